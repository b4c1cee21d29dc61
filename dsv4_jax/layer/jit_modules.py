"""`jit_modules`: your function of NNX modules (the layers, or a model holding them) compiled with
the modules taken once, for a decode loop as fast as the package's own stack step.

``nnx.jit(fn)(modules, h, caches)`` is the natural way to jit a function of modules, and it walks
the modules' graph on every call: it splits them into a graph and a state before the call, merges
them inside it and writes the state back after it. At a decode step's size that walk costs more
host time than the step (a few ms for a stack of layers, where the step itself takes well under
one on an H200), and a decode loop is host-bound at small batches. `jit_modules(fn, modules)`
splits the modules once and compiles ``fn`` over their state; each call hands the compiled
program the same state leaves, checked only by identity (has a parameter been given a new value?).

Beside that, two things a user's jit of the layers does not get by itself, and this one does:

* the CSA layers' input projections' weights side by side, made once (their `step_weights()`),
  instead of XLA concatenating them inside every step (~34 MB a V4-Flash CSA layer);
* the compile options of the layers' plans (`dsv4_jax.step.overlap.compiler_options`: the
  independent stages side by side on CUDA).

Donate the caches and the fed-back hidden states (``donate_argnames``) and the step gets the
same buffers every call (docs/use.md, "A fast decode loop on a GPU").
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from dsv4_jax.layer.module import DeepseekV4Attention
from dsv4_jax.step import overlap as overlap_mod

_MODULE_ARGS = ("_module_leaves", "_input_projections")  # the compiled function's first two arguments
_RAW = operator.methodcaller("get_raw_value")


def jit_modules(fn: Callable, modules: Any, *, donate_argnames: str | Sequence[str] = (),
                static_argnames: str | Sequence[str] = (), compiler_options: dict | None = None) -> ModulesStep:
    """``fn(modules, *args, **kwargs)`` compiled with `modules` bound: returns a callable
    ``step(*args, **kwargs)`` that runs the compiled ``fn`` on the modules' current parameters.

    >>> def decode(layers, h, caches):                 # your function: the modules come first
    ...     new = []
    ...     for layer, cache in zip(layers, caches):
    ...         out, cache = layer(h, None, cache)     # positions=None: each row's next position
    ...         h = h + out
    ...         new.append(cache)
    ...     return h, new
    >>> step = dsv4_jax.jit_modules(decode, layers, donate_argnames=("h", "caches"))
    >>> h, caches = step(h, caches)                    # as decode(layers, h, caches), compiled

    modules: an `nnx.Module`, or a list / tuple / dict of them (anything `nnx.split` takes).
    donate_argnames / static_argnames: names of `fn`'s arguments after the modules, as for
    `jax.jit`. compiler_options: `jax.jit`'s; None: those of the `DeepseekV4Attention` layers'
    plans among the modules (`dsv4_jax.compiler_options`: on CUDA, their stages side by side).

    The contract: the result is ``fn(modules, ...)`` as `nnx.jit` computes it, for a `fn` that
    does not change the modules' variables (the layers' calls do not: their caches are
    arguments and results); one that does is refused at its first call with a `ValueError`.
    Parameters given new values in place (``param[...] = ...``, `nnx.update`, a loaded
    checkpoint, an optimizer's update of the same variables) are picked up by the next call,
    as are a layer's changed options (a new trace); a module or variable put in the place of
    another is not: make a new step then. Each call checks the parameters by identity (a few
    microseconds a layer) instead of walking the modules.
    """
    return ModulesStep(fn, modules, donate_argnames=donate_argnames, static_argnames=static_argnames,
                       compiler_options=compiler_options)


class ModulesStep:
    """`jit_modules`'s compiled function, with the modules' state it hands the program."""

    def __init__(self, fn: Callable, modules: Any, *, donate_argnames=(), static_argnames=(),
                 compiler_options: dict | None = None):
        if not callable(fn):
            raise TypeError(f"fn: expected a function of the modules, got {type(fn).__name__}")
        self.fn, self.modules = fn, modules
        self._options = compiler_options
        self._argnames = (_names("donate_argnames", donate_argnames), _names("static_argnames", static_argnames))
        self._signature = _compiled_signature(fn)
        self._take()

    def _take(self) -> None:
        """Split the modules (graph and state), and record what the next calls check by identity."""
        graphdef, state = nnx.split(self.modules)
        leaves, treedef = jax.tree.flatten(state)
        variables = [v for _, v in nnx.iter_graph(self.modules) if isinstance(v, nnx.Variable)]
        layers = [v for _, v in nnx.iter_graph(self.modules) if isinstance(v, DeepseekV4Attention)]
        self._leaves = leaves
        # The CSA layers' fused input projections (None for the others), made from these arrays.
        self._input_projections = [layer.step_weights().input_proj for layer in layers]
        self._variables, self._raws = variables, [_RAW(v) for v in variables]
        self._layers = layers
        self._layer_state = [(layer.options, layer.mesh) for layer in layers]
        key = (graphdef, treedef, tuple(self._layer_state))
        if getattr(self, "_key", None) != key:
            self._key = key
            self._jitted = self._compile(graphdef, treedef, layers)

    def _compile(self, graphdef, treedef, layers):
        fn = self.fn

        def compiled(module_leaves, input_projections, *args, **kwargs):
            modules = nnx.merge(graphdef, jax.tree.unflatten(treedef, module_leaves))
            inner = [v for _, v in nnx.iter_graph(modules) if isinstance(v, DeepseekV4Attention)]
            for layer, input_proj in zip(inner, input_projections):
                if input_proj is not None:
                    layer._hold_input_projections(input_proj)
            result = fn(modules, *args, **kwargs)
            after = jax.tree.leaves(nnx.state(modules))
            if len(after) != len(module_leaves) or any(a is not b for a, b in zip(after, module_leaves)):
                raise ValueError(f"fn: {getattr(fn, '__name__', fn)!r} changed the modules' variables, which "
                                 "jit_modules does not write back; expected a function that leaves them as they "
                                 "are (use nnx.jit for one that updates them)")
            return result

        compiled.__signature__ = self._signature
        compiled.__name__ = getattr(self.fn, "__name__", "jit_modules")
        options = self._options
        if options is None:
            overlap = any(layer.step_spec().plan.overlap for layer in layers)
            options = overlap_mod.compiler_options(overlap)
        donate, static = self._argnames
        return jax.jit(compiled, donate_argnames=donate, static_argnames=static, compiler_options=options)

    def _current(self) -> bool:
        """The modules still hold the parameters (and the layers the options) that were taken."""
        return (all(map(operator.is_, map(_RAW, self._variables), self._raws))
                and all(layer.options is options and layer.mesh is mesh
                        for layer, (options, mesh) in zip(self._layers, self._layer_state)))

    def __call__(self, *args, **kwargs):
        if not self._current():
            self._take()
        return self._jitted(self._leaves, self._input_projections, *args, **kwargs)

    def lower(self, *args, **kwargs):
        """The compiled function's `jax.stages.Lowered` for these arguments (its HLO, its cost)."""
        if not self._current():
            self._take()
        return self._jitted.lower(self._leaves, self._input_projections, *args, **kwargs)


def _names(what: str, names) -> tuple[str, ...]:
    names = (names,) if isinstance(names, str) else tuple(names)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what}: expected names of fn's arguments, got {names!r}")
    return names


def _compiled_signature(fn: Callable) -> inspect.Signature:
    """`fn`'s signature with its first parameter (the modules) replaced by the compiled function's
    two state arguments: `jax.jit` maps the argument names it is given through it."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as err:
        raise TypeError(f"fn: expected a function with an inspectable signature, got {fn!r}") from err
    if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                            inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise TypeError("fn: expected a function taking the modules as its first positional argument, got "
                        f"the signature {inspect.signature(fn)}")
    head = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY) for name in _MODULE_ARGS]
    return inspect.Signature(head + params[1:])
