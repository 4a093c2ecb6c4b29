"""Backward attention: the gradients of :func:`cuflash.attention` with respect to q, k, v (and bias).

The kernels recompute the attention probabilities from the forward's ``lse`` instead of storing
them (FlashAttention-2's backward); nothing of size Sq x Sk is kept between forward and backward.
One call runs, on CuPy's current stream:

1. ``bwd_preprocess``: D = rowsum(dO * O) and lse * log2(e) per query row (float32, padded rows);
2. the dK/dV pass (``bwd_sm90`` on H100/H200, ``bwd_sm80``, ``bwd_simt``; pass 0): a CTA per block of
   keys of one kv head
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

import math

import numpy as np

from . import _checks, kernels
from ._runtime import capture as _capture, launch as _launch, memo as _memo
from ._backward_plan import _backward_plan, _family_for, _forced_family
from ._mask_blocks import bits_alone, call_block_mask
from ._scores import SCORE_OPERANDS, modifier_parts, score_operands, user_operands
from .modifiers.builtin import axis_len, bshd_facts, lowered, states_builtin
from .random import as_rng_state

__all__ = ["attention_backward", "attention_varlen_backward", "force_kernel", "FAMILIES"]

FAMILIES = kernels.backward.BWD_FAMILIES


def force_kernel(family: str):
    """Run every backward call inside a ``with`` block on one kernel family (tests and benchmarks).

    Parameters
    ----------
    family : {"bwd_sm90", "bwd_sm80", "bwd_simt"}
        bwd_sm90 (sm_90 GPUs) and bwd_sm80 run float16/bfloat16, bwd_simt float32; a family that
        cannot run a call (its dtype; for bwd_sm90 also the GPU, the head dim or the layouts) raises
        ValueError at that call, never falls back.

    Returns
    -------
    context manager
        Sets the family for the calls made inside the block (a context variable) and restores the
        previous choice when it ends.

    Raises
    ------
    ValueError
        If ``family`` is not one of the three names (when the block is entered).

    Examples
    --------
    >>> from cuflash import backward
    >>> with backward.force_kernel("bwd_sm80"):
    ...     dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse)
    """
    return _launch.forcing(_forced_family, family, FAMILIES)


# ----------------------------------------------------------------------------- argument checks

def _check_like(x, name: str, ref, ref_name: str = "q", head_dim_v: int | None = None):
    """dout / out: a CUDA array with the shape and dtype of ``ref``; with ``head_dim_v``, the shape of
    ``ref`` with v's head dim as its last axis (out's shape: design.md §2b)."""
    x = _checks.as_cuda_array(x, name)
    _checks.check_same_dtype(ref, ref_name, x, name)
    shape = tuple(ref.shape) if head_dim_v is None else tuple(ref.shape[:-1]) + (head_dim_v,)
    if tuple(x.shape) != shape:
        if shape == tuple(ref.shape):
            raise ValueError(f"{name} must have the shape of {ref_name} {shape}, got {tuple(x.shape)}")
        raise ValueError(f"{name} must have the shape of {ref_name} with v's head dim {shape}, got {tuple(x.shape)}")
    return x


def _check_lse(lse, shape, name="lse"):
    lse = _checks.as_cuda_array(lse, name)
    if lse.dtype != np.float32:
        raise TypeError(f"{name} must be float32 (as attention_forward returns lse), got {lse.dtype}")
    if tuple(lse.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (lse's), got {tuple(lse.shape)}")
    return lse


def _kernel_dlse(operands, has_dlse, shape):
    """(the checked dlse, its C-contiguous form for the kernels), or (None, None) without one: the
    last operand when the call has one."""
    if not has_dlse:
        return None, None
    import cupy

    dlse = _check_lse(operands[-1], shape, "dlse")
    return dlse, dlse if dlse.flags.c_contiguous else cupy.ascontiguousarray(dlse)


def _check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _dropout_state(dropout_p: float, rng_state):
    """The forward's (seed, offset) when the call has dropout (None otherwise), or, for an rng_state
    on the GPU, the address of its two words: the kernels read them there (never the host: no wait
    for the GPU, and a captured backward reads each replay's state)."""
    if dropout_p == 0.0:
        return None
    if rng_state is None:
        raise ValueError("dropout_p > 0 needs the forward's rng_state (attention_forward returns it)")
    if not _on_gpu(rng_state):
        return as_rng_state(rng_state)
    x = _checks.as_cuda_array(rng_state, "rng_state")
    if x.dtype.kind not in "iu" or x.dtype.itemsize != 8:
        raise TypeError(f"rng_state on the GPU must be uint64 (as a captured attention_forward returns it), got "
                        f"{x.dtype}")
    if tuple(x.shape) != (2,) or not x.flags.c_contiguous:
        raise ValueError(f"rng_state on the GPU must be a contiguous array of shape (2,) = [seed, offset], got shape "
                         f"{tuple(x.shape)}" + ("" if x.flags.c_contiguous else " (strided)"))
    return int(x.data.ptr)


def _on_gpu(x) -> bool:
    """Whether x is a CUDA array (CuPy, or DLPack on a CUDA device), not a host sequence."""
    if type(x).__module__.startswith("cupy"):
        return True
    device = getattr(x, "__dlpack_device__", None)
    return device is not None and not isinstance(x, np.ndarray) and int(device()[0]) in (2, 13)


def _check_common(*, head_dim, causal, scale, window, softcap, dropout_p, rng_state, deterministic, seqlens):
    scale = _checks.check_scale(scale, head_dim)
    window = _checks.check_window(window, causal, seqlens)
    softcap = _checks.check_softcap(softcap)
    dropout_p = _checks.check_dropout(dropout_p)
    deterministic = _check_flag(deterministic, "deterministic")
    return scale, window, softcap, dropout_p, _dropout_state(dropout_p, rng_state), deterministic


def _out_buffer(buf, name, shape, dtype, d_pad):
    """(user-visible result, kernel target) of a caller's gradient buffer, (None, None) for none:
    the kernels write pairs/float4s of d_pad columns, so a buffer whose head dim is not padded or
    whose rows are not 16-byte aligned gets a private target."""
    import cupy

    if buf is None:   # the plan allocates it
        return None, None
    result = _checks.check_out(buf, name, shape, dtype)
    if shape[-1] == d_pad and result.data.ptr % 16 == 0:
        return result, result
    return result, cupy.empty(shape[:-1] + (d_pad,), dtype=dtype)


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
                       block_size=(128, 128), dropout_p=0.0, score_mod=None, mask_mod=None, sinks=None,
                       deterministic=False, return_dbias=False, return_dsinks=False, dq=None, dk=None, dv=None,
                       dlse=None):
    """Gradients of :func:`attention` with respect to q, k and v (and bias).

    Pass the forward's inputs and options, and ``out``, ``lse`` (and, with dropout, ``rng_state``) as
    :func:`attention_forward` returned them: the probabilities are recomputed from ``lse`` (nothing
    of size Sq x Sk is kept between the passes) and the dropout mask is regenerated from
    ``rng_state``. Runs on CuPy's current stream, with no host synchronisation.

    Parameters
    ----------
    dout : CUDA array (B, Sq, Hq, D_v), the dtype of q
        Gradient of the loss with respect to ``out``. Any strides (copied if the last axis is not
        contiguous, e.g. a broadcast ``ones``).
    q : CUDA array (B, Sq, Hq, D)
        float16, bfloat16 or float32, as given to the forward.
    k : CUDA array (B, Sk, Hk, D), the dtype of q
    v : CUDA array (B, Sk, Hk, D_v), the dtype of q
        D_v, v's head dim, may differ from D (design.md §2b); out (and dout, dv) have it.
        As given to the forward (GQA/MQA: ``Hq % Hk == 0``).
    out : CUDA array (B, Sq, Hq, D_v), the dtype of q
        The forward's output.
    lse : CUDA float32 array (B, Hq, Sq)
        The forward's log-sum-exp (``-inf`` rows saw no key: their gradients are 0).
    rng_state : numpy uint64 array (2,) = (seed, offset), optional
        The forward's; required when ``dropout_p > 0``. On the GPU (a CuPy uint64 (2,) array, as a
        forward captured in a CUDA graph returns it) the kernels read it there: no wait for the GPU,
        and a captured backward reads the state of each replay.
    causal, scale, window, softcap, alibi_slopes, mask, bias, block_mask, block_size, dropout_p
        Exactly the forward's options (see :func:`attention`).
    score_mod, mask_mod : cuflash.ScoreMod, cuflash.MaskMod, optional
        The forward's (see :func:`attention`). dS goes through the ScoreMod's ``grad``
        (d expr / d score at its input); one whose derivative is not exactly 1 needs it (a
        ValueError without). Not with ``return_dbias``.
    sinks : CUDA float32 array (Hq,), optional
        The forward's attention sinks (see :func:`attention`). ``lse`` already holds them, so dq, dk and
        dv need nothing more: they are read only for ``return_dsinks``.
    deterministic : bool, default False
        If true, dQ is accumulated without atomics (in a fixed order, or by a separate pass), so that
        every result is bitwise identical from run to run (somewhat slower). dK and dV are always
        deterministic.
    return_dbias : bool, default False
        Also return dL/dbias (needs ``bias``). This materialises a float32 (B, Hq, Sq, Sk) buffer,
        then summed over the axes along which ``bias`` was broadcast; such a call cannot be captured
        in a CUDA graph.
    return_dsinks : bool, default False
        Also return dL/dsinks (needs ``sinks``): ``dsinks[h] = -sum over b, i of exp(sinks[h] -
        lse[b, h, i]) * D_i`` with ``D_i = rowsum(dO_i * O_i)`` (the sink's probability times -D_i).
        Summed in a fixed order, so bitwise reproducible from run to run whatever ``deterministic``.
    dq : CUDA array (B, Sq, Hq, D), the dtype of q, optional
    dk : CUDA array (B, Sk, Hk, D), the dtype of q, optional
    dv : CUDA array (B, Sk, Hk, D_v), the dtype of q, optional
        C-contiguous buffers to write the gradients into (returned as given); they may not overlap
        each other or any input.
    dlse : CUDA float32 array (B, Hq, Sq), optional
        Gradient of the loss with respect to ``lse``, when the loss reads it (merged partial results,
        a penalty on large lse): d lse_i / d s_ij = P_ij, so ``D_i`` becomes ``rowsum(dO_i * O_i) -
        dlse_i`` (also in ``dsinks``). A row that saw no key (lse ``-inf``) takes nothing from it.

    Returns
    -------
    dq : CuPy array (B, Sq, Hq, D)
    dk : CuPy array (B, Sk, Hk, D)
    dv : CuPy array (B, Sk, Hk, D_v)
        In the dtype of q; dk and dv summed over the query heads that share each kv head.
    dbias : CuPy array of the shape and dtype of ``bias``
        Only with ``return_dbias``.
    dsinks : CuPy float32 array (Hq,)
        Only with ``return_dsinks``; last.

    Raises
    ------
    TypeError
        As :func:`attention_forward`; ``dout``/``out`` of another dtype than q, ``lse``/``dlse`` not float32,
        an ``rng_state`` that does not hold integers, ``deterministic``/``return_dbias``/``return_dsinks``
        not bool, ``sinks`` not float32.
    ValueError
        As :func:`attention_forward`; ``dout``/``out``/``lse``/``dlse`` of the wrong shape, ``dropout_p > 0``
        without ``rng_state``, ``return_dbias`` without ``bias`` or with both ``score_mod`` and
        ``softcap``, ``return_dsinks`` without ``sinks``, ``sinks`` not of shape (Hq,), a ``score_mod``
        whose derivative is not 1 without its ``grad``, ``dq``/``dk``/``dv`` of the wrong
        shape, not C-contiguous or overlapping an input. Nothing is launched and the output
        buffers are left untouched.
    RuntimeError
        CuPy or a usable CUDA GPU is missing, or a call that needs copies (or ``return_dbias``) is
        being captured.

    Notes
    -----
    Per row i and key j (s the final score, P = exp(s - lse), D_i = rowsum(dO_i * O_i) - dlse_i):
    dV_j = sum_i Pdrop_ij dO_i, dP_ij = dO_i . V_j (times keep / (1 - p) under dropout),
    dS_ij = P_ij (dP_ij - D_i), then the chain rule through the softcap (1 - (s_cap / c)^2) and
    the scale: dQ_i = scale sum_j dS_ij K_j, dK_j = scale sum_i dS_ij Q_i; dbias_ij = dS_ij.
    Masked elements contribute exactly zero. A NaN in an element of q, k, v or dout that a
    row does not see can still reach the gradients of its tile through 0 * NaN in the matrix
    products (as in the forward's P V); visible NaNs propagate.

    Examples
    --------
    >>> import cupy as cp
    >>> import cuflash
    >>> q = cp.random.standard_normal((2, 512, 8, 64), dtype=cp.float32).astype(cp.float16)
    >>> k, v = (cp.random.standard_normal((2, 512, 2, 64), dtype=cp.float32).astype(cp.float16)
    ...         for _ in range(2))
    >>> bias = cp.zeros((1, 8, 512, 512), dtype=cp.float32)   # one bias for the batch
    >>> out, lse, _ = cuflash.attention_forward(q, k, v, causal=True, bias=bias)
    >>> dout = cp.random.standard_normal(out.shape, dtype=cp.float32).astype(cp.float16)
    >>> dq, dk, dv, dbias = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, bias=bias,
    ...                                                return_dbias=True, deterministic=True)
    >>> dk.shape, dbias.shape
    ((2, 512, 2, 64), (1, 8, 512, 512))
    """
    return _backward(dout, q, k, v, out, lse, rng_state, causal, scale, window, softcap, alibi_slopes, mask, bias,
                     block_mask, block_size, dropout_p, score_mod, mask_mod, sinks, deterministic, return_dbias,
                     return_dsinks, dq, dk, dv, dlse)


