"""Attention sinks through the adapters (issue 53 item 1): cuflash.interop.torch (eager, forward and
backward, ``ct`` and ``ct.ops``) against cuflash's own CuPy calls bit for bit (deterministic backwards),
and cuflash.interop.jax under ``jax.jit`` (forward and ``jax.grad``, q, k, v and sinks) against the
float64 reference in float32 (docs/design.md §5: rel. error 1e-5 forward, 1e-4 gradients).

The torch plumbing without a GPU (schemas, fakes, opcheck, gradcheck with sinks) is in
tests/gpu/test_torch_library.py; the JAX trace-time checks in tests/cpu/test_jax_checks.py.
Inputs are fresh random data at every run.

Run: ``python -m pytest -q tests/gpu/test_sinks_adapters.py`` (skipped without a GPU).
"""

import numpy as np
import pytest

import cuflash
from cuflash import reference


def _torch_gpu():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def _jax_gpu():
    try:
        import jax
        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:
        return False


torch_gpu = [pytest.mark.gpu, pytest.mark.skipif(not _torch_gpu(), reason="torch has no CUDA device")]
jax_gpu = [pytest.mark.gpu, pytest.mark.skipif(not _jax_gpu(), reason="JAX has no GPU")]


def _marks(marks):
    def apply(fn):
        for mark in marks:
            fn = mark(fn)
        return fn
    return apply


def _sinks_np(heads, rng):
    x = rng.normal(0.0, 2.0, heads).astype(np.float32)
    x[1] = -np.inf   # a head without a sink
    return x


def _same_bits(got, want, name):
    import cupy

    got = cupy.from_dlpack(got.detach()) if not isinstance(got, cupy.ndarray) else got
    np.testing.assert_array_equal(got.view(cupy.uint8).get(), want.view(cupy.uint8).get(), err_msg=name)


# ----------------------------------------------------------------------------- torch

@_marks(torch_gpu)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("entry", ["ct", "ops"])
def test_torch_attention_with_sinks_equals_cuflash(dtype, entry):
    import cupy
    import torch
    import cuflash.interop.torch as ct

    rng = np.random.default_rng()
    B, Sq, Sk, Hq, Hk, D = 2, 77, 130, 4, 2, 64
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(B, s, h, D, device="cuda", dtype=dt, requires_grad=True)
               for s, h in ((Sq, Hq), (Sk, Hk), (Sk, Hk)))
    sinks = torch.tensor(_sinks_np(Hq, rng), device="cuda", requires_grad=True)
    fn = ct.attention if entry == "ct" else ct.ops.attention
    out = fn(q, k, v, causal=True, window=(40, 0), sinks=sinks, deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    torch.cuda.synchronize()
    c = lambda x: cupy.from_dlpack(x.detach())  # noqa: E731
    qc, kc, vc, sc = c(q), c(k), c(v), c(sinks)
    want, lse, _ = cuflash.attention_forward(qc, kc, vc, causal=True, window=(40, 0), sinks=sc)
    dq, dk, dv, dsinks = cuflash.attention_backward(c(dout), qc, kc, vc, want, lse, causal=True, window=(40, 0),
                                                    sinks=sc, return_dsinks=True, deterministic=True)
    cupy.cuda.get_current_stream().synchronize()
    for got, ref, name in ((out, want, "out"), (q.grad, dq, "dq"), (k.grad, dk, "dk"), (v.grad, dv, "dv"),
                           (sinks.grad, dsinks, "dsinks")):
        _same_bits(got, ref, name)
    assert sinks.grad[1].item() == 0.0


@_marks(torch_gpu)
def test_torch_varlen_with_sinks_equals_cuflash():
    import cupy
    import torch
    import cuflash.interop.torch as ct

    rng = np.random.default_rng()
    lengths = [33, 1, 120]
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), h, 64, device="cuda", dtype=torch.float16, requires_grad=True)
               for h in (4, 2, 2))
    sinks = torch.tensor(_sinks_np(4, rng), device="cuda", requires_grad=True)
    out = ct.attention_varlen(q, k, v, cu, cu, max_seqlen_q=120, max_seqlen_k=120, causal=True, sinks=sinks,
                              deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    torch.cuda.synchronize()
    c = lambda x: cupy.from_dlpack(x.detach())  # noqa: E731
    qc, kc, vc, cuc, sc = c(q), c(k), c(v), c(cu), c(sinks)
    want, lse = cuflash.attention_varlen(qc, kc, vc, cuc, cuc, max_seqlen_q=120, max_seqlen_k=120, causal=True,
                                         sinks=sc, return_lse=True)
    dq, dk, dv, dsinks = cuflash.attention_varlen_backward(c(dout), qc, kc, vc, want, lse, cuc, cuc, max_seqlen_q=120,
                                                           max_seqlen_k=120, causal=True, sinks=sc,
                                                           return_dsinks=True, deterministic=True)
    cupy.cuda.get_current_stream().synchronize()
    for got, ref, name in ((out, want, "out"), (q.grad, dq, "dq"), (k.grad, dk, "dk"), (v.grad, dv, "dv"),
                           (sinks.grad, dsinks, "dsinks")):
        _same_bits(got, ref, name)


@_marks(torch_gpu)
@pytest.mark.parametrize("entry", ["ct", "ops"])
@pytest.mark.parametrize("page_size", [None, 16])
def test_torch_decode_with_sinks_equals_cuflash(entry, page_size):
    import cupy
    import torch
    import cuflash.interop.torch as ct

    rng = np.random.default_rng()
    B, Sq, Hq, Hk, D = 3, 2, 8, 2, 128
    lens = torch.tensor([0, 300, 77], dtype=torch.int32, device="cuda")
    if page_size is None:
        k_cache = torch.randn(B, 512, Hk, D, device="cuda", dtype=torch.bfloat16)
        table = None
    else:
        k_cache = torch.randn(B * 32, page_size, Hk, D, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(B * 32, device="cuda").to(torch.int32).reshape(B, 32)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=torch.bfloat16)
    sinks = torch.tensor(_sinks_np(Hq, rng), device="cuda")
    c = lambda x: None if x is None else cupy.from_dlpack(x)  # noqa: E731
    kc0, vc0 = c(k_cache).copy(), c(v_cache).copy()
    fn = ct.decode if entry == "ct" else ct.ops.decode
    out, lse = fn(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, sinks=sinks, num_splits=3,
                  return_lse=True)
    torch.cuda.synchronize()
    want, want_lse = cuflash.decode(c(q), kc0, vc0, cache_seqlens=c(lens), block_table=c(table), sinks=c(sinks),
                                    num_splits=3, return_lse=True)
    cupy.cuda.get_current_stream().synchronize()
    _same_bits(out, want, "out")
    _same_bits(lse, want_lse, "lse")
    np.testing.assert_array_equal(cupy.from_dlpack(lse).get()[0], np.broadcast_to(sinks.cpu().numpy()[:, None],
                                                                                    (Hq, Sq)))


# ----------------------------------------------------------------------------- JAX

def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@_marks(jax_gpu)
def test_jax_attention_with_sinks_against_the_reference():
    import jax
    import jax.numpy as jnp
    import cuflash.interop.jax as cj

    rng = np.random.default_rng()
    B, Sq, Sk, Hq, Hk, D = 2, 65, 113, 4, 2, 64
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, Sq, Hq, D), (B, Sk, Hk, D), (B, Sk, Hk, D)))
    dout = rng.standard_normal((B, Sq, Hq, D)).astype(np.float32)
    sinks = _sinks_np(Hq, rng)
    opts = dict(causal=True, window=(50, 0), softcap=5.0)

    def loss(q, k, v, s):
        out = cj.attention(q, k, v, sinks=s, **opts)
        return jnp.sum(out * dout), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        *(jnp.asarray(x) for x in (q, k, v, sinks)))
    ref_out, _ = reference.attention_forward(q, k, v, sinks=sinks, **opts)
    ref = reference.attention_backward(dout, q, k, v, sinks=sinks, return_dsinks=True, **opts)
    assert _rel(out, ref_out) <= 1e-5
    for got, want, name in zip(grads, ref, ("dq", "dk", "dv", "dsinks")):
        assert _rel(got, want) <= 1e-4, name


