"""The float64 analytic backward (cuflash.reference.attention_backward) against central finite differences
of the float64 forward reference (cuflash.reference.attention_forward). CPU only.

The loss is L = sum(out * dout) for a fixed random dout, so dL/dx is exactly what
attention_backward(dout, ...) returns. Central differences with step h = 1e-6 in float64 are
accurate to about 1e-9 on these O(1) quantities; the analytic gradients must agree to 1e-6
(relative) + 1e-7 (absolute). Shapes are tiny (the differences cost two forward calls per input
element) but cover every option and their combination, GQA/MQA, Sq != Sk, rows that see no key,
and dropout with a fixed rng_state (the forward is then a deterministic, smooth function).
"""

import subprocess
import sys

import numpy as np
import pytest

from cuflash import reference
from cuflash.reference import attention_backward, attention_varlen_backward

RTOL, ATOL, STEP = 1e-6, 1e-7, 1e-6


def _data(B, Sq, Sk, Hq, Hk, D, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Sq, Hq, D))
    k = rng.standard_normal((B, Sk, Hk, D))
    v = rng.standard_normal((B, Sk, Hk, D))
    dout = rng.standard_normal((B, Sq, Hq, D))
    return q, k, v, dout


def _finite_difference(loss, x):
    """Central differences of the scalar function ``loss`` at every element of ``x``."""
    grad = np.zeros(x.shape)
    for index in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += STEP
        minus[index] -= STEP
        grad[index] = (loss(plus) - loss(minus)) / (2 * STEP)
    return grad


def _check_against_differences(q, k, v, dout, options):
    opts = dict(options)
    bias = opts.pop("bias", None)

    def loss(qq=q, kk=k, vv=v, bb=bias):
        out, _ = reference.attention_forward(qq, kk, vv, bias=bb, **opts)
        return float(np.sum(out * dout))

    want_dbias = bias is not None
    grads = attention_backward(dout, q, k, v, bias=bias, return_dbias=want_dbias, **opts)
    checks = [("dq", grads[0], _finite_difference(lambda x: loss(qq=x), q)),
              ("dk", grads[1], _finite_difference(lambda x: loss(kk=x), k)),
              ("dv", grads[2], _finite_difference(lambda x: loss(vv=x), v))]
    if want_dbias:
        checks.append(("dbias", grads[3], _finite_difference(lambda x: loss(bb=x), np.asarray(bias, float))))
    for name, analytic, numeric in checks:
        assert analytic.shape == numeric.shape, name
        np.testing.assert_allclose(analytic, numeric, rtol=RTOL, atol=ATOL, err_msg=name)
    return grads


def _slopes(h):
    return (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)


# (name, shape (B, Sq, Sk, Hq, Hk, D), options)
CASES = [
    ("plain", (2, 3, 5, 2, 2, 3), {}),
    ("gqa", (1, 4, 4, 4, 2, 3), {}),
    ("mqa", (1, 3, 4, 3, 1, 2), {}),
    ("scale", (1, 3, 4, 2, 1, 3), {"scale": 0.7}),
    ("causal_sq_lt_sk", (1, 3, 6, 2, 1, 3), {"causal": True}),
    ("causal_sq_gt_sk", (1, 6, 3, 2, 1, 3), {"causal": True}),            # rows 0..2 see no key
    ("window", (1, 5, 5, 2, 1, 3), {"window": (1, 1)}),
    ("window_causal", (1, 5, 6, 2, 2, 2), {"window": (2, 3), "causal": True}),
    ("softcap", (1, 3, 4, 2, 1, 3), {"softcap": 0.8, "scale": 1.5}),
    ("alibi_h", (2, 3, 4, 2, 1, 3), {"alibi_slopes": _slopes(2)}),
    ("alibi_bh", (2, 3, 4, 2, 1, 3), {"alibi_slopes": np.array([[0.5, 0.1], [0.2, 0.9]], np.float32)}),
    ("mask_with_empty_row", (1, 4, 5, 2, 1, 3),
     {"mask": np.array([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 0, 1, 1], [0, 1, 1, 0, 1]], bool)}),
    ("bias_full", (2, 3, 4, 2, 1, 3), {"bias": np.random.default_rng(1).standard_normal((2, 2, 3, 4))}),
    ("bias_per_key", (2, 3, 4, 2, 1, 3), {"bias": np.random.default_rng(2).standard_normal((2, 1, 1, 4))}),
    ("bias_2d", (2, 3, 4, 2, 1, 3), {"bias": np.random.default_rng(3).standard_normal((3, 4))}),
    ("bias_per_row", (1, 3, 4, 2, 1, 3), {"bias": np.random.default_rng(4).standard_normal((1, 2, 3, 1))}),
    ("block_mask", (1, 4, 6, 2, 1, 3),
     {"block_mask": np.array([[1, 0, 1], [0, 1, 1]], bool), "block_size": (2, 2)}),
    ("dropout", (2, 3, 5, 2, 1, 3), {"dropout_p": 0.4, "rng_state": (1234, 7)}),
    ("dropout_gqa_causal", (1, 4, 4, 4, 2, 2), {"dropout_p": 0.25, "rng_state": (2**40 + 3, 2), "causal": True}),
    ("everything", (2, 4, 5, 4, 2, 3),
     {"causal": True, "window": (3, -1), "softcap": 2.0, "alibi_slopes": _slopes(4),
      "mask": np.random.default_rng(5).random((1, 1, 4, 5)) < 0.8,
      "bias": np.random.default_rng(6).standard_normal((2, 1, 4, 5)),
      "block_mask": np.array([[[[True, True, False]]]]), "block_size": (4, 2),
      "dropout_p": 0.2, "rng_state": (99, 1)}),
]


