"""bench/RESULTS.md: where the package stands now, generated from the records it cites.

    python bench/results_table.py            # print the page
    python bench/results_table.py --write    # write bench/RESULTS.md

`SOURCES` is the list of cited records (each a JSON file under bench/results/ with the command,
the machine and the commit that added it); every figure of the page is read from one of them by
the extractor named in its entry, nothing typed in by hand. To move a figure forward, add the new
record, point its entry (or a new one) at it, and write the page; `tests/bench/test_results_table.py`
checks that the committed page is this script's output. The sections from "## Training (issue 28)"
on are written by hand and kept as they are by `--write`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "bench" / "RESULTS.md"
H200 = "1x NVIDIA H200 (`nvidia-h200`), jax 0.11.2, Python 3.12.3"
H100 = "1x NVIDIA H100 80GB HBM3 (`nvidia-h100-x1`), jax 0.11.2, Python 3.12.3"
H200X2 = "2x NVIDIA H200, NVLink (`nvidia-h200-x2`), jax 0.11.2, Python 3.12.3"
CPU = "2-core shared dev box (CPU), jax 0.10.2, Python 3.11"

Row = tuple[str, str, str]  # case, figure, note


def _ctx(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 else str(n)


def stack(records: list[dict]) -> Iterator[Row]:
    """bench/stack.py: ms a layer of a stack of 4 in one jit, x its floor; the module call."""
    for r in records:
        if r.get("scenario") == "stack_decode" and not r.get("error"):
            yield (f"decode, {r['stack']} x{r['n_layers']}, B = {r['batch']}, {_ctx(r['context_len'])}",
                   f"{r['per_layer_ms']:.3f} ms a layer ({r['ratio_to_floor']:.2f}x the bytes floor)",
                   f"host {r['host_dispatch_ms']:.2f} ms a step" if r.get("host_dispatch_ms") else "")
    for r in records:
        if r.get("scenario") == "stack_prefill" and not r.get("error"):
            yield (f"prefill, {r['stack']} x{r['n_layers']}, B = {r['batch']}, {_ctx(r['prompt_len'])}",
                   f"{r['per_layer_ms']:.3f} ms a layer ({r['ratio_to_floor']:.2f}x the FLOP floor)", "")
    for r in records:
        if r.get("scenario") == "call_overhead":
            default = r.get("finite_verdict_auto", "guard")  # before the key: the guard
            guard = r.get("module_call_guard_ms", r["module_call_ms"] if default == "guard" else None)
            ways = ([f"the step's flag {r['module_call_flag_ms']:.3f}"] if r.get("flag_words") else []) + (
                [f"the guard program {guard:.3f}"] if guard is not None else [])
            yield (f"module call, {r['size']} {r['layer_type']} decode, B = {r['batch']}",
                   f"jitted step {r['jit_step_ms']:.3f} ms; the call with check_finite=True by "
                   + ", ".join(ways) + f"; \"host\" {r['module_call_host_check_ms']:.3f}, False "
                   f"{r['module_call_no_check_ms']:.3f} ms",
                   f"check_finite=True's way by default when recorded: the {default}")


def long_prefill(records: list[dict]) -> Iterator[Row]:
    """bench/stack.py stack_prefill with --prefill-chunk: ms a layer, x the FLOP floor, the chunks, peak memory."""
    for r in records:
        if r.get("scenario") == "stack_prefill" and not r.get("error"):
            chunks = (f"{r['chunks']} calls of {r['chunk']:,} tokens" if r.get("chunks", 1) > 1
                      else "one call")
            peak = r.get("peak_bytes_in_use")
            yield (f"prefill, {r['stack']} x{r['n_layers']}, B = {r['batch']}, {_ctx(r['prompt_len'])}",
                   f"{r['per_layer_ms']:.1f} ms a layer ({r['ratio_to_floor']:.2f}x the FLOP floor)",
                   f"{chunks}; compile {r['compile_s']:.0f} s"
                   + (f"; process peak {peak / 2**30:.1f} GiB" if peak else ""))


def break_modes(records: list[dict]) -> Iterator[Row]:
    """bench/run.py without peers: the compiled step of each mode, and its ratio to `none`'s."""
    none = {(r["scenario"], r["batch"]): r for r in records if r["mode"] == "none" and not r.get("error")}
    for r in records:
        if r["mode"] == "none" or r.get("error") or r.get("skipped"):
            continue
        base = none.get((r["scenario"], r["batch"]))
        step = r.get("raw_step_ms_median") or r["decode_ms_median"]
        case = "PR-like decode" if r["scenario"] == "decode_pr" else f"decode at {_ctx(r['context_len'])}"
        ratio = f" ({step / (base.get('raw_step_ms_median') or base['decode_ms_median']):.2f}x none)" if base else ""
        kind = "compiled step" if r.get("raw_step_ms_median") else "module call"
        yield (f"{r['layer_type']} {case}, B = {r['batch']}, {r['mode']}", f"{step:.3f} ms a step{ratio}", kind)


