"""The layer runs under JAX's strictest broadcasting setting.

Under ``jax.numpy_rank_promotion("raise")`` every implicit rank promotion is an error, so the
package spells out every broadcast. tests/conftest.py sets it for the whole suite: every test
of a layer, a step, a cache or an op (prefill, ragged decode, each layer type and break mode,
the official numerics with an FP8 cache, gradients, sharded runs) is a rank-promotion test.
Here: the setting holds, and it bites.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest


def test_the_suite_runs_under_rank_promotion_raise():
    assert jax.config.jax_numpy_rank_promotion == "raise"
    with pytest.raises(ValueError, match=r"jax_numpy_rank_promotion='raise'"):
        jnp.ones((2, 3)) + jnp.ones((3,))
    assert (jnp.ones((2, 3)) + jnp.ones((1, 3))).shape == (2, 3)  # an explicit rank broadcasts
