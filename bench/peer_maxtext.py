"""The JAX peer: MaxText's DeepSeek-V4 attention (`maxtext` 0.2.5, `CompressedAttention`), timed like ours.

Install (Python >= 3.12, jax >= 0.11: maxtext's wheel declares no base dependencies, so its
imports are listed in our ``[peers]`` extra)::

    pip install -e '.[peers]'

What is built, per case: MaxText's `CompressedAttention` (NNX) for the layer's compress ratio,
from MaxText's own model config (``deepseek4-284b`` for ``--size flash``; ``deepseek4-tiny``
with our sizes for ``small``/``tiny``), on a one-device mesh, in MaxEngine's way: built in
``prefill`` mode with caches for ``max_prefill_predict_length`` = the prompt (or the context)
and ``max_target_length`` = prompt + decode steps, then called with ``model_mode="prefill"``
once and ``"autoregressive"`` per decode step (its token-by-token compressor caches). Weights
are ours, through `bench.maxtext_map`. ``attention="dot_product"``: the only MaxText kernel
that takes the compressed keys, their mask and the sinks off TPU (its GPU flash path refuses
sinks, `probe_flash` records that); it builds dense ``[B, H, S, S + C]`` logits and masks.

Each call is one `jax.jit` program (params, cache, x, positions) -> (out, cache), the cache
donated, compiled ahead of time (`lower().compile()`: compile time is reported apart, and
XLA's memory analysis of the compiled program is the recorded peak memory and decides the cap
before anything runs).

Known differences from the reference (measured in `tests/bench/test_maxtext_peer.py` and written up
in `bench/RESULTS.md`), kept as they are:

* no YaRN on the compressed rope (`DeepSeekV4RotaryEmbedding` of 0.2.5 has no scaling);
* during decode its sliding window over the prompt part of the cache does not move: a query
  attends the last ``sliding_window`` prompt tokens plus the last ``sliding_window`` decoded
  tokens, up to twice the window (``generate_attention_mask`` aligns the last valid slot of each
  cache part with the query's position);
* it keeps norm weights, sinks and position biases in its one ``weight_dtype``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

NAME = "maxtext-jax"
TESTED_VERSION = "0.2.5"

_FLASH_MODEL = "deepseek4-284b"
_TINY_MODEL = "deepseek4-tiny"


def available() -> str | None:
    """None if maxtext's DeepSeek-V4 attention and its config system import, else the reason."""
    try:
        from maxtext.configs import pyconfig  # noqa: F401
        from maxtext.layers.attention_compressed import CompressedAttention  # noqa: F401
    except Exception as err:  # any import failure means: no peer
        from bench.report import error_text

        return error_text(err)
    return None


def versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("maxtext", "tokamax", "qwix", "aqtp", "pathwaysutils", "omegaconf", "pydantic"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


# ---------------------------------------------------------------------------- config
def _sizes(cfg) -> dict:
    """MaxText config keys for our sizes."""
    return dict(
        base_emb_dim=cfg.hidden_size, base_num_query_heads=cfg.num_attention_heads, base_num_kv_heads=1,
        head_dim=cfg.head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, sliding_window_size=cfg.sliding_window,
        indexer_n_heads=cfg.index_n_heads, indexer_head_dim=cfg.index_head_dim, indexer_topk=cfg.index_topk,
        rope_max_timescale=int(cfg.rope_theta), compressed_rope_max_timescale=int(cfg.compress_rope_theta),
        normalization_layer_epsilon=cfg.rms_norm_eps,
    )


def _mismatches(mt, cfg) -> list[str]:
    pairs = [("emb_dim", cfg.hidden_size), ("num_query_heads", cfg.num_attention_heads), ("num_kv_heads", 1),
             ("head_dim", cfg.head_dim), ("qk_rope_head_dim", cfg.qk_rope_head_dim), ("q_lora_rank", cfg.q_lora_rank),
             ("o_groups", cfg.o_groups), ("o_lora_rank", cfg.o_lora_rank), ("sliding_window_size", cfg.sliding_window),
             ("indexer_n_heads", cfg.index_n_heads), ("indexer_head_dim", cfg.index_head_dim),
             ("indexer_topk", cfg.index_topk), ("rope_max_timescale", cfg.rope_theta),
             ("compressed_rope_max_timescale", cfg.compress_rope_theta),
             ("normalization_layer_epsilon", cfg.rms_norm_eps)]
    out = [f"{k}: MaxText {getattr(mt, k)!r}, ours {v!r}" for k, v in pairs if float(getattr(mt, k)) != float(v)]
    ratios = set(mt.compress_ratios)
    for r in (cfg.csa_compress_rate, cfg.hca_compress_rate):
        if r not in ratios:
            out.append(f"compress ratio {r} not in MaxText's compress_ratios {sorted(ratios)}")
    return out


def maxtext_config(cfg, size: str, *, batch: int, prefill_len: int, max_target: int, dtype: str,
                   attention: str = "dot_product"):
    """MaxText's `HyperParameters` for one case: its own V4-Flash model config for ``flash`` (checked
    against ours, field by field), its tiny V4 config with our sizes for ``small`` / ``tiny``."""
    import maxtext
    from maxtext.configs import pyconfig

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    run = dict(run_name="dsv4_jax_peer", enable_checkpointing=False, skip_jax_distributed_system=True,
               base_output_directory=os.path.join(tempfile.gettempdir(), "maxtext_peer"), attention=attention,
               dtype=dtype, weight_dtype=dtype, matmul_precision="highest" if dtype == "float32" else "default",
               per_device_batch_size=batch, max_prefill_predict_length=prefill_len, max_target_length=max_target,
               scan_layers=False)
    if attention == "flash":  # MaxText's config accepts flash for DeepSeek4 only with its tokamax splash kernel
        run["use_tokamax_splash"] = True
    if size == "flash":
        kw = dict(model_name=_FLASH_MODEL, **run)
    else:
        kw = dict(model_name=_TINY_MODEL, override_model_config=True, compress_ratios=[0, cfg.csa_compress_rate,
                  cfg.hca_compress_rate], **_sizes(cfg), **run)
    mt = pyconfig.initialize([sys.argv[0], base], **kw)
    bad = _mismatches(mt, cfg)
    if bad:
        raise ValueError(f"MaxText's {kw['model_name']} config does not match ours: " + "; ".join(bad))
    return mt


# ---------------------------------------------------------------------------- one program
class Program:
    """MaxText's layer for one (layer type, batch, prefill length, max target) with our weights,
    split into (params, cache, rest) and its prefill / decode steps compiled ahead of time.
    ``train=True``: the layer in MaxText's training mode (no caches), for `compile_train`. `device`:
    the one device of its mesh (default: JAX's first; a compile-only one for `train_floor`)."""

    def __init__(self, cfg, size: str, layer_type: str, ours_attn, *, batch: int, prefill_len: int, max_target: int,
                 dtype: str, attention: str = "dot_product", train: bool = False, device=None):
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from jax.sharding import Mesh
        from maxtext.common.common_types import MODEL_MODE_PREFILL, MODEL_MODE_TRAIN, AttentionType
        from maxtext.layers.attention_compressed import CompressedAttention

        from bench import maxtext_map

        self.jax, self.jnp, self.nnx = jax, jnp, nnx
        self.cfg, self.layer_type, self.batch, self.prefill_len = cfg, layer_type, batch, prefill_len
        self.dtype = jnp.dtype(dtype)
        mt = maxtext_config(cfg, size, batch=batch, prefill_len=prefill_len, max_target=max_target, dtype=dtype,
                            attention=attention)
        self.mt_config = mt
        mesh = Mesh(np.array([device] if device is not None else jax.devices()[:1]), ("data",))
        shape = (batch, prefill_len, mt.emb_dim)
        layer = CompressedAttention(
            config=mt, num_query_heads=mt.num_query_heads, num_kv_heads=mt.num_kv_heads, head_dim=mt.head_dim,
            max_target_length=max_target, max_prefill_predict_length=prefill_len, mesh=mesh,
            attention_kernel=mt.attention, attention_type=AttentionType(mt.attention_type), inputs_q_shape=shape,
            inputs_kv_shape=shape, dtype=self.dtype, weight_dtype=self.dtype,
            sliding_window_size=mt.sliding_window_size, q_lora_rank=mt.q_lora_rank,
            compress_ratio=cfg.compress_rate(layer_type), model_mode=MODEL_MODE_TRAIN if train else MODEL_MODE_PREFILL,
            rngs=nnx.Rngs(0),
        )
        flat = {tuple(str(k) for k in p): v for p, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
        maxtext_map.load(flat, ours_attn, layer_type, mt.num_query_heads, self.dtype)
        self.graphdef, self.params, self.cache0, self.rest = nnx.split(layer, nnx.Param, nnx.Cache, ...)
        self.compiled = {}
        self.memory = {}

    def fresh(self):
        """A new copy of the empty cache (calls donate theirs)."""
        return self.jax.tree.map(lambda a: self.jnp.array(a, copy=True), self.cache0)

    def _fn(self, mode: str):
        from maxtext.common.common_types import MODEL_MODE_AUTOREGRESSIVE, MODEL_MODE_PREFILL

        jnp, nnx, graphdef = self.jnp, self.nnx, self.graphdef
        model_mode = MODEL_MODE_PREFILL if mode == "prefill" else MODEL_MODE_AUTOREGRESSIVE

        def step(params, cache, rest, x, pos):
            m = nnx.merge(graphdef, params, cache, rest)
            seg = jnp.ones(pos.shape, jnp.int32) if mode == "prefill" else None
            out, _ = m(x, x, seg, pos, deterministic=True, model_mode=model_mode)
            return out, nnx.state(m, nnx.Cache)

        return self.jax.jit(step, donate_argnums=(1,))

    def compile(self, mode: str, seq: int) -> None:
        """Lower + compile the step of `mode` (prefill of `seq` tokens, or a decode step)."""
        jax, jnp = self.jax, self.jnp
        x = jax.ShapeDtypeStruct((self.batch, seq, self.mt_config.emb_dim), self.dtype)
        pos = jax.ShapeDtypeStruct((self.batch, seq), jnp.int32)
        compiled = self._fn(mode).lower(self.params, self.cache0, self.rest, x, pos).compile()
        self.compiled[mode] = compiled
        self.memory[mode] = memory_bytes(compiled)

    def __call__(self, mode: str, cache, x, pos):
        return self.compiled[mode](self.params, cache, self.rest, x, pos)

    def train_loss(self):
        """``loss(params, x, cache, rest, pos)``: bench/train.py's loss of one layer, mean((x + layer(x)) ** 2)
        in float32, the layer called in MaxText's training mode (a `Program` built with ``train=True``)."""
        from maxtext.common.common_types import MODEL_MODE_TRAIN

        jnp, nnx, graphdef = self.jnp, self.nnx, self.graphdef

        def loss(params, x, cache, rest, pos):
            m = nnx.merge(graphdef, params, cache, rest)
            out, _ = m(x, x, jnp.ones(pos.shape, jnp.int32), pos, deterministic=True, model_mode=MODEL_MODE_TRAIN)
            return jnp.mean(jnp.square((x + out).astype(jnp.float32)))

        return loss

    def compile_train(self, seq: int) -> dict:
        """Lower + compile ``fwd`` (the loss) and ``fwd_bwd`` (its value_and_grad w.r.t. the parameters
        and x) for `seq` tokens a row; returns the seconds each took."""
        seconds = {}
        for name, fn in self.train_programs().items():
            t0 = time.perf_counter()
            self.compiled[name] = self.jax.jit(fn).lower(*self.train_args(seq)).compile()
            seconds[name] = time.perf_counter() - t0
            self.memory[name] = memory_bytes(self.compiled[name])
        return seconds

    def train_programs(self) -> dict:
        """``{"fwd": loss, "fwd_bwd": value_and_grad(loss) w.r.t. the parameters and x}``."""
        loss = self.train_loss()
        return {"fwd": loss, "fwd_bwd": self.jax.value_and_grad(loss, argnums=(0, 1))}

    def train_args(self, seq: int, device=None) -> tuple:
        """Abstract arguments of the train programs for `seq` tokens a row, placed on `device` if given."""
        jax, jnp = self.jax, self.jnp
        sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)

        def spec(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        params, cache, rest = (jax.tree.map(lambda a: spec(a.shape, a.dtype), t)
                               for t in (self.params, self.cache0, self.rest))
        return (params, spec((self.batch, seq, self.mt_config.emb_dim), self.dtype), cache, rest,
                spec((self.batch, seq), jnp.int32))

    def train_call(self, name: str, x, pos):
        return self.compiled[name](self.params, x, self.cache0, self.rest, pos)

    def picks(self, x, pos):
        """The CSA indexer's picks [B, S, k] of a prefill (its public submodule called on the same
        latent queries the layer gives it; -1 = nothing); entry indices, as ours."""
        from maxtext.common.common_types import MODEL_MODE_PREFILL

        nnx = self.nnx
        graphdef = self.graphdef

        def run(params, cache, rest, x, pos):
            m = nnx.merge(graphdef, params, cache, rest)
            q_normed = m.q_norm(m.wq_a(x))
            idx, _ = m.csa_compressor.indexer(x, q_normed, pos, None, MODEL_MODE_PREFILL, None)
            return idx

        return np.asarray(self.jax.jit(run)(self.params, self.cache0, self.rest, x, pos))


def memory_bytes(compiled) -> dict:
    """XLA's memory analysis of a compiled program: arguments + outputs - aliased + temporaries."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # not every backend reports it
        return {}
    if m is None:
        return {}
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {"total": int(total), "temp": int(m.temp_size_in_bytes), "arguments": int(m.argument_size_in_bytes)}


# ---------------------------------------------------------------------------- the peer
class MaxTextPeer:
    """Runs the benchmark's cases through MaxText's layer (one `Program` per case), same inputs
    and protocol as `bench.measure` (warm-up sequence, timed repeats from fresh caches)."""

    def __init__(self, cfg, size: str, layer: str, ours_attn, dtype: str, platform: str, mem_gb: float | None = None):
        from dsv4_jax.config import CSA, HCA

        self.cfg, self.size, self.ours = cfg, size, ours_attn
        self.layer_type = {"csa": CSA, "hca": HCA}[layer]
        self.dtype, self.platform, self.mem_gb = dtype, platform, mem_gb

    # ------------------------------------------------------------------ memory cap
    def memory_limit(self) -> float:
        """Bytes MaxText's step may use: `mem_gb`, else the free part of JAX's pool (GPU) or 8 GB (CPU)."""
        if self.mem_gb:
            return self.mem_gb * 1e9
        if self.platform == "gpu":
            import jax

            stats = jax.devices()[0].memory_stats() or {}
            if "bytes_limit" in stats:
                return float(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
        return 8e9

    def logits_bytes(self, batch: int, seq: int) -> float:
        """A lower bound of a prefill's memory: the dense [B, H, S, S + S/m] logits alone."""
        import jax.numpy as jnp

        keys = seq + seq // self.cfg.compress_rate(self.layer_type)
        return float(batch * self.cfg.num_attention_heads * seq * keys * jnp.dtype(self.dtype).itemsize)

    # ------------------------------------------------------------------ one case
    def run_case(self, case, inputs, *, want_picks: bool = False) -> dict:
        """Timings and outputs of one case (``skipped`` set instead where it cannot run)."""
        import jax
        import jax.numpy as jnp

        from bench import measure

        if case.scenario == "decode_long":
            x_pre = np.concatenate([p[0] for p in inputs.prefix], axis=1)
            pos_pre = np.concatenate([p[1] for p in inputs.prefix], axis=1)
        else:
            x_pre, pos_pre = inputs.prompt
        prefill_len = x_pre.shape[1]
        n_steps = case.steps if case.scenario != "prefill" else 0
        steps = inputs.steps[: max(n_steps, case.warmup_steps)] if n_steps else []
        max_target = prefill_len + max(len(steps), 1)
        res = {"steps": n_steps, "repeats": case.repeats, "compile_s": None, "warmup_s": None, "host_breaks": None,
               "ttft": [], "decode": [], "outs": []}
        limit = self.memory_limit()
        low = self.logits_bytes(case.batch, prefill_len)
        what = "prefill of the context" if case.scenario == "decode_long" else "prefill"
        if low > limit:
            res["skipped"] = (f"memory: MaxText's {what} ({prefill_len} tokens, one call: it has no chunked prefill "
                              f"for compressed attention) builds dense [B, H, S, S+C] logits, {low / 1e9:.1f} GB "
                              f"alone > {limit / 1e9:.1f} GB available")
            return res

        clock = measure.compile_clock()
        clock.start()
        t0 = time.perf_counter()
        prog = Program(self.cfg, self.size, self.layer_type, self.ours, batch=case.batch, prefill_len=prefill_len,
                       max_target=max_target, dtype=self.dtype)
        setup_s = time.perf_counter() - t0
        prog.compile("prefill", prefill_len)
        if steps:
            prog.compile("decode", 1)
        res["compile_s"] = clock.stop()
        res["setup_s"] = setup_s
        peak = max(m.get("total", 0) for m in prog.memory.values())
        res["peak_gb"] = peak / 1e9 if peak else None
        res["peak_source"] = "XLA memory analysis of the compiled step (args + outputs - aliased + temps)"
        res["memory_by_step_gb"] = {k: {kk: vv / 1e9 for kk, vv in v.items()} for k, v in prog.memory.items()}
        if peak > limit:
            res["skipped"] = (f"memory: MaxText's compiled {what} needs {peak / 1e9:.1f} GB (XLA memory analysis) "
                              f"> {limit / 1e9:.1f} GB available")
            return res

        dt = prog.dtype

        def dev(x):
            return jnp.asarray(x).astype(dt)

        x_pre_d, pos_pre_d = dev(x_pre), jnp.asarray(pos_pre, jnp.int32)
        steps_d = [(dev(x), jnp.asarray(p, jnp.int32)) for x, p in steps]

        snap = None
        if case.scenario == "decode_long":  # the context, untimed, once
            _, snap = prog("prefill", prog.fresh(), x_pre_d, pos_pre_d)
            jax.block_until_ready(snap)

        def fresh():
            return prog.fresh() if snap is None else jax.tree.map(lambda a: jnp.array(a, copy=True), snap)

        def call(mode, cache, x, pos, timed=False):
            if not timed:
                return (*prog(mode, cache, x, pos), None)
            t = time.perf_counter()
            out, cache = prog(mode, cache, x, pos)
            jax.block_until_ready((out, cache))
            return out, cache, time.perf_counter() - t

        timed_prompt = case.scenario != "decode_long"
        t0 = time.perf_counter()  # warm-up sequence
        cache = fresh()
        if timed_prompt:
            _, cache, _ = call("prefill", cache, x_pre_d, pos_pre_d)
        for x, p in steps_d[: case.warmup_steps]:
            _, cache, _ = call("decode", cache, x, p)
        jax.block_until_ready(cache)
        res["warmup_s"] = time.perf_counter() - t0
        del cache

        for r in range(case.repeats):
            last = r == case.repeats - 1
            cache = fresh()
            if timed_prompt:
                out, cache, t = call("prefill", cache, x_pre_d, pos_pre_d, timed=True)
                res["ttft"].append(t)
                if last:
                    res["outs"].append(np.asarray(out, np.float32))
            for x, p in steps_d[:n_steps]:
                out, cache, t = call("decode", cache, x, p, timed=True)
                res["decode"].append(t)
                if last:
                    res["outs"].append(np.asarray(out, np.float32))
            del cache
        if want_picks and case.scenario == "prefill":
            res["picks"] = prog.picks(x_pre_d, pos_pre_d)
        return res


# ---------------------------------------------------------------------------- training
def time_train(cfg, size: str, layer_type: str, ours_attn, *, batch: int, seq: int, dtype: str, repeats: int,
               seed: int = 0, mem_gb: float | None = None) -> dict:
    """MaxText's one-layer training step with our weights, bench/train.py's protocol: its loss
    (``fwd``) and ``value_and_grad`` w.r.t. its parameters and x (``fwd_bwd``), each compiled
    ahead of time, then the median ms of `repeats` blocked calls after a warm-up call.

    Returns ``{"layer_type", "fwd_ms", "fwd_bwd_ms", "compile_s" (fwd+bwd's), "peak_gb" (XLA's
    memory analysis of fwd+bwd)}``, or ``{"layer_type", "error"}`` where it does not run: its dense
    ``[B, H, S, S + S/m]`` logits alone exceed the memory it may use (`MaxTextPeer.memory_limit`),
    the compiled program's analysis does, or it fails (the message's first line)."""
    import jax
    import jax.numpy as jnp

    from dsv4_jax.config import CSA

    out = {"layer_type": layer_type}
    try:
        platform = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"
        limits = MaxTextPeer(cfg, size, "csa" if layer_type == CSA else "hca", ours_attn, dtype, platform, mem_gb)
        limit, low = limits.memory_limit(), limits.logits_bytes(batch, seq)
        if low > limit:
            return {**out, "error": f"memory: dense [B, H, S, S+C] logits alone {low / 1e9:.3g} GB > "
                                    f"{limit / 1e9:.3g} GB available"}
        prog = Program(cfg, size, layer_type, ours_attn, batch=batch, prefill_len=seq, max_target=seq + 1,
                       dtype=dtype, train=True)
        out["compile_s"] = prog.compile_train(seq)["fwd_bwd"]
        peak = prog.memory["fwd_bwd"].get("total")
        out["peak_gb"] = None if peak is None else peak / 1e9
        if peak is not None and peak > limit:
            return {**out, "error": f"memory: the compiled fwd+bwd needs {peak / 1e9:.3g} GB (XLA memory analysis) "
                                    f"> {limit / 1e9:.3g} GB available"}
        rng = np.random.default_rng(seed)
        x = jnp.asarray(rng.standard_normal((batch, seq, cfg.hidden_size), dtype=np.float32)).astype(prog.dtype)
        pos = jnp.asarray(np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)))
        for name in ("fwd", "fwd_bwd"):
            jax.block_until_ready(prog.train_call(name, x, pos))  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(prog.train_call(name, x, pos))
                times.append(time.perf_counter() - t0)
            out[f"{name}_ms"] = 1e3 * float(np.median(times))
    except Exception as err:  # where MaxText stops is the record
        text = str(err).strip().splitlines()
        out["error"] = f"{type(err).__name__}: {text[0][:300] if text else ''}"
    return out


