"""Sparse attention as one Pallas kernel: each query's keys gathered inside it.

The XLA path (`sparse_attention._xla_path`) gathers every query's keys into [B, s, W + K, D]
arrays (a copy of 640 keys per query in CSA), then runs the logits, the softmax with the sink
and the weighted sum as separate fusions over those copies. Here one `pallas_call` (Triton
backend on the GPU; `interpret=True` runs the same kernel on any backend, which is how the
CPU tests run it) reads each key straight from its source by index and keeps an online
softmax (flash decoding), for decode and prefill alike: every query is a row of its own,
R = B * S rows, and row r reads the sources of batch row r // S. A paged cache's entries are
one source shared by every row, the pool flattened to [1, P*E, D], read at each entry's pool row
(`paged_source`): the same loads, no copy of a row's entries into [B, T, D] first.

    grid (R, H / bh, splits); program (r, h, j) owns heads h*bh .. h*bh+bh-1 of query row r
    and the key blocks j, j + splits, ... of its window (from the pool) and then of its entries
    q      [bh, D]        this program's queries
    k      [bk, D]        one block of keys, `src[r // S, idx]` (a gather inside the kernel)
    s      [bh, bk]       float32 logits, -inf where idx = -1
    acc    [bh, D]        float32 sum of exp(s - m) k over the program's keys
    m, total [bh]         running max and sum of exp(s - m)

With one split (prefill: R alone fills the GPU) the program merges the sink itself and writes
the output in the compute dtype; with several (decode at small B) it writes its float32
partials, merged with the sink after it by XLA (`combine`) or by one more kernel that also
undoes the output's RoPE (`split_merge_kernel`, the plan's ``split_merge``). K = V (each key
is its own value), as everywhere in this layer.

Numerics follow the XLA path: the logits are rounded to the compute dtype before the scale
(the reference's order), probabilities go to the compute dtype for the weighted sum, which
accumulates in float32. The difference: the XLA path normalises the probabilities before that
cast, the kernel after the sum (flash decoding), so bf16 results differ in the last bits;
float32 agrees within 2e-5 (`tests/ops/test_sparse_attention_kernel.py`).

No attention masses (they keep the XLA path). `sparse_attention` chooses this kernel as the
step's `KernelPlan` says: by default on CUDA where it measured faster (`default_blocks`), the XLA
path as the reference and for every other backend. Its gradient (`sparse_attention._by_kernel`):
`sparse_attention_backward`'s kernel, or the XLA path's VJP.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsv4_jax.backend import Array
from dsv4_jax.cache.paged import PagedRows
from dsv4_jax.ops.rope import derotate_output
from dsv4_jax.ops.sparse_attention import split_merge_pallas as split_merge_kernel

# Keys per block and heads per program (Triton's dot needs every dimension >= 16 and a power
# of two); `splits` spreads a row's key blocks over programs when R * H / bh alone would leave
# most of the GPU's 132 SMs idle.
BLOCK_KEYS = 32
BLOCK_HEADS = 32
TARGET_PROGRAMS = 132
NUM_WARPS = 8
NUM_STAGES = 1  # Triton's software pipelining of the key-block loop (its gathered loads)

# Where the kernel is the CUDA default, and with which (block_keys, block_heads, num_warps,
# num_stages[, skip_masked_blocks]), keyed by (layer kind, phase, batch), batch None for every
# batch: the cases it measured faster than the XLA path on the H200 (V4-Flash, bf16; the
# measurements: docs/breaks_and_kernels.md, "Why the kernels' defaults"). Sliding layers (window
# only) were not measured: the XLA path.
CUDA_DEFAULT_BLOCKS = {
    ("csa", "decode", 1): (16, 32, 8, 1), ("hca", "decode", 1): (32, 16, 8, 1),
    ("hca", "decode", None): (64, 64, 8, 2, True), ("csa", "decode", None): (64, 64, 8, 2),
    ("csa", "prefill", None): (64, 64, 8, 3, True), ("hca", "prefill", None): (64, 64, 8, 3, True),
}
PREFILL_MIN_ROWS = 256
# Table entries that apply only from this many compressed entries in the cache (entries [B, T, D]'s T).
MIN_ENTRIES = {("hca", "decode", None): 1024}
# Table entries that apply only from this many rows (B * S).
MIN_ROWS = {("csa", "decode", None): 16}
# Table entries for 2-byte compute dtypes only: in float32 their blocks (64 keys x 64 heads of
# 512) need more shared memory than the H200's 227 KiB (decode (64, 64, 8, 2): 273 KiB requested).
TWO_BYTE_ONLY = {("csa", "prefill", None), ("hca", "prefill", None), ("hca", "decode", None),
                 ("csa", "decode", None)}

# The blocks a forced kernel (a `KernelPlan` stage "pallas" or "interpret" without blocks of its
# own) uses where the table has none; float32 prefill: blocks whose shared memory fits (96 KiB
# in bf16, ~192 in float32).
FORCED_BLOCKS = {"decode": (BLOCK_KEYS, BLOCK_HEADS, NUM_WARPS, NUM_STAGES), "prefill": (64, 64, 8, 3),
                 "prefill_float32": (32, 32, 8, 1)}


# Queries a row up to which a call is a decode step for the kernel: a decode token, or the few
# of a speculative step (MTP drafts, their verification: at most 8 a row).
DECODE_MAX_QUERIES = 8


def phase_of(q: Array) -> str:
    """"decode" for calls of at most `DECODE_MAX_QUERIES` queries a row (q [B, S, H, D]), else
    "prefill". The kernel is the same for both (every query a row of its own); the phase picks
    the plan's choice (``decode_attention``), blocks and table: a decode step's key blocks split
    over programs where its few rows alone would leave the GPU idle (`default_splits`), merged
    after (`combine` or the split merge kernel). A call of several queries a row takes the
    decode table's blocks measured at one query a row."""
    return "decode" if q.shape[1] <= DECODE_MAX_QUERIES else "prefill"


