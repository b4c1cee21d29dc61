"""RMS norms of DeepSeek-V4 attention (spec sections 2.1 and 2.2), NumPy/XLA generic."""

from __future__ import annotations

import numpy as np

from dsv4_jax.backend import Array, namespace


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """Weighted RMSNorm over the last axis: `w * x / sqrt(mean(x^2) + eps)`.

    Math in float32 with the (float32) weight, cast back to `x.dtype` once at the end, as the
    reference keeps its norm weights in float32. x: [..., N], weight: [N] -> [..., N].
    """
    xp = namespace(x, weight)
    h = x.astype(np.float32)
    h = h / xp.sqrt(xp.mean(h * h, axis=-1, keepdims=True) + eps)
    weight = weight.astype(np.float32).reshape((1,) * (h.ndim - weight.ndim) + weight.shape)  # no rank promotion
    return (weight * h).astype(x.dtype)


def head_rms_norm(x: Array, eps: float) -> Array:
    """Unweighted RMSNorm over the last axis (the query's per-head norm).

    The factor is computed in float32 and cast to `x.dtype` before the multiply, as HF does.
    x: [..., D] -> [..., D].
    """
    xp = namespace(x)
    h = x.astype(np.float32)
    factor = 1.0 / xp.sqrt(xp.mean(h * h, axis=-1, keepdims=True) + eps)
    return x * factor.astype(x.dtype)
