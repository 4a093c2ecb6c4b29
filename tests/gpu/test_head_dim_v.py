"""A value head dim of its own (issue 53 item 2): v (B, Sk, Hk, D_v), out and dv with D_v != D_qk, in
every forward and backward family that runs it and in decode (v_cache, v_new), against the float64
reference.

Semantics (docs/design.md §2b): out, dout and dv have v's head dim; the default scale stays
1/sqrt(D_qk); lse is unchanged. fwd_sm80/bwd_sm80 (float16, bfloat16) run the pairs (192, 128),
(128, 64), (64, 128) (and any pair of their compiled head dims), fwd_sm90 (float16, bfloat16, a
Hopper) any pair up to 256, bwd_sm90 the three pairs and (256, 128) (with score modifiers and
dropout (192, 128) and (256, 128) only: forcing it on another raises a ValueError naming the pair,
and unforced such calls run on bwd_sm80), fwd_simt/bwd_simt (float32) any pair.

Each test forces one family (``cuflash.force_kernel`` / ``cuflash.backward.force_kernel``).
hypothesis draws Sq, Sk straddling the tiles (1, 17, 113, 300), GQA, causal and windows, the dtypes,
the pairs and a softcap; the data is fresh for every example and outputs/gradients are poisoned with
NaN before each call. The accuracy rule is docs/design.md §5's (cuflash.testing.assert_attention_close
with cuflash.testing.baseline_attention / baseline_attention_backward, which take D_v != D_qk).

Run: ``python -m pytest -q tests/gpu/test_head_dim_v.py`` (skipped without a GPU).
"""

import math
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupy

import cuflash
import cuflash.backward
import cuflash.testing as tt
from cuflash import reference
from cuflash.kernels import bwd_sm90
from tests.gpu._hardware import SM90, gpu_available as _gpu_available  # noqa: E402
from tests.gpu.test_backward import baseline_backward  # noqa: E402


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy")]

PAIRS = ((192, 128), (128, 64), (64, 128))
# ... and on the Hopper families (256, 128) and (160, 128), whose Q/K run as 256 and 192 (zero-filled)
PAIRS_SM90 = PAIRS + ((256, 128), (160, 128))
PAIRS_SIMT = ((192, 128), (128, 64), (64, 128), (96, 40), (40, 200))
FAMILIES = [pytest.param("fwd_sm80", "bwd_sm80", "float16", id="sm80-fp16"),
            pytest.param("fwd_sm80", "bwd_sm80", "bfloat16", id="sm80-bf16"),
            pytest.param("fwd_sm90", "bwd_sm80", "float16", id="sm90-fp16", marks=SM90),
            pytest.param("fwd_sm90", "bwd_sm80", "bfloat16", id="sm90-bf16", marks=SM90),
            pytest.param("fwd_sm90", "bwd_sm90", "float16", id="sm90-bwd90-fp16", marks=SM90),
            pytest.param("fwd_sm90", "bwd_sm90", "bfloat16", id="sm90-bwd90-bf16", marks=SM90),
            pytest.param("fwd_simt", "bwd_simt", "float32", id="simt-fp32")]
SEQLENS = (1, 17, 113, 300)
HEADS = ((2, 1), (4, 2), (2, 2), (8, 2))
NAN = float("nan")


def _settings(n):
    base = settings.default
    return settings(max_examples=max(1, min(base.max_examples, n)), deadline=None,
                    suppress_health_check=list(base.suppress_health_check)
                    + [HealthCheck.too_slow, HealthCheck.data_too_large])


def _problems(pairs):
    return st.fixed_dictionaries(dict(
        B=st.sampled_from((1, 2)), Sq=st.sampled_from(SEQLENS), Sk=st.sampled_from(SEQLENS),
        heads=st.sampled_from(HEADS), pair=st.sampled_from(pairs), causal=st.booleans(),
        window=st.sampled_from((None, (16, 0), (40, 40), (-1, 8))), softcap=st.sampled_from((0.0, 5.0)),
        seed=st.integers(0, 2**31 - 1)))


def _data(problem, dtype):
    rng = np.random.default_rng(problem["seed"])
    (hq, hk), (d, dv) = problem["heads"], problem["pair"]
    B, Sq, Sk = problem["B"], problem["Sq"], problem["Sk"]
    q = _dev(rng, (B, Sq, hq, d), dtype)
    k = _dev(rng, (B, Sk, hk, d), dtype)
    v = _dev(rng, (B, Sk, hk, dv), dtype)
    dout = _dev(rng, (B, Sq, hq, dv), dtype)
    return q, k, v, dout


