"""Attention sinks in cuflash.decode (``sinks=``, issue 53 item 1), against the float64 reference
(cuflash.reference.decode, whose sinks tests/cpu/test_reference_sinks.py checks).

Semantics (docs/design.md §2b): row (b, h, i)'s softmax denominator gains ``exp(sinks[h])``, no value
comes with it, ``lse`` includes it; a row that sees no key (an empty sequence) has ``out = 0`` and
``lse = sinks[h]``. With split-KV the splits' partials have no sink and the combine of the last split
adds it exactly once (cuda_src/decode.cu, combine_if_last_split).

Each case runs on contiguous caches and paged ones of page sizes 16, 64 and 3, unsplit, split in 3
and by the heuristic, with and without appended tokens, in float16, bfloat16 and float32, with sinks
around the scores' range, far above them (the sink's term dominates: the normalisation must not
overflow) and with heads that have none (-inf). Sequences of 0 keys are among the lengths drawn.
Caches are poisoned past the sequences (tests/gpu/test_decode.py's build_case), outputs are
NaN-poisoned ``out=`` / ``lse=`` buffers, the data is fresh at every run (the seed is in the failure
message). Accuracy: docs/design.md §5 (cuflash.testing.assert_attention_close) against a plain
same-dtype baseline with the sink in its denominator (cuflash.testing.baseline_attention with sinks=).

Run: ``python -m pytest -q tests/gpu/test_sinks_decode.py`` (skipped without a GPU).
"""

import numpy as np
import pytest

import cupy

import cuflash
import cuflash.testing as tt
from cuflash import reference
from tests.gpu.test_decode import _bits, build_case
from tests.gpu.test_sinks import make_sinks

NAN = float("nan")
from tests.gpu._hardware import gpu_available as _gpu_available  # noqa: E402


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy")]

PAGE_SIZES = (None, 16, 64, 3)
SPLITS = (1, 3, 0)
DTYPES = ("float16", "bfloat16", "float32")
SINKS = ("normal", "large", "some_none")


def expected(case, sinks, dtype, options):
    """Reference (out, lse, k_after, v_after) of a case, and the baseline for 16-bit dtypes."""
    args = dict(cache_seqlens=case["lens"], block_table=case["table"], k_new=case["k_new"], v_new=case["v_new"],
                **options)
    host_sinks = cupy.asnumpy(cupy.asarray(sinks))
    out, lse, k_after, v_after = reference.decode(case["q"], case["k_cache"], case["v_cache"], sinks=host_sinks,
                                                  return_cache=True, **args)
    base = None
    if dtype != "float32":
        problems, _, _ = reference._decode._decode_sequences(case["q"], case["k_cache"], case["v_cache"], **args)
        base = np.concatenate([tt.baseline_attention(p["q"], p["k"], p["v"], sinks=host_sinks, **p["options"])
                               for p in problems])
    return out, lse, k_after, v_after, base


def run(case, sinks, dtype, num_splits, seed, options=None):
    """cuflash.decode on the case (fresh device copies, poisoned out= / lse=), checked against the
    reference; returns (out, lse) on the host."""
    options = options or {}
    ref_out, ref_lse, k_after, v_after, base = expected(case, sinks, dtype, options)
    q = cupy.asarray(case["q"])
    kc, vc = cupy.asarray(case["k_cache"]), cupy.asarray(case["v_cache"])
    kn = None if case["k_new"] is None else cupy.asarray(case["k_new"])
    vn = None if case["v_new"] is None else cupy.asarray(case["v_new"])
    table = None if case["table"] is None else cupy.asarray(case["table"])
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), NAN, dtype=cupy.float32)
    got_out, got_lse = cuflash.decode(q, kc, vc, cache_seqlens=cupy.asarray(case["lens"]), block_table=table,
                                      k_new=kn, v_new=vn, num_splits=num_splits, sinks=sinks, out=out, lse=lse,
                                      return_lse=True, **tt.as_device_options(options, cupy))
    assert got_out.data.ptr == out.data.ptr and got_lse.data.ptr == lse.data.ptr
    tt.assert_attention_close(got_out, ref_out, base, dtype=dtype, name=f"out (seed {seed})")
    tt.assert_attention_close(got_lse, ref_lse, dtype="float32", name=f"lse (seed {seed})")
    assert np.array_equal(_bits(kc.get()), _bits(k_after)), f"k_cache is not old cache + appended rows (seed {seed})"
    assert np.array_equal(_bits(vc.get()), _bits(v_after)), f"v_cache is not old cache + appended rows (seed {seed})"
    return got_out.get(), got_lse.get()


def _problem(dtype, page_size, append, seed, Sq=None, lens=None, Hq=8, Hk=2):
    rng = np.random.default_rng(seed)
    edge = page_size or 64
    B = 3
    Sq = Sq or int(rng.choice([1, 3, 5]))
    lens = lens or [int(rng.choice([0, 1, edge - 1, edge + 1, 2 * edge + 3, int(rng.integers(0, 400))]))
                    for _ in range(B)]
    D = 64 if dtype == "float16" else 128
    return build_case(dtype=dtype, B=B, Hq=Hq, Hk=Hk, D=D, Sq=Sq, lens=lens, page_size=page_size, append=append,
                      seed=seed)


