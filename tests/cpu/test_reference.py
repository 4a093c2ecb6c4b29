"""The float64 reference against a textbook per-row loop, and the cuflash.testing tools."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cuflash import reference, testing
from cuflash.random import dropout_keep

# The reference promises no RuntimeWarning (0/0, log(0), inf - inf) for masked rows or NaNs.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def textbook(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0,
             alibi_slopes=None, mask=None, bias=None, block_mask=None, block_size=(128, 128),
             dropout_p=0.0, rng_state=None, batch_ids=None):
    """Attention one query row at a time, straight from the definitions."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    B, Sq, Hq, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(D) if scale is None else scale
    batch_ids = range(B) if batch_ids is None else batch_ids
    out = np.zeros((B, Sq, Hq, v.shape[3]))
    lse = np.full((B, Hq, Sq), -np.inf)
    full = (B, Hq, Sq, Sk)
    j = np.arange(Sk)
    for b in range(B):
        for h in range(Hq):
            kv = h // (Hq // Hk)
            for i in range(Sq):
                diag = i + Sk - Sq
                s = scale * (k[b, :, kv, :] @ q[b, i, h, :])
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                if alibi_slopes is not None:
                    slope = alibi_slopes[h] if np.ndim(alibi_slopes) == 1 \
                        else alibi_slopes[b, h]
                    s = s - slope * np.abs(diag - j)
                if bias is not None:
                    s = s + np.broadcast_to(bias, full)[b, h, i]
                sees = np.ones(Sk, dtype=bool)
                if causal:
                    sees &= j <= diag
                if window is not None:
                    left, right = window
                    if left >= 0:
                        sees &= j >= diag - left
                    if right >= 0:
                        sees &= j <= diag + right
                if mask is not None:
                    sees &= np.broadcast_to(mask, full)[b, h, i]
                if block_mask is not None:
                    bq, bk = block_size
                    nb = (B, Hq, -(-Sq // bq), -(-Sk // bk))
                    sees &= np.broadcast_to(block_mask, nb)[b, h, i // bq][j // bk]
                js = j[sees]
                if js.size == 0:
                    continue
                m = np.max(s[js])
                e = np.exp(s[js] - m)
                lse[b, h, i] = m + np.log(e.sum())
                p = e / e.sum()
                if dropout_p > 0:
                    keep = dropout_keep(*rng_state, dropout_p, batch_ids[b], h, i, js, Hq)
                    p = np.where(keep, p / (1 - dropout_p), 0.0)
                out[b, i, h] = p @ v[b, js, kv, :]
    return out, lse


def qkv(B=2, Sq=5, Sk=7, Hq=4, Hk=2, D=8, seed=0, dtype="float64"):
    return testing.random_qkv(dict(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hk=Hk, D=D), dtype, seed)


def assert_same(a, b, rtol=1e-12, atol=1e-12):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)


# ----------------------------------------------------------------------------- vs textbook

small_shapes = testing.attention_shapes(max_batch=2, max_seqlen=70, max_heads=4,
                                        head_dims=st.sampled_from([4, 8, 16]),
                                        max_scores=2**14)


@given(data=st.data(), shape=small_shapes, seed=st.integers(0, 2**32 - 1))
def test_reference_equals_textbook(data, shape, seed):
    opts = data.draw(testing.attention_options(shape))
    if opts.get("dropout_p"):
        opts["rng_state"] = np.array([seed, seed % 1000], dtype=np.uint64)
    q, k, v = testing.random_qkv(shape, "float64", seed)
    out, lse = reference.attention_forward(q, k, v, **opts)
    want_out, want_lse = textbook(q, k, v, **opts)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert out.dtype == lse.dtype == np.float64
    assert_same(out, want_out)
    assert_same(lse, want_lse)


def test_causal_is_bottom_right_aligned():
    q, k, _ = qkv(B=1, Sq=3, Sk=5, Hq=1, Hk=1)
    s = reference.attention_scores(q, k, causal=True)[0, 0]
    assert (np.isfinite(s) == (np.arange(5)[None, :] <= np.arange(3)[:, None] + 2)).all()
    # Sq > Sk: the first Sq - Sk rows see no key.
    q, k, v = qkv(B=1, Sq=5, Sk=3, Hq=1, Hk=1)
    out, lse = reference.attention_forward(q, k, v, causal=True)
    assert (out[0, :2] == 0).all() and (lse[0, 0, :2] == -np.inf).all()
    assert np.allclose(out[0, 2, 0], v[0, 0, 0])  # row 2 sees key 0 only
    assert np.isfinite(lse[0, 0, 2:]).all()


def test_window():
    q, k, _ = qkv(B=1, Sq=6, Sk=8, Hq=1, Hk=1)
    i, j = np.arange(6)[:, None], np.arange(8)[None, :]
    diag = i + 2
    s = reference.attention_scores(q, k, window=(1, 2))[0, 0]
    assert (np.isfinite(s) == ((j >= diag - 1) & (j <= diag + 2))).all()
    s = reference.attention_scores(q, k, window=(-1, 0))[0, 0]
    causal = reference.attention_scores(q, k, causal=True)[0, 0]
    assert (np.isfinite(s) == np.isfinite(causal)).all()
    # causal caps the right side at 0; -1 on the left stays unbounded
    for window, same_as in [((2, 3), (2, 0)), ((2, -1), (2, 0)), ((-1, -1), (-1, 0))]:
        a = reference.attention_scores(q, k, causal=True, window=window)
        assert_same(a, reference.attention_scores(q, k, window=same_as))
    assert_same(reference.attention_scores(q, k, window=(-1, -1)), reference.attention_scores(q, k))


def test_gqa_equals_repeated_kv_heads():
    q, k, v = qkv(Hq=6, Hk=2)
    out, lse = reference.attention_forward(q, k, v, causal=True)
    k3, v3 = np.repeat(k, 3, axis=2), np.repeat(v, 3, axis=2)
    out3, lse3 = reference.attention_forward(q, k3, v3, causal=True)
    assert_same(out, out3)
    assert_same(lse, lse3)
    # head h uses kv head h // 3
    solo, _ = reference.attention_forward(q[:, :, 4:5], k[:, :, 1:2], v[:, :, 1:2], causal=True)
    assert_same(out[:, :, 4:5], solo)


def test_fully_masked_rows():
    q, k, v = qkv(B=2, Sq=5, Sk=7, Hq=2, Hk=1)
    mask = np.ones((2, 1, 5, 7), dtype=bool)
    mask[1, 0, 3] = False
    bias = np.zeros((1, 2, 5, 7))
    bias[0, 1, 2] = -np.inf  # -inf scores hide keys just like a mask
    out, lse = reference.attention_forward(q, k, v, mask=mask, bias=bias)
    assert (out[1, 3] == 0).all() and (lse[1, :, 3] == -np.inf).all()
    assert (out[:, 2, 1] == 0).all() and (lse[:, 1, 2] == -np.inf).all()  # bias: both batches
    assert np.isfinite(out).all()
    assert np.isfinite(lse).sum() == lse.size - 4
    # no key at all
    out, lse = reference.attention_forward(q, k[:, :0], v[:, :0])
    assert (out == 0).all() and (lse == -np.inf).all()


def test_nan_propagates_to_rows_that_see_it():
    q, k, v = qkv(B=1, Sq=6, Sk=6, Hq=2, Hk=2)
    q[0, 2, 1, 0] = np.nan
    out, lse = reference.attention_forward(q, k, v)
    assert np.isnan(out[0, 2, 1]).all() and np.isnan(lse[0, 1, 2])
    assert np.isfinite(np.delete(out[0, :, 1], 2, axis=0)).all() and np.isfinite(out[0, :, 0]).all()

    q, k, v = qkv(B=1, Sq=6, Sk=6, Hq=1, Hk=1)
    k[0, 3, 0, 5] = np.nan
    v[0, 4, 0, 1] = np.nan
    out, lse = reference.attention_forward(q, k, v, causal=True)
    assert np.isfinite(out[0, :3]).all() and np.isfinite(lse[0, 0, :3]).all()
    assert np.isnan(out[0, 3:]).all() and np.isnan(lse[0, 0, 3:]).all()
    # a NaN in v reaches only the rows that see its key, and only that column of d
    k[0, 3, 0, 5] = 1.0
    out, lse = reference.attention_forward(q, k, v, causal=True)
    assert np.isfinite(lse).all()
    assert np.isnan(out[0, 4:, 0, 1]).all()
    assert np.isfinite(out[0, :4]).all() and np.isfinite(np.delete(out[0, 4:, 0], 1, -1)).all()
    # ... even where dropout drops it (the row still sees the key); never through a mask
    out, _ = reference.attention_forward(q, k, v, causal=True, dropout_p=0.9, rng_state=(1, 0))
    assert np.isnan(out[0, 4:, 0, 1]).all() and np.isfinite(out[0, :4]).all()
    v[0, 4, 0, 2] = np.inf
    mask = np.ones((6, 6), dtype=bool)
    mask[:, 4] = False
    out, _ = reference.attention_forward(q, k, v, mask=mask)
    assert np.isfinite(out).all()
    bias = np.zeros((6, 6))
    bias[0, 3] = np.nan
    out, _ = reference.attention_forward(q, k, v, bias=bias, mask=mask)
    assert np.isnan(out[0, 0]).all() and np.isfinite(out[0, 1:]).all()


def test_dropout_matches_textbook_and_is_unbiased():
    q, k, v = qkv(B=1, Sq=4, Sk=16, Hq=2, Hk=1, seed=3)
    plain, plain_lse = reference.attention_forward(q, k, v)
    state = np.array([2**63 + 5, 17], dtype=np.uint64)
    out, lse = reference.attention_forward(q, k, v, dropout_p=0.3, rng_state=state)
    want, _ = textbook(q, k, v, dropout_p=0.3, rng_state=(2**63 + 5, 17))
    assert_same(out, want)
    assert_same(lse, plain_lse)  # lse is taken before dropout
    assert not np.allclose(out, plain)

    samples = np.stack([reference.attention_forward(q, k, v, dropout_p=0.3,
                                                    rng_state=(11, offset))[0]
                        for offset in range(400)])
    mean, sem = samples.mean(0), samples.std(0) / np.sqrt(len(samples))
    assert (np.abs(mean - plain) <= 5 * sem + 1e-3).all()


def test_dropout_needs_rng_state_and_valid_p():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="rng_state"):
        reference.attention_forward(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        reference.attention_forward(q, k, v, dropout_p=1.0, rng_state=(0, 0))
    with pytest.raises(ValueError, match="rng_state"):
        reference.attention_forward(q, k, v, dropout_p=0.1, rng_state=(0, 0, 0))


def test_varlen_equals_per_sequence_calls():
    rng = np.random.default_rng(5)
    cu_q = np.array([0, 3, 3, 10, 11], dtype=np.int32)
    cu_k = np.array([0, 5, 9, 9, 20], dtype=np.int32)
    Hq, Hk, D = 4, 2, 8
    q = rng.standard_normal((11, Hq, D))
    k = rng.standard_normal((20, Hk, D))
    v = rng.standard_normal((20, Hk, D))
    slopes = rng.uniform(0, 1, (4, Hq)).astype(np.float32)
    opts = dict(causal=True, softcap=5.0, window=(4, -1))
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, alibi_slopes=slopes, **opts)
    assert out.shape == (11, Hq, D) and lse.shape == (Hq, 11)
    for b in range(4):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = reference.attention_forward(q[None, rows], k[None, keys], v[None, keys],
                                           alibi_slopes=slopes[b], **opts)
        assert_same(out[rows], o[0])
        assert_same(lse[:, rows], l[0])
    # dropout uses the sequence index as the batch index
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, dropout_p=0.4, rng_state=(9, 2),
                                          **opts)
    for b in range(4):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = textbook(q[None, rows], k[None, keys], v[None, keys], dropout_p=0.4,
                        rng_state=(9, 2), batch_ids=[b], **opts)
        assert_same(out[rows], o[0])
        assert_same(lse[:, rows], l[0])


