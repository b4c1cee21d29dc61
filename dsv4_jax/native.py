"""The native XLA FFI handlers of the indexer's selection (built from csrc/): loading,
registration, the calls, and what was built.

The only module that imports the compiled extensions or knows the FFI target names. Three
targets per platform, same contract as `indexer.select_topk` (see csrc/select_topk.h):

==========================  ===============================================================
target                      what it does
==========================  ===============================================================
``dsv4_select_topk``        scoring + top-k; on CUDA an **eager break**: the handler has no
                            command-buffer trait, so XLA ends its CUDA graph before it and
                            starts a new one after it (vLLM's ``eager_break_during_capture``)
``dsv4_select_topk_graph``  the same kernels, declared command-buffer compatible: captured
                            inside XLA's CUDA graph (used by ``break_mode="none"``)
``dsv4_select_topk_fp4``    scoring + top-k over an FP8 cache's packed FP4 indexer keys
``[_graph]``                (codes and scale bytes, dequantized where the kernels load them)
``dsv4_select_topk[_fp4]``  the same over a paged cache's pool [N, .] and its page table
``_paged[_graph]``          [B, P_row] (`select_topk`'s ``table``): each key read in its page
``dsv4_topk[_graph]``       the top-k alone, on float32 scores (property tests, benchmarks)
``dsv4_finite_flag``        a step's finite verdict written into host memory the extension
                            owns, where the eager call polls it (`dsv4_jax.step.finite_flag`;
                            command-buffer compatible on CUDA)
``dsv4_sparse_attention_``  CUDA only: CSA's sparse attention backward for bf16, 64 heads of
``backward``                512 (csrc/sparse_attention_backward.h; `sparse_attention_backward`
                            chooses it), command-buffer compatible
==========================  ===============================================================

On the CPU there are no command buffers; both names run the same C++ handler.

The extensions are built by ``pip install -e .`` (scikit-build-core + CMake) against the XLA
FFI headers of jax 0.10.2 (FFI API 0.3), which load on every supported jax. Where a compiler
was missing, the module is absent and `available` says so; `native_info` tells the reason.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# jax platform name -> (extension module, the name `register_ffi_target` takes).
_EXTENSIONS = {"cpu": ("dsv4_jax._native_cpu", "cpu"), "cuda": ("dsv4_jax._native_cuda", "CUDA")}
_BUILD_HINT = (
    "reinstall the package where a C++ compiler (and, for GPUs, nvcc) is on PATH: "
    "`pip install -e .` (add `-Ccmake.define.DSV4_CUDA=ON` to require the CUDA part)"
)


def platform_name(platform: str) -> str:
    """jax's backend names ("gpu") and platform names ("cuda") to one key: "cpu" or "cuda"."""
    return "cuda" if platform in ("gpu", "cuda") else platform


@functools.cache
def _extension(platform: str) -> tuple[Any, str | None]:
    """(the imported extension, None) or (None, why not)."""
    module = _EXTENSIONS.get(platform)
    if module is None:
        return None, f"no native handlers exist for platform {platform!r}"
    try:
        return importlib.import_module(module[0]), None
    except ImportError as err:
        return None, f"{module[0]} is not built ({err}); {_BUILD_HINT}"


def _backend_present(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


@functools.cache
def _registered(platform: str) -> str | None:
    """Register the platform's targets with XLA once; None when ready, else why not."""
    ext, why = _extension(platform)
    if ext is None:
        return why
    if not _backend_present(platform):
        return f"jax has no {platform} backend in this process"
    for name, capsule in ext.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=_EXTENSIONS[platform][1])
    return None


def available(platform: str) -> bool:
    """Whether the native selection can run on `platform` ("cpu", "gpu"/"cuda") here."""
    return _registered(platform_name(platform)) is None


def unavailable_reason(platform: str) -> str | None:
    return _registered(platform_name(platform))


