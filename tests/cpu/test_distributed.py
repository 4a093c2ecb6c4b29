"""The ring attention of cuflash.distributed on the CPU: schedule, layout, driver, communicators.

The schedule is pure Python: these tests check, for 1..8 ranks, that every (query chunk, key
chunk) block of the attention matrix is computed exactly once over all ranks and steps, with the
mask its position calls for, that a rank only meets the chunks it holds and the ones the ring
hands it, that under causal masking the zigzag layout gives every rank the same work, and that
each step is one kernel call whose mask is exactly the step's. The layout helpers are checked on
NumPy arrays (shard/unshard round trip, which rows each rank holds), and the argument errors
without a GPU.

The ring driver itself (cuflash.distributed._comm) runs with NumPy stand-ins for the kernels: on virtual
ranks at once, on simulated streams in random orders (which catches a missing event wait), and
over torch.distributed with the gloo backend in spawned processes (when torch is installed). The
NCCL ring's calls are checked against a stand-in NcclCommunicator.
"""

import numpy as np
import pytest

from cuflash.distributed import _comm as ring_comm
from cuflash import distributed as cd

WORLDS = range(1, 9)


def _computed(world, causal):
    """All non-skipped pairs of the schedule, as a list of RingPair."""
    return [p for steps in cd.ring_schedule(world, causal=causal) for pairs in steps for p in pairs
            if p.mask != "skip"]


