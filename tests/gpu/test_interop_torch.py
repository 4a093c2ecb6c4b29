"""cuflash.interop.torch: autograd over cuflash against torch's own attention, and a training step.

Gradients are compared with torch's math SDPA backend run in float64 on the same (upcast) inputs.
The accuracy rule is docs/design.md §5's: float32 within a relative Frobenius error of 1e-4; float16
/ bfloat16 at most twice the error of a plain same-dtype attention (matmul, softmax, matmul as
torch ops in that dtype, differentiated by autograd; torch's math SDPA itself computes half
inputs in float32, so it is not that yardstick) plus a quarter-ulp relative slack. Causal
comparisons use Sq == Sk, where torch's top-left causal mask equals cuflash's bottom-right one.
Needs torch with CUDA (skipped otherwise).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - depends on the machine
    pytest.skip("torch has no CUDA device", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import cuflash  # noqa: E402
import cuflash.interop.torch as ct  # noqa: E402
from cuflash.reference import attention_backward as reference_backward  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
QUARTER_ULP = {"float16": 2e-4, "bfloat16": 1e-3, "float32": 0.0}


def _inputs(B, Sq, Sk, Hq, Hk, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float32, generator=g).to(dtype)  # noqa: E731
    return make(B, Sq, Hq, D), make(B, Sk, Hk, D), make(B, Sk, Hk, D), make(B, Sq, Hq, D)


def _sdpa(q, k, v, *, causal=False, scale=None, bias=None):
    """torch math SDPA on (B, S, H, D) tensors, GQA by repeating kv heads (h uses h // group)."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=bias, is_causal=causal, scale=scale)
    return out.transpose(1, 2)


def _naive(q, k, v, *, causal=False, scale=None, bias=None):
    """The plain same-dtype attention of the accuracy rule: matmul, softmax, matmul as torch ops in
    the inputs' dtype (each op rounds its result to it), differentiated by autograd."""
    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.repeat_interleave(group, dim=2).transpose(1, 2)
    vt = v.repeat_interleave(group, dim=2).transpose(1, 2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(s.dtype)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.matmul(s.softmax(dim=-1), vt).transpose(1, 2)


def _grads(fn, tensors, dout):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return out.detach(), grads


def _assert_close(got, ref64, base, dtype, name):
    got, ref64 = got.double(), ref64.double()
    err = (got - ref64).abs().max().item()
    if dtype == "float32":
        rel = ((got - ref64).norm() / ref64.norm().clamp_min(1e-300)).item()
        assert rel <= 1e-4, f"{name}: relative error {rel:.2e} > 1e-4"
        return
    base_err = (base.double() - ref64).abs().max().item()
    allowed = 2 * base_err + QUARTER_ULP[dtype] * ref64.abs().max().item()
    assert err <= allowed, f"{name} ({dtype}): max error {err:.3e} > 2 * {base_err:.3e} + slack = {allowed:.3e}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_gradients_match_torch_math_sdpa_in_float64(dtype, causal, heads):
    q, k, v, dout = _inputs(2, 193, 193, heads[0], heads[1], 64, DTYPES[dtype], 1)
    out, grads = _grads(lambda a, b, c: ct.attention(a, b, c, causal=causal), (q, k, v), dout)
    ref_out, ref = _grads(lambda a, b, c: _sdpa(a, b, c, causal=causal), [x.double() for x in (q, k, v)], dout)
    base_out, base = _grads(lambda a, b, c: _naive(a, b, c, causal=causal), (q, k, v), dout)
    _assert_close(out, ref_out, base_out, dtype, "out")
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref, base):
        assert g.dtype == DTYPES[dtype] and g.shape == r.shape
        _assert_close(g, r, b, dtype, name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bias_gradient_matches_torch(dtype):
    q, k, v, dout = _inputs(2, 64, 80, 4, 4, 64, DTYPES[dtype], 2)
    bias = torch.randn(1, 4, 64, 80, device="cuda", dtype=torch.float32)
    fn = lambda a, b, c, d: ct.attention(a, b, c, bias=d, scale=0.2)  # noqa: E731
    out, grads = _grads(fn, (q, k, v, bias), dout)
    ref_out, ref = _grads(lambda a, b, c, d: _sdpa(a, b, c, bias=d, scale=0.2),
                          [x.double() for x in (q, k, v, bias)], dout)
    base_out, base = _grads(lambda a, b, c, d: _naive(a, b, c, bias=d.to(a.dtype), scale=0.2), (q, k, v, bias), dout)
    for name, g, r, b in zip(("dq", "dk", "dv", "dbias"), grads, ref, base):
        assert g.shape == r.shape
        _assert_close(g, r, b, dtype, name)
    assert grads[3].dtype == torch.float32


def test_dropout_gradients_match_the_reference():
    q, k, v, dout = _inputs(1, 70, 90, 4, 2, 64, torch.bfloat16, 3)
    g = cuflash.Generator(1234)
    state = g.get_state()
    out, grads = _grads(lambda a, b, c: ct.attention(a, b, c, dropout_p=0.3, generator=g, causal=True),
                        (q, k, v), dout)
    assert g.offset == int(state[1]) + 1
    ref = reference_backward(dout.float().cpu().numpy(), *(x.float().cpu().numpy() for x in (q, k, v)),
                             dropout_p=0.3, rng_state=state, causal=True)
    for name, got, r in zip(("dq", "dk", "dv"), grads, ref):
        got = got.double().cpu().numpy()
        rel = np.linalg.norm(got - r) / np.linalg.norm(r)
        assert rel < 2e-2, f"{name}: relative error {rel:.2e} (bf16 inputs)"


def test_deterministic_and_streams():
    q, k, v, dout = _inputs(2, 300, 300, 8, 2, 64, torch.bfloat16, 4)
    fn = lambda a, b, c: ct.attention(a, b, c, causal=True, deterministic=True)  # noqa: E731
    _, first = _grads(fn, (q, k, v), dout)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _, second = _grads(fn, (q, k, v), dout)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_repeat_steps_replay_with_torch_memory_and_no_torch_call(monkeypatch):
    """A repeat autograd step without modifiers replays its remembered plans (_torch_stream.replay):
    no torch_call is made, what the replay allocates (this backward's 4 MiB dq accumulator, past the
    stream's 2 MiB arena) comes from torch, and the gradients equal the planning step's bit for bit.
    On a torch stream that is not CuPy's current one the step goes through torch_call again."""
    import cuflash.interop._torch_stream as ts

    q, k, v, dout = _inputs(1, 1024, 1024, 8, 8, 128, torch.bfloat16, 12)
    fn = lambda a, b, c: ct.attention(a, b, c, causal=True, deterministic=True)  # noqa: E731
    _, planned = _grads(fn, (q, k, v), dout)
    contexts, allocations = [], []
    torch_call, allocator = ct._torch_call, ts._allocator
    monkeypatch.setattr(ct, "_torch_call", lambda device: contexts.append(device) or torch_call(device))
    monkeypatch.setattr(ts, "_allocator", lambda index: lambda n: allocations.append(n) or allocator(index)(n))
    _, replayed = _grads(fn, (q, k, v), dout)
    assert contexts == [] and allocations, (contexts, allocations)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _, elsewhere = _grads(fn, (q, k, v), dout)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert len(contexts) == 2   # the forward and the backward
    for a, b, c in zip(planned, replayed, elsewhere):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_repeat_decode_calls_replay_with_no_torch_call(monkeypatch):
    """ct.decode's repeat call replays its plan without a torch_call, and writes what the planning call
    wrote; on a torch stream that is not CuPy's current one it goes through torch_call again."""
    g = torch.Generator(device="cuda").manual_seed(13)
    q = torch.randn(4, 1, 16, 128, device="cuda", generator=g).to(torch.bfloat16)
    k_cache, v_cache = (torch.randn(4, 600, 4, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    lens = torch.tensor([600, 1, 333, 450], dtype=torch.int32, device="cuda")
    call = lambda: ct.decode(q, k_cache, v_cache, cache_seqlens=lens, return_lse=True)  # noqa: E731
    planned = call()
    contexts = []
    torch_call = ct._torch_call
    monkeypatch.setattr(ct, "_torch_call", lambda device: contexts.append(device) or torch_call(device))
    replayed = call()
    assert contexts == []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        elsewhere = call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert len(contexts) == 1
    for a, b, c in zip(planned, replayed, elsewhere):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_non_contiguous_inputs_and_broadcast_grad():
    q, k, v, _ = _inputs(2, 100, 120, 4, 2, 64, torch.float32, 5)
    # BHSD storage passed as BSHD views; loss = out.sum() hands backward a zero-stride gradient.
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    leaves = [x.detach().clone().requires_grad_(True) for x in (qt, kt, vt)]
    ct.attention(*leaves, causal=True).sum().backward()
    ref_leaves = [x.double().detach().requires_grad_(True) for x in (q, k, v)]
    group = 2
    with sdpa_kernel(SDPBackend.MATH):
        scores = torch.einsum("bihd,bjhd->bhij", ref_leaves[0], ref_leaves[1].repeat_interleave(group, 2)) / 8.0
        mask = torch.ones(100, 120, dtype=torch.bool, device="cuda").tril(diagonal=20)   # bottom-right causal
        p = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        torch.einsum("bhij,bjhd->bihd", p, ref_leaves[2].repeat_interleave(group, 2)).sum().backward()
    for got, ref in zip(leaves, ref_leaves):
        _assert_close(got.grad, ref.grad, None, "float32", "grad")


def test_varlen_matches_per_sequence_calls():
    cu = torch.tensor([0, 50, 50, 177], dtype=torch.int32, device="cuda")
    q, k, v, dout = _inputs(1, 177, 177, 4, 2, 64, torch.float32, 6)
    q, k, v, dout = q[0], k[0], v[0], dout[0]
    _, grads = _grads(lambda a, b, c: ct.attention_varlen(a, b, c, cu, cu, causal=True), (q, k, v), dout)
    for lo, hi in ((0, 50), (50, 177)):
        _, one = _grads(lambda a, b, c: ct.attention(a[None], b[None], c[None], causal=True)[0],
                        (q[lo:hi], k[lo:hi], v[lo:hi]), dout[lo:hi])
        for g, o in zip(grads, one):
            _assert_close(g[lo:hi], o, None, "float32", "varlen grad")


def test_a_tiny_training_step_reduces_the_loss():
    torch.manual_seed(0)
    cuflash.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self, dim=128, heads=4):
            super().__init__()
            self.heads = heads
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.proj = torch.nn.Linear(dim, dim)

        def forward(self, x):
            B, S, C = x.shape
            q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads).unbind(2)
            out = ct.attention(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), causal=True,
                               dropout_p=0.1)
            return self.proj(out.float().reshape(B, S, C))

    model = Block().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(4, 96, 128, device="cuda")
    # Reachable by the block: uniform causal attention over v = x, scaled by the projections.
    target = 2 * x.cumsum(1) / torch.arange(1, 97, device="cuda").view(1, -1, 1)
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        for p in model.parameters():
            assert torch.isfinite(p.grad).all()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_rejects_cpu_tensors():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="CUDA"):
        ct.attention(q, q, q)


