"""Property tests (hypothesis): any chunking of a sequence gives the one-shot result.

For a random layer type, batch size, input and schedule of chunks, feeding the chunks one
call at a time through the cache must give the outputs (and, on the CSA layer, the indexer
picks) of one call over the whole sequence. Sequences run up to the cache's `max_seq_len`
(64 tokens: 8 HCA windows, 16 CSA windows, 8 sliding windows of the tiny golden config),
and a schedule may end exactly at the last position, after which one more token is refused.

Compile time bounds the cost: chunk lengths come from a small set and the one-shot
references from one compiled length, so the number of compiled steps stays bounded
(3 layers x 2 batch sizes x 5 lengths) whatever hypothesis draws. For a deeper search set
DSV4_HYPOTHESIS_EXAMPLES (default 25), e.g. ``DSV4_HYPOTHESIS_EXAMPLES=200 pytest tests/layer/test_properties.py``.
"""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_golden_layer as layer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

MAX_SEQ_LEN = 64
CHUNKS = (1, 2, 5, 13)
BATCHES = (1, 3)
CSA_LAYER = 1
MAX_EXAMPLES = int(os.environ.get("DSV4_HYPOTHESIS_EXAMPLES", "25"))


def inputs(batch, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch, MAX_SEQ_LEN, layer(0).config.hidden_size)).astype(np.float32)


def positions(start, length, batch):
    return np.broadcast_to(np.arange(start, start + length, dtype=np.int32), (batch, length))


def call(attn, hidden, start, cache):
    """One call; returns (out, picks or None, cache)."""
    batch, length = hidden.shape[:2]
    if attn.layer_idx == CSA_LAYER:
        out, cache, inter = attn(jnp.asarray(hidden), positions(start, length, batch), cache,
                                 return_intermediates=True)
        return np.asarray(out), np.asarray(inter.topk), cache
    out, cache = attn(jnp.asarray(hidden), positions(start, length, batch), cache)
    return np.asarray(out), None, cache


@functools.cache
def one_shot(i, batch, seed):
    attn = layer(i)
    out, picks, _ = call(attn, inputs(batch, seed), 0, attn.init_cache(batch, MAX_SEQ_LEN))
    return out, picks


def schedule_from(chunks, fill):
    """Chunks that fit in MAX_SEQ_LEN; with `fill`, topped up (from CHUNKS) to exactly MAX_SEQ_LEN."""
    out, total = [], 0
    for c in chunks:
        if total + c > MAX_SEQ_LEN:
            break
        out.append(c)
        total += c
    while fill and total < MAX_SEQ_LEN:
        c = max(c for c in CHUNKS if total + c <= MAX_SEQ_LEN)
        out.append(c)
        total += c
    return out


@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    i=st.sampled_from((0, 1, 2)),
    batch=st.sampled_from(BATCHES),
    seed=st.integers(0, 2),
    chunks=st.lists(st.sampled_from(CHUNKS), min_size=1, max_size=48),
    fill=st.booleans(),
)
# Decode-heavy and prefill-heavy runs across every window, each to the last position.
@example(i=1, batch=3, seed=0, chunks=[5] + [1] * 59, fill=True)
@example(i=2, batch=1, seed=1, chunks=[2, 13, 1, 13, 5, 1, 1, 13, 2, 13], fill=True)
@example(i=0, batch=1, seed=2, chunks=[13] * 4 + [1] * 12, fill=True)
def test_chunked_calls_equal_one_shot(i, batch, seed, chunks, fill):
    attn = layer(i)
    hidden = inputs(batch, seed)
    ref_out, ref_picks = one_shot(i, batch, seed)
    scale = np.abs(ref_out).max()
    cache = attn.init_cache(batch, MAX_SEQ_LEN)
    start = 0
    for length in schedule_from(chunks, fill):
        out, picks, cache = call(attn, hidden[:, start:start + length], start, cache)
        err = np.abs(out - ref_out[:, start:start + length]).max() / scale
        assert err < 1e-5, (start, length, err)
        if picks is not None:
            np.testing.assert_array_equal(picks, ref_picks[:, start:start + length], err_msg=f"{start}+{length}")
        start += length
    assert int(cache.length[0]) == start
    if start == MAX_SEQ_LEN:  # the last position was just written: one more token is refused
        with pytest.raises(ValueError, match=rf"expected at most 0 new tokens \(the cache holds {MAX_SEQ_LEN} of "
                                             rf"max_seq_len={MAX_SEQ_LEN}\), got 1"):
            attn(jnp.asarray(hidden[:, :1]), positions(start, 1, batch), cache)
