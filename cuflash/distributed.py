"""Context parallelism: ring attention in the zigzag layout, over NCCL or on virtual ranks.

A sequence too long for one GPU is cut into ``2 * world`` equal chunks; rank ``r`` holds chunks
``r`` and ``2 * world - 1 - r`` (the zigzag layout), so that under causal masking every rank has
the same amount of work: one early chunk, which sees few keys, and one late chunk, which sees many.
At ring step ``s`` rank ``r`` holds the keys and values of rank ``(r - s) % world`` and attends its
queries to them; partial results over disjoint key sets are merged exactly through their
log-sum-exp (:func:`cuflash.merge_states`). In the backward the keys and values travel the ring
again, and their gradients travel with them, summed in float32 by every rank they visit, until one
last hop brings them home.

- :func:`zigzag_chunks`, :func:`shard`, :func:`unshard`: the layout;
- :func:`ring_schedule`: which (query chunk, key chunk) pairs each rank computes at each step,
  and with which mask; :func:`step_calls`: the kernel calls a step takes (one per step in the
  zigzag layout); pure Python, checked on the CPU;
- :func:`ring_attention`, :func:`ring_attention_backward`: one rank's part, the ranks joined by a
  communicator (``group``): a ``cupy.cuda.nccl.NcclCommunicator``, a ``torch.distributed`` process
  group (torch users call :func:`cuflash.interop.torch.ring_attention`, an autograd function), or
  any object with the ring interface of :mod:`cuflash._ring_comm`;
- :func:`ring_attention_virtual`, :func:`ring_attention_backward_virtual`: the same driver with
  ``world`` virtual ranks in one process on one GPU, joined by device copies
  (:class:`cuflash._ring_comm.LoopbackRing`), which the tests compare with one
  :func:`cuflash.attention_forward` / :func:`cuflash.attention_backward` call.

How a rank's work overlaps its communication: the keys and values of step ``s + 1`` are sent on
and received on the communicator's stream while step ``s``'s attention runs on the compute stream
(CuPy's current stream). CUDA events order the two: the compute of step ``s + 1`` waits for the
receive of step ``s``; a receive into one of the two spare kv buffers waits until the compute that
read that buffer (two steps earlier) is done; a send of dK/dV sums waits for the compute that added
to them. Only the kv heads travel (GQA), in the inputs' dtype; the dK/dV sums travel in float32.

Dropout draws the single-GPU call's mask: the kernels draw a score's dropout decision from its row
and column (Philox counter ``(j // 4, i, b * Hq + h, offset)``, ``cuda_src/philox.cuh``), so under
dropout every (query chunk, key chunk) pair is its own call, told the pair's global position (its
dropout origin: ``FwdParams::dropout_row0 / dropout_col0``), and every rank uses one ``rng_state``.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np

from . import _checks
from .kernels.common import MAX_HEAD_DIM
from . import _ring_comm
from ._ring_comm import LoopbackRing, as_ring, device_for

__all__ = ["RingPair", "RingCall", "zigzag_chunks", "shard", "unshard", "pair_mask", "ring_schedule",
           "step_calls", "ring_attention", "ring_attention_backward", "ring_attention_virtual",
           "ring_attention_backward_virtual"]

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

    Examples
    --------
    >>> from cuflash import distributed as cd
    >>> cd.zigzag_chunks(1, 4)          # 8 chunks: rank 1 holds an early and a late one
    (1, 6)
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

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash import distributed as cd
    >>> [s.tolist() for s in cd.shard(np.arange(8).reshape(1, 8), 2)]
    [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    """
    world = _check_world(world)
    xp = _ring_comm.array_module(x)
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

    Examples
    --------
    >>> import numpy as np
    >>> from cuflash import distributed as cd
    >>> x = np.arange(8).reshape(1, 8)
    >>> bool((cd.unshard(cd.shard(x, 2)) == x).all())
    True
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
    xp = _ring_comm.array_module(shards[0])
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

    Examples
    --------
    >>> from cuflash import distributed as cd
    >>> cd.ring_schedule(2, causal=True)[0][0][2]
    RingPair(rank=0, step=0, kv_rank=0, q_chunk=3, k_chunk=0, mask='full')
    """
    rank: int
    step: int
    kv_rank: int
    q_chunk: int
    k_chunk: int
    mask: str


def pair_mask(q_chunk, k_chunk, *, causal):
    """The mask a (query chunk, key chunk) block needs, from the chunks' positions.

    Parameters
    ----------
    q_chunk, k_chunk : int
        Positions of the query and the key chunk in the sequence.
    causal : bool
        Causal self-attention over the whole sequence.

    Returns
    -------
    {"full", "causal", "skip"}
        Without ``causal`` every block is ``"full"``. With it, keys wholly before the queries are
        ``"full"``, the same chunk is ``"causal"`` (equal chunk lengths, so the kernel's bottom-right
        causal alignment is the diagonal), and keys wholly after are ``"skip"``.

    Examples
    --------
    >>> from cuflash import distributed as cd
    >>> cd.pair_mask(3, 1, causal=True), cd.pair_mask(1, 1, causal=True), cd.pair_mask(1, 3, causal=True)
    ('full', 'causal', 'skip')
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

    Examples
    --------
    >>> from cuflash import distributed as cd
    >>> [p.mask for p in cd.ring_schedule(2, causal=True)[0][0]]   # rank 0, step 0
    ['causal', 'skip', 'full', 'causal']
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


