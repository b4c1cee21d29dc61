"""DeepSeek-V4 attention configuration.

`DeepseekV4Config` is a frozen (hashable) dataclass: it is a static argument of every
compiled step, so two layers with equal configs share compiled code.

It reads both forms of a Hugging Face `config.json`:

* the *normalized* form that transformers 5.23 writes back (`layer_types`, `compress_rates`,
  `rope_parameters` nested as ``{"main": {...}, "compress": {...}}``, `partial_rotary_factor`);
* the *hub* form shipped with the checkpoints (`compress_ratios` list of 0/4/128 with one
  extra MTP entry, flat `rope_scaling`, `qk_rope_head_dim`).

Layer types (spec section 1.2):

=====  =================================  ===========================================
ratio  layer type                         keys of a query at position t
=====  =================================  ===========================================
0      ``sliding_attention``              the last ``sliding_window`` tokens
4      ``compressed_sparse_attention``    window + top-k of the 4:1 entries (indexer)
128    ``heavily_compressed_attention``   window + every visible 128:1 entry
=====  =================================  ===========================================
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)

# The legacy hub field `compress_ratios` maps exactly these ratios to layer types (HF does the same).
_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}

# The keys of a HF config.json that fix the attention layer's shapes (`from_hf` requires them).
REQUIRED_HF_KEYS = ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                    "sliding_window", "index_n_heads", "index_head_dim", "index_topk")
_MAX_SIZE = 1 << 20  # any width, head count, rank, window or top-k
_MAX_POSITIONS = 1 << 40
_MAX_RATIO = 1 << 16  # tokens a compressed entry: the compressor's ring holds up to twice as many rows


def _check_number(name: str, value: Any, *, low: float, high: float = math.inf) -> None:
    """A finite real number (int or float, not bool) with low < value < high, else an error naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and low < value < high):
        what = "a positive number" if low == 0 else f"a number > {low:g}"
        raise ValueError(f"{name}: expected {what} (finite{'' if high == math.inf else f', below {high:g}'}), "
                         f"got {value!r}")


