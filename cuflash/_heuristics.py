"""Tile sizes and kernel variants: pure functions of shapes and device properties.

Every compile-time choice is made here and handed to the CUDA sources as ``-DCUFLASH_*`` defines;
the kernels ``static_assert`` the shared-memory size they receive, so Python and CUDA cannot
disagree silently. Nothing here touches a GPU, so it is tested on the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ._params import (BWD_PARAMS, CHECK_PARAMS, CONVERT_PARAMS, DECODE_PARAMS, FWD_PARAMS,
                      MERGE_PARAMS)
from ._variant import Variant

DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2}

# Head dims the kernels are compiled for; a run-time head dim is zero-padded up to the next one.
# sm80 tiles need multiples of 64 (the shared-memory swizzle spans 8 chunks of 16 bytes).
SM80_HEAD_DIMS = (64, 128, 192, 256)
SIMT_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Tiles:
    """One CTA's shape: query rows, keys per step, warps, CTAs per SM the registers aim at."""

    block_m: int
    block_n: int
    warps: int
    min_blocks: int = 1


# Chosen from register reports (no spills under 255 registers) and timings on an H200; see
# benchmarks/NOTES.md. Without score modifiers or dropout, 4 warps with two 16-row tiles each
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
# fp32 SIMT: 4 warps up to D=128; 8 warps above keep registers well under 255 (same smem).
SIMT_TILES = {32: Tiles(64, 32, 4), 64: Tiles(64, 32, 4), 96: Tiles(64, 32, 4), 128: Tiles(64, 32, 4),
              160: Tiles(64, 32, 8), 192: Tiles(64, 32, 8), 224: Tiles(64, 32, 8), 256: Tiles(64, 32, 8)}


# Hopper (sm_90a): 2 consumer warpgroups x 64 rows (3 for long full rows at D = 64:
# sm90_consumers), 2 K/V stages. Up to D = 128, S tiles of 128 keys and Q double buffered (the next
# item's Q loads while this one computes); D = 256 fits shared memory only with one Q buffer and
# 64-key tiles (64 + 2 x 2 x 32 KB). Measured and not taken (benchmarks/NOTES.md; their wgmma
# wrappers are in the history at 0c98a8d): 80-key tiles at D = 256 (faster from 8k keys, but they
# spill), 176/192-key tiles at D = 128/64, three consumers at D = 64 for every shape.
SM90_HEAD_DIMS = (64, 128, 256)
# Consumer warpgroups of 64 query rows each: two, or three (192 rows a CTA) where sm90_consumers says.
SM90_WIDE_HEAD_DIMS = (64,)
SM90_WIDE_MIN_ROWS = 2048
SM90_BLOCK_N = {64: 128, 128: 128, 256: 64}
SM90_Q_SLOTS = {64: 2, 128: 2, 256: 1}
# K/V ring depth. D = 64 has room for 4: with the speculative softmax, a stage's V is released only
# after the next tile's exponentials, and 2 stages left the producer waiting (same-run A/B, 8k keys:
# 0.99 -> 1.02 of cuDNN, 1k 0.89 -> 0.96).
SM90_STAGES = {64: 4, 128: 2, 256: 2}


# Score modifiers, in the order of their bits in CUFLASH_SCORE_MODS (cuda_src/mask.cuh, kModSoftcap
# = 1 ... kModBlockMask = 16). A variant compiles only the modifiers whose bits it has, so that a
# call with one modifier waits only for that one's code (fwd_sm90 with all five took 30-45 s of
# NVRTC; benchmarks/NOTES.md, session 10). A call with two or more shares the variant with all of
# them, which is precompiled: that keeps the variants per configuration at 7 (none, each alone,
# all) instead of 32, the count that tests and first calls could otherwise meet.
SCORE_MODS = ("softcap", "alibi", "bias", "mask", "block_mask")
#: Decode's modifiers: its mask is decode's own (cuda_src/decode.cu); it takes no bias or block mask.
DECODE_SCORE_MODS = ("softcap", "alibi", "mask")
_MOD_BITS = {name: 1 << k for k, name in enumerate(SCORE_MODS)}
_MOD_BITS["alibi_slopes"] = _MOD_BITS["alibi"]  # the keyword's own name


def score_mod_bits(score_mods, names=SCORE_MODS) -> int:
    """CUFLASH_SCORE_MODS of the variant for a call's score modifiers.

    Parameters
    ----------
    score_mods : bool, int or iterable of str
        The modifiers the call uses: names from ``names`` (``"alibi_slopes"`` is ``"alibi"``), or
        True for all of them, False / None / empty for none, or a bit mask as an int.
    names : tuple of str
        The modifiers the kernel family has (:data:`SCORE_MODS`, :data:`DECODE_SCORE_MODS`).

    Returns
    -------
    int
        0 for none, the modifier's bit for one alone, every bit of ``names`` for two or more.

    Raises
    ------
    ValueError
        For a name or bit the family does not have.
    """
    every = sum(_MOD_BITS[n] for n in names)
    if isinstance(score_mods, bool) or score_mods is None:
        return every if score_mods else 0
    if isinstance(score_mods, (int, np.integer)):
        bits = int(score_mods)
        if bits < 0 or bits & ~every:
            raise ValueError(f"score_mods bit mask {bits} has bits outside {every} ({', '.join(names)})")
    else:
        bits = 0
        for name in score_mods:
            if _MOD_BITS.get(name, 0) & every == 0:
                raise ValueError(f"unknown score modifier {name!r}: expected some of {', '.join(names)}")
            bits |= _MOD_BITS[name]
    return bits if bits & (bits - 1) == 0 else every


def score_mod_sets(names=SCORE_MODS) -> list[int]:
    """Every CUFLASH_SCORE_MODS a planner gives for a family with these modifiers: none, each alone,
    all (for precompiling and timing everything calls can reach)."""
    return [0] + [_MOD_BITS[n] for n in names] + [score_mod_bits(True, names)]


@dataclass(frozen=True)
class LaunchPlan:
    """What the launcher needs besides the parameters: the variant, grid rows and resources."""

    variant: Variant
    block_m: int
    threads: int
    smem_bytes: int
    head_dim: int  # compiled head dim (>= the run-time one)


def _round_up(x: int, options: tuple[int, ...]) -> int:
    for value in options:
        if x <= value:
            return value
    raise ValueError(f"head dim {x} exceeds the maximum of {options[-1]}")


def sm80_smem_bytes(tiles: Tiles, head_dim: int) -> int:
    """Q tile plus two stages of K and V tiles, 16-bit elements."""
    return (tiles.block_m + 4 * tiles.block_n) * head_dim * 2


