"""Rewind and fork: a server's row operations (issue 67, items 2-4, on the contiguous cache).

The contracts checked here:

* **rewind = never written.** `dsv4_jax.rewind_rows(cache, rows, n)` on a cache made with
  ``max_rewind=K`` leaves every field bit for bit as in a cache that never saw the rewound
  tokens (the reference runs the same call shapes with those slots padded), except the ring
  histories' slots past the row's `rewindable` count, which no rewind reads and which agree
  again once K more tokens are written; every layer type, bf16-style and FP8 caches, every
  break mode, eagerly and under the user's `jax.jit`; across an entry boundary, the window
  ring's wrap and a chunk longer than the ring.
* **several tokens a step**: a verification loop (write up to 8 drafts a row, accept some,
  rewind the rest, go on; hypothesis draws the rows, drafts and accepts) equals the cache and
  outputs of the accepted tokens only, and the one-shot prefill of them (float32 tolerance).
* **fork = recompute**: rows forked from another, then decoded, equal those rows computed from
  scratch with the same history, bit for bit.
* the refusals (each leaving the cache as it was, host mirrors included) and `reset_rows`
  clearing the history.

Compile time bounds the cost: three call shapes ([3, 13], [3, 8], [3, 1]) per layer and mode,
the same for the references.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import EXECUTIONS, execution, random_layer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsv4_jax
from dsv4_jax import fork_rows, reset_rows, rewind_rows
from dsv4_jax.step.plan import plan_step

CFG = dsv4_jax.DeepseekV4Config.tiny()
LAYERS = {"sliding": 0, "csa": 1, "hca": 2}
BATCH, MAX_SEQ_LEN, K = 3, 64, 8  # K: max_rewind (= the window and every ring of the tiny config)
PREFILL, DRAFTS = 13, 8  # the call widths: a chunk longer than the rings, a verification step
MAX_EXAMPLES = int(os.environ.get("DSV4_HYPOTHESIS_EXAMPLES", "6"))


@functools.cache
def layer(kind: str, mode: str = "none", fp8: bool = False):
    extra = dict(numerics="official") if fp8 else {}
    return random_layer(CFG, LAYERS[kind], seed=5, **EXECUTIONS[mode], **extra)


def new_cache(attn, fp8=False, max_rewind=K):
    return attn.init_cache(BATCH, MAX_SEQ_LEN, kv_cache_dtype="fp8" if fp8 else "auto", max_rewind=max_rewind)


def stream(seed=0, tokens=MAX_SEQ_LEN):
    """Each row's true tokens [B, T, hidden] (what the accepted drafts are) and junk drafts."""
    rng = np.random.default_rng(seed)
    shape = (BATCH, tokens, CFG.hidden_size)
    return rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)


def call(attn, cache, x, counts, width):
    """A call of `width` slots: row b's first counts[b] tokens x[b] at its next positions, then
    padding (-1). Returns (out [B, width, hidden] as NumPy, cache); a call of padding only is
    no call (out None, cache as it was)."""
    counts = np.asarray(counts)
    if not counts.any():
        return None, cache
    length = np.asarray(cache.length)
    xs = np.full((BATCH, width, CFG.hidden_size), 0.25, np.float32)
    pos = np.full((BATCH, width), -1, np.int32)
    for b, n in enumerate(counts):
        xs[b, :n] = x[b, :n]
        pos[b, :n] = length[b] + np.arange(n)
    out, cache = attn(jnp.asarray(xs), pos, cache)
    return np.asarray(out), cache


def leaves(cache):
    return {jax.tree_util.keystr(path): np.asarray(a) for path, a in jax.tree_util.tree_flatten_with_path(cache)[0]}


def ring_of(cache, name):
    """The ring slots R of the ring whose history leaf is `name`."""
    if name.startswith(".window_history"):
        return cache.window.shape[1]
    return getattr(cache, name.split(".")[1]).buffer.shape[1]


def assert_same_cache(got, want, exact=False):
    """Every leaf of `got` equals `want`'s, bit for bit; unless `exact`, the histories only on
    the slots their row's `rewindable` count keeps (and that count at most `want`'s)."""
    g, w = leaves(got), leaves(want)
    assert g.keys() == w.keys()
    length, count = np.asarray(got.length), np.asarray(got.rewindable)
    for name in g:
        if exact or ("history" not in name and name != ".rewindable"):
            np.testing.assert_array_equal(g[name], w[name], err_msg=name)
        elif name == ".rewindable":
            assert np.all(g[name] <= w[name]), (g[name], w[name])
        else:
            r = ring_of(got, name)
            for b in range(BATCH):
                q = np.arange(length[b] - r - count[b], length[b] - r)
                slots = q[q >= 0] % K
                np.testing.assert_array_equal(g[name][b, slots], w[name][b, slots], err_msg=f"{name} row {b}")


