"""check_indices (cuda_src/check_indices.cu): the check of a call's index arrays on the GPU
(cache_seqlens, block_table, cu_seqlens), run ahead of the decode and varlen kernels that read them."""

from __future__ import annotations

from .._runtime.params import CHECK_PARAMS
from .._build.variant import Variant

CHECK_THREADS = 128
#: CTAs of the index check: one per sequence up to this many (each then strides over the rest).
CHECK_MAX_CTAS = 1024


def check_indices_variant() -> Variant:
    """The index check that runs before decode and varlen kernels whose index arrays live on the
    GPU; CHECK_THREADS threads per CTA, any grid."""
    return Variant("check_indices", {"CUFLASH_CHECK_PARAMS_SIZE": CHECK_PARAMS.itemsize})
