"""The score modifiers' arrays as kernel parameters: ALiBi slopes, mask, bias and block mask,
broadcast by zero strides (never materialised), as fields of the params structs that the forward
and backward families share (cuda_src/params.cuh, mask.cuh)."""

from __future__ import annotations

import math

import numpy as np

from . import _checks
from ._runtime import tma as _tma
from .modifiers import MaskMod, ScoreMod   # (a call's modifiers are checked on every repeat call)

SCORE_OPERANDS = ("alibi_slopes", "mask", "bias", "block_mask")


def score_operands(b, hq, sq, sk, *, alibi_slopes, mask, bias, block_mask, block_size, first: int,
                   mask_bits=None):
    """FwdParams fields for ALiBi, mask, bias and block_mask: pointers as ("operand", index) with the
    operands at ``first``, ``first + 1``, ... in that order, and the kernel-ready arrays (zero-stride
    broadcast views; ALiBi slopes contiguous) in the same order (None where absent; names in
    SCORE_OPERANDS). ``mask_bits``: the fields of a MaskMod's bits in the allocation of a derived
    ``block_mask`` ((name, value) pairs, cuflash/_mask_blocks.py), added as they are."""
    fields, arrays = {}, [None, None, None, None]
    if alibi_slopes is not None:
        slopes = arrays[0] = _checks.check_alibi(alibi_slopes, b, hq)
        fields.update(alibi_slopes=("operand", first), alibi_batch_stride=hq if slopes.ndim == 2 else 0)
    if mask is not None:
        m = arrays[1] = _checks.broadcast_operand(mask, "mask", (b, hq, sq, sk), "bool")
        fields.update(mask=("operand", first + 1), **_stride_fields("mask", m))
    if bias is not None:
        x = arrays[2] = _checks.broadcast_operand(bias, "bias", (b, hq, sq, sk), "float")
        fields.update(bias=("operand", first + 2), bias_dtype=_checks.BIAS_DTYPE_CODES[np.dtype(x.dtype)],
                      **_stride_fields("bias", x))
    bq, bk = _checks.check_block_size(block_size)
    fields.update(block_q=bq, block_k=bk)
    if block_mask is not None:
        target = (b, hq, math.ceil(sq / bq), math.ceil(sk / bk))
        x = arrays[3] = _checks.broadcast_operand(block_mask, "block_mask", target, "bool")
        fields.update(block_mask=("operand", first + 3), **_stride_fields("block_mask", x))
        if mask_bits is not None:   # the bits lie at an offset from the derived mask's own address
            if x.data.ptr != _checks.as_cuda_array(block_mask, "block_mask").data.ptr:
                raise RuntimeError("a derived block mask was copied away from its bits")
            fields.update(mask_bits)
    return fields, arrays


def _stride_fields(prefix: str, x) -> dict:
    sb, sh, sr, sc = _checks.element_strides(x)
    return {f"{prefix}_batch_stride": sb, f"{prefix}_head_stride": sh, f"{prefix}_row_stride": sr,
            f"{prefix}_col_stride": sc}


