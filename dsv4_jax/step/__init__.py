"""The step: the pure step (`pure_step`), the break boundary (`breaks`), the overlap of independent
stages (`overlap`) and meshes (`sharding`)."""

import importlib


def __getattr__(name):
    # `dsv4_jax.step.<name>` of the releases where `step` was one module, now `pure_step`.
    try:
        return getattr(importlib.import_module("dsv4_jax.step.pure_step"), name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
