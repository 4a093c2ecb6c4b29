"""The only place kernel arguments are packed.

``PARAMS_DTYPE`` mirrors ``cuda_src/params.cuh`` field for field (NumPy's ``align=True`` pads like
C); its size is compiled into every module as ``CUFLASH_PARAMS_SIZE`` and checked there.
"""

from __future__ import annotations

import contextlib
import functools
import struct

import numpy as np

_POINTERS = ("q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "mask", "bias",
             "block_mask")
_STRIDES = (
    "q_batch_stride", "q_row_stride", "q_head_stride",
    "k_batch_stride", "k_row_stride", "k_head_stride",
    "v_batch_stride", "v_row_stride", "v_head_stride",
    "o_batch_stride", "o_row_stride", "o_head_stride",
    "lse_batch_stride", "lse_head_stride",
    "alibi_batch_stride",
    "mask_batch_stride", "mask_head_stride", "mask_row_stride", "mask_col_stride",
    "bias_batch_stride", "bias_head_stride", "bias_row_stride", "bias_col_stride",
    "block_mask_batch_stride", "block_mask_head_stride", "block_mask_row_stride", "block_mask_col_stride",
)
_INTS = ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_k", "head_dim", "window_left", "window_right",
         "block_q", "block_k", "bias_dtype")

PARAMS_DTYPE = np.dtype(
    [(name, np.uint64) for name in _POINTERS]
    + [(name, np.int64) for name in _STRIDES]
    + [("dropout_seed", np.uint64)]
    + [(name, np.int32) for name in _INTS]
    + [("dropout_offset", np.uint32), ("dropout_threshold", np.uint32)]
    + [(name, np.float32) for name in ("scale", "scale_log2", "softcap", "dropout_rescale")]
    + [("pad_", np.int32)],
    align=True,
)


def _flat_struct(dtype: np.dtype) -> struct.Struct:
    """A struct.Struct with the byte layout of a flat NumPy structured dtype (padding included)."""
    codes = {"u8": "Q", "i8": "q", "u4": "I", "i4": "i", "f4": "f"}
    fmt, pos = "<", 0
    for name in dtype.names:
        field, offset = dtype.fields[name][:2]
        fmt += f"{offset - pos}x" if offset > pos else ""
        fmt += codes[f"{field.kind}{field.itemsize}"]
        pos = offset + field.itemsize
    fmt += f"{dtype.itemsize - pos}x" if dtype.itemsize > pos else ""
    layout = struct.Struct(fmt)
    assert layout.size == dtype.itemsize
    return layout


# Packing by struct: a few microseconds, where setting ~50 fields one by one on a structured scalar
# took ~20 (host time that a short kernel cannot hide).
_PARAMS_STRUCT = _flat_struct(PARAMS_DTYPE)
_PARAMS_DEFAULTS = dict.fromkeys(PARAMS_DTYPE.names, 0) | {"dropout_rescale": 1.0}


def pack_params(**fields) -> np.void:
    """A FwdParams value; fields not given are zero (null pointers, no options, no dropout)."""
    if not fields.keys() <= _PARAMS_DEFAULTS.keys():
        raise KeyError(f"FwdParams has no fields {sorted(fields.keys() - _PARAMS_DEFAULTS.keys())}")
    values = _PARAMS_DEFAULTS | fields
    packed = _PARAMS_STRUCT.pack(*[values[name] for name in PARAMS_DTYPE.names])
    return np.frombuffer(packed, dtype=PARAMS_DTYPE)[0]


# q, k, v, o, lse lead the struct: a launch replayed on new arrays rewrites only them.
_DATA_POINTERS = struct.Struct("<5Q")
assert _POINTERS[:5] == ("q", "k", "v", "o", "lse") and PARAMS_DTYPE.fields["q"][1] == 0


def with_data_pointers(params: np.void, q: int, k: int, v: int, o: int, lse: int) -> np.void:
    """``params`` with the pointers of q, k, v, o and lse replaced."""
    packed = bytearray(params.tobytes())
    _DATA_POINTERS.pack_into(packed, 0, q, k, v, o, lse)
    return np.frombuffer(packed, dtype=PARAMS_DTYPE)[0]


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    """Multiprocessors of a device (persistent grids and split heuristics size themselves by it)."""
    import cupy

    runtime = cupy.cuda.runtime
    return int(runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device_id))