def _backward(dout, q, k, v, out, lse, rng_state, causal, scale, window, softcap, alibi_slopes, mask, bias,
              block_mask, block_size, dropout_p, score_mod, mask_mod, sinks, deterministic, return_dbias,
              return_dsinks, dq, dk, dv, dlse, replay_only=False):
    """The body of :func:`attention_backward`, its arguments positional (keywords cost a repeat call
    ~0.2 us). ``replay_only``: return None, having done nothing, unless the call replays a remembered
    plan (:func:`cuflash.interop._torch_stream.replay`; calls without modifiers only, whose lowering and
    block masks come before the lookup)."""
    mod_key = mask_bits = None
    if states_builtin(score_mod, mask_mod):   # as the forward: what they state runs built in
        score_mod, mask_mod, window, softcap, alibi_slopes = lowered(
            score_mod, mask_mod, causal, window, softcap, alibi_slopes, bias, *bshd_facts(q, k), backward=True)
    if score_mod is not None or mask_mod is not None:
        mod_key, user_arrays = modifier_parts(score_mod, mask_mod)
        if mask_mod is not None and mask_mod.derives_blocks:   # the tiles it hides are skipped
            block_mask, block_size, mask_bits = call_block_mask(
                "attention_backward", mask_mod, q, k, block_mask, block_size,
                bits_alone(score_mod, softcap, alibi_slopes, mask, bias))
            if mask_bits is not None:   # the kernels read the MaskMod's bits, not its expression
                mask_mod, user_arrays, mod_key = None, (), ("mask bits", mask_bits)
    operands = (dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, mask, bias, block_mask, sinks, None)
    if mod_key is not None:
        operands = operands + user_arrays
    if dlse is not None:   # the last operand (the memo tells the calls apart by their operands)
        operands = operands + (dlse,)
    options = (causal, scale, window, softcap, block_size, dropout_p, deterministic, return_dbias,
               _forced_family.get(), (0, 0), mod_key, return_dsinks)
    plan, ptrs, where = _memo.lookup("attention_backward", operands, options)
    finish = None
    if plan is None:
        if replay_only:
            return None
        plan, ptrs, finish = _plan_backward(operands, ptrs, rng_state=rng_state, causal=causal, scale=scale,
                                            window=window, softcap=softcap, block_size=block_size,
                                            dropout_p=dropout_p, deterministic=deterministic,
                                            return_dbias=return_dbias, modifiers=(score_mod, mask_mod),
                                            return_dsinks=return_dsinks, mask_bits=mask_bits,
                                            has_dlse=dlse is not None)
        if plan is None:
            return finish
    rng = None if plan.dropout is None else _dropout_state(dropout_p, rng_state)
    grads, temps, _ = plan.run(operands, ptrs, where, rng_state=rng)
    return finish(grads, temps, plan) if finish is not None else tuple(grads)


