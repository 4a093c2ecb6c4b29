"""Backward attention on the GPU against the float64 analytic reference, kernel family by family.

Every test forces one backward family (``with cuflash.backward.force_kernel(...)``): ``bwd_sm80``
for float16/bfloat16, ``bwd_simt`` for float32, and on an sm_90 GPU also ``bwd_sm90`` for
float16/bfloat16. A case that bwd_sm90 cannot run (``kernels.bwd_sm90.bwd_sm90_obstacle`` of the
padded head dim, the score modifiers and dropout names the reason) is skipped with that reason:
listed cases by pytest.skip, drawn (hypothesis) cases by ``assume``, so that the other examples of
the same test still run on it.

Inputs of the backward. ``out`` and ``lse`` come from the float64 forward reference (rounded to
the input dtype / float32), so a forward bug cannot hide or fake a backward one; dropout uses a
chosen ``rng_state`` that the reference turns into the same keep mask. One test runs the whole
chain with cuflash's forward kernels.

The accuracy rule (docs/design.md §5 carried over to gradients). For each of dq, dk, dv (and dbias):

- float16/bfloat16: ``max|g - ref| <= 2 * max|g_base - ref| + atol * max|ref|``, where ``ref`` is
  the float64 analytic gradient (:func:`cuflash.reference.attention_backward`) and ``g_base`` the gradient of
  a plain same-dtype backward, :func:`baseline_backward` below: what a naive implementation (torch's
  math path, say) computes: S = q k^T and dP = dO V^T accumulated in float32 and stored in the
  dtype, P and dS stored in the dtype, D = rowsum(dO * O) in float32, and dV = P^T dO,
  dQ = scale dS K, dK = scale dS^T Q accumulated in float32 and stored in the dtype (bfloat16
  emulated in float32, docs/design.md §7). ``atol`` is cuflash.testing.DEFAULT_ATOL of the dtype
  (about a quarter ulp), times the largest |reference gradient| of dq, dk, dv (gradients are not
  O(1)).
- both rules add ``max|g_out - ref|``, ``g_out`` the float64 gradient with D_i = dO_i . out_i from
  the stored (rounded) output, as every FlashAttention backward computes it. Where a row sees one
  key, P = 1 and the exact dS is 0: the rounding of ``out`` is then all of a kernel's dq (fp16,
  D = 32, dropout: 2.8e-3, where the baseline's own roundings happened to cancel to 4.2e-4).
- float32: ``||g - ref||_F <= 1e-4 ||ref||_F + 1e-5 * M * sqrt(n)``, M the largest |reference
  gradient| of dq, dk, dv: negligible, except where a reference gradient is exactly 0 (Sk = 1 gives
  P = 1 and dS = 0) and float32 rounding noise is all there is. That noise is the difference of two
  float32 dot products of length D (dP = dO.v and D = dO.o, summed in different orders), scaled by
  scale * |k|: 2.9e-6 M was seen at D = 64 with scale 2 (1e-6 M had been too tight).

NaN/Inf positions must match the reference's exactly (cuflash.testing.assert_attention_close).
Output buffers are poisoned with NaN before each call, so an element never written fails.

Cost: the references run on the host in float64, so problems are small; each hypothesis test caps
its examples. The file should take well under a minute and a half on an H100/H200 once the
kernels are compiled (``python -m cuflash precompile`` and cuflash.kernels.backward.
precompile_backward_variants()).
"""

import math
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import cupy

import cuflash
import cuflash.testing as tt
from cuflash import _backward_plan, features, kernels
from cuflash._runtime import memo as _memo
from cuflash import backward as bw
from cuflash import reference
from cuflash.reference import attention_backward as reference_backward
from cuflash.reference import attention_varlen_backward as reference_varlen_backward
from tests.gpu._hardware import gpu_available as _gpu_available, is_sm90 as _is_sm90  # noqa: E402


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy")]

IS_SM90 = _is_sm90()
SM90_MARKS = [pytest.mark.skipif(not IS_SM90, reason="bwd_sm90 needs an sm_90 GPU"),
              pytest.mark.skipif("bwd_sm90" not in bw.FAMILIES,
                                 reason="bwd_sm90 is not in cuflash.backward.FAMILIES (not built yet)")]

KERNELS = [
    pytest.param("bwd_sm80", "float16", id="sm80-fp16"),
    pytest.param("bwd_sm80", "bfloat16", id="sm80-bf16"),
    pytest.param("bwd_simt", "float32", id="simt-fp32"),
    pytest.param("bwd_sm90", "float16", id="sm90-fp16", marks=SM90_MARKS),
    pytest.param("bwd_sm90", "bfloat16", id="sm90-bf16", marks=SM90_MARKS),
    # bwd_sm90 with 80-row query tiles wherever a call may take them (_wide_query_tiles, below)
    pytest.param("bwd_sm90", "float16", id="sm90wide-fp16", marks=SM90_MARKS),
    pytest.param("bwd_sm90", "bfloat16", id="sm90wide-bf16", marks=SM90_MARKS),
]
NAN = float("nan")
FLOAT32_GRAD_RTOL = 1e-4


@pytest.fixture(autouse=True)
def _wide_query_tiles(request, monkeypatch):
    """For the sm90wide-* kernels: calls without a window, score modifiers, dropout or fixed dQ
    order take bwd_sm90's 80-row query tiles at every length (BWD_SM90_WIDE_MIN_ROWS and its guarded
    twin lowered to 1), not only from the rows the planner waits for; plans remembered before are
    forgotten."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or "sm90wide" not in callspec.id:
        yield
        return
    monkeypatch.setattr(kernels.bwd_sm90, "BWD_SM90_WIDE_MIN_ROWS", 1)
    monkeypatch.setattr(kernels.bwd_sm90, "BWD_SM90_WIDE_MIN_ROWS_GUARDED", 1)
    _memo.clear_memo()
    yield
    _memo.clear_memo()


def _capped(n):
    base = settings.default
    # filter_too_much: bwd_sm90 rejects (assume) the drawn cases it cannot run.
    return settings(max_examples=max(1, min(base.max_examples, n)), deadline=None,
                    suppress_health_check=list(base.suppress_health_check)
                    + [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


def _dtype(name):
    return tt._dtype(name)


def _shape(B, Sq, Sk, Hq, Hk, D):
    return dict(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hk=Hk, D=D)


def _seed_of(name):
    return zlib.crc32(name.encode())


# ----------------------------------------------------------------------------- what bwd_sm90 runs

SCORE_MODS = ("alibi_slopes", "mask", "bias", "block_mask", "softcap")


def _score_mods(options):
    """The score modifiers a call uses, in cuflash.backward's order."""
    return tuple(name for name in SCORE_MODS
                 if (options.get(name, 0.0) > 0 if name == "softcap" else options.get(name) is not None))


