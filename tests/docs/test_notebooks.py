"""The notebooks run top to bottom, and every picture is there (so they never rot).

Each notebook is executed by nbclient in a fresh `python3` kernel (jupyter_client starts it
with this interpreter, `sys.executable`), with the working directory notebooks/, as Jupyter
would. Code cells tagged ``picture`` must produce an image/png output. The execution is a job
of helpers.JOBS (``python tests/docs/test_notebooks.py NAME DIR`` writes the executed notebook to
DIR): it runs beside the rest of the suite, and the test checks the notebook it left.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as a job (the module doc): helpers.py is one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import JOBS, background

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
BUDGET_S = 180  # the limit per notebook, on a CPU


def _run(name: str, sockets: Path):
    """Execute a notebook; the kernel talks over Unix sockets under `sockets` (IPC: no TCP port
    races with other processes, no "unencrypted TCP" warning)."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    if os.name == "nt":  # no Unix sockets
        km = jupyter_client.KernelManager(kernel_name="python3")
    else:
        km = jupyter_client.KernelManager(kernel_name="python3", transport="ipc", ip=str(sockets / "kernel"))
    client = nbclient.NotebookClient(nb, km=km, timeout=BUDGET_S, resources={"metadata": {"path": str(NOTEBOOKS)}})
    start = time.perf_counter()
    try:
        client.execute(cleanup_kc=True)  # raises CellExecutionError (with the traceback) if a cell fails
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    return nb, time.perf_counter() - start


NAMES = ("quickstart.ipynb", "indexer_explorer.ipynb")


def _job(name: str) -> pytest.MarkDecorator:
    return background(f"notebook {name}", lambda workdir: [sys.executable, __file__, name, workdir], timeout=1800)


@pytest.mark.parametrize("name", [pytest.param(name, marks=_job(name)) for name in NAMES])
def test_notebook_runs(name):
    job = JOBS.by_name[f"notebook {name}"]
    proc = job.result()  # a cell that raised: CellExecutionError, with the traceback, on stderr
    assert proc.returncode == 0, f"{name}: the notebook did not run to the end:\n{proc.stderr[-6000:]}"
    nb = nbformat.read(job.workdir / name, as_version=4)
    seconds = float((job.workdir / "seconds").read_text())
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{name}: no code cells"
    for i, cell in enumerate(code):
        assert cell.execution_count is not None, f"{name}: code cell {i} did not run"
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert not errors, f"{name}: code cell {i} raised {errors[0].ename}: {errors[0].evalue}"
    pictures = [c for c in code if "picture" in c.metadata.get("tags", [])]
    assert pictures, f"{name}: no cell tagged 'picture'"
    for cell in pictures:
        images = [o for o in cell.outputs if o.output_type in ("display_data", "execute_result")
                  and "image/png" in o.get("data", {})]
        assert images, f"{name}: picture cell produced no image:\n{cell.source[:200]}"
    assert seconds < BUDGET_S, f"{name}: took {seconds:.0f} s (budget {BUDGET_S} s)"


def _markdown(name: str) -> str:
    return "\n".join(c.source for c in nbformat.read(NOTEBOOKS / name, as_version=4).cells if c.cell_type == "markdown")


def test_the_quickstart_says_what_the_code_does():
    """The quickstart's claims about the break come from `dsv4_jax.step.plan`, the place the demo
    prints from: where each mode's break runs (`break_table()`) and which modes differentiate
    (`GRADIENT_CLAIM`; its section 8 then differentiates in every mode of `GRADIENT_MODES`)."""
    from dsv4_jax.step import plan

    text = _markdown("quickstart.ipynb")
    assert plan.break_table() in text, "section 4's table: paste dsv4_jax.step.plan.break_table() there"
    assert plan.GRADIENT_CLAIM in text, "section 8: say dsv4_jax.step.plan.GRADIENT_CLAIM, word for word"
    stale = ["host-break mode", "every break mode but", 'leave the compiled XLA program for a host callback']
    assert not [s for s in stale if s in text], "a claim the code no longer makes"


def test_where_the_break_runs_is_what_plan_step_decides():
    """The line the demo and the quickstart print, against the plan the step compiles."""
    from dsv4_jax import CSA, native
    from dsv4_jax.step import plan

    built = native.available("cpu")
    assert plan.where_break_runs("narrow", "auto", "cpu").startswith(
        "the narrow break runs on the " + ("device" if built else "host"))
    assert plan.plan_step(CSA, "narrow", "auto", platform="cpu").place == ("device" if built else "host")
    assert plan.where_break_runs("narrow", "host", "cpu").startswith("the narrow break runs on the host")
    assert plan.where_break_runs("wide", "auto", "cpu").startswith("the wide break runs on the host")
    assert plan.where_break_runs("none", "auto", "cpu").startswith("no break")


@pytest.mark.parametrize("name", NAMES)
def test_the_runtime_claim_is_the_budget(name):
    """A notebook says how long it runs as `test_notebook_runs` holds it to; so do the pages
    that send the reader to the notebooks."""
    minutes = {2: "two", 3: "three", 4: "four", 5: "five"}[BUDGET_S // 60]
    claim = f"on a CPU in under {minutes} minutes"
    assert claim in _markdown(name), f"{name}: its introduction should say it runs {claim}"
    for page in ("README.md", "docs/intermediates.md"):
        text = " ".join((NOTEBOOKS.parent / page).read_text().split())
        assert claim in text, f"{page}: should say the notebooks run {claim}"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_committed_small(name):
    """Committed without outputs: small files, clean diffs."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{name}: commit it with outputs cleared"


if __name__ == "__main__":  # the job of test_notebook_runs: python tests/docs/test_notebooks.py NAME DIR
    executed, took = _run(sys.argv[1], Path(sys.argv[2]))
    nbformat.write(executed, Path(sys.argv[2]) / sys.argv[1])
    (Path(sys.argv[2]) / "seconds").write_text(repr(took))