def _dev(rng, shape, dtype):
    return cupy.asarray(tt.normal_data(rng, shape, dtype))


def _options(problem, bwd=None):
    """The call's options; bwd_sm90 runs a softcap beside the pairs of BWD_SM90_PAIRS that take score
    modifiers only, so the others drop it there."""
    softcap = problem["softcap"]
    if bwd == "bwd_sm90" and not _bwd_sm90_runs(problem["pair"], featured=True):
        softcap = 0.0
    return dict(causal=problem["causal"], window=problem["window"], softcap=softcap)


def _bwd_sm90_runs(pair, featured):
    return bwd_sm90.bwd_sm90_obstacle(pair[0], ("softcap",) if featured else (), False, pair[1]) is None


def _poisoned(shape, dtype):
    return cupy.full(shape, NAN, dtype=dtype)


def _magnitude(*arrays):
    values = [np.abs(a[np.isfinite(a)]) for a in arrays]
    return max((float(v.max()) for v in values if v.size), default=0.0)


def _assert_grad_close(got, ref, base, dtype, name, magnitude, unavoidable):
    if dtype == "float32":
        tt.assert_attention_close(got, ref, dtype="float32", rtol=1e-4,
                                  atol=max(1e-5 * magnitude, 1e-12) + unavoidable, name=name)
    else:
        tt.assert_attention_close(got, ref, base, dtype=dtype,
                                  atol=max(tt.DEFAULT_ATOL[dtype] * magnitude, 1e-7) + unavoidable, name=name)


@pytest.mark.parametrize("fwd, bwd, dtype", FAMILIES)
def test_forward_and_backward(fwd, bwd, dtype):
    pairs = PAIRS_SIMT if dtype == "float32" else PAIRS_SM90 if bwd == "bwd_sm90" else PAIRS

    @_settings(30)
    @given(problem=_problems(pairs))
    def check(problem):
        q, k, v, dout = _data(problem, dtype)
        opts = _options(problem, bwd)
        B, Sq, hq, _ = q.shape
        dv_dim = v.shape[-1]
        out = _poisoned((B, Sq, hq, dv_dim), q.dtype)
        lse = _poisoned((B, hq, Sq), np.float32)
        with cuflash.force_kernel(fwd):
            got, got_lse, _ = cuflash.attention_forward(q, k, v, out=out, lse=lse, **opts)
        assert got.shape == (B, Sq, hq, dv_dim)
        ref, ref_lse = reference.attention_forward(q, k, v, **opts)   # default scale 1/sqrt(D_qk)
        base, base_lse = tt.baseline_attention(q, k, v, return_lse=True, **opts)
        tt.assert_attention_close(got, ref, base, dtype=dtype)
        tt.assert_attention_close(got_lse, ref_lse, base_lse, dtype=dtype, name="lse")

        grads = [_poisoned(x.shape, x.dtype) for x in (q, k, v)]
        with cuflash.backward.force_kernel(bwd):
            dq, dk, dv = cuflash.attention_backward(dout, q, k, v, got, got_lse, dq=grads[0], dk=grads[1],
                                                    dv=grads[2], **opts)
        assert dv.shape == v.shape and dk.shape == k.shape and dq.shape == q.shape
        refs = reference.attention_backward(dout, q, k, v, out=got, **opts)
        bases = tt.baseline_attention_backward(dout, q, k, v, got, **opts)
        # The part of the error that the rounded stored out makes (D = rowsum(dO * O) from it).
        unavoidable = 0.0
        magnitude = _magnitude(*refs)
        for name, g, r, b in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, bases):
            _assert_grad_close(g, r, b, dtype, name, magnitude, unavoidable)

    check()


