"""bwd_sm90 (cuda_src/bwd_sm90.cu): the dK/dV pass on sm_90a with wgmma, TMA and warp
specialisation, adding dQ itself (in any order, or in a fixed one for deterministic=True where it
can; else bwd_sm80's dQ pass follows it); float16/bfloat16."""

from __future__ import annotations

from .bwd_common import size_defines
from .common import SCORE_TILE_BYTES, LaunchPlan, round_up
from .._build.variant import Variant
from ..features import DTYPE_CODES, score_mod_bits

#: Score modifiers that bwd_sm90 applies in place from D = 128, each alone (BwdSm90Config::kScoresInPlace).
#: Not the bias or the mask: their loads beside the plain tiles spilled 12-124 B at D = 128.
IN_PLACE_MODS = tuple(score_mod_bits((name,)) for name in ("softcap", "alibi", "block_mask"))

# bwd_sm90 (cuda_src/bwd_sm90.cu): 128 keys per CTA (64 per consumer warpgroup); query rows per step
# such that each consumer's share of dQ is 64 x 64 (D = 64: 128 rows split by rows; D = 128: 64 rows
# split by columns, or without a window 80 rows, each consumer 64 columns of dQ^T). At D = 256, 64
# keys per CTA whose dK/dV columns the consumers split (64 rows per step, two 64 x 64 shares of dQ
# each). Shared memory: K, V, kStages x (Q, dO), two dS^T (or P^T and dS^T) tiles, the dQ staging
# of both consumers (at D = 256 in the step's Q and dO buffers).
# With score modifiers or dropout ("featured") the consumers need smaller accumulators
# (BwdSm90Config::kFeatured): D = 128 splits the columns as D = 256 does (64 keys per CTA), D = 64
# takes 64 query rows per step (each consumer adds dQ over its own keys). The softcap, ALiBi or the
# block mask alone from D = 128 are not featured (bwd_sm90_featured).
BWD_SM90_HEAD_DIMS = (64, 128, 256)
#: (D_qk, D_v) pairs of compiled head dims bwd_sm90 runs beside the square ones (CUFLASH_HEAD_DIM_V),
#: mapped to whether they run with score modifiers or dropout too. The tiles and the consumers'
#: split follow D_qk's, except that (64, 128) takes 64 query rows per step (D = 64's featured tiles:
#: with 128 its dV of 128 columns would not fit beside S^T and dP^T) and no pair takes
#: BWD_SM90_WIDE_BLOCK_M's rows ((128, 64) spilled 60 B there with its dQ handed over, and without the
#: hand-over ran no faster than with 64: docs/decisions.md). A consumer's dV
#: must be 64 or 128 columns wide (its wgmma n, and dO's 64-column blocks where the consumers split
#: the columns): so not (128, 64) featured (split by columns, 32 each), nor a 256 beside a 64.
#: (64, 128) featured spilled 80-112 B (NVRTC 13): bwd_sm80 runs it. DeepSeek's (192, 128) is compiled
#: as it is (compiled_head_dims): split by columns like 256, consumer 0 with dK's and dQ's first 128
#: columns, consumer 1 with their last 64 and dV's 128 (cuda_src/bwd_sm90.cu, split_dk_cols); other
#: Q/K dims from 129 to 256 beside a V of 128 run as (256, 128), the last columns zero-filled by TMA.
BWD_SM90_PAIRS = {(192, 128): True, (256, 128): True, (128, 64): False, (64, 128): False}
# The producer hands the consumers (flag, query head, query tile) in one int (cuda_src/bwd_sm90.cu:
# bit 30 a tile whose blocks hide nothing, the head from bit 16): fewer query heads than this.
BWD_SM90_MAX_HEADS = 1 << 14
BWD_SM90_THREADS = 384
BWD_SM90_BLOCK_N = {64: 128, 128: 128, 192: 64, 256: 64}
BWD_SM90_BLOCK_M = {64: 128, 128: 64, 192: 64, 256: 64}
#: Query rows per step without a window (no causal mask), score modifiers, dropout nor ordered dQ,
#: from BWD_SM90_WIDE_MIN_ROWS query rows: 80 at D = 128 (FlashAttention-3's 80 x 128; each consumer
#: then computes dQ transposed and hands it to a writer warp, BwdSm90Config::kDqHandOver). H200 bf16,
#: against the 80-row steps whose consumers added dQ themselves: 8k and 16k +5-7%; against 64-row
#: steps (which hand their dQ over one step late) at 1k-4k: 0 to +4%. 512 rows stay at 64 (a trial
#: of 80 there lost 2.5%: the last tile's padding is 9% of the rows). Calls whose tiles keep dS's
#: guard (varlen: kDqHandOver spilled there, the consumers add dQ themselves) wait for
#: BWD_SM90_WIDE_MIN_ROWS_GUARDED rows, where such 80-row steps were level with 64
#: (docs/decisions.md#bwd-sm90-80-row-steps). The ordered dQ of deterministic=True keeps 64: its writers need double-buffered
#: shares, for which 80 rows leave no shared memory (and its consumers spilled in a single-buffered trial).
BWD_SM90_WIDE_BLOCK_M = {128: 80}
BWD_SM90_WIDE_MIN_ROWS = 1024
BWD_SM90_WIDE_MIN_ROWS_GUARDED = 8192
BWD_SM90_FEATURED_BLOCK_N = {64: 128, 128: 64, 192: 64, 256: 64}
BWD_SM90_FEATURED_BLOCK_M = {64: 64, 128: 64, 192: 64, 256: 64}
#: (192: three, cuda_src/bwd_sm90.cu's consume_dim_pipelined holds a stage for two steps.)
BWD_SM90_STAGES = {64: 2, 128: 2, 192: 3, 256: 2}
#: Stages of the D = 128 variants with 64-row steps that add dQ in any order (BwdSm90Config::kDeferDq,
#: kDqAsync), not featured: 3 leaves shared memory for one dQ share buffer per consumer instead of
#: two. With the lag between the consumers a stage comes back ~0.45 of a step later, and the copy of
#: the stage after next then arrives late (consumers wait ~4.5% of a step more than in lockstep;
#: docs/decisions.md#bwd-sm90-stage-count). Measured with 3 (H200 bf16): 8k causal +1.2%, every
#: other shape from 1k to 16k within the controls' spread; so 2.
BWD_SM90_DEFER_STAGES = 2
#: Head dims whose bwd_sm90 adds dQ in a fixed order under deterministic=True (cuda_src/dq_order.cuh),
#: without score modifiers and dropout; at D = 64 the order's bookkeeping made the consumers spill,
#: and bwd_sm80's dQ pass computes dQ.
BWD_SM90_ORDERED_HEAD_DIMS = (128,)


