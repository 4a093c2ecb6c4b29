"""Backward attention: the gradients of :func:`cuflash.attention` with respect to q, k, v (and bias).

The kernels recompute the attention probabilities from the forward's ``lse`` instead of storing
them (FlashAttention-2's backward); nothing of size Sq x Sk is kept between forward and backward.
One call runs, on CuPy's current stream:

1. ``bwd_preprocess``: D = rowsum(dO * O) and lse * log2(e) per query row (float32, padded rows);
2. the dK/dV pass (``bwd_sm80`` / ``bwd_simt``, pass 0): a CTA per block of keys of one kv head
   walks over the queries of every query head of its GQA group, so dK/dV are summed over the
   group in registers, in a fixed order; it also adds dQ into a float32 buffer with atomics;
3. ``bwd_convert``: that float32 dQ, times the softmax scale, into the output dtype.

With ``deterministic=True`` step 2 does no atomics and a separate dQ pass (pass 1, a CTA per block
of queries walking over the keys) writes dQ once: the results are then bitwise identical from run
to run. When a GQA group has to be split over several CTAs to fill the GPU (few kv heads, short
sequences), dK/dV partial sums are added by ``bwd_convert`` in a fixed order, which keeps that
guarantee.
"""

from __future__ import annotations

import contextvars
import functools
import math

import numpy as np

from . import _checks, _heuristics, _launch
from ._compile import get_kernel
from .attention import _check_qkv, _kernel_ready, _score_operands
from .random import as_rng_state, dropout_threshold

__all__ = ["attention_backward", "attention_varlen_backward", "force_kernel", "FAMILIES"]

FAMILIES = _heuristics.BWD_FAMILIES
_forced_family = contextvars.ContextVar("cuflash_forced_backward_family", default=None)


def force_kernel(family: str):
    """Run every backward call inside the block on one kernel family (tests and benchmarks).

    Parameters
    ----------
    family : {"bwd_sm80", "bwd_simt"}
        bwd_sm80 runs float16/bfloat16, bwd_simt float32; a family that cannot run a call's dtype
        raises ValueError at that call, never falls back.
    """
    return _launch.forcing(_forced_family, family, FAMILIES)


def _family_for(dtype_name: str) -> str:
    family = _forced_family.get() or _heuristics.default_backward_family(dtype_name)
    if family == "bwd_sm80" and dtype_name == "float32":
        raise ValueError("the forced kernel family bwd_sm80 runs float16/bfloat16, not float32")
    if family == "bwd_simt" and dtype_name != "float32":
        raise ValueError(f"the forced kernel family bwd_simt runs float32, not {dtype_name}")
    return family


_num_sms = _launch.sm_count  # a module name, so tests can pretend to other SM counts


@functools.lru_cache(maxsize=None)
def _max_smem(device_id: int) -> int:
    import cupy

    runtime = cupy.cuda.runtime
    return int(runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id))


# ----------------------------------------------------------------------------- argument checks

def _check_like(x, name: str, ref, ref_name: str = "q"):
    """dout / out: a CUDA array with the shape and dtype of ``ref``."""
    x = _checks.as_cuda_array(x, name)
    _checks.check_same_dtype(ref, ref_name, x, name)
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(x.shape)}")
    return x


def _check_lse(lse, shape):
    lse = _checks.as_cuda_array(lse, "lse")
    if lse.dtype != np.float32:
        raise TypeError(f"lse must be float32 (as attention_forward returns it), got {lse.dtype}")
    if tuple(lse.shape) != tuple(shape):
        raise ValueError(f"lse must have shape {tuple(shape)}, got {tuple(lse.shape)}")
    return lse


def _check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _dropout_fields(dropout_p: float, rng_state):
    """Kernel fields that regenerate the forward's dropout mask from its rng_state."""
    if dropout_p == 0.0:
        return {}
    if rng_state is None:
        raise ValueError("dropout_p > 0 needs the forward's rng_state (attention_forward returns it)")
    seed, offset = as_rng_state(rng_state)
    return dict(dropout_seed=seed, dropout_offset=offset & 0xFFFFFFFF,
                dropout_threshold=dropout_threshold(dropout_p), dropout_rescale=1.0 / (1.0 - dropout_p))


