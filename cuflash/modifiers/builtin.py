"""A modifier that states a built-in option runs as that option.

The kernels run the softcap, ALiBi and the window on paths of their own: the softcap's tanh from
``ex2`` on the forward's plain loop, causal ALiBi as column biases, the window's hidden tiles never
visited. A user's expression runs on the general path: evaluated element by element, ``tanh`` as
``tanhf``, no tile skipped unless a block mask is derived. So when a modifier is made, its syntax
tree is read for what a built-in option says, and each call moves that part into the option and
keeps the rest (if any) as a smaller modifier of the same arguments:

- a ScoreMod that is a sum of terms, exactly one of them reading ``score``: that term ``score``
  or ``c * tanh(score / c)`` (the softcap |c|; c a number or scalar argument, the same value in
  both places, either order of the product), and among the others one ALiBi term, ``- s[h] *
  abs(q_idx - kv_idx)`` (or ``kv_idx - q_idx`` inside ``abs``, either order of the product) or
  ``s[h] * (kv_idx - q_idx)`` (equal to it where no visible key lies right of its query's
  diagonal), with ``s`` a float32 array argument of Hq elements;
- a MaskMod that is a conjunction (``&&``) of terms, those comparing two integer expressions
  linear in ``q_idx`` and ``kv_idx`` whose difference is ``±(q_idx - kv_idx)`` plus a constant
  bounding ``q_idx - kv_idx`` from below and above: ``kv_idx <= q_idx`` is the causal mask, ``q_idx
  - kv_idx < w`` a window of w - 1 keys to the left.

What a call may move depends on the call, so :func:`lowered` decides it at each call (a few
comparisons; the analysis is done once, when the modifier is made):

- the softcap only where the call has none, no ALiBi and no bias: they come before a ScoreMod in
  the score pipeline (docs/design.md), after the softcap;
- ALiBi and the window only where the modifier's positions are the built-ins' (a query's diagonal
  at ``q_idx == kv_idx``): ``attention`` with as many queries as keys, varlen with ``cu_seqlens_q``
  the same array as ``cu_seqlens_k``, and decode (whose ``q_idx`` is absolute in the sequence);
  ALiBi also needs the call to have none of its own, and the window must be a band that holds the
  diagonal (``window=(left, right)`` has both >= 0: ``kv_idx < q_idx`` stays a MaskMod);
- in a backward, nothing of a ScoreMod that lacks the ``grad`` it needs (the error stays the
  error); a ``grad`` that is given must equal the built-in's derivative on a sweep of scores, else
  nothing of the ScoreMod moves (the user's gradient wins).

The float64 reference evaluates the user's expression as written, so every test of a moved call
compares the built-in kernels with the expression (tests/cpu/test_modifiers_builtin.py checks the
moves themselves against the reference, tests/gpu/test_modifiers_builtin.py that the calls run the
built-in kernels bit for bit). Measured: docs/decisions.md#modifiers-built-in-options-written-as-modifiers.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple, Optional

import numpy as np

from cuflash.modifiers.derivative import reads_score
from cuflash.modifiers.numpy_eval import evaluate
from cuflash.modifiers.parse import Binary, Call, Index, Name, Node, Num, Unary, unparse, variables

__all__ = ["ScoreParts", "MaskParts", "as_written", "score_parts", "mask_parts", "states_builtin", "lowered",
           "axis_len", "bshd_facts"]

_FLOAT32_TINY, _FLOAT32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
_INT32_MAX = 2**31 - 1
_COMPARISONS = {"<", "<=", ">", ">=", "=="}
_FLIPPED = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "=="}
_SCORE = Name("score")
_AS_WRITTEN = contextvars.ContextVar("cuflash_modifiers_as_written", default=False)


@contextlib.contextmanager
def as_written():
    """Inside it, this thread's calls run their modifiers as written: nothing moves into a built-in option.

    For tests of an expression's own path through the kernels, and for measuring what the move
    gains. Only the calls made in this thread: torch's autograd runs a backward in a thread of its
    own, where modifiers move as usual (the same attention either way).

    Yields
    ------
    None

    Examples
    --------
    >>> with cuflash.modifiers.as_written():
    ...     out = cuflash.attention(q, k, v, score_mod=cuflash.ScoreMod("c * tanh(score / c)", c=30.0))
    """
    token = _AS_WRITTEN.set(True)
    try:
        yield
    finally:
        _AS_WRITTEN.reset(token)


class ScoreParts(NamedTuple):
    """What a ScoreMod says of the softcap and ALiBi, and what is left of it."""

    softcap: float                  # |c| of c * tanh(score / c); 0.0 for a plain score
    slopes: Optional[str]           # the ALiBi term's array argument, or None
    signed: bool                    # its distance is kv_idx - q_idx (right only where no visible key lies right)
    rest: Optional[object]          # ScoreMod of the other terms (score + ...) with ALiBi built in; None: nothing
    rest_with_alibi: Optional[object]   # the same with the ALiBi term kept, where the call cannot take it (softcap only)


class MaskParts(NamedTuple):
    """The bounds a MaskMod puts on q_idx - kv_idx (None: unbounded), and what is left of it."""

    lo: Optional[int]
    hi: Optional[int]
    rest: Optional[object]          # MaskMod of the other conjuncts; None: nothing


# ----------------------------------------------------------------------------- analysis, once a modifier

def score_parts(mod) -> Optional[ScoreParts]:
    """The built-in options a ScoreMod states (module docstring), or None where it states none."""
    terms = _signed_terms(mod.expr, 1)
    with_score = [(sign, node) for sign, node in terms if reads_score(node)]
    if len(with_score) != 1 or with_score[0][0] != 1:
        return None
    node = with_score[0][1]
    softcap = 0.0 if node == _SCORE else _softcap_of(node, mod.args)
    if softcap is None:
        return None
    others = [(sign, node) for sign, node in terms if not reads_score(node)]
    alibi = next(((i, found) for i, (sign, node) in enumerate(others)
                  if (found := _alibi_of(sign, node, mod.args)) is not None), None)
    if softcap == 0.0 and alibi is None:
        return None
    if mod.grad is not None and not _grad_agrees(mod.grad, softcap, mod.args):
        return None
    if alibi is None:
        rest = _score_mod_of(mod, others)
        return ScoreParts(softcap, None, False, rest, rest)
    at, (slopes, signed) = alibi
    # Without the softcap, a call that cannot take ALiBi moves nothing: no rest with it (it would be mod again).
    rest_with_alibi = _score_mod_of(mod, others) if softcap else None
    return ScoreParts(softcap, slopes, signed, _score_mod_of(mod, others[:at] + others[at + 1:]), rest_with_alibi)


def mask_parts(mod) -> Optional[MaskParts]:
    """The window a MaskMod states (module docstring), or None where it states none the option can hold."""
    lo = hi = None
    others = []
    for node in _conjuncts(mod.expr):
        bound = _bound_of(node, mod.args)
        if bound is None:
            others.append(node)
            continue
        low, high = bound
        lo = low if lo is None else (lo if low is None else max(lo, low))
        hi = high if hi is None else (hi if high is None else min(hi, high))
    if lo is None and hi is None:
        return None
    if (lo is not None and lo > 0) or (hi is not None and hi < 0):   # no window=(left, right) holds it
        return None
    rest = None
    if others:
        node = others[0]
        for other in others[1:]:
            node = Binary("&&", node, other)
        rest = type(mod)(unparse(node), sparse=mod.sparse, **mod.args.values)
    return MaskParts(lo, hi, rest)


def _signed_terms(node: Node, sign: int) -> list:
    """``node`` as a sum of (sign, term) pairs, through + and - and unary signs."""
    if isinstance(node, Binary) and node.op in ("+", "-"):
        return _signed_terms(node.left, sign) + _signed_terms(node.right, sign if node.op == "+" else -sign)
    if isinstance(node, Unary) and node.op in ("+", "-"):
        return _signed_terms(node.operand, sign if node.op == "+" else -sign)
    return [(sign, node)]


def _constant(node: Node, args):
    """The value of a number or of a scalar argument (not a bool), or None."""
    if isinstance(node, Num):
        return node.value
    if isinstance(node, Unary) and node.op in ("+", "-"):
        value = _constant(node.operand, args)
        return value if value is None or node.op == "+" else -value
    if isinstance(node, Name) and node.id in args.kinds:
        kind = args.kinds[node.id]
        if not kind.array and kind.type in ("int", "float"):
            return args.values[node.id]
    return None


def _softcap_of(node: Node, args) -> Optional[float]:
    """|c| where ``node`` is c * tanh(score / c) (the product either way round), else None."""
    if not (isinstance(node, Binary) and node.op == "*"):
        return None
    for outer, inner in ((node.left, node.right), (node.right, node.left)):
        if not (isinstance(inner, Call) and inner.function == "tanh"):
            continue
        quotient = inner.args[0]
        if not (isinstance(quotient, Binary) and quotient.op == "/" and quotient.left == _SCORE):
            continue
        c, divisor = _constant(outer, args), _constant(quotient.right, args)
        if c is None or divisor is None or float(c) != float(divisor):
            continue
        c = abs(float(c))   # c tanh(s / c) is odd in c
        if _FLOAT32_TINY <= c <= _FLOAT32_MAX:   # the softcap option's range (cuflash._checks.check_softcap)
            return c
    return None


def _alibi_of(sign: int, node: Node, args):
    """(slopes, signed) where ``sign * node`` is ALiBi's term, else None."""
    if not (isinstance(node, Binary) and node.op == "*"):
        return None
    for slope, distance in ((node.left, node.right), (node.right, node.left)):
        if not (isinstance(slope, Index) and slope.index == Name("h")):
            continue
        kind = args.kinds.get(slope.array)
        if kind is None or not kind.array or args.slots[slope.array][2] != "float32":
            continue
        if isinstance(distance, Call) and distance.function == "abs":
            if sign == -1 and _linear(distance.args[0], args) in ((1, -1, 0), (-1, 1, 0)):
                return slope.array, False
            continue
        form = _linear(distance, args)
        if (sign, form) in ((-1, (1, -1, 0)), (1, (-1, 1, 0))):
            return slope.array, True
    return None


