"""bench/deviceless.py and the census it reads (bench/hlo_census.py): a step's launches by stage, its
critical path and its command buffers, from XLA's dump of a program compiled for the H200 without one.

The compile itself needs the CUDA plugin (`jax-cuda13-plugin`, no GPU): where it is not installed
(CI) that test is skipped and the rest run on synthetic dumps.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import cuda_plugin
import pytest

from bench import hlo_census

# An optimized module in XLA's dump format: a layer's input projection (a fusion whose root is
# named by the step's scope), the native selection (a custom call), a Pallas kernel, a residual
# add that names no stage; the fusion's GEMM feeds the selection, which feeds the kernel.
_ENTRY = [
    "  %hidden_states.1 = bf16[1,1,64]{2,1,0} parameter(0)",
    "  %w = bf16[64,32]{1,0} parameter(1)",
    "  %bitcast.1 = bf16[8,64]{1,0} bitcast(%hidden_states.1)",
    "  %gemm_fusion.1 = f32[8,32]{1,0} fusion(%bitcast.1, %w), kind=kCustom, calls=%fused_dot",
    "  %ffi_call.1 = (s32[1,8]{1,0}, f32[1,32]{1,0}) custom-call(%gemm_fusion.1), "
    'custom_call_target="dsv4_select_topk_graph", metadata={op_name="jit(s)/indexer_select/ffi_call"}',
    "  %get-tuple-element.1 = s32[1,8]{1,0} get-tuple-element(%ffi_call.1), index=0",
    "  %pallas_call.1 = bf16[1,64]{1,0} custom-call(%get-tuple-element.1, %bitcast.1), "
    'custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(s)/sparse_attention/pallas_call"}',
    "  %copy.1 = bf16[1,64]{1,0} copy(%hidden_states.1)",
    "  ROOT %loop_add_fusion = bf16[1,64]{1,0} fusion(%pallas_call.1, %copy.1), kind=kLoop, calls=%fused_add",
]
HLO = """HloModule jit_stack_step

%fused_dot (p0: bf16[8,64], p1: bf16[64,32]) -> f32[8,32] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  %p1 = bf16[64,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,32]{1,0} dot(%p0, %p1), metadata={op_name="jit(s)/input_projections/cond/dot"}
}

%fused_add (p0: bf16[1,64], p1: bf16[1,64]) -> bf16[1,64] {
  %p0 = bf16[1,64]{1,0} parameter(0)
  %p1 = bf16[1,64]{1,0} parameter(1)
  ROOT %add.2 = bf16[1,64]{1,0} add(%p0, %p1), metadata={op_name="jit(s)/add"}
}

