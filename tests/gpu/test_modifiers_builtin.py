"""Modifiers that state a built-in option run as that option (cuflash/modifiers/builtin.py), on the GPU.

A call whose ScoreMod is a softcap or ALiBi, or whose MaskMod is a window, equals the call with the
built-in options bit for bit, forward and backward (the same kernels ran), in ``attention``,
``attention_varlen`` (one ``cu_seqlens`` array for queries and keys), ``decode`` and through the
torch adapter; and both are within the accuracy rule of the float64 reference evaluating the
expressions as written. Under :func:`cuflash.modifiers.as_written` the same call runs the
expressions and still meets the rule. Outputs are poisoned with NaN; the data is fresh each test.

Run: ``python -m pytest -q tests/gpu/test_modifiers_builtin.py`` (skipped without a GPU).
"""

import numpy as np
import pytest

import cupy

import cuflash
import cuflash.testing as tt
from cuflash import MaskMod, ScoreMod, reference
from tests.gpu._hardware import SM90, gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU found by CuPy")]

NAN = float("nan")
CAP = ("c * tanh(score / c)", "1.0 - tanh(score / c) * tanh(score / c)")


def _case(name, Hq, rng):
    """(score_mod, mask_mod, the call's options, the same call in built-in options)."""
    slopes = cupy.asarray(rng.uniform(0.01, 0.3, Hq).astype(np.float32))
    if name == "window+softcap":
        return (ScoreMod(*CAP, c=30.0), MaskMod("q_idx - kv_idx <= w", w=100), dict(causal=True),
                dict(causal=True, window=(100, 0), softcap=30.0))
    if name == "alibi":
        return (ScoreMod("score + s[h] * (kv_idx - q_idx)", s=slopes), None, dict(causal=True),
                dict(causal=True, alibi_slopes=slopes))
    if name == "softcap+alibi":
        return (ScoreMod("tanh(score / 7.5) * 7.5 - abs(q_idx - kv_idx) * s[h]",
                         grad="1.0 - tanh(score / 7.5) * tanh(score / 7.5)", s=slopes), None, {},
                dict(softcap=7.5, alibi_slopes=slopes))
    assert name == "band"
    return None, MaskMod("kv_idx - q_idx <= 5 && q_idx - kv_idx < 60"), {}, dict(window=(59, 5))


CASES = ("window+softcap", "alibi", "softcap+alibi", "band")


def _forward(q, k, v, **options):
    B, S, Hq, D = q.shape
    out = cupy.full((B, S, Hq, D), NAN, dtype=q.dtype)
    lse = cupy.full((B, Hq, S), NAN, dtype=np.float32)
    cuflash.attention_forward(q, k, v, out=out, lse=lse, **options)
    return out, lse


def _backward(dout, q, k, v, out, lse, **options):
    grads = tuple(cupy.full(x.shape, NAN, dtype=x.dtype) for x in (q, k, v))
    # deterministic: otherwise dQ's sums over key blocks may come in another order from call to call
    return cuflash.attention_backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                                      deterministic=True, **options)


def _equal(got, want, name):
    for g, w, part in zip(got, want, ("first", "second", "third")):
        assert bool(cupy.array_equal(g, w, equal_nan=False)), f"{name}: the {part} result differs from the built-in call"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", CASES)
def test_attention_runs_the_built_in_options(name, dtype):
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    B, S, Hq, Hk, D = 2, 300, 4, 2, 128
    q, k, v = tt.random_qkv(dict(B=B, Sq=S, Sk=S, Hq=Hq, Hk=Hk, D=D), dtype, seed, xp=cupy)
    dout = tt.random_qkv(dict(B=B, Sq=S, Sk=S, Hq=Hq, Hk=Hk, D=D), dtype, seed + 1, xp=cupy)[0]
    score_mod, mask_mod, options, builtin = _case(name, Hq, rng)
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, **options)

    out, lse = _forward(q, k, v, **mods)
    _equal((out, lse), _forward(q, k, v, **builtin), f"{name} forward")
    _equal(_backward(dout, q, k, v, out, lse, **mods), _backward(dout, q, k, v, out, lse, **builtin),
           f"{name} backward")
    ref_out, ref_lse = reference.attention_forward(q, k, v, **mods)
    tt.assert_attention_close(out, ref_out, tt.baseline_attention(q, k, v, **mods), dtype=dtype, name="out")
    tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")

    with cuflash.modifiers.as_written():   # the expressions' own path: the same attention, other kernels
        written, _ = _forward(q, k, v, **mods)
    tt.assert_attention_close(written, ref_out, tt.baseline_attention(q, k, v, **mods), dtype=dtype, name="out")


