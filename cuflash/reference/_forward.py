"""The forward side of the float64 reference: scores, attention (dense and varlen), merge of
partial states, decode against a KV cache (see :mod:`cuflash.reference`)."""

from __future__ import annotations

import numbers

import numpy as np

from cuflash.random import as_rng_state, dropout_keep



# ----------------------------------------------------------------------------- inputs

def _host(x):
    """``x`` as a NumPy array (CuPy arrays are copied to the host)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get") and hasattr(x, "__cuda_array_interface__"):
        return x.get()
    return np.asarray(x)


def _is_float(dtype):
    # ml_dtypes' bfloat16 (and float8 types) have kind "V"; recognise them by name.
    return dtype.kind == "f" or dtype.name.startswith(("bfloat", "float"))


def _to_float64(x, name):
    arr = _host(x)
    if not _is_float(arr.dtype):
        raise TypeError(f"{name} must be a float array, got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def _resolve_window(causal, window):
    """``(left, right)`` key distances around the diagonal; ``None`` means unbounded."""
    if window is None:
        left, right = -1, -1
    else:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError(f"window must be a (left, right) pair, got {window!r}") from None
        for side in (left, right):
            if isinstance(side, bool) or not isinstance(side, numbers.Integral) or side < -1:
                raise ValueError(f"window entries must be integers >= -1, got {window!r}")
    left = None if left == -1 else int(left)
    right = None if right == -1 else int(right)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _broadcast_option(xp, value, name, shape, kind):
    """``value`` as an ``xp`` array broadcast (never copied) to ``shape``."""
    if xp is np:
        arr = _host(value)
    else:
        arr = xp.asarray(value)
    if kind == "bool" and arr.dtype != np.bool_:
        raise TypeError(f"{name} must be a bool array (True = may attend), got dtype {arr.dtype}")
    if kind == "float" and not _is_float(arr.dtype):
        raise TypeError(f"{name} must be a float array, got dtype {arr.dtype}")
    try:
        return xp.broadcast_to(arr, shape)
    except ValueError:
        raise ValueError(f"{name} of shape {tuple(arr.shape)} does not broadcast to "
                         f"{shape}") from None


def _check_qkv(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-D (B, S, H, D), got shapes {q.shape}, {k.shape}, "
                         f"{v.shape}")
    B, Sq, Hq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in (B, Sk, Hk), got {k.shape} and {v.shape}")
    if k.shape[3] != D:
        raise ValueError(f"q and k head dims differ: {D} and {k.shape[3]}")
    Hk = k.shape[2]
    if Hk == 0 or Hq % Hk != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hk})")


def _repeat_kv(x, num_heads_q):
    """(B, S, Hk, D) -> (B, S, Hq, D): query head h uses kv head h // (Hq // Hk)."""
    return np.repeat(x, num_heads_q // x.shape[2], axis=2)


# ----------------------------------------------------------------------------- scores

def _score_pipeline(xp, s, *, scale, causal=False, window=None, softcap=0.0,
                    alibi_slopes=None, mask=None, bias=None, block_mask=None,
                    block_size=(128, 128), score_mod=None, mask_mod=None):
    """Scale, softcap, ALiBi, bias, a user score modifier and masks on raw ``q.k`` products.

    Shared by the float64 reference (``xp = numpy``) and the same-dtype baseline of
    :mod:`cuflash.testing` (float32, NumPy or CuPy), so the two cannot disagree on semantics.

    Parameters
    ----------
    s : array, shape (B, Hq, Sq, Sk)
        ``q.k`` (unscaled); computed in ``s.dtype``.

    Returns
    -------
    array, shape (B, Hq, Sq, Sk)
        Final scores, ``-inf`` where masked.
    """
    B, Hq, Sq, Sk = s.shape
    dtype = s.dtype
    s = s * dtype.type(scale)
    if not softcap >= 0:  # also NaN
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap}")
    if softcap > 0:
        c = dtype.type(softcap)
        s = c * xp.tanh(s / c)
    i = xp.arange(Sq).reshape(Sq, 1)
    j = xp.arange(Sk).reshape(1, Sk)
    diag = i + (Sk - Sq)  # bottom-right aligned diagonal: key index "level" with query i
    if alibi_slopes is not None:
        slopes = _host(alibi_slopes) if xp is np else xp.asarray(alibi_slopes)
        if slopes.shape not in ((Hq,), (B, Hq)):
            raise ValueError(f"alibi_slopes must have shape ({Hq},) or ({B}, {Hq}), got "
                             f"{tuple(slopes.shape)}")
        slopes = slopes.astype(dtype).reshape(-1, Hq, 1, 1)
        s = s - slopes * xp.abs(diag - j).astype(dtype)
    if bias is not None:
        s = s + _broadcast_option(xp, bias, "bias", s.shape, "float").astype(dtype)
    if score_mod is not None:   # evaluated in float64 (cuflash.modifiers.numpy_eval)
        s = xp.asarray(score_mod.reference(_host(s).astype(np.float64))).astype(dtype)

    visible = xp.ones((1, 1, Sq, Sk), dtype=bool)
    left, right = _resolve_window(causal, window)
    if left is not None:
        visible = visible & (j >= diag - left)
    if right is not None:
        visible = visible & (j <= diag + right)
    if mask is not None:
        visible = visible & _broadcast_option(xp, mask, "mask", s.shape, "bool")
    if mask_mod is not None:
        visible = visible & xp.asarray(mask_mod.reference((B, Hq, Sq, Sk)))
    if block_mask is not None:
        bq, bk = _check_block_size(block_size)
        nbq, nbk = -(-Sq // bq), -(-Sk // bk)
        blocks = _broadcast_option(xp, block_mask, "block_mask", (B, Hq, nbq, nbk), "bool")
        visible = visible & blocks[:, :, xp.arange(Sq)[:, None] // bq,
                                   xp.arange(Sk)[None, :] // bk]
    return xp.where(visible, s, dtype.type(-np.inf))


def _check_block_size(block_size):
    try:
        bq, bk = block_size
    except (TypeError, ValueError):
        raise ValueError(f"block_size must be a (bq, bk) pair, got {block_size!r}") from None
    if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) or x <= 0
           for x in (bq, bk)):
        raise ValueError(f"block_size entries must be positive integers, got {block_size!r}")
    return int(bq), int(bk)


