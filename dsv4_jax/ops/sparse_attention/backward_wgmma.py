"""The backward pass of sparse attention over key ranges, as Mosaic GPU kernels (Hopper's wgmma).

`sparse_attention_backward` (Triton) reads each key by index and adds its gradient with atomics,
in dots of 32 heads x 16 keys: at V4-Flash's head_dim (D = 512) Triton cannot hold larger tiles,
and the kernel sits at ~5x its forward. Where a query's keys are one contiguous range of their
source, the backward can be the FlashAttention one instead, in the 64-row tiles of Hopper's
warp-group MMA, with no atomics:

* the window: `key_pool` lays the pool out in position order, so query t's window keys are
  pool[e_t - W + 1 .. e_t] (the valid part), and the decode pool's slots 0..min(t, W-1);
* HCA's entries: the visible prefix entries[0 .. visible).

CSA's picks are scattered: its calls stay with the Triton kernel, window included
(`sparse_attention._by_kernel`; the window here and the picks there measured 1-3% slower than the
Triton kernel alone, with up to 6.8 GB more memory for the window's float32 share of dq). A picks
backward on wgmma would gather keys into shared memory by per-row copies
(DEVELOPING.md, "Gathers and scattered adds"). Two kernels, each a CTA of two warp groups (WG), a
head tile of 64 heads (the wgmma's M), D split in two halves of D/2 (the float32 accumulators of
[64, D] would not fit one WG's registers):

    dq kernel, grid (H / 64, R): query row r, heads h0 .. h0+63
      q, do [64, D] and lse, delta [64] by TMA; per source, its key blocks of 64 meeting [lo, hi):
        k      [64, D]     by TMA (aligned block of the padded source)
        s, dp  [64, 64]    q k^T, do k^T                   (WG 0; float32)
        p      exp(round(s) * scale - lse), 0 outside [lo, hi)
        ds     p * (dp - delta) * scale -> SMEM (bf16)
        dq    += ds k[:, half]                              (each WG its half of D, float32)
      dq [64, D] written once (q's dtype)
    dkv kernel, grid (items,): one launch for every source (window pool, HCA's entries), a
    program a work item (`work_item`): key block kb of a source, run j of its reader rows
      k [64, D] by TMA; for each query row r of the j-th of `splits` runs of the rows whose
      range meets the block (`readers`; `splits_for`: an HCA entry block is read by every later
      row), for each head tile h0:
        q, do [64, D], lse, delta by TMA
        s^T, dp^T [64 keys, 64 heads]                       (WG 0)
        p^T, ds^T as above -> SMEM (bf16)
        dk    += ds^T q[:, half] + p^T do[:, half]          (each WG its half; K = V)
      dk [64, D] written once (float32 partial sums, added after and rounded once)

`delta` = sum(do * o) over D is computed before (an XLA pass; the Triton kernel folds it in), and
the sink's gradient after, as for the Triton kernel. The cotangent is read where the output
projection's gradient leaves it, [G, R, H/G, D] (`do_groups`): a tile's heads copied group by
group (`_copy_cotangent`), no transposed copy first. Every source is padded to whole blocks of
64 rows (TMA copies aligned tiles: Mosaic GPU needs their starts to be multiples of the
shared-memory tiling). The rows and the work items are the grids' last axes: Mosaic GPU launches
a grid's last axis as CUDA's x (up to 2^31 - 1 blocks) and the others as y and z (up to 65,535:
a batch of 4 rows of 16k with the rows first failed to launch on the H200).
Numerics as `sparse_attention_backward`'s in bf16: the logits rounded as the forward rounds
them, p and ds rounded to bf16 for their dots, float32 accumulation.

Status: correct in Mosaic GPU's interpret mode on the CPU (jax >= 0.12: older
interpret modes lack transposed wgmma operands), compiled for the H200 without one (jax 0.10.2 and
0.11.2, `bench/deviceless.py`), on the H200 equal to the Triton kernel at V4-Flash size (its GPU
tests, 4 x 16,400 query rows included) and the default for HCA's calls on CUDA
(``attention_backward="auto"``): a 4-layer HCA training step 6-14% faster than with the Triton
kernel at B = 1 and 4, 4k and 16k, with 0.4-2.9 GB less peak memory and 4-6 s more compile
(docs/breaks_and_kernels.md, "Why the kernels' defaults"). Each kernel configuration is one `jax.jit` (`_launch`),
so a program's equal calls (its layers) lower once. Each result goes out through shared memory
allocated after the accumulation's scope (`_write_halves`), so a float32 result needs no room of
its own. By default each TMA copy is waited for before its dots. At V4-Flash's D = 512 the shared
memory is nearly spent (dq: q, do and a key block, 64 KiB each, and ds: 200 KiB of the H200's 227
KiB; dkv: 208 KiB), so a second buffer needs smaller tiles: the dq kernel takes 32-key blocks in 2
buffers (`dq_of(keys=32, stages=2)`: the next block's copy in flight during this one's dots, every
wgmma operand then swizzled over 64 bytes), an A/B candidate (`DQ_KEYS, DQ_STAGES`) tested in
interpret mode and compiled, not measured; the dkv kernel would need head tiles of 32. Both
kernels once spilled registers (255 a thread, the wgmma descriptors of fixed buffers hoisted out of
the loops); the buffers are now indexed through `_opaque_zero` and neither spills (checked on a
deviceless compile, the H200 compile tests under tests/bench/).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax

from dsv4_jax.backend import Array

BLOCK = 64  # keys a block and heads a tile: the M of Hopper's wgmma
_JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])
# The dq kernel's key blocks and buffers: one buffer of 64 keys (each copy awaited before its
# dots) until the H200 says otherwise; (32, 2) overlaps the next block's copy with this one's dots
# in the same shared memory (A/B candidates, both tested).
DQ_KEYS, DQ_STAGES = 64, 1
ROWS_PER_SPLIT = 64  # reader rows a program of the key-gradient kernel takes (each over every head tile)
PARTIAL_BYTES = 1 << 26  # the key-gradient kernel's float32 partial sums, a source at most
SCALARS = 32  # int32 a row of the range tables: 128 bytes (jax 0.10's Mosaic GPU copies whole warp-group multiples)
ZERO = SCALARS - 1  # a range-table column that is always 0: `_opaque_zero`


def supports(q: Array, window_contiguous: bool, *, interpret: bool = False) -> bool:
    """Whether the kernels take this call here: its window (and HCA's entries) in bf16, heads a
    multiple of 64, D a multiple of 128, windows of consecutive pool indices (CSA's picks are
    scattered: they stay with the Triton kernel); and this jax runs them (`_jax_runs_them`)."""
    _, _, h, d = q.shape
    return (window_contiguous and q.dtype == jnp.bfloat16 and h % BLOCK == 0 and d % (2 * BLOCK) == 0
            and _jax_runs_them(interpret))


def _jax_runs_them(interpret: bool = False) -> bool:
    """Whether this jax has Mosaic GPU's Pallas API as these kernels use it (they compile with jax
    0.10.2 and 0.11.2), and for `interpret`, an interpret mode that runs them (transposed wgmma
    operands: jax >= 0.12)."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError:
        return False
    if not hasattr(plgpu, "broadcasted_iota"):
        return False
    return not interpret or _JAX_VERSION >= (0, 12)


