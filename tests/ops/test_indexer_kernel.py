"""The indexer's scoring kernel (`dsv4_jax.ops.indexer.pallas`) against its XLA twin, and the plan
that chooses it.

On the CPU the kernel runs in interpret mode (the kernel body the GPU runs, as XLA ops); on
CUDA the Triton kernel itself runs (the GPU tests, skipped elsewhere). Its scores equal the XLA
twin's (`indexer.index_scores`) within float32 rounding of the sums, -inf exactly where an
entry is not visible; the selection it feeds (the native top-k after it) picks what the
native handler's own scoring picks.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import KernelPlan, native, numerics
from dsv4_jax.cache.paged import PagedRows
from dsv4_jax.cache.quantized import QuantizedRows, read
from dsv4_jax.ops.indexer import native as indexer_native
from dsv4_jax.ops.indexer import pallas as indexer_kernel
from dsv4_jax.ops.indexer import pallas_fp8 as indexer_kernel_fp8
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


def paged_keys(keys, page_entries: int, table: np.ndarray, seed: int = 0):
    """A paged cache's `PagedRows` holding `keys` ([B, T, c] array or `QuantizedRows`): row b's
    entry t written at pool row ``table[b, t // E] * E + t % E`` of a pool of random rows (what
    no row holds is noise, not zeros: a read past the table's pages would show); entries of a
    page -1 are dropped (the view then holds zeros there, as a paged cache reads them)."""
    slots = keys.shape[1]
    pool_pages = int(table.max()) + 2  # one page no row holds
    rng = np.random.default_rng(seed)

    def noise(a):
        shape = (pool_pages, page_entries, *a.shape[2:])
        if a.dtype == jnp.uint8:
            return jnp.asarray(rng.integers(0, 256, size=shape, dtype=np.uint8))
        return jnp.asarray(rng.standard_normal(shape), a.dtype)

    rows = PagedRows(pool=jax.tree.map(noise, keys), table=jnp.asarray(table, jnp.int32), slots=slots)
    index = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (table.shape[0], slots))
    return rows.scatter(index, keys)


# Rows whose pages lie scattered and out of order in the pool (a page boundary every 4 entries,
# inside every scoring block), the second row holding one page fewer (its last entries read as
# zeros); ragged visible counts, prefill (5 queries a row) and decode (1).
PAGE_ENTRIES, PAGED_SLOTS = 4, 22
PAGE_TABLE = np.array([[9, 2, 7, 0, 5, 11], [4, 10, 1, 8, 3, -1]], np.int32)
PAGED_VISIBLE = {"prefill": [[0, 3, 4, 13, 22], [22, 1, 9, 20, 17]], "decode": [[22], [19]]}


@pytest.mark.parametrize("scoring, keys, graph", [
    ("native", "bf16", True), ("native", "bf16", False), ("native", "fp4-stored", True),
    ("native", "fp4-stored", False), ("interpret", "bf16", True), ("interpret", "fp4-stored", True),
    ("interpret", "fp4-dequantized", False)])
def test_a_paged_pools_keys_select_as_the_contiguous_keys_they_hold(scoring, keys, graph):
    """`select_native` over a paged cache's keys (`PagedRows`: each key read in its page through
    the table, `native.Pages`) gives the picks and scores of the same keys held contiguously, bit
    for bit: the handler's own scoring (eager break and graph target) and the Pallas kernel's
    (interpret mode), over bf16 keys and an FP8 cache's FP4 ones (their stored form, or the
    pool dequantized)."""
    if scoring == "native" and not NATIVE:
        pytest.skip("the native handlers are not built")
    heads, dim = 16, 64
    if keys == "bf16":
        held = random_operands(2, 1, heads, dim, PAGED_SLOTS, seed=11)[2]
    else:
        held = fp4_rows(2, PAGED_SLOTS, dim, seed=11)
    paged = paged_keys(held, PAGE_ENTRIES, PAGE_TABLE, seed=12)
    missing = PAGED_SLOTS - PAGE_ENTRIES * 5  # row 1's entries past its pages: zeros in the view
    contiguous = jax.tree.map(lambda a: a.at[1, PAGED_SLOTS - missing:].set(0), held)
    plan = KernelPlan(select="native", select_scores=scoring,
                      select_keys="dequantized" if keys == "fp4-dequantized" else "stored")
    for phase, visible in PAGED_VISIBLE.items():
        visible = jnp.asarray(visible, jnp.int32)
        q, w, _ = random_operands(2, visible.shape[1], heads, dim, 8, seed=13)
        select = jax.jit(lambda q, w, k, v: indexer_native.select_native(
            q, w, k, v, top_k=8, with_scores=True, graph=graph, kernels=plan))
        got, want = select(q, w, paged, visible), select(q, w, contiguous, visible)
        np.testing.assert_array_equal(np.asarray(got.picks), np.asarray(want.picks), err_msg=phase)
        np.testing.assert_array_equal(np.asarray(got.scores), np.asarray(want.scores), err_msg=phase)
        if phase == "prefill":  # and the contiguous keys' selection is the XLA twin's (sets and scores)
            twin = indexer.select_topk(q, w, read(contiguous), visible, top_k=8, with_scores=True)
            assert_scores_match(got.scores, twin.scores)


@pytest.mark.skipif(not NATIVE, reason="the native handlers are not built")
def test_the_native_selection_reads_a_paged_pool_without_gathering_its_keys():
    """The jaxpr of the native selection over `PagedRows` holds no gather of the keys [B, T, c]
    (nor of the codes): the handler gets the pool and the table. The XLA twin, reading
    `PagedRows.view`, holds one (the check's control)."""
    held = random_operands(2, 1, 16, 64, PAGED_SLOTS, seed=11)[2]
    paged = paged_keys(held, PAGE_ENTRIES, PAGE_TABLE)
    q, w, _ = random_operands(2, 5, 16, 64, 8, seed=13)
    visible = jnp.asarray(PAGED_VISIBLE["prefill"], jnp.int32)
    gathered = re.compile(rf"\[2,{PAGED_SLOTS},64\] = gather")

    native_jaxpr = str(jax.make_jaxpr(lambda q, w, k, v: indexer_native.select_native(
        q, w, k, v, top_k=8, graph=True, kernels=KernelPlan(select="native", select_scores="native")))(
            q, w, paged, visible))
    assert "dsv4_select_topk_paged_graph" in native_jaxpr
    assert not gathered.search(native_jaxpr), native_jaxpr
    xla_jaxpr = str(jax.make_jaxpr(lambda q, w, k, v: indexer.select_topk(q, w, k, v, top_k=8))(q, w, paged, visible))
    assert gathered.search(xla_jaxpr)


@pytest.mark.skipif(not NATIVE, reason="the native handlers are not built")
def test_the_native_scores_over_a_paged_pool_differentiate_as_over_its_keys():
    """The graph target's scores (`scores_with_gradient`) over `PagedRows` differentiate as over
    the contiguous keys: the same gradients for the queries and head weights, and the pool's
    gradient is the keys' one, in their pages."""
    held = random_operands(2, 1, 16, 64, PAGED_SLOTS, jnp.float32, seed=11)[2]
    paged = paged_keys(held, PAGE_ENTRIES, PAGE_TABLE)
    contiguous = held.at[1, PAGE_ENTRIES * 5:].set(0)
    q, w, _ = random_operands(2, 5, 16, 64, 8, jnp.float32, seed=13)
    visible = jnp.asarray(PAGED_VISIBLE["prefill"], jnp.int32)
    plan = KernelPlan(select="native", select_scores="native")

    def loss(q, w, keys):
        scores = indexer_native.select_native(q, w, keys, visible, top_k=8, with_scores=True, graph=True,
                                              kernels=plan).scores
        return jnp.sum(jnp.where(jnp.isfinite(scores), scores, 0.0) ** 2)

    got = jax.jit(jax.grad(lambda q, w, pool: loss(q, w, paged.replace(pool=pool)), argnums=(0, 1, 2)))(
        q, w, paged.pool)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, w, contiguous)
    for name, g, h in zip(("queries", "weights"), got[:2], want[:2]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-6, atol=1e-6, err_msg=name)
    in_pages = np.arange(PAGED_SLOTS)[None, :, None] < np.array([PAGED_SLOTS, PAGE_ENTRIES * 5])[:, None, None]
    np.testing.assert_allclose(np.asarray(paged.replace(pool=got[2]).view()), np.where(in_pages, want[2], 0),
                               rtol=1e-6, atol=1e-6, err_msg="keys (row 1's past its pages: none held)")