def attention_scores(q, k, *, causal=False, scale=None, window=None, softcap=0.0,
                     alibi_slopes=None, mask=None, bias=None, block_mask=None,
                     block_size=(128, 128), score_mod=None, mask_mod=None):
    """Final attention scores in float64.

    Parameters
    ----------
    q : array, shape (B, Sq, Hq, D)
    k : array, shape (B, Sk, Hk, D)
        ``Hq % Hk == 0``; query head ``h`` uses kv head ``h // (Hq // Hk)``.
    causal, scale, window, softcap, alibi_slopes, mask, bias, block_mask, block_size, score_mod, mask_mod
        As in :func:`attention_forward`.

    Returns
    -------
    numpy.ndarray of float64, shape (B, Hq, Sq, Sk)
        ``s``, with ``-inf`` at every masked position.

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash import reference
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((1, 3, 2, 8)), rng.standard_normal((1, 4, 1, 8))
    >>> s = reference.attention_scores(q, k, causal=True)    # Sq = 3 < Sk = 4: bottom-right
    >>> np.isinf(s[0, 0]).astype(int)
    array([[0, 0, 1, 1],
           [0, 0, 0, 1],
           [0, 0, 0, 0]])
    """
    q = _to_float64(q, "q")
    k = _to_float64(k, "k")
    _check_qkv(q, k, k)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    kq = _repeat_kv(k, q.shape[2])
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.einsum("bihd,bjhd->bhij", q, kq)
        return _score_pipeline(np, s, scale=scale, causal=causal, window=window,
                               softcap=softcap, alibi_slopes=alibi_slopes, mask=mask, bias=bias,
                               block_mask=block_mask, block_size=block_size, score_mod=score_mod,
                               mask_mod=mask_mod)


