"""Test helpers: the recorded reference runs (tests/data), layer builders, the execution modes,
the jobs run beside the session. (A layer over a schedule of calls: `dsv4_jax.tools.diagnostics.run_schedule`.)"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4_jax
from dsv4_jax import native

DATA = Path(__file__).parent / "data"
# V4-Flash's attention heads (64 of 512: the sizes of the CUDA backward handler and of the kernels'
# largest blocks) in an otherwise tiny layer with a 32-key window and 16 picks.
FLASH_HEADS_CFG = dsv4_jax.DeepseekV4Config.tiny(hidden_size=256, num_attention_heads=64, head_dim=512,
                                                 qk_rope_head_dim=64, q_lora_rank=64, o_groups=8, o_lora_rank=64,
                                                 sliding_window=32, index_n_heads=8, index_head_dim=64, index_topk=16)
GOLDEN_FILES = ("tiny_seed1.npz", "small_seed0.npz")


@dataclasses.dataclass
class Golden:
    """One recorded HF run: config, per-layer weights, and per-call inputs/outputs."""

    name: str
    cfg: dsv4_jax.DeepseekV4Config
    meta: dict
    data: dict

    @property
    def schedule(self) -> list[int]:
        return self.meta["schedule"]

    @property
    def batch(self) -> int:
        return self.meta["batch"]

    def weights(self, layer: int) -> dict[str, np.ndarray]:
        prefix = f"layer{layer}/params/"
        return {k[len(prefix):]: v for k, v in self.data.items() if k.startswith(prefix)}

    def call(self, layer: int, c: int) -> dict[str, np.ndarray]:
        prefix = f"layer{layer}/call{c}/"
        out = {k[len(prefix):]: v for k, v in self.data.items() if k.startswith(prefix)}
        out["positions"] = np.broadcast_to(out["positions"], out["hidden"].shape[:2]).astype(np.int32)
        return out

    def hidden_all(self, layer: int) -> np.ndarray:
        """All calls' inputs concatenated: the whole sequence [B, N, hidden]."""
        return np.concatenate([self.call(layer, c)["hidden"] for c in range(len(self.schedule))], axis=1)

    def out_all(self, layer: int) -> np.ndarray:
        return np.concatenate([self.call(layer, c)["out"] for c in range(len(self.schedule))], axis=1)


def load_golden(name: str) -> Golden:
    with np.load(DATA / name) as f:
        data = {k: f[k] for k in f.files}
    meta = json.loads(bytes(data.pop("meta")).decode())
    return Golden(name=name, cfg=dsv4_jax.DeepseekV4Config.from_hf(meta["hf_config"]), meta=meta, data=data)


# Every way the layer can execute: name -> layer arguments. "none" is the XLA reference
# (`lax.top_k`); the native ones run the C++/CUDA handlers (dsv4_jax.native) and are skipped
# where those are not built.
EXECUTIONS = {
    "none": dict(break_mode="none", kernels="xla"),
    "none-native": dict(break_mode="none", kernels="native"),
    "narrow-host": dict(break_mode="narrow", break_on="host"),
    "narrow-device": dict(break_mode="narrow", break_on="device"),
    "wide": dict(break_mode="wide"),
}
NATIVE_BUILT = dsv4_jax.native_info()[native.platform_name(jax.default_backend())]["usable"]


def runnable(name: str) -> bool:
    """Whether an execution mode can run here (the native ones need the built handlers)."""
    return NATIVE_BUILT or not ("native" in name or "device" in name)


def execution(name: str) -> dict:
    """The layer arguments of an execution mode; skips the test where it cannot run here."""
    if not runnable(name):
        pytest.skip(f"{name}: {native.unavailable_reason(jax.default_backend())}")
    return dict(EXECUTIONS[name])


_BUILT: dict = {}


def new_layer(cfg, layer: int, seed: int, **kwargs) -> dsv4_jax.DeepseekV4Attention:
    """``DeepseekV4Attention(cfg, layer, rngs=nnx.Rngs(seed), **kwargs)``: a clone (`nnx.clone`: its
    own variables over the same immutable arrays) of the first layer built with these arguments
    in this process. Building runs the initializers eagerly, every operation compiled for its
    shapes: about 2.5 s in each test file (conftest drops the compiled programs after each file),
    where a clone costs none. Built afresh under a mesh (the arrays' placement follows it)."""
    try:
        key = (cfg, layer, seed, tuple(sorted(kwargs.items())))
        hash(key)
    except TypeError:
        key = None
    if key is None or not jax.sharding.get_abstract_mesh().empty or not _physical_mesh().empty:
        return dsv4_jax.DeepseekV4Attention(cfg, layer, rngs=nnx.Rngs(seed), **kwargs)
    if key not in _BUILT:
        _BUILT[key] = dsv4_jax.DeepseekV4Attention(cfg, layer, rngs=nnx.Rngs(seed), **kwargs)
    return nnx.clone(_BUILT[key])


def _physical_mesh():
    from jax._src.mesh import thread_resources  # the mesh of a `with mesh:` block

    return thread_resources.env.physical_mesh


