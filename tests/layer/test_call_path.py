"""The module call's fast path: memoized static checks, the probe of the parameters, the
last-returned cache, the cached `StepSpec` hash (issue 9: the call as thin as the jitted step).

A repeated call with the same structure runs only the value checks. These tests show that
nothing else changed: every bad value is still refused with the message a fresh layer gives,
the cache stays usable, and a change of a layer attribute, a parameter, the cache's contents
or the enclosing mesh is seen by the next call.
"""

from __future__ import annotations

import dataclasses
import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv4_jax import DeepseekV4Attention, DeepseekV4Config
from dsv4_jax.config import CSA
from dsv4_jax.layer import call as call_path
from dsv4_jax.layer import module as attention
from dsv4_jax.layer import validation
from dsv4_jax.step import breaks, finite_flag, sharding
from dsv4_jax.step.pure_step import AttentionWeights, attention_step, compiled_steps, step_function

CFG = DeepseekV4Config.tiny()
CSA_LAYER = CFG.layer_types.index(CSA)
PREFILL = 9


def _layer(**kw) -> DeepseekV4Attention:
    attn = DeepseekV4Attention(CFG, CSA_LAYER, rngs=nnx.Rngs(0), **kw)
    rng = np.random.default_rng(3)
    attn.sinks[...] = jnp.asarray(rng.normal(0.0, 0.5, attn.sinks.shape), jnp.float32)
    return attn


def _hidden(seed: int, batch: int = 1, seq: int = 1, device: bool = True):
    x = np.random.default_rng(seed).standard_normal((batch, seq, CFG.hidden_size)).astype(np.float32)
    return jnp.asarray(x) if device else x


def _positions(start, seq: int = 1, batch: int = 1) -> np.ndarray:
    start = np.broadcast_to(np.asarray(start), (batch,))
    return (start[:, None] + np.arange(seq)[None, :]).astype(np.int32)


def _prefilled(attn, batch: int = 1, max_seq_len: int = 64):
    cache = attn.init_cache(batch, max_seq_len)
    _, cache = attn(_hidden(0, batch, PREFILL), _positions(0, PREFILL, batch), cache)
    return cache


def _decode(attn, cache, steps: int, seed: int = 10):
    """`steps` single-token calls (each after the first hits the memo); returns the outputs and the cache."""
    outs = []
    for i in range(steps):
        out, cache = attn(_hidden(seed + i, cache.batch_size), _positions(cache.length), cache)
        outs.append(np.asarray(out))
    return outs, cache


