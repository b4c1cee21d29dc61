"""RoPE: frequencies (plain and YaRN) and the interleaved rotation of the trailing slice."""

from __future__ import annotations

import numpy as np
import pytest

from dsv4_jax import DeepseekV4Config
from dsv4_jax.rope import apply_rope, inv_freq


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

    from dsv4_jax.hf_reference import hf_config

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
