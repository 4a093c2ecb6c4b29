"""The only place kernel arguments are packed.

``PARAMS_DTYPE`` mirrors ``cuda_src/params.cuh`` field for field (NumPy's ``align=True`` pads like
C); its size is compiled into every module as ``CUFLASH_PARAMS_SIZE`` and checked there.
"""

from __future__ import annotations

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


def pack_params(**fields) -> np.void:
    """A FwdParams value; fields not given are zero (null pointers, no options, no dropout)."""
    params = np.zeros((), dtype=PARAMS_DTYPE)
    params["dropout_rescale"] = 1.0
    for name, value in fields.items():
        params[name] = value
    return params[()]


def launch(kernel, grid: tuple[int, int, int], threads: int, smem_bytes: int, params: np.void) -> None:
    """Launch on CuPy's current stream, raising the dynamic shared-memory limit when needed."""
    if smem_bytes > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < smem_bytes:
        kernel.max_dynamic_shared_size_bytes = smem_bytes
    kernel(grid, (threads, 1, 1), (params,), shared_mem=smem_bytes)
