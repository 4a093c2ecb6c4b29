"""Tools for testing attention implementations against cuflash's float64 reference.

Public, for anyone fuzzing their own attention code (cuflash's own tests use them):

- hypothesis strategies for shapes and options that straddle tile edges
  (:func:`head_dims`, :func:`seqlens`, :func:`gqa_heads`, :func:`attention_shapes`,
  :func:`attention_options`, :func:`problems`, :func:`varlen_seqlens`);
- :func:`random_qkv`: fresh normal data for NumPy or CuPy, any supported dtype;
- :func:`baseline_attention`: a plain same-dtype attention (matmul, softmax, matmul, rounded to
  the dtype where a naive kernel rounds), the yardstick of the accuracy rule;
- :func:`assert_attention_close`: the accuracy rule.

The accuracy rule
-----------------
For float16/bfloat16, an output passes if ``max|out - ref| <= 2 * max|baseline - ref| + atol``
(``ref`` the float64 reference, ``baseline`` the same-dtype naive attention on the same inputs):
an exact kernel may be at most twice as far from the truth as the textbook computation in that
dtype. For float32 (and float64): ``||out - ref||_F <= rtol * ||ref||_F + atol * sqrt(n)`` with
``rtol = 1e-5``. NaN must appear exactly where the reference has NaN, and infinities (``lse = -inf``
of rows that see no key) must match exactly.

Hypothesis is imported only when a strategy is built, so the rest works without it.
"""

from __future__ import annotations

import numpy as np

from cuflash.reference import _forward as _reference
from cuflash.random import as_rng_state, dropout_keep

__all__ = [
    "ALL_OPTIONS",
    "DEFAULT_ATOL",
    "VARLEN_OPTIONS",
    "as_device_options",
    "assert_attention_close",
    "attention_options",
    "attention_shapes",
    "baseline_attention",
    "baseline_attention_varlen",
    "decode_case",
    "decode_kwargs",
    "decode_on",
    "gqa_heads",
    "head_dims",
    "problems",
    "normal_data",
    "random_qkv",
    "seqlens",
    "varlen_seqlens",
]

#: Options that :func:`attention_options` can draw.
ALL_OPTIONS = frozenset({"causal", "scale", "window", "softcap", "alibi_slopes", "mask", "bias",
                         "block_mask", "dropout_p"})
#: The subset that varlen attention supports.
VARLEN_OPTIONS = ALL_OPTIONS - {"mask", "bias", "block_mask"}

#: Sequence lengths around the usual tile sizes (16, 64, 128) and odd lengths.
TILE_EDGE_SEQLENS = (1, 2, 17, 63, 64, 65, 113, 127, 128, 129, 255, 257, 1025)
#: Head dimensions that kernels usually specialise on.
COMMON_HEAD_DIMS = (32, 64, 96, 128, 256)
#: Absolute slack of the half-precision rule. About a quarter of an ulp at 1.0 of the dtype
#: (bf16 eps = 2**-8, fp16 eps = 2**-11): it only matters when the baseline is (nearly) exact,
#: e.g. Sk = 1 where out = v, and it is small against typical baseline errors.
DEFAULT_ATOL = {"bfloat16": 1e-3, "float16": 2e-4, "float32": 1e-6, "float64": 1e-12}
#: Relative Frobenius tolerance for float32 outputs.
FLOAT32_RTOL = 1e-5


def _st():
    try:
        from hypothesis import strategies
    except ImportError as e:  # pragma: no cover - hypothesis is a test dependency
        raise ImportError("cuflash.testing strategies need hypothesis "
                          "(pip install hypothesis)") from e
    return strategies


# ----------------------------------------------------------------------------- dtypes, modules

def _dtype(dtype):
    """NumPy dtype for a name or dtype ("bfloat16" resolves through ml_dtypes)."""
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    if isinstance(dtype, str) and dtype in ("fp16", "half"):
        return np.dtype(np.float16)
    return np.dtype(dtype)


def _is_cupy(x):
    return type(x).__module__.split(".")[0] == "cupy"


def _xp_of(x):
    if _is_cupy(x):
        import cupy
        return cupy
    return np


def _host(x):
    """Any array (NumPy, CuPy, ``__array__``) as NumPy."""
    return x.get() if _is_cupy(x) else np.asarray(x)


def _host64(x):
    return _host(x).astype(np.float64)


# ----------------------------------------------------------------------------- strategies

