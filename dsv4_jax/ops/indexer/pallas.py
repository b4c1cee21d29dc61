"""The indexer's scoring of a prefill as one Pallas kernel: Hopper's warpgroup MMAs for its GEMM.

The lightning indexer scores every (query, entry) pair: relu(q_h . k) * c^-1/2 * w_h summed over
its nI heads, a GEMM of [S * nI, c] queries against [T, c] keys per row. In a long CSA prefill
that GEMM is most of the layer's work (the selection over half of a 64k prefill's device time).
The native handler's scoring (csrc/select_topk_cuda.cu `ScoreKernelMma`) issues `mma.sync` and
runs at ~175 TFLOP/s on an H200; this kernel's products are one `dot` per tile, which Triton
lowers to `wgmma`, and it scored a query block of 256 against 65,536 / 262,144 entries in
0.68 / 2.75 ms against the handler's 1.57 / 6.25 ms (docs/breaks_and_kernels.md, "Why the kernels' defaults").
The handler's top-k then picks from its scores (`native.topk`), so the picks keep the module
contract (csrc/select_topk.h).

    queries [B, S, nI, c] bf16, weights float32 [B, S, nI], keys [B, T, c] bf16, visible int [B, S]
      -> scores float32 [B, S, T]  (entries t >= visible[b, s] are -inf)

    grid (B * S, ceil(T / (block * tiles))); program (r, j) scores query row r = b * S + s against
    `tiles` key blocks of `block` entries from j * block * tiles, looping over them (Triton
    pipelines the loop's key loads); blocks wholly past the row's visible entries are not loaded.
    A paged cache's keys (`pages`: the pool's rows [N, c] and the table [B, P_row]): a block's
    key rows are loaded each at its page's address (a block may span pages; a row's channels
    stay contiguous), no copy of the row's keys.
    per block: dots = keys[block, c] @ q[nI, c]^T (float32 accumulation) -> [block, nI];
               score = sum over heads of relu(dots) * c^-1/2 * w -> [block]

Numerics: the reference's formula (`indexer._block_scores`: relu(q.k) * c^-1/2 * w, summed over
heads, -0.0 folded into +0.0). bf16 products are exact in float32; only the order of the float32
sums differs from the XLA twin and from the native handler (~1e-7 relative), so near-ties can
swap places in the picks' order (as between the handler and the XLA twin in bf16 already;
docs/DEVELOPING.md). float32 inputs are not taken: Triton's dot would round them to TF32.

Where it runs is the step's `KernelPlan` (``select_scores``): by default on CUDA for bf16 calls of
several queries a row (prefill chunks) where the native selection runs; a decode step (one query a
row) keeps the handler's scoring, which measured faster there (bench/topk.py `select_fp4`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsv4_jax import native
from dsv4_jax.backend import Array

BLOCK = 128     # entries a block: one wgmma tile of keys
TILES = 8       # blocks a program loops over (its key loads pipelined)
NUM_WARPS = 8   # measured against 4 at 64k / 262k entries: 681 / 2746 us against 697 / 2785
NUM_STAGES = 3


def decode_fp4(codes: Array, scale_bytes: Array, dtype) -> Array:
    """MXFP4 keys to `dtype`, as `numerics.dequantize_bits(numerics.unpack_fp4(codes), ...)`:
    codes uint8 [n, c / 2] (channel 2i in the low nibble of byte i), scale_bytes uint8
    [n, c / 32] (``2 ** (byte - 127)``, 0 -> zero) -> [n, c]. Each value is the float32 product
    of its e2m1 value and its block's scale, then one rounding to `dtype` (exact where the
    product is): the bf16 cache's keys, bit for bit. Arithmetic the Triton lowering takes (no
    table lookups): integer ops, a bitcast for the scale, one interleave of the two nibbles."""
    n, half = codes.shape
    blocks = scale_bytes.shape[-1]

    def value(code):  # int32 e2m1 codes (sign bit 3, exponent bits 2-1, mantissa bit 0) -> float32
        exponent, mantissa = (code & 7) >> 1, (code & 1).astype(jnp.float32)
        power = jnp.left_shift(1, jnp.maximum(exponent - 1, 0)).astype(jnp.float32)
        magnitude = jnp.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * power)
        return jnp.where(code >= 8, -magnitude, magnitude)  # code 8 is -0.0, as unpack_fp4's

    wide = codes.astype(jnp.int32)
    scale = jax.lax.bitcast_convert_type(jnp.left_shift(scale_bytes.astype(jnp.int32), 23), jnp.float32)
    per_byte = jnp.broadcast_to(scale[:, :, None], (n, blocks, half // blocks)).reshape(n, half)
    pairs = jnp.stack([value(wide & 15) * per_byte, value(wide >> 4) * per_byte], axis=-1)  # [n, c / 2, 2]
    return pairs.reshape(n, 2 * half).astype(dtype)


def _kernel(visible_ref, *refs, n_query_refs: int, dots_of, block: int, tiles: int, scale: float, seq: int,
            slots: int, page_entries: int | None):
    # the queries' refs (`n_query_refs`: [R, nI, c], or a form of them that `dots_of` reads), the
    # head weights [R, nI]; keys [B, T, c], or codes [B, T, c/2] and scale bytes [B, T, c/32];
    # paged (`page_entries`): the same as a pool's rows [N, .], then the page table [B, P_row];
    # out [R, T]. `dots_of(query_refs, key_refs)`: a setup (called once a program, outside the
    # loop over blocks: the queries' loads) returning a function of a block's loader
    # (``load(ref, columns=None)``: the block's rows of a key ref, all channels or a static
    # ``(first, width)`` span of them) to the block's q.k dots, float32 [block, nI]; or
    # (flag, setup, setup): the row's choice between two such setups.
    query_refs, (w_ref, *refs) = refs[:n_query_refs], refs[n_query_refs:]
    *key_refs, out_ref = refs
    if page_entries is not None:
        *key_refs, table_ref = key_refs
    r = pl.program_id(0)
    source = r // seq
    first = pl.program_id(1) * block * tiles
    visible = visible_ref[0]
    n_loaded = jnp.clip((visible - first + block - 1) // block, 0, tiles)
    n_blocks = jnp.clip((slots - first + block - 1) // block, 0, tiles)  # blocks inside [0, T)
    w = w_ref[0].astype(jnp.float32)          # [nI]
    entries = jnp.arange(block, dtype=jnp.int32)
    ragged = slots % block != 0  # static: a partial last block, its loads and stores masked

    def load(ref, start, columns=None):
        if page_entries is not None:
            return load_paged(ref, start, columns)
        lo, width = columns or (0, ref.shape[-1])
        at = ref.at[source, pl.ds(start, block), pl.ds(lo, width)]
        if not ragged:
            return at[...]
        return plgpu.load(at, mask=(start + entries < slots)[:, None], other=0)

    def load_paged(ref, start, columns):  # each key row at its own address (a block may span pages)
        lo, width = columns or (0, ref.shape[-1])
        t = start + entries
        page = table_ref[source, jnp.minimum(t, slots - 1) // page_entries]  # [block]
        held = (t < slots) & (page >= 0) & (page < ref.shape[0] // page_entries)
        at = jnp.where(held, page * page_entries + t % page_entries, 0)
        channels = lo + jnp.arange(width, dtype=jnp.int32)
        # A missing page reads as zeros, as `PagedRows.view` holds it (its scores are 0).
        return plgpu.load(ref.at[at[:, None], channels[None, :]], mask=held[:, None], other=0)

    def store(start, values):
        at = out_ref.at[r, pl.ds(start, block)]
        if ragged:
            plgpu.store(at, values, mask=start + entries < slots)
        else:
            at[...] = values

    def score_blocks(dots_for):  # the loop over the visible blocks, with `dots_for`'s queries loaded
        dots_at = dots_for()  # a block's loader -> its dots

        def score_block(n, carry):
            start = first + n * block
            dots = dots_at(functools.partial(load, start=start))  # [block, nI] float32
            s = (jnp.maximum(dots, 0.0) * jnp.float32(scale) * w[None, :]).sum(axis=1)  # [block]
            s = jnp.where(s == 0.0, jnp.float32(0.0), s)  # fold -0.0 into +0.0: ties must compare equal
            store(start, jnp.where(start + entries < visible, s, -jnp.inf))
            return carry

        jax.lax.fori_loop(0, n_loaded, score_block, 0)

    chosen = dots_of(query_refs, key_refs)
    if callable(chosen):
        score_blocks(chosen)
    else:  # (a per-row flag, the dots where it is set, the dots where not): one branch a program
        flag, dots_on, dots_off = chosen
        jax.lax.cond(flag, lambda: score_blocks(dots_on), lambda: score_blocks(dots_off))

    def unloaded(n, carry):  # blocks past the row's visible entries
        store(first + n * block, jnp.full((block,), -jnp.inf, jnp.float32))
        return carry

    jax.lax.fori_loop(n_loaded, n_blocks, unloaded, 0)


def dense_dots(query_ref, key_refs, *, dtype):
    """`_kernel`'s dots over keys in `dtype` (bf16, or float32 in interpret mode): one dot of the
    block's keys [block, c] (loaded, or decoded from their MXFP4 codes, `decode_fp4`) against
    the queries [nI, c] (`query_ref` [1, nI, c])."""
    q = query_ref[0]                          # [nI, c]
    # float32 runs only in interpret mode (tests), whose dots on a GPU would otherwise be TF32.
    exact = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None

    def dots(load):
        if len(key_refs) == 1:
            k = load(key_refs[0])
        else:
            k = decode_fp4(load(key_refs[0]), load(key_refs[1]), dtype)
        return jax.lax.dot_general(k, q, (((1,), (1,)), ((), ())), precision=exact,
                                   preferred_element_type=jnp.float32)

    return dots


def score_call(query_arrays, weights, key_arrays, visible, *, dim: int, dots_of, interpret, block, tiles,
               num_warps, num_stages, pages=None):
    """The scores float32 [B, S, T] of `_kernel` with `dots_of` (its dots of a key block) over
    `query_arrays` (each [B, S, ...]: the queries [B, S, nI, c], or a form of them that `dots_of`
    reads, `pallas_fp8`), weights [B, S, nI], `key_arrays` (keys [B, T, .], or a paged pool
    [N, .] with `pages`) and visible [B, S]; `dim` is c (the scores' c^-1/2)."""
    batch, seq = visible.shape
    heads = weights.shape[-1]
    slots = key_arrays[0].shape[1] if pages is None else pages.slots
    page_entries = None
    if pages is not None:
        page_entries, table = pages.checked(key_arrays, (batch,))
        key_arrays = (*key_arrays, table)
    extra = {}
    if not interpret:
        extra["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    rows = batch * seq
    query_arrays = [a.reshape(rows, *a.shape[2:]) for a in query_arrays]

    def row_spec(a):  # a program's query row of an operand [R, ...]
        return pl.BlockSpec((1, *a.shape[1:]), lambda r, j, n=a.ndim - 1: (r,) + (0,) * n)

    whole = pl.no_block_spec  # the keys and the scores: each program reads and writes its span itself
    out = pl.pallas_call(
        functools.partial(_kernel, n_query_refs=len(query_arrays), dots_of=dots_of, block=block, tiles=tiles,
                          scale=dim ** -0.5, seq=seq, slots=slots, page_entries=page_entries),
        grid=(rows, -(-slots // (block * tiles))),
        in_specs=[
            pl.BlockSpec((1,), lambda r, j: (r,)),
            *[row_spec(a) for a in query_arrays],
            pl.BlockSpec((1, heads), lambda r, j: (r, 0)),
            *[whole] * len(key_arrays),
        ],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((rows, slots), jnp.float32),
        interpret=interpret,
        name="indexer_scores_kernel",
        **extra,
    )(visible.astype(jnp.int32).reshape(rows), *query_arrays,
      weights.astype(jnp.float32).reshape(rows, heads), *key_arrays)
    return out.reshape(batch, seq, slots)


def _call(queries, weights, key_arrays, visible, *, dtype, **options):
    return score_call((queries,), weights, key_arrays, visible, dim=queries.shape[-1],
                      dots_of=lambda query_refs, key_refs: functools.partial(
                          dense_dots, query_refs[0], key_refs, dtype=dtype), **options)


def index_scores(queries: Array, weights: Array, keys: Array, visible: Array, *, interpret: bool = False,
                 block: int = BLOCK, tiles: int = TILES, num_warps: int = NUM_WARPS,
                 num_stages: int = NUM_STAGES, pages: native.Pages | None = None) -> Array:
    """`indexer.index_scores` by the kernel: float32 [B, S, T] (see the module doc).

    Any T: a partial last block of keys is loaded and its scores stored under a mask (no
    padded copy of the keys, no cut of the scores). No gradient: the native selection
    differentiates its scores as the XLA twin's (`indexer_native.scores_with_gradient`).
    `pages` (`native.Pages`): keys are a paged cache's pool [N, c], each key row loaded at its
    page's address (T = ``pages.slots``), the scores of the keys the pages hold.
    """
    return _call(queries, weights, (keys,), visible, dtype=keys.dtype, interpret=interpret, block=block,
                 tiles=tiles, num_warps=num_warps, num_stages=num_stages, pages=pages)


def index_scores_fp4(queries: Array, weights: Array, codes: Array, scale_bytes: Array, visible: Array, *,
                     dtype=jnp.bfloat16, interpret: bool = False, block: int = BLOCK, tiles: int = TILES,
                     num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                     pages: native.Pages | None = None) -> Array:
    """`index_scores` over an FP8 cache's indexer keys in their stored form (`QuantizedRows`
    of grid "fp4": codes uint8 [B, T, c / 2], scale_bytes uint8 [B, T, c / 32]), each key
    decoded where it is loaded (`decode_fp4`) to `dtype`, the cache's: 68 bytes a key read
    instead of 256, and the scores of `index_scores` over the dequantized keys, bit for bit
    (the same values through the same dot; tests/ops/test_indexer_kernel.py). `pages`: as in
    `index_scores` (codes [N, c / 2] and scale bytes [N, c / 32], a paged cache's pool)."""
    if codes.shape[-1] % scale_bytes.shape[-1] or (2 * codes.shape[-1]) // scale_bytes.shape[-1] != 32:
        raise ValueError(f"scale_bytes: expected one scale per 32 channels of {2 * codes.shape[-1]}, got "
                         f"{scale_bytes.shape[-1]}")
    return _call(queries, weights, (codes, scale_bytes), visible, dtype=dtype, interpret=interpret, block=block,
                 tiles=tiles, num_warps=num_warps, num_stages=num_stages, pages=pages)


def supports(queries: Array, keys: Array) -> bool:
    """Whether the Triton kernel takes these operands: bf16 queries and keys (a float32 dot would
    be TF32), heads and channels powers of two of at least 16 (one MMA tile)."""

    def pow2_tile(x):
        return x >= 16 and x & (x - 1) == 0

    return (queries.dtype == jnp.bfloat16 and keys.dtype == jnp.bfloat16
            and pow2_tile(queries.shape[-2]) and pow2_tile(queries.shape[-1]))