def simt_smem_bytes(tiles: Tiles, head_dim: int) -> int:
    """Q tile, one K and one V tile, and the P tile, float32 elements."""
    return (tiles.block_m * head_dim + 2 * tiles.block_n * head_dim + tiles.block_m * tiles.block_n) * 4


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
    wide = (_round_up(head_dim, SM90_HEAD_DIMS) in SM90_WIDE_HEAD_DIMS and not featured and full
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


def sm90_smem_bytes(head_dim: int, consumers: int = 2) -> int:
    """1 KB of slack to align the swizzled tiles, the Q slots, kStages of K and V, and the staged
    output (16-bit elements), for a compiled head dim of SM90_HEAD_DIMS."""
    block_m = 64 * consumers
    q_bytes = SM90_Q_SLOTS[head_dim] * block_m * head_dim * 2
    out_bytes = block_m * min(head_dim, 128) * 2  # the output, staged <= 128 columns at a time
    return 1024 + q_bytes + 2 * SM90_STAGES[head_dim] * SM90_BLOCK_N[head_dim] * head_dim * 2 + out_bytes


# typed: score_mods=True (every modifier) and score_mods=1 (the softcap alone) are equal as keys otherwise.
@functools.lru_cache(maxsize=None, typed=True)  # a pure function of its arguments, asked at every call
def forward_plan(family: str, dtype_name: str, head_dim: int, *, score_mods, dropout: bool,
                 consumers: int = 2) -> LaunchPlan:
    """The forward variant for a problem.

    Parameters
    ----------
    family : {"fwd_sm90", "fwd_sm80", "fwd_simt"}
    dtype_name : {"float16", "bfloat16", "float32"}
    head_dim : int
        Run-time head dim (a multiple of 8, at most 256).
    score_mods : bool, int or tuple/frozenset of str
        The score modifiers the call uses (softcap, alibi, bias, mask, block_mask: the per-element
        pipeline); True: all of them. See :func:`score_mod_bits` (hashable values only: cached).
    dropout : bool
    consumers : int
        fwd_sm90's consumer warpgroups, 2 or 3 (:func:`sm90_consumers`; three only at D = 64 without
        score modifiers or dropout).
    """
    mods = score_mod_bits(score_mods)
    if family == "fwd_sm80":
        if dtype_name not in ("float16", "bfloat16"):
            raise ValueError(f"fwd_sm80 runs float16/bfloat16, not {dtype_name}")
        kdim = _round_up(head_dim, SM80_HEAD_DIMS)
        tiles = (SM80_TILES_FEATURED if mods or dropout else SM80_TILES)[kdim]
        smem = sm80_smem_bytes(tiles, kdim)
    elif family == "fwd_sm90":
        if dtype_name not in ("float16", "bfloat16"):
            raise ValueError(f"fwd_sm90 runs float16/bfloat16, not {dtype_name}")
        kdim = _round_up(head_dim, SM90_HEAD_DIMS)
        if consumers not in (2, 3) or consumers == 3 and (kdim not in SM90_WIDE_HEAD_DIMS or mods or dropout):
            raise ValueError(f"fwd_sm90 runs 2 consumer warpgroups, or 3 at head dims {SM90_WIDE_HEAD_DIMS} without "
                             f"score modifiers or dropout; got {consumers} at head dim {kdim}")
        defines = {
            "CUFLASH_DTYPE": DTYPE_CODES[dtype_name],
            "CUFLASH_HEAD_DIM": kdim,
            "CUFLASH_BLOCK_N": SM90_BLOCK_N[kdim],
            "CUFLASH_Q_SLOTS": SM90_Q_SLOTS[kdim],
            "CUFLASH_STAGES": SM90_STAGES[kdim],
            "CUFLASH_CONSUMERS": consumers,
            "CUFLASH_SCORE_MODS": mods,
            "CUFLASH_DROPOUT": int(dropout),
            "CUFLASH_SMEM_BYTES": sm90_smem_bytes(kdim, consumers),
            "CUFLASH_PARAMS_SIZE": FWD_PARAMS.itemsize,
        }
        return LaunchPlan(Variant(family, tuple(sorted(defines.items()))), 64 * consumers, 128 * (consumers + 1),
                          sm90_smem_bytes(kdim, consumers), kdim)
    elif family == "fwd_simt":
        if dtype_name != "float32":
            raise ValueError(f"fwd_simt runs float32, not {dtype_name}")
        kdim = _round_up(head_dim, SIMT_HEAD_DIMS)
        tiles = SIMT_TILES[kdim]
        smem = simt_smem_bytes(tiles, kdim)
    else:
        raise ValueError(f"unknown kernel family {family!r}")
    defines = {
        "CUFLASH_DTYPE": DTYPE_CODES[dtype_name],
        "CUFLASH_HEAD_DIM": kdim,
        "CUFLASH_BLOCK_M": tiles.block_m,
        "CUFLASH_BLOCK_N": tiles.block_n,
        "CUFLASH_WARPS": tiles.warps,
        "CUFLASH_MIN_BLOCKS": tiles.min_blocks,
        "CUFLASH_SCORE_MODS": mods,
        "CUFLASH_DROPOUT": int(dropout),
        "CUFLASH_SMEM_BYTES": smem,
        "CUFLASH_PARAMS_SIZE": FWD_PARAMS.itemsize,
    }
    variant = Variant(family, tuple(sorted(defines.items())))
    return LaunchPlan(variant, tiles.block_m, 32 * tiles.warps, smem, kdim)


def default_family(dtype_name: str) -> str:
    """The kernel family used when none is forced."""
    return "fwd_simt" if dtype_name == "float32" else "fwd_sm80"


def forward_precompile_variants(dtypes=None, head_dims=None, families=None, arch=None) -> list[Variant]:
    """Forward variants worth compiling ahead of time: each dtype x head dim, plain and with every
    feature, for the portable families and (for sm_90a, or when ``arch`` is None) fwd_sm90. Variants
    with one score modifier (see :data:`SCORE_MODS`) or with only modifiers or only dropout compile
    on first use.

    Parameters
    ----------
    dtypes : sequence of str, optional
        Default: float16, bfloat16, float32.
    head_dims : sequence of int, optional
        Default: 64, 128, 256 (others compile on first use).
    families : sequence of str, optional
        Restrict to these kernel families.
    arch : str, optional
        Target architecture; fwd_sm90 is only built for sm_90a.
    """
    dtypes = tuple(dtypes or ("float16", "bfloat16", "float32"))
    head_dims = tuple(head_dims or (64, 128, 256))
    out = []
    for dtype_name in dtypes:
        dtype_name = np.dtype(dtype_name).name if dtype_name != "bfloat16" else dtype_name
        candidates = [default_family(dtype_name)]
        if dtype_name != "float32" and (arch is None or arch.startswith("sm_90")):
            candidates.append("fwd_sm90")
        for family in candidates:
            if families is not None and family not in families:
                continue
            for d in head_dims:
                for mods, dropout in ((False, False), (True, True)):
                    plan = forward_plan(family, dtype_name, d, score_mods=mods, dropout=dropout)
                    if plan.variant not in out:
                        out.append(plan.variant)
                if family == "fwd_sm90" and _round_up(d, SM90_HEAD_DIMS) in SM90_WIDE_HEAD_DIMS:
                    wide = forward_plan(family, dtype_name, d, score_mods=False, dropout=False, consumers=3)
                    if wide.variant not in out:
                        out.append(wide.variant)
    return out


def precompile_variants(dtypes=None, head_dims=None, families=None, arch=None) -> list[Variant]:
    """Every kernel family's variants worth compiling ahead of time (``python -m cuflash
    precompile``, :func:`cuflash.precompile`): forward, decode and merge, backward."""
    out = forward_precompile_variants(dtypes, head_dims, families, arch)
    for more in (decode_precompile_variants(dtypes, head_dims), precompile_backward_variants(dtypes, head_dims, arch)):
        out += [v for v in more if v not in out and (families is None or v.family in families)]
    if families is None or "check_indices" in families:
        out.append(check_indices_variant())
    if families is None or "rng_state" in families:
        out.append(rng_state_variant())
    return out


def check_indices_variant() -> Variant:
    """The index check (cuda_src/check_indices.cu) that runs before decode and varlen kernels whose
    index arrays live on the GPU; 128 threads per CTA, any grid."""
    return Variant("check_indices", {"CUFLASH_CHECK_PARAMS_SIZE": CHECK_PARAMS.itemsize})


def rng_state_variant() -> Variant:
    """The dropout state draw (cuda_src/rng_state.cu) that runs first in a dropout call captured in a
    CUDA graph; one thread."""
    return Variant("rng_state")


CHECK_THREADS = 128
#: CTAs of the index check: one per sequence up to this many (each then strides over the rest).
CHECK_MAX_CTAS = 1024
#: Table entries per thread that a decode CTA checks in one pass (cuda_src/decode.cu,
#: kSelfCheckEntriesPerThread): up to this many, decode checks its index arrays itself.
DECODE_SELF_CHECK_PER_THREAD = 8


def decode_self_check(paged: bool, batch: int, max_pages: int, threads: int) -> bool:
    """Whether a decode launch checks its index arrays on the GPU itself instead of a check_indices
    launch ahead of it: always for a contiguous cache (B lengths); for a paged one when every CTA
    can read the table in one pass (a launch saves ~3 us of host time; re-reading a larger table in
    every CTA would cost more stream time than the overlapped check kernel)."""
    return not paged or batch * max_pages <= DECODE_SELF_CHECK_PER_THREAD * threads


def ci_variants() -> list[tuple[Variant, str]]:
    """(variant, arch) pairs the CPU test compiles: every family for sm_80 and sm_90a (fwd_sm90 for
    sm_90a only), forward at every default head dim, decode/merge and backward at D=128, and each
    score modifier alone (forward, backward, decode at D=128, no dropout)."""
    pairs = []
    for arch in ("sm_80", "sm_90a"):
        variants = forward_precompile_variants(arch=arch)
        for more in (decode_precompile_variants(("bfloat16", "float32"), (128,)),
                     precompile_backward_variants(("bfloat16", "float32"), (128,), arch)):
            variants += [v for v in more if v not in variants]
        variants += [check_indices_variant(), rng_state_variant()]
        singles = [v for v in reachable_variants(arch, ("bfloat16", "float32"), (128,))
                   if _one_score_mod(v) and not dict(v.defines).get("CUFLASH_DROPOUT")]
        variants += [v for v in singles if v not in variants]
        pairs += [(v, arch) for v in variants]
    # What BWD_SM90_DEFER_STAGES = 3 would compile (bwd_sm90 D = 128, 64 rows, dQ in any order), so
    # that the alternative stays compilable and free of spills.
    third = [_with_stages(v, 3) for v, arch in pairs if arch == "sm_90a" and _defers_dq(v)]
    pairs += [(v, "sm_90a") for v in dict.fromkeys(third) if (v, "sm_90a") not in pairs]
    # And what CUFLASH_BWD_ORDERED_DQ_ASYNC = 0 would compile (bwd_sm90's ordered dQ handed over by
    # the consumers' thread 0, the A/B's other side; cuda_src/bwd_sm90.cu).
    ordered = [_with_define(v, "CUFLASH_BWD_ORDERED_DQ_ASYNC", 0) for v, arch in pairs
               if arch == "sm_90a" and v.family == "bwd_sm90" and dict(v.defines)["CUFLASH_BWD_DQ"] == 2]
    pairs += [(v, "sm_90a") for v in dict.fromkeys(ordered)]
    # And CUFLASH_BWD_RELAG = 0 (the consumers' lag made at the first step only, the A/B's other
    # side; cuda_src/bwd_sm90.cu), beside the variants that defer dQ with two stages.
    lag = [_with_define(v, "CUFLASH_BWD_RELAG", 0) for v, arch in pairs
           if arch == "sm_90a" and _defers_dq(v) and dict(v.defines)["CUFLASH_STAGES"] == 2]
    pairs += [(v, "sm_90a") for v in dict.fromkeys(lag)]
    return pairs


def _defers_dq(variant: Variant) -> bool:
    d = dict(variant.defines)
    return (variant.family == "bwd_sm90" and d["CUFLASH_HEAD_DIM"] == 128 and d["CUFLASH_BLOCK_M"] == 64
            and d["CUFLASH_BWD_DQ"] == 1 and not d["CUFLASH_SCORE_MODS"] and not d["CUFLASH_DROPOUT"])


def _with_stages(variant: Variant, stages: int) -> Variant:
    d = dict(variant.defines)
    d.update(CUFLASH_STAGES=stages, CUFLASH_SMEM_BYTES=bwd_sm90_smem_bytes(d["CUFLASH_HEAD_DIM"], stages=stages))
    return Variant(variant.family, tuple(sorted(d.items())))


def _with_define(variant: Variant, name: str, value: int) -> Variant:
    return Variant(variant.family, tuple(sorted({**dict(variant.defines), name: value}.items())))


def _one_score_mod(variant: Variant) -> bool:
    mods = dict(variant.defines).get("CUFLASH_SCORE_MODS", 0)
    return mods != 0 and mods & (mods - 1) == 0


def reachable_variants(arch: str | None = None, dtypes=None, head_dims=None) -> list[Variant]:
    """Every variant a call can reach: per family, dtype and compiled head dim, each score-modifier
    set the planners give (:func:`score_mod_sets`) with and without dropout, both backward passes,
    contiguous and paged decode, and the merge, preprocess, convert, index-check and rng-state
    kernels. What the GPU tests may compile (``benchmarks/gpu_check.sh`` builds them all first); for
    the default shared-memory budget of decode.

    Parameters
    ----------
    arch : str, optional
        fwd_sm90 is included for sm_90a, or when ``arch`` is None.
    dtypes : sequence of str, optional
        Default: float16, bfloat16, float32.
    head_dims : sequence of int, optional
        Run-time head dims (each rounded up per family); default: every compiled head dim.
    """
    dtypes = [np.dtype(d).name if d != "bfloat16" else d for d in (dtypes or ("float16", "bfloat16", "float32"))]
    out = {}

    def dims(compiled):
        return compiled if head_dims is None else sorted({_round_up(d, compiled) for d in head_dims})

    for dtype_name in dtypes:
        families = [default_family(dtype_name)]
        if dtype_name != "float32" and (arch is None or arch.startswith("sm_90")):
            families.append("fwd_sm90")
        for family in families:
            compiled = {"fwd_sm80": SM80_HEAD_DIMS, "fwd_sm90": SM90_HEAD_DIMS, "fwd_simt": SIMT_HEAD_DIMS}[family]
            for d in dims(compiled):
                for mods in score_mod_sets():
                    for dropout in (False, True):
                        out.setdefault(forward_plan(family, dtype_name, d, score_mods=mods, dropout=dropout).variant)
                if family == "fwd_sm90" and d in SM90_WIDE_HEAD_DIMS:
                    out.setdefault(forward_plan(family, dtype_name, d, score_mods=False, dropout=False,
                                                consumers=3).variant)
        family = default_backward_family(dtype_name)
        out.setdefault(bwd_preprocess_variant(dtype_name))
        out.setdefault(bwd_convert_variant(dtype_name))
        for d in dims(SM80_HEAD_DIMS if family == "bwd_sm80" else SIMT_HEAD_DIMS):
            for dq_pass in (False, True):
                for mods in score_mod_sets():
                    for dropout in (False, True):
                        out.setdefault(backward_plan(family, dtype_name, d, dq_pass=dq_pass, score_mods=mods,
                                                     dropout=dropout).variant)
        if dtype_name != "float32" and (arch is None or arch.startswith("sm_90")):
            for d in dims(BWD_SM90_HEAD_DIMS):
                for mods in score_mod_sets():
                    for dropout in (False, True):
                        for det in (False, True, "pass"):
                            if det is True and not bwd_sm90_orders_dq(d, bool(score_mod_bits(mods) or dropout)):
                                continue
                            if bwd_sm90_obstacle(d, mods, dropout) is None:
                                for plan in _bwd_sm90_plans(dtype_name, d, mods, dropout, det):
                                    out.setdefault(plan.variant)
        for d in dims(DECODE_MMA_HEAD_DIMS if _decode_path(dtype_name) == "mma" else DECODE_SIMT_HEAD_DIMS):
            for paged in (False, True):
                for mods in score_mod_sets(DECODE_SCORE_MODS):
                    out.setdefault(decode_plan(dtype_name, d, paged=paged, score_mods=mods).variant)
        out.setdefault(merge_plan("float32", dtype_name).variant)
        out.setdefault(merge_plan(dtype_name, dtype_name).variant)
    out.setdefault(merge_plan("float64", "float64").variant)   # merge_states of float64 states
    out.setdefault(check_indices_variant())
    out.setdefault(rng_state_variant())
    return list(out)


# ============================================================================= Decode
#
# Split-KV decode (cuda_src/decode.cu) and the merge of partial states (cuda_src/merge.cu): tile
# shapes, the split count, and the variants worth compiling ahead of time. Pure functions of shapes
# and device properties (shared memory per block / per SM, SM count), tested on the CPU.

#: Compiled head dims of decode. fp16/bf16 (mma.sync): multiples of 64 (the shared-memory swizzle
#: spans 8 chunks of 16 bytes). float32 (FFMA): multiples of 128 (each lane owns float4 columns of O).
#: Padding columns are zero-filled in shared memory, never read from memory.
DECODE_MMA_HEAD_DIMS = (64, 128, 192, 256)
DECODE_SIMT_HEAD_DIMS = (128, 256)
#: Packed query rows (Sq_new * Hq/Hk) per CTA: one 16-row mma tile, or 8 rows of FFMA.
DECODE_BLOCK_M = {"mma": 16, "simt": 8}
DECODE_MAX_SPLITS = 128
#: Opt-in shared memory per block of an H100/H200, the default budget of the ahead-of-time variants.
DEFAULT_SMEM_PER_BLOCK = 227 * 1024
DEFAULT_SMEM_PER_SM = 228 * 1024
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


def decode_smem_bytes(dtype_name: str, head_dim: int, tiles: DecodeTiles) -> int:
    """Dynamic shared memory of a decode CTA: Q rows, the K/V stages, and (float32) P per warp.

    Mirrors ``DecodeConfig::kSmemBytes`` in cuda_src/decode.cu, which static_asserts the value.
    """
    path = _decode_path(dtype_name)
    itemsize = 2 if path == "mma" else 4
    block_m = DECODE_BLOCK_M[path]
    block_n = tiles.warps * tiles.keys_per_warp
    p_floats = tiles.warps * block_m * tiles.keys_per_warp if path == "simt" else 0
    return (block_m * head_dim + 2 * tiles.stages * block_n * head_dim) * itemsize + 4 * p_floats


def decode_plan(dtype_name: str, head_dim: int, *, paged: bool, score_mods,
                smem_per_block: int = DEFAULT_SMEM_PER_BLOCK,
                smem_per_sm: int = DEFAULT_SMEM_PER_SM) -> DecodePlan:
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
        True: all of them. See :func:`score_mod_bits`.
    smem_per_block, smem_per_sm : int
        The device's opt-in shared memory per block and shared memory per SM (bytes).

    Raises
    ------
    ValueError
        For an unsupported dtype or head dim, or when no tile shape fits ``smem_per_block``.
    """
    path = _decode_path(dtype_name)
    kdim = _round_up(head_dim, DECODE_MMA_HEAD_DIMS if path == "mma" else DECODE_SIMT_HEAD_DIMS)
    for tiles in _DECODE_TILE_CHOICES[(path, kdim)]:
        smem = decode_smem_bytes(dtype_name, kdim, tiles)
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
        "CUFLASH_SCORE_MODS": score_mod_bits(score_mods, DECODE_SCORE_MODS),
        "CUFLASH_SMEM_BYTES": smem,
        "CUFLASH_MIN_BLOCKS": ctas_per_sm,
        "CUFLASH_PARAMS_SIZE": FWD_PARAMS.itemsize,
        "CUFLASH_DECODE_PARAMS_SIZE": DECODE_PARAMS.itemsize,
    }
    block_n = tiles.warps * tiles.keys_per_warp
    in_flight = (tiles.stages - 1) * 2 * block_n * kdim * (2 if path == "mma" else 4)
    return DecodePlan(Variant("decode", tuple(sorted(defines.items()))), DECODE_BLOCK_M[path],
                      block_n, 32 * tiles.warps, smem, kdim, ctas_per_sm, in_flight)


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


MERGE_DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
MERGE_ROWS_PER_BLOCK = 8   # a warp a row (cuda_src/merge.cu)


@dataclass(frozen=True)
class MergePlan:
    variant: Variant
    rows_per_block: int

    @property
    def threads(self) -> int:
        """Per block: a warp for each of its rows."""
        return 32 * self.rows_per_block

    def grid(self, rows: int) -> int:
        return -(-rows // self.rows_per_block)


def merge_plan(in_dtype_name: str, out_dtype_name: str) -> MergePlan:
    """The merge variant (partials in ``in_dtype_name``, result in ``out_dtype_name``) and its
    launch shape: a warp a row, :data:`MERGE_ROWS_PER_BLOCK` rows a block, for every head dim."""
    for name in (in_dtype_name, out_dtype_name):
        if name not in MERGE_DTYPE_CODES:
            raise ValueError(f"merge runs float16, bfloat16, float32 or float64, not {name}")
    defines = {
        "CUFLASH_IN_DTYPE": MERGE_DTYPE_CODES[in_dtype_name],
        "CUFLASH_OUT_DTYPE": MERGE_DTYPE_CODES[out_dtype_name],
        "CUFLASH_MERGE_PARAMS_SIZE": MERGE_PARAMS.itemsize,
        "CUFLASH_MERGE_ROWS": MERGE_ROWS_PER_BLOCK,
    }
    return MergePlan(Variant("merge", tuple(sorted(defines.items()))), MERGE_ROWS_PER_BLOCK)


def decode_precompile_variants(dtypes=None, head_dims=None,
                               smem_per_block: int = DEFAULT_SMEM_PER_BLOCK) -> list[Variant]:
    """Decode and merge variants worth compiling ahead of time.

    Every dtype x head dim x (contiguous, paged) x (plain, score modifiers), for the shared memory
    of an H100/H200 by default (another budget may pick other stage counts, compiled on first use),
    plus the merges ``merge_states`` uses: float32 (parts of mixed dtypes) into each dtype, and each
    dtype into itself.

    Parameters
    ----------
    dtypes : sequence of str, optional
        Default: float16, bfloat16, float32.
    head_dims : sequence of int, optional
        Default: 64, 128, 256.
    smem_per_block : int
        Shared memory budget the stage counts are chosen for.
    """
    dtypes = tuple(dtypes or ("float16", "bfloat16", "float32"))
    head_dims = tuple(head_dims or (64, 128, 256))
    out = []
    for dtype_name in dtypes:
        dtype_name = np.dtype(dtype_name).name if dtype_name != "bfloat16" else dtype_name
        for d in head_dims:
            for paged in (False, True):
                for mods in (False, True):
                    out.append(decode_plan(dtype_name, d, paged=paged, score_mods=mods,
                                           smem_per_block=smem_per_block).variant)
        out.append(merge_plan("float32", dtype_name).variant)
        out.append(merge_plan(dtype_name, dtype_name).variant)
    return list(dict.fromkeys(out))


# ----------------------------------------------------------------------------- Backward
# Kernels of cuda_src/bwd_{preprocess,sm80,simt,convert}.cu. The dK/dV pass ("pass 0") keeps
# block_r keys per CTA and streams the queries; the dQ pass ("pass 1", deterministic mode only)
# keeps block_r queries and streams the keys. See cuflash/backward.py for the launch sequence.

BWD_FAMILIES = ("bwd_sm90", "bwd_sm80", "bwd_simt")

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


# bwd_sm90 (cuda_src/bwd_sm90.cu): 128 keys per CTA (64 per consumer warpgroup); query rows per step
# such that each consumer's share of dQ is 64 x 64 (D = 64: 128 rows split by rows; D = 128: 64 rows
# split by columns, or without a window 80 rows, each consumer 64 columns of dQ^T). At D = 256, 64
# keys per CTA whose dK/dV columns the consumers split (64 rows per step, two 64 x 64 shares of dQ
# each). Shared memory: K, V, kStages x (Q, dO), two dS^T (or P^T and dS^T) tiles, the dQ staging
# of both consumers (at D = 256 in the step's Q and dO buffers).
# With score modifiers or dropout ("featured") the consumers need smaller accumulators
# (BwdSm90Config::kFeatured): D = 128 splits the columns as D = 256 does (64 keys per CTA), D = 64
# takes 64 query rows per step (each consumer adds dQ over its own keys).
BWD_SM90_HEAD_DIMS = (64, 128, 256)
BWD_SM90_THREADS = 384
BWD_SM90_BLOCK_N = {64: 128, 128: 128, 256: 64}
BWD_SM90_BLOCK_M = {64: 128, 128: 64, 256: 64}
#: Query rows per step without a window (no causal mask), score modifiers, dropout nor ordered dQ,
#: from BWD_SM90_WIDE_MIN_ROWS query rows: 80 at D = 128 (FlashAttention-3's 80 x 128; each consumer
#: then computes dQ transposed and hands it to a writer warp, BwdSm90Config::kDqHandOver). H200 bf16,
#: against the 80-row steps whose consumers added dQ themselves: 8k and 16k +5-7%; against 64-row
#: steps (which hand their dQ over one step late) at 1k-4k: 0 to +4%. 512 rows stay at 64 (a trial
#: of 80 there lost 2.5%: the last tile's padding is 9% of the rows). Calls whose tiles keep dS's
#: guard (varlen: kDqHandOver spilled there, the consumers add dQ themselves) wait for
#: BWD_SM90_WIDE_MIN_ROWS_GUARDED rows, where such 80-row steps were level with 64 (benchmarks/NOTES.md,
#: sessions 33 to 35). The ordered dQ of deterministic=True keeps 64: its writers need double-buffered
#: shares, for which 80 rows leave no shared memory (and its consumers spilled in a single-buffered trial).
BWD_SM90_WIDE_BLOCK_M = {128: 80}
BWD_SM90_WIDE_MIN_ROWS = 1024
BWD_SM90_WIDE_MIN_ROWS_GUARDED = 8192
BWD_SM90_FEATURED_BLOCK_N = {64: 128, 128: 64, 256: 64}
BWD_SM90_FEATURED_BLOCK_M = {64: 64, 128: 64, 256: 64}
BWD_SM90_STAGES = {64: 2, 128: 2, 256: 2}
#: Stages of the D = 128 variants with 64-row steps that add dQ in any order (BwdSm90Config::kDeferDq,
#: kDqAsync), not featured: 3 leaves shared memory for one dQ share buffer per consumer instead of
#: two. With the lag between the consumers a stage comes back ~0.45 of a step later, and the copy of
#: the stage after next then arrives late (consumers wait ~4.5% of a step more than in lockstep;
#: benchmarks/NOTES.md, session 33). Measured with 3 (H200 bf16, session 34): 8k causal +1.2%, every
#: other shape from 1k to 16k within the controls' spread; so 2.
BWD_SM90_DEFER_STAGES = 2
#: Head dims whose bwd_sm90 adds dQ in a fixed order under deterministic=True (cuda_src/dq_order.cuh),
#: without score modifiers and dropout; at D = 64 the order's bookkeeping made the consumers spill,
#: and bwd_sm80's dQ pass computes dQ.
BWD_SM90_ORDERED_HEAD_DIMS = (128,)


def bwd_sm90_tiles(head_dim: int, featured: bool = False, wide: bool = False) -> tuple[int, int]:
    """(keys per CTA, query rows per step) of bwd_sm90 at a compiled head dim; featured: with score
    modifiers or dropout; wide: a call that may take BWD_SM90_WIDE_BLOCK_M's rows (no window, score
    modifier, dropout nor ordered dQ)."""
    if featured:
        return BWD_SM90_FEATURED_BLOCK_N[head_dim], BWD_SM90_FEATURED_BLOCK_M[head_dim]
    if wide and head_dim in BWD_SM90_WIDE_BLOCK_M:
        return BWD_SM90_BLOCK_N[head_dim], BWD_SM90_WIDE_BLOCK_M[head_dim]
    return BWD_SM90_BLOCK_N[head_dim], BWD_SM90_BLOCK_M[head_dim]


def bwd_sm90_stages(head_dim: int, featured: bool = False, wide: bool = False, deterministic=False) -> int:
    """Stages of bwd_sm90's Q/dO ring at a compiled head dim (``deterministic`` as in backward_plan)."""
    block_m = bwd_sm90_tiles(head_dim, featured, wide)[1]
    if head_dim == 128 and block_m == 64 and not featured and deterministic is False:
        return BWD_SM90_DEFER_STAGES
    return BWD_SM90_STAGES[head_dim]


