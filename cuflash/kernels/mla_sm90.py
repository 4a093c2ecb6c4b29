"""mla_sm90 (cuda_src/mla_sm90.cu): MLA decode on wgmma for Hopper, 64 packed query rows a CTA, or 16
with the keys as wgmma's M.

A variant per dtype and row count: the head dims (576 / 512), tiles (64 keys, two stages) and threads (a
producer and two consumer warpgroups) are the kernel's own constants. :mod:`cuflash._mla_plan` says
which calls run on it."""

from __future__ import annotations

from .._build.variant import Variant
from .._runtime.params import DECODE_PARAMS
from .common import DTYPE_CODES

MLA_SM90_DTYPES = ("float16", "bfloat16")
MLA_SM90_KEYS = 64          # keys a tile: a page must hold whole tiles
MLA_SM90_THREADS = 384
MLA_SM90_MAX_SPLITS = 64    # the combine's weights: num_splits x rows floats in one stage
#: Packed query rows a CTA: 64 (wgmma's M), or 16 with the keys as M (S^T = K Q^T, O^T = V^T P^T) for
#: calls of at most 16 rows, where 64 rows would be three quarters padding (cuda_src/mla_sm90.cu).
MLA_SM90_ROWS = (64, 16)


def mla_sm90_rows(rows: int) -> int:
    """The CTA's packed rows for a call of ``rows`` = new tokens x query heads."""
    return 16 if rows <= 16 else 64


def mla_sm90_smem_bytes(rows: int) -> int:
    """Dynamic shared memory (cuda_src/mla_sm90.cu, MlaSm90::kSmemBytes): Q (rows x 576), two stages of 64
    x 576 and P, bf16; with the keys as M two 16 x 64 P tiles and the consumers' exchanges; 1 KiB to align."""
    q, stages = rows * 576 * 2, 2 * 64 * 576 * 2
    p_tiles, exchange = (2 * rows * 128, (2 * 2 * 4 * 16 + 2 * 4 * 16) * 4) if rows == 16 else (rows * 128, 0)
    return q + stages + p_tiles + exchange + 1024


def mla_sm90_variant(dtype_name: str, rows: int = 64) -> Variant:
    """The kernel for ``dtype_name`` (float16 or bfloat16 q and latent cache) and ``rows`` packed rows a CTA."""
    if dtype_name not in MLA_SM90_DTYPES:
        raise ValueError(f"mla_sm90 runs float16/bfloat16, not {dtype_name}")
    if rows not in MLA_SM90_ROWS:
        raise ValueError(f"mla_sm90 takes 64 or 16 rows a CTA, not {rows}")
    return Variant("mla_sm90", {"CUFLASH_DTYPE": DTYPE_CODES[dtype_name], "CUFLASH_MLA_ROWS": rows,
                                "CUFLASH_SMEM_BYTES": mla_sm90_smem_bytes(rows),
                                "CUFLASH_DECODE_PARAMS_SIZE": DECODE_PARAMS.itemsize})
