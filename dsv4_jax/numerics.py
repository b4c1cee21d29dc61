"""The official inference's roundings (FP8, FP4, Hadamard), one copy for XLA and NumPy.

DeepSeek-V4's own inference code (`inference/model.py` + `inference/kernel.py` of the
release; docs/numerics.md) puts the attention's caches on a quantization grid ("We performed
QAT here"): values stay in their dtype, each rounding is a quantize -> dequantize round trip.
This module holds those roundings as pure functions written against the API NumPy and
`jax.numpy` share (`backend.namespace`), like the stage math: traced into the step for JAX
arrays, run on the host for NumPy arrays, with the same bits (tests/test_numerics.py).

The rule is the one of the real (TileLang) kernels `act_quant_kernel` / `fp4_quant_kernel`,
not of the mirror's pure-torch fallbacks (their in-place path skips the cast to the FP8/FP4
grid, and their ``2 ** ceil(log2(.))`` scale comes out one power of two low when
``amax / qmax`` sits within about an ulp above a power of two). Per block of the last axis,
in float32:

- ``amax = max(max|x|, floor)``; floor ``fp32(1e-4)`` (FP8) or ``6 * 2**-126`` (FP4);
- ``scale = 2 ** ceil(log2(amax * fp32(1 / qmax)))``, read from the float's bits: the
  exponent, plus one if any mantissa bit is set (UE8M0, a power of two rounded *up*);
- ``q = cast(clip(x / scale, -qmax, qmax))`` to e4m3 (qmax 448) or e2m1 (qmax 6), round to
  nearest even (the clip comes first, as in the kernels);
- the round trip returns ``float32(q) * scale`` cast back to the input dtype (exact: a grid
  value times a power of two). An all-zero block stays zero (signs of zeros kept).

Rules this module adds where the official code has none (it only runs bf16 widths that are
whole numbers of blocks):

- **Partial blocks.** A width that is not a whole number of blocks ends with one shorter
  block whose scale comes from its own members: what the kernels' ``ceildiv`` grid computes
  for a zero-padded row (zeros never raise an absolute max). The scales have
  ``ceil(width / block)`` entries. Test configs meet it: head_dim 32 with rope 8 leaves 24
  non-RoPE dims, one block of 24; an indexer head of 16 is one FP4 block of 16. The real
  configs (448 = 7 x 64 non-RoPE dims, indexer head 128 = 4 x 32) have none.
- **Dtypes.** The arithmetic is float32 for any input dtype; the result has the input's
  dtype. With bf16 inputs this is the official computation; float32 inputs get the same
  grid without a bf16 rounding anywhere.
- **Float32 subnormals** (``|x| < 2**-126``) are read as zero (sign kept) by the quantizers.
  XLA:CPU flushes them and XLA:GPU does not, NumPy keeps them; reading them as zero makes
  every namespace and device agree. It matters only in FP4 blocks whose absolute max is
  below ``6 * 2**-126``; no output of a quantizer is subnormal. `hadamard_rotate` does no
  such thing: its sums of values near 1e-38 may differ between backends.
- **Non-finite values.** A block holding a NaN or an infinity comes back all NaN (and with a
  NaN scale from the quantizers). The FP8 kernel gives NaN there too (its scale becomes
  infinite); e2m1 has no NaN, so the FP4 kernel's result there is not defined. As in the
  kernels, finite values within about 1/500 of float32's largest can round up to infinity
  (``x / scale = 255.99`` rounds to 256, and ``256 * 2**120`` overflows).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv4_jax.backend import Array, namespace
from dsv4_jax.config import check_choice

NUMERICS = ("reference", "official")

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP4 = np.dtype(ml_dtypes.float4_e2m1fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = np.float32(1e-4)  # the kernel's `T.max(amax, 1e-4)`, a float32 constant
FP4_AMAX_FLOOR = np.float32(6 * 2.0**-126)
FP8_BLOCK = 64  # the attention's KV rounding; FP8-weight linears use 128
FP4_BLOCK = 32

_TINY = np.float32(2.0**-126)  # smallest normal float32
_MANTISSA = np.uint32(0x7FFFFF)
_EXPONENT_SHIFT = np.uint32(23)


def _pow2_scale(amax: Array, qmax: float) -> Array:
    """``2 ** ceil(log2(amax * fp32(1 / qmax)))`` from the bits of the float32 product, as
    the kernels' `fast_round_scale`: exponent plus one if any mantissa bit is set. `amax` is
    float32, finite and at least the floor (the product is a normal float32)."""
    bits = (amax * np.float32(1.0 / qmax)).view(np.uint32)
    exponent = bits >> _EXPONENT_SHIFT  # sign bit is 0
    round_up = ((bits & _MANTISSA) != 0).astype(np.uint32)
    return ((exponent + round_up) << _EXPONENT_SHIFT).view(np.float32)


def _blocks(x: Array, block: int) -> tuple[Array, int]:
    """float32 `x` [..., n] as [..., ceil(n / block), block], zero-padded; returns also n."""
    xp = namespace(x)
    if block < 1:
        raise ValueError(f"block: expected a positive block size, got {block}")
    n = x.shape[-1]
    pad = -n % block
    if pad:
        x = xp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], (n + pad) // block, block), n


def _round_to_e2m1(q: Array) -> Array:
    """float32 `q` in [-6, 6] rounded to the nearest e2m1 value, ties to even, in float32: the
    grid's steps are 0.5 below 2, 1 below 4 and 2 up to 6, and ties to an even multiple of the
    step are ties to an even mantissa. Done here, not by the conversion to `FP4`, which then
    only re-encodes grid values: XLA:CPU's classic fusion emitter rounds an f32 -> e2m1
    conversion twice (1.2500001 -> 1.0 where the nearest value is 1.5)."""
    xp = namespace(q)
    a = xp.abs(q)
    step = xp.where(a < 2, np.float32(0.5), xp.where(a < 4, np.float32(1), np.float32(2)))
    return xp.copysign(xp.round(a / step) * step, q)


def _quantize(x: Array, block: int, qmax: float, floor: np.float32, grid: np.dtype):
    """Blocked quantization of `x` [..., n]: (grid values as float32 [..., nb, block],
    float32 scales [..., nb, 1] (NaN for a non-finite block), n)."""
    xp = namespace(x)
    xf = x.astype(np.float32)
    if xp is not np and x.dtype != np.float32:
        # XLA may compute a bf16 value in float32 and skip its rounding inside a fusion
        # (``xla_allow_excess_precision``, on by default on GPUs): the quantizer would then see
        # the float32 value it came from, and two programs (or two fusions) of the same math
        # would round differently. reduce_precision pins the input's own rounding.
        info = jnp.finfo(x.dtype)
        xf = jax.lax.reduce_precision(xf, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    xf = xp.where(xp.abs(xf) < _TINY, xp.copysign(np.float32(0), xf), xf)  # subnormals -> signed 0
    xb, n = _blocks(xf, block)
    amax = xp.max(xp.abs(xb), axis=-1, keepdims=True)
    finite = xp.isfinite(amax)
    # a non-finite block gets the largest scale (no overflow in the division), then NaN
    amax = xp.where(finite, xp.maximum(amax, floor), np.finfo(np.float32).max)
    scale = _pow2_scale(amax, qmax)
    q = xp.clip(xb / scale, np.float32(-qmax), np.float32(qmax))
    if grid == FP4:
        q = _round_to_e2m1(q)
    q = xp.where(finite, q, np.float32(0)).astype(grid)
    if xp is not np:
        # With excess precision allowed (XLA:GPU's default) XLA removes a narrowing convert
        # followed by the widening one back (f32 -> e4m3 -> f32 becomes f32): the rounding onto
        # the grid would silently not happen. The barrier keeps the grid values.
        q = jax.lax.optimization_barrier(q)
    q = q.astype(np.float32)
    q = xp.where(finite, q, np.float32(np.nan))
    return q, xp.where(finite, scale, np.float32(np.nan)), n


def _unblock(q: Array, n: int) -> Array:
    return q.reshape(*q.shape[:-2], q.shape[-2] * q.shape[-1])[..., :n]


def _round_trip(x: Array, block: int, qmax: float, floor: np.float32, grid: np.dtype) -> Array:
    q, scale, n = _quantize(x, block, qmax, floor, grid)
    return _unblock(q * scale, n).astype(x.dtype)


def fp8_round_trip(x: Array, block: int = FP8_BLOCK) -> Array:
    """`x` on the FP8 e4m3 grid of the official `act_quant(x, block, "ue8m0", inplace=True)`:
    a UE8M0 (power-of-two) scale per block of the last axis, same shape and dtype as `x`."""
    return _round_trip(x, block, FP8_MAX, FP8_AMAX_FLOOR, FP8)


def fp4_round_trip(x: Array, block: int = FP4_BLOCK) -> Array:
    """`x` on the FP4 e2m1 grid of the official `fp4_act_quant(x, block, inplace=True)`:
    a UE8M0 scale per block of the last axis, same shape and dtype as `x`."""
    return _round_trip(x, block, FP4_MAX, FP4_AMAX_FLOOR, FP4)


def quantize_fp8(x: Array, block: int = FP8_BLOCK) -> tuple[Array, Array]:
    """(e4m3 values [..., n], e8m0 scales [..., ceil(n / block)]) of `x` [..., n]: the
    compact form of `fp8_round_trip` (`dequantize_fp8` of it is that round trip, bit for bit).
    The official kernel's ``inplace=False`` output with ``scale_dtype=float8_e8m0fnu``."""
    q, scale, n = _quantize(x, block, FP8_MAX, FP8_AMAX_FLOOR, FP8)
    return _unblock(q, n).astype(FP8), scale[..., 0].astype(E8M0)


