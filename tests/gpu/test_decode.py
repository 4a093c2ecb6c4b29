"""cuflash.decode on the GPU against cuflash.reference.decode (float64).

Every case builds a cache whose unused memory is poisoned: slots past ``cache_seqlens`` (and past
the appended tokens) hold NaN, pages no sequence owns hold NaN, and ``block_table`` entries past a
sequence's last page are -1, so reading anything outside the sequences fails the comparison.
Outputs are NaN-poisoned ``out=`` buffers. After each call the whole cache must equal, bit for
bit, the old cache with the new rows written at ``cache_seqlens`` (nothing else touched).

Accuracy: :func:`cuflash.testing.assert_attention_close` against the reference with, for 16-bit
dtypes, the plain same-dtype baseline of each sequence (``cuflash.testing.baseline_attention`` on
the gathered keys); lse by the float32 rule.

Cost: the reference runs on the host, so caches stay small except in the 100k-key test (few heads,
small head dim); each hypothesis test caps its examples. Compile the kernels first
(``python -m cuflash precompile``) to keep the run near a minute on an H100/H200.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupy

import cuflash
import cuflash.testing as tt
from cuflash import reference

gpu = pytest.mark.gpu

NAN = float("nan")
DTYPES = ["float16", "bfloat16", "float32"]


def _capped(n):
    base = settings.default
    return settings(max_examples=max(1, min(base.max_examples, n)), deadline=None,
                    suppress_health_check=list(base.suppress_health_check)
                    + [HealthCheck.too_slow, HealthCheck.data_too_large,
                       HealthCheck.function_scoped_fixture])


# ----------------------------------------------------------------------------- building a case

def _bits(x):
    """A bit-exact view (NaN payloads included) for equality checks."""
    x = np.ascontiguousarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def build_case(*, dtype, B, Hq, Hk, D, Sq, lens, page_size, append, seed, slack=3, spare_pages=3):
    """Host arrays of one decode problem with a poisoned cache.

    Returns a dict: q, k_cache, v_cache, k_new, v_new (None without append), lens (int32),
    table (int32 (B, max_pages) or None), all NumPy in ``dtype``.
    """
    rng = np.random.default_rng(seed)
    dt = tt._dtype(dtype)
    lens = np.asarray(lens, dtype=np.int64)
    s_new = Sq if append else 0
    totals = lens + s_new

    def normal(*shape):
        x = rng.standard_normal(shape, dtype=np.float32).astype(dt)
        x[x == 0] = 1
        return x

    q = normal(B, Sq, Hq, D)
    if page_size is None:
        capacity = int(totals.max(initial=0)) + slack
        k_cache = np.full((B, capacity, Hk, D), NAN, dtype=dt)
        v_cache = np.full((B, capacity, Hk, D), NAN, dtype=dt)
        for b in range(B):
            k_cache[b, :lens[b]] = normal(int(lens[b]), Hk, D)
            v_cache[b, :lens[b]] = normal(int(lens[b]), Hk, D)
        table = None
    else:
        needed = -(-totals // page_size)
        max_pages = int(needed.max(initial=0)) + 1
        num_pages = int(needed.sum()) + spare_pages
        order = rng.permutation(num_pages)
        table = np.full((B, max_pages), -1, dtype=np.int32)
        k_cache = np.full((num_pages, page_size, Hk, D), NAN, dtype=dt)
        v_cache = np.full((num_pages, page_size, Hk, D), NAN, dtype=dt)
        used = 0
        for b in range(B):
            table[b, :needed[b]] = order[used:used + needed[b]]
            used += int(needed[b])
            pos = np.arange(lens[b])
            k_cache[table[b, pos // page_size], pos % page_size] = normal(int(lens[b]), Hk, D)
            v_cache[table[b, pos // page_size], pos % page_size] = normal(int(lens[b]), Hk, D)
    k_new = normal(B, s_new, Hk, D) if append else None
    v_new = normal(B, s_new, Hk, D) if append else None
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new,
                lens=lens.astype(np.int32), table=table)


def expected_for(case, *, dtype, options=None):
    """The reference (out, lse, k_after, v_after) of a case and, for 16-bit dtypes, its baseline."""
    ref_args = dict(cache_seqlens=case["lens"], block_table=case["table"], k_new=case["k_new"],
                    v_new=case["v_new"], **(options or {}))
    problems, k_after, v_after = reference._decode._decode_sequences(case["q"], case["k_cache"], case["v_cache"], **ref_args)
    B, Sq, Hq, D = case["q"].shape
    ref_out, ref_lse = np.zeros((B, Sq, Hq, D)), np.zeros((B, Hq, Sq))
    for b, p in enumerate(problems):
        o, l = reference.attention_forward(p["q"], p["k"], p["v"], **p["options"])
        ref_out[b], ref_lse[b] = o[0], l[0]
    base = None
    if dtype != "float32":
        base = np.concatenate([tt.baseline_attention(p["q"], p["k"], p["v"], **p["options"]) for p in problems])
    return dict(out=ref_out, lse=ref_lse, k_after=k_after, v_after=v_after, base=base)


def run_case(case, *, dtype, options=None, num_splits=0, host_indices=False, device_cache=None, expected=None):
    """Run cuflash.decode on a case and check it: output, lse, cache contents.

    ``device_cache``: (k_cache, v_cache) CuPy arrays holding ``case``'s cache values in some layout
    (default: fresh copies). ``expected``: :func:`expected_for` of the case, if already computed.
    Returns (out, lse) as CuPy arrays and the expected values.
    """
    options = dict(options or {})
    expected = expected or expected_for(case, dtype=dtype, options=options)
    q = cupy.asarray(case["q"])
    if device_cache is None:
        kc, vc = cupy.asarray(case["k_cache"]), cupy.asarray(case["v_cache"])
    else:
        kc, vc = device_cache
    kn = None if case["k_new"] is None else cupy.asarray(case["k_new"])
    vn = None if case["v_new"] is None else cupy.asarray(case["v_new"])
    lens, table = case["lens"], case["table"]
    if host_indices:
        seqlens_arg, table_arg = lens, table
    else:
        seqlens_arg = cupy.asarray(lens)
        table_arg = None if table is None else cupy.asarray(table)
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    got_out, got_lse = cuflash.decode(q, kc, vc, cache_seqlens=seqlens_arg, block_table=table_arg, k_new=kn,
                                      v_new=vn, num_splits=num_splits, out=out, return_lse=True,
                                      **tt.as_device_options(options, cupy))
    assert got_out.data.ptr == out.data.ptr, "out= was not used"
    assert got_lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and got_lse.dtype == np.float32
    tt.assert_attention_close(got_out, expected["out"], expected["base"], dtype=dtype, name="out")
    tt.assert_attention_close(got_lse, expected["lse"], dtype="float32", name="lse")
    assert np.array_equal(_bits(kc.get()), _bits(expected["k_after"])), "k_cache is not old cache + appended rows"
    assert np.array_equal(_bits(vc.get()), _bits(expected["v_after"])), "v_cache is not old cache + appended rows"
    return (got_out, got_lse), expected


# ----------------------------------------------------------------------------- properties

PAGE_SIZES = [None, 1, 16, 64, 256, 3]


@st.composite
def decode_problems(draw, dtypes=DTYPES, max_len=1500, options=True):
    dtype = draw(st.sampled_from(dtypes))
    page_size = draw(st.sampled_from(PAGE_SIZES))
    edge = page_size or 64   # decode tiles are 64 (16-bit) / 32 (float32) keys, 16 / 8 per warp
    length = st.one_of(st.sampled_from([0, 1, 15, 16, 17, edge - 1, edge, edge + 1, 2 * edge + 3]),
                       st.integers(0, 300), st.integers(0, max_len))
    B = draw(st.integers(1, 3))
    lens = [draw(length) for _ in range(B)]
    hk = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    Sq = draw(st.sampled_from([1, 1, 2, 3, 5, 8]))
    D = draw(st.sampled_from([64, 128, 128, 32, 72, 256] if dtype != "float32" else [64, 128, 36, 256]))
    append = draw(st.booleans())
    if not append:
        lens = [max(n, 1) for n in lens] if draw(st.booleans()) else lens
    opts = {}
    if options:
        if not draw(st.booleans()):
            opts["causal"] = False
        if draw(st.integers(0, 4)) == 0:
            opts["window"] = (draw(st.sampled_from([-1, 0, 5, 100])), draw(st.sampled_from([-1, 0, 3])))
        if draw(st.integers(0, 4)) == 0:
            opts["softcap"] = draw(st.sampled_from([5.0, 30.0]))
        if draw(st.integers(0, 4)) == 0:
            opts["scale"] = draw(st.sampled_from([0.05, 0.5]))
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        if draw(st.integers(0, 4)) == 0:
            shape = draw(st.sampled_from([(hk * group,), (B, hk * group)]))
            opts["alibi_slopes"] = rng.uniform(0.0, 0.5, shape).astype(np.float32)
        if draw(st.integers(0, 3)) == 0:
            kind = draw(st.sampled_from(["tree", "keys", "rows", "full"]))
            if kind == "tree":      # over the new tokens: (Sq, Sq), lower triangle with holes
                m = np.tril(rng.random((Sq, Sq)) < 0.7) | np.eye(Sq, dtype=bool)
            elif kind == "keys":    # (B, 1, 1, M), the last M keys of each sequence
                m = rng.random((B, 1, 1, draw(st.sampled_from([2, 7, 40])))) < 0.6
            elif kind == "rows":    # (B, Hq, Sq, 1): whole rows on or off
                m = rng.random((B, hk * group, Sq, 1)) < 0.7
            else:                   # (B, Hq, Sq, M) with M past some sequences' lengths
                m = rng.random((B, hk * group, Sq, draw(st.sampled_from([3, 33])))) < 0.5
            opts["mask"] = m
    return dict(dtype=dtype, B=B, Hq=hk * group, Hk=hk, D=D, Sq=Sq, lens=lens, page_size=page_size,
                append=append, options=opts, num_splits=draw(st.sampled_from([0, 1, 2, 7])),
                host_indices=draw(st.booleans()), seed=draw(st.integers(0, 2**32 - 1)))


def _solve(p):
    case = build_case(dtype=p["dtype"], B=p["B"], Hq=p["Hq"], Hk=p["Hk"], D=p["D"], Sq=p["Sq"], lens=p["lens"],
                      page_size=p["page_size"], append=p["append"], seed=p["seed"])
    return run_case(case, dtype=p["dtype"], options=p["options"], num_splits=p["num_splits"],
                    host_indices=p["host_indices"])


@gpu
@_capped(30)
@given(problem=decode_problems(options=False))
def test_shapes_pages_lengths_splits(xp_gpu, problem):
    _solve(problem)


@gpu
@_capped(30)
@given(problem=decode_problems())
def test_with_options(xp_gpu, problem):
    _solve(problem)


# ----------------------------------------------------------------------------- specific cases

@gpu
@pytest.mark.parametrize("dtype, page_size", [("bfloat16", None), ("bfloat16", 16), ("float16", 256),
                                              ("float32", 16)])
def test_long_cache_100k(xp_gpu, dtype, page_size):
    """One 100k-key sequence beside a short one: many splits, ragged lengths (the host reference
    dominates the cost, so it is computed once for both split counts)."""
    case = build_case(dtype=dtype, B=2, Hq=2, Hk=1, D=64, Sq=1, lens=[100_000, 37], page_size=page_size,
                      append=True, seed=7)
    expected = expected_for(case, dtype=dtype)
    for splits in (0, 1):
        run_case(case, dtype=dtype, num_splits=splits, host_indices=True, expected=expected)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("num_splits", [0, 1, 2, 7])
def test_empty_sequences(xp_gpu, dtype, page_size, num_splits):
    """cache_seqlens 0 with nothing appended: out 0, lse -inf (and no NaN)."""
    case = build_case(dtype=dtype, B=3, Hq=8, Hk=2, D=64, Sq=2, lens=[0, 70, 0], page_size=page_size,
                      append=False, seed=8)
    (out, lse), _ = run_case(case, dtype=dtype, num_splits=num_splits)
    out_h, lse_h = out.get().astype(np.float64), lse.get()
    assert np.isneginf(lse_h[[0, 2]]).all() and (out_h[[0, 2]] == 0).all()
    assert np.isfinite(lse_h[1]).all() and not np.isnan(out_h).any()


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_forced_splits_agree(xp_gpu, dtype):
    """num_splits 1, 2, 7 and the heuristic: each passes the rule, and they agree closely."""
    case = build_case(dtype=dtype, B=2, Hq=16, Hk=4, D=128, Sq=3, lens=[1000, 333], page_size=16, append=True,
                      seed=9)
    results, expected = [], expected_for(case, dtype=dtype)
    for splits in (1, 2, 7, 0):
        (out, lse), _ = run_case(case, dtype=dtype, num_splits=splits, expected=expected)
        results.append((out.get().astype(np.float64), lse.get()))
    eps = {"float16": 2**-9, "bfloat16": 2**-6, "float32": 1e-5}[dtype]
    for out, lse in results[1:]:
        np.testing.assert_allclose(lse, results[0][1], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out, results[0][0], rtol=0, atol=eps)


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("page_size", [None, 64])
def test_tree_mask(xp_gpu, dtype, page_size):
    """Speculative decoding: 6 draft tokens in a tree, each sees the cache and its ancestors."""
    parent = [-1, 0, 0, 1, 1, 2]
    tree = np.zeros((6, 6), dtype=bool)
    for i in range(6):
        j = i
        while j >= 0:
            tree[i, j] = True
            j = parent[j]
    case = build_case(dtype=dtype, B=2, Hq=8, Hk=2, D=128, Sq=6, lens=[300, 41], page_size=page_size,
                      append=True, seed=10)
    (out, lse), _ = run_case(case, dtype=dtype, options={"mask": tree})
    # With equal lengths the right-aligned (Sq, Sq) mask is the (B, Hq, Sq, T) mask of attention().
    same = build_case(dtype=dtype, B=2, Hq=8, Hk=2, D=128, Sq=6, lens=[50, 50], page_size=page_size,
                      append=True, seed=11)
    total = 56
    full = np.ones((2, 8, 6, total), dtype=bool)
    full[..., total - 6:] = tree
    (out_tree, _), _ = run_case(same, dtype=dtype, options={"mask": tree})
    (out_full, _), _ = run_case(same, dtype=dtype, options={"mask": full, "causal": False})
    np.testing.assert_array_equal(out_tree.get().astype(np.float32), out_full.get().astype(np.float32))


@gpu
def test_generation_loop_appends_token_by_token(xp_gpu):
    """Five decode steps of one token each, paged: the cache ends as the five appends."""
    dtype = "bfloat16"
    case = build_case(dtype=dtype, B=2, Hq=4, Hk=2, D=64, Sq=1, lens=[14, 3], page_size=16, append=True,
                      seed=12, spare_pages=2)
    # Room for 5 tokens: extend every sequence's pages (build_case leaves one -1 column of slack).
    table = case["table"].copy()
    free = sorted(set(range(case["k_cache"].shape[0])) - set(table[table >= 0].tolist()))
    for b in range(2):
        need = -(-(int(case["lens"][b]) + 5) // 16)
        for k in range(need):
            if table[b, k] < 0:
                table[b, k] = free.pop()
    kc, vc = cupy.asarray(case["k_cache"]), cupy.asarray(case["v_cache"])
    k_host, v_host = case["k_cache"].copy(), case["v_cache"].copy()
    lens = case["lens"].astype(np.int64)
    rng = np.random.default_rng(13)
    dt = tt._dtype(dtype)
    for step in range(5):
        q = rng.standard_normal((2, 1, 4, 64), dtype=np.float32).astype(dt)
        kn = rng.standard_normal((2, 1, 2, 64), dtype=np.float32).astype(dt)
        vn = rng.standard_normal((2, 1, 2, 64), dtype=np.float32).astype(dt)
        out = cuflash.decode(cupy.asarray(q), kc, vc, cache_seqlens=lens.astype(np.int32), block_table=table,
                             k_new=cupy.asarray(kn), v_new=cupy.asarray(vn))
        ref_out, _, k_host, v_host = reference.decode(q, k_host, v_host, cache_seqlens=lens, block_table=table,
                                                      k_new=kn, v_new=vn, return_cache=True)
        problems, _, _ = reference._decode._decode_sequences(q, k_host, v_host, cache_seqlens=lens + 1, block_table=table)
        base = np.concatenate([tt.baseline_attention(p["q"], p["k"], p["v"], **p["options"]) for p in problems])
        tt.assert_attention_close(out, ref_out, base, dtype=dtype)
        lens = lens + 1
    assert np.array_equal(_bits(kc.get()), _bits(k_host)) and np.array_equal(_bits(vc.get()), _bits(v_host))


@gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_misaligned_cache_is_copied_and_written_back(xp_gpu, dtype):
    """D = 36 (not 16-byte rows for fp16) and a cache view with an odd row stride: the slow path. Its
    write-back of the appended rows needs the lengths on the host (they are never read back from
    the GPU): given there they work, given on the GPU they are refused before anything is written."""
    case = build_case(dtype=dtype, B=2, Hq=4, Hk=2, D=36, Sq=2, lens=[20, 5], page_size=None, append=True,
                      seed=14)
    if dtype != "float32":   # float32 rows of 36 elements are whole 16-byte chunks: no copy
        with pytest.raises(ValueError, match="cache_seqlens .*on the host"):
            run_case(case, dtype=dtype)
    run_case(case, dtype=dtype, host_indices=True)
    # A contiguous-last-axis view whose other strides are not multiples of 16 bytes.
    case = build_case(dtype=dtype, B=2, Hq=4, Hk=1, D=64, Sq=1, lens=[9, 30], page_size=None, append=True,
                      seed=15)
    wide_k = cupy.asarray(np.concatenate([case["k_cache"], case["k_cache"][..., :1]], axis=-1))
    wide_v = cupy.asarray(np.concatenate([case["v_cache"], case["v_cache"][..., :1]], axis=-1))
    kc, vc = wide_k[..., :64], wide_v[..., :64]     # row stride 65 elements
    run_case(case, dtype=dtype, device_cache=(kc, vc), host_indices=True)
    assert np.array_equal(_bits(wide_k[..., 64:].get()), _bits(case["k_cache"][..., :1]))
    assert np.array_equal(_bits(wide_v[..., 64:].get()), _bits(case["v_cache"][..., :1]))


@gpu
def test_gqa_rows_past_one_block(xp_gpu):
    """Sq * Hq / Hk = 8 * 8 = 64 packed rows: four 16-row blocks (eight 8-row blocks in float32)."""
    for dtype in DTYPES:
        case = build_case(dtype=dtype, B=1, Hq=16, Hk=2, D=128, Sq=8, lens=[500], page_size=None, append=True,
                          seed=16)
        run_case(case, dtype=dtype, options={"alibi_slopes": np.linspace(0.01, 0.2, 16).astype(np.float32)})


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [None, 16, 64, 3])
def test_chunked_prefill_appends_and_attends_a_long_chunk(xp_gpu, dtype, page_size):
    """A chunk of hundreds of new tokens (chunked prefill, prefix caching) into a cache that already
    holds a prefix, one sequence with none: token i sees the prefix and new tokens j <= i (decode's
    bottom-right rule), and the whole chunk is appended; under the default split heuristic."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    case = build_case(dtype=dtype, B=3, Hq=8, Hk=2, D=128, Sq=int(np.random.default_rng(seed).integers(200, 400)),
                      lens=[700, 0, 129], page_size=page_size, append=True, seed=seed)
    try:
        run_case(case, dtype=dtype, options={"window": (300, 0)} if seed % 2 else None)
    except AssertionError as failure:
        raise AssertionError(f"seed {seed}: {failure}") from None


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [None, 16, 3])
def test_ragged_chunks_through_attention_varlen_over_a_cache(xp_gpu, dtype, page_size):
    """attention_varlen(q, k_cache, v_cache, cu_seqlens_q, None, cache_seqlens=, block_table=): each
    sequence's chunk of new tokens (0 to ~200, already in its cache) attends to its cached keys,
    bottom-right causal, as the reference's decode of that sequence alone with that chunk as q."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    n = rng.integers(0, 200, 3)
    n[rng.integers(3)] = 0
    lens = n + rng.integers(0, 300, 3)
    case = build_case(dtype=dtype, B=3, Hq=8, Hk=2, D=128, Sq=1, lens=lens.tolist(), page_size=page_size,
                      append=False, seed=seed)
    cu = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), 8, 128), dtype=np.float32).astype(tt._dtype(dtype))
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    got, lse = cuflash.attention_varlen(cupy.asarray(q), cupy.asarray(case["k_cache"]), cupy.asarray(case["v_cache"]),
                                        cupy.asarray(cu), None, max_seqlen_q=int(n.max()),
                                        cache_seqlens=cupy.asarray(case["lens"]),
                                        block_table=None if case["table"] is None else cupy.asarray(case["table"]),
                                        causal=True, return_lse=True, out=out)
    assert got.data.ptr == out.data.ptr and lse.shape == (8, int(cu[-1]))
    for b in range(3):
        if n[b] == 0:
            continue
        cache = {k: (case[k] if case["table"] is not None else case[k][b:b + 1]) for k in ("k_cache", "v_cache")}
        want, want_lse = reference.decode(q[cu[b]:cu[b + 1]][None], cache["k_cache"], cache["v_cache"],
                                          cache_seqlens=case["lens"][b:b + 1],
                                          block_table=None if case["table"] is None else case["table"][b:b + 1])
        base = None
        if dtype != "float32":
            problems, _, _ = reference._decode._decode_sequences(
                q[cu[b]:cu[b + 1]][None], cache["k_cache"], cache["v_cache"], cache_seqlens=case["lens"][b:b + 1],
                block_table=None if case["table"] is None else case["table"][b:b + 1])
            base = tt.baseline_attention(problems[0]["q"], problems[0]["k"], problems[0]["v"], **problems[0]["options"])
        tt.assert_attention_close(got[cu[b]:cu[b + 1]][None], want, base, dtype=dtype, name=f"out[{b}] (seed {seed})")
        tt.assert_attention_close(lse[:, cu[b]:cu[b + 1]][None], want_lse, dtype="float32", name=f"lse[{b}]")


@gpu
@pytest.mark.parametrize("page_size, num_splits", [(None, 1), (16, 0), (None, 3)])
def test_lse_buffer_is_written_in_place(xp_gpu, page_size, num_splits):
    """``lse=``: the caller's buffer (NaN-poisoned) receives the log-sum-exp, with or without
    ``return_lse`` and whichever path (unsplit, split-KV) writes it; a repeat call with a new
    buffer writes that one."""
    case = build_case(dtype="bfloat16", B=3, Hq=8, Hk=2, D=64, Sq=2, lens=[70, 0, 301], page_size=page_size,
                      append=False, seed=int(np.random.default_rng().integers(1 << 30)))
    expected = expected_for(case, dtype="bfloat16")
    q, kc, vc = (cupy.asarray(case[n]) for n in ("q", "k_cache", "v_cache"))
    table = None if case["table"] is None else cupy.asarray(case["table"])
    for return_lse in (True, False, False):
        lse = cupy.full((3, 8, 2), NAN, dtype=cupy.float32)
        result = cuflash.decode(q, kc, vc, cache_seqlens=cupy.asarray(case["lens"]), block_table=table,
                                num_splits=num_splits, return_lse=return_lse, lse=lse)
        if return_lse:
            assert result[1] is lse
        tt.assert_attention_close(lse, expected["lse"], dtype="float32", name="lse")


@gpu
@pytest.mark.parametrize("bad, exc, pattern", [
    (lambda q, out: cupy.zeros((2, 4, 2), dtype=cupy.float16), TypeError, "lse must have dtype float32"),
    (lambda q, out: cupy.zeros((2, 2, 4), dtype=cupy.float32), ValueError, "lse must have shape"),
    (lambda q, out: cupy.zeros((2, 4, 4), dtype=cupy.float32)[..., ::2], ValueError, "lse must be C-contiguous"),
    (lambda q, out: out.view(cupy.float32).reshape(-1)[:16].reshape(2, 4, 2), ValueError, "lse"),
])
def test_bad_lse_buffer_is_refused_before_any_write(xp_gpu, bad, exc, pattern):
    case = _error_case()
    kc, vc = cupy.asarray(case["k_cache"]), cupy.asarray(case["v_cache"])
    q = cupy.asarray(case["q"])
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    with pytest.raises(exc, match=pattern):
        cuflash.decode(q, kc, vc, cache_seqlens=case["lens"], block_table=case["table"], k_new=cupy.asarray(
            case["k_new"]), v_new=cupy.asarray(case["v_new"]), out=out, lse=bad(q, out))
    assert np.array_equal(_bits(kc.get()), _bits(case["k_cache"]))
    assert bool(cupy.isnan(out.astype(cupy.float32)).all()), "out was written before the error"


def test_zero_batch(xp_gpu):
    q = cupy.zeros((0, 1, 4, 64), dtype=cupy.float16)
    kc = cupy.zeros((0, 10, 2, 64), dtype=cupy.float16)
    out, lse = cuflash.decode(q, kc, kc, return_lse=True)
    assert out.shape == (0, 1, 4, 64) and lse.shape == (0, 4, 1)


# ----------------------------------------------------------------------------- errors

def _error_case():
    return build_case(dtype="bfloat16", B=2, Hq=4, Hk=2, D=64, Sq=2, lens=[20, 3], page_size=16, append=True,
                      seed=17)


def _bad_calls(case):
    """(name, exception, message pattern, kwargs changes) of calls that must fail before any write."""
    table = case["table"]
    bad_page = table.copy()
    bad_page[1, 0] = 10_000
    shared_slot = table.copy()
    shared_slot[1, 0] = table[0, 1]      # with lens [20, 0]: seq 1 appends at slots 0, 1 of a page seq 0 reads
    same_target = table.copy()
    same_target[0, 1] = table[1, 0]      # both sequences append into one page, seq 0 at slot 4
    lens_same = np.array([19, 3], dtype=np.int32)   # seq 0 appends at slots 3, 4 of page 1; seq 1 too
    return [
        ("too_long", ValueError, "do not fit", dict(cache_seqlens=np.array([47, 3], np.int32))),
        ("negative_len", ValueError, "cache_seqlens\\[0\\]", dict(cache_seqlens=np.array([-1, 3], np.int32))),
        ("len_dtype", TypeError, "int32", dict(cache_seqlens=np.array([20, 3], np.int64))),
        ("len_shape", ValueError, "cache_seqlens must have shape", dict(cache_seqlens=np.array([20], np.int32))),
        ("bad_page", ValueError, "block_table\\[1, 0\\]", dict(block_table=bad_page)),
        ("read_slot", ValueError, "overwrite",
         dict(block_table=shared_slot, cache_seqlens=np.array([20, 0], np.int32))),
        ("same_target", ValueError, "same cache slot", dict(block_table=same_target, cache_seqlens=lens_same)),
        ("k_new_only", ValueError, "together", dict(v_new=None)),
        ("k_new_shape", ValueError, "k_new must have shape", dict(k_new=case["k_new"][:, :, :1])),
        ("k_new_dtype", TypeError, "k_new", dict(k_new=case["k_new"].astype(np.float32))),
        ("mask_dtype", TypeError, "mask must be a bool", dict(mask=np.ones((2, 2), np.float32))),
        ("mask_shape", ValueError, "mask", dict(mask=np.ones((3, 2), bool))),
        ("splits", ValueError, "num_splits", dict(num_splits=-1)),
        ("splits_max", ValueError, "num_splits", dict(num_splits=129)),
        ("splits_type", TypeError, "num_splits", dict(num_splits=2.0)),
        ("window", ValueError, "window", dict(window=(3,))),
        ("alibi", ValueError, "alibi_slopes", dict(alibi_slopes=np.ones(3, np.float32))),
        ("out_shape", ValueError, "out must have shape", dict(out="wrong_shape")),
        ("heads", ValueError, "heads", dict(q=np.zeros((2, 2, 3, 64), case["q"].dtype))),
    ]


@pytest.mark.parametrize("name, exc, pattern, change", _bad_calls(_error_case()),
                         ids=[c[0] for c in _bad_calls(_error_case())])
@gpu
def test_errors_leave_the_cache_untouched(xp_gpu, name, exc, pattern, change):
    case = _error_case()
    args = dict(q=case["q"], k_new=case["k_new"], v_new=case["v_new"], cache_seqlens=case["lens"],
                block_table=case["table"])
    args.update(change)
    kc, vc = cupy.asarray(case["k_cache"]), cupy.asarray(case["v_cache"])
    out = cupy.full((2, 2, 4, 64), NAN, dtype=case["q"].dtype)
    if args.get("out") == "wrong_shape":
        out = cupy.zeros((2, 2, 4, 32), dtype=case["q"].dtype)
    args.pop("out", None)

    def device(x):
        return cupy.asarray(x) if isinstance(x, np.ndarray) and x.dtype != np.int32 else x

    kwargs = {k: device(v) for k, v in args.items() if k != "q"}
    with pytest.raises(exc, match=pattern):
        cuflash.decode(cupy.asarray(args["q"]), kc, vc, out=out, **kwargs)
    cupy.cuda.get_current_stream().synchronize()
    assert np.array_equal(_bits(kc.get()), _bits(case["k_cache"]))
    assert np.array_equal(_bits(vc.get()), _bits(case["v_cache"]))
    if name != "out_shape":
        assert bool(cupy.isnan(out.astype(cupy.float32)).all()), "out was written before the error"


# ----------------------------------------------------------------------------- CPU: reference and host checks

@pytest.mark.parametrize("page_size", [None, 1, 16])
def test_reference_decode_is_attention_over_gathered_keys(page_size):
    """reference.decode == attention_forward on (cached keys ++ appended keys), causal bottom-right,
    whatever the cache layout."""
    case = build_case(dtype="float32", B=3, Hq=4, Hk=2, D=16, Sq=3, lens=[0, 5, 40], page_size=page_size,
                      append=True, seed=20)
    out, lse, k_after, _ = reference.decode(case["q"], case["k_cache"], case["v_cache"],
                                            cache_seqlens=case["lens"], block_table=case["table"],
                                            k_new=case["k_new"], v_new=case["v_new"], return_cache=True)
    for b in range(3):
        n = int(case["lens"][b])
        if page_size is None:
            k_old, v_old = case["k_cache"][b, :n], case["v_cache"][b, :n]
        else:
            pos = np.arange(n)
            rows = (case["table"][b, pos // page_size], pos % page_size)
            k_old, v_old = case["k_cache"][rows], case["v_cache"][rows]
        k = np.concatenate([k_old, case["k_new"][b]])[None]
        v = np.concatenate([v_old, case["v_new"][b]])[None]
        want_out, want_lse = reference.attention_forward(case["q"][b:b + 1], k, v, causal=True)
        np.testing.assert_allclose(out[b], want_out[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[b], want_lse[0], rtol=1e-12, atol=1e-12)
    assert not np.isnan(out).any()
    # The appended rows are where the cache says, and untouched slots are still NaN.
    if page_size is None:
        np.testing.assert_array_equal(k_after[2, 40:43], case["k_new"][2])
        assert np.isnan(k_after[2, 43:]).all()


def test_reference_decode_mask_alignment():
    """A mask's M columns cover the last M keys; M = 1 covers every key."""
    case = build_case(dtype="float32", B=2, Hq=2, Hk=1, D=8, Sq=3, lens=[10, 4], page_size=None, append=True,
                      seed=21)
    args = dict(cache_seqlens=case["lens"], k_new=case["k_new"], v_new=case["v_new"])
    tree = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=bool)
    out, _ = reference.decode(case["q"], case["k_cache"], case["v_cache"], mask=tree, **args)
    problems, _, _ = reference._decode._decode_sequences(case["q"], case["k_cache"], case["v_cache"], mask=tree, **args)
    for b, n in enumerate((13, 7)):
        m = problems[b]["options"]["mask"]
        assert m.shape == (1, 2, 3, n)
        assert m[..., :n - 3].all() and (m[0, 0, :, n - 3:] == tree).all()
    row_mask = np.array([True, False, True]).reshape(1, 1, 3, 1)
    out_rows, lse_rows = reference.decode(case["q"], case["k_cache"], case["v_cache"], mask=row_mask, **args)
    assert np.isneginf(lse_rows[:, :, 1]).all() and (out_rows[:, 1] == 0).all()
    np.testing.assert_allclose(out_rows[:, [0, 2]], reference.decode(case["q"], case["k_cache"], case["v_cache"],
                                                                     **args)[0][:, [0, 2]])


