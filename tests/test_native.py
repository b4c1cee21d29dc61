"""The native indexer handlers (csrc/, `dsv4_jax.native`) against their XLA and NumPy twins.

Spec: the native `select_topk` gives the picks of `indexer.select_topk` (scores within float32
rounding), and the native top-k gives exactly the picks of the reference top-k
(`indexer.picks_from_scores`: descending score, equal scores to the lower entry index, -1
padding) on any row: many exact ties, k of 1, 7 and 512, rows of 1 to 128k entries, fewer
entries than k, nothing visible. The break's place is planned once, with clear errors.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import NATIVE_BUILT, random_layer, rel_err
from hypothesis import given, settings
from hypothesis import strategies as st

import dsv4_jax
from dsv4_jax import native
from dsv4_jax.config import CSA, HCA
from dsv4_jax.ops.indexer import reference as indexer
from dsv4_jax.step.plan import plan_step
from dsv4_jax.tools.diagnostics import run_schedule

needs_native = pytest.mark.skipif(not NATIVE_BUILT, reason="native handlers not built for this platform")


def reference_picks(scores: np.ndarray, visible: np.ndarray, k: int) -> np.ndarray:
    """The NumPy twin's top-k on scores masked to -inf from `visible` on (the layer's contract)."""
    masked = np.where(np.arange(scores.shape[-1]) < visible[..., None], scores, -np.inf).astype(np.float32)
    return indexer.picks_from_scores(masked, visible, k)


def quantized_rows(rng, rows: int, slots: int, levels: int) -> np.ndarray:
    """Scores from a few levels: exact ties everywhere, as the ReLU makes them early on."""
    return (rng.integers(-levels, levels + 1, size=(rows, 1, slots)) / 4.0).astype(np.float32)


# ---------------------------------------------------------------------------- top-k alone
@needs_native
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), slots=st.integers(1, 700), k=st.sampled_from([1, 7, 512]),
       levels=st.sampled_from([0, 1, 3, 1000]))
def test_topk_equals_the_reference_on_tied_rows(seed, slots, k, levels):
    rng = np.random.default_rng(seed)
    scores = quantized_rows(rng, 3, slots, levels)
    visible = rng.integers(0, slots + 1, size=(3, 1)).astype(np.int32)
    visible[0, 0] = slots  # one row sees everything
    got = np.asarray(native.topk(scores, visible, top_k=k))
    np.testing.assert_array_equal(got, reference_picks(scores, visible, k))


@needs_native
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_topk_on_long_rows(graph):
    """128k entries, k=512, ties at the threshold: the selection must take the lowest indices."""
    rng = np.random.default_rng(3)
    slots = 131072
    scores = quantized_rows(rng, 2, slots, 2000)
    scores[1, 0, ::3] = 1000.0  # above every level (at most 500): far more ties at the top than k
    visible = np.array([[slots], [slots - 5]], np.int32)
    got = np.asarray(native.topk(scores, visible, top_k=512, graph=graph))
    np.testing.assert_array_equal(got, reference_picks(scores, visible, 512))
    assert got[1, 0].tolist() == list(range(0, 3 * 512, 3))


def spread_rows(rng, slots: int) -> np.ndarray:
    """Rows [6, 1, T] that take each path of the CUDA top-k: continuous scores (the gathered bins
    hold a few entries each: ordered by placement, no sort), scores rounded to 1/64 (exact ties
    inside the bins, signed zeros among them), a large offset (all scores within a sliver of the
    range: a few float32 values, bins of dozens of ties, gathered and sorted from 4k entries on),
    one huge outlier squeezing the rest into the bottom bin (the radix fallback), infinities
    among finite scores, and all scores equal (no spread)."""
    normal = rng.normal(size=(slots,))
    rows = [normal, np.round(normal * 64) / 64, 1000.0 + 1e-3 * normal, normal.copy(), normal.copy(),
            np.full(slots, 0.25)]
    rows[3][slots // 2] = 1e30
    rows[4][::97] = -np.inf
    rows[4][5::211] = np.inf
    return np.stack(rows).astype(np.float32)[:, None, :]


@needs_native
@pytest.mark.parametrize("slots", [1000, 4096, 9000, 16384, 40000])  # 9000: > 48 KiB shared; 40000: not staged
@pytest.mark.parametrize("k", [1, 7, 512, 1024, 4096])
def test_topk_paths_on_spread_and_skewed_rows(slots, k):
    rng = np.random.default_rng(slots + k)
    scores = spread_rows(rng, slots)
    visible = np.array([[slots], [slots - 3], [slots], [slots], [slots - 1], [slots // 2]], np.int32)
    for graph in (False, True):
        got = np.asarray(native.topk(scores, visible, top_k=k, graph=graph))
        np.testing.assert_array_equal(got, reference_picks(scores, visible, k), err_msg=f"graph={graph}")


@needs_native
def test_topk_rows_with_nothing_or_only_minus_inf():
    scores = np.full((2, 1, 40), -np.inf, np.float32)
    visible = np.array([[0], [25]], np.int32)  # nothing visible; visible but all -inf
    got = np.asarray(native.topk(scores, visible, top_k=7))
    assert (got[0] == -1).all()
    assert got[1, 0].tolist() == list(range(7))  # -inf ties: lower index first
    np.testing.assert_array_equal(got, reference_picks(scores, visible, 7))


@needs_native
@pytest.mark.parametrize("segments", [2, 7, 32])
@pytest.mark.parametrize("k", [7, 512])
def test_topk_in_segments_gives_the_same_picks(segments, k):
    """Long rows cut into segments (on CUDA one block each, their K best merged after): the
    picks of one block a row, whatever the cut: ties at the threshold straddling the cuts (the
    lower index still wins), every path of a segment's top-k, rows seeing less than a segment,
    fewer entries than k (padding), nothing at all."""
    rng = np.random.default_rng(segments * 1000 + k)
    slots = 100_003
    scores = np.concatenate([spread_rows(rng, slots), quantized_rows(rng, 3, slots, 3)])
    scores[8, 0, ::3] = 1000.0  # more equal scores at the top than k, in every segment
    few = 3 if k == 7 else 300  # fewer visible entries than k: -1 padding
    visible = np.array([[slots], [slots - 3], [slots], [slots], [slots - 1], [slots // 2], [slots], [few], [slots]],
                       np.int32)
    want = reference_picks(scores, visible, k)
    for graph in (False, True):
        got = np.asarray(native.topk(scores, visible, top_k=k, graph=graph, segments=segments))
        np.testing.assert_array_equal(got, want, err_msg=f"graph={graph}")
    no_rows = np.asarray(native.topk(scores[:1], np.zeros((1, 1), np.int32), top_k=k, segments=segments))
    assert (no_rows == -1).all()


def test_topk_segments_policy():
    """Segments only for long rows among few: a decode step at a long context, not a prefill's
    query block; about two blocks per SM, segments of 8k entries or more, a merge of <= 16k pairs."""
    assert native.topk_segments(1, 262144, 512) == 32  # B = 1 at 1M tokens (CSA entries)
    assert native.topk_segments(8, 262144, 512) == 32
    assert native.topk_segments(32, 262144, 512) == 9
    assert native.topk_segments(1, 65536, 512) == 8  # 256k tokens: segments of 8k
    assert native.topk_segments(1, 32768, 512) == 1  # staged whole in one block
    assert native.topk_segments(128, 262144, 512) == 1  # a prefill's query block fills the card
    assert native.topk_segments(1, 262144, 4096) == 4  # the merge's row stays at 16k pairs
    with pytest.raises(ValueError, match="segments"):
        native.topk(np.zeros((1, 1, 8), np.float32), np.ones((1, 1), np.int32), top_k=2, segments=0)


# ---------------------------------------------------------------------------- scoring + top-k
def random_selection_inputs(rng, dtype, *, batch=2, seq=9, heads=4, dim=16, slots=45, zero_heads=False):
    q = rng.normal(size=(batch, seq, heads, dim))
    w = rng.normal(size=(batch, seq, heads)).astype(np.float32)
    if zero_heads:  # every score exactly 0 (signed zeros included): all ties
        w[:] = 0.0
    keys = rng.normal(size=(batch, slots, dim))
    visible = rng.integers(0, slots + 1, size=(batch, seq)).astype(np.int32)
    return jnp.asarray(q, dtype), jnp.asarray(w), jnp.asarray(keys, dtype), jnp.asarray(visible)


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("zero_heads", [False, True], ids=["random", "all-tied"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_select_topk_matches_the_xla_twin(dtype, zero_heads, graph):
    rng = np.random.default_rng(11)
    args = random_selection_inputs(rng, dtype, zero_heads=zero_heads)
    want_picks, want_scores = indexer.select_topk(*args, top_k=6, with_scores=True)
    picks, scores = jax.jit(lambda *a: native.select_topk(*a, top_k=6, graph=graph))(*args)
    np.testing.assert_array_equal(np.asarray(picks), np.asarray(want_picks))
    seen = np.isfinite(np.asarray(want_scores))
    np.testing.assert_array_equal(np.isfinite(np.asarray(scores)), seen)
    assert rel_err(np.asarray(scores)[seen], np.asarray(want_scores)[seen]) < 1e-6
    assert not np.signbit(np.asarray(scores)[np.asarray(scores) == 0]).any(), "-0.0 must be folded into +0.0"


@needs_native
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_select_topk_at_indexer_sizes_in_bf16(graph):
    """V4's indexer shape (64 heads x 128; the CUDA handler scores bf16 on the tensor cores):
    scores within float32 summation-order rounding of the XLA twin's, and the picks exactly
    the reference top-k of those scores (tie rule included)."""
    rng = np.random.default_rng(5)
    args = random_selection_inputs(rng, jnp.bfloat16, batch=3, seq=2, heads=64, dim=128, slots=700)
    check_native_scores_and_picks(args, graph)


@needs_native
def test_select_topk_over_long_rows_in_segments():
    """A decode step at 1M tokens' CSA entries (262,144 a row, B = 2): the default segments give
    the picks of one block a row and of the XLA twin."""
    rng = np.random.default_rng(8)
    args = random_selection_inputs(rng, jnp.bfloat16, batch=2, seq=1, heads=16, dim=16, slots=262144)
    args = (*args[:3], jnp.asarray([[262144], [200_001]], jnp.int32))
    assert native.topk_segments(2, 262144, 512) > 1
    picks, scores = jax.jit(lambda *a: native.select_topk(*a, top_k=512, graph=True))(*args)
    one_block, _ = jax.jit(lambda *a: native.select_topk(*a, top_k=512, graph=True, segments=1))(*args)
    np.testing.assert_array_equal(np.asarray(picks), np.asarray(one_block))
    np.testing.assert_array_equal(np.asarray(picks), reference_picks(np.asarray(scores), np.asarray(args[3]), 512))


@needs_native
@pytest.mark.parametrize(("heads", "dim", "slots"), [(64, 128, 2600), (32, 64, 333), (16, 16, 130)])
def test_select_topk_tensor_core_shapes_in_bf16(heads, dim, slots):
    """Every head count of the CUDA tensor-core kernel, rows of several key tiles (16 rows of
    2600 entries: each block scores two tiles, the second loaded while the first is scored),
    partial last tiles and rows that see only part of their keys."""
    rng = np.random.default_rng(heads)
    args = random_selection_inputs(rng, jnp.bfloat16, batch=4, seq=4, heads=heads, dim=dim, slots=slots)
    check_native_scores_and_picks(args, graph=True)


def check_native_scores_and_picks(args, graph: bool, top_k: int = 64) -> None:
    want_scores = indexer.select_topk(*args, top_k=top_k, with_scores=True)[1]
    picks, scores = jax.jit(lambda *a: native.select_topk(*a, top_k=top_k, graph=graph))(*args)
    scores, want_scores = np.asarray(scores), np.asarray(want_scores)
    seen = np.isfinite(want_scores)
    np.testing.assert_array_equal(np.isfinite(scores), seen)
    scale = np.abs(want_scores[seen]).max()
    assert np.abs(scores[seen] - want_scores[seen]).max() < 1e-5 * scale
    assert not np.signbit(scores[scores == 0]).any(), "-0.0 must be folded into +0.0"
    np.testing.assert_array_equal(np.asarray(picks), reference_picks(scores, np.asarray(args[3]), top_k))


@needs_native
@pytest.mark.parametrize("dim", [128, 256], ids=["staged-4", "staged-8"])
def test_select_topk_fp4_dequantizes_every_code_at_every_scale(dim):
    """Every e2m1 code under scale bytes 0-200 (0: an empty row; 1: products below float32's
    and bf16's normal range; up to 2 ** 73): the stored-form scores equal, bit for bit, the
    scores over the same keys dequantized by NumPy (exactly, subnormals kept) and handed over
    as bf16, on the tensor-core path (16 heads, both register stagings) as on the CPU."""
    from dsv4_jax import numerics

    rng = np.random.default_rng(7)
    slots = 2 * 201  # two keys a scale byte
    codes = rng.integers(0, 256, size=(1, slots, dim // 2), dtype=np.uint8)
    codes[0, : 512 // dim] = np.arange(256, dtype=np.uint8).reshape(-1, dim // 2)  # every code pair
    scale_bytes = np.repeat(np.arange(201, dtype=np.uint8), 2)[None, :, None].repeat(dim // 32, axis=-1)
    scales = (scale_bytes.astype(np.uint32) << 23).view(np.float32)
    dense = (numerics.unpack_fp4(codes) * np.repeat(scales, 32, axis=-1)).astype(jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(1, 2, 16, dim)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(1, 2, 16)).astype(np.float32))
    visible = jnp.asarray([[slots, slots - 5]], jnp.int32)
    picks, scores = jax.jit(lambda *a: native.select_topk_fp4(*a, top_k=64, graph=True))(
        q, w, jnp.asarray(codes), jnp.asarray(scale_bytes), visible)
    want_picks, want_scores = native.select_topk(q, w, jnp.asarray(dense), visible, top_k=64, graph=True)
    np.testing.assert_array_equal(np.asarray(scores), np.asarray(want_scores))
    np.testing.assert_array_equal(np.asarray(picks), np.asarray(want_picks))


@needs_native
@pytest.mark.parametrize(("heads", "dim", "slots", "dtype"), [
    (64, 128, 2600, jnp.bfloat16),  # V4's indexer: CUDA's tensor-core kernel, keys dequantized into its tiles
    (16, 48, 130, jnp.bfloat16),    # a partial scale block (48 channels: blocks of 32 and 16)
    (64, 128, 300, jnp.float32),    # CUDA's register-tiled FMA kernel
    (4, 16, 45, jnp.float32),       # the generic FMA kernel
    (16, 256, 70, jnp.bfloat16),    # CUDA's tensor-core kernel with the wide keys' register staging
    (16, 272, 40, jnp.bfloat16),    # wider than its staging holds: the tensor-core kernel, tiles unstaged
], ids=["v4", "partial-block", "f32-fast", "f32-generic", "wide", "wider"])
def test_select_topk_reads_packed_fp4_keys(heads, dim, slots, dtype):
    """An FP8 cache's indexer keys in their stored form (e2m1 codes two a byte, a scale byte a
    block of 32; empty rows of scale 0 included): the same scores, bit for bit, and picks as
    the native selection over the dequantized keys, and the XLA twin's picks."""
    from dsv4_jax import numerics
    from dsv4_jax.cache.quantized import QuantizedRows

    rng = np.random.default_rng(dim)
    q, w, keys, visible = random_selection_inputs(rng, dtype, batch=2, seq=4, heads=heads, dim=dim, slots=slots)
    keys = np.asarray(keys, np.float32) * np.exp2(rng.integers(-6, 6, size=(2, slots, 1)))
    keys[:, -3:] = 0.0  # rows never written: codes and scale bytes 0
    values, key_scales = numerics.quantize_to_bits(numerics.fp4_round_trip(keys, 32), 32, "fp4")
    rows = QuantizedRows(values=jnp.asarray(numerics.pack_fp4(values)), scales=jnp.asarray(key_scales),
                         rope=jnp.zeros((2, slots, 0), dtype), block=32, grid="fp4")
    dense = rows.dequantize()
    for graph in (False, True):
        picks, scores = jax.jit(lambda *a, graph=graph: native.select_topk_fp4(*a, top_k=64, graph=graph))(
            q, w, rows.values, rows.scales, visible)
        want_picks, want_scores = native.select_topk(q, w, dense, visible, top_k=64, graph=graph)
        np.testing.assert_array_equal(np.asarray(scores), np.asarray(want_scores))
        np.testing.assert_array_equal(np.asarray(picks), np.asarray(want_picks))
    xla = indexer.select_topk(q, w, rows, visible, top_k=64, with_scores=True)  # the twin reads QuantizedRows too
    np.testing.assert_array_equal(np.asarray(picks), reference_picks(np.asarray(scores), np.asarray(visible), 64))
    seen = np.isfinite(np.asarray(xla.scores))
    assert rel_err(np.asarray(scores)[seen], np.asarray(xla.scores)[seen]) < 1e-5
    # The layer's native selection with the handler's scoring hands the stored form over (no
    # dequantized copy of the keys). Pinned: on CUDA "auto" scores these 4 queries a row with the
    # Pallas kernel, which reads a dequantized copy unless select_keys="stored" (tests/ops/test_indexer_kernel.py).
    handler_scoring = dsv4_jax.KernelPlan(select="native", select_scores="native")
    select = plan_step(CSA, "none", kernels=handler_scoring).indexer_select()
    lowered = jax.jit(lambda q, w, rows, v: select(q, w, rows, v, top_k=64).picks).lower(q, w, rows, visible)
    assert "dsv4_select_topk_fp4" in lowered.as_text()
    copy = plan_step(CSA, "none", kernels=dataclasses.replace(handler_scoring, select_keys="dequantized"))
    lowered = jax.jit(lambda q, w, rows, v: copy.indexer_select()(q, w, rows, v, top_k=64).picks).lower(
        q, w, rows, visible)
    assert "dsv4_select_topk_fp4" not in lowered.as_text() and "dsv4_select_topk" in lowered.as_text()
    # The default everywhere: the stored form for the handler's scoring ("auto" stays in the plan:
    # the Pallas scoring kernel reads a dequantized copy unless "stored", tests/ops/test_indexer_kernel.py).
    assert dsv4_jax.KernelPlan().resolve("cpu", True).select_keys == "auto"
    assert dsv4_jax.KernelPlan().resolve("cuda", True).select_keys == "auto"
    with pytest.raises(ValueError, match=r"kernels\.select_keys"):
        dsv4_jax.KernelPlan(select_keys="packed")


