"""The range backward (`sparse_attention_backward_wgmma`, Mosaic GPU) against the Triton kernel
and the XLA path's VJP.

On the CPU its kernels run in Mosaic GPU's interpret mode (jax >= 0.12; older interpret modes
lack transposed wgmma operands, and the tests skip), eagerly: under a jit XLA's CPU thread pool
can be too small for the simulated warp groups waiting on each other (a hang on 2 cores), so the
layer takes them in interpret mode only where its backward runs eagerly. On CUDA the compiled
kernels at V4-Flash size (the GPU tests). bf16 only: the cotangents equal the Triton kernel's
(interpret mode, up to the order of float32 sums) and are as close to the float32 XLA VJP as the
Triton kernel's; CSA's calls (scattered picks) stay with the Triton kernel. Deviceless
compilation for the H200: tests/bench/test_h200_compile.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sparse_attention_backward import kernel_vjp, xla_vjp
from test_sparse_attention_kernel import ON_GPU, query_inputs

from dsv4_jax import KernelPlan
from dsv4_jax.ops.sparse_attention import backward_wgmma as sabw
from dsv4_jax.ops.sparse_attention import pallas as sak
from dsv4_jax.ops.sparse_attention import reference as sa

# A call the kernels take by its shapes (bf16, 64 heads of 128, ranges): `supports` then says
# whether this jax runs them (compiled, or in interpret mode).
TAKEN = jnp.zeros((1, 2, 64, 128), jnp.bfloat16)
needs_interpret = pytest.mark.skipif(not sabw.supports(TAKEN, True, interpret=True),
                                     reason="Mosaic GPU's interpret mode runs these kernels from jax 0.12")
NAMES = ("dq", "dpool", "dsinks", "dentries")


def bf16(x):
    return x.astype(jnp.bfloat16)


def range_vjp(q, pool, widx, sinks, kwargs, do, interpret):
    o, lse = sak.sparse_attention_kernel(q, pool, widx, sinks, **kwargs, interpret=interpret, with_lse=True)
    return sabw.sparse_attention_backward_wgmma(q, pool, widx, sinks, o, lse, do, **kwargs, interpret=interpret)


def bf16_inputs(kind, s, starts, h=64, d=128, seed=1):
    # Window 12; 70 entries: two blocks of 64, the second padded; rows at any position; CSA 20 picks.
    q, pool, widx, sinks, kwargs = query_inputs(kind, b=2, h=h, d=d, w=12, t=70, k=20 if kind == "csa" else 0,
                                                dtype=jnp.float32, s=s, seed=seed, starts=starts)
    do = jnp.asarray(np.random.default_rng(seed + 2).normal(size=q.shape), jnp.float32)
    return q, pool, widx, sinks, kwargs, do


@needs_interpret
# A covering set (interpret mode is slow): each layer type once, each call shape once.
@pytest.mark.parametrize("kind, s, starts", [("sliding", 1, [0, 30]), ("hca", 5, [0, 9])],
                         ids=["decode-sliding", "prefill-hca"])
def test_range_kernels_equal_the_triton_kernel(kind, s, starts):
    assert_like_the_triton_kernel(*bf16_inputs(kind, s, starts))


@needs_interpret
def test_two_head_tiles_sum_their_key_gradients():
    """128 heads: two tiles of 64, each its own dq programs; a key block's gradient sums both
    tiles' in float32 (one rounding, as the Triton kernel's)."""
    assert_like_the_triton_kernel(*bf16_inputs("hca", 2, [0, 9], h=128, d=128))


@needs_interpret
def test_a_key_blocks_reader_rows_split_across_programs_sum_to_the_same_gradient(monkeypatch):
    """Every later row of its batch row reads an HCA entry block: `splits_for` cuts those rows into
    runs of ROWS_PER_SPLIT, a program each, whose float32 partial sums are added (here runs of 2
    rows, so 3 programs a block for 5 rows)."""
    monkeypatch.setattr(sabw, "ROWS_PER_SPLIT", 2)
    assert sabw.splits_for(5, 128, 128) == 3
    assert_like_the_triton_kernel(*bf16_inputs("hca", 5, [0, 9]))


@needs_interpret
@pytest.mark.parametrize("groups", [8])  # the layer's 2 groups: the next-but-one test, through its VJP
def test_the_kernels_read_the_cotangent_by_output_group(groups):
    """do in the output projection's layout [G, B*S, H/G, D] (`do_groups`): the kernels copy each
    group's heads into their tile (no transposed copy of do first), with the same gradients."""
    q, pool, widx, sinks, kwargs, do = bf16_inputs("hca", 3, [0, 9])
    kw = {k: bf16(v) if k == "entries" else v for k, v in kwargs.items()}
    q, pool, do = bf16(q), bf16(pool), bf16(do)
    o, lse = sak.sparse_attention_kernel(q, pool, widx, sinks, **kw, interpret=True, with_lse=True)
    b, s, h, d = q.shape
    by_group = do.reshape(b * s, groups, h // groups, d).transpose(1, 0, 2, 3)
    want = sabw.sparse_attention_backward_wgmma(q, pool, widx, sinks, o, lse, do, **kw, interpret=True)
    got = sabw.sparse_attention_backward_wgmma(q, pool, widx, sinks, o, lse, by_group, **kw, interpret=True,
                                               do_groups=groups)
    for name, g, w in zip(NAMES, got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * np.abs(w).max(), err_msg=name)


@needs_interpret
@pytest.mark.parametrize("kind, keys, stages", [("hca", 32, 2), ("sliding", 32, 1)])  # a covering set
def test_the_dq_kernel_in_32_key_blocks_double_buffered_gives_the_same_dq(kind, keys, stages, monkeypatch):
    """The dq kernel's other blocking (`dq_of(keys=, stages=)`, an A/B candidate): 32-key blocks,
    the next one's copy in flight while this one's dots run (2 buffers), across the window and
    HCA's entries as one sequence of blocks: dq equal to the default's up to the order of its
    float32 sums."""
    q, pool, widx, sinks, kwargs, do = bf16_inputs(kind, 5, [0, 9])
    kw = {k: bf16(v) if k == "entries" else v for k, v in kwargs.items()}
    q, pool, do = bf16(q), bf16(pool), bf16(do)
    o, lse = sak.sparse_attention_kernel(q, pool, widx, sinks, **kw, interpret=True, with_lse=True)

    def dq():
        return np.asarray(sabw.sparse_attention_backward_wgmma(q, pool, widx, sinks, o, lse, do, **kw, interpret=True,
                                                               dq_dtype=jnp.float32)[0])

    want = dq()
    monkeypatch.setattr(sabw, "dq_of", functools.partial(sabw.dq_of, keys=keys, stages=stages))
    np.testing.assert_allclose(dq(), want, rtol=0, atol=1e-5 * np.abs(want).max())


def assert_like_the_triton_kernel(q, pool, widx, sinks, kwargs, do):
    """The range kernels' bf16 cotangents equal the Triton kernel's (interpret mode) up to 1e-3 of
    their scale and are as close to the float32 XLA VJP as its are."""
    want = xla_vjp(q, pool, widx, sinks, kwargs, do)  # float32
    kw = {k: bf16(v) if k == "entries" else v for k, v in kwargs.items()}
    args = (bf16(q), bf16(pool), widx, sinks, kw, bf16(do))
    triton = jax.jit(functools.partial(kernel_vjp, interpret=True, block_keys=16, block_heads=32))(*args)
    got = range_vjp(*args, interpret=True)
    for name, g, t, w in zip(NAMES, got, triton, want):
        if w is None:
            assert g is None, name
            continue
        g, t, w = (np.asarray(x, np.float32) for x in (g, t, w))
        scale = np.abs(w).max()
        # bf16 results: where the float32 sums (in another order) straddle a rounding boundary,
        # one unit in the last place apart (2^-8 to 2^-7 of the value)
        np.testing.assert_allclose(g, t, rtol=2 ** -7, atol=1e-3 * scale, err_msg=name)
        assert np.abs(g - w).max() <= 1.01 * np.abs(t - w).max() + 1e-4 * scale, name


@needs_interpret
# A covering set: HCA's window and entries through the range kernels (a sliding layer's window
# alone is test_range_kernels_equal_the_triton_kernel's), CSA's calls left to the Triton kernel.
@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_the_attention_differentiates_through_the_range_kernels(kind, monkeypatch):
    """`sparse_attention(..., window_contiguous=True)` with ``attention_backward="wgmma"``: the
    gradient through the custom VJP (output rotation, the cotangent by output group) equals the
    Triton backward kernel's and is as close to the float32 XLA gradient; eagerly the range
    kernels run (not for CSA: its picks are scattered, the Triton kernel takes the call), under a
    jit (interpret mode) the Triton kernel alone."""
    q, pool, widx, sinks, kwargs, do = bf16_inputs(kind, 4, [0, 9])
    positions = jnp.asarray(np.array([[0, 1, 2, 3], [9, 10, 11, 12]], np.int32))
    rotation = sa.OutputRotation(positions, np.asarray([0.9, 0.3, 0.05, 0.01], np.float32), 1.25)
    kwargs = {k: bf16(v) if k == "entries" else v for k, v in kwargs.items()}
    calls = []
    by_ranges = sabw.sparse_attention_backward_wgmma
    monkeypatch.setattr(sabw, "sparse_attention_backward_wgmma", lambda *a, **k: calls.append(1) or by_ranges(*a, **k))

    def grads(backward, jit=False, plan=None, dtype=jnp.bfloat16):
        plan = plan or KernelPlan(prefill_attention="interpret", decode_attention="interpret",
                                  attention_backward=backward)  # 4 queries a row: the decode phase
        kw = {k: v.astype(dtype) if k == "entries" else v for k, v in kwargs.items()}

        def loss(q, pool, entries):
            args = dict(kw, entries=entries) if entries is not None else kw
            o = sa.sparse_attention(q, pool, widx, sinks, **args, kernels=plan, rotation=rotation, output_groups=2,
                                    window_contiguous=True, precision=jax.lax.Precision.HIGHEST).o
            return jnp.sum(o.astype(jnp.float32) * do)

        grad = jax.grad(loss, argnums=(0, 1, 2))
        return (jax.jit(grad) if jit else grad)(q.astype(dtype), pool.astype(dtype), kw.get("entries"))

    ranges = [] if kind == "csa" else [1]
    got = grads("wgmma")
    assert calls == ranges
    assert all(g is None or np.isfinite(np.asarray(g, np.float32)).all() for g in grads("wgmma", jit=True))
    assert calls == ranges  # traced: the Triton kernel
    want = grads("xla", jit=True, plan=KernelPlan.named("xla"), dtype=jnp.float32)
    for name, g, t, w in zip(("dq", "dpool", "dentries"), got, grads("triton", jit=True), want):
        if t is None:
            assert g is None
            continue
        g, t, w = (np.asarray(x, np.float32) for x in (g, t, w))
        np.testing.assert_allclose(g, t, rtol=0, atol=2e-3 * np.abs(t).max(), err_msg=name)
        assert np.abs(g - w).max() <= 1.01 * np.abs(t - w).max() + 1e-4 * np.abs(w).max(), name


def test_readers_are_the_rows_whose_range_meets_each_block():
    rng = np.random.default_rng(0)
    rows, blocks = 40, 5
    lo = rng.integers(0, blocks * 64, rows)
    hi = np.where(rng.random(rows) < 0.2, lo, np.minimum(lo + rng.integers(1, 150, rows), blocks * 64))
    ranges = np.zeros((rows, sabw.SCALARS), np.int32)
    ranges[:, 2], ranges[:, 3] = lo, hi  # source 1
    got = np.asarray(sabw.readers(jnp.asarray(ranges), 1, blocks))
    for kb in range(blocks):
        meets = [r for r in range(rows) if hi[r] > lo[r] and lo[r] < (kb + 1) * 64 and hi[r] > kb * 64]
        want = (meets[0], meets[-1] + 1) if meets else (0, 0)
        assert tuple(got[kb, :2]) == want, kb


def test_the_rows_and_work_items_launch_on_cudas_x_axis(monkeypatch):
    """Mosaic GPU launches a grid's last axis as CUDA's x (up to 2^31 - 1 blocks), the others as y
    and z (up to 65,535). With the rows first, 4 rows of 16k (65,536 query rows) failed to launch
    on the H200 (CUDA_ERROR_INVALID_VALUE, session 55). Traced abstractly (no kernel runs)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    grids = {}

    def kernel(body, *, out_type, grid, grid_names, **_):
        grids[grid_names] = grid
        return lambda *args: jnp.zeros(out_type.shape, out_type.dtype)

    monkeypatch.setattr(plgpu, "kernel", kernel)
    monkeypatch.setattr(sabw, "_jitted_kernel", sabw._jitted_kernel.__wrapped__)  # no fake kernel cached
    rows, n, h, d = 4 * 16384 + 64, 70000 * 64, 128, 512
    q = jax.ShapeDtypeStruct((rows, h, d), jnp.bfloat16)
    stats = jax.ShapeDtypeStruct((rows, h), jnp.float32)
    source = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
    ranges = jax.ShapeDtypeStruct((rows, sabw.SCALARS), jnp.int32)
    jax.eval_shape(lambda *a: sabw.dq_of(*a[:4], [a[4]], a[5]), q, q, stats, stats, source, ranges)
    jax.eval_shape(lambda *a: sabw.dkv_of(*a[:4], [a[4]], a[5], splits=[3]), q, q, stats, stats, source, ranges)
    assert grids == {("heads", "row"): (h // 64, rows), ("item",): (3 * n // 64,)}


def test_the_key_gradient_kernels_work_items_cover_every_block_and_split_once():
    """One launch for every source: program i is a (source, key block, split, the source's splits,
    the block's row in the sources' concatenated reader tables), split-major within a source."""
    blocks, splits = (3, 2, 1), (2, 4, 1)
    got = [tuple(int(v) for v in sabw.work_item(jnp.int32(i), blocks, splits)) for i in range(6 + 8 + 1)]
    want = ([(0, kb, j, 2, kb) for j in range(2) for kb in range(3)]
            + [(1, kb, j, 4, 3 + kb) for j in range(4) for kb in range(2)] + [(2, 0, 0, 1, 5)])
    assert got == want


@pytest.mark.skipif(not sabw.supports(TAKEN, True), reason="no Mosaic GPU Pallas API in this jax")
def test_the_range_kernels_take_bf16_windows_of_64_heads():
    q = TAKEN
    assert sabw.supports(q, window_contiguous=True)
    assert not sabw.supports(q, window_contiguous=False)
    assert not sabw.supports(q.astype(jnp.float32), window_contiguous=True)
    assert not sabw.supports(jnp.zeros((1, 2, 32, 128), jnp.bfloat16), window_contiguous=True)
    assert not sabw.supports(jnp.zeros((1, 2, 64, 96), jnp.bfloat16), window_contiguous=True)


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernels need CUDA")
@pytest.mark.parametrize("kind", ["sliding", "hca"])
@pytest.mark.parametrize("b, s", [(1, 1), (2, 256)], ids=["decode", "prefill"])
def test_range_backward_at_flash_sizes(kind, b, s):
    """V4-Flash (64 heads x 512, window 128, 300 entries), compiled: equal to the Triton kernel's."""
    q, pool, widx, sinks, kwargs = query_inputs(kind, b=b, h=64, d=512, w=128, t=300, k=0, dtype=jnp.bfloat16,
                                                s=s, seed=5)
    do = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.bfloat16)
    args = (q, pool, widx, sinks, kwargs, do)
    triton = jax.jit(functools.partial(kernel_vjp, interpret=False))(*args)
    got = jax.jit(functools.partial(range_vjp, interpret=False))(*args)
    for name, g, t in zip(NAMES, got, triton):
        if t is None:
            assert g is None
            continue
        g, t = np.asarray(g, np.float32), np.asarray(t, np.float32)
        print(f"{kind} b={b} s={s} {name}: max |range - triton| / max |triton| = "
              f"{np.abs(g - t).max() / np.abs(t).max():.2e}")
        np.testing.assert_allclose(g, t, rtol=0, atol=2e-2 * np.abs(t).max(), err_msg=name)


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernels need CUDA")
def test_range_backward_past_65535_query_rows():
    """4 x 16,400 = 65,600 query rows (HCA, 64 heads, D = 128 to keep the inputs small), compiled:
    more programs than CUDA's y and z axes launch (65,535), equal to the Triton kernel's. With the
    rows on y, a training step of 4 x 16k rows failed to launch on the H200 (session 55)."""
    q, pool, widx, sinks, kwargs = query_inputs("hca", b=4, h=64, d=128, w=128, t=300, k=0, dtype=jnp.bfloat16,
                                                s=16400, seed=5)
    do = jnp.asarray(np.random.default_rng(7).normal(size=q.shape).astype(np.float32), jnp.bfloat16)
    args = (q, pool, widx, sinks, kwargs, do)
    triton = jax.jit(functools.partial(kernel_vjp, interpret=False))(*args)
    got = jax.jit(functools.partial(range_vjp, interpret=False))(*args)
    for name, g, t in zip(NAMES, got, triton):
        g, t = np.asarray(g, np.float32), np.asarray(t, np.float32)
        np.testing.assert_allclose(g, t, rtol=0, atol=2e-2 * np.abs(t).max(), err_msg=name)


