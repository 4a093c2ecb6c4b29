"""Which variants exist: those worth compiling ahead of time (``python -m cuflash precompile``,
:func:`cuflash.precompile`), every variant a call can reach (what the GPU tests may compile), and
what the CPU tests compile for sm_80 and sm_90a."""

from __future__ import annotations

import numpy as np

from .backward import backward_plan, default_backward_family, precompile_backward_variants
from .bwd_common import bwd_convert_variant, bwd_dsinks_variant, bwd_preprocess_variant
from .bwd_sm90 import (BWD_SM90_HEAD_DIMS, BWD_SM90_PAIRS, BWD_SM90_PERSISTENT_HEAD_DIMS, BWD_SM90_SCORE_TILE_HEAD_DIM,
                       bwd_sm90_obstacle, bwd_sm90_orders_dq, bwd_sm90_smem_bytes, feature_plans, takes_score_tiles)
from .check_indices import check_indices_variant
from .work_order import work_order_variant
from .common import round_up
from .decode import (DECODE_KV_DTYPES, DECODE_MLA_HEAD_DIM, DECODE_MMA_HEAD_DIMS, DECODE_SIMT_HEAD_DIMS, _decode_path,
                     decode_plan, decode_precompile_variants)
from .forward import default_family, forward_plan, forward_precompile_variants
from .fwd_simt import SIMT_HEAD_DIMS
from .fwd_sm80 import SM80_HEAD_DIMS
from .append_kv import append_kv_variant
from .fwd_sm90 import SCORE_TILE_HEAD_DIMS, SM90_HEAD_DIMS, SM90_WIDE_HEAD_DIMS, kv_cache_variants
from .merge import merge_plan
from .mla_sm90 import MLA_SM90_DTYPES, MLA_SM90_ROWS, mla_sm90_variant
from .rng_state import rng_state_variant
from .._build.variant import Variant
from ..features import DECODE_SCORE_MODS, score_mod_bits, score_mod_sets


def precompile_variants(dtypes=None, head_dims=None, families=None, arch=None) -> list[Variant]:
    """Every kernel family's variants worth compiling ahead of time (``python -m cuflash
    precompile``, :func:`cuflash.precompile`): forward, decode and merge, backward, the index check,
    append_kv, fwd_sm90 over a KV cache and MLA decode on wgmma (mla_sm90)."""
    out = forward_precompile_variants(dtypes, head_dims, families, arch)
    for more in (decode_precompile_variants(dtypes, head_dims), precompile_backward_variants(dtypes, head_dims, arch)):
        out += [v for v in more if v not in out and (families is None or v.family in families)]
    if families is None or "check_indices" in families:
        out.append(check_indices_variant())
    if families is None or "append_kv" in families:
        out.append(append_kv_variant())
    if families is None or "work_order" in families:
        out += [work_order_variant(0), work_order_variant(1)]
    if (families is None or "fwd_sm90" in families) and (arch is None or arch.startswith("sm_90")):
        # decode's chunked prefill on fwd_sm90 (square head dims; the pair compiles on first use)
        out += [v for v in kv_cache_variants(tuple(d for d in (dtypes or ("float16", "bfloat16")) if d != "float32"),
                                             tuple(sorted({round_up(d, SM90_HEAD_DIMS) for d in head_dims}))
                                             if head_dims else SM90_HEAD_DIMS)
                if "CUFLASH_HEAD_DIM_V" not in dict(v.defines) and v not in out]
    if (families is None or "mla_sm90" in families) and (arch is None or arch.startswith("sm_90")):
        out += [mla_sm90_variant(d, rows) for d in (dtypes or MLA_SM90_DTYPES) for rows in MLA_SM90_ROWS
                if d in MLA_SM90_DTYPES and (not head_dims or DECODE_MLA_HEAD_DIM in head_dims)]
    if families is None or "rng_state" in families:
        out.append(rng_state_variant())
    return out