@pytest.mark.parametrize("sinks_kind", SINKS)
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: "contiguous" if p is None else f"page{p}")
@pytest.mark.parametrize("num_splits", SPLITS, ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_sinks_against_the_reference(sinks_kind, page_size, num_splits, dtype):
    seed = int(np.random.default_rng().integers(2**32))
    rng = np.random.default_rng(seed + 1)
    append = bool(rng.integers(2))
    case = _problem(dtype, page_size, append, seed)
    sinks = make_sinks(sinks_kind, case["q"].shape[2], rng)
    run(case, sinks, dtype, num_splits, seed)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_empty_sequences_give_zero_and_the_sink(page_size, num_splits):
    # Sequences of 0 keys and nothing appended: out 0 and lse = sinks[h] exactly (and -inf for a head
    # without a sink), whether the row is finished by its CTA or by the splits' combine.
    seed = int(np.random.default_rng().integers(2**32))
    rng = np.random.default_rng(seed)
    case = _problem("bfloat16", page_size, False, seed, Sq=2, lens=[0, 300, 0])
    sinks = make_sinks("some_none", 8, rng)
    out, lse = run(case, sinks, "bfloat16", num_splits, seed)
    for b in (0, 2):
        assert bool((out[b] == 0).all()), f"seed {seed}"
        np.testing.assert_array_equal(lse[b], np.broadcast_to(cupy.asnumpy(sinks)[:, None], lse[b].shape))


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("page_size", [None, 16])
def test_sinks_with_window_softcap_and_alibi(num_splits, page_size):
    seed = int(np.random.default_rng().integers(2**32))
    rng = np.random.default_rng(seed)
    case = _problem("float16", page_size, True, seed, Sq=3, lens=[5, 200, 77])
    sinks = make_sinks("normal", 8, rng)
    options = dict(window=(40, 0), softcap=5.0, alibi_slopes=rng.uniform(0, 0.3, 8).astype(np.float32))
    run(case, sinks, "float16", num_splits, seed, options)


def test_new_sink_values_need_no_new_plan():
    # The sinks are read at each call: a repeat call with new values (or another array of the same
    # layout) gives each its own result; without sinks again, the plain result.
    seed = int(np.random.default_rng().integers(2**32))
    rng = np.random.default_rng(seed)
    case = _problem("bfloat16", 64, False, seed, Sq=1, lens=[100, 1000, 3])
    for kind in ("normal", "large", "normal"):
        run(case, make_sinks(kind, 8, rng), "bfloat16", 0, seed)
    q = cupy.asarray(case["q"])
    plain = cuflash.decode(q, cupy.asarray(case["k_cache"]), cupy.asarray(case["v_cache"]),
                           cache_seqlens=cupy.asarray(case["lens"]), block_table=cupy.asarray(case["table"]))
    with_none = cuflash.decode(q, cupy.asarray(case["k_cache"]), cupy.asarray(case["v_cache"]),
                               cache_seqlens=cupy.asarray(case["lens"]), block_table=cupy.asarray(case["table"]),
                               sinks=cupy.full(8, -np.inf, dtype=cupy.float32))
    assert np.array_equal(_bits(plain.get()), _bits(with_none.get()))


def test_sinks_are_checked_before_any_launch():
    q = cupy.zeros((2, 1, 4, 64), cupy.float16)
    kc = cupy.zeros((2, 16, 2, 64), cupy.float16)
    kn = cupy.ones((2, 1, 2, 64), cupy.float16)
    lens = np.array([3, 5], np.int32)
    before = kc.get()
    with pytest.raises(TypeError, match="sinks must be float32"):
        cuflash.decode(q, kc, kc.copy(), cache_seqlens=lens, k_new=kn, v_new=kn, sinks=cupy.zeros(4, cupy.float16))
    with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
        cuflash.decode(q, kc, kc.copy(), cache_seqlens=lens, k_new=kn, v_new=kn, sinks=cupy.zeros(2, cupy.float32))
    with pytest.raises(TypeError, match="sinks must be a CUDA array"):
        cuflash.decode(q, kc, kc.copy(), cache_seqlens=lens, k_new=kn, v_new=kn, sinks=np.zeros(4, np.float32))
    assert np.array_equal(kc.get(), before), "a refused call wrote into the cache"


def test_torch_sinks():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    seed = int(np.random.default_rng().integers(2**32))
    rng = np.random.default_rng(seed)
    case = _problem("bfloat16", 16, True, seed, Sq=2)
    sinks = torch.as_tensor(cupy.asnumpy(make_sinks("normal", 8, rng)), device="cuda")
    torch.cuda.synchronize()
    run(case, sinks, "bfloat16", 0, seed)
