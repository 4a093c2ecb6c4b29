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
  any object with the ring interface of :mod:`cuflash.distributed._comm`;
- :func:`ring_attention_virtual`, :func:`ring_attention_backward_virtual`: the same driver with
  ``world`` virtual ranks in one process on one GPU, joined by device copies
  (:class:`cuflash.distributed._comm.LoopbackRing`), which the tests compare with one
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

from .layout import shard, unshard, zigzag_chunks
from .ring import ring_attention, ring_attention_backward, ring_attention_backward_virtual, ring_attention_virtual
from .schedule import RingCall, RingPair, pair_mask, ring_schedule, step_calls

__all__ = ["RingPair", "RingCall", "zigzag_chunks", "shard", "unshard", "pair_mask", "ring_schedule",
           "step_calls", "ring_attention", "ring_attention_backward", "ring_attention_virtual",
           "ring_attention_backward_virtual"]
