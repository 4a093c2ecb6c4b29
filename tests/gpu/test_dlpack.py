"""Inputs from other frameworks through DLPack, and outputs back to them.

cuflash takes CuPy arrays or any CUDA array that speaks DLPack (``__dlpack__`` and
``__dlpack_device__``), imported zero-copy with ``cupy.from_dlpack``, which hands CuPy's current
stream to the producer so that its pending work is ordered before the kernel. Outputs are CuPy
arrays, which convert back zero-copy (``torch.from_dlpack``, ``jax.numpy.from_dlpack``).

torch and JAX are optional: their tests skip when the package (or its CUDA build) is missing.
"""

import os

import numpy as np
import pytest

import cupy

import cuflash
import cuflash.testing as tt
from cuflash import reference

# JAX would otherwise grab 75% of the GPU's memory at its first array, starving the CuPy tests
# that run after this module in the same process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
from tests.gpu._hardware import gpu_available as _gpu_available  # noqa: E402


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy")]

SHAPE = dict(B=2, Sq=77, Sk=143, Hq=4, Hk=2, D=64)


class DLPackOnly:
    """A CUDA array that exposes nothing but the DLPack protocol (no CuPy type, no
    ``__cuda_array_interface__``), as a third-party framework would."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, *args, **kwargs):
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def _check(q, k, v, out, lse=None, *, dtype, **options):
    """``out`` (and ``lse``) against the float64 reference; inputs given as CuPy arrays."""
    ref_out, ref_lse = reference.attention_forward(q, k, v, **options)
    base = tt.baseline_attention(q, k, v, **options) if dtype != "float32" else None
    tt.assert_attention_close(out, ref_out, base, dtype=dtype, name="out")
    if lse is not None:
        tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")


# ----------------------------------------------------------------------------- protocol only

@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_dlpack_only_inputs(dtype):
    q, k, v = tt.random_qkv(SHAPE, dtype, 1, xp=cupy)
    out, lse = cuflash.attention(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v), causal=True,
                                 return_lse=True)
    assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    # Same data as CuPy arrays, same kernel: the same bits.
    cupy.testing.assert_array_equal(out, cuflash.attention(q, k, v, causal=True))
    _check(q, k, v, out, lse, dtype=dtype, causal=True)


def test_dlpack_only_mixed_with_cupy_and_options():
    dtype = "bfloat16"
    q, k, v = tt.random_qkv(SHAPE, dtype, 2, xp=cupy)
    B, Sq, Sk, Hq = SHAPE["B"], SHAPE["Sq"], SHAPE["Sk"], SHAPE["Hq"]
    rng = np.random.default_rng(3)
    mask = cupy.asarray(rng.random((1, Hq, Sq, Sk)) < 0.7)
    bias = cupy.asarray(rng.standard_normal((B, 1, Sq, Sk)).astype(np.float32))
    slopes = cupy.asarray((2.0 ** -np.arange(1, Hq + 1)).astype(np.float32))
    options = dict(mask=mask, bias=bias, alibi_slopes=slopes)
    out = cuflash.attention(q, DLPackOnly(k), v, mask=DLPackOnly(mask), bias=DLPackOnly(bias),
                            alibi_slopes=DLPackOnly(slopes))
    cupy.testing.assert_array_equal(out, cuflash.attention(q, k, v, **options))
    _check(q, k, v, out, dtype=dtype, **options)


def test_dlpack_only_varlen():
    dtype = "float16"
    cu_q = np.array([0, 30, 30, 101], dtype=np.int32)
    cu_k = np.array([0, 17, 80, 150], dtype=np.int32)
    q, k, v = tt.random_qkv(dict(B=1, Sq=101, Sk=150, Hq=4, Hk=1, D=64), dtype, 4, xp=cupy)
    q, k, v = q[0], k[0], v[0]
    out = cuflash.attention_varlen(DLPackOnly(q), DLPackOnly(k), DLPackOnly(v),
                                   DLPackOnly(cupy.asarray(cu_q)), DLPackOnly(cupy.asarray(cu_k)),
                                   causal=True)
    ref_out, _ = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    base = tt.baseline_attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    tt.assert_attention_close(out, ref_out, base, dtype=dtype)


# ----------------------------------------------------------------------------- torch

def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_torch_tensors_in_and_out(dtype):
    torch = _torch()
    tdtype = getattr(torch, dtype)
    B, Sq, Sk, Hq, Hk, D = (SHAPE[n] for n in ("B", "Sq", "Sk", "Hq", "Hk", "D"))
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=tdtype, generator=g)
    k = torch.randn(B, Sk, Hk, D, device="cuda", dtype=tdtype, generator=g)
    v = torch.randn(B, Sk, Hk, D, device="cuda", dtype=tdtype, generator=g)
    from cuflash.interop._cupy_stream import cupy_stream

    # cuflash on torch's current stream, so no synchronisation is needed on either side.
    with cupy_stream(torch.cuda.current_stream().cuda_stream):
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    t_out = torch.from_dlpack(out)
    t_lse = torch.from_dlpack(lse)
    assert t_out.dtype == tdtype and tuple(t_out.shape) == (B, Sq, Hq, D)
    assert t_out.device.type == "cuda" and t_out.data_ptr() == out.data.ptr  # zero copy
    assert t_lse.dtype == torch.float32 and tuple(t_lse.shape) == (B, Hq, Sq)
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    _check(cq, ck, cv, cupy.from_dlpack(t_out), cupy.from_dlpack(t_lse), dtype=dtype, causal=True)
    # And against torch's own attention (GQA by repeating kv heads), in float32.
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    kf = kf.repeat_interleave(Hq // Hk, dim=1)
    vf = vf.repeat_interleave(Hq // Hk, dim=1)
    # cuflash's causal is bottom-right aligned; torch's is_causal is top-left: use a mask.
    i = torch.arange(Sq, device="cuda")[:, None]
    j = torch.arange(Sk, device="cuda")[None, :]
    want = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf,
                                                            attn_mask=j <= i + Sk - Sq)
    tol = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}[dtype]
    torch.testing.assert_close(t_out.float(), want.transpose(1, 2), atol=tol, rtol=tol)


def test_torch_bhsd_views_and_producer_stream():
    # BHSD tensors passed as transposed views, produced on a side stream that is still busy:
    # the DLPack import must order cuflash after the producer's work.
    torch = _torch()
    B, Sq, Sk, Hq, Hk, D = 2, 300, 300, 4, 4, 128
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):
            big = big @ big / 64.0  # keep the side stream busy
        q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=torch.bfloat16) + big[0, 0] * 0
        k = torch.randn(B, Hk, Sk, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Hk, Sk, D, device="cuda", dtype=torch.bfloat16)
        qv, kv, vv = (x.transpose(1, 2) for x in (q, k, v))
        # Consumer: CuPy's own stream (not torch's): ordering comes from __dlpack__(stream=).
        out = cuflash.attention(qv, kv, vv)
    cupy.cuda.get_current_stream().synchronize()
    side.synchronize()
    cq, ck, cv = (cupy.from_dlpack(x) for x in (qv, kv, vv))
    _check(cq, ck, cv, out, dtype="bfloat16")
    back = torch.from_dlpack(out)
    assert tuple(back.shape) == (B, Sq, Hq, D) and back.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- JAX

def _jax():
    jax = pytest.importorskip("jax")
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        devices = []
    if not devices:
        pytest.skip("jax has no GPU device")
    return jax


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_jax_arrays_in_and_out(dtype):
    jax = _jax()
    import jax.numpy as jnp

    B, Sq, Sk, Hq, Hk, D = (SHAPE[n] for n in ("B", "Sq", "Sk", "Hq", "Hk", "D"))
    key = jax.random.PRNGKey(7)
    kq, kk, kv = jax.random.split(key, 3)
    jdtype = getattr(jnp, dtype)
    gpu = jax.devices("gpu")[0]
    q = jax.device_put(jax.random.normal(kq, (B, Sq, Hq, D), dtype=jdtype), gpu)
    k = jax.device_put(jax.random.normal(kk, (B, Sk, Hk, D), dtype=jdtype), gpu)
    v = jax.device_put(jax.random.normal(kv, (B, Sk, Hk, D), dtype=jdtype), gpu)
    out = cuflash.attention(q, k, v, causal=True)
    assert isinstance(out, cupy.ndarray)
    cq, ck, cv = (cupy.from_dlpack(x) for x in (q, k, v))
    _check(cq, ck, cv, out, dtype=dtype, causal=True)
    back = jnp.from_dlpack(out)
    assert back.shape == (B, Sq, Hq, D) and back.dtype == jdtype
    np.testing.assert_array_equal(np.asarray(back.astype(jnp.float32)),
                                  cupy.asnumpy(out.astype(cupy.float32)))
