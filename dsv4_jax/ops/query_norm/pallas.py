"""The queries' per-head RMSNorm and RoPE as Pallas kernels, forward and backward.

In a training step or a prompt the queries' norm (`norms.head_rms_norm`, over each head's D
channels of the [B, S, H, D] queries, the step's largest activations) and their RoPE (the
trailing 2 * half channels, `rope.apply_rope`) are passes over the queries: XLA's norm a reduce
and a fused multiply (its backward a reduce and an elementwise pass), the in-place RoPE a slice of
the rotated channels and an update (its backward the same on the cotangent). Here each
direction is one kernel over blocks of rows, each row one head's D channels:

    x  [R, D]   R = B * S * H rows, in blocks of `rows` a program (one token's heads with a
                rotation, whose cos / sin [2, half] the program reads as one block)
    columns     the unrotated channels in power-of-two pieces (V4: 256 + 128 + 64), the rotated
                ones as their even and odd members (strided): Triton's blocks are powers of two
    forward:    f = 1 / sqrt(mean(x^2) + eps)   float32 [rows, 1]
                y = x * round(f)                the product in x's dtype, as `head_rms_norm`
                y's (even, odd) pairs turned by cos / sin in float32, rounded again (`apply_rope`)
    backward:   g [R, D] the output's cotangent (of x's dtype); its pairs turned back, rounded
                dx = g * round(f) - x * f^3 / D * sum(g * x)   float32, rounded once

The forward reads x once and writes y; the backward reads x and g once and writes dx. Values:
the forward's factor is a float32 sum in another order (and Triton's sqrt and division), so y may
differ from `head_rms_norm`'s by one rounding of x's dtype where round(f) falls the other way
(rare); the gradient equals XLA's within the rounding of x's dtype (float32: 1e-6). With the
rotation the kernels round where the norm kernel followed by XLA's rotation rounds (bf16: the
same values in interpret mode on the CPU; on the H200 the forward's every value, the gradient
within one unit in the last place in ~3% of its values).

`query_norm` chooses as the step's `KernelPlan` says (``query_norm``): "auto" the kernels on
CUDA for calls of several queries a row (prefill, training), XLA for decode steps (where XLA
fuses the norm's product with the rotation: the kernel would not shorten the step). Measured:
the norm kernels alone within noise of XLA's on the H200; with the rotation folded in, H200
4-layer training steps 0.4-3.2% faster at B = 1 and 4, 4k, the forwards 1-2% (on an H100 CSA
B = 4 0.6% slower, the other cells level or faster) (docs/breaks_and_kernels.md, "Why the kernels' defaults").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from dsv4_jax.backend import Array, namespace
from dsv4_jax.ops.norms import head_rms_norm
from dsv4_jax.ops.rope import RotationTables, rotate_by, rotate_by_in_place

BLOCK_ROWS = 16
NUM_WARPS = 4


def _pieces(width: int) -> list[tuple[int, int]]:
    """[start, start + n) column ranges of power-of-two widths n covering [0, width), the widest
    first (Triton's blocks are powers of two: V4's 448 unrotated channels are 256 + 128 + 64)."""
    out, start = [], 0
    for bit in reversed(range(max(width, 1).bit_length())):
        if width & (1 << bit):
            out.append((start, 1 << bit))
            start += 1 << bit
    return out


def _columns(ref, d: int, half: int) -> list:
    """The program's block of `ref` ([rows, D]) as column pieces: the unrotated channels
    (`_pieces`), then the rotated channels' even and odd members (strided)."""
    nope = d - 2 * half
    parts = [ref[:, pl.ds(start, n)] for start, n in _pieces(nope)]
    if half:
        parts += [ref[:, pl.ds(nope, half, stride=2)], ref[:, pl.ds(nope + 1, half, stride=2)]]
    return parts


def _store(ref, parts: list, d: int, half: int) -> None:
    nope = d - 2 * half
    for (start, n), part in zip(_pieces(nope), parts):
        ref[:, pl.ds(start, n)] = part
    if half:
        ref[:, pl.ds(nope, half, stride=2)] = parts[-2]
        ref[:, pl.ds(nope + 1, half, stride=2)] = parts[-1]


def _factor(parts: list, d: int, eps: float):  # float32 pieces [rows, n] -> [rows, 1]
    return 1.0 / jnp.sqrt(sum(jnp.sum(p * p, axis=1, keepdims=True) for p in parts) / d + eps)


