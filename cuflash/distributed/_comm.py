"""How the ring of :mod:`cuflash.distributed` runs: one rank's driver loop, and what it runs on.

:func:`forward_rank` and :func:`backward_rank` are one rank's ring forward and backward, step by
step, given the kernel calls of each step (:func:`cuflash.distributed.step_calls`). They talk to
two small interfaces, so that one driver loop serves NCCL ranks on several GPUs, virtual ranks on
one GPU, and the CPU tests:

- a **device**: streams, events, work launched on a stream, buffers. :class:`CudaDevice` is CuPy's;
  :class:`HostDevice` runs everything at once on NumPy arrays (no streams), for the CPU tests whose
  kernels are NumPy stand-ins. Methods: ``current_stream()``, ``new_stream()``, ``record(stream)``
  (an event marking the work queued on ``stream`` so far), ``wait(stream, event)`` (later work on
  ``stream`` waits for it; ``None`` waits for nothing), ``launch(stream, fn, *args)`` (run ``fn``
  with ``stream`` current: its kernels are queued there), ``empty(shape, dtype)`` and
  ``copy(dst, src, stream)`` (a raw copy of a contiguous array, queued on ``stream``).
- a **communicator** (a *ring*): ``rank``, ``world``, ``stream`` (the stream its transfers run
  on) and ``send_recv(sends, recvs)``: queue on ``stream``, as one group, the sending of each array
  of ``sends`` to rank ``(rank + 1) % world`` and the receiving of each array of ``recvs`` from
  rank ``(rank - 1) % world`` (contiguous arrays, matched by position and size with the neighbours'
  calls). Work queued on ``stream`` before the call is done before the transfer reads or writes
  anything; work queued after it starts after the transfer is complete. Every rank makes the same
  calls in the same order. ``lockstep`` is true for rings whose ranks all live in this thread
  (:class:`LoopbackRing`): their drivers must be advanced in turns.

Communicators here: :class:`NcclRing` (``cupy.cuda.nccl``) and :class:`LoopbackRing` (virtual
ranks in one process, by device copies: the test double of a real ring, and the engine of
:func:`cuflash.distributed.ring_attention_virtual`). The ``torch.distributed`` one,
``cuflash.interop._torch_ring.TorchRing``, lives with the torch adapters. :func:`as_ring` turns
what a user passes as ``group`` into one of them.
"""

from __future__ import annotations

import importlib
import operator

import numpy as np

__all__ = ["CudaDevice", "HostDevice", "LoopbackRing", "NcclRing", "array_module", "as_ring", "backward_rank",
           "device_for", "forward_rank", "lockstep", "rows", "run"]


# ----------------------------------------------------------------------------- devices

class CudaDevice:
    """Streams, events and buffers of CuPy's current device."""

    def __init__(self):
        import cupy

        self._cupy = cupy

    def current_stream(self):
        return self._cupy.cuda.get_current_stream()

    def new_stream(self):
        return self._cupy.cuda.Stream(non_blocking=True)

    def record(self, stream):
        event = self._cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        return event

    def wait(self, stream, event):
        if event is not None:
            stream.wait_event(event)

    def launch(self, stream, fn, *args):
        with stream:
            fn(*args)

    def empty(self, shape, dtype):
        return self._cupy.empty(shape, dtype)

    def copy(self, dst, src, stream):
        runtime = self._cupy.cuda.runtime
        runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, runtime.memcpyDeviceToDevice, stream.ptr)


class HostDevice:
    """NumPy arrays and no streams: every launch runs at once, in program order."""

    def current_stream(self):
        return None

    def new_stream(self):
        return None

    def record(self, stream):
        return None

    def wait(self, stream, event):
        pass

    def launch(self, stream, fn, *args):
        fn(*args)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def copy(self, dst, src, stream):
        np.copyto(dst, src)


def device_for(x):
    """:class:`CudaDevice` for a CuPy array, :class:`HostDevice` for a NumPy one."""
    if isinstance(x, np.ndarray):
        return HostDevice()
    return CudaDevice()


# ----------------------------------------------------------------------------- communicators

_RING_ATTRIBUTES = ("rank", "world", "stream", "send_recv")
#: Wrappers of a framework's process groups in the ring interface, by the framework's top-level
#: module. The core imports no framework: each adapter registers its wrapper when it is imported
#: (cuflash/interop/_torch_ring.py), and as_ring imports the adapter named here at the first group of
#: its framework.
GROUP_ADAPTERS: dict = {}
_ADAPTER_MODULES = {"torch": "cuflash.interop._torch_ring"}


