"""A cache is checked field by field against what this layer's `init_cache` makes.

Any field of the cache pytree of another shape or dtype (another indexer width, a compressor
ring of another ratio, a length of another batch) is a `ValueError` naming that field, what
was expected and what came, before anything runs; a cache filled under the other numerics is
refused too. The cache passed in stays usable.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_layer

import dsv4_jax
from dsv4_jax.config import CSA, HCA, SLIDING

LAYERS = {SLIDING: 0, CSA: 1, HCA: 2}


@pytest.fixture(scope="module")
def cfg():
    return dsv4_jax.DeepseekV4Config.tiny()


def call(attn, cache, tokens=2):
    """A call of `tokens` new tokens a row with explicit positions (the memo's path; `positions=None`
    reads the cache first, `test_a_length_of_another_batch_...` takes both)."""
    x = np.random.default_rng(0).normal(size=(cache.batch_size, tokens, attn.config.hidden_size)).astype(np.float32)
    positions = (np.asarray(cache.length)[:, None] + np.arange(tokens)).astype(np.int32)
    return attn(x, positions, cache)


def cache_of(cfg, layer_type, **overrides):
    other = dsv4_jax.DeepseekV4Config.tiny(**overrides)
    attn = dsv4_jax.DeepseekV4Attention(other, LAYERS[layer_type], rngs=__import__("flax").nnx.Rngs(0))
    return attn.init_cache(1, 16)


@pytest.mark.parametrize("layer_type, overrides, field", [
    (CSA, dict(index_head_dim=32), r"cache\.indexer\.entries: expected float32\[B, 4, 16\]"),
    (CSA, dict(csa_compress_rate=8), r"cache\.compressor\.entries: expected float32\[B, 4, 32\]"),
    (HCA, dict(hca_compress_rate=4), r"cache\.compressor\.entries: expected float32\[B, 2, 32\]"),
    (HCA, dict(hca_compress_rate=16, max_position_embeddings=4096), r"cache\.compressor\.entries"),
    (SLIDING, dict(head_dim=16, qk_rope_head_dim=8), r"cache\.window: expected shape \[B, 8, 32\]"),
])
def test_a_cache_of_another_config_is_refused_naming_the_field(cfg, layer_type, overrides, field):
    attn = random_layer(cfg, LAYERS[layer_type])
    with pytest.raises(ValueError, match=field + r".*got .*\[1, .*\] \(a cache made for another config\?\)"):
        call(attn, cache_of(cfg, layer_type, **overrides))
    call(attn, attn.init_cache(1, 16))


@pytest.mark.parametrize("good_first", [False, True])  # True: the layer's memo knows the good structure
def test_a_compressor_ring_of_another_ratio_is_refused(cfg, good_first):
    attn = random_layer(cfg, LAYERS[HCA])
    good = attn.init_cache(1, 16)
    if good_first:
        call(attn, good)
    ring = good.compressor.buffer
    crafted = good.replace(compressor=good.compressor.replace(buffer=jnp.zeros((1, 4, ring.shape[2]), ring.dtype)))
    with pytest.raises(ValueError, match=rf"cache\.compressor\.buffer: expected float32\[B, {ring.shape[1]}, "
                                         rf"{ring.shape[2]}\].*got float32\[1, 4, {ring.shape[2]}\]"):
        call(attn, crafted)
    call(attn, good)


def test_a_field_of_another_dtype_is_refused(cfg):
    attn = random_layer(cfg, LAYERS[CSA])
    good = attn.init_cache(1, 16)
    crafted = good.replace(indexer=good.indexer.replace(entries=good.indexer.entries.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match=r"cache\.indexer\.entries: expected float32\[B, 4, 16\].*got bfloat16"):
        call(attn, crafted)


def test_a_length_of_another_batch_is_an_error_of_the_cache_not_of_positions(cfg):
    attn = random_layer(cfg, LAYERS[SLIDING])
    good = attn.init_cache(2, 16)
    call(attn, good)  # the memo knows the good structure
    for length in (np.zeros((3,), np.int32), np.zeros((2, 1), np.int32), np.zeros((2,), np.float32)):
        crafted = good.replace(length=length)
        for positions in (None, np.zeros((2, 1), np.int32)):
            with pytest.raises(ValueError, match=r"^cache\.length: expected int32 \[B\] with B = 2"):
                attn(np.zeros((2, 1, cfg.hidden_size), np.float32), positions, crafted)
    call(attn, good)


@pytest.mark.parametrize("made, used", [("reference", "official"), ("official", "reference")])
def test_a_cache_filled_under_the_other_numerics_is_refused(cfg, made, used):
    maker = random_layer(cfg, LAYERS[CSA], param_dtype=jnp.bfloat16, numerics=made)
    user = random_layer(cfg, LAYERS[CSA], param_dtype=jnp.bfloat16, numerics=used)
    _, filled = call(maker, maker.init_cache(1, 16), tokens=5)
    with pytest.raises(ValueError, match=rf"cache: expected a cache of a layer with numerics='{used}'.*got one made "
                                         rf"by a layer with numerics='{made}'"):
        call(user, filled)
    call(maker, filled)  # still the maker's, and usable
    call(user, user.init_cache(1, 16))