@pytest.mark.parametrize("name, shape, options", CASES, ids=[c[0] for c in CASES])
def test_gradients_match_finite_differences(name, shape, options):
    q, k, v, dout = _data(*shape, seed=len(name))
    _check_against_differences(q, k, v, dout, options)


def test_rows_that_see_no_key_have_zero_gradients():
    q, k, v, dout = _data(1, 6, 3, 2, 1, 4, seed=10)
    dq, dk, dv = attention_backward(dout, q, k, v, causal=True)      # rows 0..2 see nothing
    assert np.all(dq[:, :3] == 0)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    # Removing those rows changes no key gradient.
    dq2, dk2, dv2 = attention_backward(dout[:, 3:], q[:, 3:], k, v, causal=True)
    np.testing.assert_allclose(dk, dk2, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dv, dv2, rtol=1e-12, atol=1e-14)
    dq3, dk3, dv3 = attention_backward(dout, q, k, v, mask=np.zeros((1, 1), bool))
    assert not dq3.any() and not dk3.any() and not dv3.any()


def test_nan_that_no_row_sees_does_not_leak():
    q, k, v, dout = _data(1, 4, 4, 2, 1, 3, seed=11)
    mask = np.array([True, True, True, False])                 # key 3 is hidden from every row
    clean = attention_backward(dout, q, k, v, causal=True, mask=mask)
    k[0, 3], v[0, 3] = np.nan, np.nan
    got = attention_backward(dout, q, k, v, causal=True, mask=mask)
    for a, b in zip(got, clean):
        np.testing.assert_array_equal(a, b)
    assert not got[1][:, 3].any() and not got[2][:, 3].any()
    # Seen by row 3 only (causal): rows 0..2 keep their gradient, row 3 turns NaN.
    dq, _, _ = attention_backward(dout, q, k, v, causal=True)
    dq_finite, _, _ = attention_backward(dout, q, np.nan_to_num(k), np.nan_to_num(v), causal=True)
    np.testing.assert_array_equal(dq[:, :3], dq_finite[:, :3])
    assert np.isnan(dq[:, 3]).all()


def test_dsum_identity_and_linearity_in_dout():
    q, k, v, dout = _data(2, 5, 7, 4, 2, 3, seed=12)
    a = attention_backward(dout, q, k, v, causal=True)
    b = attention_backward(2.5 * dout, q, k, v, causal=True)
    for x, y in zip(a, b):
        np.testing.assert_allclose(2.5 * x, y, rtol=1e-12, atol=1e-14)


