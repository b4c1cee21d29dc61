"""The attention cache: a pytree of fixed-shape arrays sized by `max_seq_len`.

Unlike HF's DynamicCache (which grows by concatenation and so cannot be compiled), every
field here has a shape fixed at `init_cache` time, so a whole prefill or decode step
compiles into one XLA program, and decode steps reuse it.

Layout for a batch of B rows, window W, compress ratio m, T = `cfg.entry_slots` entries
(``max_seq_len // m``, at least one):

==================  ====================  ===============================================
field               shape                 meaning
==================  ====================  ===============================================
length              [B] int32             tokens seen per row (a host mirror when eager)
window              [B, W, D]             rotated K=V of the last W tokens, slot p % W
compressor          CompressorCache       CSA/HCA layers: compressed KV entries + a ring of
                                          the last tokens' raw projections (slot p % R)
indexer             CompressorCache       CSA layers: the indexer's own key compressor
pages               PageTable or None     a paged cache's page table (`cache.paged`): the
                                          entries are then pools of pages, not [B, T, Dc]
window_history      [B, K, D] or None     with ``max_rewind=K``: the K tokens just older
                                          than the window ring, slot q % K (`history`)
rewindable          [B] int32 or None     with ``max_rewind=K``: tokens each row can take
                                          back (`rows.rewind_rows`; a host mirror when eager)
==================  ====================  ===============================================

With ``kv_cache_dtype="fp8"`` the window and the entries (the main KV and the indexer's
keys) are `quantized_cache.QuantizedRows` standing for those [B, N, D] arrays: FP8 grid values
and scale bytes, lossless for the official numerics (the rings stay in the cache dtype).

Rewind (``init_cache(..., max_rewind=K)``, K > 0): every ring (the window, the compressors'
`buffer`) keeps a history of K slots and the cache a per-row count of rewindable tokens, so
`rows.rewind_rows` can take back a row's last tokens exactly (`history` says how and what it
costs). ``max_rewind=0`` (the default) keeps none of it: those fields are None, the step writes
nothing more.

Ragged batches: a call may carry a different number of real tokens per row; a row's padded
slots (position `PAD` = -1, after its real tokens) write nothing and `length` counts real
tokens only (`real_tokens`, `advance_length`). `reset_rows` empties chosen rows.

Who owns `length`: the step. `attention_step` returns the new length,
``advance_length(length, S)``, like every other field of the cache. The layer's eager call
path keeps a **host mirror** instead of that device value: the length it checked on the host
before dispatch, advanced by the same `advance_length` after the step ran. So the checks
that need its value (positions continue the cache, room is left) run without a device round
trip, and a rejected call never touches the device state. Under a user's `jax.jit` there is
no mirror: the length is the step's (a tracer), and a call that would run past `max_seq_len`
leaves the cache unchanged and returns NaN (`overflows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsv4_jax.backend import Array, is_tracer, namespace
from dsv4_jax.cache import paged
from dsv4_jax.cache.paged import PageTable
from dsv4_jax.cache.quantized import check_kv_cache_dtype, quantized_zeros, write_rows
from dsv4_jax.config import CSA, HCA, SLIDING


@struct.dataclass
class CompressorCache:
    """State of one gated-pooling compressor (spec section 5.5).

    entries:      [B, T, Dc]      compressed entries emitted so far (entry w at row w);
                                  the count is ``length // ratio``
    buffer:       [B, R, 2*n*Dc]  the raw kv and gate projections (the gate without position
                                  bias) of the last R tokens side by side, ``[kv | gate]``:
                                  a ring, slot p % R

    n = 2 and R = 2m for the overlapping CSA layout (the unfinished window and the window
    before it, whose Ca half the next entry pools), n = 1 and R = m for HCA (the unfinished
    window). The ring is written like the window cache (`insert_ring`, one write for both
    projections): slot ``p % R`` holds token p for the last R positions, so every path (prefill
    chunks, decode steps) leaves the same state. Ring slots of positions before 0 and rows of
    `entries` at or beyond ``length // m`` hold zeros (nothing was written there).

    history:      [B, K, 2*n*Dc]  or None: with ``max_rewind=K``, the K tokens just older than
                                  the ring, slot q % K (`dsv4_jax.cache.history`)
    """

    entries: Array
    buffer: Array
    history: Array | None = None


@struct.dataclass
class AttentionCache:
    """Per-layer cache of `DeepseekV4Attention` (see the module docstring for the layout)."""

    length: Array
    window: Array
    compressor: CompressorCache | None = None
    indexer: CompressorCache | None = None
    window_history: Array | None = None
    rewindable: Array | None = None
    pages: PageTable | None = None
    layer_idx: int = struct.field(pytree_node=False, default=-1)
    layer_type: str = struct.field(pytree_node=False, default=SLIDING)
    max_seq_len: int = struct.field(pytree_node=False, default=0)
    # The numerics of the layer that made it ("reference" / "official"; None: made without a
    # layer). Its rows hold that numerics' rounding, so a layer of the other one refuses it.
    numerics: str | None = struct.field(pytree_node=False, default=None)

    @property
    def batch_size(self) -> int:
        return int(self.window.shape[0])

    @property
    def dtype(self):
        return self.window.dtype

    @property
    def max_rewind(self) -> int:
        """K: the most tokens a row can take back (`rows.rewind_rows`); 0 where the cache
        keeps no history (``init_cache(..., max_rewind=0)``, the default)."""
        return 0 if self.window_history is None else int(self.window_history.shape[1])


# The fields an eager cache keeps as host mirrors (NumPy [B] int32): the step returns their
# device values, the eager call path replaces them by the values it computed on the host.
HOST_MIRRORS = ("length", "rewindable")


PAD = -1  # the position of a padded slot (ragged batches): after a row's real tokens


def real_tokens(positions: Array) -> Array:
    """[B] int32: the real (non-padded) tokens of each row of a call, ``sum(positions >= 0)``.

    positions [B, S] int: a row's real tokens come first (``length .. length + n - 1``), then
    padded slots at `PAD` (-1). NumPy in, NumPy out (the host mirror); JAX in, JAX out."""
    return (positions >= 0).sum(axis=1).astype(np.int32)


def next_positions(length: Array, seq: int) -> Array:
    """[B, seq] int32: each row's next `seq` positions, ``length[b] .. length[b] + seq - 1``.

    What a call without positions runs at (``attn(x, None, cache)``, ``attention_step(...,
    positions=None, ...)``): every slot real, every row continuing its cache. Derived inside a
    jitted step, the positions are no argument of the compiled program: a decode loop then
    hands the program no new buffer for them each step (XLA re-records the commands of a CUDA
    graph that read a buffer which moved; docs/breaks_and_kernels.md, "Why the kernels' defaults").
    NumPy in, NumPy out (the host mirror); JAX in, JAX out."""
    if isinstance(length, np.ndarray):
        return (length[:, None] + np.arange(seq, dtype=np.int32)).astype(np.int32)
    return jnp.asarray(length, jnp.int32)[:, None] + jnp.arange(seq, dtype=jnp.int32)[None, :]


def advance_length(length: Array, new_tokens) -> Array:
    """`length` after a call of `new_tokens` real tokens per row (an int, or [B] for a ragged
    call, see `real_tokens`): the one rule, applied in the step (to the device length it
    returns) and by the eager call path (to its host mirror)."""
    if isinstance(length, np.ndarray):  # the host mirror stays int32 NumPy
        return (length + np.asarray(new_tokens)).astype(np.int32)
    return length + new_tokens


def advance_rewindable(rewindable: Array | None, new_tokens, frozen=None, max_rewind: int = 0):
    """`rewindable` after a call of `new_tokens` real tokens per row (int or [B]): each row can
    take back ``min(K, rewindable + new_tokens)`` tokens (its history holds that many of the
    tokens its ring evicted, or they were never evicted); rows in `frozen` [B] bool (written
    nothing) keep theirs. None (a cache without history) stays None. NumPy in, NumPy out (the
    host mirror); JAX in, JAX out."""
    if rewindable is None:
        return None
    if isinstance(rewindable, np.ndarray):
        return np.minimum(rewindable + np.asarray(new_tokens), max_rewind).astype(np.int32)
    grown = jnp.minimum(jnp.asarray(rewindable, jnp.int32) + new_tokens, max_rewind).astype(jnp.int32)
    return grown if frozen is None else jnp.where(frozen, jnp.asarray(rewindable, jnp.int32), grown)


def overflows(length: Array, new_tokens, max_seq_len: int) -> Array:
    """[B] bool: rows for which a call of `new_tokens` real tokens (int or [B]) would run past
    `max_seq_len`.

    The eager call refuses such a call before dispatch. Under a user's `jax.jit` nothing can
    refuse it, so the step applies this rule per row: an overflowing row's cache stays exactly
    as it was (its scatters are dropped, its `length` is not advanced) and its real slots'
    output is NaN; the other rows run as usual. The next eager call then sees the old length
    and checks against it."""
    return length + new_tokens > max_seq_len


def reset_rows(cache, rows):
    """The cache with `rows` emptied (length 0, every array of the row zero, as
    `init_attention_cache` makes it: its rewind history and count too) and every other row
    untouched.

    For serving loops and batched evaluation: a finished sequence's row is reset and a new
    sequence starts there at position 0 while the other rows go on. Shapes and static fields
    do not change, so the same compiled step keeps serving (no recompilation).

    cache: one layer's `AttentionCache`, or a stack's list/tuple of them (the same rows of
          every layer; the same kind comes back). Every layer's rows are zeroed in one
          compiled program (one a stack's structure); a stack's paged caches must hold one page
          table (`paged.shared_table`: a `ValueError` naming ``caches`` otherwise), which the
          rows' pages go back to once for all of them.
    rows: row indices (a sequence or int array [R], negative counted from the end) or a bool
          mask [B]. Eagerly, out-of-range indices and masks of the wrong length raise a
          `ValueError` naming ``rows`` (nothing changed). Under `jax.jit` (traced `rows`) no
          check can run: out-of-range indices are ignored, a mask must be [B] (a shape check).

    Jittable. The data arrays are rewritten (a copy unless the cache is donated, as in a
    jitted serving step; XLA updates donated buffers in place). A paged cache's rows give
    their pages back to the pool (`paged.release`). An eager cache keeps its host length
    mirror (a NumPy array, see the module docstring); a traced or device length stays on
    the device.
    """
    stack, single = checked_stack(cache)
    if not stack:
        return cache
    batch = stack[0].batch_size
    # Concrete rows are checked and become indices (also under a jit whose cache is traced);
    # traced rows become a [B] mask, which cannot be checked.
    idx = _traced_rows(rows, batch) if is_tracer(rows) else _host_rows(rows, batch)
    released = _released_pages(stack, idx)
    # The program takes a [B] mask (one compile per structure, whatever the rows' count).
    mask = idx if idx.dtype == jnp.bool_ else _host_mask(idx, batch)
    data = paged.map_stack_rows(lambda per_row: _zero_stack(per_row, mask),
                                [c.replace(**dict.fromkeys(HOST_MIRRORS)) for c in stack])
    new = []
    for i, (c, d) in enumerate(zip(stack, data)):
        if c.pages is not None:  # a paged cache's rows give their pages back instead
            d = d.replace(pages=released[i])
        mirrors = {}
        for name in HOST_MIRRORS:
            mirror = getattr(c, name)
            if mirror is None:
                continue
            if isinstance(mirror, np.ndarray) and isinstance(idx, np.ndarray):
                mirror = mirror.copy()
                mirror[idx] = 0
            else:
                mirror = _zero_rows(jnp.asarray(mirror, jnp.int32), idx)
            mirrors[name] = mirror
        new.append(d.replace(**mirrors))
    return new[0] if single else type(cache)(new)


def checked_stack(cache) -> tuple[list, bool]:
    """(one cache or a stack's list/tuple of them as a list, whether one was given): each an
    `AttentionCache` (a `TypeError` naming ``cache`` or ``caches[i]``), every one of the same
    batch size (a `ValueError` naming ``caches``)."""
    stack, single = paged.stack_of(cache)
    for i, c in enumerate(stack):
        if not isinstance(c, AttentionCache):
            where = "cache" if single else f"caches[{i}]"
            raise TypeError(f"{where}: expected an AttentionCache, got {type(c).__name__}")
    other = [i for i, c in enumerate(stack) if c.batch_size != stack[0].batch_size]
    if other:
        raise ValueError(f"caches: expected the caches of one stack to hold the same rows (batch size "
                         f"{stack[0].batch_size}), got cache {other[0]} of batch size {stack[other[0]].batch_size}")
    return stack, single


def _released_pages(stack: list, idx) -> list:
    """Each cache's page table with rows `idx` holding no page (None: not paged). Concrete
    tables: the stack's one table (`paged.shared_table`), released once; traced ones (a user's
    jit) cannot be compared, and each is released."""
    if any(c.pages is not None and is_tracer(c.pages.table) for c in stack):
        return [None if c.pages is None else paged.release(c.pages, idx) for c in stack]
    table = paged.shared_table(stack)
    released = None if table is None else paged.release(table, idx)
    return [None if c.pages is None else released for c in stack]


def _host_mask(idx: np.ndarray, batch: int) -> np.ndarray:
    mask = np.zeros((batch,), bool)
    mask[idx] = True
    return mask


@jax.jit
def _zero_stack(caches: list, mask) -> list:
    """Every leaf's rows where `mask` [B] is set to zero."""
    return jax.tree.map(lambda a: _zero_rows(a, mask), caches)


def _host_rows(rows, batch: int) -> np.ndarray:
    """Concrete `rows` -> int32 indices in [0, B) (ValueError naming `rows` otherwise)."""
    arr = np.asarray(rows)
    if arr.dtype == bool:
        if arr.shape != (batch,):
            raise ValueError(f"rows: expected a bool mask of shape [{batch}] (the batch), got shape {list(arr.shape)}")
        return np.nonzero(arr)[0].astype(np.int32)
    if arr.ndim > 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"rows: expected row indices (ints) or a bool mask [{batch}], got {arr.dtype} "
                        f"of shape {list(arr.shape)}")
    arr = arr.reshape(-1).astype(np.int64)
    bad = (arr < -batch) | (arr >= batch)
    if bad.any():
        raise ValueError(f"rows: expected row indices in [-{batch}, {batch}) (batch size {batch}), "
                         f"got {arr[bad].tolist()}")
    return (arr % batch).astype(np.int32)


