"""RoPE: frequencies (plain and YaRN) and the interleaved rotation of the trailing slice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import DeepseekV4Config
from dsv4_jax.rope import apply_rope, inv_freq, norm_rotate_queries


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_the_queries_fused_gradient_is_xlas(dtype):
    """`norm_rotate_queries(fused_backward=True)`: the same values, and its custom VJP gives
    XLA's gradient of the norm-then-rotate composition (float32: to float32 rounding; bf16:
    within bf16 rounding, since XLA rounds each partial gradient and the fused VJP only dq).
    Positions include a padded slot (-1), as a ragged call's."""
    cfg = DeepseekV4Config.tiny()
    freqs = inv_freq(cfg, "compress")
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 5, 4, cfg.head_dim)) * 3, dtype)
    g = jnp.asarray(rng.normal(size=q.shape), dtype)
    positions = jnp.asarray([[0, 1, 2, 3, -1], [7, 8, 9, 10, 11]], jnp.int32)

    def vjp(fused):
        out, pull = jax.vjp(lambda x: norm_rotate_queries(x, positions, freqs, eps=cfg.rms_norm_eps, scale=0.75,
                                                          fused_backward=fused), q)
        return out, pull(g)[0]

    (out, dq), (want_out, want_dq) = vjp(True), vjp(False)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    got, want = np.asarray(dq, np.float32), np.asarray(want_dq, np.float32)
    scale = np.abs(want).max()
    tol = 2e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)
    with pytest.raises(TypeError, match="custom_vjp"):  # reverse mode only: kernels="xla" for forward mode
        jax.jvp(lambda x: norm_rotate_queries(x, positions, freqs, eps=cfg.rms_norm_eps, fused_backward=True),
                (q,), (g,))
