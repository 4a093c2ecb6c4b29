"""fp8 (e4m3) caches in cuflash.decode without a GPU (issue 53 item 4): the arguments and their checks,
the fp8 variants (CUFLASH_KV_FP8, only they carry it), the kernel's parameters, and NumPy emulations of
the two conversions cuda_src/decode.cu does, bit for bit against ml_dtypes (what the reference uses):
e4m3 -> fp16/bf16 (e4m3_pair_to: the magnitude bits shifted into the 16-bit fields, one multiply by
2^8 / 2^120) and x / scale -> e4m3 (quantize_e4m3: float32 quotient, saturation, round to nearest
even on e4m3's grid).

NVRTC compiles the fp8 decode variants for sm_80 and sm_90a with zero spills in tests/cpu/test_compile.py
(the catalogue's ci_variants include them). The kernel against the reference: tests/gpu/test_decode_fp8.py.
"""

import inspect

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import _checks, kernels
from cuflash._runtime.params import DECODE

F8 = ml_dtypes.float8_e4m3fn


def _pair_to_16bit(byte, target):
    """e4m3_pair_to for one byte: sign | magnitude bits shifted into the 16-bit fields (NaN: all-ones
    exponent), times 2^8 (fp16) or 2^120 (bf16) in that type."""
    b = np.uint32(byte)
    t = b << 8
    mag = t & 0x7f00
    nan = ((mag + 0x0100) & 0x8000) >> 15
    if target == "float16":
        h = (t & 0x8000) | (mag >> 1) | nan * 0x7c00
        return np.array([h], np.uint16).view(np.float16)[0] * np.float16(256)
    h = (t & 0x8000) | (mag >> 4) | nan * 0x7f80
    return np.array([h], np.uint16).view(ml_dtypes.bfloat16)[0] * ml_dtypes.bfloat16(2.0 ** 120)


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_the_conversion_of_every_byte_is_exact(target):
    for byte in range(256):
        want = np.array([byte], np.uint8).view(F8).astype(np.float64)[0]
        got = np.float64(_pair_to_16bit(byte, target))
        assert (np.isnan(want) and np.isnan(got)) or (got == want and np.signbit(got) == np.signbit(want)), byte


def _quantise_like_the_kernel(x, scale):
    v = (np.asarray(x, np.float32) / np.float32(scale)).astype(np.float32)
    sign = ((v.view(np.uint32) >> 24) & 0x80).astype(np.uint32)
    a = np.minimum(np.abs(v), np.float32(448))
    e = np.maximum(((a.view(np.uint32) >> 23) & 0xff).astype(np.int64) - 127, -6)
    with np.errstate(invalid="ignore"):
        n = np.rint(a * np.ldexp(np.float32(1), 3 - e).astype(np.float32))
        byte = (((e + 6) << 3) + np.nan_to_num(n).astype(np.int64)).astype(np.uint32) | sign
    byte = np.where(np.isnan(v), sign | 0x7f, byte)
    return byte.astype(np.uint8)


def test_the_quantisation_equals_the_reference_bit_for_bit():
    rng = np.random.default_rng()
    x = (rng.standard_normal(200_000) * 10.0 ** rng.uniform(-6, 4, 200_000)).astype(np.float16)
    grid = np.arange(256, dtype=np.uint8).view(F8).astype(np.float64)
    grid = np.sort(grid[np.isfinite(grid)])
    mids = (grid[1:] + grid[:-1]) / 2   # ties: to even
    x = np.concatenate([x.astype(np.float64), mids, mids * 0.03125, [np.inf, -np.inf, np.nan, -0.0, 0.0, 1e5]])
    for scale in (np.float32(1.0), np.float32(0.03125), np.float32(0.0137)):
        want = np.clip(x / np.float64(scale), -448, 448).astype(F8).view(np.uint8)
        got = _quantise_like_the_kernel(x.astype(np.float32), scale)
        same = (want == got) | (((want & 0x7f) == 0x7f) & ((got & 0x7f) == 0x7f))
        assert same.all(), (x[~same][:5], want[~same][:5], got[~same][:5])


