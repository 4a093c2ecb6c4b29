"""cuflash.interop.torch.ops: the torch.library custom ops (torch.ops.cuflash.*).

Without a GPU (torch needed): the schemas, the fake implementations (on fake CUDA tensors where
this torch can make them, else on fake CPU tensors), autograd through fake tensors (make_fx), and,
with cuflash's float64 NumPy reference standing in for the kernels under the "cpu" device
(``_torch_ops._KERNELS``), ``torch.library.opcheck`` of every op, ``gradcheck`` of the autograd
formulas and ``torch.compile(fullgraph=True)`` of a transformer block, forward and backward,
dropout included: the torch side of the ops is checked without a GPU.

On a GPU: opcheck on the real kernels, the ops equal to the direct path bit for bit, the block
compiled with inductor (no graph break; forward, gradients and a few training steps equal to
eager, dropout drawing a fresh mask per call), and decode captured in ``torch.cuda.graph`` and
replayed with new data written into the captured inputs (contiguous and paged caches, split-KV,
with and without ``out``), equal to eager calls and near the float64 reference.

Inputs are fresh random tensors at every run (torch's unseeded generator); outputs the caller
provides are poisoned with NaN first.
"""

import math
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash  # noqa: E402
import cuflash.interop.torch as ct  # noqa: E402
from cuflash import reference  # noqa: E402
from cuflash.interop import _torch_library, _torch_ops  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ops = ct.ops
OPS = ("attention_forward", "attention_backward", "attention_varlen_forward", "attention_varlen_backward", "decode",
       "decode_out", "merge_states")
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA device")]


def _gpu(fn):
    for mark in gpu:
        fn = mark(fn)
    return fn


def _rand(*shape, dtype=torch.float32, device="cpu", requires_grad=False):
    x = torch.randn(*shape, device=device, dtype=torch.float32).to(dtype)
    return x.requires_grad_(requires_grad)


def _state(seed=None, offset=None):
    """A fresh rng_state tensor: [seed, offset] as int64 bits."""
    rng = np.random.default_rng()
    seed = int(rng.integers(0, 2**63)) if seed is None else seed
    offset = int(rng.integers(0, 2**20)) if offset is None else offset
    return torch.tensor([seed, offset], dtype=torch.int64)


# ----------------------------------------------------------------------------- schemas (CPU)

def test_ops_are_registered_with_their_schemas():
    for name in OPS:
        assert hasattr(torch.ops.cuflash, name), name
    mutated = {name: {a.name for a in getattr(torch.ops.cuflash, name).default._schema.arguments
                      if a.alias_info is not None and a.alias_info.is_write} for name in OPS}
    assert mutated["decode"] == {"k_cache", "v_cache"}
    assert mutated["decode_out"] == {"k_cache", "v_cache", "out"}
    assert all(not mutated[name] for name in OPS if not name.startswith("decode"))
    forward = torch.ops.cuflash.attention_forward.default
    assert [r.type.kind() for r in forward._schema.returns] == ["TensorType"] * 3
    if "tags" in _torch_ops._RANDOM:
        assert torch.Tag.nondeterministic_seeded in forward.tags
        assert torch.Tag.nondeterministic_seeded in torch.ops.cuflash.attention_varlen_forward.default.tags


def test_ops_reject_cpu_tensors():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="CUDA"):
        ops.attention(q, q, q)
    with pytest.raises(ValueError, match="CUDA"):
        ops.decode(q, q.clone(), q.clone())


# ----------------------------------------------------------------------------- fake implementations (CPU)

def _fake_device():
    """"cuda" when this torch makes fake CUDA tensors without a GPU (or has one), else "cpu"."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            torch.empty(1, device="cuda")
        return "cuda"
    except Exception:  # pragma: no cover - depends on the torch build
        return "cpu"


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_fake_shapes_match_the_contract(dropout_p):
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = _fake_device()
    B, Sq, Sk, Hq, Hk, D = 2, 17, 33, 8, 2, 40
    with FakeTensorMode():
        # q as a BHSD tensor viewed as BSHD: out is still C-contiguous (B, Sq, Hq, D).
        q = torch.empty(B, Hq, Sq, D, device=device, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.empty(B, Sk, Hk, D, device=device, dtype=torch.bfloat16)
        bias = torch.empty(1, Hq, 1, Sk, device=device, dtype=torch.float32)
        out, lse, rng = torch.ops.cuflash.attention_forward(q, k, k, bias=bias, dropout_p=dropout_p)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous() and out.device == q.device
        assert lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32 and lse.is_contiguous()
        assert rng.shape == ((2,) if dropout_p else (0,)) and rng.dtype == torch.int64
        assert rng.device.type == ("cpu" if dropout_p else device)

        dq, dk, dv, dbias, dsinks = torch.ops.cuflash.attention_backward(out, q, k, k, out, lse, rng, bias=bias,
                                                                         dropout_p=dropout_p, return_dbias=True)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape and dq.is_contiguous()
        assert dbias.shape == bias.shape and dbias.dtype == bias.dtype and dsinks.numel() == 0
        assert torch.ops.cuflash.attention_backward(out, q, k, k, out, lse, rng)[3].numel() == 0
        sinks = torch.empty(Hq, device=device, dtype=torch.float32)
        assert torch.ops.cuflash.attention_forward(q, k, k, sinks=sinks)[1].shape == (B, Hq, Sq)
        dsinks = torch.ops.cuflash.attention_backward(out, q, k, k, out, lse, rng, dropout_p=dropout_p, sinks=sinks,
                                                      return_dsinks=True)[4]
        assert dsinks.shape == (Hq,) and dsinks.dtype == torch.float32
        with pytest.raises(ValueError, match="sinks must have shape"):
            torch.ops.cuflash.attention_forward(q, k, k, sinks=torch.empty(Hq + 1, device=device))
        with pytest.raises(ValueError, match="return_dsinks=True needs sinks"):
            torch.ops.cuflash.attention_backward(out, q, k, k, out, lse, rng, dropout_p=dropout_p, return_dsinks=True)

        qv = torch.empty(50, Hq, D, device=device, dtype=torch.float16)
        kv = torch.empty(70, Hk, D, device=device, dtype=torch.float16)
        cu = torch.empty(4, device=device, dtype=torch.int32)
        out, lse, rng = torch.ops.cuflash.attention_varlen_forward(qv, kv, kv, cu, cu, dropout_p=dropout_p)
        assert out.shape == qv.shape and lse.shape == (Hq, 50) and lse.dtype == torch.float32
        dq, dk, dv, dsinks = torch.ops.cuflash.attention_varlen_backward(out, qv, kv, kv, out, lse, cu, cu, rng,
                                                                         dropout_p=dropout_p)
        assert dq.shape == qv.shape and dk.shape == kv.shape and dv.dtype == torch.float16 and dsinks.numel() == 0
        dsinks = torch.ops.cuflash.attention_varlen_backward(out, qv, kv, kv, out, lse, cu, cu, rng,
                                                             dropout_p=dropout_p, sinks=sinks, return_dsinks=True)[3]
        assert dsinks.shape == (Hq,) and dsinks.dtype == torch.float32

        q1 = torch.empty(B, 3, Hq, D, device=device, dtype=torch.bfloat16)
        cache = torch.empty(B, 256, Hk, D, device=device, dtype=torch.bfloat16)
        out, lse = torch.ops.cuflash.decode(q1, cache, cache.clone())
        assert out.shape == q1.shape and out.dtype == q1.dtype and lse.shape == (B, Hq, 3)
        assert torch.ops.cuflash.decode_out(q1, cache, cache.clone(), torch.empty_like(q1)).shape == (B, Hq, 3)
        assert torch.ops.cuflash.decode(q1, cache, cache.clone(), sinks=sinks)[1].shape == (B, Hq, 3)
        assert torch.ops.cuflash.decode_out(q1, cache, cache.clone(), torch.empty_like(q1), sinks=sinks).shape == \
            (B, Hq, 3)
        with pytest.raises(ValueError, match="sinks must have shape"):
            torch.ops.cuflash.decode(q1, cache, cache.clone(), sinks=torch.empty(1, device=device))

        outs = torch.empty(3, B, 5, Hq, D, device=device, dtype=torch.float16)
        lses = torch.empty(3, B, Hq, 5, device=device, dtype=torch.float32)
        out, lse = torch.ops.cuflash.merge_states(outs, lses)
        assert out.shape == (B, 5, Hq, D) and out.dtype == torch.float16 and lse.shape == (B, Hq, 5)


def test_autograd_traces_through_the_fakes():
    """make_fx with symbolic shapes: forward op, then the backward op, gradients shaped like the inputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def loss_and_grads(q, k, v, bias):
        out = ops.attention(q, k, v, bias=bias, causal=True)
        return torch.autograd.grad(out.float().square().sum(), (q, k, v, bias))

    inputs = [_rand(2, 9, 4, 16, requires_grad=True), _rand(2, 11, 2, 16, requires_grad=True),
              _rand(2, 11, 2, 16, requires_grad=True), _rand(1, 4, 9, 11, requires_grad=True)]
    graph = make_fx(loss_and_grads, tracing_mode="symbolic")(*inputs)
    code = graph.code
    assert "cuflash.attention_forward" in code and "cuflash.attention_backward" in code
    fake_grads = [n for n in graph.graph.nodes if n.op == "output"][0].args[0]
    for node, x in zip(fake_grads, inputs):
        assert len(node.meta["val"].shape) == x.dim()