#: A bias or mask alone read as TMA tiles (takes_score_tiles): at this compiled head dim (square).
BWD_SM90_SCORE_TILE_HEAD_DIM = 128


def takes_score_tiles(head_dim: int, score_mods, dropout: bool, deterministic, head_dim_v: int | None = None) -> bool:
    """Whether bwd_sm90 can read a call's one score modifier, a bias or a mask, as tiles that its producer
    loads by TMA into each stage (CUFLASH_SCORE_TILE; the layout is :func:`fwd_sm90.score_tile_layout`'s
    to check): at BWD_SM90_SCORE_TILE_HEAD_DIM, v's the same, without dropout, dQ added in no fixed
    order. The plain tiles then modify S^T in place, as for ALiBi, with one dQ share buffer."""
    kdim, kdim_v = compiled_head_dims(head_dim, head_dim_v)
    return (tuple(score_mods) in (("bias",), ("mask",)) and kdim == kdim_v == BWD_SM90_SCORE_TILE_HEAD_DIM
            and not dropout and deterministic is False)


def bwd_sm90_featured(head_dim: int, mods: int, dropout: bool) -> bool:
    """Whether a bwd_sm90 variant at a compiled head dim takes the featured tiles: dropout, several
    score modifiers, a user one, the bias or the mask (``mods``: CUFLASH_SCORE_MODS bits). From D = 128
    the softcap, ALiBi or the block mask alone keep the plain tiles, modifying the scores in place (the
    softcap's derivative recovered from P: cuda_src/bwd_sm90.cu, BwdSm90Config::kScoresInPlace); at
    D = 64 the plain tiles of 128 query rows spilled 44-80 B with the softcap.
    """
    return bool(dropout or (mods and (mods not in IN_PLACE_MODS or head_dim < 128)))