_work_counters: dict = {}


def work_counter():
    """A zeroed int32 on the current device for the current stream: the persistent kernels take
    their work items from it and reset it to 0 before they end, so launches in one stream can
    share it (one per stream, so that kernels on different streams never take each other's)."""
    import cupy

    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    counter = _work_counters.get(key)
    if counter is None:
        counter = _work_counters[key] = cupy.zeros(1, dtype=np.int32)
    return counter


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


_smem_limits: dict = {}  # kernel -> the dynamic shared memory it was allowed


def launch(kernel, grid: tuple[int, int, int], threads: int, smem_bytes: int, args) -> None:
    """Launch on CuPy's current stream, raising the dynamic shared-memory limit when needed.

    ``args`` is the parameter struct, or a tuple of the kernel's parameters in order (tensor maps
    first for the Hopper kernels).
    """
    if not isinstance(args, tuple):
        args = (args,)
    # Reading the limit back is a driver call; kernels are cached for the process, so remembering
    # what was set saves it on every later launch.
    if smem_bytes > _smem_limits.get(kernel, 48 * 1024):
        if kernel.max_dynamic_shared_size_bytes < smem_bytes:
            kernel.max_dynamic_shared_size_bytes = smem_bytes
        _smem_limits[kernel] = smem_bytes
    kernel(grid, (threads, 1, 1), args, shared_mem=smem_bytes)


# ----------------------------------------------------------------------------- Backward
# BWD_PARAMS_DTYPE mirrors cuda_src/bwd_params.cuh's BwdParams (the forward's FwdParams first, then
# the backward's own fields) and CONVERT_PARAMS_DTYPE its ConvertParams; their sizes go into every
# backward module as CUFLASH_BWD_PARAMS_SIZE / CUFLASH_CONVERT_PARAMS_SIZE and are checked there.

_BWD_POINTERS = ("dout", "dq_accum", "dq", "dk", "dv", "lse2", "dsum", "dbias")
_BWD_STRIDES = (
    "do_batch_stride", "do_row_stride", "do_head_stride",
    "dqa_batch_stride", "dqa_row_stride", "dqa_head_stride",
    "dq_batch_stride", "dq_row_stride", "dq_head_stride",
    "dk_batch_stride", "dk_row_stride", "dk_head_stride",
    "dv_batch_stride", "dv_row_stride", "dv_head_stride",
    "dbias_batch_stride", "dbias_head_stride", "dbias_row_stride",
)
_BWD_INTS = ("seqlen_q_pad", "heads_per_cta", "dkv_partial", "pad_")

BWD_PARAMS_DTYPE = np.dtype(
    [("fwd", PARAMS_DTYPE)]
    + [(name, np.uint64) for name in _BWD_POINTERS]
    + [(name, np.int64) for name in _BWD_STRIDES]
    + [(name, np.int32) for name in _BWD_INTS],
    align=True,
)

CONVERT_PARAMS_DTYPE = np.dtype(
    [("src", np.uint64), ("dst", np.uint64), ("partial_stride", np.int64),
     ("src_row_stride", np.int64), ("src_head_stride", np.int64),
     ("dst_row_stride", np.int64), ("dst_head_stride", np.int64),
     ("rows", np.int32), ("heads", np.int32), ("head_dim", np.int32), ("num_partials", np.int32),
     ("scale", np.float32), ("pad_", np.int32)],
    align=True,
)


def pack_bwd_params(fwd: dict, **fields) -> np.void:
    """A BwdParams value: ``fwd`` holds FwdParams fields (as for :func:`pack_params`), the keywords
    the backward's own; fields not given are zero (null pointers)."""
    params = np.zeros((), dtype=BWD_PARAMS_DTYPE)
    params["fwd"] = pack_params(**fwd)
    params["heads_per_cta"] = 1
    for name, value in fields.items():
        params[name] = value
    return params[()]


def pack_convert_params(**fields) -> np.void:
    """A ConvertParams value (see cuda_src/bwd_params.cuh)."""
    params = np.zeros((), dtype=CONVERT_PARAMS_DTYPE)
    params["num_partials"] = 1
    params["scale"] = 1.0
    for name, value in fields.items():
        params[name] = value
    return params[()]
