"""The same-dtype baseline of the accuracy rule: a plain attention (matmul, softmax, matmul) in the
inputs' dtype, rounded where a naive kernel rounds."""

from __future__ import annotations

import numpy as np

from cuflash.random import as_rng_state, dropout_keep
from cuflash.reference import _forward as _reference

from ._arrays import _host, _host64, _xp_of


def _round_to(x, dtype):
    """Round float32 ``x`` to ``dtype`` and back, as storing it in that dtype would."""
    if dtype == np.float32 or dtype == np.float64:
        return x
    return x.astype(dtype).astype(np.float32)


def _baseline(q, k, v, batch_ids, *, causal=False, scale=None, window=None, softcap=0.0,
              alibi_slopes=None, mask=None, bias=None, block_mask=None, block_size=(128, 128),
              dropout_p=0.0, rng_state=None, score_mod=None, mask_mod=None, sinks=None):
    xp = _xp_of(q)
    dtype = q.dtype
    if k.dtype != dtype or v.dtype != dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, Sq, Hq, D = q.shape
    Sk, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hk})")
    f32 = np.float32
    qt = xp.asarray(q).astype(f32).transpose(0, 2, 1, 3)                   # (B, Hq, Sq, D)
    kt = xp.repeat(xp.asarray(k).astype(f32), Hq // Hk, axis=2).transpose(0, 2, 3, 1)
    vt = xp.repeat(xp.asarray(v).astype(f32), Hq // Hk, axis=2).transpose(0, 2, 1, 3)
    if B * Hq * Sq == 0 or Sk == 0:   # no key: out 0, lse -inf (the sink's logit with sinks)
        lse = np.full((B, Hq, Sq), -np.inf if Sk == 0 else 0.0)
        if sinks is not None and Sk == 0:
            lse[...] = np.asarray(sinks.get() if hasattr(sinks, "get") else sinks, dtype=np.float64)[:, None]
        return np.zeros((B, Sq, Hq, Dv)), lse
    if scale is None:
        scale = 1.0 / np.sqrt(D)
    s = _round_to(xp.matmul(qt, kt), dtype)                                # S = q k^T
    s = _reference._score_pipeline(xp, s, scale=scale, causal=causal, window=window,
                                   softcap=softcap, alibi_slopes=alibi_slopes, mask=mask,
                                   bias=bias, block_mask=block_mask, block_size=block_size,
                                   score_mod=score_mod, mask_mod=mask_mod)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:   # the row's denominator also holds exp(sinks[h]); no value is added
        sink = xp.asarray(sinks.get() if xp is np and hasattr(sinks, "get") else sinks).astype(f32)
        sink = sink.reshape(1, -1, 1, 1)
        m = xp.maximum(m, sink)
    empty = m == -np.inf
    e = xp.exp(s - xp.where(empty, f32(0), m))
    l = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + xp.exp(sink - xp.where(empty, f32(0), m))
    p = _round_to(xp.where(empty, f32(0), e / xp.where(empty, f32(1), l)), dtype)
    lse = xp.where(empty, f32(-np.inf), m + xp.log(xp.where(empty, f32(1), l)))[..., 0]
    if dropout_p > 0:
        seed, offset = as_rng_state(rng_state)
        keep = dropout_keep(seed, offset, dropout_p, np.asarray(batch_ids).reshape(-1, 1, 1, 1),
                            np.arange(Hq).reshape(1, -1, 1, 1), np.arange(Sq).reshape(1, 1, -1, 1),
                            np.arange(Sk).reshape(1, 1, 1, -1), Hq)
        p = _round_to(xp.where(xp.asarray(keep), p * f32(1.0 / (1.0 - dropout_p)), f32(0)),
                      dtype)
    out = _round_to(xp.matmul(p, vt), dtype).transpose(0, 2, 1, 3)         # (B, Sq, Hq, Dv)
    return _host64(out), _host64(lse)


def baseline_attention(q, k, v, *, return_lse=False, **options):
    """Plain same-dtype attention, the yardstick of :func:`assert_attention_close`.

    Emulates a naive matmul/softmax/matmul kernel in the input dtype: ``S = q k^T`` from the
    (exact) inputs accumulated in float32 and rounded to the dtype; the score pipeline
    (scale, softcap, ALiBi, bias, masks; see :mod:`cuflash.reference`) and the softmax in
    float32; ``P`` rounded to the dtype; dropout (same keep mask as the reference, rounded
    again); ``P @ V`` in float32, rounded to the dtype. bfloat16 is emulated in float32 because
    ``cupy.matmul`` does not take bfloat16. float32 inputs get no rounding at all.

    Parameters
    ----------
    q : array, shape (B, Sq, Hq, D)
    k : array, shape (B, Sk, Hk, D)
    v : array, shape (B, Sk, Hk, Dv)
        All NumPy or all CuPy (computed on the GPU then), one dtype.
    return_lse : bool
        Also return the float32 log-sum-exp.
    **options
        Those of :func:`cuflash.reference.attention_forward` (``rng_state`` with dropout;
        ``score_mod``, ``mask_mod``, ``sinks``).

    Returns
    -------
    out : numpy.ndarray of float64, shape (B, Sq, Hq, Dv)
        The dtype-rounded values, as float64.
    lse : numpy.ndarray of float64, shape (B, Hq, Sq)
        Only if ``return_lse``.

    Examples
    --------
    >>> from cuflash import reference, testing
    >>> q, k, v = testing.random_qkv(dict(B=1, Sq=64, Sk=64, Hq=2, Hk=2, D=32), "float16", seed=0)
    >>> ref, _ = reference.attention_forward(q, k, v, causal=True)
    >>> base = testing.baseline_attention(q, k, v, causal=True)
    >>> testing.assert_attention_close(base, ref, base, dtype="float16")   # base is float64
    """
    out, lse = _baseline(q, k, v, np.arange(q.shape[0]), **options)
    return (out, lse) if return_lse else out


def baseline_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, return_lse=False,
                              max_seqlen_q=None, max_seqlen_k=None, **options):
    """:func:`baseline_attention` for packed sequences (see
    :func:`cuflash.reference.attention_varlen` for the layout).

    Parameters
    ----------
    q : array (total_q, Hq, D)
    k : array (total_k, Hk, D)
    v : array (total_k, Hk, Dv)
        All NumPy or all CuPy, one dtype.
    cu_seqlens_q, cu_seqlens_k : int arrays (B + 1,)
        Offsets of the sequences.
    return_lse : bool, default False
        Also return the log-sum-exp.
    max_seqlen_q, max_seqlen_k : int, optional
        Accepted (and ignored) for the signature of :func:`cuflash.attention_varlen`.
    **options
        Those of :func:`cuflash.reference.attention_varlen`.

    Returns
    -------
    out : numpy.ndarray of float64, shape (total_q, Hq, Dv)
    lse : numpy.ndarray of float64, shape (Hq, total_q)
        Only if ``return_lse``. Rows past ``cu_seqlens_q[-1]`` are NaN.

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash import testing
    >>> q, k, v = (np.random.default_rng(0).standard_normal((30, 2, 16)).astype(np.float16) for _ in range(3))
    >>> cu = np.array([0, 10, 30], dtype=np.int32)
    >>> out = testing.baseline_attention_varlen(q, k, v, cu, cu, causal=True)
    """
    cu_q = _host(cu_seqlens_q).astype(np.int64)
    cu_k = _host(cu_seqlens_k).astype(np.int64)
    slopes = options.pop("alibi_slopes", None)
    out = np.full((q.shape[0], q.shape[1], v.shape[2]), np.nan)
    lse = np.full((q.shape[1], q.shape[0]), np.nan)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq_slopes = slopes
        if slopes is not None and slopes.ndim == 2:
            seq_slopes = slopes[b]
        o, l = _baseline(q[None, rows], k[None, keys], v[None, keys], [b],
                         alibi_slopes=seq_slopes, **options)
        out[rows], lse[:, rows] = o[0], l[0]
    return (out, lse) if return_lse else out



def baseline_attention_backward(dout, q, k, v, out, *, causal=False, scale=None, window=None, softcap=0.0):
    """Plain same-dtype backward, the yardstick of the gradients' accuracy rule: P recomputed as
    :func:`baseline_attention` does (S and P rounded to the dtype), dP = dO V^T and dS rounded to the
    dtype, dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO in float32 then rounded; D = rowsum(dO * O)
    from the stored ``out``. GQA sums over each kv head's query heads. v (and dout, out, dv) may have a
    head dim of its own.

    Parameters
    ----------
    dout, out : array (B, Sq, Hq, Dv)
    q : array (B, Sq, Hq, D)
    k : array (B, Sk, Hk, D)
    v : array (B, Sk, Hk, Dv)
        All NumPy or all CuPy, one dtype.
    causal, scale, window, softcap
        As in :func:`cuflash.reference.attention_forward` (no dropout, bias or masks here).

    Returns
    -------
    dq, dk, dv : numpy.ndarray of float64, shapes of q, k, v
    """
    xp = _xp_of(q)
    dtype = q.dtype
    f32 = np.float32
    B, Sq, Hq, D = q.shape
    Sk, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = Hq // Hk
    if scale is None:
        scale = 1.0 / np.sqrt(D)
    t = lambda x: xp.asarray(x).astype(f32).transpose(0, 2, 1, 3)  # noqa: E731
    qt, dot, ot = t(q), t(dout), t(out)
    kt = xp.repeat(xp.asarray(k).astype(f32), group, axis=2).transpose(0, 2, 1, 3)   # (B, Hq, Sk, D)
    vt = xp.repeat(xp.asarray(v).astype(f32), group, axis=2).transpose(0, 2, 1, 3)   # (B, Hq, Sk, Dv)
    raw = _round_to(xp.matmul(qt, kt.transpose(0, 1, 3, 2)), dtype)
    s = _reference._score_pipeline(xp, raw, scale=scale, causal=causal, window=window, softcap=softcap,
                                   alibi_slopes=None, mask=None, bias=None, block_mask=None, block_size=(128, 128))
    m = s.max(axis=-1, keepdims=True)
    empty = m == -np.inf
    e = xp.exp(s - xp.where(empty, f32(0), m))
    l = e.sum(axis=-1, keepdims=True)
    p = _round_to(xp.where(empty, f32(0), e / xp.where(empty, f32(1), l)), dtype)
    dp = _round_to(xp.matmul(dot, vt.transpose(0, 1, 3, 2)), dtype)
    ds = xp.where(s != -np.inf, p * (dp - (dot * ot).sum(axis=-1, keepdims=True)), f32(0))
    if softcap > 0:
        ds = ds * (1 - xp.tanh(raw * f32(scale) / f32(softcap)) ** 2)
    ds = _round_to(ds, dtype)
    dq = _round_to(f32(scale) * xp.matmul(ds, kt), dtype)
    dk = _round_to((f32(scale) * xp.matmul(ds.transpose(0, 1, 3, 2), qt)).reshape(B, Hk, group, Sk, D).sum(axis=2),
                   dtype)
    dv = _round_to(xp.matmul(p.transpose(0, 1, 3, 2), dot).reshape(B, Hk, group, Sk, Dv).sum(axis=2), dtype)
    return tuple(_host64(x.transpose(0, 2, 1, 3)) for x in (dq, dk, dv))
