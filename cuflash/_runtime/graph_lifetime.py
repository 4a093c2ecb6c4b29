"""Host objects kept alive exactly as long as the CUDA graph that a stream is capturing.

A call captured in a graph gets state of its own (:func:`cuflash._runtime.capture.call_state`), which
every replay uses, so it must live as long as the graph and every graph made from it: executable
graphs, and copies of it (XLA adds each traced call to its command buffer as a child graph, which
copies the graph). CUDA tracks exactly that with a user object: a reference owned by the graph
passes to every copy and executable graph, and the last one released, after the launches still
running, calls the object's destructor.

The destructor runs on a CUDA thread and may not call CUDA, and a Python callback there could
run into an interpreter that is shutting down. So the destructor is ``sem_post`` on a semaphore of
the kept object, and the objects whose semaphore was posted are dropped at the next capture
(:func:`keep_with_capture`): their memory returns to CuPy's pool then, with no CUDA call in between.
"""

from __future__ import annotations

import ctypes
import functools
import threading

__all__ = ["keep_with_capture", "kept_count"]

_NO_DESTRUCTOR_SYNC = 1   # CU_USER_OBJECT_NO_DESTRUCTOR_SYNC: the only flag cuUserObjectCreate takes
_MOVE = 1                 # CU_GRAPH_USER_OBJECT_MOVE: the graph takes over the creator's reference
_ACTIVE = 1               # CU_STREAM_CAPTURE_STATUS_ACTIVE
_SEM_BYTES = 64           # sem_t: 32 bytes in 64-bit glibc and musl; room to spare

_kept: list = []          # (semaphore, object) of each capture whose graph may still exist
_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _api():
    cuda, libc = ctypes.CDLL("libcuda.so.1"), ctypes.CDLL(None)
    pointer, c_int, c_uint = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint
    try:   # CUDA 13's signature has the dependencies' edge data between the nodes and their count
        info, extra = cuda.cuStreamGetCaptureInfo_v3, (None,)
        info.argtypes = [pointer, ctypes.POINTER(c_int), pointer, ctypes.POINTER(pointer), pointer, pointer, pointer]
    except AttributeError:
        info, extra = cuda.cuStreamGetCaptureInfo_v2, ()
        info.argtypes = [pointer, ctypes.POINTER(c_int), pointer, ctypes.POINTER(pointer), pointer, pointer]
    create, retain, release = cuda.cuUserObjectCreate, cuda.cuGraphRetainUserObject, cuda.cuUserObjectRelease
    create.argtypes = [ctypes.POINTER(pointer), pointer, pointer, c_uint, c_uint]
    retain.argtypes = [pointer, pointer, c_uint, c_uint]
    release.argtypes = [pointer, c_uint]
    for fn in (info, create, retain, release):
        fn.restype = c_int
    for name in ("sem_init", "sem_trywait", "sem_destroy"):
        getattr(libc, name).restype = c_int
    libc.sem_init.argtypes = [pointer, c_int, c_uint]
    post = ctypes.cast(libc.sem_post, pointer).value   # the destructor: int sem_post(sem_t *), its result unused
    return info, extra, create, retain, release, post, libc


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUresult {rc}")


def keep_with_capture(stream: int, obj) -> None:
    """Keep ``obj`` until the graph that ``stream`` is capturing, and every graph and executable graph
    made from it, is destroyed and their launches have finished."""
    info, extra, create, retain, release, post, libc = _api()
    _drop_released()
    status, graph = ctypes.c_int(), ctypes.c_void_p()
    _check(info(stream, ctypes.byref(status), None, ctypes.byref(graph), None, *extra, None), "cuStreamGetCaptureInfo")
    if status.value != _ACTIVE:
        raise RuntimeError("keep_with_capture needs a stream that is capturing a CUDA graph")
    semaphore = ctypes.create_string_buffer(_SEM_BYTES)
    if libc.sem_init(semaphore, 0, 0) != 0:
        raise RuntimeError("sem_init failed")
    user = ctypes.c_void_p()
    _check(create(ctypes.byref(user), ctypes.addressof(semaphore), post, 1, _NO_DESTRUCTOR_SYNC), "cuUserObjectCreate")
    rc = retain(graph, user, 1, _MOVE)
    if rc != 0:
        release(user, 1)   # runs the destructor at once: nothing was kept
        _check(rc, "cuGraphRetainUserObject")
    with _lock:
        _kept.append((semaphore, obj))


def _drop_released() -> None:
    """Drop the objects whose graphs are gone (their destructors posted their semaphores)."""
    libc = _api()[-1]
    with _lock:
        alive = []
        for semaphore, obj in _kept:
            if libc.sem_trywait(semaphore) == 0:
                libc.sem_destroy(semaphore)
            else:
                alive.append((semaphore, obj))
        _kept[:] = alive


def kept_count() -> int:
    """How many captures' objects are kept now (the released ones dropped first); for tests."""
    _drop_released()
    return len(_kept)