def as_ring(group):
    """The communicator for ``group``: a ring object as it is (anything with ``rank``, ``world``,
    ``stream`` and ``send_recv``), a ``cupy.cuda.nccl.NcclCommunicator`` in an :class:`NcclRing`, a
    ``torch.distributed`` process group in a ``TorchRing``.

    Raises
    ------
    TypeError
        For anything else, or a ring whose ``rank``/``world`` are not ints.
    ValueError
        If ``world < 1`` or ``rank`` is not in ``[0, world)``.
    """
    module = type(group).__module__ or ""
    if all(hasattr(group, name) for name in _RING_ATTRIBUTES):
        ring = group
    elif module.startswith("cupy") and hasattr(group, "rank_id"):
        ring = NcclRing(group)
    elif module.partition(".")[0] in _ADAPTER_MODULES:
        framework = module.partition(".")[0]
        if framework not in GROUP_ADAPTERS:
            importlib.import_module(_ADAPTER_MODULES[framework])   # it registers its wrapper
        ring = GROUP_ADAPTERS[framework](group)
    else:
        raise TypeError(f"group must be a cupy.cuda.nccl.NcclCommunicator, a torch.distributed process group "
                        f"or a ring communicator (rank, world, stream, send_recv), got {type(group).__name__}")
    try:
        rank, world = operator.index(ring.rank), operator.index(ring.world)
    except TypeError:
        raise TypeError(f"group.rank and group.world must be ints, got {type(ring.rank).__name__} and "
                        f"{type(ring.world).__name__}") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"group.rank must be in [0, group.world) with group.world >= 1, got rank {rank}, "
                         f"world {world}")
    return ring


def _nccl():
    """``cupy.cuda.nccl``, or a RuntimeError saying why it cannot be used."""
    from cupy.cuda import nccl

    if not getattr(nccl, "available", True):
        raise RuntimeError("cupy.cuda.nccl is not available: CuPy found no NCCL library "
                           "(pip install nvidia-nccl-cu13, or nvidia-nccl-cu12 for CuPy's CUDA 12 build)")
    return nccl


_side_streams: dict = {}   # device id -> the communication stream of the NCCL rings on it


def _side_stream(device_id: int):
    import cupy

    stream = _side_streams.get(device_id)
    if stream is None:
        with cupy.cuda.Device(device_id):
            stream = _side_streams[device_id] = cupy.cuda.Stream(non_blocking=True)
    return stream


class NcclRing:
    """A ring over a ``cupy.cuda.nccl.NcclCommunicator`` (one GPU per process).

    Parameters
    ----------
    comm : cupy.cuda.nccl.NcclCommunicator
        Made by every rank with the same unique id (``nccl.get_unique_id()`` on one rank, passed
        to the others), on the GPU the rank computes on.
    stream : cupy.cuda.Stream, optional
        Where the transfers run; default: a non-blocking stream of the communicator's GPU, shared
        by the NCCL rings of this process on that GPU.

    Notes
    -----
    Arrays travel as bytes (``NCCL_UINT8``), whatever their dtype: NCCL only moves them.
    """

    lockstep = False

    def __init__(self, comm, *, stream=None):
        self.comm = comm
        self.rank, self.world = int(comm.rank_id()), int(comm.size())
        self.stream = stream if stream is not None else _side_stream(int(comm.device_id()))

    def send_recv(self, sends, recvs):
        nccl = _nccl()
        after, before = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        # One group: the send to the next rank and the receive from the previous one progress
        # together (a lone blocking send around a ring would wait for ever).
        nccl.groupStart()
        try:
            for x in sends:
                self.comm.send(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, after, self.stream.ptr)
            for y in recvs:
                self.comm.recv(y.data.ptr, y.nbytes, nccl.NCCL_UINT8, before, self.stream.ptr)
        finally:
            nccl.groupEnd()