def train_floor(cfg, size: str, layer_type: str, ours_attn, *, batch: int, seq: int, dtype: str,
                device=None) -> dict:
    """MaxText's one-layer training step (`time_train`'s programs) measured without running it.

    Its matrix products' FLOPs from the programs' jaxprs (`floor.matmul_flops`: ``fwd_flops``,
    ``fwd_bwd_flops``) and what they take at the floor model's matrix rate (``fwd_floor_ms``,
    ``fwd_bwd_floor_ms``; `floor.H200_FLOPS`): no run of the program on an H200 is faster, and its
    dense ``[B, H, S, S + S/m]`` attention makes it compute-bound. With a `device` (a compile-only
    one, `bench/deviceless.py`) also XLA's memory analysis of the programs compiled for it
    (``fwd_gb``, ``fwd_bwd_gb``: arguments + outputs + temporaries), which is what decides whether
    it fits (`time_train` refuses a program whose analysis exceeds the memory)."""
    import jax

    from bench import floor

    prog = Program(cfg, size, layer_type, ours_attn, batch=batch, prefill_len=seq, max_target=seq + 1,
                   dtype=dtype, train=True, device=device)
    out = {"layer_type": layer_type}
    for name, fn in prog.train_programs().items():
        flops = floor.matmul_flops(jax.make_jaxpr(fn)(*prog.train_args(seq)).jaxpr)
        out.update({f"{name}_flops": flops, f"{name}_floor_ms": 1e3 * flops / floor.H200_FLOPS})
        if device is not None:
            compiled = jax.jit(fn).trace(*prog.train_args(seq, device)).lower(lowering_platforms=("cuda",)).compile()
            total = memory_bytes(compiled).get("total")
            out[f"{name}_gb"] = None if total is None else total / 1e9
    return out


