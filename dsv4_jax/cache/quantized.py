"""FP8 caches: the cache's rows stored on the official numerics' grid, in about half the bytes.

With ``numerics="official"`` (`dsv4_jax.numerics`) every row the layer writes into its caches
is already on a quantization grid: the main attention's KV (window, CSA and HCA entries) on
FP8 e4m3 blocks of 64 with power-of-two scales over its non-RoPE channels, the indexer's keys
on FP4 e2m1 blocks of 32. Storing those rows as grid values plus one scale byte per block
loses nothing: a stored row dequantizes to exactly the value the bf16 cache would hold, so a
layer with ``kv_cache_dtype="fp8"`` gives the same picks and outputs, bit for bit, as with
the bf16 cache (tests/cache/test_quantized_cache.py). This is the layout vLLM's DeepSeek-V4 keeps
(``fp8_ds_mla``: 448 e4m3 values, 64 bf16 RoPE values and 7 UE8M0 scales a main KV row; the
indexer's keys as MXFP4, two e2m1 codes a byte and a UE8M0 scale a block of 32, its 68-byte
variant), as a typed pytree of three arrays instead of one byte record:

=========  ============================  =====================================================
field      shape                         meaning
=========  ============================  =====================================================
values     [B, N, D - rd] float8_e4m3fn  the grid values of the non-RoPE channels; for the
           or [B, N, D / 2] uint8        indexer's keys (grid "fp4") their e2m1 codes, two a
                                         byte (`numerics.pack_fp4`)
scales     [B, N, ceil((D - rd) / blk)]  uint8: each block's scale ``2 ** (byte - 127)``
                                         (UE8M0; 0 reads as zero, so an empty cache reads 0)
rope       [B, N, rd] (the cache dtype)  the RoPE channels, not rounded (rd = 0: indexer keys)
=========  ============================  =====================================================

Bytes a row at V4-Flash sizes (D = 512, rd = 64, indexer head 128): main KV 448 + 7 + 128 =
583 (bf16: 1024); indexer key 64 + 4 = 68 (bf16: 256).

Who reads what: the step writes rows through `write_rows` (the cache's scatters quantize
the rounded rows they are given) and reads them through `read` (the dequantized [B, N, D]
array, in the cache dtype) or, for a CSA decode step, `read_picked` (only the picked rows).
The readers (sparse attention, the XLA and NumPy scoring) see the same arrays as with a bf16
cache. The native selection reads the indexer's packed keys itself (`native.select_topk_fp4`,
chosen by `breaks`: the codes and scale bytes go to the handler, which dequantizes each key
where it loads it), so a long context's scoring reads 68 bytes a key instead of 256
(`kernel_plan.KernelPlan.select_keys`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsv4_jax import numerics
from dsv4_jax.backend import Array, namespace, scatter_rows
from dsv4_jax.cache.paged import PagedRows
from dsv4_jax.config import check_choice

KV_CACHE_DTYPES = ("auto", "fp8")


def check_kv_cache_dtype(kv_cache_dtype) -> str:
    """``kv_cache_dtype``, checked: "auto" (rows in the cache dtype, as the layer computes them)
    or "fp8" (rows on the official grid, `QuantizedRows`; needs ``numerics="official"``)."""
    return check_choice("kv_cache_dtype", kv_cache_dtype, KV_CACHE_DTYPES)


@struct.dataclass
class QuantizedRows:
    """Cache rows [B, N, D] stored as FP8 grid values, scale bytes and bf16 RoPE channels (see
    the module docstring). Quacks like the array it stands for where the cache's checks look
    (`shape`, `dtype`, `sharding`); `dequantize` gives that array."""

    values: Array
    scales: Array
    rope: Array
    block: int = struct.field(pytree_node=False, default=numerics.FP8_BLOCK)
    grid: str = struct.field(pytree_node=False, default="fp8")  # "fp8" (main KV) or "fp4" (indexer keys)

    @property
    def shape(self) -> tuple:
        stored = self.values.shape[-1] * (2 if self.grid == "fp4" else 1)
        return (*self.values.shape[:-1], stored + self.rope.shape[-1])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.rope.dtype

    @property
    def sharding(self):
        return getattr(self.values, "sharding", None)

    @property
    def devices(self):
        return getattr(self.values, "devices", None)

    def dequantize(self) -> Array:
        """[..., N, D] in the cache dtype: the rows as the bf16 cache holds them, bit for bit."""
        values = numerics.unpack_fp4(self.values) if self.grid == "fp4" else self.values
        nope = numerics.dequantize_bits(values, self.scales, self.dtype, self.block)
        if self.rope.shape[-1] == 0:
            return nope
        return namespace(nope, self.rope).concatenate([nope, self.rope], axis=-1)

    def encode(self, rows: Array) -> QuantizedRows:
        """`rows` [..., D] (already on this cache's grid: rounded by the official numerics) in
        this cache's compact form. Quantizing a rounded row again returns its value exactly
        (the scale may come out one power of two lower, with grid values twice as large)."""
        rd = self.rope.shape[-1]
        n = rows.shape[-1] - rd
        quantize = numerics.quantize_to_bits if isinstance(rows, np.ndarray) else _quantize_undifferentiable
        values, scales = quantize(rows[..., :n], self.block, self.grid)
        if self.grid == "fp4":
            values = numerics.pack_fp4(values)
        return QuantizedRows(values=values, scales=scales, rope=rows[..., n:].astype(self.dtype),
                             block=self.block, grid=self.grid)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _quantize_undifferentiable(x: Array, block: int, grid: str):
    """`numerics.quantize_to_bits` under JAX, refusing differentiation with a clear error: the
    gradient through a quantized cache row would not be the straight-through one the layer's
    official rounding uses (the bf16 cache's gradients), so none is given."""
    return numerics.quantize_to_bits(x, block, grid)


@_quantize_undifferentiable.defjvp
def _refuse(block, grid, primals, tangents):
    raise ValueError(
        "cache: an FP8 cache (kv_cache_dtype='fp8') cannot be differentiated through (its rows are stored "
        "quantized, with no straight-through gradient); train with the default cache (kv_cache_dtype='auto'), "
        "which holds the same values")


def quantized_zeros(batch: int, rows: int, dim: int, rope_dim: int, dtype, grid: str) -> QuantizedRows:
    """An empty `QuantizedRows` of `rows` rows of `dim` channels (the last `rope_dim` kept in
    `dtype`): the main KV's layout for ``grid="fp8"`` (blocks of 64), the indexer keys' for
    ``grid="fp4"`` (blocks of 32, ``rope_dim=0``)."""
    block = numerics.FP8_BLOCK if grid == "fp8" else numerics.FP4_BLOCK
    n = dim - rope_dim
    if grid == "fp4" and n % 2:
        raise ValueError(f"index_head_dim: an FP8 cache packs the indexer's keys two values a byte, "
                         f"expected an even width, got {n}")
    values = jnp.zeros((batch, rows, n), numerics.FP8) if grid == "fp8" else jnp.zeros((batch, rows, n // 2), jnp.uint8)
    return QuantizedRows(
        values=values,
        scales=jnp.zeros((batch, rows, math.ceil(n / block)), jnp.uint8),
        rope=jnp.zeros((batch, rows, rope_dim), dtype),
        block=block, grid=grid,
    )


def read(rows) -> Array:
    """The array of cache rows a reader attends to or scores: `rows` dequantized where they are
    `QuantizedRows`, gathered from their pages where they are `paged.PagedRows`, else `rows`
    itself."""
    if isinstance(rows, PagedRows):
        rows = rows.view()
    return rows.dequantize() if isinstance(rows, QuantizedRows) else rows


def read_picked(entries, picks: Array) -> tuple[Array, Array]:
    """(rows, picks) for sparse attention over a CSA layer's picks of `entries`.

    entries [B, T, D] or `QuantizedRows`, or `paged.PagedRows` of either; picks [B, S, K] int32
    (-1 = nothing). Where the entries are FP8 and the picks are fewer rows than the cache holds
    (``S * K < T``: a decode step, or a short chunk on a long context), only the picked rows are
    gathered from the compact arrays (from their pages where paged) and dequantized: rows
    [B, S*K, D] with picks ``s*K + j`` (-1 kept), the same keys in the same order, so every
    attention path gives the same result as over the whole dequantized cache. Otherwise
    (`read_attended`) the entries as they are, paged ones kept paged, and the same picks: the
    attention reads the picks from the pages itself (`sparse_attention`).
    """
    quantized = isinstance(entries.pool if isinstance(entries, PagedRows) else entries, QuantizedRows)
    if not quantized:
        return entries, picks
    batch, seq, k = picks.shape
    if seq * k >= entries.shape[1]:
        return read_attended(entries), picks
    at = jnp.maximum(picks, 0).reshape(batch, seq * k)
    if isinstance(entries, PagedRows):  # the picked rows straight from their pages
        gathered = entries.take(at)
    else:
        gathered = jax.tree.map(lambda a: jnp.take_along_axis(a, at[..., None], axis=1), entries)
    slots = jnp.arange(seq * k, dtype=jnp.int32).reshape(1, seq, k)
    return read(gathered), jnp.where(picks >= 0, slots, -1).astype(picks.dtype)


def read_attended(rows):
    """The rows as sparse attention reads them: `read`, except that paged rows stay paged
    (`paged.PagedRows`, read by index from the pool, `sparse_attention`), their pool dequantized
    where FP8. Dequantizing the pool is the work a contiguous FP8 cache does on its [B, T] rows
    when the pool holds the pages its rows need (a server's spare pages cost their share);
    gathering the rows first and dequantizing those would add a pass over every row read."""
    if isinstance(rows, PagedRows):
        return rows.replace(pool=read(rows.pool))
    return read(rows)


def write_rows(target, index: Array, values: Array):
    """`backend.scatter_rows` for a cache field of either form: ``target[b, index[b, j]] =
    values[b, j]``, out-of-range indices dropped; `values` are quantized first where the target
    is `QuantizedRows` (one scatter per stored array)."""
    if isinstance(target, PagedRows):  # into the rows' pages (encoded first for an FP8 pool)
        pool = target.pool
        return target.scatter(index, pool.encode(values) if isinstance(pool, QuantizedRows) else values)
    if not isinstance(target, QuantizedRows):
        return scatter_rows(target, index, values)
    encoded = target.encode(values)
    return target.replace(values=scatter_rows(target.values, index, encoded.values),
                          scales=scatter_rows(target.scales, index, encoded.scales),
                          rope=scatter_rows(target.rope, index, encoded.rope))


def is_quantized(cache) -> bool:
    """Whether an `AttentionCache` stores its rows as `QuantizedRows` (``kv_cache_dtype="fp8"``)."""
    return isinstance(cache.window, QuantizedRows)


def check_cache_numerics(cache, numerics_setting: str) -> None:
    """An FP8 cache holds rows on the official numerics' grid and nothing else: a layer with
    ``numerics="reference"`` would store its keys rounded where the reference does not round.
    And any cache made by a layer's `init_cache` holds the rounding of that layer's numerics
    (its `numerics` tag): a layer of the other numerics refuses it.
    `ValueError` naming ``cache`` (the call's check, and the step's when it is traced)."""
    if is_quantized(cache) and numerics_setting != "official":
        raise ValueError(
            "cache: an FP8 cache (kv_cache_dtype='fp8') stores the official numerics' rounding of the keys; "
            f"expected a layer with numerics='official', got numerics={numerics_setting!r}")
    made = getattr(cache, "numerics", None)
    if made is not None and made != numerics.check_numerics(numerics_setting):
        raise ValueError(
            f"cache: expected a cache of a layer with numerics={numerics_setting!r} (its rows hold that "
            f"numerics' rounding), got one made by a layer with numerics={made!r}; make it with this layer's "
            "init_cache")
