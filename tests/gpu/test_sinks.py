"""Attention sinks (``sinks=``, issue 53 item 1) in every forward and backward kernel family, against
the float64 reference (cuflash.reference, whose sinks tests/cpu/test_reference_sinks.py checks).

Semantics (docs/design.md §2b): row (b, h, i)'s softmax denominator gains ``exp(sinks[h])``, no value
comes with it, ``lse`` includes it; a row that sees no key has ``out = 0`` and ``lse = sinks[h]``.
The backward takes ``lse`` with the sink in it (dq, dk, dv as usual), and ``return_dsinks=True``
adds ``dsinks[h] = -sum_(b, i) exp(sinks[h] - lse_i) D_i``, summed in a fixed order (bitwise
reproducible whatever ``deterministic``).

Each test forces one family (``cuflash.force_kernel`` / ``cuflash.backward.force_kernel``):
fwd_sm80 / bwd_sm80 in float16 and bfloat16, fwd_simt / bwd_simt in float32, and on an sm_90 GPU
fwd_sm90 / bwd_sm90 in float16 and bfloat16. hypothesis draws the shapes (Sq, Sk straddling the tiles:
1, 17, 113, 300; GQA; head dims 64 and 128), causal, a window, a softcap, and the sinks: N(0, 2)
around the scores' range, a sink far above the scores (N(12, 2): the sink's term dominates and the
normalisation must not overflow), and heads without a sink (-inf). Sq > Sk with a causal mask or a
window leaves rows that see no key.

The accuracy rule is docs/design.md §5's (cuflash.testing.assert_attention_close) with a plain
same-dtype baseline that has the sink in its denominator (below); gradients as
tests/gpu/test_modifiers_kernels.py checks them; dsinks by the float32 rule against the reference
given the same stored ``out`` (its D_i). Outputs and gradients are poisoned with NaN before each call;
the data is fresh for every example.

Run: ``python -m pytest -q tests/gpu/test_sinks.py`` (skipped without a GPU).
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
from cuflash.random import as_rng_state, dropout_keep
from cuflash.reference import _forward as _ref_forward
from tests.gpu._hardware import SM90, gpu_available as _gpu_available  # noqa: E402


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy")]

FORWARD = [pytest.param("fwd_sm80", "float16", id="fwd_sm80-fp16"),
           pytest.param("fwd_sm80", "bfloat16", id="fwd_sm80-bf16"),
           pytest.param("fwd_simt", "float32", id="fwd_simt-fp32"),
           pytest.param("fwd_sm90", "float16", id="fwd_sm90-fp16", marks=SM90),
           pytest.param("fwd_sm90", "bfloat16", id="fwd_sm90-bf16", marks=SM90)]
BACKWARD = [pytest.param("bwd_sm80", "float16", id="bwd_sm80-fp16"),
            pytest.param("bwd_sm80", "bfloat16", id="bwd_sm80-bf16"),
            pytest.param("bwd_simt", "float32", id="bwd_simt-fp32"),
            pytest.param("bwd_sm90", "float16", id="bwd_sm90-fp16", marks=SM90),
            pytest.param("bwd_sm90", "bfloat16", id="bwd_sm90-bf16", marks=SM90)]
FORWARD_OF = {"bwd_sm80": "fwd_sm80", "bwd_simt": "fwd_simt", "bwd_sm90": "fwd_sm90"}
SEQLENS = (1, 17, 113, 300)
HEADS = ((2, 1), (4, 2), (2, 2), (8, 2))
SINKS = ("normal", "large", "some_none")
NAN = float("nan")


def _settings(n):
    base = settings.default
    return settings(max_examples=max(1, min(base.max_examples, n)), deadline=None,
                    suppress_health_check=list(base.suppress_health_check)
                    + [HealthCheck.too_slow, HealthCheck.data_too_large])


problems = st.fixed_dictionaries(dict(
    B=st.sampled_from((1, 2)), Sq=st.sampled_from(SEQLENS), Sk=st.sampled_from(SEQLENS),
    heads=st.sampled_from(HEADS), D=st.sampled_from((64, 128)), causal=st.booleans(),
    window=st.sampled_from((None, (16, 0), (40, 40), (-1, 8))), softcap=st.sampled_from((0.0, 5.0)),
    sinks=st.sampled_from(SINKS), seed=st.integers(0, 2**31 - 1)))


def make_sinks(kind, Hq, rng):
    """float32 (Hq,) on the GPU: N(0, 2) (scores are about N(0, 1)), N(12, 2) (the sink dominates),
    or N(0, 2) with every other head at -inf (no sink there)."""
    if kind == "large":
        x = rng.normal(12.0, 2.0, Hq)
    else:
        x = rng.normal(0.0, 2.0, Hq)
        if kind == "some_none":
            x[::2] = -np.inf
    return cupy.asarray(x.astype(np.float32))


def _options(problem):
    return dict(causal=problem["causal"], window=problem["window"], softcap=problem["softcap"])


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


# ----------------------------------------------------------------------------- baselines

def _f32(x):
    return cupy.asarray(x).astype(np.float32)


def _probabilities(q, k, sinks, rnd, scale, dropout_p=0.0, rng_state=None, **options):
    """(raw S rounded to the dtype, final scores, P rounded to the dtype) with the sink in the
    denominator, all float32 (B, Hq, Sq, Sk); with dropout, P after it (the reference's keep mask)."""
    group = q.shape[2] // k.shape[2]
    qt = _f32(q).transpose(0, 2, 1, 3)
    kt = cupy.repeat(_f32(k), group, axis=2).transpose(0, 2, 3, 1)
    raw = rnd(cupy.matmul(qt, kt))
    s = _ref_forward._score_pipeline(cupy, raw, scale=scale, **options)
    sink = _f32(sinks).reshape(1, -1, 1, 1)
    m = cupy.maximum(s.max(axis=-1, keepdims=True), sink)
    m_safe = cupy.where(m == -np.inf, np.float32(0), m)
    e = cupy.exp(s - m_safe)
    total = e.sum(axis=-1, keepdims=True) + cupy.exp(sink - m_safe)
    empty = total == 0
    p = rnd(cupy.where(empty, np.float32(0), e / cupy.where(empty, np.float32(1), total)))
    if dropout_p > 0:
        B, Hq, Sq, Sk = p.shape
        seed, offset = as_rng_state(rng_state)
        keep = dropout_keep(seed, offset, dropout_p, np.arange(B).reshape(-1, 1, 1, 1), np.arange(Hq).reshape(1, -1, 1, 1),
                            np.arange(Sq).reshape(1, 1, -1, 1), np.arange(Sk).reshape(1, 1, 1, -1), Hq)
        p = rnd(cupy.where(cupy.asarray(keep), p * np.float32(1.0 / (1.0 - dropout_p)), np.float32(0)))
    return raw, s, p


def baseline_backward(dout, q, k, v, out, sinks, softcap=0.0, **options):
    """A plain same-dtype backward (tests/gpu/test_backward.py's recipe) with P from the sink's
    denominator."""
    f32 = np.float32
    rnd = lambda x: tt._round_to(x, q.dtype)  # noqa: E731
    B, Sq, Hq, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    group = Hq // Hk
    scale = 1.0 / math.sqrt(D)
    raw, s, p = _probabilities(q, k, sinks, rnd, scale, softcap=softcap, **options)
    seen = s != -np.inf
    qt = _f32(q).transpose(0, 2, 1, 3)
    kt = cupy.repeat(_f32(k), group, axis=2).transpose(0, 2, 1, 3)
    vt = cupy.repeat(_f32(v), group, axis=2).transpose(0, 2, 1, 3)
    dot, ot = _f32(dout).transpose(0, 2, 1, 3), _f32(out).transpose(0, 2, 1, 3)
    dv = cupy.matmul(p.transpose(0, 1, 3, 2), dot)
    dp = rnd(cupy.matmul(dot, vt.transpose(0, 1, 3, 2)))
    ds = rnd(cupy.where(seen, p * (dp - (dot * ot).sum(axis=-1, keepdims=True)), f32(0)))
    if softcap > 0:
        ds = rnd(ds * (1 - cupy.tanh(raw * f32(scale) / f32(softcap)) ** 2))
    dq = rnd(f32(scale) * cupy.matmul(ds, kt))
    dk = rnd((f32(scale) * cupy.matmul(ds.transpose(0, 1, 3, 2), qt)).reshape(B, Hk, group, Sk, D).sum(axis=2))
    dv = rnd(dv.reshape(B, Hk, group, Sk, D).sum(axis=2))
    host = lambda x: cupy.asnumpy(x.transpose(0, 2, 1, 3)).astype(np.float64)  # noqa: E731
    return host(dq), host(dk), host(dv)


def _magnitude(*arrays):
    values = [np.abs(a[np.isfinite(a)]) for a in arrays]
    return max((float(v.max()) for v in values if v.size), default=0.0)


def assert_grad_close(got, ref, base, dtype, name, magnitude, stored_out):
    """tests/gpu/test_modifiers_kernels.py's rule: the baseline's error twice over plus a slack scaled
    by the largest reference gradient; plus the part of the error that the rounded ``out`` makes."""
    unavoidable = float(np.nanmax(np.abs(np.asarray(stored_out) - ref), initial=0.0))
    if dtype == "float32":
        tt.assert_attention_close(got, ref, dtype="float32", rtol=1e-4,
                                  atol=max(1e-5 * magnitude, 1e-12) + unavoidable, name=name)
    else:
        tt.assert_attention_close(got, ref, base, dtype=dtype,
                                  atol=max(tt.DEFAULT_ATOL[dtype] * magnitude, 1e-7) + unavoidable, name=name)


def assert_dsinks_close(got, ref, dout, out, lse, sinks):
    """dsinks (float32, computed from the same stored ``out`` and ``lse`` as ``ref``) by the float32
    gradient rule, with a slack scaled by the sum of the terms' magnitudes (they cancel)."""
    d = np.einsum("bihd,bihd->bhi", cupy.asnumpy(_f32(dout)).astype(np.float64),
                  cupy.asnumpy(_f32(out)).astype(np.float64))
    lse64 = cupy.asnumpy(lse).astype(np.float64).reshape(d.shape)
    sink = cupy.asnumpy(sinks).astype(np.float64).reshape(1, -1, 1)
    with np.errstate(invalid="ignore", over="ignore"):
        weight = np.where(np.isneginf(lse64), 0.0, np.exp(sink - lse64))
    scale = float(np.nansum(np.abs(weight * d)))
    tt.assert_attention_close(got, ref, dtype="float32", rtol=1e-4, atol=1e-5 * scale + 1e-10, name="dsinks")


# ----------------------------------------------------------------------------- forward

def _problem_data(problem, dtype):
    B, Sq, Sk, (Hq, Hk), D = problem["B"], problem["Sq"], problem["Sk"], problem["heads"], problem["D"]
    rng = np.random.default_rng(problem["seed"])
    q, k, v = tt.random_qkv(dict(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hk=Hk, D=D), dtype, problem["seed"], xp=cupy)
    return rng, q, k, v, make_sinks(problem["sinks"], Hq, rng)


@pytest.mark.parametrize("family, dtype", FORWARD)
@_settings(40)
@given(problem=problems)
def test_forward_against_the_reference(family, dtype, problem):
    rng, q, k, v, sinks = _problem_data(problem, dtype)
    B, Sq, Hq, D = q.shape
    options = _options(problem)
    out = cupy.full((B, Sq, Hq, D), NAN, dtype=q.dtype)
    lse = cupy.full((B, Hq, Sq), NAN, dtype=np.float32)
    with cuflash.force_kernel(family):
        cuflash.attention_forward(q, k, v, sinks=sinks, out=out, lse=lse, **options)
    ref_out, ref_lse = reference.attention_forward(q, k, v, sinks=sinks, **options)
    base = None if dtype == "float32" else tt.baseline_attention(q, k, v, sinks=sinks, **options)
    tt.assert_attention_close(out, ref_out, base, dtype=dtype, name="out")
    tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")


@pytest.mark.parametrize("family, dtype", FORWARD)
def test_rows_that_see_no_key_are_zero_with_the_sink_as_lse(family, dtype):
    # Sq > Sk with a window bounded on the right: the first rows see no key. Head 0 has no sink (-inf).
    B, Sq, Sk, Hq, Hk, D = 2, 300, 17, 4, 2, 64
    q, k, v = tt.random_qkv(dict(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hk=Hk, D=D), dtype, _seed(family, dtype), xp=cupy)
    sinks = cupy.asarray(np.array([-np.inf, 0.5, -3.0, 20.0], dtype=np.float32))
    out = cupy.full((B, Sq, Hq, D), NAN, dtype=q.dtype)
    lse = cupy.full((B, Hq, Sq), NAN, dtype=np.float32)
    with cuflash.force_kernel(family):
        cuflash.attention_forward(q, k, v, window=(4, 0), sinks=sinks, out=out, lse=lse)
    ref_out, ref_lse = reference.attention_forward(q, k, v, window=(4, 0), sinks=sinks)
    empty = Sq - Sk   # rows 0 .. Sq - Sk - 1 see no key
    assert bool((out[:, :empty] == 0).all())
    expected = np.broadcast_to(cupy.asnumpy(sinks).reshape(1, Hq, 1), (B, Hq, empty))
    np.testing.assert_array_equal(cupy.asnumpy(lse[:, :, :empty]), expected)
    base = None if dtype == "float32" else tt.baseline_attention(q, k, v, sinks=sinks, window=(4, 0))
    tt.assert_attention_close(out, ref_out, base, dtype=dtype, name="out")
    tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")


@pytest.mark.parametrize("family, dtype", FORWARD)
def test_sinks_beside_every_other_option(family, dtype):
    # ALiBi, a bias, a mask, a ScoreMod and dropout: the sink joins the denominator after all of them.
    B, Sq, Sk, Hq, Hk, D = 2, 113, 129, 4, 2, 64
    seed = _seed("options", family, dtype)
    rng = np.random.default_rng(seed)
    q, k, v = tt.random_qkv(dict(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hk=Hk, D=D), dtype, seed, xp=cupy)
    sinks = make_sinks("normal", Hq, rng)
    kw = dict(causal=True, softcap=8.0, alibi_slopes=cupy.asarray(rng.uniform(0, 0.1, Hq).astype(np.float32)),
              bias=cupy.asarray(rng.standard_normal((1, Hq, Sq, Sk)).astype(np.float32)),
              mask=cupy.asarray(rng.random((B, 1, 1, Sk)) > 0.2),
              score_mod=cuflash.ScoreMod("score * 0.5 + 0.25", grad="0.5"))
    out = cupy.full((B, Sq, Hq, D), NAN, dtype=q.dtype)
    lse = cupy.full((B, Hq, Sq), NAN, dtype=np.float32)
    with cuflash.force_kernel(family):
        cuflash.attention_forward(q, k, v, sinks=sinks, out=out, lse=lse, **kw)
    ref_out, ref_lse = reference.attention_forward(q, k, v, sinks=sinks, **kw)
    base = None if dtype == "float32" else tt.baseline_attention(q, k, v, sinks=sinks, **kw)
    tt.assert_attention_close(out, ref_out, base, dtype=dtype, name="out")
    tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")
    # Dropout: the keep mask is the reference's (same rng_state); lse is taken before dropout.
    generator = cuflash.Generator(seed)
    out_d = cupy.full((B, Sq, Hq, D), NAN, dtype=q.dtype)
    with cuflash.force_kernel(family):
        _, lse_d, rng_state = cuflash.attention_forward(q, k, v, sinks=sinks, causal=True, dropout_p=0.2,
                                                        generator=generator, out=out_d)
    ref_d, ref_lse_d = reference.attention_forward(q, k, v, sinks=sinks, causal=True, dropout_p=0.2,
                                                   rng_state=rng_state)
    base_d = None if dtype == "float32" else tt.baseline_attention(q, k, v, sinks=sinks, causal=True, dropout_p=0.2,
                                                              rng_state=rng_state)
    tt.assert_attention_close(out_d, ref_d, base_d, dtype=dtype, name="out (dropout)")
    tt.assert_attention_close(lse_d, ref_lse_d, dtype="float32", name="lse (dropout)")


@pytest.mark.parametrize("family, dtype", FORWARD)
def test_a_repeat_call_reads_the_new_sinks(family, dtype):
    # Same layout, new sink values (and a new array): the remembered plan takes the new pointer.
    B, Sq, Sk, Hq, Hk, D = 1, 113, 113, 4, 2, 64
    q, k, v = tt.random_qkv(dict(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hk=Hk, D=D), dtype, 11, xp=cupy)
    rng = np.random.default_rng(_seed("repeat", family, dtype))
    with cuflash.force_kernel(family):
        plain, plain_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        for _ in range(3):
            sinks = make_sinks("normal", Hq, rng)
            out, lse = cuflash.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
            ref, ref_lse = reference.attention_forward(q, k, v, causal=True, sinks=sinks)
            base = None if dtype == "float32" else tt.baseline_attention(q, k, v, sinks=sinks, causal=True)
            tt.assert_attention_close(out, ref, base, dtype=dtype, name="out")
            tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")
        again, again_lse = cuflash.attention(q, k, v, causal=True, return_lse=True)   # no sinks: as before
    assert cupy.array_equal(again, plain) and cupy.array_equal(again_lse, plain_lse)


@pytest.mark.parametrize("family, dtype", FORWARD)
def test_varlen(family, dtype):
    # Sequences of their own lengths, one with no key at all (its rows: out 0, lse = the sink).
    lengths_q, lengths_k = [17, 5, 113, 1], [30, 0, 113, 9]
    cu_q = cupy.asarray(np.cumsum([0] + lengths_q), dtype=cupy.int32)
    cu_k = cupy.asarray(np.cumsum([0] + lengths_k), dtype=cupy.int32)
    Hq, Hk, D = 4, 2, 64
    q, k, v = tt.random_qkv(dict(B=1, Sq=sum(lengths_q), Sk=sum(lengths_k), Hq=Hq, Hk=Hk, D=D), dtype,
                            _seed("varlen", family, dtype), xp=cupy)
    q, k, v = q[0], k[0], v[0]
    sinks = make_sinks("normal", Hq, np.random.default_rng(3))
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    with cuflash.force_kernel(family):
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=113, max_seqlen_k=113, causal=True,
                                            sinks=sinks, return_lse=True, out=out)
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q.get(), cu_k.get(), causal=True, sinks=sinks)
    base = None
    if dtype != "float32":
        pieces = []
        for a, b_, c, d in zip(cu_q.get()[:-1], cu_q.get()[1:], cu_k.get()[:-1], cu_k.get()[1:]):
            if d == c:
                pieces.append(np.zeros((b_ - a, Hq, D)))
            else:
                pieces.append(tt.baseline_attention(q[None, a:b_], k[None, c:d], v[None, c:d], sinks=sinks,
                                                    causal=True)[0])
        base = np.concatenate(pieces)
    tt.assert_attention_close(out, ref, base, dtype=dtype, name="out")
    tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")
    rows = slice(17, 22)   # the sequence with no key
    assert bool((out[rows] == 0).all())
    np.testing.assert_array_equal(cupy.asnumpy(lse[:, rows]),
                                  np.broadcast_to(cupy.asnumpy(sinks)[:, None], (Hq, 5)))


