"""Gated-pooling compressor (spec section 5): m source tokens -> one compressed KV entry.

Used twice in a CSA layer (the main KV compressor at head_dim, the indexer's key compressor
at index_head_dim) and once in an HCA layer. Runs under XLA or NumPy (see `backend`).

Per token t the input stage has already projected ``C_t = x_t Wkv`` and ``Z_t = x_t Wgate``.
Window w covers positions ``w*m .. w*m+m-1``; its entry is, per channel,

* HCA (``overlap=False``): ``E_w = sum_j softmax_j(Z_{wm+j} + bias_j) * C_{wm+j}`` over m slots;
* CSA (``overlap=True``): the projections are two series ``[Ca | Cb]``; entry w pools 2m
  slots: the Ca half of window w-1 and the Cb half of window w (window -1 is absent: gate
  -inf). Entries overlap: each spans 2m tokens with stride m.

then ``RMSNorm(kv_norm)`` and RoPE at position ``w*m``. An entry exists once its window is
complete, and a query at position t sees entry w iff ``w < (t + 1) // m``.

Streaming: the tokens of an unfinished window wait in the cache (`buffer_*`), and CSA keeps
the last completed window's Ca half (`overlap_*`) for the next entry's first slots. A call's
new tokens are laid after the buffered ones in a *stream* that starts at the unfinished
window's first position, so the windows of the stream are aligned and the position bias of
stream slot i is ``bias[i % m]``.
"""

from __future__ import annotations

import numpy as np
from flax import struct

from .backend import Array, namespace, scatter_rows
from .cache import CompressorCache
from .norms import rms_norm
from .rope import apply_rope


@struct.dataclass
class CompressorWeights:
    """kv_proj, gate_proj: [hidden, n*Dc]; position_bias: [m, n*Dc] float32; kv_norm: [Dc] float32."""

    kv_proj: Array
    gate_proj: Array
    position_bias: Array
    kv_norm: Array


