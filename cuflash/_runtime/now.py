"""Set-up work done now, even when the calling thread's stream is capturing a CUDA graph.

A call sometimes needs memory that outlives it and holds known values before its kernels run: a
stream's words (made at the first call on the stream, zeroed), larger split counters, the arena, a
plan's workspace on a stream, a generator's graph state (written from the host), a kernel loaded.
Under a capture that work would fail or be recorded instead of done: a capture in global mode
(``torch.cuda.graph``'s default) forbids ``cudaMalloc`` and ``cudaHostAlloc`` on the capturing
thread, and a memset on the capturing stream becomes a graph node that runs only at replay, so an
uncaptured call on that stream would find its words never zeroed.

:func:`done_now` runs such work with the thread's capture mode relaxed (as torch's caching
allocator does around its own ``cudaMalloc``), on a private non-blocking stream of the device with
CuPy's own memory pool (never a framework's allocator, whose capture-time blocks belong to the
graph), and waits for it: when the block exits, the memory exists and holds its values, whichever
stream is capturing. This is why a capture needs no warm-up call on its own stream. The wait is for
a few bytes' memset, once per stream or per plan and stream, never on a repeat call's path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

from cuflash._build.cuda_status import import_cupy

__all__ = ["done_now", "relaxed_capture_mode"]

_RELAXED = 2   # CU_STREAM_CAPTURE_MODE_RELAXED (cuda.h)

_side_streams: dict = {}   # device id -> the private stream set-up work runs on


@functools.lru_cache(maxsize=1)
def _exchange_capture_mode():
    fn = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
    return fn


@contextlib.contextmanager
def relaxed_capture_mode():
    """The calling thread may make the calls that a capture in global or thread-local mode forbids
    (allocations, module loads, waits on other streams) for the block; its mode is restored after."""
    exchange = _exchange_capture_mode()
    mode = ctypes.c_int(_RELAXED)
    rc = exchange(ctypes.byref(mode))
    if rc != 0:
        raise RuntimeError(f"cuThreadExchangeStreamCaptureMode failed with CUresult {rc}")
    try:
        yield
    finally:
        exchange(ctypes.byref(mode))


@contextlib.contextmanager
def done_now(device_id: int):
    """Inside the block, CuPy's current device is ``device_id``, its current stream a private one
    that no capture records, and its allocator its default pool; at exit the block's work on that
    stream is finished."""
    cupy = import_cupy()
    with relaxed_capture_mode(), cupy.cuda.Device(device_id):
        stream = _side_streams.get(device_id)
        if stream is None:   # two threads may both make one; either serves
            stream = _side_streams[device_id] = cupy.cuda.Stream(non_blocking=True)
        with stream, cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
            yield
        stream.synchronize()
