"""Which implementation runs each kernel-backed stage: the `kernels=` switch, as a static plan.

A layer's stages all have an XLA reference (the math, written once). Some also have kernels
that measured faster on an H200 (named below by their flat module names; `dsv4_jax.MOVED_MODULES`
gives each one's room, e.g. `compressor_kernel` is `ops.compress.pallas`):

=====================  =====================================  ==================================
stage                  kernel                                 reference
=====================  =====================================  ==================================
``select``             the native scoring + top-k handlers    `indexer.select_topk` (`lax.top_k`)
                       (XLA FFI, csrc/; see `native`)
``select_scores``      the indexer's scoring as a Pallas      the native handler's own scoring
                       kernel (`indexer_kernel`), the
                       handler's top-k after it
``decode_attention``   Pallas sparse attention, one query     `sparse_attention._xla_path`
                       per row (`sparse_attention_kernel`)
``prefill_attention``  the same kernel, many queries a row    `sparse_attention._xla_path`
``compress``           Pallas decode pooling of the           `compressor._pool`
                       compressors (`compressor_kernel`)
``attention_backward`` the sparse attention kernel's          the VJP of `sparse_attention.
                       gradient over key ranges as Mosaic     _xla_path`
                       GPU kernels (`sparse_attention_
                       backward_wgmma`: HCA), by index as
                       a CUDA handler (CSA, csrc/) or as a
                       Triton kernel
                       (`sparse_attention_backward`)
``query_norm``         the queries' per-head RMSNorm and      `norms.head_rms_norm`, then
                       RoPE as two Pallas kernels, forward    `rope.rotate_by` (and XLA's
                       and backward (`head_norm_kernel`)      gradients)
``projections``        the input and output projections of    XLA's GEMM (`backend.einsum`)
                       a few token rows as a Pallas kernel
                       (`projection_kernel`)
``split_merge``        decode attention's key splits merged   `split_merge_kernel.combine`, then
                       with the sink and de-rotated as one    `rope.apply_rope`
                       Pallas kernel (`split_merge_kernel`)
=====================  =====================================  ==================================

`kernels=` names a whole plan:

* ``"auto"`` (default): what measured faster on the platform: the native selection where it is
  built; on CUDA the Pallas kernels for the shapes they won on (`sparse_attention_kernel.
  CUDA_DEFAULT_BLOCKS`, the compressor kernel for every decode step, the indexer's scoring kernel
  for bf16 calls of several queries a row, the queries' norm and RoPE kernels for calls of
  several queries a row, the sparse attention kernel's gradient over key ranges for HCA and by index
  for the rest, the split merge's kernel for CSA decode batches of at least 16 rows); the XLA
  reference elsewhere (the projections' kernel is not a default: inside a decode step it measured
  level with XLA's products).
* ``"xla"``: every stage by its XLA reference: no native handler, no Pallas kernel.
* ``"native"``: as "auto", but the native handlers are required (an error names why they are not
  usable).
* ``"interpret"``: the Pallas kernels in Pallas' interpret mode on every backend and for every
  shape they take (tests and debugging on a CPU), the native handlers where built.

or is a `KernelPlan` for one stage at a time (A/B runs, forced block sizes). Each stage's choice:
"auto" (the measured default above), "pallas" (the kernel on CUDA for every shape it takes, the
reference on other platforms), "interpret" or "xla"; ``select``: "auto", "native" or "xla";
``select_scores``: "auto", "native", "pallas" or "interpret".

The plan is resolved once per step (`resolve`, for the step's platform) and sits in the step's
static identity (`StepPlan.kernels`, part of `StepSpec`): changing `kernels` between
calls compiles the program it names, never reuses a stale one. Nothing here is read from a
module global at trace time.

Gradients: every kernel differentiates as its reference. The compressor kernel's backward is
the XLA reference's VJP (`backend.differentiated_as`); the sparse attention kernel's is one of its
backward kernels (``attention_backward``: "auto", "triton", "wgmma", "cuda") or that VJP ("xla"). So
``jax.grad`` works with every plan, and gives the reference's gradients (up to the order of float
sums).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from dsv4_jax.backend import Array, is_tracer
from dsv4_jax.config import check_choice
from dsv4_jax.ops.indexer import pallas as indexer_pallas
from dsv4_jax.ops.sparse_attention import backward_triton, backward_wgmma, split_merge_pallas
from dsv4_jax.ops.sparse_attention import pallas as attention_pallas

KERNELS = ("auto", "xla", "native", "interpret")
STAGE_CHOICES = ("auto", "pallas", "interpret", "xla")
SELECT_CHOICES = ("auto", "native", "xla")
SCORES_CHOICES = ("auto", "native", "pallas", "interpret")
SELECT_KEYS_CHOICES = ("auto", "stored", "dequantized", "fp8")
BACKWARD_CHOICES = ("auto", "triton", "wgmma", "cuda", "xla")
PALLAS_STAGES = ("decode_attention", "prefill_attention", "compress", "query_norm", "projections", "split_merge")


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The implementation of each kernel-backed stage of a step (hashable; see the module doc).

    select:            "auto" | "native" | "xla"  the indexer's scoring + top-k
    decode_attention:  "auto" | "pallas" | "interpret" | "xla"  sparse attention, calls of up to
                       8 queries a row (a decode token, a speculative step's drafts:
                       `sparse_attention.pallas.phase_of`)
    prefill_attention: the same, for calls of more queries a row
    compress:          the same, for the compressors' decode pooling
    query_norm:        the same, for the queries' per-head RMSNorm and RoPE and their gradient
                       (`head_norm_kernel`; "auto": for calls of several queries a row)
    projections:       the same, for the input and output projections of calls of at most 64
                       token rows (`projection_kernel`; "auto": XLA's GEMMs: inside a decode
                       step on an H100 the kernel measured level with them at B = 32, slower
                       at B = 1)
    split_merge:       the same, for merging the decode attention kernel's key splits with the
                       sink and undoing the output's RoPE in one kernel (`split_merge_kernel`;
                       where that kernel splits a row's keys; "auto": the kernel for CSA calls
                       of at least 16 rows, where it measured faster, XLA's merge elsewhere:
                       `KernelPlan.merge_for`)
    attention_backward: "auto" | "triton" | "wgmma" | "cuda" | "xla"  the gradient of the sparse attention
                       kernel where it runs. "triton": its backward kernel by index
                       (`sparse_attention_backward`, where that kernel takes the shapes; interpret
                       mode where the forward is). "wgmma": the Mosaic GPU kernels over key ranges
                       where they take the call (`backward_wgmma.supports`: bf16
                       windows and HCA's entries, heads a multiple of 64; not CSA's picks;
                       interpret mode where the forward is, on a jax whose interpret mode runs
                       them), else as "triton". "cuda": CSA's calls by the CUDA handler
                       (`native.sparse_attention_backward`: a block a query row with all 64 heads
                       of 512, bf16, where the CUDA extension is built), else as "triton". "auto":
                       "wgmma" for HCA's calls on CUDA (on the H200 a 4-layer HCA training step
                       6-14% faster at B = 1 and 4, 4k and 16k, with 0.4-2.9 GB less peak memory
                       and 4-6 s more compile), "cuda" for CSA's (on an H100 a 4-layer CSA
                       training step 13-15% faster at 4k; docs/breaks_and_kernels.md, "Why the kernels' defaults"),
                       else "triton" (sliding windows, float32, interpret mode). "xla": the XLA reference's VJP
    decode_blocks, prefill_blocks: the sparse attention kernel's blocks wherever it runs for that
        phase (A/B runs): (block_keys, block_heads, num_warps, num_stages[, skip_masked_blocks]);
        None: the measured table's (`sparse_attention_kernel.CUDA_DEFAULT_BLOCKS`) where it has
        some, else `sparse_attention_kernel.FORCED_BLOCKS`.
    select_segments: blocks a query row of the native CUDA top-k takes (A/B runs): None, the
        policy `native.topk_segments` (long rows among few are cut into segments merged after);
        1, one block a row. The picks are the same for every value.
    select_keys:       "auto" | "stored" | "dequantized" | "fp8"  how the native selection reads an FP8
                       cache's indexer keys: "stored" their codes and scale bytes, decoded where
                       each key is loaded (by the handler, `native.select_topk_fp4`, or by the
                       Pallas scoring kernel, `indexer_kernel.index_scores_fp4`), "dequantized" a
                       dequantized copy (A/B runs; the same picks, bit for bit). "auto": the
                       stored form for the handler (on the H200 its selection takes 4.2x less
                       time than with the copy at B = 8, 1M), the copy for the Pallas kernel
                       (its stored-form reading, gated on the H200, made a CSA 64k prefill 1.5x
                       slower; docs/breaks_and_kernels.md, "Why the kernels' defaults").
                       "fp8": the stored form, and where the Pallas kernel scores it (on CUDA for
                       the operands `ops.indexer.pallas_fp8.supports`) with e4m3 x e4m3 dots on the
                       FP8 tensor cores (`ops.indexer.pallas_fp8`: exact for queries on the FP4 grid,
                       numerics="official"; other query rows by the bf16 dot): the same scores.
                       Not part of "auto" until measured on a GPU.
    select_scores:     "auto" | "native" | "pallas" | "interpret"  where the selection is native,
                       the scores its top-k picks from: "native" the handler's own scoring,
                       "pallas" the Pallas scoring kernel (`indexer_kernel`; on CUDA, for the
                       bf16 operands it takes, else "native"), "interpret" that kernel in
                       interpret mode. "auto": "pallas" for calls of several queries a row
                       (measured faster for prefill chunks, `indexer_kernel`), "native" for decode
                       steps.
                       An FP8 cache's keys reach the kernel as `select_keys` says (either way
                       the values of a bf16 cache's keys: the same scores, bit for bit).
    """

    select: str = "auto"
    decode_attention: str = "auto"
    prefill_attention: str = "auto"
    compress: str = "auto"
    query_norm: str = "auto"
    projections: str = "auto"
    split_merge: str = "auto"
    attention_backward: str = "auto"
    decode_blocks: tuple[int, ...] | None = None
    prefill_blocks: tuple[int, ...] | None = None
    select_segments: int | None = None
    select_keys: str = "auto"
    select_scores: str = "auto"

    def __post_init__(self):
        check_choice("kernels.select", self.select, SELECT_CHOICES)
        for stage in PALLAS_STAGES:
            check_choice(f"kernels.{stage}", getattr(self, stage), STAGE_CHOICES)
        check_choice("kernels.attention_backward", self.attention_backward, BACKWARD_CHOICES)
        check_choice("kernels.select_keys", self.select_keys, SELECT_KEYS_CHOICES)
        check_choice("kernels.select_scores", self.select_scores, SCORES_CHOICES)
        for name in ("decode_blocks", "prefill_blocks"):
            blocks = getattr(self, name)
            if blocks is None:
                continue
            if (not isinstance(blocks, tuple) or len(blocks) not in (4, 5)
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in blocks)):
                raise ValueError(f"kernels.{name}: expected (block_keys, block_heads, num_warps, num_stages"
                                 f"[, skip_masked_blocks]) as a tuple of 4 or 5 ints, got {blocks!r}")
        segments = self.select_segments
        if segments is not None and (not isinstance(segments, int) or isinstance(segments, bool) or segments < 1):
            raise ValueError(f"kernels.select_segments: expected None or an int >= 1, got {segments!r}")

    @classmethod
    def named(cls, kernels: str) -> KernelPlan:
        """The plan a `kernels=` name stands for."""
        check_choice("kernels", kernels, KERNELS)
        if kernels == "xla":
            return cls(select="xla", **{stage: "xla" for stage in PALLAS_STAGES}, attention_backward="xla")
        if kernels == "interpret":
            return cls(**{stage: "interpret" for stage in PALLAS_STAGES}, select_scores="interpret")
        return cls(select="native" if kernels == "native" else "auto")

    def resolve(self, platform: str, native_available: bool) -> KernelPlan:
        """This plan for `platform` ("cpu", "cuda", ...): "auto" selection decided by whether the
        native handlers are usable there; Pallas stages that only run on CUDA ("auto",
        "pallas") become "xla" elsewhere, and the scoring kernel ("auto", "pallas") "native".
        The result holds no "auto" selection (`select_keys` keeps its "auto": what it means
        depends on the scoring, which `scores_for` picks per call)."""
        select = self.select if self.select != "auto" else ("native" if native_available else "xla")
        stages = {}
        if platform != "cuda":
            stages = {s: "xla" for s in PALLAS_STAGES if getattr(self, s) in ("auto", "pallas")}
            if self.select_scores in ("auto", "pallas"):
                stages["select_scores"] = "native"
        return dataclasses.replace(self, select=select, **stages)

    def attention(self, phase: str) -> str:
        """The sparse attention choice for a "decode" or "prefill" call."""
        return self.decode_attention if phase == "decode" else self.prefill_attention

    def blocks(self, phase: str) -> tuple[int, ...] | None:
        return self.decode_blocks if phase == "decode" else self.prefill_blocks

    # Per call: what this (platform-resolved) plan runs for one call's shapes. The one place
    # where a stage's "auto" becomes an implementation; each kernel says what it takes
    # (`supports`), and its measured defaults are data beside it.

    def query_norm_for(self, queries: Array) -> str:
        """queries [B, S, H, D]: "auto" is the kernels for several queries a row (decode steps
        keep XLA's norm, which fuses with the rotation that follows)."""
        if self.query_norm == "auto":
            return "pallas" if queries.shape[1] > 1 else "xla"
        return self.query_norm

    def compress_for(self) -> str:
        """"auto" is the pooling kernel for every decode step (it measured faster at every batch)."""
        return "pallas" if self.compress == "auto" else self.compress

    def projections_for(self) -> str:
        """"auto" is XLA's GEMMs (inside a decode step the kernel measured level with them)."""
        return "xla" if self.projections == "auto" else self.projections

    def merge_for(self, kind: str, rows: int) -> str:
        """The split merge of a call of `rows` query rows (B * S) of a "csa", "hca" or "sliding"
        layer: "auto" is the kernel from `split_merge_pallas.AUTO_MIN_ROWS` rows on."""
        if self.split_merge != "auto":
            return self.split_merge
        return "pallas" if rows >= split_merge_pallas.AUTO_MIN_ROWS.get(kind, float("inf")) else "xla"

    def scores_for(self, queries: Array, keys: Array) -> str:
        """How a native selection of these operands scores: "pallas" (the Triton kernel, where it
        `supports` them), "interpret" or "native" (the handler's own scoring). "auto" is "pallas"
        for calls of several queries a row, else "native"."""
        choice = self.select_scores
        if choice == "auto":
            choice = "pallas" if queries.shape[1] > 1 else "native"
        if choice == "pallas" and not indexer_pallas.supports(queries, keys):
            return "native"
        return choice

    def attention_for(self, q: Array, entries: Array | None, picks: Array | None,
                      window_keys: int) -> tuple[dict, bool] | None:
        """(the sparse attention kernel's blocks, interpret mode) where this plan runs the kernel
        for q [B, S, H, D] (`window_keys`: W of the window indices), else None (the XLA path).

        "interpret": the kernel in interpret mode (any backend). "auto": on CUDA where it measured
        faster (`sparse_attention.pallas.default_blocks`, a table); "pallas": on CUDA for every
        shape the Triton kernel takes; both only where a GPU is the default backend (Pallas
        lowers Triton kernels only there; a program exported for CUDA from a CPU machine keeps
        the XLA path). The blocks: the plan's (A/B runs), else the table's, else the forced ones."""
        phase = attention_pallas.phase_of(q)
        choice = self.attention(phase)
        if choice == "xla":
            return None
        kind = "csa" if picks is not None else "hca" if entries is not None else "sliding"
        table = attention_pallas.default_blocks(kind, q.shape[0], phase, q.shape[1], q.dtype,
                                                0 if entries is None else entries.shape[1])
        if choice == "auto" and table is None:  # not a shape the kernel measured faster on
            return None
        given = self.blocks(phase)
        blocks = (attention_pallas.as_blocks(given) if given is not None
                  else attention_pallas.fit_to_window(table or attention_pallas.forced_blocks(phase, q.dtype),
                                                      window_keys))
        if choice == "interpret":
            return blocks, True
        if jax.default_backend() != "gpu" or not attention_pallas.supports(q, **blocks):
            return None
        return blocks, False

    def backward_for(self, q: Array, entries: Array | None, picks: Array | None, *, interpret: bool,
                     window_contiguous: bool) -> str:
        """The gradient of a call the sparse attention kernel runs: "wgmma" (the Mosaic GPU range
        kernels), "cuda" (CSA's CUDA handler), "triton" (the kernel by index) or "xla" (the
        reference's VJP).

        "auto": "wgmma" for HCA's calls (windows and visible entries: faster training steps on
        the H200), not in interpret mode, where they simulate warp groups (minutes a call on a
        CPU), nor for a window alone (sliding layers: not measured); "cuda" for CSA's calls the
        handler takes (a block a query row with all 64 heads: half the Triton kernel's
        key-gradient adds); else "triton". The range kernels run in interpret mode only where
        the backward runs eagerly: under a jit, XLA's CPU pool can be too small for the
        simulated warp groups that wait on each other. CSA's picks are scattered, not ranges:
        they stay with the kernels by index. docs/breaks_and_kernels.md has the measurements."""
        choice = self.attention_backward
        ranges = choice == "wgmma" or (choice == "auto" and entries is not None and not interpret)
        if (ranges and picks is None and backward_wgmma.supports(q, window_contiguous, interpret=interpret)
                and not (interpret and is_tracer(q))):
            return "wgmma"
        if choice == "xla" or not (interpret or backward_triton.supports(q, entries, picks)):
            return "xla"
        if choice in ("auto", "cuda") and not interpret and backward_triton.supports(q, entries, picks, cuda=True):
            return "cuda"
        return "triton"


def as_kernel_plan(kernels: Any) -> KernelPlan:
    """`kernels=` (a name of `KERNELS` or a `KernelPlan`) as a `KernelPlan`; `ValueError` otherwise."""
    if isinstance(kernels, KernelPlan):
        return kernels
    if isinstance(kernels, str) and kernels in KERNELS:
        return KernelPlan.named(kernels)
    raise ValueError(f"kernels: expected one of {KERNELS} or a dsv4_jax.KernelPlan, got {kernels!r}")


AUTO = KernelPlan()  # what `kernels="auto"` names before resolution
REFERENCE = KernelPlan.named("xla")  # every stage by its XLA reference
