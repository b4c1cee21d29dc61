"""Ragged batches: rows with their own lengths and their own number of new tokens per call.

A row's padded slots are at position -1 after its real tokens. The contract checked here:
each row's outputs equal that row run alone with the same chunks (every layer type and
execution mode, eager and under the user's `jax.jit`), with identical indexer picks; padded
slots output zeros and change nothing in the cache; `cache.length` counts real tokens;
`reset_rows` empties rows and the same compiled step keeps serving. The misuse rows (padding
inside a row, a row not continuing its own length, a call of padding only) are in
tests/layer/test_misuse.py, eager and as checkify checks.

Compile time bounds the cost: two ragged call shapes ([3, 13] and [3, 1]) per layer and
mode, three single-row shapes (13, 5, 1) for the references.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import EXECUTIONS, JOBS, background, execution, random_layer

import dsv4_jax
from dsv4_jax.cache.contiguous import reset_rows
from dsv4_jax.step.plan import plan_step
from dsv4_jax.step.pure_step import compiled_steps

CFG = dsv4_jax.DeepseekV4Config.tiny()
LAYERS = {"sliding": 0, "csa": 1, "hca": 2}
MAX_SEQ_LEN = 40
# Real tokens per row in each call (0: the row has only padding in that call). Every row's
# chunks are 13, 5 or 1 long, so the single-row references compile three shapes per layer.
SCHEDULE = [  # (call width S, tokens of rows 0, 1, 2)
    (13, (13, 5, 0)),
    (13, (1, 13, 13)),
    (13, (13, 0, 5)),
    (1, (1, 1, 0)),
]
BATCH = 3


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    total = max(sum(n[b] for _, n in SCHEDULE) for b in range(BATCH))
    return rng.normal(size=(BATCH, total, CFG.hidden_size)).astype(np.float32)


def ragged_calls(hidden):
    """The schedule as (x [B, S, hidden], positions [B, S]) pairs: real tokens first, -1 after;
    padded slots hold garbage-free but nonzero inputs (they must not matter)."""
    start = np.zeros(BATCH, np.int64)
    calls = []
    for width, counts in SCHEDULE:
        x = np.full((BATCH, width, CFG.hidden_size), 0.5, np.float32)
        pos = np.full((BATCH, width), -1, np.int32)
        for b, n in enumerate(counts):
            x[b, :n] = hidden[b, start[b]:start[b] + n]
            pos[b, :n] = np.arange(start[b], start[b] + n)
            start[b] += n
        calls.append((x, pos))
    return calls


@functools.cache
def layer(kind: str, mode: str):
    return random_layer(CFG, LAYERS[kind], seed=3, **EXECUTIONS[mode])


def picks_of(res):
    return None if len(res) < 3 or res[2].topk is None else np.asarray(res[2].topk)


@functools.cache
def alone(kind: str):
    """Each row run alone (batch 1, no padding) with its own chunks, in the XLA reference mode:
    per row and call, (out [n, hidden], picks [n, K] or None), None where the row had nothing."""
    attn = layer(kind, "none")
    hidden = inputs()
    results = []
    for b in range(BATCH):
        cache, start, per_call = attn.init_cache(1, MAX_SEQ_LEN), 0, []
        for _, counts in SCHEDULE:
            n = counts[b]
            if n == 0:
                per_call.append(None)
                continue
            res = attn(jnp.asarray(hidden[b:b + 1, start:start + n]), np.arange(start, start + n, dtype=np.int32)[None],
                       cache, return_intermediates=True)
            cache = res[1]
            picks = picks_of(res)
            per_call.append((np.asarray(res[0])[0], None if picks is None else picks[0]))
            start += n
        results.append(per_call)
    return results


def check_against_alone(kind, outs, picks_per_call, calls, tol=2e-5):
    ref = alone(kind)
    for c, (out, (_, pos)) in enumerate(zip(outs, calls)):
        out = np.asarray(out)
        for b in range(BATCH):
            n = int((pos[b] >= 0).sum())
            assert np.all(out[b, n:] == 0), (c, b)  # padded slots output zeros
            if ref[b][c] is None:
                continue
            want, want_picks = ref[b][c]
            err = np.linalg.norm(out[b, :n] - want) / np.linalg.norm(want)
            assert err < tol, (kind, c, b, err)
            if want_picks is not None and picks_per_call is not None:
                np.testing.assert_array_equal(picks_per_call[c][b, :n], want_picks, err_msg=f"call {c} row {b}")
                assert np.all(picks_per_call[c][b, n:] == -1)


def _distinct(kind, mode):
    """Modes that resolve to the same compiled step as another one run once (as in test_attention)."""
    plan = plan_step(attention_layer_type(kind), **{k: v for k, v in EXECUTIONS[mode].items()
                                                           if k in ("break_mode", "break_on", "kernels")})
    if mode != "none" and plan == plan_step(attention_layer_type(kind), "none", kernels="xla"):
        pytest.skip("same compiled step as 'none'")


def attention_layer_type(kind):
    return CFG.layer_type(LAYERS[kind])


def _user_jit(attn):
    """The layer's call under the user's own `jax.jit` (split state, merged inside)."""
    graphdef, _ = nnx.split(attn)
    f = jax.jit(lambda state, x, p, c: nnx.merge(graphdef, state)(x, p, c, return_intermediates=True))
    return lambda x, p, c: f(nnx.state(attn), x, p, c)


@pytest.mark.parametrize("mode", list(EXECUTIONS))
@pytest.mark.parametrize("kind", list(LAYERS))
def test_each_row_equals_the_row_alone(kind, mode):
    execution(mode)
    _distinct(kind, mode)
    attn = layer(kind, mode)
    calls = ragged_calls(inputs())
    cache = attn.init_cache(BATCH, MAX_SEQ_LEN)
    outs, picks, lengths = [], [], []
    for x, pos in calls:
        before = cache
        res = attn(jnp.asarray(x), pos, cache, return_intermediates=True)
        out, cache = res[0], res[1]
        outs.append(out)
        picks.append(picks_of(res))
        lengths.append(np.asarray(cache.length).tolist())
        assert isinstance(cache.length, np.ndarray)  # the eager host mirror, advanced per row
        for b in np.flatnonzero((pos < 0).all(axis=1)):  # a row of padding only: its cache is untouched
            for leaf_before, leaf_after in zip(jax.tree.leaves(before), jax.tree.leaves(cache)):
                np.testing.assert_array_equal(np.asarray(leaf_before)[b], np.asarray(leaf_after)[b])
    expected_lengths = np.cumsum([counts for _, counts in SCHEDULE], axis=0).tolist()
    assert lengths == expected_lengths  # real tokens only
    check_against_alone(kind, outs, picks if picks[0] is not None else None, calls)

    # Under the user's jax.jit: the same outputs, and the step's device length counts real tokens.
    step = _user_jit(attn)
    cache = attn.init_cache(BATCH, MAX_SEQ_LEN)
    jit_outs, jit_picks = [], []
    for c, (x, pos) in enumerate(calls[:3]):  # the [3, 13] calls: one compile
        out, cache, inter = step(jnp.asarray(x), pos, cache)
        jit_outs.append(out)
        jit_picks.append(None if inter.topk is None else np.asarray(inter.topk))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(outs[c]))
    assert np.asarray(cache.length).tolist() == expected_lengths[2]
    check_against_alone(kind, jit_outs, jit_picks if jit_picks[0] is not None else None, calls[:3])


def test_padded_slots_change_nothing_and_a_padding_row_is_untouched():
    # The CSA layer (window ring, both compressors, the indexer): a call whose padded slots are
    # filled with different garbage gives bitwise the same outputs and cache.
    attn = layer("csa", "none")
    x, pos = ragged_calls(inputs())[0]
    cache = attn.init_cache(BATCH, MAX_SEQ_LEN)
    out_a, cache_a = attn(jnp.asarray(x), pos, cache)
    garbage = np.where((pos >= 0)[..., None], x, np.float32(-7.0))
    out_b, cache_b = attn(jnp.asarray(garbage), pos, cache)
    np.testing.assert_array_equal(np.asarray(out_a), np.asarray(out_b))
    for a, b in zip(jax.tree.leaves(cache_a), jax.tree.leaves(cache_b)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Row 2 had only padding: equal to the empty cache's row, every leaf.
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(cache_a)):
        np.testing.assert_array_equal(np.asarray(a)[2], np.asarray(b)[2])


def test_under_jit_an_overflowing_row_freezes_alone():
    # Row 0 would run past max_seq_len, row 1 fits: row 0 keeps its cache and outputs NaN on its
    # real slots, row 1 runs as usual; padded slots output zeros.
    attn = layer("csa", "none")
    hidden = inputs()
    cache = attn.init_cache(2, 14)
    first = np.full((2, 13), -1, np.int32)
    first[0], first[1, :5] = np.arange(13), np.arange(5)
    _, cache = attn(jnp.asarray(hidden[:2, :13]), first, cache)
    step = _user_jit(attn)
    pos = np.asarray([[13, 14, -1], [5, 6, 7]], np.int32)
    out, after, _ = step(jnp.asarray(hidden[:2, 13:16]), pos, cache)
    out = np.asarray(out)
    assert np.isnan(out[0, :2]).all() and np.all(out[0, 2] == 0) and np.isfinite(out[1]).all()
    assert np.asarray(after.length).tolist() == [13, 8]
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(after)):
        np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)[0])


def test_reset_rows_empties_rows_and_the_compiled_step_keeps_serving():
    attn = layer("csa", "none")
    hidden = inputs()
    calls = ragged_calls(hidden)
    cache = attn.init_cache(BATCH, MAX_SEQ_LEN)
    for x, pos in calls[:2]:
        _, cache = attn(jnp.asarray(x), pos, cache)
    compiled = compiled_steps()
    fresh = attn.init_cache(BATCH, MAX_SEQ_LEN)

    reset = reset_rows(cache, [1])
    assert isinstance(reset.length, np.ndarray) and reset.length.tolist() == [14, 0, 13]
    for r, c, f in zip(jax.tree.leaves(reset), jax.tree.leaves(cache), jax.tree.leaves(fresh)):
        r, c, f = np.asarray(r), np.asarray(c), np.asarray(f)
        np.testing.assert_array_equal(r[1], f[1])  # the reset row is a fresh row
        np.testing.assert_array_equal(r[[0, 2]], c[[0, 2]])  # the others are untouched
    # A bool mask, and under jax.jit (traced rows), give the same cache.
    for other in (reset_rows(cache, np.asarray([False, True, False])),
                  jax.jit(reset_rows)(cache, jnp.asarray([1])),
                  jax.jit(reset_rows)(cache, jnp.asarray([False, True, False])),
                  reset_rows(cache, [-2])):
        for a, b in zip(jax.tree.leaves(reset), jax.tree.leaves(other)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Row 1 starts a new sequence (row 0's tokens) at position 0 while rows 0 and 2 go on, with
    # the [3, 13] step compiled before: rows 0 and 2 as alone, row 1 as row 0 alone.
    x, pos = calls[2]
    x, pos = x.copy(), pos.copy()
    x[1], pos[1] = hidden[0, :13], np.arange(13)
    out, after = attn(jnp.asarray(x), pos, reset)
    assert compiled_steps() == compiled  # no new compile: same shapes, same step
    assert after.length.tolist() == [27, 13, 18]
    ref = alone("csa")
    out = np.asarray(out)
    np.testing.assert_allclose(out[0], ref[0][2][0], rtol=0, atol=2e-5 * np.abs(ref[0][2][0]).max())
    np.testing.assert_allclose(out[1], ref[0][0][0], rtol=0, atol=2e-5 * np.abs(ref[0][0][0]).max())
    np.testing.assert_allclose(out[2, :5], ref[2][2][0], rtol=0, atol=2e-5 * np.abs(ref[2][2][0]).max())


def test_reset_rows_misuse():
    cache = layer("hca", "none").init_cache(BATCH, MAX_SEQ_LEN)
    with pytest.raises(ValueError, match=r"rows: expected row indices in \[-3, 3\) \(batch size 3\), got \[3\]"):
        reset_rows(cache, [0, 3])
    with pytest.raises(ValueError, match=r"rows: expected a bool mask of shape \[3\] \(the batch\), got shape \[2\]"):
        reset_rows(cache, np.asarray([True, False]))
    with pytest.raises(TypeError, match=r"rows: expected row indices \(ints\) or a bool mask \[3\], got float"):
        reset_rows(cache, [0.5])
    with pytest.raises(TypeError, match=r"cache: expected an AttentionCache, got dict"):
        reset_rows({}, [0])


@background("ragged bench", lambda workdir: [
    sys.executable, Path(__file__).resolve().parents[2] / "bench" / "ragged.py", "--size", "tiny",
    "--modes", "none-xla,narrow", "--repeats", "1", "--json", workdir / "ragged.json"], timeout=600)
def test_ragged_bench_smoke():
    """bench/ragged.py on the tiny size: records for the ragged mix and its padded cost (the
    command runs as a job of helpers.JOBS, beside the in-process tests)."""
    job = JOBS.by_name["ragged bench"]
    proc = job.result()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    data = json.loads((job.workdir / "ragged.json").read_text())
    assert data["meta"]["jax_version"] == jax.__version__
    assert [r["mode"] for r in data["records"]] == ["none-xla", "narrow"]
    for r in data["records"]:
        assert r["error"] is None and r["skipped"] is None
        assert r["ragged_real_tokens"] == 13 + 3 and r["padded_real_tokens"] == r["ragged_slots"] == 4 * 13
        assert r["ragged_ms_median"] > 0 and r["padded_ms_median"] > 0 and r["ragged_vs_padded"] > 0
        assert r["padded_slots_zero"] and r["max_abs_diff_real_rows"] < 1e-5
