"""work_order (cuda_src/work_order.cu): the order in which fwd_sm90 takes a block-masked call's
m-blocks and bwd_sm90 its key blocks, the longest walk first, and each one's bounds (the steps some
True block touches), worked out on the GPU from the block mask ahead of the kernel
(FwdParams::work_order, work_bounds)."""

from __future__ import annotations

from .._build.variant import Variant
from .._runtime.params import WORK_ORDER_PARAMS

WORK_ORDER_THREADS = (128, 1024)   # cuda_src/work_order.cu kWalkThreads, kRankThreads: by phase
WORK_ORDER_MAX_TILES = 4096   # kWorkOrderMaxTiles: the m-blocks or key blocks of one (sequence, head)
#: Calls whose kernel has fewer CTAs' worth of tiles than this many waves keep the causal order: with
#: every tile in the first wave, which tile goes first changes little, and the order costs a launch.
WORK_ORDER_MIN_WAVES = 2


def work_order_variant(phase: int) -> Variant:
    """The work order's two launches: phase 0 counts each tile's walk (a CTA of WORK_ORDER_THREADS[0] a
    tile), phase 1 ranks a slice's tiles (a CTA of WORK_ORDER_THREADS[1] a slice)."""
    return Variant("work_order", {"CUFLASH_WORK_ORDER_PARAMS_SIZE": WORK_ORDER_PARAMS.itemsize,
                                  "CUFLASH_WORK_ORDER_PHASE": phase})


def takes_work_order(tiles: int, pairs: int, wave: int) -> bool:
    """Whether a block-masked call's kernel takes its ``tiles`` per (sequence, head) in the work order:
    ``pairs`` (sequence, head) pairs of them against ``wave`` CTAs at once."""
    return 1 < tiles <= WORK_ORDER_MAX_TILES and tiles * pairs >= WORK_ORDER_MIN_WAVES * wave