# ---------------------------------------------------------------------------- agreement
def maxtext_sequence(cfg, size: str, layer_type: str, ours_attn, x: np.ndarray, prefill_len: int,
                     dtype: str = "float32") -> list[np.ndarray]:
    """MaxText's outputs for ``x`` [B, N, hidden]: one prefill of the first `prefill_len` tokens
    (positions from 0), then one autoregressive step per remaining token (its only way to add
    tokens after a prefill). A list: the prefill output, then one [B, 1, hidden] per step."""
    import jax.numpy as jnp

    b, n, _ = x.shape
    prog = Program(cfg, size, layer_type, ours_attn, batch=b, prefill_len=prefill_len,
                   max_target=max(n, prefill_len + 1), dtype=dtype)
    prog.compile("prefill", prefill_len)
    pos = np.broadcast_to(np.arange(n, dtype=np.int32), (b, n))
    out, cache = prog("prefill", prog.fresh(), jnp.asarray(x[:, :prefill_len], prog.dtype),
                      jnp.asarray(pos[:, :prefill_len]))
    outs = [np.asarray(out, np.float32)]
    if n > prefill_len:
        prog.compile("decode", 1)
    for t in range(prefill_len, n):
        out, cache = prog("decode", cache, jnp.asarray(x[:, t : t + 1], prog.dtype), jnp.asarray(pos[:, t : t + 1]))
        outs.append(np.asarray(out, np.float32))
    return outs