def bwd_sm90_smem_bytes(head_dim: int, featured: bool = False, wide: bool = False, stages: int | None = None) -> int:
    """Mirrors BwdSm90Config::kSmemBytes (1024 bytes of alignment slack included); ``stages``
    defaults to BWD_SM90_STAGES's."""
    block_n, block_m = bwd_sm90_tiles(head_dim, featured, wide)
    stages = BWD_SM90_STAGES[head_dim] if stages is None else stages
    kv, q_do, ds = 2 * block_n * head_dim, 2 * block_m * head_dim, 2 * block_n * block_m
    split_dims = head_dim == 256 or (head_dim == 128 and featured)
    transposed = block_m == 80   # dQ^T: a 64 x 80 share per consumer, single buffered
    # a float32 share of dQ per consumer and buffer (split by columns: in the Q/dO buffers; a third
    # stage at D = 128 leaves room for one buffer)
    dq_buffers = 0 if split_dims else 2 if head_dim == 128 and not transposed and stages == 2 else 1
    dq_staging = 2 * dq_buffers * 64 * (block_m if transposed else 64) * 4
    return 1024 + 2 * kv + 2 * stages * q_do + 2 * ds + dq_staging


def bwd_sm90_orders_dq(head_dim: int, featured: bool = False) -> bool:
    """Whether bwd_sm90 adds dQ in a fixed order under deterministic=True at this (padded) head dim
    (else bwd_sm80's dQ pass computes dQ after it); featured: with score modifiers or dropout."""
    return (not featured and head_dim <= max(BWD_SM90_HEAD_DIMS)
            and _round_up(head_dim, BWD_SM90_HEAD_DIMS) in BWD_SM90_ORDERED_HEAD_DIMS)


