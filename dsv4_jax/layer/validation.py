"""Input checks of `DeepseekV4Attention.__call__`, run on the host before anything is dispatched.

Every rejection is a `TypeError` (wrong kind or dtype) or `ValueError` (wrong shape or value)
whose message names the argument, what was expected and what came. Nothing reaches the
device before all checks pass, so a rejected call leaves the caller's cache untouched.

Checks that need values (positions continue the cache row by row, padded slots (-1) only
after a row's real tokens, room is left, hidden_states are finite) run when the values are
concrete; under a user's `jax.jit` they are tracers and only
shapes and dtypes are checked.

A layer runs these checks in full for the first call of each input structure (the classes,
shapes and dtypes of the arrays, the cache's static fields and array shapes, the layer's
options); it remembers the structures that passed, and a later call of the same structure
runs only the value checks (`check_values`), with the same rules, errors and order.

Non-finite hidden_states (NaN, +-inf) are rejected: let through, they would be written into
the window and compressor caches and poison every later call. The check is a host scan for
NumPy and host-resident inputs (about 2 us for a decode token of 4096 values). An accelerator
array is checked by a small program dispatched just before the step (`finite_deferred`,
`call_path.finite_guard`): it writes its verdict into pinned host memory and zeroes such an
input, the step runs on its output, and the call reads the verdict once the step is
dispatched, drops the results and raises the same error (the cache passed in is untouched;
~0.13 ms a call on an H200), or, with ``finite_flag.VERDICT = "flag"``, the step computes the
verdict itself and writes it into host memory the call polls (`dsv4_jax.step.finite_flag`). A
layer that donates its cache cannot drop a call's results, so there the check stays one jitted
`isfinite().all()` reduction and its read before dispatch (on an H200, V4-Flash decode, +0.4-0.5
ms per call; docs/misuse.md has the measurements). It is
set per layer by ``DeepseekV4Attention(..., check_finite=...)`` / the attribute
``attn.check_finite`` (None: the module-level `CHECK_FINITE`, True unless changed):

* ``True``    check every concrete input (the default);
* ``"host"``  check NumPy (host) inputs only, let device arrays through unchecked;
* ``False``   no check: NaN/inf propagate into the output *and the cache*.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.backend import is_tracer
from dsv4_jax.cache import paged
from dsv4_jax.cache.contiguous import AttentionCache, advance_length, init_attention_cache, next_positions
from dsv4_jax.cache.quantized import check_cache_numerics, is_quantized
from dsv4_jax.config import CSA, HCA

CHECK_FINITE_MODES = (True, "host", False)
CHECK_FINITE: bool | str = True  # the default of `attn.check_finite` (see the module docstring)


def check_float_dtype(name: str, dtype: Any, allow_none: bool = False):
    if dtype is None and allow_none:
        return None
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}: expected a floating dtype, got {dtype!r}") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name}: expected a floating dtype, got {dt}")
    return dt


def _shape_dtype(name: str, value: Any):
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"{name}: expected an array, got {type(value).__name__}")
    return tuple(shape), jnp.dtype(dtype)


def cache_structure(cache: Any) -> tuple | None:
    """The static fields of a cache and the class, shape and dtype of each of its arrays (a
    hashable key; None for anything but an `AttentionCache` holding array-likes)."""
    if type(cache) is not AttentionCache:
        return None
    try:
        window, length = cache.window, cache.length
        key = (type(length), length.shape, length.dtype, cache.layer_idx, cache.layer_type, cache.max_seq_len,
               cache.numerics, type(window), window.shape, window.dtype, _state_key(cache.compressor),
               _state_key(cache.indexer), _rewind_key(cache), _pages_key(cache.pages))
        hash(key)
    except Exception:  # not arrays where the cache holds them: the checks word it
        return None
    return key


def _pages_key(pages) -> tuple | None:
    """A page table's page size and its arrays' classes, shapes and dtypes (None: contiguous)."""
    if pages is None:
        return None
    return (pages.page_size, type(pages.table), pages.table.shape, pages.table.dtype, type(pages.refs),
            pages.refs.shape, pages.refs.dtype)


def _state_key(state) -> tuple | None:
    """The shapes and dtypes of a compressor state's arrays (None for no state)."""
    if state is None:
        return None
    entries, buffer, history = state.entries, state.buffer, state.history
    return (type(entries), entries.shape, entries.dtype, buffer.shape, buffer.dtype,
            None if history is None else (history.shape, history.dtype))


