"""The finite check's verdict read from a flag the step writes into host memory.

The eager call rejects non-finite `hidden_states` (`validation`). For an accelerator input the
check is read after the step is dispatched (`validation.finite_deferred`); its verdict comes
back one of two ways, `VERDICT`:

* ``"guard"``: a small program before the step (`call_path.finite_guard`) computes it into
  pinned host memory and zeroes a non-finite input; the call reads it through the runtime
  (a buffer read: ~0.09 ms on an H200, the call ~0.13-0.18 ms over the jitted step);
* ``"flag"``: the step computes it itself (``StepSpec.finite_flag``, `flagged`): the native
  handler ``dsv4_finite_flag`` (`native.finite_flag`) writes ``(seq << 1) | finite`` into
  this device's slot of host memory the extension owns, and the call polls that word
  (`run_flagged`): no second program, no runtime read. The step is compiled once more for it
  (the flag, the zeroing and the output's join are part of its program; the handler runs beside
  the step's chain of launches, which gains one, the reduction).

``"auto"`` (the default) is ``"flag"``: gated on the CPU and on an H200 (the handler's tests,
tests/step/test_finite_flag.py, with the CUDA handler), where the module call of a V4-Flash CSA decode
step cost 0.065 ms over the jitted step with it, against 0.181 ms with the guard (0.063 with
``check_finite="host"``, 0.029 without a check; `bench/stack.py --call-overhead`;
docs/breaks_and_kernels.md, "Why the kernels' defaults"). ``"flag"`` falls back to the guard
where the platform's native extension is not built.

How the call knows its word: ``seq`` counts the handler's runs on a device, and every flagged
step is awaited before the next is dispatched (one lock for the process), so the host expects
the last word's seq plus one. A call interrupted between dispatch and its word (an exception,
Ctrl-C) leaves that step's word to come: the next call waits for the device to finish its work
first and reads the slot again. A word that never comes (the step finished without it) or
comes out of sequence is not trusted: the call then checks the input itself (a reduction and
its read) and, for a missing word, warns and uses the guard from then on.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import warnings

import jax
import jax.numpy as jnp

from dsv4_jax import native

VERDICTS = ("auto", "guard", "flag")
VERDICT = "auto"  # how a deferred finite check comes back (see the module docstring)
AUTO = "flag"  # what "auto" means (measured on an H200: the module docstring)

_SPINS = 2000  # reads of the word before the step's output is asked whether it is done
_LOCK = threading.Lock()  # one flagged step in flight at a time: its word's seq is known


def flagged(hidden_states):
    """Inside the step, at its start: (`hidden_states` with a non-finite input zeroed, the flag).
    The verdict ``all(isfinite(hidden_states))`` goes to the host (`native.finite_flag`) beside
    the step, not before it: the zeroing takes the reduction's verdict itself, so the handler is
    not a link of the step's chain of launches (one launch more, the reduction, not two;
    docs/breaks_and_kernels.md, "Why the kernels' defaults"), and nothing downstream (the native selection,
    a host break) sees a NaN of a call whose results the host will drop. The step's output must take
    the flag (`joined`), which keeps the handler in the program."""
    finite = jnp.all(jnp.isfinite(hidden_states))
    flag = native.finite_flag(finite)
    return jnp.where(finite, hidden_states, jnp.zeros((), hidden_states.dtype)), flag


def joined(out, flag):
    """The step's output after the flag was written: `out` itself for a finite input, NaN for
    the call the host rejects (whose results it drops). A use XLA cannot fold away, at the end
    of the step, where the handler has long run."""
    return jnp.where(flag, out, jnp.asarray(jnp.nan, out.dtype))


@functools.lru_cache(maxsize=256)
def flagged_spec(spec):
    """`spec` (a `StepSpec`) with ``finite_flag=True``: the step `run_flagged` dispatches."""
    return dataclasses.replace(spec, finite_flag=True)


class _Slot:
    """The host's view of one device's slot: the words (NumPy view), the slot's index, the seq
    of the last word seen (None: read it again after the device is idle), a step whose word
    was not awaited, and why the flag is not used on this device (None while it is)."""

    __slots__ = ("broken", "device", "index", "last", "unawaited", "words")

    def __init__(self, words, index: int, device):
        self.words, self.index, self.device = words, index, device
        self.last, self.unawaited, self.broken = None, None, None


_SLOTS: dict = {}  # sharding -> its device's _Slot, or None where the flag cannot be used for its arrays
_DEVICES: dict = {}  # device -> _Slot
_BARRIER = jax.jit(lambda x: x + 1)


def _mode() -> str:
    if VERDICT not in VERDICTS:
        raise ValueError(f"finite_flag.VERDICT: expected one of {VERDICTS}, got {VERDICT!r}")
    return AUTO if VERDICT == "auto" else VERDICT


def slot_for(value) -> _Slot | None:
    """The slot a flagged step on `value` (a concrete single-device jax.Array) writes, or None
    where the verdict comes by the guard (`VERDICT`, no native extension, a broken flag)."""
    if _mode() != "flag":
        return None
    sharding = value.sharding
    try:
        slot = _SLOTS[sharding]
    except KeyError:
        if len(_SLOTS) >= 64:
            _SLOTS.clear()
        slot = _SLOTS[sharding] = _new_slot(sharding)
    except TypeError:  # an unhashable sharding
        return None
    return None if slot is None or slot.broken is not None else slot


def _new_slot(sharding) -> _Slot | None:
    devices = sharding.device_set
    if len(devices) != 1:
        return None
    device = next(iter(devices))
    words = native.finite_flag_slots(device.platform)
    if words is None:
        return None
    slot = _DEVICES.get(device)
    if slot is None:
        ordinal = getattr(device, "local_hardware_id", None)  # the FFI's device ordinal
        ordinal = device.id if ordinal is None else ordinal
        slot = _DEVICES[device] = _Slot(words, ordinal % len(words), device)
    return slot


def run_flagged(slot: _Slot, step, weights, cache, hidden_states, positions, spec):
    """Dispatch the flagged step (``spec.finite_flag``) and wait for its word: (out, new cache,
    intermediates, finite: bool). The results are the step's whatever the verdict (the caller
    drops them for a non-finite input)."""
    with _LOCK:
        if slot.last is None or slot.unawaited is not None:
            _settle(slot)
        want = slot.last + 1
        slot.last = None  # unknown until this call's word is read
        out, new_cache, intermediates = step(weights, cache, hidden_states, positions, spec=spec)
        slot.unawaited = out  # until its word is read (an interrupted wait leaves it to settle)
        finite = _await(slot, want, out)
        slot.unawaited = None
        if finite is None:  # no trustworthy word: the input checked here
            finite = bool(jnp.all(jnp.isfinite(hidden_states.astype(spec.dtype))))
        else:
            slot.last = want
        return out, new_cache, intermediates, finite


def _settle(slot: _Slot) -> None:
    """Wait until the device has run everything dispatched to it (so that no flagged step's
    word is still to come), then take the slot's current seq as the last one."""
    pending, slot.unawaited = slot.unawaited, None
    try:
        jax.block_until_ready(_BARRIER(jax.device_put(0, slot.device)))
        if pending is not None:
            jax.block_until_ready(pending)
    except Exception:  # a failed step's error was the call's; its word (if any) is written
        pass
    slot.last = slot.words.item(slot.index) >> 1


def _await(slot: _Slot, want: int, out) -> bool | None:
    """The verdict of the word with seq `want`, polled; None for a word out of sequence or one
    that never came (the step finished without writing it: the flag is not used again here)."""
    words, index = slot.words, slot.index
    spins = 0
    while True:
        word = words.item(index)
        seq = word >> 1
        if seq == want:
            return bool(word & 1)
        if seq > want:
            return None
        spins += 1
        if spins >= _SPINS:
            if out.is_ready():
                jax.block_until_ready(out)  # a failed step raises its error here
                word = words.item(index)
                if word >> 1 == want:
                    return bool(word & 1)
                if word >> 1 > want:  # out of sequence (the next call settles the slot)
                    return None
                slot.broken = (f"the step on {slot.device} finished without writing its finite flag "
                               f"(slot {index}: seq {word >> 1}, expected {want})")
                warnings.warn(f"dsv4_jax: {slot.broken}; the finite check uses the guard program from now on",
                              RuntimeWarning, stacklevel=4)
                return None
            time.sleep(0 if spins < 8 * _SPINS else 2e-5)  # let other threads (a host break) run
