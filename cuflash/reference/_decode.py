"""Float64 reference for decode: per sequence, the cached keys gathered (through the page table),
the new rows appended, and attention with the queries aligned to the end of the keys; the caches in
their serving formats (fp8 bytes, an MLA latent cache) through :mod:`._kv_cache`."""

from __future__ import annotations

import numpy as np

from . import _kv_cache
from ._forward import _host, attention_forward

__all__ = ["decode"]


class _AtPosition:
    """A ScoreMod/MaskMod evaluated on decode's sequence ``b`` alone (a batch of one): ``b`` is the
    sequence's index and ``q_idx`` the new tokens' absolute positions, ``T_b - Sq`` onwards."""

    def __init__(self, modifier, b: int, q0: int):
        self.modifier, self.b, self.q0 = modifier, b, q0

    def reference(self, x):
        return self.modifier.reference(x, b0=self.b, q0=self.q0)

    def reference_gradient(self, x):
        return self.modifier.reference_gradient(x, b0=self.b, q0=self.q0)


def _decode_sequences(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, k_new=None,
                      v_new=None, causal=True, window=None, softcap=0.0, alibi_slopes=None, scale=None,
                      mask=None, score_mod=None, mask_mod=None):
    """Per-sequence attention problems of a decode call, in the inputs' own dtype.

    Returns
    -------
    problems : list of dict
        One per sequence b: ``q`` (1, Sq, Hq, D), ``k``, ``v`` (1, T_b, Hk, D) with
        ``T_b = cache_seqlens[b] + S_new`` (the cached keys, then the appended ones), and
        ``options`` for :func:`attention_forward` (causal bottom-right, the per-sequence ALiBi
        slopes and mask, the modifiers at the sequence's positions).
    k_after, v_after : numpy.ndarray
        Copies of the caches with the new rows written at ``cache_seqlens``, as decode leaves them.
    """
    q, k_cache, v_cache = _host(q), _host(k_cache), _host(v_cache)
    for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D, got shape {x.shape}")
    B, Sq, Hq, _ = q.shape
    paged = block_table is not None
    if paged:
        table = _host(block_table).astype(np.int64)
        page_size = k_cache.shape[1]
        capacity = table.shape[1] * page_size
    else:
        capacity = k_cache.shape[1]
    lens = (np.full(B, capacity, dtype=np.int64) if cache_seqlens is None
            else _host(cache_seqlens).astype(np.int64).reshape(B))
    k_after, v_after = k_cache.copy(), v_cache.copy()
    s_new = 0
    if k_new is not None:
        k_new, v_new = _host(k_new), _host(v_new)
        s_new = k_new.shape[1]

    def positions(b, pos):
        """Index of cache rows for positions ``pos`` of sequence b."""
        if paged:
            return table[b, pos // page_size], pos % page_size
        return np.full_like(pos, b), pos

    problems = []
    mask_full = None
    if mask is not None:
        m = _host(mask)
        if m.dtype != np.bool_:
            raise TypeError(f"mask must be a bool array, got dtype {m.dtype}")
        m = m.reshape((1,) * (4 - m.ndim) + m.shape)
        mask_full = np.broadcast_to(m, (B, Hq, Sq, m.shape[-1]))
    slopes = None if alibi_slopes is None else _host(alibi_slopes)
    for b in range(B):
        if s_new:
            idx = positions(b, lens[b] + np.arange(s_new))
            k_after[idx] = k_new[b]
            v_after[idx] = v_new[b]
        total = int(lens[b]) + s_new
        idx = positions(b, np.arange(total))
        options = dict(causal=causal, window=window, softcap=softcap, scale=scale)
        if score_mod is not None:
            options["score_mod"] = _AtPosition(score_mod, b, total - Sq)
        if mask_mod is not None:
            options["mask_mod"] = _AtPosition(mask_mod, b, total - Sq)
        if slopes is not None:
            options["alibi_slopes"] = slopes[b] if slopes.ndim == 2 else slopes
        if mask_full is not None:
            cols = mask_full.shape[-1]
            seq_mask = np.ones((1, Hq, Sq, total), dtype=bool)
            if cols == 1:  # one column for every key
                seq_mask &= mask_full[b:b + 1]
            else:          # the columns cover the last `cols` keys
                n = min(cols, total)
                if n:
                    seq_mask[..., total - n:] = mask_full[b:b + 1, ..., cols - n:]
            options["mask"] = seq_mask
        problems.append(dict(q=q[b:b + 1], k=k_after[idx][None], v=v_after[idx][None],
                             options=options))
    return problems, k_after, v_after


def decode(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, k_new=None, v_new=None,
           causal=True, window=None, softcap=0.0, alibi_slopes=None, scale=None, mask=None,
           return_cache=False, sinks=None, v_head_dim=None, kv_dtype=None, k_scale=None, v_scale=None,
           score_mod=None, mask_mod=None):
    """Float64 reference for :func:`cuflash.decode`, built on :func:`attention_forward`.

    For each sequence b it gathers the cached keys ``0 .. cache_seqlens[b] - 1`` (through
    ``block_table`` for a paged cache), appends ``k_new[b]`` / ``v_new[b]``, and attends with the
    queries aligned to the end of the keys (bottom-right, causal by default).

    Parameters
    ----------
    q : array (B, Sq, Hq, D)
    k_cache, v_cache : arrays (B, S_cache, Hk, D), or paged (num_pages, page_size, Hk, D)
        ``v_cache`` may have its own head dim Dv; ``v_cache=None`` with ``v_head_dim``: an MLA
        latent cache, whose first ``v_head_dim`` columns are the values.
    cache_seqlens : int array (B,), optional
        Default: full capacity.
    block_table : int array (B, max_pages), optional
    k_new, v_new : arrays (B, S_new, Hk, D), optional
    causal, window, softcap, alibi_slopes, scale
        As in :func:`attention_forward`, per sequence (a (B, Hq) ``alibi_slopes`` row per sequence).
    mask : bool array broadcastable to (B, Hq, Sq, M), optional
        Its M columns cover the last M keys of each sequence (keys before are not masked); M = 1
        covers every key.
    return_cache : bool
        Also return the caches as decode leaves them.
    sinks : float array (Hq,), optional
        As in :func:`attention_forward`.
    v_head_dim : int, optional
        With ``v_cache=None`` (MLA): Dv, the values' width; ``k_new`` is the appended latent row.
    kv_dtype : {"float8_e4m3fn"}, optional
        The caches hold e4m3 bytes (uint8) standing for ``value * k_scale`` / ``value * v_scale``;
        appended rows are quantised (round to nearest, saturated at 448).
    k_scale, v_scale : float or float array (Hk,), optional
        The fp8 caches' scales, per tensor or per kv head (MLA: ``k_scale`` for both).
    score_mod, mask_mod : cuflash.ScoreMod, cuflash.MaskMod, optional
        As in :func:`attention_forward`, with ``b`` the sequence, ``q_idx = i + T_b - Sq`` for new
        token ``i`` (its absolute position) and ``kv_idx`` the key's position in the sequence.

    Returns
    -------
    out : numpy.ndarray of float64, shape (B, Sq, Hq, D)
    lse : numpy.ndarray of float64, shape (B, Hq, Sq)
        ``-inf`` (and out = 0) for rows that see no key.
    k_after, v_after : numpy.ndarray, only if ``return_cache``
        Copies of the caches (their dtype; uint8 bytes for fp8) with the appended rows written;
        ``v_after`` is None for an MLA cache.

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash import reference
    >>> rng = np.random.default_rng(0)
    >>> k_cache, v_cache = rng.standard_normal((2, 16, 1, 8)), rng.standard_normal((2, 16, 1, 8))
    >>> q = rng.standard_normal((2, 1, 2, 8))
    >>> out, lse = reference.decode(q, k_cache, v_cache, cache_seqlens=np.array([5, 16]))
    >>> out.shape, lse.shape
    ((2, 1, 2, 8), (2, 2, 1))
    """
    mla = v_cache is None
    k_cache, v_cache, k_new, v_new, k_values, v_values = _kv_cache.prepare(
        k_cache, v_cache, k_new, v_new, v_head_dim=v_head_dim, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
    problems, k_after, v_after = _decode_sequences(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k_new=k_new,
        v_new=v_new, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        scale=scale, mask=mask, score_mod=score_mod, mask_mod=mask_mod)
    B, Sq, Hq, D = _host(q).shape
    out = np.zeros((B, Sq, Hq, v_after.shape[-1]))
    lse = np.zeros((B, Hq, Sq))
    for b, prob in enumerate(problems):
        o, l = attention_forward(prob["q"], k_values(prob["k"]), v_values(prob["v"]), sinks=sinks,
                                 **prob["options"])
        out[b], lse[b] = o[0], l[0]
    if return_cache:   # an MLA cache is one array: its values are k_after's first columns
        return out, lse, k_after, (None if mla else v_after)
    return out, lse
