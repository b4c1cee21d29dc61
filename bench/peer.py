"""The peer: Hugging Face transformers' PyTorch DeepSeek-V4 attention layer, timed like ours.

`dsv4_jax.io.hf_reference.HFAttentionRunner` builds the HF layer with our weights and a DynamicCache.
What is timed here is the layer's forward alone (``runner.layer(...)``): the rotary tables and
the sliding-window mask are built just before each timed call, outside the timer, because in a
`DeepseekV4Model` they are built once per forward and shared by all 43 layers.

The runner's `forward` wraps its calls in `stable_topk` (a full stable sort, the project's tie
rule for parity tests); the timing here uses stock ``torch.topk``, which is what a user of HF
gets. Outputs are still compared with ours and the difference recorded.
"""

from __future__ import annotations

import copy
import time

import numpy as np

# The benchmark's peers, by record name: this module (HF transformers, PyTorch) and the JAX one,
# MaxText's `CompressedAttention` (`bench/peer_maxtext.py`; the `[peers]` extra).
HF = "hf-torch"
MAXTEXT = "maxtext-jax"
NAMES = (HF, MAXTEXT)


def maxtext():
    """The MaxText peer's module (imports maxtext only when its functions are called)."""
    from bench import peer_maxtext

    return peer_maxtext


def available() -> str | None:
    """None if torch and transformers (with DeepSeek-V4) import, else the reason."""
    try:
        import torch  # noqa: F401
        from transformers.models.deepseek_v4 import modeling_deepseek_v4  # noqa: F401
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads()}


class Peer:
    """One HF layer on a device, with helpers to run prepared calls and time them."""

    def __init__(self, cfg, layer_idx: int, weights: dict, dtype: str, device: str):
        import torch

        from dsv4_jax.io.hf_reference import HFAttentionRunner

        self.torch = torch
        self.device = device
        self.runner = HFAttentionRunner(cfg, layer_idx, weights, dtype=dtype, device=device)

    # ------------------------------------------------------------------ inputs
    def tensor(self, x: np.ndarray):
        return self.runner.to_torch(x)

    def positions(self, pos: np.ndarray):
        return self.torch.as_tensor(np.array(pos, np.int64), device=self.device)

    def sync(self) -> None:
        if self.device != "cpu":
            self.torch.cuda.synchronize()

    # ------------------------------------------------------------------ calls
    def _prepare(self, x, pos):
        from transformers.masking_utils import create_sliding_window_causal_mask

        r = self.runner
        pe = {kind: r.rotary(x, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        mask = create_sliding_window_causal_mask(
            config=r.config, inputs_embeds=x, attention_mask=None, past_key_values=r.cache,
            position_ids=pos, layer_idx=r.layer_idx,
        )
        return pe, mask

    def call(self, x, pos, timed: bool = False):
        """One layer call (tensors in); returns (out tensor, seconds or None)."""
        torch = self.torch
        with torch.no_grad():
            pe, mask = self._prepare(x, pos)
            if timed:
                self.sync()
                t0 = time.perf_counter()
            out, _ = self.runner.layer(x, position_embeddings=pe, position_ids=pos, attention_mask=mask,
                                       past_key_values=self.runner.cache)
            if timed:
                self.sync()
                return out, time.perf_counter() - t0
        return out, None

    # ------------------------------------------------------------------ cache
    def reset(self) -> None:
        self.runner.reset()

    def snapshot(self):
        return copy.deepcopy(self.runner.cache)

    def restore(self, snap) -> None:
        self.runner.cache = copy.deepcopy(snap)

    def to_numpy(self, out) -> np.ndarray:
        return out.float().cpu().numpy()

    def free(self) -> None:
        self.runner = None
        if self.device != "cpu":
            self.torch.cuda.empty_cache()

    def peak_memory_gb(self) -> float | None:
        if self.device == "cpu":
            return None
        return self.torch.cuda.max_memory_allocated() / 1e9

    def reset_peak(self) -> None:
        if self.device != "cpu":
            self.torch.cuda.reset_peak_memory_stats()
