"""`compiler_options(deterministic=True)`: XLA's flags for reproducible GPU programs.

The flags are only given for CUDA (other platforms' XLA code is deterministic already); that
they are options XLA knows is checked by compiling with them here, on the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import dsv4_jax
from dsv4_jax.step import overlap


def test_deterministic_adds_xla_flags_on_cuda_only():
    assert dsv4_jax.compiler_options("off", "cuda", deterministic=True) == overlap.DETERMINISTIC_OPTIONS
    assert dsv4_jax.compiler_options("on", "cuda", deterministic=True) == {
        overlap.SCHEDULING_OPTION: "CONCURRENT", **overlap.DETERMINISTIC_OPTIONS}
    assert dsv4_jax.compiler_options("on", "cpu", deterministic=True) == {}
    assert dsv4_jax.compiler_options("off", "cuda") == {}
    assert "xla_gpu_deterministic_ops" in overlap.DETERMINISTIC_OPTIONS


def test_the_flags_are_options_xla_accepts():
    options = dsv4_jax.compiler_options("off", "cuda", deterministic=True)
    f = jax.jit(lambda x: jnp.cumsum(x) * 2, compiler_options=options)
    assert float(f(jnp.ones(4))[-1]) == 8.0
