"""Ring attention on one GPU (cuflash.distributed) against one single-GPU call.

``ring_attention_virtual`` runs the ring driver of ``ring_attention`` for ``world`` ranks in one
process, joined by a LoopbackRing (device copies on each rank's communication stream, the compute on
CuPy's current stream, ordered by events, double-buffered): per step one attention call, merged
through the log-sum-exp. Its result must equal one :func:`cuflash.attention_forward` over the whole
sequence up to rounding, and ``ring_attention_backward_virtual`` one :func:`cuflash.attention_backward`.
The public ``ring_attention`` / ``ring_attention_backward`` run too, one thread per rank, each on a
compute stream of its own, over a threaded loopback ring (the test double of an NCCL ring).

Tolerances (the ring and the single call are both exact attention; they differ by rounding only):
- float32: relative Frobenius error 1e-5 for out, 1e-4 for the gradients (which are summed from
  up to 2 * world pair gradients in another order; test_backward_gpu.py holds the single call to
  1e-4 of the float64 reference too).
- float16/bfloat16: max|ring - single| <= 2e-2 * max|single| (the partial outputs and per-pair
  gradients are rounded to the dtype before they are merged/summed: a few ulps, 2^-8 for bf16).
- lse is float32 whatever the dtype: rtol 1e-5, atol 1e-4.
Inputs are fresh standard-normal values (cuflash.testing.random_qkv); problems are small
(B = 2, S <= 400), so the file runs in seconds once the kernels are compiled.
"""

import threading

import numpy as np
import pytest

import cuflash
import cuflash.testing as tt
from cuflash.distributed import _comm as ring_comm
from cuflash import distributed as cd

pytestmark = pytest.mark.gpu  # conftest.py skips it without a GPU, fails it on a broken setup

WORLDS = [1, 2, 4]
DTYPES = ["bfloat16", "float16", "float32"]
HEADS = [(4, 4), (8, 2)]  # (Hq, Hk): MHA and GQA


def _host(x):
    return np.asarray(x.get() if hasattr(x, "get") else x).astype(np.float64)


def _assert_close(got, want, dtype, name, f32_rtol):
    g, w = _host(got), _host(want)
    assert g.shape == w.shape, f"{name}: shape {g.shape} != {w.shape}"
    assert np.isfinite(g).all(), f"{name}: non-finite values"
    if dtype == "float32":
        err, norm = np.linalg.norm(g - w), np.linalg.norm(w)
        assert err <= f32_rtol * norm, f"{name}: relative error {err / norm:.3g} > {f32_rtol}"
    else:
        err, scale = np.abs(g - w).max(), np.abs(w).max()
        assert err <= 2e-2 * scale, f"{name}: max error {err:.3g} > 2e-2 * {scale:.3g}"


def _problem(cp, S, heads, dtype, seed):
    Hq, Hk = heads
    shape = dict(B=2, Sq=S, Sk=S, Hq=Hq, Hk=Hk, D=64)
    q, k, v = tt.random_qkv(shape, dtype, seed, xp=cp)
    dout, _, _ = tt.random_qkv(shape, dtype, seed + 1, xp=cp)
    return q, k, v, dout


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("S", [256, 8 * 25])  # chunks of 32/64/128 rows, and of 25..100 (tails)
def test_ring_forward_matches_single_call(xp_gpu, world, causal, dtype, heads, S):
    q, k, v, _ = _problem(xp_gpu, S, heads, dtype, seed=world + 10 * S)
    want_out, want_lse, _ = cuflash.attention_forward(q, k, v, causal=causal)
    out, lse = cd.ring_attention_virtual(q, k, v, world=world, causal=causal)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    _assert_close(out, want_out, dtype, "out", 1e-5)
    np.testing.assert_allclose(_host(lse), _host(want_lse), rtol=1e-5, atol=1e-4, err_msg="lse")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
