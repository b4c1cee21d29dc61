"""Many devices (`dsv4_jax.step.sharding`) on 8 CPU devices: a sharded layer equals one device.

jax fixes its device count when its backend starts, and the rest of the suite runs on one
CPU device in the same pytest process; so `test_on_8_cpu_devices` runs this file again in a
subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the other tests skip
in the one-device process), started with the session beside the in-process tests (a job of
helpers.JOBS). Run directly on 8 devices, the tests run as themselves:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest tests/step/test_sharding.py

Checked: every mode (none with XLA or native selection, narrow on host and device, wide) x
layer type under a data mesh (8 x 1) and a data x model mesh (4 x 2) equals one device within
1e-5 with identical picks, and so do the wide break's gradients; outputs, cache leaves and
parameters keep their shardings; a host break runs once per batch shard on that shard's rows
(not once on the gathered batch, not on every model replica); the device break is a custom
call on per-shard shapes inside a manual (shard_map) region; XLA reports no involuntary full
rematerialization; under `nnx.jit` / `jax.jit`, from ``jax.set_mesh`` and from a sharded cache;
the error paths.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import JOBS, assert_trees_close, background, execution, random_layer
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dsv4_jax
from dsv4_jax import CSA, HCA, SLIDING
from dsv4_jax.step import breaks, sharding
from dsv4_jax.step.pure_step import step_function

DEVICES = 8
ON_8 = jax.device_count() >= DEVICES
needs_8 = pytest.mark.skipif(not ON_8, reason="runs in the 8-device subprocess of test_on_8_cpu_devices")

TINY = dsv4_jax.DeepseekV4Config.tiny()  # 4 heads, 2 output groups, window 8, CSA 4:1 top-4, HCA 8:1
LAYER = {TINY.layer_type(i): i for i in range(TINY.num_layers)}
BATCH, N, MAX_LEN = 8, 24, 32  # 24 tokens: past the window, 6 CSA entries (> top-4), 3 HCA entries
MODES = ("none", "none-native", "narrow-host", "narrow-device", "wide")
MESHES = {"data": (8, 1), "data_model": (4, 2)}
TOL = dict(rtol=1e-5, atol=1e-5)


_ENV_8 = dict(os.environ)
_ENV_8["XLA_FLAGS"] = (_ENV_8.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}").strip()
# The 8 host devices share 2 cores with the rest of the suite: a collective whose threads wait
# longer than XLA:CPU's 40 s rendezvous limit aborts the process (seen once under load).
_ENV_8["XLA_FLAGS"] += " --xla_cpu_collective_call_terminate_timeout_seconds=600"


@pytest.mark.skipif(ON_8, reason="already on 8 devices: the tests below run here")
# -s: XLA's warnings reach this process's view of the subprocess's stderr.
@background("sharding-on-8-devices", lambda _: [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                                                __file__],
            when=not ON_8, cwd=Path(__file__).resolve().parents[2], env=_ENV_8, timeout=900)
def test_on_8_cpu_devices():
    """This file on 8 fake CPU devices, in a subprocess; fails with its output if any test fails."""
    proc = JOBS.by_name["sharding-on-8-devices"].result()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-12000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, output[-4000:]
    # The symptom of a break run on a gathered global batch (jax 0.10: one warning per gathered value).
    assert "Involuntary full rematerialization" not in output, output[-12000:]


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def host_calls():
    """The batch size of every host break's callback as it runs (narrow host, wide).

    `breaks._on_host` (which makes the callback's host function when a step is traced) wrapped
    for the whole module, so every step compiled here records its host calls."""
    calls: list[int] = []
    original = breaks._on_host

    def recording(fn, where):
        host_fn = original(fn, where)

        def counted(*args):
            calls.append(int(np.shape(jax.tree.leaves(args)[0])[0]))  # queries / q_residual: [B, ...]
            return host_fn(*args)

        return counted

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(breaks, "_on_host", recording)
        yield calls


def _mesh(name):
    return sharding.make_mesh(*MESHES[name])


def _inputs(n=N, start=0, batch=BATCH):
    x = np.random.default_rng(start).standard_normal((batch, n, TINY.hidden_size)).astype(np.float32)
    return x, np.broadcast_to(np.arange(start, start + n, dtype=np.int32), (batch, n))


def _layer(layer_type, mode, mesh=None):
    """The test's layer (random weights, seed 7), on `mesh` when given (`shard_layer` after the
    weights are drawn: assigning a parameter replaces its placement)."""
    attn = random_layer(TINY, LAYER[layer_type], seed=7, **execution(mode))
    return attn if mesh is None else sharding.shard_layer(attn, mesh)


_REFERENCE: dict = {}


def _reference(layer_type):
    """One device, break_mode="none" with the XLA selection: (prefill out, cache[, intermediates]).

    The reference for every mode (on one device the modes agree: identical picks, outputs
    within float32 rounding; test_attention.py and test_golden_record.py check that)."""
    key = layer_type
    if key not in _REFERENCE:
        attn = _layer(layer_type, "none")
        x, pos = _inputs()
        result = attn(x, pos, attn.init_cache(BATCH, MAX_LEN), return_intermediates=layer_type == CSA)
        _REFERENCE[key] = jax.tree.map(np.asarray, result)
    return _REFERENCE[key]


def _assert_close_trees(got, expected, what):
    assert_trees_close(got, expected, what, **TOL)


def _placed(array, mesh, *spec) -> bool:
    """`array` is laid out as ``NamedSharding(mesh, P(*spec))`` (jax may spell an equivalent spec
    differently, e.g. drop a size-1 axis)."""
    return array.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), array.ndim)


def _assert_cache_sharding(new, old, mesh):
    """Every device leaf of `new` has the sharding of the same leaf of `old`: batch over "data"."""
    pairs = list(zip(jax.tree.leaves(new.replace(length=None)), jax.tree.leaves(old.replace(length=None))))
    assert pairs
    for n, o in pairs:
        assert n.sharding.is_equivalent_to(o.sharding, n.ndim) and _placed(n, mesh, "data"), (n.sharding, o.sharding)


def _expected_host_calls(mode, layer_type, mesh_name):
    """A host break runs once per batch shard, on its rows (narrow: CSA only; wide: every type)."""
    if mode == "wide" or (mode == "narrow-host" and layer_type == CSA):
        data = MESHES[mesh_name][0]
        return [BATCH // data] * data
    return []


# ---------------------------------------------------------------------------- specs
@needs_8
def test_partition_specs_come_from_the_parameters_metadata():
    mesh = _mesh("data_model")
    attn = random_layer(TINY, LAYER[CSA], seed=1)
    specs = {".".join(map(str, path)): var.get_value() for path, var in
             nnx.to_flat_state(sharding.param_partition_specs(attn, mesh))}
    assert specs["q_b_proj"] == P(None, "model")  # head-major columns
    assert specs["sinks"] == P("model")
    assert specs["o_a_proj"] == P("model", None, None) and specs["o_b_proj"] == P("model", None)  # by groups
    assert specs["q_a_proj"] == specs["kv_proj"] == specs["compressor.kv_proj"] == P(None, None)
    assert specs["indexer.q_b_proj"] == specs["indexer.weights_proj"] == P(None, None)  # replicated
    # The logical axes live on the parameters; the rules are a table the caller may change.
    assert attn.q_b_proj.get_metadata()["out_sharding"] == ("q_lora", "heads")
    custom = sharding.param_partition_specs(attn, mesh, rules=[("heads", None), ("o_groups", None)])
    assert all(var.get_value() == P(*[None] * len(var.get_value())) for _, var in nnx.to_flat_state(custom))
    # A data-only mesh (no "model" axis) replicates the heads.
    only_data = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(8), ("data",),
                                  axis_types=(jax.sharding.AxisType.Auto,))
    q_b = [v.get_value() for p, v in nnx.to_flat_state(sharding.param_partition_specs(attn, only_data))
           if p == ("q_b_proj",)]
    assert q_b == [P(None, None)]
    cache = attn.init_cache(BATCH, MAX_LEN)
    cache_specs = sharding.cache_partition_specs(cache, mesh)
    assert jax.tree.leaves(cache_specs, is_leaf=lambda s: isinstance(s, P)) == [P("data")] * len(jax.tree.leaves(cache))


@needs_8
def test_shard_layer_places_parameters_and_init_cache_shards_the_cache():
    mesh = _mesh("data_model")
    attn = random_layer(TINY, LAYER[CSA], seed=1)
    before = jax.tree.map(np.asarray, attn.weights())
    assert sharding.shard_layer(attn, mesh) is attn and attn.mesh is mesh
    w = attn.weights()
    assert _placed(w.q_b_proj, mesh, None, "model")
    assert w.indexer.q_b_proj.sharding.is_fully_replicated and w.indexer.q_b_proj.sharding.mesh == mesh
    _assert_close_trees(w, before, "values unchanged")
    cache = attn.init_cache(BATCH, MAX_LEN)
    assert isinstance(cache.length, np.ndarray)  # the eager call's host mirror stays on the host
    _assert_cache_sharding(cache, cache, mesh)
    built = dsv4_jax.DeepseekV4Attention(TINY, LAYER[CSA], rngs=nnx.Rngs(1), mesh=mesh)
    assert _placed(built.weights().sinks, mesh, "model")
    # Re-sharding a placed layer (its arrays committed to the first mesh's devices) onto
    # another mesh replaces the arrays; it does not write into the old ones.
    other = sharding.make_mesh(2, 2, devices=jax.devices()[4:])
    sharding.shard_layer(attn, other)
    assert _placed(attn.weights().q_b_proj, other, None, "model")
    _assert_close_trees(attn.weights(), before, "values unchanged after re-sharding")


# ---------------------------------------------------------------------------- = one device
@needs_8
@pytest.mark.parametrize(("mesh_name", "layer_type", "mode"), [
    (mesh_name, layer_type, mode) for mesh_name in MESHES for layer_type in (SLIDING, CSA, HCA) for mode in MODES
    # A covering set (compile time: this file runs in about a minute on two cores). The native
    # "none" selection is the device break's handler with another trait: the data x model mesh
    # covers it. A layer without an indexer has nothing to break out: every mode but wide runs
    # "none"'s step (test_attention.py::test_layers_without_indexer_share_the_none_step).
    if not (mesh_name == "data" and mode == "none-native") and (layer_type == CSA or mode in ("none", "wide"))
])
def test_sharded_layer_equals_one_device(mesh_name, layer_type, mode, host_calls):
    expected = _reference(layer_type)
    mesh = _mesh(mesh_name)
    attn = _layer(layer_type, mode, mesh)
    cache = attn.init_cache(BATCH, MAX_LEN)
    x, pos = _inputs()
    host_calls.clear()
    result = attn(x, pos, cache, return_intermediates=layer_type == CSA)
    jax.block_until_ready(result)
    assert host_calls == _expected_host_calls(mode, layer_type, mesh_name)

    _assert_close_trees(result[0], expected[0], "out")
    _assert_close_trees(result[1], expected[1], "cache")
    assert _placed(result[0], mesh, "data")
    _assert_cache_sharding(result[1], cache, mesh)
    if layer_type == CSA:
        inter = result[2]
        np.testing.assert_array_equal(np.asarray(inter.topk), expected[2].topk)  # identical picks
        assert (np.asarray(inter.topk) >= 0).any()
        _assert_close_trees(inter, expected[2], "intermediates")
        assert _placed(inter.topk, mesh, "data")
        assert _placed(inter.queries, mesh, "data", None, "model")  # heads stay split
    assert _placed(attn.weights().q_b_proj, mesh, None, "model")


@needs_8
@pytest.mark.parametrize("mode", ["narrow-host", "wide"])
def test_decode_steps_continue_the_sharded_cache(mode, host_calls):
    mesh = _mesh("data_model")
    ref = _layer(CSA, "none")  # one device
    attn = _layer(CSA, mode, mesh=mesh)
    x, pos = _inputs()
    _, cache_ref, _ = ref(x, pos, ref.init_cache(BATCH, MAX_LEN), return_intermediates=True)
    cache0 = attn.init_cache(BATCH, MAX_LEN)
    _, cache, _ = attn(x, pos, cache0, return_intermediates=True)
    jax.block_until_ready(cache)  # its host calls are done before the decode steps' are counted
    for step in range(2):
        x1, p1 = _inputs(1, start=N + step)
        out_ref, cache_ref = ref(x1, p1, cache_ref)
        host_calls.clear()
        out, cache = attn(x1, p1, cache)
        jax.block_until_ready((out, cache))
        assert host_calls == _expected_host_calls(mode, CSA, "data_model")
        _assert_close_trees(out, out_ref, f"decode {step} out")
        _assert_close_trees(cache, cache_ref, f"decode {step} cache")
        assert _placed(out, mesh, "data")
        _assert_cache_sharding(cache, cache0, mesh)


# ---------------------------------------------------------------------------- where the break runs
@needs_8
@pytest.mark.parametrize(("mode", "target"), [
    ("narrow-device", "@dsv4_select_topk("),  # the eager device break
    ("none-native", "@dsv4_select_topk_graph("),  # the graph-compatible handler of "none"
    ("narrow-host", "callback"),  # the host callback
])
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_the_break_is_a_per_shard_call_in_a_manual_region(mesh_name, mode, target):
    """The lowered step: the selection's custom call sits inside a shard_map (manual) region
    over every mesh axis, on the shard's rows (batch 8 / data), never on the global batch."""
    mesh = _mesh(mesh_name)
    attn = _layer(CSA, mode, mesh=mesh)
    x, pos = _inputs()
    text = step_function(sharded=True).lower(attn.weights(), attn.init_cache(BATCH, MAX_LEN), jnp.asarray(x),
                                             jnp.asarray(pos), spec=attn.step_spec()).as_text()
    lines = text.splitlines()
    calls = [i for i, ln in enumerate(lines) if "stablehlo.custom_call" in ln and target in ln]
    assert len(calls) == 1, calls
    manual = [i for i, ln in enumerate(lines) if "sdy.manual_computation" in ln and i < calls[0]]
    assert manual and 'manual_axes={"data", "model"}' in lines[manual[-1]]
    local = BATCH // MESHES[mesh_name][0]
    operands = lines[calls[0]].rsplit(" : (", 1)[1]
    assert operands.startswith(f"tensor<{local}x{N}x{TINY.index_n_heads}x"), operands[:80]  # the shard's queries