# ----------------------------------------------------------------------------- the float64 reference as CPU kernels

def _np(x):
    if x is None:
        return None
    x = x.detach()
    return x.double().numpy() if x.is_floating_point() else x.numpy()


def _host(options, drop=()):
    return {name: (_np(value) if isinstance(value, torch.Tensor) else value) for name, value in options.items()
            if name not in drop}


def _into(target, array):
    target.copy_(torch.from_numpy(np.ascontiguousarray(array)))


class ReferenceKernels:
    """cuflash.reference (float64, NumPy) in place of the CUDA kernels, for CPU tensors."""

    @staticmethod
    def attention_forward(q, k, v, out, lse, rng_state, options):
        o, s = reference.attention_forward(_np(q), _np(k), _np(v), rng_state=rng_state, **_host(options))
        _into(out, o)
        _into(lse, s)

    @staticmethod
    def attention_backward(dout, q, k, v, out, lse, dq, dk, dv, rng_state, options, return_dbias, return_dsinks):
        grads = reference.attention_backward(_np(dout), _np(q), _np(k), _np(v), rng_state=rng_state,
                                             return_dbias=return_dbias, return_dsinks=return_dsinks,
                                             **_host(options, ("deterministic",)))
        for target, g in zip((dq, dk, dv), grads):
            _into(target, g)
        extra = list(grads[3:])
        dbias = torch.from_numpy(np.ascontiguousarray(extra.pop(0))).to(options["bias"].dtype) if return_dbias else None
        dsinks = torch.from_numpy(np.ascontiguousarray(extra.pop(0))).to(options["sinks"].dtype) if return_dsinks \
            else None
        return dbias, dsinks

    @staticmethod
    def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, out, rng_state, options):
        if "cache_seqlens" in options:   # chunked prefill: each sequence's chunk as decode's queries
            return ReferenceKernels._varlen_over_cache(q, k, v, cu_seqlens_q, out, options)
        o, s = reference.attention_varlen(_np(q), _np(k), _np(v), _np(cu_seqlens_q), _np(cu_seqlens_k),
                                          rng_state=rng_state, **_host(options))
        _into(out, o)
        return torch.from_numpy(s).float()

    @staticmethod
    def _varlen_over_cache(q, k_cache, v_cache, cu_seqlens_q, out, options):
        cu, lens = _np(cu_seqlens_q), _np(options["cache_seqlens"])
        table = _np(options["block_table"])
        lse = torch.full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32)
        for b in range(len(lens)):
            rows = slice(int(cu[b]), int(cu[b + 1]))
            if rows.start == rows.stop:
                continue
            kc, vc = ((x if table is not None else x[b:b + 1]) for x in (_np(k_cache), _np(v_cache)))
            o, s = reference.decode(_np(q)[rows][None], kc, vc, cache_seqlens=lens[b:b + 1],
                                    block_table=None if table is None else table[b:b + 1], causal=options["causal"],
                                    scale=options["scale"], window=options["window"], softcap=options["softcap"])
            out[rows] = torch.from_numpy(o[0])
            lse[:, rows] = torch.from_numpy(s[0]).float()
        return lse

    @staticmethod
    def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, rng_state,
                                  options, return_dsinks):
        grads = reference.attention_varlen_backward(_np(dout), _np(q), _np(k), _np(v), _np(cu_seqlens_q),
                                                    _np(cu_seqlens_k), rng_state=rng_state, return_dsinks=return_dsinks,
                                                    **_host(options, ("deterministic",)))
        for target, g in zip((dq, dk, dv), grads):
            _into(target, g)
        return torch.from_numpy(np.ascontiguousarray(grads[3])).to(options["sinks"].dtype) if return_dsinks else None

    @staticmethod
    def decode(q, k_cache, v_cache, out, lse, options):
        # fp8 caches as the CUDA kernels get them: uint8 views (written through), kv_dtype, the scales.
        k_cache, v_cache, cache_options = _torch_ops.decode_cache_arguments(k_cache, v_cache, options["k_scale"],
                                                                            options["v_scale"])
        options = dict(options, **cache_options)
        o, s, k_after, v_after = reference.decode(_np(q), k_cache.detach().numpy(),
                                                  None if v_cache is None else v_cache.detach().numpy(),
                                                  return_cache=True, **_host(options, ("num_splits",)))
        _into(out, o)
        _into(lse, s)
        _into(k_cache, k_after)
        if v_cache is not None:   # (MLA: one latent cache)
            _into(v_cache, v_after)

    @staticmethod
    def merge_states(outs, lses, out, lse):
        o, s = reference.merge_states(_np(outs), _np(lses))
        _into(out, o)
        _into(lse, s)