def unsupported(family, head_dim, options):
    """Why ``family`` cannot run a call with this head dim and these options (None: it can). Only
    bwd_sm90 has such limits; it is asked about the head dim padded to a multiple of 8, as
    cuflash.backward pads it (its kernels round that up to 64 or 128)."""
    if family != "bwd_sm90":
        return None
    return kernels.bwd_sm90.bwd_sm90_obstacle(8 * -(-head_dim // 8), _score_mods(options), options.get("dropout_p", 0.0) > 0)


def skip_unsupported(family, head_dim, options):
    """pytest.skip a listed case that ``family`` cannot run (never inside a hypothesis test: a skip
    there skips every example; see :func:`assume_supported`)."""
    reason = unsupported(family, head_dim, options)
    if reason is not None:
        pytest.skip(f"{family}: {reason}")


def assume_supported(family, head_dim, options):
    """Reject a drawn case that ``family`` cannot run, so hypothesis draws another."""
    reason = unsupported(family, head_dim, options)
    if reason is not None:
        event(f"{family} cannot run: {reason}")
    assume(reason is None)


class SkippedCases:
    """Sub-cases of a loop that ``family`` cannot run: each is left out, the others run, and at the
    end the test is reported skipped with the reasons (after every assertion of the others)."""

    def __init__(self, family):
        self.family, self.reasons = family, []

    def runs(self, head_dim, options) -> bool:
        reason = unsupported(self.family, head_dim, options)
        if reason is not None:
            self.reasons.append(f"{sorted(options)}: {reason}")
        return reason is None

    def report(self):
        if self.reasons:
            pytest.skip(f"{self.family} left out {len(self.reasons)} sub-case(s): " + "; ".join(self.reasons))


# ----------------------------------------------------------------------------- baseline

def baseline_backward(dout, q, k, v, out, *, causal=False, scale=None, window=None, softcap=0.0,
                      alibi_slopes=None, mask=None, bias=None, block_mask=None, block_size=(128, 128),
                      dropout_p=0.0, rng_state=None, batch_ids=None):
    """Plain same-dtype backward (see the module docstring), on the GPU in float32 with the
    dtype's rounding emulated. Returns float64 NumPy (dq, dk, dv, ds), ds = dL/ds (B, Hq, Sq, Sk)
    rounded to the dtype (what a naive kernel would hand to a bias gradient)."""
    dtype = q.dtype
    f32 = np.float32
    B, Sq, Hq, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    group = Hq // Hk
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    rnd = lambda x: tt._round_to(x, dtype)  # noqa: E731

    qt = q.astype(f32).transpose(0, 2, 1, 3)
    kt = cupy.repeat(k.astype(f32), group, axis=2).transpose(0, 2, 1, 3)
    vt = cupy.repeat(v.astype(f32), group, axis=2).transpose(0, 2, 1, 3)
    dot = dout.astype(f32).transpose(0, 2, 1, 3)
    ot = out.astype(f32).transpose(0, 2, 1, 3)

    raw = rnd(cupy.matmul(qt, kt.transpose(0, 1, 3, 2)))
    s = reference._forward._score_pipeline(cupy, raw, scale=scale, causal=causal, window=window, softcap=softcap,
                                  alibi_slopes=alibi_slopes, mask=mask, bias=bias, block_mask=block_mask,
                                  block_size=block_size)
    seen = s != -np.inf
    m = s.max(axis=-1, keepdims=True)
    empty = m == -np.inf
    e = cupy.exp(s - cupy.where(empty, f32(0), m))
    l = e.sum(axis=-1, keepdims=True)
    p = rnd(cupy.where(empty, f32(0), e / cupy.where(empty, f32(1), l)))
    keep_scale = f32(1)
    if dropout_p > 0:
        seed, offset = int(rng_state[0]), int(rng_state[1])
        ids = np.arange(B) if batch_ids is None else np.asarray(batch_ids)
        keep = cuflash.random.dropout_keep(seed, offset, dropout_p, ids.reshape(-1, 1, 1, 1),
                                           np.arange(Hq).reshape(1, -1, 1, 1), np.arange(Sq).reshape(1, 1, -1, 1),
                                           np.arange(Sk).reshape(1, 1, 1, -1), Hq)
        keep_scale = cupy.where(cupy.asarray(keep), f32(1.0 / (1.0 - dropout_p)), f32(0))
    pdrop = rnd(p * keep_scale)
    dv = cupy.matmul(pdrop.transpose(0, 1, 3, 2), dot)                       # (B, Hq, Sk, Dv)
    dp = rnd(cupy.matmul(dot, vt.transpose(0, 1, 3, 2))) * keep_scale
    dsum = (dot * ot).sum(axis=-1, keepdims=True)
    ds = rnd(cupy.where(seen, p * (dp - dsum), f32(0)))
    dx = ds
    if softcap > 0:
        dx = rnd(ds * (1 - cupy.tanh(raw * f32(scale) / f32(softcap)) ** 2))
    dq = rnd(f32(scale) * cupy.matmul(dx, kt))
    dk = f32(scale) * cupy.matmul(dx.transpose(0, 1, 3, 2), qt)
    dk = rnd(dk.reshape(B, Hk, group, Sk, D).sum(axis=2))
    dv = rnd(dv.reshape(B, Hk, group, Sk, v.shape[-1]).sum(axis=2))   # (v's head dim may be its own)
    host = lambda x: cupy.asnumpy(x).astype(np.float64)  # noqa: E731
    return (host(dq.transpose(0, 2, 1, 3)), host(dk.transpose(0, 2, 1, 3)), host(dv.transpose(0, 2, 1, 3)),
            host(ds))


def baseline_varlen_backward(dout, q, k, v, out, cu_q, cu_k, *, alibi_slopes=None, **options):
    dq, dk, dv = (np.zeros(x.shape) for x in (q, k, v))
    for b in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        slopes = alibi_slopes
        if slopes is not None and slopes.ndim == 2:
            slopes = slopes[b]
        g = baseline_backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], out[None, rows],
                              alibi_slopes=slopes, batch_ids=[b], **options)
        dq[rows], dk[keys], dv[keys] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


def _reduce_like(full, shape):
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    axes = tuple(a for a in range(4) if padded[a] == 1 and full.shape[a] != 1)
    return (full.sum(axis=axes, keepdims=True) if axes else full).reshape(shape)


# ----------------------------------------------------------------------------- the rule

def _magnitude(*arrays):
    """Largest finite |x| over the arrays (0 if none): the scale of the absolute slack."""
    finite = [np.abs(a[np.isfinite(a)]) for a in (np.asarray(x, dtype=np.float64) for x in arrays)]
    return max((float(f.max()) for f in finite if f.size), default=0.0)


def assert_grad_close(got, ref, base, dtype, name, float32_rtol=FLOAT32_GRAD_RTOL, magnitude=None,
                      stored_out=None):
    """The accuracy rule of the module docstring for one gradient. ``magnitude`` (default max|ref|)
    scales the absolute slack: pass the largest of dq, dk, dv so that a gradient that is exactly 0
    in the reference (Sk = 1: P = 1, dS = 0) is held to rounding noise of the others' size.
    ``stored_out`` is the reference gradient with D from the stored output; its distance to ``ref``
    is added to the slack."""
    ref = np.asarray(ref, dtype=np.float64)
    magnitude = _magnitude(ref) if magnitude is None else magnitude
    unavoidable = 0.0 if stored_out is None else _magnitude(np.asarray(stored_out) - ref)
    if dtype == "float32":
        tt.assert_attention_close(got, ref, dtype="float32", rtol=float32_rtol,
                                  atol=max(1e-5 * magnitude, 1e-12) + unavoidable, name=name)
    else:
        tt.assert_attention_close(got, ref, base, dtype=dtype,
                                  atol=max(tt.DEFAULT_ATOL[dtype] * magnitude, 1e-7) + unavoidable, name=name)


# ----------------------------------------------------------------------------- running a problem

def _device_options(options, dtype, bias_same_dtype=False):
    opts = tt.as_device_options(options, cupy)
    if bias_same_dtype and "bias" in opts:
        opts["bias"] = opts["bias"].astype(_dtype(dtype))
    return opts


def _forward_reference(q, k, v, opts, rng_state):
    """out (input dtype) and lse (float32) on the GPU, from the float64 forward reference."""
    ref_opts = dict(opts)
    if ref_opts.get("dropout_p", 0.0) > 0:
        ref_opts["rng_state"] = rng_state
    out, lse = reference.attention_forward(q, k, v, **ref_opts)
    return cupy.asarray(out.astype(np.float32)).astype(q.dtype), cupy.asarray(lse.astype(np.float32))


def _random_like(x, seed):
    rng = np.random.default_rng(seed)
    return cupy.asarray(rng.standard_normal(x.shape, dtype=np.float32)).astype(x.dtype)


def run_backward(family, dout, q, k, v, out, lse, options, *, rng_state=None, deterministic=False,
                 return_dbias=False):
    """attention_backward into NaN-poisoned dq/dk/dv buffers, forced onto ``family``."""
    dq = cupy.full(q.shape, NAN, dtype=q.dtype)
    dk = cupy.full(k.shape, NAN, dtype=k.dtype)
    dv = cupy.full(v.shape, NAN, dtype=v.dtype)
    with bw.force_kernel(family):
        res = bw.attention_backward(dout, q, k, v, out, lse, rng_state=rng_state, deterministic=deterministic,
                                    return_dbias=return_dbias, dq=dq, dk=dk, dv=dv, **options)
    assert len(res) == (4 if return_dbias else 3)
    for got, buf in zip(res[:3], (dq, dk, dv)):
        assert got.shape == buf.shape and got.dtype == buf.dtype
        if buf.size:
            assert got.data.ptr == buf.data.ptr, "output buffer was not used"
    return res


def planned_info(family, dout, q, k, v, out, lse, **options):
    """The ``info`` of the plan attention_backward makes for these operands with ``family`` forced
    (nothing is launched)."""
    with bw.force_kernel(family):
        return cuflash.plan(bw.attention_backward, dout, q, k, v, out, lse, **options).plan.info


def check_gradients(dout, q, k, v, out, options, grads, *, dtype, rng_state=None,
                    float32_rtol=FLOAT32_GRAD_RTOL):
    """dq, dk, dv (and dbias when grads has it) against the reference under the rule."""
    ref_opts = dict(options)
    if ref_opts.get("dropout_p", 0.0) > 0:
        ref_opts["rng_state"] = rng_state
    want_dbias = len(grads) == 4
    ref = reference_backward(dout, q, k, v, return_dbias=want_dbias, **ref_opts)
    stored = reference_backward(dout, q, k, v, out=out, return_dbias=want_dbias, **ref_opts)
    base = baseline_backward(dout, q, k, v, out, **ref_opts) if dtype != "float32" else (None,) * 4
    magnitude = _magnitude(*ref[:3])
    for name, got, r, bl, st_ in zip(("dq", "dk", "dv"), grads[:3], ref[:3], base[:3], stored):
        assert_grad_close(got, r, bl, dtype, name, float32_rtol, magnitude, stored_out=st_)
    if want_dbias:
        bias = options["bias"]
        base_db = None
        if base[3] is not None:
            # A naive kernel stores dS in the dtype, sums it and stores dbias in the bias dtype.
            base_db = _reduce_like(base[3], tuple(bias.shape)).astype(bias.dtype).astype(np.float64)
        assert grads[3].shape == tuple(bias.shape) and grads[3].dtype == bias.dtype
        # dbias is a sum of dS, so D from the stored output moves it as it moves dq, dk, dv (an fp16
        # case with one key, where the exact dS is 0 everywhere: dbias 3.4e-3 at D's rounding).
        assert_grad_close(grads[3], ref[3], base_db, dtype, "dbias", float32_rtol, max(magnitude, _magnitude(ref[3])),
                          stored_out=stored[3])
    return ref


