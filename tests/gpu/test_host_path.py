"""The host pipeline on the GPU: index arrays checked on the device, the memo of plans, cuflash.plan
and CUDA graphs, and concurrency (threads and streams).

1. Bad index values given on the GPU (``cache_seqlens``, ``block_table``, ``cu_seqlens_q/k``, a
   ``max_seqlen`` shorter than a sequence) are never read back: ``cuda_src/check_indices.cu``
   judges them and the call's other kernels write nothing. Every case checks that the cache and
   the caller's ``out=`` / ``dq, dk, dv`` buffers (poisoned with a known NaN pattern) keep every
   byte, and the three documented ways the fault surfaces: ``check=True`` raises at once; with
   ``check=False`` the call returns, and the next call of the entry point on the stream raises
   (then a third call runs), or :func:`cuflash.check_errors` raises. A good call afterwards is
   checked against the float64 reference (or, for gradients, bitwise against a clean call).
2. Concurrency: threads on their own non-blocking streams, four streams from one thread, and
   threads on CuPy's per-thread default streams (in a subprocess, since
   ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM`` must be set before CuPy starts), each making 200 calls
   of ``attention`` (fwd_sm90 forced on sm_90), split-KV paged ``decode`` and ``attention_varlen``
   (its index check and kernel launched as one CUDA graph per thread and stream) with index arrays
   on the GPU; every result must be bitwise equal to a single-threaded call on the same inputs.
3. The memo: a repeat call with new arrays of the same layout (CuPy arrays, or torch tensors on
   torch's current stream when it is CuPy's) runs with the planner monkeypatched to fail, and is
   right; a base one element off, and torch tensors on another torch stream, take the full path.
4. :func:`cuflash.plan`: runs equal the plain function bitwise, a layout mismatch is a ValueError,
   an option at call time a TypeError, and a run captured in a CUDA graph replays on new data.

Shapes are small (the float64 reference runs on the host) except in the 200-call tests. Outputs
are poisoned before every launch, so an element a kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import cuflash  # noqa: E402
import cuflash.testing as tt  # noqa: E402
from cuflash import _checks, kernels, reference  # noqa: E402
from cuflash._runtime import launch as _launch, memo as _memo, plan as _plan  # noqa: E402
from cuflash.reference import attention_backward as reference_backward  # noqa: E402
from cuflash.reference import attention_varlen_backward as reference_varlen_backward  # noqa: E402

pytestmark = pytest.mark.gpu

# The submodules (the package's attributes of these names are the functions).
attention_module = importlib.import_module("cuflash.attention")
backward_module = importlib.import_module("cuflash.backward")
decode_module = importlib.import_module("cuflash.decode")
merge_module = importlib.import_module("cuflash.merge")

ROOT = Path(__file__).resolve().parents[2]
MODES = ["check", "next_call", "check_errors"]
CALLS = 200   # per thread / stream in the concurrency tests


# ----------------------------------------------------------------------------- helpers

def _bits(x):
    """A CuPy array as unsigned integers of its item size (NaN payloads compare exactly)."""
    return x.view({1: cupy.uint8, 2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[x.dtype.itemsize])


def _host_bits(x):
    x = np.ascontiguousarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and bool(cupy.array_equal(_bits(a), _bits(b)))


def _poisoned(shape, dtype):
    """A buffer filled with a known pattern of NaNs (payload = index % 64): an element the kernel
    forgets to write fails an accuracy check, and any write at all changes its bytes."""
    x = cupy.empty(shape, dtype=dtype)
    index = cupy.arange(x.size, dtype=cupy.uint32) % 64
    if x.dtype.itemsize == 2:
        _bits(x)[...] = (index | 0x7FC0).astype(cupy.uint16).reshape(shape)
    else:
        _bits(x)[...] = (index | 0x7FC00000).astype(cupy.uint32).reshape(shape)
    return x


def _drain_faults():
    """Clear faults that an earlier test left on any stream (each check_errors raises one)."""
    for _ in range(64):
        try:
            cuflash.check_errors()
            return
        except ValueError:
            continue


@pytest.fixture(autouse=True)
def _no_pending_faults():
    _drain_faults()
    yield
    _drain_faults()


def _forbidden(*args, **kwargs):
    raise AssertionError("a repeat call went through the whole check-and-plan path")


def _spy(monkeypatch, module, name):
    """Count the calls of ``module.name`` (still calling it)."""
    calls = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def _misaligned_copy(x):
    """x's values in a view with x's shape and strides whose base is one element off 16 bytes."""
    buf = cupy.empty(x.size + 1, dtype=x.dtype)
    off = buf[1:].reshape(x.shape)
    _bits(off)[...] = _bits(x)
    assert off.data.ptr % 16 != 0 and off.strides == x.strides
    return off


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _torch_on_cupy_stream(torch):
    """torch's current stream must be CuPy's for the memo's direct torch path."""
    if torch.cuda.current_stream().cuda_stream != cupy.cuda.get_current_stream().ptr:
        pytest.skip("torch's current stream is not CuPy's in this process")


def _to_torch(torch, arrays):
    return {n: torch.from_dlpack(x) if isinstance(x, cupy.ndarray) else x for n, x in arrays.items()}


def _as_cupy(x):
    if isinstance(x, (tuple, list)):
        return type(x)(_as_cupy(y) for y in x)
    if x is None or isinstance(x, cupy.ndarray):
        return x
    return cupy.from_dlpack(x)


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _is_sm90():
    return cupy.cuda.Device().compute_capability == "90"


def _forced_forward():
    """fwd_sm90 on an sm_90 GPU (the persistent kernel with the per-stream work counter)."""
    return cuflash.force_kernel("fwd_sm90") if _is_sm90() else contextlib.nullcontext()


def _assert_grads_near(got, ref, rel=0.03):
    """A loose float64 check of gradients (the accuracy rule proper is test_backward_gpu's):
    finite, and max|g - ref| <= rel * max|ref| per gradient."""
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        g64 = cupy.asnumpy(_as_cupy(g).astype(cupy.float32)).astype(np.float64)
        assert np.isfinite(g64).all(), f"{name} has non-finite values"
        scale = max(float(np.abs(r).max()), 1e-6)
        err = float(np.abs(g64 - r).max())
        assert err <= rel * scale, f"{name}: max|{name} - ref| = {err:.3e} > {rel} * {scale:.3e}"


# ----------------------------------------------------------------------------- decode cases

def _decode_case(seed, *, paged, append, dtype="bfloat16", B=2, Hq=4, Hk=2, D=64, Sq=2, lens=(20, 3),
                 capacity=32, page_size=16, max_pages=4, num_pages=None):
    """tt.decode_case from a seed, with small defaults."""
    return tt.decode_case(np.random.default_rng(seed), lens, paged=paged, append=append, dtype=dtype, B=B, Hq=Hq,
                          Hk=Hk, D=D, Sq=Sq, capacity=capacity, page_size=page_size, max_pages=max_pages,
                          num_pages=num_pages)