@pytest.mark.parametrize("fwd, bwd, dtype", FAMILIES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen(fwd, bwd, dtype, deterministic):
    pairs = PAIRS_SIMT if dtype == "float32" else PAIRS_SM90 if bwd == "bwd_sm90" else PAIRS

    @_settings(12)
    @given(lens=st.lists(st.tuples(st.sampled_from(SEQLENS), st.sampled_from(SEQLENS)), min_size=1, max_size=3),
           heads=st.sampled_from(HEADS), pair=st.sampled_from(pairs), causal=st.booleans(),
           seed=st.integers(0, 2**31 - 1))
    def check(lens, heads, pair, causal, seed):
        rng = np.random.default_rng(seed)
        (hq, hk), (d, dv_dim) = heads, pair
        cu_q = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
        tq, tk = int(cu_q[-1]), int(cu_k[-1])
        q = _dev(rng, (tq, hq, d), dtype)
        k = _dev(rng, (tk, hk, d), dtype)
        v = _dev(rng, (tk, hk, dv_dim), dtype)
        dout = _dev(rng, (tq, hq, dv_dim), dtype)
        cq, ck = cupy.asarray(cu_q), cupy.asarray(cu_k)
        mq, mk = max(a for a, _ in lens), max(b for _, b in lens)
        out = _poisoned((tq, hq, dv_dim), q.dtype)
        with cuflash.force_kernel(fwd):
            got, got_lse = cuflash.attention_varlen(q, k, v, cq, ck, max_seqlen_q=mq, max_seqlen_k=mk, causal=causal,
                                                    return_lse=True, out=out)
        ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
        base = tt.baseline_attention_varlen(q, k, v, cq, ck, causal=causal)
        tt.assert_attention_close(got, ref, base, dtype=dtype)
        grads = [_poisoned(x.shape, x.dtype) for x in (q, k, v)]
        with cuflash.backward.force_kernel(bwd):
            dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, got, got_lse, cq, ck, max_seqlen_q=mq,
                                                           max_seqlen_k=mk, causal=causal, deterministic=deterministic,
                                                           dq=grads[0], dk=grads[1], dv=grads[2])
        refs = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=causal, out=got)
        magnitude = _magnitude(*refs)
        # Per sequence, the dense baseline of the same slice.
        for name, g, r, idx in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, (0, 1, 2)):
            base = np.zeros(r.shape)
            for b in range(len(lens)):
                sq_, sk_ = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
                one = tt.baseline_attention_backward(dout[None, sq_], q[None, sq_], k[None, sk_], v[None, sk_],
                                                     got[None, sq_], causal=causal)[idx][0]
                base[sq_ if idx == 0 else sk_] = one
            _assert_grad_close(g, r, base, dtype, name, magnitude, 0.0)

    check()


@pytest.mark.parametrize("pair", PAIRS)
def test_unforced_runs_where_it_can(pair):
    """Without a forced family the call runs (on a Hopper: fwd_sm90, then bwd_sm90) and matches the
    reference."""
    problem = dict(B=1, Sq=113, Sk=300, heads=(4, 2), pair=pair, seed=_seed(pair))
    q, k, v, dout = _data(problem, "bfloat16")
    out, lse, _ = cuflash.attention_forward(q, k, v, causal=True)
    ref, _ = reference.attention_forward(q, k, v, causal=True)
    tt.assert_attention_close(out, ref, tt.baseline_attention(q, k, v, causal=True), dtype="bfloat16")
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert dv.shape == v.shape


@SM90
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("option", ["softcap", "alibi", "block_mask"])
def test_bwd_sm90_128_64_with_one_in_place_modifier(dtype, option):
    """(128, 64) with the softcap, ALiBi or the block mask alone: bwd_sm90 on its plain tiles (the
    scores modified in place), against the reference; causal and not, GQA."""
    seed = _seed("128_64", dtype, option)
    rng = np.random.default_rng(seed)
    problem = dict(B=2, Sq=300, Sk=257, heads=(4, 2), pair=(128, 64), seed=seed)
    q, k, v, dout = _data(problem, dtype)
    extra = {"softcap": dict(softcap=5.0),
             "alibi": dict(alibi_slopes=cupy.asarray(rng.uniform(0.0, 0.5, (2, 4)).astype(np.float32))),
             "block_mask": dict(block_mask=cupy.asarray(rng.random((2, 4, 3, 3)) < 0.6))}[option]
    for causal in (False, True):
        opts = dict(causal=causal, **extra)
        out, lse, _ = cuflash.attention_forward(q, k, v, **opts)
        grads = [_poisoned(x.shape, x.dtype) for x in (q, k, v)]
        with cuflash.backward.force_kernel("bwd_sm90"):
            dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                                                    **opts)
        refs = reference.attention_backward(dout, q, k, v, out=out, **opts)
        bases = baseline_backward(dout, q, k, v, out, **opts)[:3]   # (the tt baseline takes no ALiBi, masks)
        for name, g, r, b in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, bases):
            _assert_grad_close(g, r, b, dtype, f"{name} ({option}, causal {causal}, seed {seed})",
                               _magnitude(*refs), 0.0)


