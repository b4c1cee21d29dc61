"""Misuse: every bad input is refused with a clear error, and the cache stays usable.

Each rejected call names the argument, what was expected and what came (docs/misuse.md has
the table). After a rejection the next valid call on the same cache must reproduce the
recorded HF output, which shows that nothing of the rejected call reached the cache.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import fail_on_the_host, golden_layer, load_golden
from jax.experimental import checkify

import dsv4_jax
from dsv4_jax.cache.contiguous import init_attention_cache
from dsv4_jax.config import CSA, HCA, SLIDING
from dsv4_jax.io.hf_weights import export_hf_attention_weights
from dsv4_jax.step import breaks

CSA_LAYER = 1  # tiny_seed1: layer 0 sliding, 1 CSA, 2 HCA


@pytest.fixture(scope="module")
def tiny():
    return load_golden("tiny_seed1.npz")


@pytest.fixture(scope="module")
def csa(tiny):
    return golden_layer(tiny, CSA_LAYER)


def assert_matches(out, ref):
    err = np.abs(np.asarray(out, np.float32) - ref).max() / np.abs(ref).max()
    assert err < 1e-5, err


def after_first_call(g, attn, layer=CSA_LAYER, max_seq_len=64):
    """A cache holding the first golden call (9 tokens), checked against the reference."""
    c0 = g.call(layer, 0)
    out, cache = attn(jnp.asarray(c0["hidden"]), c0["positions"], attn.init_cache(g.batch, max_seq_len))
    assert_matches(out, c0["out"])
    return cache


def next_call_is_reference(g, attn, cache, layer=CSA_LAYER):
    c1 = g.call(layer, 1)
    out, cache = attn(jnp.asarray(c1["hidden"]), c1["positions"], cache)
    assert_matches(out, c1["out"])
    return cache


# ---------------------------------------------------------------------------- call misuse
def _h(g, c=1):
    return np.asarray(g.call(CSA_LAYER, c)["hidden"])


def _p(g, c=1):
    return g.call(CSA_LAYER, c)["positions"]


MISUSE = {
    # id: (make (g, attn, cache) -> (hidden, positions, cache), error type, message regex)
    "hidden_size": (lambda g, a, c: (_h(g)[..., :32], _p(g), c), ValueError,
                    r"hidden_states: expected shape \[B, S, 64\] with S >= 1, got \[1, 1, 32\]"),
    "hidden_rank": (lambda g, a, c: (_h(g)[0], _p(g), c), ValueError,
                    r"hidden_states: expected shape \[B, S, 64\] .*got \[1, 64\]"),
    "hidden_empty": (lambda g, a, c: (_h(g)[:, :0], _p(g)[:, :0], c), ValueError,
                     r"hidden_states: expected shape .*S >= 1, got \[1, 0, 64\]"),
    "hidden_int": (lambda g, a, c: (_h(g).astype(np.int32), _p(g), c), TypeError,
                   r"hidden_states: expected a floating dtype, got int32"),
    "hidden_list": (lambda g, a, c: (_h(g).tolist(), _p(g), c), TypeError,
                    r"hidden_states: expected an array, got list"),
    "positions_shape": (lambda g, a, c: (_h(g), _p(g)[0], c), ValueError,
                        r"positions: expected shape \[B, S\] = \[1, 1\], got \[1\]"),
    "positions_float": (lambda g, a, c: (_h(g), _p(g).astype(np.float32), c), TypeError,
                        r"positions: expected an integer dtype \(int32\), got float32"),
    "positions_gap": (lambda g, a, c: (_h(g), _p(g) + 5, c), ValueError,
                      r"positions: expected row 0 to continue the cache at 9 \(9 \.\. 9\), got \[14\]"),
    "positions_restart": (lambda g, a, c: (_h(g, 0), g.call(CSA_LAYER, 0)["positions"], c), ValueError,
                          r"positions: expected row 0 to continue the cache at 9 \(9 \.\. 17\), "
                          r"got \[0, 1, \.\.\., 8\]"),
    # Ragged batches (padded slots at -1 after a row's real tokens; tests/cache/test_ragged.py):
    "positions_padding_inside": (lambda g, a, c: (np.repeat(_h(g), 2, 1), np.asarray([[-1, 9]], np.int32), c),
                                 ValueError, r"positions: expected row 0's real tokens first, then its padded "
                                             r"slots \(-1\), got \[-1, 9\]"),
    "positions_only_padding": (lambda g, a, c: (_h(g), np.asarray([[-1]], np.int32), c), ValueError,
                               r"positions: expected at least one real token \(>= 0\) in the call, got only padded "
                               r"slots \(-1\) in all 1 rows"),
    "positions_below_padding": (lambda g, a, c: (_h(g), np.asarray([[-2]], np.int32), c), ValueError,
                                r"positions: expected values >= 0, or -1 for padded slots, got row 0 = \[-2\]"),
    "positions_padded_gap": (lambda g, a, c: (np.repeat(_h(g), 2, 1), np.asarray([[10, -1]], np.int32), c),
                             ValueError, r"positions: expected row 0 to continue the cache at 9 \(9 \.\. 9\), "
                                         r"got \[10, -1\]"),
    "batch_size": (lambda g, a, c: (np.repeat(_h(g), 2, 0), np.repeat(_p(g), 2, 0), c), ValueError,
                   r"hidden_states: expected batch size 1 \(the cache's\), got 2"),
    "nan_numpy": (lambda g, a, c: (np.where(np.arange(64) == 5, np.nan, _h(g)).astype(np.float32), _p(g), c),
                  ValueError, r"hidden_states: expected finite values, got 1 non-finite of 64 \(first at "
                              r"\[0, 0, 5\]: nan\); the call was not run, the cache is unchanged"),
    "inf_device": (lambda g, a, c: (jnp.asarray(_h(g)).at[0, 0, 0].set(-jnp.inf), _p(g), c), ValueError,
                   r"hidden_states: expected finite values, got 1 non-finite .*-inf"),
    "cache_not_a_cache": (lambda g, a, c: (_h(g), _p(g), {"length": c.length}), TypeError,
                          r"cache: expected an AttentionCache from attn.init_cache\(\.\.\.\), got dict"),
    "cache_other_type": (lambda g, a, c: (_h(g), _p(g), init_attention_cache(g.cfg, 2, 1, 64, jnp.float32)),
                         ValueError, r"cache: expected the cache of layer 1 \(compressed_sparse_attention\), "
                                     r"got the cache of layer 2 \(heavily_compressed_attention\)"),
    "cache_other_layer_same_type": (
        lambda g, a, c: (_h(g), _p(g), init_attention_cache(
            dataclasses.replace(g.cfg, layer_types=(SLIDING, CSA, HCA, CSA)), 3, 1, 64, jnp.float32)),
        ValueError, r"cache: expected the cache of layer 1 \(compressed_sparse_attention\), got the cache of "
                    r"layer 3 \(compressed_sparse_attention\)"),
    "cache_other_config": (
        lambda g, a, c: (_h(g), _p(g), init_attention_cache(
            dataclasses.replace(g.cfg, sliding_window=16), 1, 1, 64, jnp.float32)),
        ValueError, r"cache.window: expected shape \[B, 8, 32\] for this config, got \[1, 16, 32\]"),
    "cache_dtype": (lambda g, a, c: (_h(g), _p(g), a.init_cache(1, 64, dtype=jnp.bfloat16)), TypeError,
                    r"cache: expected dtype float32 .*got bfloat16"),
}


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_misuse_is_refused_and_the_cache_stays_usable(tiny, csa, case):
    make, err_type, pattern = MISUSE[case]
    cache = after_first_call(tiny, csa)
    hidden, positions, bad_cache = make(tiny, csa, cache)
    with pytest.raises(err_type, match=pattern):
        csa(hidden, positions, bad_cache)
    next_call_is_reference(tiny, csa, cache)


def test_past_max_seq_len_and_the_last_position(tiny, csa):
    cache = after_first_call(tiny, csa, max_seq_len=10)  # 9 tokens held, room for one
    c1 = tiny.call(CSA_LAYER, 1)
    two = (np.repeat(c1["hidden"], 2, axis=1), np.asarray([[9, 10]], np.int32))
    with pytest.raises(ValueError, match=r"hidden_states: expected at most 1 new tokens \(the cache holds 9 of "
                                         r"max_seq_len=10\), got 2"):
        csa(*two, cache)
    # The last position (max_seq_len - 1) is allowed, and gives the reference (the cache size only
    # bounds the entry slots: with 10 tokens there are 2 CSA entries, enough for everything seen).
    out, full = csa(jnp.asarray(c1["hidden"]), c1["positions"], cache)
    assert_matches(out, c1["out"])
    with pytest.raises(ValueError, match=r"expected at most 0 new tokens \(the cache holds 10 of max_seq_len=10\)"):
        csa(jnp.asarray(c1["hidden"]), c1["positions"] + 1, full)


@pytest.mark.parametrize("attr, expected, at_init, later, default", [
    ("break_mode", r"\('none', 'narrow', 'wide'\)", "fast", "graph", "narrow"),
    ("numerics", r"\('reference', 'official'\)", "fp8", "qat", "reference"),
])
def test_unknown_string_switch(tiny, csa, attr, expected, at_init, later, default):
    with pytest.raises(ValueError, match=rf"{attr}: expected one of {expected}, got '{at_init}'"):
        dsv4_jax.DeepseekV4Attention(tiny.cfg, CSA_LAYER, rngs=nnx.Rngs(0), **{attr: at_init})
    cache = after_first_call(tiny, csa)
    options = csa.options
    with pytest.raises(ValueError, match=rf"{attr}: expected one of .*got '{later}'"):
        setattr(csa, attr, later)  # an attribute: a bad value is refused where it enters
    assert csa.options is options and getattr(csa, attr) == default  # the layer keeps its options
    next_call_is_reference(tiny, csa, cache)


# ---------------------------------------------------------------------------- under your own jit
def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def _jitted(attn, how):
    """The layer's call under the user's own jit: nnx.jit of the module, or jax.jit of split state."""
    if how == "nnx.jit":
        return nnx.jit(lambda a, x, p, c: a(x, p, c))
    graphdef, _ = nnx.split(attn)
    f = jax.jit(lambda state, x, p, c: nnx.merge(graphdef, state)(x, p, c))
    return lambda a, x, p, c: f(nnx.state(a), x, p, c)


@pytest.mark.parametrize("how", ["nnx.jit", "jax.jit"])
def test_under_jit_a_call_past_max_seq_len_leaves_the_cache_unchanged(tiny, csa, how):
    cache = after_first_call(tiny, csa, max_seq_len=10)  # 9 tokens held, room for one
    c1 = tiny.call(CSA_LAYER, 1)
    two = (jnp.asarray(np.repeat(c1["hidden"], 2, axis=1)), np.asarray([[9, 10]], np.int32))
    out, after = _jitted(csa, how)(csa, *two, cache)  # nothing can refuse it: the step's own rule
    assert np.isnan(np.asarray(out)).all()  # NaN: it cannot be mistaken for a result
    assert _leaves_equal(after, cache)  # every leaf, `length` included (still 9)
    assert after.length.tolist() == [9]
    next_call_is_reference(tiny, csa, after)  # the next eager call works on the returned cache


@pytest.mark.parametrize("break_mode", ["narrow", "wide"])
def test_under_jit_an_overflow_writes_no_entries(tiny, break_mode):
    # 12 tokens into a cache of 10: the windows it completes would have written entries 0 and 1
    # (both inside the cache) and the ring; all of it is dropped, the cache stays empty.
    attn = golden_layer(tiny, CSA_LAYER, break_mode)
    empty = attn.init_cache(1, 10)
    x = jnp.asarray(np.concatenate([_h(tiny, 0), _h(tiny, 0)], axis=1)[:, :12])
    out, after = _jitted(attn, "nnx.jit")(attn, x, np.arange(12, dtype=np.int32)[None], empty)
    assert np.isnan(np.asarray(out)).all()
    assert _leaves_equal(after, empty)
    after_first_call(tiny, attn, max_seq_len=10)  # ... and eager calls on it start from position 0
    c0 = tiny.call(CSA_LAYER, 0)
    out, _ = attn(jnp.asarray(c0["hidden"]), c0["positions"], after)
    assert_matches(out, c0["out"])


def _checkified(attn):
    """The README's recipe: ``checkify=True`` and ``jax.jit(checkify.checkify(f))``."""
    graphdef, _ = nnx.split(attn)

    @jax.jit
    @checkify.checkify
    def step(state, x, positions, cache):
        return nnx.merge(graphdef, state)(x, positions, cache)

    return lambda x, p, c: step(nnx.state(attn), x, p, c)


