"""A/B of the sparse attention backward kernel's variants at V4-Flash prefill shapes (investigation).

    python bench/backward_ab.py --json out.json

A prompt of S tokens from an empty cache (window 128 in a pool of 128 + S keys; CSA: top-512 of
S / 4 entries, picked at random among each query's visible ones; HCA: S / 128 entries, the
visible prefix), bf16, 64 heads of 512. Per variant: the median device time of the backward
(jit, block_until_ready, after warm-up), the forward kernel's beside it, and the largest
difference of its cotangents from the first variant's (relative to that one's largest value).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import sparse_attention as sa
from dsv4_jax import sparse_attention_backward as sab
from dsv4_jax import sparse_attention_kernel as sak

# The kernel's variants (the split and head-group variants of h200_backward_ab_2026-12-02_s35_2.json
# ran against the kernel of the commit that added this harness first).
VARIANTS = {
    "one_pass_acqrel_32x32": dict(relaxed=False),
    "one_pass_relaxed_32x32": dict(relaxed=True),
    "one_pass_relaxed_64x32": dict(relaxed=True, block_keys=64),
    "one_pass_relaxed_16x32": dict(relaxed=True, block_keys=16),
    "one_pass_relaxed_32x32_w4": dict(relaxed=True, num_warps=4),
    "one_pass_relaxed_32x16": dict(relaxed=True, block_heads=16),
    "relaxed_32x32_s2": dict(relaxed=True, num_stages=2),
    "relaxed_32x32_s3": dict(relaxed=True, num_stages=3),
    "relaxed_32x32_w16": dict(relaxed=True, num_warps=16),
}


def inputs(kind: str, s: int, h: int = 64, d: int = 512, w: int = 128, k: int = 512, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 6)
    dt = jnp.bfloat16
    q = jax.random.normal(keys[0], (1, s, h, d), dt)
    pool = jax.random.normal(keys[1], (1, w + s, d), dt)
    sinks = jax.random.normal(keys[2], (h,), jnp.float32)
    positions = jnp.arange(s, dtype=jnp.int32)[None]
    widx = sa.window_indices(positions, jnp.zeros((1,), jnp.int32), w)
    kwargs = {}
    ratio = 4 if kind == "csa" else 128
    t = s // ratio
    kwargs["entries"] = jax.random.normal(keys[3], (1, t, d), dt)
    visible = (jnp.arange(s, dtype=jnp.int32) + 1) // ratio
    if kind == "csa":
        scores = jax.random.uniform(keys[4], (s, t))
        scores = jnp.where(jnp.arange(t)[None] < visible[:, None], scores, -jnp.inf)
        top, picks = jax.lax.top_k(scores, min(k, t))
        kwargs["picks"] = jnp.where(jnp.isfinite(top), picks, -1).astype(jnp.int32)[None]
    else:
        kwargs["visible"] = visible[None]
    do = jax.random.normal(keys[5], q.shape, dt)
    return q, pool, widx, sinks, kwargs, do


def median_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="csa:4096,hca:4096,csa:16384")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    records = []
    for case in args.cases.split(","):
        kind, s = case.split(":")
        q, pool, widx, sinks, kwargs, do = inputs(kind, int(s))
        fwd_blocks = sak.default_blocks(kind, 1, "prefill", int(s), q.dtype) or sak.forced_blocks("prefill", q.dtype)
        fwd = jax.jit(lambda q, pool, kw, widx=widx, sinks=sinks, fb=fwd_blocks: sak.sparse_attention_kernel(
            q, pool, widx, sinks, **kw, with_lse=True, **fb))
        o, lse = fwd(q, pool, kwargs)
        fwd_ms = median_ms(fwd, (q, pool, kwargs), args.repeats)
        print(f"{kind} S={s}: forward kernel {fwd_ms:.3f} ms", flush=True)
        first = None
        for name in args.variants.split(","):
            variant = VARIANTS[name]
            bwd = jax.jit(lambda q, pool, o, lse, do, kw, v=variant, widx=widx, sinks=sinks:
                          sab.sparse_attention_backward(q, pool, widx, sinks, o, lse, do, **kw, **v))
            rec = {"kind": kind, "prompt_len": int(s), "variant": name, "params": repr(variant), "fwd_ms": fwd_ms}
            try:
                t0 = time.perf_counter()
                grads = jax.block_until_ready(bwd(q, pool, o, lse, do, kwargs))
                rec["first_call_s"] = time.perf_counter() - t0
                rec["bwd_ms"] = median_ms(bwd, (q, pool, o, lse, do, kwargs), args.repeats)
                rec["bwd_over_fwd"] = rec["bwd_ms"] / fwd_ms
                grads = [None if g is None else np.asarray(g, np.float32) for g in grads]
                if first is None:
                    first = grads
                rec["max_rel_diff_vs_first"] = {
                    n: float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30))
                    for n, g, w in zip(("dq", "dpool", "dsinks", "dentries"), grads, first) if g is not None}
                print(f"  {name:36s} {rec['bwd_ms']:8.3f} ms  x{rec['bwd_over_fwd']:.2f} fwd  "
                      f"diff {max(rec['max_rel_diff_vs_first'].values()):.1e}", flush=True)
            except Exception as e:  # a variant Triton cannot compile (shared memory) is a result too
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  {name:36s} ERROR {rec['error'][:150]}", flush=True)
            records.append(rec)
    meta = {"device": str(jax.devices()[0]), "jax": jax.__version__, "python": platform.python_version(),
            "relaxed_available": __import__("dsv4_jax.relaxed_atomics").relaxed_atomics.RELAXED}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