def bwd_sm90_dq_mode(head_dim: int, featured: bool, deterministic: bool):
    """How bwd_sm90 adds dQ for a call (backward_plan's ``deterministic``): False, in any order;
    True, in a fixed order (bwd_sm90_orders_dq); "pass", not at all (bwd_sm80's dQ pass after it)."""
    if not deterministic:
        return False
    return True if bwd_sm90_orders_dq(head_dim, featured) else "pass"


def bwd_sm90_obstacle(head_dim: int, score_mods=(), dropout: bool = False) -> str | None:
    """Why bwd_sm90 cannot run a backward with this (padded, multiple of 8) head dim, score
    modifiers and dropout, or None when it can: today only the head dim limits it (every
    combination of modifiers and dropout compiles without spills up to 256). (The caller also needs
    sm_90a and TMA-compatible layouts: cuflash/backward.py checks those.)"""
    if head_dim > max(BWD_SM90_HEAD_DIMS):
        return f"bwd_sm90 runs head dims up to {max(BWD_SM90_HEAD_DIMS)}, not {head_dim}"
    return None


def _bwd_simt_tiles(head_dim: int) -> BwdTiles:
    # 4 warps, 32 streamed rows; 32 kept rows, or 16 for head dims whose accumulators need it.
    return BwdTiles(32 if head_dim <= 160 else 16, 32, 32, 4)


