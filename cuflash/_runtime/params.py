"""Every kernel parameter struct, mirrored from ``cuda_src``, and the one packer.

Each layout is a NumPy structured dtype (``align=True`` pads like C) written field for field after
its C struct; the size it computes is compiled into the kernels as ``CUFLASH_*_PARAMS_SIZE`` and
``static_assert``-ed there, so the two sides cannot drift silently.

A plan packs each struct once, into a byte template (:class:`Template`); a call copies the template
and writes only what changes from call to call: the data pointers, and for dropout its seed and
offset (or, captured in a CUDA graph, the address of the device words holding them).
A leaf module: it imports nothing of cuflash.
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = ["USER_ARGS", "FWD_PARAMS", "BWD_PARAMS", "CONVERT_PARAMS", "DECODE_PARAMS", "MERGE_PARAMS", "CHECK_PARAMS",
           "APPEND_PARAMS", "WORK_ORDER_PARAMS", "Layout", "Template", "FWD", "BWD", "CONVERT", "DECODE", "MERGE", "CHECK",
           "APPEND", "WORK_ORDER"]


def _fields(kind, names):
    return [(name, kind) for name in names]


# ----------------------------------------------------------------------------- cuda_src/user_mod.cuh
#: cuflash::user::Args: the arguments of a call's ScoreMod/MaskMod (kMaxArrays = kMaxScalars = 8).
USER_ARGS = np.dtype(
    _fields(np.uint64, tuple(f"ptr{k}" for k in range(8)))
    + _fields(np.int64, tuple(f"size{k}" for k in range(8)))
    + _fields(np.float32, tuple(f"f{k}" for k in range(8)))
    + _fields(np.int64, tuple(f"i{k}" for k in range(8))),
    align=True,
)

# ----------------------------------------------------------------------------- cuda_src/params.cuh
FWD_PARAMS = np.dtype(
    _fields(np.uint64, ("q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes", "mask", "bias",
                        "block_mask", "sinks", "error", "block_table", "seqused_k", "work_order",
                        "work_bounds"))
    + _fields(np.int64, (
        "q_batch_stride", "q_row_stride", "q_head_stride",
        "k_batch_stride", "k_row_stride", "k_head_stride",
        "v_batch_stride", "v_row_stride", "v_head_stride",
        "o_batch_stride", "o_row_stride", "o_head_stride",
        "lse_batch_stride", "lse_head_stride",
        "alibi_batch_stride",
        "mask_batch_stride", "mask_head_stride", "mask_row_stride", "mask_col_stride",
        "bias_batch_stride", "bias_head_stride", "bias_row_stride", "bias_col_stride",
        "block_mask_batch_stride", "block_mask_head_stride", "block_mask_row_stride", "block_mask_col_stride",
        "block_table_batch_stride",
        "mask_bits_offset", "mask_bits_batch_stride", "mask_bits_head_stride", "mask_bits_row_stride"))
    + [("dropout_state", np.uint64), ("dropout_seed", np.uint64), ("user", USER_ARGS)]
    + _fields(np.int32, ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_k", "head_dim", "head_dim_v",
                         "window_left", "window_right", "block_q", "block_k", "bias_dtype"))
    + _fields(np.uint32, ("dropout_offset", "dropout_threshold"))
    + _fields(np.float32, ("scale", "scale_log2", "softcap", "dropout_rescale"))
    + _fields(np.int32, ("dropout_row0", "dropout_col0", "tail_heads", "seqlen_k_new", "page_size", "kv_box_rows",
                         "work_order_batch_stride", "work_order_head_stride")),
    align=True,
)

# ----------------------------------------------------------------------------- cuda_src/bwd_params.cuh
BWD_PARAMS = np.dtype(
    [("fwd", FWD_PARAMS)]
    + _fields(np.uint64, ("dout", "dq_accum", "dq", "dk", "dv", "lse2", "dsum", "dbias", "dq_semaphore", "dq_done",
                        "dsink_part", "dsinks", "work_counter", "dlse"))
    + _fields(np.int64, (
        "do_batch_stride", "do_row_stride", "do_head_stride",
        "dqa_batch_stride", "dqa_row_stride", "dqa_head_stride",
        "dq_batch_stride", "dq_row_stride", "dq_head_stride",
        "dk_batch_stride", "dk_row_stride", "dk_head_stride",
        "dv_batch_stride", "dv_row_stride", "dv_head_stride",
        "dbias_batch_stride", "dbias_head_stride", "dbias_row_stride"))
    + _fields(np.int32, ("seqlen_q_pad", "heads_per_cta", "dkv_partial", "dqa_tile_rows", "tail_pairs",
                         "dq_tail_pairs")),
    align=True,
)

CONVERT_PARAMS = np.dtype(
    _fields(np.uint64, ("src", "dst", "error", "cu_seqlens", "done"))
    + _fields(np.int64, ("partial_stride", "src_row_stride", "src_head_stride", "src_batch_stride", "dst_row_stride",
                         "dst_head_stride", "dst_batch_stride"))
    + _fields(np.int32, ("rows", "heads", "head_dim", "num_partials"))
    + [("scale", np.float32), ("tile_rows", np.int32), ("done_expected", np.int32), ("heads_per_slot", np.int32)],
    align=True,
)

# ----------------------------------------------------------------------------- cuda_src/decode_params.cuh
DECODE_PARAMS = np.dtype(
    [("score", FWD_PARAMS)]
    + _fields(np.uint64, ("q", "k_cache", "v_cache", "k_new", "v_new", "o", "lse", "o_part", "lse_part",
                          "cache_seqlens", "block_table", "mask", "error", "report",
                          "split_counters", "k_scale", "v_scale", "cu_seqlens_q"))
    + _fields(np.int64, (
        "q_batch_stride", "q_row_stride", "q_head_stride",
        "k_batch_stride", "k_row_stride", "k_head_stride",
        "v_batch_stride", "v_row_stride", "v_head_stride",
        "k_new_batch_stride", "k_new_row_stride", "k_new_head_stride",
        "v_new_batch_stride", "v_new_row_stride", "v_new_head_stride",
        "o_batch_stride", "o_row_stride", "o_head_stride",
        "lse_batch_stride", "lse_head_stride",
        "block_table_batch_stride",
        "mask_batch_stride", "mask_head_stride", "mask_row_stride", "mask_col_stride"))
    + _fields(np.int32, ("batch", "seqlen_q", "heads_q", "heads_k", "group", "head_dim", "out_dim", "seqlen_cache",
                         "seqlen_new", "page_size", "num_splits", "row_blocks", "mask_keys", "num_pages",
                         "max_pages", "self_check", "k_scale_stride", "v_scale_stride"))
    + _fields(np.float32, ("k_scale_value", "v_scale_value")),
    align=True,
)

# ----------------------------------------------------------------------------- cuda_src/merge.cu
MERGE_PARAMS = np.dtype(
    _fields(np.uint64, ("outs", "lses", "out", "lse"))
    + _fields(np.int64, (
        "outs_part_stride", "outs_batch_stride", "outs_row_stride", "outs_head_stride", "outs_col_stride",
        "lses_part_stride", "lses_batch_stride", "lses_head_stride", "lses_row_stride",
        "out_batch_stride", "out_row_stride", "out_head_stride", "out_col_stride",
        "lse_batch_stride", "lse_head_stride", "lse_row_stride"))
    + _fields(np.int32, ("num_parts", "batch", "seqlen", "heads", "head_dim", "pad_")),
    align=True,
)

# ----------------------------------------------------------------------------- cuda_src/check_indices.cu
CHECK_PARAMS = np.dtype(
    _fields(np.uint64, ("cache_seqlens", "block_table", "cu_seqlens_q", "cu_seqlens_k", "error", "scratch",
                        "report"))
    + [("block_table_batch_stride", np.int64)]
    + _fields(np.int32, ("batch", "capacity", "seqlen_new", "page_size", "num_pages", "max_pages", "total_q",
                         "total_k", "max_seqlen_q", "max_seqlen_k")),
    align=True,
)

# ----------------------------------------------------------------------------- cuda_src/append_kv.cu
APPEND_PARAMS = np.dtype(
    _fields(np.uint64, ("k_new", "v_new", "k_cache", "v_cache", "cache_seqlens", "block_table", "error"))
    + _fields(np.int64, (
        "k_new_batch_stride", "k_new_row_stride", "k_new_head_stride",
        "v_new_batch_stride", "v_new_row_stride", "v_new_head_stride",
        "k_batch_stride", "k_row_stride", "k_head_stride",
        "v_batch_stride", "v_row_stride", "v_head_stride",
        "block_table_batch_stride"))
    + _fields(np.int32, ("seqlen_new", "heads_k", "k_chunks", "v_chunks", "page_size")),
    align=True,
)

# ----------------------------------------------------------------------------- cuda_src/work_order.cu
WORK_ORDER_PARAMS = np.dtype(
    _fields(np.uint64, ("block_mask", "order", "walks", "bounds"))
    + _fields(np.int64, ("block_mask_batch_stride", "block_mask_head_stride", "block_mask_row_stride",
                         "block_mask_col_stride"))
    + _fields(np.int32, ("heads_m", "tiles", "by_keys", "tile", "step", "block_q", "block_k", "seqlen_q", "seqlen_k",
                         "window_left", "window_right")),
    align=True,
)

_CODES = {"u8": "Q", "i8": "q", "u4": "I", "i4": "i", "f4": "f"}
_C_TYPES = {"Q": "uint64", "q": "int64", "I": "uint32", "i": "int32", "f": "float32"}


class Layout:
    """Byte layout of one params struct: field offsets (nested structs flattened as ``"fwd.q"``) and a
    packer that is a single ``struct.pack`` (a few microseconds; setting ~50 fields of a NumPy
    structured scalar one by one took ~20).

    Parameters
    ----------
    dtype : numpy structured dtype (align=True), as above
    defaults : dict, optional
        Values of fields not given to :meth:`pack` (others are 0: null pointers, no options).
    """

    def __init__(self, dtype: np.dtype, defaults: dict | None = None):
        self.dtype = dtype
        self.size = dtype.itemsize
        self.fields = []   # (flat name, offset, struct code) in offset order
        self._flatten(dtype, "", 0)
        self.offsets = {name: offset for name, offset, _ in self.fields}
        self.codes = {name: code for name, _, code in self.fields}
        fmt, pos = "<", 0
        for _, offset, code in self.fields:
            fmt += f"{offset - pos}x" if offset > pos else ""
            fmt += code
            pos = offset + struct.calcsize("<" + code)
        fmt += f"{self.size - pos}x" if self.size > pos else ""
        self._struct = struct.Struct(fmt)
        assert self._struct.size == self.size
        self.defaults = dict.fromkeys(self.offsets, 0) | (defaults or {})

    def _flatten(self, dtype, prefix, base):
        for name in dtype.names:
            field, offset = dtype.fields[name][:2]
            if field.names is not None:
                self._flatten(field, f"{prefix}{name}.", base + offset)
            else:
                self.fields.append((prefix + name, base + offset, _CODES[f"{field.kind}{field.itemsize}"]))

    def pack(self, fields: dict) -> bytes:
        """The struct's bytes; fields not given take their defaults."""
        unknown = fields.keys() - self.defaults.keys()
        if unknown:
            raise KeyError(f"the params struct has no fields {sorted(unknown)}")
        values = self.defaults | fields
        try:
            return self._struct.pack(*[values[name] for name, _, _ in self.fields])
        except (struct.error, OverflowError):   # OverflowError: a float past float32
            raise ValueError(self._misfit(values)) from None

    def _misfit(self, values: dict) -> str:
        """The message for values that do not pack: the first field whose value does not fit its C type.
        The argument checks (cuflash/_checks.py) bound every argument first, so this is a safety net."""
        for name, _, code in self.fields:
            try:
                struct.pack("<" + code, values[name])
            except (struct.error, OverflowError):
                return (f"the kernel parameter {name} = {values[name]!r} does not fit its C type "
                        f"({_C_TYPES[code]}): an argument is out of range")
        return "the kernel parameters do not pack"   # pragma: no cover - each field packed alone

    def unpack(self, data: bytes) -> dict:
        """Field values of packed bytes (tests and debugging)."""
        return dict(zip((name for name, _, _ in self.fields), self._struct.unpack(bytes(data))))


