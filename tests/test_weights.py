"""Weights: HF names and [out, in] layout in, the same out; prefixes; dtypes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import golden_layer

from dsv4_jax import DeepseekV4Attention, load_hf_attention_weights
from dsv4_jax.weights import export_hf_attention_weights


def test_export_returns_what_was_loaded(small):
    for layer in range(3):
        attn = golden_layer(small, layer)
        exported = export_hf_attention_weights(attn)
        ref = small.weights(layer)
        assert exported.keys() == ref.keys()
        for name, value in ref.items():
            np.testing.assert_array_equal(exported[name], value, err_msg=name)


def test_prefixed_state_dict_selects_the_layer(small):
    full = {f"model.layers.{i}.self_attn.{k}": v for i in range(3) for k, v in small.weights(i).items()}
    attn = DeepseekV4Attention(small.cfg, 2, rngs=nnx.Rngs(0))
    load_hf_attention_weights(attn, full)
    np.testing.assert_array_equal(np.asarray(attn.compressor.position_bias[...]),
                                  small.weights(2)["compressor.position_bias"])


def test_layout_and_dtype_conversion(small):
    attn = golden_layer(small, 1, param_dtype=jnp.bfloat16)
    w = small.weights(1)
    np.testing.assert_array_equal(np.asarray(attn.q_a_proj[...], np.float32),
                                  np.asarray(jnp.asarray(w["q_a_proj.weight"].T, jnp.bfloat16), np.float32))
    g, r = small.cfg.o_groups, small.cfg.o_lora_rank
    o_a = np.asarray(attn.o_a_proj[...], np.float32)
    assert o_a.shape == (g, w["o_a_proj.weight"].shape[1], r)
    assert attn.sinks[...].dtype == jnp.float32 and attn.compressor.kv_norm[...].dtype == jnp.float32


def test_torch_tensors_are_accepted(small):
    torch = __import__("pytest").importorskip("torch")
    tensors = {k: torch.from_numpy(np.array(v)).to(torch.bfloat16) for k, v in small.weights(0).items()}
    attn = DeepseekV4Attention(small.cfg, 0, rngs=nnx.Rngs(0))
    load_hf_attention_weights(attn, tensors)
    assert attn.sinks[...].dtype == jnp.float32