def test_no_keys_at_all():
    # Sk = 0: nothing is launched; out is 0, lse the sinks; the backward's dsinks are 0.
    q = cupy.ones((2, 5, 4, 64), dtype=cupy.float16)
    k = v = cupy.ones((2, 0, 2, 64), dtype=cupy.float16)
    sinks = cupy.asarray(np.array([0.0, 1.0, -np.inf, 2.0], dtype=np.float32))
    out, lse, _ = cuflash.attention_forward(q, k, v, sinks=sinks)
    assert bool((out == 0).all())
    np.testing.assert_array_equal(cupy.asnumpy(lse), np.broadcast_to(cupy.asnumpy(sinks)[None, :, None], (2, 4, 5)))
    grads = cuflash.attention_backward(q, q, k, v, out, lse, sinks=sinks, return_dsinks=True)
    assert len(grads) == 4 and grads[3].shape == (4,) and grads[3].dtype == np.float32
    assert bool((grads[3] == 0).all())


# ----------------------------------------------------------------------------- backward

def _run_backward(family, dtype, problem, deterministic=False):
    rng, q, k, v, sinks = _problem_data(problem, dtype)
    kw = _options(problem)
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
    # out and lse from the float64 reference, so that a forward bug cannot hide a backward one.
    ref_out, ref_lse = reference.attention_forward(q, k, v, sinks=sinks, **kw)
    out = cupy.asarray(np.nan_to_num(ref_out)).astype(q.dtype)
    lse = cupy.asarray(ref_lse.astype(np.float32))
    dq = cupy.full(q.shape, NAN, dtype=q.dtype)
    dk, dv = cupy.full(k.shape, NAN, dtype=q.dtype), cupy.full(v.shape, NAN, dtype=q.dtype)
    with cuflash.backward.force_kernel(family):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, sinks=sinks, return_dsinks=True, dq=dq, dk=dk,
                                           dv=dv, deterministic=deterministic, **kw)
    assert len(grads) == 4 and grads[0] is dq
    dsinks = grads[3]
    assert dsinks.shape == (q.shape[2],) and dsinks.dtype == np.float32
    ref = reference.attention_backward(dout, q, k, v, sinks=sinks, return_dsinks=True, **kw)
    stored = reference.attention_backward(dout, q, k, v, out=out, sinks=sinks, return_dsinks=True, **kw)
    base = (None,) * 3 if dtype == "float32" else baseline_backward(dout, q, k, v, out, sinks, **kw)
    magnitude = _magnitude(*ref[:3])
    for name, got, r, b, s in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[:3], base, stored[:3]):
        assert_grad_close(got, r, b, dtype, name, magnitude, s)
    assert_dsinks_close(dsinks, stored[3], dout, out, lse, sinks)
    return grads


