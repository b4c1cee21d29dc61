"""Which kernels take a compiled step's time: JAX's profiler, summed per XLA operation.

    table = kernel_profile.profile(run_once, steps=20, log_dir="/tmp/prof")

`run_once()` runs the step (and blocks); it is called `steps` times inside a
`jax.profiler` trace. The trace (an XSpace protobuf) is read back with
`jax.profiler.ProfileData` and every kernel event on the device planes (`/device:GPU:*`; on
a CPU, the `/host:CPU` thunks that carry an ``hlo_op`` stat) is attributed to its XLA
operation (the ``hlo_op`` stat: a fusion, a custom call, a cuBLAS GEMM, ...). The result
lists per operation the device time per step and the number of kernels per step, largest
first, plus the device busy time per step (sum of kernel times; kernels of one stream do not
overlap) and the wall time per step.

XLA replays a step's kernels as CUDA graphs (command buffers). By default it turns command
buffers off while a profiler is active, which changes what is measured; so on the GPU set
``--xla_enable_command_buffers_during_profiling=true`` in ``XLA_FLAGS`` *before* JAX starts
(`bench/stack.py --profile` does). Kernels inside graphs are still reported one by one (CUPTI
traces graph kernel nodes).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import time

import jax

PROFILING_FLAG = "--xla_enable_command_buffers_during_profiling=true"


def _stats(event) -> dict:
    try:
        return dict(event.stats)
    except Exception:
        return {}


def _device_planes(data):
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    return planes or [p for p in data.planes if p.name == "/host:CPU"]


def summarize(xplane_path: str, steps: int, module_filter: str | None = None) -> dict:
    """Per-operation device time of a trace, divided by `steps` (see the module docstring)."""
    data = jax.profiler.ProfileData.from_file(xplane_path)
    per_op = collections.defaultdict(lambda: {"us": 0.0, "kernels": 0, "kernel_names": set()})
    per_kernel = collections.defaultdict(lambda: [0.0, 0])  # kernel name -> [us, count]
    busy_ns = 0.0
    for plane in _device_planes(data):
        for line in plane.lines:
            for ev in line.events:
                st = _stats(ev)
                op = st.get("hlo_op")
                if op is None and not plane.name.startswith("/device:"):
                    continue  # host threads: only XLA thunks count
                module = st.get("hlo_module", "")
                if module_filter and module and module_filter not in str(module):
                    continue
                # Inside a command buffer every kernel carries the buffer's name as its hlo_op;
                # then the kernel's own name (XLA names a fusion's kernel after the fusion) is the key.
                key = str(op) if op is not None and not str(op).startswith("command_buffer") else ev.name
                rec = per_op[key]
                rec["us"] += ev.duration_ns / 1e3
                rec["kernels"] += 1
                if len(rec["kernel_names"]) < 3:
                    rec["kernel_names"].add(ev.name[:80])
                by_name = per_kernel[ev.name[:80]]
                by_name[0] += ev.duration_ns / 1e3
                by_name[1] += 1
                busy_ns += ev.duration_ns
    rows = [{"op": k, "us_per_step": v["us"] / steps, "kernels_per_step": v["kernels"] / steps,
             "kernel_names": sorted(v["kernel_names"])} for k, v in per_op.items()]
    rows.sort(key=lambda r: -r["us_per_step"])
    # One XLA operation may launch several kernels (a custom call's scoring and top-k): their
    # own times, largest first.
    kernels = [{"kernel": k, "us_per_step": us / steps, "per_step": n / steps}
               for k, (us, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:20]]
    return {"rows": rows, "kernels": kernels, "busy_us_per_step": busy_ns / 1e3 / steps,
            "kernels_per_step": sum(r["kernels_per_step"] for r in rows)}


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}")


def hlo_sources(compiled_text: str) -> dict:
    """XLA instruction name -> its ``op_name`` (the JAX name stack, e.g.
    ``jit(stack_step)/sparse_attention/jit(take_along_axis)/gather``; a fusion carries the
    metadata of its root operation). The step's stages are `jax.named_scope`s, so the second
    component names the stage."""
    out = {}
    for line in compiled_text.splitlines():
        m = _INSTR.match(line)
        if m:
            op = re.search(r'op_name="([^"]*)"', m.group(2))
            if op:
                out[m.group(1)] = op.group(1)
    return out


_ANY_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\(([^)]*)\)")


def hlo_shapes(compiled_text: str) -> dict:
    """XLA instruction name -> ``"<shape> <opcode>(<operands>)"``, for the kernels whose
    instruction carries no ``op_name`` (XLA's own: a copy, a fusion XLA made of a rewritten
    gather or scatter): what it produces and from what tells which cache leaf or stage it is."""
    out = {}
    for line in compiled_text.splitlines():
        m = _ANY_INSTR.match(line)
        if m:
            name, shape, opcode, operands = m.groups()
            args = ", ".join(a.strip().lstrip("%") for a in operands.split(",") if a.strip())
            out[name] = f"{shape.split('{')[0]} {opcode}({args})"
    return out


def stage_of(op_name: str) -> str:
    """The stage of an op_name: its first named scope below the outer ``jit(...)``."""
    parts = [p for p in op_name.split("/") if p and not p.startswith("jit(")]
    return parts[0] if len(parts) > 1 else "(other)"


def attach_sources(summary: dict, compiled_text: str) -> dict:
    """Add each row's source op_name (`hlo_sources`) and a per-stage table ``by_source``."""
    sources = hlo_sources(compiled_text)
    shapes = hlo_shapes(compiled_text)
    # Kernel names are the fusion names with "." as "_" ("loop_fusion_3" <- "loop_fusion.3").
    sources.update({k.replace(".", "_"): v for k, v in list(sources.items())})
    shapes.update({k.replace(".", "_"): v for k, v in list(shapes.items())})
    by_source = collections.defaultdict(lambda: {"us_per_step": 0.0, "kernels_per_step": 0.0, "ops": 0})
    for row in summary["rows"]:
        row["source"] = sources.get(row["op"], "")
        if not row["source"] and row["op"] in shapes:
            row["hlo"] = shapes[row["op"]]
        key = stage_of(row["source"])
        agg = by_source[key]
        agg["us_per_step"] += row["us_per_step"]
        agg["kernels_per_step"] += row["kernels_per_step"]
        agg["ops"] += 1
    summary["by_source"] = sorted(({"source": k, **v} for k, v in by_source.items()),
                                  key=lambda r: -r["us_per_step"])
    return summary


