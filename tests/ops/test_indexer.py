"""Lightning indexer: scores, the tie rule, causality, -1 padding; NumPy twin = XLA."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.backend import top_k_stable
from dsv4_jax.ops.indexer.reference import Selection, index_scores, picks_from_scores, select_topk


def loop_oracle(q, w, keys, visible, top_k):
    """Independent triple loop: score, mask, sort by (-score, index), pad with -1."""
    b, s, nh, c = q.shape
    picks = np.full((b, s, top_k), -1, np.int32)
    for bi in range(b):
        for si in range(s):
            scored = []
            for e in range(visible[bi, si]):
                total = sum(w[bi, si, h] * max(float(q[bi, si, h] @ keys[bi, e]), 0.0) * c**-0.5 for h in range(nh))
                scored.append((-total, e))
            chosen = [e for _, e in sorted(scored)[:top_k]]
            picks[bi, si, : len(chosen)] = chosen
    return picks


def random_inputs(seed, b=2, s=7, nh=4, c=8, t=12):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, s, nh, c)).astype(np.float32)
    w = rng.normal(size=(b, s, nh)).astype(np.float32)
    keys = rng.normal(size=(b, t, c)).astype(np.float32)
    visible = rng.integers(0, t + 1, size=(b, s)).astype(np.int32)
    return q, w, keys, visible


@pytest.mark.parametrize("seed", range(3))
def test_picks_match_an_independent_oracle(seed):
    q, w, keys, visible = random_inputs(seed)
    want = loop_oracle(q, w, keys, visible, 5)
    np.testing.assert_array_equal(select_topk(q, w, keys, visible, top_k=5).picks, want)  # NumPy twin
    got = select_topk(jnp.asarray(q), jnp.asarray(w), jnp.asarray(keys), jnp.asarray(visible), top_k=5).picks
    np.testing.assert_array_equal(np.asarray(got), want)  # XLA


def test_numpy_top_k_matches_lax_on_ties_and_infinities():
    rng = np.random.default_rng(0)
    scores = rng.integers(-3, 4, size=(64, 40)).astype(np.float32)  # many exact ties
    scores[rng.random(scores.shape) < 0.2] = -np.inf
    for k in (1, 5, 17, 40):
        np.testing.assert_array_equal(top_k_stable(scores, k), np.asarray(top_k_stable(jnp.asarray(scores), k)))


def test_ties_go_to_the_lower_index_and_negative_zero_is_zero():
    # Negative head weights turn relu's +0 into -0: those ties must still compare equal.
    q = np.ones((1, 1, 2, 4), np.float32)
    w = np.array([[[-1.0, -1.0]]], np.float32)
    keys = np.array([[[1, 1, 1, 1], [-1, -1, -1, -1], [-2, -2, -2, -2], [-1, -1, -1, -1]]], np.float32)
    visible = np.array([[4]], np.int32)
    for xp in (np, jnp):
        scores = np.asarray(index_scores(*(xp.asarray(a) for a in (q, w, keys, visible))))
        assert not np.signbit(scores[0, 0, 1:]).any()  # entries 1-3 score exactly +0.0
        picks = np.asarray(select_topk(*(xp.asarray(a) for a in (q, w, keys, visible)), top_k=3).picks)
        assert picks[0, 0].tolist() == [1, 2, 3]  # entry 0 scores -4: last


def test_causality_and_padding():
    q, w, keys, _ = random_inputs(5, s=9, t=6)
    visible = np.array([[0, 1, 2, 3, 4, 5, 6, 6, 6]] * 2, np.int32)
    picks = select_topk(q, w, keys, visible, top_k=4).picks
    for t in range(9):
        valid = picks[:, t][picks[:, t] >= 0].reshape(2, -1)
        assert valid.shape[1] == min(4, visible[0, t])
        assert (valid < visible[0, t]).all()


def test_fewer_entry_slots_than_top_k_pads_to_top_k():
    scores = np.array([[[0.5, -np.inf]]], np.float32)
    picks = picks_from_scores(scores, np.array([[1]], np.int32), top_k=4)
    assert picks.tolist() == [[[0, -1, -1, -1]]]


def test_blocked_scoring_equals_unblocked():
    q, w, keys, visible = random_inputs(1, s=23)
    whole = select_topk(q, w, keys, visible, top_k=5, with_scores=True)
    for xp in (np, jnp):
        blocked = select_topk(*(xp.asarray(a) for a in (q, w, keys, visible)), top_k=5, with_scores=True, block=4)
        np.testing.assert_array_equal(np.asarray(blocked.picks), whole.picks)
        np.testing.assert_allclose(np.asarray(blocked.scores), whole.scores, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [256, 4])
@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_selection_has_one_type_with_or_without_scores(xp, block):
    """`select_topk` returns a `Selection` either way: the flag only fills or empties `scores`
    (one and several query blocks, both namespaces), and the picks do not depend on it."""
    args = [xp.asarray(a) for a in random_inputs(2, s=9)]
    bare = select_topk(*args, top_k=5, block=block)
    full = select_topk(*args, top_k=5, with_scores=True, block=block)
    assert type(bare) is Selection and type(full) is Selection
    assert bare.scores is None and full.scores.shape == (2, 9, 12) and full.scores.dtype == np.float32
    assert bare.picks.shape == (2, 9, 5) and bare.picks.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(bare.picks), np.asarray(full.picks))
