"""A modifier's expression evaluated by NumPy: the reference's side of "one expression, two backends".

Floats are float64, ints int64, bools bool; the variables are broadcast grids (``b`` over axis 0,
``h`` over axis 1, ``q_idx`` over axis 2, ``kv_idx`` over axis 3 of a (B, H, Sq, Sk) score array), so
an expression is evaluated for every score at once. The rules are the kernels' (:mod:`.check`):
``/`` divides as floats, ``floor_div`` and ``%`` round toward minus infinity and give 0 for a zero
divisor, ``min``/``max`` propagate NaN, and an array read outside ``[0, size)`` gives 0 (False).
"""

from __future__ import annotations

import numpy as np

from cuflash.modifiers.parse import Binary, Call, Index, Name, Node, Num, Unary

__all__ = ["evaluate", "grids"]


def grids(B: int, H: int, Sq: int, Sk: int, q_offset=0, kv_offset=0, b_offset=0) -> dict:
    """The position variables as broadcastable int64 grids; ``q_offset`` / ``kv_offset`` (ints or
    arrays broadcastable to (B, 1, 1, 1)) shift the positions (a varlen sequence's start is not one:
    positions count from the start of each sequence, so these stay 0 there); ``b_offset`` shifts
    ``b`` (a varlen sequence evaluated alone keeps its index)."""
    return {"b": np.arange(B, dtype=np.int64).reshape(B, 1, 1, 1) + b_offset,
            "h": np.arange(H, dtype=np.int64).reshape(1, H, 1, 1),
            "q_idx": np.arange(Sq, dtype=np.int64).reshape(1, 1, Sq, 1) + q_offset,
            "kv_idx": np.arange(Sk, dtype=np.int64).reshape(1, 1, 1, Sk) + kv_offset}


def _floor_div(xp, a, b):
    a, b = xp.asarray(a, dtype=xp.int64), xp.asarray(b, dtype=xp.int64)
    zero = b == 0
    return xp.where(zero, 0, xp.floor_divide(a, xp.where(zero, 1, b)))


def _floor_mod(xp, a, b):
    a, b = xp.asarray(a, dtype=xp.int64), xp.asarray(b, dtype=xp.int64)
    zero = b == 0
    return xp.where(zero, 0, xp.mod(a, xp.where(zero, 1, b)))


def _read(xp, array, index):
    """array[index], flat, with 0 (False) outside ``[0, size)``."""
    index = xp.asarray(index, dtype=xp.int64)
    if array.size == 0:
        return xp.zeros(index.shape, dtype=array.dtype)
    inside = (index >= 0) & (index < array.size)
    return xp.where(inside, array[xp.clip(index, 0, array.size - 1)], xp.zeros((), dtype=array.dtype))


_BINARY = {"+": "add", "-": "subtract", "*": "multiply", "<": "less", "<=": "less_equal", ">": "greater",
           ">=": "greater_equal", "==": "equal", "!=": "not_equal", "&&": "logical_and", "||": "logical_or"}
_CALLS = {"tanh": "tanh", "exp": "exp", "log": "log", "sqrt": "sqrt", "abs": "abs", "min": "minimum",
          "max": "maximum", "where": "where"}


def evaluate(node: Node, env: dict, xp=np):
    """The value of ``node`` (an array broadcast from the variables it reads, or a scalar).

    ``env``: every name the expression reads -> its value: the variables (``score`` float64,
    the :func:`grids`), scalar arguments (NumPy scalars) and array arguments (flat arrays of
    float64, int64 or bool). ``xp``: NumPy, or CuPy for arrays on the GPU (the same-dtype baseline
    of :mod:`cuflash.testing`)."""
    with np.errstate(all="ignore"):   # IEEE results (inf, nan) and wrapped ints, as the kernels give them
        return _evaluate(node, env, xp)


def _evaluate(node: Node, env: dict, xp):
    if isinstance(node, Num):
        return np.float64(node.value) if isinstance(node.value, float) else np.int64(node.value)
    if isinstance(node, Name):
        return env[node.id]
    if isinstance(node, Index):
        return _read(xp, env[node.array], _evaluate(node.index, env, xp))
    if isinstance(node, Unary):
        x = _evaluate(node.operand, env, xp)
        return xp.logical_not(x) if node.op == "!" else (xp.negative(x) if node.op == "-" else x)
    if isinstance(node, Binary):
        a, b = _evaluate(node.left, env, xp), _evaluate(node.right, env, xp)
        if node.op == "/":
            return xp.true_divide(xp.asarray(a, dtype=xp.float64), b)
        if node.op == "%":
            return _floor_mod(xp, a, b)
        return getattr(xp, _BINARY[node.op])(a, b)
    assert isinstance(node, Call)
    args = [_evaluate(a, env, xp) for a in node.args]
    if node.function == "floor_div":
        return _floor_div(xp, *args)
    return getattr(xp, _CALLS[node.function])(*args)
