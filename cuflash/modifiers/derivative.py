"""d(expression)/d(score), symbolically, to know whether a score modifier needs a ``grad``.

The backward pass multiplies dS by the modifier's derivative with respect to the score. When that
derivative is exactly 1 (``score + bias[...]``, ``score - slope * abs(q_idx - kv_idx)``) nothing is
needed; otherwise the user gives it (``grad=``), and a missing one is an error whose message shows
the derivative written out here, ready to paste. The rules are the usual ones; only float-typed
sub-expressions can depend on the score (an int or bool never comes from a float), and constant
0s and 1s are folded so that "exactly 1" is recognised.
"""

from __future__ import annotations

from cuflash.modifiers.parse import Binary, Call, Index, Name, Node, Num, Unary

__all__ = ["d_score", "reads_score"]

_ZERO, _ONE = Num(0), Num(1)


def reads_score(node: Node) -> bool:
    """Whether the score appears in ``node``."""
    if isinstance(node, Name):
        return node.id == "score"
    if isinstance(node, Num):
        return False
    if isinstance(node, Index):
        return reads_score(node.index)
    if isinstance(node, Unary):
        return reads_score(node.operand)
    if isinstance(node, Binary):
        return reads_score(node.left) or reads_score(node.right)
    return any(reads_score(a) for a in node.args)


def _is(node, value) -> bool:
    return isinstance(node, Num) and node.value == value


def _neg(a):
    if _is(a, 0):
        return _ZERO
    if isinstance(a, Unary) and a.op == "-":
        return a.operand
    return Unary("-", a)


def _add(a, b):
    if _is(a, 0):
        return b
    if _is(b, 0):
        return a
    return Binary("+", a, b)


def _sub(a, b):
    if _is(b, 0):
        return a
    if _is(a, 0):
        return _neg(b)
    return Binary("-", a, b)


def _mul(a, b):
    if _is(a, 0) or _is(b, 0):
        return _ZERO
    if _is(a, 1):
        return b
    if _is(b, 1):
        return a
    return Binary("*", a, b)


def _div(a, b):
    if _is(a, 0):
        return _ZERO
    if _is(b, 1):
        return a
    return Binary("/", a, b)


def _where(c, a, b):
    if a == b:
        return a
    return Call("where", (c, a, b))


def d_score(node: Node) -> Node:
    """The derivative of ``node`` with respect to ``score`` (0s and 1s folded), for a well-typed
    numeric expression (:func:`cuflash.modifiers.check.check`)."""
    if not reads_score(node):
        return _ZERO
    if isinstance(node, Name):   # the score itself
        return _ONE
    if isinstance(node, Unary):
        d = d_score(node.operand)
        return _neg(d) if node.op == "-" else d
    if isinstance(node, Binary):
        a, b = node.left, node.right
        da, db = d_score(a), d_score(b)
        if node.op == "+":
            return _add(da, db)
        if node.op == "-":
            return _sub(da, db)
        if node.op == "*":
            return _add(_mul(da, b), _mul(a, db))
        if node.op == "/":
            if _is(db, 0):
                return _div(da, b)
            return _div(_sub(_mul(da, b), _mul(a, db)), Binary("*", b, b))
        return _ZERO   # comparisons and logic are bools, % is an int: no derivative
    if isinstance(node, Index):
        return _ZERO   # an array's value: piecewise constant in its (int) index
    f, args = node.function, node.args
    if f == "where":
        return _where(args[0], d_score(args[1]), d_score(args[2]))
    if f in ("min", "max"):
        first = Binary("<=" if f == "min" else ">=", args[0], args[1])
        return _where(first, d_score(args[0]), d_score(args[1]))
    if f == "floor_div":
        return _ZERO
    x, dx = args[0], d_score(args[0])
    if f == "abs":
        return _where(Binary(">=", x, Num(0)), dx, _neg(dx))
    if f == "tanh":
        return _mul(_sub(Num(1.0), Binary("*", node, node)), dx)
    if f == "exp":
        return _mul(node, dx)
    if f == "log":
        return _div(dx, x)
    assert f == "sqrt"
    return _div(dx, Binary("*", Num(2.0), node))
