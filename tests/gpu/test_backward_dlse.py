"""attention_backward and attention_varlen_backward with ``dlse``, the gradient of a loss that reads the
forward's lse (dS = P (dP - D + dlse)), on each backward family (forced), against the float64 reference.

The reference is given the stored output (D from it, as the kernels compute D), so what is left is
the kernels' own rounding: float32 within 1e-4 relative (Frobenius), float16/bfloat16 within 5e-3.
Each case checks that dlse moves the reference gradients by far more than that, so a kernel that
ignored dlse fails. Rows that see no key (lse -inf) get NaN in dlse, which must reach no gradient.
Outputs are poisoned with NaN before the launch; inputs are fresh normal data.
"""

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import cuflash  # noqa: E402
import cuflash.backward as bw  # noqa: E402
import cuflash.testing as tt  # noqa: E402
from cuflash import reference  # noqa: E402
from tests.gpu._hardware import gpu_available, is_sm90  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU found by CuPy")]

SM90 = pytest.mark.skipif(not is_sm90(), reason="bwd_sm90 needs an sm_90 GPU")
KERNELS = [
    pytest.param("bwd_sm80", "float16", id="sm80-fp16"),
    pytest.param("bwd_sm80", "bfloat16", id="sm80-bf16"),
    pytest.param("bwd_simt", "float32", id="simt-fp32"),
    pytest.param("bwd_sm90", "float16", id="sm90-fp16", marks=SM90),
    pytest.param("bwd_sm90", "bfloat16", id="sm90-bf16", marks=SM90),
]


def _tolerance(dtype):
    return 1e-4 if dtype == "float32" else 5e-3


def _relative(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(got).all(), "not finite"
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


def _stored_forward(q, k, v, options):
    out, lse = reference.attention_forward(q, k, v, **options)
    return cupy.asarray(out.astype(np.float32)).astype(q.dtype), cupy.asarray(lse.astype(np.float32))


def _dlse_with_nan_where_unseen(lse, seed):
    rng = np.random.default_rng(seed)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    dlse[np.isneginf(lse.get())] = np.nan   # rows that see nothing: must reach no gradient
    return cupy.asarray(dlse)


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_dlse_joins_the_gradients(family, dtype, with_sinks):
    shape = dict(B=2, Sq=90, Sk=70, Hq=4, Hk=2, D=64)     # causal, Sq > Sk: the first 20 rows see no key
    q, k, v = tt.random_qkv(shape, dtype, seed=61, xp=cupy)
    dout = cupy.asarray(np.random.default_rng(62).standard_normal(q.shape, np.float32)).astype(q.dtype)
    sinks = cupy.asarray(np.array([0.5, -1.0, 0.0, 1.5], np.float32)) if with_sinks else None
    options = dict(causal=True, sinks=sinks)
    out, lse = _stored_forward(q, k, v, options)
    dlse = _dlse_with_nan_where_unseen(lse, 63)
    grads = [cupy.full(x.shape, np.nan, x.dtype) for x in (q, k, v)]
    with bw.force_kernel(family):
        got = bw.attention_backward(dout, q, k, v, out, lse, dlse=dlse, return_dsinks=with_sinks, dq=grads[0],
                                    dk=grads[1], dv=grads[2], **options)
    host = dict(out=out, dlse=np.nan_to_num(dlse.get()), return_dsinks=with_sinks, **options)
    ref = reference.attention_backward(dout, q, k, v, **host)
    without = reference.attention_backward(dout, q, k, v, **dict(host, dlse=None))
    for name, g, r, w in zip(("dq", "dk", "dv", "dsinks"), got, ref, without):
        if name == "dv":   # dV = P^T dO does not depend on lse's gradient
            assert _relative(g.get(), r) < _tolerance(dtype), name
            continue
        assert _relative(w, r) > 20 * _tolerance(dtype), f"{name}: dlse hardly moves the reference"
        assert _relative(g.get(), r) < _tolerance(dtype), name


@pytest.mark.parametrize("family", ["bwd_sm80", pytest.param("bwd_sm90", marks=SM90)])
def test_varlen_dlse(family):
    cu = np.array([0, 37, 120, 200], np.int32)
    q, k, v = tt.random_qkv(dict(B=1, Sq=200, Sk=200, Hq=4, Hk=2, D=64), "bfloat16", seed=64, xp=cupy)
    q, k, v = (x[0] for x in (q, k, v))
    dout = cupy.asarray(np.random.default_rng(65).standard_normal(q.shape, np.float32)).astype(q.dtype)
    out64, lse64 = reference.attention_varlen(q, k, v, cu, cu, causal=True)
    out = cupy.asarray(out64.astype(np.float32)).astype(q.dtype)
    lse = cupy.asarray(lse64.astype(np.float32))
    dlse = cupy.asarray(np.random.default_rng(66).standard_normal(lse.shape).astype(np.float32))
    cu_d = cupy.asarray(cu)
    with bw.force_kernel(family):
        got = bw.attention_varlen_backward(dout, q, k, v, out, lse, cu_d, cu_d, max_seqlen_q=83, max_seqlen_k=83,
                                           causal=True, dlse=dlse)
    ref = reference.attention_varlen_backward(dout, q, k, v, cu, cu, causal=True, out=out, dlse=dlse.get())
    without = reference.attention_varlen_backward(dout, q, k, v, cu, cu, causal=True, out=out)
    for name, g, r, w in zip(("dq", "dk", "dv"), got, ref, without):
        if name != "dv":
            assert _relative(w, r) > 0.1, name
        assert _relative(g.get(), r) < 5e-3, name


def test_dlse_is_checked_before_any_launch():
    q, k, v = tt.random_qkv(dict(B=1, Sq=16, Sk=16, Hq=2, Hk=2, D=64), "float16", seed=67, xp=cupy)
    out, lse, _ = cuflash.attention_forward(q, k, v)
    dq = cupy.full(q.shape, np.nan, q.dtype)
    with pytest.raises(ValueError, match="dlse"):
        cuflash.attention_backward(out, q, k, v, out, lse, dlse=lse[:, :, :8], dq=dq)
    with pytest.raises(TypeError, match="dlse"):
        cuflash.attention_backward(out, q, k, v, out, lse, dlse=lse.astype(cupy.float16), dq=dq)
    assert bool(cupy.isnan(dq).all()), "dq was written before the error"
