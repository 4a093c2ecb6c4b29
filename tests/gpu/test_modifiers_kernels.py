"""User modifiers (cuflash.ScoreMod, cuflash.MaskMod) in every forward and backward kernel family,
against the float64 reference evaluating the same expressions with NumPy.

Each test forces one family (``cuflash.force_kernel`` / ``cuflash.backward.force_kernel``):
fwd_sm80 / bwd_sm80 in float16 and bfloat16, fwd_simt / bwd_simt in float32, and on an sm_90 GPU
fwd_sm90 / bwd_sm90 in float16 and bfloat16. hypothesis draws the shapes (Sq, Sk straddling the
tiles: 1, 17, 113, 300; GQA; head dims 64 and 128), causal or not, and the modifier case:

- ``cap``: a softcap written as a ScoreMod, ``c * tanh(score / c)`` with its grad;
- ``relative``: a relative-position bias read from a float32 table, ``score + table[h * n + |i - j|]``;
- ``document``: a document mask from an int32 array of document ids per (sequence, position);
- ``sliding``: a sliding-window MaskMod;
- ``combined``: the relative bias and the document mask together, under the built-in softcap (the
  backward's chain through the built-in cap and the ScoreMod at once).

The accuracy rule is docs/design.md §5's (cuflash.testing.assert_attention_close), with the plain
same-dtype baseline below taking the same modifiers; gradients as tests/gpu/test_backward.py
checks them (its ``assert_grad_close``). Outputs and gradients are poisoned with NaN before each
call; the data is fresh for every example.

Run: ``python -m pytest -q tests/gpu/test_modifiers_kernels.py`` (skipped without a GPU).
"""

import math
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupy

import cuflash
import cuflash.testing as tt
from cuflash import reference
from cuflash.reference import _forward as _ref_forward
from tests.gpu._hardware import SM90, gpu_available as _gpu_available  # noqa: E402


# These tests are of the expressions' own path through each kernel family: nothing moves into a built-in option.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy"),
              pytest.mark.usefixtures("modifiers_as_written")]



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
CASES = ("cap", "relative", "document", "sliding", "combined")
SEQLENS = (1, 17, 113, 300)
HEADS = ((2, 1), (4, 2), (2, 2))
NAN = float("nan")


def _settings(n):
    base = settings.default
    return settings(max_examples=max(1, min(base.max_examples, n)), deadline=None,
                    suppress_health_check=list(base.suppress_health_check)
                    + [HealthCheck.too_slow, HealthCheck.data_too_large])


problems = st.fixed_dictionaries(dict(
    B=st.sampled_from((1, 2)), Sq=st.sampled_from(SEQLENS), Sk=st.sampled_from(SEQLENS),
    heads=st.sampled_from(HEADS), D=st.sampled_from((64, 128)), case=st.sampled_from(CASES),
    causal=st.booleans(), seed=st.integers(0, 2**31 - 1)))


def modifiers(case, B, Sq, Sk, Hq, rng):
    """(score_mod, mask_mod, built-in options) of a case; arrays on the GPU."""
    S = max(Sq, Sk)
    if case == "cap":
        return ScoreModCase.cap(), None, {}
    if case == "relative":
        return ScoreModCase.relative(Hq, S, rng), None, {}
    if case == "document":
        return None, MaskModCase.document(B, S, rng), {}
    if case == "sliding":
        return None, MaskModCase.sliding(int(rng.integers(0, 40))), {}
    return ScoreModCase.relative(Hq, S, rng), MaskModCase.document(B, S, rng), {"softcap": 5.0}


class ScoreModCase:
    @staticmethod
    def cap():
        return cuflash.ScoreMod("c * tanh(score / c)", grad="1.0 - tanh(score / c) * tanh(score / c)", c=2.0)

    @staticmethod
    def relative(Hq, S, rng):
        table = cupy.asarray(rng.standard_normal(Hq * S).astype(np.float32))
        return cuflash.ScoreMod("score + table[h * n + abs(q_idx - kv_idx)]", table=table, n=S)


