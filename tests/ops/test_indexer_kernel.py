"""The indexer's scoring kernel (`dsv4_jax.ops.indexer.pallas`) against its XLA twin, and the plan
that chooses it.

On the CPU the kernel runs in interpret mode (the kernel body the GPU runs, as XLA ops); on
CUDA the Triton kernel itself runs (the GPU tests, skipped elsewhere). Its scores equal the XLA
twin's (`indexer.index_scores`) within float32 rounding of the sums, -inf exactly where an
entry is not visible; the selection it feeds (the native top-k after it) picks what the
native handler's own scoring picks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import KernelPlan, native
from dsv4_jax.cache.quantized import QuantizedRows
from dsv4_jax.ops.indexer import native as indexer_native
from dsv4_jax.ops.indexer import pallas as indexer_kernel
from dsv4_jax.ops.indexer import reference as indexer

ON_GPU = jax.default_backend() == "gpu"
NATIVE = native.available(jax.default_backend())


def random_operands(batch, seq, heads, dim, slots, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, seq, heads, dim)), dtype)
    w = jnp.asarray(rng.standard_normal((batch, seq, heads)) * heads ** -0.5, jnp.float32)
    keys = jnp.asarray(rng.standard_normal((batch, slots, dim)), dtype)
    return q, w, keys


def assert_scores_match(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    seen = np.isfinite(want)
    np.testing.assert_allclose(got[seen], want[seen], rtol=1e-6, atol=1e-5)
    assert not np.signbit(got[got == 0]).any(), "-0.0 must be folded into +0.0 (ties compare equal)"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("block, tiles", [(16, 4), (128, 8)], ids=["small-blocks", "default-blocks"])
def test_the_kernel_scores_as_the_xla_twin(dtype, block, tiles):
    """Rows that see nothing, one entry, a block's edge, every entry (T = 300: a partial last
    block, loaded and stored under a mask, and programs whose span ends past T); blocks past a
    row's entries not loaded."""
    q, w, keys = random_operands(2, 4, 16, 32, 300, dtype)
    visible = jnp.asarray([[0, 5, 128, 300], [299, 17, 64, 1]], jnp.int32)
    got = indexer_kernel.index_scores(q, w, keys, visible, interpret=True, block=block, tiles=tiles)
    want = indexer.index_scores(q.astype(jnp.float32), w, keys.astype(jnp.float32), visible)
    assert_scores_match(got, want)


def test_shapes_and_dtypes_the_triton_kernel_takes():
    bf16 = random_operands(1, 2, 64, 128, 8)
    assert indexer_kernel.supports(bf16[0], bf16[2])
    f32 = random_operands(1, 2, 64, 128, 8, jnp.float32)
    assert not indexer_kernel.supports(f32[0], f32[2])  # Triton's dot would round float32 to TF32
    small = random_operands(1, 2, 8, 128, 8)
    assert not indexer_kernel.supports(small[0], small[2])  # fewer heads than an MMA tile


def test_the_plan_scores_prefill_chunks_with_the_kernel_and_decode_with_the_handler():
    """`KernelPlan.select_scores`: "auto" is the kernel for bf16 calls of several queries a row on
    CUDA, the handler's scoring for decode steps and float32; off CUDA "auto" and "pallas" resolve
    to the handler's; `kernels="interpret"` names interpret mode; a bad value is refused."""
    prefill, decode = random_operands(1, 4, 64, 128, 8), random_operands(1, 1, 64, 128, 8)
    f32 = random_operands(1, 4, 64, 128, 8, jnp.float32)
    assert KernelPlan(select_scores="auto").scores_for(prefill[0], prefill[2]) == "pallas"
    assert KernelPlan(select_scores="auto").scores_for(decode[0], decode[2]) == "native"
    assert KernelPlan(select_scores="auto").scores_for(f32[0], f32[2]) == "native"
    assert KernelPlan(select_scores="pallas").scores_for(f32[0], f32[2]) == "native"
    assert KernelPlan(select_scores="interpret").scores_for(f32[0], f32[2]) == "interpret"
    assert KernelPlan().resolve("cpu", True).select_scores == "native"
    assert KernelPlan(select_scores="pallas").resolve("cpu", True).select_scores == "native"
    assert KernelPlan().resolve("cuda", True).select_scores == "auto"
    assert KernelPlan.named("interpret").select_scores == "interpret"
    with pytest.raises(ValueError, match=r"kernels.select_scores: expected one of \('auto', 'native', 'pallas', "
                                         r"'interpret'\), got 'triton'"):
        KernelPlan(select_scores="triton")


