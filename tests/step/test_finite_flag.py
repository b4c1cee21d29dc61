"""The finite check's verdict through the step's flag (`dsv4_jax.step.finite_flag`).

On a GPU an eager call's device input is checked for NaN/inf after dispatch; with
``finite_flag.VERDICT = "flag"`` the step itself writes the verdict into host memory (the native
handler ``dsv4_finite_flag``) and the call polls it. Here the CPU's arrays are taken for
device-resident ones (as on a GPU), and the CPU handler writes the word from XLA's executor
thread: the same contract as the guard program's, and the ways a word can go missing. On a
GPU the same tests run the CUDA handler (its kernel writes the word into mapped host memory).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import NATIVE_BUILT
from test_call_path import PREFILL, _assert_same_calls, _decode, _hidden, _layer, _positions, _prefilled

from dsv4_jax import native
from dsv4_jax.layer import call as call_path
from dsv4_jax.layer import validation
from dsv4_jax.step import finite_flag
from dsv4_jax.step.pure_step import compiled_steps

needs_native = pytest.mark.skipif(not NATIVE_BUILT, reason="the native handlers are not built here")


@pytest.fixture
def flag(monkeypatch):
    """The flag as the verdict's way, the CPU's arrays taken for device-resident ones, fresh
    host-side slot state; yields the guard program's runs (a list that grows per run)."""
    monkeypatch.setattr(finite_flag, "VERDICT", "flag")
    monkeypatch.setattr(validation, "_host_resident", lambda value: False)
    monkeypatch.setattr(finite_flag, "_SLOTS", {})
    monkeypatch.setattr(finite_flag, "_DEVICES", {})
    guard, runs = call_path._FINITE_GUARD, []

    def counted(*args):
        runs.append(1)
        return guard(*args)

    monkeypatch.setattr(call_path, "_FINITE_GUARD", counted)
    return runs


def _slot():
    return finite_flag.slot_for(_hidden(0))


@needs_native
def test_the_handler_writes_each_run_a_numbered_word():
    """`native.finite_flag` returns its input and writes (seq << 1) | finite into the device's
    slot: seq counts the runs, the low bit is the verdict. `flagged` hands the step a non-finite
    input zeroed; `joined` makes the step's output NaN for it."""
    device = jax.devices()[0]
    words = native.finite_flag_slots(device.platform)
    assert words is not None and words.dtype == np.uint64 and words.size == 64
    ordinal = device.id if getattr(device, "local_hardware_id", None) is None else device.local_hardware_id
    index = ordinal % words.size

    @jax.jit
    def flagged(x):
        zeroed, flag = finite_flag.flagged(x)
        return zeroed, finite_flag.joined(2 * x, flag)  # the step's input, and its output

    x = jnp.arange(6.0).reshape(1, 2, 3)
    before = words.item(index) >> 1
    step_input, out = flagged(x)
    np.testing.assert_array_equal(np.asarray(step_input), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x))
    assert words.item(index) == ((before + 1) << 1) | 1
    step_input, out = flagged(x.at[0, 1, 2].set(jnp.nan))
    assert words.item(index) == (before + 2) << 1
    np.testing.assert_array_equal(np.asarray(step_input), np.zeros((1, 2, 3)))  # what the step reads: zeros
    assert np.isnan(np.asarray(out)).all()  # its output, which the call drops


@needs_native
def test_a_device_input_checked_by_the_flag_is_the_guards_call(flag):
    """With the flag: the same outputs and caches as the check before dispatch, no guard program,
    one word per call; a NaN input raises the same error, its results dropped, the cache the
    caller's and usable; the flagged step is compiled once and reused."""
    plain = _layer()
    want, want_cache = _decode(plain, _prefilled(plain), 3)

    checked = _layer()
    cache = _prefilled(checked)
    slot = _slot()
    first = slot.last
    got, got_cache = _decode(checked, cache, 3)
    assert not flag  # the guard never ran
    assert slot.last == first + 3
    _assert_same_calls(got, got_cache, want, want_cache)

    n = int(got_cache.length[0])
    nan = _hidden(1).at[0, 0, 3].set(jnp.inf)
    compiled = compiled_steps()
    with pytest.raises(ValueError, match=r"hidden_states: expected finite values, got 1 non-finite of 64 \(first at "
                                         r"\[0, 0, 3\]: inf\); its results were discarded, the cache is unchanged"):
        checked(nan, _positions(n), got_cache)
    out, after = checked(_hidden(20), _positions(n), got_cache)  # the cache as it was: the call runs
    assert compiled_steps() == compiled and after.length.tolist() == [n + 1]
    ref, _ = plain(_hidden(20), _positions(n), want_cache)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert not flag


