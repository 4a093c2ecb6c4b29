"""decode (cuda_src/decode.cu): split-KV attention of a few new query rows against a KV cache,
contiguous or paged: tile shapes, the split count, and the variants worth compiling ahead of time.
Pure functions of shapes and device properties (shared memory per block / per SM, SM count, memory
rate), tested on the CPU. The splits' partial states are combined by the merge kernel (merge.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .common import DEFAULT_SMEM_PER_BLOCK, DEFAULT_SMEM_PER_SM, round_up, with_user_source
from .merge import merge_plan
from .._runtime.params import DECODE_PARAMS, FWD_PARAMS
from .._build.variant import Variant
from ..features import DECODE_SCORE_MODS, DTYPE_CODES, USER_MOD_BITS, USER_MODIFIERS, score_mod_bits

#: Compiled head dims of decode. fp16/bf16 (mma.sync): multiples of 64 (the shared-memory swizzle
#: spans 8 chunks of 16 bytes). float32 (FFMA): multiples of 128 (each lane owns float4 columns of O).
#: Padding columns are zero-filled in shared memory, never read from memory.
DECODE_MMA_HEAD_DIMS = (64, 128, 192, 256)
DECODE_SIMT_HEAD_DIMS = (128, 256)
#: MLA (one latent cache, the values its first columns: cuda_src/decode.cu, CUFLASH_MLA): DeepSeek's
#: latent row of 512 value and 64 rope columns, fp16/bf16. A CTA holds DECODE_MLA_VALUE_COLUMNS of the
#: values (512 would not fit a warp's registers beside the rest): the CTAs come in value halves.
DECODE_MLA_HEAD_DIM = 576   # cuflash._checks.MLA_HEAD_DIM (the argument check's)
DECODE_MLA_VALUE_COLUMNS = 256
#: Packed query rows (Sq_new * Hq/Hk) per CTA: one 16-row mma tile, or 8 rows of FFMA.
DECODE_BLOCK_M = {"mma": 16, "simt": 8}
#: Packed rows per CTA with the keys as the mma's M (CUFLASH_KEYS_AS_M: S^T = K Q^T, the rows as N).
DECODE_KEYS_AS_M_ROWS = 8
#: Whether decode calls of at most DECODE_KEYS_AS_M_ROWS packed rows (fp16/bf16 q, not MLA, not ragged
#: new tokens) take the keys-as-M variants (docs/decisions.md, "decode: keys as the mma's M"); off
#: gives the 16-row variants, the A/B's other side.
DECODE_KEYS_AS_M_BY_DEFAULT = True
DECODE_MAX_SPLITS = 128
#: MLA's splits at most: each split's partials (its rows x 512 float32 values) are combined by the last
#: split of its value half, whose reads grow with the count. H200, (1, 32k, 16 heads), graph-replayed:
#: 16 / 32 / 63-64 splits 115-122 / 114-121 / 165-186 us, contiguous and pages of 64; 31 (what the
#: rule takes under a cap of 32: 17 tiles in the longest split, not 16) 130 us against 16's 120.
DECODE_MLA_MAX_SPLITS = 16
#: Keys a split of a paged cache holds at least: 2048 for K and V rows of D = 128 in 16 bits (1 MiB),
#: whose page-table start-up then hides; MLA's latent rows of 576 (1152 bytes a key) reach those bytes
#: in 910 keys.
DECODE_PAGED_MIN_SPLIT_KEYS = 2048
#: Resident CTAs an SM that the split count of a contiguous 16- or 32-bit cache counts, at most (fp8
#: caches count one): docs/decisions.md#decode-split-count. Paged caches count every resident CTA.
DECODE_CONTIGUOUS_CTAS_PER_SM = 2
DECODE_MLA_PAGED_MIN_SPLIT_KEYS = DECODE_PAGED_MIN_SPLIT_KEYS * (2 * 128 * 2) // (DECODE_MLA_HEAD_DIM * 2)
#: What a CTA needs besides its dynamic shared memory: the static row tables and the 1 KiB the
#: driver reserves per block.
_DECODE_SMEM_RESERVE = 1024 + 128
#: Paged caches add, per key of a tile, the K and V row addresses of two tiles (PagedRows in
#: cuda_src/decode.cu: 2 buffers x 2 tensors x 8-byte pointers).
_DECODE_PAGED_ROW_BYTES = 2 * 2 * 8


@dataclass(frozen=True)
class DecodeTiles:
    """One decode CTA: warps, keys each warp takes per pipeline stage, pipeline depth."""

    warps: int
    keys_per_warp: int
    stages: int


# Per (path, compiled head dim), best first; decode_plan takes the first that fits the device's
# shared memory. Decode is bandwidth bound: what matters is bytes in flight per SM, (stages - 1)
# stages of 32-64 KiB per CTA with 1-3 CTAs per SM, and the warps to issue the copies and math.
# D = 128 (H100, bf16 Hq 32 / Hk 8, in turns beside SDPA flash): eight warps of 16 keys, 3 stages
# (200 KiB, one CTA per SM) stream faster than four (two CTAs per SM): contiguous (8, 8k) 1.18 ->
# 1.26x flash (one split), (1, 32k) 1.31 -> 1.46x (8 splits); paged 1.10 -> 1.14x, 1.19 -> 1.28x.
_DECODE_TILE_CHOICES = {
    ("mma", 64): (DecodeTiles(4, 16, 4), DecodeTiles(4, 16, 3), DecodeTiles(4, 16, 2)),
    ("mma", 128): (DecodeTiles(8, 16, 3), DecodeTiles(4, 16, 3), DecodeTiles(4, 16, 2), DecodeTiles(2, 16, 2)),
    ("mma", 192): (DecodeTiles(4, 16, 3), DecodeTiles(4, 16, 2), DecodeTiles(2, 16, 3), DecodeTiles(2, 16, 2)),
    ("mma", 256): (DecodeTiles(4, 16, 3), DecodeTiles(4, 16, 2), DecodeTiles(2, 16, 3), DecodeTiles(2, 16, 2)),
    ("simt", 128): (DecodeTiles(4, 8, 3), DecodeTiles(4, 8, 2), DecodeTiles(2, 8, 2)),
    ("simt", 256): (DecodeTiles(4, 4, 3), DecodeTiles(4, 4, 2), DecodeTiles(2, 4, 2)),
}

#: Calls whose sequences are short (keys a CTA may see at most DECODE_SHORT_KEYS) and whose CTAs fill
#: a wave of the small tile (DECODE_SHORT_MIN_CTAS_PER_SM an SM) take CTAs of three an SM (two stages;
#: four warps at D = 128, two at D = 256), so that one CTA's start and end overlap the others' copies: a
#: CTA over 128-1024 keys spends much of its time starting and finishing. H200, bf16, GQA 32/8, one new
#: token, graph-replayed, D = 128, eight warps and three stages against four and two (us): ragged
#: 128..1024, 256 sequences, pages of 16 199.2 / 156.8, contiguous 161.4 / 150.0; ragged 256..2048,
#: 128 sequences, 159.4 / 154.7 and 156.3 / 158.9; ragged 512..4096 and uniform 8k-32k, eight warps
#: ahead (147.2 / 155.4 at 512..4096 contiguous, 43.4 / 50.0 at (1, 32k) paged). D = 256, four warps
#: and three stages against two and two, 256 sequences of 128..1024 keys: pages of 16 343.4 / 300.5 and
#: 346.6 / 301.5 (two runs), contiguous 292.1 / 294.4 and 291.5 / 293.7.
_DECODE_SHORT_TILE_CHOICES = {("mma", 128): (DecodeTiles(4, 16, 2),), ("mma", 256): (DecodeTiles(2, 16, 2),),
                              ("mma", 64, "paged"): (DecodeTiles(4, 16, 2),)}
DECODE_SHORT_KEYS = 1024
DECODE_SHORT_MIN_CTAS_PER_SM = 3


#: fp8 (e4m3) caches with fp16/bf16 queries (the mma path): the stages hold bytes, so a stage is half
#: a 16-bit one, and the CTA keeps more of them in flight: at D = 128 four stages of 128 keys against
#: the 16-bit cache's three (H200, kernel alone: five were 2-4% slower contiguous and 7-12% paged, six
#: slower still), at D = 64 eight of 64 keys (three CTAs an SM as for 16-bit caches: with four,
#: ptxas's 128 registers spill beside paging and the modifiers).
_DECODE_FP8_TILE_CHOICES = {
    64: (DecodeTiles(4, 16, 8), DecodeTiles(4, 16, 5), DecodeTiles(4, 16, 3), DecodeTiles(4, 16, 2)),
    128: (DecodeTiles(8, 16, 4), DecodeTiles(8, 16, 3), DecodeTiles(4, 16, 3), DecodeTiles(4, 16, 2),
          DecodeTiles(2, 16, 2)),
    192: (DecodeTiles(4, 16, 4), DecodeTiles(4, 16, 3), DecodeTiles(4, 16, 2), DecodeTiles(2, 16, 2)),
    256: (DecodeTiles(4, 16, 3), DecodeTiles(4, 16, 2), DecodeTiles(2, 16, 3), DecodeTiles(2, 16, 2)),
}
#: fp8 caches, paged, with the keys as the mma's M (128 registers at D = 128, where the 16-row tile
#: needs ~200): three stages and two CTAs an SM. A paged copy waits on its page's lookup, and 16 warps
#: an SM hide that where 8 did not (H200, GQA 32/8, one new token, pages of 16, kernel alone: (8, 8k)
#: 67.2 -> 52.8 us, (1, 128k) 110.3 -> 90.2, (32, 4k) 109.6 -> 77.5, (1, 32k) 53.4 -> 48.9). Contiguous
#: caches keep four stages at one CTA: two CTAs were 1-4% slower there except at (32, 4k). With user
#: modifiers the 128 registers spill (40-88 bytes), so those keep the one-CTA tiles.
_DECODE_FP8_KEYS_M_PAGED_TILE_CHOICES = {
    128: (DecodeTiles(8, 16, 3), DecodeTiles(4, 16, 3), DecodeTiles(4, 16, 2), DecodeTiles(2, 16, 2)),
}
#: 16-bit caches in pages, with the keys as the mma's M, at D = 64: eight warps of 16 keys (a page
#: lookup a key row, 128 of them a tile in flight) where the contiguous cache keeps four warps and four
#: stages. H200, bf16, GQA 32/8, one new token, pages of 16, 20 calls a graph, four warps and four stages
#: against eight and three (us): (1, 32k) 38.5 / 28.8, (8, 8k) 45.6 / 42.1, 64 sequences of 512..4096
#: 97.8 / 89.2, 128 of 256..2048 90.5 / 87.2; contiguous caches within 5% either way. Many short
#: sequences on pages take four warps and two stages instead (256 of 128..1024: 94.0 against 83.4; the
#: contiguous cache's 80.0 against 83.1 keeps its tiles).
_DECODE_KEYS_M_PAGED_TILE_CHOICES = {
    ("mma", 64): (DecodeTiles(8, 16, 3), DecodeTiles(4, 16, 4), DecodeTiles(4, 16, 3), DecodeTiles(4, 16, 2)),
}
#: MLA: a stage is the K tile alone (the values are its first columns). Four warps of 16 keys and two
#: stages take 162 KiB (three stages would not fit 227); not measured yet.
_DECODE_MLA_TILE_CHOICES = (DecodeTiles(4, 16, 2), DecodeTiles(2, 16, 3), DecodeTiles(2, 16, 2))
#: The cache formats decode reads besides the dtype of q (docs/design.md §2b): fp8 as uint8 bytes.
DECODE_KV_DTYPES = ("float8_e4m3fn",)


@dataclass(frozen=True)
class DecodePlan:
    """What the decode launcher needs besides the parameters."""

    variant: Variant
    block_m: int       # packed query rows per CTA
    block_n: int       # keys per pipeline stage
    threads: int
    smem_bytes: int    # dynamic shared memory
    head_dim: int      # compiled head dim (>= the run-time one)
    ctas_per_sm: int   # resident CTAs per SM that shared memory allows (for the split heuristic)
    in_flight_bytes: int   # K and V bytes a CTA's copies keep in flight (stages - 1 of its ring)

    def saturating_ctas(self, memory_rate: float) -> int:
        """How many of these CTAs keep a device's memory busy (:func:`decode_saturating_bytes`; the
        memory rate in bytes/s, 0 when unknown)."""
        return -(-decode_saturating_bytes(memory_rate) // self.in_flight_bytes)


def _decode_path(dtype_name: str) -> str:
    if dtype_name in ("float16", "bfloat16"):
        return "mma"
    if dtype_name == "float32":
        return "simt"
    raise ValueError(f"decode runs float16, bfloat16 or float32, not {dtype_name}")


def _check_kv_dtype(kv_dtype, path: str) -> None:
    if kv_dtype is None:
        return
    if kv_dtype not in DECODE_KV_DTYPES:
        raise ValueError(f"kv_dtype must be None or one of {DECODE_KV_DTYPES}, got {kv_dtype!r}")
    if path != "mma":
        raise ValueError("an fp8 cache (kv_dtype) needs float16 or bfloat16 queries, not float32")


def decode_block_m(dtype_name: str, keys_as_m: bool = False) -> int:
    """Packed query rows a decode CTA holds (its row block): DECODE_KEYS_AS_M_ROWS with the keys as the
    mma's M, else DECODE_BLOCK_M of the dtype's path."""
    return DECODE_KEYS_AS_M_ROWS if keys_as_m else DECODE_BLOCK_M[_decode_path(dtype_name)]


def decode_smem_bytes(dtype_name: str, head_dim: int, tiles: DecodeTiles, kv_dtype: str | None = None,
                      mla: bool = False, keys_as_m: bool = False) -> int:
    """Dynamic shared memory of a decode CTA: Q rows, the K/V stages (MLA: K alone; at least the
    combine buffer they become, which fp8 stages of few keys can be smaller than) and (float32) P per warp.

    Mirrors ``DecodeConfig::kSmemBytes`` in cuda_src/decode.cu, which static_asserts the value.
    """
    path = _decode_path(dtype_name)
    _check_kv_dtype(kv_dtype, path)
    itemsize = 2 if path == "mma" else 4
    cache_itemsize = 1 if kv_dtype else itemsize
    block_m = decode_block_m(dtype_name, keys_as_m)
    block_n = tiles.warps * tiles.keys_per_warp
    p_floats = tiles.warps * block_m * tiles.keys_per_warp if path == "simt" else 0
    tiles_per_stage = 1 if mla else 2
    stages = tiles_per_stage * tiles.stages * block_n * head_dim * cache_itemsize
    v_cols = DECODE_MLA_VALUE_COLUMNS if mla else head_dim
    comb_floats = tiles.warps * block_m * (v_cols + 8) + 3 * tiles.warps * block_m + block_m
    return block_m * head_dim * itemsize + max(stages, 4 * comb_floats) + 4 * p_floats


_USER_BITS = {m.name: m.bit for m in USER_MODIFIERS}


def decode_mod_bits(score_mods) -> int:
    """CUFLASH_SCORE_MODS of a decode variant: the built-in modifiers as :func:`score_mod_bits` over
    decode's (softcap, alibi, mask: one alone, or all of them), plus the bits of a user ScoreMod /
    MaskMod (``"score_mod"``, ``"mask_mod"``, or bits 32 / 64), as given: a variant with a user
    modifier compiles its generated functions (:func:`decode_plan`'s ``user_source``)."""
    if isinstance(score_mods, (bool, type(None))):
        return score_mod_bits(score_mods, DECODE_SCORE_MODS)
    if isinstance(score_mods, (int, np.integer)):
        bits = int(score_mods)
        return (bits & USER_MOD_BITS) | score_mod_bits(bits & ~USER_MOD_BITS if bits >= 0 else bits,
                                                       DECODE_SCORE_MODS)
    names = tuple(score_mods)
    user = sum(_USER_BITS[n] for n in set(names) if n in _USER_BITS)
    return user | score_mod_bits(tuple(n for n in names if n not in _USER_BITS), DECODE_SCORE_MODS)


def decode_plan(dtype_name: str, head_dim: int, *, paged: bool, score_mods,
                smem_per_block: int = DEFAULT_SMEM_PER_BLOCK,
                smem_per_sm: int = DEFAULT_SMEM_PER_SM, user_source: str = "",
                kv_dtype: str | None = None, mla: bool = False, keys_as_m: bool = False,
                short: bool = False) -> DecodePlan:
    """The decode variant and launch shape for a problem.

    Parameters
    ----------
    dtype_name : {"float16", "bfloat16", "float32"}
    head_dim : int
        Run-time head dim (a multiple of the 16-byte chunk, at most 256).
    paged : bool
        Paged cache (block_table) or contiguous.
    score_mods : bool, int or tuple/frozenset of str
        The score modifiers the call uses (softcap, alibi, mask: the per-element score pipeline);
        True: all of them. See :func:`score_mod_bits`. ``"score_mod"`` / ``"mask_mod"`` among them:
        the call's user modifiers (:func:`decode_mod_bits`).
    smem_per_block, smem_per_sm : int
        The device's opt-in shared memory per block and shared memory per SM (bytes).
    user_source : str, default ""
        With a user modifier: the functions written from it (:func:`cuflash.modifiers.kernel_source`),
        compiled into the variant ahead of decode.cu.
    kv_dtype : {None, "float8_e4m3fn"}
        The caches' format: None, the dtype of q; ``"float8_e4m3fn"``, e4m3 bytes (float16/bfloat16
        q only), a variant of its own (``CUFLASH_KV_FP8``).
    mla : bool
        One latent cache whose first columns are the values (``CUFLASH_MLA``): float16/bfloat16,
        ``head_dim`` = DECODE_MLA_HEAD_DIM, caches of q's dtype.
    keys_as_m : bool
        The keys as the mma's M and DECODE_KEYS_AS_M_ROWS packed rows per CTA as its N
        (``CUFLASH_KEYS_AS_M``): float16/bfloat16 q, not MLA.
    short : bool
        Short sequences over many CTAs (:func:`decode_takes_short_tiles`): the tiles of
        ``_DECODE_SHORT_TILE_CHOICES`` where the head dim has some (keys as M, 16-bit caches, no user
        modifier; the 16-row tile at three CTAs an SM spilled 52-64 B for sm_80).

    Raises
    ------
    ValueError
        For an unsupported dtype or head dim, or when no tile shape fits ``smem_per_block``.
    """
    path = _decode_path(dtype_name)
    _check_kv_dtype(kv_dtype, path)
    if keys_as_m and (path != "mma" or mla):
        raise ValueError(f"keys as the mma's M need float16/bfloat16 q and no MLA, not {dtype_name}"
                         + (" with MLA" if mla else ""))
    if mla:
        if path != "mma" or kv_dtype is not None or head_dim != DECODE_MLA_HEAD_DIM:
            raise ValueError(f"MLA decode runs float16/bfloat16 latent caches of head dim {DECODE_MLA_HEAD_DIM}, not "
                             f"{dtype_name} head dim {head_dim}" + (f" with kv_dtype={kv_dtype!r}" if kv_dtype else ""))
        kdim, choices = DECODE_MLA_HEAD_DIM, _DECODE_MLA_TILE_CHOICES
    else:
        kdim = round_up(head_dim, DECODE_MMA_HEAD_DIMS if path == "mma" else DECODE_SIMT_HEAD_DIMS)
        choices = _DECODE_FP8_TILE_CHOICES[kdim] if kv_dtype else _DECODE_TILE_CHOICES[(path, kdim)]
        if kv_dtype and keys_as_m and paged and not user_source:
            choices = _DECODE_FP8_KEYS_M_PAGED_TILE_CHOICES.get(kdim, choices)
        if keys_as_m and paged and not kv_dtype and not user_source:
            choices = _DECODE_KEYS_M_PAGED_TILE_CHOICES.get((path, kdim), choices)
        if short and keys_as_m and not kv_dtype and not user_source:
            choices = (_DECODE_SHORT_TILE_CHOICES.get((path, kdim, "paged")) if paged else None) or \
                _DECODE_SHORT_TILE_CHOICES.get((path, kdim), choices)
    for tiles in choices:
        smem = decode_smem_bytes(dtype_name, kdim, tiles, kv_dtype, mla, keys_as_m)
        reserve = _DECODE_SMEM_RESERVE + (_DECODE_PAGED_ROW_BYTES * tiles.warps * tiles.keys_per_warp if paged else 0)
        if smem + reserve <= smem_per_block:
            break
    else:
        raise ValueError(f"no decode tile shape for {dtype_name} head dim {kdim} fits in "
                         f"{smem_per_block} bytes of shared memory per block")
    # Resident CTAs per SM that shared memory allows (at most 4); the kernel's register budget
    # (__launch_bounds__ minimum blocks) aims at the same number.
    ctas_per_sm = max(1, min(4, smem_per_sm // (smem + reserve)))
    defines = {
        "CUFLASH_DTYPE": DTYPE_CODES[dtype_name],
        "CUFLASH_HEAD_DIM": kdim,
        "CUFLASH_WARPS": tiles.warps,
        "CUFLASH_KEYS_PER_WARP": tiles.keys_per_warp,
        "CUFLASH_STAGES": tiles.stages,
        "CUFLASH_PAGED": int(bool(paged)),
        "CUFLASH_SCORE_MODS": decode_mod_bits(score_mods),
        "CUFLASH_SMEM_BYTES": smem,
        "CUFLASH_MIN_BLOCKS": ctas_per_sm,
        "CUFLASH_PARAMS_SIZE": FWD_PARAMS.itemsize,
        "CUFLASH_DECODE_PARAMS_SIZE": DECODE_PARAMS.itemsize,
    }
    if kv_dtype:   # only fp8 (and MLA) variants carry their define (the others keep their compile keys)
        defines["CUFLASH_KV_FP8"] = 1
    if mla:
        defines["CUFLASH_MLA"] = 1
    if keys_as_m:
        defines["CUFLASH_KEYS_AS_M"] = 1
    block_n = tiles.warps * tiles.keys_per_warp
    in_flight = ((tiles.stages - 1) * (1 if mla else 2) * block_n * kdim *
                 (1 if kv_dtype else 2 if path == "mma" else 4))
    block_m = decode_block_m(dtype_name, keys_as_m)
    plan = DecodePlan(Variant("decode", tuple(sorted(defines.items()))), block_m,
                      block_n, 32 * tiles.warps, smem, kdim, ctas_per_sm, in_flight)
    return with_user_source(plan, user_source)


#: K/V bytes in flight that keep an H100's memory busy: its decode CTAs stream at the full rate from
#: 64 CTAs of 128 KiB each (eight warps, 3 stages of 128 keys at D = 128: (8, 8k) one split 1.26x
#: SDPA flash, two 1.20x; (1, 32k) 8 splits 1.46x, 16 splits 1.38x). Little's law: 3.35 TB/s x
#: ~2.5 us. DECODE_REFERENCE_RATE is the memory rate this figure holds up to.
DECODE_SATURATING_BYTES = 8 << 20
DECODE_REFERENCE_RATE = 3.4e12


def decode_saturating_bytes(memory_rate: float) -> int:
    """K/V bytes in flight that keep a device's memory busy, from its peak rate (bytes/s; 0 when
    unknown): DECODE_SATURATING_BYTES up to the H100's rate, then growing with the rate's square.

    A fit of two devices, not a law: a faster memory needs more in flight, and more than in
    proportion (the latency under load grows too). An H200 (4.8 TB/s) streams best from a whole
    wave of 132 CTAs, 16.5 MiB: (1, 128k) 16 splits 1.18x flash, 11 splits (the rate in proportion,
    11.5 MiB) 1.16x, 8 splits 1.13x; (4, 16k) 4 / 3 / 2 splits 1.40 / 1.34 / 1.33x.
    """
    scale = max(1.0, memory_rate / DECODE_REFERENCE_RATE)
    return int(DECODE_SATURATING_BYTES * scale * scale)


def decode_num_splits(batch: int, heads_k: int, seqlen_k: int, num_sms: int, *, row_blocks: int = 1,
                      block_n: int = 64, ctas_per_sm: int = 2, saturating_ctas: int | None = None,
                      max_splits: int = DECODE_MAX_SPLITS, min_tiles_per_split: int = 4) -> int:
    """How many key ranges (splits) each (sequence, kv head, row block) is cut into.

    Decode reads every K/V byte once and does little arithmetic per byte: it is bandwidth bound
    and needs enough CTAs streaming until the end. Without splits, batch * heads_k CTAs (8 for one
    sequence of a GQA model) keep too few bytes in flight; every split adds a partial result to
    write and merge. So the count is chosen by :func:`decode_bandwidth_efficiency` (waves of
    ``ctas_per_sm * num_sms`` CTAs, each at the memory's full rate from ``saturating_ctas`` CTAs):
    the smallest split count within 95% of the best efficiency reachable, each split keeping at
    least ``min_tiles_per_split`` tiles of ``block_n`` keys (the pipeline's fill and the merge stay
    small against the streaming). Four or more waves without splitting need none.

    Parameters
    ----------
    batch, heads_k : int
        Sequences and kv heads.
    seqlen_k : int
        Keys a CTA's rows may see (the longest sequence; the window's span if narrower).
    num_sms : int
        Streaming multiprocessors of the device.
    row_blocks : int
        CTAs along the packed query rows (Sq_new * Hq / Hk rows, block_m per CTA).
    block_n : int
        Keys per pipeline stage.
    ctas_per_sm : int
        Resident decode CTAs per SM.
    saturating_ctas : int, optional
        CTAs whose copies in flight keep the memory busy (default: a whole wave,
        ``ctas_per_sm * num_sms``; see :meth:`DecodePlan.saturating_ctas`).
    max_splits : int
        Upper bound (partial results cost num_splits * B * Sq * Hq * D float32).
    min_tiles_per_split : int

    Returns
    -------
    int
        In ``[1, max_splits]``; 1 when there is nothing to gain (the unsplit path writes the output
        directly, with no merge).
    """
    ctas = batch * heads_k * row_blocks
    tiles = -(-seqlen_k // block_n) if seqlen_k > 0 else 0
    if ctas <= 0 or tiles <= 0 or num_sms <= 0:
        return 1
    slots = max(1, ctas_per_sm) * num_sms
    if ctas >= 4 * slots:
        return 1
    saturating = slots if saturating_ctas is None else max(1, min(saturating_ctas, slots))
    limit = max(1, min(tiles // max(1, min_tiles_per_split), max_splits))
    eff = [0.0] + [decode_bandwidth_efficiency(ctas * s, slots, saturating) for s in range(1, limit + 1)]
    best = max(eff)
    return next(s for s in range(1, limit + 1) if eff[s] >= 0.95 * best)


def decode_bandwidth_efficiency(ctas: int, slots: int, saturating: int) -> float:
    """Fraction of the memory's rate a launch of ``ctas`` equal CTAs gets: it runs in waves of up to
    ``slots`` CTAs, and a wave of n CTAs streams at min(1, n / ``saturating``) of the rate."""
    if ctas <= 0:
        return 0.0
    full, last = divmod(ctas, slots)
    cost = full * max(slots, saturating) + (max(last, saturating) if last else 0)
    return ctas / cost

#: Table entries per thread that a decode CTA checks in one pass (cuda_src/decode.cu,
#: kSelfCheckEntriesPerThread): up to this many, decode checks its index arrays itself.
DECODE_SELF_CHECK_PER_THREAD = 8



#: Head dims whose longer sequences take the short-sequence tiles when those fit their CTAs in one wave
#: (decode_takes_short_tiles). H200, bf16, GQA 32/8, one new token, (32, 4k), graph-replayed, us,
#: usual tiles / short ones: D = 128 contiguous 127.6 / 124.6, pages of 16 131.9 / 130.5; D = 64 pages
#: of 16 76.3 / 74.5; D = 256 contiguous 245.7 / 243.0 but pages of 16 250.8 / 255.3 and of 64
#: 249.2 / 253.6, so not D = 256.
DECODE_ONE_WAVE_HEAD_DIMS = (64, 128)


def decode_takes_short_tiles(keys: int, ctas: int, num_sms: int, head_dim: int) -> bool:
    """Whether a decode call takes the short-sequence tiles (``decode_plan(short=True)``): at most
    DECODE_SHORT_KEYS keys a CTA may see, and ``ctas`` (sequences x kv heads x row blocks) filling a
    wave of DECODE_SHORT_MIN_CTAS_PER_SM CTAs an SM; or, at DECODE_ONE_WAVE_HEAD_DIMS, longer
    sequences whose CTAs would take two or three waves of the usual tiles (one an SM) and fit one
    wave of the small ones. H200, bf16, GQA 32/8, D = 128, one new token, (32, 4k), graph-replayed
    against SDPA cuDNN in turns: eight warps of three stages 0.966x, four warps of two stages 0.987x."""
    if keys <= 0:
        return False
    if keys <= DECODE_SHORT_KEYS:
        return ctas >= DECODE_SHORT_MIN_CTAS_PER_SM * num_sms
    return head_dim in DECODE_ONE_WAVE_HEAD_DIMS and num_sms < ctas <= DECODE_SHORT_MIN_CTAS_PER_SM * num_sms


def decode_self_check(paged: bool, batch: int, max_pages: int, threads: int) -> bool:
    """Whether a decode launch checks its index arrays on the GPU itself instead of a check_indices
    launch ahead of it: always for a contiguous cache (B lengths); for a paged one when every CTA
    can read the table in one pass (a launch saves ~3 us of host time; re-reading a larger table in
    every CTA would cost more stream time than the overlapped check kernel)."""
    return not paged or batch * max_pages <= DECODE_SELF_CHECK_PER_THREAD * threads


def decode_precompile_variants(dtypes=None, head_dims=None,
                               smem_per_block: int = DEFAULT_SMEM_PER_BLOCK, kv_dtypes=(None,)) -> list[Variant]:
    """Decode and merge variants worth compiling ahead of time.

    Every dtype x head dim x (contiguous, paged) x (plain, score modifiers), for each of ``kv_dtypes``
    (None: caches of q's dtype; ``"float8_e4m3fn"``: fp8 caches, for float16/bfloat16 only) and, for
    float16/bfloat16, both tiles (16 packed rows; the keys as the mma's M, for calls of a few rows) and
    the short-sequence tiles where a head dim has them (:func:`decode_takes_short_tiles`), for
    the shared memory of an H100/H200 by default (another budget may pick other stage counts, compiled
    on first use), plus the merges ``merge_states`` uses: float32 (parts of mixed dtypes) into each dtype, and each
    dtype into itself.

    Parameters
    ----------
    dtypes : sequence of str, optional
        Default: float16, bfloat16, float32.
    head_dims : sequence of int, optional
        Default: 64, 128, 256.
    smem_per_block : int
        Shared memory budget the stage counts are chosen for.
    kv_dtypes : sequence of {None, "float8_e4m3fn"}
        The cache formats (default: q's dtype only; fp8 variants compile on first use unless asked).
    """
    dtypes = tuple(dtypes or ("float16", "bfloat16", "float32"))
    head_dims = tuple(head_dims or (64, 128, 256))
    out = []
    for dtype_name in dtypes:
        dtype_name = np.dtype(dtype_name).name if dtype_name != "bfloat16" else dtype_name
        for d in head_dims:
            for paged in (False, True):
                for mods in (False, True):
                    for kv_dtype in (k for k in kv_dtypes if k is None or dtype_name != "float32"):
                        for keys_as_m in (False, True) if dtype_name != "float32" else (False,):
                            for short in (False, True) if keys_as_m else (False,):   # short: keys as M only
                                out.append(decode_plan(dtype_name, d, paged=paged, score_mods=mods,
                                                       smem_per_block=smem_per_block, kv_dtype=kv_dtype,
                                                       keys_as_m=keys_as_m, short=short).variant)
        out.append(merge_plan("float32", dtype_name).variant)
        out.append(merge_plan(dtype_name, dtype_name).variant)
    return list(dict.fromkeys(out))
