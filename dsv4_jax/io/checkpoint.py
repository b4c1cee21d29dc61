"""Load one attention layer from a safetensors checkpoint: HF or DeepSeek naming, FP8 or not.

`load_attention_checkpoint(attn, path, layer_idx=None)` reads the tensors of one layer's
attention from

* a single ``.safetensors`` file,
* a directory with ``model.safetensors.index.json`` (a sharded checkpoint; only the shards
  that hold the layer's tensors are opened), or a directory of ``.safetensors`` files
  without an index (only their headers are read to find the layer),

under either naming (spec section 11.1):

* HF: ``model.layers.{i}.self_attn.{q_a_proj.weight, ..., sinks, compressor.*}``;
* DeepSeek's official: ``layers.{i}.attn.{wq_a, wq_b, wkv, wo_a, wo_b, q_norm, kv_norm,
  attn_sink, compressor.{wkv,wgate,norm,ape}, indexer.{wq_b,weights_proj},
  indexer.compressor.{wkv,wgate,norm,ape}}``, renamed to HF names by the rules of §11.3.

FP8: an ``F8_E4M3`` weight comes with a block scale named ``<name>.scale`` (official) or
``<name>.weight_scale_inv`` (HF), either spelling in either naming, of shape
``[ceil(out/128), ceil(in/128)]`` and dtype ``F8_E8M0`` (UE8M0: byte u means 2^(u-127)),
``U8`` (the same bytes), ``F32`` or ``BF16``. The scale *multiplies* (despite HF's name):
``W[r, c] = W8[r, c] * s[r // 128, c // 128]``. Dequantization runs in float32, then the
layer's `param_dtype` is applied as for any other weight.

Lazy: the safetensors header (8-byte little-endian length + JSON) is parsed here and each
tensor of the requested layer is read through its own `numpy.memmap` window, so the bytes of
other layers are never touched (one layer of a 280 GB checkpoint reads ~0.1-0.3 GB).

Strict: names, shapes, FP8 scales and dtypes are checked from the headers before any tensor
data is read, and every problem is listed in one `ValueError` (see `weights.check_weight_shapes`,
the one strict check shared with `load_hf_attention_weights`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from dsv4_jax.config import CSA, HCA, SLIDING, DeepseekV4Config
from dsv4_jax.io.hf_weights import assign_checked, check_weight_shapes

INDEX_FILE = "model.safetensors.index.json"
BLOCK = 128  # FP8 block size (rows and columns)

# safetensors dtype tag -> NumPy dtype (little-endian, as the format stores it).
_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "U8": np.dtype("u1"), "I8": np.dtype("i1"), "I16": np.dtype("<i2"), "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"), "BOOL": np.dtype("?"),
}
_FLOAT_TAGS = ("F64", "F32", "F16", "BF16")
_FP8_TAGS = ("F8_E4M3", "F8_E5M2")
_SCALE_TAGS = ("F8_E8M0", "U8", "F32", "BF16")

NAMINGS = {
    "hf": re.compile(r"^model\.layers\.(\d+)\.self_attn\.(.+)$"),
    "official": re.compile(r"^layers\.(\d+)\.attn\.(.+)$"),
}
_LAYER_PREFIX = {"hf": "model.layers.{i}.self_attn.", "official": "layers.{i}.attn."}

# Official name components -> HF (spec section 11.3), applied after the indexer moves.
_OFFICIAL_PARTS = {
    "wq_a": "q_a_proj", "wq_b": "q_b_proj", "wkv": "kv_proj", "wgate": "gate_proj", "wo_a": "o_a_proj",
    "wo_b": "o_b_proj", "q_norm": "q_a_norm", "norm": "kv_norm", "ape": "position_bias", "attn_sink": "sinks",
}


# ---------------------------------------------------------------------------- safetensors reading
@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Where one tensor lies: file, dtype tag, shape and byte range (absolute offsets)."""

    key: str
    path: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int


