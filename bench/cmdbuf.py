"""Count XLA:GPU command buffers (CUDA graphs) and what stays outside them, per break mode.

XLA turns runs of convertible thunks into command buffers after compilation
(`command_buffer_conversion_pass`); a host callback is not convertible, so it splits the run:
the JAX analogue of vLLM's eager break. With ``TF_CPP_VMODULE=command_buffer_conversion_pass=3``
the pass logs

* ``Module <name> CommandBufferConfig: ...``                    once per compiled module,
* ``Creating command buffer thunk <id> with the following thunks: a, b, ...``  per graph,
* ``Thunk kind <K> is not lowered to command buffer because command size is less than the
  min graph size``                                               per thunk of a too-short run,
* ``Unsupported thunk kind: <K>``                                per thunk that cannot be recorded.

`probe()` runs one decode step per (layer, mode) in a child process with that logging on (and
an XLA dump of the step's thunk sequence), and `parse()` attributes the lines to the step
module ``jit_attention_step`` between markers the child prints. Breaks per step are also read
from the program itself: the number of Python-callback custom calls in the lowered step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

MARK = "@@BENCH_CMDBUF"
STEP_MODULE = "attention_step"


def parse(log: str) -> dict:
    """{(layer, mode): counts} from the child's stderr (see the module docstring)."""
    results: dict = {}
    current = None
    module = None
    for line in log.splitlines():
        if MARK in line:
            m = re.search(MARK + r" (begin|end) layer=(\w+) mode=([\w-]+)", line)
            if m and m.group(1) == "begin":
                current = (m.group(2), m.group(3))
                results[current] = {"command_buffers": 0, "thunks_in_command_buffers": 0,
                                    "thunks_not_graphed_min_size": 0, "unsupported_thunks": [],
                                    "modules": 0, "graphs": []}
            else:
                current = None
            module = None
            continue
        if current is None:
            continue
        m = re.search(r"Module (\S+) CommandBufferConfig", line)
        if m:
            module = m.group(1)
            if STEP_MODULE in module:
                results[current]["modules"] += 1
            continue
        if module is None or STEP_MODULE not in module:
            continue
        r = results[current]
        m = re.search(r"Creating command buffer thunk(?: (\S+))? with the following thunks: (.*)$", line)
        if m:
            thunks = [t for t in m.group(2).split(", ") if t]
            r["command_buffers"] += 1
            r["thunks_in_command_buffers"] += len(thunks)
            r["graphs"].append(len(thunks))
            continue
        if "is not lowered to command buffer because command size is less than the min graph size" in line:
            r["thunks_not_graphed_min_size"] += 1
            continue
        m = re.search(r"Unsupported thunk kind: (\S+)", line)
        if m:
            r["unsupported_thunks"].append(m.group(1))
    return results


def top_level_thunks(text: str) -> dict:
    """Kinds of the top-level thunks in a ``*thunk_sequence_after_thunk_passes.txt`` dump.

    Top-level lines are unindented (``017: kCustomCall [...]``); the thunks recorded inside a
    command buffer are indented under its ``kCommandBuffer`` line. The sequence the GPU runs
    per step is: each top-level command buffer is one CUDA-graph launch, every other
    top-level thunk is launched on its own (a host callback is a ``kCustomCall``).
    """
    kinds: dict = {}
    order = []
    inside = 0
    for line in text.splitlines():
        m = re.match(r"^(\d+): (k\w+)", line)
        if m:
            kinds[m.group(2)] = kinds.get(m.group(2), 0) + 1
            order.append(m.group(2))
        elif re.match(r"^\s+\d+: k\w+", line):
            inside += 1
    graphs = kinds.get("kCommandBuffer", 0)
    return {"top_level": order, "command_buffers": graphs, "thunks_in_command_buffers": inside,
            "thunks_outside_command_buffers": len(order) - graphs,
            "custom_calls_outside": kinds.get("kCustomCall", 0)}