def _traced_rows(rows, batch: int):
    """Traced `rows` -> a bool mask [B] (masks pass through; indices out of range are ignored)."""
    if rows.dtype == jnp.bool_:
        if rows.shape != (batch,):
            raise ValueError(f"rows: expected a bool mask of shape [{batch}] (the batch), got shape {list(rows.shape)}")
        return rows
    if rows.ndim > 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise TypeError(f"rows: expected row indices (ints) or a bool mask [{batch}], got {rows.dtype} "
                        f"of shape {list(rows.shape)}")
    rows = rows.reshape(-1)
    rows = jnp.where(rows < 0, rows + batch, rows)
    return jnp.zeros((batch,), jnp.bool_).at[rows].set(True, mode="drop")


def _zero_rows(a: Array, rows) -> Array:
    """`a` [B, ...] with the rows `rows` (int indices, or a bool mask [B]) set to zero."""
    if getattr(rows, "dtype", None) == jnp.bool_ and rows.shape == (a.shape[0],):
        return jnp.where(rows.reshape(-1, *([1] * (a.ndim - 1))), jnp.zeros((), a.dtype), a)
    return jnp.asarray(a).at[jnp.asarray(rows)].set(0)


def init_compressor_cache(batch: int, entries: int, ratio: int, dim: int, width: int, overlap: bool,
                          dtype, entry_format=None, max_rewind: int = 0,
                          pool: tuple[int, int] | None = None) -> CompressorCache:
    """An empty compressor state: `entries` slots of `dim`, a ring of `ring_slots(ratio, overlap)`
    tokens' kv and gate projections, each `width` (= n*dim) wide. `entry_format`: None (entries
    in `dtype`), or ``(grid, rope_dim)`` for FP8 entries (`quantized_cache.quantized_zeros`).
    `max_rewind` K > 0: the ring's history of K slots (`dsv4_jax.cache.history`).
    `pool`: (pages, entries a page) for a paged cache's entries [P, E, dim] instead of [B, T, dim]."""
    rows, slots = pool if pool is not None else (batch, entries)
    return CompressorCache(
        entries=(jnp.zeros((rows, slots, dim), dtype) if entry_format is None
                 else quantized_zeros(rows, slots, dim, entry_format[1], dtype, entry_format[0])),
        buffer=jnp.zeros((batch, ring_slots(ratio, overlap), 2 * width), dtype),
        history=jnp.zeros((batch, max_rewind, 2 * width), dtype) if max_rewind else None,
    )