def bwd_sm80_smem_bytes(tiles: BwdTiles, head_dim: int, dq_pass: bool) -> int:
    """Kept tiles (2), two stages of streamed tiles (2 each), and for the dK/dV pass dS^T (16-bit)
    plus two stages of lse2 and D (float32). Mirrors BwdSm80Config::kSmemBytes."""
    elems = 2 * tiles.block_r * head_dim + 4 * tiles.block_c * head_dim
    if dq_pass:
        return 2 * elems
    return 2 * (elems + tiles.block_r * tiles.block_c) + 4 * 4 * tiles.block_c


def bwd_simt_smem_bytes(tiles: BwdTiles, head_dim: int, dq_pass: bool) -> int:
    """float32 tiles with rows padded by 4: kept (2), streamed (2), dS (and P^T), lse2/D (pass 0).
    Mirrors BwdSimtConfig::kSmemBytes."""
    stride, w_stride = head_dim + 4, tiles.block_c + 1
    floats = 2 * tiles.block_r * stride + 2 * tiles.block_c * stride
    floats += (1 if dq_pass else 2) * tiles.block_r * w_stride + (0 if dq_pass else 2 * tiles.block_c)
    return 4 * floats


def _bwd_size_defines() -> dict:
    return {"CUFLASH_PARAMS_SIZE": FWD_PARAMS.itemsize, "CUFLASH_BWD_PARAMS_SIZE": BWD_PARAMS.itemsize,
            "CUFLASH_CONVERT_PARAMS_SIZE": CONVERT_PARAMS.itemsize}


