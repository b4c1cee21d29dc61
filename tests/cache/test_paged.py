"""Paged caches (`dsv4_jax.cache.paged`): the context-long rows in pages of a pool.

The contract: a paged cache gives the contiguous cache's outputs and picks bit for bit (prefill
chunks, decode steps, several tokens a step, ragged rows, reset rows, every break mode, bf16 and
FP8 rows, the layer's calls and the user's own jit, pages scattered over the pool, the XLA path and
the attention's kernel, which reads the pool in place, and their gradients); a row holds only the pages its tokens need,
takes them as it grows and gives them back on `reset_rows`; nothing takes pages under a jit (a
step past a row's pages leaves it unchanged, NaN); a pool too small, a page table pointing
outside the pool or a page held twice without a fork is refused, the cache unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsv4_jax
from dsv4_jax import DeepseekV4Config, KernelPlan
from dsv4_jax.cache import paged
from dsv4_jax.cache.contiguous import reset_rows
from dsv4_jax.cache.quantized import read

CFG = DeepseekV4Config.tiny()  # compress ratios 4 (CSA) and 8 (HCA): pages of 16 tokens hold 4 and 2 entries
MAX_SEQ, PAGE = 64, 16
SCHEDULE = (13, 13, 13, 1, 1, 1, 3)  # prefill chunks mid-window, decode steps, a 3-token verification step
LAYERS = pytest.mark.parametrize("layer", [1, 2], ids=["csa", "hca"])


def _calls(attn, cache, x, schedule=SCHEDULE, ragged: bool = False, picks: bool = True):
    """The layer's calls over `x` in chunks of `schedule`: [(output, picks, cache)] after each.
    `ragged`: row 1 pads the last 2 slots of every chunk longer than 2 (position -1). `picks`:
    the calls return their intermediates (the picks; the attention then takes the XLA path,
    which the masses need), else picks None."""
    runs, start = [], np.asarray(cache.length).astype(np.int64)  # each row continues its cache
    for n in schedule:
        pos = (start[:, None] + np.arange(n)).astype(np.int32)
        if ragged and n > 2:
            pos[1, -2:] = -1
        chunk = np.stack([x[b, start[b]:start[b] + n] for b in range(x.shape[0])])
        if picks:
            out, cache, inter = attn(jnp.asarray(chunk), jnp.asarray(pos), cache, return_intermediates=True)
        else:
            (out, cache), inter = attn(jnp.asarray(chunk), jnp.asarray(pos), cache), None
        runs.append((np.asarray(out), None if inter is None or inter.topk is None else np.asarray(inter.topk), cache))
        start += (pos >= 0).sum(axis=1)
    return runs


def _inputs(batch: int = 2, tokens: int = 48, seed: int = 4):
    return np.random.default_rng(seed).normal(size=(batch, tokens, CFG.hidden_size)).astype(np.float32)


def _assert_same_cache(paged_cache, contiguous, what: str, exact: bool = True):
    """Every row of the paged cache reads as the contiguous one: entries through the pages,
    the per-row fields as they are (`exact`: bit for bit, else to float32 rounding)."""
    def same(got, want, where):
        got, want = np.asarray(got), np.asarray(want)
        if exact:
            np.testing.assert_array_equal(got, want, err_msg=f"{what} {where}")
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{what} {where}")

    bound = paged.bind(paged_cache)
    for part in ("compressor", "indexer"):
        if getattr(contiguous, part) is not None:
            same(read(getattr(bound, part).entries), read(getattr(contiguous, part).entries), f"{part}.entries")
            same(getattr(bound, part).buffer, getattr(contiguous, part).buffer, f"{part}.buffer")
    same(read(paged_cache.window), read(contiguous.window), "window")
    np.testing.assert_array_equal(np.asarray(paged_cache.length), np.asarray(contiguous.length))


def _assert_same_runs(got, want, what: str, exact: bool = True):
    for i, ((out_g, picks_g, cache_g), (out_w, picks_w, cache_w)) in enumerate(zip(got, want)):
        if exact:
            np.testing.assert_array_equal(out_g, out_w, err_msg=f"{what} call {i}")
        else:
            np.testing.assert_allclose(out_g, out_w, rtol=1e-6, atol=1e-6, err_msg=f"{what} call {i}")
        if picks_w is not None:
            np.testing.assert_array_equal(picks_g, picks_w, err_msg=f"{what} call {i} picks")
        _assert_same_cache(cache_g, cache_w, f"{what} call {i}", exact)


# ---------------------------------------------------------------------------- paged = contiguous
@LAYERS
def test_a_paged_cache_gives_the_contiguous_caches_outputs_and_picks_bit_for_bit(layer):
    attn = helpers.random_layer(CFG, layer, seed=3)
    x = _inputs()
    want = _calls(attn, attn.init_cache(2, MAX_SEQ), x)
    got = _calls(attn, attn.init_cache(2, MAX_SEQ, page_size=PAGE, num_pages=9), x)
    _assert_same_runs(got, want, "paged")
    pages = got[-1][2].pages  # 45 tokens a row: 3 pages of 16 each, taken as the rows grew
    assert (pages.table[:, :3] >= 0).all() and (pages.table[:, 3:] == -1).all()
    assert pages.free == 9 - 6 and sorted(pages.table[:, :3].ravel().tolist()) == list(range(6))


def test_a_paged_cache_agrees_in_every_break_mode_and_for_ragged_rows():
    """The pages are read and written by XLA in every mode but the wide break, which runs them on
    NumPy copies; the XLA and host selections read the keys gathered from the pages, the native
    handler reads them in the pages. A covering set: XLA's selection ("none") and the NumPy pages
    ("wide"; "narrow-host" selects on the same XLA view); the native handler's targets, eager and
    graph, over paged keys are the next test's and tests/ops/test_indexer_kernel.py's: the same
    picks, the same values (float32 rounding for the host's twin)."""
    x = _inputs()
    schedule = (30, 3)
    base = helpers.random_layer(CFG, 1, seed=3, **helpers.EXECUTIONS["none"])
    want = _calls(base, base.init_cache(2, MAX_SEQ), x, schedule, ragged=True)
    for mode in ("none", "wide"):
        if not helpers.runnable(mode):
            continue
        attn = helpers.random_layer(CFG, 1, seed=3, **helpers.EXECUTIONS[mode])
        got = _calls(attn, attn.init_cache(2, MAX_SEQ, page_size=PAGE), x, schedule, ragged=True)
        _assert_same_runs(got, want, mode, exact=mode.startswith("none"))
    # Row 1 pads the last 2 slots of each call: 4 tokens fewer, one page fewer.
    assert got[-1][2].pages.capacity().tolist() == [48, 32] and got[-1][2].length.tolist() == [33, 29]


def _taken_out_of_order(cache):
    """`cache` with row 1 taking its first pages before row 0 takes any, then both growing: row 0
    holds pool pages [2, 3, 4], row 1 [0, 1, 5] (a row's pages out of order in the pool)."""
    cache = dsv4_jax.reserve_pages(cache, np.array([0, 32]))
    cache = dsv4_jax.reserve_pages(cache, np.array([48, 48]))
    assert np.asarray(cache.pages.table)[:, :3].tolist() == [[2, 3, 4], [0, 1, 5]]
    return cache


NATIVE_SELECT = dataclasses.replace(KernelPlan.named("xla"), select="native", select_scores="native")
KERNEL_SCORES = dataclasses.replace(NATIVE_SELECT, select_scores="interpret")


@pytest.mark.parametrize("mode, kernels, cache_dtype", [
    ("none", NATIVE_SELECT, "auto"),            # the handler's graph target over bf16 keys
    ("narrow-device", NATIVE_SELECT, "fp8"),    # its eager break over the FP4 keys' stored form
    ("none", KERNEL_SCORES, "fp8")],            # the Pallas scoring kernel (interpret mode) over the
    ids=["native-graph", "native-eager-fp8", "kernel-scores-fp8"])  # FP8 cache's pool, dequantized
def test_the_selections_read_the_pages_and_pick_as_the_contiguous_cache(mode, kernels, cache_dtype):
    """The native selection and the Pallas scoring kernel read the indexer's keys in their pages
    through the table (no gathered copy): a paged cache whose rows' pages lie out of order in the
    pool gives the contiguous cache's picks and outputs bit for bit with the same plan, over a
    prefill chunk crossing pages and a decode step, row 1 ragged. A covering set: every form and
    target at the op level is tests/ops/test_indexer_kernel.py's (the kernel over the FP4 keys'
    stored form needs Di a multiple of 32, tiny's is 16)."""
    if not helpers.runnable("narrow-device"):
        pytest.skip("the native handlers are not built")
    fp8 = dict(numerics="official") if cache_dtype == "fp8" else {}
    attn = helpers.random_layer(CFG, 1, seed=3, break_mode=mode.split("-")[0],
                                break_on="device" if mode == "narrow-device" else "auto", kernels=kernels, **fp8)
    x = _inputs()
    schedule = (30, 1)
    want = _calls(attn, attn.init_cache(2, MAX_SEQ, kv_cache_dtype=cache_dtype), x, schedule, ragged=True)
    cache = _taken_out_of_order(attn.init_cache(2, MAX_SEQ, kv_cache_dtype=cache_dtype, page_size=PAGE, num_pages=8))
    got = _calls(attn, cache, x, schedule, ragged=True)
    _assert_same_runs(got, want, f"{mode} {cache_dtype}")


def test_a_paged_steps_native_selection_gathers_no_keys():
    """The jaxpr of a CSA step on a paged cache with the native selection holds no gather of the
    indexer's keys [B, T, Di] (the handler gets the pool and the table); the XLA selection's
    step, which reads `PagedRows.view`, holds one (the check's control)."""
    if not helpers.runnable("none-native"):
        pytest.skip("the native handlers are not built")
    gathered = re.compile(rf"\[2,{MAX_SEQ // 4},{CFG.index_head_dim}\] = gather")
    x, pos = jnp.asarray(_inputs()[:, :13]), jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (2, 13))
    jaxprs = {}
    for name, kernels in (("native", NATIVE_SELECT), ("xla", "xla")):
        attn = helpers.random_layer(CFG, 1, seed=3, break_mode="none", kernels=kernels)
        cache = dsv4_jax.reserve_pages(attn.init_cache(2, MAX_SEQ, page_size=PAGE), 13)
        jaxprs[name] = str(jax.make_jaxpr(functools.partial(dsv4_jax.attention_step, spec=attn.step_spec()))(
            attn.weights(), cache, x, pos))
    assert "dsv4_select_topk_paged_graph" in jaxprs["native"]
    assert not gathered.search(jaxprs["native"])
    assert gathered.search(jaxprs["xla"])


