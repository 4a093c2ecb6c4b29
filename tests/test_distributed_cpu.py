"""The ring attention schedule and the zigzag layout of cuflash.distributed, on the CPU.

The schedule is pure Python: these tests check, for 1..8 ranks, that every (query chunk, key
chunk) block of the attention matrix is computed exactly once over all ranks and steps, with the
mask its position calls for, that a rank only meets the chunks it holds and the ones the ring
hands it, and that under causal masking the zigzag layout gives every rank the same work. The
layout helpers are checked on NumPy arrays (shard/unshard round trip, which rows each rank
holds), and the argument errors without a GPU.
"""

import numpy as np
import pytest

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
    with pytest.raises(NotImplementedError, match="dropout"):
        cd.ring_attention_virtual(q, q, q, world=2, dropout_p=0.1)
    lse = np.zeros((1, 2, 12), np.float32)
    with pytest.raises(NotImplementedError, match="dropout"):
        cd.ring_attention_backward_virtual(q, q, q, q, q, lse, world=2, dropout_p=0.1)
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

def _numpy_backward_from_lse(dout, q, k, v, out, lse, *, causal=False, scale=None):
    """What cuflash.attention_backward computes, in float64: P = exp(s - lse), D = rowsum(dO * O)."""
    from cuflash import reference
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    group = q.shape[2] // k.shape[2]
    kq, vq = (np.repeat(x.astype(np.float64), group, axis=2) for x in (k, v))
    s = reference.attention_scores(q, k, causal=causal, scale=scale)  # (B, H, Sq, Sk), -inf masked
    p = np.exp(s - lse[..., None])
    dp = np.einsum("bihd,bjhd->bhij", dout, vq)
    d = np.einsum("bihd,bihd->bhi", dout, out)
    ds = p * (dp - d[..., None])
    dq = scale * np.einsum("bhij,bjhd->bihd", ds, kq)
    dk = scale * np.einsum("bhij,bihd->bjhd", ds, q)
    dv = np.einsum("bhij,bihd->bjhd", p, dout)
    fold = lambda g: g.reshape(g.shape[:2] + (k.shape[2], group) + g.shape[3:]).sum(axis=3)  # noqa: E731
    return dq, fold(dk), fold(dv)


@pytest.fixture
def numpy_kernels(monkeypatch):
    import sys

    from cuflash import reference

    # sys.modules: the package re-exports a function named ``attention`` over the module's name
    modules = {name: sys.modules[f"cuflash.{name}"] for name in ("attention", "backward", "merge")}

    def forward(q, k, v, *, causal=False, scale=None):
        out, lse = reference.attention_forward(q, k, v, causal=causal, scale=scale)
        return out, lse, None

    monkeypatch.setattr(modules["attention"], "attention_forward", forward)
    monkeypatch.setattr(modules["merge"], "merge_states", reference.merge_states)
    monkeypatch.setattr(modules["backward"], "attention_backward", _numpy_backward_from_lse)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (4, 1)])
def test_virtual_ring_bookkeeping_on_numpy(numpy_kernels, world, causal, heads):
    from cuflash import _reference_backward, reference
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
    want = _reference_backward.attention_backward(dout, q, k, v, causal=causal, scale=0.7)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        # the gradients are summed in float32 (as they travel a real ring): float32 rounding
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * np.abs(w).max())
