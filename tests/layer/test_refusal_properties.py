"""Property tests (hypothesis): refused calls change nothing, accepted ones equal the one-shot result.

For a random layer type, ragged schedule (each call gives each row of a batch of 2 its own
number of new tokens, padded with -1) and random bad inputs slipped in between (a NaN, a value
that overflows the compute dtype, a gap or a replay in the positions, a padded slot before a
real token, a call past `max_seq_len`, the wrong batch), every bad call is refused with a
`ValueError`/`TypeError` and leaves the cache byte-identical (its host length mirror included),
and each row's outputs over the accepted calls equal those of one call over its whole sequence.

Compile time bounds the cost: call widths come from a small set, so the compiled steps stay
few whatever hypothesis draws. DSV4_HYPOTHESIS_EXAMPLES sets the number of examples (default 10).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_golden_layer as layer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MAX_SEQ_LEN = 24
BATCH = 2
WIDTHS = (1, 3)
MAX_EXAMPLES = int(os.environ.get("DSV4_HYPOTHESIS_EXAMPLES", "10"))
BAD = ("nan", "overflow", "gap", "replay", "pad_first", "past_end", "batch")


@functools.cache
def inputs(seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(BATCH, MAX_SEQ_LEN, layer(0).config.hidden_size)).astype(np.float32)


@functools.cache
def one_shot(i, seed):
    attn = layer(i)
    out, _ = attn(jnp.asarray(inputs(seed)), None, attn.init_cache(BATCH, MAX_SEQ_LEN))
    return np.asarray(out)


def snapshot(cache) -> list:
    """Every byte of the cache: its arrays and its host length mirror."""
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(cache)] + [np.asarray(cache.length).tobytes()]


def ragged_call(hidden, lengths, counts, width):
    """(hidden [B, width, hidden], positions [B, width]): row b's next counts[b] tokens, then padding."""
    x = np.zeros((BATCH, width, hidden.shape[-1]), np.float32)
    pos = np.full((BATCH, width), -1, np.int32)
    for b, (start, n) in enumerate(zip(lengths, counts)):
        x[b, :n] = hidden[b, start:start + n]
        pos[b, :n] = np.arange(start, start + n)
    return x, pos


def spoil(kind, x, pos, lengths, counts):
    """A bad version of the call (x, pos); None where this kind does not apply to it."""
    x, pos = x.copy(), pos.copy()
    b = int(np.argmax(counts))  # a row with real tokens
    if kind == "nan":
        x[b, 0, 3] = np.nan
    elif kind == "overflow":  # finite in float64, inf in the layer's float32
        x = x.astype(np.float64)
        x[b, 0, 5] = 1e39
    elif kind == "gap":
        pos[b, :counts[b]] += 1
    elif kind == "replay":
        if lengths[b] == 0:
            return None
        pos[b, :counts[b]] -= 1
    elif kind == "pad_first":
        if pos.shape[1] < 2:
            return None
        pos[b, 1:] = np.arange(lengths[b], lengths[b] + pos.shape[1] - 1)
        pos[b, 0] = -1
    elif kind == "past_end":
        width = pos.shape[1]
        pos[b] = np.arange(lengths[b], lengths[b] + width)
        if lengths[b] + width <= MAX_SEQ_LEN:
            return None
    elif kind == "batch":
        x, pos = x[:1], pos[:1]
    return x, pos


@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    i=st.sampled_from((0, 1, 2)),
    seed=st.integers(0, 1),
    steps=st.lists(st.tuples(st.sampled_from(WIDTHS), st.integers(0, 3), st.integers(0, 3),
                             st.one_of(st.none(), st.sampled_from(BAD))), min_size=1, max_size=16),
)
def test_refused_calls_leave_the_cache_byte_identical_and_accepted_ones_equal_one_shot(i, seed, steps):
    attn, hidden = layer(i), inputs(seed)
    cache = attn.init_cache(BATCH, MAX_SEQ_LEN)
    lengths = [0] * BATCH
    outputs = [[] for _ in range(BATCH)]
    for width, n0, n1, bad in steps:
        counts = [min(n, width, MAX_SEQ_LEN - length) for n, length in zip((n0, n1), lengths)]
        if not any(counts):
            continue
        x, pos = ragged_call(hidden, lengths, counts, width)
        spoiled = None if bad is None else spoil(bad, x, pos, lengths, counts)
        if spoiled is not None:
            before = snapshot(cache)
            with pytest.raises((ValueError, TypeError), match=r"^(hidden_states|positions): expected"):
                attn(*spoiled, cache)
            assert snapshot(cache) == before, bad
        out, cache = attn(x, pos, cache)
        out = np.asarray(out)
        for b, n in enumerate(counts):
            outputs[b].append(out[b, :n])
            assert not out[b, n:].any()  # padded slots output zeros
            lengths[b] += n
    assert np.asarray(cache.length).tolist() == lengths
    reference = one_shot(i, seed)
    scale = np.abs(reference).max()
    for b in range(BATCH):
        got = np.concatenate([np.zeros((0, reference.shape[-1]), np.float32), *outputs[b]])
        assert np.abs(got - reference[b, :lengths[b]]).max(initial=0.0) / scale < 1e-5, b