FWD = Layout(FWD_PARAMS, {"dropout_rescale": 1.0})
BWD = Layout(BWD_PARAMS, {"fwd.dropout_rescale": 1.0, "heads_per_cta": 1})
CONVERT = Layout(CONVERT_PARAMS, {"num_partials": 1, "scale": 1.0})
DECODE = Layout(DECODE_PARAMS, {"score.dropout_rescale": 1.0})
MERGE = Layout(MERGE_PARAMS)
CHECK = Layout(CHECK_PARAMS)
APPEND = Layout(APPEND_PARAMS)
WORK_ORDER = Layout(WORK_ORDER_PARAMS)


class Template:
    """A packed struct whose slots are filled at every call.

    Parameters
    ----------
    layout : Layout
    fields : dict
        Every field that is fixed for the plan.
    slots : dict
        Field name -> key of the per-call value (an index into the call's pointer list, or a name
        such as ``"dropout_offset"``).
    """

    __slots__ = ("data", "slots")

    def __init__(self, layout: Layout, fields: dict, slots: dict):
        self.data = layout.pack(fields)
        self.slots = tuple((layout.offsets[name], "<" + layout.codes[name], key) for name, key in slots.items())

    def fill(self, values) -> bytearray:
        """The struct's bytes for one call; ``values[key]`` for every slot."""
        buf = bytearray(self.data)
        for offset, fmt, keys in self.runs():
            struct.pack_into(fmt, buf, offset, *[values[key] for key in keys])
        return buf

    def runs(self):
        """The slots as runs of adjacent fields, each written by one ``struct.pack_into``: a list of
        (offset, format, keys). The pointers of a struct are its first fields, so a call's pointers
        are usually one or two runs."""
        runs = []
        for offset, fmt, key in sorted(self.slots):
            if runs and runs[-1][0] + struct.calcsize(runs[-1][1]) == offset:
                start, run_fmt, keys = runs[-1]
                runs[-1] = (start, run_fmt + fmt[1:], keys + (key,))
            else:
                runs.append((offset, fmt, (key,)))
        return runs