def default_backward_family(dtype_name: str, arch: str | None = None) -> str:
    """The backward kernel family used when none is forced, before bwd_sm90_obstacle and the
    layouts have their say (bwd_sm90 on sm_90a, where it runs)."""
    if dtype_name == "float32":
        return "bwd_simt"
    return "bwd_sm90" if arch is not None and arch.startswith("sm_90") else "bwd_sm80"


def backward_plan(family: str, dtype_name: str, head_dim: int, *, dq_pass: bool, score_mods,
                  dropout: bool, deterministic: bool | None = None, windowed: bool = True,
                  seqlen_q: int = 0, all_keys_seen: bool = False) -> LaunchPlan:
    """The variant of one backward pass.

    Parameters
    ----------
    family : {"bwd_sm80", "bwd_simt"}
    dtype_name : {"float16", "bfloat16", "float32"}
    head_dim : int
        Run-time head dim (a multiple of 8, at most 256).
    dq_pass : bool
        False: the dK/dV pass (with atomic dQ when asked at run time); True: the dQ pass.
    score_mods, dropout
        As in :func:`forward_plan`.
    deterministic : bool or "pass", optional
        bwd_sm90 only (required there): False, the dK/dV pass adds dQ in any order; True, it adds
        dQ in a fixed order (cuda_src/dq_order.cuh); "pass", dQ comes from bwd_sm80's dQ pass.
    windowed, seqlen_q
        bwd_sm90 only: whether the call has a causal mask or a sliding window, and its (longest)
        query length; without a window from BWD_SM90_WIDE_MIN_ROWS rows (BWD_SM90_WIDE_MIN_ROWS_GUARDED
        without ``all_keys_seen``) the query tiles may take BWD_SM90_WIDE_BLOCK_M's rows.
    all_keys_seen : bool
        bwd_sm90 only: every row sees every key of the tiles it meets (:func:`bwd_all_keys_seen`):
        the variant without dS's guard for P = 0, at BWD_SM90_UNGUARDED_HEAD_DIMS.

    Returns
    -------
    LaunchPlan
        ``block_m`` is the number of kept rows per CTA (grid: ceil(rows / block_m)).
    """
    mods = score_mod_bits(score_mods)
    if family == "bwd_sm80":
        if dtype_name not in ("float16", "bfloat16"):
            raise ValueError(f"bwd_sm80 runs float16/bfloat16, not {dtype_name}")
        kdim = _round_up(head_dim, SM80_HEAD_DIMS)
        featured = bool(mods or dropout)
        if dq_pass:
            table = BWD_SM80_DQ_TILES_MODS if mods else BWD_SM80_DQ_TILES_FEATURED if featured else BWD_SM80_DQ_TILES
            tiles = table[kdim]
        else:
            tiles = (BWD_SM80_DKDV_TILES_FEATURED if featured else BWD_SM80_DKDV_TILES)[kdim]
        smem = bwd_sm80_smem_bytes(tiles, kdim, dq_pass)
    elif family == "bwd_sm90":
        if dtype_name not in ("float16", "bfloat16"):
            raise ValueError(f"bwd_sm90 runs float16/bfloat16, not {dtype_name}")
        if dq_pass:
            raise ValueError("bwd_sm90 has no dQ pass (deterministic dQ runs bwd_sm80's)")
        if deterministic not in (False, True, "pass"):
            raise ValueError("bwd_sm90 needs deterministic=True, False or 'pass' (how dQ is added)")
        featured = bool(mods or dropout)
        if deterministic is True and not bwd_sm90_orders_dq(head_dim, featured):
            raise ValueError(f"bwd_sm90 adds dQ in a fixed order only at head dims {BWD_SM90_ORDERED_HEAD_DIMS}, "
                             "without score modifiers and dropout")
        obstacle = bwd_sm90_obstacle(head_dim, score_mods, dropout)
        if obstacle is not None:
            raise ValueError(obstacle)
        kdim = _round_up(head_dim, BWD_SM90_HEAD_DIMS)
        min_rows = BWD_SM90_WIDE_MIN_ROWS if all_keys_seen else BWD_SM90_WIDE_MIN_ROWS_GUARDED
        wide = not windowed and deterministic is False and seqlen_q >= min_rows
        block_n, block_m = bwd_sm90_tiles(kdim, featured, wide)
        stages = bwd_sm90_stages(kdim, featured, wide, deterministic)
        smem = bwd_sm90_smem_bytes(kdim, featured, wide, stages)
        defines = {
            "CUFLASH_DTYPE": DTYPE_CODES[dtype_name],
            "CUFLASH_HEAD_DIM": kdim,
            "CUFLASH_BLOCK_M": block_m,
            "CUFLASH_STAGES": stages,
            "CUFLASH_BWD_DQ": 0 if deterministic == "pass" else 2 if deterministic else 1,
            "CUFLASH_SCORE_MODS": mods,
            "CUFLASH_DROPOUT": int(dropout),
            "CUFLASH_SMEM_BYTES": smem,
            **_bwd_size_defines(),
        }
        if all_keys_seen and not windowed and not featured and kdim in BWD_SM90_UNGUARDED_HEAD_DIMS:
            defines["CUFLASH_ALL_KEYS_SEEN"] = 1
        elif windowed and not featured and bwd_sm90_tile_guard(kdim):
            defines["CUFLASH_TILE_GUARD"] = 1
        return LaunchPlan(Variant(family, tuple(sorted(defines.items()))), block_n, BWD_SM90_THREADS, smem, kdim)
    elif family == "bwd_simt":
        if dtype_name != "float32":
            raise ValueError(f"bwd_simt runs float32, not {dtype_name}")
        kdim = _round_up(head_dim, SIMT_HEAD_DIMS)
        tiles = _bwd_simt_tiles(kdim)
        smem = bwd_simt_smem_bytes(tiles, kdim, dq_pass)
    else:
        raise ValueError(f"unknown backward kernel family {family!r}")
    defines = {
        "CUFLASH_DTYPE": DTYPE_CODES[dtype_name],
        "CUFLASH_HEAD_DIM": kdim,
        "CUFLASH_BLOCK_R": tiles.block_r,
        "CUFLASH_MIN_BLOCKS": tiles.min_blocks,
        "CUFLASH_BWD_PASS": int(dq_pass),
        "CUFLASH_SCORE_MODS": mods,
        "CUFLASH_DROPOUT": int(dropout),
        "CUFLASH_SMEM_BYTES": smem,
        **_bwd_size_defines(),
    }
    if family == "bwd_sm80":
        defines.update(CUFLASH_BLOCK_C=tiles.block_c, CUFLASH_SUB_C=tiles.sub_c, CUFLASH_WARPS=tiles.warps,
                       CUFLASH_DSPLIT=tiles.dsplit)
    variant = Variant(family, tuple(sorted(defines.items())))
    return LaunchPlan(variant, tiles.block_r, 32 * tiles.warps, smem, kdim)


