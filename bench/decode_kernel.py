"""Sparse attention alone, decode and prefill: the Pallas kernel's blocks against the XLA path.

    python bench/decode_kernel.py --json $OUT/decode_kernel.json      # on the H200 (gpu_decode_kernel.sh)
    python bench/decode_kernel.py --render bench/results/<run>.json

V4-Flash shapes in bf16 (64 heads x 512, window 128; decode: CSA top-512 of 4096 entries, HCA
the 128 visible of 129 entry slots at a 16k context, B = 1 and 32; prefill (`--phases
decode,prefill`): a prompt of `--prefill-len` tokens (4096) at B = 1, CSA top-512 of its
len/4 entries, HCA its len/128, each query's visible ones). Off the GPU the kernel runs in
interpret mode (`--quick`: small shapes, the CPU smoke test in
`tests/test_sparse_attention_kernel.py`). Each case jits `reps` applications of the operation in
a row (the query nudged each time, so that none is shared), runs it `repeats` times after a
warm-up and records the median wall time per application (``op_us``): launch
gaps included, as inside a CUDA graph. The compile is the warm-up's and not timed. Every
kernel row also records its largest difference from the XLA path (``max_abs_diff``).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import report  # noqa: E402
from bench.stack import environment  # noqa: E402
from dsv4_jax import sparse_attention as sa  # noqa: E402
from dsv4_jax import sparse_attention_kernel as sak  # noqa: E402

# decode: (block_keys, block_heads, num_warps, num_stages). The first sweep
# (results/h200_decode_kernel_blocks_2026-12-01.json) tried the first five, unpipelined: larger
# key blocks won (B = 32: 58.6 us at bk 64 against 124.8 at bk 16, XLA 56.8), so the loop over
# the gathered key blocks waits on its loads; the rest pipeline them (Triton's num_stages, as
# the prefill blocks do) or take more keys or heads a program.
CONFIGS = ((32, 32, 8, 1), (16, 16, 8, 1), (32, 16, 8, 1), (16, 32, 8, 1), (64, 32, 8, 1),
           (64, 32, 8, 2), (64, 32, 8, 3), (32, 32, 8, 3), (128, 32, 8, 1), (64, 64, 8, 2), (32, 64, 8, 3),
           (64, 32, 4, 2))
# prefill: (block_keys, block_heads, num_warps, num_stages[, skip_masked_blocks]): one program per
# query and head block; the default's blocks with and without skipping the masked entry blocks
PREFILL_CONFIGS = ((64, 64, 8, 3), (64, 64, 8, 3, True), (64, 64, 8, 2, True), (32, 64, 8, 3, True),
                   (64, 32, 4, 2), (64, 32, 4, 2, True))
# The sweeps before: results/h200_prefill_kernel_blocks{1,2}_2026-12-01.json (their `prefill_configs`).


FLASH = dict(h=64, d=512, w=128, t_csa=4096, k=512, t_hca=129, context=16384)
QUICK = dict(h=16, d=32, w=16, t_csa=64, k=16, t_hca=9, context=1100)  # --quick: CPU smoke, interpret mode


def inputs(kind: str, b: int, h: int, d: int, w: int, t_csa: int, k: int, t_hca: int, context: int, seed: int = 0):
    """One decode step per row at position `context`."""
    rng = np.random.default_rng(seed)
    t = t_csa if kind == "csa" else t_hca
    starts = np.full(b, context, np.int32)
    q = jnp.asarray(rng.normal(size=(b, 1, h, d)), jnp.bfloat16)
    pool = jnp.asarray(rng.normal(size=(b, w + 1, d)), jnp.bfloat16)
    sinks = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    widx = sa.window_indices(jnp.asarray(starts[:, None]), jnp.asarray(starts), w)
    kw = {"entries": jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16)}
    if kind == "csa":
        kw["picks"] = jnp.asarray(np.stack([rng.permutation(t)[:k] for _ in range(b)])[:, None], jnp.int32)
    else:
        kw["visible"] = jnp.full((b, 1), (context + 1) // 128, jnp.int32)
    return q, pool, widx, sinks, kw


def prefill_inputs(kind: str, b: int, h: int, d: int, w: int, k: int, length: int, seed: int = 0, **_):
    """A prompt of `length` tokens from an empty cache: query t sees CSA entries < (t+1)//4 (its
    top-k of them at random, -1 past the visible ones) or HCA entries < (t+1)//128."""
    rng = np.random.default_rng(seed)
    m = 4 if kind == "csa" else 128
    t_entries = length // m
    q = jnp.asarray(rng.normal(size=(b, length, h, d)), jnp.bfloat16)
    pool = jnp.asarray(rng.normal(size=(b, w + length, d)), jnp.bfloat16)
    sinks = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length))
    widx = sa.window_indices(jnp.asarray(positions), jnp.zeros(b, jnp.int32), w)
    kw = {"entries": jnp.asarray(rng.normal(size=(b, max(t_entries, 1), d)), jnp.bfloat16)}
    visible = (positions + 1) // m
    if kind == "csa":
        score = rng.random((b, length, max(t_entries, 1)), np.float32)
        score[np.arange(max(t_entries, 1))[None, None, :] >= visible[..., None]] = -1
        picks = np.argsort(-score, axis=-1, kind="stable")[..., :k].astype(np.int32)
        picks = np.where(np.arange(picks.shape[-1])[None, None, :] < visible[..., None], picks, -1)
        kw["picks"] = jnp.asarray(picks, jnp.int32)
    else:
        kw["visible"] = jnp.asarray(visible, jnp.int32)
    return q, pool, widx, sinks, kw


