"""Paged caches against contiguous ones, and a verification step against a decode step (issue 67).

    python bench/paged.py --size flash --json $OUT/paged.json                 # the H200 run (gpu.sh paged)
    python bench/paged.py --size tiny --json /tmp/paged.json                  # seconds, CPU smoke
    python bench/paged.py --render bench/results/<run>.json                   # tables of a past run

Issue 67's targets: paged decode within 1.05x of contiguous decode (B = 1, 8, 32; 16k to 1M), and
a step of S = 4 tokens a row (a speculative step's verification) at most 1.3x a step of one token
(B = 8; 16k and 128k); V4-Flash, bf16, ms a layer of a stack in one jit.

One stack of N layers (`bench/stack.py`'s `Stack`: ``--stacks csa,hca``, N = 4, random weights)
per (stack, B, context) cell decodes from synthetic caches (`Stack.synthetic_caches`: every leaf
random, ``length`` = context) in each variant (records' ``cache``, ``queries_per_step``):

``contiguous``  the default cache, [B, T, D] entries a row.
``paged``       the same values in a paged cache (`dsv4_jax.cache.paged`): pages of ``--page-size``
                tokens, just enough for every row's ``max_seq_len`` (the pool's every page held),
                scattered over the pool by a seeded permutation, as a server's pages end up. Its
                entries are the contiguous cache's, copied into the pages before either runs.

``--paged-kernel`` adds the paged cache once more with the sparse attention kernel forced for
decode (records' ``decode_attention`` "pallas", else "auto"): where the plan takes the XLA path
(HCA below 1024 entries, CSA below 16 rows), that path gathers a paged HCA cache's entries.

Each variant runs at one query a row, and in the cells of ``--query-batches`` x
``--query-contexts`` also at ``--queries`` (S = 4) a row. The loop is the package's fastest:
the stack's pure steps in one `jax.jit`, no positions argument (each row's next S positions from
its cache length), caches and hidden states donated, each step fed the last one's output
(``stack.py --same-buffers all``). Per variant: the compile (two warm-up steps) apart, then
`bench/stack.py`'s timing (`stack.timed_steps`: ``--repeats`` x ``--steps`` pipelined steps timed
as a whole, the median; then ``--steps`` blocking ones). ``ratio_to_contiguous``: per_layer_ms
over the same cell's contiguous variant of the same S (this process); ``ratio_to_one_query``:
over the same cache's S = 1 variant; ``max_abs_diff_to_contiguous``: the hidden states after the
last step against the contiguous variant's (the same computation: 0 expected, the paged cache
is exact); ``floor_ms`` the bytes floor a layer of S new tokens (`bench/floor.py`).

``--deadline-s``: no new cell starts past this many seconds of the run; the cells left are
recorded as skipped (a device call has a hard limit: the records so far are written as they come).
"""

from __future__ import annotations

import argparse
import math
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

import dsv4_jax  # noqa: E402
from bench import measure, report  # noqa: E402
from bench import stack as stack_mod  # noqa: E402
from dsv4_jax.cache.paged import PagedRows, PageTable  # noqa: E402

CACHES = ("contiguous", "paged")
WARM = 2  # warm-up steps of every variant (the first compiles)


def paged_copies(stack: stack_mod.Stack, caches: list, batch: int, max_seq_len: int, page_size: int,
                 seed: int) -> list:
    """`caches` (the stack's contiguous caches) as paged caches holding the same values: every row
    holds the pages of ``max_seq_len`` tokens, ``batch * ceil(max_seq_len / page_size)`` pages in
    all (the whole pool), the pool's pages handed out in a seeded random order. The leaves are new
    buffers (the steps donate their caches)."""
    empty = dsv4_jax.reserve_pages(stack.empty_caches(batch, max_seq_len, page_size), max_seq_len)
    pages = next(c.pages for c in empty if c.pages is not None)
    order = np.random.default_rng(seed).permutation(pages.num_pages).astype(np.int32)
    table = np.where(pages.table >= 0, order[np.maximum(pages.table, 0)], -1).astype(np.int32)
    refs = np.zeros_like(pages.refs)
    refs[table[table >= 0]] = 1
    shared = PageTable(table=jnp.asarray(table), refs=jnp.asarray(refs), page_size=pages.page_size)
    def fill(pool, values):  # the pool (donated) with row b's slot t at its page's row
        slots = values.shape[1]
        rows = PagedRows(pool=pool, table=shared.table, slots=slots)
        return rows.scatter(jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32)[None], (batch, slots)), values).pool

    fill = jax.jit(fill, donate_argnums=0)
    out = []
    for contiguous, paged in zip(caches, empty):
        parts = {}
        for part in ("compressor", "indexer"):
            state, into = getattr(contiguous, part), getattr(paged, part)
            if state is None:
                continue
            pool = fill(into.entries, state.entries)
            parts[part] = jax.tree.map(jnp.copy, state.replace(entries=None)).replace(entries=pool)
        light = contiguous.replace(**{p: None for p in parts})  # every other leaf copied: no buffer shared
        # One table a layer, equal (a stack's caches hold one page table) but not one buffer: the
        # steps donate every cache's leaves.
        own = shared.replace(table=jnp.array(table), refs=jnp.array(refs))
        out.append(jax.tree.map(jnp.copy, light).replace(pages=own, **parts))
    return jax.block_until_ready(out)