def _forward_kernel(*refs, eps: float, half: int):
    x_ref, y_ref = refs[0], refs[-1]
    dtype, d = x_ref.dtype, x_ref.shape[1]
    xs = _columns(x_ref, d, half)
    factor = _factor([x.astype(jnp.float32) for x in xs], d, eps).astype(dtype)
    ys = [x * factor for x in xs]
    if half:  # as `apply_rope` reads the normed queries: rounded, the (even, odd) pairs turned in float32
        cos, sin = refs[1][0][None, :], refs[1][1][None, :]
        # (the products again, in float32, where they are exact: XLA:CPU, running interpret mode,
        # would otherwise skip the rounding of the bf16 products before their conversion)
        even, odd = ((x.astype(jnp.float32) * factor.astype(jnp.float32)).astype(dtype).astype(jnp.float32)
                     for x in xs[-2:])
        ys[-2:] = [(even * cos - odd * sin).astype(dtype), (odd * cos + even * sin).astype(dtype)]
    _store(y_ref, ys, d, half)


def _backward_kernel(*refs, eps: float, half: int):
    x_ref, g_ref, dx_ref = refs[0], refs[1], refs[-1]
    dtype, d = x_ref.dtype, x_ref.shape[1]
    xs = [x.astype(jnp.float32) for x in _columns(x_ref, d, half)]
    gs = [g.astype(jnp.float32) for g in _columns(g_ref, d, half)]
    if half:  # the rotation's transpose (the opposite angle), rounded as `rotate_in_place`'s gradient
        cos, sin = refs[2][0][None, :], refs[2][1][None, :]
        even, odd = gs[-2:]
        gs[-2:] = [(even * cos + odd * sin).astype(dtype).astype(jnp.float32),
                   (odd * cos - even * sin).astype(dtype).astype(jnp.float32)]
    factor = _factor(xs, d, eps)
    along = sum(jnp.sum(g * x, axis=1, keepdims=True) for g, x in zip(gs, xs))
    rounded, second = factor.astype(dtype).astype(jnp.float32), factor * factor * factor * along / d
    _store(dx_ref, [(g * rounded - x * second).astype(dtype) for g, x in zip(gs, xs)], d, half)


def _rows(x: Array, rotated: bool) -> int:
    """Rows a program: the largest power of two <= BLOCK_ROWS dividing x's rows (B * S * H);
    with a rotation, dividing H (a program's rows then share one token's position)."""
    n = x.shape[-2] if rotated else int(np.prod(x.shape[:-1]))
    rows = BLOCK_ROWS
    while n % rows:
        rows //= 2
    return rows