# ----------------------------------------------------------------------------- softmax, P @ V

def _softmax_lse(s, sinks=None):
    """Row softmax over the keys a row sees (``s != -inf``); ``(p, lse, seen)``.

    ``sinks`` (Hq,): each row's denominator also holds ``exp(sinks[h])``, and so does ``lse``; no
    value goes with it (the probabilities of the keys sum to less than 1). Rows that see no key get
    ``p = 0`` and ``lse = sinks[h]`` (``-inf`` without a sink) instead of ``0/0``.
    """
    seen = s != -np.inf  # NaN counts as seen: it must propagate
    m = np.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        sink = _host(sinks).astype(np.float64).reshape(1, -1, 1, 1)
        m = np.maximum(m, sink)
    m_safe = np.where(m == -np.inf, 0.0, m)
    e = np.exp(s - m_safe)
    total = np.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + np.exp(sink - m_safe)
    empty = total == 0   # no visible key and no sink
    p = np.where(empty, 0.0, e / np.where(empty, 1.0, total))
    lse = np.where(empty, -np.inf, m_safe + np.log(np.where(empty, 1.0, total)))
    return p, lse[..., 0], seen


def _weighted_sum(w, seen, v):
    """``out[b, i, h] = sum over seen j of w[b, h, i, j] * v[b, j, h]`` in IEEE arithmetic.

    A plain ``w @ v`` would turn ``0 * NaN`` from an unseen key into NaN; here unseen keys are
    absent, while a non-finite ``v`` at a seen key still propagates (even if ``w`` is 0 there,
    e.g. dropped by dropout).
    """
    vt = np.moveaxis(v, 1, 2)  # (B, Hq, Sk, Dv)
    finite = np.isfinite(vt)
    out = np.einsum("bhij,bhjd->bhid", w, np.where(finite, vt, 0.0))
    bad_cols = np.flatnonzero(~finite.all(axis=(0, 1, 3)))
    if bad_cols.size:
        vbad = np.where(finite, 0.0, vt)[:, :, None, bad_cols, :]        # (B, Hq, 1, nb, Dv)
        terms = w[..., bad_cols, None] * vbad                             # (B, Hq, Sq, nb, Dv)
        out = out + np.where(seen[..., bad_cols, None], terms, 0.0).sum(axis=-2)
    return np.moveaxis(out, 1, 2)  # (B, Sq, Hq, Dv)


def _attention(q, k, v, batch_ids, *, dropout_p=0.0, rng_state=None, sinks=None, **options):
    """Reference attention on float64 (B, S, H, D) arrays; ``batch_ids`` label the batches
    for dropout (varlen passes the sequence index)."""
    B, Sq, Hq, _ = q.shape
    Sk, Dv = k.shape[1], v.shape[3]
    if B == 0 or Sq == 0 or Hq == 0:
        return np.zeros((B, Sq, Hq, Dv)), np.zeros((B, Hq, Sq))
    if Sk == 0:
        empty = np.full((B, Hq, Sq), -np.inf) if sinks is None else np.broadcast_to(
            _host(sinks).astype(np.float64).reshape(1, Hq, 1), (B, Hq, Sq)).copy()
        return np.zeros((B, Sq, Hq, Dv)), empty
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = attention_scores(q, k, **options)
        p, lse, seen = _softmax_lse(s, sinks)
        if dropout_p > 0:
            seed, offset = as_rng_state(rng_state)
            keep = dropout_keep(seed, offset, dropout_p,
                                np.asarray(batch_ids).reshape(-1, 1, 1, 1),
                                np.arange(Hq).reshape(1, -1, 1, 1),
                                np.arange(Sq).reshape(1, 1, -1, 1),
                                np.arange(Sk).reshape(1, 1, 1, -1), Hq)
            p = np.where(keep, p / (1.0 - dropout_p), 0.0)
        out = _weighted_sum(p, seen, _repeat_kv(v, Hq))
    return out, lse


