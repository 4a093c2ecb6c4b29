"""What every kernel family's planning shares: the launch plan it returns, a CTA's tile shape, the
compiled head dims a run-time one rounds up to, and the shared memory of the devices it plans for.

Planning is pure: functions of shapes, options and device properties, tested on the CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..features import DTYPE_CODES, USER_MOD_BITS, score_mod_bits
from .._runtime.params import FWD_PARAMS
from .._build.variant import Variant

MAX_HEAD_DIM = 256
#: Opt-in shared memory per block of an H100/H200, the default budget of the ahead-of-time variants.
DEFAULT_SMEM_PER_BLOCK = 227 * 1024
DEFAULT_SMEM_PER_SM = 228 * 1024
#: The element bytes of fwd_sm90's and bwd_sm90's score tiles per modifier: the bias (q's dtype) and the
#: boolean mask.
SCORE_TILE_BYTES = {"bias": 2, "mask": 1}


@dataclass(frozen=True)
class Tiles:
    """One CTA's shape: query rows, keys per step, warps, CTAs per SM the registers aim at."""

    block_m: int
    block_n: int
    warps: int
    min_blocks: int = 1


@dataclass(frozen=True)
class LaunchPlan:
    """What the launcher needs besides the parameters: the variant, grid rows and resources."""

    variant: Variant
    block_m: int
    threads: int
    smem_bytes: int
    head_dim: int  # compiled head dim (>= the run-time one)
    head_dim_v: int = 0  # compiled head dim of v and out; 0: head_dim's

    @property
    def value_head_dim(self) -> int:
        """The compiled head dim of v, out, dout and dv."""
        return self.head_dim_v or self.head_dim


def round_up(x: int, options: tuple[int, ...]) -> int:
    """The first compiled head dim in ``options`` that holds ``x``."""
    for value in options:
        if x <= value:
            return value
    raise ValueError(f"head dim {x} exceeds the maximum of {options[-1]}")


def value_head_dim_defines(head_dim: int, head_dim_v: int | None) -> dict:
    """CUFLASH_HEAD_DIM_V for a variant whose v has a compiled head dim of its own; none when it
    equals q's (the kernels default it to CUFLASH_HEAD_DIM, so those variants keep their keys)."""
    if head_dim_v is None or head_dim_v == head_dim:
        return {}
    return {"CUFLASH_HEAD_DIM_V": head_dim_v}


def tiled_plan(family: str, dtype_name: str, head_dim: int, tiles: Tiles, smem: int, *, score_mods,
               dropout: bool, head_dim_v: int | None = None) -> LaunchPlan:
    """The launch plan of a forward family whose CTA shape is a :class:`Tiles` (fwd_sm80, fwd_simt):
    the defines its kernel reads, for a compiled head dim (and ``head_dim_v``, v's, when it differs)."""
    defines = {
        **value_head_dim_defines(head_dim, head_dim_v),
        "CUFLASH_DTYPE": DTYPE_CODES[dtype_name],
        "CUFLASH_HEAD_DIM": head_dim,
        "CUFLASH_BLOCK_M": tiles.block_m,
        "CUFLASH_BLOCK_N": tiles.block_n,
        "CUFLASH_WARPS": tiles.warps,
        "CUFLASH_MIN_BLOCKS": tiles.min_blocks,
        "CUFLASH_SCORE_MODS": score_mod_bits(score_mods),
        "CUFLASH_DROPOUT": int(dropout),
        "CUFLASH_SMEM_BYTES": smem,
        "CUFLASH_PARAMS_SIZE": FWD_PARAMS.itemsize,
    }
    return LaunchPlan(Variant(family, tuple(sorted(defines.items()))), tiles.block_m, 32 * tiles.warps, smem,
                      head_dim, head_dim_v if head_dim_v not in (None, head_dim) else 0)


def with_user_source(plan: LaunchPlan, source: str) -> LaunchPlan:
    """``plan`` with the functions written from the call's ScoreMod/MaskMod compiled into its variant
    (:func:`cuflash.modifiers.kernel_source`). A variant has them exactly when its CUFLASH_SCORE_MODS has a
    user modifier's bit: one without the other would not compile, or would compile a function in vain."""
    user_bits = dict(plan.variant.defines).get("CUFLASH_SCORE_MODS", 0) & USER_MOD_BITS
    if bool(user_bits) != bool(source):
        raise ValueError("a variant with score_mod/mask_mod needs their generated source, and one without takes none")
    if not source:
        return plan
    return dataclasses.replace(plan, variant=dataclasses.replace(plan.variant, source=source))
