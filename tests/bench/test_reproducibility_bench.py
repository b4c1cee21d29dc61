"""bench/reproducibility.py at the tiny size on the CPU: one process's record, and the summary
that says whether each setting's processes agree bit for bit and what determinism costs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_process_records_its_digest_and_the_summary_compares_the_settings(tmp_path):
    record = tmp_path / "repro_default_1.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "reproducibility.py"), "--size", "tiny", "--batch", "1",
                    "--prompt", "24", "--steps", "2", "--repeats", "1", "--json", str(record)],
                   check=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
    run = json.loads(record.read_text())
    assert len(run["digest"]) == 64 and set(run["layers"]) == {"compressed_sparse_attention",
                                                               "heavily_compressed_attention"}
    assert all(v["decode_step_ms"] > 0 and v["step_deterministic"] is False for v in run["layers"].values())
    # Two more "processes": the same run again, and one as the deterministic setting.
    again, det = tmp_path / "repro_default_2.json", tmp_path / "repro_det_1.json"
    again.write_text(record.read_text())
    det.write_text(json.dumps({**run, "deterministic": True, "digest": "0" * 64}))
    from bench.reproducibility import summarize

    table = summarize([str(record), str(again), str(det)])["summary"]
    assert table["default"]["bit_identical"] and table["default"]["processes"] == 2
    assert table["deterministic"]["bit_identical"] and table["cost"]
    assert all(ratio == 1.0 for layer in table["cost"].values() for ratio in layer.values())
