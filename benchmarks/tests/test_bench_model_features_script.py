"""benchmarks/bench_model_features.py without a GPU: its arguments, FLOP counts and bar cells."""

import pytest

SCRIPT = "bench_model_features"   # the bench fixture (conftest.py) loads it


def test_parts_are_chosen_and_unknown_ones_refused(bench):
    assert bench.parse_args([]).only == ["fp8", "sinks", "dv", "dvdecode", "mla"]
    assert bench.parse_args(["--only", "sinks, fp8"]).only == ["sinks", "fp8"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "chunked"])


def test_visible_work_counts_the_causal_triangle(bench):
    assert bench.visible_pairs(4) == 10 and bench.visible_pairs(4, causal=False) == 16
    # forward 2 * pairs * (D_qk + D_v) per head, forward + backward 3.5x that
    assert bench.train_flops(2, 3, 4, 64, 32) == 3.5 * 2 * 2 * 3 * 10 * 96


def test_bars(bench):
    assert bench.fp8_cells(2.0, 1.0)["bar"].endswith("pass") and bench.fp8_cells(1.6, 1.0)["bar"].endswith("FAIL")
    assert bench.fp8_cells(3.0, 2.0)["fp8 x"] == 1.5
    ok, bad = bench.sinks_cells(1.0, 1.02), bench.sinks_cells(1.0, 1.05)
    assert ok["bar"].endswith("pass") and bad["bar"].endswith("FAIL")
    assert abs(bad["cost"] - 0.05) < 1e-12


def test_value_pair_ratio_compares_throughput_not_time(bench):
    # The pair does less work (D_v < D_qk): equal times are a lower rate.
    cells = bench.dv_cells(192, 128, 1.0, 1.0, 1, 1, 8)
    assert cells["pair / square"] == pytest.approx((192 + 128) / (192 + 192))