def ci_user_modifiers():
    """The ScoreMod and MaskMod whose variants the CPU test compiles: a relative-position bias table
    and a document mask (float and int arithmetic, array reads of two dtypes, a scalar, a call).
    Arrays on the host: only their dtypes matter here.

    Heavier expressions may spill, in the sm90 families above all (168 registers a consumer thread),
    the kernels staying correct, only slower: with a window term ``&& q_idx - kv_idx <= w`` in the
    mask (a branch per element: ``&&`` short-circuits around the array reads) fwd_sm90 at D = 128
    spilled 120 B, bwd_sm80 at D = 64 16 B; a tanh cap over the table read, 56 B in fwd_sm90."""
    from ..modifiers import MaskMod, ScoreMod

    table, doc = np.zeros(64, np.float32), np.zeros(64, np.int32)
    score_mod = ScoreMod("score + table[h * n + abs(q_idx - kv_idx)]", table=table, n=16)
    mask_mod = MaskMod("doc[b * S + q_idx] == doc[b * S + kv_idx]", doc=doc, S=32)
    return score_mod, mask_mod


def user_variants(arch: str, head_dims=(64, 128), sparse: bool = False) -> list[Variant]:
    """One variant of each forward and backward family with :func:`ci_user_modifiers`, at ``head_dims``,
    for ``arch`` (the sm90 families for sm_90a only): what the CPU test compiles of the user modifiers.
    ``sparse``: the MaskMod alone with the block mask derived from it (:mod:`cuflash._mask_blocks`)."""
    from ..modifiers import kernel_source

    score_mod, mask_mod = ci_user_modifiers()
    if sparse:   # the MaskMod alone (with the ScoreMod too, fwd_simt at D = 64 spilled 16 B on sm_80)
        score_mod = None
    forward_source, backward_source = kernel_source(score_mod, mask_mod), kernel_source(score_mod, mask_mod, backward=True)
    mods = ("block_mask", "mask_mod") if sparse else ("score_mod", "mask_mod")
    out = []
    for d in head_dims:
        plans = [forward_plan("fwd_sm80", "bfloat16", d, score_mods=mods, dropout=False, user_source=forward_source),
                 forward_plan("fwd_simt", "float32", d, score_mods=mods, dropout=False, user_source=forward_source)]
        for family, dtype_name in (("bwd_sm80", "bfloat16"), ("bwd_simt", "float32")):
            plans += [backward_plan(family, dtype_name, d, dq_pass=dq_pass, score_mods=mods, dropout=False,
                                    user_source=backward_source) for dq_pass in (False, True)]
        if arch.startswith("sm_90"):
            plans.append(forward_plan("fwd_sm90", "bfloat16", d, score_mods=mods, dropout=False,
                                      user_source=forward_source))
            plans.append(backward_plan("bwd_sm90", "bfloat16", d, dq_pass=False, score_mods=mods, dropout=False,
                                       deterministic=False, user_source=backward_source))
        out += [p.variant for p in plans if p.variant not in out]
    return out


def user_decode_variants() -> list[Variant]:
    """The decode variants with :func:`ci_user_modifiers` that the CPU test compiles (for sm_80 and
    sm_90a alike): bf16 at D = 128 and 256 and float32 at D = 128, contiguous and paged; the bf16
    D = 256 paged one with every built-in modifier beside them (the most registers)."""
    from ..modifiers import kernel_source

    score_mod, mask_mod = ci_user_modifiers()
    source, user = kernel_source(score_mod, mask_mod), ("score_mod", "mask_mod")
    out = []
    for dtype_name, d in (("bfloat16", 128), ("bfloat16", 256), ("float32", 128)):
        for paged in (False, True):
            mods = user + (DECODE_SCORE_MODS if (dtype_name, d, paged) == ("bfloat16", 256, True) else ())
            out.append(decode_plan(dtype_name, d, paged=paged, score_mods=mods, user_source=source).variant)
    return out