def _options():
    """The profiler's options: no Python tracer (its frames would slow the host and crowd the
    host events), the host's own tracer (XLA's execute and thunk events, CUDA API calls) on."""
    try:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        return options
    except (AttributeError, TypeError):  # a jax without ProfileOptions
        return None


def profile(run_once, steps: int, log_dir: str, module_filter: str | None = None) -> dict:
    """Trace `steps` calls of `run_once` and summarize them (plus the wall time per step)."""
    os.makedirs(log_dir, exist_ok=True)
    run_once()  # warm: compiled and allocated before the trace starts
    jax.profiler.start_trace(log_dir, profiler_options=_options())
    t0 = time.perf_counter()
    for _ in range(steps):
        run_once()
    wall = (time.perf_counter() - t0) / steps
    jax.profiler.stop_trace()
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no .xplane.pb under {log_dir}")
    out = summarize(paths[-1], steps, module_filter)
    out["host_events"] = host_events(paths[-1], steps)
    out["wall_us_per_step"] = 1e6 * wall
    out["steps"] = steps
    out["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    return out


def host_events(xplane_path: str, steps: int, top: int = 20) -> list:
    """The host's side of the traced steps: the largest event names of the host plane's
    threads (XLA's execute, thunk and CUDA API events), us per step and count per step.
    Events nest (an execute holds its thunks), so the rows overlap and do not add up."""
    data = jax.profiler.ProfileData.from_file(xplane_path)
    per_name = collections.defaultdict(lambda: [0.0, 0])
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for ev in line.events:
                if "profiler.py" in ev.name:  # the trace's own stop, outside the steps
                    continue
                rec = per_name[f"{line.name[:24]}: {ev.name[:70]}"]
                rec[0] += ev.duration_ns / 1e3
                rec[1] += 1
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"event": k, "us_per_step": us / steps, "per_step": n / steps} for k, (us, n) in rows]


def markdown(summary: dict, top: int = 25, title: str = "") -> str:
    """A table of the largest operations of a summary."""
    lines = [f"{title} device busy {summary['busy_us_per_step']:.1f} us/step, "
             f"{summary['kernels_per_step']:.0f} kernels/step, wall {summary.get('wall_us_per_step', 0):.1f} us/step",
             "", "| XLA op | us/step | share | kernels/step | source (JAX op_name) |", "|---|---|---|---|---|"]
    busy = summary["busy_us_per_step"] or 1.0
    for r in summary["rows"][:top]:
        lines.append(f"| `{r['op'][:60]}` | {r['us_per_step']:.1f} | {100 * r['us_per_step'] / busy:.0f}% | "
                     f"{r['kernels_per_step']:.1f} | `{(r.get('source') or 'hlo: ' + r.get('hlo', ''))[:90]}` |")
    if summary.get("by_source"):
        lines += ["", "| stage (named scope) | us/step | share | kernels/step | XLA ops |", "|---|---|---|---|---|"]
        for r in summary["by_source"][:top]:
            lines.append(f"| `{r['source']}` | {r['us_per_step']:.1f} | {100 * r['us_per_step'] / busy:.0f}% | "
                         f"{r['kernels_per_step']:.1f} | {r['ops']} |")
    if summary.get("host_events"):
        lines += ["", "| host event (thread: name; nested, overlapping) | us/step | per step |", "|---|---|---|"]
        for r in summary["host_events"]:
            lines.append(f"| `{r['event']}` | {r['us_per_step']:.1f} | {r['per_step']:.1f} |")
    return "\n".join(lines)