# ----------------------------------------------------------------------------- one step's calls

class RingCall(NamedTuple):
    """One kernel call of a ring step, in chunk slots: slot ``i`` is rows ``i * c .. (i + 1) * c``
    of a shard (``c`` the chunk length). The rank's query slots ``[q_slots[0], q_slots[1])`` attend
    to key slots ``[k_slots[0], k_slots[1])`` of the kv shard in hand, every key visible, or, with
    ``causal``, causal aligned to the bottom-right corner of that rectangle (as the kernels align it).

    Examples
    --------
    >>> from cuflash import distributed as cd
    >>> cd.step_calls(cd.ring_schedule(2, causal=True)[0][1], 2)   # rank 0, step 1
    (RingCall(q_slots=(1, 2), k_slots=(0, 2), causal=False, chunks=None),)
    """
    q_slots: tuple
    k_slots: tuple
    causal: bool
    chunks: tuple | None = None   # (query chunk, key chunk) of a one-pair call under dropout: its origin


def _call_mask(a, b, nq, nk, causal):
    """The mask a call of ``nq`` query and ``nk`` key chunks applies to its chunk pair (a, b).

    Bottom-right causal: query row ``a * c + x`` sees key ``b * c + y`` iff
    ``b * c + y <= a * c + x + (nk - nq) * c``, so whole chunks left of the shifted diagonal are
    full, the diagonal chunk is causal within itself, and chunks right of it are skipped.
    """
    if not causal:
        return FULL
    diagonal = a + nk - nq
    return FULL if b < diagonal else CAUSAL if b == diagonal else SKIP


def step_calls(pairs, world, *, per_pair=False):
    """The kernel calls that compute one rank's ring step.

    When the step's live (non-skipped) pairs fill a rectangle of chunk slots that one call masks
    exactly as the pairs ask, that one call (bigger calls run closer to the GPU's peak; in the
    zigzag layout every step is one call: the whole shard against itself, causal, at step 0, then
    ``c x 2c`` or ``2c x c`` unmasked); otherwise one call per live pair.

    Parameters
    ----------
    pairs : tuple of :class:`RingPair`
        ``ring_schedule(world, causal=...)[rank][step]``.
    world : int
        Number of ranks.
    per_pair : bool
        One call per live pair, each with its ``chunks`` (dropout: a call draws the mask of the
        global positions of one pair, whose rows and columns are contiguous).

    Returns
    -------
    tuple of :class:`RingCall`
        Empty when every pair is skipped.

    Examples
    --------
    >>> from cuflash import distributed as cd
    >>> cd.step_calls(cd.ring_schedule(2, causal=True)[0][0], 2)   # rank 0, step 0: one causal call
    (RingCall(q_slots=(0, 2), k_slots=(0, 2), causal=True, chunks=None),)
    """
    world = _check_world(world)

    def slots(p):
        return (zigzag_chunks(p.rank, world).index(p.q_chunk), zigzag_chunks(p.kv_rank, world).index(p.k_chunk))

    if per_pair:
        calls = []
        for p in pairs:
            if p.mask != SKIP:
                a, b = slots(p)
                calls.append(RingCall((a, a + 1), (b, b + 1), p.mask == CAUSAL, (p.q_chunk, p.k_chunk)))
        return tuple(calls)
    masks = {slots(p): p.mask for p in pairs}
    live = [slots(p) for p in pairs if p.mask != SKIP]
    if not live:
        return ()
    q_lo, q_hi = min(a for a, _ in live), max(a for a, _ in live) + 1
    k_lo, k_hi = min(b for _, b in live), max(b for _, b in live) + 1
    nq, nk = q_hi - q_lo, k_hi - k_lo
    for causal in (False, True):
        if all(masks.get((a, b), SKIP) == _call_mask(a - q_lo, b - k_lo, nq, nk, causal)
               for a in range(q_lo, q_hi) for b in range(k_lo, k_hi)):
            return (RingCall((q_lo, q_hi), (k_lo, k_hi), causal),)
    return tuple(RingCall((a, a + 1), (b, b + 1), masks[a, b] == CAUSAL) for a, b in live)