def _scattered(cache, table=((7, 2, 10, 4), (1, 11, 5, 8))):
    """`cache` (rows empty, a pool of 12 pages) with its rows holding the pages of `table`,
    scattered over the pool, neither in order nor next to each other."""
    table = np.asarray(table, np.int32)
    refs = np.zeros(cache.pages.num_pages, np.int32)
    refs[table[table >= 0]] = 1
    return cache.replace(pages=cache.pages.replace(table=table, refs=refs))


# The attention's kernel in interpret mode (the other stages XLA's): it reads the paged entries
# in place, by their pool rows (`pallas.paged_source`), and tiny sizes make every call of a
# forced kernel: prefill 13, decode, a 3-token step.
ATTENTION_KERNEL = dsv4_jax.KernelPlan(decode_attention="interpret", prefill_attention="interpret",
                                       split_merge="interpret", decode_blocks=(4, 2, 4, 1))


@pytest.mark.parametrize("layer, kv, kernels", [
    (1, "auto", ATTENTION_KERNEL), (1, "fp8", ATTENTION_KERNEL), (2, "fp8", ATTENTION_KERNEL), (2, "fp8", "xla"),
], ids=["csa-kernel", "csa-fp8-kernel", "hca-fp8-kernel", "hca-fp8-xla"])
def test_scattered_pages_give_the_contiguous_caches_outputs_through_the_kernel_and_xla(layer, kv, kernels,
                                                                                       monkeypatch):
    """Pages scattered over the pool: the same outputs and caches bit for bit as the contiguous
    cache, with the attention's kernel reading the pool by index (the calls return no
    intermediates: with them the attention takes the XLA path; the XLA cases compare the picks
    too). A covering set: CSA's two row formats and HCA's FP8 rows through the kernel, HCA's FP8
    rows through the XLA path (CSA's FP8 rows through it, with their picks: the selections' test
    above; bf16 rows: the first test; the op's test has both layers' entries through both paths,
    and their gradients: tests/ops/test_sparse_attention_kernel.py)."""
    from dsv4_jax.ops.sparse_attention import pallas as sak

    read = []  # what the kernel reads the entries from, a call traced
    real = sak.sparse_attention_kernel
    monkeypatch.setattr(sak, "sparse_attention_kernel",
                        lambda *a, **k: read.append(type(k["entries"]).__name__) or real(*a, **k))
    numerics = dict(numerics="official") if kv == "fp8" else {}
    attn = helpers.random_layer(CFG, layer, seed=3, break_mode="none", kernels=kernels, **numerics)
    x = _inputs()
    schedule, picks = (13, 1, 3), kernels == "xla"
    want = _calls(attn, attn.init_cache(2, MAX_SEQ, kv_cache_dtype=kv), x, schedule, picks=picks)
    got = _calls(attn, _scattered(attn.init_cache(2, MAX_SEQ, kv_cache_dtype=kv, page_size=PAGE, num_pages=12)),
                 x, schedule, picks=picks)
    _assert_same_runs(got, want, f"scattered pages, {kernels}")
    assert got[-1][2].pages.table.tolist() == [[7, 2, 10, 4], [1, 11, 5, 8]]
    if kv == "fp8":  # the pool holds the FP8 records themselves
        assert isinstance(got[-1][2].compressor.entries, dsv4_jax.cache.quantized.QuantizedRows)
    if kernels != "xla":  # the contiguous calls' then the paged calls' (CSA's FP8 picks: gathered, dequantized)
        paged_reads = ["DynamicJaxprTracer"] * 2 if (layer, kv) == (1, "fp8") else ["PagedRows"] * 2
        assert read == ["DynamicJaxprTracer"] * 3 + ["PagedRows"] + paged_reads, read


