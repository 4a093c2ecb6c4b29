"""Context parallelism: ring attention in the zigzag layout (single-GPU part).

A sequence too long for one GPU is cut into ``2 * world`` equal chunks; rank ``r`` holds chunks
``r`` and ``2 * world - 1 - r`` (the zigzag layout), so that under causal masking every rank has
the same amount of work: one early chunk, which sees few keys, and one late chunk, which sees many.
At ring step ``s`` rank ``r`` holds the keys and values of rank ``(r - s) % world`` and attends its
queries to them; partial results over disjoint key sets are merged exactly through their
log-sum-exp (:func:`cuflash.merge_states`).

This module holds the pieces that need no communicator:

- :func:`zigzag_chunks`, :func:`shard`, :func:`unshard`: the layout;
- :func:`ring_schedule`: which (query chunk, key chunk) pairs each rank computes at each step,
  and with which mask (pure Python, checked on the CPU);
- :func:`ring_attention_virtual`, :func:`ring_attention_backward_virtual`: the same schedule
  with ``world`` virtual ranks in one process on one GPU (no NCCL), which the tests compare with
  one :func:`cuflash.attention_forward` / :func:`cuflash.attention_backward` call.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np

__all__ = ["RingPair", "zigzag_chunks", "shard", "unshard", "pair_mask", "ring_schedule",
           "ring_attention_virtual", "ring_attention_backward_virtual"]

FULL, CAUSAL, SKIP = "full", "causal", "skip"


# ----------------------------------------------------------------------------- layout

def _check_world(world) -> int:
    try:
        world = operator.index(world)
    except TypeError:
        raise TypeError(f"world must be an int, got {type(world).__name__}") from None
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return world


def _xp_of(x):
    """The array module of ``x``: CuPy for a CuPy array, else NumPy (no GPU needed)."""
    try:
        import cupy
    except ImportError:
        return np
    return cupy.get_array_module(x)


def zigzag_chunks(rank, world):
    """The two chunk indices rank ``rank`` holds in the zigzag layout.

    Parameters
    ----------
    rank : int
        ``0 <= rank < world``.
    world : int
        Number of ranks (>= 1); the sequence is cut into ``2 * world`` chunks.

    Returns
    -------
    (int, int)
        ``(rank, 2 * world - 1 - rank)``, in the order they sit in the rank's shard.

    Raises
    ------
    ValueError
        If ``world < 1`` or ``rank`` is out of range.
    """
    world = _check_world(world)
    rank = operator.index(rank)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    return rank, 2 * world - 1 - rank


def shard(x, world, *, axis=1):
    """Cut a sequence into the zigzag layout: one slice per rank.

    Parameters
    ----------
    x : NumPy or CuPy array, e.g. (B, S, H, D) with ``axis=1`` or lse (B, H, S) with ``axis=2``
        ``x.shape[axis]`` must be divisible by ``2 * world``.
    world : int
        Number of ranks (>= 1).
    axis : int
        The sequence axis.

    Returns
    -------
    list of ``world`` arrays, each of ``x``'s shape with ``S / world`` along ``axis``
        Rank ``r``'s slice is chunk ``r`` followed by chunk ``2 * world - 1 - r`` (new arrays).

    Raises
    ------
    ValueError
        If ``world < 1`` or the sequence length is not divisible by ``2 * world``.
    """
    world = _check_world(world)
    xp = _xp_of(x)
    length = x.shape[axis]
    if length % (2 * world):
        raise ValueError(f"x.shape[{axis}] (the sequence length, {length}) must be divisible by "
                         f"2 * world = {2 * world}")
    chunks = xp.split(x, 2 * world, axis=axis)
    return [xp.concatenate([chunks[a], chunks[b]], axis=axis)
            for a, b in (zigzag_chunks(r, world) for r in range(world))]


def unshard(shards, *, axis=1):
    """Invert :func:`shard`: put the ranks' zigzag slices back in sequence order.

    Parameters
    ----------
    shards : sequence of ``world`` NumPy or CuPy arrays
        Rank ``r``'s slice (chunk ``r`` then chunk ``2 * world - 1 - r``), all of one shape with
        an even length along ``axis``.
    axis : int
        The sequence axis.

    Returns
    -------
    array, the shards' shape with ``world`` times the length along ``axis``

    Raises
    ------
    ValueError
        If ``shards`` is empty, or the shards differ in shape or have an odd length.
    """
    shards = list(shards)
    if not shards:
        raise ValueError("shards must hold at least one array (one per rank)")
    shape = tuple(shards[0].shape)
    for r, s in enumerate(shards):
        if tuple(s.shape) != shape:
            raise ValueError(f"shards[{r}] has shape {tuple(s.shape)}, shards[0] has {shape}")
    if shape[axis] % 2:
        raise ValueError(f"shards must have an even length along axis {axis} (two equal chunks), "
                         f"got {shape[axis]}")
    world = len(shards)
    xp = _xp_of(shards[0])
    chunks = [None] * (2 * world)
    for r, s in enumerate(shards):
        first, second = xp.split(s, 2, axis=axis)
        a, b = zigzag_chunks(r, world)
        chunks[a], chunks[b] = first, second
    return xp.concatenate(chunks, axis=axis)


# ----------------------------------------------------------------------------- schedule

class RingPair(NamedTuple):
    """One (query chunk, key chunk) block of the attention matrix, as a rank meets it.

    ``rank`` computes it at ring ``step`` with the keys and values received from ``kv_rank``;
    ``mask`` is ``"full"`` (every key visible), ``"causal"`` (the diagonal chunk: causal within
    the chunk) or ``"skip"`` (no key visible: nothing to compute).
    """
    rank: int
    step: int
    kv_rank: int
    q_chunk: int
    k_chunk: int
    mask: str


def pair_mask(q_chunk, k_chunk, *, causal):
    """The mask a (query chunk, key chunk) block needs, from the chunks' positions.

    Without ``causal`` every block is ``"full"``. With it, keys wholly before the queries are
    ``"full"``, the same chunk is ``"causal"`` (equal chunk lengths, so the kernel's bottom-right
    causal alignment is the diagonal), and keys wholly after are ``"skip"``.
    """
    if not causal or k_chunk < q_chunk:
        return FULL
    return CAUSAL if k_chunk == q_chunk else SKIP


def ring_schedule(world, *, causal):
    """The ring's work in the zigzag layout: every rank's (query chunk, key chunk) pairs per step.

    At step ``s`` rank ``r`` holds the keys and values of rank ``(r - s) % world`` (they travel
    one rank further each step), and attends each of its two query chunks to each of the two
    key chunks in hand.

    Parameters
    ----------
    world : int
        Number of ranks (>= 1).
    causal : bool
        Causal self-attention over the whole sequence.

    Returns
    -------
    list (ranks) of lists (steps) of tuples of 4 :class:`RingPair`
        ``schedule[r][s]`` lists all four pairs of rank ``r`` at step ``s``, including those with
        ``mask == "skip"``, query chunks in shard order, then key chunks in shard order.

    Notes
    -----
    Over all ranks and steps every (query chunk, key chunk) pair appears exactly once. Under
    causal masking each rank does the work of ``2 * world`` full blocks (a diagonal block is half
    of one): at step 0 two diagonal blocks and one full, at each later step exactly two full.
    """
    world = _check_world(world)
    schedule = []
    for rank in range(world):
        steps = []
        for step in range(world):
            kv_rank = (rank - step) % world
            steps.append(tuple(RingPair(rank, step, kv_rank, qc, kc, pair_mask(qc, kc, causal=causal))
                               for qc in zigzag_chunks(rank, world)
                               for kc in zigzag_chunks(kv_rank, world)))
        schedule.append(steps)
    return schedule


# ----------------------------------------------------------------------------- virtual ranks

def _check_ring(q, k, v, world, dropout_p):
    world = _check_world(world)
    if dropout_p:
        raise NotImplementedError(
            "dropout_p > 0 is not supported by ring attention yet: the dropout mask depends on "
            "global query/key positions, which the kernels do not take as offsets")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must have shape (B, S, H, D), got {tuple(x.shape)}")
    seqlen = q.shape[1]
    if k.shape[1] != seqlen or v.shape[1] != seqlen:
        raise ValueError(f"q, k and v must have one sequence length (self-attention over one "
                         f"sharded sequence), got S = {q.shape[1]}, {k.shape[1]}, {v.shape[1]}")
    if seqlen % (2 * world):
        raise ValueError(f"q.shape[1] (S = {seqlen}) must be divisible by 2 * world = {2 * world}")
    return world, seqlen // (2 * world)


def _chunk(x, rank, chunk, world, c, axis=1):
    """Rank ``rank``'s rows of ``chunk`` in its shard ``x`` (a view)."""
    start = c * zigzag_chunks(rank, world).index(chunk)
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + c)
    return x[tuple(index)]


