"""The backward pass of sparse attention as Pallas kernels (issue 28: training on the GPU).

XLA's gradient of the gather-based forward (`sparse_attention._xla_path`) scatters each
query's key gradients back over the gathered window and entries: [B, s, W + K, D] updates per
query block, onto the few keys many queries share, which XLA:GPU runs as contended scatters
(CSA 4k prefill on the H200: the backward 18x the forward). Here two kernels read each key by
index again, as the forward kernel does.

**By query** (`_by_query`): every query's gradient, and the key gradients of keys read in no
order (CSA's picks, a decode step's window) added into float32 accumulators by atomic adds:

    grid (R, H / bh); program (r, g) owns heads g*bh .. g*bh+bh-1 of query row r
    q, do  [bh, D]        the queries and the output's cotangent
    lse    [bh]           the forward's log-normaliser (keys and sink), `delta` = sum(do * o)
    per key block:
      k    [bk, D]        `src[r // S, idx]`, gathered by index (K = V: each key is its own value)
      p    [bh, bk]       exp(round(q k) * scale - lse), 0 where idx = -1
      ds   [bh, bk]       p * (do k - delta)                    (the logits' cotangent)
      dq  += ds k * scale                                       [bh, D], float32, written once
      dk   = (ds * scale) q + p do                             [bk, D], atomically added at idx
    the sink:  dsink = -sum_rows exp(sink - lse) * delta        (an XLA reduction outside)

**By key** (`_by_key`), where the queries of a row are in order (`queries_in_order`: the layer's
prefills): a window key is read by the W consecutive queries after it, an HCA entry by every
query from the first that sees it to the row's last, so each key's readers are one run of rows
(`reader_ranges`, from the indices themselves). A program owns a block of keys and sums their
gradient over its share of the readers in registers, then adds it once: no atomic add per
query and key (they were most of the by-query kernel's time: 128 window keys a query, each of
its 64 heads' gradients added into the same few rows by neighbouring queries).

    grid (B, N / bk, H / bh * splits); program (b, kb, g, j) owns keys kb*bk .. kb*bk+bk-1 of
    source row b, heads g*bh .. g*bh+bh-1 and the j-th of `splits` shares of their readers
      k    [bk, D]        the keys, loaded once
      per reader row s:   q, do [bh, D], lse, delta [bh]; p, ds as above, masked to the keys
                          whose readers include s
      dk  += (ds * scale) q + p do                              [bk, D], float32
    then one atomic add of dk (programs of other head blocks and shares add into the same rows)

The by-query kernel then computes dq alone for those keys (3 dots a key block instead of 5).
R = B * S query rows; row r reads the sources of batch row r // S. A key's gradient gets the
two contributions of K = V (through the logits and through the values). Rows past a row's
last entry block with a key are skipped (HCA's visible prefix, a prompt's early queries).

Numerics follow the reference's VJP up to the order of float32 sums and where it rounds the
logits' and values' cotangents to the compute dtype (here they stay float32): float32 equals
the XLA VJP within ~1e-5 (`tests/test_sparse_attention_backward.py`); bf16 within bf16 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import relaxed_atomics
from .backend import Array
from .sparse_attention_kernel import _pad_indices, entry_indices

# bh x D float32 for dq plus bh x D for q and do, per program: 32 x 512 keeps them in registers
# at V4-Flash's head_dim (64 heads a program would spill). Triton's dots need dimensions >= 16.
BLOCK_KEYS = 32
BLOCK_HEADS = 32
NUM_WARPS = 8
# Software pipelining of the key loop, by the compute dtype's bytes: bf16 3 stages (H200, CSA /
# HCA 4k prefill: 8.10 -> 7.41 / 3.27 -> 3.13 ms, bench/results/h200_backward_ab_2026-12-02_s35_3.json);
# float32 1 (its tiles take twice the shared memory; the float32 gate runs it as measured before).
NUM_STAGES = {2: 3, 4: 1}
# Reader rows a by-key program walks at most: a key block's readers are split into shares of
# about this many (a window block has W + bk - 1 readers, an HCA entry block up to S).
ROWS_PER_PROGRAM = 64


def _dot(a, b, contract, exact):
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=exact, preferred_element_type=jnp.float32)


def _key_cotangents(q, do, lse, delta, k, seen, scale, dtype, exact):
    """p [bh, bk] and the scaled logits' cotangent ds * scale (compute dtype) of one tile."""
    s = (_dot(q, k, ((1,), (1,)), exact).astype(dtype) * scale).astype(jnp.float32)  # the forward's rounding
    p = jnp.where(seen, jnp.exp(s - lse[:, None]), 0.0)
    ds = p * (_dot(do, k, ((1,), (1,)), exact) - delta[:, None])
    return p, (ds * scale).astype(dtype)