def test_the_kernel_reads_paged_entries_by_pool_row():
    """`paged_source`: the pool flattened, each entry slot at its pool row ``page * E + t % E``,
    -1 kept, a slot on a page the row does not hold read as no key."""
    from dsv4_jax.ops.sparse_attention.pallas import paged_source

    pool = jnp.arange(12 * 4 * 2, dtype=jnp.float32).reshape(12, 4, 2)  # 12 pages of 4 entries
    rows = paged.PagedRows(pool=pool, table=jnp.asarray([[7, 2, -1, -1], [1, 11, 5, 8]], jnp.int32), slots=16)
    idx = jnp.asarray([[0, 5, -1, 9], [3, 4, 15, -1]], jnp.int32)  # [R = B, K]; row 0's slot 9 is on no page
    flat, at = paged_source(rows, idx, 2)
    assert flat.shape == (1, 48, 2)
    assert at.tolist() == [[28, 9, -1, -1], [7, 44, 35, -1]]
    np.testing.assert_array_equal(flat[0, at[1, :3]], np.asarray(rows.view())[1, [3, 4, 15]])


def test_a_sliding_layers_cache_has_nothing_to_page():
    attn = helpers.random_layer(CFG, 0, seed=3)
    cache = attn.init_cache(2, MAX_SEQ, page_size=PAGE, num_pages=4)
    assert cache.pages is None and cache.compressor is None
    assert dsv4_jax.reserve_pages(cache, 8) is cache


