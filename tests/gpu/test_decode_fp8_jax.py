"""fp8 (e4m3) KV caches through cuflash.interop.jax.decode on the GPU (issue 53 item 4), against the
float64 reference (cuflash.reference.decode with kv_dtype="float8_e4m3fn") on the same bytes, and bit for
bit against cuflash.decode's CuPy call (the same kernels).

Cases (tests/gpu/test_decode_fp8.py's data: lengths with a 0 among them, NaN bytes past each sequence,
appended values that saturate or are subnormal): jnp.float8_e4m3fn caches (kv_dtype implied),
contiguous and paged (page 16); scales per tensor (a float, static, or a 0-d JAX array) and per kv head
(a JAX (Hk,) array); with and without appended tokens; 1 and 3 splits; float16 and bfloat16 q. The
function is jitted with the caches donated: with an append the returned caches must be the given
buffers (in place) and their bytes the reference's quantisation, bit for bit. uint8 caches with
kv_dtype said give the same bits. Outputs are NaN-poisoned before cuflash writes them
(``_jax_buffers.POISON``). Accuracy as in tests/gpu/test_decode_fp8.py.

Run: ``python -m pytest -q tests/gpu/test_decode_fp8_jax.py`` (skipped without a JAX GPU device).
"""

import functools

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.gpu._hardware import jax_on_gpu  # noqa: E402

jax = jax_on_gpu()

import jax.numpy as jnp  # noqa: E402

import cupy  # noqa: E402

import cuflash.interop.jax as cj  # noqa: E402
from tests.gpu._jax_outputs import poisoned_outputs  # noqa: E402,F401
from tests.gpu.test_decode_fp8 import DTYPES, FP8, TOL, _case, _expected, _run  # noqa: E402

pytestmark = pytest.mark.gpu


def _fp8(x):
    """Host e4m3 bytes (uint8) as a JAX float8_e4m3fn array of the same bytes."""
    return jnp.asarray(np.asarray(x).view(ml_dtypes.float8_e4m3fn))


def _scales(case, scale_array):
    """(static keywords, array keywords): per kv head always arrays; per tensor a float or a 0-d array."""
    per_head = np.ndim(case["k_scale"]) == 1
    if per_head or scale_array:
        return {}, dict(k_scale=jnp.asarray(case["k_scale"], jnp.float32), v_scale=jnp.asarray(case["v_scale"],
                                                                                                jnp.float32))
    return dict(k_scale=float(case["k_scale"]), v_scale=float(case["v_scale"])), {}


def _jax_decode(case, k_cache, v_cache, *, num_splits, scale_array, kv_dtype=None):
    """The jitted call with the caches donated: (out, lse, k_cache, v_cache, whether the append was in place)."""
    static, arrays = _scales(case, scale_array)
    append = case["k_new"] is not None

    @functools.partial(jax.jit, donate_argnums=(1, 2) if append else ())
    def step(q, kc, vc, lens, table, kn, vn, scales):
        return cj.decode(q, kc, vc, cache_seqlens=lens, block_table=table, k_new=kn, v_new=vn, num_splits=num_splits,
                         return_lse=True, kv_dtype=kv_dtype, **static, **scales)

    opt = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    ptrs = (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer())
    results = step(jnp.asarray(case["q"]), k_cache, v_cache, jnp.asarray(case["lens"]), opt(case["table"]),
                   opt(case["k_new"]), opt(case["v_new"]), arrays)
    if not append:
        out, lse = results
        return out, lse, None, None, None
    out, lse, kc, vc = results
    assert kc.dtype == k_cache.dtype and vc.dtype == v_cache.dtype
    return out, lse, kc, vc, (kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer()) == ptrs


