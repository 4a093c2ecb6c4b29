"""benchmarks/bench_value_head_dim.py without a GPU: its visible-work and FLOP counts."""

SCRIPT = "bench_value_head_dim"   # the bench fixture (conftest.py) loads it


def test_visible_pairs_count_the_mask(bench):
    assert bench.visible_pairs(4, causal=True) == 1 + 2 + 3 + 4
    assert bench.visible_pairs(4, causal=False) == 16


def test_flops_count_each_product_at_its_head_dim(bench):
    # forward: S = Q K^T over D_qk and O = P V over D_v, two FLOPs a multiply-add
    assert bench.flops(192, 128, 1, backward=False) == 2 * (192 + 128)
    # backward adds S again, dQ and dK over D_qk; dP and dV over D_v
    assert bench.flops(192, 128, 1, backward=True) == 2 * (192 + 128) + 2 * (3 * 192 + 2 * 128)
    # square: the usual 4 D forward and 2.5 times that backward
    assert bench.flops(64, 64, 10, backward=True) == 10 * (4 * 64 + 10 * 64)
