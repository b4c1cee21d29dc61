"""Decode's last attention stage as one Pallas (Triton) kernel: merge the key splits with the
sink, round, and undo the output's RoPE.

At small batches the decode attention kernel spreads each row's key blocks over `splits`
programs (`sparse_attention_kernel`: flash decoding) and writes float32 partials. What follows
is XLA's: `combine` (below: the splits and the sink merged, rounded to the compute dtype),
then the layer's inverse RoPE on the output's trailing channels (`rope.derotate_output`). On
the H200 those are three or four small kernels one after another between the attention kernel
and ``wo_a`` (a V4-Flash CSA step compiled for it: an ``exp``, a merge, a rotation and an
in-place update at B = 32; two reductions and a merge at B = 1; `bench/deviceless.py
--keep-dump`), each a launch on the step's critical path. Here they are one:

    grid (R, H / bh); program (r, g) owns heads g*bh .. g*bh+bh-1 of query row r
    acc   [splits, bh, D]   float32 un-normalised partial outputs of the splits
    m, total [splits, bh]   each split's running max (-inf: it saw no key) and sum of exp(s - m)
    top   [bh]              max(max_j m_j, sink)
    o     [bh, D]           sum_j acc_j exp(m_j - top) / (sum_j total_j exp(m_j - top) + exp(sink - top)),
                            rounded to the compute dtype
    the rotated channels    o's trailing 2 * half channels as (even, odd) pairs, by cos / sin of
                            the row's position (sin negated: the inverse rotation), in float32
                            from the rounded values, rounded again; the other channels as o

The same arithmetic as `combine` then `apply_rope` in the same order (float32 throughout, one
rounding before the rotation and one after it, cos and sin computed by XLA as `apply_rope`
computes them: `rope.rotation_tables`); only a compiler's choices (fused multiply-adds, its
exp) may move a bf16 result by one unit in the last place (`tests/ops/test_split_merge_kernel.py`).

Used where the decode kernel runs with several splits and no log-normaliser is needed (the
primal of a decode step, not a training step's forward); the step's `KernelPlan` ``split_merge``
says where: "auto" the kernel where it measured faster inside a decode step (CSA batches of at
least `AUTO_MIN_ROWS` rows, on an H100; the H200's A/B is still to run), XLA's merge elsewhere;
"pallas" the kernel on CUDA wherever the attention kernel splits; "interpret" the kernel in
interpret mode on any backend.
It has no gradient of its own: the attention kernel's `custom_vjp` differentiates the
reference (`sparse_attention._by_kernel`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from dsv4_jax.backend import Array
from dsv4_jax.ops.rope import derotate_output, rotation_tables

# Where "auto" takes the kernel: CSA decode calls of at least this many query rows, i.e. where
# the attention kernel's batch blocks run (`sparse_attention_kernel.MIN_ROWS`; 4 splits a row at
# B = 32). On an H100 (V4-Flash CSA stacks of 4 at 16k, same buffers, one machine, processes
# alternating) B = 32 took 0.1975 ms a layer against XLA's 0.2014 (medians of 6 and 7 processes,
# -1.9%); B = 1 (32 splits a row) 0.1611 against 0.1591 (+1.3%, within the processes' spread):
# XLA's merge stays there, and for HCA (not measured). docs/breaks_and_kernels.md, "Why the kernels' defaults".
AUTO_MIN_ROWS = {"csa": 16}
TARGET_PROGRAMS = 512  # as many as XLA's merge fusions launch blocks (512-2048 at V4-Flash's decode)
MAX_BLOCK_HEADS = 8
BLOCK_COLUMNS = 64  # without a rotation; with one, its 2 * half channels (V4: 64)
NUM_WARPS = 4


def block_columns(d: int, half: int) -> int:
    """bd: the rotated channels' width (each program then has either only rotated channels or
    none), else BLOCK_COLUMNS (at most D)."""
    return 2 * half if half else min(d, BLOCK_COLUMNS)


def block_heads(rows: int, heads: int, column_blocks: int = 1) -> int:
    """bh: the largest power of two <= MAX_BLOCK_HEADS dividing `heads` that still gives
    TARGET_PROGRAMS programs (1 at least)."""
    bh = 1
    while (bh * 2 <= MAX_BLOCK_HEADS and heads % (bh * 2) == 0
           and rows * heads // (bh * 2) * column_blocks >= TARGET_PROGRAMS):
        bh *= 2
    return bh


def supports(x: Array, rotation: tuple | None) -> bool:
    """Whether the Triton kernel takes partials of x's head dim D (x [..., D]: the queries or
    the partials): powers of two for Triton's tensors (D, the rotated channels' half), the
    unrotated channels a whole number of column blocks."""
    d = x.shape[-1]
    half = 0 if rotation is None else int(np.shape(rotation[1])[-1])
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    bd = block_columns(d, half)
    return pow2(d) and pow2(bd) and d % bd == 0 and (d - 2 * half) % bd == 0


def _kernel(*refs, splits: int, half: int, dtype):
    acc_ref, m_ref, total_ref, sink_ref = refs[:4]  # acc_ref [splits, bh, bd]: this column block
    table_ref = refs[4] if half else None
    o_ref = refs[-1]  # [bh, bd]
    sink = sink_ref[...]  # [bh]
    bh, bd = o_ref.shape

    # The splits unrolled: their loads are independent, so they are all in flight at once (a
    # loop over them waited on each load in turn: on an H100 the CSA B = 1 step, 32 splits,
    # went 4% slower than XLA's merge with it).
    top = sink
    for j in range(splits):
        top = jnp.maximum(top, m_ref[j])
    weights, den = [], jnp.zeros_like(sink)
    for j in range(splits):
        weights.append(jnp.exp(m_ref[j] - top)[:, None])  # [bh, 1]; 0 for a split with no key
        den = den + total_ref[j] * weights[-1][:, 0]
    den = (den + jnp.exp(sink - top))[:, None]

    def merged(cols):  # the merged output's channels `cols` of this block, float32 [bh, n]
        num = jnp.zeros((bh, bd if cols is None else half), jnp.float32)
        for j in range(splits):
            # (a traced split index: interpret mode's discharge rejects a Python int beside a stride)
            part = acc_ref[j] if cols is None else acc_ref[jnp.int32(j), :, cols]
            num = num + part * weights[j]
        return num / den

    if not half:
        o_ref[...] = merged(None).astype(dtype)
        return
    rotated = pl.program_id(2) == pl.num_programs(2) - 1  # the last column block: the rotated channels

    @pl.when(jnp.logical_not(rotated))
    def _():
        o_ref[...] = merged(None).astype(dtype)

    @pl.when(rotated)
    def _():
        # as `apply_rope` reads o: rounded to the compute dtype, its (even, odd) pairs rotated in float32
        even = merged(pl.ds(0, half, stride=2)).astype(dtype).astype(jnp.float32)
        odd = merged(pl.ds(1, half, stride=2)).astype(dtype).astype(jnp.float32)
        cos, sin = table_ref[0][None, :], table_ref[1][None, :]  # [1, half], sin negated (inverse)
        o_ref[:, pl.ds(0, half, stride=2)] = (even * cos - odd * sin).astype(dtype)
        o_ref[:, pl.ds(1, half, stride=2)] = (odd * cos + even * sin).astype(dtype)


def merge_splits(acc: Array, m: Array, total: Array, sinks: Array, dtype, rotation: tuple | None = None,
                 *, interpret: bool = False) -> Array:
    """The splits merged with the sink, in `dtype`, de-rotated by `rotation`: [R, H, D].

    acc [R, splits, H, D], m and total [R, splits, H] (float32, `sparse_attention_kernel._call`'s
    partials), sinks [H]; rotation None or (positions [R] int, freqs float32 [half] (NumPy),
    scale): the inverse RoPE of the output's trailing 2 * half channels at each row's position.
    Equals `reference` (`combine`, then `apply_rope(..., inverse=True)`) up to a compiler's
    float32 contractions."""
    r, splits, h, d = acc.shape
    half = 0 if rotation is None else int(np.shape(rotation[1])[-1])
    bd = block_columns(d, half)
    bh = block_heads(r, h, d // bd)
    args = [acc, m, total, sinks.astype(jnp.float32)]
    in_specs = [pl.BlockSpec((None, splits, bh, bd), lambda i, g, c: (i, 0, g, c)),
                pl.BlockSpec((None, splits, bh), lambda i, g, c: (i, 0, g)),
                pl.BlockSpec((None, splits, bh), lambda i, g, c: (i, 0, g)),
                pl.BlockSpec((bh,), lambda i, g, c: (g,))]
    if half:
        positions, freqs, scale = rotation
        # [R, 2, half]: one input (XLA computes it in one small fusion, off the critical path)
        args.append(jnp.stack(rotation_tables(positions.reshape(r), freqs, scale, dtype, inverse=True), axis=1))
        in_specs.append(pl.BlockSpec((None, 2, half), lambda i, g, c: (i, 0, 0)))
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        extra["compiler_params"] = pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
    return pl.pallas_call(
        functools.partial(_kernel, splits=splits, half=half, dtype=dtype),
        grid=(r, h // bh, d // bd),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bh, bd), lambda i, g, c: (i, g, c)),
        out_shape=jax.ShapeDtypeStruct((r, h, d), dtype),
        interpret=interpret,
        name="split_merge",
        **extra,
    )(*args)


def combine(acc: Array, m: Array, total: Array, sinks: Array, dtype, with_lse: bool = False):
    """Merge the splits and the sink: [R, splits, H, D], [R, splits, H] x2, sinks [H] -> [R, H, D]
    (and, `with_lse`, the log-normaliser [R, H] float32).

    The sink's logit joins the softmax denominator only (its value vector is zero)."""
    sink = sinks.astype(jnp.float32)[None, :]
    top = jnp.maximum(jnp.max(m, axis=1), sink)  # [R, H]: finite, the sink is
    w = jnp.exp(m - top[:, None])  # [R, splits, H]; 0 for a split with no key
    num = jnp.sum(acc * w[..., None], axis=1)
    den = jnp.sum(total * w, axis=1) + jnp.exp(sink - top)
    o = (num / den[..., None]).astype(dtype)
    return (o, top + jnp.log(den)) if with_lse else o


def reference(acc: Array, m: Array, total: Array, sinks: Array, dtype, rotation: tuple | None = None) -> Array:
    """XLA's twin of `merge_splits`: `combine`, then the inverse RoPE in place."""
    o = combine(acc, m, total, sinks, dtype)
    if rotation is None:
        return o
    positions, freqs, scale = rotation
    return derotate_output(o, positions.reshape(-1), freqs, scale)
