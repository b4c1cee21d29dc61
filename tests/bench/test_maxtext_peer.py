"""MaxText's DeepSeek-V4 attention, the benchmark's JAX peer (`bench/peer_maxtext.py`): the weight
map (`bench/maxtext_map.py`) and what MaxText computes against ours and the HF reference, float32 CPU.

The MaxText tests skip, with the reason, where maxtext is not installed (as in CI): it is the
optional ``[peers]`` extra (Python >= 3.12, jax >= 0.11). What they pin down (numbers in
bench/RESULTS.md and, with how they were reached, docs/journal/RESULTS_2026-11-30_to_2026-12-02.md,
"MaxText peer"):

* with our weights, MaxText's prefill equals ours (and so the reference) up to float32 noise
  once the compressed rope's YaRN is off: maxtext 0.2.5 applies no YaRN there, and that alone is
  its prefill difference from HF;
* its decode equals ours while the sliding window still covers the whole sequence; after that it
  differs, because its decode window does not slide over the prompt part of its cache;
* the indexer picks the same entries, ties (all scores equal) included: lower entry index first.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dsv4_jax  # noqa: E402
from bench import maxtext_map, measure, peer_maxtext  # noqa: E402
from dsv4_jax.config import CSA, HCA  # noqa: E402

REASON = peer_maxtext.available()
needs_maxtext = pytest.mark.skipif(
    REASON is not None, reason=f"maxtext not installed ({REASON}); pip install -e '.[peers]' (Python >= 3.12)")
LAYERS = (CSA, HCA)
TOL = 1e-5  # float32, outputs of scale ~2


def tiny(**changes):
    return dataclasses.replace(dsv4_jax.DeepseekV4Config.tiny(), **changes)


def layer(cfg, layer_type, seed=0):
    """Our layer with default-init projections and random sinks / position biases (the bench's)."""
    return measure.build_layer(cfg, cfg.layer_types.index(layer_type), "float32", seed)


def inputs(cfg, batch=2, n=32, seed=1):
    return np.random.default_rng(seed).standard_normal((batch, n, cfg.hidden_size)).astype(np.float32)


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


# ---------------------------------------------------------------------------- the map (no maxtext needed)
@pytest.mark.parametrize("layer_type", LAYERS)
def test_map_covers_our_parameters_and_inverts(layer_type):
    attn = layer(tiny(), layer_type)
    ours = maxtext_map.ours_params(attn)
    entries = maxtext_map.table(layer_type)
    assert {e.ours for e in entries} == set(ours)
    assert len({e.theirs for e in entries}) == len(entries)
    theirs = maxtext_map.to_maxtext(ours, layer_type, attn.config.num_attention_heads)
    cfg = attn.config
    assert theirs[("wq_b", "kernel")].shape == (cfg.q_lora_rank, cfg.num_attention_heads, cfg.head_dim)
    assert theirs[("wkv", "kernel")].shape == (cfg.hidden_size, 1, cfg.head_dim)
    back = maxtext_map.from_maxtext(theirs, layer_type)
    assert set(back) == set(ours)
    for path, arr in ours.items():
        np.testing.assert_array_equal(back[path], arr, err_msg=str(path))


def test_map_check_lists_every_problem():
    attn = layer(tiny(), CSA)
    ours = {k: v.shape for k, v in maxtext_map.ours_params(attn).items()}
    theirs = {e.theirs: maxtext_map.to_maxtext(maxtext_map.ours_params(attn), CSA, 4)[e.theirs].shape
              for e in maxtext_map.table(CSA)}
    assert maxtext_map.check(ours, theirs, CSA, 4) == []
    theirs.pop(("sinks",))
    theirs[("wq_b", "kernel")] = (32, 4, 16)
    theirs[("extra", "kernel")] = (1,)
    problems = " ".join(maxtext_map.check(ours, theirs, CSA, 4))
    assert "sinks" in problems and "wq_b/kernel" in problems and "extra/kernel" in problems
    with pytest.raises(ValueError, match="expected"):
        maxtext_map.table("sliding_attention")


# ---------------------------------------------------------------------------- against MaxText's layer
@needs_maxtext
@pytest.mark.parametrize("layer_type", LAYERS)
def test_map_fits_maxtext_layer(layer_type):
    from flax import nnx

    cfg = tiny()
    attn = layer(cfg, layer_type)
    prog = peer_maxtext.Program(cfg, "tiny", layer_type, attn, batch=1, prefill_len=16, max_target=20, dtype="float32")
    flat = {tuple(str(k) for k in p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(prog.params)}
    ours = maxtext_map.ours_params(attn)
    assert maxtext_map.check({k: v.shape for k, v in ours.items()}, {k: v.shape for k, v in flat.items()},
                             layer_type, cfg.num_attention_heads) == []
    back = maxtext_map.from_maxtext(flat, layer_type)
    for path, arr in ours.items():
        np.testing.assert_array_equal(back[path], arr, err_msg=str(path))


@needs_maxtext
@pytest.mark.parametrize("layer_type", LAYERS)
def test_agrees_without_yarn_while_the_window_covers_the_sequence(layer_type):
    """Prefill of 24 tokens, then 8 decode steps that complete 2 CSA / 1 HCA entries in its
    token-by-token compressor caches: equal to ours within float32 noise."""
    n, s = 32, 24
    cfg = tiny(compress_rope_scaling=None, sliding_window=n)
    attn = layer(cfg, layer_type)
    x = inputs(cfg, n=n)
    ours = peer_maxtext.ours_sequence(attn, x, s)
    theirs = peer_maxtext.maxtext_sequence(cfg, "tiny", layer_type, attn, x, s)
    assert len(theirs) == len(ours) == 1 + n - s
    for t, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert max_diff(a, b) <= TOL, (t, max_diff(a, b))
    if layer_type == CSA:
        picks_mt = peer_maxtext.maxtext_prefill_picks(cfg, "tiny", attn, x[:, :s])
        picks_ours = peer_maxtext.ours_prefill_picks(attn, x[:, :s])
        assert measure.picks_overlap(picks_mt, picks_ours) == 1.0


@needs_maxtext
@pytest.mark.parametrize("layer_type", LAYERS)
def test_yarn_is_its_whole_prefill_difference(layer_type):
    """maxtext 0.2.5's compressed rope has no YaRN: with the config's YaRN its prefill differs
    from ours from position 1 on, and equals ours computed without YaRN on the same weights."""
    cfg = tiny()  # YaRN factor 16 over 64 positions: every compressed rope frequency is scaled
    attn = layer(cfg, layer_type)
    x = inputs(cfg, n=24)
    theirs = peer_maxtext.maxtext_sequence(cfg, "tiny", layer_type, attn, x, 24)[0]
    ours = peer_maxtext.ours_sequence(attn, x, 24)[0]
    per_position = np.max(np.abs(theirs - ours), axis=(0, 2))
    assert per_position[0] <= TOL  # rope angle 0: YaRN changes nothing
    assert per_position[1:].max() > 1e-2
    plain = layer(dataclasses.replace(cfg, compress_rope_scaling=None), layer_type)
    assert max_diff(theirs, peer_maxtext.ours_sequence(plain, x, 24)[0]) <= TOL


@needs_maxtext
@pytest.mark.parametrize("layer_type", LAYERS)
def test_decode_window_does_not_slide_over_the_prompt(layer_type):
    """Window 8, a 6-token prompt, then decode: equal to ours for queries at positions < 8 (the
    window still covers everything), different from position 8 on. The cause, in MaxText's own
    mask: the prompt part of its cache keeps the last `window` prompt slots at every step."""
    from flax import nnx
    from maxtext.common.common_types import MODEL_MODE_AUTOREGRESSIVE

    cfg = tiny(compress_rope_scaling=None)
    w, s, n = cfg.sliding_window, 6, 14
    attn = layer(cfg, layer_type)
    x = inputs(cfg, n=n)
    ours = peer_maxtext.ours_sequence(attn, x, s)
    theirs = peer_maxtext.maxtext_sequence(cfg, "tiny", layer_type, attn, x, s)
    assert max_diff(theirs[0], ours[0]) <= TOL
    for t in range(s, n):
        d = max_diff(theirs[1 + t - s], ours[1 + t - s])
        assert (d <= TOL) if t < w else (d > 1e-3), (t, d)

    s2 = 16
    prog = peer_maxtext.Program(cfg, "tiny", layer_type, attn, batch=1, prefill_len=s2, max_target=s2 + 4,
                                dtype="float32")
    op = nnx.merge(prog.graphdef, prog.params, prog.cache0, prog.rest).attention_op
    for step in range(3):
        mask = op.generate_attention_mask(jnp.zeros((1, 1, 1, cfg.head_dim)), jnp.zeros((1, s2, 1, cfg.head_dim)),
                                          jnp.ones((1, s2), jnp.int32), MODEL_MODE_AUTOREGRESSIVE,
                                          segment_positions=jnp.array([[s2 + step]]))
        kept = np.nonzero(np.asarray(mask).reshape(-1) == 0)[0]
        np.testing.assert_array_equal(kept, np.arange(s2 - w, s2))  # the reference keeps s2 + step - w + 1 ..


@needs_maxtext
def test_ties_lower_entry_index_first():
    """All indexer scores equal (zero head weights): both pick the lowest visible entries."""
    cfg = tiny(compress_rope_scaling=None)
    attn = layer(cfg, CSA)
    attn.indexer.weights_proj[...] = jnp.zeros_like(attn.indexer.weights_proj[...])
    x = inputs(cfg, n=40)  # 10 entries, top-k 4: most queries choose among ties
    picks_mt = peer_maxtext.maxtext_prefill_picks(cfg, "tiny", attn, x)
    picks_ours = peer_maxtext.ours_prefill_picks(attn, x)
    assert measure.picks_overlap(picks_mt, picks_ours) == 1.0
    visible = (np.arange(40)[:, None] + 1) // cfg.csa_compress_rate  # entries complete at each position
    for t in (3, 4, 20, 39):
        want = set(range(min(int(visible[t, 0]), cfg.index_topk)))
        assert set(picks_mt[0, t][picks_mt[0, t] >= 0].tolist()) == want, t
    theirs = peer_maxtext.maxtext_sequence(cfg, "tiny", CSA, attn, x, 40)[0]
    assert max_diff(theirs, peer_maxtext.ours_sequence(attn, x, 40)[0]) <= TOL


@needs_maxtext
@pytest.mark.parametrize("name", ["tiny_seed1.npz", "small_seed0.npz"])
def test_against_the_recorded_hf_reference(name):
    """HF transformers 5.23.0, recorded (tests/data, YaRN on): ours matches it on MaxText's
    schedule; MaxText's prefill differs by YaRN alone; its decode also by the window."""
    report = peer_maxtext.agreement_golden(name)
    for lt, r in report["results"].items():
        ours, mt, plain = r["ours_vs_hf"], r["maxtext_vs_hf"], r["maxtext_vs_ours_without_yarn"]
        assert ours["prefill_max_abs"] <= TOL and max(ours["decode_max_abs_per_step"]) <= TOL, lt
        assert plain["prefill_max_abs"] <= TOL, lt
        assert mt["prefill_max_abs"] > 1e-2, lt
        assert max(mt["decode_max_abs_per_step"]) > 1e-2, lt


@needs_maxtext
@pytest.mark.parametrize("layer_type", LAYERS)
def test_against_live_hf_without_yarn(layer_type):
    """Where torch + transformers 5.23.0 are installed too: MaxText against the HF layer itself,
    YaRN off and a window over the whole sequence (the setting where MaxText computes V4)."""
    pytest.importorskip("torch", reason="torch not installed (the [hf] extra)")
    pytest.importorskip("transformers.models.deepseek_v4", reason="transformers with DeepSeek-V4 not installed")
    from dsv4_jax.io.hf_reference import HFAttentionRunner
    from dsv4_jax.io.hf_weights import export_hf_attention_weights

    n, s = 32, 24
    cfg = tiny(compress_rope_scaling=None, sliding_window=n)
    attn = layer(cfg, layer_type)
    x = inputs(cfg, n=n)
    hf = HFAttentionRunner(cfg, attn.layer_idx, export_hf_attention_weights(attn))
    pos = np.broadcast_to(np.arange(n), (x.shape[0], n))
    ref = [hf(x[:, :s], pos[:, :s])] + [hf(x[:, t : t + 1], pos[:, t : t + 1]) for t in range(s, n)]
    theirs = peer_maxtext.maxtext_sequence(cfg, "tiny", layer_type, attn, x, s)
    for t, (a, b) in enumerate(zip(theirs, ref, strict=True)):
        assert max_diff(a, b) <= TOL, (t, max_diff(a, b))


@needs_maxtext
def test_bench_records_the_maxtext_peer(tmp_path):
    """bench/run.py with the JAX peer: a timed record per case (compile time and XLA's peak memory
    apart), its outputs compared with ours, its picks with ours; an impossible case is a skip
    that says why; the other peer can be left out."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_run_mt", ROOT / "bench" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    out = tmp_path / "out.json"
    argv = ["--size", "tiny", "--layers", "csa", "--scenarios", "prefill", "--modes", "none", "--peers", "maxtext-jax",
            "--json", str(out), "--no-progress", "--no-plot"]
    assert run.main(argv) == 0
    data = json.loads(out.read_text())
    recs = {r["mode"]: r for r in data["records"]}
    assert set(recs) == {"none", "maxtext-jax"}
    mt = recs["maxtext-jax"]
    assert mt["error"] is None and mt["skipped"] is None, mt
    assert mt["prefill_ms"] > 0 and mt["compile_s"] > 0 and mt["peak_gb"] > 0
    assert 0 < mt["max_abs_diff_vs_none"] < 1.0  # the tiny config's YaRN (see above), not noise
    assert 0.9 <= mt["picks_set_overlap_vs_none"] <= 1.0
    assert recs["none"]["ours_over_maxtext"] > 0
    assert data["meta"]["maxtext_versions"]["maxtext"] and data["meta"]["peer_unavailable"] == "not in --peers"

    out2 = tmp_path / "capped.json"
    assert run.main([*argv[:-4], "--maxtext-mem-gb", "1e-6", "--json", str(out2), "--no-progress", "--no-plot"]) == 0
    capped = {r["mode"]: r for r in json.loads(out2.read_text())["records"]}["maxtext-jax"]
    assert capped["skipped"].startswith("memory: MaxText's"), capped
