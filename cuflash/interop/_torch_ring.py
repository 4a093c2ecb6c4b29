"""Ring attention for torch users: a ring over a ``torch.distributed`` process group, and autograd.

:class:`TorchRing` is the communicator interface of :mod:`cuflash.distributed._comm` over a process group
with the NCCL backend (``dist.batch_isend_irecv``: the send to the next rank and the receive from the
previous one in one group). :func:`ring_attention` (exported as
``cuflash.interop.torch.ring_attention``) is :func:`cuflash.distributed.ring_attention` as a
``torch.autograd.Function``: ``loss.backward()`` runs :func:`cuflash.distributed.ring_attention_backward`
on every rank, so every rank must call backward (the ring's exchanges are collective).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from .._build.cuda_status import import_cupy

cupy = import_cupy()   # a missing CuPy says which extra to install

from ..distributed import _comm as _ring_comm
from ..distributed import ring_attention as _ring_forward, ring_attention_backward as _ring_backward
from ._cupy_stream import cupy_stream
from ._torch_stream import on_torch_stream

__all__ = ["TorchRing", "ring_attention"]


@functools.lru_cache(maxsize=None)
def _comm_streams(index: int):
    """The communication stream of the torch rings on GPU ``index``, for torch and as a CuPy stream."""
    with torch.cuda.device(index):
        stream = torch.cuda.Stream()
    return stream, cupy_stream(stream.cuda_stream)


class TorchRing:
    """A ring over a ``torch.distributed`` process group (NCCL backend, one GPU per process).

    Parameters
    ----------
    group : ProcessGroup, optional
        Default: the default process group. This process must be one of its ranks.
    device : torch.device or int, optional
        The GPU the rank computes on; default: torch's current device.

    Notes
    -----
    Arrays travel as bytes (uint8 tensors viewing the same memory). A transfer is issued on the
    ring's own stream: torch makes its NCCL stream wait for that stream, and ``work.wait()`` makes
    that stream wait for the NCCL stream, so events on it order the transfer with the compute.
    """

    lockstep = False

    def __init__(self, group=None, device=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group "
                               "(backend='nccl') on every rank first")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("group does not include this process")
        members = group if group is not None else dist.group.WORLD
        self._next = dist.get_global_rank(members, (self.rank + 1) % self.world)
        self._prev = dist.get_global_rank(members, (self.rank - 1) % self.world)
        self._torch_stream, self.stream = self._streams(device)

    def _streams(self, device):
        if device is None:
            index = torch.cuda.current_device()
        else:
            index = device if isinstance(device, int) else torch.device(device).index
            index = torch.cuda.current_device() if index is None else index
        return _comm_streams(index)

    def _on_stream(self):
        """torch's and CuPy's current stream become the ring's (so that DLPack needs no event)."""
        context = contextlib.ExitStack()
        context.enter_context(torch.cuda.stream(self._torch_stream))
        context.enter_context(self.stream)
        return context

    @staticmethod
    def _tensor(x):
        return torch.from_dlpack(x.reshape(-1).view(cupy.uint8))

    def send_recv(self, sends, recvs):
        with self._on_stream():
            ops = [dist.P2POp(dist.isend, self._tensor(x), self._next, self.group) for x in sends]
            ops += [dist.P2POp(dist.irecv, self._tensor(y), self._prev, self.group) for y in recvs]
            for work in dist.batch_isend_irecv(ops):
                work.wait()



_ring_comm.GROUP_ADAPTERS["torch"] = TorchRing   # as_ring wraps torch process groups in it


def _plain(x):
    return x.detach() if isinstance(x, torch.Tensor) else x


class _RingAttention(torch.autograd.Function):
    """(out, lse) = ring_attention(q, k, v) on this rank's shard; gradients for q, k, v."""

    @staticmethod
    def forward(ctx, q, k, v, ring, options):
        with on_torch_stream(q.device):
            out, lse = _ring_forward(_plain(q), _plain(k), _plain(v), group=ring, **options)
            out_t, lse_t = torch.from_dlpack(out), torch.from_dlpack(lse)
        ctx.save_for_backward(q, k, v, out_t, lse_t)
        ctx.ring, ctx.options = ring, options
        ctx.mark_non_differentiable(lse_t)
        return out_t, lse_t

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        with on_torch_stream(q.device):
            grads = _ring_backward(_plain(dout), _plain(q), _plain(k), _plain(v), _plain(out), _plain(lse),
                                   group=ctx.ring, **ctx.options)
            grads = tuple(torch.from_dlpack(g) for g in grads)
        return grads[0], grads[1], grads[2], None, None


def ring_attention(q, k, v, *, group=None, causal=False, scale=None, dropout_p=0.0, rng_state=None,
                   return_lse=False):
    """Differentiable :func:`cuflash.distributed.ring_attention` for torch tensors.

    Every rank of ``group`` calls it with its zigzag shard (:func:`cuflash.distributed.shard`, which
    takes torch tensors' CuPy views, or slice the sequence the same way in torch); every rank must
    then run the backward too.

    Parameters
    ----------
    q : torch.Tensor (B, S, Hq, D), float16, bfloat16 or float32, on this rank's GPU
    k, v : torch.Tensor (B, S, Hk, D)
        This rank's shard (chunks ``rank`` and ``2 * world - 1 - rank`` of the sequence); S even.
    group : torch.distributed ProcessGroup, optional
        NCCL backend; default: the default process group.
    causal, scale, dropout_p, rng_state
        As in :func:`cuflash.distributed.ring_attention`: ``dropout_p > 0`` needs ``rng_state`` =
        (seed, offset), the same on every rank (e.g. ``cuflash.Generator(seed).next_state()``); the
        backward regenerates the mask from it.
    return_lse : bool
        Also return lse (float32 (B, Hq, S), not differentiable).

    Returns
    -------
    torch.Tensor (B, S, Hq, D)
        This rank's rows of the output (and lse); backward gives this rank's dq, dk, dv.
    Raises
    ------
    TypeError
        q, k or v not a ``torch.Tensor``, or any error of :func:`cuflash.distributed.ring_attention`.
    ValueError
        q, k or v not on a CUDA device, or any error of :func:`cuflash.distributed.ring_attention`.
    RuntimeError
        If ``torch.distributed`` is not initialised.

    Examples
    --------
    Run under ``torchrun --nproc-per-node 8``, one GPU per rank:

    >>> import torch, torch.distributed as dist
    >>> import cuflash.interop.torch as ct
    >>> dist.init_process_group("nccl")
    >>> torch.cuda.set_device(dist.get_rank())
    >>> q, k, v = my_shards     # (B, S / world, H, D), chunks rank and 2 * world - 1 - rank, requires_grad
    >>> out = ct.ring_attention(q, k, v, causal=True)        # this rank's rows of the output
    >>> out.sum().backward()                                 # every rank runs the backward
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")
    ring = TorchRing(group, q.device)
    options = dict(causal=causal, scale=scale, dropout_p=dropout_p, rng_state=rng_state)
    out, lse = _RingAttention.apply(q, k, v, ring, options)
    return (out, lse) if return_lse else out
