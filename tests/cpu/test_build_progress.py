"""The progress line and the summary of a build (cuflash._build.progress): one line redrawn in
place on a terminal, a handful of plain lines in a log, one summary line at the end."""

import io
from pathlib import Path

from cuflash._build import cache as _cache
from cuflash._build.progress import Progress, summary
from cuflash._build.compile import CompileResult
from cuflash._build.variant import Variant

TINY = Variant("tiny", {"TINY_N": 64})


class Tty(io.StringIO):
    def isatty(self):
        return True


def _run(progress, total, cached=0):
    progress.start(total, cached)
    for done in range(1, total + 1):
        progress(done, total, TINY, "sm_80", RuntimeError("x") if done == 3 else None)
    progress.close()


def test_on_a_terminal_one_line_is_redrawn_then_wiped():
    tty = Tty()
    _run(Progress(["sm_80"], "precompile", tty), 40, cached=2)
    text = tty.getvalue()
    assert "\n" not in text and text.endswith("\r" + " " * Progress.WIDTH + "\r")
    frames = text.split("\r")[1:-2]
    assert len(frames) == 41 and all(len(f) == Progress.WIDTH for f in frames)  # never wraps
    assert frames[0].startswith("precompile: [....................] 0/40 built (2 in cache)")
    assert frames[-1].startswith("precompile: [####################] 40/40 built, ")
    assert ", 1 failed  tiny sm_80" in frames[-1]


def test_in_a_log_a_few_lines():
    log = io.StringIO()
    _run(Progress(["sm_80", "sm_90a"], "precompile", log), 260, cached=5)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[0] == "precompile: building 260 variants for sm_80,sm_90a (5 found in cache)"
    assert [ln.split(",")[0] for ln in lines[1:]] == [
        "precompile: 65/260 built", "precompile: 130/260 built", "precompile: 195/260 built"]
    assert lines[1].endswith(" s, 1 failed")


def test_nothing_to_build_shows_no_progress():
    log, tty = io.StringIO(), Tty()
    for stream in (log, tty):
        _run(Progress(["sm_80"], "precompile", stream), 0, cached=42)
    assert log.getvalue() == tty.getvalue() == ""


def _result(cached=False, spills=0):
    return CompileResult(b"\x7fELF", "", 10, spills, 0, 0, variant=TINY, arch="sm_80", cached=cached)


def test_summary_counts_and_where(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    outcomes = [(TINY, "sm_80", _result()), (TINY, "sm_90a", _result(cached=True))]
    line = summary(outcomes, ["sm_80", "sm_90a"], _cache.user_cache_dir(), 12.34)
    assert line == (f"precompile: 2 variants for sm_80,sm_90a: 1 built, 1 found in cache; "
                    f"12.3 s -> {_cache.user_cache_dir()}")
    outcomes = [(TINY, "sm_80", _result(spills=8)), (TINY, "sm_90a", RuntimeError("no"))]
    line = summary(outcomes, ["sm_80"], Path("/aot"), 1.0, "cuflash.precompile", " (no GPU)")
    assert line == ("cuflash.precompile: 2 variants for sm_80 (no GPU): 1 built, 0 found in cache, "
                    "1 failed, 1 spilling; 1.0 s -> /aot (use it: CUFLASH_CACHE_DIR=/aot)")
    assert summary(outcomes[:1], ["sm_80"], Path("/aot"), 1.0).startswith("precompile: 1 variant for")
