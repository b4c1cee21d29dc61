"""Train a CSA layer's lightning indexer with its KL loss (`dsv4_jax.indexer_kl_loss`), DeepSeek-V3.2's way.

    python examples/train_indexer.py --size flash --steps 200          # V4-Flash sizes, bf16 (a GPU)
    python examples/train_indexer.py --size tiny --steps 60            # seconds on a CPU

The main attention is frozen; only the indexer's parameters (``q_b_proj``, ``weights_proj`` and
its key compressor) learn, with Adam (optax), from the KL divergence between the main
attention's distribution over the compressed entries and the softmax of the indexer's scores:
first the dense warm-up (``over="visible"``: every entry a query may see), then the sparse phase
(``over="topk"``: the indexer's own picks). Each step is one `jax.jit` of `attention_step` with
intermediates, a prefill of ``--tokens`` tokens per row into an empty cache, in
``break_mode="none"`` (no break: the scores the loss differentiates stay in the program).

The hidden states are a fixed set of random batches (`--batches`), so the loss falls as the
indexer fits the main attention's choices on them; with real weights and text, feed real
hidden states instead. Prints the loss every ``--every`` steps; ``--json`` writes the curve.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import dsv4_jax
from dsv4_jax import CSA, attention_step, indexer_kl_loss

SIZES = {  # config, parameter dtype, batch, tokens per row
    "tiny": (dsv4_jax.DeepseekV4Config.tiny, jnp.float32, 2, 48),
    "flash": (dsv4_jax.DeepseekV4Config.flash, jnp.bfloat16, 1, 4096),
}


def make_layer(size: str, seed: int):
    make_config, param_dtype, _, _ = SIZES[size]
    cfg = make_config()
    return dsv4_jax.DeepseekV4Attention(cfg, cfg.layer_types.index(CSA), rngs=nnx.Rngs(seed), break_mode="none",
                                        param_dtype=param_dtype)


def train(size: str = "tiny", steps: int = 60, warmup: int | None = None, lr: float = 1e-2, batches: int = 2,
          tokens: int | None = None, seed: int = 0, every: int = 10, log=print) -> list[dict]:
    """Train the indexer of a random CSA layer; returns the curve [{step, phase, loss}, ...].

    `warmup`: steps of the dense phase ("visible") before the sparse one ("topk"); default a
    quarter of `steps`."""
    attn = make_layer(size, seed)
    _, _, batch, default_tokens = SIZES[size]
    tokens = tokens or default_tokens
    warmup = steps // 4 if warmup is None else warmup
    spec = attn.step_spec(return_intermediates=True)
    frozen = attn.weights()
    # The indexer's parameters train in float32 (master copy); the step casts them to its compute dtype.
    params = jax.tree.map(lambda p: p.astype(jnp.float32), frozen.indexer)
    cache = attn.init_cache(batch, tokens).replace(layer_idx=-1)
    cache = cache.replace(length=jnp.asarray(cache.length))
    rng = np.random.default_rng(seed + 1)
    xs = [jnp.asarray(rng.standard_normal((batch, tokens, attn.config.hidden_size)), attn.compute_dtype)
          for _ in range(batches)]
    optimizer = optax.adam(lr)
    state = optimizer.init(params)

    def loss(params, x, over):
        _, _, inter = attention_step(frozen.replace(indexer=params), cache, x, None, spec)
        return indexer_kl_loss(inter, over=over)

    @jax.jit(static_argnames="over")
    def step(params, state, x, over):
        value, grad = jax.value_and_grad(loss)(params, x, over)
        updates, state = optimizer.update(grad, state, params)
        return optax.apply_updates(params, updates), state, value

    curve, t0 = [], time.perf_counter()
    for i in range(steps):
        over = "visible" if i < warmup else "topk"
        params, state, value = step(params, state, xs[i % batches], over)
        curve.append({"step": i, "phase": over, "loss": float(value)})
        if i % every == 0 or i == steps - 1:
            log(f"step {i:4d} {over:7s} loss {float(value):.4f}  ({time.perf_counter() - t0:.1f} s)")
    return curve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="tiny", choices=tuple(SIZES))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=None, help="dense-phase steps (default: a quarter)")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--batches", type=int, default=2, help="fixed random batches cycled through")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per row (default: tiny 48, flash 4096)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    curve = train(args.size, args.steps, args.warmup, args.lr, args.batches, args.tokens, args.seed, args.every)
    if args.json:
        Path(args.json).write_text(json.dumps({"size": args.size, "device": str(jax.devices()[0]),
                                               "jax": jax.__version__, "args": vars(args), "curve": curve}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
