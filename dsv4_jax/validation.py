"""Input checks of `DeepseekV4Attention.__call__`, run on the host before anything is dispatched.

Every rejection is a `TypeError` (wrong kind or dtype) or `ValueError` (wrong shape or value)
whose message names the argument, what was expected and what came. Nothing reaches the
device before all checks pass, so a rejected call leaves the caller's cache untouched.

Checks that need values (positions continue the cache row by row, padded slots (-1) only
after a row's real tokens, room is left, hidden_states are finite) run when the values are
concrete; under a user's `jax.jit` they are tracers and only
shapes and dtypes are checked.

Non-finite hidden_states (NaN, +-inf) are rejected before dispatch: let through, they would
be written into the window and compressor caches and poison every later call. The check is
a host scan for NumPy inputs (about 2 us for a decode token of 4096 values) and one jitted
`isfinite().all()` reduction plus a device sync for `jax.Array` inputs (about 40 us on CPU;
on an H200, V4-Flash decode, +0.2-0.7 ms per call, because the sync stops the host from
dispatching ahead of the device; the README's misuse section has the measurements). It is
set per layer by ``DeepseekV4Attention(..., check_finite=...)`` / the attribute
``attn.check_finite`` (None: the module-level `CHECK_FINITE`, True unless changed):

* ``True``    check every concrete input (the default);
* ``"host"``  check NumPy (host) inputs only, let device arrays through unchecked;
* ``False``   no check: NaN/inf propagate into the output *and the cache*.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .backend import is_tracer
from .cache import AttentionCache
from .config import CSA, HCA

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


def check_cache(attn, cache: Any) -> None:
    """The cache belongs to this layer (index, type, sizes)."""
    cfg = attn.config
    if not isinstance(cache, AttentionCache):
        raise TypeError(
            f"cache: expected an AttentionCache from attn.init_cache(...), got {type(cache).__name__}"
        )
    if (cache.layer_idx, cache.layer_type) != (attn.layer_idx, attn.layer_type):
        raise ValueError(
            f"cache: expected the cache of layer {attn.layer_idx} ({attn.layer_type}), got the cache of "
            f"layer {cache.layer_idx} ({cache.layer_type})"
        )
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
    if cache.compressor is not None:
        want = cfg.entry_slots(attn.layer_type, cache.max_seq_len)
        if cache.compressor.entries.shape[1:] != (want, cfg.head_dim):
            raise ValueError(
                f"cache.compressor.entries: expected shape [B, {want}, {cfg.head_dim}], got "
                f"{list(cache.compressor.entries.shape)}"
            )


def check_call(attn, hidden_states: Any, positions: Any, cache: Any, return_intermediates: bool):
    """Validate one call; returns (the StepSpec to run, the length it checked, the call's real
    tokens per row), the last two None while tracing (the length is then the step's own).

    The length is the host value the checks ran against (int32 NumPy [B]); the caller's host
    mirror of the new length is `cache.advance_length` of it by the real tokens per row (int32
    [B], `cache.real_tokens(positions)` as the checks found it; see `dsv4_jax.cache`)."""
    cfg = attn.config
    h_shape, h_dtype = _shape_dtype("hidden_states", hidden_states)
    if not jnp.issubdtype(h_dtype, jnp.floating):
        raise TypeError(f"hidden_states: expected a floating dtype, got {h_dtype}")
    if len(h_shape) != 3 or h_shape[-1] != cfg.hidden_size or h_shape[1] < 1:
        raise ValueError(
            f"hidden_states: expected shape [B, S, {cfg.hidden_size}] with S >= 1, got {list(h_shape)}"
        )
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
    # float64 NumPy inputs run as float32 unless jax_enable_x64 is on: promote what JAX will see.
    spec = attn.step_spec(jax.dtypes.canonicalize_dtype(h_dtype), return_intermediates)
    if jnp.dtype(cache.dtype) != spec.dtype:
        raise TypeError(
            f"cache: expected dtype {spec.dtype} (the layer's compute dtype), "
            f"got {cache.dtype}; make it with attn.init_cache(..., dtype={spec.dtype})"
        )

    if is_tracer(positions) or is_tracer(cache.length):
        return spec, None, None  # values unknown while tracing: shapes and dtypes were checked
    length = np.asarray(cache.length).astype(np.int64)
    pos = np.asarray(positions).astype(np.int64)
    new_tokens = check_positions(pos, length, cache.max_seq_len)
    check_finite("hidden_states", hidden_states, CHECK_FINITE if attn.check_finite is None else attn.check_finite)
    return spec, length.astype(np.int32), new_tokens.astype(np.int32)


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


_all_finite = jax.jit(lambda x: jnp.isfinite(x).all())


def _on_cpu(value: jax.Array) -> bool:
    try:
        return all(d.platform == "cpu" for d in value.devices())
    except Exception:  # a deleted or otherwise unreadable array: let the reduction report it
        return False


def check_finite_mode(mode: Any) -> None:
    if not (mode is None or mode is True or mode is False or (isinstance(mode, str) and mode == "host")):
        raise ValueError(f"check_finite: expected one of {(None, *CHECK_FINITE_MODES)}, got {mode!r}")


def check_finite(name: str, value: Any, mode: bool | str = True) -> None:
    """Reject NaN/inf in a concrete array (see the module docstring for `mode` and the cost)."""
    check_finite_mode(mode)
    if mode is False or is_tracer(value):
        return
    if isinstance(value, jax.Array):
        if mode == "host":
            return
        # A host-resident array is read in place (no dispatch of a reduction, no transfer);
        # a device array is reduced on its device and only the verdict comes back.
        if _on_cpu(value):
            if np.isfinite(np.asarray(value)).all():
                return
        elif bool(_all_finite(value)):
            return
    elif np.isfinite(np.asarray(value)).all():
        return
    host = np.asarray(value)
    bad = ~np.isfinite(host)
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
        f"{name}: expected finite values, got {int(bad.sum())} non-finite of {host.size} (first at "
        f"{list(first)}: {host[first]}); the call was not run, the cache is unchanged"
    )


def _preview(row: np.ndarray) -> str:
    values = row.tolist()
    return str(values) if len(values) <= 8 else f"[{values[0]}, {values[1]}, ..., {values[-1]}]"
