"""Launching kernels, and the state that launches on one CUDA stream share.

Kernels are launched through the driver (``cuLaunchKernel`` via CuPy's binding) with arguments that
a plan has already laid out: a call costs a copy of the packed bytes and one driver call, not CuPy's
per-argument conversion.

What launches share belongs to one real stream (:class:`StreamState`): the persistent kernels'
work counter, the verdict word of the index check, and the host-visible fault reports. The
stream's pointer alone does not name a real stream: every thread's per-thread default stream has
the same handle (``cudaStreamPerThread``), so for it the thread is part of the key.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import struct
import threading

import numpy as np

from cuflash._build.cuda_status import import_cupy
from cuflash._runtime.now import done_now, relaxed_capture_mode

__all__ = ["launch", "address", "sm_count", "max_smem_per_block", "ctas_per_sm", "prepare_kernel", "stream_state",
           "StreamState", "current_stream_ptr", "forcing", "REPORT_SLOTS"]

PER_THREAD_STREAM = 2   # cudaStreamPerThread


def _cupy():
    return import_cupy()   # a missing CuPy says which extra to install


def device_id() -> int:
    """CuPy's current device."""
    return _cupy().cuda.runtime.getDevice()


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    """Multiprocessors of a device (persistent grids and split heuristics size themselves by it)."""
    runtime = _cupy().cuda.runtime
    return int(runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device_id))


@functools.lru_cache(maxsize=None)
def max_smem_per_block(device_id: int) -> int:
    """Opt-in shared memory per block of a device (bytes)."""
    runtime = _cupy().cuda.runtime
    return int(runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id))


@functools.lru_cache(maxsize=None)
def ctas_per_sm(func: int, threads: int, smem_bytes: int) -> int:
    """CTAs of kernel ``func`` (a function pointer of the current device) that one multiprocessor
    holds at once with this launch shape: the driver's occupancy calculator, at least 1."""
    occupancy = _cupy().cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(func, threads, smem_bytes)
    return max(1, int(occupancy))


_prepared: dict = {}   # (kernel function pointer, device) -> dynamic shared memory allowed


def prepare_kernel(kernel, smem_bytes: int, device_id: int, carveout: int | None = None) -> int:
    """The kernel's function pointer on device ``device_id``, after raising its dynamic shared-memory
    limit to ``smem_bytes`` (and setting a carveout preference); done at plan time, once per kernel
    and device.

    A ``cupy.RawKernel`` holds one function per device (``kernel.kernel`` is the current device's,
    loaded there at its first use), and its attributes are set on that function: a limit raised on
    one GPU is not raised on another. So everything here happens with ``device_id`` current, and
    the record of what was done is keyed by (function, device).
    """
    runtime = _cupy().cuda.runtime
    if runtime.getDevice() != device_id:
        with _cupy().cuda.Device(device_id):
            return prepare_kernel(kernel, smem_bytes, device_id, carveout)
    # The first use loads the module, which a capture in global mode may refuse.
    with relaxed_capture_mode():
        ptr = kernel.kernel.ptr
    key = (ptr, device_id)
    if smem_bytes > _prepared.get(key, 48 * 1024):
        if kernel.max_dynamic_shared_size_bytes < smem_bytes:
            kernel.max_dynamic_shared_size_bytes = smem_bytes
        _prepared[key] = smem_bytes
    if carveout is not None and (key, "carveout") not in _prepared:
        try:
            kernel.preferred_shared_memory_carveout = carveout
        except Exception:  # a hint only; the launch works without it
            pass
        _prepared[(key, "carveout")] = carveout
    return ptr


_driver_launch = None     # cupy_backends' cuLaunchKernel binding, bound at the first launch
_current_stream = None


# cuLaunchKernelEx's CUlaunchConfig (grid, block, shared memory, stream, attributes, their count)
# and one CUlaunchAttribute: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6) = allowed.
# Layouts as cuda.h 13.0 declares them (56 and 72 bytes).
_LAUNCH_CONFIG = struct.Struct("<7I4xQQI4x")
_DEPENDENT = ctypes.create_string_buffer(struct.pack("<i4xi60x", 6, 1), 72)   # read-only, shared


