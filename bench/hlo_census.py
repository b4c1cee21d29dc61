"""A census of XLA's optimized programs in a dump directory: what each compiled step is made of.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*stack_step.*" python bench/stack.py ...
    python bench/hlo_census.py /tmp/dump [--module stack_step] [--json census.json]

Per module (``*after_optimizations.txt``, one per compiled program): the batch and length of
its ``hidden_states`` parameter (which stack case it is), the ``copy`` instructions of its
entry computation with what they copy (a cache leaf copied for a reader of its old value, an
aliased output, ...), its conditionals and custom calls, and, on the GPU, its thunks by kind
(``thunk_sequence.txt``: kCustomKernel = a kernel launch, kCopy = a device-to-device memcpy,
kConditional, kCustomCall), i.e. the nodes of the step's CUDA graph. Nothing is timed here: the
profiles (`bench/kernel_profile.py`) say what each costs.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re

_COPY = re.compile(r"^\s*%(\S+) = (\S+) copy\((%[^)]*)\)", re.M)
_HIDDEN = re.compile(r"%hidden_states[.\d]* = (\w+)\[([\d,]+)\]")
_CONDITIONAL = re.compile(r" conditional\(")
_CUSTOM_CALL = re.compile(r" custom-call\(")
_THUNK = re.compile(r"^\s*\d+: (k\w+)", re.M)
_DEFINED = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = ", re.M)


def census_of(hlo_text: str, thunk_text: str | None = None) -> dict:
    """The census of one optimized module (its text, and its GPU thunk sequence if any)."""
    entry = hlo_text[hlo_text.find("\nENTRY"):] if "\nENTRY" in hlo_text else hlo_text
    hidden = _HIDDEN.search(hlo_text)
    shape = [int(d) for d in hidden.group(2).split(",")] if hidden else None
    copies = [{"name": name, "shape": out, "of": operand.lstrip("%")} for name, out, operand in _COPY.findall(entry)]
    out = {
        "hidden_states": None if shape is None else f"{hidden.group(1)}{shape}",
        "batch": None if shape is None else shape[0],
        "tokens": None if shape is None or len(shape) < 2 else shape[1],
        "entry_copies": len(copies),
        "copies": copies,
        # Cache writes: the entry's scatters, or the dynamic-update-slices XLA made of them
        # (fusions are named after their root: "input_scatter_fusion.3", "wrapped_scatter").
        "scatters": sum(1 for name in _DEFINED.findall(entry)
                        if "scatter" in name or "dynamic-update-slice" in name or "dynamic_update_slice" in name),
        "conditionals": len(_CONDITIONAL.findall(hlo_text)),
        "custom_calls": len(_CUSTOM_CALL.findall(hlo_text)),
    }
    if thunk_text is not None:
        out["thunks"] = dict(collections.Counter(_THUNK.findall(thunk_text)).most_common())
    return out


def census(dump_dir: str, module: str = "stack_step") -> list[dict]:
    """The census of every optimized module in `dump_dir` whose name contains `module`."""
    rows = []
    pattern = os.path.join(dump_dir, f"*{module}*after_optimizations.txt")
    for path in sorted(glob.glob(pattern)):
        prefix = path[: path.index(".", path.index(module))]  # module_NNNN.jit_<name>
        thunks = glob.glob(prefix + ".thunk_sequence.txt")
        with open(path) as f:
            text = f.read()
        thunk_text = None
        if thunks:
            with open(thunks[0]) as f:
                thunk_text = f.read()
        rows.append({"module": os.path.basename(prefix), **census_of(text, thunk_text)})
    return rows


def compiled_stacks(size: str, stacks: list[str], batches: list[int], n_layers: int = 2,
                    context: int = 64) -> list[dict]:
    """The census of `bench/stack.py`'s decode step compiled here, on the default backend (no
    dump needed): one row per stack kind and batch, for a program's copies and cache writes
    on a machine without the GPU (XLA:CPU inserts copies for the same reasons XLA:GPU does,
    though not always the same ones)."""
    import sys

    import jax.numpy as jnp

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench import stack as stack_bench

    rows = []
    for kind in stacks:
        cfg = stack_bench.stack_config(size, n_layers)
        stack = stack_bench.Stack(cfg, kind, n_layers, jnp.float32, 0, "none")
        for batch in batches:
            caches = stack.synthetic_caches(batch, stack_bench._round_up(context + 64), context, 0)
            x = stack_bench._hidden(cfg, batch, 1, stack.dtype, 0)
            positions = stack_bench._positions(batch, context, 1)
            compiled = stack.jits[None].lower(stack.weights, caches, x, positions, specs=stack.specs).compile()
            name = f"stack_step {kind} x{n_layers} B={batch} ({size})"
            rows.append({"module": name, **census_of(compiled.as_text())})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| module | hidden_states | entry copies | cache writes | conditionals | custom calls | thunks |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        thunks = ", ".join(f"{k} {v}" for k, v in r.get("thunks", {}).items()) or "-"
        lines.append(f"| {r['module']} | {r['hidden_states']} | {r['entry_copies']} | {r.get('scatters', '-')} | "
                     f"{r['conditionals']} | {r['custom_calls']} | {thunks} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump_dir", nargs="?", help="an XLA dump directory (or --compile-stack)")
    ap.add_argument("--module", default="stack_step", help="part of the module names to take (default stack_step)")
    ap.add_argument("--compile-stack", metavar="SIZE", default=None,
                    help="compile bench/stack.py's decode step here instead (e.g. tiny), see --stacks, --batches")
    ap.add_argument("--stacks", default="csa,hca")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    if args.compile_stack:
        rows = compiled_stacks(args.compile_stack, args.stacks.split(","), [int(b) for b in args.batches.split(",")])
    elif args.dump_dir:
        rows = census(args.dump_dir, args.module)
    else:
        ap.error("give a dump directory or --compile-stack SIZE")
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
