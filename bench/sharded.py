"""The sharded layer on several devices against one device: equality, step time, scaling, collectives.

    python bench/sharded.py --size flash --json $OUT/sharded.json        # nvidia-h200-x2 (bench/gpu_sharded.sh)
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
        python bench/sharded.py --size tiny --quick --json /tmp/s.json   # CPU smoke, 2 fake devices
    python bench/sharded.py --render bench/results/<run>.json            # tables of a past run

For each layer type (CSA in modes ``none``, ``narrow`` with ``break_on="host"`` and with
``break_on="device"``; HCA, which has no indexer, in ``none``) and each case (decode at B = 8
and 32 from a 16k context, prefill of 4k tokens at B = 2), the same layer (same weights), the
same inputs and the same starting cache run

* on **one device** (the plain layer, `dsv4_jax.step.pure_step.step_function`), mesh ``"1"``;
* on every mesh of ``--meshes`` (``DATAxMODEL``; default ``2x1`` = batch over two devices and
  ``1x2`` = heads over two devices), through `dsv4_jax.step.sharding` (`shard_layer`,
  `shard_cache`; the step: `dsv4_jax.step.pure_step.sharded_attention_step`).

Each record (scenario ``sharded_decode`` / ``sharded_prefill``) holds:

* ``step_ms``: the median step time (decode: repeats of ``steps`` back-to-back steps, caches
  donated, as a decode loop runs; prefill: whole calls from an empty cache, blocked).
  ``compile_s``: the AOT compile of the timed program, never part of a timing.
* ``speedup`` = one device's ``step_ms`` / this mesh's, and ``scaling_efficiency`` =
  speedup / devices (strong scaling: the same global batch on more devices).
* Equality with one device, from the first step of the same cache and inputs, through the
  step with intermediates (a separate compile): ``max_abs_diff`` of the outputs (and
  ``out_max``, the largest output magnitude, to read it against), ``cache_max_abs_diff`` over
  every cache leaf, ``picks_identical`` (the fraction of query rows whose top-k picks are the
  same list, order included; CSA), ``picks_set_identical`` (the same entries in any order: what
  the attention sees, which sums over the picked set) and ``within_tolerance`` (``max_abs_diff <= tol * out_max``;
  ``--tolerance``: 1e-2 in bf16, 1e-5 in float32; bf16's unit roundoff is 3.9e-3, and a
  split over heads sums the output projection's groups in another order).
* ``collectives``: the collective operations of the compiled program (``all-reduce``,
  ``all-gather``, ``reduce-scatter``, ``collective-permute``, ``all-to-all``), with count and
  shapes, read from ``compiled.as_text()`` (the HLO after XLA's optimizations).
* ``thunks`` (GPU, when ``--xla-dump DIR`` is given; `bench/gpu_sharded.sh` does): the step's
  top-level thunk sequence from XLA's dump: each ``kCommandBuffer`` is one CUDA-graph launch;
  a collective at top level, or nested under a top-level ``kAsyncStart`` (how XLA wraps an
  asynchronous collective), runs outside the graphs (``collective_kinds_outside``); one nested
  under a ``kCommandBuffer`` was recorded inside a graph (``collective_kinds_inside``). With
  ``--vlog FILE`` (stderr of the run with ``TF_CPP_VMODULE=command_buffer_conversion_pass=3``),
  the thunk kinds recorded inside each graph are listed too (``graph_thunk_kinds``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _dump_flags(argv) -> None:
    """``--xla-dump DIR`` must reach XLA_FLAGS before the backend starts."""
    if "--xla-dump" in argv:
        where = argv[argv.index("--xla-dump") + 1]
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={where}"
                                   " --xla_dump_hlo_module_re=.*attention_step.*").strip()
        os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # a cached program compiles nothing to dump


if __name__ == "__main__":
    _dump_flags(sys.argv)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import measure, report  # noqa: E402
from bench import plan as plan_mod  # noqa: E402
from bench import stack as stack_mod  # noqa: E402
from dsv4_jax import native  # noqa: E402
from dsv4_jax.config import CSA, HCA  # noqa: E402
from dsv4_jax.step import sharding  # noqa: E402
from dsv4_jax.step.pure_step import step_function  # noqa: E402

# (layer name, mode): the issue's matrix. HCA has no indexer: narrow is none there.
RUNS = (("csa", "none"), ("csa", "narrow"), ("csa", "narrow-device"), ("hca", "none"))
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# The result shape may be a tuple with spaces, e.g. an asynchronous all-reduce-start's.
_COLLECTIVE_RE = re.compile(r"=\s*(\([^=]*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_COLLECTIVE_THUNK_RE = re.compile(r"k\w*(AllReduce|AllGather|ReduceScatter|CollectivePermute|AllToAll|Collective)\w*")
MARK = "@@BENCH_SHARDED"


# ---------------------------------------------------------------------------- reading the program
def collectives(hlo_text: str) -> dict:
    """{op: {"count": n, "shapes": {shape: n}}} of the collectives in an HLO module's text.

    An async pair (``all-reduce-start`` / ``-done``) counts once (the start)."""
    found: dict = {}
    for shape, op, _start in _COLLECTIVE_RE.findall(hlo_text):
        entry = found.setdefault(op, {"count": 0, "shapes": {}})
        entry["count"] += 1
        entry["shapes"][shape] = entry["shapes"].get(shape, 0) + 1
    return found


def thunk_summary(text: str) -> dict:
    """The top-level thunks of a ``*thunk_sequence_after_thunk_passes.txt`` dump and which
    collectives run outside the CUDA graphs.

    A top-level ``kCommandBuffer`` is one graph launch; the thunks indented under it were
    recorded into the graph. XLA wraps an asynchronous collective in a top-level
    ``kAsyncStart`` whose nested thunk is the collective itself (``kAllReduce`` through NCCL,
    or ``kCollectiveKernel``, XLA's own one-shot all-reduce kernel) and a ``kAsyncDone``: a
    collective found at top level or nested under any top-level thunk other than a command
    buffer runs outside the graphs; one nested under a command buffer runs inside.
    """
    top: list = []  # [kind, [nested kinds]]
    for line in text.splitlines():
        m = re.match(r"^(\s*)\d+: (k\w+)", line)
        if not m:
            continue
        if not m.group(1):
            top.append([m.group(2), []])
        elif top:
            top[-1][1].append(m.group(2))
    order = [kind for kind, _ in top]
    outside = [k for kind, nested in top if kind != "kCommandBuffer"
               for k in (kind, *nested) if _COLLECTIVE_THUNK_RE.fullmatch(k)]
    inside = [k for kind, nested in top if kind == "kCommandBuffer"
              for k in nested if _COLLECTIVE_THUNK_RE.fullmatch(k)]
    return {"top_level": order, "command_buffers": order.count("kCommandBuffer"),
            "collective_thunks_outside": len(outside), "collective_kinds_outside": sorted(set(outside)),
            "collective_thunks_inside": len(inside), "collective_kinds_inside": sorted(set(inside))}


def graph_kinds(vlog: str) -> dict:
    """{case: [[thunk kinds of graph 1], ...]} from the command-buffer pass's log, attributed
    to the cases by the markers this script prints to stderr."""
    out: dict = {}
    case = None
    for line in vlog.splitlines():
        if MARK in line:
            m = re.search(MARK + r" (begin|end) (\S+)", line)
            case = m.group(2) if m and m.group(1) == "begin" else None
            continue
        if case is None:
            continue
        m = re.search(r"Creating command buffer thunk(?: \S+)? with the following thunks: (.*)$", line)
        if m:
            out.setdefault(case, []).append(sorted(set(t for t in m.group(1).split(", ") if t)))
    return out


class Dump:
    """The files XLA dumps (``--xla-dump``); `new()` returns the step's thunk sequence file
    written since the last call."""

    def __init__(self, where: str | None):
        self.dir = Path(where) if where else None
        self.seen = self._files()

    def _files(self) -> set:
        if self.dir is None or not self.dir.is_dir():
            return set()
        return set(self.dir.glob("*attention_step*thunk_sequence_after_thunk_passes*"))

    def new(self):
        files = self._files()
        fresh, self.seen = sorted(files - self.seen), files
        return fresh[-1] if fresh else None


# ---------------------------------------------------------------------------- one layer, one placement
def parse_mesh(text: str) -> tuple[int, int]:
    try:
        data, model = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--meshes: expected DATAxMODEL (e.g. 2x1), got {text!r}") from None
    return data, model


class Placement:
    """One layer placed on one device (``mesh=None``) or sharded over a mesh: its compiled
    steps, weights and caches."""

    def __init__(self, attn, mesh):
        self.attn, self.mesh = attn, mesh
        if mesh is not None:
            sharding.shard_layer(attn, mesh)
        self.weights = attn.step_weights()  # what the module call hands the step
        self.spec = attn.step_spec()
        self.spec_intermediates = attn.step_spec(return_intermediates=True)
        self.step = step_function(donate=True, sharded=mesh is not None, overlap=self.spec.plan.overlap)
        self.step_keep = step_function(donate=False, sharded=mesh is not None, overlap=self.spec.plan.overlap)

    def place(self, cache):
        if self.mesh is None:
            dev = jax.devices()[0]
            return jax.device_put(cache, dev)
        return sharding.shard_cache(cache, self.mesh)

    def inputs(self, x, pos):
        if self.mesh is None:
            return jax.device_put((x, pos), jax.devices()[0])
        lay = sharding.layout(self.attn.config, self.mesh)
        s = lay.sharding(lay.spec("batch"))
        return jax.device_put(x, s), jax.device_put(pos, s)


def _unplaced_layer(attn):
    """Every parameter back on one device (the layer is re-sharded per mesh in place)."""
    from flax import nnx

    dev = jax.devices()[0]
    for _, var in nnx.to_flat_state(nnx.state(attn, nnx.Param)):
        var.set_value(jax.device_put(var.get_value(), dev))
    attn.mesh = None
    return attn


def _synthetic_cache(attn, batch: int, max_seq_len: int, context: int, seed: int):
    """A cache as after `context` tokens, every leaf random (bench/stack.py's), on device 0."""
    key = jax.random.PRNGKey(seed)
    cache = attn.init_cache(batch, max_seq_len).replace(layer_idx=-1)
    if context == 0:
        return cache.replace(length=jnp.zeros((batch,), jnp.int32))
    leaves, tree = jax.tree.flatten(cache.replace(length=None))
    keys = jax.random.split(key, len(leaves))
    leaves = [jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype) for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(tree, leaves).replace(length=jnp.full((batch,), context, jnp.int32))


def _to_host(tree):
    return jax.tree.map(lambda a: np.asarray(jax.device_get(a)).astype(np.float32)
                        if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else np.asarray(jax.device_get(a)), tree)


def run_case(p: Placement, case: dict, cfg, dtype, seed: int, steps: int, repeats: int, dump: Dump,
             label: str) -> tuple[dict, dict]:
    """Time one case on one placement; returns (record fields, host copies for the equality check)."""
    batch, context, new = case["batch"], case["context"], case["new_tokens"]
    decode = new == 1
    total = (2 + repeats * steps) if decode else 1
    max_seq_len = stack_mod._round_up(context + max(total, new) + 1)
    x = stack_mod._hidden(cfg, batch, new, dtype, seed)
    pos0 = stack_mod._positions(batch, context, new)

    def fresh():
        return p.place(_synthetic_cache(p.attn, batch, max_seq_len, context, seed))

    # Equality inputs: the first step, with intermediates, on a cache that is kept.
    xs, ps = p.inputs(x, pos0)
    out, new_cache, inter = p.step_keep(p.weights, fresh(), xs, ps, spec=p.spec_intermediates)
    host = {"out": _to_host(out), "cache": _to_host(new_cache.replace(layer_idx=None)),
            "topk": None if inter.topk is None else np.asarray(jax.device_get(inter.topk))}
    del out, new_cache, inter

    print(f"{MARK} begin {label}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    compiled = p.step.lower(p.weights, fresh(), xs, ps, spec=p.spec).compile()
    compile_s = time.perf_counter() - t0
    print(f"{MARK} end {label}", file=sys.stderr, flush=True)
    hlo = compiled.as_text()
    thunk_file = dump.new()
    fields = {"compile_s": compile_s, "collectives": collectives(hlo)}
    if thunk_file is not None:
        fields["thunks"] = {"file": thunk_file.name, **thunk_summary(thunk_file.read_text(errors="replace"))}

    times = []
    if decode:
        cache = fresh()
        positions = [p.inputs(x, stack_mod._positions(batch, context + i, 1))[1] for i in range(total)]
        jax.block_until_ready((cache, positions))
        i = 0
        for _ in range(2):  # warm-up (NCCL communicators, autotuning caches)
            h, cache, _ = compiled(p.weights, cache, xs, positions[i])
            i += 1
        jax.block_until_ready((h, cache))
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(steps):
                h, cache, _ = compiled(p.weights, cache, xs, positions[i])
                i += 1
            jax.block_until_ready((h, cache))
            times.append((time.perf_counter() - t0) / steps)
    else:
        h, _, _ = compiled(p.weights, fresh(), xs, ps)  # warm-up
        jax.block_until_ready(h)
        for _ in range(repeats):
            cache = jax.block_until_ready(fresh())
            t0 = time.perf_counter()
            h, cache, _ = compiled(p.weights, cache, xs, ps)
            jax.block_until_ready((h, cache))
            times.append(time.perf_counter() - t0)
            del cache
    fields.update({"step_ms": 1e3 * float(np.median(times)), "step_ms_p90": 1e3 * float(np.percentile(times, 90)),
                   "step_ms_repeats": [1e3 * t for t in times], "steps": steps if decode else 1,
                   "repeats": repeats, "max_seq_len": max_seq_len,
                   "output_finite": bool(jnp.all(jnp.isfinite(h.astype(jnp.float32))))})
    return fields, host


def compare(ref: dict, got: dict, tol: float) -> dict:
    """Equality of one placement's first step with the one-device step."""
    diff = float(np.max(np.abs(ref["out"] - got["out"])))
    out_max = float(np.max(np.abs(ref["out"])))
    cache_diff = max(float(np.max(np.abs(a - b))) if a.size else 0.0
                     for a, b in zip(jax.tree.leaves(ref["cache"]), jax.tree.leaves(got["cache"])))
    res = {"max_abs_diff": diff, "out_max": out_max, "cache_max_abs_diff": cache_diff,
           "tolerance": tol, "within_tolerance": bool(diff <= tol * out_max)}
    if ref["topk"] is not None:
        same = np.all(ref["topk"] == got["topk"], axis=-1)
        res["picks_identical"] = float(np.mean(same))
        res["picks_set_identical"] = float(np.mean(np.all(np.sort(ref["topk"], -1) == np.sort(got["topk"], -1), -1)))
    return res


# ---------------------------------------------------------------------------- the run
def cases_of(args) -> list[dict]:
    out = [{"scenario": "sharded_decode", "batch": b, "context": args.context, "new_tokens": 1}
           for b in args.batches]
    out += [{"scenario": "sharded_prefill", "batch": args.prefill_batch, "context": 0, "new_tokens": n}
            for n in args.prefills]
    return out


def environment() -> dict:
    env = stack_mod.environment()
    env["devices"] = [str(d) for d in jax.devices()]
    env["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    return env


def run(args, write=None) -> tuple[list, dict]:
    cfg = plan_mod.config_for(args.size)
    dtype = jnp.dtype(args.dtype)
    tol = args.tolerance if args.tolerance is not None else (1e-2 if dtype == jnp.bfloat16 else 1e-5)
    meshes = [parse_mesh(m) for m in args.meshes]
    need = max(d * m for d, m in meshes)
    if len(jax.devices()) < need:
        raise SystemExit(f"--meshes needs {need} devices, this backend has {len(jax.devices())}")
    meta = {"environment": environment(), "args": vars(args), "started": _dt.datetime.now(_dt.UTC).isoformat()}
    dump = Dump(args.xla_dump)
    records = []
    for layer, mode in args.runs:
        platform = jax.devices()[0].platform
        if mode in plan_mod.NATIVE_MODES and not native.available(platform):
            records.append({"scenario": "sharded", "layer_type": layer.upper(), "mode": mode,
                            "skipped": f"native handlers not usable: {native.unavailable_reason(platform)}"})
            continue
        idx = plan_mod.layer_index(cfg, layer)
        attn = measure.build_layer(cfg, idx, dtype, args.seed + idx)
        plan_mod.apply_mode(attn, mode)
        for case in cases_of(args):
            base = {"scenario": case["scenario"], "size": args.size, "dtype": str(dtype),
                    "layer_type": {CSA: "CSA", HCA: "HCA"}[attn.layer_type], "mode": mode,
                    "break_on": plan_mod.MODE_SETTINGS[mode]["break_on"] if mode.startswith("narrow") else None,
                    "batch": case["batch"], "context_len": case["context"], "new_tokens": case["new_tokens"]}
            one = None
            for mesh_shape in [None, *meshes]:
                name = "1" if mesh_shape is None else f"{mesh_shape[0]}x{mesh_shape[1]}"
                rec = {**base, "mesh": name, "devices": 1 if mesh_shape is None else mesh_shape[0] * mesh_shape[1]}
                label = f"{layer}/{mode}/{case['scenario']}/b{case['batch']}/{name}"
                try:
                    if mesh_shape is not None and case["batch"] % mesh_shape[0]:
                        raise ValueError(f"batch {case['batch']} does not split over data={mesh_shape[0]}")
                    mesh = None if mesh_shape is None else sharding.make_mesh(*mesh_shape,
                                                                             devices=jax.devices()[:rec["devices"]])
                    p = Placement(_unplaced_layer(attn), mesh)
                    fields, host = run_case(p, case, cfg, dtype, args.seed, args.steps, args.repeats, dump, label)
                    rec.update(fields)
                    if mesh_shape is None:
                        one = (rec["step_ms"], host)
                    elif one is not None:
                        rec["one_device_step_ms"] = one[0]
                        rec["speedup"] = one[0] / rec["step_ms"]
                        rec["scaling_efficiency"] = rec["speedup"] / rec["devices"]
                        rec.update(compare(one[1], host, tol))
                except Exception as e:  # a record says why a case did not run; the rest runs
                    rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                records.append(rec)
                print(_line(rec), flush=True)
                if write is not None:
                    write(records, meta)
        _unplaced_layer(attn)
    if args.vlog and Path(args.vlog).is_file():
        kinds = graph_kinds(Path(args.vlog).read_text(errors="replace"))
        for rec in records:
            label = f"{rec['layer_type'].lower()}/{rec['mode']}/{rec['scenario']}/b{rec.get('batch')}/{rec.get('mesh')}"
            if label in kinds:
                rec["graph_thunk_kinds"] = kinds[label]
    meta["finished"] = _dt.datetime.now(_dt.UTC).isoformat()
    return records, meta


# ---------------------------------------------------------------------------- reporting
def _coll(rec: dict) -> str:
    c = rec.get("collectives") or {}
    return ", ".join(f"{op} x{v['count']}" for op, v in c.items()) or "none"


def _line(rec: dict) -> str:
    if "error" in rec or "skipped" in rec:
        return (f"{rec['layer_type']} {rec['mode']} {rec.get('scenario')} B={rec.get('batch')} "
                f"mesh={rec.get('mesh')}: {rec.get('error') or rec.get('skipped')}")
    eq = ""
    if "max_abs_diff" in rec:
        eq = f" diff={rec['max_abs_diff']:.2e}/{rec['out_max']:.2f} picks={rec.get('picks_identical', '-')}" \
             f"/{rec.get('picks_set_identical', '-')}" \
             f" speedup={rec['speedup']:.2f}"
    return (f"{rec['layer_type']} {rec['mode']:13s} {rec['scenario']:15s} B={rec['batch']:<3d} mesh={rec['mesh']:4s} "
            f"{rec['step_ms']:.3f} ms (compile {rec['compile_s']:.1f} s){eq} collectives: {_coll(rec)}")


def _fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def markdown(records: list, meta: dict) -> str:
    env = meta.get("environment", {})
    lines = [f"Devices: {', '.join(env.get('devices', []))}; jax {env.get('jax_version')}; "
             f"{meta.get('started', '')[:16]} UTC",
             "",
             "| layer | mode | case | mesh | step ms | vs 1 device | efficiency | max abs diff / out max "
             "| picks identical (order / sets) | collectives (HLO) | top-level thunks |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        case = (f"decode B={r.get('batch')} @ {r.get('context_len')}" if r.get("scenario") == "sharded_decode"
                else f"prefill {r.get('new_tokens')} B={r.get('batch')}")
        if "error" in r or "skipped" in r:
            lines.append(f"| {r['layer_type']} | {r['mode']} | {case} | {r.get('mesh', '-')} | "
                         f"{(r.get('error') or r.get('skipped'))[:80]} | | | | | | |")
            continue
        th = r.get("thunks")
        thunks = "-"
        if th:
            outside = ", ".join(th["collective_kinds_outside"]) or "none"
            inside = ", ".join(th.get("collective_kinds_inside", [])) or "none"
            thunks = (f"{th['command_buffers']} graphs, {len(th['top_level']) - th['command_buffers']} other; "
                      f"collectives outside: {outside}, inside: {inside}")
        eq = "-" if "max_abs_diff" not in r else f"{r['max_abs_diff']:.2e} / {r['out_max']:.2f}"
        lines.append(f"| {r['layer_type']} | {r['mode']} | {case} | {r['mesh']} | {r['step_ms']:.3f} | "
                     f"{_fmt(r.get('speedup'), '.2f')}x | {_fmt(r.get('scaling_efficiency'), '.2f')} | {eq} | "
                     f"{_fmt(r.get('picks_identical'), '.3f')} / {_fmt(r.get('picks_set_identical'), '.3f')} | "
                     f"{_coll(r)} | {thunks} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="flash", choices=("tiny", "small", "flash"))
    ap.add_argument("--dtype", default=None, help="default: bfloat16 for flash, float32 otherwise")
    ap.add_argument("--meshes", default="2x1,1x2", type=lambda s: s.split(","), help="DATAxMODEL,...")
    ap.add_argument("--runs", default=",".join(f"{a}:{b}" for a, b in RUNS),
                    type=lambda s: [tuple(x.split(":")) for x in s.split(",")], help="layer:mode,...")
    ap.add_argument("--batches", default=None, type=lambda s: [int(v) for v in s.split(",")],
                    help="decode batch sizes (default 8,32; --quick: 2,4)")
    ap.add_argument("--context", default=None, type=int, help="decode context (default 16384; --quick: 64)")
    ap.add_argument("--prefills", default=None, type=lambda s: [int(v) for v in s.split(",") if v],
                    help="prefill lengths (default 4096; --quick: 32; empty: none)")
    ap.add_argument("--prefill-batch", default=2, type=int, help="a multiple of the data axes")
    ap.add_argument("--steps", default=None, type=int, help="decode steps per repeat (default 10; --quick: 2)")
    ap.add_argument("--repeats", default=None, type=int, help="default 5; --quick: 2")
    ap.add_argument("--tolerance", default=None, type=float)
    ap.add_argument("--seed", default=0, type=int)
    ap.add_argument("--quick", action="store_true", help="small shapes (CPU smoke)")
    ap.add_argument("--xla-dump", default=None, help="dump dir for the step's thunk sequence (GPU)")
    ap.add_argument("--vlog", default=None, help="stderr log of this run with the command-buffer pass's VLOG")
    ap.add_argument("--json", default=None)
    ap.add_argument("--render", default=None, help="print the tables of a past run's JSON")
    ap.add_argument("--rethunk", default=None, metavar="DIR",
                    help="re-read each record's `thunks` from the thunk dumps in DIR (the files the records "
                         "name) and rewrite --json in place: a past run's records after a fix of this reader")
    return ap


def rethunk(path: str, where: str) -> int:
    """``--json PATH --rethunk DIR``: recompute ``thunks`` of a past run's records from its dumps."""
    data = json.loads(Path(path).read_text())
    for rec in data["records"]:
        name = (rec.get("thunks") or {}).get("file")
        if name and (Path(where) / name).is_file():
            rec["thunks"] = {**thunk_summary((Path(where) / name).read_text()), "file": name}
    data["meta"]["rethunk"] = {"reader": "bench/sharded.py thunk_summary",
                               "date_utc": _dt.datetime.now(_dt.UTC).isoformat()}
    Path(path).write_text(json.dumps(data, indent=1, default=str))
    print(markdown(data["records"], data["meta"]))
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.render:
        return report.render(args.render, markdown)
    if args.rethunk:
        if not args.json:
            raise SystemExit("--rethunk needs --json (the past run's records, rewritten in place)")
        return rethunk(args.json, args.rethunk)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.size == "flash" else "float32"
    defaults = (dict(batches=[2, 4], context=64, prefills=[32], steps=2, repeats=2) if args.quick else
                dict(batches=[8, 32], context=16384, prefills=[4096], steps=10, repeats=5))
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for layer, mode in args.runs:
        if layer not in plan_mod.LAYER_NAMES or mode not in plan_mod.MODE_SETTINGS:
            raise SystemExit(f"--runs: unknown layer:mode {layer}:{mode}")

    def write(records, meta):
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"records": records, "meta": meta}, indent=1, default=str))

    records, meta = run(args, write)
    write(records, meta)
    print(markdown(records, meta))
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
