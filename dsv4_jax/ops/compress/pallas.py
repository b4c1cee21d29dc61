"""The compressor's decode pooling as one Pallas kernel, run only for rows that complete a window.

A decode step writes its token into the compressor's ring (`cache.insert_ring`), and where
that token completes a window the window's pooled entry is written (`compressor.compress`).
On the XLA path the pooling runs for every row at every step: a row of XLA fusions (the
gate's max, exp and sum over the window's slots, the weighted sum of kv), each reading the
whole window, whose result is dropped by the entries' scatter unless the row just completed
its window, i.e. once in m steps (m = 4 for CSA, 128 for HCA). This kernel reads the window
straight from the ring and does the whole pooling in one pass, and a row that completes
nothing skips it (it writes zeros, which nothing reads).

    grid (B, Dc / bc); program (b, c) owns channels c*bc .. c*bc+bc-1 of row b's entry
    ring     [B, R, 2*n*Dc]   [kv | gate] per slot p % R (R = m for HCA, 2m for CSA, n = 1 / 2)
    kv, gate [2m or m, bc]    the window's slots: HCA window w (the whole ring); CSA the Ca half
                              of window w-1 then the Cb half of window w (ring halves
                              (w-1) % 2 and w % 2; gate -inf and kv 0 for window -1)
    pooled   [bc]             sum_j softmax_j(gate_j + bias_j) * kv_j

Numerics are the XLA path's (`compressor._pool`): float32 gate logits, probabilities rounded
to the kv dtype, the products in the kv dtype, their sum accumulated in float32 and rounded
once. Only the order of the float32 sums may differ, so float32 agrees within rounding and
bf16 within one rounding of the entry (`tests/ops/test_compressor_kernel.py`).

`compressor.compress` chooses it as the step's `KernelPlan` says (``compress``): by default on
CUDA at every batch, where it is a Triton kernel inside the step's CUDA graph (it measured faster
at B = 1 and 32 on the H200; docs/breaks_and_kernels.md, "Why the kernels' defaults");
the XLA path stays the reference, runs everywhere else, and gives the kernel its gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsv4_jax.backend import Array

BLOCK_CHANNELS = 128
NUM_WARPS = 4

def _kernel(first_ref, done_ref, ring_ref, bias_ref, out_ref, *, m: int, dc: int, bc: int, overlap: bool):
    b, c = pl.program_id(0), pl.program_id(1)
    col = c * bc
    width = (2 if overlap else 1) * dc  # the kv half of a ring slot; the gate half follows it
    dtype = out_ref.dtype

    @pl.when(done_ref[b] == 0)
    def _():  # no window completes: nothing of this row is written into the entries
        out_ref[...] = jnp.zeros(out_ref.shape, dtype)

    @pl.when(done_ref[b] != 0)
    def _():
        def slots(first, offset):
            # m ring slots from `first`: their kv channels offset + col .. (bc of them) and the
            # float32 gate logits of the same channels
            kv = ring_ref[b, pl.ds(first, m), pl.ds(offset + col, bc)]
            gate = ring_ref[b, pl.ds(first, m), pl.ds(width + offset + col, bc)].astype(jnp.float32)
            return kv, gate + bias_ref[:, pl.ds(offset + col, bc)]

        if overlap:
            w = first_ref[b]
            cur = (w % 2) * m  # window w's half of the ring; window w-1 fills the other one
            kv_prev, gate_prev = slots(m - cur, 0)  # Ca of window w-1, absent for window -1
            parts = [(jnp.where(w > 0, kv_prev, jnp.zeros_like(kv_prev)), jnp.where(w > 0, gate_prev, -jnp.inf)),
                     slots(cur, dc)]  # Cb of window w
        else:
            parts = [slots(0, 0)]  # the ring is the window
        out_ref[...] = _gated_sum(parts).astype(dtype)


def _gated_sum(parts) -> Array:
    """sum_j softmax_j(gate_j) * kv_j over the slots of all parts ([(kv [rows, bc], float32
    gate [rows, bc]), ...]) -> float32 [bc]: the probabilities rounded to the kv dtype, the
    products in it, summed in float32 (`compressor._pool`'s numerics)."""
    top = functools.reduce(jnp.maximum, [jnp.max(gate, axis=0) for _, gate in parts])  # [bc]
    exps = [jnp.exp(gate - top[None]) for _, gate in parts]
    total = functools.reduce(jnp.add, [jnp.sum(e, axis=0) for e in exps])
    sums = [jnp.sum((kv * (e / total[None]).astype(kv.dtype)).astype(jnp.float32), axis=0)
            for (kv, _), e in zip(parts, exps)]
    return functools.reduce(jnp.add, sums)


def pool_one_token(ring: Array, first_entry: Array, completes: Array, position_bias: Array, *, ratio: int,
                   overlap: bool, interpret: bool = False, block_channels: int = BLOCK_CHANNELS,
                   num_warps: int = NUM_WARPS) -> Array:
    """The pooled (pre-norm) entry of each row's unfinished window after a decode step's write.

    ring [B, R, 2*n*Dc] (after the token's write); first_entry [B] int32 (the unfinished
    window's index, ``length // m``); completes [B] bool (rows whose token completes it: only
    their result is computed, zeros elsewhere); position_bias [m, n*Dc] float32.
    Returns [B, 1, Dc] in the ring's dtype: `compressor._pool` of `compressor._one_token`'s
    windows for the completing rows.
    """
    batch, _, slot_width = ring.shape
    n = 2 if overlap else 1
    dc = slot_width // (2 * n)
    bc = min(block_channels, dc)
    if dc % bc:
        raise ValueError(f"pool_one_token: the entry width {dc} must be a multiple of the channel block {bc}")
    kernel = functools.partial(_kernel, m=ratio, dc=dc, bc=bc, overlap=overlap)
    whole = pl.no_block_spec
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        extra["compiler_params"] = pl_triton.CompilerParams(num_warps=num_warps, num_stages=1)
    out = pl.pallas_call(
        kernel,
        grid=(batch, dc // bc),
        in_specs=[whole, whole, whole, whole],
        out_specs=pl.BlockSpec((None, bc), lambda b, c: (b, c)),
        out_shape=jax.ShapeDtypeStruct((batch, dc), ring.dtype),
        interpret=interpret,
        name="compressor_pool_kernel",
        **extra,
    )(first_entry.astype(jnp.int32), completes.astype(jnp.int32), ring, position_bias.astype(jnp.float32))
    return out[:, None, :]


def supports(ring: Array, ratio: int, overlap: bool, block_channels: int = BLOCK_CHANNELS) -> bool:
    """Whether the Triton kernel takes these shapes (powers of two: m, the channel block)."""
    n = 2 if overlap else 1
    dc = ring.shape[-1] // (2 * n)
    bc = min(block_channels, dc)

    def pow2(x):
        return x >= 1 and x & (x - 1) == 0

    return pow2(ratio) and pow2(bc) and dc % bc == 0 and ring.shape[1] == (2 if overlap else 1) * ratio