def _linear(node: Node, args):
    """(a, b, c) with ``node`` = a q_idx + b kv_idx + c over ints, or None (anything else)."""
    if isinstance(node, Name) and node.id in ("q_idx", "kv_idx"):
        return (1, 0, 0) if node.id == "q_idx" else (0, 1, 0)
    if isinstance(node, (Num, Name)):
        value = _constant(node, args)
        ints = (int, np.integer)
        return (0, 0, int(value)) if isinstance(value, ints) and not isinstance(value, bool) else None
    if isinstance(node, Unary) and node.op in ("+", "-"):
        inner = _linear(node.operand, args)
        if inner is None:
            return None
        return inner if node.op == "+" else tuple(-x for x in inner)
    if isinstance(node, Binary) and node.op in ("+", "-", "*"):
        left, right = _linear(node.left, args), _linear(node.right, args)
        if left is None or right is None:
            return None
        if node.op == "+":
            return tuple(x + y for x, y in zip(left, right))
        if node.op == "-":
            return tuple(x - y for x, y in zip(left, right))
        if left[:2] == (0, 0):
            return tuple(left[2] * y for y in right)
        if right[:2] == (0, 0):
            return tuple(right[2] * x for x in left)
    return None


def _conjuncts(node: Node) -> list:
    if isinstance(node, Binary) and node.op == "&&":
        return _conjuncts(node.left) + _conjuncts(node.right)
    return [node]


