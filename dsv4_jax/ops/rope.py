"""Interleaved partial RoPE on the trailing slice of each head (spec sections 2.3 and 2.4).

Every rotated vector (query, window key, compressed entry, indexer query and key, attention
output) is laid out ``[nope | rope]``; only the trailing `rope_dim` channels rotate, in
adjacent pairs ``(2i, 2i+1)`` (GPT-J style). Pair i at position p turns by ``p * f_i``.

Sliding layers use the "main" frequencies (theta 10000); CSA/HCA layers use "compress"
(theta 160000 with YaRN) for everything, the indexer included.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import numpy as np

from dsv4_jax.backend import Array, namespace, update_trailing
from dsv4_jax.config import DeepseekV4Config


def inv_freq(cfg: DeepseekV4Config, kind: str) -> np.ndarray:
    """Per-pair inverse frequencies, float32 [rope_dim // 2], computed as HF does (float32 math).

    kind: "main" or "compress".
    """
    dim = cfg.qk_rope_head_dim
    if kind == "main":
        base, scaling = cfg.rope_theta, None
    elif kind == "compress":
        base, scaling = cfg.compress_rope_theta, cfg.compress_rope_scaling
    else:
        raise ValueError(f"kind: expected 'main' or 'compress', got {kind!r}")
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    # torch evaluates `float ** float32 tensor` exactly rounded; a float32 np.power is off by an
    # ulp for some entries, which moves the angle at large positions. Round a float64 power.
    pos_freqs = np.power(np.float64(base), exponents.astype(np.float64)).astype(np.float32)
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if scaling is None:
        return extrapolation
    interpolation = (np.float32(1.0) / (np.float32(scaling.factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        turns = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (np.float32(1.0) - ramp.astype(np.float32)).astype(np.float32)
    return (interpolation * (np.float32(1.0) - keep) + extrapolation * keep).astype(np.float32)


def attention_factor(cfg: DeepseekV4Config, kind: str) -> float:
    """Scale of cos/sin: YaRN's attention_factor on the compress rope (1.0 for V4), else 1."""
    if kind == "compress" and cfg.compress_rope_scaling is not None:
        return cfg.compress_rope_scaling.attention_factor
    return 1.0


@functools.cache
def rotation_of(cfg: DeepseekV4Config, kind: str) -> tuple[np.ndarray, float]:
    """One rope kind's (inverse frequencies float32 [half], cos/sin scale): what a stage that
    rotates needs (`inv_freq`, `attention_factor`), computed once per config and kind."""
    return inv_freq(cfg, kind), attention_factor(cfg, kind)


class LayerRotations(NamedTuple):
    """The rotations of a layer's step, each `rotation_of`'s (inverse frequencies, cos/sin scale):
    `attention` turns its queries and keys and, inverted, its attention output (the layer's kind,
    `DeepseekV4Config.rope_kind`); `compressed` its compressed entries and the indexer's queries."""

    attention: tuple[np.ndarray, float]
    compressed: tuple[np.ndarray, float]


def layer_rotations(cfg: DeepseekV4Config, kind: str) -> LayerRotations:
    """The `LayerRotations` of a layer whose rope is `kind` ("main" or "compress"), which its step
    computes once and hands down."""
    return LayerRotations(rotation_of(cfg, kind), rotation_of(cfg, "compress"))


class RotationTables(NamedTuple):
    """cos and sin of a rotation at given positions (`rotation_tables`): float32 [..., rd/2] each,
    values rounded to the rotated vectors' dtype (times the cos/sin scale), sin negated for an
    inverse rotation. A step computes its queries' and keys' once (`rotation_tables`) and hands
    them to what turns them (`rotate_by`, the queries' norm kernels)."""

    cos: Array
    sin: Array


def apply_rope(x: Array, positions: Array, freqs: Array, *, inverse: bool = False, scale: float = 1.0,
               in_place: bool = False) -> Array:
    """Rotate the trailing ``2 * len(freqs)`` channels of `x` by ``positions * freqs``.

    x:         [..., D]
    positions: integer, broadcastable to ``x.shape[:-1]`` (e.g. [B, S, 1] for [B, S, H, D])
    freqs:     float32 [rd/2]
    inverse:   rotate by the negative angle (undo the rotation; used on the attention output)
    in_place:  under JAX, write the rotated channels into x on CUDA instead of concatenating a
               new [..., D] array (`backend.update_trailing`): for the large [B, S, H, D]
               queries and attention output. Same values either way.

    The angle is float32(position) * float32(freq); cos/sin are rounded to `x.dtype` (HF
    builds its tables in the activation dtype) and the rotation itself runs in float32
    (`rotation_tables`, then `rotate_by`).
    """
    xp = namespace(x, positions, freqs)
    return rotate_by(x, rotation_tables(positions, freqs, scale, x.dtype, inverse=inverse, xp=xp), in_place=in_place)


def rotate_by(x: Array, tables: RotationTables, *, in_place: bool = False) -> Array:
    """`x` [..., D] with its trailing ``2 * half`` channels turned by `tables` (cos, sin
    float32 [..., half], broadcastable to x's [..., half] pairs): the pairs ``(2i, 2i+1)`` in
    float32, rounded back to x's dtype. `in_place`: as `apply_rope`'s."""
    cos, sin = tables
    xp = namespace(x, cos, sin)
    half = cos.shape[-1]
    nope, rot = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half :]
    pairs = rot.astype(np.float32).reshape(*rot.shape[:-1], half, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = xp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    rotated = rotated.reshape(rot.shape).astype(x.dtype)
    if in_place and xp is not np:
        return update_trailing(x, rotated)
    return xp.concatenate([nope, rotated], axis=-1)


def derotate_output(o: Array, positions: Array, freqs: Array, scale: float = 1.0) -> Array:
    """The layer's inverse RoPE on the attention output (stage 6's first step), in place:
    o [..., H, D] at positions [...] (one a query), freqs float32 [rd/2], scale the cos/sin's.
    The one place the XLA paths (`sparse_attention`, the kernels' XLA merges) undo it."""
    return apply_rope(o, positions[..., None], freqs, inverse=True, scale=scale, in_place=True)


def rotation_tables(positions: Array, freqs: Array, scale: float, dtype, *, inverse: bool = False,
                    xp=None) -> RotationTables:
    """cos and sin of ``positions * freqs`` as `apply_rope` uses them: float32 [..., rd/2] of
    values rounded to `dtype` (times `scale`), sin negated for the inverse rotation. `xp`: the
    array namespace to compute them in (default: jax.numpy for JAX arguments, else NumPy)."""
    xp = xp or namespace(positions, freqs)
    freqs = freqs.astype(np.float32).reshape((1,) * positions.ndim + freqs.shape)  # ranks explicit
    angle = positions.astype(np.float32)[..., None] * freqs  # [..., rd/2]
    cos = (xp.cos(angle) * scale).astype(dtype).astype(np.float32)
    sin = (xp.sin(angle) * scale).astype(dtype).astype(np.float32)
    return RotationTables(cos, -sin if inverse else sin)


def rotate_in_place(x: Array, positions: Array, freqs: np.ndarray, *, inverse: bool = False,
                    scale: float = 1.0) -> Array:
    """`apply_rope(x, positions, freqs, inverse=inverse, scale=scale, in_place=True)` whose
    gradient rotates the cotangent's trailing channels back in the cotangent's own buffer
    (`rotate_by_in_place` of the rotation's tables)."""
    xp = namespace(x, positions, freqs)
    return rotate_by_in_place(x, rotation_tables(positions, freqs, scale, x.dtype, inverse=inverse, xp=xp))


def rotate_by_in_place(x: Array, tables: RotationTables) -> Array:
    """`rotate_by(x, tables, in_place=True)` (JAX arrays) whose gradient rotates the cotangent's
    trailing channels back in the cotangent's own buffer.

    XLA's transposition of the in-place update adds the rotated channels' cotangent, padded to
    [..., D], to the cotangent with those channels zeroed: a pass over every query (on the H200
    0.17 ms a layer of an HCA 4k training step). The rotation is linear, so its transpose is
    the rotation by the opposite angle with the same cos/sin (sin negated: the same values as
    XLA's). Reverse mode only (a `jax.custom_vjp`): the step uses it where the queries' norm is
    a kernel, which is reverse mode only already (`KernelPlan.query_norm`). NumPy arrays (the
    wide break's host stages) are rotated by `rotate_by`.
    """
    if namespace(x, *tables) is np:
        return rotate_by(x, tables, in_place=True)

    @jax.custom_vjp
    def rotate(x, tables):
        return rotate_by(x, tables, in_place=True)

    def forward(x, tables):
        return rotate(x, tables), tables

    def backward(tables, g):
        cos, sin = tables
        return rotate_by(g, RotationTables(cos, -sin), in_place=True), None

    rotate.defvjp(forward, backward)
    return rotate(x, RotationTables(*tables))
