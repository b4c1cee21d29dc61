"""Finite means finite in the dtype the step computes in.

An input finite in its own dtype may overflow when cast to the layer's compute dtype (float64
1e39 into float32, float32 3.4e38 into bfloat16, 1e5 into float16): the step would compute on
inf, return NaN and write inf into the returned cache. Such inputs are refused like a NaN,
naming the argument; loaded weights are checked in the dtype the parameter will hold.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_layer

import dsv4_jax
from dsv4_jax.io.hf_weights import export_hf_attention_weights
from dsv4_jax.layer import call as call_path
from dsv4_jax.layer import validation

SLIDING_LAYER = 0


@pytest.fixture(scope="module")
def cfg():
    return dsv4_jax.DeepseekV4Config.tiny()


def hidden(cfg, value, dtype, where=(0, 1, 5)):
    x = np.random.default_rng(0).normal(size=(1, 2, cfg.hidden_size)).astype(dtype)
    x[where] = value
    return x


@pytest.mark.parametrize("layer_dtype, value, input_dtype", [
    (jnp.float32, 1e39, np.float64),
    (jnp.bfloat16, 3.4e38, np.float32),
    (jnp.float16, 1e5, np.float32),
])
@pytest.mark.parametrize("as_jax", [False, True])
def test_an_input_overflowing_the_compute_dtype_is_refused_and_the_cache_stays_usable(
        cfg, layer_dtype, value, input_dtype, as_jax):
    attn = random_layer(cfg, SLIDING_LAYER, param_dtype=layer_dtype)
    cache = attn.init_cache(1, 16)
    x = hidden(cfg, value, input_dtype)
    assert np.isfinite(x).all()
    bad = jnp.asarray(x) if as_jax and input_dtype != np.float64 else x
    pos = np.arange(2, dtype=np.int32)[None]
    for _ in range(2):  # the first call of the structure (full checks) and a memo hit (value checks)
        with pytest.raises(ValueError, match=r"hidden_states: expected finite values, got 1 non-finite .*"
                                             r"first at \[0, 1, 5\].*compute dtype"):
            attn(bad, pos, cache)
        out, new = attn(hidden(cfg, 0.5, np.float32), pos, cache)  # the cache passed in is intact
        assert np.isfinite(np.asarray(out, np.float32)).all()
        assert np.isfinite(np.asarray(new.window, np.float32)).all()


def test_widening_casts_are_never_rescanned_and_nan_is_still_refused():
    big = np.full((1, 1, 4), 3.4e38, np.float32)
    validation.check_finite("hidden_states", big, True, jnp.float32)  # finite in float32
    with pytest.raises(ValueError, match="hidden_states: expected finite values"):
        validation.check_finite("hidden_states", big, True, jnp.bfloat16)
    with pytest.raises(ValueError, match="hidden_states: expected finite values"):
        validation.check_finite("hidden_states", np.full((1, 1, 4), np.nan, np.float16), True, jnp.float32)
    assert validation.as_computed(big, jnp.float32) is big


def test_the_device_verdicts_cast_first():
    x = jnp.asarray(np.full((1, 1, 4), 3.4e38, np.float32))
    assert bool(validation._all_finite(x, jnp.dtype(jnp.float32)))
    assert not bool(validation._all_finite(x, jnp.dtype(jnp.bfloat16)))
    finite, guarded = call_path._FINITE_GUARD(x, jnp.dtype(jnp.bfloat16))
    assert not bool(finite) and not np.asarray(guarded).any()  # zeroed: the step never sees the inf


def test_a_weight_overflowing_the_param_dtype_is_refused_naming_it(cfg):
    attn = random_layer(cfg, SLIDING_LAYER, param_dtype=jnp.bfloat16)
    weights = export_hf_attention_weights(attn)
    before = {k: v.copy() for k, v in weights.items()}
    weights["q_b_proj.weight"] = weights["q_b_proj.weight"].copy()
    weights["q_b_proj.weight"][0, 0] = 3.4e38  # finite in float32, inf in bfloat16
    with pytest.raises(ValueError, match=r"'q_b_proj.weight': expected finite values, got 1 non-finite "
                                         r"\(1 of them finite in the given float32, overflowing bfloat16\)"):
        dsv4_jax.load_hf_attention_weights(attn, weights)
    after = export_hf_attention_weights(attn)  # nothing was loaded
    assert all(np.array_equal(after[k], before[k]) for k in before)
    # Norm weights, sinks and position biases stay float32 in every param_dtype: 3.4e38 fits there.
    weights["q_b_proj.weight"] = before["q_b_proj.weight"]
    weights["sinks"] = np.full_like(before["sinks"], 3.4e38)
    dsv4_jax.load_hf_attention_weights(attn, weights)
