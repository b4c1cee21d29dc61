"""bench/RESULTS.md is what bench/results_table.py generates from the records it cites."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
        data = __import__("json").loads((rt.RESULTS / name).read_text())
        assert list(extract(data["records"])), (title, name)
