"""A float atomic add for Pallas' Triton backend with relaxed memory order.

`jax.experimental.pallas.triton.atomic_add` lowers to `tt.atomic_rmw` with acquire-release
semantics: every add also orders the program's other memory accesses, which a reduction into
an accumulator that nothing reads before the kernel ends does not need (PyTorch Inductor's
scatter-adds use relaxed atomics for the same reason). `atomic_add(ref, idx, values)` here
is the same operation with `sem = relaxed`: the sparse attention backward's key gradients
(`sparse_attention_backward`) add this way.

It is a primitive of its own, whose abstract evaluation, interpret-mode discharge and Triton
lowering are those of Pallas' `atomic_rmw` with the one attribute changed. These live in
jax's private modules (`jax._src.pallas.triton`); where they are not as this module expects
(another jax version), `atomic_add` is Pallas' public one and `RELAXED` is False.
"""

from __future__ import annotations

from jax.experimental.pallas import triton as pl_triton

try:
    from jax import tree_util
    from jax._src import core as jax_core
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering as triton_lowering
    from jax._src.pallas.triton import primitives as triton_primitives
    from jax._src.state import discharge as state_discharge
    from jax._src.state import indexing
    from jax._src.state import primitives as state_primitives

    _ADD = triton_primitives.AtomicOpType.ADD
    _relaxed_add_p = jax_core.Primitive("dsv4_relaxed_atomic_add")
    _relaxed_add_p.def_effectful_abstract_eval(triton_primitives._atomic_abstract_eval)
    state_discharge.register_discharge_rule(_relaxed_add_p)(triton_primitives._atomic_rmw_discharge_rule)

    @triton_lowering.register_lowering(_relaxed_add_p)
    def _relaxed_add_lowering(ctx, *args_flat, args_tree, atomic_type):
        block_info, *_ = ctx.block_infos
        ptr, transforms, val, mask = args_tree.unflatten(args_flat)
        *_, value_aval, mask_aval = args_tree.unflatten(ctx.avals_in)
        (idx,) = transforms  # atomic_add below always passes one NDIndexer
        ptr = triton_lowering._compute_pointers_from_indices(ptr, block_info, idx)
        val = triton_lowering._ensure_ir_value(val, value_aval)
        if mask is not None:
            mask = triton_lowering._ensure_ir_value(mask, mask_aval)
        return triton_lowering._atomic_rmw(tt_dialect.RMWOp.FADD, ptr, val, mask=mask,
                                           semantic=tt_dialect.MemSemantic.RELAXED)

    RELAXED = True
except (ImportError, AttributeError):  # another jax's internals: the public, acquire-release add
    RELAXED = False


def atomic_add(ref, idx: tuple, values) -> None:
    """``ref[idx] += values`` atomically, relaxed order where `RELAXED` (Triton backend or
    interpret mode alike); `idx` a tuple of integer arrays broadcast to `values`' shape."""
    if not RELAXED:
        pl_triton.atomic_add(ref, idx, values)
        return
    x_ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "atomic_rmw")
    if len(transforms) != 1 or not isinstance(transforms[0], indexing.NDIndexer):
        pl_triton.atomic_add(ref, idx, values)
        return
    args_flat, args_tree = tree_util.tree_flatten((x_ref, transforms, values, None))
    _relaxed_add_p.bind(*args_flat, args_tree=args_tree, atomic_type=_ADD)
