"""bench/topk.py (the indexer's selection alone) and the per-kernel split of
bench/kernel_profile.py, at CPU sizes: what the H200 runs records, and its variants agree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from dsv4_jax import native


def test_a_prefill_query_block_records_each_variant_and_its_picks_agree():
    """`select_prefill`: the native selection, the top-k alone on its scores, the candidate
    Pallas scoring (bench/score_kernel.py, interpret mode here) followed by the native top-k,
    and the XLA twin pick the same entries for a block of queries on a causal ramp; each record
    carries the shape and the scoring's FLOPs (2 nI c per visible entry and query)."""
    from bench import topk

    records = topk.select_prefill_case(seq=8, slots=96, heads=4, dim=16, k=8, unroll=1, repeats=1,
                                       configs="1:32:2:4:3,2:16:4:4:2")
    by_variant = {r["variant"]: r for r in records}
    assert set(by_variant) == {"native-graph", "native-topk-alone", "native-pallas-scores[r1 b32 t2 w4 s3]+topk",
                               "native-pallas-scores[r2 b16 t4 w4 s2]+topk", "xla"}
    visible = [96 - (8 - 1 - s) // 4 for s in range(8)]
    for r in records:
        if native.available(jax.default_backend()):
            assert r["picks_equal"], r
            assert r["us_per_op_median"] > 0 and r["seq"] == 8 and r["slots"] == 96 and r["top_k"] == 8
            assert r["score_flops"] == pytest.approx(2.0 * 4 * 16 * sum(visible))
        else:
            assert "skipped" in r or r["variant"] == "xla"
    with pytest.raises(ValueError, match="rows:block:tiles:warps:stages"):
        topk.pallas_configs("1:128:8")


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


def test_a_decode_step_over_fp4_keys_times_the_candidate_on_their_bf16_values():
    """`select_fp4`: the stored-form selection, the dequantized copy, the bf16 keys and the
    candidate Pallas scoring over them (configurations of one query row a program only) pick
    alike."""
    from bench import topk

    records = topk.select_fp4_case(batch=2, slots=64, heads=16, dim=32, k=8, unroll=1, repeats=1,
                                   configs="1:32:2:4:3,2:32:2:4:3")
    names = [r["variant"] for r in records]
    assert names == ["native-fp4-stored", "native-fp4-dequantized", "native-bf16-keys",
                     "native-pallas-scores[r1 b32 t2 w4 s3]+topk"]
    if native.available(jax.default_backend()):
        assert all(r["picks_equal"] for r in records), records


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_the_candidate_pallas_scoring_equals_the_xla_twin(rows):
    """bench/score_kernel.py (interpret mode): the XLA twin's scores (`indexer.index_scores`)
    within float32 rounding of the sums, -inf exactly where an entry is not visible (rows that
    see nothing, one entry, a block's edge, every entry; blocks past every row's entries not
    loaded), for one, two and four query rows a program; a row count that does not divide S is
    refused."""
    import numpy as np

    from bench import score_kernel
    from dsv4_jax import indexer

    rng = np.random.default_rng(0)
    batch, seq, heads, dim, slots = 2, 4, 16, 32, 300
    q = jnp.asarray(rng.standard_normal((batch, seq, heads, dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((batch, seq, heads)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((batch, slots, dim)), jnp.bfloat16)
    visible = jnp.asarray([[0, 5, 128, 300], [299, 17, 64, 1]], jnp.int32)
    got = np.asarray(score_kernel.scores(q.reshape(-1, heads, dim), w.reshape(-1, heads), keys, visible.reshape(-1),
                                         rows_per_batch=seq, rows=rows, block=16, tiles=4, interpret=True))
    want = np.asarray(indexer.index_scores(q.astype(jnp.float32), w, keys.astype(jnp.float32), visible))
    want = want.reshape(batch * seq, slots)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    seen = np.isfinite(want)
    np.testing.assert_allclose(got[seen], want[seen], rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="S % rows == 0"):
        score_kernel.scores(q.reshape(-1, heads, dim), w.reshape(-1, heads), keys, visible.reshape(-1),
                            rows_per_batch=seq, rows=3, interpret=True)


def test_the_candidate_lowers_to_a_triton_kernel_for_cuda():
    """At V4's sizes (nI = 64, c = 128, a query block of 256 against 8,192 entries) the kernel
    lowers, on this CPU, to the Triton custom call a GPU compiles: what interpret mode cannot
    check (the Triton lowering of its loop, dot and reductions)."""
    from bench import score_kernel

    rows_total, heads, dim, slots = 256, 64, 128, 8192
    args = (jax.ShapeDtypeStruct((rows_total, heads, dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((rows_total, heads), jnp.float32),
            jax.ShapeDtypeStruct((1, slots, dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((rows_total,), jnp.int32))
    for rows in (1, 2):
        def step(q, w, k, v, rows=rows):
            return score_kernel.scores(q, w, k, v, rows_per_batch=rows_total, rows=rows)

        try:
            text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        except RuntimeError as err:  # jax >= 0.12 reads the GPU's compute capability here
            if "No supported GPU devices found" not in str(err):
                raise
            pytest.skip("this jax lowers Pallas' Triton kernels only where a GPU is present")
        assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text, text[:2000]