def test_under_jit_checkify_names_positions_and_room(tiny):
    attn = golden_layer(tiny, CSA_LAYER, checkify=True)
    cache = after_first_call(tiny, attn, max_seq_len=10)  # eager calls: host checks, the usual step
    step = _checkified(attn)
    c1 = tiny.call(CSA_LAYER, 1)
    err, (out, good) = step(jnp.asarray(c1["hidden"]), c1["positions"], cache)
    assert err.get() is None
    assert_matches(out, c1["out"])
    err, _ = step(jnp.asarray(c1["hidden"]), c1["positions"] + 5, cache)  # a gap
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"positions: expected row 0 to continue the cache at 9 \(9 \.\. 9\), got \[14 \.\. 14\]"):
        err.throw()
    err, _ = step(jnp.asarray(c1["hidden"]), c1["positions"], good)  # a replay of position 9
    assert "positions: expected row 0 to continue the cache at 10" in err.get()
    two = (jnp.asarray(np.repeat(c1["hidden"], 2, axis=1)), np.asarray([[9, 10]], np.int32))
    err, (out, after) = step(*two, cache)
    with pytest.raises(checkify.JaxRuntimeError, match=r"hidden_states: expected at most 1 new tokens \(the cache "
                                                       r"holds 9 of max_seq_len=10\), got 2"):
        err.throw()
    assert _leaves_equal(after, cache)  # and the overflow rule still holds
    next_call_is_reference(tiny, attn, cache)
    # Ragged batches pass (rows at their own lengths, padding after the real tokens) ...
    ragged = attn.init_cache(2, 10).replace(length=np.asarray([9, 4], np.int32))
    x2 = jnp.asarray(np.repeat(np.repeat(c1["hidden"], 2, axis=0), 2, axis=1))
    err, _ = step(x2, np.asarray([[9, -1], [4, 5]], np.int32), ragged)
    assert err.get() is None
    # ... and the ragged misuse is named as the eager checks name it.
    for positions, pattern in (
        ([[-1, 9], [4, 5]], r"positions: expected row 0's real tokens first, then its padded slots \(-1\), "
                            r"got \[-1 \.\. 9\]"),
        ([[-1, -1], [-1, -1]], r"positions: expected at least one real token \(>= 0\) in the call, got only "
                               r"padded slots \(-1\) in all 2 rows"),
        ([[9, -1], [5, 6]], r"positions: expected row 1 to continue the cache at 4 \(4 \.\. 5\), got \[5 \.\. 6\]"),
        ([[9, -2], [4, 5]], r"positions: expected values >= 0, or -1 for padded slots, got row 0"),
        ([[9, 10], [4, 5]], r"hidden_states: expected at most 1 new tokens \(the cache holds 9 of max_seq_len=10\), "
                            r"got 2 in row 0"),
    ):
        err, _ = step(x2, np.asarray(positions, np.int32), ragged)
        with pytest.raises(checkify.JaxRuntimeError, match=pattern):
            err.throw()