def test_a_paged_pool_of_the_wrong_form_is_refused():
    """`native.Pages` operands that the handlers and the kernel cannot read are a ValueError
    naming the argument: a pool not [pages * E, .], a table of another batch or too few pages."""
    held = random_operands(2, 1, 16, 64, PAGED_SLOTS, seed=11)[2]
    paged = paged_keys(held, PAGE_ENTRIES, PAGE_TABLE)
    q, w, _ = random_operands(2, 1, 16, 64, 8, seed=13)
    visible = jnp.asarray(PAGED_VISIBLE["decode"], jnp.int32)
    pool = paged.pool.reshape(-1, 64)
    pages = native.Pages(paged.table, PAGE_ENTRIES, PAGED_SLOTS)
    with pytest.raises(ValueError, match=r"keys: expected a paged pool \[pages \* 4, .\]"):
        indexer_kernel.index_scores(q, w, pool[:-1], visible, interpret=True, pages=pages)
    with pytest.raises(ValueError, match=r"pages.table: expected \[2, P_row\] int32 with P_row \* 4 >= 22"):
        indexer_kernel.index_scores(q, w, pool, visible, interpret=True, pages=pages._replace(table=paged.table[:, :5]))
    if NATIVE:
        with pytest.raises(ValueError, match=r"pages.table: expected \[2, P_row\] int32"):
            native.select_topk(q, w, pool, visible, top_k=8, graph=True, pages=pages._replace(table=paged.table[:1]))
        with pytest.raises(ValueError, match=r"keys: expected a paged pool"):
            native.select_topk(q, w, paged.pool, visible, top_k=8, graph=True, pages=pages)