def bwd_preprocess_variant(dtype_name: str) -> Variant:
    """D = rowsum(dO * O) and lse2 (cuda_src/bwd_preprocess.cu); grid (rows_pad / 16, Hq, B) x 128."""
    return Variant("bwd_preprocess", {"CUFLASH_DTYPE": DTYPE_CODES[dtype_name], **_bwd_size_defines()})


def bwd_convert_variant(dtype_name: str) -> Variant:
    """float32 accumulators to the output dtype (cuda_src/bwd_convert.cu); 256 threads, 8 rows each."""
    return Variant("bwd_convert", {"CUFLASH_DTYPE": DTYPE_CODES[dtype_name], **_bwd_size_defines()})


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
# Whether bwd_sm90 may take its variant without dS's guard for P = 0 (bwd_all_keys_seen), and the
# head dims where it does. H100, bf16, full attention, per call in turns beside cuDNN: D = 64 2k and
# 8k 2-4% faster, D = 128 8k and 16k (80 query rows) 1.4% (four rounds each); H200, settled turns
# (two rounds): D = 256 +1% at 2k, +2.5-3% at 4k, +0.1-0.4% at 8k and 16k; D = 128 with 64 query
# rows (2k, 4k) 0 to +0.4% (benchmarks/NOTES.md, sessions 25 and 28).
BWD_ALL_KEYS_SEEN = True
BWD_SM90_UNGUARDED_HEAD_DIMS = (64, 128, 256)
# Under a causal mask or window, without score modifiers or dropout, the guard tile by tile: a tile
# with no masked element and no row past the queries' end skips it (CUFLASH_TILE_GUARD). H200,
# settled turns, two rounds: D = 64 causal 4k and 16k +2.5-3.5%; D = 128 causal +1.5% at 2k, +1-4%
# at 4k, +3-4% at 8k, +5.5% at 16k, its ordered dQ at 8k +2-6%; D = 256 causal 2k-16k 5-7% slower,
# 7-12% with its P^T and dS^T stored tile after tile (session 29): there the branch splits the one
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


