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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import indexer

BREAK_MODES = ("none", "narrow", "wide")


def check_break_mode(break_mode: Any) -> str:
    if break_mode not in BREAK_MODES:
        raise ValueError(f"break_mode: expected one of {BREAK_MODES}, got {break_mode!r}")
    return break_mode


def _on_host(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run `fn` on NumPy copies of the callback's arguments (the NumPy twin of the stage)."""

    @functools.wraps(fn)
    def host_fn(*args):
        return fn(*jax.tree.map(np.asarray, args))

    return host_fn


def host_call(fn: Callable[..., Any], *args):
    """`fn(*args)` as one host break: traced once under XLA for its output shapes, run in NumPy.

    `vmap_method="sequential"`: under a user's `vmap` the callback runs once per element, so
    the NumPy code only ever sees the unbatched shapes it was written for.
    """
    result_shapes = jax.eval_shape(fn, *args)
    return jax.pure_callback(_on_host(fn), result_shapes, *args, vmap_method="sequential")


def indexer_select(break_mode: str) -> Callable[..., Any]:
    """The indexer's `select_topk`, in-graph (``none``, and inside the wide break) or as the
    narrow host break."""
    if break_mode == "narrow":
        def select_on_host(queries, weights, keys, visible, *, top_k, with_scores=False):
            fn = functools.partial(indexer.select_topk, top_k=top_k, with_scores=with_scores)
            return host_call(fn, queries, weights, keys, visible)

        return select_on_host
    return indexer.select_topk
