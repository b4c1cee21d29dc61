"""Errors on the host side of a call are worded, whatever their kind.

Every exception raised in a host break, `SystemExit` and `KeyboardInterrupt` included, comes
back as `HostBreakError` naming the stage, caused by the original (XLA would otherwise hand
back an anonymous runtime error). A cache consumed by an earlier call of a donating layer is
refused before anything runs, with a message naming ``donate_cache``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import fail_on_the_host, random_layer

import dsv4_jax
from dsv4_jax.step import breaks

CSA_LAYER = 1


@pytest.fixture(scope="module")
def cfg():
    return dsv4_jax.DeepseekV4Config.tiny()


def hidden(cfg, tokens=3, batch=1):
    return np.random.default_rng(0).normal(size=(batch, tokens, cfg.hidden_size)).astype(np.float32)


# query_block: a step no other test compiled, so that it is traced with the failing selection.
@pytest.mark.parametrize("kind, query_block", [(SystemExit, 89), (KeyboardInterrupt, 83), (MemoryError, 79)])
def test_any_exception_in_a_host_break_is_a_host_break_error(cfg, monkeypatch, kind, query_block):
    fail = fail_on_the_host(monkeypatch, kind("simulated"))
    attn = random_layer(cfg, CSA_LAYER, break_mode="narrow", break_on="host", query_block=query_block)
    cache = attn.init_cache(1, 32)
    _, cache = attn(hidden(cfg), None, cache)
    fail["on"] = True
    with pytest.raises(breaks.HostBreakError, match=rf"'select_topk'.* failed: {kind.__name__}: simulated") as info:
        attn(hidden(cfg), None, cache)
    assert isinstance(info.value.__cause__, kind)
    fail["on"] = False
    attn(hidden(cfg), None, cache)  # the cache passed in is intact


def test_a_donated_cache_reused_is_refused_naming_donate_cache(cfg):
    attn = random_layer(cfg, 0, donate_cache=True)
    first = attn.init_cache(1, 32)
    _, second = attn(hidden(cfg), None, first)
    message = r"^cache: expected a live cache, got one whose arrays were donated .*donate_cache=True"
    with pytest.raises(ValueError, match=message):  # the layer's memo knows this structure
        attn(hidden(cfg), None, first)
    with pytest.raises(ValueError, match=message):  # and a layer that never saw it
        random_layer(cfg, 0, donate_cache=True)(hidden(cfg), None, first)
    _, third = attn(hidden(cfg), None, second)  # the returned cache is the live one
    with pytest.raises(ValueError, match=message):
        attn(hidden(cfg), None, second)
    attn(hidden(cfg), None, third)
