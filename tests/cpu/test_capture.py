"""CUDA graph capture, the host side (no GPU): the generator's graph states and their offsets, what
a plan's run launches and where it takes its memory when the stream is capturing (the capture
query, CuPy and the launches faked), the calls that refuse to be captured, the params field the
kernels read a device (seed, offset) through, and the rng_state kernel and philox.cuh's
dropout_key compiled by NVRTC for sm_80 and sm_90a. (The GPU side is tests/gpu/test_capture.py.)
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import cuflash
from cuflash import kernels
from cuflash._runtime import capture as _capture, launch as _launch, now as _now, params as _params, pinned as _pinned, plan as _plan, step as _step
from cuflash import random as cr

backward_module = importlib.import_module("cuflash.backward")
CUDA_SRC = Path(__file__).resolve().parents[2] / "cuda_src"


# ----------------------------------------------------------------------------- a fake CuPy

class _Words:
    """A graph state's two device words: what was written into them, from the host."""

    def __init__(self, ptr):
        self.values = [None, None]
        self.data = SimpleNamespace(ptr=ptr)

    def __getitem__(self, index):
        words = self

        class View:
            def set(self, array):
                assert array.dtype == np.uint64
                words.values[index] = [int(x) for x in array]

        return View()


class _FakeCupy:
    """The parts of CuPy that Generator.graph_safe and the reseeds use, with a log."""

    def __init__(self, devices=1):
        self.devices, self.current, self.capturing, self.log = devices, 0, False, []
        self.on_side_stream = False   # inside cuflash._runtime.now.done_now (faked below)
        outer = self

        class Device:
            def __init__(self, device_id):
                self.device_id = device_id

            def __enter__(self):
                self.saved, outer.current = outer.current, self.device_id

            def __exit__(self, *exc):
                outer.current = self.saved

        class Stream:
            def is_capturing(self):
                return outer.capturing and not outer.on_side_stream

            def synchronize(self):
                outer.log.append(("stream_sync", outer.current))

        runtime = SimpleNamespace(getDevice=lambda: self.current, getDeviceCount=lambda: self.devices,
                                  deviceSynchronize=lambda: self.log.append(("device_sync", self.current)))
        self.cuda = SimpleNamespace(runtime=runtime, Device=Device, get_current_stream=Stream)

    def empty(self, shape, dtype):
        assert shape == 2 and np.dtype(dtype) == np.uint64
        self.log.append(("empty", self.current))
        return _Words(0x5000_0000 + 0x100 * len(self.log))


@pytest.fixture
def fake_gpus(monkeypatch):
    """Four fake GPUs; the rng_state kernel's loading recorded instead of done; done_now's private
    stream faked as a stream that no capture records, its end logged."""
    cupy = _FakeCupy(devices=4)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    loaded = []
    monkeypatch.setattr(_capture, "rng_step", lambda device_id: loaded.append(device_id))
    cupy.loaded = loaded

    @contextlib.contextmanager
    def done_now(device_id):
        with cupy.cuda.Device(device_id):
            cupy.on_side_stream = True
            try:
                yield
            finally:
                cupy.on_side_stream = False
            cupy.log.append(("done_now", device_id))

    monkeypatch.setattr(_now, "done_now", done_now)
    return cupy


# ----------------------------------------------------------------------------- graph states

def test_graph_offsets_split_the_upper_half_between_the_gpus():
    assert cr.GRAPH_OFFSET_START == 2**31
    assert [cr.graph_offsets(n) for n in (1, 2, 3, 4, 8, 9, 16)] == [2**31, 2**30, 2**29, 2**29, 2**28, 2**27, 2**27]
    for n in range(1, 40):   # the GPUs' ranges fit the upper half of the counter's 2**32 offsets
        assert n * cr.graph_offsets(n) <= 2**31


