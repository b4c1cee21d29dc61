"""The step's plan: what runs where in one compiled step, decided once at trace time.

`plan_step` resolves a layer's `break_mode`, `break_on`, `kernels` and `overlap` for the step's
platform into a `StepPlan`, a static (hashable) part of the compiled step's identity
(`pure_step.StepSpec.plan`): the compiled program never branches on it. Which stages leave the
XLA program and how they run there is `breaks`; which implementation runs each kernel-backed
stage is the plan's `kernels` (`ops.kernel_plan.KernelPlan`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from dsv4_jax import native
from dsv4_jax.config import CSA, check_choice
from dsv4_jax.ops.indexer import native as indexer_native
from dsv4_jax.ops.indexer import reference as indexer
from dsv4_jax.ops.kernel_plan import REFERENCE, KernelPlan, as_kernel_plan
from dsv4_jax.step import breaks
from dsv4_jax.step import overlap as overlap_mod

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
class StepPlan:
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
                   (`dsv4_jax.step.overlap`; resolved for the platform: never off CUDA)
    deterministic: the step compiles with XLA's options for run-to-run identical programs
                   (`overlap.DETERMINISTIC_OPTIONS`; resolved for the platform: only on CUDA,
                   where XLA's code is otherwise free to differ from one compile to the next)
    """

    mode: str
    place: str | None = None
    native_select: bool = False
    layout: Any = None
    kernels: KernelPlan = REFERENCE
    overlap: bool = False
    deterministic: bool = False

    def indexer_select(self) -> Callable[..., Any]:
        """The `select_topk` that `pure_step.run_stages` calls for this plan. The wide break's:
        NumPy's, inside the host break (which runs per batch shard itself, `breaks.wide_host_call`)."""
        if self.mode == "wide":
            return indexer.select_topk
        if self.native_select:
            select = functools.partial(indexer_native.select_native, graph=self.mode == "none",
                                       kernels=self.kernels)
        elif self.mode == "narrow":
            select = breaks.select_on_host
        else:
            select = indexer.select_topk
        if self.layout is None:
            return select
        # On a mesh, per batch shard: a callback or a custom call is opaque to XLA's partitioner,
        # which would gather the global batch onto one device (callbacks) or every device (custom
        # calls) for it; and it also gathers the batch for `lax.top_k` (measured, jax 0.10).
        return functools.partial(breaks.select_per_shard, select, self.layout, once=self.place == "host")


def plan_step(layer_type: str, break_mode: str, break_on: str = "auto", kernels: str | KernelPlan = "auto",
              platform: str | None = None, layout: Any = None, overlap: str = "auto",
              deterministic: bool = False) -> StepPlan:
    """Resolve a layer's `break_mode`, `break_on`, `kernels` (a name or a `KernelPlan`),
    `overlap` and `deterministic` for `platform` (default: jax's default backend) into its
    `StepPlan`; the one place these choices are made. `layout`: the step's
    `sharding.MeshLayout` (its breaks then run per batch shard), or None."""
    if platform is None and layout is not None and isinstance(layout.mesh, jax.sharding.Mesh):
        platform = layout.mesh.devices.flat[0].platform  # the mesh's devices, not jax's default
    plan = _plan_step(layer_type, break_mode, break_on, kernels, platform)
    platform = native.platform_name(platform or jax.default_backend())
    return dataclasses.replace(plan, layout=layout, overlap=overlap_mod.resolve(overlap, platform),
                               deterministic=bool(deterministic) and platform == "cuda")


