"""fwd_simt (cuda_src/fwd_simt.cu): FFMA tiles in float32, on any GPU; the forward of float32 inputs."""

from __future__ import annotations

from .common import LaunchPlan, Tiles, round_up, tiled_plan

# Head dims the kernel is compiled for; a run-time head dim is zero-padded up to the next one.
SIMT_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
# fp32 SIMT: 4 warps up to D=128; 8 warps above keep registers well under 255 (same smem).
SIMT_TILES = {32: Tiles(64, 32, 4), 64: Tiles(64, 32, 4), 96: Tiles(64, 32, 4), 128: Tiles(64, 32, 4),
              160: Tiles(64, 32, 8), 192: Tiles(64, 32, 8), 224: Tiles(64, 32, 8), 256: Tiles(64, 32, 8)}


def simt_smem_bytes(tiles: Tiles, head_dim: int, head_dim_v: int | None = None) -> int:
    """Q tile, one K and one V tile (v's head dim), and the P tile, float32 elements."""
    head_dim_v = head_dim_v or head_dim
    return (tiles.block_m * head_dim + tiles.block_n * (head_dim + head_dim_v) + tiles.block_m * tiles.block_n) * 4


def plan(dtype_name: str, head_dim: int, *, score_mods, dropout: bool, head_dim_v: int | None = None) -> LaunchPlan:
    """fwd_simt's variant for a run-time head dim (rounded up to SIMT_HEAD_DIMS) and v's (``head_dim_v``,
    default the same; any pair of SIMT_HEAD_DIMS, the tiles of the larger)."""
    if dtype_name != "float32":
        raise ValueError(f"fwd_simt runs float32, not {dtype_name}")
    kdim = round_up(head_dim, SIMT_HEAD_DIMS)
    kdim_v = round_up(head_dim_v or head_dim, SIMT_HEAD_DIMS)
    tiles = SIMT_TILES[max(kdim, kdim_v)]
    return tiled_plan("fwd_simt", dtype_name, kdim, tiles, simt_smem_bytes(tiles, kdim, kdim_v), score_mods=score_mods,
                      dropout=dropout, head_dim_v=kdim_v)
