"""Faults (issue 17): every bad argument is refused before any launch, with a TypeError or ValueError
that names it, and nothing the caller passed in (``out=`` buffers, caches, inputs) is written.

- CPU: the bound of each option against the params field it is packed into (window, block_size,
  scale, softcap), the packing's own safety net, the cache layouts that decode accepts for appends,
  host index lists, and the hypothesis fuzz of every entry point on stand-in arrays (an address, a
  shape, strides and a dtype, no memory; CuPy faked as in tests/cpu/test_host_path.py): the checks
  run before anything needs a GPU, so a check that is missing lets the call reach one and fail.
- GPU: the same fuzz on CuPy arrays, where every byte of every argument must also be as it was
  (outputs poisoned with NaN), and the layouts that must keep working (K/V caches interleaved in one
  allocation, a cache shared or broadcast when nothing is appended, windows wider than int32 needs).

Aliasing is checked on a call's full path (the first call of a layout): the fuzz clears the memo of
plans before each call, so that a plan remembered by another test is not replayed unchecked.
"""

import math
import re
import struct
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import _checks
from cuflash._runtime import launch as _launch, memo as _memo, params as _params, plan as _plan

BF16 = _checks.BFLOAT16
FLOATS = (np.dtype(np.float16), BF16, np.dtype(np.float32))
F32 = np.dtype(np.float32)
NAN = float("nan")
INT32_MAX = 2**31 - 1

# A @given test that takes function-scoped fixtures (monkeypatch) patches the same thing at every example.
FIXTURES_OK = settings(suppress_health_check=list(settings.default.suppress_health_check)
                       + [HealthCheck.function_scoped_fixture])


def c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.insert(0, step)
        step *= max(n, 1)
    return tuple(strides)


def names_in(message, names):
    for name in names:
        assert re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message), \
            f"the message does not name {name!r}: {message!r}"


# ----------------------------------------------------------------------------- option bounds (CPU)

@pytest.mark.parametrize("window, exc", [((2**31, 0), ValueError), ((0, 2**40), ValueError),
                                         ((2**63, 2**63), ValueError), ((-2, 0), ValueError),
                                         ((1.5, 0), TypeError), ((3,), ValueError), ("wide", ValueError)])
def test_window_out_of_range_is_refused(window, exc):
    with pytest.raises(exc, match="window"):
        _checks.check_window(window, False)
    with pytest.raises(exc, match="window"):
        _checks.check_options(head_dim=64, causal=True, scale=None, window=window, softcap=0.0, dropout_p=0.0,
                              generator=None, seqlens=(5, 9))


def _visible(i, sq, sk, left, right):
    """[first, last] keys of query row i (Python ints: no overflow), as docs/design.md defines the window."""
    center = i + sk - sq
    first = 0 if left < 0 else max(0, center - left)
    last = sk - 1 if right < 0 else min(sk - 1, center + right)
    return first, last


@given(sq=st.integers(1, 2**30), sk=st.integers(1, 2**30), causal=st.booleans(),
       left=st.one_of(st.just(-1), st.integers(0, 64), st.integers(0, INT32_MAX)),
       right=st.one_of(st.just(-1), st.integers(0, 64), st.integers(0, INT32_MAX)), row=st.floats(0, 1))
def test_window_is_cut_to_the_same_attention_within_int32(sq, sk, causal, left, right, row):
    plain = _checks.check_window((left, right), causal)
    cut = _checks.check_window((left, right), causal, (sq, sk))
    for i in {0, sq - 1, int(row * (sq - 1))}:
        assert _visible(i, sq, sk, *cut) == _visible(i, sq, sk, *plain), f"row {i} sees other keys"
    # What cuda_src/mask.cuh computes in int (visible_keys, and the backward's visible rows) stays in
    # int32 when sq + sk does, which every call's shape check requires (_checks: "positions are int32
    # in the kernels"); sq = sk = 2**30 is refused there and would overflow here.
    diag, l, r = sk - sq, *cut
    _params.FWD.pack({"window_left": l, "window_right": r})
    if sq + sk > INT32_MAX:
        return
    if l >= 0:
        assert -2**31 <= 0 + diag - l and sq + diag - 1 + l + 1 <= INT32_MAX
    if r >= 0:
        assert sq - 1 + diag + r + 1 <= INT32_MAX and -2**31 <= 0 - diag - r


def test_window_cut_keeps_causal_and_unbounded():
    assert _checks.check_window(None, True, (7, 9)) == (-1, 0)
    assert _checks.check_window((INT32_MAX, INT32_MAX), False, (7, 9)) == (8, 6)
    assert _checks.check_window((3, 2), False, (7, 9)) == (3, 2)
    assert _checks.check_window((INT32_MAX, 5), True, (7, 9)) == (8, 0)


@pytest.mark.parametrize("block_size", [(0, 16), (2**31, 1), (16, 2**40), (16,), (16, -1), (16, 1.0), (True, 16)])
def test_block_size_out_of_range_is_refused(block_size):
    with pytest.raises(ValueError, match="block_size"):
        _checks.check_block_size(block_size)


def test_block_size_limits_are_accepted():
    assert _checks.check_block_size((1, INT32_MAX)) == (1, INT32_MAX)
    _params.FWD.pack({"block_q": 1, "block_k": INT32_MAX})


NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70),
                    st.sampled_from([0.0, 1e-45, 1e-39, 1.1754944e-38, 2.3e38, 2.4e38, 3.4028235e38, 3.5e38, 1e300]))


@given(value=NUMBERS)
def test_scale_and_softcap_are_refused_or_pack(value):
    """Every value the checks accept packs into FwdParams (float32: scale, scale * log2(e), softcap)
    without an error; every other value is a ValueError naming the option. A softcap > 0 never
    reaches the kernels as 0 (the cap silently off)."""
    for name, check in (("scale", lambda x: _checks.check_scale(x, 64)), ("softcap", _checks.check_softcap)):
        try:
            checked = check(value)
        except ValueError as exc:
            names_in(str(exc), [name])
            continue
        fields = {"scale": checked, "scale_log2": checked * math.log2(math.e)} if name == "scale" else {name: checked}
        packed = _params.FWD.unpack(_params.FWD.pack(fields))
        assert math.isfinite(packed[name])
        assert (packed[name] > 0) == (checked > 0), f"{name}={value!r} reaches the kernels as {packed[name]}"


def test_scale_and_softcap_types():
    # (scale=None is the default 1/sqrt(D); softcap has no None.)
    for name, check, bads in (("scale", lambda x: _checks.check_scale(x, 64), ("0.1", True, [1.0])),
                              ("softcap", _checks.check_softcap, ("1", True, None, [1.0]))):
        for bad in bads:
            with pytest.raises(TypeError, match=name):
                check(bad)


