"""Smoke test of the benchmark (`bench/run.py`): a tiny run in-process, records checked.

Runs the tiny config (CSA layer, the prefill scenario: one compiled step per mode plus the
picks pass) with every break mode, and the HF peer when torch + transformers are installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_run_under_test", ROOT / "bench" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    bench = _load_bench()
    out = tmp_path_factory.mktemp("bench") / "out.json"
    argv = ["--size", "tiny", "--layers", "csa", "--scenarios", "prefill", "--json", str(out), "--no-progress",
            "--no-plot"]
    from bench import peer

    has_peer = peer.available() is None
    if not has_peer:
        argv.append("--no-peer")
    rc = bench.main(argv)
    return bench, out, rc, has_peer


def test_bench_records_have_required_fields(bench_run):
    bench, out, rc, has_peer = bench_run
    assert rc == 0
    data = json.loads(out.read_text())
    records = data["records"]
    modes = {r["mode"] for r in records}
    assert {"none", "narrow", "wide"} <= modes
    assert ("hf-torch" in modes) == has_peer
    for r in records:
        missing = [f for f in bench.REQUIRED_FIELDS if f not in r]
        assert not missing, (r["mode"], missing)
        assert r["scenario"] == "prefill" and r["layer_type"] == "CSA" and r["size"] == "tiny"
        assert r["prefill_ms"] is not None and r["prefill_ms"] > 0, r
        assert r["error"] is None and r["skipped"] is None, r
    assert data["meta"]["jax_version"]


def test_bench_modes_agree(bench_run):
    _, out, _, _ = bench_run
    records = {r["mode"]: r for r in json.loads(out.read_text())["records"]}
    assert records["none"]["max_abs_diff_vs_none"] == 0.0
    for mode in ("narrow", "wide"):
        assert records[mode]["max_abs_diff_vs_none"] <= 1e-5, records[mode]
        assert records[mode]["picks_set_overlap_vs_none"] == 1.0
        assert records[mode]["host_breaks"] == 1  # one host callback per call in the CSA step
    assert records["none"]["host_breaks"] == 0
    if "hf-torch" in records:  # same weights and inputs, float32: the peer computes the same function
        assert records["hf-torch"]["max_abs_diff_vs_none"] <= 1e-4


def test_plan_caps_are_recorded():
    _load_bench()
    from bench import plan

    cases = plan.build_plan("flash", False, "gpu", dtype_bytes=2)
    long16k = [c for c in cases if c.scenario == "prefill" and c.prompt_len == 16384 and c.layer == "csa"]
    assert long16k and all("wide" in c.skip and "hf-torch" in c.skip for c in long16k)
    quick = plan.build_plan("small", True, "cpu")
    assert {c.scenario for c in quick} == {"decode_pr", "decode_long", "prefill"}
    assert all(c.max_seq_len % 128 == 0 and c.max_seq_len >= c.prompt_len + c.steps for c in quick)