def _decode_expected(case):
    """Reference output (float64), same-dtype baseline, and the caches after the append."""
    problems, k_after, v_after = reference._decode._decode_sequences(
        case["q"], case["k_cache"], case["v_cache"], cache_seqlens=case["lens"], block_table=case["table"],
        k_new=case["k_new"], v_new=case["v_new"])
    B, Sq, Hq, D = case["q"].shape
    out = np.zeros((B, Sq, Hq, D))
    for b, p in enumerate(problems):
        o, _ = reference.attention_forward(p["q"], p["k"], p["v"], **p["options"])
        out[b] = o[0]
    base = np.concatenate([tt.baseline_attention(p["q"], p["k"], p["v"], **p["options"]) for p in problems])
    return dict(out=out, base=base, k_after=k_after, v_after=v_after)


def _check_decode(out, d, expected, dtype):
    """out against the reference; the device caches equal the old ones plus the appended rows."""
    tt.assert_attention_close(_as_cupy(out), expected["out"], expected["base"], dtype=dtype, name="out")
    assert np.array_equal(_host_bits(cupy.asnumpy(d["k_cache"])), _host_bits(expected["k_after"])), \
        "k_cache is not the old cache plus the appended rows"
    assert np.array_equal(_host_bits(cupy.asnumpy(d["v_cache"])), _host_bits(expected["v_after"])), \
        "v_cache is not the old cache plus the appended rows"


# ----------------------------------------------------------------------------- varlen cases

CU_Q = np.array([0, 30, 75, 95], dtype=np.int32)     # query lengths 30, 45, 20
CU_K = np.array([0, 50, 90, 130], dtype=np.int32)    # key lengths 50, 40, 40 (sequence 1: 5 rows see no key)
MAX_Q, MAX_K = 45, 50
VARLEN_HEADS = (4, 2, 64)                            # Hq, Hk, D


def _varlen_qkv(seed, dtype):
    hq, hk, d = VARLEN_HEADS
    q, k, v = tt.random_qkv(dict(B=1, Sq=int(CU_Q[-1]), Sk=int(CU_K[-1]), Hq=hq, Hk=hk, D=d), dtype, seed,
                            xp=cupy)
    return q[0], k[0], v[0]


def _check_varlen(q, k, v, out, cu_q=CU_Q, cu_k=CU_K):
    ref, _ = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    base = tt.baseline_attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    tt.assert_attention_close(_as_cupy(out), ref, base, dtype=np.dtype(q.dtype), name="out")


def _varlen_backward_inputs(seed, dtype="float16"):
    """dout, q, k, v and the forward's out / lse (from the float64 reference, in the call's dtypes)."""
    q, k, v = _varlen_qkv(seed, dtype)
    dout = cupy.asarray(tt.normal_data(np.random.default_rng(seed + 1), q.shape, dtype))
    out64, lse64 = reference.attention_varlen(q, k, v, CU_Q, CU_K, causal=True)
    out = cupy.asarray(out64.astype(np.float32)).astype(q.dtype)
    lse = cupy.asarray(lse64.astype(np.float32))
    return dout, q, k, v, out, lse


# ----------------------------------------------------------------------------- 1. bad indices

def _bad_then_good(mode, pattern, run, fresh_outputs, protected, check_good):
    """The life of a call with bad GPU indices, then a good call.

    ``run(bad, outs, check)`` makes the call (bad or good indices) into the output buffers
    ``outs`` and returns its results; ``protected``: inputs (the cache) no call may write.
    """
    snapshot = [_bits(x).copy() for x in protected]

    def untouched(outs, before):
        cupy.cuda.Device().synchronize()
        for x, old in zip(protected, snapshot):
            assert bool(cupy.array_equal(_bits(x), old)), "a call with bad indices wrote into an input (the cache)"
        for o, old in zip(outs, before):
            assert bool(cupy.array_equal(_bits(o), old)), "a call with bad indices wrote into an output buffer"

    outs = fresh_outputs()
    before = [_bits(o).copy() for o in outs]
    if mode == "check":
        with pytest.raises(ValueError, match=pattern):
            run(True, outs, True)
        untouched(outs, before)
    else:
        result = _as_tuple(run(True, outs, False))     # returns: the fault is recorded, not raised
        assert all(r is o for r, o in zip(result, outs)), "the call did not return the caller's buffers"
        untouched(outs, before)                        # (synchronises: the fault report is written)
        if mode == "next_call":
            outs2 = fresh_outputs()
            before2 = [_bits(o).copy() for o in outs2]
            with pytest.raises(ValueError, match=pattern):
                run(False, outs2, False)
            untouched(outs2, before2)
        else:
            with pytest.raises(ValueError, match=pattern):
                cuflash.check_errors()
            cuflash.check_errors()                     # reported once
    outs3 = fresh_outputs()
    result = _as_tuple(run(False, outs3, mode == "check"))
    cupy.cuda.Device().synchronize()
    assert all(r is o for r, o in zip(result, outs3)), "the call did not return the caller's buffers"
    check_good(outs3)
    cuflash.check_errors()                             # nothing left behind


def _decode_bad_cases():
    """(id, paged, append, (what, value), pattern): one bad value each."""
    cases = []
    for append in (False, True):
        tag = "append" if append else "no_append"
        cases += [
            (f"contiguous-len_past_capacity-{tag}", False, append, ("lens", [33, 3]), r"cache_seqlens\[0\]"),
            (f"contiguous-len_negative-{tag}", False, append, ("lens", [20, -1]), r"cache_seqlens\[1\]"),
            (f"paged-len_past_capacity-{tag}", True, append, ("lens", [65, 3]), r"cache_seqlens\[0\]"),
            (f"paged-len_negative-{tag}", True, append, ("lens", [-2, 3]), r"cache_seqlens\[0\]"),
            (f"paged-page_negative-{tag}", True, append, ("page", (1, 0, -5)), r"block_table\[1, 0\]"),
            (f"paged-page_past_pool-{tag}", True, append, ("page", (0, 1, None)), r"block_table\[0, 1\]"),
        ]
    # Room for the cached keys but not for the appended ones (capacity 32 / 64, 2 appended).
    cases += [("contiguous-len_plus_new_past_capacity", False, True, ("lens", [31, 3]), r"cache_seqlens\[0\]"),
              ("paged-len_plus_new_past_capacity", True, True, ("lens", [63, 3]), r"cache_seqlens\[0\]")]
    return cases


DECODE_BAD = _decode_bad_cases()


@pytest.fixture(params=["self_check", "check_launch"])
def decode_checker(request, monkeypatch):
    """Which decode checks the index arrays: the decode kernel itself (every contiguous cache, small
    page tables), or a check_indices launch ahead of it (forced by allowing no table entries)."""
    if request.param == "check_launch":
        monkeypatch.setattr(kernels.decode, "DECODE_SELF_CHECK_PER_THREAD", 0)
    _memo.clear_memo()
    yield request.param
    _memo.clear_memo()


