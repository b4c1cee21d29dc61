"""A candidate for the indexer's scoring on Hopper: a Pallas (Triton) kernel whose key-query
products are one `dot` per tile, which Triton lowers to warpgroup MMAs (`wgmma`) on an H200.

Why (bench/RESULTS.md, "Where a CSA prefill goes", session 42): the native handler's scoring
kernel (csrc/select_topk_cuda.cu `ScoreKernelMma`, `mma.sync`) runs at ~175 TFLOP/s, 22% of the
rate the floor assumes, and sets CSA's long-prefill ratio; three variants of it measured no
better. Hopper's full bf16 rate comes through `wgmma`. Not in the package until it measures
faster on the H200 (`python3 bench/topk.py --device-time --cases select_prefill,select_fp4
--pallas-configs ...`, variants "native-pallas-scores[...]+topk"); if it does not, it leaves main.

    scores(queries [R, nI, c] bf16, weights f32 [R, nI], keys [B, T, c] bf16, visible int32 [R],
           rows_per_batch=S)  ->  f32 [R, T]
    row r = b * S + s reads keys[b]; entries t >= visible[r] are -inf.

    grid (R / rows, ceil(T / (block * tiles))); program (i, j) scores rows i*rows .. i*rows+rows-1
    (one batch row: S % rows == 0) against `tiles` key blocks of `block` entries from
    j * block * tiles, looping over them (Triton pipelines the loop's key loads); a block wholly
    past the last row's visible entries is not loaded.
    per block and row: dots = keys[block, c] @ q[nI, c]^T (float32 accumulation) -> [block, nI];
    score = sum over heads of relu(dots) * c^-1/2 * w -> [block]

Numerics: the reference's formula (`indexer._block_scores`: relu(q.k) * c^-1/2 * w, summed over
heads, -0.0 folded into +0.0); bf16 products are exact in float32, and only the order of the
float32 sums differs from the XLA twin and from the native kernel (~1e-7 relative), as between
those two today.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BLOCK = 128   # entries a block
TILES = 8     # blocks a program loops over
ROWS = 1      # query rows a program scores against each loaded block


def _kernel(visible_ref, q_ref, w_ref, keys_ref, out_ref, *, rows: int, block: int, tiles: int, scale: float):
    j = pl.program_id(1)
    first = j * block * tiles
    vis = [visible_ref[r] for r in range(rows)]
    last = vis[0]
    for v in vis[1:]:
        last = jnp.maximum(last, v)
    n_loaded = jnp.clip((last - first + block - 1) // block, 0, tiles)
    q = [q_ref[r] for r in range(rows)]                       # [nI, c] each
    w = [w_ref[r].astype(jnp.float32) for r in range(rows)]  # [nI]
    entries = jnp.arange(block, dtype=jnp.int32)

    def score_block(n, carry):
        t0 = first + n * block
        k = keys_ref[pl.ds(n * block, block), :]  # [block, c]
        for r in range(rows):
            dots = jax.lax.dot_general(k, q[r], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s = (jnp.maximum(dots, 0.0) * jnp.float32(scale) * w[r][None, :]).sum(axis=1)  # [block]
            s = jnp.where(s == 0.0, jnp.float32(0.0), s)
            out_ref[r, pl.ds(n * block, block)] = jnp.where(t0 + entries < vis[r], s, -jnp.inf)
        return carry

    jax.lax.fori_loop(0, n_loaded, score_block, 0)

    def unloaded(n, carry):  # blocks past every row's visible entries
        for r in range(rows):
            out_ref[r, pl.ds(n * block, block)] = jnp.full((block,), -jnp.inf, jnp.float32)
        return carry

    jax.lax.fori_loop(n_loaded, tiles, unloaded, 0)


@functools.partial(jax.jit, static_argnames=("rows_per_batch", "rows", "block", "tiles", "num_warps",
                                             "num_stages", "interpret"))
def scores(queries, weights, keys, visible, *, rows_per_batch: int, rows: int = ROWS, block: int = BLOCK,
           tiles: int = TILES, num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
    """float32 [R, T] scores (see the module doc). Keys whose T is not a multiple of
    block * tiles are padded to one (a copy: real caches hold a power of two of entries)."""
    n_rows, heads, dim = queries.shape
    batch, slots, _ = keys.shape
    if n_rows != batch * rows_per_batch or rows_per_batch % rows:
        raise ValueError(f"queries: expected B * S rows with S % rows == 0, got {n_rows} rows for B = {batch}, "
                         f"S = {rows_per_batch}, rows = {rows}")
    span = block * tiles
    padded = -(-slots // span) * span
    if padded != slots:
        keys = jnp.pad(keys, ((0, 0), (0, padded - slots), (0, 0)))
    programs_per_batch = rows_per_batch // rows
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        extra["compiler_params"] = pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out = pl.pallas_call(
        functools.partial(_kernel, rows=rows, block=block, tiles=tiles, scale=dim ** -0.5),
        grid=(n_rows // rows, padded // span),
        in_specs=[
            pl.BlockSpec((None, rows), lambda i, j: (i, 0)),
            pl.BlockSpec((rows, heads, dim), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((rows, heads), lambda i, j: (i, 0)),
            pl.BlockSpec((None, span, dim), lambda i, j: (i // programs_per_batch, j, 0)),
        ],
        out_specs=pl.BlockSpec((rows, span), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n_rows, padded), jnp.float32),
        interpret=interpret,
        **extra,
    )(visible.astype(jnp.int32).reshape(n_rows // rows, rows), queries, weights.astype(jnp.float32), keys)
    return out[:, :slots]