def _call(kernel, name: str, *arrays, table=None, interpret: bool):
    """`kernel` over blocks of rows of `arrays` ([..., H, D] each, flattened to [R, D]) and the
    rotation's `table` (one [2, half] block a program, its rows' token's)."""
    shape = arrays[0].shape
    heads, d = shape[-2:]
    flat = [a.reshape(-1, d) for a in arrays]
    rows = _rows(arrays[0], table is not None)
    spec = pl.BlockSpec((rows, d), lambda i: (i, 0))
    in_specs = [spec] * len(flat)
    if table is not None:
        flat.append(table)
        in_specs.append(pl.BlockSpec((None, *table.shape[1:]), lambda i: (i * rows // heads, 0, 0)))
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        extra["compiler_params"] = pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
    out = pl.pallas_call(kernel, grid=(flat[0].shape[0] // rows,), in_specs=in_specs, out_specs=spec,
                         out_shape=jax.ShapeDtypeStruct(flat[0].shape, arrays[0].dtype), interpret=interpret,
                         name=name, **extra)(*flat)
    return out.reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def head_rms_norm_kernel(x: Array, eps: float, interpret: bool = False) -> Array:
    """`norms.head_rms_norm(x, eps)` by the forward kernel, differentiated by the backward
    kernel (reverse mode only). x [..., H, D] -> [..., H, D] (see the module doc)."""
    return _call(functools.partial(_forward_kernel, eps=eps, half=0), "query_norm", x, interpret=interpret)


def _vjp_forward(x, eps, interpret):
    return head_rms_norm_kernel(x, eps, interpret), x


def _vjp_backward(eps, interpret, x, g):
    return (_call(functools.partial(_backward_kernel, eps=eps, half=0), "query_norm_backward", x,
                  g.astype(x.dtype), interpret=interpret),)


head_rms_norm_kernel.defvjp(_vjp_forward, _vjp_backward)


def head_rms_norm_rope_kernel(x: Array, rotation: RotationTables, eps: float, interpret: bool = False) -> Array:
    """`head_rms_norm(x, eps)`, then `rotate_by` the `rotation`, as one kernel, differentiated
    (reverse mode, with respect to x) by one kernel too.

    x [B, S, H, D], rotation: each token's cos and sin, float32 [B, S, half] each
    (`rope.rotation_tables`). The normed queries are rounded to x's dtype before the rotation and
    the rotated channels after it, as on the XLA path; the gradient rotates the cotangent's
    channels back (rounded), then differentiates the norm."""
    half = int(np.shape(rotation.cos)[-1])
    table = jnp.stack([jnp.reshape(t, (-1, half)) for t in rotation], axis=1)  # [B * S, 2, half]

    @jax.custom_vjp
    def norm_rope(x, table):
        return _call(functools.partial(_forward_kernel, eps=eps, half=half), "query_norm_rope", x,
                     table=table, interpret=interpret)

    def forward(x, table):
        return norm_rope(x, table), (x, table)

    def backward(residuals, g):
        x, table = residuals
        dx = _call(functools.partial(_backward_kernel, eps=eps, half=half), "query_norm_rope_backward", x,
                   g.astype(x.dtype), table=table, interpret=interpret)
        return dx, None

    norm_rope.defvjp(forward, backward)
    return norm_rope(x, jax.lax.stop_gradient(table))


def query_norm(q: Array, eps: float, choice: str = "xla", rotation: RotationTables | None = None) -> Array:
    """The queries' per-head RMSNorm, then (with `rotation`) their RoPE: q [B, S, H, D] ->
    [B, S, H, D], by `choice` (the step plan's, `KernelPlan.query_norm_for`): "xla"
    `head_rms_norm` (and `rope.rotate_by`); "interpret" the kernels in interpret mode; "pallas"
    the kernels where a GPU is the default backend (and where the program is lowered for CUDA:
    another platform's program keeps XLA's). NumPy arrays, and widths the Triton kernels cannot
    take (`supports`): XLA's.

    rotation: None, or each token's cos and sin, float32 [B, S, half] each (`rope.rotation_tables`
    at the queries' positions, in q's dtype): RoPE of the trailing 2 * half channels, fused into
    the norm's kernels (one pass over the queries each way, where XLA's in-place rotation reads
    and writes the rotated channels once more in a slice and an update, each way)."""
    interpret = choice == "interpret"

    def kernel(x):
        if rotation is None:
            return head_rms_norm_kernel(x, float(eps), interpret)
        return head_rms_norm_rope_kernel(x, rotation, float(eps), interpret)

    def reference(x):
        return _reference(x, eps, rotation, in_place=choice == "xla")

    # Pallas lowers Triton kernels only where a GPU is the default backend.
    kernels = interpret or (choice == "pallas" and supports(q, rotation) and jax.default_backend() == "gpu")
    if not kernels or namespace(q) is np:
        return reference(q)
    if interpret:
        return kernel(q)
    return jax.lax.platform_dependent(q, cuda=kernel, default=reference)


def supports(q: Array, rotation: RotationTables | None) -> bool:
    """Whether the Triton kernels take q [..., D]: D and the rotated channels' half powers of two
    (Triton's blocks), D at least 16."""
    d = q.shape[-1]
    half = 0 if rotation is None else int(np.shape(rotation.cos)[-1])
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return d >= 16 and pow2(d) and (half == 0 or (pow2(half) and 2 * half <= d))


def _reference(q: Array, eps: float, rotation: RotationTables | None, in_place: bool) -> Array:
    """XLA's twin: `head_rms_norm`, then `rope.rotate_by`. One query a row (decode) is rotated into
    a new array: compiled for the H200, XLA fuses that rotation with its concatenation, one kernel
    after the norm where the in-place update took three (on an H100 0.3-0.8% faster a layer at
    B = 8 and 32; docs/breaks_and_kernels.md, "Why the kernels' defaults"). Several
    are rotated in place (`backend.update_trailing`), by `rotate_by_in_place` where the plan names
    a kernel (reverse mode only already: its gradient rotates the cotangent in its own buffer), by
    `rotate_by` for "xla" (forward-mode AD possible)."""
    q = head_rms_norm(q, eps)
    if rotation is None:
        return q
    heads = RotationTables(*(t[..., None, :] for t in rotation))  # [B, S, 1, half]: every head alike
    if q.shape[1] == 1 or namespace(q) is np:
        return rotate_by(q, heads)
    if in_place:
        return rotate_by(q, heads, in_place=True)
    return rotate_by_in_place(q, heads)