@pytest.mark.skipif(not ON_GPU, reason="the Mosaic GPU kernels need CUDA")
def test_range_backward_double_buffered_at_flash_sizes(monkeypatch):
    """The dq kernel's A/B candidate, 32-key blocks in 2 buffers (`dq_of(keys=32, stages=2)`),
    compiled at V4-Flash size (HCA prefill: the window and the entries as one sequence of blocks):
    equal to the default blocking's dq."""
    q, pool, widx, sinks, kwargs = query_inputs("hca", b=2, h=64, d=512, w=128, t=300, k=0, dtype=jnp.bfloat16,
                                                s=256, seed=5)
    do = jnp.asarray(np.random.default_rng(7).normal(size=q.shape), jnp.bfloat16)
    args = (q, pool, widx, sinks, kwargs, do)
    want = jax.jit(functools.partial(range_vjp, interpret=False))(*args)
    monkeypatch.setattr(sabw, "dq_of", functools.partial(sabw.dq_of, keys=32, stages=2))
    got = jax.jit(functools.partial(range_vjp, interpret=False))(*args)
    for name, g, w in zip(NAMES, got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-2 * np.abs(w).max(), err_msg=name)


def test_a_programs_equal_kernel_calls_are_one_jitted_function():
    """A model's layers call the range kernels with equal shapes: each call is the same jitted
    function with the same jaxpr, which jax lowers once a program (Mosaic GPU lowered each call on
    its own: ~1 s a kernel, session 56). Traced abstractly on any backend (nothing runs)."""
    rows, h, d, n = 128, 64, 128, 256
    q = jax.ShapeDtypeStruct((rows, h, d), jnp.bfloat16)
    stats = jax.ShapeDtypeStruct((rows, h), jnp.float32)
    source = jax.ShapeDtypeStruct((n, d), jnp.bfloat16)
    ranges = jax.ShapeDtypeStruct((rows, sabw.SCALARS), jnp.int32)

    def two_layers(q, do, lse, delta, src, rng):
        return [sabw.dq_of(q, do, lse, delta, [src], rng) for _ in range(2)]

    eqns = [e for e in jax.make_jaxpr(two_layers)(q, q, stats, stats, source, ranges).eqns
            if e.primitive.name in ("pjit", "jit")]
    assert len(eqns) == 2 and eqns[0].params["jaxpr"] is eqns[1].params["jaxpr"]
