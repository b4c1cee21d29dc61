"""Decode at the floor the way users run it (issue 68): the decode loops side by side, in one process.

    python bench/loops.py --size flash --json $OUT/loops.json                 # the H200 run (gpu.sh loops)
    python bench/loops.py --size tiny --json /tmp/loops.json                  # seconds, CPU smoke
    python bench/loops.py --render bench/results/<run>.json                   # tables of a past run

One stack of N layers (`bench/stack.py`'s `Stack`: ``--stacks csa,hca``, N = 4, random weights)
decodes from the same synthetic caches (every leaf random, ``length`` = context; made again from
the seed for each loop) and the same hidden states, the same number of steps, each step fed the
last one's output, in each way a user may write the loop (records' ``loop``):

``same_buffers``  the package's fastest loop: the stack's pure steps in one `jax.jit`, no positions
                  argument, caches and hidden states donated (``stack.py --same-buffers all``,
                  `dsv4_jax.tools.demo.stack_decode_step`): the same buffers every step.
``usual``         the same jitted stack with a positions array each step (uploaded before the
                  clock) and a new output each step (the caches donated): ``stack.py``'s usual steps.
``own_jit``       a Flax user's natural loop: ``nnx.jit`` of a function of the layers (`decode`
                  below: the module calls with ``positions=None``, the caches passed in and
                  returned), nothing donated. `nnx.jit` walks the modules' graph every call.
``own_jit_fast``  the same function through `dsv4_jax.jit_modules` (the modules split once, the
                  CSA layers' fused input projections made once, the layers' compile options),
                  the caches and hidden states donated: the fast path for NNX users.
``module_calls``  the same function called eagerly: one module call a layer (``attn(h, None, cache)``,
                  the layers' defaults: checks, finite verdict, host length mirror).

Per loop and (stack, B, context): the compile (the two warm-up steps: ``compile_s`` by JAX's
compile events, ``first_call_s`` their wall time) apart, then `bench/stack.py`'s timing
(`stack.timed_steps`: ``--repeats`` x ``--steps`` pipelined steps timed as a whole, then
``--steps`` blocking ones). ``per_layer_ms``, ``floor_ms`` (the stack's bytes floor a layer,
`bench/floor.py`), ``ratio_to_floor`` (GPU only), ``ratio_to_same_buffers`` (the same cell's
same_buffers loop, this process), ``output_digest`` and ``max_abs_diff_to_same_buffers`` (the
hidden states after the last step: every loop computes the same thing).

``--deadline-s``: no new cell starts past this many seconds of the run; the cells left are
recorded as skipped (a device call has a hard limit: the records so far are written as they come).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench import measure, report  # noqa: E402
from bench import stack as stack_mod  # noqa: E402
from dsv4_jax.layer.jit_modules import jit_modules  # noqa: E402

LOOPS = ("same_buffers", "usual", "own_jit", "own_jit_fast", "module_calls")
WARM = 2  # warm-up steps of every loop (the first compiles)


def decode(layers, hidden_states, caches):
    """A user's decode step of a stack of layers: ``h = h + attn(h)`` through the module calls,
    each row's next position from its cache (``positions=None``). The three loops of the user
    (``own_jit``, ``own_jit_fast``, ``module_calls``) run this very function."""
    h, new_caches = hidden_states, []
    for layer, cache in zip(layers, caches):
        out, cache = layer(h, None, cache)
        h = h + out
        new_caches.append(cache)
    return h, new_caches


own_jit_decode = nnx.jit(decode)  # as a Flax user writes it


class Loop:
    """One loop's state (hidden states, caches) and ``step()``: dispatch one decode step of the
    stack, feed its output to the next, return what it made (to block on)."""

    def __init__(self, name: str, stack: stack_mod.Stack, caches: list, x, context: int, total: int):
        self.name, self.stack, self.h = name, stack, x + 0  # a copy: some loops donate what they are fed
        if name in ("same_buffers", "usual"):
            self.caches = caches  # the pure step's form: layer_idx -1, device lengths
        else:  # the module call's: each cache names its layer
            self.caches = [c.replace(layer_idx=i) for c, i in zip(caches, stack.indices)]
        if name == "usual":
            batch = x.shape[0]
            self.positions = [stack_mod._positions(batch, context + i, 1) for i in range(total)]
            jax.block_until_ready(self.positions)  # uploaded before the clock
            self.at = 0
        if name == "own_jit_fast":
            self.fast = jit_modules(decode, stack.layers, donate_argnames=("hidden_states", "caches"))
        self.step = getattr(self, f"_{name}")

    def _same_buffers(self):
        st = self.stack
        self.h, self.caches = st.jits["all"](st.weights, self.caches, self.h, specs=st.specs)
        return self.h, self.caches

    def _usual(self):
        st = self.stack
        self.h, self.caches = st.jits[None](st.weights, self.caches, self.h, self.positions[self.at], specs=st.specs)
        self.at += 1
        return self.h, self.caches

    def _own_jit(self):
        self.h, self.caches = own_jit_decode(self.stack.layers, self.h, self.caches)
        return self.h, self.caches

    def _own_jit_fast(self):
        self.h, self.caches = self.fast(self.h, self.caches)
        return self.h, self.caches

    def _module_calls(self):
        self.h, self.caches = decode(self.stack.layers, self.h, self.caches)
        return self.h, self.caches


def time_loop(stack: stack_mod.Stack, loop: str, batch: int, context: int, steps: int, repeats: int,
              seed: int) -> tuple[dict, np.ndarray]:
    """One loop's record fields at (batch, context), and its hidden states after the last step
    (host float32)."""
    total = WARM + repeats * steps + steps
    max_seq_len = stack_mod._round_up(context + total)
    x = stack_mod._hidden(stack.cfg, batch, 1, stack.dtype, seed)
    runner = Loop(loop, stack, stack.synthetic_caches(batch, max_seq_len, context, seed), x, context, total)
    clock = measure.compile_clock()
    clock.start()
    t0 = time.perf_counter()
    for _ in range(WARM):
        out = runner.step()
    jax.block_until_ready(out)
    first_s = time.perf_counter() - t0
    compile_s = clock.stop()
    timings, (h, _) = stack_mod.timed_steps(runner.step, steps, repeats, len(stack.layers))
    h_host = np.asarray(h.astype(jnp.float32))
    del runner, out, h
    return ({**timings, "compile_s": compile_s, "first_call_s": first_s, "max_seq_len": max_seq_len,
             "steps": steps, "repeats": repeats, "total_steps": total, "output_finite": bool(np.isfinite(h_host).all()),
             "output_digest": stack_mod.digest(h_host),
             **stack.floor(batch, context + WARM + repeats * steps // 2, 1)}, h_host)


def cells(stacks: list, batches: list, contexts: list) -> list:
    """(stack, batch, context) in the order they run: by context, then batch, then stack, so that a
    run cut short has lost the longest contexts of every stack alike."""
    return [(kind, b, c) for c in contexts for b in batches for kind in stacks]


def run(args, write=None) -> tuple[list, dict]:
    start = time.perf_counter()
    cfg = stack_mod.stack_config(args.size, args.layers_per_stack)
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    env = stack_mod.environment()
    loops = args.loops.split(",")
    unknown = sorted(set(loops) - set(LOOPS))
    if unknown:
        raise ValueError(f"--loops: expected names of {LOOPS}, got {unknown}")
    if "same_buffers" not in loops:
        raise ValueError(f"--loops: the ratios are to the same_buffers loop; expected it among them, got {loops}")
    loops = ["same_buffers"] + [name for name in loops if name != "same_buffers"]  # the reference first
    meta = {"size": args.size, "dtype": dtype.name, "argv": sys.argv[1:], "n_layers": args.layers_per_stack,
            "stacks": args.stacks, "loops": loops, "mode": args.mode, "deadline_s": args.deadline_s, **env}
    stacks = {kind: stack_mod.Stack(cfg, kind, args.layers_per_stack, dtype, args.seed, args.mode)
              for kind in args.stacks.split(",")}
    records: list[dict] = []
    grid = cells(list(stacks), [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")])
    for kind, batch, context in grid:
        stack = stacks[kind]
        base = {"scenario": "stack_decode", "batch": batch, "context_len": context, "size": args.size, "stack": kind,
                "layer_type": stack.layer_type, "n_layers": len(stack.layers), "layer_indices": stack.indices,
                "mode": args.mode, "dtype": dtype.name, "overlap": stack.overlap,
                "overlap_active": stack.overlap_active, **env}
        late = args.deadline_s is not None and time.perf_counter() - start > args.deadline_s
        reference = None
        for loop in loops:
            rec = {**base, "loop": loop, "error": None}
            if late:
                rec["error"] = f"skipped: past --deadline-s {args.deadline_s:g} s"
            elif loop != "same_buffers" and reference is None:
                rec["error"] = "skipped: the same_buffers loop of this cell failed"
            else:
                try:
                    fields, h = time_loop(stack, loop, batch, context, args.steps, args.repeats, args.seed)
                    rec.update(fields)
                    rec["ratio_to_floor"] = rec["per_layer_ms"] / rec["floor_ms"] if gpu else None
                    if loop == "same_buffers":
                        reference = (rec["per_layer_ms"], h)
                    rec["ratio_to_same_buffers"] = rec["per_layer_ms"] / reference[0]
                    rec["max_abs_diff_to_same_buffers"] = float(np.max(np.abs(h - reference[1])))
                except Exception as err:
                    rec["error"] = report.error_text(err)
            records.append(rec)
            print(_line(rec), file=sys.stderr, flush=True)
            if write:
                write(records, meta)
    return records, meta


def _line(rec: dict) -> str:
    head = f"loops {rec['stack']} B{rec['batch']} L{rec['context_len']} {rec['loop']}"
    if rec.get("error"):
        return f"{head}: ERROR {rec['error']}"
    ratio = rec.get("ratio_to_floor")
    return (f"{head}: {rec['per_layer_ms']:.3f} ms/layer (x{rec['ratio_to_same_buffers']:.2f} same buffers, "
            f"floor {rec['floor_ms']:.3f}" + (f", x{ratio:.2f} floor" if ratio else "")
            + f"), host {rec['host_dispatch_ms']:.3f} ms/step, compile {rec['compile_s']:.1f} s, "
            f"max diff {rec['max_abs_diff_to_same_buffers']:.1e}")


def markdown(records: list, meta: dict) -> str:
    """One table: per (stack, B, context), each loop's ms a layer, its ratio to same_buffers and
    to the floor, the host's dispatch time a step, the compile."""
    out = [f"Decode loops, stacks of {meta.get('n_layers')} layers, {meta.get('size')}, {meta.get('dtype')}, "
           f"{meta.get('device')}, jax {meta.get('jax_version')}, flax {meta.get('flax_version')}", "",
           "| stack | B | ctx | loop | ms / layer | x same buffers | x floor | host ms / step | "
           "blocking step ms | compile s | max diff |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        cell = f"| {r['stack']} | {r['batch']} | {r['context_len']} | {r['loop']} |"
        if r.get("error"):
            out.append(f"{cell} {r['error'][:80]} | | | | | | |")
            continue
        ratio = r.get("ratio_to_floor")
        out.append(f"{cell} {r['per_layer_ms']:.3f} | {r['ratio_to_same_buffers']:.2f} | "
                   f"{'' if ratio is None else f'{ratio:.2f}'} | {r['host_dispatch_ms']:.3f} | "
                   f"{r['step_ms_blocking']:.3f} | {r['compile_s']:.1f} | {r['max_abs_diff_to_same_buffers']:.1e} |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=("tiny", "small", "flash"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--stacks", default="csa,hca", help="comma list of bench/stack.py stacks (mixed, csa, hca)")
    ap.add_argument("--layers-per-stack", type=int, default=4)
    ap.add_argument("--loops", default=",".join(LOOPS), help=f"comma list of {', '.join(LOOPS)} (same_buffers runs "
                                                              "first in every cell: the ratios' reference)")
    ap.add_argument("--batches", default=None, help="decode batches (default 1,8,32; tiny: 1,2)")
    ap.add_argument("--contexts", default=None, help="decode contexts (default 2048,16384,131072; tiny: 64)")
    ap.add_argument("--steps", type=int, default=None, help="steps per repeat (default 16; tiny: 4)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats (default 5; tiny: 2)")
    ap.add_argument("--mode", default="none", help="the layers' bench/plan.py mode (default: none)")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no new cell past this many seconds of the run (the rest recorded as skipped)")
    ap.add_argument("--render", default=None, metavar="JSON")
    return ap


def fill_defaults(args) -> None:
    tiny = args.size == "tiny"
    args.batches = args.batches or ("1,2" if tiny else "1,8,32")
    args.contexts = args.contexts or ("64" if tiny else "2048,16384,131072")
    args.steps = args.steps or (4 if tiny else 16)
    args.repeats = args.repeats or (2 if tiny else 5)


def main(argv=None) -> int:
    return report.scenario_main(argv, build_parser, fill_defaults, run, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
