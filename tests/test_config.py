"""Config: both HF config.json forms, the published presets, per-layer helpers."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json

import jax
import pytest

from dsv4_jax import CSA, HCA, SLIDING, DeepseekV4Config, YarnScaling
from dsv4_jax.backend import QUERY_BLOCK
from dsv4_jax.layer.options import LayerOptions
from dsv4_jax.ops.indexer import native as indexer_native
from dsv4_jax.ops.indexer import reference as indexer
from dsv4_jax.ops.sparse_attention.reference import sparse_attention
from dsv4_jax.step import breaks
from dsv4_jax.step.pure_step import StepSpec

# The attention part of DeepSeek-V4-Flash's hub config.json (spec section 1).
FLASH_HUB = {
    "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "num_hidden_layers": 43,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0], "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576, "n_routed_experts": 256, "vocab_size": 129280,
}


def test_normalized_form_from_golden(golden):
    cfg = golden.cfg
    hf = golden.meta["hf_config"]
    assert cfg.layer_types == (SLIDING, CSA, HCA)
    assert cfg.qk_rope_head_dim == hf["qk_rope_head_dim"]
    assert cfg.csa_compress_rate == 4 and cfg.hca_compress_rate == hf["compress_rates"][HCA]
    assert cfg.compress_rope_scaling == YarnScaling(factor=16.0, original_max_position_embeddings=64)
    assert cfg.rope_theta == 10000.0 and cfg.compress_rope_theta == 160000.0


def test_hub_form_gives_the_flash_preset():
    cfg = DeepseekV4Config.from_hf(FLASH_HUB)
    assert cfg == DeepseekV4Config.flash()
    assert cfg.num_layers == 43  # the MTP entry of compress_ratios is dropped
    counts = {t: cfg.layer_types.count(t) for t in (SLIDING, CSA, HCA)}
    assert counts == {SLIDING: 2, CSA: 21, HCA: 20}


def test_to_hf_writes_what_hf_wrote_for_the_same_model(golden):
    """`to_hf()` against HF's own serialization of the recorded model (the npz's `hf_config`,
    written by transformers 5.23.0): every field it writes, with HF's value."""
    hf = golden.meta["hf_config"]
    ours = golden.cfg.to_hf()
    # The recording left YaRN's `truncate` at HF's default (True), so its config.json omits it.
    want_compress = {"truncate": True, **hf["rope_parameters"]["compress"]}
    assert ours["rope_parameters"] == {"main": hf["rope_parameters"]["main"], "compress": want_compress}
    assert {k: v for k, v in ours.items() if k != "rope_parameters"} == {
        k: hf[k] for k in ours if k != "rope_parameters"}


def test_round_trip_through_the_normalized_form():
    for cfg in (DeepseekV4Config.flash(), DeepseekV4Config.pro(), DeepseekV4Config.tiny()):
        assert DeepseekV4Config.from_hf(cfg.to_hf()) == cfg


def test_pro_layout():
    cfg = DeepseekV4Config.pro()
    assert cfg.num_layers == 61 and cfg.layer_types[:3] == (HCA, HCA, CSA)
    assert cfg.layer_types.count(CSA) == 30 and cfg.layer_types.count(HCA) == 31
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.o_groups, cfg.index_topk) == (7168, 128, 16, 1024)


def test_flat_rope_parameters_describe_the_compress_rope():
    cfg = DeepseekV4Config.from_hf({**FLASH_HUB, "rope_scaling": None,
                                    "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 4096}})
    assert cfg.compress_rope_scaling.factor == 4.0
    assert cfg.rope_theta == 10000.0  # the main rope stays plain


def test_per_layer_helpers():
    cfg = DeepseekV4Config.tiny()
    assert [cfg.compress_rate(cfg.layer_type(i)) for i in range(3)] == [0, 4, 8]
    assert [cfg.rope_kind(t) for t in cfg.layer_types] == ["main", "compress", "compress"]
    with pytest.raises(ValueError, match="layer_idx"):
        cfg.layer_type(3)


def test_sizes_derived_from_the_config():
    """One owner per derived size: the compressor width and the entry slots (config methods),
    the query block (`backend.QUERY_BLOCK`, the default of every blocked function)."""
    cfg = DeepseekV4Config.tiny()  # head_dim 32, index_head_dim 16, ratios 4 (CSA) / 8 (HCA)
    assert cfg.compressor_width(CSA) == 64 and cfg.compressor_width(HCA) == 32
    assert cfg.compressor_width(CSA, indexer=True) == 32
    assert (cfg.entry_slots(CSA, 37), cfg.entry_slots(HCA, 37), cfg.entry_slots(HCA, 5)) == (9, 4, 1)
    for wrong in (lambda: cfg.compressor_width(SLIDING), lambda: cfg.compressor_width(HCA, indexer=True),
                  lambda: cfg.entry_slots(SLIDING, 8)):
        with pytest.raises(ValueError, match="layer_type"):
            wrong()
    defaults = {
        "LayerOptions.query_block": LayerOptions.__dataclass_fields__["query_block"].default,
        "StepSpec.query_block": StepSpec.__dataclass_fields__["query_block"].default,
        "select_topk(block)": inspect.signature(indexer.select_topk).parameters["block"].default,
        "index_scores(block)": inspect.signature(indexer.index_scores).parameters["block"].default,
        "sparse_attention(block)": inspect.signature(sparse_attention).parameters["block"].default,
        "_select_on_host(block)": inspect.signature(breaks.select_on_host).parameters["block"].default,
        "_select_native(block)": inspect.signature(indexer_native.select_native).parameters["block"].default,
    }
    assert defaults == dict.fromkeys(defaults, QUERY_BLOCK) and QUERY_BLOCK == 256


def test_equal_configs_share_one_compiled_step():
    """The config is a static argument of the jitted step: equal configs, however built (a list
    of layer types, a parsed config.json), must hit one compiled program, a different one not."""
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def step(cfg, x):
        traces.append(cfg)
        return x * cfg.hidden_size

    tiny = DeepseekV4Config.tiny()
    for cfg in (tiny, DeepseekV4Config.tiny(layer_types=[SLIDING, CSA, HCA]),
                DeepseekV4Config.from_hf(json.loads(json.dumps(tiny.to_hf())))):
        assert float(step(cfg, 1.0)) == 64.0
    assert len(traces) == 1
    step(DeepseekV4Config.tiny(sliding_window=16), 1.0)
    assert len(traces) == 2


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DeepseekV4Config.tiny().hidden_size = 1


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"o_groups": 3}, "o_groups"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"qk_rope_head_dim": 64}, "qk_rope_head_dim"),
        ({"index_head_dim": 4}, "index_head_dim"),
        ({"layer_types": ("dense",)}, "layer_types"),
        ({"index_topk": 0}, "index_topk"),
    ],
)
def test_inconsistent_configs_are_rejected(overrides, field):
    with pytest.raises(ValueError, match=field):
        DeepseekV4Config.tiny(**overrides)


def test_hub_ratios_outside_the_map_are_rejected():
    with pytest.raises(ValueError, match="compress_ratios"):
        DeepseekV4Config.from_hf({**FLASH_HUB, "compress_ratios": [0, 8, 128]})
