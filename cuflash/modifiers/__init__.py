"""User-written score and mask modifiers: one expression, checked in Python, evaluated by NumPy for
the float64 reference and written as CUDA C++ for the kernels.

:class:`ScoreMod` changes each score (``score`` is ``scale * q.k`` after the built-in softcap,
ALiBi and bias); :class:`MaskMod` says which (query, key) pairs may attend. Both read the positions
``b``, ``h`` (query head), ``q_idx`` and ``kv_idx`` (positions in the sequence; for varlen, within
each sequence) and their named arguments: Python scalars, or arrays indexed flat with
``name[...]``. The grammar and its rules are in :mod:`cuflash.modifiers.parse` and
:mod:`cuflash.modifiers.check`; :mod:`cuflash.modifiers.derivative` decides whether a score
modifier needs a ``grad``.

:func:`cuflash.attention`, :func:`cuflash.attention_forward`, :func:`cuflash.attention_backward`,
:func:`cuflash.attention_varlen`, :func:`cuflash.attention_varlen_backward` and :func:`cuflash.decode`
take them as ``score_mod=`` and ``mask_mod=``, like the float64 reference (:mod:`cuflash.reference`).
Every forward and backward kernel family and decode compile the call's expressions into their variant
(:func:`kernel_source`, keyed by their hash); the arrays' addresses and the scalars' values are written
into the kernels' parameters at each call, so new values need no new kernel. In decode the positions
are absolute in each sequence: new token i has ``q_idx = i + T_b - Sq``.

A modifier that states a built-in option (the softcap or ALiBi as a ScoreMod, a causal mask or a
window as a MaskMod) runs as that option wherever the call allows, the rest of its expression as a
smaller modifier (:mod:`cuflash.modifiers.builtin`; :func:`as_written` turns it off).

:mod:`cuflash.interop.torch` (``attention``, ``attention_varlen``, ``decode`` and the functions of its
``ops``) takes them in eager mode, with torch tensors as arrays (gradients for q, k, v, not for the
arrays); not under ``torch.compile`` yet (an error naming them). :mod:`cuflash.interop.jax` takes them
inside ``jax.jit`` with JAX arrays as arrays (operands of its callbacks, the modifiers rebuilt around
XLA's buffers with :meth:`ScoreMod.with_arrays`; gradients for q, k, v, zeros for the arrays).
"""

from __future__ import annotations

import hashlib
import keyword
import numbers

import numpy as np

from cuflash.modifiers import cuda as _cuda
from cuflash.modifiers.builtin import as_written, mask_parts, score_parts
from cuflash.modifiers.check import ArgKind, check
from cuflash.modifiers.derivative import d_score, reads_score
from cuflash.modifiers.numpy_eval import evaluate, grids
from cuflash.modifiers.parse import FUNCTIONS, VARIABLES, Node, Num, parse, unparse, variables
from cuflash.modifiers.spec import spec_of

__all__ = ["ScoreMod", "MaskMod", "as_written", "kernel_source"]

_MAX_ARRAYS = 8    # cuda_src/user_mod.cuh kMaxArrays
_MAX_SCALARS = 8   # kMaxScalars

_ARRAY_TYPES = {"float16": "float", "bfloat16": "float", "float32": "float", "float64": "float",
                "int8": "int", "int16": "int", "int32": "int", "int64": "int", "uint8": "int", "bool": "bool"}


def _dtype_name(dtype) -> str:
    """NumPy's name of a NumPy, CuPy, ml_dtypes or torch dtype (``torch.float32`` -> ``float32``)."""
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).replace("torch.", "")