def _assert_same_calls(outs, cache, want_outs, want_cache):
    """Two runs of calls gave the same outputs and the same final cache, bit for bit."""
    for a, b in zip(outs, want_outs):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(want_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _raw(attn, cache, x, positions):
    """The same call through the raw compiled step (fresh weights pytree, device length)."""
    weights = attention._weights_of(attn, AttentionWeights)
    raw_cache = cache.replace(layer_idx=-1, length=jnp.asarray(cache.length))
    out, new_cache, _ = step_function(False)(weights, raw_cache, x, positions, spec=attn.step_spec())
    return np.asarray(out), new_cache


def _error(call) -> tuple[type, str]:
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    return info.type, str(info.value)


def _fresh_error(attn, call) -> tuple[type, str]:
    """The error of `call` with the layer's memos dropped (the full checks, as before the memo)."""
    call_path._CALLS.pop(attn, None)
    return _error(call)


# ---------------------------------------------------------------------------- same results
def test_repeated_calls_equal_the_step_and_keep_the_host_mirror():
    attn = _layer()
    cache = _prefilled(attn)
    for i in range(6):
        x, pos = _hidden(20 + i), _positions(cache.length)
        ref_out, ref_cache = _raw(attn, cache, x, pos)
        out, cache = attn(x, pos, cache)
        np.testing.assert_array_equal(np.asarray(out), ref_out)
        assert isinstance(cache.length, np.ndarray) and cache.length.dtype == np.int32
        np.testing.assert_array_equal(cache.length, np.asarray(ref_cache.length))
        np.testing.assert_array_equal(np.asarray(cache.window), np.asarray(ref_cache.window))
        assert cache.layer_idx == CSA_LAYER
    assert cache.length.tolist() == [PREFILL + 6]
    assert attn in call_path._CALLS  # the memo served these calls


def test_numpy_inputs_ragged_rows_and_intermediates_on_the_memo():
    attn = _layer()
    cache = _prefilled(attn, batch=2)
    for i in range(3):  # NumPy hidden states, jax.Array positions
        out, cache = attn(_hidden(30 + i, 2, device=False), jnp.asarray(_positions(cache.length, 1, 2)), cache)
    assert cache.length.tolist() == [PREFILL + 3] * 2
    for i in range(3):  # ragged: row 1 pads its second slot
        pos = _positions(cache.length, 2, 2)
        pos[1, 1] = -1
        before = cache.length.copy()
        out, cache = attn(_hidden(40 + i, 2, 2), pos, cache)
        assert cache.length.tolist() == [before[0] + 2, before[1] + 1]
        assert not np.asarray(out)[1, 1].any()  # the padded slot outputs zeros
    for _ in range(2):
        x, pos = _hidden(50, 2), _positions(cache.length, 1, 2)
        ref_out, _ = _raw(attn, cache, x, pos)
        out, cache, inter = attn(x, pos, cache, return_intermediates=True)
        np.testing.assert_array_equal(np.asarray(out), ref_out)
        assert inter.topk.shape[:2] == (2, 1)


def test_large_dense_and_ragged_calls_go_through_the_same_rules():
    """More than `validation._SMALL` positions: dense calls by NumPy, ragged ones by `check_positions`."""
    attn = _layer()
    cache = attn.init_cache(2, 256)
    seq = 40
    _, cache = attn(_hidden(1, 2, seq), _positions(0, seq, 2), cache)
    _, cache = attn(_hidden(2, 2, seq), _positions(cache.length, seq, 2), cache)  # dense, memo hit
    pos = _positions(cache.length, seq, 2)
    pos[0, 30:] = -1
    _, cache = attn(_hidden(3, 2, seq), pos, cache)  # ragged, memo hit
    assert cache.length.tolist() == [2 * seq + 30, 3 * seq]
    bad = _positions(cache.length, seq, 2)
    bad[1, 5] += 1
    assert _error(lambda: attn(_hidden(4, 2, seq), bad, cache)) == _fresh_error(
        attn, lambda: attn(_hidden(4, 2, seq), bad, cache))


# ---------------------------------------------------------------------------- the checks stay
BAD_VALUES = {
    # id: (hidden, positions) for a cache holding n tokens, batch 1; hidden of shape [1, 1, hidden]
    "gap": lambda n: (_hidden(1), _positions(n + 3)),
    "behind": lambda n: (_hidden(1), _positions(n - 1)),
    "restart": lambda n: (_hidden(1), _positions(0)),
    "only_padding": lambda n: (_hidden(1), np.full((1, 1), -1, np.int32)),
    "below_padding": lambda n: (_hidden(1), np.full((1, 1), -2, np.int32)),
    "huge_uint": lambda n: (_hidden(1), np.full((1, 1), 2**64 - 1, np.uint64)),
    "int64": lambda n: (_hidden(1), _positions(n + 1).astype(np.int64)),
    "nan_numpy": lambda n: (np.where(np.arange(CFG.hidden_size) == 3, np.nan, _hidden(1, device=False))
                            .astype(np.float32), _positions(n)),
    "inf_device": lambda n: (_hidden(1).at[0, 0, 7].set(jnp.inf), _positions(n)),
    "minus_inf_float16": lambda n: (_hidden(1).astype(jnp.float16).at[0, 0, 0].set(-jnp.inf), _positions(n)),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_memoized_structure_still_refuses_bad_values(case):
    attn = _layer()
    cache = _prefilled(attn)
    _, cache = _decode(attn, cache, 2)  # the memo holds this structure (and dtypes, for most cases)
    if case in ("int64", "minus_inf_float16"):  # make the structure of the bad call a memo hit too
        x, pos = BAD_VALUES[case](int(cache.length[0]))
        _, cache = attn(_hidden(5).astype(x.dtype), _positions(cache.length).astype(pos.dtype), cache)
    n = int(cache.length[0])
    x, pos = BAD_VALUES[case](n)
    err = _error(lambda: attn(x, pos, cache))
    assert err == _fresh_error(attn, lambda: attn(x, pos, cache))
    assert err[0] is ValueError and re.match(r"(positions|hidden_states): expected", err[1]), err
    # The refused call changed nothing: the next valid call equals the raw step on the same cache.
    x, pos = _hidden(99), _positions(n)
    ref_out, _ = _raw(attn, cache, x, pos)
    out, cache = attn(x, pos, cache)
    np.testing.assert_array_equal(np.asarray(out), ref_out)
    assert cache.length.tolist() == [n + 1]


def test_overflow_is_refused_at_the_last_slot():
    attn = _layer()
    cache = _prefilled(attn, max_seq_len=PREFILL + 2)
    _, cache = attn(_hidden(1), _positions(PREFILL), cache)
    _, full = attn(_hidden(2), _positions(PREFILL + 1), cache)  # the last slot: a memo hit
    err = _error(lambda: attn(_hidden(3), _positions(PREFILL + 2), full))
    assert err == _fresh_error(attn, lambda: attn(_hidden(3), _positions(PREFILL + 2), full))
    assert err == (ValueError, "hidden_states: expected at most 0 new tokens (the cache holds 11 of "
                               "max_seq_len=11), got 1")


def test_other_structures_are_checked_in_full():
    attn = _layer()
    cache = _prefilled(attn)
    _, cache = _decode(attn, cache, 2)
    n = int(cache.length[0])
    cases = {
        "batch": (lambda: attn(_hidden(1, batch=2), _positions(n, 1, 2), cache), ValueError,
                  "hidden_states: expected batch size 1 (the cache's), got 2"),
        "hidden_size": (lambda: attn(_hidden(1)[..., :16], _positions(n), cache), ValueError,
                        "hidden_states: expected shape [B, S, 64] with S >= 1, got [1, 1, 16]"),
        "positions_float": (lambda: attn(_hidden(1), _positions(n).astype(np.float32), cache), TypeError,
                            "positions: expected an integer dtype (int32), got float32"),
        "positions_shape": (lambda: attn(_hidden(1), _positions(n)[0], cache), ValueError,
                            "positions: expected shape [B, S] = [1, 1], got [1]"),
        "cache_dtype": (lambda: attn(_hidden(1), _positions(0), attn.init_cache(1, 64, dtype=jnp.bfloat16)),
                        TypeError, "cache: expected dtype float32"),
        "cache_other_layer": (lambda: attn(_hidden(1), _positions(0), _layer_cache(0)), ValueError,
                              "cache: expected the cache of layer"),
        "cache_dict": (lambda: attn(_hidden(1), _positions(n), {"length": cache.length}), TypeError,
                       "cache: expected an AttentionCache"),
        "hidden_list": (lambda: attn(np.asarray(_hidden(1)).tolist(), _positions(n), cache), TypeError,
                        "hidden_states: expected an array, got list"),
    }
    for name, (call, err_type, start) in cases.items():
        with pytest.raises(err_type) as info:
            call()
        assert str(info.value).startswith(start), (name, str(info.value))
    _, cache = _decode(attn, cache, 1)  # still usable
    assert cache.length.tolist() == [n + 1]


def _layer_cache(layer_idx: int):
    from dsv4_jax.cache.contiguous import init_attention_cache

    return init_attention_cache(CFG, layer_idx, 1, 64, jnp.float32)


# ---------------------------------------------------------------------------- changes are seen
def test_a_changed_attribute_is_seen_by_the_next_call():
    attn = _layer()
    cache = _prefilled(attn)
    _, cache = _decode(attn, cache, 2)
    n = int(cache.length[0])

    attn.dtype = jnp.bfloat16  # the compute dtype: the float32 cache no longer fits
    with pytest.raises(TypeError, match=r"cache: expected dtype bfloat16"):
        attn(_hidden(1), _positions(n), cache)
    attn.dtype = None

    attn.layer_idx = CSA_LAYER + 3  # another index of the same type: the cache is not its own
    with pytest.raises(ValueError, match=rf"cache: expected the cache of layer {CSA_LAYER + 3}"):
        attn(_hidden(1), _positions(n), cache)
    attn.layer_idx = CSA_LAYER

    attn.check_finite = False  # NaN is let through (into a cache this test then drops)
    nan = _hidden(1).at[0, 0, 0].set(jnp.nan)
    out, _ = attn(nan, _positions(n), cache)
    assert np.isnan(np.asarray(out)).any()
    with pytest.raises(ValueError, match=r"check_finite: expected one of"):
        attn.check_finite = "sometimes"  # refused where it enters; the layer keeps False
    assert attn.check_finite is False
    attn.check_finite = None
    previous = validation.CHECK_FINITE
    try:
        validation.CHECK_FINITE = "host"  # the module default: device arrays unchecked
        attn(nan, _positions(n), cache)
    finally:
        validation.CHECK_FINITE = previous
    with pytest.raises(ValueError, match=r"hidden_states: expected finite values"):
        attn(nan, _positions(n), cache)

    _, cache = attn(_hidden(1), _positions(n), cache)
    assert cache.length.tolist() == [n + 1]


def test_a_changed_break_mode_runs_its_own_step(monkeypatch):
    attn = _layer(break_mode="none", kernels="xla")
    cache = _prefilled(attn)
    _, cache = _decode(attn, cache, 2)
    traced = []
    real = breaks.wide_host_call

    def counting(*args, **kw):
        traced.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(breaks, "wide_host_call", counting)
    ref_out, _ = _raw(attn, cache, _hidden(7), _positions(cache.length))
    attn.break_mode = "wide"
    out, cache = attn(_hidden(7), _positions(cache.length), cache)
    assert traced, "the call after break_mode='wide' did not run the wide step"
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    entries = call_path._CALLS[attn].entries
    assert {spec.plan.mode for spec, _ in entries.values()} == {"wide"}


@pytest.mark.parametrize("how", ["set_value", "new_variable", "submodule_value", "nnx_update"])
def test_a_replaced_parameter_is_used_by_the_next_call(how):
    attn = _layer()
    cache = _prefilled(attn)
    _, cache = _decode(attn, cache, 2)
    rng = np.random.default_rng(11)
    if how == "set_value":
        attn.q_a_proj[...] = jnp.asarray(rng.standard_normal(attn.q_a_proj.shape), jnp.float32) * 0.1
    elif how == "new_variable":
        attn.kv_norm = nnx.Param(jnp.asarray(rng.uniform(0.5, 1.5, attn.kv_norm.shape), jnp.float32))
    elif how == "submodule_value":
        kv = attn.indexer.compressor.kv_proj
        kv[...] = jnp.asarray(rng.standard_normal(kv.shape), jnp.float32) * 0.1
    else:
        state = nnx.state(attn, nnx.Param)
        state = jax.tree.map(lambda a: a * 1.5, state)
        nnx.update(attn, state)
    fresh = attention._weights_of(attn, AttentionWeights)
    assert all(a is b for a, b in zip(jax.tree.leaves(attn.weights()), jax.tree.leaves(fresh), strict=True))
    x, pos = _hidden(8), _positions(cache.length)
    ref_out, _ = _raw(attn, cache, x, pos)
    out, cache = attn(x, pos, cache)
    np.testing.assert_array_equal(np.asarray(out), ref_out)


def test_a_subclass_sees_its_replaced_parameters():
    class Layer(DeepseekV4Attention):
        pass

    attn = Layer(CFG, CSA_LAYER, rngs=nnx.Rngs(0))
    before = attn.weights()
    attn.q_a_norm[...] = attn.q_a_norm[...] * 2
    after = attn.weights()
    assert after is not before and after.q_a_norm is attn.q_a_norm.get_raw_value()
    assert attn.weights() is after


def test_a_mirror_changed_in_place_is_checked_and_uploaded():
    """The device twin of the length is used only while the host mirror holds its values."""
    attn = _layer()
    cache = _prefilled(attn)
    _, cache = _decode(attn, cache, 2)
    with pytest.raises(ValueError, match=r"positions: expected row 0 to continue the cache at 11"):
        attn(_hidden(1), _positions(0), cache)
    cache.length[:] = 0  # rewound in place: the next call continues at 0
    x, pos = _hidden(9), _positions(0)
    ref_out, ref_cache = _raw(attn, cache, x, pos)
    out, new = attn(x, pos, cache)
    np.testing.assert_array_equal(np.asarray(out), ref_out)
    assert new.length.tolist() == [1]
    np.testing.assert_array_equal(np.asarray(new.window), np.asarray(ref_cache.window))


def test_two_caches_on_one_layer_alternate():
    attn = _layer()
    a, b = _prefilled(attn), _prefilled(attn)
    _, b = attn(_hidden(3), _positions(PREFILL), b)
    for i in range(3):
        for name in ("a", "b"):
            cache = a if name == "a" else b
            x, pos = _hidden(60 + i), _positions(cache.length)
            ref_out, _ = _raw(attn, cache, x, pos)
            out, cache = attn(x, pos, cache)
            np.testing.assert_array_equal(np.asarray(out), ref_out)
            a, b = (cache, b) if name == "a" else (a, cache)
    assert (a.length.tolist(), b.length.tolist()) == ([PREFILL + 3], [PREFILL + 4])
    # A cache rebuilt around the same mirror (not the one the layer returned) still works.
    rebuilt = a.replace(window=a.window + 0)
    _, rebuilt = attn(_hidden(70), _positions(rebuilt.length), rebuilt)
    assert rebuilt.length.tolist() == [PREFILL + 4]


def test_a_context_mesh_is_seen_by_the_next_call():
    attn = _layer()
    cache = _prefilled(attn)
    _, cache = _decode(attn, cache, 2)
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        assert attn.step_spec().plan.layout is not None
        _, cache = attn(_hidden(4), _positions(cache.length), cache)
        specs = [spec for spec, _ in call_path._CALLS[attn].entries.values()]
        assert specs and all(spec.plan.layout is not None for spec in specs)
    _, cache = attn(_hidden(5), _positions(cache.length), cache)
    specs = [spec for spec, _ in call_path._CALLS[attn].entries.values()]
    assert specs and all(spec.plan.layout is None for spec in specs)


def test_donated_cache_on_the_memo():
    attn = _layer(donate_cache=True)
    cache = _prefilled(attn)
    outs, cache = _decode(attn, cache, 4)
    assert cache.length.tolist() == [PREFILL + 4]
    reference = _layer()
    ref_cache = _prefilled(reference)
    ref_outs, _ = _decode(reference, ref_cache, 4)
    for out, ref in zip(outs, ref_outs, strict=True):
        np.testing.assert_array_equal(out, ref)


# ---------------------------------------------------------------------------- the pieces
def test_value_checks_agree_with_check_positions():
    """`check_values` (Python lists for small calls, NumPy for large dense ones) accepts and
    refuses exactly what `check_positions` does, with its messages and lengths."""
    rng = np.random.default_rng(0)
    x = np.zeros((1, 1, 1), np.float32)
    for trial in range(600):
        batch, seq = int(rng.integers(1, 5)), int(rng.choice([1, 2, 3, 7, 40]))
        max_seq_len = int(rng.integers(1, 120))
        length = rng.integers(0, max_seq_len + 1, batch).astype(np.int32)
        if trial % 7 == 0:
            length[0] = -1  # not a length the layer makes: the exact rules decide
        counts = rng.integers(0, seq + 1, batch)
        pos = np.full((batch, seq), -1, np.int64)
        for b in range(batch):
            pos[b, :counts[b]] = length[b] + np.arange(counts[b])
        kind = trial % 5
        if kind == 1:  # one wrong value
            pos[rng.integers(batch), rng.integers(seq)] += int(rng.choice([-2, -1, 1, 5]))
        elif kind == 2:  # padding first
            pos[rng.integers(batch)] = np.roll(pos[rng.integers(batch)], 1)
        elif kind == 3:
            pos = pos.astype(np.int32)
        try:
            want = validation.check_positions(pos.astype(np.int64), length.astype(np.int64), max_seq_len)
            want = (length.tolist(), (length + want).tolist())
        except ValueError as err:
            want = str(err)
        try:
            got = validation.check_values(x, pos, length, max_seq_len, True)
        except ValueError as err:
            got = str(err)
        assert got == want, (trial, pos.tolist(), length.tolist(), max_seq_len)


def test_finite_check_shortcut_is_exact():
    """The x.x shortcut: finite values whose squares overflow still pass; NaN/inf never do."""
    for dtype in (np.float32, np.float64, np.float16, jnp.bfloat16):
        big = np.full((1, 2, 8), 1e4 if dtype in (np.float16, jnp.bfloat16) else 1e30, dtype)
        validation.check_finite("hidden_states", big)
        validation.check_finite("hidden_states", jnp.asarray(big))
        for bad in (np.nan, np.inf, -np.inf):
            x = big.copy()
            x[0, 1, 3] = bad
            for value in (x, jnp.asarray(x)):
                with pytest.raises(ValueError, match=r"hidden_states: expected finite values, got 1 non-finite "
                                                     r"of 16 \(first at \[0, 1, 3\]"):
                    validation.check_finite("hidden_states", value)
    validation.check_finite("hidden_states", np.full((1, 1, 4), np.nan, np.float32), False)
    validation.check_finite("hidden_states", jnp.full((1, 1, 4), jnp.nan), "host")
    with pytest.raises(ValueError, match="non-finite"):
        validation.check_finite("hidden_states", np.full((1, 1, 4), np.nan, np.float32), "host")


def test_equal_step_specs_share_one_compiled_step():
    """A spec built again (or unpickled) equals the layer's, hashes equal, and the jitted step
    runs it without compiling again; a changed field is another spec (another hash, another
    step), not one that inherits the cached hash of the spec it was copied from."""
    attn = _layer()
    spec = attn.step_spec()
    other = attn._new_step_spec(None, False, False)
    copy = pickle.loads(pickle.dumps(spec))
    for twin in (other, copy):
        assert twin is not spec and twin == spec and hash(twin) == hash(spec)
    changed = dataclasses.replace(spec, checks=True)
    assert changed != spec and hash(changed) != hash(spec)
    assert hash(dataclasses.replace(changed, checks=False)) == hash(spec)

    weights = attention._weights_of(attn, AttentionWeights)
    cache = attn.init_cache(1, 64)
    cache = cache.replace(layer_idx=-1, length=jnp.asarray(cache.length))
    x, pos = _hidden(0, 1, PREFILL), _positions(0, PREFILL)
    want = np.asarray(step_function(False)(weights, cache, x, pos, spec=spec)[0])
    compiled = compiled_steps()
    for twin in (other, copy):
        np.testing.assert_array_equal(np.asarray(step_function(False)(weights, cache, x, pos, spec=twin)[0]), want)
    assert compiled_steps() == compiled  # the jit cache found the equal specs


def test_an_accelerator_input_is_checked_for_finite_values_after_dispatch(monkeypatch):
    """On a GPU a device input's finite check is read after the step is dispatched: a small
    program (`call_path.finite_guard`) writes the verdict into host memory and zeroes a
    non-finite input just before the step, and the call reads the verdict while the step runs
    (no reduction and round trip of its own before dispatch): here the CPU's arrays are taken
    for device-resident ones. Same outputs and caches as the check before dispatch; a NaN input
    raises the same error, the cache stays the caller's and usable; no step is compiled for
    it; a donating layer keeps the check before dispatch. The verdict's way here is the guard
    (`finite_flag.VERDICT`); the step's own flag, the default where the native extension is
    built: tests/step/test_finite_flag.py."""
    monkeypatch.setattr(finite_flag, "VERDICT", "guard")
    ran, kinds = [], set()
    real = call_path._FINITE_GUARD

    class Counted:
        def __call__(self, *args, **kwargs):
            ran.append(1)
            result = real(*args, **kwargs)
            kinds.add(result[0].sharding.memory_kind)
            return result

    monkeypatch.setattr(call_path, "_FINITE_GUARD", Counted())
    deferred = validation.finite_deferred
    monkeypatch.setattr(validation, "finite_deferred", lambda value, mode: False)  # the check before dispatch
    plain = _layer()
    cache = _prefilled(plain)
    want, want_cache = _decode(plain, cache, 3)
    assert not ran

    monkeypatch.setattr(validation, "finite_deferred", deferred)
    monkeypatch.setattr(validation, "_host_resident", lambda value: False)  # on a GPU they are not
    checked = _layer()
    cache = _prefilled(checked)
    assert len(ran) == 1  # the prefill ran the guard
    got, got_cache = _decode(checked, cache, 3)
    assert len(ran) == 4
    assert kinds == {"pinned_host"}  # the verdict written to host memory by the guard (CPU and GPU have it)
    _assert_same_calls(got, got_cache, want, want_cache)

    n = int(got_cache.length[0])
    nan = _hidden(1).at[0, 0, 3].set(jnp.inf)
    with pytest.raises(ValueError, match=r"hidden_states: expected finite values, got 1 non-finite of 64 \(first at "
                                         r"\[0, 0, 3\]: inf\); its results were discarded, the cache is unchanged"):
        checked(nan, _positions(n), got_cache)
    compiled = compiled_steps()
    out, after = checked(_hidden(20), _positions(n), got_cache)  # the cache as it was: the call runs
    assert compiled_steps() == compiled and after.length.tolist() == [n + 1]
    np.testing.assert_array_equal(np.asarray(out), _raw(checked, got_cache, _hidden(20), _positions(n))[0])

    donating = _layer(donate_cache=True)
    cache = _prefilled(donating)
    count = len(ran)
    with pytest.raises(ValueError, match=r"the call was not run, the cache is unchanged"):
        donating(nan, _positions(PREFILL), cache)
    _decode(donating, cache, 1)
    assert len(ran) == count  # the donating step keeps its check before dispatch


# ---------------------------------------------------------------------------- positions=None
def test_positions_none_continues_each_row_of_the_cache():
    """``attn(x, None, cache)``: every row's next S positions from its cache length, eagerly
    (the host mirror's values, checked like any others) and under a user's jit (computed from
    the traced length inside the program: a decode step that takes no positions argument)."""
    attn = _layer()
    x = _hidden(1, 2, PREFILL + 3)
    cache = attn.init_cache(2, 32)
    ref_out, ref_cache = attn(x[:, :PREFILL], _positions(0, PREFILL, 2), cache)
    out, cache = attn(x[:, :PREFILL], None, attn.init_cache(2, 32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    np.testing.assert_array_equal(cache.length, ref_cache.length)

    @jax.jit
    def step(weights, cache, hidden):  # the positions come from the cache inside the program
        return attention_step(weights, cache, hidden, None, attn.step_spec())

    raw = cache.replace(layer_idx=-1, length=jnp.asarray(cache.length))
    ref_raw = ref_cache.replace(layer_idx=-1, length=jnp.asarray(ref_cache.length))
    weights = attention._weights_of(attn, AttentionWeights)
    for t in range(PREFILL, PREFILL + 3):
        want, ref_raw = _raw(attn, ref_raw, x[:, t:t + 1], _positions(t, 1, 2))
        got, raw, _ = step(weights, raw, x[:, t:t + 1])
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    assert np.asarray(raw.length).tolist() == [PREFILL + 3] * 2

    @nnx.jit
    def module_step(layer, hidden, cache):
        return layer(hidden, None, cache)

    out, traced = module_step(attn, x[:, PREFILL:PREFILL + 1], cache)
    want, _ = attn(x[:, PREFILL:PREFILL + 1], _positions(PREFILL, 1, 2), cache)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert np.asarray(traced.length).tolist() == [PREFILL + 1] * 2

    @nnx.jit
    def from_a_cache_made_inside(layer, hidden):  # its length a host mirror inside the trace
        cache = layer.init_cache(2, 32)
        prompt, cache = layer(hidden[:, :PREFILL], None, cache)
        token, cache = layer(hidden[:, PREFILL:PREFILL + 1], None, cache)  # the prompt's cache, called again
        return prompt, token, cache.length

    prompt, token, length = from_a_cache_made_inside(attn, x)
    np.testing.assert_allclose(np.asarray(prompt), np.asarray(ref_out), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(token), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert np.asarray(length).tolist() == [PREFILL + 1] * 2


@pytest.mark.parametrize("case", ["hidden_rank", "cache_type", "room"])
def test_positions_none_refuses_bad_inputs_by_name(case):
    """Without positions, a malformed input is still named: the hidden states, the cache, or
    the room left (the derived positions run past the cache), and the cache stays usable."""
    attn = _layer()
    cache = attn.init_cache(1, 12)
    if case == "hidden_rank":
        kind, message = _error(lambda: attn(_hidden(0)[0], None, cache))
        assert kind is ValueError and message.startswith("hidden_states: expected shape [B, S, ")
    elif case == "cache_type":
        kind, message = _error(lambda: attn(_hidden(0), None, {"length": np.zeros(1)}))
        assert kind is TypeError and message.startswith("cache: expected an AttentionCache")
    else:
        _, cache = attn(_hidden(0, 1, 10), None, cache)
        kind, message = _error(lambda: attn(_hidden(1, 1, 3), None, cache))
        assert kind is ValueError and message.startswith("hidden_states:"), message
        out, cache = attn(_hidden(1, 1, 2), None, cache)  # the refused call left the cache usable
        assert cache.length.tolist() == [12] and np.isfinite(np.asarray(out)).all()
