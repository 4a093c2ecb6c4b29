"""``score_mod=`` / ``mask_mod=`` inside ``jax.jit``.

A :class:`cuflash.ScoreMod` or :class:`cuflash.MaskMod` is a Python object holding an expression,
scalars and arrays. At trace time each call's modifiers are split into

- a static part, :class:`Modifiers`: the expressions, the ScoreMod's ``grad`` and the scalars (hashed
  by the modifier's :attr:`~cuflash.modifiers.ScoreMod.key` and the scalars' values, so it can key the
  callbacks' caches and sit in a custom_vjp's static argument), and the arrays' layouts;
- the array arguments, JAX values (traced or not), which become operands of the call's
  ``buffer_callback`` after the adapter's own.

Inside the callback :meth:`Modifiers.rebuild` makes the modifiers again around the CuPy views of those
operands (:meth:`cuflash.ScoreMod.with_arrays`: nothing parsed or typed again), and cuflash runs them as
from CuPy. Scalars are static: a new value is a new trace, as for any static option (the kernels read
them at run time, so it is not a new kernel).
"""

from __future__ import annotations

import math

import numpy as np

from ..modifiers import MaskMod, ScoreMod, argument_slots

__all__ = ["Modifiers", "check_differentiable", "split"]

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_MEMO = 64   # rebuilt modifiers remembered per Modifiers, by the operands' addresses


class Modifiers:
    """The static part of a call's ``score_mod`` and ``mask_mod``.

    Attributes
    ----------
    score_mod, mask_mod : cuflash.ScoreMod, cuflash.MaskMod or None
        Templates: the user's modifiers with each array replaced by a ``jax.ShapeDtypeStruct`` of its
        shape and dtype (they hold no traced value, so a cache may keep them).
    layouts : tuple of (shape, numpy.dtype)
        The array operands' layouts, the ScoreMod's arrays first, each modifier's in slot order.

    Two are equal (and hash alike) when their modifiers compile to the same code (their ``key``s), have
    the same scalar values and arrays of the same layouts.
    """

    __slots__ = ("score_mod", "mask_mod", "layouts", "_names", "_ident", "_seen")

    def __init__(self, score_mod, mask_mod):
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self._names, layouts, ident = [], [], []
        for mod in (score_mod, mask_mod):
            names = mod.args.array_names() if mod is not None else ()
            self._names.append(names)
            layouts += [(tuple(mod.args.values[n].shape), np.dtype(mod.args.values[n].dtype)) for n in names]
            # repr of the scalars: a NaN scalar equals itself, -0.0 differs from 0.0
            ident.append(None if mod is None else (mod.key, repr(mod.call_parts()[0][1])))
        self.layouts = tuple(layouts)
        self._ident = (*ident, tuple((shape, dtype.str) for shape, dtype in self.layouts))
        self._seen = {}

    def __hash__(self):
        return hash(self._ident)

    def __eq__(self, other):
        return isinstance(other, Modifiers) and self._ident == other._ident

    def __repr__(self):
        return f"Modifiers({self.score_mod!r}, {self.mask_mod!r})"

    def rebuild(self, views) -> tuple:
        """(score_mod, mask_mod) around ``views`` (CuPy arrays laid out as :attr:`layouts`, in that
        order): remembered by the views' addresses, so a repeat call makes nothing."""
        key = tuple(x.data.ptr for x in views)
        found = self._seen.get(key)
        if found is None:
            if len(self._seen) >= _MEMO:
                self._seen.clear()
            split_at = len(self._names[0])
            parts = (views[:split_at], views[split_at:])
            found = self._seen[key] = tuple(
                None if mod is None else mod.with_arrays(dict(zip(names, part))) if names else mod
                for mod, names, part in zip((self.score_mod, self.mask_mod), self._names, parts))
        return found


def split(score_mod, mask_mod) -> tuple:
    """A call's modifiers as (static part, array operands), checked when traced.

    Returns
    -------
    modifiers : Modifiers or None
        None when both are None.
    arrays : tuple of jax.Array
        The array arguments in :attr:`Modifiers.layouts`' order (NumPy arrays taken as constants, as
        the adapter takes every array argument).

    Raises
    ------
    TypeError
        ``score_mod`` not a ScoreMod, ``mask_mod`` not a MaskMod; an array argument that is not a JAX
        (or NumPy) array, or whose dtype the modifier's types refuse (both name the argument).
    ValueError
        A float scalar outside float32's range (the kernels read float32); more than 8 arrays or 8
        scalars in the two modifiers together.
    """
    if score_mod is None and mask_mod is None:
        return None, ()
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        raise TypeError(f"score_mod must be a cuflash.ScoreMod or None, got {type(score_mod).__name__}")
    if mask_mod is not None and not isinstance(mask_mod, MaskMod):
        raise TypeError(f"mask_mod must be a cuflash.MaskMod or None, got {type(mask_mod).__name__}")
    import jax

    templates, arrays = [], []
    for mod, what in ((score_mod, "score_mod"), (mask_mod, "mask_mod")):
        if mod is None:
            templates.append(None)
            continue
        for slot, kind, value in mod.args.scalars():
            if kind == "float" and math.isfinite(value) and abs(float(value)) > _FLOAT32_MAX:
                name = next(n for n, s in mod.args.slots.items() if s == (False, slot, kind))
                raise ValueError(f"{what} argument {name}={value} is outside float32's range (the kernels read "
                                 "float32 scalars)")
        names = mod.args.array_names()
        given = {name: _jax_array(mod.args.values[name], f"{what} argument {name}") for name in names}
        # A NumPy float64 array becomes float32 without jax_enable_x64: the template is typed from what
        # the operand will be, and with_args checks the expression's types again for it.
        templates.append(mod.with_args(**{name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in given.items()})
                         if names else mod)
        arrays += given.values()
    argument_slots(*templates)
    return Modifiers(*templates), tuple(arrays)


def _jax_array(x, name: str):
    """``x`` as a JAX array (NumPy's as a constant); TypeError naming ``name`` for anything else (a CuPy
    array or a torch tensor cannot be an operand of XLA's program)."""
    import jax
    import jax.numpy as jnp

    if isinstance(x, jax.Array):
        return x
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    kind = type(x)
    raise TypeError(f"{name} must be a JAX array inside cuflash.interop.jax (an operand of its call), got "
                    f"{kind.__module__}.{kind.__qualname__}")


def check_differentiable(modifiers, function: str) -> None:
    """When a gradient is traced: a ScoreMod whose derivative is not 1 needs its ``grad``
    (ValueError naming score_mod, showing the derivative to pass)."""
    if modifiers is None or modifiers.score_mod is None or not modifiers.score_mod.needs_grad:
        return
    try:
        modifiers.score_mod.gradient()
    except ValueError as error:
        raise ValueError(f"the gradient of cuflash.interop.jax.{function}: {error}") from None
