"""The queries' per-head RMSNorm as Pallas kernels, forward and backward (issue 28: training).

In a training step the queries' norm (`norms.head_rms_norm`, over each head's D channels of
the [B, S, H, D] queries, the step's largest activations) is XLA's: forward a reduce and a
fused multiply, backward a reduce and an elementwise pass, each a pass over the queries
(bench/RESULTS.md "Training", session 45: ~0.4 ms a layer of an HCA 4k step's backward).
Here each pass is one kernel over blocks of rows, each row one head's D channels:

    x  [R, D]   R = B * S * H rows, in blocks of `rows` a program
    forward:    f = 1 / sqrt(mean(x^2) + eps)   float32 [rows, 1]
                y = x * round(f)                the product in x's dtype, as `head_rms_norm`
    backward:   g [R, D] the output's cotangent (of x's dtype)
                dx = g * round(f) - x * f^3 / D * sum(g * x)   float32, rounded once

The forward reads x once and writes y; the backward reads x and g once and writes dx (XLA's
gradient reads them twice and rounds each partial gradient to x's dtype). Values: the
forward's factor is a float32 sum in another order (and Triton's sqrt and division), so y may
differ from `head_rms_norm`'s by one rounding of x's dtype where round(f) falls the other way
(rare); the gradient equals XLA's within the rounding of x's dtype (float32: 1e-6).

`query_norm` chooses as the step's `KernelPlan` says (``query_norm``): "auto" the kernels on
CUDA for calls of several queries a row (prefill, training), XLA for decode steps (not
measured there). On the H200 (V4-Flash, bf16, B = 1, 4k, one lease, kernels / XLA / kernels)
an HCA training step took 9.06 / 9.28 / 8.89 ms a layer, CSA's 15.00 / 14.72 / 14.67 (within
noise), the forwards alike (bench/RESULTS.md "Training", session 45).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from .backend import Array, namespace
from .norms import head_rms_norm

BLOCK_ROWS = 16
NUM_WARPS = 4


def _factor(h, eps: float):  # float32 [rows, D] -> [rows, 1]
    return 1.0 / jnp.sqrt(jnp.mean(h * h, axis=1, keepdims=True) + eps)


def _forward_kernel(x_ref, y_ref, *, eps: float):
    x = x_ref[...]
    factor = _factor(x.astype(jnp.float32), eps)
    y_ref[...] = x * factor.astype(x.dtype)


def _backward_kernel(x_ref, g_ref, dx_ref, *, eps: float):
    dtype = x_ref.dtype
    x, g = x_ref[...].astype(jnp.float32), g_ref[...].astype(jnp.float32)
    factor = _factor(x, eps)
    along = jnp.sum(g * x, axis=1, keepdims=True)
    dx = g * factor.astype(dtype).astype(jnp.float32) - x * (factor * factor * factor * along / x.shape[1])
    dx_ref[...] = dx.astype(dtype)


def _rows(x: Array) -> int:
    """Rows a program: the largest power of two <= BLOCK_ROWS dividing x's rows (B * S * H)."""
    n = int(np.prod(x.shape[:-1]))
    rows = BLOCK_ROWS
    while n % rows:
        rows //= 2
    return rows


def _call(kernel, out_dtype, *arrays, interpret: bool):
    shape = arrays[0].shape
    d = shape[-1]
    flat = [a.reshape(-1, d) for a in arrays]
    rows = _rows(arrays[0])
    spec = pl.BlockSpec((rows, d), lambda i: (i, 0))
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        extra["compiler_params"] = pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
    out = pl.pallas_call(kernel, grid=(flat[0].shape[0] // rows,), in_specs=[spec] * len(flat), out_specs=spec,
                         out_shape=jax.ShapeDtypeStruct(flat[0].shape, out_dtype), interpret=interpret,
                         name=kernel.func.__name__.strip("_"), **extra)(*flat)
    return out.reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def head_rms_norm_kernel(x: Array, eps: float, interpret: bool = False) -> Array:
    """`norms.head_rms_norm(x, eps)` by the forward kernel, differentiated by the backward
    kernel (reverse mode only). x [..., D] -> [..., D] (see the module doc)."""
    return _call(functools.partial(_forward_kernel, eps=eps), x.dtype, x, interpret=interpret)


def _vjp_forward(x, eps, interpret):
    return head_rms_norm_kernel(x, eps, interpret), x


def _vjp_backward(eps, interpret, x, g):
    return (_call(functools.partial(_backward_kernel, eps=eps), x.dtype, x, g.astype(x.dtype),
                  interpret=interpret),)


head_rms_norm_kernel.defvjp(_vjp_forward, _vjp_backward)


def query_norm(q: Array, eps: float, choice: str = "xla") -> Array:
    """The queries' per-head RMSNorm, q [B, S, H, D] -> [B, S, H, D], by `choice` (the step's
    ``KernelPlan.query_norm``, resolved for the platform): "xla" `head_rms_norm`; "interpret"
    the kernels in interpret mode; "pallas" the kernels where a GPU is the default backend (and
    where the program is lowered for CUDA: another platform's program keeps `head_rms_norm`);
    "auto" as "pallas" for several queries a row, else "xla". NumPy arrays, and a head_dim the
    Triton kernels cannot take (not a power of two >= 16): `head_rms_norm`."""
    if choice == "auto":
        choice = "pallas" if q.shape[1] > 1 else "xla"
    if choice == "xla" or namespace(q) is np:
        return head_rms_norm(q, eps)
    if choice == "interpret":
        return head_rms_norm_kernel(q, float(eps), True)
    d = q.shape[-1]
    # Pallas lowers Triton kernels only where a GPU is the default backend; Triton's blocks need
    # a power-of-two width of at least 16.
    if jax.default_backend() != "gpu" or d < 16 or d & (d - 1):
        return head_rms_norm(q, eps)
    return jax.lax.platform_dependent(
        q, cuda=lambda x: head_rms_norm_kernel(x, float(eps), False), default=lambda x: head_rms_norm(x, eps))
