"""Paged caches against contiguous ones, and a verification step against a decode step (issue 67).

    python bench/paged.py --size flash --json $OUT/paged.json                 # the H200 run (gpu.sh paged)
    python bench/paged.py --size tiny --json /tmp/paged.json                  # seconds, CPU smoke
    python bench/paged.py --scenario memory --size flash --json /tmp/m.json   # bytes: any machine, seconds
    python bench/paged.py --scenario prefix --size flash --json $OUT/p.json   # a forked prefix (H200)
    python bench/paged.py --render bench/results/<run>.json                   # tables of a past run

``--scenario`` (records' ``scenario``): ``decode`` (the default, ``paged_decode``: below),
``memory`` (``paged_memory``: rows a paged pool holds in a contiguous cache's bytes) and
``prefix`` (``paged_prefix``: a forked prefix and its suffix against the whole prompt's prefill);
those two are described at `run_memory` and `run_prefix`.

Issue 67's targets: paged decode within 1.05x of contiguous decode (B = 1, 8, 32; 16k to 1M), and
a step of S = 4 tokens a row (a speculative step's verification) at most 1.3x a step of one token
(B = 8; 16k and 128k); V4-Flash, bf16, ms a layer of a stack in one jit.

One stack of N layers (`bench/stack.py`'s `Stack`: ``--stacks csa,hca``, N = 4, random weights)
per (stack, B, context) cell decodes from synthetic caches (`Stack.synthetic_caches`: every leaf
random, ``length`` = context) in each variant (records' ``cache``, ``queries_per_step``):

``contiguous``  the default cache, [B, T, D] entries a row.
``paged``       the same values in a paged cache (`dsv4_jax.cache.paged`): pages of ``--page-size``
                tokens, just enough for every row's ``max_seq_len`` (the pool's every page held),
                scattered over the pool by a seeded permutation, as a server's pages end up after
                requests come and go (``--page-order random``, the default; ``in-order``: each row's
                pages one after another in the pool, as a fresh pool's `reserve_pages` hands them
                out: records' ``page_order``). Its entries are the contiguous cache's, copied into
                the pages before either runs.

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
last step against the contiguous variant's (the same computation; 0 on the CPU and on a GPU
with XLA's deterministic flags, else the two programs' GEMMs may be autotuned apart and the fed-back
steps amplify the last bit); ``floor_ms`` the bytes floor a layer of S new tokens (`bench/floor.py`).

``--profile DIR``: each variant's steps are also traced with JAX's profiler (traces under DIR) and
its device time per XLA operation kept in the record's ``profile`` (`bench/kernel_profile.py`:
the stages' totals ``by_source``, the largest operations ``rows``); the tables then add, per
cell, the stages where the paged cache's device time differs from the contiguous one's.

``--deadline-s``: no new cell starts past this many seconds of the run; the cells left are
recorded as skipped (a device call has a hard limit: the records so far are written as they come).
"""

from __future__ import annotations

import argparse
import collections
import functools
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
from bench import plan as plan_mod  # noqa: E402
from bench import stack as stack_mod  # noqa: E402
from dsv4_jax.cache import paged as paged_mod  # noqa: E402
from dsv4_jax.cache.contiguous import HOST_MIRRORS, cache_nbytes, init_attention_cache  # noqa: E402
from dsv4_jax.cache.paged import PagedRows, PageTable  # noqa: E402
from dsv4_jax.config import CSA, HCA  # noqa: E402

CACHES = ("contiguous", "paged")
WARM = 2  # warm-up steps of every variant (the first compiles)


PAGE_ORDERS = ("random", "in-order")