@pytest.mark.parametrize("keys, slots", [("bf16", 8192), ("bf16", 8000), ("fp4", 8192), ("fp4", 8000),
                                         ("bf16-paged", 8000), ("fp4-paged", 8000)])
def test_the_kernel_lowers_to_a_triton_kernel_for_cuda(keys, slots):
    """At V4's sizes (nI = 64, c = 128, a query block of 256 against 8,192 entries, or 8,000: a
    partial last block) the kernel, over bf16 keys or MXFP4 ones, lowers on this CPU to the
    Triton custom call a GPU compiles: what interpret mode cannot check (the Triton lowering of
    its loop, masked loads and stores, dot, reductions and the FP4 decoding)."""
    q, w = jax.ShapeDtypeStruct((1, 256, 64, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, 256, 64), jnp.float32)
    visible = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    if keys.endswith("paged"):  # pages of 64 entries (256 tokens at m = 4), each key row loaded at its page
        table = jax.ShapeDtypeStruct((1, 128), jnp.int32)
        widths = (128,) if keys == "bf16-paged" else (64, 4)
        pool = [jax.ShapeDtypeStruct((256 * 64, n), jnp.bfloat16 if n == 128 else jnp.uint8) for n in widths]

        def fn(q, w, table, *rest):
            *pool, visible = rest
            pages = native.Pages(table, 64, slots)
            if len(pool) == 1:
                return indexer_kernel.index_scores(q, w, *pool, visible, pages=pages)
            return indexer_kernel.index_scores_fp4(q, w, *pool, visible, pages=pages)

        args = (q, w, table, *pool, visible)
    elif keys == "bf16":
        fn, args = indexer_kernel.index_scores, (q, w, jax.ShapeDtypeStruct((1, slots, 128), jnp.bfloat16), visible)
    else:
        fn, args = indexer_kernel.index_scores_fp4, (q, w, jax.ShapeDtypeStruct((1, slots, 64), jnp.uint8),
                                                     jax.ShapeDtypeStruct((1, slots, 4), jnp.uint8), visible)
    _assert_lowers_to_a_triton_kernel(fn, args)


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


