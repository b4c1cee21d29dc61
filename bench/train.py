"""Training: forward + backward of N attention layers in one `jax.jit` (scenario ``train_step``).

    python bench/train.py --size flash --json $OUT/train.json                 # the H200 run
    python bench/train.py --size tiny --quick --json /tmp/train.json          # seconds, CPU smoke
    python bench/train.py --render bench/results/<run>.json                   # the table of a past run

The loss of a stack (bench/stack.py's stacks: ``csa``, ``hca`` and ``mixed``, V4-Flash's
interleaving, N = ``--layers``): a prefill of L tokens per row into empty caches,
``h = x; h = h + attention_step(weights_i, cache_i, h, positions, spec_i)[0]`` for each layer,
``loss = mean(h.astype(float32) ** 2)``. Timed, as compiled programs (lowered and compiled ahead
of time: ``compile_s`` and ``fwd_compile_s`` apart), medians of ``--repeats`` blocked calls after
one warm-up call, per layer (/ N):

``fwd_ms``       the loss alone;
``fwd_bwd_ms``   ``jax.value_and_grad(loss, argnums=(0, 2))``: w.r.t. each layer's parameters
                 (``attn.weights()``: no derived ``input_proj`` leaf) and the input x.

``floor_ms`` is forward + backward's FLOP floor per layer, 3x the forward's FLOPs (bench/floor.py,
the stacks' model) at the H200's rate; ``fwd_floor_ms`` the forward's; ``ratio_to_floor`` =
fwd_bwd_ms / floor_ms (GPU only). Memory: ``peak_gb`` = ``xla_total_gb``, XLA's memory analysis
of the fwd+bwd program (arguments + outputs + temporaries; ``xla_temp_gb`` the temporaries), and
``device_peak_gb``, the device's ``peak_bytes_in_use`` (the process's peak so far: it only grows
over a run; None on CPU). ``--remat layer`` wraps each layer's attention in ``jax.checkpoint``
(nothing saved: the backward recomputes the layer's forward); ``remat`` is in every record.
``grad_norm``: the global norm of all gradients (weights and x), ``grads_finite`` whether all are.
``gpu_clocks_fwd`` / ``gpu_clocks_fwd_bwd``: the card's SM clock, power, temperature and
clock-event reasons (a power cap, heat) sampled while each timed loop ran (bench/gpu_clocks.py;
None without nvidia-smi).

``--peer maxtext`` (the default where maxtext imports): MaxText's `CompressedAttention` in its
training mode (bench/peer_maxtext.py, `time_train`: our weights, no remat), one layer of the
stack's type(s), same loss, batch and length: ``maxtext_fwd_ms`` / ``maxtext_fwd_bwd_ms`` (mixed
stacks: the mean of its CSA and HCA layers) and ``ratio_to_maxtext`` = fwd_bwd_ms /
maxtext_fwd_bwd_ms, or ``maxtext_error`` where it does not run (its dense [B, H, S, S + S/m]
logits outgrow the memory at long prompts: the record says where it stops and why).
A cell that fails (out of memory, ...) is a record with ``error`` and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# No torch peer shares the card here (MaxText's peer is JAX, in this process), so JAX may take
# most of it: bench/run.py's 0.35 (set when it is imported below) left a 4-layer CSA stack at
# B = 4, 16k (~76 GB) out of memory on an H200 (session 68). Recorded as `xla_mem_fraction`.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import dsv4_jax  # noqa: E402
from bench import floor as floor_mod  # noqa: E402
from bench import gpu_clocks, peer_maxtext, report  # noqa: E402
from bench import plan as plan_mod  # noqa: E402
from bench import run as run_mod  # noqa: E402
from bench import stack as stack_mod  # noqa: E402
from dsv4_jax.ops.kernel_plan import BACKWARD_CHOICES  # noqa: E402
from dsv4_jax.step import pure_step as step_mod  # noqa: E402

REMAT = ("none", "layer")


# ---------------------------------------------------------------------------- the loss
def layer_output(weights, cache, h, positions, spec):
    """One layer's attention output [B, L, hidden] (the new cache is dropped: a training step has no use for it)."""
    return step_mod.attention_step(weights, cache, h, positions, spec)[0]


