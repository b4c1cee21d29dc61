"""Initialization: one seed gives the same weights for any `param_dtype` (drawn, then cast).

A bf16 layer and a float32 layer built from the same `nnx.Rngs` seed must hold the same
numbers up to the cast: ``bf16_param == float32_param.astype(bf16)``, bit for bit, for every
parameter of every layer type. (Drawing with `random.normal` directly in bf16 consumes the
random bits differently and gives unrelated numbers; `_projection` draws in float32.)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4_jax

TINY = dsv4_jax.DeepseekV4Config.tiny()


def _params(attn) -> dict[str, np.ndarray]:
    return {".".join(map(str, path)): np.asarray(var[...])
            for path, var in nnx.to_flat_state(nnx.state(attn, nnx.Param))}


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("layer_idx", range(TINY.num_layers))  # sliding, CSA, HCA
def test_same_seed_same_weights_for_any_param_dtype(layer_idx, param_dtype):
    ref = _params(dsv4_jax.DeepseekV4Attention(TINY, layer_idx, rngs=nnx.Rngs(7), param_dtype=jnp.float32))
    low = _params(dsv4_jax.DeepseekV4Attention(TINY, layer_idx, rngs=nnx.Rngs(7), param_dtype=param_dtype))
    assert sorted(low) == sorted(ref)
    random = [name for name, v in ref.items() if v.std() > 0]  # the projections
    assert "q_a_proj" in random and "o_b_proj" in random
    for name, value in low.items():
        expected = ref[name].astype(value.dtype)  # norms, sinks, position biases stay float32
        assert value.dtype == (jnp.dtype(param_dtype) if name in random else np.float32), name
        np.testing.assert_array_equal(value.view(np.uint16 if value.itemsize == 2 else np.uint32),
                                      expected.view(np.uint16 if value.itemsize == 2 else np.uint32),
                                      err_msg=f"{name}: another draw in {jnp.dtype(param_dtype).name}")


def test_seeds_still_matter():
    a = _params(dsv4_jax.DeepseekV4Attention(TINY, 1, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16))
    b = _params(dsv4_jax.DeepseekV4Attention(TINY, 1, rngs=nnx.Rngs(1), param_dtype=jnp.bfloat16))
    assert not np.array_equal(a["q_b_proj"].astype(np.float32), b["q_b_proj"].astype(np.float32))
    # variance 1/in for a projection [in, out]
    q = a["indexer.q_b_proj"].astype(np.float32)
    assert abs(q.std() * np.sqrt(q.shape[0]) - 1.0) < 0.1
