"""bench/loops.py: the decode loops side by side (issue 68), on the tiny config.

A smoke test of the protocol and the records (timings are not asserted: they belong to the
benchmark): every loop runs from the same caches and hidden states, and all of them compute the
same hidden states; the deadline skips cells; bad loop lists are refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import loops  # noqa: E402

FIELDS = {"loop", "stack", "batch", "context_len", "per_layer_ms", "step_ms", "step_ms_blocking", "host_dispatch_ms",
          "compile_s", "first_call_s", "floor_ms", "ratio_to_floor", "ratio_to_same_buffers",
          "max_abs_diff_to_same_buffers", "output_digest", "output_finite", "jax_version", "flax_version",
          "device", "xla_flags", "date_utc"}


def parse(*argv):
    args = loops.build_parser().parse_args(["--size", "tiny", "--stacks", "csa", "--layers-per-stack", "2", *argv])
    loops.fill_defaults(args)
    return args


def test_the_loops_compute_the_same_hidden_states_and_record_their_fields():
    written = []
    records, meta = loops.run(parse("--batches", "2", "--contexts", "32", "--steps", "2", "--repeats", "1"),
                              write=lambda recs, _: written.append(len(recs)))
    assert [r["loop"] for r in records] == list(loops.LOOPS) == meta["loops"]
    assert written == list(range(1, len(loops.LOOPS) + 1))  # the JSON is written after every record
    for r in records:
        assert r["error"] is None, r["error"]
        assert FIELDS <= set(r)
        assert (r["stack"], r["batch"], r["context_len"], r["n_layers"]) == ("csa", 2, 32, 2)
        assert r["per_layer_ms"] > 0 and r["floor_ms"] > 0 and r["compile_s"] >= 0 and r["output_finite"]
        assert r["ratio_to_floor"] is None  # on the CPU: no floor to compare with
        assert r["total_steps"] == loops.WARM + 2 * 1 + 2
        # The same computation: every loop ends on the same_buffers loop's hidden states.
        assert r["max_abs_diff_to_same_buffers"] <= 1e-5
    assert records[0]["ratio_to_same_buffers"] == 1.0
    assert "own_jit_fast" in loops.markdown(records, meta)


def test_past_the_deadline_the_cells_are_skipped():
    records, _ = loops.run(parse("--batches", "1,2", "--contexts", "32", "--deadline-s", "0",
                                 "--loops", "usual,same_buffers"))
    assert [(r["batch"], r["loop"]) for r in records] == [(1, "same_buffers"), (1, "usual"),
                                                          (2, "same_buffers"), (2, "usual")]
    assert all(r["error"] == "skipped: past --deadline-s 0 s" for r in records)
    assert "skipped" in loops.markdown(records, {})


@pytest.mark.parametrize(("names", "match"), [("usual,spin", r"--loops: expected names of .*, got \['spin'\]"),
                                              ("usual", "--loops: the ratios are to the same_buffers loop")])
def test_bad_loop_lists_are_refused(names, match):
    with pytest.raises(ValueError, match=match):
        loops.run(parse("--loops", names))


def test_cells_run_context_first_so_a_short_run_loses_the_longest_contexts_alike():
    assert loops.cells(["csa", "hca"], [1, 8], [2048, 65536])[:4] == [
        ("csa", 1, 2048), ("hca", 1, 2048), ("csa", 8, 2048), ("hca", 8, 2048)]
