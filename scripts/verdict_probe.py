"""Where the module call's finite check costs on a GPU (issue 9's thin call): one flash CSA decode
step timed five ways, interleaved, medians of blocked calls: the jitted step; the finite guard
(`attention.finite_guard`) then the step on its output, blocking on the step's output only,
then also reading the guard's verdict after dispatching the step (what the module call does);
the module call with check_finite="host" and with True. Prints one line per way (ms).
(Until 2026-12-01 evening the check ran inside a separate checked step: the records of that
version, `bench/results/h200_verdict_probe_2026-12-01.txt`, came from this script's then form.)

    python scripts/verdict_probe.py [--size flash] [--reps 100]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import measure, stack  # noqa: E402
from bench import plan as plan_mod  # noqa: E402
from dsv4_jax import attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="flash")
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    cfg = plan_mod.config_for(args.size)
    attn = measure.build_layer(cfg, plan_mod.layer_index(cfg, "csa"), dtype, 0)
    attn.break_mode = "none"
    x = stack._hidden(cfg, 1, 64, jnp.dtype(dtype), 0)
    xs = stack._hidden(cfg, 1, 1, jnp.dtype(dtype), 1)
    n = 8 * args.reps + 128
    _, cache = attn(x, np.arange(64, dtype=np.int32)[None], attn.init_cache(1, n))
    spec, weights = attn.step_spec(), attn.step_weights()
    raw = measure.clone(cache).replace(length=jnp.asarray(cache.length), layer_idx=-1)
    plain, guard = attention.step_function(False), attention._FINITE_GUARD
    times = {k: [] for k in ("jit step", "guard + step, block on out", "guard + step + verdict", "module host",
                             "module True")}
    for i in range(args.reps + 5):
        p = np.full((1, 1), 64 + i, np.int32)
        t = [time.perf_counter()]
        jax.block_until_ready(plain(weights, raw, xs, p, spec=spec)[0])
        t.append(time.perf_counter())
        verdict, safe = guard(xs)
        jax.block_until_ready(plain(weights, raw, safe, p, spec=spec)[0])
        t.append(time.perf_counter())
        verdict, safe = guard(xs)
        out = plain(weights, raw, safe, p, spec=spec)
        bool(verdict)
        jax.block_until_ready(out[0])
        t.append(time.perf_counter())
        for mode in ("host", True):
            attn.check_finite = mode
            o, cache = attn(xs, np.full((1, 1), int(cache.length[0]), np.int32), cache)
            jax.block_until_ready(o)
            t.append(time.perf_counter())
        if i >= 5:
            for k, a, b in zip(times, t, t[1:]):
                times[k].append(b - a)
    print(f"verdict memory kind: {getattr(verdict.sharding, 'memory_kind', None)}")
    for k, v in times.items():
        print(f"{k:24s} {1e3 * float(np.median(v)):.3f} ms")


if __name__ == "__main__":
    main()
