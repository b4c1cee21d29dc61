"""Sparse attention over gathered keys (spec sections 7 and 8): window + compressed + sink.

For a query at position t the keys (each also its own value, K = V) are

* the **window**: rotated kv of positions ``t-W+1 .. t`` (fewer at the start), gathered
  from a pool ``[window cache (W slots, slot p % W) | this call's S keys]``;
* the **compressed entries**: CSA gathers the indexer's picks (-1 = nothing); HCA takes
  every visible entry ``w < (t+1) // m`` (there is no selection); sliding layers have none.

Nothing of size [queries, all compressed entries] is built for CSA: each query touches
``W + index_topk`` keys, gathered per query, and the query axis is processed in blocks so
that the gathered keys [B, block, W + K, D] bound peak memory on long prefills.

Per head h, ``logit = q . key * D^-1/2``; a learned sink logit joins the softmax
denominator only (zero value vector); probabilities are float32, cast to the value dtype,
and the weighted sum accumulates in float32.

A paged cache's entries (`PagedRows`: a pool [P, E, D] and the rows' page table) are read in
place by the kernel: its source is the pool flattened to [1, P*E, D], shared by every query row,
and its indices the entries' pool rows (`pallas.paged_source`), so no step copies them into a
[B, T, D] array. The XLA path gathers them as it gathers a contiguous cache's: CSA's picks at
their pool rows (one gather), HCA's every slot (`PagedRows.view`: its dots read [B, T, D]). So
does the gradient of the kernel (`contiguous_entries`: the backward kernels take contiguous
entries, HCA's visible prefix as a range; their gradients go back to the pool by the gather's
transpose).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.backend import QUERY_BLOCK, Array, einsum, map_query_blocks, reference_vjp
from dsv4_jax.cache.paged import PagedRows
from dsv4_jax.ops.kernel_plan import AUTO, KernelPlan
from dsv4_jax.ops.rope import apply_rope, derotate_output
from dsv4_jax.ops.sparse_attention import backward_triton as sparse_attention_backward
from dsv4_jax.ops.sparse_attention import backward_wgmma as sparse_attention_backward_wgmma
from dsv4_jax.ops.sparse_attention import pallas as sparse_attention_kernel


class AttentionOutput(NamedTuple):
    """What `sparse_attention` returns: the output, and the attention masses when asked for.

    o               [B, S, H, D]       the attention output (compute dtype)
    sink_mass       [B, S, H] float32  share of each query's attention on the sink
    window_mass     [B, S, H] float32  ... on its window keys
    compressed_mass [B, S, H] float32  ... on compressed entries (0 without entries)

    The masses are None unless `with_mass` (the type never changes with the flag).
    """

    o: Array
    sink_mass: Array | None = None
    window_mass: Array | None = None
    compressed_mass: Array | None = None


class OutputRotation(NamedTuple):
    """The inverse RoPE at each query's position that the layer applies to the attention output
    (stage 6's first step, `rope.apply_rope(..., inverse=True)`), handed to `sparse_attention`
    so that it is part of the attention's gradient: the kernel path then keeps the de-rotated
    output as its backward's residual, and the output is rotated in its own buffer, not copied
    (on the H200 the copy cost 0.13 ms a layer of an HCA 4k training step).

    positions [B, S] int32 (the call's; -1 = padded slot), freqs float32 [rd/2] (NumPy: static),
    scale: the cos/sin scale (`rope.attention_factor`).
    """

    positions: Array
    freqs: np.ndarray
    scale: float = 1.0


def _derotate_transpose(do: Array, positions: Array, freqs: np.ndarray, scale: float) -> Array:
    """The transpose of `rope.derotate_output` (a rotation by the opposite angle, same cos/sin
    and scale)."""
    return apply_rope(do, positions[..., None], freqs, scale=scale, in_place=True)


def window_indices(positions: Array, length: Array, window: int) -> Array:
    """Pool indices of each query's window keys: int32 [B, S, W], -1 before position 0.

    The pool is ``[window cache in position order (W) | new keys (S)]`` (`key_pool`): position p
    sits at ``W + p - length`` whether it is this call's (p >= length) or the cache's, so each
    query's valid indices are consecutive (the range backward, `sparse_attention_backward_wgmma`,
    relies on it).
    """
    p = positions[..., None] - (window - 1) + jnp.arange(window, dtype=jnp.int32)[None, None]  # [B, S, W] ascending
    return jnp.where(p >= 0, window + p - length[:, None, None], -1).astype(jnp.int32)


def in_position_order(window_cache: Array, length: Array, window: int) -> Array:
    """The window cache [B, W, D] (position p in slot p % W) with index i holding position
    ``length - W + i``: the W positions before the call, oldest first (those before position 0
    hold whatever the slot does; no query reads them)."""
    slots = (length[:, None] - window + jnp.arange(window, dtype=jnp.int32)[None]) % window  # [B, W]
    return jnp.take_along_axis(window_cache, slots[..., None], axis=1)


def key_pool(window_before: Array, window_after: Array, keys: Array, positions: Array, length: Array,
             window: int) -> tuple[Array, Array, bool]:
    """The array a call's queries read their window keys from, their indices into it, and
    whether those indices are the array's own slots (`sparse_attention`'s `window_in_place`).

    window_before, window_after [B, W, D]: the window cache before and after the call's
    insert; keys [B, S, D] the call's rotated keys; positions [B, S]; length [B].

    * Decode (S = 1, keys in the cache's dtype): the cache after the insert, [B, W, D], which
      holds the query's window, its key and the W - 1 before it, one per slot (slot p % W);
      indices in slot order: slot j, or -1 while it holds no position yet (j > t). The
      window's keys are a set: the attention is the same in any order (up to the order of
      float sums). Reading the updated cache leaves the insert as the only use of the old one,
      so XLA writes the key in place instead of copying the cache for a reader; no pool is
      concatenated and the XLA path gathers nothing. (A row whose call overflows
      `max_seq_len` is written nothing and reads stale keys; its output is NaN by contract,
      `cache.overflows`.)
    * Otherwise: ``[window_before in position order | keys]`` [B, W+S, D] (`in_position_order`)
      and `window_indices` (ascending positions).

    Either way each query's valid indices are consecutive (slots 0..min(t, W-1) in decode).
    """
    if keys.shape[1] == 1 and window_after.dtype == keys.dtype:
        slot = jnp.arange(window, dtype=jnp.int32).reshape((1,) * positions.ndim + (window,))
        return window_after, jnp.where(slot <= positions[..., None], slot, -1).astype(jnp.int32), True
    ordered = in_position_order(window_before, length, window)
    return jnp.concatenate([ordered, keys], axis=1), window_indices(positions, length, window), False


def contiguous_entries(entries, picks: Array | None) -> tuple:
    """(entries, picks) as a contiguous cache's: paged entries (`PagedRows`) gathered from their
    pool, CSA's picks only where they are fewer than a row's slots (``S * K < T``: rows
    [B, S*K, D], picks ``s*K + j``, -1 kept; the same keys in the same order), else every slot
    (`PagedRows.view`, [B, T, D]); contiguous entries (or None) as they are."""
    if not isinstance(entries, PagedRows):
        return entries, picks
    if picks is not None and picks.shape[1] * picks.shape[2] < entries.shape[1]:
        b, s, k = picks.shape
        rows = entries.take(jnp.maximum(picks, 0).reshape(b, s * k))
        slots = jnp.arange(s * k, dtype=jnp.int32).reshape(1, s, k)
        return rows, jnp.where(picks >= 0, slots, -1).astype(picks.dtype)
    return entries.view(), picks


def sparse_attention(
    q: Array,
    pool: Array,
    window_idx: Array,
    sinks: Array,
    *,
    entries: Array | None = None,
    picks: Array | None = None,
    visible: Array | None = None,
    block: int = QUERY_BLOCK,
    precision=None,
    with_mass: bool = False,
    window_in_place: bool = False,
    rotation: OutputRotation | None = None,
    output_groups: int = 1,
    window_contiguous: bool = False,
    kernels: KernelPlan = AUTO,
) -> AttentionOutput:
    """Attention of each query over its window keys and its compressed entries, with sinks.

    q          [B, S, H, D]  rotated, normed queries (compute dtype)
    pool       [B, P, D]     the keys the window indices point into: [window cache | this
                             call's rotated keys] (P = W+S), or (decode) the updated cache (P = W)
    window_idx [B, S, W]     int32 pool indices, -1 = no key (from `window_indices` or `key_pool`)
    sinks      [H]           float32 sink logits
    entries    [B, T, D]     compressed entries (CSA/HCA), or None (sliding); or `PagedRows`
                             standing for them (a pool of the compute dtype: an FP8 pool is
                             dequantized first, `quantized.read_attended` / `read_picked`)
    picks      [B, S, K]     CSA: entry indices to attend, -1 = nothing
    visible    [B, S]        HCA: entries ``w < visible`` are all attended
    returns    `AttentionOutput`: o [B, S, H, D] and, if `with_mass`, the share of each
               query's attention on the sink, the window and the compressed entries (each
               float32 [B, S, H]; None otherwise)
    window_in_place: `window_idx[b, s, j]` is j or -1 (`key_pool`'s decode pool, S = 1): the
               XLA path reads the pool as the window keys, masked, instead of gathering a copy
    rotation:  `OutputRotation`: o is returned de-rotated by it (the layer's inverse RoPE), the
               same values as rotating the output afterwards
    output_groups: G of the grouped projection the output goes through next (the layer's
               wo_a, `cfg.o_groups`; H % G == 0): the backward kernel reads the output's
               cotangent in the [G, B*S, H/G, D] layout that projection's gradient leaves it
               in, instead of XLA transposing it to [B, S, H, D] first (a pass over it: on the
               H200 0.16 ms a layer of an HCA 4k training step). Values unchanged.
    window_contiguous: each query's valid window indices are consecutive pool indices (as
               `key_pool`'s are): the gradient may then read the window as one range
               (``attention_backward="wgmma"``, `sparse_attention_backward_wgmma`)
    kernels:   the step's `KernelPlan` (its ``decode_attention`` / ``prefill_attention``):
               without attention masses, `sparse_attention_kernel` may run instead of the XLA
               path; its gradient is `sparse_attention_backward`'s kernel or the XLA path's VJP
               (``attention_backward``), the XLA path's gradient either way
    """
    if output_groups < 1 or q.shape[2] % output_groups:
        raise ValueError(f"output_groups: expected a divisor of the {q.shape[2]} heads, got {output_groups}")
    if isinstance(entries, PagedRows) and not hasattr(entries.pool, "reshape"):
        raise TypeError(f"entries: expected paged entries in a pool of arrays (an FP8 pool dequantized "
                        f"first: quantized.read_attended), got a pool of {type(entries.pool).__name__}")
    if window_in_place and (q.shape[1] != 1 or window_idx.shape[-1] != pool.shape[1]):
        raise ValueError(f"window_in_place: expected one query per row and a pool of the window's "
                         f"{window_idx.shape[-1]} slots, got q {q.shape} and pool {pool.shape}")
    xla = functools.partial(_xla_path, block=block, precision=precision, with_mass=with_mass,
                            window_in_place=window_in_place)
    if not with_mass:
        def reference(q, pool, window_idx, sinks, entries, picks, visible):
            return xla(q, pool, window_idx, sinks, entries=entries, picks=picks, visible=visible).o

        chosen = kernels.attention_for(q, entries, picks, window_idx.shape[-1])
        if chosen is not None:
            static = None if rotation is None else (rotation.freqs, float(rotation.scale))
            attend = _by_kernel(reference, *chosen, kernels=kernels, rotation=static, output_groups=output_groups,
                                window_contiguous=window_contiguous)
            positions = None if rotation is None else rotation.positions
            return AttentionOutput(attend(q, pool, window_idx, sinks, entries, picks, visible, positions))
    out = xla(q, pool, window_idx, sinks, entries=entries, picks=picks, visible=visible)
    if rotation is None:
        return out
    return out._replace(o=derotate_output(out.o, rotation.positions, rotation.freqs, rotation.scale))


def _by_kernel(reference, blocks: dict, interpret: bool, kernels: KernelPlan, rotation: tuple | None = None,
               output_groups: int = 1, window_contiguous: bool = False):
    """``f(q, pool, window_idx, sinks, entries, picks, visible, positions) -> o`` by the kernel,
    with a gradient: a backward kernel or `reference`'s VJP, as the plan's ``attention_backward``
    names for the call (`KernelPlan.backward_for`). Not in interpret mode: the kernels
    on CUDA, `reference` (and its VJP) on any other platform the program is lowered for.

    `rotation`: None, or (freqs, scale) of the output's de-rotation at `positions` (an
    `OutputRotation`'s static part), applied to the kernel's output in place. The backward
    kernel then gets the de-rotated output as its residual, the cotangent rotated back, and the
    rotated channels' share of its `delta` (do' . o', computed here from their slices).
    `output_groups`: G, the cotangent goes to the backward kernel as [G, B*S, H/G, D]
    (`sparse_attention`). `window_contiguous`: the caller's promise that each window is a range
    (the range kernels, ``attention_backward="wgmma"``, may then take it). What else the plan
    decides for the call is asked here, where it is used: how the kernel's key splits are merged
    with the sink and de-rotated where it splits them (`KernelPlan.merge_for`: "xla", "pallas",
    "interpret", `split_merge_kernel`) and the gradient (`KernelPlan.backward_for`)."""

    def on_platform(kernel, default):
        if interpret:
            return kernel
        return functools.partial(jax.lax.platform_dependent, cuda=kernel, default=default)

    def derotate(o, positions):
        return o if rotation is None else derotate_output(o, positions, *rotation)

    def composed(q, pool, window_idx, sinks, entries, picks, visible, positions):
        return derotate(reference(q, pool, window_idx, sinks, entries, picks, visible), positions)

    def forward(q, pool, window_idx, sinks, entries, picks, visible, positions, with_lse=False):
        return sparse_attention_kernel.sparse_attention_kernel(
            q, pool, window_idx, sinks, entries=entries, picks=picks, visible=visible, interpret=interpret,
            with_lse=with_lse, rotation=None if rotation is None else (positions, *rotation),
            merge=merge(q, entries, picks), **blocks)

    attend = on_platform(forward, composed)
    bwd_blocks = dict(block_keys=sparse_attention_backward.BLOCK_KEYS,
                      block_heads=sparse_attention_backward.BLOCK_HEADS)

    def merge(q, entries, picks):
        kind = "csa" if picks is not None else "hca" if entries is not None else "sliding"
        return kernels.merge_for(kind, q.shape[0] * q.shape[1])

    def backward(q, entries, picks):
        return kernels.backward_for(q, entries, picks, interpret=interpret, window_contiguous=window_contiguous)

    @jax.custom_vjp
    def call(*args):
        return attend(*args)

    def fwd(*args):
        if backward(args[0], args[4], args[5]) == "xla":
            return attend(*args), (args, None, None)

        def reference_with_lse(*a):  # another platform's program: the reference (its VJP needs no lse)
            return composed(*a), jnp.zeros(a[0].shape[:3], jnp.float32)

        o, lse = on_platform(functools.partial(forward, with_lse=True), reference_with_lse)(*args)
        return o, (args, o, lse)

    def bwd(saved, do):
        args, o, lse = saved
        if lse is None:
            return reference_vjp(composed, args, do)

        def kernel_grads(q, pool, window_idx, sinks, entries, picks, visible, positions, o, lse, do):
            if not isinstance(entries, PagedRows):
                return contiguous_grads(q, pool, window_idx, sinks, entries, picks, visible, positions, o, lse, do)
            # The backward kernels take contiguous entries (the range kernels HCA's visible prefix
            # as a range, CSA's handler [B, T, D]): the rows gathered for them, their gradient
            # scattered back to the pool by the gather's transpose.
            rows, pull = jax.vjp(lambda p: contiguous_entries(entries.replace(pool=p), picks)[0], entries.pool)
            dq, dpool, dsinks, drows = contiguous_grads(q, pool, window_idx, sinks, rows,
                                                        contiguous_entries(entries, picks)[1], visible, positions,
                                                        o, lse, do)
            return dq, dpool, dsinks, entries.replace(pool=pull(drows)[0], table=None)

        def contiguous_grads(q, pool, window_idx, sinks, entries, picks, visible, positions, o, lse, do):
            b, s, h = q.shape[:3]
            # [G, R, H/G, D]: as the grouped output projection's gradient writes it, so that this
            # transpose and XLA's to [B, S, H, D] cancel.
            do = sparse_attention_backward.by_output_group(do.astype(q.dtype), output_groups)
            extra = {}
            if rotation is not None:
                n = 2 * rotation[0].shape[-1]
                # This share first: the rotation back then updates do' in its own buffer.
                o_tail = sparse_attention_backward.by_output_group(o[..., -n:], output_groups)
                delta_rotated = jnp.sum(do[..., -n:].astype(jnp.float32) * o_tail.astype(jnp.float32), axis=-1)
                do = _derotate_transpose(do, positions.reshape(1, b * s), *rotation)
                delta_rotated = delta_rotated.transpose(1, 0, 2).reshape(b, s, h)
                extra = dict(rotated=n, delta_rotated=delta_rotated)
            which = backward(q, entries, picks)
            if which == "wgmma":
                return sparse_attention_backward_wgmma.sparse_attention_backward_wgmma(
                    q, pool, window_idx, sinks, o, lse, do, entries=entries, visible=visible,
                    interpret=interpret, do_groups=output_groups, **extra)
            cuda = which == "cuda"
            return sparse_attention_backward.sparse_attention_backward(
                q, pool, window_idx, sinks, o, lse, do, entries=entries, picks=picks, visible=visible,
                interpret=interpret, do_groups=output_groups, cuda=cuda, **bwd_blocks, **extra)

        def reference_grads(*a):
            dq, dpool, _, dsinks, dentries, *_ = reference_vjp(composed, a[:8], a[-1])
            return dq, dpool, dsinks, dentries

        dq, dpool, dsinks, dentries = on_platform(kernel_grads, reference_grads)(*args, o, lse, do)
        return dq, dpool, None, dsinks, dentries, None, None, None

    call.defvjp(fwd, bwd)
    return call


def _xla_path(q, pool, window_idx, sinks, *, entries, picks, visible, block, precision,
              with_mass, window_in_place=False) -> AttentionOutput:
    """`sparse_attention` by XLA: the keys gathered into arrays, logits, softmax, sums."""
    if isinstance(entries, PagedRows) and picks is not None:
        # CSA on pages: each query's picks gathered from the pool [1, P*E, D] (shared by the rows:
        # the gather below broadcasts it) at their pool rows, one gather as from a contiguous cache.
        b, s, k = picks.shape
        entries, rows = sparse_attention_kernel.paged_source(entries, picks.reshape(b * s, k), b)
        picks = rows.reshape(b, s, k)
    else:  # HCA on pages: every slot (`PagedRows.view`)
        entries, picks = contiguous_entries(entries, picks)
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5
    selection = picks if picks is not None else visible

    def block_fn(qb, widx, sel, pool_, sinks_, ents):
        # Each part: (float32 logits [B, s, H, n], allowed mask, einsum for the values, values).
        if window_in_place:  # the pool is the window, slot j at index j (one query per row)
            kw = pool_[:, None]  # [B, 1, W, D]
        else:
            kw = jnp.take_along_axis(pool_[:, None], jnp.maximum(widx, 0)[..., None], axis=2)  # [B, s, W, D]
        parts = [(
            _logits(einsum("bshd,bswd->bshw", qb, kw, out_dtype=dtype, precision=precision), scale),
            (widx >= 0)[:, :, None, :], "bshw,bswd->bshd", kw,
        )]
        if ents is not None and picks is not None:  # CSA: the indexer's picks, gathered per query
            kc = jnp.take_along_axis(ents[:, None], jnp.maximum(sel, 0)[..., None], axis=2)  # [B, s, K, D]
            parts.append((
                _logits(einsum("bshd,bskd->bshk", qb, kc, out_dtype=dtype, precision=precision), scale),
                (sel >= 0)[:, :, None, :], "bshk,bskd->bshd", kc,
            ))
        elif ents is not None:  # HCA: every visible entry, shared by the row's queries
            seen = jnp.arange(ents.shape[1], dtype=jnp.int32)[None, None, :] < sel[..., None]
            # The barrier hides from XLA that this dot and the window's share the queries: XLA's
            # dot-merger would otherwise make them one dot over [window | entries], a new
            # array written every step (H200, HCA B = 32, 16k: an 11 us concatenation a layer
            # against a 5 us merged dot). Values unchanged.
            qe = jax.lax.optimization_barrier(qb)
            parts.append((
                _logits(einsum("bshd,btd->bsht", qe, ents, out_dtype=dtype, precision=precision), scale),
                seen[:, :, None, :], "bsht,btd->bshd", ents,
            ))

        z = jnp.concatenate([jnp.where(ok, lg, -jnp.inf) for lg, ok, _, _ in parts], axis=-1)
        sink = sinks_.astype(jnp.float32)[None, None, :, None]
        top = jnp.maximum(jnp.max(z, axis=-1, keepdims=True), sink)
        e = jnp.exp(z - top)
        e_sink = jnp.exp(sink - top)
        denom = jnp.sum(e, axis=-1, keepdims=True) + e_sink
        probs = e / denom  # [B, s, H, W (+K|T)] float32, sums to 1 - sink share

        out, masses, start = 0.0, [], 0
        for lg, _, spec, values in parts:
            p = probs[..., start : start + lg.shape[-1]]
            part = einsum(spec, p.astype(dtype), values, out_dtype=dtype, precision=precision)
            out = out + part.astype(jnp.float32)
            masses.append(jnp.sum(p, axis=-1))
            start += lg.shape[-1]
        out = out.astype(dtype)
        if not with_mass:
            return AttentionOutput(out)
        compressed_mass = masses[1] if len(masses) > 1 else jnp.zeros_like(masses[0])
        return AttentionOutput(out, (e_sink / denom)[..., 0], masses[0], compressed_mass)

    return map_query_blocks(block_fn, (q, window_idx, selection), (pool, sinks, entries), block)


def _logits(dots: Array, scale: float) -> Array:
    # The reference scales the logits in the compute dtype, then promotes to float32 when it
    # concatenates the float32 sink column.
    return (dots * scale).astype(jnp.float32)
