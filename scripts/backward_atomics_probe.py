"""Investigation (session 46): what the sparse attention backward kernel's key-gradient adds cost.

Times `sparse_attention_backward` at V4-Flash prefill shapes (B = 1, 4k, bf16) as it is, with
its atomic adds removed (the key gradients' dots then go too: the dq path alone), and the
forward kernel beside them. Medians of 20 blocked calls after warm-up; prints JSON lines.
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


def inputs(kind, s=4096, h=64, d=512, w=128, k=512, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(1, s, h, d)) * 0.05, jnp.bfloat16)
    pool = jnp.asarray(rng.normal(size=(1, w + s, d)), jnp.bfloat16)
    sinks = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    widx = sa.window_indices(pos, jnp.zeros((1,), jnp.int32), w)
    kw = {}
    if kind == "csa":
        t = s // 4
        kw["entries"] = jnp.asarray(rng.normal(size=(1, t, d)), jnp.bfloat16)
        n = (np.arange(s) + 1) // 4
        picks = np.where(np.arange(k)[None] < n[:, None], np.arange(k)[None], -1).astype(np.int32)
        kw["picks"] = jnp.asarray(picks[None])
    else:
        t = s // 128
        kw["entries"] = jnp.asarray(rng.normal(size=(1, t, d)), jnp.bfloat16)
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
    for kind in ("hca", "csa"):
        q, pool, widx, sinks, kw = inputs(kind)
        fwd = jax.jit(functools.partial(sak.sparse_attention_kernel, window_idx=widx, sinks=sinks, **kw,
                                        with_lse=True, **sak.forced_blocks("prefill", q.dtype)))
        o, lse = fwd(q, pool)
        do = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.bfloat16)
        row = {"kind": kind, "fwd_ms": timed(fwd, q, pool)}
        saved = sab._atomic_add
        for name, patch in (("backward_ms", None), ("backward_no_key_adds_ms", lambda *a: None)):
            if patch is not None:
                sab._atomic_add = patch
            bwd = jax.jit(functools.partial(sab.sparse_attention_backward, window_idx=widx, sinks=sinks, **kw))
            row[name] = timed(bwd, q, pool, o=o, lse=lse, do=do)
            sab._atomic_add = saved
        row.update(device=str(jax.devices()[0]), jax=jax.__version__)
        print(json.dumps(row), flush=True)
        out.append(row)
    if len(sys.argv) > 1:
        json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
