"""The layer's eager call: checks on the host, then the compiled step, then the host length mirror.

`DeepseekV4Attention.__call__` is `call`. Its first call of an input structure runs every check
of `validation.check_call`; the layer's memo (`_CallMemo`) remembers the (spec, step) of the
structures that passed, so a later call of the same structure runs only the value checks
(`validation.check_values`). Beside it: the device twins of the host length mirrors
(`_device_length`: the step gets back the length it returned instead of an upload of the
mirror), the `step_weights()` held with the probe of the parameters they were made from, and
`finite_guard`, the finite check of an accelerator input read after the step's dispatch.
Under a user's jit the call is traced: no memo, no mirror, the step runs as it is.
"""

from __future__ import annotations

import dataclasses
import operator
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.backend import is_tracer, to_host_memory
from dsv4_jax.cache import paged
from dsv4_jax.cache.contiguous import AttentionCache, advance_length, advance_rewindable
from dsv4_jax.layer import validation
from dsv4_jax.step import breaks, finite_flag, sharding
from dsv4_jax.step.pure_step import step_for, step_function


# ---------------------------------------------------------------------------- the finite guard
def finite_guard(hidden_states, dtype):
    """The finite check of an eager call's accelerator input, run as its own small program just
    before the step (`validation.finite_deferred`): (finite: bool scalar, written into pinned
    host memory (`backend.to_host_memory`), hidden_states with a non-finite input zeroed).
    Finite means finite in the compute `dtype` (static): the step casts to it first, and a value
    that overflows there is as poisonous as a NaN.

    The step runs on the guarded input, so nothing downstream (the native selection kernels, a
    host break) ever sees a NaN; the call reads the verdict after dispatching the step and, if
    it says so, drops the step's results and raises (the cache is not donated: unchanged). The
    step itself is the layer's ordinary one (no second compiled step for the check). On the
    H200 the call costs ~0.18 ms over the jitted step with this check, as it did with the
    verdict computed inside the step and read after it: one more program or one more host-memory
    read, ~0.13 ms either way (docs/breaks_and_kernels.md, "Why the kernels' defaults").
    """
    finite = jnp.all(jnp.isfinite(hidden_states.astype(dtype)))
    return to_host_memory(finite), jnp.where(finite, hidden_states, jnp.zeros((), hidden_states.dtype))


_FINITE_GUARD = jax.jit(finite_guard, static_argnums=1)
# The steps that a deferred finite check runs (not sharded, not donating; with and without the overlap).
_PLAIN_STEPS = frozenset(step_function(False, overlap=overlap, deterministic=deterministic)
                         for overlap in (False, True) for deterministic in (False, True))


# ---------------------------------------------------------------------------- the device lengths
# The device twin of each host length mirror an eager call made: id(mirror) -> (weak reference
# to the mirror, its values when made (a list of ints), the step's device length). A mirror
# changed in place, or one this layer did not make, is uploaded as before.
_DEVICE_LENGTHS: dict[int, tuple] = {}


def _remember_device_length(mirror: np.ndarray, device_length, values: list | None = None) -> None:
    key = id(mirror)
    _DEVICE_LENGTHS[key] = (weakref.ref(mirror, lambda _, k=key: _DEVICE_LENGTHS.pop(k, None)),
                            mirror.tolist() if values is None else values, device_length)


def _device_length(length, checked: list | None = None):
    """The device twin of the host mirror `length` where it still holds the values it was made
    with (`checked`: its values as the checks read them, else read here), else `length`."""
    hit = _DEVICE_LENGTHS.get(id(length)) if type(length) is np.ndarray else None
    if hit is None or hit[0]() is not length:
        return length
    if hit[1] != (length.tolist() if checked is None else checked):
        return length
    device = hit[2]
    return device if _usable(device) else length


def _usable(device_length) -> bool:
    """A remembered device length the step may take: not deleted (donated), and not a tracer.
    A tracer was made by a call under the user's own jit on a cache made inside it (a host
    mirror): outside that trace it is gone, and inside it the mirror serves as well."""
    return not is_tracer(device_length) and not getattr(device_length, "is_deleted", _not_deleted)()


def _not_deleted() -> bool:
    return False


