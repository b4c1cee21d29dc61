"""Long context (issue 29): the chunked prefill, the boundaries serving engines hit, what a cache
costs per token, the chunk sizing, the position limit, and the stack benchmark's chunked prefill.

Contract under test: `long_context.prefill` of a prompt in chunks returns what one call returns
(outputs within float32 rounding, every cache leaf, the lengths exactly), for every layer type
and for a stack of layers; a prompt may start and end at any residue of the compression ratios.

Compile time dominates, so every layer runs the same few call lengths: one call of N = 43
tokens (5 * 8 + 3: residue 3 modulo the CSA ratio 4 and the HCA ratio 8), chunks of 8 (every
chunk boundary on a window edge: W = m' = 8) and 13 (boundaries inside windows) with their
remainders 3 and 4, and single tokens. The layers use a query block of 8, so the chunks are
query-blocked too, and `prefill_chunk_size` rounds to 8 (the ratios' and the block's lcm).
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_layer

from dsv4_jax import DeepseekV4Attention, DeepseekV4Config
from dsv4_jax.cache.contiguous import cache_nbytes, init_attention_cache
from dsv4_jax.config import CSA, HCA, SLIDING
from dsv4_jax.tools import long_context

ROOT = Path(__file__).resolve().parents[2]
CFG = DeepseekV4Config.tiny()  # window 8, CSA m = 4, HCA m' = 8, top-k 4, max_position_embeddings 4096
LAYERS = {"sliding": 0, "csa": 1, "hca": 2}
QUERY_BLOCK = 8
BATCH, MAX_LEN, N = 2, 64, 43
TOL = 1e-5


@functools.cache
def layer(name: str) -> DeepseekV4Attention:
    return random_layer(CFG, LAYERS[name], query_block=QUERY_BLOCK)


@functools.cache
def prompt() -> np.ndarray:
    return np.random.default_rng(29).normal(size=(BATCH, N, CFG.hidden_size)).astype(np.float32)


@functools.cache
def one_call(name: str):
    """The reference: the whole prompt in one call (outputs [B, N, hidden], cache)."""
    attn = layer(name)
    out, cache = attn(jnp.asarray(prompt()), None, attn.init_cache(BATCH, MAX_LEN))
    return np.asarray(out), cache


@functools.cache
def token_by_token(name: str) -> list:
    """The caches after each token fed alone: caches[n] holds the first n tokens."""
    attn = layer(name)
    caches = [attn.init_cache(BATCH, MAX_LEN)]
    for t in range(N):
        _, cache = attn(jnp.asarray(prompt()[:, t:t + 1]), None, caches[-1])
        caches.append(cache)
    return caches


def assert_outputs_close(out, ref):
    err = np.abs(np.asarray(out, np.float32) - ref).max() / np.abs(ref).max()
    assert err < TOL, err


def assert_caches_close(cache, ref):
    """Every leaf within float32 rounding (entries are float sums in another order), lengths exact."""
    np.testing.assert_array_equal(np.asarray(cache.length), np.asarray(ref.length))
    assert (cache.layer_idx, cache.layer_type, cache.max_seq_len) == (ref.layer_idx, ref.layer_type, ref.max_seq_len)
    leaves = jax.tree_util.tree_leaves_with_path(cache.replace(length=None))
    for (path, a), b in zip(leaves, jax.tree.leaves(ref.replace(length=None)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=TOL, atol=TOL,
                                   err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------- chunked prefill
@pytest.mark.parametrize("chunk", [8, 13])
@pytest.mark.parametrize("name", ["sliding", "csa", "hca"])
def test_prefill_in_chunks_equals_one_call(name, chunk):
    """Chunks of 8 end on every window's edge (the first HCA entry completes exactly at the
    first chunk's end); chunks of 13 cut windows (CSA's, HCA's and the sliding one) anywhere.
    A NumPy prompt gets a NumPy output, a device prompt a device output."""
    attn = layer(name)
    x = prompt() if chunk == 13 else jnp.asarray(prompt())
    cache = attn.init_cache(BATCH, MAX_LEN)
    out, new = long_context.prefill(attn, x, cache, chunk_size=chunk)
    assert isinstance(out, np.ndarray) == (chunk == 13) and out.shape == (BATCH, N, CFG.hidden_size)
    ref_out, ref_cache = one_call(name)
    assert_outputs_close(out, ref_out)
    assert_caches_close(new, ref_cache)
    assert int(np.asarray(cache.length).max()) == 0  # the cache passed in is left as it was


def test_prefill_of_a_stack_equals_one_call_per_layer():
    """A stack: the residual stream h = h + layer(h) chunk by chunk, as a model prefills."""
    layers = [layer(n) for n in LAYERS]
    h = jnp.asarray(prompt())
    ref_caches = []
    for attn in layers:
        out, cache = attn(h, None, attn.init_cache(BATCH, MAX_LEN))
        h = h + out
        ref_caches.append(cache)
    out, caches = long_context.prefill(layers, prompt(), [a.init_cache(BATCH, MAX_LEN) for a in layers],
                                       chunk_size=13)
    assert_outputs_close(out, np.asarray(h))
    for cache, ref in zip(caches, ref_caches, strict=True):
        assert_caches_close(cache, ref)


@pytest.mark.parametrize("name", ["csa", "hca"])
def test_prompts_start_and_end_at_every_residue(name):
    """A serving engine's boundaries: a prompt after r tokens (a conversation's second turn),
    for every r in 0 .. 7, of 30 tokens in chunks of 13: it starts, its chunks cut and it ends at
    every residue modulo 4 (CSA) and 8 (HCA), e.g. 4k + 3. Equal to one call (outputs) and to
    the tokens fed one by one (every cache leaf), and decoding goes on from it."""
    attn = layer(name)
    ref_out, _ = one_call(name)
    caches = token_by_token(name)
    x = prompt()
    ends = set()
    for r in range(8):
        cache = attn.init_cache(BATCH, MAX_LEN)
        for t in range(r):
            _, cache = attn(x[:, t:t + 1], None, cache)
        out, cache = long_context.prefill(attn, x[:, r:r + 30], cache, chunk_size=13)
        assert_outputs_close(out, ref_out[:, r:r + 30])
        assert_caches_close(cache, caches[r + 30])
        step, cache = attn(x[:, r + 30:r + 31], None, cache)  # the next token decodes from it
        assert_outputs_close(step, ref_out[:, r + 30:r + 31])
        assert_caches_close(cache, caches[r + 31])
        ends.add((r + 30) % 8)
    assert ends == set(range(8))


@pytest.mark.parametrize("name", ["csa", "hca"])
def test_the_first_compressed_entry(name):
    """A prompt shorter than the first window (3 tokens: no entry), a chunk that completes CSA's
    first entry inside it (4 more: 7 tokens, HCA one short), then the decode token that completes
    HCA's: outputs and caches as the one call's / token by token's at each point; no entry
    before its window is complete."""
    attn = layer(name)
    ratio = CFG.compress_rate(attn.layer_type)
    ref_out, _ = one_call(name)
    caches = token_by_token(name)
    x = prompt()
    cache, start = attn.init_cache(BATCH, MAX_LEN), 0
    for n in (3, 4, 1):
        out, cache = long_context.prefill(attn, x[:, start:start + n], cache)
        assert_outputs_close(out, ref_out[:, start:start + n])
        start += n
        assert_caches_close(cache, caches[start])
        entries = np.asarray(cache.compressor.entries)
        written = start // ratio
        assert (np.abs(entries[:, :written]).sum(axis=-1) > 0).all()
        assert not entries[:, written:].any(), f"an entry past {written} after {start} tokens"


def test_prefill_refuses_a_prompt_longer_than_the_room_before_running():
    attn = layer("csa")
    cache = attn.init_cache(BATCH, 40)
    with pytest.raises(ValueError, match=r"hidden_states: expected at most 40 new tokens \(cache 0 holds 0 of "
                                         r"max_seq_len=40\), got 43"):
        long_context.prefill(attn, prompt(), cache, chunk_size=8)
    with pytest.raises(ValueError, match=r"chunk_size: expected a positive int or None, got 0"):
        long_context.prefill(attn, prompt(), attn.init_cache(BATCH, MAX_LEN), chunk_size=0)
    with pytest.raises(ValueError, match=r"caches: expected one cache per layer \(2\), got 1"):
        long_context.prefill([attn, attn], prompt(), [cache])


# ---------------------------------------------------------------------------- chunk sizing
def test_auto_chunk_size_fits_the_budget_and_prefills_alike():
    """Without `chunk_size`, the chunk is the largest multiple of 8 whose estimate fits the
    budget left after the returned caches and output; the result is still the one call's."""
    attn = layer("hca")
    cache = attn.init_cache(BATCH, MAX_LEN)
    kept = cache_nbytes(cache) + BATCH * N * CFG.hidden_size * 4  # the returned cache, the output
    need = functools.partial(long_context.prefill_chunk_bytes, CFG, HCA, BATCH, max_seq_len=MAX_LEN,
                             dtype=jnp.float32, query_block=QUERY_BLOCK)
    budget = kept + need(8) + (need(16) - need(8)) // 2
    x = jnp.asarray(prompt())
    assert long_context.auto_chunk_size([attn], [cache], x, budget) == 8
    out, new = long_context.prefill(attn, x, cache, memory_bytes=budget)
    ref_out, ref_cache = one_call("hca")
    assert_outputs_close(out, ref_out)
    assert_caches_close(new, ref_cache)
    assert long_context.auto_chunk_size([attn], [cache], x, kept + need(N)) == N  # all of it: one call
    with pytest.raises(ValueError, match=r"memory_bytes: expected at least [\d,]+ bytes \(a prefill chunk of 8 "
                                         r"tokens.* of HCA layers at batch 2, max_seq_len 64, float32\), got "):
        long_context.prefill(attn, x, cache, memory_bytes=kept + need(8) - 1)
    with pytest.raises(ValueError) as err:  # the misuse table (docs/misuse.md) quotes this message
        long_context.prefill_chunk_size(CFG, HCA, BATCH, need(8) - 1, jnp.float32, max_seq_len=MAX_LEN,
                                        query_block=QUERY_BLOCK)
    assert f"`{err.value}`" in (ROOT / "docs" / "misuse.md").read_text()


