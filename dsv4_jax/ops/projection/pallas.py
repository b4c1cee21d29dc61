"""A few token rows against a large weight: the layer's input and output projections as one
Pallas (Triton) kernel, for decode steps of a batch.

A decode step of B rows multiplies B tokens by each projection's weights: the input
projections' [hidden, n] where they are fused (a CSA layer's, `step.fuse_input_projections`;
an HCA or sliding layer's separate ones stay XLA's, which merges them into one GEMM), the
grouped ``wo_a`` [G, H*D/G, R] and ``wo_b`` [G*R, hidden]. At 1-64 rows the product only streams the weights
(V4-Flash: 34-67 MB a projection a layer), so its time is the weights' bytes over the memory
bandwidth XLA's GEMM reaches. On an H100 at 32 rows XLA's GEMMs (split-K, then a sum kernel) read
them at 2.0-2.3 TB/s and this kernel (one program per column block, the whole K in a loop, no
split) at 2.4-2.7 TB/s: 10-16% faster for ``wo_a``, ``wo_b`` and the input projections; at 1 and
8 rows XLA's products were as fast (``wq_b`` had no kernel faster at any row count, so it stays
XLA's) (docs/breaks_and_kernels.md, "Why the kernels' defaults").

    grid (G, N / bn); program (g, j) owns output columns j*bn .. j*bn+bn-1 of group g
    x  [Mp, G*K]   the rows (padded with zero rows to Mp = a power of two >= 16, Triton's dot)
    w  [G, K, N]   read as [K, bn] blocks, bk rows at a time
    out [Mp, G*N]  float32 accumulation over K, rounded once to x's dtype

Numerics are XLA's GEMM's: operands in the layer's dtype, float32 accumulation, one rounding;
only the order of the float32 sums may differ (`tests/ops/test_projection_kernel.py`). The kernel
differentiates as the XLA einsum (`backend.differentiated_as`).

Where it runs is the step's `KernelPlan` ``projections``: "auto" keeps XLA's products everywhere:
inside a decode step the products' gain did not show (an H100, V4-Flash stacks of 4 at 16k, one
machine: CSA B = 32 0.201 ms a layer with the kernel against 0.201 / 0.199 without, HCA B = 32
0.131 against 0.134 / 0.137, within the processes' spread; B = 1 slower, HCA 0.123 against 0.115;
docs/breaks_and_kernels.md, "Why the kernels' defaults"); "pallas" the kernel on CUDA for every
call it takes (bf16 or fp16, at most `MAX_ROWS` token rows, K a power of two, N a multiple of
16); "interpret" the kernel in Pallas' interpret mode on any backend (tests); "xla" never.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from dsv4_jax.backend import Array, differentiated_as, einsum

MAX_ROWS = 64  # token rows a call may have: beyond it the product is a GEMM's, not a weight stream
MIN_PADDED_ROWS = 16  # Triton's smallest dot dimension
# Programs of about one per SM (132 on the H100 and the H200): the widest column block that
# still gives that many, then K blocks of the same shared memory a pipeline stage (bn * bk =
# 8192 elements). At 32 rows these were the H100's best of a 225-configuration screen:
# (64, 128) for wo_a, (32, 256) for wo_b and the input projections.
TARGET_PROGRAMS = 128
BLOCK_ELEMENTS = 8192
COLUMN_BLOCKS = (64, 32, 16)
NUM_WARPS = 4
NUM_STAGES = 4


def _kernel(x_ref, w_ref, out_ref, *, bk: int, steps: int):
    # x_ref [Mp, K] (this group's rows), w_ref [K, bn], out_ref [Mp, bn]
    # float32 (interpret mode only) as the reference's products, not TF32 (a GPU's default); the
    # Triton kernel takes bf16 / fp16 alone, whose dot this leaves as it was.
    exact = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def accumulate(i, acc):
        xk = x_ref[:, pl.ds(i * bk, bk)]
        wk = w_ref[pl.ds(i * bk, bk), :]
        return acc + jax.lax.dot_general(xk, wk, (((1,), (0,)), ((), ())), precision=exact,
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, accumulate, jnp.zeros(out_ref.shape, jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def blocks(groups: int, k: int, n: int) -> tuple[int, int] | None:
    """(bn, bk) for a [G, K, N] weight, or None where the kernel does not take it (N not a
    multiple of 16, K not a power of two of at least 16)."""
    columns = [bn for bn in COLUMN_BLOCKS if n % bn == 0]
    if not columns or k < 16 or k & (k - 1):
        return None
    bn = next((bn for bn in columns if groups * (n // bn) >= TARGET_PROGRAMS), columns[-1])
    return bn, min(BLOCK_ELEMENTS // bn, k)


def project(x: Array, w: Array, *, interpret: bool = False) -> Array:
    """x [M, G, K] @ w [G, K, N] -> [M, G, N] in x's dtype (M <= `MAX_ROWS`; same dtypes).

    Raises ValueError for shapes the kernel does not take (`takes`)."""
    rows, groups, k = x.shape
    n = w.shape[2]
    chosen = blocks(groups, k, n)
    if rows > MAX_ROWS or chosen is None or w.shape[:2] != (groups, k):
        raise ValueError(f"projection_kernel.project: expected x [M <= {MAX_ROWS}, G, K] and w [G, K, N] with K a "
                         f"power of two >= 16 and N a multiple of 16, got x {x.shape} and w {w.shape}")
    bn, bk = chosen
    padded = max(MIN_PADDED_ROWS, 1 << (rows - 1).bit_length())
    x2 = x.reshape(rows, groups * k)
    if padded != rows:
        x2 = jnp.concatenate([x2, jnp.zeros((padded - rows, groups * k), x.dtype)], axis=0)
    column_blocks = n // bn
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        extra["compiler_params"] = pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    out = pl.pallas_call(
        functools.partial(_kernel, bk=bk, steps=k // bk),
        grid=(groups, column_blocks),
        in_specs=[pl.BlockSpec((padded, k), lambda g, j: (0, g)),
                  pl.BlockSpec((None, k, bn), lambda g, j: (g, 0, j))],
        out_specs=pl.BlockSpec((padded, bn), lambda g, j: (0, g * column_blocks + j)),
        out_shape=jax.ShapeDtypeStruct((padded, groups * n), x.dtype),
        interpret=interpret,
        name="projection_kernel",
        **extra,
    )(x2, w)
    return out[:rows].reshape(rows, groups, n)


def supports(rows: int, w_shape: tuple[int, ...], dtype, *, interpret: bool) -> bool:
    """Whether the kernel takes `rows` token rows against a weight of `w_shape` ([K, N] or
    [G, K, N]) in `dtype`: at most `MAX_ROWS` rows and `blocks`' shapes; as a Triton kernel
    only bf16 or fp16 (a float32 dot there would round through TF32, not XLA's float32)."""
    groups, k, n = (1, *w_shape) if len(w_shape) == 2 else w_shape
    if rows > MAX_ROWS or blocks(groups, k, n) is None:
        return False
    return interpret or jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# The projections' einsum forms: a token's features against a weight, optionally per group.
_FORMS = {"bsh,hn->bsn": False, "bsr,rh->bsh": False, "bsgi,gir->bsgr": True}


def projection(subscripts: str, a: Array, b: Array, *, out_dtype, precision=None, kernel: str = "xla") -> Array:
    """`backend.einsum(subscripts, a, b)` of a weight projection, by this kernel where `kernel`
    (the step plan's ``projections``) asks for it and the call is one it `takes`.

    subscripts: "bsh,hn->bsn" / "bsr,rh->bsh" (a [B, S, K] @ b [K, N] -> [B, S, N]) or the grouped
    "bsgi,gir->bsgr" (a [B, S, G, K] @ b [G, K, N] -> [B, S, G, N]). kernel: "xla" XLA's
    product (`KernelPlan.projections_for`), "pallas" the kernel on CUDA, "interpret" the kernel
    in interpret mode (see the module doc). The kernel's gradient is the XLA product's."""
    reference = functools.partial(einsum, subscripts, out_dtype=out_dtype, precision=precision)
    if kernel == "xla" or isinstance(a, np.ndarray):
        return reference(a, b)
    grouped = _FORMS[subscripts]
    interpret = kernel == "interpret"
    rows = math.prod(a.shape[:2])
    a, b = a.astype(out_dtype), b.astype(out_dtype)
    if not supports(rows, b.shape, out_dtype, interpret=interpret) or (
            not interpret and jax.default_backend() != "gpu"):
        # Pallas lowers Triton kernels only where a GPU is the default backend.
        return reference(a, b)

    def run(a, b):
        x = a.reshape(rows, *(a.shape[2:] if grouped else (1, a.shape[2])))
        out = project(x, b if grouped else b[None], interpret=interpret)
        return out.reshape(*a.shape[:2], *(out.shape[1:] if grouped else out.shape[2:]))

    if not interpret:  # chosen when the program is lowered for its platform, as the other kernels are
        run = functools.partial(jax.lax.platform_dependent, cuda=run, default=reference)
    return differentiated_as(reference)(run)(a, b)
