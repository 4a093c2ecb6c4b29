"""Host-side pieces of the call pipeline that need no GPU: the fault messages of the device index
check, the stream key of per-thread default streams, the ``check`` flag, a pinned plan's refusal of
options at call time, the driver check that lets a plan's tensor maps be patched with each call's
addresses, the argument blocks a step launches (per thread, at fixed addresses), and a plan's run
with CuPy faked. (The GPU side is tests/gpu/test_host_path.py.)"""

import ctypes
import hashlib
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from cuflash import _checks

# What cuflash/decode.py hands the index check (and so the plan's info) for a paged cache of 9 pages
from cuflash._runtime import faults as _faults, launch as _launch, memo as _memo, params as _params, pinned as _pinned, plan as _plan, step as _step, tma as _tma
# of 16 keys, 4 pages per sequence, 2 tokens appended.
DECODE_INFO = dict(block_table_batch_stride=4, batch=2, capacity=64, seqlen_new=2, page_size=16, num_pages=9,
                   max_pages=4)
VARLEN_INFO = dict(batch=3, total_q=95, total_k=130, max_seqlen_q=45, max_seqlen_k=50)


def _plan_with(entry, info):
    plan = _plan.Plan(entry, 11)
    plan.info.update(info)
    return plan


def test_cache_seqlens_fault_message_is_complete():
    message = _faults.fault_message(1, 0, 65, _plan_with("decode", DECODE_INFO))
    assert message.startswith("cache_seqlens[0] = 65")
    assert "64" in message
    assert "?" not in message, f"a field of the message was not filled in: {message!r}"


def test_block_table_fault_message_names_row_and_column():
    message = _faults.fault_message(2, 1 * 4 + 0, -5, _plan_with("decode", DECODE_INFO))
    assert message.startswith("block_table[1, 0] = -5")
    assert "0 .. 8" in message        # the pages of the cache
    message = _faults.fault_message(2, 0 * 4 + 3, 9, _plan_with("decode", DECODE_INFO))
    assert message.startswith("block_table[0, 3] = 9")


@pytest.mark.parametrize("code, name", [(3, "cu_seqlens_q"), (4, "cu_seqlens_k"), (5, "max_seqlen_q"),
                                        (6, "max_seqlen_k")])
def test_varlen_fault_messages_name_the_argument(code, name):
    message = _faults.fault_message(code, 2, 25, _plan_with("attention_varlen", VARLEN_INFO))
    assert message.startswith(name)
    assert "2" in message


def test_fault_message_without_a_plan():
    assert "cache_seqlens[3] = 7" in _faults.fault_message(1, 3, 7, None)


def test_a_fault_is_raised_once_naming_the_entry_point():
    plan = _plan_with("decode", DECODE_INFO)

    class State:   # the host side of a stream's fault report
        def __init__(self):
            self.fault = (1, 0, 65, plan)

        def take_fault(self, slot):
            fault, self.fault = self.fault, None
            return fault

    state = State()
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 65.*decode"):
        _faults._raise_fault(state, _launch.REPORT_SLOTS["decode"])
    _faults._raise_fault(state, _launch.REPORT_SLOTS["decode"])   # taken: nothing left


def test_report_slots_cover_the_entry_points_with_index_arrays():
    assert set(_launch.REPORT_SLOTS) == {"decode", "attention_varlen", "attention_varlen_backward"}
    assert len(set(_launch.REPORT_SLOTS.values())) == 3


