"""The indexer's selection alone: native handlers (csrc/) against XLA, on the device.

    python bench/topk.py --json $OUT/gpu_topk.json          # on the H200 (~1 min)
    python bench/topk.py --quick                             # CPU smoke run

Cases (V4-Flash indexer sizes: nI = 64 heads of c = 128, index_topk K = 512):

* ``topk``    the top-k alone on float32 scores [rows, 1, T]: `native.topk` (graph-compatible
              and eager targets) against `lax.top_k` + -1 masking (`indexer.picks_from_scores`).
              The issue's yardstick: 64 rows of 16k entries, k = 512. Each shape on tied scores
              (bins of exact ties: the CUDA kernel's sort) and on continuous ones (its placement).
* ``select``  scoring + top-k for a decode step, queries [B, 1, nI, c] against the key cache
              [B, T, c] in bfloat16: `native.select_topk` against `indexer.select_topk` (XLA),
              and the handler over the same keys in a paged cache's pool (pages of 64 entries
              scattered through it, read through the table: ``native-graph-paged``).
* ``select_fp4``  the same decode step over an FP8 cache's MXFP4 keys (68 bytes a key: codes
              two a byte + a scale byte a block of 32) at long contexts: the handler reading
              them in their stored form (`native.select_topk_fp4`, the default), against a
              dequantized bf16 copy handed to `native.select_topk` (`select_keys="dequantized"`),
              and against a bf16 cache's keys (the same values, 256 bytes a key), the stored form
              in a paged cache's pool (``native-fp4-stored-paged``), and the
              Pallas scoring over those and over the stored form (``--pallas-configs``;
              `index_scores` / `index_scores_fp4`, each followed by the native top-k; the layer
              keeps the handler's scoring for decode until these measure faster), and the
              stored form on FP8 tensor cores (``pallas-fp8-scores``, `index_scores_fp8`; the
              queries are on the FP4 grid in this case, as numerics="official" makes them).
* ``select_prefill``  one query block of a long prefill (256 queries on a causal ramp, B = 1,
              bf16; ``--prefill-slots``: the entries its last query sees): the native selection,
              the top-k alone on the same scores (with ``--device-time`` each kernel's own time
              says how the handler splits), the Pallas scoring (`dsv4_jax.ops.indexer.pallas`, each
              of ``--pallas-configs``; the first is the layer's default for prefill chunks on
              CUDA) followed by the native top-k, and XLA where its [S, nI, T] product fits 2 GiB.

Protocol: each timed program runs the operation `unroll` times on different inputs inside one
`jax.jit` (so that per-call dispatch, ~60-75 us on the H200, does not hide the kernels), after
a warm-up call that compiles and one second of back-to-back calls (the card's clock ramps up
from idle only under sustained work); the median over `repeats` calls, divided by `unroll`, is
the time of one operation. Every variant's picks are checked against the XLA twin's before
timing: a variant that disagrees is recorded with ``picks_equal: false``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsv4_jax import native, numerics  # noqa: E402
from dsv4_jax.ops.indexer import pallas as indexer_kernel  # noqa: E402
from dsv4_jax.ops.indexer import pallas_fp8 as indexer_kernel_fp8  # noqa: E402
from dsv4_jax.ops.indexer import reference as indexer  # noqa: E402


def time_program(fn, args, repeats: int, spin_s: float = 1.0) -> list[float]:
    jax.block_until_ready(fn(*args))  # compile + warm up
    # Keep the device busy for `spin_s` first: an H200 idles at ~390 MHz and reaches its boost
    # clock only under sustained work; short timed bursts alone would run at the idle clock.
    t_end = time.perf_counter() + spin_s
    while time.perf_counter() < t_end:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


def unrolled(op, unroll: int):
    """One jitted program running `op` on each of `unroll` stacked inputs (unrolled, no loop)."""

    def program(*stacked):
        return [op(*(a[i] for a in stacked)) for i in range(unroll)]

    return jax.jit(program)


DEVICE_TIME = False  # --device-time: also trace each program (bench/kernel_profile.py)


def device_time(fn, args, unroll: int) -> dict:
    """Kernel time per operation from JAX's profiler: what the device spends, without the gaps
    between kernels and the program's launch (the wall-clock median includes both)."""
    from bench import kernel_profile

    summary = kernel_profile.profile(lambda: jax.block_until_ready(fn(*args)), 5, "/tmp/dsv4_topk_profile")
    return {"device_us_per_op": summary["busy_us_per_step"] / unroll,
            "kernels_per_op": summary["kernels_per_step"] / unroll,
            "device_top_ops": [{k: r[k] for k in ("op", "us_per_step", "kernels_per_step", "kernel_names")}
                               for r in summary["rows"][:4]],
            "device_kernels_per_op": [{"kernel": r["kernel"], "us": r["us_per_step"] / unroll,
                                       "launches": r["per_step"] / unroll} for r in summary["kernels"][:4]]}


