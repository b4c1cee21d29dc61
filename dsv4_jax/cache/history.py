"""The rings' history: what a rewind needs, kept by the step's ring writes.

A ring of R slots (the window cache, a compressor's raw projections) holds token p at slot
``p % R`` for a row's last R tokens, so writing token p overwrites token ``p - R``. To take
back a row's last n <= K tokens the ring needs the tokens those writes overwrote: a cache made
with ``max_rewind=K`` keeps, per ring, a **history** of K slots holding the K tokens just older
than the ring (token q at slot ``q % K``), in the ring's own form (the FP8 window's history is
`quantized.QuantizedRows` too, so a restored slot is the bytes that were there).

Who writes what:

* the step, for every ring write (`keep_evicted`, beside `contiguous.insert_ring`): each token
  a call evicts from the ring goes into the history: a decode step moves the one token it
  overwrites; a chunk longer than the ring takes the evicted tokens written in the same call
  from its own values. Ragged rows' padded slots and frozen rows write nothing, as in
  `insert_ring`; tokens at positions below 0 are never written (their history slots read 0).
* a rewind (`restore_ring`, `drop_entries`): the rewound positions' ring slots get back the
  tokens of the history (zeros for positions below 0), and the compressed entries those
  tokens completed are zeroed (as never written).

The history of a row is valid for its last ``cache.rewindable`` evictions only: a rewind of n
uses n of them, which the history then no longer holds (the older tokens they overwrote were
never kept); they come back as the row writes tokens again. So right after a rewind, the
history slots past the row's `rewindable` count differ from a cache that never saw the
rewound tokens (they hold tokens the ring holds again); every other field equals it, and
after K more tokens the history does too.

Every function is written over the fields' leaves (a plain array or the leaves of
`QuantizedRows`, each [B, N, ...]), so a paged cache, whose rings stay per row, reuses them
as they are. Runs under XLA or NumPy (the wide break's host twin writes the history too).
"""

from __future__ import annotations

import math

import jax
import numpy as np

from dsv4_jax.backend import Array, namespace, scatter_rows
from dsv4_jax.cache.paged import PagedRows
from dsv4_jax.cache.quantized import QuantizedRows


# ---------------------------------------------------------------------------- rows of any field
def gather_rows(field, index: Array):
    """Rows ``field[b, index[b, j]]`` of every leaf: [B, N, ...] at [B, J] -> [B, J, ...]
    (indices must be in range)."""
    def take(a):
        xp = namespace(a, index)
        at = index.reshape(*index.shape, *([1] * (a.ndim - 2)))
        return xp.take_along_axis(a, at.astype(np.int32), axis=1)

    return jax.tree.map(take, field)


def put_rows(field, index: Array, rows):
    """`backend.scatter_rows` of every leaf: ``field[b, index[b, j]] = rows[b, j]``,
    out-of-range indices dropped; `rows` of the field's form (already encoded where the field
    is `QuantizedRows`)."""
    return jax.tree.map(lambda a, r: scatter_rows(a, index, r), field, rows)


def where_rows(mask: Array, a, b):
    """Per row and slot: `a` where ``mask [B, J]``, else `b` (fields of one form, [B, J, ...])."""
    def pick(x, y):
        xp = namespace(x, y, mask)
        return xp.where(mask.reshape(*mask.shape, *([1] * (x.ndim - 2))), x, y.astype(x.dtype))

    return jax.tree.map(pick, a, b)


def zero_rows_like(field):
    """A field of the same form whose leaves are zeros (`quantized_zeros`' bytes for FP8 rows)."""
    return jax.tree.map(lambda a: namespace(a).zeros_like(a), field)


def encoded(like, values: Array):
    """`values` [B, J, D] in the form of the field `like`: quantized where it is `QuantizedRows`
    (the bytes `quantized.write_rows` stores for them), else cast to its dtype."""
    if isinstance(like, QuantizedRows):
        return like.encode(values)
    return values.astype(like.dtype)


