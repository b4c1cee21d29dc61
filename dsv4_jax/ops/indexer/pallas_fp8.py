"""The indexer's scoring over an FP8 cache's MXFP4 keys on FP8 tensor cores: e4m3 x e4m3 dots.

`pallas.index_scores_fp4` decodes each stored key to bf16 and runs one bf16 dot a key block.
Under numerics="official" both operands are on the FP4 grid (the keys as the cache stores them;
the queries rounded the same way, `numerics.round_indexer_official`), so the scoring can run on
Hopper's FP8 tensor cores (wgmma e4m3, twice bf16's rate) without changing a bit:

    queries [B, S, nI, c] on the FP4 grid -> (`numerics.split_fp4_grid`) e2m1 values as e4m3
      codes [B, S, c/32, nI, 32] and their UE8M0 scales float32 [B, S, c/32, nI]
    keys: codes uint8 [B, T, c/2] (two e2m1 a byte), scale bytes uint8 [B, T, c/32]
    per key block (`pallas._kernel`'s frame: its loop, masks, pages and score formula), per
    32-channel block b:
      k_b = the block's e2m1 codes widened to e4m3 in registers (integer ops, a bitcast)
      d_b = k_b [block, 32] @ q_b [nI, 32]^T      e4m3 x e4m3, float32 accumulation (wgmma)
      dots += d_b * key_scale_b[:, None] * query_scale_b[None, :]          (b = 0, 1, ...)
    then relu(dots) * c^-1/2 * w summed over heads, as `pallas._kernel` does for every form.

Why bit for bit (`index_scores_fp4`'s scores, and so a bf16 cache's): every e2m1 value is an
e4m3 value, so the widening is exact; a product of two e2m1 values is a multiple of 1/4 of at
most 36, so a 32-channel block's sum d_b is an integer times 1/4 below 2^13 (exact even in
Hopper's reduced-precision FP8 accumulation); times the two powers of two it stays exact. The
bf16 dot sums the same exact products, only in another order; both orders give the exact sum
wherever every partial sum is a float32: where the block sums' scales (key scale times query
scale) of one (entry, head) span at most 2^9 (the smallest scale's quarter units, 2^24 of them,
then hold the largest sum). Hadamard-rotated rows spread their energy over the channels, so their
blocks' scales lie within a few powers of two (tests/ops/test_indexer_kernel.py draws them so);
where they span more, the two kernels round the sum in different orders (float32 rounding of the
sums, as between the bf16 kernel and the XLA reference) and the gate is the picks. Also outside
the contract: scale bytes 0 and 255 (a zero or non-finite block) and products of scales below
float32's normal range.

Queries off the grid (numerics="reference", or any query `split_fp4_grid` cannot factor) are not
scored in FP8: each query row carries its flag into the kernel, and a row off the grid runs
`index_scores_fp4`'s bf16 dot instead (one branch a program, no host round trip); an eager call
with ``off_grid="raise"`` refuses them.

Not a default: `KernelPlan(select_keys="fp8")` asks for it where the Pallas kernel scores
(docs/breaks_and_kernels.md); "auto" stays as it was until a GPU measures it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv4_jax import native, numerics
from dsv4_jax.backend import Array, is_tracer
from dsv4_jax.ops.indexer import pallas as dense

CODE_BYTES = numerics.FP4_BLOCK // 2  # bytes of one 32-channel block of MXFP4 codes


def widen_e2m1(codes: Array) -> Array:
    """Packed e2m1 codes uint8 [n, m] (channel 2i in the low nibble of byte i) -> the same values
    as float8_e4m3fn [n, 2m], exactly: sign to bit 7; exponent e > 0 (value 2^(e-1) (1 + m/2))
    to e4m3's e + 6 with the mantissa bit on top of e4m3's three; e = 0 (0 or 0.5) to 0 or
    2^-1. Integer ops and one bitcast (what the Triton lowering takes, no table lookups)."""
    n, half = codes.shape

    def e4m3_bits(code):  # uint8 nibbles -> uint8 e4m3 bit patterns
        exponent, mantissa = (code >> 1) & 3, code & 1
        magnitude = jnp.where(exponent == 0, mantissa * 48, ((exponent + 6) << 3) | (mantissa << 2))
        return magnitude | ((code & 8) << 4)

    pairs = jnp.stack([e4m3_bits(codes & 15), e4m3_bits(codes >> 4)], axis=-1)  # [n, m, 2]
    return jax.lax.bitcast_convert_type(pairs.reshape(n, 2 * half).astype(jnp.uint8), jnp.float8_e4m3fn)


def scale_of(scale_bytes: Array) -> Array:
    """UE8M0 bytes -> float32 ``2 ** (byte - 127)`` (0 -> 0, 255 -> inf), as `decode_fp4` reads them."""
    return jax.lax.bitcast_convert_type(jnp.left_shift(scale_bytes.astype(jnp.int32), 23), jnp.float32)


def _fp8_dots(query_refs, key_refs):
    """`pallas._kernel`'s dots of a key block by 32-channel FP8 blocks (the module doc)."""
    codes_ref, scales_ref = query_refs  # [1, c/32, nI, 32] e4m3, [1, c/32, nI] float32
    key_codes, key_scales = key_refs
    blocks = codes_ref.shape[1]
    q = [codes_ref[0, b] for b in range(blocks)]  # [nI, 32] each, loaded once a program
    q_scale = [scales_ref[0, b] for b in range(blocks)]  # [nI] each

    def dots(load):
        total = None
        for b in range(blocks):  # static: c / 32 dots, summed in channel order
            k = widen_e2m1(load(key_codes, columns=(b * CODE_BYTES, CODE_BYTES)))  # [block, 32] e4m3
            d = jax.lax.dot_general(k, q[b], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            term = d * scale_of(load(key_scales, columns=(b, 1))) * q_scale[b][None, :]  # [block, nI]
            total = term if total is None else total + term
        return total

    return dots


def split_queries(queries: Array) -> tuple[Array, Array, Array]:
    """queries [B, S, nI, c] -> (e4m3 codes [B, S, c/32, nI, 32], float32 scales [B, S, c/32, nI],
    int32 [B, S]: 1 where every head of the query is on the FP4 grid, `numerics.split_fp4_grid`)."""
    batch, seq, heads, dim = queries.shape
    values, exponents, on_grid = numerics.split_fp4_grid(queries, numerics.FP4_BLOCK)
    codes = values.reshape(batch, seq, heads, dim // numerics.FP4_BLOCK, numerics.FP4_BLOCK).transpose(0, 1, 3, 2, 4)
    scales = scale_of(exponents).transpose(0, 1, 3, 2)
    return codes, scales, jnp.all(on_grid, axis=-1).astype(jnp.int32)


def index_scores_fp8(queries: Array, weights: Array, codes: Array, scale_bytes: Array, visible: Array, *,
                     dtype=jnp.bfloat16, off_grid: str = "fall_back", interpret: bool = False,
                     block: int = dense.BLOCK, tiles: int = dense.TILES, num_warps: int = dense.NUM_WARPS,
                     num_stages: int = dense.NUM_STAGES, pages: native.Pages | None = None) -> Array:
    """`pallas.index_scores_fp4`'s scores (float32 [B, S, T]) with e4m3 x e4m3 dots (module doc).

    queries [B, S, nI, c] (`dtype`: the bf16 dot's, for rows off the FP4 grid), weights float32
    [B, S, nI], codes uint8 [B, T, c / 2] and scale_bytes uint8 [B, T, c / 32] (an FP8 cache's
    indexer keys), visible int [B, S]; `pages`: as in `index_scores_fp4`. `off_grid`:
    "fall_back" (a query row off the FP4 grid is scored by the bf16 dot, inside the kernel) or
    "raise" (a ValueError for such queries; only where they are concrete, an eager call)."""
    if off_grid not in ("fall_back", "raise"):
        raise ValueError(f"off_grid: expected 'fall_back' or 'raise', got {off_grid!r}")
    dim = queries.shape[-1]
    if dim % numerics.FP4_BLOCK or codes.shape[-1] * 2 != dim:
        raise ValueError(f"codes: expected [.., {dim // 2}] (two e2m1 codes a byte of c = {dim} channels, c a "
                         f"multiple of {numerics.FP4_BLOCK}), got {tuple(codes.shape)}")
    if scale_bytes.shape[-1] * numerics.FP4_BLOCK != dim:
        raise ValueError(f"scale_bytes: expected one scale per {numerics.FP4_BLOCK} channels of {dim}, got "
                         f"{scale_bytes.shape[-1]}")
    q_codes, q_scales, on_grid = split_queries(queries)
    if off_grid == "raise":
        if is_tracer(on_grid):
            raise ValueError("off_grid: 'raise' checks concrete queries (an eager call); under a trace use "
                             "'fall_back'")
        if not bool(on_grid.all()):
            rows = [tuple(int(i) for i in at) for at in zip(*jnp.nonzero(on_grid == 0))]
            raise ValueError(f"queries: expected values on the FP4 grid (numerics='official': Hadamard, then FP4 "
                             f"blocks of {numerics.FP4_BLOCK}), got (b, s) rows off it: {rows[:8]}")

    def dots_of(query_refs, key_refs):
        codes_ref, scales_ref, flag_ref, dense_ref = query_refs
        return (flag_ref[0] != 0, functools.partial(_fp8_dots, (codes_ref, scales_ref), key_refs),
                functools.partial(dense.dense_dots, dense_ref, key_refs, dtype=dtype))

    return dense.score_call((q_codes, q_scales, on_grid, queries.astype(dtype)), weights, (codes, scale_bytes),
                            visible, dim=dim, dots_of=dots_of, interpret=interpret, block=block, tiles=tiles,
                            num_warps=num_warps, num_stages=num_stages, pages=pages)


def supports(queries: Array, keys) -> bool:
    """Whether the FP8 kernel takes these operands: what the bf16 kernel takes (`pallas.supports`:
    its dot is the fallback of rows off the grid; bf16, heads and channels powers of two of at
    least 16), channels whole FP4 blocks of 32 (one e4m3 MMA's K), and keys an FP8 cache's MXFP4
    ones (a `QuantizedRows` of grid "fp4", blocks of 32). Hopper's FP8 tensor cores
    (compute capability 8.9 and up) are the caller's to have."""
    return (dense.supports(queries, keys) and queries.shape[-1] % numerics.FP4_BLOCK == 0
            and getattr(keys, "grid", None) == "fp4" and getattr(keys, "block", None) == numerics.FP4_BLOCK)