@_marks(jax_gpu)
def test_jax_varlen_and_decode_with_sinks_against_the_reference():
    import jax
    import jax.numpy as jnp
    import cuflash.interop.jax as cj

    rng = np.random.default_rng()
    lengths = [33, 1, 120]
    cu = np.cumsum([0] + lengths).astype(np.int32)
    q, k, v = (rng.standard_normal((sum(lengths), h, 64)).astype(np.float32) for h in (4, 2, 2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    sinks = _sinks_np(4, rng)

    def loss(q, k, v, s):
        out = cj.attention_varlen(q, k, v, jnp.asarray(cu), jnp.asarray(cu), max_seqlen_q=120, max_seqlen_k=120,
                                  causal=True, sinks=s)
        return jnp.sum(out * dout), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        *(jnp.asarray(x) for x in (q, k, v, sinks)))
    ref_out, _ = reference.attention_varlen(q, k, v, cu, cu, causal=True, sinks=sinks)
    ref = reference.attention_varlen_backward(dout, q, k, v, cu, cu, causal=True, sinks=sinks, return_dsinks=True)
    assert _rel(out, ref_out) <= 1e-5
    for got, want, name in zip(grads, ref, ("dq", "dk", "dv", "dsinks")):
        assert _rel(got, want) <= 1e-4, name

    B, Hq, Hk, D = 3, 8, 2, 128
    lens = np.array([0, 300, 77], np.int32)
    k_cache, v_cache = (rng.standard_normal((B, 512, Hk, D)).astype(np.float32) for _ in range(2))
    qd = rng.standard_normal((B, 1, Hq, D)).astype(np.float32)
    sinks = _sinks_np(Hq, rng)
    out, lse = jax.jit(lambda q, kc, vc, l, s: cj.decode(q, kc, vc, cache_seqlens=l, sinks=s, num_splits=3,
                                                         return_lse=True))(
        *(jnp.asarray(x) for x in (qd, k_cache, v_cache, lens, sinks)))
    ref_out, ref_lse = reference.decode(qd, k_cache, v_cache, cache_seqlens=lens, sinks=sinks)
    assert _rel(out, ref_out) <= 1e-5 and _rel(np.asarray(lse)[1:], ref_lse[1:]) <= 1e-5
    np.testing.assert_array_equal(np.asarray(lse)[0, :, 0], sinks)
