"""The cache: fixed shapes sized by max_seq_len, a pytree that jits, per layer type."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4_jax import AttentionCache, DeepseekV4Attention, DeepseekV4Config
from dsv4_jax.attention import step_function
from dsv4_jax.cache import cache_nbytes


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
    assert csa.compressor.entries == (2, 9, 32) and csa.compressor.buffer_kv == (2, 4, 64)
    assert csa.compressor.overlap_kv == (2, 4, 32) and csa.indexer.entries == (2, 9, 16)
    hca = shapes[2]
    assert hca.compressor.entries == (2, 4, 32) and hca.compressor.buffer_kv == (2, 8, 32)
    assert hca.compressor.overlap_kv is None and hca.indexer is None


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
    _, stepped, _ = step_function(False)(attn.weights(), cache, x, pos, spec=attn.step_spec(x.dtype))
    assert isinstance(eager.length, np.ndarray) and eager.length.dtype == np.int32
    assert isinstance(stepped.length, jax.Array) and eager.length.tolist() == [5, 5]
    np.testing.assert_array_equal(eager.length, np.asarray(stepped.length))
    _, again = attn(x, pos + 5, eager)  # the mirror is what the next call checks against
    assert isinstance(again.length, np.ndarray) and again.length.tolist() == [10, 10]
