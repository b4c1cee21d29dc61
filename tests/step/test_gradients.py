"""Gradients through every path a user can reach: each kernel differentiates as its XLA reference.

The Pallas kernels (sparse attention for decode and prefill, the compressors' decode pooling)
have no differentiation rule of their own; `backend.differentiated_as` gives each the VJP of
its XLA twin. On the CPU they run in interpret mode (``kernels="interpret"``), the same kernel
bodies the GPU runs. The loss spans a prefill and a decode step on the cache it left (whose
token completes a compressor window), so the gradient also flows through the cache. Checked:
with respect to the parameters and the hidden states, every layer type, every break mode
(``none``, ``narrow`` on the host and on the device, ``wide``), equal to the XLA reference's
gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FLASH_HEADS_CFG, random_layer, rel_err

import dsv4_jax
from dsv4_jax import KernelPlan, attention_step, native
from dsv4_jax.backend import differentiated_as

CFG = dsv4_jax.DeepseekV4Config.tiny()
PROMPT = 23  # then one decode step at position 23, which completes a CSA (m = 4) and an HCA (m = 8) window
BATCH = 2
LAYERS = {"sliding": 0, "csa": 1, "hca": 2}
NATIVE_BUILT = native.available("cpu")


def two_calls_loss(weights, hidden, cache, spec):
    """mean(out^2) of a prefill of PROMPT tokens plus that of one decode step on its cache."""
    out1, cache, _ = attention_step(weights, cache, hidden[:, :PROMPT], None, spec)
    out2, _, _ = attention_step(weights, cache, hidden[:, PROMPT:], None, spec)
    return jnp.mean(out1.astype(jnp.float32) ** 2) + jnp.mean(out2.astype(jnp.float32) ** 2)


GRAD = jax.jit(jax.value_and_grad(two_calls_loss, argnums=(0, 1)), static_argnames="spec")


def loss_and_grads(layer: str, **options):
    attn = random_layer(CFG, LAYERS[layer], seed=4, **options)
    hidden = jnp.asarray(np.random.default_rng(5).normal(size=(BATCH, PROMPT + 1, CFG.hidden_size)), jnp.float32)
    cache = attn.init_cache(BATCH, 32).replace(layer_idx=-1)
    cache = cache.replace(length=jnp.asarray(cache.length))
    return GRAD(attn.weights(), hidden, cache, spec=attn.step_spec())


@functools.cache
def reference(layer: str):
    """The XLA reference: no native handler, no Pallas kernel, no break."""
    return loss_and_grads(layer, break_mode="none", kernels="xla")


def assert_same_gradients(got, want, rtol=2e-5):
    (loss, grads), (want_loss, want_grads) = got, want
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    paths = jax.tree_util.tree_leaves_with_path(want_grads)
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == len(paths)
    for (path, w), g in zip(paths, leaves):
        scale = float(np.abs(np.asarray(w)).max())
        name = jax.tree_util.keystr(path)
        assert scale > 0 or "indexer" in name, f"{name}: the reference gradient vanishes"
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=rtol * max(scale, 1e-30),
                                   err_msg=name)


@pytest.mark.parametrize("layer", list(LAYERS))
def test_every_kernel_differentiates_as_its_reference(layer, monkeypatch):
    """kernels="interpret": every Pallas kernel runs (prefill and decode sparse attention, the
    decode pooling, the indexer's scoring where the native selection is built), and jax.grad
    w.r.t. the weights and the input equals the XLA reference's."""
    from dsv4_jax.ops.compress import pallas as compressor_kernel
    from dsv4_jax.ops.indexer import pallas as indexer_kernel
    from dsv4_jax.ops.sparse_attention import pallas as sak

    ran = []
    for module, name in ((sak, "sparse_attention_kernel"), (compressor_kernel, "pool_one_token"),
                         (indexer_kernel, "index_scores")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, functools.partial(lambda real, name, *a, **k: ran.append(name)
                                                            or real(*a, **k), real, name))
    got = loss_and_grads(layer, break_mode="none", kernels="interpret")
    expected = ({"sparse_attention_kernel"} | ({"pool_one_token"} if layer != "sliding" else set())
                | ({"index_scores"} if layer == "csa" and NATIVE_BUILT else set()))
    assert set(ran) == expected
    assert_same_gradients(got, reference(layer))


@pytest.mark.parametrize("mode", [
    dict(break_mode="narrow", break_on="host"),
    dict(break_mode="wide"),
    pytest.param(dict(break_mode="narrow", break_on="device"),
                 marks=pytest.mark.skipif(not NATIVE_BUILT, reason="the native handlers are not built")),
    pytest.param(dict(break_mode="none", kernels="native"),
                 marks=pytest.mark.skipif(not NATIVE_BUILT, reason="the native handlers are not built")),
], ids=["narrow-host", "wide", "narrow-device", "none-native"])
def test_every_break_mode_gives_the_reference_gradient(mode):
    """The picks are integers and the break's inputs are cut from differentiation, so a host
    or device break changes nothing in the gradient (the kernels' own gradients: above); the
    wide break's host stages differentiate as their in-graph twin (`breaks.wide_host_call`): every
    leaf elementwise as `assert_same_gradients` says, and within the project's float32 bound
    (relative Frobenius 2e-5; test_native's check of the device break's gradients, merged here)."""
    got, want = loss_and_grads("csa", **mode), reference("csa")
    assert_same_gradients(got, want)
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want[1]), jax.tree.leaves(got[1]), strict=True):
        assert rel_err(g, w) < 2e-5, f"{jax.tree_util.keystr(path)}: {rel_err(g, w):.2e}"


