"""The overlap (`dsv4_jax.step.overlap`): independent stages side by side through XLA's concurrent
command buffers. A setting of the layer resolved into the step's plan: on CUDA it picks the
compiled step (its compile options), elsewhere it changes nothing; the results are identical
(bit for bit) with it on and off."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4_jax
from dsv4_jax import DeepseekV4Attention, DeepseekV4Config
from dsv4_jax.config import CSA, HCA
from dsv4_jax.step import overlap
from dsv4_jax.step.plan import plan_step
from dsv4_jax.step.pure_step import compiled_steps, step_for, step_function

CFG = DeepseekV4Config.tiny()
ON_GPU = jax.default_backend() == "gpu"


def _layer(layer_type: str, **kw) -> DeepseekV4Attention:
    return DeepseekV4Attention(CFG, CFG.layer_types.index(layer_type), rngs=nnx.Rngs(0), **kw)


def _inputs(seq: int, start: int = 0, seed: int = 0):
    x = np.random.default_rng(seed).standard_normal((2, seq, CFG.hidden_size)).astype(np.float32)
    return jnp.asarray(x), np.broadcast_to(np.arange(start, start + seq, dtype=np.int32), (2, seq))


def test_overlap_resolves_per_platform():
    assert [overlap.resolve(v, "cuda") for v in ("auto", "on", "off")] == [True, True, False]
    for platform in ("cpu", "rocm", "tpu"):  # no concurrent command buffers there: one program
        assert [overlap.resolve(v, platform) for v in ("auto", "on", "off")] == [False, False, False]
    assert overlap.compiler_options(True) == {overlap.SCHEDULING_OPTION: "CONCURRENT"}
    assert overlap.compiler_options(False) == {}
    assert dsv4_jax.compiler_options("on", "cuda") == {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    assert dsv4_jax.compiler_options("on", "cpu") == {}


def test_overlap_in_the_plan():
    for setting, want in (("auto", True), ("on", True), ("off", False)):
        plan = plan_step(CSA, "none", kernels="xla", platform="cuda", overlap=setting)
        assert plan.overlap is want
    assert plan_step(HCA, "narrow", platform="cpu", overlap="on").overlap is False


@pytest.mark.parametrize("value", ["yes", True, None, "ON"])
def test_overlap_rejects_other_values(value):
    with pytest.raises(ValueError, match=r"overlap: expected one of \('auto', 'on', 'off'\), got"):
        _layer(CSA, overlap=value)
    attn = _layer(CSA)
    with pytest.raises(ValueError, match="overlap: expected one of"):
        attn.overlap = value  # an attribute: a bad value is refused where it enters
    assert attn.overlap == "auto"
    x, pos = _inputs(3)
    out, _ = attn(x, pos, attn.init_cache(2, 16))  # the layer still runs with the options it had
    assert np.isfinite(np.asarray(out)).all()


def test_compile_options_take_on_this_backend():
    """The step compiled with either schedule runs here and gives the same outputs, bit for bit
    (on a CPU the option is accepted and has nothing to schedule)."""
    attn = _layer(CSA, break_mode="none")
    spec = attn.step_spec()
    x, pos = _inputs(5)
    cache = attn.init_cache(2, 16).replace(layer_idx=-1)
    outs = [np.asarray(step_function(False, overlap=on)(attn.weights(), cache, x, pos, spec=spec)[0])
            for on in (False, True)]
    np.testing.assert_array_equal(outs[0], outs[1])


def test_switching_overlap_between_calls():
    """Off CUDA every setting is one plan and one program: switching compiles nothing new; the
    layer's step is the one `step_for` names for its spec."""
    attn = _layer(HCA)
    x, pos = _inputs(4)
    out0, _ = attn(x, pos, attn.init_cache(2, 16))
    before = compiled_steps()
    for setting in ("on", "off", "auto"):
        attn.overlap = setting
        assert attn.step_spec().plan.overlap is (setting != "off" and ON_GPU)
        out, _ = attn(x, pos, attn.init_cache(2, 16))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(out0))
    if not ON_GPU:
        assert compiled_steps() == before
    assert step_for(attn.step_spec()) is step_function(False, overlap=attn.step_spec().plan.overlap)


@pytest.mark.skipif(not ON_GPU, reason="concurrent command buffers are a CUDA schedule")
@pytest.mark.parametrize("layer_type", [CSA, HCA])
def test_overlap_is_bit_exact_on_the_gpu(layer_type):
    """On CUDA "on" and "off" are two programs (two schedules of one graph): a prefill and
    decode steps through each give the same outputs and caches, bit for bit."""
    results = {}
    for setting in ("on", "off"):
        attn = _layer(layer_type, overlap=setting, param_dtype=jnp.bfloat16)
        cache = attn.init_cache(2, 64)
        outs = []
        x, pos = _inputs(19)
        out, cache = attn(x, pos, cache)
        outs.append(np.asarray(out.astype(jnp.float32)))
        for i in range(4):
            x, pos = _inputs(1, start=19 + i, seed=i + 1)
            out, cache = attn(x, pos, cache)
            outs.append(np.asarray(out.astype(jnp.float32)))
        results[setting] = (outs, [np.asarray(leaf) for leaf in jax.tree.leaves(cache)])
    for a, b in zip(results["on"][0] + results["on"][1], results["off"][0] + results["off"][1]):
        np.testing.assert_array_equal(a, b)


def test_an_overlapped_layer_inside_your_jit(monkeypatch):
    """A step with the overlap is a jit with compile options, which JAX refuses to nest: traced
    inside a user's `jax.jit`, the layer runs the plain step (the user's jit's options hold).
    The overlap is forced on here (the CPU accepts the option and has nothing to schedule)."""
    monkeypatch.setattr(overlap, "resolve", lambda setting, platform: setting != "off")
    attn = _layer(CSA, overlap="on", break_mode="none")
    assert attn.step_spec().plan.overlap
    x, pos = _inputs(3)
    cache = attn.init_cache(2, 16)
    eager, _ = attn(x, pos, cache)
    traced = jax.jit(lambda x, cache: attn(x, pos, cache)[0])(x, cache)
    np.testing.assert_allclose(np.asarray(traced), np.asarray(eager), rtol=1e-6, atol=1e-6)