def _rank_calls(world, rank, causal, per_pair=False):
    """``step_calls`` of every step of ``rank``."""
    return [step_calls(pairs, world, per_pair=per_pair) for pairs in ring_schedule(world, causal=causal)[rank]]


# ----------------------------------------------------------------------------- argument checks

def _check_dropout(dropout_p, rng_state):
    """(dropout_p, (seed, offset)) under dropout, None without."""
    from .random import as_rng_state

    dropout_p = _checks.check_dropout(dropout_p)
    if not dropout_p:
        return None
    if rng_state is None:
        raise ValueError("dropout_p > 0 needs rng_state=(seed, offset), the same on every rank (e.g. "
                         "cuflash.Generator.next_state() drawn once and shared)")
    return dropout_p, as_rng_state(rng_state)


def _check_dropout_chunk(dropout, c):
    if dropout is not None and c % 4:
        raise ValueError(f"under dropout the chunk length (S / (2 * world) = {c}) must be a multiple of 4: the "
                         f"kernels draw dropout in Philox blocks of 4 keys aligned to a call's first key")


def _check_causal(causal):
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return bool(causal)


def _as_arrays(named, host):
    """The operands as CuPy views (CUDA arrays, DLPack imported), or NumPy arrays as they are
    when ``host`` (the CPU tests' path, whose kernels are NumPy stand-ins)."""
    if host:
        for name, x in named:
            if not isinstance(x, np.ndarray):
                raise TypeError(f"{name} must be a NumPy array like q, got {type(x).__name__}")
        return [x for _, x in named]
    return [_checks.as_cuda_array(x, name) for name, x in named]


