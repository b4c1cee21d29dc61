"""bench/RESULTS.md is what bench/results_table.py generates from the records it cites."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("results_table_under_test", ROOT / "bench" / "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_table_is_the_scripts_output():
    rt = _module()
    page = (ROOT / "bench" / "RESULTS.md").read_text()
    assert rt.generated_part(page) == rt.markdown(), "regenerate with: python bench/results_table.py --write"
    assert rt.TAIL in page and "## Long context (issue 29)" in page
    assert rt.page(page) == page  # --write keeps the hand-written sections as they are


def test_every_cited_record_exists_and_gives_rows():
    rt = _module()
    for title, name, *_, extract in rt.SOURCES:
        data = json.loads((rt.RESULTS / name).read_text())
        assert list(extract(data["records"])), (title, name)


def test_the_long_context_plot_draws_every_cell_of_its_records(tmp_path):
    """bench/long_context_plot.py: one line per (scenario, layer type, batch), one point per length,
    from the committed records that the RESULTS page's plot was drawn from."""
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("long_context_plot", ROOT / "bench" / "long_context_plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    names = ["h200_long_decode_2026-12-04_s44.json", "h200_long_prefill_2026-12-04_s44.json"]
    records = [r for n in names for r in json.loads((ROOT / "bench" / "results" / n).read_text())["records"]]
    drawn = plot.plot(records, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    assert [n for n, *_ in drawn[("stack_decode", "CSA", 1)]] == [131072, 262144, 524288, 1048576]
    assert [n for n, *_ in drawn[("stack_decode", "CSA", 32)]] == [131072, 1048576]  # 256k, 512k not run
    assert len(drawn) == 8 and sum(len(v) for v in drawn.values()) == 22 + 12
    assert (ROOT / "bench" / "results" / "h200_long_context_2026-12-04_s44.png").exists()
