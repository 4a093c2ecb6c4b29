"""fp8 (e4m3) KV caches in cuflash.decode (issue 53 item 4), against the float64 reference
(cuflash.reference.decode with kv_dtype="float8_e4m3fn", whose semantics tests/cpu/test_reference_kv_formats.py
checks).

The caches hold e4m3 bytes (uint8; CuPy has no float8 dtype) standing for value * scale, a float32 scale
per tensor or per kv head; q / out / k_new / v_new are float16 or bfloat16. Appended rows are quantised
(x / scale rounded to nearest even on e4m3's grid, saturated at 448, NaN kept) into the cache and attended
as quantised: the bytes must equal the reference's bit for bit.

Cases: contiguous caches and paged ones of page sizes 16, 64 and 3; unsplit, 3 splits and the heuristic;
scales per tensor (a Python float, or a CUDA 0-d array) and per kv head (a CUDA (Hk,) array); with and
without appended tokens; sequence lengths drawn with 0 among them. Fresh data every run (the seed is in
the failure message); outputs are NaN-poisoned ``out=`` / ``lse=`` buffers. Every one of the 256 byte
values goes through the conversion (one visible key: out is the value itself, exactly); the torch path
with torch.float8_e4m3fn tensors gives the CuPy path's bits.

Accuracy: the kernel converts the bytes to fp16 exactly (bf16 q rows scaled by a power of two into
fp16's range) and applies the scales in float32, so its error is that of a 16-bit decode (P rounded
to fp16 for the P V product; the bound keeps bf16's): out within
4e-3 (fp16) / 2e-2 (bf16) of the reference relative to the values' scale, lse within 1e-3.

Run: ``python -m pytest -q tests/gpu/test_decode_fp8.py`` (skipped without a GPU).
"""

import ml_dtypes
import numpy as np
import pytest

from tests.gpu._hardware import gpu_available as _gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy")]

if _gpu_available():
    import cupy

import cuflash  # noqa: E402
from cuflash import reference  # noqa: E402

FP8 = "float8_e4m3fn"
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
TOL = {"float16": 4e-3, "bfloat16": 2e-2}


