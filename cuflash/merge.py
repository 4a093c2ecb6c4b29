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

from . import _checks, kernels
from ._runtime import capture as _capture, launch as _launch, memo as _memo, plan as _plan, step as _step
from ._build.compile import get_kernel
from ._runtime.params import MERGE, Template

__all__ = ["merge_states"]

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


def merge_states(outs, lses, *, out=None, lse=None):
    """Combine attention results over disjoint key sets into the result over their union.

    Parameters
    ----------
    outs : CUDA array (n, B, S, H, D), or a sequence of n arrays (B, S, H, D)
        Partial outputs, each normalised over its own keys (what :func:`cuflash.attention` returns);
        float16, bfloat16, float32 or float64, any strides. A sequence of mixed dtypes is merged
        in float32 (float64 if one is float64).
    lses : CUDA float32 array (n, B, H, S), or a sequence of n arrays (B, H, S)
        Their log-sum-exps, in the layout :func:`cuflash.attention_forward` returns.
    out : CUDA array (B, S, H, D) of the dtype of ``outs[0]``, optional
    lse : CUDA float32 array (B, H, S), optional
        C-contiguous buffers to write the results into (a serving loop passes them, so that a call
        allocates nothing); neither may overlap ``outs`` or ``lses``.

    Returns
    -------
    out : CuPy array (B, S, H, D), the dtype of ``outs[0]`` (the caller's ``out`` when given)
    lse : CuPy float32 array (B, H, S) (the caller's ``lse`` when given)
        ``lse = log(sum_i exp(lse_i))`` (exact up to float32 rounding) and
        ``out = sum_i exp(lse_i - lse) * out_i``.

    Raises
    ------
    TypeError
        ``outs`` not float16/bfloat16/float32/float64, ``lses`` not float32, an array that is not a
        CUDA array, an ``out``/``lse`` of the wrong dtype.
    ValueError
        Shapes that do not match (``outs`` not 5-d or a sequence of equal 4-d arrays, ``lses`` not
        (n, B, H, S)), no part at all, an ``out``/``lse`` of the wrong shape, not C-contiguous or
        overlapping an input; before any launch, naming the argument.
    RuntimeError
        CuPy or a usable CUDA GPU is missing, or a call that stacks a sequence of parts (a copy) is
        being captured in a CUDA graph (pass one (n, ...) array there).

    Notes
    -----
    A part with ``lse_i = -inf`` saw no key and is skipped, whatever its ``out_i`` holds; a row
    whose parts are all ``-inf`` merges to ``out = 0``, ``lse = -inf`` (never NaN). A NaN ``lse_i``
    makes the row NaN. Merging is exact, so merging in stages (``merge(merge(a, b), c)``) and in one
    go agree up to rounding, and attention over ``A ∪ B`` equals ``merge(attention(A), attention(B))``.

    Examples
    --------
    Attention over a long shared prefix and each request's own keys, computed apart and merged
    (cascade inference); the result equals one call over the concatenated keys:

    >>> import cupy as cp
    >>> import cuflash
    >>> f16 = lambda *shape: cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    >>> q = f16(4, 1, 8, 64)
    >>> k1, v1 = f16(4, 900, 8, 64), f16(4, 900, 8, 64)      # the shared prefix
    >>> k2, v2 = f16(4, 50, 8, 64), f16(4, 50, 8, 64)        # each request's own keys
    >>> o1, lse1 = cuflash.attention(q, k1, v1, return_lse=True)
    >>> o2, lse2 = cuflash.attention(q, k2, v2, return_lse=True)
    >>> out, lse = cuflash.merge_states([o1, o2], [lse1, lse2])
    >>> out.shape, lse.shape
    ((4, 1, 8, 64), (4, 8, 1))
    """
    operands = (outs, lses, out, lse)
    plan, ptrs, where = _memo.lookup("merge_states", operands, ())
    if plan is None:
        plan, ptrs, result = _plan_merge(operands, ptrs)
        if plan is None:
            return result
    results, _, _ = plan.run(operands, ptrs, where)
    return results[0], results[1]


