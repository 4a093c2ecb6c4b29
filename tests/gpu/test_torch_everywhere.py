"""One ``cuflash.interop.torch`` that works everywhere a torch user writes attention.

- ``torch.cuda.graph`` after a warm-up on another stream (torch's documented pattern), with and
  without ``stream=``; forward and forward+backward captured; two graphs on one stream; replays
  with new inputs equal uncaptured calls bit for bit (backward with deterministic=True);
- dropout under ``torch.cuda.graph``: each replay draws a fresh mask, the one the generator's graph
  state held before the replay (checked against an eager call given that state);
- ``torch.compile(fullgraph=True)`` and ``mode="reduce-overhead"`` of a block that calls
  ``ct.attention``: no graph break, forward and gradients equal eager's;
- ``torch.utils.checkpoint`` and ``torch.autograd.grad``;
- ``ct.decode`` and ``ct.merge_states``: eager equals cuflash on the same data, captured replays
  equal eager, compiled equals eager.
Needs torch with CUDA (skipped otherwise).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - depends on the machine
    pytest.skip("torch has no CUDA device", allow_module_level=True)

import cuflash  # noqa: E402
import cuflash.interop.torch as ct  # noqa: E402

pytestmark = pytest.mark.gpu


def _randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


def _fill_(*tensors):
    """New random data into the same tensors (what a replay reads)."""
    for t in tensors:
        t.copy_(torch.randn(t.shape, device="cuda", dtype=torch.float32).to(t.dtype))


def _poison_(*tensors):
    for t in tensors:
        t.fill_(float("nan"))


def _same(a, b) -> bool:
    """Equal bit for bit (NaN poison left in place never passes)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.contiguous().view(torch.uint8),
                                                                          b.contiguous().view(torch.uint8)))


