"""The indexer's scoring kernel (`dsv4_jax.indexer_kernel`) against its XLA twin, and the plan
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

from dsv4_jax import KernelPlan, breaks, indexer, indexer_kernel, native
from dsv4_jax.quantized_cache import QuantizedRows

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
    """Rows that see nothing, one entry, a block's edge, every entry (T = 300: the keys padded to
    a whole program's span and the scores cut back); blocks past a row's entries not loaded."""
    q, w, keys = random_operands(2, 4, 16, 32, 300, dtype)
    visible = jnp.asarray([[0, 5, 128, 300], [299, 17, 64, 1]], jnp.int32)
    got = indexer_kernel.index_scores(q, w, keys, visible, interpret=True, block=block, tiles=tiles)
    want = indexer.index_scores(q.astype(jnp.float32), w, keys.astype(jnp.float32), visible)
    assert_scores_match(got, want)


def test_shapes_and_dtypes_the_triton_kernel_takes():
    bf16 = random_operands(1, 2, 64, 128, 8)
    assert indexer_kernel.supported(bf16[0], bf16[2])
    f32 = random_operands(1, 2, 64, 128, 8, jnp.float32)
    assert not indexer_kernel.supported(f32[0], f32[2])  # Triton's dot would round float32 to TF32
    small = random_operands(1, 2, 8, 128, 8)
    assert not indexer_kernel.supported(small[0], small[2])  # fewer heads than an MMA tile


def test_the_plan_scores_prefill_chunks_with_the_kernel_and_decode_with_the_handler():
    """`KernelPlan.select_scores`: "auto" is the kernel for bf16 calls of several queries a row on
    CUDA, the handler's scoring for decode steps and float32; off CUDA "auto" and "pallas" resolve
    to the handler's; `kernels="interpret"` names interpret mode; a bad value is refused."""
    prefill, decode = random_operands(1, 4, 64, 128, 8), random_operands(1, 1, 64, 128, 8)
    f32 = random_operands(1, 4, 64, 128, 8, jnp.float32)
    assert indexer_kernel.choose("auto", prefill[0], prefill[2]) == "pallas"
    assert indexer_kernel.choose("auto", decode[0], decode[2]) == "native"
    assert indexer_kernel.choose("auto", f32[0], f32[2]) == "native"
    assert indexer_kernel.choose("pallas", f32[0], f32[2]) == "native"
    assert indexer_kernel.choose("interpret", f32[0], f32[2]) == "interpret"
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
    """`breaks._select_native` with the kernel's scores (interpret mode here) picks what it picks
    with the handler's own, blocked over queries as the layer calls it (a block of 3 over 7
    queries: a partial last block); its scores equal the handler's."""
    q, w, keys = random_operands(2, 7, 16, 32, 200, jnp.float32, seed=1)
    visible = jnp.asarray([[0, 1, 30, 64, 150, 199, 200], [200, 3, 8, 100, 101, 7, 180]], jnp.int32)

    def select(scoring):
        return jax.jit(lambda *a: breaks._select_native(*a, top_k=16, with_scores=True, block=3, graph=graph,
                                                        scoring=scoring))(q, w, keys, visible)

    got, want = select("interpret"), select("native")
    np.testing.assert_array_equal(np.asarray(got.picks), np.asarray(want.picks))
    assert_scores_match(got.scores, want.scores)


@pytest.mark.skipif(not NATIVE, reason="the native handlers are not built")
def test_an_fp8_caches_keys_reach_the_kernel_as_their_dequantized_values():
    """With the kernel's scoring, an FP8 cache's MXFP4 keys are scored as their dequantized
    values: the picks and scores of a bf16 cache holding those values, bit for bit."""
    rng = np.random.default_rng(2)
    batch, seq, heads, dim, slots = 1, 4, 16, 64, 96
    codes = jnp.asarray(rng.integers(0, 256, size=(batch, slots, dim // 2), dtype=np.uint8))
    scales = jnp.asarray(rng.integers(122, 130, size=(batch, slots, dim // 32), dtype=np.uint8))
    rows = QuantizedRows(values=codes, scales=scales, rope=jnp.zeros((batch, slots, 0), jnp.bfloat16),
                         block=32, grid="fp4")
    q, w, _ = random_operands(batch, seq, heads, dim, slots, seed=3)
    visible = jnp.asarray([[93, 94, 95, 96]], jnp.int32)

    def select(keys):
        return jax.jit(lambda q, w, k, v: breaks._select_native(q, w, k, v, top_k=8, with_scores=True, graph=True,
                                                                scoring="interpret"))(q, w, keys, visible)

    got, want = select(rows), select(rows.dequantize())
    np.testing.assert_array_equal(np.asarray(got.picks), np.asarray(want.picks))
    np.testing.assert_array_equal(np.asarray(got.scores), np.asarray(want.scores))


def test_the_kernel_lowers_to_a_triton_kernel_for_cuda():
    """At V4's sizes (nI = 64, c = 128, a query block of 256 against 8,192 entries) the kernel
    lowers, on this CPU, to the Triton custom call a GPU compiles: what interpret mode cannot
    check (the Triton lowering of its loop, dot and reductions)."""
    args = (jax.ShapeDtypeStruct((1, 256, 64, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, 256, 64), jnp.float32),
            jax.ShapeDtypeStruct((1, 8192, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, 256), jnp.int32))
    try:
        text = jax.jit(indexer_kernel.index_scores).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
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
        return jax.jit(lambda *a: breaks._select_native(*a, top_k=512, with_scores=True, graph=True,
                                                        scoring=scoring))(q, w, keys, visible)

    got, want = select("pallas"), select("native")
    assert_scores_match(got.scores, want.scores)
    got_picks, want_picks = np.asarray(got.picks), np.asarray(want.picks)
    np.testing.assert_array_equal(np.sort(got_picks, axis=-1), np.sort(want_picks, axis=-1))
