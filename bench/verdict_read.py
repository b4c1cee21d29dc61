"""How fast the host learns a compiled step's scalar verdict (the module call's finite check).

    python bench/verdict_read.py --json $OUT/verdict_read.json      # on the H200
    python bench/verdict_read.py --quick                            # CPU smoke

The layer's eager call on accelerator inputs reads a finite verdict before it returns (it ran
inside the step, `finite_checked_step`, when this was measured; since then a small program
before the step writes it, `attention.finite_guard`, at the same measured cost a call). A step of
matmuls (about 1 ms on an H200 at the default sizes) returns (out, verdict); each way of
reading is timed per call, dispatch to verdict known, blocked, median of `--reps` calls after
a warm-up (the compile excluded), against blocking on `out` alone (`block`, the peer: what a
caller of the jitted step pays):

* ``bool``: ``bool(verdict)`` (what the layer did first);
* ``async``: ``verdict.copy_to_host_async()`` right after dispatch, then ``bool``;
* ``block_then_bool``: block on `out`, then ``bool(verdict)``;
* ``pinned``: the verdict an output in pinned host memory (``out_shardings`` with memory kind
  ``pinned_host``, where the device has it), then ``bool``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.stack import environment  # noqa: E402


def step(x, w, layers: int):
    finite = jnp.all(jnp.isfinite(x))
    y = jnp.where(finite, x, 0)
    for _ in range(layers):
        y = jnp.tanh(y @ w)
    return y, finite


def variants(layers: int) -> dict:
    plain = jax.jit(lambda x, w: step(x, w, layers))
    out = {"block": plain, "bool": plain, "async": plain, "block_then_bool": plain}
    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()} if hasattr(dev, "addressable_memories") else set()
    if "pinned_host" in kinds:
        from jax.sharding import SingleDeviceSharding

        out["pinned"] = jax.jit(lambda x, w: step(x, w, layers), out_shardings=(
            SingleDeviceSharding(dev), SingleDeviceSharding(dev, memory_kind="pinned_host")))
    return out


def call(how: str, fn, x, w) -> bool:
    y, verdict = fn(x, w)
    if how == "block":
        jax.block_until_ready(y)
        return True
    if how == "async":
        verdict.copy_to_host_async()
    if how == "block_then_bool":
        jax.block_until_ready(y)
    ok = bool(verdict)
    jax.block_until_ready(y)
    return ok


def run(args) -> list:
    n, layers = (256, 2) if args.quick else (args.size, args.layers)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n, n)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(n, n)) / np.sqrt(n), jnp.bfloat16)
    records = []
    fns = variants(layers)
    for how, fn in fns.items():
        for _ in range(3):
            assert call(how, fn, x, w)  # compile and warm up
    times = {how: [] for how in fns}
    for _ in range(args.reps):  # interleaved: a drift of the machine hits every variant alike
        for how, fn in fns.items():
            t0 = time.perf_counter()
            call(how, fn, x, w)
            times[how].append(time.perf_counter() - t0)
    base = float(np.median(times["block"])) * 1e3
    for how, t in times.items():
        ms = float(np.median(t)) * 1e3
        records.append({"scenario": "verdict_read", "how": how, "ms": ms, "over_block_ms": ms - base,
                        "reps": args.reps, "size": n, "layers": layers})
        print(f"{how:16s} {ms:.3f} ms  (+{ms - base:.3f} over block)", flush=True)
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    records = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": environment(), "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
