"""`DeepseekV4Attention`: the layer, as a thin NNX module over a pure, compiled step.

The module holds the parameters (`Compressor` and `Indexer` are its submodules), makes the
cache (`init_cache`), hands out its parameters as the step's pytree (`weights`,
`step_weights`) and its static description (`step_spec`: the `StepSpec` with the one
`StepPlan`, break and kernels resolved together). The step itself, its stages and its
compiled versions are `dsv4_jax.step.pure_step`; the eager call (checks, memo, host length mirror) is
`dsv4_jax.layer.call`, to which `__call__` hands over.
"""

from __future__ import annotations

import dataclasses
import operator
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4_jax.backend import Array
from dsv4_jax.cache.contiguous import AttentionCache, init_attention_cache
from dsv4_jax.cache.quantized import check_kv_cache_dtype
from dsv4_jax.config import CSA, HCA, DeepseekV4Config
from dsv4_jax.layer import call as call_path
from dsv4_jax.layer import validation
from dsv4_jax.layer.options import OPTION_NAMES, LayerOptions, option_property
from dsv4_jax.ops.compress.reference import CompressorWeights
from dsv4_jax.ops.indexer.reference import IndexerWeights
from dsv4_jax.step import sharding
from dsv4_jax.step.plan import plan_step
from dsv4_jax.step.pure_step import DERIVED_WEIGHTS, AttentionWeights, StepSpec, fuse_input_projections


# ---------------------------------------------------------------------------- NNX modules
def _array(param: nnx.Variable) -> Array:
    """A parameter's array. `get_raw_value` skips flax's accessor machinery (~4 us a parameter,
    which adds up on every decode step); it is only used when it holds a plain array."""
    raw = param.get_raw_value() if hasattr(param, "get_raw_value") else None
    return raw if isinstance(raw, (jax.Array, np.ndarray)) else param[...]


def _param(value, axes: tuple[str, ...]) -> nnx.Param:
    """A parameter annotated with its logical axes (NNX sharding metadata; `dsv4_jax.step.sharding`
    maps them to mesh axes). ``eager_sharding=False``: the annotation alone, so building a layer
    needs no mesh; `sharding.shard_layer` places the values."""
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _projection(rngs: nnx.Rngs, shape, dtype, axes: tuple[str, ...]) -> nnx.Param:
    """A projection kernel [..., in, out] with variance 1/in (activations stay O(1)), logical `axes`.

    Drawn in float32, then cast: one seed gives the same weights (up to the cast) for every
    `param_dtype` (`random.normal` drawing in bf16 directly consumes the bits differently)."""
    init = nnx.initializers.normal(stddev=shape[-2] ** -0.5)
    return _param(init(rngs.params(), shape, jnp.float32).astype(dtype), axes)


class Compressor(nnx.Module):
    """Parameters of a gated-pooling compressor (names as HF's `compressor.*`)."""

    def __init__(self, hidden: int, width: int, dim: int, ratio: int, *, rngs: nnx.Rngs, param_dtype):
        # One shared K=V head: nothing here has a head axis (replicated over "model").
        self.kv_proj = _projection(rngs, (hidden, width), param_dtype, ("embed", "kv"))
        self.gate_proj = _projection(rngs, (hidden, width), param_dtype, ("embed", "kv"))
        self.position_bias = _param(jnp.zeros((ratio, width), jnp.float32), ("ratio", "kv"))
        self.kv_norm = _param(jnp.ones((dim,), jnp.float32), ("kv",))

    def weights(self) -> CompressorWeights:
        return _weights_of(self, CompressorWeights)


