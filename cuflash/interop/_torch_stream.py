"""Where a cuflash call made from torch runs: torch's current stream, and torch's memory.

Two contexts:

- :func:`on_torch_stream`: CuPy's current device and stream become torch's, so cuflash's kernels
  order with the surrounding torch work exactly as a torch operator's would (ring attention,
  :mod:`cuflash.interop._torch_ring`).
- :func:`torch_call`: that, and every allocation cuflash makes during the call (outputs it was not
  given, split-KV partials, backward accumulators, padded copies) comes from torch's caching
  allocator instead of CuPy's pool. Inside ``torch.cuda.graph`` capture this is what keeps a
  captured kernel's memory valid: torch gives capture-time allocations from the graph's private
  pool and keeps them for the replays, while a block of CuPy's pool freed at the end of the call
  would be handed to other work and overwritten under the replaying graph. Outside capture the
  two pools stop competing for the GPU's memory. Used by :mod:`cuflash.interop.torch` and the
  custom ops (:mod:`cuflash.interop._torch_ops`).

:func:`replay` is the repeat call's short way: no context, only torch's allocator.

The state cuflash keeps per stream (:class:`cuflash._runtime.launch.StreamState`) is made by the
core at the first call on a stream, also inside a capture (:mod:`cuflash._runtime.now`): a warm-up
call on any stream, or none, is all ``torch.cuda.graph`` needs.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .._build.cuda_status import import_cupy

cupy = import_cupy()   # a missing CuPy says which extra to install

from ._cupy_stream import cupy_stream

__all__ = ["as_torch", "on_torch_stream", "replay", "torch_call"]

_streams: dict = {}   # (device, torch's raw stream) -> the CuPy stream over it


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _raw_stream(index: int) -> int:
    try:
        return torch._C._cuda_getCurrentRawStream(index)
    except AttributeError:  # other torch builds
        return torch.cuda.current_stream(index).cuda_stream


def _external_stream(index: int, raw: int):
    stream = _streams.get((index, raw))
    if stream is None:
        stream = _streams[(index, raw)] = cupy_stream(raw)
    return stream


@contextlib.contextmanager
def on_torch_stream(device: torch.device):
    """CuPy's current device and stream become torch's current ones for ``device``."""
    index = _device_index(device)
    with cupy.cuda.Device(index), _external_stream(index, _raw_stream(index)):
        yield


class torch_call:
    """:func:`on_torch_stream`, with cuflash's allocations taken from torch's caching allocator.

    A class rather than a generator context, and CuPy's thread-local allocator set directly rather
    than through ``cupy.cuda.using_allocator`` (a generator context too): it runs twice per autograd
    step, and each microsecond is host time the user waits for (the CuPy device is switched only
    when it differs)."""

    __slots__ = ("_device", "_stream", "_allocator", "_previous")

    def __init__(self, device: torch.device):
        index = _device_index(device)
        raw = _raw_stream(index)
        if _cupy_device() == index:
            self._device = None
            # CuPy's current stream is already torch's (both the default stream, most often): entering
            # and leaving a CuPy stream costs 1.3 us on an H200's host, the comparison 0.2.
            self._stream = None if _cupy_stream_ptr(index) == raw else _external_stream(index, raw)
        else:
            self._device, self._stream = cupy.cuda.Device(index), _external_stream(index, raw)
        self._allocator = _allocator(index)

    def __enter__(self):
        if self._device is not None:
            self._device.__enter__()
        if self._stream is not None:
            self._stream.__enter__()
        self._previous = _get_allocator()
        _set_allocator(self._allocator)

    def __exit__(self, *exc):
        _set_allocator(self._previous)
        if self._stream is not None:
            self._stream.__exit__(*exc)
        if self._device is not None:
            self._device.__exit__(*exc)
        return False


def replay(body, *args):
    """``body(*args)``, a cuflash call's body given ``replay_only`` (``cuflash.attention._forward``,
    ``cuflash.backward._backward``, ``cuflash.decode._decode``), with torch's caching allocator: the
    call's results when it repeats a remembered plan, else None, having done nothing (make it inside
    :class:`torch_call` then).

    A plan is replayed only when torch's current stream on the tensors' device is CuPy's current stream
    and the current device is the one it was made on (the plan memo's lookup), which is what
    :class:`torch_call` would have set; what a replay may allocate (temporaries past the stream's arena,
    a capture's own state) still comes from torch. Making the torch_call (reading both frameworks'
    devices and streams) was 6-12% of ``ct.attention``'s autograd step's host time on an H200
    (docs/decisions.md#torch-the-autograd-steps-host-time)."""
    previous = _get_allocator()
    _set_allocator(_on_current_device)
    try:
        return body(*args)
    finally:
        _set_allocator(previous)


def _on_current_device(nbytes: int):
    """:func:`_allocator` of the current device (a replay's: the tensors')."""
    return _allocator(_cupy_device())(nbytes)


# What cupy.cuda.using_allocator does around its block (CuPy 13-14).
_get_allocator = cupy.cuda.memory._get_thread_local_allocator
_set_allocator = cupy.cuda.memory._set_thread_local_allocator


_cupy_device = cupy.cuda.runtime.getDevice


def _cupy_stream_ptr(index: int) -> int:
    return cupy.cuda.get_current_stream(index).ptr


@functools.lru_cache(maxsize=None)
def _allocator(index: int):
    """A CuPy allocator (bytes -> MemoryPointer) that takes each block from torch's caching allocator
    on torch's current stream; the block goes back to torch when CuPy drops the pointer, after the
    call's kernels were queued on that same stream (torch's own stream-ordered reuse)."""
    device = torch.device("cuda", index)
    empty, uint8 = torch.empty, torch.uint8
    pointer, memory = cupy.cuda.MemoryPointer, cupy.cuda.UnownedMemory

    def allocate(nbytes: int):
        block = empty(nbytes, dtype=uint8, device=device)
        return pointer(memory(block.data_ptr(), nbytes, block, index), 0)

    return allocate


def as_torch(x) -> torch.Tensor:
    """A CuPy array that cuflash allocated inside :func:`torch_call` as a torch view of torch's block
    (no DLPack exchange, no event between streams); any other array through ``torch.from_dlpack``."""
    owner = getattr(x.data.mem, "_owner", None)
    dtype = _TORCH_DTYPES.get(x.dtype.name)
    if isinstance(owner, torch.Tensor) and dtype is not None and x.size:
        start, step = x.data.ptr - owner.data_ptr(), x.itemsize
        span = step + sum((n - 1) * s for n, s in zip(x.shape, x.strides))
        if start >= 0 and start % step == 0 and all(s >= 0 and s % step == 0 for s in x.strides) \
                and start + span <= owner.numel():
            flat = owner[start:start + span].view(dtype)
            return flat.as_strided(x.shape, tuple(s // step for s in x.strides))
    return torch.from_dlpack(x)


_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