def stack_loss(weights, caches, x, positions, specs, remat: str = "none"):
    """mean(h ** 2) in float32 after ``h = h + attention(layer_i, h)`` for each layer; x [B, L, hidden]."""
    h = x
    for w, cache, spec in zip(weights, caches, specs):
        out = functools.partial(layer_output, spec=spec)  # the spec is static, not an argument to checkpoint
        if remat == "layer":
            out = jax.checkpoint(out)
        h = h + out(w, cache, h, positions)
    return jnp.mean(jnp.square(h.astype(jnp.float32)))


FWD = jax.jit(stack_loss, static_argnames=("specs", "remat"))
FWD_BWD = jax.jit(jax.value_and_grad(stack_loss, argnums=(0, 2)), static_argnames=("specs", "remat"))


class TrainStack(stack_mod.Stack):
    """bench/stack.py's stack (same layers and weights), each layer constructed anew with this run's
    ``break_mode`` and ``kernels``; ``weights`` are the parameters alone (`weights()`)."""

    def __init__(self, cfg, kind: str, n: int, dtype, seed: int, break_mode: str, kernels):
        super().__init__(cfg, kind, n, dtype, seed, "none", fused=False)
        self.layers = [self._rebuilt(a, seed + i, break_mode, kernels) for i, a in zip(self.indices, self.layers)]
        self.specs = tuple(a.step_spec() for a in self.layers)
        self.weights = [a.weights() for a in self.layers]

    @staticmethod
    def _rebuilt(attn, seed: int, break_mode: str, kernels):
        new = dsv4_jax.DeepseekV4Attention(attn.config, attn.layer_idx, rngs=nnx.Rngs(seed), break_mode=break_mode,
                                           kernels=kernels, dtype=attn.dtype, param_dtype=attn.param_dtype)
        nnx.update(new, nnx.state(attn, nnx.Param))  # the bench's random sinks and position biases too
        return new


# ---------------------------------------------------------------------------- timings
def compiled(jitted, args: tuple, **static):
    """(compiled program, seconds to lower + compile, XLA's memory analysis in bytes)."""
    t0 = time.perf_counter()
    prog = jitted.lower(*args, **static).compile()
    return prog, time.perf_counter() - t0, peer_maxtext.memory_bytes(prog)


