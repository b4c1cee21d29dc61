"""Weights: HF `DeepseekV4Attention.state_dict()` names <-> the layer's parameters.

HF stores every projection PyTorch-style ``[out, in]`` (``y = x W^T``); the layer holds
``[in, out]`` kernels, so linear weights are transposed on the way in. The grouped output
projection ``o_a_proj.weight [G*R, H*D/G]`` becomes ``[G, H*D/G, R]``.

Projections take the layer's `param_dtype`; norm weights, sinks and position biases stay
float32 (what HF's loader keeps in float32 for a bf16 model, spec section 11.4).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

_PREFIX = re.compile(r"^model\.layers\.(\d+)\.self_attn\.")


def _to_numpy(value: Any, name: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor: NumPy has no bfloat16, so widen first
        value = value.detach().cpu()
        if str(value.dtype) in ("torch.bfloat16", "torch.float16"):
            value = value.float()
        value = value.numpy()
    try:
        arr = np.asarray(value)
    except Exception as err:  # noqa: BLE001 - report any unconvertible value by name
        raise TypeError(f"weights[{name!r}]: expected an array, got {type(value).__name__} ({err})") from None
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name not in ("bfloat16", "float8_e4m3fn"):
        raise TypeError(f"weights[{name!r}]: expected a floating array, got dtype {arr.dtype}")
    return arr


def parameter_table(attn) -> dict[str, tuple[Any, tuple[int, ...], str]]:
    """HF name -> (the layer's Param, the HF shape, kind) with kind in linear/grouped/fp32."""
    cfg = attn.config
    h, d, lq, hid = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.hidden_size
    g, r = cfg.o_groups, cfg.o_lora_rank
    table = {
        "q_a_proj.weight": (attn.q_a_proj, (lq, hid), "linear"),
        "q_a_norm.weight": (attn.q_a_norm, (lq,), "fp32"),
        "q_b_proj.weight": (attn.q_b_proj, (h * d, lq), "linear"),
        "kv_proj.weight": (attn.kv_proj, (d, hid), "linear"),
        "kv_norm.weight": (attn.kv_norm, (d,), "fp32"),
        "o_a_proj.weight": (attn.o_a_proj, (g * r, h * d // g), "grouped"),
        "o_b_proj.weight": (attn.o_b_proj, (hid, g * r), "linear"),
        "sinks": (attn.sinks, (h,), "fp32"),
    }

    def compressor(prefix, module, width, dim, ratio):
        table[f"{prefix}.kv_proj.weight"] = (module.kv_proj, (width, hid), "linear")
        table[f"{prefix}.gate_proj.weight"] = (module.gate_proj, (width, hid), "linear")
        table[f"{prefix}.position_bias"] = (module.position_bias, (ratio, width), "fp32")
        table[f"{prefix}.kv_norm.weight"] = (module.kv_norm, (dim,), "fp32")

    if attn.compressor is not None:
        ratio = cfg.compress_rate(attn.layer_type)
        width = attn.compressor.kv_proj.shape[-1]
        compressor("compressor", attn.compressor, width, d, ratio)
    if attn.indexer is not None:
        c, ni = cfg.index_head_dim, cfg.index_n_heads
        compressor("compressor.indexer", attn.indexer.compressor, 2 * c, c, cfg.csa_compress_rate)
        table["compressor.indexer.q_b_proj.weight"] = (attn.indexer.q_b_proj, (ni * c, lq), "linear")
        table["compressor.indexer.scorer.weights_proj.weight"] = (attn.indexer.weights_proj, (ni, hid), "linear")
    return table


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

    Strict: every missing, unknown or mis-shaped name is listed in one `ValueError`, and
    nothing is loaded unless everything fits.
    """
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights: expected a mapping of name -> array, got {type(weights).__name__}")
    given = _strip_prefixes(weights, attn.layer_idx)
    table = parameter_table(attn)
    problems = []
    missing = sorted(set(table) - set(given))
    unknown = sorted(set(given) - set(table))
    if missing:
        problems.append(f"missing {missing}")
    if unknown:
        problems.append(f"unknown {unknown}")
    arrays = {}
    for name in sorted(set(table) & set(given)):
        arr = _to_numpy(given[name], name)
        want = table[name][1]
        if tuple(arr.shape) != want:
            problems.append(f"{name}: expected shape {list(want)}, got {list(arr.shape)}")
        arrays[name] = arr
    if problems:
        raise ValueError(
            f"weights for layer {attn.layer_idx} ({attn.layer_type}): " + "; ".join(problems)
        )
    for name, arr in arrays.items():
        param, _, kind = table[name]
        param[...] = _convert(arr, kind, attn)


def _convert(arr: np.ndarray, kind: str, attn) -> jnp.ndarray:
    if kind == "fp32":
        return jnp.asarray(arr.astype(np.float32))
    if kind == "grouped":
        g = attn.config.o_groups
        arr = arr.reshape(g, -1, arr.shape[-1]).transpose(0, 2, 1)  # [G, R, in_g] -> [G, in_g, R]
    else:
        arr = arr.T
    return jnp.asarray(np.ascontiguousarray(arr.astype(np.float32))).astype(attn.param_dtype)


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
