"""What XLA would run on an H200, compiled on a machine without one: the kernels of a step, by stage.

    python -m venv .venv-deviceless
    .venv-deviceless/bin/pip install -e . "jax-cuda13-plugin==$JAX" "jax-cuda13-pjrt==$JAX"  # $JAX: jax's version
    .venv-deviceless/bin/python bench/deviceless.py --scenario decode --stacks csa,hca --batches 1,32
    .venv-deviceless/bin/python bench/deviceless.py --scenario train --stacks csa --batches 1 --tokens 4096
    # MaxText's training step (Python >= 3.12, the [peers] extra): its FLOP floor and memory on the H200
    .venv312-deviceless/bin/python bench/deviceless.py --scenario train --peer maxtext --batches 4

XLA compiles for a GPU it does not have from a description of it (``GpuTargetConfigProto``:
`bench/targets/h200.txtpb`, from openxla/xla's specs) through the CUDA plugin's compile-only
topology: the plugin and its PJRT library install from PyPI on any Linux machine, need no GPU,
driver or cuDNN (the version check is skipped: `JAX_SKIP_CUDA_CONSTRAINTS_CHECK`), and compile
with the CUDA toolkit's ptxas where one is on PATH. Keep them in a venv of their own: with them a
process looks for a GPU at start-up. The step is traced as on the H200 (the process pretends its
default backend is a GPU while tracing, so the kernel plan, the overlap and the Pallas kernels
resolve as there, and the native handlers' custom calls are named, not run), compiled with
XLA's dump on, and the dump read by `bench/hlo_census.py`: every thunk of the program (a kernel
launch, a copy, a custom call; the nodes of its CUDA graph) and the stage each kernel computes
(the step's named scopes).

What it is good for: counting kernels and copies before and after a change (issue 31's fewer
kernels per decode step), checking that a Pallas kernel compiles for sm_90 (Triton, ptxas) before
a device call, XLA's memory analysis of a program. What it is not: a timing, and not exactly the
H200's program: without the device XLA does not autotune (its GEMM configs are the heuristic's),
and jaxlib here may be older than the GPU machine's. Counts measured this way say "deviceless" in
their records.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
import tempfile
from typing import Any

# The CUDA plugin checks the CUDA libraries (cuDNN, cuBLAS, ...) when jax starts; a compile-only
# topology needs none of them.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax
import jax.numpy as jnp

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench import hlo_census  # noqa: E402
from bench import stack as stack_mod  # noqa: E402
from dsv4_jax import native  # noqa: E402
from dsv4_jax.ops.kernel_plan import BACKWARD_CHOICES, KernelPlan, as_kernel_plan  # noqa: E402

TARGETS = {"h200": os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets", "h200.txtpb")}
ATTACHED = "attached"  # target: the GPU of this machine
SCENARIOS = ("decode", "prefill", "train")
_INSTALL = ("install the CUDA plugin (no GPU needed) in a venv of its own: pip install "
            f"'jax-cuda13-plugin=={jax.__version__}' 'jax-cuda13-pjrt=={jax.__version__}', and start "
            "the process with JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (this script sets it if jax was not "
            "started before it)")


@functools.cache
def target_device(target: str = "h200"):
    """A compile-only device of `target` (a key of TARGETS): programs compile for it, never run.
    "attached": this machine's own GPU (the census of the real thing, autotuned: on the H200, to
    hold the deviceless census against it)."""
    if target == ATTACHED:
        try:
            return jax.devices("gpu")[0]
        except RuntimeError as err:
            raise RuntimeError(f"--target {ATTACHED} compiles for this machine's GPU, and it has none ({err}); "
                               "without one, compile for a described GPU: --target h200") from err
    from jax.experimental import topologies

    with open(TARGETS[target]) as f:
        config = f.read()
    try:
        topology = topologies.get_topology_desc("deviceless", "cuda", target_config=config, topology="1x1x1")
    except (NotImplementedError, RuntimeError, ValueError, TypeError) as err:
        raise RuntimeError(f"no compile-only CUDA topology in this process ({err}); {_INSTALL}") from err
    return topology.devices[0]


@contextlib.contextmanager
def pretend_gpu():
    """Trace as on a GPU machine: `jax.default_backend()` says "gpu" (the kernel plans, the overlap
    and the Pallas kernels' choices read it) and the native CUDA handlers count as usable (their
    custom calls are only compiled). Restored on exit; the handlers' cached verdicts are cleared."""
    saved_backend, saved_present = jax.default_backend, native._backend_present
    jax.default_backend = lambda: "gpu"
    native._backend_present = lambda platform: True
    native._registered.cache_clear()
    try:
        yield
    finally:
        jax.default_backend, native._backend_present = saved_backend, saved_present
        native._registered.cache_clear()


