"""mla_sm90 (cuda_src/mla_sm90.cu): MLA decode on wgmma, 64 packed query rows a CTA, for Hopper.

One variant per dtype: the head dims (576 / 512), tiles (64 keys, two stages) and threads (a producer
and two consumer warpgroups) are the kernel's own constants. :mod:`cuflash._mla_plan` says which calls
run on it."""

from __future__ import annotations

from .._build.variant import Variant
from .._runtime.params import DECODE_PARAMS
from .common import DTYPE_CODES

MLA_SM90_DTYPES = ("float16", "bfloat16")
MLA_SM90_ROWS = 64          # packed query rows a CTA (cuda_src/mla_sm90.cu, MlaSm90::kRows)
MLA_SM90_KEYS = 64          # keys a tile: a page must hold whole tiles
MLA_SM90_THREADS = 384
MLA_SM90_MAX_SPLITS = 64    # the combine's weights: num_splits x 64 floats in one stage
#: Dynamic shared memory: Q, two stages of 64 x 576 and P's 64 x 64 tile (bf16), and 1 KiB to align.
MLA_SM90_SMEM_BYTES = 64 * 576 * 2 * 3 + 64 * 64 * 2 + 1024


def mla_sm90_variant(dtype_name: str) -> Variant:
    """The kernel for ``dtype_name`` (float16 or bfloat16 q and latent cache)."""
    if dtype_name not in MLA_SM90_DTYPES:
        raise ValueError(f"mla_sm90 runs float16/bfloat16, not {dtype_name}")
    return Variant("mla_sm90", {"CUFLASH_DTYPE": DTYPE_CODES[dtype_name], "CUFLASH_SMEM_BYTES": MLA_SM90_SMEM_BYTES,
                                "CUFLASH_DECODE_PARAMS_SIZE": DECODE_PARAMS.itemsize})
