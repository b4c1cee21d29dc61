"""Analysis helpers for the intermediates of `DeepseekV4Attention` (the notebooks use them).

Everything here reads what ``attn(x, positions, cache, return_intermediates=True)`` returns
(an `Intermediates`, see docs/intermediates.md) and computes on the host, in NumPy and
float32. Nothing here changes the layer or its compiled step. The functions are pure, except
`run_schedule` (it calls a layer) and `last_query_key_set` (it reads a layer's config and
sink logits).

Definitions used throughout (B batch, S queries of a call, H heads, D head_dim, T entry slots):

* **logit** of query t, head h on a key k: ``q_{t,h} . k * D^-1/2`` (the layer's own scale).
* **dense compressed softmax** ``P[t, h, w]``: the softmax of the logits of query t, head h
  over *all* compressed entries it may see (``w < visible_entries[t]``); 0 elsewhere.
  Window keys and the sink are left out on purpose: dense attention over
  ``[sink | window | every visible entry]`` gives entry w the probability
  ``exp(l_w) / (e^sink + sum_window + sum_visible)``, and the window and sink terms cancel in
  any ratio between entries. So ``P`` is also "the share of the compressed mass that a dense
  layer (every visible entry attended) puts on entry w".
* **indexer recall** of query t, head h: ``sum_{w in topk[t]} P[t, h, w]``, the share of that
  dense compressed mass which the indexer's picks capture. 1 when every visible entry is
  picked (e.g. ``visible <= index_topk``, and always on HCA layers); NaN for a query that sees
  no entry yet. Depends only on the queries and entries, so it can be computed from one call's
  intermediates.
* **dense reference masses**: the sink / window / compressed shares the same query would have
  if the layer attended every visible entry (no indexer). Derived exactly from the sparse
  run's masses and the recall (see `dense_masses`); equal to the masses of a twin layer with
  ``index_topk >= entries``.

Memory: the dense functions build float32 ``[B, S, H, T]``; fine for notebook sizes, not for
a V4-Flash prefill of 64k tokens (slice the queries first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dsv4_jax.config import CSA, HCA, SLIDING
from dsv4_jax.step.pure_step import Intermediates

__all__ = [
    "KeySet", "compressed_logits", "concat_intermediates", "dense_compressed_probs", "dense_masses",
    "entry_spans", "indexer_recall", "last_query_key_set", "oracle_topk", "pick_differences",
    "pick_matrix", "pick_sets_equal", "recent_topk", "run_schedule", "selection_recall",
    "stable_topk_from_scores",
]


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


# ---------------------------------------------------------------------------- entries and picks
def entry_spans(entries, layer_type: str, ratio: int) -> np.ndarray:
    """Source positions each compressed entry pools: int [..., 2] = (first, last), inclusive.

    CSA (overlapping, ratio m): entry w pools the Ca half of window w-1 and the Cb half of
    window w, i.e. positions ``(w-1)*m .. w*m + m - 1`` (clipped at 0 for w = 0).
    HCA (ratio m'): entry w pools window w, positions ``w*m' .. w*m' + m' - 1``.
    """
    w = np.asarray(entries, dtype=np.int64)
    if layer_type == CSA:
        first = np.maximum((w - 1) * ratio, 0)
    elif layer_type == HCA:
        first = w * ratio
    else:
        raise ValueError(f"layer_type: expected {CSA!r} or {HCA!r}, got {layer_type!r}")
    return np.stack([first, w * ratio + ratio - 1], axis=-1)


def pick_matrix(topk, num_slots: int) -> np.ndarray:
    """Picks as a boolean query x entry matrix: topk int [..., K] (-1 = nothing) -> bool [..., T].

    ``out[..., w]`` is True iff entry w is among the query's picks (a heatmap of the indexer).
    """
    topk = np.asarray(topk)
    out = np.zeros((*topk.shape[:-1], num_slots), dtype=bool)
    lead = np.indices(topk.shape[:-1])
    valid = topk >= 0
    idx = tuple(np.broadcast_to(i[..., None], topk.shape)[valid] for i in lead)
    out[(*idx, topk[valid])] = True
    return out


def pick_sets_equal(a, b) -> np.ndarray:
    """Whether two pick arrays [..., K] select the same set of entries per query -> bool [...].

    Order and -1 padding are ignored (attention over a set is order-independent); K may differ.
    """
    return pick_differences(a, b) == 0


def pick_differences(a, b) -> np.ndarray:
    """Size of the symmetric difference of two queries' pick sets: int [...] (0 = same picks)."""
    a, b = np.asarray(a), np.asarray(b)
    slots = int(max(a.max(initial=-1), b.max(initial=-1))) + 1
    ma, mb = pick_matrix(a, max(slots, 1)), pick_matrix(b, max(slots, 1))
    return np.sum(ma ^ mb, axis=-1)


def stable_topk_from_scores(scores, visible, k: int) -> np.ndarray:
    """The indexer's selection rule, recomputed in NumPy from its scores (an independent twin).

    scores float32 [..., T] (-inf where invisible), visible int [...] -> int32 [..., k]:
    descending score, equal scores to the lower entry index, picks ``>= visible`` and missing
    places are -1. ``-0.0`` compares equal to ``+0.0``.
    """
    scores = _f32(scores) + np.float32(0.0)  # -0.0 + 0.0 = +0.0
    visible = np.asarray(visible)
    t = scores.shape[-1]
    # lexsort: last key is primary -> by descending score, then ascending index.
    order = np.lexsort((np.broadcast_to(np.arange(t), scores.shape), -scores), axis=-1)[..., :k]
    order = np.where(order < visible[..., None], order, -1)
    if order.shape[-1] < k:
        pad = np.full((*order.shape[:-1], k - order.shape[-1]), -1)
        order = np.concatenate([order, pad], axis=-1)
    return order.astype(np.int32)


# ---------------------------------------------------------------------------- dense reference
def compressed_logits(queries, compressed_kv) -> np.ndarray:
    """Attention logits of every query on every entry slot: float32 [B, S, H, T].

    queries [B, S, H, D], compressed_kv [B, T, D] (from `Intermediates`). Computed in float32;
    visibility is not applied (see `dense_compressed_probs`).
    """
    q, e = _f32(queries), _f32(compressed_kv)
    return np.einsum("bshd,btd->bsht", q, e, optimize=True) * np.float32(q.shape[-1] ** -0.5)


def dense_compressed_probs(queries, compressed_kv, visible_entries) -> np.ndarray:
    """The dense compressed softmax ``P`` (module docstring): float32 [B, S, H, T].

    Softmax over the entries each query may see (``w < visible_entries``), 0 elsewhere; a
    query that sees no entry gets all zeros.
    """
    logits = compressed_logits(queries, compressed_kv)
    t = logits.shape[-1]
    seen = np.arange(t)[None, None, None, :] < np.asarray(visible_entries)[:, :, None, None]
    z = np.where(seen, logits, -np.inf)
    top = np.max(z, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(seen, np.exp(z - top), 0.0)
    denom = np.sum(e, axis=-1, keepdims=True)
    return (e / np.where(denom > 0, denom, 1.0)).astype(np.float32)


def selection_recall(probs, selection, visible_entries) -> np.ndarray:
    """Share of the dense compressed mass a selection captures: float32 [B, S, H].

    probs [B, S, H, T] from `dense_compressed_probs`; selection int [B, S, K] (-1 = nothing,
    shared by the heads, as the indexer's picks are); NaN where a query sees no entry.
    """
    probs = _f32(probs)
    mask = pick_matrix(selection, probs.shape[-1])  # [B, S, T]
    recall = np.sum(np.where(mask[:, :, None, :], probs, 0.0), axis=-1)
    none = np.asarray(visible_entries)[:, :, None] <= 0
    return np.where(none, np.nan, recall).astype(np.float32)


def indexer_recall(queries, compressed_kv, topk, visible_entries) -> np.ndarray:
    """Indexer recall per query and head (module docstring): float32 [B, S, H], NaN = no entry.

    Pass the fields of one CSA call's `Intermediates`:
    ``indexer_recall(i.queries, i.compressed_kv, i.topk, i.visible_entries)``. On an HCA
    layer (every visible entry attended) pass ``topk=None``: the recall is 1.
    """
    probs = dense_compressed_probs(queries, compressed_kv, visible_entries)
    if topk is None:
        visible = np.asarray(visible_entries)
        topk = np.where(np.arange(probs.shape[-1]) < visible[..., None], np.arange(probs.shape[-1]), -1)
    return selection_recall(probs, topk, visible_entries)


def oracle_topk(probs, visible_entries, k: int) -> np.ndarray:
    """The best shared selection of k entries: top-k of the head-mean dense probability.

    An upper bound for any indexer that picks one set per query for all heads (as the
    lightning indexer does). int32 [B, S, k], -1 = nothing.
    """
    mean = np.mean(_f32(probs), axis=2)  # [B, S, T]
    visible = np.asarray(visible_entries)
    mean = np.where(np.arange(mean.shape[-1]) < visible[..., None], mean, -np.inf)
    return stable_topk_from_scores(mean, visible, k)


def recent_topk(visible_entries, k: int) -> np.ndarray:
    """The k most recent visible entries per query (a baseline): int32 [B, S, k], -1 = nothing."""
    visible = np.asarray(visible_entries)[..., None]
    picks = visible - 1 - np.arange(k)
    return np.where(picks >= 0, picks, -1).astype(np.int32)


def dense_masses(inter: Intermediates, recall=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sink, window and compressed shares under *dense* attention: three float32 [B, S, H].

    "Dense" = the same layer attending every visible compressed entry instead of the picks.
    With the sparse run's shares (s, v, c) and the recall r of its picks, the dense softmax
    denominator is ``Z_dense = Z * (1 - c + c / r)`` (the picked entries' exp-sum is ``c*Z``
    and is the fraction r of the visible entries' exp-sum), so

        sink_dense = s / f,  window_dense = v / f,  compressed_dense = (c / r) / f,
        f = 1 - c + c / r.

    Exact up to float rounding (no window keys are needed). Where a query sees no entry, and
    on sliding and HCA layers (nothing is left out), the dense shares are the sparse ones.
    `recall` defaults to `indexer_recall` of `inter`.
    """
    s, v, c = _f32(inter.sink_mass), _f32(inter.window_mass), _f32(inter.compressed_mass)
    if inter.topk is None:
        return s, v, c
    if recall is None:
        recall = indexer_recall(inter.queries, inter.compressed_kv, inter.topk, inter.visible_entries)
    r = _f32(recall)
    ok = np.isfinite(r) & (r > 0)
    r_safe = np.where(ok, r, 1.0)
    f = 1.0 - c + c / r_safe
    return (np.where(ok, s / f, s).astype(np.float32), np.where(ok, v / f, v).astype(np.float32),
            np.where(ok, (c / r_safe) / f, c).astype(np.float32))


# ---------------------------------------------------------------------------- one query's keys
@dataclasses.dataclass
class KeySet:
    """The keys of one query and its attention on each (head by head), for plots.

    position          the query's position t
    layer_type        sliding / CSA / HCA
    window_positions  int [n_w]        positions of its window keys (ascending)
    window_probs      float32 [H, n_w] attention probability of each window key
    entries           int [n_c]        every compressed entry the query may see (CSA: visible,
                                       picked or not; HCA: all visible; sliding: none)
    spans             int [n_c, 2]     source positions (first, last) each entry pools
    picked            bool [n_c]       entry is attended (CSA: picked by the indexer; HCA: all)
    entry_probs       float32 [H, n_c] attention probability of each entry (0 if not picked)
    sink_probs        float32 [H]      the sink's share
    """

    position: int
    layer_type: str
    window_positions: np.ndarray
    window_probs: np.ndarray
    entries: np.ndarray
    spans: np.ndarray
    picked: np.ndarray
    entry_probs: np.ndarray
    sink_probs: np.ndarray

    @property
    def window_mass(self) -> np.ndarray:
        return self.window_probs.sum(axis=-1)

    @property
    def compressed_mass(self) -> np.ndarray:
        return self.entry_probs.sum(axis=-1)


def last_query_key_set(attn, inter: Intermediates, cache_after, row: int = 0) -> KeySet:
    """The key set of the **last** query of a call, with the attention probability of every key.

    attn: the layer that ran the call (its config, layer type and sink logits are read);
    inter: that call's intermediates; cache_after: the cache it returned; row: batch row.

    Only the last query: its window (positions ``t-W+1 .. t``) is exactly what the window ring
    of `cache_after` holds (slot ``p % W``), so no key has to be recomputed. Prefill up to the
    query you want to look at. Probabilities are recomputed in float32 from the queries and
    keys; they agree with ``inter.sink_mass`` / ``window_mass`` / ``compressed_mass`` up to
    rounding (a test checks it).
    """
    cfg, layer_type = attn.config, attn.layer_type
    length = int(np.asarray(cache_after.length)[row])
    t = length - 1
    w = cfg.sliding_window
    q = _f32(inter.queries)[row, -1]  # [H, D]
    scale = np.float32(q.shape[-1] ** -0.5)

    window_positions = np.arange(max(t - w + 1, 0), t + 1)
    keys = _f32(cache_after.window)[row, window_positions % w]  # [n_w, D]
    parts = [q @ keys.T * scale]  # [H, n_w]

    if layer_type == SLIDING:
        entries = np.zeros((0,), np.int64)
        picked = np.zeros((0,), bool)
        spans = np.zeros((0, 2), np.int64)
    else:
        ratio = cfg.compress_rate(layer_type)
        visible = int(np.asarray(inter.visible_entries)[row, -1])
        entries = np.arange(visible)
        if layer_type == CSA:
            chosen = np.asarray(inter.topk)[row, -1]
            picked = np.isin(entries, chosen[chosen >= 0])
        else:
            picked = np.ones((visible,), bool)
        spans = entry_spans(entries, layer_type, ratio)
        ents = _f32(inter.compressed_kv)[row, :visible]
        lg = q @ ents.T * scale
        parts.append(np.where(picked[None, :], lg, -np.inf))

    sink = _f32(attn.sinks[...])[:, None]  # [H, 1]
    z = np.concatenate([sink, *parts], axis=-1)
    top = np.max(z, axis=-1, keepdims=True)
    e = np.exp(z - top)
    p = (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
    n_w = len(window_positions)
    return KeySet(
        position=t, layer_type=layer_type, window_positions=window_positions,
        window_probs=p[:, 1 : 1 + n_w], entries=entries, spans=spans, picked=picked,
        entry_probs=p[:, 1 + n_w :] if layer_type != SLIDING else np.zeros((p.shape[0], 0), np.float32),
        sink_probs=p[:, 0],
    )


# ---------------------------------------------------------------------------- running a schedule
_PER_QUERY = ("queries", "sink_mass", "window_mass", "compressed_mass", "index_scores", "topk", "visible_entries")


def concat_intermediates(parts: Sequence[Intermediates]) -> Intermediates:
    """The intermediates of consecutive calls as if one call had run them all.

    Per-query fields are concatenated along S; `compressed_kv` and `num_entries` are the last
    call's (entries are only ever appended, so the last call's hold every earlier one).
    All fields become NumPy arrays.
    """
    if not parts:
        raise ValueError("parts: expected at least one Intermediates, got none")
    fields = {}
    for f in dataclasses.fields(Intermediates):
        values = [getattr(p, f.name) for p in parts]
        if values[-1] is None:
            fields[f.name] = None
        elif f.name in _PER_QUERY:
            fields[f.name] = np.concatenate([np.asarray(v) for v in values], axis=1)
        else:
            fields[f.name] = np.asarray(values[-1])
    return Intermediates(**fields)


def run_schedule(attn, hidden, schedule: Sequence[int], *, max_seq_len: int | None = None, cache=None):
    """Feed `hidden` [B, N, hidden] to a layer in chunks (e.g. ``[N]``, ``[64] * 8``, ``[1] * N``).

    Starts from `cache` (or an empty one of `max_seq_len`, default N) and returns
    ``(out [B, N, hidden] NumPy, cache, Intermediates of the whole schedule)``.
    """
    import jax.numpy as jnp  # local: the rest of the module is NumPy-only

    hidden = np.asarray(hidden)
    batch, total = hidden.shape[:2]
    if sum(schedule) != total or any(n < 1 for n in schedule):
        raise ValueError(f"schedule: expected positive chunk sizes summing to {total}, got {list(schedule)}")
    if cache is None:
        cache = attn.init_cache(batch, max_seq_len or total)
    start = int(np.asarray(cache.length)[0])
    outs, inters, done = [], [], 0
    for n in schedule:
        pos = np.broadcast_to(np.arange(start + done, start + done + n, dtype=np.int32), (batch, n))
        out, cache, inter = attn(jnp.asarray(hidden[:, done : done + n]), pos, cache, return_intermediates=True)
        outs.append(np.asarray(out))
        inters.append(inter)
        done += n
    return np.concatenate(outs, axis=1), cache, concat_intermediates(inters)
