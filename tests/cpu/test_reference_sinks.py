"""Attention sinks in the float64 reference (issue 53): the row's denominator gains exp(sinks[h]),
no value goes with it, lse holds it; checked against the same attention written with an extra key
of value 0 whose score is the sink (through a bias), forward and backward (dsinks = that key's
dbias), against finite differences, and for varlen against per-sequence calls."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cuflash import reference


def _problem(rng, B=2, Sq=5, Sk=7, Hq=4, Hk=2, D=8):
    q, dout = rng.standard_normal((B, Sq, Hq, D)), rng.standard_normal((B, Sq, Hq, D))
    k, v = rng.standard_normal((B, Sk, Hk, D)), rng.standard_normal((B, Sk, Hk, D))
    return q, k, v, dout, rng.uniform(-2, 2, Hq)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), causal=st.booleans(), sq=st.integers(1, 6), sk=st.integers(1, 8))
def test_a_sink_is_a_key_of_value_zero_scored_by_the_sink(seed, causal, sq, sk):
    rng = np.random.default_rng(seed)
    q, k, v, dout, sinks = _problem(rng, Sq=sq, Sk=sk)
    B, Sq, Hq, _ = q.shape
    Hk = k.shape[2]
    # The extra key goes first: k = 0 (score 0 before the bias), v = 0, bias = the sink. With a
    # bottom-right causal mask every row sees key 0 of the longer set, as a sink is always seen.
    k1 = np.concatenate([np.zeros((B, 1, Hk, k.shape[3])), k], axis=1)
    v1 = np.concatenate([np.zeros((B, 1, Hk, v.shape[3])), v], axis=1)
    bias = np.zeros((1, Hq, 1, sk + 1))
    bias[0, :, 0, 0] = sinks
    visible = np.ones((1, 1, Sq, sk + 1), dtype=bool)
    if causal:   # the real keys keep their own causal pattern; the sink column stays visible
        i, j = np.arange(Sq)[:, None], np.arange(sk)[None, :]
        visible[0, 0, :, 1:] = j <= i + sk - Sq
    out, lse = reference.attention_forward(q, k, v, causal=causal, sinks=sinks)
    want_out, want_lse = reference.attention_forward(q, k1, v1, bias=bias, mask=visible)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10, atol=1e-12)
    dq, dk, dv, dsinks = reference.attention_backward(dout, q, k, v, causal=causal, sinks=sinks, return_dsinks=True)
    wq, wk, wv, wbias = reference.attention_backward(dout, q, k1, v1, bias=bias, mask=visible, return_dbias=True)
    for got, want in ((dq, wq), (dk, wk[:, 1:]), (dv, wv[:, 1:]), (dsinks, wbias[0, :, 0, 0])):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


def test_dsinks_match_finite_differences_and_minus_infinity_is_no_sink():
    rng = np.random.default_rng()
    q, k, v, dout, sinks = _problem(rng)
    loss = lambda s: np.sum(reference.attention_forward(q, k, v, causal=True, sinks=s)[0] * dout)  # noqa: E731
    _, _, _, dsinks = reference.attention_backward(dout, q, k, v, causal=True, sinks=sinks, return_dsinks=True)
    step = 1e-6
    for h in range(len(sinks)):
        e = np.zeros_like(sinks)
        e[h] = step
        assert abs((loss(sinks + e) - loss(sinks - e)) / (2 * step) - dsinks[h]) < 1e-6 * (1 + abs(dsinks[h]))
    none = np.full_like(sinks, -np.inf)
    for a, b in zip(reference.attention_forward(q, k, v, sinks=none), reference.attention_forward(q, k, v)):
        np.testing.assert_array_equal(a, b)
    grads = reference.attention_backward(dout, q, k, v, sinks=none, return_dsinks=True)
    assert np.array_equal(grads[3], np.zeros_like(sinks))
    for a, b in zip(grads[:3], reference.attention_backward(dout, q, k, v)):
        np.testing.assert_array_equal(a, b)


def test_a_row_that_sees_no_key_gives_zero_and_lse_the_sink():
    rng = np.random.default_rng()
    q, k, v, _, sinks = _problem(rng, Sq=9, Sk=4)
    out, lse = reference.attention_forward(q, k, v, causal=True, sinks=sinks)   # rows 0..4 see no key
    assert np.all(out[:, :5] == 0) and np.allclose(lse[:, :, :5], sinks[None, :, None])


def test_varlen_sinks_equal_per_sequence_calls():
    rng = np.random.default_rng()
    cu = np.array([0, 3, 3, 10])
    q, k, v, dout = (rng.standard_normal((10, 4, 8)) for _ in range(4))
    k, v = k[:, :2], v[:, :2]
    sinks = rng.uniform(-1, 1, 4)
    out, lse = reference.attention_varlen(q, k, v, cu, cu, causal=True, sinks=sinks)
    dq, dk, dv, dsinks = reference.attention_varlen_backward(dout, q, k, v, cu, cu, causal=True, sinks=sinks,
                                                             return_dsinks=True)
    total = np.zeros(4)
    for lo, hi in ((0, 3), (3, 10)):
        o, l = reference.attention_forward(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], causal=True, sinks=sinks)
        np.testing.assert_allclose(out[lo:hi], o[0], rtol=1e-12)
        np.testing.assert_allclose(lse[:, lo:hi], l[0], rtol=1e-12)
        g = reference.attention_backward(dout[None, lo:hi], q[None, lo:hi], k[None, lo:hi], v[None, lo:hi],
                                         causal=True, sinks=sinks, return_dsinks=True)
        np.testing.assert_allclose(dq[lo:hi], g[0][0], rtol=1e-10, atol=1e-12)
        total += g[3]
    np.testing.assert_allclose(dsinks, total, rtol=1e-10, atol=1e-12)


def test_sinks_are_checked():
    rng = np.random.default_rng()
    q, k, v, dout, sinks = _problem(rng)
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
        reference.attention_forward(q, k, v, sinks=sinks[:3])
    with pytest.raises(ValueError, match="return_dsinks=True needs sinks"):
        reference.attention_backward(dout, q, k, v, return_dsinks=True)


def test_decode_sinks_equal_attention_over_the_gathered_keys():
    rng = np.random.default_rng()
    k_cache, v_cache = rng.standard_normal((2, 12, 2, 8)), rng.standard_normal((2, 12, 2, 8))
    q, sinks = rng.standard_normal((2, 3, 4, 8)), rng.uniform(-1, 1, 4)
    lens = np.array([5, 12])
    out, lse = reference.decode(q, k_cache, v_cache, cache_seqlens=lens, sinks=sinks)
    for b in range(2):
        keys = slice(0, lens[b])
        o, l = reference.attention_forward(q[b:b + 1], k_cache[b:b + 1, keys], v_cache[b:b + 1, keys], causal=True,
                                           sinks=sinks)
        np.testing.assert_allclose(out[b], o[0], rtol=1e-12)
        np.testing.assert_allclose(lse[b], l[0], rtol=1e-12)