def test_a_graph_state_starts_above_the_host_offset_and_leaves_it(fake_gpus):
    seed = int(np.random.default_rng().integers(1, 2**63))
    g = cuflash.Generator(seed)
    for _ in range(3):
        g.next_state()
    words = g.graph_safe()
    assert words.values == [seed, 3 + 2**31], "GPU 0's graph state must start 2**31 above the host offset"
    assert g.graph_safe() is words and g.graph_safe(0) is words, "a second call must not make a new state"
    words2 = g.graph_safe(2)
    assert words2.values == [seed, 3 + 2**31 + 2 * 2**29]   # 4 GPUs: 2**29 offsets each
    assert g.offset == 3 and g.next_state().tolist() == [seed, 3], "making a graph state moved the host offset"
    assert g.get_state().tolist() == [seed, 4]
    assert fake_gpus.loaded == [0, 2], "the rng_state kernel is loaded once per GPU, when its state is made"
    # Each write waited for its copy (the copy is on the current stream, replays may run on others).
    assert fake_gpus.log.count(("stream_sync", 0)) == 1 and fake_gpus.log.count(("stream_sync", 2)) == 1
    assert g._graph_state(0) is words and g._graph_state(1) is None and g._graph_state(2) is words2


def test_manual_seed_restarts_the_graph_states(fake_gpus):
    g = cuflash.Generator(11)
    g.next_state()
    a, b = g.graph_safe(0), g.graph_safe(3)
    a.values[1] += 1000   # replays took offsets on the GPU
    fake_gpus.log.clear()
    g.manual_seed(12)
    assert a.values == [12, 2**31] and b.values == [12, 2**31 + 3 * 2**29]
    assert g.get_state().tolist() == [12, 0]
    # Replays in flight draw from the words: each GPU is waited for before its words are written.
    assert fake_gpus.log.index(("device_sync", 0)) < fake_gpus.log.index(("stream_sync", 0))
    assert ("device_sync", 3) in fake_gpus.log


def test_set_state_keeps_the_graph_offsets(fake_gpus):
    g = cuflash.Generator(21)
    words = g.graph_safe(1)
    words.values[1] += 77
    before = list(words.values)
    fake_gpus.log.clear()
    g.set_state([21, 5])                 # the same seed: a host rewind (recomputation) only
    assert words.values == before and fake_gpus.log == [], "set_state with the same seed touched the GPU"
    assert g.get_state().tolist() == [21, 5]
    g.set_state(np.array([22, 9], dtype=np.uint64))   # a new seed: written, the offset kept
    assert words.values == [22, before[1]]
    assert g.get_state().tolist() == [22, 9]


def test_a_graph_state_is_made_inside_a_capture_outside_the_graph(fake_gpus):
    g = cuflash.Generator(31)
    fake_gpus.capturing = True
    words = g.graph_safe()   # the first capture with dropout makes it, on done_now's private stream
    assert words.values == [31, 2**31]
    assert fake_gpus.log.index(("empty", 0)) < fake_gpus.log.index(("stream_sync", 0)) \
        < fake_gpus.log.index(("done_now", 0)), "the state must be made, written and waited for inside done_now"
    assert fake_gpus.loaded == [0] and g.offset == 0
    with pytest.raises(RuntimeError, match="capturing"):
        g.manual_seed(32)   # its writes would be recorded into the graph (replays may be drawing)


def test_a_generator_without_graph_states_never_touches_cupy(monkeypatch):
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"cupy.{name} used by a generator with no graph state")

    monkeypatch.setitem(sys.modules, "cupy", Untouchable())
    g = cuflash.Generator(41)
    g.next_state()
    g.manual_seed(42)
    g.set_state([43, 7])
    assert g.next_state().tolist() == [43, 7]


# ----------------------------------------------------------------------------- Plan.run

class _Memory:
    def __init__(self, ptr):
        self.ptr = ptr

    def __add__(self, offset):
        return _Memory(self.ptr + offset)


class _Array:
    def __init__(self, shape, dtype, memptr):
        self.shape, self.dtype, self.data = shape, np.dtype(dtype), memptr


