"""The grammar of a user-written modifier: tokens, the syntax tree, and the parser.

An expression is one line over ``score``, ``b``, ``h``, ``q_idx``, ``kv_idx``, the modifier's named
arguments (``name`` for a scalar, ``name[index]`` for an array, indexed flat), number literals, the
operators ``+ - * / % < <= > >= == != && || !``, parentheses and the functions of :data:`FUNCTIONS`.
Nothing else parses: no attribute access, no assignment, no casts, no other names. Precedence is
C's (``!`` and unary minus, then ``* / %``, ``+ -``, comparisons, ``== !=``, ``&&``, ``||``), and a
chained comparison (``a < b < c``, which C and Python read differently) is refused.

The tree is made of small immutable nodes (:class:`Num`, :class:`Name`, :class:`Index`,
:class:`Unary`, :class:`Binary`, :class:`Call`); :func:`unparse` writes one back in a canonical
form (fully parenthesised), which is what the kernels' cache key hashes.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Union

__all__ = ["FUNCTIONS", "VARIABLES", "Num", "Name", "Index", "Unary", "Binary", "Call", "Node", "parse", "unparse", "variables"]

#: The positions an expression reads: the score (after ``scale``), the batch, the query head, and the
#: query's and key's positions in their sequence.
VARIABLES = ("score", "b", "h", "q_idx", "kv_idx")

#: Function name -> number of arguments.
FUNCTIONS = {"tanh": 1, "exp": 1, "log": 1, "sqrt": 1, "abs": 1, "min": 2, "max": 2, "where": 3, "floor_div": 2}


class Num(NamedTuple):
    value: Union[int, float]


class Name(NamedTuple):
    id: str


class Index(NamedTuple):
    array: str
    index: "Node"


class Unary(NamedTuple):
    op: str          # "-", "+", "!"
    operand: "Node"


class Binary(NamedTuple):
    op: str          # "+", "-", "*", "/", "%", "<", "<=", ">", ">=", "==", "!=", "&&", "||"
    left: "Node"
    right: "Node"


class Call(NamedTuple):
    function: str
    args: tuple


Node = Union[Num, Name, Index, Unary, Binary, Call]

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<number>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)
  | (?P<name>[A-Za-z_][A-Za-z_0-9]*)
  | (?P<op>&&|\|\||<=|>=|==|!=|[-+*/%<>!()\[\],])
""", re.VERBOSE)

# Binary operators by precedence level, lowest first.
_LEVELS = (("||",), ("&&",), ("==", "!="), ("<", "<=", ">", ">="), ("+", "-"), ("*", "/", "%"))
_COMPARISONS = {"==", "!=", "<", "<=", ">", ">="}

# Limits that keep a pathological expression from costing NVRTC (or Python's recursion) much.
MAX_LENGTH = 2000
MAX_DEPTH = 64


def _tokens(text: str, what: str):
    """(kind, text, position) of every token; ValueError naming the first character that is none."""
    tokens, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"{what}: unexpected character {text[pos]!r} at position {pos} of {text!r}")
        kind = match.lastgroup
        if kind != "space":
            tokens.append((kind, match.group(), pos))
        pos = match.end()
    tokens.append(("end", "", len(text)))
    return tokens


