"""benchmarks/bench_decode_serving.py without a GPU: its grid, lengths, page tables and byte counts."""

import numpy as np
import pytest

SCRIPT = "bench_decode_serving"   # the bench fixture (conftest.py) loads it


def test_grid_covers_uniform_and_ragged_batches_of_1_to_256(bench):
    names = bench.batches()
    sizes = {b for _, b, _, _ in names}
    assert min(sizes) == 1 and max(sizes) == 256
    assert any(lo != hi for _, _, lo, hi in names) and any(lo == hi for _, _, lo, hi in names)
    assert len(bench.batches(quick=True)) == 2
    assert bench.LAYOUTS == ("contiguous", 16, 64) and bench.HEAD_DIMS == (64, 128, 256)


def test_lengths_are_drawn_in_range(bench):
    rng = np.random.default_rng()
    lengths = bench.draw_lengths(rng, 500, 128, 1024)
    assert lengths.dtype == np.int32 and lengths.min() >= 128 and lengths.max() <= 1024
    assert len(set(lengths.tolist())) > 10, "ragged lengths vary"
    assert (bench.draw_lengths(rng, 4, 77, 77) == 77).all()


@pytest.mark.parametrize("page_size", [16, 64, 3])
def test_page_table_gives_every_sequence_its_own_pages(bench, page_size):
    rng = np.random.default_rng()
    lengths = bench.draw_lengths(rng, 9, 1, 300)
    table, num_pages = bench.page_table(rng, lengths, page_size)
    needed = -(-lengths // page_size)
    assert num_pages == needed.sum() and table.shape == (9, needed.max())
    used = np.concatenate([table[b, :n] for b, n in enumerate(needed)])
    assert sorted(used.tolist()) == list(range(num_pages)), "each page belongs to one sequence"
    assert all((table[b, n:] == -1).all() for b, n in enumerate(needed))


def test_kv_bytes_count_what_the_sequences_hold(bench):
    lengths = np.array([10, 0, 5], dtype=np.int32)
    assert bench.kv_bytes(lengths, 8, 128) == 2 * 15 * 8 * 128 * 2
