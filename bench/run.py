"""Benchmark of dsv4_jax attention: break modes none / narrow / wide, and the HF transformers peer.

    python bench/run.py --quick --json out.json     # < 2 min on a 2-core CPU (small size)
    python bench/run.py --torch-threads 1 --json bench/results/cpu_small.json   # the full CPU run (~6 min)
    python3 bench/run.py --size flash --json $OUT/gpu_flash.json               # on the H200 (~9 min)
    python bench/run.py --render bench/results/gpu_flash.json                  # tables of a past run

Scenarios, protocol and caps: `bench/plan.py` and `bench/measure.py`; results and how to read
them: `bench/RESULTS.md`. One JSON record per (case, implementation); a Markdown table goes to
stdout and a plot (PNG) next to the JSON.

The HF peer needs torch and transformers 5.23.0 (the ``[bench]`` extra), the JAX peer (MaxText's
DeepSeek-V4 attention, ``maxtext-jax``) maxtext 0.2.5 (the ``[peers]`` extra, Python >= 3.12); a peer
that does not import is recorded as unavailable (with the reason, in ``meta``) and the run goes on.
``--peers`` picks them (default both).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform as _platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# On a GPU our layer and the torch peer share the card: cap JAX's preallocation (recorded).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.35")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dsv4_jax.layer.validation  # noqa: E402
import dsv4_jax.step.overlap  # noqa: E402
import dsv4_jax.step.plan  # noqa: E402
from bench import floor as floor_mod  # noqa: E402
from bench import measure, report  # noqa: E402
from bench import peer as peer_mod  # noqa: E402
from bench import plan as plan_mod  # noqa: E402
from bench.plan import MODES, PEER, SHORT  # noqa: E402

REQUIRED_FIELDS = (
    "scenario", "size", "layer_type", "mode", "batch", "prompt_len", "steps", "ttft_ms", "decode_ms_median",
    "decode_ms_p90", "prefill_ms", "compile_s", "max_abs_diff_vs_none", "device", "jax_version",
)


# ---------------------------------------------------------------------------- progress
class Progress:
    """tqdm if installed, else one line per unit on stderr."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.n, self.enabled = total, 0, enabled
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="run", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None
        self.t0 = time.perf_counter()

    def step(self, what: str):
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(what[:60])
            self.bar.update(1)
        else:
            el = time.perf_counter() - self.t0
            print(f"[{self.n}/{self.total} {el:6.0f}s] {what}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------- environment
def _run(cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        return ""


def _src_hash() -> str:
    """sha1 of the package sources as run (the tree may hold uncommitted edits)."""
    import hashlib

    h = hashlib.sha1()
    for f in sorted((ROOT / "dsv4_jax").rglob("*.py")):
        h.update(str(f.relative_to(ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def environment(platform: str) -> dict:
    import flax

    dev = jax.devices()[0]
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    env = {
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "platform": platform,
        "device": f"{dev.device_kind} ({dev.platform})" if platform == "gpu" else f"CPU {cpu_model}",
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "python": _platform.python_version(),
        "jax_version": jax.__version__,
        "jaxlib_version": getattr(__import__("jaxlib"), "__version__", None),
        "flax_version": flax.__version__,
        "numpy_version": np.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "xla_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "git_commit": _run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
        "git_dirty": bool(_run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "dsv4_jax"])),
        "hostname": _platform.node(),
        "dsv4_jax_src_sha1": _src_hash(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if platform == "gpu":
        env["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                  "--format=csv,noheader"])
    return env


def measure_ceilings() -> dict:
    """The GPU's copy bandwidth and bf16 matrix rate, measured with JAX (medians of 10 after 3 warm-ups)."""
    out = {}
    n = 1 << 30  # 4 GiB of float32: read + write = 8 GiB per copy
    a = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    scale = jax.jit(lambda v: v * 1.0001)
    ts = []
    for i in range(13):
        t0 = time.perf_counter()
        jax.block_until_ready(scale(a))
        if i >= 3:
            ts.append(time.perf_counter() - t0)
    out["copy_bytes_per_s"] = 2 * 4 * n / float(np.median(ts))
    del a
    k = 8192
    x = jax.random.normal(jax.random.key(1), (k, k), jnp.bfloat16)
    y = jax.random.normal(jax.random.key(2), (k, k), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    ts = []
    for i in range(13):
        t0 = time.perf_counter()
        jax.block_until_ready(mm(x, y))
        if i >= 3:
            ts.append(time.perf_counter() - t0)
    out["bf16_matmul_flops_per_s"] = 2 * k**3 / float(np.median(ts))
    return out


# ---------------------------------------------------------------------------- records
def _ms(xs):
    return None if not xs else 1e3 * float(np.median(xs))


def _p90(xs):
    return None if not xs else 1e3 * float(np.percentile(xs, 90))


def _entries(cfg, case) -> tuple[int, int | None]:
    ratio = cfg.csa_compress_rate if case.layer == "csa" else cfg.hca_compress_rate
    last = case.prompt_len + (case.steps if case.scenario != "prefill" else 0)
    if case.scenario == "decode_long":
        last = case.prompt_len + case.steps // 2
    return last // ratio, (cfg.index_topk if case.layer == "csa" else None)


def base_record(args, env, cfg, case, mode, dtype_name) -> dict:
    entries, top_k = _entries(cfg, case)
    layer_type = plan_mod.LAYER_NAMES[case.layer]
    settings = plan_mod.MODE_SETTINGS.get(mode)
    plan = None
    if settings is not None:
        try:  # what actually ran: the resolved break plan of this layer type on this platform
            plan = dsv4_jax.step.plan.plan_step(layer_type, settings["break_mode"], settings["break_on"],
                                                settings["kernels"], env["platform"])
        except ValueError:
            plan = None
    return {
        "scenario": case.scenario, "size": args.size, "layer_type": SHORT[layer_type],
        "break_mode": plan.mode if plan else None, "break_on": plan.place if plan else None,
        "native_select": plan.native_select if plan else None,
        "overlap": args.overlap if mode != PEER else None,
        "layer_idx": plan_mod.layer_index(cfg, case.layer), "mode": mode, "batch": case.batch,
        "prompt_len": case.prompt_len, "context_len": case.prompt_len if case.scenario == "decode_long" else None,
        "steps": case.steps_for(mode) if mode != PEER else case.steps,
        "repeats": case.repeats_for(mode) if mode != PEER else case.repeats,
        "max_seq_len": case.max_seq_len,
        "entry_slots": cfg.entry_slots(layer_type, case.max_seq_len),
        "entries": entries, "top_k": top_k,
        "ttft_ms": None, "decode_ms_median": None, "decode_ms_p90": None, "prefill_ms": None, "compile_s": None,
        "max_abs_diff_vs_none": None, "picks_equal_vs_none": None, "host_breaks": None,
        "dtype": dtype_name, "device": env["device"], "platform": env["platform"], "jax_version": env["jax_version"],
        "xla_flags": env["xla_flags"], "seed": args.seed, "date_utc": env["date_utc"],
        "skipped": None, "error": None,
    }


def fill_timings(rec, res, case):
    rec["compile_s"] = res.get("compile_s")
    rec["warmup_s"] = res.get("warmup_s")
    rec["host_breaks"] = res.get("host_breaks")
    rec["steps"], rec["repeats"] = res["steps"], res["repeats"]
    if case.scenario == "prefill":
        rec["prefill_ms"] = _ms(res["ttft"])
        rec["prefill_ms_min"] = None if not res["ttft"] else 1e3 * min(res["ttft"])
        rec["ttft_ms"] = rec["prefill_ms"]
        rec["steps"] = 0
    else:
        rec["ttft_ms"] = _ms(res["ttft"])
        rec["decode_ms_median"] = _ms(res["decode"])
        rec["decode_ms_p90"] = _p90(res["decode"])
        rec["decode_ms_min"] = None if not res["decode"] else 1e3 * min(res["decode"])
        rec["decode_samples"] = len(res["decode"])
        if res.get("raw_decode"):
            rec["raw_step_ms_median"] = _ms(res["raw_decode"])
            rec["raw_step_ms_p90"] = _p90(res["raw_decode"])
    if res.get("peak_gb") is not None:
        rec["peak_gb"] = res["peak_gb"]


def add_floor(rec, cfg, case, weight_bytes, itemsize, platform):
    if platform != "gpu":
        return
    if case.scenario == "prefill":
        f = floor_mod.floor(cfg, case.layer, case.batch, 0, case.prompt_len, weight_bytes, itemsize)
        metric = rec["prefill_ms"]
    else:
        start = case.prompt_len + case.steps // 2
        f = floor_mod.floor(cfg, case.layer, case.batch, start, 1, weight_bytes, itemsize)
        metric = rec["decode_ms_median"]
        if case.scenario == "decode_pr":
            rec["ttft_floor_ms"] = floor_mod.floor(cfg, case.layer, case.batch, 0, case.prompt_len, weight_bytes,
                                                   itemsize)["floor_ms"]
    rec.update(f)
    rec["ratio_to_floor"] = None if metric is None else metric / f["floor_ms"]


# ---------------------------------------------------------------------------- main loop
def run(args, partial=None) -> tuple[list, dict]:
    platform = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"
    cfg = plan_mod.config_for(args.size)
    dtype = jnp.dtype(args.dtype or ("bfloat16" if platform == "gpu" else "float32"))
    modes = tuple(m for m in args.modes.split(",") if m)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: expected a subset of {MODES}, got {bad}")
    wanted = () if args.no_peer else tuple(p for p in args.peers.split(",") if p)
    unknown = [p for p in wanted if p not in peer_mod.NAMES]
    if unknown:
        raise SystemExit(f"--peers: expected a subset of {peer_mod.NAMES}, got {unknown}")
    peer_reason = peer_mod.available() if PEER in wanted else ("--no-peer" if args.no_peer else "not in --peers")
    use_peer = PEER in wanted and peer_reason is None
    mt_name = peer_mod.MAXTEXT
    mt_reason = (peer_mod.maxtext().available() if mt_name in wanted
                 else ("--no-peer" if args.no_peer else "not in --peers"))
    use_mt = mt_name in wanted and mt_reason is None
    cases = plan_mod.build_plan(
        args.size, args.quick, platform, layers=tuple(args.layers.split(",")), modes=modes, peer=use_peer,
        batches=[int(b) for b in args.batches.split(",")] if args.batches else None,
        scenarios=args.scenarios.split(",") if args.scenarios else None,
        dtype_bytes=dtype.itemsize, hf_mem_gb=args.hf_mem_gb,
    )
    out_dir = Path(args.json).resolve().parent if args.json else None
    # The layer's default rejects non-finite inputs before dispatch (a device sync for jax.Array
    # inputs); recorded, and switchable, because it is part of the module call being timed.
    dsv4_jax.layer.validation.CHECK_FINITE = {"true": True, "host": "host", "false": False}[args.check_finite]
    meta = {"size": args.size, "quick": args.quick, "dtype": dtype.name, "argv": sys.argv[1:],
            "overlap": args.overlap,
            "check_finite": dsv4_jax.layer.validation.CHECK_FINITE,
            "config": {k: v for k, v in cfg.__dict__.items() if k != "layer_types"},
            "peer_unavailable": None if use_peer else (peer_reason or "--no-peer"),
            "maxtext_unavailable": None if use_mt else mt_reason}

    # Command buffers first: the child process must find the GPU's memory free.
    if platform == "gpu" and args.cmdbuf:
        from bench import cmdbuf

        ctx = 16384 if not args.quick else 4096
        t0 = time.perf_counter()
        meta["cmdbuf"] = cmdbuf.probe(args.size, tuple(args.layers.split(",")), modes, batch=1, context=ctx,
                                      out_dir=out_dir)
        meta["cmdbuf_s"] = time.perf_counter() - t0

    env = environment(platform)
    meta.update(env)
    if use_peer:
        if args.torch_threads:
            import torch

            torch.set_num_threads(args.torch_threads)
        meta["peer_versions"] = peer_mod.versions()
        meta["peer_topk"] = "stock torch.topk (the layer alone is timed; rotary + mask built outside the timer)"
    if use_mt:
        meta["maxtext_versions"] = peer_mod.maxtext().versions()
        meta["maxtext_attention"] = "dot_product (dense [B, H, S, S+C] logits and masks; see bench/peer_maxtext.py)"
    if platform == "gpu" and args.ceilings:
        meta["ceilings"] = measure_ceilings()

    total = sum(len(c.modes) + (1 if c.peer else 0) + (1 if use_mt else 0) for c in cases)
    prog = Progress(total, enabled=not args.no_progress)
    records = []
    torch_device = "cuda" if platform == "gpu" else "cpu"
    runs, peers, mts = {}, {}, {}

    def layer_objects(layer):
        if layer not in runs:
            runs[layer] = measure.JaxRun(cfg, layer, dtype, seed=args.seed, prefix_chunk=plan_mod.JAX_PREFIX_CHUNK)
            runs[layer].attn.overlap = args.overlap  # kept by every mode (`plan.apply_mode` leaves it)
            if use_mt:
                mts[layer] = peer_mod.maxtext().MaxTextPeer(cfg, args.size, layer, runs[layer].attn, dtype.name,
                                                            platform, args.maxtext_mem_gb)
                if platform == "gpu" and args.maxtext_flash_probe:
                    meta.setdefault("maxtext_flash_probe", {})[layer] = peer_mod.maxtext().probe_flash(
                        cfg, args.size, layer, runs[layer].attn, dtype.name)
            peers[layer] = None
            if use_peer and any(c.peer and PEER not in c.skip for c in cases if c.layer == layer):
                from dsv4_jax.io.hf_weights import export_hf_attention_weights

                peers[layer] = peer_mod.Peer(cfg, runs[layer].layer_idx, export_hf_attention_weights(runs[layer].attn),
                                             dtype.name, torch_device)
        return runs[layer], peers[layer]

    for case in cases:
        jr, peer = layer_objects(case.layer)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        inputs = measure.make_inputs(cfg, case, args.seed, plan_mod.JAX_PREFIX_CHUNK)
        dev_inputs = jr.device_inputs(inputs)
        t0 = time.perf_counter()
        snap = jr.snapshot(case, inputs, dev_inputs)
        setup_s = time.perf_counter() - t0
        results, case_records = {}, {}
        for mode in case.modes:
            rec = base_record(args, env, cfg, case, mode, dtype.name)
            rec["setup_s"], rec["loadavg_1m"] = setup_s, load
            if mode in case.skip:
                rec["skipped"] = case.skip[mode]
            else:
                try:
                    res = jr.run_mode(case, mode, dev_inputs, snap)
                    fill_timings(rec, res, case)
                    results[mode] = res
                except Exception as err:
                    rec["error"] = report.error_text(err)
            add_floor(rec, cfg, case, jr.weight_bytes, dtype.itemsize, platform)
            case_records[mode] = rec
            prog.step(f"{case.key} {mode}")
        # Picks agreement (separate, untimed pass).
        if case.picks_check and case.layer == "csa" and "none" in results:
            try:
                ref = jr.picks(case, "none", dev_inputs, snap)
                for mode in results:
                    if mode != "none":
                        p = jr.picks(case, mode, dev_inputs, snap)
                        case_records[mode]["picks_equal_vs_none"] = float(np.mean(p == ref))
                        case_records[mode]["picks_set_overlap_vs_none"] = measure.picks_overlap(p, ref)
                case_records["none"]["picks_equal_vs_none"] = 1.0
                case_records["none"]["picks_valid_frac"] = float(np.mean(ref >= 0))
            except Exception as err:
                case_records["none"]["error"] = f"picks pass: {type(err).__name__}: {str(err)[:200]}"
        # The peer.
        if case.peer:
            rec = base_record(args, env, cfg, case, PEER, dtype.name)
            rec["loadavg_1m"] = load
            if PEER in case.skip:
                rec["skipped"] = case.skip[PEER]
            elif peer is None:
                rec["skipped"] = "peer unavailable"
            else:
                try:
                    res = measure.run_peer(peer, case, inputs)
                    fill_timings(rec, res, case)
                    results[PEER] = res
                except Exception as err:
                    rec["error"] = report.error_text(err)
                    peer.reset()
                    if torch_device == "cuda":
                        peer.torch.cuda.empty_cache()
            rec.update({"peer_" + k: v for k, v in (meta.get("peer_versions") or {}).items()})
            add_floor(rec, cfg, case, jr.weight_bytes, dtype.itemsize, platform)
            case_records[PEER] = rec
            prog.step(f"{case.key} {PEER}")
        # The JAX peer (MaxText), same inputs; where it cannot run, the record says why.
        if use_mt:
            rec = base_record(args, env, cfg, case, mt_name, dtype.name)
            rec["loadavg_1m"] = load
            want_picks = case.picks_check and case.layer == "csa" and case.scenario == "prefill"
            try:
                res = mts[case.layer].run_case(case, inputs, want_picks=want_picks)
                for k in ("setup_s", "peak_source", "memory_by_step_gb", "skipped"):
                    rec[k] = res.get(k)
                if rec["skipped"]:
                    rec["compile_s"], rec["peak_gb"] = res.get("compile_s"), res.get("peak_gb")
                else:
                    fill_timings(rec, res, case)
                    results[mt_name] = res
                    if "picks" in res and "none" in results:
                        ours_picks = jr.picks(case, "none", dev_inputs, snap)
                        rec["picks_set_overlap_vs_none"] = measure.picks_overlap(res["picks"], ours_picks)
            except Exception as err:
                rec["error"] = report.error_text(err)
            rec.update({"maxtext_" + k: v for k, v in (meta.get("maxtext_versions") or {}).items()})
            add_floor(rec, cfg, case, jr.weight_bytes, dtype.itemsize, platform)
            case_records[mt_name] = rec
            prog.step(f"{case.key} {mt_name}")
        # Agreement with mode none (outputs of the timed sequences), and ours / HF.
        ref = results.get("none", {}).get("outs")
        for mode, rec in case_records.items():
            res = results.get(mode)
            if res is not None and ref:
                rec["max_abs_diff_vs_none"] = measure.max_abs_diff(res["outs"], ref)
                rec["out_scale"] = measure.ref_scale(ref)
        metric = "prefill_ms" if case.scenario == "prefill" else "decode_ms_median"
        hf = case_records.get(PEER, {}).get(metric)
        mt = case_records.get(mt_name, {}).get(metric)
        for mode, rec in case_records.items():
            if mode not in (PEER, mt_name) and hf and rec.get(metric):
                rec["ours_over_hf"] = rec[metric] / hf
            if mode not in (PEER, mt_name) and mt and rec.get(metric):
                rec["ours_over_maxtext"] = rec[metric] / mt
        if mt_name in results and results.get(PEER, {}).get("outs"):
            case_records[mt_name]["max_abs_diff_vs_hf"] = measure.max_abs_diff(results[mt_name]["outs"],
                                                                               results[PEER]["outs"])
        records.extend(case_records.values())
        del snap, dev_inputs, results
        if partial is not None:  # survive a cut-off run: the records so far are on disk
            partial(records, meta)
    for p in peers.values():
        if p is not None:
            p.free()
    prog.close()
    return records, meta


def check_records(records) -> list[str]:
    """Problems with the records: missing fields, or modes that disagree with mode none."""
    problems = []
    for r in records:
        missing = [f for f in REQUIRED_FIELDS if f not in r]
        if missing:
            problems.append(f"{r.get('scenario')}/{r.get('mode')}: missing {missing}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run (< 2 min on a 2-core CPU)")
    ap.add_argument("--size", default="small", choices=("tiny", "small", "flash"))
    ap.add_argument("--json", default=None, help="write the records here (and the plot next to it)")
    ap.add_argument("--plot", default=None, help="PNG path (default: the JSON path with .png)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--layers", default="csa,hca")
    ap.add_argument("--batches", default=None, help="comma list, overrides the plan's batch sizes")
    ap.add_argument("--scenarios", default=None,
                    help="comma list of decode_pr,decode_long,prefill; or of stack_decode,stack_prefill "
                         "(N layers in one jax.jit: handed to bench/stack.py with the other arguments)")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-finite", choices=("true", "host", "false"), default="true",
                    help="the layer's non-finite input check (default: true, the layer's default)")
    ap.add_argument("--overlap", default="auto",
                    help="the layers' overlap, one of dsv4_jax.step.overlap.OVERLAP_CHOICES (recorded as `overlap`; "
                         "the A/B: a run each); the stack scenarios take a list (bench/stack.py)")
    ap.add_argument("--no-peer", action="store_true", help="skip every peer")
    ap.add_argument("--peers", default="hf-torch,maxtext-jax",
                    help="comma list of peers: hf-torch (transformers, PyTorch), maxtext-jax (MaxText 0.2.5)")
    ap.add_argument("--maxtext-mem-gb", type=float, default=None,
                    help="memory MaxText's compiled step may use (default: 8 on CPU, JAX's free pool on GPU)")
    ap.add_argument("--maxtext-flash-probe", action=argparse.BooleanOptionalAction, default=True,
                    help="GPU: record whether MaxText's attention='flash' runs a prefill (it refuses sinks)")
    ap.add_argument("--hf-mem-gb", type=float, default=None, help="cap of HF's estimated peak memory")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads for the peer (default: torch's own choice)")
    ap.add_argument("--cmdbuf", action=argparse.BooleanOptionalAction, default=True,
                    help="GPU: count XLA command buffers per mode from XLA's log (child process)")
    ap.add_argument("--ceilings", action=argparse.BooleanOptionalAction, default=True,
                    help="GPU: measure copy bandwidth and bf16 matmul rate")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="print the tables of an earlier run's JSON (no measurement)")
    args, _ = ap.parse_known_args(argv)
    if args.scenarios and all(sc.startswith("stack_") for sc in args.scenarios.split(",")):
        from bench import stack  # the stack scenarios: bench/stack.py takes the whole command line

        return stack.main(sys.argv[1:] if argv is None else list(argv))
    args = ap.parse_args(argv)
    try:
        dsv4_jax.step.overlap.check_overlap(args.overlap)
    except ValueError as err:
        ap.error(str(err))

    if args.render:
        return report.render(args.render)

    t0 = time.perf_counter()

    def write(records, meta):
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            meta["wall_s"] = time.perf_counter() - t0
            path.write_text(json.dumps({"meta": meta, "records": records}, indent=1, default=str))

    records, meta = run(args, partial=write)
    meta["wall_s"] = time.perf_counter() - t0
    md = report.markdown(records, meta)
    print(md)
    if args.json:
        write(records, meta)
        path = Path(args.json)
        plot_path = Path(args.plot) if args.plot else path.with_suffix(".png")
        if not args.no_plot:
            report.plot(records, plot_path,
                        title=f"dsv4_jax bench: {meta.get('device')} {args.size} {meta.get('dtype')}")
    problems = check_records(records)
    for p in problems:
        print("PROBLEM:", p, file=sys.stderr)
    print(f"wall time {meta['wall_s']:.1f} s", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