def test_the_default_step_has_no_checks(tiny, csa):
    # checkify=False (the default): no `check` in the traced step; the spec is the eager one.
    cache = csa.init_cache(1, 64)
    c0 = tiny.call(CSA_LAYER, 0)
    jaxpr = jax.make_jaxpr(lambda x, p, c: csa(x, p, c))(jnp.asarray(c0["hidden"]), c0["positions"], cache)
    assert "check" not in str(jaxpr)
    assert not csa.step_spec().checks


# ---------------------------------------------------------------------------- non-finite inputs
def test_nonfinite_check_modes(tiny, csa):
    cache = after_first_call(tiny, csa)
    bad_np = _h(tiny).copy()
    bad_np[0, 0, 3] = np.nan
    bad_dev = jnp.asarray(bad_np)
    previous = getattr(csa, "check_finite", None)  # None: the module default, validation.CHECK_FINITE
    try:
        csa.check_finite = "host"  # only host (NumPy) inputs are scanned
        with pytest.raises(ValueError, match="expected finite values"):
            csa(bad_np, _p(tiny), cache)
        out, poisoned = csa(bad_dev, _p(tiny), cache)
        csa.check_finite = False  # no check at all: NaN reaches the output and the cache
        out2, poisoned2 = csa(bad_np, _p(tiny), cache)
        for o, c in ((out, poisoned), (out2, poisoned2)):
            assert np.isnan(np.asarray(o)).all()
            assert np.isnan(np.asarray(c.window)).any()
        expected = r"check_finite: expected one of \(None, True, 'host', False\), got 'sometimes'"
        with pytest.raises(ValueError, match=expected):
            csa.check_finite = "sometimes"  # refused at the assignment
        assert csa.check_finite is False
    finally:
        csa.check_finite = previous
    # The default (None: the module-wide `validation.CHECK_FINITE`) scans device inputs too.
    assert csa.check_finite is None
    with pytest.raises(ValueError, match="expected finite values"):
        csa(bad_dev, _p(tiny), cache)
    next_call_is_reference(tiny, csa, cache)  # the cache passed in was never written