@pytest.mark.parametrize("paged", [False, True])
def test_chunked_prefill_over_a_cache_equals_cupy(paged):
    """ct.attention_varlen and ct.ops.attention_varlen over a KV cache (cache_seqlens, block_table):
    cuflash.attention_varlen's bits from CuPy (the same kernel); a call that needs a gradient is refused."""
    import cupy

    B, Hq, Hk, D, L, page = 3, 8, 2, 128, 512, 64
    g = torch.Generator(device="cuda").manual_seed(11 + paged)
    n = torch.tensor([37, 0, 150])
    lens = (n + torch.tensor([100, 5, 300])).to(torch.int32).cuda()
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)]).to(torch.int32).cuda()
    make = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    q = make(int(n.sum()), Hq, D)
    if paged:
        k_cache, v_cache = make(B * L // page, page, Hk, D), make(B * L // page, page, Hk, D)
        table = torch.randperm(B * L // page, device="cuda", generator=g).to(torch.int32).reshape(B, L // page)
    else:
        k_cache, v_cache, table = make(B, L, Hk, D), make(B, L, Hk, D), None
    kwargs = dict(max_seqlen_q=int(n.max()), causal=True, cache_seqlens=lens, block_table=table)
    as_cupy = lambda x: None if x is None else cupy.from_dlpack(x)  # noqa: E731
    want = cuflash.attention_varlen(as_cupy(q.view(torch.int16)).view(cuflash._checks.BFLOAT16),
                                    *(as_cupy(x.view(torch.int16)).view(cuflash._checks.BFLOAT16)
                                      for x in (k_cache, v_cache)),
                                    as_cupy(cu), None, **{**kwargs, "cache_seqlens": as_cupy(lens),
                                                          "block_table": as_cupy(table)})
    for fn in (ct.attention_varlen, ct.ops.attention_varlen):
        got = fn(q, k_cache, v_cache, cu, None, **kwargs)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(got.view(torch.int16).cpu().numpy(), want.view(cupy.int16).get())
        with pytest.raises(ValueError, match="no backward"):
            fn(q.clone().requires_grad_(True), k_cache, v_cache, cu, None, **kwargs)