def solve(family, dtype, shape, options, seed, *, deterministic=False, return_dbias=False,
          bias_same_dtype=False):
    """Fresh data, reference forward, forced backward into poisoned buffers, reference check.
    A case ``family`` cannot run is skipped (hypothesis tests reject it before calling this)."""
    skip_unsupported(family, shape["D"], options)
    q, k, v = tt.random_qkv(shape, dtype, seed, xp=cupy)
    dout = _random_like(q, seed + 1)
    opts = _device_options(options, dtype, bias_same_dtype)
    rng_state = np.array([seed % 2**64, 3], dtype=np.uint64) if opts.get("dropout_p", 0.0) > 0 else None
    out, lse = _forward_reference(q, k, v, opts, rng_state)
    want_dbias = return_dbias and "bias" in opts
    grads = run_backward(family, dout, q, k, v, out, lse, opts, rng_state=rng_state, deterministic=deterministic,
                         return_dbias=want_dbias)
    ref = check_gradients(dout, q, k, v, out, opts, grads, dtype=dtype, rng_state=rng_state)
    return grads, ref, (dout, q, k, v, out, lse, opts, rng_state)


# ----------------------------------------------------------------------------- properties

OPTION_HEAD_DIMS = st.sampled_from([32, 64, 80, 128])
SHAPE_HEAD_DIMS = st.sampled_from([8, 36, 64, 72, 128, 160, 192, 256])


@st.composite
def option_problems(draw):
    shape = draw(tt.attention_shapes(max_batch=2, head_dims=OPTION_HEAD_DIMS, max_scores=2**15))
    return dict(shape=shape, options=draw(tt.attention_options(shape)), seed=draw(st.integers(0, 2**62)),
                deterministic=draw(st.booleans()), return_dbias=draw(st.booleans()),
                bias_same_dtype=draw(st.booleans()))


@pytest.mark.parametrize("family, dtype", KERNELS)
@_capped(30)
@given(problem=option_problems())
def test_option_combinations(family, dtype, problem):
    assume_supported(family, problem["shape"]["D"], problem["options"])
    solve(family, dtype, problem["shape"], problem["options"], problem["seed"],
          deterministic=problem["deterministic"], return_dbias=problem["return_dbias"],
          bias_same_dtype=problem["bias_same_dtype"])


@st.composite
def shape_problems(draw):
    shape = draw(tt.attention_shapes(max_batch=2, head_dims=SHAPE_HEAD_DIMS, max_scores=2**16))
    options = {"causal": True} if draw(st.booleans()) else {}
    return dict(shape=shape, options=options, seed=draw(st.integers(0, 2**62)),
                deterministic=draw(st.booleans()))


@pytest.mark.parametrize("family, dtype", KERNELS)
@_capped(25)
@given(problem=shape_problems())
def test_shapes_and_head_dims(family, dtype, problem):
    assume_supported(family, problem["shape"]["D"], problem["options"])
    solve(family, dtype, problem["shape"], problem["options"], problem["seed"],
          deterministic=problem["deterministic"])


# ----------------------------------------------------------------------------- each option

def _slopes(h):
    return (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)


def _mask(shape, density, seed):
    return np.random.default_rng(seed).random(shape) < density