def _check_common(*, head_dim, causal, scale, window, softcap, dropout_p, rng_state, deterministic):
    scale = _checks.check_scale(scale, head_dim)
    window = _checks.check_window(window, causal)
    softcap = _checks.check_softcap(softcap)
    dropout_p = _checks.check_dropout(dropout_p)
    deterministic = _check_flag(deterministic, "deterministic")
    return scale, window, softcap, _dropout_fields(dropout_p, rng_state), deterministic


def _out_buffer(buf, name, shape, dtype, d_pad):
    """(user-visible result, kernel target): the kernels write pairs/float4s of d_pad columns, so a
    buffer whose head dim is not padded or whose rows are not 16-byte aligned gets a private target."""
    import cupy

    if buf is not None:
        _checks.check_out(buf, name, shape, dtype)
    result = cupy.empty(shape, dtype=dtype) if buf is None else buf
    if shape[-1] == d_pad and result.data.ptr % 16 == 0:
        return result, result
    return result, cupy.empty(shape[:-1] + (d_pad,), dtype=dtype)


def _rows(x, varlen: bool) -> dict:
    """(batch, row, head) element strides of a (B, S, H, D) array, or (0, row, head) of (T, H, D)."""
    strides = _checks.element_strides(x)
    if varlen:
        return dict(batch=0, row=strides[0], head=strides[1])
    return dict(batch=strides[0], row=strides[1], head=strides[2])


def _layout_fields(prefix: str, x, varlen: bool) -> dict:
    r = _rows(x, varlen)
    return {f"{prefix}_batch_stride": r["batch"], f"{prefix}_row_stride": r["row"], f"{prefix}_head_stride": r["head"]}


# ----------------------------------------------------------------------------- launch sequence

def _convert(dtype_name, src, dst, *, rows, heads, head_dim, src_row_stride, src_head_stride, dst_row_stride,
             dst_head_stride, scale=1.0, num_partials=1, partial_stride=0):
    params = _launch.pack_convert_params(
        src=src.data.ptr, dst=dst.data.ptr, partial_stride=partial_stride, src_row_stride=src_row_stride,
        src_head_stride=src_head_stride, dst_row_stride=dst_row_stride, dst_head_stride=dst_head_stride,
        rows=rows, heads=heads, head_dim=head_dim, num_partials=num_partials, scale=scale)
    kernel = get_kernel(_heuristics.bwd_convert_variant(dtype_name))
    _launch.launch(kernel, (math.ceil(rows * heads / 8), 1, 1), 256, 0, params)


