"""`load_attention_checkpoint`: synthetic safetensors checkpoints built from the golden weights.

The checkpoints are written with the real `safetensors` writer, in HF naming
(``model.layers.{i}.self_attn.*``) and DeepSeek's official naming (``layers.{i}.attn.*``),
with FP8 e4m3 weights + UE8M0 128x128 block scales (quantized here with ml_dtypes) or plain
float32, as one file or sharded with an index. The loaded layer's parameters are checked
against the dequantized reference (bit-exact in float32, in the layout of test_weights.LAYOUT)
and, for float32 checkpoints, its output against the recorded HF outputs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import load_golden
from safetensors.numpy import save_file
from test_weights import assert_holds_in_jax_layout  # the HF -> layer layout, written once

import dsv4_jax
from dsv4_jax.config import CSA
from dsv4_jax.io import checkpoint
from dsv4_jax.io.hf_weights import expected_shapes, export_hf_attention_weights

# HF name -> official name (spec section 11.1), written out independently of the loader's rules.
HF_TO_OFFICIAL = {
    "q_a_proj.weight": "wq_a.weight", "q_a_norm.weight": "q_norm.weight", "q_b_proj.weight": "wq_b.weight",
    "kv_proj.weight": "wkv.weight", "kv_norm.weight": "kv_norm.weight", "o_a_proj.weight": "wo_a.weight",
    "o_b_proj.weight": "wo_b.weight", "sinks": "attn_sink",
    "compressor.position_bias": "compressor.ape", "compressor.kv_proj.weight": "compressor.wkv.weight",
    "compressor.gate_proj.weight": "compressor.wgate.weight", "compressor.kv_norm.weight": "compressor.norm.weight",
    "compressor.indexer.q_b_proj.weight": "indexer.wq_b.weight",
    "compressor.indexer.scorer.weights_proj.weight": "indexer.weights_proj.weight",
    "compressor.indexer.position_bias": "indexer.compressor.ape",
    "compressor.indexer.kv_proj.weight": "indexer.compressor.wkv.weight",
    "compressor.indexer.gate_proj.weight": "indexer.compressor.wgate.weight",
    "compressor.indexer.kv_norm.weight": "indexer.compressor.norm.weight",
}
# FP8 in the real checkpoints (spec section 11.2); the rest is bf16 (weights, norms) or fp32.
FP8 = ("q_a_proj.weight", "q_b_proj.weight", "kv_proj.weight", "o_a_proj.weight", "o_b_proj.weight",
       "compressor.indexer.q_b_proj.weight")
FP32 = ("sinks", "compressor.position_bias", "compressor.indexer.position_bias")


# ---------------------------------------------------------------------------- helpers
def golden(name):
    """(the recorded run, its config, {layer: HF-named weights})."""
    g = load_golden(name)
    return g, g.cfg, {i: g.weights(i) for i in range(g.cfg.num_layers)}


@pytest.fixture(scope="module")
def tiny():
    return golden("tiny_seed1.npz")


def quantize_fp8(w: np.ndarray, block: int = 128):
    """Blockwise FP8 e4m3 with power-of-two (UE8M0) scales: (w8, scale bytes as float8_e8m0fnu)."""
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    exps = np.zeros((nr, nc), np.int32)
    w8 = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            amax = float(np.abs(blk).max()) or 1.0
            exps[i, j] = int(np.ceil(np.log2(amax / 448.0)))
            w8[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / np.float32(2.0 ** exps[i, j])).astype(
                ml_dtypes.float8_e4m3fn)
    return w8, (exps + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def dequant_reference(w8, scale, block=128):
    """Element-by-block reference: W[r, c] = w8[r, c] * 2^(u - 127)."""
    u = scale.view(np.uint8).astype(np.int64)
    factors = np.ldexp(1.0, u - 127)
    full = np.kron(factors, np.ones((block, block)))[: w8.shape[0], : w8.shape[1]]
    return (w8.astype(np.float64) * full).astype(np.float32)


def ckpt_tensors(weights, naming="hf", fp8=False, scale_suffix=None):
    """Checkpoint tensors of several layers + the float32 reference each layer should load.

    weights: {layer: {HF name: array}}. Returns ({key: array}, {layer: {HF name: reference}}).
    """
    tensors, reference = {}, {}
    for i, layer in weights.items():
        prefix = f"model.layers.{i}.self_attn." if naming == "hf" else f"layers.{i}.attn."
        suffix = scale_suffix or (".weight_scale_inv" if naming == "hf" else ".scale")
        reference[i] = {}
        for name, w in layer.items():
            key = prefix + (name if naming == "hf" else HF_TO_OFFICIAL[name])
            w = np.asarray(w, np.float32)
            if fp8 and name in FP8:
                w8, scale = quantize_fp8(w)
                tensors[key] = w8
                tensors[key[: -len(".weight")] + suffix] = scale
                reference[i][name] = dequant_reference(w8, scale)
            elif fp8 and name not in FP32:
                tensors[key] = w.astype(ml_dtypes.bfloat16)
                reference[i][name] = tensors[key].astype(np.float32)
            else:
                tensors[key] = w
                reference[i][name] = w
        # Neighbours of the attention block that the loader must ignore.
        if naming == "hf":
            tensors[f"model.layers.{i}.input_layernorm.weight"] = np.ones(4, np.float32)
        else:
            tensors[f"layers.{i}.attn_norm.weight"] = np.ones(4, np.float32)
            tensors[f"layers.{i}.ffn.gate.weight"] = np.ones((2, 2), ml_dtypes.bfloat16)
    tensors["model.embed_tokens.weight" if naming == "hf" else "embed.weight"] = np.zeros((3, 4), np.float32)
    return tensors, reference


def write(path: Path, tensors, shards=None):
    """One file (`path` ends in .safetensors) or a sharded directory: {file name: key predicate}."""
    if shards is None:
        save_file(tensors, str(path))
        return path
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for fname, owns in shards.items():
        part = {k: v for k, v in tensors.items() if owns(k) and k not in weight_map}
        save_file(part, str(path / fname))
        weight_map.update(dict.fromkeys(part, fname))
    assert set(weight_map) == set(tensors)
    (path / checkpoint.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def by_layer(i):
    return lambda k: f"layers.{i}." in k


def make_layer(cfg, i, **kw):
    return dsv4_jax.DeepseekV4Attention(cfg, layer_idx=i, rngs=nnx.Rngs(100 + i), **kw)


def assert_loaded(attn, reference):
    """The layer's parameters are exactly `reference` ({HF name: float32 tensor in HF layout})."""
    assert_holds_in_jax_layout(attn, reference)