def _on_host(value) -> np.ndarray:
    """An array argument's values as a NumPy array: CuPy (``get``), any CUDA array through DLPack, a
    torch tensor on the CPU (bfloat16 widened: NumPy has none), or what NumPy reads itself."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "get") and hasattr(value, "data"):   # CuPy
        return value.get()
    device = getattr(value, "__dlpack_device__", None)
    if device is not None and device()[0] in (2, 3, 13):   # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
        import cupy

        return cupy.from_dlpack(value.detach() if hasattr(value, "detach") else value).get()
    if hasattr(value, "detach"):   # a torch tensor on the CPU
        value = value.detach()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    return np.asarray(value)


class _Arguments:
    """A modifier's named arguments: what each is (:class:`~cuflash.modifiers.check.ArgKind`), its
    slot in ``cuflash::user::Args``, and its value."""

    def __init__(self, values: dict, what: str):
        self.values, self.kinds, self.slots = {}, {}, {}
        arrays = scalars = 0
        for name, value in values.items():
            if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
                raise ValueError(f"{what}: argument name {name!r} is not a plain identifier")
            if name in VARIABLES or name in FUNCTIONS:
                raise ValueError(f"{what}: argument name {name!r} is taken by the grammar "
                                 f"({', '.join(VARIABLES + tuple(FUNCTIONS))})")
            if isinstance(value, (bool, np.bool_)):
                kind, stored = ArgKind(False, "bool"), bool(value)
            elif isinstance(value, numbers.Integral):
                if not -2**63 <= int(value) < 2**63:
                    raise ValueError(f"{what}: argument {name}={value} does not fit in int64")
                kind, stored = ArgKind(False, "int"), np.int64(value)
            elif isinstance(value, numbers.Real):
                kind, stored = ArgKind(False, "float"), np.float64(value)
            elif hasattr(value, "dtype") and hasattr(value, "shape"):
                dtype = _dtype_name(value.dtype)
                if dtype not in _ARRAY_TYPES:
                    raise TypeError(f"{what}: argument array {name} has dtype {dtype}; the dtypes are "
                                    f"{', '.join(_ARRAY_TYPES)}")
                kind, stored = ArgKind(True, _ARRAY_TYPES[dtype]), value
            else:
                raise TypeError(f"{what}: argument {name} must be a bool, int, float or an array, got "
                                f"{type(value).__name__}")
            if kind.array:
                self.slots[name] = (True, arrays, dtype)
                arrays += 1
            else:
                self.slots[name] = (False, scalars, kind.type)
                scalars += 1
            self.kinds[name], self.values[name] = kind, stored
        if arrays > _MAX_ARRAYS or scalars > _MAX_SCALARS:
            raise ValueError(f"{what}: at most {_MAX_ARRAYS} array and {_MAX_SCALARS} scalar arguments, got "
                             f"{arrays} and {scalars}")

    def arrays(self) -> tuple:
        """The array arguments in slot order."""
        return tuple(self.values[name] for name in self.array_names())

    def array_names(self) -> tuple:
        """The names of the array arguments in slot order."""
        return tuple(name for name, (array, _, _) in sorted(self.slots.items(), key=lambda kv: kv[1][1]) if array)

    def replaced(self, arrays: dict) -> "_Arguments":
        """These arguments with some arrays swapped for others of the same dtypes (kinds and slots
        shared, nothing checked: :meth:`_Modifier.with_arrays` checks)."""
        new = object.__new__(_Arguments)
        new.kinds, new.slots, new.values = self.kinds, self.slots, {**self.values, **arrays}
        return new

    def scalars(self) -> tuple:
        """(slot, type, value) of each scalar argument: the kernels read the value at run time."""
        return tuple(sorted((slot, kind, self.values[name]) for name, (array, slot, kind) in self.slots.items()
                            if not array))

    def shifted(self, arrays: int, scalars: int) -> dict:
        """The slots moved past ``arrays`` array and ``scalars`` scalar slots (a MaskMod's arguments
        after a ScoreMod's in the kernels' one block)."""
        return {name: (array, slot + (arrays if array else scalars), kind)
                for name, (array, slot, kind) in self.slots.items()}

    def counts(self) -> tuple[int, int]:
        arrays = sum(1 for array, _, _ in self.slots.values() if array)
        return arrays, len(self.slots) - arrays

    def layout(self) -> tuple:
        """What the compiled code depends on: each argument's name, slot and dtype or type (not the
        scalars' values, which the kernels read at run time)."""
        return tuple(sorted((name, slot) for name, slot in self.slots.items()))

    def host(self) -> dict:
        """The reference's values: arrays flat on the host in float64, int64 or bool."""
        env = {}
        for name, value in self.values.items():
            if self.kinds[name].array:
                to = {"float": np.float64, "int": np.int64, "bool": np.bool_}[self.kinds[name].type]
                env[name] = _on_host(value).reshape(-1).astype(to)
            else:
                env[name] = value
        return env


