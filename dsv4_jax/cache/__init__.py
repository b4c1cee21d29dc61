"""The caches: contiguous (`contiguous`) and FP8-quantized rows (`quantized`)."""

import importlib


def __getattr__(name):
    # `dsv4_jax.cache.<name>` of the releases where `cache` was one module, now `contiguous`.
    try:
        return getattr(importlib.import_module("dsv4_jax.cache.contiguous"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