def _backward_at(dout, q, k, v, out, lse, *, dropout_origin=(0, 0), rng_state=None, causal=False, scale=None,
                 window=None, softcap=0.0, alibi_slopes=None, mask=None, bias=None, block_mask=None,
                 block_size=(128, 128), dropout_p=0.0, deterministic=False, return_dbias=False, dq=None, dk=None,
                 dv=None):
    """:func:`attention_backward` of a forward made by :func:`cuflash.attention._forward_at` with the same
    ``dropout_origin`` (ring attention's chunk pairs): it regenerates that block of the larger call's
    dropout mask. Private; the body of :func:`_backward` (without modifiers or dlse) with the origin in
    the plan's key."""
    if isinstance(dropout_origin, list):
        dropout_origin = tuple(dropout_origin)   # a key of the plan memo: hashable
    operands = (dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, mask, bias, block_mask, None, None)
    options = (causal, scale, window, softcap, block_size, dropout_p, deterministic, return_dbias,
               _forced_family.get(), dropout_origin, None, False)
    plan, ptrs, where = _memo.lookup("attention_backward", operands, options)
    finish = None
    if plan is None:
        plan, ptrs, finish = _plan_backward(operands, ptrs, rng_state=rng_state, causal=causal, scale=scale,
                                            window=window, softcap=softcap, block_size=block_size,
                                            dropout_p=dropout_p, deterministic=deterministic,
                                            return_dbias=return_dbias, dropout_origin=dropout_origin)
        if plan is None:
            return finish
    rng = None if plan.dropout is None else _dropout_state(dropout_p, rng_state)
    grads, temps, _ = plan.run(operands, ptrs, where, rng_state=rng)
    return finish(grads, temps, plan) if finish is not None else tuple(grads)


