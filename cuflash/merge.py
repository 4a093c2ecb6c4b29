"""Merging attention states: partial results over disjoint key sets -> the result over their union.

Attention over keys A and attention over keys B, each with its log-sum-exp, determine attention
over A ∪ B exactly (the cascade property that split-KV decode, ring attention and shared-prefix
"cascade" inference rest on):

    m = max_i lse_i,   w_i = exp(lse_i - m),   out = sum_i w_i out_i / sum_i w_i,
    lse = m + log(sum_i w_i).

The kernel is ``cuda_src/merge.cu``; the float64 twin is :func:`cuflash.reference.merge_states`.
"""

from __future__ import annotations

import numpy as np

from . import _checks, _heuristics
from ._compile import get_kernel
from ._launch import launch

__all__ = ["merge_states"]

# Mirrors ``MergeParams`` in cuda_src/merge.cu (align=True pads like C); its size is compiled in as
# CUFLASH_MERGE_PARAMS_SIZE and static_asserted there.
_POINTERS = ("outs", "lses", "out", "lse")
_STRIDES = (
    "outs_part_stride", "outs_batch_stride", "outs_row_stride", "outs_head_stride", "outs_col_stride",
    "lses_part_stride", "lses_batch_stride", "lses_head_stride", "lses_row_stride",
    "out_batch_stride", "out_row_stride", "out_head_stride", "out_col_stride",
    "lse_batch_stride", "lse_head_stride", "lse_row_stride",
)
_INTS = ("num_parts", "batch", "seqlen", "heads", "head_dim", "pad_")
MERGE_PARAMS_DTYPE = np.dtype(
    [(name, np.uint64) for name in _POINTERS]
    + [(name, np.int64) for name in _STRIDES]
    + [(name, np.int32) for name in _INTS],
    align=True,
)

_MERGE_DTYPES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
                 np.dtype(np.float64): "float64"}
if _checks.BFLOAT16 is not None:
    _MERGE_DTYPES[_checks.BFLOAT16] = "bfloat16"


def _merge_dtype_name(x, name: str) -> str:
    try:
        return _MERGE_DTYPES[np.dtype(x.dtype)]
    except KeyError:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}") from None


def _is_sequence(x) -> bool:
    return isinstance(x, (list, tuple))