def test_chunk_size_is_monotone_in_memory_and_a_multiple():
    flash = DeepseekV4Config.flash()
    layer_types = [CSA, HCA]
    kwargs = dict(max_seq_len=1 << 20, xla_scores=False, donated=True, residual=True)
    step = long_context.chunk_multiple(flash, layer_types)
    assert step == 256  # lcm(4, 128, the query block 256)
    chunks = [long_context.prefill_chunk_size(flash, layer_types, 1, budget, **kwargs)
              for budget in np.geomspace(4e9, 200e9, 12)]
    assert chunks == sorted(chunks) and chunks[0] < chunks[-1]
    assert all(c % step == 0 for c in chunks)
    for budget, chunk in zip(np.geomspace(4e9, 200e9, 12), chunks):
        assert long_context.prefill_chunk_bytes(flash, layer_types, 1, chunk, dtype=jnp.bfloat16, **kwargs) <= budget
        assert long_context.prefill_chunk_bytes(flash, layer_types, 1, chunk + step, dtype=jnp.bfloat16,
                                                **kwargs) > budget
    assert long_context.prefill_chunk_size(flash, layer_types, 1, 200e9, at_most=1000, **kwargs) == 1000
    with pytest.raises(ValueError, match=r"memory_bytes: expected at least [\d,]+ bytes \(a prefill chunk of 256 "
                                         r"tokens.*CSA/HCA layers at batch 1, max_seq_len 1048576, bfloat16\), "
                                         r"got 1,000,000; .*pass chunk_size yourself"):
        long_context.prefill_chunk_size(flash, layer_types, 1, 1e6, **kwargs)
    # The XLA scoring path holds [B, block, nI, T] float32 scores: more memory, smaller chunks.
    with_xla = long_context.prefill_chunk_size(flash, layer_types, 1, 40e9, **{**kwargs, "xla_scores": True})
    assert with_xla < long_context.prefill_chunk_size(flash, layer_types, 1, 40e9, **kwargs)


