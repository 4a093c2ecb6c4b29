"""Float64 host reference for the attention backward, from the analytic formulas (no tiling).

The gradients of :func:`cuflash.reference.attention_forward` with respect to q, k, v and bias,
for a loss whose gradient with respect to ``out`` is ``dout``. Everything is recomputed from
q, k, v in float64 (the scores with :func:`cuflash.reference.attention_scores`, so the two
references share one score pipeline). Per batch ``b``, query head ``h``, row ``i``, key ``j``::

    P_ij     = exp(s_ij - lse_i)                      (0 where (i, j) is masked)
    Pdrop_ij = P_ij * keep_ij / (1 - p)               (P without dropout)
    dV_j     = sum_i Pdrop_ij dO_i
    dP_ij    = dO_i . V_j * keep_ij / (1 - p)
    D_i      = sum_j P_ij dP_ij - dlse_i              (= dO_i . O_i - dlse_i; dO_i . out_i - dlse_i for a
                                                      given out; dlse = dL/dlse when the loss reads lse,
                                                      as d lse_i / d s_ij = P_ij)
    dS_ij    = P_ij (dP_ij - D_i)                     (dL/ds)
    dY_ij    = dS_ij * g(y_ij)                        (a score_mod with derivative g at its input y),
                                                      else dS_ij; dL/dbias_ij
    dX_ij    = dY_ij * (1 - tanh(x_ij / c)^2)         (softcap c; x = scale * q_i . k_j), else dY_ij
    dQ_i     = scale * sum_j dX_ij K_j,    dK_j = scale * sum_i dX_ij Q_i
    dsink_h  = -sum_(b, i) exp(sink_h - lse_i) D_i    (attention sinks: lse holds exp(sink_h))

dK and dV of a kv head are summed over the query heads that share it (GQA/MQA); dbias is summed
over the axes along which the bias was broadcast. Masked elements contribute exactly nothing
(a NaN or Inf there never reaches a gradient); a NaN in anything a row sees propagates.
"""

from __future__ import annotations

import numpy as np

from cuflash.random import as_rng_state, dropout_keep

from . import _forward as _ref

__all__ = ["attention_backward", "attention_varlen_backward"]


def _grads(dout, q, k, v, batch_ids, *, dropout_p, rng_state, return_dbias, bias, scale, softcap, out=None,
           score_mod=None, sinks=None, dlse=None, **score_options):
    """Gradients on float64 (B, S, H, D) arrays, (dq, dk, dv, ds, dsinks); ``batch_ids`` label the
    batches for dropout; D_i from ``out`` (B, Sq, Hq, Dv) when given, less ``dlse`` (B, Hq, Sq) when
    given; dsinks (Hq,) or None."""
    B, Sq, Hq, D = q.shape
    Sk, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    dq = np.zeros(q.shape)
    dk = np.zeros(k.shape)
    dv = np.zeros(v.shape)
    dbias_full = np.zeros((B, Hq, Sq, Sk))
    dsinks = None if sinks is None else np.zeros(Hq)
    if B == 0 or Sq == 0 or Sk == 0 or Hq == 0:
        return dq, dk, dv, dbias_full, dsinks
    if scale is None:
        scale = 1.0 / np.sqrt(D)
    kq, vq = _ref._repeat_kv(k, Hq), _ref._repeat_kv(v, Hq)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = _ref.attention_scores(q, k, scale=scale, softcap=softcap, bias=bias, score_mod=score_mod,
                                  **score_options)
        p, lse, seen = _ref._softmax_lse(s, sinks)
        keep_scale = 1.0
        if dropout_p > 0:
            seed, offset = as_rng_state(rng_state)
            keep = dropout_keep(seed, offset, dropout_p, np.asarray(batch_ids).reshape(-1, 1, 1, 1),
                                np.arange(Hq).reshape(1, -1, 1, 1), np.arange(Sq).reshape(1, 1, -1, 1),
                                np.arange(Sk).reshape(1, 1, 1, -1), Hq)
            keep_scale = np.where(keep, 1.0 / (1.0 - dropout_p), 0.0)
        pdrop = p * keep_scale
        # dP at the seen keys only: np.where drops what a NaN/Inf of an unseen key made of it.
        dp = np.where(seen, np.einsum("bihd,bjhd->bhij", dout, vq) * keep_scale, 0.0)
        if out is None:
            dsum = np.sum(np.where(seen, p * dp, 0.0), axis=-1, keepdims=True)
        else:
            dsum = np.einsum("bihd,bihd->bhi", dout, out)[..., None]
        if dlse is not None:   # a row that sees nothing (lse -inf) has P = 0: nothing to take
            dsum = dsum - np.where(np.isneginf(lse), 0.0, dlse)[..., None]
        ds = np.where(seen, p * (dp - dsum), 0.0)
        if sinks is not None:
            sink = np.asarray(sinks, dtype=np.float64).reshape(1, Hq, 1)
            # A row with neither keys nor sink (lse -inf, sink -inf) has no sink weight at all.
            weight = np.where(np.isneginf(lse), 0.0, np.exp(sink - lse))
            dsinks = -np.sum(weight * dsum[..., 0], axis=(0, 2))
        if score_mod is not None:   # through the modifier: its derivative at its input y
            y = _ref.attention_scores(q, k, scale=scale, softcap=softcap, bias=bias, **score_options)
            ds = np.where(seen, ds * score_mod.reference_gradient(np.where(seen, y, 0.0)), 0.0)
        dx = ds
        if softcap > 0:
            x = scale * np.einsum("bihd,bjhd->bhij", q, kq)
            dx = np.where(seen, ds * (1.0 - np.tanh(x / softcap) ** 2), 0.0)
        dq = scale * _ref._weighted_sum(dx, seen, kq)
        seen_t = np.swapaxes(seen, -1, -2)
        dk_q = scale * _ref._weighted_sum(np.swapaxes(dx, -1, -2), seen_t, q)          # (B, Sk, Hq, D)
        dv_q = _ref._weighted_sum(np.swapaxes(pdrop, -1, -2), seen_t, dout)              # (B, Sk, Hq, Dv)
    group = Hq // Hk
    dk = dk_q.reshape(B, Sk, Hk, group, D).sum(axis=3)
    dv = dv_q.reshape(B, Sk, Hk, group, Dv).sum(axis=3)
    return dq, dk, dv, ds, dsinks


