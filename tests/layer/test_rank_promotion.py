"""The layer runs under JAX's strictest broadcasting setting.

Under ``jax.numpy_rank_promotion("raise")`` every implicit rank promotion is an error, so
the package spells out every broadcast (prefill, ragged decode, each layer type and break
mode, the official numerics with an FP8 cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax
from dsv4_jax.config import CSA, HCA, SLIDING

LAYERS = {SLIDING: 0, CSA: 1, HCA: 2}


@pytest.mark.parametrize("layer_type, options, cache_options", [
    (SLIDING, dict(break_mode="narrow"), {}),
    (HCA, dict(break_mode="narrow"), {}),
    (HCA, dict(break_mode="wide"), {}),
    (CSA, dict(break_mode="none"), {}),
    (CSA, dict(break_mode="narrow"), {}),
    (CSA, dict(break_mode="wide"), {}),
    (CSA, dict(numerics="official", param_dtype=jnp.bfloat16), dict(kv_cache_dtype="fp8")),
])
def test_prefill_and_decode_under_rank_promotion_raise(layer_type, options, cache_options):
    cfg = dsv4_jax.DeepseekV4Config.tiny()
    x = np.random.default_rng(0).normal(size=(2, 9, cfg.hidden_size)).astype(np.float32)
    with jax.numpy_rank_promotion("raise"):
        attn = dsv4_jax.DeepseekV4Attention(cfg, LAYERS[layer_type], rngs=__import__("flax").nnx.Rngs(0), **options)
        cache = attn.init_cache(2, 32, **cache_options)
        out, cache = attn(x, None, cache)  # prefill
        out, cache = attn(x[:, :2], np.array([[9, 10], [9, -1]], np.int32), cache)  # ragged decode
        out, cache, _ = attn(x[:, :1], None, cache, return_intermediates=True)
        assert np.isfinite(np.asarray(out, np.float32)).all()
