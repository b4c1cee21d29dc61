"""FP8 caches (`dsv4_jax.cache.quantized`): lossless for the official numerics, half the bytes.

The contract: a layer with ``numerics="official"`` gives the same outputs and picks with
``kv_cache_dtype="fp8"`` as with its bf16 (here: float32) cache, bit for bit, in prefill
chunks, decode steps, ragged calls and every break mode; every stored row dequantizes to the
row the other cache holds; the cache takes about half the bytes.
"""

from __future__ import annotations

import helpers
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dsv4_jax import DeepseekV4Config, numerics
from dsv4_jax.cache.contiguous import cache_nbytes, reset_rows
from dsv4_jax.cache.quantized import QuantizedRows, quantized_zeros, read
from dsv4_jax.config import CSA

LAYERS = pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])


def _runs(attn, kv_cache_dtype: str, schedule=(13, 13, 13, 1, 1, 1), batch: int = 2, jit: bool = False):
    """Calls of `attn` over a random input in chunks of `schedule` (outputs, caches, picks): by
    default a prefill, two prefills continuing mid-window and decode steps in two call lengths
    (each compiles a step per layer, mode and cache kind)."""
    cfg = attn.config
    x = np.random.default_rng(4).normal(size=(batch, sum(schedule), cfg.hidden_size)).astype(np.float32)
    cache = attn.init_cache(batch, 64, kv_cache_dtype=kv_cache_dtype)
    runs, start = [], 0
    for n in schedule:
        pos = np.broadcast_to(np.arange(start, start + n, dtype=np.int32), (batch, n))
        out, cache, inter = attn(jnp.asarray(x[:, start:start + n]), jnp.asarray(pos), cache,
                                 return_intermediates=True)
        runs.append((np.asarray(out), cache, None if inter.topk is None else np.asarray(inter.topk)))
        start += n
    return runs


def _assert_same_rows(quantized, plain, what: str):
    assert isinstance(quantized, QuantizedRows), what
    np.testing.assert_array_equal(np.asarray(read(quantized)), np.asarray(plain), err_msg=what)


@LAYERS
def test_fp8_cache_gives_the_bf16_caches_outputs_and_picks_bit_for_bit(layer):
    cfg = DeepseekV4Config.tiny()
    attn = helpers.random_layer(cfg, layer, seed=3, numerics="official")
    for (out_p, cache_p, picks_p), (out_q, cache_q, picks_q) in zip(_runs(attn, "auto"), _runs(attn, "fp8")):
        np.testing.assert_array_equal(out_q, out_p)
        np.testing.assert_array_equal(picks_q, picks_p)
        _assert_same_rows(cache_q.window, cache_p.window, "window")
        if cache_p.compressor is not None:
            _assert_same_rows(cache_q.compressor.entries, cache_p.compressor.entries, "compressor.entries")
            np.testing.assert_array_equal(np.asarray(cache_q.compressor.buffer), np.asarray(cache_p.compressor.buffer))
        if cache_p.indexer is not None:
            _assert_same_rows(cache_q.indexer.entries, cache_p.indexer.entries, "indexer.entries")
        np.testing.assert_array_equal(np.asarray(cache_q.length), np.asarray(cache_p.length))


def test_fp8_cache_agrees_in_every_break_mode():
    cfg = DeepseekV4Config.tiny()
    base = _runs(helpers.random_layer(cfg, 1, seed=3, numerics="official", **helpers.EXECUTIONS["none"]), "auto")
    for mode in helpers.EXECUTIONS:
        if not helpers.runnable(mode):
            continue
        attn = helpers.random_layer(cfg, 1, seed=3, numerics="official", **helpers.EXECUTIONS[mode])
        for (out_b, _, picks_b), (out, _, picks) in zip(base, _runs(attn, "fp8")):
            np.testing.assert_array_equal(picks, picks_b, err_msg=mode)
            np.testing.assert_allclose(out, out_b, rtol=1e-6, atol=1e-6, err_msg=mode)


def test_fp8_cache_in_bf16_under_a_users_jit_and_for_ragged_rows():
    """bf16 compute (the V4-Flash dtype), the raw step jitted by the caller, a ragged call (row 1
    pads its last 5 slots) and a reset row: still the bf16 cache's values."""
    cfg = DeepseekV4Config.tiny()
    attn = helpers.random_layer(cfg, 1, seed=5, numerics="official", param_dtype=jnp.bfloat16)
    @nnx.jit
    def step(layer, cache, hidden, positions):
        return layer(hidden, positions, cache)

    x = jnp.asarray(np.random.default_rng(7).normal(size=(2, 24, cfg.hidden_size)), jnp.bfloat16)
    pos = np.broadcast_to(np.arange(24, dtype=np.int32), (2, 24)).copy()
    pos[1, -5:] = -1
    outs = {}
    for kind in ("auto", "fp8"):
        cache = attn.init_cache(2, 48, kv_cache_dtype=kind)
        out, cache = step(attn, cache, x, jnp.asarray(pos))
        cache = reset_rows(cache, [0])
        out2, cache = step(attn, cache, x[:, :4], jnp.asarray(np.stack([np.arange(4), 19 + np.arange(4)]), jnp.int32))
        outs[kind] = (np.asarray(out.astype(jnp.float32)), np.asarray(out2.astype(jnp.float32)), cache)
    for a, b in zip(outs["auto"][:2], outs["fp8"][:2]):
        np.testing.assert_array_equal(b, a)
    cache_p, cache_q = outs["auto"][2], outs["fp8"][2]
    _assert_same_rows(cache_q.window, cache_p.window, "window")
    _assert_same_rows(cache_q.indexer.entries, cache_p.indexer.entries, "indexer.entries")


