"""Many devices: the layer, its parameters and its cache sharded over a `jax.sharding.Mesh`.

Two kinds of parallelism, named by the mesh's axes (the defaults; `LOGICAL_AXIS_RULES` maps
the library's logical axes onto them, and a layer may bring its own rules):

* ``"data"``: the batch. Every activation and every cache leaf is ``[B, ...]`` and is split
  along B; B must be a multiple of the axis size.
* ``"model"``: the attention heads. ``q_b_proj``'s columns (head-major), the sinks and the
  grouped output projection (``o_a_proj``'s groups, ``o_b_proj``'s rows) are split; the
  axis size must divide ``num_attention_heads`` and ``o_groups``. The sparse attention is
  per head; the output projection sums over the groups, and XLA inserts that reduction.
  The single shared K=V head, the compressors and the whole cache have no head axis: they are
  replicated over ``"model"``.

Where the parallelism is declared: each parameter carries logical axis names as NNX sharding
metadata (``nnx.Param(..., out_sharding=("q_lora", "heads"))``, as MaxText and bonsai annotate
theirs); `param_partition_specs` turns them into mesh `PartitionSpec`s through the rules;
`cache_partition_specs` gives the cache's (batch on ``"data"``). `shard_layer` and
`shard_cache` place a layer and a cache on a mesh.

How the layer learns its mesh (trace time, once per compiled step; jax 0.10 and 0.12 alike):
``attn.mesh`` (the constructor's ``mesh=``, set by `shard_layer`), else the mesh of
``jax.set_mesh(...)`` around the call, else (eager calls only) the mesh the cache's arrays live
on. It becomes part of the step's `StepPlan` (a `MeshLayout`), so it is static: the compiled
program never asks.

What runs where (`run_per_shard`): the breaks run **per batch shard**, never on a gathered
global batch: the indexer's selection (host callback, native custom call, and `lax.top_k`,
for which XLA's partitioner gathers the batch too) and the wide break are wrapped in
`jax.shard_map` over the whole mesh (callbacks need every axis manual), with the batch split
along ``"data"``. Within a batch shard every ``"model"`` device holds the
same inputs; a host callback then runs on one of them only (`lax.cond` on the axis index) and
its result is shared with the others by a ``psum`` over ``"model"`` (the others add zeros), so
the host sees each batch row once per step; the native device break runs on every device of
the shard (it is on-device work on data each device already holds, and avoids waiting for a
collective). Everything else is ordinary XLA SPMD, steered by sharding constraints on the
step's inputs and outputs (`constrain_inputs`, `constrain_outputs`, which
`step.sharded_attention_step` applies): outputs and every cache leaf keep
their sharding.

The indexer's heads: its selection needs the score summed over *all* indexer heads
(``sum_h w_h relu(q_h . k)``) before the top-k. Splitting them over ``"model"`` would need a
cross-device reduction of the ``[B, S, T]`` scores inside the break and would change the order
of that float32 sum (the picks must equal one device's), so the indexer (its projections, its
compressor and key cache) is replicated over ``"model"``: logical axis ``"index_heads"`` maps to
no mesh axis. Its weights are a small part of the layer's (V4-Flash: ``q_b_proj`` [1024, 64*128]
beside the attention's [1024, 64*512]).

Limits: the mesh's axes must be `AxisType.Auto` (`make_mesh` builds one; `jax.make_mesh`'s
default is Explicit, where every op of the step would need explicit output shardings); the
layer is not meant to be called inside a user's own `shard_map`; the eager call's
``cache.length`` is its host mirror (a NumPy array), so it is the one cache leaf without a
device sharding. The cache writes (`backend.scatter_rows`) are vmapped per-row scatters,
which XLA's partitioner splits along the batch: a decode step on a data mesh compiles with no
collective (tests/step/test_sharding.py checks it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsv4_jax.cache.contiguous import HOST_MIRRORS, AttentionCache

DATA = "data"
MODEL = "model"

# Logical axis -> mesh axis (or None: replicated). Every logical name the layer uses is listed:
# flax passes an unlisted name through as a mesh axis name.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", DATA),  # the leading axis of every activation and cache leaf
    ("heads", MODEL),  # attention heads: q_b_proj's columns (head-major), sinks
    ("o_groups", MODEL),  # output projection groups: o_a_proj's groups, o_b_proj's rows
    ("embed", None),  # hidden size
    ("q_lora", None),  # q_lora_rank
    ("o_lora", None),  # o_lora_rank
    ("group_dim", None),  # o_a_proj's per-group input (heads of the group x head_dim)
    ("kv", None),  # the single K=V head's channels, compressor widths
    ("ratio", None),  # compressor window slots (position biases)
    ("index_heads", None),  # the indexer's heads: replicated (see the module docstring)
)

# The logical axes of the step's intermediates (`step.Intermediates`); missing fields: batch only.
_INTERMEDIATE_AXES = {
    "queries": ("batch", None, "heads", None),
    "sink_mass": ("batch", None, "heads"),
    "window_mass": ("batch", None, "heads"),
    "compressed_mass": ("batch", None, "heads"),
}




def make_mesh(data: int | None = None, model: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``("data", "model")`` mesh with `AxisType.Auto` axes over `devices` (default: all).

    data: the batch axis size (default: the devices left after `model`); model: the heads
    axis size. ``data * model`` must equal the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, value in (("model", model), ("data", data)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if data is None:
        if len(devices) % model:
            raise ValueError(f"model: expected a divisor of the {len(devices)} devices, got {model}")
        data = len(devices) // model
    if data * model != len(devices):
        raise ValueError(f"data, model: expected data * model == {len(devices)} devices, got {data} * {model}")
    grid = np.asarray(devices, dtype=object).reshape(data, model)
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


# ---------------------------------------------------------------------------- the layout
@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A mesh and the logical-axis rules that apply to it (hashable: part of a `StepPlan`).

    mesh:  a `jax.sharding.Mesh`, or the `AbstractMesh` of ``jax.set_mesh`` inside a trace
    rules: the rules, each mapped to the mesh axes present (an absent axis means replicated)
    """

    mesh: Any
    rules: tuple[tuple[str, Any], ...]

    def axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes a logical axis is split over (empty: replicated)."""
        target = dict(self.rules).get(logical) if logical else None
        if target is None:
            return ()
        return (target,) if isinstance(target, str) else tuple(target)

    def spec(self, *logical: str | None) -> P:
        """The `PartitionSpec` of an array with these logical axes."""
        parts = []
        for name in logical:
            axes = self.axes(name)
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*parts)

    def size(self, axes: Sequence[str]) -> int:
        shape = dict(self.mesh.shape)
        return int(np.prod([shape[a] for a in axes], dtype=np.int64))

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return self.axes("batch")

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The mesh axes a batch shard is replicated over (``"model"``, by default)."""
        return tuple(a for a in self.mesh.axis_names if a not in self.batch_axes and dict(self.mesh.shape)[a] > 1)

    def sharding(self, spec: P):
        """What `with_sharding_constraint` takes: a `NamedSharding`, or under ``jax.set_mesh`` with
        an abstract mesh the bare spec (jax resolves it against the context mesh)."""
        return NamedSharding(self.mesh, spec) if isinstance(self.mesh, Mesh) else spec


