"""The backward pass of sparse attention as one Pallas kernel (training on the GPU).

XLA's gradient of the gather-based forward (`sparse_attention._xla_path`) scatters each
query's key gradients back over the gathered window and entries: [B, s, W + K, D] updates per
query block, onto the few keys many queries share, which XLA:GPU runs as contended scatters
(CSA 4k prefill on the H200: the backward 18x the forward). Here the backward reads each key
by index again, as the forward kernel does, and adds its gradient into a float32 accumulator
by atomic adds:

    grid (R, H / bh); program (i, g) owns heads g*bh .. g*bh+bh-1 of query row r = _row_of(i)
                          (launched in a spread order: `ROW_STRETCHES`)
    q, do  [bh, D]        the queries and the output's cotangent
    lse    [bh]           the forward's log-normaliser (keys and sink)
    delta  [bh]           sum(do * o) over D, from the output's tile (written out for the sink)
    per key block:
      k    [bk, D]        `src[r // S, idx]`, gathered by index (K = V: each key is its own value)
      p    [bh, bk]       exp(round(q k) * scale - lse), 0 where idx = -1
      ds   [bh, bk]       p * (do k - delta)                    (the logits' cotangent)
      dq  += ds k * scale                                       [bh, D], float32, written once
      dk   = (ds * scale) q + p do                             [bk, D], atomically added at idx
    the sink:  dsink = -sum_rows exp(sink - lse) * delta        (an XLA reduction outside)

Five dots a key block (q k, do k, ds k, ds q, p do), each with bh = 32 rows. A three-dot form
on the rows of q and do stacked once per program (x = [q; do], x k -> [s; dp] with 2bh = 64
rows, the M of Hopper's wgmma, and [ds * scale; p]^T x -> dk) computed the same gradients but
made the H200's training step 1.5-1.9x slower; it was removed (git history keeps it;
docs/breaks_and_kernels.md, "Why the kernels' defaults").

`delta` is the kernel's own (it loads the tile of do anyway): a separate pass over o and do
cost 0.15 ms a layer of an HCA 4k training step on the H200. Where the caller holds the output
only after a linear map of its trailing channels (the layer's inverse RoPE, which
`sparse_attention` applies in place so that the output is not copied for this residual), it
passes that o' and the rotated channels' share of delta separately (`rotated`,
`delta_rotated`): do . o = do' . o' over those channels for any linear map, and the others are
equal.

The cotangent may come as [G, R, H/G, D] (`do_groups`): the layout in which the layer's grouped
output projection's gradient writes it, read as it is (a program's heads are whole groups or a
part of one), instead of XLA transposing it to [B, S, H, D] first.

R = B * S query rows; row r reads the sources of batch row r // S. A key's gradient gets the
two contributions of K = V (through the logits and through the values). Rows past a row's
last entry block with a key are skipped (HCA's visible prefix, a prompt's early queries).

Numerics follow the reference's VJP up to the order of float32 sums and where it rounds the
logits' and values' cotangents to the compute dtype (here they stay float32): float32 equals
the XLA VJP within ~1e-5 (`tests/ops/test_sparse_attention_backward.py`); bf16 within bf16 rounding.

CSA's calls in bf16 at 64 heads of 512 (V4-Flash's shapes; V4-Pro's 128 heads take the Triton
kernel) can go to a CUDA handler instead
(`cuda=True`, `supports(..., cuda=True)`; csrc/sparse_attention_backward_cuda.cu through
`native.sparse_attention_backward`): the same contract and roundings, one block of 8 warps a
query row with all 64 heads, so that each key's gradient is summed over the heads before its one
atomic add (here a program's 32 heads add theirs: 64 heads a program exceed Triton's registers).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsv4_jax import native
from dsv4_jax.backend import Array
from dsv4_jax.ops.sparse_attention import pallas as sparse_attention_kernel
from dsv4_jax.ops.sparse_attention import relaxed_atomics
from dsv4_jax.ops.sparse_attention.pallas import _pad_indices, entry_indices

# bh x D float32 for dq plus bh x D for q and do, per program. 64 heads, or 64 keys, a program
# exceed the H200's shared memory at V4-Flash's head_dim; 16 keys in 4 warps measured faster
# than 32 in 8 on the H200 (bf16, 4k prefill; docs/breaks_and_kernels.md, "Why the kernels' defaults").
# Triton's dots need dimensions >= 16.
BLOCK_KEYS = 16
BLOCK_HEADS = 32
NUM_WARPS = 4
# Software pipelining of the key loop, by the compute dtype's bytes: bf16 3 stages (measured faster
# on the H200 for CSA and HCA 4k prefill, same section of docs/breaks_and_kernels.md);
# float32 1 (its tiles take twice the shared memory; the float32 gate runs it as measured before).
NUM_STAGES = {2: 3, 4: 1}
# Programs run in launch order, about one an SM at a time: in row order, the ~130 programs in
# flight are neighbouring queries whose windows (and often picks) share most keys, so their
# atomic adds queue on the same addresses. Launch i runs row (i % G) * (R / G) + i // G: the
# programs in flight are spread over G stretches of the rows (G the largest power of two up to
# ROW_STRETCHES dividing R; 1 keeps row order).
ROW_STRETCHES = 16


def row_stretches(rows: int, most: int = ROW_STRETCHES) -> int:
    """G: the largest power of two <= `most` that divides `rows` (1 for odd `rows`)."""
    g = 1
    while g * 2 <= most and rows % (g * 2) == 0:
        g *= 2
    return g


def _row_of(i, rows: int, stretches: int):
    """The query row that launch `i` runs (a bijection of [0, rows))."""
    if stretches == 1:
        return i
    return (i % stretches) * (rows // stretches) + i // stretches


def _bwd_kernel(*refs, scale: float, block_keys: int, rows_per_source: int, n_window: int, n_entries: int,
                dtype, trash_pool: int, trash_entries: int, relaxed: bool, rotated: int, rows: int, stretches: int):
    refs = list(refs)
    widx_ref = refs.pop(0)
    eidx_ref, eblocks_ref = (refs.pop(0), refs.pop(0)) if n_entries else (None, None)
    q_ref, do_ref, o_ref, lse_ref = (refs.pop(0) for _ in range(4))
    delta_rotated_ref = refs.pop(0) if rotated else None
    pool_ref = refs.pop(0)
    ents_ref = refs.pop(0) if n_entries else None
    refs = refs[2 if n_entries else 1:]  # the aliased zero accumulators' input refs
    dq_ref, dpool_ref = refs[0], refs[1]
    dents_ref = refs[2] if n_entries else None
    delta_ref = refs[-1]

    r = _row_of(pl.program_id(0), rows, stretches)
    src = r // rows_per_source
    q = q_ref[...]  # [bh, D]
    do = do_ref[...].reshape(q.shape)  # [bh / hpg, hpg, D] or [bh, D] (the heads of the block in order)
    lse = lse_ref[...]  # [bh] float32
    exact = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    cols = jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
    terms = do.astype(jnp.float32) * o_ref[...].astype(jnp.float32)  # [bh, D]
    if rotated:  # o' = M o on the trailing channels: their share comes in as do' . o'
        terms = jnp.where(cols < q.shape[1] - rotated, terms, 0.0)
        delta = jnp.sum(terms, axis=1) + delta_rotated_ref[...]
    else:
        delta = jnp.sum(terms, axis=1)
    delta_ref[...] = delta

    def dot(a, b, contract):
        return jax.lax.dot_general(a, b, (contract, ((), ())), precision=exact, preferred_element_type=jnp.float32)

    def key_block(src_ref, idx_ref, grad_ref, trash, blk, dq):
        idx = idx_ref[r, pl.ds(blk * block_keys, block_keys)]  # [bk]
        k = src_ref[src, jnp.maximum(idx, 0), :].astype(dtype)  # [bk, D]
        logits, dp = dot(q, k, ((1,), (1,))), dot(do, k, ((1,), (1,)))
        s = (logits.astype(dtype) * scale).astype(jnp.float32)  # the forward's rounding
        p = jnp.where((idx >= 0)[None, :], jnp.exp(s - lse[:, None]), 0.0)  # [bh, bk]
        ds = p * (dp - delta[:, None])
        ds_scaled = (ds * scale).astype(dtype)
        dq = dq + dot(ds_scaled, k, ((1,), (0,)))
        dk = dot(ds_scaled, q, ((0,), (0,))) + dot(p.astype(dtype), do, ((0,), (0,)))  # [bk, D]
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


def _atomic_add(ref, idx, values, relaxed: bool):
    if relaxed:
        relaxed_atomics.atomic_add(ref, idx, values)
    else:
        from jax.experimental.pallas import triton as pl_triton

        pl_triton.atomic_add(ref, idx, values)


def supports(q: Array, entries: Array | None, picks: Array | None, *, cuda: bool = False) -> bool:
    """Whether the backward takes the call on a GPU: the Triton kernel wherever the forward kernel
    takes its blocks (`BLOCK_KEYS`, `BLOCK_HEADS`); with `cuda`, the CUDA handler
    (`native.sparse_attention_backward`): CSA's picks, bf16, 64 heads of 512 channels, the CUDA
    extension built and a GPU in this process."""
    if not cuda:
        return sparse_attention_kernel.supports(q, block_keys=BLOCK_KEYS, block_heads=BLOCK_HEADS)
    return (picks is not None and entries is not None and q.dtype == jnp.bfloat16
            and q.shape[2:] == (native.BACKWARD_HEADS, native.BACKWARD_DIM) and native.available("cuda"))


def _by_cuda(q, pool, window_idx, sinks, o, lse, do, entries, picks, rotated, delta_rotated, do_groups,
             row_stretches_most):
    """`sparse_attention_backward` by the CUDA handler (`supports(..., cuda=True)`): the same contract."""
    if not supports(q, entries, picks, cuda=True):
        why = native.unavailable_reason("cuda") or "it takes CSA's picks in bf16 with 64 heads of 512"
        raise ValueError(f"cuda=True: the CUDA handler does not take q {q.dtype}{list(q.shape)} with "
                         f"{'picks' if picks is not None else 'no picks'} here ({why}); use the Triton kernel "
                         "(cuda=False)")
    b, s, h, d = q.shape
    rows = b * s
    do_by_group = _as_group_layout(do.astype(q.dtype), rows, h, d, do_groups, h)  # [G, R, H/G, D]
    lse_rows = lse.reshape(rows, h).astype(jnp.float32)
    delta_rotated = (jnp.zeros((rows, h), jnp.float32) if not rotated
                     else delta_rotated.reshape(rows, h).astype(jnp.float32))
    dq, dpool, dents, delta = native.sparse_attention_backward(
        q.reshape(rows, h, d), do_by_group, o.reshape(rows, h, d).astype(q.dtype), lse_rows, delta_rotated,
        pool.astype(q.dtype), window_idx.reshape(rows, -1).astype(jnp.int32), entries.astype(q.dtype),
        picks.reshape(rows, -1).astype(jnp.int32), scale=d ** -0.5, rotated=rotated,
        stretches=row_stretches(rows, row_stretches_most))
    return dq.reshape(b, s, h, d), dpool.astype(pool.dtype), _sink_gradient(sinks, lse_rows, delta), \
        dents.astype(entries.dtype)


def _sink_gradient(sinks: Array, lse_rows: Array, delta: Array) -> Array:
    """dsinks [H] float32 = -sum over rows of exp(sink - lse) * delta (lse, delta [R, H] float32)."""
    p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :] - lse_rows)  # [R, H]
    return -jnp.sum(p_sink * delta, axis=0)


def by_output_group(x: Array, groups: int) -> Array:
    """[B, S, H, C] -> [G, B*S, H/G, C] (head g*H/G + j of row r at [g, r, j]): the layout of
    `do_groups`. A caller holding the cotangent in that layout's transpose gets a no-op."""
    b, s, h, c = x.shape
    return x.reshape(b * s, groups, h // groups, c).transpose(1, 0, 2, 3)


def _as_group_layout(do: Array, rows: int, h: int, d: int, groups: int | None, bh: int) -> Array:
    """do as [G, R, H/G, D], G such that a program's bh heads are whole groups or lie in one
    (`_group_block_spec`); other groupings are rearranged into one group (a transpose)."""
    if groups is None:
        return do.reshape(1, rows, h, d)
    if do.shape != (groups, rows, h // groups, d):
        raise ValueError(f"do: expected [G, B*S, H/G, D] = {(groups, rows, h // groups, d)} with "
                         f"do_groups={groups}, got {do.shape}")
    hpg = h // groups
    if bh % hpg == 0 or hpg % bh == 0:
        return do
    return do.transpose(1, 0, 2, 3).reshape(1, rows, h, d)


def _group_block_spec(hpg: int, bh: int, d: int, row_of) -> pl.BlockSpec:
    """Program (i, g)'s heads g*bh .. g*bh+bh-1 of row `row_of(i)` in do [G, R, hpg, D]: bh / hpg
    whole groups, or a part of one group."""
    if bh % hpg == 0:
        return pl.BlockSpec((bh // hpg, None, hpg, d), lambda i, g: (g, row_of(i), 0, 0))
    per = hpg // bh
    return pl.BlockSpec((None, None, bh, d), lambda i, g: (g // per, row_of(i), g % per, 0))


def sparse_attention_backward(q: Array, pool: Array, window_idx: Array, sinks: Array, o: Array, lse: Array,
                              do: Array, *, entries: Array | None = None, picks: Array | None = None,
                              visible: Array | None = None, interpret: bool = False,
                              block_keys: int = BLOCK_KEYS, block_heads: int = BLOCK_HEADS,
                              num_warps: int = NUM_WARPS, num_stages: int | None = None, relaxed: bool = True,
                              rotated: int = 0, delta_rotated: Array | None = None,
                              row_stretches_most: int = ROW_STRETCHES, do_groups: int | None = None,
                              cuda: bool = False):
    """The cotangents of `sparse_attention_kernel`'s inputs: (dq, dpool, dsinks, dentries).

    q [B, S, H, D], pool [B, P, D], window_idx [B, S, W], sinks [H], entries [B, T, D] with
    picks [B, S, K] or visible [B, S] (or none): the forward's arguments; o [B, S, H, D] and
    lse [B, S, H] float32 its output and log-normaliser (`sparse_attention_kernel(...,
    with_lse=True)`); do [B, S, H, D] the output's cotangent. Returns dq [B, S, H, D] (q's
    dtype), dpool [B, P, D] (pool's dtype), dsinks [H] float32, dentries [B, T, D] or None.
    `rotated` > 0: o is o' = M o, the output after a linear map M of its trailing `rotated`
    channels, do = M^T do' the cotangent brought back through it, and `delta_rotated` [B, S, H]
    float32 the sum of do' * o' over those channels (`sparse_attention`'s output rotation).
    `relaxed`: the key gradients' atomic adds in relaxed memory order (`relaxed_atomics`; False:
    Pallas' acquire-release `atomic_add`, twice the time on the H200). `num_stages`: None, by
    q's dtype (`NUM_STAGES`). `row_stretches_most`: the launch order's spread (`ROW_STRETCHES`;
    1 launches the rows in order). `do_groups`: None, do is [B, S, H, D]; G, do is [G, B*S, H/G, D]
    (head g*H/G + j of row r at [g, r, j]), the layout in which the gradient of a grouped
    output projection (the layer's wo_a, batched over its G groups) leaves it: read as it is,
    XLA's transpose of it to [B, S, H, D] (a pass over it) cancels against the caller's.
    `cuda`: by the CUDA handler instead of the Triton kernel (where `supports(..., cuda=True)`; the block and
    launch options other than `row_stretches_most` are the Triton kernel's).
    """
    if rotated and delta_rotated is None:
        raise ValueError(f"delta_rotated: expected the rotated channels' share of delta [B, S, H] with "
                         f"rotated={rotated}, got None")
    if cuda:
        return _by_cuda(q, pool, window_idx, sinks, o, lse, do, entries, picks, rotated, delta_rotated, do_groups,
                        row_stretches_most)
    b, s, h, d = q.shape
    rows = b * s
    bh = min(block_heads, h)
    dtype = q.dtype
    widx = _pad_indices(window_idx.reshape(rows, -1).astype(jnp.int32), block_keys)
    eidx = entry_indices(rows, entries, picks, visible)
    n_entries = 0
    index_args = [widx]
    if eidx is not None:
        eidx = _pad_indices(eidx.astype(jnp.int32), block_keys)
        n_entries = eidx.shape[1] // block_keys
        # [R] int32: entry blocks up to the row's last key (HCA: the visible prefix)
        last = jnp.max(jnp.where(eidx >= 0, jnp.arange(1, eidx.shape[1] + 1, dtype=jnp.int32), 0), axis=1)
        index_args += [eidx, (last + block_keys - 1) // block_keys]
    do_by_group = _as_group_layout(do.astype(dtype), rows, h, d, do_groups, bh)  # [G, R, H/G, D]
    q_rows = q.reshape(rows, h, d)
    lse_rows = lse.reshape(rows, h).astype(jnp.float32)
    o_rows = o.reshape(rows, h, d)
    stats = [lse_rows] + ([delta_rotated.reshape(rows, h).astype(jnp.float32)] if rotated else [])
    # float32 accumulators with one trash row each (keys a program does not have), zeros in.
    dpool0 = jnp.zeros((pool.shape[0], pool.shape[1] + 1, d), jnp.float32)
    dents0 = None if eidx is None else jnp.zeros((entries.shape[0], entries.shape[1] + 1, d), jnp.float32)

    stretches = row_stretches(rows, row_stretches_most)
    kernel = functools.partial(_bwd_kernel, scale=d ** -0.5, block_keys=block_keys, rows_per_source=s,
                               n_window=widx.shape[1] // block_keys, n_entries=n_entries, dtype=dtype,
                               trash_pool=pool.shape[1], trash_entries=0 if eidx is None else entries.shape[1],
                               relaxed=relaxed, rotated=rotated, rows=rows, stretches=stretches)
    whole = pl.no_block_spec
    per_head = pl.BlockSpec((None, bh, d), lambda i, g: (_row_of(i, rows, stretches), g, 0))
    per_head_stat = pl.BlockSpec((None, bh), lambda i, g: (_row_of(i, rows, stretches), g))
    per_head_of_groups = _group_block_spec(do_by_group.shape[2], bh, d, lambda i: _row_of(i, rows, stretches))
    sources = [pool] + ([entries] if eidx is not None else [])
    accumulators = [dpool0] + ([dents0] if eidx is not None else [])
    args = [*index_args, q_rows, do_by_group, o_rows, *stats, *sources, *accumulators]
    in_specs = ([whole] * len(index_args) + [per_head, per_head_of_groups, per_head] + [per_head_stat] * len(stats)
                + [whole] * (len(sources) + len(accumulators)))
    first_acc = len(args) - len(accumulators)
    out_shape = [jax.ShapeDtypeStruct((rows, h, d), dtype),
                 *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in accumulators),
                 jax.ShapeDtypeStruct((rows, h), jnp.float32)]  # delta
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        if num_stages is None:
            num_stages = NUM_STAGES.get(jnp.dtype(dtype).itemsize, 1)
        extra["compiler_params"] = pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    dq, dpool, *dents, delta = pl.pallas_call(
        kernel,
        grid=(rows, h // bh),
        in_specs=in_specs,
        out_specs=[per_head] + [whole] * len(accumulators) + [per_head_stat],
        out_shape=out_shape,
        input_output_aliases={first_acc + i: 1 + i for i in range(len(accumulators))},
        interpret=interpret,
        name="sparse_attention_backward",
        **extra,
    )(*args)
    dsinks = _sink_gradient(sinks, lse_rows, delta)
    dentries = None if eidx is None else dents[0][:, :-1].astype(entries.dtype)
    return dq.reshape(b, s, h, d), dpool[:, :-1].astype(pool.dtype), dsinks, dentries
