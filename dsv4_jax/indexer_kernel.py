"""The indexer's scoring of a prefill as one Pallas kernel: Hopper's warpgroup MMAs for its GEMM.

The lightning indexer scores every (query, entry) pair: relu(q_h . k) * c^-1/2 * w_h summed over
its nI heads, a GEMM of [S * nI, c] queries against [T, c] keys per row. In a long CSA prefill
that GEMM is most of the layer's work (bench/RESULTS.md, "Where a CSA prefill goes": the
selection 56% of a 64k prefill's device time, 70% at 128k). The native handler's scoring
(csrc/select_topk_cuda.cu `ScoreKernelMma`) issues `mma.sync` and runs at ~175 TFLOP/s on an
H200; this kernel's products are one `dot` per tile, which Triton lowers to `wgmma`, and it
scored a query block of 256 against 65,536 / 262,144 entries in 0.68 / 2.75 ms against the
handler's 1.57 / 6.25 ms (bench/topk.py `select_prefill`, session 43). The handler's top-k then
picks from its scores (`native.topk`), so the picks keep the module contract (csrc/select_topk.h).

    queries [B, S, nI, c] bf16, weights float32 [B, S, nI], keys [B, T, c] bf16, visible int [B, S]
      -> scores float32 [B, S, T]  (entries t >= visible[b, s] are -inf)

    grid (B * S, ceil(T / (block * tiles))); program (r, j) scores query row r = b * S + s against
    `tiles` key blocks of `block` entries from j * block * tiles, looping over them (Triton
    pipelines the loop's key loads); blocks wholly past the row's visible entries are not loaded.
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

from .backend import Array

BLOCK = 128     # entries a block: one wgmma tile of keys
TILES = 8       # blocks a program loops over (its key loads pipelined)
NUM_WARPS = 8   # measured against 4 at 64k / 262k entries: 681 / 2746 us against 697 / 2785
NUM_STAGES = 3


def _kernel(visible_ref, q_ref, w_ref, keys_ref, out_ref, *, block: int, tiles: int, scale: float):
    first = pl.program_id(1) * block * tiles
    visible = visible_ref[0]
    n_loaded = jnp.clip((visible - first + block - 1) // block, 0, tiles)
    q = q_ref[0]                              # [nI, c]
    w = w_ref[0].astype(jnp.float32)          # [nI]
    entries = jnp.arange(block, dtype=jnp.int32)

    def score_block(n, carry):
        k = keys_ref[pl.ds(n * block, block), :]  # [block, c]
        dots = jax.lax.dot_general(k, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = (jnp.maximum(dots, 0.0) * jnp.float32(scale) * w[None, :]).sum(axis=1)  # [block]
        s = jnp.where(s == 0.0, jnp.float32(0.0), s)  # fold -0.0 into +0.0: ties must compare equal
        out_ref[0, pl.ds(n * block, block)] = jnp.where(first + n * block + entries < visible, s, -jnp.inf)
        return carry

    jax.lax.fori_loop(0, n_loaded, score_block, 0)

    def unloaded(n, carry):  # blocks past the row's visible entries
        out_ref[0, pl.ds(n * block, block)] = jnp.full((block,), -jnp.inf, jnp.float32)
        return carry

    jax.lax.fori_loop(n_loaded, tiles, unloaded, 0)


def index_scores(queries: Array, weights: Array, keys: Array, visible: Array, *, interpret: bool = False,
                 block: int = BLOCK, tiles: int = TILES, num_warps: int = NUM_WARPS,
                 num_stages: int = NUM_STAGES) -> Array:
    """`indexer.index_scores` by the kernel: float32 [B, S, T] (see the module doc).

    Keys whose T is not a multiple of block * tiles are padded to one and the scores cut back
    (copies; caches of a power of two of entries take none). No gradient: the native selection
    differentiates its scores as the XLA twin's (`breaks._scores_with_gradient`).
    """
    batch, seq, heads, dim = queries.shape
    slots = keys.shape[1]
    span = block * tiles
    padded = -(-slots // span) * span
    if padded != slots:
        keys = jnp.pad(keys, ((0, 0), (0, padded - slots), (0, 0)))
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        extra["compiler_params"] = pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    rows = batch * seq
    out = pl.pallas_call(
        functools.partial(_kernel, block=block, tiles=tiles, scale=dim ** -0.5),
        grid=(rows, padded // span),
        in_specs=[
            pl.BlockSpec((1,), lambda r, j: (r,)),
            pl.BlockSpec((1, heads, dim), lambda r, j: (r, 0, 0)),
            pl.BlockSpec((1, heads), lambda r, j: (r, 0)),
            pl.BlockSpec((None, span, dim), lambda r, j: (r // seq, j, 0)),
        ],
        out_specs=pl.BlockSpec((1, span), lambda r, j: (r, j)),
        out_shape=jax.ShapeDtypeStruct((rows, padded), jnp.float32),
        interpret=interpret,
        name="indexer_scores_kernel",
        **extra,
    )(visible.astype(jnp.int32).reshape(rows), queries.reshape(rows, heads, dim),
      weights.astype(jnp.float32).reshape(rows, heads), keys)
    return out[:, :slots].reshape(batch, seq, slots)


def supported(queries: Array, keys: Array) -> bool:
    """Whether the Triton kernel takes these operands: bf16 queries and keys (a float32 dot would
    be TF32), heads and channels powers of two of at least 16 (one MMA tile)."""

    def pow2_tile(x):
        return x >= 16 and x & (x - 1) == 0

    return (queries.dtype == jnp.bfloat16 and keys.dtype == jnp.bfloat16
            and pow2_tile(queries.shape[-2]) and pow2_tile(queries.shape[-1]))


def choose(choice: str, queries: Array, keys: Array) -> str:
    """How a native selection of these operands scores (`KernelPlan.select_scores`, resolved for
    the step's platform): "pallas" (the Triton kernel), "interpret" (the kernel in interpret
    mode) or "native" (the handler's own scoring). "auto" is "pallas" for calls of several
    queries a row that the kernel takes, else "native"."""
    if choice == "auto":
        several = queries.shape[1] > 1
        return "pallas" if several and supported(queries, keys) else "native"
    if choice == "pallas" and not supported(queries, keys):
        return "native"
    return choice