def _table(rows):
    return np.array(rows, dtype=np.int64)


def test_check_pages_accepts_ordinary_tables():
    from cuflash.decode import _check_pages

    # Partly filled last pages receive the appends; -1 past the used pages is never looked at.
    _check_pages(_table([[0, 1, -1], [2, -1, -1]]), np.array([20, 3]), 2, 16, 3)
    # A shared prefix page read by both sequences, appends into private pages.
    _check_pages(_table([[0, 1, -1], [0, 2, -1]]), np.array([20, 16]), 1, 16, 3)
    # Page size 1: every token its own page, in any order.
    _check_pages(_table([[4, 2, 0, -1], [1, 3, -1, -1]]), np.array([2, 1]), 1, 1, 5)


@gpu
@pytest.mark.parametrize("heads, seqlen_q, expected", [((8, 8), 1, True), ((32, 8), 2, True), ((64, 8), 1, True),
                                                       ((32, 8), 3, False), ((16, 1), 1, False)])
def test_calls_of_few_rows_take_keys_as_m(monkeypatch, heads, seqlen_q, expected):
    """cuflash.decode plans the keys-as-M variant exactly when Sq * Hq / Hk <= 8 (and the call
    matches the reference, run_case's checks)."""
    from cuflash._runtime import memo
    from cuflash.kernels import decode as kdecode

    asked = []
    plan = kdecode.decode_plan

    def recording(*args, **kwargs):
        asked.append(kwargs.get("keys_as_m", False))
        return plan(*args, **kwargs)

    monkeypatch.setattr(kdecode, "decode_plan", recording)
    memo.clear_memo()
    hq, hk = heads
    case = build_case(dtype="bfloat16", B=2, Hq=hq, Hk=hk, D=64, Sq=seqlen_q, lens=[300, 171], page_size=16,
                      append=True, seed=int(np.random.default_rng().integers(1 << 30)))
    run_case(case, dtype="bfloat16")
    assert asked == [expected]


