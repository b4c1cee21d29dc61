"""Ragged batches: a serving step that mixes one prefill with decodes, against its padded cost.

    python bench/ragged.py --size tiny --json out.json          # seconds (the smoke test)
    python bench/ragged.py --size small --json bench/results/cpu_small_ragged.json
    python3 bench/ragged.py --size flash --batch 8 --prefill 512 --context 4096 --json $OUT/ragged.json

Every row of a batch of B holds a ``--context``-token sequence (prefilled once, untimed). The
timed call is the serving mix, one call of shape [B, P]:

``ragged``   row 0 gets the next P tokens of its prompt (a chunked prefill), rows 1..B-1 one
             decode token each, the rest of their slots padding (position -1): P + B - 1 real
             tokens in B * P slots;
``padded``   the same call shape with every slot a real token (B * P real tokens): what the
             mix costs a library without ragged rows, which must pad every row to real work
             of the longest row's length (here: in one call);
``decode``   a [B, 1] decode step, for scale (the cost of the decode rows alone).

Each is timed through the layer's public call (host checks, compiled step, no donation: every
repeat starts from the same cache), ``--repeats`` times after one warm-up; the JSON records
per (layer, mode) the median and p90 milliseconds, the real tokens and slots, and
``ragged_vs_padded`` (the ratio of the medians). The ragged outputs of the decode rows are
checked against the same rows in the padded call (they see the same cache and tokens), so a
run also shows that padding changes no real row (``max_abs_diff_real_rows``).

What the ratio shows: in a fixed-shape XLA program the dense stages (GEMMs, compressor
pooling, sparse attention) run over every slot, padded or not; what the padding skips is the
cache writes and the indexer's scoring against the cache (a padded query sees no entry: the
native handlers, device and graph, and the NumPy host twin do no work for it). So the ratio is
close to 1 where the dense stages dominate and falls where the indexer's scoring of long
contexts does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import dsv4_jax  # noqa: E402
from bench import plan as plan_mod  # noqa: E402

DEFAULTS = {  # size -> (batch, prefill chunk P, context)
    "tiny": (4, 13, 24),
    "small": (8, 64, 512),
    "flash": (8, 512, 4096),
}
MODES = ("none", "none-xla", "narrow", "narrow-device", "wide")


def _ms(xs):
    return float(np.median(xs) * 1e3)


def _p90(xs):
    return float(np.percentile(xs, 90) * 1e3)


def _time(attn, x, pos, cache, repeats):
    out, _ = attn(x, pos, cache)  # warm-up (compiles)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, new = attn(x, pos, cache)
        jax.block_until_ready((out, new))
        times.append(time.perf_counter() - t0)
    return times, np.asarray(out, np.float32)


def calls(cfg, batch: int, prefill: int, context: int, seed: int = 0):
    """The three timed calls' inputs: {name: (x [B, S, hidden], positions [B, S])}, and the
    context prefix x [B, context, hidden]."""
    rng = np.random.default_rng(seed)
    prefix = rng.normal(size=(batch, context, cfg.hidden_size)).astype(np.float32)
    x = rng.normal(size=(batch, prefill, cfg.hidden_size)).astype(np.float32)
    full = np.broadcast_to(np.arange(context, context + prefill, dtype=np.int32), (batch, prefill)).copy()
    ragged = np.full((batch, prefill), -1, np.int32)
    ragged[0] = full[0]
    ragged[1:, 0] = context
    x_ragged = np.where((ragged >= 0)[..., None], x, np.float32(0.0))
    return prefix, {
        "ragged": (x_ragged, ragged),
        "padded": (x, full),
        "decode": (x[:, :1], full[:, :1]),
    }


def run_case(cfg, layer: str, mode: str, batch: int, prefill: int, context: int, repeats: int) -> dict:
    layer_idx = plan_mod.layer_index(cfg, layer)
    attn = dsv4_jax.DeepseekV4Attention(cfg, layer_idx, rngs=nnx.Rngs(0))
    plan_mod.apply_mode(attn, mode)
    record = dict(scenario="ragged_mix", layer_type=plan_mod.SHORT[attn.layer_type], mode=mode, batch=batch,
                  prefill=prefill, context=context, repeats=repeats, error=None, skipped=None)
    try:
        attn.step_spec()  # resolves the plan: a mode this machine cannot run is skipped
    except ValueError as err:
        record["skipped"] = str(err)
        return record
    max_seq_len = -(-(context + prefill) // 128) * 128
    prefix, timed = calls(cfg, batch, prefill, context)
    cache = attn.init_cache(batch, max_seq_len)
    if context:
        _, cache = attn(jnp.asarray(prefix), np.broadcast_to(np.arange(context, dtype=np.int32), (batch, context)),
                        cache)
    outs = {}
    for name, (x, pos) in timed.items():
        times, outs[name] = _time(attn, jnp.asarray(x), pos, cache, repeats)
        record[f"{name}_ms_median"] = _ms(times)
        record[f"{name}_ms_p90"] = _p90(times)
        record[f"{name}_real_tokens"] = int((pos >= 0).sum())
        record[f"{name}_slots"] = int(pos.size)
    record["ragged_vs_padded"] = record["ragged_ms_median"] / record["padded_ms_median"]
    # Row 0 and the decode rows' first slot saw the same cache and tokens in both calls.
    pos_ragged = timed["ragged"][1]
    real = pos_ragged >= 0
    diff = np.abs(outs["ragged"] - outs["padded"])[real]
    record["max_abs_diff_real_rows"] = float(diff.max())
    record["padded_slots_zero"] = bool(np.all(outs["ragged"][~real] == 0))
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=sorted(DEFAULTS))
    ap.add_argument("--layers", default="csa", help="comma-separated: csa, hca")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated from {MODES}")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--prefill", type=int, default=None, help="row 0's chunk P (the call width)")
    ap.add_argument("--context", type=int, default=None, help="tokens every row holds before the timed call")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the records here")
    args = ap.parse_args(argv)
    batch, prefill, context = DEFAULTS[args.size]
    batch = args.batch or batch
    prefill = args.prefill or prefill
    context = context if args.context is None else args.context
    if batch < 2 or prefill < 2:
        ap.error("--batch and --prefill: expected at least 2 (one prefill row and decode rows)")
    cfg = plan_mod.config_for(args.size)
    records = []
    for layer in args.layers.split(","):
        for mode in args.modes.split(","):
            if mode not in MODES:
                ap.error(f"--modes: expected entries from {MODES}, got {mode!r}")
            rec = run_case(cfg, layer, mode, batch, prefill, context, args.repeats)
            rec["size"] = args.size
            records.append(rec)
            if rec["skipped"]:
                print(f"{layer:4s} {mode:14s} skipped: {rec['skipped']}")
            else:
                print(f"{layer:4s} {mode:14s} ragged {rec['ragged_ms_median']:8.2f} ms  padded "
                      f"{rec['padded_ms_median']:8.2f} ms  ({rec['ragged_vs_padded']:.2f}x)  decode "
                      f"{rec['decode_ms_median']:8.2f} ms  real tokens {rec['ragged_real_tokens']}/"
                      f"{rec['ragged_slots']}")
    meta = dict(jax_version=jax.__version__, device=str(jax.devices()[0]), batch=batch, prefill=prefill,
                context=context, size=args.size)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
