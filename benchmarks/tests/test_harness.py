"""benchmarks/_harness.py's turns without a GPU: every contender timed once per repeat, each timed
run after an untimed run of its own, and no contender always following the same one (in a fixed
cycle the first always followed the last, cuDNN in the scripts, and measured ~1% slow)."""

import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def harness():
    sys.path.insert(0, str(BENCH))
    try:
        import _harness
        yield _harness
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("_harness", None)


def test_turns(harness):
    names = [f"c{i}" for i in range(random.randint(3, 6))]
    repeats = random.randint(5, 9)   # the orders are seeded by these two; each (count, repeats) drawn here passes
    ran = []

    class Recorded(harness.Timer):
        def _calls_per_run(self, fn):
            return 1

        def _run(self, fn, n, start=0):
            ran.append(fn)
            return float(len(ran))

    ms = Recorded(None, repeats, warmup=0, target_ms=1.0).median_ms_each({n: n for n in names})
    assert sorted(ms) == sorted(names)
    assert len(ran) == 2 * repeats * len(names)
    untimed, timed = ran[0::2], ran[1::2]
    assert untimed == timed   # each timed run right after an untimed run of the same contender
    for r in range(repeats):
        assert sorted(timed[r * len(names):(r + 1) * len(names)]) == sorted(names)   # all, once a repeat
    # not one cycle taken from different starts: that gives each contender the same predecessor
    # within every repeat (len(names) pairs in all)
    pairs = {(timed[i - 1], timed[i]) for i in range(len(timed)) if i % len(names)}
    assert len(pairs) > len(names), pairs


def test_runnable_leaves_out_the_contenders_that_raise(harness, capsys):
    calls = []

    def runs(i):
        calls.append(i)

    def refuses(i):
        raise ValueError("no such option\nsecond line")

    usable = harness.runnable({"ours": runs, "peer": refuses}, "problem P")
    assert usable == {"ours": runs} and calls == [0]
    out = capsys.readouterr().out
    assert "problem P: peer left out (ValueError: no such option)" in out and "second line" not in out


def test_peer_arguments(harness):
    import argparse

    args = harness.peer_arguments(argparse.ArgumentParser(), repeats=5).parse_args(["--no-fa4", "--md", "t.md"])
    assert (args.repeats, args.target_ms, args.no_fa4, args.md, args.csv) == (5, 100.0, True, "t.md", None)


def test_open_torch_peers_without_a_gpu_says_so(harness, capsys):
    from types import SimpleNamespace

    class Error(Exception):
        pass

    runtime = SimpleNamespace(CUDARuntimeError=Error, getDeviceCount=lambda: 0)
    cupy = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))
    args = SimpleNamespace(repeats=3, target_ms=10.0, no_fa4=True)
    assert harness.open_torch_peers(cupy, args) is None
    said = capsys.readouterr()
    assert "no CUDA GPU" in said.err and "needs a GPU and torch" in said.out


def test_largest_difference(harness):
    # The largest |out - base's out| over the other contenders, each output taken through detach() and
    # float(); a lone base gives 0.
    class Out:
        def __init__(self, values):
            self.values = values

        def detach(self):
            return self

        def float(self):
            return self

        def __sub__(self, other):
            return Out([a - b for a, b in zip(self.values, other.values)])

        def abs(self):
            return Out([abs(a) for a in self.values])

        def max(self):
            return max(self.values)

    base, values = [0.5, -1.0, 2.0], {"peer": [0.5, -1.25, 2.0], "other": [1.0, -1.0, 2.0]}
    outputs = {"cuflash": lambda: Out(base), **{name: (lambda v=v: Out(v)) for name, v in values.items()}}
    assert harness.largest_difference(outputs, ["cuflash", "peer", "other"]) == 0.5
    assert harness.largest_difference(outputs, ["cuflash", "peer"]) == 0.25
    assert harness.largest_difference(outputs, ["cuflash"]) == 0.0
    assert harness.largest_difference(outputs, ["peer", "other"], base="peer") == 0.5


def test_other_compiler_is_named(harness, capsys):
    from cuflash._build import nvrtc

    here = ".".join(str(x) for x in nvrtc.version())
    harness.note_other_compiler({"same": here, "other": "12.0", "old": None})
    captured = capsys.readouterr()
    err = captured.out + captured.err
    assert "tree other: cubins built by NVRTC 12.0" in err and f"compiles with {here}" in err
    assert "tree old: cubins built by NVRTC (unknown)" in err
    assert "tree same" not in err
