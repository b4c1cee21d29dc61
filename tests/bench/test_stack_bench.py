"""bench/stack.py: N layers in one jax.jit (issue 9's stack scenario), on the tiny config.

A smoke test of the protocol and the records (timings are not asserted: they belong to the
benchmark), and of the profile's attribution of kernels to the step's named stages. The run
is a job of helpers.JOBS: a fresh process, started with the session beside the in-process tests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import helpers  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from helpers import JOBS, background  # noqa: E402

from bench import stack  # noqa: E402
from dsv4_jax.config import CSA, HCA  # noqa: E402


def test_stack_interleaves_the_configs_layer_types():
    cfg = stack.stack_config("tiny", 4)
    mixed = [cfg.layer_types[i] for i in stack.stack_layer_indices(cfg, "mixed", 4)]
    assert mixed == [CSA, HCA, CSA, HCA]
    assert {cfg.layer_types[i] for i in stack.stack_layer_indices(cfg, "csa", 4)} == {CSA}
    with pytest.raises(ValueError, match="--layers-per-stack"):
        stack.stack_layer_indices(cfg, "hca", 99)


def test_the_command_lines_kernel_switches_become_the_layers_plan():
    """A/B runs: the switches change the mode's `KernelPlan` (in each layer's static step
    identity), not module globals; --prefill-blocks reaches every prefill the kernel runs."""
    from dsv4_jax import KernelPlan

    args = stack.build_parser().parse_args(["--prefill-blocks", "32,64,4,2,0", "--no-compress-kernel",
                                            "--decode-kernel", "--projection-kernel", "--merge-kernel"])
    assert stack.kernel_plan(args) == KernelPlan(decode_attention="pallas", compress="xla", projections="pallas",
                                                 split_merge="pallas", prefill_blocks=(32, 64, 4, 2, 0))
    assert stack.kernel_plan(args, "xla") == KernelPlan(select="xla", decode_attention="pallas",
                                                        prefill_attention="xla", compress="xla",
                                                        query_norm="xla", projections="pallas",
                                                        split_merge="pallas", attention_backward="xla",
                                                        prefill_blocks=(32, 64, 4, 2, 0))
    cfg = stack.stack_config("tiny", 2)
    st = stack.Stack(cfg, "csa", 1, "float32", 0, "none", kernel_args=args)
    assert st.layers[0].kernels == stack.kernel_plan(args, "auto")
    assert st.specs[0].plan.kernels.prefill_blocks == (32, 64, 4, 2, 0)


def test_the_overlap_ab_switches_the_layers_and_the_stacks_program():
    """--overlap on,off: each job once per setting; the stack's layers and its jitted steps follow
    the setting's resolved plan (off CUDA always off: one program), and the runs of one job
    record equal output digests (the A/B's bit-for-bit check on the GPU)."""
    assert stack.build_parser().parse_args(["--overlap", "on,off"]).overlap == "on,off"
    cfg = stack.stack_config("tiny", 2)
    st = stack.Stack(cfg, "csa", 1, "float32", 0, "none", overlap="on")
    gpu = st.layers[0].step_spec().plan.overlap
    assert st.layers[0].overlap == "on" and st.overlap_active is gpu and st.jits is stack.STACK_STEPS[gpu]
    runs = {}
    for setting in ("on", "off"):
        st.set_overlap(setting)
        assert all(spec.plan.overlap is (gpu and setting == "on") for spec in st.specs)
        runs[setting] = stack.time_decode(st, 1, 16, steps=2, repeats=1, seed=0, same_buffers="all")
    assert runs["on"]["output_digest"] == runs["off"]["output_digest"]
    assert runs["on"]["temp_bytes"] >= 0


def test_fp8_caches_in_the_stack_and_its_floor():
    """--kv-cache-dtype fp8 (with --numerics official): the stack's caches are FP8, its decode
    runs, and the floor counts the FP8 bytes (less than the same run's bf16 floor)."""
    from dsv4_jax.cache.quantized import is_quantized

    args = stack.build_parser().parse_args(["--numerics", "official", "--kv-cache-dtype", "auto,fp8"])
    assert (args.numerics, args.kv_cache_dtype) == ("official", "auto,fp8")
    cfg = stack.stack_config("tiny", 2)
    st = stack.Stack(cfg, "csa", 1, "float32", 0, "none", numerics="official")
    runs = {}
    for kv in ("auto", "fp8"):
        st.kv_cache_dtype = kv
        assert is_quantized(st.empty_caches(1, 64)[0]) is (kv == "fp8")
        runs[kv] = stack.time_decode(st, 1, 16, steps=2, repeats=1, seed=0, same_buffers="all")
        assert runs[kv]["output_finite"]
    assert runs["fp8"]["floor_bytes"] < runs["auto"]["floor_bytes"]


# Through bench/run.py: the stack scenarios are handed to bench/stack.py.
@background("stack bench", lambda workdir: [
    sys.executable, ROOT / "bench" / "run.py", "--size", "tiny", "--scenarios", "stack_decode,stack_prefill",
    "--stacks", "mixed", "--profile", "1:256", "--profile-steps", "2", "--profile-dir", workdir / "prof",
    "--json", workdir / "stack.json"], cwd=ROOT, timeout=900)
def test_stack_run_writes_records_and_a_profile_by_stage():
    job = JOBS.by_name["stack bench"]
    proc = job.result()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    data = json.loads((job.workdir / "stack.json").read_text())
    records = data["records"]
    assert {r["scenario"] for r in records} == {"stack_decode", "stack_prefill"}
    for r in records:
        assert r["error"] is None
        assert r["layer_type"] == "CSA+HCA" and r["n_layers"] == 4
        assert r["per_layer_ms"] > 0 and r["compile_s"] >= 0 and r["output_finite"]
        assert r["per_layer_ms"] == pytest.approx(r["step_ms"] / 4)
        assert r["floor_ms"] > 0
    decode = next(r for r in records if r["scenario"] == "stack_decode")
    assert decode["context_len"] == 256 and decode["step_ms_blocking"] > 0
    # The dispatch loop is part of each timed repeat, so its median cannot exceed the step's.
    assert 0 < decode["host_dispatch_ms"] <= decode["step_ms"]
    (prof,) = data["meta"]["profiles"]
    assert prof["busy_us_per_step"] > 0 and prof["rows"]
    # The host's side of the traced steps: XLA's execute events, per step.
    assert any("Execute" in e["event"] and e["per_step"] >= 1 for e in prof["host_events"])
    stages = {row["source"] for row in prof["by_source"]}
    # The stages are jax.named_scopes of attention_step: the profile can name them.
    assert {"sparse_attention", "compressor", "indexer_select"} <= stages
    assert "stack_decode" in stack.markdown(records, data["meta"])


def test_the_hlo_census_reads_copies_conditionals_and_thunks(tmp_path):
    """`bench/hlo_census.py` on a dump: which stack case a module is, the entry computation's
    copies and what they copy, conditionals, custom calls and (GPU) thunks by kind."""
    from bench import hlo_census

    hlo = """HloModule jit_stack_step
%branch (p: f32[2]) -> f32[2] {
  %copy.9 = f32[2]{0} copy(%p)
}

ENTRY %main (hidden_states.1: bf16[32,1,64], caches_0__length.1: s32[32]) -> s32[32] {
  %hidden_states.1 = bf16[32,1,64]{2,1,0} parameter(0)
  %copy.3 = s32[32]{0} copy(%caches_0__length.1), metadata={scheduling_name="copy.3"}
  %input_scatter_fusion.2 = bf16[32,8,4]{2,1,0} fusion(%caches_0__window.1, %i, %u), kind=kInput
  %loop_dynamic_update_slice_fusion.1 = bf16[32,8,4]{2,1,0} fusion(%caches_0__ring.1, %i, %u), kind=kLoop
  %cond = (f32[2]) conditional(%pred, %a, %b), branch_computations={%branch, %branch}
  %cc = f32[2] custom-call(%x), custom_call_target="dsv4_topk"
}
"""
    thunks = """001: kCustomKernel [source | next=002 (1) ] loop_fusion grid: [1, 1, 1]
002: kCopy         [prev=001 (1) | sink ] kCopy
003: kConditional  [source | sink ]
  false_branch:
    004: kCustomKernel [source | sink] loop_broadcast_fusion grid: [1, 1, 1]
"""
    (tmp_path / "module_0001.jit_stack_step.sm_9.0a_gpu_after_optimizations.txt").write_text(hlo)
    (tmp_path / "module_0001.jit_stack_step.thunk_sequence.txt").write_text(thunks)
    (tmp_path / "module_0002.jit_other.sm_9.0a_gpu_after_optimizations.txt").write_text(hlo)
    rows = hlo_census.census(str(tmp_path))
    assert len(rows) == 1
    row = rows[0]
    assert row["module"] == "module_0001.jit_stack_step" and row["batch"] == 32 and row["tokens"] == 1
    assert row["copies"] == [{"name": "copy.3", "shape": "s32[32]{0}", "of": "caches_0__length.1"}]  # entry only
    assert row["conditionals"] == 1 and row["custom_calls"] == 1 and row["scatters"] == 2  # the cache writes
    assert row["thunks"] == {"kCustomKernel": 2, "kCopy": 1, "kConditional": 1}
    assert "| module_0001.jit_stack_step | bf16[32, 1, 64] | 1 | 2 | 1 | 1 |" in hlo_census.markdown(rows)


def test_the_profile_describes_kernels_without_a_source():
    """`bench/kernel_profile.py`: a kernel whose instruction carries no op_name (one XLA made,
    e.g. of a rewritten scatter) is described by its shape, opcode and operands (`hlo`)."""
    from bench import kernel_profile

    hlo = "\n".join([
        "ENTRY %main (caches_0__window.1: bf16[1,8,4], length: s32[1]) -> bf16[1,1,4] {",
        "  %loop_dynamic_slice_fusion.3 = bf16[1,1,4]{2,1,0} fusion(%caches_0__window.1, %length), kind=kLoop",
        '  %gemm_fusion_dot.1 = bf16[1,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%g, '
        'metadata={op_name="jit(stack_step)/wq_b_kv_insert/dot_general"}',
        "}",
    ])
    summary = {"rows": [{"op": "loop_dynamic_slice_fusion_3", "us_per_step": 1.0, "kernels_per_step": 1.0},
                        {"op": "gemm_fusion_dot_1", "us_per_step": 9.0, "kernels_per_step": 1.0}],
               "busy_us_per_step": 10.0, "kernels_per_step": 2.0}
    kernel_profile.attach_sources(summary, hlo)
    sliced, gemm = summary["rows"]
    assert sliced["source"] == "" and sliced["hlo"] == "bf16[1,1,4] fusion(caches_0__window.1, length)"
    assert gemm["source"] == "jit(stack_step)/wq_b_kv_insert/dot_general" and "hlo" not in gemm
    table = kernel_profile.markdown(summary)
    assert "hlo: bf16[1,1,4] fusion(caches_0__window.1, length)" in table and "wq_b_kv_insert" in table


def test_the_call_overhead_times_every_finite_check_way(monkeypatch):
    """`call_overhead`: the module call with each finite-check mode and with the verdict by the
    step's flag, against the jitted step, on equal layers and inputs (the same outputs); the
    CPU's arrays taken for device-resident ones, so that the guard and the flag both run."""
    from dsv4_jax.layer import validation
    from dsv4_jax.step import finite_flag

    monkeypatch.setattr(validation, "_host_resident", lambda value: False)
    rec = stack.call_overhead("tiny", jnp.float32, steps=2, repeats=1, seed=0)
    assert rec["scenario"] == "call_overhead" and rec["samples"] == 2 and rec["max_abs_diff"] == 0.0
    for key in ("module_call_ms", "jit_step_ms", "module_call_host_check_ms", "module_call_no_check_ms",
                "module_call_flag_ms"):
        assert rec[key] > 0
    assert rec["flag_words"] == (2 if helpers.NATIVE_BUILT else 0)
    assert rec["finite_verdict_auto"] == finite_flag.AUTO and finite_flag.VERDICT == "auto"
    assert "the verdict by the step's flag" in stack.markdown([rec], {})