def native_info() -> dict[str, Any]:
    """What was built and what is usable in this process, per platform.

    ``{"jax": "0.10.2", "cpu": {"built": True, "usable": True, "ffi_api": "0.3", ...},
    "cuda": {"built": False, "usable": False, "reason": "..."}}``
    """
    info: dict[str, Any] = {"jax": jax.__version__}
    for platform in _EXTENSIONS:
        ext, why = _extension(platform)
        entry: dict[str, Any] = {"built": ext is not None}
        if ext is not None:
            entry.update(ext.build_info())
            entry["targets"] = sorted(ext.registrations())
        reason = _registered(platform)
        entry["usable"] = reason is None
        if reason is not None:
            entry["reason"] = why or reason
        info[platform] = entry
    return info


def _register_all() -> None:
    for platform in _EXTENSIONS:
        _registered(platform)


# The CUDA top-k takes a row in one block of threads (staged in its shared memory up to 32,768
# entries). A decode step of a long context has few rows and long ones (B = 1 at 1M tokens: one
# row of 262,144 CSA entries, one SM of 132 busy), so such rows are cut into segments, one
# block each, whose K best are merged by a second launch (csrc/select_topk_cuda.cu LaunchTopk).
SEGMENT_MIN_SLOTS = 32768  # rows up to this length: one block a row (staged: one pass over memory)
SEGMENT_MAX_ROWS = 64  # more rows than this fill the card one block a row (a prefill's query block)
SEGMENT_TARGET_BLOCKS = 264  # two blocks per SM of an H200
SEGMENT_MIN_LENGTH = 8192  # entries a segment takes, at least (a segment's cost is mostly fixed)
SEGMENT_MAX_PAIRS = 16384  # P * K: the merge's row (32 segments at K = 512)


