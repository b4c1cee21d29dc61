"""`python -m dsv4_jax.demo`: one layer of each type, prefill + decode, every break mode.

Prints, per layer type and break mode: compile and run times, the cache it filled, the
indexer's picks for the last query, and how far the modes and a one-shot prefill of the same
tokens agree (they should: same picks, outputs equal to float32 rounding).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import native
from .attention import DeepseekV4Attention
from .breaks import BREAK_MODES, plan_break
from .config import CSA, DeepseekV4Config


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    jax.block_until_ready(result)
    return result, time.perf_counter() - start


def run_layer(cfg: DeepseekV4Config, layer_idx: int, x: np.ndarray, prompt: int, steps: int, modes) -> None:
    batch, total = x.shape[:2]
    layer_type = cfg.layer_type(layer_idx)
    print(f"\n== layer {layer_idx}: {layer_type} ==")
    attn = DeepseekV4Attention(cfg, layer_idx, rngs=nnx.Rngs(layer_idx))
    if layer_type != CSA:
        print("  (no indexer here: 'narrow' has no break and shares the compiled step of 'none')")
    results = {}
    for mode in modes:
        attn.break_mode = mode
        cache = attn.init_cache(batch_size=batch, max_seq_len=total)
        pos = np.broadcast_to(np.arange(prompt, dtype=np.int32), (batch, prompt))
        (out, cache, inter), first = _timed(attn, jnp.asarray(x[:, :prompt]), pos, cache, return_intermediates=True)
        outs, picks, step_times = [np.asarray(out)], [inter.topk], []
        for t in range(prompt, total):
            pos = np.full((batch, 1), t, np.int32)
            (out, cache, inter), dt = _timed(attn, jnp.asarray(x[:, t:t + 1]), pos, cache, return_intermediates=True)
            outs.append(np.asarray(out))
            picks.append(inter.topk)
            step_times.append(dt)
        decode_ms = 1e3 * float(np.median(step_times[1:] if len(step_times) > 1 else step_times))
        results[mode] = np.concatenate(outs, axis=1), picks, cache, inter
        print(f"  {mode:>6}: prefill {prompt} tokens {1e3 * first:8.1f} ms (first call: compiles, unless shared); "
              f"{steps} decode steps, median {decode_ms:6.2f} ms/step after the first")

    ref_out, ref_picks, cache, inter = results[modes[0]]
    print(f"  cache after {total} tokens: length {cache.length.tolist()}, window {tuple(cache.window.shape)}", end="")
    if inter.num_entries is not None:
        print(f", compressed entries {np.asarray(inter.num_entries).tolist()} "
              f"of {inter.compressed_kv.shape[1]} slots", end="")
    print()
    if layer_type == CSA:
        print(f"  indexer picks of the last query (row 0, top-{cfg.index_topk}): "
              f"{np.asarray(ref_picks[-1])[0, -1].tolist()}")
    for mode in modes[1:]:
        out, picks, _, _ = results[mode]
        line = f"  {mode} vs {modes[0]}: max |out diff| {np.abs(out - ref_out).max():.2e}"
        if layer_type == CSA:  # only CSA layers pick: elsewhere there is nothing to compare
            same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(ref_picks, picks))
            queries = sum(np.asarray(p).shape[1] for p in picks)
            line += (f", picks {'identical' if same else 'DIFFER'} "
                     f"({len(picks)} calls, {batch} x {queries} queries x top-{cfg.index_topk})")
        print(line)
    attn.break_mode = modes[0]
    one_shot, _ = attn(jnp.asarray(x), np.broadcast_to(np.arange(total, dtype=np.int32), (batch, total)),
                       attn.init_cache(batch, total))
    err = np.linalg.norm(np.asarray(one_shot) - ref_out) / np.linalg.norm(ref_out)
    print(f"  prefill {prompt} + {steps} decode steps vs one-shot prefill of all {total}: rel err {err:.1e}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=40, help="prompt tokens (prefill)")
    parser.add_argument("--steps", type=int, default=12, help="decode steps after the prompt")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--modes", default=",".join(BREAK_MODES), help="comma-separated break modes")
    args = parser.parse_args(argv)
    modes = tuple(args.modes.split(","))

    cfg = DeepseekV4Config.tiny()  # sliding / CSA (ratio 4, top-4) / HCA (ratio 8), window 8
    print(f"dsv4_jax demo on {jax.devices()[0].platform} (jax {jax.__version__}); config: hidden "
          f"{cfg.hidden_size}, {cfg.num_attention_heads} heads x {cfg.head_dim}, window {cfg.sliding_window}, "
          f"CSA ratio {cfg.csa_compress_rate} top-{cfg.index_topk}, HCA ratio {cfg.hca_compress_rate}; "
          f"batch {args.batch}, prompt {args.prompt}, {args.steps} decode steps; modes {', '.join(modes)}")
    # Where the CSA layer's narrow break runs here (break_on="auto"): the native handler on this
    # device when it is built, else the host callback (dsv4_jax.native_info() says why).
    plan = plan_break(CSA, "narrow", "auto")
    print(f"the narrow break runs on the {plan.place}" + (" (native XLA FFI handler)" if plan.native_select else
          f" (jax.pure_callback; {native.unavailable_reason(jax.default_backend())})"))
    x = np.random.default_rng(0).normal(size=(args.batch, args.prompt + args.steps, cfg.hidden_size))
    for layer_idx in range(cfg.num_layers):
        run_layer(cfg, layer_idx, x.astype(np.float32), args.prompt, args.steps, modes)


if __name__ == "__main__":
    main()
