"""`DeepseekV4Attention`: the layer, as a thin NNX module over a pure, compiled step.

One call runs the stages of vLLM's `attention_impl`, in order (names as in vLLM):

1. input GEMMs: ``wq_a`` + q_norm -> q_residual; ``wkv`` + kv_norm; the compressors'
   kv/gate projections; the indexer's head weights           (always in-graph)
2. ``wq_b_kv_insert``: ``wq_b``, per-head q norm, RoPE on q and kv, window-cache insert
3. ``compressor``: gated pooling of completed windows into compressed entries (CSA/HCA)
4. ``indexer``: its own key compressor, queries, scores, top-k (CSA)
5. sparse attention: window keys + picked (CSA) / visible (HCA) entries + sink
6. output: inverse RoPE at the query position, grouped ``wo_a``, then ``wo_b``

Stages 2-4 are `run_stages`, written once for XLA and NumPy; the step's `BreakPlan` (from
`break_mode`, `break_on` and `kernels`, see `breaks`) decides which of them run in a break and
where. Stages 1, 5 and 6 are always in-graph.

Shapes: B batch, S new tokens, H heads, D head_dim, W window, T entry slots, K index_topk.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from . import breaks, indexer, sharding, validation
from .backend import QUERY_BLOCK, Array, einsum, to_host_memory
from .cache import (
    AttentionCache,
    CompressorCache,
    advance_length,
    init_attention_cache,
    insert_ring,
    next_positions,
    overflows,
    real_tokens,
)
from .compressor import CompressorWeights, compress, visible_entries
from .config import CSA, HCA, SLIDING, DeepseekV4Config
from .indexer import IndexerWeights, head_weights, index_queries
from .norms import head_rms_norm, rms_norm
from .rope import apply_rope, attention_factor, inv_freq
from .sparse_attention import key_pool, sparse_attention


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
    for a V4-Flash CSA layer) ran on every step, 22 us a layer on the H200 (bench/RESULTS.md,
    issue 9). Made here once (the layer's `step_weights()` keeps it while its parameters stay
    the same arrays), the step gets the merged GEMM without the copy. Costs one more copy of
    those weights in memory. Under a trace (`nnx.grad`) it is part of the program, as XLA's
    merge was; gradients reach the separate parameters through it.
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
    indexer_weights: Array | None = None  # [B, S, nI] float32


@struct.dataclass
class StageOutputs:
    q: Array  # [B, S, H, D] rotated queries
    kv: Array  # [B, S, D]    rotated keys (= values) of this call
    window: Array  # [B, W, D] window cache after the insert
    compressor: CompressorCache | None = None
    indexer: CompressorCache | None = None
    picks: Array | None = None  # [B, S, K] int32, -1 = nothing (CSA)
    index_scores: Array | None = None  # [B, S, T] float32 (CSA, only when intermediates are asked)


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
    plan: breaks.BreakPlan
    dtype: Any  # compute dtype (jnp.dtype)
    precision: Any = None
    query_block: int = QUERY_BLOCK
    return_intermediates: bool = False
    checks: bool = False  # in-graph `checkify.check`s of positions and room (see `check_in_graph`)

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


@functools.cache
def _freqs(cfg: DeepseekV4Config, kind: str) -> np.ndarray:
    return inv_freq(cfg, kind)


# ---------------------------------------------------------------------------- stages 2-4
def wq_b_kv_insert(q_residual, kv, window, positions, length, q_b_proj, spec: StepSpec, frozen=None,
                   count=None):
    """Stage 2: queries [B, S, H, D] and rotated keys [B, S, D]; the window cache after the insert
    (rows in `frozen` unchanged; of a ragged call only each row's `count` real tokens are
    inserted). Padded slots (position -1) get queries and keys too (fixed shapes), which
    nothing reads."""
    cfg, dtype = spec.cfg, spec.dtype
    freqs, scale = _freqs(cfg, spec.rope_kind), attention_factor(cfg, spec.rope_kind)
    q = einsum("bsl,lk->bsk", q_residual, q_b_proj, out_dtype=dtype, precision=spec.precision)
    q = q.reshape(*q.shape[:2], cfg.num_attention_heads, cfg.head_dim)
    q = apply_rope(head_rms_norm(q, cfg.rms_norm_eps), positions[..., None], freqs, scale=scale,
                   in_place=True)
    kv = apply_rope(kv, positions, freqs, scale=scale)
    return q, kv, insert_ring(window, kv, length, frozen, count)


def run_stages(inputs: StageInputs, cache: AttentionCache, positions, weights: AttentionWeights,
               spec: StepSpec, select=None) -> StageOutputs:
    """Stages 2-4 (`wq_b_kv_insert`, `compressor`, `indexer`); XLA or NumPy (see `breaks`).

    `select` is the indexer's selection (default: the plan's; in-graph, the narrow host
    break or the native handler); the wide break runs this whole function on the host with
    the NumPy selection.
    """
    cfg = spec.cfg
    select = select or spec.plan.indexer_select()
    length = cache.length
    # Ragged calls: row b has count[b] real tokens, then padded slots (position -1) that write
    # nothing (scatter indices dropped) and that the indexer scores against no entry (visible 0).
    count = real_tokens(positions)
    # A row that would run past max_seq_len (possible only under a user's jit) writes nothing.
    frozen = overflows(length, count, cache.max_seq_len)
    compress_freqs, compress_scale = _freqs(cfg, "compress"), attention_factor(cfg, "compress")
    common = dict(ratio=spec.ratio, freqs=compress_freqs, rope_scale=compress_scale, eps=cfg.rms_norm_eps,
                  frozen=frozen, count=count, kernel=spec.plan.kernels.compress)

    # The named scopes label the step's XLA operations by stage (profiles: bench/kernel_profile.py).
    with jax.named_scope("wq_b_kv_insert"):
        q, kv, window = wq_b_kv_insert(inputs.q_residual, inputs.kv, cache.window, positions, length,
                                       weights.q_b_proj, spec, frozen, count)
    out = StageOutputs(q=q, kv=kv, window=window)
    if spec.layer_type == SLIDING:
        return out

    cw = weights.compressor
    with jax.named_scope("compressor"):
        comp_state = compress(inputs.compressor_kv, inputs.compressor_gate, cache.compressor, length,
                              position_bias=cw.position_bias, kv_norm=cw.kv_norm,
                              overlap=spec.layer_type == CSA, **common)
    out = out.replace(compressor=comp_state)
    if spec.layer_type == HCA:
        return out

    iw = weights.indexer
    with jax.named_scope("indexer_compressor"):
        index_state = compress(inputs.indexer_kv, inputs.indexer_gate, cache.indexer, length,
                               position_bias=iw.compressor.position_bias, kv_norm=iw.compressor.kv_norm,
                               overlap=True, **common)
    # The indexer's input is detached, as in DeepSeek-V3.2: its own loss (`indexer_kl_loss`)
    # trains the indexer only (its picks pass no gradient back to q_residual anyway).
    q_in = inputs.q_residual
    if not isinstance(q_in, np.ndarray):  # the wide break's host twin runs on NumPy arrays
        q_in = jax.lax.stop_gradient(q_in)
    with jax.named_scope("indexer_queries"):
        queries = index_queries(q_in, iw.q_b_proj, positions, compress_freqs,
                                n_heads=cfg.index_n_heads, rope_scale=compress_scale, dtype=spec.dtype,
                                precision=spec.precision)
    visible = visible_entries(positions, spec.ratio)
    with jax.named_scope("indexer_select"):
        selected = select(queries, inputs.indexer_weights, index_state.entries, visible,
                          top_k=cfg.index_topk, with_scores=spec.return_intermediates, block=spec.query_block)
    return out.replace(indexer=index_state, picks=selected.picks, index_scores=selected.scores)


def input_projections(x: Array, weights: AttentionWeights, cfg: DeepseekV4Config, dtype, prec) -> StageInputs:
    """Stage 1: x [B, S, hidden] -> `StageInputs` (q_residual, kv; the compressors' kv and gate
    and the indexer's head weights where the layer has them).

    One GEMM over `weights.input_proj` where it is set (then split by the projections'
    widths), else one GEMM per projection: the same products."""
    if weights.input_proj is None:
        outs = [einsum("bsh,hn->bsn", x, w, out_dtype=dtype, precision=prec) for w in input_projection_weights(weights)]
    else:
        fused = einsum("bsh,hn->bsn", x, weights.input_proj, out_dtype=dtype, precision=prec)
        edges = np.cumsum([w.shape[1] for w in input_projection_weights(weights)])[:-1]
        outs = jnp.split(fused, edges, axis=-1)
    q_residual = rms_norm(outs[0], weights.q_a_norm, cfg.rms_norm_eps)
    kv = rms_norm(outs[1], weights.kv_norm, cfg.rms_norm_eps)
    inputs = StageInputs(q_residual=q_residual, kv=kv)
    if weights.compressor is not None:
        inputs = inputs.replace(compressor_kv=outs[2], compressor_gate=outs[3])
    if weights.indexer is not None:
        inputs = inputs.replace(indexer_kv=outs[4], indexer_gate=outs[5],
                                indexer_weights=head_weights(outs[6], cfg.index_n_heads))
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
    x = hidden_states.astype(dtype)
    length = jnp.asarray(cache.length, jnp.int32)
    positions = next_positions(length, x.shape[1]) if positions is None else positions.astype(jnp.int32)
    cache = cache.replace(length=length)
    if spec.checks:
        check_in_graph(length, positions, cache.max_seq_len)

    # 1. Input GEMMs (vLLM: the parallel input projections and the fused q/kv norm).
    with jax.named_scope("input_projections"):
        inputs = input_projections(x, weights, cfg, dtype, prec)

    # 2-4. wq_b_kv_insert, compressor, indexer: in-graph, or (partly) in the host break.
    if spec.plan.mode == "wide":
        stage_fn = functools.partial(run_stages, spec=spec, select=indexer.select_topk)
        stages = breaks.wide_host_call(stage_fn, inputs, cache, positions, stage_weights(weights))
    else:
        stages = run_stages(inputs, cache, positions, weights, spec)

    # 5. Sparse attention over [window | picked or visible entries] with the sink.
    entries = stages.compressor.entries if stages.compressor is not None else None
    visible = visible_entries(positions, spec.ratio) if spec.layer_type != SLIDING else None
    with jax.named_scope("sparse_attention"):
        pool, window_idx, in_place = key_pool(cache.window, stages.window, stages.kv, positions, length,
                                              cfg.sliding_window)
        attended = sparse_attention(
            stages.q, pool, window_idx, weights.sinks, window_in_place=in_place,
            entries=entries, picks=stages.picks, visible=visible if spec.layer_type == HCA else None,
            block=spec.query_block, precision=prec, with_mass=spec.return_intermediates,
            kernels=spec.plan.kernels,
        )

    # 6. Inverse RoPE at the query position, grouped low-rank output projection.
    with jax.named_scope("output_projection"):
        out = output_projection(attended.o, positions, weights, spec)
    count = real_tokens(positions)  # [B] real tokens per row (a ragged call pads with -1)
    real = positions >= 0  # [B, S]
    overflow = overflows(length, count, cache.max_seq_len)  # [B]; such rows were written nothing
    # Padded slots output zeros: they see no key, so their attention output is 0 already; the
    # select makes it the contract rather than a consequence (e.g. of a finite padded input).
    # An overflowing row's real slots output NaN.
    out = jnp.where(real[..., None], out, jnp.zeros((), out.dtype))
    out = jnp.where(overflow[:, None, None] & real[..., None], jnp.asarray(jnp.nan, out.dtype), out)

    new_length = jnp.where(overflow, length, advance_length(length, count))
    new_cache = cache.replace(length=new_length, window=stages.window,
                              compressor=stages.compressor, indexer=stages.indexer)
    intermediates = None
    if spec.return_intermediates:
        def padded_zero(a):  # padded slots' queries, keys and masses are 0 (nothing was attended)
            return jnp.where(real.reshape(*real.shape, *([1] * (a.ndim - 2))), a, jnp.zeros((), a.dtype))

        intermediates = Intermediates(
            queries=padded_zero(stages.q), keys=padded_zero(stages.kv), sink_mass=padded_zero(attended.sink_mass),
            window_mass=padded_zero(attended.window_mass), compressed_mass=padded_zero(attended.compressed_mass),
            index_scores=stages.index_scores, topk=stages.picks, compressed_kv=entries,
            num_entries=None if entries is None else new_length // spec.ratio,
            visible_entries=visible,
        )
    return out, new_cache, intermediates


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


def output_projection(o, positions, weights: AttentionWeights, spec: StepSpec):
    """Stage 6: o [B, S, H, D] -> de-rotated -> groups [B, S, G, H*D/G] -> wo_a -> wo_b [B, S, hidden]."""
    cfg, dtype = spec.cfg, spec.dtype
    o = apply_rope(o, positions[..., None], _freqs(cfg, spec.rope_kind), inverse=True,
                   scale=attention_factor(cfg, spec.rope_kind), in_place=True)
    grouped = o.reshape(*o.shape[:2], cfg.o_groups, -1)
    z = einsum("bsgi,gir->bsgr", grouped, weights.o_a_proj, out_dtype=dtype, precision=spec.precision)
    z = z.reshape(*z.shape[:2], -1)
    return einsum("bsr,rh->bsh", z, weights.o_b_proj, out_dtype=dtype, precision=spec.precision)


def finite_guard(hidden_states):
    """The finite check of an eager call's accelerator input, run as its own small program just
    before the step (`validation.finite_deferred`): (finite: bool scalar, written into pinned
    host memory (`backend.to_host_memory`), hidden_states with a non-finite input zeroed).

    The step runs on the guarded input, so nothing downstream (the native selection kernels, a
    host break) ever sees a NaN; the call reads the verdict after dispatching the step and, if
    it says so, drops the step's results and raises (the cache is not donated: unchanged). The
    step itself is the layer's ordinary one (no second compiled step for the check). On the
    H200 the call costs ~0.18 ms over the jitted step with this check, as it did with the
    verdict computed inside the step and read after it (bench/RESULTS.md, "The decode window
    read in place"): one more program or one more host-memory read, ~0.13 ms either way.
    """
    finite = jnp.all(jnp.isfinite(hidden_states))
    return to_host_memory(finite), jnp.where(finite, hidden_states, jnp.zeros((), hidden_states.dtype))


# The compiled steps, module-level so that equal layers share compiled code (`StepSpec` static).
_STEPS = {
    False: jax.jit(attention_step, static_argnames=("spec",)),
    True: jax.jit(attention_step, static_argnames=("spec",), donate_argnames=("cache",)),
}
_FINITE_GUARD = jax.jit(finite_guard)


def step_function(donate: bool = False):
    """The compiled `attention_step` the layer runs: ``step(weights, cache, x, positions, spec=spec)``.

    `donate`: the version that donates the cache's buffers (``donate_cache=True``). Calling it
    directly skips the layer's input checks and host length mirror (the returned cache's length
    is the step's device array): the raw step, for benchmarks and tools.
    """
    return _STEPS[bool(donate)]


def compiled_steps() -> int:
    """How many versions of the layer's step have been compiled so far in this process (both
    `step_function`s and their sharded twins, `sharding.step_function`; each call shape, dtype,
    mesh and static option compiles one)."""
    steps = [*_STEPS.values(), *(sharding.step_function(d) for d in (False, True))]
    return sum(step._cache_size() for step in steps)


# ---------------------------------------------------------------------------- NNX modules
def _array(param: nnx.Variable) -> Array:
    """A parameter's array. `get_raw_value` skips flax's accessor machinery (~4 us a parameter,
    which adds up on every decode step); it is only used when it holds a plain array."""
    raw = param.get_raw_value() if hasattr(param, "get_raw_value") else None
    return raw if isinstance(raw, (jax.Array, np.ndarray)) else param[...]


def _param(value, axes: tuple[str, ...]) -> nnx.Param:
    """A parameter annotated with its logical axes (NNX sharding metadata; `dsv4_jax.sharding`
    maps them to mesh axes). ``eager_sharding=False``: the annotation alone, so building a layer
    needs no mesh; `sharding.shard_layer` places the values."""
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _projection(rngs: nnx.Rngs, shape, dtype, axes: tuple[str, ...]) -> nnx.Param:
    """A projection kernel [..., in, out] with variance 1/in (activations stay O(1)), logical `axes`.

    Drawn in float32, then cast: one seed gives the same weights (up to the cast) for every
    `param_dtype` (`random.normal` drawing in bf16 directly consumes the bits differently)."""
    init = nnx.initializers.normal(stddev=shape[-2] ** -0.5)
    return _param(init(rngs.params(), shape, jnp.float32).astype(dtype), axes)


class Compressor(nnx.Module):
    """Parameters of a gated-pooling compressor (names as HF's `compressor.*`)."""

    def __init__(self, hidden: int, width: int, dim: int, ratio: int, *, rngs: nnx.Rngs, param_dtype):
        # One shared K=V head: nothing here has a head axis (replicated over "model").
        self.kv_proj = _projection(rngs, (hidden, width), param_dtype, ("embed", "kv"))
        self.gate_proj = _projection(rngs, (hidden, width), param_dtype, ("embed", "kv"))
        self.position_bias = _param(jnp.zeros((ratio, width), jnp.float32), ("ratio", "kv"))
        self.kv_norm = _param(jnp.ones((dim,), jnp.float32), ("kv",))

    def weights(self) -> CompressorWeights:
        return _weights_of(self, CompressorWeights)


class Indexer(nnx.Module):
    """Parameters of the lightning indexer (HF `compressor.indexer.*`, official `indexer.*`)."""

    def __init__(self, cfg: DeepseekV4Config, *, rngs: nnx.Rngs, param_dtype):
        c = cfg.index_head_dim
        # "index_heads", not "heads": the selection sums over all indexer heads, so the indexer is
        # replicated over "model" (see `dsv4_jax.sharding`).
        self.q_b_proj = _projection(rngs, (cfg.q_lora_rank, cfg.index_n_heads * c), param_dtype,
                                    ("q_lora", "index_heads"))
        self.weights_proj = _projection(rngs, (cfg.hidden_size, cfg.index_n_heads), param_dtype,
                                        ("embed", "index_heads"))
        self.compressor = Compressor(cfg.hidden_size, cfg.compressor_width(CSA, indexer=True), c,
                                     cfg.csa_compress_rate, rngs=rngs, param_dtype=param_dtype)

    def weights(self) -> IndexerWeights:
        return _weights_of(self, IndexerWeights)


# The device twin of each host length mirror an eager call made: id(mirror) -> (weak reference
# to the mirror, its values when made (a list of ints), the step's device length). A mirror
# changed in place, or one this layer did not make, is uploaded as before.
_DEVICE_LENGTHS: dict[int, tuple] = {}


def _remember_device_length(mirror: np.ndarray, device_length, values: list | None = None) -> None:
    key = id(mirror)
    _DEVICE_LENGTHS[key] = (weakref.ref(mirror, lambda _, k=key: _DEVICE_LENGTHS.pop(k, None)),
                            mirror.tolist() if values is None else values, device_length)


def _device_length(length, checked: list | None = None):
    """The device twin of the host mirror `length` where it still holds the values it was made
    with (`checked`: its values as the checks read them, else read here), else `length`."""
    hit = _DEVICE_LENGTHS.get(id(length)) if type(length) is np.ndarray else None
    if hit is None or hit[0]() is not length:
        return length
    if hit[1] != (length.tolist() if checked is None else checked):
        return length
    device = hit[2]
    return length if getattr(device, "is_deleted", _not_deleted)() else device


def _not_deleted() -> bool:
    return False


def _with(cache: AttentionCache, layer_idx: int, length) -> AttentionCache:
    """``cache.replace(layer_idx=..., length=...)`` without `dataclasses.replace`'s field walk
    (a copy of the instance's fields; only for `AttentionCache` itself, which has no
    ``__post_init__``)."""
    if type(cache) is not AttentionCache:
        return cache.replace(layer_idx=layer_idx, length=length)
    fields = cache.__dict__.copy()
    fields["layer_idx"] = layer_idx
    fields["length"] = length
    new = object.__new__(AttentionCache)
    object.__setattr__(new, "__dict__", fields)
    return new


# Per-layer memos of `weights()`, `step_spec()` and of the calls' static checks, outside the
# modules (NNX would otherwise treat the cached arrays as part of the module's graph). Weak
# keys: they go with the layer.
_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STEP_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> (weights(), fused)
_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_CALL_KEYS = 64  # input structures remembered per layer (then the memo starts over)


def _parameter_arrays(module: nnx.Module) -> list:
    """Every parameter array of `module` and its submodules, in `_weights_of`'s order."""
    out = []
    for name in _field_names(type(module)):
        value = module.__dict__.get(name)
        if isinstance(value, nnx.Module):
            out.extend(_parameter_arrays(value))
        elif value is not None:
            out.append(_array(value))
    return out


def _field_names(cls) -> tuple:
    """The parameter attributes of a module class (`_FIELD_NAMES`; a subclass has its base's)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = next((_FIELD_NAMES[base] for base in cls.__mro__ if base in _FIELD_NAMES), ())
    return names


# How the probe reads a parameter's array: its slot, where the parameter's class reads it there
# (flax's `Variable.get_raw_value`), else through the method.
_PLAIN_GET = getattr(nnx.Variable, "get_raw_value", None)
_RAW_SLOT = operator.attrgetter("_raw_value")
_RAW_VALUE = operator.methodcaller("get_raw_value")


def _parameter_probe(module: nnx.Module):
    """What `weights()` compares by identity to know its pytree is current, without walking the
    modules: (attribute dicts, names, the objects they held, the parameters, their arrays). None
    where a parameter holds something else than a plain array (then the walk, each call)."""
    owners, names, held, params, raws = [], [], [], [], []

    def walk(m) -> bool:
        fields = m.__dict__
        for name in _field_names(type(m)):
            value = fields.get(name)
            owners.append(fields)
            names.append(name)
            held.append(value)
            if isinstance(value, nnx.Module):
                if not walk(value):
                    return False
            elif value is not None:
                raw = value.get_raw_value() if hasattr(value, "get_raw_value") else None
                if not isinstance(raw, (jax.Array, np.ndarray)):
                    return False
                params.append(value)
                raws.append(raw)
        return True

    if not walk(module):
        return None
    plain = _PLAIN_GET is not None and all(type(p).get_raw_value is _PLAIN_GET for p in params)
    return tuple(owners), tuple(names), tuple(held), tuple(params), tuple(raws), _RAW_SLOT if plain else _RAW_VALUE


def _probe_holds(probe) -> bool:
    """Every attribute still holds the object it held, every parameter the array it held."""
    owners, names, held, params, raws, read = probe
    return (all(map(operator.is_, map(dict.get, owners, names), held))
            and all(map(operator.is_, map(read, params), raws)))


_LAYER_FIELDS = operator.attrgetter("config", "layer_idx", "layer_type", "break_mode", "break_on", "kernels",
                                     "dtype", "param_dtype", "precision", "query_block", "donate_cache",
                                     "checkify", "mesh", "sharding_rules")


def _layer_state(layer) -> tuple:
    """Everything of the layer that the static checks, the step's spec and its choice read,
    with the mesh of an enclosing ``jax.set_mesh`` (compared by equality, which is identity for
    unchanged attributes: a change of any of them starts the call memo over)."""
    return _LAYER_FIELDS(layer), (_context_mesh() if layer.mesh is None else None)


def _context_mesh():
    """`sharding.context_mesh()`, shorter where there is none: JAX sets the abstract mesh with
    every concrete one (`jax.set_mesh`, and its own jit and shard_map internals), so an empty
    abstract mesh means no context mesh."""
    if jax.sharding.get_abstract_mesh().empty:
        return None
    return sharding.context_mesh()


def _inputs_key(hidden_states, positions, return_intermediates) -> tuple | None:
    """The structure of a call's arrays (classes, shapes, dtypes) and options: all that
    `validation.check_call`'s static checks and the step's spec read of them. None for inputs
    the memo does not take (tracers, other types)."""
    concrete = validation._CONCRETE_TYPES
    if not ((type(hidden_states) in concrete or validation.is_concrete_array(hidden_states))
            and (type(positions) in concrete or validation.is_concrete_array(positions))):
        return None
    return (type(hidden_states), hidden_states.shape, hidden_states.dtype, type(positions), positions.shape,
            positions.dtype, bool(return_intermediates))


def _cache_key(cache) -> tuple | None:
    """The structure of a cache (its static fields, the class of its length, its arrays' shapes,
    dtype and mesh): all that the static checks, the spec and the step's choice read of it.
    None for anything but an `AttentionCache`."""
    if type(cache) is not AttentionCache:
        return None
    try:
        window, comp = cache.window, cache.compressor
        placed = getattr(window, "sharding", None)
        key = (type(cache.length), cache.layer_idx, cache.layer_type, cache.max_seq_len, type(window),
               window.shape, window.dtype, None if comp is None else comp.entries.shape, cache.indexer is None,
               placed if isinstance(placed, jax.sharding.NamedSharding) else None)
        hash(key)
    except Exception:  # not arrays where the cache holds them: the checks word it
        return None
    return key


class _CallMemo:
    """A layer's memo of its eager calls: the layer state it holds for (`_layer_state`), the
    (spec, step) of each input structure whose static checks passed, and the cache the last
    call returned (weak reference, its structure key, its length mirror's values, the step's
    device length), so that the next call on it skips reading the cache's structure again; and
    the `step_weights()` with the probe of the parameters it was made from."""

    __slots__ = ("entries", "last", "state", "weights")

    def __init__(self, state):
        self.state, self.entries, self.last = state, {}, None
        self.weights = None  # (the `weights()` probe, the `step_weights()` of that pytree)


def _weights_of(module: nnx.Module, cls):
    """`cls` (a weights pytree) filled from `module`'s attributes of the same names.

    The parameters' names are the modules' attributes, set in the constructors: the one
    source. The weights pytrees name the same attributes (a mismatch fails at once), and the
    HF name table is derived from the same attributes (`weights.parameter_table`).
    """
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in DERIVED_WEIGHTS:
            continue
        value = getattr(module, field.name)
        values[field.name] = (None if value is None else value.weights() if isinstance(value, nnx.Module)
                              else _array(value))
    return cls(**values)


_FIELD_NAMES = {}  # module class -> the weights pytree's field names (filled below the classes)


class DeepseekV4Attention(nnx.Module):
    """DeepSeek-V4 attention (sliding / CSA / HCA by `cfg.layer_types[layer_idx]`), with a cache.

    >>> attn = DeepseekV4Attention(cfg, layer_idx=1, rngs=nnx.Rngs(0))
    >>> cache = attn.init_cache(batch_size=2, max_seq_len=4096)
    >>> out, cache = attn(hidden_states, positions, cache)   # [B,S,hidden], int32 [B,S]

    Arguments:
      break_mode:   "narrow" (default; the indexer's scoring + top-k in a break), "none"
                    (no break) or "wide" (wq_b_kv_insert + compressors + indexer on the
                    host). Same picks and outputs in every mode. An attribute: it may be
                    changed between calls (each mode compiles once).
      break_on:     where the narrow break runs: "device" (a native XLA FFI custom call on
                    the step's device, an eager break that never leaves it), "host" (a
                    `jax.pure_callback` into NumPy) or "auto" (default: "device" where the
                    native handlers are built for the platform, see `dsv4_jax.native_info()`,
                    else "host"). The wide break is always on the host. An attribute.
      kernels:      "auto" (default: native handlers where built; with break_mode="none" the
                    selection then runs the graph-compatible native handler, no break),
                    "native" (require them) or "xla" (XLA reference ops only, e.g. `lax.top_k`).
      dtype:        compute dtype; None (default) = `param_dtype`: a bf16 layer computes in
                    bf16 and casts float32 inputs to bf16 (its cache and output are bf16); a
                    float32 layer computes bf16 inputs in float32. (flax's `nnx.Linear`
                    promotes instead; here the cache's dtype must be known before the first
                    input is seen, so the layer alone decides.) Set it to compute in another
                    dtype than the weights, e.g. ``dtype=jnp.float32`` with bf16 weights.
      param_dtype:  dtype of the projection weights. Norm weights, sinks and position biases
                    stay float32, as the reference keeps them.
      precision:    `jax.lax.Precision` of the matmuls. None (default) means HIGHEST for a
                    float32 compute dtype (true float32 on GPUs too, where XLA's default
                    would use TF32) and the backend default for bf16.
      query_block:  queries processed at a time by the indexer scoring and sparse attention
                    (bounds the memory of long prefills).
      donate_cache: donate the input cache's buffers to the step (in-place updates; the
                    cache passed in becomes unusable after a successful call).
      check_finite: reject NaN/inf in `hidden_states`: True (every concrete input; an
                    accelerator array inside the step, its verdict read after it, or before
                    dispatch with a device sync where the cache is donated), "host" (NumPy
                    inputs only), False (none: NaN reaches the output and the cache). None
                    (default): `dsv4_jax.validation.CHECK_FINITE`, which is True.
      checkify:     False (default) or True: under your own `jax.jit`, where the value checks
                    cannot run on the host, put them into the step as
                    `jax.experimental.checkify.check`s (each row's positions continue its
                    length, padding only after a row's real tokens, room left; messages as
                    the eager ones). Then wrap your
                    function in `checkify.checkify` (``jax.jit(checkify.checkify(f))``) and
                    call ``err.throw()``. Eager calls are checked on the host and run the
                    usual step either way. An attribute.
      mesh:         a `jax.sharding.Mesh` (axes "data" for the batch, "model" for the heads;
                    `dsv4_jax.sharding.make_mesh`) to run on: the parameters are placed on it
                    by their logical axes, `init_cache` makes a batch-sharded cache, and the
                    breaks run per batch shard. None (default): no mesh of its own; the step
                    then takes the mesh of an enclosing ``jax.set_mesh(...)``, or (eager calls)
                    the one the cache is sharded over. An attribute; see `dsv4_jax.sharding`.
      sharding_rules: (logical axis, mesh axis or None) pairs overriding
                    `dsv4_jax.sharding.LOGICAL_AXIS_RULES` (None: the defaults).

    Parameters (JAX [in, out] layout): ``q_a_proj [hidden, Lq]``, ``q_a_norm [Lq]``,
    ``q_b_proj [Lq, H*D]``, ``kv_proj [hidden, D]``, ``kv_norm [D]``,
    ``o_a_proj [G, H*D/G, R]``, ``o_b_proj [G*R, hidden]``, ``sinks [H]``; ``compressor``
    (CSA/HCA) and ``indexer`` (CSA) submodules. Load HF weights with
    `dsv4_jax.load_hf_attention_weights`.
    """

    def __init__(self, config: DeepseekV4Config, layer_idx: int, *, rngs: nnx.Rngs,
                 break_mode: str = "narrow", break_on: str = "auto", kernels: str = "auto", dtype=None,
                 param_dtype=jnp.float32, precision=None, query_block: int = QUERY_BLOCK,
                 donate_cache: bool = False,
                 check_finite=None, checkify: bool = False, mesh=None, sharding_rules=None):
        if not isinstance(config, DeepseekV4Config):
            raise TypeError(f"config: expected a DeepseekV4Config, got {type(config).__name__}")
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_type(layer_idx)
        self.break_mode = breaks.check_break_mode(break_mode)
        self.break_on = breaks.check_break_on(break_on)
        self.kernels = breaks.check_kernels(kernels)
        self.dtype = validation.check_float_dtype("dtype", dtype, allow_none=True)
        self.param_dtype = validation.check_float_dtype("param_dtype", param_dtype)
        self.precision = precision
        if isinstance(query_block, bool) or not isinstance(query_block, int) or query_block < 1:
            raise ValueError(f"query_block: expected a positive int, got {query_block!r}")
        self.query_block = query_block
        self.donate_cache = bool(donate_cache)
        validation.check_finite_mode(check_finite)
        self.check_finite = check_finite
        self.checkify = bool(checkify)

        c, h, d = config, config.num_attention_heads, config.head_dim
        pd = self.param_dtype
        # Logical axes (`dsv4_jax.sharding.LOGICAL_AXIS_RULES`): heads split over "model" where
        # the math is per head (q_b_proj's head-major columns, sinks) and the output projection
        # by its groups (each group holds whole heads; XLA sums the groups' partial outputs).
        self.q_a_proj = _projection(rngs, (c.hidden_size, c.q_lora_rank), pd, ("embed", "q_lora"))
        self.q_a_norm = _param(jnp.ones((c.q_lora_rank,), jnp.float32), ("q_lora",))
        self.q_b_proj = _projection(rngs, (c.q_lora_rank, h * d), pd, ("q_lora", "heads"))
        self.kv_proj = _projection(rngs, (c.hidden_size, d), pd, ("embed", "kv"))
        self.kv_norm = _param(jnp.ones((d,), jnp.float32), ("kv",))
        self.o_a_proj = _projection(rngs, (c.o_groups, h * d // c.o_groups, c.o_lora_rank), pd,
                                    ("o_groups", "group_dim", "o_lora"))
        self.o_b_proj = _projection(rngs, (c.o_groups * c.o_lora_rank, c.hidden_size), pd, ("o_groups", "embed"))
        self.sinks = _param(jnp.zeros((h,), jnp.float32), ("heads",))
        self.compressor = (
            Compressor(c.hidden_size, c.compressor_width(self.layer_type), d, c.compress_rate(self.layer_type),
                       rngs=rngs, param_dtype=pd)
            if self.layer_type in (CSA, HCA) else None
        )
        self.indexer = Indexer(c, rngs=rngs, param_dtype=pd) if self.layer_type == CSA else None
        self.mesh = None
        # Hashable (the module's static attributes key `nnx.jit`'s cache): a tuple over every logical axis.
        self.sharding_rules = None if sharding_rules is None else sharding.check_rules(sharding_rules)
        if mesh is not None:
            sharding.shard_layer(self, mesh, sharding_rules)

    # ------------------------------------------------------------------ public API
    def init_cache(self, batch_size: int, max_seq_len: int, dtype=None, *,
                   allow_long_context: bool = False) -> AttentionCache:
        """An empty cache for `batch_size` rows of up to `max_seq_len` tokens.

        dtype: the cache dtype; defaults to the layer's compute dtype, which is `dtype`, else
        `param_dtype` (the compute dtype does not depend on the inputs: with
        ``param_dtype=jnp.bfloat16`` and ``dtype=None`` the layer computes in bf16 for float32
        and bf16 inputs alike, and this default cache fits both). A cache of another dtype
        than the compute dtype is refused at the call with a `TypeError` naming ``cache``.
        allow_long_context: `max_seq_len` past ``config.max_position_embeddings`` (positions the
        model was not trained for) is a `ValueError` naming both unless this is True (as vLLM
        refuses a ``max_model_len`` past the model's limit unless told otherwise).
        """
        dtype = validation.check_float_dtype("dtype", dtype, allow_none=True)
        dtype = dtype or self.compute_dtype
        cache = init_attention_cache(self.config, self.layer_idx, batch_size, max_seq_len, dtype,
                                     allow_long_context=allow_long_context)
        # On a mesh: batch-sharded over its "data" axis (`ValueError` naming batch_size if it does not split).
        return cache if self.mesh is None else sharding.shard_cache(cache, self.mesh, self.sharding_rules)

    def weights(self) -> AttentionWeights:
        """The current parameters as an `AttentionWeights` pytree of arrays.

        Built once and reused while every parameter still holds the same array (checked by
        identity each call: an assignment, a loaded checkpoint or an optimizer update makes a
        new pytree). The cache lives outside the module (`_WEIGHTS`), so NNX never sees it; it
        keeps a probe of the attributes, parameters and arrays it was built from, so that the
        check is a few identity comparisons rather than a walk of the modules."""
        hit = _WEIGHTS.get(self)
        if hit is not None and hit[0] is not None and _probe_holds(hit[0]):
            return hit[2]  # the same parameters still hold the same arrays
        arrays = _parameter_arrays(self)
        key = tuple(map(id, arrays))
        if hit is not None and hit[1] == key:  # the cached pytree holds these very arrays
            weights = hit[2]
        else:
            weights = _weights_of(self, AttentionWeights)
        _WEIGHTS[self] = (_parameter_probe(self), key, weights)
        return weights

    def step_weights(self) -> AttentionWeights:
        """What the layer's call hands its compiled step: `weights()`, for a CSA layer with the
        input projections' weights side by side (`fuse_input_projections`), made once per
        `weights()` pytree.

        Use it to drive `attention_step` yourself at the layer's speed; differentiate through
        `weights()` (its leaves are the parameters; `input_proj` would be a leaf of its own)."""
        weights = self.weights()
        if weights.indexer is None:
            # Only CSA layers: their 7 input GEMMs are what XLA merged (with the copy); an HCA
            # layer's 4 ran slower as one on the H200 (B = 1: 0.17 against 0.12 ms a layer).
            return weights
        hit = _STEP_WEIGHTS.get(self)
        if hit is None or hit[0] is not weights:
            hit = _STEP_WEIGHTS[self] = (weights, fuse_input_projections(weights))
        return hit[1]

    @property
    def compute_dtype(self):
        """The dtype the layer computes in (and its cache holds): `dtype`, else `param_dtype`."""
        return jnp.dtype(self.dtype if self.dtype is not None else self.param_dtype)

    def step_spec(self, return_intermediates: bool = False, checks: bool = False) -> StepSpec:
        """The static description of the compiled step this layer runs (inputs of any float dtype:
        they are cast to the layer's `compute_dtype`). `return_intermediates`: the step that also
        returns `Intermediates`; `checks`: the step with in-graph `checkify` checks
        (`check_in_graph`), to run under `checkify.checkify`. Memoized per value of everything it
        reads (the layer's options and the mesh)."""
        mesh = self.mesh if self.mesh is not None else sharding.context_mesh()
        key = (mesh, self.sharding_rules, self.break_mode, self.break_on, self.kernels, self.dtype,
               self.param_dtype, self.precision, self.query_block, bool(return_intermediates), bool(checks))
        specs = _SPECS.setdefault(self, {})
        spec = specs.get(key)
        if spec is None:
            spec = specs[key] = self._new_step_spec(mesh, return_intermediates, checks)
        return spec

    def _new_step_spec(self, mesh, return_intermediates: bool, checks: bool) -> StepSpec:
        layout = None if mesh is None else sharding.layout(self.config, mesh, self.sharding_rules)
        plan = breaks.plan_break(self.layer_type, self.break_mode, self.break_on, self.kernels, layout=layout)
        dtype = self.compute_dtype
        precision = self.precision
        if precision is None and jnp.dtype(dtype) == jnp.float32:
            precision = jax.lax.Precision.HIGHEST
        return StepSpec(cfg=self.config, layer_type=self.layer_type, plan=plan,
                        dtype=jnp.dtype(dtype), precision=precision, query_block=self.query_block,
                        return_intermediates=bool(return_intermediates), checks=bool(checks))

    def __call__(self, hidden_states, positions, cache: AttentionCache, *, return_intermediates: bool = False):
        """Run the layer on S new tokens per row and return ``(out, cache)``.

        hidden_states: [B, S, hidden] float; positions: int [B, S]: row b's real tokens
        continue its length (``cache.length[b], cache.length[b] + 1, ...``), then -1 pads the
        row to S (ragged batches: rows may differ in length and in new tokens; padded slots
        output zeros and write nothing; at least one real token per call). ``positions=None``:
        every slot real, each row continuing its cache (`cache.next_positions`); under a jit
        they are then computed from the cache's length inside the program (a decode step
        that takes no positions argument; see `attention_step`).
        With ``return_intermediates=True`` returns ``(out, cache, Intermediates)``; off by
        default, and then nothing extra is computed (it is a separate compiled step).

        Runs compiled code: the first call of each (layer type, shapes, options) compiles, later
        calls (e.g. every decode step, and every layer of the same type) reuse it. Inside a
        user's `jax.jit`/`nnx.jit` it is traced: the value checks are skipped (or, with
        ``checkify=True``, become `checkify` checks), and a call past `max_seq_len` leaves the
        cache unchanged and returns NaN (see `attention_step`).
        """
        if positions is None:
            positions = validation.positions_from_cache(self, hidden_states, cache)
        memo = _CALLS.get(self)
        if memo is not None:
            last = memo.last
            last = last if last is not None and last[0]() is cache else None  # the cache it returned
            inputs = _inputs_key(hidden_states, positions, return_intermediates)
            structure = last[1] if last is not None else _cache_key(cache)
            if inputs is not None and structure is not None and memo.state == _layer_state(self):
                hit = memo.entries.get((inputs, structure))
                if hit is not None:  # the static checks passed for this structure: the value checks only
                    finite = validation.finite_mode(self)
                    deferred = hit[1] is _STEPS[False] and validation.finite_deferred(hidden_states, finite)
                    before, after = validation.check_values(hidden_states, positions, cache.length,
                                                            cache.max_seq_len, False if deferred else finite)
                    if last is not None and last[2] == before and not getattr(last[3], "is_deleted", _not_deleted)():
                        device_length = last[3]  # the mirror still holds what the step returned
                    else:
                        device_length = _device_length(cache.length, before)
                    return self._run(memo, hit, hidden_states, positions, cache, return_intermediates,
                                     before, after, device_length, deferred)
        structure = _cache_key(cache)
        inputs = None if structure is None else _inputs_key(hidden_states, positions, return_intermediates)
        state = None if inputs is None else _layer_state(self)
        # An accelerator input's finite check may be read after dispatch (decided below, once the
        # step is known): the value checks before dispatch leave it out, the same checks in the same order.
        finite = validation.finite_mode(self)
        deferred = not self.donate_cache and validation.finite_deferred(hidden_states, finite)
        spec, host_length, new_tokens = validation.check_call(self, hidden_states, positions, cache,
                                                              return_intermediates, False if deferred else None)
        if host_length is None and self.checkify:  # traced: the value checks go into the step
            spec = dataclasses.replace(spec, checks=True)
        if spec.plan.layout is None and host_length is not None and sharding.mesh_of(cache) is not None:
            # An eager call on a cache sharded over a mesh the layer was not told about: run on
            # that mesh (its breaks per batch shard) rather than gather the batch for them.
            layout = sharding.layout(self.config, sharding.mesh_of(cache), self.sharding_rules)
            spec = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, layout=layout))
        if spec.plan.layout is not None:
            sharding.check_batch(spec.plan.layout, hidden_states.shape[0])
            step = sharding.step_function(self.donate_cache)
        else:
            step = step_function(self.donate_cache)
        if host_length is None:
            # Traced: the layer index is checked above and is no part of the computation.
            with breaks.surface_host_errors():  # an exception on the host arrives as HostBreakError
                anonymous = cache.replace(layer_idx=-1, length=_device_length(cache.length))
                out, new_cache, intermediates = step(self.step_weights(), anonymous, hidden_states, positions,
                                                     spec=spec)
            new_cache = new_cache.replace(layer_idx=cache.layer_idx)
            return (out, new_cache, intermediates) if return_intermediates else (out, new_cache)
        if state is not None:  # remember what passed: the next call of this structure checks values only
            if memo is None or memo.state != state or len(memo.entries) >= _MAX_CALL_KEYS:
                memo = _CALLS[self] = _CallMemo(state)
            memo.entries[(inputs, structure)] = (spec, step)
        if deferred and step is not _STEPS[False]:  # a sharded step: the check before dispatch after all
            validation.check_finite("hidden_states", hidden_states, finite)
            deferred = False
        before = host_length.tolist()
        after = advance_length(host_length, new_tokens).tolist()
        return self._run(memo, (spec, step), hidden_states, positions, cache, return_intermediates, before, after,
                         _device_length(cache.length, before), deferred)

    def _run(self, memo, run, hidden_states, positions, cache: AttentionCache, return_intermediates,
             before: list, after: list, device_length, finite_deferred: bool = False):
        """Run the checked eager call: the compiled step, then the host length mirror.

        `run`: (spec, step); `before`/`after`: the lengths the checks read and the lengths after
        the call (lists); `device_length`: what the step gets for the length (the device twin of
        the mirror where there is one, else the mirror); `finite_deferred`: run `finite_guard`
        first and the step (the non-donating one) on its output, then raise the finite check's
        error, the results dropped, if its verdict says so."""
        spec, step = run
        # The layer index is checked and is no part of the computation: leave it out of the
        # compiled step's identity, so that layers of one type share one program.
        # The step gets the device copy of the host length mirror where this layer made one
        # (uploading the NumPy mirror would cost more dispatch time than the checks save).
        anonymous = _with(cache, -1, device_length)
        held = None if memo is None else memo.weights
        if held is not None and _probe_holds(held[0]):
            weights = held[1]  # what `step_weights()` returns while the probe holds, without its lookups
        else:
            weights = self.step_weights()
            if memo is not None:
                probe = _WEIGHTS[self][0]  # the probe of the pytree `step_weights()` was made from
                memo.weights = None if probe is None else (probe, weights)
        try:
            step_input = hidden_states
            if finite_deferred:
                finite, step_input = _FINITE_GUARD(hidden_states)
            out, new_cache, intermediates = step(weights, anonymous, step_input, positions, spec=spec)
        except Exception:
            with breaks.surface_host_errors():  # an exception on the host arrives as HostBreakError
                raise
        # The host mirror of the step's new length (see `dsv4_jax.cache`): the next call's
        # checks need no device round trip; the step's own length is kept beside it.
        # (This runs while the device computes.)
        mirror = np.array(after, np.int32)
        if finite_deferred and not bool(finite):  # nothing of the call is kept: the cache is the caller's
            validation.reject_non_finite("hidden_states", hidden_states, ran=True)
        device_length = new_cache.length
        _remember_device_length(mirror, device_length, after)
        new_cache = _with(new_cache, cache.layer_idx, mirror)
        if memo is not None:
            structure = _cache_key(new_cache)
            memo.last = None if structure is None else (weakref.ref(new_cache), structure, after, device_length)
        if return_intermediates:
            return out, new_cache, intermediates
        return out, new_cache


_FIELD_NAMES.update({
    DeepseekV4Attention: tuple(f.name for f in dataclasses.fields(AttentionWeights) if f.name not in DERIVED_WEIGHTS),
    Compressor: tuple(f.name for f in dataclasses.fields(CompressorWeights)),
    Indexer: tuple(f.name for f in dataclasses.fields(IndexerWeights)),
})