# ----------------------------------------------------------------------------- the packing's safety net (CPU)

LAYOUTS = {"FWD": _params.FWD, "BWD": _params.BWD, "CONVERT": _params.CONVERT, "DECODE": _params.DECODE,
           "MERGE": _params.MERGE, "CHECK": _params.CHECK}
_PAST = {"i": [2**31, -2**31 - 1, 2**40], "I": [2**32, -1], "q": [2**63, -2**63 - 1], "Q": [2**64, -1],
         "f": [1e39, -1e300, 3.5e38]}


@given(data=st.data())
def test_packing_names_a_field_out_of_range(data):
    layout = LAYOUTS[data.draw(st.sampled_from(sorted(LAYOUTS)))]
    field = data.draw(st.sampled_from([name for name, _, _ in layout.fields]))
    value = data.draw(st.sampled_from(_PAST[layout.codes[field]]))
    with pytest.raises(ValueError) as info:   # never struct.error or OverflowError
        layout.pack({field: value})
    names_in(str(info.value), [field])
    assert type(info.value) is ValueError and not isinstance(info.value, struct.error)


def test_template_of_a_plan_refuses_an_oversized_window():
    with pytest.raises(ValueError, match="window_left"):
        _params.Template(_params.FWD, {"window_left": 2**40}, {"q": 0})


# ----------------------------------------------------------------------------- cache layouts (CPU)

class Layout:
    """What the layout checks read of an array: address, shape, byte strides, item size."""

    def __init__(self, ptr, shape, strides, itemsize):
        self.data, self.itemsize = SimpleNamespace(ptr=ptr), itemsize
        self.shape, self.strides = tuple(shape), tuple(strides)
        self.size = math.prod(self.shape)


def of(a):
    """The Layout of a NumPy array (its real address and strides)."""
    return Layout(a.__array_interface__["data"][0], a.shape, a.strides, a.itemsize)


def _bytes(x):
    """Every byte address of every element (brute force, small arrays)."""
    offsets = np.zeros((1,), dtype=np.int64)
    for n, s in zip(x.shape, x.strides):
        offsets = (offsets[:, None] + s * np.arange(n)[None, :]).ravel()
    return x.data.ptr + offsets[:, None] + np.arange(x.itemsize)[None, :]


LAYOUT = st.integers(1, 3).flatmap(lambda ndim: st.tuples(
    st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim),
    st.lists(st.integers(-12, 12), min_size=ndim, max_size=ndim), st.sampled_from([1, 2, 4])))


@given(layout=LAYOUT)
def test_distinct_elements_is_sound(layout):
    shape, steps, itemsize = layout
    x = Layout(1 << 20, shape, [s * itemsize for s in steps], itemsize)
    if _checks.distinct_elements(x.shape, x.strides, x.itemsize):
        flat = _bytes(x).ravel()
        assert np.unique(flat).size == flat.size, f"{shape} {x.strides}: accepted, but elements share bytes"


