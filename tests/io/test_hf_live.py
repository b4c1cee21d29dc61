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
from dsv4_jax.config import CSA, HCA, SLIDING
from dsv4_jax.io.hf_weights import export_hf_attention_weights

pytest.importorskip("torch")
pytest.importorskip("transformers")
from dsv4_jax.io.hf_reference import HFAttentionRunner, official_roundings, official_sites


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


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_official_numerics_match_hf_with_the_official_roundings(layer):
    """``numerics="official"`` against HF's layer with the official roundings put in at the
    official code's places (`official_roundings`): the same outputs and picks through prefill
    chunks and decode steps, and every rounding site of the layer type reached."""
    import torch

    cfg = dsv4_jax.DeepseekV4Config.tiny(index_n_heads=8)
    attn = random_layer(cfg, layer, seed=21, numerics="official")
    hf = HFAttentionRunner(cfg, layer, export_hf_attention_weights(attn))
    seen = []
    indexer = getattr(getattr(hf.layer, "compressor", None), "indexer", None)
    hook = indexer.register_forward_hook(lambda m, a, out: seen.append(out.numpy())) if indexer else None
    x = np.random.default_rng(22).normal(size=(2, 47, cfg.hidden_size)).astype(np.float32)
    cache = attn.init_cache(2, 47)
    start = 0
    try:
        with official_roundings(cfg.qk_rope_head_dim) as sites:
            for n in (19, 1, 1, 10, 1, 15):
                pos = np.broadcast_to(np.arange(start, start + n, dtype=np.int32), (2, n))
                out, cache, inter = attn(jnp.asarray(x[:, start:start + n]), pos, cache, return_intermediates=True)
                with torch.no_grad():
                    ref = hf(x[:, start:start + n], pos)
                assert rel_err(out, ref) < 2e-5, f"call at {start}: {rel_err(out, ref):.2e}"
                if indexer is not None:
                    np.testing.assert_array_equal(np.asarray(inter.topk), pad_picks(seen[-1], cfg.index_topk))
                start += n
    finally:
        if hook is not None:
            hook.remove()
    expected = official_sites(attn.layer_type)
    assert len(expected) == {SLIDING: 1, CSA: 4, HCA: 2}[attn.layer_type]
    assert set(sites) == expected, f"rounding sites reached: {sorted(sites)}, expected {sorted(expected)}"
