"""The sparse attention backward kernels against the XLA path's VJP (`sparse_attention._xla_path`).

On the CPU the kernels run in Pallas' interpret mode; on CUDA the Triton kernels themselves (the
GPU tests, skipped elsewhere), at V4-Flash sizes. The cotangents of the queries, the key pool,
the sinks and the entries: float32 within 1e-5 of the XLA VJP; bf16 reported against float32
next to the XLA VJP's own bf16 error. Both ways of summing the key gradients: by query with
atomic adds (any indices), and by key where the queries are in order (the layer's prefills:
ragged rows, a window cache partly filled, HCA's visible prefix).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sparse_attention_kernel import ON_GPU, XLA, query_inputs

from dsv4_jax import KernelPlan
from dsv4_jax import sparse_attention as sa
from dsv4_jax import sparse_attention_backward as sab
from dsv4_jax import sparse_attention_kernel as sak


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


def in_order_inputs(kind: str, b: int, h: int, d: int, w: int, s: int, starts, real, ratio: int, k: int = 6,
                    dtype=jnp.float32, seed: int = 0):
    """S queries per row at positions start_b .. start_b + real_b - 1, then padding (-1), as the
    layer calls sparse attention: window indices from the positions, HCA's visible prefix
    (t + 1) // ratio, CSA's picks random (distinct, a tail of -1; at most k, at most the entries)
    among (last position + 1) // ratio + 1 entries."""
    rng = np.random.default_rng(seed)
    starts = np.asarray(starts, np.int32)
    positions = starts[:, None] + np.arange(s, dtype=np.int32)[None, :]
    positions = np.where(np.arange(s)[None, :] < np.asarray(real)[:, None], positions, -1).astype(np.int32)
    t = int(positions.max() + 1) // ratio + 1
    q = jnp.asarray(rng.normal(size=(b, s, h, d)), dtype)
    pool = jnp.asarray(rng.normal(size=(b, w + s, d)), dtype)
    sinks = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    widx = sa.window_indices(jnp.asarray(positions), jnp.asarray(starts), w)
    kwargs = {}
    if kind != "sliding":
        kwargs["entries"] = jnp.asarray(rng.normal(size=(b, t, d)), dtype)
    if kind == "hca":
        kwargs["visible"] = jnp.asarray((positions + 1) // ratio, jnp.int32)
    elif kind == "csa":
        k = min(k, t)
        picks = np.stack([rng.permutation(t)[:k] for _ in range(b * s)]).astype(np.int32)
        picks[np.arange(k)[None, :] >= rng.integers(1, k + 1, b * s)[:, None]] = -1
        kwargs["picks"] = jnp.asarray(picks.reshape(b, s, k))
    return q, pool, widx, sinks, kwargs


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
    got = kernel_vjp(q, pool, widx, sinks, kwargs, do, interpret=True, **blocks)
    assert_close(got, xla_vjp(q, pool, widx, sinks, kwargs, do), rtol=1e-5)


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("rows_per_program", [64, 3], ids=["one_share", "shares"])
def test_backward_by_key_equals_the_xla_vjp_in_float32(kind, rows_per_program, monkeypatch):
    # Rows from position 0 (the window fills up), 5 (ragged: 3 padded queries) and 40 (a full
    # window cache, its slots read by the first queries); a key's readers in one program's
    # share (64) or split over shares of 3 rows, some of which hold no reader.
    monkeypatch.setattr(sab, "ROWS_PER_PROGRAM", rows_per_program)
    q, pool, widx, sinks, kwargs = in_order_inputs(kind, b=3, h=4, d=8, w=12, s=9, starts=[0, 5, 40],
                                                   real=[9, 6, 9], ratio=4)
    do = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)
    got = kernel_vjp(q, pool, widx, sinks, kwargs, do, interpret=True, block_keys=4, block_heads=2,
                     queries_in_order=True)
    assert_close(got, xla_vjp(q, pool, widx, sinks, kwargs, do), rtol=1e-5)