@pytest.fixture
def host_kernels(monkeypatch):
    monkeypatch.setitem(_torch_ops._KERNELS, "cpu", ReferenceKernels)


def _opcheck(op, args, kwargs=None, **tolerance):
    torch.library.opcheck(op, args, kwargs or {}, **tolerance)


def _sinks(heads, device, requires_grad=False):
    """Attention sinks (Hq,): float32 for the CUDA kernels, float64 for the reference under "cpu" (so that
    gradcheck's finite differences are exact); one head without a sink (-inf)."""
    x = torch.randn(heads, dtype=torch.float32 if device == "cuda" else torch.float64, device=device)
    x[1] = -math.inf
    return x.requires_grad_(requires_grad)


def _forward_cases(device, dtype):
    """(args, kwargs) of attention_forward: GQA causal; every score modifier with a bias that
    requires a gradient; dropout with a given state; a mask and a block mask; sinks that require a
    gradient, with a window."""
    B, Sq, Sk, Hq, Hk, D = 2, 37, 45, 4, 2, 32
    mk = lambda *s: _rand(*s, dtype=dtype, device=device, requires_grad=True)  # noqa: E731
    cases = [((mk(B, Sq, Hq, D), mk(B, Sk, Hk, D), mk(B, Sk, Hk, D)), dict(causal=True, deterministic=True))]
    slopes = torch.rand(Hq, device=device) * 0.3
    bias = _rand(1, Hq, Sq, Sk, device=device, requires_grad=True)
    cases.append(((mk(B, Sq, Hq, D), mk(B, Sk, Hk, D), mk(B, Sk, Hk, D)),
                  dict(alibi_slopes=slopes, bias=bias, window_left=20, window_right=5, softcap=15.0, scale=0.2,
                       deterministic=True)))
    cases.append(((mk(B, Sq, Hq, D), mk(B, Sk, Hk, D), mk(B, Sk, Hk, D)),
                  dict(dropout_p=0.3, rng_state=_state(), causal=True, deterministic=True)))
    mask = torch.rand(B, 1, Sq, Sk, device=device) < 0.8
    block_mask = torch.ones(B, Hq, math.ceil(Sq / 16), math.ceil(Sk / 16), dtype=torch.bool, device=device)
    block_mask[:, :, :, 0] = False   # every row still sees keys beyond the first block
    cases.append(((mk(B, Sq, Hq, D), mk(B, Sk, Hk, D), mk(B, Sk, Hk, D)),
                  dict(mask=mask, block_mask=block_mask, block_q=16, block_k=16, deterministic=True)))
    cases.append(((mk(B, Sq, Hq, D), mk(B, Sk, Hk, D), mk(B, Sk, Hk, D)),
                  dict(sinks=_sinks(Hq, device, requires_grad=True), causal=True, window_left=9, window_right=0,
                       deterministic=True)))
    return cases


def _varlen_inputs(device, dtype, requires_grad=True):
    lengths_q, lengths_k = [5, 0, 19, 12], [7, 3, 19, 30]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32, device=device)
    mk = lambda *s: _rand(*s, dtype=dtype, device=device, requires_grad=requires_grad)  # noqa: E731
    return (mk(sum(lengths_q), 4, 32), mk(sum(lengths_k), 2, 32), mk(sum(lengths_k), 2, 32), cu_q, cu_k,
            max(lengths_q), max(lengths_k))


def _decode_cases(device, dtype):
    """(args, kwargs) of decode: a contiguous cache with an append; a paged one with an append."""
    B, Sq, Hq, Hk, D = 3, 2, 8, 2, 32
    mk = lambda *s: _rand(*s, dtype=dtype, device=device)  # noqa: E731
    lens = torch.tensor([0, 17, 60], dtype=torch.int32, device=device)
    cases = [((mk(B, Sq, Hq, D), mk(B, 64, Hk, D), mk(B, 64, Hk, D)),
              dict(cache_seqlens=lens, k_new=mk(B, Sq, Hk, D), v_new=mk(B, Sq, Hk, D), num_splits=2,
                   sinks=_sinks(Hq, device)))]
    page_size, max_pages = 16, 5
    table = torch.randperm(B * max_pages + 2, device=device)[:B * max_pages].reshape(B, max_pages).to(torch.int32)
    cases.append(((mk(B, Sq, Hq, D), mk(B * max_pages + 2, page_size, Hk, D), mk(B * max_pages + 2, page_size, Hk, D)),
                  dict(cache_seqlens=lens, block_table=table, k_new=mk(B, Sq, Hk, D), v_new=mk(B, Sq, Hk, D))))
    return cases


def _fp8_decode_case(device, dtype, per_head=False):
    """(args, kwargs) of decode on torch.float8_e4m3fn caches (e4m3 of values within +-4 under scales),
    with an append; scales per kv head (float32 tensors) or per tensor (floats)."""
    B, Sq, Hq, Hk, D, L = 2, 2, 4, 2, 32, 24
    mk = lambda *s: _rand(*s, dtype=dtype, device=device)  # noqa: E731
    k_scale = torch.tensor([0.02, 0.05], device=device) if per_head else 0.03125
    v_scale = torch.tensor([0.04, 0.01], device=device) if per_head else 0.0625
    fp8 = lambda x, s: (x / s).clamp(-448, 448).to(torch.float8_e4m3fn)  # noqa: E731
    ks = k_scale.view(1, 1, Hk, 1) if per_head else k_scale
    vs = v_scale.view(1, 1, Hk, 1) if per_head else v_scale
    k_cache = fp8(torch.randn(B, L, Hk, D, device=device) * 2, ks)
    v_cache = fp8(torch.randn(B, L, Hk, D, device=device) * 2, vs)
    lens = torch.tensor([0, 13], dtype=torch.int32, device=device)
    return ((mk(B, Sq, Hq, D), k_cache, v_cache),
            dict(cache_seqlens=lens, k_new=mk(B, Sq, Hk, D), v_new=mk(B, Sq, Hk, D), k_scale=k_scale, v_scale=v_scale))


