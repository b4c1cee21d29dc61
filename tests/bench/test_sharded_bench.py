"""bench/sharded.py: the sharded layer against one device (issue 13's benchmark), on the tiny config.

The readers of the compiled program (collectives from HLO text, the thunk sequence, the
command-buffer log) on fixed text, and one small run on 2 fake CPU devices in a subprocess
(jax fixes its device count when the backend starts; a job of helpers.JOBS, started with the
session beside the in-process tests): every record equals one device, the batch mesh compiles
with no collective and the heads mesh with the output projection's all-reduce. Timings are not
asserted: they belong to the benchmark.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from helpers import JOBS, background  # noqa: E402

from bench import sharded  # noqa: E402

HLO = """
ENTRY %main {
  %p = bf16[8,1,4096]{2,1,0} parameter(0)
  %all-reduce-start = bf16[8,1,4096]{2,1,0} all-reduce-start(%p), replica_groups={{0,1}}, to_apply=%add
  %all-reduce-done = bf16[8,1,4096]{2,1,0} all-reduce-done(%all-reduce-start)
  %ar.2 = s32[4,1,512]{2,1,0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  %ag = f32[8,64]{1,0} all-gather(%y), dimensions={0}
  %ars = (bf16[32,4096]{1,0}, bf16[32,4096]{1,0}) all-reduce-start(%z), replica_groups={{0,1}}, to_apply=%add
  %not = f32[8]{0} add(%a, %b)
}
"""

THUNKS = """000: kCommandBuffer [source       | next=017 (1)]
017: kAllReduceStart    [prev=000 (1) | next=018 (1)] all-reduce-start
018: kAllReduceDone    [prev=017 (1) | next=019 (1)] all-reduce-done
019: kCommandBuffer [prev=018 (1) | sink        ]
"""

VLOG = f"""I1201 command_buffer_conversion_pass.cc:1] Module jit_x CommandBufferConfig: FUSION
{sharded.MARK} begin csa/none/sharded_decode/b8/1x2
I1201 cbcp.cc:2] Creating command buffer thunk 7 with the following thunks: kKernel, kGemm, kKernel
I1201 cbcp.cc:2] Creating command buffer thunk with the following thunks: kAllReduceStart, kKernel
{sharded.MARK} end csa/none/sharded_decode/b8/1x2
I1201 cbcp.cc:2] Creating command buffer thunk 9 with the following thunks: kKernel
"""


def test_collectives_are_read_from_the_optimized_hlo():
    found = sharded.collectives(HLO)
    assert found == {
        "all-reduce": {"count": 3, "shapes": {"bf16[8,1,4096]{2,1,0}": 1, "s32[4,1,512]{2,1,0}": 1,
                                              "(bf16[32,4096]{1,0}, bf16[32,4096]{1,0})": 1}},
        "all-gather": {"count": 1, "shapes": {"f32[8,64]{1,0}": 1}},
    }


# As XLA 0.11.2 (jax 0.11.2, H200 x2) dumps a heads-sharded decode step: the all-reduce is XLA's
# one-shot kernel, wrapped in an async start/done pair between two command buffers.
ASYNC_THUNKS = """000: kCommandBuffer [source       | next=039 (1)]
    001: kCustomKernel   [source       | next=002 (1)] loop_convert_fusion grid: [8, 1, 1]
    020: kCustomCall   [prev=019 (1)  | next=021 (1)] kCustomCall
039: kAsyncStart    [prev=000 (1) | next=000 (2)] stream=computation_stream[0], async_id=39
    040: kCollectiveKernel [source | sink] kCollectiveKernel
041: kAsyncDone     [source       | sink        ] async_id=39
000: kCommandBuffer [prev=039 (2) | sink        ]
"""

# With collectives enabled in command buffers: the all-reduce recorded into the graph.
GRAPHED_THUNKS = """000: kCommandBuffer [source       | sink]
    001: kCustomKernel   [source       | next=002 (1)] loop_convert_fusion grid: [8, 1, 1]
    002: kAsyncStart    [prev=001 (1) | next=004 (1)] stream=computation_stream[0], async_id=2
        003: kAllReduce [source | sink] kAllReduce
    004: kAsyncDone     [prev=002 (1) | sink        ] async_id=2
