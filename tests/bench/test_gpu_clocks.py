"""bench/gpu_clocks.py: the card's clocks sampled beside a timed loop (nvidia-smi), as the
training benchmark records them. nvidia-smi is stood in for by a script printing its lines."""

from __future__ import annotations

import stat
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gpu_clocks  # noqa: E402


def fake_smi(tmp_path: Path, first: list[str], later: list[str] = ()) -> str:
    """An executable that prints `first` at once and `later` 0.3 s on (as ``nvidia-smi
    --loop-ms`` would, one sample a line), then waits to be stopped."""
    path = tmp_path / "fake-smi"
    echo = lambda lines: "".join(f"echo '{line}'\n" for line in lines)  # noqa: E731
    path.write_text(f"#!/bin/sh\n{echo(first)}sleep 0.3\n{echo(later)}exec sleep 30\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def wait_for(clocks, n: int):
    """The timed loop's stand-in: runs until the sampler has read `n` lines in all (5 s at most)."""
    for _ in range(500):
        if len(clocks._lines) >= n:
            return
        time.sleep(0.01)


def test_a_line_is_a_sample_or_nothing():
    assert gpu_clocks.parse_line("1980, 412.35, 41, 0x0000000000000000\n") == {
        "sm_mhz": 1980.0, "power_w": 412.35, "temperature_c": 41.0, "event_reasons": 0}
    assert gpu_clocks.parse_line("[N/A], 412.35, 41, 0x0") is None
    assert gpu_clocks.parse_line('Field "clocks_event_reasons.active" is not a valid field to query.') is None


def test_the_summary_gives_ranges_and_names_the_reasons():
    samples = [gpu_clocks.parse_line(line) for line in
               ("1980, 400, 40, 0x0", "1755, 700, 52, 0x4", "1830, 690, 50, 0x0000000000000024")]
    got = gpu_clocks.summarise(samples)
    assert got["samples"] == 3
    assert got["sm_mhz"] == {"min": 1755.0, "median": 1830.0, "max": 1980.0}
    assert got["power_w"] == {"min": 400.0, "median": 690.0, "max": 700.0}
    assert got["temperature_c_max"] == 52.0
    assert got["event_reasons"] == "0x24"
    assert got["event_reason_names"] == ["sw_power_cap", "sw_thermal_slowdown"]
    assert gpu_clocks.summarise([]) == {"samples": 0}


def test_the_sampler_keeps_what_nvidia_smi_sampled_while_the_block_ran(tmp_path):
    # The first sample comes before the block starts (the sampler waits for it) and is left out.
    exe = fake_smi(tmp_path, ["1980, 90, 30, 0x1"], ["1980, 400, 40, 0x0", "1755, 700, 52, 0x4"])
    with gpu_clocks.ClockSampler(executable=exe) as clocks:
        assert len(clocks._lines) == 1
        wait_for(clocks, 3)
    assert clocks.summary["samples"] == 2 and clocks.summary["event_reason_names"] == ["sw_power_cap"]
    assert clocks.summary["sm_mhz"]["min"] == 1755.0 and clocks.summary["power_w"]["min"] == 400.0


def test_a_sampler_that_gets_no_sample_says_what_nvidia_smi_said(tmp_path):
    exe = fake_smi(tmp_path, ['Field "clocks_event_reasons.active" is not a valid field to query.'])
    with gpu_clocks.ClockSampler(executable=exe) as clocks:
        wait_for(clocks, 1)
    assert clocks.summary["samples"] == 0
    assert "not a valid field" in clocks.summary["error"]


def test_without_nvidia_smi_there_is_no_summary():
    with gpu_clocks.ClockSampler(executable="no-such-nvidia-smi") as clocks:
        pass
    assert clocks.summary is None


def test_a_sampler_that_cannot_start_says_why(tmp_path, monkeypatch):
    exe = fake_smi(tmp_path, ["1980, 400, 40, 0x0"])

    def refuse(*args, **kwargs):  # as a vfork exec racing another thread's memory map did in CI
        raise OSError(14, "Bad address")

    monkeypatch.setattr(gpu_clocks.subprocess, "Popen", refuse)
    with gpu_clocks.ClockSampler(executable=exe) as clocks:
        pass  # the timed loop runs all the same
    assert clocks.summary == {"samples": 0, "error": "OSError: [Errno 14] Bad address"}