class LoopbackRing:
    """``world`` virtual ranks in one process, joined by device copies: a ring without NCCL.

    ``ring.ranks[r]`` is rank ``r``'s communicator, with a stream of its own. An exchange completes
    when every rank has posted it: the last post queues, on each receiver's stream, a wait for the
    sender's stream, the copies, and on each sender's stream a wait for those copies (so a send
    buffer is not overwritten before it has been read). The ranks' drivers must therefore run in
    turns, each up to its next post (``lockstep``), as :func:`cuflash.distributed.ring_attention_virtual`
    runs them.

    Parameters
    ----------
    world : int
        Number of ranks (>= 1).
    device : CudaDevice or HostDevice (or a test's stand-in)
        Makes the ranks' streams and queues the copies.
    """

    def __init__(self, world, device):
        world = operator.index(world)
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.world, self.device = world, device
        self.ranks = [_LoopbackRank(self, r, device.new_stream()) for r in range(world)]
        self._posts = [None] * world   # (sends, recvs) of the exchange under way, per rank
        self.exchanges = 0             # completed exchanges (for the tests)

    def _post(self, rank, sends, recvs):
        if self._posts[rank] is not None:
            raise RuntimeError(f"rank {rank} of a LoopbackRing posted a second exchange before every rank had "
                               f"posted the first: its ranks must run in turns (ring_attention_virtual does)")
        self._posts[rank] = (list(sends), list(recvs))
        if all(post is not None for post in self._posts):
            posts, self._posts = self._posts, [None] * self.world
            self._exchange(posts)

    def _exchange(self, posts):
        dev, n = self.device, self.world
        streams = [rank.stream for rank in self.ranks]
        for r, (_, recvs) in enumerate(posts):
            sends = posts[(r - 1) % n][0]
            if len(sends) != len(recvs) or any(_layout(x) != _layout(y) for x, y in zip(sends, recvs)):
                raise ValueError(f"rank {r} receives {[_layout(y) for y in recvs]} but rank {(r - 1) % n} sends "
                                 f"{[_layout(x) for x in sends]}")
        ready = [dev.record(s) for s in streams]         # each sender's earlier work, e.g. its last writes
        for r, (_, recvs) in enumerate(posts):
            before = (r - 1) % n
            dev.wait(streams[r], ready[before])
            for x, y in zip(posts[before][0], recvs):
                dev.copy(y, x, streams[r])
        copied = [dev.record(s) for s in streams]
        for r in range(n):
            dev.wait(streams[r], copied[(r + 1) % n])     # the next rank has read what r sent
        self.exchanges += 1


def _layout(x):
    return tuple(x.shape), np.dtype(x.dtype).str


class _LoopbackRank:
    """Rank ``rank`` of a :class:`LoopbackRing`: the communicator interface."""

    lockstep = True

    def __init__(self, ring, rank, stream):
        self.ring, self.rank, self.world, self.stream = ring, rank, ring.world, stream

    def send_recv(self, sends, recvs):
        self.ring._post(self.rank, sends, recvs)


# ----------------------------------------------------------------------------- the driver
#
# One rank's forward and backward (forward_rank, backward_rank) are generators: each posts its
# exchanges through the communicator and yields right after each post. A real communicator needs
# nothing at a yield (run() takes the generator to its end); the virtual ranks of a LoopbackRing are
# advanced in turns from one yield to the next (lockstep()), so that every rank has posted an
# exchange before any rank goes past it.

def accumulator(dtype):
    """Where partial results add up: float32 (float64 for float64 stand-ins in the CPU tests)."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def rows(x, slots, c, axis=1):
    """Rows of chunk slots ``[slots[0], slots[1])`` of a shard (a view)."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(slots[0] * c, slots[1] * c)
    return x[tuple(index)]


def run(driver):
    """Run one rank's driver to its end; its result."""
    while True:
        try:
            next(driver)
        except StopIteration as stop:
            return stop.value


def lockstep(drivers):
    """Run the drivers of all ranks of a ring in turns, each up to its next exchange; their results."""
    results, done = [None] * len(drivers), [False] * len(drivers)
    while not all(done):
        for r, driver in enumerate(drivers):
            try:
                next(driver)
            except StopIteration as stop:
                results[r], done[r] = stop.value, True
        if any(done) and not all(done):
            raise RuntimeError("the ranks of the ring posted different numbers of exchanges")
    return results


def _zero(*arrays):
    for x in arrays:
        x.fill(0)