def _distinct(kind, mode):
    """Modes that resolve to the same compiled step as another one run once (as in test_ragged)."""
    kw = {k: v for k, v in EXECUTIONS[mode].items() if k in ("break_mode", "break_on", "kernels")}
    if mode != "none" and plan_step(CFG.layer_type(LAYERS[kind]), **kw) == plan_step(
            CFG.layer_type(LAYERS[kind]), "none", kernels="xla"):
        pytest.skip("same compiled step as 'none'")


# ---------------------------------------------------------------------------- rewind = never written
# A covering set: FP8 caches on the compressed layers (whose windows are FP8 too); every break
# mode on CSA, the only layer with an indexer to break out; "wide" (the ring writes and their
# history in NumPy, on the host) on every layer type.
CASES = [(kind, "none", False) for kind in LAYERS] + [(kind, "none", True) for kind in ("csa", "hca")]
CASES += [("csa", mode, False) for mode in EXECUTIONS if mode != "none"]
CASES += [(kind, "wide", False) for kind in ("sliding", "hca")]


@pytest.mark.parametrize("kind,mode,fp8", CASES)
def test_rewind_equals_never_written(kind, mode, fp8):
    """A prefill, a rewind right after it (the history from the chunk's own values: 13 > 8
    slots), a verification step whose rejected drafts cross an entry boundary and the
    window's wrap, then K decode steps: every step's outputs and cache equal the reference
    that only ever saw the kept tokens; after the K steps the histories too."""
    execution(mode)
    _distinct(kind, mode)
    attn = layer(kind, mode, fp8)
    true, junk = stream()
    spec, ref = new_cache(attn, fp8), new_cache(attn, fp8)

    kept = np.zeros((BATCH, MAX_SEQ_LEN, CFG.hidden_size), np.float32)  # the kept tokens' outputs
    out, spec = call(attn, spec, true, [PREFILL] * BATCH, PREFILL)
    spec = rewind_rows(spec, [0, 2], [4, 2])
    _, ref = call(attn, ref, true, [9, 13, 11], PREFILL)
    assert_same_cache(spec, ref)
    np.testing.assert_array_equal(spec.length, [9, 13, 11])
    kept[:, :PREFILL] = out

    drafts = [8, 5, 8]
    accept = np.array([1, 0, 5])
    x = junk[:, :DRAFTS].copy()
    for b, a in enumerate(accept):  # the accepted drafts are the row's true next tokens
        start = int(spec.length[b])
        x[b, :a] = true[b, start:start + a]
    out, spec = call(attn, spec, x, drafts, DRAFTS)
    spec = rewind_rows(spec, [0, 1, 2], np.array(drafts) - accept)
    want, ref = call(attn, ref, x, accept, DRAFTS)
    for b, a in enumerate(accept):  # the accepted drafts' outputs are the reference's
        np.testing.assert_array_equal(out[b, :a], want[b, :a])
        kept[b, spec.length[b] - a:spec.length[b]] = out[b, :a]
    assert_same_cache(spec, ref)

    for step in range(K):
        start = np.asarray(spec.length)
        x = np.stack([true[b, start[b]:start[b] + 1] for b in range(BATCH)])
        out, spec = attn(jnp.asarray(x), None, spec)
        want, ref = attn(jnp.asarray(x), None, ref)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want), err_msg=f"decode step {step}")
        kept[np.arange(BATCH), start] = np.asarray(out)[:, 0]
    assert_same_cache(spec, ref, exact=True)
    # Every kept token's output is token-by-token decoding's (the [3, 1] step compiled above).
    stepwise = token_by_token(attn, true, np.asarray(spec.length), fp8)
    for b in range(BATCH):
        n = int(spec.length[b])
        err = np.abs(kept[b, :n] - stepwise[b, :n]).max() / np.abs(stepwise[b, :n]).max()
        assert err < 2e-5, (b, err)


