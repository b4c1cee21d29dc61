"""The README's first command runs `python -m dsv4_jax.tools.demo`: it must keep working and print
what the README says it prints (per layer: every mode against the first, the CSA layer's picks,
a one-shot prefill; then the stacked decode step against the module calls). That the modes
agree, and that chunking changes nothing, test_attention.py proves on the layer itself
(test_all_execution_modes_agree_on_csa, test_output_does_not_depend_on_chunking); what only the
demo shows is checked here: its stacked step (`dsv4_jax.tools.demo.stack_decode_step`, no positions,
buffers donated) equals the layers' module calls. The command runs as a job of helpers.JOBS: a
fresh process, started with the session beside the in-process tests."""

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
@background("demo", lambda _: [sys.executable, "-m", "dsv4_jax.tools.demo", "--prompt", "21", "--steps", "2"],
            timeout=600)
def test_demo_runs_and_reports_what_the_readme_says():
    proc = JOBS.by_name["demo"].result()
    assert proc.returncode == 0, proc.stderr[-6000:]
    sections = _sections(proc.stdout)
    assert list(sections) == [SLIDING, CSA, HCA, "stack"]
    stack = sections.pop("stack")  # the layers as a model's decode loop runs them, in one jit
    agree = [line for line in stack if "one jitted step vs the module calls" in line]
    assert len(agree) == 1 and float(agree[0].rsplit("rel err ", 1)[1]) < 1e-5, stack
    assert any("lengths [23, 23]" in line for line in stack), stack  # 21 + 2 steps, every row
    for layer_type, lines in sections.items():
        compared = sorted(re.findall(r"^  (\w+) vs none: ", "\n".join(lines), re.M))
        assert compared == ["narrow", "wide"], lines  # every mode against the XLA reference
        assert any("picks of the last query" in line for line in lines) == (layer_type == CSA), lines
        assert sum("vs one-shot prefill" in line for line in lines) == 1, lines