# ---------------------------------------------------------------------------- rows come and go
def test_reset_rows_give_pages_back_and_a_new_request_reuses_them():
    """Three requests in two rows: row 0's pages go back to the pool when it finishes and the
    third request runs on them; the outputs are the contiguous cache's, no page leaks."""
    attn = helpers.random_layer(CFG, 1, seed=3)
    x, y = _inputs(tokens=64), _inputs(tokens=64, seed=8)
    caches = {"contiguous": attn.init_cache(2, MAX_SEQ), "paged": attn.init_cache(2, MAX_SEQ, page_size=PAGE,
                                                                                   num_pages=7)}
    outs = {}
    for kind, cache in caches.items():
        first = _calls(attn, cache, x, schedule=(40, 1))
        cache = reset_rows(first[-1][2], [0])
        if kind == "paged":
            assert cache.pages.table[0].tolist() == [-1] * 4 and cache.pages.free == 7 - 3
        second = _calls(attn, cache, np.stack([y[0], x[1]]), schedule=(20, 1))  # row 1 goes on at 41
        outs[kind] = first + second
    _assert_same_runs(outs["paged"], outs["contiguous"], "reuse")
    final = outs["paged"][-1][2]
    paged.check_pages(final.pages)
    assert reset_rows(final, [0, 1]).pages.free == 7  # every page back


def test_under_a_users_jit_nothing_takes_pages_and_a_row_past_its_pages_is_frozen():
    attn = helpers.random_layer(CFG, 2, seed=3)
    x = jnp.asarray(_inputs(tokens=40))

    @nnx.jit
    def step(layer, cache, hidden):
        return layer(hidden, None, cache)

    contiguous = attn.init_cache(2, MAX_SEQ)
    cache = attn.init_cache(2, MAX_SEQ, page_size=PAGE)
    cache = dsv4_jax.reserve_pages(cache, np.array([32, 16]))  # row 1 has room for 16 tokens only
    assert cache.pages.capacity().tolist() == [32, 16]
    want, contiguous = step(attn, contiguous, x[:, :24])
    got, cache = step(attn, cache, x[:, :24])
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert np.isnan(np.asarray(got[1])).all() and np.asarray(cache.length).tolist() == [24, 0]
    # Row 1 unchanged: reset it, reserve again, and the call runs.
    cache = dsv4_jax.reserve_pages(reset_rows(cache, [1]), 24)
    got, cache = step(attn, cache, x[:, :24])
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_a_stacks_caches_keep_one_page_table():
    layers = [helpers.random_layer(CFG, i, seed=3) for i in range(3)]
    stack = [attn.init_cache(2, MAX_SEQ, page_size=PAGE, num_pages=6) for attn in layers]
    stack = dsv4_jax.reserve_pages(stack, np.array([20, 5]))
    assert stack[0].pages is None and stack[1].pages is stack[2].pages
    assert stack[1].pages.capacity().tolist() == [32, 16]
    apart = [stack[0], stack[1], dsv4_jax.reserve_pages(stack[2], 40)]
    with pytest.raises(ValueError, match="caches: expected the paged caches of one stack to hold one page table"):
        dsv4_jax.reserve_pages(apart, 1)


# ---------------------------------------------------------------------------- refusals
def test_a_pool_too_small_names_the_pages_needed_and_free_and_changes_nothing():
    attn = helpers.random_layer(CFG, 1, seed=3)
    x = _inputs()
    cache = attn.init_cache(2, MAX_SEQ, page_size=PAGE, num_pages=3)
    first = _calls(attn, cache, x, schedule=(13,))[-1][2]  # one page each: 1 free
    with pytest.raises(ValueError, match=r"pages: expected a pool with 2 free pages of 16 tokens .* got 1 free of 3"):
        attn(jnp.asarray(x[:, 13:26]), None, first)
    assert first.pages.free == 1 and np.asarray(first.length).tolist() == [13, 13]
    out, _ = attn(jnp.asarray(x[:, 13:16]), None, first)  # 3 more tokens fit the pages held
    want = _calls(attn, attn.init_cache(2, MAX_SEQ), x, schedule=(13, 3))[-1][0]
    np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.parametrize("crafted, match", [
    (lambda t, r: (np.where(t == 0, 99, t), r), r"cache.pages.table: expected pool pages in \[0, 9\) or -1"),
    (lambda t, r: (np.where(t == 2, 0, t), r), r"cache.pages.refs: expected each page's count"),
    (lambda t, r: (t[:, ::-1].copy(), r), "expected each row's pages first"),
], ids=["outside-the-pool", "held-twice", "hole"])
def test_a_crafted_page_table_is_refused(crafted, match):
    attn = helpers.random_layer(CFG, 1, seed=3)
    x = _inputs()
    cache = _calls(attn, attn.init_cache(2, MAX_SEQ, page_size=PAGE, num_pages=9), x, schedule=(20,))[-1][2]
    table, refs = crafted(np.asarray(cache.pages.table), np.asarray(cache.pages.refs))
    bad = cache.replace(pages=cache.pages.replace(table=table, refs=refs))
    with pytest.raises(ValueError, match=match):
        attn(jnp.asarray(x[:, 20:21]), None, bad)


def test_bad_paging_arguments_are_refused():
    attn = helpers.random_layer(CFG, 1, seed=3)
    with pytest.raises(ValueError, match=r"page_size: expected a multiple of the layer's compress ratios \[4, 8\]"):
        attn.init_cache(2, MAX_SEQ, page_size=12)
    with pytest.raises(ValueError, match="num_pages: a pool of pages needs page_size too"):
        attn.init_cache(2, MAX_SEQ, num_pages=4)
    with pytest.raises(ValueError, match="page_size: expected a positive int"):
        attn.init_cache(2, MAX_SEQ, page_size=0)
    cache = attn.init_cache(2, MAX_SEQ, page_size=PAGE)
    with pytest.raises(ValueError, match="new_tokens: expected a non-negative int"):
        dsv4_jax.reserve_pages(cache, -1)
    with pytest.raises(TypeError, match="pages are taken eagerly"):
        jax.jit(lambda c: dsv4_jax.reserve_pages(c, 4))(cache)