def test_varlen_rows_past_the_last_sequence_are_undefined():
    q, k, v = np.ones((6, 1, 4)), np.ones((4, 1, 4)), np.ones((4, 1, 4))
    out, lse = reference.attention_varlen(q, k, v, np.array([0, 4]), np.array([0, 4]))
    assert np.isnan(out[4:]).all() and np.isnan(lse[:, 4:]).all()
    assert np.allclose(out[:4], 1.0)


def test_varlen_rejects_bad_cu_seqlens():
    q = k = v = np.ones((6, 1, 4))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        reference.attention_varlen(q, k, v, np.array([1, 4]), np.array([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        reference.attention_varlen(q, k, v, np.array([0, 4]), np.array([0, 7]))
    with pytest.raises(ValueError, match="same length"):
        reference.attention_varlen(q, k, v, np.array([0, 4]), np.array([0, 2, 4]))
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        reference.attention_varlen(q, k, v, np.array([0.0, 4.0]), np.array([0, 4]))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        reference.attention_varlen(q, k, v, np.array([0, 4]), np.array([0, 4]), max_seqlen_q=3)


def test_softcap_and_alibi_scores():
    q, k, _ = qkv(B=2, Sq=4, Sk=6, Hq=2, Hk=2)
    raw = np.einsum("bihd,bjhd->bhij", q, k) * 0.7
    assert_same(reference.attention_scores(q, k, scale=0.7, softcap=2.0),
                2.0 * np.tanh(raw / 2.0))
    slopes = np.array([[0.5, 0.25], [1.0, 0.125]], dtype=np.float32)
    dist = np.abs(np.arange(4)[:, None] + 2 - np.arange(6)[None, :])
    assert_same(reference.attention_scores(q, k, scale=0.7, alibi_slopes=slopes),
                raw - slopes[:, :, None, None] * dist)
    assert_same(reference.attention_scores(q, k, scale=0.7, alibi_slopes=slopes[1]),
                raw - slopes[1][None, :, None, None] * dist)
    # order: softcap first, then ALiBi, then bias
    bias = np.full((4, 6), 0.5)
    assert_same(reference.attention_scores(q, k, scale=0.7, softcap=2.0, alibi_slopes=slopes,
                                           bias=bias),
                2.0 * np.tanh(raw / 2.0) - slopes[:, :, None, None] * dist + 0.5)


def test_block_mask_equals_elementwise_mask():
    q, k, v = qkv(B=2, Sq=37, Sk=50, Hq=2, Hk=1, seed=8)
    rng = np.random.default_rng(8)
    block_mask = rng.random((2, 1, 3, 4)) < 0.6
    block_mask[0, 0, 1] = False
    bq, bk = 16, 13
    mask = np.repeat(np.repeat(block_mask, bq, axis=2), bk, axis=3)[:, :, :37, :50]
    a = reference.attention_forward(q, k, v, block_mask=block_mask, block_size=(bq, bk),
                                    causal=True)
    b = reference.attention_forward(q, k, v, mask=mask, causal=True)
    assert_same(a[0], b[0])
    assert_same(a[1], b[1])
    assert (a[1][0, :, 16:32] == -np.inf).all()


def test_input_kinds():
    import ml_dtypes
    q, k, v = qkv(dtype="bfloat16")
    assert q.dtype == ml_dtypes.bfloat16
    out, lse = reference.attention_forward(q, k, v)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    assert_same(out, reference.attention_forward(q64, k64, v64)[0])

    class Wrapped:
        def __init__(self, x):
            self.x = x

        def __array__(self, dtype=None, copy=None):
            return self.x

    assert_same(reference.attention_forward(Wrapped(q64), Wrapped(k64), Wrapped(v64))[0], out)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(mask=np.ones((5, 7), dtype=np.int8)), TypeError, "mask"),
    (dict(mask=np.ones((3, 7), dtype=bool)), ValueError, "mask"),
    (dict(bias=np.ones((2, 3, 5, 7))), ValueError, "bias"),
    (dict(block_mask=np.ones((1, 1, 2, 1), dtype=bool)), ValueError, "block_mask"),
    (dict(block_mask=np.ones((1, 1), dtype=bool), block_size=(0, 4)), ValueError, "block_size"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, "alibi_slopes"),
    (dict(window=(1, -2)), ValueError, "window"),
    (dict(window=3), ValueError, "window"),
    (dict(softcap=-1.0), ValueError, "softcap"),
])
def test_reference_rejects_bad_options(kwargs, error, match):
    q, k, v = qkv()
    with pytest.raises(error, match=match):
        reference.attention_forward(q, k, v, **kwargs)


