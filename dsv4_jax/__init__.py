"""dsv4_jax: DeepSeek-V4 attention in JAX/Flax NNX, with the lightning indexer as a break out of the
XLA program: a native custom call on the device where the native part is built, else a host
callback (`step.plan.BREAK_SUMMARY`, `native_info()`).

The package's rooms (docs/DEVELOPING.md draws them): `config` and `numerics` (what the model
computes), `backend` (one copy of the math for XLA and NumPy), `native` (the built XLA FFI
handlers), `ops/` (each op's XLA reference beside its kernels and their backward, and the
`kernels=` plan), `cache/` (the cache pytrees), `step/` (the pure step, its plan, the break
boundary, the overlap, meshes), `layer/` (the NNX module, its eager call, the input checks),
`io/` (checkpoints, HF weights, export, the HF reference) and `tools/` (demo, diagnostics,
long context, the indexer's loss).
"""

import importlib
import importlib.abc
import importlib.util
import sys
import typing

# export registers the pytrees for jax.export serialization; sharding: meshes, partition specs;
# long_context: prompts of any length by chunks, cache sizes.
from dsv4_jax.cache.contiguous import AttentionCache, CompressorCache, reset_rows
from dsv4_jax.cache.paged import PageTable, reserve_pages
from dsv4_jax.cache.rows import fork_rows, rewind_rows
from dsv4_jax.config import CSA, HCA, SLIDING, DeepseekV4Config, YarnScaling
from dsv4_jax.io import export  # noqa: F401
from dsv4_jax.io.checkpoint import load_attention_checkpoint
from dsv4_jax.io.hf_weights import load_hf_attention_weights
from dsv4_jax.layer.jit_modules import jit_modules
from dsv4_jax.layer.module import DeepseekV4Attention
from dsv4_jax.layer.options import LayerOptions
from dsv4_jax.native import native_info
from dsv4_jax.ops.kernel_plan import KERNELS, KernelPlan
from dsv4_jax.step import sharding  # noqa: F401
from dsv4_jax.step.overlap import OVERLAP_CHOICES, compiler_options
from dsv4_jax.step.plan import BREAK_MODES, BREAK_PLACES, BreakPlan, StepPlan
from dsv4_jax.step.pure_step import AttentionWeights, Intermediates, attention_step
from dsv4_jax.tools import long_context  # noqa: F401
from dsv4_jax.tools.indexer_loss import indexer_kl_loss

# The flat module paths of releases before the rooms (``dsv4_jax.diagnostics``, ...): users'
# notebooks import them, so each still names the module in its room (the same module object).
MOVED_MODULES = {
    "attention": "layer.module",
    "breaks": "step.breaks",
    "call_path": "layer.call",
    "checkpoint": "io.checkpoint",
    "compressor": "ops.compress.reference",
    "compressor_kernel": "ops.compress.pallas",
    "demo": "tools.demo",
    "diagnostics": "tools.diagnostics",
    "export": "io.export",
    "finite_flag": "step.finite_flag",
    "head_norm_kernel": "ops.query_norm.pallas",
    "hf_reference": "io.hf_reference",
    "indexer": "ops.indexer.reference",
    "indexer_kernel": "ops.indexer.pallas",
    "indexer_loss": "tools.indexer_loss",
    "kernel_plan": "ops.kernel_plan",
    "long_context": "tools.long_context",
    "norms": "ops.norms",
    "overlap": "step.overlap",
    "projection_kernel": "ops.projection.pallas",
    "quantized_cache": "cache.quantized",
    "relaxed_atomics": "ops.sparse_attention.relaxed_atomics",
    "rope": "ops.rope",
    "sharding": "step.sharding",
    "sparse_attention": "ops.sparse_attention.reference",
    "sparse_attention_backward": "ops.sparse_attention.backward_triton",
    "sparse_attention_backward_wgmma": "ops.sparse_attention.backward_wgmma",
    "sparse_attention_kernel": "ops.sparse_attention.pallas",
    "split_merge_kernel": "ops.sparse_attention.split_merge_pallas",
    "validation": "layer.validation",
    "weights": "io.hf_weights",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import dsv4_jax.<old name>` gives the module in its room, unchanged (its own spec kept).
    The old names that are now folders, `dsv4_jax.cache` and `dsv4_jax.step`, hand on the names
    of the module they were (their `__getattr__`)."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{MOVED_MODULES[spec.name.rpartition('.')[2]]}")
        self._own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        # The import machinery gave the module the alias's spec: it keeps its own.
        module.__spec__ = self._own_specs.pop(module.__name__)

    _own_specs: typing.ClassVar[dict] = {}


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())

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
    "LayerOptions",
    "PageTable",
    "StepPlan",
    "YarnScaling",
    "attention_step",
    "compiler_options",
    "fork_rows",
    "indexer_kl_loss",
    "jit_modules",
    "load_attention_checkpoint",
    "load_hf_attention_weights",
    "native_info",
    "reserve_pages",
    "reset_rows",
    "rewind_rows",
]