def ring_attention_virtual(q, k, v, *, world, causal=False, scale=None, dropout_p=0.0):
    """Ring attention forward with ``world`` virtual ranks on one GPU.

    The inputs are sharded with :func:`shard`; each rank attends its two query chunks to the
    key chunks :func:`ring_schedule` hands it step by step (one :func:`cuflash.attention_forward`
    per non-skipped pair), the partial results of each query chunk are merged with
    :func:`cuflash.merge_states`, and the rank outputs are put back in sequence order.

    Parameters
    ----------
    q : CuPy array (B, S, Hq, D)
    k, v : CuPy arrays (B, S, Hk, D)
        float16, bfloat16 or float32; ``S`` divisible by ``2 * world``; GQA as in
        :func:`cuflash.attention_forward` (each chunk keeps its kv heads).
    world : int
        Number of virtual ranks (>= 1).
    causal : bool
        Causal self-attention over the whole sequence.
    scale : float, optional
        Multiplies q.k; default ``1 / sqrt(D)``.
    dropout_p : float
        Must be 0 (see Raises).

    Returns
    -------
    out : CuPy array (B, S, Hq, D), the dtype of q
    lse : CuPy float32 array (B, Hq, S)
        Equal, up to rounding, to one ``cuflash.attention_forward(q, k, v, causal=causal)``.

    Raises
    ------
    ValueError
        If ``world < 1``, the shapes are not (B, S, H, D) with one ``S``, or ``S`` is not
        divisible by ``2 * world``.
    NotImplementedError
        If ``dropout_p > 0``.
    """
    from .attention import attention_forward
    from .merge import merge_states

    world, c = _check_ring(q, k, v, world, dropout_p)
    xp = _xp_of(q)
    q_sh, k_sh, v_sh = (shard(x, world) for x in (q, k, v))

    out_sh, lse_sh = [], []
    for rank, steps in enumerate(ring_schedule(world, causal=causal)):
        parts = {chunk: ([], []) for chunk in zigzag_chunks(rank, world)}  # outs, lses
        for pairs in steps:
            for p in pairs:
                if p.mask == SKIP:
                    continue
                o, lse, _ = attention_forward(
                    _chunk(q_sh[rank], rank, p.q_chunk, world, c),
                    _chunk(k_sh[p.kv_rank], p.kv_rank, p.k_chunk, world, c),
                    _chunk(v_sh[p.kv_rank], p.kv_rank, p.k_chunk, world, c),
                    causal=p.mask == CAUSAL, scale=scale)
                parts[p.q_chunk][0].append(o)
                parts[p.q_chunk][1].append(lse)
        merged = [(outs[0], lses[0]) if len(outs) == 1 else merge_states(outs, lses)
                  for outs, lses in parts.values()]  # every query chunk sees its own diagonal
        out_sh.append(xp.concatenate([o for o, _ in merged], axis=1))
        lse_sh.append(xp.concatenate([lse for _, lse in merged], axis=2))
    return unshard(out_sh, axis=1), unshard(lse_sh, axis=2)


