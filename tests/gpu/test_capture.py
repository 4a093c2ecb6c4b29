"""CUDA graph capture of every entry point, and dropout drawing a fresh, reproducible mask per replay.

Each entry point (attention, attention_forward, attention_backward, attention_varlen and its
backward, decode on contiguous and paged caches with an append, merge_states) is captured once on a
fresh non-blocking stream after a warm-up call on another stream (none for a planned call), through :func:`cuflash.plan` and as a plain call, with
the outputs given (``out=``, ``lse=``, ``dq=`` ...) and, where the call can allocate them, without.
Then, twice: NEW random data (and new index values: cu_seqlens, cache_seqlens, block_table) goes
into the same input buffers, the outputs are poisoned with NaN, CuPy's pool gives every free block
back to the driver (a replay that used memory a call had freed would fault), the graph is replayed,
and its results must equal, bit for bit, an uncaptured call on the same data, and the float64
reference under the accuracy rule of tests/gpu/test_attention.py where that is cheap. Backward calls
use deterministic=True (atomic dQ sums in a different order would differ in the last bits).

Dropout: a captured forward (each forward family: fwd_sm90 where the GPU has it, fwd_sm80,
fwd_simt) is replayed three times; each replay's rng_state, a device array, must hold a new offset
(consecutive, from the generator's graph state), its output must be the float64 reference's with
that state and bitwise the uncaptured forward's given that state, and a backward captured in the
same graph, reading the device rng_state, must equal the uncaptured backward given the same state.

Also: two graphs of one plan captured on two streams replay at the same time without sharing
words or temporaries, and so do two graphs captured on one stream (each captured call's state is
its own, kept as long as its graph); and calls that cannot be captured safely raise RuntimeError
(a copied operand, check=True).
"""

from __future__ import annotations

import contextlib
import importlib
import time

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

import cuflash  # noqa: E402
import cuflash.testing as tt  # noqa: E402
from cuflash import reference  # noqa: E402
from cuflash.reference import attention_backward as reference_backward  # noqa: E402

pytestmark = pytest.mark.gpu

backward_module = importlib.import_module("cuflash.backward")

ATTENTION = dict(B=2, Sq=77, Sk=150, Hq=4, Hk=2, D=64)
FLOAT32_GRAD_RTOL = 1e-4


# ----------------------------------------------------------------------------- helpers