def topk(records: list[dict]) -> Iterator[Row]:
    """bench/topk.py --device-time: kernel time per operation, native (graph) against XLA."""
    xla = {}
    for r in records:
        key = (r["case"], r.get("rows"), r.get("batch"), r["slots"])
        if r["variant"].startswith("xla"):
            xla[key] = r["device_us_per_op"]
    for r in records:
        key = (r["case"], r.get("rows"), r.get("batch"), r["slots"])
        if r["variant"] == "native-graph" and key in xla:
            shape = (f"{r['rows']} x {r['slots']}" if r["case"] == "topk"
                     else f"scoring + top-k, B = {r['batch']}, T = {r['slots']}")
            yield (f"{r['case']} {shape}, k = {r['top_k']}",
                   f"{r['device_us_per_op']:.1f} us (XLA {xla[key]:.1f} us)", "kernel time")


def peers(records: list[dict]) -> Iterator[Row]:
    """bench/run.py with the peers: our compiled step (decode) or call (prefill) against MaxText
    and HF transformers, same weights and inputs."""
    by = {}
    for r in records:
        by[(r["scenario"], r["layer_type"], r["prompt_len"], r["batch"], r["mode"])] = r
    for (scenario, layer, length, batch, mode), r in by.items():
        if mode != "none" or r.get("error"):
            continue
        mt = by.get((scenario, layer, length, batch, "maxtext-jax"))
        hf = by.get((scenario, layer, length, batch, "hf-torch"))

        def ms(p, key):
            if p is None or p.get("error") or p.get("skipped") or p.get(key) is None:
                return "not run"
            return f"{p[key]:.3g}"
        if scenario == "prefill":
            case, key, ours = f"{layer} prefill {_ctx(r['prompt_len'])}, B = {batch}", "prefill_ms", r["prefill_ms"]
        else:
            where = "PR-like" if scenario == "decode_pr" else f"at {_ctx(r['context_len'])}"
            case, key, ours = f"{layer} decode {where}, B = {batch}", "decode_ms_median", r["raw_step_ms_median"]
        yield (case, f"ours {ours:.3g} ms, MaxText {ms(mt, key)}, HF {ms(hf, key)}",
               "ours: compiled step" if scenario != "prefill" else "ours: module call")


def sharded(records: list[dict]) -> Iterator[Row]:
    """bench/sharded.py: one GPU against a mesh over two, same layer and inputs."""
    one = {(r["scenario"], r["layer_type"], r["mode"], r["batch"]): r for r in records if r["mesh"] == "1"}
    for r in records:
        base = one.get((r["scenario"], r["layer_type"], r["mode"], r["batch"]))
        if r["mesh"] == "1" or base is None:
            continue
        what = "decode" if r["scenario"] == "sharded_decode" else f"prefill {_ctx(r['new_tokens'])}"
        mode = r["mode"] + (f" ({r['break_on']})" if r.get("break_on") else "")
        yield (f"{r['layer_type']} {mode}, {what}, B = {r['batch']}, mesh {r['mesh']}",
               f"{r['step_ms']:.3g} ms against {base['step_ms']:.3g} on one GPU "
               f"({base['step_ms'] / r['step_ms']:.2f}x)", "")


def ragged(records: list[dict]) -> Iterator[Row]:
    """bench/ragged.py: a ragged call against the same shape with every slot real."""
    for r in records:
        if not r.get("error"):
            yield (f"{r['layer_type']} [B = {r['batch']}, {r['prefill']}] mix, {r['mode']}",
                   f"{r['ragged_vs_padded']:.2f}x the padded call", "")