def _check_qkv(q, k, v, host):
    """Shapes (B, S, H, D) with one B and one S, GQA heads, one head dim, one dtype (one the kernels
    take, unless ``host``: NumPy stand-ins may be float64)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must have shape (B, S, H, D), got {tuple(x.shape)}")
    if not host:
        _checks.check_float_dtype(q, "q")
    _checks.check_same_dtype(q, "q", k, "k")
    _checks.check_same_dtype(q, "q", v, "v")
    b, seqlen, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"k and v must have the batch size of q ({b}), got {k.shape[0]} and {v.shape[0]}")
    if k.shape[1] != seqlen or v.shape[1] != seqlen:
        raise ValueError(f"q, k and v must have one sequence length (self-attention over one "
                         f"sharded sequence), got S = {q.shape[1]}, {k.shape[1]}, {v.shape[1]}")
    _checks.check_heads(hq, k.shape[2], v.shape[2])
    _checks.check_head_dim(d, k.shape[3], v.shape[3], MAX_HEAD_DIM)


def _check_saved(q, dout, out, lse, host):
    """The backward's dout and out (q's shape and dtype) and lse (float32 (B, Hq, S); NumPy stand-ins
    may be float64 when ``host``)."""
    for name, x in (("dout", dout), ("out", out)):
        _checks.check_same_dtype(q, "q", x, name)
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(x.shape)}")
    want = (q.shape[0], q.shape[2], q.shape[1])
    if tuple(lse.shape) != want:
        raise ValueError(f"lse must have shape (B, Hq, S) = {want}, got {tuple(lse.shape)}")
    if np.dtype(lse.dtype) != np.float32 and not (host and np.dtype(lse.dtype) == np.float64):
        raise TypeError(f"lse must be float32, got {lse.dtype}")


def _check_local_length(q):
    if q.shape[1] % 2:
        raise ValueError(f"q.shape[1] (this rank's shard, S = {q.shape[1]}) must be even: a shard holds two "
                         f"equal chunks of the zigzag layout (see shard)")


def _check_global_length(q, world):
    if q.shape[1] % (2 * world):
        raise ValueError(f"q.shape[1] (S = {q.shape[1]}) must be divisible by 2 * world = {2 * world}")


def _ring_group(group):
    ring = as_ring(group)
    if getattr(ring, "lockstep", False):
        raise TypeError("group is a rank of a LoopbackRing, whose ranks only run together: use "
                        "ring_attention_virtual / ring_attention_backward_virtual")
    return ring


# ----------------------------------------------------------------------------- public API

def _empty_results(xp, shapes, dtypes):
    return tuple(xp.empty(s, d) for s, d in zip(shapes, dtypes))


def ring_attention(q, k, v, *, group, causal=False, scale=None, dropout_p=0.0, rng_state=None):
    """Ring attention forward: this rank's part of attention over a sequence sharded across ranks.

    Every rank of ``group`` calls it at once with its zigzag shard (:func:`shard`: chunks ``rank``
    and ``2 * world - 1 - rank`` of ``2 * world`` equal chunks). The keys and values travel the ring
    (only the kv heads, in their dtype) while each rank attends its queries to the slice in hand;
    the partial results are merged through their log-sum-exp in float32.

    Parameters
    ----------
    q : CUDA array (B, S, Hq, D)
    k, v : CUDA arrays (B, S, Hk, D)
        This rank's shard (CuPy, or any CUDA array with DLPack), float16, bfloat16 or float32, on
        the current device; ``S`` (the shard length) even; GQA as in :func:`cuflash.attention_forward`.
        Every rank passes the same shapes, dtype and options. k and v are copied once if they
        are not C-contiguous (they are sent as they are).
    group : communicator
        A ``cupy.cuda.nccl.NcclCommunicator`` (one GPU per process), a ``torch.distributed``
        process group with the NCCL backend, a :class:`cuflash._ring_comm.NcclRing`, or any object
        with the ring interface (``rank``, ``world``, ``stream``, ``send_recv``; see
        :mod:`cuflash._ring_comm`).
    causal : bool
        Causal self-attention over the whole (global) sequence.
    scale : float, optional
        Multiplies q.k; default ``1 / sqrt(D)``.
    dropout_p : float
        Dropout as in :func:`cuflash.attention_forward`; the chunk length ``S / 2`` must then be a
        multiple of 4.
    rng_state : array_like of int (2,) = (seed, offset), optional
        Required when ``dropout_p > 0``, the same on every rank: the dropout mask is that of one
        :func:`cuflash.attention_forward` over the whole sequence that drew this state.

    Returns
    -------
    out : CuPy array (B, S, Hq, D), the dtype of q
    lse : CuPy float32 array (B, Hq, S)
        This rank's rows of the global result: ``unshard`` of all ranks' outputs equals, up to
        rounding, one :func:`cuflash.attention_forward` over the whole sequence.

    Raises
    ------
    TypeError, ValueError
        For a bad argument (naming it), before any launch or communication.

    Notes
    -----
    Runs on CuPy's current stream; the transfers run on the communicator's stream, each step's
    overlapping the previous step's attention, ordered by CUDA events; the host never waits.
    World 1 is one attention call (no communication).

    Examples
    --------
    One process per GPU (e.g. launched by ``torchrun``), a NCCL communicator over all ranks:

    >>> import cupy as cp
    >>> from cupy.cuda import nccl
    >>> from cuflash import distributed as cd
    >>> comm = nccl.NcclCommunicator(world, uid, rank)     # uid from nccl.get_unique_id() on rank 0
    >>> q, k, v = (cd.shard(x, world)[rank] for x in (q_all, k_all, v_all))   # (B, S / world, H, D)
    >>> out, lse = cd.ring_attention(q, k, v, group=comm, causal=True)
    """
    ring = _ring_group(group)
    dropout = _check_dropout(dropout_p, rng_state)
    causal = _check_causal(causal)
    q, k, v = _as_arrays((("q", q), ("k", k), ("v", v)), host=False)
    _check_qkv(q, k, v, host=False)
    _check_local_length(q)
    _check_dropout_chunk(dropout, q.shape[1] // 2)
    scale = _checks.check_scale(scale, q.shape[3])
    import cupy

    b, s, hq, d = q.shape
    if b * s * hq == 0:
        return _empty_results(cupy, ((b, s, hq, d), (b, hq, s)), (q.dtype, np.float32))
    k, v = cupy.ascontiguousarray(k), cupy.ascontiguousarray(v)
    calls = _rank_calls(ring.world, ring.rank, causal, per_pair=dropout is not None)
    return _ring_comm.run(_ring_comm.forward_rank(ring, device_for(q), calls, q, k, v, scale=scale, dropout=dropout))


def ring_attention_backward(dout, q, k, v, out, lse, *, group, causal=False, scale=None, dropout_p=0.0,
                            rng_state=None):
    """Ring attention backward: this rank's dq, dk, dv of :func:`ring_attention`.

    The keys and values travel the ring again; the dK/dV each rank computes for the slice in hand
    travel with it in float32, summed by every rank they visit, and come home after the last step.

    Parameters
    ----------
    dout : CUDA array (B, S, Hq, D)
        Gradient of the loss with respect to this rank's ``out``, the dtype of q.
    q, k, v : CUDA arrays
        This rank's shard, as given to :func:`ring_attention`.
    out : CUDA array (B, S, Hq, D)
    lse : CUDA float32 array (B, Hq, S)
        What :func:`ring_attention` returned on this rank.
    group, causal, scale, dropout_p, rng_state
        As in :func:`ring_attention` (the same values).

    Returns
    -------
    dq : CuPy array (B, S, Hq, D)
    dk, dv : CuPy arrays (B, S, Hk, D)
        The dtype of q, this rank's rows; dk/dv summed over the query heads that share a kv head
        and over all ranks' queries.

    Raises
    ------
    TypeError, ValueError
        For a bad argument (naming it), before any launch or communication.

    Examples
    --------
    >>> out, lse = cd.ring_attention(q, k, v, group=comm, causal=True)
    >>> dq, dk, dv = cd.ring_attention_backward(dout, q, k, v, out, lse, group=comm, causal=True)
    """
    ring = _ring_group(group)
    dropout = _check_dropout(dropout_p, rng_state)
    causal = _check_causal(causal)
    dout, q, k, v, out, lse = _as_arrays((("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out),
                                         ("lse", lse)), host=False)
    _check_qkv(q, k, v, host=False)
    _check_saved(q, dout, out, lse, host=False)
    _check_local_length(q)
    _check_dropout_chunk(dropout, q.shape[1] // 2)
    scale = _checks.check_scale(scale, q.shape[3])
    import cupy

    if q.shape[0] * q.shape[1] * q.shape[2] == 0:
        return _empty_results(cupy, (q.shape, k.shape, v.shape), (q.dtype,) * 3)
    k, v = cupy.ascontiguousarray(k), cupy.ascontiguousarray(v)
    calls = _rank_calls(ring.world, ring.rank, causal, per_pair=dropout is not None)
    return _ring_comm.run(_ring_comm.backward_rank(ring, device_for(q), calls, dout, q, k, v, out, lse,
                                                  scale=scale, dropout=dropout))


def _virtual_operands(named, world, dropout_p, rng_state, causal):
    """The virtual functions' checks: (world, causal, dropout, arrays, whether they are NumPy stand-ins)."""
    world = _check_world(world)
    dropout = _check_dropout(dropout_p, rng_state)
    causal = _check_causal(causal)
    host = isinstance(dict(named)["q"], np.ndarray)
    arrays = _as_arrays(named, host)
    return world, causal, dropout, arrays, host


