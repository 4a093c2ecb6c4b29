"""fwd_sm90 (cuda_src/fwd_sm90.cu): wgmma, TMA loads on mbarriers and warp specialisation (one
producer warpgroup, two or three consumers), persistent CTAs; float16/bfloat16 on sm_90a."""

from __future__ import annotations

import math

from .common import DEFAULT_SMEM_PER_BLOCK, SCORE_TILE_BYTES, LaunchPlan, round_up
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
#: Q's and K's compiled head dims beside a V of its own of SM90_PAIR_QK_192_V: 192 as well (DeepSeek's
#: (192, 128), the pair measured and tested; bwd_sm90 compiles 192 beside it too), where a square 192
#: rounds up to 256 (its output, staged 128 columns at a time, would take one and a half passes). At
#: (192, 128), 96-key tiles, one Q slot and two stages (201 KiB, as 64-key tiles with three): S = Q K^T
#: over 192 columns instead of 256, a sixth less tensor work a tile, and half again as many keys a tile
#: to carry each tile's softmax and waits. H200, bf16, B 2, S 8k, H 16, causal / full TFLOP/s: 96 x 2
#: 648 / 690 against 64 x 3's 557 / 599 (docs/decisions.md#a-value-head-dim-of-its-own).
SM90_PAIR_QK_DIMS = (64, 128, 192, 256)
SM90_PAIR_QK_192_V = 128
SM90_BLOCK_N_192, SM90_Q_SLOTS_192, SM90_STAGES_192 = 96, 1, 2
SM90_TILES_192_64 = (64, 3)   # (keys a tile, stages) of the (192, 128) variants that keep 64 keys: see plan()
# Consumer warpgroups of 64 query rows each: two, or three (192 rows a CTA) where sm90_consumers says.
SM90_WIDE_HEAD_DIMS = (64,)
SM90_WIDE_MIN_ROWS = 2048
#: ... and from this many query rows of a causal call (the window (-1, 0)), whose diagonal's masked half
#: weighs less on long rows: H200 bf16, 16k tokens, two / three consumers over cuDNN: 2k 1.001 / 0.958,
#: 4k 1.028 / 0.998, 8k 1.043 / 1.077, 16k 1.047 / 1.095 (docs/decisions.md#fwd-sm90-three-consumers-at-head-dim-64).
SM90_WIDE_MIN_ROWS_CAUSAL = 8192
SM90_BLOCK_N = {64: 128, 128: 128, 256: 64}
# With a user ScoreMod/MaskMod, 64-key tiles: a consumer holds half the scores (at D = 64 and 128), which leaves
# room for the expression's reads (a document mask over 128-key tiles spilled 228 B, with a relative
# bias table 496 B, 108 B at D = 64; over 64-key tiles none).
SM90_BLOCK_N_USER = {64: 64, 128: 64, 192: 64, 256: 64}
SM90_Q_SLOTS = {64: 2, 128: 2, 256: 1}
# K/V ring depth. D = 64 has room for 4: with the speculative softmax, a stage's V is released only
# after the next tile's exponentials, and 2 stages left the producer waiting (same-run A/B, 8k keys:
# 0.99 -> 1.02 of cuDNN, 1k 0.89 -> 0.96).
SM90_STAGES = {64: 4, 128: 2, 256: 2}

# Over a KV cache (CUFLASH_KV_CACHE: decode's many new tokens, cuflash/_prefill_plan.py):
#: the new tokens (of the longest sequence) from which decode runs on fwd_sm90 (kv_cache_pays), and from
#: which it does when its 128-row blocks alone fill the SMs.
KV_CACHE_MIN_QUERIES, KV_CACHE_MIN_QUERIES_FULL = 128, 32