def _hf_number(key: str, value: Any, where: str = "config") -> float:
    """`float(value)` of a HF config key, a `TypeError` naming the key for anything but a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}[{key!r}]: expected a number, got {type(value).__name__} {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters of the "compress" rope (CSA/HCA layers only; spec section 2.4).

    `attention_factor` multiplies cos/sin. DeepSeek-V4 uses 1.0 (HF forces it, the official
    code never applies an mscale), but an explicit value in a config is honoured as HF does.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        # Every field a finite positive number (a bool is no number here): NaN or inf would reach
        # the rope tables and turn them into NaN or a plain rope without an error.
        for name in ("factor", "beta_fast", "beta_slow", "attention_factor"):
            _check_number(f"YarnScaling.{name}", getattr(self, name), low=0.0)
        value = self.original_max_position_embeddings
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"YarnScaling.original_max_position_embeddings: expected a positive int, got {value!r}")
        if not self.beta_fast > self.beta_slow:
            raise ValueError(f"YarnScaling.beta_fast: expected more than beta_slow ({self.beta_slow}) (the ramp "
                             f"runs from the fast to the slow rotations), got {self.beta_fast}")
        if not isinstance(self.truncate, bool):
            raise TypeError(f"YarnScaling.truncate: expected a bool, got {type(self.truncate).__name__}")


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
    """Sizes and per-layer schedule of DeepSeek-V4 attention.

    Field names follow the HF `DeepseekV4Config` (see spec section 1.1 for the official
    ModelArgs names). Defaults are the published V4-Flash values.
    """

    hidden_size: int = 4096
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    layer_types: tuple[str, ...] = (SLIDING, CSA, HCA)
    csa_compress_rate: int = 4
    hca_compress_rate: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: YarnScaling | None = YarnScaling(factor=16.0, original_max_position_embeddings=65536)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; the stored value must be hashable.
        if not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        positive = (
            "hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank",
            "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
            "index_topk", "csa_compress_rate", "hca_compress_rate", "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DeepseekV4Config.{name}: expected a positive int, got {value!r}")
            # Past these sizes the first allocation fails (out of memory) naming no field.
            limit = _MAX_POSITIONS if name == "max_position_embeddings" else _MAX_SIZE
            if value > limit:
                raise ValueError(f"DeepseekV4Config.{name}: expected at most {limit:,}, got {value:,}")
        for name in ("csa_compress_rate", "hca_compress_rate"):
            value = getattr(self, name)
            if value > _MAX_RATIO:
                raise ValueError(f"DeepseekV4Config.{name}: expected a compression ratio of at most {_MAX_RATIO} "
                                 f"tokens an entry (V4 uses 4 and 128), got {value:,}")
        for name in ("rope_theta", "compress_rope_theta"):
            # theta <= 1 makes every rotation as fast as the first; inf turns RoPE off.
            _check_number(f"DeepseekV4Config.{name}", getattr(self, name), low=1.0)
        # eps >= 1 swamps the mean square of unit-scale activations (inf zeroes the output).
        _check_number("DeepseekV4Config.rms_norm_eps", self.rms_norm_eps, low=0.0, high=1.0)
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"DeepseekV4Config.qk_rope_head_dim: expected an even number (rope rotates channel pairs), "
                f"got {self.qk_rope_head_dim}"
            )
        if self.qk_rope_head_dim > self.head_dim:
            raise ValueError(
                f"DeepseekV4Config.qk_rope_head_dim: expected <= head_dim ({self.head_dim}), "
                f"got {self.qk_rope_head_dim}"
            )
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(
                f"DeepseekV4Config.index_head_dim: expected >= qk_rope_head_dim ({self.qk_rope_head_dim}) "
                f"because the indexer rotates its trailing qk_rope_head_dim channels, got {self.index_head_dim}"
            )
        if self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"DeepseekV4Config.o_groups: expected a divisor of num_attention_heads "
                f"({self.num_attention_heads}), got {self.o_groups}"
            )
        if any(not isinstance(t, str) for t in self.layer_types):
            raise TypeError(f"DeepseekV4Config.layer_types: expected layer type names (str), got {self.layer_types!r}")
        if not self.layer_types:
            raise ValueError("DeepseekV4Config.layer_types: expected at least one layer, got ()")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"DeepseekV4Config.layer_types: expected entries from {LAYER_TYPES}, got {bad}")
        scaling = self.compress_rope_scaling
        if scaling is not None:
            if not isinstance(scaling, YarnScaling):
                raise TypeError(
                    "DeepseekV4Config.compress_rope_scaling: expected YarnScaling or None, "
                    f"got {type(scaling).__name__}"
                )
            if not scaling.factor > 0 or scaling.original_max_position_embeddings < 1:
                raise ValueError(
                    "DeepseekV4Config.compress_rope_scaling: expected factor > 0 and "
                    f"original_max_position_embeddings >= 1, got {scaling}"
                )

    # ------------------------------------------------------------------ per-layer helpers
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def layer_type(self, layer_idx: int) -> str:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(
                f"layer_idx: expected an int in [0, {self.num_layers}) for this config's "
                f"{self.num_layers} layers, got {layer_idx!r}"
            )
        return self.layer_types[layer_idx]

    def compress_rate(self, layer_type: str) -> int:
        """Tokens per compressed entry: 0 for sliding layers, m for CSA, m' for HCA."""
        return {SLIDING: 0, CSA: self.csa_compress_rate, HCA: self.hca_compress_rate}[layer_type]

    def compressor_width(self, layer_type: str, *, indexer: bool = False) -> int:
        """Width ``n*Dc`` of a compressor's kv/gate projections, position bias and buffers.

        CSA's overlapping layout projects two series ``[Ca | Cb]`` (twice the entry width,
        n = 2), HCA one (n = 1). Entries are ``head_dim`` wide; with `indexer` (CSA only) it is
        the indexer's key compressor, whose entries are ``index_head_dim`` wide. The one owner
        of this size: the layer's parameters, its cache and the HF weight shapes use it.
        """
        if layer_type not in (CSA, HCA) or (indexer and layer_type != CSA):
            what = "an indexer" if indexer else "a compressor"
            raise ValueError(f"layer_type: {layer_type!r} has no {what}")
        dim = self.index_head_dim if indexer else self.head_dim
        return 2 * dim if layer_type == CSA else dim

    def entry_slots(self, layer_type: str, max_seq_len: int) -> int:
        """Compressed-entry slots T of a cache of `max_seq_len` tokens: ``max_seq_len // m``,
        at least one (so that gathers never index an empty axis; unused slots are masked)."""
        if layer_type not in (CSA, HCA):
            raise ValueError(f"layer_type: {layer_type!r} has no compressed entries")
        return max(1, int(max_seq_len) // self.compress_rate(layer_type))

    @staticmethod
    def rope_kind(layer_type: str) -> str:
        """"main" (theta 10000, plain) for sliding layers, "compress" (YaRN) for CSA/HCA."""
        return "main" if layer_type == SLIDING else "compress"

    # ------------------------------------------------------------------ presets
    @classmethod
    def flash(cls, **overrides: Any) -> DeepseekV4Config:
        """Published DeepSeek-V4-Flash sizes (43 layers: 2 sliding, 21 CSA, 20 HCA)."""
        ratios = [0, 0] + [4, 128] * 20 + [4]
        base = dict(
            hidden_size=4096, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
            q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
            index_n_heads=64, index_head_dim=128, index_topk=512,
            layer_types=tuple(_RATIO_TO_LAYER_TYPE[r] for r in ratios),
        )
        return cls(**{**base, **overrides})

    @classmethod
    def pro(cls, **overrides: Any) -> DeepseekV4Config:
        """Published DeepSeek-V4-Pro sizes (61 layers: 31 HCA, 30 CSA)."""
        ratios = [128, 128] + [4, 128] * 29 + [4]
        base = dict(
            hidden_size=7168, num_attention_heads=128, head_dim=512, qk_rope_head_dim=64,
            q_lora_rank=1536, o_groups=16, o_lora_rank=1024, sliding_window=128,
            index_n_heads=64, index_head_dim=128, index_topk=1024,
            layer_types=tuple(_RATIO_TO_LAYER_TYPE[r] for r in ratios),
        )
        return cls(**{**base, **overrides})

    @classmethod
    def tiny(cls, **overrides: Any) -> DeepseekV4Config:
        """A CPU-sized config with every mechanism active (window < prompt, entries > top-k)."""
        base = dict(
            hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8,
            q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
            index_n_heads=4, index_head_dim=16, index_topk=4,
            layer_types=(SLIDING, CSA, HCA), csa_compress_rate=4, hca_compress_rate=8,
            compress_rope_scaling=YarnScaling(factor=16.0, original_max_position_embeddings=64),
            max_position_embeddings=4096,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def small(cls, **overrides: Any) -> DeepseekV4Config:
        """A scaled-down V4 for benchmarks on a CPU (the benchmarks' ``--size small``): hidden 1024,
        16 heads x 128 (rope 64), q_lora 256, 4 output groups x 256, window 128, indexer 16 x 64
        with top-128, one layer of each type at V4's ratios (4 and 128)."""
        base = dict(
            hidden_size=1024, num_attention_heads=16, head_dim=128, qk_rope_head_dim=64, q_lora_rank=256,
            o_groups=4, o_lora_rank=256, sliding_window=128, index_n_heads=16, index_head_dim=64,
            index_topk=128, layer_types=(SLIDING, CSA, HCA),
        )
        return cls(**{**base, **overrides})

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DeepseekV4Config:
        """Build from a HF `config.json` dict, normalized or hub form (see module docstring).

        The keys that fix the layer's shapes (`REQUIRED_HF_KEYS`, a layer schedule and the rope
        width) are required, as every DeepSeek-V4 config.json has them: a dict without them is a
        `ValueError` naming them (rather than V4-Flash's sizes filled in without a word). The
        other attention keys (rope thetas and scaling, eps, max positions, compress rates) take
        the HF defaults (V4-Flash values), as `DeepseekV4Config.from_dict` does. Fields of the
        model that are not part of attention (MoE, mHC, vocab) are ignored. A value of the wrong
        kind is a `TypeError` naming its key; a value out of range the config's `ValueError`.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config: expected a mapping (a parsed config.json), got {type(config).__name__}")
        c = dict(config)
        get = c.get
        defaults = cls()
        for key in ("rope_parameters", "rope_scaling", "compress_rates"):
            if get(key) is not None and not isinstance(get(key), Mapping):
                raise TypeError(f"config[{key!r}]: expected a mapping (a JSON object) or null, got "
                                f"{type(get(key)).__name__}")
        for key in ("layer_types", "compress_ratios"):
            if get(key) is not None and not isinstance(get(key), (list, tuple)):
                raise TypeError(f"config[{key!r}]: expected a list, got {type(get(key)).__name__}")

        kv_heads = get("num_key_value_heads", 1)
        if kv_heads != 1:
            raise ValueError(
                f"config['num_key_value_heads']: expected 1 (DeepSeek-V4 uses one shared K=V head), got {kv_heads!r}"
            )

        head_dim = get("head_dim", defaults.head_dim)
        if get("qk_rope_head_dim") is not None:
            rope_dim = get("qk_rope_head_dim")
        elif get("partial_rotary_factor") is not None:
            if isinstance(head_dim, bool) or not isinstance(head_dim, int):
                raise TypeError(f"config['head_dim']: expected an int, got {type(head_dim).__name__} {head_dim!r}")
            rope_dim = int(head_dim * _hf_number("partial_rotary_factor", get("partial_rotary_factor")))
        else:
            rope_dim = defaults.qk_rope_head_dim

        rates = dict(get("compress_rates") or {})
        csa_rate = rates.get(CSA, get("compress_rate_csa", defaults.csa_compress_rate))
        hca_rate = rates.get(HCA, get("compress_rate_hca", defaults.hca_compress_rate))

        n_layers = get("num_hidden_layers")
        if n_layers is not None and (isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1):
            raise ValueError(f"config['num_hidden_layers']: expected a positive int, got {n_layers!r}")
        if get("layer_types") is not None:
            layer_types = list(get("layer_types"))
        elif get("compress_ratios") is not None:
            ratios = list(get("compress_ratios"))
            bad = sorted({r for r in ratios if r not in _RATIO_TO_LAYER_TYPE})
            if bad:
                raise ValueError(
                    f"config['compress_ratios']: expected entries from {sorted(_RATIO_TO_LAYER_TYPE)}, got {bad}; "
                    "other rates need explicit 'layer_types' plus 'compress_rates'"
                )
            layer_types = [_RATIO_TO_LAYER_TYPE[r] for r in ratios]
        else:
            # HF's default schedule (2 HCA, then alternating); real checkpoints always carry one.
            n = n_layers if n_layers is not None else 43
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        if n_layers is not None:
            if len(layer_types) < n_layers:
                raise ValueError(
                    f"config['num_hidden_layers']: expected at most {len(layer_types)} (the length of the "
                    f"layer schedule), got {n_layers}"
                )
            layer_types = layer_types[:n_layers]  # hub lists carry extra MTP entries

        missing = [k for k in REQUIRED_HF_KEYS if get(k) is None]
        missing += [" or ".join(map(repr, keys)) for keys in (("layer_types", "compress_ratios"),
                                                              ("qk_rope_head_dim", "partial_rotary_factor"))
                    if all(get(k) is None for k in keys)]
        if missing:
            raise ValueError(
                f"config: expected the keys that fix a DeepSeek-V4 attention layer's shapes (every config.json of the "
                f"model has them), got a config without {', '.join(map(str, missing))}")

        main_theta = get("rope_theta", defaults.rope_theta)
        compress_theta = get("compress_rope_theta", defaults.compress_rope_theta)
        rope_params = get("rope_parameters") or {}
        if isinstance(rope_params.get("main"), Mapping) != isinstance(rope_params.get("compress"), Mapping):
            raise TypeError("config['rope_parameters']: expected either both 'main' and 'compress' as objects or the "
                            f"flat form, got keys {sorted(rope_params)}")
        if isinstance(rope_params.get("main"), Mapping) and isinstance(rope_params.get("compress"), Mapping):
            main = rope_params["main"]
            compress = dict(rope_params["compress"])
            main_theta = main.get("rope_theta", main_theta)
            if main.get("rope_type", "default") != "default":
                raise ValueError(
                    f"config['rope_parameters']['main']['rope_type']: expected 'default', got {main['rope_type']!r}"
                )
            compress_theta = compress.get("rope_theta", compress_theta)
        else:
            # Flat form (hub `rope_scaling`, or a flat `rope_parameters`): it describes the compress rope.
            compress = {k: v for k, v in {**rope_params, **(get("rope_scaling") or {})}.items()}
        scaling = _yarn_from_dict(compress)

        return cls(
            hidden_size=get("hidden_size", defaults.hidden_size),
            num_attention_heads=get("num_attention_heads", defaults.num_attention_heads),
            head_dim=head_dim,
            qk_rope_head_dim=rope_dim,
            q_lora_rank=get("q_lora_rank", defaults.q_lora_rank),
            o_groups=get("o_groups", defaults.o_groups),
            o_lora_rank=get("o_lora_rank", defaults.o_lora_rank),
            sliding_window=get("sliding_window", defaults.sliding_window),
            index_n_heads=get("index_n_heads", defaults.index_n_heads),
            index_head_dim=get("index_head_dim", defaults.index_head_dim),
            index_topk=get("index_topk", defaults.index_topk),
            layer_types=tuple(layer_types),
            csa_compress_rate=csa_rate,
            hca_compress_rate=hca_rate,
            rope_theta=_hf_number("rope_theta", main_theta),
            compress_rope_theta=_hf_number("compress_rope_theta", compress_theta),
            compress_rope_scaling=scaling,
            rms_norm_eps=_hf_number("rms_norm_eps", get("rms_norm_eps", defaults.rms_norm_eps)),
            max_position_embeddings=get("max_position_embeddings", defaults.max_position_embeddings),
        )

    def to_hf(self) -> dict[str, Any]:
        """The attention fields in HF's normalized form (what `from_hf` reads back)."""
        rope_fraction = self.qk_rope_head_dim / self.head_dim
        compress: dict[str, Any] = {
            "rope_type": "default", "rope_theta": self.compress_rope_theta, "partial_rotary_factor": rope_fraction,
        }
        if self.compress_rope_scaling is not None:
            s = self.compress_rope_scaling
            compress.update(
                rope_type="yarn", factor=s.factor, original_max_position_embeddings=s.original_max_position_embeddings,
                beta_fast=s.beta_fast, beta_slow=s.beta_slow, attention_factor=s.attention_factor,
                truncate=s.truncate,
            )
        return {
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1, "head_dim": self.head_dim, "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank, "sliding_window": self.sliding_window,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "num_hidden_layers": self.num_layers,
            "layer_types": list(self.layer_types),
            "compress_rates": {CSA: self.csa_compress_rate, HCA: self.hca_compress_rate},
            "rope_theta": self.rope_theta, "compress_rope_theta": self.compress_rope_theta,
            "partial_rotary_factor": rope_fraction,
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": rope_fraction},
                "compress": compress,
            },
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
        }


def _yarn_from_dict(rope: Mapping[str, Any]) -> YarnScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "yarn":
        raise ValueError(f"config rope type of the compress rope: expected 'yarn' or 'default', got {rope_type!r}")
    missing = [k for k in ("factor", "original_max_position_embeddings") if rope.get(k) is None]
    if missing:
        raise ValueError(f"config yarn rope parameters: missing {missing} in {dict(rope)}")
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        # HF (configuration_deepseek_v4.py) forces 1.0 for a yarn compress rope unless set explicitly.
        attention_factor = 1.0
    where = "config yarn rope parameters"
    original = rope["original_max_position_embeddings"]
    if isinstance(original, float) and original.is_integer():
        original = int(original)
    if isinstance(original, bool) or not isinstance(original, int):
        raise TypeError(f"{where}['original_max_position_embeddings']: expected an int, got {original!r}")
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise TypeError(f"{where}['truncate']: expected a bool, got {truncate!r}")
    # A missing (or null) beta takes HF's default; a present one is checked as given (0 stays 0).
    beta_fast, beta_slow = rope.get("beta_fast"), rope.get("beta_slow")
    return YarnScaling(
        factor=_hf_number("factor", rope["factor"], where),
        original_max_position_embeddings=original,
        beta_fast=32.0 if beta_fast is None else _hf_number("beta_fast", beta_fast, where),
        beta_slow=1.0 if beta_slow is None else _hf_number("beta_slow", beta_slow, where),
        attention_factor=_hf_number("attention_factor", attention_factor, where),
        truncate=truncate,
    )


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """`value` if it is one of `choices`, else a ValueError naming `name` (every string switch
    of the layer: break_mode, break_on, kernels and the plan's stages)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return value