def ring_attention_backward_virtual(dout, q, k, v, out, lse, *, world, causal=False, scale=None,
                                    dropout_p=0.0):
    """Ring attention backward with ``world`` virtual ranks on one GPU.

    Each non-skipped (query chunk, key chunk) pair of :func:`ring_schedule` runs one
    :func:`cuflash.attention_backward` with the chunks' q, k, v and the *final* ``out`` and
    ``lse`` rows of its queries: the probabilities it recomputes, ``exp(s - lse)``, are then
    those of the whole row, and ``rowsum(dout * out)`` is the whole row's, so the pairs'
    gradients add up exactly. dq is summed per query chunk and dk/dv per key chunk in float32
    (as they would travel around a real ring), then cast to the input dtype.

    Parameters
    ----------
    dout : CuPy array (B, S, Hq, D)
        Gradient of the loss with respect to ``out``, the dtype of q.
    q : CuPy array (B, S, Hq, D)
    k, v : CuPy arrays (B, S, Hk, D)
        As given to :func:`ring_attention_virtual`.
    out : CuPy array (B, S, Hq, D)
    lse : CuPy float32 array (B, Hq, S)
        What :func:`ring_attention_virtual` (or one :func:`cuflash.attention_forward`) returned.
    world, causal, scale, dropout_p
        As in :func:`ring_attention_virtual`.

    Returns
    -------
    dq : CuPy array (B, S, Hq, D)
    dk, dv : CuPy arrays (B, S, Hk, D)
        The dtype of q; dk/dv summed over the query heads that share a kv head.

    Raises
    ------
    ValueError
        As :func:`ring_attention_virtual`, or if ``lse`` is not (B, Hq, S).
    NotImplementedError
        If ``dropout_p > 0``.
    """
    from .backward import attention_backward

    world, c = _check_ring(q, k, v, world, dropout_p)
    if tuple(lse.shape) != (q.shape[0], q.shape[2], q.shape[1]):
        raise ValueError(f"lse must have shape (B, Hq, S) = {(q.shape[0], q.shape[2], q.shape[1])}, "
                         f"got {tuple(lse.shape)}")
    xp = _xp_of(q)
    q_sh, k_sh, v_sh, dout_sh, out_sh = (shard(x, world) for x in (q, k, v, dout, out))
    lse_sh = shard(lse, world, axis=2)

    dq_acc = [xp.zeros(s.shape, xp.float32) for s in q_sh]
    dk_acc = [xp.zeros(s.shape, xp.float32) for s in k_sh]
    dv_acc = [xp.zeros(s.shape, xp.float32) for s in v_sh]
    for rank, steps in enumerate(ring_schedule(world, causal=causal)):
        for pairs in steps:
            for p in pairs:
                if p.mask == SKIP:
                    continue
                src = p.kv_rank

                def qrows(x, axis=1):
                    return _chunk(x, rank, p.q_chunk, world, c, axis)

                def krows(x):
                    return _chunk(x, src, p.k_chunk, world, c)

                dq, dk, dv = attention_backward(
                    qrows(dout_sh[rank]), qrows(q_sh[rank]), krows(k_sh[src]), krows(v_sh[src]),
                    qrows(out_sh[rank]),
                    xp.ascontiguousarray(qrows(lse_sh[rank], axis=2)),  # (B, Hq, c), packed rows
                    causal=p.mask == CAUSAL, scale=scale)
                qrows(dq_acc[rank])[...] += dq.astype(xp.float32)
                krows(dk_acc[src])[...] += dk.astype(xp.float32)
                krows(dv_acc[src])[...] += dv.astype(xp.float32)
    dtype = q.dtype
    return tuple(unshard([a.astype(dtype) for a in acc]) for acc in (dq_acc, dk_acc, dv_acc))
