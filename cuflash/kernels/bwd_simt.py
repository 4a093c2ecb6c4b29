"""bwd_simt (cuda_src/bwd_simt.cu): the backward's two passes with FFMA tiles in float32, on any GPU."""

from __future__ import annotations

from .bwd_common import BwdTiles, tiled_plan
from .common import LaunchPlan, round_up
from .fwd_simt import SIMT_HEAD_DIMS

def _bwd_simt_tiles(head_dim: int) -> BwdTiles:
    # 4 warps, 32 streamed rows; 32 kept rows, or 16 for head dims whose accumulators need it.
    return BwdTiles(32 if head_dim <= 160 else 16, 32, 32, 4)


def bwd_simt_smem_bytes(tiles: BwdTiles, head_dim: int, dq_pass: bool, head_dim_v: int | None = None) -> int:
    """float32 tiles with rows padded by 4: kept (2), streamed (2; V and dO of v's head dim), dS (and
    P^T), lse2/D (pass 0). Mirrors BwdSimtConfig::kSmemBytes."""
    strides, w_stride = head_dim + 4 + (head_dim_v or head_dim) + 4, tiles.block_c + 1
    floats = tiles.block_r * strides + tiles.block_c * strides
    floats += (1 if dq_pass else 2) * tiles.block_r * w_stride + (0 if dq_pass else 2 * tiles.block_c)
    return 4 * floats


def plan(dtype_name: str, head_dim: int, *, dq_pass: bool, score_mods, dropout: bool,
         head_dim_v: int | None = None) -> LaunchPlan:
    """One pass of bwd_simt at a run-time head dim (rounded up to SIMT_HEAD_DIMS) and v's
    (``head_dim_v``, default the same; any pair), with the kept rows of the larger."""
    if dtype_name != "float32":
        raise ValueError(f"bwd_simt runs float32, not {dtype_name}")
    kdim = round_up(head_dim, SIMT_HEAD_DIMS)
    kdim_v = round_up(head_dim_v or head_dim, SIMT_HEAD_DIMS)
    tiles = _bwd_simt_tiles(max(kdim, kdim_v))
    return tiled_plan("bwd_simt", dtype_name, kdim, tiles, bwd_simt_smem_bytes(tiles, kdim, dq_pass, kdim_v),
                      dq_pass=dq_pass, score_mods=score_mods, dropout=dropout, head_dim_v=kdim_v)