def _merge_inputs(device, dtype):
    outs = _rand(3, 2, 5, 4, 32, dtype=dtype, device=device)
    lses = _rand(3, 2, 4, 5, device=device) * 3
    lses[0, 0, 0, 0] = -math.inf   # a part that saw no key
    return outs, lses


def _opcheck_all(device, dtype):
    for args, kwargs in _forward_cases(device, dtype):
        _opcheck(torch.ops.cuflash.attention_forward.default, args, kwargs)
        out, lse, rng = torch.ops.cuflash.attention_forward(*args, **kwargs)
        dout = torch.randn_like(out)
        bwd = {n: (v.detach() if isinstance(v, torch.Tensor) else v) for n, v in kwargs.items() if n != "rng_state"}
        bwd["return_dbias"] = "bias" in kwargs
        bwd["return_dsinks"] = "sinks" in kwargs
        _opcheck(torch.ops.cuflash.attention_backward.default,
                 (dout, *(x.detach() for x in args), out.detach(), lse, rng), bwd)
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs(device, dtype)
    for kwargs in (dict(causal=True, deterministic=True), dict(dropout_p=0.2, rng_state=_state(), deterministic=True),
                   dict(causal=True, sinks=_sinks(q.shape[1], device, requires_grad=True), deterministic=True)):
        args = (q, k, v, cu_q, cu_k)
        kwargs = dict(kwargs, max_seqlen_q=max_q, max_seqlen_k=max_k)
        _opcheck(torch.ops.cuflash.attention_varlen_forward.default, args, kwargs)
        out, lse, rng = torch.ops.cuflash.attention_varlen_forward(*args, **kwargs)
        bwd = {n: (v.detach() if isinstance(v, torch.Tensor) else v) for n, v in kwargs.items() if n != "rng_state"}
        bwd["return_dsinks"] = "sinks" in kwargs
        _opcheck(torch.ops.cuflash.attention_varlen_backward.default,
                 (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, cu_q, cu_k, rng), bwd)
    for args, kwargs in _decode_cases(device, dtype):
        _opcheck(torch.ops.cuflash.decode.default, args, kwargs)
        out = torch.full_like(args[0], math.nan)
        _opcheck(torch.ops.cuflash.decode_out.default, (*args, out), kwargs)
    if dtype != torch.float32:   # fp8 caches (the ops take the scales as tensors)
        for per_head in (False, True):
            args, kwargs = _fp8_decode_case(device, dtype, per_head)
            kwargs = {n: (torch.tensor(v, dtype=torch.float32) if isinstance(v, float) else v) for n, v in kwargs.items()}
            # (test_schema compares the mutated caches with float arithmetic torch lacks for float8)
            utils = ("test_faketensor", "test_aot_dispatch_dynamic")
            _opcheck(torch.ops.cuflash.decode.default, args, kwargs, test_utils=utils)
            _opcheck(torch.ops.cuflash.decode_out.default, (*args, torch.full_like(args[0], math.nan)), kwargs,
                     test_utils=utils)
    _opcheck(torch.ops.cuflash.merge_states.default, _merge_inputs(device, dtype))


def test_opcheck_every_op_with_host_kernels(host_kernels):
    _opcheck_all("cpu", torch.float64)