def _rewind_key(cache) -> tuple | None:
    """The shapes and dtypes of a cache's rewind history and count (None without them)."""
    history, count = cache.window_history, cache.rewindable
    if history is None and count is None:
        return None
    return (type(history), getattr(history, "shape", None), getattr(history, "dtype", None), type(count),
            getattr(count, "shape", None), getattr(count, "dtype", None))


# (config, layer index, numerics, `cache_structure`) of the caches `check_cache` accepted: the
# same structure again needs only the donation check (a decode loop with positions=None checks
# its cache every call).
_ACCEPTED: dict = {}


def check_cache(attn, cache: Any) -> None:
    """The cache belongs to this layer: index, type, the numerics it was filled under, and every
    field of the pytree (`length` [B] int, the window, the compressor and indexer states, the
    FP8 rows' parts) of the shape and dtype that this layer's ``init_cache(B, max_seq_len,
    dtype=cache.dtype)`` makes (`expected_cache`). The cache's own dtype against the layer's
    compute dtype is `check_call`'s (a `TypeError`)."""
    cfg = attn.config
    if not isinstance(cache, AttentionCache):
        raise TypeError(
            f"cache: expected an AttentionCache from attn.init_cache(...), got {type(cache).__name__}"
        )
    structure = cache_structure(cache)
    accepted = None if structure is None else (attn.config, attn.layer_idx, attn.numerics, structure)
    if accepted is not None and accepted in _ACCEPTED:
        if donated(cache):
            reject_donated()
        return
    if (cache.layer_idx, cache.layer_type) != (attn.layer_idx, attn.layer_type):
        raise ValueError(
            f"cache: expected the cache of layer {attn.layer_idx} ({attn.layer_type}), got the cache of "
            f"layer {cache.layer_idx} ({cache.layer_type})"
        )
    if any(map(_deleted, jax.tree.leaves(cache))):
        reject_donated()
    want_window = (cfg.sliding_window, cfg.head_dim)
    if tuple(cache.window.shape[1:]) != want_window:
        raise ValueError(
            f"cache.window: expected shape [B, {want_window[0]}, {want_window[1]}] for this config, "
            f"got {list(cache.window.shape)} (a cache made for another config?)"
        )
    expect = {CSA: ("compressor", "indexer"), HCA: ("compressor",)}.get(attn.layer_type, ())
    for part in ("compressor", "indexer"):
        present = getattr(cache, part) is not None
        if present != (part in expect):
            raise ValueError(
                f"cache.{part}: expected {'a compressor state' if part in expect else 'None'} for a "
                f"{attn.layer_type} layer, got {'a state' if present else 'None'}"
            )
    check_cache_numerics(cache, attn.numerics)
    max_seq_len = cache.max_seq_len
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, (int, np.integer)) or max_seq_len < 1:
        raise ValueError(f"cache.max_seq_len: expected a positive int, got {max_seq_len!r}")
    batch = cache.window.shape[0] if len(getattr(cache.window, "shape", ())) == 3 else None
    length = cache.length
    l_shape, l_dtype = _shape_dtype("cache.length", length)
    if batch is None or l_shape != (batch,) or not jnp.issubdtype(l_dtype, jnp.integer):
        raise ValueError(
            f"cache.length: expected int32 [B] with B = {batch} (the window's batch), got {l_dtype}{list(l_shape)}")
    dtype = cache.dtype
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise TypeError(f"cache.window: expected a floating dtype, got {dtype}")
    pages = cache.pages
    paging = {} if pages is None else {"page_size": pages.page_size, "num_pages": int(np.shape(pages.refs)[0])}
    expected = expected_cache(attn.config, attn.layer_idx, batch, int(max_seq_len), jnp.dtype(dtype),
                              "fp8" if is_quantized(cache) else "auto", _history_slots(cache), **paging)
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(cache.replace(length=None))
    want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(
        expected.replace(length=None, numerics=cache.numerics))  # the numerics: checked above
    if got_tree != want_tree:
        raise ValueError(f"cache: expected the pytree that attn.init_cache makes ({want_tree}), got {got_tree}")
    for (path, got), (_, want) in zip(got_leaves, want_leaves):
        g_shape, g_dtype = _shape_dtype(f"cache{jax.tree_util.keystr(path)}", got)
        if g_shape != tuple(want.shape) or g_dtype != want.dtype:
            raise ValueError(
                f"cache{jax.tree_util.keystr(path)}: expected {want.dtype}{_dims(want.shape)} for this config "
                f"(what attn.init_cache({batch}, {max_seq_len}) makes for layer {attn.layer_idx}), got "
                f"{g_dtype}{list(g_shape)} (a cache made for another config?)")
    if accepted is not None:
        if len(_ACCEPTED) > 256:
            _ACCEPTED.clear()
        _ACCEPTED[accepted] = True


