"""Argument checking of the public API (docs/design.md §2, "Errors").

Every bad input must be rejected before any GPU work with a TypeError (type, dtype) or a
ValueError (shape, value) whose message names the argument; an ``out=`` (or ``lse=``) buffer
must come back untouched. The error cases below each poison the output buffer with NaN first
and check afterwards that it is still all NaN.

The first section runs anywhere (host arrays are rejected before CuPy touches a device); the
rest needs CUDA arrays and is marked ``gpu`` (skipped cleanly without a GPU). None of the error
cases launches or even compiles a kernel; the few "not an error" cases at the end do.
"""

import math
import re

import numpy as np
import pytest

import cupy

import cuflash


def _gpu_available():
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # CUDARuntimeError without a driver, ImportError of libcuda, ...
        return False


HAS_GPU = _gpu_available()


def gpu_test(fn):
    """Mark a test ``gpu`` and skip it cleanly when CuPy finds no device."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")(fn))


def _force_kernel(family):
    """``cuflash.force_kernel`` (the spec also names it ``cuflash.attention.force_kernel``;
    the package attribute ``attention`` is the function, so look the module up by name)."""
    if hasattr(cuflash, "force_kernel"):
        return cuflash.force_kernel(family)
    import importlib
    return importlib.import_module("cuflash.attention").force_kernel(family)


# --------------------------------------------------------------------------- no GPU needed

B, SQ, SK, HQ, HK, D = 2, 17, 33, 4, 2, 64


def _host_qkv():
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal(s).astype(np.float16)
                 for s in ((B, SQ, HQ, D), (B, SK, HK, D), (B, SK, HK, D)))


@pytest.mark.parametrize("fn", ["attention", "attention_forward"])
def test_host_arrays_are_not_cuda_arrays(fn):
    # NumPy arrays speak DLPack too, but on the CPU: they must be refused, not silently copied.
    q, k, v = _host_qkv()
    with pytest.raises(TypeError, match=r"\bq\b.*CUDA|CUDA.*\bq\b"):
        getattr(cuflash, fn)(q, k, v)


def test_lists_are_not_cuda_arrays():
    q, k, v = (x.tolist() for x in _host_qkv())
    with pytest.raises(TypeError, match=r"\bq\b"):
        cuflash.attention(q, k, v)


def test_varlen_host_arrays_are_not_cuda_arrays():
    q, k, v = (x.reshape(-1, x.shape[2], x.shape[3]) for x in _host_qkv())
    cu_q = np.array([0, SQ, 2 * SQ], dtype=np.int32)
    cu_k = np.array([0, SK, 2 * SK], dtype=np.int32)
    with pytest.raises(TypeError, match=r"\bq\b"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k)


# --------------------------------------------------------------------------- GPU: dense API

class _Inputs:
    """Valid fp16 inputs of shape (B, S, H, D) plus factories for bad variants."""

    def __init__(self, dtype=np.float16):
        self.dtype = np.dtype(dtype)
        self.q = self.rand((B, SQ, HQ, D))
        self.k = self.rand((B, SK, HK, D))
        self.v = self.rand((B, SK, HK, D))

    def rand(self, shape, dtype=None):
        x = cupy.random.standard_normal(shape, dtype=cupy.float32)
        return x.astype(self.dtype if dtype is None else dtype)

    @staticmethod
    def ones_bool(shape):
        return cupy.ones(shape, dtype=bool)


def _bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


# name -> (overrides(c) -> dict of arguments replacing the valid ones, exception, regexes that
# must all match the message). The first regex names the argument.
NAN = float("nan")
DENSE_CASES = {
    # shapes of q, k, v
    "q_rank3": (lambda c: dict(q=c.rand((B, SQ, HQ * D))), ValueError, [r"\bq\b"]),
    "k_rank5": (lambda c: dict(k=c.rand((B, SK, HK, D, 1))), ValueError, [r"\bk\b"]),
    "v_rank3": (lambda c: dict(v=c.rand((B, SK, HK * D))), ValueError, [r"\bv\b"]),
    "k_batch": (lambda c: dict(k=c.rand((B + 1, SK, HK, D)), v=c.rand((B + 1, SK, HK, D))),
                ValueError, [r"\bk\b"]),
    "v_batch": (lambda c: dict(v=c.rand((B + 1, SK, HK, D))), ValueError, [r"\bv\b"]),
    "v_seqlen": (lambda c: dict(v=c.rand((B, SK + 1, HK, D))), ValueError, [r"\bv\b"]),
    "v_heads": (lambda c: dict(v=c.rand((B, SK, 2 * HK, D))), ValueError, [r"\bv\b"]),
    "k_head_dim": (lambda c: dict(k=c.rand((B, SK, HK, D // 2))), ValueError, [r"\bk\b"]),
    "v_head_dim_over_256": (lambda c: dict(v=c.rand((B, SK, HK, 264))), ValueError, [r"\bv\b", r"256|264"]),
    # v may have a head dim of its own; out must then have it
    "out_head_dim_of_q": (lambda c: dict(v=c.rand((B, SK, HK, D // 2))), ValueError,
                          [r"\bout\b", rf"\({B}, {SQ}, {HQ}, {D // 2}\)"]),
    "heads_not_divisible": (lambda c: dict(k=c.rand((B, SK, 3, D)), v=c.rand((B, SK, 3, D))),
                            ValueError, [r"(?i)head"]),
    "head_dim_over_256": (lambda c: dict(q=c.rand((B, SQ, HQ, 264)), k=c.rand((B, SK, HK, 264)),
                                         v=c.rand((B, SK, HK, 264))),
                          ValueError, [r"(?i)head.?dim|\bD\b", r"256|264"]),
    # dtypes
    "k_dtype_mismatch": (lambda c: dict(k=c.rand((B, SK, HK, D), _bf16())), TypeError,
                         [r"\bk\b|dtype"]),
    "v_dtype_mismatch": (lambda c: dict(v=c.rand((B, SK, HK, D), np.float32)), TypeError,
                         [r"\bv\b|dtype"]),
    "float64": (lambda c: {n: c.rand(getattr(c, n).shape, np.float64) for n in "qkv"},
                TypeError, [r"\bq\b|dtype", r"float64"]),
    "int32": (lambda c: {n: cupy.ones(getattr(c, n).shape, np.int32) for n in "qkv"},
              TypeError, [r"\bq\b|dtype", r"int32"]),
    # scale
    "scale_zero": (lambda c: dict(scale=0.0), ValueError, [r"scale"]),
    "scale_negative": (lambda c: dict(scale=-0.5), ValueError, [r"scale", r"-0\.5"]),
    "scale_nan": (lambda c: dict(scale=NAN), ValueError, [r"scale"]),
    # window
    "window_left_below_minus_one": (lambda c: dict(window=(-2, 0)), ValueError, [r"window"]),
    "window_right_below_minus_one": (lambda c: dict(window=(4, -3)), ValueError, [r"window"]),
    "window_one_entry": (lambda c: dict(window=(3,)), ValueError, [r"window"]),
    "window_three_entries": (lambda c: dict(window=(1, 2, 3)), ValueError, [r"window"]),
    # softcap
    "softcap_negative": (lambda c: dict(softcap=-1.0), ValueError, [r"softcap"]),
    "softcap_nan": (lambda c: dict(softcap=NAN), ValueError, [r"softcap"]),
    # alibi_slopes: float32, (Hq,) or (B, Hq)
    "alibi_heads": (lambda c: dict(alibi_slopes=cupy.ones((HQ + 1,), np.float32)), ValueError,
                    [r"alibi_slopes"]),
    "alibi_kv_heads": (lambda c: dict(alibi_slopes=cupy.ones((HK,), np.float32)), ValueError,
                       [r"alibi_slopes"]),
    "alibi_batch": (lambda c: dict(alibi_slopes=cupy.ones((B + 1, HQ), np.float32)), ValueError,
                    [r"alibi_slopes"]),
    "alibi_rank3": (lambda c: dict(alibi_slopes=cupy.ones((1, B, HQ), np.float32)), ValueError,
                    [r"alibi_slopes"]),
    "alibi_dtype": (lambda c: dict(alibi_slopes=cupy.ones((HQ,), np.float16)), TypeError,
                    [r"alibi_slopes"]),
    # mask: bool, broadcastable to (B, Hq, Sq, Sk)
    "mask_uint8": (lambda c: dict(mask=cupy.ones((B, HQ, SQ, SK), np.uint8)), TypeError,
                   [r"mask"]),
    "mask_float": (lambda c: dict(mask=cupy.ones((SQ, SK), np.float32)), TypeError, [r"mask"]),
    "mask_keys": (lambda c: dict(mask=c.ones_bool((B, HQ, SQ, SK + 1))), ValueError, [r"mask"]),
    "mask_kv_heads": (lambda c: dict(mask=c.ones_bool((1, HK, SQ, SK))), ValueError, [r"mask"]),
    "mask_rank5": (lambda c: dict(mask=c.ones_bool((1, B, HQ, SQ, SK))), ValueError, [r"mask"]),
    # bias: float, broadcastable to (B, Hq, Sq, Sk)
    "bias_int": (lambda c: dict(bias=cupy.zeros((B, HQ, SQ, SK), np.int32)), TypeError,
                 [r"bias"]),
    "bias_bool": (lambda c: dict(bias=c.ones_bool((SQ, SK))), TypeError, [r"bias"]),
    "bias_rows": (lambda c: dict(bias=cupy.zeros((B, HQ, SQ + 1, SK), np.float32)), ValueError,
                  [r"bias"]),
    "bias_batch": (lambda c: dict(bias=cupy.zeros((B + 1, 1, 1, 1), np.float32)), ValueError,
                   [r"bias"]),
    # block_mask: bool (B|1, H|1, ceil(Sq/bq), ceil(Sk/bk)); here ceil(17/16) = 2, ceil(33/16) = 3
    "block_mask_blocks": (lambda c: dict(block_mask=c.ones_bool((B, HQ, 2, 2)),
                                         block_size=(16, 16)), ValueError, [r"block_mask"]),
    "block_mask_default_size": (lambda c: dict(block_mask=c.ones_bool((1, 1, 2, 1))), ValueError,
                                [r"block_mask"]),
    "block_mask_uint8": (lambda c: dict(block_mask=cupy.ones((1, 1, 2, 3), np.uint8),
                                        block_size=(16, 16)), TypeError, [r"block_mask"]),
    "block_size_zero": (lambda c: dict(block_mask=c.ones_bool((1, 1, 1, 1)), block_size=(0, 128)),
                        ValueError, [r"block_size"]),
    "block_size_negative": (lambda c: dict(block_mask=c.ones_bool((1, 1, 1, 1)),
                                           block_size=(-16, 16)), ValueError, [r"block_size"]),
    "block_size_one_entry": (lambda c: dict(block_mask=c.ones_bool((1, 1, 1, 1)),
                                            block_size=(128,)), ValueError, [r"block_size"]),
    # dropout
    "dropout_negative": (lambda c: dict(dropout_p=-0.1), ValueError, [r"dropout_p"]),
    "dropout_one": (lambda c: dict(dropout_p=1.0), ValueError, [r"dropout_p"]),
    "dropout_nan": (lambda c: dict(dropout_p=NAN), ValueError, [r"dropout_p"]),
    "generator_int": (lambda c: dict(dropout_p=0.1, generator=42), TypeError, [r"generator"]),
    "generator_numpy": (lambda c: dict(dropout_p=0.1, generator=np.random.default_rng(0)),
                        TypeError, [r"generator"]),
    # out
    "out_shape": (lambda c: dict(out=cupy.full((B, SQ, HQ, D + 8), NAN, c.dtype)), ValueError,
                  [r"\bout\b"]),
    "out_dtype": (lambda c: dict(out=cupy.full((B, SQ, HQ, D), NAN, np.float32)), TypeError,
                  [r"\bout\b"]),
    "out_not_contiguous": (lambda c: dict(out=cupy.full((B, HQ, SQ, D), NAN, c.dtype)
                                          .transpose(0, 2, 1, 3)), ValueError, [r"\bout\b"]),
    "out_host": (lambda c: dict(out=np.full((B, SQ, HQ, D), NAN, c.dtype)), TypeError,
                 [r"\bout\b"]),
}

# attention_forward only: the lse= buffer, float32 (B, Hq, Sq), C-contiguous.
LSE_CASES = {
    "lse_shape": (lambda c: dict(lse=cupy.full((B, HQ, SQ + 1), NAN, np.float32)), ValueError,
                  [r"\blse\b"]),
    "lse_bshq_layout": (lambda c: dict(lse=cupy.full((B, SQ, HQ), NAN, np.float32)), ValueError,
                        [r"\blse\b"]),
    "lse_dtype": (lambda c: dict(lse=cupy.full((B, HQ, SQ), NAN, np.float16)), TypeError,
                  [r"\blse\b"]),
    "lse_not_contiguous": (lambda c: dict(lse=cupy.full((B, SQ, HQ), NAN, np.float32)
                                          .transpose(0, 2, 1)), ValueError, [r"\blse\b"]),
}


def _check_message(excinfo, patterns):
    msg = str(excinfo.value)
    for pat in patterns:
        assert re.search(pat, msg), f"message {msg!r} does not match {pat!r}"


def _untouched(buf):
    """The poisoned buffer is still entirely NaN (nothing was written before the error)."""
    if isinstance(buf, np.ndarray):
        assert np.isnan(buf.astype(np.float32)).all()
    else:
        assert bool(cupy.isnan(buf.astype(cupy.float32)).all())


def _call_expecting(call, exc, patterns, buffers):
    """``call()`` raises ``exc`` whose message matches ``patterns``; ``buffers`` stay NaN."""
    with pytest.raises(exc) as excinfo:
        call()
    _check_message(excinfo, patterns)
    cupy.cuda.get_current_stream().synchronize()
    for buf in buffers:
        _untouched(buf)


@gpu_test
@pytest.mark.parametrize("case", sorted(DENSE_CASES))
@pytest.mark.parametrize("fn", ["attention", "attention_forward"])
def test_dense_argument_errors(case, fn):
    build, exc, patterns = DENSE_CASES[case]
    c = _Inputs()
    args = dict(q=c.q, k=c.k, v=c.v, out=cupy.full((B, SQ, HQ, D), NAN, c.dtype))
    args.update(build(c))
    buffers = [args["out"]]
    if fn == "attention_forward":
        args["lse"] = cupy.full((B, HQ, SQ), NAN, np.float32)
        buffers.append(args["lse"])
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    _call_expecting(lambda: getattr(cuflash, fn)(q, k, v, **args), exc, patterns, buffers)


@gpu_test
@pytest.mark.parametrize("case", sorted(LSE_CASES))
def test_lse_buffer_errors(case):
    build, exc, patterns = LSE_CASES[case]
    c = _Inputs()
    out = cupy.full((B, SQ, HQ, D), NAN, c.dtype)
    args = build(c)
    _call_expecting(lambda: cuflash.attention_forward(c.q, c.k, c.v, out=out, **args), exc,
                    patterns, [out, args["lse"]])


@gpu_test
@pytest.mark.parametrize("which", ["k", "v"])
def test_host_array_among_cuda_arrays(which):
    c = _Inputs()
    args = dict(q=c.q, k=c.k, v=c.v)
    args[which] = cupy.asnumpy(args[which])
    out = cupy.full((B, SQ, HQ, D), NAN, c.dtype)
    _call_expecting(lambda: cuflash.attention(args["q"], args["k"], args["v"], out=out),
                    TypeError, [rf"\b{which}\b"], [out])


@gpu_test
@pytest.mark.parametrize("family, dtype", [("fwd_simt", np.float16), ("fwd_simt", "bf16"),
                                           ("fwd_sm80", np.float32)])
def test_force_impossible_kernel(family, dtype):
    c = _Inputs(_bf16() if dtype == "bf16" else dtype)
    out = cupy.full((B, SQ, HQ, D), NAN, c.dtype)
    with pytest.raises(ValueError, match=family):
        with _force_kernel(family):
            cuflash.attention(c.q, c.k, c.v, out=out)
    _untouched(out)


@gpu_test
def test_force_unknown_kernel():
    c = _Inputs()
    with pytest.raises(ValueError, match="no_such_family"):
        with _force_kernel("no_such_family"):
            cuflash.attention(c.q, c.k, c.v)


# --------------------------------------------------------------------------- GPU: varlen

TOTAL_Q, TOTAL_K = 30, 40
CU_Q, CU_K = [0, 10, 10, 30], [0, 15, 15, 40]   # three sequences, the middle one empty


def _cu(values, dtype=np.int32):
    return cupy.asarray(np.asarray(values, dtype=dtype))


VARLEN_CASES = {
    "cu_seqlens_q_int64": (lambda c: dict(cu_seqlens_q=_cu(CU_Q, np.int64)), TypeError,
                           [r"cu_seqlens_q"]),
    "cu_seqlens_k_float": (lambda c: dict(cu_seqlens_k=_cu(CU_K, np.float32)), TypeError,
                           [r"cu_seqlens_k"]),
    "cu_seqlens_lengths_differ": (lambda c: dict(cu_seqlens_k=_cu([0, 15, 40])), ValueError,
                                  [r"cu_seqlens"]),
    "cu_seqlens_q_rank2": (lambda c: dict(cu_seqlens_q=_cu([CU_Q])), ValueError,
                           [r"cu_seqlens_q"]),
    "cu_seqlens_q_decreasing": (lambda c: dict(cu_seqlens_q=_cu([0, 20, 10, 30])), ValueError,
                                [r"cu_seqlens_q"]),
    "cu_seqlens_k_decreasing": (lambda c: dict(cu_seqlens_k=_cu([0, 15, 14, 40])), ValueError,
                                [r"cu_seqlens_k"]),
    "cu_seqlens_q_past_total": (lambda c: dict(cu_seqlens_q=_cu([0, 10, 10, TOTAL_Q + 1])),
                                ValueError, [r"cu_seqlens_q"]),
    "cu_seqlens_k_past_total": (lambda c: dict(cu_seqlens_k=_cu([0, 15, 15, TOTAL_K + 1])),
                                ValueError, [r"cu_seqlens_k"]),
    "cu_seqlens_q_negative_start": (lambda c: dict(cu_seqlens_q=_cu([-1, 10, 10, 30])),
                                    ValueError, [r"cu_seqlens_q"]),
    "max_seqlen_q_too_small": (lambda c: dict(max_seqlen_q=5), ValueError, [r"max_seqlen_q"]),
    "max_seqlen_k_too_small": (lambda c: dict(max_seqlen_k=5), ValueError, [r"max_seqlen_k"]),
    "q_rank4": (lambda c: dict(q=c.rand((1, TOTAL_Q, HQ, D))), ValueError, [r"\bq\b"]),
    "k_total_differs_from_v": (lambda c: dict(v=c.rand((TOTAL_K + 1, HK, D))), ValueError,
                               [r"\bv\b"]),
    "heads_not_divisible": (lambda c: dict(k=c.rand((TOTAL_K, 3, D)), v=c.rand((TOTAL_K, 3, D))),
                            ValueError, [r"(?i)head"]),
    "k_dtype_mismatch": (lambda c: dict(k=c.rand((TOTAL_K, HK, D), np.float32)), TypeError,
                         [r"\bk\b|dtype"]),
    "alibi_batch": (lambda c: dict(alibi_slopes=cupy.ones((2, HQ), np.float32)), ValueError,
                    [r"alibi_slopes"]),
    "window_below_minus_one": (lambda c: dict(window=(-3, 0)), ValueError, [r"window"]),
    "dropout_one": (lambda c: dict(dropout_p=1.0), ValueError, [r"dropout_p"]),
    "out_shape": (lambda c: dict(out=cupy.full((TOTAL_Q, HQ, D + 8), NAN, c.dtype)), ValueError,
                  [r"\bout\b"]),
    # mask, bias and block_mask do not exist in varlen: a clear ValueError, not silence.
    "mask": (lambda c: dict(mask=c.ones_bool((1, 1, 1, 1))), ValueError, [r"mask"]),
    "bias": (lambda c: dict(bias=cupy.zeros((1, 1, 1, 1), np.float32)), ValueError, [r"bias"]),
    "block_mask": (lambda c: dict(block_mask=c.ones_bool((1, 1, 1, 1))), ValueError,
                   [r"block_mask"]),
}


@gpu_test
@pytest.mark.parametrize("case", sorted(VARLEN_CASES))
def test_varlen_argument_errors(case):
    build, exc, patterns = VARLEN_CASES[case]
    c = _Inputs()
    args = dict(q=c.rand((TOTAL_Q, HQ, D)), k=c.rand((TOTAL_K, HK, D)),
                v=c.rand((TOTAL_K, HK, D)), cu_seqlens_q=_cu(CU_Q), cu_seqlens_k=_cu(CU_K),
                out=cupy.full((TOTAL_Q, HQ, D), NAN, c.dtype))
    args.update(build(c))
    pos = [args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
    # Offsets stay on the GPU and are checked there: check=True raises a bad value at this call
    # (tests/gpu/test_host_path.py covers the deferred report).
    _call_expecting(lambda: cuflash.attention_varlen(*pos, **args, check=True), exc, patterns,
                    [args["out"]])


# --------------------------------------------------------------------------- not errors

@gpu_test
def test_last_axis_not_contiguous_is_copied():
    # docs/design.md §2: only the last axis must be contiguous; otherwise the input is copied.
    c = _Inputs()
    wide = [c.rand(x.shape[:3] + (2 * D,)) for x in (c.q, c.k, c.v)]
    strided = [w[..., ::2] for w in wide]
    assert not any(s.flags.c_contiguous for s in strided)
    got = cuflash.attention(*strided, causal=True)
    want = cuflash.attention(*(cupy.ascontiguousarray(s) for s in strided), causal=True)
    cupy.testing.assert_array_equal(got, want)


@gpu_test
def test_accepted_edge_values():
    # Boundary values that are legal: unbounded window, zero softcap, p = 0, tiny scale.
    c = _Inputs()
    base = cuflash.attention(c.q, c.k, c.v)
    same = cuflash.attention(c.q, c.k, c.v, window=(-1, -1), softcap=0.0, dropout_p=0.0,
                             scale=1.0 / math.sqrt(D))
    # Equivalent options; a different code path may round differently, by an ulp or so.
    cupy.testing.assert_allclose(base.astype(cupy.float32), same.astype(cupy.float32),
                                 rtol=0, atol=2e-3)
    tiny = cuflash.attention(c.q, c.k, c.v, scale=1e-30)
    assert bool(cupy.isfinite(tiny.astype(cupy.float32)).all())