def kv_cache_pays(seqlen_q: int, work_items: int, sms: int) -> bool:
    """Whether decode's ``seqlen_q`` new tokens run faster on fwd_sm90 than on the decode kernel:
    from KV_CACHE_MIN_QUERIES, or from KV_CACHE_MIN_QUERIES_FULL when fwd_sm90's ``work_items`` (128-row
    blocks x query heads x sequences) fill the ``sms``. Below, the decode kernel's split-KV keeps more
    SMs busy. H200, GQA 32/8, D 128, prefix 4k, page 16, TFLOP/s decode kernel / fwd_sm90: one sequence
    (32 items) 32 new tokens 49.7 / 27.2, 64 71.2 / 55.0, 128 75.6 / 110.9; eight (256 items) 32 78.2 /
    114.7, 64 79.0 / 231.2 (benchmarks/results/chunked_prefill_crossover_h200.md)."""
    return seqlen_q >= KV_CACHE_MIN_QUERIES or (seqlen_q >= KV_CACHE_MIN_QUERIES_FULL and work_items >= sms)
#: the score modifiers it takes (decode's names), each a variant without spills (ALiBi and softcap
#: together spilled 20-24 bytes at D = 64 and 128: the decode kernel runs them);
KV_CACHE_SCORE_MODS = ((), ("softcap",), ("alibi",))
#: how the cache's rows reach shared memory (CUFLASH_KV_CACHE): by TMA, a box of a page and a column block
#: a copy; copied by the producer warpgroup; or by TMA, a box of a page a copy for every column block
#: ("row_groups": the cache read as one run of rows, tiles laid out in 8-row groups).
KV_CACHE_MODES = {"tma": 1, "gather": 2, "row_groups": 3}


#: TMA boxes of a paged cache have gcd(page_size, keys per tile) rows, which must be a multiple of 8: the
#: 128-byte swizzle's 1024-byte atoms stay whole.
KV_CACHE_BOX_MULTIPLE = 8


def kv_cache_mode(page_size: int | None, rows_run_on: bool = False) -> str:
    """``"tma"`` for a contiguous cache (``page_size`` None) or pages of a multiple of KV_CACHE_BOX_MULTIPLE
    rows (boxes of :func:`kv_box_rows`), else ``"gather"``: 16-byte copies by the producer warpgroup.
    ``"row_groups"`` instead of ``"tma"`` for such pages when ``rows_run_on``: both caches' rows run on
    from page to page (page stride = page_size rows) and their head dims are whole 64-column blocks, so
    that one copy takes a box's every column block. Pages of 16 rows at D = 128 then take 16 copies a
    tile instead of 32: 0.88-0.92x the contiguous forward against 0.77-0.79x
    (docs/decisions.md#chunked-prefill-on-fwd_sm90)."""
    if page_size is None:
        return "tma"
    if page_size % KV_CACHE_BOX_MULTIPLE:
        return "gather"
    return "row_groups" if rows_run_on else "tma"


def kv_box_rows(page_size: int | None, block_n: int) -> int:
    """Rows of one TMA box over a KV cache: a tile's ``block_n`` keys for a contiguous cache, else
    gcd(page_size, block_n), so that no box crosses a page (a tile is block_n / that many boxes)."""
    return block_n if page_size is None else math.gcd(page_size, block_n)


def kv_cache_variants(dtypes=("float16", "bfloat16"), head_dims=SM90_HEAD_DIMS) -> list[Variant]:
    """fwd_sm90's variants over a KV cache: square head dims, each of KV_CACHE_SCORE_MODS, every mode, and
    DeepSeek's (192, 128)."""
    out = [plan(dtype_name, d, score_mods=mods, dropout=False, kv_cache=mode).variant
           for dtype_name in dtypes for d in head_dims for mods in KV_CACHE_SCORE_MODS for mode in KV_CACHE_MODES]
    return out + [plan(dtype_name, 192, score_mods=(), dropout=False, head_dim_v=SM90_PAIR_QK_192_V,
                       kv_cache=mode).variant for dtype_name in dtypes for mode in KV_CACHE_MODES]