@needs_8
@pytest.mark.parametrize("layer_type", [CSA, HCA])
def test_cache_writes_stay_on_their_batch_shard(layer_type):
    """A decode step on a data mesh compiles without collectives: the cache writes (per-row
    scatters, `backend.scatter_rows`) stay on the shard that holds the row."""
    mesh = _mesh("data")
    attn = _layer(layer_type, "none", mesh=mesh)
    x, pos = _inputs()
    _, cache = attn(jnp.asarray(x), jnp.asarray(pos), attn.init_cache(BATCH, MAX_LEN))
    step_x = jnp.asarray(x[:, :1])
    step_pos = jnp.full((BATCH, 1), N, jnp.int32)
    compiled = step_function(sharded=True).lower(attn.weights(), cache.replace(layer_idx=-1), step_x, step_pos,
                                                 spec=attn.step_spec()).compile().as_text()
    collectives = [ln.strip()[:120] for ln in compiled.splitlines()
                   if any(op in ln for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute"))]
    assert not collectives, collectives[:5]


@needs_8
def test_the_wide_break_differentiates_on_a_mesh():
    """The wide break's backward (the VJP of its stages traced in the graph) on a mesh, its
    callback run per batch shard: the one-device gradient of break_mode="none"."""
    x, pos = (jnp.asarray(a) for a in _inputs())

    def grads(attn):
        cache = attn.init_cache(BATCH, MAX_LEN)
        return nnx.grad(lambda layer: jnp.mean(layer(x, pos, cache)[0].astype(jnp.float32) ** 2))(attn)

    want = grads(_layer(CSA, "none"))
    got = grads(_layer(CSA, "wide", mesh=_mesh("data_model")))
    assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want)) > 0
    _assert_close_trees(got, want, "gradients")