def _check_dropout(dropout_p, rng_state):
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")
    if dropout_p > 0 and rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state=(seed, offset)")
    return float(dropout_p)


def attention_forward(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0,
                      alibi_slopes=None, mask=None, bias=None, block_mask=None,
                      block_size=(128, 128), dropout_p=0.0, rng_state=None, score_mod=None,
                      mask_mod=None, sinks=None):
    """Float64 reference attention.

    Parameters
    ----------
    q : array, shape (B, Sq, Hq, D)
    k : array, shape (B, Sk, Hk, D)
    v : array, shape (B, Sk, Hk, Dv)
        Any float dtype (bfloat16 via ml_dtypes), NumPy or CuPy; ``Hq % Hk == 0``, query
        head ``h`` uses kv head ``h // (Hq // Hk)``.
    causal : bool
        Bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq``.
    scale : float, optional
        Defaults to ``1 / sqrt(D)``.
    window : (int, int), optional
        ``(left, right)``, inclusive, ``-1`` unbounded: query ``i`` sees key ``j`` iff
        ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``. With ``causal``, ``right`` becomes
        ``min(right, 0)``.
    softcap : float
        If ``> 0``, scores become ``softcap * tanh(s / softcap)`` (before ALiBi and bias).
    alibi_slopes : array, shape (Hq,) or (B, Hq), optional
        Subtracts ``slope * |i + Sk - Sq - j|``.
    mask : bool array broadcastable to (B, Hq, Sq, Sk), optional
        True = may attend.
    bias : float array broadcastable to (B, Hq, Sq, Sk), optional
        Added to the (scaled, capped) scores.
    block_mask : bool array broadcastable to (B, Hq, ceil(Sq/bq), ceil(Sk/bk)), optional
        Key ``j`` is hidden from query ``i`` where ``block_mask[b, h, i // bq, j // bk]`` is
        False.
    block_size : (int, int)
        ``(bq, bk)`` for ``block_mask``.
    dropout_p : float
        In ``[0, 1)``; kept probabilities are scaled by ``1 / (1 - dropout_p)``.
    rng_state : array_like of int, shape (2,), optional
        ``[seed, offset]``; required when ``dropout_p > 0``.
    score_mod : cuflash.modifiers.ScoreMod, optional
        Applied to each score after the bias, evaluated by NumPy in float64.
    mask_mod : cuflash.modifiers.MaskMod, optional
        Hides the pairs where it is False, with the other masks.
    sinks : float array, shape (Hq,), optional
        Attention sinks: each row's softmax denominator also holds ``exp(sinks[h])`` (no value goes
        with it), and so does ``lse``.

    Returns
    -------
    out : numpy.ndarray of float64, shape (B, Sq, Hq, Dv)
    lse : numpy.ndarray of float64, shape (B, Hq, Sq)
        Natural log of the row's sum of ``exp(s)`` (before dropout); ``-inf`` for a row that
        sees no key, whose ``out`` is 0.

    Raises
    ------
    TypeError, ValueError
        On inputs of the wrong kind or shape.

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash import reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 64, 4, 32)) for _ in range(3))
    >>> out, lse = reference.attention_forward(q, k, v, causal=True, dropout_p=0.1, rng_state=(7, 0))
    >>> out.shape, lse.shape
    ((1, 64, 4, 32), (1, 4, 64))
    """
    q, k, v = (_to_float64(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    _check_qkv(q, k, v)
    dropout_p = _check_dropout(dropout_p, rng_state)
    return _attention(q, k, v, np.arange(q.shape[0]), dropout_p=dropout_p,
                      rng_state=rng_state, causal=causal, scale=scale, window=window,
                      softcap=softcap, alibi_slopes=alibi_slopes, mask=mask, bias=bias,
                      block_mask=block_mask, block_size=block_size, score_mod=score_mod,
                      mask_mod=mask_mod, sinks=_check_sinks(sinks, q.shape[2]))


def _check_sinks(sinks, heads_q):
    """``sinks`` as a float64 (Hq,) host array (None passes)."""
    if sinks is None:
        return None
    sinks = _to_float64(sinks, "sinks")
    if sinks.shape != (heads_q,):
        raise ValueError(f"sinks must have shape ({heads_q},) (one per query head), got {sinks.shape}")
    return sinks


def _check_cu_seqlens(cu, name, total):
    cu = _host(cu)
    if cu.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must have shape (B + 1,), got {cu.shape}")
    cu = cu.astype(np.int64)
    if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > total:
        raise ValueError(f"{name} must start at 0, be non-decreasing and end at most at "
                         f"{total}, got {cu.tolist()}")
    return cu


class _AtSequence:
    """A ScoreMod/MaskMod evaluated on one varlen sequence alone (a batch of one) whose ``b`` is the
    sequence's index ``b0``; positions count from the sequence's start either way."""

    def __init__(self, modifier, b0: int):
        self.modifier, self.b0 = modifier, b0

    def reference(self, x):
        return self.modifier.reference(x, b0=self.b0)

    def reference_gradient(self, x):
        return self.modifier.reference_gradient(x, b0=self.b0)


def at_sequence(modifier, b0: int):
    """``modifier`` for varlen sequence ``b0`` evaluated alone (None stays None)."""
    return None if modifier is None else _AtSequence(modifier, b0)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, causal=False, scale=None, window=None, softcap=0.0,
                     alibi_slopes=None, dropout_p=0.0, rng_state=None, sinks=None, score_mod=None,
                     mask_mod=None):
    """Float64 reference for packed variable-length batches.

    Parameters
    ----------
    q : array, shape (total_q, Hq, D)
    k : array, shape (total_k, Hk, D)
    v : array, shape (total_k, Hk, Dv)
    cu_seqlens_q, cu_seqlens_k : int array, shape (B + 1,)
        Sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of ``q`` (likewise
        ``k``/``v``); it is an independent ``(Sq_b, Sk_b)`` problem with batch index ``b``
        (for dropout and a (B, Hq) ``alibi_slopes``).
    max_seqlen_q, max_seqlen_k : int, optional
        Accepted for signature compatibility; if given they must bound the lengths.
    causal, scale, window, softcap, alibi_slopes, dropout_p, rng_state, sinks
        As in :func:`attention_forward` (``mask``, ``bias`` and ``block_mask`` are not
        supported in varlen).
    score_mod, mask_mod : cuflash.ScoreMod, cuflash.MaskMod, optional
        As in :func:`attention_forward`, with ``q_idx``/``kv_idx`` the positions within each
        sequence and ``b`` the sequence's index.

    Returns
    -------
    out : numpy.ndarray of float64, shape (total_q, Hq, Dv)
    lse : numpy.ndarray of float64, shape (Hq, total_q)
        Rows after ``cu_seqlens_q[-1]`` belong to no sequence: NaN in both (undefined).

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash import reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((30, 4, 32)) for _ in range(3))
    >>> cu = np.array([0, 10, 30])                       # two sequences: 10 and 20 rows
    >>> out, lse = reference.attention_varlen(q, k, v, cu, cu, causal=True)
    >>> out.shape, lse.shape
    ((30, 4, 32), (4, 30))
    """
    q, k, v = (_to_float64(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"varlen q, k, v must be 3-D (total, H, D), got shapes {q.shape}, "
                         f"{k.shape}, {v.shape}")
    _check_qkv(q[None], k[None], v[None])
    dropout_p = _check_dropout(dropout_p, rng_state)
    cu_q = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    cu_k = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length, got "
                         f"{cu_q.shape[0]} and {cu_k.shape[0]}")
    for given, cu, name in ((max_seqlen_q, cu_q, "max_seqlen_q"),
                            (max_seqlen_k, cu_k, "max_seqlen_k")):
        if given is not None and len(cu) > 1 and given < np.diff(cu).max():
            raise ValueError(f"{name}={given} is smaller than the longest sequence "
                             f"({np.diff(cu).max()})")
    B = cu_q.shape[0] - 1
    Hq = q.shape[1]
    sinks = _check_sinks(sinks, Hq)
    slopes = None
    if alibi_slopes is not None:
        slopes = _host(alibi_slopes)
        if slopes.ndim == 2 and slopes.shape[0] != B:
            raise ValueError(f"alibi_slopes must have shape ({Hq},) or ({B}, {Hq}), got "
                             f"{slopes.shape}")
    out = np.full((q.shape[0], Hq, v.shape[2]), np.nan)
    lse = np.full((Hq, q.shape[0]), np.nan)
    for b in range(B):
        rows = slice(cu_q[b], cu_q[b + 1])
        keys = slice(cu_k[b], cu_k[b + 1])
        seq_slopes = slopes[b] if slopes is not None and slopes.ndim == 2 else slopes
        o, l = _attention(q[None, rows], k[None, keys], v[None, keys], [b],
                          dropout_p=dropout_p, rng_state=rng_state, causal=causal,
                          scale=scale, window=window, softcap=softcap,
                          alibi_slopes=seq_slopes, sinks=sinks, score_mod=at_sequence(score_mod, b),
                          mask_mod=at_sequence(mask_mod, b))
        out[rows] = o[0]
        lse[:, rows] = l[0]
    return out, lse


# ----------------------------------------------------------------------------- merge

def merge_states(outs, lses):
    """Float64 reference for :func:`cuflash.merge_states`.

    Parameters
    ----------
    outs : array (n, B, S, H, D) or a sequence of n arrays (B, S, H, D)
        Attention outputs over n disjoint key sets, each normalised over its own keys.
    lses : array (n, B, H, S) or a sequence of n arrays (B, H, S)
        Their log-sum-exps.

    Returns
    -------
    out : numpy.ndarray of float64, shape (B, S, H, D)
        ``sum_i exp(lse_i - lse) * out_i`` over the parts with ``lse_i != -inf`` (a part that saw
        no key contributes nothing, whatever its ``out_i`` holds); 0 for a row with no such part.
    lse : numpy.ndarray of float64, shape (B, H, S)
        ``log(sum_i exp(lse_i))``; ``-inf`` for a row whose parts are all ``-inf``. NaN propagates.

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash import reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 16, 2, 8)) for _ in range(3))
    >>> o1, l1 = reference.attention_forward(q, k[:, :10], v[:, :10])
    >>> o2, l2 = reference.attention_forward(q, k[:, 10:], v[:, 10:])
    >>> out, lse = reference.merge_states([o1, o2], [l1, l2])
    >>> np.allclose(out, reference.attention_forward(q, k, v)[0])
    True
    """
    if isinstance(outs, (list, tuple)):
        outs = np.stack([_to_float64(x, f"outs[{i}]") for i, x in enumerate(outs)])
    else:
        outs = _to_float64(outs, "outs")
    if isinstance(lses, (list, tuple)):
        lses = np.stack([_to_float64(x, f"lses[{i}]") for i, x in enumerate(lses)])
    else:
        lses = _to_float64(lses, "lses")
    if outs.ndim != 5 or outs.shape[0] == 0:
        raise ValueError(f"outs must be (n >= 1, B, S, H, D), got shape {outs.shape}")
    n, b, s, h, _ = outs.shape
    if lses.shape != (n, b, h, s):
        raise ValueError(f"lses must have shape {(n, b, h, s)}, got {lses.shape}")
    lse_t = np.moveaxis(lses, -1, -2)                                  # (n, B, S, H)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = lse_t.max(axis=0)                                          # NaN if any part is NaN
        m_safe = np.where(m == -np.inf, 0.0, m)
        seen = lse_t != -np.inf
        w = np.where(seen, np.exp(lse_t - m_safe), 0.0)
        total = w.sum(axis=0)
        empty = total == 0
        acc = np.where(seen[..., None], w[..., None] * outs, 0.0).sum(axis=0)
        out = np.where(empty[..., None], 0.0, acc / np.where(empty, 1.0, total)[..., None])
        lse = np.where(empty, -np.inf, m_safe + np.log(np.where(empty, 1.0, total)))
    return out, np.moveaxis(lse, -1, -2)