@SM90
def test_the_softcap_takes_the_forwards_plain_loop():
    q, k, v = tt.random_qkv(dict(B=1, Sq=256, Sk=256, Hq=2, Hk=2, D=128), "bfloat16", 3, xp=cupy)
    cap = ScoreMod(*CAP, c=30.0)
    moved = cuflash.plan(cuflash.attention_forward, q, k, v, score_mod=cap, causal=True).plan.info
    with cuflash.modifiers.as_written():
        written = cuflash.plan(cuflash.attention_forward, q, k, v, score_mod=cap, causal=True).plan.info
    assert moved["family"] == written["family"] == "fwd_sm90"
    assert moved["on_plain_loop"] and not written["on_plain_loop"]


def test_varlen_moves_only_with_one_offsets_array():
    rng = np.random.default_rng()
    lengths = [37, 300, 128]
    cu = cupy.asarray(np.cumsum([0] + lengths), dtype=cupy.int32)
    total, Hq, Hk, D = sum(lengths), 4, 2, 64
    q, k, v = (x[0] for x in tt.random_qkv(dict(B=1, Sq=total, Sk=total, Hq=Hq, Hk=Hk, D=D), "bfloat16",
                                             int(rng.integers(2**31)), xp=cupy))
    score_mod, mask_mod, options, builtin = _case("window+softcap", Hq, rng)

    def run(cu_k, **kw):
        out = cupy.full(q.shape, NAN, dtype=q.dtype)
        return cuflash.attention_varlen(q, k, v, cu, cu_k, max_seqlen_q=300, max_seqlen_k=300, out=out, **kw)

    moved = run(cu, score_mod=score_mod, mask_mod=mask_mod, **options)
    assert bool(cupy.array_equal(moved, run(cu, **builtin)))
    # A copy of the offsets: the sequences may differ in length, so nothing moves; still the same attention.
    written = run(cu.copy(), score_mod=score_mod, mask_mod=mask_mod, **options)
    mods = dict(score_mod=score_mod, mask_mod=mask_mod, max_seqlen_q=300, max_seqlen_k=300, **options)
    ref = reference.attention_varlen(q, k, v, cu, cu, **mods)[0]
    base = tt.baseline_attention_varlen(q, k, v, cu, cu, **mods)
    for got in (moved, written):
        tt.assert_attention_close(got, ref, base, dtype="bfloat16", name="varlen out")


def test_decode_runs_the_built_in_options():
    rng = np.random.default_rng()
    B, Sq, Hq, Hk, D, L = 3, 2, 8, 2, 128, 700
    q = cupy.asarray(rng.standard_normal((B, Sq, Hq, D)), dtype=cupy.float16)
    k_cache, v_cache = (cupy.asarray(rng.standard_normal((B, L, Hk, D)), dtype=cupy.float16) for _ in range(2))
    seqlens = cupy.asarray([700, 1, 333], dtype=cupy.int32)
    slopes = cupy.asarray(rng.uniform(0.01, 0.3, Hq).astype(np.float32))
    score_mod = ScoreMod("c * tanh(score / c) - s[h] * abs(q_idx - kv_idx)", c=20.0, s=slopes)
    mask_mod = MaskMod("q_idx - kv_idx < 256")
    moved = cuflash.decode(q, k_cache, v_cache, cache_seqlens=seqlens, score_mod=score_mod, mask_mod=mask_mod)
    builtin = cuflash.decode(q, k_cache, v_cache, cache_seqlens=seqlens, softcap=20.0, alibi_slopes=slopes,
                             window=(255, -1))
    assert bool(cupy.array_equal(moved, builtin))
    ref, _ = reference.decode(q, k_cache, v_cache, cache_seqlens=seqlens, score_mod=score_mod, mask_mod=mask_mod)
    np.testing.assert_allclose(cupy.asnumpy(moved.astype(cupy.float32)), ref, atol=2e-2, rtol=2e-2)


def test_torch_adapter_runs_the_built_in_options():
    torch = pytest.importorskip("torch")
    ct = pytest.importorskip("cuflash.interop.torch")
    gen = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(2**31)))
    shape = (2, 256, 4, 64)
    leaves = [torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(3)]
    twins = [x.detach().clone().requires_grad_() for x in leaves]
    dout = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
    out = ct.attention(*leaves, causal=True, score_mod=ScoreMod(*CAP, c=30.0), mask_mod=MaskMod("q_idx - kv_idx <= 64"),
                       deterministic=True)
    want = ct.attention(*twins, causal=True, softcap=30.0, window=(64, 0), deterministic=True)
    out.backward(dout)
    want.backward(dout)
    assert torch.equal(out, want)
    for got, expected in zip(leaves, twins):
        assert torch.equal(got.grad, expected.grad)
