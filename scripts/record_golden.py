"""Record the golden reference runs of tests/data/*.npz from HF transformers 5.23.0.

    python scripts/record_golden.py OUT_DIR [NAME ...] [--inputs-from DIR]

Needs torch and transformers==5.23.0 (the `[hf]` extra). For each recording (NAME, default
all of `RECORDINGS`) it runs HF's `DeepseekV4Attention` layer by layer through
`dsv4_jax.io.hf_reference.HFAttentionRunner` (float32, CPU, a `DynamicCache`, masks and rotary
tables built as `DeepseekV4Model` builds them; top-k ties to the lower entry index) over the
recording's schedule of calls, and writes OUT_DIR/NAME in the format of tests/data/README.md.

Inputs (the layers' weights and the attention inputs of every call):

* `--inputs-from DIR`: read from DIR/NAME, an existing recording; the reference outputs
  (`out`, and for the CSA layer `topk` and `index_scores`) are recorded again. The committed
  files' inputs came from a run of the whole `DeepseekV4Model` whose script is not in this
  repository; this mode re-derives everything that is the reference's answer from them.
* otherwise: drawn from the recording's seed by `make_inputs` (NumPy), so a new file is
  reproducible from this script alone.

The `RECORDINGS` table is the one place for each recording's config, schedule, batch and
seed; tests/io/test_golden_record.py checks the committed files against it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from dsv4_jax.config import CSA, HCA, SLIDING, DeepseekV4Config, YarnScaling  # noqa: E402
from dsv4_jax.io.hf_weights import expected_shapes  # noqa: E402

TRANSFORMERS_VERSION = "5.23.0"
SOURCE = "transformers DeepseekV4Model, float32, CPU, top-k ties broken by lower index"
TIE_RULE = "stable top-k: among equal indexer scores the lower entry index wins"


@dataclasses.dataclass(frozen=True)
class Recording:
    config: DeepseekV4Config
    schedule: tuple[int, ...]  # new tokens per call
    batch: int
    seed: int
    # "official": HF's layer with the official inference's roundings put in at its places
    # (`dsv4_jax.io.hf_reference.official_roundings`), the reference of ``numerics="official"``.
    numerics: str = "reference"
    # With --inputs-from: the recording whose weights and inputs this one reuses (default: itself).
    inputs_of: str | None = None

    @property
    def total(self) -> int:
        return sum(self.schedule)


_YARN = YarnScaling(factor=16.0, original_max_position_embeddings=64)
_LAYERS = (SLIDING, CSA, HCA)

RECORDINGS = {
    # `DeepseekV4Config.tiny()` but for its indexer: 2 heads and top-3 (tiny's: 4 heads, top-4).
    "tiny_seed1.npz": Recording(
        DeepseekV4Config.tiny(index_n_heads=2, index_topk=3),
        schedule=(9, 1, 1, 1, 6, 1, 1), batch=1, seed=1,
    ),
    # A config of its own, 4x tiny's width (not `DeepseekV4Config.small()`, the benchmarks'
    # 1024-wide one): every size differs from both presets.
    "small_seed0.npz": Recording(
        DeepseekV4Config(
            hidden_size=256, num_attention_heads=8, head_dim=64, qk_rope_head_dim=16, q_lora_rank=128, o_groups=4,
            o_lora_rank=64, sliding_window=16, index_n_heads=4, index_head_dim=32, index_topk=6,
            layer_types=_LAYERS, csa_compress_rate=4, hca_compress_rate=16, compress_rope_scaling=_YARN,
            max_position_embeddings=4096,
        ),
        schedule=(45,) + (1,) * 7 + (13, 1, 1, 1), batch=2, seed=0,
    ),
}
# small_seed0's weights and inputs through the official numerics (recorded with --inputs-from
# tests/data): the same calls, so the two files also show what the rounding changes.
RECORDINGS["small_seed0_official.npz"] = dataclasses.replace(
    RECORDINGS["small_seed0.npz"], numerics="official", inputs_of="small_seed0.npz")

# HF model fields outside attention (no effect on it) with which the recordings were made.
MODEL_FIELDS = dict(vocab_size=97, hc_mult=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    num_nextn_predict_layers=0)


def hf_kwargs(rec: Recording) -> dict:
    """The keyword arguments of HF's `DeepseekV4Config` for `rec` (no transformers needed)."""
    kwargs = {**rec.config.to_hf(), **MODEL_FIELDS, "mlp_layer_types": ["moe"] * rec.config.num_layers}
    compress = dict(kwargs["rope_parameters"]["compress"])
    if compress.get("truncate") is True:  # HF's default: the recordings left it implicit
        del compress["truncate"]
    kwargs["rope_parameters"] = {**kwargs["rope_parameters"], "compress": compress}
    return kwargs


