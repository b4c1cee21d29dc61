"""Weights: HF names and [out, in] layout in, the same out; prefixes; dtypes."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import golden_layer

from dsv4_jax import CSA, HCA, SLIDING, DeepseekV4Attention, load_hf_attention_weights
from dsv4_jax.io.hf_weights import expected_shapes, export_hf_attention_weights

# HF `DeepseekV4Attention.state_dict()` name -> (the layer's parameter, layout), written from the
# spec (section 11) and the layer's docstring, independently of dsv4_jax.io.hf_weights. Layouts: "T",
# a linear weight, HF [out, in] -> [in, out]; "grouped", o_a_proj [G*R, H*D/G], group g's
# rows g*R:(g+1)*R, -> [G, H*D/G, R]; "=", float32 vectors and position biases as they are.
_COMMON = {
    "q_a_proj.weight": ("q_a_proj", "T"), "q_a_norm.weight": ("q_a_norm", "="),
    "q_b_proj.weight": ("q_b_proj", "T"), "kv_proj.weight": ("kv_proj", "T"), "kv_norm.weight": ("kv_norm", "="),
    "o_a_proj.weight": ("o_a_proj", "grouped"), "o_b_proj.weight": ("o_b_proj", "T"), "sinks": ("sinks", "="),
}
_COMPRESSOR = {
    "compressor.kv_proj.weight": ("compressor.kv_proj", "T"),
    "compressor.gate_proj.weight": ("compressor.gate_proj", "T"),
    "compressor.position_bias": ("compressor.position_bias", "="),
    "compressor.kv_norm.weight": ("compressor.kv_norm", "="),
}
_INDEXER = {
    "compressor.indexer.kv_proj.weight": ("indexer.compressor.kv_proj", "T"),
    "compressor.indexer.gate_proj.weight": ("indexer.compressor.gate_proj", "T"),
    "compressor.indexer.position_bias": ("indexer.compressor.position_bias", "="),
    "compressor.indexer.kv_norm.weight": ("indexer.compressor.kv_norm", "="),
    "compressor.indexer.q_b_proj.weight": ("indexer.q_b_proj", "T"),
    "compressor.indexer.scorer.weights_proj.weight": ("indexer.weights_proj", "T"),
}
LAYOUT = {SLIDING: _COMMON, HCA: {**_COMMON, **_COMPRESSOR}, CSA: {**_COMMON, **_COMPRESSOR, **_INDEXER}}


def assert_holds_in_jax_layout(attn, hf_weights):
    """`attn`'s parameters are exactly `hf_weights` (HF names and layout, float32) per LAYOUT."""
    assert sorted(hf_weights) == sorted(LAYOUT[attn.layer_type])
    for name, (path, layout) in LAYOUT[attn.layer_type].items():
        got = np.asarray(functools.reduce(getattr, path.split("."), attn)[...], np.float32)
        w = np.asarray(hf_weights[name], np.float32)
        if layout == "T":
            w = w.T
        elif layout == "grouped":
            r = attn.config.o_lora_rank
            w = np.stack([w[g * r:(g + 1) * r].T for g in range(attn.config.o_groups)])
        np.testing.assert_array_equal(got, w, err_msg=name)


def test_load_puts_each_hf_tensor_in_its_parameter(small):
    # The recorded files hold HF's own state_dict names: the names LAYOUT knows, per layer type.
    for layer in range(3):
        assert_holds_in_jax_layout(golden_layer(small, layer), small.weights(layer))


def test_expected_shapes_are_hfs_for_every_layer_type(small):
    """The HF table is derived from the layer's parameters; it must name and shape exactly what
    HF's own state_dict holds (the recorded files), per layer type, also for a config that
    lacks the layer type (then an abstract layer of that type alone is described)."""
    for layer, layer_type in enumerate(small.cfg.layer_types):
        hf = {name: value.shape for name, value in small.weights(layer).items()}
        table = expected_shapes(small.cfg, layer_type)
        assert sorted(table) == sorted(LAYOUT[layer_type])
        assert {name: shape for name, (shape, _) in table.items()} == hf
        assert {name: kind for name, (_, kind) in table.items()} == {
            name: {"T": "linear", "grouped": "grouped", "=": "fp32"}[layout]
            for name, (_, layout) in LAYOUT[layer_type].items()}
        alone = dataclasses.replace(small.cfg, layer_types=tuple(t for t in small.cfg.layer_types if t != layer_type))
        assert expected_shapes(alone, layer_type) == table


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