def scattered_table(batch: int, per_row: int, seed: int, missing: int = 2) -> np.ndarray:
    """[batch, per_row] pool pages in random order (a row's pages scattered through the pool),
    row 1 holding `missing` pages fewer (-1 at its end)."""
    table = np.random.default_rng(seed).permutation(batch * per_row + 3)[:batch * per_row]
    table = table.reshape(batch, per_row).astype(np.int32)
    table[1, per_row - missing:] = -1
    return table


@pytest.mark.skipif(not (ON_GPU and NATIVE), reason="the native CUDA handlers and the Triton kernel need CUDA")
@pytest.mark.parametrize("keys, heads, dim", [("bf16", 64, 128), ("f32", 64, 128), ("bf16", 8, 32),
                                              ("fp4", 64, 128), ("fp4", 64, 256), ("fp4", 64, 512)])
def test_gpu_paged_keys_select_as_the_contiguous_keys_they_hold(keys, heads, dim):
    """On a GPU, pages of 64 entries (V4's 256 tokens at m = 4) in random order through the pool,
    T = 8,010 (a partial last page), row 1 missing its last two pages: every CUDA scoring kernel
    reads the keys through the table (`native.Pages`) and gives the picks and scores of the same
    keys held contiguously, bit for bit, in the eager break and the graph target: the
    tensor-core kernel (bf16, 64 heads; FP4 staged for c <= 128, <= 256, and unstaged at 512),
    the FMA kernel's register-tiled path (float32, 64 heads) and its generic one (8 heads); and
    the Triton kernel (at V4's c = 128 where it takes the operands: bf16 64 heads, FP4 stored).
    A prefill block of 256 queries on a causal ramp over 2 rows, and a decode step of 8 rows."""
    slots, entries = 8010, 64
    per_row = -(-slots // entries)
    held_entries = entries * (per_row - 2)  # row 1's entries past its pages read as zeros
    dtype = jnp.float32 if keys == "f32" else jnp.bfloat16
    for phase, batch, seq in (("prefill", 2, 256), ("decode", 8, 1)):
        table = scattered_table(batch, per_row, seed=batch)
        if keys == "fp4":
            held = fp4_rows(batch, slots, dim, seed=21)
        else:
            held = random_operands(batch, 1, heads, dim, slots, dtype, seed=21)[2]
        held = jax.tree.map(lambda a: a.at[1, held_entries:].set(0), held)
        paged = paged_keys(held, entries, table, seed=22)
        q, w, _ = random_operands(batch, seq, heads, dim, 8, dtype, seed=23)
        ramp = slots - (seq - 1 - np.arange(seq)) // 4
        visible = jnp.asarray(np.broadcast_to(ramp, (batch, seq)), jnp.int32)
        kernels = (("native", True), ("native", False)) + ((("pallas", True),) if dim == 128 else ())
        for scoring, graph in kernels:
            plan = KernelPlan(select="native", select_scores=scoring, select_keys="stored")
            select = jax.jit(lambda q, w, k, v, plan=plan, graph=graph: indexer_native.select_native(
                q, w, k, v, top_k=512, with_scores=True, graph=graph, kernels=plan))
            got, want = select(q, w, paged, visible), select(q, w, held, visible)
            what = f"{phase} {scoring} graph={graph}"
            np.testing.assert_array_equal(np.asarray(got.scores), np.asarray(want.scores), err_msg=what)
            np.testing.assert_array_equal(np.asarray(got.picks), np.asarray(want.picks), err_msg=what)


def official_operands(batch, seq, heads, dim, slots, seed):
    """Queries and MXFP4 keys as numerics="official" makes them: Hadamard-rotated, then FP4 blocks
    of 32 (`round_indexer_official`; the keys in the cache's stored form), so that each row's
    blocks' scales lie within a few powers of two (the FP8 kernel's bit-for-bit regime)."""
    rng = np.random.default_rng(seed)
    q = numerics.round_indexer_official(jnp.asarray(rng.standard_normal((batch, seq, heads, dim)), jnp.bfloat16))
    w = jnp.asarray(rng.standard_normal((batch, seq, heads)) * heads ** -0.5, jnp.float32)
    keys = numerics.hadamard_rotate(jnp.asarray(rng.standard_normal((batch, slots, dim)), jnp.bfloat16))
    values, scale_bytes = numerics.quantize_to_bits(keys, numerics.FP4_BLOCK, "fp4")
    rows = QuantizedRows(values=numerics.pack_fp4(values), scales=scale_bytes,
                         rope=jnp.zeros((batch, slots, 0), jnp.bfloat16), block=32, grid="fp4")
    return q, w, rows


def test_widened_e2m1_codes_are_their_values_in_e4m3():
    """`widen_e2m1` of every byte (two e2m1 codes, -0.0 included) is `unpack_fp4`'s values, bit for
    bit as float32 (signs of zeros too)."""
    codes = jnp.arange(256, dtype=jnp.uint8).reshape(16, 16)
    got = np.asarray(indexer_kernel_fp8.widen_e2m1(codes).astype(jnp.float32))
    want = np.asarray(numerics.unpack_fp4(codes))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_official_queries_split_into_e4m3_codes_and_scales_exactly():
    """`numerics.split_fp4_grid` of FP4-rounded values gives factors whose product is the values
    (blocks whose maximum rounded to 3 * scale too: half the scale, twice the codes); values off the
    grid are flagged, per vector."""
    rng = np.random.default_rng(0)
    x = numerics.round_indexer_official(jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16))
    x = x.at[0, :32].set(jnp.asarray([3.0, -1.5, 0.5] + [0.0] * 29, jnp.bfloat16))  # amax 3 * scale
    values, scale_bytes, on_grid = numerics.split_fp4_grid(x)
    assert values.dtype == jnp.float8_e4m3fn and scale_bytes.dtype == jnp.uint8 and on_grid.shape == (64,)
    assert bool(on_grid.all())
    back = numerics.dequantize_bits(values, scale_bytes, jnp.float32, numerics.FP4_BLOCK)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x.astype(jnp.float32)))
    off = x.at[3, 5].add(jnp.bfloat16(0.01))
    np.testing.assert_array_equal(np.asarray(numerics.split_fp4_grid(off)[2]), np.arange(64) != 3)


