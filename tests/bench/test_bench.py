"""Smoke test of the benchmark (`bench/run.py`): a tiny run, records checked.

Runs the tiny config (CSA layer, the prefill scenario: one compiled step per mode plus the
picks pass) with every break mode, and the HF peer when torch + transformers are installed.
The command runs as a job of helpers.JOBS: a fresh process, started with the session beside
the in-process tests.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from helpers import JOBS, background

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dsv4_jax  # noqa: E402
from bench import peer  # noqa: E402

HAS_PEER = peer.available() is None
BENCH_RUN = background("bench", lambda workdir: [
    sys.executable, ROOT / "bench" / "run.py", "--size", "tiny", "--layers", "csa", "--scenarios", "prefill",
    "--json", workdir / "out.json", "--no-progress", "--no-plot", *([] if HAS_PEER else ["--no-peer"])],
    cwd=ROOT, timeout=900)


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_run_under_test", ROOT / "bench" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_run():
    """(bench/run.py as a module, the run's JSON, the finished process, whether the peer ran)."""
    job = JOBS.by_name["bench"]
    proc = job.result()
    return _load_bench(), job.workdir / "out.json", proc, HAS_PEER


@BENCH_RUN
def test_bench_records_have_required_fields(bench_run):
    bench, out, proc, has_peer = bench_run
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    data = json.loads(out.read_text())
    records = data["records"]
    modes = {r["mode"] for r in records}
    assert {"none", "none-xla", "narrow", "narrow-device", "wide"} <= modes
    assert ("hf-torch" in modes) == has_peer
    for r in records:
        missing = [f for f in bench.REQUIRED_FIELDS if f not in r]
        assert not missing, (r["mode"], missing)
        assert r["scenario"] == "prefill" and r["layer_type"] == "CSA" and r["size"] == "tiny"
        assert r["error"] is None, r
        if r["skipped"] is not None:  # only the device break, where the native handlers are not built
            assert r["mode"] == "narrow-device" and not dsv4_jax.native.available("cpu"), r
            continue
        assert r["prefill_ms"] is not None and r["prefill_ms"] > 0, r
    assert data["meta"]["jax_version"]


@BENCH_RUN
def test_bench_modes_agree(bench_run):
    """Every mode against "none" (the reference of the run), "none" against the HF peer, and
    each record says where its break ran."""
    _, out, _, _ = bench_run
    records = {r["mode"]: r for r in json.loads(out.read_text())["records"]}
    native_built = not records["narrow-device"].get("skipped")
    compared = [m for m in ("none-xla", "narrow", "narrow-device", "wide") if not records[m].get("skipped")]
    assert len(compared) == (4 if native_built else 3)
    for mode in compared:
        assert records[mode]["max_abs_diff_vs_none"] <= 1e-5, records[mode]
        assert records[mode]["picks_set_overlap_vs_none"] == 1.0
    place = {"none": None, "none-xla": None, "narrow": "host", "narrow-device": "device", "wide": "host"}
    for mode in [*compared, "none"]:
        assert records[mode]["break_on"] == place[mode], records[mode]
    assert records["none"]["native_select"] == native_built and records["none-xla"]["native_select"] is False
    # One host callback per call in the CSA step of the host breaks; none in the device break.
    assert [records[m]["host_breaks"] for m in ("none", "none-xla", "narrow", "wide")] == [0, 0, 1, 1]
    if native_built:
        assert records["narrow-device"]["host_breaks"] == 0
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