# ---------------------------------------------------------------------------- shared prefixes, rewind
@LAYERS
def test_a_forked_paged_row_shares_its_prefix_and_rewinds_like_the_contiguous_cache(layer):
    """A prompt in row 0 forked into row 1 (a shared system prompt), speculative steps of 3
    drafts in both rows with different rewinds: the contiguous cache's outputs and rows, bit
    for bit (on it a fork copies and a rewind is the never-written cache:
    tests/cache/test_rewind_fork.py); the prefix's full pages shared, none leaked."""
    attn = helpers.random_layer(CFG, layer, seed=3)
    x = _inputs(tokens=64)
    outs = {}
    for kind, paging in (("contiguous", {}), ("paged", dict(page_size=PAGE, num_pages=8))):
        cache = attn.init_cache(2, MAX_SEQ, max_rewind=4, **paging)
        prompt = np.where(np.arange(40)[None] < np.array([[40], [0]]), np.arange(40), -1).astype(np.int32)
        out, cache = attn(jnp.asarray(x[:, :40]), jnp.asarray(prompt), cache)  # row 1 waits
        cache = dsv4_jax.fork_rows(cache, 0, 1)
        if kind == "paged":  # 40 tokens, 4 kept for rewind: pages 0-1 shared, page 2 copied
            table, refs = cache.pages.table, cache.pages.refs
            assert table[1, :2].tolist() == table[0, :2].tolist() and table[1, 2] != table[0, 2]
            assert refs[table[0, :2]].tolist() == [2, 2] and cache.pages.free == 8 - 4
        runs = []
        for step, back in enumerate(([2, 0], [1, 3], [0, 0])):
            drafts = np.stack([x[0, 40 + 3 * step:43 + 3 * step], x[1, 50 + 3 * step:53 + 3 * step]])
            out, cache = attn(jnp.asarray(drafts), None, cache)
            runs.append(np.asarray(out))
            cache = dsv4_jax.rewind_rows(cache, [0, 1], np.array(back))
            runs.append(cache)
        outs[kind] = runs
    for i, (got, want) in enumerate(zip(outs["paged"], outs["contiguous"])):
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want, err_msg=f"step {i // 2}")
        else:
            _assert_same_cache(got, want, f"after rewind {i // 2}")
    final = outs["paged"][-1]
    paged.check_pages(final.pages)
    assert reset_rows(final, [0, 1]).pages.free == 8


def test_forking_into_a_short_pool_is_refused_and_changes_nothing():
    attn = helpers.random_layer(CFG, 1, seed=3)
    cache = attn.init_cache(3, MAX_SEQ, page_size=PAGE, num_pages=4)
    x = _inputs(batch=3, tokens=40)
    rows = np.where(np.arange(40)[None] < np.array([[40], [0], [0]]), np.arange(40), -1).astype(np.int32)
    _, cache = attn(jnp.asarray(x), jnp.asarray(rows), cache)  # row 0: 3 pages, 1 free
    forked = dsv4_jax.fork_rows(cache, 0, 1)  # 2 full pages shared, the partial one copied: 0 free
    with pytest.raises(ValueError, match=r"pages: expected a pool with 1 free pages of 16 tokens to fork row 0 "
                                         r"into row 2 \(2 of its 3 pages shared\), got 0 free of 4"):
        dsv4_jax.fork_rows(forked, 0, 2)
    assert forked.pages.free == 0 and np.asarray(forked.length).tolist() == [40, 40, 0]
    with pytest.raises(TypeError, match="forking a paged cache takes pages"):
        jax.jit(lambda c: dsv4_jax.fork_rows(c, 0, 2))(cache)


def _device_copy(cache):
    """`cache` with its own device buffers (host mirrors kept): something to donate."""
    return jax.tree.map(lambda a: jnp.copy(a) if isinstance(a, jax.Array) else a, cache)


def _pools(cache):
    return [cache.compressor.entries, cache.indexer.entries]


