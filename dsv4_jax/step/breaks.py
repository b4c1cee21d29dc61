"""The break boundary: which stages leave the XLA program and how they run there (per `plan.StepPlan`).

This mirrors vLLM's "breakable CUDA graph" (PR #45309): code that cannot be captured runs
eagerly between graph segments. In XLA the analogue is an op inside the jitted step that
cannot join a command buffer: on a GPU XLA closes its CUDA graph before it and opens a new
one after it, exactly where vLLM splits its graph. Two such ops serve as the break:

* a host callback (``break_on="host"``): `jax.pure_callback` into NumPy, running the same
  functions as the graph (see `backend`); the inputs cross to the host and back;
* a native XLA FFI custom call (``break_on="device"``, see `native`): the indexer's handler
  on the step's own device, declared *not* command-buffer compatible (the eager break);
  nothing leaves the device.

=========  ======================================  ==========================================
mode       ``break_on="host"``                     ``break_on="device"``
=========  ======================================  ==========================================
``none``   no break: the selection is in-graph (the native graph-compatible handler where
           built and ``kernels`` allows it, else `lax.top_k`)
``narrow`` indexer scoring + top-k in NumPy        indexer scoring + top-k, native eager break
``wide``   ``wq_b_kv_insert`` + compressors +      (refused: the wide break stays on the host)
           indexer in NumPy (vLLM before #45309)
=========  ======================================  ==========================================

All of it is decided once, at trace time, by `plan.plan_step` into a `StepPlan` (a static part
of the compiled step's identity): the compiled program never branches on it. The input
GEMMs before the stages and the sparse attention and output projection after them always
stay in-graph.

What crosses a host boundary: in ``narrow``, the indexer queries, head weights, indexer key
cache and visible-entry counts go down and int32 picks [B, S, index_topk] (-1 padded) come
back; the cache writes stay in-graph. In ``wide`` the callback takes the state it updates
(window ring, compressor and indexer caches) and returns the new state with the picks.

On a mesh (``StepPlan.layout``, see `sharding`): the selection (every kind: host callback,
native eager break, native graph handler, `lax.top_k`) and the wide break run inside
`jax.shard_map`, per batch shard, never on a gathered global batch; a host callback runs on one
device of each batch shard and its result reaches the shard's ``"model"`` replicas by a ``psum``.

Gradients: the picks are integers; the break's inputs are cut from differentiation
(`lax.stop_gradient`), so a loss differentiates alike in ``none`` and ``narrow``. The wide
break computes differentiable stages on the host: its backward is the VJP of the same stages
traced in the graph (`wide_host_call`), so it differentiates as ``none`` does, in reverse mode.

Errors on the host: an exception raised by the NumPy side is re-raised there as
`HostBreakError` naming the stage and the break mode, and JAX hands it to the caller as a
`jax.errors.JaxRuntimeError` (a `RuntimeError`), or a `ValueError` on JAX's C++ dispatch
path, whose message contains that text and the host traceback; `surface_host_errors` turns
either into a `HostBreakError` caused by the original exception. It surfaces at the call
(CPU) or at the first use of the call's outputs (asynchronous dispatch, e.g. on a GPU);
nothing hangs, and the cache passed in is untouched (unless the layer donates it,
``donate_cache=True``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from dsv4_jax.backend import QUERY_BLOCK
from dsv4_jax.cache.quantized import read
from dsv4_jax.ops.indexer import reference as indexer
from dsv4_jax.step import sharding


class HostBreakError(RuntimeError):
    """An exception inside a host break, with the stage and break mode it happened in."""


_MARKER = "dsv4_jax host break"
# Recent host exceptions by id, so that `surface_host_errors` can chain the original.
_FAILURES: dict[int, BaseException] = {}
_FAILURE_IDS = itertools.count(1)
_FAILURES_LOCK = threading.Lock()


def _record(err: BaseException) -> int:
    traceback.clear_frames(err.__traceback__)  # keep the trace, drop its frames' (large) arrays
    with _FAILURES_LOCK:
        n = next(_FAILURE_IDS)
        _FAILURES[n] = err
        while len(_FAILURES) > 8:
            _FAILURES.pop(min(_FAILURES))
    return n


@contextlib.contextmanager
def surface_host_errors() -> Iterator[None]:
    """Re-raise a failed host break as `HostBreakError` from the original exception.

    JAX reports an exception inside `jax.pure_callback` as a `JaxRuntimeError` or, on its
    C++ dispatch path, a `ValueError`, with the host traceback flattened into the message.
    Wrapped around a dispatch, this turns either into one `HostBreakError` whose message
    names the stage and whose ``__cause__`` is the original exception.
    """
    try:
        yield
    except HostBreakError:
        raise
    except Exception as err:
        text = str(err)
        if _MARKER not in text:
            raise
        line = next(ln for ln in text.splitlines() if _MARKER in ln)
        line = line[line.index(_MARKER):]
        original = None
        if line.startswith(f"{_MARKER} #"):
            with _FAILURES_LOCK:
                original = _FAILURES.pop(int(line[len(_MARKER) + 2:].split(" ", 1)[0]), None)
        raise HostBreakError(line) from (original or err)


# How the stages that run as host breaks are named in errors.
_STAGES = {
    "run_stages": "'run_stages' (wq_b_kv_insert + compressor + indexer, break_mode='wide')",
    "select_topk": "'select_topk' (the indexer's scoring + top-k, break_mode='narrow')",
}


def _stage_name(fn: Callable[..., Any]) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", type(fn).__name__)
    return _STAGES.get(name, repr(name))


def _on_host(fn: Callable[..., Any], where: str) -> Callable[..., Any]:
    """Run `fn` on NumPy copies of the callback's arguments (the NumPy twin of the stage)."""

    @functools.wraps(fn)
    def host_fn(*args):
        try:
            return fn(*jax.tree.map(np.asarray, args))
        except BaseException as err:  # SystemExit, KeyboardInterrupt too: XLA would flatten them anonymously
            n = _record(err)
            raise HostBreakError(f"{_MARKER} #{n} {where} failed: {type(err).__name__}: {err}") from err

    return host_fn


