"""Config values that make no sense are refused where they come in, naming the field.

NaN, inf and zero where a positive finite number is needed, absurd sizes and ratios, values
of the wrong kind, and HF config dicts that lack the keys fixing the layer's shapes: each is a
`ValueError` or `TypeError` naming the field (or the config key), what was expected and what
came, at construction, never at the first call or as an out-of-memory error.
"""

from __future__ import annotations

import math

import pytest
from test_config import FLASH_HUB

from dsv4_jax import DeepseekV4Config, YarnScaling
from dsv4_jax.config import REQUIRED_HF_KEYS

YARN = dict(factor=16.0, original_max_position_embeddings=64)


@pytest.mark.parametrize("overrides, error, message", [
    (dict(rope_theta=math.inf), ValueError, r"DeepseekV4Config.rope_theta: expected a number > 1 \(finite\), got inf"),
    (dict(rope_theta=math.nan), ValueError, r"DeepseekV4Config.rope_theta: .*got nan"),
    (dict(compress_rope_theta=1.0), ValueError, r"DeepseekV4Config.compress_rope_theta: .*> 1 \(finite\), got 1.0"),
    (dict(rms_norm_eps=math.inf), ValueError,
     r"DeepseekV4Config.rms_norm_eps: expected a positive number \(finite, below 1\)"),
    (dict(rms_norm_eps=0.0), ValueError, r"DeepseekV4Config.rms_norm_eps: .*got 0.0"),
    (dict(rms_norm_eps="1e-6"), TypeError, r"DeepseekV4Config.rms_norm_eps: expected a number, got str"),
    (dict(rope_theta=True), TypeError, r"DeepseekV4Config.rope_theta: expected a number, got bool"),
    (dict(csa_compress_rate=1 << 20), ValueError, r"DeepseekV4Config.csa_compress_rate: expected a compression "
                                                  r"ratio of at most 65536"),
    (dict(hidden_size=1 << 40), ValueError, r"DeepseekV4Config.hidden_size: expected at most 1,048,576"),
    (dict(index_topk=2.0), ValueError, r"DeepseekV4Config.index_topk: expected a positive int, got 2.0"),
    (dict(layer_types=(1, 2)), TypeError, r"DeepseekV4Config.layer_types: expected layer type names"),
])
def test_nonsense_fields_are_refused_naming_them(overrides, error, message):
    with pytest.raises(error, match=message):
        DeepseekV4Config.tiny(**overrides)


@pytest.mark.parametrize("overrides, error, message", [
    (dict(attention_factor=0.0), ValueError,
     r"YarnScaling.attention_factor: expected a positive number \(finite\), got 0.0"),
    (dict(beta_fast=math.nan), ValueError, r"YarnScaling.beta_fast: .*got nan"),
    (dict(factor=math.inf), ValueError, r"YarnScaling.factor: .*got inf"),
    (dict(beta_fast=1.0, beta_slow=2.0), ValueError, r"YarnScaling.beta_fast: expected more than beta_slow"),
    (dict(original_max_position_embeddings=0), ValueError, r"original_max_position_embeddings: expected a positive"),
    (dict(truncate="yes"), TypeError, r"YarnScaling.truncate: expected a bool, got str"),
])
def test_nonsense_yarn_parameters_are_refused_naming_them(overrides, error, message):
    with pytest.raises(error, match=message):
        YarnScaling(**{**YARN, **overrides})


def hub(**changes):
    out = {**FLASH_HUB, **changes}
    return {k: v for k, v in out.items() if v is not None}


@pytest.mark.parametrize("config, error, message", [
    (hub(rope_theta=math.inf), ValueError, r"rope_theta: expected a number > 1 \(finite\), got inf"),
    (hub(rms_norm_eps=math.inf), ValueError, r"rms_norm_eps: .*got inf"),
    (hub(rope_scaling={**FLASH_HUB["rope_scaling"], "attention_factor": 0}), ValueError, r"attention_factor: .*got 0"),
    (hub(rope_scaling={**FLASH_HUB["rope_scaling"], "beta_fast": math.nan}), ValueError, r"beta_fast: .*got nan"),
    (hub(rope_scaling={**FLASH_HUB["rope_scaling"], "beta_fast": 0}), ValueError, r"beta_fast: .*got 0"),
    (hub(rope_scaling={**FLASH_HUB["rope_scaling"], "factor": "16"}), TypeError, r"\['factor'\]: expected a number"),
    (hub(rope_parameters=[1, 2]), TypeError, r"config\['rope_parameters'\]: expected a mapping .*got list"),
    (hub(rope_scaling="yarn"), TypeError, r"config\['rope_scaling'\]: expected a mapping .*got str"),
    (hub(compress_ratios="0,4"), TypeError, r"config\['compress_ratios'\]: expected a list, got str"),
    (hub(rope_theta="10000"), TypeError, r"config\['rope_theta'\]: expected a number, got str"),
    (hub(num_hidden_layers="43"), ValueError, r"config\['num_hidden_layers'\]: expected a positive int, got '43'"),
    (hub(qk_rope_head_dim=None, partial_rotary_factor="1/8"), TypeError,
     r"config\['partial_rotary_factor'\]: expected a number, got str"),
    (hub(rope_parameters={"main": {"rope_theta": 1e4}}), TypeError,
     r"config\['rope_parameters'\]: expected either both"),
])
def test_nonsense_hf_values_are_refused_naming_the_key(config, error, message):
    with pytest.raises(error, match=message):
        DeepseekV4Config.from_hf(config)


def test_a_hf_config_without_the_shape_keys_is_refused_naming_them():
    with pytest.raises(ValueError, match=r"config: expected the keys that fix .*shapes.*without num_attention_heads, "
                                         r"head_dim, .*'layer_types' or 'compress_ratios', 'qk_rope_head_dim' or "
                                         r"'partial_rotary_factor'"):
        DeepseekV4Config.from_hf({"hidden_size": 64})
    for key in REQUIRED_HF_KEYS:
        with pytest.raises(ValueError, match=rf"without {key}$"):
            DeepseekV4Config.from_hf(hub(**{key: None}))
    # The rest have HF's defaults: a config.json without them still reads.
    assert DeepseekV4Config.from_hf(hub(rope_theta=None, rms_norm_eps=None)) == DeepseekV4Config.flash()