def head_dims(*, max_dim=256, multiple_of=8):
    """Strategy for head dimensions.

    Mostly the common kernel specialisations (32, 64, 96, 128, 256), sometimes any multiple of
    ``multiple_of`` up to ``max_dim``.

    Parameters
    ----------
    max_dim : int, default 256
    multiple_of : int, default 8

    Returns
    -------
    hypothesis strategy of int

    Examples
    --------
    >>> from hypothesis import given
    >>> from cuflash import testing
    >>> @given(testing.head_dims(max_dim=128))
    ... def test_head_dim(d):
    ...     assert d % 8 == 0 and d <= 128
    """
    st = _st()
    common = [d for d in COMMON_HEAD_DIMS if d <= max_dim and d % multiple_of == 0]
    anything = st.integers(1, max_dim // multiple_of).map(lambda n: n * multiple_of)
    return st.one_of(st.sampled_from(common), anything) if common else anything


def seqlens(*, min_value=1, max_value=1025):
    """Strategy for sequence lengths that straddle tile edges.

    Draws from 1, 2, 17, 63, 64, 65, 113, 127, 128, 129, 255, 257, 1025 (those within
    ``[min_value, max_value]``) or a small random length.

    Parameters
    ----------
    min_value, max_value : int
        Bounds, inclusive (default 1 and 1025).

    Returns
    -------
    hypothesis strategy of int

    Examples
    --------
    >>> from cuflash import testing
    >>> testing.seqlens(max_value=300).example()   # doctest: +SKIP
    129
    """
    st = _st()
    edges = [s for s in TILE_EDGE_SEQLENS if min_value <= s <= max_value]
    small = st.integers(min_value, max(min_value, min(max_value, 40)))
    return st.one_of(st.sampled_from(edges), small) if edges else small


def gqa_heads(*, max_heads=8):
    """Strategy for ``(Hq, Hk)`` with ``Hq % Hk == 0``: MHA, GQA and MQA.

    Parameters
    ----------
    max_heads : int, default 8
        Bound on Hq.

    Returns
    -------
    hypothesis strategy of (int, int)

    Examples
    --------
    >>> from cuflash import testing
    >>> testing.gqa_heads(max_heads=8).example()   # doctest: +SKIP
    (6, 2)
    """
    st = _st()

    @st.composite
    def draw_heads(draw):
        hk = draw(st.integers(1, max(1, min(4, max_heads))))
        group = draw(st.sampled_from([g for g in (1, 2, 3, 4, 8) if hk * g <= max_heads]))
        return hk * group, hk

    return draw_heads()


def attention_shapes(*, max_batch=3, max_seqlen=1025, head_dims=None, max_heads=8,
                     max_scores=2**21):
    """Strategy for attention problem shapes.

    Parameters
    ----------
    max_batch, max_seqlen, max_heads : int
        Upper bounds.
    head_dims : hypothesis strategy of int, optional
        Defaults to :func:`head_dims` (``_head_dims()`` here, up to 256).
    max_scores : int
        Bound on ``B * Hq * Sq * Sk`` so the float64 reference stays cheap; the batch, heads and
        (if needed) ``Sk`` are reduced to fit.

    Returns
    -------
    hypothesis strategy of dict
        Keys ``B, Sq, Sk, Hq, Hk, D``.

    Examples
    --------
    >>> from cuflash import testing
    >>> testing.attention_shapes(max_seqlen=300).example()   # doctest: +SKIP
    {'B': 2, 'Sq': 17, 'Sk': 129, 'Hq': 4, 'Hk': 2, 'D': 64}
    """
    st = _st()
    dims = head_dims if head_dims is not None else _head_dims_default()

    @st.composite
    def draw_shape(draw):
        sq = draw(seqlens(max_value=max_seqlen))
        sk = draw(seqlens(max_value=max_seqlen))
        if sq * sk > max_scores:
            sk = max(1, max_scores // sq)
        budget = max_scores // (sq * sk)
        hq, hk = draw(gqa_heads(max_heads=max(1, min(max_heads, budget))))
        b = draw(st.integers(1, max(1, min(max_batch, budget // hq))))
        return dict(B=b, Sq=sq, Sk=sk, Hq=hq, Hk=hk, D=draw(dims))

    return draw_shape()


_head_dims_default = head_dims  # attention_shapes' argument shadows the function name


def _option_array_shape(draw, st, full, kinds):
    """Pick a shape broadcastable to ``full`` = (B, H, X, Y) among typical layouts."""
    b, h, x, y = full
    shapes = {
        "full": (b, h, x, y),
        "shared": (1, 1, x, y),
        "2d": (x, y),
        "per_batch_key": (b, 1, 1, y),
        "per_head": (1, h, x, y),
        "per_batch_row": (b, 1, x, 1),
    }
    return shapes[draw(st.sampled_from(kinds))]


def attention_options(shape, *, allow=None, block_sizes=((128, 128), (64, 64), (128, 64),
                                                         (64, 128), (16, 32))):
    """Strategy for keyword options of an attention call on ``shape``.

    Parameters
    ----------
    shape : dict
        ``B, Sq, Sk, Hq`` (as from :func:`attention_shapes`).
    allow : set of str, optional
        Option names that may be drawn (default :data:`ALL_OPTIONS`; use
        :data:`VARLEN_OPTIONS` for varlen). Each allowed option is drawn or left out.
    block_sizes : sequence of (int, int)
        Candidates for ``block_size`` when ``block_mask`` is drawn.

    Returns
    -------
    hypothesis strategy of dict
        Keyword arguments: ``causal`` (bool), ``scale`` (float), ``window`` ((left, right),
        -1 unbounded), ``softcap`` (float > 0), ``alibi_slopes`` (float32, (Hq,) or (B, Hq)),
        ``mask`` (bool, broadcastable to (B, Hq, Sq, Sk), sometimes with fully masked rows),
        ``bias`` (float32, broadcastable likewise), ``block_mask`` + ``block_size``,
        ``dropout_p``. Arrays are NumPy (see :func:`as_device_options`); they come from a drawn
        seed rather than element by element, so large ones stay cheap.

    Examples
    --------
    >>> from hypothesis import given, strategies as st
    >>> from cuflash import testing
    >>> @given(st.data())
    ... def test_options(data):
    ...     shape = data.draw(testing.attention_shapes(max_seqlen=128))
    ...     options = data.draw(testing.attention_options(shape, allow=testing.VARLEN_OPTIONS))
    ...     assert "mask" not in options
    """
    st = _st()
    allow = ALL_OPTIONS if allow is None else frozenset(allow)
    unknown = allow - ALL_OPTIONS
    if unknown:
        raise ValueError(f"unknown options in allow: {sorted(unknown)}")
    B, Sq, Sk, Hq = shape["B"], shape["Sq"], shape["Sk"], shape["Hq"]

    @st.composite
    def draw_options(draw):
        opts = {}
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

        def wanted(name):
            return name in allow and draw(st.booleans())

        if wanted("causal"):
            opts["causal"] = True
        if wanted("scale"):
            opts["scale"] = draw(st.one_of(st.sampled_from([0.05, 0.5, 1.0]),
                                           st.floats(0.01, 2.0)))
        if wanted("window"):
            side = st.one_of(st.just(-1), st.integers(0, 4),
                             st.integers(0, max(Sq, Sk) + 2))
            opts["window"] = (draw(side), draw(side))
        if wanted("softcap"):
            opts["softcap"] = draw(st.sampled_from([1.0, 5.0, 30.0]))
        if wanted("alibi_slopes"):
            rows = draw(st.sampled_from([None, B]))
            size = (Hq,) if rows is None else (rows, Hq)
            if draw(st.booleans()):  # the ALiBi paper's geometric slopes
                slopes = 2.0 ** (-8.0 * np.arange(1, Hq + 1) / Hq) * np.ones(size)
            else:
                slopes = rng.uniform(0.0, 1.0, size)
            opts["alibi_slopes"] = slopes.astype(np.float32)
        if wanted("mask"):
            mshape = _option_array_shape(draw, st, (B, Hq, Sq, Sk),
                                         ["full", "shared", "2d", "per_batch_key", "per_head",
                                          "per_batch_row"])
            density = draw(st.sampled_from([0.05, 0.5, 0.9, 1.0]))
            mask = rng.random(mshape) < density
            if mshape[-2] == Sq and Sq > 1 and draw(st.booleans()):
                rows = rng.choice(Sq, size=max(1, Sq // 4), replace=False)
                mask[..., rows, :] = False  # rows that see no key at all
            opts["mask"] = mask
        if wanted("bias"):
            bshape = _option_array_shape(draw, st, (B, Hq, Sq, Sk),
                                         ["full", "shared", "2d", "per_batch_key", "per_head",
                                          "per_batch_row"])
            amplitude = draw(st.sampled_from([0.1, 1.0, 5.0]))
            opts["bias"] = (amplitude * rng.standard_normal(bshape)).astype(np.float32)
        if wanted("block_mask"):
            bq, bk = draw(st.sampled_from(list(block_sizes)))
            nbq, nbk = -(-Sq // bq), -(-Sk // bk)
            kshape = _option_array_shape(draw, st, (B, Hq, nbq, nbk),
                                         ["full", "shared", "per_head"])
            density = draw(st.sampled_from([0.25, 0.5, 0.9]))
            opts["block_mask"] = rng.random(kshape) < density
            opts["block_size"] = (bq, bk)
        if wanted("dropout_p"):
            opts["dropout_p"] = draw(st.one_of(st.sampled_from([0.1, 0.5]),
                                               st.floats(0.01, 0.9)))
        return opts

    return draw_options()


def problems(*, max_batch=2, max_seqlen=1025, head_dims=None, max_heads=8, max_scores=2**21,
             dtypes=("float16", "bfloat16", "float32"), allow=None):
    """Strategy for whole attention problems.

    Parameters
    ----------
    max_batch, max_seqlen, head_dims, max_heads, max_scores
        As in :func:`attention_shapes`.
    dtypes : sequence of str, default ("float16", "bfloat16", "float32")
        The dtypes to draw from.
    allow : set of str, optional
        As in :func:`attention_options`.

    Returns
    -------
    hypothesis strategy of dict
        ``shape`` (from :func:`attention_shapes`), ``dtype`` (a name from ``dtypes``),
        ``options`` (from :func:`attention_options`), ``seed`` (int, for :func:`random_qkv`
        and a dropout generator).

    Examples
    --------
    >>> from hypothesis import given
    >>> from cuflash import reference, testing
    >>> @given(testing.problems(max_seqlen=200, dtypes=("float32",)))
    ... def test_reference_runs(problem):
    ...     q, k, v = testing.random_qkv(problem["shape"], problem["dtype"], problem["seed"])
    ...     options = dict(problem["options"])
    ...     if "dropout_p" in options:
    ...         options["rng_state"] = (problem["seed"], 0)
    ...     reference.attention_forward(q, k, v, **options)
    """
    st = _st()

    @st.composite
    def draw_problem(draw):
        shape = draw(attention_shapes(max_batch=max_batch, max_seqlen=max_seqlen,
                                      head_dims=head_dims, max_heads=max_heads,
                                      max_scores=max_scores))
        return dict(shape=shape, dtype=draw(st.sampled_from(list(dtypes))),
                    options=draw(attention_options(shape, allow=allow)),
                    seed=draw(st.integers(0, 2**63 - 1)))

    return draw_problem()


def varlen_seqlens(*, max_batch=4, max_seqlen=300, allow_empty=True):
    """Strategy for ``(cu_seqlens_q, cu_seqlens_k)``, int32 NumPy arrays of shape (B + 1,).

    Lengths are drawn like :func:`seqlens` (0 too, if ``allow_empty``), independently for
    queries and keys.

    Parameters
    ----------
    max_batch : int, default 4
        Bound on the number of sequences B.
    max_seqlen : int, default 300
        Bound on each length.
    allow_empty : bool, default True
        Whether a sequence may be empty.

    Returns
    -------
    hypothesis strategy of (numpy.ndarray, numpy.ndarray)

    Examples
    --------
    >>> from cuflash import testing
    >>> testing.varlen_seqlens(max_batch=2).example()   # doctest: +SKIP
    (array([ 0, 17, 81], dtype=int32), array([  0,   1, 130], dtype=int32))
    """
    st = _st()
    length = seqlens(max_value=max_seqlen)
    if allow_empty:
        length = st.one_of(st.just(0), length)

    @st.composite
    def draw_cu(draw):
        b = draw(st.integers(1, max_batch))
        lq = [draw(length) for _ in range(b)]
        lk = [draw(length) for _ in range(b)]
        return (np.concatenate([[0], np.cumsum(lq)]).astype(np.int32),
                np.concatenate([[0], np.cumsum(lk)]).astype(np.int32))

    return draw_cu()


def as_device_options(options, xp):
    """Copy of ``options`` with every NumPy array converted by ``xp.asarray`` (e.g. CuPy).

    Parameters
    ----------
    options : dict
        Keyword options, e.g. from :func:`attention_options`.
    xp : module
        ``cupy`` (or ``numpy``).

    Returns
    -------
    dict

    Examples
    --------
    >>> import cupy as cp
    >>> from cuflash import testing
    >>> opts = testing.as_device_options({"causal": True, "mask": mask_on_host}, cp)
    """
    return {name: xp.asarray(value) if isinstance(value, np.ndarray) else value
            for name, value in options.items()}


# ----------------------------------------------------------------------------- data

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
                num_pages=None):
    """Host arrays of a decode problem: q (B, Sq, Hq, D), a contiguous (B, capacity, Hk, D) or paged
    (num_pages, page_size, Hk, D) cache holding ``lens[b]`` keys per sequence, and with ``append``
    Sq new tokens (k_new, v_new) to write after them. Cache memory no sequence uses holds NaN (so a
    kernel that reads it shows), block_table is -1 past each sequence's pages, which are in random
    order; ``num_pages`` defaults to the pages needed plus 3.

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
        v_cache = np.full((num_pages, page_size, Hk, D), np.nan, dtype=dt)
        used = 0
        for b in range(B):
            n = int(needed[b])
            table[b, :n] = order[used:used + n]
            used += n
            pos = np.arange(lens[b])
            rows = (table[b, pos // page_size], pos % page_size)
            k_cache[rows] = normal_data(rng, (int(lens[b]), Hk, D), dtype)
            v_cache[rows] = normal_data(rng, (int(lens[b]), Hk, D), dtype)
    else:
        assert lens.max() + s_new <= capacity
        table = None
        k_cache = np.full((B, capacity, Hk, D), np.nan, dtype=dt)
        v_cache = np.full((B, capacity, Hk, D), np.nan, dtype=dt)
        for b in range(B):
            k_cache[b, :lens[b]] = normal_data(rng, (int(lens[b]), Hk, D), dtype)
            v_cache[b, :lens[b]] = normal_data(rng, (int(lens[b]), Hk, D), dtype)
    k_new = normal_data(rng, (B, s_new, Hk, D), dtype) if append else None
    v_new = normal_data(rng, (B, s_new, Hk, D), dtype) if append else None
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


def _round_to(x, dtype):
    """Round float32 ``x`` to ``dtype`` and back, as storing it in that dtype would."""
    if dtype == np.float32 or dtype == np.float64:
        return x
    return x.astype(dtype).astype(np.float32)


def _baseline(q, k, v, batch_ids, *, causal=False, scale=None, window=None, softcap=0.0,
              alibi_slopes=None, mask=None, bias=None, block_mask=None, block_size=(128, 128),
              dropout_p=0.0, rng_state=None):
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
    if B * Hq * Sq == 0 or Sk == 0:
        return (np.zeros((B, Sq, Hq, Dv)),
                np.full((B, Hq, Sq), -np.inf if Sk == 0 else 0.0))
    if scale is None:
        scale = 1.0 / np.sqrt(D)
    s = _round_to(xp.matmul(qt, kt), dtype)                                # S = q k^T
    s = _reference._score_pipeline(xp, s, scale=scale, causal=causal, window=window,
                                   softcap=softcap, alibi_slopes=alibi_slopes, mask=mask,
                                   bias=bias, block_mask=block_mask, block_size=block_size)
    m = s.max(axis=-1, keepdims=True)
    empty = m == -np.inf
    e = xp.exp(s - xp.where(empty, f32(0), m))
    l = e.sum(axis=-1, keepdims=True)
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
        Those of :func:`cuflash.reference.attention_forward` (``rng_state`` with dropout).

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


# ----------------------------------------------------------------------------- the rule

def _where(index, shape):
    return tuple(int(n) for n in np.unravel_index(index, shape))


def assert_attention_close(out, ref, baseline=None, *, dtype=None, atol=None, rtol=FLOAT32_RTOL,
                           name="out"):
    """Assert the accuracy rule for an attention result.

    Parameters
    ----------
    out : array (NumPy, CuPy or ``__array__``)
        The result under test (``out`` or ``lse``).
    ref : array, same shape
        The float64 reference (:mod:`cuflash.reference`).
    baseline : array, same shape, optional
        :func:`baseline_attention` on the same inputs; required for float16/bfloat16.
    dtype : str or dtype, optional
        The dtype whose rule applies; defaults to ``out.dtype`` (give it for ``lse``, which
        is float32 whatever the inputs were).
    atol : float, optional
        Absolute slack; defaults to :data:`DEFAULT_ATOL` of the dtype (bfloat16 1e-3,
        float16 2e-4, float32 1e-6 as an RMS slack).
    rtol : float
        Relative Frobenius tolerance of the float32 rule (1e-5).
    name : str
        Used in the failure message.

    Raises
    ------
    AssertionError
        If shapes differ, NaN/Inf positions differ from the reference's, or the error is too
        large; the message gives the error, where it is largest and the allowance.
    ValueError
        If a half-precision check has no ``baseline``.

    Notes
    -----
    float16/bfloat16: ``max|out - ref| <= 2 * max|baseline - ref| + atol``.
    float32/float64: ``||out - ref||_F <= rtol * ||ref||_F + atol * sqrt(n)``.
    Both are taken over the elements where the reference is finite.

    Examples
    --------
    >>> import cupy as cp
    >>> import cuflash
    >>> from cuflash import reference, testing
    >>> q, k, v = testing.random_qkv(dict(B=1, Sq=200, Sk=300, Hq=4, Hk=2, D=64), "bfloat16", seed=1, xp=cp)
    >>> out = cuflash.attention(q, k, v, causal=True)
    >>> ref, _ = reference.attention_forward(q, k, v, causal=True)
    >>> testing.assert_attention_close(out, ref, testing.baseline_attention(q, k, v, causal=True))
    """
    dtype = _dtype(dtype) if dtype is not None else np.dtype(getattr(out, "dtype", np.float64))
    half = dtype in (np.dtype(np.float16), _dtype("bfloat16"))
    if atol is None:
        atol = DEFAULT_ATOL.get(dtype.name, DEFAULT_ATOL["float32"])
    o, r = _host64(out), _host64(ref)
    if o.shape != r.shape:
        raise AssertionError(f"{name}: shape {o.shape} differs from the reference's {r.shape}")

    finite = np.isfinite(r)
    bad = (np.isnan(o) != np.isnan(r)) | (np.isinf(r) & (o != r)) | (finite & ~np.isfinite(o))
    if bad.any():
        first = np.flatnonzero(bad)[0]
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.size} elements are NaN/Inf where the reference "
            f"is not, or the other way round; first at {_where(first, o.shape)}: "
            f"{name}={o.flat[first]:.6g}, reference={r.flat[first]:.6g}")
    if not finite.any():
        return

    # Compare finite elements only (inf - inf would warn and say nothing).
    r = np.where(finite, r, 0.0)
    err = np.abs(np.where(finite, o, 0.0) - r)
    worst = int(np.argmax(err))
    where = (f"largest at {_where(worst, o.shape)}: {name}={o.flat[worst]:.6g}, "
             f"reference={r.flat[worst]:.6g}")
    if half:
        if baseline is None:
            raise ValueError(f"the {dtype.name} accuracy rule needs baseline= "
                             "(cuflash.testing.baseline_attention)")
        bl = _host64(baseline)
        if bl.shape != r.shape:
            raise ValueError(f"baseline shape {bl.shape} differs from the reference's {r.shape}")
        # A non-finite baseline element (e.g. 0 * NaN from a masked key) says nothing of scale.
        berr = np.abs(np.where(finite & np.isfinite(bl), bl, r) - r)
        allowed = 2.0 * berr.max() + atol
        if err.max() > allowed:
            raise AssertionError(
                f"{name} ({dtype.name}): max|{name} - ref| = {err.max():.3e} > "
                f"2 * max|baseline - ref| + atol = 2 * {berr.max():.3e} + {atol:.1e} = "
                f"{allowed:.3e}; {where}; baseline worst at "
                f"{_where(int(np.argmax(berr)), o.shape)}")
    else:
        n = int(finite.sum())
        diff = float(np.sqrt(np.sum(err ** 2)))
        norm = float(np.sqrt(np.sum(r ** 2)))
        allowed = rtol * norm + atol * np.sqrt(n)
        if diff > allowed:
            raise AssertionError(
                f"{name} ({dtype.name}): ||{name} - ref||_F = {diff:.3e} > rtol * ||ref||_F + "
                f"atol * sqrt(n) = {rtol:.0e} * {norm:.3e} + {atol:.0e} * sqrt({n}) = "
                f"{allowed:.3e} (relative {diff / max(norm, 1e-300):.2e}); max abs error "
                f"{err.max():.3e}, {where}")
