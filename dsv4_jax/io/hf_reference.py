"""Drive the reference: Hugging Face transformers' PyTorch DeepSeek-V4 attention layer.

Used by the live parity tests (the ``[hf]`` extra) and as the benchmark's peer. Needs
``torch`` and ``transformers==5.23.0``; imported lazily so the package never requires them.

`HFAttentionRunner` holds one HF `DeepseekV4Attention` with the same config and weights as a
`dsv4_jax` layer, plus a `DynamicCache`, and runs calls the way `DeepseekV4Model` does
(mask built before the layer updates the cache, rotary tables for both rope kinds).

Top-k ties: `torch.topk` leaves the order of equal scores unspecified, so the runner's indexer
runs inside `stable_topk()` (equal scores: lower entry index first), the project's rule. That is
a torch function mode: it holds only inside the `with` block and only on the calling thread;
nothing of torch is patched, so other code in the process keeps the stock `topk`. It is entered
around the indexer's forward only (the one place HF's attention calls topk), because a function
mode adds a few microseconds of Python to every torch call it sees (the benchmark times
`forward`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping

import numpy as np

from dsv4_jax.config import DeepseekV4Config

# Parameters HF's loader keeps in float32 for a bf16 model (spec section 11.4).
_FP32_KEEP = ("sinks", "position_bias", "q_a_norm", "kv_norm")


# Fields of the HF model outside attention, small (only the attention layer is ever built).
_MODEL_FIELDS = dict(vocab_size=128, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def hf_config(cfg: DeepseekV4Config, **model_fields):
    """A transformers `DeepseekV4Config` for `cfg` (eager attention, the only V4 backend).

    `model_fields` override HF fields outside attention (vocab, MoE, mHC sizes) or the
    attention fields of `cfg.to_hf()`.
    """
    import transformers
    from transformers import DeepseekV4Config as HFConfig

    # HF warns that YaRN's factor differs from max_position / original (V4 sets it explicitly).
    transformers.logging.set_verbosity_error()
    return HFConfig(**{**cfg.to_hf(), **_MODEL_FIELDS, **model_fields}, attn_implementation="eager")


def _stable_topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):  # torch.topk's signature
    import torch

    if out is not None:
        raise NotImplementedError("stable_topk: topk(..., out=) is not supported")
    values, indices = torch.sort(input, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@contextlib.contextmanager
def stable_topk():
    """Within the block, on this thread, `torch.topk` / `Tensor.topk` break ties by the lower index.

    A `TorchFunctionMode` (thread-local, popped on exit even when the block raises), not a
    patch of `torch.Tensor.topk`: code outside the block, and other threads meanwhile, see
    the stock `topk`. Descending stable sort: `-inf` entries come last in index order, and
    `-0.0` ties with `0.0` (sorting compares values).
    """
    import torch
    from torch.overrides import TorchFunctionMode

    class StableTopk(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.topk or func is torch.Tensor.topk:
                return _stable_topk(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))

    with StableTopk():
        yield


def _under_stable_topk(forward):
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with stable_topk():
            return forward(*args, **kwargs)

    return wrapped


# The official inference's roundings at HF's call sites: (class of the caller, start of the calling
# line) -> which rounding (`official_roundings`). Every site follows an `apply_rotary_pos_emb`.
_OFFICIAL_SITES = {
    ("DeepseekV4Attention", "kv = apply_rotary_pos_emb("): "kv",
    ("DeepseekV4CSACompressor", "compressed = apply_rotary_pos_emb("): "kv",
    ("DeepseekV4HCACompressor", "compressed = apply_rotary_pos_emb("): "kv",
    ("DeepseekV4Indexer", "compressed = apply_rotary_pos_emb("): "indexer",
    ("DeepseekV4Indexer", "q = apply_rotary_pos_emb("): "indexer",
}


def official_sites(layer_type: str) -> set:
    """The `_OFFICIAL_SITES` a layer of this type reaches in a call that writes entries."""
    from dsv4_jax.config import CSA, HCA

    owners = {"DeepseekV4Attention"} | {CSA: {"DeepseekV4CSACompressor", "DeepseekV4Indexer"},
                                        HCA: {"DeepseekV4HCACompressor"}}.get(layer_type, set())
    return {site for site in _OFFICIAL_SITES if site[0] in owners}


@contextlib.contextmanager
def official_roundings(rope_dim: int):
    """Within the block, HF's DeepSeek-V4 attention rounds where DeepSeek's own inference does
    (`dsv4_jax.numerics`, docs/numerics.md): the attention's keys and the CSA/HCA compressors'
    new entries onto the FP8 grid (`round_kv_official`), the indexer's entries and queries by
    Hadamard + FP4 (`round_indexer_official`), each right after its RoPE. An independent
    placement of the roundings to check `numerics="official"` against (tests/io/test_hf_live.py).

    HF's module-level `apply_rotary_pos_emb` is replaced for the block's duration (not thread
    safe; restored on exit): the wrapper rounds the result when its caller is one of
    `_OFFICIAL_SITES` (the caller's class and the calling line's text). Yields a counter of the
    sites that rounded, so that a caller can check each was reached (a renamed variable in a
    later transformers would otherwise silently round nothing).
    """
    import collections
    import linecache
    import sys

    import ml_dtypes
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    from dsv4_jax import numerics

    stock = hf.apply_rotary_pos_emb
    counts = collections.Counter()

    def round_as_official(x, kind):
        host = x.detach().float().cpu().numpy()
        if x.dtype == torch.bfloat16:
            host = host.astype(ml_dtypes.bfloat16)
        rounded = (numerics.round_kv_official(host, rope_dim) if kind == "kv"
                   else numerics.round_indexer_official(host))
        return torch.from_numpy(np.asarray(rounded, np.float32)).to(device=x.device, dtype=x.dtype)

    @functools.wraps(stock)
    def rope_then_round(*args, **kwargs):
        out = stock(*args, **kwargs)
        frame = sys._getframe(1)
        owner = type(frame.f_locals.get("self")).__name__
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        for (cls, start), kind in _OFFICIAL_SITES.items():
            if owner == cls and line.startswith(start):
                counts[cls, start] += 1
                return round_as_official(out, kind)
        return out

    hf.apply_rotary_pos_emb = rope_then_round
    try:
        yield counts
    finally:
        hf.apply_rotary_pos_emb = stock


class HFAttentionRunner:
    """One HF attention layer with its cache; `__call__(hidden, positions) -> out` (NumPy)."""

    def __init__(self, cfg: DeepseekV4Config, layer_idx: int, weights: Mapping[str, np.ndarray],
                 dtype: str = "float32", device: str = "cpu", **model_fields):
        import torch
        from transformers.cache_utils import DynamicCache
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

        self.torch = torch
        self.hf = hf
        self.config = hf_config(cfg, **model_fields)
        self.layer_idx = layer_idx
        self.dtype = getattr(torch, dtype)
        self.device = device
        layer = hf.DeepseekV4Attention(self.config, layer_idx)
        state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in weights.items()}
        layer.load_state_dict(state, strict=True)
        layer = layer.to(device=device, dtype=self.dtype).eval()
        for name, param in layer.named_parameters():
            if any(part in name for part in _FP32_KEEP):
                param.data = param.data.float()
        indexer = getattr(getattr(layer, "compressor", None), "indexer", None)
        if indexer is not None:  # CSA: this layer's indexer, and nothing else, picks ties by the rule
            indexer.forward = _under_stable_topk(indexer.forward)
        self.layer = layer
        self.rotary = hf.DeepseekV4RotaryEmbedding(self.config).to(device)
        self.cache = DynamicCache(config=self.config)

    def reset(self) -> None:
        from transformers.cache_utils import DynamicCache

        self.cache = DynamicCache(config=self.config)

    def __call__(self, hidden: np.ndarray, positions: np.ndarray, synchronize=None) -> np.ndarray:
        """hidden [B, S, hidden] (float32 NumPy), positions [B, S] -> out float32 NumPy [B, S, hidden]."""
        out = self.forward(self.to_torch(hidden), self.torch.as_tensor(np.array(positions), device=self.device))
        return out.float().cpu().numpy()

    def to_torch(self, hidden: np.ndarray):
        return self.torch.as_tensor(np.asarray(hidden, np.float32), device=self.device).to(self.dtype)

    def forward(self, x, position_ids):
        """The torch-level call (tensors in, tensor out), for timing without conversions."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        torch = self.torch
        with torch.no_grad():
            pe = {kind: self.rotary(x, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")}
            mask = create_sliding_window_causal_mask(
                config=self.config, inputs_embeds=x, attention_mask=None,
                past_key_values=self.cache, position_ids=position_ids, layer_idx=self.layer_idx,
            )
            out, _ = self.layer(x, position_embeddings=pe, position_ids=position_ids, attention_mask=mask,
                                past_key_values=self.cache)
        return out