def _optional_like(x, name, shape, like):
    """An optional operand (a stored ``out``, ``dlse``) in float64, of ``like``'s ``shape``."""
    if x is None:
        return None
    x = _ref._to_float64(x, name)
    if x.shape != shape:
        raise ValueError(f"{name} must have the shape of {like}, {shape}, got {x.shape}")
    return x


def _reduce_to(full, shape):
    """``full`` (B, Hq, Sq, Sk) summed over the axes along which ``shape`` broadcasts to it."""
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(a for a in range(4) if padded[a] == 1 and full.shape[a] != 1)
    reduced = full.sum(axis=axes, keepdims=True) if axes else full
    return reduced.reshape(shape)


def attention_backward(dout, q, k, v, *, causal=False, scale=None, window=None, softcap=0.0,
                       alibi_slopes=None, mask=None, bias=None, block_mask=None, block_size=(128, 128),
                       dropout_p=0.0, rng_state=None, return_dbias=False, out=None, score_mod=None,
                       mask_mod=None, sinks=None, return_dsinks=False, dlse=None):
    """Float64 gradients of :func:`cuflash.reference.attention_forward`.

    Parameters
    ----------
    dout : array, shape (B, Sq, Hq, Dv)
        Gradient of the loss with respect to the attention output.
    q : array, shape (B, Sq, Hq, D)
    k : array, shape (B, Sk, Hk, D)
    v : array, shape (B, Sk, Hk, Dv)
        Any float dtype (bfloat16 via ml_dtypes), NumPy or CuPy; computed in float64.
    causal, scale, window, softcap, alibi_slopes, mask, bias, block_mask, block_size, dropout_p, rng_state
        As in :func:`cuflash.reference.attention_forward`.
    score_mod, mask_mod
        As in :func:`cuflash.reference.attention_forward`; a score_mod whose derivative is not 1
        needs its ``grad`` (:meth:`cuflash.modifiers.ScoreMod.gradient`).
    return_dbias : bool
        Also return dL/dbias (``bias`` required), in the shape of ``bias``.
    sinks : float array, shape (Hq,), optional
        As in :func:`cuflash.reference.attention_forward`.
    return_dsinks : bool
        Also return dL/dsinks (``sinks`` required), float64 (Hq,), last.
    out : array, shape (B, Sq, Hq, Dv), optional
        A stored forward output. When given, ``D_i = dO_i . out_i`` as a FlashAttention kernel
        computes it, so that the rounding of the stored output is part of the result (tests take
        the difference to the exact gradients as the part of a kernel's error it cannot avoid).
    dlse : float array, shape (B, Hq, Sq), optional
        Gradient of the loss with respect to the forward's lse, when the loss reads it.

    Returns
    -------
    dq : numpy.ndarray of float64, shape (B, Sq, Hq, D)
    dk : numpy.ndarray of float64, shape (B, Sk, Hk, D)
    dv : numpy.ndarray of float64, shape (B, Sk, Hk, Dv)
        Summed over the query heads that share a kv head.
    dbias : numpy.ndarray of float64, the shape of ``bias``
        Only if ``return_dbias``.
    dsinks : numpy.ndarray of float64, shape (Hq,)
        Only if ``return_dsinks``.

    Raises
    ------
    TypeError, ValueError
        On inputs of the wrong kind or shape.
    """
    dout, q, k, v = (_ref._to_float64(x, n) for x, n in ((dout, "dout"), (q, "q"), (k, "k"), (v, "v")))
    _ref._check_qkv(q, k, v)
    if dout.shape != q.shape[:3] + (v.shape[3],):
        raise ValueError(f"dout must have shape {q.shape[:3] + (v.shape[3],)}, got {dout.shape}")
    dropout_p = _ref._check_dropout(dropout_p, rng_state)
    out = _optional_like(out, "out", dout.shape, "dout")
    if return_dbias and bias is None:
        raise ValueError("return_dbias=True needs a bias")
    if return_dsinks and sinks is None:
        raise ValueError("return_dsinks=True needs sinks")
    sinks = _ref._check_sinks(sinks, q.shape[2])
    dlse = _optional_like(dlse, "dlse", (q.shape[0], q.shape[2], q.shape[1]), "lse")
    dq, dk, dv, ds, dsinks = _grads(dout, q, k, v, np.arange(q.shape[0]), dropout_p=dropout_p, rng_state=rng_state,
                            return_dbias=return_dbias, bias=bias, scale=scale, softcap=softcap, causal=causal,
                            window=window, alibi_slopes=alibi_slopes, mask=mask, block_mask=block_mask,
                            block_size=block_size, out=out, score_mod=score_mod, mask_mod=mask_mod,
                            sinks=sinks, dlse=dlse)
    grads = (dq, dk, dv)
    if return_dbias:
        grads += (_reduce_to(ds, _ref._host(bias).shape),)
    if return_dsinks:
        grads += (dsinks,)
    return grads