def _decode_launches() -> set:
    """The launch counts of the decode plans remembered since the memo was cleared."""
    return {len(plan.steps) for plan in _memo._memo.values() if plan.entry == "decode"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("name, paged, append, bad, pattern", DECODE_BAD, ids=[c[0] for c in DECODE_BAD])
def test_decode_bad_indices(name, paged, append, bad, pattern, num_splits, mode, decode_checker):
    if not paged and decode_checker == "check_launch":
        pytest.skip("a contiguous cache's lengths are always checked by the decode kernel")
    case = _decode_case(11, paged=paged, append=append)
    d = tt.decode_on(case, cupy)
    lens_bad, table_bad = d["lens"], d["table"]
    what, value = bad
    if what == "lens":
        lens_bad = cupy.asarray(np.array(value, dtype=np.int32))
    else:
        b, p, page = value
        table = case["table"].copy()
        assert table[b, p] >= 0, "the case must put the bad entry in a column the sequence uses"
        table[b, p] = case["k_cache"].shape[0] if page is None else page
        table_bad = cupy.asarray(table)
    expected = _decode_expected(case)

    def run(bad, outs, check):
        return cuflash.decode(d["q"], d["k_cache"], d["v_cache"], cache_seqlens=lens_bad if bad else d["lens"],
                              block_table=table_bad if bad else d["table"], k_new=d["k_new"], v_new=d["v_new"],
                              num_splits=num_splits, out=outs[0], check=check)

    _bad_then_good(mode, pattern, run, lambda: (_poisoned(d["q"].shape, d["q"].dtype),),
                   [d["k_cache"], d["v_cache"]], lambda outs: _check_decode(outs[0], d, expected, case["dtype"]))
    assert _decode_launches() == {2 if decode_checker == "check_launch" else 1}


def _garbage_past_the_pages(table):
    """Bad entries in columns no sequence uses (lens 20 / 3, + 0 or 2 appended, page 16: sequence 0
    uses columns 0-1, sequence 1 column 0)."""
    table = table.copy()
    table[0, 2:] = [-3, 2**31 - 1]
    table[1, 1:] = [-1, -7, 10**6]
    return table


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("append", [False, True])
def test_decode_bad_entries_in_unused_block_table_columns_are_no_error(append, num_splits):
    case = _decode_case(12, paged=True, append=append)
    case["table"] = _garbage_past_the_pages(case["table"])
    d = tt.decode_on(case, cupy)
    out = _poisoned(d["q"].shape, d["q"].dtype)
    got = cuflash.decode(d["q"], d["k_cache"], d["v_cache"], num_splits=num_splits, out=out, check=True,
                         **tt.decode_kwargs(d))
    assert got is out
    _check_decode(out, d, _decode_expected(case), case["dtype"])
    cuflash.check_errors()


@pytest.mark.parametrize("append", [False, True])
def test_decode_host_lengths_with_a_device_table_ignore_unused_columns(append):
    """cache_seqlens given as NumPy, block_table on the GPU: the device check must still only look
    at the pages each sequence uses (the docstring allows anything, e.g. -1, past them)."""
    case = _decode_case(13, paged=True, append=append)
    case["table"] = _garbage_past_the_pages(case["table"])
    d = tt.decode_on(case, cupy)
    out = _poisoned(d["q"].shape, d["q"].dtype)
    got = cuflash.decode(d["q"], d["k_cache"], d["v_cache"], cache_seqlens=case["lens"], block_table=d["table"],
                         k_new=d["k_new"], v_new=d["v_new"], out=out, check=True)
    assert got is out
    _check_decode(out, d, _decode_expected(case), case["dtype"])
    cuflash.check_errors()


VARLEN_BAD = [
    # (id, changes to the good arguments, pattern); lengths stay within max_seqlen unless that is the fault.
    ("cu_q_not_monotone", {"cu_q": [0, 30, 25, 70]}, "cu_seqlens_q"),
    ("cu_k_not_monotone", {"cu_k": [0, 50, 45, 85]}, "cu_seqlens_k"),
    ("cu_q_not_from_zero", {"cu_q": [5, 30, 75, 95]}, "cu_seqlens_q"),
    ("cu_k_not_from_zero", {"cu_k": [2, 50, 90, 130]}, "cu_seqlens_k"),
    ("cu_q_past_total", {"cu_q": [0, 30, 75, 100]}, "cu_seqlens_q"),
    ("cu_k_past_total", {"cu_k": [0, 50, 90, 140]}, "cu_seqlens_k"),
    ("longer_than_max_seqlen_q", {"max_q": 40}, "max_seqlen_q"),
    ("longer_than_max_seqlen_k", {"max_k": 45}, "max_seqlen_k"),
]


def _varlen_args(change=None):
    args = dict(cu_q=cupy.asarray(CU_Q), cu_k=cupy.asarray(CU_K), max_q=MAX_Q, max_k=MAX_K)
    for name, value in (change or {}).items():
        args[name] = cupy.asarray(np.array(value, dtype=np.int32)) if name.startswith("cu") else value
    return args


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, change, pattern", VARLEN_BAD, ids=[c[0] for c in VARLEN_BAD])
def test_varlen_bad_offsets(name, change, pattern, mode):
    q, k, v = _varlen_qkv(21, "bfloat16")
    good, bad = _varlen_args(), _varlen_args(change)

    def run(is_bad, outs, check):
        a = bad if is_bad else good
        return cuflash.attention_varlen(q, k, v, a["cu_q"], a["cu_k"], max_seqlen_q=a["max_q"],
                                        max_seqlen_k=a["max_k"], causal=True, out=outs[0], check=check)

    _bad_then_good(mode, pattern, run, lambda: (_poisoned(q.shape, q.dtype),), [q, k, v],
                   lambda outs: _check_varlen(q, k, v, outs[0]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, change, pattern", VARLEN_BAD, ids=[c[0] for c in VARLEN_BAD])
def test_varlen_backward_bad_offsets(name, change, pattern, mode):
    dout, q, k, v, out, lse = _varlen_backward_inputs(31)
    good, bad = _varlen_args(), _varlen_args(change)

    def fresh():
        return _poisoned(q.shape, q.dtype), _poisoned(k.shape, k.dtype), _poisoned(v.shape, v.dtype)

    def run(is_bad, outs, check):
        a = bad if is_bad else good
        return cuflash.attention_varlen_backward(dout, q, k, v, out, lse, a["cu_q"], a["cu_k"], max_seqlen_q=a["max_q"],
                                                 max_seqlen_k=a["max_k"], causal=True, deterministic=True,
                                                 dq=outs[0], dk=outs[1], dv=outs[2], check=check)

    # A clean call first: deterministic=True makes it the bitwise yardstick of the good call after the bad one.
    clean = fresh()
    run(False, clean, True)
    _assert_grads_near(clean, reference_varlen_backward(dout, q, k, v, CU_Q, CU_K, causal=True))

    def check_good(outs):
        for name_, got, want in zip(("dq", "dk", "dv"), outs, clean):
            assert _same_bits(got, want), f"{name_} after the bad call differs from a clean call's"

    _bad_then_good(mode, pattern, run, fresh, [dout, q, k, v, out, lse], check_good)


def test_check_default_comes_from_the_environment(monkeypatch):
    """CUFLASH_CHECK=1 at import sets _checks._CHECK_DEFAULT: check=None then behaves as check=True."""
    monkeypatch.setattr(_checks, "_CHECK_DEFAULT", True)
    case = _decode_case(41, paged=True, append=True)
    d = tt.decode_on(case, cupy)
    k_before, v_before = _bits(d["k_cache"]).copy(), _bits(d["v_cache"]).copy()
    out = _poisoned(d["q"].shape, d["q"].dtype)
    out_before = _bits(out).copy()
    bad_lens = cupy.asarray(np.array([65, 3], dtype=np.int32))
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]"):
        cuflash.decode(d["q"], d["k_cache"], d["v_cache"], cache_seqlens=bad_lens, block_table=d["table"],
                       k_new=d["k_new"], v_new=d["v_new"], out=out)
    cupy.cuda.Device().synchronize()
    assert bool(cupy.array_equal(_bits(d["k_cache"]), k_before))
    assert bool(cupy.array_equal(_bits(d["v_cache"]), v_before))
    assert bool(cupy.array_equal(_bits(out), out_before))

    q, k, v = _varlen_qkv(42, "bfloat16")
    bad = _varlen_args({"cu_k": [0, 50, 45, 85]})
    out = _poisoned(q.shape, q.dtype)
    out_before = _bits(out).copy()
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        cuflash.attention_varlen(q, k, v, bad["cu_q"], bad["cu_k"], max_seqlen_q=MAX_Q, max_seqlen_k=MAX_K,
                                 causal=True, out=out)
    cupy.cuda.Device().synchronize()
    assert bool(cupy.array_equal(_bits(out), out_before))

    dout, q, k, v, out, lse = _varlen_backward_inputs(43)
    bad = _varlen_args({"cu_q": [5, 30, 75, 95]})
    dq = _poisoned(q.shape, q.dtype)
    dq_before = _bits(dq).copy()
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        cuflash.attention_varlen_backward(dout, q, k, v, out, lse, bad["cu_q"], bad["cu_k"], max_seqlen_q=MAX_Q,
                                          max_seqlen_k=MAX_K, causal=True, dq=dq)
    cupy.cuda.Device().synchronize()
    assert bool(cupy.array_equal(_bits(dq), dq_before))

    # An explicit check=False still defers the fault to the next call / check_errors.
    cuflash.decode(d["q"], d["k_cache"], d["v_cache"], cache_seqlens=bad_lens, block_table=d["table"],
                   k_new=d["k_new"], v_new=d["v_new"], check=False)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\]"):
        cuflash.check_errors()
    assert bool(cupy.array_equal(_bits(d["k_cache"]), k_before))
    assert bool(cupy.array_equal(_bits(d["v_cache"]), v_before))


# ----------------------------------------------------------------------------- 3. the memo

ATT_SHAPE = dict(B=2, Sq=130, Sk=257, Hq=4, Hk=2, D=64)
BWD_SHAPE = dict(B=2, Sq=70, Sk=129, Hq=4, Hk=2, D=64)
MEMO_DECODE = dict(append=True, B=2, Hq=8, Hk=2, D=64, Sq=1, capacity=64, max_pages=4, num_pages=12)


class _Entry:
    """One entry point for the memo tests: make(seed) -> CuPy arrays (and host data under names
    starting with '_'); call(arrays) -> results; check(arrays, CuPy results); ``outs``: the names
    of the caller's output buffers, returned as the same objects."""

    def __init__(self, module, planner, make, call, check, outs=()):
        self.module, self.planner, self.make, self.call, self.check, self.outs = (
            module, planner, make, call, check, outs)


def _make_attention(seed):
    q, k, v = tt.random_qkv(ATT_SHAPE, "bfloat16", seed, xp=cupy)
    return dict(q=q, k=k, v=v, out=_poisoned(q.shape, q.dtype))


def _call_attention(a):
    return cuflash.attention(a["q"], a["k"], a["v"], causal=True, out=a["out"])


def _check_attention(a, out):
    ref, _ = reference.attention_forward(a["q"], a["k"], a["v"], causal=True)
    base = tt.baseline_attention(a["q"], a["k"], a["v"], causal=True)
    tt.assert_attention_close(out, ref, base, dtype="bfloat16", name="out")


def _make_backward(seed):
    q, k, v = tt.random_qkv(BWD_SHAPE, "float16", seed, xp=cupy)
    dout = cupy.asarray(tt.normal_data(np.random.default_rng(seed + 7), q.shape, "float16"))
    out64, lse64 = reference.attention_forward(q, k, v, causal=True)
    return dict(dout=dout, q=q, k=k, v=v, out=cupy.asarray(out64.astype(np.float32)).astype(q.dtype),
                lse=cupy.asarray(lse64.astype(np.float32)), dq=_poisoned(q.shape, q.dtype),
                dk=_poisoned(k.shape, k.dtype), dv=_poisoned(v.shape, v.dtype))


def _call_backward(a):
    return cuflash.attention_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], causal=True,
                                      dq=a["dq"], dk=a["dk"], dv=a["dv"])