@functools.lru_cache(maxsize=1)
def _launch_kernel_ex():
    fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def address(block: bytearray) -> int:
    """The address of a bytearray's bytes (valid while it lives and is not resized)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(block))


@functools.lru_cache(maxsize=256)
def _dependent_config(grid, threads: int, smem_bytes: int, stream_ptr: int):
    """A CUlaunchConfig for a programmatic dependent launch (read-only once made: shared)."""
    return ctypes.create_string_buffer(_LAUNCH_CONFIG.pack(grid[0], grid[1], grid[2], threads, 1, 1, smem_bytes,
                                                           stream_ptr, ctypes.addressof(_DEPENDENT), 1), 56)


def launch(func: int, grid, threads: int, smem_bytes: int, argv: int, stream_ptr: int, dependent: bool = False) -> None:
    """Launch ``func`` on ``stream_ptr``. ``argv`` is the address of the kernel's argument pointer
    array (``kernelParams``: one pointer per parameter, to its bytes; see :class:`cuflash._runtime.step.Step`).
    The driver copies the values at the call, so the memory is free once it returns.

    ``dependent``: a programmatic dependent launch (sm_90): the kernel may start before the previous
    kernel in the stream ends and waits for it in ``griddepcontrol.wait`` (cuda_src/fault.cuh). Only
    for a kernel whose predecessor is a kernel of the same call.
    """
    global _driver_launch
    if dependent:
        rc = _launch_kernel_ex()(_dependent_config(grid, threads, smem_bytes, stream_ptr), func, argv, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")
        return
    if _driver_launch is None:
        _driver_launch = _cupy().cuda.driver.launchKernel
    _driver_launch(func, grid[0], grid[1], grid[2], threads, 1, 1, smem_bytes, stream_ptr, argv, 0)


def current_stream_ptr(device_id: int = -1) -> int:
    """The handle of CuPy's current stream on ``device_id`` (-1: the current device). A caller that
    knows the current device passes it, which spares CuPy a getDevice call (~0.2 us)."""
    global _current_stream
    if _current_stream is None:
        _current_stream = _cupy().cuda.get_current_stream
    return _current_stream(device_id).ptr


# Fault reports: one slot of 4 int32 (code, index, value, spare) per entry point that checks index
# arrays on the GPU, in pinned host memory that the check kernel writes and the host reads without
# synchronising (a fault shows at a later call, the way CUDA reports asynchronous errors).
REPORT_SLOTS = {"decode": 0, "attention_varlen": 1, "attention_varlen_backward": 2}

# Calls whose temporaries take at most this many bytes take them from their stream's arena instead
# of CuPy's pool (~1 us of host time a call): their kernels are short, so the host time is what the
# user waits for. Larger temporaries belong to kernels that run far longer than an allocation.
ARENA_BYTES = 2 << 20   # a power of two (StreamState.arena)


class StreamState:
    """The device words and fault reports of one real stream on one device.

    ``counter``: zeroed int32 the persistent kernels take work items from (each launch leaves it at
    0); ``error``: the verdict of the call's index check; ``scratch``: the check kernel's two words;
    :meth:`split_counters`: zeroed counters of finished splits (split-KV decode, left at 0).
    ``reports``: the host-mapped fault slots, and ``plans``: the plan of the last checked call of
    each slot (its shapes word the error message). :meth:`arena`: the small temporaries of calls on
    this stream, and ``tails``: plan -> what its calls here pass after their operands (the
    temporaries' pointers and the stream's words, see :meth:`cuflash._runtime.plan.Plan.run`), made once.

    ``reports_of``: the state whose fault reports (and their plans) this one shares; a captured
    call's own state (:func:`cuflash._runtime.capture.call_state`) reports to its stream's.
    """

    def __init__(self, device_id: int, reports_of: StreamState | None = None):
        cupy = _cupy()
        runtime = cupy.cuda.runtime
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            self._words = cupy.zeros(8, dtype=np.int32)
        base = self._words.data.ptr
        self.counter, self.error, self.scratch = base, base + 4, base + 8
        if reports_of is not None:
            self._host, self.reports, self.plans = reports_of._host, reports_of.reports, reports_of.plans
        else:
            nbytes = 16 * len(REPORT_SLOTS)
            # Mapped and portable: with unified addressing the host pointer is also the device pointer.
            self._host = runtime.hostAlloc(nbytes, runtime.hostAllocMapped | runtime.hostAllocPortable)
            ctypes.memset(self._host, 0, nbytes)
            self.reports = (ctypes.c_int32 * (4 * len(REPORT_SLOTS))).from_address(self._host)
            self.plans = [None] * len(REPORT_SLOTS)
        self._workspaces = {}   # plan -> its temporaries on this stream
        with cupy.cuda.Device(device_id):
            self._counters = cupy.zeros(1024, dtype=np.int32)
        self._old_counters = []
        self._arena, self._arena_bytes, self._old_arenas = None, 0, []
        self.tails = {}
        self.spares = {}   # (plan, output index) -> its outputs to hand out again (recycled.py)

    def split_counters(self, n: int) -> int:
        """The address of at least ``n`` zeroed int32 counters (kernels leave them at zero). A larger
        request makes a new zeroed array, done before this returns; the old one stays alive (kernels
        already queued, or a captured graph, may still use it)."""
        if n > self._counters.size:
            size = max(n, 2 * self._counters.size)
            self._old_counters.append(self._counters)
            with done_now(self.device_id):   # zeroed before any later launch, even under a capture
                self._counters = _cupy().zeros(size, dtype=np.int32)
            self.tails.clear()
        return self._counters.data.ptr

    def arena(self, nbytes: int):
        """A MemoryPointer to at least ``nbytes`` (<= ARENA_BYTES) bytes for the temporaries of one
        call at a time on this stream: the stream runs its calls one after the other, so each may
        use it whole. A larger request replaces it by one of the next power of two; the old one is
        kept (a captured graph may still use it), so all of them together stay under 2 * ARENA_BYTES."""
        if nbytes > self._arena_bytes:
            size = max(1 << (nbytes - 1).bit_length(), 64 << 10)
            with done_now(self.device_id):
                arena = _cupy().cuda.alloc(size)
            if self._arena is not None:
                self._old_arenas.append(self._arena)
            self._arena, self._arena_bytes = arena, size
            self.tails.clear()
        return self._arena

    def workspace(self, plan):
        """Temporaries of ``plan`` kept by this stream (for streams whose freed memory CuPy's pool
        cannot tell apart: the per-thread default streams)."""
        temps = self._workspaces.get(plan)
        if temps is None:
            with done_now(self.device_id):
                temps = self._workspaces[plan] = [b.make() for b in plan.temps]
        return temps

    def report_ptr(self, slot: int) -> int:
        return self._host + 16 * slot

    def take_fault(self, slot: int):
        """(code, index, value, plan) of a fault reported in ``slot``, cleared; or None."""
        words = self.reports
        code = words[4 * slot]
        if code == 0:
            return None
        fault = (code, words[4 * slot + 1], words[4 * slot + 2], self.plans[slot])
        for i in range(4):
            words[4 * slot + i] = 0
        return fault


_states: dict = {}             # (device, stream, thread token) -> StreamState, kept for the process
_thread_states = threading.local()
_states_lock = threading.Lock()


def _thread_token():
    """An object unique to the calling thread (thread idents are reused once a thread ends, and a
    dead thread's stream may still be running its kernels); the keys of ``_states`` keep it alive,
    so it is never reused either."""
    token = getattr(_thread_states, "token", None)
    if token is None:
        token = _thread_states.token = object()
    return token


def stream_key(device_id: int, stream_ptr: int):
    return (device_id, stream_ptr, _thread_token() if stream_ptr == PER_THREAD_STREAM else None)


def stream_state(device_id: int, stream_ptr: int) -> StreamState:
    """The shared state of a real stream (created on first use, also inside a capture: see
    :mod:`cuflash._runtime.now`; kept for the process)."""
    # stream_key(), written out: this runs at every call.
    key = (device_id, stream_ptr, _thread_token() if stream_ptr == PER_THREAD_STREAM else None)
    state = _states.get(key)
    if state is None:
        with _states_lock:
            state = _states.get(key)
            if state is None:
                with done_now(device_id):
                    state = _states[key] = StreamState(device_id)
    return state


def all_stream_states():
    return list(_states.values())


@contextlib.contextmanager
def forcing(forced, family: str, families: tuple[str, ...]):
    """Set the context variable ``forced`` to ``family`` for the block (the force_kernel contexts)."""
    if family not in families:
        raise ValueError(f"family must be one of {families}, got {family!r}")
    token = forced.set(family)
    try:
        yield
    finally:
        forced.reset(token)
