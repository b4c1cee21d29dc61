"""Sparse attention: gathered window + entries + sink equals dense masked attention (float64)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.cache.contiguous import insert_ring
from dsv4_jax.ops.sparse_attention.reference import (
    AttentionOutput,
    in_position_order,
    key_pool,
    sparse_attention,
    window_indices,
)


def dense_reference(q, keys, allowed, sinks):
    """q [B,S,H,D], keys [B,S,N,D] per query, allowed [B,S,N]; one softmax with a sink column."""
    logits = np.einsum("bshd,bsnd->bshn", q, keys) * q.shape[-1] ** -0.5
    logits = np.where(allowed[:, :, None, :], logits, -np.inf)
    full = np.concatenate([logits, np.broadcast_to(sinks[None, None, :, None], (*logits.shape[:3], 1))], -1)
    p = np.exp(full - full.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bshn,bsnd->bshd", p[..., :-1], keys), p[..., -1]


def test_window_indices_address_the_last_w_positions():
    # Cache holds 5 tokens (slots p % 4: 4, 1, 2, 3), this call brings positions 5, 6.
    # In position order the pool is [positions 1, 2, 3, 4 | 5, 6]: position p at 4 + p - 5.
    idx = np.asarray(window_indices(jnp.array([[5, 6]]), jnp.array([5]), 4))
    assert idx[0, 0].tolist() == [1, 2, 3, 4]  # position 5 sees 2, 3, 4 and itself
    assert idx[0, 1].tolist() == [2, 3, 4, 5]
    first = np.asarray(window_indices(jnp.array([[0, 1]]), jnp.array([0]), 4))
    assert first[0].tolist() == [[-1, -1, -1, 4], [-1, -1, 4, 5]]


@pytest.mark.parametrize("length", [0, 2, 5, 8, 11])
def test_the_pool_holds_the_window_in_position_order(length):
    # Slot p % 4 of the cache holds position p (as a value here); each query's valid window
    # indices are consecutive and address its positions, oldest first.
    w, s = 4, 3
    cache = np.full((1, w, 1), -1.0, np.float32)
    for p in range(length):
        cache[0, p % w, 0] = p
    keys = (length + np.arange(s, dtype=np.float32))[None, :, None]
    positions = jnp.asarray(length + np.arange(s, dtype=np.int32))[None]
    pool, idx, in_place = key_pool(jnp.asarray(cache), jnp.asarray(cache), jnp.asarray(keys), positions,
                                   jnp.asarray([length]), w)
    assert not in_place
    pool, idx = np.asarray(pool)[0, :, 0], np.asarray(idx)[0]
    for q, t in enumerate(range(length, length + s)):
        valid = idx[q][idx[q] >= 0]
        assert pool[valid].tolist() == list(range(max(0, t - w + 1), t + 1))
        assert valid.tolist() == list(range(valid[0], valid[0] + len(valid)))


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("block", [256, 3])
def test_matches_dense_masked_attention(kind, block):
    rng = np.random.default_rng(0)
    b, s, h, d, w, t, k, start = 2, 7, 3, 8, 4, 6, 3, 9
    q = rng.normal(size=(b, s, h, d)).astype(np.float32)
    ring = rng.normal(size=(b, w, d)).astype(np.float32)
    new = rng.normal(size=(b, s, d)).astype(np.float32)
    entries = rng.normal(size=(b, t, d)).astype(np.float32)
    sinks = rng.normal(size=(h,)).astype(np.float32)
    positions = np.broadcast_to(np.arange(start, start + s), (b, s)).astype(np.int32)
    pool = np.concatenate([ring, new], 1)
    widx = np.asarray(window_indices(jnp.asarray(positions), jnp.full((b,), start, jnp.int32), w))
    keys = [np.take_along_axis(pool[:, None], np.maximum(widx, 0)[..., None], 2)]
    allowed = [widx >= 0]
    kwargs = {}
    if kind == "csa":
        picks = rng.integers(-1, t, size=(b, s, k)).astype(np.int32)
        picks[..., 0] = np.arange(s) % t  # distinct valid picks first, some -1 after
        picks[..., 1] = np.where(picks[..., 1] == picks[..., 0], -1, picks[..., 1])
        picks[..., 2] = np.where((picks[..., 2] == picks[..., 0]) | (picks[..., 2] == picks[..., 1]), -1, picks[..., 2])
        keys.append(np.take_along_axis(entries[:, None], np.maximum(picks, 0)[..., None], 2))
        allowed.append(picks >= 0)
        kwargs = dict(entries=jnp.asarray(entries), picks=jnp.asarray(picks))
    elif kind == "hca":
        visible = (positions + 1) // 2
        keys.append(np.broadcast_to(entries[:, None], (b, s, t, d)))
        allowed.append(np.arange(t)[None, None] < visible[..., None])
        kwargs = dict(entries=jnp.asarray(entries), visible=jnp.asarray(visible))
    ref, sink_share = dense_reference(q.astype(np.float64), np.concatenate(keys, 2).astype(np.float64),
                                      np.concatenate(allowed, 2), sinks.astype(np.float64))
    out, sink_mass, window_mass, compressed_mass = sparse_attention(
        jnp.asarray(q), jnp.asarray(pool), jnp.asarray(widx), jnp.asarray(sinks), block=block, with_mass=True,
        **kwargs,
    )
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sink_mass), sink_share, rtol=1e-5)
    total = np.asarray(sink_mass) + np.asarray(window_mass) + np.asarray(compressed_mass)
    np.testing.assert_allclose(total, 1.0, rtol=1e-5)
    if kind == "sliding":
        assert not np.asarray(compressed_mass).any()
    # Without the masses: the same output in the same type, the masses None.
    bare = sparse_attention(jnp.asarray(q), jnp.asarray(pool), jnp.asarray(widx), jnp.asarray(sinks), block=block,
                            **kwargs)
    assert type(bare) is AttentionOutput
    assert bare.sink_mass is None and bare.window_mass is None and bare.compressed_mass is None
    np.testing.assert_array_equal(np.asarray(bare.o), np.asarray(out))


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("start", [0, 2, 9])
def test_a_decode_step_reads_its_window_from_the_updated_cache(kind, start):
    """A decode step's keys come from the window cache after the insert, in slot order (slot j,
    -1 while it holds no position), and the XLA path reads that cache without a gathered copy:
    the same attention as over [cache before in position order | new key] gathered by position,
    masses included. A prefill keeps the concatenated pool."""
    rng = np.random.default_rng(start)
    b, h, d, w, t = 2, 3, 8, 4, 6
    q = jnp.asarray(rng.normal(size=(b, 1, h, d)), jnp.float32)
    before = jnp.asarray(rng.normal(size=(b, w, d)), jnp.float32)
    key = jnp.asarray(rng.normal(size=(b, 1, d)), jnp.float32)
    length = jnp.array([start, start + 1], jnp.int32)  # ragged: the rows are at different positions
    positions = length[:, None]
    after = insert_ring(before, key, length)
    pool, widx, in_place = key_pool(before, after, key, positions, length, w)
    assert in_place and pool is after
    for row, p in enumerate(np.asarray(positions)[:, 0]):
        assert np.asarray(widx)[row, 0].tolist() == [j if j <= p else -1 for j in range(w)]
    kwargs = {}
    if kind == "csa":
        kwargs = dict(entries=jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32),
                      picks=jnp.array([[[0, 2, -1]], [[1, -1, -1]]], jnp.int32))
    elif kind == "hca":
        kwargs = dict(entries=jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32), visible=(positions + 1) // 2)
    sinks = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    got = sparse_attention(q, pool, widx, sinks, window_in_place=True, with_mass=True, **kwargs)
    old_pool = jnp.concatenate([in_position_order(before, length, w), key], axis=1)
    want = sparse_attention(q, old_pool, window_indices(positions, length, w), sinks, with_mass=True, **kwargs)
    for a, b_ in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-6, atol=1e-6)

    with pytest.raises(ValueError, match="window_in_place: expected one query per row"):
        sparse_attention(q, old_pool, widx, sinks, window_in_place=True, **kwargs)

    prefill_keys = jnp.concatenate([key, key], axis=1)
    pool, widx, in_place = key_pool(before, after, prefill_keys, jnp.concatenate([positions, positions + 1], 1),
                                    length, w)
    assert not in_place and pool.shape == (b, w + 2, d)