def _with(cache: AttentionCache, layer_idx: int, length, rewindable=None) -> AttentionCache:
    """``cache.replace(layer_idx=..., length=...)`` (and `rewindable` where given) without
    `dataclasses.replace`'s field walk (a copy of the instance's fields; only for
    `AttentionCache` itself, which has no ``__post_init__``)."""
    extra = {} if rewindable is None else {"rewindable": rewindable}
    if type(cache) is not AttentionCache:
        return cache.replace(layer_idx=layer_idx, length=length, **extra)
    fields = cache.__dict__.copy()
    fields["layer_idx"] = layer_idx
    fields["length"] = length
    fields.update(extra)
    new = object.__new__(AttentionCache)
    object.__setattr__(new, "__dict__", fields)
    return new


# ---------------------------------------------------------------------------- the pages
# The host page tables a call checked: id(table) -> weak reference (a table is checked once).
_CHECKED_TABLES: dict[int, weakref.ref] = {}


def _with_pages_for(cache: AttentionCache, after: list, donate: bool = False) -> AttentionCache:
    """A paged cache holding the pages for `after` tokens a row (`paged.reserve_to`: a
    `ValueError` naming the pages needed and free if the pool is short; the caller's cache
    unchanged), its host page table checked first (`paged.check_pages`) unless this module
    made it or checked it before. `donate` (a layer that donates its cache to the step): the
    pages taken are zeroed in place, not in a copy of each pool."""
    table = cache.pages.table
    if isinstance(table, np.ndarray) and not _checked(table):
        paged.check_pages(cache.pages)
        _remember_checked(table)
    reserved = paged.reserve_to(cache, after, donate=donate)
    if reserved.pages.table is not table and isinstance(reserved.pages.table, np.ndarray):
        _remember_checked(reserved.pages.table)  # made by `reserve_to` from a checked one
    return reserved


def _checked(table: np.ndarray) -> bool:
    hit = _CHECKED_TABLES.get(id(table))
    return hit is not None and hit() is table


def _remember_checked(table: np.ndarray) -> None:
    key = id(table)
    _CHECKED_TABLES[key] = weakref.ref(table, lambda _: _CHECKED_TABLES.pop(key, None))


# ---------------------------------------------------------------------------- the memo
# Per-layer memos of the calls' static checks, outside the modules (NNX would otherwise treat
# them as part of the module's graph). Weak keys: they go with the layer.
_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_CALL_KEYS = 64  # input structures remembered per layer (then the memo starts over)


_LAYER_FIELDS = operator.attrgetter("config", "layer_idx", "layer_type", "options", "mesh")


def _layer_state(layer) -> tuple:
    """Everything of the layer that the static checks, the step's spec and its choice read,
    with the mesh of an enclosing ``jax.set_mesh`` (compared by equality, which is identity for
    unchanged attributes: a change of any of them starts the call memo over)."""
    return _LAYER_FIELDS(layer), (_context_mesh() if layer.mesh is None else None)


def _context_mesh():
    """`sharding.context_mesh()`, shorter where there is none: JAX sets the abstract mesh with
    every concrete one (`jax.set_mesh`, and its own jit and shard_map internals), so an empty
    abstract mesh means no context mesh."""
    if jax.sharding.get_abstract_mesh().empty:
        return None
    return sharding.context_mesh()


def _inputs_key(hidden_states, positions, return_intermediates) -> tuple | None:
    """The structure of a call's arrays (classes, shapes, dtypes) and options: all that
    `validation.check_call`'s static checks and the step's spec read of them. None for inputs
    the memo does not take (tracers, other types)."""
    concrete = validation._CONCRETE_TYPES
    if not ((type(hidden_states) in concrete or validation.is_concrete_array(hidden_states))
            and (type(positions) in concrete or validation.is_concrete_array(positions))):
        return None
    return (type(hidden_states), hidden_states.shape, hidden_states.dtype, type(positions), positions.shape,
            positions.dtype, bool(return_intermediates))


def _cache_key(cache) -> tuple | None:
    """The structure of a cache (its static fields, the class of its length, its arrays' shapes,
    dtype and mesh): all that the static checks, the spec and the step's choice read of it.
    None for anything but an `AttentionCache`."""
    # Every array's shape and dtype (`validation.cache_structure`): a cache crafted with one field
    # changed is a new structure, checked in full, never a hit of a good one.
    structure = validation.cache_structure(cache)
    if structure is None:
        return None
    placed = getattr(cache.window, "sharding", None)
    return structure, placed if isinstance(placed, jax.sharding.NamedSharding) else None