# ---------------------------------------------------------------------------- how the mesh arrives
@needs_8
@pytest.mark.parametrize(("mode", "wrapper"), [("narrow-host", "nnx.jit"), ("wide", "jax.jit in set_mesh")])
def test_under_a_users_jit(mode, wrapper, host_calls):
    """nnx.jit of a layer with ``attn.mesh``; jax.jit of a layer without, inside ``jax.set_mesh``
    (the layer then sees the abstract mesh of the trace)."""
    mesh = _mesh("data_model")
    expected = _reference(CSA)
    x, pos = _inputs()
    if wrapper == "nnx.jit":
        attn = _layer(CSA, mode, mesh=mesh)
        cache = attn.init_cache(BATCH, MAX_LEN)
        fn, first = nnx.jit(lambda layer, *a: layer(*a, return_intermediates=True)), attn
        context = contextlib.nullcontext()
    else:
        attn = _layer(CSA, mode)
        cache = sharding.shard_cache(attn.init_cache(BATCH, MAX_LEN), mesh)
        graphdef, first = nnx.split(attn)
        fn = jax.jit(lambda state, *a: nnx.merge(graphdef, state)(*a, return_intermediates=True))
        context = jax.set_mesh(mesh)
    host_calls.clear()
    with context:
        out, new_cache, inter = fn(first, jnp.asarray(x), jnp.asarray(pos), cache)
        jax.block_until_ready(out)
    assert host_calls == _expected_host_calls(mode, CSA, "data_model")
    _assert_close_trees(out, expected[0], "out")
    np.testing.assert_array_equal(np.asarray(inter.topk), expected[2].topk)
    _assert_close_trees(new_cache.replace(length=np.asarray(new_cache.length)), expected[1], "cache")
    assert _placed(out, mesh, "data")
    assert _placed(new_cache.length, mesh, "data")  # under jit, length is on device
    _assert_cache_sharding(new_cache, cache, mesh)