def on_plain_loop(score_mods, window: tuple[int, int]) -> bool:
    """Whether fwd_sm90 runs a call's one score modifier on its loop without modifiers
    (``plan(on_plain_loop=True)``; ``score_mods`` the call's modifier names):

    - ALiBi alone under a window whose right edge is 0 (causal), as a bias of each key column: no visible
      key lies right of its query's diagonal there, so -slope |i + diag - j| is slope (j - ref) less a
      term of the row alone (docs/decisions.md#fwd-sm90-alibi-as-column-biases);
    - the softcap alone, capping the raw scores before the edge tiles' masks
      (docs/decisions.md#fwd-sm90-the-softcap-on-the-plain-loop)."""
    mods = tuple(score_mods)
    return (mods in (("alibi",), ("alibi_slopes",)) and window[1] == 0) or mods == ("softcap",)


#: Compiled head dims at which a bias or mask alone is read as tiles (score_tile): at 256, the 64-key
#: tiles' 16 KiB of bias does not fit beside one Q slot and two stages.
SCORE_TILE_HEAD_DIMS = (64, 128)
#: What the dynamic shared memory leaves to the static (barriers, the slots' items: a few hundred bytes),
#: both within DEFAULT_SMEM_PER_BLOCK.
STATIC_SMEM_ROOM = 1024


def score_tile(score_mods, x, dtype_name: str, head_dim: int, head_dim_v: int | None = None) -> bool:
    """Whether fwd_sm90 reads the call's one score modifier, a bias or a boolean mask (``x``: its (B, Hq,
    Sq, Sk) view, zero strides where broadcast), as tiles that its producer loads by TMA beside K, on its
    loop without modifiers (``plan(on_plain_loop=True)``): at compiled head dims of SM90_HEAD_DIMS in
    SCORE_TILE_HEAD_DIMS (V's the same), in the layouts of :func:`score_tile_layout` (rows broadcast: tiles
    of one row, :func:`tile_one_row`). A bias of another dtype or broadcast over keys is read element by
    element. H200, D 128, B 2, S 8k, H 16, causal, forward: docs/decisions.md#fwd-sm90-a-bias-or-mask-as-tiles."""
    kdim, kdim_v = pair_head_dims(head_dim, head_dim_v)
    return kdim in SCORE_TILE_HEAD_DIMS and kdim_v == kdim and score_tile_layout(score_mods, x, dtype_name)


def score_tile_layout(score_mods, x, dtype_name: str) -> bool:
    """Whether ``score_mods`` is a bias or a mask alone whose (B, Hq, Sq, Sk) view ``x`` a TMA map reads in
    tiles (fwd_sm90's and bwd_sm90's score tiles): a bias of q's dtype ``dtype_name`` or a bool mask, keys
    contiguous, rows, heads and batches apart by a multiple of 16 bytes or 0 (rows 0: a key mask or bias,
    one row for all queries: :func:`tile_one_row`), a 16-byte aligned base."""
    if tuple(score_mods) not in (("bias",), ("mask",)) or x is None:
        return False
    if str(x.dtype) != ("bool" if tuple(score_mods) == ("mask",) else dtype_name):
        return False
    sb, sh, sr, sc = x.strides
    return sc == x.itemsize and all(s >= 0 and s % 16 == 0 for s in (sb, sh, sr)) and x.data.ptr % 16 == 0


def tile_one_row(x) -> bool:
    """Whether a bias or mask view ``x`` (B, Hq, Sq, Sk) is the same for every query (row stride 0: a key
    padding mask or bias, (B, 1, 1, Sk) broadcast): its score tiles are then one row of keys
    (CUFLASH_TILE_ONE_ROW), which every query reads."""
    return x.strides[2] == 0