class MaskModCase:
    @staticmethod
    def document(B, S, rng):
        # Non-decreasing document ids per sequence, for every position a query or key may have.
        ids = np.sort(rng.integers(0, 4, size=(B, S)), axis=1).astype(np.int32)
        return cuflash.MaskMod("doc[b * S + q_idx] == doc[b * S + kv_idx]", doc=cupy.asarray(ids.reshape(-1)), S=S)

    @staticmethod
    def sliding(w):
        return cuflash.MaskMod("q_idx - kv_idx <= w && kv_idx - q_idx <= w", w=w)


# ----------------------------------------------------------------------------- baselines

def _f32(x):
    return cupy.asarray(x).astype(np.float32)


def _scores(q, k, scale, score_mod, mask_mod, causal, softcap, rnd):
    """Raw S = q k^T rounded to the dtype (B, Hq, Sq, Sk) float32, and the final scores."""
    B, Sq, Hq, D = q.shape
    group = Hq // k.shape[2]
    qt = _f32(q).transpose(0, 2, 1, 3)
    kt = cupy.repeat(_f32(k), group, axis=2).transpose(0, 2, 3, 1)
    raw = rnd(cupy.matmul(qt, kt))
    s = _ref_forward._score_pipeline(cupy, raw, scale=scale, causal=causal, softcap=softcap, score_mod=score_mod,
                                     mask_mod=mask_mod)
    return raw, s


def baseline_backward(dout, q, k, v, out, *, causal=False, softcap=0.0, score_mod=None, mask_mod=None):
    """A plain same-dtype backward (tests/gpu/test_backward.py's recipe) with the modifiers: dS goes
    through the ScoreMod's grad at its input and then through the built-in softcap."""
    dtype = q.dtype
    f32 = np.float32
    rnd = lambda x: tt._round_to(x, dtype)  # noqa: E731
    B, Sq, Hq, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    group = Hq // Hk
    scale = 1.0 / math.sqrt(D)
    raw, s = _scores(q, k, scale, score_mod, mask_mod, causal, softcap, rnd)
    seen = s != -np.inf
    m = s.max(axis=-1, keepdims=True)
    empty = m == -np.inf
    e = cupy.exp(s - cupy.where(empty, f32(0), m))
    p = rnd(cupy.where(empty, f32(0), e / cupy.where(empty, f32(1), e.sum(axis=-1, keepdims=True))))
    qt = _f32(q).transpose(0, 2, 1, 3)
    kt = cupy.repeat(_f32(k), group, axis=2).transpose(0, 2, 1, 3)
    vt = cupy.repeat(_f32(v), group, axis=2).transpose(0, 2, 1, 3)
    dot, ot = _f32(dout).transpose(0, 2, 1, 3), _f32(out).transpose(0, 2, 1, 3)
    dv = cupy.matmul(p.transpose(0, 1, 3, 2), dot)
    dp = rnd(cupy.matmul(dot, vt.transpose(0, 1, 3, 2)))
    ds = rnd(cupy.where(seen, p * (dp - (dot * ot).sum(axis=-1, keepdims=True)), f32(0)))
    if score_mod is not None:
        y = _ref_forward._score_pipeline(cupy, raw, scale=scale, softcap=softcap)
        g = score_mod.reference_gradient(cupy.asnumpy(y).astype(np.float64)).astype(np.float32)
        ds = rnd(cupy.where(seen, ds * cupy.asarray(g), f32(0)))
    if softcap > 0:
        ds = rnd(ds * (1 - cupy.tanh(raw * f32(scale) / f32(softcap)) ** 2))
    dq = rnd(f32(scale) * cupy.matmul(ds, kt))
    dk = rnd((f32(scale) * cupy.matmul(ds.transpose(0, 1, 3, 2), qt)).reshape(B, Hk, group, Sk, D).sum(axis=2))
    dv = rnd(dv.reshape(B, Hk, group, Sk, D).sum(axis=2))
    host = lambda x: cupy.asnumpy(x.transpose(0, 2, 1, 3)).astype(np.float64)  # noqa: E731
    return host(dq), host(dk), host(dv)


