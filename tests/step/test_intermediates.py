"""`return_intermediates=True`: off by default and free when off, consistent when on; and the
analysis helpers of `dsv4_jax.tools.diagnostics` that the notebooks use.

Runs on the tiny preset with random weights (every parameter, sinks and position biases
included). The recorded reference's scores and picks are compared in test_attention.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import random_layer
from hypothesis import given, settings
from hypothesis import strategies as st

import dsv4_jax
from dsv4_jax import CSA, HCA, SLIDING
from dsv4_jax.ops.indexer.reference import picks_from_scores
from dsv4_jax.tools import diagnostics as dg

TINY = dsv4_jax.DeepseekV4Config.tiny()  # window 8, CSA ratio 4 with top-4, HCA ratio 8
SCHEDULE = (40, 1, 1)  # 40 tokens -> 10 CSA entries (> top-4), 5 HCA entries; then 2 decode steps
BATCH = 2
MAX_LEN = 64


def _inputs(seed: int = 0, total: int = sum(SCHEDULE)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((BATCH, total, TINY.hidden_size)).astype(np.float32)


@dataclasses.dataclass
class Call:
    positions: np.ndarray
    out: np.ndarray
    inter: dsv4_jax.Intermediates
    before: dsv4_jax.AttentionCache
    after: dsv4_jax.AttentionCache


def _run_calls(attn, x, schedule=SCHEDULE) -> list[Call]:
    cache, start, calls = attn.init_cache(BATCH, MAX_LEN), 0, []
    for n in schedule:
        pos = np.broadcast_to(np.arange(start, start + n, dtype=np.int32), (BATCH, n))
        out, after, inter = attn(jnp.asarray(x[:, start:start + n]), pos, cache, return_intermediates=True)
        calls.append(Call(pos, np.asarray(out), inter, cache, after))
        cache, start = after, start + n
    return calls


@pytest.fixture(scope="module")
def tiny_layers():
    return {TINY.layer_type(i): random_layer(TINY, i, seed=3) for i in range(TINY.num_layers)}


@pytest.fixture(scope="module")
def tiny_calls(tiny_layers):
    """Each tiny layer run over SCHEDULE with intermediates: {layer_type: [Call, ...]}."""
    x = _inputs()
    return {name: _run_calls(attn, x) for name, attn in tiny_layers.items()}


LAYER_TYPES = (SLIDING, CSA, HCA)


# ---------------------------------------------------------------------------- off by default, free when off
def test_default_call_returns_out_and_cache(tiny_layers):
    attn = tiny_layers[CSA]
    x = jnp.asarray(_inputs()[:, :SCHEDULE[0]])
    pos = np.broadcast_to(np.arange(SCHEDULE[0], dtype=np.int32), x.shape[:2])
    out, cache = attn(x, pos, attn.init_cache(BATCH, MAX_LEN))  # exactly two results
    assert out.shape == x.shape and out.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(cache.length), [SCHEDULE[0]] * BATCH)
    out_on, cache_on, inter = attn(x, pos, attn.init_cache(BATCH, MAX_LEN), return_intermediates=True)
    # Asking for the intermediates adds them; it does not change the output or the cache.
    np.testing.assert_allclose(np.asarray(out_on), np.asarray(out), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(cache_on), jax.tree.leaves(cache), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)
    # ... and they describe this call: one row of picks per query, entries of the 40 tokens.
    assert np.asarray(inter.topk).shape == (BATCH, SCHEDULE[0], TINY.index_topk)
    np.testing.assert_array_equal(np.asarray(inter.num_entries), [SCHEDULE[0] // TINY.csa_compress_rate] * BATCH)


def _all_eqns(jaxpr):
    """Equations of a jaxpr, those of nested jaxprs (pjit, map, cond, ...) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


def _count_eqns(jaxpr) -> int:
    return sum(1 for _ in _all_eqns(jaxpr))