def _warm_up_elsewhere(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@pytest.mark.parametrize("explicit_stream", [False, True], ids=["default", "stream="])
def test_forward_and_backward_in_torch_cuda_graph(explicit_stream):
    shape = (2, int(np.random.default_rng().integers(100, 300)), 8, 64)
    q, k, v, dout = (_randn(*shape) for _ in range(4))
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    opts = dict(causal=True, deterministic=True)

    def step():
        out = ct.attention(q, k, v, **opts)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    _warm_up_elsewhere(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream() if explicit_stream else None):
        static = step()
    for _ in range(2):
        with torch.no_grad():
            _fill_(q, k, v, dout)
        _poison_(*static)
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        for name, got, w in zip(("out", "dq", "dk", "dv"), static, want):
            assert _same(got, w), f"{name} of the replay differs from an eager call"


def test_several_graphs_on_one_stream_and_decode_merge():
    b, hq, hk, d, length = 3, 16, 4, 128, 512
    k_cache, v_cache = (_randn(b, length, hk, d) for _ in range(2))
    lens = torch.randint(1, length - 4, (b,), device="cuda", dtype=torch.int32)
    q = _randn(b, 1, hq, d)
    q2, k2, v2 = _randn(b, 1, hq, d), _randn(b, 64, hk, d), _randn(b, 64, hk, d)

    def decode():
        return ct.decode(q, k_cache, v_cache, cache_seqlens=lens, return_lse=True)

    def merged():
        o1, l1 = ct.decode(q2, k_cache, v_cache, cache_seqlens=lens, return_lse=True)
        o2, l2 = ct.decode(q2, k2, v2, causal=False, return_lse=True)
        return ct.merge_states(torch.stack([o1, o2]), torch.stack([l1, l2]))

    _warm_up_elsewhere(decode)
    _warm_up_elsewhere(merged)
    stream = torch.cuda.Stream()
    graphs, statics = [torch.cuda.CUDAGraph() for _ in range(2)], []
    for graph, fn in zip(graphs, (decode, merged)):
        with torch.cuda.graph(graph, stream=stream):
            statics.append(fn())
    for _ in range(2):
        _fill_(q, q2, k2, v2, k_cache, v_cache)
        lens.copy_(torch.randint(1, length - 4, (b,), device="cuda", dtype=torch.int32))
        for static in statics:
            _poison_(*static)
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        for static, fn in zip(statics, (decode, merged)):
            for got, want in zip(static, fn()):
                assert _same(got, want), "a replayed decode/merge differs from an eager call"
    # Eager ct.decode equals cuflash.decode on the same tensors.
    out = ct.decode(q, k_cache, v_cache, cache_seqlens=lens)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert _same(out, torch.from_dlpack(cuflash.decode(q, k_cache, v_cache, cache_seqlens=lens)))


def test_dropout_in_torch_cuda_graph_draws_a_fresh_mask_per_replay():
    shape = (1, 200, 4, 64)
    q, k, v = (_randn(*shape, dtype=torch.float16) for _ in range(3))
    generator = cuflash.Generator(int(np.random.default_rng().integers(2**62)))
    opts = dict(dropout_p=0.3)
    _warm_up_elsewhere(lambda: ct.attention(q, k, v, generator=generator, **opts))
    assert generator._graph_state(torch.cuda.current_device()) is None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = ct.attention(q, k, v, generator=generator, **opts)
    words = generator._graph_state(torch.cuda.current_device())
    assert words is not None, "the capture made no graph state"
    outs = []
    for _ in range(3):
        state = words.get()   # what this replay draws
        _poison_(static)
        graph.replay()
        torch.cuda.synchronize()
        replay_gen = cuflash.Generator(0)
        replay_gen.set_state(state)
        assert _same(static, ct.attention(q, k, v, generator=replay_gen, **opts))
        outs.append(static.clone())
    assert not _same(outs[0], outs[1]) and not _same(outs[1], outs[2]), "two replays drew one mask"


class _Block(torch.nn.Module):
    def __init__(self, width=256, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width, dtype=torch.bfloat16, device="cuda")
        self.proj = torch.nn.Linear(width, width, dtype=torch.bfloat16, device="cuda")

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).unbind(2)
        return x + self.proj(ct.attention(q, k, v, causal=True, deterministic=True).reshape(b, s, w))


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_compile_fullgraph_matches_eager(mode):
    torch._dynamo.reset()
    block = _Block()
    x = _randn(2, 256, 256).requires_grad_(True)
    compiled = torch.compile(block, fullgraph=True, mode=mode)
    for _ in range(3):   # reduce-overhead records its graph after warm-up runs
        with torch.no_grad():
            _fill_(x)
        eager_out = block(x)
        eager_grads = torch.autograd.grad(eager_out.float().square().sum(), (x, *block.parameters()))
        out = compiled(x)
        grads = torch.autograd.grad(out.float().square().sum(), (x, *block.parameters()))
        torch.testing.assert_close(out, eager_out, rtol=2e-2, atol=2e-2)
        for g, e in zip(grads, eager_grads):
            torch.testing.assert_close(g, e, rtol=5e-2, atol=5e-2)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_compiled_decode_and_varlen_match_eager():
    torch._dynamo.reset()
    cu = torch.tensor([0, 37, 100, 228], device="cuda", dtype=torch.int32)
    q, k, v = (_randn(228, 4, 64) for _ in range(3))

    def varlen(q, k, v):
        return ct.attention_varlen(q, k, v, cu, cu, max_seqlen_q=128, max_seqlen_k=128, causal=True)

    assert _same(torch.compile(varlen, fullgraph=True)(q, k, v), varlen(q, k, v))
    k_cache, v_cache = (_randn(2, 256, 2, 64) for _ in range(2))
    lens = torch.tensor([100, 255], device="cuda", dtype=torch.int32)
    qd = _randn(2, 1, 8, 64)

    def decode(qd):
        return ct.decode(qd, k_cache, v_cache, cache_seqlens=lens)

    assert _same(torch.compile(decode, fullgraph=True)(qd), decode(qd))


def test_checkpoint_and_autograd_grad():
    q, k, v = (_randn(2, 300, 8, 64).requires_grad_(True) for _ in range(3))
    dout = _randn(2, 300, 8, 64)

    def fn(q, k, v):
        return ct.attention(q, k, v, causal=True, deterministic=True)

    want = torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
    out = torch.utils.checkpoint.checkpoint(fn, q, k, v, use_reentrant=False)
    got = torch.autograd.grad(out, (q, k, v), dout)
    for g, w in zip(got, want):
        assert _same(g, w)