def replay_first_call(attn, g, i):
    """The layer's first golden call (prefill) against the recorded HF output."""
    c0 = g.call(i, 0)
    out, _ = attn(jnp.asarray(c0["hidden"]), c0["positions"], attn.init_cache(g.batch, 64))
    assert np.abs(np.asarray(out) - c0["out"]).max() <= 1e-5 * np.abs(c0["out"]).max()


def header_only_file(path: Path, shapes: dict[str, tuple[tuple[int, ...], str]]):
    """A safetensors file whose header declares `shapes` (key -> (shape, dtype tag)) but holds no data."""
    sizes = {"F8_E4M3": 1, "F8_E8M0": 1, "BF16": 2, "F32": 4}
    header, offset = {}, 0
    for key, (shape, tag) in shapes.items():
        n = int(np.prod(shape)) * sizes[tag]
        header[key] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    return path


# ---------------------------------------------------------------------------- loading
@pytest.mark.parametrize("naming,fp8,sharded", [
    ("hf", False, False), ("hf", True, True), ("official", False, True), ("official", True, False),
])
def test_load_both_namings_with_and_without_fp8(tmp_path, tiny, naming, fp8, sharded):
    g, cfg, weights = tiny
    tensors, reference = ckpt_tensors(weights, naming, fp8)
    shards = {f"model-0000{i + 1}-of-00003.safetensors": by_layer(i) for i in range(2)}
    shards["model-00003-of-00003.safetensors"] = lambda k: True
    path = write(tmp_path / ("ckpt" if sharded else "model.safetensors"), tensors, shards if sharded else None)
    for i in range(cfg.num_layers):
        attn = make_layer(cfg, i)
        info = dsv4_jax.load_attention_checkpoint(attn, path)
        assert isinstance(info, checkpoint.CheckpointLayer)
        assert info.naming == naming and info.layer_idx == i
        prefix = f"model.layers.{i}.self_attn." if naming == "hf" else f"layers.{i}.attn."
        assert info.keys == {n: prefix + (n if naming == "hf" else HF_TO_OFFICIAL[n]) for n in weights[i]}
        assert set(info.fp8) == ({n for n in FP8 if n in weights[i]} if fp8 else set())
        if sharded:
            assert [os.path.basename(f) for f in info.files] == [f"model-0000{i + 1}-of-00003.safetensors"
                                                                 if i < 2 else "model-00003-of-00003.safetensors"]
        assert_loaded(attn, reference[i])
        if not fp8:  # the exact golden weights: the layer reproduces the recorded HF output
            replay_first_call(attn, g, i)