@pytest.mark.parametrize("layer", ["sliding", "hca"])
def test_the_wide_break_differentiates_every_layer_type(layer):
    """The wide break runs every layer type's stages on the host (CSA: above): the gradient is
    the XLA reference's for the window-only and the HCA layer too."""
    assert_same_gradients(loss_and_grads(layer, break_mode="wide"), reference(layer))


def test_the_wide_break_refuses_forward_mode():
    """Reverse mode only, as through the kernels: JAX refuses a jvp of the host stages."""
    attn = random_layer(CFG, LAYERS["csa"], seed=4, break_mode="wide")
    x = jnp.ones((1, 9, CFG.hidden_size), jnp.float32)
    cache, spec = attn.init_cache(1, 16), attn.step_spec()
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda x: attention_step(attn.weights(), cache, x, None, spec)[0], (x,), (x,))


def test_nnx_grad_through_the_module_call():
    """The researcher's spelling: `nnx.grad` of a loss of the layer's call, kernels included."""
    attn = random_layer(CFG, LAYERS["hca"], seed=4, break_mode="none", kernels="interpret")
    hidden = jnp.asarray(np.random.default_rng(5).normal(size=(BATCH, PROMPT + 1, CFG.hidden_size)), jnp.float32)

    def loss(attn):
        cache = attn.init_cache(BATCH, 32)
        out1, cache = attn(hidden[:, :PROMPT], None, cache)
        out2, _ = attn(hidden[:, PROMPT:], None, cache)
        return jnp.mean(out1 ** 2) + jnp.mean(out2 ** 2)

    grads = nnx.grad(loss)(attn)
    want = reference("hca")[1][0]
    for name in ("q_b_proj", "o_a_proj", "sinks"):
        np.testing.assert_allclose(np.asarray(getattr(grads, name)[...]), np.asarray(getattr(want, name)),
                                   rtol=2e-5, atol=2e-5 * float(np.abs(np.asarray(getattr(want, name))).max()))
    np.testing.assert_allclose(np.asarray(grads.compressor.gate_proj[...]), np.asarray(want.compressor.gate_proj),
                               rtol=2e-5, atol=2e-5 * float(np.abs(np.asarray(want.compressor.gate_proj)).max()))


def test_differentiated_as_takes_the_references_vjp():
    """The kernel's forward, the reference's backward; integer and boolean arguments and None
    get no cotangent."""

    def reference_fn(x, idx, mask, w):
        return jnp.where(mask, jnp.sin(x[idx]) * w, 0.0)

    def kernel(x, idx, mask, w):  # a different forward: the gradient must not be its own
        return reference_fn(x, idx, mask, w) + 1.0

    fn = differentiated_as(reference_fn)(kernel)
    x, w = jnp.arange(5.0), jnp.asarray(2.0)
    idx, mask = jnp.asarray([4, 0, 0]), jnp.asarray([True, False, True])
    np.testing.assert_allclose(np.asarray(fn(x, idx, mask, w)), np.asarray(reference_fn(x, idx, mask, w) + 1.0))
    got = jax.grad(lambda x, w: fn(x, idx, mask, w).sum(), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: reference_fn(x, idx, mask, w).sum(), argnums=(0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_a_changed_plan_compiles_its_own_program(monkeypatch):
    """`kernels` is part of the step's static identity: switching it on a layer between calls
    runs the program it names (never a stale compiled one), and switching back reuses the first."""
    from dsv4_jax.ops.sparse_attention import pallas as sak

    traced = []
    real = sak.sparse_attention_kernel
    monkeypatch.setattr(sak, "sparse_attention_kernel", lambda *a, **k: traced.append(1) or real(*a, **k))
    attn = random_layer(CFG, LAYERS["sliding"], seed=7, break_mode="none", kernels="xla")
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 5, CFG.hidden_size)), jnp.float32)
    cache = attn.init_cache(1, 16)
    want, _ = attn(x, None, cache)
    assert not traced
    attn.kernels = KernelPlan(prefill_attention="interpret", decode_attention="interpret")  # 5 queries: "decode"
    got, _ = attn(x, None, cache)
    assert traced  # the kernel's program, compiled for the new plan
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    traced.clear()
    attn.kernels = "xla"
    again, _ = attn(x, None, cache)
    assert not traced and np.array_equal(np.asarray(again), np.asarray(want))


