"""Long context: what a cache costs per token, how large a prefill chunk fits, a chunked prefill.

The layer is chunk invariant: any schedule of calls gives the result of one call over the
whole sequence (`tests/layer/test_properties.py`, `tests/tools/test_long_context.py`). A prompt of any
length can therefore run through a layer, or through a model's stack of layers, in chunks,
and only one chunk's temporaries exist at a time: `prefill` does that, with chunks sized by
`prefill_chunk_size` from the memory available.

* `cache_bytes`, `cache_bytes_per_token`, `cache_fixed_bytes`: one layer's cache, computed from
  its real leaves (`jax.eval_shape` of `cache.init_attention_cache`: nothing is allocated).
  A cache is ``fixed + per_token * max_seq_len`` bytes per row (max_seq_len a multiple of the
  layer's compression ratio): the entries grow with `max_seq_len`; the window ring, the
  compressors' rings and the length do not.
* `cache_table` / `cache_table_markdown`: those figures per layer type of a config, and what a
  context of `max_seq_len` tokens costs a whole model (the tables of docs/long_context.md);
  `rows_that_fit` / `capacity_table_markdown`: how many such contexts a memory holds.
* `prefill_chunk_terms` / `prefill_chunk_bytes`: an estimate of one chunk's device memory, term
  by term (see `prefill_chunk_terms`); `prefill_chunk_size`: the largest chunk within a budget.
* `prefill(layers, hidden_states, caches)`: the chunked prefill; returns what one call returns.

Shapes: B rows, S tokens of a chunk, N tokens of the prompt, H heads, D head_dim, W window,
T = ``max_seq_len // m`` entry slots, K index_topk, nI / c the indexer's heads / head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsv4_jax.backend import QUERY_BLOCK
from dsv4_jax.cache.contiguous import AttentionCache, cache_nbytes, init_attention_cache
from dsv4_jax.cache.quantized import is_quantized
from dsv4_jax.config import CSA, HCA, LAYER_TYPES, SLIDING, DeepseekV4Config
from dsv4_jax.layer.module import DeepseekV4Attention

# Budget of `prefill` where the device reports no memory (`Device.memory_stats()` is None, e.g.
# XLA:CPU): a fixed 1 GiB, so that a CPU run takes chunks of a known size rather than guess the
# host's free memory (which other processes share).
DEFAULT_MEMORY_BYTES = 1 << 30
# Share of a device's free memory that `prefill` budgets where the device reports it: the
# estimate leaves out XLA's own scratch and the allocator's fragmentation.
FREE_MEMORY_FRACTION = 0.9

_SHORT = {SLIDING: "sliding", CSA: "CSA", HCA: "HCA"}


# ---------------------------------------------------------------------------- cache memory
def _config_with(cfg: DeepseekV4Config, layer_type: str) -> tuple[DeepseekV4Config, int]:
    """(a config, the index of a `layer_type` layer in it): `cfg` where it has such a layer."""
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"layer_type: expected one of {LAYER_TYPES}, got {layer_type!r}")
    if layer_type in cfg.layer_types:
        return cfg, cfg.layer_types.index(layer_type)
    return dataclasses.replace(cfg, layer_types=(layer_type,)), 0


def cache_bytes(cfg: DeepseekV4Config, layer_type: str, max_seq_len: int, *, batch: int = 1,
                dtype=jnp.bfloat16, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one layer's cache of `batch` rows and `max_seq_len` tokens: the sum over the
    leaves of the cache `init_cache` makes (shapes from `jax.eval_shape`, nothing allocated).
    Any `max_seq_len` is accepted here (costing a cache is not making one). `kv_cache_dtype`:
    "auto" or "fp8" (`init_cache`'s; FP8 rows cost about half)."""
    return _cache_bytes(cfg, layer_type, int(max_seq_len), int(batch), jnp.dtype(dtype), kv_cache_dtype)