@given(data=st.data())
def test_views_of_an_array_have_distinct_elements(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    a = np.zeros(shape, dtype=np.float16, order=data.draw(st.sampled_from("CF")))
    index = tuple(slice(data.draw(st.integers(0, n - 1)), None, data.draw(st.sampled_from([1, 2, 3, -1])))
                  for n in shape)
    view = a[index].transpose(data.draw(st.permutations(range(len(shape)))))
    assert _checks.distinct_elements(view.shape, view.strides, view.itemsize)


def _cache_verdict(k, v):
    try:
        _checks.check_cache_rows(k, v)
    except ValueError as exc:
        return str(exc)
    return None


def test_cache_layouts_for_appends():
    B, S, H, D = 3, 10, 4, 8
    k, v = np.zeros((B, S, H, D), np.float16), np.zeros((B, S, H, D), np.float16)
    kv = np.zeros((B, S, 2, H, D), np.float16)                    # one allocation, k and v interleaved
    pages = np.zeros((5, 2, 16, H, D), np.float16)                # FlashInfer's (pages, 2, page, H, D)
    bhsd = np.zeros((B, H, S, D), np.float16).transpose(0, 2, 1, 3)
    as_strided = np.lib.stride_tricks.as_strided
    accepted = [(k, v), (kv[:, :, 0], kv[:, :, 1]), (kv[:, :, 1], kv[:, :, 0]), (pages[:, 0], pages[:, 1]),
                (bhsd, v), (k[:, :5], k[:, 5:])]                  # the last: two halves of each sequence's rows
    for a, b in accepted:
        assert _cache_verdict(of(a), of(b)) is None, (a.strides, b.strides)
    overlapping = as_strided(k, strides=(S * H * D, H * D, 2 * D, 2))   # half-sized batch and row strides
    refused = {
        "k_cache and v_cache share memory": [(k, k), (kv[:, :, 0], kv[:, :, 0]), (k[:, 1:], k[:, :-1]),
                                             (k, as_strided(k, strides=(2 * S * H * D, 2 * D, 2 * S * D, 2)))],
        "k_cache has rows that share memory": [(np.broadcast_to(k[:1], k.shape), v), (overlapping, v)],
        "v_cache has rows that share memory": [(k, np.broadcast_to(v[:, :1], v.shape)), (v, overlapping)],
    }
    for message, cases in refused.items():
        for a, b in cases:
            verdict = _cache_verdict(of(a), of(b))
            assert verdict is not None and verdict.startswith(message), (a.strides, b.strides, verdict)


@given(data=st.data())
def test_cache_rows_check_is_sound(data):
    """Accepted pairs (any strides, any offset between them) share no byte, within or across caches."""
    shape = tuple(data.draw(st.lists(st.integers(1, 3), min_size=2, max_size=3)))
    itemsize = 2
    def strides():
        return [s * itemsize for s in data.draw(st.lists(st.integers(0, 30), min_size=len(shape), max_size=len(shape)))]
    ks = strides()
    vs = ks if data.draw(st.booleans()) else strides()
    k = Layout(1 << 20, shape, ks, itemsize)
    v = Layout((1 << 20) + itemsize * data.draw(st.integers(-40, 40)), shape, vs, itemsize)
    if _cache_verdict(k, v) is None:
        flat = np.concatenate([_bytes(k).ravel(), _bytes(v).ravel()])
        assert np.unique(flat).size == flat.size, f"accepted {ks} / {vs} at {v.data.ptr - k.data.ptr}"


# ----------------------------------------------------------------------------- index lists, sizes (CPU)

@pytest.mark.parametrize("values, exc", [([2**40, 1], ValueError), ([2**70], ValueError), ([-2**31 - 1], ValueError),
                                         ([1.5, 2], TypeError), ([True], TypeError), (["3"], TypeError),
                                         ([[1, 2], [3]], ValueError), ([None], TypeError)])
def test_host_index_lists_are_checked(values, exc):
    with pytest.raises(exc, match="cache_seqlens"):
        _checks.int32_operand(values, "cache_seqlens", 1)


@pytest.mark.parametrize("q, k, batch, lengths, varlen, name", [
    ((65536, 1, 1, 8), (65536, 1, 1, 8), 65536, (1, 1), False, r"\bq\b"),
    ((1, 1, 65536, 8), (1, 1, 1, 8), 1, (1, 1), False, r"\bq\b"),
    ((1, 2**31, 1, 8), (1, 1, 1, 8), 1, (2**31, 1), False, r"\bq\b"),
    ((1, 1, 1, 8), (1, 2**31, 1, 8), 1, (1, 2**31), False, r"\bk\b"),
    ((1, 2**30, 1, 8), (1, 2**30, 1, 8), 1, (2**30, 2**30), False, r"\bq\b.*\bk\b"),
    ((4, 1, 8), (4, 1, 8), 65536, (4, 4), True, "cu_seqlens_q"),
    ((2**31, 1, 8), (4, 1, 8), 1, (5, 4), True, r"\bq\b"),
    ((2**30, 1, 8), (2**30, 1, 8), 1, (2**30, 2**30), True, "max_seqlen_q"),
])
def test_problem_sizes_past_the_kernels(q, k, batch, lengths, varlen, name):
    with pytest.raises(ValueError, match=name):
        _checks.check_problem_size(SimpleNamespace(shape=q), SimpleNamespace(shape=k), batch=batch,
                                   seqlen_q=lengths[0], seqlen_k=lengths[1], varlen=varlen)
    # At the limits: 65535 sequences, 65535 * 32768 = 2**31 - 32768 rows.
    _checks.check_problem_size(SimpleNamespace(shape=(65535, 2, 16384, 8)), SimpleNamespace(shape=(65535, 2, 1, 8)),
                               batch=65535, seqlen_q=2, seqlen_k=2, varlen=False)


# ----------------------------------------------------------------------------- arrays for the fuzz

class StandIn:
    """A CuPy array as the argument checks see it: an address, shape, byte strides and dtype; no memory.
    ``room``: the bytes of its allocation from its address on (for overlapping views)."""

    def __init__(self, shape, dtype, ptr, strides=None, room=0):
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.strides = tuple(strides) if strides is not None else c_strides(self.shape, self.itemsize)
        self.ndim, self.size = len(self.shape), math.prod(self.shape)
        self.nbytes = self.size * self.itemsize
        self.data = SimpleNamespace(ptr=ptr, device_id=0)
        dense = c_strides(self.shape, self.itemsize)
        contiguous = all(s == c for n, s, c in zip(self.shape, self.strides, dense) if n > 1)
        self.flags = SimpleNamespace(c_contiguous=contiguous)
        self._c_contiguous = contiguous   # what the plan memo reads (cuflash/_runtime/memo.py, lookup)
        self.room = room

    def reshape(self, shape):
        """What broadcast_operand asks for: leading axes of length 1."""
        shape = tuple(shape)
        extra = len(shape) - self.ndim
        assert extra >= 0 and shape[extra:] == self.shape and set(shape[:extra]) <= {1}, (self.shape, shape)
        return StandIn(shape, self.dtype, self.data.ptr, (0,) * extra + self.strides, self.room)


class StandIns:
    """Arrays at made-up addresses (256-byte aligned allocations, random gaps between them)."""

    gpu = False

    def __init__(self, rng):
        self.rng, self.next = rng, 0x7F00_0000_0000

    def array(self, shape, dtype, values=None, poison=False):
        dtype = np.dtype(dtype)
        room = 2 * math.prod(shape) * dtype.itemsize + 256    # room for an overlapping view of the same size
        ptr, self.next = self.next, self.next + -(-room // 256) * 256 + 256 * int(self.rng.integers(1, 5))
        return StandIn(shape, dtype, ptr, room=room)

    def view(self, x, offset, shape, dtype, strides=None):
        return StandIn(shape, dtype, x.data.ptr + offset, strides, x.room - offset)

    @staticmethod
    def room(x):
        return x.room

    def snapshot(self):
        return None

    def cupy(self):
        """A CuPy module stand-in with what the checks call."""
        def asarray(x):
            x = np.asarray(x)
            return self.array(x.shape, x.dtype)

        def ascontiguousarray(x):
            return x if x.flags.c_contiguous else self.array(x.shape, x.dtype)

        def broadcast_to(x, shape):
            lead = len(shape) - x.ndim
            strides = [0] * lead + [s if n == m else 0 for n, m, s in zip(x.shape, shape[lead:], x.strides)]
            return StandIn(shape, x.dtype, x.data.ptr, strides, x.room)

        runtime = SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1)
        return SimpleNamespace(ndarray=StandIn, asarray=asarray, ascontiguousarray=ascontiguousarray,
                               broadcast_to=broadcast_to, cuda=SimpleNamespace(runtime=runtime))


class Device:
    """CuPy arrays, each in an allocation of its own with room for an overlapping view; fresh random
    values (outputs poisoned with NaN); ``snapshot`` copies every allocation's bytes to the host."""

    gpu = True

    def __init__(self, cupy, rng):
        self.cp, self.rng, self.bases = cupy, rng, []

    def array(self, shape, dtype, values=None, poison=False):
        cp, dtype, shape = self.cp, np.dtype(dtype), tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        base = cp.asarray(self.rng.integers(0, 256, 2 * nbytes + 256, dtype=np.uint8))
        self.bases.append(base)
        if values is None:
            if dtype == np.bool_:
                values = self.rng.random(shape) < 0.8
            elif dtype.kind in "iu":
                values = self.rng.integers(0, 4, shape)
            else:
                values = np.full(shape, NAN) if poison else self.rng.standard_normal(shape)
        host = np.ascontiguousarray(np.asarray(values).astype(dtype).reshape(shape))
        base[:nbytes] = cp.asarray(host.reshape(-1).view(np.uint8))
        return cp.ndarray(shape, dtype, memptr=base.data)

    def view(self, x, offset, shape, dtype, strides=None):
        return self.cp.ndarray(shape, dtype, memptr=x.data + offset, strides=strides)

    @staticmethod
    def room(x):
        return x.data.mem.ptr + x.data.mem.size - x.data.ptr

    def snapshot(self):
        self.cp.cuda.get_current_stream().synchronize()
        return [base.get() for base in self.bases]


def spread(xp, shape, dtype):
    """A huge array over little memory: zero strides, but for a short last axis (a head dim), which
    stays contiguous as the kernels want it."""
    itemsize = np.dtype(dtype).itemsize
    if shape[-1] <= 256:
        return xp.view(xp.array(shape[-1:], dtype), 0, shape, dtype, (0,) * (len(shape) - 1) + (itemsize,))
    return xp.view(xp.array((1,), dtype), 0, shape, dtype, (0,) * len(shape))


# ----------------------------------------------------------------------------- valid calls

class Call:
    """One call of an entry point: its arguments by name, which are positional, which are outputs,
    and for each array argument a shape that is wrong for it alone."""

    def __init__(self, fn, positional, args, outputs, bad_shapes):
        self.fn, self.positional, self.args = fn, positional, args
        self.outputs, self.bad_shapes = outputs, bad_shapes

    def __call__(self):
        fn = getattr(cuflash, self.fn)
        keywords = {n: v for n, v in self.args.items() if n not in self.positional}
        return fn(*[self.args[n] for n in self.positional], **keywords)

    def arrays(self):
        """Names of the arguments that are device arrays."""
        return [n for n, v in self.args.items() if hasattr(v, "strides") and not isinstance(v, np.ndarray)]


def _sizes(draw):
    hk, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    return SimpleNamespace(dtype=draw(st.sampled_from(FLOATS)), b=draw(st.integers(1, 3)), sq=draw(st.integers(1, 24)),
                           sk=draw(st.integers(1, 24)), hk=hk, hq=hk * group, d=draw(st.sampled_from([8, 24, 40, 64])))


def build_dense(draw, xp, entry):
    n = _sizes(draw)
    dt, b, sq, sk, hq, hk, d = n.dtype, n.b, n.sq, n.sk, n.hq, n.hk, n.d
    backward = entry == "attention_backward"
    a, bad = {}, {}
    if backward:
        a["dout"], bad["dout"] = xp.array((b, sq, hq, d), dt), (b, sq + 1, hq, d)
    a["q"], bad["q"] = xp.array((b, sq, hq, d), dt), (2, b, sq, hq, d)
    a["k"], bad["k"] = xp.array((b, sk, hk, d), dt), (b, sk, hk, d + 8)
    a["v"], bad["v"] = xp.array((b, sk, hk, d), dt), (b, sk + 1, hk, d)
    if backward:
        a["out"], bad["out"] = xp.array((b, sq, hq, d), dt), (b, sq + 1, hq, d)
        a["lse"], bad["lse"] = xp.array((b, hq, sq), F32), (b, hq, sq + 1)
    a["causal"] = draw(st.booleans())
    if draw(st.booleans()):
        a["alibi_slopes"], bad["alibi_slopes"] = xp.array(draw(st.sampled_from([(hq,), (b, hq)])), F32), (hq + 1,)
    if draw(st.booleans()):
        a["mask"], bad["mask"] = xp.array(draw(st.sampled_from([(sq, sk), (b, 1, sq, sk), (1, hq, 1, sk)])), bool), \
            (b, hq, sq + 1, sk)
    if draw(st.booleans()):
        a["bias"], bad["bias"] = xp.array(draw(st.sampled_from([(sq, sk), (b, hq, sq, sk)])),
                                          draw(st.sampled_from([F32, dt]))), (b, hq, sq, sk + 1)
    if draw(st.booleans()):
        bq, bk = draw(st.sampled_from([(16, 16), (8, 32), (128, 128)]))
        blocks = (1, 1, -(-sq // bq), -(-sk // bk))
        a["block_mask"], bad["block_mask"] = xp.array(blocks, bool), (1, 1, blocks[2] + 1, blocks[3])
        a["block_size"] = (bq, bk)
    if backward:
        for name, shape in (("dq", (b, sq, hq, d)), ("dk", (b, sk, hk, d)), ("dv", (b, sk, hk, d))):
            a[name], bad[name] = xp.array(shape, dt, poison=True), (shape[0], shape[1] + 1) + shape[2:]
        return Call(entry, ("dout", "q", "k", "v", "out", "lse"), a, ("dq", "dk", "dv"), bad)
    a["out"], bad["out"] = xp.array((b, sq, hq, d), dt, poison=True), (b, sq + 1, hq, d)
    outputs = ("out",)
    if entry == "attention_forward":
        a["lse"], bad["lse"] = xp.array((b, hq, sq), F32, poison=True), (b, hq, sq + 1)
        outputs = ("out", "lse")
    return Call(entry, ("q", "k", "v"), a, outputs, bad)


def build_varlen(draw, xp, entry):
    n = _sizes(draw)
    dt, hq, hk, d = n.dtype, n.hq, n.hk, n.d
    lens_q = draw(st.lists(st.integers(1, 16), min_size=1, max_size=3))
    lens_k = draw(st.lists(st.integers(1, 16), min_size=len(lens_q), max_size=len(lens_q)))
    batch, tq, tk = len(lens_q), sum(lens_q), sum(lens_k)
    backward = entry == "attention_varlen_backward"
    a, bad = {}, {}
    if backward:
        a["dout"], bad["dout"] = xp.array((tq, hq, d), dt), (tq + 1, hq, d)
    a["q"], bad["q"] = xp.array((tq, hq, d), dt), (1, tq, hq, d)
    a["k"], bad["k"] = xp.array((tk, hk, d), dt), (tk, hk, d + 8)
    a["v"], bad["v"] = xp.array((tk, hk, d), dt), (tk + 1, hk, d)
    if backward:
        a["out"], bad["out"] = xp.array((tq, hq, d), dt), (tq + 1, hq, d)
        a["lse"], bad["lse"] = xp.array((hq, tq), F32), (hq, tq + 1)
    for name, lens in (("cu_seqlens_q", lens_q), ("cu_seqlens_k", lens_k)):
        a[name] = xp.array((batch + 1,), np.int32, values=np.concatenate([[0], np.cumsum(lens)]))
    bad["cu_seqlens_q"], bad["cu_seqlens_k"] = (1, batch + 1), (batch + 2,)
    if draw(st.booleans()):
        a["max_seqlen_q"], a["max_seqlen_k"] = max(lens_q), max(lens_k)
    a["causal"] = draw(st.booleans())
    if draw(st.booleans()):
        a["alibi_slopes"], bad["alibi_slopes"] = xp.array(draw(st.sampled_from([(hq,), (batch, hq)])), F32), (hq + 1,)
    if backward:
        for name, shape in (("dq", (tq, hq, d)), ("dk", (tk, hk, d)), ("dv", (tk, hk, d))):
            a[name], bad[name] = xp.array(shape, dt, poison=True), (shape[0] + 1,) + shape[1:]
        return Call(entry, ("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k"), a, ("dq", "dk", "dv"),
                    bad)
    a["out"], bad["out"] = xp.array((tq, hq, d), dt, poison=True), (tq + 1, hq, d)
    return Call(entry, ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"), a, ("out",), bad)


def build_decode(draw, xp, paged, *, append=None, host_index=None, min_batch=1):
    n = _sizes(draw)
    dt, hq, hk, d = n.dtype, n.hq, n.hk, n.d
    b = draw(st.integers(min_batch, 3))
    append = draw(st.booleans()) if append is None else append
    host_index = draw(st.booleans()) if host_index is None else host_index
    s_new = draw(st.integers(1, 3)) if append else 0
    sq = s_new if append else draw(st.integers(1, 3))
    lens = np.array(draw(st.lists(st.integers(0, 12), min_size=b, max_size=b)), dtype=np.int32)
    a, bad = {}, {}
    if paged:
        page_size = draw(st.sampled_from([1, 3, 8, 16]))
        needed = -(-(lens + s_new) // page_size)
        max_pages, num_pages = int(needed.max()) + 1, int(needed.sum()) + 2
        order = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(num_pages)
        table = np.full((b, max_pages), -1, dtype=np.int32)
        used = 0
        for i in range(b):
            table[i, :needed[i]] = order[used:used + needed[i]]
            used += int(needed[i])
        cache_shape = (num_pages, page_size, hk, d)
        a["block_table"] = table if host_index else xp.array(table.shape, np.int32, values=table)
        bad["block_table"] = (b + 1, max_pages)
    else:
        cache_shape = (b, int(lens.max()) + s_new + draw(st.integers(1, 4)), hk, d)
    a["q"], bad["q"] = xp.array((b, sq, hq, d), dt), (b, sq, hq * d)
    a["k_cache"], bad["k_cache"] = xp.array(cache_shape, dt), (1,) + cache_shape
    a["v_cache"], bad["v_cache"] = xp.array(cache_shape, dt), (cache_shape[0], cache_shape[1] + 1) + cache_shape[2:]
    a["cache_seqlens"] = lens if host_index else xp.array((b,), np.int32, values=lens)
    bad["cache_seqlens"] = (b + 1,)
    if append:
        a["k_new"], bad["k_new"] = xp.array((b, s_new, hk, d), dt), (b, s_new, hk + 1, d)
        a["v_new"], bad["v_new"] = xp.array((b, s_new, hk, d), dt), (b, s_new + 1, hk, d)
    if draw(st.booleans()):
        a["alibi_slopes"], bad["alibi_slopes"] = xp.array((hq,), F32), (hq + 1,)
    if draw(st.booleans()):
        a["mask"], bad["mask"] = xp.array((sq, 1), bool), (sq + 1, 1)
    a["out"], bad["out"] = xp.array((b, sq, hq, d), dt, poison=True), (b, sq + 1, hq, d)
    call = Call("decode", ("q", "k_cache", "v_cache"), a, ("out",), bad)
    call.capacity = cache_shape[1] * (table.shape[1] if paged else 1)
    call.s_new, call.num_pages = s_new, cache_shape[0]
    return call


def build_merge(draw, xp):
    dt = draw(st.sampled_from(FLOATS + (np.dtype(np.float64),)))
    n, b, s, h = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 3))
    d = draw(st.sampled_from([8, 24, 64]))
    a = {"outs": xp.array((n, b, s, h, d), dt), "lses": xp.array((n, b, h, s), F32),
         "out": xp.array((b, s, h, d), dt, poison=True), "lse": xp.array((b, h, s), F32, poison=True)}
    bad = {"outs": (1, n, b, s, h, d), "lses": (n, b, h, s + 1), "out": (b, s + 1, h, d), "lse": (b, h, s + 1)}
    return Call("merge_states", ("outs", "lses"), a, ("out", "lse"), bad)


ENTRIES = ("attention", "attention_forward", "attention_varlen", "attention_backward", "attention_varlen_backward",
           "decode", "decode_paged", "merge_states")


def build(draw, xp, entry, **kw):
    if entry in ("attention", "attention_forward", "attention_backward"):
        return build_dense(draw, xp, entry)
    if entry in ("attention_varlen", "attention_varlen_backward"):
        return build_varlen(draw, xp, entry)
    if entry.startswith("decode"):
        return build_decode(draw, xp, entry == "decode_paged", **kw)
    return build_merge(draw, xp)


# ----------------------------------------------------------------------------- faults

ROLES = {"lse": "f32", "lses": "f32", "alibi_slopes": "f32", "bias": "bias", "mask": "bool", "block_mask": "bool",
         "cu_seqlens_q": "int32", "cu_seqlens_k": "int32", "cache_seqlens": "int32", "block_table": "int32",
         "outs": "outs"}
WRONG_DTYPES = {"float": FLOATS + (np.dtype(np.float64), np.dtype(np.int32)), "f32": (np.float16, np.float64),
                "bias": (np.float64, np.int32), "bool": (np.uint8, np.float32), "int32": (np.int64, np.float32),
                "outs": (np.int32, np.int8)}


def fault_dtype(draw, xp, call):
    name = draw(st.sampled_from(sorted(call.bad_shapes)))
    x = call.args[name]
    wrong = [np.dtype(t) for t in WRONG_DTYPES[ROLES.get(name, "float")] if np.dtype(t) != x.dtype]
    dtype = draw(st.sampled_from(wrong))
    call.args[name] = np.asarray(x).astype(dtype) if isinstance(x, np.ndarray) else xp.array(x.shape, dtype)
    return TypeError, (name,)


def fault_shape(draw, xp, call):
    name = draw(st.sampled_from(sorted(call.bad_shapes)))
    x, shape = call.args[name], call.bad_shapes[name]
    call.args[name] = np.zeros(shape, x.dtype) if isinstance(x, np.ndarray) else xp.array(shape, x.dtype)
    return ValueError, (name,)


def fault_host(draw, xp, call):
    # decode takes its index arrays from the host too; every other array must be on the GPU.
    name = draw(st.sampled_from([n for n in call.arrays() if n not in ("cache_seqlens", "block_table")]))
    x = call.args[name]
    call.args[name] = np.zeros(x.shape, x.dtype)
    return TypeError, (name,)


def overlap(draw, xp, call, name, other):
    """Make ``call.args[name]`` and ``call.args[other]`` share memory: ``name`` becomes a view of its
    shape and dtype starting inside ``other``'s bytes, or (when ``other``'s allocation has no room
    for it) ``other`` a view inside ``name``'s."""
    x, y = call.args[name], call.args[other]
    lo, hi = _checks.memory_span(y)
    start = lo - y.data.ptr + 16 * draw(st.integers(0, (hi - lo - 1) // 16))
    if start + x.nbytes <= xp.room(y):
        call.args[name] = xp.view(y, start, x.shape, x.dtype)
    else:
        lo, hi = _checks.memory_span(x)
        start = 16 * draw(st.integers(0, (hi - lo - 1) // 16))
        y_lo, y_hi = _checks.memory_span(y)
        assert start + (y_hi - y_lo) <= xp.room(x)
        call.args[other] = xp.view(x, start + (y.data.ptr - y_lo), y.shape, y.dtype, y.strides)


def fault_alias(draw, xp, call):
    name = draw(st.sampled_from(call.outputs))
    other = draw(st.sampled_from([n for n in call.arrays() if n != name]))
    overlap(draw, xp, call, name, other)
    return ValueError, (name, other)


WINDOWS = [((2**31, 0), ValueError), ((0, 2**40), ValueError), ((-2, 0), ValueError), ((1.5, 0), TypeError),
           ((3,), ValueError)]
SCALES = [(0.0, ValueError), (-1.0, ValueError), (NAN, ValueError), (math.inf, ValueError), (1e39, ValueError),
          ("0.1", TypeError)]
SOFTCAPS = [(-1.0, ValueError), (NAN, ValueError), (math.inf, ValueError), (1e39, ValueError), (1e-45, ValueError),
            ("1", TypeError)]
DROPOUTS = [(-0.1, ValueError), (1.0, ValueError), (NAN, ValueError), (2.0, ValueError), ("0.1", TypeError)]
BLOCK_SIZES = [((0, 16), ValueError), ((2**31, 1), ValueError), ((16,), ValueError), ((16, -1), ValueError)]


def option_faults(entry):
    """(argument, value, exception, names the message must hold) for the options of ``entry``."""
    faults = [("window", w, e, ("window",)) for w, e in WINDOWS]
    faults += [("scale", s, e, ("scale",)) for s, e in SCALES]
    faults += [("softcap", s, e, ("softcap",)) for s, e in SOFTCAPS]
    faults += [("causal", "yes", TypeError, ("causal",))]
    if entry in ("attention", "attention_forward", "attention_backward"):
        faults += [("block_size", b, e, ("block_size",)) for b, e in BLOCK_SIZES]
    if not entry.startswith("decode"):
        faults += [("dropout_p", p, e, ("dropout_p",)) for p, e in DROPOUTS]
    if entry in ("attention", "attention_forward", "attention_varlen"):
        faults += [(("dropout_p", "generator"), (0.1, 42), TypeError, ("generator",))]
    if entry == "attention":
        faults += [("return_lse", 1, TypeError, ("return_lse",))]
    if entry in ("attention_backward", "attention_varlen_backward"):
        faults += [("deterministic", 1, TypeError, ("deterministic",)),
                   ("dropout_p", 0.1, ValueError, ("rng_state",)),
                   (("dropout_p", "rng_state"), (0.1, [1, 2, 3]), ValueError, ("rng_state",))]
    if entry == "attention_backward":
        faults += [("return_dbias", "yes", TypeError, ("return_dbias",))]
    if "varlen" in entry:
        faults += [("max_seqlen_q", -1, ValueError, ("max_seqlen_q",)),
                   ("max_seqlen_k", 2.5, TypeError, ("max_seqlen_k",)),
                   ("mask", "present", ValueError, ("mask",)), ("block_mask", "present", ValueError, ("block_mask",))]
    if entry.startswith("decode"):
        faults += [("num_splits", s, ValueError, ("num_splits",)) for s in (-1, 129, 2**40)]
        faults += [("num_splits", s, TypeError, ("num_splits",)) for s in (2.0, True, None)]
    return faults


def fault_option(draw, xp, call, entry):
    names, values, exc, expected = draw(st.sampled_from(option_faults(entry)))
    if isinstance(names, str):
        names, values = (names,), (values,)
    for name, value in zip(names, values):
        call.args[name] = xp.array((1, 1, 1, 1), bool) if value == "present" else value
    return exc, expected


def fault_size(draw, xp, call, entry):
    """Replace the call by one whose sizes pass what the kernels index (zero-stride views: no memory)."""
    dt = draw(st.sampled_from(FLOATS))
    a = call.args
    for name in list(a):
        if name not in ("causal",):
            del a[name]
    call.outputs = ()
    if entry in ("attention", "attention_forward", "attention_backward"):
        kind = draw(st.sampled_from(["batch", "heads", "rows_q", "rows_k", "lengths"]))
        b, sq, sk, hq = {"batch": (65536, 1, 1, 1), "heads": (1, 1, 1, 65536), "rows_q": (1, 2**31, 1, 1),
                         "rows_k": (1, 1, 2**31, 1), "lengths": (1, 2**30, 2**30, 1)}[kind]
        a["q"], a["k"], a["v"] = (spread(xp, s, dt) for s in ((b, sq, hq, 8), (b, sk, 1, 8), (b, sk, 1, 8)))
        if entry == "attention_backward":
            a["dout"], a["out"], a["lse"] = spread(xp, (b, sq, hq, 8), dt), spread(xp, (b, sq, hq, 8), dt), \
                spread(xp, (b, hq, sq), F32)
        return ValueError, {"rows_k": ("k",), "lengths": ("q", "k")}.get(kind, ("q",))
    if "varlen" in entry:
        kind = draw(st.sampled_from(["batch", "rows_q", "rows_k", "lengths"]))
        tq, tk, batch = {"batch": (4, 4, 65536), "rows_q": (2**31, 4, 1), "rows_k": (4, 2**31, 1),
                         "lengths": (2**30, 2**30, 1)}[kind]
        a["q"], a["k"], a["v"] = (spread(xp, s, dt) for s in ((tq, 1, 8), (tk, 1, 8), (tk, 1, 8)))
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            a[name] = xp.array((batch + 1,), np.int32, values=np.zeros(batch + 1))
        if entry == "attention_varlen_backward":
            a["dout"], a["out"] = spread(xp, (tq, 1, 8), dt), spread(xp, (tq, 1, 8), dt)
            a["lse"] = spread(xp, (1, tq), F32)
        names = {"batch": ("cu_seqlens_q",), "rows_k": ("k",), "lengths": ("max_seqlen_q",)}
        return ValueError, names.get(kind, ("q",))
    if entry == "decode":
        kind = draw(st.sampled_from(["batch", "kv_heads", "rows_q", "capacity", "mask_keys"]))
        b, sq, h, s = {"batch": (65536, 1, 1, 4), "kv_heads": (1, 1, 65536, 4), "rows_q": (1, 2**31, 1, 4),
                       "capacity": (1, 1, 1, 2**31), "mask_keys": (1, 1, 1, 4)}[kind]
        a["k_cache"] = a["v_cache"] = spread(xp, (b, s, h, 8), dt)
    else:
        kind = draw(st.sampled_from(["batch", "pages", "capacity", "mask_keys"]))
        b, sq, h, pages, page_size, max_pages = {"batch": (65536, 1, 1, 2, 4, 1), "pages": (1, 1, 1, 2**31, 1, 1),
                                                 "capacity": (1, 1, 1, 2, 2**11, 2**20),
                                                 "mask_keys": (1, 1, 1, 2, 4, 1)}[kind]
        a["k_cache"] = a["v_cache"] = spread(xp, (pages, page_size, h, 8), dt)
        a["block_table"] = np.zeros((b, max_pages), np.int32)
        a["cache_seqlens"] = np.ones(b, np.int32)
    a["q"] = spread(xp, (b, sq, h, 8), dt)
    if kind == "mask_keys":
        a["mask"] = spread(xp, (1, 1, 1, 2**31), bool)
    return ValueError, {"batch": ("q",), "kv_heads": ("k_cache",), "rows_q": ("q",), "pages": ("k_cache",),
                        "capacity": ("block_table",) if entry == "decode_paged" else ("k_cache",),
                        "mask_keys": ("mask",)}[kind]


def fault_cache(draw, xp, call, entry):
    """An append into caches whose rows share memory, or into memory the call reads."""
    kc = call.args["k_cache"]
    kind = draw(st.sampled_from(["same", "shifted", "zero_stride", "overlapping_stride", "read_inside"]))
    if kind == "same":
        call.args["v_cache"] = kc
        return ValueError, ("k_cache", "v_cache")
    if kind == "shifted":   # a C-contiguous cache moved by less than its size overlaps itself
        shift = 16 * draw(st.integers(1, max(1, kc.nbytes // 16 - 1)))
        call.args["v_cache"] = xp.view(kc, shift, kc.shape, kc.dtype)
        return ValueError, ("k_cache", "v_cache")
    name = draw(st.sampled_from(["k_cache", "v_cache"]))
    x = call.args[name]
    if kind in ("zero_stride", "overlapping_stride"):   # sequences (pages) over each other
        first = 0 if kind == "zero_stride" else x.strides[0] // 2
        call.args[name] = xp.view(x, 0, x.shape, x.dtype, (first,) + tuple(x.strides[1:]))
        return ValueError, (name,)
    reads = [n for n in ("q", "k_new", "v_new", "alibi_slopes", "mask", "cache_seqlens", "block_table")
             if n in call.arrays()]
    other = draw(st.sampled_from(reads))
    overlap(draw, xp, call, name, other)
    return ValueError, (name, other)


def fault_index(draw, xp, call, entry):
    """Index arrays given on the host with values or types the kernels cannot take."""
    lens, b = call.args["cache_seqlens"], len(call.args["cache_seqlens"])
    kinds = ["past_int32", "floats", "bools", "negative", "too_long"]
    kinds += ["no_room"] if call.s_new else []
    kinds += ["page", "table_floats", "table_ragged"] if entry == "decode_paged" else []
    kind = draw(st.sampled_from(kinds))
    i = draw(st.integers(0, b - 1))
    if kind in ("past_int32", "floats", "bools"):
        call.args["cache_seqlens"] = [{"past_int32": 2**40, "floats": 0.5, "bools": True}[kind]] * b
        return (ValueError if kind == "past_int32" else TypeError), ("cache_seqlens",)
    if kind in ("negative", "too_long", "no_room"):
        lens = lens.copy()
        lens[i] = {"negative": -1, "too_long": call.capacity + 1, "no_room": call.capacity - call.s_new + 1}[kind]
        call.args["cache_seqlens"] = lens
        return ValueError, ("cache_seqlens",)
    table = call.args["block_table"]
    if kind == "page":
        table, lens = table.copy(), lens.copy()
        lens[i] = max(lens[i], 1)   # the sequence uses its first page
        table[i, 0] = call.num_pages + draw(st.integers(0, 5))
        call.args["block_table"], call.args["cache_seqlens"] = table, lens
        return ValueError, ("block_table",)
    if kind == "table_floats":
        call.args["block_table"] = (table + 0.5).tolist()
        return TypeError, ("block_table",)
    call.args["block_table"] = [row.tolist() for row in table] + [[0]]
    if len(table[0]) == 1:
        call.args["block_table"][-1] = [0, 0]
    return ValueError, ("block_table",)


FAULTS = {"dtype": ENTRIES, "shape": ENTRIES, "host": ENTRIES, "alias": ENTRIES, "option": ENTRIES[:-1],
          "size": ENTRIES[:-1], "cache": ("decode", "decode_paged"), "index": ("decode", "decode_paged")}
CASES = [(entry, fault) for fault, entries in FAULTS.items() for entry in entries]


def faulty_call(draw, xp, entry, fault):
    """A call of ``entry`` with one fault of kind ``fault``: (call, exception, names in the message)."""
    kw = {}
    if entry.startswith("decode"):
        kw = {"cache": dict(append=True, min_batch=2), "index": dict(host_index=True),
              "alias": dict(append=True) if draw(st.booleans()) else {}}.get(fault, {})
    call = build(draw, xp, entry, **kw)
    if fault in ("dtype", "shape", "host", "alias"):
        exc, names = {"dtype": fault_dtype, "shape": fault_shape, "host": fault_host, "alias": fault_alias}[fault](
            draw, xp, call)
    else:
        exc, names = {"option": fault_option, "size": fault_size, "cache": fault_cache, "index": fault_index}[fault](
            draw, xp, call, entry)
    return call, exc, names


def expect_refused(call, exc, names, xp, launched):
    before = xp.snapshot()
    _memo.clear_memo()   # the full path, whatever plans other tests left
    with pytest.raises(exc) as info:
        call()
    names_in(str(info.value), names)
    assert launched == [], f"{len(launched)} kernels were launched before the error"
    after = xp.snapshot()
    if before is not None:
        for i, (was, now) in enumerate(zip(before, after)):
            assert np.array_equal(was, now), f"allocation {i} was written before the error"


@pytest.fixture
def launched(monkeypatch):
    """The kernels launched through cuflash._runtime.launch.launch (not launched: recorded)."""
    calls = []
    monkeypatch.setattr(_launch, "launch", lambda *args, **kw: calls.append(args))
    monkeypatch.setattr(_launch, "current_stream_ptr", lambda device_id=-1: 0)
    return calls


@pytest.mark.parametrize("entry, fault", CASES)
@FIXTURES_OK
@given(data=st.data())
def test_bad_arguments_are_refused_before_the_gpu(monkeypatch, launched, entry, fault, data):
    space = StandIns(np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    fake = space.cupy()
    monkeypatch.setattr(_checks, "_cupy", lambda: fake)
    monkeypatch.setattr(_plan, "_cp", fake)
    monkeypatch.setattr(_memo, "_cp", fake)
    call, exc, names = faulty_call(data.draw, space, entry, fault)
    expect_refused(call, exc, names, space, launched)


@pytest.mark.gpu
@pytest.mark.parametrize("entry, fault", CASES)
@FIXTURES_OK
@given(data=st.data())
def test_bad_arguments_are_refused_on_the_gpu(xp_gpu, launched, entry, fault, data):
    xp = Device(xp_gpu, np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    call, exc, names = faulty_call(data.draw, xp, entry, fault)
    expect_refused(call, exc, names, xp, launched)


# ----------------------------------------------------------------------------- GPU: layouts that keep working

def _bits(x):
    return x.view({2: np.uint16, 4: np.uint32}[x.itemsize])


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_interleaved_caches_take_appends(xp_gpu, paged):
    """k_cache and v_cache as the two halves of one (…, 2, …) allocation (vLLM / FlashInfer layouts)
    share no row: an append into them is accepted and gives what separate caches give."""
    cp = xp_gpu
    rng = np.random.default_rng()
    B, S, H, D, s_new = 2, 40, 2, 64, 2
    lens = rng.integers(0, S - s_new, B).astype(np.int32)
    q = cp.asarray(rng.standard_normal((B, s_new, 2 * H, D)).astype(np.float16))
    k_new, v_new = (cp.asarray(rng.standard_normal((B, s_new, H, D)).astype(np.float16)) for _ in range(2))
    if paged:
        kv = cp.asarray(rng.standard_normal((B * 3, 2, 16, H, D)).astype(np.float16))   # 3 pages of 16 per sequence
        kc, vc = kv[:, 0], kv[:, 1]
        table = np.arange(B * 3, dtype=np.int32).reshape(B, 3)[:, ::-1].copy()
        extra = dict(block_table=table)
    else:
        kv = cp.asarray(rng.standard_normal((B, S, 2, H, D)).astype(np.float16))
        kc, vc = kv[:, :, 0], kv[:, :, 1]
        extra = {}
    k_sep, v_sep = cp.ascontiguousarray(kc), cp.ascontiguousarray(vc)
    got = cuflash.decode(q, kc, vc, cache_seqlens=lens, k_new=k_new, v_new=v_new, **extra)
    want = cuflash.decode(q, k_sep, v_sep, cache_seqlens=lens, k_new=k_new, v_new=v_new, **extra)
    assert np.array_equal(_bits(got.get()), _bits(want.get()))
    assert np.array_equal(_bits(kc.get()), _bits(k_sep.get())) and np.array_equal(_bits(vc.get()), _bits(v_sep.get()))


@pytest.mark.gpu
def test_caches_are_shared_or_broadcast_when_only_read(xp_gpu):
    """Without k_new/v_new the caches are only read: v_cache is k_cache, and one prefix broadcast to
    every sequence (zero batch stride), are accepted and equal their materialised copies."""
    cp = xp_gpu
    rng = np.random.default_rng()
    B, S, H, D = 3, 50, 2, 64
    q = cp.asarray(rng.standard_normal((B, 1, 4, D)).astype(np.float16))
    kc = cp.asarray(rng.standard_normal((B, S, H, D)).astype(np.float16))
    lens = rng.integers(1, S, B).astype(np.int32)
    got = cuflash.decode(q, kc, kc, cache_seqlens=lens)
    want = cuflash.decode(q, kc, kc.copy(), cache_seqlens=lens)
    assert np.array_equal(_bits(got.get()), _bits(want.get()))
    prefix = cp.broadcast_to(kc[:1], kc.shape)
    got = cuflash.decode(q, prefix, prefix, cache_seqlens=lens)
    full = cp.ascontiguousarray(prefix)
    want = cuflash.decode(q, full, full.copy(), cache_seqlens=lens)
    assert np.array_equal(_bits(got.get()), _bits(want.get()))


def _close(got, want, atol=2e-3):
    """Equal up to rounding: a window that hides nothing may still take the masked code path."""
    np.testing.assert_allclose(got.get().astype(np.float32), want.get().astype(np.float32), rtol=1e-3, atol=atol)


@pytest.mark.gpu
def test_windows_wider_than_the_problem_are_unbounded(xp_gpu):
    """A window side up to 2**31 - 1 (int32's largest) is the unbounded window, in every entry point
    (the kernels add it to positions in int32: it must not overflow there)."""
    cp = xp_gpu
    rng = np.random.default_rng()
    q = cp.asarray(rng.standard_normal((2, 37, 4, 64)).astype(np.float16))
    k, v = (cp.asarray(rng.standard_normal((2, 53, 2, 64)).astype(np.float16)) for _ in range(2))
    wide = (INT32_MAX, INT32_MAX)
    for causal in (False, True):
        out, lse, _ = cuflash.attention_forward(q, k, v, causal=causal, window=wide)
        ref, ref_lse, _ = cuflash.attention_forward(q, k, v, causal=causal)
        _close(out, ref)
        _close(lse, ref_lse, atol=1e-4)
        dout = cp.asarray(rng.standard_normal(q.shape).astype(np.float16))
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, window=wide, deterministic=True)
        want = cuflash.attention_backward(dout, q, k, v, ref, ref_lse, causal=causal, deterministic=True)
        for g, w in zip(grads, want):
            _close(g, w, atol=1e-2)
    cu = cp.asarray(np.array([0, 37, 74], np.int32))
    cu_k = cp.asarray(np.array([0, 53, 106], np.int32))
    packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    _close(cuflash.attention_varlen(*packed, cu, cu_k, window=wide, causal=True),
           cuflash.attention_varlen(*packed, cu, cu_k, causal=True))
    lens = np.array([20, 40], np.int32)
    _close(cuflash.decode(q[:, :2], k, v, cache_seqlens=lens, window=(INT32_MAX, 0)),
           cuflash.decode(q[:, :2], k, v, cache_seqlens=lens))


@pytest.mark.gpu
def test_varlen_work_items_past_int32_on_sm90(xp_gpu, launched):
    """fwd_sm90 counts (m-block, head, sequence) work items in int32; under varlen the m-blocks cover
    max_seqlen_q rows of every sequence, so many sequences with the default max_seqlen_q (the total)
    pass it: refused, naming max_seqlen_q, before any launch."""
    from cuflash._build.compile import device_arch

    if device_arch() != "sm_90a":
        pytest.skip("fwd_sm90 runs on sm_90 GPUs")
    cp = xp_gpu
    batch, heads, total = 65535, 512, 128 * 65   # ceil(total / 128) * heads * batch > 2**31
    q = cp.zeros((total, heads, 8), np.float16)  # real strides: TMA takes them, so fwd_sm90 is chosen
    k = v = cp.zeros((total, 1, 8), np.float16)
    cu = cp.asarray(np.minimum(np.arange(batch + 1), total).astype(np.int32))
    _memo.clear_memo()
    with pytest.raises(ValueError, match="max_seqlen_q"):
        cuflash.attention_varlen(q, k, v, cu, cu)
    assert launched == []