@SM90
@pytest.mark.parametrize("pair", [p for p in PAIRS if not _bwd_sm90_runs(p, featured=True)])
def test_forcing_bwd_sm90_names_the_pair(pair):
    """Pairs bwd_sm90 runs plain but not with score modifiers: forced with a softcap, a ValueError
    naming the pair; unforced, bwd_sm80 runs the call."""
    problem = dict(B=1, Sq=17, Sk=17, heads=(2, 1), pair=pair, seed=1)
    q, k, v, dout = _data(problem, "float16")
    out, lse, _ = cuflash.attention_forward(q, k, v, softcap=5.0)
    with cuflash.backward.force_kernel("bwd_sm90"), pytest.raises(ValueError, match=rf"\({pair[0]}, {pair[1]}\)"):
        cuflash.attention_backward(dout, q, k, v, out, lse, softcap=5.0)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, softcap=5.0)
    refs = reference.attention_backward(dout, q, k, v, out=out, softcap=5.0)
    bases = tt.baseline_attention_backward(dout, q, k, v, out, softcap=5.0)
    for name, g, r, b in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, bases):
        _assert_grad_close(g, r, b, "float16", name, _magnitude(*refs), 0.0)


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


def test_scale_default_is_qk_head_dim():
    problem = dict(B=1, Sq=17, Sk=113, heads=(2, 2), pair=(192, 128), seed=3)
    q, k, v, _ = _data(problem, "float32")
    got = cuflash.attention(q, k, v)
    explicit = cuflash.attention(q, k, v, scale=1.0 / math.sqrt(192))
    assert cupy.array_equal(got, explicit)


def _cupy_reference_bits(problem):
    """(q, k, v, dout) as bfloat16 host arrays, and cuflash's out, dq, dk, dv from CuPy (causal, dQ in a
    fixed order) as uint16 bits: what the adapters must give."""
    q, k, v, dout = _data(problem, "bfloat16")
    out, lse, _ = cuflash.attention_forward(q, k, v, causal=True)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    return [x.get() for x in (q, k, v, dout)], [x.view(cupy.uint16).get() for x in (out, *grads)]


def test_torch_adapter_equals_cupy():
    """ct.attention and ct.ops.attention through autograd with v's own head dim: cuflash's bits (the same
    kernels), for out and the three gradients."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    import cuflash.interop.torch as ct

    problem = dict(B=2, Sq=113, Sk=300, heads=(4, 2), pair=(192, 128), seed=_seed("torch"))
    host, want = _cupy_reference_bits(problem)

    def on_torch(x):   # bfloat16 through its bits
        return torch.from_numpy(x.view(np.int16).copy()).cuda().view(torch.bfloat16)

    def bits(t):
        return t.detach().view(torch.int16).cpu().numpy().view(np.uint16)

    for fn in (ct.attention, ct.ops.attention):
        q, k, v, dout = (on_torch(x) for x in host)
        for x in (q, k, v):
            x.requires_grad_(True)
        out = fn(q, k, v, causal=True, deterministic=True)
        got = [out, *torch.autograd.grad(out, (q, k, v), dout)]
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert tuple(g.shape) == w.shape, name
            np.testing.assert_array_equal(bits(g), w, err_msg=name)


def test_jax_adapter_equals_cupy():
    """cj.attention inside jax.jit and jax.grad with v's own head dim: cuflash's bits for out and the three
    gradients."""
    from tests.gpu._hardware import jax_on_gpu

    jax = jax_on_gpu()
    import jax.numpy as jnp

    import cuflash.interop.jax as cj

    problem = dict(B=2, Sq=113, Sk=300, heads=(4, 2), pair=(64, 128), seed=_seed("jax"))
    host, want = _cupy_reference_bits(problem)
    q, k, v, dout = (jnp.asarray(x) for x in host)

    def attend(q, k, v):
        return cj.attention(q, k, v, causal=True, deterministic=True)

    def loss(q, k, v):   # its gradient with respect to out is dout, exactly (bfloat16 in float32)
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))

    got = [jax.jit(attend)(q, k, v), *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), w, err_msg=name)


# ----------------------------------------------------------------------------- decode

DECODE_SHAPE = dict(B=2, Hq=8, Hk=2, Sq=1, capacity=320, page_size=16, max_pages=20)


def _decode_problem(pair, paged, append, dtype, seed, Sq=1):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 300, size=2)
    shape = dict(DECODE_SHAPE, Sq=Sq)
    return tt.decode_case(rng, lens, paged=paged, append=append, dtype=dtype, D=pair[0], D_v=pair[1], **shape)


def _decode_reference(case):
    """The float64 reference's out, the same-dtype baseline, and the caches after the append."""
    problems, k_after, v_after = reference._decode._decode_sequences(
        case["q"], case["k_cache"], case["v_cache"], cache_seqlens=case["lens"], block_table=case["table"],
        k_new=case["k_new"], v_new=case["v_new"])
    out = np.concatenate([reference.attention_forward(p["q"], p["k"], p["v"], **p["options"])[0] for p in problems])
    base = np.concatenate([tt.baseline_attention(p["q"], p["k"], p["v"], **p["options"]) for p in problems])
    return out, base, k_after, v_after


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("pair", PAIRS + ((96, 40),))
def test_decode(pair, paged, append, num_splits, dtype):
    """decode with v_cache (and v_new) of their own head dim: out has D_v columns, the appended rows
    land in each cache whole; split-KV partials of D_v columns. One new token (the keys-as-M tile for
    16-bit q) and four (the 16-row tile)."""
    for Sq in (1, 4):
        case = _decode_problem(pair, paged, append, dtype, _seed("decode", pair, paged, append, num_splits, dtype, Sq),
                               Sq=Sq)
        d = tt.decode_on(case, cupy)
        out = _poisoned((2, Sq, 8, pair[1]), d["q"].dtype)
        got = cuflash.decode(d["q"], d["k_cache"], d["v_cache"], out=out, num_splits=num_splits,
                             **tt.decode_kwargs(d))
        assert got is out
        ref, base, k_after, v_after = _decode_reference(case)
        tt.assert_attention_close(out, ref, base, dtype=dtype, name="out")
        for name, after in (("k_cache", k_after), ("v_cache", v_after)):
            same = np.array_equal(cupy.asnumpy(d[name]), after, equal_nan=True)
            assert same, f"{name} is not the old cache plus the appended rows"