def test_fp8_layer_matches_in_memory_load_of_dequantized_weights(tmp_path, tiny):
    g, cfg, weights = tiny
    tensors, reference = ckpt_tensors(weights, "official", fp8=True)
    path = write(tmp_path / "m.safetensors", tensors)
    a, b = make_layer(cfg, 1), make_layer(cfg, 1)
    dsv4_jax.load_attention_checkpoint(a, path)
    dsv4_jax.load_hf_attention_weights(b, reference[1])
    c0 = g.call(1, 0)
    out_a, _ = a(jnp.asarray(c0["hidden"]), c0["positions"], a.init_cache(1, 64))
    out_b, _ = b(jnp.asarray(c0["hidden"]), c0["positions"], b.init_cache(1, 64))
    np.testing.assert_array_equal(np.asarray(out_a), np.asarray(out_b))


def test_bf16_param_dtype_and_either_scale_spelling(tmp_path, tiny):
    _, cfg, weights = tiny
    for naming, suffix in (("hf", ".scale"), ("official", ".weight_scale_inv")):
        tensors, reference = ckpt_tensors({1: weights[1]}, naming, fp8=True, scale_suffix=suffix)
        path = write(tmp_path / f"{naming}.safetensors", tensors)
        attn = make_layer(cfg, 1, param_dtype=jnp.bfloat16)
        info = dsv4_jax.load_attention_checkpoint(attn, path)
        assert info.fp8
        assert attn.q_a_proj[...].dtype == jnp.bfloat16 and attn.sinks[...].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(attn.q_a_proj[...], np.float32),
                                      reference[1]["q_a_proj.weight"].T.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_dequantize_blocks_partial_blocks_and_scale_dtypes():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(300, 200)).astype(np.float32) * np.float32(3.0)
    w8, scale = quantize_fp8(w)
    assert scale.shape == (3, 2)
    want = dequant_reference(w8, scale)
    u = scale.view(np.uint8)
    for tag, s in (("F8_E8M0", scale), ("U8", u), ("F32", np.ldexp(np.float32(1), u.astype(np.int32) - 127)),
                   ("BF16", np.ldexp(np.float32(1), u.astype(np.int32) - 127).astype(ml_dtypes.bfloat16))):
        got = checkpoint.dequantize_blocks(w8, checkpoint.scale_to_float32(s, tag))
        np.testing.assert_array_equal(got, want, err_msg=tag)
    assert np.abs(want - w).max() <= 0.07 * np.abs(w).max()  # FP8 e4m3: 3 mantissa bits


def test_official_renaming_rules():
    for hf, official in HF_TO_OFFICIAL.items():
        assert checkpoint.official_to_hf(official) == hf
    assert checkpoint.official_to_hf("indexer.wq_b.scale") == "compressor.indexer.q_b_proj.weight_scale_inv"
    assert checkpoint.official_to_hf("wo_a.scale") == "o_a_proj.weight_scale_inv"


def test_another_layer_index_of_the_same_type(tmp_path, tiny):
    _, cfg, weights = tiny
    tensors, reference = ckpt_tensors({0: weights[0], 1: weights[1], 7: weights[1]}, "official")
    path = write(tmp_path / "m.safetensors", tensors)
    attn = make_layer(cfg, 1)
    info = dsv4_jax.load_attention_checkpoint(attn, path, layer_idx=7)
    assert info.layer_idx == 7
    assert_loaded(attn, reference[7])
    with pytest.raises(ValueError, match=r"layer_idx: expected a checkpoint layer of attn's type "
                                         r"compressed_sparse_attention .* a sliding_attention layer"):
        dsv4_jax.load_attention_checkpoint(attn, path, layer_idx=0)
    with pytest.raises(ValueError, match=r"layer_idx: .*got 3; the checkpoint has attention tensors of layers "
                                         r"0-1, 7 \(official naming\)"):
        dsv4_jax.load_attention_checkpoint(attn, path, layer_idx=3)


