"""Weights loaded while the layer is called: the layer's memo of its weights pytree never pairs
old arrays with the probe of new ones.

The memo reuses a pytree while its probe (the parameters' identities) holds. The pytree is
built from the arrays the probe recorded, so whatever another thread does between the probe
and the pytree, the next call after a load computes with the loaded weights. The interleavings
are forced by hooking the probe (no thread race, no flakiness).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_layer

import dsv4_jax
from dsv4_jax.io.hf_weights import export_hf_attention_weights
from dsv4_jax.layer import module as attention

SLIDING_LAYER = 0


@pytest.fixture(scope="module")
def cfg():
    return dsv4_jax.DeepseekV4Config.tiny()


def run(attn, hidden):
    out, _ = attn(hidden, np.arange(hidden.shape[1], dtype=np.int32)[None], attn.init_cache(1, 16))
    return np.asarray(out)


@pytest.mark.parametrize("layer", [SLIDING_LAYER, 1])
@pytest.mark.parametrize("when", ["before the probe", "after the probe"])
def test_a_load_between_probe_and_read_is_seen_by_the_next_call(cfg, monkeypatch, layer, when):
    attn = random_layer(cfg, layer, seed=0)
    new_weights = export_hf_attention_weights(random_layer(cfg, layer, seed=1))
    reference = random_layer(cfg, layer, seed=1)
    hidden = jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, cfg.hidden_size)), jnp.float32)
    run(attn, hidden)  # the memo holds the old pytree under the old probe

    # Another thread's load, interleaved once with the memo's rebuild (made necessary by an
    # assignment the memo has not seen yet).
    original = attention._parameter_probe
    swapped = []

    def probe_with_a_load(module):
        if not swapped and when == "before the probe":
            swapped.append(dsv4_jax.load_hf_attention_weights(attn, new_weights))
        probe = original(module)
        if not swapped and when == "after the probe":
            swapped.append(dsv4_jax.load_hf_attention_weights(attn, new_weights))
        return probe

    monkeypatch.setattr(attention, "_parameter_probe", probe_with_a_load)
    attn.sinks[...] = attn.sinks[...] + 0.0  # a new array: the next call rebuilds the memo
    run(attn, hidden)
    assert swapped
    monkeypatch.setattr(attention, "_parameter_probe", original)
    expected = run(reference, hidden)
    for _ in range(2):  # every later call computes with the loaded weights
        np.testing.assert_allclose(run(attn, hidden), expected, rtol=1e-6, atol=1e-6)


def test_the_memo_pytree_holds_exactly_what_its_probe_vouches_for(cfg):
    attn = random_layer(cfg, 1, seed=0)
    probe, weights = attn._probed_weights()
    assert probe.holds()
    assert [id(a) for a in jax.tree.leaves(weights)] == [id(a) for a in probe[4]]
