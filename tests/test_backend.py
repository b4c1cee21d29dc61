"""`backend.einsum`: one matmul dtype rule, the same in both namespaces.

The rule (DEVELOPING.md, "Matmul dtype rule"): both operands are rounded to `out_dtype`,
products are accumulated in float32, and the result is rounded once to `out_dtype`. The
host breaks run the NumPy branch on exactly the arrays the XLA branch gets in the `none`
mode, so a layer whose `param_dtype` (float32) is wider than its compute dtype (bf16) gives
the same stage results in every break mode only if the NumPy branch rounds the float32
weights to bf16 as XLA does.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4_jax.backend import einsum

BF16 = np.dtype(ml_dtypes.bfloat16)


def both(subscripts, a, b, out_dtype):
    """(NumPy branch, XLA branch) results as NumPy arrays of their own dtype."""
    host = einsum(subscripts, np.asarray(a), np.asarray(b), out_dtype=out_dtype)
    graph = einsum(subscripts, jnp.asarray(a), jnp.asarray(b), out_dtype=out_dtype, precision="highest")
    assert isinstance(host, np.ndarray)
    return host, np.asarray(graph)


def cancelling_operands(seed=0):
    """float32 a [4, 16] and b [16, 3] with a @ b == 0 once a is rounded to bf16, but not before.

    a = [base + tiny | -base] and b = [c; c]: the two halves cancel exactly when `tiny` is
    rounded away. base is small integers (exact in bf16); tiny = 2**-10 is under half a bf16
    ulp of any |base| >= 1, and survives in float32 as tiny * sum(c) != 0.
    """
    rng = np.random.default_rng(seed)
    base = rng.integers(1, 5, size=(4, 8)) * rng.choice([-1, 1], size=(4, 8))
    c = rng.integers(1, 5, size=(8, 3))  # positive: sum(c) != 0 in every column
    a = np.concatenate([base + 2.0**-10, -base], axis=1).astype(np.float32)
    b = np.concatenate([c, c], axis=0).astype(np.float32)
    assert np.all(a.astype(BF16).astype(np.float32)[:, :8] == base)  # the premise: bf16 drops tiny
    return a, b, c


def test_float32_operands_are_rounded_to_a_bf16_output_dtype():
    # A float32 weight in a bf16 layer: both branches compute with the weight rounded to bf16.
    a, b, _ = cancelling_operands()
    host, graph = both("ik,kj->ij", a, b, jnp.bfloat16)
    assert host.dtype == BF16 and graph.dtype == BF16
    np.testing.assert_array_equal(graph.astype(np.float32), 0.0)
    np.testing.assert_array_equal(host.astype(np.float32), 0.0)


def test_float32_output_keeps_float32_operands():
    # Same operands, float32 output: nothing is rounded, tiny * sum(c) survives in both.
    a, b, c = cancelling_operands()
    host, graph = both("ik,kj->ij", a, b, jnp.float32)
    want = np.broadcast_to(np.float32(2.0**-10) * c.sum(0).astype(np.float32), (4, 3))
    np.testing.assert_array_equal(graph, want)
    np.testing.assert_array_equal(host, want)


@pytest.mark.parametrize(("out_dtype", "want"), [
    (jnp.float32, 1 + 2.0**-6 + 2.0**-14),  # (1 + 2^-7)^2 exactly: bf16 operands widened (HF's .float())
    (jnp.bfloat16, 1 + 2.0**-6),  # one rounding of the float32 accumulation to bf16
])
def test_bf16_operands_accumulate_in_float32_and_round_once(out_dtype, want):
    a = np.full((1, 4), 1 + 2.0**-7, BF16)  # exact in bf16
    b = np.array([[1 + 2.0**-7], [0], [0], [0]], BF16)
    host, graph = both("ik,kj->ij", a, b, out_dtype)
    for got in (host, graph):
        assert got.dtype == np.dtype(out_dtype)
        assert got.astype(np.float64).item() == want


def test_single_token_projections_on_more_rows_give_the_same_values(monkeypatch):
    """A B = S = 1 projection on padded rows (the row, then zeros: `padded_rows_product`, what
    CUDA runs, where a one-row dot becomes a slow reduction) keeps the first row: the same
    values, and the whole decode step of one row equals the plain one. The CPU lowering
    computes the plain one-row product; a program lowered for CUDA has the 8 rows."""
    import jax
    from helpers import random_layer

    import dsv4_jax
    from dsv4_jax import backend
    from dsv4_jax.step.pure_step import attention_step

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 1, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    grouped = jnp.asarray(rng.standard_normal((1, 1, 4, 16)), jnp.float32)
    wg = jnp.asarray(rng.standard_normal((4, 16, 8)), jnp.float32)
    for sub, a, b in (("bsh,hl->bsl", x, w), ("bsgi,gir->bsgr", grouped, wg)):
        plain = einsum(sub, a, b, out_dtype=jnp.float32)
        for rows in (3, backend.GPU_DOT_ROWS):
            padded = backend.padded_rows_product(sub, a, b, rows=rows)
            assert padded.shape == plain.shape
            np.testing.assert_allclose(np.asarray(padded), np.asarray(plain), rtol=1e-6, atol=1e-6)

    cfg = dsv4_jax.DeepseekV4Config.tiny()
    attn = random_layer(cfg, cfg.layer_types.index(dsv4_jax.CSA), break_mode="none", kernels="xla")
    cache = attn.init_cache(1, 32)
    prompt = jnp.asarray(rng.standard_normal((1, 12, cfg.hidden_size)), jnp.float32)
    _, cache = attn(prompt, np.arange(12, dtype=np.int32)[None], cache)
    token = jnp.asarray(rng.standard_normal((1, 1, cfg.hidden_size)), jnp.float32)
    args = (attn.weights(), cache.replace(length=jnp.asarray(cache.length), layer_idx=-1), token,
            jnp.asarray([[12]], jnp.int32))
    step = jax.jit(attention_step, static_argnames="spec")
    want = step(*args, spec=attn.step_spec())
    assert "tensor<8x1x64x" not in step.lower(*args, spec=attn.step_spec()).as_text()  # CPU: one row
    exported = jax.export.export(step, platforms=("cuda",))(*args, spec=attn.step_spec())
    assert "tensor<8x1x64x" in exported.mlir_module()  # CUDA: the padded rows
    # The whole step with every single-token projection padded (as CUDA runs it) equals the plain one.
    real, padded_calls = jax.lax.platform_dependent, []

    def cuda_rows(*a, cuda, default, **kw):  # only the projections' choice: the rest as lowered for the CPU
        padded = getattr(cuda, "func", None) is backend.padded_rows_product
        padded_calls.append(padded)
        return cuda(*a) if padded else real(*a, cuda=cuda, default=default, **kw)

    monkeypatch.setattr(jax.lax, "platform_dependent", cuda_rows)
    jax.clear_caches()  # the lowering choice is made when tracing
    try:
        got = jax.jit(attention_step, static_argnames="spec")(*args, spec=attn.step_spec())
    finally:
        jax.clear_caches()  # no trace made with the patched choice outlives the test
    assert sum(padded_calls) >= 5  # the input, query, indexer and output projections
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