def paged_copies(stack: stack_mod.Stack, caches: list, batch: int, max_seq_len: int, page_size: int,
                 seed: int, page_order: str = "random") -> list:
    """`caches` (the stack's contiguous caches) as paged caches holding the same values: every row
    holds the pages of ``max_seq_len`` tokens, ``batch * ceil(max_seq_len / page_size)`` pages in
    all (the whole pool), the pool's pages handed out in a seeded random order (`page_order`
    "random") or as `reserve_pages` gives them, row after row ("in-order"). The leaves are new
    buffers (the steps donate their caches)."""
    if page_order not in PAGE_ORDERS:
        raise ValueError(f"page_order: expected one of {PAGE_ORDERS}, got {page_order!r}")
    empty = dsv4_jax.reserve_pages(stack.empty_caches(batch, max_seq_len, page_size), max_seq_len)
    pages = next(c.pages for c in empty if c.pages is not None)
    order = (np.random.default_rng(seed).permutation(pages.num_pages) if page_order == "random"
             else np.arange(pages.num_pages)).astype(np.int32)
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
                 steps: int, repeats: int, seed: int, profile_dir: str | None = None) -> tuple[dict, np.ndarray]:
    """One variant's record fields from `caches` (donated), and its hidden states after the last
    step (host float32). `profile_dir`: the timed steps are followed by `steps` traced ones
    (`profile_steps`: a warm-up step and `steps` traced ones, the record's ``profile``; the
    hidden states are then those after them)."""
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
    if profile_dir:
        del h
        timings["profile"] = profile_steps(stack, step, state, steps, profile_dir)
        h = state["h"]
    h_host = np.asarray(h.astype(jnp.float32))
    state.clear()
    del out, h
    return ({**timings, "compile_s": compile_s, "first_call_s": first_s, "max_seq_len": max_seq_len,
             "steps": steps, "repeats": repeats,
             "total_steps": WARM + repeats * steps + steps + (steps + 1 if profile_dir else 0),
             "output_finite": bool(np.isfinite(h_host).all()), "output_digest": stack_mod.digest(h_host),
             **stack.floor(batch, context + queries * (WARM + repeats * steps // 2), queries)}, h_host)


PROFILE_ROWS = 30  # a profiled variant keeps its largest operations (the stages' totals: all)


def profile_steps(stack: stack_mod.Stack, step, state: dict, steps: int, log_dir: str) -> dict:
    """Device time per XLA operation of `steps` more of the variant's steps (`step` advances
    `state`), traced into `log_dir`, with each operation's stage from the compiled step's text
    (`kernel_profile.attach_sources`): ``by_source``, ``rows`` (the largest `PROFILE_ROWS`),
    ``busy_us_per_step``, ``wall_us_per_step``, ``kernels_per_step``."""
    from bench import kernel_profile

    summary = kernel_profile.profile(lambda: jax.block_until_ready(step()), steps, log_dir, module_filter="stack_step")
    compiled = stack.jits["all"].lower(stack.weights, state["caches"], state["h"], specs=stack.specs).compile()
    kernel_profile.attach_sources(summary, compiled.as_text())
    keep = ("op", "us_per_step", "kernels_per_step", "source", "hlo")
    return {"busy_us_per_step": summary["busy_us_per_step"], "wall_us_per_step": summary["wall_us_per_step"],
            "kernels_per_step": summary["kernels_per_step"], "by_source": summary["by_source"],
            "rows": [{k: r[k] for k in keep if k in r} for r in summary["rows"][:PROFILE_ROWS]]}

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


def _keep(records: list, rec: dict, line, write, meta: dict) -> None:
    """A scenario's record kept as it comes: added, its line on stderr, and the records so far
    written (a device call has a hard limit)."""
    records.append(rec)
    print(line(rec), file=sys.stderr, flush=True)
    if write:
        write(records, meta)


def run(args, write=None) -> tuple[list, dict]:
    """The records and meta of ``--scenario``'s run (`write(records, meta)` after every record)."""
    scenarios = {"decode": run_decode, "memory": run_memory, "prefix": run_prefix}
    return scenarios[getattr(args, "scenario", "decode")](args, write)


def run_decode(args, write=None) -> tuple[list, dict]:
    start = time.perf_counter()
    cfg = stack_mod.stack_config(args.size, args.layers_per_stack)
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    numerics = "official" if args.kv_cache_dtype == "fp8" else args.numerics
    env = stack_mod.environment()
    meta = {"size": args.size, "dtype": dtype.name, "argv": sys.argv[1:], "n_layers": args.layers_per_stack,
            "stacks": args.stacks, "caches": list(CACHES), "page_size": args.page_size, "page_order": args.page_order,
            "queries": args.queries,
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
                "mode": args.mode, "dtype": dtype.name, "page_size": args.page_size, "page_order": args.page_order,
                "kv_cache_dtype": args.kv_cache_dtype, "numerics": numerics, **env}
        late = args.deadline_s is not None and time.perf_counter() - start > args.deadline_s
        one_query = {}  # cache -> per_layer_ms at S = 1
        for queries in query_counts:
            total = WARM + args.repeats * args.steps + args.steps + (args.steps + 1 if args.profile else 0)
            max_seq_len = stack_mod._round_up(context + total * queries, math.lcm(128, args.page_size))
            reference = None
            variants = {}
            if not late:
                try:  # both made before either runs (the paged one is a copy of the contiguous one)
                    variants["contiguous"] = stack.synthetic_caches(batch, max_seq_len, context, args.seed)
                    variants["paged"] = paged_copies(stack, variants["contiguous"], batch, max_seq_len,
                                                     args.page_size, args.seed, args.page_order)
                except Exception as err:
                    variants = {"error": report.error_text(err)}
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
                        trace = (None if not args.profile else
                                 f"{args.profile}/{kind}_b{batch}_l{context}_s{queries}_{key}")
                        fields, h = time_variant(stack if attention == "auto" else forced[kind], variants.pop(key),
                                                 batch, queries, context, max_seq_len, args.steps, args.repeats,
                                                 args.seed, trace)
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
                        rec["error"] = report.error_text(err)
                _keep(records, rec, _line, write, meta)
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


def decode_markdown(records: list, meta: dict) -> str:
    """One table: per (stack, B, context, S), each cache's ms a layer, its ratio to the
    contiguous cache and to S = 1, to the floor, the host's dispatch time a step, the compile."""
    out = [f"Paged and contiguous caches, stacks of {meta.get('n_layers')} layers, {meta.get('size')}, "
           f"{meta.get('dtype')}, pages of {meta.get('page_size')} tokens "
           f"({meta.get('page_order', 'random')} over the pool), {meta.get('device')}, "
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
    return "\n".join(out + profile_markdown(records))


def profile_markdown(records: list, top: int = 8) -> list:
    """Per profiled cell (``--profile``): the device time a step of each cache, and the `top`
    stages whose time differs most between the contiguous cache and each other variant."""
    out = []
    cells_seen: dict = collections.defaultdict(dict)
    for r in records:
        if r.get("profile"):
            key = (r["stack"], r["batch"], r["context_len"], r["queries_per_step"])
            cells_seen[key][r["cache"] + (" (kernel)" if r.get("decode_attention") == "pallas" else "")] = r["profile"]
    for (kind, batch, context, queries), by_cache in cells_seen.items():
        base = by_cache.get("contiguous")
        if base is None:
            continue
        for cache, prof in by_cache.items():
            if cache == "contiguous":
                continue
            stages = {s["source"]: [s["us_per_step"], 0.0] for s in base["by_source"]}
            for s in prof["by_source"]:
                stages.setdefault(s["source"], [0.0, 0.0])[1] = s["us_per_step"]
            out += ["", f"Device time a step, {kind} B = {batch}, ctx {context}, S = {queries}: contiguous "
                        f"{base['busy_us_per_step']:.1f} us, {cache} {prof['busy_us_per_step']:.1f} us; the stages "
                        "that differ most:", "", f"| stage | contiguous us | {cache} us | difference |",
                    "|---|---|---|---|"]
            for name, (c, p) in sorted(stages.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))[:top]:
                out.append(f"| {name} | {c:.1f} | {p:.1f} | {p - c:+.1f} |")
    return out


# ---------------------------------------------------------------------------- --scenario memory
GB = 1e9  # tokens_per_gb_*: tokens held per 10**9 bytes of cache
ROWS_TARGET = 3.0  # issue 67: a ragged batch holds at least 3x the rows of a contiguous cache of its bytes


def draw_lengths(seed: int, n: int, low: int, high: int) -> np.ndarray:
    """[n] int64 row lengths, log-uniform over [low, high] tokens: ``round(exp(U(ln low, ln high)))``
    of ``numpy.random.default_rng(seed)``, in the order drawn."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(np.exp(rng.uniform(np.log(low), np.log(high), n))), low, high).astype(np.int64)


@functools.cache
def layer_cache_bytes(cfg, layer_idx: int, batch: int, max_seq_len: int, dtype: str, kv_cache_dtype: str,
                      page_size: int | None = None, num_pages: int | None = None) -> int:
    """Bytes of every leaf of layer `layer_idx`'s empty cache (`init_attention_cache`'s: the
    window ring, the compressors' rings and entries or pools, ``length``, the page table and its
    reference counts), from its shapes (`jax.eval_shape`: nothing allocated)."""
    shapes = jax.eval_shape(functools.partial(
        init_attention_cache, cfg, layer_idx, batch, max_seq_len, jnp.dtype(dtype), allow_long_context=True,
        kv_cache_dtype=kv_cache_dtype, page_size=page_size, num_pages=num_pages))
    return cache_nbytes(shapes)


def layer_groups(cfg) -> dict:
    """{name: {layer index: layers like it}}: one CSA layer, one HCA layer, and the whole config
    ("model": every layer, sliding ones included, each type counted once by its first layer)."""
    first = {}
    for i, t in enumerate(cfg.layer_types):
        first.setdefault(t, i)
    counts = collections.Counter(cfg.layer_types)
    return {"csa": {first[CSA]: 1}, "hca": {first[HCA]: 1}, "model": {i: counts[t] for t, i in first.items()}}


def memory_record(cfg, name: str, group: dict, rows: int, max_seq_len: int, page_size: int, lengths: np.ndarray,
                  dtype: str, kv_cache_dtype: str, mean: tuple[float, float]) -> dict:
    """One record of the memory scenario (see `run_memory`) for the layers `group`; `mean`: the
    tokens and the pages a row of the lengths' distribution holds on average."""
    mean_length, mean_pages = mean
    def total(batch, paging=(None, None)):
        return sum(n * layer_cache_bytes(cfg, i, batch, max_seq_len, dtype, kv_cache_dtype, *paging)
                   for i, n in group.items())

    pages = np.cumsum(-(-lengths // page_size))  # pages[k - 1]: the pages of the first k rows
    budget = total(rows)

    def paged_bytes(k):
        return total(k, (page_size, int(pages[k - 1])))

    if paged_bytes(len(lengths)) <= budget:
        raise ValueError(f"lengths: all {len(lengths)} rows drawn fit in {budget} bytes; draw more")
    lo, hi = 0, len(lengths)  # paged_bytes(lo) <= budget < paged_bytes(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if paged_bytes(mid) <= budget else (lo, mid)
    fit = lo
    bytes_paged = paged_bytes(fit) if fit else 0
    tokens_contiguous, tokens_paged = int(lengths[:rows].sum()), int(lengths[:fit].sum())
    types = collections.Counter({cfg.layer_types[i]: n for i, n in group.items()})
    # Bytes are linear in rows and pages: a row's own (ring, window, table row), a page's, the rest.
    page = total(1, (page_size, 2)) - total(1, (page_size, 1))
    row = total(2, (page_size, 1)) - total(1, (page_size, 1))
    rest = total(1, (page_size, 1)) - row - page
    expected = (budget - rest) / (row + mean_pages * page)  # rows of the distribution's mean pages
    return {
        "layers": name, "layer_counts": {plan_mod.SHORT[t]: n for t, n in types.items()},
        "n_layers": sum(group.values()), "max_seq_len": max_seq_len, "page_size": page_size,
        "rows_contiguous": rows, "bytes_contiguous": budget, "tokens_contiguous": tokens_contiguous,
        "rows_paged": fit, "pages_paged": int(pages[fit - 1]) if fit else 0, "bytes_paged": bytes_paged,
        "tokens_paged": tokens_paged, "rows_ratio": fit / rows,
        "tokens_per_gb_contiguous": tokens_contiguous / (budget / GB),
        "tokens_per_gb_contiguous_full": rows * max_seq_len / (budget / GB),
        "tokens_per_gb_paged": tokens_paged / (bytes_paged / GB) if fit else 0.0,
        "tokens_per_gb_ratio": (tokens_paged / bytes_paged) / (tokens_contiguous / budget) if fit else 0.0,
        "bytes_per_row_contiguous": budget / rows, "bytes_per_page": page, "bytes_per_row_paged": row,
        "mean_length_paged": tokens_paged / fit if fit else 0.0, "mean_length_expected": mean_length,
        "mean_pages_expected": mean_pages, "rows_ratio_expected": expected / rows,
        "tokens_per_gb_contiguous_expected": rows * mean_length / (budget / GB),
        "tokens_per_gb_paged_expected": mean_length / ((row + mean_pages * page) / GB),
        "rows_ratio_target": ROWS_TARGET, "meets_target": fit / rows >= ROWS_TARGET,
    }


def run_memory(args, write=None) -> tuple[list, dict]:
    """``--scenario memory``: how many rows of a ragged batch a paged cache holds in the bytes of
    a contiguous one (issue 67: at least 3x), counted, not timed (any machine, nothing allocated).

    A contiguous cache of ``--memory-rows`` N rows reserves ``--memory-max-len`` (1M) tokens a
    row: its bytes are the budget. The ragged rows' lengths are drawn log-uniformly over
    [``--memory-min-len``, ``--memory-max-len``] (1k to 1M; `draw_lengths`, ``--seed``); the paged
    cache (pages of ``--page-size``, 256; the table as wide as ``max_seq_len`` = the max length)
    holding the first k of them has a pool of just their pages: ``rows_paged`` is the largest k
    whose cache fits the budget. Bytes are every leaf of the caches' `init_cache` (window ring,
    compressor rings, entries or pools, ``length``, page table and reference counts; each layer
    holds its own copy of the table) from their shapes (`jax.eval_shape`). Per layer group (one
    CSA layer, one HCA layer, the config's every layer: ``layers`` csa / hca / model) and cache
    format (bf16 rows, FP8 rows: ``kv_cache_dtype`` auto / fp8, the format official numerics
    uses): ``rows_ratio`` = rows_paged / N, and ``tokens_per_gb_*`` the tokens held per 10**9
    bytes (contiguous: its N rows drawn from the same lengths, ``_full`` at max length each).
    A few dozen rows drawn make a noisy ratio (the lengths spread over three decades):
    ``rows_ratio_expected`` and ``tokens_per_gb_*_expected`` are the figures at a row's mean
    tokens and pages over 2**20 draws (the limit of many rows)."""
    cfg = plan_mod.config_for(args.size)
    dtype = jnp.dtype(args.dtype or "bfloat16").name
    lengths = draw_lengths(args.seed, max(4096, 256 * args.memory_rows), args.memory_min_len, args.memory_max_len)
    many = draw_lengths(args.seed + 1, 1 << 20, args.memory_min_len, args.memory_max_len)
    mean = (float(np.mean(many)), float(np.mean(-(-many // args.page_size))))
    distribution = (f"log-uniform over [{args.memory_min_len}, {args.memory_max_len}] tokens: "
                    f"round(exp(uniform(ln {args.memory_min_len}, ln {args.memory_max_len}))), "
                    f"numpy default_rng({args.seed}), rows in the order drawn")
    env = stack_mod.environment()
    meta = {"scenario": "memory", "size": args.size, "dtype": dtype, "argv": sys.argv[1:],
            "page_size": args.page_size, "rows_contiguous": args.memory_rows, "max_seq_len": args.memory_max_len,
            "length_distribution": distribution, "gb_bytes": GB, **env}
    records = []
    for kv in ("auto", "fp8"):
        for name, group in layer_groups(cfg).items():
            rec = {"scenario": "paged_memory", "size": args.size, "dtype": dtype, "kv_cache_dtype": kv,
                   "numerics": "official" if kv == "fp8" else "reference", "length_distribution": distribution,
                   "length_min": args.memory_min_len, "length_max": args.memory_max_len, "length_seed": args.seed,
                   "error": None, **env}
            try:
                rec.update(memory_record(cfg, name, group, args.memory_rows, args.memory_max_len, args.page_size,
                                         lengths, dtype, kv, mean))
            except Exception as err:
                rec["error"] = report.error_text(err)
            _keep(records, rec, _memory_line, write, meta)
    return records, meta


def _memory_line(rec: dict) -> str:
    head = f"paged_memory {rec.get('layers')} {rec['kv_cache_dtype']}"
    if rec.get("error"):
        return f"{head}: ERROR {rec['error']}"
    return (f"{head}: {rec['rows_paged']} ragged rows in the bytes of {rec['rows_contiguous']} contiguous "
            f"({rec['bytes_contiguous'] / GB:.2f} GB), x{rec['rows_ratio']:.2f}; tokens/GB "
            f"{rec['tokens_per_gb_paged']:.0f} paged, {rec['tokens_per_gb_contiguous']:.0f} contiguous")


def memory_markdown(records: list, meta: dict) -> str:
    out = [f"Ragged rows in a paged pool against a contiguous cache of the same bytes, {meta.get('size')}, "
           f"{meta.get('dtype')}, pages of {meta.get('page_size')} tokens, max_seq_len {meta.get('max_seq_len')}; "
           f"lengths {meta.get('length_distribution')}", "",
           "| layers | cache | GB | rows contiguous | rows paged | x rows | x rows expected | tokens / GB contiguous | "
           "tokens / GB paged | x tokens / GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        cell = f"| {r.get('layers')} | {r['kv_cache_dtype']} |"
        if r.get("error"):
            out.append(f"{cell} {r['error'][:80]} | | | | | | | |")
            continue
        out.append(f"{cell} {r['bytes_contiguous'] / GB:.2f} | {r['rows_contiguous']} | {r['rows_paged']} | "
                   f"{r['rows_ratio']:.2f} | {r['rows_ratio_expected']:.2f} | {r['tokens_per_gb_contiguous']:.0f} | "
                   f"{r['tokens_per_gb_paged']:.0f} | "
                   f"{r['tokens_per_gb_ratio']:.2f} |")
    return "\n".join(out)


# ---------------------------------------------------------------------------- --scenario prefix
PREFIX_TARGET = 0.10  # issue 67: fork + the suffix at most 10% of the full prefill's time


def row_of(cache, row: int):
    """Row `row` of a paged cache as a cache of one row: its per-row fields, its page table row,
    the whole pools (shared, not copied) and reference counts. What the suffix's step runs on,
    so that it costs a step of one row as the full prefill does."""
    one = paged_mod.map_rows(lambda c: jax.tree.map(lambda a: a[row:row + 1], c), cache)
    return one.replace(pages=cache.pages.replace(table=cache.pages.table[row:row + 1]))


def put_row(cache, row: int, one):
    """`cache` with row `row` set to the one-row cache `one` (`row_of`'s, after a step) and the
    pools `one` holds (the step wrote the row's pages there); the page table as `cache` has it,
    ``length`` (and ``rewindable``) back as host mirrors, as an eager cache keeps them."""
    parts = [p for p in ("compressor", "indexer") if getattr(cache, p) is not None]

    def per_row(c):
        return c.replace(pages=None, **{p: getattr(c, p).replace(entries=None) for p in parts})

    rows = jax.tree.map(lambda a, b: jnp.asarray(a).at[row].set(b[0]), per_row(cache), per_row(one))
    mirrors = {name: np.asarray(getattr(rows, name)) for name in HOST_MIRRORS if getattr(rows, name) is not None}
    return rows.replace(pages=cache.pages, **mirrors,
                        **{p: getattr(rows, p).replace(entries=getattr(one, p).entries) for p in parts})


def pool_bytes(caches) -> int:
    """Bytes of the caches' pools (every layer's compressor and indexer entries)."""
    return sum(a.nbytes for c in caches for part in ("compressor", "indexer") if getattr(c, part) is not None
               for a in jax.tree.leaves(getattr(c, part).entries))


def _copy(caches):
    """New buffers of every leaf (host mirrors stay NumPy): the steps donate their caches."""
    return jax.block_until_ready(jax.tree.map(lambda a: a.copy() if isinstance(a, np.ndarray) else jnp.copy(a),
                                              caches))


def prompt_calls(x, start: int, chunk: int | None) -> list:
    """[(hidden [1, n, hidden], positions [1, n])]: the prompt `x` (tokens from `start`) as one
    call, or calls of `chunk` tokens (the last one shorter), on the device before any clock."""
    n = x.shape[1]
    step = chunk or n
    return jax.block_until_ready([(x[:, s:s + step], stack_mod._positions(1, start + s, min(step, n - s)))
                                  for s in range(0, n, step)])


def prefill_calls(stack: stack_mod.Stack, caches, calls: list):
    """The stack's jitted step over `calls` (caches donated from call to call): (the hidden
    states of every call, the caches), blocked."""
    outs = []
    for h, pos in calls:
        h, caches = stack.jits[None](stack.weights, caches, h, pos, specs=stack.specs)
        outs.append(h)
    return jax.block_until_ready((outs, caches))


def time_prefix(stack: stack_mod.Stack, prompt: int, prefix: int, page_size: int, repeats: int, seed: int,
                chunk: int | None = None, stop_at: float | None = None, pool_rows: int = 2) -> dict:
    """The fields of one prefix record (see `run_prefix`)."""
    if not 0 < prefix < prompt:
        raise ValueError(f"--prefix-len: expected 0 < prefix < prompt ({prompt}), got {prefix}")
    max_seq_len = stack_mod._round_up(prompt, math.lcm(128, page_size))
    x = stack_mod._hidden(stack.cfg, 1, prompt, stack.dtype, seed)
    full_calls, suffix_calls = prompt_calls(x, 0, chunk), prompt_calls(x[:, prefix:], prefix, chunk)
    clock = measure.compile_clock()
    clock.start()
    t0 = time.perf_counter()
    # The prefix: row 0 of a two-row cache (a pool of `pool_rows` rows' pages), prefilled as a row
    # of its own (untimed).
    num_pages = pool_rows * -(-max_seq_len // page_size)
    two = [a.init_cache(2, max_seq_len, allow_long_context=True, kv_cache_dtype=stack.kv_cache_dtype,
                        page_size=page_size, num_pages=num_pages).replace(layer_idx=-1) for a in stack.layers]
    two = dsv4_jax.reserve_pages(two, np.array([prefix, 0]))
    _, ones = prefill_calls(stack, [row_of(c, 0) for c in two], prompt_calls(x[:, :prefix], 0, chunk))
    source = jax.block_until_ready([put_row(c, 0, o) for c, o in zip(two, ones)])
    del two, ones

    def full():
        caches = jax.block_until_ready(stack.empty_caches(1, max_seq_len, page_size))
        t0 = time.perf_counter()
        caches = jax.block_until_ready(dsv4_jax.reserve_pages(caches, prompt, donate=True))
        t1 = time.perf_counter()
        outs, _ = prefill_calls(stack, caches, full_calls)
        return (t1 - t0, time.perf_counter() - t1), outs

    def forked():
        caches = _copy(source)
        t0 = time.perf_counter()
        caches = jax.block_until_ready(dsv4_jax.fork_rows(caches, 0, 1, donate=True))  # the stack, one call
        t1 = time.perf_counter()
        caches = jax.block_until_ready(dsv4_jax.reserve_pages(caches, np.array([0, prompt - prefix]), donate=True))
        t2 = time.perf_counter()
        stats = {"shared_pages": int((np.asarray(caches[0].pages.refs) > 1).sum()),
                 "suffix_pages": int((np.asarray(caches[0].pages.table[1]) >= 0).sum())}
        view = jax.block_until_ready([row_of(c, 1) for c in caches])  # the benchmark's, not the user's: untimed
        del caches
        t3 = time.perf_counter()
        outs, _ = prefill_calls(stack, view, suffix_calls)
        return (t1 - t0, t2 - t1, time.perf_counter() - t3), outs, stats

    full()  # the warm-up: every program compiled (the steps, fork_rows', reserve_pages' zeroing)
    forked()
    first_s = time.perf_counter() - t0
    compile_s = clock.stop()
    # The same suffix on the prefix row itself (no fork): the fork is exact where they are equal.
    unforked = dsv4_jax.reserve_pages(_copy(source), np.array([prompt - prefix, 0]))
    reference, _ = prefill_calls(stack, [row_of(c, 0) for c in unforked], suffix_calls)
    del unforked
    full_times, fork_times = [], []
    for i in range(repeats):  # interleaved: a drift of the machine moves both alike
        if i and stop_at is not None and time.perf_counter() > stop_at:
            break
        times, full_outs = full()
        full_times.append(times)
        times, suffix_outs, stats = forked()
        fork_times.append(times)
    host = lambda outs: np.asarray(jnp.concatenate(outs, axis=1).astype(jnp.float32))  # noqa: E731
    whole, suffix, reference = host(full_outs), host(suffix_outs), host(reference)
    n = len(stack.layers)
    ms = lambda times, k: 1e3 * float(np.median([t[k] for t in times]))  # noqa: E731
    out = {"full_reserve_ms": ms(full_times, 0), "full_prefill_ms": ms(full_times, 1),
           "fork_ms": ms(fork_times, 0), "reserve_ms": ms(fork_times, 1), "suffix_ms": ms(fork_times, 2)}
    out.update({f"{key}_per_layer": value / n for key, value in list(out.items())})
    out["ratio_to_full"] = (out["fork_ms"] + out["suffix_ms"]) / out["full_prefill_ms"]
    out["ratio_to_full_with_pages"] = ((out["fork_ms"] + out["reserve_ms"] + out["suffix_ms"])
                                       / (out["full_reserve_ms"] + out["full_prefill_ms"]))
    tail = whole[:, prefix:]
    full_floor, suffix_floor = stack.floor(1, 0, prompt), stack.floor(1, prefix, prompt - prefix)
    return {**out, "full_prefill_ms_repeats": [1e3 * t[1] for t in full_times],
            "fork_ms_repeats": [1e3 * t[0] for t in fork_times],
            "suffix_ms_repeats": [1e3 * t[2] for t in fork_times],
            "max_abs_diff_to_unforked": float(np.max(np.abs(suffix - reference))),
            "max_abs_diff_to_full": float(np.max(np.abs(suffix - tail))),
            "max_rel_diff_to_full": float(np.max(np.abs(suffix - tail)) / max(float(np.max(np.abs(tail))), 1e-30)),
            "output_finite": bool(np.isfinite(whole).all() and np.isfinite(suffix).all()),
            "output_digest": stack_mod.digest(suffix),
            "full_floor_ms": full_floor["floor_ms"], "suffix_floor_ms": suffix_floor["floor_ms"],
            "floor_ratio": suffix_floor["floor_ms"] / full_floor["floor_ms"],
            "compile_s": compile_s, "first_call_s": first_s, "repeats": len(full_times),
            "max_seq_len": max_seq_len, "num_pages": num_pages, "pool_rows": pool_rows,
            "pool_bytes": pool_bytes(source), **stats,
            "chunk": chunk, "full_calls": len(full_calls), "suffix_calls": len(suffix_calls)}


def run_prefix(args, write=None) -> tuple[list, dict]:
    """``--scenario prefix``: a prompt of ``--prompt-len`` P tokens (64k) whose first
    ``--prefix-len`` F (60k) are already in row 0 of a paged cache (issue 67: fork + the suffix
    at most 10% of the full prefill's time). Per stack of ``--stacks`` (`bench/stack.py`'s, N
    layers in one jit, random weights), B = 1, pages of ``--page-size``:

    ``full_prefill_ms``  the stack's jitted step over the P tokens into an empty paged cache of
                         one row (one call, as `bench/stack.py`'s prefill; ``--prefill-chunk``:
                         calls of that many tokens, the caches donated from call to call), after
                         `dsv4_jax.reserve_pages` for P tokens (``full_reserve_ms``).
    ``fork_ms``          `dsv4_jax.fork_rows` of the stack's list of caches in one call, the
                         prefix row 0 into the empty row 1 of a two-row cache (prefilled before,
                         untimed), as a server calls it: eager, its host work (one page decision
                         for the stack's table) included, every layer's copied pages in one
                         compiled program and the per-row fields in one more, the pools written
                         in place (``donate=True``, as a server forks; so does every
                         `reserve_pages` here). ``fork_ms_per_layer`` is that call's time / N.
    ``reserve_ms``       `dsv4_jax.reserve_pages` of the suffix's pages for row 1, the stack's
                         list in one call (every layer's zeroing in one program).

    The two-row cache's pool holds ``--pool-rows`` (2) rows of ``max_seq_len`` (``pool_bytes``):
    `fork_rows` (where it copies a page) and `reserve_pages` (zeroing the pages taken) write the
    pools eagerly, in place here (``donate=True``; without it each whole pool is copied and their
    time follows the pool's size): ``--pool-rows 64`` measures a server's larger pool.
    ``suffix_ms``        the step over the P - F suffix tokens on the forked row: row 1 as a cache
                         of one row (`row_of`: its per-row fields, its table row, the shared pools),
                         so that it costs a B = 1 step as the full prefill does.

    Timings are blocking (`jax.block_until_ready`), the compile apart (one warm-up of each, its
    time ``compile_s``), medians over ``--repeats`` (the two interleaved; none started past
    ``--deadline-s`` after the first). ``ratio_to_full`` = (fork + suffix) / full, target <= 0.10;
    ``ratio_to_full_with_pages`` counts both sides' reserve_pages too; ``floor_ratio`` the bytes /
    FLOPs floor's ratio of the suffix to the whole prompt (`bench/floor.py`). Each also a layer:
    ``*_per_layer`` = the stack's / N. ``max_abs_diff_to_unforked``: the forked row's suffix
    outputs against the same suffix prefilled on the prefix row itself (0: the fork is exact);
    ``max_abs_diff_to_full`` (and ``max_rel_diff_to_full``, over the largest output): against
    the full prefill's last P - F outputs (a prompt in two calls against one call: equal to the
    rounding of the chunking, ~1e-7 relative in float32 on the CPU)."""
    start = time.perf_counter()
    cfg = stack_mod.stack_config(args.size, args.layers_per_stack)
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    numerics = "official" if args.kv_cache_dtype == "fp8" else args.numerics
    env = stack_mod.environment()
    meta = {"scenario": "prefix", "size": args.size, "dtype": dtype.name, "argv": sys.argv[1:],
            "n_layers": args.layers_per_stack, "stacks": args.stacks, "page_size": args.page_size,
            "prompt_len": args.prompt_len, "prefix_len": args.prefix_len, "prefill_chunk": args.prefill_chunk,
            "pool_rows": args.pool_rows,
            "mode": args.mode, "kv_cache_dtype": args.kv_cache_dtype, "numerics": numerics,
            "deadline_s": args.deadline_s, **env}
    stop_at = None if args.deadline_s is None else start + args.deadline_s
    records: list[dict] = []
    for kind in args.stacks.split(","):
        rec = {"scenario": "paged_prefix", "size": args.size, "stack": kind, "batch": 1,
               "prompt_len": args.prompt_len, "prefix_len": args.prefix_len,
               "suffix_len": args.prompt_len - args.prefix_len, "page_size": args.page_size, "mode": args.mode,
               "dtype": dtype.name, "kv_cache_dtype": args.kv_cache_dtype, "numerics": numerics, "error": None, **env}
        if stop_at is not None and time.perf_counter() > stop_at:
            rec["error"] = f"skipped: past --deadline-s {args.deadline_s:g} s"
        else:
            try:
                stack = stack_mod.Stack(cfg, kind, args.layers_per_stack, dtype, args.seed, args.mode,
                                        numerics=numerics, kv_cache_dtype=args.kv_cache_dtype)
                rec.update({"layer_type": stack.layer_type, "n_layers": len(stack.layers),
                            "layer_indices": stack.indices})
                rec.update(time_prefix(stack, args.prompt_len, args.prefix_len, args.page_size, args.repeats,
                                       args.seed, args.prefill_chunk, stop_at, args.pool_rows))
                rec["ratio_target"] = PREFIX_TARGET
                rec["meets_target"] = rec["ratio_to_full"] <= PREFIX_TARGET
                del stack
            except Exception as err:
                rec["error"] = report.error_text(err)
        _keep(records, rec, _prefix_line, write, meta)
    return records, meta


def _prefix_line(rec: dict) -> str:
    head = f"paged_prefix {rec['stack']} P{rec['prompt_len']} F{rec['prefix_len']}"
    if rec.get("error"):
        return f"{head}: ERROR {rec['error']}"
    return (f"{head}: fork {rec['fork_ms']:.3f} + suffix {rec['suffix_ms']:.3f} ms against full "
            f"{rec['full_prefill_ms']:.3f} ms (stack of {rec['n_layers']}): x{rec['ratio_to_full']:.4f} "
            f"(floor x{rec['floor_ratio']:.4f}); reserve {rec['reserve_ms']:.3f} / {rec['full_reserve_ms']:.3f} ms; "
            f"diff {rec['max_abs_diff_to_unforked']:.1e} unforked, {rec['max_abs_diff_to_full']:.1e} full; "
            f"compile {rec['compile_s']:.1f} s")


def prefix_markdown(records: list, meta: dict) -> str:
    out = [f"A forked prefix and its suffix against the whole prompt's prefill, stacks of {meta.get('n_layers')}, "
           f"{meta.get('size')}, {meta.get('dtype')}, pages of {meta.get('page_size')} tokens, B = 1, "
           f"{meta.get('device')}, jax {meta.get('jax_version')}", "",
           "| stack | prompt | prefix | fork ms / layer | suffix ms / layer | full ms / layer | x full | x floor's | "
           "reserve ms (suffix / full) | max diff unforked | max diff full | compile s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        cell = f"| {r['stack']} | {r['prompt_len']} | {r['prefix_len']} |"
        if r.get("error"):
            out.append(f"{cell} {r['error'][:80]} | | | | | | | | |")
            continue
        out.append(f"{cell} {r['fork_ms_per_layer']:.3f} | {r['suffix_ms_per_layer']:.3f} | "
                   f"{r['full_prefill_ms_per_layer']:.3f} | {r['ratio_to_full']:.4f} | {r['floor_ratio']:.4f} | "
                   f"{r['reserve_ms']:.3f} / {r['full_reserve_ms']:.3f} | {r['max_abs_diff_to_unforked']:.1e} | "
                   f"{r['max_abs_diff_to_full']:.1e} | {r['compile_s']:.1f} |")
    return "\n".join(out)


def markdown(records: list, meta: dict) -> str:
    """The tables of a run, one per scenario its records hold (records without one: decode)."""
    tables = {"paged_decode": decode_markdown, "paged_memory": memory_markdown, "paged_prefix": prefix_markdown}
    parts = []
    for scenario, table in tables.items():
        rows = [r for r in records if r.get("scenario", "paged_decode") == scenario]
        if rows:
            parts.append(table(rows, meta))
    return "\n\n".join(parts)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=("tiny", "small", "flash"))
    ap.add_argument("--scenario", default="decode", choices=("decode", "memory", "prefix"),
                    help="decode: paged against contiguous decode (the default); memory: ragged rows a paged pool "
                         "holds in a contiguous cache's bytes (run_memory); prefix: fork + suffix against the "
                         "whole prompt's prefill (run_prefix)")
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
    ap.add_argument("--page-order", default="random", choices=PAGE_ORDERS,
                    help="decode: the paged cache's pages over the pool, a seeded permutation (default) or "
                         "each row's one after another")
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
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="decode: also trace each variant's steps into DIR; the device time per XLA operation and "
                         "stage goes into its record (profile) and the tables")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no new cell past this many seconds of the run (the rest recorded as skipped)")
    ap.add_argument("--memory-rows", type=int, default=8,
                    help="memory: rows of the contiguous cache whose bytes are the budget (default 8)")
    ap.add_argument("--memory-min-len", type=int, default=1024, help="memory: shortest ragged row (default 1024)")
    ap.add_argument("--memory-max-len", type=int, default=1 << 20,
                    help="memory: longest ragged row and max_seq_len of both caches (default 1048576)")
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="prefix: tokens of the prompt (default 65536; tiny 256)")
    ap.add_argument("--prefix-len", type=int, default=None,
                    help="prefix: tokens of it already in the prefix row (default 61440; tiny 192)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefix: prefill in calls of this many tokens (default: one call, as bench/stack.py)")
    ap.add_argument("--pool-rows", type=int, default=2,
                    help="prefix: the forked cache's pool, in rows of max_seq_len (default 2: its two rows; more: a "
                         "server's pool, which fork_rows and reserve_pages write in place here)")
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
    args.prompt_len = args.prompt_len or (256 if tiny else 65536)
    args.prefix_len = args.prefix_len or (192 if tiny else 61440)


def main(argv=None) -> int:
    return report.scenario_main(argv, build_parser, fill_defaults, run, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
