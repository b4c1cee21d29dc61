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


def test_the_layer_option_compiles_its_steps_deterministic_on_cuda_only():
    """``deterministic=True``: the step's plan says so on CUDA (its compiled step then carries the
    flags), never elsewhere; the option is a bool, refused otherwise, and settable."""
    import pytest
    from flax import nnx

    from dsv4_jax.config import CSA
    from dsv4_jax.step.plan import plan_step
    from dsv4_jax.step.pure_step import step_for, step_function

    assert plan_step(CSA, "none", kernels="xla", platform="cuda", deterministic=True).deterministic
    assert not plan_step(CSA, "none", kernels="xla", platform="cpu", deterministic=True).deterministic
    assert not plan_step(CSA, "none", kernels="xla", platform="cuda").deterministic
    assert step_function(deterministic=True) is not step_function()

    cfg = dsv4_jax.DeepseekV4Config.tiny()
    attn = dsv4_jax.DeepseekV4Attention(cfg, layer_idx=1, rngs=nnx.Rngs(0), deterministic=True)
    assert attn.options.deterministic and not attn.step_spec().plan.deterministic  # a CPU here
    assert step_for(attn.step_spec()) is step_function()
    attn.deterministic = False
    assert attn.options.deterministic is False
    with pytest.raises(TypeError, match="deterministic: expected True or False, got 'yes'"):
        attn.deterministic = "yes"