# ---------------------------------------------------------------------------- laziness
def test_reads_only_the_requested_layer(tmp_path, tiny, monkeypatch):
    _, cfg, weights = tiny
    tensors, _ = ckpt_tensors(weights, "official", fp8=True)
    path = write(tmp_path / "one.safetensors", tensors)
    read = []
    original = checkpoint.read_tensor
    monkeypatch.setattr(checkpoint, "read_tensor", lambda ref: read.append(ref.key) or original(ref))
    attn = make_layer(cfg, 2)
    dsv4_jax.load_attention_checkpoint(attn, path)
    assert read and all(k.startswith("layers.2.attn.") for k in read)
    assert len(read) == len(weights[2]) + sum(n in weights[2] for n in FP8)  # each weight and scale once


def test_other_layers_may_be_garbage_or_truncated(tmp_path, tiny):
    _, cfg, weights = tiny
    tensors, reference = ckpt_tensors(weights, "hf", fp8=True)
    shards = {"a.safetensors": by_layer(1), "b.safetensors": by_layer(0), "c.safetensors": lambda k: True}
    root = write(tmp_path / "sharded", tensors, shards)
    (root / "b.safetensors").write_bytes(b"\xff" * 100)  # layer 0's shard is not even a safetensors file
    attn = make_layer(cfg, 1)
    dsv4_jax.load_attention_checkpoint(attn, root)
    assert_loaded(attn, reference[1])
    with pytest.raises(ValueError, match=r"b\.safetensors.*expected a safetensors file"):
        dsv4_jax.load_attention_checkpoint(make_layer(cfg, 0), root)

    # One file, cut short inside another layer's data: the requested layer still loads.
    single = write(tmp_path / "single.safetensors", tensors)
    refs = checkpoint.read_header(str(single))
    end = {i: max(r.stop for k, r in refs.items() if f"layers.{i}.self_attn." in k) for i in range(3)}
    keep = min(end.values())
    layer = min(end, key=end.get)
    assert any(r.stop > keep for r in refs.values())
    with open(single, "r+b") as f:
        f.truncate(keep)
    attn = make_layer(cfg, layer)
    dsv4_jax.load_attention_checkpoint(attn, single)
    assert_loaded(attn, reference[layer])
    other = next(i for i in range(3) if end[i] > keep)
    with pytest.raises(ValueError, match="truncated"):
        dsv4_jax.load_attention_checkpoint(make_layer(cfg, other), single)


# ---------------------------------------------------------------------------- strictness
def test_missing_unknown_misshaped_in_one_error_and_nothing_loaded(tmp_path, tiny):
    _, cfg, weights = tiny
    tensors, _ = ckpt_tensors({1: weights[1]}, "official", fp8=True)
    del tensors["layers.1.attn.indexer.weights_proj.weight"]  # missing
    tensors["layers.1.attn.indexer.bias"] = np.zeros(3, np.float32)  # unknown
    tensors["layers.1.attn.compressor.ape"] = np.zeros((3, 64), np.float32)  # mis-shaped
    del tensors["layers.1.attn.wkv.scale"]  # FP8 without a scale
    tensors["layers.1.attn.wo_b.scale"] = np.zeros((2, 2), ml_dtypes.float8_e8m0fnu)  # scale of the wrong shape
    path = write(tmp_path / "bad.safetensors", tensors)
    attn = make_layer(cfg, 1)
    before = export_hf_attention_weights(attn)
    with pytest.raises(ValueError) as err:
        dsv4_jax.load_attention_checkpoint(attn, path)
    msg = str(err.value)
    for needle in ("missing ['compressor.indexer.scorer.weights_proj.weight']",
                   "unknown ['compressor.indexer.bias' ('layers.1.attn.indexer.bias')]",
                   "'compressor.position_bias' ('layers.1.attn.compressor.ape'): expected shape [4, 64], got [3, 64]",
                   "'kv_proj.weight' ('layers.1.attn.wkv.weight'): F8_E4M3 weight without a block scale",
                   "'layers.1.attn.wo_b.scale': expected shape [1, 1]", "got [2, 2]"):
        assert needle in msg, (needle, msg)
    after = export_hf_attention_weights(attn)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_nonfinite_after_dequantization(tmp_path, tiny):
    _, cfg, weights = tiny
    tensors, _ = ckpt_tensors({0: weights[0]}, "hf", fp8=True)
    tensors["model.layers.0.self_attn.q_b_proj.weight_scale_inv"] = np.full((1, 1), 255, np.uint8).view(
        ml_dtypes.float8_e8m0fnu)  # UE8M0 0xFF is NaN
    path = write(tmp_path / "nan.safetensors", tensors)
    with pytest.raises(ValueError, match=r"'q_b_proj.weight': expected finite values, got 4096 non-finite"):
        dsv4_jax.load_attention_checkpoint(make_layer(cfg, 0), path)


