"""Every kernel compiles for the H200, on a machine without one (`bench/deviceless.py`).

The Pallas kernels run as Triton programs only on a GPU, so the CPU suite checks their math in
interpret mode but never their compilation: block shapes Triton rejects, shared memory past the
H200's 227 KiB, a dot dimension under 16, a custom call XLA leaves out of the step's CUDA graph.
Here each step is traced as on the H200 (its kernel plan forced to every kernel), compiled for it
through XLA's compile-only CUDA topology (Triton and ptxas run) and read back from XLA's dump.

Needs jax's CUDA plugin (`jax-cuda13-plugin` and `jax-cuda13-pjrt` of jax's version; no GPU) and
JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 when jax starts: CI's deviceless stage (.ci/run). Elsewhere the
file skips.
"""

from __future__ import annotations

import dataclasses
import functools

import cuda_plugin
import pytest

import dsv4_jax
from dsv4_jax import KernelPlan

pytestmark = pytest.mark.skipif(not cuda_plugin.installed(),
                                reason="needs jax's CUDA plugin (no GPU): see bench/deviceless.py")

# The CUDA handlers (csrc/), built where nvcc was found at install.
NATIVE_CUDA = dsv4_jax.native_info()["cuda"]["built"]
# Every Pallas kernel, and the native selection where it is built, wherever the step can take them.
EVERY_KERNEL = KernelPlan(select="native" if NATIVE_CUDA else "xla", decode_attention="pallas",
                          prefill_attention="pallas", compress="pallas", query_norm="pallas", projections="pallas",
                          split_merge="pallas", select_scores="pallas")


@functools.cache  # a case compiles once for the tests that read it
def _census(scenario, stack, batch, tokens, size="small", **case):
    from bench import deviceless

    return deviceless.census(deviceless.Case(scenario, stack, batch, tokens, layers=1, size=size, **case))


@pytest.mark.parametrize("stack", ["csa", "hca"])
@pytest.mark.parametrize("batch", [1, 4])
def test_a_decode_step_is_one_cuda_graph_with_every_kernel(stack, batch):
    """Decode with the attention kernel, the compressors' pooling kernel and (CSA) the native
    selection: compiled, and all of it inside one command buffer (nothing left between graphs)."""
    row = _census("decode", stack, batch, 256, kernels=EVERY_KERNEL)
    assert row["command_buffers"] == 1 and row["outside_command_buffers"] == {}
    assert row["triton_calls"] >= (3 if stack == "csa" else 2)  # attention + one pooling per compressor
    assert row["native_calls"] == (1 if stack == "csa" and NATIVE_CUDA else 0)


@pytest.mark.parametrize("stack, queries", [("csa", 1), ("hca", 4)])
def test_a_paged_decode_step_is_one_cuda_graph_with_every_kernel(stack, queries):
    """A paged cache (pages of 256 tokens; `dsv4_jax.cache.paged`): the attention kernel reads the
    pool in place by the entries' pool rows; a decode step and a 4-token verification step
    compile with every kernel, all of it inside one command buffer."""
    row = _census("decode", stack, 4, 2048, kernels=EVERY_KERNEL, page_size=256, queries=queries)
    assert row["command_buffers"] == 1 and row["outside_command_buffers"] == {}
    assert row["triton_calls"] >= (3 if stack == "csa" else 2)


@pytest.mark.skipif(not NATIVE_CUDA, reason="the CUDA handlers are not built (no nvcc at install)")
def test_the_finite_flag_stays_inside_the_cuda_graph():
    """The module call's flag (`dsv4_jax.step.finite_flag`): its custom call is a node of the step's graph."""
    row = _census("decode", "csa", 1, 256, kernels=EVERY_KERNEL, finite_flag=True)
    assert row["command_buffers"] == 1 and row["outside_command_buffers"] == {}
    assert row["native_calls"] == 2  # the selection and the flag


@pytest.mark.parametrize("stack", ["csa", "hca"])
def test_a_prefill_step_compiles_with_every_kernel(stack):
    """Prefill: the attention kernel for many queries a row, the queries' norm kernel and (CSA)
    the indexer's Pallas scoring before the native top-k."""
    row = _census("prefill", stack, 1, 256, kernels=EVERY_KERNEL)
    assert row["triton_calls"] >= (3 if stack == "csa" else 2)


def test_a_training_step_compiles_with_the_backward_kernel():
    """value_and_grad of a CSA layer: the attention kernel's backward, the norm kernels' backward."""
    forward = _census("prefill", "csa", 1, 256, kernels=EVERY_KERNEL)
    row = _census("train", "csa", 1, 256, kernels=EVERY_KERNEL)
    assert any(stage.endswith("(bwd)") for stage in row["stages"])
    assert row["triton_calls"] > forward["triton_calls"]  # the backward kernels


