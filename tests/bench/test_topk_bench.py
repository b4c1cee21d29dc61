"""bench/topk.py (the indexer's selection alone) and the per-kernel split of
bench/kernel_profile.py, at CPU sizes: what the H200 runs records, and its variants agree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from dsv4_jax import native


def test_a_prefill_query_block_records_each_variant_and_its_picks_agree():
    """`select_prefill`: the native selection, the top-k alone on its scores, the candidate
    Pallas scoring (dsv4_jax.ops.indexer.pallas, interpret mode here) followed by the native top-k,
    and the XLA twin pick the same entries for a block of queries on a causal ramp; each record
    carries the shape and the scoring's FLOPs (2 nI c per visible entry and query)."""
    from bench import topk

    records = topk.select_prefill_case(seq=8, slots=96, heads=4, dim=16, k=8, unroll=1, repeats=1,
                                       configs="32:2:4:3,16:4:4:2")
    by_variant = {r["variant"]: r for r in records}
    assert set(by_variant) == {"native-graph", "native-topk-alone", "native-pallas-scores[b32 t2 w4 s3]+topk",
                               "native-pallas-scores[b16 t4 w4 s2]+topk", "xla"}
    visible = [96 - (8 - 1 - s) // 4 for s in range(8)]
    for r in records:
        if native.available(jax.default_backend()):
            assert r["picks_equal"], r
            assert r["us_per_op_median"] > 0 and r["seq"] == 8 and r["slots"] == 96 and r["top_k"] == 8
            assert r["score_flops"] == pytest.approx(2.0 * 4 * 16 * sum(visible))
        else:
            assert "skipped" in r or r["variant"] == "xla"
    with pytest.raises(ValueError, match="block:tiles:warps:stages"):
        topk.pallas_configs("128:8")


def test_a_decode_step_over_paged_keys_picks_as_over_the_contiguous_keys():
    """`select`: the handler over the keys in a paged cache's pool (pages scattered through it, a
    partial last page) picks what it picks over the contiguous keys, and what XLA picks."""
    from bench import topk

    records = topk.select_case(batch=2, slots=150, heads=16, dim=32, k=8, unroll=1, repeats=1, dtype=jnp.float32)
    assert [r["variant"] for r in records] == ["xla", "native-graph", "native-eager", "native-graph-paged"]
    if native.available(jax.default_backend()):
        assert all(r["picks_equal"] for r in records), records


@pytest.mark.parametrize("kind", ["tied", "continuous"])
def test_the_topk_case_records_its_kind_of_scores_and_the_variants_agree(kind):
    """`topk`: the native top-k (both targets) and `lax.top_k` pick the same entries, on tied
    scores (the CUDA kernel's sort) and on continuous ones (its placement); each record says which."""
    from bench import topk

    records = topk.topk_case(rows=2, slots=64, k=8, unroll=1, repeats=1, scores_kind=kind)
    assert {r["variant"] for r in records} == {"xla-lax.top_k", "native-graph", "native-eager"}
    for r in records:
        if "skipped" in r:  # no native handler on this platform
            assert r["variant"].startswith("native"), r
            continue
        assert r["scores"] == kind and r["slots"] == 64 and r["top_k"] == 8 and r["picks_equal"], r


def test_the_profile_splits_an_operation_into_its_kernels(tmp_path):
    """`kernel_profile.profile` lists, besides the per-operation rows, the kernels by name (an
    operation such as the selection's custom call launches two): times per step, largest first,
    within the device's busy time."""
    from bench import kernel_profile

    x = jnp.ones((64, 64), jnp.float32)
    fn = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    summary = kernel_profile.profile(lambda: jax.block_until_ready(fn(x)), 2, str(tmp_path))
    kernels = summary["kernels"]
    assert kernels and all(set(k) == {"kernel", "us_per_step", "per_step"} for k in kernels)
    times = [k["us_per_step"] for k in kernels]
    assert times == sorted(times, reverse=True)
    assert sum(times) <= summary["busy_us_per_step"] * (1 + 1e-9)


def test_a_decode_step_over_fp4_keys_times_the_pallas_scoring_on_their_bf16_values():
    """`select_fp4`: the stored-form selection (contiguous and in a paged pool's scattered pages),
    the dequantized copy, the bf16 keys and the Pallas scoring over those, over the stored form
    and on FP8 tensor cores pick alike."""
    from bench import topk

    records = topk.select_fp4_case(batch=2, slots=64, heads=16, dim=32, k=8, unroll=1, repeats=1,
                                   configs="32:2:4:3")
    names = [r["variant"] for r in records]
    assert names == ["native-fp4-stored", "native-fp4-dequantized", "native-bf16-keys", "native-fp4-stored-paged",
                     "native-pallas-scores[b32 t2 w4 s3]+topk", "native-pallas-fp4-scores[b32 t2 w4 s3]+topk",
                     "native-pallas-fp8-scores[b32 t2 w4 s3]+topk"]
    if native.available(jax.default_backend()):
        assert all(r["picks_equal"] for r in records), records