def time_variants(case: str, variants: dict, args: tuple, unroll: int, repeats: int, fields: dict) -> list[dict]:
    """Time each variant's unrolled program on `args`; picks compared with the first variant's."""
    ref = None
    out = []
    for name, op in variants.items():
        if name.startswith("native") and not native.available(jax.default_backend()):
            out.append({"case": case, "variant": name, "skipped": native.unavailable_reason(jax.default_backend())})
            continue
        fn = unrolled(op, unroll)
        picks = np.asarray(fn(*args)[0])
        ref = picks if ref is None else ref
        times = time_program(fn, args, repeats)
        out.append({"case": case, "variant": name, **fields, "unroll": unroll,
                    "us_per_op_median": 1e6 * statistics.median(times) / unroll,
                    "us_per_op_min": 1e6 * min(times) / unroll, "repeats": repeats,
                    "picks_equal": bool(np.array_equal(picks, ref)),
                    # bf16 scores of two implementations round differently: where picks differ,
                    # say how many places, and whether the rows still pick the same sets.
                    "picks_differing": int(np.sum(picks != ref)),
                    "picks_same_sets": bool(np.array_equal(np.sort(picks, axis=-1), np.sort(ref, axis=-1))),
                    **(device_time(fn, args, unroll) if DEVICE_TIME else {})})
    return out