#: (D_qk, D_v) pairs with a value head dim of their own that the sweep compiles: DeepSeek's (192, 128) and
#: the two of issue 53 on the tensor-core families; one pair on the float32 ones (they compile any pair).
VALUE_HEAD_DIM_PAIRS = ((192, 128), (128, 64), (64, 128))
VALUE_HEAD_DIM_PAIRS_SIMT = ((192, 128),)


def value_head_dim_variants(dtypes=("bfloat16", "float32"), sm90: bool = True) -> list[Variant]:
    """fwd_sm80/bwd_sm80 (both passes) and fwd_sm90 and bwd_sm90 (``sm90``; bwd_sm90 with each of its
    dQ modes and tiles, where it runs the pair) at VALUE_HEAD_DIM_PAIRS and fwd_simt/bwd_simt at
    VALUE_HEAD_DIM_PAIRS_SIMT, plain and with every score modifier and dropout."""
    out = []
    for dtype_name in dtypes:
        simt = dtype_name == "float32"
        fwd, bwd = ("fwd_simt", "bwd_simt") if simt else ("fwd_sm80", "bwd_sm80")
        for d, d_v in (VALUE_HEAD_DIM_PAIRS_SIMT if simt else VALUE_HEAD_DIM_PAIRS):
            for mods, dropout in ((False, False), (True, True)):
                out.append(forward_plan(fwd, dtype_name, d, score_mods=mods, dropout=dropout, head_dim_v=d_v).variant)
                if sm90 and not simt:
                    out.append(forward_plan("fwd_sm90", dtype_name, d, score_mods=mods, dropout=dropout,
                                            head_dim_v=d_v).variant)
                for dq_pass in (False, True):
                    out.append(backward_plan(bwd, dtype_name, d, dq_pass=dq_pass, score_mods=mods, dropout=dropout,
                                             head_dim_v=d_v).variant)
        # bwd_sm90 at each of its compiled pairs (DeepSeek's (192, 128) and (256, 128) both), also with
        # each modifier that keeps the plain tiles (bwd_sm90_featured)
        singles = tuple(((name,), False) for name in ("softcap", "alibi", "block_mask"))
        for d, d_v in (() if simt or not sm90 else BWD_SM90_PAIRS):
            for mods, dropout in ((False, False), (True, True)) + singles:
                if bwd_sm90_obstacle(d, mods, dropout, d_v) is None:
                    featured = bool(score_mod_bits(mods) or dropout)
                    for det in (False, "pass") + ((True,) if bwd_sm90_orders_dq(d, featured) else ()):
                        out += [p.variant for p in feature_plans(dtype_name, d, mods, dropout, det, d_v)]
    return list(dict.fromkeys(out))


def ci_mask_blocks_variants() -> list[Variant]:
    """The block-mask evaluations (cuda_src/mask_blocks.cu) the CPU test compiles: of
    :func:`ci_user_modifiers`' MaskMod, a causal document mask and a prefix-LM mask."""
    from ..modifiers import MaskMod, kernel_source
    from .mask_blocks import mask_blocks_variant

    doc = np.zeros(64, np.int32)
    masks = (ci_user_modifiers()[1], MaskMod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx", doc=doc),
             MaskMod("kv_idx < prefix || kv_idx <= q_idx", prefix=16))
    return [mask_blocks_variant(kernel_source(None, m)) for m in masks]


def fp8_decode_variants() -> list[Variant]:
    """The decode variants on fp8 (e4m3) caches that the CPU test compiles (for sm_80 and sm_90a
    alike): bf16 at D = 128 and 256 (the most registers) and fp16 at D = 64, contiguous and paged,
    plain and with every built-in modifier."""
    out = []
    for dtype_name, dims in (("bfloat16", (128, 256)), ("float16", (64,))):
        out += [v for v in decode_precompile_variants((dtype_name,), dims, kv_dtypes=DECODE_KV_DTYPES)
                if v.family == "decode"]
    return out


