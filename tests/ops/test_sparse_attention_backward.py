"""The sparse attention backward kernel against the XLA path's VJP (`sparse_attention._xla_path`).

On the CPU the kernel runs in Pallas' interpret mode; on CUDA the Triton kernel itself (the GPU
tests, skipped elsewhere), at V4-Flash sizes. The cotangents of the queries, the key pool, the
sinks and the entries: float32 within 1e-5 of the XLA VJP; bf16 reported against float32 next
to the XLA VJP's own bf16 error.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sparse_attention_kernel import ON_GPU, XLA, query_inputs

from dsv4_jax import KernelPlan
from dsv4_jax.ops import rope
from dsv4_jax.ops.sparse_attention import backward_triton as sab
from dsv4_jax.ops.sparse_attention import pallas as sak
from dsv4_jax.ops.sparse_attention import reference as sa


def xla_vjp(q, pool, widx, sinks, kwargs, do):
    """The XLA path's cotangents (q, pool, sinks, entries or None), float32 at HIGHEST."""
    def f(q, pool, sinks, entries):
        kw = dict(kwargs, entries=entries) if entries is not None else kwargs
        return sa.sparse_attention(q, pool, widx, sinks, **kw, precision=jax.lax.Precision.HIGHEST, kernels=XLA).o

    _, vjp = jax.vjp(f, q, pool, sinks, kwargs.get("entries"))
    return vjp(do)


def kernel_vjp(q, pool, widx, sinks, kwargs, do, interpret, **blocks):
    o, lse = sak.sparse_attention_kernel(q, pool, widx, sinks, **kwargs, interpret=interpret, with_lse=True)
    dq, dpool, dsinks, dentries = sab.sparse_attention_backward(q, pool, widx, sinks, o, lse, do, **kwargs,
                                                                interpret=interpret, **blocks)
    return dq, dpool, dsinks, dentries


def assert_close(got, want, rtol):
    for name, g, w in zip(("dq", "dpool", "dsinks", "dentries"), got, want):
        if w is None:
            assert g is None, name
            continue
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max(), err_msg=name)


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("s, blocks", [(1, dict(block_keys=8, block_heads=4)), (5, dict(block_keys=4, block_heads=2))],
                         ids=["decode", "prefill"])
def test_backward_kernel_equals_the_xla_vjp_in_float32(kind, s, blocks):
    # Window 12 in blocks of 8 (padded) or 4, 13 entries, some picks -1, rows at position 0..;
    # two head blocks of 2 (prefill) or one of 4 (decode).
    q, pool, widx, sinks, kwargs = query_inputs(kind, b=3, h=4, d=8, w=12, t=13, k=6, dtype=jnp.float32, s=s)
    do = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)
    # Jitted, as a training step runs them: one program a side (eagerly every operation compiles on its own).
    got = jax.jit(functools.partial(kernel_vjp, interpret=True, **blocks))(q, pool, widx, sinks, kwargs, do)
    assert_close(got, jax.jit(xla_vjp)(q, pool, widx, sinks, kwargs, do), rtol=1e-5)


@pytest.mark.parametrize("rows, most, stretches", [(4096, 64, 64), (48, 64, 16), (6, 64, 2), (15, 64, 1),
                                                   (4096, 1, 1)])
def test_the_launch_order_is_a_permutation_of_the_rows(rows, most, stretches):
    assert sab.row_stretches(rows, most) == stretches
    order = np.asarray(sab._row_of(jnp.arange(rows), rows, stretches))
    np.testing.assert_array_equal(np.sort(order), np.arange(rows))
    if stretches > 1:  # launches next to each other run rows rows / G apart
        assert order[1] - order[0] == rows // stretches


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_backward_kernel_in_spread_launch_order_equals_the_xla_vjp(kind):
    # 2 x 8 = 16 rows in 8 stretches of 2: each program's row, its blocks of q, do, o, lse and its
    # dq and delta follow the launch order.
    q, pool, widx, sinks, kwargs = query_inputs(kind, b=2, h=4, d=8, w=12, t=13, k=6, dtype=jnp.float32, s=8)
    do = jnp.asarray(np.random.default_rng(4).normal(size=q.shape), jnp.float32)
    blocks = dict(block_keys=4, block_heads=2, row_stretches_most=8)
    got = jax.jit(functools.partial(kernel_vjp, interpret=True, **blocks))(q, pool, widx, sinks, kwargs, do)
    assert_close(got, jax.jit(xla_vjp)(q, pool, widx, sinks, kwargs, do), rtol=1e-5)