@pytest.mark.parametrize("name", ["sliding", "csa", "hca"])
def test_the_chunk_estimate_bounds_what_xla_allocates(name):
    """`prefill_chunk_bytes` bounds XLA:CPU's own reservation for the step (temporaries and
    outputs, the returned cache included), and stays within 4x of it (measured 1.3-5x over
    tiny and small configs, chunks of 1 to 2048; larger where XLA:CPU fuses the indexer's scores)."""
    from dsv4_jax.step.pure_step import step_function

    attn = random_layer(CFG, LAYERS[name], break_mode="none", kernels="xla", query_block=QUERY_BLOCK)
    cache = jax.eval_shape(lambda: attn.init_cache(BATCH, MAX_LEN)).replace(
        layer_idx=-1, length=jax.ShapeDtypeStruct((BATCH,), jnp.int32))
    compiled = step_function(False).lower(
        attn.step_weights(), cache, jax.ShapeDtypeStruct((BATCH, N, CFG.hidden_size), jnp.float32),
        jax.ShapeDtypeStruct((BATCH, N), jnp.int32), spec=attn.step_spec()).compile()
    stats = compiled.memory_analysis()
    xla = stats.temp_size_in_bytes + stats.output_size_in_bytes
    estimate = long_context.prefill_chunk_bytes(CFG, attn.layer_type, BATCH, N, MAX_LEN, jnp.float32,
                                                query_block=QUERY_BLOCK)
    assert xla <= estimate <= 4 * xla, (estimate, xla)