def _bits(x):
    """A CuPy array as unsigned integers of its item size (NaN payloads compare exactly)."""
    return x.view({1: cupy.uint8, 2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[x.dtype.itemsize])


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(cupy.array_equal(_bits(a), _bits(b)))


def _poison(x):
    """Fill x with a pattern of NaNs (payload = index % 64): an element a replay leaves unwritten
    fails the comparisons."""
    index = cupy.arange(x.size, dtype=cupy.uint32).reshape(x.shape) % 64
    if x.dtype.itemsize == 2:
        _bits(x)[...] = (index | 0x7FC0).astype(cupy.uint16)
    elif x.dtype.itemsize == 4:
        _bits(x)[...] = index | 0x7FC00000
    else:
        _bits(x)[...] = index.astype(cupy.uint64) | 0x7FF8000000000000
    return x


def _poisoned(shape, dtype):
    return _poison(cupy.empty(shape, dtype=dtype))


def _write(dst, src):
    """src's bits (NumPy or CuPy) into the device buffer dst of the same shape and dtype."""
    src = cupy.asarray(src)
    assert src.shape == dst.shape and src.dtype == dst.dtype
    _bits(dst)[...] = _bits(src)


def _qkv(seed, dtype, shape=ATTENTION):
    return tt.random_qkv(shape, dtype, seed, xp=cupy)


def _forced(family):
    """Force a forward family (and the matching backward one) for the block; None: the defaults."""
    if family is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(cuflash.force_kernel(family))
    stack.enter_context(backward_module.force_kernel(family.replace("fwd_", "bwd_")))
    return stack


def _entry(via, fn, args, arrays, options):
    """What the test calls with the arrays only: the plan of ``fn(*args, **arrays, **options)``
    (``via="plan"``), or ``fn`` with the (non-array) options bound (a plain call)."""
    if via == "plan":
        plan = cuflash.plan(fn, *args, **arrays, **options)
        assert isinstance(plan, cuflash.Plan)
        return plan
    return lambda *a, **kw: fn(*a, **kw, **options)


def _capture(stream, call):
    """call() once on ANOTHER, fresh stream (the warm-up torch's and CuPy's docs ask for: it plans
    the call and loads its kernels), then a capture of a second call on ``stream``, where no cuflash
    call ran before: the stream's words, the workspaces and a generator's graph state are made
    inside the capture. Returns (graph, what the captured call returned)."""
    cupy.cuda.Device().synchronize()
    elsewhere = cupy.cuda.Stream(non_blocking=True)
    with elsewhere:
        call()
    elsewhere.synchronize()
    with stream:
        stream.begin_capture()
        try:
            result = call()
        except BaseException:
            with contextlib.suppress(Exception):
                stream.end_capture()
            raise
        graph = stream.end_capture()
    return graph, result


def _replay(graph, stream):
    """Launch the graph once, after the new data is in place; memory the pool held for freed arrays
    goes back to the driver first, so that a replay using memory a call had freed faults."""
    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    graph.launch(stream)
    stream.synchronize()


def _refused(stream, call, match):
    """call() under capture must raise RuntimeError matching ``match`` (the capture then ended)."""
    cupy.cuda.Device().synchronize()
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(RuntimeError, match=match):
                call()
        finally:
            with contextlib.suppress(Exception):
                stream.end_capture()
    assert not stream.is_capturing()


def _check_attention(q, k, v, out, lse=None, **options):
    ref_out, ref_lse = reference.attention_forward(q, k, v, **options)
    dtype = np.dtype(q.dtype)
    base = tt.baseline_attention(q, k, v, **options) if dtype != np.float32 else None
    tt.assert_attention_close(out, ref_out, base, dtype=dtype, name="out")
    if lse is not None:
        tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")


# ----------------------------------------------------------------------------- forward

FAMILIES = [None, "fwd_sm80"]


@pytest.mark.parametrize("family", FAMILIES, ids=["default", "fwd_sm80"])
@pytest.mark.parametrize("via", ["plan", "call"])
def test_attention(via, family):
    """attention(out=): its lse is a temporary of the call, which the graph keeps using."""
    opts = dict(causal=True, softcap=20.0)
    rng = np.random.default_rng()
    q, k, v = _qkv(int(rng.integers(2**31)), "bfloat16")
    out = _poisoned(q.shape, q.dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    with _forced(family):
        fn = _entry(via, cuflash.attention, (q, k, v), dict(out=out), opts)
        graph, got = _capture(stream, lambda: fn(q, k, v, out=out))
        assert got is out
        for _ in range(2):
            new = _qkv(int(rng.integers(2**31)), "bfloat16")
            for dst, src in zip((q, k, v), new):
                _write(dst, src)
            _poison(out)
            _replay(graph, stream)
            want = cuflash.attention(*new, **opts)
            assert _same_bits(out, want), "the replay differs from an uncaptured call on the same data"
    _check_attention(q, k, v, out, **opts)


@pytest.mark.parametrize("outputs", ["given", "alloc"])
@pytest.mark.parametrize("via", ["plan", "call"])
def test_attention_forward(via, outputs):
    """attention_forward with out= and lse= given, or allocated by the captured call (the graph then
    writes the arrays that call returned)."""
    opts = dict(window=(40, 3))
    rng = np.random.default_rng()
    q, k, v = _qkv(int(rng.integers(2**31)), "float16")
    given = {}
    if outputs == "given":
        given = dict(out=_poisoned(q.shape, q.dtype), lse=_poisoned((2, 4, 77), np.float32))
    stream = cupy.cuda.Stream(non_blocking=True)
    fn = _entry(via, cuflash.attention_forward, (q, k, v), given, opts)
    graph, (out, lse, rng_state) = _capture(stream, lambda: fn(q, k, v, **given))
    assert rng_state is None
    if given:
        assert out is given["out"] and lse is given["lse"]
    for _ in range(2):
        new = _qkv(int(rng.integers(2**31)), "float16")
        for dst, src in zip((q, k, v), new):
            _write(dst, src)
        _poison(out)
        _poison(lse)
        _replay(graph, stream)
        want_out, want_lse, _ = cuflash.attention_forward(*new, **opts)
        assert _same_bits(out, want_out) and _same_bits(lse, want_lse)
    _check_attention(q, k, v, out, lse, **opts)


# ----------------------------------------------------------------------------- backward

def _backward_inputs(rng, dtype, q, k, v, dout, out, lse, **opts):
    """New q, k, v, dout into the buffers, and the forward's out and lse of them (uncaptured)."""
    for dst, src in zip((q, k, v), _qkv(int(rng.integers(2**31)), dtype)):
        _write(dst, src)
    _write(dout, tt.normal_data(rng, dout.shape, dtype))
    cuflash.attention_forward(q, k, v, out=out, lse=lse, **opts)


@pytest.mark.parametrize("grads", ["given", "alloc"])
@pytest.mark.parametrize("via", ["plan", "call"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_attention_backward(dtype, via, grads):
    """attention_backward (dq, dk, dv given or allocated): its temporaries (lse2, dsum, dq_accum,
    split partials) are kept by the plan or the stream."""
    fwd_opts = dict(causal=True)
    opts = dict(fwd_opts, deterministic=True)
    rng = np.random.default_rng()
    q, k, v = _qkv(int(rng.integers(2**31)), dtype)
    dout = cupy.empty(q.shape, dtype=q.dtype)
    out, lse = cupy.empty(q.shape, dtype=q.dtype), cupy.empty((2, 4, 77), dtype=np.float32)
    _backward_inputs(rng, dtype, q, k, v, dout, out, lse, **fwd_opts)
    given = {}
    if grads == "given":
        given = dict(dq=_poisoned(q.shape, q.dtype), dk=_poisoned(k.shape, k.dtype), dv=_poisoned(v.shape, v.dtype))
    stream = cupy.cuda.Stream(non_blocking=True)
    fn = _entry(via, cuflash.attention_backward, (dout, q, k, v, out, lse), given, opts)
    graph, got = _capture(stream, lambda: fn(dout, q, k, v, out, lse, **given))
    if given:
        assert all(g is b for g, b in zip(got, (given["dq"], given["dk"], given["dv"])))
    for _ in range(2):
        _backward_inputs(rng, dtype, q, k, v, dout, out, lse, **fwd_opts)
        for g in got:
            _poison(g)
        _replay(graph, stream)
        want = cuflash.attention_backward(dout, q, k, v, out, lse, **opts)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            assert _same_bits(g, w), f"the replay's {name} differs from an uncaptured call on the same data"
    if dtype == "float32":
        ref = reference_backward(dout, q, k, v, **fwd_opts)
        for name, g, r in zip(("dq", "dk", "dv"), got, ref):
            tt.assert_attention_close(g, r, dtype="float32", rtol=FLOAT32_GRAD_RTOL, name=name)


# ----------------------------------------------------------------------------- varlen

CU = {1: (np.array([0, 30, 75, 95], np.int32), np.array([0, 50, 90, 130], np.int32)),
      2: (np.array([0, 40, 55, 95], np.int32), np.array([0, 45, 85, 130], np.int32)),
      3: (np.array([0, 20, 65, 95], np.int32), np.array([0, 30, 80, 130], np.int32))}
MAX_Q, MAX_K = 45, 50
VARLEN = dict(B=1, Sq=95, Sk=130, Hq=4, Hk=2, D=64)


def _varlen_qkv(rng, dtype):
    q, k, v = tt.random_qkv(VARLEN, dtype, int(rng.integers(2**31)), xp=cupy)
    return q[0], k[0], v[0]


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("via", ["plan", "call"])
def test_attention_varlen(via, return_lse):
    opts = dict(max_seqlen_q=MAX_Q, max_seqlen_k=MAX_K, causal=True, check=False, return_lse=return_lse)
    rng = np.random.default_rng()
    q, k, v = _varlen_qkv(rng, "bfloat16")
    cu_q, cu_k = (cupy.asarray(c) for c in CU[1])
    out = _poisoned(q.shape, q.dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    fn = _entry(via, cuflash.attention_varlen, (q, k, v, cu_q, cu_k), dict(out=out), opts)
    graph, got = _capture(stream, lambda: fn(q, k, v, cu_q, cu_k, out=out))
    got_out, got_lse = got if return_lse else (got, None)
    assert got_out is out
    for n in (2, 3):
        new = _varlen_qkv(rng, "bfloat16")
        for dst, src in zip((q, k, v), new):
            _write(dst, src)
        _write(cu_q, CU[n][0])       # new sequence boundaries, same totals
        _write(cu_k, CU[n][1])
        _poison(out)
        if got_lse is not None:
            _poison(got_lse)
        _replay(graph, stream)
        want = cuflash.attention_varlen(*new, cupy.asarray(CU[n][0]), cupy.asarray(CU[n][1]), **opts)
        want_out, want_lse = want if return_lse else (want, None)
        assert _same_bits(out, want_out)
        if return_lse:
            assert _same_bits(got_lse, want_lse)
        ref, _ = reference.attention_varlen(q, k, v, *CU[n], causal=True)
        base = tt.baseline_attention_varlen(q, k, v, *CU[n], causal=True)
        tt.assert_attention_close(out, ref, base, dtype=np.dtype(q.dtype), name="out")
    cuflash.check_errors()


@pytest.mark.parametrize("via", ["plan", "call"])
def test_attention_varlen_backward(via):
    fwd_opts = dict(max_seqlen_q=MAX_Q, max_seqlen_k=MAX_K, causal=True, check=False)
    opts = dict(fwd_opts, deterministic=True)
    rng = np.random.default_rng()
    q, k, v = _varlen_qkv(rng, "float16")
    dout, out = cupy.empty(q.shape, dtype=q.dtype), cupy.empty(q.shape, dtype=q.dtype)
    lse = cupy.empty((4, 95), dtype=np.float32)
    cu_q, cu_k = (cupy.asarray(c) for c in CU[1])

    def new_inputs(n):
        for dst, src in zip((q, k, v), _varlen_qkv(rng, "float16")):
            _write(dst, src)
        _write(dout, tt.normal_data(rng, dout.shape, "float16"))
        _write(cu_q, CU[n][0])
        _write(cu_k, CU[n][1])
        _, new_lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, out=out, return_lse=True, **fwd_opts)
        _write(lse, new_lse)

    new_inputs(1)
    grads = tuple(_poisoned(x.shape, x.dtype) for x in (q, k, v))
    given = dict(zip(("dq", "dk", "dv"), grads))
    stream = cupy.cuda.Stream(non_blocking=True)
    fn = _entry(via, cuflash.attention_varlen_backward, (dout, q, k, v, out, lse, cu_q, cu_k), given, opts)
    graph, got = _capture(stream, lambda: fn(dout, q, k, v, out, lse, cu_q, cu_k, **given))
    assert all(g is b for g, b in zip(got, grads))
    for n in (2, 3):
        new_inputs(n)
        for g in grads:
            _poison(g)
        _replay(graph, stream)
        want = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cupy.asarray(CU[n][0]),
                                                 cupy.asarray(CU[n][1]), **opts)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            assert _same_bits(g, w), f"the replay's {name} differs from an uncaptured call on the same data"
    cuflash.check_errors()


# ----------------------------------------------------------------------------- decode

DECODE = dict(B=2, Hq=8, Hk=2, D=128, Sq=2, capacity=320, page_size=16, max_pages=20, num_pages=48)
DECODE_LENS = {1: (300, 77), 2: (250, 100), 3: (17, 261)}


def _check_decode(out, d, case):
    """out against the reference; the caches equal the case's plus the appended rows."""
    problems, k_after, v_after = reference._decode._decode_sequences(
        case["q"], case["k_cache"], case["v_cache"], cache_seqlens=case["lens"], block_table=case["table"],
        k_new=case["k_new"], v_new=case["v_new"])
    B, Sq, Hq, D = case["q"].shape
    ref = np.zeros((B, Sq, Hq, D))
    for b, p in enumerate(problems):
        ref[b] = reference.attention_forward(p["q"], p["k"], p["v"], **p["options"])[0][0]
    base = np.concatenate([tt.baseline_attention(p["q"], p["k"], p["v"], **p["options"]) for p in problems])
    tt.assert_attention_close(out, ref, base, dtype="bfloat16", name="out")
    for name, after in (("k_cache", k_after), ("v_cache", v_after)):
        assert _same_bits(d[name], cupy.asarray(after)), f"{name} is not the old cache plus the appended rows"


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("via", ["plan", "call"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode(paged, via, num_splits):
    """decode with an append (split-KV partials and split counters when num_splits > 1; index arrays
    checked on the GPU at every replay)."""
    rng = np.random.default_rng()
    cases = {n: tt.decode_case(rng, DECODE_LENS[n], paged=paged, append=True, dtype="bfloat16", **DECODE)
             for n in DECODE_LENS}
    d = tt.decode_on(cases[1], cupy)
    out = _poisoned(d["q"].shape, d["q"].dtype)
    opts = dict(num_splits=num_splits, check=False)
    stream = cupy.cuda.Stream(non_blocking=True)
    fn = _entry(via, cuflash.decode, (d["q"], d["k_cache"], d["v_cache"]), dict(out=out, **tt.decode_kwargs(d)), opts)
    graph, got = _capture(stream, lambda: fn(d["q"], d["k_cache"], d["v_cache"], out=out, **tt.decode_kwargs(d)))
    assert got is out
    for n in (2, 3):
        for name in tt.DECODE_ARRAYS:
            if d[name] is not None:
                _write(d[name], cases[n][name])   # new tokens, lengths and pages; the cache reset to the case's
        _poison(out)
        _replay(graph, stream)
        w = tt.decode_on(cases[n], cupy)
        want = cuflash.decode(w["q"], w["k_cache"], w["v_cache"], **tt.decode_kwargs(w), **opts)
        assert _same_bits(out, want), "the replay differs from an uncaptured call on the same data"
        assert _same_bits(d["k_cache"], w["k_cache"]) and _same_bits(d["v_cache"], w["v_cache"])
        _check_decode(out, d, cases[n])
    cuflash.check_errors()


# ----------------------------------------------------------------------------- merge

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("via", ["plan", "call"])
def test_merge_states(via, dtype):
    rng = np.random.default_rng()
    n, b, s, h, d = 3, 2, 5, 4, 64

    def new_states():
        outs = tt.normal_data(rng, (n, b, s, h, d), dtype)
        lses = (3 * rng.standard_normal((n, b, h, s))).astype(np.float32)
        lses[lses == 0] = 1
        lses[0, 0, 0, 0] = -np.inf   # a part that saw no key
        return outs, lses

    outs_h, lses_h = new_states()
    outs, lses = cupy.asarray(outs_h), cupy.asarray(lses_h)
    out, lse = _poisoned((b, s, h, d), outs.dtype), _poisoned((b, h, s), np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    fn = _entry(via, cuflash.merge_states, (outs, lses), dict(out=out, lse=lse), {})
    graph, got = _capture(stream, lambda: fn(outs, lses, out=out, lse=lse))
    assert got[0] is out and got[1] is lse
    for _ in range(2):
        outs_h, lses_h = new_states()
        _write(outs, outs_h)
        _write(lses, lses_h)
        _poison(out)
        _poison(lse)
        _replay(graph, stream)
        want_out, want_lse = cuflash.merge_states(cupy.asarray(outs_h), cupy.asarray(lses_h))
        assert _same_bits(out, want_out) and _same_bits(lse, want_lse)
        ref_out, ref_lse = reference.merge_states(outs_h, lses_h)
        atol = 1e-2 if dtype == "bfloat16" else 1e-5
        np.testing.assert_allclose(cupy.asnumpy(out).astype(np.float64), ref_out, rtol=atol, atol=atol)
        np.testing.assert_allclose(cupy.asnumpy(lse), ref_lse, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- dropout

# (dtype, forward family): fwd_sm90 runs where the GPU has it (None = the default family).
DROPOUT_CASES = [("bfloat16", None), ("bfloat16", "fwd_sm80"), ("float32", None)]
DROPOUT_P = 0.3


@pytest.mark.parametrize("via", ["plan", "call"])
@pytest.mark.parametrize("dtype, family", DROPOUT_CASES, ids=["default", "fwd_sm80", "float32"])
def test_dropout_draws_a_fresh_reproducible_mask_per_replay(dtype, family, via):
    """A forward and its backward captured in one graph, replayed three times on new data."""
    opts = dict(causal=True, dropout_p=DROPOUT_P)
    rng = np.random.default_rng()
    seed = int(rng.integers(2**63))
    generator = cuflash.Generator(seed)
    generator.next_state()                         # a host draw before: the graph state starts above it
    q, k, v = _qkv(int(rng.integers(2**31)), dtype)
    dout = cupy.asarray(tt.normal_data(rng, q.shape, dtype))
    out, lse = _poisoned(q.shape, q.dtype), _poisoned((2, 4, 77), np.float32)
    grads = tuple(_poisoned(x.shape, x.dtype) for x in (q, k, v))
    stream = cupy.cuda.Stream(non_blocking=True)
    with _forced(family):
        forward = _entry(via, cuflash.attention_forward, (q, k, v), dict(out=out, lse=lse),
                         dict(generator=generator, **opts))
        device = cupy.cuda.runtime.getDevice()
        if via == "plan":
            assert generator._graph_state(device) is not None, "cuflash.plan made no graph state"
        else:
            assert generator._graph_state(device) is None
        # The graph state starts 2**31 above the host offset of the moment it is made: at the plan
        # (one host draw so far), or at the first capture (after the warm-up's host draw too).
        start = (1 if via == "plan" else 2) + 2**31 + device * cuflash.random.graph_offsets()
        backward = _entry(via, cuflash.attention_backward, (dout, q, k, v, out, lse),
                          dict(rng_state=np.array([1, 2], dtype=np.uint64), dq=grads[0], dk=grads[1], dv=grads[2]),
                          dict(deterministic=True, **opts))
        states = []

        def step():
            _, _, state = forward(q, k, v, out=out, lse=lse)
            states.append(state)
            backward(dout, q, k, v, out, lse, rng_state=state, dq=grads[0], dk=grads[1], dv=grads[2])

        graph, _ = _capture(stream, step)
        words = generator._graph_state(device)
        assert words is not None, "the capture made no graph state"
        assert words.get().tolist() == [seed, start], "the graph state starts 2**31 above the host offset"
        warm, captured = states
        assert isinstance(warm, np.ndarray), "the uncaptured warm-up draws on the host"
        assert isinstance(captured, cupy.ndarray) and captured.dtype == np.uint64 and captured.shape == (2,)
        host_offset = generator.offset
        seen = []
        for r in range(3):
            new = _qkv(int(rng.integers(2**31)), dtype)
            for dst, src in zip((q, k, v), new):
                _write(dst, src)
            _write(dout, tt.normal_data(rng, dout.shape, dtype))
            for x in (out, lse, *grads):
                _poison(x)
            _replay(graph, stream)
            state = captured.get()
            assert state.tolist() == [seed, start + r], f"replay {r} did not take the graph state's next offset"
            seen.append(int(state[1]))
            assert int(words.get()[1]) == start + r + 1
            # The uncaptured forward given that state (seed and offset by value) is the same, bit for bit.
            replay_gen = cuflash.Generator(0)
            replay_gen.set_state(state)
            want_out, want_lse, want_state = cuflash.attention_forward(*new, generator=replay_gen, **opts)
            assert want_state.tolist() == state.tolist()
            assert _same_bits(out, want_out) and _same_bits(lse, want_lse), \
                f"replay {r}: the forward differs from an uncaptured one with its rng_state"
            _check_attention(q, k, v, out, lse, rng_state=state, **opts)
            # The backward read the device state of this replay: the uncaptured backward given it
            # (on the host, and on the GPU) computes the same.
            for given in (state, cupy.asarray(state)):
                want = cuflash.attention_backward(dout, q, k, v, out, lse, rng_state=given, deterministic=True,
                                                  **opts)
                for name, g, w in zip(("dq", "dk", "dv"), grads, want):
                    assert _same_bits(g, w), f"replay {r}: {name} differs from the uncaptured backward"
        assert len(set(seen)) == 3, "two replays used one offset"
        assert generator.offset == host_offset, "replays moved the host offset"
        assert generator.next_state().tolist() == [seed, host_offset], "the host draws went on where they were"


def test_dropout_of_attention_varies_per_replay():
    """attention() does not return its state: it is drawn into the stream's scratch words, the
    graph state still advancing per replay."""
    opts = dict(dropout_p=0.5)
    rng = np.random.default_rng()
    generator = cuflash.Generator(int(rng.integers(2**63)))
    q, k, v = _qkv(int(rng.integers(2**31)), "float16")
    out = _poisoned(q.shape, q.dtype)
    stream = cupy.cuda.Stream(non_blocking=True)
    graph, _ = _capture(stream, lambda: cuflash.attention(q, k, v, out=out, generator=generator, **opts))
    words = generator._graph_state(cupy.cuda.runtime.getDevice())   # made by the capture
    results = []
    for _ in range(2):
        state = words.get()
        _poison(out)
        _replay(graph, stream)          # the same data: only the mask changes
        replay_gen = cuflash.Generator(0)
        replay_gen.set_state(state)
        want = cuflash.attention(q, k, v, generator=replay_gen, **opts)
        assert _same_bits(out, want)
        results.append(out.copy())
    assert not _same_bits(results[0], results[1]), "two replays drew one mask"


# ----------------------------------------------------------------------------- streams

def _replay_at_once(graphs, streams, outputs):
    """Poison the outputs, then launch each graph on its stream back to back, and wait for all."""
    for x in outputs:
        _poison(x)
    cupy.cuda.Device().synchronize()
    for graph, stream in zip(graphs, streams):
        graph.launch(stream)
    for stream in streams:
        stream.synchronize()


def test_graphs_captured_on_two_streams_replay_at_once():
    """One plan captured on two streams: each graph has its stream's words (fwd_sm90's work counter)
    and temporaries, so the two can run at the same time."""
    rng = np.random.default_rng()
    opts = dict(causal=True)
    sets = [_qkv(int(rng.integers(2**31)), "bfloat16") for _ in range(2)]
    outs = [_poisoned(sets[0][0].shape, sets[0][0].dtype) for _ in range(2)]
    plan = cuflash.plan(cuflash.attention, *sets[0], out=outs[0], **opts)
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    graphs = [_capture(s, lambda i=i: plan(*sets[i], out=outs[i]))[0] for i, s in enumerate(streams)]
    for _ in range(3):
        news = [_qkv(int(rng.integers(2**31)), "bfloat16") for _ in range(2)]
        for arrays, new in zip(sets, news):
            for dst, src in zip(arrays, new):
                _write(dst, src)
        _replay_at_once(graphs, streams, outs)
        for out, new in zip(outs, news):
            assert _same_bits(out, cuflash.attention(*new, **opts))


def test_graphs_captured_on_one_stream_replay_at_once():
    """Two graphs captured on one stream, replayed at the same time on two others (as XLA may run two
    calls of its graph that share no buffer): each captured call has its own words (fwd_sm90's work
    counter, decode's split counters) and temporaries (decode's split partials), so neither corrupts
    the other. Many short rounds, so that the launches overlap."""
    rng = np.random.default_rng()
    case_args = dict(paged=False, append=False, dtype="bfloat16", **DECODE)
    cases = [tt.decode_case(rng, DECODE_LENS[n], **case_args) for n in (1, 2)]
    decodes = [tt.decode_on(c, cupy) for c in cases]
    sets = [_qkv(int(rng.integers(2**31)), "bfloat16") for _ in range(2)]
    outs = [_poisoned(sets[0][0].shape, sets[0][0].dtype) for _ in range(2)]
    decode_outs = [_poisoned(d["q"].shape, d["q"].dtype) for d in decodes]
    opts = dict(causal=True)

    def call(i):
        cuflash.attention(*sets[i], out=outs[i], **opts)
        d = decodes[i]
        cuflash.decode(d["q"], d["k_cache"], d["v_cache"], out=decode_outs[i], num_splits=4, check=False,
                       **tt.decode_kwargs(d))

    capturing = cupy.cuda.Stream(non_blocking=True)
    graphs = [_capture(capturing, lambda i=i: call(i))[0] for i in range(2)]
    want = [cuflash.attention(*x, **opts) for x in sets]
    want_decode = [cuflash.decode(d["q"], d["k_cache"], d["v_cache"], num_splits=4, **tt.decode_kwargs(d))
                   for d in decodes]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    for _ in range(20):
        _replay_at_once(graphs, streams, outs + decode_outs)
        for i in range(2):
            assert _same_bits(outs[i], want[i]), "a forward replayed beside another graph differs"
            assert _same_bits(decode_outs[i], want_decode[i]), "a decode replayed beside another graph differs"
    cuflash.check_errors()


def test_a_captured_calls_state_lives_as_long_as_its_graph():
    """The state a captured call owns is kept while its graph exists and dropped once the graph is
    destroyed (CUDA's user object, released after the graph's launches)."""
    from cuflash._runtime import graph_lifetime

    rng = np.random.default_rng()
    q, k, v = _qkv(int(rng.integers(2**31)), "bfloat16")
    out = _poisoned(q.shape, q.dtype)
    before = graph_lifetime.kept_count()
    stream = cupy.cuda.Stream(non_blocking=True)
    graph, _ = _capture(stream, lambda: cuflash.attention(q, k, v, out=out))
    assert graph_lifetime.kept_count() == before + 1
    _replay(graph, stream)
    assert _same_bits(out, cuflash.attention(q, k, v))
    del graph
    cupy.cuda.Device().synchronize()
    for _ in range(200):   # the destructor runs on a CUDA thread, soon after
        if graph_lifetime.kept_count() == before:
            break
        time.sleep(0.005)
    assert graph_lifetime.kept_count() == before, "the destroyed graph's state was not released"


# ----------------------------------------------------------------------------- refusals

def test_calls_that_cannot_be_captured_say_so():
    rng = np.random.default_rng()
    q, k, v = _qkv(int(rng.integers(2**31)), "bfloat16")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuflash.attention(q, k, v)            # the stream's words exist: only the call is refused
        stream.synchronize()
    # A copied operand: a head dim that is not a multiple of 8 is padded into a copy.
    qx, kx, vx = (cupy.ascontiguousarray(x[..., :58]) for x in (q, k, v))
    _refused(stream, lambda: cuflash.attention(qx, kx, vx), "cannot be captured.*copies")
    # A merge of a list of states (stacked into a copy).
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    _refused(stream, lambda: cuflash.merge_states([out, out], [lse, lse]), "copies")
    # check=True waits for the GPU.
    cu_q, cu_k = (cupy.asarray(c) for c in CU[1])
    vq, vk, vv = _varlen_qkv(rng, "bfloat16")
    with stream:
        cuflash.attention_varlen(vq, vk, vv, cu_q, cu_k, max_seqlen_q=MAX_Q, max_seqlen_k=MAX_K)
    _refused(stream, lambda: cuflash.attention_varlen(vq, vk, vv, cu_q, cu_k, max_seqlen_q=MAX_Q,
                                                      max_seqlen_k=MAX_K, check=True), "check=True")
    cuflash.check_errors()


def test_a_planned_call_needs_no_warm_up_at_all():
    """cuflash.plan outside, then a capture on a fresh stream with no cuflash call before anywhere
    for these shapes: the plan's workspace and the stream's words are made inside the capture;
    several graphs on one stream, replayed one after the other, each match an uncaptured call."""
    rng = np.random.default_rng()
    opts = dict(causal=True)
    shape = dict(ATTENTION, Sq=int(rng.integers(40, 90)), Sk=int(rng.integers(100, 200)))
    sets = [_qkv(int(rng.integers(2**31)), "bfloat16", shape) for _ in range(2)]
    outs = [_poisoned(sets[0][0].shape, sets[0][0].dtype) for _ in range(2)]
    lses = [_poisoned((shape["B"], shape["Hq"], shape["Sq"]), np.float32) for _ in range(2)]
    plan = cuflash.plan(cuflash.attention_forward, *sets[0], out=outs[0], lse=lses[0], **opts)
    stream = cupy.cuda.Stream(non_blocking=True)
    graphs = []
    with stream:
        for i in range(2):   # two graphs captured on one stream
            stream.begin_capture()
            plan(*sets[i], out=outs[i], lse=lses[i])
            graphs.append(stream.end_capture())
    for _ in range(2):
        news = [_qkv(int(rng.integers(2**31)), "bfloat16", shape) for _ in range(2)]
        for arrays, new in zip(sets, news):
            for dst, src in zip(arrays, new):
                _write(dst, src)
        for x in (*outs, *lses):
            _poison(x)
        for graph in graphs:
            _replay(graph, stream)
        for out, lse, new in zip(outs, lses, news):
            want_out, want_lse, _ = cuflash.attention_forward(*new, **opts)
            assert _same_bits(out, want_out) and _same_bits(lse, want_lse)