class _CallMemo:
    """A layer's memo of its eager calls: the layer state it holds for (`_layer_state`), the
    (spec, step) of each input structure whose static checks passed, and the cache the last
    call returned (weak reference, its structure key, its length mirror's values, the step's
    device length), so that the next call on it skips reading the cache's structure again; and
    the `step_weights()` with the probe of the parameters it was made from."""

    __slots__ = ("entries", "last", "state", "weights")

    def __init__(self, state):
        self.state, self.entries, self.last = state, {}, None
        self.weights = None  # (the `weights()` probe, the `step_weights()` of that pytree)


# ---------------------------------------------------------------------------- the call
def call(layer, hidden_states, positions, cache: AttentionCache, return_intermediates: bool = False):
    """`layer(hidden_states, positions, cache, return_intermediates=...)` (see
    `DeepseekV4Attention.__call__`): the checks (the full ones for a new input structure, the
    value checks for one the memo holds), then `_run`, or under a user's jit the step traced."""
    if positions is None:
        positions = validation.positions_from_cache(layer, hidden_states, cache)
    memo = _CALLS.get(layer)
    if memo is not None:
        last = memo.last
        last = last if last is not None and last[0]() is cache else None  # the cache it returned
        inputs = _inputs_key(hidden_states, positions, return_intermediates)
        structure = last[1] if last is not None else _cache_key(cache)
        if inputs is not None and structure is not None and memo.state == _layer_state(layer):
            hit = memo.entries.get((inputs, structure))
            if hit is not None:  # the static checks passed for this structure: the value checks only
                if last is None and validation.donated(cache):  # (the cache it returned is live)
                    validation.reject_donated()
                finite = validation.finite_mode(layer)
                deferred = hit[1] in _PLAIN_STEPS and validation.finite_deferred(hidden_states, finite)
                before, after = validation.check_values(hidden_states, positions, cache.length,
                                                        cache.max_seq_len, False if deferred else finite,
                                                        hit[0].dtype)
                if last is not None and last[2] == before and _usable(last[3]):
                    device_length = last[3]  # the mirror still holds what the step returned
                else:
                    device_length = _device_length(cache.length, before)
                return _run(layer, memo, hit, hidden_states, positions, cache, return_intermediates,
                            before, after, device_length, deferred)
    structure = _cache_key(cache)
    inputs = None if structure is None else _inputs_key(hidden_states, positions, return_intermediates)
    state = None if inputs is None else _layer_state(layer)
    # An accelerator input's finite check may be read after dispatch (decided below, once the
    # step is known): the value checks before dispatch leave it out, the same checks in the same order.
    finite = validation.finite_mode(layer)
    deferred = not layer.donate_cache and validation.finite_deferred(hidden_states, finite)
    spec, host_length, new_tokens = validation.check_call(layer, hidden_states, positions, cache,
                                                          return_intermediates, False if deferred else None)
    if host_length is None and layer.checkify:  # traced: the value checks go into the step
        spec = dataclasses.replace(spec, checks=True)
    if spec.plan.layout is None and host_length is not None and sharding.mesh_of(cache) is not None:
        # An eager call on a cache sharded over a mesh the layer was not told about: run on
        # that mesh (its breaks per batch shard) rather than gather the batch for them.
        layout = sharding.layout(layer.config, sharding.mesh_of(cache), layer.sharding_rules)
        spec = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, layout=layout))
    if spec.plan.layout is not None:
        sharding.check_batch(spec.plan.layout, hidden_states.shape[0])
    step = step_for(spec, layer.donate_cache)
    if host_length is None:
        # Traced: the layer index is checked above and is no part of the computation. The
        # enclosing jit's compile options hold (JAX refuses a nested jit with its own).
        step = step_function(layer.donate_cache, sharded=spec.plan.layout is not None)
        with breaks.surface_host_errors():  # an exception on the host arrives as HostBreakError
            anonymous = cache.replace(layer_idx=-1, length=_device_length(cache.length))
            out, new_cache, intermediates = step(layer.step_weights(), anonymous, hidden_states, positions,
                                                 spec=spec)
        new_cache = new_cache.replace(layer_idx=cache.layer_idx)
        return (out, new_cache, intermediates) if return_intermediates else (out, new_cache)
    if state is not None:  # remember what passed: the next call of this structure checks values only
        if memo is None or memo.state != state or len(memo.entries) >= _MAX_CALL_KEYS:
            memo = _CALLS[layer] = _CallMemo(state)
        memo.entries[(inputs, structure)] = (spec, step)
    if deferred and step not in _PLAIN_STEPS:  # a sharded step: the check before dispatch after all
        validation.check_finite("hidden_states", hidden_states, finite, spec.dtype)
        deferred = False
    before = host_length.tolist()
    after = advance_length(host_length, new_tokens).tolist()
    return _run(layer, memo, (spec, step), hidden_states, positions, cache, return_intermediates, before, after,
                _device_length(cache.length, before), deferred)