def array_module(x):
    """The array module of ``x``: CuPy for a CuPy array, else NumPy (no GPU, nor CuPy, needed)."""
    if isinstance(x, np.ndarray):
        return np
    try:
        import cupy
    except ImportError:
        return np
    return cupy.get_array_module(x)


def _copy_into(dst, src):
    """dst[...] = src in dst's dtype, in one pass (a cast through a temporary array takes twice as
    long: 1.3 against 0.7 ms for 128M float32 into bfloat16 on an H200); 16-bit values of one dtype
    are copied as bits, whatever CuPy makes of bfloat16."""
    if dst.dtype == src.dtype and dst.dtype.itemsize == 2:
        dst.view(np.uint16)[...] = src.view(np.uint16)
    else:
        array_module(dst).copyto(dst, src, casting="unsafe")


def _add_into(dst, src):
    """dst += src, src cast to dst's dtype on the fly (one pass, as _copy_into)."""
    array_module(dst).add(dst, src, out=dst)


class _KvRing:
    """The keys and values in a rank's hand as they travel the ring, two spare buffers to receive
    the next ones into (allocated once per call), and the events that order the two streams."""

    def __init__(self, comm, dev, k, v):
        self.comm, self.dev = comm, dev
        self.compute = dev.current_stream()
        self.in_hand = (k, v)
        self.spares = [(dev.empty(k.shape, k.dtype), dev.empty(v.shape, v.dtype))
                       for _ in range(min(2, comm.world - 1))]
        # The compute stream's work so far: the inputs are written, no spare buffer is being read.
        # The driver moves it forward after each step's compute.
        self.reads_done = dev.record(self.compute)
        self._incoming = self._arrival = None

    def pass_on(self, step):
        """Post the exchange that brings step ``step + 1``'s keys and values: those in hand go to
        the next rank while the previous rank's come into a spare buffer, on the communicator's
        stream, behind the compute that last read that buffer (step ``step - 1``)."""
        spare = self.spares[step % 2]
        self.dev.wait(self.comm.stream, self.reads_done)
        self.comm.send_recv(self.in_hand, spare)
        yield
        self._arrival = self.dev.record(self.comm.stream)
        self._incoming = spare

    def take_incoming(self):
        """The received keys and values become those in hand; compute waits for their arrival."""
        self.in_hand = self._incoming
        self.dev.wait(self.compute, self._arrival)


class _RowParts:
    """The (out, lse) of every call of a rank's forward, side by side until one merge at the end.

    Slot ``i``'s ``j``-th part is its rows in ``outs[j]`` (B, 2c, Hq, D), in q's dtype, and in
    ``lses[j]`` (B, Hq, 2c). A call spanning both slots takes the next number of both (they are
    equal in the zigzag schedules); a number a slot skips or never reaches holds lse = -inf, which the
    merge skips without reading its out. Every part is written once by its call and read once by
    the one :func:`cuflash.merge_states` over the stack that gives the shard's result: 4 bytes an
    output element a step in bf16, where a running float32 state merged after each call moves ~10.
    Memory: a q-sized part per step (zigzag: ``world`` parts).
    """

    def __init__(self, dev, q, c, calls):
        b, _, hq, d = q.shape
        self.dev, self.compute, self.c = dev, dev.current_stream(), c
        self.number, empty, count = [], [], [0, 0]
        for call in (call for step in calls for call in step):
            slots = range(*call.q_slots)
            j = max(count[i] for i in slots)
            empty += [(n, i) for i in slots for n in range(count[i], j)]
            for i in slots:
                count[i] = j + 1
            self.number.append(j)
        n = max(count)
        empty += [(m, i) for i in range(2) for m in range(count[i], n)]
        self.outs = dev.empty((n, b, 2 * c, hq, d), q.dtype)
        self.lses = dev.empty((n, b, hq, 2 * c), accumulator(q.dtype))
        for m, i in empty:
            dev.launch(self.compute, _fill, rows(self.lses[m], (i, i + 1), c, axis=2), -np.inf)
        self.scratch = {}
        self.calls = 0

    def into(self, call):
        """Where the next call (in the driver's order) writes (out, lse): its rows of its part, or
        contiguous scratch for a view that is not (one slot of B > 1 rows, or of lse), moved into
        place by :meth:`settle`."""
        j = self.number[self.calls]
        self.calls += 1
        place = (rows(self.outs[j], call.q_slots, self.c), rows(self.lses[j], call.q_slots, self.c, axis=2))
        target = tuple(x if x.flags.c_contiguous else self._scratch(x) for x in place)
        return place, target

    def _scratch(self, x):
        key = (tuple(x.shape), x.dtype.str)
        if key not in self.scratch:
            self.scratch[key] = self.dev.empty(x.shape, x.dtype)
        return self.scratch[key]

    def settle(self, place, target):
        """Queue the moves of a call's scratch output into its part (the next call with the same
        scratch runs after them on the compute stream)."""
        for dst, src in zip(place, target):
            if dst is not src:
                self.dev.launch(self.compute, _copy_into, dst, src)

    def result(self):
        """The shard's (out, lse): one merge of all parts (the part itself when there is one)."""
        if self.outs.shape[0] == 1:
            return self.outs[0], self.lses[0]
        from ..merge import merge_states

        out = self.dev.empty(self.outs.shape[1:], self.outs.dtype)
        lse = self.dev.empty(self.lses.shape[1:], self.lses.dtype)
        self.dev.launch(self.compute, _merge_into, merge_states, self.outs, self.lses, out, lse)
        return out, lse


