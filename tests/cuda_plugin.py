"""Whether jax's CUDA plugin is installed in this environment (CI's deviceless stage, a GPU box),
without importing jax: `tests/conftest.py` asks before jax starts."""

from __future__ import annotations

import importlib.util


def installed() -> bool:
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))
