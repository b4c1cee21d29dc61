"""The example scripts run as documented, and do what they say."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import serving  # noqa: E402
import train_indexer  # noqa: E402

from dsv4_jax.cache import paged  # noqa: E402


def test_the_indexer_learns_from_its_kl_loss():
    """examples/train_indexer.py on the tiny config: the dense warm-up's loss and then the sparse
    phase's both fall (the indexer fits the frozen main attention's choices)."""
    curve = train_indexer.train("tiny", steps=40, warmup=16, log=lambda *_: None)
    dense = [c["loss"] for c in curve if c["phase"] == "visible"]
    sparse = [c["loss"] for c in curve if c["phase"] == "topk"]
    assert len(dense) == 16 and len(sparse) == 24
    assert np.all(np.isfinite(dense + sparse))
    assert dense[-1] < 0.5 * dense[0], dense
    assert np.mean(sparse[-4:]) < 0.7 * np.mean(sparse[:4]), sparse


def test_the_serving_example_shares_the_prompt_rewinds_and_gives_pages_back():
    """examples/serving.py: request B after the forked system prompt equals B from scratch, bit
    for bit; the prompt's 2 full pages shared; the speculative steps leave the rows at their
    accepted tokens; request A's own pages come back to the pool and C runs on them."""
    result = serving.serve(log=lambda *_: None)
    np.testing.assert_array_equal(result["b_shared"], result["b_alone"])
    assert result["shared_pages"] == 2 and result["freed"] == 2
    caches = result["caches"]
    for cache in caches[1:]:  # the CSA and HCA layers' caches: one page table, consistent
        paged.check_pages(cache.pages)
        assert cache.pages is caches[1].pages or np.array_equal(cache.pages.table, caches[1].pages.table)
    assert caches[1].length.tolist() == [5, 46 + int(result["accepted"][1])]


def test_pages_hold_at_least_three_times_the_rows_of_a_ragged_batch():
    """Issue 67's memory target at V4-Flash sizes: rows of 1k to 1M tokens."""
    report = serving.memory_report()
    assert report["csa"]["rows_ratio"] >= 3 and report["hca"]["rows_ratio"] >= 3, report