class _StreamState:
    counter, error, scratch = 0x9000, 0x9004, 0x9008

    def __init__(self):
        self.plans, self.kept, self.tails, self.arenas = [None] * 3, {}, {}, []

    def arena(self, nbytes):
        if not self.arenas or nbytes > self.arenas[-1][1]:
            self.arenas.append((_Memory(0x5000_0000 + 0x100_0000 * len(self.arenas)), nbytes))
            self.tails.clear()
        return self.arenas[-1][0]

    def report_ptr(self, slot):
        return 0xB000 + 16 * slot

    def take_fault(self, slot):
        return None

    def workspace(self, plan):
        temps = self.kept.get(plan)
        if temps is None:
            base = 0x6000_0000 + 0x10_0000 * len(self.kept)
            temps = self.kept[plan] = [_Array(b.shape, b.dtype, _Memory(base + 0x1000 * i))
                                       for i, b in enumerate(plan.temps)]
        return temps


class _Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def launch(self, values, stream):
        self.log.append((self.name, list(values), stream))


@pytest.fixture
def fake_run(monkeypatch):
    """Plan.run with CuPy faked: the capture query answers ``fake.capturing`` and is counted, every
    launch (the rng_state step's too) is logged."""
    fake = SimpleNamespace(capturing=False, queries=0, allocations=[], memsets=[], log=[], state=_StreamState())

    def is_capturing(stream):
        assert stream == 0x1234
        fake.queries += 1
        return fake.capturing

    def alloc(nbytes):
        fake.allocations.append(nbytes)
        return _Memory(0x7C00_0000_0000 * len(fake.allocations))

    runtime = SimpleNamespace(getDevice=lambda: 0, streamIsCapturing=is_capturing,
                              memsetAsync=lambda *a: fake.memsets.append(a),
                              streamSynchronize=lambda stream: fake.log.append(("sync",)))
    monkeypatch.setattr(_plan, "_cp", SimpleNamespace(ndarray=_Array, cuda=SimpleNamespace(alloc=alloc,
                                                                                               runtime=runtime)))
    monkeypatch.setattr(_launch, "current_stream_ptr", lambda device_id=-1: 0x1234)
    monkeypatch.setattr(_launch, "stream_state", lambda device, stream: fake.state)
    monkeypatch.setattr(_plan, "_call_state", lambda device, stream: fake.state)   # a captured call's own
    monkeypatch.setattr(_plan._recycled, "MAX_BYTES", 0)   # outputs made at every call (test_recycled.py)
    monkeypatch.setattr(_capture, "_rng_steps", {0: _Recorder("rng", fake.log)})
    monkeypatch.setattr(_capture, "relaxed_capture_mode", contextlib.nullcontext)
    return fake


class _Generator:
    """A generator with (or without) a graph state on GPU 0, counting its host draws."""

    def __init__(self, graph=True):
        self.draws, self.made = 0, 0
        self.words = _Array((2,), np.uint64, _Memory(0x4440)) if graph else None

    def next_state(self):
        self.draws += 1
        return np.array([7, 100 + self.draws], dtype=np.uint64)

    def _graph_state(self, device_id):
        assert device_id == 0
        return self.words

    def graph_safe(self, device_id):
        assert device_id == 0 and self.words is None
        self.made += 1
        self.words = _Array((2,), np.uint64, _Memory(0x4440))
        return self.words


def _dropout_plan(log, temps=()):
    return _plan.Plan("attention", 5, temps=temps, steps=[_Recorder("fwd", log)], dropout=(0.5, 2.0))


def test_every_call_asks_about_capture_once(fake_run):
    plan = _plan.Plan("attention", 5, outputs={3: _step.Buffer((4, 8), np.float32)},
                          steps=[_Recorder("fwd", fake_run.log)], results=(3,))
    for capturing in (False, True):
        fake_run.capturing = capturing
        plan.run((None,) * 5, [0x10, 0x20, 0x30, 0, 0])
    assert fake_run.queries == 2
    assert [entry[0] for entry in fake_run.log] == ["fwd", "fwd"]