def _by_query_kernel(*refs, scale: float, block_keys: int, rows_per_source: int, n_window: int, n_entries: int,
                     dtype, pool_atomics: bool, entries_atomics: bool, trash_pool: int, trash_entries: int,
                     relaxed: bool):
    refs = list(refs)
    widx_ref = refs.pop(0)
    eidx_ref, eblocks_ref = (refs.pop(0), refs.pop(0)) if n_entries else (None, None)
    q_ref, do_ref, lse_ref, delta_ref, pool_ref = (refs.pop(0) for _ in range(5))
    ents_ref = refs.pop(0) if n_entries else None
    n_acc = pool_atomics + entries_atomics
    refs = refs[n_acc:]  # the aliased zero accumulators' input refs
    dq_ref = refs.pop(0)
    dpool_ref = refs.pop(0) if pool_atomics else None
    dents_ref = refs.pop(0) if entries_atomics else None

    r = pl.program_id(0)
    src = r // rows_per_source
    q, do = q_ref[...], do_ref[...]  # [bh, D]
    lse, delta = lse_ref[...], delta_ref[...]  # [bh] float32
    exact = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    cols = jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]

    def key_block(src_ref, idx_ref, grad_ref, trash, blk, dq):
        idx = idx_ref[r, pl.ds(blk * block_keys, block_keys)]  # [bk]
        k = src_ref[src, jnp.maximum(idx, 0), :].astype(dtype)  # [bk, D]
        p, ds_scaled = _key_cotangents(q, do, lse, delta, k, (idx >= 0)[None, :], scale, dtype, exact)
        dq = dq + _dot(ds_scaled, k, ((1,), (0,)), exact)
        if grad_ref is not None:
            dk = _dot(ds_scaled, q, ((0,), (0,)), exact) + _dot(p.astype(dtype), do, ((0,), (0,)), exact)  # [bk, D]
            # Keys a program does not have (-1) add into a trash row past the sources' rows.
            rows = jnp.broadcast_to(jnp.where(idx >= 0, idx, trash)[:, None], dk.shape)
            _atomic_add(grad_ref, (src, rows, jnp.broadcast_to(cols, dk.shape)), dk, relaxed)
        return dq

    def loop(src_ref, idx_ref, grad_ref, trash, n_blocks, dq):
        return jax.lax.fori_loop(0, n_blocks, lambda i, c: key_block(src_ref, idx_ref, grad_ref, trash, i, c), dq)

    dq = jnp.zeros(q.shape, jnp.float32)
    dq = loop(pool_ref, widx_ref, dpool_ref, trash_pool, n_window, dq)
    if n_entries:
        dq = loop(ents_ref, eidx_ref, dents_ref, trash_entries, eblocks_ref[r], dq)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _by_key_kernel(lo_ref, hi_ref, first_ref, last_ref, q_ref, do_ref, lse_ref, delta_ref, src_ref, _acc_in,
                   dsrc_ref, *, scale: float, block_keys: int, block_heads: int, rows_per_source: int, splits: int,
                   n_keys: int, dtype, relaxed: bool):
    b, kb, gj = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, j = gj // splits, gj % splits
    exact = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    keys = kb * block_keys + jnp.arange(block_keys, dtype=jnp.int32)  # [bk]
    k = src_ref[b, jnp.minimum(keys, n_keys - 1), :].astype(dtype)  # [bk, D]
    lo, hi = lo_ref[b, pl.ds(kb * block_keys, block_keys)], hi_ref[b, pl.ds(kb * block_keys, block_keys)]
    # This program's share of the block's reader rows first .. last (none: first > last).
    count = jnp.maximum(last_ref[b, kb] - first_ref[b, kb] + 1, 0)
    chunk = (count + splits - 1) // splits
    start = first_ref[b, kb] + j * chunk
    n_rows = jnp.clip(count - j * chunk, 0, chunk)
    heads = pl.ds(g * block_heads, block_heads)

    def reader(i, dk):
        s = start + i
        r = b * rows_per_source + s
        q, do = q_ref[r, heads, :], do_ref[r, heads, :]  # [bh, D]
        seen = ((lo <= s) & (s <= hi))[None, :]  # [1, bk]: the keys row s reads
        p, ds_scaled = _key_cotangents(q, do, lse_ref[r, heads], delta_ref[r, heads], k, seen, scale, dtype, exact)
        return dk + _dot(ds_scaled, q, ((0,), (0,)), exact) + _dot(p.astype(dtype), do, ((0,), (0,)), exact)

    dk = jax.lax.fori_loop(0, n_rows, reader, jnp.zeros(k.shape, jnp.float32))
    rows = jnp.broadcast_to(jnp.where(keys < n_keys, keys, n_keys)[:, None], dk.shape)  # padding: the trash row
    cols = jnp.broadcast_to(jnp.arange(k.shape[1], dtype=jnp.int32)[None, :], dk.shape)
    _atomic_add(dsrc_ref, (b, rows, cols), dk, relaxed)


