"""A server's operations on a cache's rows beyond `contiguous.reset_rows`: take back a row's last
tokens (`rewind_rows`: speculative decoding's rejected drafts) and start rows from others as
they stand (`fork_rows`: a shared prompt prefix).

Both are jittable and change no shape (the compiled step keeps serving). Eagerly, their checks
read the cache's host mirrors (`length`, `rewindable`: no device sync) and a refused call
raises before anything runs, the cache unchanged. Under a user's `jax.jit` (traced rows or
counts) nothing can refuse: see each function for what a bad row does then.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.backend import is_tracer
from dsv4_jax.cache import paged
from dsv4_jax.cache.contiguous import HOST_MIRRORS, AttentionCache, _host_rows, _traced_rows, checked_stack
from dsv4_jax.cache.history import drop_entries, restore_ring
from dsv4_jax.config import CSA


# ---------------------------------------------------------------------------- rewind
def rewind_rows(cache, rows, n):
    """The cache with the last `n` tokens of rows `rows` taken back, as if never written.

    cache: one layer's `AttentionCache`, or a stack's list/tuple of them (the same rows of
          every layer; the same kind comes back): every layer rewound in one compiled program
          (a speculative step's rejected drafts cost one dispatch, not one a layer), each
          checked against its own counts.
    rows: row indices (an int, a sequence or int array, negative counted from the end; no row
          twice) or a bool mask [B].
    n:    tokens to take back: an int for every row of `rows`, or one per row (as many as the
          indices of `rows`; [B] for a mask, whose unselected rows' values are ignored).

    Each rewound row gets back its length minus n, its window ring and both compressors' rings
    (main and indexer) as they stood n tokens ago, and the compressed entries those tokens
    completed zeroed: bit for bit the cache that never saw the tokens
    (tests/cache/test_rewind_fork.py), except the ring histories' slots past the row's new
    `rewindable` count (`dsv4_jax.cache.history`, which says why). The other rows are untouched.

    What it needs: a cache made with ``init_cache(..., max_rewind=K)``. A row can take back
    ``cache.rewindable[row]`` tokens: up to K, fewer after a rewind (a rewind of n uses n of its
    history; each written token gives one back) and never more than its length. What that
    costs, per batch row: K rows of the window (``K * D`` values of the cache dtype; FP8 caches
    the FP8 row) and K rows of each compressor ring (``K * 2 * n * Dc``: CSA's main and indexer
    rings, HCA's one), an int32 count; the step writes ``min(K, S)`` more rows per ring (one
    scatter each, of the tokens its ring writes evict, read from the ring before the write).
    A rewind itself is one scatter of ``min(K, R)`` rows per ring and of ``ceil(K / m)`` entry
    rows per compressor.

    Eagerly (concrete rows and n), refused with the cache unchanged: a cache without history
    (`ValueError` naming ``cache``), rows out of range or twice (``rows``), n not an int
    (`TypeError` naming ``n``), negative, of the wrong shape, or past a row's
    ``rewindable`` (`ValueError` naming ``n`` and the limit). Under `jax.jit` (traced rows or
    n) nothing can refuse: a row asked for a negative n or more than it can take back is left
    unchanged; indices out of range are ignored.
    """
    stack, single = checked_stack(cache)
    if not stack:
        return cache
    for i, c in enumerate(stack):
        if c.max_rewind == 0:
            raise ValueError(f"{'cache' if single else f'caches[{i}]'}: rewind_rows needs the history a cache keeps "
                             "when made with max_rewind > 0, got a cache made with max_rewind=0; pass max_rewind=K "
                             "(the most tokens a row may take back, e.g. the drafts of a speculative step) to "
                             "init_cache")
    batch = stack[0].batch_size
    traced = is_tracer(rows) or is_tracer(n)
    if traced:
        per_row = _traced_counts(rows, n, batch)
    else:  # every layer's counts checked before any is rewound
        counts = [_host_counts(c, rows, n, batch) for c in stack]
        per_row = counts[0]
    rewound = _rewind_stack([c.replace(**_device_mirrors(c)) for c in stack], jnp.asarray(per_row, jnp.int32),
                            tuple(c.max_rewind for c in stack))
    new = []
    for c, r in zip(stack, rewound):
        if c.pages is not None:  # a rewind takes no page and gives none back: the table as it was
            r = r.replace(pages=c.pages)
        if not traced:  # an eager cache keeps its host mirrors, moved by the same rule on the host
            r = r.replace(**_host_mirrors(c, r, lambda mirror: (mirror - per_row).astype(np.int32)))
        new.append(r)
    return new[0] if single else type(cache)(new)


def _host_counts(cache: AttentionCache, rows, n, batch: int) -> np.ndarray:
    """Concrete rows and n, checked -> [B] int32 tokens to take back per row (0: untouched)."""
    idx = _host_rows(rows, batch)
    mask = np.asarray(rows).dtype == bool
    if not mask and len(np.unique(idx)) != len(idx):
        raise ValueError(f"rows: expected each row at most once, got {np.asarray(rows).reshape(-1).tolist()}")
    arr = np.asarray(n)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"n: expected an int or ints (tokens to take back), got {arr.dtype.name} {n!r}")
    want = (batch,) if mask else (len(idx),)
    if arr.ndim and arr.shape != want:
        raise ValueError(f"n: expected an int or one per row ({'[B] for a mask' if mask else 'as many as rows'}: "
                         f"shape {list(want)}), got shape {list(arr.shape)}")
    per = np.broadcast_to(arr, (batch,) if mask else (len(idx),)).astype(np.int64)
    if mask:
        per = per[idx]
    if (per < 0).any():
        raise ValueError(f"n: expected tokens to take back >= 0, got {per[per < 0].tolist()} (rows "
                         f"{idx[per < 0].tolist()})")
    length = _host_values(cache.length)
    rewindable = _host_values(cache.rewindable)
    if length is not None and rewindable is not None:
        limit = np.minimum(rewindable[idx], length[idx])
        over = per > limit
        if over.any():
            i = int(np.argmax(over))
            raise ValueError(
                f"n: expected at most {int(limit[i])} tokens for row {int(idx[i])} (what it can take back: "
                f"max_rewind={cache.max_rewind}, fewer since a rewind or while it holds fewer tokens; it holds "
                f"{int(length[idx[i]])}), got {int(per[i])}")
    out = np.zeros((batch,), np.int32)
    out[idx] = per
    return out


def _host_values(mirror):
    """A host mirror's values (a concrete device array is read), None where traced."""
    if mirror is None or is_tracer(mirror):
        return None
    return np.asarray(mirror)


def _traced_counts(rows, n, batch: int):
    """Traced rows or n -> [B] int32 tokens to take back (rows out of range ignored)."""
    rows = jnp.asarray(rows)
    n = jnp.asarray(n)
    if not jnp.issubdtype(n.dtype, jnp.integer) or n.dtype == jnp.bool_:
        raise TypeError(f"n: expected an int or ints (tokens to take back), got {n.dtype}")
    if rows.dtype == jnp.bool_:
        mask = _traced_rows(rows, batch)
        return jnp.where(mask, jnp.broadcast_to(n, (batch,)), 0).astype(jnp.int32)
    rows = rows.reshape(-1)
    rows = jnp.where(rows < 0, rows + batch, rows)
    return jnp.zeros((batch,), jnp.int32).at[rows].set(jnp.broadcast_to(n, rows.shape).astype(jnp.int32),
                                                         mode="drop")


def _device_mirrors(cache: AttentionCache) -> dict:
    """The cache's host mirrors as int32 device arrays (what the jitted row operations take)."""
    return {name: jnp.asarray(getattr(cache, name), jnp.int32) for name in HOST_MIRRORS
            if getattr(cache, name) is not None}


def _host_mirrors(cache: AttentionCache, new: AttentionCache, move) -> dict:
    """The new cache's fields for the old cache's host mirrors: `move(mirror)` (NumPy) where the
    old one is a NumPy array (an eager cache), else the device value `new` holds."""
    return {name: move(getattr(cache, name)) if isinstance(getattr(cache, name), np.ndarray)
            else getattr(new, name) for name in HOST_MIRRORS}


@functools.partial(jax.jit, static_argnums=2)
def _rewind(cache: AttentionCache, n, max_rewind: int) -> AttentionCache:
    """`rewind_rows` on device values: n [B] int32 (0: row untouched). A row whose n is
    negative or past its `rewindable` count is left unchanged (what a traced call can do)."""
    n = jnp.where((n >= 0) & (n <= jnp.minimum(cache.rewindable, cache.length)), n, 0)
    cache = paged.bind(cache)  # a paged cache's entries zeroed in their pages (never shared ones: `fork_rows`)
    old_length = cache.length
    new_length = old_length - n
    window = restore_ring(cache.window, cache.window_history, new_length, n)

    def compressor(state, ratio):
        if state is None:
            return None
        return state.replace(buffer=restore_ring(state.buffer, state.history, new_length, n),
                             entries=drop_entries(state.entries, old_length, new_length, ratio, max_rewind))

    ratio = _ratio(cache)
    return paged.unbind(cache.replace(length=new_length, rewindable=cache.rewindable - n, window=window,
                                      compressor=compressor(cache.compressor, ratio),
                                      indexer=compressor(cache.indexer, ratio)))


@functools.partial(jax.jit, static_argnums=2)
def _rewind_stack(caches: list, n, max_rewinds: tuple) -> list:
    """`_rewind` of every cache of a stack, one program."""
    return [_rewind(c, n, k) for c, k in zip(caches, max_rewinds)]


def _ratio(cache: AttentionCache) -> int:
    """The compress ratio m of a compressed layer's cache, from its ring (2m slots for CSA's
    overlapping windows, m for HCA); 0 for a sliding layer."""
    if cache.compressor is None:
        return 0
    slots = cache.compressor.buffer.shape[1]
    return slots // 2 if cache.layer_type == CSA else slots


# ---------------------------------------------------------------------------- fork
def fork_rows(cache, src, dst, *, donate: bool = False):
    """The cache with rows `dst` continuing from rows `src` as they stand: every field of row
    ``src[i]`` (length, window ring, compressors' entries and rings, rewind history and count)
    copied into row ``dst[i]``; the other rows untouched.

    cache: one layer's `AttentionCache`, or a stack's list/tuple of them (the same rows of every
           layer; returned as the same kind: list in, list out). A stack forks in one call: one
           decision on the host for its page table, every layer's copied pages in one compiled
           program and every layer's per-row fields in one more (a server's fork costs two
           dispatches, not a few per layer; repeated forks of the same shapes compile nothing
           new). Sliding layers' caches (nothing paged) and contiguous caches fork their rows.

    A forked row then decoded equals the same row computed from scratch with the same tokens,
    bit for bit (tests/cache/test_rewind_fork.py). On a contiguous cache a fork copies the rows
    (the whole entries of a row: ``max_seq_len / m`` of them). A paged cache (`cache.paged`)
    shares the source's pages that no later write or rewind can touch (those wholly below
    ``length - max_rewind`` tokens: reference counts) and copies the rest into pages taken from
    the pool (a short pool: `ValueError` naming the pages needed and free); eager only, since
    it takes pages. A stack's paged caches must hold one page table (`paged.shared_table`) and
    the same lengths: a `ValueError` naming ``caches`` otherwise. The copied pages are written
    into a new pool by default, in place with `donate=True` (no copy of the pool; the caches
    passed in are unusable after).

    src, dst: row indices (ints or int sequences, negative counted from the end); one `src`
    for every `dst`, or one each. Eagerly, refused with every cache unchanged (nothing is
    written before every check has passed): indices out of range (`ValueError` naming ``src`` /
    ``dst``), a `dst` row twice, and a `dst` row that holds tokens in any cache (`ValueError`
    naming ``dst``: `reset_rows` it first). Jittable for contiguous caches: under `jax.jit`
    (traced indices) nothing can refuse: a `dst` holding tokens is overwritten, indices out of
    range are ignored.
    """
    stack, single = checked_stack(cache)
    if not stack:
        return cache
    batch = stack[0].batch_size
    traced = is_tracer(src) or is_tracer(dst)
    lengths = _host_lengths(stack)
    if traced:
        src_idx, dst_idx = _traced_pairs(src, dst, batch)
    else:
        src_idx, dst_idx = _host_pairs(lengths, src, dst, batch)
    if any(c.pages is not None for c in stack):
        if traced or any(is_tracer(c.pages.table) for c in stack if c.pages is not None):
            raise TypeError(f"{'cache' if single else 'caches'}: forking a paged cache takes pages, which is done "
                            "eagerly (not under jax.jit)")
        stack = paged.fork_pages(stack, src_idx, dst_idx, lengths, donate=bool(donate),
                                 what="cache" if single else "caches")
    # The per-row fields of every layer, one program; a paged cache's pools and table were
    # forked by `paged.fork_pages`. An eager cache's NumPy mirrors are forked on the host.
    mirrors = [{} if traced else {name: m for name in HOST_MIRRORS if isinstance(m := getattr(c, name), np.ndarray)}
               for c in stack]
    rows = [c.replace(**{name: None if name in kept else jnp.asarray(m, jnp.int32) for name in HOST_MIRRORS
                         if (m := getattr(c, name)) is not None}) for c, kept in zip(stack, mirrors)]
    # Host indices go to the program as NumPy (its own transfer: cheaper than jnp.asarray's dispatch).
    at = (src_idx, dst_idx) if traced else (src_idx.astype(np.int32), dst_idx.astype(np.int32))
    new = paged.map_stack_rows(lambda per_row: _fork(per_row, *at), rows)

    def copied(mirror):
        mirror = mirror.copy()
        mirror[dst_idx] = mirror[src_idx]
        return mirror

    new = [n.replace(**{name: copied(m) for name, m in kept.items()}) for n, kept in zip(new, mirrors)]
    return new[0] if single else type(cache)(new)


def _host_lengths(stack: list) -> list:
    """Each cache's length [B] as a host array (one transfer for the stack's device ones),
    None where traced."""
    concrete = [i for i, c in enumerate(stack) if not is_tracer(c.length)]
    values = jax.device_get([stack[i].length for i in concrete])
    out = [None] * len(stack)
    for i, value in zip(concrete, values):
        out[i] = np.asarray(value)
    return out


def _host_pairs(lengths: list, src, dst, batch: int):
    """Concrete src and dst, checked against every cache's host `lengths` (None: traced, not
    checked) -> int32 index arrays of one length."""
    for name, value in (("src", src), ("dst", dst)):
        if np.asarray(value).dtype == bool:
            raise TypeError(f"{name}: expected row indices (ints), got a bool array")
    src_idx = _named_rows("src", src, batch)
    dst_idx = _named_rows("dst", dst, batch)
    if len(src_idx) == 1 and len(dst_idx) > 1:
        src_idx = np.repeat(src_idx, len(dst_idx))
    if len(src_idx) != len(dst_idx):
        raise ValueError(f"src: expected one row, or one for each dst row ({len(dst_idx)}), got {len(src_idx)}")
    if len(np.unique(dst_idx)) != len(dst_idx):
        raise ValueError(f"dst: expected each row at most once, got {np.asarray(dst).reshape(-1).tolist()}")
    for length in lengths:
        if length is None:
            continue
        busy = length[dst_idx] > 0
        if busy.any():
            rows = dst_idx[busy]
            raise ValueError(f"dst: expected empty rows to fork into, got row(s) {rows.tolist()} holding "
                             f"{length[rows].tolist()} tokens; reset_rows them first")
    return src_idx, dst_idx


def _named_rows(name: str, rows, batch: int) -> np.ndarray:
    """`contiguous._host_rows` with its errors naming `name` instead of ``rows``."""
    try:
        return _host_rows(rows, batch)
    except (TypeError, ValueError) as err:
        raise type(err)(name + str(err).removeprefix("rows")) from None


def _traced_pairs(src, dst, batch: int):
    src, dst = jnp.asarray(src, jnp.int32).reshape(-1), jnp.asarray(dst, jnp.int32).reshape(-1)
    src = jnp.broadcast_to(src, dst.shape)
    src = jnp.where(src < 0, src + batch, src)
    dst = jnp.where(dst < 0, dst + batch, dst)
    # A source out of range copies nothing: its destination index is dropped too.
    dst = jnp.where((src >= 0) & (src < batch), dst, batch)
    return jnp.clip(src, 0, batch - 1), dst


@jax.jit
def _fork(cache: AttentionCache, src, dst) -> AttentionCache:
    """Every leaf's rows `dst` set to its rows `src` (read before any is written)."""
    return jax.tree.map(lambda a: a.at[dst].set(a[src], mode="drop"), cache)