def test_gqa_sums_over_the_group():
    q, k, v, dout = _data(1, 4, 5, 4, 2, 3, seed=13)
    dq, dk, dv = attention_backward(dout, q, k, v)
    kr, vr = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
    dq_r, dk_r, dv_r = attention_backward(dout, q, kr, vr)
    np.testing.assert_allclose(dq, dq_r, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dk, dk_r.reshape(1, 5, 2, 2, 3).sum(3), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dv, dv_r.reshape(1, 5, 2, 2, 3).sum(3), rtol=1e-12, atol=1e-14)


def test_varlen_matches_per_sequence_batches():
    rng = np.random.default_rng(14)
    cu_q = np.array([0, 3, 3, 7], np.int32)
    cu_k = np.array([0, 4, 6, 6], np.int32)        # sequence 1 has no queries, 2 no keys
    q, k, v = rng.standard_normal((7, 4, 3)), rng.standard_normal((6, 2, 3)), rng.standard_normal((6, 2, 3))
    dout = rng.standard_normal((7, 4, 3))
    slopes = rng.uniform(0, 1, (3, 4)).astype(np.float32)
    opts = dict(causal=True, softcap=3.0, dropout_p=0.3, rng_state=(5, 6))
    dq, dk, dv = attention_varlen_backward(dout, q, k, v, cu_q, cu_k, alibi_slopes=slopes, **opts)
    assert not dk[4:6].any() and not dv[4:6].any()   # keys of a sequence without queries
    assert not dq[3:7].any()                          # queries of a sequence without keys
    rows, keys = slice(0, 3), slice(0, 4)
    one = attention_backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                             alibi_slopes=slopes[0], **opts)       # batch index 0, as in varlen
    np.testing.assert_allclose(dq[rows], one[0][0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dk[keys], one[1][0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dv[keys], one[2][0], rtol=1e-12, atol=1e-14)


def test_varlen_against_finite_differences():
    rng = np.random.default_rng(15)
    cu_q = np.array([0, 2, 5], np.int32)
    cu_k = np.array([0, 3, 5], np.int32)
    q, k, v = rng.standard_normal((5, 2, 2)), rng.standard_normal((5, 1, 2)), rng.standard_normal((5, 1, 2))
    dout = rng.standard_normal((5, 2, 2))
    opts = dict(causal=True, dropout_p=0.3, rng_state=(3, 4), alibi_slopes=np.array([0.2, 0.7], np.float32))

    def loss(qq=q, kk=k, vv=v):
        out, _ = reference.attention_varlen(qq, kk, vv, cu_q, cu_k, **opts)
        return float(np.sum(out * dout))

    dq, dk, dv = attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **opts)
    np.testing.assert_allclose(dq, _finite_difference(lambda x: loss(qq=x), q), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dk, _finite_difference(lambda x: loss(kk=x), k), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dv, _finite_difference(lambda x: loss(vv=x), v), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("options", [dict(causal=True), dict(sinks=np.array([0.3, -1.0], np.float32)),
                                     dict(softcap=1.5, dropout_p=0.3, rng_state=(5, 6))],
                         ids=["causal-with-empty-rows", "sinks", "softcap-dropout"])
def test_a_loss_that_reads_lse(options):
    """L = sum(out * dout) + sum(lse * dlse): dlse joins D (dS = P (dP - D + dlse)), dsinks included."""
    q, k, v, dout = _data(1, 5, 3, 2, 1, 3, seed=21)   # causal: rows 0 and 1 see no key (lse -inf)
    dlse = np.random.default_rng(22).standard_normal((1, 2, 5))
    sinks = options.get("sinks")
    opts = {key: value for key, value in options.items() if key != "sinks"}

    def loss(qq=q, kk=k, vv=v, ss=sinks):
        out, lse = reference.attention_forward(qq, kk, vv, sinks=ss, **opts)
        return float(np.sum(out * dout) + np.sum(np.where(np.isneginf(lse), 0.0, lse) * dlse))

    grads = attention_backward(dout, q, k, v, dlse=dlse, sinks=sinks, return_dsinks=sinks is not None, **opts)
    checks = [("dq", grads[0], _finite_difference(lambda x: loss(qq=x), q)),
              ("dk", grads[1], _finite_difference(lambda x: loss(kk=x), k)),
              ("dv", grads[2], _finite_difference(lambda x: loss(vv=x), v))]
    if sinks is not None:
        checks.append(("dsinks", grads[3], _finite_difference(lambda x: loss(ss=x), sinks.astype(np.float64))))
    for name, analytic, numeric in checks:
        np.testing.assert_allclose(analytic, numeric, rtol=RTOL, atol=ATOL, err_msg=name)
    without = attention_backward(dout, q, k, v, sinks=sinks, **opts)
    assert np.abs(grads[0] - without[0]).max() > 1e-3, "dlse changed nothing"


def test_varlen_with_a_loss_that_reads_lse():
    rng = np.random.default_rng(23)
    cu_q, cu_k = np.array([0, 2, 5], np.int32), np.array([0, 3, 5], np.int32)
    q, k, v = rng.standard_normal((5, 2, 2)), rng.standard_normal((5, 1, 2)), rng.standard_normal((5, 1, 2))
    dout, dlse = rng.standard_normal((5, 2, 2)), rng.standard_normal((2, 5))

    def loss(qq=q, kk=k, vv=v):
        out, lse = reference.attention_varlen(qq, kk, vv, cu_q, cu_k, causal=True)
        return float(np.sum(out * dout) + np.sum(np.where(np.isneginf(lse), 0.0, lse) * dlse))

    dq, dk, dv = attention_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=True, dlse=dlse)
    np.testing.assert_allclose(dq, _finite_difference(lambda x: loss(qq=x), q), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dk, _finite_difference(lambda x: loss(kk=x), k), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dv, _finite_difference(lambda x: loss(vv=x), v), rtol=RTOL, atol=ATOL)


def test_stored_output_moves_only_d():
    # D from the exact output is the exact D; D from a perturbed output shifts dS by -P * dD, which
    # moves dq and dk and leaves dv alone.
    q, k, v, dout = _data(2, 5, 7, 4, 2, 3, seed=18)
    opts = dict(causal=True, dropout_p=0.25, rng_state=(7, 8))
    exact = attention_backward(dout, q, k, v, **opts)
    out, _ = reference.attention_forward(q, k, v, **opts)
    for a, b in zip(exact, attention_backward(dout, q, k, v, out=out, **opts)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    nudged = attention_backward(dout, q, k, v, out=out + 1e-3, **opts)
    np.testing.assert_array_equal(nudged[2], exact[2])
    assert np.abs(nudged[0] - exact[0]).max() > 1e-6 and np.abs(nudged[1] - exact[1]).max() > 1e-6
    rows = slice(0, 5)
    varlen = attention_varlen_backward(dout[0], q[0], k[0], v[0], np.array([0, 5]), np.array([0, 7]),
                                       out=out[0] + 1e-3, **opts)
    np.testing.assert_allclose(varlen[0], nudged[0][0, rows], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="out must have the shape"):
        attention_backward(dout, q, k, v, out=out[:, :2], **opts)


def test_low_precision_inputs_are_upcast():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v, dout = _data(1, 3, 4, 2, 1, 8, seed=16)
    lowp = [x.astype(ml_dtypes.bfloat16) for x in (dout, q, k, v)]
    got = attention_backward(*lowp, causal=True)
    want = attention_backward(*(x.astype(np.float64) for x in lowp), causal=True)
    for a, b in zip(got, want):
        assert a.dtype == np.float64
        np.testing.assert_array_equal(a, b)


def test_argument_errors():
    q, k, v, dout = _data(1, 3, 4, 2, 1, 3, seed=17)
    with pytest.raises(ValueError, match="return_dbias"):
        attention_backward(dout, q, k, v, return_dbias=True)
    with pytest.raises(ValueError, match="rng_state"):
        attention_backward(dout, q, k, v, dropout_p=0.5)
    with pytest.raises(ValueError, match="dout"):
        attention_backward(dout[:, :2], q, k, v)


@pytest.mark.parametrize("first", ["cuflash.reference._backward", "cuflash.reference._forward", "cuflash.reference"])
def test_any_reference_module_imports_first(first):
    # The backward builds on the forward, and the package re-exports both: in a fresh interpreter
    # any of them may be imported first.
    code = f"import {first}; from cuflash.reference import attention_backward; print(attention_backward.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "attention_backward"
