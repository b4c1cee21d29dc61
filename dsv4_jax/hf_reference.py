"""Drive the reference: Hugging Face transformers' PyTorch DeepSeek-V4 attention layer.

Used by the live parity tests (the ``[hf]`` extra) and as the benchmark's peer. Needs
``torch`` and ``transformers==5.23.0``; imported lazily so the package never requires them.

`HFAttentionRunner` holds one HF `DeepseekV4Attention` with the same config and weights as a
`dsv4_jax` layer, plus a `DynamicCache`, and runs calls the way `DeepseekV4Model` does
(mask built before the layer updates the cache, rotary tables for both rope kinds).

Top-k ties: `torch.topk` leaves the order of equal scores unspecified, so the runner swaps in
a stable top-k during its calls (equal scores: lower entry index first), the project's rule.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import numpy as np

from .config import DeepseekV4Config

# Parameters HF's loader keeps in float32 for a bf16 model (spec section 11.4).
_FP32_KEEP = ("sinks", "position_bias", "q_a_norm", "kv_norm")


def hf_config(cfg: DeepseekV4Config):
    """A transformers `DeepseekV4Config` for `cfg` (eager attention, the only V4 backend)."""
    import transformers
    from transformers import DeepseekV4Config as HFConfig

    # HF warns that YaRN's factor differs from max_position / original (V4 sets it explicitly).
    transformers.logging.set_verbosity_error()
    return HFConfig(
        **cfg.to_hf(),
        vocab_size=128, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        attn_implementation="eager",
    )


@contextlib.contextmanager
def stable_topk():
    """Within the block, `Tensor.topk` breaks ties by the lower index (a stable sort)."""
    import torch

    original = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


class HFAttentionRunner:
    """One HF attention layer with its cache; `__call__(hidden, positions) -> out` (NumPy)."""

    def __init__(self, cfg: DeepseekV4Config, layer_idx: int, weights: Mapping[str, np.ndarray],
                 dtype: str = "float32", device: str = "cpu"):
        import torch
        from transformers.cache_utils import DynamicCache
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

        self.torch = torch
        self.hf = hf
        self.config = hf_config(cfg)
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
        with torch.no_grad(), stable_topk():
            pe = {kind: self.rotary(x, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")}
            mask = create_sliding_window_causal_mask(
                config=self.config, inputs_embeds=x, attention_mask=None,
                past_key_values=self.cache, position_ids=position_ids, layer_idx=self.layer_idx,
            )
            out, _ = self.layer(x, position_embeddings=pe, position_ids=position_ids, attention_mask=mask,
                                past_key_values=self.cache)
        return out