def ours_sequence(attn, x: np.ndarray, prefill_len: int) -> list[np.ndarray]:
    """Our layer on the same schedule as `maxtext_sequence` (one prefill, then single tokens)."""
    import jax.numpy as jnp

    b, n, _ = x.shape
    pos = np.broadcast_to(np.arange(n, dtype=np.int32), (b, n)).copy()
    cache = attn.init_cache(b, max(n, 1))
    out, cache = attn(jnp.asarray(x[:, :prefill_len]), pos[:, :prefill_len], cache)
    outs = [np.asarray(out, np.float32)]
    for t in range(prefill_len, n):
        out, cache = attn(jnp.asarray(x[:, t : t + 1]), pos[:, t : t + 1], cache)
        outs.append(np.asarray(out, np.float32))
    return outs


def ours_prefill_picks(attn, x: np.ndarray) -> np.ndarray:
    import jax.numpy as jnp

    b, n, _ = x.shape
    pos = np.broadcast_to(np.arange(n, dtype=np.int32), (b, n)).copy()
    _, _, inter = attn(jnp.asarray(x), pos, attn.init_cache(b, n), return_intermediates=True)
    return np.asarray(inter.topk)


def maxtext_prefill_picks(cfg, size: str, ours_attn, x: np.ndarray, dtype: str = "float32") -> np.ndarray:
    import jax.numpy as jnp

    from dsv4_jax.config import CSA

    b, n, _ = x.shape
    prog = Program(cfg, size, CSA, ours_attn, batch=b, prefill_len=n, max_target=n + 1, dtype=dtype)
    pos = np.broadcast_to(np.arange(n, dtype=np.int32), (b, n))
    return prog.picks(jnp.asarray(x, prog.dtype), jnp.asarray(pos))


