"""What the backward families share (cuda_src/bwd_common.cuh, bwd_params.cuh), and the two small
kernels around them: D = rowsum(dO * O) before (cuda_src/bwd_preprocess.cu) and the float32
accumulators' conversion after (cuda_src/bwd_convert.cu).

The dK/dV pass ("pass 0") keeps block_r keys per CTA and streams the queries; the dQ pass ("pass 1",
deterministic mode where bwd_sm90 does not order dQ itself) keeps block_r queries and streams the
keys. cuflash/backward.py builds the launch sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from .common import LaunchPlan, value_head_dim_defines
from .._runtime.params import BWD_PARAMS, CONVERT_PARAMS, FWD_PARAMS
from .._build.variant import Variant
from ..features import DTYPE_CODES, score_mod_bits

#: Rows of the lse2 / dsum buffers per (sequence, head) are padded to a multiple of this, which is
#: a multiple of every backward block size, so the passes read whole tiles without bounds checks.
BWD_ROW_PAD = 128


@dataclass(frozen=True)
class BwdTiles:
    """One backward CTA's shape.

    block_r: rows the CTA keeps (keys in the dK/dV pass, queries in the dQ pass), 16 per warp row;
    block_c: rows streamed per step; sub_c: columns of S/dP held in registers at once (sm80);
    warps; dsplit: warps that share 16 kept rows and split the head-dim columns of the
    accumulators (large head dims); min_blocks: CTAs per SM the register budget aims at.
    """

    block_r: int
    block_c: int
    sub_c: int
    warps: int
    dsplit: int = 1
    min_blocks: int = 1


def size_defines() -> dict:
    """The parameter structs' sizes every backward kernel static_asserts."""
    return {"CUFLASH_PARAMS_SIZE": FWD_PARAMS.itemsize, "CUFLASH_BWD_PARAMS_SIZE": BWD_PARAMS.itemsize,
            "CUFLASH_CONVERT_PARAMS_SIZE": CONVERT_PARAMS.itemsize}


def tiled_plan(family: str, dtype_name: str, head_dim: int, tiles: BwdTiles, smem: int, *, dq_pass: bool,
               score_mods, dropout: bool, head_dim_v: int | None = None, **defines) -> LaunchPlan:
    """The launch plan of one pass of a backward family whose CTA shape is a :class:`BwdTiles`
    (bwd_sm80, bwd_simt), for a compiled head dim (and v's, ``head_dim_v``, when it differs);
    ``defines``: the family's own."""
    defines = {
        **value_head_dim_defines(head_dim, head_dim_v),
        "CUFLASH_DTYPE": DTYPE_CODES[dtype_name],
        "CUFLASH_HEAD_DIM": head_dim,
        "CUFLASH_BLOCK_R": tiles.block_r,
        "CUFLASH_MIN_BLOCKS": tiles.min_blocks,
        "CUFLASH_BWD_PASS": int(dq_pass),
        "CUFLASH_SCORE_MODS": score_mod_bits(score_mods),
        "CUFLASH_DROPOUT": int(dropout),
        "CUFLASH_SMEM_BYTES": smem,
        **size_defines(),
        **defines,
    }
    return LaunchPlan(Variant(family, tuple(sorted(defines.items()))), tiles.block_r, 32 * tiles.warps, smem,
                      head_dim, head_dim_v if head_dim_v not in (None, head_dim) else 0)


def bwd_preprocess_variant(dtype_name: str, dq_first_stores: bool = False) -> Variant:
    """D = rowsum(dO * O) and lse2 (cuda_src/bwd_preprocess.cu); grid (rows_pad / 16, Hq, B) x 128.
    ``dq_first_stores``: dq_accum not zeroed, bwd_sm90's first writer of each tile stores it
    (:func:`cuflash.kernels.bwd_sm90.bwd_sm90_first_stores_dq`)."""
    defines = {"CUFLASH_DTYPE": DTYPE_CODES[dtype_name], **size_defines()}
    if dq_first_stores:   # (only such variants carry it)
        defines["CUFLASH_DQ_FIRST_STORES"] = 1
    return Variant("bwd_preprocess", defines)


def bwd_dsinks_variant() -> Variant:
    """dL/dsinks summed per head from bwd_preprocess's per-CTA sums (cuda_src/bwd_dsinks.cu); grid (Hq,)
    x :data:`BWD_DSINKS_THREADS`. One variant for every dtype (it adds float32)."""
    return Variant("bwd_dsinks", size_defines())


#: Threads of a bwd_dsinks CTA (cuda_src/bwd_dsinks.cu, kDsinkThreads).
BWD_DSINKS_THREADS = 256


def bwd_convert_variant(dtype_name: str) -> Variant:
    """float32 accumulators to the output dtype (cuda_src/bwd_convert.cu); 256 threads, 8 rows each."""
    return Variant("bwd_convert", {"CUFLASH_DTYPE": DTYPE_CODES[dtype_name], **size_defines()})


def backward_heads_per_cta(batch: int, heads_k: int, group: int, key_blocks: int, num_sms: int) -> int:
    """Query heads whose dK/dV one CTA of the dK/dV pass sums (a divisor of ``group`` = Hq / Hk).

    The whole group (no partial buffers, no extra pass) unless that leaves fewer CTAs than SMs, as
    with MQA on short sequences; then the group is split into the fewest chunks that fill the GPU,
    each writing float32 partial sums that bwd_convert adds in a fixed order.
    """
    ctas = max(1, batch * heads_k * key_blocks)
    for splits in range(1, group + 1):
        if group % splits == 0 and (ctas * splits >= num_sms or splits == group):
            return group // splits
    return 1


# Waves of CTAs whose (slot, sequence) pairs a causal backward pass takes block by block at the end
# of its grid (bwd_tail_pairs).
BWD_TAIL_WAVES = 2


def bwd_tail_pairs(blocks: int, pairs: int, wave_ctas: int, *, shrinking: bool, ordered: bool) -> int:
    """How many of the last (slot, sequence) pairs of a backward pass's grid (``blocks`` row blocks
    by ``pairs``) start block by block (cuda_src/bwd_common.cuh, bwd_grid_place) instead of head by
    head; 0 for none. ``wave_ctas``: CTAs the GPU runs at once (SMs x CTAs per SM).

    ``shrinking``: each block's walk is shorter than the one dispatched before it (a causal mask:
    the window bounded on the right only). Taken head by head, the heads started last then leave
    their first, heaviest blocks running alone at the end of the call: a model of the dispatch
    (benchmarks/experiments/bwd_dispatch_model.py) puts bwd_sm90 at D = 128 causal at 0.94-0.95 of
    the ideal from 1k to 8k tokens, and at 0.98-0.99 with the last BWD_TAIL_WAVES waves' worth of
    pairs taken block by block (measured on an H100: 3-6% faster at D = 128 and 256). Only those:
    every head in flight reads its own Q and dO, and block-major throughout keeps ~130 heads in
    flight, more than L2 holds (0.6x as fast). Ordered dQ (``ordered``) dispatches by its own order
    (cuda_src/dq_order.cuh).
    """
    if not shrinking or ordered:
        return 0
    return min(pairs, -(-BWD_TAIL_WAVES * wave_ctas // max(1, blocks)))