def read_header(path: str) -> dict[str, TensorRef]:
    """Parse a safetensors header (no tensor data is read): key -> `TensorRef`.

    The layout is checked as the safetensors library checks it (its reader cannot take the
    FP8 / E8M0 dtypes, so this one reads the format itself): every entry has a dtype, a shape of
    non-negative ints and ``data_offsets`` [begin, end]; sorted by begin, the tensors start at 0
    (right after the header), follow each other without gap or overlap, each spans dtype x shape
    bytes (for the dtypes this reader knows), and the last one ends where the file ends. The one
    leniency: a file cut short is reported when a tensor past the cut is read (`read_tensor`),
    so that a layer before the cut still loads (the bytes of other layers are never needed)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > 100_000_000:
                raise ValueError(f"header length {n} bytes is implausible")
            raw = f.read(n)
            if len(raw) < n:
                raise ValueError(f"header of {n} bytes is truncated")
        header = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"checkpoint file {path!r}: expected a safetensors file, got an unreadable one "
                         f"({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"checkpoint file {path!r}: expected a JSON object as safetensors header")
    base = 8 + n
    refs = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            if not (_is_count(begin) and _is_count(end) and all(map(_is_count, shape)) and begin <= end
                    and isinstance(info["dtype"], str)):
                raise ValueError
            refs[key] = TensorRef(key, path, info["dtype"], shape, base + begin, base + end)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"checkpoint file {path!r}: malformed header entry for {key!r}: {info!r}") from None
    _check_layout(path, refs, base)
    return refs


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(path: str, refs: Mapping[str, TensorRef], base: int) -> None:
    """The tensors tile the data section exactly (see `read_header`); a `ValueError` naming the
    file and the offending tensor otherwise."""
    at = base
    for ref in sorted(refs.values(), key=lambda r: (r.start, r.stop)):
        if ref.start != at:
            what = "overlaps the tensor before it" if ref.start < at else "leaves a gap after the tensor before it"
            where = "the start of the data" if at == base else f"data offset {at - base}"
            raise ValueError(
                f"checkpoint file {path!r}: expected tensor {ref.key!r} to start at {where}, got data_offsets "
                f"[{ref.start - base}, {ref.stop - base}] (it {what}; the safetensors format stores tensors "
                "back to back)")
        dtype = _DTYPES.get(ref.dtype)
        if dtype is not None and ref.stop - ref.start != math.prod(ref.shape) * dtype.itemsize:
            raise ValueError(
                f"checkpoint tensor {ref.key!r} in {path!r}: expected {math.prod(ref.shape) * dtype.itemsize} "
                f"bytes for {ref.dtype} {list(ref.shape)}, the header gives {ref.stop - ref.start}")
        at = ref.stop
    size = os.path.getsize(path)
    if size > at:
        raise ValueError(
            f"checkpoint file {path!r}: expected the tensors to end where the file ends ({size} bytes), got "
            f"data up to byte {at} ({size - at} bytes after the last tensor)")


def read_tensor(ref: TensorRef) -> np.ndarray:
    """The tensor's data as a read-only NumPy array over a memory map of exactly its bytes."""
    dtype = _DTYPES.get(ref.dtype)
    if dtype is None:
        raise ValueError(f"checkpoint tensor {ref.key!r}: unsupported safetensors dtype {ref.dtype}")
    count = math.prod(ref.shape)
    nbytes = count * dtype.itemsize
    if ref.stop - ref.start != nbytes:
        raise ValueError(
            f"checkpoint tensor {ref.key!r} in {ref.path!r}: expected {nbytes} bytes for {ref.dtype} "
            f"{list(ref.shape)}, the header gives {ref.stop - ref.start}"
        )
    if nbytes == 0:
        return np.zeros(ref.shape, dtype)
    size = os.path.getsize(ref.path)
    if ref.stop > size:
        raise ValueError(
            f"checkpoint tensor {ref.key!r}: expected bytes {ref.start}..{ref.stop} of {ref.path!r}, "
            f"the file has {size} bytes (truncated?)"
        )
    raw = np.memmap(ref.path, dtype=np.uint8, mode="r", offset=ref.start, shape=(nbytes,))
    return raw.view(dtype).reshape(ref.shape)