def score_tile_spec(x, block_m: int) -> _tma.TensorMapSpec:
    """The TMA map of a bias or mask ``x`` that :func:`cuflash.kernels.fwd_sm90.score_tile_layout` accepts,
    read in boxes of ``block_m`` query rows (fwd_sm90's and bwd_sm90's score tiles), as a (B', Sq, H', Sk)
    array: a broadcast head or batch (zero stride) becomes an axis of length 1, which the kernels read at
    coordinate 0; broadcast rows (a key mask or bias) one row, read in boxes of one row."""
    b, h, sq, sk = x.shape
    sb, sh, sr, _ = x.strides
    if sr == 0:
        sq, sr, block_m = 1, -(-sk * x.itemsize // 16) * 16, 1
    plane = -(-sr * sq // 16) * 16   # a stride for an axis of length 1, past the rows (any valid one would do)
    h, sh = (h, sh) if sh else (1, plane)
    b, sb = (b, sb) if sb else (1, plane * h)
    return _tma.TensorMapSpec(_Layout((b, sq, h, sk), (sb, sr, sh, x.itemsize)), block_m, str(x.dtype))


class _Layout:
    """Shape and byte strides: what a TensorMapSpec reads of an array."""

    __slots__ = ("shape", "strides", "nbytes")

    def __init__(self, shape, strides):
        self.shape, self.strides, self.nbytes = tuple(shape), tuple(strides), 0


# ----------------------------------------------------------------------------- user-written modifiers

def modifier_parts(score_mod, mask_mod):
    """(memo key, arrays) of a call's ScoreMod and MaskMod: what the plan memo keys on besides the
    arrays' layouts, and the array arguments, which the entry point appends to its operands (their
    addresses are written per call, like every operand's). (None, ()) without modifiers.

    Raises
    ------
    TypeError
        ``score_mod`` that is not a :class:`cuflash.ScoreMod`, ``mask_mod`` not a :class:`cuflash.MaskMod`.
    """
    if score_mod is not None and not isinstance(score_mod, ScoreMod):
        raise TypeError(f"score_mod must be a cuflash.ScoreMod or None, got {type(score_mod).__name__}")
    if mask_mod is not None and not isinstance(mask_mod, MaskMod):
        raise TypeError(f"mask_mod must be a cuflash.MaskMod or None, got {type(mask_mod).__name__}")
    score_key, score_arrays = score_mod.call_parts() if score_mod is not None else (None, ())
    mask_key, mask_arrays = mask_mod.call_parts() if mask_mod is not None else (None, ())
    return (score_key, mask_key), score_arrays + mask_arrays


def user_operands(score_mod, mask_mod, *, first: int, backward: bool = False):
    """FwdParams fields of a call's ScoreMod and MaskMod, their kernel-ready arrays, the names the
    kernel planners take among ``score_mods``, and the CUDA the variant compiles in.

    The arguments fill one ``user::Args`` block (cuda_src/user_mod.cuh; the MaskMod's slots after
    the ScoreMod's, :func:`cuflash.modifiers.argument_slots`): array k's address as the operand
    ``first + k`` (the arrays come back in that order) and its element count; the scalars' values.

    Returns
    -------
    fields : dict
        ``"user.ptr<k>"`` -> ("operand", first + k), ``"user.size<k>"``, ``"user.f<k>"``, ``"user.i<k>"``.
    arrays : tuple
        CuPy arrays, C-contiguous (the expressions index them flat, in C order; others are copied).
    names : tuple of str
        ``"score_mod"`` and/or ``"mask_mod"``.
    source : str
        :func:`cuflash.modifiers.kernel_source` (``backward``: with the ScoreMod's grad).

    Raises
    ------
    TypeError
        An array argument that is not a CUDA array.
    ValueError
        An array argument on another GPU; a float scalar outside float32's range (the kernels read
        float32); more than 8 arrays or scalars in all; a ScoreMod without the grad its backward
        needs.
    """
    from .modifiers import argument_slots, kernel_source

    if score_mod is None and mask_mod is None:
        return {}, (), (), ""
    cupy = _checks._cupy()
    fields, arrays, names = {}, [], []
    for mod, slots, what in zip((score_mod, mask_mod), argument_slots(score_mod, mask_mod), ("score_mod", "mask_mod")):
        if mod is None:
            continue
        names.append(what)
        for name, (is_array, slot, kind) in sorted(slots.items(), key=lambda item: (not item[1][0], item[1][1])):
            value = mod.args.values[name]
            if is_array:
                x = cupy.ascontiguousarray(_checks.as_cuda_array(value, f"{what} argument {name}"))
                fields[f"user.ptr{slot}"] = ("operand", first + slot)
                fields[f"user.size{slot}"] = x.size
                arrays.append(x)
            elif kind == "float":
                if not abs(float(value)) <= float(np.finfo(np.float32).max) and not math.isinf(value) and not math.isnan(value):
                    raise ValueError(f"{what} argument {name}={value} is outside float32's range (the kernels read "
                                     "float32 scalars)")
                fields[f"user.f{slot}"] = float(value)
            else:
                fields[f"user.i{slot}"] = int(value)
    return fields, tuple(arrays), tuple(names), kernel_source(score_mod, mask_mod, backward=backward)
