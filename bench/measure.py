"""Timing of one case: our layer in each break mode, and the HF peer, on the same inputs.

Protocol (every implementation, every mode):

* inputs: one NumPy draw per case (seeded by the case), shared by all modes and the peer;
  converted to device arrays / tensors before any timing;
* a *sequence* starts from a snapshot (decode_pr: an empty cache; decode_long: the cache after
  the prefilled context, made once in mode ``none`` and cloned; prefill: an empty cache);
* warm-up: one untimed sequence (prompt + ``warmup_steps`` decode steps, or one prefill call);
  for our layer the XLA trace/lower/compile time of that warm-up is read from JAX's monitoring
  events (``/jax/core/compile/*_duration``) and reported as ``compile_s``;
* timed: ``repeats`` sequences from fresh copies of the snapshot; every call is timed alone
  (``perf_counter`` around the call and ``block_until_ready`` / ``cuda.synchronize``);
  decode statistics are over all timed steps of all repeats;
* the outputs of the last timed sequence are kept (host float32) to compare with mode ``none``.

Our layer is timed through its public call (`DeepseekV4Attention.__call__`: host-side input
checks, dispatch of the compiled step, donated cache); positions are host NumPy arrays.
"""

from __future__ import annotations

import dataclasses
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dsv4_jax
from dsv4_jax.step import pure_step as step_mod

from . import plan as plan_mod

# ---------------------------------------------------------------------------- compile time
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class CompileClock:
    """Sums JAX's trace + lower + backend-compile durations while `active`."""

    def __init__(self):
        self.total = 0.0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **_):
        if self.active and event in _COMPILE_EVENTS:
            self.total += float(duration)

    def start(self):
        self.total, self.active = 0.0, True

    def stop(self) -> float:
        self.active = False
        return self.total


_CLOCK: CompileClock | None = None


def compile_clock() -> CompileClock:
    global _CLOCK
    if _CLOCK is None:
        _CLOCK = CompileClock()
    return _CLOCK


# ---------------------------------------------------------------------------- inputs
@dataclasses.dataclass
class Inputs:
    """NumPy inputs of a case: hidden states and positions of every call, shared by all impls."""

    prefix: list  # decode_long: [(x [B, c, hid], pos [B, c])] chunks of the context (untimed)
    prompt: tuple | None  # decode_pr / prefill: (x [B, S, hid], pos [B, S])
    steps: list  # decode: [(x [B, 1, hid], pos [B, 1])], warm-up and timed sequences share them


def case_seed(case: plan_mod.Case, base: int) -> int:
    return (base * 1_000_003 + zlib.crc32(case.key.encode())) % (2**31)


def make_inputs(cfg, case: plan_mod.Case, base_seed: int, prefix_chunk: int) -> Inputs:
    rng = np.random.default_rng(case_seed(case, base_seed))
    b, hid = case.batch, cfg.hidden_size

    def block(start, n):
        x = rng.standard_normal((b, n, hid), dtype=np.float32)
        pos = np.broadcast_to(np.arange(start, start + n, dtype=np.int32), (b, n)).copy()
        return x, pos

    prefix, prompt, steps = [], None, []
    if case.scenario == "decode_long":
        for start in range(0, case.prompt_len, prefix_chunk):
            prefix.append(block(start, min(prefix_chunk, case.prompt_len - start)))
        first = case.prompt_len
    else:
        prompt = block(0, case.prompt_len)
        first = case.prompt_len
    if case.scenario != "prefill":
        steps = [block(first + i, 1) for i in range(max(case.steps, case.warmup_steps))]
    return Inputs(prefix, prompt, steps)


def rechunk(prefix: list, chunk: int) -> list:
    """The same context in other chunks (the peer bounds its dense attention by chunk length)."""
    if not prefix:
        return []
    x = np.concatenate([p[0] for p in prefix], axis=1)
    pos = np.concatenate([p[1] for p in prefix], axis=1)
    return [(x[:, i : i + chunk], pos[:, i : i + chunk]) for i in range(0, x.shape[1], chunk)]


# ---------------------------------------------------------------------------- our layer
def build_layer(cfg, layer_idx: int, dtype, seed: int) -> dsv4_jax.DeepseekV4Attention:
    """Our layer with default-init projections and small random sinks / position biases."""
    attn = dsv4_jax.DeepseekV4Attention(cfg, layer_idx, rngs=nnx.Rngs(seed), break_mode="none", dtype=dtype,
                                        param_dtype=dtype, donate_cache=True)
    rng = np.random.default_rng(seed + 17)
    attn.sinks[...] = jnp.asarray(rng.normal(0.0, 0.5, attn.sinks.shape), jnp.float32)
    for comp in (attn.compressor, attn.indexer.compressor if attn.indexer is not None else None):
        if comp is not None:
            comp.position_bias[...] = jnp.asarray(rng.normal(0.0, 0.1, comp.position_bias.shape), jnp.float32)
    return attn


