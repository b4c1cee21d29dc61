"""Markdown tables and a PNG plot from the benchmark's JSON records."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

from .peer import MAXTEXT
from .plan import MODES, PEER

IMPLS = (*MODES, PEER, MAXTEXT)



def error_text(err: BaseException, limit: int = 300) -> str:
    """A record's ``error``: the exception's type and the start of its message (a record stays
    small; the log keeps the whole traceback)."""
    return f"{type(err).__name__}: {str(err)[:limit]}"

def _fmt(v, digits=3):
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.{digits}g}"


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def _groups(records, scenario):
    groups: OrderedDict = OrderedDict()
    for r in records:
        if r["scenario"] != scenario:
            continue
        key = (r["layer_type"], r["batch"], r["prompt_len"])
        groups.setdefault(key, {})[r["mode"]] = r
    return groups


def _cell(r, metric, p90=None):
    if r is None:
        return "-"
    if r.get("skipped"):
        return "skip"
    if r.get("error"):
        return "OOM" if "OutOfMemory" in r["error"] else "error"
    v = r.get(metric)
    s = _fmt(v)
    if p90 and r.get(p90) is not None:
        s += f" / {_fmt(r[p90])}"
    return s


def _diffs(g):
    parts = []
    short = {"none-xla": "x", "narrow": "n", "narrow-device": "nd", "wide": "w", PEER: "hf", MAXTEXT: "mt"}
    for m in ("none-xla", "narrow", "narrow-device", "wide", PEER, MAXTEXT):
        r = g.get(m)
        if r is not None and r.get("max_abs_diff_vs_none") is not None:
            parts.append(f"{short[m]} {r['max_abs_diff_vs_none']:.1e}")
    mt = g.get(MAXTEXT)
    if mt is not None and mt.get("max_abs_diff_vs_hf") is not None:
        parts.append(f"mt-vs-hf {mt['max_abs_diff_vs_hf']:.1e}")
    picks = [f"{short[m]} {g[m]['picks_set_overlap_vs_none']:.3f}"
             for m in ("none-xla", "narrow", "narrow-device", "wide", MAXTEXT)
             if g.get(m) is not None and g[m].get("picks_set_overlap_vs_none") is not None]
    s = ", ".join(parts) if parts else "-"
    if picks:
        s += "; picks overlap " + ", ".join(picks)
    return s


def table(records, scenario: str, metric: str, p90: str | None = None) -> str:
    """One Markdown table: a row per (layer, batch, length), a column per impl, then ratios."""
    groups = _groups(records, scenario)
    if not groups:
        return ""
    has_floor = any(r.get("floor_ms") for g in groups.values() for r in g.values())
    head = ["layer", "B", "ctx" if scenario == "decode_long" else "prompt", "entries/top-k"]
    head += [f"{m} ms" for m in IMPLS]
    head += ["wide/narrow", "narrow/none", "narrow-device/none", "none/none-xla", "none/HF", "narrow/HF"]
    has_mt = any(MAXTEXT in g for g in groups.values())
    if has_mt:
        head += ["none/MaxText", "narrow-device/MaxText", "MaxText peak GB"]
    if has_floor:
        head += ["floor ms", "none/floor", "narrow/floor"]
    raw = any(r.get("raw_step_ms_median") for g in groups.values() for r in g.values()) and metric.startswith("decode")
    if raw:
        head += ["none raw step ms", "narrow raw step ms", "narrow-device raw step ms"]
    head += ["max abs diff vs none (x, n, nd, w, hf, mt); picks overlap"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (lt, b, plen), g in groups.items():
        any_r = next(iter(g.values()))
        val = {m: (g[m].get(metric) if m in g and not g[m].get("skipped") and not g[m].get("error") else None)
               for m in IMPLS}
        row = [lt, str(b), str(plen), f"{any_r.get('entries', '-')}/{any_r.get('top_k') or 'all'}"]
        row += [_cell(g.get(m), metric, p90) for m in IMPLS]
        row += [_fmt(_ratio(val["wide"], val["narrow"])), _fmt(_ratio(val["narrow"], val["none"])),
                _fmt(_ratio(val.get("narrow-device"), val["none"])), _fmt(_ratio(val["none"], val.get("none-xla"))),
                _fmt(_ratio(val["none"], val[PEER])), _fmt(_ratio(val["narrow"], val[PEER]))]
        if has_mt:
            peak = g.get(MAXTEXT, {}).get("peak_gb")
            row += [_fmt(_ratio(val["none"], val[MAXTEXT])), _fmt(_ratio(val.get("narrow-device"), val[MAXTEXT])),
                    _fmt(peak)]
        if has_floor:
            fl = any_r.get("ttft_floor_ms" if metric == "ttft_ms" and scenario == "decode_pr" else "floor_ms")
            row += [_fmt(fl), _fmt(_ratio(val["none"], fl)), _fmt(_ratio(val["narrow"], fl))]
        if raw:
            row += [_cell(g.get(m), "raw_step_ms_median") for m in ("none", "narrow", "narrow-device")]
        row.append(_diffs(g))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def compile_table(records) -> str:
    rows: OrderedDict = OrderedDict()
    for r in records:
        if r["mode"] == PEER:
            continue
        key = (r["scenario"], r["layer_type"], r["batch"], r["prompt_len"])
        rows.setdefault(key, {})[r["mode"]] = r
    compiled = (*MODES, MAXTEXT) if any(MAXTEXT in g for g in rows.values()) else MODES
    head = ["scenario", "layer", "B", "len"] + [f"{m} compile s" for m in compiled] + ["host breaks / call (n, w)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (sc, lt, b, plen), g in rows.items():
        cells = [_cell(g.get(m), "compile_s") if not (m == MAXTEXT and g.get(m, {}).get("skipped"))
                 else _fmt(g[m].get("compile_s")) for m in compiled]
        br = ", ".join(str(g[m].get("host_breaks")) for m in ("narrow", "wide") if m in g)
        lines.append("| " + " | ".join([sc, lt, str(b), str(plen), *cells, br or "-"]) + " |")
    return "\n".join(lines)


def skips(records) -> str:
    out = []
    for r in records:
        if r.get("skipped") or r.get("error"):
            what = r.get("skipped") or ("error: " + r["error"])
            out.append(f"- {r['scenario']} {r['layer_type']} B={r['batch']} len={r['prompt_len']} "
                       f"{r['mode']}: {what}")
    return "\n".join(out)


def cmdbuf_table(cb: dict) -> str:
    """Command buffers (CUDA graphs) and host breaks of one decode step, per layer and mode."""
    rows = [k for k in cb if "/" in k]
    if not rows:
        return ""
    head = ["layer/mode", "host callbacks in step", "top-level thunks (XLA dump)", "command buffers (log)",
            "thunks per command buffer (log)", "thunks left outside graphs (dump)", "not graphed (min size, log)"]
    lines = [f"decode step, B={cb.get('batch')}, context {cb.get('context')}, XLA_FLAGS='{cb.get('xla_flags')}'",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in rows:
        c = cb[k]
        dump = c.get("thunk_dump") or {}
        lines.append("| " + " | ".join([
            k, str(c.get("host_callbacks_in_step")), " > ".join(dump.get("top_level", [])) or "-",
            str(c.get("command_buffers")), ", ".join(str(g) for g in c.get("graphs", [])) or "-",
            str(dump.get("thunks_outside_command_buffers", "-")), str(c.get("thunks_not_graphed_min_size")),
        ]) + " |")
    return "\n".join(lines)


def maxtext_table(records, hf_records=()) -> str:
    """The JAX peer beside ours: per case MaxText's time, ours (none, narrow-device) / MaxText, its
    peak memory (XLA's analysis of its largest compiled step) and compile time, agreement with
    ours, or why it did not run. `hf_records` (optional, another run's records of the same cases)
    add that run's ours/HF for mode none, labelled as such."""
    groups: OrderedDict = OrderedDict()
    for r in records:
        groups.setdefault((r["scenario"], r["layer_type"], r["batch"], r["prompt_len"]), {})[r["mode"]] = r
    if not any(MAXTEXT in g for g in groups.values()):
        return ""
    hf = {(r["scenario"], r["layer_type"], r["batch"], r["prompt_len"]): r for r in hf_records
          if r["mode"] == "none"}
    head = ["scenario", "layer", "B", "len", "MaxText ms", "none ms", "none/MaxText", "narrow-device/MaxText",
            "MaxText peak GB", "MaxText compile s", "MaxText vs ours max abs (out scale)", "picks overlap"]
    if hf:
        head += ["none/HF (HF run)"]
    head += ["MaxText not run: why"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, g in groups.items():
        mt, none = g.get(MAXTEXT), g.get("none", {})
        if mt is None:
            continue
        metric = "prefill_ms" if key[0] == "prefill" else "decode_ms_median"
        diff = mt.get("max_abs_diff_vs_none")
        row = [key[0], key[1], str(key[2]), str(key[3]), _cell(mt, metric), _fmt(none.get(metric)),
               _fmt(none.get("ours_over_maxtext")), _fmt(g.get("narrow-device", {}).get("ours_over_maxtext")),
               _fmt(mt.get("peak_gb")), _fmt(mt.get("compile_s")),
               "-" if diff is None else f"{diff:.1e} ({_fmt(mt.get('out_scale'))})",
               _fmt(mt.get("picks_set_overlap_vs_none"))]
        if hf:
            row.append(_fmt(hf.get(key, {}).get("ours_over_hf")))
        row.append(mt.get("skipped") or (("error: " + mt["error"]) if mt.get("error") else ""))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def markdown(records, meta: dict | None = None) -> str:
    parts = []
    if meta:
        parts.append(f"device: {meta.get('device')} | platform: {meta.get('platform')} | size: {meta.get('size')} "
                     f"| dtype: {meta.get('dtype')} | jax {meta.get('jax_version')} | "
                     f"peer: {meta.get('peer_versions') or meta.get('peer_unavailable')}")
    parts.append("### decode, PR-like (2-token prompt, then decode steps): ms per step, median / p90")
    parts.append(table(records, "decode_pr", "decode_ms_median", "decode_ms_p90"))
    parts.append("### decode, PR-like: time to first token (the 2-token prompt), ms, median")
    parts.append(table(records, "decode_pr", "ttft_ms"))
    parts.append("### decode at long context (prefix prefilled untimed): ms per step, median / p90")
    parts.append(table(records, "decode_long", "decode_ms_median", "decode_ms_p90"))
    parts.append("### prefill: ms per call, median")
    parts.append(table(records, "prefill", "prefill_ms"))
    mt = maxtext_table(records)
    if mt:
        parts.append("### the JAX peer (MaxText 0.2.5, dot_product): per case")
        parts.append(mt)
        if meta and meta.get("maxtext_flash_probe"):
            parts.append("MaxText attention='flash' prefill here: " + "; ".join(
                f"{k}: {v}" for k, v in meta["maxtext_flash_probe"].items()))
    parts.append("### compile time (trace + lower + XLA compile of the warm-up) and host breaks")
    parts.append(compile_table(records))
    if meta and meta.get("cmdbuf"):
        parts.append("### XLA command buffers per decode step (TF_CPP_VMODULE=command_buffer_conversion_pass=3)")
        parts.append(cmdbuf_table(meta["cmdbuf"]))
    s = skips(records)
    if s:
        parts.append("### skipped / failed\n" + s)
    return "\n\n".join(p for p in parts if p) + "\n"


def render(path, tables=markdown) -> int:
    """``--render JSON``: print the tables of a past run's JSON ({"records": [...], "meta": {...}}).

    `tables(records, meta)` makes them: this module's `markdown` (bench/run.py), or a script's own
    (bench/stack.py, bench/sharded.py). Returns the exit status, 0."""
    data = json.loads(Path(path).read_text())
    print(tables(data["records"], data["meta"]))
    return 0


def scenario_main(argv, build_parser, fill_defaults, run, tables) -> int:
    """The command line of a scenario script (bench/stack.py, bench/train.py): ``--render FILE``
    prints a past run's tables; otherwise `run(args, write)` with the records and meta written to
    ``--json`` after every record (a run cut short keeps what it measured), the tables printed at
    the end. Exit status 1 when every record failed."""
    import time

    args = build_parser().parse_args(argv)
    if args.render:
        return render(args.render, tables)
    fill_defaults(args)
    t0 = time.perf_counter()

    def write(records, meta):
        if args.json:
            meta["wall_s"] = time.perf_counter() - t0
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"meta": meta, "records": records}, indent=1, default=str))

    records, meta = run(args, write)
    write(records, meta)
    print(tables(records, meta))
    errors = [r for r in records if r.get("error")]
    return 1 if errors and len(errors) == len(records) else 0


