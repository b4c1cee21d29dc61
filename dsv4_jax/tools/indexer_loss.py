"""The lightning indexer's training signal: KL(main attention || indexer), as DeepSeek-V3.2.

The indexer's top-k passes no gradient (the picks are integers), so the indexer is trained by
its own loss: the KL divergence from the main attention's distribution over the compressed
entries to the softmax of the indexer's scores over the same entries (DeepSeek-V3.2, section
2.1.1: dense warm-up, then the sparse phase on the selected set).

**Formula.** B batch, S queries of a call, H heads, D head_dim, T entry slots, K index_topk.
For query t (row b, omitted) and head h, the main attention's logit on compressed entry s is
``l[t,h,s] = q[t,h] . E[s] * D^-1/2`` (``q`` = `Intermediates.queries`, ``E`` =
`Intermediates.compressed_kv`). The loss runs over a set of entries ``S_t``:

* ``over="topk"`` (the sparse phase): the indexer's picks, ``S_t = {topk[t, k] >= 0}``;
* ``over="visible"`` (the dense warm-up): every entry the query may see,
  ``S_t = {s < visible_entries[t]}``.

The main attention's probability of entry s is that of the layer's softmax over
``[sink | window keys | compressed entries]``:

* ``topk``: the layer's own (sparse) attention, ``P[t,h,s] = exp(l[t,h,s]) / Z[t,h]``;
* ``visible``: *dense* attention, the same softmax with every visible entry attended
  (``Z`` over the sink, the window and all of ``S_t``): what the main attention would give
  without the indexer, the dense warm-up's target.

Both are derived exactly from the intermediates, without the window keys: the sink and the
window enter only through ``Z``, and the layer's masses give it (``sink_mass + window_mass``
is their share of the sparse softmax, ``compressed_mass`` the picks' share), as in
`dsv4_jax.tools.diagnostics.dense_masses`. With ``A`` the sink + window exp-sum and ``C(X)`` the
exp-sum of entries X: ``A / C(picks) = (sink_mass + window_mass) / compressed_mass``, so
``log P[t,h,s] = l[t,h,s] - log C(S_t) - softplus(log A - log C(S_t))``.

Target and prediction, both distributions over ``S_t``:

    p[t, s] = sum_h P[t,h,s] / sum_{s' in S_t} sum_h P[t,h,s']      (lax.stop_gradient)
    q[t, s] = exp(I[t,s]) / sum_{s' in S_t} exp(I[t,s'])            (I = index_scores)
    KL[t]   = sum_{s in S_t} p[t,s] (log p[t,s] - log q[t,s])
    loss    = mean of KL[t] over the queries (b, t) whose S_t is not empty

``p`` is under `lax.stop_gradient`: no gradient reaches the main attention through the
target; the loss differentiates only through ``index_scores``. Gradient w.r.t. the scores:
``(q - p) / N`` on ``S_t`` (N = number of queries counted), zero elsewhere.

**Where the gradient comes from.** `index_scores` must be differentiable: run the layer with
``break_mode="none"`` and ``kernels="xla"`` (the in-graph `lax.top_k` path). In the narrow
and wide modes the scores come back from a host break, and with the native kernels from an
FFI call; both cut them from differentiation, so this loss then has zero gradient.
The indexer's queries are computed from the attention's q_residual (``q_a_proj``,
``q_a_norm``); as in DeepSeek-V3.2, the step is meant to detach it where it enters the
indexer (`lax.stop_gradient` in `step.run_stages`), so that this loss trains the
indexer's parameters only (``q_b_proj``, ``weights_proj`` and its key compressor).

>>> out, cache, inter = dsv4_jax.attention_step(weights, cache, x, positions, spec)  # CSA, intermediates on
>>> loss = indexer_kl_loss(inter, over="topk")
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.special import logsumexp

from dsv4_jax.step.pure_step import Intermediates

OVER = ("topk", "visible")

__all__ = ["OVER", "indexer_kl_loss", "indexer_kl_target"]


def _check(inter: Intermediates, over: str) -> None:
    if not isinstance(inter, Intermediates):
        raise TypeError(f"inter: expected dsv4_jax.Intermediates, got {type(inter).__name__}")
    if over not in OVER:
        raise ValueError(f"over: expected one of {OVER}, got {over!r}")
    missing = [f for f in ("index_scores", "topk", "compressed_kv", "visible_entries")
               if getattr(inter, f) is None]
    if missing:
        raise ValueError(
            f"inter: {', '.join(missing)} missing; the indexer loss needs the intermediates of a "
            "compressed_sparse_attention (CSA) layer, the only layer type with an indexer"
        )


def _entry_set(inter: Intermediates, over: str):
    """Indices int32 [B, S, n] into the entry slots and mask bool [B, S, n] of each query's set."""
    if over == "topk":
        topk = jnp.asarray(inter.topk)
        return jnp.maximum(topk, 0), topk >= 0
    t = inter.compressed_kv.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (*inter.index_scores.shape[:2], t))
    return idx, idx < jnp.asarray(inter.visible_entries)[..., None]


