"""score_mod= / mask_mod= through the torch adapter (cuflash.interop.torch and its ops).

Without a GPU (torch needed), with cuflash's float64 reference standing in for the kernels under
the "cpu" device (tests/gpu/test_torch_library.py's ReferenceKernels): the ops' functions pass the
modifiers to the kernels (forward, backward through autograd, gradcheck, varlen, decode with its
appends), their torch tensor arguments included, eagerly and under torch.compile (fullgraph, the
arrays read at each call, a MaskMod deriving no block mask there); the ops take the modifiers' specs
and arrays; a modifier's tensor that requires a gradient is refused while autograd records, and a
ScoreMod that would need its grad is refused before the forward.

On a GPU: ct.attention, ct.attention_varlen, ct.decode and the ops with modifiers whose arrays are
torch tensors, eager forward and backward, equal to cuflash's own calls on the same data (CuPy arrays,
CuPy modifiers; deterministic backwards, so bit for bit); the data is fresh at every run.
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
import cuflash.interop.torch as ct  # noqa: E402
from cuflash import reference  # noqa: E402
from cuflash.interop import _torch_ops  # noqa: E402
from cuflash.modifiers import MaskMod, ScoreMod  # noqa: E402
from tests.gpu.test_torch_library import ReferenceKernels  # noqa: E402

ops = ct.ops
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA device")]

RELATIVE = "score + table[q_idx - kv_idx + off]"
CAP = ("c * tanh(score / c)", "1.0 - tanh(score / c) * tanh(score / c)")


@pytest.fixture
def host_kernels(monkeypatch):
    monkeypatch.setitem(_torch_ops._KERNELS, "cpu", ReferenceKernels)


def _np(x):
    return x.detach().numpy()


def _rand(*shape, requires_grad=False, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


# ----------------------------------------------------------------------------- CPU: plumbing

def _compiled(fn):
    """fn compiled whole (fullgraph: a graph break is an error) through AOTAutograd, no Inductor."""
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)



def test_ops_attention_passes_the_modifiers_forward_and_backward(host_kernels):
    B, Sq, Sk, Hq, Hk, D = 2, 7, 11, 4, 2, 8
    q, k, v = _rand(B, Sq, Hq, D, requires_grad=True), _rand(B, Sk, Hk, D, requires_grad=True), \
        _rand(B, Sk, Hk, D, requires_grad=True)
    table = torch.randn(2 * 16 + 1)   # a torch tensor as the modifier's array
    score_mod = ScoreMod("c * tanh(score / c) + table[q_idx - kv_idx + off]",
                         grad="1.0 - tanh(score / c) * tanh(score / c)", table=table, off=16, c=3.0)
    mask_mod = MaskMod("kv_idx <= q_idx + 4 || kv_idx == 0")
    out, lse = ops.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    ref_out, ref_lse = reference.attention_forward(_np(q), _np(k), _np(v), score_mod=score_mod, mask_mod=mask_mod)
    np.testing.assert_allclose(_np(out), ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(_np(lse), ref_lse, rtol=1e-6, atol=1e-6)   # float32
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = reference.attention_backward(_np(dout), _np(q), _np(k), _np(v), score_mod=score_mod, mask_mod=mask_mod)
    for got, want in zip((q.grad, k.grad, v.grad), grads):
        np.testing.assert_allclose(_np(got), want, rtol=1e-10, atol=1e-12)
    # The backward op's function takes them too.
    dq, dk, dv = ops.attention_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                        score_mod=score_mod, mask_mod=mask_mod)
    for got, want in zip((dq, dk, dv), grads):
        np.testing.assert_allclose(_np(got), want, rtol=1e-10, atol=1e-12)


def test_gradcheck_through_a_score_mod(host_kernels):
    q, k, v = (_rand(*s, requires_grad=True) for s in ((1, 5, 2, 4), (1, 6, 1, 4), (1, 6, 1, 4)))
    score_mod = ScoreMod(CAP[0], grad=CAP[1], c=2.0)
    mask_mod = MaskMod("q_idx != kv_idx || q_idx == 0")
    fn = lambda q, k, v: ops.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, causal=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-6)


def test_bias_gets_its_gradient_beside_the_modifiers(host_kernels):
    q, k, v = (_rand(*s, requires_grad=True) for s in ((1, 5, 2, 4), (1, 6, 1, 4), (1, 6, 1, 4)))
    bias = _rand(2, 1, 6, requires_grad=True)
    mask_mod = MaskMod("kv_idx != 2")
    fn = lambda q, k, v, bias: ops.attention(q, k, v, bias=bias, mask_mod=mask_mod)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-6)
    # beside a ScoreMod (bias is added before it): dbias through the ScoreMod's grad
    score_mod = ScoreMod(*CAP, c=2.0)
    fn = lambda q, k, v, bias: ops.attention(q, k, v, bias=bias, score_mod=score_mod)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="dbias .* score_mod and a softcap"):   # not beside both
        ops.attention(q, k, v, bias=bias, score_mod=ScoreMod("score + 1.0"), softcap=5.0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_ops_varlen_passes_the_modifiers(host_kernels, compiled):
    # compiled: ct.attention_varlen under torch.compile(fullgraph=True), which becomes the op.
    lengths = [5, 3, 9]
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    q, k, v = (_rand(sum(lengths), h, 8, requires_grad=True) for h in (4, 2, 2))
    bonus = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float32)
    score_mod = ScoreMod("score + bonus[b] * 1.0 - 0.1 * abs(q_idx - kv_idx)", bonus=bonus)
    mask_mod = MaskMod("kv_idx <= q_idx")
    fn = (_compiled(ct.attention_varlen) if compiled else ops.attention_varlen)
    out = fn(q, k, v, cu, cu, max_seqlen_q=9, max_seqlen_k=9, score_mod=score_mod, mask_mod=mask_mod)
    ref, _ = reference.attention_varlen(_np(q), _np(k), _np(v), _np(cu), _np(cu), score_mod=score_mod,
                                        mask_mod=mask_mod)
    np.testing.assert_allclose(_np(out), ref, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = reference.attention_varlen_backward(_np(dout), _np(q), _np(k), _np(v), _np(cu), _np(cu),
                                                score_mod=score_mod, mask_mod=mask_mod)
    for got, want in zip((q.grad, k.grad, v.grad), grads):
        np.testing.assert_allclose(_np(got), want, rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()


@pytest.mark.parametrize("entry", ["ops", "ops with out", "ct compiled"])
def test_ops_decode_passes_the_modifiers(host_kernels, entry):
    B, Sq, Hq, Hk, D, cap = 2, 3, 4, 2, 8, 40
    q = _rand(B, Sq, Hq, D)
    k_cache, v_cache = _rand(B, cap, Hk, D), _rand(B, cap, Hk, D)
    k_new, v_new = _rand(B, Sq, Hk, D), _rand(B, Sq, Hk, D)
    lens = torch.tensor([4, 30], dtype=torch.int32)
    table = torch.randn(2 * cap + 1)
    score_mod = ScoreMod(RELATIVE, table=table, off=cap)
    mask_mod = MaskMod("q_idx - kv_idx <= w", w=6)
    ref_out, ref_lse, k_after, v_after = reference.decode(_np(q), _np(k_cache), _np(v_cache), cache_seqlens=_np(lens),
                                                          k_new=_np(k_new), v_new=_np(v_new), score_mod=score_mod,
                                                          mask_mod=mask_mod, return_cache=True)
    version = k_cache._version
    out = torch.full_like(q, math.nan) if entry == "ops with out" else None
    fn = _compiled(ct.decode) if entry == "ct compiled" else ops.decode
    got, lse = fn(q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new, v_new=v_new, score_mod=score_mod,
                  mask_mod=mask_mod, return_lse=True, out=out)
    if out is not None:
        assert got is out
    np.testing.assert_allclose(_np(got), ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(_np(lse), ref_lse, rtol=1e-6, atol=1e-6)   # float32
    np.testing.assert_array_equal(_np(k_cache), k_after)
    np.testing.assert_array_equal(_np(v_cache), v_after)
    if entry != "ct compiled":
        assert k_cache._version > version   # mutated in place, as the op declares
    torch._dynamo.reset()


def test_a_modifier_tensor_that_requires_grad_is_refused_while_recording(host_kernels):
    q, k, v = (_rand(1, 4, 2, 4, requires_grad=True) for _ in range(3))
    table = torch.zeros(9, dtype=torch.float64, requires_grad=True)
    score_mod = ScoreMod(RELATIVE, table=table, off=4)
    with pytest.raises(ValueError, match=r"score_mod argument table requires a gradient.*detach"):
        ops.attention(q, k, v, score_mod=score_mod)
    with torch.no_grad():   # nothing is differentiated: the tensor is used detached
        out = ops.attention(q, k, v, score_mod=score_mod)
    ref, _ = reference.attention_forward(_np(q), _np(k), _np(v), score_mod=ScoreMod(RELATIVE, table=_np(table), off=4))
    np.testing.assert_allclose(_np(out), ref, rtol=1e-12, atol=1e-12)
    out = ops.attention(q, k, v, score_mod=ScoreMod(RELATIVE, table=table.detach(), off=4))
    np.testing.assert_allclose(_np(out), ref, rtol=1e-12, atol=1e-12)


def test_a_score_mod_without_the_grad_it_needs_is_refused_before_the_forward(host_kernels):
    q, k, v = (_rand(1, 4, 2, 4, requires_grad=True) for _ in range(3))
    capped = ScoreMod(CAP[0], c=2.0)
    with pytest.raises(ValueError, match="grad="):
        ops.attention(q, k, v, score_mod=capped)
    with torch.no_grad():
        ops.attention(q, k, v, score_mod=capped)   # inference needs no grad


@pytest.mark.parametrize("fn", ["attention", "attention_forward", "attention_varlen", "decode"])
def test_modifiers_of_the_wrong_type_are_named(host_kernels, fn):
    q = _rand(1, 4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    args = {"attention": (q, q, q), "attention_forward": (q, q, q), "decode": (q, q.clone(), q.clone()),
            "attention_varlen": (q[0], q[0], q[0], cu, cu)}[fn]
    with pytest.raises(TypeError, match="score_mod"):
        getattr(ops, fn)(*args, score_mod=MaskMod("kv_idx <= q_idx"))
    with pytest.raises(TypeError, match="mask_mod"):
        getattr(ops, fn)(*args, mask_mod="kv_idx <= q_idx")


@pytest.mark.parametrize("entry", ["ops", "ct"])
def test_torch_compile_takes_modifiers_forward_and_backward(host_kernels, entry):
    # Made outside the compiled function, as users write them; the arrays are the graph's inputs,
    # read at every call (a write into the table between calls is seen, with no recompile).
    B, Sq, Sk, Hq, Hk, D = 2, 6, 9, 4, 2, 8
    table = torch.randn(2 * 16 + 1)
    score_mod = ScoreMod("c * tanh(score / c) + table[q_idx - kv_idx + off]",
                         grad="1.0 - tanh(score / c) * tanh(score / c)", table=table, off=16, c=3.0)
    mask_mod = MaskMod("kv_idx <= q_idx + w || kv_idx == 0", w=2)
    fn = ops.attention if entry == "ops" else ct.attention
    compiled = _compiled(lambda q, k, v: fn(q, k, v, score_mod=score_mod, mask_mod=mask_mod))
    for step in range(2):
        q, k, v = (_rand(*s, requires_grad=True) for s in ((B, Sq, Hq, D), (B, Sk, Hk, D), (B, Sk, Hk, D)))
        out = compiled(q, k, v)
        want, _ = reference.attention_forward(_np(q), _np(k), _np(v), score_mod=score_mod, mask_mod=mask_mod)
        np.testing.assert_allclose(_np(out), want, rtol=1e-12, atol=1e-12, err_msg=f"step {step}")
        dout = torch.randn_like(out)
        out.backward(dout)
        grads = reference.attention_backward(_np(dout), _np(q), _np(k), _np(v), score_mod=score_mod,
                                             mask_mod=mask_mod)
        for got, ref, name in zip((q.grad, k.grad, v.grad), grads, ("dq", "dk", "dv")):
            np.testing.assert_allclose(_np(got), ref, rtol=1e-10, atol=1e-12, err_msg=f"{name}, step {step}")
        table.mul_(-2.0)   # new values at the same address
    torch._dynamo.reset()


def test_under_compile_a_mask_mod_derives_no_block_mask(host_kernels, monkeypatch):
    # A compiled graph's inputs may be refilled at the same address (mode="reduce-overhead"), which a
    # block mask cached by address would not see: the traced call asks for none; an eager call keeps it.
    seen = []
    forward = ReferenceKernels.attention_forward

    def spy(q, k, v, out, lse, rng_state, options):
        seen.append(options["mask_mod"].derives_blocks)
        return forward(q, k, v, out, lse, rng_state, options)

    monkeypatch.setattr(ReferenceKernels, "attention_forward", staticmethod(spy))
    mask_mod = MaskMod("kv_idx <= q_idx")
    q = _rand(1, 4, 2, 8)
    ops.attention(q, q, q, mask_mod=mask_mod)
    _compiled(lambda q: ops.attention(q, q, q, mask_mod=mask_mod))(q)
    assert seen[0] is True and seen[-1] is False
    torch._dynamo.reset()


def test_the_ops_take_modifier_specs_and_arrays(host_kernels):
    # torch.ops.cuflash.* themselves: specs as strings, arrays as a Tensor[] (the ScoreMod's first),
    # checked by opcheck (schema, fake, autograd registration, AOT dispatch); a spec naming more
    # arrays than given, or arrays left over, is a ValueError.
    B, S, H, D = 1, 6, 2, 8
    q, k, v = (_rand(B, S, H, D, requires_grad=True) for _ in range(3))
    table, doc = torch.randn(2 * S + 1), torch.tensor([0, 0, 1, 1, 1, 2], dtype=torch.int32)
    score_mod = ScoreMod("score + table[q_idx - kv_idx + S]", table=table, S=S)
    mask_mod = MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc)
    specs = dict(score_mod=score_mod.spec, mask_mod=mask_mod.spec, mod_arrays=[table, doc])
    out, lse, _ = torch.ops.cuflash.attention_forward(q, k, v, **specs)
    want, _ = reference.attention_forward(_np(q), _np(k), _np(v), score_mod=score_mod, mask_mod=mask_mod)
    np.testing.assert_allclose(_np(out), want, rtol=1e-12, atol=1e-12)
    torch.library.opcheck(torch.ops.cuflash.attention_forward.default, (q, k, v), specs)
    with pytest.raises(ValueError, match="names 1 arrays"):
        torch.ops.cuflash.attention_forward(q, k, v, score_mod=score_mod.spec, mod_arrays=[])
    with pytest.raises(ValueError, match="more tensors"):
        torch.ops.cuflash.attention_forward(q, k, v, score_mod=score_mod.spec, mod_arrays=[table, doc])


def test_without_modifiers_the_ops_are_unchanged_under_compile(host_kernels):
    torch._dynamo.reset()
    q, k, v = (_rand(1, 5, 2, 8) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: ops.attention(q, k, v, causal=True), backend="eager", fullgraph=True)
    np.testing.assert_allclose(_np(compiled(q, k, v)), _np(ops.attention(q, k, v, causal=True)), rtol=0, atol=0)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- GPU: equal to cuflash's own calls

def _gpu(fn):
    for mark in gpu:
        fn = mark(fn)
    return fn


def _cupy(x):
    import cupy

    return cupy.from_dlpack(x.detach())


def _mods_on(device, S, Hq, B, cupy_arrays=False):
    """A relative-bias ScoreMod (float32 table) and a document MaskMod (int32 ids), as torch tensors or
    CuPy arrays holding the same values."""
    g = torch.Generator(device="cpu").manual_seed(int(np.random.default_rng().integers(2**31)))
    table = torch.randn(Hq * (2 * S + 1), generator=g).to(device)
    doc = torch.sort(torch.randint(0, 3, (B, S), generator=g), dim=1).values.to(torch.int32).reshape(-1).to(device)

    def build(table, doc):
        return (ScoreMod("score + table[h * (2 * S + 1) + q_idx - kv_idx + S]", table=table, S=S),
                MaskMod("doc[b * S + q_idx] == doc[b * S + kv_idx] || kv_idx == 0", doc=doc, S=S))
    return build(table, doc), build(_cupy(table), _cupy(doc))


@_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("entry", ["ct", "ops"])
def test_torch_attention_equals_cuflash(dtype, entry):
    import cupy

    B, Sq, Sk, Hq, Hk, D = 2, 77, 130, 4, 2, 64
    q, k, v = (torch.randn(B, s, h, D, device="cuda", dtype=dtype, requires_grad=True)
               for s, h in ((Sq, Hq), (Sk, Hk), (Sk, Hk)))
    (score_t, mask_t), (score_c, mask_c) = _mods_on("cuda", max(Sq, Sk), Hq, B)
    fn = ct.attention if entry == "ct" else ops.attention
    out = fn(q, k, v, causal=True, softcap=5.0, score_mod=score_t, mask_mod=mask_t, deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    torch.cuda.synchronize()
    qc, kc, vc = (_cupy(x) for x in (q, k, v))
    want, lse, _ = cuflash.attention_forward(qc, kc, vc, causal=True, softcap=5.0, score_mod=score_c, mask_mod=mask_c)
    dq, dk, dv = cuflash.attention_backward(_cupy(dout), qc, kc, vc, want, lse, causal=True, softcap=5.0,
                                            score_mod=score_c, mask_mod=mask_c, deterministic=True)
    cupy.cuda.get_current_stream().synchronize()
    for got, ref, name in ((out, want, "out"), (q.grad, dq, "dq"), (k.grad, dk, "dk"), (v.grad, dv, "dv")):
        np.testing.assert_array_equal(_cupy(got).view(cupy.uint8).get(), ref.view(cupy.uint8).get(), err_msg=name)


@_gpu
def test_torch_varlen_equals_cuflash():
    import cupy

    lengths = [33, 1, 120]
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), h, 64, device="cuda", dtype=torch.float16, requires_grad=True)
               for h in (4, 2, 2))
    (score_t, mask_t), (score_c, mask_c) = _mods_on("cuda", max(lengths), 4, len(lengths))
    out = ct.attention_varlen(q, k, v, cu, cu, max_seqlen_q=120, max_seqlen_k=120, causal=True, score_mod=score_t,
                              mask_mod=mask_t, deterministic=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    torch.cuda.synchronize()
    qc, kc, vc, cuc = (_cupy(x) for x in (q, k, v, cu))
    want, lse = cuflash.attention_varlen(qc, kc, vc, cuc, cuc, max_seqlen_q=120, max_seqlen_k=120, causal=True,
                                         score_mod=score_c, mask_mod=mask_c, return_lse=True)
    dq, dk, dv = cuflash.attention_varlen_backward(_cupy(dout), qc, kc, vc, want, lse, cuc, cuc, max_seqlen_q=120,
                                                   max_seqlen_k=120, causal=True, score_mod=score_c, mask_mod=mask_c,
                                                   deterministic=True)
    cupy.cuda.get_current_stream().synchronize()
    for got, ref, name in ((out, want, "out"), (q.grad, dq, "dq"), (k.grad, dk, "dk"), (v.grad, dv, "dv")):
        np.testing.assert_array_equal(_cupy(got).view(cupy.uint8).get(), ref.view(cupy.uint8).get(), err_msg=name)


@_gpu
@pytest.mark.parametrize("entry", ["ct", "ops"])
@pytest.mark.parametrize("page_size", [None, 16])
def test_torch_decode_equals_cuflash(entry, page_size):
    import cupy

    B, Sq, Hq, Hk, D = 3, 2, 8, 2, 128
    lens = torch.tensor([0, 100, 700], dtype=torch.int32, device="cuda")
    if page_size is None:
        k_cache, v_cache = (torch.randn(B, 1024, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        table = None
    else:
        pages = 1024 // page_size
        k_cache, v_cache = (torch.randn(B * pages, page_size, Hk, D, device="cuda", dtype=torch.bfloat16)
                            for _ in range(2))
        table = torch.randperm(B * pages, device="cuda").reshape(B, pages).to(torch.int32)
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(B, Sq, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    (score_t, mask_t), (score_c, mask_c) = _mods_on("cuda", 1024, Hq, B)
    kc0, vc0 = k_cache.clone(), v_cache.clone()
    fn = ct.decode if entry == "ct" else ops.decode
    out, lse = fn(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, k_new=k_new, v_new=v_new,
                  num_splits=3, score_mod=score_t, mask_mod=mask_t, return_lse=True)
    torch.cuda.synchronize()
    want, want_lse = cuflash.decode(_cupy(q), _cupy(kc0), _cupy(vc0), cache_seqlens=_cupy(lens),
                                    block_table=None if table is None else _cupy(table), k_new=_cupy(k_new),
                                    v_new=_cupy(v_new), num_splits=3, score_mod=score_c, mask_mod=mask_c,
                                    return_lse=True)
    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(_cupy(out).view(cupy.uint8).get(), want.view(cupy.uint8).get())
    np.testing.assert_array_equal(_cupy(lse).get(), want_lse.get())
    assert torch.equal(k_cache, kc0) and torch.equal(v_cache, vc0)   # both appended the same rows


@_gpu
def test_torch_compile_with_modifiers_equals_cuflash():
    # fullgraph through Inductor, forward and backward; under compile the MaskMod derives no block mask,
    # so the CuPy call it must equal bit for bit takes the same MaskMod with sparse=False.
    import cupy

    from cuflash.modifiers.spec import rebuild

    B, S, Hq, Hk, D = 2, 200, 4, 2, 64
    q, k, v = (torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (Hq, Hk, Hk))
    (score_t, mask_t), (score_c, mask_c) = _mods_on("cuda", S, Hq, B)
    dense_c, _ = rebuild(mask_c.spec_without_blocks, [mask_c.args.values["doc"]])
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: ct.attention(q, k, v, causal=True, score_mod=score_t, mask_mod=mask_t,
                                                          deterministic=True), fullgraph=True)
    out = compiled(q, k, v)
    dout = torch.randn_like(out)
    out.backward(dout)
    torch.cuda.synchronize()
    qc, kc, vc = (_cupy(x) for x in (q, k, v))
    want, lse, _ = cuflash.attention_forward(qc, kc, vc, causal=True, score_mod=score_c, mask_mod=dense_c)
    dq, dk, dv = cuflash.attention_backward(_cupy(dout), qc, kc, vc, want, lse, causal=True, score_mod=score_c,
                                            mask_mod=dense_c, deterministic=True)
    cupy.cuda.get_current_stream().synchronize()
    for got, ref, name in ((out, want, "out"), (q.grad, dq, "dq"), (k.grad, dk, "dk"), (v.grad, dv, "dv")):
        np.testing.assert_array_equal(_cupy(got).view(cupy.uint8).get(), ref.view(cupy.uint8).get(), err_msg=name)
    torch._dynamo.reset()