def _check_backward(a, grads):
    _assert_grads_near(grads, reference_backward(a["dout"], a["q"], a["k"], a["v"], causal=True))


def _make_varlen(seed):
    q, k, v = _varlen_qkv(seed, "bfloat16")
    return dict(q=q, k=k, v=v, cu_q=cupy.asarray(CU_Q), cu_k=cupy.asarray(CU_K), out=_poisoned(q.shape, q.dtype))


def _call_varlen(a):
    return cuflash.attention_varlen(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], max_seqlen_q=MAX_Q,
                                    max_seqlen_k=MAX_K, causal=True, out=a["out"])


def _check_varlen_entry(a, out):
    _check_varlen(a["q"], a["k"], a["v"], out)


def _make_varlen_backward(seed):
    dout, q, k, v, out, lse = _varlen_backward_inputs(seed)
    return dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_q=cupy.asarray(CU_Q), cu_k=cupy.asarray(CU_K),
                dq=_poisoned(q.shape, q.dtype), dk=_poisoned(k.shape, k.dtype), dv=_poisoned(v.shape, v.dtype))


def _call_varlen_backward(a):
    return cuflash.attention_varlen_backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], a["cu_q"],
                                             a["cu_k"], max_seqlen_q=MAX_Q, max_seqlen_k=MAX_K, causal=True,
                                             dq=a["dq"], dk=a["dk"], dv=a["dv"])