def _catalog(path: str) -> tuple[dict[str, str], dict[str, dict[str, TensorRef]]]:
    """(key -> file for every tensor of the checkpoint, headers already parsed by file)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_FILE)
        if os.path.exists(index):
            return _from_index(index), {}
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(
                f"path: expected a .safetensors file or a directory with {INDEX_FILE} or .safetensors files, "
                f"got the directory {path!r} without any"
            )
        headers = {os.path.join(path, f): read_header(os.path.join(path, f)) for f in files}
        return {k: p for p, refs in headers.items() for k in refs}, headers
    if path.endswith(".json"):
        return _from_index(path), {}
    if not os.path.exists(path):
        raise ValueError(f"path: expected an existing safetensors file or checkpoint directory, got {path!r}")
    refs = read_header(path)
    return dict.fromkeys(refs, path), {path: refs}


def _from_index(index: str) -> dict[str, str]:
    """key -> shard path of an index file. The shards must be files of the index's own directory:
    a name that leads elsewhere (``../x.safetensors``, an absolute path, a link out) is refused,
    as is a `weight_map` that is not a mapping of tensor name -> file name."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"checkpoint index {index!r}: expected JSON with a 'weight_map' ({err})") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"checkpoint index {index!r}: expected 'weight_map' to map tensor names to shard files, "
                         f"got {type(weight_map).__name__}")
    root = os.path.dirname(os.path.abspath(index))
    real_root = os.path.realpath(root)
    out = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"checkpoint index {index!r}: expected weight_map[{key!r}] to be a shard file name, "
                             f"got {name!r}")
        shard = os.path.join(root, name)
        if os.path.isabs(name) or os.path.commonpath([real_root, os.path.realpath(shard)]) != real_root:
            raise ValueError(f"checkpoint index {index!r}: expected weight_map[{key!r}] to name a file inside the "
                             f"checkpoint directory {root!r}, got {name!r}")
        out[key] = shard
    return out


# ---------------------------------------------------------------------------- naming
def official_to_hf(name: str) -> str:
    """An official layer-relative name (``indexer.compressor.wkv.weight``) -> HF's
    (``compressor.indexer.kv_proj.weight``); ``.scale`` -> ``.weight_scale_inv``."""
    parts = name.split(".")
    if parts[:2] == ["indexer", "compressor"]:
        parts = ["compressor", "indexer", *parts[2:]]
    elif parts[:1] == ["indexer"] and parts[1:2] == ["weights_proj"]:
        parts = ["compressor", "indexer", "scorer", *parts[1:]]
    elif parts[:1] == ["indexer"]:
        parts = ["compressor", "indexer", *parts[1:]]
    parts = [_OFFICIAL_PARTS.get(p, p) for p in parts]
    if parts[-1] == "scale":
        parts[-1] = "weight_scale_inv"
    return ".".join(parts)


def _split_scale(name: str) -> str | None:
    """HF weight name a scale belongs to (``x.weight_scale_inv`` or ``x.scale`` -> ``x.weight``)."""
    for suffix in (".weight_scale_inv", ".scale"):
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return None


def _layer_keys(catalog: Mapping[str, str], layer_idx: int) -> tuple[str, dict[str, str]]:
    """(naming, layer-relative name -> full key) of layer `layer_idx`'s attention tensors."""
    found: dict[str, dict[str, str]] = {"hf": {}, "official": {}}
    layers: dict[str, set[int]] = {"hf": set(), "official": set()}
    for key in catalog:
        for naming, pattern in NAMINGS.items():
            m = pattern.match(key)
            if m:
                layers[naming].add(int(m.group(1)))
                if int(m.group(1)) == layer_idx:
                    found[naming][m.group(2)] = key
    present = [n for n in NAMINGS if found[n]]
    if len(present) == 2:
        raise ValueError(
            f"checkpoint: expected one naming for layer {layer_idx}, got both HF "
            f"('model.layers.{layer_idx}.self_attn.*') and official ('layers.{layer_idx}.attn.*') keys"
        )
    if not present:
        have = [f"{_ranges(sorted(layers[n]))} ({n} naming)" for n in NAMINGS if layers[n]]
        got = f"attention tensors of layers {'; '.join(have)}" if have else "no attention tensors in either naming"
        raise ValueError(
            f"layer_idx: expected a layer of the checkpoint ('model.layers.{layer_idx}.self_attn.*' or "
            f"'layers.{layer_idx}.attn.*'), got {layer_idx}; the checkpoint has {got}"
        )
    return present[0], found[present[0]]


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _layer_type_of(names: set[str]) -> str:
    """The layer type a set of HF names belongs to (CSA has an indexer, HCA only a compressor)."""
    if any(n.startswith("compressor.indexer.") for n in names):
        return CSA
    if any(n.startswith("compressor.") for n in names):
        return HCA
    return SLIDING


