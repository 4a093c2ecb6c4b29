"""XLA's buffers as CuPy arrays, inside a JAX ``buffer_callback``.

The callback gets ``jax.experimental.buffer_callback.Buffer`` objects: device memory that XLA owns
for the duration of the call, with ``__cuda_array_interface__``. cuflash takes CuPy arrays (its
memo of plans reads a CuPy array's layout and pointer in a few hundred nanoseconds), so each buffer
becomes a CuPy view of the same memory, of the shape and dtype fixed when the call was traced.
Making a view costs microseconds (CuPy's ``UnownedMemory`` and ``ndarray``); XLA hands a compiled
program the same addresses from run to run as long as its buffer assignment holds, so the views are
remembered by address: a repeat call reads one pointer per buffer and finds its view.
A remembered view owns nothing: it is only used again for a buffer at the same address, then live.

Float8 buffers (an fp8 KV cache, ``jnp.float8_e4m3fn``) become uint8 views of their bytes, which is how
cuflash takes them (CuPy has no float8 dtype). XLA's ``__cuda_array_interface__`` has no typestr for
float8 types (it raises "Unimplemented primitive type"), so their address is read from the buffer's
DLPack capsule instead (``DLManagedTensor.dl_tensor.data``; the capsule frees itself), falling back on
the interface should a JAX's DLPack not know the type.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np

from .._build.cuda_status import import_cupy

cupy = import_cupy()   # a missing CuPy says which extra to install

__all__ = ["Views", "poison"]

#: Tests set this: every output buffer that cuflash is to write is filled with NaN bytes (0xFF) before
#: the launch, so that an element the kernels never write fails the comparison with the reference.
POISON = False

_VIEWS_PER_BUFFER = 64   # addresses remembered per buffer position (a compiled program uses a few)

#: Buffer dtypes viewed as their bytes (uint8): cuflash reads them so (decode's kv_dtype).
BYTE_DTYPES = frozenset({np.dtype(ml_dtypes.float8_e4m3fn)})

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)


def address(buffer) -> int:
    """The device address of an XLA buffer, by its ``__cuda_array_interface__``."""
    return buffer.__cuda_array_interface__["data"][0]


def byte_address(buffer) -> int:
    """The device address of an XLA buffer whose dtype ``__cuda_array_interface__`` cannot name
    (float8): the ``data`` field of its DLPack tensor (the first field of the unversioned
    ``DLManagedTensor``; XLA's has no byte offset). The interface when DLPack cannot name it either."""
    try:
        capsule = buffer.__dlpack__()
    except Exception:  # a DLPack without float8 codes
        return address(buffer)
    return ctypes.c_void_p.from_address(_capsule_pointer(capsule, b"dltensor")).value or 0


class Views:
    """The CuPy views of the buffers at one position list of a callback (its inputs, or its outputs),
    laid out as ``layouts`` = ((shape, dtype), ...) said at trace time; a float8 layout (BYTE_DTYPES)
    gives a uint8 view of the bytes."""

    __slots__ = ("_layouts", "_seen", "_addresses")

    def __init__(self, layouts):
        layouts = tuple((tuple(shape), np.dtype(dtype)) for shape, dtype in layouts)
        # None: the interface, read inline (the common case, a function call less per buffer).
        self._addresses = tuple(byte_address if dtype in BYTE_DTYPES else None for _, dtype in layouts)
        self._layouts = tuple((shape, np.dtype(np.uint8) if dtype in BYTE_DTYPES else dtype)
                              for shape, dtype in layouts)
        self._seen = [{} for _ in self._layouts]

    def __call__(self, buffers, device: int) -> list:
        """The views of ``buffers`` (in the order of the layouts) on ``device``."""
        views = []
        for buffer, seen, layout, read in zip(buffers, self._seen, self._layouts, self._addresses):
            ptr = buffer.__cuda_array_interface__["data"][0] if read is None else read(buffer)
            view = seen.get(ptr)
            if view is None:
                if len(seen) >= _VIEWS_PER_BUFFER:
                    seen.clear()
                view = seen[ptr] = _view(ptr, layout[0], layout[1], device)
            views.append(view)
        return views


def _view(ptr: int, shape: tuple, dtype: np.dtype, device: int):
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    memory = cupy.cuda.UnownedMemory(ptr, nbytes, None, device)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))


def poison(arrays) -> None:
    """Fill ``arrays`` with 0xFF bytes on CuPy's current stream (NaN in float16, bfloat16, float32)."""
    stream = cupy.cuda.get_current_stream().ptr
    for x in arrays:
        if x.nbytes:
            cupy.cuda.runtime.memsetAsync(x.data.ptr, 0xFF, x.nbytes, stream)