def meta(rec: Recording, source: str = SOURCE) -> dict:
    """The file's `meta` (needs transformers: `hf_config` is HF's normalized config, non-defaults)."""
    from dsv4_jax.io.hf_reference import hf_config

    kwargs = hf_kwargs(rec)
    hf = hf_config(rec.config, **kwargs).to_diff_dict()
    hf.pop("_attn_implementation", None)  # how it ran, not what the model is
    out = {"hf_config": hf, "layer_types": list(rec.config.layer_types), "schedule": list(rec.schedule),
           "batch": rec.batch, "seed": rec.seed, "source": source}
    if rec.numerics != "reference":
        out["numerics"] = rec.numerics
    return out


def entries_after(rec: Recording, layer_type: str) -> list[int]:
    """Compressed entries that exist after each call (the width of `index_scores`)."""
    m = rec.config.compress_rate(layer_type)
    return [int(np.sum(rec.schedule[: c + 1])) // m for c in range(len(rec.schedule))] if m else []


def array_shapes(rec: Recording) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every array key of the file but `meta` -> (shape, dtype name)."""
    cfg, b = rec.config, rec.batch
    shapes = {}
    for i, layer_type in enumerate(cfg.layer_types):
        for name, (shape, _) in expected_shapes(cfg, layer_type).items():
            shapes[f"layer{i}/params/{name}"] = (shape, "float32")
        entries = entries_after(rec, layer_type)
        for c, n in enumerate(rec.schedule):
            prefix = f"layer{i}/call{c}/"
            shapes[prefix + "hidden"] = ((b, n, cfg.hidden_size), "float32")
            shapes[prefix + "positions"] = ((1, n), "int64")
            shapes[prefix + "out"] = ((b, n, cfg.hidden_size), "float32")
            if layer_type == CSA:
                shapes[prefix + "topk"] = ((b, n, min(cfg.index_topk, entries[c])), "int64")
                shapes[prefix + "index_scores"] = ((b, n, entries[c]), "float32")
    return shapes


def make_inputs(rec: Recording) -> tuple[dict[int, dict[str, np.ndarray]], dict[int, np.ndarray]]:
    """Fresh inputs from `rec.seed`: ({layer: HF-named weights}, {layer: hidden [B, N, hidden]}).

    Projections ~ N(0, 1/fan_in), norm weights 1 + 0.2 N(0, 1), sinks and position biases
    N(0, 0.5^2) (so that they matter), attention inputs N(0, 1).
    """
    rng = np.random.default_rng(rec.seed)
    cfg, weights, hidden = rec.config, {}, {}
    for i, layer_type in enumerate(cfg.layer_types):
        weights[i] = {}
        for name, (shape, kind) in sorted(expected_shapes(cfg, layer_type).items()):
            if kind != "fp32":
                w = rng.normal(0.0, shape[1] ** -0.5, shape)
            elif name.endswith("norm.weight"):
                w = 1.0 + 0.2 * rng.normal(size=shape)
            else:
                w = rng.normal(0.0, 0.5, shape)
            weights[i][name] = w.astype(np.float32)
        hidden[i] = rng.normal(size=(rec.batch, rec.total, cfg.hidden_size)).astype(np.float32)
    return weights, hidden


def inputs_from(path: Path, rec: Recording) -> tuple[dict[int, dict[str, np.ndarray]], dict[int, np.ndarray]]:
    """The weights and attention inputs of an existing recording of `rec`."""
    with np.load(path) as f:
        data = {k: f[k] for k in f.files}
    weights, hidden = {}, {}
    for i in range(rec.config.num_layers):
        prefix = f"layer{i}/params/"
        weights[i] = {k[len(prefix):]: v for k, v in data.items() if k.startswith(prefix)}
        hidden[i] = np.concatenate([data[f"layer{i}/call{c}/hidden"] for c in range(len(rec.schedule))], axis=1)
    return weights, hidden


def _keep(seen: dict, key: str):
    """A forward hook that stores the module's output as seen[key]."""
    def hook(module, args, out):
        seen[key] = out
    return hook


def record(rec: Recording, weights, hidden, source: str = SOURCE) -> dict[str, np.ndarray]:
    """Run the reference over `rec.schedule`: the file's arrays, `meta` included."""
    import contextlib

    from dsv4_jax.io.hf_reference import HFAttentionRunner, official_roundings, official_sites

    arrays = {"meta": np.frombuffer(json.dumps(meta(rec, source)).encode(), np.uint8)}
    for i, layer_type in enumerate(rec.config.layer_types):
        for name, w in weights[i].items():
            arrays[f"layer{i}/params/{name}"] = np.asarray(w, np.float32)
        runner = HFAttentionRunner(rec.config, i, weights[i], **hf_kwargs(rec))
        seen: dict = {}
        hooks = []
        if layer_type == CSA:  # the scores before causal masking, and the picks (-1: nothing)
            indexer = runner.layer.compressor.indexer
            hooks = [indexer.scorer.register_forward_hook(_keep(seen, "index_scores")),
                     indexer.register_forward_hook(_keep(seen, "topk"))]
        official = rec.numerics == "official"
        numerics = official_roundings(rec.config.qk_rope_head_dim) if official else contextlib.nullcontext()
        try:
            with numerics as sites:
                _record_calls(rec, runner, i, layer_type, hidden, seen, arrays)
            if official and set(sites) != official_sites(layer_type):
                raise RuntimeError(f"layer {i}: the official roundings reached {sorted(sites)}, "
                                   f"expected {sorted(official_sites(layer_type))}")
        finally:
            for hook in hooks:
                hook.remove()
    return arrays


def _record_calls(rec: Recording, runner, i: int, layer_type: str, hidden, seen: dict, arrays: dict) -> None:
    import torch

    start = 0
    for c, n in enumerate(rec.schedule):
        prefix = f"layer{i}/call{c}/"
        x = np.ascontiguousarray(hidden[i][:, start:start + n], np.float32)
        positions = np.arange(start, start + n, dtype=np.int64)[None]
        seen.clear()
        with torch.no_grad():
            out = runner(x, np.broadcast_to(positions, (rec.batch, n)))
        arrays[prefix + "hidden"] = x
        arrays[prefix + "positions"] = positions
        arrays[prefix + "out"] = out.astype(np.float32)
        if layer_type == CSA:
            arrays[prefix + "topk"] = seen["topk"].numpy().astype(np.int64)
            arrays[prefix + "index_scores"] = seen["index_scores"].float().numpy()
        start += n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("names", nargs="*", default=list(RECORDINGS), help=f"of {list(RECORDINGS)}")
    parser.add_argument("--inputs-from", type=Path, help="take weights and inputs from DIR/NAME")
    args = parser.parse_args(argv)
    import transformers

    if transformers.__version__ != TRANSFORMERS_VERSION:
        parser.error(f"expected transformers=={TRANSFORMERS_VERSION}, got {transformers.__version__}")
    unknown = [n for n in args.names if n not in RECORDINGS]
    if unknown:
        parser.error(f"names: expected some of {list(RECORDINGS)}, got {unknown}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        rec = RECORDINGS[name]
        if args.inputs_from:
            inputs = inputs_from(args.inputs_from / (rec.inputs_of or name), rec)
            source = f"{SOURCE}; outputs re-recorded by scripts/record_golden.py"
        else:
            inputs = make_inputs(rec)
            source = (f"transformers {TRANSFORMERS_VERSION} DeepseekV4Attention via dsv4_jax.io.hf_reference, float32, "
                      f"CPU, {TIE_RULE}; inputs from scripts/record_golden.py make_inputs(seed={rec.seed})")
        np.savez_compressed(args.out_dir / name, **record(rec, *inputs, source=source))
        print(f"wrote {args.out_dir / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
