"""benchmarks/bench_jax_grid.py without a GPU: the grid it times and how it reads the bars."""

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench_jax_grid.py"
spec = importlib.util.spec_from_file_location("bench_jax_grid", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_the_grid_is_issue_54s():
    grid = bench.problems()
    attention = [p for p in grid if not p[1].startswith("decode")]
    assert len(attention) == 3 * 2 * 2 * 2   # D x length x causal x (fwd, fwd+bwd)
    for name, kind, (b, s, h, d), causal in attention:
        assert b * s == bench.TOKENS and h * d == bench.WIDTH and d in (64, 128, 256) and s in (4096, 16384)
    assert {(p[3], p[1]) for p in attention} == {(c, k) for c in (False, True) for k in ("fwd", "fwd+bwd")}
    decode = [p for p in grid if p[1].startswith("decode")]
    assert [p[1] for p in decode] == ["decode", "decode4"], "decode alone and four calls in one jit"
    assert all(p[2] == (8, 8192, 32, 8, 128) for p in decode), "decode at (8, 8k), GQA 32/8, D 128"
    assert len(bench.problems(quick=True)) < len(grid)


def test_ratios_and_bars():
    r = bench.ratios({"jax cuflash": 2.0, "jax cudnn": 2.2, "cupy cuflash": 1.8})
    assert abs(r["cudnn"] - 1.1) < 1e-12 and abs(r["cupy"] - 0.9) < 1e-12
    assert bench.bar_text("cudnn", r["cudnn"]).endswith("pass")
    assert bench.bar_text("cupy", r["cupy"]).endswith("FAIL")
    assert bench.ratios({"jax cuflash": 1.0, "cupy cuflash": 1.0}) == {"cupy": 1.0}, "decode has no cuDNN"
    assert bench.bar_text("cudnn", None) == "-"
