"""TMA tensor maps (CUtensorMap) for the Hopper kernels, encoded through the CUDA driver.

A map describes a (B, S, H, D) array as a 4-d tensor (innermost first: D, S, H, B) with the
caller's strides, read in boxes of 64 columns (128 bytes, the span of the 128-byte swizzle) x
``box_rows`` rows of one head. Coordinates past the extent read as zeros, which is how tails
never reach a result. The map travels to the kernel by value: its 128 bytes are one kernel
parameter of the launch (cuflash/_launch.py), like the packed parameter struct.
"""

from __future__ import annotations

import ctypes
import functools

_FLOAT16, _BFLOAT16 = 6, 9  # CU_TENSOR_MAP_DATA_TYPE_*
_SWIZZLE_128B = 3
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


class TensorMapSpec(tuple):
    """What a tensor map depends on besides the address: (shape, byte strides, nbytes, box rows,
    dtype name). Made once per plan; maps are then cached by (address, spec)."""

    __slots__ = ()

    def __new__(cls, x, box_rows: int, dtype_name: str):
        return super().__new__(cls, (tuple(x.shape), tuple(x.strides), int(x.nbytes), int(box_rows), dtype_name))


@functools.lru_cache(maxsize=1)
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    return fn


def tma_compatible(x) -> bool:
    """Whether a (…, S, H, D) CuPy array can be described by a tensor map: 16-byte aligned base and
    non-negative strides that are multiples of 16 bytes (the last axis contiguous)."""
    if x.strides[-1] != x.itemsize or x.data.ptr % 16:
        return False
    return all(s >= 0 and s % 16 == 0 for s in x.strides[:-1])


# Encoded maps by (address, TensorMapSpec): a map is a pure function of these, so a hit is exact.
# Encoding through ctypes costs ~10 us a map, four a launch: host time that a short forward cannot
# hide. Bounded: cleared when full.
_cache: dict = {}
_CACHE_ENTRIES = 256


def encode_at(ptr: int, spec: TensorMapSpec) -> bytes:
    """The 128 bytes of the tensor map ``spec`` over the array at ``ptr`` (cached): boxes of
    (64 columns, box rows, 1, 1) over (B, S, H, D), or (S, H, D) as one batch (varlen's packed rows).

    Raises
    ------
    RuntimeError
        If the driver rejects the map.
    """
    key = (ptr, spec)
    tensor_map = _cache.get(key)
    if tensor_map is None:
        if len(_cache) >= _CACHE_ENTRIES:
            _cache.clear()
        tensor_map = _cache[key] = _encode(ptr, *spec)
    return tensor_map


def encode(x, box_rows: int, dtype_name: str) -> bytes:
    """:func:`encode_at` for an array ``x``."""
    return encode_at(x.data.ptr, TensorMapSpec(x, box_rows, dtype_name))


def _encode(ptr: int, shape, strides, nbytes: int, box_rows: int, dtype_name: str) -> bytes:
    if len(shape) == 3:
        s, h, d = shape
        ss, sh, _ = strides
        b, sb = 1, -(-nbytes // 16) * 16  # any valid stride: the one batch coordinate is 0
    else:
        b, s, h, d = shape
        sb, ss, sh, _ = strides
    words = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 4)(d, s, h, b)
    byte_strides = (ctypes.c_uint64 * 3)(ss, sh, sb)  # for dims 1..3
    box = (ctypes.c_uint32 * 4)(64, box_rows, 1, 1)
    elem = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    data_type = _BFLOAT16 if dtype_name == "bfloat16" else _FLOAT16
    args = (words, data_type, 4, ctypes.c_void_p(ptr), dims, byte_strides, box, elem,
            0,  # interleave none
            _SWIZZLE_128B,
            0,  # L2 promotion none
            0)  # out-of-bounds fill: zeros
    rc = _libcuda()(*args)
    if rc == _INVALID_CONTEXT:
        # A thread whose CuPy work so far needed no runtime call (memory from the pool, cached
        # plans) has no current context for this driver call: bind the device's primary context
        # (cudaFree(0) initialises the runtime on the current device) and try again.
        import cupy

        cupy.cuda.runtime.free(0)
        rc = _libcuda()(*args)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled rejected shape {shape} strides {strides} (error {rc})")
    return bytes(words)