@needs_8
def test_mesh_from_set_mesh_and_from_the_cache(host_calls):
    """A layer without a mesh of its own: it takes ``jax.set_mesh``'s, else (eager) the cache's."""
    mesh = _mesh("data_model")
    expected = _reference(CSA)
    attn = _layer(CSA, "narrow-host")
    assert attn.mesh is None
    cache = sharding.shard_cache(attn.init_cache(BATCH, MAX_LEN), mesh)
    x, pos = _inputs()
    with jax.set_mesh(mesh):
        assert attn.step_spec().plan.layout.mesh == mesh
        host_calls.clear()
        out, new_cache, inter = attn(x, pos, cache, return_intermediates=True)
        jax.block_until_ready(out)
    assert host_calls == [2, 2, 2, 2]
    _assert_close_trees((out, new_cache, inter), expected, "set_mesh")
    assert attn.step_spec().plan.layout is None  # outside the context: no mesh
    host_calls.clear()
    out, new_cache, inter = attn(x, pos, cache, return_intermediates=True)  # the cache's mesh
    jax.block_until_ready(out)
    assert host_calls == [2, 2, 2, 2]
    _assert_close_trees(out, expected[0], "from the cache")
    assert _placed(out, mesh, "data")
    _assert_cache_sharding(new_cache, cache, mesh)