def _atomic_add(ref, idx, values, relaxed: bool):
    if relaxed:
        relaxed_atomics.atomic_add(ref, idx, values)
    else:
        from jax.experimental.pallas import triton as pl_triton

        pl_triton.atomic_add(ref, idx, values)


def reader_ranges(index: Array, n_sources: int, n_keys: int, rows_per_source: int) -> tuple[Array, Array]:
    """The first and last query row (of its source row) that reads each key: lo, hi [B, N] int32
    (lo = S, hi = -1 for a key nobody reads), from index [R, L] (key numbers, -1 = none; row r
    reads source row r // S). Under `queries_in_order` a key's readers are every row in lo .. hi."""
    rows, width = index.shape
    src = jnp.broadcast_to((jnp.arange(rows, dtype=jnp.int32) // rows_per_source)[:, None], (rows, width))
    row = jnp.broadcast_to((jnp.arange(rows, dtype=jnp.int32) % rows_per_source)[:, None], (rows, width))
    slot = jnp.where(index >= 0, index, n_keys)  # nobody: a trash column, dropped
    lo = jnp.full((n_sources, n_keys + 1), rows_per_source, jnp.int32).at[src, slot].min(row)
    hi = jnp.full((n_sources, n_keys + 1), -1, jnp.int32).at[src, slot].max(row)
    return lo[:, :n_keys], hi[:, :n_keys]


def _by_key(q_rows, do_rows, lse_rows, delta, source, index, *, rows_per_source, max_readers, block_keys,
            block_heads, interpret, compiler_params, relaxed):
    """The key gradients of `source` [B, N, D] by key: float32 [B, N, D] (see the module doc)."""
    n_src, n_keys, d = source.shape
    h = q_rows.shape[1]
    bh = min(block_heads, h)
    lo, hi = reader_ranges(index, n_src, n_keys, rows_per_source)
    pad = -n_keys % block_keys
    lo = jnp.pad(lo, ((0, 0), (0, pad)), constant_values=rows_per_source)
    hi = jnp.pad(hi, ((0, 0), (0, pad)), constant_values=-1)
    n_blocks = lo.shape[1] // block_keys
    first = jnp.min(lo.reshape(n_src, n_blocks, block_keys), axis=2)
    last = jnp.max(hi.reshape(n_src, n_blocks, block_keys), axis=2)
    splits = max(1, -(-min(max_readers, rows_per_source) // ROWS_PER_PROGRAM))
    kernel = functools.partial(_by_key_kernel, scale=d ** -0.5, block_keys=block_keys, block_heads=bh,
                               rows_per_source=rows_per_source, splits=splits, n_keys=n_keys, dtype=q_rows.dtype,
                               relaxed=relaxed)
    acc = jnp.zeros((n_src, n_keys + 1, d), jnp.float32)
    whole = pl.no_block_spec
    out = pl.pallas_call(
        kernel,
        grid=(n_src, n_blocks, (h // bh) * splits),
        in_specs=[whole] * 10,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(acc.shape, acc.dtype),
        input_output_aliases={9: 0},
        interpret=interpret,
        name="sparse_attention_backward_by_key",
        **compiler_params,
    )(lo, hi, first, last, q_rows, do_rows, lse_rows, delta, source, acc)
    return out[:, :-1]


def sparse_attention_backward(q: Array, pool: Array, window_idx: Array, sinks: Array, o: Array, lse: Array,
                              do: Array, *, entries: Array | None = None, picks: Array | None = None,
                              visible: Array | None = None, interpret: bool = False,
                              block_keys: int = BLOCK_KEYS, block_heads: int = BLOCK_HEADS,
                              num_warps: int = NUM_WARPS, num_stages: int | None = None, relaxed: bool = True,
                              queries_in_order: bool = False):
    """The cotangents of `sparse_attention_kernel`'s inputs: (dq, dpool, dsinks, dentries).

    q [B, S, H, D], pool [B, P, D], window_idx [B, S, W], sinks [H], entries [B, T, D] with
    picks [B, S, K] or visible [B, S] (or none): the forward's arguments; o [B, S, H, D] and
    lse [B, S, H] float32 its output and log-normaliser (`sparse_attention_kernel(...,
    with_lse=True)`); do [B, S, H, D] the output's cotangent. Returns dq [B, S, H, D] (q's
    dtype), dpool [B, P, D] (pool's dtype), dsinks [H] float32, dentries [B, T, D] or None.

    queries_in_order: each row's queries are at consecutive ascending positions, padding (-1)
    after, and window_idx is `sparse_attention.window_indices` of them (the layer's calls of
    several queries a row): the window keys' and HCA entries' gradients are then summed by key
    (`_by_key`); otherwise, and for CSA's picks, added by query with atomics. Wrong gradients if
    the claim is false. `relaxed`: the atomic adds in relaxed memory order (`relaxed_atomics`;
    False: Pallas' acquire-release `atomic_add`, twice the time on the H200). `num_stages`:
    None, by q's dtype (`NUM_STAGES`).
    """
    b, s, h, d = q.shape
    rows = b * s
    bh = min(block_heads, h)
    dtype = q.dtype
    window_rows = window_idx.reshape(rows, -1).astype(jnp.int32)
    widx = _pad_indices(window_rows, block_keys)
    eidx_rows = entry_indices(rows, entries, picks, visible)
    by_key = queries_in_order and s > 1
    pool_atomics = not by_key
    entries_atomics = eidx_rows is not None and not (by_key and visible is not None)
    n_entries = 0
    index_args = [widx]
    if eidx_rows is not None:
        eidx = _pad_indices(eidx_rows.astype(jnp.int32), block_keys)
        n_entries = eidx.shape[1] // block_keys
        # [R] int32: entry blocks up to the row's last key (HCA: the visible prefix)
        last = jnp.max(jnp.where(eidx >= 0, jnp.arange(1, eidx.shape[1] + 1, dtype=jnp.int32), 0), axis=1)
        index_args += [eidx, (last + block_keys - 1) // block_keys]
    q_rows, do_rows = q.reshape(rows, h, d), do.astype(dtype).reshape(rows, h, d)
    lse_rows = lse.reshape(rows, h).astype(jnp.float32)
    delta = jnp.sum(do_rows.astype(jnp.float32) * o.reshape(rows, h, d).astype(jnp.float32), axis=-1)  # [R, H]
    # float32 accumulators of the atomic adds with one trash row each (keys a program does not have), zeros in.
    accumulators = []
    if pool_atomics:
        accumulators.append(jnp.zeros((pool.shape[0], pool.shape[1] + 1, d), jnp.float32))
    if entries_atomics:
        accumulators.append(jnp.zeros((entries.shape[0], entries.shape[1] + 1, d), jnp.float32))

    compiler_params = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        if num_stages is None:
            num_stages = NUM_STAGES.get(jnp.dtype(dtype).itemsize, 1)
        compiler_params["compiler_params"] = pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    kernel = functools.partial(_by_query_kernel, scale=d ** -0.5, block_keys=block_keys, rows_per_source=s,
                               n_window=widx.shape[1] // block_keys, n_entries=n_entries, dtype=dtype,
                               pool_atomics=pool_atomics, entries_atomics=entries_atomics,
                               trash_pool=pool.shape[1], trash_entries=0 if entries is None else entries.shape[1],
                               relaxed=relaxed)
    whole = pl.no_block_spec
    per_head = pl.BlockSpec((None, bh, d), lambda i, g: (i, g, 0))
    per_head_stat = pl.BlockSpec((None, bh), lambda i, g: (i, g))
    sources = [pool] + ([entries] if eidx_rows is not None else [])
    args = [*index_args, q_rows, do_rows, lse_rows, delta, *sources, *accumulators]
    in_specs = ([whole] * len(index_args) + [per_head, per_head, per_head_stat, per_head_stat]
                + [whole] * (len(sources) + len(accumulators)))
    first_acc = len(args) - len(accumulators)
    out_shape = [jax.ShapeDtypeStruct((rows, h, d), dtype), *(jax.ShapeDtypeStruct(a.shape, a.dtype)
                                                              for a in accumulators)]
    dq, *added = pl.pallas_call(
        kernel,
        grid=(rows, h // bh),
        in_specs=in_specs,
        out_specs=[per_head] + [whole] * len(accumulators),
        out_shape=out_shape,
        input_output_aliases={first_acc + i: 1 + i for i in range(len(accumulators))},
        interpret=interpret,
        name="sparse_attention_backward",
        **compiler_params,
    )(*args)
    added = iter(added)
    by_key_args = dict(rows_per_source=s, block_keys=block_keys, block_heads=block_heads, interpret=interpret,
                       compiler_params=compiler_params, relaxed=relaxed)
    if pool_atomics:
        dpool = next(added)[:, :-1]
    else:  # a window key is read by the W queries from its own position on
        dpool = _by_key(q_rows, do_rows, lse_rows, delta, pool, window_rows,
                        max_readers=window_rows.shape[1] + block_keys - 1, **by_key_args)
    dentries = None
    if entries_atomics:
        dentries = next(added)[:, :-1]
    elif eidx_rows is not None:  # HCA by key: an entry is read by every query from the first that sees it
        dentries = _by_key(q_rows, do_rows, lse_rows, delta, entries, eidx_rows, max_readers=s, **by_key_args)
    p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :] - lse_rows)  # [R, H]
    dsinks = -jnp.sum(p_sink * delta, axis=0)
    dentries = None if dentries is None else dentries.astype(entries.dtype)
    return dq.reshape(b, s, h, d), dpool.astype(pool.dtype), dsinks, dentries