@needs_native
def test_select_topk_under_vmap_and_grad():
    rng = np.random.default_rng(5)
    q, w, keys, visible = random_selection_inputs(rng, jnp.float32)
    single = native.select_topk(q, w, keys, visible, top_k=5, graph=False)[0]
    stacked = jax.vmap(lambda *a: native.select_topk(*a, top_k=5, graph=False)[0])(
        *(jnp.stack([a, a]) for a in (q, w, keys, visible)))
    np.testing.assert_array_equal(np.asarray(stacked), np.stack([single, single]))
    # The picks are integers: the break passes no gradient, and differentiating through it works.
    grad = jax.grad(lambda q: jnp.sum(jnp.take_along_axis(
        q[..., 0, 0], jnp.maximum(native.select_topk(q, w, keys, visible, top_k=5, graph=False)[0][..., 0], 0),
        axis=1)))(q)
    assert np.isfinite(np.asarray(grad)).all()


# ---------------------------------------------------------------------------- the layer
# The device, host and wide breaks' gradients equal the XLA reference's (a prefill and a decode
# step through the cache, every leaf): test_gradients.test_every_break_mode_gives_the_reference_gradient.


@needs_native
def test_device_narrow_decode_matches_host_narrow():
    """A prefill and decode steps: the device break gives the host break's picks and outputs."""
    cfg = dsv4_jax.DeepseekV4Config.tiny()
    x = np.random.default_rng(9).normal(size=(2, 30, cfg.hidden_size)).astype(np.float32)
    outs = {}
    for place in ("host", "device"):
        attn = random_layer(cfg, 1, seed=6, break_on=place)
        outs[place] = run_schedule(attn, x, [17] + [1] * 13)
    np.testing.assert_array_equal(outs["device"][0], outs["host"][0])
    np.testing.assert_array_equal(outs["device"][2].topk, outs["host"][2].topk)  # every call's picks