def _main_log_probs(inter: Intermediates, over: str, idx, mask):
    """log P[t, h, s] of the main attention over the set: float32 [B, S, H, n] (-inf outside)."""
    q = jnp.asarray(inter.queries, jnp.float32)
    ents = jnp.asarray(inter.compressed_kv, jnp.float32)
    scale = q.shape[-1] ** -0.5
    hi = jax.lax.Precision.HIGHEST
    # Logits of every query on every slot, then the set's and the picks' parts.
    logits = jnp.einsum("bshd,btd->bsht", q, ents, precision=hi) * scale  # [B, S, H, T]
    topk = jnp.asarray(inter.topk)
    picked = topk >= 0

    def gather(idx_):
        return jnp.take_along_axis(logits, jnp.broadcast_to(idx_[:, :, None, :], (*logits.shape[:3], idx_.shape[-1])),
                                   axis=-1)

    l_set = jnp.where(mask[:, :, None, :], gather(idx), -jnp.inf)  # [B, S, H, n]
    l_picks = jnp.where(picked[:, :, None, :], gather(jnp.maximum(topk, 0)), -jnp.inf)
    lse_set = logsumexp(l_set, axis=-1)  # [B, S, H]
    lse_picks = logsumexp(l_picks, axis=-1)
    # log A - log C(S_t), A = exp-sum of sink + window (from the sparse run's masses).
    rest = jnp.asarray(inter.sink_mass, jnp.float32) + jnp.asarray(inter.window_mass, jnp.float32)
    log_a = jnp.log(rest) - jnp.log(jnp.asarray(inter.compressed_mass, jnp.float32)) + lse_picks
    return l_set - (lse_set + jax.nn.softplus(log_a - lse_set))[..., None]


def indexer_kl_target(inter: Intermediates, over: str = "topk"):
    """The target p and its support: (log p float32 [B, S, n] with -inf outside the set,
    valid bool [B, S]: the query's set is not empty and its target is finite).

    n = K (``over="topk"``, column k is entry ``topk[..., k]``) or T (``over="visible"``,
    column s is entry s). Under `lax.stop_gradient` (see the module docstring).
    """
    _check(inter, over)
    inter = jax.lax.stop_gradient(inter)
    idx, mask = _entry_set(inter, over)
    log_p_heads = _main_log_probs(inter, over, idx, mask)  # [B, S, H, n]
    a = logsumexp(log_p_heads, axis=2)  # log sum_h P  [B, S, n]
    norm = logsumexp(jnp.where(mask, a, -jnp.inf), axis=-1)  # [B, S]
    valid = jnp.any(mask, axis=-1) & jnp.isfinite(norm)
    log_p = jnp.where(mask & valid[..., None], a - jnp.where(valid, norm, 0.0)[..., None], -jnp.inf)
    return jax.lax.stop_gradient(log_p), valid


def indexer_kl_loss(inter: Intermediates, over: str = "topk", reduction: str = "mean"):
    """KL(p_main || softmax(index_scores)) over each query's entry set (module docstring).

    inter:      the `Intermediates` of a CSA layer's call (``return_intermediates=True``);
                differentiable w.r.t. the indexer's parameters in ``break_mode="none"``
                with ``kernels="xla"``.
    over:       "topk" (the indexer's picks: DeepSeek-V3.2's sparse phase) or "visible"
                (every visible entry, with the dense attention as target: its warm-up).
    reduction:  "mean" (a scalar: the mean over queries with a non-empty set, 0 if there is
                none) or "none" (float32 [B, S], 0 for queries with an empty set).
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction: expected 'mean' or 'none', got {reduction!r}")
    log_p, valid = indexer_kl_target(inter, over)
    idx, mask = _entry_set(inter, over)
    scores = jnp.take_along_axis(jnp.asarray(inter.index_scores, jnp.float32), idx, axis=-1)  # [B, S, n]
    on = mask & valid[..., None]
    # Rows without a set get finite dummies, so that nothing NaN enters the gradient.
    scores = jnp.where(on, scores, jnp.where(valid[..., None], -jnp.inf, 0.0))
    log_q = scores - logsumexp(scores, axis=-1, keepdims=True)
    p = jnp.where(on, jnp.exp(log_p), 0.0)
    terms = jnp.where(on, p * (jnp.where(on, log_p, 0.0) - jnp.where(on, log_q, 0.0)), 0.0)
    kl = jnp.sum(terms, axis=-1)  # [B, S]
    if reduction == "none":
        return kl
    count = jnp.sum(valid)
    return jnp.sum(kl) / jnp.maximum(count, 1).astype(jnp.float32)