@needs_8
def test_a_layer_on_a_mesh_exports_its_one_device_step():
    from dsv4_jax.io.export import export_step

    attn = _layer(CSA, "narrow-device", _mesh("data_model"))
    exported = export_step(attn, (BATCH, N, TINY.hidden_size), attn.init_cache(BATCH, MAX_LEN))
    text = exported.mlir_module()
    assert "@dsv4_select_topk(" in text and "manual_computation" not in text and exported.nr_devices == 1


# ---------------------------------------------------------------------------- errors
@needs_8
def test_bad_meshes_and_batches():
    cfg_layer = LAYER[CSA]
    with pytest.raises(ValueError, match=r"mesh: expected the 'model' axis .* to divide o_groups \(2\), got size 4"):
        dsv4_jax.DeepseekV4Attention(TINY, cfg_layer, rngs=nnx.Rngs(0), mesh=sharding.make_mesh(2, 4))
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\), got size 8"):
        sharding.shard_layer(random_layer(TINY, cfg_layer), sharding.make_mesh(1, 8))
    explicit = jax.make_mesh((4, 2), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match=r"mesh: expected axes of type AxisType.Auto.*make_mesh"):
        sharding.shard_layer(random_layer(TINY, cfg_layer), explicit)
    with pytest.raises(TypeError, match=r"mesh: expected a jax.sharding.Mesh, got tuple"):
        sharding.shard_layer(random_layer(TINY, cfg_layer), (4, 2))
    with pytest.raises(TypeError, match=r"sharding_rules: expected \(logical axis, mesh axis or None\) pairs"):
        sharding.shard_layer(random_layer(TINY, cfg_layer), sharding.make_mesh(4, 2), rules=[1, 2])
    with pytest.raises(ValueError, match=r"data, model: expected data \* model == 8 devices, got 4 \* 4"):
        sharding.make_mesh(4, 4)

    attn = random_layer(TINY, cfg_layer, mesh=sharding.make_mesh(4, 2))
    with pytest.raises(ValueError, match=r"batch_size: expected a batch size divisible by the mesh's 'data' "
                                         r"axis \(4\), got 6"):
        attn.init_cache(6, MAX_LEN)
    attn.mesh = None  # a cache made without the mesh, then a call on it
    cache = attn.init_cache(6, MAX_LEN)
    attn.mesh = sharding.make_mesh(4, 2)
    x, pos = _inputs(batch=6)
    with pytest.raises(ValueError, match=r"hidden_states: expected a batch size divisible by the mesh's 'data' "
                                         r"axis \(4\), got 6"):
        attn(x, pos, cache)