def _bound_of(node: Node, args):
    """(lo, hi) where ``node`` bounds d = q_idx - kv_idx as lo <= d <= hi (either may be None), else None."""
    if not (isinstance(node, Binary) and node.op in _COMPARISONS):
        return None
    left, right = _linear(node.left, args), _linear(node.right, args)
    if left is None or right is None:
        return None
    a, b, c = (x - y for x, y in zip(left, right))   # a q_idx + b kv_idx + c  <op>  0
    op = node.op
    if (a, b) == (-1, 1):
        a, b, c, op = 1, -1, -c, _FLIPPED[op]
    if (a, b) != (1, -1) or abs(c) > _INT32_MAX:   # the window's sizes are int32 in the kernels
        return None
    # d + c <op> 0
    return {"<=": (None, -c), "<": (None, -c - 1), ">=": (-c, None), ">": (-c + 1, None), "==": (-c, -c)}[op]


def _grad_agrees(grad: Node, softcap: float, args) -> bool:
    """Whether a given ``grad`` is the built-in's derivative, 1 - tanh(s / c)^2 (or 1), on a sweep of
    scores (it must read nothing but the score and scalars)."""
    if variables(grad) - {"score"} or _reads_arrays(grad):
        return False
    reach = 8.0 * softcap if softcap else 100.0
    score = np.concatenate([np.linspace(-reach, reach, 161), [-1e4, -1.0, -1e-3, 0.0, 1e-3, 1.0, 1e4]])
    env = {name: value for name, value in args.values.items() if not args.kinds[name].array}
    env["score"] = score
    want = 1.0 - np.tanh(score / softcap) ** 2 if softcap else np.ones_like(score)
    got = np.broadcast_to(np.asarray(evaluate(grad, env), dtype=np.float64), score.shape)
    return bool(np.allclose(got, want, rtol=1e-9, atol=1e-12))