def test_a_captured_call_runs_on_state_of_its_own(fake_run, monkeypatch):
    # Two captured calls of one plan on one stream get their own words and temporaries (a graph may
    # run them at once); uncaptured calls keep sharing the stream's.
    own = []

    def call_state(device, stream):
        state = _StreamState()
        state.counter, state.error, state.scratch = (0xA000 * (len(own) + 2) + 4 * i for i in range(3))
        state.arenas.append((_Memory(0x7000_0000 * (len(own) + 1)), 1 << 20))
        own.append(state)
        return state

    monkeypatch.setattr(_plan, "_call_state", call_state)
    temps = (_step.Buffer((32, 4), np.float32),)
    plan = _plan.Plan("attention", 5, temps=temps, steps=[_Recorder("fwd", fake_run.log)])
    for capturing in (True, True, False, False):
        fake_run.capturing = capturing
        plan.run((None,) * 5, [0x10] * 5)
    words = [entry[1][plan.index("counter")] for entry in fake_run.log]
    arenas = [entry[1][plan.temp_index(0)] for entry in fake_run.log]
    assert len(own) == 2 and words[:2] == [own[0].counter, own[1].counter] and words[2] == words[3] == 0x9000
    assert len(set(arenas[:3])) == 3 and arenas[2] == arenas[3], "the captured calls' temporaries are their own"


def test_dropout_outside_a_capture_draws_on_the_host(fake_run):
    generator = _Generator()
    plan = _dropout_plan(fake_run.log)
    _, _, drawn = plan.run((None,) * 5, [0x10, 0x20, 0x30, 0x40, 0x50], generator=generator)
    assert [entry[0] for entry in fake_run.log] == ["fwd"], "the rng_state kernel ran outside a capture"
    values = fake_run.log[0][1]
    assert values[plan.index("dropout_state")] == 0
    assert values[plan.index("seed")] == 7 and values[plan.index("offset")] == 101
    assert drawn.tolist() == [7, 101] and generator.draws == 1 and fake_run.queries == 1


@pytest.mark.parametrize("rng_output", [False, True])
def test_dropout_under_capture_draws_on_the_gpu(fake_run, rng_output):
    generator = _Generator()
    plan = _dropout_plan(fake_run.log)
    fake_run.capturing = True
    calls = []
    for _ in range(2):
        fake_run.log.clear()
        _, _, drawn = plan.run((None,) * 5, [0x10, 0x20, 0x30, 0x40, 0x50], generator=generator,
                               rng_output=rng_output)
        assert [entry[0] for entry in fake_run.log] == ["rng", "fwd"], "the state must be drawn before the kernels"
        rng_values, fwd_values = fake_run.log[0][1], fake_run.log[1][1]
        assert rng_values == [0x4440, drawn.data.ptr], "rng_state reads the generator's words, writes the call's"
        assert fwd_values[plan.index("dropout_state")] == drawn.data.ptr
        assert fwd_values[plan.index("seed")] == 0 and fwd_values[plan.index("offset")] == 0
        assert drawn.shape == (2,) and drawn.dtype == np.uint64
        calls.append(drawn.data.ptr)
    assert generator.draws == 0, "a captured call drew its state on the host"
    if rng_output:   # each returned state has its own words (a forward's backward reads them later)
        assert calls[0] != calls[1] and fake_run.allocations == [16, 16]
    else:            # not returned: the stream's scratch words
        assert calls[0] == calls[1] and fake_run.allocations == []


def test_dropout_under_capture_makes_the_graph_state_it_needs(fake_run):
    plan = _dropout_plan(fake_run.log)
    fake_run.capturing = True
    generator = _Generator(graph=False)
    for _ in range(2):
        fake_run.log.clear()
        plan.run((None,) * 5, [0x10] * 5, generator=generator)
        assert [entry[0] for entry in fake_run.log] == ["rng", "fwd"] and fake_run.log[0][1][0] == 0x4440
    assert generator.made == 1 and generator.draws == 0, "the graph state is made once, and nothing drawn on the host"


