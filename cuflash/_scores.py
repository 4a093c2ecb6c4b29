"""The score modifiers' arrays as kernel parameters: ALiBi slopes, mask, bias and block mask,
broadcast by zero strides (never materialised), as fields of the params structs that the forward
and backward families share (cuda_src/params.cuh, mask.cuh)."""

from __future__ import annotations

import math

import numpy as np

from . import _checks

SCORE_OPERANDS = ("alibi_slopes", "mask", "bias", "block_mask")


def score_operands(b, hq, sq, sk, *, alibi_slopes, mask, bias, block_mask, block_size, first: int):
    """FwdParams fields for ALiBi, mask, bias and block_mask: pointers as ("operand", index) with the
    operands at ``first``, ``first + 1``, ... in that order, and the kernel-ready arrays (zero-stride
    broadcast views; ALiBi slopes contiguous) in the same order (None where absent; names in
    SCORE_OPERANDS)."""
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
    return fields, arrays


def _stride_fields(prefix: str, x) -> dict:
    sb, sh, sr, sc = _checks.element_strides(x)
    return {f"{prefix}_batch_stride": sb, f"{prefix}_head_stride": sh, f"{prefix}_row_stride": sr,
            f"{prefix}_col_stride": sc}