def timed(op, q, reps: int, repeats: int) -> tuple[float, np.ndarray]:
    @jax.jit
    def many(q):
        def body(i, carry):
            acc, qi = carry
            o = op(qi)
            return acc + o.astype(jnp.float32), qi + (o[..., :1] * 0).astype(qi.dtype)
        acc, _ = jax.lax.fori_loop(0, reps, body, (jnp.zeros(q.shape, jnp.float32), q))
        return acc

    jax.block_until_ready(many(q))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(many(q))
        times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times)) / reps, np.asarray(jax.jit(op)(q), np.float32)


def xla_op(qi, *, data):
    pool, widx, sinks, kw = data
    saved = sa.DECODE_KERNEL, sa.PREFILL_KERNEL
    sa.DECODE_KERNEL = sa.PREFILL_KERNEL = False
    try:
        return sa.sparse_attention(qi, pool, widx, sinks, **kw).o
    finally:
        sa.DECODE_KERNEL, sa.PREFILL_KERNEL = saved


def kernel_op(qi, *, data, **blocks):
    pool, widx, sinks, kw = data
    return sak.sparse_attention_kernel(qi, pool, widx, sinks, **blocks, **kw)


def run(args) -> list:
    records = []
    shapes = QUICK if args.quick else FLASH
    interpret = jax.default_backend() != "gpu"
    cases = []  # (phase, kind, batch, inputs, block configs, reps)
    for phase in args.phases.split(","):
        for kind in args.kinds.split(","):
            if phase == "decode":
                for b in (int(v) for v in args.batches.split(",")):
                    configs = ((16, 16, 4, 1),) if args.quick else CONFIGS
                    cases.append((phase, kind, b, lambda kind=kind, b=b: inputs(kind, b, **shapes), configs, args.reps))
            else:
                length = 64 if args.quick else args.prefill_len
                configs = ((16, 16, 4, 2, True),) if args.quick else PREFILL_CONFIGS
                cases.append((phase, kind, 1, lambda kind=kind, length=length: prefill_inputs(
                    kind, 1, length=length, **shapes), configs, max(1, args.reps // 4)))
    for phase, kind, b, make, configs, reps in cases:
        q, pool, widx, sinks, kw = make()
        data = (pool, widx, sinks, kw)
        base = {"phase": phase, "kind": kind, "batch": b, "queries": q.shape[1]}
        us, ref = timed(functools.partial(xla_op, data=data), q, reps, args.repeats)
        records.append({**base, "impl": "xla", "op_us": us, "reps": reps})
        print(f"{phase} {kind} B={b} xla: {us:.1f} us", flush=True)
        for bk, bh, warps, stages, *skip in configs:
            skip = bool(skip and skip[0])
            kernel = functools.partial(kernel_op, data=data, block_keys=bk, block_heads=bh, num_warps=warps,
                                       num_stages=stages, skip_masked_blocks=skip, interpret=interpret)
            try:
                us, got = timed(kernel, q, reps, args.repeats)
                rec = {"op_us": us, "max_abs_diff": float(np.abs(got - ref).max()),
                       "out_max": float(np.abs(ref).max())}
            except Exception as err:  # a record says why a configuration did not run
                rec = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            name = f"kernel bk={bk} bh={bh} w={warps} st={stages}" + (" skip" if skip else "")
            records.append({**base, "impl": name, "reps": reps, **rec})
            print(f"{phase} {kind} B={b} {name}: {rec}", flush=True)
        del q, pool, widx, kw, data, ref
    return records


def markdown(records: list, meta: dict) -> str:
    lines = [f"{meta.get('environment', {}).get('device', '')}; reps {meta.get('reps')}", "",
             "| phase | layer | B | queries | implementation | us per op | max abs diff vs XLA (out max) |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        diff = "-" if "max_abs_diff" not in r else f"{r['max_abs_diff']:.2e} ({r['out_max']:.2f})"
        us = r.get("error", "")[:60] if "error" in r else f"{r['op_us']:.1f}"
        lines.append(f"| {r.get('phase', 'decode')} | {r['kind'].upper()} | {r['batch']} | {r.get('queries', 1)} "
                     f"| {r['impl']} | {us} | {diff} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="csa,hca")
    ap.add_argument("--batches", default="1,32", help="decode batches")
    ap.add_argument("--phases", default="decode", help="decode, prefill or both")
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="small shapes, one block shape, 2 x 1 runs (CPU smoke)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--render", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.repeats = 2, 1
    if args.render:
        return report.render(args.render, markdown)
    meta = {"environment": environment(), "reps": args.reps, "repeats": args.repeats, "quick": args.quick,
            "configs": CONFIGS, "prefill_configs": PREFILL_CONFIGS,
            "kernel_defaults": [sak.BLOCK_KEYS, sak.BLOCK_HEADS, sak.NUM_WARPS, sak.NUM_STAGES],
            "interpret": jax.default_backend() != "gpu"}
    records = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"records": records, "meta": meta}, indent=1, default=str))
    print(markdown(records, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
