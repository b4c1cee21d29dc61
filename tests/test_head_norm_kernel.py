"""The queries' per-head RMSNorm kernels (forward and backward) against `norms.head_rms_norm`.

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
from dsv4_jax.head_norm_kernel import head_rms_norm_kernel, query_norm
from dsv4_jax.norms import head_rms_norm

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


def test_query_norm_runs_the_kernel_as_the_plan_says():
    """"interpret" runs the kernels anywhere; "auto" and "pallas" only where a GPU is the default
    backend ("auto": for several queries a row); "xla" never."""
    x = jnp.ones((1, 3, 4, 32), jnp.float32)

    def uses_kernel(choice, q=x):
        return "pallas_call" in str(jax.make_jaxpr(lambda v: query_norm(v, EPS, choice))(q))

    assert uses_kernel("interpret")
    assert not uses_kernel("xla")
    assert uses_kernel("auto") == ON_GPU and uses_kernel("pallas") == ON_GPU
    assert not uses_kernel("auto", x[:, :1])  # one query a row: a decode step keeps XLA's
    assert KernelPlan.named("xla").query_norm == "xla"
    assert KernelPlan.named("interpret").query_norm == "interpret"
    assert KernelPlan().resolve("cpu", False).query_norm == "xla"


def test_the_kernels_lower_to_triton_kernels_for_cuda():
    """At V4-Flash's heads and head_dim (bf16, 1,024 queries), the forward and the backward
    kernel lower on this CPU to the Triton custom calls a GPU compiles (their reductions and
    rounding: what interpret mode cannot check)."""
    x = jax.ShapeDtypeStruct((1, 1024, 64, 512), jnp.bfloat16)

    def forward_and_backward(v, g):
        y, pull = jax.vjp(lambda a: head_rms_norm_kernel(a, EPS, False), v)
        return y, pull(g)[0]

    try:
        text = jax.jit(forward_and_backward).trace(x, x).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as err:  # jax >= 0.12 reads the GPU's compute capability here
        if "No supported GPU devices found" not in str(err):
            raise
        pytest.skip("this jax lowers Pallas' Triton kernels only where a GPU is present")
    calls = text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call")
    assert calls >= 2, text[:2000]


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