def _tile(dtype=jnp.bfloat16, columns: int | None = None):
    """Shared-memory tiles of 8 rows of 128 bytes, swizzled: what wgmma operands and TMA copies
    want (`columns` fewer than 128 bytes: rows of those, swizzled over their width)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    per_row = 128 // jnp.dtype(dtype).itemsize
    columns = per_row if columns is None else min(columns, per_row)
    return (plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(columns * jnp.dtype(dtype).itemsize))


def _interpret_params(interpret: bool):
    if not interpret:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _load(ref, layout):
    """`plgpu.load` of a whole SMEM ref in `layout` (jax < 0.11.x asks for the index)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if "idx" in inspect.signature(plgpu.load).parameters:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _transposed(ref):
    """A shared-memory ref's transpose as a wgmma operand (`plgpu.transpose_ref` before jax 0.12,
    which deprecates it for the ref's own `transpose`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if _JAX_VERSION >= (0, 12):
        return ref.transpose((1, 0))
    return plgpu.transpose_ref(ref, (1, 0))


def _copies_by_group(group_heads: int) -> bool:
    """Whether the kernels can read the cotangent in the output groups' layout with H/G heads a
    group: whole 8-row tiles of the shared memory, a 64-head tile whole groups or within one."""
    return group_heads % 8 == 0 and (BLOCK % group_heads == 0 or group_heads % BLOCK == 0)


def _cotangent_pieces(group_heads: int | None) -> int:
    """TMA copies of a 64-head tile of the cotangent: 1 from [R, H, D], else one per output group
    it spans (`group_heads` H/G heads each, from [G, R, H/G, D])."""
    return 1 if group_heads is None else max(1, BLOCK // group_heads)


def _copy_cotangent(do_ref, r, ht, columns, dst, bar, group_heads: int | None):
    """Row r's heads ht * 64 .. + 63, `columns` of D, into dst [64, D/2]: from do [R, H, D], or
    group by group from the output groups' layout [G, R, H/G, D] (`group_heads` = H/G a multiple
    of 8 that divides 64 or that 64 divides: whole tiles of 8 rows of the shared memory)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if group_heads is None:
        plgpu.copy_gmem_to_smem(do_ref.at[r, pl.ds(pl.multiple_of(ht * BLOCK, BLOCK), BLOCK), columns], dst, bar)
        return
    piece = min(group_heads, BLOCK)
    for k in range(BLOCK // piece):
        head = ht * BLOCK + k * piece
        within = pl.ds(pl.multiple_of(lax.rem(head, group_heads), 8), piece)
        rows = dst.at[pl.ds(k * piece, piece)]
        plgpu.copy_gmem_to_smem(do_ref.at[lax.div(head, group_heads), r, within, columns], rows, bar)


def _opaque_zero(rng_smem):
    """0, read from the row's range table in shared memory, where the compiler cannot see it is.

    A wgmma instruction (K = 16) takes 64-bit descriptors of its operands' shared memory: 32 of
    them for a [64, 512] operand. Where a buffer's address is fixed, LLVM hoists its descriptors
    out of the loops, and the kernels ran out of registers (ptxas at 255 a thread, 700-820 bytes
    spilled by each kernel at V4-Flash size, jax 0.11.2). Indexing the buffers with this value
    after each wait keeps the descriptors in the loop body, made where they are used (no spills:
    dq 244 registers, dkv 250)."""
    return rng_smem[ZERO]


def _dots_over_halves(a_halves, b_halves, shape, transposed_b: bool, zero):
    """sum_j a_j b_j^T over the halves of D ([2, M, D/2] refs in SMEM) -> float32 [M, N]. `zero`:
    `_opaque_zero`, added to the halves' index."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def dots(acc_ref):
        for j in range(2):
            b = b_halves.at[j + zero]
            plgpu.wgmma(acc_ref, a_halves.at[j + zero], _transposed(b) if transposed_b else b)
        return acc_ref[...]

    return pl.run_scoped(dots, plgpu.ACC(shape, jnp.float32))


def _from_source(sources, which, copy):
    """`copy(src_ref)` for the source `which` (traced) of the kernel's `sources`: a branch a
    source, none where there is one."""
    from jax.experimental import pallas as pl

    if len(sources) == 1:
        copy(sources[0])
        return
    for j, src_ref in enumerate(sources):
        pl.when(which == j)(functools.partial(copy, src_ref))


def _write_halves(value, dst, dtype, wg, half: int):
    """Each warp group's [64, D/2] half of a result, through shared memory (allocated after the
    accumulation's scope: its memory, now free) to `dst` in GMEM as `dtype`."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def write(out_smem):
        out = out_smem.at[wg]
        out[...] = value.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out, dst)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(write, plgpu.SMEM((2, BLOCK, half), dtype, transforms=_tile(dtype)), collective_axes="wg")