def test_the_backward_kernel_compiles_at_v4_flash_size():
    """V4-Flash's 64 heads x 512: the sizes whose blocks fill the H200's shared memory (the Triton
    backward kernel forced: CSA's calls default to the CUDA handler where it is built)."""
    row = _census("train", "csa", 1, 512, size="flash",
                  kernels=dataclasses.replace(EVERY_KERNEL, attention_backward="triton"))
    assert row["triton_calls"] > 0 and any(stage.endswith("(bwd)") for stage in row["stages"])


@pytest.mark.skipif(not NATIVE_CUDA, reason="the CUDA handlers are not built (no nvcc at install)")
@pytest.mark.parametrize("backward", ["auto", "cuda"])
def test_csas_backward_handler_stays_inside_the_training_graph(backward):
    """CSA's sparse attention backward by the CUDA handler (`attention_backward="auto"` or "cuda"
    at V4-Flash size): one custom call in place of the Triton backward kernel, a node of the
    training step's CUDA graphs (command-buffer compatible, its accumulators zeroed inside)."""
    row = _census("train", "csa", 1, 512, size="flash",
                  kernels=dataclasses.replace(EVERY_KERNEL, attention_backward=backward))
    by_triton = _census("train", "csa", 1, 512, size="flash",
                        kernels=dataclasses.replace(EVERY_KERNEL, attention_backward="triton"))
    assert row["custom_call_targets"].get("dsv4_sparse_attention_backward", 0) == 1
    assert "dsv4_sparse_attention_backward" not in by_triton["custom_call_targets"]
    assert row["triton_calls"] == by_triton["triton_calls"] - 1
    assert row["outside_command_buffers"] == {}


@pytest.mark.parametrize("backward", ["auto", "wgmma"])
@pytest.mark.parametrize("stack, range_kernels", [("hca", 2), ("csa", 0)])
def test_the_range_backward_compiles_at_v4_flash_size(stack, range_kernels, backward):
    """The Mosaic GPU range kernels (`sparse_attention_backward_wgmma`: dq, and in one launch dK of
    the window and of HCA's entries) in the training step beside the Triton kernels, for HCA's
    calls under ``attention_backward="auto"`` and "wgmma"; CSA's calls (scattered picks) stay with
    the Triton backward kernel under "wgmma" (under "auto" the CUDA handler takes them where it
    is built), as every call does under "triton"."""
    row = _census("train", stack, 1, 512, size="flash",
                  kernels=dataclasses.replace(EVERY_KERNEL, attention_backward=backward))
    by_index = _census("train", stack, 1, 512, size="flash",
                       kernels=dataclasses.replace(EVERY_KERNEL, attention_backward="triton"))
    assert row["custom_call_targets"].get("mosaic_gpu_v2", 0) == range_kernels
    assert by_index["custom_call_targets"].get("mosaic_gpu_v2", 0) == 0
    by_handler = stack == "csa" and backward == "auto" and NATIVE_CUDA  # CSA's "auto": the CUDA handler
    assert row["triton_calls"] == by_index["triton_calls"] - (stack == "hca") - by_handler


@pytest.mark.parametrize("stack, batch", [("csa", 1), ("csa", 16), ("hca", 1)])
def test_the_default_decode_blocks_compile_at_v4_flash_size(stack, batch):
    """The default plan's decode kernels at V4-Flash size, with the blocks of
    `sparse_attention_kernel.CUDA_DEFAULT_BLOCKS` where the kernel is the default (one-row
    decode; CSA batches from `MIN_ROWS` rows: 64 heads x 64 keys a program in bf16)."""
    row = _census("decode", stack, batch, 256, size="flash")
    assert row["command_buffers"] == 1 and row["outside_command_buffers"] == {}
    assert row["triton_calls"] >= (3 if stack == "csa" else 2)  # attention + one pooling per compressor


