"""Live comparison with the reference on fresh random weights (needs the `[hf]` extra).

Skipped when torch / transformers are not installed. The reference runs with a stable
top-k (equal scores: lower index first), the project's tie rule.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import pad_picks, random_layer, rel_err

import dsv4_jax
from dsv4_jax.weights import export_hf_attention_weights

pytest.importorskip("torch")
pytest.importorskip("transformers")
from dsv4_jax.hf_reference import HFAttentionRunner


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_matches_hf_on_random_weights(layer):
    cfg = dsv4_jax.DeepseekV4Config.tiny(index_n_heads=8)  # more heads: fewer exact ties
    attn = random_layer(cfg, layer, seed=11)
    hf = HFAttentionRunner(cfg, layer, export_hf_attention_weights(attn))
    x = np.random.default_rng(12).normal(size=(2, 47, cfg.hidden_size)).astype(np.float32)
    cache = attn.init_cache(2, 47)
    start = 0
    for n in (19, 1, 1, 10, 1, 15):
        pos = np.broadcast_to(np.arange(start, start + n, dtype=np.int32), (2, n))
        out, cache = attn(jnp.asarray(x[:, start:start + n]), pos, cache)
        ref = hf(x[:, start:start + n], pos)
        assert rel_err(out, ref) < 2e-5, f"call at {start}: {rel_err(out, ref):.2e}"
        start += n


def test_picks_match_hf_indexer():
    """The CSA picks themselves, read from HF's indexer during the same run."""
    import torch

    cfg = dsv4_jax.DeepseekV4Config.tiny(index_n_heads=8)
    attn = random_layer(cfg, 1, seed=13)
    hf = HFAttentionRunner(cfg, 1, export_hf_attention_weights(attn))
    seen = []
    hook = hf.layer.compressor.indexer.register_forward_hook(lambda m, a, out: seen.append(out.numpy()))
    x = np.random.default_rng(14).normal(size=(1, 40, cfg.hidden_size)).astype(np.float32)
    cache = attn.init_cache(1, 40)
    try:
        start = 0
        for n in (25, 1, 14):
            pos = np.arange(start, start + n, dtype=np.int32)[None]
            _, cache, inter = attn(jnp.asarray(x[:, start:start + n]), pos, cache, return_intermediates=True)
            with torch.no_grad():
                hf(x[:, start:start + n], pos)
            np.testing.assert_array_equal(np.asarray(inter.topk), pad_picks(seen[-1], cfg.index_topk))
            start += n
    finally:
        hook.remove()