def _plan_step(layer_type: str, break_mode: str, break_on: str, kernels: str | KernelPlan,
                platform: str | None) -> StepPlan:
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
        return StepPlan(mode="wide", place="host", kernels=dataclasses.replace(plan, select="xla"))
    if layer_type != CSA:  # no indexer: nothing to break, nothing to select (one step for every `select`)
        return StepPlan(mode="none", kernels=dataclasses.replace(plan, select="xla"))
    if requested.select == "native" or (break_mode == "narrow" and break_on == "device"):
        what = "kernels.select='native'" if requested.select == "native" else "break_on='device'"
        _require_native(platform, requested.select, what)
    use_native = plan.select == "native"
    if break_mode == "none":
        return StepPlan(mode="none", native_select=use_native, kernels=plan)
    place = "host" if break_on == "host" or (break_on == "auto" and not use_native) else "device"
    return StepPlan(mode="narrow", place=place, native_select=place == "device", kernels=plan)


def _require_native(platform: str, select: str, what: str) -> None:
    if select == "xla":
        raise ValueError(f"{what}: needs the native indexer handlers, but kernels='xla' rules them out")
    reason = native.unavailable_reason(platform)
    if reason is not None:
        raise ValueError(f"{what}: the native indexer handlers are not usable on {platform}: {reason}")


# ------------------------------------------------------------------ the break, in words
# The one place the user-facing claims about the break are written: the demo prints
# `where_break_runs()`; notebooks/quickstart.ipynb prints it, carries `break_table()` and
# `GRADIENT_CLAIM` verbatim in its prose (tests/docs/test_notebooks.py checks both) and differentiates
# in every mode of `GRADIENT_MODES`; tests/step/test_gradients.py checks those gradients against the
# XLA reference's.

# Reverse mode (`jax.grad`, `nnx.grad`) differentiates the layer in every break mode; forward mode
# (`jax.jvp`) not through the wide break (its host stages are a `jax.custom_vjp`).
GRADIENT_MODES = BREAK_MODES
FORWARD_MODE_GRADIENT_MODES = ("none", "narrow")
GRADIENT_CLAIM = (
    "`jax.grad` and `nnx.grad` go through the layer in every break mode (`none`, `narrow`, `wide`; "
    "forward mode, `jax.jvp`, not through `wide`)"
)

# mode -> (what leaves the XLA program, where it runs with break_on="auto", the default)
BREAK_SUMMARY = {
    "none": ("nothing (the indexer's top-k stays in the program)", "—"),
    "narrow": ("the lightning indexer's scoring + top-k",
               "on the device (a native XLA FFI custom call) where the native part is built, "
               "else on the host (`jax.pure_callback`)"),
    "wide": ("`wq_b_kv_insert` + the compressors + the indexer", "on the host (`jax.pure_callback`), always"),
}
assert tuple(BREAK_SUMMARY) == BREAK_MODES and set(GRADIENT_MODES) <= set(BREAK_MODES)


def break_table() -> str:
    """`BREAK_SUMMARY` as a markdown table (the quickstart notebook's section 4 carries it)."""
    rows = ["| `break_mode` | leaves the XLA program | where it runs (`break_on=\"auto\"`) |", "|---|---|---|"]
    rows += [f"| `{mode}`{' (default)' if mode == 'narrow' else ''} | {what} | {where} |"
             for mode, (what, where) in BREAK_SUMMARY.items()]
    return "\n".join(rows)


def where_break_runs(break_mode: str = "narrow", break_on: str = "auto", platform: str | None = None) -> str:
    """Where a CSA layer's break runs in this process, in one line: what `plan_step` decides for
    `platform` (default: jax's default backend) and, for a host break, why not on the device."""
    platform = native.platform_name(platform or jax.default_backend())
    plan = _plan_step(CSA, break_mode, break_on, "auto", platform)
    if plan.mode == "none":
        return f"no break: the selection stays in the XLA program ({platform})"
    if plan.place == "device":
        return f"the {plan.mode} break runs on the device ({platform}: native XLA FFI handler)"
    why = ("the wide break always does" if plan.mode == "wide" else
           "break_on='host'" if break_on == "host" else native.unavailable_reason(platform))
    return f"the {plan.mode} break runs on the host (jax.pure_callback; {why})"


BreakPlan = StepPlan  # its name before it held the whole plan (the public `dsv4_jax.BreakPlan`)