def _fill(x, value):
    x.fill(value)


def _merge_into(merge_states, outs, lses, out, lse):
    merge_states(outs, lses, out=out, lse=lse)


def _dropout_options(dropout, call, c, backward=False):
    """The keywords of a call under dropout (``dropout``: (p, (seed, offset)) or None): every call
    draws with the ring's one state, at the global position of its (one) chunk pair."""
    if dropout is None:
        return {}
    from ..random import Generator

    p, state = dropout
    origin = (call.chunks[0] * c, call.chunks[1] * c)
    if backward:
        return dict(dropout_p=p, rng_state=state, dropout_origin=origin)
    generator = Generator(0)   # a private one whose next draw is the ring's state
    generator.set_state(state)
    return dict(dropout_p=p, generator=generator, dropout_origin=origin)


def _forward_call(attention_forward, q, k, v, causal, scale, part, options):
    attention_forward(q, k, v, causal=causal, scale=scale, out=part[0], lse=part[1], **options)


def forward_rank(comm, dev, calls, q, k, v, *, scale, dropout=None):
    """One rank's ring forward over its shard (a generator, see the section); returns (out, lse).

    ``calls[s]``: the :class:`cuflash.distributed.RingCall` s of this rank's step ``s`` (one per
    chunk pair, with its ``chunks``, under ``dropout`` = (p, (seed, offset))).
    """
    from ..attention import _forward_at   # attention_forward, at a chunk pair's dropout origin

    world, c = comm.world, q.shape[1] // 2
    ring = _KvRing(comm, dev, k, v)
    parts = _RowParts(dev, q, c, calls)
    for step in range(world):
        last = step == world - 1
        if not last:
            yield from ring.pass_on(step)
        k_in, v_in = ring.in_hand
        for call in calls[step]:
            place, target = parts.into(call)
            dev.launch(ring.compute, _forward_call, _forward_at, rows(q, call.q_slots, c),
                       rows(k_in, call.k_slots, c), rows(v_in, call.k_slots, c), call.causal, scale, target,
                       _dropout_options(dropout, call, c))
            parts.settle(place, target)
        ring.reads_done = dev.record(ring.compute)
        if not last:
            ring.take_incoming()
    return parts.result()


def _backward_call(attention_backward, operands, causal, scale, grads, dq_rows, options):
    dq, dk, dv = grads
    attention_backward(*operands, causal=causal, scale=scale, dq=dq, dk=dk, dv=dv, **options)
    _add_into(dq_rows, dq)


def _add_kv_grads(sums, parts):
    for k_rows, dk, dv in parts:
        _add_into(k_rows(sums[0]), dk)
        _add_into(k_rows(sums[1]), dv)


