"""The package's face: the public names, and the module paths of the releases before the rooms.

Users' notebooks import `dsv4_jax.diagnostics`, `dsv4_jax.sharding`, `from dsv4_jax.step import
AttentionWeights`, ...: each still names the module (or name) in its room, the same object.
"""

from __future__ import annotations

import importlib

import pytest

import dsv4_jax


@pytest.mark.parametrize("old", sorted(dsv4_jax.MOVED_MODULES))
def test_a_flat_module_path_names_the_module_in_its_room(old):
    new = importlib.import_module(f"dsv4_jax.{dsv4_jax.MOVED_MODULES[old]}")
    assert importlib.import_module(f"dsv4_jax.{old}") is new
    assert getattr(dsv4_jax, old) is new
    assert new.__spec__.name == new.__name__  # the module keeps its own spec, not the alias's


def test_the_old_names_of_the_step_and_the_cache_hand_on_their_contents():
    from dsv4_jax.cache import AttentionCache, advance_length, contiguous, reset_rows
    from dsv4_jax.step import attention_step, pure_step, straight_through

    assert (AttentionCache, advance_length, reset_rows) == (
        contiguous.AttentionCache, contiguous.advance_length, contiguous.reset_rows)
    assert (attention_step, straight_through) == (pure_step.attention_step, pure_step.straight_through)
    assert dsv4_jax.attention_step is pure_step.attention_step
    with pytest.raises(AttributeError, match=r"dsv4_jax\.step' has no attribute 'nothing'"):
        dsv4_jax.step.nothing  # noqa: B018


def test_the_public_names():
    assert set(dsv4_jax.__all__) <= set(dir(dsv4_jax))
    assert dsv4_jax.BreakPlan is dsv4_jax.StepPlan  # its name before it held the whole plan