def _copy_row(gmem, smem, r, ht, bar, wg, group_heads: int | None):
    """Row r's tile of heads ht * 64 .. + 63 into shared memory, copies issued by warp group 0 and
    awaited by both: `gmem` (ranges [R, SCALARS], q [R, H, D], do (`_copy_cotangent`), lse and
    delta [R, H]) into `smem` (the row's ranges, q and do as [2, 64, D/2] halves, lse, delta)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    ranges_ref, q_ref, do_ref, lse_ref, delta_ref = gmem
    rng_smem, q_smem, do_smem, lse_smem, delta_smem = smem
    half = q_smem.shape[-1]
    heads = pl.ds(pl.multiple_of(ht * BLOCK, BLOCK), BLOCK)

    @pl.when(wg == 0)
    def _():
        for j in range(2):
            plgpu.copy_gmem_to_smem(q_ref.at[r, heads, pl.ds(j * half, half)], q_smem.at[j], bar)
            _copy_cotangent(do_ref, r, ht, pl.ds(j * half, half), do_smem.at[j], bar, group_heads)
        plgpu.copy_gmem_to_smem(lse_ref.at[r, heads], lse_smem, bar)
        plgpu.copy_gmem_to_smem(delta_ref.at[r, heads], delta_smem, bar)
        plgpu.copy_gmem_to_smem(ranges_ref.at[r], rng_smem, bar)
    plgpu.barrier_wait(bar)


def _row_copies(group_heads: int | None) -> int:
    """The TMA copies `_copy_row` issues for a row tile (its barrier's arrivals): q's and do's
    halves (do by head pieces), lse, delta and the ranges."""
    return 2 + 2 * _cotangent_pieces(group_heads) + 3


def _probabilities(s, dp, lse_smem, delta_smem, kb, lo, hi, key_axis: int, scale: float, dtype, keys: int = BLOCK):
    """p and ds, rounded to `dtype` for their dots, of the logits s and their cotangent dp (float32,
    64 heads by `keys` keys of block kb along `key_axis`): p = exp(round(s) * scale - lse), 0 for
    keys outside [lo, hi); ds = p * (dp - delta) * scale."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    heads_axis = 1 - key_axis
    lse = _load(lse_smem, plgpu.Layout.WGMMA.reduce(key_axis))
    delta = _load(delta_smem, plgpu.Layout.WGMMA.reduce(key_axis))
    key = kb * keys + plgpu.broadcasted_iota(jnp.int32, s.shape, key_axis, layout=plgpu.Layout.WGMMA)
    s = (s.astype(dtype) * scale).astype(jnp.float32)  # the forward's rounding
    p = jnp.where((key >= lo) & (key < hi), jnp.exp(s - lax.broadcast_in_dim(lse, s.shape, [heads_axis])), 0.0)
    ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [heads_axis]))
    return p.astype(dtype), (ds * scale).astype(dtype)