def _dims(shape) -> str:
    return "[B, " + ", ".join(map(str, shape[1:])) + "]"


def _history_slots(cache) -> int:
    """The `max_rewind` a cache was made with, as far as its window history tells (0 without
    one; a history of another form is then refused against the expected pytree)."""
    shape = getattr(cache.window_history, "shape", None)
    return int(shape[1]) if shape is not None and len(shape) == 3 else 0


@functools.lru_cache(maxsize=64)
def expected_cache(cfg, layer_idx: int, batch: int, max_seq_len: int, dtype, kv_cache_dtype: str,
                   max_rewind: int = 0, page_size: int | None = None,
                   num_pages: int | None = None) -> AttentionCache:
    """The shapes and dtypes (`jax.ShapeDtypeStruct` leaves) of the cache that `init_cache` makes
    for layer `layer_idx` of `cfg`: the one complete spec a cache is checked against."""
    return jax.eval_shape(lambda: init_attention_cache(cfg, layer_idx, batch, max_seq_len, dtype,
                                                       allow_long_context=True, kv_cache_dtype=kv_cache_dtype,
                                                       max_rewind=max_rewind, page_size=page_size,
                                                       num_pages=num_pages))


def _deleted(value: Any) -> bool:
    return isinstance(value, jax.Array) and not is_tracer(value) and value.is_deleted()


def donated(cache: AttentionCache) -> bool:
    """Whether the cache's arrays were consumed (donated to an earlier call): its window tells
    (a step's donation deletes every array of the cache together), and a paged cache's pools
    (`fork_rows` / `reserve_pages` with ``donate=True`` consume the pools alone)."""
    window = cache.window
    return _deleted(getattr(window, "values", window)) or (cache.pages is not None and paged.pools_consumed(cache))


def reject_donated() -> None:
    raise ValueError(
        "cache: expected a live cache, got one whose arrays were donated to an earlier call (a layer with "
        "donate_cache=True consumes the cache passed in, even the call's own, so that XLA updates it in place; "
        "fork_rows and reserve_pages with donate=True consume a paged cache's pools); pass the cache that call "
        "returned, or set donate_cache=False to keep the caller's cache")


def check_hidden_states(attn, hidden_states: Any) -> tuple:
    """An array of a floating dtype, shaped [B, S, hidden] with S >= 1; returns (shape, dtype)."""
    h_shape, h_dtype = _shape_dtype("hidden_states", hidden_states)
    if not jnp.issubdtype(h_dtype, jnp.floating):
        raise TypeError(f"hidden_states: expected a floating dtype, got {h_dtype}")
    hidden = attn.config.hidden_size
    if len(h_shape) != 3 or h_shape[-1] != hidden or h_shape[1] < 1:
        raise ValueError(f"hidden_states: expected shape [B, S, {hidden}] with S >= 1, got {list(h_shape)}")
    return h_shape, h_dtype


