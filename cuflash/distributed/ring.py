"""One rank's ring attention, forward and backward, over a communicator or on virtual ranks (see
:mod:`cuflash.distributed`)."""

from __future__ import annotations

import numpy as np

from .. import _checks
from ..kernels.common import MAX_HEAD_DIM
from . import _comm
from ._comm import LoopbackRing, as_ring, device_for
from .layout import _check_world, shard, unshard
from .schedule import _rank_calls


# ----------------------------------------------------------------------------- argument checks

def _check_dropout(dropout_p, rng_state):
    """(dropout_p, (seed, offset)) under dropout, None without."""
    from ..random import as_rng_state

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
        process group with the NCCL backend, a :class:`cuflash._comm.NcclRing`, or any object
        with the ring interface (``rank``, ``world``, ``stream``, ``send_recv``; see
        :mod:`cuflash.distributed._comm`).
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
    return _comm.run(_comm.forward_rank(ring, device_for(q), calls, q, k, v, scale=scale, dropout=dropout))


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
    return _comm.run(_comm.backward_rank(ring, device_for(q), calls, dout, q, k, v, out, lse,
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
    every rank, the ranks joined by a :class:`cuflash._comm.LoopbackRing` (device copies on
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
    results = _comm.lockstep([_comm.forward_rank(loop.ranks[r], dev,
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
    results = _comm.lockstep([_comm.backward_rank(loop.ranks[r], dev,
                                                            _rank_calls(world, r, causal, dropout is not None),
                                                            *(s[r] for s in shards), scale=scale, dropout=dropout)
                                   for r in range(world)])
    return tuple(unshard([grads[i] for grads in results]) for i in range(3))
