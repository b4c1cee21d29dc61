"""The speed-of-light floor of a call on a GPU: max(bytes / bandwidth, FLOPs / matrix rate).

Bytes: every weight once, plus the cache a query must read (window keys; CSA: the indexer keys of
every visible entry and the ``index_topk`` picked entries; HCA: every visible entry), plus the
call's input and output activations. FLOPs: 2 per multiply-add of the projections, the indexer
scoring (CSA) and sparse attention (QK and PV over window + picked / visible entries).

The issue fixes the rates: ~4.3 TB/s (an H200 device-to-device copy) and ~790 TFLOP/s (bf16
matrix rate) for the H200; `bench/run.py` also measures both on the machine and records them.
"""

from __future__ import annotations

import math

import numpy as np

from dsv4_jax.config import CSA, HCA

H200_BYTES_PER_S = 4.3e12
H200_FLOPS = 790e12


def projection_params(cfg, layer: str) -> int:
    """Multiply-add weights a token goes through (all projections of the layer)."""
    h, d, lq, hid = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.hidden_size
    n = hid * lq + lq * h * d + hid * d + h * d * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * hid
    if layer == "csa":
        n += 2 * hid * cfg.compressor_width(CSA)  # compressor kv + gate (overlapping: 2 x head_dim wide)
        c, ni = cfg.index_head_dim, cfg.index_n_heads
        # the indexer's q_b and weights_proj, and its compressor's kv + gate
        n += lq * ni * c + hid * ni + 2 * hid * cfg.compressor_width(CSA, indexer=True)
    else:
        n += 2 * hid * cfg.compressor_width(HCA)
    return n


def _per_query(cfg, layer: str, t: np.ndarray):
    """Cache keys read and attention/indexer FLOPs of queries at positions t (numpy arrays)."""
    h, d = cfg.num_attention_heads, cfg.head_dim
    window = np.minimum(t + 1, cfg.sliding_window)
    if layer == "csa":
        visible = (t + 1) // cfg.csa_compress_rate
        picked = np.minimum(visible, cfg.index_topk)
        keys = window + picked
        index_flops = 2.0 * cfg.index_n_heads * cfg.index_head_dim * visible
        index_bytes_elems = visible * cfg.index_head_dim
    else:
        visible = (t + 1) // cfg.hca_compress_rate
        keys = window + visible
        index_flops = 0.0 * visible
        index_bytes_elems = 0 * visible
    attn_flops = 4.0 * h * d * keys
    return keys, attn_flops + index_flops, index_bytes_elems


def cache_row_bytes(cfg, itemsize: int, kv_cache_dtype: str = "auto") -> tuple[float, float]:
    """Bytes of one main KV row and of one indexer key as the cache stores them: `itemsize` a
    value, or with ``kv_cache_dtype="fp8"`` (`dsv4_jax.cache.quantized`) one byte a non-RoPE
    value plus a scale byte a block of 64, RoPE values at `itemsize`; indexer keys two e2m1
    codes a byte plus a scale byte a block of 32 (V4-Flash: 583 and 68 bytes against 1024 and 256)."""
    d, c = cfg.head_dim, cfg.index_head_dim
    if kv_cache_dtype == "auto":
        return float(d * itemsize), float(c * itemsize)
    nope = d - cfg.qk_rope_head_dim
    return float(nope + -(-nope // 64) + cfg.qk_rope_head_dim * itemsize), float(c // 2 + -(-c // 32))


def floor(cfg, layer: str, batch: int, start: int, new_tokens: int, weight_bytes: int, itemsize: int,
          bytes_per_s: float = H200_BYTES_PER_S, flops_per_s: float = H200_FLOPS,
          kv_cache_dtype: str = "auto") -> dict:
    """Floor of one call of `new_tokens` per row starting at position `start` (seconds and parts);
    the cache's bytes as `kv_cache_dtype` stores them (`cache_row_bytes`)."""
    t = np.arange(start, start + new_tokens, dtype=np.int64)
    keys, flops_q, index_elems = _per_query(cfg, layer, t)
    flops = batch * (2.0 * projection_params(cfg, layer) * new_tokens + float(flops_q.sum()))
    row, index_row = cache_row_bytes(cfg, itemsize, kv_cache_dtype)
    index_rows = index_elems / cfg.index_head_dim
    if new_tokens == 1:  # decode: the cache a step reads, per row
        cache_bytes = float(keys[-1] * row + index_rows[-1] * index_row)
    else:  # prefill: every key read once (it is written by this call) + the entries written
        cache_bytes = float(keys.max() * row + index_rows.max() * index_row)
    act_elems = new_tokens * (2 * cfg.hidden_size)
    nbytes = weight_bytes + batch * (cache_bytes + act_elems * itemsize)
    t_bytes, t_flops = nbytes / bytes_per_s, flops / flops_per_s
    return {"floor_ms": 1e3 * max(t_bytes, t_flops), "floor_bytes": nbytes, "floor_flops": flops,
            "floor_bound": "bytes" if t_bytes >= t_flops else "flops"}


def matmul_flops(jaxpr) -> float:
    """FLOPs of a program's matrix products, 2 per multiply-add, read from its jaxpr (``jax.make_jaxpr(f)
    (*args).jaxpr``): every ``dot_general``, in nested jaxprs too (``pjit``, ``custom_vjp``, ``remat``),
    a ``scan``'s body times its length, a ``cond``'s largest branch. The count of the floor model's
    kind for a program written in plain JAX (a peer's): divided by a matrix rate it is a time no run
    of that program can beat. A ``while`` loop (its trip count is data) or a Pallas kernel (its body is
    one block's) raises ValueError."""
    from jax.extend import core

    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
        elif name == "scan":
            total += eqn.params["length"] * matmul_flops(eqn.params["jaxpr"].jaxpr)
        elif name == "cond":
            total += max(matmul_flops(branch.jaxpr) for branch in eqn.params["branches"])
        elif name in ("while", "pallas_call"):
            raise ValueError(f"matmul_flops: a {name} in the program; its FLOPs cannot be read from the jaxpr")
        else:
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, core.ClosedJaxpr):
                        total += matmul_flops(sub.jaxpr)
                    elif isinstance(sub, core.Jaxpr):
                        total += matmul_flops(sub)
    return total