def dequantize_fp8(values: Array, scales: Array, dtype, block: int = FP8_BLOCK) -> Array:
    """`values` (e4m3 [..., n]) times their block's scale (e8m0 [..., ceil(n / block)]),
    in `dtype`: the inverse of `quantize_fp8` (exact; equals `fp8_round_trip` of the input)."""
    return _dequantize(values, scales, dtype, block)


def quantize_fp4(x: Array, block: int = FP4_BLOCK) -> tuple[Array, Array]:
    """(e2m1 values [..., n], e8m0 scales [..., ceil(n / block)]): the compact form of
    `fp4_round_trip` (unpacked, one value per byte; MXFP4 caches pack two per byte)."""
    q, scale, n = _quantize(x, block, FP4_MAX, FP4_AMAX_FLOOR, FP4)
    return _unblock(q, n).astype(FP4), scale[..., 0].astype(E8M0)


def dequantize_fp4(values: Array, scales: Array, dtype, block: int = FP4_BLOCK) -> Array:
    """The inverse of `quantize_fp4` (exact; equals `fp4_round_trip` of the input).
    A NaN scale (a non-finite block) gives NaN values."""
    return _dequantize(values, scales, dtype, block)


def _dequantize(values: Array, scales: Array, dtype, block: int) -> Array:
    n = values.shape[-1]
    if scales.shape[-1] != -(-n // block):
        raise ValueError(
            f"scales: expected {-(-n // block)} scales for {n} values in blocks of {block}, got {scales.shape[-1]}"
        )
    vb, _ = _blocks(values.astype(np.float32), block)
    s = scales.astype(np.float32)[..., None]
    return _unblock(vb * s, n).astype(dtype)


def quantize_to_bits(x: Array, block: int, grid: str) -> tuple[Array, Array]:
    """The compact cache form of `x` [..., n] on the official FP8 or FP4 grid: (the grid values
    as float8_e4m3fn [..., n], the scales' UE8M0 exponent bytes as uint8 [..., ceil(n / block)]).

    grid: "fp8" (the main attention's KV, `fp8_round_trip`) or "fp4" (the indexer's keys,
    `fp4_round_trip`; e2m1 values are e4m3 values too, so one container holds both grids).
    The scale byte is the float32 scale's exponent field (a power of two: ``2 ** (e - 127)``;
    255 for a non-finite block). `dequantize_bits` of it is the round trip, bit for bit. A
    byte 0 dequantizes to zero: an empty cache of zeros reads as zeros (e8m0 has no zero).
    """
    qmax, floor = {"fp8": (FP8_MAX, FP8_AMAX_FLOOR), "fp4": (FP4_MAX, FP4_AMAX_FLOOR)}[grid]
    q, scale, n = _quantize(x, block, qmax, floor, FP8 if grid == "fp8" else FP4)
    exponent = (scale[..., 0].view(np.uint32) >> _EXPONENT_SHIFT) & np.uint32(0xFF)  # NaN -> 255
    return _unblock(q, n).astype(FP8), exponent.astype(np.uint8)


def dequantize_bits(values: Array, exponents: Array, dtype, block: int) -> Array:
    """`values` (float8_e4m3fn [..., n]) times ``2 ** (exponent - 127)`` per block of the last
    axis (uint8 [..., ceil(n / block)]; 0 -> a zero scale, 255 -> infinity), in `dtype`: the
    inverse of `quantize_to_bits`, the same float32 product as the round trips."""
    return _dequantize(values, (exponents.astype(np.uint32) << _EXPONENT_SHIFT).view(np.float32), dtype, block)


def split_fp4_grid(x: Array, block: int = FP4_BLOCK) -> tuple[Array, Array, Array]:
    """Values already on the FP4 grid (`fp4_round_trip`'s output: an indexer query under
    numerics="official", `round_indexer_official`) split into their exact factors: (the e2m1
    values as float8_e4m3fn [..., n], the UE8M0 scale bytes uint8 [..., ceil(n / block)], and
    whether each vector is on the grid: bool [...]) with ``dequantize_bits(values, bytes) == x``
    wherever that flag is set. `quantize_to_bits` of the values again: a block whose absolute
    max rounded to 3 * scale comes back at half the scale and twice the codes (the same values).
    Off the grid (a value no e2m1 code times the block's scale gives, a NaN) the flag is False
    and the factors are those of `fp4_round_trip(x)`, not of `x`."""
    xp = namespace(x)
    values, exponents = quantize_to_bits(x, block, "fp4")
    back = dequantize_bits(values, exponents, np.float32, block)
    return values, exponents, xp.all(back == x.astype(np.float32), axis=-1)


# The 16 e2m1 codes' values (sign bit 3, exponent bits 2-1, mantissa bit 0), and the midpoints
# between the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 that turn a grid value back into its code.
FP4_CODE_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def pack_fp4(values: Array) -> Array:
    """FP4 grid values [..., n] (any float dtype; n even) as e2m1 codes two a byte, uint8
    [..., n / 2]: channel 2i in the low nibble of byte i, 2i + 1 in the high one (the OCP MXFP4
    order, as vLLM's 68-byte indexer keys). Signs are kept (-0.0 has code 8); a NaN (a
    non-finite block, whose scale byte is 255) packs as a zero, which that scale makes NaN again."""
    xp = namespace(values)
    n = values.shape[-1]
    if n % 2:
        raise ValueError(f"values: FP4 codes pack two a byte, expected an even last axis, got {n}")
    v = values.astype(np.float32)
    magnitude = xp.abs(v)
    code = sum((magnitude > np.float32(m)).astype(np.uint8) for m in _FP4_MIDPOINTS)
    code = code | (xp.signbit(v).astype(np.uint8) << np.uint8(3))
    pairs = code.reshape(*code.shape[:-1], n // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << np.uint8(4))


def unpack_fp4(packed: Array) -> Array:
    """The inverse of `pack_fp4`: uint8 [..., m] -> the grid values as float32 [..., 2m]."""
    xp = namespace(packed)
    codes = xp.stack([packed & np.uint8(0xF), packed >> np.uint8(4)], axis=-1)
    codes = codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1]).astype(np.int32)
    return xp.asarray(FP4_CODE_VALUES)[codes]


