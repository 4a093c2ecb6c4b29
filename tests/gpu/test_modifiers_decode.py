"""User modifiers (cuflash.ScoreMod, cuflash.MaskMod) in cuflash.decode, against the float64 reference
(cuflash.reference.decode) evaluating the same expressions with NumPy.

Positions are absolute within each sequence: new token i of sequence b is ``q_idx = i + T_b - Sq``
(T_b = cache_seqlens[b] + appended tokens), key j is ``kv_idx = j``. Cases:

- ``relative``: a relative-position bias read from a float32 table, ``score + table[q_idx - kv_idx + off]``;
- ``sliding``: a sliding-window MaskMod, ``q_idx - kv_idx <= w`` (under the default causal);
- ``cap``: a softcap written as a ScoreMod, ``c * tanh(score / c)``;
- ``combined``: a float16 relative table per head and a document mask (int32 ids per position,
  with the first ``sink`` keys always visible) under the built-in softcap and ALiBi.

Each runs on contiguous caches and paged ones of page sizes 16, 64 and 3, unsplit, split in 3 and
by the heuristic, with and without appended tokens, in float16, bfloat16 and float32. Caches are
poisoned past the sequences (tests/gpu/test_decode.py's build_case), outputs are NaN-poisoned ``out=``
buffers, the data is fresh at every run (the seed is in the failure message). Accuracy: the rule of
docs/design.md §5 (cuflash.testing.assert_attention_close) against a plain same-dtype baseline taking
the same modifiers.

Run: ``python -m pytest -q tests/gpu/test_modifiers_decode.py`` (skipped without a GPU).
"""


import numpy as np
import pytest

import cupy

import cuflash
import cuflash.testing as tt
from cuflash import reference
from tests.gpu.test_decode import _bits, build_case

NAN = float("nan")
from tests.gpu._hardware import gpu_available as _gpu_available  # noqa: E402


# These tests are of the expressions' own path through decode: nothing moves into a built-in option.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy"),
              pytest.mark.usefixtures("modifiers_as_written")]



CASES = ("relative", "sliding", "cap", "combined")
PAGE_SIZES = (None, 16, 64, 3)
SPLITS = (1, 3, 0)
DTYPES = ("float16", "bfloat16", "float32")


def modifiers(case, B, Hq, max_total, rng):
    """(score_mod, mask_mod, built-in options) of a case; arrays on the GPU."""
    off = max_total
    if case == "relative":
        table = cupy.asarray(rng.standard_normal(2 * off + 1).astype(np.float32))
        return cuflash.ScoreMod("score + table[q_idx - kv_idx + off]", table=table, off=off), None, {}
    if case == "sliding":
        return None, cuflash.MaskMod("q_idx - kv_idx <= w", w=int(rng.integers(0, 40))), {}
    if case == "cap":
        return cuflash.ScoreMod("c * tanh(score / c)", c=2.0), None, {}
    table = cupy.asarray(rng.standard_normal(Hq * (2 * off + 1)).astype(np.float16))
    score_mod = cuflash.ScoreMod("score + table[h * (2 * off + 1) + q_idx - kv_idx + off]", table=table, off=off)
    ids = np.sort(rng.integers(0, 4, size=(B, max_total)), axis=1).astype(np.int32)
    mask_mod = cuflash.MaskMod("doc[b * S + q_idx] == doc[b * S + kv_idx] || kv_idx < sink",
                               doc=cupy.asarray(ids.reshape(-1)), S=max_total, sink=int(rng.integers(0, 3)))
    slopes = rng.uniform(0.0, 0.3, Hq).astype(np.float32)
    return score_mod, mask_mod, {"softcap": 5.0, "alibi_slopes": slopes}


def expected(case, dtype, options):
    """Reference (out, lse, k_after, v_after) of a case, and the baseline for 16-bit dtypes."""
    problems, k_after, v_after = reference._decode._decode_sequences(
        case["q"], case["k_cache"], case["v_cache"], cache_seqlens=case["lens"], block_table=case["table"],
        k_new=case["k_new"], v_new=case["v_new"], **options)
    B, Sq, Hq, D = case["q"].shape
    out, lse = np.zeros((B, Sq, Hq, D)), np.zeros((B, Hq, Sq))
    for b, p in enumerate(problems):
        o, l = reference.attention_forward(p["q"], p["k"], p["v"], **p["options"])
        out[b], lse[b] = o[0], l[0]
    base = None if dtype == "float32" else np.concatenate([tt.baseline_attention(p["q"], p["k"], p["v"], **p["options"])
                                                           for p in problems])
    # The reference of cuflash.reference.decode itself (its public entry) agrees with the per-sequence one.
    public_out, public_lse = reference.decode(case["q"], case["k_cache"], case["v_cache"], cache_seqlens=case["lens"],
                                              block_table=case["table"], k_new=case["k_new"], v_new=case["v_new"],
                                              **options)
    np.testing.assert_array_equal(public_out, out)
    np.testing.assert_array_equal(public_lse, lse)
    return out, lse, k_after, v_after, base