def keys_as_m_decode_variants() -> list[Variant]:
    """The decode variants with the keys as the mma's M (DECODE_KEYS_AS_M_BY_DEFAULT) that the CPU test
    compiles (for sm_80 and sm_90a alike): bf16 at D = 128 and 256 and fp16 at D = 64, on 16-bit and fp8
    caches, contiguous and paged, plain and with every built-in modifier; and bf16 at D = 128 with
    :func:`ci_user_modifiers` (their tiles differ: decode_plan)."""
    from ..modifiers import kernel_source

    out = [decode_plan(dtype_name, d, paged=paged, score_mods=mods, kv_dtype=kv_dtype, keys_as_m=True).variant
           for dtype_name, dims in (("bfloat16", (128, 256)), ("float16", (64,))) for d in dims
           for kv_dtype in (None,) + DECODE_KV_DTYPES for paged in (False, True) for mods in (False, True)]
    score_mod, mask_mod = ci_user_modifiers()
    source = kernel_source(score_mod, mask_mod)
    return out + [decode_plan("bfloat16", 128, paged=paged, score_mods=("score_mod", "mask_mod"), user_source=source,
                              kv_dtype=kv_dtype, keys_as_m=True).variant
                  for kv_dtype in (None,) + DECODE_KV_DTYPES for paged in (False, True)]


def mla_decode_variants(dtypes=("float16", "bfloat16"), score_mod_sets_=None) -> list[Variant]:
    """MLA decode's variants (one latent cache, head dim DECODE_MLA_HEAD_DIM): per dtype, contiguous
    and paged, each of decode's score-modifier sets (default: plain and all of them)."""
    sets = score_mod_sets_ if score_mod_sets_ is not None else (False, True)
    return [decode_plan(dtype_name, DECODE_MLA_HEAD_DIM, paged=paged, score_mods=mods, mla=True).variant
            for dtype_name in dtypes for paged in (False, True) for mods in sets]


def ci_variants() -> list[tuple[Variant, str]]:
    """(variant, arch) pairs the CPU test compiles: every family for sm_80 and sm_90a (fwd_sm90 for
    sm_90a only), forward at every default head dim, decode/merge and backward at D=128, each
    score modifier alone (forward, backward, decode at D=128, no dropout), the user modifiers of
    :func:`user_variants` (D = 64 and 128; with and without the block mask derived from the MaskMod)
    and :func:`user_decode_variants`, the block-mask evaluations of :func:`ci_mask_blocks_variants`,
    :func:`mla_decode_variants`, :func:`keys_as_m_decode_variants`, append_kv, fwd_sm90 over a KV
    cache (bf16, sm_90a: :func:`kv_cache_variants`) and mla_sm90 (bf16, sm_90a)."""
    pairs = []
    for arch in ("sm_80", "sm_90a"):
        variants = forward_precompile_variants(arch=arch)
        for more in (decode_precompile_variants(("bfloat16", "float32"), (128,)),
                     precompile_backward_variants(("bfloat16", "float32"), (128,), arch)):
            variants += [v for v in more if v not in variants]
        variants += [check_indices_variant(), rng_state_variant(), work_order_variant(0), work_order_variant(1)]
        singles = [v for v in reachable_variants(arch, ("bfloat16", "float32"), (128,))
                   if _one_score_mod(v) and not dict(v.defines).get("CUFLASH_DROPOUT")]
        variants += [v for v in singles if v not in variants]
        variants += [v for v in user_variants(arch) if v not in variants]
        variants += [v for v in user_variants(arch, sparse=True) if v not in variants]
        variants += [v for v in ci_mask_blocks_variants() if v not in variants]
        variants += [v for v in user_decode_variants() if v not in variants]
        variants += [v for v in value_head_dim_variants(sm90=arch.startswith("sm_90")) if v not in variants]
        variants += [v for v in fp8_decode_variants() if v not in variants]
        variants += [v for v in mla_decode_variants() if v not in variants]
        variants += [v for v in keys_as_m_decode_variants() if v not in variants]
        variants.append(append_kv_variant())
        if arch.startswith("sm_90"):
            variants += [v for v in kv_cache_variants(("bfloat16",)) if v not in variants]
            variants += [mla_sm90_variant("bfloat16", rows) for rows in MLA_SM90_ROWS]
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
    # And bwd_sm90's persistent CTAs (CUFLASH_BWD_PERSISTENT), which only D = 64 takes.
    persistent = [backward_plan("bwd_sm90", dtype_name, d, dq_pass=False, score_mods=(), dropout=False,
                                deterministic=False, persistent=True).variant
                  for dtype_name in ("bfloat16", "float16") for d in BWD_SM90_PERSISTENT_HEAD_DIMS]
    pairs += [(v, "sm_90a") for v in dict.fromkeys(persistent)]
    return pairs