@functools.lru_cache(maxsize=256)  # `prefill_chunk_size` asks for the same cache at every chunk it tries
def _cache_bytes(cfg: DeepseekV4Config, layer_type: str, max_seq_len: int, batch: int, dtype,
                 kv_cache_dtype: str) -> int:
    cfg, idx = _config_with(cfg, layer_type)
    shapes = jax.eval_shape(lambda: init_attention_cache(cfg, idx, batch, max_seq_len, dtype,
                                                         allow_long_context=True, kv_cache_dtype=kv_cache_dtype))
    return cache_nbytes(shapes)


def _costing_lengths(cfg: DeepseekV4Config, layer_type: str) -> tuple[int, int]:
    """Two cache lengths between which a layer's cache grows by whole entries only."""
    step = max(1, cfg.compress_rate(layer_type))
    return step, 2 * step


def cache_bytes_per_token(cfg: DeepseekV4Config, layer_type: str, dtype=jnp.bfloat16,
                          kv_cache_dtype: str = "auto") -> float:
    """Bytes per row that one layer's cache grows by per token of `max_seq_len`.

    From the real leaves: the difference of `cache_bytes` between two lengths one compression
    window apart, divided by the window. Sliding layers: 0 (their cache is the window ring);
    CSA: ``(head_dim + index_head_dim) * itemsize / m``; HCA: ``head_dim * itemsize / m'``
    (FP8 caches: a main KV row of 583 bytes and an indexer key of 68 at V4-Flash widths).
    """
    short, long = _costing_lengths(cfg, layer_type)
    size = functools.partial(cache_bytes, cfg, layer_type, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    return (size(long) - size(short)) / (long - short)


def cache_fixed_bytes(cfg: DeepseekV4Config, layer_type: str, dtype=jnp.bfloat16,
                      kv_cache_dtype: str = "auto") -> int:
    """Bytes per row of one layer's cache that do not grow with `max_seq_len`: the window ring,
    the compressors' rings and the length (``cache_bytes(L) == fixed + per_token * L`` for L a
    multiple of the compression ratio)."""
    short, long = _costing_lengths(cfg, layer_type)  # long = 2 * short: the line through both, at 0
    size = functools.partial(cache_bytes, cfg, layer_type, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    return 2 * size(short) - size(long)


def cache_table(cfg: DeepseekV4Config, max_seq_len: int, dtype=jnp.bfloat16, batch: int = 1,
                kv_cache_dtype: str = "auto") -> list[dict]:
    """One row per layer type of `cfg`: how many layers it has, the cache's bytes per token and
    fixed bytes (per row), one layer's cache at `max_seq_len` (`batch` rows, exact) and all
    layers of the type together (``total``), for caches of `kv_cache_dtype` ("auto", "fp8")."""
    fmt = dict(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    rows = []
    for layer_type in LAYER_TYPES:
        count = cfg.layer_types.count(layer_type)
        if not count:
            continue
        per_layer = cache_bytes(cfg, layer_type, max_seq_len, batch=batch, **fmt)
        rows.append({"layer_type": layer_type, "layers": count,
                     "bytes_per_token": cache_bytes_per_token(cfg, layer_type, **fmt),
                     "fixed_bytes": cache_fixed_bytes(cfg, layer_type, **fmt),
                     "per_layer": per_layer, "total": count * per_layer})
    return rows


def rows_that_fit(cfg: DeepseekV4Config, max_seq_len: int, memory_bytes: int, dtype=jnp.bfloat16,
                  kv_cache_dtype: str = "auto") -> int:
    """The most rows (sequences of `max_seq_len` tokens) whose caches, every layer of `cfg`,
    fit in `memory_bytes`: the batch x context a memory holds (caches alone: no weights, no
    activations; a cache's bytes are linear in its rows)."""
    per_row = sum(r["total"] for r in cache_table(cfg, max_seq_len, dtype, 1, kv_cache_dtype))
    return int(memory_bytes // per_row)


def capacity_table_markdown(cfg: DeepseekV4Config, contexts: Sequence[int], memory_bytes: int,
                            dtype=jnp.bfloat16) -> str:
    """`rows_that_fit` with the default and with FP8 caches for each of `contexts`, as a markdown
    table (tokens of context held: rows x context)."""
    out = [f"| context | rows in {format_bytes(memory_bytes)}, {np.dtype(dtype).name} caches | "
           f"rows, FP8 caches | tokens held, {np.dtype(dtype).name} -> FP8 |", "|---|---|---|---|"]
    for context in contexts:
        plain, fp8 = (rows_that_fit(cfg, context, memory_bytes, dtype, kv) for kv in ("auto", "fp8"))
        out.append(f"| {context:,} | {plain:,} | {fp8:,} | {plain * context:,} -> {fp8 * context:,} "
                   f"({fp8 / plain:.2f}x) |")
    return "\n".join(out)


def format_bytes(n: float) -> str:
    """Bytes in binary units, 3 significant digits (``"320 MiB"``, ``"6.58 GiB"``)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1)):
        if abs(n) >= scale or unit == "B":
            value = n / scale
            return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"
    raise AssertionError("unreachable")


def cache_table_markdown(cfg: DeepseekV4Config, max_seq_len: int, dtype=jnp.bfloat16, batch: int = 1,
                         kv_cache_dtype: str = "auto") -> str:
    """`cache_table` as a markdown table, with a last row for the whole model (its layers summed)."""
    rows = cache_table(cfg, max_seq_len, dtype, batch, kv_cache_dtype)
    out = [f"| layer type | layers | bytes / token, one layer | fixed bytes, one layer | one layer at "
           f"{max_seq_len:,} tokens | all layers of the type |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {_SHORT[r['layer_type']]} | {r['layers']} | {r['bytes_per_token']:,g} | "
                   f"{r['fixed_bytes']:,} | {format_bytes(r['per_layer'])} | {format_bytes(r['total'])} |")
    total = sum(r["total"] for r in rows)
    out.append(f"| **model** | {sum(r['layers'] for r in rows)} | "
               f"{sum(r['bytes_per_token'] * r['layers'] for r in rows):,g} (all layers) | "
               f"{sum(r['fixed_bytes'] * r['layers'] for r in rows):,} (all layers) | | "
               f"**{format_bytes(total)}** ({total:,} bytes) |")
    return "\n".join(out)


def chunk_table_markdown(cfg: DeepseekV4Config, layer_types: str | Iterable[str], budgets: Sequence[int], *,
                         batch: int = 1, max_seq_len: int, dtype=jnp.bfloat16, **options) -> str:
    """`prefill_chunk_size` for each of `budgets` (bytes) as a markdown table: the chunk, its
    estimated memory, and the calls a prompt of `max_seq_len` tokens takes. `options`: the
    keywords of `prefill_chunk_size` (query_block, xla_scores, donated, residual)."""
    types = _layer_types(layer_types)
    out = ["| budget | chunk (tokens) | its estimated memory | calls for a prompt of "
           f"{max_seq_len:,} tokens |", "|---|---|---|---|"]
    for budget in budgets:
        chunk = prefill_chunk_size(cfg, types, batch, budget, dtype, max_seq_len=max_seq_len, **options)
        need = prefill_chunk_bytes(cfg, types, batch, chunk, max_seq_len, dtype,
                                   **{k: v for k, v in options.items() if k != "at_most"})
        out.append(f"| {format_bytes(budget)} | {chunk:,} | {format_bytes(need)} | {-(-max_seq_len // chunk)} |")
    return "\n".join(out)


# ---------------------------------------------------------------------------- a chunk's memory
def prefill_chunk_terms(cfg: DeepseekV4Config, layer_type: str, batch: int, chunk: int, max_seq_len: int,
                        dtype=jnp.bfloat16, *, query_block: int = QUERY_BLOCK, xla_scores: bool = True,
                        donated: bool = False, residual: bool = False, kv_cache_dtype: str = "auto") -> dict[str, int]:
    """An estimate of the device memory one call of `chunk` tokens holds, in named terms (bytes).

    A sum of the step's large temporaries, each counted as a separate buffer (XLA reuses some:
    on XLA:CPU the estimate was 1.3-5.3x what its buffer assignment reserves, tiny and small
    configs, chunks of 1 to 2048; `tests/tools/test_long_context.py` checks it bounds that from
    above). ``e`` is the compute dtype's size (`dtype`).

    Per token of the chunk (x B*S):

    * ``hidden``: the chunk's input and output [B, S, hidden] (with `residual`, also the residual
      stream's h and h + out of a stack);
    * ``projections``: the input GEMMs' output [B, S, Lq + D + compressor and indexer widths],
      then q_residual and kv normed (+ the indexer's float32 head weights);
    * ``queries``: [B, S, H, D] three times: q_b's output, normed and rotated, and the query
      blocks' copy (`backend.map_query_blocks`);
    * ``attention_output``: [B, S, H, D] three times: the blocks' stacked output, unblocked,
      de-rotated;
    * ``output_projection``: the grouped wo_a's [B, S, G, R];
    * ``keys``: the rotated keys and the pool [window | keys], and the int32 window indices [B, S, W];
    * ``compressors`` (CSA, HCA): per compressor, the [kv | gate] stream and its windows (x 4 in e)
      and the float32 slot logits, softmax and weights (x 3);
    * ``indexer_queries`` (CSA): the indexer queries [B, S, nI, c] twice, the picks [B, S, K] int32
      twice (a block's and the stacked), the visible counts.

    Per query of one query block (x B*min(S, query_block)): the blocks run one at a time:

    * ``attention_block``: the XLA path's gathered keys [B, s, W (+ K for CSA), D] and its float32
      logits, exponentials and probabilities over [B, s, H, W + K (CSA) | W + T (HCA) | W] plus
      the probabilities cast to e. (The Pallas kernel path on CUDA gathers nothing: an overestimate there.)
    * ``indexer_block`` (CSA): with `xla_scores` (``break_mode="none"`` without the native
      handler: `lax.top_k`) the scores' dot products [B, s, nI, T] float32; always [B, s, T]
      float32 three times (the summed scores, masked, the top-k's copy) and the picks.

    Once per layer:

    * ``cache_copy``: the new cache the step returns (in its `kv_cache_dtype`), unless the cache
      is `donated` (then XLA writes it in place);
    * ``dequantized_rows`` (``kv_cache_dtype="fp8"``): the rows the step reads whole, dequantized
      into the compute dtype (window, entries, indexer keys: `quantized_cache.read`), counted as
      the cache's size in that dtype.

    Arguments: `layer_type` one of the config's types; `max_seq_len` the cache's (it sets T);
    `xla_scores`: whether the indexer scores by XLA (see above); `residual`: the layer is one of
    a stack whose residual stream is carried along.
    """
    dt = jnp.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"dtype: expected a floating dtype, got {dt}")
    for name, value in (("batch", batch), ("chunk", chunk), ("max_seq_len", max_seq_len),
                        ("query_block", query_block)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    _config_with(cfg, layer_type)
    e, f32, i32 = dt.itemsize, 4, 4
    tokens = batch * chunk
    rows = batch * min(chunk, query_block)
    h, d, w, lq = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window, cfg.q_lora_rank
    compressed, csa = layer_type in (CSA, HCA), layer_type == CSA
    widths = [cfg.compressor_width(layer_type)] if compressed else []
    if csa:
        widths.append(cfg.compressor_width(CSA, indexer=True))
    n_i, k = cfg.index_n_heads, cfg.index_topk
    slots = cfg.entry_slots(layer_type, max_seq_len) if compressed else 0

    proj = lq + d + 2 * sum(widths) + (n_i if csa else 0)
    terms = {
        "hidden": tokens * (4 if residual else 2) * cfg.hidden_size * e,
        "projections": tokens * ((proj + lq + d) * e + (n_i * f32 if csa else 0)),
        "queries": tokens * 3 * h * d * e,
        "attention_output": tokens * 3 * h * d * e,
        "output_projection": tokens * cfg.o_groups * cfg.o_lora_rank * e,
        "keys": tokens * (2 * d * e + w * i32),
    }
    if compressed:
        terms["compressors"] = tokens * sum(4 * width * e + 3 * width * f32 for width in widths)
    if csa:
        terms["indexer_queries"] = tokens * (2 * n_i * cfg.index_head_dim * e + 2 * k * i32 + i32)
    attended = w + (k if csa else slots)
    gathered = w + (k if csa else 0)
    terms["attention_block"] = rows * (gathered * d * e + h * attended * (3 * f32 + e))
    if csa:
        terms["indexer_block"] = rows * ((n_i * slots * f32 if xla_scores else 0) + 3 * slots * f32 + 2 * k * i32)
    size = functools.partial(cache_bytes, cfg, layer_type, max_seq_len, batch=batch, dtype=dt)
    terms["cache_copy"] = 0 if donated else size(kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype == "fp8":
        terms["dequantized_rows"] = size()
    return {name: int(value) for name, value in terms.items()}


def _layer_types(layer_types) -> tuple[str, ...]:
    types = (layer_types,) if isinstance(layer_types, str) else tuple(dict.fromkeys(layer_types))
    if not types:
        raise ValueError("layer_types: expected at least one layer type, got none")
    return types


def prefill_chunk_bytes(cfg: DeepseekV4Config, layer_types: str | Iterable[str], batch: int, chunk: int,
                        max_seq_len: int, dtype=jnp.bfloat16, *, query_block: int = QUERY_BLOCK,
                        xla_scores: bool = True, donated: bool = False, residual: bool = False,
                        kv_cache_dtype: str = "auto") -> int:
    """The estimated device memory of one chunk (`prefill_chunk_terms` summed). For a stack of
    layers of several types (run one layer at a time), the largest layer type's; `residual`:
    the stack's residual stream is carried along."""
    return max(sum(prefill_chunk_terms(cfg, t, batch, chunk, max_seq_len, dtype, query_block=query_block,
                                       xla_scores=xla_scores, donated=donated, residual=residual,
                                       kv_cache_dtype=kv_cache_dtype).values())
               for t in _layer_types(layer_types))


def chunk_multiple(cfg: DeepseekV4Config, layer_types: str | Iterable[str], query_block: int = QUERY_BLOCK) -> int:
    """What `prefill_chunk_size` rounds chunks to: the least common multiple of the layers'
    compression ratios (every chunk then starts on a window boundary of every compressor: no
    chunk carries an unfinished window into the next, and chunk boundaries line up across
    layer types) and of the query block (the blocked stages run whole blocks: the last block of
    a chunk is not padded)."""
    ratios = [cfg.compress_rate(t) for t in _layer_types(layer_types) if cfg.compress_rate(t)]
    return math.lcm(query_block, *ratios)


def prefill_chunk_size(cfg: DeepseekV4Config, layer_types: str | Iterable[str], batch: int, memory_bytes: int,
                       dtype=jnp.bfloat16, *, max_seq_len: int, query_block: int = QUERY_BLOCK,
                       xla_scores: bool = True, donated: bool = False, residual: bool = False,
                       at_most: int | None = None, kv_cache_dtype: str = "auto") -> int:
    """The largest prefill chunk (tokens per call) whose estimated memory (`prefill_chunk_bytes`)
    fits `memory_bytes`.

    A multiple of `chunk_multiple` (the compression ratios' and the query block's least common
    multiple), or the whole of `at_most` (the prompt's length; default `max_seq_len`, as no
    call holds more) where all of it fits: a prompt that fits runs as one call. Monotone in
    `memory_bytes`. A budget too small for one multiple is a `ValueError` naming
    ``memory_bytes`` and what the smallest chunk needs.
    Chunks larger than a few query blocks save only per-call overhead (every query's work is
    the same in any chunk), so a budget far above the need changes little.
    """
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, (int, float, np.integer, np.floating)):
        raise TypeError(f"memory_bytes: expected a number of bytes, got {type(memory_bytes).__name__}")
    if not math.isfinite(memory_bytes):
        raise ValueError(f"memory_bytes: expected a finite number of bytes, got {memory_bytes!r}")
    types = _layer_types(layer_types)
    if at_most is not None and (isinstance(at_most, bool) or not isinstance(at_most, (int, np.integer))
                                or at_most < 1):
        raise ValueError(f"at_most: expected a positive int or None, got {at_most!r}")
    whole = int(max_seq_len if at_most is None else at_most)

    def need(chunk: int) -> int:
        return prefill_chunk_bytes(cfg, types, batch, chunk, max_seq_len, dtype, query_block=query_block,
                                   xla_scores=xla_scores, donated=donated, residual=residual,
                                   kv_cache_dtype=kv_cache_dtype)

    if need(whole) <= memory_bytes:
        return whole
    step = chunk_multiple(cfg, types, query_block)
    if need(step) > memory_bytes:
        raise ValueError(
            f"memory_bytes: expected at least {need(step):,} bytes (a prefill chunk of {step} tokens, the smallest "
            f"multiple of the compression ratios and the query block, of {'/'.join(_SHORT[t] for t in types)} "
            f"layers at batch {batch}, max_seq_len {max_seq_len}, {jnp.dtype(dtype).name}), got {int(memory_bytes):,}; "
            "free device memory, lower the batch or the layer's query_block, or pass chunk_size yourself"
        )
    # Largest k with need(k * step) within the budget: double, then bisect (need grows with k;
    # need(whole) is over the budget, so the doubling ends by then).
    lo, hi = 1, 2
    while need(hi * step) <= memory_bytes:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if need(mid * step) <= memory_bytes else (lo, mid)
    return lo * step


# ---------------------------------------------------------------------------- the chunked prefill
def available_memory_bytes(device=None) -> int:
    """The bytes `prefill` budgets on `device` (default: jax's first device): its free memory
    (``bytes_limit - bytes_in_use`` of `Device.memory_stats()`) times `FREE_MEMORY_FRACTION`,
    or `DEFAULT_MEMORY_BYTES` where the device reports no memory (XLA:CPU)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # a backend without the query
        stats = None
    if not stats or "bytes_limit" not in stats:
        return DEFAULT_MEMORY_BYTES
    return int(FREE_MEMORY_FRACTION * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))


def _device_of(cache: AttentionCache):
    devices = getattr(cache.window, "devices", None)
    return next(iter(devices()), None) if callable(devices) else None


def indexer_scores_by_xla(layer) -> bool:
    """Whether a layer's indexer scores [B, block, nI, T] come from XLA dot products (its plan
    neither breaks to the host nor runs the native handler)."""
    if layer.layer_type != CSA:
        return False
    plan = layer.step_spec().plan
    return plan.mode == "none" and not plan.native_select


def auto_chunk_size(layers: Sequence, caches: Sequence[AttentionCache], hidden_states,
                    memory_bytes: int | None = None) -> int:
    """The chunk `prefill` takes without `chunk_size`: `prefill_chunk_size` for these layers
    (their compute dtype, query block and indexer path), the caches' batch and `max_seq_len`,
    at most the prompt's length, within `memory_bytes` (default `available_memory_bytes` of the
    caches' device) less what the prefill keeps: the returned caches (new buffers, unless every
    layer donates its cache) and, for a `jax.Array` prompt, the output [B, N, hidden]."""
    batch, total = hidden_states.shape[:2]
    if memory_bytes is None:
        memory_bytes = available_memory_bytes(_device_of(caches[0]))
    donated = all(layer.donate_cache for layer in layers)
    kept = 0 if donated else sum(cache_nbytes(c) for c in caches)
    if not isinstance(hidden_states, np.ndarray):
        out_dtype = jnp.result_type(hidden_states.dtype, *(layer.compute_dtype for layer in layers))
        kept += batch * total * hidden_states.shape[2] * jnp.dtype(out_dtype).itemsize
    widest = max((jnp.dtype(x.compute_dtype) for x in layers), key=lambda dt: dt.itemsize)
    try:
        return prefill_chunk_size(
            layers[0].config, [x.layer_type for x in layers], batch, memory_bytes - kept, widest,
            max_seq_len=max(c.max_seq_len for c in caches), query_block=max(x.query_block for x in layers),
            xla_scores=any(indexer_scores_by_xla(x) for x in layers), donated=donated,
            residual=len(layers) > 1, at_most=total,
            kv_cache_dtype="fp8" if any(is_quantized(c) for c in caches) else "auto")
    except ValueError as err:
        raise ValueError(f"{err} (of memory_bytes={int(memory_bytes):,}, {kept:,} are kept for the returned "
                         "caches and output)") from None


def _write_chunk(out, piece, start):
    """`out` [B, N, hidden] with `piece` [B, S, hidden] written at token `start`."""
    return jax.lax.dynamic_update_slice(out, piece.astype(out.dtype), (0, start, 0))


# `prefill`'s output buffer is donated: each chunk is written in place, no copy of the whole output.
_WRITE_CHUNK = jax.jit(_write_chunk, donate_argnums=0)


def _check_prefill(layers, hidden_states, caches) -> None:
    if not layers:
        raise ValueError("layers: expected a DeepseekV4Attention or a non-empty sequence of them, got none")
    for i, layer in enumerate(layers):
        if not isinstance(layer, DeepseekV4Attention):
            raise TypeError(f"layers[{i}]: expected a DeepseekV4Attention, got {type(layer).__name__}")
    if len(caches) != len(layers):
        raise ValueError(f"caches: expected one cache per layer ({len(layers)}), got {len(caches)}")
    for i, cache in enumerate(caches):
        if not isinstance(cache, AttentionCache):
            raise TypeError(f"caches[{i}]: expected an AttentionCache from init_cache, got {type(cache).__name__}")
    if not isinstance(hidden_states, (np.ndarray, jax.Array)):
        raise TypeError(f"hidden_states: expected an array, got {type(hidden_states).__name__}")
    if hidden_states.ndim != 3 or hidden_states.shape[1] < 1:
        raise ValueError(f"hidden_states: expected shape [B, N, {layers[0].config.hidden_size}] with N >= 1, "
                         f"got {list(hidden_states.shape)}")
    # Room for the whole prompt, before any chunk runs (the layer checks each call; this refuses a
    # prompt that would fail halfway, after minutes of work). The host mirror of an eager cache.
    total = hidden_states.shape[1]
    for i, cache in enumerate(caches):
        length = np.asarray(cache.length)
        if int(length.max()) + total > cache.max_seq_len:
            raise ValueError(f"hidden_states: expected at most {cache.max_seq_len - int(length.max())} new tokens "
                             f"(cache {i} holds {int(length.max())} of max_seq_len={cache.max_seq_len}), got {total}")


def prefill(layers, hidden_states, caches, *, chunk_size: int | None = None, memory_bytes: int | None = None):
    """Run a prompt through a layer, or through a stack of layers, in chunks; return what one
    call returns.

    layers:        a `DeepseekV4Attention`, or a sequence of them: a model's attention layers in
                   order, each adding its output to the residual stream (``h = h + layer(h)``, as a
                   model's blocks do; the rest of a block, its norms and MoE, is not here)
    hidden_states: [B, N, hidden], a `jax.Array` or NumPy array: every row's next N tokens, all
                   real, each row continuing its cache (as ``attn(x, None, cache)``)
    caches:        the layer's cache, or one per layer (from ``init_cache``)
    chunk_size:    tokens per call; None: `auto_chunk_size`, the largest chunk whose estimated
                   memory fits `memory_bytes` (`prefill_chunk_size`)
    memory_bytes:  the device memory the prefill may use beyond what is allocated (the returned
                   caches and output included); None: `available_memory_bytes` of the caches' device
                   (90% of its free memory, or `DEFAULT_MEMORY_BYTES` = 1 GiB where the device
                   reports none, as XLA:CPU)
    returns        one layer: ``(out [B, N, hidden], cache)``, as ``attn(hidden_states, None,
                   cache)``; a sequence: ``(h [B, N, hidden], caches)``, the residual stream after
                   the last layer (``hidden_states`` plus every layer's output) and the caches.
                   NumPy in, NumPy out: then the device holds one chunk of input and output at a
                   time; a `jax.Array` prompt gets a `jax.Array` output, written chunk by chunk
                   into one buffer.

    Each chunk is one call of each layer (the module call: its checks, its compiled step; one
    compile per chunk length, so the last, shorter chunk compiles once more). The result equals
    one call's within float32 rounding, every cache leaf included (chunk invariance; tested at
    the chunk sizes this takes in `tests/tools/test_long_context.py`). The caches passed in stay
    valid unless the layers donate their caches (``donate_cache=True``); a prompt longer than a
    cache's room is refused before any chunk runs (`ValueError` naming ``hidden_states``).
    """
    single = isinstance(layers, DeepseekV4Attention)
    layer_list = [layers] if single else list(layers)
    cache_list = [caches] if single else list(caches)
    _check_prefill(layer_list, hidden_states, cache_list)
    batch, total, hidden = hidden_states.shape
    if chunk_size is None:
        chunk_size = auto_chunk_size(layer_list, cache_list, hidden_states, memory_bytes)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")
    chunk_size = min(int(chunk_size), total)
    on_host = isinstance(hidden_states, np.ndarray)
    out, pending = None, None
    for start in range(0, total, chunk_size):
        x = hidden_states[:, start:start + chunk_size]
        piece = x if single else jnp.asarray(x)  # a stack's residual stream h, on the device
        for i, layer in enumerate(layer_list):
            o, cache_list[i] = layer(piece, None, cache_list[i])
            piece = o if single else piece + o
        if on_host:
            if out is None:
                out = np.empty((batch, total, hidden), np.dtype(piece.dtype))
            if pending is not None:  # the previous chunk's output, read while this one computes
                out[:, pending[0]:pending[0] + pending[1].shape[1]] = np.asarray(pending[1])
            pending = (start, piece)
        else:
            if out is None:
                out = jnp.zeros((batch, total, hidden), piece.dtype)
            out = _WRITE_CHUNK(out, piece, np.int32(start))
    if pending is not None:
        out[:, pending[0]:] = np.asarray(pending[1])
    return (out, cache_list[0]) if single else (out, cache_list)


def readme_tables() -> list[str]:
    """The tables of docs/long_context.md, computed: the caches of V4-Flash and V4-Pro at
    1,048,576 tokens (bf16, one sequence), V4-Flash's FP8 caches (``kv_cache_dtype="fp8"``),
    how many sequences of 128k-1M tokens 120 GiB of caches hold in either format, and
    `prefill_chunk_size` for a V4-Flash stack of CSA and HCA layers (bf16, B = 1, a
    1,048,576-token cache, the caches donated, the native indexer as on a GPU where it is
    built) within 16, 40 and 100 GiB. `python -m dsv4_jax.tools.long_context` prints them;
    `tests/tools/test_long_context.py` checks docs/long_context.md holds them."""
    context = 1 << 20
    flash = DeepseekV4Config.flash()
    return [
        cache_table_markdown(flash, context),
        cache_table_markdown(DeepseekV4Config.pro(), context),
        cache_table_markdown(flash, context, kv_cache_dtype="fp8"),
        capacity_table_markdown(flash, [131072, 262144, 524288, context], 120 << 30),
        chunk_table_markdown(flash, [CSA, HCA], [16 << 30, 40 << 30, 100 << 30], max_seq_len=context,
                             xla_scores=False, donated=True, residual=True),
    ]


if __name__ == "__main__":
    print("\n\n".join(readme_tables()))


__all__ = [
    "DEFAULT_MEMORY_BYTES",
    "FREE_MEMORY_FRACTION",
    "auto_chunk_size",
    "available_memory_bytes",
    "cache_bytes",
    "cache_bytes_per_token",
    "cache_fixed_bytes",
    "cache_table",
    "cache_table_markdown",
    "capacity_table_markdown",
    "chunk_multiple",
    "chunk_table_markdown",
    "format_bytes",
    "indexer_scores_by_xla",
    "prefill",
    "prefill_chunk_bytes",
    "prefill_chunk_size",
    "prefill_chunk_terms",
    "readme_tables",
    "rows_that_fit",
]
