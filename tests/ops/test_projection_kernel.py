"""The projections' kernel (`projection_kernel`) against XLA's product, its twin.

The float32 cases run the kernel in Pallas' interpret mode (the same kernel body, executed by
XLA; the Triton kernel takes bf16 and fp16 only) and agree with XLA's float32 product within
rounding. The bf16 case runs the Triton kernel itself on CUDA (interpret mode elsewhere): the
exact product rounded once (float32 accumulation), as a GEMM's is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import prefill_then_decode, random_layer

import dsv4_jax
from dsv4_jax import KernelPlan
from dsv4_jax.backend import einsum
from dsv4_jax.ops.projection import pallas as projection_kernel

ON_GPU = jax.default_backend() == "gpu"
KERNEL = "pallas" if ON_GPU else "interpret"

# (subscripts, a's shape without the rows, b's shape): the step's three forms at tiny sizes
FORMS = {
    "input": ("bsh,hn->bsn", (64,), (64, 48)),
    "wo_a": ("bsgi,gir->bsgr", (2, 64), (2, 64, 16)),
    "wo_b": ("bsr,rh->bsh", (32,), (32, 64)),
}


def operands(form: str, rows: int, seed: int = 0):
    subscripts, a_tail, b_shape = FORMS[form]
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.normal(size=(rows, 1, *a_tail)), jnp.float32)
    b = jnp.asarray(rng.normal(size=b_shape) / np.sqrt(a_tail[-1]), jnp.float32)
    return subscripts, a, b


@pytest.mark.parametrize("rows", [1, 5, 32, 33, 64])
@pytest.mark.parametrize("form", list(FORMS))
def test_the_kernel_gives_xlas_float32_product(form, rows):
    """Every row count it takes (padded to a power of two of at least 16 rows), each form."""
    subscripts, a, b = operands(form, rows)
    want = einsum(subscripts, a, b, out_dtype=jnp.float32, precision="highest")
    got = projection_kernel.projection(subscripts, a, b, out_dtype=jnp.float32, precision="highest",
                                       kernel="interpret")
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", list(FORMS))
def test_the_kernel_rounds_the_bf16_product_once(form):
    """bf16 operands: float32 accumulation, one rounding: the exact product rounded to bf16,
    up to a float32 sum in another order rounding the other way."""
    subscripts, a, b = operands(form, 8, seed=1)
    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    exact = np.einsum(subscripts, np.asarray(a, np.float64), np.asarray(b, np.float64))
    got = projection_kernel.projection(subscripts, a, b, out_dtype=jnp.bfloat16, kernel=KERNEL)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float64), exact, rtol=2 ** -8, atol=1e-6)


@pytest.mark.skipif(not ON_GPU, reason="the Triton kernel at V4-Flash sizes (the CPU runs the same code at tiny sizes)")
@pytest.mark.parametrize("rows", [8, 32])
@pytest.mark.parametrize("subscripts, a_tail, b_shape", [
    ("bsh,hn->bsn", (4096,), (4096, 4160)),  # CSA's fused input projections
    ("bsgi,gir->bsgr", (8, 4096), (8, 4096, 1024)),  # wo_a
    ("bsr,rh->bsh", (8192,), (8192, 4096)),  # wo_b
], ids=["input", "wo_a", "wo_b"])
def test_the_triton_kernel_rounds_the_bf16_product_once_at_flash_sizes(subscripts, a_tail, b_shape, rows):
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.normal(size=(rows, 1, *a_tail)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(size=b_shape) / np.sqrt(a_tail[-1]), jnp.bfloat16)
    exact = jnp.einsum(subscripts, a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
    got = jax.jit(lambda a, b: projection_kernel.projection(subscripts, a, b, out_dtype=jnp.bfloat16,
                                                            kernel="pallas"))(a, b)
    xla = einsum(subscripts, a, b, out_dtype=jnp.bfloat16)
    err = [float(jnp.max(jnp.abs(v.astype(jnp.float32) - exact))) for v in (got, xla)]
    print(f"{subscripts} rows {rows}: max error kernel {err[0]:.2e}, XLA {err[1]:.2e}")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(exact), rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("form", ["input", "wo_a"])
def test_the_kernel_differentiates_as_xlas_product(form):
    subscripts, a, b = operands(form, 3, seed=2)

    def loss(product):
        return lambda a, b: jnp.sum(jnp.sin(product(subscripts, a, b, out_dtype=jnp.float32, precision="highest")))

    want = jax.jit(jax.grad(loss(einsum), (0, 1)))(a, b)
    kernel = lambda *args, **kw: projection_kernel.projection(*args, **kw, kernel="interpret")  # noqa: E731
    got = jax.jit(jax.grad(loss(kernel), (0, 1)))(a, b)
    for g, w in zip(got, want):  # the products' float32 sums in another order: cancellation in the sums after
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * float(np.abs(w).max()))


def test_blocks_and_the_shapes_it_takes():
    """V4-Flash's projections get the blocks that won the H100's screen at 32 rows; a call of more
    than 64 rows, a K not a power of two, an N not a multiple of 16, or a float32 Triton call is
    XLA's."""
    assert projection_kernel.blocks(8, 4096, 1024) == (64, 128)  # wo_a
    assert projection_kernel.blocks(1, 8192, 4096) == (32, 256)  # wo_b
    assert projection_kernel.blocks(1, 4096, 4160) == (32, 256)  # CSA's fused input projections
    assert projection_kernel.blocks(1, 96, 64) is None and projection_kernel.blocks(1, 64, 40) is None
    bf16 = jnp.bfloat16
    assert projection_kernel.supports(64, (4096, 4160), bf16, interpret=False)
    assert not projection_kernel.supports(65, (4096, 4160), bf16, interpret=False)
    assert not projection_kernel.supports(8, (4096, 4160), jnp.float32, interpret=False)
    assert projection_kernel.supports(8, (4096, 4160), jnp.float32, interpret=True)
    with pytest.raises(ValueError, match=r"x \[M <= 64, G, K\].*got x \(65, 1, 64\)"):
        projection_kernel.project(jnp.zeros((65, 1, 64)), jnp.zeros((1, 64, 16)), interpret=True)


