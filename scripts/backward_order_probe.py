"""Investigation (session 47): the sparse attention backward kernel's launch order.

Times `sparse_attention_backward` at V4-Flash prefill shapes (bf16, 4k tokens a row) for
several `row_stretches_most` (1: rows in order) and blocks, and the forward kernel beside them
(the first record also timed the kernel with its atomic adds removed, as session 46's probe did).
CSA with every row picking the same entries (`csa`, the most sharing) and with random picks among
the visible entries (`csa_random`). Medians of 20 blocked calls after warm-up; prints JSON lines.
"""

from __future__ import annotations

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import sparse_attention as sa
from dsv4_jax import sparse_attention_backward as sab
from dsv4_jax import sparse_attention_kernel as sak


def inputs(kind, b=1, s=4096, h=64, d=512, w=128, k=512, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, s, h, d)) * 0.05, jnp.bfloat16)
    pool = jnp.asarray(rng.normal(size=(b, w + s, d)), jnp.bfloat16)
    sinks = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
    widx = sa.window_indices(pos, jnp.zeros((b,), jnp.int32), w)
    kw = {}
    if kind.startswith("csa"):
        t = s // 4
        kw["entries"] = jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16)
        n = (np.arange(s) + 1) // 4
        if kind == "csa":
            picks = np.where(np.arange(k)[None] < n[:, None], np.arange(k)[None], -1)
        else:
            keys = rng.random((s, t))
            keys = np.where(np.arange(t)[None] < n[:, None], keys, 2.0)
            picks = np.argsort(keys, axis=1)[:, :k]
            picks = np.where(np.arange(k)[None] < n[:, None], picks, -1)
        kw["picks"] = jnp.asarray(np.broadcast_to(picks[None], (b, s, k)).astype(np.int32))
    else:
        t = s // 128
        kw["entries"] = jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16)
        kw["visible"] = (pos + 1) // 128
    return q, pool, widx, sinks, kw


def timed(fn, *args, reps=20, **kwargs):
    jax.block_until_ready(fn(*args, **kwargs))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args, **kwargs))
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def main():
    out = []
    for kind, b in (("hca", 1), ("csa", 1), ("csa_random", 1), ("hca", 4), ("csa_random", 4)):
        q, pool, widx, sinks, kw = inputs(kind, b=b)
        fwd = jax.jit(functools.partial(sak.sparse_attention_kernel, window_idx=widx, sinks=sinks, **kw,
                                        with_lse=True, **sak.forced_blocks("prefill", q.dtype)))
        o, lse = fwd(q, pool)
        do = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.bfloat16)
        row = {"kind": kind, "batch": b, "fwd_ms": timed(fwd, q, pool)}
        ref = None
        # G<n>: the launch order's spread at session 46's blocks (32 keys, 32 heads, 8 warps, 3 stages);
        # the first record (h200_backward_order_probe) ran these, the second (h200_backward_blocks_probe)
        # G1, G16 and the block variants.
        old_blocks = dict(block_keys=32, block_heads=32, num_warps=8, num_stages=3)
        variants = {f"G{g}": dict(old_blocks, row_stretches_most=g) for g in (1, 4, 16, 64, 256)}
        variants.update({"bk16_bh64_w8_s2": dict(block_keys=16, block_heads=64, num_warps=8, num_stages=2),
                         "bk32_bh64_w16_s2": dict(block_keys=32, block_heads=64, num_warps=16, num_stages=2),
                         "bk64_bh32_w8_s2": dict(block_keys=64, block_heads=32, num_warps=8, num_stages=2),
                         "bk16_bh32_w4_s3": dict(block_keys=16, block_heads=32, num_warps=4, num_stages=3)})
        for name, blocks in variants.items():
            try:
                bwd = jax.jit(functools.partial(sab.sparse_attention_backward, window_idx=widx, sinks=sinks, **kw,
                                                **blocks))
                row[f"backward_ms_{name}"] = timed(bwd, q, pool, o=o, lse=lse, do=do)
                got = bwd(q, pool, o=o, lse=lse, do=do)
            except Exception as e:  # a variant that does not compile is a finding
                row[f"backward_ms_{name}"] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            if ref is None:
                ref = got
            else:
                for i, what in ((0, "dq"), (1, "dpool")):
                    g, w = got[i].astype(jnp.float32), ref[i].astype(jnp.float32)
                    row[f"max_rel_{what}_{name}"] = float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
        row.update(device=str(jax.devices()[0]), jax=jax.__version__)
        print(json.dumps(row), flush=True)
        out.append(row)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
