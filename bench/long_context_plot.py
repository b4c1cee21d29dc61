"""The long-context cost curve: ms a layer against context, log-log, from bench/stack.py records.

    python bench/long_context_plot.py bench/results/h200_long_decode_2026-12-04_s44.json \
        bench/results/h200_long_prefill_2026-12-04_s44.json --out bench/results/h200_long_context_2026-12-04_s44.png

Left: decode (``stack_decode`` records), one line per (stack, batch) against the context, with
the bytes floor of the same cells dashed. Right: prefill of a prompt into empty caches
(``stack_prefill``, in one call or by chunks), one line per stack against the prompt's length,
with the FLOP floor dashed. Only what the records hold is drawn; cells with an error are left out.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def series(records: list[dict]) -> dict[tuple, list[tuple[int, float, float]]]:
    """{(scenario, stack, batch): [(length, per_layer_ms, floor_ms), ...] sorted by length}."""
    out = defaultdict(list)
    for r in records:
        if r.get("error") or r.get("scenario") not in ("stack_decode", "stack_prefill"):
            continue
        length = r["context_len"] if r["scenario"] == "stack_decode" else r["prompt_len"]
        out[(r["scenario"], r["layer_type"], r["batch"])].append((length, r["per_layer_ms"], r["floor_ms"]))
    return {k: sorted(v) for k, v in sorted(out.items())}


def plot(records: list[dict], path: Path, title: str = "") -> dict:
    """Draws the curve of `records` into `path` (PNG); returns the series drawn (see `series`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = series(records)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    panels = {"stack_decode": (axes[0], "decode from a context (tokens)", "ms a layer, one decode step"),
              "stack_prefill": (axes[1], "prompt length (tokens)", "ms a layer, the whole prompt")}
    for (scenario, layer_type, batch), points in drawn.items():
        ax = panels[scenario][0]
        xs = [p[0] for p in points]
        label = f"{layer_type} B={batch}"
        line, = ax.plot(xs, [p[1] for p in points], marker="o", label=label)
        ax.plot(xs, [p[2] for p in points], linestyle="--", color=line.get_color(), alpha=0.6,
                label=f"{label} floor")
    for ax, xlabel, ylabel in panels.values():
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        if ax.lines:
            ax.legend(fontsize=7, ncol=2)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="+", help="bench/stack.py JSON files")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default="V4-Flash, bf16, per layer inside the jitted stack (dashed: the floor)")
    args = ap.parse_args(argv)
    records = [r for name in args.records for r in json.loads(Path(name).read_text())["records"]]
    drawn = plot(records, Path(args.out), args.title)
    for key, points in drawn.items():
        print(*key, " ".join(f"{n}:{ms:.3f}" for n, ms, _ in points))


if __name__ == "__main__":
    main()