def _bias(shape, seed, amplitude=2.0):
    return (amplitude * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


B_, SQ_, SK_, HQ_, HK_, D_ = 2, 113, 129, 4, 2, 64
EACH_OPTION = [
    ("plain", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {}),
    ("d128_long", _shape(1, 200, 300, 2, 1, 128), {}),
    ("causal_sq_lt_sk", _shape(B_, 17, 129, HQ_, HK_, D_), {"causal": True}),
    ("causal_sq_gt_sk", _shape(B_, 129, 17, HQ_, HK_, D_), {"causal": True}),
    ("causal_square_d128", _shape(1, 257, 257, 2, 2, 128), {"causal": True}),
    ("d256_long_gqa", _shape(1, 200, 300, 4, 1, 256), {}),
    ("causal_d256", _shape(2, 129, 193, 2, 2, 256), {"causal": True}),
    ("window_d256", _shape(1, 200, 150, 2, 1, 256), {"window": (7, 3)}),
    ("window_both", _shape(B_, 200, 150, HQ_, HK_, D_), {"window": (7, 3)}),
    ("window_causal", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"window": (20, 8), "causal": True}),
    ("softcap", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"softcap": 5.0, "scale": 1.0}),
    ("alibi_bh", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"alibi_slopes": np.random.default_rng(1).uniform(0, 1, (B_, HQ_)).astype(np.float32), "causal": True}),
    ("mask_full", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"mask": _mask((B_, HQ_, SQ_, SK_), 0.5, 2)}),
    ("mask_keys_1d", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"mask": _mask((SK_,), 0.7, 4)}),
    ("bias_full", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"bias": _bias((B_, HQ_, SQ_, SK_), 7)}),
    ("bias_per_batch_key", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"bias": _bias((B_, 1, 1, SK_), 10)}),
    ("bias_2d_softcap", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"bias": _bias((SQ_, SK_), 8), "softcap": 3.0}),
    ("block_mask_odd_blocks", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"block_mask": _mask((1, HQ_, 7, 3), 0.6, 13), "block_size": (17, 45)}),
    ("dropout_01", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"dropout_p": 0.1}),
    ("dropout_05_causal_mqa", _shape(B_, SQ_, SK_, HQ_, 1, D_), {"dropout_p": 0.5, "causal": True}),
    ("everything", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"causal": True, "window": (50, -1), "softcap": 20.0, "alibi_slopes": _slopes(HQ_),
      "mask": _mask((1, 1, SQ_, SK_), 0.9, 14), "bias": _bias((B_, 1, SQ_, SK_), 15, 0.5),
      "block_mask": _mask((1, HQ_, 4, 3), 0.8, 16), "block_size": (32, 64), "dropout_p": 0.2}),
    # Every modifier with dropout at D = 256 (bwd_sm90's largest featured variant).
    ("everything_d256", _shape(1, SQ_, SK_, HQ_, HK_, 256),
     {"softcap": 20.0, "alibi_slopes": _slopes(HQ_), "mask": _mask((1, 1, SQ_, SK_), 0.9, 17),
      "bias": _bias((1, 1, SQ_, SK_), 18, 0.5), "block_mask": _mask((1, HQ_, 4, 3), 0.8, 19),
      "block_size": (32, 64), "dropout_p": 0.2}),
    # Blocks smaller than a tile's share of the vote (a tile meets up to 22 x 27 of them).
    ("block_mask_small_blocks", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"block_mask": _mask((1, HQ_, 38, 26), 0.05, 20), "block_size": (3, 5)}),
]


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("name, shape, options", EACH_OPTION, ids=[c[0] for c in EACH_OPTION])
def test_each_option(family, dtype, name, shape, options):
    # Atomic and deterministic dQ on alternate cases (both run every option family somewhere).
    deterministic = [c[0] for c in EACH_OPTION].index(name) % 2 == 1
    solve(family, dtype, shape, options, _seed_of(name), deterministic=deterministic, return_dbias=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind, shape, options, operand", [
    pytest.param("bias", _shape(2, 300, 456, 4, 2, 128), {"causal": True}, dict(shape=(300, 456)), id="bias-causal-tails"),
    pytest.param("bias", _shape(1, 700, 600, 4, 2, 128), {"causal": True}, dict(shape=(4, 700, 600)),
                 id="bias-heads-rows-without-keys"),
    pytest.param("bias", _shape(2, 257, 384, 2, 1, 128), {"window": (100, 20), "scale": 0.3},
                 dict(shape=(2, 1, 257, 384)), id="bias-batches-window"),
    pytest.param("bias", _shape(2, 200, 328, 4, 4, 128), {}, dict(shape=(200, 328), rows_stride=512),
                 id="bias-rows-of-a-wider-array"),
    pytest.param("mask", _shape(2, 300, 464, 4, 2, 128), {"causal": True}, dict(shape=(300, 464)), id="mask-causal-tails"),
    pytest.param("mask", _shape(2, 257, 512, 4, 1, 128), {}, dict(shape=(2, 4, 257, 512), empty_rows=9),
                 id="mask-rows-all-hidden"),
    pytest.param("mask", _shape(2, 300, 464, 4, 2, 128), {"causal": True}, dict(shape=(2, 1, 1, 464)),
                 id="key-mask-one-row"),
    pytest.param("bias", _shape(2, 257, 456, 4, 2, 128), {"window": (100, 20)}, dict(shape=(456,)),
                 id="key-bias-one-row"),
])
def test_bias_and_mask_as_tiles(dtype, kind, shape, options, operand):
    """bwd_sm90 reads a bias of q's dtype or a mask alone as TMA tiles on its plain tiles (S^T modified in
    place, the tile read transposed; a key mask or bias as tiles of one row). (With return_dbias the bias
    takes the featured tiles, whose dbias test_dbias_for_broadcast_biases checks.)"""
    seed = _seed_of("bwd_score_tile" + kind + repr(shape) + repr(options) + dtype)
    operand = dict(operand)
    x = tt.score_tile_operand(kind, operand.pop("shape"), dtype, seed, cupy, **operand)
    opts = dict(_device_options(options, dtype), **{kind: x})
    q, k, v = tt.random_qkv(shape, dtype, seed, xp=cupy)
    dout = _random_like(q, seed + 1)
    out, lse = _forward_reference(q, k, v, opts, None)
    assert planned_info("bwd_sm90", dout, q, k, v, out, lse, **opts)["score_tile"]
    grads = run_backward("bwd_sm90", dout, q, k, v, out, lse, opts)
    check_gradients(dout, q, k, v, out, opts, grads, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bias_tile_infinities_where_hidden(dtype):
    """bwd_sm90's bias tile starts S^T's accumulator: NaN and +inf where the causal mask hides a key must
    leave the gradients finite and right, -inf where it is seen must hide it."""
    seed = _seed_of("bwd_bias_tile_hidden_infinities" + dtype)
    sq, sk = 300, 456
    opts = dict(_device_options({"causal": True}, dtype), bias=tt.bias_with_hidden_infinities(sq, sk, dtype, seed, cupy))
    q, k, v = tt.random_qkv(_shape(2, sq, sk, 4, 2, 128), dtype, seed, xp=cupy)
    dout = _random_like(q, seed + 1)
    out, lse = _forward_reference(q, k, v, opts, None)
    assert planned_info("bwd_sm90", dout, q, k, v, out, lse, **opts)["score_tile"]
    grads = run_backward("bwd_sm90", dout, q, k, v, out, lse, opts)
    assert not any(bool(cupy.isnan(g.astype(cupy.float32)).any()) for g in grads[:3])
    check_gradients(dout, q, k, v, out, opts, grads, dtype=dtype)


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("bias_shape", [(2, 3, 40, 50), (1, 3, 40, 50), (40, 50), (50,), (2, 1, 40, 1),
                                        (1, 3, 1, 1)])
def test_dbias_for_broadcast_biases(family, dtype, bias_shape):
    shape = _shape(2, 40, 50, 3, 1, 64)
    for bias_dtype in ("float32", dtype):
        options = {"bias": _bias(bias_shape, 30).astype(_dtype(bias_dtype)), "causal": True}
        grads, _, _ = solve(family, dtype, shape, options, 31, return_dbias=True)
        assert grads[3].shape == bias_shape and grads[3].dtype == _dtype(bias_dtype)


# ----------------------------------------------------------------------------- hard cases

@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("sq", [1, 2, 5, 17])
@pytest.mark.parametrize("sk", [1, 2, 5, 17])
def test_tiny_sequences(family, dtype, sq, sk):
    # Tails of one element: zero-padded keys must be masked before exp, or exp(0 - lse) overflows
    # for very negative lse and inf * 0 turns the gradient into NaN.
    options = [{}, {"causal": True}, {"alibi_slopes": _slopes(4)}][(sq + sk) % 3]
    grads, _, _ = solve(family, dtype, _shape(2, sq, sk, 4, 2, 64), options, 40 + sq * 31 + sk,
                        deterministic=sq % 2 == 1)
    for g in grads:
        assert not bool(cupy.isnan(g.astype(cupy.float32)).any())


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_large_magnitude_inputs(family, dtype):
    # Scores of a few hundred and an lse to match: P = exp(s - lse) must not overflow anywhere,
    # including the zero-padded tail keys (s = 0, far above a very negative lse).
    shape = _shape(2, 129, 257, 4, 1, 128)
    q, k, v = tt.random_qkv(shape, dtype, 80, xp=cupy)
    left_out = SkippedCases(family)
    for qscale, options in ((30.0, {}), (30.0, {"causal": True}), (30.0, {"softcap": 50.0}), (-30.0, {})):
        if not left_out.runs(shape["D"], options):
            continue
        qs = (q.astype(cupy.float32) * qscale).astype(q.dtype)
        dout = _random_like(q, 81)
        out, lse = _forward_reference(qs, k, v, options, None)
        grads = run_backward(family, dout, qs, k, v, out, lse, options)
        for g in grads:
            assert bool(cupy.isfinite(g.astype(cupy.float32)).all())
        # float32: scores of a few hundred carry rounding errors of |s| * 2^-24 into P = exp(s - lse)
        # (the same for any float32 implementation), so the relative gradient error here is ~1e-4.
        check_gradients(dout, qs, k, v, out, options, grads, dtype=dtype, float32_rtol=1e-3)
    left_out.report()


FULLY_MASKED = [
    ("causal_sq_gt_sk", _shape(B_, 150, 40, HQ_, HK_, D_), {"causal": True}),
    ("window_left_of_keys", _shape(B_, 130, 20, HQ_, HK_, D_), {"window": (5, 0)}),
    ("mask_rows", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"mask": np.broadcast_to(np.arange(SQ_)[:, None] % 3 != 0, (SQ_, SK_)).copy()}),
    ("mask_all_false", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"mask": np.zeros((1, 1), bool)}),
    ("block_mask_rows", _shape(B_, 200, SK_, HQ_, HK_, D_),
     {"block_mask": np.array([[True, False], [False, False]]).reshape(1, 1, 2, 2)}),
    ("bias_minus_inf_rows", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"bias": np.where(np.arange(SQ_)[:, None] < 10, -np.inf, 0.0).astype(np.float32)
      * np.ones((1, SK_), np.float32)}),
    ("dropout_causal_sq_gt_sk", _shape(B_, 150, 40, HQ_, HK_, D_), {"causal": True, "dropout_p": 0.3}),
]


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("name, shape, options", FULLY_MASKED, ids=[c[0] for c in FULLY_MASKED])
def test_fully_masked_rows_get_zero_gradients(family, dtype, name, shape, options):
    for deterministic in (False, True):
        grads, ref, (_, _, _, _, _, lse, _, _) = solve(family, dtype, shape, options, _seed_of(name),
                                                       deterministic=deterministic)
        empty = np.isneginf(cupy.asnumpy(lse))                     # (B, Hq, Sq)
        assert empty.any(), "the case should have rows that see no key"
        dq = cupy.asnumpy(grads[0].astype(cupy.float32))
        assert (dq[np.moveaxis(empty, 1, 2)] == 0).all(), "rows that see no key must get dq = 0 exactly"
        for g in grads:
            assert bool(cupy.isfinite(g.astype(cupy.float32)).all())
        if name == "mask_all_false":
            for g in grads:
                assert not bool(g.astype(cupy.float32).any())


# ----------------------------------------------------------------------------- determinism

@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
def test_deterministic_is_bitwise_reproducible(family, dtype, heads):
    shape = _shape(2, 300, 333, heads[0], heads[1], 64)
    options = {"causal": True, "dropout_p": 0.2, "alibi_slopes": cupy.asarray(_slopes(heads[0]))}
    skip_unsupported(family, shape["D"], options)
    q, k, v = tt.random_qkv(shape, dtype, 90, xp=cupy)
    dout = _random_like(q, 91)
    rng_state = np.array([5, 9], dtype=np.uint64)
    out, lse = _forward_reference(q, k, v, options, rng_state)
    first = run_backward(family, dout, q, k, v, out, lse, options, rng_state=rng_state, deterministic=True)
    check_gradients(dout, q, k, v, out, options, first, dtype=dtype, rng_state=rng_state)
    for _ in range(19):
        again = run_backward(family, dout, q, k, v, out, lse, options, rng_state=rng_state, deterministic=True)
        for a, b in zip(first, again):
            assert bool((a.view(cupy.uint8) == b.view(cupy.uint8)).all()), "deterministic=True changed bits"
    # The atomic path agrees within rounding.
    atomic = run_backward(family, dout, q, k, v, out, lse, options, rng_state=rng_state)
    check_gradients(dout, q, k, v, out, options, atomic, dtype=dtype, rng_state=rng_state)


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("num_sms", [1, 10_000], ids=["whole_group_per_cta", "group_split_over_ctas"])
def test_gqa_group_reduction_paths(family, dtype, num_sms, monkeypatch):
    # Few SMs: one CTA sums the whole query-head group in registers; many SMs: the group is split
    # over CTAs whose float32 partials bwd_convert adds. Both must agree with the reference.
    monkeypatch.setattr(_backward_plan, "_num_sms", lambda device_id: num_sms)
    for heads in ((8, 2), (8, 1), (6, 3)):
        shape = _shape(2, 150, 200, heads[0], heads[1], 64)
        for deterministic in (False, True):
            solve(family, dtype, shape, {"causal": True}, 100 + heads[1], deterministic=deterministic)


# ----------------------------------------------------------------------------- layouts

