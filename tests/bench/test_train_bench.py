"""bench/train.py: forward + backward of N layers in one jax.jit (scenario ``train_step``), tiny config.

The run's records and protocol (timings are not asserted: they belong to the benchmark), that a
failing cell is a record and the run goes on, and that the gradient the benchmark times is the
model's: equal to the gradient of the same loss through the modules' own calls. Where maxtext
is installed (Python >= 3.12, the ``[peers]`` extra), also that MaxText's training-mode layer,
the peer, computes the same loss and input gradient as ours.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_maxtext_peer import needs_maxtext  # noqa: E402

import dsv4_jax  # noqa: E402
from bench import floor, measure, peer_maxtext, train  # noqa: E402
from bench import stack as stack_mod  # noqa: E402
from dsv4_jax.config import CSA, HCA  # noqa: E402


def _flat(tree) -> dict[str, np.ndarray]:
    """Leaves by dotted path; nnx's `.value` suffix dropped, so a State reads as the weights pytree."""
    return {jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value"): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_train_run_writes_records(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert train.main(["--size", "tiny", "--quick", "--stacks", "hca", "--layers", "1", "--lengths", "32",
                       "--peer", "none", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (rec,) = data["records"]
    assert rec["error"] is None, rec["error"]
    assert (rec["scenario"], rec["layer_type"], rec["n_layers"], rec["batch"], rec["prompt_len"]) == (
        "train_step", "HCA", 1, 1, 32)
    assert (rec["size"], rec["dtype"], rec["remat"], rec["break_mode"], rec["kernels"]) == (
        "tiny", "float32", "none", "narrow", "auto")
    assert rec["fwd_ms"] > 0 and rec["fwd_bwd_ms"] > 0 and rec["compile_s"] > 0 and rec["fwd_compile_s"] > 0
    assert rec["ratio_bwd_to_fwd"] == pytest.approx(rec["fwd_bwd_ms"] / rec["fwd_ms"])
    assert rec["fwd_floor_ms"] > 0 and rec["floor_ms"] == pytest.approx(3 * rec["fwd_floor_ms"])
    assert rec["ratio_to_floor"] is None  # an H200 floor: no ratio on a CPU
    assert np.isfinite(rec["loss"]) and rec["loss"] > 0
    assert rec["grads_finite"] and np.isfinite(rec["grad_norm"]) and rec["grad_norm"] > rec["grad_norm_x"] > 0
    assert rec["peak_gb"] == rec["xla_total_gb"] and rec["xla_total_gb"] >= rec["xla_temp_gb"] > 0
    if shutil.which("nvidia-smi") is None:  # the card's clocks are sampled where nvidia-smi runs
        assert rec["gpu_clocks_fwd"] is None and rec["gpu_clocks_fwd_bwd"] is None
    else:
        assert "samples" in rec["gpu_clocks_fwd"] and "samples" in rec["gpu_clocks_fwd_bwd"]
    assert data["meta"]["remat"] == "none" and data["meta"]["peer"] == "none" and data["meta"]["git_commit"]
    capsys.readouterr()
    assert train.main(["--render", str(out)]) == 0
    assert "| hca | HCA | 1 | 32 |" in capsys.readouterr().out


def test_a_failing_cell_is_a_record_and_the_run_goes_on(monkeypatch, tmp_path):
    """Out of memory at B = 4 (after the forward ran): that record keeps the forward and the
    error's first line; the next cell runs."""
    def fake(rec, stack, batch, length, repeats, seed, remat):
        rec.update(fwd_ms=1.0)
        if batch == 4:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9 GB.\nBuffer details")
        rec.update(fwd_bwd_ms=3.0, ratio_bwd_to_fwd=3.0)

    monkeypatch.setattr(train, "time_train", fake)
    out = tmp_path / "train.json"
    assert train.main(["--size", "tiny", "--quick", "--stacks", "csa", "--layers", "1", "--batches", "4,1",
                       "--peer", "none", "--remat", "layer", "--json", str(out)]) == 0
    oom, ok = json.loads(out.read_text())["records"]
    assert oom["batch"] == 4 and oom["error"] == "RuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying " \
                                                 "to allocate 9 GB."
    assert oom["fwd_ms"] == 1.0 and "fwd_bwd_ms" not in oom
    assert ok["batch"] == 1 and ok["error"] is None and ok["fwd_bwd_ms"] == 3.0
    assert oom["remat"] == ok["remat"] == "layer"


def test_the_benchmarks_gradient_is_the_modules():
    """value_and_grad of the timed loss (with --remat layer), w.r.t. every layer's parameters and
    x, equals nnx.value_and_grad of the same loss through the layers' own calls (whose step
    takes the fused input projections: another program)."""
    cfg = stack_mod.stack_config("tiny", 1)
    st = train.TrainStack(cfg, "mixed", 2, jnp.float32, 0, "narrow", "auto")
    batch, length = 2, 24
    x = stack_mod._hidden(cfg, batch, length, st.dtype, 0)
    positions = stack_mod._positions(batch, 0, length)
    loss, (grads, grad_x) = train.FWD_BWD(st.weights, st.empty_caches(batch, 128), x, positions, specs=st.specs,
                                          remat="layer")

    def module_loss(layers, x):
        h = x
        for attn in layers:
            out, _ = attn(h, np.asarray(positions), attn.init_cache(batch, 128))
            h = h + out
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    ref_loss, (ref_grads, ref_x) = nnx.value_and_grad(module_loss, argnums=(0, 1))(st.layers, x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad_x), np.asarray(ref_x), rtol=1e-4, atol=1e-7)
    assert float(jnp.abs(grad_x).max()) > 0
    for layer, got, ref in zip(st.layers, grads, ref_grads):
        got, ref = _flat(got), _flat(ref)
        assert sorted(got) == sorted(ref)  # every parameter, and no derived leaf (input_proj)
        for name in got:
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-7, err_msg=f"{layer.layer_type} {name}")
        assert np.abs(got["q_b_proj"]).max() > 0 and np.abs(got["compressor.kv_proj"]).max() > 0