def _reads_arrays(node: Node) -> bool:
    if isinstance(node, Index):
        return True
    if isinstance(node, Unary):
        return _reads_arrays(node.operand)
    if isinstance(node, Binary):
        return _reads_arrays(node.left) or _reads_arrays(node.right)
    if isinstance(node, Call):
        return any(_reads_arrays(a) for a in node.args)
    return False


def _score_mod_of(mod, terms):
    """A ScoreMod ``score`` plus ``terms``, with ``mod``'s arguments; None for no terms."""
    if not terms:
        return None
    node = _SCORE
    for sign, term in terms:
        node = Binary("+" if sign > 0 else "-", node, term)
    return type(mod)(unparse(node), **mod.args.values)


# ----------------------------------------------------------------------------- each call

def lowered(score_mod, mask_mod, causal, window, softcap, alibi_slopes, bias, heads_q, aligned, backward=False):
    """The call's (score_mod, mask_mod, window, softcap, alibi_slopes) with what its modifiers state
    of a built-in option moved into that option, where this call may take it (module docstring).

    ``heads_q``: the call's query heads (None if unknown); ``aligned``: whether the modifiers'
    positions are the built-ins' (a query's diagonal at q_idx == kv_idx). Anything that is not what
    it should be (a modifier of another type, a window that is not a pair of ints) moves nothing:
    the call's checks name it."""
    score, mask = getattr(score_mod, "_builtin", None), getattr(mask_mod, "_builtin", None)
    if type(score) is not ScoreParts:   # None, or a MaskMod given as score_mod (modifier_parts names it)
        score = None
    if type(mask) is not MaskParts:
        mask = None
    if (score is None and mask is None) or _AS_WRITTEN.get():
        return score_mod, mask_mod, window, softcap, alibi_slopes
    if mask is not None and aligned:
        joined = _joined_window(window, mask)
        if joined is not None:
            window, mask_mod = joined, _rest_for(mask.rest, mask_mod, "rest")
    no_softcap = (isinstance(softcap, (int, float, np.integer, np.floating)) and not isinstance(softcap, bool)
                  and softcap == 0)
    if score is None or not no_softcap or alibi_slopes is not None:
        return score_mod, mask_mod, window, softcap, alibi_slopes
    if (score.softcap and bias is not None) or (backward and score_mod.needs_grad):
        return score_mod, mask_mod, window, softcap, alibi_slopes
    slopes = score_mod.args.values[score.slopes] if score.slopes is not None else None
    alibi = (slopes is not None and aligned and heads_q is not None
             and tuple(getattr(slopes, "shape", ())) == (heads_q,)
             and (not score.signed or causal is True or _right_edge(window) == 0))
    if not alibi and not score.softcap:
        return score_mod, mask_mod, window, softcap, alibi_slopes
    if alibi:
        return _rest_for(score.rest, score_mod, "rest"), mask_mod, window, score.softcap, slopes
    return _rest_for(score.rest_with_alibi, score_mod, "rest_with_alibi"), mask_mod, window, score.softcap, None


