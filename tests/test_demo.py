"""The README's first command runs `python -m dsv4_jax.demo`: it must keep working, and what it
reports must be the agreement the README promises (same picks in every mode, outputs equal to
float32 rounding, chunking-invariant). The command runs as a job of helpers.JOBS: a fresh
process, started with the session beside the in-process tests."""

from __future__ import annotations

import re
import sys

from helpers import JOBS, background

from dsv4_jax import CSA, HCA, SLIDING


def _sections(out: str) -> dict[str, list[str]]:
    """The demo's output per layer: {layer type: its lines}."""
    sections, current = {}, None
    for line in out.splitlines():
        header = re.fullmatch(r"== layer \d+: (\w+) ==", line)
        if header or (line.startswith("== the ") and "layers stacked" in line):
            current = sections.setdefault(header.group(1) if header else "stack", [])
        elif current is not None:
            current.append(line)
    return sections


# Batch 2: a 21-token prefill, then 2 decode steps: 5 CSA entries for a top-4, so the indexer selects.
@background("demo", lambda _: [sys.executable, "-m", "dsv4_jax.demo", "--prompt", "21", "--steps", "2"], timeout=600)
def test_demo_runs_and_reports_agreement():
    proc = JOBS.by_name["demo"].result()
    assert proc.returncode == 0, proc.stderr[-6000:]
    sections = _sections(proc.stdout)
    assert list(sections) == [SLIDING, CSA, HCA, "stack"]
    stack = sections.pop("stack")  # the layers as a model's decode loop runs them, in one jit
    agree = [line for line in stack if "one jitted step vs the module calls" in line]
    assert len(agree) == 1 and float(agree[0].rsplit("rel err ", 1)[1]) < 1e-5, stack
    assert any("lengths [23, 23]" in line for line in stack), stack  # 21 + 2 steps, every row
    for layer_type, lines in sections.items():
        diffs = dict(re.findall(r"^  (\w+) vs none: max \|out diff\| (\S+?)(?:,|$)", "\n".join(lines), re.M))
        assert sorted(diffs) == ["narrow", "wide"], lines
        assert float(diffs["narrow"]) == 0.0  # narrow and none: bit-identical
        assert float(diffs["wide"]) <= 1e-5
        picks = [line for line in lines if "picks" in line and " vs none" in line]
        if layer_type == CSA:  # the only layer with an indexer: every call's picks compared, per mode
            assert len(picks) == 2, lines
            assert all(line.endswith("picks identical (3 calls, 2 x 23 queries x top-4)") for line in picks), picks
            last = next(line for line in lines if "picks of the last query" in line)
            assert "-1" not in last.rsplit(":", 1)[1], last  # four real picks among five entries
        else:
            assert picks == [], picks
        one_shot = [line for line in lines if "vs one-shot prefill" in line]
        assert len(one_shot) == 1 and float(one_shot[0].rsplit("rel err ", 1)[1]) < 2e-5