@pytest.mark.skipif(not NATIVE, reason="the native handlers are not built")
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager-break"])
def test_the_native_selection_picks_alike_with_the_kernel_scores(graph):
    """`indexer_native.select_native` with the kernel's scores (interpret mode here) picks what it picks
    with the handler's own, blocked over queries as the layer calls it (a block of 3 over 7
    queries: a partial last block); its scores equal the handler's."""
    q, w, keys = random_operands(2, 7, 16, 32, 200, jnp.float32, seed=1)
    visible = jnp.asarray([[0, 1, 30, 64, 150, 199, 200], [200, 3, 8, 100, 101, 7, 180]], jnp.int32)

    def select(scoring):
        plan = KernelPlan(select="native", select_scores=scoring)
        return jax.jit(lambda *a: indexer_native.select_native(*a, top_k=16, with_scores=True, block=3, graph=graph,
                                                               kernels=plan))(q, w, keys, visible)

    got, want = select("interpret"), select("native")
    np.testing.assert_array_equal(np.asarray(got.picks), np.asarray(want.picks))
    assert_scores_match(got.scores, want.scores)


def fp4_rows(batch, slots, dim, seed, scale_bytes=(122, 130)):
    """An FP8 cache's indexer keys: random MXFP4 codes (every e2m1 value, both signs) and scale bytes."""
    rng = np.random.default_rng(seed)
    codes = jnp.asarray(rng.integers(0, 256, size=(batch, slots, dim // 2), dtype=np.uint8))
    scales = jnp.asarray(rng.integers(*scale_bytes, size=(batch, slots, dim // 32), dtype=np.uint8))
    return QuantizedRows(values=codes, scales=scales, rope=jnp.zeros((batch, slots, 0), jnp.bfloat16),
                         block=32, grid="fp4")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_decode_fp4_is_the_caches_dequantization(dtype):
    """The kernel's decoding of a stored key equals `QuantizedRows.dequantize`, bit for bit: every
    byte (two e2m1 codes, -0.0 included) under scale bytes from 0 (a zero scale: an empty cache)
    through subnormal, normal and large scales to 255 (a non-finite block)."""
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    codes = np.repeat(codes, 8, axis=0)  # [128, 16]: 32 channels a row, one scale block
    scale_bytes = np.array([0, 1, 2, 20, 100, 120, 127, 130, 200, 254, 255, 126, 128, 3, 64, 190], np.uint8)
    scales = np.tile(scale_bytes, 8)[:, None]  # [128, 1]: each byte row under 8 scales
    rows = QuantizedRows(values=jnp.asarray(codes[None]), scales=jnp.asarray(scales[None]),
                         rope=jnp.zeros((1, 128, 0), dtype), block=32, grid="fp4")
    got = np.asarray(indexer_kernel.decode_fp4(jnp.asarray(codes), jnp.asarray(scales), dtype)).astype(np.float32)
    want = np.asarray(rows.dequantize()[0]).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # signs of zeros and NaNs alike


def test_stored_fp4_keys_score_as_their_dequantized_values():
    """`index_scores_fp4` over the stored form gives `index_scores`' scores over the dequantized
    keys, bit for bit (interpret mode; a partial last block: T = 300)."""
    rows = fp4_rows(2, 300, 64, seed=5)
    q, w, _ = random_operands(2, 3, 16, 64, 300, seed=6)
    visible = jnp.asarray([[0, 129, 300], [300, 7, 256]], jnp.int32)
    got = indexer_kernel.index_scores_fp4(q, w, rows.values, rows.scales, visible, interpret=True)
    want = indexer_kernel.index_scores(q, w, rows.dequantize(), visible, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match=r"scale_bytes: expected one scale per 32 channels of 64, got 4"):
        indexer_kernel.index_scores_fp4(q, w, rows.values, jnp.concatenate([rows.scales] * 2, -1), visible)


@pytest.mark.skipif(not NATIVE, reason="the native handlers are not built")
@pytest.mark.parametrize("select_keys", ["auto", "stored", "dequantized"])
def test_an_fp8_caches_keys_score_as_their_dequantized_values(select_keys, monkeypatch):
    """With the kernel's scoring, an FP8 cache's MXFP4 keys give the picks and scores of a bf16
    cache holding their values, bit for bit, however they reach the kernel: their stored form
    (`select_keys="stored"`, `index_scores_fp4`) or a dequantized copy ("auto", "dequantized")."""
    batch, seq, heads, dim, slots = 1, 4, 16, 64, 96
    rows = fp4_rows(batch, slots, dim, seed=2)
    q, w, _ = random_operands(batch, seq, heads, dim, slots, seed=3)
    visible = jnp.asarray([[93, 94, 95, 96]], jnp.int32)
    calls = []
    real = indexer_kernel.index_scores_fp4
    monkeypatch.setattr(indexer_kernel, "index_scores_fp4", lambda *a, **k: calls.append(1) or real(*a, **k))

    def select(keys):
        plan = KernelPlan(select="native", select_scores="interpret", select_keys=select_keys)
        return jax.jit(lambda q, w, k, v: indexer_native.select_native(
            q, w, k, v, top_k=8, with_scores=True, graph=True, kernels=plan))(q, w, keys, visible)

    got = select(rows)
    assert bool(calls) == (select_keys == "stored")
    want = select(rows.dequantize())
    np.testing.assert_array_equal(np.asarray(got.picks), np.asarray(want.picks))
    np.testing.assert_array_equal(np.asarray(got.scores), np.asarray(want.scores))


@pytest.mark.parametrize("keys, slots", [("bf16", 8192), ("bf16", 8000), ("fp4", 8192), ("fp4", 8000)])
def test_the_kernel_lowers_to_a_triton_kernel_for_cuda(keys, slots):
    """At V4's sizes (nI = 64, c = 128, a query block of 256 against 8,192 entries, or 8,000: a
    partial last block) the kernel, over bf16 keys or MXFP4 ones, lowers on this CPU to the
    Triton custom call a GPU compiles: what interpret mode cannot check (the Triton lowering of
    its loop, masked loads and stores, dot, reductions and the FP4 decoding)."""
    q, w = jax.ShapeDtypeStruct((1, 256, 64, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, 256, 64), jnp.float32)
    visible = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    if keys == "bf16":
        fn, args = indexer_kernel.index_scores, (q, w, jax.ShapeDtypeStruct((1, slots, 128), jnp.bfloat16), visible)
    else:
        fn, args = indexer_kernel.index_scores_fp4, (q, w, jax.ShapeDtypeStruct((1, slots, 64), jnp.uint8),
                                                     jax.ShapeDtypeStruct((1, slots, 4), jnp.uint8), visible)
    try:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as err:  # jax >= 0.12 reads the GPU's compute capability here
        if "No supported GPU devices found" not in str(err):
            raise
        pytest.skip("this jax lowers Pallas' Triton kernels only where a GPU is present")
    assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text, text[:2000]


@pytest.mark.skipif(not (ON_GPU and NATIVE), reason="the Triton kernel and the native CUDA handlers need CUDA")
@pytest.mark.parametrize("slots", [4096, 65536])
def test_gpu_kernel_scoring_at_flash_sizes_picks_the_handlers_sets(slots):
    """On the H200 at V4-Flash sizes (a query block of 256 on a causal ramp, nI = 64, c = 128,
    K = 512, bf16): the Triton kernel's scores equal the handler's within float32 rounding of
    the sums, and the picks are the same sets (their order may differ where bf16 scores tie to
    the last bit: docs/DEVELOPING.md)."""
    q, w, keys = random_operands(1, 256, 64, 128, slots, seed=4)
    visible = jnp.asarray((slots - (255 - np.arange(256)) // 4)[None], jnp.int32)

    def select(scoring):
        plan = KernelPlan(select="native", select_scores=scoring)
        return jax.jit(lambda *a: indexer_native.select_native(*a, top_k=512, with_scores=True, graph=True,
                                                               kernels=plan))(q, w, keys, visible)

    got, want = select("pallas"), select("native")
    assert_scores_match(got.scores, want.scores)
    got_picks, want_picks = np.asarray(got.picks), np.asarray(want.picks)
    np.testing.assert_array_equal(np.sort(got_picks, axis=-1), np.sort(want_picks, axis=-1))


@pytest.mark.skipif(not (ON_GPU and NATIVE), reason="the Triton kernel and the native CUDA handlers need CUDA")
@pytest.mark.parametrize("batch, seq, slots", [(8, 1, 65536), (1, 256, 8000)], ids=["decode", "prefill-ragged"])
def test_gpu_stored_fp4_keys_score_as_their_dequantized_values(batch, seq, slots):
    """On the H200 at V4-Flash sizes (nI = 64, c = 128): the Triton kernel over an FP8 cache's
    stored keys gives its scores over the dequantized keys bit for bit (the contract between
    the two caches, which `select_keys="stored"` needs before it can be a default), and picks
    the sets the handler's stored-form selection picks (a decode step of 8 rows; a query block
    of a prefill over a T with a partial last block)."""
    rows = fp4_rows(batch, slots, 128, seed=7)
    q, w, _ = random_operands(batch, seq, 64, 128, 8, seed=8)
    visible = jnp.asarray(np.broadcast_to(slots - (seq - 1 - np.arange(seq)) // 4, (batch, seq)), jnp.int32)
    got = jax.jit(indexer_kernel.index_scores_fp4)(q, w, rows.values, rows.scales, visible)
    want = jax.jit(indexer_kernel.index_scores)(q, w, rows.dequantize(), visible)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    picks = native.topk(got, visible, top_k=512, graph=True)
    handler_picks, handler_scores = native.select_topk_fp4(q, w, rows.values, rows.scales, visible, top_k=512,
                                                           graph=True)
    assert_scores_match(got, handler_scores)
    np.testing.assert_array_equal(np.sort(np.asarray(picks), axis=-1), np.sort(np.asarray(handler_picks), axis=-1))
