"""Philox4x32-10 (host and device), dropout decisions and the Generator."""

import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cuflash import random as cr

CUDA_SRC = Path(__file__).resolve().parents[2] / "cuda_src"

# Random123's kat_vectors, "philox4x32 10" lines: counter (4 words), key (2 words), result.
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

words32 = st.integers(0, 2**32 - 1)


# ----------------------------------------------------------------------------- philox4x32

@pytest.mark.parametrize("counter, key, expected", KAT)
def test_known_answers(counter, key, expected):
    out = cr.philox4x32(np.array(counter, dtype=np.uint32), np.array(key, dtype=np.uint32))
    assert out.dtype == np.uint32
    assert out.tolist() == list(expected)


def test_known_answers_as_one_batch():
    counters = np.array([c for c, _, _ in KAT], dtype=np.uint32)
    keys = np.array([k for _, k, _ in KAT], dtype=np.uint32)
    assert cr.philox4x32(counters, keys).tolist() == [list(e) for _, _, e in KAT]


def test_accepts_python_ints_and_wide_integer_dtypes():
    counter, key, expected = KAT[1]
    assert cr.philox4x32(list(counter), list(key)).tolist() == list(expected)
    assert cr.philox4x32(np.array(counter, np.int64), np.array(key, np.uint64)).tolist() \
        == list(expected)


@given(st.lists(st.tuples(st.tuples(words32, words32, words32, words32),
                          st.tuples(words32, words32)), min_size=1, max_size=8))
def test_vectorised_equals_scalar_loop(cases):
    counters = np.array([c for c, _ in cases], dtype=np.uint32)
    keys = np.array([k for _, k in cases], dtype=np.uint32)
    batch = cr.philox4x32(counters, keys)
    for n, (c, k) in enumerate(cases):
        assert batch[n].tolist() == cr.philox4x32(c, k).tolist()


def test_broadcasting():
    rng = np.random.default_rng(1)
    counters = rng.integers(0, 2**32, size=(5, 4), dtype=np.uint32)
    keys = rng.integers(0, 2**32, size=(3, 1, 2), dtype=np.uint32)
    out = cr.philox4x32(counters, keys)
    assert out.shape == (3, 5, 4)
    for a in range(3):
        for b in range(5):
            assert out[a, b].tolist() == cr.philox4x32(counters[b], keys[a, 0]).tolist()


@pytest.mark.parametrize("counter, key, error", [
    (np.zeros(4, np.float32), np.zeros(2, np.uint32), TypeError),
    (np.zeros(4, np.uint32), [0.5, 0.0], TypeError),
    (np.zeros(3, np.uint32), np.zeros(2, np.uint32), ValueError),
    (np.zeros(4, np.uint32), np.zeros(3, np.uint32), ValueError),
    ([0, 0, 0, 2**32], [0, 0], ValueError),
    ([0, 0, 0, -1], [0, 0], ValueError),
    ([0, 0, 0, 0], [2**70, 0], ValueError),
])
def test_philox_rejects_bad_words(counter, key, error):
    with pytest.raises(error, match="counter|key"):
        cr.philox4x32(counter, key)


# ----------------------------------------------------------------------------- dropout

def test_dropout_words_follow_the_formula():
    seed, offset, Hq = 0x0123456789ABCDEF, 2**32 + 7, 3
    b, h, i, j4 = 1, 2, 5, 9
    expected = cr.philox4x32([j4, i, b * Hq + h, 7], [0x89ABCDEF, 0x01234567])
    assert cr.dropout_words(seed, offset, b, h, i, j4, Hq).tolist() == expected.tolist()