# ---------------------------------------------------------------------------- cache memory
def test_cache_bytes_per_token_from_the_real_leaves():
    flash = DeepseekV4Config.flash()
    # CSA: a 512-wide entry and a 128-wide indexer key per 4 tokens; HCA: one 512-wide entry per 128.
    assert long_context.cache_bytes_per_token(flash, CSA) == (512 + 128) * 2 / 4 == 320
    assert long_context.cache_bytes_per_token(flash, HCA) == 512 * 2 / 128 == 8
    assert long_context.cache_bytes_per_token(flash, SLIDING) == 0
    assert long_context.cache_bytes_per_token(CFG, CSA, jnp.float32) == (32 + 16) * 4 / 4
    # Fixed: the window ring (128 x 512), the compressors' rings (CSA: 8 tokens of [kv | gate] 2 x
    # 1024 wide, the indexer's 8 x 2 x 256; HCA: 128 x 2 x 512), the int32 length.
    assert long_context.cache_fixed_bytes(flash, SLIDING) == 128 * 512 * 2 + 4
    assert long_context.cache_fixed_bytes(flash, CSA) == (128 * 512 + 8 * 2048 + 8 * 512) * 2 + 4
    assert long_context.cache_fixed_bytes(flash, HCA) == (128 * 512 + 128 * 1024) * 2 + 4
    for layer_type in (SLIDING, CSA, HCA):
        for length in (1 << 12, 1 << 20):
            per_token = long_context.cache_bytes_per_token(flash, layer_type)
            assert long_context.cache_bytes(flash, layer_type, length, batch=3) == 3 * (
                long_context.cache_fixed_bytes(flash, layer_type) + per_token * length)
    # The layer's own cache has these bytes.
    attn = layer("csa")
    assert cache_nbytes(attn.init_cache(BATCH, MAX_LEN)) == long_context.cache_bytes(
        CFG, CSA, MAX_LEN, batch=BATCH, dtype=jnp.float32)


def dequantized(cache):
    """The cache with its FP8 rows read back (`quantized_cache.read`): float arrays to compare."""
    from dsv4_jax.cache.quantized import read

    def comp(c):
        return None if c is None else c.replace(entries=read(c.entries))

    return cache.replace(window=read(cache.window), compressor=comp(cache.compressor), indexer=comp(cache.indexer))


def test_fp8_caches_bytes_and_chunked_prefill():
    """FP8 caches (`quantized_cache`): a V4-Flash main KV row of 448 + 7 scale bytes + 64 bf16
    RoPE values, an indexer key of 64 + 4 (two e2m1 codes a byte); the chunk estimate counts the FP8 copy and the rows
    dequantized for reading; a prompt by chunks into FP8 caches equals one call, bit for bit."""
    flash = DeepseekV4Config.flash()
    assert long_context.cache_bytes_per_token(flash, CSA, kv_cache_dtype="fp8") == (583 + 68) / 4
    assert long_context.cache_bytes_per_token(flash, HCA, kv_cache_dtype="fp8") == 583 / 128
    # What a memory holds: whole rows only, and about twice as many with FP8 caches.
    for kv in ("auto", "fp8"):
        per_row = sum(r["total"] for r in long_context.cache_table(flash, 1 << 20, kv_cache_dtype=kv))
        rows = long_context.rows_that_fit(flash, 1 << 20, 120 << 30, kv_cache_dtype=kv)
        assert rows * per_row <= 120 << 30 < (rows + 1) * per_row
    assert long_context.rows_that_fit(flash, 1 << 20, 120 << 30, kv_cache_dtype="fp8") == 2 * 17
    terms = long_context.prefill_chunk_terms(flash, CSA, 1, 4096, 1 << 20, kv_cache_dtype="fp8")
    assert terms["cache_copy"] == long_context.cache_bytes(flash, CSA, 1 << 20, kv_cache_dtype="fp8")
    assert terms["dequantized_rows"] == long_context.cache_bytes(flash, CSA, 1 << 20)
    attn = random_layer(CFG, LAYERS["csa"], query_block=QUERY_BLOCK, numerics="official")
    x = prompt()
    positions = jnp.asarray(np.broadcast_to(np.arange(N, dtype=np.int32), (BATCH, N)))
    one, one_cache = attn(jnp.asarray(x), positions, attn.init_cache(BATCH, MAX_LEN, kv_cache_dtype="fp8"))
    plain_out, _ = attn(jnp.asarray(x), positions, attn.init_cache(BATCH, MAX_LEN))
    np.testing.assert_array_equal(np.asarray(one), np.asarray(plain_out))  # lossless
    for chunk in (8, None):  # None: the chunk from the memory estimate
        out, cache = long_context.prefill(attn, x, attn.init_cache(BATCH, MAX_LEN, kv_cache_dtype="fp8"),
                                          chunk_size=chunk)
        assert_outputs_close(out, one)
        assert_caches_close(dequantized(cache), dequantized(one_cache))


