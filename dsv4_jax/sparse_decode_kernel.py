"""Sparse decode attention as one Pallas kernel: the keys gathered inside it (issue 9).

The XLA path (`sparse_attention.sparse_attention`) gathers a decode query's keys into
[B, 1, W + K, D] arrays, then runs the logits, the softmax with the sink and the weighted
sum as separate fusions (~9 kernels and two gathered copies per layer and step on the H200).
Here one `pallas_call` (Triton backend on the GPU; `interpret=True` runs the same kernel on
any backend, which is how the CPU tests run it) reads each key straight from its source by
index and keeps an online softmax (flash decoding):

    grid (B, H / bh, splits); program (b, h, j) owns heads h*bh .. h*bh+bh-1 of row b and the
    key blocks j, j + splits, ... of the window (from the pool) and then of the entries
    q      [bh, D]        this program's queries
    k      [bk, D]        one block of keys, `src[b, idx]` (a gather inside the kernel)
    s      [bh, bk]       float32 logits, -inf where idx = -1
    acc    [bh, D]        float32 sum of exp(s - m) k over the program's keys
    m, total [bh]         running max and sum of exp(s - m)

and one small XLA fusion merges the splits with the sink (`combine`). K = V (each key is its
own value), as everywhere in this layer.

Numerics follow the XLA path: the logits are rounded to the compute dtype before the scale
(the reference's order), probabilities go to the compute dtype for the weighted sum, which
accumulates in float32. The difference: the XLA path normalises the probabilities before that
cast, the kernel after the sum (flash decoding), so bf16 results differ in the last bits;
float32 agrees within 2e-5 (`tests/test_sparse_decode_kernel.py`).

Decode only (one query per row), without the attention masses: `sparse_attention` chooses
this kernel on CUDA where it measured faster (`default_blocks`; `DECODE_KERNEL` there forces
either path) and keeps the XLA path as the reference and for every other backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .backend import Array

# Keys per block and heads per program (Triton's dot needs every dimension >= 16 and a power
# of two); `splits` spreads a row's key blocks over programs when B * H / bh alone would leave
# most of the GPU's 132 SMs idle.
BLOCK_KEYS = 32
BLOCK_HEADS = 32
TARGET_PROGRAMS = 132
NUM_WARPS = 8

# Where the kernel is the CUDA default, and with which (block_keys, block_heads): the cases it
# beat the XLA path in, on the operation alone (bench/decode_kernel.py, H200, V4-Flash bf16,
# bench/results/h200_decode_kernel_blocks_2026-12-01.json, us per op):
#   CSA B = 1:  24.7 (bk 16, bh 32) against 28.9     HCA B = 1:  20.2 (bk 32, bh 16) against 30.3
#   CSA B = 32: 58.6 at best against 56.8            HCA B = 32: 37.7 at best against 31.7
# so one-row decode only; batches keep the XLA path (its gathers are amortised over the rows,
# and the kernel's per-program loop is not). Sliding layers (window only) were not measured.
CUDA_DEFAULT_BLOCKS = {("csa", 1): (16, 32), ("hca", 1): (32, 16)}


def default_blocks(kind: str, batch: int) -> dict | None:
    """The kernel's blocks where it is the CUDA default for this layer kind ("csa", "hca",
    "sliding") and batch, else None (the XLA path)."""
    chosen = CUDA_DEFAULT_BLOCKS.get((kind, batch))
    return None if chosen is None else {"block_keys": chosen[0], "block_heads": chosen[1]}


def supported_on_gpu(q: Array, block_heads: int = BLOCK_HEADS, block_keys: int = BLOCK_KEYS) -> bool:
    """Whether the Triton kernel takes these shapes: q [B, 1, H, D] with H a multiple of the
    head block, D a power of two, every dot dimension >= 16."""
    _, s, h, d = q.shape
    bh = min(block_heads, h)

    def pow2(n):
        return n >= 16 and n & (n - 1) == 0

    return s == 1 and h % bh == 0 and pow2(bh) and pow2(d) and pow2(block_keys)


def _pad_indices(idx: Array, block: int) -> Array:
    """[B, L] int32 -> [B, ceil(L / block) * block], padded with -1 (no key)."""
    pad = -idx.shape[1] % block
    return jnp.pad(idx, ((0, 0), (0, pad)), constant_values=-1) if pad else idx


def _kernel(*refs, scale: float, block_keys: int, splits: int, n_window: int, n_entries: int, dtype):
    if n_entries:
        widx_ref, eidx_ref, q_ref, pool_ref, ents_ref, acc_ref, m_ref, l_ref = refs
    else:
        widx_ref, q_ref, pool_ref, acc_ref, m_ref, l_ref = refs
    b, j = pl.program_id(0), pl.program_id(2)
    q = q_ref[...]  # [bh, D]
    exact = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None  # no TF32 for float32

    def key_block(src_ref, idx_ref, blk, carry):
        acc, m, total = carry
        idx = idx_ref[b, pl.ds(blk * block_keys, block_keys)]  # [bk]
        k = src_ref[b, jnp.maximum(idx, 0), :].astype(dtype)  # [bk, D], gathered by index
        dots = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=exact,
                                   preferred_element_type=jnp.float32)
        s = (dots.astype(dtype) * scale).astype(jnp.float32)  # the reference's rounding order
        s = jnp.where((idx >= 0)[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key yet: keep exp() finite
        alpha = jnp.exp(m - shift)
        p = jnp.exp(s - shift[:, None])
        acc = acc * alpha[:, None] + jax.lax.dot_general(
            p.astype(dtype), k, (((1,), (0,)), ((), ())), precision=exact, preferred_element_type=jnp.float32)
        return acc, m_new, total * alpha + jnp.sum(p, axis=1)

    def loop(src_ref, idx_ref, n_blocks, carry):
        count = jnp.maximum(0, (n_blocks - j + splits - 1) // splits)
        return jax.lax.fori_loop(0, count, lambda i, c: key_block(src_ref, idx_ref, j + i * splits, c), carry)

    bh, d = q.shape
    carry = (jnp.zeros((bh, d), jnp.float32), jnp.full((bh,), -jnp.inf, jnp.float32), jnp.zeros((bh,), jnp.float32))
    carry = loop(pool_ref, widx_ref, n_window, carry)
    if n_entries:
        carry = loop(ents_ref, eidx_ref, n_entries, carry)
    acc_ref[...], m_ref[...], l_ref[...] = carry


def partials(q: Array, pool: Array, window_idx: Array, entries: Array | None, entry_idx: Array | None, *,
             block_keys: int = BLOCK_KEYS, block_heads: int = BLOCK_HEADS, splits: int | None = None,
             interpret: bool = False):
    """The kernel: per split, the un-normalised output and its softmax statistics.

    q [B, H, D]; pool [B, P, D] with window_idx [B, W] (-1 = no key); entries [B, T, D] with
    entry_idx [B, K] (-1 = no key), or both None (sliding layers).
    Returns acc [B, splits, H, D] float32, m [B, splits, H] float32 (-inf: the split saw no
    key), total [B, splits, H] float32 (the sum of exp(s - m)).
    """
    b, h, d = q.shape
    bh = min(block_heads, h)
    widx = _pad_indices(window_idx.astype(jnp.int32), block_keys)
    n_window = widx.shape[1] // block_keys
    eidx = None if entries is None else _pad_indices(entry_idx.astype(jnp.int32), block_keys)
    n_entries = 0 if eidx is None else eidx.shape[1] // block_keys
    if splits is None:
        splits = max(1, min(max(n_window, n_entries), TARGET_PROGRAMS // (b * (h // bh))))
    kernel = functools.partial(_kernel, scale=d ** -0.5, block_keys=block_keys, splits=splits,
                               n_window=n_window, n_entries=n_entries, dtype=q.dtype)
    whole = pl.no_block_spec
    in_specs = [whole] + ([whole] if n_entries else []) + [
        pl.BlockSpec((None, bh, d), lambda i, g, s: (i, g, 0)), whole] + ([whole] if n_entries else [])
    args = [widx] + ([eidx] if n_entries else []) + [q, pool] + ([entries] if n_entries else [])
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        extra["compiler_params"] = pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
    return pl.pallas_call(
        kernel,
        grid=(b, h // bh, splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, bh, d), lambda i, g, s: (i, s, g, 0)),
                   pl.BlockSpec((None, None, bh), lambda i, g, s: (i, s, g)),
                   pl.BlockSpec((None, None, bh), lambda i, g, s: (i, s, g))],
        out_shape=[jax.ShapeDtypeStruct((b, splits, h, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, splits, h), jnp.float32),
                   jax.ShapeDtypeStruct((b, splits, h), jnp.float32)],
        interpret=interpret,
        name="sparse_decode_attention",
        **extra,
    )(*args)


def combine(acc: Array, m: Array, total: Array, sinks: Array, dtype) -> Array:
    """Merge the splits and the sink: [B, splits, H, D], [B, splits, H] x2, sinks [H] -> [B, H, D].

    The sink's logit joins the softmax denominator only (its value vector is zero)."""
    sink = sinks.astype(jnp.float32)[None, :]
    top = jnp.maximum(jnp.max(m, axis=1), sink)  # [B, H]: finite, the sink is
    w = jnp.exp(m - top[:, None])  # [B, splits, H]; 0 for a split with no key
    num = jnp.sum(acc * w[..., None], axis=1)
    den = jnp.sum(total * w, axis=1) + jnp.exp(sink - top)
    return (num / den[..., None]).astype(dtype)


def sparse_decode_attention(q: Array, pool: Array, window_idx: Array, sinks: Array, *,
                            entries: Array | None = None, picks: Array | None = None,
                            visible: Array | None = None, interpret: bool = False, **blocks) -> Array:
    """`sparse_attention` for one query per row, by the kernel: the same arguments, S = 1.

    q [B, 1, H, D], pool [B, W+1, D], window_idx [B, 1, W], sinks [H]; entries [B, T, D] with
    picks [B, 1, K] (CSA) or visible [B, 1] (HCA: entries w < visible), or neither (sliding).
    Returns o [B, 1, H, D] in q's dtype.
    """
    entry_idx = None
    if entries is not None and picks is not None:
        entry_idx = picks[:, 0]
    elif entries is not None:
        w = jnp.arange(entries.shape[1], dtype=jnp.int32)[None, :]
        entry_idx = jnp.where(w < visible[:, :1], w, -1)
    acc, m, total = partials(q[:, 0], pool, window_idx[:, 0], entries, entry_idx, interpret=interpret, **blocks)
    return combine(acc, m, total, sinks, q.dtype)[:, None]
