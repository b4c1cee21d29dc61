"""The same bits in every process? One process's digest of a fixed computation, and its speed.

    python bench/reproducibility.py --size flash --json $OUT/repro_default_1.json
    python bench/reproducibility.py --size flash --deterministic --json $OUT/repro_det_1.json
    python bench/reproducibility.py --summarize $OUT/repro_*.json --json $OUT/reproducibility.json
    python bench/reproducibility.py --size tiny --prompt 40 --steps 3 --repeats 3   # CPU smoke

One process builds a CSA and an HCA layer (the config's first of each, bf16 weights drawn from
seed 0), runs a prefill of ``--prompt`` tokens at batch ``--batch`` through the module calls,
then ``--steps`` decode steps (``positions=None``), and hashes every output and the final
caches (sha256 over their bytes): the digest. ``--deterministic`` builds the layers with
``deterministic=True`` (on CUDA: XLA's flags for run-to-run identical programs). Run it in
several processes per setting (bench/gpu.sh repro: three each, one after the other on one
machine) and ``--summarize`` says whether each setting's processes agree bit for bit.

Speed, the peer measured in the same run being the other setting: the decode step's median over
``--repeats`` repeats of ``--steps`` steps (each step blocked on, after a warm-up pass), and the
prefill's median over ``--repeats`` calls into fresh caches; compile time (the first calls) apart.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _layers(cfg, deterministic: bool):
    import jax.numpy as jnp
    from flax import nnx

    import dsv4_jax

    picked = [next(i for i, t in enumerate(cfg.layer_types) if t == kind) for kind in (dsv4_jax.CSA, dsv4_jax.HCA)]
    return [dsv4_jax.DeepseekV4Attention(cfg, layer_idx=i, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16,
                                         deterministic=deterministic) for i in picked]


def _measure(layer, prompt, positions, tokens, args, digest) -> dict:
    """One layer: its outputs and final cache into `digest`, then its timings."""
    import jax
    import numpy as np

    max_seq_len = args.prompt + args.steps
    t0 = time.perf_counter()
    cache = layer.init_cache(args.batch, max_seq_len)
    out, cache = layer(prompt, positions, cache)
    outs = [out]
    for s in range(args.steps):
        out, cache = layer(tokens[:, s], None, cache)
        outs.append(out)
    jax.block_until_ready((outs, cache))
    first_s = time.perf_counter() - t0  # both steps' compiles and one run of each
    for array in [*outs, *jax.tree.leaves(cache)]:
        digest.update(np.asarray(array).tobytes())

    def prefill():
        out, cache = layer(prompt, positions, layer.init_cache(args.batch, max_seq_len))
        return jax.block_until_ready((out, cache))[1]

    def decode_steps(cache):
        times = []
        for s in range(args.steps):
            t = time.perf_counter()
            out, cache = layer(tokens[:, s], None, cache)
            out.block_until_ready()
            times.append(time.perf_counter() - t)
        return times

    start = prefill()  # warm-up, and the cache the decode steps start from
    prefill_ms = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        prefill()
        prefill_ms.append(1e3 * (time.perf_counter() - t))
    decode_steps(start)  # warm-up
    decode_ms = [1e3 * statistics.median(decode_steps(start)) for _ in range(args.repeats)]
    return {"first_calls_s": round(first_s, 3), "prefill_ms": round(statistics.median(prefill_ms), 4),
            "decode_step_ms": round(statistics.median(decode_ms), 4),
            "step_deterministic": bool(layer.step_spec().plan.deterministic)}


def run(args) -> dict:
    import jax
    import numpy as np

    import dsv4_jax
    from bench import run as bench_run

    cfg = {"flash": dsv4_jax.DeepseekV4Config.flash, "tiny": dsv4_jax.DeepseekV4Config.tiny}[args.size]()
    layers = _layers(cfg, args.deterministic)
    rng = np.random.default_rng(0)
    prompt = rng.normal(size=(args.batch, args.prompt, cfg.hidden_size)).astype(np.float32)
    tokens = rng.normal(size=(args.batch, args.steps, 1, cfg.hidden_size)).astype(np.float32)
    positions = np.broadcast_to(np.arange(args.prompt, dtype=np.int32), (args.batch, args.prompt))

    digest = hashlib.sha256()
    records = {layer.layer_type: _measure(layer, prompt, positions, tokens, args, digest) for layer in layers}
    env = bench_run.environment(jax.default_backend())
    return {"bench": "reproducibility", "size": args.size, "batch": args.batch, "prompt": args.prompt,
            "steps": args.steps, "repeats": args.repeats, "deterministic": args.deterministic,
            "digest": digest.hexdigest(), "layers": records, "pid": os.getpid(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "environment": env}


def summarize(paths: list[str]) -> dict:
    """Per setting: the processes' digests (all equal?) and the median of their step times;
    the deterministic setting's time against the default's."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    table = {}
    for setting in (False, True):
        mine = [r for r in runs if r["deterministic"] is setting]
        if not mine:
            continue
        kinds = sorted(mine[0]["layers"])
        table["deterministic" if setting else "default"] = {
            "processes": len(mine),
            "digests": [r["digest"] for r in mine],
            "bit_identical": len({r["digest"] for r in mine}) == 1,
            "layers": {k: {m: round(statistics.median(r["layers"][k][m] for r in mine), 4)
                           for m in ("prefill_ms", "decode_step_ms", "first_calls_s")} for k in kinds},
        }
    if len(table) == 2:
        d, n = table["deterministic"]["layers"], table["default"]["layers"]
        table["cost"] = {k: {m: round(d[k][m] / n[k][m], 3) for m in ("prefill_ms", "decode_step_ms")} for k in d}
    return {"bench": "reproducibility_summary", "runs": runs, "summary": table}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="flash", choices=("flash", "tiny"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--summarize", nargs="+", metavar="JSON")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    result = summarize(args.summarize) if args.summarize else run(args)
    text = json.dumps(result, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    shown = result.get("summary", result)
    print(json.dumps({k: v for k, v in shown.items() if k not in ("environment", "runs")}, indent=1))


if __name__ == "__main__":
    main()