def ring_slots(ratio: int, overlap: bool) -> int:
    """Tokens a compressor's ring holds: two windows where an entry also pools the window
    before its own (CSA's overlap), else one."""
    return 2 * ratio if overlap else ratio


def insert_ring(ring: Array, values: Array, length: Array, frozen: Array | None = None,
                count: Array | None = None) -> Array:
    """Write each row's last ``min(count, R)`` real values into their ring slots ``p % R``.

    The window cache and the compressors' rings: ring [B, R, X], values [B, S, X] (positions
    ``length .. length + S - 1``), length [B] (tokens before the call) -> [B, R, X], one
    scatter. frozen [B] bool (optional): rows written nothing (their scatter indices point
    past the ring and are dropped: no copy of the ring). count [B] int32 (optional, ragged
    calls): real tokens per row, ``values[:, :count]``; the padded slots after them write
    nothing (default: all S are real). Runs under XLA or NumPy. An FP8 window
    (`quantized_cache.QuantizedRows`) is written the quantized values.
    """
    r, s = ring.shape[1], values.shape[1]
    n = min(s, r)
    if count is None:
        pos = length[:, None] + (s - n) + np.arange(n, dtype=np.int32)[None, :]
        slot = pos % r
        if frozen is not None:
            slot = namespace(slot, frozen).where(frozen[:, None], r, slot)
        return write_rows(ring, slot, values[:, s - n :])
    # Ragged: row b's last min(count_b, R) real values are its columns count_b - n .. count_b - 1;
    # columns before 0 (a row with fewer than n real tokens) are dropped, never written twice.
    xp = namespace(values, length, count)
    col = count[:, None].astype(np.int32) - n + xp.arange(n, dtype=np.int32)[None, :]  # [B, n]
    keep = col >= 0
    if frozen is not None:
        keep = keep & ~frozen[:, None]
    slot = xp.where(keep, (length[:, None] + col) % r, r)
    picked = xp.take_along_axis(values, xp.maximum(col, 0)[..., None], axis=1)
    return write_rows(ring, slot, picked)