def plot(records, path: Path, title: str = "") -> Path | None:
    """Grouped bars (log scale): decode median and prefill per case, one bar per impl."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    panels = [("decode_pr", "decode_ms_median", "decode step, 2-token prompt (ms)"),
              ("decode_long", "decode_ms_median", "decode step at long context (ms)"),
              ("prefill", "prefill_ms", "prefill (ms)")]
    panels = [p for p in panels if any(r["scenario"] == p[0] for r in records)]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.6 * len(panels)), squeeze=False)
    colors = {"none": "#1f77b4", "none-xla": "#17becf", "narrow": "#2ca02c", "narrow-device": "#9467bd",
              "wide": "#d62728", PEER: "#7f7f7f", MAXTEXT: "#ff7f0e"}
    for ax, (scenario, metric, label) in zip(axes[:, 0], panels, strict=True):
        groups = _groups(records, scenario)
        labels = [f"{lt} B{b} L{p}" for (lt, b, p) in groups]
        width = 0.8 / len(IMPLS)
        for i, m in enumerate(IMPLS):
            xs, ys = [], []
            for j, g in enumerate(groups.values()):
                r = g.get(m)
                if r and not r.get("skipped") and not r.get("error") and r.get(metric):
                    xs.append(j + (i - 1.5) * width)
                    ys.append(r[metric])
            if xs:
                ax.bar(xs, ys, width=width, label=m, color=colors[m])
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=20, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, ncol=4)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":  # python -m bench.report MAXTEXT_JSON [HF_JSON]: the JAX peer's table
    import json
    import sys

    runs = [json.loads(Path(p).read_text())["records"] for p in sys.argv[1:3]]
    print(maxtext_table(runs[0], runs[1] if len(runs) > 1 else ()))