@needs_maxtext
@pytest.mark.parametrize("layer_type", [CSA, HCA])
def test_maxtexts_training_mode_computes_our_loss_and_input_gradient(layer_type):
    """The peer's fwd+bwd (its training mode, our weights) against ours on one layer, float32,
    without YaRN on the compressed rope (MaxText 0.2.5 has none): equal up to float32 noise."""
    cfg = dataclasses.replace(dsv4_jax.DeepseekV4Config.tiny(), compress_rope_scaling=None)
    attn = measure.build_layer(cfg, cfg.layer_types.index(layer_type), "float32", 0)
    batch, length = 2, 64
    x = stack_mod._hidden(cfg, batch, length, jnp.float32, 0)
    positions = stack_mod._positions(batch, 0, length)
    ours, (_, ours_x) = jax.value_and_grad(train.stack_loss, argnums=(0, 2))(
        [attn.weights()], [attn.init_cache(batch, 128)], x, positions, specs=(attn.step_spec(),))
    with jax.default_matmul_precision("highest"):  # MaxText's float32 config asks for it too
        prog = peer_maxtext.Program(cfg, "tiny", layer_type, attn, batch=batch, prefill_len=length,
                                    max_target=length + 1, dtype="float32", train=True)
        prog.compile_train(length)
    theirs, (_, theirs_x) = prog.train_call("fwd_bwd", x, positions)
    np.testing.assert_allclose(float(theirs), float(ours), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(theirs_x), np.asarray(ours_x), rtol=1e-4, atol=1e-8)


# ---------------------------------------------------------------------------- the peer's FLOP floor
def test_matmul_flops_counts_every_matrix_product_of_a_program():
    """`floor.matmul_flops`, the floor of a peer that cannot run (bench/deviceless.py --peer maxtext):
    2 per multiply-add of every dot_general, a scan's body times its length, a cond's larger branch,
    through jit and checkpoint; value_and_grad w.r.t. both operands of every product is 3x the
    forward (two cotangent products each). A while loop's trip count is data: it raises."""

    def f(w, x):
        c, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=3)
        c = jax.lax.cond(c.sum() > 0, lambda c: (c @ w) @ w, lambda c: c @ w, c)
        return jnp.einsum("bi,bi->", c, x)

    w, x = jnp.ones((8, 8)), jnp.ones((2, 8))
    product = 2 * 2 * 8 * 8  # [2, 8] @ [8, 8]
    forward = 3 * product + 2 * product + 2 * 2 * 8
    assert floor.matmul_flops(jax.make_jaxpr(jax.jit(jax.checkpoint(f)))(w, x).jaxpr) == forward
    assert floor.matmul_flops(jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1)))(w, x).jaxpr) == 3 * forward
    looped = jax.make_jaxpr(lambda w: jax.lax.while_loop(lambda c: c.sum() < 9, lambda c: c @ w, w))(w)
    with pytest.raises(ValueError, match="while"):
        floor.matmul_flops(looped.jaxpr)


@needs_maxtext
@pytest.mark.parametrize("layer_type", [CSA, HCA])
def test_maxtexts_training_floor_counts_its_dense_attention(layer_type):
    """`peer_maxtext.train_floor`: its forward's matrix FLOPs hold at least the dense [B, H, S, S + S/m]
    attention's QK and PV products (what keeps it from long sequences), the backward adds at most two
    products per forward one, and the floor is the FLOPs at the floor model's rate."""
    cfg = dsv4_jax.DeepseekV4Config.tiny()
    attn = measure.build_layer(cfg, cfg.layer_types.index(layer_type), "float32", 0)
    batch, length = 2, 64
    got = peer_maxtext.train_floor(cfg, "tiny", layer_type, attn, batch=batch, seq=length, dtype="float32")
    keys = length + length // cfg.compress_rate(layer_type)
    dense_attention = 2 * 2 * batch * cfg.num_attention_heads * length * keys * cfg.head_dim
    assert got["fwd_flops"] > dense_attention
    assert 2 * got["fwd_flops"] < got["fwd_bwd_flops"] <= 3 * got["fwd_flops"]
    assert got["fwd_bwd_floor_ms"] == pytest.approx(1e3 * got["fwd_bwd_flops"] / floor.H200_FLOPS)
    assert "fwd_bwd_gb" not in got  # memory needs a compiled program: train_floor's `device`
