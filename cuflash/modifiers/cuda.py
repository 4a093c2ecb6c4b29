"""A modifier's expression written as CUDA C++: the kernels' side of "one expression, two backends".

Only what the grammar allows reaches NVRTC, and no user text at all: numbers are written from their
parsed values, argument names become slots of ``cuflash::user::Args`` (``cuda_src/user_mod.cuh``),
and every operation is emitted with explicit types, so that C's conversions cannot change a
result: ints are ``long long``, floats ``float``, bools ``bool``; ``/`` converts both sides to
float; ``%``, ``floor_div``, ``min``/``max`` and array reads call the helpers of ``user_mod.cuh``,
which follow :mod:`cuflash.modifiers.numpy_eval`'s rules.
"""

from __future__ import annotations

import math

from cuflash.modifiers.check import VARIABLE_TYPES
from cuflash.modifiers.parse import Binary, Index, Name, Node, Num, Unary

__all__ = ["READERS", "emit", "function"]

#: Array dtype -> the user_mod.cuh function that reads one element.
READERS = {
    "float16": "read_f16", "bfloat16": "read_bf16", "float32": "read_f32", "float64": "read_f64",
    "int8": "read_int<signed char>", "int16": "read_int<short>", "int32": "read_int<int>",
    "int64": "read_int<long long>", "uint8": "read_int<unsigned char>", "bool": "read_bool",
}

_U = "cuflash::user::"
_CAST = {"float": "float", "int": "long long", "bool": "bool"}


def _float_literal(value: float) -> str:
    if math.isinf(value):
        return "CUFLASH_INF"
    text = repr(float(value))
    if "e" not in text and "." not in text:
        text += ".0"
    return text + "f"


def emit(node: Node, types, slots: dict) -> str:
    """C++ text of ``node``. ``types``: a function giving a sub-expression's type
    (:func:`cuflash.modifiers.check.check` of it); ``slots``: argument name -> (is_array, slot,
    dtype name for an array or value type for a scalar)."""

    def as_type(n: Node, t: str) -> str:
        text = walk(n)
        return text if types(n) == t else f"(({_CAST[t]})({text}))"

    def walk(n: Node) -> str:
        if isinstance(n, Num):
            return _float_literal(n.value) if isinstance(n.value, float) else f"{n.value}ll"
        if isinstance(n, Name):
            if n.id in VARIABLE_TYPES:   # the generated function's parameters have these names
                return n.id
            _, slot, kind = slots[n.id]
            if kind == "float":
                return f"args.f[{slot}]"
            return f"args.i[{slot}]" if kind == "int" else f"(args.i[{slot}] != 0)"
        if isinstance(n, Index):
            _, slot, dtype = slots[n.array]
            return f"{_U}{READERS[dtype]}(args, {slot}, {as_type(n.index, 'int')})"
        if isinstance(n, Unary):
            return f"({n.op}{walk(n.operand)})"
        if isinstance(n, Binary):
            if n.op == "/":
                return f"({as_type(n.left, 'float')} / {as_type(n.right, 'float')})"
            if n.op == "%":
                return f"{_U}floor_mod({walk(n.left)}, {walk(n.right)})"
            if n.op in ("+", "-", "*", "<", "<=", ">", ">=", "==", "!=") and "float" in (types(n.left), types(n.right)):
                return f"({as_type(n.left, 'float')} {n.op} {as_type(n.right, 'float')})"
            return f"({walk(n.left)} {n.op} {walk(n.right)})"
        t, args = types(n), n.args
        if n.function == "where":
            return f"({walk(args[0])} ? {as_type(args[1], t)} : {as_type(args[2], t)})"
        if n.function == "floor_div":
            return f"{_U}floor_div({walk(args[0])}, {walk(args[1])})"
        if n.function in ("min", "max"):
            helper = ("nan_" if t == "float" else "int_") + n.function
            return f"{_U}{helper}({as_type(args[0], t)}, {as_type(args[1], t)})"
        if n.function == "abs":
            return f"fabsf({walk(args[0])})" if t == "float" else f"{_U}int_abs({walk(args[0])})"
        return f"{n.function}f({as_type(args[0], 'float')})"   # tanhf, expf, logf, sqrtf

    return walk(node)


def function(name: str, node: Node, result: str, types, slots: dict, with_score: bool = True) -> str:
    """A ``__device__`` function ``name`` returning ``node`` as ``result`` (``"float"`` or ``"bool"``)
    of (score, b, h, q_idx, kv_idx, args); a mask function (``with_score=False``) takes no score."""
    score = "float score, " if with_score else ""
    body = emit(node, types, slots)
    if types(node) != result:
        body = f"(({_CAST[result]})({body}))"
    return (f"__device__ __forceinline__ {_CAST[result]} {name}({score}long long b, long long h, long long q_idx, "
            f"long long kv_idx, const {_U}Args& args) {{\n    return {body};\n}}\n")