def assert_grad_close(got, ref, base, dtype, name, magnitude, stored_out):
    """tests/gpu/test_backward.py's rule: the baseline's error twice over plus a slack scaled by the
    largest reference gradient; plus the part of the error that the rounded ``out`` makes."""
    unavoidable = float(np.nanmax(np.abs(np.asarray(stored_out) - ref), initial=0.0))
    if dtype == "float32":
        tt.assert_attention_close(got, ref, dtype="float32", rtol=1e-4,
                                  atol=max(1e-5 * magnitude, 1e-12) + unavoidable, name=name)
    else:
        tt.assert_attention_close(got, ref, base, dtype=dtype,
                                  atol=max(tt.DEFAULT_ATOL[dtype] * magnitude, 1e-7) + unavoidable, name=name)


def _magnitude(*arrays):
    values = [np.abs(a[np.isfinite(a)]) for a in arrays]
    return max((float(v.max()) for v in values if v.size), default=0.0)


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


# ----------------------------------------------------------------------------- forward

@pytest.mark.parametrize("family, dtype", FORWARD)
@_settings(40)
@given(problem=problems)
def test_forward_against_the_reference(family, dtype, problem):
    B, Sq, Sk, (Hq, Hk), D = problem["B"], problem["Sq"], problem["Sk"], problem["heads"], problem["D"]
    rng = np.random.default_rng(problem["seed"])
    q, k, v = tt.random_qkv(dict(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hk=Hk, D=D), dtype, problem["seed"], xp=cupy)
    score_mod, mask_mod, options = modifiers(problem["case"], B, Sq, Sk, Hq, rng)
    causal = problem["causal"]
    out = cupy.full((B, Sq, Hq, D), NAN, dtype=q.dtype)
    lse = cupy.full((B, Hq, Sq), NAN, dtype=np.float32)
    with cuflash.force_kernel(family):
        cuflash.attention_forward(q, k, v, causal=causal, score_mod=score_mod, mask_mod=mask_mod, out=out, lse=lse,
                                  **options)
    ref_out, ref_lse = reference.attention_forward(q, k, v, causal=causal, score_mod=score_mod, mask_mod=mask_mod,
                                                   **options)
    base = None if dtype == "float32" else tt.baseline_attention(q, k, v, causal=causal, score_mod=score_mod,
                                                            mask_mod=mask_mod, **options)
    tt.assert_attention_close(out, ref_out, base, dtype=dtype, name="out")
    tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")


@pytest.mark.parametrize("family, dtype", FORWARD)
def test_a_repeat_call_reads_the_new_arrays(family, dtype):
    # Same layout, new table and document ids: the remembered plan must take the new pointers.
    B, Sq, Sk, Hq, Hk, D = 2, 113, 113, 4, 2, 64
    rng = np.random.default_rng(_seed(family, dtype))
    q, k, v = tt.random_qkv(dict(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hk=Hk, D=D), dtype, 7, xp=cupy)
    for _ in range(3):
        score_mod = ScoreModCase.relative(Hq, Sk, rng)
        mask_mod = MaskModCase.document(B, Sk, rng)
        out = cupy.full((B, Sq, Hq, D), NAN, dtype=q.dtype)
        with cuflash.force_kernel(family):
            cuflash.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, out=out)
        ref, _ = reference.attention_forward(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        base = None if dtype == "float32" else tt.baseline_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        tt.assert_attention_close(out, ref, base, dtype=dtype, name="out")


@pytest.mark.parametrize("family, dtype", FORWARD)
def test_varlen_positions_count_from_each_sequence(family, dtype):
    rng = np.random.default_rng(_seed("varlen", family, dtype))
    lengths_q, lengths_k = [17, 1, 113], [30, 9, 113]
    cu_q = cupy.asarray(np.cumsum([0] + lengths_q), dtype=cupy.int32)
    cu_k = cupy.asarray(np.cumsum([0] + lengths_k), dtype=cupy.int32)
    Hq, Hk, D = 4, 2, 64
    q, k, v = tt.random_qkv(dict(B=1, Sq=sum(lengths_q), Sk=sum(lengths_k), Hq=Hq, Hk=Hk, D=D), dtype, 3, xp=cupy)
    q, k, v = q[0], k[0], v[0]
    score_mod = ScoreModCase.relative(Hq, 113, rng)
    mask_mod = cuflash.MaskMod("kv_idx <= q_idx + b * 4")   # b: the sequence's index
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    with cuflash.force_kernel(family):
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=113, max_seqlen_k=113, causal=False,
                                            score_mod=score_mod, mask_mod=mask_mod, return_lse=True, out=out)
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q.get(), cu_k.get(), score_mod=score_mod,
                                              mask_mod=mask_mod)
    base = None
    if dtype != "float32":
        base = np.concatenate([tt.baseline_attention(q[None, a:b_], k[None, c:d], v[None, c:d],
                                                score_mod=_ref_forward.at_sequence(score_mod, i),
                                                mask_mod=_ref_forward.at_sequence(mask_mod, i))[0]
                               for i, (a, b_, c, d) in enumerate(zip(cu_q.get()[:-1], cu_q.get()[1:],
                                                                     cu_k.get()[:-1], cu_k.get()[1:]))])
    tt.assert_attention_close(out, ref, base, dtype=dtype, name="out")
    tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")


