"""The kernel variant: a family plus the compile-time defines that fix its configuration.

A leaf module (it imports nothing of cuflash), so that the compiler (:mod:`cuflash._compile`) and
the planners (:mod:`cuflash._heuristics`) can both name variants without importing each other.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Variant"]


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
    """

    family: str
    defines: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        defines = tuple(sorted((str(k), int(v)) for k, v in dict(self.defines).items()))
        object.__setattr__(self, "defines", defines)

    @property
    def entry(self) -> str:
        return "cuflash_" + self.family

    def label(self) -> str:
        """Short text for tables: ``HEAD_DIM=128,DTYPE=1`` (``CUFLASH_`` prefix dropped)."""
        return ",".join(f"{k.removeprefix('CUFLASH_')}={v}" for k, v in self.defines)