@needs_8
@pytest.mark.parametrize("layer_type", [CSA])
def test_fp8_caches_on_a_mesh(layer_type):
    """FP8 caches (`dsv4_jax.cache.quantized`) batch-sharded like every cache leaf: a prefill and
    a decode step on the (4, 2) mesh give the bf16 cache's outputs, bit for bit, and every
    stored (non-empty) array of the new cache stays split over "data". The CSA layer's cache
    holds every kind of leaf an HCA cache holds (window, compressed entries, compressor state)
    and the indexer's: HCA on a mesh adds compiles, not leaves."""
    mesh = _mesh("data_model")
    x, pos = _inputs()
    step_x, step_pos = jnp.asarray(x[:, :1]), jnp.full((BATCH, 1), N, jnp.int32)
    outs = {}
    for kind in ("auto", "fp8"):
        attn = sharding.shard_layer(random_layer(TINY, LAYER[layer_type], seed=7, numerics="official"), mesh)
        out, cache = attn(jnp.asarray(x), jnp.asarray(pos), attn.init_cache(BATCH, MAX_LEN, kv_cache_dtype=kind))
        out2, cache = attn(step_x, step_pos, cache)
        outs[kind] = (np.asarray(out), np.asarray(out2))
    for a, b in zip(outs["auto"], outs["fp8"]):
        np.testing.assert_array_equal(b, a)
    for leaf in jax.tree.leaves(cache.replace(length=None)):
        # (the indexer keys' RoPE part is empty, [B, N, 0]: XLA gives it no sharding to keep)
        assert leaf.size == 0 or _placed(leaf, mesh, "data"), leaf.sharding