def _gradient_targets(dq, dk, dv, shapes, dtype, d, d_pad, dv_pad=None):
    """The caller's gradient buffers and the kernels' targets: (results, targets, layouts). dv has
    its own head dim (``shapes[2][-1]``, padded ``dv_pad``)."""
    results, targets, layouts = [], [], []
    pads = (d_pad, d_pad, dv_pad or d_pad)
    for buf, name, shape, pad in zip((dq, dk, dv), ("dq", "dk", "dv"), shapes, pads):
        result, target = _out_buffer(buf, name, shape, dtype, pad)
        if result is None and pad != shape[-1]:   # the kernels write pad columns: a private target
            import cupy

            target = cupy.empty(shape[:-1] + (pad,), dtype=dtype)
        results.append(result)
        targets.append(target)
        layouts.append(target if target is not None else _checks.Shaped(shape, dtype))
    return results, targets, layouts


def _finisher(users, results, targets, dims, reduce_dbias=None):
    """What a call does after its launches: copy private targets into the caller's buffers (or
    new ones), reduce dbias; returns the gradients as the caller sees them (dsinks, a result of the
    plan after dq, dk, dv, last). ``dims``: the head dims of dq, dk, dv."""
    import cupy

    def finish(grads, temps, plan):
        final = []
        for user, result, target, grad, d in zip(users, results, targets, grads[:3], dims):
            if target is not None and target is not result:
                if result is None:
                    result = cupy.empty(target.shape[:-1] + (d,), dtype=target.dtype)
                result[...] = target[..., :d]
            final.append(user if user is not None else (result if result is not None else grad))
        if reduce_dbias is not None:
            final.append(reduce_dbias(_memo.temp_array(plan, temps, len(plan.temps) - 1)))
        final.extend(grads[3:])
        return tuple(final)

    return finish


