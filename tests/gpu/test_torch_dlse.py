"""cuflash.interop.torch with a loss that reads lse: ``ct.attention(..., return_lse=True)``,
``ct.ops.attention`` and ``ct.ops.attention_varlen`` give lse a gradient (the backward's dlse), and
``ct.merge_states`` is differentiable, so attention over two halves of the keys merged trains as one
call, eagerly and under ``torch.compile(fullgraph=True)``. float32 inputs: within 1e-4 relative (Frobenius) of the
float64 reference or of the single call. Needs torch with CUDA (skipped otherwise).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - depends on the machine
    pytest.skip("torch has no CUDA device", allow_module_level=True)

import cuflash.interop.torch as ct  # noqa: E402
from cuflash import reference  # noqa: E402

pytestmark = pytest.mark.gpu


def _randn(*shape, seed, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=torch.float32, generator=g).requires_grad_(requires_grad)


def _relative(got, want):
    got, want = (np.asarray(x.detach().cpu(), np.float64) if isinstance(x, torch.Tensor) else x for x in (got, want))
    assert np.isfinite(got).all(), "not finite"
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.parametrize("attend", [ct.attention, ct.ops.attention], ids=["ct.attention", "ct.ops.attention"])
def test_a_loss_that_reads_lse_gets_its_gradient(attend):
    q, k, v = (_randn(2, n, h, 64, seed=s, requires_grad=True) for n, h, s in ((90, 4, 1), (70, 2, 2), (70, 2, 3)))
    dout, dlse = _randn(2, 90, 4, 64, seed=4), _randn(2, 4, 90, seed=5)
    out, lse = attend(q, k, v, causal=True, return_lse=True)   # 20 rows see no key (lse -inf)
    with torch.no_grad():   # the same out and lse without autograd
        out_ng, lse_ng = attend(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, out_ng) and torch.equal(lse, lse_ng)
    with pytest.raises(TypeError, match="return_lse"):
        attend(q, k, v, return_lse="yes")
    (out * dout).sum().add(torch.where(torch.isfinite(lse), lse, 0.0).mul(dlse).sum()).backward()
    ref = reference.attention_backward(*(x.detach().cpu().numpy() for x in (dout, q, k, v)), causal=True,
                                       dlse=dlse.cpu().numpy())
    for name, x, r in zip(("dq", "dk", "dv"), (q, k, v), ref):
        assert _relative(x.grad, r) < 1e-4, name

    cu = torch.tensor([0, 37, 120, 200], device="cuda", dtype=torch.int32)
    qv, kv, vv = (_randn(200, h, 64, seed=s, requires_grad=True) for h, s in ((4, 6), (2, 7), (2, 8)))
    dout_v, dlse_v = _randn(200, 4, 64, seed=9), _randn(4, 200, seed=10)
    out, lse = ct.ops.attention_varlen(qv, kv, vv, cu, cu, max_seqlen_q=83, max_seqlen_k=83, causal=True,
                                       return_lse=True)
    ((out * dout_v).sum() + (lse * dlse_v).sum()).backward()
    ref = reference.attention_varlen_backward(*(x.detach().cpu().numpy() for x in (dout_v, qv, kv, vv)),
                                              cu.cpu().numpy(), cu.cpu().numpy(), causal=True,
                                              dlse=dlse_v.cpu().numpy())
    for name, x, r in zip(("dq", "dk", "dv"), (qv, kv, vv), ref):
        assert _relative(x.grad, r) < 1e-4, name


def _merged(q, k, v, dout):
    o1, l1 = ct.attention(q, k[:, :40], v[:, :40], return_lse=True)
    o2, l2 = ct.ops.attention(q, k[:, 40:], v[:, 40:], return_lse=True)
    out, _ = ct.merge_states([o1, o2], [l1, l2])
    return (out * dout).sum()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_merged_partial_results_train_as_one_call(compiled):
    inputs = [_randn(2, n, h, 64, seed=s) for n, h, s in ((64, 4, 11), (100, 2, 12), (100, 2, 13))]
    dout = _randn(2, 64, 4, 64, seed=14)
    merged = torch.compile(_merged, fullgraph=True) if compiled else _merged
    q, k, v = (x.clone().requires_grad_(True) for x in inputs)
    merged(q, k, v, dout).backward()
    q1, k1, v1 = (x.clone().requires_grad_(True) for x in inputs)
    (ct.attention(q1, k1, v1) * dout).sum().backward()
    for name, a, b in zip(("dq", "dk", "dv"), (q, k, v), (q1, k1, v1)):
        assert _relative(a.grad, b.grad.double().cpu().numpy()) < 1e-4, name
