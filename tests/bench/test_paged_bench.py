"""bench/paged.py: paged caches against contiguous ones, S tokens a row against one (issue 67),
on the tiny config.

A smoke test of the protocol and the records (timings are not asserted: they belong to the
benchmark): both caches decode from the same values, so they compute the same hidden states bit
for bit; the S-token cells run beside the one-token ones; the deadline skips cells; the records
make RESULTS.md's rows (`results_table.paged`).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import paged, results_table  # noqa: E402

FIELDS = {"cache", "queries_per_step", "stack", "batch", "context_len", "page_size", "per_layer_ms", "step_ms",
          "step_ms_blocking", "host_dispatch_ms", "compile_s", "first_call_s", "floor_ms", "ratio_to_floor",
          "ratio_to_contiguous", "ratio_to_one_query", "max_abs_diff_to_contiguous", "output_digest",
          "output_finite", "jax_version", "device", "date_utc"}


def parse(*argv):
    args = paged.build_parser().parse_args(["--size", "tiny", "--stacks", "hca", "--layers-per-stack", "2", *argv])
    paged.fill_defaults(args)
    return args


def test_paged_and_contiguous_caches_compute_the_same_hidden_states_and_record_their_fields():
    written = []
    records, meta = paged.run(parse("--batches", "2", "--contexts", "32", "--query-contexts", "32", "--queries", "3",
                                    "--steps", "2", "--repeats", "1", "--paged-kernel"),
                              write=lambda recs, _: written.append(len(recs)))
    assert [(r["cache"], r["decode_attention"], r["queries_per_step"]) for r in records] == [
        ("contiguous", "auto", 1), ("paged", "auto", 1), ("paged", "pallas", 1),
        ("contiguous", "auto", 3), ("paged", "auto", 3), ("paged", "pallas", 3)]
    assert written == [1, 2, 3, 4, 5, 6]  # the JSON is written after every record
    assert meta["page_size"] == 16 and meta["caches"] == ["contiguous", "paged"]
    for r in records:
        assert r["error"] is None, r["error"]
        assert FIELDS <= set(r)
        assert (r["stack"], r["batch"], r["context_len"], r["n_layers"]) == ("hca", 2, 32, 2)
        assert r["per_layer_ms"] > 0 and r["floor_ms"] > 0 and r["output_finite"]
        assert r["max_abs_diff_to_contiguous"] == 0.0  # the pages hold the contiguous cache's values
    one, three = records[1], records[4]
    assert {r["output_digest"] for r in records[:3]} == {records[0]["output_digest"]}
    assert {r["output_digest"] for r in records[3:]} == {records[3]["output_digest"]}
    assert records[0]["ratio_to_contiguous"] == 1.0 and one["ratio_to_one_query"] == 1.0
    assert three["ratio_to_one_query"] == three["per_layer_ms"] / one["per_layer_ms"]
    rows = list(results_table.paged(records))
    assert rows[4][0] == "hca x2, B = 2, 0k, S = 3: paged" and rows[4][1].endswith("x S = 1")
    assert rows[5][0] == "hca x2, B = 2, 0k, S = 3: paged (decode kernel forced)"
    assert rows[4][2] == "max diff to contiguous 0.0e+00"
    assert "| hca | 2 | 32 | 3 | paged (kernel) |" in paged.markdown(records, meta)


def test_past_the_deadline_the_cells_are_skipped():
    records, _ = paged.run(parse("--batches", "1", "--contexts", "32", "--query-batches", "1",
                                 "--query-contexts", "32", "--deadline-s", "0"))
    assert [(r["cache"], r["queries_per_step"]) for r in records] == [
        ("contiguous", 1), ("paged", 1), ("contiguous", 4), ("paged", 4)]
    assert all(r["error"] == "skipped: past --deadline-s 0 s" for r in records)
    assert all(row[1] == "not run" for row in results_table.paged(records))


def test_cells_run_context_first_and_add_the_s_token_steps_where_asked():
    assert paged.cells(["csa", "hca"], [1, 8], [16384, 131072], [8], [16384], 4) == [
        ("csa", 1, 16384, [1]), ("hca", 1, 16384, [1]), ("csa", 8, 16384, [1, 4]), ("hca", 8, 16384, [1, 4]),
        ("csa", 1, 131072, [1]), ("hca", 1, 131072, [1]), ("csa", 8, 131072, [1]), ("hca", 8, 131072, [1])]
    # An S-token cell outside the paged grid runs too.
    assert paged.cells(["hca"], [1], [16384], [8], [16384], 4) == [("hca", 1, 16384, [1]), ("hca", 8, 16384, [1, 4])]
