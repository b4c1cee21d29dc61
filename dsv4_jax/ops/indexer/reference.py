"""Lightning indexer of CSA layers (spec section 6): pick top-k compressed entries per query.

Contract of `select_topk` (the function the host break calls):

* index unit: a compressed entry (entry w covers positions ``w*m .. w*m+m-1``, plus the
  previous window through the CSA overlap);
* score: ``I[t, w] = sum_h w_{t,h} * relu(qI_{t,h} . KI_w) * c^-1/2`` in float32, where
  ``w_{t,h} = (x_t Wproj)_h * nI^-1/2`` may be negative;
* causality: only entries with ``w < (t + 1) // m`` (completed windows) are candidates;
* order: descending score, **equal scores to the lower entry index** (the reference rule;
  `lax.top_k` is stable and the NumPy twin matches it; -0.0 is folded into +0.0 first);
* output: a `Selection`: int32 picks ``[B, S, index_topk]``, valid picks first, then -1 for
  "nothing" (a query with fewer than index_topk visible entries, or an empty cache), and the
  float32 scores ``[B, S, T]`` when asked for (else None: the type never changes with the flag).

The same functions run under XLA (in-graph, ``break_mode="none"``) and under NumPy inside a
`jax.pure_callback` (the host break, see `breaks`). Queries with ``visible = 0`` (a ragged
call's padded slots, position -1, and queries before the first completed window) get -1 picks
and no scores: the native handlers do no work for them, and the NumPy twin skips them when
they are at least half of the call; the fixed-shape XLA program scores every slot. Scoring
is blocked over queries so that the per-head temporary [B, block, nI, T] stays bounded on
long prefills.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from flax import struct

from dsv4_jax.backend import QUERY_BLOCK, Array, einsum, map_query_blocks, namespace, top_k_stable
from dsv4_jax.cache.quantized import read
from dsv4_jax.ops.compress.reference import CompressorWeights
from dsv4_jax.ops.rope import apply_rope


class Selection(NamedTuple):
    """What every indexer selection returns (`select_topk`, the breaks, the native handler).

    picks:  int32 [B, S, top_k], descending score, -1 = nothing
    scores: float32 [B, S, T], -inf where not visible; None unless asked for (`with_scores`)

    A pytree: a None field has no leaves, so a host break returns only the picks.
    """

    picks: Array
    scores: Array | None = None


@struct.dataclass
class IndexerWeights:
    """q_b_proj: [q_lora_rank, nI*c]; weights_proj: [hidden, nI]; compressor: the key compressor."""

    q_b_proj: Array
    weights_proj: Array
    compressor: CompressorWeights


def head_weights(projected: Array, n_heads: int) -> Array:
    """Per-query head weights ``(x Wproj) * nI^-1/2`` from the projection ``x Wproj``
    [B, S, nI] (one of the layer's input GEMMs, `step.input_projections`) -> float32."""
    return projected.astype(np.float32) * (n_heads**-0.5)


def index_queries(q_residual: Array, q_b_proj: Array, positions: Array, freqs: Array, *, n_heads: int,
                  rope_scale: float, dtype, precision=None) -> Array:
    """Indexer queries: q_residual [B, S, Lq] -> [B, S, nI, c], rotated at the query positions.

    No norm (unlike the attention queries); compress-rope frequencies on the trailing channels.
    """
    q = einsum("bsl,lc->bsc", q_residual, q_b_proj, out_dtype=dtype, precision=precision)
    q = q.reshape(*q.shape[:2], n_heads, -1)
    return apply_rope(q, positions[..., None], freqs, scale=rope_scale)


def _block_scores(queries: Array, weights: Array, visible: Array, keys: Array) -> Array:
    xp = namespace(queries, weights, keys, visible)
    # float32 scores as the reference takes them; HIGHEST so that a GPU does not use TF32
    # (the host twin computes exact float32: near-ties must be ordered alike in every mode).
    dots = einsum("bshc,btc->bsht", queries, keys, out_dtype=np.float32, precision="highest")  # [B, s, nI, T]
    # Same order of operations as the reference: relu(q.k) * c^-1/2, times the head weight, sum.
    s = (xp.maximum(dots, 0.0) * np.float32(queries.shape[-1] ** -0.5) * weights[..., None]).sum(axis=2)
    s = xp.where(s == 0, np.float32(0.0), s)  # fold -0.0 into +0.0: ties must compare equal
    seen = xp.arange(keys.shape[1], dtype=np.int32)[None, None, :] < visible[..., None]
    return xp.where(seen, s, np.float32(-np.inf))


def index_scores(queries: Array, weights: Array, keys: Array, visible: Array, *, block: int = QUERY_BLOCK) -> Array:
    """Indexer scores, float32 [B, S, T]; entries a query may not see are -inf.

    queries [B, S, nI, c], weights float32 [B, S, nI], keys [B, T, c], visible int [B, S].
    """
    return map_query_blocks(_block_scores, (queries, weights, visible), (keys,), block)


def picks_from_scores(scores: Array, visible: Array, top_k: int) -> Array:
    """Stable top-k of float32 scores [B, S, T] -> int32 [B, S, top_k] with -1 padding."""
    xp = namespace(scores, visible)
    k = min(top_k, scores.shape[-1])
    picks = top_k_stable(scores, k)
    picks = xp.where(picks < visible[..., None], picks, np.int32(-1)).astype(np.int32)
    if k < top_k:
        pad = xp.full((*picks.shape[:-1], top_k - k), -1, dtype=np.int32)
        picks = xp.concatenate([picks, pad], axis=-1)
    return picks


def select_topk(queries: Array, weights: Array, keys: Array, visible: Array, *, top_k: int,
                with_scores: bool = False, block: int = QUERY_BLOCK) -> Selection:
    """The indexer's selection: scores, then stable top-k with -1 padding (module contract).

    queries [B, S, nI, c], weights float32 [B, S, nI], keys [B, T, c] (or an FP8 cache's
    `QuantizedRows`), visible int32 [B, S] -> `Selection(picks int32 [B, S, top_k], scores
    float32 [B, S, T] or None)`; the scores are returned only if `with_scores`. Blocked over
    queries: only [B, block, nI, T] exists at a time.
    """

    keys = read(keys)  # an FP8 cache's keys (`QuantizedRows`) as the array they stand for

    def select_block(q, w, vis, k):
        scores = _block_scores(q, w, vis, k)
        return Selection(picks_from_scores(scores, vis, top_k), scores if with_scores else None)

    if namespace(queries, weights, keys, visible) is np and 2 * int((visible > 0).sum()) <= visible.size:
        # The NumPy twin (host breaks) scores only the queries that see an entry: padded slots
        # of a ragged call (and queries before the first completed window) cost nothing.
        return _select_seen(select_block, queries, weights, keys, visible, top_k, with_scores, block)
    return map_query_blocks(select_block, (queries, weights, visible), (keys,), block)


def _select_seen(select_block, queries, weights, keys, visible, top_k, with_scores, block) -> Selection:
    """`select_topk` in NumPy over each row's span of queries with ``visible > 0`` only; the
    others get what the full computation gives them (-1 picks, -inf scores). The same formula on
    a slice: a float32 score may round differently in its last bit, as between any two call
    shapes of NumPy's einsum (the caveat of "Same picks, same outputs" in docs/breaks_and_kernels.md)."""
    batch, seq = visible.shape
    picks = np.full((batch, seq, top_k), -1, np.int32)
    scores = np.full((batch, seq, keys.shape[1]), -np.inf, np.float32) if with_scores else None
    for b in range(batch):
        seen = np.flatnonzero(visible[b] > 0)
        if not seen.size:
            continue
        lo, hi = int(seen[0]), int(seen[-1]) + 1
        part = map_query_blocks(select_block, (queries[b:b + 1, lo:hi], weights[b:b + 1, lo:hi],
                                               visible[b:b + 1, lo:hi]), (keys[b:b + 1],), block)
        picks[b, lo:hi] = part.picks[0]
        if with_scores:
            scores[b, lo:hi] = part.scores[0]
    return Selection(picks, scores)