def _bwd_sm90_plans(dtype_name: str, head_dim: int, mods, dropout: bool, deterministic) -> list[LaunchPlan]:
    """bwd_sm90's launch plans for one feature set: with a window, and without one (short and long
    queries; with and without every key seen)."""
    plans = [backward_plan("bwd_sm90", dtype_name, head_dim, dq_pass=False, score_mods=mods, dropout=dropout,
                           deterministic=deterministic)]
    for seqlen_q in (0, BWD_SM90_WIDE_MIN_ROWS, BWD_SM90_WIDE_MIN_ROWS_GUARDED):
        for all_keys_seen in (False, True):
            plans.append(backward_plan("bwd_sm90", dtype_name, head_dim, dq_pass=False, score_mods=mods,
                                       dropout=dropout, deterministic=deterministic, windowed=False,
                                       seqlen_q=seqlen_q, all_keys_seen=all_keys_seen))
    return plans


def precompile_backward_variants(dtypes=None, head_dims=None, arch=None) -> list[Variant]:
    """Backward variants worth compiling ahead of time: for each dtype and head dim, both passes,
    plain and with every feature, plus the preprocess and convert kernels; and bwd_sm90's (for
    sm_90a, or when ``arch`` is None) where it runs that head dim.

    Parameters
    ----------
    dtypes : sequence of str, optional
        Default: float16, bfloat16, float32.
    head_dims : sequence of int, optional
        Default: 64, 128, 256.
    """
    dtypes = tuple(dtypes or ("float16", "bfloat16", "float32"))
    head_dims = tuple(head_dims or (64, 128, 256))
    out = []
    for dtype_name in dtypes:
        dtype_name = np.dtype(dtype_name).name if dtype_name != "bfloat16" else dtype_name
        family = default_backward_family(dtype_name)
        for variant in (bwd_preprocess_variant(dtype_name), bwd_convert_variant(dtype_name)):
            if variant not in out:
                out.append(variant)
        for d in head_dims:
            for dq_pass in (False, True):
                for mods, dropout in ((False, False), (True, True)):
                    plan = backward_plan(family, dtype_name, d, dq_pass=dq_pass, score_mods=mods, dropout=dropout)
                    if plan.variant not in out:
                        out.append(plan.variant)
            if dtype_name != "float32" and (arch is None or arch.startswith("sm_90")):
                for mods, dropout, det in (((), False, False), ((), False, True), ((), False, "pass"),
                                           (SCORE_MODS, True, False)):
                    if bwd_sm90_obstacle(d, mods, dropout) is None:
                        if det is True and not bwd_sm90_orders_dq(d, bool(score_mod_bits(mods) or dropout)):
                            continue
                        for plan in _bwd_sm90_plans(dtype_name, d, mods, dropout, det):
                            if plan.variant not in out:
                                out.append(plan.variant)
    return out
