"""The decode reference on serving caches (issue 53): fp8 (e4m3 bytes with per-tensor or per-kv-head
scales) against the same decode on caches dequantised here with ml_dtypes, appends quantised and
saturated; the MLA latent cache (values = its first v_head_dim columns) against the same decode with
those columns passed as v_cache; and the checks."""

import ml_dtypes
import numpy as np
import pytest

from cuflash import reference


def _e4m3(x, scale):
    """Independent quantisation: x / scale, saturated at 448, rounded to e4m3, as bytes."""
    return np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _values(raw, scale):
    return raw.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_caches_equal_the_dequantised_decode(paged, per_head):
    rng = np.random.default_rng()
    B, L, Hk, Hq, D, S_new = 2, 32, 2, 8, 16, 2
    k_scale = rng.uniform(0.01, 0.1, Hk) if per_head else np.float32(0.05)
    v_scale = rng.uniform(0.01, 0.1, Hk) if per_head else np.float32(0.07)
    ks = np.reshape(k_scale, (1, 1, -1, 1)) if per_head else float(k_scale)
    vs = np.reshape(v_scale, (1, 1, -1, 1)) if per_head else float(v_scale)
    shape = (B * L // 8, 8, Hk, D) if paged else (B, L, Hk, D)
    k_raw, v_raw = (_e4m3(rng.standard_normal(shape) * 3, s) for s in (ks, vs))
    table = rng.permutation(B * L // 8).reshape(B, L // 8) if paged else None
    lens = np.array([5, L - S_new])
    q = rng.standard_normal((B, S_new, Hq, D))
    k_new, v_new = rng.standard_normal((B, S_new, Hk, D)) * 50, rng.standard_normal((B, S_new, Hk, D))
    k_new[0, 0, 0, 0] = 1e6   # saturates at 448 * scale rather than turning into NaN
    out, lse, k_after, v_after = reference.decode(q, k_raw, v_raw, cache_seqlens=lens, block_table=table, k_new=k_new,
                                                  v_new=v_new, kv_dtype="float8_e4m3fn", k_scale=k_scale,
                                                  v_scale=v_scale, return_cache=True)
    assert k_after.dtype == np.uint8 and not np.isnan(_values(k_after, ks)).any()
    # The same decode on float64 caches that already hold the quantised new rows.
    k_want, v_want = k_raw.copy(), v_raw.copy()
    for b in range(B):
        for t in range(S_new):
            pos = lens[b] + t
            where = (table[b, pos // 8], pos % 8) if paged else (b, pos)
            k_want[where] = _e4m3(k_new[b, t][None, None], ks)[0, 0]
            v_want[where] = _e4m3(v_new[b, t][None, None], vs)[0, 0]
    np.testing.assert_array_equal(k_after, k_want)
    np.testing.assert_array_equal(v_after, v_want)
    want_out, want_lse = reference.decode(q, _values(k_want, ks), _values(v_want, vs), block_table=table,
                                          cache_seqlens=lens + S_new)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_mla_latent_cache_equals_its_columns_as_values():
    rng = np.random.default_rng()
    B, L, Hq, Dqk, Dv = 2, 24, 16, 72, 64
    kv = rng.standard_normal((B, L, 1, Dqk))
    q, k_new = rng.standard_normal((B, 1, Hq, Dqk)), rng.standard_normal((B, 1, 1, Dqk))
    lens = np.array([7, 20])
    out, lse, kv_after, none = reference.decode(q, kv, None, cache_seqlens=lens, k_new=k_new, v_head_dim=Dv,
                                                return_cache=True)
    assert none is None and out.shape == (B, 1, Hq, Dv)
    want = reference.decode(q, kv, kv[..., :Dv].copy(), cache_seqlens=lens, k_new=k_new, v_new=k_new[..., :Dv],
                            return_cache=True)
    np.testing.assert_allclose(out, want[0], rtol=1e-12)
    np.testing.assert_allclose(lse, want[1], rtol=1e-12)
    np.testing.assert_array_equal(kv_after, want[2])
    np.testing.assert_array_equal(kv_after[..., :Dv], want[3])


def test_serving_cache_arguments_are_checked():
    rng = np.random.default_rng()
    kc, vc = rng.standard_normal((1, 8, 1, 8)), rng.standard_normal((1, 8, 1, 8))
    q = rng.standard_normal((1, 1, 2, 8))
    with pytest.raises(ValueError, match="needs v_head_dim"):
        reference.decode(q, kc, None)
    with pytest.raises(ValueError, match="v_head_dim must lie"):
        reference.decode(q, kc, None, v_head_dim=9)
    with pytest.raises(ValueError, match="v_head_dim is for v_cache=None"):
        reference.decode(q, kc, vc, v_head_dim=4)
    with pytest.raises(TypeError, match="uint8"):
        reference.decode(q, kc, vc, kv_dtype="float8_e4m3fn", k_scale=1.0, v_scale=1.0)
    raw = np.zeros((1, 8, 1, 8), np.uint8)
    with pytest.raises(ValueError, match="k_scale is required"):
        reference.decode(q, raw, raw, kv_dtype="float8_e4m3fn", v_scale=1.0)
    with pytest.raises(ValueError, match=r"shape \(1,\)"):
        reference.decode(q, raw, raw, kv_dtype="float8_e4m3fn", k_scale=np.ones(3), v_scale=1.0)
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        reference.decode(q, raw, raw, kv_dtype="float8_e5m2", k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="need kv_dtype"):
        reference.decode(q, kc, vc, k_scale=1.0)