@needs_native
def test_an_interrupted_wait_is_settled_before_the_next_call(flag, monkeypatch):
    """A call interrupted between dispatch and its word (Ctrl-C) leaves that word to come; the
    next call waits for the device, reads the slot again and gets its own verdict."""
    attn = _layer()
    cache = _prefilled(attn)
    await_word = finite_flag._await

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(finite_flag, "_await", interrupted)
    with pytest.raises(KeyboardInterrupt):
        attn(_hidden(5), _positions(PREFILL), cache)
    slot = _slot()
    assert slot.last is None and slot.unawaited is not None
    monkeypatch.setattr(finite_flag, "_await", await_word)
    nan = _hidden(6).at[0, 0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match="its results were discarded"):
        attn(nan, _positions(PREFILL), cache)
    out, after = attn(_hidden(7), _positions(PREFILL), cache)
    assert after.length.tolist() == [PREFILL + 1] and bool(jnp.all(jnp.isfinite(out)))
    assert slot.unawaited is None and slot.last == slot.words.item(slot.index) >> 1
    assert not flag


@needs_native
def test_a_word_out_of_sequence_is_not_trusted(flag):
    """A word whose seq is past the one the call expects (the host's count went wrong) is not
    read as its verdict: the call checks the input itself, and the next call reads the slot
    again."""
    attn = _layer()
    cache = _prefilled(attn)
    slot = _slot()
    slot.last -= 2  # the host expects an older word than the step will write
    nan = _hidden(6).at[0, 0, 1].set(jnp.nan)
    with pytest.raises(ValueError, match="its results were discarded"):
        attn(nan, _positions(PREFILL), cache)
    assert slot.last is None
    _, after = attn(_hidden(7), _positions(PREFILL), cache)
    assert after.length.tolist() == [PREFILL + 1]
    assert slot.last == slot.words.item(slot.index) >> 1 and slot.broken is None and not flag


@needs_native
def test_a_word_that_never_comes_turns_the_flag_off_with_a_warning(flag):
    """A step that finishes without writing the word the host polls (a slot that is not its
    device's): the call checks the input itself and warns, and later calls use the guard."""
    attn = _layer()
    cache = _prefilled(attn)
    slot = _slot()
    slot.index = (slot.index + 1) % slot.words.size
    slot.last = slot.words.item(slot.index) >> 1
    nan = _hidden(6).at[0, 0, 2].set(jnp.nan)
    with pytest.warns(RuntimeWarning, match="finished without writing its finite flag"):
        with pytest.raises(ValueError, match="its results were discarded"):
            attn(nan, _positions(PREFILL), cache)
    assert slot.broken is not None and _slot() is None
    _, after = attn(_hidden(7), _positions(PREFILL), cache)
    assert after.length.tolist() == [PREFILL + 1] and len(flag) == 1  # the guard checked it


def test_the_verdicts_way_is_checked_and_falls_back_without_the_native_extension(flag, monkeypatch):
    """`VERDICT` names one of its ways; "auto" is the flag (measured on an H200); without the
    platform's extension "flag" is the guard."""
    monkeypatch.setattr(finite_flag, "VERDICT", "fast")
    with pytest.raises(ValueError, match=r"finite_flag.VERDICT: expected one of \('auto', 'guard', 'flag'\), "
                                         r"got 'fast'"):
        _slot()
    monkeypatch.setattr(finite_flag, "VERDICT", "auto")
    assert finite_flag.AUTO == "flag"
    monkeypatch.setattr(finite_flag, "VERDICT", "guard")
    assert _slot() is None
    monkeypatch.setattr(finite_flag, "VERDICT", "flag")
    monkeypatch.setattr(native, "finite_flag_slots", lambda platform: None)
    assert _slot() is None
    attn = _layer()
    _prefilled(attn)
    assert len(flag) == 1  # the prefill's check ran the guard


@needs_native
def test_layers_called_from_two_threads_each_get_their_own_verdict(flag):
    """The flagged steps of two threads are awaited one at a time (the process's lock): each
    call reads its own word, so a NaN input in one thread raises there and the other thread's
    calls run as they would alone."""
    import threading

    layers = [_layer(), _layer()]
    caches = [_prefilled(attn) for attn in layers]
    want = [_decode(attn, cache, 4, seed=30 + 10 * i)[0] for i, (attn, cache) in enumerate(zip(layers, caches))]
    results, errors = [None, None], []

    def run(i):
        try:
            attn, cache = layers[i], caches[i]
            outs = []
            for step in range(4):
                if i == 1:  # a rejected call between every two accepted ones
                    try:
                        attn(_hidden(99).at[0, 0, step].set(jnp.nan), _positions(cache.length), cache)
                        errors.append("a NaN input was accepted")
                    except ValueError as err:
                        assert "its results were discarded" in str(err)
                out, cache = attn(_hidden(30 + 10 * i + step), _positions(cache.length), cache)
                outs.append(np.asarray(out))
            results[i] = outs
        except Exception as err:  # reported below, with the thread's index
            errors.append(f"thread {i}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for got, expected in zip(results, want):
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)
    assert not flag
