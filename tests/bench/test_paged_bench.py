"""bench/paged.py: paged caches against contiguous ones, S tokens a row against one (issue 67),
on the tiny config.

A smoke test of the protocol and the records (timings are not asserted: they belong to the
benchmark): both caches decode from the same values, so they compute the same hidden states bit
for bit; the S-token cells run beside the one-token ones; the deadline skips cells; the records
make RESULTS.md's rows (`results_table.paged`). The memory scenario's bytes are the caches'
leaves' (checked against real caches); the prefix scenario's forked row computes bit for bit
what the prefix row itself does.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from bench import paged, plan, results_table  # noqa: E402
from dsv4_jax.cache.contiguous import init_attention_cache  # noqa: E402
from dsv4_jax.cache.paged import PagedRows  # noqa: E402
from dsv4_jax.config import CSA  # noqa: E402

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
    assert rows[4][0] == "hca x2, B = 2, 32, S = 3: paged" and rows[4][1].endswith("x S = 1")
    assert rows[5][0] == "hca x2, B = 2, 32, S = 3: paged (decode kernel forced)"
    assert rows[4][2] == "max diff to contiguous 0.0e+00"
    assert "| hca | 2 | 32 | 3 | paged (kernel) |" in paged.markdown(records, meta)



def test_a_profiled_run_records_each_variants_device_time_by_stage(tmp_path):
    """--profile: each variant's steps traced after the timed ones (the same steps for both, so
    the hidden states still agree bit for bit), the device time per stage in its record, and the
    tables compare the paged cache's stages with the contiguous cache's."""
    one_cell = ("--batches", "1", "--contexts", "32", "--query-batches", "1", "--query-contexts", "32",
                "--queries", "1")
    records, meta = paged.run(parse(*one_cell, "--steps", "2", "--repeats", "1", "--profile", str(tmp_path)))
    assert [r["cache"] for r in records] == ["contiguous", "paged"]
    for r in records:
        assert r["error"] is None, r["error"]
        prof = r["profile"]
        assert prof["busy_us_per_step"] > 0 and prof["rows"] and len(prof["rows"]) <= paged.PROFILE_ROWS
        assert "sparse_attention" in {s["source"] for s in prof["by_source"]}
        assert r["max_abs_diff_to_contiguous"] == 0.0 and r["total_steps"] == paged.WARM + 2 + 2 + 3
    assert "Device time a step, hca B = 1, ctx 32, S = 1: contiguous" in paged.markdown(records, meta)

def test_the_pages_lie_in_a_random_order_or_row_after_row_and_hold_the_contiguous_values():
    """--page-order: the paged copy's table is a seeded permutation of the pool ("random") or each
    row's pages one after another ("in-order", as `reserve_pages` hands a fresh pool out); either
    way every row reads the contiguous cache's entries."""
    from bench import stack as stack_mod

    cfg = stack_mod.stack_config("tiny", 2)
    stack = stack_mod.Stack(cfg, "csa", 2, jnp.float32, 0, "none")
    batch, max_seq_len, page = 2, 64, 16
    tables = {}
    for order in paged.PAGE_ORDERS:
        contiguous = stack.synthetic_caches(batch, max_seq_len, 40, 0)
        copies = paged.paged_copies(stack, contiguous, batch, max_seq_len, page, 0, order)
        tables[order] = np.asarray(copies[0].pages.table)
        for want, got in zip(contiguous, copies):
            for part in ("compressor", "indexer"):
                entries = np.asarray(getattr(want, part).entries)
                rows = PagedRows(pool=getattr(got, part).entries, table=got.pages.table, slots=entries.shape[1])
                np.testing.assert_array_equal(np.asarray(rows.view()), entries, err_msg=f"{order} {part}")
    pages = tables["in-order"].size
    assert tables["in-order"].tolist() == np.arange(pages).reshape(batch, -1).tolist()
    assert sorted(tables["random"].ravel().tolist()) == list(range(pages))
    assert tables["random"].tolist() != tables["in-order"].tolist()
    with pytest.raises(ValueError, match=r"page_order: expected one of \('random', 'in-order'\), got 'sorted'"):
        paged.paged_copies(stack, contiguous, batch, max_seq_len, page, 0, "sorted")
    records, meta = paged.run(parse("--batches", "1", "--contexts", "32", "--query-batches", "1",
                                    "--query-contexts", "32", "--queries", "1", "--steps", "1", "--repeats", "1",
                                    "--page-order", "in-order"))
    assert meta["page_order"] == "in-order" and all(r["page_order"] == "in-order" for r in records)
    assert records[1]["max_abs_diff_to_contiguous"] == 0.0
    assert [row[0] for row in results_table.paged(records)] == [
        "hca x2, B = 1, 32, S = 1: contiguous", "hca x2, B = 1, 32, S = 1: paged (pages in order)"]
    assert "(in-order over the pool)" in paged.markdown(records, meta)


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