def default_blocks(kind: str, batch: int, phase: str = "decode", queries: int = 1,
                   dtype=jnp.bfloat16, entries: int = 0) -> dict | None:
    """The kernel's blocks where it is the CUDA default for this layer kind ("csa", "hca",
    "sliding"), phase ("decode", "prefill"), batch, queries per row, compute dtype and number of
    compressed entries the cache holds (T of entries [B, T, D]; 0 without), else None (the XLA
    path)."""
    if phase == "prefill" and batch * queries < PREFILL_MIN_ROWS:
        return None
    key = (kind, phase, batch) if (kind, phase, batch) in CUDA_DEFAULT_BLOCKS else (kind, phase, None)
    chosen = CUDA_DEFAULT_BLOCKS.get(key)
    if chosen is None or entries < MIN_ENTRIES.get(key, 0) or batch * queries < MIN_ROWS.get(key, 0):
        return None
    if key in TWO_BYTE_ONLY and jnp.dtype(dtype).itemsize > 2:
        return None
    return as_blocks(chosen)


def forced_blocks(phase: str, dtype=jnp.bfloat16) -> dict:
    """The blocks of a forced kernel for this phase and compute dtype."""
    wide = phase == "prefill" and jnp.dtype(dtype).itemsize > 2
    return as_blocks(FORCED_BLOCKS["prefill_float32" if wide else phase])