def positions_from_cache(attn, hidden_states: Any, cache: Any):
    """A call's positions where it passed None: every row's next S positions from the cache's
    length (`cache.next_positions`); the host mirror's values in an eager call (then the call
    checks them like any others), the traced length's under a jit. A malformed input raises
    the error `check_call` would raise for it, naming the input rather than the positions."""
    h_shape, _ = check_hidden_states(attn, hidden_states)
    check_cache(attn, cache)
    length = cache.length
    if not is_tracer(length):
        length = np.asarray(length, np.int32)  # the host mirror (an eager call reads it anyway)
    if getattr(length, "ndim", None) != 1:
        raise ValueError(f"cache.length: expected shape [B], got {list(np.shape(length))}")
    return next_positions(length, h_shape[1])


def check_call(attn, hidden_states: Any, positions: Any, cache: Any, return_intermediates: bool,
               finite: bool | str | None = None):
    """Validate one call; returns (the StepSpec to run, the length it checked, the call's real
    tokens per row), the last two None while tracing (the length is then the step's own).
    `finite`: the finite check's mode, None for the layer's (False where the caller reads the
    check after the step's dispatch, `finite_deferred`).

    The length is the host value the checks ran against (int32 NumPy [B]); the caller's host
    mirror of the new length is `cache.advance_length` of it by the real tokens per row (int32
    [B], `cache.real_tokens(positions)` as the checks found it; see `dsv4_jax.cache.contiguous`)."""
    h_shape, _ = check_hidden_states(attn, hidden_states)
    batch, seq = h_shape[:2]
    p_shape, p_dtype = _shape_dtype("positions", positions)
    if not jnp.issubdtype(p_dtype, jnp.integer):
        raise TypeError(f"positions: expected an integer dtype (int32), got {p_dtype}")
    if p_shape != (batch, seq):
        raise ValueError(f"positions: expected shape [B, S] = {[batch, seq]}, got {list(p_shape)}")
    check_cache(attn, cache)
    if cache.batch_size != batch:
        raise ValueError(
            f"hidden_states: expected batch size {cache.batch_size} (the cache's), got {batch}"
        )
    spec = attn.step_spec(return_intermediates)
    if jnp.dtype(cache.dtype) != spec.dtype:
        raise TypeError(
            f"cache: expected dtype {spec.dtype} (the layer's compute dtype), "
            f"got {cache.dtype}; make it with attn.init_cache(..., dtype={spec.dtype})"
        )

    if is_tracer(positions) or is_tracer(cache.length):
        return spec, None, None  # values unknown while tracing: shapes and dtypes were checked
    if finite is None:
        finite = finite_mode(attn)
    before, after = check_values(hidden_states, positions, cache.length, cache.max_seq_len, finite, spec.dtype)
    length = np.array(before, np.int32)
    return spec, length, np.array(after, np.int32) - length


def check_values(hidden_states: Any, positions: Any, length: Any, max_seq_len: int,
                 finite: bool | str, dtype: Any = None) -> tuple[list, list]:
    """The value checks of `check_call` alone, for a call whose shapes, dtypes and cache
    `check_call` accepted before (the layer's memo of them; concrete inputs): positions by
    `check_positions`'s rules, then `check_finite` with mode `finite` in the compute `dtype`.
    Same errors, same order.

    Returns (the lengths the checks read, the lengths after the call), lists of B ints: the
    values of `check_call`'s checked length and of ``advance_length`` of it by the real tokens.

    A call whose rows each continue their length (dense, or ragged for small calls) with room
    left is accepted on Python lists (B x S <= `_SMALL`) or with two NumPy operations (a dense
    call); anything else (a rejection included) goes through `check_positions`, which words it.
    """
    pos = positions if type(positions) is np.ndarray else np.asarray(positions)
    host = length if type(length) is np.ndarray else np.asarray(length)
    before = after = None
    if (host.dtype == _INT32 and host.ndim == 1 and pos.ndim == 2 and host.shape[0] == pos.shape[0]
            and pos.shape[1] > 0):
        batch, seq = pos.shape
        before = host.tolist()
        if batch * seq <= _SMALL:
            after = _continue_rows(pos.tolist(), before, seq, max_seq_len)
        else:
            after = _continue_dense(pos, host, before, seq, max_seq_len)
    if after is None:
        checked = host.astype(np.int64)
        new_tokens = check_positions(pos.astype(np.int64), checked, max_seq_len)
        checked = checked.astype(np.int32)
        before, after = checked.tolist(), advance_length(checked, new_tokens.astype(np.int32)).tolist()
    check_finite("hidden_states", hidden_states, finite, dtype)
    return before, after


