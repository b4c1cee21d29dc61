"""The layer's options: one frozen dataclass that the constructor, the step's memo key and the
call path all read.

`DeepseekV4Attention(cfg, layer_idx, rngs=..., **options)` takes these fields by name; each is
also an attribute of the layer that may be changed between calls (``attn.break_mode = "none"``
replaces ``attn.options`` with a checked copy, and the next call compiles the step it names).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from dsv4_jax import numerics as numerics_mod
from dsv4_jax.backend import QUERY_BLOCK
from dsv4_jax.layer import validation
from dsv4_jax.ops.kernel_plan import KernelPlan
from dsv4_jax.step import overlap as overlap_mod
from dsv4_jax.step import sharding
from dsv4_jax.step.plan import check_break_mode, check_break_on, check_kernels


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    """How a `DeepseekV4Attention` layer runs (hashable: a static part of the module).

    break_mode:   "narrow" (default; the indexer's scoring + top-k in a break), "none" (no
                  break) or "wide" (wq_b_kv_insert + compressors + indexer on the host). Same
                  picks and outputs in every mode; each mode compiles once.
    break_on:     where the narrow break runs: "device" (a native XLA FFI custom call on the
                  step's device, an eager break that never leaves it), "host" (a
                  `jax.pure_callback` into NumPy) or "auto" (default: "device" where the native
                  handlers are built for the platform, see `dsv4_jax.native_info()`, else
                  "host"). The wide break is always on the host.
    kernels:      "auto" (default: native handlers where built; with break_mode="none" the
                  selection then runs the graph-compatible native handler, no break), "native"
                  (require them), "xla" (XLA reference ops only, e.g. `lax.top_k`),
                  "interpret" (the Pallas kernels in interpret mode), or a `KernelPlan` for one
                  stage at a time (`dsv4_jax.ops.kernel_plan`).
    dtype:        compute dtype; None (default) = `param_dtype`: a bf16 layer computes in bf16
                  and casts float32 inputs to bf16 (its cache and output are bf16); a float32
                  layer computes bf16 inputs in float32. (flax's `nnx.Linear` promotes instead;
                  here the cache's dtype must be known before the first input is seen, so the
                  layer alone decides.) Set it to compute in another dtype than the weights,
                  e.g. ``dtype=jnp.float32`` with bf16 weights.
    param_dtype:  dtype of the projection weights (default float32). Norm weights, sinks and
                  position biases stay float32, as the reference keeps them.
    precision:    `jax.lax.Precision` of the matmuls. None (default) means HIGHEST for a float32
                  compute dtype (true float32 on GPUs too, where XLA's default would use TF32)
                  and the backend default for bf16.
    query_block:  queries processed at a time by the indexer scoring and sparse attention
                  (bounds the memory of long prefills).
    donate_cache: donate the input cache's buffers to the step (in-place updates; the cache
                  passed in becomes unusable after a successful call).
    check_finite: reject NaN/inf in `hidden_states`: True (every concrete input; an accelerator
                  array inside the step, its verdict read after it, or before dispatch with a
                  device sync where the cache is donated), "host" (NumPy inputs only), False
                  (none: NaN reaches the output and the cache). None (default):
                  `dsv4_jax.layer.validation.CHECK_FINITE`, which is True.
    checkify:     False (default) or True: under your own `jax.jit`, where the value checks
                  cannot run on the host, put them into the step as
                  `jax.experimental.checkify.check`s (each row's positions continue its length,
                  padding only after a row's real tokens, room left; messages as the eager
                  ones). Then wrap your function in `checkify.checkify`
                  (``jax.jit(checkify.checkify(f))``) and call ``err.throw()``. Eager calls are
                  checked on the host and run the usual step either way.
    sharding_rules: (logical axis, mesh axis or None) pairs overriding
                  `dsv4_jax.step.sharding.LOGICAL_AXIS_RULES` (None: the defaults).
    numerics:     "reference" (default: Hugging Face transformers' numerics, exactly) or
                  "official" (DeepSeek's own inference: the window and compressed KV on an FP8
                  grid, the indexer's queries and keys Hadamard-rotated onto an FP4 grid;
                  docs/numerics.md). The same in every break mode and on every device.
    overlap:      "auto" (default), "on" or "off": the step's independent stages (the query path
                  with wq_b_kv_insert, the compressors, the indexer's queries and keys) may run
                  side by side on the GPU (XLA's concurrent command buffers, the parallel half of
                  vLLM PR #45309; `dsv4_jax.step.overlap`). Identical results; "auto" is on
                  where it measured faster (CUDA). No effect off CUDA, nor on a step traced
                  inside your own `jax.jit` (give that jit
                  ``compiler_options=dsv4_jax.compiler_options()``).
    deterministic: False (default) or True: on CUDA, compile the layer's steps with XLA's options
                  for run-to-run identical programs (no autotuning, deterministic scatters and
                  reductions; `dsv4_jax.step.overlap.DETERMINISTIC_OPTIONS`): the same bits in
                  every process on the same GPU and software, at a cost in speed that
                  docs/misuse.md gives. No effect off CUDA (XLA's CPU code is deterministic), nor
                  on a step traced inside your own `jax.jit` (give that jit
                  ``compiler_options=dsv4_jax.compiler_options(deterministic=True)``).
    """

    break_mode: str = "narrow"
    break_on: str = "auto"
    kernels: str | KernelPlan = "auto"
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    query_block: int = QUERY_BLOCK
    donate_cache: bool = False
    check_finite: bool | str | None = None
    checkify: bool = False
    sharding_rules: tuple | None = None
    numerics: str = "reference"
    overlap: str = "auto"
    deterministic: bool = False

    def __post_init__(self):
        # Every option checked and normalised here, the one place: a ValueError/TypeError names it.
        checked = {
            "break_mode": check_break_mode(self.break_mode),
            "break_on": check_break_on(self.break_on),
            "kernels": check_kernels(self.kernels),
            "dtype": validation.check_float_dtype("dtype", self.dtype, allow_none=True),
            "param_dtype": validation.check_float_dtype("param_dtype", self.param_dtype),
            "donate_cache": bool(self.donate_cache),
            "checkify": bool(self.checkify),
            "sharding_rules": (None if self.sharding_rules is None or self.sharding_rules is sharding.LOGICAL_AXIS_RULES
                               else sharding.check_rules(self.sharding_rules)),
            "numerics": numerics_mod.check_numerics(self.numerics),
            "overlap": overlap_mod.check_overlap(self.overlap),
        }
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"deterministic: expected True or False, got {self.deterministic!r}")
        query_block = self.query_block
        if isinstance(query_block, bool) or not isinstance(query_block, int) or query_block < 1:
            raise ValueError(f"query_block: expected a positive int, got {query_block!r}")
        validation.check_finite_mode(self.check_finite)
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def compute_dtype(self):
        """The dtype the layer computes in (and its cache holds): `dtype`, else `param_dtype`."""
        return jnp.dtype(self.dtype if self.dtype is not None else self.param_dtype)


OPTION_NAMES = tuple(field.name for field in dataclasses.fields(LayerOptions))


def option_property(name: str) -> property:
    """``layer.<name>``: reads ``layer.options``; setting it replaces them with a checked copy."""

    def get(layer):
        return getattr(layer.options, name)

    def set_(layer, value):
        layer.options = dataclasses.replace(layer.options, **{name: value})

    return property(get, set_, doc=f"`LayerOptions.{name}` of this layer (settable).")