def states_builtin(score_mod, mask_mod) -> bool:
    """Whether either modifier states a built-in option (then :func:`lowered` has something to decide):
    the entry points ask this first, so that a call whose modifiers state none pays two attribute
    reads."""
    return getattr(score_mod, "_builtin", None) is not None or getattr(mask_mod, "_builtin", None) is not None


def _joined_window(window, mask: MaskParts):
    """``window`` narrowed to the MaskMod's bounds, or None where ``window`` is not a valid pair."""
    if window is None:
        left = right = -1
    elif (isinstance(window, (tuple, list)) and len(window) == 2
          and all(type(x) is int and -1 <= x <= _INT32_MAX for x in window)):
        left, right = window
    else:
        return None
    if mask.hi is not None:
        left = mask.hi if left == -1 else min(left, mask.hi)
    if mask.lo is not None:
        right = -mask.lo if right == -1 else min(right, -mask.lo)
    return left, right


def _right_edge(window):
    if isinstance(window, (tuple, list)) and len(window) == 2 and type(window[1]) is int:
        return window[1]
    return None


def _rest_for(template, mod, which: str):
    """``template`` (a rest made from the modifier's arguments when it was made) around ``mod``'s
    arrays: the template itself for the modifier it was made from, else its :meth:`with_arrays`
    around ``mod``'s (an adapter's view of other buffers), remembered on ``mod``."""
    if template is None or not template.array_names:
        return template
    owns = mod.__dict__.get("_owns_arrays", True)
    if owns and all(template.args.values[n] is mod.args.values[n] for n in template.array_names):
        return template
    found = mod.__dict__.setdefault("_rests", {})
    rest = found.get(which)
    if rest is None:
        rest = found[which] = template.with_arrays({n: mod.args.values[n] for n in template.array_names})
        if owns:   # the caller's own arrays (cuflash.modifiers.spec.rebuild), not views of reused buffers
            rest.__dict__.pop("_owns_arrays", None)
    return rest


def axis_len(x, axis: int):
    """``x.shape[axis]``, or None where ``x`` is no array of that many axes (the call's checks say so)."""
    shape = getattr(x, "shape", None)
    return shape[axis] if shape is not None and len(shape) > axis else None


def bshd_facts(q, k) -> tuple:
    """(heads_q, aligned) of a call on (B, S, H, D) arrays: q's heads, and whether q and k have as many
    rows (None, False where either is no such array: the call's checks say so)."""
    q_shape, k_shape = getattr(q, "shape", None), getattr(k, "shape", None)
    if q_shape is None or k_shape is None or len(q_shape) != 4 or len(k_shape) != 4:
        return None, False
    return q_shape[2], q_shape[1] == k_shape[1]