def _record_short_tiles(monkeypatch):
    """A list that receives (short, warps) for each decode_plan call the planner makes from now on."""
    from cuflash.kernels import decode as kdecode

    asked, plan = [], kdecode.decode_plan

    def recording(*args, **kwargs):
        result = plan(*args, **kwargs)
        asked.append((kwargs.get("short", False), dict(result.variant.defines)["CUFLASH_WARPS"]))
        return result

    monkeypatch.setattr(kdecode, "decode_plan", recording)
    return asked


@gpu
@pytest.mark.parametrize("head_dim, warps", [(64, {None: (4, 4), 16: (4, 8)}), (128, {None: (4, 8), 16: (4, 8)}),
                                              (256, {None: (2, 4), 16: (2, 4)})])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("append", [False, True])
def test_short_sequences_take_the_short_tiles(monkeypatch, head_dim, warps, page_size, append):
    """Many short sequences (at most DECODE_SHORT_KEYS keys, a wave of three CTAs an SM) take the
    short-sequence tiles (two stages; four warps at D = 128 and on pages at D = 64, two at D = 256),
    and the same case with the rule off the default ones: both match the reference (run_case's checks)."""
    from cuflash._runtime import memo
    from cuflash.kernels import decode as kdecode

    asked = _record_short_tiles(monkeypatch)
    rng = np.random.default_rng()
    case = build_case(dtype="bfloat16", B=64, Hq=32, Hk=8, D=head_dim, Sq=1, lens=rng.integers(1, 1000, size=64),
                      page_size=page_size, append=append, seed=int(rng.integers(1 << 30)))
    expected = expected_for(case, dtype="bfloat16")
    memo.clear_memo()
    run_case(case, dtype="bfloat16", expected=expected)
    monkeypatch.setattr(kdecode, "DECODE_SHORT_KEYS", 0)
    memo.clear_memo()
    run_case(case, dtype="bfloat16", expected=expected)
    memo.clear_memo()
    assert asked == [(True, warps[page_size][0]), (False, warps[page_size][1])]