def _plan_backward(operands, key, *, rng_state, causal, scale, window, softcap, block_size, dropout_p,
                   deterministic, return_dbias, dropout_origin=(0, 0), modifiers=(None, None), return_dsinks=False,
                   mask_bits=None, has_dlse=False):
    """The full path of :func:`attention_backward`: (plan, pointers, finish), or (None, None, result)
    for a call that launches nothing. Operands: dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, mask,
    bias, block_mask, sinks, dsinks (None: the plan's output), then the ScoreMod/MaskMod arrays, then
    dlse when ``has_dlse``. ``mask_bits``: as in :func:`cuflash.attention._plan_attention`."""
    import cupy

    dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, mask, bias, block_mask, sinks = operands[:14]
    return_dsinks = _checks.check_return_dsinks(return_dsinks, sinks)
    q, k, v, dtype_name = _checks.check_qkv(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
    b, sq, hq, d = q.shape
    dv_dim = v.shape[-1]   # out, dout and dv have v's head dim (design.md §2b)
    if k.shape[0] != b:
        raise ValueError(f"k must have the batch size of q ({b}), got {k.shape[0]}")
    sk, hk = k.shape[1], k.shape[2]
    _checks.check_problem_size(q, k, batch=b, seqlen_q=sq, seqlen_k=sk, varlen=False)
    dout = _check_like(dout, "dout", q, head_dim_v=dv_dim)
    out = _check_like(out, "out", q, head_dim_v=dv_dim)
    lse = _check_lse(lse, (b, hq, sq))
    dlse, dlse_k = _kernel_dlse(operands, has_dlse, (b, hq, sq))
    scale, window, softcap, dropout_p, _, deterministic = _check_common(
        head_dim=d, causal=causal, scale=scale, window=window, softcap=softcap, dropout_p=dropout_p,
        rng_state=rng_state, deterministic=deterministic, seqlens=(sq, sk))
    origin_fields = _checks.check_dropout_origin(dropout_origin, (sq, sk))
    return_dbias = _check_flag(return_dbias, "return_dbias")
    if return_dbias and bias is None:
        raise ValueError("return_dbias=True needs a bias")
    if return_dbias and modifiers[0] is not None and softcap > 0:
        # The kernels keep one factor per score, d s / d (scale q.k): the ScoreMod's derivative times the
        # softcap's. dbias is dL/dy at the ScoreMod's input (through it, not through the softcap), which
        # that product gives only without a softcap.
        raise ValueError("return_dbias=True is not supported together with a score_mod and a softcap (put the "
                         "cap inside the score_mod, or leave the bias without a gradient)")
    score_fields, score_arrays = score_operands(b, hq, sq, sk, alibi_slopes=alibi_slopes, mask=mask, bias=bias,
                                                block_mask=block_mask, block_size=block_size, first=9,
                                                mask_bits=mask_bits)
    sinks = _checks.check_sinks(sinks, hq)
    user_fields, user_arrays, user_mods, user_source = user_operands(*modifiers, first=15, backward=True)
    bias_arr = _checks.as_cuda_array(bias, "bias") if return_dbias else None
    family = _family_for(dtype_name)
    d_pad, dv_pad = -(-d // 8) * 8, -(-dv_dim // 8) * 8
    users = (dq, dk, dv)
    shapes = ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv_dim))
    results, targets, layouts = _gradient_targets(dq, dk, dv, shapes, q.dtype, d, d_pad, dv_pad)
    _checks.check_disjoint(zip(("dq", "dk", "dv"), results),
                           (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse),
                            ("dlse", dlse), *zip(SCORE_OPERANDS, score_arrays), ("sinks", sinks),
                            *((("score_mod/mask_mod argument", x) for x in user_arrays))))

    if b == 0 or hq == 0 or sq == 0 or sk == 0:
        # No score at all: every gradient is zero (and dq/dk/dv may be empty).
        _memo.nothing_to_plan()
        grads = []
        for user, result, shape in zip(users, results, shapes):
            x = result if result is not None else cupy.empty(shape, dtype=q.dtype)
            x.fill(0)
            grads.append(user if user is not None else x)
        if return_dbias:
            grads.append(cupy.zeros(bias_arr.shape, dtype=bias_arr.dtype))
        if return_dsinks:
            grads.append(cupy.zeros((hq,), dtype=np.float32))
        return None, None, tuple(grads)

    kernel = [_checks.kernel_ready(x, pad) for x, pad in zip((q, k, v, out, dout), (d_pad, d_pad, dv_pad, dv_pad, dv_pad))]
    lse_k = lse if lse.flags.c_contiguous else cupy.ascontiguousarray(lse)
    fwd_fields = dict(seqlen_q=sq, seqlen_k=sk, window_left=window[0], window_right=window[1], scale=scale,
                      scale_log2=scale * math.log2(math.e), softcap=softcap, **origin_fields)
    plan = _backward_plan("attention_backward", len(operands), family=family, dtype_name=dtype_name,
                          varlen=False, batch=b, max_q=sq, max_k=sk, heads_q=hq, heads_k=hk, d=d, d_pad=d_pad,
                          dv=dv_dim, dv_pad=dv_pad,
                          layouts=dict(zip(("q", "k", "v", "out", "dout"), kernel[:4] + [kernel[4]]),
                                       dq=layouts[0], dk=layouts[1], dv=layouts[2]),
                          lse_head_stride=lse_k.shape[-1], fwd_fields=fwd_fields,
                          score_fields={**score_fields, **user_fields}, dropout_p=dropout_p,
                          deterministic=deterministic, dbias_shape=(b, hq, sq, sk) if return_dbias else None,
                          user_mods=user_mods, user_source=user_source, dsinks=(13, 14) if return_dsinks else None,
                          score_arrays=dict(zip(SCORE_OPERANDS, score_arrays)),
                          dlse_at=len(operands) - 1 if has_dlse else None)
    qk, kk, vk, ok, dok = kernel
    kernel_operands = (dok, qk, kk, vk, ok, lse_k, *targets, *score_arrays, sinks, None, *user_arrays,
                       *((dlse_k,) if has_dlse else ()))
    ptrs = _memo.pointers(kernel_operands)
    in_place = _memo.in_place(operands, kernel_operands) and not return_dbias
    if return_dbias:
        _capture.refuse_capture("attention_backward", "return_dbias sums dS over the broadcast axes of bias "
                                 "into a new array, through temporaries that live only during the call")
    elif not in_place:
        _capture.refuse_capture("attention_backward", _capture.COPIES_NOT_CAPTURED)
    _memo.remember(key if in_place else None, plan)
    needs_finish = return_dbias or any(t is not None and t is not r for t, r in zip(targets, results)) or any(
        u is not None and type(u) is not cupy.ndarray for u in users)
    reduce = (lambda full: _reduce_dbias(full, bias_arr)) if return_dbias else None
    return plan, ptrs, _finisher(users, results, targets, (d, d, dv_dim), reduce) if needs_finish else None


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                              max_seqlen_k=None, rng_state=None, causal=False, scale=None, window=None,
                              softcap=0.0, alibi_slopes=None, dropout_p=0.0, score_mod=None, mask_mod=None,
                              sinks=None, deterministic=False, return_dsinks=False, dq=None, dk=None, dv=None,
                              mask=None, bias=None, block_mask=None, check=None, dlse=None):
    """Gradients of :func:`attention_varlen` with respect to q, k and v.

    Pass the forward's inputs, options, ``out`` and ``lse`` (``return_lse=True``); as
    :func:`attention_backward`, per packed sequence.

    Parameters
    ----------
    dout : CUDA array (total_q, Hq, D_v), the dtype of q
        Gradient of the loss with respect to ``out``.
    q : CUDA array (total_q, Hq, D)
    k : CUDA array (total_k, Hk, D)
    v : CUDA array (total_k, Hk, D_v)
        As given to the forward.
    out : CUDA array (total_q, Hq, D_v)
        The forward's output.
    lse : CUDA float32 array (Hq, total_q)
        As ``attention_varlen(..., return_lse=True)`` returns it.
    cu_seqlens_q, cu_seqlens_k : CUDA int32 arrays (B + 1,)
        The forward's; never read back: checked on the GPU as in :func:`attention_varlen`.
    max_seqlen_q, max_seqlen_k : int, optional
        Bounds of the longest sequences (default: the totals, correct but with a larger grid).
    rng_state : numpy uint64 array (2,) = (seed, offset), optional
        The forward's dropout state; required when ``dropout_p > 0``. Since
        :func:`attention_varlen` does not return it, draw it with ``generator.next_state()`` before
        the forward and give the forward a generator set to it (as :mod:`cuflash.interop.torch`
        does); on the GPU as in :func:`attention_backward`.
    causal, scale, window, softcap, alibi_slopes, dropout_p, deterministic
        As in :func:`attention_backward`.
    score_mod, mask_mod : cuflash.ScoreMod, cuflash.MaskMod, optional
        The forward's (see :func:`attention_varlen`), with their gradient as in
        :func:`attention_backward`.
    sinks : CUDA float32 array (Hq,), optional
        The forward's attention sinks; read only for ``return_dsinks``.
    return_dsinks : bool, default False
        Also return dL/dsinks, float32 (Hq,), summed over every sequence's rows (as in
        :func:`attention_backward`, bitwise reproducible).
    dq : CUDA array (total_q, Hq, D), optional
    dk, dv : CUDA arrays (total_k, Hk, D), optional
        C-contiguous buffers of the dtype of q to write the gradients into; they may not overlap
        each other or any input.
    mask, bias, block_mask : None
        Not supported in varlen (a ValueError).
    check : bool, optional
        As in :func:`attention_varlen`: raise bad offsets now (True) or at a later call (False).
    dlse : CUDA float32 array (Hq, total_q), optional
        Gradient of the loss with respect to ``lse``, as in :func:`attention_backward`.

    Returns
    -------
    dq : CuPy array (total_q, Hq, D)
    dk : CuPy array (total_k, Hk, D)
    dv : CuPy array (total_k, Hk, D_v)
        In the dtype of q; dk and dv summed over the query heads that share each kv head.
    dsinks : CuPy float32 array (Hq,)
        Only with ``return_dsinks``.

    Raises
    ------
    TypeError, ValueError
        As :func:`attention_backward` and :func:`attention_varlen`, naming the argument, before any
        launch (offsets found wrong on the GPU: a ValueError, see ``check``).
    RuntimeError
        CuPy or a usable CUDA GPU is missing, or a call that needs copies is being captured.

    Examples
    --------
    >>> import cupy as cp
    >>> import cuflash
    >>> cu = cp.asarray([0, 100, 137, 649], dtype=cp.int32)
    >>> q, k, v = (cp.random.standard_normal((649, 8, 64), dtype=cp.float32).astype(cp.float16)
    ...            for _ in range(3))
    >>> out, lse = cuflash.attention_varlen(q, k, v, cu, cu, max_seqlen_q=512, max_seqlen_k=512,
    ...                                     causal=True, return_lse=True)
    >>> dq, dk, dv = cuflash.attention_varlen_backward(cp.ones_like(out), q, k, v, out, lse, cu, cu,
    ...                                                max_seqlen_q=512, max_seqlen_k=512, causal=True)
    """
    for value, name in ((mask, "mask"), (bias, "bias"), (block_mask, "block_mask")):
        if value is not None:
            raise ValueError(f"{name} is not supported by attention_varlen_backward; pad and call "
                             "attention_backward instead")
    mod_key = None
    if states_builtin(score_mod, mask_mod):   # as the forward
        score_mod, mask_mod, window, softcap, alibi_slopes = lowered(
            score_mod, mask_mod, causal, window, softcap, alibi_slopes, None, axis_len(q, 1),
            cu_seqlens_q is cu_seqlens_k, backward=True)
    operands = (dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, cu_seqlens_q, cu_seqlens_k, sinks, None)
    if score_mod is not None or mask_mod is not None:
        mod_key, user_arrays = modifier_parts(score_mod, mask_mod)
        operands = operands + user_arrays
    if dlse is not None:   # the last operand
        operands = operands + (dlse,)
    options = (max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, dropout_p, deterministic,
               _forced_family.get(), mod_key, return_dsinks)
    plan, ptrs, where = _memo.lookup("attention_varlen_backward", operands, options)
    finish = None
    if plan is None:
        plan, ptrs, finish = _plan_varlen_backward(operands, ptrs, max_seqlen_q=max_seqlen_q,
                                                   max_seqlen_k=max_seqlen_k, rng_state=rng_state, causal=causal,
                                                   scale=scale, window=window, softcap=softcap,
                                                   dropout_p=dropout_p, deterministic=deterministic,
                                                   modifiers=(score_mod, mask_mod), return_dsinks=return_dsinks,
                                                   has_dlse=dlse is not None)
        if plan is None:
            return finish
    rng = None if plan.dropout is None else _dropout_state(dropout_p, rng_state)
    grads, temps, _ = plan.run(operands, ptrs, where, rng_state=rng, check=_checks.check_flag(check))
    return finish(grads, temps, plan) if finish is not None else tuple(grads)


