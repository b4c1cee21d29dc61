"""The number a model cares about: N attention layers inside one `jax.jit`, decode and prefill.

    python bench/stack.py --size flash --json $OUT/stack.json                 # the H200 run
    python bench/stack.py --size tiny --quick --json /tmp/stack.json          # seconds, CPU smoke
    python bench/run.py --scenarios stack_decode,stack_prefill ...            # the same, via run.py
    python bench/stack.py --render bench/results/<run>.json                   # tables of a past run

What is timed is the raw compiled step of a *stack*: ``h = h + attention_step(layer_i, h)``
for each layer, all in one program (residual adds keep the layers sequential), the caches
donated, no module call (that overhead is measured separately: ``--call-overhead``; alone,
without the stacks: ``--call-overhead-only --steps 200 --repeats 5``). Stacks:

``mixed``  the first N compressed layers of the config in model order: V4-Flash's interleaving
           CSA, HCA, CSA, HCA, ... (N = 4 by default); ``layer_type`` "CSA+HCA".
``csa``    N CSA layers; ``hca``: N HCA layers (the per-type numbers of the issue's targets).

Scenarios (records ``scenario``):

``stack_decode``   one new token per row, B in ``--batches`` (1, 8, 32) at contexts in
                   ``--contexts`` (2k, 16k, 64k). The caches start *synthetic*: every leaf drawn
                   at random, ``length`` = context. Decoding from a random cache costs what
                   decoding from a prefilled one costs (same shapes, same gathers; the indexer's
                   picks are different but as many), and it takes seconds where prefilling 64k
                   tokens x 32 rows x N layers would take minutes. Each repeat runs ``steps``
                   steps back to back (as a model's decode loop does: dispatch overlaps the
                   device) and is timed as a whole; ``per_layer_ms`` = median over repeats of
                   (repeat time / steps / N). ``step_ms_blocking`` times single steps with a
                   block after each (includes the dispatch latency); ``host_dispatch_ms`` is the
                   host's time per step to dispatch a repeat (near ``step_ms``: host-bound).
                   ``--same-buffers positions``: the timed steps take no positions argument
                   (each row's next position is its cache length); ``--same-buffers all``: also
                   the last step's output as their hidden states, donated: the same argument and
                   output buffers every step.
``stack_prefill``  one prompt of L tokens (``--prefills``: 4k, 16k) into empty caches, B = 1;
                   median over repeats of whole calls.

``floor_ms`` is per layer, the mean over the stack's layers of `bench/floor.py`'s floor (the
same model as `bench/run.py`: bytes floor for decode, max(bytes, FLOPs) for prefill), and
``ratio_to_floor`` = per_layer_ms / floor_ms. Compile time is measured apart (``compile_s``,
the first call) and never part of a timing.

``--profile ITEM[,ITEM]``: also trace steps with JAX's profiler (command buffers kept on) and
record the device time per XLA operation (`bench/kernel_profile.py`) under ``meta["profiles"]``.
An ITEM is ``B:CTX`` (decode of the mixed stack at batch B from context CTX), ``prefill:LEN``
(a prefill of LEN tokens at B = 1 into empty caches), either prefixed by another stack of
``--stacks`` (``hca/32:16384``, ``csa/prefill:4096``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import functools
import hashlib
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if "--profile" in " ".join(sys.argv):  # must be in XLA_FLAGS before the backend starts
    from bench.kernel_profile import PROFILING_FLAG

    if PROFILING_FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + PROFILING_FLAG).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import floor as floor_mod  # noqa: E402
from bench import measure, report  # noqa: E402
from bench import plan as plan_mod  # noqa: E402
from dsv4_jax import numerics as numerics_mod  # noqa: E402
from dsv4_jax.cache.quantized import check_kv_cache_dtype  # noqa: E402
from dsv4_jax.config import CSA, HCA  # noqa: E402
from dsv4_jax.ops.kernel_plan import KernelPlan, as_kernel_plan  # noqa: E402
from dsv4_jax.step import finite_flag  # noqa: E402
from dsv4_jax.step import overlap as overlap_mod  # noqa: E402
from dsv4_jax.step import pure_step as step_mod  # noqa: E402
from dsv4_jax.tools.demo import stack_step  # noqa: E402

STACKS = {"mixed": (CSA, HCA), "csa": (CSA,), "hca": (HCA,)}
FLOOR_LAYER = {CSA: "csa", HCA: "hca"}


# ---------------------------------------------------------------------------- the stack
def stack_config(size: str, n: int):
    """The size's config, with V4-Flash's interleaving extended where it has too few layers
    (the tiny and small configs have one layer of each type)."""
    cfg = plan_mod.config_for(size)
    if min(cfg.layer_types.count(CSA), cfg.layer_types.count(HCA)) < n:
        cfg = dataclasses.replace(cfg, layer_types=cfg.layer_types[:1] + (CSA, HCA) * n)
    return cfg


def stack_layer_indices(cfg, kind: str, n: int) -> list[int]:
    """The first `n` layers of the config whose type belongs to the stack `kind`, in model order."""
    idx = [i for i, t in enumerate(cfg.layer_types) if t in STACKS[kind]]
    if len(idx) < n:
        raise ValueError(f"--layers-per-stack: the config has {len(idx)} layers of stack {kind!r}, asked for {n}")
    return idx[:n]


# The stack's step is the demo's (`dsv4_jax.tools.demo.stack_step`: ``h = h + attention(layer_i, h)``
# over the layers, one program); here its jitted variants, per overlap (`dsv4_jax.step.overlap`: the
# compile options of concurrent command buffers or not; a stack runs those of its layers' plans):
# None: positions an argument, the caches donated.
# `--same-buffers`: `stack_step` of one new token a row at each row's next position, each
# layer's from its cache length (``positions=None``, `dsv4_jax.cache.contiguous.next_positions`): no
# positions argument, so no new argument buffer a step. XLA re-records a CUDA graph's commands
# whenever a buffer they use moved (`command_buffer::update`); these steps show what that costs
# the host. "positions": the positions from the caches (the output is still a new buffer);
# "all": the hidden states donated too (as `dsv4_jax.tools.demo.stack_decode_step`), so a loop feeding
# each step the last one's output gets it back in the same buffer: every argument and output
# the same buffer every step.
stack_step_own_positions = functools.partial(stack_step, positions=None)


def _stack_steps(overlap: bool) -> dict:
    jit = functools.partial(jax.jit, static_argnames=("specs",),
                            compiler_options=overlap_mod.compiler_options(overlap))
    return {None: jit(stack_step, donate_argnames=("caches",)),
            "positions": jit(stack_step_own_positions, donate_argnames=("caches",)),
            "all": jit(stack_step_own_positions, donate_argnames=("caches", "hidden_states"))}


STACK_STEPS = {overlap: _stack_steps(overlap) for overlap in (False, True)}


class Stack:
    """The layers of one stack (random weights, as `bench/run.py`'s), their specs and weights."""

    def __init__(self, cfg, kind: str, n: int, dtype, seed: int, mode: str, fused: bool = True, kernel_args=None,
                 overlap: str = "auto", numerics: str = "reference", kv_cache_dtype: str = "auto"):
        """`kernel_args`: the command line, whose A/B switches change the mode's kernel plan
        (`kernel_plan`); `overlap`: the layers' setting (`set_overlap`); `numerics`: the layers'
        (`dsv4_jax.numerics`); `kv_cache_dtype`: the caches' format ("auto", "fp8": official
        numerics only; `dsv4_jax.cache.quantized`), which the floor's cache bytes follow."""
        self.cfg, self.kind, self.dtype = cfg, kind, jnp.dtype(dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.indices = stack_layer_indices(cfg, kind, n)
        self.layers = []
        for i in self.indices:
            attn = measure.build_layer(cfg, i, self.dtype, seed + i)
            plan_mod.apply_mode(attn, mode)
            attn.numerics = numerics
            if kernel_args is not None:
                attn.kernels = kernel_plan(kernel_args, attn.kernels)
            self.layers.append(attn)
        self.set_overlap(overlap)
        # What the module call hands the step (input projections fused), or the parameters alone.
        self.weights = [a.step_weights() if fused else a.weights() for a in self.layers]
        self.weight_bytes = [measure.weight_bytes(a) for a in self.layers]
        types = [a.layer_type for a in self.layers]
        self.layer_type = "+".join(plan_mod.SHORT[t] for t in dict.fromkeys(types))

    def set_overlap(self, overlap: str) -> None:
        """The layers' `overlap` setting ("auto", "on", "off"): their specs, and the stack's jitted
        steps (`jits`, their compile options those of the layers' resolved plans)."""
        for attn in self.layers:
            attn.overlap = overlap
        self.overlap = overlap
        self.specs = tuple(a.step_spec() for a in self.layers)
        self.overlap_active = any(spec.plan.overlap for spec in self.specs)
        self.jits = STACK_STEPS[self.overlap_active]

    def empty_caches(self, batch: int, max_seq_len: int, page_size: int | None = None):
        # allow_long_context: a decode from a context of max_position_embeddings tokens needs a
        # few slots past it (the steps timed, rounded up); the cost is what is measured here.
        # page_size: paged caches (`dsv4_jax.cache.paged`), no page held yet.
        return [a.init_cache(batch, max_seq_len, allow_long_context=True, kv_cache_dtype=self.kv_cache_dtype,
                             page_size=page_size).replace(layer_idx=-1) for a in self.layers]

    def synthetic_caches(self, batch: int, max_seq_len: int, context: int, seed: int):
        """Caches as after `context` tokens: every leaf random (see the module docstring)."""
        key = jax.random.PRNGKey(seed)
        out = []
        for cache in self.empty_caches(batch, max_seq_len):
            leaves, tree = jax.tree.flatten(cache.replace(length=None))
            keys = jax.random.split(key, len(leaves) + 1)
            key = keys[0]
            leaves = [_random_leaf(k, x) for k, x in zip(keys[1:], leaves)]
            filled = jax.tree.unflatten(tree, leaves)
            out.append(filled.replace(length=jnp.full((batch,), context, jnp.int32)))
        return jax.block_until_ready(out)

    def floor(self, batch: int, start: int, new_tokens: int) -> dict:
        """The per-layer floor: the mean of the layers' floors (bench/floor.py)."""
        floors = [floor_mod.floor(self.cfg, FLOOR_LAYER[a.layer_type], batch, start, new_tokens, wb,
                                  self.dtype.itemsize, kv_cache_dtype=self.kv_cache_dtype)
                  for a, wb in zip(self.layers, self.weight_bytes)]
        return {"floor_ms": float(np.mean([f["floor_ms"] for f in floors])),
                "floor_bytes": float(np.mean([f["floor_bytes"] for f in floors])),
                "floor_flops": float(np.mean([f["floor_flops"] for f in floors])),
                "floor_bound": "/".join(sorted({f["floor_bound"] for f in floors}))}


def _random_leaf(key, like):
    """A random array shaped like a cache leaf: normal values, or for an FP8 cache's scale bytes
    (uint8) exponents near 2**0 (`dsv4_jax.cache.quantized`)."""
    if like.dtype == jnp.uint8:
        return jax.random.randint(key, like.shape, 120, 128, jnp.int32).astype(jnp.uint8)
    return jax.random.normal(key, like.shape, jnp.float32).astype(like.dtype)


def _round_up(n: int, to: int = 128) -> int:
    return max(to, int(math.ceil(n / to) * to))


def _hidden(cfg, batch: int, seq: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((batch, seq, cfg.hidden_size), dtype=np.float32)).astype(dtype)


def _positions(batch: int, start: int, n: int):
    return jnp.asarray(np.broadcast_to(np.arange(start, start + n, dtype=np.int32), (batch, n)))


# ---------------------------------------------------------------------------- timings
def timed_steps(step, steps: int, repeats: int, n_layers: int) -> tuple[dict, object]:
    """Time a decode loop: `repeats` repeats of `steps` calls of ``step()`` back to back (each
    dispatches one step and returns what it made; dispatch overlaps the device, as in a model's
    decode loop), each repeat timed as a whole, then `steps` single calls with a block after each.
    (The timing fields of a record, the last call's result.) ``per_layer_ms`` = median over
    repeats of (repeat time / steps / `n_layers`)."""
    per_step, dispatched = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = step()
        dispatched.append((time.perf_counter() - t0) / steps)
        jax.block_until_ready(out)
        per_step.append((time.perf_counter() - t0) / steps)
    blocking = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = step()
        jax.block_until_ready(out)
        blocking.append(time.perf_counter() - t0)
    step_ms = 1e3 * float(np.median(per_step))
    return {"step_ms": step_ms, "per_layer_ms": step_ms / n_layers,
            "per_layer_ms_repeats": [1e3 * t / n_layers for t in per_step],
            "step_ms_blocking": 1e3 * float(np.median(blocking)),
            # The host's time to hand the device a step (the dispatch loop, before the block):
            # near step_ms, the host and not the device sets the pace of the pipelined steps.
            "host_dispatch_ms": 1e3 * float(np.median(dispatched))}, out


def time_decode(stack: Stack, batch: int, context: int, steps: int, repeats: int, seed: int,
                same_buffers: str | None = None) -> dict:
    """Decode timings of the stack at (batch, context); see the module docstring. With
    `same_buffers` ("positions" or "all") the timed steps are `stack.jits`'s,
    ("all") each fed the last one's output."""
    warm = 2
    # warm-up, (same buffers: one more compile,) pipelined repeats, one blocking repeat
    total = warm + int(bool(same_buffers)) + repeats * steps + steps
    max_seq_len = _round_up(context + total)
    caches = stack.synthetic_caches(batch, max_seq_len, context, seed)
    x = _hidden(stack.cfg, batch, 1, stack.dtype, seed)
    pos = context
    clock = measure.compile_clock()
    clock.start()
    t0 = time.perf_counter()
    for _ in range(warm):
        h, caches = stack.jits[None](stack.weights, caches, x, _positions(batch, pos, 1), specs=stack.specs)
        pos += 1
    jax.block_until_ready((h, caches))
    first_s = time.perf_counter() - t0
    compile_s = clock.stop()
    positions = [_positions(batch, context + i, 1) for i in range(total)]  # uploaded before timing
    jax.block_until_ready(positions)
    fed = [x + 0]  # same_buffers "all": the hidden states the next step takes (and donates)

    def step(caches, at):
        if not same_buffers:
            return stack.jits[None](stack.weights, caches, x, positions[at - context], specs=stack.specs)
        if same_buffers == "positions":
            return stack.jits["positions"](stack.weights, caches, x, specs=stack.specs)
        h, caches = stack.jits["all"](stack.weights, caches, fed.pop(), specs=stack.specs)
        fed.append(h)
        return h, caches

    if same_buffers:  # compiled before the clock starts, like the step above
        h, caches = step(caches, pos)
        pos += 1
        jax.block_until_ready((h, caches))
    state = {"caches": caches, "pos": pos}

    def next_step():
        h, state["caches"] = step(state["caches"], state["pos"])
        state["pos"] += 1
        return h, state["caches"]

    timings, (h, caches) = timed_steps(next_step, steps, repeats, len(stack.layers))
    finite = bool(jnp.all(jnp.isfinite(h)))
    memory = compiled_memory(stack, "all" if same_buffers == "all" else same_buffers, stack.weights, caches,
                             fed[-1] if same_buffers == "all" else x,
                             None if same_buffers else positions[0])
    return {**timings,
            "compile_s": compile_s, "first_call_s": first_s, "max_seq_len": max_seq_len,
            "steps": steps, "repeats": repeats, "output_finite": finite, "output_digest": digest(h), **memory,
            **stack.floor(batch, context + warm + repeats * steps // 2, 1)}


def digest(x) -> str:
    """A short hash of an array's bytes: runs that should agree bit for bit (the overlap A/B:
    same inputs, same number of steps) record equal digests."""
    return hashlib.sha256(np.asarray(x).tobytes()).hexdigest()[:16]


def compiled_memory(stack: Stack, jit_key, weights, caches, x, positions) -> dict:
    """XLA's buffer sizes of the stack's compiled step for these arguments (`memory_analysis`
    of the executable the timed calls ran, from jax's compile cache: no second compile where
    the cache has it): ``temp_bytes`` (the step's scratch), ``argument_bytes``, ``output_bytes``;
    empty where the backend reports none."""
    args = (weights, caches, x) if jit_key in ("positions", "all") else (weights, caches, x, positions)
    try:
        analysis = stack.jits[jit_key].lower(*args, specs=stack.specs).compile().memory_analysis()
    except Exception:  # a backend without the analysis
        return {}
    if analysis is None:
        return {}
    return {"temp_bytes": int(analysis.temp_size_in_bytes), "argument_bytes": int(analysis.argument_size_in_bytes),
            "output_bytes": int(analysis.output_size_in_bytes)}


def time_prefill(stack: Stack, batch: int, length: int, repeats: int, seed: int, chunk=None,
                 memory_bytes: float | None = None) -> dict:
    """Prefill timings: one prompt of `length` tokens into empty caches, whole calls.

    `chunk` (``--prefill-chunk``): None, the prompt as one call of the stack's step; an int, or
    "auto" (`dsv4_jax.tools.long_context.prefill_chunk_size` within `memory_bytes`, default the
    device's free memory once the caches exist): the prompt as consecutive calls of that many
    tokens (`time_chunked_prefill`). Both record the device's memory (`prefill_memory_record`).
    """
    if chunk is not None:
        return time_chunked_prefill(stack, batch, length, repeats, seed, chunk, memory_bytes)
    max_seq_len = _round_up(length)
    x = _hidden(stack.cfg, batch, length, stack.dtype, seed)
    pos = _positions(batch, 0, length)
    clock = measure.compile_clock()
    clock.start()
    t0 = time.perf_counter()
    h, _ = stack.jits[None](stack.weights, stack.empty_caches(batch, max_seq_len), x, pos, specs=stack.specs)
    jax.block_until_ready(h)
    first_s = time.perf_counter() - t0
    compile_s = clock.stop()
    times = []
    for _ in range(repeats):
        caches = jax.block_until_ready(stack.empty_caches(batch, max_seq_len))
        t0 = time.perf_counter()
        h, caches = stack.jits[None](stack.weights, caches, x, pos, specs=stack.specs)
        jax.block_until_ready((h, caches))
        times.append(time.perf_counter() - t0)
        del caches
    n = len(stack.layers)
    step_ms = 1e3 * float(np.median(times))
    return {"step_ms": step_ms, "per_layer_ms": step_ms / n, "per_layer_ms_repeats": [1e3 * t / n for t in times],
            "compile_s": compile_s, "first_call_s": first_s, "max_seq_len": max_seq_len, "repeats": repeats,
            "output_finite": bool(jnp.all(jnp.isfinite(h))), "output_digest": digest(h),
            **stack.floor(batch, 0, length),
            "chunk": None, **prefill_memory_record()}


def prefill_memory_record(before: dict | None = None) -> dict:
    """The device's memory for a prefill record (None where it reports none, as XLA:CPU):
    ``peak_bytes_in_use`` is its peak since the process started (JAX has no reset), so it is
    the prefill's own only where the prefill is the largest thing the process ran: for that,
    one stack and one prompt length a run (``--stacks csa --scenarios stack_prefill --prefills N``).
    ``bytes_in_use_before``: in use before the timed calls (weights and caches)."""
    stats = jax.devices()[0].memory_stats() or {}
    return {"peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit"),
            "bytes_in_use_before": (before or {}).get("bytes_in_use")}


def prefill_chunk_for(stack: Stack, batch: int, length: int, max_seq_len: int, chunk,
                      memory_bytes: float | None = None) -> tuple[int, dict]:
    """(tokens per call, record fields) for ``--prefill-chunk``: an int as given (at most the
    prompt), or "auto": `long_context.prefill_chunk_size` for the stack's layers (their types,
    dtype, query block, indexer path; caches donated, residual stream carried) within
    `memory_bytes`, default `long_context.available_memory_bytes()` (call it once the caches
    exist: their memory is then no longer free)."""
    from dsv4_jax.tools import long_context

    layer_types = [a.layer_type for a in stack.layers]
    options = dict(query_block=max(a.query_block for a in stack.layers), donated=True, residual=True,
                   xla_scores=any(long_context.indexer_scores_by_xla(a) for a in stack.layers))
    budget = None
    if chunk == "auto":
        budget = int(memory_bytes) if memory_bytes is not None else long_context.available_memory_bytes()
        chunk = long_context.prefill_chunk_size(stack.cfg, layer_types, batch, budget, stack.dtype,
                                                max_seq_len=max_seq_len, at_most=length, **options)
    chunk = min(int(chunk), length)
    estimate = long_context.prefill_chunk_bytes(stack.cfg, layer_types, batch, chunk, max_seq_len, stack.dtype,
                                                **options)
    return chunk, {"chunk": chunk, "chunk_auto": budget is not None, "memory_budget_bytes": budget,
                   "chunk_estimate_bytes": estimate}


def time_chunked_prefill(stack: Stack, batch: int, length: int, repeats: int, seed: int, chunk,
                         memory_bytes: float | None = None) -> dict:
    """A prompt of `length` tokens into empty caches as consecutive calls of the stack's compiled
    step of `chunk` tokens (the last one shorter; one compile per chunk length), timed as a whole:
    ``step_ms`` is the whole prompt's time, ``per_layer_ms`` = step_ms / N layers, ``floor_ms`` the
    sum of the chunks' floors (per layer; every chunk reads the weights again).

    The chunks' hidden states are one random [B, chunk, hidden] block (and one of the last
    chunk's length), made before the clock and fed to every chunk: a 1M-token input would take
    device memory the prefill itself does not need (a model embeds each chunk's tokens as it
    goes). The caches are donated from call to call, as in a model's chunked prefill."""
    from dsv4_jax.cache.contiguous import cache_nbytes

    max_seq_len = _round_up(length)
    caches = jax.block_until_ready(stack.empty_caches(batch, max_seq_len))
    chunk, chunk_record = prefill_chunk_for(stack, batch, length, max_seq_len, chunk, memory_bytes)
    bounds = [(start, min(chunk, length - start)) for start in range(0, length, chunk)]
    xs = {n: _hidden(stack.cfg, batch, n, stack.dtype, seed) for n in sorted({n for _, n in bounds})}
    positions = jax.block_until_ready([_positions(batch, start, n) for start, n in bounds])
    cache_bytes = sum(cache_nbytes(c) for c in caches)
    before = jax.devices()[0].memory_stats() or {}

    def run(caches):
        for (_, n), pos in zip(bounds, positions):
            h, caches = stack.jits[None](stack.weights, caches, xs[n], pos, specs=stack.specs)
        return jax.block_until_ready((h, caches))

    clock = measure.compile_clock()
    clock.start()
    t0 = time.perf_counter()
    h, caches = run(caches)
    first_s = time.perf_counter() - t0
    compile_s = clock.stop()
    del caches
    times = []
    for _ in range(repeats):
        caches = jax.block_until_ready(stack.empty_caches(batch, max_seq_len))
        t0 = time.perf_counter()
        h, caches = run(caches)
        times.append(time.perf_counter() - t0)
        del caches
    n_layers = len(stack.layers)
    step_ms = 1e3 * float(np.median(times))
    return {"step_ms": step_ms, "per_layer_ms": step_ms / n_layers,
            "per_layer_ms_repeats": [1e3 * t / n_layers for t in times], "compile_s": compile_s,
            "first_call_s": first_s, "max_seq_len": max_seq_len, "repeats": repeats, "chunks": len(bounds),
            "output_finite": bool(jnp.all(jnp.isfinite(h))), "cache_bytes": cache_bytes,
            **chunked_floor(stack, batch, bounds), **chunk_record, **prefill_memory_record(before)}


def chunked_floor(stack: Stack, batch: int, bounds: list) -> dict:
    """The per-layer floor of a prompt run as the calls `bounds` [(start, tokens)]: the sum of
    the calls' floors (`Stack.floor`)."""
    floors = [stack.floor(batch, start, n) for start, n in bounds]
    out = {key: float(sum(f[key] for f in floors)) for key in ("floor_ms", "floor_bytes", "floor_flops")}
    out["floor_bound"] = "/".join(sorted({b for f in floors for b in f["floor_bound"].split("/")}))
    return out


def profile_decode(stack: Stack, batch: int, context: int, steps: int, seed: int, log_dir: str) -> dict:
    """Device time per XLA operation of the stack's decode step (bench/kernel_profile.py)."""
    from bench import kernel_profile

    max_seq_len = _round_up(context + steps + 8)
    state = {"caches": stack.synthetic_caches(batch, max_seq_len, context, seed), "pos": context}
    x = _hidden(stack.cfg, batch, 1, stack.dtype, seed)

    def run_once():
        h, state["caches"] = stack.jits[None](stack.weights, state["caches"], x, _positions(batch, state["pos"], 1),
                                        specs=stack.specs)
        state["pos"] += 1
        jax.block_until_ready(h)

    summary = kernel_profile.profile(run_once, steps, log_dir, module_filter="stack_step")
    compiled = stack.jits[None].lower(stack.weights, state["caches"], x, _positions(batch, state["pos"], 1),
                                specs=stack.specs).compile()
    kernel_profile.attach_sources(summary, compiled.as_text())
    summary.update({"stack": stack.kind, "layer_type": stack.layer_type, "n_layers": len(stack.layers),
                    "batch": batch, "context_len": context})
    return summary


def profile_prefill(stack: Stack, length: int, steps: int, seed: int, log_dir: str) -> dict:
    """Device time per XLA operation of the stack's prefill of `length` tokens at B = 1."""
    from bench import kernel_profile

    max_seq_len = _round_up(length)
    x = _hidden(stack.cfg, 1, length, stack.dtype, seed)
    pos = _positions(1, 0, length)

    def run_once():
        h, _ = stack.jits[None](stack.weights, stack.empty_caches(1, max_seq_len), x, pos, specs=stack.specs)
        jax.block_until_ready(h)

    summary = kernel_profile.profile(run_once, steps, log_dir, module_filter="stack_step")
    compiled = stack.jits[None].lower(stack.weights, stack.empty_caches(1, max_seq_len), x, pos,
                                specs=stack.specs).compile()
    kernel_profile.attach_sources(summary, compiled.as_text())
    summary.update({"stack": stack.kind, "layer_type": stack.layer_type, "n_layers": len(stack.layers),
                    "batch": 1, "context_len": None, "prompt_len": length, "scenario": "stack_prefill"})
    return summary


def profile_items(spec: str | None) -> list:
    """``--profile`` items as (stack, scenario, batch, length): ``B:CTX``, ``prefill:LEN``,
    optionally ``STACK/`` first (default: the mixed stack)."""
    items = []
    for item in (spec or "").split(","):
        if not item:
            continue
        kind, _, shape = item.rpartition("/")
        head, _, length = shape.partition(":")
        if head == "prefill":
            items.append((kind or "mixed", "stack_prefill", 1, int(length)))
        else:
            items.append((kind or "mixed", "stack_decode", int(head), int(length)))
    return items


@contextlib.contextmanager
def _finite_verdict(mode):
    """`finite_flag.VERDICT` for the calls of `call_overhead`'s layer `mode`: "flag" and "guard"
    for its layers of those ways, as it was for the others (restored after)."""
    before = finite_flag.VERDICT
    finite_flag.VERDICT = mode if mode in ("flag", "guard") else before
    try:
        yield
    finally:
        finite_flag.VERDICT = before


def call_overhead(size: str, dtype, steps: int, repeats: int, seed: int) -> dict:
    """The module call against `jax.jit(attention_step)` on one CSA decode step (same inputs).

    Both run the same compiled executable; the module call adds its input checks, parameter
    gathering and host length mirror. Medians over `repeats` x `steps` single blocked calls.
    The module call is timed with each finite-check mode (`check_finite` True, the default:
    ``module_call_ms``; "host": ``module_call_host_check_ms``; False: ``module_call_no_check_ms``;
    one layer of equal weights and its own cache each), interleaved with the jitted step at the
    same positions, so that the check's share shows; ``max_abs_diff``: the largest difference of
    the last step's outputs from the jitted step's. The layers keep the module's default,
    ``donate_cache=False`` (the jitted step then does not donate either): a donating layer
    checks device inputs before dispatch (`validation.finite_deferred`), a separate round trip.
    Two more layers check with each way of the verdict (`dsv4_jax.step.finite_flag`): written by the
    step itself (``finite_flag.VERDICT = "flag"``): ``module_call_flag_ms``, ``flag_words`` the
    words it read (0 where the input is checked on the host, as on a CPU, or the native
    extension is missing); by the program before the step (``"guard"``): ``module_call_guard_ms``;
    ``finite_verdict_auto``: which of them the default (``module_call_ms``) uses for device inputs."""
    cfg = plan_mod.config_for(size)
    layer_idx = plan_mod.layer_index(cfg, "csa")
    batch, context = 1, 64
    x = _hidden(cfg, batch, context, jnp.dtype(dtype), seed)
    xs = _hidden(cfg, batch, 1, jnp.dtype(dtype), seed + 1)
    max_seq_len = _round_up(context + repeats * steps + 8)
    layers, caches, times = {}, {}, {}
    for mode in (True, "host", False, "flag", "guard"):
        attn = layers[mode] = measure.build_layer(cfg, layer_idx, dtype, seed)
        attn.break_mode, attn.donate_cache, times[mode] = "none", False, []
        attn.check_finite = True if mode in ("flag", "guard") else mode
        with _finite_verdict(mode):
            _, caches[mode] = attn(x, np.broadcast_to(np.arange(context, dtype=np.int32), (batch, context)),
                                   attn.init_cache(batch, max_seq_len))
    with _finite_verdict("flag"):  # the flag's slot, where the prefill used it
        slot = finite_flag.slot_for(xs)
    flag_words = 0  # the words the "flag" layer's calls read (the default layer may share the slot)
    attn = layers[True]
    spec = attn.step_spec()
    step = step_mod.step_for(spec, attn.donate_cache)
    raw_cache = measure.clone(caches[True]).replace(length=jnp.asarray(caches[True].length), layer_idx=-1)
    weights = attn.step_weights()
    raw_t, outs = [], {}
    for i in range(repeats * steps):
        p = np.full((batch, 1), context + i, np.int32)
        for mode, layer in layers.items():
            word = None if slot is None else slot.last
            with _finite_verdict(mode):
                t0 = time.perf_counter()
                outs[mode], caches[mode] = layer(xs, p, caches[mode])
                jax.block_until_ready(outs[mode])
                times[mode].append(time.perf_counter() - t0)
            if mode == "flag" and word is not None and slot.last is not None:
                flag_words += slot.last - word
        t0 = time.perf_counter()
        out, raw_cache, _ = step(weights, raw_cache, xs, p, spec=spec)
        jax.block_until_ready(out)
        raw_t.append(time.perf_counter() - t0)
    module_ms, raw_ms = (1e3 * float(np.median(t)) for t in (times[True], raw_t))
    diff = max(float(jnp.max(jnp.abs(o.astype(jnp.float32) - out.astype(jnp.float32)))) for o in outs.values())
    return {"scenario": "call_overhead", "size": size, "layer_type": "CSA", "batch": batch, "context_len": context,
            "module_call_ms": module_ms, "jit_step_ms": raw_ms, "overhead_ms": module_ms - raw_ms,
            "module_call_host_check_ms": 1e3 * float(np.median(times["host"])),
            "module_call_no_check_ms": 1e3 * float(np.median(times[False])),
            "module_call_flag_ms": 1e3 * float(np.median(times["flag"])), "flag_words": int(flag_words),
            "module_call_guard_ms": 1e3 * float(np.median(times["guard"])),
            "finite_verdict_auto": finite_flag.AUTO,
            "ratio": module_ms / raw_ms, "samples": len(raw_t), "max_abs_diff": diff, "donate_cache": False}


# ---------------------------------------------------------------------------- the run
def environment() -> dict:
    dev = jax.devices()[0]
    import flax

    return {"device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}", "platform": dev.platform,
            "jax_version": jax.__version__, "flax_version": flax.__version__, "python": sys.version.split()[0],
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "date_utc": _dt.datetime.now(_dt.UTC).isoformat()}


# The A/B switches of the command line: stage of the plan -> (the flag forcing the kernel, its help;
# the flag forcing XLA, its help).
KERNEL_SWITCHES = {
    "decode_attention": ("decode-kernel", "the Pallas decode kernel on CUDA for every decode shape it takes "
                                          "(decode_attention = 'pallas')",
                         "no-decode-kernel", "decode attention by the XLA path on CUDA too (the layers' KernelPlan "
                                             "decode_attention = 'xla') for A/B runs against the Pallas kernel"),
    "prefill_attention": ("prefill-kernel", "the Pallas kernel on CUDA for every prefill shape it takes "
                                            "(prefill_attention = 'pallas')",
                          "no-prefill-kernel", "prefill attention by the XLA path on CUDA too "
                                               "(prefill_attention = 'xla')"),
    "compress": ("compress-kernel", "the compressor's decode pooling kernel on CUDA for every shape it takes "
                                    "(compress = 'pallas')",
                 "no-compress-kernel", "the compressor's decode pooling by the XLA path on CUDA too (compress = 'xla') "
                                       "for A/B runs"),
    "projections": ("projection-kernel", "the input and output projections of calls of at most 64 token rows by the "
                                         "Pallas kernel on CUDA (projections = 'pallas'; "
                                         "dsv4_jax.ops.projection.pallas) for A/B runs",
                    "no-projection-kernel", "the input and output projections by XLA's GEMMs (projections = 'xla'; "
                                            "the default today)"),
    "query_norm": ("query-norm-kernel", "the queries' per-head norm and RoPE by one Pallas kernel on CUDA for every "
                                        "call, decode steps too (query_norm = 'pallas'; "
                                        "dsv4_jax.ops.query_norm.pallas; "
                                        "the default: calls of several queries a row)",
                   "no-query-norm-kernel", "the queries' per-head norm and RoPE by XLA everywhere (query_norm = "
                                           "'xla') for A/B runs"),
    "split_merge": ("merge-kernel", "decode attention's key splits merged with the sink and de-rotated by one "
                                    "Pallas kernel on CUDA wherever the attention kernel splits them (split_merge = "
                                    "'pallas'; dsv4_jax.ops.sparse_attention.split_merge_pallas; the default: CSA "
                                    "calls of >= 16 rows)",
                    "no-merge-kernel", "decode attention's key splits merged by XLA everywhere (split_merge = 'xla') "
                                       "for A/B runs"),
}
KERNEL_FLAGS = {stage: (on.replace("-", "_"), off.replace("-", "_"))
                for stage, (on, _, off, _) in KERNEL_SWITCHES.items()}


def kernel_plan(args, kernels="auto") -> KernelPlan:
    """`kernels` (a mode's name or plan) with the command line's A/B switches: --(no-)decode-kernel,
    --(no-)prefill-kernel, --(no-)compress-kernel, --(no-)projection-kernel, --(no-)query-norm-kernel,
    --(no-)merge-kernel ("pallas" / "xla" for that stage), --decode-blocks
    and --prefill-blocks (the kernel's blocks wherever it runs for that phase), --select-segments
    (blocks a row of the native top-k), --select-keys and --select-scores (how the native
    selection reads an FP8 cache's keys, and whose scores its top-k picks from)."""
    plan = as_kernel_plan(kernels)
    changes = {}
    for stage, (on, off) in KERNEL_FLAGS.items():
        if getattr(args, off, False):
            changes[stage] = "xla"
        elif getattr(args, on, False):
            changes[stage] = "pallas"
    for phase in ("decode", "prefill"):
        blocks = getattr(args, f"{phase}_blocks", None)
        if blocks:  # bk,bh,warps,stages[,skip]
            changes[f"{phase}_blocks"] = tuple(int(v) for v in blocks.split(","))
    if getattr(args, "select_segments", None):
        changes["select_segments"] = args.select_segments
    if getattr(args, "select_keys", None):
        changes["select_keys"] = args.select_keys
    if getattr(args, "select_scores", None):
        changes["select_scores"] = args.select_scores
    return dataclasses.replace(plan, **changes)


def run(args, write=None) -> tuple[list, dict]:
    cfg = stack_config(args.size, args.layers_per_stack)
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    env = environment()
    meta = {"size": args.size, "dtype": dtype.name, "argv": sys.argv[1:], "n_layers": args.layers_per_stack,
            "stacks": args.stacks, "same_buffers": args.same_buffers,
            "kernels": {mode: dataclasses.asdict(kernel_plan(args, plan_mod.MODE_SETTINGS[mode]["kernels"]))
                        for mode in args.modes.split(",")},
            "fused_input_projections": not getattr(args, "unfused_projections", False), **env}
    records: list[dict] = []
    scenarios = args.scenarios.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    prefills = [int(p) for p in args.prefills.split(",")] if args.prefills else []
    overlaps = [overlap_mod.check_overlap(v) for v in args.overlap.split(",")]
    kv_dtypes = [check_kv_cache_dtype(v) for v in args.kv_cache_dtype.split(",")]
    if "fp8" in kv_dtypes and args.numerics != "official":
        raise ValueError("--kv-cache-dtype: fp8 caches hold the official numerics' rounding; expected "
                         f"--numerics official, got --numerics {args.numerics}")
    for mode in ([] if args.call_overhead_only else args.modes.split(",")):
        for kind in args.stacks.split(","):
            stack = Stack(cfg, kind, args.layers_per_stack, dtype, args.seed, mode,
                          fused=not getattr(args, "unfused_projections", False), kernel_args=args,
                          numerics=args.numerics)
            base = {"size": args.size, "stack": kind, "layer_type": stack.layer_type, "n_layers": len(stack.layers),
                    "layer_indices": stack.indices, "mode": mode, "dtype": dtype.name,
                    "native_select": stack.specs[0].plan.native_select if CSA in STACKS[kind] else None,
                    "weight_bytes_per_layer": float(np.mean(stack.weight_bytes)), **env}
            jobs = []
            if "stack_decode" in scenarios:
                jobs += [("stack_decode", b, c) for c in contexts for b in batches]
            if "stack_prefill" in scenarios:
                jobs += [("stack_prefill", 1, p) for p in prefills]
            for scenario, batch, length, overlap, kv in [(*job, ov, kv) for job in jobs for ov in overlaps
                                                          for kv in kv_dtypes]:
                stack.set_overlap(overlap)
                stack.kv_cache_dtype = kv
                rec = {"scenario": scenario, "batch": batch,
                       "context_len": length if scenario == "stack_decode" else None,
                       "prompt_len": length if scenario == "stack_prefill" else None, **base,
                       "overlap": overlap, "overlap_active": stack.overlap_active, "numerics": args.numerics,
                       "kv_cache_dtype": kv, "error": None}
                try:
                    if scenario == "stack_decode":
                        rec.update(time_decode(stack, batch, length, args.steps, args.repeats, args.seed,
                                               same_buffers=args.same_buffers))
                    else:
                        rec.update(time_prefill(stack, batch, length, max(1, args.repeats), args.seed,
                                                chunk=getattr(args, "prefill_chunk", None),
                                                memory_bytes=getattr(args, "prefill_memory", None)))
                    rec["ratio_to_floor"] = rec["per_layer_ms"] / rec["floor_ms"] if gpu else None
                except Exception as err:
                    rec["error"] = report.error_text(err)
                records.append(rec)
                print(_line(rec), file=sys.stderr, flush=True)
                if write:
                    write(records, meta)
            for p_kind, p_scenario, b, c in profile_items(args.profile):
                if p_kind != kind:
                    continue
                meta.setdefault("profiles", [])
                where = os.path.join(args.profile_dir, f"{mode}_{kind}_{p_scenario}_B{b}_L{c}")
                try:
                    if p_scenario == "stack_decode":
                        prof = profile_decode(stack, b, c, args.profile_steps, args.seed, where)
                    else:
                        prof = profile_prefill(stack, c, max(2, args.profile_steps // 4), args.seed, where)
                    prof["mode"] = mode
                    meta["profiles"].append(prof)
                except Exception as err:
                    meta["profiles"].append({"mode": mode, "stack": kind, "scenario": p_scenario, "batch": b,
                                             "context_len": c, "error": report.error_text(err)})
                if write:
                    write(records, meta)
            del stack
    if args.call_overhead or args.call_overhead_only:
        records.append({**call_overhead(args.call_overhead_size, dtype if gpu else jnp.float32, args.steps,
                                        max(args.repeats, 3), args.seed), **env})
        print(_line(records[-1]), file=sys.stderr, flush=True)
    return records, meta


def _line(rec: dict) -> str:
    if rec.get("scenario") == "call_overhead":
        return (f"call_overhead {rec['size']}: module {rec['module_call_ms']:.3f} ms, jit step "
                f"{rec['jit_step_ms']:.3f} ms, ratio {rec['ratio']:.2f}")
    if rec.get("error"):
        return f"{rec['scenario']} {rec['stack']} B{rec['batch']}: ERROR {rec['error']}"
    length = rec["context_len"] or rec["prompt_len"]
    ratio = rec.get("ratio_to_floor")
    return (f"{rec['scenario']} {rec['mode']} {rec['stack']} B{rec['batch']} L{length}: "
            f"{rec['per_layer_ms']:.3f} ms/layer (floor {rec['floor_ms']:.3f}"
            + (f", x{ratio:.1f}" if ratio else "") + f"), compile {rec['compile_s']:.1f} s"
            + (f", host {rec['host_dispatch_ms']:.3f} ms/step" if "host_dispatch_ms" in rec else ""))


def markdown(records: list, meta: dict) -> str:
    """Tables of a run: per-layer time, floor and ratio per stack and shape, then the profiles."""
    out = [f"Stack of {meta.get('n_layers')} layers in one jax.jit, {meta.get('size')}, {meta.get('dtype')}, "
           f"{meta.get('device')}, jax {meta.get('jax_version')}", ""]
    for scenario in ("stack_decode", "stack_prefill"):
        rows = [r for r in records if r.get("scenario") == scenario]
        if not rows:
            continue
        length = "ctx" if scenario == "stack_decode" else "prompt"
        out += [f"### {scenario}", "",
                f"| mode | overlap | stack | layer types | B | {length} | ms / layer | floor ms / layer | x floor | "
                "blocking step ms | host ms / step | compile s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            overlap = r.get("overlap", "")  # records before the overlap switch have none
            if r.get("kv_cache_dtype", "auto") != "auto":
                overlap += f", {r['kv_cache_dtype']} cache"
            if r.get("error"):
                out.append(f"| {r['mode']} | {overlap} | {r['stack']} | {r['layer_type']} | {r['batch']} | "
                           f"{r['context_len'] or r['prompt_len']} | error: {r['error'][:80]} | | | | | |")
                continue
            ratio, blocking, host = (r.get(k) for k in ("ratio_to_floor", "step_ms_blocking", "host_dispatch_ms"))
            out.append(f"| {r['mode']} | {overlap} | {r['stack']} | {r['layer_type']} | {r['batch']} | "
                       f"{r['context_len'] or r['prompt_len']} | {r['per_layer_ms']:.3f} | {r['floor_ms']:.3f} | "
                       f"{'' if ratio is None else f'{ratio:.1f}'} | "
                       f"{'' if blocking is None else f'{blocking:.3f}'} | "
                       f"{'' if host is None else f'{host:.3f}'} | {r['compile_s']:.1f} |")
        out.append("")
    for r in records:
        if r.get("scenario") == "call_overhead":
            out.append(f"Module call vs `jax.jit(attention_step)` ({r['size']} CSA decode, B=1): "
                       f"{r['module_call_ms']:.3f} vs {r['jit_step_ms']:.3f} ms, ratio {r['ratio']:.2f}, "
                       f"overhead {r['overhead_ms']:.3f} ms ({r['samples']} calls each)"
                       + ("" if "module_call_host_check_ms" not in r else
                          f"; check_finite='host' {r['module_call_host_check_ms']:.3f} ms, "
                          f"False {r['module_call_no_check_ms']:.3f} ms")
                       + ("" if "module_call_flag_ms" not in r else
                          f"; the verdict by the step's flag {r['module_call_flag_ms']:.3f} ms "
                          f"({r['flag_words']} words read)")
                       + ("" if "module_call_guard_ms" not in r else
                          f", by the guard program {r['module_call_guard_ms']:.3f} ms; the default: "
                          f"the {r['finite_verdict_auto']}"))
    if meta.get("profiles"):
        from bench import kernel_profile

        for prof in meta["profiles"]:
            if prof.get("error"):
                out.append(f"profile {prof.get('stack', 'mixed')} {prof.get('scenario', 'stack_decode')} "
                           f"B{prof['batch']} L{prof['context_len']}: error {prof['error']}")
                continue
            out += ["", kernel_profile.markdown(
                prof, title=f"**Profile** ({prof['mode']}, {prof['layer_type']} x{prof['n_layers']}, "
                            f"B={prof['batch']}, " + (f"prefill {prof['prompt_len']}" if prof.get("prompt_len")
                                                      else f"ctx {prof['context_len']}") + "):")]
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=("tiny", "small", "flash"))
    ap.add_argument("--quick", action="store_true", help="one batch, one short context, few steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--modes", default="none", help="comma list of bench/plan.py modes (default: none)")
    ap.add_argument("--stacks", default="mixed,csa,hca")
    ap.add_argument("--layers-per-stack", type=int, default=4)
    ap.add_argument("--scenarios", default="stack_decode,stack_prefill")
    ap.add_argument("--batches", default=None, help="decode batches (default 1,8,32)")
    ap.add_argument("--contexts", default=None, help="decode contexts (default 2048,16384,65536)")
    ap.add_argument("--prefills", default=None, help="prefill lengths (default 4096,16384)")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per repeat (default 16)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats (default 5)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, metavar="[STACK/]B:CTX|[STACK/]prefill:LEN,...")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--profile-dir", default="/tmp/dsv4_stack_profile")
    ap.add_argument("--call-overhead", action="store_true", help="also time the module call vs the jitted step")
    ap.add_argument("--call-overhead-size", default="tiny", choices=("tiny", "small", "flash"))
    ap.add_argument("--call-overhead-only", action="store_true",
                    help="time only the module call vs the jitted step (no stacks); --steps x --repeats calls")
    ap.add_argument("--same-buffers", default=None, choices=("positions", "all"),
                    help="timed decode steps read their positions from the caches (positions), and take the "
                         "last step's output, donated (all: the same argument and output buffers every step)")
    ap.add_argument("--unfused-projections", action="store_true",
                    help="hand the step weights() (no input_proj: XLA merges the input GEMMs itself) for A/B runs")
    for on, on_help, off, off_help in KERNEL_SWITCHES.values():
        ap.add_argument(f"--{off}", action="store_true", help=off_help)
        ap.add_argument(f"--{on}", action="store_true", help=on_help)
    ap.add_argument("--prefill-blocks", default=None, metavar="BK,BH,WARPS,STAGES[,SKIP]",
                    help="blocks of every prefill the kernel runs (KernelPlan prefill_blocks); SKIP 1 = "
                         "skip_masked_blocks")
    ap.add_argument("--decode-blocks", default=None, metavar="BK,BH,WARPS,STAGES",
                    help="blocks of every decode step the kernel runs (KernelPlan decode_blocks)")
    ap.add_argument("--select-segments", default=None, type=int, metavar="P",
                    help="blocks a query row of the native CUDA top-k (KernelPlan select_segments; 1: one "
                         "block a row; default: native.topk_segments)")
    ap.add_argument("--select-keys", default=None, choices=("stored", "dequantized", "fp8"),
                    help="how the native selection reads an FP8 cache's indexer keys (KernelPlan select_keys; "
                         "default: stored, the handler dequantizes them where it loads them; fp8: with --select-scores "
                         "pallas, the Pallas kernel's e4m3 dots on FP8 tensor cores, exact under --numerics official)")
    ap.add_argument("--select-scores", default=None, choices=("native", "pallas"),
                    help="the scores the native selection's top-k picks from (KernelPlan select_scores; "
                         "default: the Pallas scoring kernel for prefill chunks on CUDA, the handler's for decode)")
    ap.add_argument("--overlap", default="auto", metavar="SETTING[,SETTING...]",
                    help="the layers' overlap (dsv4_jax.step.overlap: auto, on, off); a list runs each job once per "
                         "setting, in order, back to back (the A/B: e.g. on,off,on); records carry `overlap`")
    ap.add_argument("--numerics", default="reference", choices=numerics_mod.NUMERICS,
                    help="the layers' numerics (dsv4_jax.numerics; fp8 caches need official); records carry it")
    ap.add_argument("--kv-cache-dtype", default="auto", metavar="FORMAT[,FORMAT...]",
                    help="the caches' format (auto, fp8: dsv4_jax.cache.quantized, with --numerics official); a "
                         "list runs each job once per format, back to back (the A/B); records carry "
                         "`kv_cache_dtype`, and the floor counts the format's bytes")
    ap.add_argument("--render", default=None, metavar="JSON")
    ap.add_argument("--prefill-chunk", default=None, type=prefill_chunk_arg, metavar="N|auto",
                    help="stack_prefill as consecutive calls of N tokens (auto: the largest chunk whose estimated "
                         "memory fits the device's free memory, dsv4_jax.tools.long_context.prefill_chunk_size); "
                         "records chunk, chunks, the estimate and the device's peak memory")
    ap.add_argument("--prefill-memory", default=None, type=float, metavar="BYTES",
                    help="the budget of --prefill-chunk auto (default: the device's free memory once the caches exist)")
    return ap


def prefill_chunk_arg(value: str):
    """``--prefill-chunk``: "auto" or a positive int."""
    if value == "auto":
        return value
    try:
        chunk = int(value)
    except ValueError:
        chunk = 0
    if chunk < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'auto', got {value!r}")
    return chunk


def fill_defaults(args) -> None:
    quick = args.quick or args.size == "tiny"
    args.batches = args.batches or ("1" if quick else "1,8,32")
    args.contexts = args.contexts or ("256" if quick else "2048,16384,65536")
    args.prefills = args.prefills if args.prefills is not None else ("128" if quick else "4096,16384")
    args.steps = args.steps or (4 if quick else 16)
    args.repeats = args.repeats or (2 if quick else 5)


def main(argv=None) -> int:
    return report.scenario_main(argv, build_parser, fill_defaults, run, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