def _dq_kernel(ranges_ref, q_ref, do_ref, lse_ref, delta_ref, *refs, n_sources: int, scale: float, dtype, d: int,
               group_heads: int | None, keys: int, stages: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    sources, dq_ref = refs[:n_sources], refs[n_sources]
    r, ht, wg = lax.axis_index("row"), lax.axis_index("heads"), lax.axis_index("wg")
    half = d // 2
    heads = pl.ds(pl.multiple_of(ht * BLOCK, BLOCK), BLOCK)

    def accumulate(q_smem, do_smem, k_smem, ds_smem, lse_smem, delta_smem, rng_smem, in_bar, k_bars, sync_bar):
        _copy_row((ranges_ref, q_ref, do_ref, lse_ref, delta_ref), (rng_smem, q_smem, do_smem, lse_smem, delta_smem),
                  r, ht, in_bar, wg, group_heads)
        # The row's key blocks, source after source, as one sequence i = 0 .. total - 1.
        bounds = []  # (first block, blocks, lo, hi) of each source
        for i in range(n_sources):
            lo, hi = rng_smem[2 * i], rng_smem[2 * i + 1]
            first = lax.div(lo, keys)
            bounds.append((first, jnp.where(hi > lo, lax.div(hi + keys - 1, keys) - first, 0), lo, hi))
        starts = [0]
        for _, n, _, _ in bounds:
            starts.append(starts[-1] + n)
        total = starts[-1]

        def block_of(i):  # (source, key block, lo, hi) of the sequence's block i
            which, kb, lo, hi = 0, bounds[0][0] + i, bounds[0][2], bounds[0][3]
            for j in range(1, n_sources):
                later = i >= starts[j]
                which = jnp.where(later, j, which)
                kb = jnp.where(later, bounds[j][0] + i - starts[j], kb)
                lo, hi = jnp.where(later, bounds[j][2], lo), jnp.where(later, bounds[j][3], hi)
            return which, kb, lo, hi

        def fetch(i, slot):  # warp group 0 copies block i into buffer `slot`
            which, kb, _, _ = block_of(i)
            rows = pl.ds(pl.multiple_of(kb * keys, keys), keys)

            def copy(src_ref):
                for h in range(2):
                    plgpu.copy_gmem_to_smem(src_ref.at[rows, pl.ds(h * half, half)], k_smem.at[slot, h],
                                            k_bars.at[slot])

            _from_source(sources, which, copy)

        if stages > 1:
            @pl.when((wg == 0) & (total > 0))
            def _():
                fetch(0, 0)

        def key_block(i, dq_acc):
            slot = lax.rem(i, stages)
            _, kb, lo, hi = block_of(i)

            @pl.when(wg == 0)
            def _():
                if stages > 1:  # the next block into the other buffer, free since the last rendezvous
                    @pl.when(i + 1 < total)
                    def _():
                        fetch(i + 1, lax.rem(i + 1, stages))
                else:
                    fetch(i, slot)
            plgpu.barrier_wait(k_bars.at[slot])
            zero = _opaque_zero(rng_smem)
            k = k_smem.at[slot + zero]

            @pl.when(wg == 0)  # the logits and their cotangent once; both warp groups use ds
            def _():
                s = _dots_over_halves(q_smem, k, (BLOCK, keys), transposed_b=True, zero=zero)  # [heads, keys]
                dp = _dots_over_halves(do_smem, k, (BLOCK, keys), transposed_b=True, zero=zero)
                _, ds = _probabilities(s, dp, lse_smem, delta_smem, kb, lo, hi, 1, scale, dtype, keys)
                ds_smem[...] = ds
                plgpu.commit_smem()
            plgpu.barrier_arrive(sync_bar)
            plgpu.barrier_wait(sync_bar)
            plgpu.wgmma(dq_acc, ds_smem, k.at[wg + zero])
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(sync_bar)  # both warp groups are done with this buffer and ds_smem
            plgpu.barrier_wait(sync_bar)

        def rows_loop(dq_acc):
            lax.fori_loop(0, total, lambda i, c: (key_block(i, dq_acc), c)[1], 0)
            return dq_acc[...]

        return pl.run_scoped(rows_loop, plgpu.ACC((BLOCK, half), jnp.float32))

    scratch = _dq_scratch(d, dtype, group_heads, keys, stages)
    dq = pl.run_scoped(accumulate, *scratch, collective_axes="wg")
    _write_halves(dq, dq_ref.at[r, heads, pl.ds(wg * half, half)], dq_ref.dtype, wg, half)


def _dkv_kernel(readers_ref, ranges_ref, q_ref, do_ref, lse_ref, delta_ref, *refs, blocks: tuple[int, ...],
                splits: tuple[int, ...], scale: float, dtype, d: int, head_tiles: int, group_heads: int | None):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    sources, dsrc_ref = refs[:len(blocks)], refs[len(blocks)]
    item, wg = lax.axis_index("item"), lax.axis_index("wg")
    half = d // 2
    source, kb, split, n_splits, readers_row = work_item(item, blocks, splits)
    keys = pl.ds(pl.multiple_of(kb * BLOCK, BLOCK), BLOCK)

    def accumulate(q_smem, do_smem, k_smem, ds_smem, p_smem, lse_smem, delta_smem, rng_smem, rd_smem, k_bar, in_bar,
                   sync_bar):
        @pl.when(wg == 0)
        def _():
            def copy(src_ref):
                for j in range(2):
                    plgpu.copy_gmem_to_smem(src_ref.at[keys, pl.ds(j * half, half)], k_smem.at[j], k_bar)

            _from_source(sources, source, copy)
            plgpu.copy_gmem_to_smem(readers_ref.at[readers_row], rd_smem, k_bar)
        plgpu.barrier_wait(k_bar)

        def query_row(i, dk_acc):  # i: row r, head tile ht
            r, ht = lax.div(i, head_tiles), lax.rem(i, head_tiles)

            _copy_row((ranges_ref, q_ref, do_ref, lse_ref, delta_ref),
                      (rng_smem, q_smem, do_smem, lse_smem, delta_smem), r, ht, in_bar, wg, group_heads)

            zero = _opaque_zero(rng_smem)

            @pl.when(wg == 0)
            def _():
                lo, hi = rng_smem[2 * source], rng_smem[2 * source + 1]
                st = _dots_over_halves(k_smem, q_smem, (BLOCK, BLOCK), transposed_b=True, zero=zero)  # [keys, heads]
                dpt = _dots_over_halves(k_smem, do_smem, (BLOCK, BLOCK), transposed_b=True, zero=zero)
                pt, dst = _probabilities(st, dpt, lse_smem, delta_smem, kb, lo, hi, 0, scale, dtype)
                ds_smem[...] = dst
                p_smem[...] = pt
                plgpu.commit_smem()
            plgpu.barrier_arrive(sync_bar)
            plgpu.barrier_wait(sync_bar)
            plgpu.wgmma(dk_acc, ds_smem, q_smem.at[wg + zero])
            plgpu.wgmma(dk_acc, p_smem, do_smem.at[wg + zero])
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(sync_bar)  # both warp groups are done with this row's tiles
            plgpu.barrier_wait(sync_bar)

        def loop(dk_acc):
            # This split's share of the block's reader rows [r0, r1): `splits` near-equal runs.
            r0, r1 = rd_smem[0], rd_smem[1]
            chunk = lax.div(r1 - r0 + n_splits - 1, n_splits)
            first = r0 + split * chunk
            last = jnp.maximum(jnp.minimum(r1, first + chunk), first)
            lax.fori_loop(first * head_tiles, last * head_tiles, lambda i, c: (query_row(i, dk_acc), c)[1], 0)
            return dk_acc[...]

        return pl.run_scoped(loop, plgpu.ACC((BLOCK, half), jnp.float32))

    dk = pl.run_scoped(accumulate, *_dkv_scratch(d, dtype, group_heads), collective_axes="wg")

    _write_halves(dk, dsrc_ref.at[item, :, pl.ds(wg * half, half)], jnp.float32, wg, half)


def readers(ranges: Array, source: int, n_blocks: int) -> Array:
    """[NB, SCALARS] int32: the query rows [r0, r1) whose range of `source` (columns 2 * source,
    2 * source + 1 of `ranges` [R, SCALARS]) meets key block kb; (0, 0) where none does. Rows in
    between that do not meet it are masked by their own ranges."""
    lo, hi = ranges[:, 2 * source], ranges[:, 2 * source + 1]
    rows = lo.shape[0]
    kb = jnp.arange(n_blocks, dtype=jnp.int32)[:, None]
    meets = (hi > lo)[None, :] & (lo[None, :] < (kb + 1) * BLOCK) & (hi[None, :] > kb * BLOCK)  # [NB, R]
    some = meets.any(axis=1)
    r0 = jnp.argmax(meets, axis=1).astype(jnp.int32)
    r1 = (rows - jnp.argmax(meets[:, ::-1], axis=1)).astype(jnp.int32)
    zero = jnp.zeros_like(r0)
    return jnp.stack([jnp.where(some, r0, 0), jnp.where(some, r1, 0)] + [zero] * (SCALARS - 2), axis=1)


def _dq_scratch(d: int, dtype, group_heads: int | None, keys: int, stages: int):
    """The dq kernel's shared memory: q, do as [2, 64, D/2] halves, `stages` key blocks [2, keys,
    D/2], ds [64, keys], lse, delta, the row's ranges; barriers for the row's copies, each key
    buffer's and the warp groups' rendezvous. One swizzle for every wgmma operand (Mosaic GPU's
    wgmma wants A's and B's alike): ds's rows of `keys` set it (32 keys: 64 bytes)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tile = _tile(dtype, keys)
    row_copies = _row_copies(group_heads)
    halves = [plgpu.SMEM((2, BLOCK, d // 2), dtype, transforms=tile) for _ in range(2)]  # q, do
    return [*halves, plgpu.SMEM((stages, 2, keys, d // 2), dtype, transforms=tile),
            plgpu.SMEM((BLOCK, keys), dtype, transforms=tile),
            plgpu.SMEM((BLOCK,), jnp.float32), plgpu.SMEM((BLOCK,), jnp.float32), plgpu.SMEM((SCALARS,), jnp.int32),
            plgpu.Barrier(num_arrivals=row_copies), plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2)]


def _dkv_scratch(d: int, dtype, group_heads: int | None):
    """The key-gradient kernel's shared memory: q, do and the key block as [2, 64, D/2] halves,
    ds and p [64, 64], lse, delta, the row's ranges, the block's readers; barriers for the block's
    copies, each row's and the warp groups' rendezvous."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tile = _tile()
    row_copies = _row_copies(group_heads)
    halves = [plgpu.SMEM((2, BLOCK, d // 2), dtype, transforms=tile) for _ in range(3)]  # q, do, keys
    squares = [plgpu.SMEM((BLOCK, BLOCK), dtype, transforms=tile) for _ in range(2)]  # ds, p
    small = [plgpu.SMEM((BLOCK,), jnp.float32), plgpu.SMEM((BLOCK,), jnp.float32), plgpu.SMEM((SCALARS,), jnp.int32),
             plgpu.SMEM((SCALARS,), jnp.int32)]
    # The key block's halves and its readers; a row's copies; the rendezvous.
    bars = [plgpu.Barrier(num_arrivals=3), plgpu.Barrier(num_arrivals=row_copies), plgpu.Barrier(num_arrivals=2)]
    return [*halves, *squares, *small, *bars]


def dq_of(q: Array, do: Array, lse: Array, delta: Array, sources: list[Array], ranges: Array, *,
          dq_dtype=None, keys: int = DQ_KEYS, stages: int = DQ_STAGES, interpret: bool = False) -> Array:
    """dq [R, H, D] of rows q [R, H, D] (bf16), their cotangent do (q's layout, or the output
    groups' [G, R, H/G, D]), lse, delta [R, H] float32 over `sources` (each [N, D], N a multiple
    of 64) read in the ranges [R, SCALARS] int32 (lo, hi of source 0, then of source 1; hi <= lo:
    none; column ZERO 0). `dq_dtype`: dq's dtype (default q's). `keys` a key block (64 or 32) and `stages` key
    buffers (2: the next block's copy overlaps this one's dots; at D = 512 only with 32 keys)."""
    rows, h, d = q.shape
    group_heads = do.shape[2] if do.ndim == 4 else None
    kernel = functools.partial(_dq_kernel, n_sources=len(sources), scale=d ** -0.5, dtype=q.dtype, d=d,
                               group_heads=group_heads, keys=keys, stages=stages)
    return _launch(kernel, ((rows, h, d), dq_dtype or q.dtype), (h // BLOCK, rows), ("heads", "row"),
                   "range_backward_dq", interpret)(ranges, q, do, lse, delta, *sources)


def _launch(kernel: functools.partial, out: tuple, grid: tuple, grid_names: tuple, name: str, interpret: bool):
    """The Mosaic GPU kernel `kernel` (a kernel body with its static arguments) of one output `out`
    (shape, dtype), two warp groups a program, as a function of its operands.

    Compiled, identical kernels are one jitted function: a model's layers call the same kernel
    with the same shapes, and jax lowers a jitted function's equal calls once (Mosaic GPU's
    lowering of one of these kernels takes about a second: a 4-layer training step lowered it
    four times). Interpret mode calls the kernel as it is (under a jit the simulated warp
    groups can hang on a small CPU pool: the callers run it eagerly)."""
    if interpret:
        return _kernel(kernel, out, grid, grid_names, name, _interpret_params(True))
    return _jitted_kernel(kernel.func, tuple(sorted(kernel.keywords.items())), out, grid, grid_names, name)


@functools.cache
def _jitted_kernel(body, keywords: tuple, out: tuple, grid: tuple, grid_names: tuple, name: str):
    return jax.jit(_kernel(functools.partial(body, **dict(keywords)), out, grid, grid_names, name, None))


def _kernel(kernel, out: tuple, grid: tuple, grid_names: tuple, name: str, interpret):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(*out), grid=grid, grid_names=grid_names, num_threads=2,
                        thread_name="wg", kernel_name=name, interpret=interpret)


def work_item(item, blocks: tuple[int, ...], splits: tuple[int, ...]):
    """The key-gradient kernel's program `item` (traced int32) as (source, key block kb, split j,
    the source's splits, kb's row in the sources' concatenated reader tables): programs run source
    after source, each source's split-major (a split's blocks launch side by side); `blocks` and
    `splits` a source (static)."""
    kb, split = lax.rem(item, blocks[0]), lax.div(item, blocks[0])
    source, n_splits, row = 0, splits[0], kb
    first, readers_base = 0, 0
    for i in range(1, len(blocks)):
        first, readers_base = first + blocks[i - 1] * splits[i - 1], readers_base + blocks[i - 1]
        later, local = item >= first, item - first
        source = jnp.where(later, i, source)
        kb = jnp.where(later, lax.rem(local, blocks[i]), kb)
        split = jnp.where(later, lax.div(local, blocks[i]), split)
        n_splits = jnp.where(later, splits[i], n_splits)
        row = jnp.where(later, readers_base + lax.rem(local, blocks[i]), row)
    return source, kb, split, n_splits, row


def dkv_of(q: Array, do: Array, lse: Array, delta: Array, sources: list[Array], ranges: Array, *,
           splits: list[int] | None = None, interpret: bool = False) -> list[Array]:
    """The gradients [N_i, D] float32 of `sources` (each [N_i, D], N_i a multiple of 64; K = V:
    through the logits and the values) from the rows whose range of that source (in `ranges`, as
    `dq_of`'s) covers its keys, in one launch: each key block's reader rows in `splits[i]` runs
    (default 1), a program each (float32 partial sums, added here), every head tile of a row summed
    in the program. do as `dq_of`'s."""
    _, h, d = q.shape
    splits = tuple(splits or [1] * len(sources))
    blocks = tuple(src.shape[0] // BLOCK for src in sources)
    items = sum(nb * sp for nb, sp in zip(blocks, splits))
    tables = jnp.concatenate([readers(ranges, i, nb) for i, nb in enumerate(blocks)])
    kernel = functools.partial(_dkv_kernel, blocks=blocks, splits=splits, scale=d ** -0.5, dtype=q.dtype, d=d,
                               head_tiles=h // BLOCK, group_heads=do.shape[2] if do.ndim == 4 else None)
    partials = _launch(kernel, ((items, BLOCK, d), jnp.float32), (items,), ("item",), "range_backward_dkv",
                       interpret)(tables, ranges, q, do, lse, delta, *sources)
    grads, first = [], 0
    for nb, sp in zip(blocks, splits):  # each source's partial sums, split-major
        grads.append(jnp.sum(partials[first: first + sp * nb].reshape(sp, nb * BLOCK, d), axis=0))
        first += sp * nb
    return grads


def splits_for(span: int, n: int, d: int) -> int:
    """Programs a key block of a source [N, D] gets when at most `span` rows read it: runs of about
    `ROWS_PER_SPLIT` rows (an HCA entry block is read by every later row of its batch row: one
    program would walk them all), as many as `PARTIAL_BYTES` of float32 partial sums allow."""
    return max(1, min(-(-span // ROWS_PER_SPLIT), PARTIAL_BYTES // (n * d * 4)))


def _padded_rows(x: Array) -> Array:
    """[B, N, D] -> [B * N', D], N' = N rounded up to a multiple of BLOCK (zero rows)."""
    b, n, d = x.shape
    pad = -n % BLOCK
    return jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(b * (n + pad), d)


def _window_ranges(window_idx: Array, padded: int) -> tuple[Array, Array]:
    """lo, hi [R] of each row's window in the flattened padded pool (batch row b at b * padded)."""
    b = window_idx.shape[0]
    valid = window_idx >= 0
    lo = jnp.min(jnp.where(valid, window_idx, jnp.iinfo(jnp.int32).max), axis=-1)
    hi = jnp.max(window_idx, axis=-1) + 1
    base = (jnp.arange(b, dtype=jnp.int32) * padded)[:, None]
    some = jnp.any(valid, axis=-1)
    return jnp.where(some, lo + base, 0).reshape(-1), jnp.where(some, hi + base, 0).reshape(-1)


def sparse_attention_backward_wgmma(q: Array, pool: Array, window_idx: Array, sinks: Array, o: Array, lse: Array,
                                    do: Array, *, entries: Array | None = None, visible: Array | None = None,
                                    interpret: bool = False, rotated: int = 0, delta_rotated: Array | None = None,
                                    do_groups: int | None = None, dq_dtype=None):
    """`sparse_attention_backward`'s contract (dq, dpool, dsinks, dentries) for the calls
    `takes` accepts: the window of each query consecutive pool indices (its valid ones), HCA's
    `visible` entries or none (CSA's picks stay with the Triton kernel). `dq_dtype`: dq's dtype
    (default q's). See the module doc for the kernels."""
    b, s, h, d = q.shape
    rows = b * s
    # delta reads o's channels that the caller's output rotation leaves as they are. Without the
    # barrier XLA reads them from the forward kernel's output before the rotation (equal there),
    # which then lives until this backward and makes the rotation work on a copy: an [R, H, D]
    # pass a layer and, at the peak, one more such buffer a layer (HCA B = 4 4k, 4 layers: XLA's
    # temporaries 20.1 against 17.6 GiB in a deviceless compile).
    o = lax.optimization_barrier(o)
    o_rows = o.reshape(rows, h, d).astype(jnp.float32)
    if do_groups is not None and _copies_by_group(h // do_groups):  # the kernels read [G, R, H/G, D]
        do = do.reshape(do_groups, rows, h // do_groups, d).astype(q.dtype)
        terms = do.astype(jnp.float32) * o_rows.reshape(rows, do_groups, h // do_groups, d).transpose(1, 0, 2, 3)
        terms = terms.transpose(1, 0, 2, 3).reshape(rows, h, d)  # fused into delta's sum: do stays put
    else:
        if do_groups is not None:  # [G, R, H/G, D] -> [R, H, D]
            do = do.transpose(1, 0, 2, 3)
        do = do.reshape(rows, h, d).astype(q.dtype)
        terms = do.astype(jnp.float32) * o_rows
    if rotated:  # o' = M o on the trailing channels: their share comes in as do' . o'
        delta = jnp.sum(terms[..., : d - rotated], axis=-1) + delta_rotated.reshape(rows, h).astype(jnp.float32)
    else:
        delta = jnp.sum(terms, axis=-1)
    lse_rows = lse.reshape(rows, h).astype(jnp.float32)
    q_rows = q.reshape(rows, h, d)

    pool_flat = _padded_rows(pool)
    lo_w, hi_w = _window_ranges(window_idx, pool_flat.shape[0] // b)
    columns = [lo_w, hi_w]
    sources = [pool_flat]
    if entries is not None:
        ents_flat = _padded_rows(entries)
        padded = ents_flat.shape[0] // b
        base = jnp.repeat(jnp.arange(b, dtype=jnp.int32) * padded, s)
        seen = jnp.clip(visible.reshape(rows).astype(jnp.int32), 0, entries.shape[1])
        columns += [base, base + seen]
        sources.append(ents_flat)
    columns += [jnp.zeros_like(lo_w)] * (SCALARS - len(columns))
    ranges = jnp.stack(columns, axis=1).astype(jnp.int32)  # [R, SCALARS]

    # The most rows that read one key block: a window's block, its 64 keys' and W - 1 more rows of
    # its batch row; an entry block, every row of its batch row.
    spans = [min(s, BLOCK + window_idx.shape[-1] - 1), s]
    dq = dq_of(q_rows, do, lse_rows, delta, sources, ranges, dq_dtype=dq_dtype, interpret=interpret)
    if interpret:  # one kernel at a time: the interpret mode's simulated GPU state is global
        q_rows, _ = lax.optimization_barrier((q_rows, dq))
    grads = dkv_of(q_rows, do, lse_rows, delta, sources, ranges, interpret=interpret,
                   splits=[splits_for(span, *src.shape) for span, src in zip(spans, sources)])
    dpool = grads[0].reshape(b, -1, d)[:, : pool.shape[1]].astype(pool.dtype)
    dentries = None
    if entries is not None:
        dentries = grads[1].reshape(b, -1, d)[:, : entries.shape[1]].astype(entries.dtype)
    p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :] - lse_rows)  # [R, H]
    dsinks = -jnp.sum(p_sink * delta, axis=0)
    return dq.reshape(b, s, h, d), dpool, dsinks, dentries