def backward_rank(comm, dev, calls, dout, q, k, v, out, lse, *, scale, dropout=None):
    """One rank's ring backward over its shard (a generator, see the section); returns (dq, dk, dv).

    Each call gets the final ``out`` and ``lse`` rows of its queries, so the probabilities it
    recomputes, ``exp(s - lse)``, are those of the whole row, and ``rowsum(dout * out)`` is the
    whole row's: the calls' gradients add up exactly. dq adds up here; the dK/dV sums of the kv in
    hand arrive from the previous rank, get this rank's part, and move on with the kv. Under
    ``dropout`` each call regenerates its chunk pair's part of the forward's mask (as forward_rank).
    """
    from ..backward import _backward_at   # attention_backward, at a chunk pair's dropout origin

    world, c = comm.world, q.shape[1] // 2
    acc = accumulator(q.dtype)
    dq_sum = dev.empty(q.shape, acc)
    sums, spare = ((dev.empty(k.shape, acc), dev.empty(v.shape, acc)) for _ in range(2))
    ring = _KvRing(comm, dev, k, v)
    compute = ring.compute
    dev.launch(compute, _zero, dq_sum, *sums)
    lse_rows = _LseRows(dev, lse, c)
    scratch = {}

    def buffer(key, shape, dtype):
        if key not in scratch:
            scratch[key] = dev.empty(shape, dtype)
        return scratch[key]

    arrival = None   # of the dK/dV sums of the kv in hand (step 0: this rank's own, zero)
    added = None     # the compute that added this rank's part to the sums of the previous step

    def pass_sums():
        """Post the exchange that sends the sums just added to (with their kv, one step behind)
        and brings those of the kv now in hand."""
        nonlocal sums, spare, arrival
        dev.wait(comm.stream, added)
        comm.send_recv(sums, spare)
        yield
        arrival = dev.record(comm.stream)
        sums, spare = spare, sums

    for step in range(world):
        last = step == world - 1
        k_in, v_in = ring.in_hand
        parts = []
        for j, call in enumerate(calls[step]):
            nq, nk = (call.q_slots[1] - call.q_slots[0]) * c, (call.k_slots[1] - call.k_slots[0]) * c
            grads = (buffer(("dq", nq), (q.shape[0], nq) + q.shape[2:], q.dtype),
                     buffer(("dk", j, nk), (k.shape[0], nk) + k.shape[2:], k.dtype),
                     buffer(("dv", j, nk), (v.shape[0], nk) + v.shape[2:], v.dtype))
            operands = (rows(dout, call.q_slots, c), rows(q, call.q_slots, c), rows(k_in, call.k_slots, c),
                        rows(v_in, call.k_slots, c), rows(out, call.q_slots, c), lse_rows(call.q_slots))
            dev.launch(compute, _backward_call, _backward_at, operands, call.causal, scale, grads,
                       rows(dq_sum, call.q_slots, c), _dropout_options(dropout, call, c, backward=True))
            parts.append((lambda x, slots=call.k_slots: rows(x, slots, c), grads[1], grads[2]))
        # The step's exchanges are posted after its calls are queued: an NCCL kernel queued first
        # takes SMs before the backward's CTAs, and made a 64k-token bwd_sm90 call ~14% slower on an
        # H100 (82 -> 94 ms beside a 0.4 ms transfer; 84 ms with the transfer queued after it).
        if not last:
            yield from ring.pass_on(step)
        if step > 0:
            yield from pass_sums()
        ring.reads_done = dev.record(compute)
        # The calls above run while the sums are on their way; only adding to them waits.
        dev.wait(compute, arrival)
        dev.launch(compute, _add_kv_grads, sums, parts)
        added = dev.record(compute)
        if not last:
            ring.take_incoming()
    if world > 1:   # the last sums go home to their owner
        yield from pass_sums()
    grads = tuple(dev.empty(x.shape, q.dtype) for x in (q, k, v))
    dev.launch(compute, _copy_into, grads[0], dq_sum)   # complete: converted while dK/dV come home
    dev.wait(compute, arrival)
    for dst, src in zip(grads[1:], sums):
        dev.launch(compute, _copy_into, dst, src)
    return grads


class _LseRows:
    """lse rows of a call's query slots, packed (B, Hq, rows): the shard's lse itself for both
    chunks when it is packed, otherwise a copy made once per call of the driver."""

    def __init__(self, dev, lse, c):
        self.dev, self.lse, self.c, self.copies = dev, lse, c, {}

    def __call__(self, slots):
        if slots == (0, 2) and self.lse.flags.c_contiguous:
            return self.lse
        if slots not in self.copies:
            packed = rows(self.lse, slots, self.c, axis=2)
            copy = self.copies[slots] = self.dev.empty(packed.shape, packed.dtype)
            self.dev.launch(self.dev.current_stream(), _copy_into, copy, packed)
        return self.copies[slots]
