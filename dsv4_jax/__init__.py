"""dsv4_jax: DeepSeek-V4 attention in JAX/Flax NNX, with the lightning indexer as a break out of the
XLA program: a native custom call on the device where the native part is built, else a host
callback (`breaks.BREAK_SUMMARY`, `native_info()`)."""

# export registers the pytrees for jax.export serialization; sharding: meshes, partition specs;
# long_context: prompts of any length by chunks, cache sizes.
from . import export, long_context, sharding  # noqa: F401
from .attention import DeepseekV4Attention
from .breaks import BREAK_MODES, BREAK_PLACES, BreakPlan
from .cache import AttentionCache, CompressorCache, reset_rows
from .checkpoint import load_attention_checkpoint
from .config import CSA, HCA, SLIDING, DeepseekV4Config, YarnScaling
from .indexer_loss import indexer_kl_loss
from .kernel_plan import KERNELS, KernelPlan
from .native import native_info
from .overlap import OVERLAP_CHOICES, compiler_options
from .step import AttentionWeights, Intermediates, attention_step
from .weights import load_hf_attention_weights

__all__ = [
    "BREAK_MODES",
    "BREAK_PLACES",
    "CSA",
    "HCA",
    "KERNELS",
    "OVERLAP_CHOICES",
    "SLIDING",
    "AttentionCache",
    "AttentionWeights",
    "BreakPlan",
    "CompressorCache",
    "DeepseekV4Attention",
    "DeepseekV4Config",
    "Intermediates",
    "KernelPlan",
    "YarnScaling",
    "attention_step",
    "compiler_options",
    "indexer_kl_loss",
    "load_attention_checkpoint",
    "load_hf_attention_weights",
    "native_info",
    "reset_rows",
]