def test_the_layer_trains_through_the_backward_kernel_or_the_xla_vjp_alike():
    """`KernelPlan.attention_backward`: "auto" (the backward kernel) and "xla" (the reference's
    VJP) give the same gradients of `sparse_attention` with the forward kernel."""
    q, pool, widx, sinks, kwargs = query_inputs("csa", b=2, h=4, d=8, w=8, t=20, k=6, dtype=jnp.float32, s=7)

    def grads(backward):
        plan = KernelPlan(prefill_attention="interpret", prefill_blocks=(4, 2, 4, 1), decode_attention="interpret",
                          decode_blocks=(4, 2, 4, 1), attention_backward=backward)  # 7 queries a row: "decode"

        def loss(q, pool, sinks, entries):
            o = sa.sparse_attention(q, pool, widx, sinks, **dict(kwargs, entries=entries), kernels=plan,
                                    precision=jax.lax.Precision.HIGHEST).o
            return jnp.sum(jnp.sin(o))

        # Jitted, as a training step takes it (eagerly every operation compiles on its own).
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, pool, sinks, kwargs["entries"])

    want = grads("xla")
    assert_close(grads("auto"), want, rtol=1e-5)


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("output_groups", [1, 2])
def test_the_output_rotation_differentiates_as_rotating_afterwards(kind, output_groups):
    """`sparse_attention(..., rotation=)`: the kernel path de-rotates its output in place and its
    backward kernel takes the de-rotated output, the cotangent rotated back and the rotated
    channels' share of delta; outputs and gradients equal the XLA path's followed by the same
    inverse RoPE (float32; scale != 1 and padded slots at position -1 included), with the
    cotangent in the heads' order or by output group (`output_groups`)."""
    q, pool, widx, sinks, kwargs = query_inputs(kind, b=2, h=4, d=16, w=8, t=20, k=6, dtype=jnp.float32, s=7)
    positions = jnp.asarray(np.random.default_rng(5).integers(-1, 40, q.shape[:2]), jnp.int32)
    freqs = np.asarray([0.9, 0.3, 0.05], np.float32)  # the trailing 6 of 16 channels rotate
    rotation = sa.OutputRotation(positions, freqs, 1.25)
    entries = kwargs.pop("entries", None)
    plan = KernelPlan(prefill_attention="interpret", prefill_blocks=(4, 2, 4, 1), decode_attention="interpret",
                      decode_blocks=(4, 2, 4, 1))  # 7 queries a row: the decode phase (`phase_of`)

    def loss(plan, rotated):
        def f(q, pool, sinks, entries):
            o = sa.sparse_attention(q, pool, widx, sinks, **kwargs, entries=entries, kernels=plan,
                                    precision=jax.lax.Precision.HIGHEST, rotation=rotation if rotated else None,
                                    output_groups=output_groups).o
            if not rotated:
                o = rope.apply_rope(o, positions[..., None], freqs, inverse=True, scale=1.25)
            return jnp.sum(jnp.sin(o)), o
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True))(q, pool, sinks, entries)

    (got, o_got), (want, o_want) = loss(plan, True), loss(XLA, False)
    np.testing.assert_allclose(np.asarray(o_got), np.asarray(o_want), rtol=1e-6, atol=1e-6)
    assert_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("h, groups, block_heads", [(4, 1, 2), (4, 2, 2), (4, 4, 2), (6, 2, 2)],
                         ids=["part-of-a-group", "a-group", "two-groups", "rearranged"])
