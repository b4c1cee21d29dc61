"""The Pallas sparse attention kernel against its XLA twin (`sparse_attention`'s XLA path).

On the CPU the kernel runs in Pallas' interpret mode (the same kernel body, executed by XLA);
on CUDA the Triton kernel itself runs (the GPU tests, skipped elsewhere). Decode (one query
per row, key blocks split over programs and merged by `combine`) and prefill (S queries per
row, one program per query and head block, the sink merged in the kernel). Float32 agrees
within 2e-5; bf16 is compared with the float32 result, beside the XLA path's own bf16 error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import KernelPlan
from dsv4_jax.ops.sparse_attention import pallas as sak
from dsv4_jax.ops.sparse_attention import reference as sa

ON_GPU = jax.default_backend() == "gpu"


def query_inputs(kind: str, b: int, h: int, d: int, w: int, t: int, k: int, dtype, seed: int = 0,
                 starts=None, s: int = 1):
    """S queries per row at positions start_b .. start_b + S - 1 (the window partly empty for
    small starts), their keys in the pool [B, W + S, D] as the layer builds it."""
    rng = np.random.default_rng(seed)
    starts = np.asarray(starts if starts is not None else rng.integers(0, 4 * w, b), np.int32)
    q = jnp.asarray(rng.normal(size=(b, s, h, d)), dtype)
    pool = jnp.asarray(rng.normal(size=(b, w + s, d)), dtype)
    sinks = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    positions = starts[:, None] + np.arange(s, dtype=np.int32)[None, :]
    widx = sa.window_indices(jnp.asarray(positions), jnp.asarray(starts), w)
    kwargs = {}
    if kind != "sliding":
        kwargs["entries"] = jnp.asarray(rng.normal(size=(b, t, d)), dtype)
    if kind == "csa":  # distinct picks per query, a random tail of -1 (fewer entries than k)
        picks = np.stack([rng.permutation(t)[:k] for _ in range(b * s)]).astype(np.int32)
        picks[np.arange(k)[None, :] >= rng.integers(1, k + 1, b * s)[:, None]] = -1
        kwargs["picks"] = jnp.asarray(picks.reshape(b, s, k))
    elif kind == "hca":
        kwargs["visible"] = jnp.asarray(rng.integers(0, t + 1, (b, s)), jnp.int32)
    return q, pool, widx, sinks, kwargs


def decode_inputs(*args, **kwargs):
    return query_inputs(*args, **kwargs, s=1)


XLA = KernelPlan.named("xla")
INTERPRET = KernelPlan.named("interpret")


def _xla_path(q, pool, widx, sinks, kwargs):
    # HIGHEST, as the layer passes for float32 (a GPU would otherwise use TF32 for the dots).
    return sa.sparse_attention(q, pool, widx, sinks, **kwargs, precision=jax.lax.Precision.HIGHEST, kernels=XLA).o


def _jit_if_float32(fn, q):
    """float32 calls run jitted, as the layer's step runs them: one program a call shape (run
    eagerly, every operation compiles on its own, for each shape). bf16 calls run eagerly, every
    operation rounding its result: the XLA path's own bf16 error, the yardstick of the bf16 tests."""
    return jax.jit(fn) if q.dtype == jnp.float32 else fn


def _xla(q, pool, widx, sinks, kwargs):
    return np.asarray(_jit_if_float32(_xla_path, q)(q, pool, widx, sinks, kwargs), np.float32)


def kernel_path(q, pool, widx, sinks, kwargs, **blocks):
    # Triton on CUDA where it takes the shapes (dots of >= 16 in every dimension), else interpret mode.
    triton_ok = sak.supports(q, **blocks)
    interpret = not (ON_GPU and triton_ok)

    def kernel(q, pool, widx, sinks, kwargs):
        return sak.sparse_attention_kernel(q, pool, widx, sinks, interpret=interpret, **kwargs, **blocks)

    return np.asarray(_jit_if_float32(kernel, q)(q, pool, widx, sinks, kwargs), np.float32)