_INT32 = np.dtype(np.int32)
_SMALL = 64  # calls of at most this many positions are checked on Python lists (no NumPy calls)
_ARANGE: dict[int, np.ndarray] = {}


def _continue_rows(rows: list, starts: list, seq: int, max_seq_len: int) -> list | None:
    """The lengths after the call if `check_positions` accepts it, else None (then it decides).

    Row b accepted: its first n values are ``starts[b], starts[b] + 1, ...``, the rest -1,
    ``starts[b] >= 0`` and ``starts[b] + n <= max_seq_len``; and some row has n > 0."""
    after = []
    real = False
    for row, start in zip(rows, starts):
        if start < 0:
            return None
        if row[0] == start and row[-1] == start + seq - 1 and (seq <= 2 or row == list(range(start, start + seq))):
            n = seq
        else:
            n = 0
            for value in row:
                if value != start + n:
                    break
                n += 1
            if row.count(-1) != seq - n:  # the first n are >= 0: the rest must all be padding
                return None
        if start + n > max_seq_len:
            return None
        real = real or n > 0
        after.append(start + n)
    return after if real else None


def _continue_dense(pos: np.ndarray, length: np.ndarray, starts: list, seq: int, max_seq_len: int) -> list | None:
    """As `_continue_rows`, for a dense call (every slot real) of any size; None otherwise."""
    if min(starts) < 0 or max(starts) + seq > max_seq_len:
        return None
    steps = _ARANGE.get(seq)
    if steps is None:
        steps = _ARANGE[seq] = np.arange(seq, dtype=np.int64)[None, :]
        steps.flags.writeable = False
        if len(_ARANGE) > 64:
            _ARANGE.clear()
            _ARANGE[seq] = steps
    if not (pos == length[:, None] + steps).all():
        return None
    return [start + seq for start in starts]


def check_positions(pos: np.ndarray, length: np.ndarray, max_seq_len: int) -> np.ndarray:
    """The value rules of a call's positions [B, S] against the cache's lengths [B] (host);
    returns the real tokens per row [B]. `check_in_graph` is the in-graph twin (same rules,
    same messages).

    Row b holds ``n_b`` real tokens ``length[b] .. length[b] + n_b - 1`` first, then padded
    slots at -1 (a ragged batch; ``n_b = 0`` is a row with nothing in this call); at least one
    row of the call has a real token; and ``length[b] + n_b <= max_seq_len``.
    """
    batch, seq = pos.shape
    low = pos < -1
    if low.any():
        b = int(np.argwhere(low)[0][0])
        raise ValueError(f"positions: expected values >= 0, or -1 for padded slots, got row {b} = {_preview(pos[b])}")
    real = pos >= 0
    count = real.sum(axis=1)
    mixed = real != (np.arange(seq)[None, :] < count[:, None])
    if mixed.any():
        b = int(np.argwhere(mixed)[0][0])
        raise ValueError(
            f"positions: expected row {b}'s real tokens first, then its padded slots (-1), got {_preview(pos[b])}"
        )
    if not count.any():
        raise ValueError(
            f"positions: expected at least one real token (>= 0) in the call, got only padded slots (-1) in "
            f"all {batch} rows"
        )
    expected = length[:, None] + np.arange(seq)[None, :]
    wrong = real & (pos != expected)
    if wrong.any():
        b = int(np.argwhere(wrong)[0][0])
        start, n = int(length[b]), int(count[b])
        raise ValueError(
            f"positions: expected row {b} to continue the cache at {start} ({start} .. {start + n - 1}), "
            f"got {_preview(pos[b])}"
        )
    over = length + count > max_seq_len
    if over.any():
        b = int(np.argwhere(over)[0][0])
        held = int(length[b])
        raise ValueError(
            f"hidden_states: expected at most {max_seq_len - held} new tokens (the cache holds {held} of "
            f"max_seq_len={max_seq_len}), got {int(count[b])}" + (f" in row {b}" if batch > 1 else "")
        )
    return count


