"""The break boundary: which stages leave the XLA program for the host, per `break_mode`.

This mirrors vLLM's "breakable CUDA graph" (PR #45309): code that cannot be captured runs
eagerly between graph segments. In XLA the analogue is a host callback inside the jitted
step: on a GPU it splits the command buffers (CUDA graphs) around it, exactly where vLLM
splits its graph. The mode is a static attribute, so the choice is made at trace time and
the compiled program contains no runtime branch.

=========  =======================================================================
mode       what runs on the host (NumPy, through one ``jax.pure_callback``)
=========  =======================================================================
``none``   nothing: the indexer's top-k is `lax.top_k`, in-graph
``narrow`` the lightning indexer's scoring + top-k (vLLM after #45309)
``wide``   ``wq_b_kv_insert`` + the compressors + the indexer (vLLM before #45309)
=========  =======================================================================

In every mode the host runs *the same functions* as the graph (see `backend`): only the
array namespace changes. The input GEMMs before the stages and the sparse attention and
output projection after them always stay in-graph.

What crosses the boundary: in ``narrow``, the indexer queries, head weights, indexer key
cache and visible-entry counts go down and int32 picks [B, S, index_topk] (-1 padded) come
back; the cache writes stay in-graph. In ``wide`` the callback takes the state it updates
(window ring, compressor and indexer caches) and returns the new state with the picks.

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

from . import indexer

BREAK_MODES = ("none", "narrow", "wide")


def check_break_mode(break_mode: Any) -> str:
    if break_mode not in BREAK_MODES:
        raise ValueError(f"break_mode: expected one of {BREAK_MODES}, got {break_mode!r}")
    return break_mode


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
        except Exception as err:
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


def indexer_select(break_mode: str) -> Callable[..., Any]:
    """The indexer's `select_topk`, in-graph (``none``, and inside the wide break) or as the
    narrow host break."""
    if break_mode == "narrow":
        def select_on_host(queries, weights, keys, visible, *, top_k, with_scores=False, block=indexer.SCORE_BLOCK):
            fn = functools.partial(indexer.select_topk, top_k=top_k, with_scores=with_scores, block=block)
            return host_call(fn, queries, weights, keys, visible)

        return select_on_host
    return indexer.select_topk
