"""The compressor's decode pooling kernel against its XLA twin (`compressor._pool`).

On the CPU the kernel runs in Pallas' interpret mode (the same kernel body, executed by XLA);
on CUDA the Triton kernel itself runs. Float32 agrees within float32 rounding (only the
order of the sums may differ); bf16 within one rounding of the entry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax.ops.compress import pallas as compressor_kernel
from dsv4_jax.ops.compress import reference as compressor

ON_GPU = jax.default_backend() == "gpu"
KERNEL = "pallas" if ON_GPU else "interpret"


def ring_inputs(overlap: bool, m: int, dc: int, b: int, dtype, seed: int = 0):
    """A ring after a decode step's write, each row at some window (0 for some: no window
    before it), and the rows whose token completes their window."""
    rng = np.random.default_rng(seed)
    n = 2 if overlap else 1
    r = (2 if overlap else 1) * m
    ring = jnp.asarray(rng.normal(size=(b, r, 2 * n * dc)) * 2, dtype)
    first_entry = jnp.asarray(np.r_[0, 1, rng.integers(0, 50, b - 2)], jnp.int32)
    completes = jnp.asarray(np.r_[True, True, rng.random(b - 2) < 0.5])
    bias = jnp.asarray(rng.normal(size=(m, n * dc)), jnp.float32)
    return ring, first_entry, completes, bias


def xla_pooling(ring, first_entry, bias, m, overlap):
    windows, before = compressor._one_token(ring, first_entry, m)
    return np.asarray(compressor._pool(windows, before, first_entry, bias, overlap, ring.dtype), np.float32)


def kernel_pooling(ring, first_entry, completes, bias, m, overlap):
    pool = jax.jit(lambda *a: compressor_kernel.pool_one_token(*a, ratio=m, overlap=overlap,
                                                               interpret=not ON_GPU))
    return np.asarray(pool(ring, first_entry, completes, bias), np.float32)


@pytest.mark.parametrize("overlap, m, dc", [(True, 4, 512), (True, 4, 128), (False, 128, 512), (False, 8, 32)],
                         ids=["csa", "csa-indexer", "hca", "hca-tiny"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_the_kernel_pools_as_the_xla_path(overlap, m, dc, dtype):
    """V4-Flash's compressors (CSA kv 512 and indexer 128 wide with m = 4 and the window
    before; HCA m = 128) and a tiny one: the completing rows' entries equal the XLA path's,
    the other rows are zeros (never written)."""
    ring, first_entry, completes, bias = ring_inputs(overlap, m, dc, b=6, dtype=dtype)
    want = xla_pooling(ring, first_entry, bias, m, overlap)
    got = kernel_pooling(ring, first_entry, completes, bias, m, overlap)
    done = np.asarray(completes)
    assert got.shape == want.shape == (6, 1, dc)
    np.testing.assert_array_equal(got[~done], 0)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got[done], want[done], rtol=1e-5, atol=1e-6)
    else:  # the float32 sums in another order may round the bf16 entry the other way
        np.testing.assert_allclose(got[done], want[done], rtol=2 ** -7, atol=2 ** -7 * np.abs(want).max())


def test_shapes_the_triton_kernel_takes():
    ring = jnp.zeros((2, 8, 4 * 512), jnp.bfloat16)
    assert compressor_kernel.supports(ring, 4, True)
    assert not compressor_kernel.supports(ring, 4, False)  # an HCA ring is m slots
    assert not compressor_kernel.supports(jnp.zeros((2, 6, 4 * 512)), 3, True)  # m not a power of two
    with pytest.raises(ValueError, match="multiple of the channel block"):
        compressor_kernel.pool_one_token(jnp.zeros((1, 4, 2 * 200)), jnp.zeros(1, jnp.int32), jnp.ones(1, bool),
                                         jnp.zeros((4, 200)), ratio=4, overlap=False, interpret=True)


@pytest.mark.parametrize("layer", [1, 2], ids=["csa", "hca"])
def test_a_layer_decoding_with_the_kernel_equals_the_layer_without(layer):
    """The tiny layer in float32: a prefill, then decode steps across two window ends (CSA
    m = 4, HCA m = 8; the unit test above mixes completing and other rows), with the kernel for every decode
    pooling against the XLA path: the outputs and every cache leaf agree."""
    from flax import nnx

    import dsv4_jax

    cfg = dsv4_jax.DeepseekV4Config.tiny()
    rng = np.random.default_rng(layer)
    hidden = jnp.asarray(rng.normal(size=(2, 40, cfg.hidden_size)), jnp.float32)

    def run(kernel):
        attn = dsv4_jax.DeepseekV4Attention(cfg, layer, rngs=nnx.Rngs(layer), dtype=jnp.float32,
                                            kernels=dsv4_jax.KernelPlan(compress=kernel))
        cache, outs = attn.init_cache(2, 48), []
        positions = jnp.asarray([np.arange(0, 21), np.arange(0, 21)], jnp.int32)
        out, cache = attn(hidden[:, :21], positions, cache)
        outs.append(np.asarray(out, np.float32))
        for t in range(21, 38):
            out, cache = attn(hidden[:, t:t + 1], jnp.full((2, 1), t, jnp.int32), cache)
            outs.append(np.asarray(out, np.float32))
        return np.concatenate(outs, axis=1), jax.tree.leaves(cache)

    (want, want_cache), (got, got_cache) = run("xla"), run(KERNEL)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=1e-5)
    for a, b in zip(got_cache, want_cache):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-6)