def test_float64_numpy_input_runs_as_float32(tiny, csa):
    # NumPy's default float64 is what JAX computes in float32 (x64 off): accepted, same result.
    cache = after_first_call(tiny, csa)
    c1 = tiny.call(CSA_LAYER, 1)
    out, _ = csa(c1["hidden"].astype(np.float64), c1["positions"].astype(np.int64), cache)
    assert out.dtype == jnp.float32
    assert_matches(out, c1["out"])


# ---------------------------------------------------------------------------- host-break failure
def _run_with_deadline(fn, seconds=120):
    """Run fn in a thread; fail (instead of hanging the suite) if it does not finish in time."""
    result = {}

    def body():
        try:
            result["value"] = fn()
        except BaseException as err:
            result["error"] = err

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the call hangs"
    return result


@pytest.mark.parametrize("break_mode", ["narrow", "wide"])
def test_exception_inside_the_host_break(tiny, monkeypatch, break_mode):
    fail = fail_on_the_host(monkeypatch, FloatingPointError("simulated failure on the host"))
    # query_block=97: a step no other test compiled, so it is traced with `flaky` in its break.
    attn = golden_layer(tiny, CSA_LAYER, break_mode=break_mode, break_on="host", query_block=97)
    cache = after_first_call(tiny, attn)
    fail["on"] = True

    def failing_call():  # the error may surface at the call or at the first use of its outputs
        out, new_cache = attn(_h(tiny), _p(tiny), cache)
        jax.block_until_ready((out, new_cache))

    err = _run_with_deadline(failing_call).get("error")
    assert isinstance(err, (RuntimeError, ValueError)), err  # JaxRuntimeError, or ValueError on C++ dispatch
    stage = "'select_topk'" if break_mode == "narrow" else "'run_stages'"
    assert "dsv4_jax host break" in str(err) and stage in str(err) and f"break_mode='{break_mode}'" in str(err)
    assert "FloatingPointError: simulated failure on the host" in str(err)

    # `breaks.surface_host_errors` turns it into one HostBreakError caused by the original exception.
    def surfaced():
        with breaks.surface_host_errors():
            failing_call()

    err = _run_with_deadline(surfaced).get("error")
    assert isinstance(err, breaks.HostBreakError), err
    assert str(err).startswith("dsv4_jax host break") and stage in str(err)
    assert isinstance(err.__cause__, FloatingPointError)

    fail["on"] = False
    next_call_is_reference(tiny, attn, cache)  # the cache passed in is intact