def test_decode_fp8_cache_names_the_pair():
    q = cupy.zeros((1, 1, 4, 128), dtype=cupy.float16)
    k, v = cupy.zeros((1, 32, 2, 128), dtype=cupy.uint8), cupy.zeros((1, 32, 2, 64), dtype=cupy.uint8)
    with pytest.raises(ValueError, match=r"\(D_qk, D_v\) = \(128, 64\)"):
        cuflash.decode(q, k, v, kv_dtype="float8_e4m3fn", k_scale=1.0, v_scale=1.0)


def test_decode_adapters_equal_cupy():
    """ct.decode, ct.ops.decode and cj.decode (inside jax.jit) with a value head dim of its own give
    cuflash's bits from CuPy, appending into both caches."""
    case = _decode_problem((192, 128), True, True, "bfloat16", _seed("decode adapters"), Sq=2)
    d = tt.decode_on(case, cupy)
    want = cuflash.decode(d["q"], d["k_cache"].copy(), d["v_cache"].copy(), **tt.decode_kwargs(d))
    want_bits = want.view(cupy.uint16).get()
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        import cuflash.interop.torch as ct

        for fn in (ct.decode, ct.ops.decode):
            t = {name: None if x is None else torch.from_dlpack(x.copy()) for name, x in d.items()
                 if name in tt.DECODE_ARRAYS}
            out = fn(t["q"], t["k_cache"], t["v_cache"], cache_seqlens=t["lens"], block_table=t["table"],
                     k_new=t["k_new"], v_new=t["v_new"])
            assert tuple(out.shape) == want.shape
            np.testing.assert_array_equal(out.view(torch.int16).cpu().numpy().view(np.uint16), want_bits)
    from tests.gpu._hardware import jax_on_gpu

    jax = jax_on_gpu()
    import jax.numpy as jnp

    import cuflash.interop.jax as cj

    j = {name: None if x is None else jnp.asarray(cupy.asnumpy(x)) for name, x in d.items() if name in tt.DECODE_ARRAYS}
    step = jax.jit(lambda q, kc, vc, lens, table, kn, vn: cj.decode(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                                     k_new=kn, v_new=vn))
    out, k_cache, v_cache = step(j["q"], j["k_cache"], j["v_cache"], j["lens"], j["table"], j["k_new"], j["v_new"])
    assert out.shape == want.shape and v_cache.shape == d["v_cache"].shape
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), want_bits)
