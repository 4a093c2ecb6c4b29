"""Fresh random inputs: q, k, v of any dtype, normal data, and decode cases (caches, lengths, page
tables) with their arrays on any module."""

from __future__ import annotations

import numpy as np

from ._arrays import _dtype


def random_qkv(shape, dtype, seed, xp=np):
    """Fresh standard-normal ``q, k, v`` for ``shape``.

    Parameters
    ----------
    shape : dict
        ``B, Sq, Sk, Hq, Hk, D`` and optionally ``Dv`` (value head dim, default ``D``).
    dtype : str or dtype
        "float16", "bfloat16" (ml_dtypes) or "float32".
    seed : int
        Same seed, same values, whatever ``xp``.
    xp : module
        ``numpy`` or ``cupy``; the arrays are made on the host and copied.

    Returns
    -------
    q : array, shape (B, Sq, Hq, D)
    k : array, shape (B, Sk, Hk, D)
    v : array, shape (B, Sk, Hk, Dv)
        No element is zero (a zero would hide an unwritten or skipped value).

    Examples
    --------
    >>> from cuflash import testing
    >>> shape = dict(B=1, Sq=17, Sk=129, Hq=4, Hk=2, D=64)
    >>> q, k, v = testing.random_qkv(shape, "float16", seed=0)
    >>> q.shape, k.shape, q.dtype
    ((1, 17, 4, 64), (1, 129, 2, 64), dtype('float16'))
    """
    dtype = _dtype(dtype)
    rng = np.random.default_rng(seed)
    B, Sq, Sk, Hq, Hk, D = (shape[n] for n in ("B", "Sq", "Sk", "Hq", "Hk", "D"))
    Dv = shape.get("Dv", D)
    out = []
    for dims in ((B, Sq, Hq, D), (B, Sk, Hk, D), (B, Sk, Hk, Dv)):
        x = rng.standard_normal(dims, dtype=np.float32).astype(dtype)
        x[x == 0] = 1  # rounding (fp16 underflow) may produce zeros
        out.append(xp.asarray(x))
    return tuple(out)


# ----------------------------------------------------------------------------- baseline

def score_tile_operand(kind, shape, dtype, seed, xp=np, *, rows_stride=None, empty_rows=0):
    """A bias or a bool mask of ``shape`` on ``xp``, as the kernels' score tiles read them: the bias
    normal with amplitude 2 and ~5% -inf, in ``dtype``; the mask ~70% True, its first ``empty_rows``
    rows all False (rows that see no key). ``rows_stride``: the last axis cut from a wider array of that
    many columns (rows apart by more than a row)."""
    rng = np.random.default_rng(seed)
    wide = tuple(shape[:-1]) + ((rows_stride or shape[-1]),)
    if kind == "mask":
        x = rng.random(wide) < 0.7
        x[..., :empty_rows, :] = False
    else:
        x = 2.0 * rng.standard_normal(wide)
        x[rng.random(wide) < 0.05] = -np.inf
        x = x.astype(np.float32).astype(_dtype(dtype))
    return xp.asarray(x)[..., :shape[-1]]


def bias_with_hidden_infinities(sq, sk, dtype, seed, xp=np):
    """A (sq, sk) bias as :func:`score_tile_operand` makes it (~5% -inf), with NaN and +inf at two in
    three of the keys a causal (bottom-right) mask hides from each query: values that must not reach
    a row."""
    bias = np.asarray(score_tile_operand("bias", (sq, sk), dtype, seed)).astype(np.float32)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    hidden = (j > i + sk - sq) & (j % 3 != 2)
    bias = np.where(hidden, np.where(j % 2 == 0, np.nan, np.inf), bias)
    return xp.asarray(bias.astype(_dtype(dtype)))


def normal_data(rng, shape, dtype):
    """Standard normal host values of ``dtype`` from ``rng``, with no zeros (test data is never zero:
    an unwritten output must not pass as a result).

    Parameters
    ----------
    rng : numpy.random.Generator
    shape : tuple of int
    dtype : str or dtype
        "float16", "bfloat16" (ml_dtypes), "float32", ...

    Returns
    -------
    numpy.ndarray of ``dtype``, shape ``shape``

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash import testing
    >>> x = testing.normal_data(np.random.default_rng(0), (2, 3), "float16")
    >>> x.dtype, bool((x != 0).all())
    (dtype('float16'), True)
    """
    x = rng.standard_normal(shape, dtype=np.float32).astype(_dtype(dtype))
    x[x == 0] = 1
    return x


#: The arrays of a :func:`decode_case`, in decode's argument order.
DECODE_ARRAYS = ("q", "k_cache", "v_cache", "k_new", "v_new", "lens", "table")