ON_GPU = jax.default_backend() == "gpu"
# Shapes the Triton kernels take (every dot dimension >= 16): 16 heads of 64, a window of 32.
TRITON_CFG = dsv4_jax.DeepseekV4Config.tiny(num_attention_heads=16, head_dim=64, qk_rope_head_dim=16, o_groups=4,
                                             sliding_window=32, index_topk=16)


def _prefill_and_decode_grads(layer: int, kernels, device=None, cfg=TRITON_CFG, dtype=jnp.float32):
    """value_and_grad of a 300-token prefill (>= 256 queries: the prefill kernel) plus a decode
    step (the decode kernels), in `dtype` (the loss in float32), on `device` (default: the
    default device)."""
    attn = random_layer(cfg, layer, seed=11, break_mode="none", kernels=kernels, dtype=dtype)
    rng = np.random.default_rng(12)
    hidden = np.asarray(rng.normal(size=(1, 301, cfg.hidden_size)), np.float32)
    cache = attn.init_cache(1, 320).replace(layer_idx=-1)
    args = (attn.weights(), hidden, cache.replace(length=np.asarray(cache.length)))
    args = jax.device_put(args, device)

    def loss(weights, hidden, cache):
        out1, cache, _ = attention_step(weights, cache, hidden[:, :300], None, attn.step_spec())
        out2, _, _ = attention_step(weights, cache, hidden[:, 300:], None, attn.step_spec())
        return jnp.mean(out1.astype(jnp.float32) ** 2) + jnp.mean(out2.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(*args)


@pytest.mark.skipif(not ON_GPU, reason="the Triton kernels need CUDA")
@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_gpu_gradients_with_the_triton_kernels_equal_the_cpu_reference(layer):
    """On the GPU with the Triton kernels forced for prefill and decode (and the native
    selection where built), float32 gradients equal the CPU's XLA reference gradients (rel 1e-4)."""
    pallas = KernelPlan(decode_attention="pallas", prefill_attention="pallas", compress="pallas", query_norm="pallas")
    got = _prefill_and_decode_grads(layer, pallas)
    want = _prefill_and_decode_grads(layer, "xla", jax.devices("cpu")[0])
    assert_same_gradients(jax.device_get(got), jax.device_get(want), rtol=1e-4)


# CSA's backward by the CUDA handler takes bf16 with 64 heads of 512 (V4-Flash's); the rest small.
HANDLER_CFG = FLASH_HEADS_CFG


@pytest.mark.skipif(not (ON_GPU and native.available("cuda")),
                    reason="the CUDA handler needs a GPU and the built CUDA extension")
def test_gpu_gradients_through_the_cuda_backward_handler():
    """A CSA layer's prefill + decode in bf16 with the kernels "auto" runs on CUDA, CSA's backward
    by the CUDA handler (`attention_backward="cuda"`, what "auto" takes there) against the Triton
    backward kernel: the layer's wiring around the handler (the output rotation's share of delta,
    the cotangent by output group, the sink) gives the Triton kernel's gradients, and both are as
    close to the CPU's float32 XLA reference as bf16 allows (the handler within twice the Triton
    path's error). Its 32-key window takes one key block: the prefill kernel's blocks are fitted
    to it (`sparse_attention_kernel.fit_to_window`; V4-Flash's blocks asked for more shared
    memory than the card has, session 65, whose H100 run passed with blocks (32, 64, 8, 2) given)."""
    def plan(backward):
        return KernelPlan(attention_backward=backward)

    by_handler = jax.device_get(_prefill_and_decode_grads(1, plan("cuda"), cfg=HANDLER_CFG, dtype=jnp.bfloat16))
    by_triton = jax.device_get(_prefill_and_decode_grads(1, plan("triton"), cfg=HANDLER_CFG, dtype=jnp.bfloat16))
    want = jax.device_get(_prefill_and_decode_grads(1, "xla", jax.devices("cpu")[0], cfg=HANDLER_CFG))
    np.testing.assert_allclose(float(by_handler[0]), float(by_triton[0]), rtol=1e-3)
    paths = jax.tree_util.tree_leaves_with_path(want[1])
    for (path, w), h, t in zip(paths, jax.tree.leaves(by_handler[1]), jax.tree.leaves(by_triton[1])):
        name = jax.tree_util.keystr(path)
        w, h, t = (np.asarray(a, np.float32) for a in (w, h, t))
        scale = float(np.abs(w).max())
        if scale == 0:  # the indexer's parameters: no gradient through the picks
            assert not np.abs(h).max() and not np.abs(t).max(), name
            continue
        np.testing.assert_allclose(h, t, rtol=0, atol=5e-2 * float(np.abs(t).max()), err_msg=f"{name} against Triton")
        handler_err, triton_err = (float(np.abs(a - w).max()) / scale for a in (h, t))
        print(f"bf16 layer gradient {name}: handler {handler_err:.2e}, Triton {triton_err:.2e}")
        assert handler_err <= max(2 * triton_err, 2 ** -6), name