def test_flash_layer_given_pro_tensors_names_the_preset(tmp_path):
    flash, pro = dsv4_jax.DeepseekV4Config.flash(), dsv4_jax.DeepseekV4Config.pro()
    attn = nnx.eval_shape(lambda: dsv4_jax.DeepseekV4Attention(flash, layer_idx=2, rngs=nnx.Rngs(0)))
    shapes = {}
    for name, (shape, _) in expected_shapes(pro, CSA).items():
        key = "layers.2.attn." + HF_TO_OFFICIAL[name]
        quantized = name in FP8
        shapes[key] = (shape, "F8_E4M3" if quantized else "F32" if name in FP32 else "BF16")
        if quantized:
            shapes[key[: -len(".weight")] + ".scale"] = (tuple(-(-s // 128) for s in shape), "F8_E8M0")
    path = header_only_file(tmp_path / "pro-layer2.safetensors", shapes)  # header only: no data is ever read
    with pytest.raises(ValueError) as err:
        dsv4_jax.load_attention_checkpoint(attn, path)
    msg = str(err.value)
    assert "'q_a_proj.weight' ('layers.2.attn.wq_a.weight'): expected shape [1024, 4096], got [1536, 7168]" in msg
    assert "'o_a_proj.weight' ('layers.2.attn.wo_a.weight'): expected shape [8192, 4096], got [16384, 4096]" in msg
    assert "these shapes fit DeepseekV4Config.pro()" in msg


def test_small_config_given_another_configs_checkpoint_points_at_its_config_json(tmp_path, tiny):
    small, _, small_weights = golden("small_seed0.npz")
    _, cfg, _ = tiny
    tensors, _ = ckpt_tensors({1: small_weights[1]}, "hf")
    root = tmp_path / "small"
    write(root, tensors, {"model.safetensors": lambda k: True})
    (root / "config.json").write_text(json.dumps(small.meta["hf_config"]))
    with pytest.raises(ValueError) as err:
        dsv4_jax.load_attention_checkpoint(make_layer(cfg, 1), root)
    msg = str(err.value)
    assert "'q_a_proj.weight': expected shape [32, 64], got [128, 256]" in msg
    assert "these shapes fit DeepseekV4Config.from_hf(json.load(open(" in msg and "config.json" in msg


def test_bad_paths_and_namings(tmp_path, tiny):
    _, cfg, weights = tiny
    attn = make_layer(cfg, 0)
    with pytest.raises(ValueError, match="path: expected an existing"):
        dsv4_jax.load_attention_checkpoint(attn, tmp_path / "nope.safetensors")
    with pytest.raises(ValueError, match="without any"):
        dsv4_jax.load_attention_checkpoint(attn, tmp_path)
    (tmp_path / "x.safetensors").write_bytes(b"12345")
    with pytest.raises(ValueError, match="expected a safetensors file"):
        dsv4_jax.load_attention_checkpoint(attn, tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match="path: expected a file or directory path"):
        dsv4_jax.load_attention_checkpoint(attn, 3)
    with pytest.raises(ValueError, match="layer_idx: expected a non-negative int"):
        dsv4_jax.load_attention_checkpoint(attn, tmp_path, layer_idx=-1)
    hf, _ = ckpt_tensors({0: weights[0]}, "hf")
    official, _ = ckpt_tensors({0: weights[0]}, "official")
    both = write(tmp_path / "both.safetensors", {**hf, **official})
    with pytest.raises(ValueError, match="expected one naming for layer 0, got both"):
        dsv4_jax.load_attention_checkpoint(attn, both)