def test_zigzag_chunks():
    assert cd.zigzag_chunks(0, 1) == (0, 1)
    assert [cd.zigzag_chunks(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("causal", [False, True])
def test_schedule_covers_every_visible_pair_once(world, causal):
    n = 2 * world
    got = [(p.q_chunk, p.k_chunk) for p in _computed(world, causal)]
    want = [(i, j) for i in range(n) for j in range(n) if not causal or j <= i]
    assert sorted(got) == want  # sorted equality: each pair once, none missing, no extra


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("causal", [False, True])
def test_schedule_masks_and_ring_order(world, causal):
    schedule = cd.ring_schedule(world, causal=causal)
    assert len(schedule) == world
    for rank, steps in enumerate(schedule):
        assert len(steps) == world
        assert {p.kv_rank for pairs in steps for p in pairs} == set(range(world))  # every kv slice
        for step, pairs in enumerate(steps):
            assert len(pairs) == 4
            for p in pairs:
                assert (p.rank, p.step, p.kv_rank) == (rank, step, (rank - step) % world)
                assert p.q_chunk in cd.zigzag_chunks(rank, world)
                assert p.k_chunk in cd.zigzag_chunks(p.kv_rank, world)
                want = ("full" if not causal or p.k_chunk < p.q_chunk
                        else "causal" if p.k_chunk == p.q_chunk else "skip")
                assert p.mask == want
                assert (p.mask == "causal") == (causal and step == 0 and p.q_chunk == p.k_chunk)


@pytest.mark.parametrize("world", WORLDS)
def test_zigzag_causal_work_is_balanced(world):
    weight = {"full": 1.0, "causal": 0.5, "skip": 0.0}  # in full-chunk-equivalents
    for steps in cd.ring_schedule(world, causal=True):
        # every step costs each rank the same (2 full blocks), so no rank waits on another
        assert [sum(weight[p.mask] for p in pairs) for pairs in steps] == [2.0] * world
    total = sum(weight[p.mask] for p in _computed(world, True))
    n = 2 * world
    assert total == n * (n - 1) / 2 + n / 2  # the lower triangle of the n x n chunk matrix


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_shard_unshard_round_trip(world, axis):
    shape = [3, 5, 4]
    shape[axis] = 2 * world * 3
    x = np.random.default_rng(world).standard_normal(shape).astype(np.float32)
    shards = cd.shard(x, world, axis=axis)
    assert len(shards) == world
    c = shape[axis] // (2 * world)
    for r, s in enumerate(shards):
        a, b = cd.zigzag_chunks(r, world)
        rows = np.r_[a * c:(a + 1) * c, b * c:(b + 1) * c]
        np.testing.assert_array_equal(s, np.take(x, rows, axis=axis))
    back = cd.unshard(shards, axis=axis)
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(back, x)


def test_shard_unshard_bfloat16_and_4d():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.arange(2 * 16 * 3 * 8, dtype=np.float32).reshape(2, 16, 3, 8).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(cd.unshard(cd.shard(x, 4)).view(np.uint16), x.view(np.uint16))


def test_argument_errors():
    x = np.zeros((1, 12, 2, 4), np.float32)
    with pytest.raises(ValueError, match="world"):
        cd.ring_schedule(0, causal=True)
    with pytest.raises(ValueError, match="world"):
        cd.shard(x, 0)
    with pytest.raises(TypeError, match="world"):
        cd.shard(x, 2.0)
    with pytest.raises(ValueError, match="rank"):
        cd.zigzag_chunks(3, 3)
    with pytest.raises(ValueError, match=r"x.shape\[1\].*2 \* world = 8"):
        cd.shard(x, 4)
    with pytest.raises(ValueError, match="shards"):
        cd.unshard([])
    with pytest.raises(ValueError, match=r"shards\[1\]"):
        cd.unshard([x, x[:, :6]])
    with pytest.raises(ValueError, match="even length"):
        cd.unshard([x[:, :5]])


def test_ring_argument_errors_before_any_launch():
    # NumPy inputs: the checks come first, so no GPU is needed to see them
    q = np.zeros((1, 12, 2, 4), np.float32)
    with pytest.raises(ValueError, match="world"):
        cd.ring_attention_virtual(q, q, q, world=0)
    with pytest.raises(ValueError, match=r"q.shape\[1\] \(S = 12\).*2 \* world = 8"):
        cd.ring_attention_virtual(q, q, q, world=4, causal=True)
    with pytest.raises(ValueError, match="one sequence length"):
        cd.ring_attention_virtual(q, q[:, :6], q[:, :6], world=1)
    with pytest.raises(ValueError, match="k must have shape"):
        cd.ring_attention_virtual(q, q[0], q, world=1)
    with pytest.raises(ValueError, match="dropout_p > 0 needs rng_state"):
        cd.ring_attention_virtual(q, q, q, world=2, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"chunk length \(S / \(2 \* world\) = 3\) must be a multiple of 4"):
        cd.ring_attention_virtual(q, q, q, world=2, dropout_p=0.1, rng_state=(1, 2))
    lse = np.zeros((1, 2, 12), np.float32)
    with pytest.raises(ValueError, match="dropout_p > 0 needs rng_state"):
        cd.ring_attention_backward_virtual(q, q, q, q, q, lse, world=2, dropout_p=0.1)
    with pytest.raises(ValueError, match="multiple of 4"):
        cd.ring_attention_backward_virtual(q, q, q, q, q, lse, world=2, dropout_p=0.1, rng_state=(1, 2))
    with pytest.raises(ValueError, match=r"lse must have shape \(B, Hq, S\)"):
        cd.ring_attention_backward_virtual(q, q, q, q, q, lse[:, :, :6], world=2)
    with pytest.raises(ValueError, match=r"q.shape\[1\]"):
        cd.ring_attention_backward_virtual(q, q, q, q, q, lse, world=5)


# ----------------------------------------------------------------------------- the driver on the CPU
#
# The virtual ring's bookkeeping (which rows go to which call, merging, summing the gradients)
# checked without a GPU: the kernel calls are replaced by float64 NumPy stand-ins with the same
# contract, so the ring must equal the float64 reference of the whole problem: to 1e-10 forward,
# to float32 rounding backward (the gradients are summed in float32).

def _keep_scale(shape, dropout_p, state, origin):
    """keep / (1 - p) of a (B, Hq, Sq, Sk) block at ``origin`` of the single-GPU call's mask
    (cuda_src/philox.cuh, through cuflash.random's NumPy twin); 1.0 without dropout."""
    from cuflash.random import dropout_keep
    if not dropout_p:
        return 1.0
    b, h, sq, sk = shape
    keep = dropout_keep(int(state[0]), int(state[1]), dropout_p, np.arange(b).reshape(-1, 1, 1, 1),
                        np.arange(h).reshape(1, -1, 1, 1), origin[0] + np.arange(sq).reshape(1, 1, -1, 1),
                        origin[1] + np.arange(sk).reshape(1, 1, 1, -1), h)
    return np.where(keep, 1.0 / (1.0 - dropout_p), 0.0)


def _numpy_backward_from_lse(dout, q, k, v, out, lse, *, causal=False, scale=None, keep_scale=1.0):
    """What cuflash.attention_backward computes, in float64: P = exp(s - lse), D = rowsum(dO * O);
    under dropout ``keep_scale`` (:func:`_keep_scale`) scales P in dV and dP."""
    from cuflash import reference
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    group = q.shape[2] // k.shape[2]
    kq, vq = (np.repeat(x.astype(np.float64), group, axis=2) for x in (k, v))
    s = reference.attention_scores(q, k, causal=causal, scale=scale)  # (B, H, Sq, Sk), -inf masked
    p = np.exp(s - lse[..., None])
    dp = np.einsum("bihd,bjhd->bhij", dout, vq) * keep_scale
    d = np.einsum("bihd,bihd->bhi", dout, out)
    ds = p * (dp - d[..., None])
    dq = scale * np.einsum("bhij,bjhd->bihd", ds, kq)
    dk = scale * np.einsum("bhij,bihd->bjhd", ds, q)
    dv = np.einsum("bhij,bihd->bjhd", p * keep_scale, dout)
    fold = lambda g: g.reshape(g.shape[:2] + (k.shape[2], group) + g.shape[3:]).sum(axis=3)  # noqa: E731
    return dq, fold(dk), fold(dv)


def _into(results, buffers):
    """Write stand-in results into the caller's buffers (as the kernels' out=, dq=... do)."""
    for result, buffer in zip(results, buffers):
        if buffer is not None:
            buffer[...] = result
    return tuple(result if buffer is None else buffer for result, buffer in zip(results, buffers))


def _stand_ins():
    """{(module, name): NumPy stand-in} for the kernels the ring calls."""
    import sys

    from cuflash import reference

    def forward(q, k, v, *, causal=False, scale=None, out=None, lse=None, dropout_p=0.0, generator=None,
                dropout_origin=(0, 0)):
        if not dropout_p:
            return _into(reference.attention_forward(q, k, v, causal=causal, scale=scale), (out, lse)) + (None,)
        state = generator.next_state()
        s = reference.attention_scores(q, k, causal=causal, scale=scale)
        row_lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
        p = np.exp(s - row_lse[..., None]) * _keep_scale(s.shape, dropout_p, state, dropout_origin)
        o = np.einsum("bhij,bjhd->bihd", p, np.repeat(v, q.shape[2] // v.shape[2], axis=2))
        return _into((o, row_lse), (out, lse)) + (state,)

    def merge(outs, lses, *, out=None, lse=None):
        return _into(reference.merge_states(outs, lses), (out, lse))

    def backward(dout, q, k, v, out, lse, *, causal=False, scale=None, dq=None, dk=None, dv=None, dropout_p=0.0,
                 rng_state=None, dropout_origin=(0, 0)):
        keep_scale = _keep_scale(lse.shape + (k.shape[1],), dropout_p, rng_state, dropout_origin)
        grads = _numpy_backward_from_lse(dout, q, k, v, out, lse, causal=causal, scale=scale, keep_scale=keep_scale)
        return _into(grads, (dq, dk, dv))

    # sys.modules: the package re-exports a function named ``attention`` over the module's name
    return {(sys.modules["cuflash.attention"], "_forward_at"): forward,
            (sys.modules["cuflash.merge"], "merge_states"): merge,
            (sys.modules["cuflash.backward"], "_backward_at"): backward}


@pytest.fixture
def numpy_kernels(monkeypatch):
    for (module, name), fn in _stand_ins().items():
        monkeypatch.setattr(module, name, fn)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (4, 1)])
def test_virtual_ring_bookkeeping_on_numpy(numpy_kernels, world, causal, heads):
    from cuflash import reference
    rng = np.random.default_rng(world)
    B, S, D = 2, 2 * world * 5, 8
    q = rng.standard_normal((B, S, heads[0], D))
    k, v = (rng.standard_normal((B, S, heads[1], D)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    want_out, want_lse = reference.attention_forward(q, k, v, causal=causal, scale=0.7)
    out, lse = cd.ring_attention_virtual(q, k, v, world=world, causal=causal, scale=0.7)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10, atol=1e-12)
    got = cd.ring_attention_backward_virtual(dout, q, k, v, out, lse, world=world, causal=causal,
                                             scale=0.7)
    want = reference.attention_backward(dout, q, k, v, causal=causal, scale=0.7)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        # the gradients are summed in float32 (as they travel a real ring): float32 rounding
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * np.abs(w).max())


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_virtual_ring_dropout_on_numpy(numpy_kernels, world, causal):
    """Under dropout every chunk pair is its own call at its global origin, so the ring draws the
    single-GPU call's mask: it equals the float64 reference of the whole problem with that mask."""
    from cuflash import reference
    rng = np.random.default_rng(10 + world)
    B, S, D, state, p = 2, 2 * world * 8, 8, (1234, 5), 0.3
    q = rng.standard_normal((B, S, 4, D))
    k, v = (rng.standard_normal((B, S, 2, D)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    want_out, want_lse = reference.attention_forward(q, k, v, causal=causal, scale=0.7, dropout_p=p, rng_state=state)
    out, lse = cd.ring_attention_virtual(q, k, v, world=world, causal=causal, scale=0.7, dropout_p=p,
                                         rng_state=state)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-10, atol=1e-12)
    got = cd.ring_attention_backward_virtual(dout, q, k, v, out, lse, world=world, causal=causal, scale=0.7,
                                             dropout_p=p, rng_state=state)
    want = reference.attention_backward(dout, q, k, v, causal=causal, scale=0.7, dropout_p=p,
                                                  rng_state=state)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * np.abs(w).max())


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("causal", [False, True])
def test_step_calls_per_pair_carry_their_chunks(world, causal):
    for rank, steps in enumerate(cd.ring_schedule(world, causal=causal)):
        for pairs in steps:
            calls = cd.step_calls(pairs, world, per_pair=True)
            live = [p for p in pairs if p.mask != "skip"]
            assert [c.chunks for c in calls] == [(p.q_chunk, p.k_chunk) for p in live]
            for call, p in zip(calls, live):
                assert call.q_slots[1] - call.q_slots[0] == 1 and call.k_slots[1] - call.k_slots[0] == 1
                assert cd.zigzag_chunks(rank, world)[call.q_slots[0]] == p.q_chunk
                assert cd.zigzag_chunks(p.kv_rank, world)[call.k_slots[0]] == p.k_chunk
                assert call.causal == (p.mask == "causal")


# ----------------------------------------------------------------------------- one call per step

@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("causal", [False, True])
def test_step_calls_cover_the_schedule_with_its_masks(world, causal):
    # Expand every call back into chunk pairs with the mask the call applies to each (bottom-right
    # causal over the call's rectangle): they must be exactly the step's non-skipped pairs.
    for rank, steps in enumerate(cd.ring_schedule(world, causal=causal)):
        for pairs in steps:
            want = {(p.q_chunk, p.k_chunk): p.mask for p in pairs if p.mask != "skip"}
            got = {}
            for call in cd.step_calls(pairs, world):
                nq, nk = (call.q_slots[1] - call.q_slots[0]), (call.k_slots[1] - call.k_slots[0])
                for a in range(nq):
                    for b in range(nk):
                        diagonal = a + nk - nq
                        mask = ("full" if not call.causal or b < diagonal
                                else "causal" if b == diagonal else "skip")
                        if mask == "skip":
                            continue
                        qc = cd.zigzag_chunks(rank, world)[call.q_slots[0] + a]
                        kc = cd.zigzag_chunks(pairs[0].kv_rank, world)[call.k_slots[0] + b]
                        assert (qc, kc) not in got, "a pair computed twice"
                        got[qc, kc] = mask
            assert got == want


@pytest.mark.parametrize("world", WORLDS)
def test_zigzag_steps_are_one_call_each(world):
    # Bigger calls run closer to peak: the zigzag layout needs exactly one call per step.
    for causal in (False, True):
        for rank, steps in enumerate(cd.ring_schedule(world, causal=causal)):
            for step, pairs in enumerate(steps):
                (call,) = cd.step_calls(pairs, world)
                if not causal or step == 0:
                    assert call == cd.RingCall((0, 2), (0, 2), causal)
                elif pairs[0].kv_rank < rank:    # its early chunk: all of my queries see it
                    assert call == cd.RingCall((0, 2), (0, 1), False)
                else:                            # only my late chunk sees both of its chunks
                    assert call == cd.RingCall((1, 2), (0, 2), False)


def test_step_calls_fall_back_to_one_call_per_pair():
    # Made-up masks no single call can apply: in slots, (0, 1) full and (1, 0) causal on the
    # anti-diagonal, the diagonal skipped (rank 0 holds chunks 0, 3; kv rank 1 holds 1, 2).
    pairs = tuple(cd.RingPair(0, 1, 1, qc, kc, mask) for qc, kc, mask in
                  ((0, 1, "skip"), (0, 2, "full"), (3, 1, "causal"), (3, 2, "skip")))
    assert cd.step_calls(pairs, 2) == (cd.RingCall((0, 1), (1, 2), False), cd.RingCall((1, 2), (0, 1), True))
    assert cd.step_calls(tuple(p._replace(mask="skip") for p in pairs), 2) == ()


# ----------------------------------------------------------------------------- streams, simulated
#
# The driver's ordering (events between the compute stream and each rank's communication stream,
# double buffers, sends not overwritten before they are read) checked without a GPU: a stand-in
# device queues every launch, copy, record and wait on its stream, as CUDA does, and runs the
# queues afterwards in a random order that respects only the queued waits (a wait on an event
# recorded later in host order waits for nothing, as in CUDA). Buffers start as NaN. A missing
# wait lets a kernel read a buffer before it is written, or after it is overwritten: the result
# then differs from the reference for some orders, which the tests draw by the dozen.

class _SimStream:
    def __init__(self, name):
        self.name, self.queue = name, []


class _SimEvent:
    done = False


class SimDevice(ring_comm.HostDevice):
    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.streams = [_SimStream("compute")]
        self.ops = 0

    def current_stream(self):
        return self.streams[0]

    def new_stream(self):
        self.streams.append(_SimStream(f"comm{len(self.streams)}"))
        return self.streams[-1]

    def record(self, stream):
        event = _SimEvent()
        stream.queue.append(("record", event))
        return event

    def wait(self, stream, event):
        if event is not None:
            stream.queue.append(("wait", event))

    def launch(self, stream, fn, *args):
        stream.queue.append(("run", fn, args))

    def empty(self, shape, dtype):
        return np.full(shape, np.nan, dtype)

    def copy(self, dst, src, stream):
        stream.queue.append(("run", np.copyto, (dst, src)))

    def drain(self):
        """Run every queued operation, picking at random among the streams whose next one may run."""
        for s in self.streams:
            s.queue.reverse()   # pop() from the end
        while any(s.queue for s in self.streams):
            ready = [s for s in self.streams if s.queue and (s.queue[-1][0] != "wait" or s.queue[-1][1].done)]
            assert ready, "deadlock: every stream waits for an event that is never reached"
            op = ready[self.rng.integers(len(ready))].queue.pop()
            if op[0] == "run":
                op[1](*op[2])
            elif op[0] == "record":
                op[1].done = True
            self.ops += 1


def _pair_calls(pairs, world):
    """One call per live pair: the driver's general path (the zigzag schedule never needs it)."""
    def slots(chunk, rank):
        i = cd.zigzag_chunks(rank, world).index(chunk)
        return (i, i + 1)
    return tuple(cd.RingCall(slots(p.q_chunk, p.rank), slots(p.k_chunk, p.kv_rank), p.mask == "causal")
                 for p in pairs if p.mask != "skip")


def _sim_ring(world, causal, heads, seed, device, fused=True):
    from cuflash import reference
    rng = np.random.default_rng(seed)
    B, S, D = 1, 2 * world * 3, 4
    q = rng.standard_normal((B, S, heads[0], D))
    k, v = (rng.standard_normal((B, S, heads[1], D)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    out, lse = reference.attention_forward(q, k, v, causal=causal)
    loop = ring_comm.LoopbackRing(world, device)
    plan = cd.step_calls if fused else _pair_calls
    calls = [[plan(p, world) for p in steps] for steps in cd.ring_schedule(world, causal=causal)]
    shards = [cd.shard(x, world) for x in (q, k, v)]
    fwd = ring_comm.lockstep([ring_comm.forward_rank(loop.ranks[r], device, calls[r], *(s[r] for s in shards),
                                                     scale=0.5) for r in range(world)])
    shards = [cd.shard(x, world) for x in (dout, q, k, v, out)] + [cd.shard(lse, world, axis=2)]
    bwd = ring_comm.lockstep([ring_comm.backward_rank(loop.ranks[r], device, calls[r], *(s[r] for s in shards),
                                                      scale=0.5) for r in range(world)])
    device.drain()
    got = (cd.unshard([o for o, _ in fwd]), cd.unshard([x for _, x in fwd], axis=2),
           *(cd.unshard([g[i] for g in bwd]) for i in range(3)))
    want = (*reference.attention_forward(q, k, v, causal=causal, scale=0.5),
            *_numpy_backward_from_lse(dout, q, k, v, out, lse, causal=causal, scale=0.5))
    return loop, got, want


def _close(got, want):
    return all(np.allclose(g, w, rtol=1e-9, atol=1e-9) for g, w in zip(got, want))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_driver_streams_in_random_orders(numpy_kernels, world, causal, fused):
    for seed in range(12):
        device = SimDevice(seed)
        loop, got, want = _sim_ring(world, causal, (4, 2), seed, device, fused)
        # forward: world - 1 kv exchanges; backward: world - 1 kv and world dK/dV exchanges
        assert loop.exchanges == (3 * world - 2 if world > 1 else 0)
        assert _close(got, want), f"seed {seed}"


class _DropsWaits(SimDevice):
    """A driver bug, simulated: the waits of one kind of stream go missing."""

    def __init__(self, seed, on):
        super().__init__(seed)
        self.on = on

    def wait(self, stream, event):
        if (stream.name == "compute") != (self.on == "comm"):
            return
        super().wait(stream, event)


@pytest.mark.parametrize("on", ["compute", "comm"])
def test_simulated_streams_catch_a_missing_wait(numpy_kernels, on):
    # The check above means something only if a missing wait shows: for some order, it must.
    results = [_close(*_sim_ring(3, True, (2, 2), seed, _DropsWaits(seed, on))[1:]) for seed in range(12)]
    assert not all(results)


def test_loopback_ring_checks_its_protocol():
    device = ring_comm.HostDevice()
    loop = ring_comm.LoopbackRing(3, device)
    a = [np.arange(4.0) + r for r in range(3)]
    b = [np.zeros(4) for _ in range(3)]
    for r in range(3):
        loop.ranks[r].send_recv([a[r]], [b[r]])
        assert loop.exchanges == (r == 2)
    for r in range(3):
        np.testing.assert_array_equal(b[r], a[(r - 1) % 3])   # from the previous rank
    loop.ranks[0].send_recv([a[0]], [b[0]])
    with pytest.raises(RuntimeError, match="in turns"):
        loop.ranks[0].send_recv([a[0]], [b[0]])
    loop = ring_comm.LoopbackRing(2, device)
    loop.ranks[0].send_recv([a[0]], [b[0]])
    with pytest.raises(ValueError, match="rank 1 receives"):
        loop.ranks[1].send_recv([a[1]], [np.zeros(5)])
    with pytest.raises(ValueError, match="world"):
        ring_comm.LoopbackRing(0, device)


# ----------------------------------------------------------------------------- communicators

class _FakeNccl:
    NCCL_UINT8 = 7
    available = True

    def __init__(self):
        self.log = []

    def groupStart(self):  # noqa: N802 - CuPy's names
        self.log.append("start")

    def groupEnd(self):  # noqa: N802
        self.log.append("end")


class _FakeComm:
    def __init__(self, nccl, rank, world):
        self.nccl, self._rank, self._world = nccl, rank, world

    def rank_id(self):
        return self._rank

    def size(self):
        return self._world

    def send(self, ptr, count, dtype, peer, stream):
        self.nccl.log.append(("send", ptr, count, dtype, peer, stream))

    def recv(self, ptr, count, dtype, peer, stream):
        self.nccl.log.append(("recv", ptr, count, dtype, peer, stream))


def test_nccl_ring_sends_bytes_to_the_next_rank_in_one_group(monkeypatch):
    from types import SimpleNamespace
    nccl = _FakeNccl()
    monkeypatch.setattr(ring_comm, "_nccl", lambda: nccl)
    array = lambda ptr, nbytes: SimpleNamespace(data=SimpleNamespace(ptr=ptr), nbytes=nbytes)  # noqa: E731
    ring = ring_comm.NcclRing(_FakeComm(nccl, 0, 4), stream=SimpleNamespace(ptr=99))
    assert (ring.rank, ring.world, ring.lockstep) == (0, 4, False)
    ring.send_recv([array(1, 10), array(2, 20)], [array(3, 10), array(4, 20)])
    assert nccl.log == ["start", ("send", 1, 10, 7, 1, 99), ("send", 2, 20, 7, 1, 99),
                        ("recv", 3, 10, 7, 3, 99), ("recv", 4, 20, 7, 3, 99), "end"]


def test_as_ring():
    from types import SimpleNamespace
    ring = SimpleNamespace(rank=1, world=2, stream=None, send_recv=lambda s, r: None)
    assert ring_comm.as_ring(ring) is ring
    with pytest.raises(TypeError, match="group must be"):
        ring_comm.as_ring(object())
    with pytest.raises(ValueError, match="group.rank"):
        ring_comm.as_ring(SimpleNamespace(rank=2, world=2, stream=None, send_recv=None))
    with pytest.raises(TypeError, match="group.rank and group.world must be ints"):
        ring_comm.as_ring(SimpleNamespace(rank=0.0, world=2, stream=None, send_recv=None))


def test_real_ring_argument_errors_before_any_communication():
    from types import SimpleNamespace

    def refuse(sends, recvs):
        raise AssertionError("communicated before the arguments were checked")

    group = SimpleNamespace(rank=0, world=2, stream=None, send_recv=refuse)
    q = np.zeros((1, 8, 2, 4), np.float32)
    with pytest.raises(TypeError, match="q must be a CUDA array"):
        cd.ring_attention(q, q, q, group=group)
    with pytest.raises(TypeError, match="group must be"):
        cd.ring_attention(q, q, q, group="nccl")
    with pytest.raises(ValueError, match="dropout_p > 0 needs rng_state"):
        cd.ring_attention(q, q, q, group=group, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        cd.ring_attention(q, q, q, group=group, dropout_p=1.5)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cd.ring_attention(q, q, q, group=group, causal="yes")
    with pytest.raises(TypeError, match="LoopbackRing"):
        cd.ring_attention(q, q, q, group=ring_comm.LoopbackRing(2, ring_comm.HostDevice()).ranks[0])
    lse = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(TypeError, match="dout must be a CUDA array"):
        cd.ring_attention_backward(q, q, q, q, q, lse, group=group)


def test_check_helpers_name_the_argument():
    q = np.zeros((1, 6, 4, 8), np.float32)
    k = np.zeros((1, 6, 2, 8), np.float32)
    cd.ring._check_qkv(q, k, k, host=True)
    with pytest.raises(TypeError, match="k must have the dtype of q"):
        cd.ring._check_qkv(q, k.astype(np.float16), k, host=True)
    with pytest.raises(TypeError, match="q must be float16, bfloat16 or float32"):
        cd.ring._check_qkv(q.astype(np.float64), k.astype(np.float64), k.astype(np.float64), host=False)
    with pytest.raises(ValueError, match="batch size of q"):
        cd.ring._check_qkv(q, np.zeros((2, 6, 2, 8), np.float32), np.zeros((2, 6, 2, 8), np.float32), host=True)
    with pytest.raises(ValueError, match="multiple of the heads of k"):
        cd.ring._check_qkv(q, np.zeros((1, 6, 3, 8), np.float32), np.zeros((1, 6, 3, 8), np.float32), host=True)
    with pytest.raises(ValueError, match="head dim of q"):
        cd.ring._check_qkv(q, np.zeros((1, 6, 2, 4), np.float32), k, host=True)
    with pytest.raises(ValueError, match="this rank's shard, S = 7"):
        cd.ring._check_local_length(np.zeros((1, 7, 2, 8)))
    lse = np.zeros((1, 4, 6), np.float32)
    cd.ring._check_saved(q, q, q, lse, host=False)
    with pytest.raises(ValueError, match="out must have the shape of q"):
        cd.ring._check_saved(q, q, q[:, :2], lse, host=False)
    with pytest.raises(TypeError, match="dout must have the dtype of q"):
        cd.ring._check_saved(q, q.astype(np.float16), q, lse, host=False)
    with pytest.raises(TypeError, match="lse must be float32"):
        cd.ring._check_saved(q, q, q, lse.astype(np.float64), host=False)


# ----------------------------------------------------------------------------- torch.distributed, on the CPU
#
# TorchRing's exchanges through torch.distributed, with the gloo backend on the CPU: the same
# batch_isend_irecv calls, peers and matching as over NCCL, minus the streams (NumPy arrays as torch
# tensors of the same memory). Each spawned process runs one rank's driver with the stand-in kernels.

def _gloo_rank(rank, world, store_path, causal, results):
    import torch
    import torch.distributed as dist

    from cuflash import reference
    from cuflash.interop._torch_ring import TorchRing

    class HostTorchRing(TorchRing):
        def _streams(self, device):
            return None, None

        def _on_stream(self):
            import contextlib
            return contextlib.nullcontext()

        @staticmethod
        def _tensor(x):
            return torch.from_numpy(x.reshape(-1).view(np.uint8))

    for (module, name), fn in _stand_ins().items():
        setattr(module, name, fn)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        rng = np.random.default_rng(5)   # the same problem on every rank
        q = rng.standard_normal((1, 2 * world * 3, 4, 8))
        k, v = (rng.standard_normal((1, 2 * world * 3, 2, 8)) for _ in range(2))
        dout = rng.standard_normal(q.shape)
        out, lse = reference.attention_forward(q, k, v, causal=causal)
        ring = HostTorchRing()
        dev = ring_comm.HostDevice()
        calls = [cd.step_calls(p, world) for p in cd.ring_schedule(world, causal=causal)[rank]]
        mine = lambda x, axis=1: cd.shard(x, world, axis=axis)[rank]  # noqa: E731
        got = ring_comm.run(ring_comm.forward_rank(ring, dev, calls, mine(q), mine(k), mine(v), scale=0.5))
        got += ring_comm.run(ring_comm.backward_rank(ring, dev, calls, mine(dout), mine(q), mine(k), mine(v),
                                                     mine(out), mine(lse, 2), scale=0.5))
        want = reference.attention_forward(q, k, v, causal=causal, scale=0.5)
        want += _numpy_backward_from_lse(dout, q, k, v, out, lse, causal=causal, scale=0.5)
        axes = (1, 2, 1, 1, 1)
        results.put((rank, all(np.allclose(g, mine(w, a), rtol=1e-9, atol=1e-9)
                               for g, w, a in zip(got, want, axes))))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_torch_ring_over_gloo(tmp_path, world):
    pytest.importorskip("torch")
    import multiprocessing
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed has no gloo backend")
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ranks = [spawn.Process(target=_gloo_rank, args=(r, world, str(tmp_path / "store"), True, results))
             for r in range(world)]
    for p in ranks:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in range(world))
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got == {r: True for r in range(world)}
    assert [p.exitcode for p in ranks] == [0] * world