@pytest.mark.parametrize("family, dtype", BACKWARD)
@_settings(30)
@given(problem=problems)
def test_backward_against_the_reference(family, dtype, problem):
    _run_backward(family, dtype, problem)


@pytest.mark.parametrize("family, dtype", BACKWARD)
@pytest.mark.parametrize("deterministic", [False, True])
def test_dsinks_are_bitwise_reproducible(family, dtype, deterministic):
    # The whole chain (cuflash's own forward, then the backward), twice: dsinks are summed in a fixed
    # order in either mode; with deterministic=True dq, dk, dv are bitwise equal too.
    problem = dict(B=2, Sq=300, Sk=113, heads=(8, 2), D=64, causal=True, window=None, softcap=0.0,
                   sinks="normal", seed=_seed("determinism", family, dtype))
    rng, q, k, v, sinks = _problem_data(problem, dtype)
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
    with cuflash.force_kernel(FORWARD_OF[family]):
        out, lse, _ = cuflash.attention_forward(q, k, v, causal=True, sinks=sinks)
    with cuflash.backward.force_kernel(family):
        first = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks, return_dsinks=True,
                                           deterministic=deterministic)
        second = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks, return_dsinks=True,
                                            deterministic=deterministic)
    assert cupy.array_equal(first[3], second[3])
    if deterministic:
        for a, b in zip(first[:3], second[:3]):
            assert cupy.array_equal(a, b)
    stored = reference.attention_backward(dout, q, k, v, out=out, causal=True, sinks=sinks, return_dsinks=True)
    assert_dsinks_close(first[3], stored[3], dout, out, lse, sinks)


