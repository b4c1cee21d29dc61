"""XLA CPU miscompile: a slice update (`x.at[..., a:].set(v)`) whose result is scattered.

Found while moving `rope.apply_rope` from a concatenation to an in-place update (issue 9): the
compressor's rotated entries feed `backend.scatter_rows` (a vmapped ``.at[i].set(mode="drop")``)
and the golden replays failed on the CPU (rel err 1e-2). Jitted, the update version differs
from the concatenation and from NumPy at B = 1 with two or more rows; eager it agrees. Seen
with jax 0.10.2 and 0.12 (CPU). XLA fuses the update into a
``copy_dynamic-update-slice_fusion`` of shape [J, 1, 1, D] feeding the scatter; its result is
wrong. The same happened with the queries' update feeding the Pallas kernel in interpret mode
(the CPU tests). `apply_rope` therefore updates in place only where asked, and then only on
CUDA (`backend.update_trailing`, by `platform_dependent`; the GPU gates: the golden replays and
the layer with and without the kernel, tests/ops/test_sparse_attention_kernel.py).

    python scripts/xla_cpu_update_scatter_repro.py      # prints "bug reproduced" while it exists
"""

import jax
import jax.numpy as jnp
import numpy as np


def rotate_and_scatter(entries, x, positions, rows, in_place):
    freqs = jnp.asarray([1.0, 0.1, 0.01, 0.001], jnp.float32)
    half = freqs.shape[0]
    angle = positions.astype(jnp.float32)[..., None] * freqs
    pairs = x[..., -2 * half:].reshape(*x.shape[:-1], half, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * jnp.cos(angle) - odd * jnp.sin(angle),
                         odd * jnp.cos(angle) + even * jnp.sin(angle)], axis=-1).reshape(*x.shape[:-1], 2 * half)
    if in_place:
        out = x.at[..., -2 * half:].set(rotated)
    else:
        out = jnp.concatenate([x[..., :-2 * half], rotated], axis=-1)
    return jax.vmap(lambda t, i, v: t.at[i].set(v, mode="drop"))(entries, rows, out)


def main():
    rng = np.random.default_rng(1)
    entries = jnp.asarray(rng.normal(size=(1, 8, 16)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(1, 2, 16)), jnp.float32)
    positions = jnp.asarray([[3, 7]], jnp.int32)
    rows = jnp.asarray([[1, 2]], jnp.int32)
    fn = jax.jit(rotate_and_scatter, static_argnums=4)
    updated, concatenated = fn(entries, x, positions, rows, True), fn(entries, x, positions, rows, False)
    with jax.disable_jit():
        eager = rotate_and_scatter(entries, x, positions, rows, True)
    print(f"jax {jax.__version__} on {jax.default_backend()}")
    print("concatenation == eager:", np.allclose(concatenated, eager, atol=1e-6))
    print("in-place update == eager:", np.allclose(updated, eager, atol=1e-6))
    print("bug reproduced" if not np.allclose(updated, eager, atol=1e-6) else "no bug")


if __name__ == "__main__":
    main()