def test_reader_ranges_are_the_first_and_last_query_that_reads_each_key():
    _, pool, widx, _, kwargs = in_order_inputs("hca", b=2, h=2, d=4, w=4, s=6, starts=[0, 9], real=[6, 4],
                                               ratio=2)
    lo, hi = sab.reader_ranges(widx.reshape(12, 4), 2, pool.shape[1], 6)
    # Row 0 (positions 0..5): key s (pool slot 4 + s) is read by queries s .. s + 3; the cache's
    # slots by nobody. Row 1 (positions 9..12, then padding): slots 4 + s likewise up to query 3;
    # cache slots 2, 3, 0 hold positions 6, 7, 8, read by queries up to 0, 1, 2.
    np.testing.assert_array_equal(lo[0], [6, 6, 6, 6, 0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(hi[0], [-1, -1, -1, -1, 3, 4, 5, 5, 5, 5])
    np.testing.assert_array_equal(lo[1], [0, 6, 0, 0, 0, 1, 2, 3, 6, 6])
    np.testing.assert_array_equal(hi[1], [2, -1, 0, 1, 3, 3, 3, 3, -1, -1])
    visible = kwargs["visible"].reshape(12)
    eidx = sak.entry_indices(12, kwargs["entries"], None, visible)
    lo, hi = sab.reader_ranges(eidx, 2, kwargs["entries"].shape[1], 6)
    np.testing.assert_array_equal(lo[0, :3], [1, 3, 5])  # entry w: from the first query at t >= 2w + 1
    np.testing.assert_array_equal(hi[0, :3], [5, 5, 5])


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_the_layer_trains_through_the_backward_kernels_or_the_xla_vjp_alike(kind):
    """`KernelPlan.attention_backward`: "auto" (the backward kernels, by key where the queries are
    in order), "atomics" (by query) and "xla" (the reference's VJP) give the same gradients of
    `sparse_attention` with the forward kernel."""
    q, pool, widx, sinks, kwargs = in_order_inputs(kind, b=2, h=4, d=8, w=8, s=7, starts=[3, 30], real=[7, 5],
                                                   ratio=4)

    def grads(backward):
        plan = KernelPlan(prefill_attention="interpret", prefill_blocks=(4, 2, 4, 1), attention_backward=backward)

        def loss(q, pool, sinks, entries):
            o = sa.sparse_attention(q, pool, widx, sinks, **dict(kwargs, entries=entries), kernels=plan,
                                    precision=jax.lax.Precision.HIGHEST, queries_in_order=True).o
            return jnp.sum(jnp.sin(o))

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, pool, sinks, kwargs["entries"])

    want = grads("xla")
    assert_close(grads("auto"), want, rtol=1e-5)
    assert_close(grads("atomics"), want, rtol=1e-5)


def test_the_key_gradients_add_with_relaxed_atomics_in_the_triton_program():
    """The Triton program, lowered for CUDA on any machine, adds the key gradients with relaxed
    atomics (`relaxed_atomics`: half the kernel's time on the H200 against Pallas' acquire-release
    adds, bench/results/h200_backward_ab_2026-12-02_s35_1.json); `relaxed=False` is Pallas' own."""
    from dsv4_jax import relaxed_atomics

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


def test_the_triton_program_sums_in_order_prefills_by_key():
    """With `queries_in_order` the CUDA program has the by-key kernel (window and HCA entries),
    lowered for CUDA on any machine."""
    q, pool, widx, sinks, kwargs = in_order_inputs("hca", b=1, h=16, d=16, w=16, s=32, starts=[0], real=[32],
                                                   ratio=4, dtype=jnp.bfloat16)
    lse = jnp.zeros(q.shape[:3], jnp.float32)

    def triton_module(in_order):
        f = jax.jit(lambda q, pool, lse: sab.sparse_attention_backward(
            q, pool, widx, sinks, q, lse, q, **kwargs, block_keys=16, block_heads=16, queries_in_order=in_order))
        try:
            return f.trace(q, pool, lse).lower(lowering_platforms=("cuda",)).as_text()
        except Exception as e:  # a jaxlib that cannot lower Pallas for CUDA here
            pytest.skip(f"no CUDA lowering of Pallas on this machine: {type(e).__name__}: {e}")

    assert triton_module(True).count("sparse_attention_backward_by_key") >= 2  # window and entries
    assert "sparse_attention_backward_by_key" not in triton_module(False)


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
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_triton_backward_by_key_at_flash_sizes(kind):
    """V4-Flash shapes, a prefill of 320 queries in order (a row from position 0, a ragged row after
    200 cached tokens), the window keys' and HCA entries' gradients by key: float32 against the
    XLA VJP; bf16 within the XLA VJP's own bf16 error (as above)."""
    ratio = 4 if kind == "csa" else 128
    q, pool, widx, sinks, kwargs = in_order_inputs(kind, b=2, h=64, d=512, w=128, s=320, starts=[0, 200],
                                                   real=[320, 250], ratio=ratio, k=512)
    do = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.float32)
    want = xla_vjp(q, pool, widx, sinks, kwargs, do)
    assert_close(kernel_vjp(q, pool, widx, sinks, kwargs, do, interpret=False, queries_in_order=True), want,
                 rtol=1e-4)
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    kw16 = {n: (bf(v) if n == "entries" else v) for n, v in kwargs.items()}
    got16 = kernel_vjp(bf(q), bf(pool), widx, sinks, kw16, bf(do), interpret=False, queries_in_order=True)
    xla16 = xla_vjp(bf(q), bf(pool), widx, sinks, kw16, bf(do))
    for name, g, x, w in zip(("dq", "dpool", "dsinks", "dentries"), got16, xla16, want):
        if w is None:
            continue
        scale = float(np.abs(np.asarray(w, np.float32)).max())
        kernel_err = float(np.abs(np.asarray(g, np.float32) - np.asarray(w, np.float32)).max()) / scale
        xla_err = float(np.abs(np.asarray(x, np.float32) - np.asarray(w, np.float32)).max()) / scale
        print(f"bf16 backward by key {kind} {name}: kernel {kernel_err:.2e}, XLA VJP {xla_err:.2e}")
        assert kernel_err <= max(2 * xla_err, 2 ** -6)
