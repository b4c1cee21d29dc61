"""The example scripts run as documented, and do what they say."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import train_indexer  # noqa: E402


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
