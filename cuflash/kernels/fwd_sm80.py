"""fwd_sm80 (cuda_src/fwd_sm80.cu): mma.sync m16n8k16, ldmatrix and cp.async tiles for
float16/bfloat16 on sm_80 and later; the forward of every GPU that is not a Hopper, and the fallback
of one where fwd_sm90's TMA cannot describe the operands."""

from __future__ import annotations

from .common import LaunchPlan, Tiles, round_up, tiled_plan
from ..features import score_mod_bits

# Head dims the kernels are compiled for; a run-time head dim is zero-padded up to the next one.
# sm80 tiles need multiples of 64 (the shared-memory swizzle spans 8 chunks of 16 bytes).
SM80_HEAD_DIMS = (64, 128, 192, 256)
# Chosen from register reports (no spills under 255 registers) and timings on an H200
# (docs/decisions.md#fwd-sm80-tiles). Without score modifiers or dropout, 4 warps with two 16-row tiles each
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


def sm80_smem_bytes(tiles: Tiles, head_dim: int, head_dim_v: int | None = None) -> int:
    """Q tile plus two stages of K and V tiles (V of v's head dim), 16-bit elements."""
    head_dim_v = head_dim_v or head_dim
    return ((tiles.block_m + 2 * tiles.block_n) * head_dim + 2 * tiles.block_n * head_dim_v) * 2


def plan(dtype_name: str, head_dim: int, *, score_mods, dropout: bool, head_dim_v: int | None = None) -> LaunchPlan:
    """fwd_sm80's variant for a run-time head dim (rounded up to SM80_HEAD_DIMS) and v's (``head_dim_v``,
    default the same; any pair of SM80_HEAD_DIMS, with the tiles of the larger: docs/decisions.md,
    "A value head dim of its own")."""
    if dtype_name not in ("float16", "bfloat16"):
        raise ValueError(f"fwd_sm80 runs float16/bfloat16, not {dtype_name}")
    kdim = round_up(head_dim, SM80_HEAD_DIMS)
    kdim_v = round_up(head_dim_v or head_dim, SM80_HEAD_DIMS)
    tiles = (SM80_TILES_FEATURED if score_mod_bits(score_mods) or dropout else SM80_TILES)[max(kdim, kdim_v)]
    return tiled_plan("fwd_sm80", dtype_name, kdim, tiles, sm80_smem_bytes(tiles, kdim, kdim_v), score_mods=score_mods,
                      dropout=dropout, head_dim_v=kdim_v)