"""


def test_async_collectives_between_graphs_run_outside_them():
    summary = sharded.thunk_summary(ASYNC_THUNKS)
    assert summary["top_level"] == ["kCommandBuffer", "kAsyncStart", "kAsyncDone", "kCommandBuffer"]
    assert summary["command_buffers"] == 2
    assert summary["collective_kinds_outside"] == ["kCollectiveKernel"]
    assert summary["collective_thunks_inside"] == 0
    graphed = sharded.thunk_summary(GRAPHED_THUNKS)
    assert graphed["top_level"] == ["kCommandBuffer"]
    assert graphed["collective_thunks_outside"] == 0
    assert graphed["collective_kinds_inside"] == ["kAllReduce"]


def test_thunk_sequence_says_which_collectives_run_outside_the_graphs():
    summary = sharded.thunk_summary(THUNKS)
    assert summary["top_level"] == ["kCommandBuffer", "kAllReduceStart", "kAllReduceDone", "kCommandBuffer"]
    assert summary["command_buffers"] == 2
    assert summary["collective_thunks_outside"] == 2
    assert summary["collective_kinds_outside"] == ["kAllReduceDone", "kAllReduceStart"]
    assert sharded.thunk_summary("000: kCommandBuffer [source | sink]")["collective_thunks_outside"] == 0


def test_graph_contents_are_attributed_to_the_case_between_markers():
    kinds = sharded.graph_kinds(VLOG)
    assert kinds == {"csa/none/sharded_decode/b8/1x2": [["kGemm", "kKernel"], ["kAllReduceStart", "kKernel"]]}


def test_mesh_arguments():
    assert sharded.parse_mesh("2x1") == (2, 1)
    try:
        sharded.parse_mesh("2by1")
    except ValueError as e:
        assert "--meshes" in str(e)
    else:
        raise AssertionError("a bad mesh was accepted")


_ENV_2 = dict(os.environ)
_ENV_2["XLA_FLAGS"] = (_ENV_2.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
_ENV_2["JAX_PLATFORMS"] = "cpu"


@background("sharded-bench-on-2-devices", lambda workdir: [
    sys.executable, ROOT / "bench" / "sharded.py", "--size", "tiny", "--quick", "--runs", "csa:none,hca:none",
    "--batches", "2", "--prefills", "", "--json", workdir / "sharded.json"], cwd=ROOT, env=_ENV_2, timeout=600)
def test_two_fake_devices_equal_one():
    job = JOBS.by_name["sharded-bench-on-2-devices"]
    proc = job.result()
    out = job.workdir / "sharded.json"
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records = json.loads(out.read_text())["records"]
    sharded_recs = [r for r in records if r["mesh"] != "1"]
    expected = {(t, m) for t in ("CSA", "HCA") for m in ("2x1", "1x2")}
    assert {(r["layer_type"], r["mesh"]) for r in sharded_recs} == expected
    # That a sharded layer equals one device (outputs, caches, picks) and that a batch mesh's
    # decode step has no collective, test_sharding.py proves on 8 devices in every mode; here the
    # records say so (the bench's own verdict) and carry what the bench read from the program.
    for r in sharded_recs:
        assert "error" not in r, r
        assert r["within_tolerance"] and r["max_abs_diff"] <= 1e-5 * r["out_max"], r
        if r["layer_type"] == "CSA":
            assert r["picks_identical"] == 1.0
        assert r["speedup"] > 0 and r["scaling_efficiency"] == r["speedup"] / 2
        if r["mesh"] == "1x2":
            assert r["collectives"]["all-reduce"]["count"] >= 1  # the output projection's group sum
    assert "| CSA | none |" in sharded.markdown(records, json.loads(out.read_text())["meta"])
