"""Decode's split merge as one kernel (`split_merge_kernel`) against its XLA twin: `combine`
(the splits and the sink merged) then the inverse RoPE (`rope.apply_rope`).

The CPU runs the kernel in Pallas' interpret mode (the same kernel body, executed by XLA); on
CUDA the Triton kernel itself runs (the flash-size case: `bench/gpu.sh gates`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import prefill_then_decode, random_layer

import dsv4_jax
from dsv4_jax import KernelPlan
from dsv4_jax.ops.sparse_attention import split_merge_pallas as split_merge_kernel
from dsv4_jax.ops.sparse_attention.pallas import sparse_attention_kernel

ON_GPU = jax.default_backend() == "gpu"
KERNEL = "pallas" if ON_GPU else "interpret"


def partials(rows, splits, heads, d, seed=0, empty_split=True):
    """acc, m, total as the decode kernel leaves them (a split that saw no key: m = -inf, 0 sums)."""
    rng = np.random.default_rng(seed)
    acc = rng.normal(size=(rows, splits, heads, d)).astype(np.float32)
    m = rng.normal(size=(rows, splits, heads)).astype(np.float32)
    total = rng.uniform(0.5, 3.0, size=(rows, splits, heads)).astype(np.float32)
    if empty_split:
        m[0, -1], acc[0, -1], total[0, -1] = -np.inf, 0.0, 0.0
    sinks = rng.normal(size=heads).astype(np.float32)
    return jnp.asarray(acc), jnp.asarray(m), jnp.asarray(total), jnp.asarray(sinks)


def rotation(rows, half, seed=1):
    rng = np.random.default_rng(seed)
    positions = jnp.asarray(rng.integers(0, 70000, size=rows), jnp.int32)
    return positions, (1.0 / 10000 ** (np.arange(half, dtype=np.float32) / half)).astype(np.float32), 1.0


@pytest.mark.parametrize("rows,splits,heads,d,half", [(1, 32, 8, 64, 8), (3, 5, 16, 32, 4), (4, 2, 4, 64, 0)],
                         ids=["one-row-32-splits", "odd-splits", "no-rotation"])
def test_the_kernel_gives_combine_then_the_inverse_rope_in_float32(rows, splits, heads, d, half):
    acc, m, total, sinks = partials(rows, splits, heads, d)
    rot = rotation(rows, half) if half else None
    got = split_merge_kernel.merge_splits(acc, m, total, sinks, jnp.float32, rot, interpret=True)
    want = split_merge_kernel.reference(acc, m, total, sinks, jnp.float32, rot)
    assert got.shape == (rows, heads, d) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)


def test_the_bf16_result_is_rounded_before_and_after_the_rotation():
    """As `apply_rope` reads the merged output: rounded to bf16, rotated in float32, rounded
    again; the channels that do not rotate are the merged output's."""
    acc, m, total, sinks = partials(2, 4, 8, 64, seed=3)
    rot = rotation(2, 8)
    got = split_merge_kernel.merge_splits(acc, m, total, sinks, jnp.bfloat16, rot, interpret=True)
    want = split_merge_kernel.reference(acc, m, total, sinks, jnp.bfloat16, rot)
    unrotated = split_merge_kernel.combine(acc, m, total, sinks, jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got[..., :48], np.float32), np.asarray(unrotated[..., :48], np.float32))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=8e-3, atol=1e-6)
    assert np.mean(np.asarray(got == want)) > 0.99  # one unit in the last place at most, rarely


@pytest.mark.skipif(not ON_GPU, reason="the Triton kernel at V4-Flash sizes (the CPU runs the same code at tiny sizes)")
@pytest.mark.parametrize("rows,splits", [(1, 32), (32, 4)], ids=["B1", "B32"])
def test_the_triton_kernel_at_flash_sizes(rows, splits):
    acc, m, total, sinks = partials(rows, splits, 64, 512, seed=rows)
    rot = rotation(rows, 32)
    got = split_merge_kernel.merge_splits(acc, m, total, sinks, jnp.bfloat16, rot)
    want = split_merge_kernel.reference(acc, m, total, sinks, jnp.bfloat16, rot)
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    equal = np.mean(np.asarray(got == want))
    print(f"split merge bf16 B={rows}: max |kernel - XLA| {diff.max():.3g}, equal {equal:.5f}")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=8e-3, atol=1e-6)