def test_small_temporaries_come_from_the_streams_arena(fake_run):
    # The arena is never freed, so a graph may keep using it (a captured call's is its own state's).
    temps = (_step.Buffer((32, 4), np.float32), _step.Buffer((16,), np.float32, zero=True))
    plan = _plan.Plan("attention", 5, temps=temps, steps=[_Recorder("fwd", fake_run.log)])
    for capturing in (False, True, False):
        fake_run.capturing = capturing
        fake_run.log.clear()
        _, got, _ = plan.run((None,) * 5, [0x10] * 5)
        arena = fake_run.state.arenas[-1][0]
        assert got is arena and fake_run.state.arenas[-1][1] == 768   # two blocks of 256-byte multiples
        values = fake_run.log[0][1]
        assert values[plan.temp_index(0)] == arena.ptr and values[plan.temp_index(1)] == arena.ptr + 512
        assert values[5 + 2:5 + 5] == [0x9000, 0x9004, 0x9008]   # then the stream's words
    assert fake_run.allocations == [] and fake_run.queries == 3 and len(fake_run.state.arenas) == 1
    assert [m[0] for m in fake_run.memsets] == [arena.ptr + 512] * 3, "the accumulator is zeroed at every call"
    # A plan with more temporaries grows the arena; the first plan's calls then use the new one.
    bigger = _plan.Plan("attention", 5, temps=(_step.Buffer((4096,), np.float32),),
                            steps=[_Recorder("fwd", fake_run.log)])
    bigger.run((None,) * 5, [0x10] * 5)
    fake_run.log.clear()
    plan.run((None,) * 5, [0x10] * 5)
    assert fake_run.log[0][1][plan.temp_index(0)] == fake_run.state.arenas[-1][0].ptr != arena.ptr


def test_a_streams_tails_stay_bounded(fake_run, monkeypatch):
    # Each plan run on a stream keeps its tail (and so the plan) there: at most as many as the memo.
    monkeypatch.setattr(_plan, "_MEMO_ENTRIES", 4)
    for n in range(10):
        plan = _plan.Plan("attention", 5, temps=(_step.Buffer((16,), np.float32),),
                              steps=[_Recorder("fwd", fake_run.log)])
        plan.run((None,) * 5, [0x10] * 5)
        assert plan in fake_run.state.tails and len(fake_run.state.tails) <= 4


