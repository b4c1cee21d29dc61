"""`dsv4_jax.io.export`: the layer's step through `jax.export`, serialized and deserialized.

The deserialized step runs and gives what the layer's own call gives (outputs, cache,
intermediates), for ``break_mode="none"`` and for the native device break (also in a fresh
process, where only `deserialize_step` registers the native target); every library pytree
round-trips through serialization; host break modes are refused with a ValueError naming
``break_mode``.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import NATIVE_BUILT, assert_trees_close, execution, random_layer

import dsv4_jax
from dsv4_jax import CSA, HCA, SLIDING
from dsv4_jax.io.export import PYTREES, deserialize_step, export_step, serialize_step

TINY = dsv4_jax.DeepseekV4Config.tiny()  # window 8, CSA ratio 4 with top-4, HCA ratio 8
BATCH, N, MAX_LEN = 2, 24, 32  # 24 tokens -> 6 CSA entries (> top-4), 3 HCA entries
LAYER = {TINY.layer_type(i): i for i in range(TINY.num_layers)}


def _inputs(n=N, start=0):
    x = np.random.default_rng(start).standard_normal((BATCH, n, TINY.hidden_size)).astype(np.float32)
    return x, np.broadcast_to(np.arange(start, start + n, dtype=np.int32), (BATCH, n))


def _assert_trees_equal(got, expected, what):
    assert_trees_close(got, expected, what, rtol=1e-6, atol=1e-6, same_dtypes=True)


@pytest.mark.parametrize(("layer_type", "with_intermediates"), [(CSA, True), (HCA, False)])
def test_deserialized_step_equals_the_layer_call(layer_type, with_intermediates):
    attn = random_layer(TINY, LAYER[layer_type], seed=5, break_mode="none", kernels="xla")
    cache = attn.init_cache(BATCH, MAX_LEN)
    x, positions = _inputs()
    exported = export_step(attn, x.shape, cache, return_intermediates=with_intermediates)
    blob = serialize_step(exported)
    assert isinstance(blob, bytes)  # what it holds is proven below: the step it gives back runs as the layer
    step = deserialize_step(blob)
    assert step.in_tree == exported.in_tree and step.out_tree == exported.out_tree

    out, new_cache, inter = step.call(attn.weights(), cache, jnp.asarray(x), jnp.asarray(positions))
    expected = attn(x, positions, cache, return_intermediates=with_intermediates)
    _assert_trees_equal(out, expected[0], "out")
    _assert_trees_equal(new_cache.replace(length=np.asarray(new_cache.length)), expected[1], "cache")
    assert isinstance(new_cache, dsv4_jax.AttentionCache) and new_cache.layer_idx == cache.layer_idx
    if with_intermediates:
        assert isinstance(inter, dsv4_jax.Intermediates)
        _assert_trees_equal(inter, expected[2], "intermediates")
        assert np.asarray(inter.topk).max() >= 0
    else:
        assert inter is None


def test_exported_decode_step_continues_a_cache():
    """Prefill with the layer, then a decode step exported separately (its own call shape)."""
    attn = random_layer(TINY, LAYER[CSA], seed=6, break_mode="none", kernels="xla")
    x, positions = _inputs()
    _, cache = attn(x, positions, attn.init_cache(BATCH, MAX_LEN))
    x1, p1 = _inputs(1, start=N)
    step = deserialize_step(serialize_step(export_step(attn, x1.shape, cache)))
    out, new_cache, _ = step.call(attn.weights(), cache, jnp.asarray(x1), jnp.asarray(p1))
    out_ref, cache_ref = attn(x1, p1, cache)
    _assert_trees_equal(out, out_ref, "decode out")
    np.testing.assert_array_equal(np.asarray(new_cache.length), N + 1)
    _assert_trees_equal(new_cache.replace(length=np.asarray(new_cache.length)), cache_ref, "decode cache")


@pytest.mark.parametrize("mode", ["none", "narrow-device"])
def test_an_exported_decode_step_runs_on_a_paged_cache(mode):
    """The same step on a paged cache: the pages reserved before the call (nothing takes pages
    inside a compiled step), the layer's own call's output and cache; the native device break
    keeps its paged target (the keys read in their pages)."""
    attn = random_layer(TINY, LAYER[CSA], seed=6, **execution(mode))
    x, positions = _inputs()
    _, cache = attn(x, positions, attn.init_cache(BATCH, MAX_LEN, page_size=16))
    cache = dsv4_jax.reserve_pages(cache, 1)
    x1, p1 = _inputs(1, start=N)
    exported = export_step(attn, x1.shape, cache)
    assert ("@dsv4_select_topk_paged(" in exported.mlir_module()) == (mode == "narrow-device")
    step = deserialize_step(serialize_step(exported))
    out, new_cache, _ = step.call(attn.weights(), cache, jnp.asarray(x1), jnp.asarray(p1))
    out_ref, cache_ref = attn(x1, p1, cache)
    _assert_trees_equal(out, out_ref, "decode out")
    _assert_trees_equal(new_cache.replace(length=np.asarray(new_cache.length), pages=cache_ref.pages), cache_ref,
                        "decode cache")


def test_every_library_pytree_round_trips():
    """All eight pytrees (static fields included) as the inputs and outputs of an exported function
    (a paged FP8 cache brings `QuantizedRows` and `PageTable`)."""
    attn = random_layer(TINY, LAYER[CSA], seed=5, break_mode="none", kernels="xla", numerics="official")
    cache = attn.init_cache(BATCH, MAX_LEN, kv_cache_dtype="fp8", page_size=16).replace(layer_idx=1)
    inter = dsv4_jax.Intermediates(*[np.full((2,), i, np.float32) for i in range(10)])
    trees = (attn.weights(), cache, inter)
    w = trees[0]
    nodes = (w, w.compressor, w.indexer, cache, cache.indexer, cache.window, cache.pages, inter)
    assert {type(n) for n in nodes} == set(PYTREES)
    exported = jax.export.export(jax.jit(lambda *t: t))(*trees)
    back = deserialize_step(serialize_step(exported))
    assert back.in_tree == jax.tree.structure((trees, {})) and back.out_tree == jax.tree.structure(trees)
    assert back.call(*trees)[1].layer_idx == 1
    _assert_trees_equal(back.call(*trees), trees, "identity")


@pytest.mark.parametrize("kwargs", [
    dict(break_mode="narrow", break_on="host"),
    dict(break_mode="wide"),
])
def test_host_breaks_are_refused(kwargs):
    attn = random_layer(TINY, LAYER[CSA], seed=5, **kwargs)
    cache = attn.init_cache(BATCH, MAX_LEN)
    with pytest.raises(ValueError, match=rf"break_mode: '{kwargs['break_mode']}'.*cannot be (exported|serialized)"):
        export_step(attn, (BATCH, N, TINY.hidden_size), cache)


@pytest.mark.skipif(not NATIVE_BUILT, reason="the native indexer handlers are not built here (pip install -e .)")
@pytest.mark.parametrize("break_on", ["device", "auto"])
def test_the_device_break_step_exports_and_runs(break_on):
    """narrow on the device: the eager-break custom call stays in the module, and the
    deserialized step equals the layer's call (picks included); a decode step continues it."""
    attn = random_layer(TINY, LAYER[CSA], seed=5, break_mode="narrow", break_on=break_on)
    assert attn.step_spec().plan.place == "device"
    cache = attn.init_cache(BATCH, MAX_LEN)
    x, positions = _inputs()
    exported = export_step(attn, x.shape, cache, return_intermediates=True)
    assert "@dsv4_select_topk(" in exported.mlir_module()  # the eager break, not the graph handler
    assert "dsv4_select_topk_graph" not in exported.mlir_module()
    step = deserialize_step(serialize_step(exported))
    out, new_cache, inter = step.call(attn.weights(), cache, jnp.asarray(x), jnp.asarray(positions))
    expected = attn(x, positions, cache, return_intermediates=True)
    _assert_trees_equal(out, expected[0], "out")
    _assert_trees_equal(new_cache.replace(length=np.asarray(new_cache.length)), expected[1], "cache")
    _assert_trees_equal(inter, expected[2], "intermediates")
    assert np.asarray(inter.topk).max() >= 0

    x1, p1 = _inputs(1, start=N)
    decode = deserialize_step(serialize_step(export_step(attn, x1.shape, expected[1])))
    out1, cache1, _ = decode.call(attn.weights(), expected[1], jnp.asarray(x1), jnp.asarray(p1))
    out1_ref, cache1_ref = attn(x1, p1, expected[1])
    _assert_trees_equal(out1, out1_ref, "decode out")
    _assert_trees_equal(cache1.replace(length=np.asarray(cache1.length)), cache1_ref, "decode cache")