def weight_bytes(attn) -> int:
    return int(sum(np.prod(p.shape) * p.dtype.itemsize for p in jax.tree.leaves(nnx.state(attn, nnx.Param))))


def clone(cache):
    """A deep copy of a cache (device arrays copied on device; host `length` stays NumPy)."""
    return jax.tree.map(lambda a: np.array(a, copy=True) if isinstance(a, np.ndarray) else jnp.array(a, copy=True),
                        cache)


def host_breaks(attn, x, pos, cache) -> int:
    """Host callbacks (breaks) in the lowered step for these inputs: count of Python callbacks."""
    spec = attn.step_spec()
    step = step_mod.step_for(spec, attn.donate_cache)
    text = step.lower(attn.step_weights(), cache, x, pos, spec=spec).as_text()
    return text.count("xla_ffi_python_")


class JaxRun:
    """Runs the cases of one layer in every mode; holds the layer and the snapshots."""

    def __init__(self, cfg, layer: str, dtype, seed: int, prefix_chunk: int):
        self.cfg = cfg
        self.layer = layer
        self.layer_idx = plan_mod.layer_index(cfg, layer)
        self.dtype = jnp.dtype(dtype)
        self.attn = build_layer(cfg, self.layer_idx, self.dtype, seed)
        self.prefix_chunk = prefix_chunk
        self.weight_bytes = weight_bytes(self.attn)

    def dev(self, x):
        return jnp.asarray(x).astype(self.dtype)

    def _call(self, x, pos, cache, timed=False):
        if timed:
            t0 = time.perf_counter()
            out, cache = self.attn(x, pos, cache)
            jax.block_until_ready((out, cache))
            return out, cache, time.perf_counter() - t0
        out, cache = self.attn(x, pos, cache)
        return out, cache, None

    def snapshot(self, case, inputs: Inputs, dev_inputs):
        """The cache a sequence starts from (decode_long: the prefilled context, mode none)."""
        cache = self.attn.init_cache(case.batch, case.max_seq_len)
        if case.scenario != "decode_long":
            return cache
        plan_mod.apply_mode(self.attn, "none")
        for x, pos in dev_inputs["prefix"]:
            _, cache, _ = self._call(x, pos, cache)
        jax.block_until_ready(cache)
        return cache

    def device_inputs(self, inputs: Inputs) -> dict:
        return {
            "prefix": [(self.dev(x), pos) for x, pos in inputs.prefix],
            "prompt": None if inputs.prompt is None else (self.dev(inputs.prompt[0]), inputs.prompt[1]),
            "steps": [(self.dev(x), pos) for x, pos in inputs.steps],
        }

    def run_mode(self, case, mode: str, dev_inputs: dict, snap) -> dict:
        """Warm-up, timed repeats and kept outputs of one mode (see the module docstring)."""
        attn = self.attn
        plan_mod.apply_mode(attn, mode)
        n_steps, reps = case.steps_for(mode), case.repeats_for(mode)
        prompt, steps = dev_inputs["prompt"], dev_inputs["steps"]
        clock = compile_clock()

        def fresh():
            return clone(snap)

        # Breaks in the compiled step (count of host callbacks in the lowered program).
        probe_x, probe_pos = (prompt if case.scenario == "prefill" else steps[0])
        breaks = host_breaks(attn, probe_x, probe_pos, snap)

        # Warm-up (compiles every call shape of the sequence).
        clock.start()
        t0 = time.perf_counter()
        cache = fresh()
        if prompt is not None:
            _, cache, _ = self._call(*prompt, cache)
        for x, pos in steps[: min(case.warmup_steps, len(steps))]:
            _, cache, _ = self._call(x, pos, cache)
        jax.block_until_ready(cache)
        warm_s = time.perf_counter() - t0
        compile_s = clock.stop()
        del cache

        ttft, dec, outs = [], [], []
        for r in range(reps):
            cache = fresh()
            last = r == reps - 1
            if prompt is not None:
                out, cache, dt = self._call(*prompt, cache, timed=True)
                ttft.append(dt)
                if last:
                    outs.append(np.asarray(out, np.float32))
            for x, pos in steps[:n_steps]:
                out, cache, dt = self._call(x, pos, cache, timed=True)
                dec.append(dt)
                if last:
                    outs.append(np.asarray(out, np.float32))
            del cache
        raw = self.raw_steps(case, dev_inputs, snap, n_steps) if (case.scenario != "prefill" and mode != "wide") else []
        return {"ttft": ttft, "decode": dec, "outs": outs, "compile_s": compile_s, "warmup_s": warm_s,
                "host_breaks": breaks, "steps": n_steps, "repeats": reps, "raw_decode": raw}

    def raw_steps(self, case, dev_inputs: dict, snap, n_steps: int) -> list:
        """The same decode steps through the compiled step function alone (`step.step_function`:
        no input checks, weights pytree built once, cache length on the device): the module's
        per-call overhead is the difference. Same compiled executable as the module call."""
        attn = self.attn
        cache = clone(snap)
        if dev_inputs["prompt"] is not None:
            _, cache = attn(*dev_inputs["prompt"], cache)
        steps = dev_inputs["steps"][:n_steps]
        spec = attn.step_spec()
        step = step_mod.step_for(spec, attn.donate_cache)
        weights = attn.step_weights()  # what the module call hands the step
        cache = cache.replace(length=jnp.asarray(cache.length))
        jax.block_until_ready(cache)
        times = []
        for x, pos in steps:
            t0 = time.perf_counter()
            out, cache, _ = step(weights, cache, x, pos, spec=spec)
            jax.block_until_ready((out, cache))
            times.append(time.perf_counter() - t0)
        return times

    def picks(self, case, mode: str, dev_inputs: dict, snap):
        """Indexer picks [B, S, K] of the case's first call in `mode` (return_intermediates pass)."""
        plan_mod.apply_mode(self.attn, mode)
        cache = clone(snap)
        x, pos = dev_inputs["prompt"] if case.scenario == "prefill" else dev_inputs["steps"][0]
        _, _, inter = self.attn(x, pos, cache, return_intermediates=True)
        return np.asarray(inter.topk)


