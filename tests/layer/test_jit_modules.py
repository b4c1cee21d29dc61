"""`dsv4_jax.jit_modules`: a function of NNX modules compiled with the modules taken once.

The contract: the same results as the function eagerly and under `nnx.jit`; the CSA layers' fused
input projections handed in, not concatenated in the program; parameters given new values in
place and changed options picked up; a function that changes the modules' variables refused;
bad arguments named. One stack of the tiny config's three layers (sliding, CSA, HCA), one
compiled step shape for the whole file.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4_jax
from dsv4_jax.layer.jit_modules import ModulesStep

CFG = dsv4_jax.DeepseekV4Config.tiny()
BATCH, PROMPT, STEPS, MAX_LEN = 2, 12, 3, 32


def decode(layers, h, caches):
    """A user's step: the module calls with positions=None, the caches in and out."""
    new = []
    for layer, cache in zip(layers, caches):
        out, cache = layer(h, None, cache)
        h = h + out
        new.append(cache)
    return h, new


nnx_jit_decode = nnx.jit(decode)  # the natural way, to compare with


def layers_and_prompt(seed=0):
    """The tiny config's layers, and their caches and last hidden state after a prompt (eager)."""
    layers = [dsv4_jax.DeepseekV4Attention(CFG, i, rngs=nnx.Rngs(seed + i)) for i in range(CFG.num_layers)]
    caches = [layer.init_cache(BATCH, MAX_LEN) for layer in layers]
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((BATCH, PROMPT, CFG.hidden_size)), jnp.float32)
    h, caches = decode(layers, x, caches)
    return layers, caches, h[:, -1:]


def run(step, token, caches, steps=STEPS):
    outs = []
    for _ in range(steps):
        token, caches = step(token, caches)
        outs.append(np.asarray(token))
    return np.concatenate(outs, 1), caches


@pytest.fixture(scope="module")
def stack():
    layers, caches, token = layers_and_prompt()
    step = dsv4_jax.jit_modules(decode, layers, donate_argnames=("h", "caches"))
    return layers, caches, token, step


def test_the_same_steps_as_the_module_calls_and_nnx_jit(stack):
    layers, caches, token, step = stack
    eager, _ = run(lambda t, c: decode(layers, t, c), token, caches)
    by_nnx, _ = run(lambda t, c: nnx_jit_decode(layers, t, c), token, caches)
    fast, fast_caches = run(step, token + 0, [jax.tree.map(jnp.copy, c) for c in caches])
    np.testing.assert_allclose(fast, eager, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(fast, by_nnx)
    assert [np.asarray(c.length).tolist() for c in fast_caches] == [[PROMPT + STEPS] * BATCH] * CFG.num_layers
    # The returned caches work eagerly again.
    out, _ = layers[1](jnp.asarray(fast[:, -1:]), None, fast_caches[1])
    assert out.shape == (BATCH, 1, CFG.hidden_size)


def test_the_donated_arguments_are_consumed(stack):
    _, caches, token, step = stack
    fed, mine = token + 0, [jax.tree.map(jnp.copy, c) for c in caches]
    step(fed, mine)
    assert fed.is_deleted() and mine[1].window.is_deleted()


def _weight_concatenations(text: str) -> int:
    """Concatenations of [hidden, n] operands in a lowered program: the CSA layer's input
    projections' weights side by side (the hidden states are [B, S, hidden])."""
    return sum("concatenate" in line and f"tensor<{CFG.hidden_size}x" in line for line in text.splitlines())


def test_the_fused_input_projections_come_in_made(stack):
    layers, caches, token, step = stack
    assert _weight_concatenations(nnx_jit_decode.lower(layers, token, caches).as_text()) == 1  # the CSA layer's
    assert _weight_concatenations(step.lower(token, caches).as_text()) == 0


def test_parameters_given_new_values_in_place_are_picked_up():
    layers, caches, token = layers_and_prompt(seed=3)
    step = dsv4_jax.jit_modules(decode, layers)
    before, _ = step(token, caches)
    csa = layers[1]
    csa.q_b_proj[...] = 2 * csa.q_b_proj[...]
    after, _ = step(token, caches)
    expected, _ = decode(layers, token, caches)
    assert not np.allclose(after, before)
    np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-5)
    jitted = step._jitted
    csa.check_finite = False  # a changed option: a new trace, the same parameters
    again, _ = step(token, caches)
    assert step._jitted is not jitted
    np.testing.assert_array_equal(again, after)


def test_a_function_that_changes_the_modules_variables_is_refused():
    layers, caches, token = layers_and_prompt(seed=5)

    def scales_a_parameter(layers, h, caches):
        layers[0].sinks[...] = layers[0].sinks[...] + 1
        return decode(layers, h, caches)

    with pytest.raises(ValueError, match="fn: 'scales_a_parameter' changed the modules' variables"):
        dsv4_jax.jit_modules(scales_a_parameter, layers)(token, caches)
    assert np.all(np.asarray(layers[0].sinks[...]) == 0)  # nothing written back


@pytest.mark.parametrize(("fn", "kwargs", "error", "match"), [
    (None, {}, TypeError, "fn: expected a function of the modules, got NoneType"),
    (lambda *args: args, {}, TypeError, "fn: expected a function taking the modules as its first positional"),
    (decode, {"donate_argnames": [0]}, TypeError, r"donate_argnames: expected names of fn's arguments, got \(0,\)"),
])
def test_bad_arguments_are_named(fn, kwargs, error, match):
    layer = dsv4_jax.DeepseekV4Attention(CFG, 0, rngs=nnx.Rngs(0))
    with pytest.raises(error, match=match):
        dsv4_jax.jit_modules(fn, [layer], **kwargs)


def test_the_step_is_a_modules_step_with_the_layers_compile_options(stack):
    layers, _, _, step = stack
    assert isinstance(step, ModulesStep) and step.modules is layers
    assert dsv4_jax.jit_modules(decode, layers, compiler_options={})._options == {}
