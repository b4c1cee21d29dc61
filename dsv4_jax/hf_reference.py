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

from .config import DeepseekV4Config

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