def decode_case(rng, lens, *, paged, append, dtype, B, Hq, Hk, D, Sq, capacity, page_size, max_pages,
                num_pages=None, D_v=None):
    """Host arrays of a decode problem: q (B, Sq, Hq, D), a contiguous (B, capacity, Hk, D) or paged
    (num_pages, page_size, Hk, D) cache holding ``lens[b]`` keys per sequence, and with ``append``
    Sq new tokens (k_new, v_new) to write after them. Cache memory no sequence uses holds NaN (so a
    kernel that reads it shows), block_table is -1 past each sequence's pages, which are in random
    order; ``num_pages`` defaults to the pages needed plus 3. ``D_v``: v_cache's and v_new's head dim
    when it is their own (default D).

    Returns
    -------
    dict of NumPy arrays: q, k_cache, v_cache, k_new, v_new (None without append), lens (int32),
    table (int32 (B, max_pages), None when contiguous); and dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash import testing
    >>> case = testing.decode_case(np.random.default_rng(0), [5, 40], paged=True, append=True,
    ...                            dtype="float16", B=2, Hq=4, Hk=2, D=64, Sq=1, capacity=64,
    ...                            page_size=16, max_pages=4)
    >>> case["k_cache"].shape, case["table"].shape
    ((7, 16, 2, 64), (2, 4))
    """
    dt = _dtype(dtype)
    D_v = D if D_v is None else D_v
    lens = np.asarray(lens, dtype=np.int64)
    s_new = Sq if append else 0
    q = normal_data(rng, (B, Sq, Hq, D), dtype)
    if paged:
        needed = -(-(lens + s_new) // page_size)
        assert needed.max() <= max_pages
        num_pages = int(needed.sum()) + 3 if num_pages is None else num_pages
        assert needed.sum() <= num_pages
        order = rng.permutation(num_pages)
        table = np.full((B, max_pages), -1, dtype=np.int32)
        k_cache = np.full((num_pages, page_size, Hk, D), np.nan, dtype=dt)
        v_cache = np.full((num_pages, page_size, Hk, D_v), np.nan, dtype=dt)
        used = 0
        for b in range(B):
            n = int(needed[b])
            table[b, :n] = order[used:used + n]
            used += n
            pos = np.arange(lens[b])
            rows = (table[b, pos // page_size], pos % page_size)
            k_cache[rows] = normal_data(rng, (int(lens[b]), Hk, D), dtype)
            v_cache[rows] = normal_data(rng, (int(lens[b]), Hk, D_v), dtype)
    else:
        assert lens.max() + s_new <= capacity
        table = None
        k_cache = np.full((B, capacity, Hk, D), np.nan, dtype=dt)
        v_cache = np.full((B, capacity, Hk, D_v), np.nan, dtype=dt)
        for b in range(B):
            k_cache[b, :lens[b]] = normal_data(rng, (int(lens[b]), Hk, D), dtype)
            v_cache[b, :lens[b]] = normal_data(rng, (int(lens[b]), Hk, D_v), dtype)
    k_new = normal_data(rng, (B, s_new, Hk, D), dtype) if append else None
    v_new = normal_data(rng, (B, s_new, Hk, D_v), dtype) if append else None
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new, lens=lens.astype(np.int32),
                table=table, dtype=dtype)


def decode_on(case, xp):
    """The case's arrays as ``xp`` arrays (``cupy`` for the GPU; None stays None).

    Parameters
    ----------
    case : dict
        From :func:`decode_case`.
    xp : module
        ``cupy`` or ``numpy``.

    Returns
    -------
    dict
        ``q, k_cache, v_cache, k_new, v_new, lens, table`` (:data:`DECODE_ARRAYS`).

    Examples
    --------
    >>> import cupy as cp
    >>> import cuflash
    >>> from cuflash import testing
    >>> gpu = testing.decode_on(case, cp)
    >>> out = cuflash.decode(gpu["q"], gpu["k_cache"], gpu["v_cache"], **testing.decode_kwargs(gpu))
    """
    return {n: None if case[n] is None else xp.asarray(case[n]) for n in DECODE_ARRAYS}


def decode_kwargs(case):
    """decode's keyword arrays of a case (absent ones left out, so that a plan accepts them).

    Parameters
    ----------
    case : dict
        From :func:`decode_case` (host arrays) or :func:`decode_on` (device arrays).

    Returns
    -------
    dict
        ``cache_seqlens``, ``block_table``, ``k_new``, ``v_new``: those that are not None.

    Examples
    --------
    >>> from cuflash import reference, testing
    >>> out, lse = reference.decode(case["q"], case["k_cache"], case["v_cache"], **testing.decode_kwargs(case))
    """
    kw = dict(cache_seqlens=case["lens"], block_table=case["table"], k_new=case["k_new"], v_new=case["v_new"])
    return {n: x for n, x in kw.items() if x is not None}