@pytest.mark.parametrize("entry", ["ops", "ops with out", "ct compiled"])
def test_mla_decode_through_the_ops(host_kernels, entry):
    """MLA decode (v_cache None, v_head_dim): the ops take an absent v_cache (schema ``Tensor(a!)?``) and
    v_head_dim, out has v_head_dim columns, k_new's latent rows are appended to the one cache; eagerly,
    into ``out=`` and compiled (ct.decode becomes the op); opcheck on both ops. The reference kernels
    run any width (the CUDA kernel takes 576)."""
    B, Sq, Hq, D, Dv, cap = 2, 2, 4, 24, 16, 30
    q, latent, k_new = (_rand(*s, dtype=torch.float64) for s in ((B, Sq, Hq, D), (B, cap, 1, D), (B, Sq, 1, D)))
    lens = torch.tensor([3, 20], dtype=torch.int32)
    want, want_lse, after, _ = reference.decode(_np(q), _np(latent), None, v_head_dim=Dv, cache_seqlens=_np(lens),
                                                k_new=_np(k_new), return_cache=True)
    out = torch.full((B, Sq, Hq, Dv), math.nan, dtype=q.dtype) if entry == "ops with out" else None
    kwargs = dict(cache_seqlens=lens, k_new=k_new, v_head_dim=Dv, return_lse=True, out=out)
    if entry == "ct compiled":
        torch._dynamo.reset()
        fn = torch.compile(ct.decode, backend="aot_eager", fullgraph=True)
    else:
        fn = ops.decode
    got, lse = fn(q, latent, None, **kwargs)
    assert got.shape == (B, Sq, Hq, Dv) and (out is None or got is out)
    np.testing.assert_allclose(_np(got), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(_np(lse), want_lse, rtol=1e-6, atol=1e-6)   # float32
    np.testing.assert_array_equal(_np(latent), after)
    torch._dynamo.reset()
    args = (q, latent.clone(), None)
    op_kwargs = dict(cache_seqlens=lens, k_new=k_new, v_head_dim=Dv)
    _opcheck(torch.ops.cuflash.decode.default, args, op_kwargs)
    _opcheck(torch.ops.cuflash.decode_out.default, (*args, torch.full((B, Sq, Hq, Dv), math.nan, dtype=q.dtype)),
             op_kwargs)


@pytest.mark.parametrize("entry", ["ops", "ct compiled"])
def test_value_head_dim_through_the_ops(host_kernels, entry):
    """A value head dim of its own (issue 53): out and dout with v's head dim, dv with v's shape, from the
    dense and the varlen ops, eagerly and compiled (ct.attention becomes the op); the gradients
    against the float64 reference; opcheck on both forward ops (their fakes give out v's head dim)."""
    B, Sq, Sk, Hq, Hk, D, Dv = 2, 5, 7, 4, 2, 12, 20
    f64 = torch.float64
    q, k = _rand(B, Sq, Hq, D, dtype=f64, requires_grad=True), _rand(B, Sk, Hk, D, dtype=f64, requires_grad=True)
    v = _rand(B, Sk, Hk, Dv, dtype=f64, requires_grad=True)
    dout = _rand(B, Sq, Hq, Dv, dtype=f64)
    if entry == "ct compiled":
        torch._dynamo.reset()
        fn = torch.compile(lambda *a: ct.attention(*a, causal=True), backend="aot_eager", fullgraph=True)
    else:
        fn = lambda *a: ops.attention(*a, causal=True)   # noqa: E731
    out = fn(q, k, v)
    assert out.shape == (B, Sq, Hq, Dv)
    want, _ = reference.attention_forward(_np(q), _np(k), _np(v), causal=True)
    np.testing.assert_allclose(_np(out), want, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = reference.attention_backward(_np(dout), _np(q), _np(k), _np(v), causal=True)[:3]
    for got, ref, x in zip(grads, refs, (q, k, v)):
        assert got.shape == x.shape
        np.testing.assert_allclose(_np(got), ref, rtol=1e-10, atol=1e-10)

    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 7], dtype=torch.int32)
    qv, kv, vv = q[0].detach(), k[0].detach(), v[0].detach()
    got = ops.attention_varlen(qv, kv, vv, cu, cu_k, max_seqlen_q=3, max_seqlen_k=4)
    assert got.shape == (Sq, Hq, Dv)
    want_v, _ = reference.attention_varlen(_np(qv), _np(kv), _np(vv), _np(cu), _np(cu_k))
    np.testing.assert_allclose(_np(got), want_v, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()
    _opcheck(torch.ops.cuflash.attention_forward.default, (q.detach(), k.detach(), v.detach()), dict(causal=True))
    _opcheck(torch.ops.cuflash.attention_varlen_forward.default, (qv, kv, vv, cu, cu_k),
             dict(max_seqlen_q=3, max_seqlen_k=4))


@pytest.mark.parametrize("paged", [False, True])
def test_chunked_prefill_through_the_varlen_op(host_kernels, paged):
    """attention_varlen over a KV cache (cache_seqlens, block_table; cu_seqlens_k None): ragged chunks of
    new tokens already in their caches, through ops.attention_varlen and compiled ct.attention_varlen,
    against each sequence's reference decode; inference only (a recorded gradient is refused, naming
    the way out); opcheck of the op with the cache arguments."""
    B, Hq, Hk, D, L, page = 3, 4, 2, 8, 40, 8
    n = np.array([5, 0, 9])
    lens = torch.tensor(n + np.array([7, 3, 20]), dtype=torch.int32)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32)
    q = _rand(int(n.sum()), Hq, D, dtype=torch.float64)
    if paged:
        k_cache, v_cache = (_rand(B * L // page, page, Hk, D, dtype=torch.float64) for _ in range(2))
        table = torch.randperm(B * L // page, dtype=torch.int32).reshape(B, L // page)
    else:
        k_cache, v_cache = (_rand(B, L, Hk, D, dtype=torch.float64) for _ in range(2))
        table = None
    want = torch.full(q.shape, math.nan, dtype=q.dtype)
    want_lse = ReferenceKernels._varlen_over_cache(q, k_cache, v_cache, cu, want, dict(
        cache_seqlens=lens, block_table=table, causal=True, scale=None, window=None, softcap=0.0))
    kwargs = dict(max_seqlen_q=int(n.max()), causal=True, cache_seqlens=lens, block_table=table)
    out, lse = ops.attention_varlen(q, k_cache, v_cache, cu, None, return_lse=True, **kwargs)
    np.testing.assert_allclose(_np(out), _np(want), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(_np(lse), _np(want_lse), rtol=1e-6, atol=1e-6)   # float32
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: ct.attention_varlen(*a, **kwargs), backend="aot_eager", fullgraph=True)
    np.testing.assert_allclose(_np(compiled(q, k_cache, v_cache, cu, None)), _np(want), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="no backward.*torch.no_grad"):
        ops.attention_varlen(q.clone().requires_grad_(True), k_cache, v_cache, cu, None, **kwargs)
    torch._dynamo.reset()
    _opcheck(torch.ops.cuflash.attention_varlen_forward.default, (q, k_cache, v_cache, cu, None),
             dict(max_seqlen_q=int(n.max()), causal=True, cache_seqlens=lens, block_table=table))


def test_gradcheck_of_the_autograd_formulas(host_kernels):
    """torch.autograd.gradcheck (finite differences in float64) through the ops: the backward op is
    wired to the right inputs, GQA gradients summed, dbias reduced to bias's broadcast shape, dsinks
    (the backward asked for return_dsinks) per query head."""
    q, k, v = (_rand(*s, dtype=torch.float64, requires_grad=True) for s in ((1, 5, 4, 8), (1, 7, 2, 8), (1, 7, 2, 8)))
    bias = _rand(4, 1, 7, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(4, dtype=torch.float32)
    fn = lambda q, k, v, bias: ops.attention(q, k, v, bias=bias, alibi_slopes=slopes, causal=True,  # noqa: E731
                                             softcap=3.0, window=(3, -1))
    assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-6)
    qv, kv, vv, cu_q, cu_k, max_q, max_k = _varlen_inputs("cpu", torch.float64)
    fv = lambda q, k, v: ops.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,  # noqa: E731
                                              causal=True)
    assert torch.autograd.gradcheck(fv, (qv, kv, vv), eps=1e-6, atol=1e-6)

    # Sinks (one head without: -inf, whose gradient is 0), beside a window and dropout off.
    sinks = _sinks(4, "cpu", requires_grad=True)
    fs = lambda q, k, v, sinks: ops.attention(q, k, v, sinks=sinks, causal=True, window=(3, -1))  # noqa: E731
    assert torch.autograd.gradcheck(fs, (q, k, v, sinks), eps=1e-6, atol=1e-6)
    fvs = lambda q, k, v, sinks: ops.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=max_q,  # noqa: E731
                                                      max_seqlen_k=max_k, causal=True, sinks=sinks)
    assert torch.autograd.gradcheck(fvs, (qv, kv, vv, sinks), eps=1e-6, atol=1e-6)
    # The gradient reaches sinks alone too (q, k, v constants), and through the eager functions.
    out = ops.attention(q.detach(), k.detach(), v.detach(), sinks=sinks, causal=True)
    (g,) = torch.autograd.grad(out.square().sum(), sinks)
    assert g.shape == (4,) and g[1].item() == 0.0 and bool(torch.isfinite(g).all())


class Block(torch.nn.Module):
    """Pre-norm transformer block: layernorm, qkv projection (GQA), cuflash attention through the
    custom op, output projection, MLP."""

    def __init__(self, dim, heads, kv_heads, *, window=None, dropout_p=0.0, attn_dtype=None, deterministic=True):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.window, self.dropout_p, self.attn_dtype, self.deterministic = window, dropout_p, attn_dtype, deterministic
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, S, C = x.shape
        hd = self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], dim=-1)
        q, k, v = q.view(B, S, self.heads, hd), k.view(B, S, self.kv_heads, hd), v.view(B, S, self.kv_heads, hd)
        if self.attn_dtype is not None:
            q, k, v = q.to(self.attn_dtype), k.to(self.attn_dtype), v.to(self.attn_dtype)
        a = ops.attention(q, k, v, causal=True, window=self.window, dropout_p=self.dropout_p if self.training else 0.0,
                          deterministic=self.deterministic)
        x = x + self.proj(a.to(x.dtype).reshape(B, S, C))
        return x + self.mlp(self.norm2(x))


