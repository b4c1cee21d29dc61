"""Weights: HF `DeepseekV4Attention.state_dict()` names <-> the layer's parameters.

HF stores every projection PyTorch-style ``[out, in]`` (``y = x W^T``); the layer holds
``[in, out]`` kernels, so linear weights are transposed on the way in. The grouped output
projection ``o_a_proj.weight [G*R, H*D/G]`` becomes ``[G, H*D/G, R]``.

Projections take the layer's `param_dtype`; norm weights, sinks and position biases stay
float32 (what HF's loader keeps in float32 for a bf16 model, spec section 11.4).

The names have one source, the layer's attributes (its constructors): `parameter_table` and
`expected_shapes` derive the HF names (`hf_name`), shapes and layouts from them.

There is one strict check (`check_weight_shapes`): `load_hf_attention_weights` (in-memory
mappings) and `load_attention_checkpoint` (safetensors files, see `checkpoint`) both go
through it, so both list every missing, unknown and mis-shaped tensor in one `ValueError`
and load nothing unless everything fits.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4_jax.config import DeepseekV4Config
from dsv4_jax.layer.module import DeepseekV4Attention

_PREFIX = re.compile(r"^model\.layers\.(\d+)\.self_attn\.")

# Presets tried when shapes do not fit, to say which published model a checkpoint belongs to.
_PRESETS: tuple[tuple[str, Callable[[], DeepseekV4Config]], ...] = (
    ("DeepseekV4Config.flash()", DeepseekV4Config.flash),
    ("DeepseekV4Config.pro()", DeepseekV4Config.pro),
    ("DeepseekV4Config.tiny()", DeepseekV4Config.tiny),
)


def hf_name(path: tuple[str, ...]) -> str:
    """HF's state_dict name of the parameter at attribute path `path` of `DeepseekV4Attention`.

    The one naming rule: the layer's attributes (set in its constructors) are the source of the
    names, the HF table is derived. HF nests the indexer inside the compressor
    (``compressor.indexer.*``, its head weights under ``scorer.``, its key compressor's
    parameters directly), and names linear and norm weights ``<module>.weight``; ``sinks`` and
    ``position_bias`` are bare tensors.
    """
    if path[0] == "indexer":
        rest = path[1:]
        if rest[0] == "compressor":
            rest = rest[1:]
        elif rest[0] == "weights_proj":
            rest = ("scorer", *rest)
        path = ("compressor", "indexer", *rest)
    bare = path[-1] in ("sinks", "position_bias")
    return ".".join(path) + ("" if bare else ".weight")


def _kind(path: tuple[str, ...], ndim: int) -> str:
    """linear ([in, out] kernel, HF [out, in]), grouped (``o_a_proj`` [G, in_g, R]) or fp32."""
    if not path[-1].endswith("_proj"):
        return "fp32"  # norm weights, sinks, position biases: float32 in every param_dtype
    return "grouped" if ndim == 3 else "linear"


def _hf_shape(shape: tuple[int, ...], kind: str) -> tuple[int, ...]:
    if kind == "linear":
        return shape[::-1]
    if kind == "grouped":  # [G, in_g, R] -> [G*R, in_g]
        return (shape[0] * shape[2], shape[1])
    return shape


def _parameters(module, prefix: tuple[str, ...] = ()):
    """(attribute path, Param) of every parameter of an NNX module (and its submodules)."""
    for attr, value in vars(module).items():
        if attr.startswith("_"):
            continue
        if isinstance(value, nnx.Param):
            yield (*prefix, attr), value
        elif isinstance(value, nnx.Module):
            yield from _parameters(value, (*prefix, attr))


def _value(param):
    """A Param's array, or its `jax.ShapeDtypeStruct` in an abstract (`nnx.eval_shape`) layer."""
    return param.get_value() if hasattr(param, "get_value") else param.value


def parameter_table(attn) -> dict[str, tuple[Any, tuple[int, ...], str]]:
    """HF name -> (the layer's Param, the HF shape, kind) with kind in linear/grouped/fp32.

    Derived from the layer's own parameters (`hf_name`, `_kind`): nothing here lists them."""
    table = {}
    for path, param in _parameters(attn):
        shape = tuple(int(n) for n in _value(param).shape)
        kind = _kind(path, len(shape))
        table[hf_name(path)] = (param, _hf_shape(shape, kind), kind)
    return dict(sorted(table.items()))


def expected_shapes(cfg: DeepseekV4Config, layer_type: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape in PyTorch layout, kind) of one attention layer of `layer_type`.

    kind is ``linear`` ([out, in] projection), ``grouped`` (``o_a_proj``) or ``fp32`` (norms,
    sinks, position biases). Needs no layer object, so it also describes the presets: the
    table of an abstract layer (`nnx.eval_shape`, nothing allocated), cached per config.
    """
    return dict(_abstract_table(cfg, layer_type))


@functools.cache
def _abstract_table(cfg: DeepseekV4Config, layer_type: str) -> tuple[tuple[str, tuple[tuple[int, ...], str]], ...]:
    if layer_type not in cfg.layer_types:  # a config without such a layer: one of that type alone
        cfg = dataclasses.replace(cfg, layer_types=(layer_type,))
    layer_idx = cfg.layer_types.index(layer_type)
    abstract = nnx.eval_shape(lambda: DeepseekV4Attention(cfg, layer_idx, rngs=nnx.Rngs(0)))
    return tuple((name, (shape, kind)) for name, (_, shape, kind) in parameter_table(abstract).items())


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
    table = parameter_table(attn)
    for name in sorted(arrays):
        # Finite in the dtype the parameter will hold (what `_convert` makes of it): a float32
        # weight of 1e39 is as unusable in a bfloat16 layer as a NaN.
        arr, target = arrays[name], _stored_dtype(table[name][2], attn)
        with np.errstate(over="ignore", invalid="ignore"):
            stored = arr.astype(np.float32).astype(target)
        finite = np.isfinite(stored)
        if not finite.all():
            overflow = int((~finite & np.isfinite(arr.astype(np.float64))).sum())
            why = f" ({overflow} of them finite in the given {arr.dtype}, overflowing {target})" if overflow else ""
            bad.append(f"{describe(name)}: expected finite values, got {int(arr.size - finite.sum())} non-finite"
                       f"{why}")
    if bad:
        raise ValueError(f"{what} for layer {attn.layer_idx} ({attn.layer_type}): " + "; ".join(bad))
    for name, arr in arrays.items():
        param, _, kind = table[name]
        param[...] = _convert(arr, kind, attn)


def _stored_dtype(kind: str, attn) -> np.dtype:
    """The dtype a parameter of `kind` holds in `attn` (`_convert`'s target)."""
    return np.dtype(np.float32) if kind == "fp32" else np.dtype(jnp.dtype(attn.param_dtype))


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