@pytest.mark.parametrize("kernel", ["dq", "dkv"])
def test_the_range_kernels_keep_their_registers(kernel, tmp_path, monkeypatch):
    """The range backward's kernels at V4-Flash size compile without spilling registers (ptxas's
    report, through Mosaic GPU's dump): a [64, 512] wgmma operand takes 32 descriptors of 64 bits,
    and hoisted out of the loops they spilled 700-820 bytes a thread (`_opaque_zero`)."""
    import jax
    import jax.numpy as jnp

    from bench import deviceless
    from dsv4_jax.ops.sparse_attention import backward_wgmma as sabw

    if not sabw.supports(jnp.zeros((1, 2, 64, 128), jnp.bfloat16), True):
        pytest.skip("no Mosaic GPU Pallas API in this jax")
    monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")
    device = deviceless.target_device("h200")
    rows, h, d, n = 256, 64, 512, 512

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))

    args = (arg((rows, h, d), jnp.bfloat16), arg((8, rows, h // 8, d), jnp.bfloat16), arg((rows, h), jnp.float32),
            arg((rows, h), jnp.float32), arg((n, d), jnp.bfloat16), arg((rows, sabw.SCALARS), jnp.int32))
    if kernel == "dq":
        fn = lambda q, do, lse, delta, src, ranges: sabw.dq_of(q, do, lse, delta, [src], ranges)  # noqa: E731
    else:
        fn = lambda q, do, lse, delta, src, ranges: sabw.dkv_of(q, do, lse, delta, [src, src], ranges,  # noqa: E731
                                                                splits=[2, 3])
    with deviceless.pretend_gpu():
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compile()
    reports = [p.read_text() for p in tmp_path.rglob("*ptxas*")]
    assert reports, f"no ptxas report in {sorted(p.name for p in tmp_path.iterdir())}"
    assert "0 bytes spill stores, 0 bytes spill loads" in reports[-1], reports[-1]


def test_the_projection_kernel_compiles_at_flash_size_in_a_batchs_decode_step():
    """V4-Flash CSA decode at B = 32 with `KernelPlan(projections="pallas")`: the kernel's own blocks
    ((64, 128) for wo_a, (32, 256) for wo_b and the fused input projections) through Triton and
    ptxas, inside the step's one CUDA graph; the output projection is 2 launches, not XLA's 4
    (each GEMM's split-K sum after it)."""
    base = _census("decode", "csa", 32, 16384, size="flash")
    row = _census("decode", "csa", 32, 16384, size="flash", kernels=KernelPlan(projections="pallas"))
    assert row["command_buffers"] == 1 and row["outside_command_buffers"] == {}
    assert row["triton_calls"] == base["triton_calls"] + 3  # input projections, wo_a, wo_b
    assert row["stages_per_layer"]["output_projection"] == 2 < base["stages_per_layer"]["output_projection"]


@pytest.mark.parametrize("batch", [1, 32])
def test_the_split_merge_kernel_shortens_a_decode_steps_chain(batch):
    """V4-Flash CSA decode where the attention kernel splits each row's keys (B = 1: 32 splits;
    B = 32: 4) with `KernelPlan(split_merge="pallas")`: the splits' merge, the sink and the inverse
    RoPE as one Triton kernel inside the step's CUDA graph, in place of XLA's two to four
    kernels one after another (fewer launches on the critical path)."""
    base = _census("decode", "csa", batch, 16384, size="flash", kernels=KernelPlan(split_merge="xla"))
    row = _census("decode", "csa", batch, 16384, size="flash", kernels=KernelPlan(split_merge="pallas"))
    if batch == 32:  # "auto" takes the kernel for CSA batches (split_merge_kernel.AUTO_MIN_ROWS)
        assert _census("decode", "csa", batch, 16384, size="flash")["triton_calls"] == row["triton_calls"]
    assert row["command_buffers"] == 1 and row["outside_command_buffers"] == {}
    assert row["triton_calls"] == base["triton_calls"] + 1
    assert row["stages_per_layer"]["sparse_attention"] < base["stages_per_layer"]["sparse_attention"]
    assert row["critical_path_per_layer"] < base["critical_path_per_layer"]


@pytest.mark.parametrize("layer", [1, 2], ids=["csa", "hca"])
def test_a_short_window_prefill_compiles_at_v4_flash_heads(layer):
    """64 heads of 512 in bf16 with a 32-key window (V4's is 128): the default plan's prefill
    kernel blocks are fitted to a window of one key block (`sparse_attention_kernel.fit_to_window`),
    whose 64-key blocks asked for 262,656 bytes of shared memory, past the H200's 232,448."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from helpers import FLASH_HEADS_CFG as cfg
    from helpers import random_layer

    from bench import deviceless

    device = deviceless.target_device("h200")
    with deviceless.pretend_gpu():
        attn = random_layer(cfg, layer, break_mode="none", dtype=jnp.bfloat16)
        cache = attn.init_cache(1, 320).replace(layer_idx=-1)
        args = deviceless._abstract((attn.weights(), cache.replace(length=np.asarray(cache.length))), device)
        hidden = jax.ShapeDtypeStruct((1, 256, cfg.hidden_size), jnp.bfloat16,
                                      sharding=jax.sharding.SingleDeviceSharding(device))
        step = jax.jit(lambda w, c, x: dsv4_jax.attention_step(w, c, x, None, attn.step_spec())[0])
        lowered = step.trace(args[0], args[1], hidden).lower(lowering_platforms=("cuda",))
    assert "sparse_attention_kernel" in lowered.as_text()
    lowered.compile()  # raised RESOURCE_EXHAUSTED before the blocks were fitted
