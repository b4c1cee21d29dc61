"""Independent stages side by side: the parallel half of vLLM PR #45309, through XLA.

In graph mode the PR runs `wq_b_kv_insert` and the compressor on an auxiliary CUDA stream
(`maybe_execute_in_parallel`; serial where there is none, e.g. ROCm), then the indexer as the one
eager break. Here a step's stages (the query path with `wq_b_kv_insert`, the compressors, the
indexer's queries and keys, then the selection, then sparse attention) are one XLA program, and
on CUDA XLA runs most of it as a command buffer (a CUDA graph). How that graph is built is
XLA's `xla_gpu_command_buffer_scheduling_mode`:

* ``"LHS"`` (XLA's default): the commands in the order of XLA's schedule, one after another;
* ``"CONCURRENT"``: graph edges only where buffers conflict (a read after a write, a write
  after a read or write), so kernels with no data between them, e.g. the compressors and the
  query projection, may run at the same time on the GPU.

The order of the work within each kernel, and the data every kernel reads, are the same in both
modes, so the results are identical, bit for bit (the GPU gate compares them). With the
device break (``break_on="device"``, `breaks`) the native selection is not command-buffer
compatible: XLA closes the graph before it and opens one after it, so the order is the PR's:
the graph of both branches (concurrent inside), the indexer's eager break, then sparse
attention and the output projection.

`overlap` (the layer's option, resolved into the step's plan, `StepPlan.overlap`):

* ``"auto"`` (default): on where it measured faster (CUDA; docs/breaks_and_kernels.md, "Why the kernels' defaults"), off
  elsewhere;
* ``"on"``: CONCURRENT on CUDA; other platforms have no such schedule and run as "off";
* ``"off"``: XLA's schedule as the process has it (LHS unless ``XLA_FLAGS`` says otherwise).

The option is a compile option of the layer's own compiled step (`compiler_options`, given to
its `jax.jit`); a step traced inside *your* `jax.jit` is compiled with your jit's options, so
pass them there: ``jax.jit(f, compiler_options=dsv4_jax.compiler_options())``. The process-wide
equivalent is ``XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`` (set before jax
starts; a compile option given to a jit takes precedence over it for that program).
"""

from __future__ import annotations

from typing import Any

from dsv4_jax.config import check_choice

OVERLAP_CHOICES = ("auto", "on", "off")
SCHEDULING_OPTION = "xla_gpu_command_buffer_scheduling_mode"
# Where "auto" turns the overlap on: the platforms it measured faster on (see the module docstring).
AUTO_ON = ("cuda",)


def check_overlap(overlap: Any) -> str:
    """`overlap` if it is one of `OVERLAP_CHOICES`, else a ValueError naming the argument."""
    return check_choice("overlap", overlap, OVERLAP_CHOICES)


def resolve(overlap: str, platform: str) -> bool:
    """Whether a step on `platform` ("cpu", "cuda", ...) runs with the overlap: "on" and "auto"
    on CUDA ("auto" where it measured faster, `AUTO_ON`); never elsewhere (no concurrent
    command buffers there: one program for every setting)."""
    check_overlap(overlap)
    if platform != "cuda":
        return False
    return overlap == "on" or (overlap == "auto" and platform in AUTO_ON)


def compiler_options(overlap: bool | str = "auto", platform: str | None = None, *,
                     deterministic: bool = False) -> dict[str, Any]:
    """The XLA compile options of a step with or without the overlap (a `resolve`d bool, or a
    setting of `OVERLAP_CHOICES` resolved for `platform`, default jax's default backend), for
    ``jax.jit(..., compiler_options=...)``: CONCURRENT command buffers, or nothing (the
    process's schedule; a jit without options may also be nested in another jit, which JAX
    refuses for a jit with options).

    deterministic: on CUDA, also XLA's `DETERMINISTIC_OPTIONS` (run-to-run identical results:
    no atomics-based reductions or scatters, no autotuning that may pick another algorithm
    from one compile to the next), at some cost in speed; other platforms add nothing (their
    XLA code is deterministic already). The layer's own step compiles without them: pass these
    options to your own `jax.jit` around the layer, or set the same flags in ``XLA_FLAGS``."""
    if platform is None and (isinstance(overlap, str) or deterministic):
        import jax

        from dsv4_jax.native import platform_name

        platform = platform_name(jax.default_backend())
    if isinstance(overlap, str):
        overlap = resolve(overlap, platform)
    options = {SCHEDULING_OPTION: "CONCURRENT"} if overlap else {}
    if deterministic and platform == "cuda":
        options.update(DETERMINISTIC_OPTIONS)
    return options


# XLA's debug options for run-to-run reproducible GPU programs (`compiler_options(deterministic=True)`):
# deterministic implementations of the ops that have one (scatter, reductions), and no autotuning,
# whose choice of GEMM / convolution algorithm may differ from one compile to the next.
DETERMINISTIC_OPTIONS = {"xla_gpu_deterministic_ops": True, "xla_gpu_autotune_level": 0}
