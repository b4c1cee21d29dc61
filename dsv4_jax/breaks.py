"""The break boundary: which stages leave the XLA program, where they run, per `BreakPlan`.

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

All of it is decided once, at trace time, by `plan_break` into a `BreakPlan` (a static part
of the compiled step's identity): the compiled program never branches on it. The input
GEMMs before the stages and the sparse attention and output projection after them always
stay in-graph.

What crosses a host boundary: in ``narrow``, the indexer queries, head weights, indexer key
cache and visible-entry counts go down and int32 picks [B, S, index_topk] (-1 padded) come
back; the cache writes stay in-graph. In ``wide`` the callback takes the state it updates
(window ring, compressor and indexer caches) and returns the new state with the picks.

On a mesh (``BreakPlan.layout``, see `sharding`): the selection (every kind: host callback,
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
import dataclasses
import functools
import itertools
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from . import indexer, indexer_kernel, native, numerics, sharding
from . import overlap as overlap_mod
from .backend import QUERY_BLOCK, map_query_blocks
from .config import CSA
from .kernel_plan import REFERENCE, KernelPlan, as_kernel_plan, check_choice
from .quantized_cache import QuantizedRows, read

BREAK_MODES = ("none", "narrow", "wide")
BREAK_PLACES = ("auto", "host", "device")


def check_break_mode(break_mode: Any) -> str:
    return check_choice("break_mode", break_mode, BREAK_MODES)


def check_break_on(break_on: Any) -> str:
    return check_choice("break_on", break_on, BREAK_PLACES)


def check_kernels(kernels: Any) -> str | KernelPlan:
    as_kernel_plan(kernels)  # raises a ValueError naming `kernels`
    return kernels


@dataclasses.dataclass(frozen=True)
class BreakPlan:
    """What runs where in one compiled step (hashable: part of the step's static identity).

    mode:          the effective break mode; "narrow" on a layer without an indexer (sliding,
                   HCA) has nothing to break and is "none", so both share one compiled step
    place:         "host" or "device" where there is a break, else None
    native_select: the indexer's selection is the native handler: the eager break
                   (narrow/device) or the graph-compatible target (none)
    layout:        a `sharding.MeshLayout` when the step runs on a mesh, else None: the breaks
                   (and the native selection) then run per batch shard (`sharding.run_per_shard`)
    kernels:       the `kernel_plan.KernelPlan` resolved for the step's platform: which stages
                   run a Pallas kernel (and how), which their XLA reference
    overlap:       the step's command buffers let independent stages run side by side
                   (`dsv4_jax.overlap`; resolved for the platform: never off CUDA)
    """

    mode: str
    place: str | None = None
    native_select: bool = False
    layout: Any = None
    kernels: KernelPlan = REFERENCE
    overlap: bool = False

    def indexer_select(self) -> Callable[..., Any]:
        """The `select_topk` that `step.run_stages` calls for this plan."""
        if self.native_select:
            select = functools.partial(_select_native, graph=self.mode == "none",
                                       segments=self.kernels.select_segments,
                                       select_keys=self.kernels.select_keys,
                                       scoring=self.kernels.select_scores)
        elif self.mode == "narrow":
            select = _select_on_host
        else:
            select = indexer.select_topk
        if self.layout is None:
            return select
        # On a mesh, per batch shard: a callback or a custom call is opaque to XLA's partitioner,
        # which would gather the global batch onto one device (callbacks) or every device (custom
        # calls) for it; and it also gathers the batch for `lax.top_k` (measured, jax 0.10).
        return functools.partial(_select_per_shard, select, self.layout, once=self.place == "host")


def plan_break(layer_type: str, break_mode: str, break_on: str = "auto", kernels: str | KernelPlan = "auto",
               platform: str | None = None, layout: Any = None, overlap: str = "auto") -> BreakPlan:
    """Resolve a layer's `break_mode`, `break_on`, `kernels` (a name or a `KernelPlan`) and
    `overlap` for `platform` (default: jax's default backend) into its `BreakPlan`; the one place
    these choices are made. `layout`: the step's `sharding.MeshLayout` (its breaks then run per
    batch shard), or None."""
    if platform is None and layout is not None and isinstance(layout.mesh, jax.sharding.Mesh):
        platform = layout.mesh.devices.flat[0].platform  # the mesh's devices, not jax's default
    plan = _plan_break(layer_type, break_mode, break_on, kernels, platform)
    on = overlap_mod.resolve(overlap, native.platform_name(platform or jax.default_backend()))
    return dataclasses.replace(plan, layout=layout, overlap=on)


def _plan_break(layer_type: str, break_mode: str, break_on: str, kernels: str | KernelPlan,
                platform: str | None) -> BreakPlan:
    check_break_mode(break_mode)
    check_break_on(break_on)
    requested = as_kernel_plan(kernels)
    platform = native.platform_name(platform or jax.default_backend())
    plan = requested.resolve(platform, native.available(platform))
    if break_mode == "wide":
        if break_on == "device":
            raise ValueError(
                "break_on: 'device' is not available with break_mode='wide' (the wide break runs "
                "wq_b_kv_insert, the compressors and the indexer in NumPy on the host); use "
                "break_on='host' or 'auto', or break_mode='narrow' for a device break"
            )
        return BreakPlan(mode="wide", place="host", kernels=dataclasses.replace(plan, select="xla"))
    if layer_type != CSA:  # no indexer: nothing to break, nothing to select (one step for every `select`)
        return BreakPlan(mode="none", kernels=dataclasses.replace(plan, select="xla"))
    if requested.select == "native" or (break_mode == "narrow" and break_on == "device"):
        what = "kernels.select='native'" if requested.select == "native" else "break_on='device'"
        _require_native(platform, requested.select, what)
    use_native = plan.select == "native"
    if break_mode == "none":
        return BreakPlan(mode="none", native_select=use_native, kernels=plan)
    place = "host" if break_on == "host" or (break_on == "auto" and not use_native) else "device"
    return BreakPlan(mode="narrow", place=place, native_select=place == "device", kernels=plan)


def _require_native(platform: str, select: str, what: str) -> None:
    if select == "xla":
        raise ValueError(f"{what}: needs the native indexer handlers, but kernels='xla' rules them out")
    reason = native.unavailable_reason(platform)
    if reason is not None:
        raise ValueError(f"{what}: the native indexer handlers are not usable on {platform}: {reason}")


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

    `fn` is ``partial(run_stages, spec=spec, select=indexer.select_topk)`` and `args` are
    ``(inputs, cache, positions, stage weights)``; on a mesh (``spec.plan.layout``) the callback
    runs once per batch shard with the weights whole (`sharding.run_per_shard`), and its new
    state keeps the cache's batch sharding.

    The host stages carry gradients (wq_b, the compressors' pooling, the cache inserts) that a
    callback cannot give. Every break mode computes the same values (the project's contract,
    tests/test_attention.py), so the backward is the VJP of `fn` traced in the graph on the
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


def _select_on_host(queries, weights, keys, visible, *, top_k, with_scores=False,
                    block=QUERY_BLOCK) -> indexer.Selection:
    """The narrow host break: `indexer.select_topk` in NumPy, inputs cut from differentiation.

    Its `Selection` crosses back whole; without `with_scores` its scores are None, a pytree
    node without leaves, so only the int32 picks come back from the host."""
    fn = functools.partial(indexer.select_topk, top_k=top_k, with_scores=with_scores, block=block)
    return host_call(fn, *jax.lax.stop_gradient((queries, weights, read(keys))), visible)


def _select_per_shard(select, layout, queries, weights, keys, visible, *, top_k, with_scores=False,
                      block=QUERY_BLOCK, once: bool) -> indexer.Selection:
    """`select` run per batch shard of a mesh (`sharding.run_per_shard`): every argument is
    ``[B, ...]``; `once` for a host callback (one device per batch shard calls the host)."""
    fn = functools.partial(select, top_k=top_k, with_scores=with_scores, block=block)
    return sharding.run_per_shard(fn, layout, (queries, weights, read(keys), visible), once=once)


def _select_native(queries, weights, keys, visible, *, top_k, with_scores=False, block=QUERY_BLOCK,
                   graph: bool, segments: int | None = None, select_keys: str = "auto",
                   scoring: str = "native") -> indexer.Selection:
    """The native selection, blocked over queries like `indexer.select_topk` (bounds the
    [B, block, T] scores of long prefills); the eager break unless `graph`; `segments` as
    `KernelPlan.select_segments`. `scoring`: `KernelPlan.select_scores` (resolved for the
    platform); where it chooses the Pallas kernel (`indexer_kernel.choose`) the handler's top-k
    picks from that kernel's scores. An FP8 cache's keys (`QuantizedRows`), by
    `KernelPlan.select_keys`: the handler's scoring reads their stored form
    (`native.select_topk_fp4`) unless "dequantized"; the Pallas kernel reads it
    (`indexer_kernel.index_scores_fp4`) where "stored", else a dequantized copy ("auto": with
    the stored form a CSA 64k prefill took 1.5x the time on the H200, each query block decoding
    the keys again)."""
    dense = read(keys)
    scoring = indexer_kernel.choose(scoring, queries, dense)
    fp4 = isinstance(keys, QuantizedRows) and keys.grid == "fp4" and keys.block == numerics.FP4_BLOCK
    stored = fp4 and (select_keys != "dequantized" if scoring == "native" else select_keys == "stored")
    if scoring == "native" and stored:

        def select_fp4_block(q, w, vis, codes, key_scales):
            picks, scores = native.select_topk_fp4(q, w, codes, key_scales, vis, top_k=top_k, graph=graph,
                                                   segments=segments)
            # No `_scores_with_gradient`: nothing differentiates through an FP8 cache (its writes refuse).
            return indexer.Selection(picks, scores if with_scores else None)

        return map_query_blocks(select_fp4_block, (queries, weights, visible), (keys.values, keys.scales), block)

    if stored:  # the Pallas kernel over the stored form

        def score_fp4_block(q, w, vis, codes, key_scales):
            scores = indexer_kernel.index_scores_fp4(*jax.lax.stop_gradient((q, w)), codes, key_scales, vis,
                                                     dtype=dense.dtype, interpret=scoring == "interpret")
            picks = native.topk(scores, vis, top_k=top_k, graph=graph, segments=segments)
            return indexer.Selection(picks, scores if with_scores else None)

        return map_query_blocks(score_fp4_block, (queries, weights, visible), (keys.values, keys.scales), block)

    def select_block(q, w, vis, k):
        if scoring == "native":
            picks, scores = native.select_topk(q, w, k, vis, top_k=top_k, graph=graph, segments=segments)
        else:  # the Pallas kernel's scores, the handler's top-k over them
            scores = indexer_kernel.index_scores(*jax.lax.stop_gradient((q, w, k)), vis,
                                                 interpret=scoring == "interpret")
            picks = native.topk(scores, vis, top_k=top_k, graph=graph, segments=segments)
        if with_scores and graph:  # break_mode="none": differentiable like the XLA scores (indexer_kl_loss)
            scores = _scores_with_gradient(scores, q, w, k, vis)
        return indexer.Selection(picks, scores if with_scores else None)

    return map_query_blocks(select_block, (queries, weights, visible), (dense,), block)


@jax.custom_jvp
def _scores_with_gradient(scores, queries, weights, keys, visible):
    """The native handler's scores, differentiated as `indexer.index_scores` (same formula, XLA)."""
    return scores


@_scores_with_gradient.defjvp
def _scores_with_gradient_jvp(primals, tangents):
    scores, queries, weights, keys, visible = primals
    _, dq, dw, dk, _ = tangents
    _, ds = jax.jvp(lambda q, w, k: indexer.index_scores(q, w, k, visible, block=q.shape[-3]),
                    (queries, weights, keys), (dq, dw, dk))
    return scores, ds