def _plan_varlen_backward(operands, key, *, max_seqlen_q, max_seqlen_k, rng_state, causal, scale, window, softcap,
                          dropout_p, deterministic, modifiers=(None, None), return_dsinks=False, has_dlse=False):
    """The full path of :func:`attention_varlen_backward` (see :func:`_plan_backward`). Operands: dout, q, k,
    v, out, lse, dq, dk, dv, alibi_slopes, cu_seqlens_q, cu_seqlens_k, sinks, dsinks, then the
    ScoreMod/MaskMod arrays, then dlse when ``has_dlse``."""
    import cupy

    dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, cu_seqlens_q, cu_seqlens_k, sinks = operands[:13]
    return_dsinks = _checks.check_return_dsinks(return_dsinks, sinks)
    q, k, v, dtype_name = _checks.check_qkv(q, k, v, 3, "(total, heads, head_dim)")
    total_q, hq, d = q.shape
    dv_dim = v.shape[-1]
    total_k, hk = k.shape[0], k.shape[1]
    dout = _check_like(dout, "dout", q, head_dim_v=dv_dim)
    out = _check_like(out, "out", q, head_dim_v=dv_dim)
    lse = _check_lse(lse, (hq, total_q))
    dlse, dlse_k = _kernel_dlse(operands, has_dlse, (hq, total_q))
    cu_q, cu_k, batch, max_q, max_k = _checks.check_varlen(cu_seqlens_q, cu_seqlens_k, total_q, total_k,
                                                           max_seqlen_q, max_seqlen_k)
    _checks.check_problem_size(q, k, batch=batch, seqlen_q=max_q, seqlen_k=max_k, varlen=True)
    scale, window, softcap, dropout_p, _, deterministic = _check_common(
        head_dim=d, causal=causal, scale=scale, window=window, softcap=softcap, dropout_p=dropout_p,
        rng_state=rng_state, deterministic=deterministic, seqlens=(max_q, max_k))
    score_fields, score_arrays = score_operands(batch, hq, 1, 1, alibi_slopes=alibi_slopes, mask=None, bias=None,
                                                block_mask=None, block_size=(128, 128), first=9)
    sinks = _checks.check_sinks(sinks, hq)
    user_fields, user_arrays, user_mods, user_source = user_operands(*modifiers, first=14, backward=True)
    family = _family_for(dtype_name)
    d_pad, dv_pad = -(-d // 8) * 8, -(-dv_dim // 8) * 8
    users = (dq, dk, dv)
    shapes = ((total_q, hq, d), (total_k, hk, d), (total_k, hk, dv_dim))
    results, targets, layouts = _gradient_targets(dq, dk, dv, shapes, q.dtype, d, d_pad, dv_pad)
    _checks.check_disjoint(zip(("dq", "dk", "dv"), results),
                           (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse),
                            ("dlse", dlse), ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k), ("alibi_slopes", score_arrays[0]),
                            ("sinks", sinks), *((("score_mod/mask_mod argument", x) for x in user_arrays))))

    if hq == 0 or batch == 0 or max_q == 0 or max_k == 0 or total_q == 0:
        _memo.nothing_to_plan()
        grads = []
        for user, result, shape in zip(users, results, shapes):
            x = result if result is not None else cupy.empty(shape, dtype=q.dtype)
            x.fill(0)
            grads.append(user if user is not None else x)
        if return_dsinks:
            grads.append(cupy.zeros((hq,), dtype=np.float32))
        return None, None, tuple(grads)

    kernel = [_checks.kernel_ready(x, pad) for x, pad in zip((q, k, v, out, dout), (d_pad, d_pad, dv_pad, dv_pad, dv_pad))]
    lse_k = lse if lse.flags.c_contiguous else cupy.ascontiguousarray(lse)
    fwd_fields = dict(seqlen_q=max_q, seqlen_k=max_k, window_left=window[0], window_right=window[1], scale=scale,
                      scale_log2=scale * math.log2(math.e), softcap=softcap)
    score_fields = {**score_fields, "cu_seqlens_q": ("operand", 10), "cu_seqlens_k": ("operand", 11), **user_fields}
    check = dict(cu_seqlens_q=("operand", 10), cu_seqlens_k=("operand", 11), batch=batch, total_q=total_q,
                 total_k=total_k, max_seqlen_q=max_q if max_seqlen_q is not None else 0,
                 max_seqlen_k=max_k if max_seqlen_k is not None else 0)
    plan = _backward_plan("attention_varlen_backward", len(operands), family=family, dtype_name=dtype_name,
                          varlen=True, batch=batch, max_q=max_q, max_k=max_k, heads_q=hq, heads_k=hk, d=d,
                          d_pad=d_pad, dv=dv_dim, dv_pad=dv_pad, layouts=dict(zip(("q", "k", "v", "out", "dout"), kernel),
                                                    dq=layouts[0], dk=layouts[1], dv=layouts[2]),
                          lse_head_stride=lse_k.shape[-1], fwd_fields=fwd_fields, score_fields=score_fields,
                          dropout_p=dropout_p, deterministic=deterministic, dbias_shape=None, check=check,
                          user_mods=user_mods, user_source=user_source, dsinks=(12, 13) if return_dsinks else None,
                          dlse_at=len(operands) - 1 if has_dlse else None)
    qk, kk, vk, ok, dok = kernel
    kernel_operands = (dok, qk, kk, vk, ok, lse_k, *targets, score_arrays[0], cu_q, cu_k, sinks, None, *user_arrays,
                       *((dlse_k,) if has_dlse else ()))
    ptrs = _memo.pointers(kernel_operands)
    in_place = _memo.in_place(operands, kernel_operands)
    if not in_place:
        _capture.refuse_capture("attention_varlen_backward", _capture.COPIES_NOT_CAPTURED)
    _memo.remember(key if in_place else None, plan)
    needs_finish = any(t is not None and t is not r for t, r in zip(targets, results)) or any(
        u is not None and type(u) is not cupy.ndarray for u in users)
    return plan, ptrs, _finisher(users, results, targets, (d, d, dv_dim)) if needs_finish else None