@pytest.mark.parametrize("family, dtype", BACKWARD)
def test_backward_with_dropout_bias_and_dbias(family, dtype):
    # dsinks after dbias in the result; D_i from the dropped-out output, as the reference's.
    B, Sq, Sk, Hq, Hk, D = 1, 113, 129, 4, 2, 64
    seed = _seed("dropout", family, dtype)
    rng = np.random.default_rng(seed)
    q, k, v = tt.random_qkv(dict(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hk=Hk, D=D), dtype, seed, xp=cupy)
    sinks = make_sinks("normal", Hq, rng)
    bias = cupy.asarray(rng.standard_normal((1, Hq, Sq, Sk)).astype(np.float32))
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
    kw = dict(causal=True, bias=bias, dropout_p=0.1, sinks=sinks)
    with cuflash.force_kernel(FORWARD_OF[family]):
        out, lse, rng_state = cuflash.attention_forward(q, k, v, generator=cuflash.Generator(seed), **kw)
    with cuflash.backward.force_kernel(family):
        dq, dk, dv, dbias, dsinks = cuflash.attention_backward(dout, q, k, v, out, lse, rng_state=rng_state,
                                                               return_dbias=True, return_dsinks=True, **kw)
    assert dbias.shape == bias.shape and dsinks.shape == (Hq,)
    stored = reference.attention_backward(dout, q, k, v, out=out, rng_state=rng_state, return_dbias=True,
                                          return_dsinks=True, **kw)
    assert_dsinks_close(dsinks, stored[4], dout, out, lse, sinks)
    magnitude = _magnitude(*stored[:3])
    for name, got, r in zip(("dq", "dk", "dv"), (dq, dk, dv), stored[:3]):
        # Against the reference given the kernel's own out: what remains is the backward's rounding.
        atol = (1e-5 if dtype == "float32" else 3e-2) * max(magnitude, 1e-6)
        tt.assert_attention_close(got, r, dtype="float32", rtol=1e-4 if dtype == "float32" else 3e-2, atol=atol,
                                  name=name)