def pool_rows(pool: QuantizedRows) -> QuantizedRows:
    """A paged pool's codes and scale bytes as key rows [N, .] (the kernels' paged operands)."""
    return pool.replace(values=pool.values.reshape(-1, pool.values.shape[-1]),
                        scales=pool.scales.reshape(-1, pool.scales.shape[-1]))


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_fp8_dots_score_as_the_stored_fp4_kernel_bit_for_bit(layout):
    """`index_scores_fp8` (interpret mode) gives `index_scores_fp4`'s scores bit for bit, prefill (3
    queries a row, ragged visible counts, T = 300: a partial last block) and decode (1 query a row),
    over contiguous keys and a paged pool (pages scattered, row 1 missing its last page); the picks
    are the XLA reference's over the dequantized keys; the scores equal the reference's within
    float32 rounding of the head sums."""
    heads, dim = 16, 64
    if layout == "contiguous":
        q, w, rows = official_operands(2, 3, heads, dim, 300, seed=31)
        keys, pages, view = rows, None, rows.dequantize()
        cases = {"prefill": [[0, 129, 300], [300, 7, 256]], "decode": [[300], [211]]}
    else:
        q, w, rows = official_operands(2, 5, heads, dim, PAGED_SLOTS, seed=32)
        paged = paged_keys(rows, PAGE_ENTRIES, PAGE_TABLE, seed=33)
        keys, pages = pool_rows(paged.pool), native.Pages(paged.table, PAGE_ENTRIES, PAGED_SLOTS)
        view = read(paged.view())
        cases = PAGED_VISIBLE
    for phase, visible in cases.items():
        visible = jnp.asarray(visible, jnp.int32)
        qs, ws = q[:, :visible.shape[1]], w[:, :visible.shape[1]]
        got = indexer_kernel_fp8.index_scores_fp8(qs, ws, keys.values, keys.scales, visible, interpret=True,
                                                  off_grid="raise", pages=pages)
        want = indexer_kernel.index_scores_fp4(qs, ws, keys.values, keys.scales, visible, interpret=True,
                                               pages=pages)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=phase)
        twin = indexer.select_topk(qs, ws, view, visible, top_k=8, with_scores=True)
        assert_scores_match(got, twin.scores)
        np.testing.assert_array_equal(np.asarray(indexer.picks_from_scores(got, visible, 8)), np.asarray(twin.picks),
                                      err_msg=phase)


