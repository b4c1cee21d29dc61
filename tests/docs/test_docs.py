"""The Python examples of README.md and docs/*.md run as typed.

Every ```python block of a page runs, in the page's order, in one namespace per page (a page's
later blocks use what its earlier ones defined). The one exception is a block the reader is
told, in the rendered page, is an excerpt: the line before it reads
``*Excerpt — not runnable as typed: REASON*`` (for a block that needs a GPU or minutes and has
no tiny-config spelling; a block that needs a checkpoint writes one first, as docs/use.md's
does). Such a block must still compile; a hidden marker (an HTML comment) is refused. All pages
run in one subprocess on the CPU with 8 host devices (docs/sharding.md builds a 4 x 2 mesh), a job
of helpers.JOBS (started with the session beside the in-process tests); each page's outcome is a
test of its own. README.md's commands are the ones CI runs (`.ci/run`).
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
EXCERPT = re.compile(r"^\*Excerpt — not runnable as typed:\s*(?P<reason>.*?)\s*\*$")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(first line number, code, the excerpt's reason or None) of every ```python block."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if m["lang"] == "python":
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = EXCERPT.match(before)
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
def test_blocks_are_plain_python_or_visibly_excerpts(page):
    """No doctest prompts; every block valid Python; an excerpt says why, and nothing is skipped
    by a marker the rendered page hides."""
    text = page.read_text()
    assert not re.search(r"<!--\s*not run", text), (
        f"{page.name}: a block skipped by an HTML comment the reader never sees; make it run as typed "
        "on the tiny config, or put `*Excerpt — not runnable as typed: REASON*` on the line before it")
    for line, code, reason in python_blocks(text):
        assert reason != "", f"{page.name}:{line}: an excerpt without its reason"
        assert not re.search(r"^>>> ", code, re.M), f"{page.name}:{line}: a doctest prompt"
        compile(code, f"{page.name}:{line}", "exec")  # at least valid Python


def test_the_marker_is_recognised():
    text = ("a\n\n*Excerpt — not runnable as typed: needs a GPU*\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n"
            "```bash\nls\n```\n<!-- not run: hidden -->\n```python\nz = 3\n```\n")
    assert python_blocks(text) == [(5, "x = 1\n", "needs a GPU"), (9, "y = 2\n", None), (16, "z = 3\n", None)]


def test_relative_links_resolve():
    """Links between the pages (and to files of the repository) point at something that exists."""
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)}: link to {target}, which does not exist"


def test_ci_runs_the_readmes_commands():
    """`.ci/run` runs the README's test command as typed (with .venv312 for Python 3.12), and the
    README's install: what a newcomer types is what CI checks."""
    readme = (ROOT / "README.md").read_text()
    first = readme[readme.index("```bash\n") + len("```bash\n"):]
    commands = first[:first.index("```")].strip().splitlines()
    test_command = next(c for c in commands if "-m pytest" in c)
    assert "--durations=" in test_command, "the README's test command should print the slowest tests"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    suites = [line for line in ci if "-m pytest" in line and " -n " in line]
    assert suites and all(line.replace(".venv312/", ".venv/") == test_command for line in suites), (
        f"the README says {test_command!r}; .ci/run runs {suites}")
    assert "python3 -m venv .venv" in ci and any(line.startswith(".venv/bin/pip install -q -e '.[test") for line in ci)