def host_call(fn: Callable[..., Any], *args):
    """`fn(*args)` as one host break: traced once under XLA for its output shapes, run in NumPy.

    `vmap_method="sequential"`: under a user's `vmap` the callback runs once per element, so
    the NumPy code only ever sees the unbatched shapes it was written for.
    """
    result_shapes = jax.eval_shape(fn, *args)
    return jax.pure_callback(_on_host(fn, _stage_name(fn)), result_shapes, *args, vmap_method="sequential")


def wide_host_call(fn: Callable[..., Any], *args):
    """`host_call` for the wide break, differentiable in reverse mode by its in-graph twin.

    `fn` is ``partial(run_stages, spec=spec, rotations=..., select=indexer.select_topk)`` and `args` are
    ``(inputs, cache, positions, stage weights)``; on a mesh (``spec.plan.layout``) the callback
    runs once per batch shard with the weights whole (`sharding.run_per_shard`), and its new
    state keeps the cache's batch sharding.

    The host stages carry gradients (wq_b, the compressors' pooling, the cache inserts) that a
    callback cannot give. Every break mode computes the same values (the project's contract,
    tests/layer/test_attention.py), so the backward is the VJP of `fn` traced in the graph on the
    same inputs: `fn` runs again there, once, under the pullback (what `jax.checkpoint` would
    recompute), and the gradients are break_mode="none"'s with the XLA selection. Reverse mode
    only (a `jax.custom_vjp`, as the kernels are).
    """
    spec = getattr(fn, "keywords", {}).get("spec")
    layout = getattr(getattr(spec, "plan", None), "layout", None)

    def on_host(*xs):
        if layout is None:
            return host_call(fn, *xs)
        return sharding.run_per_shard(functools.partial(host_call, fn), layout, xs[:-1], xs[-1:], once=True)

    @jax.custom_vjp
    def call(*xs):
        return on_host(*xs)

    def forward(*xs):
        return on_host(*xs), xs

    def backward(xs, cotangents):
        _, pullback = jax.vjp(fn, *xs)
        return pullback(cotangents)

    call.defvjp(forward, backward)
    return call(*args)


def select_on_host(queries, weights, keys, visible, *, top_k, with_scores=False,
                    block=QUERY_BLOCK) -> indexer.Selection:
    """The narrow host break: `indexer.select_topk` in NumPy, inputs cut from differentiation.

    Its `Selection` crosses back whole; without `with_scores` its scores are None, a pytree
    node without leaves, so only the int32 picks come back from the host."""
    fn = functools.partial(indexer.select_topk, top_k=top_k, with_scores=with_scores, block=block)
    return host_call(fn, *jax.lax.stop_gradient((queries, weights, read(keys))), visible)


def select_per_shard(select, layout, queries, weights, keys, visible, *, top_k, with_scores=False,
                      block=QUERY_BLOCK, once: bool) -> indexer.Selection:
    """`select` run per batch shard of a mesh (`sharding.run_per_shard`): every argument is
    ``[B, ...]``; `once` for a host callback (one device per batch shard calls the host)."""
    fn = functools.partial(select, top_k=top_k, with_scores=with_scores, block=block)
    return sharding.run_per_shard(fn, layout, (queries, weights, read(keys), visible), once=once)