def attention_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                              max_seqlen_k=None, causal=False, scale=None, window=None, softcap=0.0,
                              alibi_slopes=None, dropout_p=0.0, rng_state=None, out=None, sinks=None,
                              return_dsinks=False, score_mod=None, mask_mod=None, dlse=None):
    """Float64 gradients of :func:`cuflash.reference.attention_varlen`.

    Parameters
    ----------
    dout : array, shape (total_q, Hq, Dv)
    q : array, shape (total_q, Hq, D)
    k : array, shape (total_k, Hk, D)
    v : array, shape (total_k, Hk, Dv)
    cu_seqlens_q, cu_seqlens_k : int arrays, shape (B + 1,)
        Sequence b is rows ``cu_seqlens[b]:cu_seqlens[b + 1]``, an independent problem with batch
        index b (dropout, (B, Hq) alibi_slopes).
    max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes, dropout_p, rng_state
        As in :func:`cuflash.reference.attention_varlen`.
    out : array, shape (total_q, Hq, Dv), optional
        As in :func:`attention_backward`.
    sinks, return_dsinks
        As in :func:`attention_backward` (dsinks summed over the sequences).
    score_mod, mask_mod
        As in :func:`cuflash.reference.attention_varlen` (positions within each sequence, ``b`` its
        index); a score_mod whose derivative is not 1 needs its ``grad``.
    dlse : float array, shape (Hq, total_q), optional
        As in :func:`attention_backward`, in the varlen lse's layout.

    Returns
    -------
    dq : numpy.ndarray of float64, shape (total_q, Hq, D)
    dk : numpy.ndarray of float64, shape (total_k, Hk, D)
    dv : numpy.ndarray of float64, shape (total_k, Hk, Dv)
        Rows that belong to no sequence are 0.
    dsinks : numpy.ndarray of float64, shape (Hq,)
        Only if ``return_dsinks``.
    """
    dout, q, k, v = (_ref._to_float64(x, n) for x, n in ((dout, "dout"), (q, "q"), (k, "k"), (v, "v")))
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or dout.ndim != 3:
        raise ValueError(f"varlen dout, q, k, v must be 3-D (total, H, D), got shapes {dout.shape}, {q.shape}, "
                         f"{k.shape}, {v.shape}")
    _ref._check_qkv(q[None], k[None], v[None])
    dropout_p = _ref._check_dropout(dropout_p, rng_state)
    out = _optional_like(out, "out", dout.shape, "dout")
    cu_q = _ref._check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    cu_k = _ref._check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got {cu_q.shape[0]} and "
                         f"{cu_k.shape[0]}")
    slopes = None if alibi_slopes is None else _ref._host(alibi_slopes)
    if return_dsinks and sinks is None:
        raise ValueError("return_dsinks=True needs sinks")
    sinks = _ref._check_sinks(sinks, q.shape[1])
    dlse = _optional_like(dlse, "dlse", (q.shape[1], q.shape[0]), "lse")
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dsinks = np.zeros(q.shape[1])
    for b in range(cu_q.shape[0] - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq_slopes = slopes[b] if slopes is not None and slopes.ndim == 2 else slopes
        g = _grads(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], [b], dropout_p=dropout_p,
                   rng_state=rng_state, return_dbias=False, bias=None, scale=scale, softcap=softcap,
                   causal=causal, window=window, alibi_slopes=seq_slopes,
                   out=None if out is None else out[None, rows], sinks=sinks,
                   dlse=None if dlse is None else dlse[None, :, rows],
                   score_mod=_ref.at_sequence(score_mod, b), mask_mod=_ref.at_sequence(mask_mod, b))
        dq[rows], dk[keys], dv[keys] = g[0][0], g[1][0], g[2][0]
        if g[4] is not None:
            dsinks += g[4]
    return (dq, dk, dv, dsinks) if return_dsinks else (dq, dk, dv)

