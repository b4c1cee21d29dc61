"""The queries' per-head RMSNorm kernels (forward and backward) against `norms.head_rms_norm`,
and with the queries' RoPE folded in against the norm kernels followed by `rope.apply_rope`.

On the CPU the kernels run in Pallas' interpret mode (the same kernel bodies, executed by XLA);
on CUDA the Triton kernels themselves run. The forward equals the reference but where a row's
factor, a float32 sum in another order, rounds the other way (float32: within 1e-6; bf16:
within one rounding of the output); the gradient equals XLA's within the rounding of the
compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import DeepseekV4Config, KernelPlan
from dsv4_jax.ops.norms import head_rms_norm
from dsv4_jax.ops.query_norm.pallas import (
    _pieces,
    head_rms_norm_kernel,
    head_rms_norm_rope_kernel,
    query_norm,
    supports,
)
from dsv4_jax.ops.rope import RotationTables, apply_rope, attention_factor, inv_freq, rotate_in_place, rotation_tables

ON_GPU = jax.default_backend() == "gpu"
EPS = 1e-6


def forward_and_gradient(norm, x, g):
    y, pull = jax.vjp(norm, x)
    return np.asarray(y, np.float32), np.asarray(pull(g)[0], np.float32)


def assert_matches_reference(x, g, interpret):
    got = forward_and_gradient(jax.jit(lambda v: head_rms_norm_kernel(v, EPS, interpret)), x, g)
    want = forward_and_gradient(jax.jit(lambda v: head_rms_norm(v, EPS)), x, g)
    tol = 1e-6 if x.dtype == jnp.float32 else 1e-2  # bf16: one rounding of the output
    for name, a, b in zip(("y", "dx"), got, want):
        scale = np.abs(b).max()
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale, err_msg=name)
    if x.dtype == jnp.bfloat16:  # a flipped rounding of the factor is rare: most rows are exact
        assert np.mean(got[0] == want[0]) > 0.99


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 5, 4, 64), (3, 1, 4, 32)], ids=["prefill", "decode-odd-rows"])
def test_the_kernels_norm_and_differentiate_as_the_reference(dtype, shape):
    """Forward and gradient in interpret mode; 60 rows of 32 (blocks of 4 rows) too."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=shape) * 3, dtype)
    g = jnp.asarray(rng.normal(size=shape), dtype)
    assert_matches_reference(x, g, interpret=True)


def rope_of(cfg, positions):
    """(positions, freqs, scale) of the compress rope at `positions` [B, S]."""
    return positions, inv_freq(cfg, "compress"), attention_factor(cfg, "compress")


def rotation_of(cfg, positions, dtype=jnp.float32):
    """The queries' `RotationTables` at `positions` [B, S], as the step hands them to the norm."""
    return rotation_tables(*rope_of(cfg, positions), dtype)


def norm_then_rope(x, rope, interpret):
    """What the step ran before the fused kernel: the norm kernel, then the in-place RoPE."""
    positions, freqs, scale = rope
    return rotate_in_place(head_rms_norm_kernel(x, EPS, interpret), positions[..., None], freqs, scale=scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 5, 4, 32), (3, 1, 4, 32), (1, 3, 2, 64)],
                         ids=["prefill", "decode", "two-heads-of-64"])
def test_the_norm_with_rope_equals_the_norm_then_rope(dtype, shape):
    """One kernel each way equals the norm kernels followed by the rotation (and its transpose):
    bf16 bit for bit on the CPU (rounded after the norm, rotated in float32, rounded again; the
    cotangent's channels turned back and rounded before the norm's gradient); float32 within its rounding
    (the factor's sum runs over the column pieces in another order). Against the XLA reference
    (`head_rms_norm`, `apply_rope`) as the norm kernel alone compares."""
    cfg = DeepseekV4Config.tiny(head_dim=shape[-1], qk_rope_head_dim=8 if shape[-1] == 32 else 16)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=shape) * 3, dtype)
    g = jnp.asarray(rng.normal(size=shape), dtype)
    rope = rope_of(cfg, jnp.asarray(rng.integers(0, 3000, size=shape[:2]), jnp.int32))
    rotation = rotation_tables(*rope, dtype)
    fused = jax.jit(lambda v: query_norm(v, EPS, "interpret", rotation))
    got = forward_and_gradient(fused, x, g)
    before = forward_and_gradient(jax.jit(lambda v: norm_then_rope(v, rope, True)), x, g)
    xla = forward_and_gradient(jax.jit(lambda v: query_norm(v, EPS, "xla", rotation)), x, g)
    for name, a, b, c in zip(("y", "dx"), got, before, xla):
        if dtype == jnp.bfloat16 and not ON_GPU:  # (XLA:GPU may skip an interpreted kernel's roundings)
            np.testing.assert_array_equal(a, b, err_msg=name)
        tol = 1e-6 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=name)
        np.testing.assert_allclose(a, c, rtol=tol, atol=tol * np.abs(c).max(), err_msg=name)
    if dtype == jnp.bfloat16 and not ON_GPU:  # (XLA:GPU fuses its norm and rotation, unrounded between)
        assert np.mean(got[0] == xla[0]) > 0.99