def loops(records: list[dict]) -> Iterator[Row]:
    """bench/loops.py: the decode loops users write, side by side in one process (issue 68)."""
    for r in records:
        case = f"{r['stack']} x{r['n_layers']}, B = {r['batch']}, {_ctx(r['context_len'])}: {r['loop']}"
        if r.get("error"):
            yield case, "not run", str(r["error"]).split(":")[0]
        else:
            yield (case, f"{r['per_layer_ms']:.3f} ms a layer, {r['ratio_to_same_buffers']:.2f}x the same-buffers "
                         f"loop ({r['ratio_to_floor']:.2f}x the bytes floor)",
                   f"host {r['host_dispatch_ms']:.2f} ms a step")


def paged(records: list[dict]) -> Iterator[Row]:
    """bench/paged.py: paged caches against contiguous ones, S tokens a row against one (issue 67:
    within 1.05x; an S = 4 step at most 1.3x an S = 1 step)."""
    for r in records:
        s = r["queries_per_step"]
        case = f"{r['stack']} x{r['n_layers']}, B = {r['batch']}, {_ctx(r['context_len'])}, S = {s}: {r['cache']}"
        case += " (decode kernel forced)" if r.get("decode_attention") == "pallas" else ""
        case += " (pages in order)" if r["cache"] == "paged" and r.get("page_order") == "in-order" else ""
        if r.get("error"):
            yield case, "not run", str(r["error"]).split(":")[0]
            continue
        figure = f"{r['per_layer_ms']:.3f} ms a layer, {r['ratio_to_contiguous']:.3f}x contiguous"
        if s != 1 and r.get("ratio_to_one_query") is not None:
            figure += f", {r['ratio_to_one_query']:.2f}x S = 1"
        yield case, figure, f"max diff to contiguous {r['max_abs_diff_to_contiguous']:.1e}"


def paged_memory(records: list[dict]) -> Iterator[Row]:
    """bench/paged.py --scenario memory: the rows of a ragged batch a paged pool holds in a
    contiguous cache's bytes (issue 67: at least 3x), tokens per GB."""
    for r in records:
        if r.get("error"):
            continue
        cache = "bf16" if r["kv_cache_dtype"] == "auto" else r["kv_cache_dtype"]
        yield (f"{r['layers']}, {cache} cache, {r['rows_contiguous']} rows of {_ctx(r['max_seq_len'])} "
               f"reserved ({r['bytes_contiguous'] / 1e9:.2f} GB)",
               f"{r['rows_paged']} ragged rows paged, {r['rows_ratio']:.2f}x (at the mean length "
               f"{r['rows_ratio_expected']:.2f}x)",
               f"tokens per GB: {r['tokens_per_gb_contiguous']:,.0f} contiguous, {r['tokens_per_gb_paged']:,.0f} paged")



def paged_prefix(records: list[dict]) -> Iterator[Row]:
    """bench/paged.py --scenario prefix: a forked prefix and its suffix's prefill against the whole
    prompt's prefill (issue 67: fork + suffix at most 10% of the full prefill)."""
    for r in records:
        case = (f"{r['stack']} x{r['n_layers']}, B = {r['batch']}, a {_ctx(r['prompt_len'])} prompt whose first "
                f"{_ctx(r['prefix_len'])} are forked")
        if r.get("error"):
            yield case, "not run", str(r["error"]).split(":")[0]
            continue
        yield (case, f"fork {r['fork_ms_per_layer']:.3f} + suffix {r['suffix_ms_per_layer']:.2f} ms a layer against "
                     f"{r['full_prefill_ms_per_layer']:.1f}: {100 * r['ratio_to_full']:.1f}% (the FLOP floors' "
                     f"{100 * r['floor_ratio']:.1f}%)",
               f"max diff to the same suffix on the unforked row {r['max_abs_diff_to_unforked']:.1e}")


def select_fp4(records: list[dict]) -> Iterator[Row]:
    """bench/topk.py --cases select_fp4 --device-time: the selection over MXFP4 indexer keys, kernel
    time a call: the CUDA selection over the stored codes against the Pallas scoring kernels + top-k
    (over the keys' bf16 values; the FP4 codes widened to bf16; to e4m3, FP8 dots: issue 69)."""
    base = {(r["batch"], r["slots"]): r["device_us_per_op"] for r in records
            if r["case"] == "select_fp4" and r["variant"] == "native-fp4-stored"}
    for r in records:
        if r["case"] != "select_fp4" or r["variant"] in ("native-fp4-dequantized", "native-bf16-keys"):
            continue
        us, ref = r["device_us_per_op"], base.get((r["batch"], r["slots"]))
        ratio = f" ({us / ref:.2f}x the CUDA selection over the stored codes)" if ref and r["variant"] != \
            "native-fp4-stored" else ""
        yield (f"B = {r['batch']}, T = {_ctx(r['slots'])}: {r['variant']}", f"{us:.1f} us{ratio}",
               "the same picks" if r["picks_equal"] else f"picks differ in {r['picks_differing']}")