def _run_backward(*, family, dtype_name, varlen, batch, max_q, max_k, heads_q, heads_k, d, d_pad, tensors,
                  fwd_fields, score_fields, dropout_fields, deterministic, dq_t, dk_t, dv_t, dbias_buf):
    """Preprocess, dK/dV pass (+ atomic dQ), then convert or the dQ pass. ``tensors`` holds the
    kernel-ready q, k, v, out, dout and a row-contiguous lse; dq_t/dk_t/dv_t are the kernel targets."""
    import cupy

    q, k, v, o, do, lse = (tensors[n] for n in ("q", "k", "v", "out", "dout", "lse"))
    score_mods = bool(fwd_fields.get("softcap", 0.0) > 0) or any(
        key in score_fields for key in ("alibi_slopes", "mask", "bias", "block_mask"))
    dropout = bool(dropout_fields)
    plan0 = _heuristics.backward_plan(family, dtype_name, d_pad, dq_pass=False, score_mods=score_mods,
                                      dropout=dropout)
    plan1 = (_heuristics.backward_plan(family, dtype_name, d_pad, dq_pass=True, score_mods=score_mods,
                                       dropout=dropout) if deterministic else None)

    device_id = cupy.cuda.Device().id
    for plan in (plan0, plan1):
        if plan is not None and plan.smem_bytes > _max_smem(device_id):
            raise ValueError(f"the backward for head_dim {d} needs {plan.smem_bytes // 1024} KiB of shared memory "
                             f"per block; this GPU offers {_max_smem(device_id) // 1024} KiB")

    rows_pad = _heuristics.BWD_ROW_PAD * max(1, math.ceil(max_q / _heuristics.BWD_ROW_PAD))
    lse2 = cupy.empty((batch, heads_q, rows_pad), dtype=np.float32)
    dsum = cupy.empty((batch, heads_q, rows_pad), dtype=np.float32)

    fwd = dict(q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=o.data.ptr, lse=lse.data.ptr,
               **{f: val for f, val in fwd_fields.items()}, **score_fields, **dropout_fields,
               heads_q=heads_q, heads_k=heads_k, head_dim=d_pad, batch=batch)
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o)):
        fwd.update(_layout_fields(name, x, varlen))
    fwd.update(lse_batch_stride=0 if varlen else heads_q * max_q, lse_head_stride=lse.shape[-1])

    group = heads_q // heads_k
    key_blocks = math.ceil(max_k / plan0.block_m)
    heads_per_cta = _heuristics.backward_heads_per_cta(batch, heads_k, group, key_blocks, _num_sms(device_id))
    splits = group // heads_per_cta
    float_dtype = np.float32
    if splits > 1:
        # float32 partial sums per head chunk: (rows, Hk * splits, d_pad); bwd_convert adds them.
        rows_k = dk_t.shape[:-2]
        dk_part = cupy.empty(rows_k + (heads_k * splits, d_pad), dtype=float_dtype)
        dv_part = cupy.empty(rows_k + (heads_k * splits, d_pad), dtype=float_dtype)
        dk_target, dv_target = dk_part, dv_part
    else:
        dk_target, dv_target = dk_t, dv_t
    dq_accum = None if deterministic else cupy.zeros(dq_t.shape[:-1] + (d_pad,), dtype=float_dtype)

    bwd = dict(dout=do.data.ptr, lse2=lse2.data.ptr, dsum=dsum.data.ptr, seqlen_q_pad=rows_pad,
               heads_per_cta=heads_per_cta, dkv_partial=int(splits > 1),
               dk=dk_target.data.ptr, dv=dv_target.data.ptr, dq=dq_t.data.ptr,
               **_layout_fields("do", do, varlen), **_layout_fields("dk", dk_target, varlen),
               **_layout_fields("dv", dv_target, varlen), **_layout_fields("dq", dq_t, varlen))
    if dq_accum is not None:
        bwd.update(dq_accum=dq_accum.data.ptr, **_layout_fields("dqa", dq_accum, varlen))
    if dbias_buf is not None:
        sb, sh, sr, _ = _checks.element_strides(dbias_buf)
        bwd.update(dbias=dbias_buf.data.ptr, dbias_batch_stride=sb, dbias_head_stride=sh, dbias_row_stride=sr)
    params = _launch.pack_bwd_params(fwd, **bwd)

    _launch.launch(get_kernel(_heuristics.bwd_preprocess_variant(dtype_name)),
                   (rows_pad // 16, heads_q, batch), 128, 0, params)
    _launch.launch(get_kernel(plan0.variant), (key_blocks, heads_k * splits, batch), plan0.threads,
                   plan0.smem_bytes, params)
    if deterministic:
        _launch.launch(get_kernel(plan1.variant), (math.ceil(max_q / plan1.block_m), heads_q, batch),
                       plan1.threads, plan1.smem_bytes, params)
    else:
        rows_q = dq_t.shape[0] if varlen else dq_t.shape[0] * dq_t.shape[1]
        qa = _rows(dq_accum, varlen)
        qt = _rows(dq_t, varlen)
        _convert(dtype_name, dq_accum, dq_t, rows=rows_q, heads=heads_q, head_dim=d,
                 src_row_stride=qa["row"], src_head_stride=qa["head"], dst_row_stride=qt["row"],
                 dst_head_stride=qt["head"], scale=fwd_fields["scale"])
    if splits > 1:
        rows_k = dk_t.shape[0] if varlen else dk_t.shape[0] * dk_t.shape[1]
        for part, target in ((dk_part, dk_t), (dv_part, dv_t)):
            pr, tr = _rows(part, varlen), _rows(target, varlen)
            _convert(dtype_name, part, target, rows=rows_k, heads=heads_k, head_dim=d,
                     src_row_stride=pr["row"], src_head_stride=splits * pr["head"], dst_row_stride=tr["row"],
                     dst_head_stride=tr["head"], num_partials=splits, partial_stride=pr["head"])


def _reduce_dbias(dbias_full, bias):
    """dL/dbias in the shape and dtype of the caller's bias: dS summed over its broadcast axes."""
    shape = tuple(bias.shape)
    padded = (1,) * (4 - len(shape)) + shape
    axes = tuple(a for a in range(4) if padded[a] == 1 and dbias_full.shape[a] != 1)
    reduced = dbias_full.sum(axis=axes, keepdims=True) if axes else dbias_full
    return reduced.reshape(shape).astype(bias.dtype)


# ----------------------------------------------------------------------------- public API

def attention_backward(dout, q, k, v, out, lse, *, rng_state=None, causal=False, scale=None, window=None,
                       softcap=0.0, alibi_slopes=None, mask=None, bias=None, block_mask=None,
                       block_size=(128, 128), dropout_p=0.0, deterministic=False, return_dbias=False,
                       dq=None, dk=None, dv=None):
    """Gradients of :func:`cuflash.attention` with respect to q, k and v (and bias).

    Pass the forward's inputs, options, ``out`` and ``lse`` (and, with dropout, its
    ``rng_state``) as :func:`cuflash.attention_forward` returned them; the probabilities are
    recomputed from ``lse``, and the dropout mask is regenerated from ``rng_state``.

    Parameters
    ----------
    dout : array (B, Sq, Hq, D), the dtype of q
        Gradient of the loss with respect to ``out``; any strides (copied if the last axis is not
        contiguous, e.g. a broadcast ``ones``).
    q : array (B, Sq, Hq, D); k, v : arrays (B, Sk, Hk, D)
        float16, bfloat16 or float32, as in the forward (GQA/MQA: Hq % Hk == 0).
    out : array (B, Sq, Hq, D)
        The forward's output.
    lse : float32 array (B, Hq, Sq)
        The forward's log-sum-exp (-inf for rows that saw no key: they get zero gradients).
    rng_state : numpy uint64 array (2,), optional
        The forward's ``(seed, offset)``; required when ``dropout_p > 0``.
    causal, scale, window, softcap, alibi_slopes, mask, bias, block_mask, block_size, dropout_p
        Exactly the forward's options (see :func:`cuflash.attention_forward`).
    deterministic : bool
        If true, dQ is computed by a separate pass without atomics, so that every result is
        bitwise identical from run to run (somewhat slower). dK/dV are always deterministic.
    return_dbias : bool
        Also return dL/dbias (requires ``bias``). This materialises a float32 (B, Hq, Sq, Sk)
        buffer, which is then summed over the axes along which ``bias`` was broadcast.
    dq : CuPy array (B, Sq, Hq, D), optional
    dk, dv : CuPy arrays (B, Sk, Hk, D), optional
        C-contiguous output buffers of the input dtype.

    Returns
    -------
    dq : CuPy array (B, Sq, Hq, D)
    dk, dv : CuPy arrays (B, Sk, Hk, D)
        Summed over the query heads that share each kv head.
    dbias : CuPy array of the shape and dtype of ``bias``
        Only when ``return_dbias`` is true.

    Raises
    ------
    TypeError, ValueError
        For any bad argument, before any launch; the output buffers are then left untouched.
    RuntimeError
        When no CUDA GPU is usable.

    Notes
    -----
    Per row i and key j (s the final score, P = exp(s - lse), D_i = rowsum(dO_i * O_i)):
    dV_j = sum_i Pdrop_ij dO_i, dP_ij = dO_i . V_j (times keep / (1 - p) under dropout),
    dS_ij = P_ij (dP_ij - D_i), then the chain rule through the softcap (1 - (s_cap / c)^2) and
    the scale: dQ_i = scale sum_j dS_ij K_j, dK_j = scale sum_i dS_ij Q_i; dbias_ij = dS_ij.
    Masked elements contribute exactly zero. A NaN in an element of q, k, v or dout that a
    row does not see can still reach the gradients of its tile through 0 * NaN in the matrix
    products (as in the forward's P V); visible NaNs propagate.
    """
    import cupy

    q, k, v, dtype_name = _check_qkv(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
    b, sq, hq, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"k must have the batch size of q ({b}), got {k.shape[0]}")
    sk, hk = k.shape[1], k.shape[2]
    dout = _check_like(dout, "dout", q)
    out = _check_like(out, "out", q)
    lse = _check_lse(lse, (b, hq, sq))
    scale, window, softcap, dropout_fields, deterministic = _check_common(
        head_dim=d, causal=causal, scale=scale, window=window, softcap=softcap, dropout_p=dropout_p,
        rng_state=rng_state, deterministic=deterministic)
    return_dbias = _check_flag(return_dbias, "return_dbias")
    if return_dbias and bias is None:
        raise ValueError("return_dbias=True needs a bias")
    score_fields = _score_operands(b, hq, sq, sk, alibi_slopes=alibi_slopes, mask=mask, bias=bias,
                                   block_mask=block_mask, block_size=block_size)
    bias_arr = _checks.as_cuda_array(bias, "bias") if return_dbias else None
    family = _family_for(dtype_name)
    d_pad = -(-d // 8) * 8
    dq, dq_t = _out_buffer(dq, "dq", (b, sq, hq, d), q.dtype, d_pad)
    dk, dk_t = _out_buffer(dk, "dk", (b, sk, hk, d), q.dtype, d_pad)
    dv, dv_t = _out_buffer(dv, "dv", (b, sk, hk, d), q.dtype, d_pad)

    if b == 0 or hq == 0 or sq == 0 or sk == 0:
        # No score at all: every gradient is zero (and dq/dk/dv may be empty).
        for x in (dq, dk, dv):
            x.fill(0)
        return (dq, dk, dv, cupy.zeros(bias_arr.shape, dtype=bias_arr.dtype)) if return_dbias else (dq, dk, dv)

    tensors = dict(zip(("q", "k", "v", "out", "dout"), (_kernel_ready(x, d_pad) for x in (q, k, v, out, dout))))
    tensors["lse"] = lse if lse.flags.c_contiguous else cupy.ascontiguousarray(lse)
    dbias_buf = cupy.zeros((b, hq, sq, sk), dtype=np.float32) if return_dbias else None
    fwd_fields = dict(seqlen_q=sq, seqlen_k=sk, window_left=window[0], window_right=window[1], scale=scale,
                      scale_log2=scale * math.log2(math.e), softcap=softcap)
    _run_backward(family=family, dtype_name=dtype_name, varlen=False, batch=b, max_q=sq, max_k=sk, heads_q=hq,
                  heads_k=hk, d=d, d_pad=d_pad, tensors=tensors, fwd_fields=fwd_fields,
                  score_fields=score_fields, dropout_fields=dropout_fields, deterministic=deterministic,
                  dq_t=dq_t, dk_t=dk_t, dv_t=dv_t, dbias_buf=dbias_buf)
    for result, target in ((dq, dq_t), (dk, dk_t), (dv, dv_t)):
        if target is not result:
            result[...] = target[..., :d]
    if return_dbias:
        return dq, dk, dv, _reduce_dbias(dbias_buf, bias_arr)
    return dq, dk, dv


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                              max_seqlen_k=None, rng_state=None, causal=False, scale=None, window=None,
                              softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False, dq=None,
                              dk=None, dv=None, mask=None, bias=None, block_mask=None):
    """Gradients of :func:`cuflash.attention_varlen` with respect to q, k and v.

    Parameters
    ----------
    dout, out : arrays (total_q, Hq, D), the dtype of q
    q : array (total_q, Hq, D); k, v : arrays (total_k, Hk, D)
    lse : float32 array (Hq, total_q)
        As ``attention_varlen(..., return_lse=True)`` returns it.
    cu_seqlens_q, cu_seqlens_k : int32 arrays (B + 1,) on the GPU
        The forward's (read back to the host once to be checked).
    max_seqlen_q, max_seqlen_k : int, optional
    rng_state : numpy uint64 array (2,), optional
        The forward's ``(seed, offset)``; required when ``dropout_p > 0``.
    causal, scale, window, softcap, alibi_slopes, dropout_p, deterministic
        As in :func:`attention_backward`; mask, bias and block_mask are not supported in varlen.
    dq : CuPy array (total_q, Hq, D), optional
    dk, dv : CuPy arrays (total_k, Hk, D), optional

    Returns
    -------
    dq : CuPy array (total_q, Hq, D)
    dk, dv : CuPy arrays (total_k, Hk, D)
    """
    import cupy

    for value, name in ((mask, "mask"), (bias, "bias"), (block_mask, "block_mask")):
        if value is not None:
            raise ValueError(f"{name} is not supported by attention_varlen_backward; pad and call "
                             "attention_backward instead")
    q, k, v, dtype_name = _check_qkv(q, k, v, 3, "(total, heads, head_dim)")
    total_q, hq, d = q.shape
    total_k, hk = k.shape[0], k.shape[1]
    dout = _check_like(dout, "dout", q)
    out = _check_like(out, "out", q)
    lse = _check_lse(lse, (hq, total_q))
    cu_q, cu_k, batch, max_q, max_k = _checks.check_varlen(cu_seqlens_q, cu_seqlens_k, total_q, total_k,
                                                           max_seqlen_q, max_seqlen_k)
    scale, window, softcap, dropout_fields, deterministic = _check_common(
        head_dim=d, causal=causal, scale=scale, window=window, softcap=softcap, dropout_p=dropout_p,
        rng_state=rng_state, deterministic=deterministic)
    score_fields = _score_operands(batch, hq, 1, 1, alibi_slopes=alibi_slopes, mask=None, bias=None,
                                   block_mask=None, block_size=(128, 128))
    family = _family_for(dtype_name)
    d_pad = -(-d // 8) * 8
    dq, dq_t = _out_buffer(dq, "dq", (total_q, hq, d), q.dtype, d_pad)
    dk, dk_t = _out_buffer(dk, "dk", (total_k, hk, d), q.dtype, d_pad)
    dv, dv_t = _out_buffer(dv, "dv", (total_k, hk, d), q.dtype, d_pad)

    if hq == 0 or max_q == 0 or max_k == 0:
        for x in (dq, dk, dv):
            x.fill(0)
        return dq, dk, dv

    tensors = dict(zip(("q", "k", "v", "out", "dout"), (_kernel_ready(x, d_pad) for x in (q, k, v, out, dout))))
    tensors["lse"] = lse if lse.flags.c_contiguous else cupy.ascontiguousarray(lse)
    fwd_fields = dict(seqlen_q=max_q, seqlen_k=max_k, cu_seqlens_q=cu_q.data.ptr, cu_seqlens_k=cu_k.data.ptr,
                      window_left=window[0], window_right=window[1], scale=scale,
                      scale_log2=scale * math.log2(math.e), softcap=softcap)
    _run_backward(family=family, dtype_name=dtype_name, varlen=True, batch=batch, max_q=max_q, max_k=max_k,
                  heads_q=hq, heads_k=hk, d=d, d_pad=d_pad, tensors=tensors, fwd_fields=fwd_fields,
                  score_fields=score_fields, dropout_fields=dropout_fields, deterministic=deterministic,
                  dq_t=dq_t, dk_t=dk_t, dv_t=dv_t, dbias_buf=None)
    for result, target in ((dq, dq_t), (dk, dk_t), (dv, dv_t)):
        if target is not result:
            result[...] = target[..., :d]
    return dq, dk, dv