# ---------------------------------------------------------------------------- construction misuse
def test_inconsistent_configs_are_refused():
    tiny = dsv4_jax.DeepseekV4Config.tiny
    cases = [
        (dict(o_groups=3), r"DeepseekV4Config.o_groups: expected a divisor of num_attention_heads \(4\), got 3"),
        (dict(qk_rope_head_dim=7), r"qk_rope_head_dim: expected an even number .*got 7"),
        (dict(qk_rope_head_dim=64), r"qk_rope_head_dim: expected <= head_dim \(32\), got 64"),
        (dict(index_head_dim=4), r"index_head_dim: expected >= qk_rope_head_dim \(8\) .*got 4"),
        (dict(hidden_size=0), r"DeepseekV4Config.hidden_size: expected a positive int, got 0"),
        (dict(layer_types=("sliding_attention", "dense")), r"layer_types: expected entries from .*got \['dense'\]"),
        (dict(rms_norm_eps=-1.0), r"rms_norm_eps: expected a positive number \(finite, below 1\), got -1.0"),
    ]
    for overrides, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            tiny(**overrides)
    with pytest.raises(ValueError, match=r"config\['num_key_value_heads'\]: expected 1 .*got 8"):
        dsv4_jax.DeepseekV4Config.from_hf({"num_key_value_heads": 8})
    with pytest.raises(ValueError, match=r"config\['compress_ratios'\]: expected entries from \[0, 4, 128\], "
                                         r"got \[8\]"):
        dsv4_jax.DeepseekV4Config.from_hf({"compress_ratios": [0, 8]})
    cfg = tiny()
    with pytest.raises(ValueError, match=r"layer_idx: expected an int in \[0, 3\) .*got 3"):
        dsv4_jax.DeepseekV4Attention(cfg, 3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="config: expected a DeepseekV4Config, got dict"):
        dsv4_jax.DeepseekV4Attention({}, 0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="param_dtype: expected a floating dtype, got int32"):
        dsv4_jax.DeepseekV4Attention(cfg, 0, rngs=nnx.Rngs(0), param_dtype=jnp.int32)
    attn = dsv4_jax.DeepseekV4Attention(cfg, 0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="batch_size: expected a positive int, got 0"):
        attn.init_cache(0, 16)
    with pytest.raises(ValueError, match=r"max_seq_len: expected a positive int, got 2\.5"):
        attn.init_cache(1, 2.5)
    with pytest.raises(TypeError, match="dtype: expected a floating dtype, got int8"):
        attn.init_cache(1, 16, dtype=jnp.int8)