# ---------------------------------------------------------------------------- the plan
def _where(plan):
    return plan.mode, plan.place, plan.native_select


def test_plan_resolves_each_choice_once():
    plan = plan_step
    assert _where(plan(CSA, "narrow", "host")) == ("narrow", "host", False)
    assert _where(plan(CSA, "wide", "auto")) == ("wide", "host", False)
    assert _where(plan(HCA, "narrow", "device")) == ("none", None, False)  # nothing to break
    assert _where(plan(CSA, "none", "auto", "xla")) == ("none", None, False)
    if NATIVE_BUILT:
        assert _where(plan(CSA, "narrow", "auto")) == ("narrow", "device", True)
        assert _where(plan(CSA, "none", "auto")) == ("none", None, True)


def test_plan_errors_name_the_argument(monkeypatch):
    with pytest.raises(ValueError, match=r"break_on: 'device' is not available with break_mode='wide'"):
        plan_step(CSA, "wide", "device")
    with pytest.raises(ValueError, match=r"break_on: expected one of \('auto', 'host', 'device'\), got 'gpu'"):
        plan_step(CSA, "narrow", "gpu")
    with pytest.raises(ValueError, match=r"kernels: expected one of \('auto', 'xla', 'native', 'interpret'\) or a "
                                         r"dsv4_jax.KernelPlan, got 'pallas'"):
        dsv4_jax.DeepseekV4Attention(dsv4_jax.DeepseekV4Config.tiny(), 1, rngs=nnx.Rngs(0), kernels="pallas")
    with pytest.raises(ValueError, match=r"break_on='device': needs the native indexer handlers, but kernels='xla'"):
        plan_step(CSA, "narrow", "device", "xla")
    # A machine where nothing was built: "auto" falls back to the host, "device" says how to build.
    monkeypatch.setattr(native, "unavailable_reason", lambda platform: "dsv4_jax._native_cpu is not built; pip install")
    monkeypatch.setattr(native, "available", lambda platform: False)
    assert _where(plan_step(CSA, "narrow", "auto")) == ("narrow", "host", False)
    assert _where(plan_step(CSA, "none", "auto")) == ("none", None, False)
    with pytest.raises(ValueError, match=r"break_on=.device.: the native indexer handlers are not usable.*pip install"):
        plan_step(CSA, "narrow", "device")


def test_native_info_says_what_was_built():
    info = dsv4_jax.native_info()
    assert info["jax"] == jax.__version__
    for platform in ("cpu", "cuda"):
        entry = info[platform]
        assert entry["usable"] == (entry["built"] and "reason" not in entry)
        if entry["built"]:
            assert entry["ffi_api"] == "0.3"  # the oldest supported jaxlib's headers: loads on all
            # CUDA also has CSA's sparse attention backward (csrc/sparse_attention_backward_cuda.cu).
            cuda_only = {"dsv4_sparse_attention_backward"} if platform == "cuda" else set()
            selections = {f"dsv4_select_topk{keys}{layout}{graph}" for keys in ("", "_fp4")
                          for layout in ("", "_paged") for graph in ("", "_graph")}  # contiguous or paged keys
            assert set(entry["targets"]) == selections | {"dsv4_topk", "dsv4_topk_graph",
                                                          "dsv4_finite_flag"} | cuda_only
        else:
            assert "pip install" in entry["reason"]