def _check_mesh(mesh: Any) -> None:
    if not isinstance(mesh, (Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    types = getattr(mesh, "axis_types", None) or ()
    explicit = [name for name, t in zip(mesh.axis_names, types) if t != AxisType.Auto]
    if explicit:
        raise ValueError(
            f"mesh: expected axes of type AxisType.Auto, got {dict(zip(mesh.axis_names, types))}; build it "
            f"with dsv4_jax.step.sharding.make_mesh(data, model) or jax.make_mesh(shape, names, "
            f"axis_types=(jax.sharding.AxisType.Auto,) * len(names))"
        )


def check_rules(rules: Any) -> tuple[tuple[str, Any], ...]:
    """`rules` as a hashable table over every logical axis: the user's pairs over the defaults
    (None: `LOGICAL_AXIS_RULES`); `TypeError` naming ``sharding_rules`` for anything else."""
    if rules is None:
        return LOGICAL_AXIS_RULES
    try:
        pairs = tuple((str(k), v if v is None or isinstance(v, str) else tuple(v)) for k, v in rules)
    except (TypeError, ValueError):
        raise TypeError(f"sharding_rules: expected (logical axis, mesh axis or None) pairs, got {rules!r}") from None
    # A user's table may name only what it changes: the other logical axes keep the defaults.
    return tuple({**dict(LOGICAL_AXIS_RULES), **dict(pairs)}.items())


def _on_mesh(mesh, rules) -> tuple[tuple[str, Any], ...]:
    """`rules` with every mesh axis that `mesh` lacks dropped (such a logical axis is replicated)."""
    names = set(mesh.axis_names)

    def present(target):
        if target is None:
            return None
        axes = tuple(a for a in ((target,) if isinstance(target, str) else target) if a in names)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return tuple((k, present(v)) for k, v in rules)


@functools.cache
def _layout(cfg, mesh, rules) -> MeshLayout:
    layout = MeshLayout(mesh=mesh, rules=_on_mesh(mesh, rules))
    for logical, count, what in (("heads", cfg.num_attention_heads, "num_attention_heads"),
                                 ("o_groups", cfg.o_groups, "o_groups")):
        size = layout.size(layout.axes(logical))
        if count % size:
            raise ValueError(
                f"mesh: expected the {'x'.join(map(repr, layout.axes(logical)))} axis (the {logical!r} axis) "
                f"to divide {what} ({count}), got size {size}; use a smaller model axis or more data parallelism"
            )
    return layout


def layout(cfg, mesh, rules=None) -> MeshLayout:
    """The `MeshLayout` of a layer of `cfg` on `mesh` (validated: the heads axis divides
    ``num_attention_heads`` and ``o_groups``; `ValueError` naming ``mesh`` otherwise)."""
    _check_mesh(mesh)
    return _layout(cfg, mesh, check_rules(rules))


def context_mesh():
    """The mesh of an enclosing ``jax.set_mesh(...)``, or None: concrete outside a trace, abstract
    inside one (`jax.sharding.get_mesh` refuses to run under `jax.jit`)."""
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # inside jax.jit: only the abstract mesh is known
        mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def mesh_of(cache: AttentionCache):
    """The mesh the cache's arrays are sharded over (more than one device), else None."""
    sharding = getattr(cache.window, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
        return sharding.mesh
    return None


def check_batch(layout_: MeshLayout, batch: int, name: str = "hidden_states") -> None:
    """`ValueError` naming `name` unless `batch` splits evenly over the batch axes."""
    size = layout_.size(layout_.batch_axes)
    if batch % size:
        raise ValueError(
            f"{name}: expected a batch size divisible by the mesh's {'x'.join(map(repr, layout_.batch_axes))} "
            f"axis ({size}), got {batch}"
        )


# ---------------------------------------------------------------------------- partition specs
def param_partition_specs(attn, mesh=None, rules=None) -> nnx.State:
    """The mesh `PartitionSpec` of every parameter of `attn`: an `nnx.State` shaped like
    ``nnx.state(attn, nnx.Param)`` whose values are specs.

    Read from the parameters' NNX sharding metadata (logical axes) through `rules` (default:
    the layer's ``sharding_rules``, else `LOGICAL_AXIS_RULES`), keeping only the axes of `mesh`
    (default: ``attn.mesh``; without any mesh, the rules are applied as they are).
    """
    rules = check_rules(rules if rules is not None else getattr(attn, "sharding_rules", None))
    mesh = mesh if mesh is not None else getattr(attn, "mesh", None)
    if mesh is not None:
        rules = layout(attn.config, mesh, rules).rules
    with nnx.logical_axis_rules(rules):
        return nnx.get_partition_spec(nnx.state(attn, nnx.Param))


def cache_partition_specs(cache: AttentionCache, mesh=None, rules=None) -> AttentionCache:
    """The mesh `PartitionSpec` of every cache leaf: an `AttentionCache` of specs.

    Every leaf is ``[B, ...]``: batch over the rules' ``"batch"`` axis (default ``"data"``), the
    rest replicated (the cache has no head axis: one shared K=V head). Without `mesh`, the rules
    are applied as they are.
    """
    if not isinstance(cache, AttentionCache):
        raise TypeError(f"cache: expected an AttentionCache, got {type(cache).__name__}")
    rules = check_rules(rules)
    if mesh is not None:
        _check_mesh(mesh)
        rules = _on_mesh(mesh, rules)
    return _cache_specs(MeshLayout(mesh=mesh, rules=rules), cache)


def _cache_specs(lay: MeshLayout, cache: AttentionCache) -> AttentionCache:
    # P("data") alone: the spec of the batch axis, the trailing axes replicated (the form jax
    # reports for such arrays, so that specs compare equal).
    return jax.tree.map(lambda a: lay.spec("batch"), cache)


def shard_layer(attn, mesh, rules=None):
    """Place `attn`'s parameters on `mesh` by their partition specs and set ``attn.mesh`` (in place).

    Returns `attn`. Raises `ValueError` naming ``mesh`` when its heads axis does not divide
    ``num_attention_heads`` / ``o_groups``. Loading weights afterwards (`load_hf_attention_weights`)
    replaces the parameters with unsharded arrays: shard after loading, or call this again.
    """
    rules = check_rules(rules if rules is not None else getattr(attn, "sharding_rules", None))
    lay = layout(attn.config, mesh, rules)
    specs = param_partition_specs(attn, mesh, rules)
    spec_of = {path: var.get_value() for path, var in nnx.to_flat_state(specs)}
    for path, var in nnx.to_flat_state(nnx.state(attn, nnx.Param)):
        # set_value, not ``var[...] =``: that writes into the old array (a scatter), which fails
        # when the old array is committed to another device set.
        var.set_value(jax.device_put(var.get_value(), lay.sharding(spec_of[path])))
    attn.mesh = mesh
    attn.sharding_rules = None if rules is LOGICAL_AXIS_RULES else rules
    return attn


def shard_cache(cache: AttentionCache, mesh, rules=None) -> AttentionCache:
    """`cache` placed on `mesh`, batch over ``"data"``. The batch size must split evenly
    (`ValueError` naming ``batch_size``). ``cache.length`` stays a NumPy array: it is the
    eager call's host mirror (see `dsv4_jax.cache.contiguous`), read on the host before every call."""
    specs = cache_partition_specs(cache, mesh, rules)
    check_batch(MeshLayout(mesh=mesh, rules=_on_mesh(mesh, check_rules(rules))), cache.batch_size, "batch_size")

    def place(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    # The host mirrors (the length, a rewind count) stay on the host; device values are placed.
    mirrors = {name: getattr(cache, name) for name in HOST_MIRRORS}
    none = dict.fromkeys(HOST_MIRRORS)
    placed = jax.tree.map(place, cache.replace(**none), specs.replace(**none))
    return placed.replace(**{name: mirror if mirror is None or isinstance(mirror, np.ndarray)
                             else place(mirror, getattr(specs, name)) for name, mirror in mirrors.items()})


# ---------------------------------------------------------------------------- the step's constraints
def _constrain(lay: MeshLayout, x, spec: P):
    return jax.lax.with_sharding_constraint(x, lay.sharding(spec))


def _constrain_cache(lay: MeshLayout, cache: AttentionCache) -> AttentionCache:
    return jax.tree.map(lambda a, s: _constrain(lay, a, s), cache, _cache_specs(lay, cache))


def constrain_inputs(lay: MeshLayout, hidden_states, positions, cache: AttentionCache):
    """The step's inputs constrained to `lay` (`step.sharded_attention_step`): hidden states,
    positions and every cache leaf batch-sharded (the cache's length as an int32 array)."""
    batch = lay.spec("batch")
    hidden_states = _constrain(lay, hidden_states, batch)
    positions = _constrain(lay, jnp.asarray(positions), batch)
    cache = _constrain_cache(lay, cache.replace(length=jnp.asarray(cache.length, jnp.int32)))
    return hidden_states, positions, cache


def constrain_outputs(lay: MeshLayout, out, cache: AttentionCache, intermediates):
    """The step's outputs constrained to `lay`: the output and every cache leaf batch-sharded,
    the intermediates' head axes split over ``"model"`` (`_INTERMEDIATE_AXES`)."""
    out = _constrain(lay, out, lay.spec("batch"))
    cache = _constrain_cache(lay, cache)
    if intermediates is not None:
        intermediates = intermediates.replace(**{
            f.name: _constrain(lay, getattr(intermediates, f.name),
                               lay.spec(*_INTERMEDIATE_AXES.get(f.name, ("batch",))))
            for f in dataclasses.fields(intermediates) if getattr(intermediates, f.name) is not None
        })
    return out, cache, intermediates


# ---------------------------------------------------------------------------- per-shard breaks
def run_per_shard(fn: Callable[..., Any], lay: MeshLayout, batched: Sequence[Any], shared: Sequence[Any] = (),
                  *, once: bool = False):
    """``fn(*batched, *shared)`` per batch shard: inside `shard_map` over the whole mesh.

    batched: pytrees of ``[B, ...]`` arrays, split along B over the batch axes; shared: pytrees
    passed whole to every shard (replicated); `fn` returns a pytree of ``[B_shard, ...]`` arrays,
    reassembled along B. `fn` sees per-shard shapes.

    Every mesh axis is manual (XLA runs a host callback only in a fully manual region), so `fn`
    runs on every device. With ``once`` (host callbacks), the devices of a batch shard that are
    replicas of each other (the ``"model"`` axis) run it on one of them: the others take zeros,
    and a ``psum`` over the replica axes hands everyone the result (``x + 0 == x``).
    """
    batch = lay.spec("batch")
    replicas = lay.replica_axes

    def body(*args):
        if not (once and replicas):
            return fn(*args)
        first = jax.lax.axis_index(replicas) == 0

        def skip(*xs):
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *xs))

        return jax.lax.psum(jax.lax.cond(first, fn, skip, *args), replicas)

    in_specs = tuple([batch] * len(batched) + [P()] * len(shared))
    mapped = jax.shard_map(body, mesh=lay.mesh, in_specs=in_specs, out_specs=batch)
    return mapped(*batched, *shared)


__all__ = [
    "DATA",
    "LOGICAL_AXIS_RULES",
    "MODEL",
    "MeshLayout",
    "cache_partition_specs",
    "constrain_inputs",
    "constrain_outputs",
    "make_mesh",
    "param_partition_specs",
    "run_per_shard",
    "shard_cache",
    "shard_layer",
]