def test_the_documented_figures_are_computed():
    """The tables of docs/long_context.md are what the functions compute (regenerate with
    ``python -m dsv4_jax.tools.long_context``)."""
    section = (ROOT / "docs" / "long_context.md").read_text()
    for block in long_context.readme_tables():
        assert block in section, block


# ---------------------------------------------------------------------------- position limit
def test_max_seq_len_past_the_models_positions_needs_an_opt_in():
    attn = layer("hca")
    assert attn.init_cache(1, CFG.max_position_embeddings).max_seq_len == 4096  # the last position is allowed
    message = (r"max_seq_len: expected at most config.max_position_embeddings=4096 \(the positions the model was "
               r"trained for\), got 4097; pass allow_long_context=True to init_cache")
    with pytest.raises(ValueError, match=message):
        attn.init_cache(1, 4097)
    with pytest.raises(ValueError, match=message):
        init_attention_cache(CFG, 2, 1, 4097, jnp.float32)
    cache = attn.init_cache(1, 4097, allow_long_context=True)
    assert cache.max_seq_len == 4097 and cache.compressor.entries.shape[1] == 4097 // 8
    assert init_attention_cache(CFG, 2, 1, 4097, jnp.float32, allow_long_context=True).max_seq_len == 4097
    with pytest.raises(TypeError, match="allow_long_context: expected a bool, got str"):
        attn.init_cache(1, 16, allow_long_context="yes")


# ---------------------------------------------------------------------------- the stack benchmark
def test_the_stack_benchmark_prefills_in_chunks():
    """`bench/stack.py --prefill-chunk N|auto`: the stack_prefill record of a chunked prompt."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import stack

    parser = stack.build_parser()
    assert parser.parse_args(["--prefill-chunk", "auto"]).prefill_chunk == "auto"
    assert parser.parse_args(["--prefill-chunk", "16", "--prefill-memory", "4e10"]).prefill_memory == 4e10
    assert parser.parse_args([]).prefill_chunk is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill-chunk", "0"])

    st = stack.Stack(stack.stack_config("tiny", 2), "mixed", 2, "float32", 0, "none")
    rec = stack.time_prefill(st, 1, 40, 1, 0, chunk=16)
    assert (rec["chunk"], rec["chunks"], rec["chunk_auto"], rec["max_seq_len"]) == (16, 3, False, 128)
    assert rec["per_layer_ms"] == pytest.approx(rec["step_ms"] / 2) and rec["output_finite"]
    assert rec["floor_ms"] == pytest.approx(sum(st.floor(1, s, n)["floor_ms"] for s, n in ((0, 16), (16, 16),
                                                                                             (32, 8))))
    assert rec["chunk_estimate_bytes"] > 0 and rec["cache_bytes"] == sum(
        cache_nbytes(c) for c in st.empty_caches(1, 128))
    assert {"peak_bytes_in_use", "bytes_limit", "bytes_in_use_before"} <= rec.keys()
    chunk, fields = stack.prefill_chunk_for(st, 1, 40, 128, "auto", memory_bytes=1 << 30)
    assert chunk == 40 and fields["chunk_auto"] and fields["memory_budget_bytes"] == 1 << 30
    assert re.search("chunk", stack.build_parser().format_help())