def ring_attention_virtual(q, k, v, *, world, causal=False, scale=None, dropout_p=0.0, rng_state=None):
    """Ring attention forward with ``world`` virtual ranks on one GPU.

    The inputs are sharded with :func:`shard`, and the driver of :func:`ring_attention` runs for
    every rank, the ranks joined by a :class:`cuflash._ring_comm.LoopbackRing` (device copies on
    each rank's communication stream, events and double buffers as over NCCL) and advanced in
    turns; the rank outputs are put back in sequence order.

    Parameters
    ----------
    q : CuPy array (B, S, Hq, D)
    k, v : CuPy arrays (B, S, Hk, D)
        float16, bfloat16 or float32; ``S`` divisible by ``2 * world``; GQA as in
        :func:`cuflash.attention_forward` (each chunk keeps its kv heads). NumPy arrays run the
        same driver at once on the host, for tests whose kernels are NumPy stand-ins.
    world : int
        Number of virtual ranks (>= 1).
    causal : bool
        Causal self-attention over the whole sequence.
    scale : float, optional
        Multiplies q.k; default ``1 / sqrt(D)``.
    dropout_p : float
    rng_state : array_like of int (2,) = (seed, offset), optional
        As in :func:`ring_attention` (``S / (2 * world)`` a multiple of 4 under dropout).

    Returns
    -------
    out : CuPy array (B, S, Hq, D), the dtype of q
    lse : CuPy float32 array (B, Hq, S)
        Equal, up to rounding, to one ``cuflash.attention_forward(q, k, v, causal=causal)`` (under
        dropout: one whose generator drew ``rng_state``).

    Raises
    ------
    TypeError, ValueError
        If ``world < 1``, the shapes are not (B, S, H, D) with one ``S``, or ``S`` is not
        divisible by ``2 * world``, or another argument is bad; before any launch.

    Examples
    --------
    >>> import cupy as cp
    >>> import cuflash
    >>> from cuflash import distributed as cd
    >>> q, k, v = (cp.random.standard_normal((1, 4096, 8, 64), dtype=cp.float32).astype(cp.float16)
    ...            for _ in range(3))
    >>> out, lse = cd.ring_attention_virtual(q, k, v, world=4, causal=True)
    >>> ref = cuflash.attention(q, k, v, causal=True)     # equal up to rounding
    """
    world, causal, dropout, (q, k, v), host = _virtual_operands((("q", q), ("k", k), ("v", v)), world, dropout_p,
                                                                rng_state, causal)
    _check_qkv(q, k, v, host)
    _check_global_length(q, world)
    _check_dropout_chunk(dropout, q.shape[1] // (2 * world))
    scale = _checks.check_scale(scale, q.shape[3])
    dev = device_for(q)
    loop = LoopbackRing(world, dev)
    shards = [shard(x, world) for x in (q, k, v)]
    results = _ring_comm.lockstep([_ring_comm.forward_rank(loop.ranks[r], dev,
                                                           _rank_calls(world, r, causal, dropout is not None),
                                                           *(s[r] for s in shards), scale=scale, dropout=dropout)
                                   for r in range(world)])
    return unshard([o for o, _ in results], axis=1), unshard([lse for _, lse in results], axis=2)


def ring_attention_backward_virtual(dout, q, k, v, out, lse, *, world, causal=False, scale=None,
                                    dropout_p=0.0, rng_state=None):
    """Ring attention backward with ``world`` virtual ranks on one GPU.

    The driver of :func:`ring_attention_backward` for every rank, joined as in
    :func:`ring_attention_virtual`. Each (query chunks, key chunks) call of the schedule gets the
    *final* ``out`` and ``lse`` rows of its queries, so the calls' gradients add up exactly; dq
    is summed per rank and dk/dv travel the ring in float32, then are cast to the input dtype.

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
    world, causal, scale, dropout_p, rng_state
        As in :func:`ring_attention_virtual`.

    Returns
    -------
    dq : CuPy array (B, S, Hq, D)
    dk, dv : CuPy arrays (B, S, Hk, D)
        The dtype of q; dk/dv summed over the query heads that share a kv head.

    Raises
    ------
    TypeError, ValueError
        As :func:`ring_attention_virtual`, or if ``lse`` is not (B, Hq, S).

    Examples
    --------
    >>> out, lse = cd.ring_attention_virtual(q, k, v, world=4, causal=True)
    >>> dq, dk, dv = cd.ring_attention_backward_virtual(cp.ones_like(out), q, k, v, out, lse, world=4,
    ...                                                 causal=True)
    """
    named = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse))
    world, causal, dropout, (dout, q, k, v, out, lse), host = _virtual_operands(named, world, dropout_p, rng_state,
                                                                                causal)
    _check_qkv(q, k, v, host)
    _check_saved(q, dout, out, lse, host)
    _check_global_length(q, world)
    _check_dropout_chunk(dropout, q.shape[1] // (2 * world))
    scale = _checks.check_scale(scale, q.shape[3])
    dev = device_for(q)
    loop = LoopbackRing(world, dev)
    shards = [shard(x, world) for x in (dout, q, k, v, out)] + [shard(lse, world, axis=2)]
    results = _ring_comm.lockstep([_ring_comm.backward_rank(loop.ranks[r], dev,
                                                            _rank_calls(world, r, causal, dropout is not None),
                                                            *(s[r] for s in shards), scale=scale, dropout=dropout)
                                   for r in range(world)])
    return tuple(unshard([grads[i] for grads in results]) for i in range(3))