def _run(model, x, seed=None):
    """Output and parameter gradients of one forward/backward (cuflash's default generator
    reseeded first when ``seed`` is given)."""
    model.zero_grad(set_to_none=True)
    if seed is not None:
        cuflash.manual_seed(seed)
    y = model(x)
    y.float().square().mean().backward()
    return y.detach(), [p.grad.detach().clone() for p in model.parameters()]


def _compile_counted(model, backend):
    """torch.compile(fullgraph=True) of ``model``, and the Dynamo graphs it made (recorded by the backend)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = []
    inner = torch._dynamo.lookup_backend(backend)

    def recording(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    return torch.compile(model, backend=recording, fullgraph=True), graphs


def _assert_one_graph(graphs):
    import torch._dynamo

    assert len(graphs) == 1, f"{len(graphs)} graphs"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert "cuflash.attention_forward" in graphs[0].code


def _assert_close(got, want, rel, name):
    """Each pair within a relative (Frobenius) error ``rel``."""
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (name, i, g.shape, w.shape)
        err = ((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30)).item()
        assert err <= rel, f"{name}[{i}]: relative error {err:.2e} > {rel:.0e}"


def _check_compiled_block(device, backend, *, dtype, attn_dtype, rel, seq=24, dim=64, heads=4, kv_heads=2):
    torch.manual_seed(int(np.random.default_rng().integers(2**31)))
    model = Block(dim, heads, kv_heads, window=(seq // 2, -1), attn_dtype=attn_dtype).to(device=device, dtype=dtype)
    x = _rand(2, seq, dim, dtype=dtype, device=device)
    compiled, graphs = _compile_counted(model, backend)
    y_c, g_c = _run(compiled, x)
    y_e, g_e = _run(model, x)
    _assert_one_graph(graphs)
    _assert_close([y_c], [y_e], rel, "output")
    _assert_close(g_c, g_e, rel, "gradients")

    # Dropout in the compiled graph: each call draws a fresh state from cuflash's default generator
    # (one draw per call: the op runs once, never recomputed), and with the generator reseeded the
    # compiled block reproduces eager mode, mask and gradients included.
    model.dropout_p = 0.3
    compiled, graphs = _compile_counted(model, backend)
    y1, g1 = _run(compiled, x, seed=11)
    assert cuflash.default_generator().offset == 1
    y2, _ = _run(compiled, x)
    assert cuflash.default_generator().offset == 2 and not torch.equal(y1, y2)
    y0, g0 = _run(model, x, seed=11)
    _assert_one_graph(graphs)
    _assert_close([y1], [y0], rel, "dropout output")
    _assert_close(g1, g0, rel, "dropout gradients")
    assert ((y1 - y0).norm() / (y2 - y0).norm()).item() < 0.1   # another mask is far off


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")), reason="inductor on the CPU needs a C++ compiler"))])
def test_compiled_block_matches_eager_with_host_kernels(host_kernels, backend):
    _check_compiled_block("cpu", backend, dtype=torch.float64, attn_dtype=None, rel=1e-9, dim=32)


def test_export_of_the_block_keeps_the_op(host_kernels):
    model = Block(32, 4, 2)
    exported = torch.export.export(model, (_rand(2, 10, 32),))
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert "cuflash.attention_forward.default" in targets, targets


def test_generator_and_rng_state(host_kernels):
    q, k, v = _rand(1, 6, 2, 8), _rand(1, 9, 2, 8), _rand(1, 9, 2, 8)
    g = cuflash.Generator(2**64 - 5)    # a seed past int64: carried as its bits
    out, lse, rng = ops.attention_forward(q, k, v, dropout_p=0.4, generator=g)
    assert rng.device.type == "cpu" and rng.view(torch.uint64)[0].item() == 2**64 - 5 and g.offset == 1
    again, _, rng2 = ops.attention_forward(q, k, v, dropout_p=0.4, rng_state=rng)
    assert torch.equal(out, again) and torch.equal(rng, rng2)
    ref, _ = reference.attention_forward(_np(q), _np(k), _np(v), dropout_p=0.4, rng_state=(2**64 - 5, 0))
    np.testing.assert_allclose(out.double().numpy(), ref, rtol=1e-6, atol=1e-6)
    _, _, none = ops.attention_forward(q, k, v)
    assert none.shape == (0,) and none.dtype == torch.int64, "without dropout the state is empty (no kernel fills it)"
    with pytest.raises(ValueError, match="either generator or rng_state"):
        ops.attention_forward(q, k, v, dropout_p=0.4, generator=g, rng_state=rng)
    with pytest.raises(ValueError, match="dropout_p"):
        ops.attention_forward(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match="rng_state"):
        ops.attention_forward(q, k, v, dropout_p=0.4, rng_state=torch.zeros(3, dtype=torch.int64))


class _SeenOps(TorchDispatchMode):
    """A dispatch mode that records the ops it sees."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_kernels_run_directly_only_on_plain_tensors_outside_modes(host_kernels):
    """Below autograd an op runs its kernel without the dispatcher only for plain tensors with no
    dispatch mode active: a mode still sees the op (and the results agree), and fake tensors or
    subclasses (a Parameter) go through the dispatcher."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _rand(1, 6, 2, 8), _rand(1, 9, 2, 8), _rand(1, 9, 2, 8)
    assert _torch_library.direct((q, k, v, None, True, 0.5))
    assert not _torch_library.direct((q, torch.nn.Parameter(k), v))

    plain = ops.attention(q, k, v, causal=True)
    with _SeenOps() as seen:
        assert not _torch_library.direct((q, k, v))
        moded = ops.attention(q, k, v, causal=True)
    assert any("cuflash.attention_forward" in name for name in seen.ops), seen.ops
    assert torch.equal(plain, moded)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        assert not _torch_library.direct((fq, fk, fv))
        assert ops.attention(fq, fk, fv, causal=True).shape == q.shape


def test_merge_of_a_list_and_decode_out_with_host_kernels(host_kernels):
    outs = [_rand(2, 3, 4, 8, dtype=torch.float32), _rand(2, 3, 4, 8, dtype=torch.float64)]
    lses = [_rand(2, 4, 3), _rand(2, 4, 3)]
    out, lse = ops.merge_states(outs, lses)
    want, want_lse = reference.merge_states([_np(x) for x in outs], [_np(x) for x in lses])
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse.double().numpy(), want_lse, rtol=1e-6, atol=1e-6)

    (q, k_cache, v_cache), kwargs = _decode_cases("cpu", torch.float32)[0]
    out = torch.full_like(q, math.nan)
    k_before = k_cache.clone()
    versions = k_cache._version, v_cache._version, out._version
    got, lse = ops.decode(q, k_cache, v_cache, out=out, return_lse=True, **kwargs)
    assert got is out and not torch.isnan(out).any()
    # The mutated tensors' version counters move (autograd then refuses a stale saved tensor).
    assert all(after > before for before, after in zip(versions, (k_cache._version, v_cache._version,
                                                                    out._version)))
    want, want_lse, k_after, _ = reference.decode(_np(q), _np(k_before), _np(v_cache), return_cache=True,
                                                  **_host({n: v for n, v in kwargs.items() if n != "num_splits"}))
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k_cache.double().numpy(), k_after, rtol=0, atol=0)


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_caches_through_the_ops_with_host_kernels(host_kernels, per_head):
    # torch.float8_e4m3fn caches reach the kernels as their uint8 bytes with kv_dtype, the appended rows
    # quantised into the caller's tensors; the scales as floats or float32 tensors.
    (q, k_cache, v_cache), kwargs = _fp8_decode_case("cpu", torch.float16, per_head)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = ops.decode(q, k_cache, v_cache, return_lse=True, **kwargs)
    scales = {n: (np.float32(v) if isinstance(v, float) else _np(v)) for n, v in kwargs.items() if n.endswith("scale")}
    want, want_lse, k_after, v_after = reference.decode(
        _np(q), k_before.view(torch.uint8).numpy(), v_before.view(torch.uint8).numpy(), return_cache=True,
        kv_dtype="float8_e4m3fn", cache_seqlens=_np(kwargs["cache_seqlens"]), k_new=_np(kwargs["k_new"]),
        v_new=_np(kwargs["v_new"]), **scales)
    assert k_cache.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(k_cache.view(torch.uint8).numpy(), k_after)
    np.testing.assert_array_equal(v_cache.view(torch.uint8).numpy(), v_after)
    np.testing.assert_allclose(out.double().numpy(), want, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(lse.double().numpy(), want_lse, rtol=1e-5, atol=1e-5)


def test_fp8_cache_arguments_are_checked_in_the_adapter():
    k = torch.zeros(1, 8, 2, 16, dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"k_cache is a uint8 tensor.*float8_e4m3fn"):
        _torch_ops.decode_cache_arguments(k, k.clone(), 1.0, 1.0)
    k8 = k.view(torch.float8_e4m3fn)
    kc, vc, options = _torch_ops.decode_cache_arguments(k8, k8.clone(), torch.tensor(0.5), torch.tensor([0.25]))
    assert kc.dtype == torch.uint8 and kc.data_ptr() == k8.data_ptr()
    assert options == {"kv_dtype": "float8_e4m3fn", "k_scale": 0.5, "v_scale": 0.25}
    with pytest.raises(TypeError, match="scale must be a float or a torch.Tensor"):
        ops.decode(torch.zeros(1, 1, 2, 16), k8, k8.clone(), k_scale="1", v_scale=1.0)
    _torch_ops._check_scale_shape(torch.ones(2), "k_scale", k8)   # the fakes' check: one, or one per kv head
    with pytest.raises(ValueError, match=r"k_scale must be a scalar or have shape \(2,\)"):
        _torch_ops._check_scale_shape(torch.ones(3), "k_scale", k8)


# ----------------------------------------------------------------------------- on the GPU

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_opcheck_every_op(dtype):
    _opcheck_all("cuda", dtype)


@_gpu
def test_ops_equal_the_direct_path():
    """Same kernels, same arguments: the op's outputs and gradients equal cuflash's and the direct
    autograd path's bit for bit (deterministic backward), dropout state included."""
    B, Sq, Sk, Hq, Hk, D = 2, 100, 130, 8, 2, 64
    q, k, v = (_rand(*s, dtype=torch.bfloat16, device="cuda") for s in ((B, Sq, Hq, D), (B, Sk, Hk, D), (B, Sk, Hk, D)))
    bias = _rand(1, Hq, Sq, Sk, device="cuda")
    options = dict(causal=True, softcap=20.0, window=(50, -1), dropout_p=0.2)
    state = _state()
    out, lse, rng = ops.attention_forward(q, k, v, bias=bias, rng_state=state, **options)
    out_cf, lse_cf, rng_cf = cuflash.attention_forward(q, k, v, bias=bias, generator=_generator_of(state), **options)
    assert torch.equal(out, torch.from_dlpack(out_cf)) and torch.equal(lse, torch.from_dlpack(lse_cf))
    assert np.array_equal(rng.numpy().view(np.uint64), rng_cf)

    dout = torch.randn_like(out)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, bias)]
    ops.attention(*leaves[:3], bias=leaves[3], rng_state=state, deterministic=True, **options).backward(dout)
    direct = [x.clone().requires_grad_(True) for x in (q, k, v, bias)]
    ct.attention(*direct[:3], bias=direct[3], generator=_generator_of(state), deterministic=True,
                 **options).backward(dout)
    for a, b in zip(leaves, direct):
        assert torch.equal(a.grad, b.grad)


