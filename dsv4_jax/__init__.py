"""dsv4_jax: DeepSeek-V4 attention in JAX/Flax NNX, with the lightning indexer as a host break."""

from .attention import AttentionWeights, DeepseekV4Attention, Intermediates, attention_step
from .breaks import BREAK_MODES
from .cache import AttentionCache, CompressorCache
from .checkpoint import load_attention_checkpoint
from .config import CSA, HCA, SLIDING, DeepseekV4Config, YarnScaling
from .weights import load_hf_attention_weights

__all__ = [
    "BREAK_MODES", "CSA", "HCA", "SLIDING", "AttentionCache", "AttentionWeights", "CompressorCache",
    "DeepseekV4Attention", "DeepseekV4Config", "Intermediates", "YarnScaling", "attention_step",
    "load_attention_checkpoint", "load_hf_attention_weights",
]
