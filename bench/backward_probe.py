"""Session 63 probe (temporary; run from the repository root): the CSA Triton backward kernel
alone at V4-Flash shapes, variants timed in alternating rounds in one process.

python bench/backward_probe.py [--batch 4] [--tokens 4096] [--variants base,one_loop=1] [--out F]
A variant: "base" or keyword=int pairs joined by ":" for `sparse_attention_backward`.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import sparse_attention_backward as sab
from dsv4_jax.sparse_attention_kernel import sparse_attention_kernel


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


def once(f, args):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--variants", default="base,one_loop=1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    q, pool, widx, sinks, entries, picks, do = inputs(a.batch, a.tokens)
    fwd = jax.jit(functools.partial(sparse_attention_kernel, with_lse=True))
    o, lse = fwd(q, pool, widx, sinks, entries=entries, picks=picks)
    args = (q, pool, widx, sinks, o, lse, do, entries, picks)
    fns, recs, outs = {}, {}, {}
    for v in a.variants.split(","):
        kw = {} if v == "base" else {k_: int(x) for k_, x in (o_.split("=") for o_ in v.split(":"))}
        f = jax.jit(lambda q, pool, w, s, o, lse, do, e, p, kw=kw: sab.sparse_attention_backward(
            q, pool, w, s, o, lse, do, entries=e, picks=p, **kw))
        try:
            first = once(f, args)
        except Exception as err:
            print(f"{v}: failed {type(err).__name__}: {str(err)[:400]}", flush=True)
            recs[v] = {"variant": v, "error": str(err)[:400]}
            continue
        fns[v] = f
        outs[v] = f(*args)
        recs[v] = {"variant": v, "first_call_s": first, "times_ms": []}
    for _ in range(a.rounds):
        for v, f in fns.items():
            recs[v]["times_ms"] += [once(f, args) * 1e3 for _ in range(a.reps)]
    ref = outs.get("base")
    for v in fns:
        recs[v]["median_ms"] = float(np.median(recs[v]["times_ms"]))
        if ref is not None and v != "base":
            recs[v]["max_rel"] = [None if y is None else
                                  float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))) /
                                        (float(jnp.max(jnp.abs(y.astype(jnp.float32)))) + 1e-30))
                                  for x, y in zip(outs[v], ref)]
        print(json.dumps({k: x for k, x in recs[v].items() if k != "times_ms"}), flush=True)
    meta = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "batch": a.batch,
            "tokens": a.tokens, "rounds": a.rounds, "reps": a.reps, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv)}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"records": list(recs.values()), "meta": meta}, fh, indent=1)


if __name__ == "__main__":
    main()