@_gpu
def test_ops_take_the_eager_route_on_cuda_tensors():
    """Eagerly on plain CUDA tensors ops.attention runs cuflash.interop.torch's route (its autograd node,
    not the op's) and equals the op bit for bit, outputs and gradients, dropout included; under a
    dispatch mode the op is called."""
    B, Sq, Sk, Hq, Hk, D = 2, 90, 120, 8, 2, 64
    q, k, v = (_rand(*s, dtype=torch.bfloat16, device="cuda") for s in ((B, Sq, Hq, D), (B, Sk, Hk, D), (B, Sk, Hk, D)))
    options = dict(causal=True, softcap=20.0, window=(40, -1), dropout_p=0.2, deterministic=True)
    state, dout = _state(), _rand(B, Sq, Hq, D, dtype=torch.bfloat16, device="cuda")
    leaves = [[x.clone().requires_grad_(True) for x in (q, k, v)] for _ in range(2)]
    routed = ops.attention(*leaves[0], generator=_generator_of(state), **options)
    through_op = ops.attention(*leaves[1], rng_state=state, **options)   # rng_state: the op itself
    assert type(routed.grad_fn).__name__ == "_AttentionBackward"
    assert type(through_op.grad_fn).__name__ == "_AttentionForwardBackward"
    assert torch.equal(routed, through_op)
    routed.backward(dout)
    through_op.backward(dout)
    for a, b in zip(*leaves):
        assert torch.equal(a.grad, b.grad)

    with _SeenOps() as seen:
        moded = ops.attention(q, k, v, causal=True)
    assert any("cuflash.attention_forward" in name for name in seen.ops), seen.ops
    assert torch.equal(moded, ops.attention(q, k, v, causal=True))


