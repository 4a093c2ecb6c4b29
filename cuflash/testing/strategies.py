"""hypothesis strategies for attention problems whose shapes straddle tile edges and whose options
cover every modifier (hypothesis is imported only when a strategy is built)."""

from __future__ import annotations

import numpy as np

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


def _st():
    try:
        from hypothesis import strategies
    except ImportError as e:  # pragma: no cover - hypothesis is a test dependency
        raise ImportError("cuflash.testing strategies need hypothesis "
                          "(pip install hypothesis)") from e
    return strategies



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