def bwd_sm90_tiles(head_dim: int, featured: bool = False, wide: bool = False,
                   head_dim_v: int | None = None) -> tuple[int, int]:
    """(keys per CTA, query rows per step) of bwd_sm90 at a compiled head dim; featured: with score
    modifiers or dropout; wide: a call that may take BWD_SM90_WIDE_BLOCK_M's rows (no window, score
    modifier, dropout nor ordered dQ); head_dim_v: v's compiled head dim (BWD_SM90_PAIRS)."""
    if (head_dim, head_dim_v) == (64, 128):
        featured = True   # its tiles: 64 query rows per step
    if head_dim_v not in (None, head_dim):
        wide = False
    if featured:
        return BWD_SM90_FEATURED_BLOCK_N[head_dim], BWD_SM90_FEATURED_BLOCK_M[head_dim]
    if wide and head_dim in BWD_SM90_WIDE_BLOCK_M:
        return BWD_SM90_BLOCK_N[head_dim], BWD_SM90_WIDE_BLOCK_M[head_dim]
    return BWD_SM90_BLOCK_N[head_dim], BWD_SM90_BLOCK_M[head_dim]


def bwd_sm90_stages(head_dim: int, featured: bool = False, wide: bool = False, deterministic=False,
                    head_dim_v: int | None = None) -> int:
    """Stages of bwd_sm90's Q/dO ring at a compiled head dim (``deterministic`` as in backward_plan)."""
    block_m = bwd_sm90_tiles(head_dim, featured, wide, head_dim_v)[1]
    if head_dim == 128 and block_m == 64 and not featured and deterministic is False:
        return BWD_SM90_DEFER_STAGES
    return BWD_SM90_STAGES[head_dim]


