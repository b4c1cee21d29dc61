"""Session 58 probe (run from the repository root): the CSA training step's Triton backward kernel alone at V4-Flash B=4 4k shapes.

python bench/backward_split_probe.py [--batch 4] [--tokens 4096] [--variants base,noatom,split] [--out F]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from dsv4_jax import sparse_attention_backward as sab
from dsv4_jax.sparse_attention_kernel import sparse_attention_kernel
import backward_split_variants as bwd_variants


def inputs(batch, tokens, h=64, d=512, w=128, m=4, k=512, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    dt = jnp.bfloat16
    q = jax.random.normal(ks[0], (batch, tokens, h, d), dt)
    keys = jax.random.normal(ks[1], (batch, tokens, d), dt)
    pool = jnp.concatenate([jnp.zeros((batch, w, d), dt), keys], axis=1)
    t = jnp.arange(tokens, dtype=jnp.int32)
    p = t[:, None] - (w - 1) + jnp.arange(w, dtype=jnp.int32)
    widx = jnp.broadcast_to(jnp.where(p >= 0, w + p, -1), (batch, tokens, w)).astype(jnp.int32)
    n_ent = tokens // m
    entries = jax.random.normal(ks[2], (batch, n_ent, d), dt)
    score = jax.random.uniform(ks[3], (batch, tokens, n_ent))
    vis = ((t + 1) // m)[None, :, None]
    score = jnp.where(jnp.arange(n_ent)[None, None, :] < vis, score, -1.0)
    top, picks = jax.lax.top_k(score, min(k, n_ent))
    picks = jnp.where(top >= 0, picks, -1).astype(jnp.int32)
    sinks = jax.random.normal(ks[4], (h,), jnp.float32)
    do = jax.random.normal(ks[5], (batch, tokens, h, d), dt) * 0.01
    return q, pool, widx, sinks, entries, picks, do


def timeit(f, args, reps):
    out = f(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3, out


def noatom_add(ref, idx, values, relaxed):
    src = idx[0]

    @pl.when(src < 0)  # never: the adds' instructions stay, no memory traffic
    def _():
        sab.relaxed_atomics.atomic_add(ref, idx, values)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--variants", default="base,noatom,split")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    q, pool, widx, sinks, entries, picks, do = inputs(a.batch, a.tokens)
    fwd = jax.jit(functools.partial(sparse_attention_kernel, with_lse=True, block_keys=32, block_heads=32,
                                    num_warps=8, num_stages=1))
    t_fwd, (o, lse) = timeit(lambda *x: fwd(*x[:4], entries=x[4], picks=x[5]), (q, pool, widx, sinks, entries, picks), a.reps)
    recs = [{"variant": "forward", "ms": t_fwd}]
    print(f"forward kernel {t_fwd:.3f} ms", flush=True)
    base_out = None
    args = (q, pool, widx, sinks, o, lse, do, entries, picks)
    for v in a.variants.split(","):
        name, *opts = v.split(":")
        kw = dict(x.split("=") for x in opts)
        kw = {k_: int(x) for k_, x in kw.items()}
        saved = sab._atomic_add
        srt = kw.pop("sorted", 0)
        if name in ("base", "noatom"):
            if name == "noatom":
                sab._atomic_add = noatom_add
            f = jax.jit(lambda q, pool, w, s, o, l, do, e, p: sab.sparse_attention_backward(
                q, pool, w, s, o, l, do, entries=e, picks=p, **kw))
        elif name == "split":
            f = jax.jit(lambda q, pool, w, s, o, l, do, e, p: bwd_variants.split_backward(
                q, pool, w, s, o, l, do, entries=e, picks=p, **kw))
        if srt:  # picks ascending, -1 last, sorted inside the timed call
            g = f

            def f(q, pool, w, s, o, l, do, e, p, g=g):
                big = jnp.iinfo(jnp.int32).max
                ps = jnp.sort(jnp.where(p < 0, big, p), axis=-1)
                return g(q, pool, w, s, o, l, do, e, jnp.where(ps == big, -1, ps))
            f = jax.jit(f)
        t0 = time.perf_counter()
        try:
            jax.block_until_ready(f(*args))
        except Exception as err:  # noqa: BLE001
            print(f"{v}: failed {type(err).__name__}: {str(err)[:400]}", flush=True)
            recs.append({"variant": v, "error": str(err)[:400]})
            sab._atomic_add = saved
            continue
        compile_s = time.perf_counter() - t0
        ms, out = timeit(f, args, a.reps)
        sab._atomic_add = saved
        rec = {"variant": v, "ms": ms, "first_call_s": compile_s, "vs_forward": ms / t_fwd}
        if name == "base" and base_out is None:
            base_out = out
        elif base_out is not None and v != "noatom":
            rec["max_rel"] = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))) /
                                    (float(jnp.max(jnp.abs(y.astype(jnp.float32)))) + 1e-30))
                              for x, y in zip(out, base_out)]
        print(json.dumps(rec), flush=True)
        recs.append(rec)
    meta = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "batch": a.batch,
            "tokens": a.tokens, "reps": a.reps, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"records": recs, "meta": meta}, fh, indent=1)


if __name__ == "__main__":
    main()