def test_a_call_it_does_not_take_is_xlas(monkeypatch):
    """More rows than `MAX_ROWS` (a prefill): the kernel is not traced, the product is XLA's."""
    traced = []
    monkeypatch.setattr(projection_kernel, "project", lambda *a, **k: traced.append(a) or None)
    subscripts, a, b = operands("input", 65)
    got = projection_kernel.projection(subscripts, a, b, out_dtype=jnp.float32, kernel="interpret")
    assert not traced and got.shape == (65, 1, 48)


def test_the_plan_names_the_stage():
    assert KernelPlan().projections == "auto"
    assert KernelPlan.named("xla").projections == "xla"
    assert KernelPlan.named("interpret").projections == "interpret"
    assert KernelPlan(projections="pallas").resolve("cpu", False).projections == "xla"
    assert KernelPlan(projections="pallas").resolve("cuda", False).projections == "pallas"
    with pytest.raises(ValueError, match=r"kernels\.projections"):
        KernelPlan(projections="triton")


@pytest.mark.parametrize("layer", [1, 2], ids=["csa", "hca"])
def test_a_layer_decoding_through_the_kernel_equals_the_layer_without(layer, monkeypatch):
    """The tiny layer in float32, a prefill then decode steps of a batch of 3 with the kernel
    for the output projections and (CSA, whose input projections are fused) the input ones, the
    prefill's 3 x 20 rows too: the outputs and the caches agree with XLA's products, and the
    kernel ran in both phases."""
    calls, project = [], projection_kernel.project
    monkeypatch.setattr(projection_kernel, "project", lambda x, w, **kw: calls.append(len(x)) or project(x, w, **kw))
    cfg = dsv4_jax.DeepseekV4Config.tiny()
    hidden = jnp.asarray(np.random.default_rng(layer).normal(size=(3, 26, cfg.hidden_size)), jnp.float32)

    def run(kernel):
        attn = random_layer(cfg, layer, seed=layer, break_mode="none", kernels=KernelPlan(projections=kernel))
        return prefill_then_decode(attn, hidden, 20)

    (want, want_cache), (got, got_cache) = run("xla"), run("interpret")
    assert {3, 60} <= set(calls)  # decode rows and the prefill's
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for g, w in zip(got_cache, want_cache):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-5, atol=1e-6)