class Indexer(nnx.Module):
    """Parameters of the lightning indexer (HF `compressor.indexer.*`, official `indexer.*`)."""

    def __init__(self, cfg: DeepseekV4Config, *, rngs: nnx.Rngs, param_dtype):
        c = cfg.index_head_dim
        # "index_heads", not "heads": the selection sums over all indexer heads, so the indexer is
        # replicated over "model" (see `dsv4_jax.step.sharding`).
        self.q_b_proj = _projection(rngs, (cfg.q_lora_rank, cfg.index_n_heads * c), param_dtype,
                                    ("q_lora", "index_heads"))
        self.weights_proj = _projection(rngs, (cfg.hidden_size, cfg.index_n_heads), param_dtype,
                                        ("embed", "index_heads"))
        self.compressor = Compressor(cfg.hidden_size, cfg.compressor_width(CSA, indexer=True), c,
                                     cfg.csa_compress_rate, rngs=rngs, param_dtype=param_dtype)

    def weights(self) -> IndexerWeights:
        return _weights_of(self, IndexerWeights)


# Per-layer memos of `weights()`, `step_weights()` and `step_spec()`, outside the modules (NNX
# would otherwise treat the cached arrays as part of the module's graph). Weak keys: they go
# with the layer. (The calls' memo is `call_path`'s.)
_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STEP_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> (weights(), fused)
_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _parameter_arrays(module: nnx.Module) -> list:
    """Every parameter array of `module` and its submodules, in `_weights_of`'s order."""
    out = []
    for name in _field_names(type(module)):
        value = module.__dict__.get(name)
        if isinstance(value, nnx.Module):
            out.extend(_parameter_arrays(value))
        elif value is not None:
            out.append(_array(value))
    return out