# Finite after the cast to the compute dtype (static): what the step computes on.
_all_finite = jax.jit(lambda x, dtype: jnp.isfinite(x.astype(dtype)).all(), static_argnums=1)


def _on_cpu(value: jax.Array) -> bool:
    try:
        return all(d.platform == "cpu" for d in value.devices())
    except Exception:  # a deleted or otherwise unreadable array: let the reduction report it
        return False


# sharding -> whether its devices are all CPUs (`_on_cpu`), so that a call asks once per sharding;
# and the last sharding asked about with its answer (consecutive calls often share the object).
_CPU_SHARDINGS: dict = {}
_LAST_SHARDING: tuple = (None, False)


def _host_resident(value: jax.Array) -> bool:
    """`_on_cpu(value)`, remembered per sharding (equal shardings have the same devices)."""
    global _LAST_SHARDING
    try:
        if value.is_deleted():
            return False
        sharding = value.sharding
        last = _LAST_SHARDING
        if sharding is last[0]:
            return last[1]
        cpu = _CPU_SHARDINGS.get(sharding)
    except Exception:  # an array without these, or an unhashable sharding: ask the array
        return _on_cpu(value)
    if cpu is None:
        if len(_CPU_SHARDINGS) > 64:
            _CPU_SHARDINGS.clear()
        cpu = _CPU_SHARDINGS[sharding] = _on_cpu(value)
    _LAST_SHARDING = (sharding, cpu)
    return cpu


_LIST_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))  # whose .tolist() gives Python floats
_LIST_MAX = 128  # arrays of at most this many values are summed as Python floats


def as_computed(host: np.ndarray, dtype: Any) -> np.ndarray:
    """`host` as the step computes on it: converted the way JAX converts a NumPy input (float64
    to float32 unless x64 is on), then cast to the compute `dtype` (None: as it is). A value
    finite in its own dtype may overflow to inf here (1e39 into float32, 1e5 into float16)."""
    if dtype is None or _overflow_limit(host.dtype, dtype) is None:
        return host
    with np.errstate(over="ignore", invalid="ignore"):
        return host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False).astype(dtype)


@functools.lru_cache(maxsize=64)
def _overflow_limit(source: Any, dtype: Any) -> float | None:
    """The largest value of `dtype` where a finite value of dtype `source` may become inf when
    cast to it (a narrower range), else None. Values of at most this magnitude stay finite
    through any rounding on the way."""
    source, dtype = np.dtype(source), np.dtype(dtype)
    if source == dtype or not jnp.issubdtype(source, jnp.floating):
        return None
    limit = float(jnp.finfo(dtype).max)
    return limit if limit < float(jnp.finfo(source).max) else None


def _finite_on_host(host: np.ndarray, dtype: Any = None) -> bool:
    """Whether every value of `host` is finite in the compute `dtype` (`as_computed`). A small
    float32/float64 array is summed as Python floats (double precision: NaN and inf propagate,
    finite float32 values cannot overflow, no NumPy call) and, where the cast may overflow, its
    largest magnitude compared with the dtype's largest value; only where these do not settle
    it are the values cast and scanned."""
    limit = None if dtype is None else _overflow_limit(host.dtype, dtype)
    if host.size <= _LIST_MAX and host.dtype in _LIST_DTYPES:
        values = host.ravel().tolist()
        if math.isfinite(sum(values)) and (limit is None or max(map(abs, values), default=0.0) <= limit):
            return True
    elif limit is not None and host.size and float(np.abs(host).max()) <= limit:  # NaN compares False
        return True
    return bool(np.isfinite(as_computed(host, dtype)).all())


# The array classes whose instances are concrete (never tracers): NumPy's and the jax.Array
# implementations met so far (learned; whether an object is a tracer is a matter of its class).
_CONCRETE_TYPES: set = {np.ndarray}
_JAX_TYPES: set = set()  # the concrete jax.Array classes among them


