"""MLA decode (issue 53 item 3): ``cuflash.decode(q, kv_cache, None, v_head_dim=512, k_new=...)``, one
latent cache whose rows (576 columns: 512 values, 64 rope) are the keys and whose first 512 columns are
the values, against the float64 reference (cuflash.reference.decode with the same arguments).

Cases, on each kernel family forced (the decode kernel; mla_sm90, Hopper's wgmma kernel, on pages of
multiples of 64): contiguous and paged caches (pages of 64, the MLA engines' size, 128, 16 and 3), one
kv head and 16 to 128 query heads of 1 to 3 new tokens (mla_sm90: 16 rows a CTA with the keys as M, or
64), new tokens appended (their latent rows, k_new alone), lengths with 0 among them, one split, three
and the heuristic, with sinks and a ScoreMod sometimes (decode kernel); fresh data every run (the seed in the failure
message), NaN-poisoned ``out=`` / ``lse=`` buffers and cache slots past each sequence. Arguments that
do not agree with MLA are refused before any launch, the cache untouched.

Run: ``python -m pytest -q tests/gpu/test_decode_mla.py`` (skipped without a GPU).
"""

import numpy as np
import pytest

from tests.gpu._hardware import gpu_available as _gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy")]

if _gpu_available():
    import cupy

import cuflash  # noqa: E402
import cuflash.testing as tt  # noqa: E402
from cuflash import reference  # noqa: E402

NAN = float("nan")
D_LATENT, D_V = 576, 512
TOL = {"float16": 4e-3, "bfloat16": 2e-2}