def init_attention_cache(cfg, layer_idx: int, batch_size: int, max_seq_len: int, dtype, *,
                         allow_long_context: bool = False, kv_cache_dtype: str = "auto",
                         max_rewind: int = 0, page_size: int | None = None,
                         num_pages: int | None = None) -> AttentionCache:
    """An empty cache for layer `layer_idx` of `cfg` (all zeros, length 0).

    `max_seq_len` past ``cfg.max_position_embeddings`` is refused (`check_position_limit`)
    unless `allow_long_context`. `kv_cache_dtype`: "auto" (rows in `dtype`) or "fp8" (the
    window and the entries as `quantized_cache.QuantizedRows`: main KV on the FP8 grid with
    `dtype` RoPE channels, indexer keys on the FP4 grid; for ``numerics="official"`` layers).
    `page_size` (tokens, a multiple of the compress ratios) and `num_pages`: a paged cache
    (`cache.paged`: the entries in a pool of `num_pages` pages, default as many as every row at
    `max_seq_len` needs; no page held yet). A sliding layer has nothing that grows: its cache
    is contiguous whatever the paging.
    `max_rewind`: K >= 0, the most tokens a row can take back (`rows.rewind_rows`); K > 0 keeps
    a history of K tokens per ring and the count `rewindable` (`dsv4_jax.cache.history`).
    """
    fp8 = check_kv_cache_dtype(kv_cache_dtype) == "fp8"
    layer_type = cfg.layer_type(layer_idx)
    for name, value in (("batch_size", batch_size), ("max_seq_len", max_seq_len)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    max_rewind = check_max_rewind(max_rewind)
    batch_size, max_seq_len = int(batch_size), int(max_seq_len)
    check_position_limit(cfg, max_seq_len, allow_long_context)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype: expected a floating dtype for the cache, got {dtype}")
    compressor = indexer = pages = None
    if layer_type in (CSA, HCA):
        ratio = cfg.compress_rate(layer_type)
        entry_slots = cfg.entry_slots(layer_type, max_seq_len)
        paging = paged.check_paging(page_size, num_pages, (cfg.csa_compress_rate, cfg.hca_compress_rate),
                                    batch_size, max_seq_len)
        pool = None
        if paging is not None:
            pages = paged.empty_table(batch_size, max_seq_len, *paging)
            pool = (paging[1], paging[0] // ratio)
        compressor = init_compressor_cache(
            batch_size, entry_slots, ratio, cfg.head_dim, cfg.compressor_width(layer_type),
            overlap=layer_type == CSA, dtype=dtype, entry_format=("fp8", cfg.qk_rope_head_dim) if fp8 else None,
            max_rewind=max_rewind, pool=pool,
        )
        if layer_type == CSA:
            indexer = init_compressor_cache(
                batch_size, entry_slots, ratio, cfg.index_head_dim, cfg.compressor_width(CSA, indexer=True),
                overlap=True, dtype=dtype, entry_format=("fp4", 0) if fp8 else None, max_rewind=max_rewind,
                pool=pool,
            )
    else:
        paged.check_paging(page_size, num_pages, (cfg.csa_compress_rate, cfg.hca_compress_rate), batch_size,
                           max_seq_len)

    def window_rows(rows):
        return (quantized_zeros(batch_size, rows, cfg.head_dim, cfg.qk_rope_head_dim, dtype, "fp8")
                if fp8 else jnp.zeros((batch_size, rows, cfg.head_dim), dtype))

    return AttentionCache(
        length=np.zeros((batch_size,), np.int32),
        window=window_rows(cfg.sliding_window),
        compressor=compressor,
        indexer=indexer,
        window_history=window_rows(max_rewind) if max_rewind else None,
        rewindable=np.zeros((batch_size,), np.int32) if max_rewind else None,
        pages=pages,
        layer_idx=layer_idx,
        layer_type=layer_type,
        max_seq_len=max_seq_len,
    )


def check_max_rewind(max_rewind) -> int:
    """`max_rewind`, checked: an int >= 0 (`ValueError` naming it otherwise)."""
    if isinstance(max_rewind, bool) or not isinstance(max_rewind, (int, np.integer)) or max_rewind < 0:
        raise ValueError(f"max_rewind: expected an int >= 0 (the most tokens a row can take back; 0: no "
                         f"history kept), got {max_rewind!r}")
    return int(max_rewind)


def check_position_limit(cfg, max_seq_len: int, allow_long_context: bool = False) -> None:
    """Refuse a cache for positions the model was not trained on, unless asked to.

    A cache of `max_seq_len` tokens holds positions ``0 .. max_seq_len - 1``; past
    ``cfg.max_position_embeddings`` RoPE (YaRN on the compressed layers) runs at angles the
    model never saw, and nothing in the layer would say so. As vLLM refuses a ``max_model_len``
    past the model's limit unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set, this raises a
    `ValueError` naming both values unless `allow_long_context` is True.
    """
    if not isinstance(allow_long_context, (bool, np.bool_)):
        raise TypeError(f"allow_long_context: expected a bool, got {type(allow_long_context).__name__}")
    limit = cfg.max_position_embeddings
    if max_seq_len > limit and not allow_long_context:
        raise ValueError(
            f"max_seq_len: expected at most config.max_position_embeddings={limit} (the positions the model "
            f"was trained for), got {max_seq_len}; pass allow_long_context=True to init_cache to make a cache "
            "past it anyway (positions beyond the trained range: quality is not guaranteed)"
        )


def cache_nbytes(cache: AttentionCache) -> int:
    """Bytes held by the cache's arrays."""
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(cache))
