"""The GPU's clocks, power and clock-event reasons while a timed loop runs (NVIDIA, nvidia-smi).

Two processes of one tree on one H200 have timed the same training step 8.77 and 9.72 ms a
layer (bench/RESULTS.md, "Training"): whether the card ran slower (a power cap, heat) or the
programs differed is a question the records could not answer. `ClockSampler` runs
``nvidia-smi --query-gpu=... --loop-ms=<interval>`` beside the loop, starts the loop after its
first sample, and summarises the samples taken while the loop ran:

    with ClockSampler() as clocks:
        ...  # the timed calls
    rec["gpu_clocks"] = clocks.summary  # None where there is no nvidia-smi (CPU runs)

``summary``: ``samples``; ``sm_mhz`` and ``power_w`` (min / median / max over the samples);
``temperature_c_max``; ``event_reasons`` (the union of the active clock-event reasons' bits, as
nvidia-smi prints them, e.g. "0x0000000000000004" = the software power cap; "0x0" none) and
``event_reason_names`` (the bits named, after NVML's ``nvmlClocksEventReasons``); or ``error``
when there is none (nvidia-smi would not sample, or the loop was shorter than its interval).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time

FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")

# NVML's clock-event reasons (nvml.h, nvmlClocksEventReason*): the bits that slow the clocks.
EVENT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def parse_line(line: str) -> dict | None:
    """One ``--format=csv,noheader,nounits`` line of `FIELDS` -> a sample, or None (not one)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return None
    try:
        return {"sm_mhz": float(parts[0]), "power_w": float(parts[1]), "temperature_c": float(parts[2]),
                "event_reasons": int(parts[3], 16)}
    except ValueError:  # "[N/A]", an error message
        return None


def summarise(samples: list[dict]) -> dict:
    """The samples' ranges (see the module's docstring); ``samples`` 0 gives the count alone."""
    out: dict = {"samples": len(samples)}
    if not samples:
        return out
    for key in ("sm_mhz", "power_w"):
        values = [s[key] for s in samples]
        out[key] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    out["temperature_c_max"] = max(s["temperature_c"] for s in samples)
    reasons = 0
    for s in samples:
        reasons |= s["event_reasons"]
    out["event_reasons"] = hex(reasons)
    out["event_reason_names"] = [name for bit, name in EVENT_REASONS.items() if reasons & bit]
    return out


class ClockSampler:
    """Samples the first GPU every `interval_ms` while the ``with`` block runs (see the module)."""

    def __init__(self, interval_ms: int = 20, executable: str = "nvidia-smi", start_timeout_s: float = 3.0):
        self.interval_ms = interval_ms
        self.start_timeout_s = start_timeout_s
        self.executable = shutil.which(executable)
        self.summary: dict | None = None
        self._proc = None
        self._lines: list[str] = []
        self._first = 0
        self._reader = None

    def __enter__(self):
        if self.executable is None:
            return self
        try:
            self._proc = subprocess.Popen(
                [self.executable, "--id=0", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                 f"--loop-ms={self.interval_ms}"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError as err:  # the timed loop runs anyway; the record says why it has no clocks
            self.summary = {"samples": 0, "error": f"{type(err).__name__}: {err}"}
            return self
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        # nvidia-smi takes ~0.1 s to its first sample, longer than a short timed loop: start the
        # block after it, and keep only the samples taken while the block ran.
        deadline = time.monotonic() + self.start_timeout_s
        while not self._lines and self._proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        self._first = len(self._lines)
        return self

    def _read(self):
        for line in self._proc.stdout:
            self._lines.append(line)

    def __exit__(self, *exc):
        if self._proc is None:
            return False
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=5)
        samples = [s for s in map(parse_line, self._lines[self._first:]) if s is not None]
        self.summary = summarise(samples)
        if not samples:
            said = "".join(self._lines).strip()[:200]
            self.summary["error"] = (f"no sample while the block ran; nvidia-smi printed: {said}" if said
                                     else "nvidia-smi printed nothing")
        return False
