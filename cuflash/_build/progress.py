"""What a build of many kernel variants shows: one progress line while it runs, one summary line
when it ends (``python -m cuflash precompile`` and :func:`cuflash.precompile` both).

A build of every variant is a few hundred compilations and several minutes, so the line must say
that work is going on without burying the answer: on a terminal it is redrawn in place (carriage
returns) and wiped at the end; in a log (not a terminal) it is a plain line at the start and at
each quarter. Compiler warnings are not shown here: they are in each result's ``warnings`` and
in ``python -m cuflash precompile -v``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from cuflash._build.cache import user_cache_dir

__all__ = ["Progress", "summary"]


class Progress:
    """The progress line of one build; pass ``start`` and the instance itself to
    :func:`cuflash._build.compile.build` (``started`` and ``progress``), then call :meth:`close`.

    Parameters
    ----------
    archs : sequence of str
        The targets built, named in the line.
    prefix : str
        What the line starts with (``"precompile"``, ``"cuflash.precompile"``).
    stream : file, optional
        Default: ``sys.stderr``, so that the summary on stdout stays one clean line.
    """

    WIDTH = 79  # a terminal's line less one column, so that the line never wraps

    def __init__(self, archs, prefix: str = "precompile", stream=None):
        self.stream = stream or sys.stderr
        self.archs = ",".join(archs)
        self.prefix = prefix
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start_time = time.perf_counter()
        self.failed = 0
        self.quarter = 0
        self.drawn = False

    def start(self, todo: int, cached: int) -> None:
        """Called before the first compilation: ``todo`` to build, ``cached`` found in cache."""
        self.start_time = time.perf_counter()
        if not todo:  # all cached: the summary says so, nothing to watch
            return
        if self.tty:
            self._draw(f"[{'.' * 20}] 0/{todo} built ({cached} in cache)")
        else:
            self._write(f"{self.prefix}: building {todo} variants for {self.archs} "
                        f"({cached} found in cache)\n")

    def __call__(self, done, total, variant, arch, result) -> None:
        self.failed += isinstance(result, Exception)
        elapsed = time.perf_counter() - self.start_time
        failed = f", {self.failed} failed" if self.failed else ""
        if self.tty:
            bar = "#" * (20 * done // total) + "." * (20 - 20 * done // total)
            self._draw(f"[{bar}] {done}/{total} built, {elapsed:.0f} s{failed}  {variant.family} {arch}")
        elif done < total and 4 * done // total > self.quarter:  # the summary tells the end
            self.quarter = 4 * done // total
            self._write(f"{self.prefix}: {done}/{total} built, {elapsed:.0f} s{failed}\n")

    def close(self) -> None:
        """Wipe the line on a terminal, so that what is printed next starts on a clean line."""
        if self.tty and self.drawn:
            self._write("\r" + " " * self.WIDTH + "\r")
            self.drawn = False

    def _draw(self, text: str) -> None:
        self._write("\r" + f"{self.prefix}: {text}".ljust(self.WIDTH)[:self.WIDTH])
        self.drawn = True

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def summary(outcomes, archs, cache_dir, seconds: float, prefix: str = "precompile",
            note: str = "") -> str:
    """The one line that ends a build: how many variants, built / found in cache / failed /
    spilling, the time and where the cubins are.

    Parameters
    ----------
    outcomes : list of (Variant, str, CompileResult or Exception)
        What :func:`cuflash._build.compile.build` returned.
    archs : sequence of str
    cache_dir : path
        Where the build wrote; named with how to use it when it is not the user cache.
    seconds : float
    prefix : str
    note : str
        Said after the targets (e.g. why these targets were chosen).
    """
    failed = sum(isinstance(r, Exception) for _, _, r in outcomes)
    done = [r for _, _, r in outcomes if not isinstance(r, Exception)]
    cached = sum(r.cached for r in done)
    spilling = sum(r.spills > 0 for r in done)
    counts = f"{len(done) - cached} built, {cached} found in cache"
    counts += f", {failed} failed" if failed else ""
    counts += f", {spilling} spilling" if spilling else ""
    where = "" if Path(cache_dir) == user_cache_dir() else f" (use it: CUFLASH_CACHE_DIR={cache_dir})"
    variants = f"{len(outcomes)} variant" + ("" if len(outcomes) == 1 else "s")
    return (f"{prefix}: {variants} for {','.join(archs)}{note}: {counts}; "
            f"{seconds:.1f} s -> {cache_dir}{where}")