def test_the_norm_with_rope_at_the_cache_positions_of_a_ragged_call():
    """Padded slots (position -1) are rotated like any other position (nothing reads them)."""
    cfg = DeepseekV4Config.tiny()
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 4, 32)), jnp.float32)
    positions = jnp.asarray([[5, 6, 7], [0, -1, -1]], jnp.int32)
    _, freqs, scale = rope_of(cfg, positions)
    got = query_norm(x, EPS, "interpret", rotation_of(cfg, positions))
    want = apply_rope(head_rms_norm(x, EPS), positions[..., None], freqs, scale=scale)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_column_pieces_are_powers_of_two_covering_the_row():
    assert _pieces(448) == [(0, 256), (256, 128), (384, 64)]
    assert _pieces(512) == [(0, 512)] and _pieces(24) == [(0, 16), (16, 8)] and _pieces(0) == []
    q = jnp.zeros((1, 1, 64, 512))
    assert supports(q, None) and supports(q, RotationTables(np.zeros((1, 1, 32)), np.zeros((1, 1, 32))))
    assert not supports(q, RotationTables(np.zeros((1, 1, 24)), np.zeros((1, 1, 24))))
    assert not supports(jnp.zeros((1, 1, 4, 48)), None)


def test_query_norm_runs_the_kernel_as_the_plan_says():
    """"interpret" runs the kernels anywhere; "auto" and "pallas" only where a GPU is the default
    backend ("auto": for several queries a row); "xla" never."""
    x = jnp.ones((1, 3, 4, 32), jnp.float32)

    def uses_kernel(choice, q=x):
        if choice == "auto":  # what the plan's "auto" names for this call
            choice = KernelPlan().query_norm_for(q)
        return "pallas_call" in str(jax.make_jaxpr(lambda v: query_norm(v, EPS, choice))(q))

    assert uses_kernel("interpret")
    assert not uses_kernel("xla")
    assert uses_kernel("auto") == ON_GPU and uses_kernel("pallas") == ON_GPU
    assert not uses_kernel("auto", x[:, :1])  # one query a row: a decode step keeps XLA's
    assert KernelPlan.named("xla").query_norm == "xla"
    assert KernelPlan.named("interpret").query_norm == "interpret"
    assert KernelPlan().resolve("cpu", False).query_norm == "xla"
    # with the rotation: one kernel (no slice and update of the rotated channels after it)
    rotation = rotation_of(DeepseekV4Config.tiny(), jnp.zeros((1, 3), jnp.int32))
    jaxpr = str(jax.make_jaxpr(lambda v: query_norm(v, EPS, "interpret", rotation))(x))
    assert jaxpr.count("pallas_call") == 1 and "query_norm_rope" in jaxpr
    assert "pallas_call" not in str(jax.make_jaxpr(lambda v: query_norm(v, EPS, "xla", rotation))(x))


def test_the_kernels_lower_to_triton_kernels_for_cuda():
    """At V4-Flash's heads and head_dim (bf16, 1,024 queries), the forward and the backward
    kernel lower on this CPU to the Triton custom calls a GPU compiles (their reductions and
    rounding: what interpret mode cannot check)."""
    x = jax.ShapeDtypeStruct((1, 1024, 64, 512), jnp.bfloat16)

    rotation = rotation_of(DeepseekV4Config.flash(), jnp.arange(1024, dtype=jnp.int32)[None], jnp.bfloat16)

    def forward_and_backward(v, g):
        y, pull = jax.vjp(lambda a: head_rms_norm_kernel(a, EPS, False), v)
        z, pull_rope = jax.vjp(lambda a: head_rms_norm_rope_kernel(a, rotation, EPS, False), v)
        return y, pull(g)[0], z, pull_rope(g)[0]

    try:
        text = jax.jit(forward_and_backward).trace(x, x).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as err:  # jax >= 0.12 reads the GPU's compute capability here
        if "No supported GPU devices found" not in str(err):
            raise
        pytest.skip("this jax lowers Pallas' Triton kernels only where a GPU is present")
    calls = text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call")
    assert calls >= 4, text[:2000]


@pytest.mark.skipif(not ON_GPU, reason="the Triton kernels run on CUDA")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_kernels_at_flash_sizes(dtype):
    """The Triton kernels at V4-Flash's heads and head_dim, a 256-query prefill."""
    cfg = DeepseekV4Config.flash()
    rng = np.random.default_rng(1)
    shape = (1, 256, cfg.num_attention_heads, cfg.head_dim)
    x = jnp.asarray(rng.normal(size=shape) * 3, dtype)
    g = jnp.asarray(rng.normal(size=shape), dtype)
    assert_matches_reference(x, g, interpret=False)
    rope = rope_of(cfg, jnp.asarray(rng.integers(0, 16384, size=shape[:2]), jnp.int32))
    got = forward_and_gradient(jax.jit(lambda v: query_norm(v, EPS, "pallas", rotation_tables(*rope, dtype))), x, g)
    want = forward_and_gradient(jax.jit(lambda v: norm_then_rope(v, rope, False)), x, g)
    for name, a, b in zip(("y", "dx"), got, want):
        diff = np.abs(a - b) / np.abs(b).max()
        print(f"query norm + rope {x.dtype} {name}: max |fused - norm then rope| {diff.max():.3g}, "
              f"equal {np.mean(a == b):.5f}")
        tol = 1e-6 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max(), err_msg=name)
        if dtype == jnp.bfloat16:
            # The forward rounds as the two kernels did (H200: every value equal). The gradient
            # differs by one unit in the last place in ~3% of values (H200, session 62; within the
            # norm kernel's own tolerance against XLA's gradient above).
            assert np.mean(a == b) > (0.999 if name == "y" else 0.9), name