def _field_names(cls) -> tuple:
    """The parameter attributes of a module class (`_FIELD_NAMES`; a subclass has its base's)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = next((_FIELD_NAMES[base] for base in cls.__mro__ if base in _FIELD_NAMES), ())
    return names


# How the probe reads a parameter's array: its slot, where the parameter's class reads it there
# (flax's `Variable.get_raw_value`), else through the method.
_PLAIN_GET = getattr(nnx.Variable, "get_raw_value", None)
_RAW_SLOT = operator.attrgetter("_raw_value")
_RAW_VALUE = operator.methodcaller("get_raw_value")


def _parameter_probe(module: nnx.Module):
    """What `weights()` compares by identity to know its pytree is current, without walking the
    modules: (attribute dicts, names, the objects they held, the parameters, their arrays). None
    where a parameter holds something else than a plain array (then the walk, each call)."""
    owners, names, held, params, raws = [], [], [], [], []

    def walk(m) -> bool:
        fields = m.__dict__
        for name in _field_names(type(m)):
            value = fields.get(name)
            owners.append(fields)
            names.append(name)
            held.append(value)
            if isinstance(value, nnx.Module):
                if not walk(value):
                    return False
            elif value is not None:
                raw = value.get_raw_value() if hasattr(value, "get_raw_value") else None
                if not isinstance(raw, (jax.Array, np.ndarray)):
                    return False
                params.append(value)
                raws.append(raw)
        return True

    if not walk(module):
        return None
    plain = _PLAIN_GET is not None and all(type(p).get_raw_value is _PLAIN_GET for p in params)
    return _Probe((tuple(owners), tuple(names), tuple(held), tuple(params), tuple(raws),
                   _RAW_SLOT if plain else _RAW_VALUE))


class _Probe(tuple):
    """A `_parameter_probe`: (attribute dicts, names, the objects they held, the parameters,
    their arrays, how to read a parameter's array). The call path holds one beside the
    `step_weights()` it made and asks it `holds()`."""

    __slots__ = ()

    def holds(self) -> bool:
        """Every attribute still holds the object it held, every parameter the array it held."""
        owners, names, held, params, raws, read = self
        return (all(map(operator.is_, map(dict.get, owners, names), held))
                and all(map(operator.is_, map(read, params), raws)))


def _weights_of(module: nnx.Module, cls):
    """`cls` (a weights pytree) filled from `module`'s attributes of the same names.

    The parameters' names are the modules' attributes, set in the constructors: the one
    source. The weights pytrees name the same attributes (a mismatch fails at once), and the
    HF name table is derived from the same attributes (`weights.parameter_table`).
    """
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in DERIVED_WEIGHTS:
            continue
        value = getattr(module, field.name)
        values[field.name] = (None if value is None else value.weights() if isinstance(value, nnx.Module)
                              else _array(value))
    return cls(**values)


def _weights_from_probe(probe: _Probe, module_cls):
    """The weights pytree of the arrays `probe` recorded, in its walk's order (`_parameter_probe`):
    what the probe vouches for is exactly what the pytree holds."""
    held, raws = iter(probe[2]), iter(probe[4])

    def build(cls):
        values = {}
        for name in _field_names(cls):
            value = next(held)
            values[name] = (None if value is None else build(type(value)) if isinstance(value, nnx.Module)
                            else next(raws))
        return _pytree_class(cls)(**values)

    return build(module_cls)


def _pytree_class(module_cls):
    """The weights pytree class of a module class (a subclass has its base's)."""
    return next(_PYTREE_CLASSES[base] for base in module_cls.__mro__ if base in _PYTREE_CLASSES)


_FIELD_NAMES = {}  # module class -> the weights pytree's field names (filled below the classes)
_PYTREE_CLASSES = {}  # module class -> its weights pytree class (filled below the classes)


class DeepseekV4Attention(nnx.Module):
    """DeepSeek-V4 attention (sliding / CSA / HCA by `cfg.layer_types[layer_idx]`), with a cache.

    >>> attn = DeepseekV4Attention(cfg, layer_idx=1, rngs=nnx.Rngs(0))
    >>> cache = attn.init_cache(batch_size=2, max_seq_len=4096)
    >>> out, cache = attn(hidden_states, positions, cache)   # [B,S,hidden], int32 [B,S]

    Options (keyword arguments, each also a settable attribute): `LayerOptions`'s fields
    (break_mode, break_on, kernels, dtype, param_dtype, precision, query_block, donate_cache,
    check_finite, checkify, sharding_rules, numerics, overlap, deterministic), held as
    ``attn.options``.
    mesh: a `jax.sharding.Mesh` (axes "data" for the batch, "model" for the heads;
    `dsv4_jax.step.sharding.make_mesh`) to run on: the parameters are placed on it by their
    logical axes, `init_cache` makes a batch-sharded cache, and the breaks run per batch shard.
    None (default): no mesh of its own; the step then takes the mesh of an enclosing
    ``jax.set_mesh(...)``, or (eager calls) the one the cache is sharded over. An attribute;
    see `dsv4_jax.step.sharding`.

    Parameters (JAX [in, out] layout): ``q_a_proj [hidden, Lq]``, ``q_a_norm [Lq]``,
    ``q_b_proj [Lq, H*D]``, ``kv_proj [hidden, D]``, ``kv_norm [D]``,
    ``o_a_proj [G, H*D/G, R]``, ``o_b_proj [G*R, hidden]``, ``sinks [H]``; ``compressor``
    (CSA/HCA) and ``indexer`` (CSA) submodules. Load HF weights with
    `dsv4_jax.load_hf_attention_weights`.
    """

    def __init__(self, config: DeepseekV4Config, layer_idx: int, *, rngs: nnx.Rngs, mesh=None, **options):
        if not isinstance(config, DeepseekV4Config):
            raise TypeError(f"config: expected a DeepseekV4Config, got {type(config).__name__}")
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"{unknown[0]}: not an option of DeepseekV4Attention; expected one of {OPTION_NAMES}")
        self.options = LayerOptions(**options)
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_type(layer_idx)

        c, h, d = config, config.num_attention_heads, config.head_dim
        pd = self.param_dtype
        # Logical axes (`dsv4_jax.step.sharding.LOGICAL_AXIS_RULES`): heads split over "model" where
        # the math is per head (q_b_proj's head-major columns, sinks) and the output projection
        # by its groups (each group holds whole heads; XLA sums the groups' partial outputs).
        self.q_a_proj = _projection(rngs, (c.hidden_size, c.q_lora_rank), pd, ("embed", "q_lora"))
        self.q_a_norm = _param(jnp.ones((c.q_lora_rank,), jnp.float32), ("q_lora",))
        self.q_b_proj = _projection(rngs, (c.q_lora_rank, h * d), pd, ("q_lora", "heads"))
        self.kv_proj = _projection(rngs, (c.hidden_size, d), pd, ("embed", "kv"))
        self.kv_norm = _param(jnp.ones((d,), jnp.float32), ("kv",))
        self.o_a_proj = _projection(rngs, (c.o_groups, h * d // c.o_groups, c.o_lora_rank), pd,
                                    ("o_groups", "group_dim", "o_lora"))
        self.o_b_proj = _projection(rngs, (c.o_groups * c.o_lora_rank, c.hidden_size), pd, ("o_groups", "embed"))
        self.sinks = _param(jnp.zeros((h,), jnp.float32), ("heads",))
        self.compressor = (
            Compressor(c.hidden_size, c.compressor_width(self.layer_type), d, c.compress_rate(self.layer_type),
                       rngs=rngs, param_dtype=pd)
            if self.layer_type in (CSA, HCA) else None
        )
        self.indexer = Indexer(c, rngs=rngs, param_dtype=pd) if self.layer_type == CSA else None
        self.mesh = None
        if mesh is not None:
            sharding.shard_layer(self, mesh, self.sharding_rules)

    # ------------------------------------------------------------------ public API
    def init_cache(self, batch_size: int, max_seq_len: int, dtype=None, *,
                   allow_long_context: bool = False, kv_cache_dtype: str = "auto",
                   max_rewind: int = 0, page_size: int | None = None,
                   num_pages: int | None = None) -> AttentionCache:
        """An empty cache for `batch_size` rows of up to `max_seq_len` tokens.

        dtype: the cache dtype; defaults to the layer's compute dtype, which is `dtype`, else
        `param_dtype` (the compute dtype does not depend on the inputs: with
        ``param_dtype=jnp.bfloat16`` and ``dtype=None`` the layer computes in bf16 for float32
        and bf16 inputs alike, and this default cache fits both). A cache of another dtype
        than the compute dtype is refused at the call with a `TypeError` naming ``cache``.
        allow_long_context: `max_seq_len` past ``config.max_position_embeddings`` (positions the
        model was not trained for) is a `ValueError` naming both unless this is True (as vLLM
        refuses a ``max_model_len`` past the model's limit unless told otherwise).
        kv_cache_dtype: "auto" (the rows in `dtype`) or "fp8" (FP8 caches: the window and the
        compressed entries as FP8 grid values with a scale byte a block, the indexer's keys on
        the FP4 grid, in about half the bytes; `dsv4_jax.cache.quantized`). Lossless for a layer
        with ``numerics="official"`` (same picks and outputs as its bf16 cache, bit for bit),
        which it requires: with "reference" numerics a `ValueError` names ``kv_cache_dtype``.
        page_size, num_pages: a paged cache (`dsv4_jax.cache.paged`): the compressed entries in a
        pool of `num_pages` pages of `page_size` tokens (a multiple of the compress ratios; 256
        fits V4's), each row holding only the pages its tokens need; the window and the
        compressors' rings stay per row. The layer's calls take pages as rows grow,
        `reset_rows` gives them back; under your own jit, `dsv4_jax.reserve_pages` first. Give
        every layer of a stack the same batch, max_seq_len, page_size and num_pages: their
        caches then hold one page table.
        max_rewind: K >= 0, the most tokens a row can take back with `dsv4_jax.rewind_rows`
        (speculative decoding: the rejected drafts). K > 0 keeps, per ring, the K tokens it last
        evicted (`dsv4_jax.cache.history`): K rows of the window's and of each compressor ring's
        width a batch row, and the step writes up to ``min(K, S)`` of them more per ring; 0 (the
        default) keeps nothing and costs nothing.
        """
        dtype = validation.check_float_dtype("dtype", dtype, allow_none=True)
        dtype = dtype or self.compute_dtype
        if check_kv_cache_dtype(kv_cache_dtype) == "fp8" and self.numerics != "official":
            raise ValueError(
                "kv_cache_dtype: 'fp8' stores the keys on the official numerics' FP8/FP4 grid; expected a layer "
                f"with numerics='official', got numerics={self.numerics!r}")
        if page_size is not None and self.mesh is not None:
            raise ValueError("page_size: a paged cache is not sharded over a mesh (yet); expected page_size=None "
                             f"for a layer with a mesh, got page_size={page_size!r}")
        cache = init_attention_cache(self.config, self.layer_idx, batch_size, max_seq_len, dtype,
                                     allow_long_context=allow_long_context, kv_cache_dtype=kv_cache_dtype,
                                     max_rewind=max_rewind, page_size=page_size, num_pages=num_pages)
        cache = cache.replace(numerics=self.numerics)  # its rows will hold this numerics' rounding
        # On a mesh: batch-sharded over its "data" axis (`ValueError` naming batch_size if it does not split).
        return cache if self.mesh is None else sharding.shard_cache(cache, self.mesh, self.sharding_rules)

    def weights(self) -> AttentionWeights:
        """The current parameters as an `AttentionWeights` pytree of arrays.

        Built once and reused while every parameter still holds the same array (checked by
        identity each call: an assignment, a loaded checkpoint or an optimizer update makes a
        new pytree). The cache lives outside the module (`_WEIGHTS`), so NNX never sees it; it
        keeps a probe of the attributes, parameters and arrays it was built from, so that the
        check is a few identity comparisons rather than a walk of the modules.

        Safe against a concurrent load (another thread assigning parameters): the pytree is
        built from the very arrays the probe recorded, never from a second read, so a memo can
        never pair older arrays with a newer probe (which would keep the old weights forever)."""
        return self._probed_weights()[1]

    def _probed_weights(self) -> tuple:
        """(the probe of the parameters, or None, `weights()` built from exactly what it read)."""
        hit = _WEIGHTS.get(self)
        if hit is not None and hit[0] is not None and hit[0].holds():
            return hit[0], hit[2]  # the same parameters still hold the same arrays
        probe = _parameter_probe(self)
        if probe is None:  # a parameter holds something else than a plain array: the walk
            weights = _weights_of(self, AttentionWeights)
            _WEIGHTS[self] = (None, None, weights)
            return None, weights
        # The arrays' identities are a valid key: the memo's pytree keeps its own arrays alive.
        key = tuple(map(id, probe[4]))
        if hit is not None and hit[1] == key:  # the cached pytree holds these very arrays
            weights = hit[2]
        else:
            weights = _weights_from_probe(probe, type(self))
        _WEIGHTS[self] = (probe, key, weights)
        return probe, weights

    def step_weights(self) -> AttentionWeights:
        """What the layer's call hands its compiled step: `weights()`, for a CSA layer with the
        input projections' weights side by side (`fuse_input_projections`), made once per
        `weights()` pytree.

        Use it to drive `attention_step` yourself at the layer's speed; differentiate through
        `weights()` (its leaves are the parameters; `input_proj` would be a leaf of its own)."""
        return self._step_weights_of(self.weights())

    def _step_weights_of(self, weights: AttentionWeights) -> AttentionWeights:
        if weights.indexer is None:
            # Only CSA layers: their 7 input GEMMs are what XLA merged (with the copy); an HCA
            # layer's 4 ran slower as one on the H200 (B = 1: 0.17 against 0.12 ms a layer).
            return weights
        hit = _STEP_WEIGHTS.get(self)
        if hit is None or hit[0] is not weights:
            hit = _STEP_WEIGHTS[self] = (weights, fuse_input_projections(weights))
        return hit[1]

    def _hold_input_projections(self, input_proj) -> None:
        """Let `step_weights()` hand out `weights()` with this `input_proj` while the parameters
        hold: the fused input projections made once outside a trace and passed into it as an
        argument (`dsv4_jax.layer.jit_modules`), instead of concatenated inside every step."""
        weights = self.weights()
        _STEP_WEIGHTS[self] = (weights, weights.replace(input_proj=input_proj))

    def _probed_step_weights(self) -> tuple:
        """(the probe of the parameters `weights()` was made from, or None, `step_weights()`):
        what the call path holds to reuse the pytree while the probe `holds()`. Both come from
        one `_probed_weights()` (no second look-up another thread could change in between)."""
        probe, weights = self._probed_weights()
        return probe, self._step_weights_of(weights)

    @property
    def compute_dtype(self):
        """The dtype the layer computes in (and its cache holds): `dtype`, else `param_dtype`."""
        return self.options.compute_dtype

    def step_spec(self, return_intermediates: bool = False, checks: bool = False) -> StepSpec:
        """The static description of the compiled step this layer runs (inputs of any float dtype:
        they are cast to the layer's `compute_dtype`). `return_intermediates`: the step that also
        returns `Intermediates`; `checks`: the step with in-graph `checkify` checks
        (`check_in_graph`), to run under `checkify.checkify`. Memoized per value of everything it
        reads (the layer's options and the mesh)."""
        mesh = self.mesh if self.mesh is not None else sharding.context_mesh()
        key = (mesh, self.options, bool(return_intermediates), bool(checks))
        specs = _SPECS.setdefault(self, {})
        spec = specs.get(key)
        if spec is None:
            spec = specs[key] = self._new_step_spec(mesh, return_intermediates, checks)
        return spec

    def _new_step_spec(self, mesh, return_intermediates: bool, checks: bool) -> StepSpec:
        layout = None if mesh is None else sharding.layout(self.config, mesh, self.sharding_rules)
        plan = plan_step(self.layer_type, self.break_mode, self.break_on, self.kernels, layout=layout,
                         overlap=self.overlap, deterministic=self.deterministic)
        dtype = self.compute_dtype
        precision = self.precision
        if precision is None and jnp.dtype(dtype) == jnp.float32:
            precision = jax.lax.Precision.HIGHEST
        return StepSpec(cfg=self.config, layer_type=self.layer_type, plan=plan,
                        dtype=jnp.dtype(dtype), precision=precision, query_block=self.query_block,
                        return_intermediates=bool(return_intermediates), checks=bool(checks),
                        numerics=self.numerics)

    def __call__(self, hidden_states, positions, cache: AttentionCache, *, return_intermediates: bool = False):
        """Run the layer on S new tokens per row and return ``(out, cache)``.

        hidden_states: [B, S, hidden] float; positions: int [B, S]: row b's real tokens
        continue its length (``cache.length[b], cache.length[b] + 1, ...``), then -1 pads the
        row to S (ragged batches: rows may differ in length and in new tokens; padded slots
        output zeros and write nothing; at least one real token per call). ``positions=None``:
        every slot real, each row continuing its cache (`cache.next_positions`); under a jit
        they are then computed from the cache's length inside the program (a decode step
        that takes no positions argument; see `attention_step`).
        With ``return_intermediates=True`` returns ``(out, cache, Intermediates)``; off by
        default, and then nothing extra is computed (it is a separate compiled step).

        Runs compiled code: the first call of each (layer type, shapes, options) compiles, later
        calls (e.g. every decode step, and every layer of the same type) reuse it. Inside a
        user's `jax.jit`/`nnx.jit` it is traced: the value checks are skipped (or, with
        ``checkify=True``, become `checkify` checks), and a call past `max_seq_len` leaves the
        cache unchanged and returns NaN (see `attention_step`).
        """
        return call_path.call(self, hidden_states, positions, cache, return_intermediates)


for _name in OPTION_NAMES:  # attn.break_mode, ...: the options, settable one at a time
    setattr(DeepseekV4Attention, _name, option_property(_name))

_FIELD_NAMES.update({
    DeepseekV4Attention: tuple(f.name for f in dataclasses.fields(AttentionWeights) if f.name not in DERIVED_WEIGHTS),
    Compressor: tuple(f.name for f in dataclasses.fields(CompressorWeights)),
    Indexer: tuple(f.name for f in dataclasses.fields(IndexerWeights)),
})
_PYTREE_CLASSES.update({DeepseekV4Attention: AttentionWeights, Compressor: CompressorWeights,
                        Indexer: IndexerWeights})
