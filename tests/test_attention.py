"""The layer end to end: reference parity, execution-mode agreement, chunk invariance, causality.

Spec: every call of every recorded reference run reproduces HF's output within 2e-5
(relative Frobenius, float32) and HF's indexer picks exactly, in every break mode; any
schedule of calls (one shot, chunks, token by token) gives the one-shot result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import golden_layer, pad_picks, random_layer, rel_err, run_schedule

import dsv4_jax
from dsv4_jax.attention import _step

MODES = ("none", "narrow", "wide")
TOL = 2e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_replays_every_golden_call(golden, layer, mode):
    attn = golden_layer(golden, layer, mode)
    cache = attn.init_cache(golden.batch, sum(golden.schedule) + 3)
    for c in range(len(golden.schedule)):
        call = golden.call(layer, c)
        out, cache, inter = attn(jnp.asarray(call["hidden"]), call["positions"], cache, return_intermediates=True)
        err = rel_err(out, call["out"])
        assert err < TOL, f"{golden.name} layer {layer} call {c} ({mode}): rel err {err:.2e}"
        if "topk" in call:
            np.testing.assert_array_equal(
                np.asarray(inter.topk), pad_picks(call["topk"], golden.cfg.index_topk),
                err_msg=f"{golden.name} call {c} ({mode}): indexer picks differ from the reference",
            )


def test_golden_scores_match_reference(small):
    """The indexer scores themselves (not only the picks) match HF's, where visible."""
    attn = golden_layer(small, 1, "narrow")
    cache = attn.init_cache(small.batch, sum(small.schedule))
    for c in range(len(small.schedule)):
        call = small.call(1, c)
        _, cache, inter = attn(jnp.asarray(call["hidden"]), call["positions"], cache, return_intermediates=True)
        ref = call["index_scores"]  # [B, S, entries after this call], before masking
        ours = np.asarray(inter.index_scores)[..., : ref.shape[-1]]
        seen = np.isfinite(ours)
        np.testing.assert_array_equal(seen, np.arange(ref.shape[-1]) < (call["positions"][..., None] + 1) // 4)
        np.testing.assert_allclose(ours[seen], ref[seen], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- modes
@pytest.fixture(scope="module")
def long_input():
    cfg = dsv4_jax.DeepseekV4Config.tiny()
    x = np.random.default_rng(7).normal(size=(2, 53, cfg.hidden_size)).astype(np.float32)
    return cfg, x


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_all_break_modes_agree(long_input, layer):
    """Same picks in every mode; none and narrow are bit-identical (only the top-k moves)."""
    cfg, x = long_input
    schedule = [21, 1, 1, 12, 1, 17]
    results = {}
    for mode in MODES:
        attn = random_layer(cfg, layer, seed=3, break_mode=mode)
        out, extras, _ = run_schedule(attn, x, schedule, return_intermediates=True)
        picks = [None if e[0].topk is None else np.asarray(e[0].topk) for e in extras]
        results[mode] = out, picks
    base_out, base_picks = results["none"]
    for mode in ("narrow", "wide"):
        out, picks = results[mode]
        for a, b in zip(base_picks, picks):
            if a is not None:
                np.testing.assert_array_equal(a, b, err_msg=f"picks differ: none vs {mode}")
        if mode == "narrow":
            np.testing.assert_array_equal(out, base_out)
        else:  # the wide break runs the same stage math in NumPy instead of XLA
            assert rel_err(out, base_out) < 1e-6


def test_break_mode_can_be_switched_between_calls(long_input):
    cfg, x = long_input
    attn = random_layer(cfg, 1, seed=3, break_mode="none")
    ref, _, _ = run_schedule(attn, x, [30, 1, 1, 21])
    cache = attn.init_cache(2, 53)
    outs, start = [], 0
    for n, mode in zip([30, 1, 1, 21], ["narrow", "wide", "none", "narrow"]):
        attn.break_mode = mode
        pos = np.broadcast_to(np.arange(start, start + n, dtype=np.int32), (2, n))
        out, cache = attn(jnp.asarray(x[:, start:start + n]), pos, cache)
        outs.append(np.asarray(out))
        start += n
    assert rel_err(np.concatenate(outs, 1), ref) < 1e-6


# ---------------------------------------------------------------------------- schedules
SCHEDULES = {
    "one_shot": [53],
    "chunked": [13, 7, 1, 1, 9, 22],
    "short_first": [3, 1, 1, 1, 47],
    "token_by_token": [1] * 53,
}


@pytest.fixture(scope="module")
def schedule_runs(long_input):
    """Each layer type run under each schedule (narrow mode, intermediates on)."""
    cfg, x = long_input
    runs = {}
    for layer in (0, 1, 2):
        attn = random_layer(cfg, layer, seed=5)
        for name, schedule in SCHEDULES.items():
            out, extras, cache = run_schedule(attn, x, schedule, return_intermediates=True)
            runs[layer, name] = out, [e[0] for e in extras], cache
    return runs


@pytest.mark.parametrize("schedule", ["chunked", "short_first", "token_by_token"])
@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_output_does_not_depend_on_chunking(schedule_runs, layer, schedule):
    one_shot, ref_inter, ref_cache = schedule_runs[layer, "one_shot"]
    out, inters, cache = schedule_runs[layer, schedule]
    assert rel_err(out, one_shot) < TOL
    if layer == 1:
        picks = np.concatenate([np.asarray(i.topk) for i in inters], axis=1)
        np.testing.assert_array_equal(picks, np.asarray(ref_inter[0].topk))
    # The caches end in the same state too (entries are never recomputed, only appended).
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(ref_cache)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)


def test_decode_matches_teacher_forced_prefill(schedule_runs):
    """Token-by-token decode after a short prefill = the one-shot (teacher-forced) prefill."""
    for layer in (0, 1, 2):
        decode, _, _ = schedule_runs[layer, "token_by_token"]
        prefill, _, _ = schedule_runs[layer, "one_shot"]
        for t in (0, 7, 8, 31, 52):  # around window and compression boundaries
            assert rel_err(decode[:, t], prefill[:, t]) < TOL, f"layer {layer}, position {t}"


def test_picks_obey_causality_and_count(schedule_runs, long_input):
    """A query never picks an unfinished window; it gets min(top-k, visible) distinct picks."""
    cfg, _x = long_input
    _, inters, _ = schedule_runs[1, "token_by_token"]
    m, k = cfg.csa_compress_rate, cfg.index_topk
    for t, inter in enumerate(inters):
        picks = np.asarray(inter.topk)[:, 0]  # [B, K]
        visible = (t + 1) // m
        for row in picks:
            valid = row[row >= 0]
            assert len(valid) == min(k, visible), f"position {t}: {row}"
            assert (valid < visible).all(), f"position {t} picked an unfinished window: {row}"
            assert len(set(valid.tolist())) == len(valid)
            assert (row[len(valid):] == -1).all(), "valid picks come first, then -1"


def test_future_tokens_do_not_change_past_outputs(long_input):
    cfg, x = long_input
    for layer in (1, 2):
        attn = random_layer(cfg, layer, seed=9, break_mode="none")
        full, _, _ = run_schedule(attn, x, [53])
        prefix, _, _ = run_schedule(attn, x[:, :29], [29])
        assert rel_err(prefix, full[:, :29]) < TOL


def test_ties_go_to_the_lower_entry_index(long_input):
    """With zero head weights every score is exactly 0: picks are the first visible entries."""
    cfg, x = long_input
    for mode in MODES:
        attn = random_layer(cfg, 1, seed=2, break_mode=mode)
        attn.indexer.weights_proj[...] = jnp.zeros_like(attn.indexer.weights_proj[...])
        _, extras, _ = run_schedule(attn, x[:, :40], [40], return_intermediates=True)
        picks = np.asarray(extras[0][0].topk)
        for t in range(40):
            n = min(cfg.index_topk, (t + 1) // cfg.csa_compress_rate)
            expected = list(range(n)) + [-1] * (cfg.index_topk - n)
            assert picks[0, t].tolist() == expected, f"{mode}, position {t}"


def test_short_context_pads_with_minus_one():
    """Fewer entries than top-k (and a cache too short for top-k entry slots) still work."""
    cfg = dsv4_jax.DeepseekV4Config.tiny(index_topk=64)
    attn = random_layer(cfg, 1, seed=4)
    x = np.random.default_rng(0).normal(size=(1, 10, cfg.hidden_size)).astype(np.float32)
    _, extras, _ = run_schedule(attn, x, [6, 1, 3], max_seq_len=12, return_intermediates=True)
    picks = np.concatenate([np.asarray(e[0].topk) for e in extras], axis=1)[0]
    assert picks.shape == (10, 64)
    for t in range(10):
        n = (t + 1) // 4
        assert sorted(picks[t, :n].tolist()) == list(range(n)) and (picks[t, n:] == -1).all()


# ---------------------------------------------------------------------------- compilation
def test_decode_steps_reuse_one_compiled_step():
    cfg = dsv4_jax.DeepseekV4Config.tiny(sliding_window=5)  # a config no other test compiles
    attn = random_layer(cfg, 1, seed=1)
    x = np.random.default_rng(1).normal(size=(1, 30, cfg.hidden_size)).astype(np.float32)
    cache = attn.init_cache(1, 30)
    before = _step._cache_size()
    attn(jnp.asarray(x[:, :10]), np.arange(10, dtype=np.int32)[None], cache)  # compile: prefill
    _, cache = attn(jnp.asarray(x[:, :10]), np.arange(10, dtype=np.int32)[None], cache)
    after_prefill = _step._cache_size()
    for t in range(10, 30):
        _out, cache = attn(jnp.asarray(x[:, t:t + 1]), np.array([[t]], np.int32), cache)
    assert after_prefill - before == 1
    assert _step._cache_size() - after_prefill == 1  # one decode step compiled, 20 calls


def test_works_inside_a_users_nnx_jit(long_input):
    cfg, x = long_input
    attn = random_layer(cfg, 1, seed=6)
    eager, _, _ = run_schedule(attn, x[:, :24], [20, 1, 1, 1, 1])

    @nnx.jit
    def step(layer, hidden, positions, cache):
        return layer(hidden, positions, cache)

    cache = attn.init_cache(2, 24)
    outs, start = [], 0
    for n in (20, 1, 1, 1):
        pos = jnp.broadcast_to(jnp.arange(start, start + n, dtype=jnp.int32), (2, n))
        out, cache = step(attn, jnp.asarray(x[:, start:start + n]), pos, cache)
        outs.append(np.asarray(out))
        start += n
    assert rel_err(np.concatenate(outs, 1), eager[:, :23]) < 1e-6
    # A cache that comes back from a traced call (length on the device) still works eagerly.
    out, cache = attn(jnp.asarray(x[:, 23:24]), np.array([[23], [23]], np.int32), cache)
    assert rel_err(out, eager[:, 23:24]) < 1e-6


def test_donated_cache_gives_the_same_result(long_input):
    cfg, x = long_input
    ref, _, _ = run_schedule(random_layer(cfg, 2, seed=8), x, [30, 1, 22])
    out, _, _ = run_schedule(random_layer(cfg, 2, seed=8, donate_cache=True), x, [30, 1, 22])
    np.testing.assert_array_equal(out, ref)


def test_query_blocks_do_not_change_the_result(long_input):
    """Long prefills run the indexer scoring and sparse attention in query blocks (a lax.map)."""
    cfg, x = long_input
    for layer in (1, 2):
        ref, ref_extras, _ = run_schedule(random_layer(cfg, layer, seed=4), x, [53], return_intermediates=True)
        blocked = random_layer(cfg, layer, seed=4, query_block=7)
        out, extras, _ = run_schedule(blocked, x, [53], return_intermediates=True)
        assert rel_err(out, ref) < 1e-6
        if layer == 1:
            np.testing.assert_array_equal(np.asarray(extras[0][0].topk), np.asarray(ref_extras[0][0].topk))
