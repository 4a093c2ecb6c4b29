"""benchmarks/bench_training.py without a GPU: its grid, FLOP counts and summary rows."""

import math

SCRIPT = "bench_training"   # the bench fixture (conftest.py) loads it


def test_grid_keeps_tokens_and_hidden(bench):
    problems = bench.grid([64, 256], [1024, 16384], 16384, 2048)
    assert len(problems) == 2 * 2 * 2
    for d, causal, s, b, h in problems:
        assert b * s == 16384 and h * d == 2048
    assert {causal for _, causal, *_ in problems} == {False, True}
    assert bench.grid([96], [1000], 16384, 2048) == []   # neither divides: left out


def test_flops_halve_under_a_causal_mask(bench):
    full = bench.flops(128, False, 1024, 2, 4, backward=False)
    assert full == 4 * 2 * 4 * 1024 * 1024 * 128
    assert bench.flops(128, True, 1024, 2, 4, backward=False) == full / 2
    assert bench.flops(128, False, 1024, 2, 4, backward=True) == 3.5 * full   # forward + 2.5x backward


def test_summary_rows_take_geometric_means_and_count_misses(bench):
    rows = [{"fwd x fa4": 0.5, "fwd+bwd x fa4": 1.1}, {"fwd x fa4": 2.0, "fwd+bwd x fa4": 1.1},
            {"fwd x fa4": None}]
    mean, under = bench.summary_rows(rows)
    assert math.isclose(mean["fwd x fa4"], 1.0) and math.isclose(mean["fwd+bwd x fa4"], 1.1)
    assert under["fwd x fa4"] == "1" and under["fwd+bwd x fa4"] == "0"
    assert mean["fwd x cudnn"] is None and under["fwd x cudnn"] is None   # no cells: nothing claimed


def test_main_without_a_gpu_returns_quietly(bench, capsys):
    assert bench.main(["--head-dims", "64", "--seqlens", "1024"]) is None
