"""The README's first command runs `python -m dsv4_jax.demo`: it must keep working."""

from __future__ import annotations

from dsv4_jax import demo


def test_demo_runs_and_reports_agreement(capsys):
    demo.main(["--prompt", "13", "--steps", "2"])
    out = capsys.readouterr().out
    assert out.count("== layer") == 3
    assert out.count("picks identical") == 6 and "DIFFER" not in out
    for line in out.splitlines():
        if "vs one-shot prefill" in line:
            assert float(line.rsplit("rel err ", 1)[1]) < 2e-5