def hadamard_rotate(x: Array) -> Array:
    """Normalized Walsh-Hadamard transform over the last axis, as the official
    `rotate_activation` (Dao-AILab `fast_hadamard_transform(x, scale=dim ** -0.5)`).

    float32 butterflies ``(a + b, a - b)`` at strides 1, 2, 4, ... (the CUDA kernel's order:
    within a thread, then across lanes, warps and chunks), the sums times
    ``float32(dim ** -0.5)``, then one rounding to `x`'s dtype. A width that is not a power
    of two is zero-padded to the next one and the output truncated, as that library does
    (the scale stays ``dim ** -0.5`` of the unpadded width).
    """
    xp = namespace(x)
    dim = x.shape[-1]
    if dim < 1:
        raise ValueError("hadamard_rotate: expected a non-empty last axis")
    n = 1 << math.ceil(math.log2(dim))
    y = x.astype(np.float32)
    if n != dim:
        y = xp.pad(y, [(0, 0)] * (y.ndim - 1) + [(0, n - dim)])
    lead = y.shape[:-1]
    stride = 1
    while stride < n:
        pairs = y.reshape(*lead, n // (2 * stride), 2, stride)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = xp.stack([a + b, a - b], axis=-2).reshape(*lead, n)
        stride *= 2
    return (y[..., :dim] * np.float32(dim**-0.5)).astype(x.dtype)


def round_kv_official(kv: Array, rope_dim: int) -> Array:
    """The official rounding of a main-attention KV entry (window, CSA and HCA compressed):
    FP8 blocks of 64 on the leading ``head_dim - rope_dim`` (non-RoPE) channels, the trailing
    `rope_dim` (RoPE) channels untouched (`act_quant(kv[..., :-rd], 64, ..., inplace=True)`)."""
    xp = namespace(kv)
    n = kv.shape[-1] - rope_dim
    if not 0 <= rope_dim <= kv.shape[-1]:
        raise ValueError(f"rope_dim: expected 0 <= rope_dim <= {kv.shape[-1]}, got {rope_dim}")
    if n == 0:
        return kv
    nope = fp8_round_trip(kv[..., :n], FP8_BLOCK)
    return nope if rope_dim == 0 else xp.concatenate([nope, kv[..., n:]], axis=-1)


def round_indexer_official(x: Array) -> Array:
    """The official rounding of the indexer's queries (after RoPE) and of its compressor's
    keys: Hadamard over all channels (RoPE ones included), then FP4 blocks of 32
    (`rotate_activation`, then `fp4_act_quant(x, 32, True)`)."""
    return fp4_round_trip(hadamard_rotate(x), FP4_BLOCK)


def check_numerics(numerics) -> str:
    """The layer's ``numerics=`` setting, checked: "reference" (transformers' numerics) or
    "official" (the official inference's roundings at the places `docs/numerics.md` lists)."""
    return check_choice("numerics", numerics, NUMERICS)
