"""A CuPy stream over a CUDA stream that another library made (torch's, a communicator's).

CuPy 14 reads foreign streams through the CUDA stream protocol (``cupy.cuda.Stream.from_external``
takes any object whose ``__cuda_stream__()`` returns ``(0, handle)``) and deprecates
``cupy.cuda.ExternalStream``. The adapters hold raw handles (torch's current stream is read as an
integer, the cheapest way), so they hand CuPy this small wrapper. Importing it imports no framework.
"""

from __future__ import annotations

from .._build.cuda_status import import_cupy

cupy = import_cupy()   # a missing CuPy says which extra to install

__all__ = ["cupy_stream"]


class _RawStream:
    """A raw ``cudaStream_t`` speaking the CUDA stream protocol."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def cupy_stream(handle: int) -> cupy.cuda.Stream:
    """A CuPy stream over the CUDA stream ``handle``, which it does not own: the caller keeps that
    stream alive while the CuPy stream is in use. It does not know its device, so use it inside
    ``cupy.cuda.Device(<the stream's device>)``."""
    return cupy.cuda.Stream.from_external(_RawStream(handle))