# ---------------------------------------------------------------------------- weights misuse
def test_weights_missing_unknown_misshaped_in_one_error(tiny):
    attn = dsv4_jax.DeepseekV4Attention(tiny.cfg, CSA_LAYER, rngs=nnx.Rngs(0))
    before = export_hf_attention_weights(attn)
    w = dict(tiny.weights(CSA_LAYER))
    del w["compressor.indexer.kv_norm.weight"]
    w["compressor.bias"] = np.zeros(3, np.float32)
    w["o_a_proj.weight"] = w["o_a_proj.weight"].T
    with pytest.raises(ValueError) as err:
        dsv4_jax.load_hf_attention_weights(attn, w)
    msg = str(err.value)
    assert msg.startswith("weights for layer 1 (compressed_sparse_attention): ")
    assert "missing ['compressor.indexer.kv_norm.weight']" in msg
    assert "unknown ['compressor.bias']" in msg
    assert "'o_a_proj.weight': expected shape [32, 64], got [64, 32]" in msg
    after = export_hf_attention_weights(attn)
    assert all(np.array_equal(before[k], after[k]) for k in before)  # nothing was loaded


def test_weights_of_another_config_name_the_preset_or_nothing(tiny):
    small = load_golden("small_seed0.npz")
    attn = dsv4_jax.DeepseekV4Attention(tiny.cfg, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"'q_a_proj.weight': expected shape \[32, 64\], got \[128, 256\]"):
        dsv4_jax.load_hf_attention_weights(attn, small.weights(2))
    # Weights shaped for the tiny() preset, given to a layer of the golden config (index heads 2 vs 4):
    preset = dsv4_jax.DeepseekV4Config.tiny()
    donor = dsv4_jax.DeepseekV4Attention(preset, CSA_LAYER, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"expected shape \[32, 32\], got \[64, 32\].*these shapes fit "
                                         r"DeepseekV4Config.tiny\(\)"):
        dsv4_jax.load_hf_attention_weights(golden_layer(tiny, CSA_LAYER), export_hf_attention_weights(donor))


def test_weights_bad_values(tiny):
    attn = dsv4_jax.DeepseekV4Attention(tiny.cfg, 0, rngs=nnx.Rngs(0))
    w = dict(tiny.weights(0))
    with pytest.raises(TypeError, match="weights: expected a mapping of name -> array, got list"):
        dsv4_jax.load_hf_attention_weights(attn, list(w.items()))
    with pytest.raises(TypeError, match=r"weights\['sinks'\]: expected a floating array, got dtype int64"):
        dsv4_jax.load_hf_attention_weights(attn, {**w, "sinks": np.arange(4)})
    with pytest.raises(ValueError, match=r"'kv_norm.weight': expected finite values, got 1 non-finite"):
        dsv4_jax.load_hf_attention_weights(attn, {**w, "kv_norm.weight": np.where(np.arange(32) == 0, np.inf, 1.0)})
    prefixed = {f"model.layers.2.self_attn.{k}": v for k, v in w.items()}
    with pytest.raises(ValueError, match=r"weights: expected keys 'model.layers.0.self_attn.\*' for layer_idx=0, "
                                         r"got keys of layers \[2\]"):
        dsv4_jax.load_hf_attention_weights(attn, prefixed)
