"""The indexer's selection by the native handlers (csrc/, `dsv4_jax.native`): scoring + top-k
as an XLA FFI custom call, the eager break or a graph-compatible target; the XLA reference is
`reference.select_topk`, the Pallas scoring kernel `pallas.index_scores`. The one place that
decides how a paged cache's keys reach the selection (`select_native`: through the page table;
the reference and the host breaks read `PagedRows.view`, through `quantized.read`)."""

from __future__ import annotations

import jax

from dsv4_jax import native, numerics
from dsv4_jax.backend import QUERY_BLOCK, map_query_blocks
from dsv4_jax.cache.paged import PagedRows
from dsv4_jax.cache.quantized import QuantizedRows, read
from dsv4_jax.ops.indexer import pallas as indexer_kernel
from dsv4_jax.ops.indexer import pallas_fp8 as indexer_kernel_fp8
from dsv4_jax.ops.indexer import reference as indexer
from dsv4_jax.ops.kernel_plan import KernelPlan

NATIVE_SCORES = KernelPlan(select="native", select_scores="native")  # the handler's own scoring


def select_native(queries, weights, keys, visible, *, top_k, with_scores=False, block=QUERY_BLOCK,
                  graph: bool, kernels: KernelPlan = NATIVE_SCORES) -> indexer.Selection:
    """The native selection, blocked over queries like `indexer.select_topk` (bounds the
    [B, block, T] scores of long prefills); the eager break unless `graph`. `kernels`: the step's
    plan (resolved for the platform): its ``select_segments`` as the handler's, and its
    ``select_scores`` for the scores (`KernelPlan.scores_for`): where that is the Pallas kernel
    the handler's top-k picks from the kernel's scores. An FP8 cache's keys (`QuantizedRows`), by
    `KernelPlan.select_keys`: the handler's scoring reads their stored form
    (`native.select_topk_fp4`) unless "dequantized"; the Pallas kernel reads it
    (`indexer_kernel.index_scores_fp4`) where "stored", else a dequantized copy ("auto": with
    the stored form a CSA 64k prefill took 1.5x the time on the H200, each query block decoding
    the keys again). A paged cache's keys (`paged.PagedRows`): the handler and the kernel read
    each key in its page of the pool through the page table (`native.Pages`), no copy of a
    row's keys (a "dequantized" copy is of the pool). ``select_keys="fp8"``: as "stored", and
    where the Pallas kernel scores the stored form and takes them (`indexer_kernel_fp8.supports`)
    with e4m3 x e4m3 dots (`indexer_kernel_fp8.index_scores_fp8`; query rows off the FP4 grid
    by the bf16 dot inside the kernel): the same scores."""
    paged = isinstance(keys, PagedRows)
    held = keys.pool if paged else keys  # the keys as the cache stores them: an array or QuantizedRows
    pages = native.Pages(keys.table, keys.page_entries, keys.slots) if paged else None

    def rows(a):  # a pool's pages as key rows [N, .] (the handlers' and the kernel's paged operand)
        return a.reshape(-1, a.shape[-1]) if paged else a

    scoring = kernels.scores_for(queries, keys)
    segments, select_keys = kernels.select_segments, kernels.select_keys
    fp4 = isinstance(held, QuantizedRows) and held.grid == "fp4" and held.block == numerics.FP4_BLOCK
    stored = fp4 and (select_keys != "dequantized" if scoring == "native" else select_keys in ("stored", "fp8"))
    if scoring == "native" and stored:

        def select_fp4_block(q, w, vis, codes, key_scales):
            picks, scores = native.select_topk_fp4(q, w, codes, key_scales, vis, top_k=top_k, graph=graph,
                                                   segments=segments, pages=pages)
            # No `scores_with_gradient`: nothing differentiates through an FP8 cache (its writes refuse).
            return indexer.Selection(picks, scores if with_scores else None)

        return map_query_blocks(select_fp4_block, (queries, weights, visible), (rows(held.values), rows(held.scales)),
                                block)

    if stored:  # the Pallas kernel over the stored form, its dots in the cache's dtype or in FP8
        on_fp8 = select_keys == "fp8" and indexer_kernel_fp8.supports(queries, held)
        score = indexer_kernel_fp8.index_scores_fp8 if on_fp8 else indexer_kernel.index_scores_fp4

        def score_fp4_block(q, w, vis, codes, key_scales):
            scores = score(*jax.lax.stop_gradient((q, w)), codes, key_scales, vis, dtype=held.dtype,
                           interpret=scoring == "interpret", pages=pages)
            picks = native.topk(scores, vis, top_k=top_k, graph=graph, segments=segments)
            return indexer.Selection(picks, scores if with_scores else None)

        return map_query_blocks(score_fp4_block, (queries, weights, visible), (rows(held.values), rows(held.scales)),
                                block)

    dense = read(held)  # dequantized where FP8 (a paged cache's: the pool)
    whole = keys.replace(pool=dense) if paged else dense  # what the scores' gradient reads

    def select_block(q, w, vis, k):
        if scoring == "native":
            picks, scores = native.select_topk(q, w, k, vis, top_k=top_k, graph=graph, segments=segments,
                                               pages=pages)
        else:  # the Pallas kernel's scores, the handler's top-k over them
            scores = indexer_kernel.index_scores(*jax.lax.stop_gradient((q, w, k)), vis,
                                                 interpret=scoring == "interpret", pages=pages)
            picks = native.topk(scores, vis, top_k=top_k, graph=graph, segments=segments)
        if with_scores and graph:  # break_mode="none": differentiable like the XLA scores (indexer_kl_loss)
            scores = scores_with_gradient(scores, q, w, whole, vis)
        return indexer.Selection(picks, scores if with_scores else None)

    return map_query_blocks(select_block, (queries, weights, visible), (rows(dense),), block)


@jax.custom_jvp
def scores_with_gradient(scores, queries, weights, keys, visible):
    """The native handler's scores, differentiated as `indexer.index_scores` (same formula, XLA);
    keys [B, T, c], or `PagedRows` over a pool of them (read through `PagedRows.view` only
    where differentiated)."""
    return scores


@scores_with_gradient.defjvp
def scores_with_gradient_jvp(primals, tangents):
    scores, queries, weights, keys, visible = primals
    _, dq, dw, dk, _ = tangents
    if isinstance(keys, PagedRows):
        paged = keys

        def scores_of(q, w, pool):
            return indexer.index_scores(q, w, paged.replace(pool=pool).view(), visible, block=q.shape[-3])

        keys, dk = paged.pool, dk.pool
    else:
        def scores_of(q, w, k):
            return indexer.index_scores(q, w, k, visible, block=q.shape[-3])

    _, ds = jax.jvp(scores_of, (queries, weights, keys), (dq, dw, dk))
    return scores, ds
