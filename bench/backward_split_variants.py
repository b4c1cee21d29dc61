"""Probe variants of the Triton sparse-attention backward (session 58; not the package).

noatom: the tree's kernel with the key gradients' atomic adds masked off (compute and gathers
only). split: two kernels, dq per (row, 32 heads) without atomics (3 dots a key block), and the
key gradients per row over all 64 heads (4 dots a key block, half the atomic adds).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsv4_jax import relaxed_atomics
from dsv4_jax.sparse_attention_backward import (_as_group_layout, _group_block_spec, _row_of, row_stretches,
                                                NUM_STAGES)
from dsv4_jax.sparse_attention_kernel import _pad_indices, entry_indices


def _indices(q, window_idx, entries, picks, visible, bk):
    rows = q.shape[0] * q.shape[1]
    widx = _pad_indices(window_idx.reshape(rows, -1).astype(jnp.int32), bk)
    eidx = _pad_indices(entry_indices(rows, entries, picks, visible).astype(jnp.int32), bk)
    last = jnp.max(jnp.where(eidx >= 0, jnp.arange(1, eidx.shape[1] + 1, dtype=jnp.int32), 0), axis=1)
    return widx, eidx, (last + bk - 1) // bk


def _dq_kernel(widx_ref, eidx_ref, eblk_ref, q_ref, do_ref, o_ref, lse_ref, pool_ref, ents_ref,
               dq_ref, delta_ref, *, scale, bk, s_rows, nw, dtype, rows, stretches):
    r = _row_of(pl.program_id(0), rows, stretches)
    src = r // s_rows
    q = q_ref[...]
    do = do_ref[...].reshape(q.shape)
    lse = lse_ref[...]
    delta = jnp.sum(do.astype(jnp.float32) * o_ref[...].astype(jnp.float32), axis=1)
    delta_ref[...] = delta

    def dot(a, b, c):
        return jax.lax.dot_general(a, b, (c, ((), ())), preferred_element_type=jnp.float32)

    def block(src_ref, idx_ref, blk, dq):
        idx = idx_ref[r, pl.ds(blk * bk, bk)]
        k = src_ref[src, jnp.maximum(idx, 0), :].astype(dtype)
        logits, dp = dot(q, k, ((1,), (1,))), dot(do, k, ((1,), (1,)))
        s = (logits.astype(dtype) * scale).astype(jnp.float32)
        p = jnp.where((idx >= 0)[None, :], jnp.exp(s - lse[:, None]), 0.0)
        ds = ((p * (dp - delta[:, None])) * scale).astype(dtype)
        return dq + dot(ds, k, ((1,), (0,)))

    dq = jnp.zeros(q.shape, jnp.float32)
    dq = jax.lax.fori_loop(0, nw, lambda i, c: block(pool_ref, widx_ref, i, c), dq)
    dq = jax.lax.fori_loop(0, eblk_ref[r], lambda i, c: block(ents_ref, eidx_ref, i, c), dq)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dk_kernel(widx_ref, eidx_ref, eblk_ref, q_ref, do_ref, lse_ref, delta_ref, pool_ref, ents_ref,
               dpool_in, dents_in, dpool_ref, dents_ref, *, scale, bk, s_rows, nw, dtype, rows, stretches,
               trash_pool, trash_ents):
    r = _row_of(pl.program_id(0), rows, stretches)
    src = r // s_rows
    q = q_ref[...]  # [H, D]
    do = do_ref[...].reshape(q.shape)
    lse, delta = lse_ref[...], delta_ref[...]
    cols = jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]

    def dot(a, b, c):
        return jax.lax.dot_general(a, b, (c, ((), ())), preferred_element_type=jnp.float32)

    def block(src_ref, idx_ref, grad_ref, trash, blk, carry):
        idx = idx_ref[r, pl.ds(blk * bk, bk)]
        k = src_ref[src, jnp.maximum(idx, 0), :].astype(dtype)
        logits, dp = dot(q, k, ((1,), (1,))), dot(do, k, ((1,), (1,)))
        s = (logits.astype(dtype) * scale).astype(jnp.float32)
        p = jnp.where((idx >= 0)[None, :], jnp.exp(s - lse[:, None]), 0.0)
        ds = ((p * (dp - delta[:, None])) * scale).astype(dtype)
        dk = dot(ds, q, ((0,), (0,))) + dot(p.astype(dtype), do, ((0,), (0,)))
        rws = jnp.broadcast_to(jnp.where(idx >= 0, idx, trash)[:, None], dk.shape)
        relaxed_atomics.atomic_add(grad_ref, (src, rws, jnp.broadcast_to(cols, dk.shape)), dk)
        return carry

    jax.lax.fori_loop(0, nw, lambda i, c: block(pool_ref, widx_ref, dpool_ref, trash_pool, i, c), 0)
    jax.lax.fori_loop(0, eblk_ref[r], lambda i, c: block(ents_ref, eidx_ref, dents_ref, trash_ents, i, c), 0)


def split_backward(q, pool, window_idx, sinks, o, lse, do, *, entries, picks=None, visible=None, bk=16, bh=32,
                   warps_dq=4, warps_dk=4, stages_dq=None, stages_dk=None, do_groups=None, interpret=False,
                   dk_heads=None, bk_dk=None):
    from jax.experimental.pallas import triton as pl_triton
    b, s, h, d = q.shape
    rows = b * s
    dtype = q.dtype
    widx, eidx, eblk = _indices(q, window_idx, entries, picks, visible, bk)
    nw = widx.shape[1] // bk
    st = row_stretches(rows)
    row_of = functools.partial(_row_of, rows=rows, stretches=st)
    q_rows, o_rows = q.reshape(rows, h, d), o.reshape(rows, h, d)
    lse_rows = lse.reshape(rows, h).astype(jnp.float32)
    whole = pl.no_block_spec
    default_stages = NUM_STAGES.get(jnp.dtype(dtype).itemsize, 1)
    # dq
    do1 = _as_group_layout(do.astype(dtype), rows, h, d, do_groups, bh)
    per_head = pl.BlockSpec((None, bh, d), lambda i, g: (row_of(i), g, 0))
    per_stat = pl.BlockSpec((None, bh), lambda i, g: (row_of(i), g))
    extra = {} if interpret else {"compiler_params": pl_triton.CompilerParams(
        num_warps=warps_dq, num_stages=stages_dq or default_stages)}
    dq, delta = pl.pallas_call(
        functools.partial(_dq_kernel, scale=d ** -0.5, bk=bk, s_rows=s, nw=nw, dtype=dtype, rows=rows, stretches=st),
        grid=(rows, h // bh),
        in_specs=[whole] * 3 + [per_head, _group_block_spec(do1.shape[2], bh, d, row_of), per_head, per_stat,
                                whole, whole],
        out_specs=[per_head, per_stat],
        out_shape=[jax.ShapeDtypeStruct((rows, h, d), dtype), jax.ShapeDtypeStruct((rows, h), jnp.float32)],
        interpret=interpret, name="bwd_dq", **extra,
    )(widx, eidx, eblk, q_rows, do1, o_rows, lse_rows, pool, entries)
    # dk over dk_heads (default all) heads a program
    hk = dk_heads or h
    bkk = bk_dk or bk
    widx, eidx, eblk = _indices(q, window_idx, entries, picks, visible, bkk)
    nw = widx.shape[1] // bkk
    do2 = _as_group_layout(do.astype(dtype), rows, h, d, do_groups, hk)
    per_head_k = pl.BlockSpec((None, hk, d), lambda i, g: (row_of(i), g, 0))
    per_stat_k = pl.BlockSpec((None, hk), lambda i, g: (row_of(i), g))
    dpool0 = jnp.zeros((pool.shape[0], pool.shape[1] + 1, d), jnp.float32)
    dents0 = jnp.zeros((entries.shape[0], entries.shape[1] + 1, d), jnp.float32)
    extra = {} if interpret else {"compiler_params": pl_triton.CompilerParams(
        num_warps=warps_dk, num_stages=stages_dk or default_stages)}
    dpool, dents = pl.pallas_call(
        functools.partial(_dk_kernel, scale=d ** -0.5, bk=bkk, s_rows=s, nw=nw, dtype=dtype, rows=rows, stretches=st,
                          trash_pool=pool.shape[1], trash_ents=entries.shape[1]),
        grid=(rows, h // hk),
        in_specs=[whole] * 3 + [per_head_k, _group_block_spec(do2.shape[2], hk, d, row_of), per_stat_k, per_stat_k,
                                whole, whole, whole, whole],
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(dpool0.shape, jnp.float32), jax.ShapeDtypeStruct(dents0.shape, jnp.float32)],
        input_output_aliases={9: 0, 10: 1},
        interpret=interpret, name="bwd_dk", **extra,
    )(widx, eidx, eblk, q_rows, do2, lse_rows, delta, pool, entries, dpool0, dents0)
    p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :] - lse_rows)
    dsinks = -jnp.sum(p_sink * delta, axis=0)
    return (dq.reshape(b, s, h, d), dpool[:, :-1].astype(pool.dtype), dsinks, dents[:, :-1].astype(entries.dtype))
