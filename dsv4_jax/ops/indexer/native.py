"""The indexer's selection by the native handlers (csrc/, `dsv4_jax.native`): scoring + top-k
as an XLA FFI custom call, the eager break or a graph-compatible target; the XLA reference is
`reference.select_topk`, the Pallas scoring kernel `pallas.index_scores`."""

from __future__ import annotations

import jax

from dsv4_jax import native, numerics
from dsv4_jax.backend import QUERY_BLOCK, map_query_blocks
from dsv4_jax.cache.quantized import QuantizedRows, read
from dsv4_jax.ops.indexer import pallas as indexer_kernel
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
    the keys again)."""
    dense = read(keys)
    scoring = kernels.scores_for(queries, dense)
    segments, select_keys = kernels.select_segments, kernels.select_keys
    fp4 = isinstance(keys, QuantizedRows) and keys.grid == "fp4" and keys.block == numerics.FP4_BLOCK
    stored = fp4 and (select_keys != "dequantized" if scoring == "native" else select_keys == "stored")
    if scoring == "native" and stored:

        def select_fp4_block(q, w, vis, codes, key_scales):
            picks, scores = native.select_topk_fp4(q, w, codes, key_scales, vis, top_k=top_k, graph=graph,
                                                   segments=segments)
            # No `scores_with_gradient`: nothing differentiates through an FP8 cache (its writes refuse).
            return indexer.Selection(picks, scores if with_scores else None)

        return map_query_blocks(select_fp4_block, (queries, weights, visible), (keys.values, keys.scales), block)

    if stored:  # the Pallas kernel over the stored form

        def score_fp4_block(q, w, vis, codes, key_scales):
            scores = indexer_kernel.index_scores_fp4(*jax.lax.stop_gradient((q, w)), codes, key_scales, vis,
                                                     dtype=dense.dtype, interpret=scoring == "interpret")
            picks = native.topk(scores, vis, top_k=top_k, graph=graph, segments=segments)
            return indexer.Selection(picks, scores if with_scores else None)

        return map_query_blocks(score_fp4_block, (queries, weights, visible), (keys.values, keys.scales), block)

    def select_block(q, w, vis, k):
        if scoring == "native":
            picks, scores = native.select_topk(q, w, k, vis, top_k=top_k, graph=graph, segments=segments)
        else:  # the Pallas kernel's scores, the handler's top-k over them
            scores = indexer_kernel.index_scores(*jax.lax.stop_gradient((q, w, k)), vis,
                                                 interpret=scoring == "interpret")
            picks = native.topk(scores, vis, top_k=top_k, graph=graph, segments=segments)
        if with_scores and graph:  # break_mode="none": differentiable like the XLA scores (indexer_kl_loss)
            scores = scores_with_gradient(scores, q, w, k, vis)
        return indexer.Selection(picks, scores if with_scores else None)

    return map_query_blocks(select_block, (queries, weights, visible), (dense,), block)


@jax.custom_jvp
def scores_with_gradient(scores, queries, weights, keys, visible):
    """The native handler's scores, differentiated as `indexer.index_scores` (same formula, XLA)."""
    return scores


@scores_with_gradient.defjvp
def scores_with_gradient_jvp(primals, tangents):
    scores, queries, weights, keys, visible = primals
    _, dq, dw, dk, _ = tangents
    _, ds = jax.jvp(lambda q, w, k: indexer.index_scores(q, w, k, visible, block=q.shape[-3]),
                    (queries, weights, keys), (dq, dw, dk))
    return scores, ds