# ---------------------------------------------------------------------------- FP8
def scale_to_float32(scale: np.ndarray, tag: str) -> np.ndarray:
    """Block scales as float32 multipliers (UE8M0 bytes u -> 2^(u-127))."""
    if tag == "U8":
        return np.ldexp(np.float32(1.0), scale.astype(np.int32) - 127).astype(np.float32)
    return np.asarray(scale).astype(np.float32)


def dequantize_blocks(weight: np.ndarray, scale: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """``W[r, c] = float(weight[r, c]) * scale[r // block, c // block]`` in float32.

    weight: [out, in] (any float dtype, e.g. float8_e4m3fn); scale: float32
    [ceil(out/block), ceil(in/block)]. Works a block row at a time, so only one block row
    of the input is widened at once (the input may be a memory map).
    """
    rows, cols = weight.shape
    out = np.empty((rows, cols), np.float32)
    for i, r0 in enumerate(range(0, rows, block)):
        factors = np.repeat(scale[i], block)[:cols]
        np.multiply(weight[r0 : r0 + block].astype(np.float32), factors, out=out[r0 : r0 + block])
    return out


# ---------------------------------------------------------------------------- the loader
@dataclasses.dataclass(frozen=True)
class CheckpointLayer:
    """What `load_attention_checkpoint` loaded: naming, source layer, files, and the
    checkpoint key of every parameter (HF name -> key); `fp8` lists the dequantized ones."""

    naming: str
    layer_idx: int
    files: tuple[str, ...]
    keys: Mapping[str, str]
    fp8: tuple[str, ...]


def load_attention_checkpoint(attn, path: str | os.PathLike, layer_idx: int | None = None) -> CheckpointLayer:
    """Load layer `layer_idx`'s attention weights from a safetensors checkpoint into `attn`.

    path: a ``.safetensors`` file, a checkpoint directory (with ``model.safetensors.index.json``
    or plain ``.safetensors`` files), or the index file itself.
    layer_idx: the checkpoint layer to read; defaults to ``attn.layer_idx``. Another index is
    allowed (e.g. to load layer 7 into a layer object built as layer 1) when both are of the
    same layer type; a type mismatch is a `ValueError`.

    Either naming (HF or DeepSeek's official), FP8 weights with UE8M0 block scales or plain
    bf16/fp32 weights (see the module docstring). Only this layer's tensors are read. Strict:
    unknown, missing and mis-shaped tensors, FP8 weights without scales (or scales of the
    wrong shape), and non-finite values are listed by name in one `ValueError`; nothing is
    loaded unless everything fits. Returns a `CheckpointLayer` describing what was read.
    """
    if layer_idx is None:
        layer_idx = attn.layer_idx
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, (int, np.integer)) or layer_idx < 0:
        raise ValueError(f"layer_idx: expected a non-negative int (or None for attn.layer_idx), got {layer_idx!r}")
    layer_idx = int(layer_idx)
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a file or directory path, got {type(path).__name__}")
    catalog, headers = _catalog(path)
    naming, keys = _layer_keys(catalog, layer_idx)

    # Rename to HF, split weights from scales, and find each tensor's header entry.
    refs: dict[str, TensorRef] = {}
    scales: dict[str, TensorRef] = {}
    problems: list[str] = []
    source: dict[str, str] = {}
    for rel, key in sorted(keys.items()):
        name = official_to_hf(rel) if naming == "official" else rel
        file = catalog[key]
        if file not in headers:
            headers[file] = read_header(file)  # opens only the shards holding this layer
        ref = headers[file].get(key)
        if ref is None:
            problems.append(f"{key!r}: listed in the index for {os.path.basename(file)!r} but not in that file")
            continue
        owner = _split_scale(name)
        target = scales if owner is not None else refs
        slot = owner if owner is not None else name
        if slot in target:
            problems.append(f"{slot!r}: given twice ({target[slot].key!r} and {key!r})")
        target[slot] = ref
        if owner is None:
            source[name] = key

    def describe(name: str) -> str:
        key = source.get(name)
        return repr(name) if key is None or key.endswith(name) else f"{name!r} ({key!r})"

    # Type check first: a layer object of another type cannot take these tensors at all.
    ckpt_type = _layer_type_of(set(refs))
    if ckpt_type != attn.layer_type:
        evidence = {CSA: "it has 'compressor.indexer.*' tensors", HCA: "it has 'compressor.*' but no "
                    "'compressor.indexer.*' tensors", SLIDING: "it has no 'compressor.*' tensors"}[ckpt_type]
        raise ValueError(
            f"layer_idx: expected a checkpoint layer of attn's type {attn.layer_type} (attn is layer "
            f"{attn.layer_idx}), got checkpoint layer {layer_idx}, a {ckpt_type} layer ({evidence})"
        )

    # Header-level checks: dtypes and FP8 scales (the names and shapes follow in check_weight_shapes).
    fp8 = []
    for name, ref in sorted(refs.items()):
        scale = scales.get(name)
        if ref.dtype in _FP8_TAGS:
            if scale is None:
                stem = ref.key.removesuffix(".weight")
                problems.append(f"{describe(name)}: {ref.dtype} weight without a block scale "
                                f"(expected '{stem}.scale' or '{stem}.weight_scale_inv')")
                continue
            fp8.append(name)
            want = tuple(-(-s // BLOCK) for s in ref.shape)
            if len(ref.shape) != 2:
                problems.append(f"{describe(name)}: expected a 2-D FP8 weight, got shape {list(ref.shape)}")
            elif scale.shape != want:
                problems.append(
                    f"{scale.key!r}: expected shape {list(want)} (128x128 blocks of the {list(ref.shape)} weight), "
                    f"got {list(scale.shape)}"
                )
            if scale.dtype not in _SCALE_TAGS:
                problems.append(f"{scale.key!r}: expected a scale dtype in {_SCALE_TAGS}, got {scale.dtype}")
        elif ref.dtype not in _FLOAT_TAGS:
            problems.append(f"{describe(name)}: expected a float dtype in {_FLOAT_TAGS + _FP8_TAGS}, got {ref.dtype}")
        elif scale is not None:
            problems.append(f"{scale.key!r}: a block scale for {ref.key!r}, which is {ref.dtype}, not FP8")
    for name, scale in sorted(scales.items()):
        if name not in refs:
            problems.append(f"{scale.key!r}: a block scale without its weight {name!r}")

    hint_configs = _config_json_hint(path)
    check_weight_shapes(attn, {n: r.shape for n, r in refs.items()}, describe=describe, problems=problems,
                        hint_configs=hint_configs, what=f"checkpoint layer {layer_idx} ({naming} naming) -> weights")

    # Everything fits: read (only these tensors), dequantize, and assign through the strict loader.
    arrays = {}
    for name, ref in refs.items():
        data = read_tensor(ref)
        if name in scales:
            scale = scales[name]
            data = dequantize_blocks(data, scale_to_float32(read_tensor(scale), scale.dtype))
        else:
            data = data.astype(np.float32)
        arrays[name] = data
    assign_checked(attn, arrays, describe=describe, what=f"checkpoint layer {layer_idx} ({naming} naming) -> weights")
    files = sorted({r.path for r in (*refs.values(), *scales.values())})
    return CheckpointLayer(naming=naming, layer_idx=layer_idx, files=tuple(files),
                           keys={n: r.key for n, r in sorted(refs.items())}, fp8=tuple(sorted(fp8)))


def _config_json_hint(path) -> list[tuple[str, Any]]:
    """The checkpoint's own config.json, if it sits next to the weights (for the mis-shape hint)."""
    path = os.fspath(path)
    root = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(root, "config.json")
    if not os.path.exists(file):
        return []
    try:
        with open(file) as f:
            cfg = DeepseekV4Config.from_hf(json.load(f))
    except Exception:  # a hint only: an unreadable config.json gives none
        return []
    return [(f"DeepseekV4Config.from_hf(json.load(open({file!r})))", cfg)]