def test_ring_backward_matches_single_call(xp_gpu, world, causal, dtype, heads):
    q, k, v, dout = _problem(xp_gpu, 256, heads, dtype, seed=100 + world)
    out, lse, _ = cuflash.attention_forward(q, k, v, causal=causal)
    want = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    got = cd.ring_attention_backward_virtual(dout, q, k, v, out, lse, world=world, causal=causal)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        _assert_close(g, w, dtype, name, 1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_ring_forward_backward_chain_with_scale(xp_gpu, causal):
    # the ring's own out/lse feed the ring backward; a non-default scale reaches every pair
    q, k, v, dout = _problem(xp_gpu, 400, (8, 2), "float32", seed=7)
    out, lse = cd.ring_attention_virtual(q, k, v, world=4, causal=causal, scale=0.3)
    want_out, want_lse, _ = cuflash.attention_forward(q, k, v, causal=causal, scale=0.3)
    _assert_close(out, want_out, "float32", "out", 1e-5)
    np.testing.assert_allclose(_host(lse), _host(want_lse), rtol=1e-5, atol=1e-4, err_msg="lse")
    got = cd.ring_attention_backward_virtual(dout, q, k, v, out, lse, world=4, causal=causal, scale=0.3)
    want = cuflash.attention_backward(dout, q, k, v, want_out, want_lse, causal=causal, scale=0.3)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _assert_close(g, w, "float32", name, 1e-4)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_ring_dropout_matches_single_call(xp_gpu, world, causal, dtype):
    # every chunk pair is its own call at its global origin: the single call's mask, one rng_state
    q, k, v, dout = _problem(xp_gpu, 256, (8, 2), dtype, seed=300 + world)
    state = cuflash.Generator(77).next_state()
    want_out, want_lse, rng_state = cuflash.attention_forward(q, k, v, causal=causal, dropout_p=0.1,
                                                              generator=cuflash.Generator(77))
    assert [int(x) for x in rng_state] == [int(x) for x in state]
    out, lse = cd.ring_attention_virtual(q, k, v, world=world, causal=causal, dropout_p=0.1, rng_state=state)
    _assert_close(out, want_out, dtype, "out", 1e-5)
    np.testing.assert_allclose(_host(lse), _host(want_lse), rtol=1e-5, atol=1e-4, err_msg="lse")
    want = cuflash.attention_backward(dout, q, k, v, want_out, want_lse, causal=causal, dropout_p=0.1,
                                      rng_state=state)
    got = cd.ring_attention_backward_virtual(dout, q, k, v, want_out, want_lse, world=world, causal=causal,
                                             dropout_p=0.1, rng_state=state)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _assert_close(g, w, dtype, name, 1e-4)


@pytest.mark.parametrize("dtype", ["float16", "float32"])   # fwd_sm90/sm80 and fwd_simt
def test_dropout_origin_draws_a_block_of_the_full_mask(xp_gpu, dtype):
    # attention_forward on q[:, r0:r1], k[:, c0:c1] at dropout origin (r0, c0) draws exactly that
    # block of the full call's mask: compare with the float64 reference of the block with it sliced
    from cuflash.random import dropout_keep

    q, k, v, _ = _problem(xp_gpu, 200, (4, 2), dtype, seed=5)
    r0, r1, c0, c1 = 37, 150, 44, 196
    state, p = (123, 9), 0.25
    qb, kb, vb = q[:, r0:r1], k[:, c0:c1], v[:, c0:c1]
    generator = cuflash.Generator(0)
    generator.set_state(state)
    from cuflash.attention import _forward_at
    out, lse, _ = _forward_at(qb, kb, vb, dropout_p=p, generator=generator, dropout_origin=(r0, c0))
    qh, kh, vh = (_host(x) for x in (qb, kb, vb))
    hq = qh.shape[2]
    s = np.einsum("bihd,bjhd->bhij", qh, np.repeat(kh, 2, axis=2)) / np.sqrt(qh.shape[3])
    prob = np.exp(s - s.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    keep = dropout_keep(state[0], state[1], p, np.arange(2).reshape(-1, 1, 1, 1), np.arange(hq).reshape(1, -1, 1, 1),
                        np.arange(200).reshape(1, 1, -1, 1), np.arange(200).reshape(1, 1, 1, -1), hq)
    block = keep[:, :, r0:r1, c0:c1]
    want = np.einsum("bhij,bjhd->bihd", np.where(block, prob / (1 - p), 0.0), np.repeat(vh, 2, axis=2))
    _assert_close(out, want, dtype, "out", 1e-5)
    unshifted = np.einsum("bhij,bjhd->bihd", np.where(keep[:, :, :r1 - r0, :c1 - c0], prob / (1 - p), 0.0),
                          np.repeat(vh, 2, axis=2))
    assert np.abs(_host(out) - unshifted).max() > 1e-3   # the origin moved the mask


def test_dropout_origin_column_must_be_a_multiple_of_4(xp_gpu):
    q, k, v, _ = _problem(xp_gpu, 64, (4, 4), "float16", seed=1)
    with pytest.raises(ValueError, match="multiple of 4"):
        from cuflash.attention import _forward_at
        _forward_at(q, k, v, dropout_p=0.1, dropout_origin=(3, 6))


def test_shard_unshard_on_gpu(xp_gpu):
    cp = xp_gpu
    q, _, _, _ = _problem(cp, 64, (2, 2), "bfloat16", seed=3)
    shards = cd.shard(q, 4)
    assert all(isinstance(s, cp.ndarray) and s.shape == (2, 16, 2, 64) for s in shards)
    back = cd.unshard(shards)
    np.testing.assert_array_equal(back.view(cp.uint16).get(), q.view(cp.uint16).get())


def test_virtual_forward_is_bitwise_repeatable_on_a_side_stream(xp_gpu):
    cp = xp_gpu
    q, k, v, _ = _problem(cp, 256, (8, 2), "bfloat16", seed=11)
    first, _ = cd.ring_attention_virtual(q, k, v, world=4, causal=True)
    with cp.cuda.Stream(non_blocking=True) as side:   # the compute stream is whatever is current
        again, _ = cd.ring_attention_virtual(q, k, v, world=4, causal=True)
    side.synchronize()
    np.testing.assert_array_equal(first.view(cp.uint16).get(), again.view(cp.uint16).get())
    want_out, _, _ = cuflash.attention_forward(q, k, v, causal=True)
    _assert_close(again, want_out, "bfloat16", "out", None)


class _ThreadedLoopback(ring_comm.LoopbackRing):
    """A LoopbackRing whose ranks run in threads of their own, as NCCL ranks run in processes: a
    post waits until every rank has posted (lockstep off), so the public API drives each rank."""

    def __init__(self, world, device):
        super().__init__(world, device)
        self._turn = threading.Condition()
        for rank in self.ranks:
            rank.lockstep = False

    def _post(self, rank, sends, recvs):
        with self._turn:
            done = self.exchanges
            super()._post(rank, sends, recvs)
            self._turn.notify_all()
            if not self._turn.wait_for(lambda: self.exchanges > done, timeout=120):
                raise RuntimeError(f"rank {rank}: the other ranks never posted")


def _threaded(world, fn):
    """fn(rank) in one thread per rank, each on a compute stream of its own; the results."""
    import cupy

    results, errors = [None] * world, []

    def body(rank):
        try:
            with cupy.cuda.Device(0), cupy.cuda.Stream(non_blocking=True) as stream:
                results[rank] = fn(rank)
                stream.synchronize()
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_public_ring_over_a_threaded_loopback(xp_gpu, world, causal):
    cp = xp_gpu
    q, k, v, dout = _problem(cp, 2 * world * 40, (8, 2), "bfloat16", seed=20 + world)
    out, lse, _ = cuflash.attention_forward(q, k, v, causal=causal)
    want = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    q_sh, k_sh, v_sh, dout_sh = (cd.shard(x, world) for x in (q, k, v, dout))
    # k and v with strided rows: ring_attention sends contiguous copies
    k_sh, v_sh = ([cp.concatenate([x, x], axis=3)[..., :x.shape[3]] for x in xs] for xs in (k_sh, v_sh))
    cp.cuda.Device().synchronize()
    loop = _ThreadedLoopback(world, ring_comm.CudaDevice())

    def rank_forward(r):
        return cd.ring_attention(q_sh[r], k_sh[r], v_sh[r], group=loop.ranks[r], causal=causal)

    fwd = _threaded(world, rank_forward)
    _assert_close(cd.unshard([o for o, _ in fwd]), out, "bfloat16", "out", None)
    np.testing.assert_allclose(_host(cd.unshard([x for _, x in fwd], axis=2)), _host(lse), rtol=1e-5, atol=1e-4)

    def rank_backward(r):
        return cd.ring_attention_backward(dout_sh[r], q_sh[r], k_sh[r], v_sh[r], *fwd[r], group=loop.ranks[r],
                                          causal=causal)

    bwd = _threaded(world, rank_backward)
    for i, (name, w) in enumerate(zip(("dq", "dk", "dv"), want)):
        _assert_close(cd.unshard([g[i] for g in bwd]), w, "bfloat16", name, None)
    assert loop.exchanges == 3 * world - 2


def test_torch_ring_attention_on_one_rank(xp_gpu, tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    if not torch.cuda.is_available() or not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch without CUDA or NCCL")
    import cuflash.interop.torch as ct

    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        def make(heads):
            return torch.randn(2, 128, heads, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        q, k, v = make(8), make(2), make(2)
        dout = torch.randn_like(q)
        out = ct.ring_attention(q, k, v, causal=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        want = ct.attention(q, k, v, causal=True)
        want_grads = torch.autograd.grad(want, (q, k, v), dout)
        for name, g, w in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
            _assert_close(xp_gpu.from_dlpack(g.detach()), xp_gpu.from_dlpack(w.detach()), "bfloat16", name, None)

        # dropout: the ring draws the single call's mask from the shared rng_state
        state = cuflash.Generator(31).next_state()
        out = ct.ring_attention(q, k, v, causal=True, dropout_p=0.2, rng_state=state)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        want_out, want_lse, drawn = cuflash.attention_forward(*(xp_gpu.from_dlpack(x.detach()) for x in (q, k, v)),
                                                              causal=True, dropout_p=0.2,
                                                              generator=cuflash.Generator(31))
        assert [int(x) for x in drawn] == [int(x) for x in state]
        want_grads = cuflash.attention_backward(xp_gpu.from_dlpack(dout), *(xp_gpu.from_dlpack(x.detach())
                                                for x in (q, k, v)), want_out, want_lse, causal=True,
                                                dropout_p=0.2, rng_state=state)
        for name, g, w in zip(("out", "dq", "dk", "dv"), (out, *grads), (want_out, *want_grads)):
            _assert_close(xp_gpu.from_dlpack(g.detach()), w, "bfloat16", f"dropout {name}", None)
        with pytest.raises(ValueError, match="rng_state"):
            ct.ring_attention(q, k, v, causal=True, dropout_p=0.2)
    finally:
        dist.destroy_process_group()