def topk_case(rows: int, slots: int, k: int, unroll: int, repeats: int, seed: int = 0,
              scores_kind: str = "tied") -> list[dict]:
    """`scores_kind`: "continuous" (standard normal: few entries a histogram bin, as real indexer
    scores; the CUDA kernel orders its candidates by placement) or "tied" (every 7th score
    rounded to an integer: bins of dozens of exact ties, which the kernel sorts)."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((unroll, rows, 1, slots)).astype(np.float32)
    if scores_kind == "tied":
        scores[..., ::7] = np.round(scores[..., ::7])  # exact ties at several levels
    visible = np.full((unroll, rows, 1), slots, np.int32)
    variants = {
        "xla-lax.top_k": lambda s, v: indexer.picks_from_scores(s, v, k),
        "native-graph": lambda s, v: native.topk(s, v, top_k=k, graph=True),
        "native-eager": lambda s, v: native.topk(s, v, top_k=k, graph=False),
    }
    return time_variants("topk", variants, (jnp.asarray(scores), jnp.asarray(visible)), unroll, repeats,
                         {"rows": rows, "slots": slots, "top_k": k, "scores": scores_kind})


PAGE_ENTRIES = 64  # a paged cache's entries a page: V4's page of 256 tokens at m = 4


def paged_copy(arrays, seed: int = 3):
    """The stacked keys `arrays` ([unroll, B, T, .] each) as a paged cache holds them: (pools
    [unroll, N, .] each, table int32 [unroll, B, P_row]), every row's pages of `PAGE_ENTRIES`
    entries at random places of the pool (out of order, rows interleaved)."""
    unroll, batch, slots = arrays[0].shape[:3]
    per_row = -(-slots // PAGE_ENTRIES)
    rng = np.random.default_rng(seed)
    table = np.stack([rng.permutation(batch * per_row).reshape(batch, per_row) for _ in range(unroll)]).astype(np.int32)
    pools = []
    for a in arrays:
        a = np.asarray(a)
        padded = np.zeros((unroll, batch, per_row * PAGE_ENTRIES, a.shape[-1]), a.dtype)
        padded[:, :, :slots] = a
        pool = np.zeros((unroll, batch * per_row, PAGE_ENTRIES, a.shape[-1]), a.dtype)
        for u in range(unroll):
            pool[u, table[u].reshape(-1)] = padded[u].reshape(batch * per_row, PAGE_ENTRIES, a.shape[-1])
        pools.append(jnp.asarray(pool.reshape(unroll, -1, a.shape[-1])))
    return pools, jnp.asarray(table)


def select_case(batch: int, slots: int, heads: int, dim: int, k: int, unroll: int, repeats: int,
                dtype=jnp.bfloat16, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((unroll, batch, 1, heads, dim)), dtype)
    w = jnp.asarray(rng.standard_normal((unroll, batch, 1, heads)) * heads**-0.5, jnp.float32)
    keys = jnp.asarray(rng.standard_normal((unroll, batch, slots, dim)), dtype)
    visible = jnp.full((unroll, batch, 1), slots, jnp.int32)
    (pool,), table = paged_copy((keys,))

    def paged(q, w, kk, pool, table, v):  # the same keys read in their pages through the table
        pages = native.Pages(table, PAGE_ENTRIES, slots)
        return native.select_topk(q, w, pool, v, top_k=k, graph=True, pages=pages)[0]

    variants = {
        "xla": lambda q, w, kk, pool, table, v: indexer.select_topk(q, w, kk, v, top_k=k).picks,
        "native-graph": lambda q, w, kk, pool, table, v: native.select_topk(q, w, kk, v, top_k=k, graph=True)[0],
        "native-eager": lambda q, w, kk, pool, table, v: native.select_topk(q, w, kk, v, top_k=k, graph=False)[0],
        "native-graph-paged": paged,
    }
    return time_variants("select", variants, (q, w, keys, pool, table, visible), unroll, repeats,
                         {"batch": batch, "slots": slots, "heads": heads, "dim": dim, "top_k": k,
                          "dtype": jnp.dtype(dtype).name})


def select_fp4_case(batch: int, slots: int, heads: int, dim: int, k: int, unroll: int, repeats: int,
                    seed: int = 2, configs: str = "") -> list[dict]:
    from dsv4_jax.cache.quantized import QuantizedRows

    rng = np.random.default_rng(seed)
    # Queries on the FP4 grid, as numerics="official" rounds them (the FP8 dots take only those;
    # the other variants are indifferent to it).
    q = numerics.fp4_round_trip(jnp.asarray(rng.standard_normal((unroll, batch, 1, heads, dim)), jnp.bfloat16))
    w = jnp.asarray(rng.standard_normal((unroll, batch, 1, heads)) * heads**-0.5, jnp.float32)
    # Random codes and scale bytes near 2 ** 0 (what a quantized cache holds; no host-side
    # quantization of a 1M context's keys needed).
    codes = jnp.asarray(rng.integers(0, 256, size=(unroll, batch, slots, dim // 2), dtype=np.uint8))
    scales = jnp.asarray(rng.integers(122, 130, size=(unroll, batch, slots, dim // 32), dtype=np.uint8))
    visible = jnp.full((unroll, batch, 1), slots, jnp.int32)
    dense = QuantizedRows(values=codes, scales=scales, rope=jnp.zeros((unroll, batch, slots, 0), jnp.bfloat16),
                          block=32, grid="fp4").dequantize()

    (codes_pool, scales_pool), table = paged_copy((codes, scales))

    # Every variant takes the same arguments: the keys in both forms and in pages (`paged_copy`:
    # pc, ps, t). Picks are checked equal.
    def dequantized(q, w, c, s, dense, pc, ps, t, v):  # the copy inside the program, as the layer's step did
        kk = QuantizedRows(values=c, scales=s, rope=jnp.zeros((*c.shape[:-1], 0), jnp.bfloat16), block=32,
                           grid="fp4").dequantize()
        return native.select_topk(q, w, kk, v, top_k=k, graph=True)[0]

    def stored_paged(q, w, c, s, dense, codes_pool, scales_pool, table, v):  # the stored form in its pages
        return native.select_topk_fp4(q, w, codes_pool, scales_pool, v, top_k=k, graph=True,
                                      pages=native.Pages(table, PAGE_ENTRIES, slots))[0]

    def stored(q, w, c, s, dense, pc, ps, t, v):
        return native.select_topk_fp4(q, w, c, s, v, top_k=k, graph=True)[0]

    def bf16_keys(q, w, c, s, dense, pc, ps, t, v):
        return native.select_topk(q, w, dense, v, top_k=k, graph=True)[0]

    variants = {
        "native-fp4-stored": stored,
        "native-fp4-dequantized": dequantized,
        "native-bf16-keys": bf16_keys,
        "native-fp4-stored-paged": stored_paged,
    }
    for config in pallas_configs(configs):  # the Pallas scoring over the bf16 keys, then over the stored form
        select = pallas_select(config, k)
        variants[pallas_name(config)] = lambda q, w, c, s, dense, pc, ps, t, v, select=select: select(q, w, dense, v)
        select = pallas_select(config, k, stored=True)
        variants[pallas_name(config, stored=True)] = (lambda q, w, c, s, dense, pc, ps, t, v, select=select:
                                                      select(q, w, (c, s), v))
        select = pallas_select(config, k, stored=True, fp8=True)
        variants[pallas_name(config, stored=True, fp8=True)] = (lambda q, w, c, s, dense, pc, ps, t, v,
                                                                select=select: select(q, w, (c, s), v))
    args = (q, w, codes, scales, dense, codes_pool, scales_pool, table, visible)
    return time_variants("select_fp4", variants, args, unroll, repeats,
                         {"batch": batch, "slots": slots, "heads": heads, "dim": dim, "top_k": k,
                          "key_bytes": {"mxfp4": dim // 2 + dim // 32, "bfloat16": 2 * dim}, "dtype": "mxfp4"})


# The Pallas scoring's configurations (`--pallas-configs`): entries a block, blocks a program,
# Triton warps, pipeline stages; the first is the package's (dsv4_jax.ops.indexer.pallas).
PALLAS_CONFIGS = "128:8:8:3,128:8:4:3"


def pallas_configs(spec: str) -> list[dict]:
    keys = ("block", "tiles", "num_warps", "num_stages")
    out = []
    for item in filter(None, spec.split(",")):
        values = item.split(":")
        if len(values) != len(keys) or not all(v.isdigit() and int(v) > 0 for v in values):
            raise ValueError(f"--pallas-configs: expected block:tiles:warps:stages items, got {item!r}")
        out.append(dict(zip(keys, map(int, values))))
    return out


def pallas_name(config: dict, stored: bool = False, fp8: bool = False) -> str:
    scores = "pallas-fp8-scores" if fp8 else "pallas-fp4-scores" if stored else "pallas-scores"
    return f"native-{scores}[b{{block}} t{{tiles}} w{{num_warps}} s{{num_stages}}]+topk".format(**config)


def pallas_select(config: dict, k: int, stored: bool = False, fp8: bool = False):
    """picks of queries [B, S, nI, c] against keys [B, T, c]: the Pallas scoring kernel
    (`indexer_kernel.index_scores`; interpret mode off the GPU), then the native top-k: what
    the layer's native selection runs for a prefill chunk on CUDA (`KernelPlan.select_scores`).
    `stored`: keys are an FP8 cache's (codes, scale bytes), scored by `index_scores_fp4`
    (`KernelPlan.select_keys="stored"`), or with `fp8` by `index_scores_fp8`'s e4m3 dots
    (`select_keys="fp8"`; queries on the FP4 grid)."""

    def select(q, w, keys, visible):
        interpret = jax.default_backend() != "gpu"
        if fp8:
            scores = indexer_kernel_fp8.index_scores_fp8(q, w, *keys, visible, interpret=interpret, **config)
        elif stored:
            scores = indexer_kernel.index_scores_fp4(q, w, *keys, visible, interpret=interpret, **config)
        else:
            scores = indexer_kernel.index_scores(q, w, keys, visible, interpret=interpret, **config)
        return native.topk(scores, visible, top_k=k, graph=True)

    return select


def select_prefill_case(seq: int, slots: int, heads: int, dim: int, k: int, unroll: int, repeats: int,
                        seed: int = 3, configs: str = PALLAS_CONFIGS) -> list[dict]:
    """One query block of a long prefill chunk: `seq` queries (the layer's indexer block) at the
    end of a prompt whose last query sees `slots` entries (a causal ramp of one entry in four),
    B = 1, bf16. The top-k alone on the same scores says how the handler's time splits."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((unroll, 1, seq, heads, dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((unroll, 1, seq, heads)) * heads**-0.5, jnp.float32)
    keys = jnp.asarray(rng.standard_normal((unroll, 1, slots, dim)), jnp.bfloat16)
    visible = jnp.asarray(np.broadcast_to(slots - (seq - 1 - np.arange(seq)) // 4, (unroll, 1, seq)), jnp.int32)
    if native.available(jax.default_backend()):
        native_scores = jax.jit(lambda q, w, kk, v: native.select_topk(q, w, kk, v, top_k=k, graph=True)[1])
        scores = native_scores(q, w, keys, visible)
    else:
        scores = indexer.select_topk(q, w, keys, visible, top_k=k).scores
    variants = {
        "native-graph": lambda q, w, kk, v, s: native.select_topk(q, w, kk, v, top_k=k, graph=True)[0],
        "native-topk-alone": lambda q, w, kk, v, s: native.topk(s, v, top_k=k, graph=True),
    }
    for c in pallas_configs(configs):
        select = pallas_select(c, k)
        variants[pallas_name(c)] = lambda q, w, kk, v, s, select=select: select(q, w, kk, v)
    if seq * heads * slots <= 256 * 64 * 32768:  # XLA's [S, nI, T] float32 product: 2 GiB at most
        variants["xla"] = lambda q, w, kk, v, s: indexer.select_topk(q, w, kk, v, top_k=k).picks
    return time_variants("select_prefill", variants, (q, w, keys, visible, scores), unroll, repeats,
                         {"batch": 1, "seq": seq, "slots": slots, "heads": heads, "dim": dim, "top_k": k,
                          "dtype": "bfloat16", "score_flops": 2.0 * heads * dim * float(np.asarray(visible[0]).sum())})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--cases", default="topk,select,select_fp4", help="which cases to run (comma-separated)")
    ap.add_argument("--prefill-slots", default="8192,32768,65536,262144",
                    help="select_prefill: entries the block's last query sees (comma-separated)")
    ap.add_argument("--pallas-configs", default=PALLAS_CONFIGS,
                    help="select_prefill, select_fp4: the Pallas scoring's configurations, "
                         "block:tiles:warps:stages[,...] (dsv4_jax.ops.indexer.pallas)")
    ap.add_argument("--device-time", action="store_true",
                    help="also trace each program: kernel time per op (set XLA_FLAGS="
                         "--xla_enable_command_buffers_during_profiling=true to keep CUDA graphs)")
    args = ap.parse_args(argv)
    global DEVICE_TIME
    DEVICE_TIME = args.device_time
    records = []
    cases = set(args.cases.split(","))
    if args.quick:
        if "topk" in cases:
            for kind in ("tied", "continuous"):
                records += topk_case(rows=8, slots=2048, k=64, unroll=4, repeats=5, scores_kind=kind)
        if "select" in cases:
            records += select_case(batch=2, slots=256, heads=64, dim=128, k=64, unroll=2, repeats=3,
                                   dtype=jnp.float32)
        if "select_fp4" in cases:
            records += select_fp4_case(batch=2, slots=256, heads=64, dim=128, k=64, unroll=2, repeats=3,
                                       configs=args.pallas_configs)
        if "select_prefill" in cases:
            records += select_prefill_case(seq=16, slots=256, heads=64, dim=128, k=64, unroll=2, repeats=3,
                                           configs=args.pallas_configs)
    else:
        if "topk" in cases:
            for kind in ("tied", "continuous"):
                for rows, slots in ((64, 16384), (64, 4096), (64, 131072), (32, 4096), (1, 4096)):
                    records += topk_case(rows=rows, slots=slots, k=512, unroll=10, repeats=args.repeats,
                                         scores_kind=kind)
        if "select" in cases:
            for batch, slots in ((1, 512), (1, 4096), (8, 4096), (32, 4096), (32, 512)):
                records += select_case(batch=batch, slots=slots, heads=64, dim=128, k=512, unroll=10,
                                       repeats=args.repeats)
        if "select_fp4" in cases:  # a CSA layer's entries at 128k and 1M tokens of context
            for batch, slots in ((1, 32768), (8, 32768), (1, 262144), (8, 262144)):
                records += select_fp4_case(batch=batch, slots=slots, heads=64, dim=128, k=512,
                                           unroll=4 if batch * slots > 300_000 else 10, repeats=args.repeats,
                                           configs=args.pallas_configs)
        if "select_prefill" in cases:  # a CSA prefill's query block of 256 at 32k, 128k, 256k and 1M tokens
            for slots in (int(t) for t in args.prefill_slots.split(",")):
                records += select_prefill_case(seq=256, slots=slots, heads=64, dim=128, k=512,
                                               configs=args.pallas_configs,
                                               unroll=2 if slots > 65536 else 4, repeats=args.repeats)
    dev = jax.devices()[0]
    meta = {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform, "jax_version": jax.__version__,
            "native": native.native_info(), "date_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "command": " ".join(["python", "bench/topk.py", *(argv if argv is not None else sys.argv[1:])])}
    for r in records:
        r.update(device=meta["device"], jax_version=meta["jax_version"])
    print(f"{'case':10} {'variant':22} {'shape':28} {'us/op':>9}  picks==first variant's")
    for r in records:
        if r.get("skipped"):
            print(f"{r['case']:10} {r['variant']:22} skipped: {r['skipped']}")
            continue
        shape = (f"{r['rows']}x{r['slots']} k={r['top_k']} {r['scores']}" if r["case"] == "topk"
                 else f"S={r['seq']} T={r['slots']} {r['dtype']}" if r["case"] == "select_prefill"
                 else f"B={r['batch']} T={r['slots']} {r['dtype']}")
        dev_us = f"  device {r['device_us_per_op']:.1f} us in {r['kernels_per_op']:.1f} kernels" \
            if "device_us_per_op" in r else ""
        print(f"{r['case']:10} {r['variant']:22} {shape:28} {r['us_per_op_median']:9.1f}  {r['picks_equal']}{dev_us}")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "records": records}, indent=1))


if __name__ == "__main__":
    main()
