"""Tile sizes and kernel variants: pure functions of shapes and device properties.

Every compile-time choice is made here and handed to the CUDA sources as ``-DCUFLASH_*`` defines;
the kernels ``static_assert`` the shared-memory size they receive, so Python and CUDA cannot
disagree silently. Nothing here touches a GPU, so it is tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._compile import Variant

DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2}

# Head dims the kernels are compiled for; a run-time head dim is zero-padded up to the next one.
# sm80 tiles need multiples of 64 (the shared-memory swizzle spans 8 chunks of 16 bytes).
SM80_HEAD_DIMS = (64, 128, 192, 256)
SIMT_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Tiles:
    """One CTA's shape: query rows, keys per step, warps, CTAs per SM the registers aim at."""

    block_m: int
    block_n: int
    warps: int
    min_blocks: int = 1


# Chosen from register reports (no spills under 255 registers) and timings on an H200; see
# benchmarks/NOTES.md. Without score modifiers or dropout, 4 warps with two 16-row tiles each
# (FlashAttention-2's shape) read each K/V fragment once for 32 rows; with them, the extra live
# state no longer fits and 8 warps of one 16-row tile each take over.
SM80_TILES = {
    64: Tiles(128, 64, 4),
    128: Tiles(128, 32, 4),
    192: Tiles(128, 32, 8),
    256: Tiles(128, 32, 8),
}
SM80_TILES_FEATURED = {
    64: Tiles(128, 64, 8),
    128: Tiles(128, 64, 8),
    192: Tiles(128, 32, 8),
    256: Tiles(128, 32, 8),
}
SIMT_TILES = Tiles(64, 32, 4)


@dataclass(frozen=True)
class LaunchPlan:
    """What the launcher needs besides the parameters: the variant, grid rows and resources."""

    variant: Variant
    block_m: int
    threads: int
    smem_bytes: int
    head_dim: int  # compiled head dim (>= the run-time one)


def _round_up(x: int, options: tuple[int, ...]) -> int:
    for value in options:
        if x <= value:
            return value
    raise ValueError(f"head dim {x} exceeds the maximum of {options[-1]}")


def sm80_smem_bytes(tiles: Tiles, head_dim: int) -> int:
    """Q tile plus two stages of K and V tiles, 16-bit elements."""
    return (tiles.block_m + 4 * tiles.block_n) * head_dim * 2


def simt_smem_bytes(tiles: Tiles, head_dim: int) -> int:
    """Q tile, one K and one V tile, and the P tile, float32 elements."""
    return (tiles.block_m * head_dim + 2 * tiles.block_n * head_dim + tiles.block_m * tiles.block_n) * 4


def forward_plan(family: str, dtype_name: str, head_dim: int, *, score_mods: bool, dropout: bool) -> LaunchPlan:
    """The forward variant for a problem.

    Parameters
    ----------
    family : {"fwd_sm80", "fwd_simt"}
    dtype_name : {"float16", "bfloat16", "float32"}
    head_dim : int
        Run-time head dim (a multiple of 8, at most 256).
    score_mods : bool
        Whether softcap, ALiBi, bias, mask or block_mask may be present (the per-element pipeline).
    dropout : bool
    """
    if family == "fwd_sm80":
        if dtype_name not in ("float16", "bfloat16"):
            raise ValueError(f"fwd_sm80 runs float16/bfloat16, not {dtype_name}")
        kdim = _round_up(head_dim, SM80_HEAD_DIMS)
        tiles = (SM80_TILES_FEATURED if score_mods or dropout else SM80_TILES)[kdim]
        smem = sm80_smem_bytes(tiles, kdim)
    elif family == "fwd_simt":
        if dtype_name != "float32":
            raise ValueError(f"fwd_simt runs float32, not {dtype_name}")
        kdim = _round_up(head_dim, SIMT_HEAD_DIMS)
        tiles = SIMT_TILES
        smem = simt_smem_bytes(tiles, kdim)
    else:
        raise ValueError(f"unknown kernel family {family!r}")
    from ._launch import PARAMS_DTYPE  # the size of the parameter struct is asserted in params.cuh

    defines = {
        "CUFLASH_DTYPE": DTYPE_CODES[dtype_name],
        "CUFLASH_HEAD_DIM": kdim,
        "CUFLASH_BLOCK_M": tiles.block_m,
        "CUFLASH_BLOCK_N": tiles.block_n,
        "CUFLASH_WARPS": tiles.warps,
        "CUFLASH_MIN_BLOCKS": tiles.min_blocks,
        "CUFLASH_SCORE_MODS": int(score_mods),
        "CUFLASH_DROPOUT": int(dropout),
        "CUFLASH_SMEM_BYTES": smem,
        "CUFLASH_PARAMS_SIZE": PARAMS_DTYPE.itemsize,
    }
    variant = Variant(family, tuple(sorted(defines.items())))
    return LaunchPlan(variant, tiles.block_m, 32 * tiles.warps, smem, kdim)


def default_family(dtype_name: str) -> str:
    """The kernel family used when none is forced."""
    return "fwd_simt" if dtype_name == "float32" else "fwd_sm80"


def precompile_variants(dtypes=None, head_dims=None, families=None) -> list[Variant]:
    """Variants worth compiling ahead of time: each dtype x head dim, plain and with every feature.

    Parameters
    ----------
    dtypes : sequence of str, optional
        Default: float16, bfloat16, float32.
    head_dims : sequence of int, optional
        Default: 64, 128, 256 (others compile on first use).
    families : sequence of str, optional
        Restrict to these kernel families.
    """
    dtypes = tuple(dtypes or ("float16", "bfloat16", "float32"))
    head_dims = tuple(head_dims or (64, 128, 256))
    out = []
    for dtype_name in dtypes:
        dtype_name = np.dtype(dtype_name).name if dtype_name != "bfloat16" else dtype_name
        family = default_family(dtype_name)
        if families is not None and family not in families:
            continue
        for d in head_dims:
            for mods, dropout in ((False, False), (True, True)):
                plan = forward_plan(family, dtype_name, d, score_mods=mods, dropout=dropout)
                if plan.variant not in out:
                    out.append(plan.variant)
    return out