def test_per_thread_default_stream_is_keyed_by_thread():
    keys = {}
    both_alive = threading.Barrier(2)   # (a finished thread's identifier may be given to the next one)

    def record(name):
        keys[name] = (_launch.stream_key(0, 2), _launch.stream_key(0, 0x7F00), _launch.stream_key(0, 0))
        both_alive.wait()

    threads = [threading.Thread(target=record, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert keys["a"][0] != keys["b"][0], "two threads' per-thread default streams share state"
    assert keys["a"][1] == keys["b"][1] and keys["a"][2] == keys["b"][2], "one real stream, two states"


def _unowned(shape, dtype, ptr, strides=None):
    """A CuPy array over a made-up device address (CuPy builds one without a GPU)."""
    cupy = pytest.importorskip("cupy")
    from cupy.cuda import memory

    mem = memory.UnownedMemory(ptr, 1 << 30, None, device_id=0)
    return cupy.ndarray(shape, dtype, memory.MemoryPointer(mem, 0), strides=strides)


def test_lookup_keys_contiguous_arrays_by_shape_not_strides(monkeypatch):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(_launch, "current_stream_ptr", lambda device_id=-1: 0x5000)
    monkeypatch.setattr(_memo, "_memo", {})
    base = 0x7000_0000_0000
    a = _unowned((1, 4, 2, 8), np.float16, base)
    plan, key, where = _memo.lookup("probe", (a, None), ("option",))
    assert plan is None and key is not None and where == (0, 0x5000)
    made = _plan.Plan("probe", 2, aligned=(0,))
    _memo.remember(key, made)
    # The batch axis has length 1: its stride moves no address, and the plan serves both.
    b = _unowned((1, 4, 2, 8), np.float16, base + (1 << 20), strides=(2, 32, 16, 2))
    assert b._c_contiguous and b.strides != a.strides
    assert _memo.lookup("probe", (b, None), ("option",)) == (made, [b.data.ptr, 0], (0, 0x5000))
    # Strides that move addresses, another shape, dtype or option, an absent operand: other plans.
    c = _unowned((1, 4, 2, 8), np.float16, base, strides=(128, 16, 64, 2))
    misses = [(c, None), (_unowned((1, 4, 2, 16), np.float16, base), None),
              (_unowned((1, 4, 2, 8), np.float32, base), None), (None, a)]
    for operands in misses:
        assert _memo.lookup("probe", operands, ("option",))[0] is None
    assert _memo.lookup("probe", (a, None), ("other",))[0] is None
    # A pointer the plan needs aligned that is not: no replay (the full path copies it).
    assert _memo.lookup("probe", (_unowned((1, 4, 2, 8), np.float16, base + 8), None), ("option",)) \
        == (None, None, (0, 0x5000))
    # An operand not aligned that the plan does not need aligned replays.
    made.aligned = ()
    shifted = _unowned((1, 4, 2, 8), np.float16, base + 8)
    assert _memo.lookup("probe", (shifted, None), ("option",)) == (made, [base + 8, 0], (0, 0x5000))


def test_a_streams_arena_grows_and_keeps_what_it_replaced(monkeypatch):
    allocations = []

    def alloc(nbytes):
        allocations.append(nbytes)
        return SimpleNamespace(ptr=0x1000_0000 * len(allocations), size=nbytes)

    import contextlib

    cupy = SimpleNamespace(cuda=SimpleNamespace(alloc=alloc, Device=lambda device: contextlib.nullcontext()))
    monkeypatch.setattr(_launch, "_cupy", lambda: cupy)
    monkeypatch.setattr(_launch, "done_now", lambda device_id: contextlib.nullcontext())
    state = _launch.StreamState.__new__(_launch.StreamState)   # its device words are not needed here
    state.device_id, state.tails = 0, {}
    state._arena, state._arena_bytes, state._old_arenas = None, 0, []
    first = state.arena(1000)
    assert allocations == [64 << 10] and state.arena(64 << 10) is first, "the smallest arena is 64 KiB"
    state.tails["plan"] = "tail"
    second = state.arena((64 << 10) + 1)
    assert allocations[-1] == 128 << 10 and second is not first and state.tails == {}, \
        "a larger arena (the next power of two) forgets the tails that point into the old one"
    assert state._old_arenas == [first], "a graph may still use the old arena: it is kept"
    state.arena(_launch.ARENA_BYTES - 5)
    state.arena(_launch.ARENA_BYTES)
    assert allocations[-1] == _launch.ARENA_BYTES, "sizes are powers of two: ARENA_BYTES serves both"
    assert sum(allocations) < 2 * _launch.ARENA_BYTES


def test_check_flag(monkeypatch):
    monkeypatch.setattr(_checks, "_CHECK_DEFAULT", False)
    assert _checks.check_flag(None) is False
    monkeypatch.setattr(_checks, "_CHECK_DEFAULT", True)
    assert _checks.check_flag(None) is True
    assert _checks.check_flag(False) is False
    assert _checks.check_flag(np.bool_(True)) is True
    for bad in (1, "yes", 0.0):
        with pytest.raises(TypeError, match="check"):
            _checks.check_flag(bad)


def test_pinned_plan_refuses_options_at_call_time():
    seen = []

    def fn(x, *, opt=1, other=2):
        seen.append((x, opt, other))
        return x

    plan = _pinned.PinnedPlan(fn, plan=None, key=None, options={"opt": 3})
    assert plan(5) == 5 and seen[-1] == (5, 3, 2)
    for value in (4, 3):   # another value, or the same one again
        with pytest.raises(TypeError):
            plan(5, opt=value)
    assert len(seen) == 1, "a refused call reached the function"


# ----------------------------------------------------------------------------- tensor maps, argument blocks

def _map_body(spec) -> bytes:
    """120 bytes that depend on everything in a map but its address."""
    return (hashlib.sha256(repr(spec).encode()).digest() * 4)[:120]


def encode_like_cuda13(ptr, *spec):
    """A driver whose maps hold the global address as a little-endian 64-bit value in bytes 0..7
    (what CUDA 13's cuTensorMapEncodeTiled was measured to do)."""
    return ptr.to_bytes(8, "little") + _map_body(spec)


def encode_shifted(ptr, *spec):
    """A driver that keeps the address elsewhere (bytes 8..15, shifted by 4)."""
    body = _map_body(spec)
    return body[:8] + (ptr >> 4).to_bytes(8, "little") + body[8:]


def encode_mixed(ptr, *spec):
    """A driver whose other bytes depend on the address too."""
    return ptr.to_bytes(8, "little") + _map_body((spec, ptr >> 40))


def encode_refusing(ptr, *spec):
    raise RuntimeError("cuTensorMapEncodeTiled rejected")


@pytest.fixture
def driver(monkeypatch):
    """Install a fake encoder (returns the list of its calls); the patch check starts unknown."""
    def install(encoder):
        calls = []

        def encode(ptr, *spec):
            calls.append(ptr)
            return encoder(ptr, *spec)

        monkeypatch.setattr(_tma, "_encode", encode)
        monkeypatch.setattr(_tma, "_cache", {})
        monkeypatch.setattr(_tma, "_patchable", {})
        return calls

    return install


@pytest.mark.parametrize("encoder, patchable", [(encode_like_cuda13, True), (encode_shifted, False),
                                                (encode_mixed, False), (encode_refusing, False)])
def test_address_patch_check(driver, encoder, patchable):
    calls = driver(encoder)
    assert _tma.address_patchable() is patchable
    checked = len(calls)
    assert 1 <= checked <= 6   # a few encodes (fewer where the first answer already says no)
    assert _tma.address_patchable() is patchable and len(calls) == checked, "checked more than once"


def test_row_group_maps_are_checked_on_their_own(driver):
    """A driver whose row-groups maps (5-d) depend on the address beyond bytes 0..7 leaves the other maps
    patchable: each kind has its own answer, and only that kind is encoded per call."""
    def encoder(ptr, *spec):
        return encode_mixed(ptr, *spec) if len(spec) > 5 and spec[5] else encode_like_cuda13(ptr, *spec)

    calls = driver(encoder)
    paged = _tma.TensorMapSpec(_dense((50, 16, 8, 128)), 16, "bfloat16", row_groups=True)
    assert _tma.address_patchable() is True
    assert _tma.address_patchable(_tma.TensorMapSpec(_dense((2, 300, 8, 128)), 128, "bfloat16")) is True
    checked = len(calls)
    assert _tma.address_patchable(paged) is False and len(calls) > checked
    assert _tma.address_patchable(paged) is False and _tma.address_patchable() is True


def _dense(shape, itemsize=2):
    """Just enough of a contiguous array for a TensorMapSpec: shape, byte strides, nbytes."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return SimpleNamespace(shape=tuple(shape), strides=tuple(strides), nbytes=step, itemsize=itemsize)


@pytest.mark.parametrize("shape, box_rows, row_groups, dims, strides, box", [
    # (B, S, H, D): columns, rows, heads, batch; boxes of 64 columns x box rows of one head.
    ((2, 300, 8, 128), 128, False, (128, 300, 8, 2), (2048, 256, 614400), (64, 128, 1, 1)),
    # A paged cache in row groups: 64 columns, 8 rows, D / 64 column blocks, the cache's groups of 8
    # rows (pages x page_size / 8), heads; one box takes every column block of box_rows rows.
    ((50, 16, 8, 128), 16, True, (64, 8, 2, 100, 8), (2048, 128, 16384, 256), (64, 8, 2, 2, 1)),
    ((7, 64, 2, 192), 64, True, (64, 8, 3, 56, 2), (768, 128, 6144, 384), (64, 8, 3, 8, 1)),
])
def test_tensor_map_layouts_given_to_the_driver(monkeypatch, shape, box_rows, row_groups, dims, strides, box):
    """What cuTensorMapEncodeTiled is asked for: rank, extents, byte strides (dims 1..) and box."""
    seen = {}

    def encode(words, data_type, rank, ptr, dims_, strides_, box_, elem, interleave, swizzle, l2, fill):
        seen.update(rank=rank, dims=tuple(dims_[:rank]), strides=tuple(strides_[:rank - 1]),
                    box=tuple(box_[:rank]), elem=tuple(elem[:rank]), swizzle=swizzle)
        return 0

    monkeypatch.setattr(_tma, "_libcuda", lambda: encode)
    spec = _tma.TensorMapSpec(_dense(shape), box_rows, "bfloat16", row_groups=row_groups)
    assert len(_tma._encode(0x7F00_0000_0000, *spec)) == 128
    assert seen == dict(rank=len(dims), dims=dims, strides=strides, box=box, elem=(1,) * len(dims), swizzle=3)


def test_patched_map_is_the_map_encoded_at_the_address(driver):
    driver(encode_like_cuda13)
    spec = _tma.TensorMapSpec(_dense((2, 300, 8, 128)), 128, "bfloat16")
    for ptr in (0x7F12_3456_0000, 0x3_0000_0010, 0x7FFF_FFFF_FFF0):
        assert _tma.patched(_tma.template(spec), ptr) == encode_like_cuda13(ptr, *spec)


# A fwd_sm90-like launch: four maps (q, k, v, o), the params struct with pointer slots, dropout's
# seed (64-bit) and offset (32-bit) slots, and the stream's counter by value.
COUNTER, SEED, OFFSET = 11, 12, 13
MAPPED = (0, 1, 2, 3)


def _fwd_step():
    x = _dense((2, 300, 8, 64))
    maps = [("map", i, _tma.TensorMapSpec(x, rows, "bfloat16")) for i, rows in zip(MAPPED, (128, 128, 128, 64))]
    template = _params.Template(_params.FWD, {"seqlen_q": 300, "scale": 0.125, "dropout_rescale": 2.0},
                                {"q": 0, "k": 1, "v": 2, "o": 3, "lse": 4, "dropout_seed": SEED,
                                 "dropout_offset": OFFSET})
    return _step.Step(0xF00, (132, 1, 1), 384, 1000, (*maps, ("struct", template), ("pointer", COUNTER)))


def _values(n):
    """The values of call ``n``: distinct 16-byte aligned pointers, dropout's seed and 32-bit offset."""
    values = [0x7E00_0000_0000 + (n << 32) + (i << 20) for i in range(SEED)]
    return values + [n * 1000 + 7, (n * 77 + 5) & 0xFFFFFFFF]


def _expected_arguments(step, values):
    """Each parameter's bytes as the driver at CUDA 13 would have them (maps encoded at their address)."""
    out = []
    for arg in step.args:
        if arg[0] == "map":
            out.append(encode_like_cuda13(values[arg[1]], *arg[2]))
        elif arg[0] == "struct":
            out.append(bytes(arg[1].fill(values)))
        else:
            out.append(values[arg[1]].to_bytes(8, "little"))
    return out


@pytest.fixture
def launches(monkeypatch):
    """Replace the driver launch of ``step``: record each launch, with the bytes of each parameter
    read, as the driver does, through the argument pointer array before the launch returns."""
    seen = []

    def launch(func, grid, threads, smem, argv, stream, dependent=False):
        sizes = [128 if a[0] == "map" else len(a[1].data) if a[0] == "struct" else 8 for a in launches.step.args]
        pointers = [int.from_bytes(ctypes.string_at(argv + 8 * i, 8), "little") for i in range(len(sizes))]
        seen.append(SimpleNamespace(func=func, grid=grid, argv=argv, stream=stream,
                                    arguments=[ctypes.string_at(p, n) for p, n in zip(pointers, sizes)]))

    launches = SimpleNamespace(seen=seen, launch=launch, step=None)
    monkeypatch.setattr(_launch, "launch", launch)
    return launches


@pytest.mark.parametrize("encoder", [encode_like_cuda13, encode_shifted])
def test_a_launch_writes_each_calls_pointers_and_map_addresses(driver, launches, encoder):
    calls = driver(encoder)
    step = launches.step = _fwd_step()
    made = len(calls)   # the check and the plan's maps
    for n in range(3):
        values = _values(n + 1)
        step.launch(values, 0x1234)
        got = launches.seen[-1].arguments
        if _tma.address_patchable():
            assert got == _expected_arguments(step, values)
        else:   # each call has the driver encode its maps
            assert [got[i] for i in MAPPED] == [encoder(values[i], *step.args[i][2]) for i in MAPPED]
            assert got[4:] == _expected_arguments(step, values)[4:]
        fields = _params.FWD.unpack(got[4])
        assert [fields[name] for name in ("q", "k", "v", "o", "lse")] == values[:5]
        assert (fields["dropout_seed"], fields["dropout_offset"]) == (values[SEED], values[OFFSET])
        assert fields["seqlen_q"] == 300 and fields["scale"] == 0.125 and fields["dropout_rescale"] == 2.0
        seen = launches.seen[-1]
        assert (seen.func, seen.grid, seen.stream) == (0xF00, (132, 1, 1), 0x1234)
    if _tma.address_patchable():
        assert len(calls) == made, "a call encoded a tensor map: it should only write the address"
    else:
        assert len(calls) == made + 3 * len(MAPPED)
    assert len({s.argv for s in launches.seen}) == 1, "the thread's argument block moved between calls"


def test_each_thread_launches_its_own_block(driver, launches, monkeypatch):
    # Two threads launch the same step at once: each reads its parameters only after the other has
    # written its own (the barrier), so a shared block would show the other thread's pointers.
    driver(encode_like_cuda13)
    step = launches.step = _fwd_step()
    both_wrote = threading.Barrier(2, timeout=10)
    values = {n: _values(n) for n in (5, 6)}

    def launch_when_both_wrote(*args):
        both_wrote.wait()
        launches.launch(*args)

    def worker(n):
        for _ in range(2):
            step.launch(values[n], 0x1000 + n)

    monkeypatch.setattr(_launch, "launch", launch_when_both_wrote)
    threads = [threading.Thread(target=worker, args=(n,)) for n in values]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(launches.seen) == 4
    argv = {}
    for seen in launches.seen:
        n = seen.stream - 0x1000
        assert seen.arguments == _expected_arguments(step, values[n]), f"thread {n} launched another's pointers"
        argv.setdefault(n, set()).add(seen.argv)
    assert all(len(a) == 1 for a in argv.values()), "a thread's argument block moved between its calls"
    assert argv[5] != argv[6], "two threads share an argument block"


def test_a_finished_threads_block_is_freed(driver, launches):
    import gc
    import weakref

    driver(encode_like_cuda13)
    step = launches.step = _fwd_step()
    blocks = []

    def worker():
        step.launch(_values(1), 0)
        blocks.append(weakref.ref(step._local.block[1]))   # the block's memoryview

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    gc.collect()
    assert blocks and blocks[0]() is None, "a finished thread's argument block is still alive"


# ----------------------------------------------------------------------------- Plan.run, CuPy faked

class _Memory:
    """A CuPy MemoryPointer stand-in: an address, and ``+`` for an offset."""

    def __init__(self, ptr):
        self.ptr = ptr

    def __add__(self, offset):
        return _Memory(self.ptr + offset)


class _Array:
    def __init__(self, shape, dtype, memptr):
        self.shape, self.dtype, self.data = shape, np.dtype(dtype), memptr


class _Stream:
    """The stream state Plan.run reads, and what it was asked."""

    counter, error, scratch = 0x9000, 0x9004, 0x9008

    def __init__(self, fault=None):
        self.fault, self.plans, self.events, self.tails = fault, [None] * 3, [], {}

    def report_ptr(self, slot):
        return 0xB000 + 16 * slot

    def take_fault(self, slot):
        self.events.append("take_fault")
        if not self.events.count("sync"):
            return None
        fault, self.fault = self.fault, None
        return fault


@pytest.fixture
def fake_cuda(monkeypatch):
    state = _Stream()
    allocations = []

    def alloc(nbytes):
        allocations.append(nbytes)
        return _Memory(0x7C00_0000_0000 * len(allocations))

    runtime = SimpleNamespace(getDevice=lambda: 0, memsetAsync=lambda *a: state.events.append(("memset", a)),
                              streamSynchronize=lambda stream: state.events.append("sync"),
                              streamIsCapturing=lambda stream: False)
    cupy = SimpleNamespace(ndarray=_Array, cuda=SimpleNamespace(alloc=alloc, runtime=runtime))
    monkeypatch.setattr(_plan, "_cp", cupy)
    monkeypatch.setattr(_memo, "_cp", cupy)
    monkeypatch.setattr(_launch, "current_stream_ptr", lambda device_id=-1: 0x1234)
    monkeypatch.setattr(_launch, "stream_state", lambda device, stream: state)
    monkeypatch.setattr(_plan, "_call_state", lambda device, stream: state)   # a captured call's own
    monkeypatch.setattr(_plan._recycled, "MAX_BYTES", 0)   # outputs made at every call (test_recycled.py)
    # Kernel by kernel (test_run_launches_several_kernels_as_one_graph covers the graph path).
    monkeypatch.setattr(_plan, "GRAPH_MIN_STEPS", 0)
    return SimpleNamespace(state=state, allocations=allocations)


class _Recorder:
    """A step that records the values it was launched with."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def launch(self, values, stream):
        self.log.append((self.name, list(values), stream))


def test_run_allocates_missing_outputs_in_one_block(fake_cuda):
    log = []
    outputs = {3: _step.Buffer((2, 5, 3, 64), _checks.BFLOAT16), 4: _step.Buffer((2, 3, 5), np.float32)}
    plan = _plan.Plan("attention", 5, outputs=outputs, steps=[_Recorder("fwd", log)], results=(3, 4))
    given = _Array((2, 5, 3, 64), _checks.BFLOAT16, _Memory(0x5550))
    operands = (None, None, None, given, None)
    results, temps, drawn = plan.run(operands, [0x10, 0x20, 0x30, 0x5550, 0])
    assert results[0] is given and drawn is None and temps == []
    lse = results[1]
    assert lse.shape == (2, 3, 5) and lse.dtype == np.float32 and fake_cuda.allocations == [256]
    assert log[0][1][:5] == [0x10, 0x20, 0x30, 0x5550, lse.data.ptr] and log[0][2] == 0x1234
    results, _, _ = plan.run((None,) * 5, [0x10, 0x20, 0x30, 0, 0])   # neither given: one allocation
    out, lse = results
    assert fake_cuda.allocations[1] == 2 * 5 * 3 * 64 * 2 + 256 and lse.data.ptr == out.data.ptr + 3840
    assert out.dtype == _checks.BFLOAT16 and log[1][1][3:5] == [out.data.ptr, lse.data.ptr]
    assert log[1][1][5:10] == [0x9000, 0x9004, 0x9008, 0, 0]   # the stream's words


def test_run_with_check_waits_for_the_index_check(fake_cuda):
    log = []
    plan = _plan.Plan("attention_varlen", 8, steps=[_Recorder("check", log), _Recorder("fwd", log)],
                          checked=True, info=VARLEN_INFO)
    ptrs = [0x100 * (i + 1) for i in range(8)]
    plan.run((None,) * 8, ptrs, check=False)
    assert [name for name, _, _ in log] == ["check", "fwd"] and "sync" not in fake_cuda.state.events
    assert log[0][1][plan.index("report")] == 0xB000 + 16 * _launch.REPORT_SLOTS["attention_varlen"]
    fake_cuda.state.fault = (3, 2, 25, plan)
    log.clear()
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        plan.run((None,) * 8, ptrs, check=True)
    assert [name for name, _, _ in log] == ["check"], "a kernel ran after the index check found a fault"
    plan.run((None,) * 8, ptrs, check=True)   # the fault was taken: the next call runs
    assert [name for name, _, _ in log] == ["check", "check", "fwd"]


class _GraphStep(_Recorder):
    """A step of a graphed plan: records the values written into its block."""

    def write(self, values):
        self.log.append((self.name, list(values), None))

    def argv(self):
        return id(self)


def test_run_launches_several_kernels_as_one_graph(fake_cuda, monkeypatch):
    # Plans of GRAPH_MIN_STEPS kernels or more write every step's arguments, then launch one graph,
    # made once per thread and (device, stream) on the thread's blocks; under capture, and for
    # shorter plans, kernel by kernel.
    monkeypatch.setattr(_plan, "GRAPH_MIN_STEPS", 2)
    made, log = [], []

    class FakeGraph:
        def __init__(self, steps, argvs):
            made.append((tuple(s.name for s in steps), tuple(argvs)))

        def launch(self, stream):
            log.append(("graph", None, stream))

    monkeypatch.setattr(_plan._graph, "KernelGraph", FakeGraph)
    steps = [_GraphStep("check", log), _GraphStep("fwd", log)]
    plan = _plan.Plan("attention_varlen", 8, steps=steps, checked=True, info=VARLEN_INFO)
    ptrs = [0x100 * (i + 1) for i in range(8)]
    for _ in range(2):
        plan.run((None,) * 8, ptrs)
    assert [name for name, _, _ in log] == ["check", "fwd", "graph"] * 2 and log[2][2] == 0x1234
    assert made == [(("check", "fwd"), (id(steps[0]), id(steps[1])))], "one graph for the thread and stream"
    assert log[0][1][:8] == ptrs
    other = []
    thread = threading.Thread(target=lambda: other.append(plan.run((None,) * 8, ptrs)))
    thread.start()
    thread.join()
    assert other and len(made) == 2, "another thread builds its own graph"
    log.clear()
    monkeypatch.setattr(_plan._cp.cuda.runtime, "streamIsCapturing", lambda stream: True)
    plan.run((None,) * 8, ptrs)   # under capture: launched one by one, as the capture records them
    assert [(name, stream) for name, _, stream in log] == [("check", 0x1234), ("fwd", 0x1234)]
    log.clear()
    monkeypatch.setattr(_plan._cp.cuda.runtime, "streamIsCapturing", lambda stream: False)
    plan.steps = steps[1:]   # fewer kernels than GRAPH_MIN_STEPS
    plan.run((None,) * 8, ptrs)
    assert [(name, stream) for name, _, stream in log] == [("fwd", 0x1234)] and len(made) == 2


def test_run_passes_dropouts_seed_and_offset(fake_cuda):
    log = []
    plan = _plan.Plan("attention", 3, steps=[_Recorder("fwd", log)], dropout=(0.5, 2.0))
    seed, offset = 0xDEAD_BEEF_0000_0001, (5 << 32) + 12
    _, _, drawn = plan.run((None,) * 3, [0x10, 0x20, 0x30], rng_state=np.array([seed, offset], dtype=np.uint64))
    assert log[-1][1][plan.index("seed"):] == [seed, 12]
    assert drawn.dtype == np.uint64 and drawn.tolist() == [seed, offset]
    generator = SimpleNamespace(next_state=lambda: (7, 9))
    _, _, drawn = plan.run((None,) * 3, [0x10, 0x20, 0x30], generator=generator)
    assert log[-1][1][plan.index("seed"):] == [7, 9] and drawn.tolist() == [7, 9]


class _Strided:
    """What memory_span reads of an array: its address, shape, byte strides, item size."""

    def __init__(self, ptr, shape, strides, itemsize=4):
        self.data, self.shape, self.strides, self.itemsize = SimpleNamespace(ptr=ptr), shape, strides, itemsize
        self.size = int(np.prod(shape))


def test_memory_span_and_disjoint_outputs():
    rng = np.random.default_rng()
    base = int(rng.integers(1, 2**40)) * 256
    rows = _Strided(base, (4, 8), (32, 4))                  # 128 bytes
    assert _checks.memory_span(rows) == (base, base + 128)
    flipped = _Strided(base + 124, (4, 8), (-32, -4))       # the same bytes walked backwards
    assert _checks.memory_span(flipped) == (base, base + 128)
    assert _checks.memory_span(_Strided(base, (0, 8), (32, 4))) == (0, 0)
    after = _Strided(base + 128, (2, 8), (32, 4))
    _checks.check_disjoint((("out", after),), (("q", rows), ("k", None)))   # adjacent: fine
    with pytest.raises(ValueError, match="out overlaps q"):
        _checks.check_disjoint((("out", _Strided(base + 96, (1, 8), (32, 4))),), (("q", rows),))
    with pytest.raises(ValueError, match="dq overlaps dk"):
        _checks.check_disjoint((("dq", rows), ("dk", flipped)), ())
    # Every other column of a wide array against the columns between: the spans overlap, refused.
    even = _Strided(base, (4, 4), (32, 8))
    odd = _Strided(base + 4, (4, 4), (32, 8))
    with pytest.raises(ValueError, match="out overlaps lse"):
        _checks.check_disjoint((("out", even), ("lse", odd)), ())
    _checks.check_disjoint((("out", _Strided(base, (0,), (4,))),), (("q", rows),))   # empty: no memory