def median_ms(prog, args: tuple, repeats: int):
    """(median ms of `repeats` blocked calls after one warm-up call, the last call's result)."""
    out = jax.block_until_ready(prog(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(prog(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times)), out


def grad_summary(grads) -> dict:
    """Global norm (float32) of the gradients, of x's alone, and whether every one is finite."""
    leaves = [g.astype(jnp.float32) for g in jax.tree.leaves(grads)]
    norm = float(jnp.sqrt(sum(jnp.sum(g * g) for g in leaves)))
    return {"grad_norm": norm, "grad_norm_x": float(jnp.linalg.norm(grads[1].astype(jnp.float32))),
            "grads_finite": all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)}


def gb(n) -> float | None:
    return None if n is None else n / 1e9


def device_peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def floors(stack: TrainStack, batch: int, length: int) -> dict:
    """Per layer: the forward's FLOP floor and forward + backward's (3x), at the H200's matrix rate."""
    flops = stack.floor(batch, 0, length)["floor_flops"]
    fwd = 1e3 * flops / floor_mod.H200_FLOPS
    return {"floor_flops": flops, "fwd_floor_ms": fwd, "floor_ms": 3 * fwd}


def time_train(rec: dict, stack: TrainStack, batch: int, length: int, repeats: int, seed: int, remat: str) -> None:
    """Fill `rec` with the cell's timings, memory and gradient summary (what ran before an error stays)."""
    n = len(stack.layers)
    x = stack_mod._hidden(stack.cfg, batch, length, stack.dtype, seed)
    args = (stack.weights, stack.empty_caches(batch, stack_mod._round_up(length)), x,
            stack_mod._positions(batch, 0, length))
    static = {"specs": stack.specs, "remat": remat}
    fwd, rec["fwd_compile_s"], mem = compiled(FWD, args, **static)
    with gpu_clocks.ClockSampler() as clocks:
        ms, loss = median_ms(fwd, args, repeats)
    rec.update(fwd_ms=ms / n, loss=float(loss), fwd_xla_total_gb=gb(mem.get("total")), gpu_clocks_fwd=clocks.summary)
    del fwd
    bwd, rec["compile_s"], mem = compiled(FWD_BWD, args, **static)
    # The cell's own peak: the device's peak_bytes_in_use cannot be reset, so it is the run's so far.
    rec.update(xla_temp_gb=gb(mem.get("temp")), xla_total_gb=gb(mem.get("total")), peak_gb=gb(mem.get("total")))
    with gpu_clocks.ClockSampler() as clocks:
        ms, (loss, grads) = median_ms(bwd, args, repeats)
    rec.update(fwd_bwd_ms=ms / n, ratio_bwd_to_fwd=ms / n / rec["fwd_ms"], device_peak_gb=gb(device_peak_bytes()),
               gpu_clocks_fwd_bwd=clocks.summary, **grad_summary(grads))


def profile_train(stack: TrainStack, batch: int, length: int, steps: int, seed: int, remat: str, log_dir: str) -> list:
    """Device time per XLA operation of the forward and of forward + backward (`bench/kernel_profile.py`,
    command buffers kept on): which operations the backward's time goes to."""
    from bench import kernel_profile

    x = stack_mod._hidden(stack.cfg, batch, length, stack.dtype, seed)
    args = (stack.weights, stack.empty_caches(batch, stack_mod._round_up(length)), x,
            stack_mod._positions(batch, 0, length))
    static = {"specs": stack.specs, "remat": remat}
    out = []
    for name, jitted in (("fwd", FWD), ("fwd_bwd", FWD_BWD)):
        prog = jitted.lower(*args, **static).compile()
        summary = kernel_profile.profile(lambda prog=prog: jax.block_until_ready(prog(*args)), steps,
                                         f"{log_dir}/{stack.kind}_B{batch}_L{length}_{name}")
        kernel_profile.attach_sources(summary, prog.as_text())
        summary.update({"program": name, "stack": stack.kind, "layer_type": stack.layer_type,
                        "n_layers": len(stack.layers), "batch": batch, "prompt_len": length, "remat": remat})
        out.append(summary)
    return out


def profile_items(spec: str | None) -> list:
    """``--profile`` items STACK/B:LEN as (stack, batch, length)."""
    items = []
    for item in filter(None, (spec or "").split(",")):
        kind, _, cell = item.partition("/")
        b, _, length = cell.partition(":")
        items.append((kind, int(b), int(length)))
    return items


# ---------------------------------------------------------------------------- the MaxText peer
def maxtext_cell(cache: dict, stack: TrainStack, size: str, batch: int, length: int, repeats: int,
                 seed: int, mem_gb: float | None) -> dict:
    """MaxText's per-layer fwd / fwd+bwd for the stack's layer type(s) (the mean over types for a
    mixed stack); one run per (type, batch, length), kept in `cache`."""
    results = []
    for lt in dict.fromkeys(a.layer_type for a in stack.layers):
        key = (lt, batch, length)
        if key not in cache:
            attn = stack.layers[[a.layer_type for a in stack.layers].index(lt)]
            cache[key] = peer_maxtext.time_train(stack.cfg, size, lt, attn, batch=batch, seq=length,
                                                 dtype=stack.dtype.name, repeats=repeats, seed=seed, mem_gb=mem_gb)
        results.append(cache[key])
    errors = [f"{plan_mod.SHORT[r['layer_type']]}: {r['error']}" for r in results if r.get("error")]
    if errors:
        return {"maxtext_error": "; ".join(errors)}
    out = {f"maxtext_{k}": float(np.mean([r[k] for r in results])) for k in ("fwd_ms", "fwd_bwd_ms", "compile_s")}
    peaks = [r["peak_gb"] for r in results if r.get("peak_gb") is not None]
    out["maxtext_xla_total_gb"] = max(peaks) if peaks else None
    return out


# ---------------------------------------------------------------------------- the run
def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def kernel_plan(args) -> dsv4_jax.KernelPlan:
    """--kernels (a name) with --attention-backward, --query-norm and
    bench/stack.py's kernel A/B switches."""
    plan = stack_mod.kernel_plan(args, args.kernels)
    if args.attention_backward:
        plan = dataclasses.replace(plan, attention_backward=args.attention_backward)
    if args.query_norm:
        plan = dataclasses.replace(plan, query_norm=args.query_norm)
    return plan


def run(args, write=None) -> tuple[list, dict]:
    cfg = stack_mod.stack_config(args.size, args.layers)
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    reason = peer_maxtext.available()
    peer = args.peer or ("none" if reason else "maxtext")
    env = stack_mod.environment()
    plan = kernel_plan(args)
    # bench/run.py's environment adds the commit, a dirty flag, the package's source hash, nvidia-smi
    meta = {**run_mod.environment("gpu" if gpu else "cpu"), **env, "command": " ".join(sys.argv),
            "size": args.size, "dtype": dtype.name, "argv": sys.argv[1:], "n_layers": args.layers,
            "stacks": args.stacks, "remat": args.remat, "break_mode": args.break_mode,
            "kernels": dataclasses.asdict(plan),
            "peer": peer, "maxtext": peer_maxtext.versions() if not reason else {"unavailable": reason},
            "repeats": args.repeats, "seed": args.seed}
    records: list[dict] = []
    peer_cache: dict = {}
    for kind in args.stacks.split(","):
        stack = TrainStack(cfg, kind, args.layers, dtype, args.seed, args.break_mode, plan)
        for length in (int(v) for v in args.lengths.split(",")):
            for batch in (int(v) for v in args.batches.split(",")):
                rec = {"scenario": "train_step", "size": args.size, "stack": kind, "layer_type": stack.layer_type,
                       "n_layers": len(stack.layers), "layer_indices": stack.indices, "batch": batch,
                       "prompt_len": length, "dtype": dtype.name, "remat": args.remat,
                       "break_mode": args.break_mode, "kernels": args.kernels,
                       "attention_backward": plan.attention_backward, "query_norm": plan.query_norm,
                       "repeats": args.repeats,
                       **floors(stack, batch, length), "error": None}
                try:
                    time_train(rec, stack, batch, length, args.repeats, args.seed, args.remat)
                    rec["ratio_to_floor"] = rec["fwd_bwd_ms"] / rec["floor_ms"] if gpu else None
                except Exception as err:  # the cell's outcome is the record (OOM, a kernel's failure, ...)
                    rec["error"] = first_line(err)
                if peer == "maxtext":
                    try:
                        rec.update(maxtext_cell(peer_cache, stack, args.size, batch, length, args.repeats,
                                                args.seed, args.maxtext_mem_gb))
                    except Exception as err:
                        rec["maxtext_error"] = first_line(err)
                    if rec.get("fwd_bwd_ms") and rec.get("maxtext_fwd_bwd_ms"):
                        rec["ratio_to_maxtext"] = rec["fwd_bwd_ms"] / rec["maxtext_fwd_bwd_ms"]
                records.append(rec)
                print(_line(rec), file=sys.stderr, flush=True)
                if write:
                    write(records, meta)
        for p_kind, b, length in profile_items(args.profile):
            if p_kind == kind:
                try:
                    meta.setdefault("profiles", []).extend(
                        profile_train(stack, b, length, args.profile_steps, args.seed, args.remat, args.profile_dir))
                except Exception as err:
                    meta.setdefault("profiles", []).append({"stack": kind, "batch": b, "prompt_len": length,
                                                            "error": first_line(err)})
                if write:
                    write(records, meta)
        del stack
    return records, meta


def _fmt(v, spec=".3f") -> str:
    return "" if v is None else format(v, spec)


def _line(r: dict) -> str:
    head = f"train_step {r['stack']} B{r['batch']} L{r['prompt_len']} remat={r['remat']}: "
    if r.get("fwd_bwd_ms") is not None:
        head += (f"fwd {r['fwd_ms']:.3f}, fwd+bwd {r['fwd_bwd_ms']:.3f} ms/layer (x{r['ratio_bwd_to_fwd']:.2f} fwd, "
                 f"floor {r['floor_ms']:.4g}), compile {_fmt(r.get('compile_s'), '.1f')} s")
    elif r.get("fwd_ms") is not None:
        head += f"fwd {r['fwd_ms']:.3f} ms/layer"
    clocks = r.get("gpu_clocks_fwd_bwd") or {}
    if clocks.get("sm_mhz"):
        sm, power = clocks["sm_mhz"], clocks["power_w"]
        head += (f"; SM {sm['min']:.0f}-{sm['max']:.0f} MHz, {power['max']:.0f} W"
                 + "".join(f", {name}" for name in clocks["event_reason_names"] if name != "gpu_idle"))
    return (head + (f"; ERROR {r['error']}" if r.get("error") else "")
            + (f"; MaxText fwd+bwd {r['maxtext_fwd_bwd_ms']:.3f}" if r.get("maxtext_fwd_bwd_ms") else "")
            + (f"; MaxText: {r['maxtext_error']}" if r.get("maxtext_error") else ""))


def markdown(records: list, meta: dict) -> str:
    """One table: per-layer fwd and fwd+bwd, their ratio, the floor, memory, MaxText's fwd+bwd."""
    out = [f"train_step: {meta.get('n_layers')} layers in one jax.jit, {meta.get('size')}, {meta.get('dtype')}, "
           f"remat {meta.get('remat')}, {meta.get('device')}, jax {meta.get('jax_version')}", "",
           "| stack | layer types | B | prompt | fwd ms / layer | fwd+bwd ms / layer | fwd+bwd / fwd | "
           "floor ms / layer | x floor | peak GB | compile s | MaxText fwd+bwd ms | x MaxText |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        mt = _fmt(r.get("maxtext_fwd_bwd_ms")) or (f"- ({r['maxtext_error'][:60]})" if r.get("maxtext_error") else "")
        fwd_bwd = _fmt(r.get("fwd_bwd_ms")) or f"error: {(r.get('error') or '')[:80]}"
        out.append(f"| {r['stack']} | {r['layer_type']} | {r['batch']} | {r['prompt_len']} | {_fmt(r.get('fwd_ms'))} | "
                   f"{fwd_bwd} | {_fmt(r.get('ratio_bwd_to_fwd'), '.2f')} | {r['floor_ms']:.4g} | "
                   f"{_fmt(r.get('ratio_to_floor'), '.2f')} | {_fmt(r.get('peak_gb'), '.2f')} | "
                   f"{_fmt(r.get('compile_s'), '.1f')} | {mt} | {_fmt(r.get('ratio_to_maxtext'), '.2f')} |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=("tiny", "small", "flash"))
    ap.add_argument("--quick", action="store_true", help="one batch, one short prompt, two repeats")
    ap.add_argument("--json", default=None)
    ap.add_argument("--stacks", default="csa,hca,mixed")
    ap.add_argument("--layers", type=int, default=4, help="layers per stack (default 4)")
    ap.add_argument("--batches", default=None, help="default 1,4 (--quick: 1)")
    ap.add_argument("--lengths", default=None, help="prompt lengths (default 4096,16384,65536; --quick: 4096, CPU 64)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per program (default 5, --quick 2)")
    ap.add_argument("--remat", default="none", choices=REMAT, help="layer: jax.checkpoint around each layer")
    ap.add_argument("--break-mode", default="narrow", help="the layers' break_mode (default narrow)")
    ap.add_argument("--kernels", default="auto", choices=dsv4_jax.KERNELS, help="the layers' kernels (default auto)")
    ap.add_argument("--attention-backward", default=None, choices=BACKWARD_CHOICES,
                    help="the sparse attention kernel's gradient (KernelPlan.attention_backward): the Mosaic "
                         "GPU range kernels for HCA, the Triton kernel elsewhere (auto), the Triton kernel "
                         "(triton), the range kernels wherever they take the call (wgmma) or the XLA VJP")
    ap.add_argument("--query-norm", default=None, choices=("auto", "pallas", "xla"),
                    help="the queries' per-head norm: its Pallas kernels (auto: for prefill) or XLA")
    for flag in ("decode-kernel", "prefill-kernel", "compress-kernel"):  # bench/stack.py's A/B switches
        ap.add_argument(f"--{flag}", action="store_true", help=f"as bench/stack.py --{flag}")
        ap.add_argument(f"--no-{flag}", action="store_true", help=f"as bench/stack.py --no-{flag}")
    ap.add_argument("--prefill-blocks", default=None, help="as bench/stack.py --prefill-blocks")
    ap.add_argument("--dtype", default=None, help="parameters and activations (default bfloat16 on GPU, else float32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer", default=None, choices=("maxtext", "none"),
                    help="MaxText's fwd+bwd beside ours (default: maxtext where it imports)")
    ap.add_argument("--maxtext-mem-gb", type=float, default=None,
                    help="memory MaxText may use (default: the free part of JAX's pool on GPU, 8 GB on CPU)")
    ap.add_argument("--profile", default=None, metavar="STACK/B:LEN[,...]",
                    help="also profile the forward and forward + backward of these cells: device time per XLA "
                         "operation in meta['profiles'] (bench/kernel_profile.py)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--profile-dir", default="/tmp/dsv4_train_profile")
    ap.add_argument("--render", default=None, metavar="JSON")
    return ap


def fill_defaults(args) -> None:
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    args.batches = args.batches or ("1" if args.quick else "1,4")
    args.lengths = args.lengths or ("4096,16384,65536" if not args.quick else ("4096" if gpu else "64"))
    args.repeats = args.repeats or (2 if args.quick else 5)


def main(argv=None) -> int:
    return report.scenario_main(argv, build_parser, fill_defaults, run, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