class _Parser:
    def __init__(self, text: str, what: str):
        self.text, self.what = text, what
        self.tokens = _tokens(text, what)
        self.at = 0
        self.depth = 0

    def error(self, message: str, token=None):
        kind, text, pos = token or self.tokens[self.at]
        shown = "the end" if kind == "end" else repr(text)
        return ValueError(f"{self.what}: {message} at {shown} (position {pos} of {self.text!r})")

    def peek(self):
        return self.tokens[self.at]

    def take(self, text=None):
        token = self.tokens[self.at]
        if text is not None and token[1] != text:
            raise self.error(f"expected {text!r}")
        self.at += 1
        return token

    def expression(self, level=0) -> Node:
        if level == len(_LEVELS):
            return self.unary()
        left = self.expression(level + 1)
        while self.peek()[0] == "op" and self.peek()[1] in _LEVELS[level]:
            token = self.take()
            right = self.expression(level + 1)
            if token[1] in _COMPARISONS and self.peek()[1] in _LEVELS[level]:
                raise self.error("a chained comparison reads differently in C and Python; use && between two")
            left = Binary(token[1], left, right)
        return left

    def unary(self) -> Node:
        token = self.peek()
        if token[0] == "op" and token[1] in ("-", "+", "!"):
            self.take()
            self.enter()
            node = Unary(token[1], self.unary())
            self.depth -= 1
            return node
        return self.postfix()

    def enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(f"the expression nests deeper than {MAX_DEPTH} levels")

    def postfix(self) -> Node:
        node = self.primary()
        if self.peek()[1] == "[":
            bracket = self.take()
            if not isinstance(node, Name) or node.id in VARIABLES:
                raise self.error("only a named array argument can be indexed", bracket)
            self.enter()
            index = self.expression()
            self.depth -= 1
            self.take("]")
            node = Index(node.id, index)
        return node

    def primary(self) -> Node:
        kind, text, pos = token = self.take()
        if kind == "number":
            if any(c in text for c in ".eE"):
                return Num(float(text))
            if int(text) >= 2**63:
                raise self.error("an int literal must fit in int64", token)
            return Num(int(text))
        if kind == "name":
            if text in FUNCTIONS:
                self.take("(")
                self.enter()
                args = [self.expression()]
                while self.peek()[1] == ",":
                    self.take()
                    args.append(self.expression())
                self.depth -= 1
                self.take(")")
                if len(args) != FUNCTIONS[text]:
                    raise self.error(f"{text} takes {FUNCTIONS[text]} argument(s), got {len(args)}", token)
                return Call(text, tuple(args))
            if self.peek()[1] == "(":
                raise self.error(f"unknown function {text!r} (the functions are {', '.join(FUNCTIONS)})", token)
            return Name(text)
        if text == "(":
            self.enter()
            node = self.expression()
            self.depth -= 1
            self.take(")")
            return node
        raise self.error("expected a number, a name, a function call or '('", token)


def parse(text: str, what: str = "expression") -> Node:
    """The syntax tree of ``text``.

    Parameters
    ----------
    text : str
        One expression of the grammar above.
    what : str
        What the text is, for error messages (``"score_mod"``, ``"mask_mod"``, ``"grad"``).

    Returns
    -------
    Node

    Raises
    ------
    TypeError
        If ``text`` is not a str.
    ValueError
        If it does not parse: the message names the offending token and its position.

    Examples
    --------
    >>> parse("score + bias[h * 64 + q_idx - kv_idx]")
    Binary(op='+', left=Name(id='score'), right=Index(array='bias', index=...))
    """
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, got {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise ValueError(f"{what} is {len(text)} characters long; at most {MAX_LENGTH}")
    parser = _Parser(text, what)
    if parser.peek()[0] == "end":
        raise ValueError(f"{what} is empty")
    node = parser.expression()
    if parser.peek()[0] != "end":
        raise parser.error("unexpected token")
    return node


def unparse(node: Node) -> str:
    """The canonical text of a tree: every operation parenthesised, numbers in repr form."""
    if isinstance(node, Num):
        return repr(node.value)
    if isinstance(node, Name):
        return node.id
    if isinstance(node, Index):
        return f"{node.array}[{unparse(node.index)}]"
    if isinstance(node, Unary):
        return f"({node.op}{unparse(node.operand)})"
    if isinstance(node, Binary):
        return f"({unparse(node.left)} {node.op} {unparse(node.right)})"
    return f"{node.function}({', '.join(unparse(a) for a in node.args)})"


def variables(node: Node) -> frozenset:
    """The variables of :data:`VARIABLES` that ``node`` reads (array names and scalar arguments are
    not among them; an index expression's variables are)."""
    if isinstance(node, Num):
        return frozenset()
    if isinstance(node, Name):
        return frozenset((node.id,)) if node.id in VARIABLES else frozenset()
    if isinstance(node, Index):
        return variables(node.index)
    if isinstance(node, Unary):
        return variables(node.operand)
    if isinstance(node, Binary):
        return variables(node.left) | variables(node.right)
    return frozenset().union(*(variables(a) for a in node.args))