def sm90_consumers(head_dim: int, *, featured: bool, window: tuple[int, int], seqlen_q: int) -> int:
    """Consumer warpgroups of fwd_sm90 for a problem (its CTA computes 64 query rows per consumer):
    ``head_dim`` the run-time one, ``featured`` with score modifiers or dropout, ``window`` the call's
    (left, right) bounds ((-1, -1): none, (-1, 0): causal).

    Three at D = 64 without score modifiers or dropout, for attention without a causal or window
    mask over at least SM90_WIDE_MIN_ROWS query rows, or with a causal one over at least
    SM90_WIDE_MIN_ROWS_CAUSAL; two otherwise. At D = 64 a tile's exponentials cost about as much as
    its products, and a third warpgroup keeps the tensor cores busy while the others take theirs
    (H100, bf16, ratio to cuDNN, two / three: 2k 1.01 / 1.05, 8k 1.03 / 1.11, 16k 1.01 / 1.10).
    Short causal rows lose on 192-row tiles (the diagonal's masked half, a last m-block of 64 rows
    at 1k: H200, 2k 1.00 / 0.96, 4k 1.03 / 1.00), long ones gain (8k 1.04 / 1.08, 16k 1.05 / 1.10);
    sliding windows keep two. The three-warpgroup variant has 160 registers per consumer thread, too
    few for the score modifiers (140 B of spills) and for the speculative softmax's second P.
    """
    min_rows = {(-1, -1): SM90_WIDE_MIN_ROWS, (-1, 0): SM90_WIDE_MIN_ROWS_CAUSAL}.get(tuple(window))
    wide = (round_up(head_dim, SM90_HEAD_DIMS) in SM90_WIDE_HEAD_DIMS and not featured and min_rows is not None
            and seqlen_q >= min_rows)
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