def test_large_temporaries_under_capture_are_kept_by_the_stream(fake_run):
    temps = (_step.Buffer((_launch.ARENA_BYTES // 4,), np.float32),
             _step.Buffer((16,), np.float32, zero=True))
    plan = _plan.Plan("attention", 5, temps=temps, steps=[_Recorder("fwd", fake_run.log)])
    plan.run((None,) * 5, [0x10] * 5)
    plan.run((None,) * 5, [0x10] * 5)
    assert len(fake_run.allocations) == 2 and fake_run.state.kept == {}, "outside a capture: one block per call"
    assert fake_run.state.arenas == []
    fake_run.allocations.clear()
    fake_run.memsets.clear()
    fake_run.capturing = True
    for _ in range(2):
        fake_run.log.clear()
        _, got, _ = plan.run((None,) * 5, [0x10] * 5)
        kept = fake_run.state.kept[plan]
        assert got is kept and fake_run.allocations == []
        values = fake_run.log[0][1]
        assert values[plan.temp_index(0)] == kept[0].data.ptr and values[plan.temp_index(1)] == kept[1].data.ptr
    # The accumulator is zeroed in the graph, at every replay.
    assert [m[0] for m in fake_run.memsets] == [kept[1].data.ptr] * 2


def test_check_true_cannot_be_captured(fake_run):
    plan = _plan.Plan("attention_varlen", 8, steps=[_Recorder("check", fake_run.log),
                                                         _Recorder("fwd", fake_run.log)], checked=True)
    fake_run.capturing = True
    with pytest.raises(RuntimeError, match="check=True"):
        plan.run((None,) * 8, [0x100] * 8, check=True)
    assert fake_run.log == []
    plan.run((None,) * 8, [0x100] * 8, check=False)
    assert [entry[0] for entry in fake_run.log] == ["check", "fwd"]


def test_a_device_rng_state_is_read_by_the_kernels(fake_run):
    plan = _dropout_plan(fake_run.log)
    for capturing in (False, True):
        fake_run.capturing = capturing
        fake_run.log.clear()
        _, _, drawn = plan.run((None,) * 5, [0x10] * 5, rng_state=0xABC0)
        assert [entry[0] for entry in fake_run.log] == ["fwd"] and drawn is None
        values = fake_run.log[0][1]
        assert values[plan.index("dropout_state")] == 0xABC0 and values[plan.index("seed")] == 0


# ----------------------------------------------------------------------------- refusals

def test_refuse_capture(monkeypatch):
    monkeypatch.setattr(_capture, "is_capturing", lambda: False)
    _capture.refuse_capture("decode", "why")
    monkeypatch.setattr(_capture, "is_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"decode call cannot be captured.*: why"):
        _capture.refuse_capture("decode", "why")


def test_the_first_call_on_a_stream_makes_its_state_outside_the_capture(monkeypatch):
    # Its words are allocated and zeroed inside done_now (a private stream, waited for), so a
    # first call inside a capture needs no warm-up on the capturing stream.
    events = []

    @contextlib.contextmanager
    def done_now(device_id):
        events.append(("enter", device_id))
        yield
        events.append(("exit", device_id))

    class State:
        def __init__(self, device_id):
            events.append(("made", device_id))

    monkeypatch.setattr(_launch, "done_now", done_now)
    monkeypatch.setattr(_launch, "StreamState", State)
    key = _launch.stream_key(77, 0xCA97)
    _launch._states.pop(key, None)
    try:
        state = _launch.stream_state(77, 0xCA97)
        assert events == [("enter", 77), ("made", 77), ("exit", 77)]
        assert _launch.stream_state(77, 0xCA97) is state and len(events) == 3, "a stream's state is made once"
    finally:   # not through monkeypatch, which would put the fake state back at teardown
        _launch._states.pop(key, None)


class _CudaArray:
    """What backward reads of an rng_state on the GPU (after _checks.as_cuda_array)."""

    def __init__(self, dtype=np.uint64, shape=(2,), contiguous=True, ptr=0xD00D00):
        self.dtype, self.shape = np.dtype(dtype), shape
        self.flags = SimpleNamespace(c_contiguous=contiguous)
        self.data = SimpleNamespace(ptr=ptr)

    def __dlpack_device__(self):
        return (2, 0)   # kDLCUDA, device 0


def test_backward_takes_a_device_rng_state_without_reading_it(monkeypatch):
    monkeypatch.setattr(backward_module._checks, "as_cuda_array", lambda x, name: x)
    state = backward_module._dropout_state
    assert state(0.0, _CudaArray()) is None
    assert state(0.1, _CudaArray(ptr=0xD00D00)) == 0xD00D00
    assert state(0.1, _CudaArray(dtype=np.int64, ptr=0xE00)) == 0xE00
    with pytest.raises(TypeError, match="uint64"):
        state(0.1, _CudaArray(dtype=np.uint32))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        state(0.1, _CudaArray(shape=(3,)))
    with pytest.raises(ValueError, match="strided"):
        state(0.1, _CudaArray(contiguous=False))
    # Host states stay values (NumPy, lists).
    assert state(0.1, np.array([5, 2**40 + 3], dtype=np.uint64)) == (5, 2**40 + 3)
    assert state(0.1, [1, 2]) == (1, 2)
    with pytest.raises(ValueError, match="rng_state"):
        state(0.1, [1, 2, 3])


# ----------------------------------------------------------------------------- params and kernels

def test_params_carry_the_device_state_beside_the_seed():
    for layout, prefix in ((_params.FWD, ""), (_params.BWD, "fwd."), (_params.DECODE, "score.")):
        offsets, codes = layout.offsets, layout.codes
        assert codes[prefix + "dropout_state"] == "Q"
        assert offsets[prefix + "dropout_state"] % 8 == 0
        assert offsets[prefix + "dropout_seed"] == offsets[prefix + "dropout_state"] + 8
        assert layout.defaults[prefix + "dropout_state"] == 0, "a call from the host must read the values"


def test_plan_value_names():
    plan = _plan.Plan("attention", 4, temps=(_step.Buffer((2,), np.float32),))
    names = ("counter", "error", "scratch", "report", "split_counters", "dropout_state", "seed", "offset")
    assert [plan.index(n) for n in names] == list(range(5, 5 + len(names)))


def test_the_rng_state_kernel_is_built_everywhere():
    variant = kernels.rng_state.rng_state_variant()
    assert variant.family == "rng_state" and (CUDA_SRC / "rng_state.cu").is_file()
    assert variant in kernels.catalogue.precompile_variants()
    assert variant in kernels.catalogue.precompile_variants(families=("rng_state",))
    assert {(variant, arch) for arch in ("sm_80", "sm_90a")} <= set(kernels.catalogue.ci_variants())
    for arch in ("sm_80", "sm_90a"):
        assert variant in kernels.catalogue.reachable_variants(arch, ("bfloat16",), (128,))


HARNESS = r"""
#include "philox.cuh"

struct Params {   // the fields dropout_key reads, as FwdParams has them
    const unsigned long long* dropout_state;
    unsigned long long dropout_seed;
    unsigned int dropout_offset;
    int dropout_row0, dropout_col0;
};

extern "C" __global__ void dropout_key_harness(Params p, int rows, unsigned int* out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows) return;
    const uint4 w = cuflash::dropout_words(cuflash::dropout_key(p), 1, 2, i, 3, 5);
    out[4 * i] = w.x; out[4 * i + 1] = w.y; out[4 * i + 2] = w.z; out[4 * i + 3] = w.w;
}
"""


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_dropout_key_and_the_rng_state_kernel_compile(arch):
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    for source, name in ((HARNESS, "dropout_key_harness.cu"), ((CUDA_SRC / "rng_state.cu").read_text(),
                                                               "rng_state.cu")):
        prog = nvrtc.createProgram(source, name, [], [])
        try:
            try:
                nvrtc.compileProgram(prog, ["-std=c++17", f"-arch={arch}", f"-I{CUDA_SRC}"])
            except nvrtc.NVRTCError as e:
                pytest.fail(f"NVRTC failed on {name} for {arch}: {e}\n{nvrtc.getProgramLog(prog)}")
            assert len(nvrtc.getCUBIN(prog)) > 0
        finally:
            nvrtc.destroyProgram(prog)


def test_plan_makes_the_graph_state_of_a_dropout_forward(monkeypatch):
    """cuflash.plan of a forward with dropout makes its generator's graph state (a run may be captured);
    of a backward, or without dropout, it does not."""
    made = []

    class Gen:
        def graph_safe(self):
            made.append(self)

    gen = Gen()

    def fake_entry(entry, dropout):
        def fn(*args, **kwargs):   # what an entry point does under planned(): a lookup, then run
            _plan._planning.get()["key"] = ("key",)
            raise _plan.PlanningDone(_plan.Plan(entry, 1, dropout=dropout))
        return fn

    _pinned.planned(fake_entry("attention", (1, 2.0)), generator=gen)
    assert made == [gen]
    _pinned.planned(fake_entry("attention_backward", (1, 2.0)), generator=gen)
    _pinned.planned(fake_entry("attention", None), generator=gen)
    assert made == [gen]
    monkeypatch.setattr(_plan, "_default_generator", lambda: gen)
    _pinned.planned(fake_entry("attention_varlen", (1, 2.0)))
    assert made == [gen, gen]