def test_blocks_and_the_shapes_it_takes():
    assert split_merge_kernel.block_columns(512, 32) == 64 and split_merge_kernel.block_columns(512, 0) == 64
    assert split_merge_kernel.block_heads(1, 64, 8) == 1  # 512 programs
    assert split_merge_kernel.block_heads(32, 64, 8) == 8  # 2048 programs, the cap of 8 heads
    assert split_merge_kernel.block_heads(4, 64, 8) == 4  # 1024 programs
    q = jnp.zeros((1, 1, 4, 64))
    assert split_merge_kernel.supports(q, None) and split_merge_kernel.supports(q, rotation(1, 32))
    assert not split_merge_kernel.supports(jnp.zeros((1, 1, 4, 48)), None)  # Triton's tensors: powers of two
    assert not split_merge_kernel.supports(q, rotation(1, 12))


@pytest.mark.parametrize("queries", [1, 3], ids=["decode", "prompt"])
def test_the_attention_kernel_merges_its_splits_through_it(queries):
    """`sparse_attention_kernel` with several splits and an output rotation: merge "interpret"
    (the kernel) equals merge "xla" (`combine`, then the rotation), for one query a row and for
    several (each query a row of its own, at its own position)."""
    rng = np.random.default_rng(5)
    b, s, h, d, w, t, k = 2, queries, 8, 64, 16, 40, 8
    q = jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32)
    pool = jnp.asarray(rng.normal(size=(b, w, d)), jnp.float32)
    window_idx = jnp.asarray(np.broadcast_to(np.where(np.arange(w) < 11, np.arange(w), -1), (b, s, w)), jnp.int32)
    entries = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    picks = jnp.asarray(np.broadcast_to(rng.permutation(t)[:k], (b, s, k)), jnp.int32).at[1, 0, -3:].set(-1)
    sinks = jnp.asarray(rng.normal(size=h), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 5000, size=(b, s)), jnp.int32)
    rot = (positions, rotation(1, 8)[1], 1.0)
    run = lambda merge: sparse_attention_kernel(q, pool, window_idx, sinks, entries=entries, picks=picks,  # noqa: E731
                                                interpret=True, block_keys=4, splits=3, rotation=rot, merge=merge)
    np.testing.assert_allclose(np.asarray(run("interpret")), np.asarray(run("xla")), rtol=2e-6, atol=2e-6)


def test_auto_takes_the_kernel_where_it_measured_faster():
    """CSA decode batches of at least 16 rows (where the attention kernel's batch blocks run);
    one-row decode and HCA keep XLA's merge; an explicit choice is kept."""
    assert KernelPlan(split_merge="auto").merge_for("csa", 32) == "pallas"
    assert KernelPlan(split_merge="auto").merge_for("csa", 16) == "pallas"
    assert KernelPlan(split_merge="auto").merge_for("csa", 1) == "xla"
    assert KernelPlan(split_merge="auto").merge_for("hca", 32) == "xla"
    assert KernelPlan(split_merge="auto").merge_for("sliding", 64) == "xla"
    assert KernelPlan(split_merge="interpret").merge_for("hca", 1) == "interpret"
    assert KernelPlan(split_merge="xla").merge_for("csa", 32) == "xla"


def test_the_plan_names_the_stage():
    assert KernelPlan().split_merge == "auto"
    assert KernelPlan.named("xla").split_merge == "xla"
    assert KernelPlan.named("interpret").split_merge == "interpret"
    assert KernelPlan(split_merge="pallas").resolve("cpu", False).split_merge == "xla"
    with pytest.raises(ValueError, match=r"kernels\.split_merge"):
        KernelPlan(split_merge="triton")


@pytest.mark.parametrize("layer", [1, 2], ids=["csa", "hca"])
def test_a_layer_decoding_through_the_kernel_equals_the_layer_without(layer, monkeypatch):
    """The tiny layer in float32, a prefill then decode steps of a batch of 2 with the decode
    attention kernel: its splits merged by the kernel or by XLA give the same outputs and
    caches, and the kernel ran."""
    calls, merge = [], split_merge_kernel.merge_splits
    monkeypatch.setattr(split_merge_kernel, "merge_splits",
                        lambda *a, **kw: calls.append(a[0].shape) or merge(*a, **kw))
    cfg = dsv4_jax.DeepseekV4Config.tiny()
    hidden = jnp.asarray(np.random.default_rng(layer).normal(size=(2, 24, cfg.hidden_size)), jnp.float32)

    def run(kernel):
        plan = KernelPlan(decode_attention="interpret", split_merge=kernel, decode_blocks=(4, 64, 4, 1))
        return prefill_then_decode(random_layer(cfg, layer, seed=layer, break_mode="none", kernels=plan), hidden, 20)

    (want, want_cache), (got, got_cache) = run("xla"), run("interpret")
    assert calls and all(shape[0] == 2 and shape[1] > 1 for shape in calls)  # decode rows, several splits
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for g, w in zip(got_cache, want_cache):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