def time_variant(stack: stack_mod.Stack, caches: list, batch: int, queries: int, context: int, max_seq_len: int,
                 steps: int, repeats: int, seed: int) -> tuple[dict, np.ndarray]:
    """One variant's record fields from `caches` (donated), and its hidden states after the last
    step (host float32)."""
    state = {"h": stack_mod._hidden(stack.cfg, batch, queries, stack.dtype, seed), "caches": caches}

    def step():
        state["h"], state["caches"] = stack.jits["all"](stack.weights, state["caches"], state["h"], specs=stack.specs)
        return state["h"], state["caches"]

    clock = measure.compile_clock()
    clock.start()
    t0 = time.perf_counter()
    for _ in range(WARM):
        out = step()
    jax.block_until_ready(out)
    first_s = time.perf_counter() - t0
    compile_s = clock.stop()
    timings, (h, _) = stack_mod.timed_steps(step, steps, repeats, len(stack.layers))
    h_host = np.asarray(h.astype(jnp.float32))
    state.clear()
    del out, h
    return ({**timings, "compile_s": compile_s, "first_call_s": first_s, "max_seq_len": max_seq_len,
             "steps": steps, "repeats": repeats, "total_steps": WARM + repeats * steps + steps,
             "output_finite": bool(np.isfinite(h_host).all()), "output_digest": stack_mod.digest(h_host),
             **stack.floor(batch, context + queries * (WARM + repeats * steps // 2), queries)}, h_host)


def cells(stacks: list, batches: list, contexts: list, query_batches: list, query_contexts: list,
          queries: int) -> list:
    """[(stack, batch, context, [S, ...])] in the order they run: by context, then batch, then
    stack, so that a run cut short has lost the longest contexts of every stack alike; S = 1 in
    every cell, `queries` too in the cells of `query_batches` x `query_contexts` (a cell of those
    outside the paged grid runs there too)."""
    extra = [(b, c) for c in query_contexts for b in query_batches if b not in batches or c not in contexts]
    grid = sorted({(c, b) for c in contexts for b in batches} | {(c, b) for b, c in extra})
    return [(kind, b, c, [1] + ([queries] if b in query_batches and c in query_contexts and queries != 1 else []))
            for c, b in grid for kind in stacks]


def run(args, write=None) -> tuple[list, dict]:
    start = time.perf_counter()
    cfg = stack_mod.stack_config(args.size, args.layers_per_stack)
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    numerics = "official" if args.kv_cache_dtype == "fp8" else args.numerics
    env = stack_mod.environment()
    meta = {"size": args.size, "dtype": dtype.name, "argv": sys.argv[1:], "n_layers": args.layers_per_stack,
            "stacks": args.stacks, "caches": list(CACHES), "page_size": args.page_size, "queries": args.queries,
            "paged_kernel": args.paged_kernel,
            "mode": args.mode, "kv_cache_dtype": args.kv_cache_dtype, "numerics": numerics,
            "deadline_s": args.deadline_s, **env}
    def make(kind, kernel_args=None):
        return stack_mod.Stack(cfg, kind, args.layers_per_stack, dtype, args.seed, args.mode, kernel_args=kernel_args,
                               numerics=numerics, kv_cache_dtype=args.kv_cache_dtype)

    stacks = {kind: make(kind) for kind in args.stacks.split(",")}
    # --paged-kernel: the paged cache once more with the attention kernel forced for decode (an A/B
    # of the plan's choice where it takes the XLA path, which gathers a paged HCA cache's entries).
    forced = {kind: make(kind, argparse.Namespace(decode_kernel=True)) for kind in stacks} if args.paged_kernel else {}
    plan = [("contiguous", "auto"), ("paged", "auto")] + ([("paged", "pallas")] if args.paged_kernel else [])
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    records: list[dict] = []
    grid = cells(list(stacks), ints(args.batches), ints(args.contexts), ints(args.query_batches),
                 ints(args.query_contexts), args.queries)
    for kind, batch, context, query_counts in grid:
        stack = stacks[kind]
        base = {"scenario": "paged_decode", "batch": batch, "context_len": context, "size": args.size, "stack": kind,
                "layer_type": stack.layer_type, "n_layers": len(stack.layers), "layer_indices": stack.indices,
                "mode": args.mode, "dtype": dtype.name, "page_size": args.page_size,
                "kv_cache_dtype": args.kv_cache_dtype, "numerics": numerics, **env}
        late = args.deadline_s is not None and time.perf_counter() - start > args.deadline_s
        one_query = {}  # cache -> per_layer_ms at S = 1
        for queries in query_counts:
            total = WARM + args.repeats * args.steps + args.steps
            max_seq_len = stack_mod._round_up(context + total * queries, math.lcm(128, args.page_size))
            reference = None
            variants = {}
            if not late:
                try:  # both made before either runs (the paged one is a copy of the contiguous one)
                    variants["contiguous"] = stack.synthetic_caches(batch, max_seq_len, context, args.seed)
                    variants["paged"] = paged_copies(stack, variants["contiguous"], batch, max_seq_len,
                                                     args.page_size, args.seed)
                except Exception as err:
                    variants = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            for cache, attention in plan:
                key = cache if attention == "auto" else f"{cache}_{attention}"
                rec = {**base, "cache": cache, "decode_attention": attention, "queries_per_step": queries,
                       "error": None}
                if late:
                    rec["error"] = f"skipped: past --deadline-s {args.deadline_s:g} s"
                elif "error" in variants:
                    rec["error"] = variants["error"]
                elif cache != "contiguous" and reference is None:
                    rec["error"] = "skipped: the contiguous variant of this cell failed"
                else:
                    try:
                        if key == "paged" and args.paged_kernel:  # a copy for the forced kernel's run after
                            variants["paged_pallas"] = jax.tree.map(jnp.copy, variants["paged"])
                        fields, h = time_variant(stack if attention == "auto" else forced[kind], variants.pop(key),
                                                 batch, queries, context, max_seq_len, args.steps, args.repeats,
                                                 args.seed)
                        rec.update(fields)
                        rec["ratio_to_floor"] = rec["per_layer_ms"] / rec["floor_ms"] if gpu else None
                        if cache == "contiguous":
                            reference = (rec["per_layer_ms"], h)
                        rec["ratio_to_contiguous"] = rec["per_layer_ms"] / reference[0]
                        rec["max_abs_diff_to_contiguous"] = float(np.max(np.abs(h - reference[1])))
                        if queries == 1:
                            one_query[key] = rec["per_layer_ms"]
                        rec["ratio_to_one_query"] = (rec["per_layer_ms"] / one_query[key] if key in one_query
                                                     else None)
                    except Exception as err:
                        rec["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                records.append(rec)
                print(_line(rec), file=sys.stderr, flush=True)
                if write:
                    write(records, meta)
            variants.clear()
    return records, meta


def _line(rec: dict) -> str:
    head = (f"paged {rec['stack']} B{rec['batch']} L{rec['context_len']} S{rec['queries_per_step']} {rec['cache']}"
            + (" (decode kernel forced)" if rec.get("decode_attention") == "pallas" else ""))
    if rec.get("error"):
        return f"{head}: ERROR {rec['error']}"
    ratio, one = rec.get("ratio_to_floor"), rec.get("ratio_to_one_query")
    return (f"{head}: {rec['per_layer_ms']:.3f} ms/layer (x{rec['ratio_to_contiguous']:.3f} contiguous"
            + (f", x{one:.3f} S=1" if one is not None and rec["queries_per_step"] != 1 else "")
            + f", floor {rec['floor_ms']:.3f}" + (f", x{ratio:.2f} floor" if ratio else "")
            + f"), host {rec['host_dispatch_ms']:.3f} ms/step, compile {rec['compile_s']:.1f} s, "
            f"max diff {rec['max_abs_diff_to_contiguous']:.1e}")


def markdown(records: list, meta: dict) -> str:
    """One table: per (stack, B, context, S), each cache's ms a layer, its ratio to the
    contiguous cache and to S = 1, to the floor, the host's dispatch time a step, the compile."""
    out = [f"Paged and contiguous caches, stacks of {meta.get('n_layers')} layers, {meta.get('size')}, "
           f"{meta.get('dtype')}, pages of {meta.get('page_size')} tokens, {meta.get('device')}, "
           f"jax {meta.get('jax_version')}", "",
           "| stack | B | ctx | S | cache | ms / layer | x contiguous | x S = 1 | x floor | host ms / step | "
           "compile s | max diff |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        forced = " (kernel)" if r.get("decode_attention") == "pallas" else ""
        cell = f"| {r['stack']} | {r['batch']} | {r['context_len']} | {r['queries_per_step']} | {r['cache']}{forced} |"
        if r.get("error"):
            out.append(f"{cell} {r['error'][:80]} | | | | | | |")
            continue
        ratio, one = r.get("ratio_to_floor"), r.get("ratio_to_one_query")
        out.append(f"{cell} {r['per_layer_ms']:.3f} | {r['ratio_to_contiguous']:.3f} | "
                   f"{'' if one is None else f'{one:.3f}'} | {'' if ratio is None else f'{ratio:.2f}'} | "
                   f"{r['host_dispatch_ms']:.3f} | {r['compile_s']:.1f} | {r['max_abs_diff_to_contiguous']:.1e} |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=("tiny", "small", "flash"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--stacks", default="csa,hca", help="comma list of bench/stack.py stacks (mixed, csa, hca)")
    ap.add_argument("--layers-per-stack", type=int, default=4)
    ap.add_argument("--batches", default=None, help="decode batches (default 1,8,32; tiny: 1,2)")
    ap.add_argument("--contexts", default=None, help="decode contexts (default 16384,131072,1048576; tiny: 64)")
    ap.add_argument("--queries", type=int, default=4, help="tokens a row of the verification step (default 4)")
    ap.add_argument("--query-batches", default=None, help="batches of the S-token cells (default 8; tiny: 2)")
    ap.add_argument("--query-contexts", default=None,
                    help="contexts of the S-token cells (default 16384,131072; tiny: 64)")
    ap.add_argument("--page-size", type=int, default=None,
                    help="tokens a page, a multiple of the compress ratios (default 256; tiny: 16)")
    ap.add_argument("--paged-kernel", action="store_true",
                    help="also the paged cache with the sparse attention kernel forced for decode (an A/B of the "
                         "plan's choice; records' decode_attention 'pallas', else 'auto')")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                    help="the caches' rows (fp8: official numerics)")
    ap.add_argument("--numerics", default="reference", choices=("reference", "official"))
    ap.add_argument("--steps", type=int, default=None, help="steps per repeat (default 16; tiny: 2)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats (default 5; tiny: 2)")
    ap.add_argument("--mode", default="none", help="the layers' bench/plan.py mode (default: none)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no new cell past this many seconds of the run (the rest recorded as skipped)")
    ap.add_argument("--render", default=None, metavar="JSON")
    return ap


def fill_defaults(args) -> None:
    tiny = args.size == "tiny"
    args.batches = args.batches or ("1,2" if tiny else "1,8,32")
    args.contexts = args.contexts or ("64" if tiny else "16384,131072,1048576")
    args.query_batches = args.query_batches or ("2" if tiny else "8")
    args.query_contexts = args.query_contexts or ("64" if tiny else "16384,131072")
    args.steps = args.steps or (2 if tiny else 16)
    args.repeats = args.repeats or (2 if tiny else 5)
    args.page_size = args.page_size or (16 if tiny else 256)


def main(argv=None) -> int:
    return report.scenario_main(argv, build_parser, fill_defaults, run, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
