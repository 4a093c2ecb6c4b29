"""A modifier written as one string and rebuilt from it: how a ScoreMod/MaskMod crosses an op schema.

torch's custom ops take strings and lists of tensors, not Python objects, and ``torch.compile``
traces an op call with its string arguments as constants and its tensors as graph inputs. So a
modifier travels as its *spec*, a JSON string of everything its compiled code and its scalars
depend on (kind, expression, grad, each argument's name in slot order with its dtype or scalar
value, ``sparse``), beside its array arguments in slot order; :func:`rebuild` makes the modifier
again around the arrays the op receives.

The spec is written once, when the modifier is made (:attr:`cuflash.ScoreMod.spec`): a traced call
reads it as an attribute, nothing computed. Rebuilding parses and types the expression once per spec
(a template kept by :func:`_template`) and then only binds the arrays
(:meth:`cuflash.ScoreMod.with_arrays`), a few dict operations per call.
"""

from __future__ import annotations

import functools
import json
import types

__all__ = ["spec_of", "rebuild"]


def spec_of(mod, *, sparse=None) -> str:
    """The spec of a ScoreMod or MaskMod (``sparse``: a MaskMod's flag in the spec, if not its own)."""
    args = []
    for name, value in mod.args.values.items():   # insertion order: the slots follow it
        kind = mod.args.kinds[name]
        if kind.array:
            args.append([name, "array", mod.args.slots[name][2]])
        else:
            args.append([name, kind.type, {"bool": bool, "int": int, "float": float}[kind.type](value)])
    fields = {"kind": mod._what, "expr": mod.text, "args": args}
    if mod._what == "score_mod":
        fields["grad"] = mod.grad_text
    else:
        fields["sparse"] = mod.sparse if sparse is None else bool(sparse)
    return json.dumps(fields, sort_keys=True)


def rebuild(spec: str, arrays) -> tuple:
    """(modifier, n): the modifier of ``spec`` around the first n of ``arrays`` (its array arguments in
    slot order; the rest belong to another modifier of the same call).

    Raises
    ------
    ValueError
        ``spec`` is not a modifier's spec, or fewer arrays than it names.
    TypeError
        An array whose dtype is not the spec's.
    """
    template, names = _template(spec)
    if len(arrays) < len(names):
        raise ValueError(f"the {template._what} spec names {len(names)} arrays ({', '.join(names)}), got {len(arrays)}")
    if not names:
        return template, 0
    mod = template.with_arrays(dict(zip(names, arrays)))
    mod.__dict__.pop("_owns_arrays", None)   # the caller's own arrays, not views of reused buffers
    return mod, len(names)


@functools.lru_cache(maxsize=256)
def _template(spec: str):
    """The modifier of ``spec`` around stand-in arrays of the spec's dtypes, and its array names."""
    from cuflash.modifiers import MaskMod, ScoreMod

    try:
        fields = json.loads(spec)
        kind, expr, args = fields["kind"], fields["expr"], fields["args"]
        values = {name: (_StandIn(value) if what == "array" else value) for name, what, value in args}
    except (TypeError, ValueError, KeyError) as error:
        raise ValueError(f"not a modifier spec ({error}): {spec[:200]!r}") from None
    if kind == "score_mod":
        mod = ScoreMod(expr, grad=fields.get("grad"), **values)
    elif kind == "mask_mod":
        mod = MaskMod(expr, sparse=fields.get("sparse", True), **values)
    else:
        raise ValueError(f"not a modifier spec (kind {kind!r}): {spec[:200]!r}")
    return mod, mod.args.array_names()


class _StandIn:
    """An array argument's place in a template: its dtype's name, no data."""

    shape = (0,)

    def __init__(self, dtype_name: str):
        self.dtype = types.SimpleNamespace(name=dtype_name)