def _stacked_outs(outs):
    """``outs`` as one CUDA array (n, B, S, H, D) and the dtype of the result (that of outs[0])."""
    import cupy

    if _is_sequence(outs):
        if len(outs) == 0:
            raise ValueError("outs must hold at least one partial result, got an empty sequence")
        parts = [_checks.as_cuda_array(x, f"outs[{i}]") for i, x in enumerate(outs)]
        names = [_merge_dtype_name(x, f"outs[{i}]") for i, x in enumerate(parts)]
        for i, x in enumerate(parts):
            if x.ndim != 4:
                raise ValueError(f"outs[{i}] must be 4-d (batch, seqlen, heads, head_dim), got shape "
                                 f"{tuple(x.shape)}")
            if x.shape != parts[0].shape:
                raise ValueError(f"outs[{i}] must have the shape of outs[0] {tuple(parts[0].shape)}, "
                                 f"got {tuple(x.shape)}")
        if len(set(names)) == 1:
            # Stacked as unsigned-integer bits: a plain copy whatever CuPy makes of bfloat16.
            uint = {2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[parts[0].itemsize]
            return cupy.stack([x.view(uint) for x in parts]).view(parts[0].dtype), parts[0].dtype
        # Mixed dtypes are merged in float32 (float64 if any part is float64), never rounded down.
        work = np.float64 if "float64" in names else np.float32
        return cupy.stack([x.astype(work) for x in parts]), parts[0].dtype
    x = _checks.as_cuda_array(outs, "outs")
    _merge_dtype_name(x, "outs")
    if x.ndim != 5:
        raise ValueError(f"outs must be 5-d (parts, batch, seqlen, heads, head_dim) or a sequence of 4-d "
                         f"arrays, got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError("outs must hold at least one partial result, got 0")
    return x, x.dtype


def _stacked_lses(lses, n: int):
    import cupy

    if _is_sequence(lses):
        if len(lses) != n:
            raise ValueError(f"lses must hold one entry per partial result ({n}), got {len(lses)}")
        parts = [_checks.as_cuda_array(x, f"lses[{i}]") for i, x in enumerate(lses)]
        for i, x in enumerate(parts):
            if x.dtype != np.float32:
                raise TypeError(f"lses[{i}] must be float32, got {x.dtype}")
            if x.ndim != 3 or x.shape != parts[0].shape:
                raise ValueError(f"lses[{i}] must be 3-d (batch, heads, seqlen) like lses[0], got shape "
                                 f"{tuple(x.shape)}")
        return cupy.stack(parts)
    x = _checks.as_cuda_array(lses, "lses")
    if x.dtype != np.float32:
        raise TypeError(f"lses must be float32, got {x.dtype}")
    return x


def merge_states(outs, lses):
    """Combine attention results over disjoint key sets into the result over their union.

    Parameters
    ----------
    outs : CUDA array (n, B, S, H, D), or a sequence of n arrays (B, S, H, D)
        Partial outputs, each normalised over its own keys (what :func:`cuflash.attention` returns);
        float16, bfloat16, float32 or float64, any strides. A sequence of mixed dtypes is merged
        in float32 (float64 if one is float64).
    lses : CUDA float32 array (n, B, H, S), or a sequence of n arrays (B, H, S)
        Their log-sum-exps, in the layout :func:`cuflash.attention_forward` returns.

    Returns
    -------
    out : CuPy array (B, S, H, D), the dtype of ``outs[0]``
    lse : CuPy float32 array (B, H, S)
        ``lse = log(sum_i exp(lse_i))`` (exact up to float32 rounding) and
        ``out = sum_i exp(lse_i - lse) * out_i``.

    Raises
    ------
    TypeError, ValueError
        For a bad argument, before any launch.

    Notes
    -----
    A part with ``lse_i = -inf`` saw no key and is skipped, whatever its ``out_i`` holds; a row
    whose parts are all ``-inf`` merges to ``out = 0``, ``lse = -inf`` (never NaN). A NaN ``lse_i``
    makes the row NaN. Merging is exact, so merging in stages (``merge(merge(a, b), c)``) and in one
    go agree up to rounding, and attention over ``A ∪ B`` equals ``merge(attention(A), attention(B))``.
    """
    import cupy

    stacked, out_dtype = _stacked_outs(outs)
    n, b, s, h, d = stacked.shape
    lse_stack = _stacked_lses(lses, n)
    if tuple(lse_stack.shape) != (n, b, h, s):
        raise ValueError(f"lses must have shape (parts, batch, heads, seqlen) = {(n, b, h, s)} to match outs "
                         f"{tuple(stacked.shape)}, got {tuple(lse_stack.shape)}")
    out = cupy.empty((b, s, h, d), dtype=out_dtype)
    lse = cupy.empty((b, h, s), dtype=np.float32)
    _launch_merge(stacked, lse_stack, out, lse)
    return out, lse


def _launch_merge(outs, lses, out, lse) -> None:
    """Launch the merge kernel: outs (n, B, S, H, D), lses (n, B, H, S) float32 -> out (B, S, H, D)
    (only its first ``out.shape[-1]`` columns are read from ``outs``), lse (B, H, S) float32."""
    n, b, s, h = outs.shape[:4]
    d = out.shape[-1]
    if b * s * h == 0:
        return
    if b * s * h >= 2**31:
        raise ValueError(f"merge handles fewer than 2**31 rows (batch * seqlen * heads), got {b * s * h}")
    plan = _heuristics.merge_plan(_merge_dtype_name(outs, "outs"), _merge_dtype_name(out, "out"), d)
    params = np.zeros((), dtype=MERGE_PARAMS_DTYPE)
    params["outs"], params["lses"] = outs.data.ptr, lses.data.ptr
    params["out"], params["lse"] = out.data.ptr, lse.data.ptr
    names = ("part", "batch", "row", "head", "col")
    for name, stride in zip(names, _checks.element_strides(outs)):
        params[f"outs_{name}_stride"] = stride
    for name, stride in zip(("part", "batch", "head", "row"), _checks.element_strides(lses)):
        params[f"lses_{name}_stride"] = stride
    for name, stride in zip(("batch", "row", "head", "col"), _checks.element_strides(out)):
        params[f"out_{name}_stride"] = stride
    for name, stride in zip(("batch", "head", "row"), _checks.element_strides(lse)):
        params[f"lse_{name}_stride"] = stride
    params["num_parts"], params["batch"], params["seqlen"], params["heads"], params["head_dim"] = n, b, s, h, d
    launch(get_kernel(plan.variant), (b * s * h, 1, 1), plan.threads, 0, params[()])