def test_fp8_cache_layout_and_bytes():
    """The stored arrays (dtypes, block counts) and the bytes: at V4-Flash widths a main KV row
    takes 448 + 7 + 128 = 583 bytes (bf16: 1024) and an indexer key 64 + 4 (bf16: 256): two e2m1
    codes a byte and a scale byte a block of 32."""
    cfg = DeepseekV4Config.tiny()
    attn = helpers.random_layer(cfg, 1, numerics="official")
    cache = attn.init_cache(3, 64, kv_cache_dtype="fp8")
    window = cache.window
    assert window.shape == (3, cfg.sliding_window, cfg.head_dim) and window.dtype == jnp.float32
    assert window.values.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and window.scales.dtype == np.uint8
    nope = cfg.head_dim - cfg.qk_rope_head_dim
    assert window.values.shape[-1] == nope and window.scales.shape[-1] == -(-nope // 64)
    assert window.rope.shape[-1] == cfg.qk_rope_head_dim
    keys = cache.indexer.entries
    assert keys.grid == "fp4" and keys.block == 32 and keys.rope.shape[-1] == 0
    assert keys.values.dtype == np.uint8 and keys.values.shape[-1] == cfg.index_head_dim // 2
    assert keys.shape == (3, cfg.entry_slots(CSA, 64), cfg.index_head_dim)
    np.testing.assert_array_equal(np.asarray(read(window)), np.zeros(window.shape, np.float32))  # empty reads 0
    assert cache_nbytes(cache) < cache_nbytes(attn.init_cache(3, 64))

    flash = dict(batch=1, rows=1000)
    main = quantized_zeros(flash["batch"], flash["rows"], 512, 64, jnp.bfloat16, "fp8")
    index = quantized_zeros(flash["batch"], flash["rows"], 128, 0, jnp.bfloat16, "fp4")
    per_row = [sum(a.nbytes for a in jax.tree.leaves(rows)) // flash["rows"] for rows in (main, index)]
    assert per_row == [583, 68]


def test_reencoding_a_rounded_row_keeps_its_value():
    """What the cache's writes rely on: the quantization of an already rounded row gives back its
    value exactly (FP8 and FP4 grids, magnitudes across the float32 range, blocks whose
    absolute max rounds down to the scale's lower half, zeros, non-finite blocks)."""
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(64, 256)).astype(np.float32) * np.exp2(rng.integers(-60, 60, size=(64, 1)))
    rows[0, :64] = 0.0
    rows[1, :] = 230.0 * np.exp2(rng.integers(-8, 8, size=256))  # amax / scale in (224, 256): rounds to 224
    rows[2, 3] = np.nan
    rows[3, 5] = np.inf
    for grid, round_trip, block in (("fp8", numerics.fp8_round_trip, 64), ("fp4", numerics.fp4_round_trip, 32)):
        for dtype in (np.float32, ml_dtypes.bfloat16):
            rounded = round_trip(rows.astype(dtype), block)
            again = numerics.dequantize_bits(*numerics.quantize_to_bits(rounded, block, grid), dtype, block)
            np.testing.assert_array_equal(again.astype(np.float32), rounded.astype(np.float32), err_msg=grid)
            direct = numerics.dequantize_bits(*numerics.quantize_to_bits(rows.astype(dtype), block, grid), dtype, block)
            np.testing.assert_array_equal(direct.astype(np.float32), rounded.astype(np.float32), err_msg=grid)
            non_finite = again[2:4, :block].astype(np.float32)
            assert np.isnan(non_finite).all()


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_fp4_codes_pack_two_a_byte(xp):
    """The indexer keys' storage: every e2m1 value (both zeros included) packs into its code,
    channel 2i in the low nibble, and unpacks to the same bits; NaN (a non-finite block) packs
    as a zero, which the block's scale byte 255 turns back into NaN."""
    grid = numerics.FP4_CODE_VALUES
    values = np.stack([np.repeat(grid, 16), np.tile(grid, 16)], axis=-1).reshape(16, 32)
    packed = numerics.pack_fp4(xp.asarray(values.astype(ml_dtypes.bfloat16)))
    assert packed.dtype == np.uint8 and packed.shape == (16, 16)
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(packed).reshape(-1), (np.repeat(codes, 16) | (np.tile(codes, 16) << 4)))
    back = np.asarray(numerics.unpack_fp4(packed))
    np.testing.assert_array_equal(back.view(np.uint32), values.astype(np.float32).view(np.uint32))
    nan_row = numerics.pack_fp4(xp.asarray(np.full((1, 32), np.nan, np.float32)))
    scales = xp.asarray(np.full((1, 1), 255, np.uint8))
    with np.errstate(invalid="ignore"):  # 0 x inf, on purpose
        back_nan = numerics.dequantize_bits(numerics.unpack_fp4(nan_row), scales, np.float32, 32)
    assert np.isnan(np.asarray(back_nan)).all()
    with pytest.raises(ValueError, match="even last axis"):
        numerics.pack_fp4(xp.zeros((2, 3), np.float32))