def _diffs(outs, ref) -> dict:
    steps = [float(np.max(np.abs(a - b))) for a, b in zip(outs[1:], ref[1:], strict=True)]
    return {"prefill_max_abs": float(np.max(np.abs(outs[0] - ref[0]))),
            "prefill_max_abs_per_position": np.max(np.abs(outs[0] - ref[0]), axis=(0, 2)).tolist(),
            "decode_max_abs_per_step": steps, "out_scale": float(max(np.max(np.abs(o)) for o in ref))}


def agreement(size: str = "tiny", *, batch: int = 2, prefill_len: int = 24, steps: int = 8, seed: int = 0) -> dict:
    """MaxText against ours, float32, on one prefill + `steps` decode tokens, per layer type, in
    three settings: the config as it is; without YaRN on the compressed rope (MaxText 0.2.5 has
    none); and without YaRN with a window that covers the whole sequence (MaxText's decode
    window does not slide over the prompt). Plus the CSA indexer's prefill picks (set overlap)."""
    import dataclasses

    from bench import measure, plan
    from dsv4_jax.config import CSA, HCA

    base = plan.config_for(size)
    n = prefill_len + steps
    settings = {
        "as configured": base,
        "no YaRN": dataclasses.replace(base, compress_rope_scaling=None),
        "no YaRN, window >= sequence": dataclasses.replace(base, compress_rope_scaling=None, sliding_window=n),
    }
    x = np.random.default_rng(seed).standard_normal((batch, n, base.hidden_size)).astype(np.float32)
    out = {"size": size, "batch": batch, "prefill_len": prefill_len, "steps": steps, "seed": seed, "results": {}}
    for name, cfg in settings.items():
        for lt in (CSA, HCA):
            attn = measure.build_layer(cfg, cfg.layer_types.index(lt), "float32", seed)
            ours = ours_sequence(attn, x, prefill_len)
            theirs = maxtext_sequence(cfg, size, lt, attn, x, prefill_len)
            r = _diffs(theirs, ours)
            if lt == CSA:
                head = x[:, :prefill_len]
                r["prefill_picks_set_overlap"] = measure.picks_overlap(
                    maxtext_prefill_picks(cfg, size, attn, head), ours_prefill_picks(attn, head))
            out["results"][f"{name} / {lt}"] = r
    return out