@pytest.mark.parametrize("family, dtype", BACKWARD)
def test_varlen_backward(family, dtype):
    lengths_q, lengths_k = [17, 5, 113], [30, 0, 113]
    cu_q = cupy.asarray(np.cumsum([0] + lengths_q), dtype=cupy.int32)
    cu_k = cupy.asarray(np.cumsum([0] + lengths_k), dtype=cupy.int32)
    Hq, Hk, D = 4, 2, 64
    seed = _seed("varlen_backward", family, dtype)
    rng = np.random.default_rng(seed)
    q, k, v = tt.random_qkv(dict(B=1, Sq=sum(lengths_q), Sk=sum(lengths_k), Hq=Hq, Hk=Hk, D=D), dtype, seed, xp=cupy)
    q, k, v = q[0], k[0], v[0]
    sinks = make_sinks("normal", Hq, rng)
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q.get(), cu_k.get(), causal=True, sinks=sinks)
    out = cupy.asarray(ref_out).astype(q.dtype)
    lse = cupy.asarray(ref_lse.astype(np.float32))
    with cuflash.backward.force_kernel(family):
        dq, dk, dv, dsinks = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_seqlen_q=113,
                                                               max_seqlen_k=113, causal=True, sinks=sinks,
                                                               return_dsinks=True)
    stored = reference.attention_varlen_backward(dout, q, k, v, cu_q.get(), cu_k.get(), causal=True, out=out,
                                                 sinks=sinks, return_dsinks=True)
    d = np.einsum("ihd,ihd->hi", cupy.asnumpy(_f32(dout)).astype(np.float64), cupy.asnumpy(_f32(out)).astype(np.float64))
    weight = np.exp(cupy.asnumpy(sinks).astype(np.float64)[:, None] - cupy.asnumpy(lse).astype(np.float64))
    tt.assert_attention_close(dsinks, stored[3], dtype="float32", rtol=1e-4,
                              atol=1e-5 * float(np.abs(weight * d).sum()) + 1e-10, name="dsinks")
    magnitude = _magnitude(*stored[:3])
    for name, got, r in zip(("dq", "dk", "dv"), (dq, dk, dv), stored[:3]):
        atol = (1e-5 if dtype == "float32" else 3e-2) * max(magnitude, 1e-6)
        tt.assert_attention_close(got, r, dtype="float32", rtol=1e-4 if dtype == "float32" else 3e-2, atol=atol,
                                  name=name)