def golden_layer(g: Golden, layer: int, break_mode: str = "narrow", **kwargs) -> dsv4_jax.DeepseekV4Attention:
    attn = new_layer(g.cfg, layer, 0, break_mode=break_mode, **kwargs)
    dsv4_jax.load_hf_attention_weights(attn, g.weights(layer))
    return attn


@functools.cache
def tiny_golden_layer(layer: int) -> dsv4_jax.DeepseekV4Attention:
    """The tiny recording's (tiny_seed1.npz) layer `layer`, made once per process (property tests)."""
    return golden_layer(load_golden("tiny_seed1.npz"), layer)


def fail_on_the_host(monkeypatch, error: BaseException) -> dict:
    """Make the indexer's selection raise `error` on its NumPy side (a host break) while the
    returned switch's ``"on"`` is set; its in-graph (XLA) twin stays as it was. A step that is
    to fail must be traced after this (e.g. with a `query_block` no other test compiled)."""
    from dsv4_jax.ops.indexer import reference as indexer

    switch = {"on": False}
    original = indexer.select_topk

    @functools.wraps(original)
    def failing(queries, *args, **kwargs):
        if switch["on"] and isinstance(queries, np.ndarray):  # the NumPy side, i.e. on the host
            raise error
        return original(queries, *args, **kwargs)

    monkeypatch.setattr(indexer, "select_topk", failing)
    return switch


def random_layer(cfg, layer: int, seed: int = 0, break_mode: str = "narrow", **kwargs):
    """A layer with every parameter random, position biases and sinks included (they init to 0)."""
    attn = new_layer(cfg, layer, seed, break_mode=break_mode, **kwargs)
    rng = np.random.default_rng(seed + 1000)
    state = nnx.state(attn, nnx.Param)
    for path, var in sorted(nnx.to_flat_state(state), key=lambda kv: str(kv[0])):
        name = str(path[-1])
        arr = np.asarray(var[...], np.float32)
        if name in ("position_bias", "sinks"):
            arr = rng.normal(0.0, 1.0, arr.shape)
        elif name.endswith("norm"):
            arr = 1.0 + 0.2 * rng.normal(size=arr.shape)
        var[...] = jnp.asarray(arr, var[...].dtype)
    return attn


def prefill_then_decode(attn, hidden, prefill: int, max_seq_len: int = 32):
    """A prompt of `prefill` tokens a row, then one token a step to the end of `hidden` [B, S, hidden]:
    (the outputs [B, S, hidden] as NumPy, the final cache's leaves)."""
    b, s = hidden.shape[:2]
    cache = attn.init_cache(b, max_seq_len)
    out, cache = attn(hidden[:, :prefill], jnp.tile(jnp.arange(prefill, dtype=jnp.int32), (b, 1)), cache)
    outs = [np.asarray(out)]
    for t in range(prefill, s):
        out, cache = attn(hidden[:, t:t + 1], jnp.full((b, 1), t, jnp.int32), cache)
        outs.append(np.asarray(out))
    return np.concatenate(outs, axis=1), jax.tree.leaves(cache)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def pad_picks(picks: np.ndarray, k: int) -> np.ndarray:
    """Golden picks have min(K, T) columns; the layer always returns K (-1 padded)."""
    missing = k - picks.shape[-1]
    if missing <= 0:
        return picks.astype(np.int32)
    return np.concatenate([picks, -np.ones((*picks.shape[:-1], missing), picks.dtype)], -1).astype(np.int32)


def assert_trees_close(got, expected, what: str, *, rtol: float, atol: float, same_dtypes: bool = False) -> None:
    """Two pytrees of arrays agree: the same structure, integer leaves (picks, lengths) equal,
    float leaves within `rtol`/`atol`; with `same_dtypes`, every leaf's dtype and shape too."""
    g_leaves, g_tree = jax.tree.flatten(got)
    e_leaves, e_tree = jax.tree.flatten(expected)
    assert g_tree == e_tree, what
    for i, (g, e) in enumerate(zip(g_leaves, e_leaves)):
        g, e = np.asarray(g), np.asarray(e)
        if same_dtypes:
            assert g.dtype == e.dtype and g.shape == e.shape, (what, i)
        if g.dtype.kind in "iu":
            np.testing.assert_array_equal(g, e, err_msg=f"{what}: leaf {i}")
        else:
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=f"{what}: leaf {i}")


