"""Paged caches: the parts that grow with the context live in pages of a pool, as in vLLM.

A contiguous cache reserves ``max_seq_len`` tokens for every row. A paged cache keeps the
compressed entries (CSA's main KV entries and the indexer's keys, HCA's entries; bf16 and FP8
rows alike) in a pool of fixed-size pages, and each row holds only the pages its tokens need.
The sliding window ring and the compressors' rings stay per row: they are small and fixed.

==================  ======================  ==============================================
field               shape                   meaning
==================  ======================  ==============================================
pages.table         [B, P_row] int32        row b's logical page j is pool page
                                            ``table[b, j]`` (-1: none); a row's pages come
                                            first, in order (P_row = ceil(max_seq_len /
                                            page_size))
pages.refs          [P] int32               rows holding each page (0: free; 2 and more:
                                            a prefix shared by `fork_rows`)
compressor.entries  [P, E, D] (or FP8)      the pool: P pages of E = page_size // m entries
indexer.entries     [P, E, Di] (or FP4)     the indexer keys' pool, the same pages
==================  ======================  ==============================================

Entry t of row b (tokens ``t*m .. t*m + m - 1``) is row ``t % E`` of pool page
``table[b, t // E]``. The step reads the rows through `PagedRows`, which stands for the [B, T, D]
entries of a contiguous cache (T = ``max_seq_len // m``) wherever the cache's rows are read or
written (`quantized.read`, `read_picked`, `write_rows`). Who reads the pages in place: the
sparse attention's kernel (each entry by its pool row, `physical`), the indexer's native
selection and its Pallas scoring kernel (through the table: `native.Pages`, decided in
`indexer_native.select_native`). The XLA paths gather: CSA's picks, HCA's held rows and the
XLA and host selections' keys (`view`).

Who allocates: nothing under a user's `jax.jit`. The layer's eager call takes the pages a call
needs before it dispatches (`reserve`: a `ValueError` naming the pages needed and free when the
pool is short, the cache unchanged); a jitted loop reserves before it runs (`dsv4_jax.reserve_pages`),
and a row whose step would run past its pages is treated like a row past ``max_seq_len``: its
cache is unchanged and its output NaN (`capacity`). `reset_rows` gives a row's pages back.
A page taken is zeroed first, so a row reads what a contiguous cache's row holds.

A stack of layers keeps one page table: every layer's cache holds the same table and the same
reference counts, because every change to them makes the same decision for each layer, as
vLLM's layers share one block table: `reserve_pages` and `fork_rows` take the whole stack's
caches at once (one host decision, one compiled program for every layer's pools), `reset_rows`
each cache with the same rows. Each layer has its own pool (its rows' widths differ).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsv4_jax.backend import Array, is_tracer, namespace


@struct.dataclass
class PageTable:
    """Which pool pages each row holds (see the module docstring). Host NumPy arrays in an
    eager cache (the layer's calls take pages before dispatch), device arrays under a jit."""

    table: Array
    refs: Array
    page_size: int = struct.field(pytree_node=False, default=256)

    @property
    def num_pages(self) -> int:
        return int(self.refs.shape[0])

    @property
    def pages_per_row(self) -> int:
        return int(self.table.shape[1])

    @property
    def free(self) -> int:
        """Pages no row holds (host tables only)."""
        return int((np.asarray(self.refs) == 0).sum())

    def capacity(self) -> Array:
        """[B] int32: tokens each row can hold with the pages it has."""
        xp = namespace(self.table)
        return (xp.sum(self.table >= 0, axis=1) * self.page_size).astype(np.int32)


@struct.dataclass
class PagedRows:
    """A paged cache field standing for the entries [B, T, D] of a contiguous cache.

    pool  [P, E, D] array, or `quantized.QuantizedRows` of that shape (FP8 / FP4 rows)
    table [B, P_row] int32, the cache's page table; slots T (static): entries per row.
    Quacks like the array it stands for where readers look (`shape`, `dtype`)."""

    pool: Array
    table: Array
    slots: int = struct.field(pytree_node=False, default=1)

    @property
    def page_entries(self) -> int:
        return int(self.pool.shape[1])

    @property
    def shape(self) -> tuple:
        return (self.table.shape[0], self.slots, *self.pool.shape[2:])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.pool.dtype

    def physical(self, index: Array) -> Array:
        """index [B, n] (entry slots of each row) -> [B, n] rows of the flattened pool
        (``page * E + offset``); indices outside [0, T) or on a page the row does not hold
        map to ``P * E`` (past the pool: a scatter drops them, a gather reads row 0)."""
        xp = namespace(self.table, index)
        e, rows = self.page_entries, self.pool.shape[0] * self.page_entries
        inside = (index >= 0) & (index < self.slots)
        slot = xp.where(inside, index, 0)
        page = xp.take_along_axis(self.table, slot // e, axis=1)
        return xp.where(inside & (page >= 0), page * e + slot % e, rows).astype(np.int32)

    def take(self, index: Array):
        """The rows at `index` [B, n] (entry slots; out of range or unheld: pool row 0, which
        the readers mask) in the pool's form: [B, n, D] array or `QuantizedRows`."""
        return self._gather(self.physical(index))

    def _gather(self, flat: Array):
        """The pool's rows `flat` [B, n] (`physical`; past the pool: row 0) in the pool's form."""
        rows = self.pool.shape[0] * self.page_entries
        at = namespace(flat).minimum(flat, rows - 1)
        return jax.tree.map(lambda a: a.reshape(rows, *a.shape[2:])[at], self.pool)

    def view(self):
        """The entries [B, T, D] as a contiguous cache holds them (zeros where no page is held:
        a page is zeroed when taken). A gather of every held page's rows."""
        xp = namespace(self.table, *jax.tree.leaves(self.pool))  # NumPy only in a host break's twin
        index = xp.broadcast_to(xp.arange(self.slots, dtype=np.int32)[None], (self.table.shape[0], self.slots))
        flat = self.physical(index)
        rows = self._gather(flat)
        held = flat < self.pool.shape[0] * self.page_entries
        return jax.tree.map(lambda a: xp.where(held.reshape(*held.shape, *([1] * (a.ndim - 2))), a,
                                               xp.zeros((), a.dtype)), rows)

    def scatter(self, index: Array, encoded) -> PagedRows:
        """The rows with ``row b, slot index[b, j]`` set to ``encoded[b, j]`` (in the pool's form,
        already encoded for an FP8 pool); indices outside the row's pages dropped."""
        flat = self.physical(index)
        rows = self.pool.shape[0] * self.page_entries

        def put(pool, values):
            xp = namespace(pool, flat, values)
            target = pool.reshape(rows, *pool.shape[2:])
            values = values.reshape(values.shape[0] * values.shape[1], *values.shape[2:]).astype(pool.dtype)
            if xp is jnp:
                target = target.at[flat.reshape(-1)].set(values, mode="drop")
            else:
                target, keep = np.array(target, copy=True), flat.reshape(-1) < rows
                target[flat.reshape(-1)[keep]] = values[keep]
            return target.reshape(pool.shape)

        return self.replace(pool=jax.tree.map(put, self.pool, encoded))


# ---------------------------------------------------------------------------- making one
def check_paging(page_size, num_pages, ratios: tuple, batch: int, max_seq_len: int) -> tuple[int, int] | None:
    """`init_cache`'s page_size / num_pages, checked: None for a contiguous cache, else
    (page_size, num_pages). page_size a positive multiple of every compress ratio of the layer
    (`ratios`; V4's 4 and 128 fit 256); num_pages defaults to what a contiguous cache reserves
    (every row at max_seq_len)."""
    if page_size is None:
        if num_pages is not None:
            raise ValueError(f"num_pages: a pool of pages needs page_size too, got num_pages={num_pages!r} "
                             "and page_size=None")
        return None
    for name, value in (("page_size", page_size), ("num_pages", num_pages)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    bad = [m for m in ratios if page_size % m]
    if bad:
        raise ValueError(f"page_size: expected a multiple of the layer's compress ratios {sorted(set(ratios))} "
                         f"(a page holds whole entries), got {page_size}")
    per_row = math.ceil(max_seq_len / page_size)
    return int(page_size), int(num_pages if num_pages is not None else batch * per_row)


def empty_table(batch: int, max_seq_len: int, page_size: int, num_pages: int) -> PageTable:
    """No row holds a page (host arrays)."""
    return PageTable(table=np.full((batch, math.ceil(max_seq_len / page_size)), -1, np.int32),
                     refs=np.zeros((num_pages,), np.int32), page_size=page_size)


def bind(cache):
    """The cache with its paged entries as `PagedRows` (what the step's stages read and write);
    a contiguous cache as it is."""
    pages = cache.pages
    if pages is None:
        return cache

    def bound(state):
        ratio = pages.page_size // state.entries.shape[1]  # tokens an entry
        slots = max(1, cache.max_seq_len // ratio)  # `config.entry_slots`
        return state.replace(entries=PagedRows(pool=state.entries, table=pages.table, slots=slots))

    return cache.replace(**{part: bound(getattr(cache, part)) for part in ("compressor", "indexer")
                            if getattr(cache, part) is not None})


def unbind(cache):
    """The inverse of `bind`: the pools back in place of their `PagedRows`."""
    if cache.pages is None:
        return cache
    return cache.replace(**{part: getattr(cache, part).replace(entries=getattr(cache, part).entries.pool)
                            for part in ("compressor", "indexer") if getattr(cache, part) is not None})


# ---------------------------------------------------------------------------- taking and giving back pages
def stack_of(caches) -> tuple[list, bool]:
    """(the caches as a list, whether one cache was given rather than a stack's sequence)."""
    if isinstance(caches, (list, tuple)):
        return list(caches), False
    return [caches], True


def shared_table(stack: list) -> PageTable | None:
    """The page table every paged cache of a stack holds (None: no cache is paged). A stack
    whose caches hold different tables (not kept together by this module's functions) is a
    `ValueError` naming ``caches``."""
    tables = [c.pages for c in stack if c.pages is not None]
    if not tables:
        return None
    first = tables[0]
    for i, other in enumerate(tables[1:], 1):
        if other is first:
            continue
        if (other.page_size != first.page_size or np.shape(other.table) != np.shape(first.table)
                or np.shape(other.refs) != np.shape(first.refs)
                or not (np.array_equal(np.asarray(other.table), np.asarray(first.table))
                        and np.array_equal(np.asarray(other.refs), np.asarray(first.refs)))):
            raise ValueError(f"caches: expected the paged caches of one stack to hold one page table (made by "
                             f"one init_cache per layer with the same batch, max_seq_len, page_size and num_pages, "
                             f"and changed only by reserve_pages / reset_rows / fork_rows on the whole stack), "
                             f"got a different table in the stack's paged cache {i}")
    return first


def reserve_to(caches, totals, what: str = "caches", donate: bool = False):
    """`caches` (one cache or a stack's sequence) with every row holding the pages for
    ``totals[b]`` tokens (capped at ``max_seq_len``): the pages it lacks taken from the pool in
    order and zeroed, every layer's pools in one compiled program (`write_stack_pools`;
    `donate`: in place). Eager only (host page tables). A pool without enough free pages is a
    `ValueError` naming the pages needed and free, nothing changed."""
    stack, single = stack_of(caches)
    pages = shared_table(stack)
    if pages is None:
        return caches
    if is_tracer(pages.table) or is_tracer(totals):
        raise TypeError(f"{what}: pages are taken eagerly, before a jitted step (dsv4_jax.reserve_pages), "
                        "not under jax.jit")
    for c in stack:
        if c.pages is not None:
            _check_live(c, what)
    table, refs = np.asarray(pages.table), np.asarray(pages.refs)
    max_seq_len = max(c.max_seq_len for c in stack if c.pages is not None)
    totals = np.minimum(np.broadcast_to(np.asarray(totals, np.int64), table.shape[:1]), max_seq_len)
    need = -(-totals // pages.page_size)
    held = (table >= 0).sum(axis=1)
    missing = np.maximum(need - held, 0)
    wanted = int(missing.sum())
    if wanted == 0:
        return caches
    free = np.flatnonzero(refs == 0)
    if wanted > free.size:
        raise ValueError(
            f"pages: expected a pool with {wanted} free pages of {pages.page_size} tokens for this call "
            f"(rows {np.flatnonzero(missing).tolist()} need {missing[missing > 0].tolist()}), got {free.size} free "
            f"of {pages.num_pages}; make the cache with more num_pages, or free rows with reset_rows")
    taken = free[:wanted]
    new_table, new_refs = table.copy(), refs.copy()
    at = 0
    for b in np.flatnonzero(missing):
        new_table[b, held[b]:held[b] + missing[b]] = taken[at:at + missing[b]]
        at += missing[b]
    new_refs[taken] = 1
    new_pages = pages.replace(table=new_table, refs=new_refs)
    out = write_stack_pools([c if c.pages is None else c.replace(pages=new_pages) for c in stack], _zero_pages,
                            (taken.astype(np.int32),), donate)
    return out[0] if single else type(caches)(out)


def _zero_pages(pool, at):
    return pool.at[at].set(0)


def _copy_pages(pool, frm, to):
    return pool.at[to].set(pool[frm])


def pools_consumed(cache) -> bool:
    """Whether a paged cache's pools were donated to an earlier write (`write_stack_pools` with
    `donate`, or a step that donates its cache): deleted arrays."""
    return any(isinstance(a, jax.Array) and not is_tracer(a) and a.is_deleted()
               for state in (cache.compressor, cache.indexer) if state is not None
               for a in jax.tree.leaves(state.entries))


def _check_live(cache, what: str) -> None:
    if pools_consumed(cache):
        raise ValueError(f"{what}: expected a live cache, got one whose pools were donated to an earlier call "
                         "(donate=True, or a layer with donate_cache=True); pass the cache that call returned")


def write_stack_pools(caches: list, write, indices: tuple, donate: bool = False) -> list:
    """The caches (a stack's list) with ``write(pool, *indices)`` applied to every pool (every
    array of the compressor's and the indexer's paged entries) of every paged cache (caches
    without pages pass through), all of them in ONE compiled program (one a stack's pool shapes
    and `write`: a server's repeated calls compile nothing new), one dispatch for the stack.

    A pool is some GB at long contexts: by default the write makes new pools (the caller's
    caches stay as they were, the two held at once for the call); `donate` writes the device
    pools in place, as `DeepseekV4Attention(donate_cache=True)` does the step's writes (no copy;
    the caches passed in are unusable after). A host (NumPy) pool is copied to the device and
    written there. A pool given twice to be donated (the same cache twice in the list) is a
    `ValueError` naming ``caches``, nothing written."""
    stack = list(caches)
    at = [i for i, c in enumerate(stack) if c.pages is not None]
    pools = [{part: getattr(stack[i], part).entries for part in ("compressor", "indexer")
              if getattr(stack[i], part) is not None} for i in at]
    leaves, treedef = jax.tree.flatten(pools)
    if not leaves:
        return stack
    in_place = [bool(donate) and isinstance(a, jax.Array) for a in leaves]
    donated = [a for a, d in zip(leaves, in_place) if d]
    if len({id(a) for a in donated}) != len(donated):
        raise ValueError("caches: expected each layer's cache once in the stack, got the same pools twice "
                         "(with donate=True a pool can be written in place only once)")
    written, copied = _stack_write(write)(donated, [a for a, d in zip(leaves, in_place) if not d], *indices)
    written, copied = iter(written), iter(copied)
    new_pools = jax.tree.unflatten(treedef, [next(written) if d else next(copied) for d in in_place])
    for i, parts in zip(at, new_pools):
        stack[i] = stack[i].replace(**{part: getattr(stack[i], part).replace(entries=pool)
                                       for part, pool in parts.items()})
    return stack


@functools.cache
def _stack_write(write):
    """`write` over lists of pools, compiled (one program a list of shapes): the first list
    donated (written in place), the second copied."""
    def run(donated: list, kept: list, *indices):
        return [write(a, *indices) for a in donated], [write(a, *indices) for a in kept]

    return jax.jit(run, donate_argnums=0)


def release(pages: PageTable, rows) -> PageTable:
    """`pages` with the rows `rows` (int indices, or a bool mask [B] when traced) holding none:
    their pages' reference counts decremented (a page no row holds is free; its rows are
    zeroed when it is taken again)."""
    table, refs = pages.table, pages.refs
    if isinstance(table, np.ndarray) and isinstance(rows, np.ndarray) and rows.dtype != bool:
        table, refs = table.copy(), refs.copy()
        held = table[rows]
        np.subtract.at(refs, held[held >= 0], 1)
        table[rows] = -1
        return pages.replace(table=table, refs=refs)
    table, refs = jnp.asarray(table), jnp.asarray(refs)
    if getattr(rows, "dtype", None) == jnp.bool_:
        mask = rows
    else:
        mask = jnp.zeros(table.shape[:1], jnp.bool_).at[rows].set(True)
    drop = mask[:, None] & (table >= 0)
    given = jnp.zeros_like(refs).at[jnp.where(drop, table, refs.shape[0])].add(1, mode="drop")
    return pages.replace(table=jnp.where(mask[:, None], -1, table), refs=refs - given)


def map_rows(fn, cache):
    """``fn`` of the cache's per-row fields: a paged cache's pools and page table (not per row:
    `release`, `fork_pages` change them) are taken out before and put back after, as they
    were; a contiguous cache goes to ``fn`` whole."""
    return map_stack_rows(lambda stack: [fn(stack[0])], [cache])[0]


def map_stack_rows(fn, caches: list) -> list:
    """`map_rows` of a stack: ``fn`` of the list of the caches' per-row fields (one call, e.g.
    one jitted program for every layer), each paged cache's pools and table put back after."""
    taken = [{part: getattr(c, part).entries for part in ("compressor", "indexer") if getattr(c, part) is not None}
             if c.pages is not None else None for c in caches]
    rows = [c if pools is None else c.replace(pages=None, **{part: getattr(c, part).replace(entries=None)
                                                             for part in pools})
            for c, pools in zip(caches, taken)]
    return [new if pools is None else new.replace(
                pages=c.pages, **{part: getattr(new, part).replace(entries=pool) for part, pool in pools.items()})
            for c, new, pools in zip(caches, fn(rows), taken)]


def row_limit(cache) -> Array | int:
    """The most tokens each row may hold now: ``max_seq_len``, or for a paged cache [B] the
    tokens its pages hold (at most ``max_seq_len``). A step past it leaves the row unchanged
    (`contiguous.overflows`)."""
    if cache.pages is None:
        return cache.max_seq_len
    capacity = cache.pages.capacity()  # NumPy in the wide break's host twin, else JAX
    return namespace(capacity).minimum(cache.max_seq_len, capacity)


def check_pages(pages: PageTable, what: str = "cache.pages") -> None:
    """A host page table that the pool can hold: entries in [-1, P), a row's pages first
    (no hole), every page's reference count the number of rows holding it. `ValueError`
    naming `what` otherwise (a crafted table, or one changed without this module)."""
    table, refs = np.asarray(pages.table), np.asarray(pages.refs)
    n = refs.shape[0]
    bad = (table < -1) | (table >= n)
    if bad.any():
        raise ValueError(f"{what}.table: expected pool pages in [0, {n}) or -1, got {table[bad][:8].tolist()}")
    held = table >= 0
    if (held[:, 1:] & ~held[:, :-1]).any():
        raise ValueError(f"{what}.table: expected each row's pages first, then -1, got a row with a hole: "
                         f"rows {np.flatnonzero((held[:, 1:] & ~held[:, :-1]).any(axis=1)).tolist()}")
    counts = np.bincount(table[held], minlength=n)
    if not np.array_equal(counts, refs):
        pages_off = np.flatnonzero(counts != refs)[:8].tolist()
        raise ValueError(f"{what}.refs: expected each page's count of the rows holding it (a page held twice "
                         f"only through fork_rows), got pages {pages_off} held by {counts[pages_off].tolist()} rows "
                         f"but counted {refs[pages_off].tolist()}")
    dup = [b for b in range(table.shape[0]) if len(set(table[b][held[b]].tolist())) != int(held[b].sum())]
    if dup:
        raise ValueError(f"{what}.table: expected distinct pages within a row, got a page twice in rows {dup}")


def reserve_pages(caches, new_tokens, *, donate: bool = False):
    """`caches` (one layer's cache, or a stack's list/tuple of them) with every row holding the
    pages for `new_tokens` (int, or [B]) more tokens than it has (capped at ``max_seq_len``).

    What a loop under your own `jax.jit` calls before it runs (nothing can take pages inside
    it: a row whose step would run past its pages is left unchanged, its output NaN). The
    layer's eager calls take their pages themselves. Eager only; a pool without enough free
    pages is a `ValueError` naming the pages needed and free, the caches unchanged. Caches of
    sliding layers (nothing paged) pass through. The pages taken are zeroed: in a new pool by
    default, in place with `donate=True` (no copy of each pool; the caches passed in are
    unusable after a call that took pages)."""
    stack, _ = stack_of(caches)
    paged_caches = [c for c in stack if c.pages is not None]
    if not paged_caches:
        return caches
    if any(is_tracer(c.length) or is_tracer(c.pages.table) for c in paged_caches):
        raise TypeError("caches: pages are taken eagerly, before a jitted step (dsv4_jax.reserve_pages), "
                        "not under jax.jit")
    new = np.asarray(new_tokens)
    if is_tracer(new_tokens) or not np.issubdtype(new.dtype, np.integer) or (new < 0).any():
        raise ValueError(f"new_tokens: expected a non-negative int or ints [B] (eagerly), got {new_tokens!r}")
    length = np.asarray(paged_caches[0].length)
    return reserve_to(caches, length + new, donate=bool(donate))


def fork_pages(caches: list, src: np.ndarray, dst: np.ndarray, lengths: list, donate: bool = False,
               what: str = "caches") -> list:
    """A stack's caches (a list; those without pages pass through) with rows `dst` holding the
    pages rows `src` hold, one decision on the host for the shared table (`shared_table`):
    the source's pages that no later write or rewind can reach shared (those wholly below
    ``length - max_rewind`` tokens; their reference counts go up), the rest of the pages its
    tokens fill copied into pages taken from the pool (in order), every layer's copies in one
    compiled program (`write_stack_pools`; `donate`: in place). A destination's own pages go
    back first. `lengths`: each cache's host length [B] (None where not paged).

    Refused before anything is written (every cache unchanged): tables that differ or paged
    caches of other lengths or max_rewind (`ValueError` naming ``caches``), a consumed cache
    (naming `what`), a short pool (`ValueError` naming the pages needed and free). The per-row
    fields are `rows.fork_rows`'."""
    pages = shared_table(caches)
    paged_at = [i for i, c in enumerate(caches) if c.pages is not None]
    for i in paged_at:
        _check_live(caches[i], what)
    first = paged_at[0]
    for i in paged_at[1:]:
        if caches[i].max_rewind != caches[first].max_rewind or not np.array_equal(lengths[i], lengths[first]):
            raise ValueError(f"caches: expected the paged caches of one stack at the same lengths and max_rewind "
                             f"(they decide which pages a fork shares), got cache {i} at {lengths[i].tolist()} "
                             f"(max_rewind={caches[i].max_rewind}), cache {first} at {lengths[first].tolist()} "
                             f"(max_rewind={caches[first].max_rewind})")
    table, refs = np.asarray(pages.table).copy(), np.asarray(pages.refs).copy()
    length = lengths[first]
    ps, keep = pages.page_size, caches[first].max_rewind
    for d in dst:  # a destination starts from nothing
        held = table[d][table[d] >= 0]
        np.subtract.at(refs, held, 1)
        table[d] = -1
    copies: list[tuple[int, int]] = []  # (source page, new page)
    for s, d in zip(src.tolist(), dst.tolist()):
        filled = -(-int(length[s]) // ps)
        shared = max(0, int(length[s]) - keep) // ps
        free = np.flatnonzero(refs == 0)
        if filled - shared > free.size:
            raise ValueError(f"pages: expected a pool with {filled - shared} free pages of {ps} tokens to fork row "
                             f"{s} into row {d} ({shared} of its {filled} pages shared), got {free.size} free of "
                             f"{pages.num_pages}; make the cache with more num_pages, or free rows with reset_rows")
        table[d, :shared] = table[s, :shared]
        refs[table[s, :shared]] += 1
        taken = free[:filled - shared]
        table[d, shared:filled] = taken
        refs[taken] = 1
        copies += list(zip(table[s, shared:filled].tolist(), taken.tolist()))
    new_pages = pages.replace(table=table, refs=refs)
    stack = [c if c.pages is None else c.replace(pages=new_pages) for c in caches]
    if not copies:
        return stack
    frm, to = (np.array(c, np.int32) for c in zip(*copies))  # NumPy: the program's own transfer
    return write_stack_pools(stack, _copy_pages, (frm, to), donate)