def _views(x):
    """(name, view) pairs with x's values and other layouts."""
    B, S, H, D = x.shape
    bhsd = cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    wide = cupy.full((B, S, H, 2 * D), NAN, dtype=x.dtype)
    wide[..., ::2] = x
    padded = cupy.full((B, S + 9, H, D + 8), NAN, dtype=x.dtype)
    padded[:, :S, :, :D] = x
    return [("bhsd_transposed", bhsd), ("last_axis_strided", wide[..., ::2]),
            ("padded_rows_and_dim", padded[:, :S, :, :D])]


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_non_contiguous_dout_and_inputs(family, dtype):
    shape = _shape(2, 77, 143, 4, 2, 64)
    options = {"causal": True}
    skip_unsupported(family, shape["D"], options)
    q, k, v = tt.random_qkv(shape, dtype, 110, xp=cupy)
    dout = _random_like(q, 111)
    out, lse = _forward_reference(q, k, v, options, None)
    expected = run_backward(family, dout, q, k, v, out, lse, options, deterministic=True)
    check_gradients(dout, q, k, v, out, options, expected, dtype=dtype)
    for name, view in _views(dout):
        got = run_backward(family, view, q, k, v, out, lse, options, deterministic=True)
        for a, b in zip(got, expected):
            assert bool((a == b).all()), f"dout as {name} changed the gradients"
    # Every input strided at once, and dout broadcast from a single row (zero strides, as
    # torch's grad of out.sum() is).
    views = [_views(x)[0][1] for x in (q, k, v, out)]
    lse_view = cupy.ascontiguousarray(lse.transpose(0, 2, 1)).transpose(0, 2, 1)
    got = run_backward(family, _views(dout)[1][1], *views, lse_view, options, deterministic=True)
    for a, b in zip(got, expected):
        assert bool((a == b).all())
    ones = cupy.broadcast_to(cupy.ones((1, 1, 1, 64), dtype=q.dtype), q.shape)
    grads = run_backward(family, ones, q, k, v, out, lse, options)
    check_gradients(ones, q, k, v, out, options, grads, dtype=dtype)


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("head_dim", [36, 100, 250])
def test_head_dims_that_need_padding(family, dtype, head_dim):
    solve(family, dtype, _shape(2, 65, 97, 4, 2, head_dim), {"causal": True}, head_dim)


# ----------------------------------------------------------------------------- chain with the forward

