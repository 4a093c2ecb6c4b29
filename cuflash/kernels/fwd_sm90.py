"""fwd_sm90 (cuda_src/fwd_sm90.cu): wgmma, TMA loads on mbarriers and warp specialisation (one
producer warpgroup, two or three consumers), persistent CTAs; float16/bfloat16 on sm_90a."""

from __future__ import annotations

from .common import LaunchPlan, round_up
from .._runtime.params import FWD_PARAMS
from .._build.variant import Variant
from ..features import DTYPE_CODES, USER_MOD_BITS, score_mod_bits

# Hopper (sm_90a): 2 consumer warpgroups x 64 rows (3 for long full rows at D = 64:
# sm90_consumers), 2 K/V stages. Up to D = 128, S tiles of 128 keys and Q double buffered (the next
# item's Q loads while this one computes); D = 256 fits shared memory only with one Q buffer and
# 64-key tiles (64 + 2 x 2 x 32 KB). Measured and not taken
# (docs/decisions.md#fwd-sm90-tiles-and-stages): 80-key tiles at D = 256 (faster from 8k keys, but they
# spill), 176/192-key tiles at D = 128/64, three consumers at D = 64 for every shape.
SM90_HEAD_DIMS = (64, 128, 256)
# Consumer warpgroups of 64 query rows each: two, or three (192 rows a CTA) where sm90_consumers says.
SM90_WIDE_HEAD_DIMS = (64,)
SM90_WIDE_MIN_ROWS = 2048
SM90_BLOCK_N = {64: 128, 128: 128, 256: 64}
# With a user ScoreMod/MaskMod, 64-key tiles: a consumer holds half the scores (at D = 64 and 128), which leaves
# room for the expression's reads (a document mask over 128-key tiles spilled 228 B, with a relative
# bias table 496 B, 108 B at D = 64; over 64-key tiles none).
SM90_BLOCK_N_USER = {64: 64, 128: 64, 256: 64}
SM90_Q_SLOTS = {64: 2, 128: 2, 256: 1}
# K/V ring depth. D = 64 has room for 4: with the speculative softmax, a stage's V is released only
# after the next tile's exponentials, and 2 stages left the producer waiting (same-run A/B, 8k keys:
# 0.99 -> 1.02 of cuDNN, 1k 0.89 -> 0.96).
SM90_STAGES = {64: 4, 128: 2, 256: 2}


def sm90_consumers(head_dim: int, *, featured: bool, full: bool, seqlen_q: int) -> int:
    """Consumer warpgroups of fwd_sm90 for a problem (its CTA computes 64 query rows per consumer):
    ``head_dim`` the run-time one, ``featured`` with score modifiers or dropout, ``full`` without a
    causal or window mask.

    Three at D = 64 without score modifiers or dropout, for attention without a causal or
    window mask over at least SM90_WIDE_MIN_ROWS query rows; two otherwise. At D = 64 a tile's
    exponentials cost about as much as its products, and a third warpgroup keeps the tensor cores
    busy while the others take theirs (H100, bf16, ratio to cuDNN, two / three: 2k 1.01 / 1.05,
    8k 1.03 / 1.11, 16k 1.01 / 1.10). Causal rows and short sequences lose on 192-row tiles (the
    diagonal's masked half, a last m-block of 64 rows at 1k): causal 1k 0.94 / 0.76, 4k 1.00 / 0.94,
    full 1k 0.99 / 0.96. The three-warpgroup variant has 160 registers per consumer thread, too few
    for the score modifiers (140 B of spills) and for the speculative softmax's second P.
    """
    wide = (round_up(head_dim, SM90_HEAD_DIMS) in SM90_WIDE_HEAD_DIMS and not featured and full
            and seqlen_q >= SM90_WIDE_MIN_ROWS)
    return 3 if wide else 2


FWD_TAIL_WAVES = 2


