"""`indexer_kl_loss`: the indexer's training signal (KL(main attention || indexer) over entries).

Checks: the gradient reaches every indexer parameter and nothing else (through
`attention_step`, and through the module under `nnx.grad`); the loss and its gradient vanish
when the two distributions match; KL >= 0; and the value equals an independent NumPy
computation that runs the main attention explicitly (window keys, sink, entries), both on a
small hand-built example and on a real layer's call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import random_layer

import dsv4_jax
from dsv4_jax.tools.indexer_loss import OVER, indexer_kl_loss, indexer_kl_target

TINY = dsv4_jax.DeepseekV4Config.tiny()  # window 8, CSA ratio 4, top-4, 4 heads of 32
CSA_LAYER = 1
BATCH, N, MAX_LEN = 2, 40, 64  # 40 tokens -> 10 entries (> top-4)
INDEXER_PARAMS = ("q_b_proj", "weights_proj", "compressor.kv_proj", "compressor.gate_proj",
                  "compressor.position_bias", "compressor.kv_norm")
SHARED_QUERY_PARAMS = ("q_a_proj", "q_a_norm")  # q_residual feeds the attention and the indexer


# ---------------------------------------------------------------------------- NumPy reference
def reference_kl(queries, window_keys, window_ok, sinks, entries, topk, visible, scores, over):
    """KL per query [B, S] by the definition, in float64, with the main attention run explicitly.

    window_keys [B, S, W, D] with window_ok [B, S, W]; the main softmax is over
    [sink | window keys | attended entries]: the picks (over="topk") or every visible entry
    (over="visible", the dense attention). Also returns the sparse run's masses (sink, window,
    compressed) [B, S, H], what the layer reports.
    """
    q, wk, e = (np.asarray(a, np.float64) for a in (queries, window_keys, entries))
    b_, s_, h_, d = q.shape
    kl = np.zeros((b_, s_))
    masses = np.zeros((3, b_, s_, h_))
    for b in range(b_):
        for t in range(s_):
            picks = [int(k) for k in topk[b, t] if k >= 0]
            v = int(visible[b, t])
            for h in range(h_):  # the sparse attention's masses
                lw = [q[b, t, h] @ wk[b, t, j] / np.sqrt(d) for j in range(wk.shape[2]) if window_ok[b, t, j]]
                lp = [q[b, t, h] @ e[b, k] / np.sqrt(d) for k in picks]
                z = np.exp(sinks[h]) + np.sum(np.exp(lw)) + np.sum(np.exp(lp))
                masses[:, b, t, h] = np.exp(sinks[h]) / z, np.sum(np.exp(lw)) / z, np.sum(np.exp(lp)) / z
            support = picks if over == "topk" else list(range(v))
            if not support:
                continue
            p = np.zeros(len(support))
            for h in range(h_):
                lw = [q[b, t, h] @ wk[b, t, j] / np.sqrt(d) for j in range(wk.shape[2]) if window_ok[b, t, j]]
                le = np.array([q[b, t, h] @ e[b, k] / np.sqrt(d) for k in support])
                z = np.exp(sinks[h]) + np.sum(np.exp(lw)) + np.sum(np.exp(le))
                p += np.exp(le) / z
            p /= p.sum()
            i = np.asarray(scores, np.float64)[b, t, support]
            qd = np.exp(i - i.max()) / np.exp(i - i.max()).sum()
            kl[b, t] = np.sum(p * np.log(p / qd))
    return kl, masses


def _synthetic(seed: int, over_picks=None):
    """A small hand-built call: B=1, S=4 queries, H=2 heads, D=4, W=2, T=5 entries, K=2.

    Query 0 sees no entry (excluded from the mean); query 1 has one pick of 2 visible entries
    (-1 padding); the others two picks. Returns (Intermediates, the reference's inputs).
    """
    rng = np.random.default_rng(seed)
    b, s, h, d, w, t = 1, 4, 2, 4, 2, 5
    queries = rng.standard_normal((b, s, h, d)) * 2
    window_keys = rng.standard_normal((b, s, w, d))
    window_ok = np.ones((b, s, w), bool)
    window_ok[0, 0, 0] = False  # the first query has one window key
    sinks = rng.standard_normal(h)
    entries = rng.standard_normal((b, t, d))
    visible = np.array([[0, 2, 4, 5]])
    topk = np.array([[[-1, -1], [1, -1], [3, 0], [2, 4]]]) if over_picks is None else over_picks
    scores = rng.standard_normal((b, s, t)) * 3
    scores = np.where(np.arange(t) < visible[..., None], scores, -np.inf)
    args = (queries, window_keys, window_ok, sinks, entries, topk, visible, scores)
    _, masses = reference_kl(*args, over="topk")
    inter = dsv4_jax.Intermediates(
        queries=jnp.asarray(queries, jnp.float32), keys=jnp.zeros((b, s, d)),
        sink_mass=jnp.asarray(masses[0], jnp.float32), window_mass=jnp.asarray(masses[1], jnp.float32),
        compressed_mass=jnp.asarray(masses[2], jnp.float32), index_scores=jnp.asarray(scores, jnp.float32),
        topk=jnp.asarray(topk, jnp.int32), compressed_kv=jnp.asarray(entries, jnp.float32),
        num_entries=jnp.asarray([t], jnp.int32), visible_entries=jnp.asarray(visible, jnp.int32),
    )
    return inter, args


@pytest.mark.parametrize("over", OVER)
def test_matches_numpy_on_a_hand_built_example(over):
    inter, args = _synthetic(0)
    expected, _ = reference_kl(*args, over=over)
    per_query = np.asarray(indexer_kl_loss(inter, over, reduction="none"))
    np.testing.assert_allclose(per_query, expected, rtol=2e-5, atol=1e-6)
    assert per_query[0, 0] == 0.0 and expected[0, 2:].min() > 1e-3  # query 0 sees nothing
    if over == "topk":  # query 1 has a single pick: both distributions are that pick
        assert per_query[0, 1] == 0.0
    mean = float(indexer_kl_loss(inter, over))
    np.testing.assert_allclose(mean, expected[0, 1:].mean(), rtol=2e-5)  # averaged over queries 1..3


def test_topk_and_visible_agree_when_every_visible_entry_is_picked():
    picks = np.array([[[-1, -1], [1, 0], [-1, -1], [-1, -1]]])  # query 1 picks both its visible entries
    inter, _ = _synthetic(1, over_picks=picks)
    inter = inter.replace(visible_entries=jnp.asarray([[0, 2, 0, 0]], jnp.int32))
    a = indexer_kl_loss(inter, "topk", reduction="none")
    b = indexer_kl_loss(inter, "visible", reduction="none")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("over", OVER)
def test_zero_loss_and_zero_gradient_when_the_distributions_match(over):
    inter, _ = _synthetic(2)
    log_p, valid = indexer_kl_target(inter, over)
    # An indexer whose softmax over the set is exactly the target (plus a constant per query).
    if over == "topk":
        scores = np.full(inter.index_scores.shape, -1e3, np.float32)
        picks = np.asarray(inter.topk)
        for b, t, k in zip(*np.nonzero(picks >= 0)):
            scores[b, t, picks[b, t, k]] = float(log_p[b, t, k]) + 7.0
    else:
        scores = np.where(np.isfinite(log_p), np.asarray(log_p) - 2.0, -np.inf).astype(np.float32)
    inter = inter.replace(index_scores=jnp.asarray(scores))
    loss, grad = jax.value_and_grad(lambda s: indexer_kl_loss(inter.replace(index_scores=s), over))(
        inter.index_scores)
    assert abs(float(loss)) < 1e-6
    np.testing.assert_allclose(np.asarray(grad), 0.0, atol=1e-6)
    assert np.asarray(valid).sum() == 3


@pytest.mark.parametrize("over", OVER)
def test_kl_is_nonnegative(over):
    for seed in range(20):
        inter, _ = _synthetic(seed)
        per_query = np.asarray(indexer_kl_loss(inter, over, reduction="none"))
        assert np.all(np.isfinite(per_query)) and per_query.min() >= -1e-6, (seed, per_query)
        assert float(indexer_kl_loss(inter, over)) >= 0.0


def test_refuses_layers_without_an_indexer_and_bad_arguments():
    inter, _ = _synthetic(0)
    with pytest.raises(ValueError, match="compressed_sparse_attention"):
        indexer_kl_loss(inter.replace(index_scores=None, topk=None))
    with pytest.raises(ValueError, match="over"):
        indexer_kl_loss(inter, over="all")
    with pytest.raises(ValueError, match="reduction"):
        indexer_kl_loss(inter, reduction="sum")


# ---------------------------------------------------------------------------- through the layer
@functools.partial(jax.jit, static_argnames="spec")
def _losses_and_grads(weights, cache, x, positions, spec):
    def loss(w, over):
        _, _, inter = dsv4_jax.attention_step(w, cache, x, positions, spec)
        return indexer_kl_loss(inter, over), inter

    # over -> (loss, gradient w.r.t. the weights, the call's intermediates)
    results = {over: jax.value_and_grad(loss, has_aux=True)(weights, over) for over in OVER}
    return {over: (value, grads, inter) for over, ((value, inter), grads) in results.items()}


def _flat(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def layer_run():
    attn = random_layer(TINY, CSA_LAYER, seed=3, break_mode="none", kernels="xla")
    x = np.random.default_rng(0).standard_normal((BATCH, N, TINY.hidden_size)).astype(np.float32)
    positions = np.broadcast_to(np.arange(N, dtype=np.int32), (BATCH, N))
    cache = attn.init_cache(BATCH, MAX_LEN)
    spec = attn.step_spec(return_intermediates=True)
    return attn, x, positions, cache, spec


@pytest.fixture(scope="module")
def layer_grads(layer_run):
    attn, x, positions, cache, spec = layer_run
    return _losses_and_grads(attn.weights(), cache, x, positions, spec=spec)


@pytest.mark.parametrize("over", OVER)
def test_gradient_reaches_every_indexer_parameter(layer_grads, over):
    loss, grads, _ = layer_grads[over]
    assert np.isfinite(float(loss)) and float(loss) > 0
    indexer = _flat(grads.indexer)
    assert sorted(indexer) == sorted(INDEXER_PARAMS)
    for name, g in indexer.items():
        assert np.all(np.isfinite(g)), name
        assert np.abs(g).max() > 0, f"indexer.{name}: no gradient from the indexer loss"


@pytest.mark.parametrize("over", OVER)
def test_no_gradient_into_the_main_attention(layer_grads, over):
    """The target is under stop_gradient: the attention's own parameters get nothing."""
    _, grads, _ = layer_grads[over]
    main = {k: v for k, v in _flat(grads.replace(indexer=None)).items() if k not in SHARED_QUERY_PARAMS}
    assert {"q_b_proj", "kv_proj", "o_a_proj", "sinks", "compressor.kv_proj", "compressor.position_bias"} <= set(main)
    for name, g in main.items():
        assert np.all(g == 0), f"{name}: the indexer loss leaks a gradient into the main attention"


@pytest.mark.parametrize("over", OVER)
def test_no_gradient_into_the_shared_query_projection(layer_grads, over):
    """q_a_proj/q_a_norm feed the indexer's queries too (through q_residual); DeepSeek-V3.2
    detaches the indexer's input, so its loss trains the indexer only.

    Needs `lax.stop_gradient` on q_residual where `step.run_stages` computes the
    indexer queries (the proposed diff); fails until then.
    """
    _, grads, _ = layer_grads[over]
    flat = _flat(grads)
    for name in SHARED_QUERY_PARAMS:
        assert np.all(flat[name] == 0), f"{name}: the indexer loss trains the shared query projection"


def test_layer_loss_matches_numpy(layer_run, layer_grads):
    """On a real prefill (from position 0, so every window key is this call's): the loss from
    the intermediates equals the explicit recomputation, and the layer's masses are the
    reference's."""
    attn = layer_run[0]
    inter = layer_grads["topk"][2]
    w = TINY.sliding_window
    keys = np.asarray(inter.keys, np.float64)  # [B, N, D]
    src = np.arange(N)[:, None] - (w - 1) + np.arange(w)[None, :]  # [N, W]
    window_keys = keys[:, np.maximum(src, 0)]
    window_ok = np.broadcast_to(src >= 0, (BATCH, N, w))
    sinks = np.asarray(attn.weights().sinks, np.float64)
    for over in OVER:
        args = (inter.queries, window_keys, window_ok, sinks, inter.compressed_kv, np.asarray(inter.topk),
                np.asarray(inter.visible_entries), np.asarray(inter.index_scores))
        expected, masses = reference_kl(*args, over=over)
        got = np.asarray(indexer_kl_loss(inter, over, reduction="none"))
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
        counted = np.asarray(inter.visible_entries) > 0
        np.testing.assert_allclose(float(layer_grads[over][0]), expected[counted].mean(), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(inter.compressed_mass), masses[2], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(inter.window_mass), masses[1], rtol=1e-4, atol=1e-6)


def test_matching_indexer_through_the_layer_gives_zero_loss_and_gradient(layer_run):
    """A layer whose main attention and indexer are both uniform over the entries: zero queries
    (q_b_proj = 0: every logit 0) and zero head weights (weights_proj = 0: every score 0)."""
    attn, x, positions, cache, spec = layer_run
    w = attn.weights()
    w = w.replace(q_b_proj=jnp.zeros_like(w.q_b_proj),
                  indexer=w.indexer.replace(weights_proj=jnp.zeros_like(w.indexer.weights_proj)))
    results = _losses_and_grads(w, cache, x, positions, spec=spec)
    for over, (loss, grads, _) in results.items():
        assert abs(float(loss)) < 1e-6, over
        for name, g in _flat(grads.indexer).items():
            np.testing.assert_allclose(g, 0.0, atol=1e-6, err_msg=f"{over}: indexer.{name}")


def test_nnx_grad_through_the_module(layer_run, layer_grads):
    """The researcher's spelling: `nnx.grad` of the loss of `attn(..., return_intermediates=True)`."""
    attn, x, positions, cache, _ = layer_run

    def loss(module):
        _, _, inter = module(jnp.asarray(x), jnp.asarray(positions), cache, return_intermediates=True)
        return indexer_kl_loss(inter, "topk")

    grads = nnx.grad(loss)(attn)
    expected = _flat(layer_grads["topk"][1].indexer)
    for name in INDEXER_PARAMS:
        g = np.asarray(functools.reduce(getattr, ["indexer", *name.split(".")], grads)[...])
        assert np.abs(g).max() > 0, name
        np.testing.assert_allclose(g, expected[name], rtol=1e-5, atol=1e-7)
