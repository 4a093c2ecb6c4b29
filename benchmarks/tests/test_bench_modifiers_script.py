"""benchmarks/bench_modifiers.py without a GPU: its document lengths and visible-work counts."""

import numpy as np
import pytest

SCRIPT = "bench_modifiers"   # the bench fixture (conftest.py) loads it


def test_documents_fill_the_sequence(bench):
    rng = np.random.default_rng()
    lengths = bench.document_lengths(rng, 16384)
    assert lengths.sum() == 16384 and (lengths[:-1] >= 512).all() and (lengths <= 4096).all()


def test_visible_pairs_count_what_each_mask_leaves(bench, monkeypatch):
    monkeypatch.setattr(bench, "WINDOW", 2)
    monkeypatch.setattr(bench, "PREFIX", 3)
    # window 2, causal: rows see 1, 2, 3, 3, 3 keys
    assert bench.visible_pairs("window+softcap", 5) == 12
    # documents of 2 and 3: causal triangles 3 + 6
    assert bench.visible_pairs("document", 5, np.array([2, 3])) == 9
    # prefix 3: rows 0..2 see 3 keys, row 3 sees 4, row 4 sees 5
    assert bench.visible_pairs("prefix-lm", 5) == 18
    # causal: rows see 1..5 keys
    assert bench.visible_pairs("relative-bias", 5) == 15
    assert bench.visible_pairs("alibi", 5) == 15
    with pytest.raises(ValueError):
        bench.visible_pairs("other", 5)


def test_step_flops_are_fourteen_per_pair_and_head_dim(bench):
    assert bench.step_tflops(10**6, 1, 1.0) == pytest.approx(14 * bench.HEADS * bench.HEAD_DIM * 10**6 / 1e-3 / 1e12)


@pytest.mark.parametrize("problem", ["window+softcap", "document", "prefix-lm", "relative-bias", "alibi"])
def test_dense_masks_leave_the_visible_pairs(bench, monkeypatch, problem):
    rng = np.random.default_rng()
    monkeypatch.setattr(bench, "WINDOW", int(rng.integers(1, 9)))
    monkeypatch.setattr(bench, "PREFIX", int(rng.integers(1, 9)))
    lengths = np.array([3, 5, 2, 6])
    doc = np.repeat(np.arange(lengths.size), lengths)
    i = np.arange(lengths.sum())
    allowed = bench.may_attend(problem, i[:, None], i[None, :], doc)
    assert allowed.sum() == bench.visible_pairs(problem, lengths.sum(), lengths)
    assert allowed.diagonal().all()   # no query is left without a key (SDPA's -inf rows)
