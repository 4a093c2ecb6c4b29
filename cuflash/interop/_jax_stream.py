"""XLA's CUDA stream as CuPy's current stream, inside a JAX ``buffer_callback``.

The callback's execution context names the stream XLA runs the surrounding computation on
(``ctx.stream``, a raw ``cudaStream_t``); cuflash launches on CuPy's current stream, so each call
makes a CuPy stream over XLA's the current one (:class:`on_xla_stream`), and cuflash's kernels
order with XLA's own work exactly as an XLA kernel would: no event, no copy, no host
synchronisation. The CuPy stream is made once per XLA stream and kept.

When XLA records the callback into a CUDA graph (``command_buffer_compatible=True``) the stream is
capturing; cuflash itself makes what a first call on a stream needs (its words, arena, split
counters) and loads its kernels outside the capture (:mod:`cuflash._runtime.now`), so nothing more
is done here. Importing this module imports CuPy, not JAX.
"""

from __future__ import annotations

from .._build.cuda_status import import_cupy

cupy = import_cupy()   # a missing CuPy says which extra to install

from ._cupy_stream import cupy_stream  # noqa: E402

__all__ = ["on_xla_stream"]

_streams: dict = {}   # XLA's raw stream -> (device id, the CuPy stream over it), kept for the process


def _handle(ctx) -> int:
    """``ctx.stream``: a property in recent jaxlib, a method in earlier ones."""
    stream = ctx.stream
    return stream if type(stream) is int else stream()


class on_xla_stream:
    """``with on_xla_stream(ctx, buffer) as where:`` makes XLA's stream of ``ctx`` and its device (that
    of ``buffer``, one of the callback's buffers) CuPy's current ones for the block; ``where.device``
    is the device id."""

    __slots__ = ("device", "_device", "_stream")

    def __init__(self, ctx, buffer):
        handle = _handle(ctx)
        entry = _streams.get(handle)
        if entry is None:   # a stream runs on one device: read it from a buffer once
            device = int(buffer.__dlpack_device__()[1])
            entry = _streams[handle] = (device, cupy_stream(handle))
        self.device = entry[0]
        self._device = cupy.cuda.Device(entry[0])
        self._stream = entry[1]

    def __enter__(self):
        self._device.__enter__()
        self._stream.__enter__()
        return self

    def __exit__(self, *exc):
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)
        return False