def _abstract(tree, device):
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


@dataclasses.dataclass(frozen=True)
class Case:
    """One program: `scenario` of a stack of `layers` layers of `stack` ("csa", "hca", "mixed")."""

    scenario: str
    stack: str
    batch: int
    tokens: int  # decode: the context; prefill and train: the tokens a row
    layers: int = 4
    size: str = "flash"
    finite_flag: bool = False  # decode, prefill: the steps compute the module call's finite flag
    kernels: Any = "auto"  # the layers' `kernels=` (a name or a `KernelPlan`)
    page_size: int | None = None  # decode, prefill: paged caches of pages of this many tokens
    queries: int = 1  # decode: the tokens a row of a step (a verification step: several)


def lowered(case: Case, device):
    """The case's program, traced as on the GPU and lowered for CUDA (jax's Lowered)."""
    cfg = stack_mod.stack_config(case.size, case.layers)
    dtype = jnp.bfloat16
    hidden = jax.ShapeDtypeStruct((case.batch, case.queries if case.scenario == "decode" else case.tokens,
                                   cfg.hidden_size),
                                  dtype, sharding=jax.sharding.SingleDeviceSharding(device))
    plan = as_kernel_plan(case.kernels)
    with pretend_gpu():
        if case.scenario == "train":
            from bench import train as train_mod

            stack = train_mod.TrainStack(cfg, case.stack, case.layers, dtype, 0, "none", plan)
            caches = jax.eval_shape(lambda: stack.empty_caches(case.batch, stack_mod._round_up(case.tokens)))
            positions = jax.ShapeDtypeStruct((case.batch, case.tokens), jnp.int32,
                                             sharding=jax.sharding.SingleDeviceSharding(device))
            jitted, args = train_mod.FWD_BWD, (stack.weights, caches, hidden, positions)
            static = {"specs": stack.specs, "remat": "none"}
        else:
            stack = stack_mod.Stack(cfg, case.stack, case.layers, dtype, 0, "none")
            for attn in stack.layers:
                attn.kernels = plan
            stack.set_overlap(stack.overlap)  # the specs again, with the plan
            extra = case.tokens + 64 if case.scenario == "decode" else case.tokens
            caches = jax.eval_shape(lambda: stack.empty_caches(case.batch, stack_mod._round_up(extra), case.page_size))
            if case.scenario == "decode":  # bench/stack.py --same-buffers all: what the stacks time
                jitted, args = stack.jits["all"], (stack.weights, caches, hidden)
            else:
                positions = jax.ShapeDtypeStruct((case.batch, case.tokens), jnp.int32,
                                                 sharding=jax.sharding.SingleDeviceSharding(device))
                jitted, args = stack.jits[None], (stack.weights, caches, hidden, positions)
            specs = stack.specs
            if case.finite_flag:
                from dsv4_jax.step import finite_flag

                specs = tuple(finite_flag.flagged_spec(spec) for spec in specs)
            static = {"specs": specs}
        args = (_abstract(args[0], device), _abstract(args[1], device), *args[2:])
        return jitted.trace(*args, **static).lower(lowering_platforms=("cuda",)), stack


def census(case: Case, target: str = "h200", keep_dump: str | None = None, autotune: str | None = None) -> dict:
    """Compile the case for `target` without the device; its census (`hlo_census.census_of`,
    with the kernels by stage) and XLA's memory analysis. `autotune`: XLA's autotuning results
    from a run on the device (`bash bench/gpu.sh ab` or `trainab` with AUTOTUNE_DUMP=1) to
    compile with the GEMM configs the device chose instead of the heuristic's; XLA uses the
    entries whose device string matches the target's (`bench/targets/`), untried so far."""
    device = target_device(target)
    low, stack = lowered(case, device)
    with tempfile.TemporaryDirectory() as tmp:
        if keep_dump:  # a folder of the case's own in it
            os.makedirs(keep_dump, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f"{case.scenario}_{case.stack}_B{case.batch}_{case.tokens}_", dir=keep_dump)
        dump = tmp
        options = {"xla_dump_to": dump, "xla_dump_hlo_as_text": True}
        if autotune:
            options["xla_gpu_load_autotune_results_from"] = os.path.abspath(autotune)
        compiled = low.compile(compiler_options=options)
        rows = hlo_census.census(dump, module="")
    if len(rows) != 1:
        raise RuntimeError(f"expected one optimized module in the dump, found {len(rows)}")
    mem = compiled.memory_analysis()
    row = rows[0]
    launches = sum(v for k, v in row.get("thunks", {}).items() if k not in hlo_census.CONTAINERS)
    return {**row, **dataclasses.asdict(case), "scenario": f"deviceless_{case.scenario}", "target": target,
            "autotune": autotune, "layer_type": stack.layer_type, "jax": jax.__version__, "deviceless": True,
            "launches": launches, "launches_per_layer": launches / case.layers,
            "critical_path_per_layer": row["critical_path"] / case.layers,
            "stages_per_layer": {k: v / case.layers for k, v in row.get("stages", {}).items()},
            "temp_mib": mem.temp_size_in_bytes / 2**20 if mem else None}