def test_dropout_keep_picks_word_j_mod_4():
    seed, offset, p, Hq = 99, 3, 0.4, 2
    j = np.arange(32)
    keep = cr.dropout_keep(seed, offset, p, 1, 1, 6, j, Hq)
    words = cr.dropout_words(seed, offset, 1, 1, 6, j // 4, Hq)[np.arange(32), j % 4]
    assert keep.tolist() == (words >= cr.dropout_threshold(p)).tolist()


def test_dropout_keep_broadcasts():
    seed, offset, p, Hq = 5, 11, 0.3, 4
    b, h, i, j = (np.arange(n).reshape(s) for n, s in
                  ((2, (2, 1, 1, 1)), (4, (1, 4, 1, 1)), (3, (1, 1, 3, 1)), (9, (1, 1, 1, 9))))
    keep = cr.dropout_keep(seed, offset, p, b, h, i, j, Hq)
    assert keep.shape == (2, 4, 3, 9) and keep.dtype == np.bool_
    for idx in [(0, 0, 0, 0), (1, 3, 2, 8), (1, 2, 0, 5)]:
        assert keep[idx] == cr.dropout_keep(seed, offset, p, *idx, Hq)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_rate(p):
    n = 2 * 4 * 64 * 200
    keep = cr.dropout_keep(1234, 0, p, np.arange(2)[:, None, None, None],
                           np.arange(4)[:, None, None], np.arange(64)[:, None], np.arange(200), 4)
    rate = keep.mean()
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 6 * sigma


def test_dropout_p_zero_keeps_everything():
    keep = cr.dropout_keep(7, 0, 0.0, 0, np.arange(3)[:, None, None], np.arange(50)[:, None],
                           np.arange(77), 3)
    assert keep.all()


def test_threshold_edges():
    assert cr.dropout_threshold(0.0) == 0
    assert cr.dropout_threshold(1e-12) == 0  # rounds to 0: nothing dropped
    assert cr.dropout_threshold(0.5) == 2**31
    assert cr.dropout_threshold(0.25) == 2**30
    assert cr.dropout_threshold(1 - 1e-12) == 2**32 - 1  # clamped into uint32
    assert cr.dropout_threshold(np.float32(0.5)) == 2**31


@pytest.mark.parametrize("p, error", [(1.0, ValueError), (-0.1, ValueError),
                                      (float("nan"), ValueError), ("0.1", TypeError),
                                      (True, TypeError)])
def test_threshold_rejects_bad_p(p, error):
    with pytest.raises(error, match="dropout_p"):
        cr.dropout_threshold(p)


def test_offset_uses_low_32_bits_and_changes_the_mask():
    args = (0.5, 0, np.arange(2)[:, None, None], np.arange(16)[:, None], np.arange(64), 2)
    a = cr.dropout_keep(3, 5, *args)
    assert np.array_equal(a, cr.dropout_keep(3, 5 + 2**32, *args))
    assert not np.array_equal(a, cr.dropout_keep(3, 6, *args))
    assert not np.array_equal(a, cr.dropout_keep(3 + 2**32, 5, *args))  # seed hi word is key


# ----------------------------------------------------------------------------- Generator

def test_generator_state_and_offsets():
    g = cr.Generator(42)
    assert g.seed == 42 and g.offset == 0
    state = g.get_state()
    assert state.dtype == np.uint64 and state.tolist() == [42, 0]
    assert g.next_state().tolist() == [42, 0]
    assert g.next_state().tolist() == [42, 1]
    assert g.offset == 2 and g.get_state().tolist() == [42, 2]
    saved = g.get_state()
    g.next_state()
    g.set_state(saved)
    assert g.next_state().tolist() == [42, 2]
    g.set_state((2**64 - 1, 2**64 - 1))
    assert g.next_state().tolist() == [2**64 - 1, 2**64 - 1]
    assert g.offset == 0  # wraps mod 2**64
    assert g.manual_seed(7) is g and g.get_state().tolist() == [7, 0]


def test_generator_random_seed():
    a, b = cr.Generator(), cr.Generator()
    assert 0 <= a.seed < 2**64 and a.offset == 0
    assert a.seed != b.seed  # 2**-64 chance of a false failure


@pytest.mark.parametrize("seed, error", [(-1, ValueError), (2**64, ValueError),
                                         (1.5, TypeError), ("3", TypeError), (True, TypeError)])
def test_generator_rejects_bad_seed(seed, error):
    with pytest.raises(error, match="seed"):
        cr.Generator(seed)
    with pytest.raises(error, match="seed"):
        cr.manual_seed(seed)


@pytest.mark.parametrize("state, error", [
    (None, TypeError), (3, TypeError), (np.array([1.0, 2.0]), TypeError),
    (np.array([1, 2, 3], np.uint64), ValueError), ([1], ValueError),
    ([-1, 0], ValueError), ([0, 2**64], ValueError), ([0, 0.5], TypeError),
])
def test_set_state_validation(state, error):
    g = cr.Generator(1)
    with pytest.raises(error, match="state"):
        g.set_state(state)
    assert g.get_state().tolist() == [1, 0]  # untouched


def test_next_state_is_thread_safe():
    g = cr.Generator(3)
    seen = []
    lock = threading.Lock()

    def work():
        mine = [int(g.next_state()[1]) for _ in range(500)]
        with lock:
            seen.extend(mine)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == list(range(4000)) and g.offset == 4000


def test_default_generator_and_manual_seed():
    g = cr.default_generator()
    assert cr.default_generator() is g
    assert cr.manual_seed(123) is g
    assert g.get_state().tolist() == [123, 0]
    g.next_state()
    cr.manual_seed(123)
    assert g.offset == 0


# ----------------------------------------------------------------------------- philox.cuh

HARNESS = r"""
#include "philox.cuh"

extern "C" __global__ void philox_harness(const unsigned int* counter, const unsigned int* key,
                                          unsigned int* out, int n) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n) return;
  uint4 c;
  c.x = counter[4 * t];
  c.y = counter[4 * t + 1];
  c.z = counter[4 * t + 2];
  c.w = counter[4 * t + 3];
  uint2 k;
  k.x = key[2 * t]; k.y = key[2 * t + 1];
  const uint4 r = cuflash::philox4x32_10(c, k);
  out[4 * t] = r.x; out[4 * t + 1] = r.y; out[4 * t + 2] = r.z; out[4 * t + 3] = r.w;
}

extern "C" __global__ void dropout_words_harness(unsigned long long seed, unsigned int offset,
                                                 int batch, int heads, int rows, int col_groups,
                                                 unsigned int* out) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= batch * heads * rows * col_groups) return;
  const int j4 = t % col_groups;
  const int i = (t / col_groups) % rows;
  const int h = (t / (col_groups * rows)) % heads;
  const int b = t / (col_groups * rows * heads);
  const uint4 r = cuflash::dropout_words(seed, offset, b, h, i, j4, heads);
  out[4 * t] = r.x; out[4 * t + 1] = r.y; out[4 * t + 2] = r.z; out[4 * t + 3] = r.w;
}
"""


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_philox_header_compiles_with_nvrtc(arch):
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    prog = nvrtc.createProgram(HARNESS, "philox_harness.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["-std=c++17", f"-arch={arch}", f"-I{CUDA_SRC}"])
        except nvrtc.NVRTCError as e:
            pytest.fail(f"NVRTC failed for {arch}: {e}\n{nvrtc.getProgramLog(prog)}")
        assert len(nvrtc.getCUBIN(prog)) > 0
    finally:
        nvrtc.destroyProgram(prog)


@pytest.mark.gpu
def test_device_philox_matches_numpy(xp_gpu):
    cp = xp_gpu
    module = cp.RawModule(code=HARNESS, options=("-std=c++17", f"-I{CUDA_SRC}"))
    rng = np.random.default_rng(2024)
    n = 4096
    counters = rng.integers(0, 2**32, size=(n, 4), dtype=np.uint32)
    counters[:3] = [c for c, _, _ in KAT]
    keys = rng.integers(0, 2**32, size=(n, 2), dtype=np.uint32)
    keys[:3] = [k for _, k, _ in KAT]
    out = cp.empty((n, 4), dtype=cp.uint32)
    module.get_function("philox_harness")(
        ((n + 127) // 128,), (128,), (cp.asarray(counters), cp.asarray(keys), out, np.int32(n)))
    np.testing.assert_array_equal(out.get(), cr.philox4x32(counters, keys))

    seed, offset, B, H, S, J4 = 0xDEADBEEF12345678, 2**32 + 3, 2, 3, 17, 9
    total = B * H * S * J4
    words = cp.empty((B, H, S, J4, 4), dtype=cp.uint32)
    module.get_function("dropout_words_harness")(
        ((total + 127) // 128,), (128,),
        (np.uint64(seed), np.uint32(offset & 0xFFFFFFFF), np.int32(B), np.int32(H), np.int32(S),
         np.int32(J4), words))
    expected = cr.dropout_words(seed, offset, np.arange(B)[:, None, None, None],
                                np.arange(H)[:, None, None], np.arange(S)[:, None],
                                np.arange(J4), H)
    np.testing.assert_array_equal(words.get(), expected)
