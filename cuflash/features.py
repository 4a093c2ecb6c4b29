"""The two tables every layer reads: the element types the kernels take, and the score modifiers.

A dtype or a modifier is added here first; the kernels' side of each table is asserted against
this one by ``tests/cpu/test_features.py`` (``cuda_src/common.cuh`` ``DtypeCode``,
``cuda_src/mask.cuh`` ``ScoreMod``), and ``docs/internals.md`` lists the other places a new entry
touches.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

#: One numbering of element types for every kernel: CUFLASH_DTYPE (the attention families),
#: CUFLASH_IN_DTYPE / CUFLASH_OUT_DTYPE (merge) and the run-time ``bias_dtype`` of a bias array
#: (cuda_src/common.cuh, ``DtypeCode``).
DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}


class ScoreMod(NamedTuple):
    """A built-in score modifier: its name in CUFLASH_SCORE_MODS, the entry points' keyword, its
    bit (cuda_src/mask.cuh, ``ScoreMod``), and whether decode has it."""

    name: str
    keyword: str
    bit: int
    decode: bool


# In the order of their bits and of the score pipeline (docs/design.md §2): cap, ALiBi, bias, masks.
# Decode's mask is its own (cuda_src/decode.cu); decode takes no bias or block mask.
MODIFIERS = (
    ScoreMod("softcap", "softcap", 1, True),
    ScoreMod("alibi", "alibi_slopes", 2, True),
    ScoreMod("bias", "bias", 4, False),
    ScoreMod("mask", "mask", 8, True),
    ScoreMod("block_mask", "block_mask", 16, False),
)

# A variant compiles only the modifiers whose bits it has, so that a call with one modifier waits
# only for that one's code (fwd_sm90 with all five took 30-45 s of NVRTC:
# docs/decisions.md#score-modifier-variants). A call with two or more shares the variant with all of
# them, which is precompiled: that keeps the variants per configuration at 7 (none, each alone,
# all) instead of 32, the count that tests and first calls could otherwise meet.
SCORE_MODS = tuple(m.name for m in MODIFIERS)
#: Decode's modifiers.
DECODE_SCORE_MODS = tuple(m.name for m in MODIFIERS if m.decode)

#: The user-written modifiers (cuflash.ScoreMod, cuflash.MaskMod): bits of CUFLASH_SCORE_MODS too
#: (``kModUserScore``, ``kModUserMask``), but each variant that has one also carries the functions
#: written from the call's expression (:attr:`cuflash._build.variant.Variant.source`), so they are
#: never among "every modifier" (``score_mods=True``) and never merged with the built-in ones: the
#: built-in bits of a call are chosen as before and the user bits are added to them.
USER_MODIFIERS = (
    ScoreMod("score_mod", "score_mod", 32, False),
    ScoreMod("mask_mod", "mask_mod", 64, False),
)
USER_MOD_BITS = sum(m.bit for m in USER_MODIFIERS)
_MOD_BITS = {m.name: m.bit for m in MODIFIERS + USER_MODIFIERS} | {m.keyword: m.bit for m in MODIFIERS}


def score_mod_bits(score_mods, names=SCORE_MODS) -> int:
    """CUFLASH_SCORE_MODS of the variant for a call's score modifiers.

    Parameters
    ----------
    score_mods : bool, int or iterable of str
        The modifiers the call uses: names from ``names`` (or their keywords: ``"alibi_slopes"`` is
        ``"alibi"``), or True for all of them, False / None / empty for none, or a bit mask as an int.
    names : tuple of str
        The modifiers the kernel family has (:data:`SCORE_MODS`, :data:`DECODE_SCORE_MODS`).

        ``"score_mod"`` / ``"mask_mod"`` (:data:`USER_MODIFIERS`) may come beside them where
        ``names`` is :data:`SCORE_MODS` (not in decode).

    Returns
    -------
    int
        0 for none, the modifier's bit for one alone, every bit of ``names`` for two or more; plus
        the bits of the user modifiers, as given.

    Raises
    ------
    ValueError
        For a name or bit the family does not have.
    """
    every = sum(_MOD_BITS[n] for n in names)
    user = USER_MOD_BITS if names == SCORE_MODS else 0
    if isinstance(score_mods, bool) or score_mods is None:
        return every if score_mods else 0
    if isinstance(score_mods, (int, np.integer)):
        bits = int(score_mods)
        if bits < 0 or bits & ~(every | user):
            raise ValueError(f"score_mods bit mask {bits} has bits outside {every | user} ({', '.join(names)})")
    else:
        bits = 0
        for name in score_mods:
            if _MOD_BITS.get(name, 0) & (every | user) == 0:
                raise ValueError(f"unknown score modifier {name!r}: expected some of {', '.join(names)}")
            bits |= _MOD_BITS[name]
    user_bits, bits = bits & user, bits & ~user
    return user_bits | (bits if bits & (bits - 1) == 0 else every)


def score_mod_sets(names=SCORE_MODS) -> list[int]:
    """Every CUFLASH_SCORE_MODS a planner gives for a family with these modifiers: none, each alone,
    all (for precompiling and timing everything calls can reach)."""
    return [0] + [_MOD_BITS[n] for n in names] + [score_mod_bits(True, names)]