def token_by_token(attn, true, lengths, fp8=False):
    """Each row's first lengths[b] tokens decoded one a call (rows that are done pad): [B, T, hidden]."""
    cache, outs = new_cache(attn, fp8), np.zeros((BATCH, MAX_SEQ_LEN, CFG.hidden_size), np.float32)
    for t in range(int(lengths.max())):
        pos = np.where(t < lengths, t, -1).astype(np.int32)[:, None]
        out, cache = attn(jnp.asarray(true[:, t:t + 1]), pos, cache)
        outs[:, t] = np.asarray(out)[:, 0]
    return outs


def test_rewind_past_the_ring_restores_it_whole():
    """K = 12 > R = 8 (the HCA ring, the window): a rewind of 12 takes every slot from the
    history; equal to a prefill of the one token kept."""
    attn = layer("hca")
    true, _ = stream()
    cache = new_cache(attn, max_rewind=12)
    _, cache = call(attn, cache, true, [PREFILL] * BATCH, PREFILL)
    np.testing.assert_array_equal(cache.rewindable, [12] * BATCH)
    cache = rewind_rows(cache, np.array([True, False, True]), np.array([12, 0, 9]))
    _, ref = call(attn, new_cache(attn, max_rewind=12), true, [1, 13, 4], PREFILL)
    g, w = leaves(cache), leaves(ref)
    for name in g:
        if "history" not in name and name != ".rewindable":
            np.testing.assert_array_equal(g[name], w[name], err_msg=name)
    np.testing.assert_array_equal(cache.rewindable, [0, 12, 3])


# ---------------------------------------------------------------------------- the verification loop
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(list(LAYERS)), seed=st.integers(0, 3), data=st.data())
def test_verification_loop_equals_the_accepted_tokens_only(kind, seed, data):
    """Rounds of up to 8 drafts a row (random rows, ragged, -1 padded), a random number of them
    accepted, the rest rewound: the cache equals the one that saw the accepted tokens only,
    the accepted drafts' outputs equal its outputs, and every accepted token's output equals
    the one-shot prefill of the accepted tokens."""
    attn = layer(kind)
    true, junk = stream(seed)
    spec, ref = new_cache(attn), new_cache(attn)
    _, spec = call(attn, spec, true, [PREFILL] * BATCH, PREFILL)
    _, ref = call(attn, ref, true, [PREFILL] * BATCH, PREFILL)
    got = np.zeros((BATCH, MAX_SEQ_LEN, CFG.hidden_size), np.float32)  # each accepted token's output
    for _ in range(data.draw(st.integers(1, 4), label="rounds")):
        drafts = np.array(data.draw(st.lists(st.integers(0, DRAFTS), min_size=BATCH, max_size=BATCH), label="drafts"))
        if not drafts.any():
            continue
        accept = np.array([data.draw(st.integers(0, int(d)), label=f"accept {b}") for b, d in enumerate(drafts)])
        start = np.asarray(spec.length).copy()
        x = junk[:, start.max() % 16:][:, :DRAFTS].copy()
        for b in range(BATCH):
            x[b, :accept[b]] = true[b, start[b]:start[b] + accept[b]]
        out, spec = call(attn, spec, x, drafts, DRAFTS)
        rejected = drafts - accept
        as_mask = data.draw(st.booleans(), label="rows as a mask")
        rows = rejected > 0 if as_mask else np.nonzero(rejected)[0]
        if rejected.any():
            spec = rewind_rows(spec, rows, rejected if as_mask else rejected[rows])
        want, ref = call(attn, ref, x, accept, DRAFTS)
        for b in range(BATCH):
            got[b, start[b]:start[b] + accept[b]] = out[b, :accept[b]]
            if want is not None:
                np.testing.assert_array_equal(out[b, :accept[b]], want[b, :accept[b]])
        assert_same_cache(spec, ref)
    one_shot = one_shot_outputs(kind, seed)
    for b in range(BATCH):
        n = int(spec.length[b])
        assert n >= PREFILL
        err = np.abs(got[b, PREFILL:n] - one_shot[b, PREFILL:n]).max(initial=0) / np.abs(one_shot[b]).max()
        assert err < 2e-5, (b, err)


@functools.cache
def one_shot_outputs(kind, seed):
    attn = layer(kind)
    true, _ = stream(seed)
    tokens = PREFILL + 4 * DRAFTS  # the most a row accepts in the loop above
    out, _ = attn(jnp.asarray(true[:, :tokens]), None, new_cache(attn))
    return np.asarray(out)