def _quantise(x, scale):
    return np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _case(rng, *, dtype, page_size, per_head, append, B=3, Sq=2, Hq=8, Hk=2, D=128, capacity=200):
    """Host arrays of one decode call: raw e4m3 caches (garbage bytes past each sequence), lengths with a
    0 among them, a page table (paged), new rows with values that saturate and that are subnormal."""
    k_scale = rng.uniform(0.005, 0.05, Hk).astype(np.float32) if per_head else np.float32(0.03125)
    v_scale = rng.uniform(0.005, 0.05, Hk).astype(np.float32) if per_head else np.float32(0.0175)
    ks = k_scale.reshape(1, 1, Hk, 1) if per_head else k_scale
    vs = v_scale.reshape(1, 1, Hk, 1) if per_head else v_scale
    s_new = Sq if append else 0
    lens = rng.integers(0, capacity - s_new + 1, B)
    lens[rng.integers(B)] = 0
    if page_size is None:
        shape, table = (B, capacity, Hk, D), None
    else:
        max_pages = -(-capacity // page_size)
        pages = B * max_pages + 3
        table = rng.permutation(pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
        shape = (pages, page_size, Hk, D)
    k_cache = _quantise(rng.standard_normal(shape), ks)
    v_cache = _quantise(rng.standard_normal(shape), vs)
    # Slots past the sequences hold NaN bytes: never read into a result.
    for cache in (k_cache, v_cache):
        for b in range(B):
            for pos in range(int(lens[b]), capacity):
                where = (b, pos) if table is None else (table[b, pos // page_size], pos % page_size)
                cache[where] = 0x7f
    q = rng.standard_normal((B, Sq, Hq, D)).astype(DTYPES[dtype])
    k_new = v_new = None
    if append:
        k_new = rng.standard_normal((B, s_new, Hk, D)).astype(DTYPES[dtype])
        v_new = rng.standard_normal((B, s_new, Hk, D)).astype(DTYPES[dtype])
        k_new[0, 0, 0, :4] = [1000, -1000, 1e-5, -0.0]   # saturates at 448 * scale; subnormal; -0
        v_new[-1, -1, -1, :3] = [-2000, 3e-6, 0.0]
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, lens=lens.astype(np.int32), table=table, k_new=k_new,
                v_new=v_new, k_scale=k_scale, v_scale=v_scale)


def _gpu(x):
    return None if x is None else cupy.asarray(x)


def _scale_arg(scale, per_head, as_array):
    if per_head or as_array:
        return cupy.asarray(scale, dtype=cupy.float32)
    return float(scale)


def _run(case, *, num_splits, scale_array=False):
    per_head = np.ndim(case["k_scale"]) == 1
    k_cache, v_cache = _gpu(case["k_cache"]), _gpu(case["v_cache"])
    q = _gpu(case["q"])
    B, Sq, Hq, D = q.shape
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    lse = cupy.full((B, Hq, Sq), np.nan, dtype=cupy.float32)
    cuflash.decode(q, k_cache, v_cache, cache_seqlens=_gpu(case["lens"]), block_table=_gpu(case["table"]),
                   k_new=_gpu(case["k_new"]), v_new=_gpu(case["v_new"]), num_splits=num_splits, kv_dtype=FP8,
                   k_scale=_scale_arg(case["k_scale"], per_head, scale_array),
                   v_scale=_scale_arg(case["v_scale"], per_head, scale_array), out=out, lse=lse)
    return out, lse, k_cache.get(), v_cache.get()


def _expected(case):
    to64 = lambda x: None if x is None else np.asarray(x).astype(np.float64)  # noqa: E731
    return reference.decode(to64(case["q"]), case["k_cache"], case["v_cache"], cache_seqlens=case["lens"],
                            block_table=case["table"], k_new=to64(case["k_new"]), v_new=to64(case["v_new"]),
                            kv_dtype=FP8, k_scale=case["k_scale"], v_scale=case["v_scale"], return_cache=True)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("page_size", [None, 16, 64, 3])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("append", [False, True])
def test_fp8_decode_matches_the_reference(dtype, page_size, num_splits, per_head, append):
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    case = _case(rng, dtype=dtype, page_size=page_size, per_head=per_head, append=append)
    out, lse, k_after, v_after = _run(case, num_splits=num_splits, scale_array=bool(seed % 2))
    want, want_lse, k_want, v_want = _expected(case)
    msg = f"seed {seed}"
    np.testing.assert_array_equal(k_after, k_want, err_msg=msg)   # the appended bytes, bit for bit
    np.testing.assert_array_equal(v_after, v_want, err_msg=msg)
    got = cupy.asnumpy(out).astype(np.float64)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * scale, err_msg=msg)
    np.testing.assert_allclose(cupy.asnumpy(lse), want_lse, rtol=1e-4, atol=1e-3, err_msg=msg)
    empty = case["lens"] + (case["q"].shape[1] if append else 0) == 0
    assert (got[empty] == 0).all() and np.isneginf(cupy.asnumpy(lse)[empty]).all(), msg


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("paged", [False, True])
def test_every_byte_converts_exactly(dtype, paged):
    # One visible key: out is that key's value, v_raw * v_scale, exactly (with v_scale = 1 every e4m3
    # value is an fp16 and a bf16 value). Row b holds bytes 0..255 across its 256 columns, rotated by b;
    # the NaN bytes (0x7f, 0xff) give NaN in their columns, as in the reference.
    B, Hk, Hq, D = 4, 1, 2, 256
    raw = np.stack([np.roll(np.arange(256, dtype=np.uint8), b) for b in range(B)])
    v_cache = np.zeros((B, 4, Hk, D), np.uint8)
    v_cache[:, 0, 0] = raw
    k_cache = np.full((B, 4, Hk, D), 0x38, np.uint8)   # 1.0
    table = None
    if paged:
        table = np.arange(B, dtype=np.int32).reshape(B, 1)
    q = np.ones((B, 1, Hq, D), DTYPES[dtype])
    case = dict(q=q, k_cache=k_cache, v_cache=v_cache, lens=np.ones(B, np.int32), table=table, k_new=None,
                v_new=None, k_scale=np.float32(1 / 256), v_scale=np.float32(1.0))
    out, lse, _, _ = _run(case, num_splits=1)
    want = raw.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    got = cupy.asnumpy(out).astype(np.float64)[:, 0]
    for h in range(Hq):
        np.testing.assert_array_equal(got[:, h], want)


def test_appended_nan_and_saturation_bytes():
    rng = np.random.default_rng()
    case = _case(rng, dtype="float16", page_size=16, per_head=True, append=True)
    case["k_new"][1, 0, 1, :3] = [np.nan, -np.nan, np.inf]
    _, _, k_after, _ = _run(case, num_splits=1)
    _, _, k_want, _ = _expected(case)
    np.testing.assert_array_equal(k_after, k_want)


def test_fp8_checks_name_the_argument():
    q = cupy.zeros((1, 1, 2, 64), cupy.float16)
    raw = cupy.zeros((1, 8, 1, 64), cupy.uint8)
    half = cupy.zeros((1, 8, 1, 64), cupy.float16)
    with pytest.raises(TypeError, match="kv_dtype"):
        cuflash.decode(q, raw, raw)
    with pytest.raises(TypeError, match="k_cache must hold the e4m3 bytes as uint8"):
        cuflash.decode(q, half, half, kv_dtype=FP8, k_scale=1.0, v_scale=1.0)
    with pytest.raises(TypeError, match="q is float32"):
        cuflash.decode(q.astype(cupy.float32), raw, raw, kv_dtype=FP8, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="kv_dtype must be None or one of"):
        cuflash.decode(q, raw, raw, kv_dtype="float8_e5m2", k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="k_scale is required"):
        cuflash.decode(q, raw, raw, kv_dtype=FP8, v_scale=1.0)
    with pytest.raises(ValueError, match=r"v_scale must be a scalar or have shape \(1,\) or \(1,\)"):
        cuflash.decode(q, raw, raw, kv_dtype=FP8, k_scale=1.0, v_scale=cupy.ones(3, cupy.float32))
    with pytest.raises(TypeError, match="k_scale must be float32"):
        cuflash.decode(q, raw, raw, kv_dtype=FP8, k_scale=cupy.ones(1, cupy.float64), v_scale=1.0)
    with pytest.raises(ValueError, match="k_scale must be a finite float32 scale > 0"):
        cuflash.decode(q, raw, raw, kv_dtype=FP8, k_scale=0.0, v_scale=1.0)
    with pytest.raises(ValueError, match="need kv_dtype"):
        cuflash.decode(q, half, half, k_scale=1.0)


def test_torch_float8_caches_give_the_cupy_bits():
    torch = pytest.importorskip("torch")
    import cuflash.interop.torch as ct

    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    rng = np.random.default_rng()
    for page_size, per_head in ((None, False), (16, True)):
        case = _case(rng, dtype="bfloat16", page_size=page_size, per_head=per_head, append=True)
        out, lse, k_after, v_after = _run(case, num_splits=0)
        dev = "cuda"
        t = lambda x: torch.from_numpy(np.asarray(x)).to(dev)  # noqa: E731
        q = t(case["q"].view(np.uint16)).view(torch.bfloat16)
        k_new = t(case["k_new"].view(np.uint16)).view(torch.bfloat16)
        v_new = t(case["v_new"].view(np.uint16)).view(torch.bfloat16)
        k_cache = t(case["k_cache"]).view(torch.float8_e4m3fn)
        v_cache = t(case["v_cache"]).view(torch.float8_e4m3fn)
        scales = dict(k_scale=t(case["k_scale"]) if per_head else float(case["k_scale"]),
                      v_scale=t(case["v_scale"]) if per_head else float(case["v_scale"]))
        table = None if case["table"] is None else t(case["table"])
        for call in (ct.decode, ct.ops.decode):
            kc, vc = k_cache.clone(), v_cache.clone()
            got, got_lse = call(q, kc, vc, cache_seqlens=t(case["lens"]), block_table=table, k_new=k_new,
                                v_new=v_new, return_lse=True, **scales)
            torch.cuda.synchronize()
            np.testing.assert_array_equal(kc.view(torch.uint8).cpu().numpy(), k_after)
            np.testing.assert_array_equal(vc.view(torch.uint8).cpu().numpy(), v_after)
            np.testing.assert_array_equal(got.view(torch.uint16).cpu().numpy(), cupy.asnumpy(out).view(np.uint16))
            np.testing.assert_array_equal(got_lse.cpu().numpy(), cupy.asnumpy(lse))