# ---------------------------------------------------------------------------- the peer
def run_peer(peer, case, inputs: Inputs) -> dict:
    """The same protocol for the HF layer (chunked untimed prefix for decode_long)."""
    t = peer.tensor
    prompt = None if inputs.prompt is None else (t(inputs.prompt[0]), peer.positions(inputs.prompt[1]))
    steps = [(t(x), peer.positions(p)) for x, p in inputs.steps]
    n_steps, reps = case.steps, case.repeats

    peer.reset()
    peer.reset_peak()
    snap = None
    if case.scenario == "decode_long":
        for x, p in rechunk(inputs.prefix, plan_mod.hf_chunk(case.batch)):
            peer.call(t(x), peer.positions(p))
        peer.sync()
        snap = peer.snapshot()

    def fresh():
        if snap is None:
            peer.reset()
        else:
            peer.restore(snap)

    t0 = time.perf_counter()
    fresh()
    if prompt is not None:
        peer.call(*prompt)
    for x, p in steps[: min(case.warmup_steps, len(steps))]:
        peer.call(x, p)
    peer.sync()
    warm_s = time.perf_counter() - t0

    ttft, dec, outs = [], [], []
    for r in range(reps):
        fresh()
        last = r == reps - 1
        if prompt is not None:
            out, dt = peer.call(*prompt, timed=True)
            ttft.append(dt)
            if last:
                outs.append(peer.to_numpy(out))
        for x, p in steps[:n_steps]:
            out, dt = peer.call(x, p, timed=True)
            dec.append(dt)
            if last:
                outs.append(peer.to_numpy(out))
    peer.reset()
    return {"ttft": ttft, "decode": dec, "outs": outs, "compile_s": None, "warmup_s": warm_s,
            "host_breaks": None, "steps": n_steps, "repeats": reps, "peak_gb": peer.peak_memory_gb()}


# ---------------------------------------------------------------------------- comparisons
def max_abs_diff(outs, ref_outs) -> float | None:
    """Max |a - b| over the calls both sequences made (same positions, same inputs)."""
    n = min(len(outs), len(ref_outs))
    if n == 0:
        return None
    return float(max(np.max(np.abs(a - b)) for a, b in zip(outs[:n], ref_outs[:n], strict=True)))


def picks_overlap(picks, ref) -> float:
    """Mean over queries of |picks set ∩ ref set| / max(sizes) (-1 = nothing, ignored); order-free."""
    a = picks.reshape(-1, picks.shape[-1])
    b = ref.reshape(-1, ref.shape[-1])
    total = 0.0
    for ra, rb in zip(a, b, strict=True):
        sa, sb = set(ra[ra >= 0].tolist()), set(rb[rb >= 0].tolist())
        n = max(len(sa), len(sb))
        total += 1.0 if n == 0 else len(sa & sb) / n
    return total / max(len(a), 1)


def ref_scale(ref_outs) -> float | None:
    if not ref_outs:
        return None
    return float(max(np.max(np.abs(a)) for a in ref_outs))
