"""Probe (session 59; an investigation, not the package): decode projections (M <= 32 rows) by
XLA's GEMM against a Pallas Triton and a Mosaic GPU GEMV-style kernel, device time by
jax.profiler. Run from the repo root.

python bench/decode_projection_probe.py [--interpret] [--out F]
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl


def _kernel(x_ref, w_ref, o_ref, *, bk, nk):
    # x [Mp, Ks], w [Ks, bn] (this program's split of K, its columns), o [Mp, bn]
    acc = jnp.zeros(o_ref.shape, jnp.float32)

    def body(i, acc):
        xk = x_ref[:, pl.ds(i * bk, bk)]
        wk = w_ref[pl.ds(i * bk, bk), :]
        return acc + jax.lax.dot_general(xk, wk, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, nk, body, acc)
    o_ref[...] = acc.astype(o_ref.dtype)


def gemv(x, w, *, bn=128, bk=128, splits=1, warps=4, stages=3, interpret=False):
    """x [G, M, K] @ w [G, K, N] -> [G, M, N] (x's dtype), M padded to 16 rows."""
    g, m, k = x.shape
    n = w.shape[2]
    mp = max(16, 1 << (m - 1).bit_length())
    if mp != m:
        x = jnp.concatenate([x, jnp.zeros((g, mp - m, k), x.dtype)], axis=1)
    ks = k // splits
    assert ks % bk == 0 and n % bn == 0
    out_dtype = x.dtype if splits == 1 else jnp.float32
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton
        extra["compiler_params"] = pl_triton.CompilerParams(num_warps=warps, num_stages=stages)
    out = pl.pallas_call(
        functools.partial(_kernel, bk=bk, nk=ks // bk),
        grid=(g, n // bn, splits),
        in_specs=[pl.BlockSpec((None, mp, ks), lambda gi, j, s: (gi, 0, s)),
                  pl.BlockSpec((None, ks, bn), lambda gi, j, s: (gi, s, j))],
        out_specs=pl.BlockSpec((None, None, mp, bn), lambda gi, j, s: (s, gi, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, g, mp, n), out_dtype),
        interpret=interpret, name="gemv", **extra)(x, w)
    out = out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
    return out[:, :m]


def xla_gemv(x, w):
    g, m, k = x.shape
    if m == 1:  # the package's padded single-token product
        xp = jnp.concatenate([x, jnp.zeros((g, 7, k), x.dtype)], axis=1)
        return jnp.einsum("gmk,gkn->gmn", xp, w)[:, :1]
    return jnp.einsum("gmk,gkn->gmn", x, w)


def mgpu_gemv(x, w, *, bn=128, bk=64, splits=1, stages=4, interpret=False):
    """The same product as a Mosaic GPU kernel: x padded to 64 rows (wgmma's M), W's tiles by TMA
    in a `stages`-deep pipeline, one program per (group, column block, K split)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    g, m, k = x.shape
    n = w.shape[2]
    bm = 64
    if m < bm:
        x = jnp.concatenate([x, jnp.zeros((g, bm - m, k), x.dtype)], axis=1)
    ks = k // splits
    nt = n // bn
    assert ks % bk == 0 and n % bn == 0
    out_dtype = x.dtype if splits == 1 else jnp.float32

    def body(x_gmem, w_gmem, o_gmem):
        pid = lax.axis_index("p")
        s = lax.rem(pid, splits)
        rest = lax.div(pid, splits)
        j = lax.rem(rest, nt)
        gi = lax.div(rest, nt)

        def acc_scope(acc_ref):
            plgpu.emit_pipeline(
                lambda _, xs, ws: plgpu.wgmma(acc_ref, xs, ws),
                grid=(ks // bk,),
                in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (0, kk)),
                          plgpu.BlockSpec((bk, bn), lambda kk: (kk, j))],
                max_concurrent_steps=stages,
            )(x_gmem.at[gi, :, pl.ds(s * ks, ks)], w_gmem.at[gi, pl.ds(s * ks, ks), :])
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

        @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=out_dtype))
        def _store(o_smem):
            o_smem[...] = acc.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[s, gi, :, pl.ds(j * bn, bn)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((splits, g, bm, n), out_dtype), grid=(g * nt * splits,),
        grid_names=("p",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    out = kernel(x, w)
    out = out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
    return out[:, :m]


def mgpu_configs(g, k, n):
    out = []
    for splits, bn, bk, stages in itertools.product((1, 2, 4, 8), (32, 64, 128, 256), (64, 128), (4, 8)):
        if n % bn or (k // splits) % bk or k // splits < bk * 2:
            continue
        progs = g * (n // bn) * splits
        if progs < 100 or progs > 2048:
            continue
        if stages * (64 * bk + bk * bn) * 2 > 200 * 1024:
            continue
        out.append(dict(bn=bn, bk=bk, splits=splits, stages=stages))
    return out

SHAPES = {  # name: (G, K, N)
    "q_b": (1, 1024, 32768),
    "wo_a": (8, 4096, 1024),
    "wo_b": (1, 8192, 4096),
    "in_proj": (1, 4096, 4160),
}


def configs(g, k, n):
    out = []
    for bn, bk, splits, warps, stages in itertools.product((32, 64, 128, 256), (64, 128, 256), (1, 2, 4, 8),
                                                           (4, 8), (3, 4)):
        if n % bn or (k // splits) % bk or k // splits < bk:
            continue
        progs = g * (n // bn) * splits
        if progs < 100 or progs > 2048:
            continue
        out.append(dict(bn=bn, bk=bk, splits=splits, warps=warps, stages=stages))
    return out



def wall_us(run, args, copies, calls=20, reps=5):
    jax.block_until_ready(run(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [run(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t0) / (calls * copies))
    return float(np.median(ts)) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--screen-rows", type=int, default=8)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="4")
    ap.add_argument("--budget-s", type=float, default=500)
    ap.add_argument("--mgpu", type=int, default=1)
    a = ap.parse_args()
    recs = []
    if a.interpret:  # correctness only, small
        key = jax.random.key(0)
        for m in (1, 8, 32):
            x = jax.random.normal(key, (2, m, 256), jnp.float32)
            w = jax.random.normal(jax.random.key(1), (2, 256, 128), jnp.float32)
            for splits in (1, 2):
                y = gemv(x, w, bn=64, bk=64, splits=splits, interpret=True)
                ref = jnp.einsum("gmk,gkn->gmn", x, w, precision="highest")
                print(m, splits, float(jnp.max(jnp.abs(y - ref))))
        return
    import kernel_profile
    t_start = time.time()
    warps = {int(v) for v in a.warps.split(",")}
    stages = {int(v) for v in a.stages.split(",")}

    def save():
        meta = dict(jax=jax.__version__, device=str(jax.devices()[0].device_kind),
                    date=time.strftime("%Y-%m-%d %H:%M:%S"), wall_s=time.time() - t_start, argv=sys.argv[1:],
                    copies=a.copies, steps=a.steps,
                    note=("screen: wall us a GEMV (20 back-to-back calls of a jit of `copies` GEMVs on distinct "
                          "weight buffers, median of 5); profiled: device busy us a GEMV (jax.profiler); bf16"))
        if a.out:
            with open(a.out, "w") as fh:
                json.dump({"records": recs, "meta": meta}, fh, indent=1)

    for name in a.shapes.split(","):
        g, k, n = SHAPES[name]
        ws = [jax.random.normal(jax.random.key(i), (g, k, n), jnp.bfloat16) for i in range(a.copies)]
        nbytes = g * k * n * 2
        cands = [c for c in configs(g, k, n) if c["warps"] in warps and c["stages"] in stages]

        def make(kind, cfg):
            f = {"xla": xla_gemv, "pallas": functools.partial(gemv, **(cfg or {})),
                 "mgpu": functools.partial(mgpu_gemv, **(cfg or {}))}[kind]
            return jax.jit(lambda x_in, *weights, f=f: [f(x_in, w) for w in weights])

        x8 = jax.random.normal(jax.random.key(98), (g, a.screen_rows, k), jnp.bfloat16)
        screened = []
        mc = mgpu_configs(g, k, n) if a.mgpu else []
        both = [("pallas", c) for c in cands] + [("mgpu", c) for c in mc]
        __import__("random").Random(0).shuffle(both)  # a budget cut leaves an even sample
        names = a.shapes.split(",")
        for kind, cfg in [("xla", None), *both]:
            if time.time() - t_start > a.budget_s * (names.index(name) + 1) / len(names):
                break
            try:
                us = wall_us(make(kind, cfg), (x8, *ws), a.copies)
            except Exception as e:
                recs.append(dict(phase="screen", shape=name, kind=kind, cfg=cfg, error=str(e)[:200]))
                continue
            rec = dict(phase="screen", shape=name, m=a.screen_rows, kind=kind, cfg=cfg, wall_us=us,
                       tbps=nbytes / us / 1e6)
            recs.append(rec)
            screened.append(rec)
        pal = sorted((r for r in screened if r["kind"] == "pallas"), key=lambda r: r["wall_us"])[:a.top]
        pal += sorted((r for r in screened if r["kind"] == "mgpu"), key=lambda r: r["wall_us"])[:a.top]
        xs = [r for r in screened if r["kind"] == "xla"]
        print("SCREEN", name, "xla", xs and round(xs[0]["wall_us"], 2),
              [(r["cfg"], round(r["wall_us"], 2)) for r in pal], flush=True)
        for m in (int(v) for v in a.rows.split(",")):
            x = jax.random.normal(jax.random.key(99), (g, m, k), jnp.bfloat16)
            ref = np.asarray(jnp.einsum("gmk,gkn->gmn", x.astype(jnp.float32), ws[0].astype(jnp.float32),
                                        precision="highest"))
            for kind, cfg in [("xla", None)] + [(r["kind"], r["cfg"]) for r in pal]:
                run = make(kind, cfg)
                try:
                    outs = jax.block_until_ready(run(x, *ws))
                    err = float(np.max(np.abs(np.asarray(outs[0]).astype(np.float32) - ref)) / np.max(np.abs(ref)))
                    prof = kernel_profile.profile(lambda run=run, x=x, ws=ws: jax.block_until_ready(run(x, *ws)),
                                                  steps=a.steps,
                                                  log_dir=f"/tmp/gemvprof/{name}_{m}_{len(recs)}")
                    us = prof["busy_us_per_step"] / a.copies
                    rec = dict(phase="profiled", shape=name, g=g, k=k, n=n, m=m, kind=kind, cfg=cfg, us=us,
                               tbps=nbytes / us / 1e6, wall_us=wall_us(run, (x, *ws), a.copies), err=err,
                               kernels=[(r["op"], round(r["us_per_step"] / a.copies, 2)) for r in prof["rows"][:4]])
                except Exception as e:
                    rec = dict(phase="profiled", shape=name, m=m, kind=kind, cfg=cfg,
                               error=f"{type(e).__name__}: {str(e)[:300]}")
                recs.append(rec)
                print(json.dumps(rec), flush=True)
        save()
    save()


if __name__ == "__main__":
    main()