class _Modifier:
    _what = "modifier"

    def _typer(self):
        cache = {}

        def types(node: Node) -> str:
            t = cache.get(id(node))
            if t is None:
                t = cache[id(node)] = check(node, self.args.kinds, self._what)
            return t
        return types

    @property
    def key(self) -> str:
        """A hash of what the compiled code depends on (the variant's cache key takes it)."""
        text = repr((type(self).__name__, self._canonical(), self.args.layout()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def call_parts(self) -> tuple:
        """(memo key, arrays) of a call: what its plan depends on besides the arrays' layouts (which
        the plan memo reads from the arrays themselves): :attr:`key` and the scalars' values (fields
        of the plan's parameters); and the array arguments in slot order. Computed once: a modifier
        is not changed after it is made."""
        parts = self.__dict__.get("_call_parts")
        if parts is None:
            parts = self._call_parts = ((self.key, tuple(value for _, _, value in self.args.scalars())),
                                        self.args.arrays())
        return parts

    def with_args(self, **values):
        """The same modifier with some named arguments given new values (same names; an array may
        come as another array type or dtype, e.g. a torch tensor detached from autograd)."""
        unknown = values.keys() - self.args.values.keys()
        if unknown:
            raise ValueError(f"{self._what} has no arguments {sorted(unknown)}")
        new = object.__new__(type(self))
        new.__dict__.update({k: v for k, v in self.__dict__.items()
                             if k not in ("_call_parts", "_owns_arrays", "_rests")})
        new.args = _Arguments({**self.args.values, **values}, self._what)
        check(self.expr, new.args.kinds, self._what)   # a new dtype may change the expression's types
        if getattr(self, "grad", None) is not None:
            check(self.grad, new.args.kinds, "grad")
        new._write_specs()
        return new

    def with_arrays(self, arrays: dict):
        """The same modifier around other arrays of the same dtypes: expression, grad, scalars and
        :attr:`key` kept, nothing parsed or typed again (a few dict operations, cheap enough for each
        call). For adapters that hand cuflash another object for the same data: inside ``jax.jit``,
        XLA's buffers viewed as CuPy arrays (:mod:`cuflash.interop.jax`).

        Parameters
        ----------
        arrays : dict
            A new array (any object with ``dtype`` and ``shape``; a CUDA array to run) for every array
            argument, by name.

        Raises
        ------
        ValueError
            ``arrays`` does not name exactly the modifier's array arguments.
        TypeError
            An array whose dtype is not the one it replaces (the compiled code depends on it; for a
            new dtype use :meth:`with_args`).
        """
        names = self.args.array_names()
        if arrays.keys() != set(names):
            raise ValueError(f"{self._what}.with_arrays needs exactly the array arguments {list(names)}, got "
                             f"{sorted(arrays)}")
        for name in names:
            want = _dtype_name(self.args.values[name].dtype)
            got = getattr(arrays[name], "dtype", None)
            if got is None or _dtype_name(got) != want:
                raise TypeError(f"{self._what} argument {name} must stay {want} in with_arrays, got "
                                f"{'no array' if got is None else _dtype_name(got)}")
        memo_key = self.call_parts()[0]
        new = object.__new__(type(self))
        new.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_rests"})   # rests around self's arrays
        new.args = self.args.replaced(arrays)
        new._call_parts = (memo_key, tuple(arrays[name] for name in names))
        if names:
            new._owns_arrays = False   # views: their memory may hold new data at the same address
        return new

    def _env(self, shape, score=None, b0=0, q0=0):
        env = grids(*shape, q_offset=q0, b_offset=b0)
        env.update(self.args.host())
        if score is not None:
            env["score"] = score
        return env


class ScoreMod(_Modifier):
    """A score modifier: one expression giving each (query, key) pair's new score.

    Passed as ``score_mod=`` to :func:`cuflash.attention` and the other entry points, it runs inside
    every kernel family after ``scale``, the softcap, ALiBi and ``bias``, and the float64 reference
    evaluates the same expression with NumPy. A softcap or ALiBi written as one (``c * tanh(score /
    c)``, ``score + s[h] * (kv_idx - q_idx)``, ...) runs as the built-in option wherever the call
    allows (:mod:`cuflash.modifiers.builtin`; :func:`cuflash.modifiers.as_written` turns it off).

    Parameters
    ----------
    expr : str
        One expression of the grammar (:mod:`cuflash.modifiers.parse`) over ``score``, ``b``, ``h``,
        ``q_idx``, ``kv_idx`` and the named arguments; a number (an int becomes a float).
    grad : str, optional
        d(expr)/d(score), an expression of the same grammar. Needed by the backward unless the
        derivative is exactly 1 (``score`` plus or minus terms without it); without it the backward
        raises, showing the derivative worked out symbolically.
    **args
        Named arguments: bools, ints, floats (read at run time), or arrays of float16, bfloat16,
        float32, float64, int8..int64, uint8 or bool (indexed flat; a read outside the array gives 0).

    Raises
    ------
    TypeError, ValueError
        A malformed expression (the offending token named), a type error in it, a bad argument.

    Examples
    --------
    >>> relative = ScoreMod("score + table[q_idx - kv_idx + 511]", table=cupy.zeros(1023, cupy.float32))
    >>> capped = ScoreMod("30.0 * tanh(score / 30.0)", grad="1.0 - tanh(score / 30.0) * tanh(score / 30.0)")
    """

    _what = "score_mod"

    def __init__(self, expr, grad=None, **args):
        self.args = _Arguments(args, "score_mod")
        self.expr = parse(expr, "score_mod")
        if check(self.expr, self.args.kinds, "score_mod") == "bool":
            raise ValueError(f"score_mod must give a number, and {expr!r} gives a bool (a MaskMod says which "
                             "pairs may attend)")
        self.derivative = d_score(self.expr)
        self.grad = None
        if grad is not None:
            self.grad = parse(grad, "grad")
            if check(self.grad, self.args.kinds, "grad") == "bool":
                raise ValueError(f"grad must give a number, and {grad!r} gives a bool")
        self.text, self.grad_text = expr, grad
        # The backward's complaint, written now: a traced call (torch.compile) reads it, computes nothing.
        self.missing_grad = None
        if self.needs_grad:
            self.missing_grad = (f"score_mod {expr!r} has a derivative with respect to score that is not 1, so the "
                                 f"backward needs it: pass grad=, e.g. grad={unparse(self.derivative)!r}")
        self._write_specs()

    def _write_specs(self):
        #: The modifier as one string (:mod:`cuflash.modifiers.spec`): how it crosses an op schema,
        #: beside its array arguments in slot order (these names).
        self.spec = spec_of(self)
        self.array_names = self.args.array_names()
        #: The softcap and ALiBi it states (:mod:`cuflash.modifiers.builtin`), which calls run built in.
        self._builtin = score_parts(self)

    def _canonical(self):
        return unparse(self.expr), None if self.grad is None else unparse(self.grad)

    @property
    def needs_grad(self) -> bool:
        """Whether the backward needs ``grad`` (the derivative is not exactly 1) and it is missing."""
        return self.grad is None and self.derivative != Num(1)

    def gradient(self) -> Node:
        """d(expr)/d(score) for the backward: ``grad``, or 1; ValueError if neither applies."""
        if self.grad is not None:
            return self.grad
        if self.derivative == Num(1):
            return self.derivative
        raise ValueError(self.missing_grad)

    def reference(self, score: np.ndarray, b0: int = 0, q0: int = 0) -> np.ndarray:
        """The modified scores, float64, for a (B, H, Sq, Sk) float64 array of scores (``b`` counts
        from ``b0``: a varlen sequence's index; ``q_idx`` from ``q0``: decode's new tokens sit at the
        end of their sequence)."""
        value = evaluate(self.expr, self._env(score.shape, score, b0, q0))
        return np.broadcast_to(np.asarray(value, dtype=np.float64), score.shape)

    def reference_gradient(self, score: np.ndarray, b0: int = 0, q0: int = 0) -> np.ndarray:
        """d(expr)/d(score) at each score, float64 (see :meth:`gradient`)."""
        value = evaluate(self.gradient(), self._env(score.shape, score, b0, q0))
        return np.broadcast_to(np.asarray(value, dtype=np.float64), score.shape)

    def cuda_source(self, name: str = "user_score_mod", backward: bool | None = None, slots=None) -> str:
        """The ``__device__`` functions of the modifier: ``name``, and ``name``_grad with a grad (or,
        ``backward=True``, always: :meth:`gradient`, which raises where one is needed and missing;
        ``backward=False``, never). ``slots``: the arguments' slots when not the modifier's own."""
        types = self._typer()
        slots = self.args.slots if slots is None else slots
        source = _cuda.function(name, self.expr, "float", types, slots)
        grad = self.gradient() if backward else (None if backward is False else self.grad)
        if grad is not None:
            source += _cuda.function(f"{name}_grad", grad, "float", types, slots)
        return source

    def __repr__(self):
        grad = "" if self.grad is None else f", grad={unparse(self.grad)!r}"
        return f"cuflash.ScoreMod({self.text!r}{grad}, args={sorted(self.args.values)})"


class MaskMod(_Modifier):
    """A mask written as one expression: True where query ``q_idx`` may attend to key ``kv_idx``.

    Passed as ``mask_mod=``; combined with the built-in masks (causal, window, ``mask``) by "and". Its
    terms (joined by ``&&``) that bound ``q_idx - kv_idx`` (``kv_idx <= q_idx``, ``q_idx - kv_idx <
    w``, ...) run as the built-in causal mask and window wherever the call allows
    (:mod:`cuflash.modifiers.builtin`).

    Parameters
    ----------
    expr : str
        One bool expression of the grammar over ``b``, ``h``, ``q_idx``, ``kv_idx`` and the named
        arguments (not ``score``: a mask that depends on the scores is a ScoreMod giving -inf).
    sparse : bool, default True
        Derive a block mask from the expression (evaluated on the GPU over every element of every
        64 x 64 block, once per call shape and arguments, then cached), so that the kernels never load
        the tiles it hides entirely (a document mask skips every tile between two documents, as varlen
        does); with it, every element's answer as a bit, which the kernels read instead of the
        expression when the MaskMod is the call's only modifier. The cache assumes that an array
        argument's contents do not change while its address does not: after writing into one in place,
        call :func:`cuflash.clear_mask_cache` (or pass a new array). ``False``: every tile is loaded and
        masked element by element. Not derived in ``attention_varlen`` and ``decode`` (see
        docs/design.md). The name ``sparse`` is therefore not available to the arguments.
    **args
        Named arguments, as for :class:`ScoreMod`.

    Raises
    ------
    TypeError, ValueError
        A malformed expression, one that reads ``score`` or does not give a bool, a bad argument.

    Examples
    --------
    >>> document = MaskMod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx", doc=doc_ids)
    >>> prefix_lm = MaskMod("kv_idx < prefix || kv_idx <= q_idx", prefix=256)
    """

    _what = "mask_mod"
    #: Whether this object's arrays own their memory (False for :meth:`with_arrays`' views of another
    #: framework's buffers, which it may reuse for new data at the same address: no derived sparsity).
    _owns_arrays = True

    def __init__(self, expr, *, sparse=True, **args):
        if not isinstance(sparse, (bool, np.bool_)):
            raise TypeError(f"mask_mod: sparse must be a bool, got {type(sparse).__name__}")
        self.sparse = bool(sparse)
        self.args = _Arguments(args, "mask_mod")
        self.expr = parse(expr, "mask_mod")
        if reads_score(self.expr):
            raise ValueError("mask_mod cannot read score (a mask that depends on the scores is a ScoreMod "
                             "giving -inf)")
        if check(self.expr, self.args.kinds, "mask_mod") != "bool":
            raise ValueError(f"mask_mod must give a bool (True = may attend), and {expr!r} gives a number")
        self.text = expr
        self._write_specs()

    def _write_specs(self):
        #: The modifier as one string (:mod:`cuflash.modifiers.spec`), and as one that derives no block
        #: mask (what torch.compile's graphs take: their inputs may be refilled at the same address).
        self.spec = spec_of(self)
        self.spec_without_blocks = spec_of(self, sparse=False)
        self.array_names = self.args.array_names()
        #: The window it states (:mod:`cuflash.modifiers.builtin`), which calls run built in.
        self._builtin = mask_parts(self)

    def _canonical(self):
        return unparse(self.expr)

    @property
    def reads(self) -> frozenset:
        """The position variables the expression reads, among ``b``, ``h``, ``q_idx``, ``kv_idx``: the
        block mask derived from it (:mod:`cuflash._mask_blocks`) has a batch axis only if it reads
        ``b``, a head axis only if it reads ``h``."""
        return variables(self.expr)

    @property
    def derives_blocks(self) -> bool:
        """Whether calls derive a block mask from this MaskMod (``sparse`` and arrays that own their
        memory, see :mod:`cuflash._mask_blocks`)."""
        return self.sparse and self._owns_arrays

    def reference(self, shape, b0: int = 0, q0: int = 0) -> np.ndarray:
        """Where pairs may attend, a bool array of ``shape`` (B, H, Sq, Sk) (``b`` counts from ``b0``,
        ``q_idx`` from ``q0``)."""
        value = evaluate(self.expr, self._env(shape, b0=b0, q0=q0))
        return np.broadcast_to(np.asarray(value, dtype=bool), tuple(shape))

    def cuda_source(self, name: str = "user_mask_mod", slots=None) -> str:
        """The ``__device__`` function of the mask (``slots`` as in :meth:`ScoreMod.cuda_source`)."""
        return _cuda.function(name, self.expr, "bool", self._typer(), self.args.slots if slots is None else slots,
                              with_score=False)

    def __repr__(self):
        sparse = "" if self.sparse else ", sparse=False"
        return f"cuflash.MaskMod({self.text!r}{sparse}, args={sorted(self.args.values)})"


def argument_slots(score_mod, mask_mod) -> tuple[dict, dict]:
    """The slots of each modifier's arguments in the kernels' one ``cuflash::user::Args`` block: the
    ScoreMod's first, the MaskMod's after them ({} for a modifier that is None).

    Raises
    ------
    ValueError
        If the two together have more than 8 array or 8 scalar arguments.
    """
    score_slots = score_mod.args.slots if score_mod is not None else {}
    arrays, scalars = score_mod.args.counts() if score_mod is not None else (0, 0)
    mask_slots = mask_mod.args.shifted(arrays, scalars) if mask_mod is not None else {}
    if mask_mod is not None:
        more = mask_mod.args.counts()
        if arrays + more[0] > _MAX_ARRAYS or scalars + more[1] > _MAX_SCALARS:
            raise ValueError(f"score_mod and mask_mod together take at most {_MAX_ARRAYS} array and {_MAX_SCALARS} "
                             f"scalar arguments, got {arrays + more[0]} and {scalars + more[1]}")
    return score_slots, mask_slots


def kernel_source(score_mod, mask_mod, *, backward: bool = False) -> str:
    """The CUDA C++ a kernel variant compiles ahead of its family's source for a call's modifiers
    (:attr:`cuflash._build.variant.Variant.source`): ``user_score_mod`` (with ``user_score_mod_grad``
    for the backward) and ``user_mask_mod`` over one ``cuflash::user::Args`` block
    (:func:`argument_slots`); "" when both are None.

    Raises
    ------
    ValueError
        ``backward`` with a ScoreMod whose derivative is not 1 and that has no ``grad``; too many
        arguments.
    """
    if score_mod is None and mask_mod is None:
        return ""
    score_slots, mask_slots = argument_slots(score_mod, mask_mod)
    parts = ['#include "user_mod.cuh"\n']
    if score_mod is not None:
        parts.append(score_mod.cuda_source("user_score_mod", backward=backward, slots=score_slots))
    if mask_mod is not None:
        parts.append(mask_mod.cuda_source("user_mask_mod", slots=mask_slots))
    return "".join(parts)