# The cited records: (scenario, record under bench/results/, command, machine, commit that added it, extractor).
SOURCES: list[tuple[str, str, str, str, str, Callable[[list[dict]], Iterator[Row]]]] = [
    ("Stacks of 4 layers on the same buffers (decode, prefill), the module call",
     "h200_stack_grid_same_buffers_2026-12-02.json",
     "python3 bench/stack.py --size flash --same-buffers all --call-overhead --call-overhead-size flash",
     H200, "d88f675", stack),
    ("The module call's finite check, each way (flash CSA decode, B = 1)",
     "h200_call_overhead_2026-12-05_s50.json",
     "python3 bench/stack.py --call-overhead-only --call-overhead-size flash --steps 200 --repeats 5",
     H200, "d97e074", stack),
    ("Decode stacks of 4 on the same buffers, B = 1, 8, 32 at 2k-64k (session 68's defaults)",
     "h200_decode_grid_2026-12-06_s68.json",
     "python3 bench/stack.py --size flash --scenarios stack_decode --stacks csa|hca --batches 1,8,32 "
     "--contexts 2048,16384,65536 --same-buffers all",
     H200 + "; CSA and HCA in two processes back to back (merged record)",
     "d7540b7", stack),
    ("The mixed stack's decode with the usual steps (new positions, new output each step)",
     "h200_stack_grid_mixed_fresh_2026-12-02.json",
     "python3 bench/stack.py --size flash --stacks mixed --scenarios stack_decode",
     H200, "d88f675", stack),
    ("Long context: decode from 128k to 1M tokens (stacks of 4 on the same buffers)",
     "h200_long_decode_2026-12-04_s44.json",
     "python3 bench/stack.py --size flash --scenarios stack_decode --stacks csa|hca --batches 1,8,32|1,8 "
     "--contexts 131072,1048576|262144,524288|131072,262144,524288,1048576 --same-buffers all",
     H200 + "; three processes in one lease (merged record; CSA B = 32 at 256k and 512k not run)", "abddf42",
     stack),
    ("Long context: prefill from 4k to 1M tokens (stacks of 2; 1M by chunks)",
     "h200_long_prefill_2026-12-04_s44.json",
     "python3 bench/stack.py --size flash --scenarios stack_prefill --stacks csa|hca --layers-per-stack 2 "
     "--prefills 16384,65536,131072,262144|4096,16384,65536|262144,524288|1048576 [--prefill-chunk auto] "
     "--repeats 3|5|2|1",
     H200 + "; six processes (merged record): HCA session 37, CSA sessions 43 (16k-256k, 1M) and 44 (512k)",
     "d8a5829 (CSA)", long_prefill),
    ("Break modes: the device break and the XLA selection against `none` (one CSA layer)",
     "h200_flash_device_break_2026-12-01.json",
     "python3 bench/run.py --size flash --layers csa --scenarios decode_pr,decode_long "
     "--modes none,none-xla,narrow-device --no-peer --no-progress",
     H200, "b822eef", break_modes),
    ("Break modes: the host break (one CSA layer; before the selection kernels' rewrite)",
     "h200_flash_device_break_2026-11-30_r3.json",
     "python3 bench/run.py --size flash --layers csa --scenarios decode_pr,decode_long "
     "--modes none,none-xla,narrow,narrow-device --no-peer --no-progress",
     H200, "ee6d48d", break_modes),
    ("The selection alone",
     "h200_topk_native_ab_new_2026-12-01.json",
     "python3 bench/topk.py --device-time --repeats 10",
     H200, "b822eef", topk),
    ("Against MaxText 0.2.5 and HF transformers 5.23.0: CSA",
     "h200_flash_maxtext_csa_2026-12-01.json",
     "python3 bench/run.py --size flash --layers csa --modes none --batches 1,8,32 --peers hf-torch,maxtext-jax "
     "--hf-mem-gb 30 --no-cmdbuf --no-ceilings --no-progress",
     H200 + ", without the CUDA handlers (`lax.top_k`)", "3307da6", peers),
    ("Against MaxText 0.2.5 and HF transformers 5.23.0: HCA",
     "h200_flash_maxtext_hca_2026-12-01.json",
     "python3 bench/run.py --size flash --layers hca --modes none --batches 1,8 --peers hf-torch,maxtext-jax "
     "--hf-mem-gb 30 --no-cmdbuf --no-ceilings --no-progress",
     H200, "3307da6", peers),
    ("Two GPUs: batch (2x1) or heads (1x2) over two H200s against one",
     "h200x2_sharded_2026-12-01.json",
     "python3 bench/sharded.py --size flash --xla-dump DIR --vlog LOG",
     H200X2, "7f89b0d", sharded),
    ("Decode loops as users write them: same buffers, the usual steps, nnx.jit, jit_modules, module calls",
     "h100_loops_2026-12-07.json",
     "bash bench/gpu.sh loops  (python3 bench/loops.py --size flash --stacks csa,hca --batches 1,8,32 "
     "--contexts 2048,16384,131072)",
     H100, "a385271", loops),
    ("Decode loops as users write them, at 1M tokens",
     "h100_loops_2026-12-07_1m.json",
     "CONTEXTS=1048576 BATCHES=1,8 bash bench/gpu.sh loops",
     H100 + "; the module calls of CSA B = 8 ran out of the H100's memory (the calls keep two caches)",
     "a385271", loops),
    ("Paged caches against contiguous ones (16k to 1M), S = 4 verification steps against S = 1",
     "h100_paged_2026-12-07_s75.json",
     "PAGED_TIMEOUT=480 PAGED_DEADLINE=420 bash bench/gpu.sh paged  (python3 bench/paged.py --size flash "
     "--stacks csa,hca --batches 1,8,32 --contexts 16384,131072,1048576 --query-batches 8 "
     "--query-contexts 16384,131072)",
     H100 + "; max diff: the hidden states after the last of ~40 steps, each fed the last one's output; "
     "CSA B = 32 at 1M does not fit the H100's memory",
     "c2b10df", paged),
    ("Paged CSA after the scoring kernel reads its tiles' page runs before its loop",
     "h100_paged_2026-12-07_s77.json",
     "STACKS=csa BATCHES=1,8,32 CONTEXTS=131072,1048576 GOLDEN=0 GATES_K=test_indexer_kernel GATES_TIMEOUT=200 "
     "PAGED_DEADLINE=330 PAGED_TIMEOUT=400 bash bench/gpu.sh gates paged  (python3 bench/paged.py --size flash "
     "--stacks csa --batches 1,8,32 --contexts 131072,1048576 --query-batches 8 --query-contexts 16384,131072)",
     H100 + "; pages in a random order over the pool; CSA B = 32 at 1M does not fit the H100's memory",
     "bbd2b74", paged),
    ("Paged CSA with each row's pages in order over the pool (as a fresh pool hands them out)",
     "h100_paged_2026-12-07_s77_in_order.json",
     "python3 bench/paged.py --size flash --stacks csa --batches 8,32 --contexts 131072 --query-batches 8 "
     "--query-contexts 1048576 --page-order in-order --deadline-s 200",
     H100 + "; the same call, just before the next section's run", "bbd2b74 + bench/paged.py's --page-order", paged),
    ("Paged CSA with the pages in a random order over the pool (the same cells, the same call)",
     "h100_paged_2026-12-07_s77_random.json",
     "python3 bench/paged.py --size flash --stacks csa --batches 8,32 --contexts 131072 --query-batches 8 "
     "--query-contexts 1048576 --page-order random --deadline-s 200",
     H100 + "; the same call, just after the previous section's run", "bbd2b74 + bench/paged.py's --page-order",
     paged),
    ("A forked prefix: fork + the suffix's prefill against the whole prompt's prefill",
     "h100_paged_prefix_2026-12-07_s75.json",
     "PAGED_SCENARIO=prefix bash bench/gpu.sh paged  (python3 bench/paged.py --scenario prefix --size flash "
     "--stacks csa,hca)",
     H100, "2ce5089 (a stack forked and reserved in one call each)", paged_prefix),
    ("Paged against contiguous with XLA's deterministic flags: the same bits after every step",
     "h100_paged_2026-12-07_s74_deterministic_128k.json",
     'XLA_FLAGS="--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0" STACKS=csa,hca BATCHES=8 '
     "CONTEXTS=131072 QUERY_CONTEXTS=131072 bash bench/gpu.sh paged",
     H100 + "; no autotuning (the default runs' max diffs come from GEMMs autotuned apart in the two "
     "programs), so not a timing to compare with the other sections",
     "102ccc8 + the CUDA selection's key-run reads", paged),
    ("The selection over MXFP4 keys: the CUDA selection against the Pallas scoring kernels (bf16, FP4, FP8 dots)",
     "h100_topk_fp4_2026-12-07_s75.json",
     'TOPK_ARGS="--cases select,select_fp4" bash bench/gpu.sh topk  (python3 bench/topk.py --device-time '
     "--repeats 10 --cases select,select_fp4)",
     H100 + "; V4-Flash's indexer (64 heads of 128, top-2048), decode: one query a row", "c2b10df", select_fp4),
    ("Memory: a ragged batch (1k to 1M tokens a row, log-uniform) in a paged pool against rows reserved for 1M",
     "cpu_paged_memory_2026-12-07.json",
     "python bench/paged.py --scenario memory --size flash",
     "CPU (byte counts from the caches' shapes, `jax.eval_shape`: no timing), jax 0.10.2, Python 3.11",
     "38bbeaf", paged_memory),
    ("Ragged batches (CPU, small size, float32; a CI run shared the cores)",
     "cpu_small_ragged.json",
     "python bench/ragged.py --size small",
     CPU, "540dc14", ragged),
]


