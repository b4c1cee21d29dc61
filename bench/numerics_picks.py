"""What the official numerics change: picks and outputs of ``numerics="official"`` against "reference".

    python3 bench/numerics_picks.py --size flash --lengths 4096,16384,65536 --json out.json

For each layer type (CSA, HCA; random weights as `bench/measure.build_layer`, one prompt of
random hidden states per length, B = 1, prefilled in one call from an empty cache), the same
layer runs the prompt with ``numerics="reference"`` (transformers 5.23's arithmetic) and with
``numerics="official"`` (DeepSeek's own inference: the FP8 / FP4 roundings, docs/numerics.md).
A record per layer type and length (``scenario: "numerics_picks"``):

    picks_replaced           CSA: the share of a query's top-k that the official rounding replaces,
                             the mean over queries whose top-k is full in both runs
    picks_replaced_quarters  the same per quarter of the prompt's positions (early queries choose
                             among few entries)
    rows_changed             CSA: the share of those queries with at least one pick replaced
    out_rel_max, out_rel_rms the output's difference: max |official - reference| / max |reference|,
                             and the ratio of their root mean squares

Random weights are not the trained model's: these numbers show how much the rounding can move
the indexer's choice at a size and length, not what it does to DeepSeek-V4's checkpoints.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import measure, report  # noqa: E402
from bench import plan as plan_mod  # noqa: E402
from bench import run as run_mod  # noqa: E402
from bench import stack as stack_mod  # noqa: E402


def replaced_share(reference: np.ndarray, official: np.ndarray) -> np.ndarray:
    """Per query row, the share of `reference`'s picks [S, K] (int, -1 = none) absent from
    `official`'s: a float [S], 0 for a row without picks (each row's picks are distinct)."""
    rows = reference.shape[0]
    width = int(max(reference.max(initial=0), official.max(initial=0))) + 1
    offset = (np.arange(rows, dtype=np.int64) * width)[:, None]
    ref = np.where(reference >= 0, reference + offset, -1)  # one id space over every row
    off = np.where(official >= 0, official + offset, -2)
    picked = (reference >= 0).sum(axis=1)
    kept = (np.isin(ref, off) & (ref >= 0)).sum(axis=1)
    return (picked - kept) / np.maximum(picked, 1)


def compare(attn, hidden: jax.Array, settings: tuple[str, str] = ("reference", "official")) -> dict:
    """The two runs of one prompt through `attn`, with the numerics `settings` (the baseline, then
    the one compared with it), and what differs (the module docstring's fields)."""
    length = hidden.shape[1]
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    runs = []
    for numerics in settings:
        attn.numerics = numerics
        out, _, inter = attn(hidden, positions, attn.init_cache(1, length), return_intermediates=True)
        runs.append((np.asarray(out, np.float32), None if inter.topk is None else np.asarray(inter.topk)[0]))
    (ref_out, ref_picks), (off_out, off_picks) = runs
    diff = off_out - ref_out
    rec = {"out_rel_max": float(np.abs(diff).max() / np.abs(ref_out).max()),
           "out_rel_rms": float(np.sqrt(np.mean(diff ** 2)) / np.sqrt(np.mean(ref_out ** 2))),
           "picks_replaced": None, "picks_replaced_quarters": None, "rows_changed": None, "full_rows": None}
    if ref_picks is not None:  # CSA
        full = (ref_picks >= 0).all(axis=1) & (off_picks >= 0).all(axis=1)
        share = replaced_share(ref_picks, off_picks)
        quarters = np.array_split(np.arange(length), 4)
        rec.update(picks_replaced=float(share[full].mean()) if full.any() else None,
                   rows_changed=float((share[full] > 0).mean()) if full.any() else None,
                   full_rows=int(full.sum()),
                   picks_replaced_quarters=[float(share[q][full[q]].mean()) if full[q].any() else None
                                            for q in quarters])
    return rec


def run(args, write=None) -> tuple[list[dict], dict]:
    """The records of every layer type and length (`write(records, meta)` after each, if given)."""
    cfg = plan_mod.config_for(args.size)
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    env = stack_mod.environment()
    meta = {**run_mod.environment("gpu" if gpu else "cpu"), **env, "size": args.size, "dtype": dtype.name,
            "argv": sys.argv[1:], "seed": args.seed}
    records = []
    for kind in args.layers.split(","):
        layer_idx = stack_mod.stack_layer_indices(cfg, kind, 1)[0]
        layer_type = cfg.layer_types[layer_idx]
        attn = measure.build_layer(cfg, layer_idx, dtype, args.seed + layer_idx)
        attn.donate_cache = False
        for length in (int(n) for n in args.lengths.split(",")):
            rng = np.random.default_rng(args.seed + length)
            hidden = jnp.asarray(rng.standard_normal((1, length, cfg.hidden_size), dtype=np.float32), dtype)
            rec = {"scenario": "numerics_picks", "size": args.size, "layer_type": layer_type,
                   "layer_idx": layer_idx, "prompt_len": length, "dtype": dtype.name,
                   "index_topk": cfg.index_topk, **env, "error": None}
            try:
                rec.update(compare(attn, hidden))
            except Exception as err:  # a failing cell is a record; the run goes on
                rec["error"] = report.error_text(err)
            records.append(rec)
            print(line(rec), file=sys.stderr, flush=True)
            if write:
                write(records, meta)
    return records, meta


def line(rec: dict) -> str:
    head = f"numerics_picks {rec['layer_type']} L{rec['prompt_len']}"
    if rec["error"]:
        return f"{head}: ERROR {rec['error']}"
    picks = "" if rec["picks_replaced"] is None else (
        f"picks replaced {rec['picks_replaced']:.1%} (quarters "
        + " / ".join("-" if q is None else f"{q:.1%}" for q in rec["picks_replaced_quarters"])
        + f"), rows changed {rec['rows_changed']:.1%}, ")
    return f"{head}: {picks}output rel max {rec['out_rel_max']:.3f}, rel rms {rec['out_rel_rms']:.3f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=("tiny", "small", "flash"))
    ap.add_argument("--layers", default="csa,hca", help="layer types, of csa,hca (bench/stack.py's stacks)")
    ap.add_argument("--lengths", default="2048,8192", help="prompt lengths (default 2048,8192)")
    ap.add_argument("--dtype", default=None, help="parameters and activations (default bfloat16 on GPU, else float32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    def write(records, meta):
        Path(args.json).write_text(json.dumps({"meta": meta, "records": records}, indent=1))

    run(args, write if args.json else None)


if __name__ == "__main__":
    main()