def _case(rng, *, dtype, page_size, heads_q, seqlen_q, append, B=3, capacity=300, lens=None):
    """Host arrays: q, the latent cache (NaN past each sequence), lengths (``lens``, or random with a 0),
    a page table."""
    dt = tt._dtype(dtype)
    s_new = seqlen_q if append else 0
    if lens is None:
        lens = rng.integers(0, capacity - s_new + 1, B)
        lens[rng.integers(B)] = 0
    lens = np.asarray(lens)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dt)

    if page_size is None:
        cache, table = np.full((B, capacity, 1, D_LATENT), NAN, dtype=dt), None
        for b in range(B):
            cache[b, :lens[b]] = normal(int(lens[b]), 1, D_LATENT)
    else:
        max_pages = -(-capacity // page_size)
        pages = B * max_pages + 2
        table = rng.permutation(pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
        cache = np.full((pages, page_size, 1, D_LATENT), NAN, dtype=dt)
        for b in range(B):
            pos = np.arange(lens[b])
            cache[table[b, pos // page_size], pos % page_size] = normal(int(lens[b]), 1, D_LATENT)
    k_new = normal(B, s_new, 1, D_LATENT) if append else None
    return dict(q=normal(B, seqlen_q, heads_q, D_LATENT), cache=cache, lens=lens.astype(np.int32), table=table,
                k_new=k_new)


def _options(rng, heads_q, with_extras):
    if not with_extras:
        return {}
    sinks = rng.standard_normal(heads_q).astype(np.float32)
    return dict(sinks=sinks, score_mod=cuflash.ScoreMod("score - 0.01 * abs(q_idx - kv_idx)"))


def _run(case, *, num_splits, options):
    cache = cupy.asarray(case["cache"])
    q = cupy.asarray(case["q"])
    B, Sq, Hq, _ = q.shape
    out = cupy.full((B, Sq, Hq, D_V), NAN, dtype=q.dtype)
    lse = cupy.full((B, Hq, Sq), NAN, dtype=cupy.float32)
    device_options = {k: (cupy.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in options.items()}
    got, got_lse = cuflash.decode(q, cache, None, v_head_dim=D_V, cache_seqlens=cupy.asarray(case["lens"]),
                                  block_table=None if case["table"] is None else cupy.asarray(case["table"]),
                                  k_new=None if case["k_new"] is None else cupy.asarray(case["k_new"]),
                                  num_splits=num_splits, out=out, lse=lse, return_lse=True, **device_options)
    assert got.data.ptr == out.data.ptr and got_lse.data.ptr == lse.data.ptr
    return out.get(), lse.get(), cache.get()


def _family(family):
    """The kernel family forced for MLA decode (cuflash._mla_plan); mla_sm90 needs a Hopper GPU."""
    from cuflash import _mla_plan
    from cuflash._build.compile import device_arch

    if family == "mla_sm90" and device_arch() != "sm_90a":
        pytest.skip("mla_sm90 runs on sm_90a")
    return _mla_plan.force_kernel(family)


@pytest.mark.parametrize("family", ["decode", "mla_sm90"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [None, 64, 128, 16, 3])
@pytest.mark.parametrize("heads_q, seqlen_q", [(16, 1), (128, 1), (16, 2), (40, 3)])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_mla_decode_matches_the_reference(family, dtype, page_size, heads_q, seqlen_q, num_splits):
    if family == "mla_sm90" and page_size is not None and page_size % 64:
        pytest.skip("mla_sm90 reads pages of whole 64-key tiles")
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    case = _case(rng, dtype=dtype, page_size=page_size, heads_q=heads_q, seqlen_q=seqlen_q, append=bool(seed % 2))
    # (sinks and a ScoreMod run on the decode kernel only)
    options = _options(rng, heads_q, with_extras=family == "decode" and seed % 3 == 0)
    with _family(family):
        out, lse, cache_after = _run(case, num_splits=num_splits, options=options)
    want, want_lse, cache_want, _ = reference.decode(
        case["q"], case["cache"], None, v_head_dim=D_V, cache_seqlens=case["lens"], block_table=case["table"],
        k_new=case["k_new"], return_cache=True, **options)
    msg = f"seed {seed}"
    np.testing.assert_array_equal(cache_after.view(np.uint16), np.asarray(cache_want).view(np.uint16), err_msg=msg)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=0, atol=TOL[dtype] * scale, err_msg=msg)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-3 * max(1.0, float(np.abs(want_lse[np.isfinite(
        want_lse)]).max(initial=1.0))), err_msg=msg)


BAD_INDICES = {"len_past_capacity": r"cache_seqlens\[0\]", "len_negative": r"cache_seqlens\[0\]",
               "page_negative": r"block_table\[1, 0\]", "page_past_pool": r"block_table\[0, 1\]"}


@pytest.mark.parametrize("mode", ["check", "check_errors"])
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("heads_q", [16, 128])
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("bad", list(BAD_INDICES))
def test_mla_sm90_with_bad_indices_writes_nothing(bad, page_size, num_splits, heads_q, append, mode):
    """Lengths or pages on the GPU that do not fit: the index check runs ahead of mla_sm90, which starts
    beside it (its programmatic dependent, without an append) and reads the lengths before the verdict.
    It must read within the cache and write nothing: out, lse and the cache keep their bits, and the
    fault names the entry (raised by the call with ``check=True``, where the check runs alone first, or
    by ``cuflash.check_errors()`` after a call that returned); the same call with good indices then
    matches the reference."""
    if page_size is None and bad.startswith("page"):
        pytest.skip("a contiguous cache has no pages")
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    case = _case(rng, dtype="bfloat16", page_size=page_size, heads_q=heads_q, seqlen_q=1, append=append, B=2,
                 capacity=256, lens=[200, 70])
    lens, table = case["lens"].copy(), None if case["table"] is None else case["table"].copy()
    if bad == "len_past_capacity":
        lens[0] = 256 + 1
    elif bad == "len_negative":
        lens[0] = -2
    elif bad == "page_negative":
        table[1, 0] = -5
    else:
        table[0, 1] = case["cache"].shape[0]
    q, cache = cupy.asarray(case["q"]), cupy.asarray(case["cache"])
    out = cupy.full((2, 1, heads_q, D_V), NAN, dtype=q.dtype)
    lse = cupy.full((2, heads_q, 1), NAN, dtype=cupy.float32)
    before = [x.view(cupy.uint16 if x.itemsize == 2 else cupy.uint32).copy() for x in (cache, out, lse)]
    def call():
        return cuflash.decode(q, cache, None, v_head_dim=D_V, cache_seqlens=cupy.asarray(lens),
                              block_table=None if table is None else cupy.asarray(table),
                              k_new=None if case["k_new"] is None else cupy.asarray(case["k_new"]),
                              num_splits=num_splits, out=out, lse=lse, return_lse=True, check=mode == "check")

    with _family("mla_sm90"), pytest.raises(ValueError, match=BAD_INDICES[bad]):
        call()
        cuflash.check_errors()
    cupy.cuda.Device().synchronize()
    for x, was, name in zip((cache, out, lse), before, ("the cache", "out", "lse")):
        assert bool(cupy.array_equal(x.view(was.dtype), was)), f"{name} was written (seed {seed})"
    with _family("mla_sm90"):
        got, got_lse, _ = _run(case, num_splits=num_splits, options={})
    want, want_lse = reference.decode(case["q"], case["cache"], None, v_head_dim=D_V, cache_seqlens=case["lens"],
                                      block_table=case["table"], k_new=case["k_new"])[:2]
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0, atol=TOL["bfloat16"] * scale,
                               err_msg=f"seed {seed}")


def _long_sequence(page_size):
    """One sequence of ~16k latent rows, 16 heads, one new token: (seed, host case, q and cache on the GPU,
    the decode keywords)."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    case = _case(rng, dtype="bfloat16", page_size=page_size, heads_q=16, seqlen_q=1, append=False, B=1,
                 capacity=16384, lens=[16384 - int(rng.integers(0, 64))])
    kw = dict(v_head_dim=D_V, cache_seqlens=cupy.asarray(case["lens"]),
              block_table=None if case["table"] is None else cupy.asarray(case["table"]))
    return seed, case, cupy.asarray(case["q"]), cupy.asarray(case["cache"]), kw


def _assert_long_sequence_matches(case, out, lse, msg):
    """out and lse of a _long_sequence case against the float64 reference (bf16's tolerance for out)."""
    want, want_lse = reference.decode(case["q"], case["cache"], None, v_head_dim=D_V, cache_seqlens=case["lens"],
                                      block_table=case["table"])
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=0,
                               atol=TOL["bfloat16"] * max(1.0, float(np.abs(want).max())), err_msg=msg)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-3 * max(1.0, float(np.abs(want_lse).max())), err_msg=msg)


@pytest.mark.parametrize("page_size", [None, 64])
def test_one_long_sequence_takes_the_mla_split_count(page_size):
    # One sequence of 16k latent rows, 16 heads: the split rule alone would cut it 63 ways (a wave of
    # value-half CTAs); MLA stops at DECODE_MLA_MAX_SPLITS (the last split combines every partial). The
    # rows are read by copy_rows_by_eights (cuda_src/decode.cu), pages of 64 a whole tile each.
    from cuflash import kernels
    seed, case, q, cache, kw = _long_sequence(page_size)
    with _family("decode"):
        splits = cuflash.plan(cuflash.decode, q, cache, None, **kw).plan.info["num_splits"]
        # (pages: splits of DECODE_MLA_PAGED_MIN_SPLIT_KEYS or more, 18 here before the cap)
        assert splits == kernels.decode.DECODE_MLA_MAX_SPLITS, splits
        out, lse, _ = _run(case, num_splits=0, options={})
    _assert_long_sequence_matches(case, out, lse, f"seed {seed}, {splits} splits")


@pytest.mark.parametrize("page_size", [None, 64])
def test_one_long_sequence_on_mla_sm90_splits_over_the_sms(page_size):
    """One sequence of 16k latent rows on mla_sm90 (16 heads: 16 rows a CTA, the keys as M): a split a
    CTA, as many as fill the SMs once (mla_num_splits), combined by the last split; against the reference."""
    from cuflash import _mla_plan
    seed, case, q, cache, kw = _long_sequence(page_size)
    with _family("mla_sm90"):
        info = cuflash.plan(cuflash.decode, q, cache, None, **kw).plan.info
        assert info["family"] == "mla_sm90" and info["cta_rows"] == 16   # 16 heads: the keys as M
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        assert info["num_splits"] == _mla_plan.mla_num_splits(1, 1, 16384, sms) > 1, info
        out, lse, _ = _run(case, num_splits=0, options={})
    _assert_long_sequence_matches(case, out, lse, f"seed {seed}")


def test_mla_sm90_refuses_what_it_cannot_run():
    """Forced onto mla_sm90, a call it cannot run (pages of 16, sinks) is a ValueError naming why."""
    from cuflash._build.compile import device_arch
    if device_arch() != "sm_90a":
        pytest.skip("mla_sm90 runs on sm_90a")
    rng = np.random.default_rng()
    case = _case(rng, dtype="bfloat16", page_size=16, heads_q=16, seqlen_q=1, append=False)
    with _family("mla_sm90"), pytest.raises(ValueError, match="pages of 16"):
        _run(case, num_splits=0, options={})
    case = _case(rng, dtype="bfloat16", page_size=None, heads_q=16, seqlen_q=1, append=False)
    with _family("mla_sm90"), pytest.raises(ValueError, match="sinks"):
        _run(case, num_splits=0, options=dict(sinks=np.zeros(16, np.float32)))


@pytest.mark.parametrize("bad, exc, pattern", [
    (dict(v_head_dim=None), ValueError, "needs v_head_dim"),
    (dict(v_head_dim=520), ValueError, "v_head_dim"),
    (dict(v_head_dim=512.0), TypeError, "v_head_dim must be an int"),
    (dict(v_new=True), ValueError, "v_new must be None"),
    (dict(q_dim=512), ValueError, "576"),
])
def test_arguments_that_do_not_fit_mla_are_refused_before_any_write(bad, exc, pattern):
    rng = np.random.default_rng()
    case = _case(rng, dtype="bfloat16", page_size=None, heads_q=16, seqlen_q=1, append=True)
    d = bad.get("q_dim", D_LATENT)
    cache = cupy.asarray(case["cache"][..., :d])
    before = cache.get()
    q = cupy.asarray(case["q"][..., :d])
    k_new = cupy.asarray(case["k_new"][..., :d])
    args = dict(v_head_dim=bad.get("v_head_dim", D_V), cache_seqlens=cupy.asarray(case["lens"]), k_new=k_new,
                v_new=k_new if bad.get("v_new") else None)
    with pytest.raises(exc, match=pattern):
        cuflash.decode(q, cache, None, **args)
    np.testing.assert_array_equal(cache.get().view(np.uint16), before.view(np.uint16))


def test_v_head_dim_with_a_v_cache_is_refused():
    x = cupy.zeros((1, 8, 1, 64), dtype=cupy.float16)
    with pytest.raises(ValueError, match="v_head_dim is for MLA"):
        cuflash.decode(x[:, :1], x, x, v_head_dim=32)


def test_torch_mla_decode_equals_cupy():
    """ct.decode and the op with v_cache None give cuflash.decode's bits (the same kernels), the appended
    latent rows included."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    import cuflash.interop.torch as ct

    rng = np.random.default_rng()
    case = _case(rng, dtype="bfloat16", page_size=64, heads_q=128, seqlen_q=1, append=True)
    want_cache = cupy.asarray(case["cache"])
    want = cuflash.decode(cupy.asarray(case["q"]), want_cache, None, v_head_dim=D_V,
                          cache_seqlens=cupy.asarray(case["lens"]), block_table=cupy.asarray(case["table"]),
                          k_new=cupy.asarray(case["k_new"]), num_splits=3)
    def on_torch(name):   # bf16 through its bits (int16), the index arrays as they are
        x = case[name]
        if x.dtype.itemsize == 2:
            return torch.from_numpy(x.view(np.int16).copy()).cuda().view(torch.bfloat16)
        return torch.from_numpy(x.copy()).cuda()

    def bits(t):
        return t.view(torch.int16).cpu().numpy().view(np.uint16)

    for fn in (ct.decode, ct.ops.decode):
        q, cache, lens, table, k_new = (on_torch(n) for n in ("q", "cache", "lens", "table", "k_new"))
        got = fn(q, cache, None, v_head_dim=D_V, cache_seqlens=lens, block_table=table, k_new=k_new, num_splits=3)
        torch.cuda.synchronize()
        assert tuple(got.shape) == want.shape
        np.testing.assert_array_equal(bits(got), want.view(cupy.uint16).get())
        np.testing.assert_array_equal(bits(cache), want_cache.view(cupy.uint16).get())


def test_jax_mla_decode_equals_cupy():
    """cj.decode(q, latent, None, v_head_dim=512) inside jax.jit, the cache donated: cuflash.decode's bits,
    the appended latent rows included."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuflash.interop.jax as cj

    rng = np.random.default_rng()
    case = _case(rng, dtype="bfloat16", page_size=64, heads_q=16, seqlen_q=2, append=True)
    want_cache = cupy.asarray(case["cache"])
    want = cuflash.decode(cupy.asarray(case["q"]), want_cache, None, v_head_dim=D_V,
                          cache_seqlens=cupy.asarray(case["lens"]), block_table=cupy.asarray(case["table"]),
                          k_new=cupy.asarray(case["k_new"]))
    step = jax.jit(lambda q, c, l, t, kn: cj.decode(q, c, None, v_head_dim=D_V, cache_seqlens=l, block_table=t,
                                                    k_new=kn), donate_argnums=(1,))
    out, cache = step(*(jnp.asarray(case[n]) for n in ("q", "cache", "lens", "table", "k_new")))
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), want.view(cupy.uint16).get())
    np.testing.assert_array_equal(np.asarray(cache).view(np.uint16), want_cache.view(cupy.uint16).get())