# ----------------------------------------------------------------------------- errors before any launch

def test_bad_sinks_are_refused_before_any_launch():
    q = k = v = cupy.ones((1, 17, 2, 64), dtype=cupy.float16)
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    lse = cupy.zeros((1, 2, 17), dtype=cupy.float32)
    with pytest.raises(TypeError, match="sinks.*CUDA"):
        cuflash.attention(q, k, v, sinks=np.zeros(2, np.float32), out=out)
    with pytest.raises(TypeError, match="sinks must be float32"):
        cuflash.attention(q, k, v, sinks=cupy.zeros(2, cupy.float16), out=out)
    with pytest.raises(ValueError, match=r"sinks must have shape \(2,\)"):
        cuflash.attention(q, k, v, sinks=cupy.zeros(3, cupy.float32), out=out)
    with pytest.raises(ValueError, match=r"sinks must have shape"):
        cuflash.attention(q, k, v, sinks=cupy.zeros((1, 2), cupy.float32), out=out)
    with pytest.raises(ValueError, match="sinks"):
        cuflash.attention_varlen(q[0], k[0], v[0], cupy.asarray([0, 17], cupy.int32), cupy.asarray([0, 17], cupy.int32),
                                 sinks=cupy.zeros(4, cupy.float32), out=out[0])
    assert bool(cupy.isnan(out).all())   # nothing written
    dq = cupy.full(q.shape, NAN, dtype=q.dtype)
    with pytest.raises(ValueError, match="return_dsinks=True needs sinks"):
        cuflash.attention_backward(q, q, k, v, q, lse, return_dsinks=True, dq=dq)
    with pytest.raises(TypeError, match="return_dsinks must be a bool"):
        cuflash.attention_backward(q, q, k, v, q, lse, sinks=cupy.zeros(2, cupy.float32), return_dsinks="yes", dq=dq)
    with pytest.raises(TypeError, match="sinks must be float32"):
        cuflash.attention_backward(q, q, k, v, q, lse, sinks=cupy.zeros(2, cupy.float64), return_dsinks=True, dq=dq)
    assert bool(cupy.isnan(dq).all())
