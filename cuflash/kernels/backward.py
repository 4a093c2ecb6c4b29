"""The backward families side by side: the variant of one pass (:func:`backward_plan`, by family),
the family a dtype defaults to, and the backward variants worth compiling ahead of time."""

from __future__ import annotations

import numpy as np

from . import bwd_simt, bwd_sm80, bwd_sm90
from .bwd_common import bwd_convert_variant, bwd_dsinks_variant, bwd_preprocess_variant
from .common import LaunchPlan, with_user_source
from .._build.variant import Variant
from ..features import SCORE_MODS, score_mod_bits

BWD_FAMILIES = ("bwd_sm90", "bwd_sm80", "bwd_simt")


def default_backward_family(dtype_name: str, arch: str | None = None) -> str:
    """The backward kernel family used when none is forced, before bwd_sm90_obstacle and the
    layouts have their say (bwd_sm90 on sm_90a, where it runs)."""
    if dtype_name == "float32":
        return "bwd_simt"
    return "bwd_sm90" if arch is not None and arch.startswith("sm_90") else "bwd_sm80"


def backward_plan(family: str, dtype_name: str, head_dim: int, *, dq_pass: bool, score_mods,
                  dropout: bool, deterministic: bool | None = None, windowed: bool = True,
                  seqlen_q: int = 0, all_keys_seen: bool = False, user_source: str = "",
                  head_dim_v: int | None = None, score_tile: bool = False, tile_one_row: bool = False,
                  persistent: bool = False, dq_first_stores: bool = False) -> LaunchPlan:
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
    user_source : str, default ""
        As in :func:`cuflash.kernels.forward.forward_plan` (the backward's, with the ScoreMod's grad).
    head_dim_v : int, optional
        Run-time head dim of v, out, dout and dv when it differs from ``head_dim``: the families compile
        it (CUFLASH_HEAD_DIM_V); bwd_sm90 the pairs of its BWD_SM90_PAIRS only
        (:func:`bwd_sm90.bwd_sm90_obstacle`).
    score_tile, tile_one_row : bool, default False
        bwd_sm90 only: the bias or mask alone read as TMA tiles (:func:`bwd_sm90.takes_score_tiles`);
        ``tile_one_row``: that bias or mask the same for every query (:func:`fwd_sm90.tile_one_row`).
    persistent : bool, default False
        bwd_sm90 only: CTAs that take key blocks from a counter (:func:`bwd_sm90.bwd_sm90_persistent`).
    dq_first_stores : bool, default False
        bwd_sm90 only: the call lets each dQ tile's first writer store it
        (:func:`bwd_sm90.bwd_sm90_first_stores_dq`); the variant does where its dQ goes through writers.

    Returns
    -------
    LaunchPlan
        ``block_m`` is the number of kept rows per CTA (grid: ceil(rows / block_m)).
    """
    if family == "bwd_sm90":
        if dq_pass:
            raise ValueError("bwd_sm90 has no dQ pass (deterministic dQ runs bwd_sm80's)")
        obstacle = bwd_sm90.bwd_sm90_obstacle(head_dim, score_mods, dropout, head_dim_v)
        if obstacle is not None:
            raise ValueError(obstacle)
        plan = bwd_sm90.plan(dtype_name, head_dim, score_mods=score_mods, dropout=dropout,
                             deterministic=deterministic, windowed=windowed, seqlen_q=seqlen_q,
                             all_keys_seen=all_keys_seen, head_dim_v=head_dim_v, score_tile=score_tile,
                             tile_one_row=tile_one_row, persistent=persistent, dq_first_stores=dq_first_stores)
    elif persistent or dq_first_stores:
        raise ValueError(f"{family} has neither persistent CTAs nor dQ writers (bwd_sm90's)")
    elif score_tile:
        raise ValueError(f"{family} reads no score tiles (bwd_sm90's)")
    elif family == "bwd_sm80":
        plan = bwd_sm80.plan(dtype_name, head_dim, dq_pass=dq_pass, score_mods=score_mods, dropout=dropout,
                             head_dim_v=head_dim_v)
    elif family == "bwd_simt":
        plan = bwd_simt.plan(dtype_name, head_dim, dq_pass=dq_pass, score_mods=score_mods, dropout=dropout,
                             head_dim_v=head_dim_v)
    else:
        raise ValueError(f"unknown backward kernel family {family!r}")
    return with_user_source(plan, user_source)


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
        for variant in (bwd_preprocess_variant(dtype_name), bwd_preprocess_variant(dtype_name, dq_first_stores=True),
                        bwd_convert_variant(dtype_name), bwd_dsinks_variant()):
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
                    if bwd_sm90.bwd_sm90_obstacle(d, mods, dropout) is None:
                        if det is True and not bwd_sm90.bwd_sm90_orders_dq(d, bool(score_mod_bits(mods) or dropout)):
                            continue
                        for plan in bwd_sm90.feature_plans(dtype_name, d, mods, dropout, det):
                            if plan.variant not in out:
                                out.append(plan.variant)
    return out