def agreement_golden(name: str) -> dict:
    """MaxText against a recorded HF transformers 5.23.0 run (tests/data, float32 CPU, YaRN on):
    the first call as its prefill, every later token as one decode step. Also ours on the same
    schedule, and MaxText against ours without YaRN (what the YaRN difference alone explains)."""
    import dataclasses
    import json
    from pathlib import Path

    import dsv4_jax
    from dsv4_jax.config import CSA, HCA

    path = Path(__file__).resolve().parent.parent / "tests" / "data" / name
    with np.load(path) as f:
        data = {k: f[k] for k in f.files}
    meta = json.loads(bytes(data.pop("meta")).decode())
    cfg = dsv4_jax.DeepseekV4Config.from_hf(meta["hf_config"])
    schedule = meta["schedule"]
    out = {"file": name, "schedule": schedule, "batch": meta["batch"], "results": {}}
    for lt in (CSA, HCA):
        li = cfg.layer_types.index(lt)
        calls = [{k.split("/")[-1]: v for k, v in data.items() if k.startswith(f"layer{li}/call{c}/")}
                 for c in range(len(schedule))]
        x = np.concatenate([c["hidden"] for c in calls], axis=1)
        ref_all = np.concatenate([c["out"] for c in calls], axis=1)
        first = schedule[0]
        ref = [ref_all[:, :first]] + [ref_all[:, t : t + 1] for t in range(first, x.shape[1])]
        weights = {k.split("/params/")[1]: v for k, v in data.items() if k.startswith(f"layer{li}/params/")}
        r = {}
        for label, c in (("yarn", cfg), ("no_yarn", dataclasses.replace(cfg, compress_rope_scaling=None))):
            from flax import nnx

            attn = dsv4_jax.DeepseekV4Attention(c, li, rngs=nnx.Rngs(0), break_mode="none")
            dsv4_jax.load_hf_attention_weights(attn, weights)
            r[f"ours_{label}"] = ours_sequence(attn, x, first)
            if label == "yarn":
                mt = maxtext_sequence(c, "small", lt, attn, x, first)
        res = {"maxtext_vs_hf": _diffs(mt, ref), "ours_vs_hf": _diffs(r["ours_yarn"], ref),
               "maxtext_vs_ours_without_yarn": _diffs(mt, r["ours_no_yarn"])}
        out["results"][lt] = res
    return out