# ---------------------------------------------------------------------------- jobs in the background
# The tests of a command run in a fresh process (the 8-device sharding run, the notebooks, the
# demo, the benchmarks' smoke runs) spend their time in that process: conftest.py starts the
# selected tests' jobs when the session starts, one after another on a thread of their own, so
# they run on the machine's other core while this process compiles; each test then waits for its
# job and checks what it left. A job no one started runs when its test asks for it.
@dataclasses.dataclass(eq=False)
class Job:
    """A command whose output the test reads: `command(workdir)` -> argv, run in `cwd` with `env`
    (None: this process's); its files go to `workdir`, a fresh temporary folder."""

    command: Callable[[Path], list]
    env: dict | None = None
    cwd: Path | None = None
    timeout: float = 900
    workdir: Path | None = None
    proc: subprocess.Popen | None = None
    timed_out: bool = False
    name: str = ""
    seconds: float | None = None  # the command's wall time, once it ran
    waited: float = 0.0  # how long a test waited for it (the session's critical path when > 0)
    error: BaseException | None = None  # what stopped the job before its command ended, if anything
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def run(self) -> None:
        """Run the command to its end (once; a second call waits for the first). Whatever stops
        it (the command not starting, the session stopping) still marks it done, with `error`
        set, so that a test waiting for it fails instead of waiting forever."""
        with self._lock:
            if self.done.is_set():
                return
            try:
                if JOBS.stopping:
                    raise RuntimeError(f"job {self.name!r}: the session is stopping")
                self.workdir = Path(tempfile.mkdtemp(prefix="dsv4-test-job-"))
                args = [str(a) for a in self.command(self.workdir)]
                start = time.monotonic()
                with open(self.workdir / "stdout", "w") as out, open(self.workdir / "stderr", "w") as err:
                    self.proc = _start(args, cwd=self.cwd, env=self.env, stdout=out, stderr=err)
                    try:
                        self.proc.wait(timeout=self.timeout)
                    except subprocess.TimeoutExpired:
                        self.timed_out = True
                        self.proc.kill()
                        self.proc.wait()
                self.seconds = time.monotonic() - start
            except BaseException as e:  # reported to the waiting test by `result`
                self.error = e
            finally:
                self.done.set()

    def result(self) -> subprocess.CompletedProcess:
        """Wait for the job (run it here if no one has started it); its exit status and output.
        Raises subprocess.TimeoutExpired where it ran past `timeout` (it was killed), and
        RuntimeError where it did not run to its end (the cause chained) or was not done within
        twice its timeout."""
        if JOBS.started(self):
            start = time.monotonic()
            finished = self.done.wait(timeout=2 * self.timeout)
            self.waited += time.monotonic() - start
            if not finished:
                raise RuntimeError(f"job {self.name!r}: not done after {2 * self.timeout:.0f} s")
        else:
            self.run()
        if self.error is not None:
            raise RuntimeError(f"job {self.name!r} did not run to its end: "
                               f"{type(self.error).__name__}: {self.error}") from self.error
        stdout, stderr = ((self.workdir / name).read_text(errors="replace") for name in ("stdout", "stderr"))
        if self.timed_out:
            raise subprocess.TimeoutExpired(self.proc.args, self.timeout, stdout, stderr)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, stdout, stderr)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _start(args: list, **kwargs) -> subprocess.Popen:
    """`subprocess.Popen` of a job, tried again where the exec fails with EFAULT: CPython starts
    children by vfork, and an exec can fail with "Bad address" while another thread of this
    process (JAX's compiler, a test's kernels) changes its memory map (a CI run on 2026-12-04:
    `OSError: [Errno 14] Bad address: '.../bin/python'` in the bench job's start)."""
    for _ in range(2):
        try:
            return subprocess.Popen(args, stdin=subprocess.DEVNULL, text=True, **kwargs)
        except OSError as e:
            if e.errno != errno.EFAULT:
                raise
            time.sleep(0.5)
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, text=True, **kwargs)


class Jobs:
    """The registered jobs by name; `start` runs a list of them in order on one thread."""

    def __init__(self):
        self.by_name: dict[str, Job] = {}
        self.queued: list[Job] = []
        self.stopping = False
        self.thread: threading.Thread | None = None

    def register(self, name: str, job: Job, when: bool = True) -> pytest.MarkDecorator:
        """Register `job` as `name` (unless not `when`); returns the mark that ties a test to it."""
        if when:
            job.name = name
            self.by_name[name] = job
        return pytest.mark.background(name)

    def started(self, job: Job) -> bool:
        return job in self.queued

    def start(self, names) -> None:
        self.queued = [self.by_name[n] for n in dict.fromkeys(names) if n in self.by_name]
        if self.queued:
            self.thread = threading.Thread(target=lambda: [job.run() for job in self.queued], daemon=True,
                                           name="dsv4-test-jobs")
            self.thread.start()

    def summary(self) -> str:
        """One line: each job that ran, its wall time and how long the tests waited for it."""
        ran = [job for job in self.by_name.values() if job.seconds is not None]
        if not ran:
            return ""
        parts = [f"{job.name} {job.seconds:.0f} s" + (f" (waited {job.waited:.0f} s)" if job.waited >= 1 else "")
                 for job in ran]
        return f"background jobs, {sum(job.seconds for job in ran):.0f} s in all: " + ", ".join(parts)

    def stop(self) -> None:
        self.stopping = True
        for job in self.by_name.values():
            job.stop()


JOBS = Jobs()


def background(name: str, command: Callable[[Path], list], when: bool = True, **kwargs) -> pytest.MarkDecorator:
    """Mark a test as the owner of a job (see `Job`), registered only `when` the test will run;
    the test reads it with ``JOBS.by_name[name].result()``."""
    return JOBS.register(name, Job(command, **kwargs), when)