@gpu
@pytest.mark.parametrize("page_size", [None, 16])
def test_two_waves_of_long_sequences_take_one_of_short_tiles(monkeypatch, page_size):
    """Sequences longer than DECODE_SHORT_KEYS whose CTAs would take two waves of the usual tiles (one an
    SM) take the short-sequence tiles, one wave of them; both tiles match the reference."""
    import cupy
    from cuflash._runtime import memo
    from cuflash.kernels import decode as kdecode

    asked = _record_short_tiles(monkeypatch)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    batch = sms // 8 + 1   # batch x 8 kv heads: just over one CTA an SM
    rng = np.random.default_rng()
    case = build_case(dtype="bfloat16", B=batch, Hq=32, Hk=8, D=128, Sq=1,
                      lens=rng.integers(kdecode.DECODE_SHORT_KEYS + 1, 2000, size=batch), page_size=page_size,
                      append=False, seed=int(rng.integers(1 << 30)))
    expected = expected_for(case, dtype="bfloat16")
    memo.clear_memo()
    run_case(case, dtype="bfloat16", expected=expected)
    monkeypatch.setattr(kdecode, "DECODE_SHORT_MIN_CTAS_PER_SM", 1)   # the rule off: no CTA count fits
    memo.clear_memo()
    run_case(case, dtype="bfloat16", expected=expected)
    memo.clear_memo()
    assert asked == [(True, 4), (False, 8)]


@pytest.mark.parametrize("table, lens, s_new, page_size, num_pages, pattern", [
    ([[0, 5]], [20], 1, 16, 5, r"block_table\[0, 1\] = 5"),
    ([[0, -1]], [16], 1, 16, 5, r"block_table\[0, 1\] = -1"),
    ([[0, 1], [1, 2]], [17, 0], 1, 16, 3, "same cache slot|overwrite"),
    ([[0, 1], [1, 2]], [20, 0], 2, 16, 3, "overwrite"),
    ([[0, 0]], [3], 14, 16, 1, "overwrite"),       # a sequence's own pages repeat: appends hit read slots
    ([[0, 1], [0, 2]], [3, 3], 1, 16, 3, "same cache slot"),
])
def test_check_pages_rejects(table, lens, s_new, page_size, num_pages, pattern):
    from cuflash.decode import _check_pages

    with pytest.raises(ValueError, match=pattern):
        _check_pages(_table(table), np.array(lens), s_new, page_size, num_pages)