# ----------------------------------------------------------------------------- backward

def _run_backward(family, dtype, problem):
    B, Sq, Sk, (Hq, Hk), D = problem["B"], problem["Sq"], problem["Sk"], problem["heads"], problem["D"]
    rng = np.random.default_rng(problem["seed"])
    q, k, v = tt.random_qkv(dict(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hk=Hk, D=D), dtype, problem["seed"], xp=cupy)
    dout = cupy.asarray(rng.standard_normal((B, Sq, Hq, D)).astype(np.float32)).astype(q.dtype)
    score_mod, mask_mod, options = modifiers(problem["case"], B, Sq, Sk, Hq, rng)
    causal = problem["causal"]
    kw = dict(causal=causal, score_mod=score_mod, mask_mod=mask_mod, **options)
    # out and lse from the float64 reference, so that a forward bug cannot hide a backward one.
    ref_out, ref_lse = reference.attention_forward(q, k, v, **kw)
    out = cupy.asarray(np.nan_to_num(ref_out)).astype(q.dtype)
    lse = cupy.asarray(ref_lse.astype(np.float32))
    dq = cupy.full(q.shape, NAN, dtype=q.dtype)
    dk, dv = cupy.full(k.shape, NAN, dtype=q.dtype), cupy.full(v.shape, NAN, dtype=q.dtype)
    with cuflash.backward.force_kernel(family):
        cuflash.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **kw)
    ref = reference.attention_backward(dout, q, k, v, **kw)
    stored = reference.attention_backward(dout, q, k, v, out=out, **kw)
    base = (None,) * 3 if dtype == "float32" else baseline_backward(dout, q, k, v, out, **kw)
    magnitude = _magnitude(*ref)
    for name, got, r, b, s in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, base, stored):
        assert_grad_close(got, r, b, dtype, name, magnitude, s)


@pytest.mark.parametrize("family, dtype", BACKWARD)
@_settings(30)
@given(problem=problems)
def test_backward_against_the_reference(family, dtype, problem):
    _run_backward(family, dtype, problem)


@pytest.mark.parametrize("family, dtype", BACKWARD)
def test_backward_deterministic_dq_pass(family, dtype):
    # The dQ pass (bwd_sm80 / bwd_simt, and bwd_sm90's deterministic mode) applies the modifiers too;
    # out and lse from cuflash's own forward this time (the whole chain).
    rng = np.random.default_rng(5)
    q, k, v = tt.random_qkv(dict(B=2, Sq=113, Sk=300, Hq=4, Hk=2, D=64), dtype, 5, xp=cupy)
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
    score_mod, mask_mod, options = modifiers("combined", 2, 113, 300, 4, rng)
    kw = dict(causal=True, score_mod=score_mod, mask_mod=mask_mod, **options)
    out, lse, _ = cuflash.attention_forward(q, k, v, **kw)
    with cuflash.backward.force_kernel(family):
        first = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
        second = cuflash.attention_backward(dout, q, k, v, out, lse, deterministic=True, **kw)
    for a, b in zip(first, second):
        assert cupy.array_equal(a, b)
    ref = reference.attention_backward(dout, q, k, v, out=out, **kw)
    base = (None,) * 3 if dtype == "float32" else baseline_backward(dout, q, k, v, out, **kw)
    magnitude = _magnitude(*ref)
    for name, got, r, b in zip(("dq", "dk", "dv"), first, ref, base):
        assert_grad_close(got, r, b, dtype, name, magnitude, r)