def device_memory_bytes(target: str = "h200") -> float:
    """The memory of `target`'s GPU: the description's ``device_memory_size``, or the attached GPU's pool."""
    if target == ATTACHED:
        return float(target_device(target).memory_stats()["bytes_limit"])
    with open(TARGETS[target]) as f:
        sizes = [line.split(":")[1] for line in f if line.strip().startswith("device_memory_size:")]
    return float(sizes[0])


def maxtext_train(case: Case, target: str = "h200") -> dict:
    """MaxText's training step beside the case's (bench/train.py's peer: one layer of each of the
    stack's layer types, `peer_maxtext.train_floor`), compiled for `target` without the device: its
    matrix FLOPs' floor and XLA's memory analysis, and whether it fits the GPU's memory. Where it
    fits, ``maxtext_fwd_bwd_floor_ms`` is a time it cannot beat there (a mixed stack: the mean of its
    layer types, as bench/train.py averages the peer's times); where it does not, it does not run.
    Needs Python >= 3.12 with the ``[peers]`` extra and the CUDA plugin (docs/benchmarks.md)."""
    from bench import peer_maxtext
    from bench import train as train_mod

    reason = peer_maxtext.available()
    if reason:
        raise RuntimeError(f"--peer maxtext: MaxText does not import here ({reason})")
    device = target_device(target)
    cfg = stack_mod.stack_config(case.size, case.layers)
    stack = train_mod.TrainStack(cfg, case.stack, case.layers, jnp.bfloat16, 0, "none", "auto")
    types = [a.layer_type for a in stack.layers]
    per_type = [peer_maxtext.train_floor(cfg, case.size, lt, stack.layers[types.index(lt)], batch=case.batch,
                                         seq=case.tokens, dtype="bfloat16", device=device)
                for lt in dict.fromkeys(types)]
    memory = device_memory_bytes(target)
    need = max(r["fwd_bwd_gb"] for r in per_type)
    return {"scenario": "deviceless_maxtext_train", "stack": case.stack, "layer_type": stack.layer_type,
            "batch": case.batch, "tokens": case.tokens, "size": case.size, "target": target, "deviceless": True,
            "jax": jax.__version__, "maxtext": peer_maxtext.versions().get("maxtext"), "per_layer_type": per_type,
            "maxtext_fwd_floor_ms": sum(r["fwd_floor_ms"] for r in per_type) / len(per_type),
            "maxtext_fwd_bwd_floor_ms": sum(r["fwd_bwd_floor_ms"] for r in per_type) / len(per_type),
            "maxtext_fwd_bwd_gb": need, "device_memory_gb": memory / 1e9, "fits": need * 1e9 <= memory}