def is_concrete_array(value: Any) -> bool:
    """Whether `value` is a NumPy array or a concrete `jax.Array` (not a tracer), by its class."""
    kind = type(value)
    if kind in _CONCRETE_TYPES:
        return True
    if isinstance(value, (np.ndarray, jax.Array)) and not is_tracer(value):
        _CONCRETE_TYPES.add(kind)
        return True
    return False


def finite_mode(attn) -> bool | str:
    """The layer's finite-check mode: `attn.check_finite`, or `CHECK_FINITE` where that is None."""
    return CHECK_FINITE if attn.check_finite is None else attn.check_finite


def check_finite_mode(mode: Any) -> None:
    if not (mode is None or mode is True or mode is False or (isinstance(mode, str) and mode == "host")):
        raise ValueError(f"check_finite: expected one of {(None, *CHECK_FINITE_MODES)}, got {mode!r}")


def _learn_jax_type(kind: type) -> bool:
    _JAX_TYPES.add(kind)
    return True


def check_finite(name: str, value: Any, mode: bool | str = True, dtype: Any = None) -> None:
    """Reject NaN/inf in a concrete array (see the module docstring for `mode` and the cost),
    after its cast to the compute `dtype` (None: in its own dtype): a value that overflows the
    dtype the step computes in is as non-finite as a NaN there."""
    if mode is not True:
        check_finite_mode(mode)
        if mode is False:
            return
    kind = type(value)  # the common inputs first, by class: a NumPy array, a jax.Array
    if kind is np.ndarray:
        host = value
    elif kind in _JAX_TYPES or (not is_tracer(value) and isinstance(value, jax.Array) and _learn_jax_type(kind)):
        if mode == "host":
            return
        # A host-resident array is read in place (no dispatch of a reduction, no transfer);
        # a device array is reduced on its device and only the verdict comes back.
        if not _host_resident(value):
            if bool(_all_finite(value, value.dtype if dtype is None else jnp.dtype(dtype))):
                return
            host = None
        else:
            host = np.asarray(value)
    elif is_tracer(value):
        return
    else:
        host = np.asarray(value)
    if host is not None and _finite_on_host(host, dtype):
        return
    reject_non_finite(name, value, dtype=dtype)


def finite_deferred(value: Any, mode: bool | str) -> bool:
    """Whether the finite check of `value` under `mode` is one to read after dispatch (a
    concrete `jax.Array` on an accelerator, mode True): a small program computes the verdict
    into pinned host memory and zeroes a non-finite input just before the step runs on it
    (`call_path.finite_guard`), and the call reads the verdict once the step is dispatched,
    instead of waiting for a reduction's device round trip before dispatch. NumPy and
    host-resident inputs are scanned on the host."""
    if mode is not True:
        return False
    kind = type(value)
    if kind not in _JAX_TYPES:
        if is_tracer(value) or not isinstance(value, jax.Array):
            return False
        _learn_jax_type(kind)
    return not _host_resident(value)


def reject_non_finite(name: str, value: Any, ran: bool = False, dtype: Any = None) -> None:
    """Raise the finite check's ValueError for `value` (read on the host), which holds a NaN/inf
    in the compute `dtype` (None: its own); `ran`: the step ran on it (a check read after
    dispatch) and its results were dropped."""
    host = np.asarray(value)
    computed = as_computed(host, dtype)
    bad = ~np.isfinite(computed)
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    outcome = "its results were discarded" if ran else "the call was not run"
    where = f"{host[first]}"
    if np.isfinite(host[first]):
        where += f", which is {computed[first]} in the compute dtype {np.dtype(dtype)}"
    raise ValueError(
        f"{name}: expected finite values, got {int(bad.sum())} non-finite of {host.size} (first at "
        f"{list(first)}: {where}); {outcome}, the cache is unchanged"
    )


def _preview(row: np.ndarray) -> str:
    values = row.tolist()
    return str(values) if len(values) <= 8 else f"[{values[0]}, {values[1]}, ..., {values[-1]}]"
