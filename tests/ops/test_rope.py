"""RoPE: frequencies (plain and YaRN) and the interleaved rotation of the trailing slice."""

from __future__ import annotations

import numpy as np
import pytest

from dsv4_jax import DeepseekV4Config
from dsv4_jax.ops.rope import apply_rope, inv_freq


def test_yarn_ramp_matches_the_spec_for_v4():
    """Spec 2.4: pairs 0-15 keep theta^(-2i/rd), pairs >= 25 are divided by 16, 16-24 blend."""
    cfg = DeepseekV4Config.flash()
    yarn = inv_freq(cfg, "compress").astype(np.float64)
    plain = 160000.0 ** (-np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(yarn[:16], plain[:16], rtol=1e-6)
    np.testing.assert_allclose(yarn[25:], plain[25:] / 16, rtol=1e-6)
    assert np.all(yarn[16:25] < plain[16:25]) and np.all(yarn[16:25] > plain[16:25] / 16)
    np.testing.assert_allclose(inv_freq(cfg, "main"), 10000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-6)


@pytest.mark.parametrize("kind", ["main", "compress"])
def test_frequencies_equal_hf_bit_for_bit(golden, kind):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from dsv4_jax.io.hf_reference import hf_config

    for cfg in (golden.cfg, DeepseekV4Config.flash()):
        rot = DeepseekV4RotaryEmbedding(hf_config(cfg))
        hf = getattr(rot, f"{kind}_inv_freq").to(torch.float32).numpy()
        np.testing.assert_array_equal(inv_freq(cfg, kind), hf)


def test_rotation_is_interleaved_on_the_trailing_slice():
    x = np.zeros((1, 8), np.float32)
    x[0, 4] = 1.0  # first channel of the rope slice (pair 0, even element)
    freqs = np.array([0.5, 0.25], np.float32)
    y = apply_rope(x, np.array([2]), freqs)
    np.testing.assert_allclose(y[0, :4], 0.0)
    np.testing.assert_allclose(y[0, 4:6], [np.cos(1.0), np.sin(1.0)], rtol=1e-6)
    np.testing.assert_allclose(y[0, 6:], 0.0)


def test_inverse_undoes_and_scores_depend_on_distance_only():
    rng = np.random.default_rng(0)
    freqs = inv_freq(DeepseekV4Config.tiny(), "compress")
    q, k = rng.normal(size=(2, 32)).astype(np.float32)
    back = apply_rope(apply_rope(q, np.array(37), freqs), np.array(37), freqs, inverse=True)
    np.testing.assert_allclose(back, q, rtol=1e-5, atol=1e-6)
    dots = [apply_rope(q, np.array(t), freqs) @ apply_rope(k, np.array(t - 5), freqs) for t in (5, 50, 500)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotate_in_place_differentiates_as_apply_rope(dtype, inverse):
    """`rotate_in_place`'s custom gradient (the cotangent rotated back in place) gives
    `apply_rope`'s values and XLA's gradient of it, bit for bit."""
    import jax
    import jax.numpy as jnp

    from dsv4_jax.ops.rope import rotate_in_place

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 5, 3, 16)), dtype)
    g = jnp.asarray(rng.normal(size=x.shape), dtype)
    positions = jnp.asarray(rng.integers(-1, 5000, (2, 5, 1)), jnp.int32)
    freqs = np.asarray([0.7, 0.11, 0.013], np.float32)

    def plain(x):
        return apply_rope(x, positions, freqs, inverse=inverse, scale=1.25, in_place=True)

    def custom(x):
        return rotate_in_place(x, positions, freqs, inverse=inverse, scale=1.25)

    (y_plain, vjp_plain), (y_custom, vjp_custom) = jax.vjp(plain, x), jax.vjp(custom, x)
    np.testing.assert_array_equal(np.asarray(y_custom, np.float32), np.asarray(y_plain, np.float32))
    np.testing.assert_array_equal(np.asarray(vjp_custom(g)[0], np.float32), np.asarray(vjp_plain(g)[0], np.float32))


def test_rotate_in_place_keeps_numpy_on_the_host():
    """The wide break runs the stages on NumPy arrays: `rotate_in_place` stays NumPy there."""
    from dsv4_jax.ops.rope import rotate_in_place

    rng = np.random.default_rng(1)
    x = rng.normal(size=(1, 3, 2, 8)).astype(np.float32)
    positions = np.arange(3, dtype=np.int32)[None, :, None]
    freqs = np.asarray([0.5, 0.25], np.float32)
    got = rotate_in_place(x, positions, freqs, scale=1.5)
    assert type(got) is np.ndarray
    np.testing.assert_array_equal(got, apply_rope(x, positions, freqs, scale=1.5))