def fwd_tail_heads(m_blocks: int, pairs: int, wave_ctas: int, *, shrinking: bool) -> int:
    """How many of the last (head, sequence) pairs of fwd_sm90's work items are numbered
    m-block-major (cuda_src/fwd_sm90.cu, WorkItem::of) instead of head by head; 0 for none.
    ``m_blocks``: m-blocks per head, ``pairs``: heads x sequences, ``wave_ctas``: the persistent
    CTAs (one per SM).

    ``shrinking``: a head's m-blocks are taken longest first and each is shorter than the one
    before (a causal mask: the window bounded on the right only). Each CTA claims its next item as
    it starts one, so the heads taken last leave their longest m-blocks running alone at the end
    of the call: a model of that dispatch (benchmarks/experiments/fwd_dispatch_model.py) puts
    causal calls from 1k to 16k at 0.90-0.95 of the ideal makespan, and at 0.97-0.98 with the last
    FWD_TAIL_WAVES waves' worth of pairs m-block-major (measured on an H100, two waves: D = 64
    causal 1k +6%, D = 128 4k-8k +8%, D = 256 2k-8k +12-14%). Only those: each of them reads its
    head's K/V at its own pace (at D = 256 16k, three waves' worth of heads already ran slower than
    one).
    """
    if not shrinking or m_blocks <= 1:
        return 0
    return min(pairs, -(-FWD_TAIL_WAVES * wave_ctas // m_blocks))


def sm90_smem_bytes(head_dim: int, consumers: int = 2, block_n: int | None = None) -> int:
    """1 KB of slack to align the swizzled tiles, the Q slots, kStages of K and V, and the staged
    output (16-bit elements), for a compiled head dim of SM90_HEAD_DIMS (``block_n``: keys per tile,
    default SM90_BLOCK_N's)."""
    block_m = 64 * consumers
    block_n = block_n or SM90_BLOCK_N[head_dim]
    q_bytes = SM90_Q_SLOTS[head_dim] * block_m * head_dim * 2
    out_bytes = block_m * min(head_dim, 128) * 2  # the output, staged <= 128 columns at a time
    return 1024 + q_bytes + 2 * SM90_STAGES[head_dim] * block_n * head_dim * 2 + out_bytes


def value_head_dim_obstacle(head_dim: int, head_dim_v: int | None) -> str | None:
    """Why fwd_sm90 cannot run v with head dim ``head_dim_v`` beside q's ``head_dim`` (run-time, padded
    to 8), or None: its kernel has one head dim for Q, K, V and O (docs/decisions.md, "A value head dim
    of its own"); such calls run on fwd_sm80."""
    if head_dim_v is None or head_dim_v == head_dim:
        return None
    return (f"fwd_sm90 runs v with the head dim of q and k only, not the pair (D_qk, D_v) = ({head_dim}, "
            f"{head_dim_v}); fwd_sm80 runs it")


def plan(dtype_name: str, head_dim: int, *, score_mods, dropout: bool, consumers: int = 2,
         head_dim_v: int | None = None) -> LaunchPlan:
    """fwd_sm90's variant for a run-time head dim (rounded up to SM90_HEAD_DIMS) and its consumer
    warpgroups (:func:`sm90_consumers`). ``head_dim_v`` must equal ``head_dim`` (or be None)."""
    if dtype_name not in ("float16", "bfloat16"):
        raise ValueError(f"fwd_sm90 runs float16/bfloat16, not {dtype_name}")
    obstacle = value_head_dim_obstacle(head_dim, head_dim_v)
    if obstacle is not None:
        raise ValueError(obstacle)
    mods = score_mod_bits(score_mods)
    kdim = round_up(head_dim, SM90_HEAD_DIMS)
    if consumers not in (2, 3) or consumers == 3 and (kdim not in SM90_WIDE_HEAD_DIMS or mods or dropout):
        raise ValueError(f"fwd_sm90 runs 2 consumer warpgroups, or 3 at head dims {SM90_WIDE_HEAD_DIMS} without "
                         f"score modifiers or dropout; got {consumers} at head dim {kdim}")
    block_n = (SM90_BLOCK_N_USER if mods & USER_MOD_BITS else SM90_BLOCK_N)[kdim]
    smem = sm90_smem_bytes(kdim, consumers, block_n)
    defines = {
        "CUFLASH_DTYPE": DTYPE_CODES[dtype_name],
        "CUFLASH_HEAD_DIM": kdim,
        "CUFLASH_BLOCK_N": block_n,
        "CUFLASH_Q_SLOTS": SM90_Q_SLOTS[kdim],
        "CUFLASH_STAGES": SM90_STAGES[kdim],
        "CUFLASH_CONSUMERS": consumers,
        "CUFLASH_SCORE_MODS": mods,
        "CUFLASH_DROPOUT": int(dropout),
        "CUFLASH_SMEM_BYTES": smem,
        "CUFLASH_PARAMS_SIZE": FWD_PARAMS.itemsize,
    }
    return LaunchPlan(Variant("fwd_sm90", tuple(sorted(defines.items()))), 64 * consumers, 128 * (consumers + 1),
                      smem, kdim)