def topk_segments(rows: int, slots: int, top_k: int) -> int:
    """Segments per row of the CUDA top-k for `rows` rows of `slots` entries (1: a block a row).

    Long rows (> `SEGMENT_MIN_SLOTS` entries) among few (<= `SEGMENT_MAX_ROWS`): about
    `SEGMENT_TARGET_BLOCKS` blocks in all, each segment at least `SEGMENT_MIN_LENGTH` entries,
    and at most `SEGMENT_MAX_PAIRS` pairs for the merge of a row.
    """
    if slots <= SEGMENT_MIN_SLOTS or rows > SEGMENT_MAX_ROWS or top_k <= 0:
        return 1
    wanted = min(-(-SEGMENT_TARGET_BLOCKS // max(rows, 1)), SEGMENT_MAX_PAIRS // top_k, slots // SEGMENT_MIN_LENGTH)
    return max(1, wanted)


def _workspace(lead_and_seq: tuple[int, ...], slots: int, top_k: int, segments: int | None):
    """The handlers' workspace output [..., S, 2 * P * K] int32 (W = 0 with one block a row)."""
    rows = math.prod(lead_and_seq)
    p = topk_segments(rows, slots, top_k) if segments is None else segments
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise ValueError(f"segments: expected None or an int >= 1, got {segments!r}")
    p = min(p, max(slots, 1))
    return jax.ShapeDtypeStruct((*lead_and_seq, 2 * p * top_k if p > 1 else 0), jnp.int32)


class Pages(NamedTuple):
    """Where a selection's keys are a paged cache's pool (`dsv4_jax.cache.paged`): the keys'
    operands are the pool flattened, [N, .] (N = pages * entries), and key t of batch row b is
    pool row ``table[b, t // entries] * entries + t % entries``; a page -1 (or outside the
    pool) reads as a zero key. table int32 [B, P_row] with P_row * entries >= slots."""

    table: Any
    entries: int
    slots: int

    def checked(self, key_arrays, lead: tuple[int, ...]) -> tuple[int, Any]:
        """(entries, table int32) after checking the pool's operands `key_arrays` ([N, .] each,
        N a multiple of ``entries``) and the table ([*lead, P_row], P_row * entries >= slots):
        a `ValueError` naming ``keys`` or ``pages.table`` otherwise."""
        entries = int(self.entries)
        rows = key_arrays[0].shape[0]
        if any(k.ndim != 2 or k.shape[0] != rows for k in key_arrays) or entries < 1 or rows % entries:
            raise ValueError(f"keys: expected a paged pool [pages * {entries}, .] for pages of {entries} entries, "
                             f"got {[tuple(k.shape) for k in key_arrays]}")
        table = jnp.asarray(self.table, jnp.int32)
        if table.shape[:-1] != tuple(lead) or table.shape[-1] * entries < self.slots:
            raise ValueError(f"pages.table: expected [{', '.join(map(str, lead))}, P_row] int32 with "
                             f"P_row * {entries} >= {self.slots} entries a row, got {tuple(table.shape)}")
        return entries, table


def _paged_call(name: str, key_args: tuple, pages: Pages | None, lead_and_seq: tuple, top_k: int,
                segments: int | None, args: tuple, graph: bool):
    """The FFI call of a selection target `name` over `key_args` (contiguous, or a pool with
    `pages`: the _paged target, the table after the keys' operands)."""
    slots = key_args[0].shape[-2] if pages is None else pages.slots
    out_types = (
        jax.ShapeDtypeStruct((*lead_and_seq, top_k), jnp.int32),
        jax.ShapeDtypeStruct((*lead_and_seq, slots), jnp.float32),
        _workspace(lead_and_seq, slots, top_k, segments),
    )
    queries, weights, visible = args
    if pages is None:
        call = jax.ffi.ffi_call(name + ("_graph" if graph else ""), out_types, vmap_method="broadcast_all")
        picks, scores, _ = call(queries, weights, *key_args, visible)
        return picks, scores
    entries, table = pages.checked(key_args, lead_and_seq[:-1])
    # vmap: one call a batch element (the pool is shared, not broadcast along the vmapped dims).
    call = jax.ffi.ffi_call(name + "_paged" + ("_graph" if graph else ""), out_types, vmap_method="sequential")
    picks, scores, _ = call(queries, weights, *key_args, table, visible, page_entries=np.int64(entries))
    return picks, scores


def select_topk(queries, weights, keys, visible, *, top_k: int, graph: bool, segments: int | None = None,
                pages: Pages | None = None):
    """(picks int32 [..., S, top_k], scores float32 [..., S, T]) from the native handler.

    queries [..., S, nI, c] and keys [..., T, c] in float32 or bfloat16 (other dtypes are
    computed in float32), weights float32 [..., S, nI], visible int32 [..., S]. `graph`
    picks the command-buffer-compatible target (no break) over the eager break.
    `segments`: blocks a row of the CUDA top-k (None: `topk_segments`; the picks are the
    same for every value; the CPU handler has one path). `pages`: the keys are a paged
    cache's pool [N, c], read through ``pages.table`` (`Pages`; T = ``pages.slots``): the
    same picks and scores as over the keys [B, T, c] the pages hold, with no copy of them.
    The inputs carry no gradient (the picks are integers; see `indexer_kl_loss` for the
    indexer's training signal); `vmap` adds leading dims, which the handler accepts.
    """
    _register_all()
    dtype = queries.dtype if queries.dtype in (jnp.float32, jnp.bfloat16) else jnp.float32
    args = (jax.lax.stop_gradient(queries.astype(dtype)), jax.lax.stop_gradient(weights.astype(jnp.float32)),
            visible.astype(jnp.int32))
    return _paged_call("dsv4_select_topk", (jax.lax.stop_gradient(keys.astype(dtype)),), pages,
                       queries.shape[:-2], top_k, segments, args, graph)


def select_topk_fp4(queries, weights, key_codes, key_scales, visible, *, top_k: int, graph: bool,
                    segments: int | None = None, pages: Pages | None = None):
    """`select_topk` over an FP8 cache's indexer keys in their stored form: key_codes uint8
    [..., T, c / 2] (e2m1 codes two a byte, `numerics.pack_fp4`) and key_scales uint8
    [..., T, ceil(c / 32)] (UE8M0 exponent bytes). The handler dequantizes each key where it
    loads it (exactly: the scores and picks of `select_topk` over the dequantized keys), so a
    long context's scoring reads 68 bytes a V4 key instead of a bf16 copy's 256. `pages`: as in
    `select_topk` (codes [N, c / 2] and scales [N, ceil(c / 32)], a paged cache's pool)."""
    _register_all()
    dtype = queries.dtype if queries.dtype in (jnp.float32, jnp.bfloat16) else jnp.float32
    args = (jax.lax.stop_gradient(queries.astype(dtype)), jax.lax.stop_gradient(weights.astype(jnp.float32)),
            visible.astype(jnp.int32))
    return _paged_call("dsv4_select_topk_fp4", (jnp.asarray(key_codes, jnp.uint8), jnp.asarray(key_scales, jnp.uint8)),
                       pages, queries.shape[:-2], top_k, segments, args, graph)


def topk(scores, visible, *, top_k: int, graph: bool = True, segments: int | None = None):
    """int32 [..., S, top_k]: the native top-k of float32 scores [..., S, T] over ``t < visible``.

    Descending score, equal scores to the lower index, -1 padding (as `indexer.picks_from_scores`
    on scores that are -inf from `visible` on). `segments` as in `select_topk`.
    """
    _register_all()
    scores = jnp.asarray(scores, jnp.float32)
    out_types = (jax.ShapeDtypeStruct((*scores.shape[:-1], top_k), jnp.int32),
                 _workspace(scores.shape[:-1], scores.shape[-1], top_k, segments))
    name = "dsv4_topk_graph" if graph else "dsv4_topk"
    picks, _ = jax.ffi.ffi_call(name, out_types, vmap_method="broadcast_all")(
        jax.lax.stop_gradient(scores), jnp.asarray(visible, jnp.int32))
    return picks


def finite_flag(finite):
    """bool scalar -> the same bool, computed after the handler wrote ``(seq << 1) | finite`` into
    the slot of this device in `finite_flag_slots` (seq: the handler's runs on the device so far,
    this one included). Inside a step only (`dsv4_jax.step.finite_flag`); the step must consume the
    returned copy, which keeps the call in the program and orders everything after it."""
    _register_all()
    return jax.ffi.ffi_call("dsv4_finite_flag", jax.ShapeDtypeStruct((), jnp.bool_))(finite)


BACKWARD_HEADS, BACKWARD_DIM = 64, 512  # the shapes csrc/sparse_attention_backward_cuda.cu is built for


def sparse_attention_backward(q, dout, o, lse, delta_rotated, pool, window, entries, picks, *, scale: float,
                              rotated: int, stretches: int):
    """(dq bf16 [R, H, D], dpool f32 [B, P, D], dentries f32 [B, N, D], delta f32 [R, H]): the CUDA
    handler's gradient of CSA's sparse attention (contract in csrc/sparse_attention_backward.h).
    q, o bf16 [R, 64, 512]; dout bf16 [G, R, 64 / G, 512]; lse, delta_rotated f32 [R, 64]; pool,
    entries bf16 [B, ., 512]; window, picks int32 [R, .] (-1: no key). CUDA only: the caller
    checks `available("cuda")` and lowers it for CUDA alone (`jax.lax.platform_dependent`)."""
    _register_all()
    rows = q.shape[0]
    out_types = (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
                 jax.ShapeDtypeStruct(pool.shape, jnp.float32),
                 jax.ShapeDtypeStruct(entries.shape, jnp.float32),
                 jax.ShapeDtypeStruct((rows, q.shape[1]), jnp.float32))
    return jax.ffi.ffi_call("dsv4_sparse_attention_backward", out_types)(
        q, dout, o, lse, delta_rotated, pool, window, entries, picks,
        scale=np.float32(scale), rotated=np.int64(rotated), stretches=np.int64(stretches))


@functools.cache
def finite_flag_slots(platform: str) -> np.ndarray | None:
    """The host slots `finite_flag` writes (uint64, one per device ordinal modulo their count),
    as a NumPy view of the extension's memory (CUDA: mapped pinned host memory, allocated on
    the first call), or None where the platform's extension is not usable here."""
    platform = platform_name(platform)
    if _registered(platform) is not None:
        return None
    address, count = _extension(platform)[0].finite_flag_slots()
    return np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(address))


__all__ = ["Pages", "available", "finite_flag", "finite_flag_slots", "native_info", "platform_name", "select_topk",
           "select_topk_fp4", "sparse_attention_backward", "topk", "topk_segments",
           "unavailable_reason"]