@_gpu
@pytest.mark.parametrize("with_out", [False, True])
def test_ops_decode_takes_the_eager_route_and_moves_versions(with_out):
    """Eagerly on plain CUDA tensors ops.decode (cuflash.interop.torch.decode's route) equals the op
    called through the dispatcher, caches included, and moves the version counters of the caches it
    appends to and of ``out``."""
    for (q, k_cache, v_cache), kwargs in _decode_cases("cuda", torch.float16):
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
        out = torch.full_like(q, math.nan) if with_out else None
        versions = [x._version for x in caches[0]] + ([out._version] if with_out else [])
        got, lse = ops.decode(q, *caches[0], out=out, return_lse=True, **kwargs)
        if with_out:
            assert got is out
        after = [x._version for x in caches[0]] + ([out._version] if with_out else [])
        assert all(b > a for a, b in zip(versions, after))
        want, want_lse = torch.ops.cuflash.decode(q, *caches[1], **kwargs)
        assert torch.equal(got, want) and torch.equal(lse, want_lse)
        for a, b in zip(*caches):
            assert torch.equal(a, b)


def _generator_of(state):
    generator = cuflash.Generator(0)
    generator.set_state(state.numpy().view(np.uint64))
    return generator


@_gpu
@pytest.mark.parametrize("attn_dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
def test_compiled_block_matches_eager(attn_dtype):
    """torch.compile(fullgraph=True) with inductor: one graph, no break; forward and gradients equal
    eager (the attention is the same kernel; inductor's own fusions differ by rounding)."""
    _check_compiled_block("cuda", "inductor", dtype=torch.float32, attn_dtype=attn_dtype, seq=200, dim=256, heads=4,
                          kv_heads=2, rel=1e-4 if attn_dtype is None else 2e-2)


@_gpu
def test_compiled_block_trains_like_eager():
    torch.manual_seed(int(np.random.default_rng().integers(2**31)))
    eager = Block(128, 4, 1, attn_dtype=torch.bfloat16).cuda()
    compiled_model = Block(128, 4, 1, attn_dtype=torch.bfloat16).cuda()
    compiled_model.load_state_dict(eager.state_dict())
    compiled, graphs = _compile_counted(compiled_model, "inductor")
    x = _rand(4, 96, 128, device="cuda")
    # Reachable by the block: causal running means of x.
    target = 2 * x.cumsum(1) / torch.arange(1, 97, device="cuda").view(1, -1, 1)
    losses = {}
    for name, model, fn in (("eager", eager, eager), ("compiled", compiled_model, compiled)):
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses[name] = []
        for _ in range(30):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(fn(x), target)
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    _assert_one_graph(graphs)
    for name in losses:
        assert losses[name][-1] < 0.3 * losses[name][0], (name, losses[name])
    np.testing.assert_allclose(losses["compiled"][:10], losses["eager"][:10], rtol=2e-2)


def _decode_reference(q, k_cache, v_cache, lens, table, k_new, v_new):
    out, lse = reference.decode(q.float().cpu().numpy(), k_cache.float().cpu().numpy(), v_cache.float().cpu().numpy(),
                                cache_seqlens=lens.cpu().numpy(), block_table=None if table is None else table.cpu().numpy(),
                                k_new=k_new.float().cpu().numpy(), v_new=v_new.float().cpu().numpy())
    return out, lse


@_gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("with_out", [False, True], ids=["new_out", "out"])
def test_decode_replays_in_a_torch_cuda_graph(paged, num_splits, with_out):
    """Capture decode (with its append) once; each replay reads the new q / k_new / v_new /
    cache_seqlens copied into the captured tensors and equals an eager call on a copy of the caches."""
    B, Sq, Hq, Hk, D, dtype = 3, 2, 8, 2, 64, torch.bfloat16
    if paged:
        page_size, max_pages = 16, 40
        pages = B * max_pages + 3
        table = torch.randperm(pages, device="cuda")[:B * max_pages].reshape(B, max_pages).to(torch.int32)
        k_cache, v_cache = (_rand(pages, page_size, Hk, D, dtype=dtype, device="cuda") for _ in range(2))
        capacity = max_pages * page_size
    else:
        table, capacity = None, 640
        k_cache, v_cache = (_rand(B, capacity, Hk, D, dtype=dtype, device="cuda") for _ in range(2))
    static = dict(q=_rand(B, Sq, Hq, D, dtype=dtype, device="cuda"), k_new=_rand(B, Sq, Hk, D, dtype=dtype, device="cuda"),
                  v_new=_rand(B, Sq, Hk, D, dtype=dtype, device="cuda"),
                  lens=torch.randint(0, capacity - Sq + 1, (B,), dtype=torch.int32, device="cuda"))
    static_out = torch.full((B, Sq, Hq, D), math.nan, dtype=dtype, device="cuda") if with_out else None

    def step(q, k_cache, v_cache, lens, k_new, v_new):
        return ops.decode(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, k_new=k_new, v_new=v_new,
                          num_splits=num_splits, return_lse=True, out=static_out if q is static["q"] else None)

    args = lambda d, kc, vc: (d["q"], kc, vc, d["lens"], d["k_new"], d["v_new"])  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # plans the call and compiles its kernel before the capture
        step(*args(static, k_cache, v_cache))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = step(*args(static, k_cache, v_cache))
    if with_out:
        assert out_g is static_out

    for replay in range(3):
        fresh = dict(q=_rand(B, Sq, Hq, D, dtype=dtype, device="cuda"),
                     k_new=_rand(B, Sq, Hk, D, dtype=dtype, device="cuda"),
                     v_new=_rand(B, Sq, Hk, D, dtype=dtype, device="cuda"),
                     lens=torch.randint(0, capacity - Sq + 1, (B,), dtype=torch.int32, device="cuda"))
        for name, value in fresh.items():
            static[name].copy_(value)
        k_eager, v_eager = k_cache.clone(), v_cache.clone()
        k_before, v_before = k_cache.clone(), v_cache.clone()
        out_e, lse_e = step(*args(fresh, k_eager, v_eager))
        out_g.fill_(math.nan)
        lse_g.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_g, out_e), f"replay {replay}: out differs from the eager call"
        assert torch.equal(lse_g, lse_e), f"replay {replay}: lse differs from the eager call"
        assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager), f"replay {replay}: appends differ"
        if replay == 0:
            want, want_lse = _decode_reference(fresh["q"], k_before, v_before, fresh["lens"], table, fresh["k_new"],
                                               fresh["v_new"])
            got = out_g.float().cpu().numpy()
            assert np.abs(got - want).max() < 3e-2, np.abs(got - want).max()
            assert np.abs(lse_g.cpu().numpy() - want_lse).max() < 1e-2
