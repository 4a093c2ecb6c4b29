"""Merging attention states (cuflash.merge_states and its float64 twin cuflash.reference.merge_states).

The cascade property: attention over keys A ∪ B equals merge(attention over A, attention over B).
It is tested on the CPU with the float64 reference and on the GPU with cuflash.attention on key
subsets, with up to 128 parts, empty parts and parts whose keys are all masked. Masks and biases
depend on key positions, so every part gets the columns of one full mask / bias (causal is folded
into the mask), which keeps the parts' scores those of the whole problem.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash.testing as tt
from cuflash import reference

NAN, INF = float("nan"), float("inf")


def _capped(n):
    base = settings.default
    return settings(max_examples=max(1, min(base.max_examples, n)), deadline=None,
                    suppress_health_check=list(base.suppress_health_check)
                    + [HealthCheck.too_slow, HealthCheck.data_too_large,
                       HealthCheck.function_scoped_fixture])


# ----------------------------------------------------------------------------- problems

@st.composite
def cascade_problems(draw, max_parts=128, max_sk=200):
    """A small attention problem, one full mask and bias, and a random partition of the keys.

    Returns a dict: shape (B, Sq, Sk, Hq, Hk, D), ``options`` (scale, softcap, bias, mask, all
    as explicit arrays over the full key axis), ``parts`` (list of key index arrays, some empty,
    some whose keys are all masked), ``seed``.
    """
    sk = draw(st.one_of(st.integers(1, 40), st.sampled_from([64, 128, 129, max_sk])))
    shape = dict(B=draw(st.integers(1, 2)), Sq=draw(st.sampled_from([1, 2, 5, 16])), Sk=sk,
                 D=draw(st.sampled_from([8, 16, 32])))
    hq, hk = draw(tt.gqa_heads(max_heads=4))
    shape.update(Hq=hq, Hk=hk)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    b, sq = shape["B"], shape["Sq"]
    visible = rng.random((b, 1, sq, sk)) < draw(st.sampled_from([0.3, 0.8, 1.0]))
    if draw(st.booleans()):  # causal, bottom-right, folded into the mask
        visible &= (np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq)
    if sq > 1 and draw(st.booleans()):
        visible[:, :, 0, :] = False  # a row that sees no key at all
    n_parts = draw(st.one_of(st.integers(1, 8), st.sampled_from([max_parts, min(max_parts, sk)])))
    owner = rng.integers(0, n_parts, size=sk)
    if draw(st.booleans()) and n_parts > 1:
        # A part whose keys are all masked: hide its keys from every row.
        visible[..., owner == 0] = False
    parts = [np.flatnonzero(owner == i) for i in range(n_parts)]
    options = dict(mask=visible)
    if draw(st.booleans()):
        options["bias"] = rng.standard_normal((b, hq, sq, sk)).astype(np.float32)
    if draw(st.booleans()):
        options["softcap"] = draw(st.sampled_from([1.0, 5.0]))
    if draw(st.booleans()):
        options["scale"] = draw(st.sampled_from([0.3, 1.0]))
    return dict(shape=shape, options=options, parts=parts, seed=seed)


def _restrict(options, idx):
    """The options of the sub-problem over keys ``idx`` (the mask's and bias's columns)."""
    out = dict(options)
    for name in ("mask", "bias"):
        if name in out:
            out[name] = out[name][..., idx]
    return out


# ----------------------------------------------------------------------------- CPU: reference identities

@_capped(40)
@given(problem=cascade_problems())
def test_cascade_reference(problem):
    """reference attention over all keys == reference merge of reference attention over the parts."""
    q, k, v = tt.random_qkv(problem["shape"], "float64", problem["seed"])
    full_out, full_lse = reference.attention_forward(q, k, v, **problem["options"])
    outs, lses = [], []
    for idx in problem["parts"]:
        o, l = reference.attention_forward(q, k[:, idx], v[:, idx], **_restrict(problem["options"], idx))
        outs.append(o)
        lses.append(l)
    out, lse = reference.merge_states(outs, lses)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(full_lse))
    np.testing.assert_allclose(lse, full_lse, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out, full_out, rtol=1e-10, atol=1e-12)
    assert not np.isnan(out).any()


def _random_states(rng, n, b=2, s=3, h=2, d=5, p_masked=0.2):
    outs = rng.standard_normal((n, b, s, h, d))
    lses = rng.standard_normal((n, b, h, s)) * 3
    lses[rng.random(lses.shape) < p_masked] = -INF
    return outs, lses


@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6))
def test_merge_is_associative_and_order_free(seed, n):
    rng = np.random.default_rng(seed)
    outs, lses = _random_states(rng, n + 2)
    out, lse = reference.merge_states(outs, lses)
    # In two stages: the first n parts, then the rest.
    o1, l1 = reference.merge_states(outs[:n], lses[:n])
    o2, l2 = reference.merge_states([o1, *outs[n:]], [l1, *lses[n:]])
    np.testing.assert_allclose(o2, out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(l2, lse, rtol=1e-12, atol=1e-12)
    perm = rng.permutation(n + 2)
    o3, l3 = reference.merge_states(outs[perm], lses[perm])
    np.testing.assert_allclose(o3, out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(l3, lse, rtol=1e-12, atol=1e-12)


def test_merge_single_part_is_identity():
    rng = np.random.default_rng(1)
    outs, lses = _random_states(rng, 1)
    out, lse = reference.merge_states(outs, lses)
    seen = np.moveaxis(lses[0], -1, -2) != -INF
    np.testing.assert_allclose(out[seen], outs[0][seen], rtol=1e-15)
    np.testing.assert_array_equal(out[~seen], 0.0)
    np.testing.assert_array_equal(lse, lses[0])


def test_merge_masked_parts():
    """-inf parts contribute nothing, even holding NaN; all -inf -> out 0, lse -inf, no NaN."""
    rng = np.random.default_rng(2)
    outs, lses = _random_states(rng, 3, p_masked=0.0)
    garbage = outs.copy()
    garbage[1] = NAN
    lses_masked = lses.copy()
    lses_masked[1] = -INF
    out, lse = reference.merge_states(garbage, lses_masked)
    want_out, want_lse = reference.merge_states(outs[[0, 2]], lses[[0, 2]])
    np.testing.assert_allclose(out, want_out, rtol=1e-15)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-15)
    out, lse = reference.merge_states(np.full((4, 1, 2, 3, 5), NAN), np.full((4, 1, 3, 2), -INF))
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse, -INF)


def test_merge_nan_propagates():
    rng = np.random.default_rng(3)
    outs, lses = _random_states(rng, 3, p_masked=0.0)
    lses[1, 0, 1, 2] = NAN              # part 1, batch 0, head 1, row 2
    out, lse = reference.merge_states(outs, lses)
    assert np.isnan(lse[0, 1, 2]) and np.isnan(out[0, 2, 1]).all()
    assert np.isfinite(np.delete(lse.ravel(), np.ravel_multi_index((0, 1, 2), lse.shape))).all()
    outs[2, 1, 0, 0, 3] = NAN           # a NaN in a visible part's output
    out, _ = reference.merge_states(outs, lses)
    assert np.isnan(out[1, 0, 0, 3]) and np.isfinite(out[1, 0, 0, :3]).all()


def test_merge_lse_is_exact_logsumexp():
    lses = np.array([0.0, np.log(3.0), -INF, 1000.0, 1000.0])
    cases = [(lses[:2], np.log(4.0)), (lses[:3], np.log(4.0)), (lses[3:], 1000.0 + np.log(2.0))]
    for parts, want in cases:
        n = len(parts)
        _, lse = reference.merge_states(np.ones((n, 1, 1, 1, 2)), parts.reshape(n, 1, 1, 1))
        np.testing.assert_allclose(lse.item(), want, rtol=1e-15)


def test_reference_merge_rejects_bad_shapes():
    with pytest.raises(ValueError, match="lses must have shape"):
        reference.merge_states(np.zeros((2, 1, 3, 4, 5)), np.zeros((2, 1, 3, 4)))
    with pytest.raises(ValueError, match="outs must be"):
        reference.merge_states(np.zeros((1, 3, 4, 5)), np.zeros((1, 4, 3)))


# ----------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu

HALF_EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def _to_dtype(x, dtype):
    return np.asarray(x).astype(tt._dtype(dtype))


@st.composite
def merge_inputs(draw):
    n = draw(st.one_of(st.integers(1, 8), st.sampled_from([31, 128])))
    b, s, h = draw(st.integers(1, 2)), draw(st.sampled_from([1, 3, 17])), draw(st.sampled_from([1, 2, 5]))
    d = draw(st.sampled_from([1, 7, 64, 100, 128, 256, 300]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    outs = rng.standard_normal((n, b, s, h, d))
    lses = (rng.standard_normal((n, b, h, s)) * draw(st.sampled_from([0.1, 3.0, 30.0]))).astype(np.float32)
    lses[rng.random(lses.shape) < draw(st.sampled_from([0.0, 0.3, 0.9]))] = -INF
    if draw(st.booleans()):
        lses[:, 0, 0, 0] = -INF      # a row with every part masked
        outs[:, 0, 0, 0, :] = NAN    # ... whose outputs hold garbage
    return dict(outs=outs, lses=lses, dtype=draw(st.sampled_from(["float16", "bfloat16", "float32", "float64"])),
                form=draw(st.sampled_from(["stacked", "sequence", "strided"])))


@gpu
@_capped(40)
@given(case=merge_inputs())
def test_merge_states_gpu_matches_reference(xp_gpu, case):
    import cuflash

    cp = xp_gpu
    outs_host = _to_dtype(case["outs"], case["dtype"])
    lses = case["lses"]
    ref_out, ref_lse = reference.merge_states(outs_host, lses)
    if case["form"] == "sequence":
        outs_arg, lses_arg = [cp.asarray(x) for x in outs_host], [cp.asarray(x) for x in lses]
    elif case["form"] == "strided":
        # Non-contiguous views: every other column of a wider array, parts in reverse order twice.
        wide = np.zeros(outs_host.shape[:-1] + (2 * outs_host.shape[-1],), dtype=outs_host.dtype)
        wide[..., ::2] = outs_host
        outs_arg, lses_arg = cp.asarray(wide)[..., ::2], cp.asarray(lses)
    else:
        outs_arg, lses_arg = cp.asarray(outs_host), cp.asarray(lses)
    out, lse = cuflash.merge_states(outs_arg, lses_arg)
    assert out.dtype == outs_host.dtype and lse.dtype == np.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    out, lse = out.get().astype(np.float64), lse.get().astype(np.float64)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-6, atol=1e-5)
    eps = HALF_EPS.get(case["dtype"], 1e-6)
    err = np.abs(out - ref_out)
    assert (err <= eps * np.abs(ref_out) + 1e-5).all(), f"max error {err.max():.3g}"


@gpu
def test_merge_states_gpu_mixed_sequence_and_errors(xp_gpu):
    import cuflash

    cp = xp_gpu
    rng = np.random.default_rng(5)
    a = rng.standard_normal((1, 2, 3, 8))
    lse = rng.standard_normal((2, 1, 3, 2)).astype(np.float32)
    parts = [cp.asarray(a.astype(tt._dtype("bfloat16"))), cp.asarray(a.astype(np.float32))]
    out, out_lse = cuflash.merge_states(parts, [cp.asarray(x) for x in lse])
    assert out.dtype == parts[0].dtype  # the dtype of outs[0]
    ref_out, ref_lse = reference.merge_states([p.get() for p in parts], lse)
    np.testing.assert_allclose(out_lse.get(), ref_lse, rtol=1e-6)
    np.testing.assert_allclose(out.get().astype(np.float64), ref_out, rtol=2**-8, atol=1e-6)
    with pytest.raises(TypeError, match="lses must be float32"):
        cuflash.merge_states(cp.zeros((1, 1, 2, 3, 4), cp.float32), cp.zeros((1, 1, 3, 2), cp.float64))
    with pytest.raises(ValueError, match="lses must have shape"):
        cuflash.merge_states(cp.zeros((2, 1, 2, 3, 4), cp.float32), cp.zeros((2, 1, 2, 3), cp.float32))
    with pytest.raises(ValueError, match="at least one"):
        cuflash.merge_states([], [])
    with pytest.raises(TypeError, match="outs must be"):
        cuflash.merge_states(cp.zeros((1, 1, 2, 3, 4), cp.int32), cp.zeros((1, 1, 3, 2), cp.float32))
    with pytest.raises(TypeError, match="CUDA array"):
        cuflash.merge_states(np.zeros((1, 1, 2, 3, 4), np.float32), np.zeros((1, 1, 3, 2), np.float32))


@gpu
@_capped(20)
@given(problem=cascade_problems(), dtype=st.sampled_from(["float32", "float16", "bfloat16"]))
def test_cascade_gpu(xp_gpu, problem, dtype):
    """cuflash.attention over all keys == cuflash.merge_states of cuflash.attention over the parts."""
    import cuflash

    cp = xp_gpu
    q, k, v = tt.random_qkv(problem["shape"], dtype, problem["seed"])
    opts = problem["options"]
    ref_out, ref_lse = reference.attention_forward(q, k, v, **opts)
    qd, kd, vd = (cp.asarray(x) for x in (q, k, v))
    outs, lses, part_errors = [], [], [0.0]
    for idx in problem["parts"]:
        part_opts = _restrict(opts, idx)
        o, l = cuflash.attention(qd, kd[:, cp.asarray(idx)], vd[:, cp.asarray(idx)], return_lse=True,
                                 **tt.as_device_options(part_opts, cp))
        outs.append(o)
        lses.append(l)
        if dtype != "float32":
            # The merge is a convex combination: its error is at most the worst part's error.
            po, pl = reference.attention_forward(q, k[:, idx], v[:, idx], **part_opts)
            seen = np.isfinite(np.moveaxis(pl, -1, -2))[..., None] & np.ones_like(po, dtype=bool)
            if seen.any():
                part_errors.append(float(np.abs(o.get().astype(np.float64) - po)[seen].max()))
    out, lse = cuflash.merge_states(outs, lses)
    assert out.dtype == q.dtype
    tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")
    if dtype == "float32":
        tt.assert_attention_close(out, ref_out, dtype="float32", name="out")
    else:
        got = out.get().astype(np.float64)
        assert not np.isnan(got).any()
        err = np.abs(got - ref_out).max()
        allowed = max(part_errors) + HALF_EPS[dtype] * np.abs(ref_out).max() + tt.DEFAULT_ATOL[dtype]
        assert err <= allowed, f"merged error {err:.3g} > worst part error + rounding = {allowed:.3g}"


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_merge_states_gpu_into_caller_buffers(xp_gpu, dtype):
    """out= / lse= are written in place (NaN-poisoned first), equal the allocating call bitwise,
    and are returned as the very objects passed; overlaps and bad buffers are refused before any
    launch, the buffers left untouched. (Overlaps are checked when a call's layout is planned, so
    the bad calls come first here: a repeat call replays its plan with no checks but alignment.)"""
    import cuflash
    from cuflash._runtime import memo as _memo

    cp = xp_gpu
    _memo.clear_memo()   # these layouts are planned (and checked) here first
    rng = np.random.default_rng()
    n, b, s, h, d = 3, 2, 5, 4, 64
    outs = cp.asarray(rng.standard_normal((n, b, s, h, d)).astype(tt._dtype(dtype)))
    lses = cp.asarray(rng.standard_normal((n, b, h, s)).astype(np.float32))
    before, lses_before = outs.copy(), lses.copy()
    with pytest.raises(ValueError, match="out overlaps outs"):
        cuflash.merge_states(outs, lses, out=outs[0])
    with pytest.raises(ValueError, match="lse overlaps lses"):
        cuflash.merge_states(outs, lses, lse=lses[1])
    shared = cp.empty(b * s * h * d, dtype=cp.float32)
    with pytest.raises(ValueError, match="out overlaps lse"):
        cuflash.merge_states(outs.astype(cp.float32), lses, out=shared.reshape(b, s, h, d),
                             lse=shared[:b * h * s].reshape(b, h, s))
    with pytest.raises(TypeError, match="out must have dtype"):
        cuflash.merge_states(outs, lses, out=cp.empty((b, s, h, d), dtype=cp.float64))
    with pytest.raises(ValueError, match="lse must have shape"):
        cuflash.merge_states(outs, lses, lse=cp.empty((b, s, h), dtype=cp.float32))
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        cuflash.merge_states(outs, lses, out=cp.empty((b, s, h, 2 * d), dtype=outs.dtype)[..., ::2])
    np.testing.assert_array_equal(outs.view(cp.uint8).get(), before.view(cp.uint8).get())
    np.testing.assert_array_equal(lses.get(), lses_before.get())
    want_out, want_lse = cuflash.merge_states(outs, lses)

    def poisoned(shape, dtype):   # all bits set: NaN in every float format (bfloat16 has no cp.full)
        x = cp.empty(shape, dtype=dtype)
        x.view({2: cp.uint16, 4: cp.uint32}[x.itemsize]).fill(2 ** (8 * x.itemsize) - 1)
        return x

    for _ in range(2):   # the first call plans, the second replays the plan
        out = poisoned((b, s, h, d), outs.dtype)
        lse = poisoned((b, h, s), cp.float32)
        got_out, got_lse = cuflash.merge_states(outs, lses, out=out, lse=lse)
        assert got_out is out and got_lse is lse
        np.testing.assert_array_equal(out.view(cp.uint8).get(), want_out.view(cp.uint8).get())
        np.testing.assert_array_equal(lse.get(), want_lse.get())
    only_lse = poisoned((b, h, s), cp.float32)
    got_out, _ = cuflash.merge_states(outs, lses, lse=only_lse)
    np.testing.assert_array_equal(got_out.view(cp.uint8).get(), want_out.view(cp.uint8).get())
    np.testing.assert_array_equal(only_lse.get(), want_lse.get())

