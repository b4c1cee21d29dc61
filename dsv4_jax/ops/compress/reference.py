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

Streaming: the compressor keeps the raw projections of the last tokens in a ring (`buffer`,
``[kv | gate]`` per slot p % R: the unfinished window, and for CSA the window before it,
whose Ca half the next entry pools). A call's new tokens are laid after the unfinished
window's buffered ones in a *stream* that starts at that window's first position, so the
windows of the stream are aligned and the position bias of stream slot i is ``bias[i % m]``;
the call's tokens are written into the ring (`cache.insert_ring`, as the window cache is).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsv4_jax.backend import Array, differentiated_as, namespace
from dsv4_jax.cache.contiguous import CompressorCache, insert_ring
from dsv4_jax.cache.history import keep_evicted
from dsv4_jax.cache.quantized import write_rows
from dsv4_jax.ops.compress import pallas as compressor_kernel
from dsv4_jax.ops.norms import rms_norm
from dsv4_jax.ops.rope import apply_rope


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
    kernel: str = "auto",
    round_entries=None,
) -> CompressorCache:
    """Append a call's tokens to the compressor; emit the entries of windows they complete.

    kv, gate:  [B, S, n*Dc]  this call's projections (positions ``length .. length+S-1``)
    state:     the compressor's cache before the call
    length:    [B] int32     tokens seen before this call
    frozen:    [B] bool or None: rows whose state stays as it was (a call that would run past
               `max_seq_len`, see `cache.overflows`); their entry and ring writes are dropped
               by the scatters (no copy of the cache)
    count:     [B] int32 or None: real tokens per row of a ragged call (``kv[:, :count]``; the
               padded slots after them are skipped: they never enter the stream, so they pool
               into nothing, are not written into the ring and write no entry). None: all S
               are real.
    kernel:    the step plan's ``compress`` choice for a decode step's pooling (`_pool_one_token`)
    round_entries: None, or a function applied to the new entries after their norm and RoPE
               (the official numerics' rounding, `dsv4_jax.numerics`); the ring is not rounded
    returns    the state after the call: the entries of the windows this call completes are
               written at rows ``length // m ..``, the call's tokens into the ring (and the
               tokens they evict into the ring's history, where the state keeps one).

    The stream can touch ``L = (m - 1 + S) // m + 1`` windows. At most ``P = L - 1`` of them
    can complete (``(length % m + count) // m <= (m - 1 + S) // m``), so only the first P are
    pooled (fixed shapes: a decode step pools one window, not two) and window j of a row is
    written iff ``j < (length % m + count) // m``.

    A call of one token (decode) builds no stream (`_one_token`): the token is written into
    the ring first and the windows are read from the updated ring, which holds them whole; on
    CUDA a Pallas kernel pools them, for the completing rows only (`_pool_one_token`).

    Shapes per step (Dc = entry width, n = 2 for CSA else 1, R = 2m for CSA else m):
      ring    [B, R, 2*n*Dc]    [kv | gate], before and after the call
      stream  [B, L*m, 2*n*Dc]  buffered tokens, then the new ones, zero-padded
      windows [B, L, m, n*Dc]   kv and gate each
      slots   [B, P, 2m or m, Dc] -> softmax over slots (float32) -> pooled [B, P, Dc]
    """
    xp = namespace(kv, gate, length)
    seq = kv.shape[1]
    m = ratio
    dtype = kv.dtype
    n_windows = (m - 1 + seq) // m + 1
    n_pooled = n_windows - 1  # windows that can complete in this call

    buffered = (length % m).astype(np.int32)  # [B] tokens of the unfinished window
    first_entry = (length // m).astype(np.int32)  # [B] index of the stream's window 0
    n_new = np.int32(seq) if count is None else count.astype(np.int32)  # [B] (or S) real tokens
    completed = (buffered + n_new) // m  # [B] windows this call completes

    projected = xp.concatenate([kv, gate.astype(kv.dtype)], axis=-1)  # [B, S, 2*n*Dc]: one ring write
    ring = insert_ring(state.buffer, projected, length, frozen, count)
    # With a rewind history, the tokens this write evicts (read from the ring before it).
    history = keep_evicted(state.history, state.buffer, projected, length, frozen, count)
    if seq > 1:
        windows, before = _streamed(state.buffer, projected, buffered, first_entry, n_new, m)
        pooled = _pool(windows[:, :n_pooled], before, first_entry, position_bias, overlap, dtype)
    else:
        pooled = _pool_one_token(ring, first_entry, completed > 0, position_bias, m, overlap, dtype, kernel)
    pooled = rms_norm(pooled, kv_norm, eps)
    entry_pos = (first_entry[:, None] + xp.arange(n_pooled, dtype=np.int32)[None, :]) * m  # [B, P]
    pooled = apply_rope(pooled, entry_pos, freqs, scale=rope_scale)
    if round_entries is not None:
        pooled = round_entries(pooled)

    # Write the completed windows' entries.
    j = xp.arange(n_pooled, dtype=np.int32)[None, :]
    write = j < completed[:, None]
    if frozen is not None:
        write = write & ~frozen[:, None]
    write_at = xp.where(write, first_entry[:, None] + j, state.entries.shape[1])
    entries = write_rows(state.entries, write_at, pooled)  # quantized where the entries are FP8
    return state.replace(entries=entries, buffer=ring, history=history)


def _pool(windows: Array, before: Array, first_entry: Array, position_bias: Array, overlap: bool, dtype) -> Array:
    """The gated pooling of P windows: their pre-norm entries (XLA or NumPy).

    windows [B, P, m, 2*n*Dc] (``[kv | gate]`` per slot, window j = entry first_entry + j);
    before [B, m, 2*n*Dc] window ``first_entry - 1`` (CSA pools its Ca half into entry
    first_entry; absent where first_entry = 0); position_bias [m, n*Dc] float32
    -> [B, P, Dc] in `dtype`:

      slots [B, P, 2m or m, Dc] -> softmax over slots (float32) -> pooled [B, P, Dc]
    """
    xp = namespace(windows, first_entry)
    width = windows.shape[-1] // 2
    dc = width // (2 if overlap else 1)
    win_kv, raw_gate = windows[..., :width], windows[..., width:]  # [B, P, m, n*Dc] each
    before_kv, before_gate = before[..., :width], before[..., width:]  # [B, m, n*Dc]
    # The reference adds the float32 bias to the raw gate, so the logits are float32.
    bias = position_bias.astype(np.float32)[None, None]  # [1, 1, m, n*Dc]: ranks explicit
    pool_kv, pool_gate = win_kv, raw_gate.astype(np.float32) + bias

    if overlap:
        # Entry w pools [Ca of window w-1 | Cb of window w]. Window -1 of the stream is the
        # window before the unfinished one (`before_*`, from the ring), absent for entry 0.
        has_prev = (first_entry > 0)[:, None, None, None]
        prev0_kv = xp.where(has_prev, before_kv[:, None, :, :dc], xp.zeros((), before_kv.dtype)).astype(dtype)
        prev0_gate = xp.where(has_prev, before_gate[:, None, :, :dc].astype(np.float32) + bias[..., :dc], -np.inf)
        prev_kv = xp.concatenate([prev0_kv, pool_kv[:, :-1, :, :dc]], axis=1)
        prev_gate = xp.concatenate([prev0_gate, pool_gate[:, :-1, :, :dc]], axis=1)
        slots_kv = xp.concatenate([prev_kv, pool_kv[..., dc:]], axis=2)  # [B, P, 2m, Dc]
        slots_gate = xp.concatenate([prev_gate, pool_gate[..., dc:]], axis=2)
    else:
        slots_kv, slots_gate = pool_kv, pool_gate

    probs = xp.exp(slots_gate - xp.max(slots_gate, axis=2, keepdims=True))
    probs = (probs / xp.sum(probs, axis=2, keepdims=True)).astype(dtype)
    # Product in the kv dtype, sum accumulated in float32 and rounded once (a torch bf16 sum).
    return (slots_kv * probs).astype(np.float32).sum(axis=2).astype(dtype)  # [B, P, Dc]


def _pool_one_token(ring: Array, first_entry: Array, completes: Array, position_bias: Array, m: int,
                    overlap: bool, dtype, kernel: str) -> Array:
    """A decode step's pooled entry [B, 1, Dc]: `_pool` of `_one_token`'s windows, or
    `compressor_kernel.pool_one_token` (one kernel, only for the rows in `completes` [B]; the
    others' results are never written) where `kernel` (the plan's, `KernelPlan.compress_for`)
    asks for it: "pallas" on CUDA, "interpret" on any backend, "xla" never. The kernel
    differentiates as `_pool` (`backend.differentiated_as`)."""
    def reference(ring, first_entry, completes, position_bias):
        windows, before = _one_token(ring, first_entry, m)
        return _pool(windows, before, first_entry, position_bias, overlap, dtype)

    if isinstance(ring, np.ndarray) or kernel == "xla":
        return reference(ring, first_entry, completes, position_bias)
    pool = functools.partial(compressor_kernel.pool_one_token, ratio=m, overlap=overlap)
    if kernel == "interpret":  # the kernel on any backend (tests, CPU)
        pool = functools.partial(pool, interpret=True)
    elif jax.default_backend() != "gpu" or not compressor_kernel.supports(ring, m, overlap):
        # Pallas lowers Triton kernels only where a GPU is the default backend; chosen when the
        # program is lowered for its platform, as `sparse_attention`'s kernel is.
        return reference(ring, first_entry, completes, position_bias)
    else:
        pool = functools.partial(jax.lax.platform_dependent, cuda=pool, default=reference)
    return differentiated_as(reference)(pool)(ring, first_entry, completes, position_bias)


def _ring_window(ring: Array, w: Array, m: int) -> Array:
    """Window w[b]'s m slots of each row's ring, in position order: ring [B, R, X] (R = m or
    2m), w [B] -> [B, m, X]. Its tokens sit at slots ``(w * m + i) % R``: the whole ring where
    R = m, else the half ``w % 2`` (a select between the two halves, no gather). Window -1 (a
    row's first window has none before it) reads the second half, which callers mask."""
    if ring.shape[1] == m:
        return ring
    xp = namespace(ring, w)
    first_half = (w % 2 == 0)[:, None, None]
    return xp.where(first_half, ring[:, :m], ring[:, m:])


def _streamed(ring: Array, projected: Array, buffered: Array, first_entry: Array, n_new, m: int):
    """`compress`'s stream of a call: the buffered tokens of the unfinished window (from the
    ring before the call), then the call's real ones, zero-padded to whole windows (stream
    slot i holds position ``first_entry * m + i``); and the window before the unfinished one.

    ring [B, R, X] before the call; projected [B, S, X] the call's ``[kv | gate]``; buffered,
    first_entry [B]; n_new [B] (a ragged call's real tokens) or the scalar S -> the windows
    [B, L, m, X] and window ``first_entry - 1`` [B, m, X].
    """
    xp = namespace(projected, buffered)
    batch, seq, _ = projected.shape
    n_windows = (m - 1 + seq) // m + 1
    slot = xp.arange(n_windows * m, dtype=np.int32)[None, :]  # [1, L*m]
    from_buffer = slot < buffered[:, None]
    new_idx = slot - buffered[:, None]
    # A ragged row's padded slots are not part of its stream: zeros, as past the end of a call.
    from_new = (new_idx >= 0) & (new_idx < (n_new if np.ndim(n_new) == 0 else n_new[:, None]))
    unfinished = _ring_window(ring, first_entry, m)  # [B, m, X]: its first `buffered` slots
    old = xp.take_along_axis(unfinished, xp.clip(slot, 0, m - 1)[..., None], 1)
    fresh = _rows_at(projected, new_idx)
    stream = xp.where(from_buffer[..., None], old, xp.where(from_new[..., None], fresh, xp.zeros_like(fresh)))
    return stream.reshape(batch, n_windows, m, -1), _ring_window(ring, first_entry - 1, m)


def _rows_at(x: Array, idx: Array) -> Array:
    """x [B, S, X] at per-row indices idx [B, N] -> [B, N, X]; an index outside [0, S) reads zeros.

    One gather whose indices are unique and ascending within a row, and declared so: its
    transpose (x's gradient) is then a plain scatter. A `take_along_axis` of the clipped
    indices repeats the ends, and its transpose is a scatter-add that XLA:GPU runs with atomic
    adds (0.26 ms a layer of a CSA B = 4 4k training step on the H200; the step measured 1.3-1.7%
    faster with this form on an H100; docs/breaks_and_kernels.md, "Why the kernels' defaults").
    """
    if namespace(x, idx) is np:
        inside = (idx >= 0) & (idx < x.shape[1])
        rows = np.take_along_axis(x, np.clip(idx, 0, x.shape[1] - 1)[..., None], 1)
        return np.where(inside[..., None], rows, np.zeros((), x.dtype))
    batch = jax.lax.broadcasted_iota(np.int32, idx.shape, 0)
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0, 1), start_index_map=(0, 1))
    return jax.lax.gather(x, jnp.stack([batch, idx.astype(np.int32)], -1), dims, (1, 1, x.shape[2]),
                          mode=jax.lax.GatherScatterMode.FILL_OR_DROP, fill_value=0, unique_indices=True,
                          indices_are_sorted=True)


def _one_token(ring: Array, first_entry: Array, m: int):
    """`compress`'s windows for a call of one token per row (decode), without a stream.

    The ring already holds the token (written by `compress` first), so the unfinished window
    and (CSA) the window before it are read from it whole. Where the token completes its
    window, every slot of it holds one of its tokens; where it does not, the slots after the
    token hold zeros or an older window's tokens, and the pooled result is not written.
    Reading only the ring after the write leaves the write as the only user of the ring
    before it: XLA updates it in place, with no copy for a reader of its old value.

    ring [B, R, X] (after the write); first_entry [B] -> the unfinished window [B, 1, m, X]
    and the window before it [B, m, X].
    """
    return _ring_window(ring, first_entry, m)[:, None], _ring_window(ring, first_entry - 1, m)


def visible_entries(positions: Array, ratio: int) -> Array:
    """Entries a query at each position may see: ``(t + 1) // m`` (spec section 5.4)."""
    return ((positions + 1) // ratio).astype(np.int32)

