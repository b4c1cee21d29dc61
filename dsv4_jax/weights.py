"""Weights: HF `DeepseekV4Attention.state_dict()` names <-> the layer's parameters.

HF stores every projection PyTorch-style ``[out, in]`` (``y = x W^T``); the layer holds
``[in, out]`` kernels, so linear weights are transposed on the way in. The grouped output
projection ``o_a_proj.weight [G*R, H*D/G]`` becomes ``[G, H*D/G, R]``.

Projections take the layer's `param_dtype`; norm weights, sinks and position biases stay
float32 (what HF's loader keeps in float32 for a bf16 model, spec section 11.4).

There is one strict check (`check_weight_shapes`): `load_hf_attention_weights` (in-memory
mappings) and `load_attention_checkpoint` (safetensors files, see `checkpoint`) both go
through it, so both list every missing, unknown and mis-shaped tensor in one `ValueError`
and load nothing unless everything fits.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from .config import CSA, HCA, DeepseekV4Config

_PREFIX = re.compile(r"^model\.layers\.(\d+)\.self_attn\.")

# HF name -> attribute path of the parameter inside `DeepseekV4Attention`.
_PARAM_PATHS = {
    "q_a_proj.weight": ("q_a_proj",),
    "q_a_norm.weight": ("q_a_norm",),
    "q_b_proj.weight": ("q_b_proj",),
    "kv_proj.weight": ("kv_proj",),
    "kv_norm.weight": ("kv_norm",),
    "o_a_proj.weight": ("o_a_proj",),
    "o_b_proj.weight": ("o_b_proj",),
    "sinks": ("sinks",),
    "compressor.kv_proj.weight": ("compressor", "kv_proj"),
    "compressor.gate_proj.weight": ("compressor", "gate_proj"),
    "compressor.position_bias": ("compressor", "position_bias"),
    "compressor.kv_norm.weight": ("compressor", "kv_norm"),
    "compressor.indexer.kv_proj.weight": ("indexer", "compressor", "kv_proj"),
    "compressor.indexer.gate_proj.weight": ("indexer", "compressor", "gate_proj"),
    "compressor.indexer.position_bias": ("indexer", "compressor", "position_bias"),
    "compressor.indexer.kv_norm.weight": ("indexer", "compressor", "kv_norm"),
    "compressor.indexer.q_b_proj.weight": ("indexer", "q_b_proj"),
    "compressor.indexer.scorer.weights_proj.weight": ("indexer", "weights_proj"),
}

# Presets tried when shapes do not fit, to say which published model a checkpoint belongs to.
_PRESETS: tuple[tuple[str, Callable[[], DeepseekV4Config]], ...] = (
    ("DeepseekV4Config.flash()", DeepseekV4Config.flash),
    ("DeepseekV4Config.pro()", DeepseekV4Config.pro),
    ("DeepseekV4Config.tiny()", DeepseekV4Config.tiny),
)


def expected_shapes(cfg: DeepseekV4Config, layer_type: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape in PyTorch layout, kind) of one attention layer of `layer_type`.

    kind is ``linear`` ([out, in] projection), ``grouped`` (``o_a_proj``) or ``fp32`` (norms,
    sinks, position biases). Needs no layer object, so it also describes the presets.
    """
    h, d, lq, hid = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.hidden_size
    g, r = cfg.o_groups, cfg.o_lora_rank
    table = {
        "q_a_proj.weight": ((lq, hid), "linear"),
        "q_a_norm.weight": ((lq,), "fp32"),
        "q_b_proj.weight": ((h * d, lq), "linear"),
        "kv_proj.weight": ((d, hid), "linear"),
        "kv_norm.weight": ((d,), "fp32"),
        "o_a_proj.weight": ((g * r, h * d // g), "grouped"),
        "o_b_proj.weight": ((hid, g * r), "linear"),
        "sinks": ((h,), "fp32"),
    }

    def compressor(prefix, width, dim, ratio):
        table[f"{prefix}.kv_proj.weight"] = ((width, hid), "linear")
        table[f"{prefix}.gate_proj.weight"] = ((width, hid), "linear")
        table[f"{prefix}.position_bias"] = ((ratio, width), "fp32")
        table[f"{prefix}.kv_norm.weight"] = ((dim,), "fp32")

    if layer_type in (CSA, HCA):
        compressor("compressor", 2 * d if layer_type == CSA else d, d, cfg.compress_rate(layer_type))
    if layer_type == CSA:
        c, ni = cfg.index_head_dim, cfg.index_n_heads
        compressor("compressor.indexer", 2 * c, c, cfg.csa_compress_rate)
        table["compressor.indexer.q_b_proj.weight"] = ((ni * c, lq), "linear")
        table["compressor.indexer.scorer.weights_proj.weight"] = ((ni, hid), "linear")
    return table


def parameter_table(attn) -> dict[str, tuple[Any, tuple[int, ...], str]]:
    """HF name -> (the layer's Param, the HF shape, kind) with kind in linear/grouped/fp32."""
    table = {}
    for name, (shape, kind) in expected_shapes(attn.config, attn.layer_type).items():
        param = attn
        for attr in _PARAM_PATHS[name]:
            param = getattr(param, attr)
        table[name] = (param, shape, kind)
    return table


def _to_numpy(value: Any, name: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor: NumPy has no bfloat16, so widen first
        value = value.detach().cpu()
        if str(value.dtype) in ("torch.bfloat16", "torch.float16"):
            value = value.float()
        value = value.numpy()
    try:
        arr = np.asarray(value)
    except Exception as err:  # report any unconvertible value by name
        raise TypeError(f"weights[{name!r}]: expected an array, got {type(value).__name__} ({err})") from None
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name not in ("bfloat16", "float8_e4m3fn"):
        raise TypeError(f"weights[{name!r}]: expected a floating array, got dtype {arr.dtype}")
    return arr


def _preset_hint(layer_type: str, shapes: Mapping[str, tuple[int, ...]],
                 candidates: Iterable[tuple[str, DeepseekV4Config]] = ()) -> str:
    """' (these shapes fit X)' for the first preset or candidate config that fits, else ''."""
    options = [*candidates, *((label, make()) for label, make in _PRESETS)]
    for label, cfg in options:
        want = expected_shapes(cfg, layer_type)
        if set(want) == set(shapes) and all(tuple(shapes[k]) == want[k][0] for k in want):
            return f"; these shapes fit {label}, build the layer with that config"
    return ""


def check_weight_shapes(attn, shapes: Mapping[str, tuple[int, ...]], *, describe: Callable[[str], str] = repr,
                        problems: Iterable[str] = (), hint_configs: Iterable[tuple[str, DeepseekV4Config]] = (),
                        what: str = "weights") -> None:
    """The strict check: every missing, unknown and mis-shaped name, in one `ValueError`.

    shapes: HF name -> shape (PyTorch layout) of what is about to be loaded; `describe`
    renders a name in messages (e.g. with its checkpoint key); `problems` are further
    findings of the caller (FP8 scales, dtypes) reported together with these.
    """
    table = expected_shapes(attn.config, attn.layer_type)
    found = list(problems)
    missing = sorted(set(table) - set(shapes))
    unknown = sorted(set(shapes) - set(table))
    if missing:
        found.append(f"missing [{', '.join(map(repr, missing))}]")
    if unknown:
        found.append(f"unknown [{', '.join(map(describe, unknown))}]")
    misshaped = False
    for name in sorted(set(table) & set(shapes)):
        want = table[name][0]
        if tuple(shapes[name]) != want:
            misshaped = True
            found.append(f"{describe(name)}: expected shape {list(want)}, got {list(shapes[name])}")
    if found:
        hint = _preset_hint(attn.layer_type, shapes, hint_configs) if misshaped else ""
        raise ValueError(f"{what} for layer {attn.layer_idx} ({attn.layer_type}): " + "; ".join(found) + hint)


def _strip_prefixes(weights: Mapping[str, Any], layer_idx: int) -> dict[str, Any]:
    prefixed = {k: v for k, v in weights.items() if _PREFIX.match(k)}
    plain = {k: v for k, v in weights.items() if not _PREFIX.match(k)}
    if not prefixed:
        return plain
    ours = {_PREFIX.sub("", k): v for k, v in prefixed.items() if int(_PREFIX.match(k).group(1)) == layer_idx}
    if not ours:
        found = sorted({int(_PREFIX.match(k).group(1)) for k in prefixed})
        raise ValueError(
            f"weights: expected keys 'model.layers.{layer_idx}.self_attn.*' for layer_idx={layer_idx}, "
            f"got keys of layers {found}"
        )
    clash = sorted(set(ours) & set(plain))
    if clash:
        raise ValueError(f"weights: keys given both with and without the layer prefix: {clash}")
    return {**plain, **ours}


def load_hf_attention_weights(attn, weights: Mapping[str, Any]) -> None:
    """Load HF `DeepseekV4Attention.state_dict()` tensors into `attn` (in place).

    weights: a mapping from HF names (``q_a_proj.weight``, ..., ``sinks``), with or without a
    ``model.layers.{i}.self_attn.`` prefix (then only layer ``attn.layer_idx`` is taken), to
    arrays (NumPy, JAX, or CPU torch tensors) in PyTorch ``[out, in]`` layout.

    Strict: every missing, unknown, mis-shaped or non-finite tensor is listed in one
    `ValueError`, and nothing is loaded unless everything fits. For checkpoint files (FP8,
    DeepSeek's official names) see `load_attention_checkpoint`.
    """
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights: expected a mapping of name -> array, got {type(weights).__name__}")
    given = _strip_prefixes(weights, attn.layer_idx)
    arrays = {name: _to_numpy(value, name) for name, value in given.items()}
    assign_checked(attn, arrays)


def assign_checked(attn, arrays: Mapping[str, np.ndarray], *, describe: Callable[[str], str] = repr,
                   what: str = "weights") -> None:
    """Check `arrays` (HF name -> NumPy, PyTorch layout) strictly, then write them into `attn`."""
    check_weight_shapes(attn, {k: tuple(v.shape) for k, v in arrays.items()}, describe=describe, what=what)
    bad = []
    for name in sorted(arrays):
        arr = arrays[name]
        finite = np.isfinite(arr) if arr.dtype.kind == "f" else np.isfinite(arr.astype(np.float32))
        if not finite.all():
            bad.append(f"{describe(name)}: expected finite values, got {int(arr.size - finite.sum())} non-finite")
    if bad:
        raise ValueError(f"{what} for layer {attn.layer_idx} ({attn.layer_type}): " + "; ".join(bad))
    table = parameter_table(attn)
    for name, arr in arrays.items():
        param, _, kind = table[name]
        param[...] = _convert(arr, kind, attn)


def _convert(arr: np.ndarray, kind: str, attn) -> jnp.ndarray:
    arr = arr.astype(np.float32, copy=False)
    if kind == "fp32":
        return jnp.asarray(arr)
    if kind == "grouped":
        g = attn.config.o_groups
        arr = arr.reshape(g, -1, arr.shape[-1]).transpose(0, 2, 1)  # [G, R, in_g] -> [G, in_g, R]
    else:
        arr = arr.T
    return jnp.asarray(np.ascontiguousarray(arr)).astype(attn.param_dtype)


def export_hf_attention_weights(attn) -> dict[str, np.ndarray]:
    """The layer's parameters under HF names, PyTorch layout, float32 NumPy (inverse of loading)."""
    out = {}
    for name, (param, shape, kind) in parameter_table(attn).items():
        arr = np.asarray(jnp.asarray(param[...], jnp.float32))
        if kind == "grouped":
            arr = arr.transpose(0, 2, 1).reshape(shape)
        elif kind == "linear":
            arr = arr.T
        out[name] = np.ascontiguousarray(arr)
    return out
