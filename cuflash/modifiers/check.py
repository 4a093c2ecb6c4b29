"""Types of a modifier's expression, checked before anything is compiled.

Three types: ``float`` (the score, float arrays and literals with a point or an exponent; float32 in
the kernels, float64 in the reference), ``int`` (``b``, ``h``, ``q_idx``, ``kv_idx``, integer arrays
and literals; 64-bit in both) and ``bool`` (comparisons, bool arrays). Numbers mix as in C (an int
meeting a float becomes a float); a bool never turns into a number or back, so ``where(c, a, b)``
is how a condition picks a value. ``/`` always divides as floats; integer division is
``floor_div(a, b)`` and ``%`` takes ints, both rounding toward minus infinity like Python (and a
zero divisor gives 0 in both backends).
"""

from __future__ import annotations

from cuflash.modifiers.parse import FUNCTIONS, VARIABLES, Binary, Call, Index, Name, Node, Num, Unary, unparse

__all__ = ["ArgKind", "check", "VARIABLE_TYPES"]

VARIABLE_TYPES = {"score": "float", "b": "int", "h": "int", "q_idx": "int", "kv_idx": "int"}
assert set(VARIABLE_TYPES) == set(VARIABLES)


class ArgKind:
    """What a named argument is, as far as the expression's types and the kernels' code go:
    ``array`` (True for an array, indexed flat) and ``type`` (its values' type)."""

    __slots__ = ("array", "type")

    def __init__(self, array: bool, type_: str):
        self.array, self.type = array, type_

    def __repr__(self):
        return f"ArgKind(array={self.array}, type={self.type!r})"


def _numeric(t: str) -> bool:
    return t in ("int", "float")


def check(node: Node, args: dict, what: str) -> str:
    """The type of ``node`` (``"float"``, ``"int"`` or ``"bool"``), or ValueError naming the first
    sub-expression that breaks the rules. ``args``: argument name -> :class:`ArgKind`."""

    def fail(message, at):
        return ValueError(f"{what}: {message} in {unparse(at)}")

    def walk(n: Node) -> str:
        if isinstance(n, Num):
            return "float" if isinstance(n.value, float) else "int"
        if isinstance(n, Name):
            if n.id in VARIABLE_TYPES:
                return VARIABLE_TYPES[n.id]
            kind = args.get(n.id)
            if kind is None:
                names = ", ".join(list(VARIABLES) + sorted(args)) or "none"
                raise fail(f"unknown name {n.id!r} (the names are {names})", n)
            if kind.array:
                raise fail(f"{n.id} is an array: index it, as {n.id}[...]", n)
            return kind.type
        if isinstance(n, Index):
            kind = args.get(n.array)
            if kind is None:
                raise fail(f"unknown array {n.array!r}", n)
            if not kind.array:
                raise fail(f"{n.array} is a scalar and cannot be indexed", n)
            if walk(n.index) != "int":
                raise fail(f"the index of {n.array} must be an int", n)
            return kind.type
        if isinstance(n, Unary):
            t = walk(n.operand)
            if n.op == "!":
                if t != "bool":
                    raise fail("! takes a bool", n)
                return "bool"
            if not _numeric(t):
                raise fail(f"unary {n.op} takes a number", n)
            return t
        if isinstance(n, Binary):
            a, b = walk(n.left), walk(n.right)
            if n.op in ("&&", "||"):
                if a != "bool" or b != "bool":
                    raise fail(f"{n.op} takes bools", n)
                return "bool"
            if n.op in ("==", "!="):
                if (a == "bool") != (b == "bool"):
                    raise fail(f"{n.op} compares a bool with a number", n)
                return "bool"
            if not (_numeric(a) and _numeric(b)):
                raise fail(f"{n.op} takes numbers", n)
            if n.op in ("<", "<=", ">", ">="):
                return "bool"
            if n.op == "/":
                return "float"
            if n.op == "%":
                if a != "int" or b != "int":
                    raise fail("% takes ints (floor_div and % round toward minus infinity)", n)
                return "int"
            return "float" if "float" in (a, b) else "int"
        assert isinstance(n, Call) and len(n.args) == FUNCTIONS[n.function]
        types = [walk(a) for a in n.args]
        if n.function == "where":
            if types[0] != "bool":
                raise fail("where's condition must be a bool", n)
            if (types[1] == "bool") != (types[2] == "bool"):
                raise fail("where picks between two bools or two numbers", n)
            return "bool" if types[1] == "bool" else ("float" if "float" in types[1:] else "int")
        if not all(_numeric(t) for t in types):
            raise fail(f"{n.function} takes numbers", n)
        if n.function == "floor_div":
            if types != ["int", "int"]:
                raise fail("floor_div takes ints", n)
            return "int"
        if n.function in ("min", "max"):
            return "float" if "float" in types else "int"
        if n.function == "abs":
            return types[0]
        return "float"   # tanh, exp, log, sqrt

    return walk(node)