def probe(size: str, layers, modes, batch: int, context: int, out_dir: Path | None = None,
          timeout: int = 300) -> dict:
    """Run the child with the command-buffer VLOG on; returns {"layer/mode": counts, ...}."""
    import tempfile

    dump = Path(tempfile.mkdtemp(prefix="bench_xla_dump_"))
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    env["TF_CPP_VMODULE"] = "command_buffer_conversion_pass=3"
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} "
                        f"--xla_dump_hlo_module_re=.*{STEP_MODULE}.*").strip()
    env["BENCH_DUMP_DIR"] = str(dump)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # XLA must compile (its passes log, its dump) in the child
    cmd = [sys.executable, str(Path(__file__).resolve()), "--size", size, "--layers", ",".join(layers),
           "--modes", ",".join(modes), "--batch", str(batch), "--context", str(context)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    log = proc.stderr
    if out_dir is not None:
        (out_dir / "cmdbuf_vlog.txt").write_text(log[-4_000_000:])
        try:
            import tarfile

            with tarfile.open(out_dir / "cmdbuf_xla_dump.tar.gz", "w:gz") as tar:
                for f in sorted(dump.glob("*")):
                    if "thunk" in f.name or "after_optimizations.txt" in f.name:
                        tar.add(f, arcname=f.name)
        except Exception:
            pass
    counts = parse(log)
    result = {"returncode": proc.returncode, "context": context, "batch": batch,
              "xla_flags": os.environ.get("XLA_FLAGS", "")}
    try:
        child = json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception:
        child = {}
    for (layer, mode), c in counts.items():
        info = child.get(f"{layer}/{mode}") or {}
        c["host_callbacks_in_step"] = info.get("host_callbacks")
        c["thunk_dump"] = info.get("thunk_dump")
        del c["graphs"][16:]
        result[f"{layer}/{mode}"] = c
    if proc.returncode != 0:
        result["error_tail"] = log[-3000:]
    return result


def _child(argv=None) -> None:
    import argparse

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench import measure, plan

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="flash")
    ap.add_argument("--layers", default="csa,hca")
    ap.add_argument("--modes", default="none,narrow,wide")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=16384)
    a = ap.parse_args(argv)
    cfg = plan.config_for(a.size)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    callbacks = {}
    dump = Path(os.environ.get("BENCH_DUMP_DIR", "/nonexistent"))

    def dumped():
        return set(dump.glob(f"*{STEP_MODULE}*thunk_sequence_after_thunk_passes*")) if dump.is_dir() else set()

    for layer in a.layers.split(","):
        attn = measure.build_layer(cfg, plan.layer_index(cfg, layer), dtype, seed=0)
        attn.donate_cache = False
        max_len = int(np.ceil((a.context + 1) / 128) * 128)
        cache = attn.init_cache(a.batch, max_len)
        cache = cache.replace(length=np.full((a.batch,), a.context, np.int32))  # a decode step at `context`
        x = np.random.default_rng(0).standard_normal((a.batch, 1, cfg.hidden_size), np.float32)
        x = jnp.asarray(x).astype(dtype)
        pos = np.full((a.batch, 1), a.context, np.int32)
        jax.block_until_ready((x, cache))
        for mode in a.modes.split(","):
            plan.apply_mode(attn, mode)
            info = {"host_callbacks": measure.host_breaks(attn, x, pos, cache)}
            before = dumped()
            print(f"{MARK} begin layer={layer} mode={mode}", file=sys.stderr, flush=True)
            out, _ = attn(x, pos, cache)
            jax.block_until_ready(out)
            print(f"{MARK} end layer={layer} mode={mode}", file=sys.stderr, flush=True)
            new = sorted(dumped() - before)
            if new:
                info["thunk_dump"] = {"file": new[-1].name, **top_level_thunks(new[-1].read_text(errors="replace"))}
            callbacks[f"{layer}/{mode}"] = info
    print(json.dumps(callbacks), flush=True)


if __name__ == "__main__":
    _child()