def _check_varlen_backward(a, grads):
    _assert_grads_near(grads, reference_varlen_backward(a["dout"], a["q"], a["k"], a["v"], CU_Q, CU_K, causal=True))


def _make_decode(paged):
    def make(seed):
        case = _decode_case(seed, paged=paged, lens=(40 + seed % 7, 9), **MEMO_DECODE)
        d = tt.decode_on(case, cupy)
        arrays = {n: x for n, x in d.items() if x is not None}
        arrays.update(out=_poisoned(d["q"].shape, d["q"].dtype), _case=case, _device=d)
        return arrays
    return make


def _call_decode(a):
    return cuflash.decode(a["q"], a["k_cache"], a["v_cache"], cache_seqlens=a["lens"], block_table=a.get("table"),
                          k_new=a["k_new"], v_new=a["v_new"], out=a["out"])


def _check_decode_entry(a, out):
    _check_decode(out, a["_device"], _decode_expected(a["_case"]), a["_case"]["dtype"])


def _make_merge(seed):
    rng = np.random.default_rng(seed)
    outs = tt.normal_data(rng, (3, 2, 5, 4, 64), "float32")
    lses = 3.0 * tt.normal_data(rng, (3, 2, 4, 5), "float32")
    lses[1, 0, 2, 3] = -np.inf            # a part that saw no key
    return dict(outs=cupy.asarray(outs), lses=cupy.asarray(lses))


def _call_merge(a):
    return cuflash.merge_states(a["outs"], a["lses"])


def _check_merge(a, result):
    out, lse = result
    ref_out, ref_lse = reference.merge_states(a["outs"], a["lses"])
    tt.assert_attention_close(out, ref_out, dtype="float32", name="out")
    tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")


ENTRIES = {
    "attention": _Entry(attention_module, "_plan_attention", _make_attention, _call_attention, _check_attention,
                        ("out",)),
    "attention_backward": _Entry(backward_module, "_plan_backward", _make_backward, _call_backward, _check_backward,
                                 ("dq", "dk", "dv")),
    "attention_varlen": _Entry(attention_module, "_plan_varlen", _make_varlen, _call_varlen, _check_varlen_entry,
                               ("out",)),
    "attention_varlen_backward": _Entry(backward_module, "_plan_varlen_backward", _make_varlen_backward,
                                        _call_varlen_backward, _check_varlen_backward, ("dq", "dk", "dv")),
    "decode_contiguous": _Entry(decode_module, "_plan_decode", _make_decode(False), _call_decode,
                                _check_decode_entry, ("out",)),
    "decode_paged": _Entry(decode_module, "_plan_decode", _make_decode(True), _call_decode, _check_decode_entry,
                           ("out",)),
    "merge_states": _Entry(merge_module, "_plan_merge", _make_merge, _call_merge, _check_merge),
}


def _replay(entry, monkeypatch, convert):
    """First call plans (and is right); two more calls with new arrays of the same layout must
    replay the remembered plan (the planner fails if called) and be right."""
    _memo.clear_memo()
    for n, seed in enumerate((101, 102, 103)):
        arrays = entry.make(seed)
        args = convert(arrays)
        result = entry.call(args)
        for r, name in zip(_as_tuple(result), entry.outs):
            assert r is args[name], f"{name}= was not returned as the caller's object"
        cupy.cuda.Device().synchronize()
        entry.check(arrays, _as_cupy(result))
        if n == 0:
            assert len(_memo._memo) == 1, "the first call did not remember its plan"
            monkeypatch.setattr(entry.module, entry.planner, _forbidden)
    monkeypatch.undo()


@pytest.mark.parametrize("name", list(ENTRIES))
def test_repeat_call_replays_the_plan_cupy(name, monkeypatch):
    _replay(ENTRIES[name], monkeypatch, lambda arrays: arrays)


@pytest.mark.parametrize("name", list(ENTRIES))
def test_repeat_call_replays_the_plan_torch(name, monkeypatch):
    torch = _torch()
    _torch_on_cupy_stream(torch)
    _replay(ENTRIES[name], monkeypatch, lambda arrays: _to_torch(torch, arrays))


@pytest.mark.parametrize("name", ["attention", "decode_paged"])
def test_misaligned_base_takes_the_full_path(name, monkeypatch):
    """Same shape, strides and dtype as a remembered call, but q one element off 16 bytes: the
    plan (made for aligned operands) must not be replayed; the full path copies q and is right.
    An aligned repeat afterwards still replays."""
    entry = ENTRIES[name]
    _memo.clear_memo()
    first = entry.make(111)
    entry.call(first)
    calls = _spy(monkeypatch, entry.module, entry.planner)
    arrays = entry.make(112)
    arrays["q"] = _misaligned_copy(arrays["q"])
    result = entry.call(arrays)
    cupy.cuda.Device().synchronize()
    entry.check(arrays, result)
    assert len(calls) == 1, "a misaligned operand replayed a plan made for aligned ones"
    again = entry.make(113)
    entry.check(again, entry.call(again))
    assert len(calls) == 1, "an aligned repeat did not replay the remembered plan"