# The sections after the generated table are written by hand (figures not in a record here).
TAIL = "## Training (issue 28)"
STUBS = (f"{TAIL}\n\nMeasured in the current session: see below.\n\n"
         "## Long context (issue 29)\n\nMeasured in the current session: see below.\n")


# Records with no date in their meta or name: the date of the run, from the journal.
UNDATED = {"cpu_small_ragged.json": "2026-11-30"}


def _date(data: dict, name: str) -> str:
    meta = data.get("meta") or {}
    date = meta.get("date_utc") or next((r.get("date_utc") for r in data["records"] if r.get("date_utc")), None)
    if date:
        return str(date)[:10]
    dated = [part for part in name.replace(".", "_").split("_") if part.startswith("20") and len(part) == 10]
    return dated[0] if dated else UNDATED[name]


def markdown() -> str:
    out = ["# bench/RESULTS.md: where the package stands", "",
           "Generated by `python bench/results_table.py --write` from the records it cites (`SOURCES` there);",
           "do not edit by hand. Every figure is read from the record named in its section: V4-Flash sizes,",
           "bf16, unless the section says otherwise. Records live in `bench/results/`; how each figure was",
           "reached, and the figures before these, is the frozen journal",
           "[`docs/journal/RESULTS_2026-11-30_to_2026-12-02.md`](../docs/journal/RESULTS_2026-11-30_to_2026-12-02.md).",
           "What the scenarios measure and how to run them: [`docs/benchmarks.md`](../docs/benchmarks.md).",
           "", "| # | scenario | record | date | machine | commit | command |", "|---|---|---|---|---|---|---|"]
    tables = []
    for i, (title, name, command, machine, commit, extract) in enumerate(SOURCES, 1):
        data = json.loads((RESULTS / name).read_text())
        out.append(f"| {i} | {title} | [`results/{name}`](results/{name}) | {_date(data, name)} | {machine} | "
                   f"{commit} | `{command}` |")
        rows = list(extract(data["records"]))
        tables += ["", f"## {i}. {title}", "", f"Record `results/{name}`.", "",
                   "| case | figure | note |", "|---|---|---|"]
        tables += [f"| {case} | {figure} | {note} |" for case, figure, note in rows]
    out += tables
    return "\n".join(out) + "\n"


def page(current: str | None = None) -> str:
    """The generated table, then the hand-written sections from `TAIL` on of `current` (the
    page as it is), or their stubs."""
    if current is not None and f"\n{TAIL}" in current:
        return markdown() + current[current.index(f"\n{TAIL}"):]
    return markdown() + "\n" + STUBS


def generated_part(text: str) -> str:
    """What `markdown()` owns of a page: everything before `TAIL`."""
    return text[:text.index(f"\n{TAIL}")] if f"\n{TAIL}" in text else text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    text = page(PAGE.read_text() if PAGE.exists() else None)
    if args.write:
        PAGE.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