def _run(layer, memo, run, hidden_states, positions, cache: AttentionCache, return_intermediates,
         before: list, after: list, device_length, finite_deferred: bool = False):
    """Run the checked eager call: the compiled step, then the host length mirror.

    `run`: (spec, step); `before`/`after`: the lengths the checks read and the lengths after
    the call (lists); `device_length`: what the step gets for the length (the device twin of
    the mirror where there is one, else the mirror); `finite_deferred`: the finite check read
    after dispatch (the step is the non-donating one): the step flagged (`finite_flag`) where
    that is the verdict's way, else `finite_guard` first and the step on its output; then the
    finite check's error, the results dropped, if the verdict says so."""
    spec, step = run
    if cache.pages is not None:  # a paged cache: the pages this call's tokens need, taken now
        cache = _with_pages_for(cache, after, layer.donate_cache)
    # The layer index is checked and is no part of the computation: leave it out of the
    # compiled step's identity, so that layers of one type share one program.
    # The step gets the device copy of the host length mirror where this layer made one
    # (uploading the NumPy mirror would cost more dispatch time than the checks save).
    # A cache with a rewind history: its count of rewindable tokens is a host mirror too.
    rewindable = cache.rewindable
    anonymous = _with(cache, -1, device_length, None if rewindable is None else _device_length(rewindable))
    held = None if memo is None else memo.weights
    if held is not None and held[0].holds():
        weights = held[1]  # what `step_weights()` returns while the probe holds, without its lookups
    else:
        probe, weights = layer._probed_step_weights()
        if memo is not None:
            memo.weights = None if probe is None else (probe, weights)
    try:
        slot = finite_flag.slot_for(hidden_states) if finite_deferred else None
        if slot is not None:  # the step writes the verdict where the host polls it
            out, new_cache, intermediates, finite = finite_flag.run_flagged(
                slot, step, weights, anonymous, hidden_states, positions, finite_flag.flagged_spec(spec))
        else:
            step_input = hidden_states
            if finite_deferred:
                finite, step_input = _FINITE_GUARD(hidden_states, spec.dtype)
            out, new_cache, intermediates = step(weights, anonymous, step_input, positions, spec=spec)
    except Exception:
        with breaks.surface_host_errors():  # an exception on the host arrives as HostBreakError
            raise
    # The host mirror of the step's new length (see `dsv4_jax.cache.contiguous`): the next call's
    # checks need no device round trip; the step's own length is kept beside it.
    # (This runs while the device computes.)
    mirror = np.array(after, np.int32)
    if finite_deferred and not bool(finite):  # nothing of the call is kept: the cache is the caller's
        validation.reject_non_finite("hidden_states", hidden_states, ran=True, dtype=spec.dtype)
    device_length = new_cache.length
    _remember_device_length(mirror, device_length, after)
    rewindable_mirror = None
    if rewindable is not None:  # advanced by the step's rule (`advance_rewindable`), on the host
        rewindable_mirror = advance_rewindable(np.asarray(rewindable, np.int32), mirror - np.asarray(before, np.int32),
                                               max_rewind=cache.max_rewind)
        _remember_device_length(rewindable_mirror, new_cache.rewindable)
    new_cache = _with(new_cache, cache.layer_idx, mirror, rewindable_mirror)
    if cache.pages is not None:  # the step leaves the table as it was: keep the host one
        new_cache = new_cache.replace(pages=cache.pages)
    if memo is not None:
        structure = _cache_key(new_cache)
        memo.last = None if structure is None else (weakref.ref(new_cache), structure, after, device_length)
    if return_intermediates:
        return out, new_cache, intermediates
    return out, new_cache