def sm90_smem_bytes(head_dim: int, consumers: int = 2, block_n: int | None = None, head_dim_v: int | None = None,
                    stages: int | None = None, q_slots: int | None = None, tile_elem_bytes: int = 0,
                    tile_one_row: bool = False) -> int:
    """Dynamic shared memory of fwd_sm90: Q slots, the K and V stages, the staged output (16-bit
    elements) and a score tile, for compiled head dims of SM90_HEAD_DIMS (``head_dim`` Q's and K's,
    ``head_dim_v`` V's and O's, default ``head_dim``; ``block_n``: keys per tile, default SM90_BLOCK_N's;
    ``stages``: default SM90_STAGES'; ``q_slots``: default SM90_Q_SLOTS'; ``tile_elem_bytes``: a bias's or
    mask's element bytes, 0 for none; ``tile_one_row``: its tile one row, a 1 KiB block per 128 bytes of
    keys)."""
    head_dim_v = head_dim_v or head_dim
    block_m = 64 * consumers
    block_n = block_n or _tiles_of(head_dim)[0]
    stages = stages or _tiles_of(head_dim)[2]
    q_bytes = (q_slots or _tiles_of(head_dim)[1]) * block_m * head_dim * 2
    out_bytes = block_m * min(head_dim_v, 128) * 2  # the output, staged <= 128 columns at a time
    tile_bytes = (1024 // 128 if tile_one_row else block_m) * block_n * tile_elem_bytes
    return 1024 + q_bytes + stages * block_n * (head_dim + head_dim_v) * 2 + out_bytes + tile_bytes


def value_head_dim_obstacle(head_dim: int, head_dim_v: int | None) -> str | None:
    """Why fwd_sm90 cannot run v with head dim ``head_dim_v`` beside q's ``head_dim`` (run-time, padded
    to 8), or None. Each is compiled at the next of SM90_HEAD_DIMS (Q and K at one, V and O at the
    other: ``CUFLASH_HEAD_DIM_V``), so every pair of head dims up to 256 runs (docs/decisions.md, "A
    value head dim of its own")."""
    if head_dim_v is None or head_dim_v == head_dim:
        return None
    if max(head_dim, head_dim_v) > SM90_HEAD_DIMS[-1]:
        return (f"fwd_sm90 runs head dims up to {SM90_HEAD_DIMS[-1]}, not the pair (D_qk, D_v) = ({head_dim}, "
                f"{head_dim_v})")
    return None


def _tiles_of(kdim: int) -> tuple[int, int, int]:
    """(keys per tile, Q slots, stages) of a compiled Q/K head dim."""
    if kdim == 192:
        return SM90_BLOCK_N_192, SM90_Q_SLOTS_192, SM90_STAGES_192
    return SM90_BLOCK_N[kdim], SM90_Q_SLOTS[kdim], SM90_STAGES[kdim]


def pair_head_dims(head_dim: int, head_dim_v: int | None) -> tuple[int, int]:
    """The compiled (Q/K, V) head dims of run-time ones (padded to 8; ``head_dim_v`` None: square):
    the next of SM90_HEAD_DIMS, Q's and K's of SM90_PAIR_QK_DIMS beside a V of its own compiled at
    SM90_PAIR_QK_192_V."""
    kdim_v = round_up(head_dim if head_dim_v is None else head_dim_v, SM90_HEAD_DIMS)
    if head_dim_v is None or head_dim_v == head_dim or kdim_v != SM90_PAIR_QK_192_V:
        return round_up(head_dim, SM90_HEAD_DIMS), kdim_v
    return round_up(head_dim, SM90_PAIR_QK_DIMS), kdim_v


def _pair_tiles(kdim: int, kdim_v: int, block_n: int, consumers: int) -> tuple[int, int]:
    """(block_n, stages) of a variant whose V head dim differs from Q's: the narrower of the two dims'
    key tiles, and the most stages up to Q's dim's count that fit the shared memory (at least 2)."""
    block_n = min(block_n, SM90_BLOCK_N[kdim_v])
    for stages in range(_tiles_of(kdim)[2], 1, -1):
        if sm90_smem_bytes(kdim, consumers, block_n, kdim_v, stages) <= DEFAULT_SMEM_PER_BLOCK:
            return block_n, stages
    return block_n, 2


def plan(dtype_name: str, head_dim: int, *, score_mods, dropout: bool, consumers: int = 2,
         head_dim_v: int | None = None, kv_cache: str | None = None, on_plain_loop: bool = False,
         tile_one_row: bool = False) -> LaunchPlan:
    """fwd_sm90's variant for a run-time head dim (rounded up to SM90_HEAD_DIMS) and its consumer
    warpgroups (:func:`sm90_consumers`). ``head_dim_v``: v's and out's head dim when it differs (rounded
    up the same way; two consumers; the key tile and stage count of :func:`_pair_tiles`). ``kv_cache``:
    keys and values from a KV cache (``CUFLASH_KV_CACHE``; decode's chunked prefill,
    :mod:`cuflash._prefill_plan`): ``"tma"`` (contiguous, or pages of multiples of 8 rows), ``"row_groups"``
    (such pages, rows running on from page to page) or ``"gather"`` (other pages, copied row by row:
    :func:`kv_cache_mode`). ``on_plain_loop``: ALiBi or the softcap alone on the loop without modifiers
    (``CUFLASH_MOD_ON_PLAIN_LOOP``; ALiBi so is exact only where no visible key is right of its query's
    diagonal: :func:`on_plain_loop`), or a bias or mask alone read as tiles (:func:`score_tile`; one Q
    slot where two leave no room for the tile); ``tile_one_row``: that bias or mask the same for every
    query, read as tiles of one row (:func:`tile_one_row`)."""
    if dtype_name not in ("float16", "bfloat16"):
        raise ValueError(f"fwd_sm90 runs float16/bfloat16, not {dtype_name}")
    obstacle = value_head_dim_obstacle(head_dim, head_dim_v)
    if obstacle is not None:
        raise ValueError(obstacle)
    mods = score_mod_bits(score_mods)
    tiled = {score_mod_bits((name,)): size for name, size in SCORE_TILE_BYTES.items()}
    if on_plain_loop and mods not in (score_mod_bits(("alibi",)), score_mod_bits(("softcap",)), *tiled):
        raise ValueError(f"the loop without modifiers takes ALiBi, the softcap, a bias or a mask alone, not "
                         f"{score_mods}")
    kdim, kdim_v = pair_head_dims(head_dim, head_dim_v)
    tile_elem_bytes = tiled.get(mods, 0) if on_plain_loop else 0
    if tile_elem_bytes and (kdim not in SCORE_TILE_HEAD_DIMS or kdim_v != kdim or kv_cache is not None):
        raise ValueError(f"fwd_sm90 reads a bias or mask as tiles at head dims {SCORE_TILE_HEAD_DIMS} (V's the "
                         f"same), not over a KV cache; got ({kdim}, {kdim_v})")
    if tile_one_row and not tile_elem_bytes:
        raise ValueError("tiles of one row are a bias's or mask's on the loop without modifiers")
    if consumers not in (2, 3) or consumers == 3 and (kdim not in SM90_WIDE_HEAD_DIMS or mods or dropout
                                                      or kdim_v != kdim):
        raise ValueError(f"fwd_sm90 runs 2 consumer warpgroups, or 3 at head dims {SM90_WIDE_HEAD_DIMS} without "
                         f"score modifiers, dropout or a value head dim of its own; got {consumers} at head dim "
                         f"{kdim}")
    block_n = SM90_BLOCK_N_USER[kdim] if mods & USER_MOD_BITS else _tiles_of(kdim)[0]
    stages = _tiles_of(kdim)[2]
    if kdim_v != kdim:
        block_n, stages = _pair_tiles(kdim, kdim_v, block_n, consumers)
    if kdim == 192 and (kv_cache is not None or dropout or mods & ~score_mod_bits(("softcap",))):
        # 64-key tiles and three stages: over a KV cache a tile's TMA boxes go out one a lane of a warp
        # (load_boxes; 96 keys would take 36 boxes), and the other modifiers and dropout have not run
        # on a GPU with 96-key tiles (the softcap, causal masks and windows have).
        block_n, stages = SM90_TILES_192_64
    q_slots = _tiles_of(kdim)[1]
    smem = sm90_smem_bytes(kdim, consumers, block_n, kdim_v, stages, q_slots, tile_elem_bytes, tile_one_row)
    if smem > DEFAULT_SMEM_PER_BLOCK - STATIC_SMEM_ROOM:   # a score tile where two Q slots leave no room (D = 128)
        q_slots = 1
        smem = sm90_smem_bytes(kdim, consumers, block_n, kdim_v, stages, q_slots, tile_elem_bytes, tile_one_row)
    defines = {
        "CUFLASH_DTYPE": DTYPE_CODES[dtype_name],
        "CUFLASH_HEAD_DIM": kdim,
        "CUFLASH_BLOCK_N": block_n,
        "CUFLASH_Q_SLOTS": q_slots,
        "CUFLASH_STAGES": stages,
        "CUFLASH_CONSUMERS": consumers,
        "CUFLASH_SCORE_MODS": mods,
        "CUFLASH_DROPOUT": int(dropout),
        "CUFLASH_SMEM_BYTES": smem,
        "CUFLASH_PARAMS_SIZE": FWD_PARAMS.itemsize,
    }
    if kdim_v != kdim:   # only such variants carry it (the others keep their compile keys)
        defines["CUFLASH_HEAD_DIM_V"] = kdim_v
    if kv_cache is not None:
        defines["CUFLASH_KV_CACHE"] = KV_CACHE_MODES[kv_cache]
    if on_plain_loop:
        defines["CUFLASH_MOD_ON_PLAIN_LOOP"] = 1
    if tile_one_row:
        defines["CUFLASH_TILE_ONE_ROW"] = 1

    return LaunchPlan(Variant("fwd_sm90", tuple(sorted(defines.items()))), 64 * consumers, 128 * (consumers + 1),
                      smem, kdim)
