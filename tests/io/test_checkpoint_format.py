"""The checkpoint reader refuses what the safetensors format forbids, and index files that lead
outside the checkpoint.

Each refusal is a `ValueError` naming the file (or index) and the offending tensor (or entry).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import dsv4_jax
from dsv4_jax.io import checkpoint


def safetensors_bytes(entries: dict, data: bytes) -> bytes:
    header = json.dumps(entries).encode()
    return len(header).to_bytes(8, "little") + header + data


def write(path, entries, data=b"\0" * 32):
    path.write_bytes(safetensors_bytes(entries, data))
    return str(path)


def f32(begin, end, shape=(2,)):
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, end]}


def test_a_well_formed_file_is_read(tmp_path):
    # The header's order is free; the data's is what must tile.
    path = write(tmp_path / "ok.safetensors", {"b": f32(8, 16), "a": f32(0, 8), "__metadata__": {}},
                 np.arange(4, dtype="<f4").tobytes())
    refs = checkpoint.read_header(path)
    np.testing.assert_array_equal(checkpoint.read_tensor(refs["b"]), [2.0, 3.0])


@pytest.mark.parametrize("entries, data, message", [
    ({"a": f32(8, 16)}, 16, r"expected tensor 'a' to start at the start of the data.*gap"),
    ({"a": f32(0, 8), "b": f32(4, 12)}, 12, r"expected tensor 'b' to start at data offset 8.*overlaps"),
    ({"a": f32(0, 8), "b": f32(12, 20)}, 20, r"expected tensor 'b' to start at data offset 8.*gap"),
    ({"a": f32(0, 12)}, 12, r"'a'.*expected 8 bytes for F32 \[2\], the header gives 12"),
    ({"a": f32(0, 8)}, 16, r"expected the tensors to end where the file ends.*8 bytes after the last tensor"),
    ({"a": f32(-8, 8)}, 16, r"malformed header entry for 'a'"),
    ({"a": f32(8, 0)}, 16, r"malformed header entry for 'a'"),
    ({"a": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}}, 8, r"malformed header entry for 'a'"),
    ({"a": {"dtype": 3, "shape": [2], "data_offsets": [0, 8]}}, 8, r"malformed header entry for 'a'"),
])
def test_offsets_must_tile_the_data_exactly(tmp_path, entries, data, message):
    path = write(tmp_path / "bad.safetensors", entries, b"\0" * data)
    with pytest.raises(ValueError, match=rf"checkpoint (file|tensor).*{message}"):
        checkpoint.read_header(path)


def test_offsets_pointing_back_into_the_header_are_refused(tmp_path):
    # Offsets are relative to the end of the header: a negative one would read the header as data.
    path = write(tmp_path / "back.safetensors", {"a": {"dtype": "U8", "shape": [8], "data_offsets": [-8, 0]}},
                 b"")
    with pytest.raises(ValueError, match="malformed header entry for 'a'"):
        checkpoint.read_header(path)


@pytest.fixture()
def tiny_layer():
    return dsv4_jax.DeepseekV4Attention(dsv4_jax.DeepseekV4Config.tiny(), 0, rngs=dsv4_jax_rngs())


def dsv4_jax_rngs():
    from flax import nnx

    return nnx.Rngs(0)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../x.safetensors"])
def test_index_shards_outside_the_checkpoint_directory_are_refused(tmp_path, tiny_layer, shard):
    root = tmp_path / "ckpt"
    root.mkdir()
    write(tmp_path / "outside.safetensors", {"a": f32(0, 8)}, b"\0" * 8)
    (root / checkpoint.INDEX_FILE).write_text(json.dumps(
        {"weight_map": {"model.layers.0.self_attn.sinks": shard}}))
    with pytest.raises(ValueError, match=r"checkpoint index .*expected weight_map\['model.layers.0.self_attn.sinks'\] "
                                         r"to name a file inside the checkpoint directory"):
        dsv4_jax.load_attention_checkpoint(tiny_layer, root)


def test_index_symlink_leading_out_is_refused(tmp_path, tiny_layer):
    root = tmp_path / "ckpt"
    root.mkdir()
    write(tmp_path / "outside.safetensors", {"a": f32(0, 8)}, b"\0" * 8)
    os.symlink(tmp_path / "outside.safetensors", root / "link.safetensors")
    (root / checkpoint.INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "link.safetensors"}}))
    with pytest.raises(ValueError, match="to name a file inside the checkpoint directory"):
        dsv4_jax.load_attention_checkpoint(tiny_layer, root)


@pytest.mark.parametrize("index, message", [
    ({"weight_map": ["a.safetensors"]}, r"expected 'weight_map' to map tensor names to shard files, got list"),
    ({"weight_map": {"x": 3}}, r"expected weight_map\['x'\] to be a shard file name, got 3"),
    ({"weight_map": {"x": None}}, r"expected weight_map\['x'\] to be a shard file name, got None"),
    ({"weight_map": {"x": ""}}, r"expected weight_map\['x'\] to be a shard file name, got ''"),
    ([1, 2], r"expected JSON with a 'weight_map'"),
])
def test_a_malformed_index_is_a_value_error_naming_it(tmp_path, tiny_layer, index, message):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / checkpoint.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"checkpoint index .*{checkpoint.INDEX_FILE}.*{message}"):
        dsv4_jax.load_attention_checkpoint(tiny_layer, root)