def test_donating_writes_the_pools_in_place_and_a_refusal_keeps_the_cache():
    """`fork_rows(..., donate=True)`, `reserve_pages(..., donate=True)` and the call of a layer
    made with ``donate_cache=True`` write the pages they copy or take into the pools in place:
    the pools passed in are consumed (no copy of each pool beside them), the results are the
    copying writes' bit for bit; a refused fork (a short pool) consumes nothing."""
    x = _inputs(batch=3, tokens=56)
    attn = helpers.random_layer(CFG, 1, seed=3)
    rows = np.where(np.arange(40)[None] < np.array([[40], [0], [0]]), np.arange(40), -1).astype(np.int32)
    _, cache = attn(jnp.asarray(x[:, :40]), jnp.asarray(rows), attn.init_cache(3, MAX_SEQ, page_size=PAGE,
                                                                                num_pages=4))
    donor = _device_copy(cache)
    want = dsv4_jax.fork_rows(cache, 0, 1)  # 2 pages shared, the partial one copied: 0 free
    got = dsv4_jax.fork_rows(donor, 0, 1, donate=True)
    assert all(pool.is_deleted() for pool in _pools(donor)) and not any(p.is_deleted() for p in _pools(cache))
    helpers.assert_trees_close(got, want, "donated fork", rtol=0, atol=0)
    for use in (lambda c: dsv4_jax.reserve_pages(c, 1), lambda c: dsv4_jax.fork_rows(c, 0, 2),
                lambda c: attn(jnp.asarray(x[:, 40:41]), None, c)):  # the consumed cache, named
        with pytest.raises(ValueError, match=r"expected a live cache, got one whose .* donated to an earlier call"):
            use(donor)
    with pytest.raises(ValueError, match="pages: expected a pool with 1 free pages"):
        dsv4_jax.fork_rows(got, 0, 2, donate=True)
    assert not any(pool.is_deleted() for pool in _pools(got))

    # Two rows of 40 tokens (3 pages each), then 9 more: each row takes its fourth page.
    _, first = attn(jnp.asarray(x[:2, :40]), None, attn.init_cache(2, MAX_SEQ, page_size=PAGE, num_pages=8))
    donor = _device_copy(first)
    reserved = dsv4_jax.reserve_pages(donor, 9, donate=True)
    assert all(pool.is_deleted() for pool in _pools(donor)) and reserved.pages.free == 0
    helpers.assert_trees_close(reserved, dsv4_jax.reserve_pages(first, 9), "donated reserve", rtol=0, atol=0)
    step = jnp.asarray(x[:2, 40:49])
    want_out, want_cache = attn(step, None, _device_copy(first))
    got_out, got_cache = helpers.random_layer(CFG, 1, seed=3, donate_cache=True)(step, None, first)
    assert all(pool.is_deleted() for pool in _pools(first))
    np.testing.assert_array_equal(np.asarray(got_out), np.asarray(want_out))
    helpers.assert_trees_close(got_cache, want_cache, "the donating layer's cache", rtol=0, atol=0)