def run(case, dtype, options, num_splits, seed):
    """cuflash.decode on the case (fresh device copies, poisoned out=), checked against the reference."""
    ref_out, ref_lse, k_after, v_after, base = expected(case, dtype, options)
    q = cupy.asarray(case["q"])
    kc, vc = cupy.asarray(case["k_cache"]), cupy.asarray(case["v_cache"])
    kn = None if case["k_new"] is None else cupy.asarray(case["k_new"])
    vn = None if case["v_new"] is None else cupy.asarray(case["v_new"])
    table = None if case["table"] is None else cupy.asarray(case["table"])
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), NAN, dtype=cupy.float32)
    got_out, got_lse = cuflash.decode(q, kc, vc, cache_seqlens=cupy.asarray(case["lens"]), block_table=table,
                                      k_new=kn, v_new=vn, num_splits=num_splits, out=out, lse=lse, return_lse=True,
                                      **tt.as_device_options(options, cupy))
    assert got_out.data.ptr == out.data.ptr and got_lse.data.ptr == lse.data.ptr
    tt.assert_attention_close(got_out, ref_out, base, dtype=dtype, name=f"out (seed {seed})")
    tt.assert_attention_close(got_lse, ref_lse, dtype="float32", name=f"lse (seed {seed})")
    assert np.array_equal(_bits(kc.get()), _bits(k_after)), f"k_cache is not old cache + appended rows (seed {seed})"
    assert np.array_equal(_bits(vc.get()), _bits(v_after)), f"v_cache is not old cache + appended rows (seed {seed})"
    return got_out


def _problem(case_name, dtype, page_size, append, seed, Sq=None, lens=None, Hq=8, Hk=2):
    rng = np.random.default_rng(seed)
    edge = page_size or 64
    B = 3
    Sq = Sq or int(rng.choice([1, 3, 5]))
    lens = lens or [int(rng.choice([0, 1, edge - 1, edge + 1, 2 * edge + 3, int(rng.integers(0, 400))]))
                    for _ in range(B)]
    D = 64 if dtype == "float16" else 128
    case = build_case(dtype=dtype, B=B, Hq=Hq, Hk=Hk, D=D, Sq=Sq, lens=lens, page_size=page_size, append=append,
                      seed=seed)
    max_total = max(lens) + (Sq if append else 0) + 1
    score_mod, mask_mod, builtins = modifiers(case_name, B, Hq, max_total, rng)
    options = dict(builtins)
    if score_mod is not None:
        options["score_mod"] = score_mod
    if mask_mod is not None:
        options["mask_mod"] = mask_mod
    return case, options


@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: "contiguous" if p is None else f"page{p}")
@pytest.mark.parametrize("num_splits", SPLITS, ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_modifiers_against_the_reference(case_name, page_size, num_splits, dtype):
    seed = int(np.random.default_rng().integers(2**32))
    append = bool(np.random.default_rng(seed + 1).integers(2))
    case, options = _problem(case_name, dtype, page_size, append, seed)
    run(case, dtype, options, num_splits, seed)


@pytest.mark.parametrize("page_size", [None, 16])
def test_appended_tokens_see_each_other_at_their_positions(page_size):
    # Five appended tokens per sequence (chunked), a relative bias that singles out each offset: the
    # new tokens' q_idx are T_b - 5 .. T_b - 1, and the bias between them follows.
    seed = int(np.random.default_rng().integers(2**32))
    case, options = _problem("relative", "bfloat16", page_size, True, seed, Sq=5, lens=[0, 33, 200])
    run(case, "bfloat16", options, 2, seed)


def test_the_arrays_are_read_at_each_call():
    # A repeat call with new arrays of the same layout runs the remembered plan with their addresses
    # (and a new scalar value with no new kernel); each result follows its own arrays.
    seed = int(np.random.default_rng().integers(2**32))
    case, _ = _problem("relative", "bfloat16", 16, False, seed, Sq=2, lens=[50, 120, 7])
    rng = np.random.default_rng(seed)
    off = 200
    for scale_value in (1.0, 3.0):
        table = cupy.asarray(rng.standard_normal(2 * off + 1).astype(np.float32))
        score_mod = cuflash.ScoreMod("score + g * table[q_idx - kv_idx + off]", table=table, off=off, g=scale_value)
        run(case, "bfloat16", {"score_mod": score_mod}, 0, seed)


def test_a_modifier_that_hides_every_key_gives_empty_rows():
    # A MaskMod that hides all keys of sequence 1: out 0 and lse -inf there, the others untouched.
    seed = int(np.random.default_rng().integers(2**32))
    case, _ = _problem("sliding", "float32", None, True, seed, Sq=2, lens=[10, 20, 30])
    mask_mod = cuflash.MaskMod("b != 1")
    got = run(case, "float32", {"mask_mod": mask_mod}, 3, seed)
    assert bool((got[1] == 0).all())


def test_torch_tensors_as_array_arguments():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    seed = int(np.random.default_rng().integers(2**32))
    case, options = _problem("relative", "bfloat16", 64, True, seed)
    table = torch.as_tensor(cupy.asnumpy(options["score_mod"].args.values["table"]), device="cuda")
    off = int(options["score_mod"].args.values["off"])
    torch.cuda.synchronize()
    run(case, "bfloat16", {"score_mod": cuflash.ScoreMod("score + table[q_idx - kv_idx + off]", table=table, off=off)},
        0, seed)