def test_the_backward_kernel_reads_the_cotangent_by_output_group(h, groups, block_heads):
    """`do_groups`: the cotangent as [G, B*S, H/G, D] (the grouped output projection's gradient's
    layout) gives the same cotangents, bit for bit, as [B, S, H, D], whether a program's heads
    are part of a group, one group, several, or (H/G = 3 against 2 heads a program) the groups
    are rearranged first."""
    q, pool, widx, sinks, kwargs = query_inputs("csa", b=2, h=h, d=8, w=8, t=13, k=6, dtype=jnp.float32, s=3)
    o, lse = sak.sparse_attention_kernel(q, pool, widx, sinks, **kwargs, interpret=True, with_lse=True)
    do = jnp.asarray(np.random.default_rng(4).normal(size=q.shape), jnp.float32)
    by_group = do.reshape(-1, groups, h // groups, 8).transpose(1, 0, 2, 3)

    def backward(do, do_groups):
        return sab.sparse_attention_backward(q, pool, widx, sinks, o, lse, do, **kwargs, interpret=True,
                                             block_keys=4, block_heads=block_heads, do_groups=do_groups)

    for got, want in zip(backward(by_group, groups), backward(do, None)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="do: expected"):
        backward(do, groups)
    with pytest.raises(ValueError, match=f"output_groups: expected a divisor of the {h} heads, got {h + 1}"):
        sa.sparse_attention(q, pool, widx, sinks, **kwargs, output_groups=h + 1)


def test_the_key_gradients_add_with_relaxed_atomics_in_the_triton_program():
    """The Triton program, lowered for CUDA on any machine, adds the key gradients with relaxed
    atomics (`relaxed_atomics`: half the kernel's time on the H200 against Pallas' acquire-release
    adds, bench/results/h200_backward_ab_2026-12-02_s35_1.json); `relaxed=False` is Pallas' own."""
    from dsv4_jax.ops.sparse_attention import relaxed_atomics

    if not relaxed_atomics.RELAXED:
        pytest.skip(f"jax {jax.__version__}'s Pallas internals differ: the public acquire-release atomic_add")
    q, pool, widx, sinks, kwargs = query_inputs("csa", b=1, h=16, d=16, w=16, t=16, k=16, dtype=jnp.bfloat16, s=4)
    lse = jnp.zeros(q.shape[:3], jnp.float32)

    def triton_module(relaxed):
        f = jax.jit(lambda q, pool, lse: sab.sparse_attention_backward(
            q, pool, widx, sinks, q, lse, q, **kwargs, block_keys=16, block_heads=16, relaxed=relaxed))
        try:
            return f.trace(q, pool, lse).lower(lowering_platforms=("cuda",)).as_text()
        except Exception as e:  # a jaxlib that cannot lower Pallas for CUDA here
            pytest.skip(f"no CUDA lowering of Pallas on this machine: {type(e).__name__}: {e}")

    assert "relaxed" in triton_module(True)
    assert "relaxed" not in triton_module(False)


@pytest.mark.skipif(not ON_GPU, reason="the Triton kernel needs CUDA")
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("b, s", [(1, 1), (4, 1), (1, 256)], ids=["decode1", "decode4", "prefill"])
def test_triton_backward_at_flash_sizes(kind, b, s):
    """V4-Flash shapes (64 heads of 512, window 128, top-512 of 4k entries or 129 HCA entries):
    float32 against the XLA VJP; bf16 against float32, beside the XLA VJP's own bf16 error."""
    t = 4096 if kind == "csa" else 129
    q, pool, widx, sinks, kwargs = query_inputs(kind, b=b, h=64, d=512, w=128, t=t, k=512, dtype=jnp.float32, s=s)
    do = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)
    want = xla_vjp(q, pool, widx, sinks, kwargs, do)
    assert_close(kernel_vjp(q, pool, widx, sinks, kwargs, do, interpret=False), want, rtol=1e-4)
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    kw16 = {n: (bf(v) if n == "entries" else v) for n, v in kwargs.items()}
    got16 = kernel_vjp(bf(q), bf(pool), widx, sinks, kw16, bf(do), interpret=False)
    xla16 = xla_vjp(bf(q), bf(pool), widx, sinks, kw16, bf(do))
    for name, g, x, w in zip(("dq", "dpool", "dsinks", "dentries"), got16, xla16, want):
        if w is None:
            continue
        scale = float(np.abs(np.asarray(w, np.float32)).max())
        kernel_err = float(np.abs(np.asarray(g, np.float32) - np.asarray(w, np.float32)).max()) / scale
        xla_err = float(np.abs(np.asarray(x, np.float32) - np.asarray(w, np.float32)).max()) / scale
        print(f"bf16 backward {kind} B={b} S={s} {name}: kernel {kernel_err:.2e}, XLA VJP {xla_err:.2e}")
        assert kernel_err <= max(2 * xla_err, 2 ** -6)


@pytest.mark.skipif(not ON_GPU, reason="the Triton kernel needs CUDA")
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_triton_backward_by_output_group_at_flash_sizes(kind):
    """The Triton kernel reading the cotangent as V4-Flash's grouped output projection leaves it
    ([8, B*S, 8, 512]: four groups a program of 32 heads) gives the cotangents of reading it as
    [B, S, H, D], up to the order of float sums (delta's in the tiles' layout, the keys' atomic
    adds): a head read from the wrong place would be off by the size of the gradients."""
    t = 4096 if kind == "csa" else 129
    q, pool, widx, sinks, kwargs = query_inputs(kind, b=1, h=64, d=512, w=128, t=t, k=512, dtype=jnp.bfloat16, s=256)
    o, lse = sak.sparse_attention_kernel(q, pool, widx, sinks, **kwargs, with_lse=True)
    do = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.bfloat16)
    by_group = do.reshape(-1, 8, 8, 512).transpose(1, 0, 2, 3)
    grouped = sab.sparse_attention_backward(q, pool, widx, sinks, o, lse, by_group, **kwargs, do_groups=8)
    plain = sab.sparse_attention_backward(q, pool, widx, sinks, o, lse, do, **kwargs)
    for name, got, want in zip(("dq", "dpool", "dsinks", "dentries"), grouped, plain):
        if want is None:
            continue
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * np.abs(want).max(), err_msg=name)