# ---------------------------------------------------------------------------- the step's writes
def keep_evicted(history, ring, values: Array, length: Array, frozen: Array | None = None,
                 count: Array | None = None):
    """The history after a call writes `values` into `ring` (`contiguous.insert_ring`): the
    tokens the call evicts go into their slots ``q % K``.

    history [B, K, X] (or `QuantizedRows`, or None: no history kept, None returned);
    ring [B, R, X] the ring *before* the call; values [B, S, X] the call's tokens (positions
    ``length .. length + S - 1``, not yet encoded); length [B]; frozen [B] bool (rows written
    nothing); count [B] (a ragged call's real tokens; None: all S).

    Writing token p evicts token p - R, so a row's call of n real tokens evicts positions
    ``length - R .. length + n - R - 1``; only the last ``J = min(K, S)`` of them can be kept
    (one scatter of J slots a leaf). An evicted token older than the call is read from the
    ring before the call (a decode step: the one slot it overwrites); one of the call itself
    (a chunk longer than R) from `values`. Positions below 0 are not written.
    """
    if history is None:
        return None
    xp = namespace(values, length)
    r, k, s = ring.shape[1], history.shape[1], values.shape[1]
    j = min(k, s)
    n_new = np.int32(s) if count is None else count.astype(np.int32)[:, None]
    length = length.astype(np.int32)[:, None]
    q = length + n_new - r - j + xp.arange(j, dtype=np.int32)[None, :]  # [B, J] evicted positions
    keep = (q >= length - r) & (q >= 0)
    if frozen is not None:
        keep = keep & ~frozen[:, None]
    from_call = q >= length
    old = gather_rows(ring, q % r)
    new = encoded(ring, gather_rows(values, xp.clip(q - length, 0, s - 1)))
    return put_rows(history, xp.where(keep, q % k, k), where_rows(from_call, new, old))


# ---------------------------------------------------------------------------- a rewind
def restore_ring(ring, history, new_length: Array, n: Array):
    """The ring after a row's last `n` tokens are taken back: the slots of positions
    ``new_length .. new_length + n - 1`` hold again the tokens R older (from the history; zeros
    for positions below 0), the other slots are untouched.

    ring [B, R, X] and history [B, K, X] of one form; new_length, n [B] (n = 0: row untouched;
    n <= K and the history valid for n, checked by the caller). One scatter of ``min(K, R)``
    slots a leaf: where n > R the whole ring comes from the history.
    """
    xp = namespace(new_length, n)
    r, k = ring.shape[1], history.shape[1]
    j = xp.arange(min(k, r), dtype=np.int32)[None, :]
    q = new_length.astype(np.int32)[:, None] - r + j  # [B, J] the positions the slots get back
    kept = gather_rows(history, q % k)
    rows = where_rows(q >= 0, kept, zero_rows_like(kept))
    return put_rows(ring, xp.where(j < n[:, None], q % r, r), rows)


def drop_entries(entries, old_length: Array, new_length: Array, ratio: int, max_rewind: int):
    """The compressed entries with those completed by the rewound tokens zeroed (as never
    written): rows ``new_length // m .. old_length // m - 1``; a rewind of at most K tokens
    completed at most ``ceil(K / m)`` of them (one scatter of that many rows a leaf)."""
    xp = namespace(old_length, new_length)
    span = max(1, math.ceil(max_rewind / ratio))
    w = (new_length // ratio).astype(np.int32)[:, None] + xp.arange(span, dtype=np.int32)[None, :]
    at = xp.where(w < (old_length // ratio)[:, None], w, entries.shape[1])
    if isinstance(entries, PagedRows):  # zero rows of the pool's form, scattered into the rows' pages
        batch = old_length.shape[0]
        return entries.scatter(at, jax.tree.map(lambda a: xp.zeros((batch, span, *a.shape[2:]), a.dtype),
                                                entries.pool))
    slots = jax.tree.map(lambda a: xp.zeros((a.shape[0], span, *a.shape[2:]), a.dtype), entries)
    return put_rows(entries, at, slots)