ENTRY %main (hidden_states.1: bf16[1,1,64], w: bf16[64,32]) -> bf16[1,64] {
""" + "\n".join(_ENTRY) + "\n}\n"

METADATA = "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {i}\n  }}\n'
    f'  thunk_kind: "{kind}"\n}}\n'
    for i, (name, kind) in enumerate([("command_buffer_1", "kCommandBuffer"), ("gemm_fusion.1", "kCustomKernel"),
                                      ("ffi_call.1", "kCustomCall"), ("command_buffer_2", "kCommandBuffer"),
                                      ("pallas_call.1", "kCustomKernel"), ("copy.1", "kCopy"),
                                      ("loop_add_fusion", "kCustomKernel")]))

# The top level after the thunk passes: the selection left between two command buffers.
PASSES = """000: kCommandBuffer [source       | next=002 (1)]
    001: kCustomKernel [source        | sink ] gemm_fusion_1 grid: [1, 1, 1]
002: kCustomCall    [prev=000 (1) | next=000 (1)] kCustomCall
000: kCommandBuffer [prev=002 (1) | sink        ]
    003: kCustomKernel [source        | next=004 (1) ] pallas_kernel grid: [1, 1, 1]
    004: kCopy         [source        | next=005 (1) ] kCopy
    005: kCustomKernel [prev=004 (1)  | sink         ] loop_add_fusion grid: [1, 1, 1]
"""


def test_an_operation_belongs_to_the_first_stage_its_op_name_names():
    stage = hlo_census.stage_of_op_name
    assert stage("jit(stack_step)/input_projections/cond/branch_0_fun/dot_general") == "input_projections"
    assert stage("jit(stack_loss)/transpose(jvp(sparse_attention))/dot_general") == "sparse_attention (bwd)"
    assert stage("jit(stack_step)/add") is None


def test_the_stage_order_is_the_steps_named_scopes():
    """STAGE_ORDER names every `jax.named_scope` of `dsv4_jax.step.pure_step` (and "other" for the rest)."""
    source = (Path(__file__).parents[2] / "dsv4_jax" / "step" / "pure_step.py").read_text()
    scopes = set(re.findall(r'jax\.named_scope\("(\w+)"\)', source))
    assert scopes == set(hlo_census.STAGE_ORDER) - {"other"}


def test_the_census_counts_launches_by_stage_graphs_and_the_critical_path(tmp_path):
    prefix = tmp_path / "module_0001.jit_stack_step"
    Path(f"{prefix}.sm_9.0a_gpu_after_optimizations.txt").write_text(HLO)
    Path(f"{prefix}.thunk_metadata.txt").write_text(METADATA)
    Path(f"{prefix}.thunk_sequence_after_thunk_passes.txt").write_text(PASSES)
    (row,) = hlo_census.census(str(tmp_path), module="")
    # each launch by its instruction: the fusion by its root's scope, the add by none
    assert row["stages"] == {"input_projections": 1, "indexer_select": 1, "sparse_attention": 1, "other": 2}
    assert row["command_buffers"] == 2 and row["outside_command_buffers"] == {"kCustomCall": 1}
    # gemm -> selection -> kernel -> add; the copy runs beside them
    assert hlo_census.critical_path(HLO) == ["gemm_fusion.1", "ffi_call.1", "pallas_call.1", "loop_add_fusion"]
    assert row["critical_path"] == 4


def test_the_deviceless_table_shows_a_layers_launches_by_stage():
    deviceless = pytest.importorskip("bench.deviceless")
    record = {"scenario": "deviceless_decode", "layer_type": "CSA", "layers": 4, "batch": 1, "tokens": 16384,
              "launches_per_layer": 39.25, "critical_path_per_layer": 14.25, "command_buffers": 1,
              "stages_per_layer": {"sparse_attention": 5, "input_projections": 5, "other": 2}}
    table = deviceless.markdown([record])
    assert "| case | launches a layer | in a chain | graphs | input_projections | sparse_attention | other |" in table
    assert "| decode CSA x4 B=1 16384 | 39.25 | 14.25 | 1 | 5 | 5 | 2 |" in table


@pytest.mark.skipif(cuda_plugin.installed(), reason="the CUDA plugin is installed here")
def test_without_the_cuda_plugin_the_error_says_what_to_install():
    from bench import deviceless

    with pytest.raises(RuntimeError, match="jax-cuda13-plugin"):
        deviceless.target_device("h200")


@pytest.mark.skipif(not cuda_plugin.installed(), reason="needs jax's CUDA plugin (no GPU): see bench/deviceless.py")
def test_a_decode_step_compiles_for_the_h200_without_one(tmp_path):
    """The tiny CSA stack's decode step, traced as on the H200 and compiled for it (in a process
    of its own: the plugin must start with jax): one command buffer, nothing outside it, launches
    attributed to the layer's stages."""
    out = tmp_path / "census.json"
    script = Path(__file__).resolve().parents[2] / "bench" / "deviceless.py"
    subprocess.run([sys.executable, str(script), "--size", "tiny", "--stacks", "csa", "--layers", "1",
                    "--tokens", "64", "--json", str(out)], check=True, timeout=600)
    (row,) = json.loads(out.read_text())["records"]
    assert row["deviceless"] and row["launches"] > 0 and row["critical_path"] > 0
    assert row["command_buffers"] == 1 and row["outside_command_buffers"] == {}
    assert {"input_projections", "sparse_attention", "output_projection"} <= set(row["stages"])