def test_fp8_cache_requires_the_official_numerics():
    cfg = DeepseekV4Config.tiny()
    reference = helpers.random_layer(cfg, 1)
    with pytest.raises(ValueError, match=r"kv_cache_dtype: 'fp8' .* numerics='official'"):
        reference.init_cache(1, 32, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        reference.init_cache(1, 32, kv_cache_dtype="int8")
    official = helpers.random_layer(cfg, 1, numerics="official")
    cache = official.init_cache(1, 32, kv_cache_dtype="fp8")
    x = jnp.zeros((1, 4, cfg.hidden_size), jnp.float32)
    with pytest.raises(ValueError, match=r"cache: an FP8 cache .* numerics='official'"):
        reference(x, jnp.arange(4, dtype=jnp.int32)[None], cache)
    out, cache = official(x, jnp.arange(4, dtype=jnp.int32)[None], cache)  # the cache stays usable
    assert np.isfinite(np.asarray(out)).all() and int(cache.length[0]) == 4


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the CUDA kernels and native handlers run on a GPU")
@pytest.mark.parametrize("layer", [1, 2], ids=["csa", "hca"])
@pytest.mark.parametrize("kernels", ["auto", "pallas"])
def test_gpu_fp8_cache_gives_the_bf16_caches_outputs_bit_for_bit(layer, kernels):
    """On CUDA, bf16, with the default plan and with every Pallas kernel forced: the FP8 cache's
    prefill and decode outputs, picks and rows equal the bf16 cache's, bit for bit."""
    from dsv4_jax import KernelPlan

    plan = "auto" if kernels == "auto" else KernelPlan(decode_attention="pallas", prefill_attention="pallas",
                                                       compress="pallas")
    cfg = DeepseekV4Config.tiny()
    attn = helpers.random_layer(cfg, layer, seed=3, numerics="official", param_dtype=jnp.bfloat16, kernels=plan)
    for (out_p, cache_p, picks_p), (out_q, cache_q, picks_q) in zip(_runs(attn, "auto"), _runs(attn, "fp8")):
        np.testing.assert_array_equal(out_q.astype(np.float32), out_p.astype(np.float32))
        np.testing.assert_array_equal(picks_q, picks_p)
        _assert_same_rows(cache_q.compressor.entries, cache_p.compressor.entries, "compressor.entries")


def test_differentiating_through_an_fp8_cache_is_refused():
    """Gradients through quantized rows would differ from the bf16 cache's straight-through
    ones: refused with a ValueError naming the cache (train with the default cache)."""
    from dsv4_jax.step.pure_step import attention_step

    cfg = DeepseekV4Config.tiny()
    attn = helpers.random_layer(cfg, 2, numerics="official", break_mode="none")
    spec = attn.step_spec()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 24, cfg.hidden_size)), jnp.float32)

    def loss(weights, cache):
        return jnp.sum(attention_step(weights, cache, x, None, spec)[0] ** 2)

    grad = jax.jit(jax.grad(loss))  # jitted: the eager grad dispatches every op on its own (slow)
    plain = attn.init_cache(1, 32)
    grads = grad(attn.weights(), plain.replace(length=jnp.asarray(plain.length)))
    assert float(jnp.abs(grads.compressor.kv_proj).sum()) > 0
    fp8 = attn.init_cache(1, 32, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"cache: an FP8 cache .* cannot be differentiated"):
        grad(attn.weights(), fp8.replace(length=jnp.asarray(fp8.length)))
    with pytest.raises(ValueError, match=r"cache: an FP8 cache .* cannot be differentiated"):  # eagerly too
        jax.grad(loss)(attn.weights(), fp8.replace(length=jnp.asarray(fp8.length)))
    out, _ = attn(x, jnp.arange(24, dtype=jnp.int32)[None], fp8)  # inference with it still runs
    assert np.isfinite(np.asarray(out)).all()
