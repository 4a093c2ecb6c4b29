"""The forward families side by side: the variant of a call (:func:`forward_plan`, by family), the
family a dtype defaults to, and the forward variants worth compiling ahead of time."""

from __future__ import annotations

import functools

import numpy as np

from . import fwd_simt, fwd_sm80, fwd_sm90
from .common import LaunchPlan, round_up, with_user_source
from .._build.variant import Variant

FWD_FAMILIES = ("fwd_sm90", "fwd_sm80", "fwd_simt")


# typed: score_mods=True (every modifier) and score_mods=1 (the softcap alone) are equal as keys otherwise.
@functools.lru_cache(maxsize=None, typed=True)  # a pure function of its arguments, asked at every call
def forward_plan(family: str, dtype_name: str, head_dim: int, *, score_mods, dropout: bool,
                 consumers: int = 2, user_source: str = "", head_dim_v: int | None = None,
                 on_plain_loop: bool = False, tile_one_row: bool = False) -> LaunchPlan:
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
    user_source : str, default ""
        With ``"score_mod"``/``"mask_mod"`` among ``score_mods``: the functions written from the call's
        modifiers (:func:`cuflash.modifiers.kernel_source`), compiled into the variant.
    head_dim_v : int, optional
        Run-time head dim of v and out (a multiple of 8, at most 256), when it differs from
        ``head_dim``: every family compiles it (CUFLASH_HEAD_DIM_V).
    on_plain_loop : bool, default False
        fwd_sm90 only: ALiBi, the softcap, or a bias or mask read as tiles alone on the loop without modifiers
        (:func:`fwd_sm90.on_plain_loop`, :func:`fwd_sm90.score_tile`).
    tile_one_row : bool, default False
        fwd_sm90 only: that bias or mask the same for every query (:func:`fwd_sm90.tile_one_row`).
    """
    if on_plain_loop and family != "fwd_sm90":
        raise ValueError(f"a modifier on the loop without modifiers is fwd_sm90's, not {family}'s")
    if family == "fwd_sm90":
        plan = fwd_sm90.plan(dtype_name, head_dim, score_mods=score_mods, dropout=dropout, consumers=consumers,
                             head_dim_v=head_dim_v, on_plain_loop=on_plain_loop, tile_one_row=tile_one_row)
    elif family == "fwd_sm80":
        plan = fwd_sm80.plan(dtype_name, head_dim, score_mods=score_mods, dropout=dropout, head_dim_v=head_dim_v)
    elif family == "fwd_simt":
        plan = fwd_simt.plan(dtype_name, head_dim, score_mods=score_mods, dropout=dropout, head_dim_v=head_dim_v)
    else:
        raise ValueError(f"unknown kernel family {family!r}")
    return with_user_source(plan, user_source)



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
                if family == "fwd_sm90" and round_up(d, fwd_sm90.SM90_HEAD_DIMS) in fwd_sm90.SM90_WIDE_HEAD_DIMS:
                    wide = forward_plan(family, dtype_name, d, score_mods=False, dropout=False, consumers=3)
                    if wide.variant not in out:
                        out.append(wide.variant)
    return out
