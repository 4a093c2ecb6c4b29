"""bwd_sm80 (cuda_src/bwd_sm80.cu): the backward's two passes (dK/dV, and dQ in deterministic mode)
with mma.sync tiles, float16/bfloat16 on sm_80 and later; bwd_sm90's dQ pass where it does not order
dQ itself."""

from __future__ import annotations

from .bwd_common import BwdTiles, tiled_plan
from .common import LaunchPlan, round_up
from .fwd_sm80 import SM80_HEAD_DIMS
from ..features import score_mod_bits

# From ptxas reports (no spills under 255 registers for sm_80 and sm_90a): the dK/dV pass holds two
# accumulators of 16 rows x head_dim per warp, so D = 128 runs S/dP in slices of 32 columns (16
# with score modifiers or dropout, whose per-element work needs registers too), and D >= 192 splits
# the head dim over the warps of a row group. pass 0 needs block_c in {64, 128} (dS^T swizzle).
# Shared memory: every tile fits the 163 KiB of an A100 except the D = 256 dK/dV pass (165 KiB,
# H100/H200); backward() says so instead of failing at launch on smaller GPUs.
BWD_SM80_DKDV_TILES = {
    64: BwdTiles(128, 64, 64, 8),
    128: BwdTiles(128, 64, 32, 8),
    192: BwdTiles(64, 64, 32, 8, dsplit=2),
    256: BwdTiles(32, 64, 32, 8, dsplit=4),
}
BWD_SM80_DKDV_TILES_FEATURED = {
    64: BwdTiles(128, 64, 32, 8),
    128: BwdTiles(128, 64, 16, 8),
    192: BwdTiles(64, 64, 16, 8, dsplit=2),
    256: BwdTiles(32, 64, 32, 8, dsplit=4),
}
BWD_SM80_DQ_TILES = {
    64: BwdTiles(128, 64, 64, 8),
    128: BwdTiles(128, 64, 64, 8),
    192: BwdTiles(128, 32, 32, 8),
    256: BwdTiles(64, 32, 32, 4),
}
BWD_SM80_DQ_TILES_FEATURED = {
    64: BwdTiles(128, 64, 64, 8),
    128: BwdTiles(128, 64, 64, 8),
    192: BwdTiles(128, 32, 32, 8),
    256: BwdTiles(64, 32, 32, 4),
}
# With score modifiers the dQ pass takes its streamed tile in narrower slices, one at a time
# (cuda_src/bwd_sm80.cu): with whole-tile slices their per-element state spilled (D = 128 on sm_80,
# D = 256 with a mask on sm_90a).
BWD_SM80_DQ_TILES_MODS = {
    64: BwdTiles(128, 64, 32, 8),
    128: BwdTiles(128, 64, 32, 8),
    192: BwdTiles(128, 32, 16, 8),
    256: BwdTiles(64, 32, 16, 4),
}


def bwd_sm80_smem_bytes(tiles: BwdTiles, head_dim: int, dq_pass: bool, head_dim_v: int | None = None) -> int:
    """Kept tiles (2), two stages of streamed tiles (2 each; V and dO of v's head dim), and for the
    dK/dV pass dS^T (16-bit) plus two stages of lse2 and D (float32). Mirrors BwdSm80Config::kSmemBytes."""
    dims = head_dim + (head_dim_v or head_dim)
    elems = tiles.block_r * dims + 2 * tiles.block_c * dims
    if dq_pass:
        return 2 * elems
    return 2 * (elems + tiles.block_r * tiles.block_c) + 4 * 4 * tiles.block_c


def plan(dtype_name: str, head_dim: int, *, dq_pass: bool, score_mods, dropout: bool,
         head_dim_v: int | None = None) -> LaunchPlan:
    """One pass of bwd_sm80 at a run-time head dim (rounded up to SM80_HEAD_DIMS) and v's
    (``head_dim_v``, default the same), with the tiles of the larger."""
    if dtype_name not in ("float16", "bfloat16"):
        raise ValueError(f"bwd_sm80 runs float16/bfloat16, not {dtype_name}")
    kdim_v = round_up(head_dim_v or head_dim, SM80_HEAD_DIMS)
    kdim = round_up(head_dim, SM80_HEAD_DIMS)
    tile_dim = max(kdim, kdim_v)
    mods = score_mod_bits(score_mods)
    featured = bool(mods or dropout)
    if dq_pass:
        table = BWD_SM80_DQ_TILES_MODS if mods else BWD_SM80_DQ_TILES_FEATURED if featured else BWD_SM80_DQ_TILES
        tiles = table[tile_dim]
    else:
        tiles = (BWD_SM80_DKDV_TILES_FEATURED if featured else BWD_SM80_DKDV_TILES)[tile_dim]
    return tiled_plan("bwd_sm80", dtype_name, kdim, tiles, bwd_sm80_smem_bytes(tiles, kdim, dq_pass, kdim_v),
                      dq_pass=dq_pass, score_mods=score_mods, dropout=dropout, head_dim_v=kdim_v,
                      CUFLASH_BLOCK_C=tiles.block_c,
                      CUFLASH_SUB_C=tiles.sub_c, CUFLASH_WARPS=tiles.warps, CUFLASH_DSPLIT=tiles.dsplit)