def test_queries_off_the_fp4_grid_are_refused_or_scored_by_the_bf16_dot():
    """Queries not on the FP4 grid (numerics="reference"): an eager call with ``off_grid="raise"``
    refuses them naming the rows; otherwise (under a jit) each such row is scored by the bf16 dot
    inside the kernel: `index_scores_fp4`'s scores bit for bit, rows on the grid beside them too."""
    q, w, rows = official_operands(2, 3, 16, 64, 130, seed=34)
    loose = random_operands(2, 3, 16, 64, 8, seed=35)[0]
    mixed = q.at[1, 2].set(loose[1, 2])  # one row off the grid
    visible = jnp.asarray([[1, 64, 130], [130, 100, 129]], jnp.int32)
    with pytest.raises(ValueError, match=r"queries: expected values on the FP4 grid .* rows off it: \[\(1, 2\)\]"):
        indexer_kernel_fp8.index_scores_fp8(mixed, w, rows.values, rows.scales, visible, off_grid="raise",
                                            interpret=True)
    with pytest.raises(ValueError, match=r"off_grid: expected 'fall_back' or 'raise', got 'ignore'"):
        indexer_kernel_fp8.index_scores_fp8(q, w, rows.values, rows.scales, visible, off_grid="ignore")
    score = jax.jit(lambda *a: indexer_kernel_fp8.index_scores_fp8(*a, interpret=True))
    for queries in (mixed, loose):
        got = score(queries, w, rows.values, rows.scales, visible)
        want = indexer_kernel.index_scores_fp4(queries, w, rows.values, rows.scales, visible, interpret=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.skipif(not NATIVE, reason="the native handlers are not built")
def test_the_plan_scores_an_fp8_caches_keys_with_fp8_dots_where_asked():
    """`KernelPlan(select_keys="fp8")` with the Pallas kernel's scoring (interpret mode) runs
    `index_scores_fp8` and selects as "stored" does (picks and scores bit for bit); "auto" and
    "stored" never run it; an unknown choice is refused."""
    q, w, rows = official_operands(1, 4, 16, 64, 96, seed=36)
    visible = jnp.asarray([[93, 94, 95, 96]], jnp.int32)
    calls = []
    real = indexer_kernel_fp8.index_scores_fp8

    def select(select_keys):
        plan = KernelPlan(select="native", select_scores="interpret", select_keys=select_keys)
        return jax.jit(lambda q, w, k, v: indexer_native.select_native(
            q, w, k, v, top_k=8, with_scores=True, graph=True, kernels=plan))(q, w, rows, visible)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(indexer_kernel_fp8, "index_scores_fp8", lambda *a, **k: calls.append(1) or real(*a, **k))
        got = select("fp8")
        assert calls
        calls.clear()
        want = select("stored")
        select("auto")
        assert not calls
    np.testing.assert_array_equal(np.asarray(got.picks), np.asarray(want.picks))
    np.testing.assert_array_equal(np.asarray(got.scores), np.asarray(want.scores))
    assert KernelPlan().select_keys == "auto"
    with pytest.raises(ValueError, match=r"kernels.select_keys: expected one of \('auto', 'stored', 'dequantized', "
                                         r"'fp8'\), got 'e4m3'"):
        KernelPlan(select_keys="e4m3")


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_the_fp8_kernel_lowers_to_a_triton_kernel_for_cuda(layout):
    """At V4's sizes (nI = 64, c = 128, a query block of 256 against 8,000 entries: a partial last
    block; or a paged pool of 64-entry pages) the FP8 kernel lowers on this CPU to the Triton
    custom call: its e4m3 dots, the codes' widening and bitcast, the per-row branch to the bf16 dot."""
    q, w = jax.ShapeDtypeStruct((1, 256, 64, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, 256, 64), jnp.float32)
    visible = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    if layout == "paged":
        def fn(q, w, table, codes, scale_bytes, visible):
            return indexer_kernel_fp8.index_scores_fp8(q, w, codes, scale_bytes, visible,
                                                       pages=native.Pages(table, 64, 8000))

        args = (q, w, jax.ShapeDtypeStruct((1, 128), jnp.int32), jax.ShapeDtypeStruct((256 * 64, 64), jnp.uint8),
                jax.ShapeDtypeStruct((256 * 64, 4), jnp.uint8), visible)
    else:
        fn = indexer_kernel_fp8.index_scores_fp8
        args = (q, w, jax.ShapeDtypeStruct((1, 8000, 64), jnp.uint8), jax.ShapeDtypeStruct((1, 8000, 4), jnp.uint8),
                visible)
    _assert_lowers_to_a_triton_kernel(fn, args)


@pytest.mark.skipif(not (ON_GPU and NATIVE), reason="the Triton kernel and the native CUDA handlers need CUDA")
@pytest.mark.parametrize("batch, seq, slots, paged", [(8, 1, 262144, False), (2, 256, 65536, False),
                                                      (8, 1, 65536, True)],
                         ids=["decode-256k", "prefill-64k", "decode-paged"])
def test_gpu_fp8_dots_score_as_the_stored_fp4_kernel_at_flash_sizes(batch, seq, slots, paged):
    """On Hopper at V4-Flash sizes (c = 128, nI = 64, official numerics' queries and keys): the FP8
    kernel's scores are `index_scores_fp4`'s bit for bit (wgmma e4m3 against wgmma bf16), and so
    its picks; decode rows of 262,144 entries, a prefill block of 256 on a causal ramp, and a
    paged pool (64-entry pages scattered, row 1 missing two pages)."""
    q, w, rows = official_operands(batch, seq, 64, 128, slots, seed=41)
    visible = jnp.asarray(np.broadcast_to(slots - (seq - 1 - np.arange(seq)) // 4, (batch, seq)), jnp.int32)
    pages = None
    if paged:
        per_row = slots // 64
        paged_rows = paged_keys(rows, 64, scattered_table(batch, per_row, seed=42), seed=43)
        rows = pool_rows(paged_rows.pool)
        pages = native.Pages(paged_rows.table, 64, slots)
    got = jax.jit(lambda *a: indexer_kernel_fp8.index_scores_fp8(*a, pages=pages))(
        q, w, rows.values, rows.scales, visible)
    want = jax.jit(lambda *a: indexer_kernel.index_scores_fp4(*a, pages=pages))(q, w, rows.values, rows.scales,
                                                                               visible)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(native.topk(got, visible, top_k=512, graph=True)),
                                  np.asarray(native.topk(want, visible, top_k=512, graph=True)))


def _assert_lowers_to_a_triton_kernel(fn, args):
    """`fn(*args)` lowered for CUDA on this machine holds a Triton kernel call (skips where this
    jax needs a GPU present to lower Pallas' Triton kernels)."""
    try:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as err:  # jax >= 0.12 reads the GPU's compute capability here
        if "No supported GPU devices found" not in str(err):
            raise
        pytest.skip("this jax lowers Pallas' Triton kernels only where a GPU is present")
    assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text, text[:2000]
