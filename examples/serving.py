"""A server's cache on a stack of layers: pages, a shared system prompt, speculative steps.

    python examples/serving.py            # the tiny config on a CPU, seconds; prints what happens

Three requests on a stack of the three layer types (sliding, CSA, HCA) with one paged cache a
layer (`init_cache(..., page_size=, num_pages=, max_rewind=)`; docs/use.md, "Paged caches"):

1. **A shared system prompt.** Row 0 holds the system prompt; `fork_rows` starts request B in
   row 1 from it (the prompt's full pages shared, not copied); both rows then take their own
   user turns in one ragged call. Request B's outputs equal those of B computed from scratch
   on a contiguous cache (its prompt, then its turn), bit for bit.
2. **Speculative steps.** Each step verifies 4 drafts a row in one call, keeps a number of them
   (here: drawn at random) and takes the rest back with `rewind_rows`; the rows then hold
   exactly the cache of the accepted tokens only.
3. **Pages come back.** Request A finishes: `reset_rows` gives its pages back, and request C
   starts in row 0 on them.

`memory_report` is the reason for pages: at V4-Flash sizes, the rows of a ragged batch (1k to
1M tokens) that a paged cache holds in the bytes a contiguous cache needs for them.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dsv4_jax
from dsv4_jax.cache.contiguous import cache_nbytes

PAGE_SIZE, NUM_PAGES, MAX_REWIND, DRAFTS = 16, 24, 4, 4


def stack(cfg, seed: int = 0) -> list:
    """One layer of each type: sliding, CSA, HCA (the tiny config's layers 0-2)."""
    return [dsv4_jax.DeepseekV4Attention(cfg, i, rngs=nnx.Rngs(seed + i)) for i in range(3)]


def run(layers, caches, x, positions):
    """The stack's layers in order on hidden states `x` [B, S, hidden] (residual adds)."""
    out = []
    for i, layer in enumerate(layers):
        y, caches[i] = layer(x, positions, caches[i])
        x = x + y
        out.append(y)
    return x, caches


def new_caches(layers, batch: int, max_seq_len: int, paged: bool = True) -> list:
    paging = dict(page_size=PAGE_SIZE, num_pages=NUM_PAGES) if paged else {}
    return [layer.init_cache(batch, max_seq_len, max_rewind=MAX_REWIND, **paging) for layer in layers]


def serve(cfg=None, seed: int = 0, log=print) -> dict:
    """The three requests (see the module docstring); returns what a test checks."""
    cfg = cfg or dsv4_jax.DeepseekV4Config.tiny()
    layers = stack(cfg, seed)
    rng = np.random.default_rng(seed)
    tokens = lambda n: rng.normal(size=(n, cfg.hidden_size)).astype(np.float32)  # noqa: E731
    system, user_a, user_b, user_c = tokens(37), tokens(6), tokens(9), tokens(5)

    # 1. The system prompt in row 0; request B forks it into row 1; both users' turns in one call.
    caches = new_caches(layers, 2, 128)
    _, caches = run(layers, caches, jnp.asarray(np.stack([system, np.zeros_like(system)])),
                    np.stack([np.arange(37), np.full(37, -1)]).astype(np.int32))
    caches = dsv4_jax.fork_rows(caches, 0, 1)  # the stack in one call
    pages = caches[1].pages
    shared = int((pages.refs > 1).sum())
    log(f"fork: row 1 starts from row 0's {int(caches[1].length[0])} tokens, {shared} pages shared, "
        f"{pages.free} of {pages.num_pages} free")
    turn = np.zeros((2, 9, cfg.hidden_size), np.float32)
    turn[0, :6], turn[1] = user_a, user_b
    positions = np.stack([np.where(np.arange(9) < 6, 37 + np.arange(9), -1), 37 + np.arange(9)]).astype(np.int32)
    h, caches = run(layers, caches, jnp.asarray(turn), positions)
    b_shared = np.asarray(h[1])
    # Request B from scratch on a contiguous cache: the system prompt into its row, then its turn.
    alone = new_caches(layers, 2, 128, paged=False)
    _, alone = run(layers, alone, jnp.asarray(np.stack([np.zeros_like(system), system])),
                   np.stack([np.full(37, -1), np.arange(37)]).astype(np.int32))
    h_alone, _ = run(layers, alone, jnp.asarray(np.stack([np.zeros_like(user_b), user_b])),
                     np.stack([np.full(9, -1), 37 + np.arange(9)]).astype(np.int32))
    b_alone = np.asarray(h_alone[1])
    log(f"request B after the shared prompt equals B alone: {np.array_equal(b_shared, b_alone)}")

    # 2. Speculative steps: 4 drafts a row verified in one call, the rejected ones taken back.
    accepted_total = np.zeros(2, np.int64)
    for step in range(3):
        drafts = rng.normal(size=(2, DRAFTS, cfg.hidden_size)).astype(np.float32)
        _, caches = run(layers, caches, jnp.asarray(drafts), None)
        accept = rng.integers(0, DRAFTS + 1, size=2)
        caches = dsv4_jax.rewind_rows(caches, [0, 1], DRAFTS - accept)  # every layer in one call
        accepted_total += accept
        log(f"step {step}: accepted {accept.tolist()} of {DRAFTS} drafts, lengths {caches[1].length.tolist()}")

    # 3. Request A is done: its pages go back; request C starts in row 0 on them.
    free_before = caches[1].pages.free
    caches = dsv4_jax.reset_rows(caches, [0])
    freed = caches[1].pages.free - free_before
    c_turn = np.zeros((2, 5, cfg.hidden_size), np.float32)
    c_turn[0] = user_c
    _, caches = run(layers, caches, jnp.asarray(c_turn),
                    np.stack([np.arange(5), np.full(5, -1)]).astype(np.int32))
    log(f"request A done: {freed} pages back to the pool; request C in row 0 holds "
        f"{int((caches[1].pages.table[0] >= 0).sum())} page(s), {caches[1].pages.free} free")
    return dict(b_shared=b_shared, b_alone=b_alone, shared_pages=shared, freed=freed, caches=caches,
                accepted=accepted_total, layers=layers)


def memory_report(lengths=(1024, 4096, 16384, 65536, 262144, 1048576), page_size: int = 256) -> dict:
    """Bytes of a V4-Flash CSA and HCA layer's cache for a ragged batch of rows of `lengths`
    tokens: contiguous (every row at the longest) against paged (each row's pages; the pool
    exactly as large as they need). No array is made (`jax.eval_shape`). `rows_ratio`: how many
    times the rows a contiguous cache of the same bytes holds the paged one holds."""
    cfg = dsv4_jax.DeepseekV4Config.flash()
    batch, longest = len(lengths), max(lengths)
    report = {}
    for name, layer_idx in (("csa", 2), ("hca", 3)):
        attn = nnx.eval_shape(lambda i=layer_idx: dsv4_jax.DeepseekV4Attention(cfg, i, rngs=nnx.Rngs(0),
                                                                                param_dtype=jnp.bfloat16))
        pages = sum(math.ceil(n / page_size) for n in lengths)
        contiguous = cache_nbytes(jax.eval_shape(lambda a=attn: a.init_cache(batch, longest,
                                                                             allow_long_context=True)))
        paged = cache_nbytes(jax.eval_shape(lambda a=attn, n=pages: a.init_cache(
            batch, longest, allow_long_context=True, page_size=page_size, num_pages=n)))
        report[name] = dict(contiguous_bytes=contiguous, paged_bytes=paged, rows_ratio=contiguous / paged,
                            tokens_per_gb_paged=sum(lengths) / (paged / 2**30),
                            tokens_per_gb_contiguous=sum(lengths) / (contiguous / 2**30))
    return report


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args(argv)
    serve()
    for name, r in memory_report().items():
        print(f"V4-Flash {name.upper()} layer, rows of 1k to 1M tokens: contiguous {r['contiguous_bytes'] / 2**30:.2f} "
              f"GiB, paged {r['paged_bytes'] / 2**30:.2f} GiB: {r['rows_ratio']:.1f}x the rows in the same bytes")


if __name__ == "__main__":
    main()