# ---------------------------------------------------------------------------- under the user's jit
def test_rewind_and_fork_under_the_users_jit():
    """A jitted verification round (step, rewind with traced rows and counts, fork) equals
    the eager one; a traced count past what a row can take back leaves that row unchanged."""
    attn = layer("csa")
    true, junk = stream(1)
    cache = new_cache(attn)
    _, cache = call(attn, cache, true, [PREFILL, PREFILL, 0], PREFILL)
    graphdef, state = nnx.split(attn)

    @jax.jit
    def round_(state, cache, x, positions, rows, n, src, dst):
        out, cache = nnx.merge(graphdef, state)(x, positions, cache)
        return out, fork_rows(rewind_rows(cache, rows, n), src, dst)

    x = junk[:, :DRAFTS]
    positions = np.where(np.arange(DRAFTS) < np.array([[8], [3], [0]]), np.asarray(cache.length)[:, None]
                         + np.arange(DRAFTS), -1).astype(np.int32)
    n = np.array([6, 9, 0], np.int32)  # row 1 asks for more than its 8: unchanged under jit
    out, jitted = round_(state, cache, jnp.asarray(x), positions, jnp.array([0, 1]), jnp.asarray(n[:2]),
                         jnp.array([0]), jnp.array([2]))
    eager_out, eager = attn(jnp.asarray(x), positions, cache)
    eager = fork_rows(rewind_rows(eager, [0], [6]), [0], [2])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(eager_out))
    assert_same_cache(jitted, eager, exact=True)
    assert isinstance(eager.length, np.ndarray) and isinstance(eager.rewindable, np.ndarray)  # the mirrors kept
    np.testing.assert_array_equal(eager.length, [PREFILL + 2, PREFILL + 3, PREFILL + 2])


# ---------------------------------------------------------------------------- fork = recompute
@pytest.mark.parametrize("kind", list(LAYERS))
def test_forked_rows_equal_rows_computed_from_scratch(kind):
    """Row 0 holds a prefix; rows 1 and 2 fork from it and go on with their own tokens (decode
    steps, a rewind, a verification step): bit for bit the rows that computed the prefix
    themselves."""
    attn = layer(kind)
    true, junk = stream(2)
    forked = new_cache(attn)
    _, forked = call(attn, forked, true, [PREFILL, 0, 0], PREFILL)
    forked = fork_rows(forked, 0, [1, 2])
    prefix = np.broadcast_to(true[:1], true.shape)
    _, scratch = call(attn, new_cache(attn), prefix, [PREFILL] * BATCH, PREFILL)
    assert_same_cache(forked, scratch, exact=True)
    for step in range(3):
        x = junk[:, step:step + 1]
        out, forked = attn(jnp.asarray(x), None, forked)
        want, scratch = attn(jnp.asarray(x), None, scratch)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    forked, scratch = (rewind_rows(c, [1, 2], [2, 1]) for c in (forked, scratch))
    out, forked = call(attn, forked, true[:, 20:], [8, 5, 2], DRAFTS)
    want, scratch = call(attn, scratch, true[:, 20:], [8, 5, 2], DRAFTS)
    np.testing.assert_array_equal(out, want)
    assert_same_cache(forked, scratch, exact=True)


def test_fork_copies_every_field_without_history_too():
    attn = layer("hca")
    cache = attn.init_cache(BATCH, MAX_SEQ_LEN)
    _, cache = call(attn, cache, stream()[0], [0, PREFILL, 0], PREFILL)  # (no history: compiles a new step)
    forked = fork_rows(cache, [1, -2], [0, 2])
    for name, a in leaves(forked).items():
        np.testing.assert_array_equal(a[0], a[1], err_msg=name)
        np.testing.assert_array_equal(a[2], a[1], err_msg=name)
    assert forked.rewindable is None and isinstance(forked.length, np.ndarray)


# ---------------------------------------------------------------------------- reset, refusals
def test_reset_rows_clears_the_history():
    attn = layer("csa")
    cache = new_cache(attn)
    _, cache = call(attn, cache, stream()[0], [PREFILL] * BATCH, PREFILL)
    cache = reset_rows(cache, [1])
    fresh = leaves(new_cache(attn))
    for name, a in leaves(cache).items():
        np.testing.assert_array_equal(a[1], fresh[name][1], err_msg=name)
    assert isinstance(cache.rewindable, np.ndarray)
    np.testing.assert_array_equal(cache.rewindable, [K, 0, K])


