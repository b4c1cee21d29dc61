"""The layer's step as a pure function: its pytrees, its static `StepSpec`, its stages, and the
one registry of its compiled versions (on one device and on a mesh).

One call runs the stages of vLLM's `attention_impl`, in order (names as in vLLM):

1. input GEMMs: ``wq_a`` + q_norm -> q_residual; ``wkv`` + kv_norm; the compressors'
   kv/gate projections; the indexer's weights_proj            (always in-graph)
2. ``wq_b_kv_insert``: ``wq_b``, per-head q norm, RoPE on q and kv, window-cache insert
3. ``compressor``: gated pooling of completed windows into compressed entries (CSA/HCA)
4. ``indexer``: its own key compressor, queries, scores, top-k (CSA)
5. sparse attention: window keys + picked (CSA) / visible (HCA) entries + sink, then the
   output's inverse RoPE at the query position (vLLM: the first step of the output)
6. output: grouped ``wo_a``, then ``wo_b``

Stages 2-4 are `run_stages`, written once for XLA and NumPy; the step's `StepPlan` (from
`break_mode`, `break_on` and `kernels`, see `breaks`) decides which of them run in a break and
where. Stages 1, 5 and 6 are always in-graph.

The layer (`dsv4_jax.layer.module.DeepseekV4Attention`) holds the parameters and makes the
`StepSpec`; its eager call (`dsv4_jax.layer.call`) checks the inputs and runs a compiled step
from `step_function`.

Shapes: B batch, S new tokens, H heads, D head_dim, W window, T entry slots, K index_topk.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dsv4_jax import numerics
from dsv4_jax.backend import QUERY_BLOCK, Array, einsum
from dsv4_jax.cache import paged
from dsv4_jax.cache.contiguous import (
    AttentionCache,
    CompressorCache,
    advance_length,
    advance_rewindable,
    insert_ring,
    next_positions,
    overflows,
    real_tokens,
)
from dsv4_jax.cache.history import keep_evicted
from dsv4_jax.cache.quantized import check_cache_numerics, read, read_attended, read_picked
from dsv4_jax.config import CSA, HCA, SLIDING, DeepseekV4Config
from dsv4_jax.ops.compress.reference import CompressorWeights, compress, visible_entries
from dsv4_jax.ops.indexer.reference import IndexerWeights, head_weights, index_queries
from dsv4_jax.ops.norms import rms_norm
from dsv4_jax.ops.projection.pallas import projection
from dsv4_jax.ops.query_norm.pallas import query_norm
from dsv4_jax.ops.rope import LayerRotations, layer_rotations, rotate_by, rotation_tables
from dsv4_jax.ops.sparse_attention.reference import OutputRotation, key_pool, sparse_attention
from dsv4_jax.step import breaks, finite_flag, sharding
from dsv4_jax.step import overlap as overlap_mod
from dsv4_jax.step.plan import StepPlan


# ---------------------------------------------------------------------------- pytrees
@struct.dataclass
class AttentionWeights:
    """The layer's parameters as plain arrays (JAX [in, out] layout; what the step consumes).

    q_a_proj [hidden, Lq], q_a_norm [Lq], q_b_proj [Lq, H*D], kv_proj [hidden, D],
    kv_norm [D], o_a_proj [G, H*D/G, R], o_b_proj [G*R, hidden], sinks [H];
    compressor (CSA/HCA) and indexer (CSA) or None.

    input_proj [hidden, N] is derived, not a parameter: the input projections' weights side by
    side (`fuse_input_projections`; the layer's `step_weights()` adds it), or None. With it the
    step runs one GEMM for them all; without it, one per projection (same values).
    """

    q_a_proj: Array
    q_a_norm: Array
    q_b_proj: Array
    kv_proj: Array
    kv_norm: Array
    o_a_proj: Array
    o_b_proj: Array
    sinks: Array
    compressor: CompressorWeights | None = None
    indexer: IndexerWeights | None = None
    input_proj: Array | None = None


DERIVED_WEIGHTS = ("input_proj",)  # AttentionWeights fields that are no parameter of the layer


def input_projection_weights(weights: AttentionWeights) -> list:
    """The input projections' [hidden, n] weights in `input_proj`'s column order: q_a, kv, then
    the compressor's kv and gate, then the indexer's compressor kv and gate and weights_proj."""
    parts = [weights.q_a_proj, weights.kv_proj]
    if weights.compressor is not None:
        parts += [weights.compressor.kv_proj, weights.compressor.gate_proj]
    if weights.indexer is not None:
        parts += [weights.indexer.compressor.kv_proj, weights.indexer.compressor.gate_proj,
                  weights.indexer.weights_proj]
    return parts


def fuse_input_projections(weights: AttentionWeights) -> AttentionWeights:
    """`weights` with `input_proj` set: the input projections' weights concatenated once.

    Why: the projections share their input, and XLA:GPU merges such GEMMs into one over the
    concatenation of their weights; with the weights as step inputs that concatenation (~34 MB
    for a V4-Flash CSA layer) ran on every step, 22 us a layer on the H200
    (docs/breaks_and_kernels.md, "Why the kernels' defaults"). Made here once (the layer's `step_weights()`
    keeps it while its parameters stay the same arrays), the step gets the merged GEMM without the
    copy. Costs one more copy of those weights in memory. Under a trace (`nnx.grad`) it is part of
    the program, as XLA's merge was; gradients reach the separate parameters through it.
    """
    parts = input_projection_weights(weights)
    if any(p is None for p in parts) or not isinstance(parts[0], jax.Array | jax.core.Tracer):
        return weights.replace(input_proj=None)
    dtype = jnp.result_type(*parts)
    return weights.replace(input_proj=jnp.concatenate([p.astype(dtype) for p in parts], axis=1))


@struct.dataclass
class StageInputs:
    """What the in-graph input GEMMs hand to stages 2-4 (one call's tokens)."""

    q_residual: Array  # [B, S, Lq]   q_norm(x wq_a), also the indexer's query input
    kv: Array  # [B, S, D]           kv_norm(x wkv), not rotated yet
    compressor_kv: Array | None = None  # [B, S, n*D]
    compressor_gate: Array | None = None
    indexer_kv: Array | None = None  # [B, S, 2c]
    indexer_gate: Array | None = None
    indexer_head_proj: Array | None = None  # [B, S, nI] x weights_proj (its scale: `head_weights`)


@struct.dataclass
class StageOutputs:
    q: Array  # [B, S, H, D] rotated queries
    kv: Array  # [B, S, D]    rotated keys (= values) of this call
    window: Array  # [B, W, D] window cache after the insert
    compressor: CompressorCache | None = None
    indexer: CompressorCache | None = None
    picks: Array | None = None  # [B, S, K] int32, -1 = nothing (CSA)
    index_scores: Array | None = None  # [B, S, T] float32 (CSA, only when intermediates are asked)
    window_history: Array | None = None  # [B, K, D] the window ring's rewind history (max_rewind > 0)


@struct.dataclass
class Intermediates:
    """What `attn(..., return_intermediates=True)` also returns (None where a layer type lacks it).

    index_scores    [B, S, T] float32  indexer scores over the entry slots, -inf where not visible (CSA)
    topk            [B, S, K] int32    the indexer's picks, -1 = nothing (CSA)
    compressed_kv   [B, T, D]          compressed entries after this call (CSA/HCA); rows
                                       ``>= num_entries`` are empty slots
    num_entries     [B] int32          entries that exist after this call
    visible_entries [B, S] int32       entries each query may see, ``(t + 1) // m`` (CSA/HCA)
    queries         [B, S, H, D]       rotated, normed attention queries
    keys            [B, S, D]          rotated K=V of this call's tokens (with the window cache
                                       before the call, every query's window keys)
    sink_mass       [B, S, H] float32  share of each query's attention on the sink
    window_mass     [B, S, H] float32  ... on its window keys
    compressed_mass [B, S, H] float32  ... on compressed entries (0 on sliding layers)
    """

    queries: Array
    keys: Array
    sink_mass: Array
    window_mass: Array
    compressed_mass: Array
    index_scores: Array | None = None
    topk: Array | None = None
    compressed_kv: Array | None = None
    num_entries: Array | None = None
    visible_entries: Array | None = None


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything static about a compiled step (hashable: a `jax.jit` static argument)."""

    cfg: DeepseekV4Config
    layer_type: str
    plan: StepPlan
    dtype: Any  # compute dtype (jnp.dtype)
    precision: Any = None
    query_block: int = QUERY_BLOCK
    return_intermediates: bool = False
    checks: bool = False  # in-graph `checkify.check`s of positions and room (see `check_in_graph`)
    numerics: str = "reference"  # or "official": the official inference's roundings (`numerics`)
    finite_flag: bool = False  # the eager call's finite check inside the step (`finite_flag.flagged`)

    # `jax.jit` hashes its static arguments on every dispatch: the dataclass hash (over the whole
    # config) is computed once per spec and kept beside the fields (equal specs hash equal: the
    # same function of the same fields). Not pickled: string hashes differ between processes.
    def __hash__(self) -> int:
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", value)
            return value

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def ratio(self) -> int:
        return self.cfg.compress_rate(self.layer_type)

    @property
    def rope_kind(self) -> str:
        return self.cfg.rope_kind(self.layer_type)



# ---------------------------------------------------------------------------- stages 2-4
def straight_through(rounding, x):
    """``rounding(x)`` (an official numerics round trip, `dsv4_jax.numerics`) whose gradient is
    the straight-through estimator of quantization-aware training: the cotangent passes the
    rounding unchanged (differentiating the round trip itself would cast the cotangent onto
    the FP8/FP4 grid and treat the scales as constants). NumPy inputs (the wide break's host
    twin) are rounded as they are."""
    if isinstance(x, np.ndarray):
        return rounding(x)

    @jax.custom_vjp
    def rounded(x):
        return rounding(x)

    rounded.defvjp(lambda x: (rounding(x), None), lambda _, cotangent: (cotangent,))
    return rounded(x)


def official_roundings(spec: StepSpec) -> tuple:
    """(the main attention's KV rounding, the indexer's rounding): functions of an array with
    straight-through gradients under ``numerics="official"``, None under "reference"."""
    if spec.numerics != "official":
        return None, None
    round_kv = functools.partial(numerics.round_kv_official, rope_dim=spec.cfg.qk_rope_head_dim)
    return (functools.partial(straight_through, round_kv),
            functools.partial(straight_through, numerics.round_indexer_official))


def wq_b_kv_insert(q_residual, kv, window, positions, length, q_b_proj, spec: StepSpec, rope: tuple,
                   round_kv=None, frozen=None, count=None):
    """Stage 2: queries [B, S, H, D] and rotated keys [B, S, D]; the window cache after the insert
    (rows in `frozen` unchanged; of a ragged call only each row's `count` real tokens are
    inserted). Padded slots (position -1) get queries and keys too (fixed shapes), which
    nothing reads. `rope`: the layer's (freqs, scale) (`LayerRotations.attention`); `round_kv`:
    the official numerics' KV rounding or None (`official_roundings`)."""
    cfg, dtype = spec.cfg, spec.dtype
    freqs, scale = rope
    q = einsum("bsl,lk->bsk", q_residual, q_b_proj, out_dtype=dtype, precision=spec.precision)
    q = q.reshape(*q.shape[:2], cfg.num_attention_heads, cfg.head_dim)
    # The call's rotation, once: cos and sin [B, S, rd/2] at its positions, for its keys and queries.
    turn = rotation_tables(positions, freqs, scale, q.dtype)
    kv = rotate_by(kv, turn)
    # The per-head norm and RoPE: one kernel each way where the plan says (`head_norm_kernel`).
    q = query_norm(q, cfg.rms_norm_eps, spec.plan.kernels.query_norm_for(q), rotation=turn)
    if round_kv is not None:  # FP8 grid on the non-RoPE channels, before the window insert
        kv = round_kv(kv)
    return q, kv, insert_ring(window, kv, length, frozen, count)


def run_stages(inputs: StageInputs, cache: AttentionCache, positions, weights: AttentionWeights,
               spec: StepSpec, rotations: LayerRotations, select) -> StageOutputs:
    """Stages 2-4 (`wq_b_kv_insert`, `compressor`, `indexer`); XLA or NumPy (see `breaks`).

    What the step hands down: `rotations` (`rope.layer_rotations`: the layer's rope for the
    queries and keys, the compressed one for the compressors' entries and the indexer's
    queries) and `select`, the indexer's selection (`StepPlan.indexer_select`: in-graph, the
    narrow host break or the native handler; the NumPy one where the wide break runs this
    whole function on the host).
    """
    cfg = spec.cfg
    length = cache.length
    # Ragged calls: row b has count[b] real tokens, then padded slots (position -1) that write
    # nothing (scatter indices dropped) and that the indexer scores against no entry (visible 0).
    count = real_tokens(positions)
    # A row that would run past max_seq_len (possible only under a user's jit) writes nothing.
    frozen = overflows(length, count, paged.row_limit(cache))
    compress_freqs, compress_scale = rotations.compressed
    common = dict(ratio=spec.ratio, freqs=compress_freqs, rope_scale=compress_scale, eps=cfg.rms_norm_eps,
                  frozen=frozen, count=count, kernel=spec.plan.kernels.compress_for())
    round_kv, round_indexer = official_roundings(spec)

    # The named scopes label the step's XLA operations by stage (profiles: bench/kernel_profile.py).
    with jax.named_scope("wq_b_kv_insert"):
        q, kv, window = wq_b_kv_insert(inputs.q_residual, inputs.kv, cache.window, positions, length,
                                       weights.q_b_proj, spec, rotations.attention, round_kv, frozen, count)
    # With a rewind history (`max_rewind` > 0), the window tokens this insert evicts.
    window_history = keep_evicted(cache.window_history, cache.window, kv, length, frozen, count)
    out = StageOutputs(q=q, kv=kv, window=window, window_history=window_history)
    if spec.layer_type == SLIDING:
        return out

    cw = weights.compressor
    with jax.named_scope("compressor"):
        comp_state = compress(inputs.compressor_kv, inputs.compressor_gate, cache.compressor, length,
                              position_bias=cw.position_bias, kv_norm=cw.kv_norm,
                              overlap=spec.layer_type == CSA, **common,
                              round_entries=round_kv)
    out = out.replace(compressor=comp_state)
    if spec.layer_type == HCA:
        return out

    iw = weights.indexer
    with jax.named_scope("indexer_compressor"):
        index_state = compress(inputs.indexer_kv, inputs.indexer_gate, cache.indexer, length,
                               position_bias=iw.compressor.position_bias, kv_norm=iw.compressor.kv_norm,
                               overlap=True, **common,
                               round_entries=round_indexer)
    # The indexer's input is detached, as in DeepSeek-V3.2: its own loss (`indexer_kl_loss`)
    # trains the indexer only (its picks pass no gradient back to q_residual anyway).
    q_in = inputs.q_residual
    if not isinstance(q_in, np.ndarray):  # the wide break's host twin runs on NumPy arrays
        # XLA's dot merger joins GEMMs of one input: the indexer's query projection would become
        # part of wq_b's (one [Lq, H*D + nI*c] product) and the scoring and top-k would wait for
        # all of it. Kept apart they run beside wq_b in the concurrent graph (`overlap`); apart
        # with the overlap off too, so that both settings run the same products, bit for bit.
        q_in = jax.lax.optimization_barrier(jax.lax.stop_gradient(q_in))
    with jax.named_scope("indexer_queries"):
        head_weight = head_weights(inputs.indexer_head_proj, cfg.index_n_heads)  # [B, S, nI] float32
        queries = index_queries(q_in, iw.q_b_proj, positions, compress_freqs,
                                n_heads=cfg.index_n_heads, rope_scale=compress_scale, dtype=spec.dtype,
                                precision=spec.precision)
        if round_indexer is not None:  # Hadamard + FP4, as the keys: the rotation keeps q.k, the rounding does not
            queries = round_indexer(queries)
    visible = visible_entries(positions, spec.ratio)
    with jax.named_scope("indexer_select"):
        # The keys as the cache stores them (FP8, paged): the native selection reads them there
        # itself, the other selections through `quantized.read` (`indexer_native.select_native`).
        selected = select(queries, head_weight, index_state.entries, visible,
                          top_k=cfg.index_topk, with_scores=spec.return_intermediates, block=spec.query_block)
    return out.replace(indexer=index_state, picks=selected.picks, index_scores=selected.scores)


def input_projections(x: Array, weights: AttentionWeights, cfg: DeepseekV4Config, dtype, prec,
                      kernel: str = "xla") -> StageInputs:
    """Stage 1: x [B, S, hidden] -> `StageInputs` (q_residual, kv; the compressors' kv and gate
    and the indexer's weights_proj product where the layer has them).

    One GEMM over `weights.input_proj` where it is set (then split by the projections'
    widths), else one GEMM per projection: the same products. `kernel`: the plan's
    ``projections`` (`projection_kernel.projection`), for the fused GEMM only: separate
    projections stay XLA's, which merges them into one GEMM (a kernel each would be 4-7 launches
    of a few programs each)."""
    if weights.input_proj is None:
        outs = [einsum("bsh,hn->bsn", x, w, out_dtype=dtype, precision=prec) for w in input_projection_weights(weights)]
    else:
        fused = projection("bsh,hn->bsn", x, weights.input_proj, out_dtype=dtype, precision=prec, kernel=kernel)
        edges = np.cumsum([w.shape[1] for w in input_projection_weights(weights)])[:-1]
        outs = jnp.split(fused, edges, axis=-1)
    q_residual = rms_norm(outs[0], weights.q_a_norm, cfg.rms_norm_eps)
    kv = rms_norm(outs[1], weights.kv_norm, cfg.rms_norm_eps)
    inputs = StageInputs(q_residual=q_residual, kv=kv)
    if weights.compressor is not None:
        inputs = inputs.replace(compressor_kv=outs[2], compressor_gate=outs[3])
    if weights.indexer is not None:
        inputs = inputs.replace(indexer_kv=outs[4], indexer_gate=outs[5], indexer_head_proj=outs[6])
    return inputs


def stage_weights(weights: AttentionWeights) -> AttentionWeights:
    """Only the parameters stages 2-4 read (what the wide break has to copy to the host).

    The input projections of stage 1 and the output projections of stage 6 stay behind:
    at V4-Flash sizes that is a third of the layer's weight bytes instead of all of them.
    """
    def compressor(w: CompressorWeights | None):
        return None if w is None else w.replace(kv_proj=None, gate_proj=None)

    return weights.replace(
        q_a_proj=None, q_a_norm=None, kv_proj=None, kv_norm=None, o_a_proj=None, o_b_proj=None, sinks=None,
        input_proj=None,
        compressor=compressor(weights.compressor),
        indexer=None if weights.indexer is None else weights.indexer.replace(
            weights_proj=None, compressor=compressor(weights.indexer.compressor)),
    )


# ---------------------------------------------------------------------------- the step
def attention_step(weights: AttentionWeights, cache: AttentionCache, hidden_states, positions,
                   spec: StepSpec):
    """One call of the layer as a pure function: (out [B, S, hidden], new cache, intermediates).

    Pure and jittable; `DeepseekV4Attention.__call__` validates the inputs, then runs this
    under `jax.jit` with `spec` static. `positions`: int [B, S] (see the module call), or None
    for every row's next S positions from its cache length (`cache.next_positions`): a decode
    loop's step then takes no positions argument, so the compiled step gets no new buffer for
    them each call.

    Nothing here can refuse a call, so two rules hold for values the eager checks would refuse:
    a row whose call would run past ``cache.max_seq_len`` leaves its cache unchanged (length
    included) and gets a NaN output (`cache.overflows`); positions that do not continue the
    cache are not detected, unless ``spec.checks`` (then run the step under
    `jax.experimental.checkify.checkify`; see `check_in_graph`).
    """
    cfg, dtype, prec = spec.cfg, spec.dtype, spec.precision
    check_cache_numerics(cache, spec.numerics)
    flag = None
    x = hidden_states.astype(dtype)
    if spec.finite_flag:  # the eager call polls the verdict (after the cast: an overflow counts)
        x, flag = finite_flag.flagged(x)
    length = jnp.asarray(cache.length, jnp.int32)
    positions = next_positions(length, x.shape[1]) if positions is None else positions.astype(jnp.int32)
    cache = paged.bind(cache.replace(length=length))  # a paged cache's entries read through its pages
    if spec.checks:
        check_in_graph(length, positions, cache.max_seq_len)

    # 1. Input GEMMs (vLLM: the parallel input projections and the fused q/kv norm).
    with jax.named_scope("input_projections"):
        inputs = input_projections(x, weights, cfg, dtype, prec, spec.plan.kernels.projections_for())

    # What the later stages are handed, once a step: the rotations (queries, keys, compressed
    # entries, the indexer's queries, the attention output) and the plan's indexer selection.
    rotations = layer_rotations(cfg, spec.rope_kind)
    select = spec.plan.indexer_select()

    # 2-4. wq_b_kv_insert, compressor, indexer: in-graph, or (partly) in the host break.
    if spec.plan.mode == "wide":
        stage_fn = functools.partial(run_stages, spec=spec, rotations=rotations, select=select)
        stages = breaks.wide_host_call(stage_fn, inputs, cache, positions, stage_weights(weights))
    else:
        stages = run_stages(inputs, cache, positions, weights, spec, rotations, select)

    # 5. Sparse attention over [window | picked or visible entries] with the sink.
    # An FP8 cache's rows are read dequantized (the values a bf16 cache holds, `quantized_cache`);
    # a CSA step dequantizes only its picks where they are fewer than the cache's rows. Paged
    # entries stay in their pool: the attention reads them by index through the page table.
    entries, picks = None, stages.picks
    if stages.compressor is not None:
        entries, picks = (read_picked(stages.compressor.entries, picks) if picks is not None
                          else (read_attended(stages.compressor.entries), None))
    visible = visible_entries(positions, spec.ratio) if spec.layer_type != SLIDING else None
    with jax.named_scope("sparse_attention"):
        pool, window_idx, in_place = key_pool(read(cache.window), read(stages.window), stages.kv, positions, length,
                                              cfg.sliding_window)
        # The output's inverse RoPE (stage 6's first step) is part of the attention, so that
        # its gradient keeps the de-rotated output as the residual (no copy of the output).
        attended = sparse_attention(
            stages.q, pool, window_idx, weights.sinks, window_in_place=in_place,
            entries=entries, picks=picks, visible=visible if spec.layer_type == HCA else None,
            block=spec.query_block, precision=prec, with_mass=spec.return_intermediates,
            rotation=OutputRotation(positions, *rotations.attention), output_groups=spec.cfg.o_groups,
            window_contiguous=True, kernels=spec.plan.kernels,
        )

    # 6. Grouped low-rank output projection (of the output de-rotated above).
    with jax.named_scope("output_projection"):
        out = output_projection(attended.o, weights, spec)
    count = real_tokens(positions)  # [B] real tokens per row (a ragged call pads with -1)
    real = positions >= 0  # [B, S]
    overflow = overflows(length, count, paged.row_limit(cache))  # [B]; such rows were written nothing
    # Padded slots output zeros: they see no key, so their attention output is 0 already; the
    # select makes it the contract rather than a consequence (e.g. of a finite padded input).
    # An overflowing row's real slots output NaN.
    out = jnp.where(real[..., None], out, jnp.zeros((), out.dtype))
    out = jnp.where(overflow[:, None, None] & real[..., None], jnp.asarray(jnp.nan, out.dtype), out)
    if flag is not None:
        out = finite_flag.joined(out, flag)

    new_length = jnp.where(overflow, length, advance_length(length, count))
    new_cache = paged.unbind(cache.replace(
        length=new_length, window=stages.window, window_history=stages.window_history,
        compressor=stages.compressor, indexer=stages.indexer,
        rewindable=advance_rewindable(_on_device(cache.rewindable), count, overflow, cache.max_rewind)))
    intermediates = None
    if spec.return_intermediates:
        def padded_zero(a):  # padded slots' queries, keys and masses are 0 (nothing was attended)
            return jnp.where(real.reshape(*real.shape, *([1] * (a.ndim - 2))), a, jnp.zeros((), a.dtype))

        intermediates = Intermediates(
            queries=padded_zero(stages.q), keys=padded_zero(stages.kv), sink_mass=padded_zero(attended.sink_mass),
            window_mass=padded_zero(attended.window_mass), compressed_mass=padded_zero(attended.compressed_mass),
            index_scores=stages.index_scores, topk=stages.picks, compressed_kv=read(stages.compressor.entries)
            if stages.compressor is not None else None,
            num_entries=None if entries is None else new_length // spec.ratio,
            visible_entries=visible,
        )
    return out, new_cache, intermediates


def _on_device(mirror):
    """A host mirror (a NumPy [B] int32 the step may be handed) as a JAX array; None stays None."""
    return None if mirror is None else jnp.asarray(mirror, jnp.int32)


def check_in_graph(length, positions, max_seq_len: int) -> None:
    """The eager value checks as `checkify.check`s, for steps traced under a user's jit.

    Present only when ``StepSpec.checks`` (``DeepseekV4Attention(checkify=True)`` under a
    user's jit); such a step must run under `jax.experimental.checkify.checkify`. The rules
    and messages are `validation.check_positions`'s: positions >= -1; per row its real tokens
    first, then padded slots (-1); at least one real token in the call; real tokens continue
    the row's cache (``positions``); room left per row (``hidden_states``).
    """
    from jax.experimental import checkify

    batch, seq = positions.shape
    col = jnp.arange(seq, dtype=jnp.int32)[None, :]
    low = jnp.any(positions < -1, axis=1)
    row = jnp.argmax(low)
    checkify.check(~jnp.any(low), "positions: expected values >= 0, or -1 for padded slots, got row {row} = "
                   "[{first} .. {last}]", row=row, first=positions[row, 0], last=positions[row, -1])
    real = positions >= 0
    count = real.sum(axis=1).astype(jnp.int32)
    mixed = jnp.any(real != (col < count[:, None]), axis=1)
    row = jnp.argmax(mixed)
    checkify.check(~jnp.any(mixed), "positions: expected row {row}'s real tokens first, then its padded slots "
                   "(-1), got [{first} .. {last}]", row=row, first=positions[row, 0], last=positions[row, -1])
    checkify.check(jnp.any(count > 0), "positions: expected at least one real token (>= 0) in the call, got only "
                   f"padded slots (-1) in all {batch} rows")
    expected = length[:, None] + col
    wrong = jnp.any(real & (positions != expected), axis=1)  # [B]
    row = jnp.argmax(wrong)
    checkify.check(~jnp.any(wrong),
                   "positions: expected row {row} to continue the cache at {start} ({start} .. {end}), "
                   "got [{first} .. {last}]",
                   row=row, start=length[row], end=length[row] + count[row] - 1,
                   first=positions[row, 0], last=positions[row, -1])
    over = length + count > max_seq_len
    row = jnp.argmax(over)
    checkify.check(~jnp.any(over),
                   f"hidden_states: expected at most {{room}} new tokens (the cache holds {{held}} of "
                   f"max_seq_len={max_seq_len}), got {{n}}" + (" in row {row}" if batch > 1 else ""),
                   room=max_seq_len - length[row], held=length[row], n=count[row],
                   **({"row": row} if batch > 1 else {}))


def output_projection(o, weights: AttentionWeights, spec: StepSpec):
    """Stage 6: o [B, S, H, D] (de-rotated by `sparse_attention`) -> groups [B, S, G, H*D/G] -> wo_a
    -> wo_b [B, S, hidden]."""
    cfg, dtype = spec.cfg, spec.dtype
    kernel = spec.plan.kernels.projections_for()
    grouped = o.reshape(*o.shape[:2], cfg.o_groups, -1)
    z = projection("bsgi,gir->bsgr", grouped, weights.o_a_proj, out_dtype=dtype, precision=spec.precision,
                   kernel=kernel)
    z = z.reshape(*z.shape[:2], -1)
    return projection("bsr,rh->bsh", z, weights.o_b_proj, out_dtype=dtype, precision=spec.precision, kernel=kernel)


def sharded_attention_step(weights, cache, hidden_states, positions, spec):
    """`attention_step` with its inputs and outputs constrained to the plan's layout.

    ``spec.plan.layout`` (a `sharding.MeshLayout`) must be set (the layer's `step_spec` sets it
    when it has a mesh). The hidden states, positions, output and every cache leaf are
    batch-sharded (``"data"``); the intermediates' head axes are split over ``"model"``; the
    weights come as they are placed (`sharding.shard_layer`). Same (out, new cache,
    intermediates) as `attention_step`.
    """
    lay = spec.plan.layout
    hidden_states, positions, cache = sharding.constrain_inputs(lay, hidden_states, positions, cache)
    out, new_cache, intermediates = attention_step(weights, cache, hidden_states, positions, spec)
    return sharding.constrain_outputs(lay, out, new_cache, intermediates)


# ---------------------------------------------------------------------------- the compiled steps
# Module-level, so that equal layers share compiled code (`StepSpec` static): (sharded, donate,
# overlap, deterministic) -> the jitted step, its compile options the plan's
# (`dsv4_jax.step.overlap.compiler_options`; deterministic ones only exist for CUDA, where the plan
# alone sets them). The one registry: the layer's call, `compiled_steps` and the tools read it.
_STEPS = {
    (sharded, donate, overlap, deterministic): jax.jit(
        sharded_attention_step if sharded else attention_step, static_argnames=("spec",),
        compiler_options=overlap_mod.compiler_options(overlap, "cuda" if deterministic else None,
                                                      deterministic=deterministic),
        **({"donate_argnames": ("cache",)} if donate else {}))
    for sharded in (False, True) for donate in (False, True) for overlap in (False, True)
    for deterministic in (False, True)
}


def step_function(donate: bool = False, sharded: bool = False, overlap: bool = False, deterministic: bool = False):
    """The compiled step the layer runs: ``step(weights, cache, x, positions, spec=spec)``.

    `donate`: the version that donates the cache's buffers (``donate_cache=True``); `sharded`:
    `sharded_attention_step` (the layer runs it when its step has a mesh, ``spec.plan.layout``),
    else `attention_step`; `overlap`: compiled with concurrent command buffers (the layer's
    ``spec.plan.overlap``, `dsv4_jax.step.overlap`); `deterministic`: compiled with XLA's options
    for run-to-run identical programs (``spec.plan.deterministic``, CUDA only). Calling it directly
    skips the layer's input checks and host length mirror (the returned cache's length is the
    step's device array): the raw step, for benchmarks and tools.
    """
    return _STEPS[bool(sharded), bool(donate), bool(overlap), bool(deterministic)]


def step_for(spec: StepSpec, donate: bool = False):
    """The compiled step that runs `spec`: `step_function` for its mesh (``spec.plan.layout``),
    its overlap (``spec.plan.overlap``) and determinism (``spec.plan.deterministic``); `donate`
    as there."""
    return step_function(donate, sharded=spec.plan.layout is not None, overlap=spec.plan.overlap,
                         deterministic=spec.plan.deterministic)


def compiled_steps() -> int:
    """How many versions of the layer's step have been compiled so far in this process (every
    `step_function`, sharded ones included; each call shape, dtype, mesh and static option
    compiles one)."""
    return sum(step._cache_size() for step in _STEPS.values())