def compress(
    kv: Array,
    gate: Array,
    state: CompressorCache,
    length: Array,
    *,
    position_bias: Array,
    kv_norm: Array,
    ratio: int,
    overlap: bool,
    freqs: Array,
    rope_scale: float,
    eps: float,
    frozen: Array | None = None,
    count: Array | None = None,
) -> CompressorCache:
    """Append a call's tokens to the compressor; emit the entries of windows they complete.

    kv, gate:  [B, S, n*Dc]  this call's projections (positions ``length .. length+S-1``)
    state:     the compressor's cache before the call
    length:    [B] int32     tokens seen before this call
    frozen:    [B] bool or None: rows whose state stays as it was (a call that would run past
               `max_seq_len`, see `cache.overflows`); their entry writes are dropped by the
               scatter (no copy of the entries), their small buffers kept by a select
    count:     [B] int32 or None: real tokens per row of a ragged call (``kv[:, :count]``; the
               padded slots after them are skipped: they never enter the stream, so they pool
               into nothing, buffer nothing and write no entry). None: all S are real.
    returns    the state after the call: the entries of the windows this call completes are
               written at rows ``length // m ..``, the rest of the stream waits in the buffer.

    The stream can touch ``L = (m - 1 + S) // m + 1`` windows. At most ``P = L - 1`` of them
    can complete (``(length % m + count) // m <= (m - 1 + S) // m``), so only the first P are
    pooled (fixed shapes: a decode step pools one window, not two) and window j of a row is
    written iff ``j < (length % m + count) // m``; the last window only feeds the buffer.

    A call of one token (decode) builds no stream: its window 0 is the buffer with the token
    in its slot, updated in place (`_one_token`); the same values.

    Shapes per step (Dc = entry width, n = 2 for CSA else 1):
      stream  [B, L*m, n*Dc]    buffered tokens, then the new ones, zero-padded
      windows [B, L, m, n*Dc]
      slots   [B, P, 2m or m, Dc] -> softmax over slots (float32) -> pooled [B, P, Dc]
    """
    xp = namespace(kv, gate, length)
    seq = kv.shape[1]
    m = ratio
    dtype = kv.dtype
    dc = kv_norm.shape[-1]
    n_windows = (m - 1 + seq) // m + 1
    n_pooled = n_windows - 1  # windows that can complete in this call

    buffered = (length % m).astype(np.int32)  # [B] tokens of the unfinished window
    first_entry = (length // m).astype(np.int32)  # [B] index of the stream's window 0
    n_new = np.int32(seq) if count is None else count.astype(np.int32)  # [B] (or S) real tokens
    completed = (buffered + n_new) // m  # [B] windows this call completes

    build = _one_token if seq == 1 else _streamed
    win_kv, raw_gate, buffer_kv, buffer_gate = build(state, kv, gate, buffered, n_new, completed, frozen)
    # The reference adds the float32 bias to the raw gate, so the logits are float32.
    win_gate = raw_gate.astype(np.float32) + position_bias.astype(np.float32)
    pool_kv, pool_gate = win_kv[:, :n_pooled], win_gate[:, :n_pooled]  # [B, P, m, n*Dc]

    if overlap:
        # Entry w pools [Ca of window w-1 | Cb of window w]. Window -1 of the stream is the
        # last window completed before this call (kept in `overlap_*`), absent for entry 0.
        has_prev = (first_entry > 0)[:, None, None, None]
        prev0_kv = xp.where(has_prev, state.overlap_kv[:, None], xp.zeros_like(state.overlap_kv[:, None]))
        prev0_gate = xp.where(has_prev, state.overlap_gate[:, None], -np.inf)
        prev_kv = xp.concatenate([prev0_kv.astype(dtype), pool_kv[:, :-1, :, :dc]], axis=1)
        prev_gate = xp.concatenate([prev0_gate.astype(np.float32), pool_gate[:, :-1, :, :dc]], axis=1)
        slots_kv = xp.concatenate([prev_kv, pool_kv[..., dc:]], axis=2)  # [B, P, 2m, Dc]
        slots_gate = xp.concatenate([prev_gate, pool_gate[..., dc:]], axis=2)
    else:
        slots_kv, slots_gate = pool_kv, pool_gate

    probs = xp.exp(slots_gate - xp.max(slots_gate, axis=2, keepdims=True))
    probs = (probs / xp.sum(probs, axis=2, keepdims=True)).astype(dtype)
    # Product in the kv dtype, sum accumulated in float32 and rounded once (a torch bf16 sum).
    pooled = (slots_kv * probs).astype(np.float32).sum(axis=2).astype(dtype)  # [B, L, Dc]
    pooled = rms_norm(pooled, kv_norm, eps)
    entry_pos = (first_entry[:, None] + xp.arange(n_pooled, dtype=np.int32)[None, :]) * m  # [B, P]
    pooled = apply_rope(pooled, entry_pos, freqs, scale=rope_scale)

    # Write the completed windows' entries; the rest of the stream waits in the buffer.
    j = xp.arange(n_pooled, dtype=np.int32)[None, :]
    write = j < completed[:, None]
    if frozen is not None:
        write = write & ~frozen[:, None]
    write_at = xp.where(write, first_entry[:, None] + j, state.entries.shape[1])
    entries = scatter_rows(state.entries, write_at, pooled)
    new_state = state.replace(entries=entries, buffer_kv=buffer_kv, buffer_gate=buffer_gate)
    if overlap:
        last = xp.maximum(completed - 1, 0)
        any_new = (completed > 0)[:, None, None]
        if frozen is not None:
            any_new = any_new & ~frozen[:, None, None]
        new_state = new_state.replace(
            overlap_kv=xp.where(any_new, _window_rows(win_kv[..., :dc], last), state.overlap_kv),
            overlap_gate=xp.where(any_new, _window_rows(win_gate[..., :dc], last), state.overlap_gate),
        )
    return new_state


def _streamed(state: CompressorCache, kv: Array, gate: Array, buffered: Array, n_new, completed: Array,
              frozen: Array | None):
    """`compress`'s stream of a call: the buffered tokens, then the call's real ones, zero-padded
    to whole windows (stream slot i holds position ``(length // m) * m + i``).

    kv, gate [B, S, n*Dc]; buffered, completed [B]; n_new [B] (a ragged call's real tokens) or
    the scalar S -> the windows' kv and raw gate [B, L, m, n*Dc], the new buffer_kv and
    buffer_gate [B, m, n*Dc] (the window the call leaves unfinished; a frozen row's unchanged).
    """
    xp = namespace(kv, gate, buffered)
    batch, seq, _ = kv.shape
    m = state.buffer_kv.shape[1]
    n_windows = (m - 1 + seq) // m + 1
    slot = xp.arange(n_windows * m, dtype=np.int32)[None, :]  # [1, L*m]
    from_buffer = slot < buffered[:, None]
    new_idx = slot - buffered[:, None]
    # A ragged row's padded slots are not part of its stream: zeros, as past the end of a call.
    from_new = (new_idx >= 0) & (new_idx < (n_new if np.ndim(n_new) == 0 else n_new[:, None]))

    def windows(buffer: Array, new: Array) -> Array:  # [B, L, m, n*Dc]
        old = xp.take_along_axis(buffer, xp.clip(slot, 0, m - 1)[..., None], 1)
        fresh = xp.take_along_axis(new, xp.clip(new_idx, 0, seq - 1)[..., None], 1)
        zero = xp.zeros_like(fresh)
        stream = xp.where(from_buffer[..., None], old, xp.where(from_new[..., None], fresh, zero))
        return stream.reshape(batch, n_windows, m, -1)

    def unless_frozen(new: Array, old: Array) -> Array:  # [B, m, X]: m rows per batch row, cheap
        return new if frozen is None else xp.where(frozen[:, None, None], old, new)

    win_kv, raw_gate = windows(state.buffer_kv, kv), windows(state.buffer_gate, gate)
    return (win_kv, raw_gate, unless_frozen(_window_rows(win_kv, completed), state.buffer_kv),
            unless_frozen(_window_rows(raw_gate, completed), state.buffer_gate))


def _window_rows(a: Array, w: Array) -> Array:
    """Window w[b] of each row: a [B, L, m, X], w [B] -> [B, m, X]."""
    xp = namespace(a, w)
    m = a.shape[2]
    return xp.take_along_axis(a, w[:, None, None, None] + xp.zeros((1, 1, m, 1), np.int32), 1)[:, 0]


def _one_token(state: CompressorCache, kv: Array, gate: Array, buffered: Array, n_new, completed: Array,
               frozen: Array | None):
    """`compress`'s stream for a call of one token per row (decode), without building it.

    The buffer holds zeros after its ``buffered`` tokens (every path keeps that invariant), so
    window 0 of the stream is the buffer with the token in slot ``buffered``, and the window
    after it is empty: read by a select inside the pooling, not gathered into a stream. The new
    buffers are the old ones updated in place by two scatters: the token into its slot where
    the window goes on, zeros over the row where it completes (their other rows' indices are
    out of range, dropped; a frozen row writes nothing), instead of a select over every row.

    kv, gate [B, 1, n*Dc]; buffered, completed [B]; n_new [B] or a scalar (0 or 1 per row)
    -> window 0's kv and raw gate [B, 1, m, n*Dc], the new buffer_kv and buffer_gate [B, m, n*Dc].
    """
    xp = namespace(kv, gate, buffered)
    batch, m = state.buffer_kv.shape[:2]
    has_token = xp.broadcast_to(xp.asarray(n_new) > 0, (batch,))
    token_slot = xp.arange(m, dtype=np.int32)[None, :, None] == buffered[:, None, None]  # [B, m, 1]
    token_slot = token_slot & has_token[:, None, None]
    win_kv = xp.where(token_slot, kv, state.buffer_kv)[:, None]
    raw_gate = xp.where(token_slot, gate, state.buffer_gate)[:, None]

    goes_on, clears = has_token & (completed == 0), completed > 0
    if frozen is not None:
        goes_on, clears = goes_on & ~frozen, clears & ~frozen
    insert_at = xp.where(goes_on, buffered, m)[:, None]  # [B, 1]
    clear_at = xp.where(clears, 0, m)[:, None] + xp.arange(m, dtype=np.int32)[None, :]  # [B, m]

    def update(buffer: Array, token: Array) -> Array:
        return scatter_rows(scatter_rows(buffer, insert_at, token), clear_at, xp.zeros_like(buffer))

    return win_kv, raw_gate, update(state.buffer_kv, kv), update(state.buffer_gate, gate)


def visible_entries(positions: Array, ratio: int) -> Array:
    """Entries a query at each position may see: ``(t + 1) // m`` (spec section 5.4)."""
    return ((positions + 1) // ratio).astype(np.int32)