def refusals():
    """(what is wrong, the call, the error, a fragment of its message)."""
    return [
        ("n past what the row can take back", lambda c: rewind_rows(c, [0], [9]), ValueError,
         "n: expected at most 8 tokens for row 0"),
        ("n past what the row holds", lambda c: rewind_rows(c, [2], 3), ValueError,
         "n: expected at most 2 tokens for row 2"),
        ("n negative", lambda c: rewind_rows(c, [0, 1], [1, -1]), ValueError, "n: expected tokens to take back >= 0"),
        ("n a float", lambda c: rewind_rows(c, [0], 1.0), TypeError, "n: expected an int"),
        ("n a bool", lambda c: rewind_rows(c, [0], True), TypeError, "n: expected an int"),
        ("n of the wrong shape", lambda c: rewind_rows(c, [0, 1], [1, 1, 1]), ValueError,
         "n: expected an int or one per row"),
        ("rows out of range", lambda c: rewind_rows(c, [3], 1), ValueError, "rows: expected row indices in [-3, 3)"),
        ("a row twice", lambda c: rewind_rows(c, [0, 0], 1), ValueError, "rows: expected each row at most once"),
        ("a mask of the wrong length", lambda c: rewind_rows(c, np.array([True, False]), 1), ValueError,
         "rows: expected a bool mask of shape [3]"),
        ("no history", lambda c: rewind_rows(c.replace(window_history=None), [0], 1), ValueError,
         "pass max_rewind=K"),
        ("not a cache", lambda c: rewind_rows({"length": c.length}, [0], 1), TypeError,
         "cache: expected an AttentionCache"),
        ("dst holding tokens", lambda c: fork_rows(c, 0, 1), ValueError,
         "dst: expected empty rows to fork into, got row(s) [1]"),
        ("dst out of range", lambda c: fork_rows(c, 0, 5), ValueError, "dst: expected row indices in [-3, 3)"),
        ("src out of range", lambda c: fork_rows(c, -4, 2), ValueError, "src: expected row indices in [-3, 3)"),
        ("dst twice", lambda c: fork_rows(c.replace(length=np.zeros(3, np.int32)), 0, [1, 1]), ValueError,
         "dst: expected each row at most once"),
        ("src and dst of other lengths", lambda c: fork_rows(c, [0, 1], [2, 2, 2]), ValueError,
         "src: expected one row, or one for each dst row"),
        ("rows as a mask for a fork", lambda c: fork_rows(c, np.array([True, False, False]), 2), TypeError,
         "src: expected row indices"),
    ]


@pytest.mark.parametrize("case", refusals(), ids=lambda case: case[0])
def test_refusals_leave_the_cache_as_it_was(case):
    """Each refusal names its argument; the cache (its host mirrors included) is unchanged and
    a rewind on it afterwards still gives the reference."""
    _, run, error, message = case
    attn = layer("csa")
    cache = _refusal_cache()
    before = leaves(cache)
    with pytest.raises(error) as info:
        run(cache)
    assert message in str(info.value), str(info.value)
    after = leaves(cache)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert isinstance(cache.length, np.ndarray) and isinstance(cache.rewindable, np.ndarray)
    del attn


@functools.cache
def _refusal_cache():
    """Row 0 holds 13 tokens (can take back 8), row 1 holds 13, row 2 holds 2 (can take back 2)."""
    attn = layer("csa")
    _, cache = call(attn, new_cache(attn), stream()[0], [PREFILL, PREFILL, 2], PREFILL)
    return cache


def test_refusal_messages_say_how():
    with pytest.raises(ValueError, match=r"made with max_rewind=0; pass max_rewind=K .* to init_cache"):
        rewind_rows(_refusal_cache().replace(window_history=None), 0, 1)
    with pytest.raises(ValueError, match=r"n: expected at most 2 tokens for row 2 .* it holds 2\), got 3"):
        rewind_rows(_refusal_cache(), 2, 3)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_init_cache_refuses_a_bad_max_rewind(bad):
    with pytest.raises(ValueError, match="max_rewind: expected an int >= 0"):
        layer("sliding").init_cache(1, 16, max_rewind=bad)


def test_the_history_costs_what_the_docs_say():
    """K rows of the window and of each compressor ring per batch row, and an int32 count."""
    attn = layer("csa")
    plain, kept = attn.init_cache(BATCH, MAX_SEQ_LEN), new_cache(attn)
    from dsv4_jax.cache.contiguous import cache_nbytes

    ring_rows = kept.window.shape[2] + kept.compressor.buffer.shape[2] + kept.indexer.buffer.shape[2]
    assert cache_nbytes(kept) - cache_nbytes(plain) == BATCH * (K * ring_rows * 4 + 4)