def _restrided(x, strides):
    """A copy of CuPy array ``x`` laid out with the byte ``strides`` (each a multiple of the item
    size; the copy's memory spans what they reach)."""
    span = sum((n - 1) * s for n, s in zip(x.shape, strides)) + x.itemsize
    base = cupy.empty(span // x.itemsize + 1, dtype=x.dtype)
    y = cupy.lib.stride_tricks.as_strided(base, x.shape, strides)
    y[...] = x
    return y


@pytest.mark.parametrize("frontend", ["cupy", "torch"])
def test_strides_key_a_plan_except_along_axes_of_length_one(frontend, monkeypatch):
    """The memo keys C-contiguous operands by their shape alone: a q whose only other stride is
    along its batch axis of length 1 replays the plan; one of the same shape laid out heads before
    rows takes the full path. Both are right."""
    convert = (lambda x: x) if frontend == "cupy" else _torch().from_dlpack
    if frontend == "torch":
        _torch_on_cupy_stream(_torch())
    shape = dict(ATT_SHAPE, B=1)
    s, h, d = shape["Sq"], shape["Hq"], shape["D"]
    _memo.clear_memo()
    calls = _spy(monkeypatch, attention_module, "_plan_attention")
    for n, strides in enumerate((None, (2, h * d * 2, d * 2, 2), (s * h * d * 2, d * 2, s * d * 2, 2))):
        q, k, v = tt.random_qkv(shape, "bfloat16", 140 + n, xp=cupy)
        if strides is not None:
            q = _restrided(q, strides)
        assert q.strides == (strides or q.strides)
        out = _poisoned(q.shape, q.dtype)
        result = cuflash.attention(convert(q), convert(k), convert(v), causal=True, out=convert(out))
        cupy.cuda.Device().synchronize()
        _check_attention(dict(q=q, k=k, v=v), _as_cupy(result))
        assert len(calls) == (1, 1, 2)[n], ("the first call plans", "strides along a length-1 axis missed the plan",
                                            "replayed a plan made for other strides")[n]


def test_misaligned_torch_tensor_takes_the_full_path(monkeypatch):
    torch = _torch()
    _torch_on_cupy_stream(torch)
    entry = ENTRIES["attention"]
    _memo.clear_memo()
    first = _to_torch(torch, entry.make(121))
    entry.call(first)
    calls = _spy(monkeypatch, entry.module, entry.planner)
    arrays = entry.make(122)
    args = _to_torch(torch, arrays)
    buf = torch.empty(args["q"].numel() + 1, dtype=args["q"].dtype, device=args["q"].device)
    q_off = buf[1:].view(args["q"].shape)
    q_off.copy_(args["q"])
    assert q_off.data_ptr() % 16 != 0 and q_off.stride() == args["q"].stride()
    args["q"] = q_off
    result = entry.call(args)
    assert result is args["out"]
    torch.cuda.synchronize()
    entry.check(arrays, _as_cupy(result))
    assert len(calls) == 1


def test_torch_tensors_on_another_torch_stream(monkeypatch):
    """torch's current stream is not CuPy's: every call takes the full path through DLPack (which
    orders the producer's stream before ours) and is right."""
    torch = _torch()
    entry = ENTRIES["attention"]
    _memo.clear_memo()
    calls = _spy(monkeypatch, entry.module, entry.planner)
    side = torch.cuda.Stream()
    for n, seed in enumerate((131, 132)):
        arrays = entry.make(seed)
        src = _to_torch(torch, arrays)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            assert torch.cuda.current_stream().cuda_stream != cupy.cuda.get_current_stream().ptr
            # Produced on the side stream, consumed on CuPy's.
            q, k, v = (src[x].clone() for x in ("q", "k", "v"))
            out = cuflash.attention(q, k, v, causal=True)
        assert isinstance(out, cupy.ndarray)
        cupy.cuda.Device().synchronize()
        entry.check(arrays, out)
        assert len(calls) == n + 1, "a torch tensor on another torch stream replayed a plan"


# ----------------------------------------------------------------------------- 4. cuflash.plan

PLAN_DECODE = dict(append=True, dtype="bfloat16", B=2, Hq=8, Hk=2, D=128, Sq=1, capacity=320, max_pages=20,
                   num_pages=48)


def _load_into(d, case):
    """Write a case's values into the device buffers ``d`` (same shapes), on the current stream."""
    for n in tt.DECODE_ARRAYS:
        if d[n] is not None:
            _bits(d[n])[...] = _bits(cupy.asarray(case[n]))


@contextlib.contextmanager
def _capturing(stream, graphs):
    """Capture the block's launches on ``stream`` into a graph appended to ``graphs``."""
    stream.begin_capture()
    try:
        yield
    except BaseException:
        try:
            stream.end_capture()
        except Exception:
            pass
        raise
    graphs.append(stream.end_capture())


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_plan_decode(paged, monkeypatch):
    lens = {1: (300, 77), 2: (250, 100), 3: (260, 90)}
    cases = {n: _decode_case(n, paged=paged, lens=lens[n], **PLAN_DECODE) for n in lens}
    d1 = tt.decode_on(cases[1], cupy)
    out1 = _poisoned(d1["q"].shape, d1["q"].dtype)
    out1_before = _bits(out1).copy()
    p = cuflash.plan(cuflash.decode, d1["q"], d1["k_cache"], d1["v_cache"], out=out1, num_splits=4, check=False,
                     **tt.decode_kwargs(d1))
    assert isinstance(p, cuflash.Plan)
    cupy.cuda.Device().synchronize()
    assert np.array_equal(_host_bits(cupy.asnumpy(d1["k_cache"])), _host_bits(cases[1]["k_cache"])), \
        "planning launched something"
    assert bool(cupy.array_equal(_bits(out1), out1_before))

    # Runs on other arrays of the layout: no planning, the plain call's bits (each on its own copy,
    # since both append).
    expected = _decode_expected(cases[2])
    da, db = tt.decode_on(cases[2], cupy), tt.decode_on(cases[2], cupy)
    out_a, out_b = (_poisoned(da["q"].shape, da["q"].dtype) for _ in range(2))
    with monkeypatch.context() as m:
        m.setattr(decode_module, "_plan_decode", _forbidden)
        got = p(da["q"], da["k_cache"], da["v_cache"], out=out_a, **tt.decode_kwargs(da))
    assert got is out_a
    want = cuflash.decode(db["q"], db["k_cache"], db["v_cache"], out=out_b, num_splits=4, check=False,
                          **tt.decode_kwargs(db))
    cupy.cuda.Device().synchronize()
    assert _same_bits(out_a, want), "the plan's run differs from the plain call"
    assert _same_bits(da["k_cache"], db["k_cache"]) and _same_bits(da["v_cache"], db["v_cache"])
    _check_decode(out_a, da, expected, "bfloat16")

    # A layout mismatch, and options at call time, are errors before anything runs.
    k_before = _bits(da["k_cache"]).copy()
    q_other = cupy.asarray(np.concatenate([cases[2]["q"]] * 2, axis=1))       # Sq = 2
    with pytest.raises(ValueError, match="plan"):
        p(q_other, da["k_cache"], da["v_cache"], out=out_a, **tt.decode_kwargs(da))
    for option in (dict(num_splits=4), dict(num_splits=2), dict(check=True)):
        with pytest.raises(TypeError):
            p(da["q"], da["k_cache"], da["v_cache"], out=out_a, **tt.decode_kwargs(da), **option)
    with pytest.raises((TypeError, ValueError)):    # an option not fixed at plan time
        p(da["q"], da["k_cache"], da["v_cache"], out=out_a, causal=False, **tt.decode_kwargs(da))
    cupy.cuda.Device().synchronize()
    assert bool(cupy.array_equal(_bits(da["k_cache"]), k_before)), "a rejected call wrote into the cache"

    # Capture in a CUDA graph; replay it on new values in the same buffers.
    bufs = tt.decode_on(cases[2], cupy)
    out_g = _poisoned(bufs["q"].shape, bufs["q"].dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    graphs = []
    cupy.cuda.Device().synchronize()
    with stream:
        p(bufs["q"], bufs["k_cache"], bufs["v_cache"], out=out_g, **tt.decode_kwargs(bufs))   # warm-up
        stream.synchronize()
        with _capturing(stream, graphs):
            p(bufs["q"], bufs["k_cache"], bufs["v_cache"], out=out_g, **tt.decode_kwargs(bufs))
        _load_into(bufs, cases[3])          # new q, k_new, v_new, lengths, table; the cache reset
        _bits(out_g)[...] = _bits(_poisoned(out_g.shape, out_g.dtype))
        graphs[0].launch(stream)
        stream.synchronize()
    dw = tt.decode_on(cases[3], cupy)
    want = cuflash.decode(dw["q"], dw["k_cache"], dw["v_cache"], num_splits=4, check=False, **tt.decode_kwargs(dw))
    cupy.cuda.Device().synchronize()
    assert _same_bits(out_g, want), "the graph's replay differs from an uncaptured call"
    assert _same_bits(bufs["k_cache"], dw["k_cache"]) and _same_bits(bufs["v_cache"], dw["v_cache"])
    _check_decode(out_g, bufs, _decode_expected(cases[3]), "bfloat16")
    cuflash.check_errors()


CU_2 = (np.array([0, 40, 55, 95], np.int32), np.array([0, 45, 85, 130], np.int32))
CU_3 = (np.array([0, 20, 65, 95], np.int32), np.array([0, 30, 80, 130], np.int32))


def test_plan_attention_varlen(monkeypatch):
    opts = dict(max_seqlen_q=MAX_Q, max_seqlen_k=MAX_K, causal=True, check=False)
    q1, k1, v1 = _varlen_qkv(141, "bfloat16")
    out1 = _poisoned(q1.shape, q1.dtype)
    p = cuflash.plan(cuflash.attention_varlen, q1, k1, v1, cupy.asarray(CU_Q), cupy.asarray(CU_K), out=out1, **opts)
    assert isinstance(p, cuflash.Plan)

    q2, k2, v2 = _varlen_qkv(142, "bfloat16")
    cu_q2, cu_k2 = (cupy.asarray(c) for c in CU_2)
    out_a, out_b = _poisoned(q2.shape, q2.dtype), _poisoned(q2.shape, q2.dtype)
    with monkeypatch.context() as m:
        m.setattr(attention_module, "_plan_varlen", _forbidden)
        got = p(q2, k2, v2, cu_q2, cu_k2, out=out_a)
    assert got is out_a
    want = cuflash.attention_varlen(q2, k2, v2, cu_q2, cu_k2, out=out_b, **opts)
    cupy.cuda.Device().synchronize()
    assert _same_bits(out_a, want)
    _check_varlen(q2, k2, v2, out_a, *CU_2)

    with pytest.raises(ValueError, match="plan"):
        p(q2[:90], k2, v2, cu_q2, cu_k2, out=out_a[:90])
    for option in (dict(causal=True), dict(max_seqlen_q=MAX_Q), dict(check=True)):
        with pytest.raises(TypeError):
            p(q2, k2, v2, cu_q2, cu_k2, out=out_a, **option)

    # Capture, then replay on new values (and new sequence boundaries) in the same buffers.
    q, k, v = _varlen_qkv(143, "bfloat16")
    cu_q, cu_k = cupy.asarray(CU_Q), cupy.asarray(CU_K)
    out_g = _poisoned(q.shape, q.dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    graphs = []
    cupy.cuda.Device().synchronize()
    with stream:
        p(q, k, v, cu_q, cu_k, out=out_g)     # warm-up: the stream's state and the plan's workspace
        stream.synchronize()
        with _capturing(stream, graphs):
            p(q, k, v, cu_q, cu_k, out=out_g)
        q3, k3, v3 = _varlen_qkv(144, "bfloat16")
        for dst, src in ((q, q3), (k, k3), (v, v3)):
            _bits(dst)[...] = _bits(src)
        cu_q[...] = cupy.asarray(CU_3[0])
        cu_k[...] = cupy.asarray(CU_3[1])
        _bits(out_g)[...] = _bits(_poisoned(out_g.shape, out_g.dtype))
        graphs[0].launch(stream)
        stream.synchronize()
    want = cuflash.attention_varlen(q3, k3, v3, cupy.asarray(CU_3[0]), cupy.asarray(CU_3[1]), **opts)
    cupy.cuda.Device().synchronize()
    assert _same_bits(out_g, want), "the graph's replay differs from an uncaptured call"
    _check_varlen(q3, k3, v3, out_g, *CU_3)
    cuflash.check_errors()


# ----------------------------------------------------------------------------- 2. concurrency

CONC_ATTENTION = dict(B=2, Sq=1024, Sk=1024, Hq=8, Hk=8, D=128)
CONC_DECODE = dict(paged=True, append=False, dtype="float16", B=2, Hq=8, Hk=2, D=128, Sq=1, lens=(1000, 700),
                   page_size=16, max_pages=64, num_pages=120)
SETS_PER_WORKER = 2


CONC_VARLEN = ((0, 300, 512), 320)   # cu_seqlens (queries = keys), max_seqlen


def _conc_inputs(index):
    """Input set ``index``: attention q, k, v (fp16), a paged decode case and a varlen batch (its
    index check and kernel: two launches, one graph) on the GPU."""
    q, k, v = tt.random_qkv(CONC_ATTENTION, "float16", 1000 + index, xp=cupy)
    d = tt.decode_on(_decode_case(2000 + index, **CONC_DECODE), cupy)
    cu, _ = CONC_VARLEN
    packed = tt.random_qkv(dict(B=1, Sq=cu[-1], Sk=cu[-1], Hq=4, Hk=4, D=64), "float16", 3000 + index, xp=cupy)
    varlen = tuple(x[0] for x in packed) + (cupy.asarray(cu, dtype=cupy.int32),)
    return dict(attention=(q, k, v), decode=d, varlen=varlen)


def _conc_step(inputs):
    """One call of each entry point (index arrays on the GPU: the check kernel runs every call)."""
    q, k, v = inputs["attention"]
    a = cuflash.attention(q, k, v, causal=True)
    d = inputs["decode"]
    o = cuflash.decode(d["q"], d["k_cache"], d["v_cache"], cache_seqlens=d["lens"], block_table=d["table"],
                       num_splits=4)
    vq, vk, vv, cu = inputs["varlen"]
    n = CONC_VARLEN[1]
    vo = cuflash.attention_varlen(vq, vk, vv, cu, cu, max_seqlen_q=n, max_seqlen_k=n, causal=True)
    return a, o, vo


def _conc_setup(workers):
    """Inputs (SETS_PER_WORKER per worker) and their single-threaded results, made on the current
    stream, then the whole device synchronised (the workers' streams do not wait for it)."""
    inputs = [_conc_inputs(i) for i in range(workers * SETS_PER_WORKER)]
    with _forced_forward():
        expected = [_conc_step(x) for x in inputs]
    cupy.cuda.Device().synchronize()
    return inputs, expected


def _conc_mismatches(results, expected):
    """results[w] = list of (input set, attention out, decode out, varlen out) of worker w."""
    bad = []
    for w, outs in enumerate(results):
        assert outs is not None and len(outs) == CALLS, f"worker {w} did not finish"
        for i, (index, *got) in enumerate(outs):
            for name, x, want in zip(("attention", "decode", "attention_varlen"), got, expected[index]):
                if not _same_bits(x, want):
                    bad.append(f"worker {w} call {i}: {name}")
    return bad


def _conc_worker(w, inputs, results, errors, barrier, stream=None):
    """CALLS steps on the thread's stream (``stream``, or the current one: the per-thread default
    stream under CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1), then a synchronisation of that stream."""
    try:
        with (stream if stream is not None else contextlib.nullcontext()), _forced_forward():
            barrier.wait()
            outs = []
            for i in range(CALLS):
                index = w * SETS_PER_WORKER + i % SETS_PER_WORKER
                outs.append((index, *_conc_step(inputs[index])))
            cupy.cuda.get_current_stream().synchronize()
        results[w] = outs
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        errors.append(e)
        barrier.abort()


def _run_threads(workers, inputs, own_streams):
    results, errors = [None] * workers, []
    barrier = threading.Barrier(workers)
    threads = [threading.Thread(target=_conc_worker,
                                args=(w, inputs, results, errors, barrier,
                                      cupy.cuda.Stream(non_blocking=True) if own_streams else None))
               for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("workers", [2, 4])
def test_threads_on_their_own_streams(workers):
    inputs, expected = _conc_setup(workers)
    results = _run_threads(workers, inputs, own_streams=True)
    bad = _conc_mismatches(results, expected)
    assert not bad, f"{len(bad)} results differ from single-threaded calls: {bad[:10]}"
    cuflash.check_errors()


def test_four_streams_from_one_thread():
    inputs, expected = _conc_setup(4)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]
    results = [[] for _ in streams]
    with _forced_forward():
        for i in range(CALLS):
            for w, stream in enumerate(streams):
                index = w * SETS_PER_WORKER + i % SETS_PER_WORKER
                with stream:
                    results[w].append((index, *_conc_step(inputs[index])))
    for stream in streams:
        stream.synchronize()
    bad = _conc_mismatches(results, expected)
    assert not bad, f"{len(bad)} results differ from single-threaded calls: {bad[:10]}"
    device = cupy.cuda.Device().id
    for stream in streams:   # the persistent forward leaves each stream's work counter at 0
        assert int(_launch.stream_state(device, stream.ptr)._words[0]) == 0
    cuflash.check_errors()


def _ptds_main(workers: int) -> int:
    """The per-thread-default-stream check, run in a subprocess started with
    CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1. Returns the exit status (0: every result bitwise equal)."""
    ptr = cupy.cuda.get_current_stream().ptr
    if ptr != 2:   # cudaStreamPerThread
        print(f"CuPy's current stream is {ptr}, not the per-thread default stream", flush=True)
        return 2
    inputs, expected = _conc_setup(workers)
    try:
        results = _run_threads(workers, inputs, own_streams=False)
    except BaseException as e:  # noqa: BLE001
        print(f"a worker failed: {type(e).__name__}: {e}", flush=True)
        return 3
    bad = _conc_mismatches(results, expected)
    if bad:
        print(f"{len(bad)} results differ from single-threaded calls: {bad[:20]}", flush=True)
        return 1
    print(f"ok: {workers} threads x {CALLS} calls", flush=True)
    return 0


_PTDS_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import test_host_path as t
sys.exit(t._ptds_main(int(sys.argv[1])))
"""


@pytest.mark.parametrize("workers", [2, 4])
def test_threads_on_per_thread_default_streams(workers):
    env = dict(os.environ, CUPY_CUDA_PER_THREAD_DEFAULT_STREAM="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    script = _PTDS_SCRIPT.format(tests=str(Path(__file__).resolve().parent))
    proc = subprocess.run([sys.executable, "-c", script, str(workers)], env=env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                                  f"--- stderr\n{proc.stderr[-4000:]}")


# ----------------------------------------------------------------------------- 5. plans as graphs

def test_outputs_without_out_are_reused_only_once_dropped():
    """A loop that drops its previous result gets outputs handed out again (recycled.py); a result
    the caller still holds, or a view of it, is never written by a later call. Every result is
    checked against an out= call on its own inputs, the held ones after all the calls."""
    rng = np.random.default_rng()
    cases = [tt.decode_on(_decode_case(int(rng.integers(2**31)), paged=False, append=False), cupy) for _ in range(6)]

    def decode(d):
        return cuflash.decode(d["q"], d["k_cache"], d["v_cache"], **tt.decode_kwargs(d))

    def want(d):
        return cuflash.decode(d["q"], d["k_cache"], d["v_cache"], out=_poisoned(d["q"].shape, d["q"].dtype),
                              **tt.decode_kwargs(d))

    result, addresses = None, set()
    for d in cases:
        result = decode(d)   # the previous result dropped after this call
        addresses.add(result.data.ptr)
        assert _same_bits(result, want(d))
    assert len(addresses) <= 2, "a loop that drops its results should reuse their memory"
    held = [decode(cases[0]), decode(cases[1])[1:]]   # an array, and a view whose base is dropped
    later = [decode(d) for d in cases[2:]]
    assert _same_bits(held[0], want(cases[0])) and _same_bits(held[1], want(cases[1])[1:])
    for d, x in zip(cases[2:], later):
        assert _same_bits(x, want(d))


def test_plans_of_several_kernels_launch_as_one_graph(monkeypatch):
    # A backward (preprocess, main pass, dQ conversion: a programmatic edge on sm_90) and a varlen
    # call (index check, kernel) run as one CUDA graph per thread and stream; the same calls launched
    # kernel by kernel give bitwise equal dK, dV, out and lse (dQ's atomic order aside: close), on
    # new data at every call (the graph takes each call's arguments).
    shape = dict(B=2, Sq=300, Sk=300, Hq=4, Hk=2, D=128)

    def calls(seed):
        q, k, v = tt.random_qkv(shape, "bfloat16", seed, xp=cupy)
        dout = tt.random_qkv(shape, "bfloat16", seed + 100, xp=cupy)[0]
        out, lse, _ = cuflash.attention_forward(q, k, v)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse)
        cu = cupy.asarray([0, 170, 300], dtype=cupy.int32)
        varlen = cuflash.attention_varlen(q[0], k[0], v[0], cu, cu, max_seqlen_q=170, max_seqlen_k=170,
                                          return_lse=True)
        return grads, varlen

    for seed in (61, 62):
        graphed = calls(seed)
        with monkeypatch.context() as m:
            m.setattr(_plan, "GRAPH_MIN_STEPS", 0)
            plain = calls(seed)
        (dq, dk, dv), (out, lse) = graphed
        assert _same_bits(dk, plain[0][1]) and _same_bits(dv, plain[0][2])
        assert _same_bits(out, plain[1][0]) and _same_bits(lse, plain[1][1])
        assert bool(cupy.allclose(dq.astype(cupy.float32), plain[0][0].astype(cupy.float32), rtol=1e-2, atol=1e-2))
    entries = {plan.entry: plan for plan in _memo._memo.values()}
    for entry in ("attention_backward", "attention_varlen"):
        plan = entries[entry]
        assert len(plan.steps) >= 2 and getattr(plan._graphs, "by_stream", None), f"{entry} ran no graph"

