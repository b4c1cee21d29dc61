"""The Python examples of README.md and docs/*.md run as typed.

Every ```python block of a page runs, in the page's order, in one namespace per page (a page's
later blocks use what its earlier ones defined). A block preceded by an HTML comment
``<!-- not run: REASON -->`` is skipped (for blocks that need a GPU, a real checkpoint or
minutes); the reason must be given. All pages run in one subprocess on the CPU with 8 host
devices (docs/sharding.md builds a 4 x 2 mesh), a job of helpers.JOBS (started with the session
beside the in-process tests); each page's outcome is a test of its own.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from helpers import JOBS, background

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>.*?)\s*-->$")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(first line number, code, the not-run reason or None) of every ```python block."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if m["lang"] == "python":
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = NOT_RUN.match(before)
            blocks.append((i + 2, "\n".join(lines[i + 1:end]) + "\n", marker["reason"] if marker else None))
        i = end + 1
    return blocks


RUNNER = r"""
import contextlib, io, json, sys, traceback
with open(sys.argv[1]) as f:
    pages = json.load(f)
results = {}
for name, blocks in pages.items():
    namespace = {"__name__": "__docs__"}
    results[name] = "ok"
    for line, code in blocks:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(code, f"{name}:{line}", "exec"), namespace)
        except BaseException:
            results[name] = f"the block at {name}:{line} failed:\n" + traceback.format_exc(limit=-4)
            break
print("@@DOCS" + json.dumps(results))
"""


def _runnable(page: Path) -> list[tuple[int, str]]:
    return [(line, code) for line, code, reason in python_blocks(page.read_text()) if reason is None]


def _runner(workdir: Path) -> list:
    """The job's command: the runner, given every page's runnable blocks in a file."""
    pages = {str(p.relative_to(ROOT)): _runnable(p) for p in PAGES}
    (workdir / "pages.json").write_text(json.dumps({name: blocks for name, blocks in pages.items() if blocks}))
    return [sys.executable, "-c", RUNNER, workdir / "pages.json"]


_ENV = dict(os.environ, JAX_PLATFORMS="cpu")
_ENV["XLA_FLAGS"] = (_ENV.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The 8 host devices share 2 cores with the rest of the suite: a collective whose threads wait
# longer than XLA:CPU's 40 s rendezvous limit aborts the process (seen once under load).
_ENV["XLA_FLAGS"] += " --xla_cpu_collective_call_terminate_timeout_seconds=600"
DOCS_RUN = background("docs", _runner, cwd=ROOT, env=_ENV, timeout=600)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str]:
    proc = JOBS.by_name["docs"].result()
    found = [line for line in proc.stdout.splitlines() if line.startswith("@@DOCS")]
    assert found, f"the docs runner crashed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(found[-1][len("@@DOCS"):])


@DOCS_RUN
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_examples_run_as_typed(page, outcomes):
    name = str(page.relative_to(ROOT))
    if name not in outcomes:
        pytest.skip("no runnable python block")
    assert outcomes[name] == "ok", outcomes[name]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_blocks_are_plain_python_or_say_why_not_run(page):
    """No doctest prompts in a block that runs; every skipped block gives its reason."""
    for line, code, reason in python_blocks(page.read_text()):
        assert reason != "", f"{page.name}:{line}: `<!-- not run: -->` without a reason"
        if reason is None:
            assert not re.search(r"^>>> ", code, re.M), f"{page.name}:{line}: a doctest prompt in a block that runs"
            compile(code, f"{page.name}:{line}", "exec")  # at least valid Python


def test_the_marker_is_recognised():
    text = "a\n\n<!-- not run: needs a GPU -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(5, "x = 1\n", "needs a GPU"), (9, "y = 2\n", None)]


def test_relative_links_resolve():
    """Links between the pages (and to files of the repository) point at something that exists."""
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)}: link to {target}, which does not exist"