BLOCKS = [dict(block_keys=4, block_heads=2, splits=1),
          dict(block_keys=4, block_heads=4, splits=3),
          dict(block_keys=8, block_heads=4, splits=5),
          dict(block_keys=8, block_heads=2),
          dict(block_keys=4, block_heads=2, skip_masked_blocks=True),
          dict(block_keys=4, block_heads=4, splits=3, skip_masked_blocks=True)]
KINDS = ["sliding", "csa", "hca"]
# A covering set of (kind, blocks, phase), not the full product (every case compiles and runs an
# interpret-mode kernel): every kind with every block choice, each block choice and each kind in
# both phases (the phase alternates with the sum of the two indices).
FLOAT32_CASES = [pytest.param(kind, blocks, 5 if (i + j) % 2 else 1,
                              id=f"{'prefill' if (i + j) % 2 else 'decode'}-blocks{i}-{kind}")
                 for i, blocks in enumerate(BLOCKS) for j, kind in enumerate(KINDS)]


@pytest.mark.parametrize("kind, blocks, s", FLOAT32_CASES)
def test_kernel_equals_the_xla_path_in_float32(kind, blocks, s):
    # splits=5 with 3 window blocks and 3-4 entry blocks: some programs see no key at all;
    # splits=1: the kernel merges the sink itself; prefill: the first queries of the row at
    # position 0 see only part of their window.
    q, pool, widx, sinks, kwargs = query_inputs(kind, b=3, h=4, d=8, w=12, t=13, k=6, dtype=jnp.float32,
                                                starts=[0, 5, 40], s=s)
    got = kernel_path(q, pool, widx, sinks, kwargs, **blocks)
    want = _xla(q, pool, widx, sinks, kwargs)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_a_row_with_no_key_outputs_zero_as_the_xla_path():
    # A ragged call's padded row (position -1) sees no key: the sink takes all the mass.
    q, pool, _, sinks, kwargs = decode_inputs("csa", b=2, h=4, d=8, w=4, t=6, k=3, dtype=jnp.float32)
    widx = sa.window_indices(jnp.asarray([[-1], [7]]), jnp.asarray([0, 7]), 4)
    kwargs["picks"] = kwargs["picks"].at[0].set(-1)
    got = kernel_path(q, pool, widx, sinks, kwargs, block_keys=4, block_heads=4)
    np.testing.assert_array_equal(got[0], 0.0)
    np.testing.assert_allclose(got, _xla(q, pool, widx, sinks, kwargs), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_bf16_kernel_is_as_close_to_float32_as_the_xla_path(kind):
    q, pool, widx, sinks, kwargs = decode_inputs(kind, b=2, h=4, d=16, w=8, t=24, k=8, dtype=jnp.bfloat16)
    as32 = {n: (v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v) for n, v in kwargs.items()}
    exact = _xla(q.astype(jnp.float32), pool.astype(jnp.float32), widx, sinks, as32)
    scale = np.abs(exact).max()
    kernel_err = np.abs(kernel_path(q, pool, widx, sinks, kwargs, block_keys=8, block_heads=4) - exact).max()
    xla_err = np.abs(_xla(q, pool, widx, sinks, kwargs) - exact).max()
    # bf16 rounds at 2^-8 relative; both paths round the logits, the probabilities and the output.
    assert kernel_err <= max(2 * xla_err, 2 ** -7 * scale), (kernel_err, xla_err, scale)


def test_the_cuda_default_table():
    # Where the kernel measured faster than the XLA path on the H200 (see CUDA_DEFAULT_BLOCKS).
    assert sak.default_blocks("csa", 1) == {"block_keys": 16, "block_heads": 32, "num_warps": 8, "num_stages": 1}
    assert sak.default_blocks("hca", 1) == {"block_keys": 32, "block_heads": 16, "num_warps": 8, "num_stages": 1}
    assert sak.default_blocks("hca", 8) is None
    # CSA decode of a batch: the kernel from MIN_ROWS rows (measured level at 8, faster at 32)
    rows = sak.MIN_ROWS[("csa", "decode", None)]
    assert sak.default_blocks("csa", rows - 1) is None
    assert sak.default_blocks("csa", 32) == {"block_keys": 64, "block_heads": 64, "num_warps": 8, "num_stages": 2}
    assert sak.default_blocks("csa", 32, dtype=jnp.float32) is None  # its shared memory: bf16 only
    # HCA decode of a batch: the kernel over caches of at least MIN_ENTRIES entries (128k tokens)
    long = sak.MIN_ENTRIES[("hca", "decode", None)]
    assert sak.default_blocks("hca", 8, entries=long - 1) is None
    assert sak.default_blocks("hca", 8, entries=long) == {"block_keys": 64, "block_heads": 64, "num_warps": 8,
                                                          "num_stages": 2, "skip_masked_blocks": True}
    assert sak.default_blocks("hca", 1, entries=long)["block_heads"] == 16  # one row: its own entry
    assert sak.default_blocks("hca", 8, dtype=jnp.float32, entries=long) is None  # its shared memory: bf16 only
    assert sak.default_blocks("csa", 8, entries=long) is None
    assert sak.default_blocks("sliding", 1) is None
    assert sak.default_blocks("csa", 1, "prefill", 4096) == {"block_keys": 64, "block_heads": 64, "num_warps": 8,
                                                            "num_stages": 3, "skip_masked_blocks": True}
    assert sak.default_blocks("hca", 1, "prefill", 4096) == {"block_keys": 64, "block_heads": 64, "num_warps": 8,
                                                            "num_stages": 3, "skip_masked_blocks": True}
    assert sak.default_blocks("csa", 2, "prefill", 8) is None  # short prompts: not measured, XLA
    assert sak.default_blocks("csa", 1, "prefill", 4096, jnp.float32) is None  # its shared memory: bf16 only
    assert sak.forced_blocks("prefill", jnp.float32)["block_keys"] == 32
    assert sak.default_blocks("sliding", 1, "prefill", 4096) is None
    for (kind, phase, batch), chosen in sak.CUDA_DEFAULT_BLOCKS.items():
        entries = sak.MIN_ENTRIES.get((kind, phase, batch), 0)
        assert sak.default_blocks(kind, batch or 3, phase, 4096, entries=entries)["block_keys"] == chosen[0]


def test_blocks_are_fitted_to_a_window_of_one_key_block():
    """A window that one key block holds (V4's 128 keys take two of 64) gets half the keys a block:
    Triton buffers its block beside the pipelined entry blocks, past the H200's shared memory at
    64 heads of 512 (tests/bench/test_h200_compile.py compiles it). 32-key blocks are kept."""
    prefill = sak.default_blocks("csa", 1, "prefill", 4096)
    assert sak.fit_to_window(prefill, 128) == prefill
    assert sak.fit_to_window(prefill, 64) == {**prefill, "block_keys": 32}
    assert sak.fit_to_window(prefill, 32) == {**prefill, "block_keys": 32}
    assert sak.fit_to_window(sak.default_blocks("hca", 1), 16) == sak.default_blocks("hca", 1)  # 32 keys already
    assert sak.fit_to_window(sak.default_blocks("csa", 1), 8) == sak.default_blocks("csa", 1)  # 16 keys


@pytest.mark.parametrize("kind, phase, batch", list(sak.CUDA_DEFAULT_BLOCKS))
def test_the_default_blocks_equal_the_xla_path(kind, phase, batch, monkeypatch):
    """Each CUDA default: `sparse_attention` hands its blocks to the kernel for a bf16 call, and
    the kernel with those blocks equals the XLA path in float32 (interpret mode, which has no
    shared-memory limit), at a realistic window (128) and head count (32)."""
    b = batch or max(2, sak.MIN_ROWS.get((kind, phase, batch), 0))
    s = 1 if phase == "decode" else sak.PREFILL_MIN_ROWS // 2
    t = max(300, sak.MIN_ENTRIES.get((kind, phase, batch), 0))  # entries: as many as the entry needs
    q, pool, widx, sinks, kwargs = query_inputs(kind, b=b, h=32, d=32, w=128, t=t, k=64, dtype=jnp.float32,
                                                starts=[1000] * b, s=s)
    blocks = sak.default_blocks(kind, b, phase, s, jnp.bfloat16, entries=t)
    calls = []
    real = sak.sparse_attention_kernel
    monkeypatch.setattr(sak, "sparse_attention_kernel", lambda *a, **k: calls.append(k) or real(*a, **k))
    kw16 = {n: (v.astype(jnp.bfloat16) if n == "entries" else v) for n, v in kwargs.items()}
    # Traced only: the blocks are chosen, and the kernel called with them, while tracing.
    jax.eval_shape(lambda: sa.sparse_attention(q.astype(jnp.bfloat16), pool.astype(jnp.bfloat16), widx, sinks,
                                               **kw16, kernels=INTERPRET))
    assert {n: calls[-1][n] for n in blocks} == blocks
    kernel = jax.jit(lambda *args: real(*args[:4], **args[4], **blocks, interpret=True))
    got = np.asarray(kernel(q, pool, widx, sinks, kwargs), np.float32)
    np.testing.assert_allclose(got, _xla(q, pool, widx, sinks, kwargs), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("s", [1, 4, 9], ids=["decode", "drafts", "prefill"])
def test_sparse_attention_chooses_the_kernel_only_where_asked(s, monkeypatch):
    """The path is chosen while tracing (the calls are traced only, `jax.eval_shape`); what the
    kernel computes: the tests above. Calls of up to 8 queries a row (a speculative step's
    drafts) are decode steps."""
    q, pool, widx, sinks, kwargs = query_inputs("csa", b=1, h=4, d=8, w=4, t=6, k=3, dtype=jnp.float32, s=s)
    decode = s <= sak.DECODE_MAX_QUERIES
    stage, other = ("decode_attention", "prefill_attention") if decode else ("prefill_attention", "decode_attention")
    calls = []
    real = sak.sparse_attention_kernel
    monkeypatch.setattr(sak, "sparse_attention_kernel", lambda *a, **k: calls.append(k) or real(*a, **k))

    def trace(**options):
        jax.eval_shape(lambda: sa.sparse_attention(q, pool, widx, sinks, **kwargs, **options))

    trace(kernels=KernelPlan(**{other: "interpret"}))
    assert not calls  # the other phase's choice does not reach this call
    asked = KernelPlan(**{stage: "interpret"})
    trace(kernels=asked)
    assert calls and calls[-1]["interpret"] is True
    calls.clear()
    trace(with_mass=True, kernels=asked)  # masses: the XLA path
    assert not calls
    trace()  # the default: shapes Triton cannot take stay on XLA
    assert not calls


def test_forced_prefill_blocks_may_skip_masked_entry_blocks(monkeypatch):
    """A plan's forced blocks (`bench/stack.py --prefill-blocks BK,BH,WARPS,STAGES,1`): the forced
    kernel skips each row's entry blocks past its last pick, with the XLA path's result."""
    q, pool, widx, sinks, kwargs = query_inputs("csa", b=2, h=4, d=8, w=8, t=40, k=16, dtype=jnp.float32, s=9)
    plan = KernelPlan(prefill_attention="interpret", prefill_blocks=(4, 2, 4, 1, 1))
    calls = []
    real = sak.sparse_attention_kernel
    monkeypatch.setattr(sak, "sparse_attention_kernel", lambda *a, **k: calls.append(k) or real(*a, **k))
    forced = jax.jit(lambda *args: sa.sparse_attention(*args[:4], **args[4], kernels=plan).o)
    got = np.asarray(forced(q, pool, widx, sinks, kwargs), np.float32)
    assert calls[-1]["skip_masked_blocks"] is True
    np.testing.assert_allclose(got, _xla(q, pool, widx, sinks, kwargs), atol=2e-5, rtol=2e-5)


def _paged(entries, page_entries: int, seed: int = 0):
    """`entries` [B, T, D] as `PagedRows`: each row's pages scattered over a pool with 2 spare pages."""
    from dsv4_jax.cache.paged import PagedRows

    b, t, d = entries.shape
    per_row = -(-t // page_entries)
    table = np.random.default_rng(seed).permutation(b * per_row + 2)[:b * per_row].reshape(b, per_row)
    padded = np.zeros((b, per_row * page_entries, d), np.float32)
    padded[:, :t] = np.asarray(entries, np.float32)
    pool = np.zeros((b * per_row + 2, page_entries, d), np.float32)
    pool[table.reshape(-1)] = padded.reshape(b * per_row, page_entries, d)
    return PagedRows(pool=jnp.asarray(pool, entries.dtype), table=jnp.asarray(table, jnp.int32), slots=t)


@pytest.mark.parametrize("kind, s", [("csa", 1), ("hca", 1), ("csa", 3), ("hca", 9)])
def test_paged_entries_give_the_contiguous_entries_results_and_gradients(kind, s):
    """Entries in scattered pages (`PagedRows`): the kernel reads the pool in place, the XLA path
    gathers; both give what they give on the contiguous entries, bit for bit, and the gradient
    (the backward kernel on the gathered entries) is the contiguous one's, at the pages' rows."""
    q, pool, widx, sinks, kwargs = query_inputs(kind, b=3, h=4, d=8, w=12, t=13, k=6, dtype=jnp.float32,
                                                starts=[0, 5, 40], s=s)
    paged = _paged(kwargs["entries"], page_entries=4)
    plan = KernelPlan(decode_attention="interpret", prefill_attention="interpret", decode_blocks=(4, 2, 4, 1),
                      prefill_blocks=(4, 2, 4, 1, 1))

    def run(rows, as_entries, kernels):  # (o, (dq, d rows)); rows: the entries' array or the pool
        def loss(q, rows):
            o = sa.sparse_attention(q, pool, widx, sinks, **{**kwargs, "entries": as_entries(rows)}, kernels=kernels,
                                    precision=jax.lax.Precision.HIGHEST).o
            return jnp.sum(o * o), o

        (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(q, rows)
        return o, grads

    for kernels in (plan, XLA):
        want, (dq_want, dents_want) = run(kwargs["entries"], lambda rows: rows, kernels)
        got, (dq_got, dpool) = run(paged.pool, lambda rows: paged.replace(pool=rows), kernels)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(dq_got, dq_want)
        # The pool's gradient: each slot's at its page's row, zero on the spare pages.
        at = paged.physical(jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (3, 13)))
        flat = dpool.reshape(-1, 8)
        np.testing.assert_allclose(flat[at], dents_want, atol=1e-6, rtol=1e-6)
        assert float(jnp.abs(flat).sum()) == pytest.approx(float(jnp.abs(dents_want).sum()), rel=1e-6)


@pytest.mark.skipif(ON_GPU, reason="a CPU machine's export")
def test_a_cpu_machine_exports_the_decode_step_for_cuda_with_the_xla_path():
    # Shapes the kernel takes, in its CUDA default case (one-row HCA decode): Pallas lowers a
    # Triton kernel only on a GPU machine, so the export keeps the XLA path for every platform.
    q, pool, widx, sinks, kwargs = decode_inputs("hca", b=1, h=16, d=32, w=32, t=40, k=3, dtype=jnp.float32)
    assert sak.supports(q, **sak.default_blocks("hca", 1))
    fn = jax.jit(lambda *a: sa.sparse_attention(*a, **kwargs, precision=jax.lax.Precision.HIGHEST).o)
    exported = jax.export.export(fn, platforms=("cpu", "cuda"))(q, pool, widx, sinks)
    assert "xla.gpu.triton" not in exported.mlir_module()  # no Triton custom call
    np.testing.assert_allclose(np.asarray(exported.call(q, pool, widx, sinks), np.float32),
                               _xla(q, pool, widx, sinks, kwargs), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_golden_calls_through_the_kernel(small, layer, monkeypatch):
    """Every golden call of the reference, prefill chunks and decode steps through the kernel
    (in interpret mode: the golden configs' 4-8 heads are below Triton's 16), without
    intermediates (which keep the XLA path). One recording (small_seed0: both prefill chunks and
    decode steps, every layer type); the kernel against the XLA path on other shapes: above."""
    from helpers import golden_layer, rel_err

    golden = small
    traced = []
    real = sak.sparse_attention_kernel
    monkeypatch.setattr(sak, "sparse_attention_kernel", lambda *a, **k: traced.append(1) or real(*a, **k))
    attn = golden_layer(golden, layer, break_mode="none", kernels="interpret")
    cache = attn.init_cache(golden.batch, sum(golden.schedule) + 3)
    decodes = 0
    for c in range(len(golden.schedule)):
        call = golden.call(layer, c)
        out, cache = attn(jnp.asarray(call["hidden"]), call["positions"], cache)
        err = rel_err(out, call["out"])
        assert err < 2e-5, f"{golden.name} layer {layer} call {c}: rel err {err:.2e}"
        decodes += call["hidden"].shape[1] == 1
    assert decodes > 0 and traced  # decode calls ran, and their steps were traced with the kernel


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_several_tokens_a_row_run_the_decode_kernel(layer, monkeypatch):
    """A speculative step (4 drafts a row, ragged: 4, 2 and 3 real) is a decode step for the
    kernel: its blocks (the plan's decode blocks) with the key blocks split over programs and
    merged by the split merge kernel, every query a row of its own; the layer's outputs equal
    those of the XLA path (float32, interpret mode)."""
    from flax import nnx

    import dsv4_jax

    cfg = dsv4_jax.DeepseekV4Config.tiny()
    plan = KernelPlan(decode_attention="interpret", split_merge="interpret", decode_blocks=(4, 2, 4, 1))
    calls = []
    real = sak.sparse_attention_kernel
    monkeypatch.setattr(sak, "sparse_attention_kernel", lambda *a, **k: calls.append((a[0].shape, k)) or real(*a, **k))
    rng = np.random.default_rng(layer)
    hidden = rng.normal(size=(3, 17, cfg.hidden_size)).astype(np.float32)
    drafts = np.array([4, 2, 3])
    positions = np.where(np.arange(4) < drafts[:, None], 13 + np.arange(4), -1).astype(np.int32)

    def run(kernels):
        attn = dsv4_jax.DeepseekV4Attention(cfg, layer, rngs=nnx.Rngs(layer), break_mode="none", kernels=kernels)
        _, cache = attn(jnp.asarray(hidden[:, :13]), None, attn.init_cache(3, 32))
        out, _ = attn(jnp.asarray(hidden[:, 13:]), positions, cache)
        return np.asarray(out)

    want = run("xla")
    got = run(plan)
    assert [shape[1] for shape, _ in calls] == [4]  # the prefill chunk kept the XLA path, the drafts did not
    assert calls[0][1]["block_keys"] == 4 and calls[0][1]["merge"] == "interpret"
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=2e-5)


FLASH_CASES = [  # (phase, B, S, blocks): a forced kernel's blocks, each CUDA default's, and
    # the forced prefill blocks skipping the masked entry blocks
    ("decode", 1, 1, "forced"), ("decode", 32, 1, "forced"), ("decode", 1, 1, "cuda_default"),
    ("decode", 8, 1, "cuda_default"), ("decode", 32, 1, "cuda_default"),
    ("decode", 1, 4, "cuda_default"), ("decode", 8, 4, "cuda_default"),  # a speculative step's 4 drafts
    ("prefill", 2, 128, "forced"), ("prefill", 2, 128, "cuda_default"), ("prefill", 2, 128, "skip"),
]


@pytest.mark.skipif(not ON_GPU, reason="the Triton kernel needs CUDA")
@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
@pytest.mark.parametrize("phase, b, s, which", FLASH_CASES)
def test_triton_kernel_at_flash_sizes(kind, phase, b, s, which):
    """V4-Flash shapes: 64 heads of 512, window 128, top-512 of 4k entries (CSA), 129 (HCA; a
    decode batch 2048, where its CUDA default starts); the blocks of a forced kernel, and the
    CUDA default's where it has some."""
    t = 4096 if kind == "csa" else 2048 if (phase, b) == ("decode", 8) else 129

    def blocks_for(dtype):
        if which in ("forced", "skip"):
            return {**sak.forced_blocks(phase, dtype), **({"skip_masked_blocks": True} if which == "skip" else {})}
        return sak.default_blocks(kind, b, phase, s, dtype, entries=t) or sak.forced_blocks(phase, dtype)

    if which == "cuda_default" and sak.default_blocks(kind, b, phase, s, entries=t) is None:
        pytest.skip("the XLA path is the CUDA default here")
    if which == "forced" and sak.default_blocks(kind, b, phase, s, entries=t) == blocks_for(jnp.bfloat16):
        pytest.skip("the same blocks as the CUDA default")
    q, pool, widx, sinks, kwargs = query_inputs(kind, b=b, h=64, d=512, w=128, t=t, k=512, dtype=jnp.float32, s=s)
    # float32 with the blocks float32 runs with (a prefill's bf16 blocks exceed shared memory in float32)
    np.testing.assert_allclose(kernel_path(q, pool, widx, sinks, kwargs, **blocks_for(jnp.float32)),
                               _xla(q, pool, widx, sinks, kwargs), atol=2e-5, rtol=2e-5)
    blocks = blocks_for(jnp.bfloat16)
    q16, pool16 = q.astype(jnp.bfloat16), pool.astype(jnp.bfloat16)
    kw16 = {n: (v.astype(jnp.bfloat16) if n == "entries" else v) for n, v in kwargs.items()}
    exact = _xla(q16.astype(jnp.float32), pool16.astype(jnp.float32), widx, sinks,
                 {n: (v.astype(jnp.float32) if n == "entries" else v) for n, v in kw16.items()})
    kernel_err = np.abs(kernel_path(q16, pool16, widx, sinks, kw16, **blocks) - exact).max()
    xla_err = np.abs(_xla(q16, pool16, widx, sinks, kw16) - exact).max()
    print(f"bf16 {kind} {phase} B={b} S={s} {which} {blocks}: kernel {kernel_err:.2e}, XLA path {xla_err:.2e} "
          f"(max |o| {np.abs(exact).max():.2f})")
    assert kernel_err <= max(2 * xla_err, 2 ** -7 * np.abs(exact).max())


@pytest.mark.skipif(not ON_GPU, reason="the Triton kernel needs CUDA")
@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_the_layer_with_the_kernel_equals_the_layer_without(layer):
    """The whole layer on CUDA in float32, a prefill of 300 tokens in two chunks and decode
    steps, with the kernel for every call (prefill and decode) against the XLA path: 16 heads
    of 64 (shapes the Triton kernel takes), the queries' in-place rope update feeding it."""
    from flax import nnx

    import dsv4_jax

    cfg = dsv4_jax.DeepseekV4Config.tiny(num_attention_heads=16, head_dim=64, qk_rope_head_dim=16, o_groups=4,
                                          sliding_window=32, index_topk=16)
    rng = np.random.default_rng(layer)
    hidden = jnp.asarray(rng.normal(size=(2, 304, cfg.hidden_size)), jnp.float32)

    def run(kernels):
        attn = dsv4_jax.DeepseekV4Attention(cfg, layer, rngs=nnx.Rngs(layer), dtype=jnp.float32, kernels=kernels)
        cache, outs, start = attn.init_cache(2, 320), [], 0
        for n in (200, 100, 1, 1, 1, 1):
            positions = jnp.broadcast_to(jnp.arange(start, start + n, dtype=jnp.int32), (2, n))
            out, cache = attn(hidden[:, start:start + n], positions, cache)
            outs.append(np.asarray(out, np.float32))
            start += n
        return np.concatenate(outs, axis=1)

    want = run("xla")
    got = run(KernelPlan(decode_attention="pallas", prefill_attention="pallas"))
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=2e-5)
