"""bench/numerics_picks.py: the official numerics' picks and outputs against the reference's (tiny config).

The comparison itself (a pick replaced, by row; nothing differs between two runs of one setting)
and the run's records; the shares it measures belong to the benchmark, not to a test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import measure, numerics_picks  # noqa: E402
from bench import plan as plan_mod  # noqa: E402
from dsv4_jax.config import CSA, HCA  # noqa: E402


def test_replaced_share_counts_the_reference_picks_the_other_run_lacks():
    reference = np.array([[0, 1, 2, 3], [5, 4, -1, -1], [7, 6, 5, 4]])
    official = np.array([[3, 2, 1, 0], [4, 6, -1, -1], [0, 1, 2, 3]])
    # Row 0: the same set in another order; row 1: 5 replaced, one of its two picks (the -1s are
    # no picks); row 2: all.
    np.testing.assert_allclose(numerics_picks.replaced_share(reference, official), [0.0, 0.5, 1.0])


def test_one_setting_against_itself_differs_nowhere():
    cfg = plan_mod.config_for("tiny")
    idx = cfg.layer_types.index(CSA)
    attn = measure.build_layer(cfg, idx, jnp.float32, 0)
    attn.donate_cache = False
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((1, 48, cfg.hidden_size)), jnp.float32)
    rec = numerics_picks.compare(attn, hidden, settings=("official", "official"))
    assert rec["picks_replaced"] == 0.0 and rec["rows_changed"] == 0.0 and rec["full_rows"] > 0
    assert rec["out_rel_max"] == 0.0 and rec["out_rel_rms"] == 0.0


def test_the_run_records_each_layer_type_and_length(tmp_path):
    out = tmp_path / "picks.json"
    numerics_picks.main(["--size", "tiny", "--lengths", "40,72", "--json", str(out)])
    page = json.loads(out.read_text())
    recs = page["records"]
    assert [(r["layer_type"], r["prompt_len"]) for r in recs] == [(CSA, 40), (CSA, 72), (HCA, 40), (HCA, 72)]
    assert all(r["error"] is None and r["scenario"] == "numerics_picks" for r in recs)
    for r in recs:
        assert 0 < r["out_rel_max"] and 0 < r["out_rel_rms"]  # the official rounding moves every output
        if r["layer_type"] == CSA:
            assert 0 <= r["picks_replaced"] <= r["rows_changed"] <= 1 and len(r["picks_replaced_quarters"]) == 4
        else:
            assert r["picks_replaced"] is None
    assert page["meta"]["size"] == "tiny" and "jax_version" in page["meta"]