def maxtext_markdown(rows: list[dict]) -> str:
    lines = ["| case | MaxText fwd+bwd floor ms a layer | its fwd floor | XLA memory GB (fwd+bwd) | fits |",
             "|---|---|---|---|---|"]
    for r in rows:
        memory = f"{r['maxtext_fwd_bwd_gb']:.1f} of {r['device_memory_gb']:.0f}"
        lines.append(f"| train {r['layer_type']} B={r['batch']} {r['tokens']} | {r['maxtext_fwd_bwd_floor_ms']:.1f} | "
                     f"{r['maxtext_fwd_floor_ms']:.1f} | {memory} | {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """Launches a layer (kernels, copies, custom calls): all, on the critical path (one after
    another however many run side by side), and by stage; the step's command buffers."""
    stages = _stage_columns(rows)
    head = ["case", "launches a layer", "in a chain", "graphs", *stages]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        extra = ", finite flag" if r.get("finite_flag") else ""
        plan = r.get("kernels")
        if isinstance(plan, dict):  # a forced plan: what differs from the default
            extra += ", " + ", ".join(f"{k} {tuple(v) if isinstance(v, list) else v}" for k, v in plan.items()
                                      if v != getattr(KernelPlan(), k))
        scenario = r["scenario"].removeprefix("deviceless_")
        case = f"{scenario} {r['layer_type']} x{r['layers']} B={r['batch']} {r['tokens']}{extra}"
        cells = [f"{r['stages_per_layer'].get(s, 0):g}" for s in stages]
        lines.append(f"| {case} | {r['launches_per_layer']:g} | {r['critical_path_per_layer']:g} | "
                     f"{r.get('command_buffers', '-')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _stage_columns(rows: list[dict]) -> list[str]:
    present = {s for r in rows for s in r["stages_per_layer"]}
    return sorted(present, key=hlo_census.stage_rank)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", choices=SCENARIOS, default="decode")
    ap.add_argument("--stacks", default="csa,hca", help="csa, hca, mixed (comma-separated)")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--tokens", default=None,
                    help="decode: contexts (default 16384); prefill, train: tokens a row (default 4096)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--size", default="flash")
    ap.add_argument("--finite-flag", action="store_true",
                    help="decode, prefill: the steps compute the module call's finite flag "
                         "(dsv4_jax.step.finite_flag)")
    ap.add_argument("--decode-kernel", action="store_true",
                    help="the Pallas decode kernel for every decode shape it takes (as bench/stack.py's)")
    ap.add_argument("--decode-blocks", default=None, metavar="BK,BH,WARPS,STAGES",
                    help="blocks of every decode step the kernel runs (as bench/stack.py's)")
    ap.add_argument("--projection-kernel", action="store_true",
                    help="the projections of calls of at most 64 token rows by the Pallas kernel (as bench/stack.py's)")
    ap.add_argument("--query-norm-kernel", action="store_true",
                    help="the queries' norm and RoPE by the Pallas kernel, decode too (as bench/stack.py's)")
    ap.add_argument("--merge-kernel", action="store_true",
                    help="decode attention's split merge by the Pallas kernel (as bench/stack.py's)")
    ap.add_argument("--no-merge-kernel", action="store_true",
                    help="decode attention's split merge by XLA (as bench/stack.py's)")
    ap.add_argument("--attention-backward", default=None, choices=BACKWARD_CHOICES,
                    help="train: the sparse attention's backward (KernelPlan.attention_backward; as bench/train.py's)")
    ap.add_argument("--peer", default=None, choices=("maxtext",),
                    help="train: MaxText's training step instead of ours, its FLOP floor and memory (maxtext_train)")
    ap.add_argument("--target", choices=[*sorted(TARGETS), ATTACHED], default="h200",
                    help="the GPU described in bench/targets/, or 'attached': this machine's own (no pretence)")
    ap.add_argument("--autotune", default=None, metavar="TEXTPROTO",
                    help="XLA's autotuning results from the device (gpu.sh AUTOTUNE_DUMP=1) to compile with")
    ap.add_argument("--keep-dump", default=None, help="keep XLA's dumps here (a folder a case)")
    ap.add_argument("--json", default=None, help="write the records here")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    tokens = args.tokens or ("16384" if args.scenario == "decode" else "4096")
    ab = (args.decode_kernel or args.decode_blocks or args.projection_kernel or args.merge_kernel
          or args.no_merge_kernel or args.query_norm_kernel)
    kernels = stack_mod.kernel_plan(args) if ab else "auto"
    if args.attention_backward:
        kernels = dataclasses.replace(as_kernel_plan(kernels), attention_backward=args.attention_backward)
    if args.peer and args.scenario != "train":
        raise SystemExit("--peer maxtext: the train scenario only")
    if args.peer:
        row, table = (lambda case: maxtext_train(case, args.target)), maxtext_markdown
    else:
        row, table = (lambda case: census(case, args.target, args.keep_dump, args.autotune)), markdown
    rows = []
    for kind in args.stacks.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for n in (int(t) for t in tokens.split(",")):
                rows.append(row(Case(args.scenario, kind, batch, n, args.layers, args.size, args.finite_flag, kernels)))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"records": rows, "meta": {"jax": jax.__version__, "target": args.target,
                                                 "argv": sys.argv[1:]}}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