def agreement_markdown(report: dict) -> str:
    """Tables of an agreement report (`python -m bench.peer_maxtext --render JSON`)."""

    def rng(xs):
        return "-" if not xs else f"{min(xs):.1e} .. {max(xs):.1e}"

    lines = ["| reference | setting | layer | prefill max abs | decode steps max abs (min .. max) | out scale | "
             "prefill picks overlap |", "|---|---|---|---|---|---|---|"]
    for g in report["hf_recorded"]:
        for lt, r in g["results"].items():
            for key, label in (("ours_vs_hf", "ours vs HF"), ("maxtext_vs_hf", "MaxText vs HF"),
                               ("maxtext_vs_ours_without_yarn", "MaxText vs ours without YaRN")):
                v = r[key]
                lines.append(f"| HF 5.23.0 recorded, {g['file']} (schedule {g['schedule']}) | {label} | {lt} | "
                             f"{v['prefill_max_abs']:.1e} | {rng(v['decode_max_abs_per_step'])} | "
                             f"{v['out_scale']:.2f} | - |")
    for a in report["synthetic"]:
        for key, v in a["results"].items():
            setting, lt = key.split(" / ")
            picks = v.get("prefill_picks_set_overlap")
            lines.append(f"| ours, {a['size']} B={a['batch']} prefill {a['prefill_len']} + {a['steps']} steps | "
                         f"MaxText vs ours, {setting} | {lt} | {v['prefill_max_abs']:.1e} | "
                         f"{rng(v['decode_max_abs_per_step'])} | {v['out_scale']:.2f} | "
                         f"{'-' if picks is None else f'{picks:.3f}'} |")
    return "\n".join(lines)


def probe_flash(cfg, size: str, layer: str, ours_attn, dtype: str, seq: int = 256) -> str:
    """Whether MaxText's ``attention="flash"`` runs a prefill of this layer here ("ran"), else its error."""
    import jax
    import jax.numpy as jnp

    from dsv4_jax.config import CSA, HCA

    try:
        prog = Program(cfg, size, {"csa": CSA, "hca": HCA}[layer], ours_attn, batch=1, prefill_len=seq,
                       max_target=seq + 1, dtype=dtype, attention="flash")
        prog.compile("prefill", seq)
        x = jnp.zeros((1, seq, cfg.hidden_size), prog.dtype)
        pos = jnp.arange(seq, dtype=jnp.int32)[None]
        jax.block_until_ready(prog("prefill", prog.fresh(), x, pos))
        return "ran"
    except Exception as err:  # the outcome is the record
        text = " / ".join(line.strip() for line in str(err).splitlines() if line.strip())
        return f"{type(err).__name__}: {text[:400]}"


if __name__ == "__main__":  # python -m bench.peer_maxtext --json out.json: the agreement report
    import argparse
    import json

    ap = argparse.ArgumentParser(description="MaxText's attention against ours and the recorded HF reference")
    ap.add_argument("--sizes", default="tiny,small")
    ap.add_argument("--json", default=None)
    ap.add_argument("--render", default=None, metavar="JSON", help="print the tables of an earlier report")
    args = ap.parse_args()
    if args.render:
        print(agreement_markdown(json.loads(Path(args.render).read_text())))
        raise SystemExit(0)
    reason = available()
    if reason:
        raise SystemExit(f"maxtext unavailable: {reason}")
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    report = {"versions": versions(), "jax": jax.__version__, "platform": jax.default_backend(), "synthetic": [],
              "hf_recorded": [agreement_golden(n) for n in ("tiny_seed1.npz", "small_seed0.npz")]}
    for size in args.sizes.split(","):
        kw = dict(prefill_len=24, steps=8) if size == "tiny" else dict(prefill_len=256, steps=8)
        report["synthetic"].append(agreement(size, **kw))
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