@pytest.mark.parametrize("family, dtype", BACKWARD)
def test_dbias_beside_a_score_mod(family, dtype):
    # bias is added before the ScoreMod: dbias = dS times the ScoreMod's grad, against the reference.
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    q, k, v = tt.random_qkv(dict(B=2, Sq=70, Sk=130, Hq=4, Hk=2, D=64), dtype, seed, xp=cupy)
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32)).astype(q.dtype)
    bias = cupy.asarray(rng.standard_normal((4, 70, 130)).astype(np.float32))
    kw = dict(causal=True, bias=bias, score_mod=cuflash.ScoreMod("c * tanh(score / c)",
                                                                 grad="1.0 - tanh(score / c) * tanh(score / c)", c=3.0))
    ref_out, ref_lse = reference.attention_forward(q, k, v, **kw)
    out = cupy.asarray(np.nan_to_num(ref_out)).astype(q.dtype)
    lse = cupy.asarray(ref_lse.astype(np.float32))
    with cuflash.backward.force_kernel(family):
        *_, dbias = cuflash.attention_backward(dout, q, k, v, out, lse, return_dbias=True, **kw)
    *_, want = reference.attention_backward(dout, q, k, v, out=out, return_dbias=True, **kw)
    tol = 1e-4 if dtype == "float32" else 2e-2
    err = float(np.abs(dbias.get().astype(np.float64) - want).max())
    assert err <= tol * max(1e-3, float(np.abs(want).max())), f"seed {seed}: dbias off by {err}"


# ----------------------------------------------------------------------------- errors before any launch

def test_bad_arguments_are_refused_before_any_launch():
    q = k = v = cupy.ones((1, 17, 2, 64), dtype=cupy.float16)
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    host_table = cuflash.ScoreMod("score + table[kv_idx]", table=np.zeros(17, np.float32))
    with pytest.raises(TypeError, match="score_mod argument table"):
        cuflash.attention(q, k, v, score_mod=host_table, out=out)
    with pytest.raises(TypeError, match="mask_mod"):
        cuflash.attention(q, k, v, mask_mod=cuflash.ScoreMod("score"), out=out)
    assert bool(cupy.isnan(out).all())   # nothing written
    lse = cupy.zeros((1, 2, 17), dtype=cupy.float32)
    capped = cuflash.ScoreMod("c * tanh(score / c)", c=2.0)
    with pytest.raises(ValueError, match="grad"):
        cuflash.attention_backward(q, q, k, v, q, lse, score_mod=capped)
    with pytest.raises(ValueError, match="return_dbias"):   # beside a ScoreMod and a softcap
        cuflash.attention_backward(q, q, k, v, q, lse, bias=cupy.zeros((17, 17), cupy.float32), return_dbias=True,
                                   score_mod=cuflash.ScoreMod("score * 2.0", grad="2.0"), softcap=5.0)


@pytest.mark.skipif(cupy.cuda.runtime.getDeviceCount() < 2 if _gpu_available() else True,
                    reason="needs a second GPU")
def test_an_array_argument_on_another_gpu_is_refused():
    q = k = v = cupy.ones((1, 17, 2, 64), dtype=cupy.float16)
    with cupy.cuda.Device(1):
        table = cupy.zeros(17, dtype=cupy.float32)
    with pytest.raises(ValueError, match="table"):
        cuflash.attention(q, k, v, score_mod=cuflash.ScoreMod("score + table[kv_idx]", table=table))