def _plan_merge(operands, key):
    """The full path of :func:`merge_states`: (plan, pointers, None), or (None, None, result) for an
    empty merge."""
    import cupy

    outs, lses, out, lse = operands
    stacked, out_dtype = _stacked_outs(outs)
    n, b, s, h, d = stacked.shape
    lse_stack = _stacked_lses(lses, n)
    if tuple(lse_stack.shape) != (n, b, h, s):
        raise ValueError(f"lses must have shape (parts, batch, heads, seqlen) = {(n, b, h, s)} to match outs "
                         f"{tuple(stacked.shape)}, got {tuple(lse_stack.shape)}")
    out_k = None if out is None else _checks.check_out(out, "out", (b, s, h, d), out_dtype)
    lse_k = None if lse is None else _checks.check_out(lse, "lse", (b, h, s), np.float32)
    _checks.check_disjoint((("out", out_k), ("lse", lse_k)), (("outs", stacked), ("lses", lse_stack)))
    if b * s * h == 0:
        _memo.nothing_to_plan()
        return None, None, (out if out is not None else cupy.empty((b, s, h, d), dtype=out_dtype),
                            lse if lse is not None else cupy.empty((b, h, s), dtype=np.float32))
    if b * s * h >= 2**31:
        raise ValueError(f"merge handles fewer than 2**31 rows (batch * seqlen * heads), got {b * s * h}")
    out_layout = _checks.Shaped((b, s, h, d), out_dtype)
    lse_layout = _checks.Shaped((b, h, s), np.float32)
    plan = _plan.Plan("merge_states", len(operands),
                          outputs={2: _step.Buffer(out_layout.shape, out_dtype),
                                   3: _step.Buffer(lse_layout.shape, np.float32)})
    merge = kernels.merge.merge_plan(_merge_dtype_name(stacked, "outs"), _merge_dtype_name(out_layout, "out"))
    device_id = _launch.device_id()
    func = _launch.prepare_kernel(get_kernel(merge.variant), 0, device_id)
    params = Template(MERGE, merge_fields(stacked, lse_stack, out_layout, lse_layout),
                      {"outs": 0, "lses": 1, "out": 2, "lse": 3})
    plan.steps.append(_step.Step(func, (merge.grid(b * s * h), 1, 1), merge.threads, 0, (("struct", params),)))
    kernel_operands = (stacked, lse_stack, out_k, lse_k)
    in_place = _memo.in_place(operands, kernel_operands)
    if not in_place:
        _capture.refuse_capture("merge_states", _capture.COPIES_NOT_CAPTURED)
    _memo.remember(key if in_place else None, plan)
    return plan, _memo.pointers(kernel_operands), None


def merge_fields(outs, lses, out, lse) -> dict:
    """MergeParams' sizes and strides for outs (n, B, S, H, D), lses (n, B, H, S), out (B, S, H, D)
    (only its first ``out.shape[-1]`` columns are read from ``outs``) and lse (B, H, S); arrays or
    :class:`cuflash._checks.Shaped` layouts."""
    n, b, s, h = outs.shape[:4]
    fields = dict(num_parts=n, batch=b, seqlen=s, heads=h, head_dim=out.shape[-1])
    for name, stride in zip(("part", "batch", "row", "head", "col"), _checks.element_strides(outs)):
        fields[f"outs_{name}_stride"] = stride
    for name, stride in zip(("part", "batch", "head", "row"), _checks.element_strides(lses)):
        fields[f"lses_{name}_stride"] = stride
    for name, stride in zip(("batch", "row", "head", "col"), _checks.element_strides(out)):
        fields[f"out_{name}_stride"] = stride
    for name, stride in zip(("batch", "head", "row"), _checks.element_strides(lse)):
        fields[f"lse_{name}_stride"] = stride
    return fields
