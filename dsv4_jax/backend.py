"""Array-namespace helpers: one copy of the math, run by XLA or by NumPy.

The stages that may sit inside a host break (`wq_b_kv_insert`, the compressors, the indexer)
are written once against the part of the NumPy API that `jax.numpy` shares. Called with
`jax.Array`s (or tracers) they are traced into the jitted step; called with `np.ndarray`s
inside a `jax.pure_callback` they are the "NumPy twin" that runs on the host. The few
operations whose spelling differs (scatter, stable top-k, matmul with an accumulation dtype,
blocking over queries) live here.

Dtype rule for matmuls, both namespaces: operands in the output dtype, accumulation in
float32, one rounding of the result: what a PyTorch matmul does (see `einsum`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = Any  # jax.Array or np.ndarray


def namespace(*arrays: Array):
    """`jax.numpy` if any argument is a JAX array or tracer, else `numpy`."""
    for a in arrays:
        if isinstance(a, jax.Array):
            return jnp
    return np


def update_trailing(x: Array, values: Array) -> Array:
    """`x` with its trailing ``values.shape[-1]`` channels replaced by `values` (same dtype).

    On CUDA an update of x (`.at[..., -n:].set`), which XLA does in x's buffer where x is not
    used again: for the large [B, S, H, D] queries and attention output, whose copy would cost a
    pass over every query in a prefill. Elsewhere a concatenation: XLA's CPU backend (jax 0.10.2,
    0.12) miscompiles such an update where it feeds a scatter or a Pallas kernel in interpret
    mode (scripts/xla_cpu_update_scatter_repro.py). Chosen when the program is lowered for its
    platform (`jax.lax.platform_dependent`); the values are the same either way.
    """
    start = x.shape[-1] - values.shape[-1]

    def update(x, values):
        return x.at[..., start:].set(values)

    def concatenate(x, values):
        return jnp.concatenate([x[..., :start], values], axis=-1)

    return jax.lax.platform_dependent(jnp.asarray(x), values, cuda=update, default=concatenate)


def to_host_memory(x: Array) -> Array:
    """Inside a jitted function: `x` as an output placed in the host's pinned memory, where the
    default device has such memory, else `x`. For a small result the host reads right after
    the program (the layer's finite verdict, `call_path.finite_guard`): the program writes it
    there itself, so reading it is no device-to-host transfer of its own (on an H200 ~0.09 ms
    after a step, against ~0.24 ms for a device array's read; docs/breaks_and_kernels.md, "Why the kernels' defaults").
    """
    return jax.device_put(x, jax.memory.Space.Host) if _has_pinned_host() else x


@functools.cache
def _has_pinned_host() -> bool:
    try:
        return "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}
    except Exception:  # a backend without memory kinds
        return False


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def einsum(subscripts: str, a: Array, b: Array, *, out_dtype, precision=None) -> Array:
    """Two-operand einsum in `out_dtype`: operands cast to it, float32 accumulation.

    A float32 `out_dtype` widens low-precision operands first (the reference's `.float()`);
    a bf16 one gives a bf16 matmul, which accumulates in float32 and rounds once on every
    backend (cuBLAS, XLA:CPU), like a PyTorch bf16 matmul.
    """
    xp = namespace(a, b)
    if xp is np:
        # Round the operands to `out_dtype` as the XLA branch does (a float32 weight of a bf16
        # layer becomes bf16; ml_dtypes supplies NumPy's bfloat16), then compute in float32:
        # NumPy has no bf16 kernels, and float32 is what the accumulation is anyway.
        dtype = np.dtype(out_dtype)
        a32, b32 = (np.asarray(v).astype(dtype).astype(np.float32) for v in (a, b))
        return np.einsum(subscripts, a32, b32, optimize=True).astype(dtype)
    a, b = a.astype(out_dtype), b.astype(out_dtype)

    def plain(a, b):
        return jnp.einsum(subscripts, a, b, precision=precision)

    if not _single_token_projection(subscripts, a):
        return plain(a, b)

    # Chosen when the program is lowered for its platform (also for an exported program).
    return jax.lax.platform_dependent(
        a, b, cuda=functools.partial(padded_rows_product, subscripts, precision=precision), default=plain)


def padded_rows_product(subscripts: str, a: Array, b: Array, *, precision=None, rows: int | None = None) -> Array:
    """`einsum` of a single token's projection (a [1, 1, ...]) computed on `rows` rows (default
    `GPU_DOT_ROWS`): the real row first, then zero rows. Rows are independent, so row 0 is
    the same product (rounded by whichever GEMM the backend picks)."""
    rows = GPU_DOT_ROWS if rows is None else rows
    many = jnp.concatenate([a, jnp.zeros((rows - 1, *a.shape[1:]), a.dtype)], axis=0)
    return jnp.einsum(subscripts, many, b, precision=precision)[:1]


# A dense projection of a single token (B = S = 1: a decode step of one row) is a
# matrix-vector product, which XLA:GPU (jax 0.11) emits as reduction fusions at a fraction of
# the memory bandwidth; on 8 rows (the real one, then zeros) it is a GEMM. On the H200 that
# took the input projections of a V4-Flash B = 1 decode step from 65 to 13 us per layer
# (docs/breaks_and_kernels.md, "Why the kernels' defaults"). On the CPU the
# padding costs 2x (XLA:CPU's GEMV is fine), so it is CUDA only. (Repeating the row instead of
# zeros measured no gain, 2026-12-02.)
GPU_DOT_ROWS = 8


def _single_token_projection(subscripts: str, a: Array) -> bool:
    """Whether `a @ b` is a projection ("bs...,<no b or s>->bs...") of a single token."""
    if not subscripts.startswith("bs") or a.shape[0] * a.shape[1] != 1:
        return False
    rhs = subscripts.split(",")[1].split("->")[0]
    return "b" not in rhs and "s" not in rhs


def scatter_rows(target: Array, index: Array, values: Array) -> Array:
    """`target[b, index[b, j]] = values[b, j]`; entries with an out-of-range index are dropped.

    target: [B, N, ...], index: [B, J] int, values: [B, J, ...] -> [B, N, ...] (a new array).
    """
    xp = namespace(target, index, values)
    if xp is jnp:
        # One scatter per row, vmapped: with no explicit batch index, XLA's partitioner keeps a
        # batch-sharded target's writes on their shard (a [batch, index] scatter all-gathers the
        # updates across the batch axis first).
        return jax.vmap(lambda t, i, v: t.at[i].set(v, mode="drop"))(target, index, values.astype(target.dtype))
    out = np.array(target, copy=True)
    keep = (index >= 0) & (index < target.shape[1])
    b, j = np.nonzero(keep)
    out[b, index[b, j]] = values[b, j].astype(out.dtype)
    return out


def top_k_stable(scores: Array, k: int) -> Array:
    """Indices of the `k` largest scores along the last axis, ties to the lower index.

    Ordered by descending score, equal scores by ascending index; `-inf` entries come last in
    index order. `scores` must hold no NaN and no negative zero (see `indexer.index_scores`).
    Returns int32 [..., k].
    """
    if namespace(scores) is jnp:
        return jax.lax.top_k(scores, k)[1].astype(jnp.int32)  # lax.top_k is stable
    return _np_top_k_stable(np.asarray(scores), k)


def _np_top_k_stable(scores: np.ndarray, k: int) -> np.ndarray:
    """NumPy twin of `lax.top_k`: O(T) selection, then a stable sort of the k winners."""
    lead, n = scores.shape[:-1], scores.shape[-1]
    rows = scores.reshape(-1, n)
    if k == n:
        order = np.argsort(-rows, axis=-1, kind="stable")
        return order.astype(np.int32).reshape(*lead, k)
    # The k-th largest value per row; everything above it is in, ties at it go lowest-index first.
    kth = -np.partition(-rows, k - 1, axis=-1)[:, k - 1 : k]
    above = rows > kth
    tied = rows == kth
    need = k - above.sum(axis=-1, keepdims=True)
    chosen = above | (tied & (np.cumsum(tied, axis=-1) <= need))
    idx = np.nonzero(chosen)[1].reshape(rows.shape[0], k)  # ascending index within each row
    picked = np.take_along_axis(rows, idx, axis=-1)
    order = np.argsort(-picked, axis=-1, kind="stable")
    return np.take_along_axis(idx, order, axis=-1).astype(np.int32).reshape(*lead, k)


# Queries processed at a time by the indexer scoring and sparse attention (the default of
# `DeepseekV4Attention(query_block=...)` and of every blocked function): bounds the per-query
# temporaries of long prefills, e.g. the indexer's [B, block, nI, T] float32 scores.
QUERY_BLOCK = 256


def map_query_blocks(fn: Callable[..., Any], per_query: Sequence[Array], shared: Sequence[Array], block: int):
    """Apply `fn(*per_query_block, *shared)` over blocks of the query axis (axis 1).

    Bounds peak memory of long prefills: every per-query intermediate exists for `block`
    queries at a time. `per_query` arrays are [B, S, ...] (or None, passed through); `fn`
    returns a pytree of [B, s, ...] arrays. On XLA the blocks run in a `lax.map` loop, on
    NumPy in a Python loop.
    """
    present = [a for a in (*per_query, *shared) if a is not None]
    xp = namespace(*present)
    seq = per_query[0].shape[1]
    if seq <= block:
        return fn(*per_query, *shared)
    if xp is np:
        outs = [
            fn(*(None if a is None else a[:, i : i + block] for a in per_query), *shared)
            for i in range(0, seq, block)
        ]
        return jax.tree.map(lambda *parts: np.concatenate(parts, axis=1), *outs)
    n_blocks = -(-seq // block)
    pad = n_blocks * block - seq

    def to_blocks(a):
        if a is None:
            return None
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(a.shape[0], n_blocks, block, *a.shape[2:])
        return jnp.moveaxis(a, 1, 0)

    def from_blocks(a):
        a = jnp.moveaxis(a, 0, 1)
        return a.reshape(a.shape[0], n_blocks * block, *a.shape[3:])[:, :seq]

    outs = jax.lax.map(lambda xs: fn(*xs, *shared), tuple(to_blocks(a) for a in per_query))
    return jax.tree.map(from_blocks, outs)


def reference_vjp(reference: Callable[..., Any], args: tuple, cotangent) -> tuple:
    """The cotangents of `args` under ``reference(*args)`` for `cotangent`: the VJP with respect to
    every floating-point array among them, None for the others (integer and boolean arrays, None),
    as a `jax.custom_vjp` backward returns them."""
    leaves, tree = jax.tree.flatten(args)
    wrt = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]

    def ref(*inexact):
        it = iter(inexact)
        return reference(*jax.tree.unflatten(tree, [next(it) if w else x for x, w in zip(leaves, wrt)]))

    _, vjp = jax.vjp(ref, *(x for x, w in zip(leaves, wrt) if w))
    grads = iter(vjp(cotangent))
    return tuple(jax.tree.unflatten(tree, [next(grads) if w else None for w in wrt]))


def differentiated_as(reference: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: a kernel whose gradient is `reference`'s (a `jax.custom_vjp`).

    ``differentiated_as(ref)(kernel)(*args)`` runs ``kernel(*args)``; its backward pass is the
    VJP of ``ref(*args)`` (the XLA reference, recomputed from the saved inputs), taken with
    respect to every floating-point array among `args` (integer and boolean arrays, e.g. key
    indices, get no cotangent; None arguments pass through). So a Pallas kernel, which has no
    differentiation rule of its own, gives exactly the reference's gradients. Reverse mode only
    (`jax.grad`, `jax.vjp`); forward mode (`jax.jvp`) is refused by JAX for a custom VJP.
    """

    def decorate(kernel: Callable[..., Any]) -> Callable[..., Any]:
        @jax.custom_vjp
        def call(*args):
            return kernel(*args)

        def forward(*args):
            return kernel(*args), args

        call.defvjp(forward, functools.partial(reference_vjp, reference))
        return functools.wraps(kernel)(call)

    return decorate
