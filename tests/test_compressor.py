"""Compressor: streaming gated pooling equals the spec's one-shot formula (float64 oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.cache import init_compressor_cache
from dsv4_jax.compressor import compress, visible_entries


def oracle(c, z, bias, norm_w, m, overlap, freqs, eps=1e-6):
    """Spec 5.3, vectorized full-sequence form, in float64: entries [B, N // m, Dc]."""
    b, total, width = c.shape
    n = total // m
    cw = c[:, : n * m].reshape(b, n, m, width)
    zw = z[:, : n * m].reshape(b, n, m, width) + bias
    if overlap:
        d = width // 2
        prev_c = np.concatenate([np.zeros((b, 1, m, d)), cw[:, :-1, :, :d]], axis=1)
        prev_z = np.concatenate([np.full((b, 1, m, d), -np.inf), zw[:, :-1, :, :d]], axis=1)
        slots_c = np.concatenate([prev_c, cw[..., d:]], axis=2)
        slots_z = np.concatenate([prev_z, zw[..., d:]], axis=2)
    else:
        slots_c, slots_z = cw, zw
    p = np.exp(slots_z - slots_z.max(axis=2, keepdims=True))
    e = (p / p.sum(axis=2, keepdims=True) * slots_c).sum(axis=2)
    e = norm_w * e / np.sqrt((e * e).mean(-1, keepdims=True) + eps)
    half = len(freqs)
    ang = (np.arange(n) * m)[None, :, None] * freqs.astype(np.float64)
    x0, x1 = e[..., -2 * half :: 2], e[..., -2 * half + 1 :: 2]
    rot = np.stack([x0 * np.cos(ang) - x1 * np.sin(ang), x1 * np.cos(ang) + x0 * np.sin(ang)], -1)
    return np.concatenate([e[..., : -2 * half], rot.reshape(b, n, 2 * half)], -1)


@pytest.mark.parametrize("xp", ["numpy", "jax"])
@pytest.mark.parametrize(("m", "overlap"), [(4, True), (8, False), (3, True)], ids=["csa", "hca", "csa_m3"])
def test_streaming_matches_one_shot_oracle(xp, m, overlap):
    rng = np.random.default_rng(m)
    dim, total = 16, 45
    width = 2 * dim if overlap else dim
    c = rng.normal(size=(2, total, width)).astype(np.float32)
    z = rng.normal(size=(2, total, width)).astype(np.float32)
    bias = rng.normal(size=(m, width)).astype(np.float32)
    norm_w = (1 + 0.3 * rng.normal(size=dim)).astype(np.float32)
    freqs = np.array([0.9, 0.3, 0.01], np.float32)
    kw = dict(position_bias=bias, kv_norm=norm_w, ratio=m, overlap=overlap, freqs=freqs, rope_scale=1.0, eps=1e-6)
    state = init_compressor_cache(2, total // m, m, dim, width, overlap, jnp.float32)
    if xp == "numpy":
        state = jax.tree.map(np.asarray, state)
        fn = compress
    else:
        fn = jax.jit(compress, static_argnames=("ratio", "overlap", "rope_scale", "eps"))
    start = 0
    for n in (5, 1, 2, 11, 1, 1, 24):  # crosses windows mid-chunk, at chunk ends and inside decode steps
        length = np.full((2,), start, np.int32)
        state = fn(c[:, start:start + n], z[:, start:start + n], state, length, **kw)
        start += n
        done = start // m
        expected = oracle(c[:, :start].astype(np.float64), z[:, :start].astype(np.float64), bias, norm_w, m,
                          overlap, freqs)
        np.testing.assert_allclose(np.asarray(state.entries)[:, :done], expected, rtol=2e-5, atol=2e-6)
        # The unfinished window waits in the buffer, slot p % m.
        rest = start - done * m
        np.testing.assert_array_equal(np.asarray(state.buffer_kv)[:, :rest], c[:, done * m:start])
        np.testing.assert_array_equal(np.asarray(state.buffer_gate)[:, :rest], z[:, done * m:start])
        if overlap and done:
            last = slice((done - 1) * m, done * m)
            np.testing.assert_array_equal(np.asarray(state.overlap_kv), c[:, last, :dim])
            np.testing.assert_allclose(np.asarray(state.overlap_gate), z[:, last, :dim] + bias[:, :dim], rtol=1e-6)


def test_an_entry_is_visible_from_the_last_token_of_its_window():
    # Spec 5.4: query t sees entry w iff w < (t + 1) // m.
    np.testing.assert_array_equal(visible_entries(np.arange(9), 4), [0, 0, 0, 1, 1, 1, 1, 2, 2])
