"""`jax.export` of the layer's compiled step: serialize it, load it elsewhere, call it.

Importing this module registers the library's pytrees (`AttentionWeights`,
`CompressorWeights`, `IndexerWeights`, `AttentionCache`, `CompressorCache`, `Intermediates`)
with `jax.export.register_pytree_node_serialization`, so that an exported step's calling
convention (its input and output trees) can be serialized. Import it in the process that
deserializes too (`deserialize_step` lives here, so using it does).

>>> from dsv4_jax.io.export import export_step, serialize_step, deserialize_step
>>> attn = DeepseekV4Attention(cfg, layer_idx=1, rngs=nnx.Rngs(0), break_mode="none")
>>> cache = attn.init_cache(batch_size=2, max_seq_len=4096)
>>> exported = export_step(attn, (2, 100, cfg.hidden_size), cache)   # a prefill of 100 tokens
>>> blob = serialize_step(exported)                                   # bytes: store them anywhere
>>> step = deserialize_step(blob)
>>> out, cache, _ = step.call(attn.weights(), cache, x, positions)   # = attention_step(...)

What is exported: `attention_step` for one call shape (batch, tokens per call, the cache's
`max_seq_len`), one dtype and the layer's static options, with the weights and the cache as
*arguments* (nothing is baked in). Export a prefill and a decode step separately. The call
skips the eager path's input checks (positions must continue the cache, as in `jax.jit`).

What exports: ``break_mode="none"`` and the **native device break** (``"narrow"`` with
``break_on="device"``, or ``"auto"`` where the native handlers are built): the latter keeps its
FFI custom call (target ``dsv4_select_topk``, the eager break; its ``_fp4`` and ``_paged``
variants on an FP8 or a paged cache) in the exported module, so the
process that calls the deserialized step must have the target registered on the same platform;
`deserialize_step` registers the library's targets (as importing and using `dsv4_jax.native`
does), and a missing native build fails at the call with XLA's "no FFI handler" error. Host
breaks refuse with a `ValueError` naming ``break_mode``: a `jax.pure_callback` (``"narrow"`` on
the host, ``"wide"``) cannot be serialized. A sliding or HCA layer has no indexer, so its
``"narrow"`` is ``"none"``. A layer on a mesh (``attn.mesh``) exports its one-device step.

The selection: a layer whose ``break_mode="none"`` step runs the native graph handler
(``kernels="auto"`` where it is built) is exported with the XLA selection (`lax.top_k`,
same picks by the selection's contract) so that the artifact runs wherever jax runs;
``native_kernels=True`` keeps the native custom call instead, and then the process that
calls the deserialized step must have the targets registered (``dsv4_jax.native.available``
of its platform returns True) on the same platform.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax import native
from dsv4_jax.cache.contiguous import AttentionCache, CompressorCache
from dsv4_jax.cache.paged import PageTable
from dsv4_jax.cache.quantized import QuantizedRows
from dsv4_jax.layer.module import DeepseekV4Attention
from dsv4_jax.ops.compress.reference import CompressorWeights
from dsv4_jax.ops.indexer.reference import IndexerWeights
from dsv4_jax.step.pure_step import AttentionWeights, Intermediates, StepSpec, attention_step

PYTREES = (AttentionWeights, CompressorWeights, IndexerWeights, AttentionCache, CompressorCache, QuantizedRows,
           PageTable, Intermediates)

# The native targets an exported step may call (see `dsv4_jax.native`): the graph-compatible
# selection of break_mode="none" (native_kernels=True) and the eager device break of "narrow".
_NATIVE_TARGETS = tuple(f"dsv4_select_topk{keys}{layout}{graph}" for keys in ("", "_fp4") for layout in ("", "_paged")
                        for graph in ("_graph", ""))

__all__ = ["PYTREES", "deserialize_step", "export_step", "serialize_step"]


# ---------------------------------------------------------------------------- registration
def _serialize_aux(aux: Any) -> bytes:
    # flax struct dataclasses flatten to (children, tuple of their static fields' values):
    # AttentionCache's (layer_idx, layer_type, max_seq_len), an empty tuple for the others.
    return json.dumps(list(aux), default=_json_scalar).encode()


def _json_scalar(value: Any):
    if isinstance(value, np.integer):
        return int(value)
    raise TypeError(f"cannot serialize the static field value {value!r} of a dsv4_jax pytree")


def _deserialize_aux(data: bytes) -> tuple:
    return tuple(json.loads(bytes(data).decode()))


def _register(cls: type) -> None:
    name = f"dsv4_jax.{cls.__name__}"
    try:
        jax.export.register_pytree_node_serialization(
            cls, serialized_name=name, serialize_auxdata=_serialize_aux, deserialize_auxdata=_deserialize_aux)
    except ValueError as err:  # registered before (e.g. this module was reloaded)
        if "Duplicate serialization registration" not in str(err) or name not in str(err) + repr(cls):
            raise


for _cls in PYTREES:
    _register(_cls)


# ---------------------------------------------------------------------------- export
def _exportable_spec(spec: StepSpec, break_mode: str, native_kernels: bool) -> StepSpec:
    plan = spec.plan
    if plan.mode == "wide":
        raise ValueError(
            "break_mode: 'wide' cannot be exported: its host break (wq_b_kv_insert, the compressors and "
            "the indexer in NumPy) is a jax.pure_callback, and host callbacks cannot be serialized by "
            "jax.export; set break_mode='none' (same outputs, everything in the XLA program)"
        )
    if plan.mode == "narrow" and plan.place == "host":
        raise ValueError(
            f"break_mode: {break_mode!r} with break_on='host' cannot be exported: its break (the indexer's "
            f"scoring + top-k) is a jax.pure_callback into NumPy, and host callbacks cannot be serialized by "
            f"jax.export; set break_mode='none' (same picks and outputs, everything in the XLA program) or "
            f"break_on='device' (the native custom call, where it is built)"
        )
    if plan.mode == "none" and plan.native_select and not native_kernels:
        plan = dataclasses.replace(plan, native_select=False, kernels=dataclasses.replace(plan.kernels, select="xla"))
    # The exported step is a one-device program: no per-shard wrapping (`dsv4_jax.step.sharding`).
    return dataclasses.replace(spec, plan=dataclasses.replace(plan, layout=None))


def _struct(a) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(a), a.dtype)


def export_step(attn: DeepseekV4Attention, hidden_shape: Sequence[int], cache: AttentionCache, *,
                hidden_dtype=jnp.float32, return_intermediates: bool = False, native_kernels: bool = False,
                platforms: Sequence[str] | None = None) -> jax.export.Exported:
    """Export `attn`'s compiled step for calls of `hidden_shape` [B, S, hidden] on `cache`.

    attn:                 a layer in break_mode "none", or "narrow" on the device (host breaks
                          raise a ValueError naming ``break_mode``; see the module docstring)
    hidden_shape:         (B, S, hidden) of the calls to export (S new tokens per call)
    cache:                a cache of the shape the calls will use (`attn.init_cache(B, max_seq_len)`);
                          only its shapes, dtypes and static fields are read
    hidden_dtype:         dtype of the hidden states passed in (cast to the layer's
                          `compute_dtype`, as the layer's call does)
    return_intermediates: export the step that also returns `Intermediates`
    native_kernels:       keep the native graph selection of a "none" layer that uses it (module
                          docstring); the device break always keeps its custom call
    platforms:            `jax.export` lowering platforms (default: jax's default backend)

    Returns a `jax.export.Exported`: ``exported.call(weights, cache, hidden_states, positions)``
    returns ``(out, new_cache, intermediates or None)``, as `dsv4_jax.attention_step`; weights
    are `attn.weights()` (or any `AttentionWeights` of the same shapes).
    """
    if not isinstance(attn, DeepseekV4Attention):
        raise TypeError(f"attn: expected a DeepseekV4Attention, got {type(attn).__name__}")
    if not isinstance(cache, AttentionCache):
        raise TypeError(f"cache: expected an AttentionCache, got {type(cache).__name__}")
    shape = tuple(int(n) for n in hidden_shape)
    cfg = attn.config
    if len(shape) != 3 or shape[0] != cache.batch_size or shape[2] != cfg.hidden_size or shape[1] < 1:
        raise ValueError(
            f"hidden_shape: expected (batch={cache.batch_size}, tokens >= 1, hidden={cfg.hidden_size}) "
            f"for this layer and cache, got {shape}"
        )
    if cache.layer_type != attn.layer_type:
        raise ValueError(f"cache: a {cache.layer_type} cache, but the layer is {attn.layer_type}")
    spec = _exportable_spec(attn.step_spec(return_intermediates), attn.break_mode,
                            native_kernels)
    disabled = ()
    if spec.plan.native_select:  # jax.export allows only its own list of custom calls unless told
        disabled = tuple(jax.export.DisabledSafetyCheck.custom_call(t) for t in _NATIVE_TARGETS)
    step = jax.jit(functools.partial(attention_step, spec=spec))
    args = (
        jax.tree.map(_struct, attn.weights()),
        jax.tree.map(_struct, cache),
        jax.ShapeDtypeStruct(shape, jnp.dtype(hidden_dtype)),
        jax.ShapeDtypeStruct(shape[:2], jnp.int32),
    )
    return jax.export.export(step, platforms=platforms, disabled_checks=disabled)(*args)


def serialize_step(exported: jax.export.Exported) -> bytes:
    """The exported step as bytes (StableHLO plus its calling convention)."""
    return bytes(exported.serialize())


def deserialize_step(data: bytes | bytearray) -> jax.export.Exported:
    """An exported step back from `serialize_step`'s bytes; call it with ``.call(...)``.

    Registers the library's native FFI targets with XLA where they are built (a step exported
    with the device break or ``native_kernels=True`` calls them); the others need none."""
    exported = jax.export.deserialize(bytearray(data))
    for platform in exported.platforms:
        native.available(platform)  # registers the platform's targets; False where not built
    return exported