@pytest.mark.parametrize("family, dtype", KERNELS)
def test_end_to_end_with_forward_kernels(family, dtype):
    shape = _shape(2, 200, 260, 4, 2, 128)
    q, k, v = tt.random_qkv(shape, dtype, 120, xp=cupy)
    dout = _random_like(q, 121)
    left_out = SkippedCases(family)
    for options in ({}, {"causal": True, "dropout_p": 0.3, "softcap": 10.0}):
        if not left_out.runs(shape["D"], options):
            continue
        out, lse, rng_state = cuflash.attention_forward(q, k, v, generator=cuflash.Generator(7), **options)
        grads = run_backward(family, dout, q, k, v, out, lse, options, rng_state=rng_state)
        check_gradients(dout, q, k, v, out, options, grads, dtype=dtype, rng_state=rng_state)
    left_out.report()


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_runs_on_the_current_stream(family, dtype):
    shape = _shape(2, 129, 129, 4, 4, 64)
    skip_unsupported(family, shape["D"], {})
    q, k, v = tt.random_qkv(shape, dtype, 130, xp=cupy)
    dout = _random_like(q, 131)
    out, lse = _forward_reference(q, k, v, {}, None)
    expected = run_backward(family, dout, q, k, v, out, lse, {}, deterministic=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        args = [x.copy() for x in (dout, q, k, v, out, lse)]
        with bw.force_kernel(family):
            got = bw.attention_backward(*args, deterministic=True)
    stream.synchronize()
    for a, b in zip(got, expected):
        assert bool((a == b).all())


# ----------------------------------------------------------------------------- varlen

@st.composite
def varlen_problems(draw, allow=tt.VARLEN_OPTIONS):
    cu_q, cu_k = draw(tt.varlen_seqlens(max_batch=4, max_seqlen=200))
    heads = draw(tt.gqa_heads(max_heads=4))
    D = draw(OPTION_HEAD_DIMS)
    shape = _shape(len(cu_q) - 1, max(1, int(np.diff(cu_q).max())), max(1, int(np.diff(cu_k).max())),
                   heads[0], heads[1], D)
    return dict(cu_q=cu_q, cu_k=cu_k, shape=shape, options=draw(tt.attention_options(shape, allow=allow)),
                seed=draw(st.integers(0, 2**62)), deterministic=draw(st.booleans()))


def _varlen_solve(family, dtype, cu_q, cu_k, shape, options, seed, deterministic, poison_neighbours=False):
    skip_unsupported(family, shape["D"], options)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q, k, v = tt.random_qkv(_shape(1, total_q, total_k, shape["Hq"], shape["Hk"], shape["D"]), dtype, seed,
                            xp=cupy)
    q, k, v = q[0], k[0], v[0]
    dout = _random_like(q, seed + 1)
    opts = tt.as_device_options(options, cupy)
    rng_state = np.array([seed % 2**64, 11], dtype=np.uint64) if opts.get("dropout_p", 0.0) > 0 else None
    ref_opts = dict(opts, **({"rng_state": rng_state} if rng_state is not None else {}))
    out64, lse64 = reference.attention_varlen(q, k, v, cu_q, cu_k, **ref_opts)
    out = cupy.asarray(np.nan_to_num(out64).astype(np.float32)).astype(q.dtype)
    lse = cupy.asarray(np.nan_to_num(lse64, nan=-np.inf, neginf=-np.inf).astype(np.float32))
    dq = cupy.full(q.shape, NAN, dtype=q.dtype)
    dk = cupy.full(k.shape, NAN, dtype=k.dtype)
    dv = cupy.full(v.shape, NAN, dtype=v.dtype)
    with bw.force_kernel(family):
        got = bw.attention_varlen_backward(dout, q, k, v, out, lse, cupy.asarray(cu_q), cupy.asarray(cu_k),
                                           rng_state=rng_state, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
                                           **opts)
    ref = reference_varlen_backward(dout, q, k, v, cu_q, cu_k, **ref_opts)
    stored = reference_varlen_backward(dout, q, k, v, cu_q, cu_k, out=out, **ref_opts)
    base = (baseline_varlen_backward(dout, q, k, v, out, cu_q, cu_k, **ref_opts) if dtype != "float32"
            else (None,) * 3)
    magnitude = _magnitude(*ref)
    for name, g, r, bl, st_ in zip(("dq", "dk", "dv"), got, ref, base, stored):
        assert g.data.ptr == (dq, dk, dv)[("dq", "dk", "dv").index(name)].data.ptr or g.size == 0
        assert_grad_close(g, r, bl, dtype, name, magnitude=magnitude, stored_out=st_)
    return got


@pytest.mark.parametrize("family, dtype", KERNELS)
@_capped(25)
@given(problem=varlen_problems())
def test_varlen_against_reference(family, dtype, problem):
    assume_supported(family, problem["shape"]["D"], problem["options"])
    _varlen_solve(family, dtype, problem["cu_q"], problem["cu_k"], problem["shape"], problem["options"],
                  problem["seed"], problem["deterministic"])


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("head_dim", [64, 256])
def test_varlen_empty_sequences_and_neighbours(family, dtype, head_dim):
    # Sequence 1 has no keys (its dq must be 0), sequence 2 no queries (its dk/dv must be 0).
    cu_q = np.array([0, 70, 150, 150, 320], dtype=np.int32)
    cu_k = np.array([0, 129, 129, 200, 263], dtype=np.int32)
    for deterministic in (False, True):
        dq, dk, dv = _varlen_solve(family, dtype, cu_q, cu_k, _shape(4, 170, 129, 4, 2, head_dim), {"causal": True},
                                   140, deterministic)
        assert not bool(dq[70:150].astype(cupy.float32).any())
        assert not bool(dk[129:200].astype(cupy.float32).any()) and not bool(dv[129:200].astype(cupy.float32).any())


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_one_visible_key_gives_the_stored_output_rounding(family, dtype):
    # Query row 0 of head 2 sees key 1 only; every other row sees nothing. The exact dq is 0 and a
    # kernel's dq is the rounding of the stored output carried through D (hypothesis found it, fp16
    # bwd_sm90, at 6.6x the baseline's error). Against the gradient with D from the stored output,
    # no extra slack: the kernel's dq must be that gradient.
    if dtype == "float32":
        pytest.skip("the stored output is float32: its rounding is below the float32 rule")
    shape = _shape(1, 2, 2, 8, 1, 32)
    mask = np.zeros((1, 8, 2, 2), dtype=bool)
    mask[0, 2, 0, 1] = True
    grads, _, (dout, q, k, v, out, _, opts, rng_state) = solve(
        family, dtype, shape, {"mask": mask, "dropout_p": 0.375}, 1294671)
    stored = reference_backward(dout, q, k, v, out=out, rng_state=rng_state, **opts)
    base = baseline_backward(dout, q, k, v, out, rng_state=rng_state, **opts)
    magnitude = _magnitude(*stored)
    for name, got, want, bl in zip(("dq", "dk", "dv"), grads, stored, base[:3]):
        assert_grad_close(got, want, bl, dtype, name, magnitude=magnitude)


# ----------------------------------------------------------------------------- API surface

@pytest.mark.parametrize("family, dtype", KERNELS)
def test_zero_size_inputs(family, dtype):
    skip_unsupported(family, 64, {"causal": True})
    dt = _dtype(dtype)
    for B, Sq, Sk in ((0, 5, 7), (2, 0, 7), (2, 5, 0)):
        q = cupy.ones((B, Sq, 4, 64), dtype=dt)
        k = cupy.ones((B, Sk, 2, 64), dtype=dt)
        lse = cupy.zeros((B, 4, Sq), dtype=cupy.float32)
        with bw.force_kernel(family):
            dq, dk, dv = bw.attention_backward(q, q, k, k, q, lse, causal=True)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
        for g in (dq, dk, dv):
            assert not bool(g.astype(cupy.float32).any())


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_argument_errors_come_before_any_launch(family, dtype):
    shape = _shape(1, 33, 40, 4, 2, 64)
    skip_unsupported(family, shape["D"], {})
    q, k, v = tt.random_qkv(shape, dtype, 150, xp=cupy)
    dout = _random_like(q, 151)
    out, lse = _forward_reference(q, k, v, {}, None)
    dq = cupy.full(q.shape, NAN, dtype=q.dtype)

    def call(**kw):
        args = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
        args.update({n: kw.pop(n) for n in list(kw) if n in args})
        with bw.force_kernel(family):
            return bw.attention_backward(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"],
                                         dq=dq, **kw)

    with pytest.raises(ValueError, match="rng_state"):
        call(dropout_p=0.3)
    with pytest.raises(ValueError, match="return_dbias"):
        call(return_dbias=True)
    with pytest.raises(ValueError, match="lse"):
        call(lse=lse[:, :, 1:])
    with pytest.raises(TypeError, match="lse"):
        call(lse=lse.astype(cupy.float64))
    with pytest.raises(TypeError, match="dout"):
        call(dout=dout.astype(cupy.float32 if dtype != "float32" else cupy.float16))
    with pytest.raises(ValueError, match="out"):
        call(out=out[:, 1:])
    with pytest.raises(TypeError, match="deterministic"):
        call(deterministic=1)
    with pytest.raises(ValueError, match="dk"):
        call(dk=cupy.empty((1, 40, 2, 63), dtype=q.dtype))
    assert bool(cupy.isnan(dq.astype(cupy.float32)).all()), "dq was written before an argument error"
    other = "bwd_sm80" if dtype == "float32" else "bwd_simt"   # a family that cannot run this dtype
    with pytest.raises(ValueError, match=other):
        with bw.force_kernel(other):
            bw.attention_backward(dout, q, k, v, out, lse)
    with pytest.raises(ValueError, match="family"):
        with bw.force_kernel("bwd_nonexistent"):
            pass


# ----------------------------------------------------------------------------- bwd_sm90

def _sm90_only(test):
    for mark in SM90_MARKS:
        test = mark(test)
    return test


def _assert_same_bits_every_run(first, run_again, *, runs):
    """``run_again()`` ``runs`` times: dq, dk, dv bitwise equal to ``first`` every time."""
    for run in range(runs):
        for name, a, b in zip(("dq", "dk", "dv"), first, run_again()):
            assert bool((a.view(cupy.uint8) == b.view(cupy.uint8)).all()), \
                f"deterministic=True changed bits of {name} on run {run + 2}"


@_sm90_only
@pytest.mark.parametrize("head_dim, causal", [(128, True), (128, False), (64, False)],
                         ids=["d128-causal", "d128", "d64"])
def test_sm90_deterministic_is_bitwise_reproducible_at_scale(head_dim, causal):
    # Long enough for many key blocks per CTA and many CTAs per kv head: any order that depends on
    # scheduling (atomics, a split GQA group summed out of order) would show in 20 runs.
    options = {"causal": True} if causal else {}
    skip_unsupported("bwd_sm90", head_dim, options)
    shape = _shape(2, 1000, 1000, 8, 2, head_dim)
    q, k, v = tt.random_qkv(shape, "bfloat16", 160 + head_dim, xp=cupy)
    dout = _random_like(q, 161 + head_dim)
    out, lse = _forward_reference(q, k, v, options, None)
    first = run_backward("bwd_sm90", dout, q, k, v, out, lse, options, deterministic=True)
    check_gradients(dout, q, k, v, out, options, first, dtype="bfloat16")
    _assert_same_bits_every_run(first, lambda: run_backward("bwd_sm90", dout, q, k, v, out, lse, options,
                                                              deterministic=True), runs=19)


@_sm90_only
@pytest.mark.parametrize("options, sq, sk, num_sms, dq", [
    ({}, 700, 900, None, "ordered"),
    ({}, 900, 500, None, "ordered"),
    ({}, 700, 900, 3, "ordered"),                         # fewer CTAs at once than key blocks (8)
    ({"causal": True}, 600, 1000, None, "ordered"),
    ({"causal": True}, 1000, 600, 3, "ordered"),
    ({"window": (200, 150)}, 900, 900, None, "ordered"),
    ({"window": (100, -1)}, 600, 600, None, "ordered"),   # bounded on the left only
    ({"window": (-1, 60)}, 600, 900, None, "ordered"),    # bounded on the right only
], ids=["full", "full-sq>sk", "full-3-sms", "causal", "causal-3-sms", "window", "left-window", "right-window"])
def test_sm90_ordered_dq(options, sq, sk, num_sms, dq, monkeypatch):
    # Deterministic dQ added in a fixed order (cuda_src/dq_order.cuh) at D = 128 with GQA, under
    # every window shape: chosen by the plan, gradients within the accuracy rule, the same bits on
    # every run. (num_sms only changes how the GQA group is split over CTAs.)
    if num_sms is not None:
        monkeypatch.setattr(_backward_plan, "_num_sms", lambda device_id: num_sms)
    _memo.clear_memo()   # plans remembered from other calls were made for the real SM count
    monkeypatch.setattr(_memo, "_memo", {})   # and none made here outlives the test
    shape = _shape(2, sq, sk, 8, 2, 128)
    q, k, v = tt.random_qkv(shape, "bfloat16", sq + 7 * sk, xp=cupy)
    dout = _random_like(q, sq + 7 * sk + 1)
    out, lse = _forward_reference(q, k, v, options, None)
    with bw.force_kernel("bwd_sm90"):
        planned = cuflash.plan(bw.attention_backward, dout, q, k, v, out, lse, deterministic=True, **options)
    assert planned.plan.info["dq"] == dq
    first = run_backward("bwd_sm90", dout, q, k, v, out, lse, options, deterministic=True)
    check_gradients(dout, q, k, v, out, options, first, dtype="bfloat16")
    _assert_same_bits_every_run(first, lambda: run_backward("bwd_sm90", dout, q, k, v, out, lse, options,
                                                              deterministic=True), runs=4)


@_sm90_only
def test_sm90_d64_deterministic_takes_the_dq_pass():
    shape = _shape(1, 300, 300, 4, 2, 64)
    q, k, v = tt.random_qkv(shape, "bfloat16", 190, xp=cupy)
    dout, out = _random_like(q, 191), _random_like(q, 192)
    lse = cupy.zeros((1, 4, 300), dtype=cupy.float32)
    with bw.force_kernel("bwd_sm90"):
        for deterministic, dq in ((True, "pass"), (False, "atomic")):
            planned = cuflash.plan(bw.attention_backward, dout, q, k, v, out, lse, deterministic=deterministic)
            assert planned.plan.info["dq"] == dq


@_sm90_only
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_ordered_dq_varlen(causal):
    # Sequences of different lengths in one call: each has its own key blocks, tiles and order.
    cu_q = np.array([0, 300, 310, 900, 1029], dtype=np.int32)
    cu_k = np.array([0, 520, 521, 1100, 1380], dtype=np.int32)
    shape = _shape(4, 600, 579, 4, 2, 128)
    def solve_once():
        return _varlen_solve("bwd_sm90", "bfloat16", cu_q, cu_k, shape, {"causal": causal}, 180, True)

    _assert_same_bits_every_run(solve_once(), solve_once, runs=4)


@_sm90_only
@pytest.mark.parametrize("head_dim", [128, 256])
def test_sm90_is_the_default_for_bf16(head_dim):
    shape = _shape(2, 256, 300, 8, 2, head_dim)
    q, k, v = tt.random_qkv(shape, "bfloat16", 170, xp=cupy)
    dout, out = _random_like(q, 171), _random_like(q, 172)
    lse = cupy.zeros((2, 8, 256), dtype=cupy.float32)
    for options in ({}, {"causal": True}):
        # cuflash.plan plans the call without launching; the plan records the family it chose.
        planned = cuflash.plan(bw.attention_backward, dout, q, k, v, out, lse, **options)
        assert planned.plan.info["family"] == "bwd_sm90", f"default backward with {options}"


@_sm90_only
def test_sm90_takes_80_row_query_tiles_on_long_rows():
    # D = 128 without a window: 80 query rows per step from BWD_SM90_WIDE_MIN_ROWS query rows, 64
    # below and with a causal mask or deterministic=True (nothing is launched: planning only).
    def query_tile(sq, **options):
        shape = _shape(1, sq, 256, 2, 2, 128)
        q, k, v = tt.random_qkv(shape, "bfloat16", 173, xp=cupy)
        dout, out = _random_like(q, 174), _random_like(q, 175)
        lse = cupy.zeros((1, 2, sq), dtype=cupy.float32)
        return planned_info("bwd_sm90", dout, q, k, v, out, lse, **options)["query_tile"]

    long = kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS
    assert query_tile(long) == 80 and query_tile(long - 1) == 64
    assert query_tile(long, causal=True) == query_tile(long, deterministic=True) == 64


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_dbias_with_one_key_and_dropout(family, dtype):
    # Hypothesis found it (fp16 bwd_sm90): one key, so every visible row has P = 1 and an exact dS
    # of 0; a mask, dropout and a broadcast bias, whose dbias sums every dS. What is left is D's
    # rounding from the stored output, which the rule allows for dbias as for dq, dk, dv.
    mask = np.zeros((1, 1, 14, 1), dtype=bool)
    mask[0, 0, [2, 3, 11, 13], 0] = True
    options = {"mask": mask, "bias": np.full((1, 1, 1, 1), -0.1245911, dtype=np.float32), "dropout_p": 0.1}
    solve(family, dtype, _shape(1, 14, 1, 1, 1, 32), options, 121, return_dbias=True)


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_causal_tail_pairs_block_major(family, dtype, deterministic, monkeypatch):
    # Causal passes read their grid's last pairs block by block (bwd_grid_place): bwd_sm90's dK/dV
    # pass and every family's dQ pass (deterministic mode); with one SM, ceil(2 x CTAs per SM /
    # blocks) of the 12 (24) pairs. Against the reference, and the same with no tail and with every
    # pair in it: dK/dV (and deterministic dQ) bitwise equal whatever the order.
    monkeypatch.setattr(_backward_plan, "_num_sms", lambda device_id: 1)
    shape = _shape(3, 200, 200, 8, 4, 64)
    grads, _, (dout, q, k, v, out, lse, opts, _) = solve(family, dtype, shape, {"causal": True}, 196,
                                                         deterministic=deterministic)
    info = planned_info(family, dout, q, k, v, out, lse, deterministic=deterministic, **opts)
    assert info["splits"] == 1 and info["tail_pairs"] < 12 and info["dq_tail_pairs"] < 24
    assert (info["tail_pairs"] > 0) == (info["family"] == "bwd_sm90")
    assert (info["dq_tail_pairs"] > 0) == (info["dq"] == "pass")
    _same_with_no_tail_and_all_tail(family, dtype, grads, (dout, q, k, v, out, lse, opts), deterministic,
                                    monkeypatch)


def _same_with_no_tail_and_all_tail(family, dtype, grads, problem, deterministic, monkeypatch):
    """The call of ``problem`` again with no pair and with every pair in the tail: against the
    reference, and dK/dV (and deterministic dQ) bitwise equal to ``grads``."""
    dout, q, k, v, out, lse, opts = problem
    for waves in (0, 100):
        monkeypatch.setattr(kernels.bwd_common, "BWD_TAIL_WAVES", waves)
        _memo.clear_memo()
        again = run_backward(family, dout, q, k, v, out, lse, opts, deterministic=deterministic)
        for name, a, b in zip(("dq", "dk", "dv"), grads, again):
            if name != "dq" or deterministic:
                same = (a.view(cupy.uint8) == b.view(cupy.uint8)).all()
                assert bool(same), f"{name} changed with {waves} waves"
        check_gradients(dout, q, k, v, out, opts, again, dtype=dtype)
    _memo.clear_memo()


@_sm90_only
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_causal_tail_pairs_key_block_major(head_dim, monkeypatch):
    # A causal grid whose last pairs (slot, sequence) start key block by key block (cta_place): with
    # 4 SMs and 3 key blocks, 3 of the 12 pairs (tail_pairs); then none, then all of them. Each CTA
    # must still take exactly one (key block, slot, sequence): against the reference, and dK/dV
    # (no atomics) bitwise the same in every order.
    monkeypatch.setattr(_backward_plan, "_num_sms", lambda device_id: 4)
    block_n = kernels.bwd_sm90.BWD_SM90_BLOCK_N[head_dim]
    shape = _shape(3, 3 * block_n - 20, 3 * block_n - 20, 8, 4, head_dim)
    grads, _, (dout, q, k, v, out, lse, opts, _) = solve("bwd_sm90", "bfloat16", shape, {"causal": True}, 195)
    info = planned_info("bwd_sm90", dout, q, k, v, out, lse, **opts)
    assert info["family"] == "bwd_sm90" and info["splits"] == 1 and info["tail_pairs"] == 3
    _same_with_no_tail_and_all_tail("bwd_sm90", "bfloat16", grads, (dout, q, k, v, out, lse, opts), False,
                                    monkeypatch)


@_sm90_only
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_dq_conversion_behind_the_kernel(head_dim, monkeypatch):
    # The dQ conversion runs as bwd_sm90's programmatic dependent: each of its CTAs waits for the
    # counted reductions of its (sequence, slot), not for the grid. More CTAs than SMs, the GQA
    # group split over CTAs (slots of one query head), against the reference with it and without.
    monkeypatch.setattr(_backward_plan, "_num_sms", lambda device_id: 10_000)
    shape = _shape(2, 600, 1100, 8, 2, head_dim)
    for behind in (True, False):
        monkeypatch.setattr(kernels.bwd_sm90, "BWD_CONVERT_BEHIND", behind)
        _memo.clear_memo()
        _, _, (dout, q, k, v, out, lse, opts, _) = solve("bwd_sm90", "bfloat16", shape, {}, 205 + behind)
        info = planned_info("bwd_sm90", dout, q, k, v, out, lse, **opts)
        assert info["convert_behind"] is behind and info["splits"] == 4
        # deterministic=True (the ordered dQ at D = 128, the dQ pass otherwise) and causal calls:
        # the conversion starts after the kernel.
        for others in ({"deterministic": True}, {"causal": True}):
            info = planned_info("bwd_sm90", dout, q, k, v, out, lse, **others, **opts)
            assert info["convert_behind"] is False, others
    _memo.clear_memo()


@_sm90_only
@pytest.mark.parametrize("head_dim, query_tile", [(64, 128), (128, 80), (128, 64), (256, 64)])
def test_sm90_variant_without_the_unseen_key_guard(head_dim, query_tile, monkeypatch):
    # Full attention at D = 64, 128 (80-row query tiles, here at every length, and 64-row ones) and
    # 256 takes the variant whose dS has no guard for P = 0; against the reference with it and
    # without, and calls with keys a row does not see keep the guard.
    for name in ("BWD_SM90_WIDE_MIN_ROWS", "BWD_SM90_WIDE_MIN_ROWS_GUARDED"):
        monkeypatch.setattr(kernels.bwd_sm90, name, 1 if query_tile == 80 else 1 << 30)
    shape = _shape(2, 300, 700, 8, 2, head_dim)
    for unguarded in (True, False):
        monkeypatch.setattr(kernels.bwd_sm90, "BWD_ALL_KEYS_SEEN", unguarded)
        _memo.clear_memo()
        _, _, (dout, q, k, v, out, lse, opts, _) = solve("bwd_sm90", "bfloat16", shape, {}, 215 + unguarded)
        info = planned_info("bwd_sm90", dout, q, k, v, out, lse, **opts)
        assert info["all_keys_seen"] is unguarded and info["query_tile"] == query_tile
        for others in ({"causal": True}, {"window": (64, 64)}, {"softcap": 20.0}):
            info = planned_info("bwd_sm90", dout, q, k, v, out, lse, **others, **opts)
            assert info["all_keys_seen"] is False, others
    _memo.clear_memo()


@_sm90_only
@pytest.mark.parametrize("head_dim, deterministic", [(64, False), (128, False), (128, True)])
def test_sm90_variant_with_the_guard_tile_by_tile(head_dim, deterministic, monkeypatch):
    # Under a causal mask or window, D = 64 and D = 128 (dQ in any order and ordered) decide dS's
    # guard for P = 0 tile by tile (tiles with a masked element, or rows past the end, keep it): against the
    # reference with it and without, several tiles per row and ragged ends. So does the softcap alone
    # from D = 128, on the plain tiles (BwdSm90Config::kSoftcapAlone: P^T from the capped scores, dS's
    # factor from P^T and lse); other score modifiers keep the guard everywhere.
    # (Short D = 64 walks otherwise take the persistent CTAs, which guard every tile:
    # test_sm90_persistent_ctas.)
    monkeypatch.setattr(kernels.bwd_sm90, "BWD_SM90_PERSISTENT_MAX_STEPS", -1)
    shape = _shape(2, 300, 700, 8, 2, head_dim)
    cases = [({"causal": True}, 231), ({"window": (150, 40)}, 233)]
    if head_dim == 128:
        cases += [({"causal": True, "softcap": 20.0}, 235), ({"window": (150, 40), "softcap": 5.0}, 237)]
    for tile_guard in (True, False):
        monkeypatch.setattr(kernels.bwd_sm90, "BWD_SM90_TILE_GUARD", tile_guard)
        _memo.clear_memo()
        for opts, seed in cases:
            _, _, (dout, q, k, v, out, lse, run_opts, _) = solve("bwd_sm90", "bfloat16", shape, opts,
                                                                 seed + tile_guard, deterministic=deterministic)
            info = planned_info("bwd_sm90", dout, q, k, v, out, lse, deterministic=deterministic, **run_opts)
            assert info["tile_guard"] is tile_guard and info["all_keys_seen"] is False, opts
        slopes = cupy.full(q.shape[2], 0.25, dtype=cupy.float32)
        info = planned_info("bwd_sm90", dout, q, k, v, out, lse, deterministic=deterministic, alibi_slopes=slopes,
                            **run_opts)
        assert info["tile_guard"] is False
    _memo.clear_memo()


@_sm90_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sm90_dq_tiles_stored_by_their_first_writer(dtype):
    # D = 128 self-attention on the plain 64-row tiles: the first dQ writer of each tile stores its
    # shares and the others add theirs (BwdSm90Config::kDqFirstStores), dq_accum left unzeroed. The
    # memory pool is handed NaN first, so that a tile with no first store would poison dQ: ragged ends,
    # a head dim below the compiled one, GQA (a CTA's several query heads), windows whose tiles have
    # few writers, the modifiers of the plain tiles, a grid of more CTAs than SMs (shapes kept small
    # for the float64 reference). Not square, or without a mask or window: dq_accum zeroed.
    cases = [(_shape(2, 300, 300, 8, 2, 128), {"causal": True}, 261),
             (_shape(2, 300, 300, 8, 2, 128), {"window": (150, 40)}, 263),
             (_shape(1, 640, 640, 4, 4, 96), {"causal": True}, 265),
             (_shape(2, 448, 448, 4, 4, 128), {"window": (-1, 64)}, 267),
             (_shape(2, 1152, 1152, 8, 8, 128), {"causal": True}, 269),   # 144 CTAs: more than SMs
             (_shape(1, 1536, 1536, 4, 2, 128), {"window": (256, 0)}, 271),
             (_shape(2, 520, 520, 4, 4, 128), {"causal": True, "softcap": 20.0}, 273),
             (_shape(1, 700, 700, 6, 2, 128), {"window": (0, 300)}, 275)]
    for shape, opts, seed in cases:
        junk = cupy.full(1 << 24, NAN, dtype=cupy.float32)   # 64 MiB of NaN back to the pool
        del junk
        _, _, (dout, q, k, v, out, lse, run_opts, _) = solve("bwd_sm90", dtype, shape, opts, seed)
        if shape["D"] != 128:   # 96 runs padded to 128: a call with copies, which cuflash.plan does not plan
            continue
        # At B = 1 the reference's lse comes Fortran-ordered: a copy, which cuflash.plan does not plan either.
        info = planned_info("bwd_sm90", dout, q, k, v, out, cupy.ascontiguousarray(lse), **run_opts)
        assert info["dq_first_stores"] is True, opts
    for shape, opts in ((_shape(2, 200, 330, 4, 4, 128), {"causal": True}), (_shape(2, 448, 448, 4, 4, 128), {})):
        _, _, (dout, q, k, v, out, lse, run_opts, _) = solve("bwd_sm90", dtype, shape, opts, 277)
        assert planned_info("bwd_sm90", dout, q, k, v, out, lse, **run_opts)["dq_first_stores"] is False, opts


@_sm90_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sm90_persistent_ctas(dtype, monkeypatch):
    # D = 64 under a causal mask or window, walks short enough: CTAs that stay and take key blocks
    # from a counter (BwdSm90Config::kPersistent), against the reference: ragged ends, GQA (a CTA's
    # several query heads), and a grid of more key blocks than SMs (each CTA takes several in turn,
    # its stage ring, dS^T tiles and place slots running on from block to block). Every such call
    # takes them at any length here (the rule's walk limit raised); a call without a mask does not.
    monkeypatch.setattr(kernels.bwd_sm90, "BWD_SM90_PERSISTENT_MAX_STEPS", 1e9)
    _memo.clear_memo()
    cases = [(_shape(2, 300, 700, 8, 2, 64), {"causal": True}, 241),
             (_shape(2, 300, 700, 8, 2, 64), {"window": (150, 40)}, 243),
             (_shape(1, 640, 640, 4, 4, 48), {"causal": True}, 245),
             (_shape(4, 1024, 1024, 16, 16, 64), {"causal": True}, 247),
             (_shape(3, 1536, 1536, 8, 4, 64), {"window": (256, 0)}, 249)]
    for shape, opts, seed in cases:
        _, _, (dout, q, k, v, out, lse, run_opts, _) = solve("bwd_sm90", dtype, shape, opts, seed)
        if shape["D"] != 64:   # 48 runs padded to 64: a call with copies, which cuflash.plan does not plan
            continue
        info = planned_info("bwd_sm90", dout, q, k, v, out, lse, **run_opts)
        assert info["persistent"] is True and info["tile_guard"] is False and info["convert_behind"] is False, opts
    info = planned_info("bwd_sm90", dout, q, k, v, out, lse)
    assert info["persistent"] is False
    _memo.clear_memo()


@_sm90_only
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("mod", ["softcap", "alibi", "block_mask"])
def test_sm90_one_modifier_in_place_on_the_plain_tiles(head_dim, dtype, mod):
    # From D = 128 the softcap, ALiBi or the block mask alone run on the plain tiles, the scores
    # modified in place (BwdSm90Config::kScoresInPlace; the softcap's factor 1 - tanh^2 recovered from
    # P and lse). Caps that saturate most scores (c = 2) and one that barely bends them (c = 50),
    # steep slopes, sparse blocks of odd sizes; causal, windowed and full, ragged ends; dQ in any order
    # and through the dQ pass.
    shape = _shape(2, 300, 700, 8, 2, head_dim)
    extra = {"softcap": ({"softcap": 2.0}, {"softcap": 50.0}, {"softcap": 5.0, "scale": 0.5}),
             "alibi": ({"alibi_slopes": _slopes(8)}, {"alibi_slopes": 4 * _slopes(8)}, {"alibi_slopes": _slopes(8)}),
             "block_mask": ({"block_mask": _mask((1, 8, 10, 11), 0.6, 31), "block_size": (32, 64)},
                            {"block_mask": _mask((2, 1, 38, 26), 0.5, 32), "block_size": (8, 27)},
                            {"block_mask": _mask((1, 1, 5, 6), 0.7, 33), "block_size": (64, 128)})}[mod]
    for i, (masks, more) in enumerate(zip(({"causal": True}, {"window": (150, 40)}, {}), extra)):
        solve("bwd_sm90", dtype, shape, {**masks, **more}, 241 + 7 * i + head_dim, deterministic=i == 1)
    assert kernels.bwd_sm90.bwd_sm90_featured(head_dim, features.score_mod_bits((mod,)), False) is False


@_sm90_only
def test_sm90_nan_in_a_key_no_row_before_it_sees():
    # Causal: a NaN in the last key's V reaches the gradients only through the row that sees it; the
    # rows of the same tiles before it keep finite dQ (dS = 0 exactly where P = 0, whatever dP is),
    # and the other keys finite dK. out and lse come from the clean V (the forward's P V would carry
    # 0 * NaN into the rows of the key's tile: documented), then V is poisoned for the backward.
    shape = _shape(1, 200, 200, 4, 4, 64)
    q, k, v = tt.random_qkv(shape, "bfloat16", 225, xp=cupy)
    dout = _random_like(q, 226)
    out, lse, _ = cuflash.attention_forward(q, k, v, causal=True)
    v[:, -1, :, 3] = NAN
    grads = run_backward("bwd_sm90", dout, q, k, v, out, lse, {"causal": True})
    dq, dk, dv = (g.astype(cupy.float32) for g in grads)
    assert bool(cupy.isfinite(dq[:, :-1]).all()) and bool(cupy.isfinite(dk[:, :-1]).all())
    assert bool(cupy.isfinite(dv).all())
    assert bool(cupy.isnan(dq[:, -1]).any()) and bool(cupy.isnan(dk[:, -1]).any())


@pytest.mark.skipif(IS_SM90, reason="this GPU is sm_90")
@pytest.mark.skipif("bwd_sm90" not in bw.FAMILIES, reason="bwd_sm90 is not in cuflash.backward.FAMILIES")
def test_sm90_forced_on_another_gpu_raises():
    q, k, v = tt.random_qkv(_shape(1, 33, 40, 4, 2, 64), "bfloat16", 190, xp=cupy)
    lse = cupy.zeros((1, 4, 33), dtype=cupy.float32)
    with bw.force_kernel("bwd_sm90"):
        with pytest.raises(ValueError, match="bwd_sm90"):
            bw.attention_backward(q, q, k, v, q, lse)
