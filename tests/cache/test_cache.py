"""The cache: fixed shapes sized by max_seq_len, a pytree that jits, per layer type."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4_jax import AttentionCache, DeepseekV4Attention, DeepseekV4Config
from dsv4_jax.cache.contiguous import cache_nbytes, insert_ring
from dsv4_jax.step.pure_step import step_function


def test_shapes_per_layer_type():
    cfg = DeepseekV4Config.tiny()
    shapes = {}
    for layer in range(3):
        cache = DeepseekV4Attention(cfg, layer, rngs=nnx.Rngs(0)).init_cache(batch_size=2, max_seq_len=37)
        shapes[layer] = jax.tree.map(lambda a: tuple(a.shape), cache)
        assert isinstance(cache, AttentionCache) and cache.max_seq_len == 37 and cache.layer_idx == layer
        assert isinstance(cache.length, np.ndarray) and cache.length.tolist() == [0, 0]
    assert shapes[0].window == (2, 8, 32) and shapes[0].compressor is None and shapes[0].indexer is None
    csa = shapes[1]
    # CSA's rings hold two windows of m = 4 (the unfinished one and the one before it, whose
    # Ca half the next entry pools), kv and gate side by side, each [Ca | Cb] wide; HCA's one
    # window of m = 8.
    assert csa.compressor.entries == (2, 9, 32) and csa.compressor.buffer == (2, 8, 2 * 64)
    assert csa.indexer.entries == (2, 9, 16) and csa.indexer.buffer == (2, 8, 2 * 32)
    hca = shapes[2]
    assert hca.compressor.entries == (2, 4, 32) and hca.compressor.buffer == (2, 8, 2 * 32)
    assert hca.indexer is None


def test_insert_keeps_the_last_r_tokens_in_their_slots():
    ring = np.zeros((1, 4, 1), np.float32)
    ring = insert_ring(ring, np.arange(6, dtype=np.float32).reshape(1, 6, 1) + 10, np.array([0]))
    assert ring[0, :, 0].tolist() == [14, 15, 12, 13]  # positions 4, 5, 2, 3 in slots p % 4
    # One more token (a decode step) overwrites the oldest slot; a frozen row writes nothing;
    # a ragged row writes its real tokens only.
    ring = insert_ring(ring, np.array([[[16.0]]], np.float32), np.array([6]))
    assert ring[0, :, 0].tolist() == [14, 15, 16, 13]
    frozen = insert_ring(ring, np.array([[[17.0]]], np.float32), np.array([7]), frozen=np.array([True]))
    assert frozen[0, :, 0].tolist() == [14, 15, 16, 13]
    ragged = insert_ring(ring, np.array([[[17.0], [99.0]]], np.float32), np.array([7]), count=np.array([1]))
    assert ragged[0, :, 0].tolist() == [14, 15, 16, 17]


def test_cache_is_a_pytree_that_jits():
    cfg = DeepseekV4Config.tiny()
    cache = DeepseekV4Attention(cfg, 1, rngs=nnx.Rngs(0)).init_cache(1, 16)
    doubled = jax.jit(lambda c: jax.tree.map(lambda a: a + 1, c))(cache)
    assert jax.tree.structure(doubled) == jax.tree.structure(cache)
    assert doubled.layer_type == cache.layer_type and doubled.max_seq_len == 16


def test_size_is_linear_in_max_seq_len():
    cfg = DeepseekV4Config.flash()
    attn = jax.eval_shape(lambda: DeepseekV4Attention(cfg, 2, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16))
    small = cache_nbytes(jax.eval_shape(lambda: attn.init_cache(1, 4096)))
    large = cache_nbytes(jax.eval_shape(lambda: attn.init_cache(1, 8192)))
    per_token = (large - small) / 4096
    # CSA: one 512-wide and one 128-wide entry per 4 tokens, bf16 -> (512 + 128) * 2 / 4 bytes/token
    assert per_token == (512 + 128) * 2 / 4


def test_length_is_the_steps_and_the_eager_call_keeps_a_host_mirror():
    """One owner of `length`: the step returns it; the eager call replaces that device value by a
    host NumPy mirror (advanced by the same rule), equal to it, so the next call's checks need no
    device round trip."""
    cfg = DeepseekV4Config.tiny()
    attn = DeepseekV4Attention(cfg, 0, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(2, 5, cfg.hidden_size)).astype(np.float32)
    pos = np.broadcast_to(np.arange(5, dtype=np.int32), (2, 5))
    cache = attn.init_cache(2, 16)
    _, eager = attn(x, pos, cache)
    _, stepped, _ = step_function(False)(attn.weights(), cache, x, pos, spec=attn.step_spec())
    assert isinstance(eager.length, np.ndarray) and eager.length.dtype == np.int32
    assert isinstance(stepped.length, jax.Array) and eager.length.tolist() == [5, 5]
    np.testing.assert_array_equal(eager.length, np.asarray(stepped.length))
    _, again = attn(x, pos + 5, eager)  # the mirror is what the next call checks against
    assert isinstance(again.length, np.ndarray) and again.length.tolist() == [10, 10]