def _bytes(x):
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_kv_head"])
@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
def test_jitted_fp8_decode_matches_the_reference(dtype, page_size, num_splits, per_head, append):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    case = _case(rng, dtype=dtype, page_size=page_size, per_head=per_head, append=append)
    scale_array = bool(seed % 2)
    msg = f"seed {seed}, scales as {'arrays' if per_head or scale_array else 'floats'}"
    out, lse, kc, vc, in_place = _jax_decode(case, _fp8(case["k_cache"]), _fp8(case["v_cache"]),
                                             num_splits=num_splits, scale_array=scale_array)
    want, want_lse, k_want, v_want = _expected(case)
    if append:
        assert in_place, f"the append was not in place ({msg})"
        np.testing.assert_array_equal(_bytes(kc), k_want, err_msg=msg)   # the appended bytes, bit for bit
        np.testing.assert_array_equal(_bytes(vc), v_want, err_msg=msg)
    got = np.asarray(out).astype(np.float64)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * scale, err_msg=msg)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-4, atol=1e-3, err_msg=msg)
    empty = case["lens"] + (case["q"].shape[1] if append else 0) == 0
    assert (got[empty] == 0).all() and np.isneginf(np.asarray(lse)[empty]).all(), msg

    # The same kernels from CuPy: the same bits.
    c_out, c_lse, c_k, c_v = _run(case, num_splits=num_splits, scale_array=scale_array)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), cupy.asnumpy(c_out).view(np.uint16), err_msg=msg)
    np.testing.assert_array_equal(np.asarray(lse), cupy.asnumpy(c_lse), err_msg=msg)
    if append:
        np.testing.assert_array_equal(_bytes(kc), c_k, err_msg=msg)
        np.testing.assert_array_equal(_bytes(vc), c_v, err_msg=msg)


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
def test_uint8_caches_with_kv_dtype_give_the_same_bits(page_size):
    rng = np.random.default_rng()
    case = _case(rng, dtype="bfloat16", page_size=page_size, per_head=True, append=True)
    out8, lse8, kc8, vc8, _ = _jax_decode(case, _fp8(case["k_cache"]), _fp8(case["v_cache"]), num_splits=0,
                                          scale_array=True)
    out, lse, kc, vc, in_place = _jax_decode(case, jnp.asarray(case["k_cache"]), jnp.asarray(case["v_cache"]),
                                             num_splits=0, scale_array=True, kv_dtype=FP8)
    assert in_place and kc.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(out8).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse8))
    np.testing.assert_array_equal(np.asarray(kc), _bytes(kc8))
    np.testing.assert_array_equal(np.asarray(vc), _bytes(vc8))


def test_appended_nan_and_saturation_bytes():
    rng = np.random.default_rng()
    case = _case(rng, dtype="float16", page_size=None, per_head=False, append=True)
    case["k_new"][1, 0, 1, :3] = [np.nan, -np.nan, np.inf]
    _, _, kc, _, in_place = _jax_decode(case, _fp8(case["k_cache"]), _fp8(case["v_cache"]), num_splits=1,
                                        scale_array=False)
    _, _, k_want, _ = _expected(case)
    assert in_place
    np.testing.assert_array_equal(_bytes(kc), k_want)


def test_repeated_steps_reuse_the_callback_and_append_in_order():
    # Two decode steps through one jitted function: the second attends to the first's quantised rows.
    rng = np.random.default_rng()
    case = _case(rng, dtype="bfloat16", page_size=16, per_head=True, append=True)
    case["lens"] = np.minimum(case["lens"], 200 - 2 * case["q"].shape[1]).astype(np.int32)   # room for two steps
    kc, vc = _fp8(case["k_cache"]), _fp8(case["v_cache"])
    _, _, kc, vc, _ = _jax_decode(case, kc, vc, num_splits=0, scale_array=True)
    first = _expected(case)
    case2 = dict(case, k_cache=first[2], v_cache=first[3], lens=case["lens"] + case["q"].shape[1])
    case2["q"] = rng.standard_normal(case["q"].shape).astype(case["q"].dtype)
    out, _, kc, vc, in_place = _jax_decode(case2, kc, vc, num_splits=0, scale_array=True)
    want, _, k_want, v_want = _expected(case2)
    assert in_place
    np.testing.assert_array_equal(_bytes(kc), k_want)
    np.testing.assert_array_equal(_bytes(vc), v_want)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(np.asarray(out).astype(np.float64), want, rtol=0, atol=TOL["bfloat16"] * scale)
