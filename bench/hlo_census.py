"""A census of XLA's optimized programs in a dump directory: what each compiled step is made of.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*stack_step.*" python bench/stack.py ...
    python bench/hlo_census.py /tmp/dump [--module stack_step] [--json census.json]

Per module (``*after_optimizations.txt``, one per compiled program): the batch and length of
its ``hidden_states`` parameter (which stack case it is), the ``copy`` instructions of its
entry computation with what they copy (a cache leaf copied for a reader of its old value, an
aliased output, ...), its conditionals and custom calls, and, on the GPU, its thunks by kind
(``thunk_sequence.txt``: kCustomKernel = a kernel launch, kCopy = a device-to-device memcpy,
kConditional, kCustomCall), i.e. the nodes of the step's CUDA graph; with ``thunk_metadata.txt``
the launches by stage (each thunk's HLO instruction, a fusion's root, the step's named scopes:
`stages_of`), and with ``thunk_sequence_after_thunk_passes.txt`` the command buffers and what
runs between them (`graphs_of`). Nothing is timed here: the profiles (`bench/kernel_profile.py`)
say what each costs. `bench/deviceless.py` makes such a dump for the H200 on a machine without it.
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
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
TRITON = "__gpu$xla.gpu.triton"  # a Pallas kernel lowered for a GPU
NATIVE = "dsv4_"  # the package's XLA FFI handlers (csrc/)
_THUNK = re.compile(r"^\s*\d+: (k\w+)", re.M)
_TOP_THUNK = re.compile(r"^\d+: (k\w+)", re.M)  # thunk_sequence_after_thunk_passes.txt: not nested
_DEFINED = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = ", re.M)
# thunk_metadata.txt: each thunk's HLO instruction (its profile annotation) and kind
_THUNK_META = re.compile(r'profile_annotation: "([^"]*)"[^}]*\}\s*thunk_kind: "(\w+)"')
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = .*$", re.M)
_COMPUTATION = re.compile(r"^%(\S+) \(.*?\{\n(.*?)\n\}", re.M | re.S)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_WORD = re.compile(r"\w+")

# The step's stages: its named scopes (`dsv4_jax.step.pure_step`), in the order a layer runs them.
STAGE_ORDER = ("input_projections", "wq_b_kv_insert", "compressor", "indexer_compressor", "indexer_queries",
               "indexer_select", "sparse_attention", "output_projection", "other")
# Thunks that hold others (a CUDA graph, a sequence, a branch, a loop); every other thunk is a launch
# (a kernel, a copy, a custom call).
CONTAINERS = ("kCommandBuffer", "kSequential", "kConditional", "kWhile")


def stage_of_op_name(op_name: str) -> str | None:
    """The stage an XLA operation belongs to from its op_name ("jit(stack_step)/input_projections/
    cond/.../dot_general"; under a gradient "transpose(jvp(...))" wrap the scopes): the first named
    scope of the step in it, "... (bwd)" inside a transpose, None if none."""
    for part in op_name.split("/"):
        for word in _WORD.findall(part):
            if word in STAGE_ORDER:
                return f"{word} (bwd)" if "transpose(" in op_name else word
    return None


def stages_of(hlo_text: str, metadata_text: str) -> dict:
    """Launches of the program by stage: each launching thunk (thunk_metadata.txt) is its HLO
    instruction's, a fusion the stage of its root (else of most of its operations), "other" where
    no stage is named (the positions from the cache lengths, the residual add between layers)."""
    instructions = {}
    for match in _INSTRUCTION.finditer(hlo_text):
        instructions.setdefault(match.group(1), match.group(0))
    bodies = {m.group(1): m.group(2) for m in _COMPUTATION.finditer(hlo_text)}

    def stage(name: str) -> str:
        line = instructions.get(name, "")
        calls = _CALLS.search(line)
        body = bodies.get(calls.group(1), "") if calls else ""
        root = [ln for ln in body.splitlines() if ln.lstrip().startswith("ROOT")]
        for names in (_OP_NAME.findall(root[0]) if root else [], _OP_NAME.findall(line)):
            found = [s for s in map(stage_of_op_name, names) if s]
            if found:
                return found[0]
        found = [s for s in map(stage_of_op_name, _OP_NAME.findall(body)) if s]
        return collections.Counter(found).most_common(1)[0][0] if found else "other"

    counts = collections.Counter(stage(name) for name, kind in _THUNK_META.findall(metadata_text)
                                 if kind not in CONTAINERS)
    return dict(sorted(counts.items(), key=lambda kv: stage_rank(kv[0])))


def stage_rank(stage: str) -> tuple:
    """Sort key: the forward stages in STAGE_ORDER, then the backward ones."""
    base = stage.removesuffix(" (bwd)")
    return (stage != base, STAGE_ORDER.index(base) if base in STAGE_ORDER else len(STAGE_ORDER))


# Entry instructions that launch nothing (views, tuples, values already in place).
_NOT_LAUNCHED = ("parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all", "opt-barrier",
                 "partition-id", "replica-id")
_ENTRY_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = (?:\([^=]*?\)|\S+) ([\w-]+)\((.*?)\)", re.M)


def critical_path(hlo_text: str) -> list[str]:
    """The longest chain of launches through the entry computation's data dependencies: each
    launch waits for the launches that made its operands, so however many run side by side (the
    overlap's concurrent command buffers), a step takes at least this chain's launches one after
    another. Returns the chain's instruction names, first to last."""
    entry = hlo_text[hlo_text.find("\nENTRY"):] if "\nENTRY" in hlo_text else hlo_text
    depth, best_from, launched = {}, {}, set()
    for name, opcode, operands in _ENTRY_INSTRUCTION.findall(entry):
        args = [a for a in re.findall(r"%([\w.\-]+)", operands) if a in depth]
        before = max(args, key=lambda a: depth[a], default=None)
        if opcode not in _NOT_LAUNCHED:
            launched.add(name)
        depth[name] = (depth[before] if before else 0) + (name in launched)
        best_from[name] = before
    if not depth:
        return []
    name, chain = max(depth, key=depth.get), []
    while name is not None:
        chain.append(name)
        name = best_from[name]
    return [n for n in reversed(chain) if n in launched]


def graphs_of(passes_text: str) -> dict:
    """The program's top level after XLA's thunk passes: its command buffers (CUDA graphs) and
    the launches between them (each a launch of its own, and a graph split)."""
    top = _TOP_THUNK.findall(passes_text)
    return {"command_buffers": top.count("kCommandBuffer"),
            "outside_command_buffers": dict(collections.Counter(k for k in top if k not in CONTAINERS))}


def census_of(hlo_text: str, thunk_text: str | None = None, metadata_text: str | None = None,
              passes_text: str | None = None) -> dict:
    """The census of one optimized module (its text, and its GPU thunk sequence, thunk metadata
    and thunk sequence after the thunk passes if any: the thunks by kind, the launches by
    stage, the command buffers)."""
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
        "custom_call_targets": dict(collections.Counter(_TARGET.findall(hlo_text))),
        "triton_calls": _TARGET.findall(hlo_text).count(TRITON),
        "native_calls": sum(t.startswith(NATIVE) for t in _TARGET.findall(hlo_text)),
        "critical_path": len(critical_path(hlo_text)),
    }
    if thunk_text is not None:
        out["thunks"] = dict(collections.Counter(_THUNK.findall(thunk_text)).most_common())
    if metadata_text is not None:
        out["stages"] = stages_of(hlo_text, metadata_text)
    if passes_text is not None:
        out.update(graphs_of(passes_text))
    return out


def census(dump_dir: str, module: str = "stack_step") -> list[dict]:
    """The census of every optimized module in `dump_dir` whose name contains `module`."""
    rows = []
    pattern = os.path.join(dump_dir, f"*{module}*after_optimizations.txt")
    for path in sorted(glob.glob(pattern)):
        prefix = os.path.join(dump_dir, ".".join(os.path.basename(path).split(".")[:2]))  # module_NNNN.jit_<name>
        texts = []
        for name in (path, prefix + ".thunk_sequence.txt", prefix + ".thunk_metadata.txt",
                     prefix + ".thunk_sequence_after_thunk_passes.txt"):
            texts.append(None)
            if os.path.exists(name):
                with open(name) as f:
                    texts[-1] = f.read()
        rows.append({"module": os.path.basename(prefix), **census_of(*texts)})
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