@pytest.mark.skipif(not NATIVE_BUILT, reason="the native indexer handlers are not built here (pip install -e .)")
def test_the_device_break_step_runs_in_a_fresh_process(tmp_path):
    """Serialized here, called in a new Python process: `deserialize_step` registers the FFI
    target there (a bare `jax.export.deserialize` call fails: no handler for dsv4_select_topk)."""
    attn = random_layer(TINY, LAYER[CSA], seed=8, break_mode="narrow", break_on="device")
    cache = attn.init_cache(BATCH, MAX_LEN)
    x, positions = _inputs()
    (tmp_path / "step.bin").write_bytes(serialize_step(export_step(attn, x.shape, cache)))
    args = jax.tree.map(np.asarray, (attn.weights(), cache, x, positions))
    (tmp_path / "args.pkl").write_bytes(pickle.dumps(args))
    script = textwrap.dedent(f"""
        import pickle, pathlib, sys
        import numpy as np
        from dsv4_jax.io.export import deserialize_step
        root = pathlib.Path({str(tmp_path)!r})
        step = deserialize_step(root.joinpath("step.bin").read_bytes())
        out, cache, _ = step.call(*pickle.loads(root.joinpath("args.pkl").read_bytes()))
        np.save(root / "out.npy", np.asarray(out))
        np.save(root / "entries.npy", np.asarray(cache.indexer.entries))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out, new_cache = attn(x, positions, cache)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), np.asarray(out), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.load(tmp_path / "entries.npy"), np.asarray(new_cache.indexer.entries),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not NATIVE_BUILT, reason="the native indexer handlers are not built here")
def test_native_kernels_of_the_none_step():
    attn = random_layer(TINY, LAYER[CSA], seed=5, break_mode="none")
    cache = attn.init_cache(BATCH, MAX_LEN)
    # kernels="auto": the native graph handler in the layer's own step
    portable = export_step(attn, (BATCH, N, TINY.hidden_size), cache)
    assert "dsv4_select_topk" not in portable.mlir_module()
    native = export_step(attn, (BATCH, N, TINY.hidden_size), cache, native_kernels=True)
    assert "dsv4_select_topk_graph" in native.mlir_module()


def test_a_sliding_layer_in_narrow_mode_exports():
    """No indexer, nothing to break: its "narrow" step is the "none" step."""
    attn = random_layer(TINY, LAYER[SLIDING], seed=5)
    assert attn.break_mode == "narrow"
    cache = attn.init_cache(BATCH, MAX_LEN)
    exported = export_step(attn, (BATCH, N, TINY.hidden_size), cache)
    assert exported.in_tree == jax.tree.structure(((attn.weights(), cache, 0, 0), {}))


def test_bad_arguments():
    attn = random_layer(TINY, LAYER[HCA], seed=5, break_mode="none")
    cache = attn.init_cache(BATCH, MAX_LEN)
    with pytest.raises(ValueError, match="hidden_shape"):
        export_step(attn, (BATCH + 1, N, TINY.hidden_size), cache)
    with pytest.raises(TypeError, match="cache"):
        export_step(attn, (BATCH, N, TINY.hidden_size), {"length": 0})
