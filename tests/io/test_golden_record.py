"""tests/data/*.npz can be regenerated: they are what scripts/record_golden.py records.

Without torch: every committed file has a recording in the script's `RECORDINGS` table, and
its metadata (config, schedule, batch, seed) and its arrays (keys, shapes, dtypes) are what
the script writes for it. With torch + transformers 5.23.0: the full HF config too, and the
tiny file recorded again from its inputs in a temp dir gives the committed reference outputs
(outputs and index scores within 1e-6, picks exactly). Also here: the reference's tie rule
holds only while it runs.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from dsv4_jax import DeepseekV4Config

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


def _load_script():
    spec = importlib.util.spec_from_file_location("record_golden_under_test", ROOT / "scripts" / "record_golden.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


rg = _load_script()


def _read(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    return json.loads(bytes(arrays.pop("meta")).decode()), arrays


def _needs_reference(torch: bool = True):
    if torch:
        pytest.importorskip("torch", reason="running the HF reference needs torch (the [hf] extra)")
    transformers = pytest.importorskip("transformers", reason="HF's config needs transformers (the [hf] extra)")
    if transformers.__version__ != rg.TRANSFORMERS_VERSION:
        pytest.skip(f"the recordings are of transformers {rg.TRANSFORMERS_VERSION}, "
                    f"installed is {transformers.__version__}")


def test_every_committed_file_has_a_recording():
    assert sorted(p.name for p in DATA.glob("*.npz")) == sorted(rg.RECORDINGS)


@pytest.mark.parametrize("name", sorted(rg.RECORDINGS))
def test_metadata_is_the_scripts(name):
    rec = rg.RECORDINGS[name]
    meta, _ = _read(DATA / name)
    assert (meta["schedule"], meta["batch"], meta["seed"]) == (list(rec.schedule), rec.batch, rec.seed)
    assert meta["layer_types"] == list(rec.config.layer_types)
    assert DeepseekV4Config.from_hf(meta["hf_config"]) == rec.config
    # Every field the script passes to HF's config, the non-attention ones (vocab, mHC, MoE) included.
    kwargs = rg.hf_kwargs(rec)
    assert {k: meta["hf_config"].get(k) for k in kwargs} == kwargs


@pytest.mark.parametrize("name", sorted(rg.RECORDINGS))
def test_arrays_are_the_scripts_keys_shapes_and_dtypes(name):
    _, arrays = _read(DATA / name)
    want = rg.array_shapes(rg.RECORDINGS[name])
    assert sorted(arrays) == sorted(want)
    got = {k: (a.shape, a.dtype.name) for k, a in arrays.items()}
    assert got == want


@pytest.mark.parametrize("name", sorted(rg.RECORDINGS))
def test_full_hf_config_is_the_scripts(name):
    _needs_reference(torch=False)
    meta, _ = _read(DATA / name)
    assert meta["hf_config"] == rg.meta(rg.RECORDINGS[name])["hf_config"]


def test_rerecording_tiny_gives_the_committed_arrays(tmp_path):
    _needs_reference()
    name = "tiny_seed1.npz"
    assert rg.main([str(tmp_path), name, "--inputs-from", str(DATA)]) == 0
    meta, got = _read(tmp_path / name)
    committed_meta, committed = _read(DATA / name)
    meta.pop("source")  # says that the outputs were recorded again
    assert meta == {k: v for k, v in committed_meta.items() if k != "source"}
    assert sorted(got) == sorted(committed)
    for key, want in committed.items():
        assert got[key].shape == want.shape and got[key].dtype == want.dtype, key
        if key.endswith("/topk"):
            np.testing.assert_array_equal(got[key], want, err_msg=key)
            continue
        finite = np.isfinite(want)  # index scores: -inf nowhere (scores precede causal masking)
        np.testing.assert_array_equal(np.isfinite(got[key]), finite, err_msg=key)
        np.testing.assert_allclose(got[key][finite], want[finite], rtol=0, atol=1e-6, err_msg=key)


def test_reference_tie_rule_holds_only_inside_its_calls():
    """`stable_topk` decides ties inside its block (the runner enters it around HF's indexer);
    torch's own topk is untouched after a reference call, and on other threads meanwhile."""
    _needs_reference()
    import torch

    from dsv4_jax.io.hf_reference import HFAttentionRunner, stable_topk

    ties = torch.zeros(1, 5000)  # all equal: stock topk returns some 5 of them, not necessarily 0..4
    lowest = torch.arange(5)[None]
    stock_fn, stock_method = torch.topk, torch.Tensor.topk
    stock = torch.topk(ties, 5).indices

    with stable_topk():
        assert torch.equal(torch.topk(ties, 5).indices, lowest) and torch.equal(ties.topk(5).indices, lowest)
        other = {}
        thread = threading.Thread(target=lambda: other.update(picks=torch.topk(ties, 5).indices))
        thread.start()
        thread.join()
        assert torch.equal(other["picks"], stock)

    rec = rg.RECORDINGS["tiny_seed1.npz"]
    weights, hidden = rg.inputs_from(DATA / "tiny_seed1.npz", rec)
    runner = HFAttentionRunner(rec.config, 1, weights[1])
    runner(hidden[1][:, :9], np.arange(9)[None])  # a CSA call: the indexer's topk ran in the block
    assert torch.topk is stock_fn and torch.Tensor.topk is stock_method
    assert torch.equal(torch.topk(ties, 5).indices, stock) and torch.equal(ties.topk(5).indices, stock)