def _callback_outputs(jaxpr) -> list[list]:
    return [[v.aval for v in eqn.outvars] for eqn in _all_eqns(jaxpr) if "callback" in eqn.primitive.name]


@pytest.mark.parametrize("break_mode", dsv4_jax.BREAK_MODES)
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_off_is_a_separate_smaller_step(tiny_layers, layer_type, break_mode):
    """The default step has no extra outputs, fewer operations, and its host break returns
    only the picks (the scores never cross it)."""
    attn = tiny_layers[layer_type]
    cache = attn.init_cache(BATCH, MAX_LEN)
    x = jnp.asarray(_inputs()[:, :SCHEDULE[0]])
    pos = jnp.asarray(np.broadcast_to(np.arange(SCHEDULE[0], dtype=np.int32), x.shape[:2]))
    # The host break: its callback's outputs are what this test reads (the device break's
    # custom call returns the scores in both steps, and the default step discards them).
    attn.break_mode, attn.break_on = break_mode, "host"
    try:
        spec_off, spec_on = attn.step_spec(False), attn.step_spec(True)
    finally:
        attn.break_mode, attn.break_on = "narrow", "auto"
    assert spec_off != spec_on and not spec_off.return_intermediates  # two compiled steps
    w = attn.weights()
    step = {s: functools.partial(dsv4_jax.attention_step, spec=s) for s in (spec_off, spec_on)}

    out_off = jax.eval_shape(step[spec_off], w, cache, x, pos)
    out_on = jax.eval_shape(step[spec_on], w, cache, x, pos)
    assert out_off[2] is None
    assert isinstance(out_on[2], dsv4_jax.Intermediates)
    n_base = len(jax.tree.leaves(out_off[:2]))
    assert len(jax.tree.leaves(out_off)) == n_base
    assert len(jax.tree.leaves(out_on)) > n_base

    jx_off = jax.make_jaxpr(step[spec_off])(w, cache, x, pos).jaxpr
    jx_on = jax.make_jaxpr(step[spec_on])(w, cache, x, pos).jaxpr
    assert len(jx_off.outvars) == n_base
    assert _count_eqns(jx_off) < _count_eqns(jx_on)

    # What comes back from the host: when on, the CSA scores [B, S, T] are added; nothing else.
    def returned(jaxpr):
        return sorted(str(a) for outs in _callback_outputs(jaxpr) for a in outs)

    cb_off, cb_on = returned(jx_off), returned(jx_on)
    extra = []
    if layer_type == CSA and break_mode != "none":
        extra = [str(jax.core.ShapedArray((BATCH, SCHEDULE[0], MAX_LEN // TINY.csa_compress_rate), jnp.float32))]
    assert cb_on == sorted(cb_off + extra)
    if layer_type == CSA and break_mode == "narrow":  # off: the narrow break returns the picks only
        assert cb_off == [str(jax.core.ShapedArray((BATCH, SCHEDULE[0], TINY.index_topk), jnp.int32))]


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_on_and_off_give_the_same_output_and_cache(tiny_layers, tiny_calls, layer_type):
    attn = tiny_layers[layer_type]
    call = tiny_calls[layer_type][0]
    x = jnp.asarray(_inputs()[:, :SCHEDULE[0]])
    out, cache = attn(x, call.positions, call.before)
    np.testing.assert_allclose(np.asarray(out), call.out, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(call.after)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_intermediates_under_a_users_jit(tiny_layers, tiny_calls):
    attn = tiny_layers[CSA]
    call = tiny_calls[CSA][0]

    @nnx.jit
    def run(attn, x, pos, cache):
        return attn(x, pos, cache, return_intermediates=True)

    out, _, inter = run(attn, jnp.asarray(_inputs()[:, :SCHEDULE[0]]), jnp.asarray(call.positions), call.before)
    np.testing.assert_allclose(np.asarray(out), call.out, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(inter.topk), np.asarray(call.inter.topk))


# ---------------------------------------------------------------------------- consistency when on
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_fields_present_and_shaped(tiny_calls, layer_type):
    cfg = TINY
    h, d, k = cfg.num_attention_heads, cfg.head_dim, cfg.index_topk
    for call in tiny_calls[layer_type]:
        i, s = call.inter, call.positions.shape[1]
        assert i.queries.shape == (BATCH, s, h, d)
        for mass in (i.sink_mass, i.window_mass, i.compressed_mass):
            assert mass.shape == (BATCH, s, h) and mass.dtype == jnp.float32
        if layer_type == SLIDING:
            assert i.index_scores is None and i.topk is None and i.compressed_kv is None
            assert i.num_entries is None and i.visible_entries is None
            continue
        ratio = cfg.compress_rate(layer_type)
        slots = MAX_LEN // ratio
        assert i.compressed_kv.shape == (BATCH, slots, d)
        np.testing.assert_array_equal(i.visible_entries, (call.positions + 1) // ratio)
        np.testing.assert_array_equal(i.num_entries, np.asarray(call.after.length) // ratio)
        np.testing.assert_array_equal(np.asarray(i.compressed_kv), np.asarray(call.after.compressor.entries))
        if layer_type == HCA:
            assert i.index_scores is None and i.topk is None
        else:
            assert i.index_scores.shape == (BATCH, s, slots) and i.index_scores.dtype == jnp.float32
            assert i.topk.shape == (BATCH, s, k) and i.topk.dtype == jnp.int32


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_masses_are_shares_summing_to_one(tiny_calls, layer_type):
    for call in tiny_calls[layer_type]:
        s, v, c = (np.asarray(a, np.float64) for a in
                   (call.inter.sink_mass, call.inter.window_mass, call.inter.compressed_mass))
        np.testing.assert_allclose(s + v + c, 1.0, atol=1e-5)
        for mass in (s, v, c):
            assert np.all(mass >= 0) and np.all(mass <= 1 + 1e-6)
        assert np.all(s > 0) and np.all(v > 0)  # a query always sees itself, and the sink
        if layer_type == SLIDING:
            assert np.all(c == 0)
        else:  # no compressed mass before the first entry exists
            none = np.asarray(call.inter.visible_entries) == 0
            assert np.all(c[none] == 0) and np.all(c[~none] > 0)


def test_queries_are_normed_per_head(tiny_calls):
    """RMS-normed (no weight), then rotated: each head's query has mean square 1."""
    for layer_type in LAYER_TYPES:
        q = np.asarray(tiny_calls[layer_type][0].inter.queries, np.float64)
        np.testing.assert_allclose(np.mean(q**2, axis=-1), 1.0, rtol=1e-4)


def test_index_scores_are_minus_inf_exactly_where_invisible(tiny_calls):
    for call in tiny_calls[CSA]:
        scores = np.asarray(call.inter.index_scores)
        visible = np.arange(scores.shape[-1]) < np.asarray(call.inter.visible_entries)[..., None]
        assert np.all(np.isfinite(scores[visible]))
        assert np.all(scores[~visible] == -np.inf)


def test_topk_is_the_stable_top_k_of_the_scores(tiny_calls):
    k = TINY.index_topk
    for call in tiny_calls[CSA]:
        scores, visible = np.asarray(call.inter.index_scores), np.asarray(call.inter.visible_entries)
        topk = np.asarray(call.inter.topk)
        np.testing.assert_array_equal(topk, dg.stable_topk_from_scores(scores, visible, k))
        # The rule spelled out, query by query: by descending score, ties to the lower index.
        for b, t in np.ndindex(*topk.shape[:2]):
            ranked = sorted(range(visible[b, t]), key=lambda w, b=b, t=t: (-scores[b, t, w], w))[:k]
            assert topk[b, t].tolist() == ranked + [-1] * (k - len(ranked))


def test_tied_scores_pick_the_lowest_entries(tiny_layers):
    """Zero head weights make every visible score exactly 0: the picks are entries 0..k-1."""
    attn = random_layer(TINY, 1, seed=3)
    attn.indexer.weights_proj[...] = jnp.zeros_like(attn.indexer.weights_proj[...])
    calls = _run_calls(attn, _inputs())
    k = TINY.index_topk
    for call in calls:
        scores = np.asarray(call.inter.index_scores)
        visible = np.asarray(call.inter.visible_entries)
        assert np.all(scores[np.arange(scores.shape[-1]) < visible[..., None]] == 0)
        expected = np.where(np.arange(k) < visible[..., None], np.arange(k), -1)
        np.testing.assert_array_equal(np.asarray(call.inter.topk), expected)


# ---------------------------------------------------------------------------- diagnostics: picks and spans
def test_entry_spans():
    np.testing.assert_array_equal(dg.entry_spans([0, 1, 5], CSA, 4), [[0, 3], [0, 7], [16, 23]])
    np.testing.assert_array_equal(dg.entry_spans([0, 2], HCA, 16), [[0, 15], [32, 47]])
    with pytest.raises(ValueError, match="layer_type"):
        dg.entry_spans([0], SLIDING, 0)


def test_pick_matrix_and_differences():
    a = np.array([[[2, 0, -1], [1, 3, 4]]])
    np.testing.assert_array_equal(dg.pick_matrix(a, 5)[0], [[1, 0, 1, 0, 0], [0, 1, 0, 1, 1]])
    b = np.array([[[0, 2, -1], [4, 3, 0]]])  # same set in another order; then one entry swapped
    np.testing.assert_array_equal(dg.pick_differences(a, b), [[0, 2]])
    np.testing.assert_array_equal(dg.pick_sets_equal(a, b), [[True, False]])
    np.testing.assert_array_equal(dg.pick_sets_equal(a[..., :2], np.array([[[0, 2], [1, 3]]])), [[True, True]])


def test_recent_topk():
    np.testing.assert_array_equal(dg.recent_topk(np.array([[0, 2, 5]]), 3), [[[-1, -1, -1], [1, 0, -1], [4, 3, 2]]])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 9), st.integers(1, 12))
def test_stable_topk_twin_matches_the_indexer(seed, t, k):
    """`stable_topk_from_scores` (lexsort) agrees with the indexer's NumPy selection, ties and
    -0.0 included."""
    rng = np.random.default_rng(seed)
    scores = rng.integers(-2, 3, size=(2, 5, t)).astype(np.float32)  # many ties
    scores[scores == 0] = rng.choice(np.array([0.0, -0.0], np.float32), size=int((scores == 0).sum()))
    visible = rng.integers(0, t + 1, size=(2, 5)).astype(np.int32)
    scores = np.where(np.arange(t) < visible[..., None], scores, -np.inf).astype(np.float32)
    scores = np.where(scores == 0, np.float32(0.0), scores)  # the indexer folds -0.0 before top-k
    np.testing.assert_array_equal(dg.stable_topk_from_scores(scores, visible, k), picks_from_scores(scores, visible, k))


# ---------------------------------------------------------------------------- diagnostics: dense reference
def test_dense_compressed_probs_are_a_softmax_over_visible_entries(tiny_calls):
    i = tiny_calls[CSA][0].inter
    p = dg.dense_compressed_probs(i.queries, i.compressed_kv, i.visible_entries)
    visible = np.asarray(i.visible_entries)
    sums = p.sum(-1)
    np.testing.assert_allclose(sums[visible > 0], 1.0, atol=1e-5)
    assert np.all(sums[visible == 0] == 0)
    invisible = np.arange(p.shape[-1])[None, None, None, :] >= visible[:, :, None, None]
    assert np.all(p[np.broadcast_to(invisible, p.shape)] == 0)


def test_indexer_recall_bounds(tiny_calls):
    for layer_type in (CSA, HCA):
        i = tiny_calls[layer_type][0].inter
        r = dg.indexer_recall(i.queries, i.compressed_kv, i.topk, i.visible_entries)
        visible = np.asarray(i.visible_entries)
        assert np.all(np.isnan(r[visible == 0]))
        seen = r[visible > 0]
        assert np.all((seen >= 0) & (seen <= 1 + 1e-5))
        # Every visible entry picked (few entries, or HCA): recall 1.
        k = TINY.index_topk if layer_type == CSA else np.inf
        full = (visible > 0) & (visible <= k)
        np.testing.assert_allclose(r[full], 1.0, atol=1e-5)
        if layer_type == CSA:
            assert np.any(r[visible > k] < 0.999)  # more entries than picks: something is left out


def test_oracle_selection_has_the_best_head_mean_recall(tiny_calls):
    i = tiny_calls[CSA][0].inter
    visible = np.asarray(i.visible_entries)
    p = dg.dense_compressed_probs(i.queries, i.compressed_kv, visible)
    seen = visible > 0
    for k in (1, 2, 4):
        oracle = dg.selection_recall(p, dg.oracle_topk(p, visible, k), visible)[seen].mean(-1)
        for other in (dg.stable_topk_from_scores(i.index_scores, visible, k), dg.recent_topk(visible, k)):
            mine = dg.selection_recall(p, other, visible)[seen].mean(-1)
            assert np.all(oracle >= mine - 1e-6)


def test_dense_masses_equal_a_layer_attending_every_entry(tiny_layers, tiny_calls):
    """`dense_masses` (derived from the sparse run) = the masses of a twin layer whose top-k
    covers every entry (same weights)."""
    sparse = tiny_calls[CSA][0]
    twin = random_layer(dataclasses.replace(TINY, index_topk=MAX_LEN // TINY.csa_compress_rate), 1, seed=3)
    x = jnp.asarray(_inputs()[:, :SCHEDULE[0]])
    _, _, dense = twin(x, sparse.positions, twin.init_cache(BATCH, MAX_LEN), return_intermediates=True)
    ds, dw, dc = dg.dense_masses(sparse.inter)
    np.testing.assert_allclose(ds, dense.sink_mass, atol=2e-6)
    np.testing.assert_allclose(dw, dense.window_mass, atol=2e-6)
    np.testing.assert_allclose(dc, dense.compressed_mass, atol=2e-6)
    # The twin attends everything: its recall is 1, and its dense masses are its own.
    r = dg.indexer_recall(dense.queries, dense.compressed_kv, dense.topk, dense.visible_entries)
    np.testing.assert_allclose(r[np.isfinite(r)], 1.0, atol=1e-5)
    assert np.nanmax(np.asarray(sparse.inter.compressed_mass) - dc) <= 1e-6  # picks see less than all


def test_dense_masses_pass_through_without_an_indexer(tiny_calls):
    for layer_type in (SLIDING, HCA):
        i = tiny_calls[layer_type][0].inter
        for a, b in zip(dg.dense_masses(i), (i.sink_mass, i.window_mass, i.compressed_mass)):
            np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_last_query_key_set_reproduces_the_masses(tiny_layers, tiny_calls, layer_type):
    attn = tiny_layers[layer_type]
    for call in tiny_calls[layer_type]:
        for row in range(BATCH):
            ks = dg.last_query_key_set(attn, call.inter, call.after, row=row)
            t = int(call.positions[row, -1])
            assert ks.position == t and ks.layer_type == layer_type
            np.testing.assert_array_equal(ks.window_positions, np.arange(max(t - TINY.sliding_window + 1, 0), t + 1))
            i = call.inter
            np.testing.assert_allclose(ks.sink_probs, np.asarray(i.sink_mass)[row, -1], atol=1e-6)
            np.testing.assert_allclose(ks.window_mass, np.asarray(i.window_mass)[row, -1], atol=1e-6)
            np.testing.assert_allclose(ks.compressed_mass, np.asarray(i.compressed_mass)[row, -1], atol=1e-6)
            if layer_type == SLIDING:
                assert len(ks.entries) == 0
                continue
            assert len(ks.entries) == (t + 1) // TINY.compress_rate(layer_type)
            if layer_type == CSA:
                chosen = np.asarray(i.topk)[row, -1]
                np.testing.assert_array_equal(ks.entries[ks.picked], np.sort(chosen[chosen >= 0]))
            else:
                assert ks.picked.all()
            assert np.all(ks.entry_probs[:, ~ks.picked] == 0)


def test_last_query_key_set_early_query(tiny_layers):
    """A query before the window fills (t < W - 1) sees only positions 0..t."""
    attn = tiny_layers[SLIDING]
    x = jnp.asarray(_inputs()[:, :1])
    cache = attn.init_cache(BATCH, MAX_LEN)
    _, after, inter = attn(x, np.zeros((BATCH, 1), np.int32), cache, return_intermediates=True)
    ks = dg.last_query_key_set(attn, inter, after)
    np.testing.assert_array_equal(ks.window_positions, [0])
    np.testing.assert_allclose(ks.sink_probs + ks.window_mass, 1.0, atol=1e-6)


# ---------------------------------------------------------------------------- diagnostics: schedules
def test_run_schedule_chunked_equals_one_call(tiny_layers):
    """`run_schedule` over chunks (its intermediates joined by `concat_intermediates`) gives
    what a single call over all the tokens gives: outputs and scores to float32 rounding,
    the same picks and entries. Token by token: the same pick sets as the prefill."""
    attn = tiny_layers[CSA]
    schedule = [*SCHEDULE, 1, 1]  # the last call (position 43) completes entry 10: the entries grow mid-schedule
    total = sum(schedule)
    x = _inputs(total=total)
    pos = np.broadcast_to(np.arange(total, dtype=np.int32), (BATCH, total))
    one_out, _, one = attn(jnp.asarray(x), pos, attn.init_cache(BATCH, MAX_LEN), return_intermediates=True)
    out, cache, inter = dg.run_schedule(attn, x, schedule, max_seq_len=MAX_LEN)
    np.testing.assert_allclose(out, np.asarray(one_out), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(inter.topk, np.asarray(one.topk))
    np.testing.assert_allclose(inter.index_scores, np.asarray(one.index_scores), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inter.queries, np.asarray(one.queries), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inter.compressed_mass, np.asarray(one.compressed_mass), atol=1e-6)
    np.testing.assert_allclose(inter.compressed_kv, np.asarray(one.compressed_kv), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(inter.visible_entries, np.asarray(one.visible_entries))
    np.testing.assert_array_equal(inter.num_entries, np.asarray(one.num_entries))
    assert np.asarray(cache.length).tolist() == [total] * BATCH

    # Token by token for the first 40 (decode-shaped calls only): the same pick sets as one call.
    first = SCHEDULE[0]
    _, _, one_by_one = dg.run_schedule(attn, x[:, :first], [1] * first, max_seq_len=MAX_LEN)
    assert dg.pick_sets_equal(one_by_one.topk, np.asarray(one.topk)[:, :first]).all()
    np.testing.assert_allclose(one_by_one.compressed_mass, np.asarray(one.compressed_mass)[:, :first], atol=1e-5)


def test_run_schedule_rejects_a_bad_schedule(tiny_layers):
    with pytest.raises(ValueError, match="schedule"):
        dg.run_schedule(tiny_layers[SLIDING], _inputs(), [3, 4])


def test_concat_intermediates_needs_parts():
    with pytest.raises(ValueError, match="at least one"):
        dg.concat_intermediates([])
