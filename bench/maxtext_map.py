"""Our layer's parameters -> MaxText's `CompressedAttention` (maxtext 0.2.5): names and layouts.

Pure NumPy + flax.nnx: nothing here imports maxtext, so the table is testable anywhere.

Both sides hold JAX-style ``[in, out]`` kernels, so no transposes: only three reshapes.

=====================================  ===========================================  ===========================
ours (`DeepseekV4Attention` attribute)   MaxText (`CompressedAttention` state path)  layout
=====================================  ===========================================  ===========================
``q_a_proj``        [hidden, q_lora]     ``wq_a/kernel``                            same
``q_a_norm``        [q_lora]             ``q_norm/scale``                           same
``q_b_proj``        [q_lora, H*D]        ``wq_b/kernel`` [q_lora, H, D]             split heads
``kv_proj``         [hidden, D]          ``wkv/kernel`` [hidden, 1, D]              one KV head
``kv_norm``         [D]                  ``kv_norm/scale``                          same
``o_a_proj``        [G, H*D/G, R]        ``o_a_proj/kernel`` [G, H*D/G, R]          same
``o_b_proj``        [G*R, hidden]        ``o_b_proj/kernel``                        same
``sinks``           [H]                  ``sinks``                                  same
``compressor.X``                         ``csa_compressor/X`` (CSA), ``hca_compressor/X`` (HCA),
                                         X in kv_proj/kernel, gate_proj/kernel, position_bias, kv_norm/scale
``indexer.q_b_proj``                     ``csa_compressor/indexer/q_proj/kernel``   same
``indexer.weights_proj``                 ``csa_compressor/indexer/weights_proj/kernel``  same
``indexer.compressor.X``                 ``csa_compressor/indexer/X``               same
=====================================  ===========================================  ===========================

The CSA compressors' ``[Ca | Cb]`` halves are in the same order on both sides (MaxText's
`csa_overlap_pooling` splits the projection as ``a, b = split(kv, 2)`` and shifts ``a`` by one
window, as HF and we do), so their kernels copy unchanged; the agreement tests check it.

`load` is strict in both directions: every MaxText parameter is written exactly once, every one
of ours is used, and shapes must fit after the layout change; otherwise one `ValueError` lists
everything and nothing is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4_jax.config import CSA, HCA

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Entry:
    ours: Path
    theirs: Path
    layout: str  # "same" | "heads" ([in, H*D] -> [in, H, D]) | "one_head" ([in, D] -> [in, 1, D])


_MAIN = (
    (("q_a_proj",), ("wq_a", "kernel"), "same"),
    (("q_a_norm",), ("q_norm", "scale"), "same"),
    (("q_b_proj",), ("wq_b", "kernel"), "heads"),
    (("kv_proj",), ("wkv", "kernel"), "one_head"),
    (("kv_norm",), ("kv_norm", "scale"), "same"),
    (("o_a_proj",), ("o_a_proj", "kernel"), "same"),
    (("o_b_proj",), ("o_b_proj", "kernel"), "same"),
    (("sinks",), ("sinks",), "same"),
)
_COMPRESSOR = (
    ("kv_proj", ("kv_proj", "kernel")),
    ("gate_proj", ("gate_proj", "kernel")),
    ("position_bias", ("position_bias",)),
    ("kv_norm", ("kv_norm", "scale")),
)


def table(layer_type: str) -> tuple[Entry, ...]:
    """The map of one layer type (CSA or HCA; MaxText's sliding layers are not used here)."""
    if layer_type not in (CSA, HCA):
        raise ValueError(f"layer_type: expected {CSA!r} or {HCA!r}, got {layer_type!r}")
    comp = "csa_compressor" if layer_type == CSA else "hca_compressor"
    out = [Entry(*e) for e in _MAIN]
    out += [Entry(("compressor", name), (comp, *path), "same") for name, path in _COMPRESSOR]
    if layer_type == CSA:
        out += [Entry(("indexer", "q_b_proj"), (comp, "indexer", "q_proj", "kernel"), "same"),
                Entry(("indexer", "weights_proj"), (comp, "indexer", "weights_proj", "kernel"), "same")]
        out += [Entry(("indexer", "compressor", name), (comp, "indexer", *path), "same") for name, path in _COMPRESSOR]
    return tuple(out)


def _flat(module) -> dict[Path, nnx.Variable]:
    """{path of str: Param} of an NNX module (its `nnx.state(..., nnx.Param)`, flattened)."""
    return {tuple(str(k) for k in path): var for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def ours_params(attn) -> dict[Path, np.ndarray]:
    """Our layer's parameters as float32 NumPy arrays, by attribute path."""
    return {path: np.asarray(jnp.asarray(var.get_value(), jnp.float32)) for path, var in _flat(attn).items()}


def _to_theirs(arr: np.ndarray, layout: str, num_heads: int) -> np.ndarray:
    if layout == "heads":
        return arr.reshape(arr.shape[0], num_heads, arr.shape[1] // num_heads)
    if layout == "one_head":
        return arr.reshape(arr.shape[0], 1, arr.shape[1])
    return arr


def _to_ours(arr: np.ndarray, layout: str) -> np.ndarray:
    if layout in ("heads", "one_head"):
        return arr.reshape(arr.shape[0], -1)
    return arr


def to_maxtext(params: Mapping[Path, np.ndarray], layer_type: str, num_heads: int) -> dict[Path, np.ndarray]:
    """Our parameters (by attribute path) -> MaxText's (by state path), in MaxText's layouts."""
    return {e.theirs: _to_theirs(np.asarray(params[e.ours]), e.layout, num_heads) for e in table(layer_type)}


def from_maxtext(params: Mapping[Path, np.ndarray], layer_type: str) -> dict[Path, np.ndarray]:
    """The inverse of `to_maxtext` (MaxText state paths -> our attribute paths and layouts)."""
    return {e.ours: _to_ours(np.asarray(params[e.theirs]), e.layout) for e in table(layer_type)}


def check(ours: Mapping[Path, tuple[int, ...]], theirs: Mapping[Path, tuple[int, ...]], layer_type: str,
          num_heads: int) -> list[str]:
    """Problems of the map against two parameter trees (path -> shape): unused, unset, mis-shaped."""
    entries = table(layer_type)
    problems = []
    missing_ours = sorted(".".join(e.ours) for e in entries if e.ours not in ours)
    unused_ours = sorted(".".join(p) for p in set(ours) - {e.ours for e in entries})
    missing_theirs = sorted("/".join(e.theirs) for e in entries if e.theirs not in theirs)
    unset_theirs = sorted("/".join(p) for p in set(theirs) - {e.theirs for e in entries})
    for label, names in (("not in our layer", missing_ours), ("of ours not mapped", unused_ours),
                         ("not in MaxText's layer", missing_theirs), ("of MaxText's not set", unset_theirs)):
        if names:
            problems.append(f"{label}: {names}")
    for e in entries:
        if e.ours in ours and e.theirs in theirs:
            want = _to_theirs(np.empty(ours[e.ours], np.int8), e.layout, num_heads).shape
            if tuple(want) != tuple(theirs[e.theirs]):
                problems.append(f"{'.'.join(e.ours)} -> {'/'.join(e.theirs)}: shape {list(ours[e.ours])} maps to "
                                f"{list(want)}, MaxText has {list(theirs[e.theirs])}")
    return problems


def load(mt_params: Mapping[Path, nnx.Variable], attn, layer_type: str, num_heads: int, dtype) -> None:
    """Write our layer's parameters into MaxText's Param variables (`mt_params`: path -> Param), cast to
    `dtype` (MaxText keeps one `weight_dtype` for every parameter, norms and sinks included)."""
    ours = ours_params(attn)
    problems = check({k: v.shape for k, v in ours.items()},
                     {k: tuple(v.get_value().shape) for k, v in mt_params.items()}, layer_type, num_heads)
    if problems:
        raise ValueError("maxtext_map: our parameters do not fit MaxText's layer: " + "; ".join(problems))
    for path, arr in to_maxtext(ours, layer_type, num_heads).items():
        mt_params[path].set_value(jnp.asarray(arr, dtype))