def _defers_dq(variant: Variant) -> bool:
    """A square bwd_sm90 variant at D = 128 that defers dQ (the stage and lag A/Bs' subject)."""
    d = dict(variant.defines)
    return (variant.family == "bwd_sm90" and d["CUFLASH_HEAD_DIM"] == 128 and d["CUFLASH_BLOCK_M"] == 64
            and "CUFLASH_HEAD_DIM_V" not in d
            and d["CUFLASH_BWD_DQ"] == 1 and not d["CUFLASH_SCORE_MODS"] and not d["CUFLASH_DROPOUT"])


def _with_stages(variant: Variant, stages: int) -> Variant:
    d = dict(variant.defines)
    d.update(CUFLASH_STAGES=stages, CUFLASH_SMEM_BYTES=bwd_sm90_smem_bytes(d["CUFLASH_HEAD_DIM"], stages=stages))
    return Variant(variant.family, tuple(sorted(d.items())), variant.source)


def _with_define(variant: Variant, name: str, value: int) -> Variant:
    return Variant(variant.family, tuple(sorted({**dict(variant.defines), name: value}.items())), variant.source)


def _one_score_mod(variant: Variant) -> bool:
    mods = dict(variant.defines).get("CUFLASH_SCORE_MODS", 0)
    return mods != 0 and mods & (mods - 1) == 0