def test_reference_rejects_bad_shapes():
    q, k, v = qkv(Hq=4, Hk=2)
    with pytest.raises(ValueError, match="multiple"):
        reference.attention_forward(q[:, :, :3], k, v)
    with pytest.raises(ValueError):
        reference.attention_forward(q[0], k, v)
    with pytest.raises(TypeError, match="q"):
        reference.attention_forward(q.astype(np.int32), k, v)


# ----------------------------------------------------------------------------- cuflash.testing

@given(testing.problems(max_seqlen=300, max_scores=2**16, head_dims=testing.head_dims(max_dim=64)))
def test_problem_strategy_draws_valid_problems(problem):
    shape, opts = problem["shape"], problem["options"]
    assert shape["Hq"] % shape["Hk"] == 0
    assert shape["B"] * shape["Hq"] * shape["Sq"] * shape["Sk"] <= 2**16
    assert problem["dtype"] in ("float16", "bfloat16", "float32")
    for name in ("mask", "bias"):
        if name in opts:
            np.broadcast_shapes(opts[name].shape,
                                (shape["B"], shape["Hq"], shape["Sq"], shape["Sk"]))
    if "block_mask" in opts:
        bq, bk = opts["block_size"]
        np.broadcast_shapes(opts["block_mask"].shape, (shape["B"], shape["Hq"],
                                                       -(-shape["Sq"] // bq),
                                                       -(-shape["Sk"] // bk)))
    assert 0.0 < opts.get("dropout_p", 0.5) < 1.0


@given(testing.varlen_seqlens(max_batch=3, max_seqlen=70))
def test_varlen_strategy(cu):
    cu_q, cu_k = cu
    assert cu_q.dtype == cu_k.dtype == np.int32 and cu_q.shape == cu_k.shape
    assert cu_q[0] == cu_k[0] == 0 and (np.diff(cu_q) >= 0).all() and (np.diff(cu_k) >= 0).all()


def test_random_qkv():
    shape = dict(B=2, Sq=3, Sk=5, Hq=4, Hk=2, D=16, Dv=8)
    q, k, v = testing.random_qkv(shape, "float16", seed=1)
    assert q.shape == (2, 3, 4, 16) and k.shape == (2, 5, 2, 16) and v.shape == (2, 5, 2, 8)
    assert q.dtype == k.dtype == v.dtype == np.float16
    assert all((x != 0).all() for x in (q, k, v))
    assert (testing.random_qkv(shape, "float16", seed=1)[0] == q).all()
    assert not (testing.random_qkv(shape, "float16", seed=2)[0] == q).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_accuracy_rule_accepts_baseline_and_rejects_perturbation(dtype):
    shape = dict(B=2, Sq=33, Sk=40, Hq=4, Hk=2, D=32)
    q, k, v = testing.random_qkv(shape, dtype, seed=4)
    mask = np.ones((2, 1, 33, 40), dtype=bool)
    mask[0, 0, 5] = False
    opts = dict(causal=True, softcap=30.0, mask=mask, dropout_p=0.2, rng_state=(3, 4))
    ref, ref_lse = reference.attention_forward(q, k, v, **opts)
    base, base_lse = testing.baseline_attention(q, k, v, return_lse=True, **opts)
    assert base.shape == ref.shape and base.dtype == np.float64
    assert (base_lse == -np.inf).sum() == (ref_lse == -np.inf).sum() > 0
    assert np.abs(base - ref).max() < 0.05  # it is an attention, only rounded

    testing.assert_attention_close(base, ref, base, dtype=dtype)
    bad = base.copy()
    bump = 3 * np.abs(base - ref).max() + 10 * testing.DEFAULT_ATOL[dtype] + 1e-3
    bad[1, 7, 2, 3] += bump
    with pytest.raises(AssertionError, match=r"\(1, 7, 2, 3\)"):
        testing.assert_attention_close(bad, ref, base, dtype=dtype)


def test_accuracy_rule_nan_and_usage():
    ref = np.array([[1.0, np.nan], [-np.inf, 0.5]])
    testing.assert_attention_close(ref.astype(np.float32), ref)
    testing.assert_attention_close(ref.astype(np.float16), ref, ref, dtype="float16")
    with pytest.raises(AssertionError, match="NaN"):
        testing.assert_attention_close(np.array([[1.0, 2.0], [-np.inf, 0.5]], np.float32), ref)
    with pytest.raises(AssertionError, match="NaN"):
        testing.assert_attention_close(np.array([[1.0, np.nan], [0.0, 0.5]], np.float32), ref)
    with pytest.raises(AssertionError, match="NaN"):
        testing.assert_attention_close(np.array([[np.nan, np.nan], [-np.inf, 0.5]], np.float32),
                                       ref)
    with pytest.raises(AssertionError, match="shape"):
        testing.assert_attention_close(np.zeros(3, np.float32), ref)
    with pytest.raises(ValueError, match="baseline"):
        testing.assert_attention_close(ref.astype(np.float16), ref)
    # float32: relative Frobenius error 1e-5
    x = np.random.default_rng(0).standard_normal(1000)
    testing.assert_attention_close((x * (1 + 5e-6)).astype(np.float32), x)
    with pytest.raises(AssertionError, match="relative"):
        testing.assert_attention_close(x * (1 + 1e-4), x, dtype="float32")


def test_baseline_varlen_matches_per_sequence_baseline():
    rng = np.random.default_rng(2)
    cu_q, cu_k = np.array([0, 4, 9], np.int32), np.array([0, 6, 8], np.int32)
    q = rng.standard_normal((9, 2, 16)).astype(np.float16)
    k = rng.standard_normal((8, 1, 16)).astype(np.float16)
    v = rng.standard_normal((8, 1, 16)).astype(np.float16)
    out = testing.baseline_attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    ref, _ = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert np.abs(out - ref).max() < 0.01
    second = testing.baseline_attention(q[None, 4:9], k[None, 6:8], v[None, 6:8], causal=True)
    assert_same(out[4:9], second[0])


def test_baseline_takes_sinks_and_modifiers_as_the_reference_does():
    """The same-dtype baseline with sinks (a denominator term, lse = the sink for a row with no key)
    and with a ScoreMod/MaskMod stays within rounding of the float64 reference; without the sink
    it would not."""
    from cuflash.modifiers import MaskMod, ScoreMod

    rng = np.random.default_rng()
    q, k, v = testing.random_qkv(dict(B=2, Sq=17, Sk=23, Hq=4, Hk=2, D=32), "float16",
                                 seed=int(rng.integers(1 << 30)))
    sinks = (2 * rng.standard_normal(4)).astype(np.float32)
    sinks[1] = -np.inf
    ref, ref_lse = reference.attention_forward(q, k, v, causal=True, sinks=sinks)
    base, base_lse = testing.baseline_attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    testing.assert_attention_close(base, ref, base, dtype="float16")
    assert np.abs(base_lse - ref_lse).max() < 1e-2
    without = testing.baseline_attention(q, k, v, causal=True)
    assert np.abs(without - ref).max() > 10 * np.abs(base - ref).max()
    _, empty_lse = testing.baseline_attention(q, k[:, :0], v[:, :0], sinks=sinks, return_lse=True)
    assert (empty_lse == sinks[None, :, None]).all()

    cap = ScoreMod("c * tanh(score / c)", grad="1.0 - tanh(score / c) * tanh(score / c)", c=2.0)
    near = MaskMod("q_idx - kv_idx <= 5")
    ref, _ = reference.attention_forward(q, k, v, causal=True, score_mod=cap, mask_mod=near)
    base = testing.baseline_attention(q, k, v, causal=True, score_mod=cap, mask_mod=near)
    testing.assert_attention_close(base, ref, base, dtype="float16")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bias_with_hidden_infinities(dtype):
    """NaN and +inf only at keys a causal mask hides (two in three of them), the seen keys as
    score_tile_operand makes them; the reference's output stays finite over them."""
    sq, sk = 37, 53
    bias = testing.bias_with_hidden_infinities(sq, sk, dtype, 11).astype(np.float32)
    plain = testing.score_tile_operand("bias", (sq, sk), dtype, 11).astype(np.float32)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    hidden = j > i + sk - sq
    assert np.array_equal(bias[~hidden], plain[~hidden])
    special = ~np.isfinite(bias) & ~np.isneginf(bias)   # NaN or +inf
    assert np.array_equal(special, hidden & (j % 3 != 2))
    assert np.isnan(bias[special & (j % 2 == 0)]).all() and np.isposinf(bias[special & (j % 2 == 1)]).all()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n, 1, 8)) for n in (sq, sk, sk))
    out, lse = reference.attention_forward(q, k, v, causal=True, bias=bias)[:2]
    assert np.isfinite(out).all()
