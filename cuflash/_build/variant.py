"""The kernel variant: a family plus the compile-time defines that fix its configuration.

It imports only :mod:`cuflash.features` (the tables that give dtype codes and modifier bits their
names), so that the compiler (:mod:`cuflash._build.compile`), the planners (:mod:`cuflash.kernels`) and
the command line can all name and describe variants without importing each other.
"""

from __future__ import annotations

import dataclasses
import hashlib

from cuflash.features import DTYPE_CODES, MODIFIERS

__all__ = ["Variant"]

_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
_DTYPE_WORDS = {code: _SHORT.get(name, name) for name, code in DTYPE_CODES.items()}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled configuration of a kernel family.

    Parameters
    ----------
    family : str
        ``"fwd_sm80"``, ``"fwd_simt"``, ...; the source is ``cuda_src/<family>.cu`` and the
        entry point ``cuflash_<family>``.
    defines : tuple of (str, int) pairs, or a dict
        Compile-time constants (``-DNAME=value``); stored sorted so that equal configurations
        are equal (and hash equal) however they were written.
    source : str, default ""
        CUDA C++ compiled ahead of the family's source: the functions written from a call's
        ScoreMod/MaskMod (:func:`cuflash.modifiers.kernel_source`). Part of the variant's identity and,
        through :attr:`source_key`, of its cache key, so that different expressions compile different
        kernels and identical ones share one.
    """

    family: str
    defines: tuple[tuple[str, int], ...] = ()
    source: str = ""

    def __post_init__(self):
        defines = tuple(sorted((str(k), int(v)) for k, v in dict(self.defines).items()))
        object.__setattr__(self, "defines", defines)

    @property
    def source_key(self) -> str:
        """sha256 (16 hex digits) of :attr:`source`, "" without one."""
        return hashlib.sha256(self.source.encode()).hexdigest()[:16] if self.source else ""

    @property
    def entry(self) -> str:
        return "cuflash_" + self.family

    def label(self) -> str:
        """Short text for tables: ``HEAD_DIM=128,DTYPE=1`` (``CUFLASH_`` prefix dropped)."""
        return ",".join(f"{k.removeprefix('CUFLASH_')}={v}" for k, v in self.defines)

    def describe(self) -> str:
        """A few words for people: dtype, head dim and the features compiled in, e.g.
        ``"bf16 D128 dq mods dropout"`` (``"mods"``: every modifier the family has;
        one alone goes by its name)."""
        d = {k.removeprefix("CUFLASH_"): v for k, v in self.defines}
        words = []
        if "DTYPE" in d:
            words.append(_DTYPE_WORDS.get(d["DTYPE"], f"dtype{d['DTYPE']}"))
        if "IN_DTYPE" in d:
            words.append(f"{_DTYPE_WORDS.get(d['IN_DTYPE'], d['IN_DTYPE'])}->"
                         f"{_DTYPE_WORDS.get(d.get('OUT_DTYPE'), d.get('OUT_DTYPE'))}")
        if "HEAD_DIM" in d:
            words.append(f"D{d['HEAD_DIM']}")
        if "BWD_PASS" in d:
            words.append("dq" if d["BWD_PASS"] else "dkdv")
        if d.get("PAGED"):
            words.append("paged")
        mods = d.get("SCORE_MODS", 0)
        if mods:
            one = [m.name for m in MODIFIERS if m.bit == mods]
            words.append(one[0] if one else "mods")
        if d.get("DROPOUT"):
            words.append("dropout")
        if self.source:
            words.append(f"user:{self.source_key[:8]}")
        return " ".join(words)
