"""Compressor: streaming gated pooling equals the spec's one-shot formula (float64 oracle)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.cache.contiguous import init_compressor_cache, ring_slots
from dsv4_jax.ops.compress.reference import compress, visible_entries


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
        # The ring holds the last R tokens' raw projections [kv | gate], slot p % R (R = 2m for
        # CSA: the unfinished window and the one before it; m for HCA), zeros where no token was yet.
        ring = ring_slots(m, overlap)
        held = np.arange(max(0, start - ring), start)
        expected = np.zeros((2, ring, 2 * width), np.float32)
        expected[:, held % ring] = np.concatenate([c[:, held], z[:, held]], axis=-1)
        np.testing.assert_array_equal(np.asarray(state.buffer), expected)


def test_an_entry_is_visible_from_the_last_token_of_its_window():
    # Spec 5.4: query t sees entry w iff w < (t + 1) // m.
    np.testing.assert_array_equal(visible_entries(np.arange(9), 4), [0, 0, 0, 1, 1, 1, 1, 2, 2])


@pytest.mark.parametrize(("m", "overlap"), [(4, True), (8, False)], ids=["csa", "hca"])
@pytest.mark.parametrize("batch", [1, 4])
def test_a_decode_step_copies_no_compressor_state(m, overlap, batch):
    # A decode step writes its token into the ring in place (one scatter) and reads the
    # windows it pools from the updated ring: no reader of the ring's old value is left, so XLA's
    # optimized program, with the state donated as in a serving step, copies none of the
    # state. (Reading the old buffers and a separate CSA overlap while writing them cost two
    # copies of each buffer and one of each overlap array, on the CPU and at B = 1 on the H200:
    # docs/journal/DEVELOPING_performance_log_2026-11-30_to_2026-12-02.md.) The same function as every decode step runs.
    dim = 16
    width = 2 * dim if overlap else dim
    kw = dict(position_bias=jnp.zeros((m, width), jnp.float32), kv_norm=jnp.ones((dim,), jnp.float32), ratio=m,
              overlap=overlap, freqs=jnp.array([0.9, 0.3], jnp.float32), rope_scale=1.0, eps=1e-6)
    state = init_compressor_cache(batch, 4, m, dim, width, overlap, jnp.float32)
    step = jax.jit(lambda kv, gate, state, length: compress(kv, gate, state, length, **kw), donate_argnums=(2,))
    token = jnp.ones((batch, 1, width), jnp.float32)
    hlo = step.lower(token, token, state, jnp.full((batch,), 5, jnp.int32)).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    state_shapes = {f"f32[{','.join(map(str, a.shape))}]" for a in jax.tree.leaves(state)}
    copies = re.findall(r"= (\S+) copy\(", entry)
    assert not [c for c in copies if c.split("{")[0] in state_shapes], f"copies of the state: {copies}"


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_the_streams_shift_reads_zeros_outside_and_differentiates_without_atomic_adds(xp):
    """`_rows_at` (the stream's per-row shift of the call's tokens by the buffered count): x at
    each row's indices, zeros outside [0, S); its gradient is the clipped `take_along_axis`'s
    (the form it replaced), and its transpose is a scatter of unique indices (on CUDA a plain
    store, where the clipped form's repeated ends made XLA add atomically)."""
    from dsv4_jax.ops.compress.reference import _rows_at

    rng = np.random.default_rng(7)
    x = rng.normal(size=(3, 6, 5)).astype(np.float32)
    idx = (np.arange(10)[None, :] - np.array([[0], [2], [3]])).astype(np.int32)  # [3, 10]: -3 .. 9
    inside = (idx >= 0) & (idx < 6)
    want = np.where(inside[..., None], np.take_along_axis(x, np.clip(idx, 0, 5)[..., None], 1), 0)
    np.testing.assert_array_equal(np.asarray(_rows_at(xp.asarray(x), xp.asarray(idx))), want)
    if xp is np:
        return
    cot = jnp.asarray(rng.normal(size=want.shape), jnp.float32)

    def clipped(x):
        return jnp.where(inside[..., None], jnp.take_along_axis(x, jnp.clip(idx, 0, 5)[..., None], 1), 0)

    got = jax.vjp(lambda x: _rows_at(x, jnp.asarray(idx)), jnp.asarray(x))[1](cot)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.vjp(clipped, jnp.asarray(x))[1](cot)[0]), rtol=1e-6)
    hlo = jax.jit(jax.grad(lambda x: jnp.sum(_rows_at(x, jnp.asarray(idx)) * cot))).lower(jnp.asarray(x)).as_text()
    scatters = re.findall(r"stablehlo\.scatter.*", hlo)
    assert scatters and all("unique_indices = true" in s for s in scatters), scatters