def bwd_sm90_smem_bytes(head_dim: int, featured: bool = False, wide: bool = False, stages: int | None = None,
                        head_dim_v: int | None = None, tile_elem_bytes: int = 0, tile_one_row: bool = False) -> int:
    """Mirrors BwdSm90Config::kSmemBytes (1024 bytes of alignment slack included); ``stages``
    defaults to BWD_SM90_STAGES's, ``head_dim_v`` (v's compiled head dim) to ``head_dim``;
    ``tile_elem_bytes``: a score tile's element bytes (SCORE_TILE_BYTES), 0 for none; ``tile_one_row``: its
    tile one row, a 1 KiB block per 128 bytes of keys."""
    head_dim_v = head_dim_v or head_dim
    block_n, block_m = bwd_sm90_tiles(head_dim, featured, wide, head_dim_v)
    stages = BWD_SM90_STAGES[head_dim] if stages is None else stages
    k_v = 2 * block_n * (head_dim + head_dim_v)
    q_do, ds = 2 * block_m * (head_dim + head_dim_v), 2 * block_n * block_m
    split_dims = head_dim >= 192 or (head_dim == 128 and featured)
    # split by columns, consumer 0's float32 share of dQ passes through a Q buffer and consumer 1's
    # through a dO buffer, or, where that is too small, a buffer of its own (one consumer's at most)
    shares = [4 * block_m * split_dk_cols(head_dim, c) for c in (0, 1)]
    too_small = [shares[0] > 2 * block_m * head_dim, shares[1] > 2 * block_m * head_dim_v]
    dq_own = shares[too_small.index(True)] if split_dims and any(too_small) else 0
    transposed = block_m == 80   # dQ^T: a 64 x 80 share per consumer, single buffered
    # a float32 share of dQ per consumer and buffer (split by columns: in the Q/dO buffers; a third
    # stage at D = 128 leaves room for one buffer)
    dq_buffers = 0 if split_dims else 2 if head_dim == 128 and not transposed and stages == 2 and not tile_elem_bytes else 1
    dq_staging = 2 * dq_buffers * 64 * (block_m if transposed else 64) * 4
    tiles = stages * (1024 // 128 if tile_one_row else block_m) * block_n * tile_elem_bytes   # one a stage
    return 1024 + k_v + stages * q_do + 2 * ds + dq_staging + dq_own + tiles


def split_dk_cols(head_dim: int, consumer: int) -> int:
    """Columns of dK (and dQ) that ``consumer`` owns where bwd_sm90's consumers split the columns
    (mirrors cuda_src/bwd_sm90.cu's split_dk_cols: halves, or 128 and 64 at 192)."""
    return (128 if consumer == 0 else 64) if head_dim == 192 else head_dim // 2


def compiled_head_dims(head_dim: int, head_dim_v: int | None = None) -> tuple[int, int]:
    """bwd_sm90's compiled (Q/K, V) head dims of run-time ones (padded to 8; ``head_dim_v`` None:
    square): the next of BWD_SM90_HEAD_DIMS, except Q's and K's 192 beside a V of 128 (BWD_SM90_PAIRS)."""
    kdim_v = round_up(head_dim if head_dim_v is None else head_dim_v, BWD_SM90_HEAD_DIMS)
    if head_dim_v not in (None, head_dim) and kdim_v == 128 and 128 < head_dim <= 192:
        return 192, kdim_v
    return round_up(head_dim, BWD_SM90_HEAD_DIMS), kdim_v


def bwd_sm90_orders_dq(head_dim: int, featured: bool = False) -> bool:
    """Whether bwd_sm90 adds dQ in a fixed order under deterministic=True at this (padded) head dim
    (else bwd_sm80's dQ pass computes dQ after it); featured: with score modifiers or dropout."""
    return (not featured and head_dim <= max(BWD_SM90_HEAD_DIMS)
            and round_up(head_dim, BWD_SM90_HEAD_DIMS) in BWD_SM90_ORDERED_HEAD_DIMS)


def bwd_sm90_dq_mode(head_dim: int, featured: bool, deterministic: bool):
    """How bwd_sm90 adds dQ for a call (backward_plan's ``deterministic``): False, in any order;
    True, in a fixed order (bwd_sm90_orders_dq); "pass", not at all (bwd_sm80's dQ pass after it)."""
    if not deterministic:
        return False
    return True if bwd_sm90_orders_dq(head_dim, featured) else "pass"


def bwd_sm90_obstacle(head_dim: int, score_mods=(), dropout: bool = False, head_dim_v: int | None = None) -> str | None:
    """Why bwd_sm90 cannot run a backward with this (padded, multiple of 8) head dim, score
    modifiers and dropout, or None when it can: the head dim limits it (every combination of
    modifiers and dropout compiles without spills up to 256), and a value head dim of its own
    (``head_dim_v``) must make one of BWD_SM90_PAIRS once both are rounded up (other pairs run on
    bwd_sm80). (The caller also needs sm_90a and TMA-compatible layouts: cuflash/backward.py checks
    those.)"""
    if max(head_dim, head_dim_v or 0) > max(BWD_SM90_HEAD_DIMS):
        return f"bwd_sm90 runs head dims up to {max(BWD_SM90_HEAD_DIMS)}, not {max(head_dim, head_dim_v or 0)}"
    if head_dim_v is None or head_dim_v == head_dim:
        return None
    pair = compiled_head_dims(head_dim, head_dim_v)
    if pair[0] == pair[1]:
        return None
    # The plain pairs take what keeps the plain tiles: the softcap, ALiBi or the block mask alone from
    # D = 128 (bwd_sm90_featured); (128, 64) so compiles without spills.
    featured = bwd_sm90_featured(pair[0], score_mod_bits(score_mods), dropout)
    if pair not in BWD_SM90_PAIRS or (featured and not BWD_SM90_PAIRS[pair]):
        runs = ", ".join(f"{qk, v}" + ("" if any_options else " without dropout or score modifiers other than "
                                                              "one of the softcap, ALiBi and the block mask from 128")
                         for (qk, v), any_options in BWD_SM90_PAIRS.items())
        return (f"bwd_sm90 runs the head dim pairs (D_qk, D_v) {runs} (rounded up: compiled_head_dims), not "
                f"({head_dim}, {head_dim_v}){' with these score modifiers or dropout' if featured else ''}; bwd_sm80 "
                "runs it")
    return None


# Whether bwd_sm90 may take its variant without dS's guard for P = 0 (bwd_all_keys_seen), and the
# head dims where it does. H100, bf16, full attention, per call in turns beside cuDNN: D = 64 2k and
# 8k 2-4% faster, D = 128 8k and 16k (80 query rows) 1.4% (four rounds each); H200, settled turns
# (two rounds): D = 256 +1% at 2k, +2.5-3% at 4k, +0.1-0.4% at 8k and 16k; D = 128 with 64 query
# rows (2k, 4k) 0 to +0.4% (docs/decisions.md#bwd-sm90-unguarded-ds).
BWD_ALL_KEYS_SEEN = True
# (192: as 256, whose split by columns it shares; not measured on its own.)
BWD_SM90_UNGUARDED_HEAD_DIMS = (64, 128, 192, 256)
# Under a causal mask or window, without score modifiers or dropout, the guard tile by tile: a tile
# with no masked element and no row past the queries' end skips it (CUFLASH_TILE_GUARD). H200,
# settled turns, two rounds: D = 64 causal 4k and 16k +2.5-3.5%; D = 128 causal +1.5% at 2k, +1-4%
# at 4k, +3-4% at 8k, +5.5% at 16k, its ordered dQ at 8k +2-6%; D = 256 causal 2k-16k 5-7% slower,
# 7-12% with its P^T and dS^T stored tile after tile (docs/decisions.md#bwd-sm90-tile-guard): there the branch splits the one
# block after dP^T's wait in which ptxas interleaves the 16 exponentials a thread with the rest of
# the elementwise work, and they then run back to back. D = 256 keeps the guard.
BWD_SM90_TILE_GUARD = True
BWD_SM90_TILE_GUARD_HEAD_DIMS = (64, 128)


def bwd_sm90_tile_guard(head_dim: int) -> bool:
    """Whether a windowed bwd_sm90 call without score modifiers or dropout at this (padded) head dim
    decides dS's guard tile by tile (BWD_SM90_TILE_GUARD)."""
    return BWD_SM90_TILE_GUARD and head_dim in BWD_SM90_TILE_GUARD_HEAD_DIMS


def bwd_all_keys_seen(*, windowed: bool, varlen: bool, featured: bool) -> bool:
    """Whether every row of a backward call sees every key of the tiles it meets: no causal mask nor
    window, no varlen batch (whose tiles reach into the next sequence), no score modifier (mask,
    bias, block mask, ALiBi, softcap) nor dropout. Keys past the end come in as zeros. Then an
    element's P is 0 only by underflow, and dS = P (dP - D) needs no guard against a non-finite dP
    of an unseen key (cuda_src/bwd_common.cuh, element_grad)."""
    return BWD_ALL_KEYS_SEEN and not windowed and not varlen and not featured


# Whether bwd_sm90's dQ conversion may run behind it (bwd_convert_behind; False: always after it).
BWD_CONVERT_BEHIND = True


def bwd_convert_behind(*, shrinking: bool) -> bool:
    """Whether bwd_sm90's dQ conversion is launched as its programmatic dependent (sm_90): its CTAs
    then take the SMs that bwd_sm90's last wave leaves idle and convert each head once all of that
    head's dQ reductions have landed (cuda_src/bwd_convert.cu), instead of starting after the grid.

    Without a causal mask (``shrinking`` False) the grid's last wave runs half empty at D = 128 and
    256 (2048 CTAs are 15.5 waves of 132): H100, bf16, 2k tokens per sequence, per call 2% faster
    at D = 64 and 256, 0-1% at D = 128. A causal grid's last waves are full (bwd_tail_pairs), and
    there it measured 0-2% slower: not there.
    """
    return BWD_CONVERT_BEHIND and not shrinking


#: bwd_sm90's first dQ writer of each tile stores it (CUFLASH_BWD_DQ_FIRST_STORES, bwd_sm90_first_stores_dq);
#: False for an A/B against dq_accum zeroed by bwd_preprocess.
BWD_SM90_DQ_FIRST_STORES = True
#: ... up to this many keys: beyond, the zeroing saved is a small share of the call and the gain was
#: lost in the noise (per call x zeroed, two runs, D 128 causal: 1k 1.028-1.031, 2k 1.025-1.028, GQA 32/8
#: 2k 1.036-1.037; 4k 1.007-1.030, 16k 0.969-1.027, window 1024 8k 1.001-1.002, and with softcap 0.977-0.983).
BWD_SM90_DQ_FIRST_STORES_MAX_SEQLEN = 2048


def bwd_sm90_first_stores_dq(*, score_mods, dropout: bool, deterministic, varlen: bool, seqlen_q: int,
                             seqlen_k: int, window: tuple[int, int]) -> bool:
    """Whether a call lets bwd_sm90's first dQ writer of each tile store its shares where the others add
    theirs, so that bwd_preprocess need not zero dq_accum (cuda_src/bwd_sm90.cu, kDqFirstStores). Every
    tile of dQ must then have a writer: every query row sees a key (self-attention: as many queries as
    keys, not varlen, a window's edges never below the diagonal's) and no block mask hides a whole
    tile. :func:`plan` takes it where the writers are warps of their own (D = 128, 64-row steps, dQ in
    no fixed order, the plain tiles)."""
    mods = score_mod_bits(score_mods) if not isinstance(score_mods, int) else score_mods
    # (Under a causal mask or window, whose key blocks reach a tile at different steps: without one, a
    # head's blocks reach each tile together and all but the first wait for its store, full 512 0.984x.)
    return (BWD_SM90_DQ_FIRST_STORES and not dropout and deterministic is False and not varlen
            and seqlen_q == seqlen_k <= BWD_SM90_DQ_FIRST_STORES_MAX_SEQLEN
            and not mods & score_mod_bits(("block_mask",)) and min(window) >= -1 and window[1] >= 0)


#: Compiled head dims whose CTAs stay and take key blocks from a counter (CUFLASH_BWD_PERSISTENT):
#: the next block's K and V load while the consumers store the last one's dK and dV, where a CTA of
#: its own waits for them after its launch (docs/decisions.md#bwd-sm90-persistent-ctas-at-head-dim-64) ...
BWD_SM90_PERSISTENT_HEAD_DIMS = (64,)
#: ... under a causal mask or window, for walks of at most this many query tiles on average (a CTA's
#: query heads included). Such variants guard every tile's dS (their consumers have no registers left
#: for the tile-by-tile guard), which long walks pay for more than the hidden loads save them. H200,
#: bf16, per call from torch, persistent over CTAs of their own: causal 1k / 2k / 4k (4.5 / 8.5 / 16.5
#: steps) 1.062 / 1.041 / 1.029, window 1024 at 8k (8.4) 1.037, GQA 32/8 causal 1k (18) 0.990; without a
#: mask (losing the variant without the guard) full 1k / 2k 1.016 / 0.958: not there.
BWD_SM90_PERSISTENT_MAX_STEPS = 17


def bwd_sm90_persistent(head_dim: int, *, score_mods, dropout: bool, deterministic, varlen: bool,
                        head_dim_v: int | None = None, seqlen_q: int = 0, seqlen_k: int = 0,
                        window: tuple[int, int] | None = None, heads_per_cta: int = 1) -> bool:
    """Whether bwd_sm90 runs a call in persistent CTAs: at BWD_SM90_PERSISTENT_HEAD_DIMS (Q's and V's),
    without score modifiers or dropout, dQ added in no fixed order (``deterministic`` False), not
    varlen (whose short sequences end CTAs early). With a ``window`` (left, right; (-1, 0) causal,
    (-1, -1) none), only where a CTA walks at most BWD_SM90_PERSISTENT_MAX_STEPS query tiles on
    average (:func:`mean_walk_steps` of the lengths, times its ``heads_per_cta`` query heads);
    without one (None), whether the variant exists."""
    kdim, kdim_v = compiled_head_dims(head_dim, head_dim_v)
    if not (kdim in BWD_SM90_PERSISTENT_HEAD_DIMS and kdim_v == kdim and not score_mods and not dropout
            and deterministic is False and not varlen):
        return False
    if window is None:
        return True
    steps = mean_walk_steps(seqlen_q, seqlen_k, window, *bwd_sm90_tiles(kdim)) * heads_per_cta
    return tuple(window) != (-1, -1) and steps <= BWD_SM90_PERSISTENT_MAX_STEPS


def mean_walk_steps(seqlen_q: int, seqlen_k: int, window: tuple[int, int], block_n: int, block_m: int) -> float:
    """Query tiles of ``block_m`` rows that bwd_sm90's key blocks of ``block_n`` keys walk on average:
    the rows each block's keys are visible to under the window (left, right; -1 unbounded), as the
    kernel finds them (visible_queries, cuda_src/mask.cuh)."""
    blocks = -(-seqlen_k // block_n) if seqlen_q > 0 and seqlen_k > 0 else 0
    if blocks == 0:
        return 0.0
    left, right = window
    diag, steps = seqlen_k - seqlen_q, 0
    for n_lo in range(0, seqlen_k, block_n):
        n_hi = min(n_lo + block_n, seqlen_k)
        lo = 0 if right < 0 else max(0, n_lo - diag - right)
        hi = seqlen_q if left < 0 else min(seqlen_q, n_hi - diag + left)
        if hi > lo:
            steps += -(-hi // block_m) - lo // block_m
    return steps / blocks


def plan(dtype_name: str, head_dim: int, *, score_mods, dropout: bool, deterministic, windowed: bool = True,
         seqlen_q: int = 0, all_keys_seen: bool = False, head_dim_v: int | None = None,
         score_tile: bool = False, tile_one_row: bool = False, persistent: bool = False,
         dq_first_stores: bool = False) -> LaunchPlan:
    """bwd_sm90's variant for a call (the arguments as in :func:`cuflash.kernels.backward.backward_plan`;
    ``score_tile``: the bias or mask read as tiles, where :func:`takes_score_tiles` allows; ``tile_one_row``:
    that bias or mask the same for every query, tiles of one row: fwd_sm90.tile_one_row; ``persistent``:
    CTAs that take key blocks from a counter, where :func:`bwd_sm90_persistent` allows; ``dq_first_stores``:
    the call lets each dQ tile's first writer store it (:func:`bwd_sm90_first_stores_dq`), which the
    variant then does if its dQ goes through writers of their own)."""
    if dtype_name not in ("float16", "bfloat16"):
        raise ValueError(f"bwd_sm90 runs float16/bfloat16, not {dtype_name}")
    if deterministic not in (False, True, "pass"):
        raise ValueError("bwd_sm90 needs deterministic=True, False or 'pass' (how dQ is added)")
    mods = score_mod_bits(score_mods)
    if deterministic is True and not bwd_sm90_orders_dq(head_dim, bool(mods or dropout)):
        raise ValueError(f"bwd_sm90 adds dQ in a fixed order only at head dims {BWD_SM90_ORDERED_HEAD_DIMS}, "
                         "without score modifiers and dropout")
    obstacle = bwd_sm90_obstacle(head_dim, score_mods, dropout, head_dim_v)
    if obstacle is not None:
        raise ValueError(obstacle)
    kdim, kdim_v = compiled_head_dims(head_dim, head_dim_v)
    if score_tile and not takes_score_tiles(head_dim, score_mods, dropout, deterministic, head_dim_v):
        raise ValueError(f"bwd_sm90 reads a bias or mask alone as tiles at head dim {BWD_SM90_SCORE_TILE_HEAD_DIM}, "
                         f"without dropout, dQ in no fixed order; not {tuple(score_mods)} at ({kdim}, {kdim_v})")
    featured = bwd_sm90_featured(kdim, mods, dropout) and not score_tile
    min_rows = BWD_SM90_WIDE_MIN_ROWS if all_keys_seen else BWD_SM90_WIDE_MIN_ROWS_GUARDED
    wide = not windowed and not mods and deterministic is False and seqlen_q >= min_rows
    block_n, block_m = bwd_sm90_tiles(kdim, featured, wide, kdim_v)
    stages = bwd_sm90_stages(kdim, featured, wide, deterministic, kdim_v)
    tile_elem_bytes = SCORE_TILE_BYTES[tuple(score_mods)[0]] if score_tile else 0
    if tile_one_row and not score_tile:
        raise ValueError("tiles of one row are a bias's or mask's read as tiles")
    smem = bwd_sm90_smem_bytes(kdim, featured, wide, stages, kdim_v, tile_elem_bytes, tile_one_row)
    defines = {
        "CUFLASH_DTYPE": DTYPE_CODES[dtype_name],
        "CUFLASH_HEAD_DIM": kdim,
        "CUFLASH_BLOCK_M": block_m,
        "CUFLASH_STAGES": stages,
        "CUFLASH_BWD_DQ": 0 if deterministic == "pass" else 2 if deterministic else 1,
        "CUFLASH_SCORE_MODS": mods,
        "CUFLASH_DROPOUT": int(dropout),
        "CUFLASH_SMEM_BYTES": smem,
        **size_defines(),
    }
    if kdim_v != kdim:   # only such variants carry it (the others keep their compile keys)
        defines["CUFLASH_HEAD_DIM_V"] = kdim_v
    if score_tile:
        defines["CUFLASH_SCORE_TILE"] = 1
    if tile_one_row:
        defines["CUFLASH_TILE_ONE_ROW"] = 1
    if all_keys_seen and not windowed and not (mods or dropout) and kdim in BWD_SM90_UNGUARDED_HEAD_DIMS:
        defines["CUFLASH_ALL_KEYS_SEEN"] = 1
    elif windowed and not featured and mods in (0, score_mod_bits(("softcap",))) and bwd_sm90_tile_guard(kdim):
        # (the softcap alone too: its P^T comes as without a modifier; the others' tiles keep the guard)
        defines["CUFLASH_TILE_GUARD"] = 1
    if persistent:
        if not bwd_sm90_persistent(head_dim, score_mods=mods, dropout=dropout, deterministic=deterministic,
                                   varlen=False, head_dim_v=head_dim_v) or score_tile or block_m != 128:
            raise ValueError(f"bwd_sm90 runs persistent CTAs at head dims {BWD_SM90_PERSISTENT_HEAD_DIMS} without "
                             "score modifiers, dropout or a fixed dQ order")
        defines["CUFLASH_BWD_PERSISTENT"] = 1
        defines.pop("CUFLASH_ALL_KEYS_SEEN", None)   # every tile guarded (BWD_SM90_PERSISTENT_MAX_STEPS)
        defines.pop("CUFLASH_TILE_GUARD", None)
    if (dq_first_stores and kdim == kdim_v == 128 and block_m == 64 and not featured and deterministic is False
            and not persistent and not dropout and not mods & score_mod_bits(("block_mask",))):
        defines["CUFLASH_BWD_DQ_FIRST_STORES"] = 1   # (the writers' variants of a call that allows it)
    return LaunchPlan(Variant("bwd_sm90", tuple(sorted(defines.items()))), block_n, BWD_SM90_THREADS, smem, kdim)


def feature_plans(dtype_name: str, head_dim: int, mods, dropout: bool, deterministic,
                  head_dim_v: int | None = None) -> list[LaunchPlan]:
    """bwd_sm90's launch plans for one feature set: with a window (and in persistent CTAs, where
    :func:`bwd_sm90_persistent` allows), and without one (short and long queries; with and without every
    key seen); each also with its dQ tiles' first writers storing them, where it has writers."""
    common = dict(score_mods=mods, dropout=dropout, deterministic=deterministic, head_dim_v=head_dim_v)
    calls = [{}] + [dict(windowed=False, seqlen_q=seqlen_q, all_keys_seen=all_keys_seen)
                    for seqlen_q in (0, BWD_SM90_WIDE_MIN_ROWS, BWD_SM90_WIDE_MIN_ROWS_GUARDED)
                    for all_keys_seen in (False, True)]
    plans = []
    for call in calls:
        for first_stores in (False, True):
            launch = plan(dtype_name, head_dim, **common, **call, dq_first_stores=first_stores)
            if all(launch.variant != other.variant for other in plans):
                plans.append(launch)
        if not call and bwd_sm90_persistent(head_dim, score_mods=mods, dropout=dropout, deterministic=deterministic,
                                            varlen=False, head_dim_v=head_dim_v):
            plans.append(plan(dtype_name, head_dim, **common, persistent=True))
    return plans