def test_decode_takes_the_fp8_arguments():
    params = inspect.signature(cuflash.decode).parameters
    for name in ("kv_dtype", "k_scale", "v_scale"):
        assert params[name].default is None and params[name].kind is inspect.Parameter.KEYWORD_ONLY


def test_fp8_variants_carry_their_define_and_fit():
    plain = kernels.decode.decode_plan("bfloat16", 128, paged=True, score_mods=False)
    assert "CUFLASH_KV_FP8" not in dict(plain.variant.defines)
    for dtype in ("float16", "bfloat16"):
        for d in (64, 128, 192, 256):
            plan = kernels.decode.decode_plan(dtype, d, paged=True, score_mods=True, kv_dtype="float8_e4m3fn")
            assert dict(plan.variant.defines)["CUFLASH_KV_FP8"] == 1
            assert plan.smem_bytes + 1024 + 128 + 32 * plan.block_n <= 227 * 1024
    with pytest.raises(ValueError, match="float16 or bfloat16 queries"):
        kernels.decode.decode_plan("float32", 128, paged=False, score_mods=False, kv_dtype="float8_e4m3fn")
    variants = kernels.decode.decode_precompile_variants(kv_dtypes=(None, "float8_e4m3fn"))
    assert any(dict(v.defines).get("CUFLASH_KV_FP8") for v in variants)
    from cuflash.kernels.catalogue import ci_variants, reachable_variants

    # (Variants with user modifiers' source are compiled too; no call reaches them without those.)
    fp8 = {v for v, _ in ci_variants() if dict(v.defines).get("CUFLASH_KV_FP8") and not v.source}
    assert len(fp8) >= 12 and fp8 <= set(reachable_variants())


def test_the_scales_are_fields_of_decode_params():
    for name in ("k_scale", "v_scale", "k_scale_stride", "v_scale_stride", "k_scale_value", "v_scale_value"):
        assert name in DECODE.offsets
    packed = DECODE.unpack(DECODE.pack({"k_scale_value": 0.5, "v_scale_stride": 1}))
    assert packed["k_scale_value"] == 0.5 and packed["v_scale_stride"] == 1


def test_cache_dtype_checks_name_kv_dtype():
    S = _checks.Shaped
    q, raw, half = S((1, 1, 2, 64), np.float16), S((1, 8, 1, 64), np.uint8), S((1, 8, 1, 64), np.float16)
    with pytest.raises(TypeError, match="k_cache is uint8.*kv_dtype='float8_e4m3fn'"):
        _checks.check_decode_operands(q, raw, raw, False, 256)
    with pytest.raises(TypeError, match="v_cache must hold the e4m3 bytes as uint8"):
        _checks.check_decode_operands(q, raw, half, False, 256, kv_dtype="float8_e4m3fn")
    with pytest.raises(TypeError, match="q is float32"):
        _checks.check_decode_operands(S((1, 1, 2, 64), np.float32), raw, raw, False, 256, kv_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="kv_dtype must be None or one of"):
        _checks.check_decode_operands(q, raw, raw, False, 256, kv_dtype="float8_e5m2")
    assert _checks.check_decode_operands(q, raw, raw, False, 256, kv_dtype="float8_e4m3fn") == "float16"


def test_host_scales_are_float32_values():
    assert _checks.host_scale(0.1, "k_scale") == float(np.float32(0.1))
    assert _checks.host_scale(np.array([0.5], np.float32), "k_scale") == 0.5
    assert _checks.host_scale(np.ones(2), "k_scale") is None   # an array: an operand (must be on the GPU)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="k_scale must be a finite float32 scale > 0"):
            _checks.host_scale(bad, "k_scale")


def test_host_arrays_are_refused_before_anything_else():
    q = np.zeros((1, 1, 2, 64), np.float16)
    with pytest.raises(TypeError, match=r"\bq\b"):
        cuflash.decode(q, q.view(np.uint8), q.view(np.uint8), kv_dtype="float8_e4m3fn", k_scale=1.0, v_scale=1.0)
