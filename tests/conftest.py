"""Fixtures: the recorded reference runs of tests/data (see helpers.py)."""

from __future__ import annotations

import os

import cuda_plugin

# Compiling dominates this suite: it builds a few hundred small XLA:CPU programs (every layer
# type x break mode x call shape). XLA:CPU keeps IEEE float semantics at every LLVM optimisation
# level and in both of its fusion code generators (no fast-math), so these settings change how
# fast the generated code runs, not the arithmetic's semantics: LLVM's level 0 halves the compile
# time, and
# on jaxlib < 0.11 the classic fusion emitters (the MLIR emitters are the only ones from 0.11 on,
# where the flag is gone: an unknown XLA flag aborts the process) halve it again. The notebooks'
# kernels and the subprocesses inherit the settings. DSV4_TEST_XLA_OPT=default keeps XLA's
# defaults.
if os.environ.get("DSV4_TEST_XLA_OPT", "0") != "default" and "optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""
):
    from importlib.metadata import version

    _fast = ["--xla_backend_optimization_level=0"]
    if tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (0, 11):
        _fast.append("--xla_cpu_use_fusion_emitters=false")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_fast]).strip()

# One compilation cache on disk for the whole run: the test files, both pytest-xdist workers
# and the jobs' subprocesses (notebooks, docs, demo, bench smoke runs: they inherit the
# environment) compile the same tiny-config steps; each distinct program compiles once a run
# (docs/DEVELOPING.md, keeping the suite fast). The process that makes the folder (the run's
# first, before its workers start) removes it at exit. DSV4_TEST_JAX_CACHE=off: no cache. Not
# where jax's CUDA plugin is installed (the deviceless stage, a GPU box): the deviceless
# compiles cannot load a cached program (no client), and their census reads XLA's dump, which a
# loaded program never writes.
if (os.environ.get("DSV4_TEST_JAX_CACHE") != "off" and "JAX_COMPILATION_CACHE_DIR" not in os.environ
        and not cuda_plugin.installed()):
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="dsv4-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import gc

import jax
import pytest
from helpers import GOLDEN_FILES, JOBS, Golden, load_golden

# Every test is a rank-promotion test: the package spells out every broadcast, so the whole suite
# (every layer type, break mode, cache kind and numerics it runs) runs under JAX's strictest
# broadcasting setting, where an implicit rank promotion is an error
# (tests/layer/test_rank_promotion.py checks that the setting holds).
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_configure(config):
    config.addinivalue_line("markers", "background(name): the test reads the job `name` of helpers.JOBS")


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """The selected tests' jobs start now, in test order, one at a time beside this process.
    Not in a pytest-xdist worker: the workers already share the cores, and which tests a worker
    gets is decided as it goes; each job runs there when its test asks for it."""
    if not session.config.option.collectonly and not hasattr(session.config, "workerinput"):
        JOBS.start(mark.args[0] for item in session.items for mark in item.iter_markers("background"))


def pytest_sessionfinish(session):
    JOBS.stop()


def pytest_terminal_summary(terminalreporter):
    """Where the background jobs' time went (docs/DEVELOPING.md, keeping the suite fast)."""
    line = JOBS.summary()
    if line:
        terminalreporter.write_line(line)


@pytest.fixture(autouse=True, scope="module")
def free_compiled_programs():
    """After each test file, drop JAX's compiled programs. Each XLA:CPU executable holds a few
    memory mappings of its JIT-compiled code; the whole suite in one process compiled enough of
    them to pass Linux's limit of 65,530 mappings a process (`vm.max_map_count`), and XLA then
    crashed with a segmentation fault in a compile (2026-12-03, in test_ragged at about 73% of
    the suite). What a test file compiled is not reused by the next one anyway."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session", params=GOLDEN_FILES)
def golden(request) -> Golden:
    return load_golden(request.param)


@pytest.fixture(scope="session")
def small() -> Golden:
    return load_golden("small_seed0.npz")
