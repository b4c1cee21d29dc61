"""`python -m dsv4_jax.tools.demo`: one layer of each type, prefill + decode, every break mode;
then the three layers as a model's decode loop would run them.

Prints, per layer type and break mode: compile and run times, the cache it filled, the
indexer's picks for the last query, and how far the modes and a one-shot prefill of the same
tokens agree (they should: same picks, outputs equal to float32 rounding). Then the layers
stacked (``h = h + attn(h)``): a prefill through the module calls, and decode steps of all
layers in one `jax.jit` that takes no positions (each layer's from its cache) and donates its
caches and hidden states, against the same steps through the module calls.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv4_jax import native
from dsv4_jax.config import CSA, DeepseekV4Config
from dsv4_jax.layer.module import DeepseekV4Attention
from dsv4_jax.step import overlap as overlap_mod
from dsv4_jax.step.plan import BREAK_MODES, where_break_runs
from dsv4_jax.step.pure_step import attention_step


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


def stack_step(weights, caches, hidden_states, positions, specs):
    """A stack of layers as one pure function, ``h = h + attention(layer_i, h)`` for each layer
    in order: `weights`, `caches` and `specs` hold one entry a layer (`attn.step_weights()`, the
    pure step's caches, `attn.step_spec()`); `positions` int [B, S] or None (each row's next
    positions from each layer's cache length). hidden_states [B, S, hidden] -> (the same shape,
    the new caches). `stack_decode_step` jits it for decoding; bench/stack.py times its variants."""
    h = hidden_states
    new_caches = []
    for w, cache, spec in zip(weights, caches, specs):
        out, cache, _ = attention_step(w, cache, h, positions, spec)
        h = h + out.astype(h.dtype)
        new_caches.append(cache)
    return h, new_caches


def _stack_decode(weights, caches, hidden_states, specs):
    return stack_step(weights, caches, hidden_states, None, specs)


# Per overlap (`dsv4_jax.step.overlap`): the program's compile options follow its layers' plans.
_STACK_DECODE = {overlap: jax.jit(_stack_decode, static_argnames=("specs",),
                                  donate_argnames=("caches", "hidden_states"),
                                  compiler_options=overlap_mod.compiler_options(overlap))
                 for overlap in (False, True)}


def stack_decode_step(weights, caches, hidden_states, specs):
    """One decode step of a stack of layers (`stack_step`) as one program.

    No positions argument (``positions=None``: each row's next position from each layer's cache
    length) and the caches and hidden states donated: fed its own output, the step gets the same
    buffers every call, so on a GPU XLA replays its CUDA graph without re-recording any command
    (docs/breaks_and_kernels.md, "Why the kernels' defaults"). Compiled with
    the overlap where the layers' steps have it (their ``overlap`` setting, `dsv4_jax.step.overlap`).
    hidden_states [B, 1, hidden] -> (the same shape, the new caches)."""
    overlap = any(spec.plan.overlap for spec in specs)
    return _STACK_DECODE[overlap](weights, caches, hidden_states, specs=specs)


def run_stack(cfg: DeepseekV4Config, x: np.ndarray, prompt: int, steps: int) -> None:
    """The config's layers stacked: prefill through the module calls, then `steps` decode steps
    in one jitted program (`stack_decode_step`) against the same steps through the module calls."""
    batch, total = x.shape[0], prompt + steps
    print(f"\n== the {cfg.num_layers} layers stacked, decode steps in one jax.jit ==")
    layers = [DeepseekV4Attention(cfg, i, rngs=nnx.Rngs(i)) for i in range(cfg.num_layers)]
    h = jnp.asarray(x[:, :prompt])
    caches = [attn.init_cache(batch_size=batch, max_seq_len=total) for attn in layers]
    pos = np.broadcast_to(np.arange(prompt, dtype=np.int32), (batch, prompt))
    for i, attn in enumerate(layers):
        out, caches[i] = attn(h, pos, caches[i])
        h = h + out
    token = h[:, -1:]  # what decode feeds back here: the last hidden state (a stand-in for a new token)

    eager, eager_caches, h_eager = [], list(caches), token
    for t in range(prompt, total):
        for i, attn in enumerate(layers):
            out, eager_caches[i] = attn(h_eager, np.full((batch, 1), t, np.int32), eager_caches[i])
            h_eager = h_eager + out
        eager.append(np.asarray(h_eager))

    weights = [attn.step_weights() for attn in layers]
    specs = tuple(attn.step_spec() for attn in layers)
    # The pure step takes device lengths and no layer index (its program is the same for any).
    jitted_caches = [c.replace(layer_idx=-1, length=jnp.asarray(c.length)) for c in caches]
    h_jit, times, jitted = token + 0, [], []  # a copy: the step donates what it is fed
    for _ in range(steps):
        (h_jit, jitted_caches), dt = _timed(stack_decode_step, weights, jitted_caches, h_jit, specs=specs)
        jitted.append(np.asarray(h_jit))
        times.append(dt)
    jitted, eager = np.concatenate(jitted, 1), np.concatenate(eager, 1)
    err = np.linalg.norm(jitted - eager) / np.linalg.norm(eager)
    later = f", median {1e3 * float(np.median(times[1:])):.2f} ms/step after" if steps > 1 else ""
    print(f"  {steps} decode steps: first {1e3 * times[0]:.1f} ms (compiles){later}; "
          f"lengths {np.asarray(jitted_caches[0].length).tolist()}")
    print(f"  one jitted step vs the module calls: rel err {err:.1e}")


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
    # device when it is built, else the host callback (dsv4_jax.native_info() says why); the
    # notebooks and the docs say it in the words of dsv4_jax.step.plan.BREAK_SUMMARY.
    print(where_break_runs("narrow", "auto", native.platform_name(jax.devices()[0].platform)))
    x = np.random.default_rng(0).normal(size=(args.batch, args.prompt + args.steps, cfg.hidden_size))
    for layer_idx in range(cfg.num_layers):
        run_layer(cfg, layer_idx, x.astype(np.float32), args.prompt, args.steps, modes)
    run_stack(cfg, x.astype(np.float32), args.prompt, args.steps)


if __name__ == "__main__":
    main()