# ---------------------------------------------------------------------------- --scenario memory
MEMORY_FIELDS = {"layers", "kv_cache_dtype", "page_size", "max_seq_len", "length_distribution", "rows_contiguous",
                 "bytes_contiguous", "tokens_contiguous", "rows_paged", "pages_paged", "bytes_paged", "tokens_paged",
                 "rows_ratio", "rows_ratio_expected", "tokens_per_gb_contiguous", "tokens_per_gb_paged",
                 "bytes_per_page", "bytes_per_row_paged", "meets_target", "jax_version", "device", "date_utc"}


def leaf_bytes(cache) -> int:
    """The bytes of a real cache's every leaf, counted from its arrays."""
    return sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(cache))


def test_the_memory_scenario_counts_every_leaf_and_fits_more_ragged_rows_than_contiguous_ones():
    args = parse("--scenario", "memory", "--memory-rows", "2", "--memory-min-len", "64", "--memory-max-len", "2048")
    records, meta = paged.run(args)
    assert [(r["layers"], r["kv_cache_dtype"]) for r in records] == [
        (g, kv) for kv in ("auto", "fp8") for g in ("csa", "hca", "model")]
    assert meta["page_size"] == 16 and "log-uniform over [64, 2048]" in meta["length_distribution"]
    for r in records:
        assert r["error"] is None, r["error"]
        assert MEMORY_FIELDS <= set(r) and r["scenario"] == "paged_memory"
        assert r["rows_ratio"] > 1 and r["rows_paged"] == 2 * r["rows_ratio"]
        assert r["bytes_paged"] <= r["bytes_contiguous"]
        assert r["tokens_per_gb_paged"] == r["tokens_paged"] / (r["bytes_paged"] / 1e9)
    # By hand, the CSA layer in bf16: real caches' leaves (the window ring, both compressors' rings
    # and entries or pools, length, page table and counts) weigh what the records say.
    cfg = plan.config_for("tiny")
    csa = records[0]
    lengths = paged.draw_lengths(0, 4096, 64, 2048)
    assert csa["tokens_paged"] == lengths[:csa["rows_paged"]].sum()
    assert csa["pages_paged"] == (-(-lengths[:csa["rows_paged"]] // 16)).sum()

    def real(batch, **paging):
        return leaf_bytes(init_attention_cache(cfg, cfg.layer_types.index(CSA), batch, 2048, jnp.bfloat16,
                                               allow_long_context=True, **paging))

    assert real(2) == csa["bytes_contiguous"]
    assert real(csa["rows_paged"], page_size=16, num_pages=csa["pages_paged"]) == csa["bytes_paged"]
    one_more = int((-(-lengths[:csa["rows_paged"] + 1] // 16)).sum())  # the next row would not fit
    assert real(csa["rows_paged"] + 1, page_size=16, num_pages=one_more) > csa["bytes_contiguous"]
    assert "| csa | fp8 |" in paged.markdown(records, meta)


# ---------------------------------------------------------------------------- --scenario prefix
PREFIX_FIELDS = {"fork_ms", "reserve_ms", "suffix_ms", "full_prefill_ms", "full_reserve_ms", "fork_ms_per_layer",
                 "suffix_ms_per_layer", "full_prefill_ms_per_layer", "ratio_to_full", "ratio_to_full_with_pages",
                 "max_abs_diff_to_unforked", "max_abs_diff_to_full", "max_rel_diff_to_full", "floor_ratio",
                 "compile_s", "prompt_len", "prefix_len", "suffix_len", "shared_pages", "suffix_pages",
                 "jax_version", "device", "date_utc"}


def test_a_forked_prefix_and_its_suffix_compute_what_the_whole_prompt_computes():
    records, meta = paged.run(parse("--scenario", "prefix", "--stacks", "csa", "--layers-per-stack", "1",
                                    "--repeats", "1", "--pool-rows", "3"))
    (r,) = records
    assert r["error"] is None, r["error"]
    assert PREFIX_FIELDS <= set(r) and r["scenario"] == "paged_prefix"
    assert (r["prompt_len"], r["prefix_len"], r["suffix_len"], r["n_layers"], r["repeats"]) == (256, 192, 64, 1, 1)
    assert r["max_abs_diff_to_unforked"] == 0.0  # the forked row computes what the prefix row itself does
    assert r["max_rel_diff_to_full"] < 1e-5  # a prompt in two calls against one: the chunking's rounding
    assert (r["shared_pages"], r["suffix_pages"]) == (192 // 16, 256 // 16)  # the prefix's pages are shared
    assert (r["pool_rows"], r["num_pages"]) == (3, 3 * 256 // 16) and r["pool_bytes"] > 0
    assert r["ratio_to_full"] == (r["fork_ms"] + r["suffix_ms"]) / r["full_prefill_ms"]
    assert r["output_finite"] and min(r["fork_ms"], r["suffix_ms"], r["full_prefill_ms"]) > 0
    assert "| csa | 256 | 192 |" in paged.markdown(records, meta)


def test_past_the_deadline_the_prefix_stacks_are_skipped():
    records, _ = paged.run(parse("--scenario", "prefix", "--stacks", "csa,hca", "--deadline-s", "0"))
    assert [(r["stack"], r["error"]) for r in records] == [
        (kind, "skipped: past --deadline-s 0 s") for kind in ("csa", "hca")]