def fit_to_window(blocks: dict, window_keys: int) -> dict:
    """`blocks` with half as many keys a block (32 at the least) where the window
    (`window_keys` slots a query) would take a single key block: Triton then gives that block
    buffers of its own beside the pipelined entry blocks, and 64 heads of 512 with 64-key blocks
    asked for 262,656 bytes of shared memory in 3 stages, 262,400 in 2 with masked blocks
    skipped (a deviceless compile for the H200, which has 232,448), where V4's 128-key
    window (two blocks) takes 193 KiB. For the table's and the forced blocks; a plan's own
    blocks are taken as given."""
    keys = blocks["block_keys"]
    if keys > 32 and -(-window_keys // keys) <= 1:
        return {**blocks, "block_keys": max(32, keys // 2)}
    return blocks


def as_blocks(chosen) -> dict:
    """(block_keys, block_heads, num_warps, num_stages[, skip_masked_blocks]) -> the kernel's keywords."""
    names = ("block_keys", "block_heads", "num_warps", "num_stages", "skip_masked_blocks")
    blocks = dict(zip(names, chosen))
    if "skip_masked_blocks" in blocks:
        blocks["skip_masked_blocks"] = bool(blocks["skip_masked_blocks"])
    return blocks


def supports(q: Array, block_heads: int = BLOCK_HEADS, block_keys: int = BLOCK_KEYS, **_) -> bool:
    """Whether the Triton kernel takes these shapes: q [B, S, H, D] with H a multiple of the
    head block, D a power of two, every dot dimension >= 16."""
    h, d = q.shape[2:]
    bh = min(block_heads, h)

    def pow2(n):
        return n >= 16 and n & (n - 1) == 0

    return h % bh == 0 and pow2(bh) and pow2(d) and pow2(block_keys)


def _pad_indices(idx: Array, block: int) -> Array:
    """[R, L] int32 -> [R, ceil(L / block) * block], padded with -1 (no key)."""
    pad = -idx.shape[1] % block
    return jnp.pad(idx, ((0, 0), (0, pad)), constant_values=-1) if pad else idx


def _kernel(*refs, scale: float, block_keys: int, splits: int, rows_per_source: int, n_window: int,
            n_entries: int, dtype, finish: bool, skip_masked_blocks: bool, with_lse: bool = False,
            shared_entries: bool = False):
    refs = list(refs)
    widx_ref = refs.pop(0)
    eidx_ref = refs.pop(0) if n_entries else None
    eblocks_ref = refs.pop(0) if n_entries and skip_masked_blocks else None
    q_ref, pool_ref = refs.pop(0), refs.pop(0)
    ents_ref = refs.pop(0) if n_entries else None
    sink_ref = refs.pop(0) if finish else None
    out_refs = refs
    r, j = pl.program_id(0), pl.program_id(2)
    src = r // rows_per_source
    q = q_ref[...]  # [bh, D]
    exact = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None  # no TF32 for float32

    def key_block(src_ref, row, idx_ref, blk, carry):
        acc, m, total = carry
        idx = idx_ref[r, pl.ds(blk * block_keys, block_keys)]  # [bk]
        k = src_ref[row, jnp.maximum(idx, 0), :].astype(dtype)  # [bk, D], gathered by index
        dots = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=exact,
                                   preferred_element_type=jnp.float32)
        s = (dots.astype(dtype) * scale).astype(jnp.float32)  # the reference's rounding order
        s = jnp.where((idx >= 0)[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key yet: keep exp() finite
        alpha = jnp.exp(m - shift)
        p = jnp.exp(s - shift[:, None])
        acc = acc * alpha[:, None] + jax.lax.dot_general(
            p.astype(dtype), k, (((1,), (0,)), ((), ())), precision=exact, preferred_element_type=jnp.float32)
        return acc, m_new, total * alpha + jnp.sum(p, axis=1)

    def loop(src_ref, row, idx_ref, n_blocks, carry):
        # One split (prefill) and a static n_blocks: a static trip count, which Triton's
        # pipeliner handles best.
        count = n_blocks if splits == 1 else jnp.maximum(0, (n_blocks - j + splits - 1) // splits)
        return jax.lax.fori_loop(0, count, lambda i, c: key_block(src_ref, row, idx_ref, j + i * splits, c), carry)

    bh, d = q.shape
    carry = (jnp.zeros((bh, d), jnp.float32), jnp.full((bh,), -jnp.inf, jnp.float32), jnp.zeros((bh,), jnp.float32))
    carry = loop(pool_ref, src, widx_ref, n_window, carry)
    if n_entries:
        # skip_masked_blocks: only up to the row's last entry block with a key (a prompt's early
        # queries see few entries; their picks past those are -1). Paged entries: one pool, row 0.
        carry = loop(ents_ref, 0 if shared_entries else src, eidx_ref,
                     eblocks_ref[r] if skip_masked_blocks else n_entries, carry)
    if finish:  # one split: merge the sink here, as `combine` does for one split
        acc, m, total = carry
        sink = sink_ref[...]
        top = jnp.maximum(m, sink)
        w = jnp.exp(m - top)
        den = total * w + jnp.exp(sink - top)
        out_refs[0][...] = ((acc * w[:, None]) / den[:, None]).astype(out_refs[0].dtype)
        if with_lse:  # the softmax's log-normaliser (sink included), for the backward kernel
            out_refs[1][...] = top + jnp.log(den)
    else:
        out_refs[0][...], out_refs[1][...], out_refs[2][...] = carry


def _call(q, pool, window_idx, entries, entry_idx, sinks, *, rows_per_source, block_keys, block_heads,
          num_warps, num_stages, splits, interpret, skip_masked_blocks=False, with_lse=False,
          shared_entries=False):
    """The pallas_call over R query rows; row r reads the sources' row r // rows_per_source.

    q [R, H, D]; pool [R / rows_per_source, P, D] with window_idx [R, W] (-1 = no key);
    entries [R / rows_per_source, T, D] with entry_idx [R, K] (-1 = no key), or both None;
    `shared_entries`: entries [1, N, D] read by every row (a paged cache's pool, `paged_source`).
    sinks None: per split, the un-normalised output and its softmax statistics, acc
    [R, splits, H, D], m [R, splits, H] (-inf: the split saw no key) and total [R, splits, H]
    (the sum of exp(s - m)), all float32, for `combine`. sinks [H] (one split only): the
    finished output [R, H, D] in q's dtype, the sink merged in the kernel; `with_lse`: also
    the log-normaliser [R, H] float32 (what the backward kernel needs).
    """
    r, h, d = q.shape
    bh = min(block_heads, h)
    widx = _pad_indices(window_idx.astype(jnp.int32), block_keys)
    n_window = widx.shape[1] // block_keys
    eidx = None if entries is None else _pad_indices(entry_idx.astype(jnp.int32), block_keys)
    n_entries = 0 if eidx is None else eidx.shape[1] // block_keys
    finish = sinks is not None
    kernel = functools.partial(_kernel, scale=d ** -0.5, block_keys=block_keys, splits=splits,
                               rows_per_source=rows_per_source, n_window=n_window, n_entries=n_entries,
                               dtype=q.dtype, finish=finish, skip_masked_blocks=skip_masked_blocks,
                               with_lse=with_lse, shared_entries=shared_entries)
    whole = pl.no_block_spec
    index_args = [widx] + ([eidx] if n_entries else [])
    if n_entries and skip_masked_blocks:  # [R] int32: entry blocks up to the row's last key
        last = jnp.max(jnp.where(eidx >= 0, jnp.arange(1, eidx.shape[1] + 1, dtype=jnp.int32), 0), axis=1)
        index_args.append((last + block_keys - 1) // block_keys)
    in_specs = [whole] * len(index_args) + [
        pl.BlockSpec((None, bh, d), lambda i, g, s: (i, g, 0)), whole] + ([whole] if n_entries else [])
    args = index_args + [q, pool] + ([entries] if n_entries else [])
    if finish:
        in_specs.append(pl.BlockSpec((bh,), lambda i, g, s: (g,)))
        args.append(sinks.astype(jnp.float32))
        out_specs = pl.BlockSpec((None, bh, d), lambda i, g, s: (i, g, 0))
        out_shape = jax.ShapeDtypeStruct((r, h, d), q.dtype)
        if with_lse:
            out_specs = [out_specs, pl.BlockSpec((None, bh), lambda i, g, s: (i, g))]
            out_shape = [out_shape, jax.ShapeDtypeStruct((r, h), jnp.float32)]
    else:
        out_specs = [pl.BlockSpec((None, None, bh, d), lambda i, g, s: (i, s, g, 0)),
                     pl.BlockSpec((None, None, bh), lambda i, g, s: (i, s, g)),
                     pl.BlockSpec((None, None, bh), lambda i, g, s: (i, s, g))]
        out_shape = [jax.ShapeDtypeStruct((r, splits, h, d), jnp.float32),
                     jax.ShapeDtypeStruct((r, splits, h), jnp.float32),
                     jax.ShapeDtypeStruct((r, splits, h), jnp.float32)]
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        extra["compiler_params"] = pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        kernel,
        grid=(r, h // bh, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name="sparse_attention_kernel",
        **extra,
    )(*args)


def default_splits(q: Array, window_idx: Array, entry_idx: Array | None, block_keys: int, block_heads: int) -> int:
    """Enough splits of the key blocks to give the GPU ~TARGET_PROGRAMS programs (1 when the
    rows and head blocks already do)."""
    r, h, _ = q.shape
    n_keys = max(window_idx.shape[1], 0 if entry_idx is None else entry_idx.shape[1])
    return max(1, min(-(-n_keys // block_keys), TARGET_PROGRAMS // (r * (h // min(block_heads, h)))))


def entry_indices(rows: int, entries: Array | None, picks: Array | None, visible: Array | None) -> Array | None:
    """The entries each query row reads, [rows, K] int32 (-1 = none): CSA's picks, HCA's visible
    slots ``w < visible`` (in slot order: a prefix, then -1), None without entries."""
    if entries is None:
        return None
    if picks is not None:
        return picks.reshape(rows, -1)
    w = jnp.arange(entries.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where(w < visible.reshape(rows, 1), w, -1)


def paged_source(entries: PagedRows, entry_idx: Array, batch: int) -> tuple[Array, Array]:
    """A paged cache's entries as the kernel's source: (the pool flattened to [1, P*E, D], every
    row's source; entry_idx [R, K] (entry slots of batch row r // (R / batch), -1 = none) as pool
    rows ``table[b, t // E] * E + t % E``, -1 kept). A slot on a page the row does not hold is
    no key (-1): only a row stepping past its pages reads one, and its output is NaN by contract
    (`paged.row_limit`); a contiguous cache's row holds zeros there."""
    pool = entries.pool
    n = pool.shape[0] * pool.shape[1]
    rows, k = entry_idx.shape
    flat = entries.physical(entry_idx.reshape(batch, (rows // batch) * k)).reshape(rows, k)
    return pool.reshape(1, n, *pool.shape[2:]), jnp.where(flat < n, flat, -1)


def sparse_attention_kernel(q: Array, pool: Array, window_idx: Array, sinks: Array, *,
                            entries: Array | None = None, picks: Array | None = None,
                            visible: Array | None = None, interpret: bool = False,
                            block_keys: int = BLOCK_KEYS, block_heads: int = BLOCK_HEADS,
                            num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                            splits: int | None = None, skip_masked_blocks: bool = False,
                            with_lse: bool = False, rotation: tuple | None = None, merge: str = "xla"):
    """`sparse_attention` by the kernel (no attention masses): the same arguments.

    q [B, S, H, D], pool [B, W+S, D], window_idx [B, S, W], sinks [H]; entries [B, T, D] (or
    `PagedRows` standing for them, a pool of the compute dtype: read in place, `paged_source`)
    with picks [B, S, K] (CSA) or visible [B, S] (HCA: entries w < visible), or neither (sliding).
    Returns o [B, S, H, D] in q's dtype; `with_lse`: (o, lse [B, S, H] float32), lse the
    softmax's log-normaliser over the keys and the sink (`sparse_attention_backward`'s input).

    skip_masked_blocks: loop over each row's entry blocks only up to its last key (-1 picks /
    invisible HCA entries after it are skipped instead of computed and masked); the loop's trip
    count becomes per row. Same result; the CUDA table turns it on for prefill and for HCA's
    batch decode (`CUDA_DEFAULT_BLOCKS`' fifth value).

    rotation: None, or (positions [B, S] int, freqs float32 [half] (NumPy), scale): o is returned
    de-rotated at each query's position (the layer's inverse RoPE, `rope.apply_rope(...,
    inverse=True)` on the trailing 2 * half channels). merge: how several splits are merged with
    the sink (and that rotation): "xla" (`combine`, then the rotation in place), "pallas" or
    "interpret" (`split_merge_kernel`: one kernel; without `with_lse` only).
    """
    b, s, h, d = q.shape
    entry_idx = entry_indices(b * s, entries, picks, visible)
    shared = isinstance(entries, PagedRows)
    if shared:
        entries, entry_idx = paged_source(entries, entry_idx, b)
    rows = q.reshape(b * s, h, d)
    widx = window_idx.reshape(b * s, -1)
    if splits is None:
        splits = default_splits(rows, widx, entry_idx, block_keys, block_heads)
    blocks = dict(rows_per_source=s, block_keys=block_keys, block_heads=block_heads, num_warps=num_warps,
                  num_stages=num_stages, splits=splits, interpret=interpret, skip_masked_blocks=skip_masked_blocks,
                  shared_entries=shared)
    if splits == 1:
        o = _call(rows, pool, widx, entries, entry_idx, sinks, **blocks, with_lse=with_lse)
    elif merge != "xla" and not with_lse and split_merge_kernel.supports(q, rotation):
        partials = _call(rows, pool, widx, entries, entry_idx, None, **blocks)
        merge_rotation = None if rotation is None else (rotation[0].reshape(b * s), *rotation[1:])
        o = split_merge_kernel.merge_splits(*partials, sinks, q.dtype, merge_rotation,
                                            interpret=interpret or merge == "interpret")
        return o.reshape(b, s, h, d)  # de-rotated by the kernel
    else:
        partials = _call(rows, pool, widx, entries, entry_idx, None, **blocks)
        o = split_merge_kernel.combine(*partials, sinks, q.dtype, with_lse)
    lse = o[1].reshape(b, s, h) if with_lse else None
    o = (o[0] if with_lse else o).reshape(b, s, h, d)
    if rotation is not None:
        positions, freqs, scale = rotation
        o = derotate_output(o, positions, freqs, scale)
    return (o, lse) if with_lse else o