def test_gradients_through_a_paged_cache_equal_the_contiguous_caches():
    """jax.grad of a prefill chunk on a cache holding a prompt in scattered pages, w.r.t. the
    weights and the input: the same through the pages (their gathers and scatters) as through the
    contiguous rows. (Through the attention's kernel and its backward kernel:
    tests/ops/test_sparse_attention_kernel.py.)"""
    attn = helpers.random_layer(CFG, 1, seed=3, break_mode="none")
    tokens = 10
    x = _inputs(tokens=40)
    spec = attn.step_spec()
    grads = {}
    for kind, paging in (("contiguous", {}), ("paged", dict(page_size=PAGE, num_pages=12))):
        cache = attn.init_cache(2, MAX_SEQ, **paging)
        cache = _calls(attn, _scattered(cache) if paging else cache, x, schedule=(30,), picks=False)[-1][2]
        cache = cache.replace(length=jnp.asarray(cache.length))

        def loss(weights, hidden, cache=cache):
            out, _, _ = dsv4_jax.attention_step(weights, cache, hidden, None, spec)
            return jnp.sum(out * out)

        grads[kind] = jax.jit(jax.grad(loss, argnums=(0, 1)))(attn.weights(), jnp.asarray(x[:, 30:30 + tokens]))
    helpers.assert_trees_close(grads["paged"], grads["contiguous"], "gradients", rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------- a stack in one call
def _filled_stack(kv: str = "auto", paging: dict | None = None, prompt: int = 40, seed: int = 0) -> list:
    """A sliding, a CSA and an HCA layer's caches (3 rows, max_rewind 4; `paging`: paged) with
    row 0 holding `prompt` tokens of random rows (a fork copies whatever the rows hold: no step
    needed to fill them; FP8 rows random bytes), rows 1 and 2 empty."""
    numerics = dict(numerics="official") if kv == "fp8" else {}
    stack = [helpers.random_layer(CFG, i, seed=3, **numerics).init_cache(3, MAX_SEQ, kv_cache_dtype=kv, max_rewind=4,
                                                                          **(paging or {})) for i in range(3)]
    stack = dsv4_jax.reserve_pages(stack, np.array([prompt, 0, 0]))
    rng = np.random.default_rng(seed)

    def random(a):
        a = np.asarray(a)
        if a.dtype.itemsize == 1:  # FP8 codes: any byte but NaN's
            return jnp.asarray(rng.integers(0, 0x78, a.shape, np.uint8).view(a.dtype))
        return jnp.asarray(rng.normal(size=a.shape).astype(a.dtype))

    out = []
    for c in stack:
        pages, filled = c.pages, jax.tree.map(random, c.replace(pages=None, length=None, rewindable=None))
        out.append(filled.replace(pages=pages, length=np.array([prompt, 0, 0], np.int32),
                                  rewindable=np.array([4, 0, 0], np.int32)))
    return out


def _assert_bitwise(got, want, what: str):
    """The same pytree, every leaf (host mirrors and page tables included) the same bytes."""
    g_leaves, g_tree = jax.tree.flatten(got)
    w_leaves, w_tree = jax.tree.flatten(want)
    assert g_tree == w_tree, what
    for i, (g, w) in enumerate(zip(g_leaves, w_leaves)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (what, i)
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=f"{what}: leaf {i}")
        assert isinstance(jax.tree.leaves(got)[i], np.ndarray) == isinstance(jax.tree.leaves(want)[i], np.ndarray)


def _pool_leaves(cache) -> list:
    """Every array of a cache's pools (CSA: entries and indexer keys; HCA: entries)."""
    return jax.tree.leaves([part.entries for part in (cache.compressor, cache.indexer) if part is not None])


def _compiled():
    """The cache sizes of the programs a stack's fork and reserve run."""
    from dsv4_jax.cache import rows

    return (paged._stack_write(paged._copy_pages)._cache_size(), paged._stack_write(paged._zero_pages)._cache_size(),
            rows._fork._cache_size())


STACK_PAGING = dict(page_size=PAGE, num_pages=7)


@pytest.mark.parametrize("kv, paging", [("auto", STACK_PAGING), ("fp8", STACK_PAGING), ("auto", None)],
                         ids=["paged", "paged-fp8", "contiguous"])
def test_a_stack_forks_in_one_call_as_its_layers_one_by_one(kv, paging):
    """`fork_rows` of a stack's list (sliding, CSA, HCA) equals forking each layer's cache with
    the same rows, bit for bit (bf16-style and FP8 rows, paged and contiguous); `donate=True`
    consumes every pool of the list; the list's kind comes back; a second fork of the same
    shapes compiles nothing. The paged stack then decoded equals the per-layer-forked stack
    decoded (40 tokens, 4 kept for rewind: pages 0-1 shared, page 2 copied)."""
    stack = _filled_stack(kv, paging)
    want = [dsv4_jax.fork_rows(c, 0, 1) for c in stack]
    donor = [_device_copy(c) for c in stack]
    got = dsv4_jax.fork_rows(donor, 0, 1, donate=True)
    assert isinstance(got, list)
    _assert_bitwise(got, want, "a stack's fork")
    if paging:
        assert all(pool.is_deleted() for c in donor[1:] for pool in _pool_leaves(c))
        assert got[1].pages is got[2].pages and got[1].pages.free == 7 - 4
        assert np.asarray(got[1].pages.refs)[np.asarray(got[1].pages.table)[0, :2]].tolist() == [2, 2]
    again = tuple(_device_copy(c) for c in got)
    before = _compiled()
    twice = dsv4_jax.fork_rows(again, 0, 2, donate=True)  # the same shapes (one page copied): nothing compiles
    assert _compiled() == before and isinstance(twice, tuple)
    _assert_bitwise(list(twice), [dsv4_jax.fork_rows(c, 0, 2) for c in want], "a second fork")
    if kv == "auto" and paging:
        layers = [helpers.random_layer(CFG, i, seed=3) for i in range(3)]
        x = jnp.asarray(_inputs(batch=3, tokens=1, seed=9))
        for i, attn in enumerate(layers):
            out_got, got_i = attn(x, None, got[i])
            out_want, want_i = attn(x, None, want[i])
            np.testing.assert_array_equal(np.asarray(out_got), np.asarray(out_want), err_msg=f"layer {i}")
            _assert_bitwise(got_i, want_i, f"layer {i} decoded")


def test_a_refused_stack_fork_leaves_every_cache_usable():
    """A refused fork of a stack (`donate=True`) consumes nothing and changes nothing: a short
    pool, a `dst` holding tokens, tables that differ, caches at other lengths, a cache twice,
    caches of other batch sizes; the stack then forks."""
    stack = [_device_copy(c) for c in _filled_stack(paging=dict(page_size=PAGE, num_pages=4))]
    before = [jax.tree.map(np.array, c) for c in stack]  # copies: a NumPy view of a CPU buffer blocks its donation
    apart = dsv4_jax.reserve_pages(stack[2], np.array([0, 0, 1]))  # its table alone takes the free page
    late = stack[2].replace(length=np.array([41, 0, 0], np.int32))
    short = dsv4_jax.fork_rows(stack, 0, 1)  # 2 pages shared, 1 copied: 0 free
    for caches, src, dst, match in (
            (short, 0, 2, r"pages: expected a pool with 1 free pages of 16 tokens to fork row 0 into row 2"),
            (stack, 1, 0, r"dst: expected empty rows to fork into, got row\(s\) \[0\] holding \[40\] tokens"),
            ([stack[0], stack[1], apart], 0, 1, "caches: expected the paged caches of one stack to hold one page"),
            ([stack[0], stack[1], late], 0, 1, r"caches: expected the paged caches of one stack at the same lengths"),
            ([stack[1], stack[1]], 0, 1, "caches: expected each layer's cache once in the stack"),
            ([stack[1], helpers.random_layer(CFG, 1, seed=3).init_cache(2, MAX_SEQ)], 0, 1,
             r"caches: expected the caches of one stack to hold the same rows \(batch size 3\), got cache 1 of")):
        with pytest.raises(ValueError, match=match):
            dsv4_jax.fork_rows(caches, src, dst, donate=True)
        assert not any(a.is_deleted() for c in caches for a in jax.tree.leaves(c) if isinstance(a, jax.Array))
    for c, was in zip(stack, before):
        _assert_bitwise(jax.tree.map(np.asarray, c), was, "after the refusals")
    forked = dsv4_jax.fork_rows(stack, 0, 1, donate=True)
    assert forked[1].pages.free == 0 and np.asarray(forked[2].length).tolist() == [40, 40, 0]
    with pytest.raises(ValueError, match=r"caches: expected a live cache, got one whose .* donated"):
        dsv4_jax.fork_rows(stack, 0, 2)
    with pytest.raises(TypeError, match="caches: forking a paged cache takes pages"):
        jax.jit(lambda c: dsv4_jax.fork_rows(c, 0, 1))(short)


def test_a_contiguous_stack_forks_under_jit_as_eagerly():
    """Traced rows: the list form under `jax.jit` equals the eager one (the host mirrors come
    back as device values, as a single cache's do)."""
    stack = _filled_stack()
    eager = dsv4_jax.fork_rows(stack, [0], [2])
    jitted = jax.jit(lambda c, s, d: dsv4_jax.fork_rows(c, s, d))(stack, jnp.array([0]), jnp.array([2]))
    _assert_bitwise(jax.tree.map(np.asarray, jitted), jax.tree.map(np.asarray, eager), "jitted stack fork")


def test_a_stacks_reserve_zeroes_every_layers_pages_in_one_program():
    """`reserve_pages` of a stack equals each layer's own reserve, bit for bit; `donate=True`
    consumes every pool; a second reserve of the same shapes compiles nothing."""
    stack = _filled_stack(paging=STACK_PAGING)
    want = [dsv4_jax.reserve_pages(c, np.array([9, 16, 0])) for c in stack]  # a page each for rows 0 and 1
    donor = [_device_copy(c) for c in stack]
    got = dsv4_jax.reserve_pages(donor, np.array([9, 16, 0]), donate=True)
    _assert_bitwise(got, want, "a stack's reserve")
    assert all(pool.is_deleted() for c in donor[1:] for pool in _pool_leaves(c))
    before = _compiled()
    again = dsv4_jax.reserve_pages(got, np.array([0, 0, 32]), donate=True)  # 2 pages again: nothing compiles
    assert _compiled() == before and again[1].pages.free == 0


@pytest.mark.parametrize("paging", [STACK_PAGING, None], ids=["paged", "contiguous"])
def test_a_stack_rewinds_and_resets_in_one_call_as_its_layers_one_by_one(paging):
    """`rewind_rows` and `reset_rows` of a stack's list (or tuple: the same kind comes back)
    equal the same call on each layer's cache, bit for bit (host mirrors and page table
    included): every layer in one program, the stack's one table released once, and a second
    call of the same shapes compiles nothing. A refused call (a layer without history, more
    tokens than a row holds, tables that differ, a stack holding something else) changes no
    cache; a contiguous stack's calls under `jax.jit` equal the eager ones."""
    from dsv4_jax.cache import contiguous, rows

    forked = dsv4_jax.fork_rows(_filled_stack(paging=paging), 0, 1)  # rows 0 and 1 hold 40 tokens
    want = [dsv4_jax.rewind_rows(c, [0, 1], [3, 1]) for c in forked]
    got = dsv4_jax.rewind_rows(forked, [0, 1], [3, 1])
    assert isinstance(got, list)
    _assert_bitwise(got, want, "a stack's rewind")
    want = [dsv4_jax.reset_rows(c, [0]) for c in got]
    got = dsv4_jax.reset_rows(tuple(got), [0])
    assert isinstance(got, tuple)
    _assert_bitwise(list(got), want, "a stack's reset")
    if paging:  # row 0's pages given back: pages 0-1 are row 1's alone, row 0's copy of page 2 free
        assert got[1].pages is got[2].pages and got[1].pages.free == 7 - 3
    compiled = (contiguous._zero_stack._cache_size(), rows._rewind_stack._cache_size())
    again = dsv4_jax.reset_rows(dsv4_jax.rewind_rows(got, [1], 1), [1])
    assert (contiguous._zero_stack._cache_size(), rows._rewind_stack._cache_size()) == compiled
    assert np.asarray(again[1].length).tolist() == [0, 0, 0]
    if paging:
        assert again[1].pages.free == 7

    before = [jax.tree.map(np.array, c) for c in forked]
    no_history = helpers.random_layer(CFG, 1, seed=3).init_cache(3, MAX_SEQ, **(paging or {}))
    refusals = [
        (lambda: dsv4_jax.rewind_rows([forked[0], no_history], [0], 1), ValueError,
         r"caches\[1\]: rewind_rows needs the history a cache keeps"),
        (lambda: dsv4_jax.rewind_rows(forked, [0, 2], 1), ValueError, r"n: expected at most 0 tokens for row 2"),
        (lambda: dsv4_jax.reset_rows([forked[0], "cache"], [0]), TypeError,
         r"caches\[1\]: expected an AttentionCache, got str"),
        (lambda: dsv4_jax.reset_rows(forked, [3]), ValueError, r"rows: expected row indices in \[-3, 3\)")]
    if paging:
        apart = dsv4_jax.reserve_pages(forked[2], np.array([0, 0, 16]))  # its table alone takes a page
        refusals.append((lambda: dsv4_jax.reset_rows([forked[1], apart], [0]), ValueError,
                         "caches: expected the paged caches of one stack to hold one page table"))
    for call, kind, match in refusals:
        with pytest.raises(kind, match=match):
            call()
    for c, was in zip(forked, before):
        _assert_bitwise(jax.tree.map(np.asarray, c), was, "after the refusals")
    if not paging:
        jitted = jax.jit(lambda c, r: dsv4_jax.reset_rows(dsv4_jax.rewind_rows(c, r, 2), r[:1]))(forked,
                                                                                               jnp.array([1, 0]))
        eager = dsv4_jax.reset_rows(dsv4_jax.rewind_rows(forked, [1, 0], 2), [1])
        _assert_bitwise(jax.tree.map(np.asarray, jitted), jax.tree.map(np.asarray, eager), "under jit")