def reachable_variants(arch: str | None = None, dtypes=None, head_dims=None) -> list[Variant]:
    """Every variant a call can reach: per family, dtype and compiled head dim, each score-modifier
    set the planners give (:func:`score_mod_sets`) with and without dropout, both backward passes,
    contiguous and paged decode (16-bit and fp8 caches, both tiles, the short-sequence tiles), MLA on
    wgmma, fwd_sm90 over a KV cache, and the merge, preprocess, convert, index-check, append,
    rng-state and work-order kernels.
    What the GPU tests may compile (``benchmarks/gpu_check.sh`` builds them all first); for the default
    shared-memory budget of decode.

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
        return compiled if head_dims is None else sorted({round_up(d, compiled) for d in head_dims})

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
                if family == "fwd_sm90":   # ALiBi (causal), the softcap, a bias or a mask alone (on_plain_loop, score_tile)
                    tiled = (("bias",), ("mask",)) if d in SCORE_TILE_HEAD_DIMS else ()
                    for mods in (("alibi",), ("softcap",), *tiled):
                        for dropout in (False, True):
                            for one_row in (False, True) if mods in tiled else (False,):   # (tile_one_row)
                                out.setdefault(forward_plan(family, dtype_name, d, score_mods=mods, dropout=dropout,
                                                            on_plain_loop=True, tile_one_row=one_row).variant)
                if family == "fwd_sm90" and d in SM90_WIDE_HEAD_DIMS:
                    out.setdefault(forward_plan(family, dtype_name, d, score_mods=False, dropout=False,
                                                consumers=3).variant)
        family = default_backward_family(dtype_name)
        out.setdefault(bwd_preprocess_variant(dtype_name))
        out.setdefault(bwd_preprocess_variant(dtype_name, dq_first_stores=True))
        out.setdefault(bwd_convert_variant(dtype_name))
        out.setdefault(bwd_dsinks_variant())
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
                                for plan in feature_plans(dtype_name, d, mods, dropout, det):
                                    out.setdefault(plan.variant)
            # a bias or a mask alone read as tiles (takes_score_tiles; with or without a window, one variant),
            # of the query tile's rows or one row for all (tile_one_row), dQ tiles zeroed or first stored
            for mods in (("bias",), ("mask",)):
                d = BWD_SM90_SCORE_TILE_HEAD_DIM
                if takes_score_tiles(d, mods, False, False) and d in dims(BWD_SM90_HEAD_DIMS):
                    for one_row in (False, True):
                        for first_stores in (False, True):
                            out.setdefault(backward_plan("bwd_sm90", dtype_name, d, dq_pass=False, score_mods=mods,
                                                         dropout=False, deterministic=False, score_tile=True,
                                                         tile_one_row=one_row, dq_first_stores=first_stores).variant)
        for d in dims(DECODE_MMA_HEAD_DIMS if _decode_path(dtype_name) == "mma" else DECODE_SIMT_HEAD_DIMS):
            for paged in (False, True):
                for mods in score_mod_sets(DECODE_SCORE_MODS):
                    out.setdefault(decode_plan(dtype_name, d, paged=paged, score_mods=mods).variant)
                    if dtype_name == "float32":
                        continue
                    # fp8 (e4m3) caches, the keys-as-M tiles of calls of a few packed rows, and theirs for many
                    # short sequences (the same variant where a head dim has none)
                    for kv_dtype, keys_as_m, short in (("float8_e4m3fn", False, False), (None, True, False),
                                                       ("float8_e4m3fn", True, False), (None, True, True)):
                        out.setdefault(decode_plan(dtype_name, d, paged=paged, score_mods=mods, kv_dtype=kv_dtype,
                                                   keys_as_m=keys_as_m, short=short).variant)
        if dtype_name != "float32" and (head_dims is None or DECODE_MLA_HEAD_DIM in head_dims):
            for variant in mla_decode_variants((dtype_name,), score_mod_sets(DECODE_SCORE_MODS)):
                out.setdefault(variant)
            if arch is None or arch.startswith("sm_90"):   # MLA on wgmma (cuflash/_mla_plan.py)
                for rows in MLA_SM90_ROWS:
                    out.setdefault(mla_sm90_variant(dtype_name, rows))
        out.setdefault(merge_plan("float32", dtype_name).variant)
        out.setdefault(merge_plan(dtype_name, dtype_name).variant)
    out.setdefault(merge_plan("float64", "float64").variant)   # merge_states of float64 states
    out.setdefault(check_indices_variant())
    out.setdefault(rng_state_variant())
    out.setdefault(append_kv_variant())
    out.setdefault(work_order_variant(0))
    out.setdefault(work_order_variant(1))
    if arch is None or arch.startswith("sm_90"):   # decode's many new tokens on fwd_sm90
        for variant in kv_cache_variants(tuple(d for d in dtypes if d != "float32"), dims(SM90_HEAD_DIMS)):
            if head_dims is None or "CUFLASH_HEAD_DIM_V" not in dict(variant.defines):   # (as the pairs below)
                out.setdefault(variant)
    if head_dims is None:   # (a head-dim filter asks for equal head dims)
        for variant in value_head_dim_variants(tuple(dtypes), sm90=arch is None or arch.startswith("sm_90")):
            out.setdefault(variant)
    return list(out)
