"""TMA tensor maps (CUtensorMap) for the Hopper kernels, encoded through the CUDA driver.

A map describes a (B, S, H, D) array as a 4-d tensor (innermost first: D, S, H, B) with the
caller's strides, read in boxes of 128 bytes of columns (64 16-bit elements or 128 bytes of a bool
mask: the span of the 128-byte swizzle) x ``box_rows`` rows of one head. Coordinates past the extent
read as zeros, which is how tails never reach a result. The map travels to the kernel by value: its
128 bytes are one kernel parameter of the launch (cuflash/_runtime/launch.py), like the packed
parameter struct.

A plan encodes its maps once, at a stand-in address (:data:`TEMPLATE_ADDRESS`), and a call writes
only the operand's address into them: the driver keeps the global address as a plain little-endian
64-bit value in bytes 0..7 of the map, and nothing else in the map depends on it (as measured with
CUDA 13's ``cuTensorMapEncodeTiled``). That layout is not documented, so :func:`address_patchable`
checks it on the driver once per process; where it does not hold, a call encodes its maps
(:func:`encode_at`, ~8.5 us each).
"""

from __future__ import annotations

import ctypes
import functools

_DATA_TYPES = {"float16": 6, "bfloat16": 9, "bool": 0}  # CU_TENSOR_MAP_DATA_TYPE_* (bool as UINT8)
_SWIZZLE_128B = 3
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT


class TensorMapSpec(tuple):
    """What a tensor map depends on besides the address: (shape, byte strides, nbytes, box rows,
    dtype name: float16, bfloat16 or bool, row groups). Made once per plan; maps are then cached by
    (address, spec).

    ``row_groups``: a paged KV cache (pages, page_size, H, D) whose rows run on from page to page (page
    stride = page_size x row stride) and whose D is whole 64-column blocks, as fwd_sm90 reads it in its
    "row_groups" mode: a 5-d tensor (innermost first: 64 columns, 8 rows, D / 64 column blocks, the
    cache's row groups of 8, H) read in boxes of (64, 8, D / 64, box_rows / 8, 1), so that one copy
    takes a box's every column block and lays out each group's blocks side by side."""

    __slots__ = ()

    def __new__(cls, x, box_rows: int, dtype_name: str, row_groups: bool = False):
        return super().__new__(cls, (tuple(x.shape), tuple(x.strides), int(x.nbytes), int(box_rows), dtype_name,
                                     bool(row_groups)))


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
# Encoding through ctypes costs ~8.5 us a map; plans encode theirs once (:func:`template`), and
# calls go through here only where maps cannot be patched. Bounded: cleared when full.
_cache: dict = {}
_CACHE_ENTRIES = 256


def encode_at(ptr: int, spec: TensorMapSpec) -> bytes:
    """The 128 bytes of the tensor map ``spec`` over the array at ``ptr`` (cached): boxes of
    (128 bytes of columns, box rows, 1, 1) over (B, S, H, D), or (S, H, D) as one batch (varlen's packed
    rows), or a paged cache's boxes in row groups (:class:`TensorMapSpec`).

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


def _encode(ptr: int, shape, strides, nbytes: int, box_rows: int, dtype_name: str, row_groups: bool = False) -> bytes:
    if row_groups:
        pages, page_size, h, d = shape
        _, ss, sh, _ = strides
        dims = (64, 8, d // 64, pages * page_size // 8, h)
        byte_strides = (ss, 128, 8 * ss, sh)
        box = (64, 8, d // 64, box_rows // 8, 1)
    else:
        if len(shape) == 3:
            s, h, d = shape
            ss, sh, _ = strides
            b, sb = 1, -(-nbytes // 16) * 16  # any valid stride: the one batch coordinate is 0
        else:
            b, s, h, d = shape
            sb, ss, sh, _ = strides
        dims, byte_strides, box = (d, s, h, b), (ss, sh, sb), (128 if dtype_name == "bool" else 64, box_rows, 1, 1)
    rank = len(dims)
    words = (ctypes.c_uint64 * 16)()
    args = (words, _DATA_TYPES[dtype_name], rank, ctypes.c_void_p(ptr), (ctypes.c_uint64 * rank)(*dims),
            (ctypes.c_uint64 * (rank - 1))(*byte_strides), (ctypes.c_uint32 * rank)(*box),
            (ctypes.c_uint32 * rank)(*(1,) * rank),
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


# Where plans encode their maps (any 16-byte aligned address: the driver does not dereference it),
# and the check's addresses, apart from it in low and high bits (below 2**47, like a real pointer).
TEMPLATE_ADDRESS = 0x7F00_0000_0000
_PROBE_ADDRESSES = (0x7A12_3456_7890, 0x1000_0000_0100)
_PROBE_SPECS = {
    "tiles": (
        ((2, 300, 8, 128), (300 * 8 * 128 * 2, 8 * 128 * 2, 128 * 2, 2), 2 * 300 * 8 * 128 * 2, 128, "bfloat16"),
        ((700, 4, 64), (4 * 64 * 2, 64 * 2, 2), 700 * 4 * 64 * 2, 64, "float16"),   # varlen's packed rows
    ),
    "row_groups": (   # a paged cache in row groups
        ((50, 16, 8, 128), (16 * 8 * 128 * 2, 8 * 128 * 2, 128 * 2, 2), 50 * 16 * 8 * 128 * 2, 16, "bfloat16", True),
    ),
    "bool": (   # a (B, Sq, H, Sk) mask, one head broadcast
        ((2, 1000, 1, 1000), (1000 * 1008, 1008, 1000 * 1008, 1), 0, 128, "bool"),
    ),
}
_patchable: dict = {}   # kind (_PROBE_SPECS) -> the check's answer


def address_patchable(spec: TensorMapSpec | None = None) -> bool:
    """Whether a map encoded at one address becomes the map at another by writing that address into
    its bytes 0..7 (little-endian). Checked on the driver when a plan first needs a map of its kind,
    once per process: a (B, S, H, D) and a packed-rows map, a row-groups map (``spec`` in row groups) or
    a bool mask's, each encoded at three addresses. False as well where the driver refuses the stand-in
    addresses; then every call encodes its maps of that kind."""
    kind = "tiles" if spec is None else "row_groups" if spec[5] else "bool" if spec[4] == "bool" else "tiles"
    known = _patchable.get(kind)
    if known is None:
        known = _patchable[kind] = _check_patchable(_PROBE_SPECS[kind])
    return known


def _check_patchable(specs) -> bool:
    try:
        for spec in specs:
            addresses = (TEMPLATE_ADDRESS, *_PROBE_ADDRESSES)
            maps = [_encode(address, *spec) for address in addresses]
            for address, tensor_map in zip(addresses, maps):
                if len(tensor_map) != 128 or tensor_map != patched(maps[0], address):
                    return False
    except RuntimeError:
        return False
    return True


def patched(tensor_map: bytes, ptr: int) -> bytes:
    """``tensor_map`` over the address ``ptr`` (valid where :func:`address_patchable`)."""
    return ptr.to_bytes(8, "little") + tensor_map[8:]


def template(spec: TensorMapSpec) -> bytes:
    """The map ``spec`` at :data:`TEMPLATE_ADDRESS`: a plan's copy, whose address each call replaces
    (valid where :func:`address_patchable`)."""
    return encode_at(TEMPLATE_ADDRESS, spec)