CUDA_HANDLER = ON_GPU and sab.native.available("cuda")


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_the_cuda_handler_refuses_what_it_does_not_take(kind):
    """`cuda=True` where the handler cannot run (here: small float32 shapes, HCA's ranges, or no
    CUDA handler in this process) is a ValueError that says why, not an XLA error at run time."""
    q, pool, widx, sinks, kwargs = query_inputs(kind, b=1, h=4, d=8, w=8, t=13, k=6, dtype=jnp.float32, s=3)
    o = jnp.zeros_like(q)
    lse = jnp.zeros(q.shape[:3], jnp.float32)
    with pytest.raises(ValueError, match=r"cuda=True: the CUDA handler does not take q float32\[1, 3, 4, 8\]"):
        sab.sparse_attention_backward(q, pool, widx, sinks, o, lse, o, **kwargs, cuda=True)


@pytest.mark.skipif(not CUDA_HANDLER, reason="the CUDA handler needs a GPU and the built CUDA extension")
@pytest.mark.parametrize("b, s, groups, rotated", [(1, 1, None, 0), (4, 1, None, 0), (1, 256, None, 0),
                                                    (2, 128, 8, 64)], ids=["decode1", "decode4", "prefill",
                                                                           "grouped_rotated"])
def test_cuda_backward_at_flash_sizes(b, s, groups, rotated):
    """The CUDA handler (CSA, bf16, 64 heads of 512: `attention_backward="cuda"`) against the XLA
    VJP in float32, beside the XLA VJP's own bf16 error (the Triton kernel's criterion), and
    against the Triton kernel on the same bf16 inputs, with the cotangent by output group and
    an output rotation's share of delta as the layer passes them."""
    q, pool, widx, sinks, kwargs = query_inputs("csa", b=b, h=64, d=512, w=128, t=4096, k=512, dtype=jnp.float32,
                                                s=s)
    do = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)
    want = xla_vjp(q, pool, widx, sinks, kwargs, do)
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    kw16 = {n: (bf(v) if n == "entries" else v) for n, v in kwargs.items()}
    o, lse = sak.sparse_attention_kernel(bf(q), bf(pool), widx, sinks, **kw16, with_lse=True)
    extra = {}
    if rotated:  # delta's rotated share given apart (any values: both kernels add it as given)
        extra = dict(rotated=rotated, delta_rotated=jnp.asarray(np.random.default_rng(4).normal(size=q.shape[:3]),
                                                                 jnp.float32))
    do16 = bf(do) if groups is None else sab.by_output_group(bf(do), groups)
    args = (bf(q), bf(pool), widx, sinks, o, lse, do16)
    got = sab.sparse_attention_backward(*args, **kw16, do_groups=groups, cuda=True, **extra)
    triton = sab.sparse_attention_backward(*args, **kw16, do_groups=groups, **extra)
    for name, g, t in zip(("dq", "dpool", "dsinks", "dentries"), got, triton):
        g, t = np.asarray(g, np.float32), np.asarray(t, np.float32)
        np.testing.assert_allclose(g, t, rtol=0, atol=1e-2 * np.abs(t).max(), err_msg=f"{name} against Triton")
    if rotated:
        return
    xla16 = xla_vjp(bf(q), bf(pool), widx, sinks, kw16, bf(do))
    for name, g, x, w in zip(("dq", "dpool", "dsinks", "dentries"), got, xla16, want):
        scale = float(np.abs(np.asarray(w, np.float32)).max())
        kernel_err = float(np.abs(np.asarray(g, np.float32) - np.asarray(w, np.float32)).max()) / scale
        xla_err = float(np.abs(np.asarray(x, np.float32) - np.asarray(w, np.float32)).max()) / scale
        print(f"bf16 CUDA backward B={b} S={s} {name}: handler {kernel_err:.2e}, XLA VJP {xla_err:.2e}")
        assert kernel_err <= max(2 * xla_err, 2 ** -6)
