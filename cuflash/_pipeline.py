"""The host pipeline of every entry point: check -> plan -> pack -> launch, and the memo of plans.

An entry point names its array operands (inputs, optional outputs, index arrays) and its options.
The first call with a given layout checks everything (:mod:`cuflash._checks`), plans the kernels
(:mod:`cuflash._heuristics`) and packs their parameters (:mod:`cuflash._params`) into a
:class:`Plan`, which it then runs. The plan is remembered under a key made of everything the checks
and the planning looked at except the data pointers: each operand's type, shape, strides, dtype and
device, the options, the forced kernel family and the current device. A repeat call with the same
key, from CuPy arrays or torch tensors, does only what depends on the pointers: their 16-byte
alignment, the outputs' allocation, writing the new pointers (into the packed structs and the
tensor maps, each step's argument block kept per thread at a fixed address), the launches (a plan
of GRAPH_MIN_STEPS kernels or more: one launch of a CUDA graph of them, :mod:`cuflash._graph`).

torch tensors are read directly (``data_ptr()``, ``stride()``; torch is never imported here) when
torch's current stream is CuPy's current stream, which is all that DLPack's stream handshake would
have ordered; otherwise, and for any other DLPack producer, the call takes the full path through
``cupy.from_dlpack``.
"""

from __future__ import annotations

import contextvars
import operator
import struct
import sys
import threading

import numpy as np

from . import _compile, _graph, _heuristics, _launch, _params, _tma

__all__ = ["Plan", "Step", "lookup", "remember", "planned", "PlanningDone"]

_MEMO_ENTRIES = 512
# Plans of at least this many kernels launch them as one CUDA graph (cuflash/_graph.py); 0: never.
GRAPH_MIN_STEPS = 2
_memo: dict = {}
_cp = None   # the cupy module, bound at the first call (cuflash imports no CUDA library at import)
_random = None   # cuflash.random, bound at the first call that draws dropout


def _cupy():
    global _cp
    if _cp is None:
        import cupy

        _cp = cupy
    return _cp


class Step:
    """One kernel launch of a plan, its arguments laid out once.

    ``args`` are the kernel's parameters in order: ``("struct", Template)``, ``("map", value index,
    TensorMapSpec)`` or ``("pointer", value index)`` (a pointer passed by value). They are laid out in
    one block, the argument pointer array first (``kernelParams``), then each parameter's bytes (at
    8-byte aligned offsets). A tensor map's bytes are encoded here, at a stand-in address that each
    call replaces (:func:`cuflash._tma.address_patchable`; where the driver's layout does not allow
    it, each call encodes its maps instead).

    Each thread that launches the step has its own copy of the block, at a fixed address, its
    pointer array filled in once. A call writes only what changes per call into it (64-bit words:
    the template's pointer slots, the maps' addresses, pointer parameters; other slots by
    ``pack_into``, one per run of adjacent fields), so every other byte stays what the plan packed,
    and launches it. The driver has copied the arguments when the launch returns, so the thread's
    next call may write the block again.
    """

    __slots__ = ("func", "grid", "threads", "smem", "args", "dependent", "block", "offsets", "words", "writes",
                 "maps", "_local")

    def __init__(self, func: int, grid, threads: int, smem: int, args, dependent: bool = False):
        self.func, self.grid, self.threads, self.smem = func, tuple(int(g) for g in grid), threads, smem
        self.args = tuple(args)
        self.dependent = dependent   # a programmatic dependent of the plan's previous step (_launch.launch)
        words, writes, maps, offsets = [], [], [], []
        block = bytearray(8 * len(self.args))
        for arg in self.args:
            block += bytes(-len(block) % 8)
            position = len(block)
            offsets.append(position)
            if arg[0] == "struct":
                block += arg[1].data
                for offset, fmt, keys in arg[1].runs():
                    if fmt == "<" + "Q" * len(keys) and (position + offset) % 8 == 0:
                        words += [((position + offset) // 8 + i, key) for i, key in enumerate(keys)]
                    else:
                        writes.append((position + offset, struct.Struct(fmt), operator.itemgetter(*keys),
                                       len(keys) == 1))
            elif arg[0] == "map":
                if _tma.address_patchable():
                    block += _tma.template(arg[2])
                    words.append((position // 8, arg[1]))   # bytes 0..7: the global address
                else:
                    block += bytes(128)
                    maps.append((position, arg[1], arg[2]))
            else:
                block += bytes(8)
                words.append((position // 8, arg[1]))
        block += bytes(-len(block) % 8)
        self.block, self.offsets = bytes(block), tuple(offsets)
        self.words, self.writes, self.maps = tuple(words), tuple(writes), tuple(maps)
        self._local = threading.local()

    def _thread_block(self):
        """The calling thread's block: (bytearray, its 64-bit words, its address), made at its first
        launch (the words' memoryview pins the bytearray, so its address never changes)."""
        block = bytearray(self.block)
        base = _launch.address(block)
        struct.pack_into(f"<{len(self.offsets)}Q", block, 0, *[base + offset for offset in self.offsets])
        mine = self._local.block = (block, memoryview(block).cast("Q"), base)
        return mine

    def launch(self, values, stream: int) -> None:
        """Launch with the call's ``values`` (see :class:`Plan`) on ``stream``."""
        base = self.write(values)
        _launch.launch(self.func, self.grid, self.threads, self.smem, base, stream, self.dependent)

    def argv(self) -> int:
        """The address of the calling thread's argument pointer array (fixed for the thread)."""
        try:
            return self._local.block[2]
        except AttributeError:
            return self._thread_block()[2]

    def write(self, values) -> int:
        """Write the call's ``values`` into the calling thread's block; returns its argument pointer
        array's address."""
        try:
            block, words, base = self._local.block
        except AttributeError:
            block, words, base = self._thread_block()
        for index, key in self.words:
            words[index] = values[key]   # native byte order: little-endian on every CUDA host
        for offset, packer, get, single in self.writes:
            if single:
                packer.pack_into(block, offset, get(values))
            else:
                packer.pack_into(block, offset, *get(values))
        for offset, key, spec in self.maps:
            block[offset:offset + 128] = _tma.encode_at(values[key], spec)
        return base


class Buffer:
    """An array a plan allocates per call (or owns, for a pinned plan): shape, dtype, and whether
    each call zeroes it first (temporaries only)."""

    __slots__ = ("shape", "dtype", "zero", "nbytes")

    def __init__(self, shape, dtype, zero: bool = False):
        self.shape, self.dtype, self.zero = tuple(int(n) for n in shape), np.dtype(dtype), zero
        self.nbytes = self.dtype.itemsize * int(np.prod(self.shape))

    def make(self):
        import cupy

        return cupy.empty(self.shape, dtype=self.dtype)


# The values of a call after its operands and temporaries (see Plan): the stream's words, then
# dropout's state: the address of its device words (0: none, the seed and offset are the values),
# its seed and its offset (low 32 bits).
_VALUE_NAMES = ("counter", "error", "scratch", "report", "split_counters", "dropout_state", "seed", "offset")


class Plan:
    """Everything a call of one layout launches, independent of its data pointers.

    Values of a call, by index: the entry point's operands (0 .. n_operands - 1: their pointers, 0
    for an absent one), then the temporaries, then the stream's words (COUNTER, ERROR, SCRATCH,
    REPORT, SPLIT_COUNTERS), then dropout's state (DROPOUT_STATE, SEED, OFFSET).

    Under CUDA graph capture (CuPy's current stream capturing), what a replay needs must outlive the
    call and may not be read on the host: the temporaries come from memory that the stream keeps
    (its arena for small ones, which it never frees, :meth:`cuflash._launch.StreamState.arena`; a
    pinned plan's own workspace; :meth:`cuflash._launch.StreamState.workspace`), and a call that
    draws dropout takes its (seed, offset) on the GPU, from its generator's graph state, by a launch
    of ``cuda_src/rng_state.cu`` ahead of its steps; its kernels read them through DROPOUT_STATE.
    Graphs captured on one stream share that stream's words and workspaces, as calls on it do: run
    them one after the other (capture on separate streams the graphs that are to run at once).

    Parameters
    ----------
    entry : str
        The entry point (names the fault-report slot of index checks).
    outputs : dict
        Operand index -> Buffer: an output the call allocates when the caller passed none.
    temps : sequence of Buffer
        Temporaries (split partials, lse buffers, accumulators).
    steps : sequence of Step
    aligned : sequence of int
        Operand indices whose pointers must be 16-byte aligned (the plan was made for aligned ones).
    dropout : (float, float) or None
        (threshold, rescale) when the call draws dropout: a seed and offset per call.
    checked : bool
        Whether the plan's first step checks the index arrays: the index check kernel, or a decode
        kernel that checks its lengths itself (its faults go to the entry's report slot).
    info : dict
        What error messages need (capacity, max_pages, ...).
    split_counters : int
        Zeroed int32 counters of the stream the plan's kernels use and leave at zero (split-KV
        decode counts its finished splits in them).
    """

    def __init__(self, entry, n_operands, *, outputs=None, temps=(), steps=(), aligned=(), dropout=None,
                 checked=False, info=None, results=None, split_counters=0):
        self.entry = entry
        self.n_operands = n_operands
        self.outputs = dict(outputs or {})
        self.temps = tuple(temps)
        self.steps = list(steps)
        self.aligned = tuple(aligned)
        self.dropout = dropout
        self.checked = checked
        self.info = dict(info or {})
        self.results = tuple(results) if results is not None else tuple(self.outputs)
        self.slot = _launch.REPORT_SLOTS.get(entry)
        self.split_counters = split_counters
        self._temp_offsets, offset = [], 0
        for buffer in self.temps:
            self._temp_offsets.append(offset)
            offset += -(-buffer.nbytes // 256) * 256
        self._temp_bytes = offset
        self._zeroed = tuple(i for i, buffer in enumerate(self.temps) if buffer.zero)
        self._output_indices = tuple(self.outputs)
        self._output_layouts = {}
        # A call's pointers of the outputs, and its results from its operands, read by one C call
        # each (a tuple whatever their number) rather than by comprehensions: merge_states'
        # Plan.run 2.2 -> 1.8 us on a 2-core CPU (benchmarks/NOTES.md, session 31).
        self._output_ptrs = _getter(self._output_indices)
        self._results_of = _getter(self.results)
        self._graphs = threading.local()   # per thread: (device, stream, kernels) -> _graph.KernelGraph

    def _output_layout(self, missing):
        """(index, shape, dtype, offset) of each missing output in one allocation, and its size."""
        layout, offset = [], 0
        for index in missing:
            buffer = self.outputs[index]
            layout.append((index, buffer.shape, _array_dtype(buffer.dtype), offset))
            offset += -(-buffer.nbytes // 256) * 256
        return tuple(layout), offset

    # Value indices of the stream's words and the per-call dropout state.
    def index(self, name: str) -> int:
        base = self.n_operands + len(self.temps)
        return base + _VALUE_NAMES.index(name)

    def temp_index(self, i: int) -> int:
        return self.n_operands + i

    def run(self, operands, ptrs, where=None, *, generator=None, rng_state=None, rng_output=False, check=False,
            workspace=None):
        """Launch the plan for one call.

        Parameters
        ----------
        operands : tuple
            The entry point's operands (for the outputs the caller gave).
        ptrs : list of int
            Their data pointers (0 for absent ones).
        where : (int, int), optional
            (device, stream) of the call, as :func:`lookup` read them; read here when None.
        generator : cuflash.Generator, optional
            Dropout's source (the default generator when None).
        rng_state : (int, int) or int, optional
            Dropout's (seed, offset) for this call instead (the backward replays the forward's), or
            the address of a device uint64 (2,) array holding them (read by the kernels).
        rng_output : bool
            Whether the caller returns the drawn state: under capture it then gets an array of its
            own (else the stream's scratch words hold it).
        check : bool
            Wait for the index check and raise its fault now.
        workspace : list of arrays, optional
            The temporaries (a pinned plan's); allocated here when None.

        Returns
        -------
        (results, temps, rng_state): the output arrays (the caller's or new ones, in the order of
        ``results``), the temporaries (the workspace's arrays, or the one allocation holding them,
        the stream's arena for small ones, valid until the next call on the stream:
        ``temp_array(temps, i)`` views one), and the dropout state drawn (numpy uint64 (2,); under
        capture a CuPy uint64 (2,) array that each replay fills; None without dropout or when given).

        Raises
        ------
        RuntimeError
            Under capture: ``check=True`` (it waits for the GPU), or dropout from a generator with
            no graph state on this GPU (:meth:`cuflash.Generator.graph_safe`).
        """
        if _planning.get() is not None:
            raise PlanningDone(self)
        cupy = _cp or _cupy()

        if where is None:
            device_id = cupy.cuda.runtime.getDevice()
            stream = _launch.current_stream_ptr(device_id)
        else:
            device_id, stream = where
        state = _launch.stream_state(device_id, stream)
        if self.slot is not None:
            _raise_fault(state, self.slot)
        capturing = None   # asked only where the answer changes what the call does
        if check and self.checked:
            capturing = cupy.cuda.runtime.streamIsCapturing(stream)
            if capturing:
                raise RuntimeError(f"{self.entry}(check=True) waits for the GPU's check of the index arrays, which a "
                                   "stream capture cannot do: capture it with check=False (a bad index then makes "
                                   "the replay write nothing and is raised by the next call on the stream or by "
                                   "cuflash.check_errors())")
        if workspace is None and self.temps:
            pinned = _pinned.get()
            if pinned is not None and pinned.plan is self:
                workspace = pinned.workspace(device_id, stream)
        # What follows the operands' pointers in the values: the temporaries' pointers and the
        # stream's words, made once per stream for the plans whose temporaries fit the arena.
        if workspace is None and self._temp_bytes <= _launch.ARENA_BYTES:
            temps, tail = state.tails.get(self) or self._arena_tail(state)
        else:
            if workspace is None:
                if stream == _launch.PER_THREAD_STREAM:
                    # CuPy's pool files freed blocks under the stream's handle, which every thread's
                    # per-thread stream shares: a block freed here could go to another thread while
                    # this thread's kernels still use it. Each thread keeps its temporaries instead.
                    workspace = state.workspace(self)
                else:
                    capturing = cupy.cuda.runtime.streamIsCapturing(stream)
                    if capturing:   # the graph uses them at every replay: the stream keeps them
                        workspace = state.workspace(self)
            if workspace is not None:
                temps = workspace
                tail = [t.data.ptr for t in temps]
            else:
                # One allocation for all temporaries; the pool reuses it only after this stream's
                # work, so dropping it at return is safe.
                temps = cupy.cuda.alloc(self._temp_bytes)
                tail = [temps.ptr + offset for offset in self._temp_offsets]
            tail += self._stream_words(state)
        draw = None
        if self.dropout is not None and rng_state is None:
            source = generator or _default_generator()
            if capturing is None:
                capturing = cupy.cuda.runtime.streamIsCapturing(stream)
            if capturing:   # drawn on the GPU at each replay, from the generator's graph state
                draw = _graph_draw(cupy, source, device_id, state, rng_output, self.entry)
            else:
                rng_state = source.next_state()
        values = ptrs + tail
        made = None
        if self._output_indices and not all(self._output_ptrs(values)):
            missing = tuple([index for index in self._output_indices if not values[index]])
            layout = self._output_layouts.get(missing)
            if layout is None:
                layout = self._output_layouts[missing] = self._output_layout(missing)
            if layout[1]:
                # One allocation for the outputs the caller did not give (an allocation costs
                # about a microsecond of host time, cupy.empty nearly three).
                memory = cupy.cuda.alloc(layout[1])
                ndarray, base, made = cupy.ndarray, memory.ptr, {}
                for index, shape, dtype, offset in layout[0]:
                    made[index] = ndarray(shape, dtype, memory + offset if offset else memory)
                    values[index] = base + offset
        drawn = None
        if self.dropout is not None:
            if draw is not None:
                drawn = draw[2]
                values += (drawn.data.ptr, 0, 0)
            elif type(rng_state) is int:   # the address of device words (a backward's device rng_state)
                values += (rng_state, 0, 0)
            else:
                seed, offset = int(rng_state[0]), int(rng_state[1])
                values += (0, seed, offset & 0xFFFFFFFF)
                drawn = np.array([seed, offset], dtype=np.uint64)
        for i in self._zeroed:   # accumulators start at zero at every call, owned ones too
            cupy.cuda.runtime.memsetAsync(tail[i], 0, self.temps[i].nbytes, stream)
        steps = self.steps
        if draw is not None:
            draw[0].launch(draw[1], stream)
        if self.checked:
            state.plans[self.slot] = self
            if check:
                steps[0].launch(values, stream)
                cupy.cuda.runtime.streamSynchronize(stream)
                _raise_fault(state, self.slot)
                steps = steps[1:]
        if len(steps) >= GRAPH_MIN_STEPS > 0 and draw is None and not (
                capturing if capturing is not None else cupy.cuda.runtime.streamIsCapturing(stream)):
            for step in steps:
                step.write(values)
            self._graph(device_id, stream, steps).launch(stream)
        else:
            for step in steps:
                step.launch(values, stream)
        results = self._results_of(operands)
        if made:
            results = [made.get(i, x) for i, x in zip(self.results, results)]
        return results, temps, drawn

    def _stream_words(self, state) -> list:
        """The stream's words in a call's values (COUNTER .. SPLIT_COUNTERS)."""
        return [state.counter, state.error, state.scratch, state.report_ptr(self.slot) if self.checked else 0,
                state.split_counters(self.split_counters) if self.split_counters else 0]

    def _arena_tail(self, state):
        """(temps, tail) of a call on ``state``'s stream with the temporaries in its arena, kept in
        ``state.tails`` (which the arena's and the split counters' growth clears)."""
        if self.temps:
            temps = state.arena(self._temp_bytes)
            tail = [temps.ptr + offset for offset in self._temp_offsets]
        else:
            temps, tail = [], []
        tail += self._stream_words(state)
        if len(state.tails) >= _MEMO_ENTRIES:   # bounded like the memo (each entry keeps its plan alive)
            state.tails.clear()
        state.tails[self] = (temps, tail)
        return temps, tail

    def _graph(self, device_id: int, stream: int, steps):
        """The calling thread's graph of ``steps`` for this stream (made at its first use)."""
        graphs = getattr(self._graphs, "by_stream", None)
        if graphs is None:
            graphs = self._graphs.by_stream = {}
        key = (device_id, stream, len(steps))
        graph = graphs.get(key)
        if graph is None:
            graph = graphs[key] = _graph.KernelGraph(steps, [step.argv() for step in steps])
        return graph


class _RngScratch:
    """The stream's two words holding the state that a captured call drew but does not return
    (``attention``, ``attention_varlen``), kept by the stream's workspaces under this key."""

    temps = (Buffer((2,), np.uint64),)


_RNG_SCRATCH = _RngScratch()
_rng_steps: dict = {}   # device id -> the Step of cuda_src/rng_state.cu


def rng_step(device_id: int) -> Step:
    """The launch of ``cuda_src/rng_state.cu`` on a device (values: the generator's graph state, the
    call's words); its kernel is loaded at the first call (made outside any capture by
    :meth:`cuflash.Generator.graph_safe`)."""
    step = _rng_steps.get(device_id)
    if step is None:
        func = _launch.prepare_kernel(_compile.get_kernel(_heuristics.rng_state_variant()), 0, device_id)
        step = _rng_steps[device_id] = Step(func, (1, 1, 1), 1, 0, (("pointer", 0), ("pointer", 1)))
    return step


def _graph_draw(cupy, generator, device_id: int, state, rng_output: bool, entry: str):
    """Dropout's state for a captured call: the launch that draws it on the GPU at each replay
    (step, values), and the call's words it fills (a new array when the caller returns it, else the
    stream's scratch words), as (step, values, words)."""
    words = generator._graph_state(device_id)
    if words is None:
        raise RuntimeError(f"{entry} with dropout is being captured in a CUDA graph, and its generator has no graph "
                           "state on this GPU, which a capture cannot make (it would take a copy to the GPU): call "
                           "generator.graph_safe() (cuflash.default_generator().graph_safe() without a generator), "
                           "or plan the call with cuflash.plan(...), before capturing")
    if rng_output:
        call = cupy.ndarray((2,), np.uint64, cupy.cuda.alloc(16))
    else:
        call = state.workspace(_RNG_SCRATCH)[0]
    step = _rng_steps.get(device_id) or rng_step(device_id)
    return step, [words.data.ptr, call.data.ptr], call


# Why a call that copies an operand cannot be captured in a CUDA graph: the copies live only during
# the call, and a replay would read and write them after the memory pool has handed them on.
COPIES_NOT_CAPTURED = (
    "the kernels need copies of some of its arrays (a last axis that is not contiguous, a base or out= not "
    "16-byte aligned, a head dim that is not a multiple of 8, index arrays given on the host, a list of "
    "states to merge), which live only during the call. Pass arrays the kernels can use in place "
    "(cuflash.plan(...) refuses the others)")


def is_capturing() -> bool:
    """Whether CuPy's current stream is capturing a CUDA graph."""
    cupy = _cp or _cupy()
    return bool(cupy.cuda.runtime.streamIsCapturing(_launch.current_stream_ptr()))


def refuse_capture(entry: str, why: str) -> None:
    """Raise RuntimeError when CuPy's current stream is capturing: ``entry``'s call cannot be
    captured safely, for the reason ``why``. Called on the full path only (a call that can never be
    replayed from a plan)."""
    if is_capturing():
        raise RuntimeError(f"this {entry} call cannot be captured in a CUDA graph: {why}")


def _getter(indices):
    """A function of a sequence giving the tuple of its items at ``indices`` (operator.itemgetter
    gives a bare item for one index and needs at least one)."""
    if len(indices) >= 2:
        return operator.itemgetter(*indices)
    if len(indices) == 1:
        index = indices[0]
        return lambda values: (values[index],)
    return lambda values: ()


def _array_dtype(dtype: np.dtype):
    """What to pass as cupy.ndarray's dtype: the scalar type of a NumPy built-in dtype (which CuPy
    resolves ~0.15 us faster than the dtype object), else the dtype."""
    return dtype.type if dtype.isbuiltin == 1 and dtype.isnative else dtype


def _default_generator():
    """cuflash.random.default_generator(), its module imported once (an import statement in the
    call path costs ~0.8 us a call)."""
    global _random
    if _random is None:
        from . import random

        _random = random
    return _random.default_generator()


class PlanningDone(Exception):
    """Raised by :meth:`Plan.run` under :func:`planned` instead of launching: carries the plan."""

    def __init__(self, plan):
        super().__init__("planned")
        self.plan = plan


_planning = contextvars.ContextVar("cuflash_planning", default=None)   # a dict while planning
_pinned = contextvars.ContextVar("cuflash_pinned_plan", default=None)


class PinnedPlan:
    """A call's plan fixed once for a serving or training loop: calling it runs the entry point with
    arguments of the same shapes, strides, dtypes and options, with no planning at all (a mismatch
    is a ValueError), on temporaries it owns (one set per stream, made at the first call on that
    stream), so that its launches can be captured in a CUDA graph. Made by :func:`cuflash.plan`,
    which also makes the graph state of a dropout forward's generator on the current GPU
    (:meth:`cuflash.Generator.graph_safe`).
    """

    def __init__(self, fn, plan: Plan, key, options: dict):
        self.fn, self.plan, self.key, self.options = fn, plan, key, options
        self._workspaces = {}

    def workspace(self, device_id: int, stream_ptr: int):
        key = _launch.stream_key(device_id, stream_ptr)
        temps = self._workspaces.get(key)
        if temps is None:
            temps = self._workspaces[key] = [b.make() for b in self.plan.temps]
        return temps

    def describe(self) -> str:
        name = getattr(self.fn, "__name__", "?")
        shapes = [tuple(d[1]) if d and d[0] == "torch" else (d[0] if d else None) for d in self.key[2]]
        return f"{name} with operand shapes {shapes}"

    def __call__(self, *args, **kwargs):
        for name in kwargs:
            if name in self.options:
                raise TypeError(f"{name} is fixed by the plan; pass only arrays when calling it")
        token = _pinned.set(self)
        try:
            return self.fn(*args, **self.options, **kwargs)
        finally:
            _pinned.reset(token)

    def __repr__(self):
        return f"<cuflash plan of {self.describe()}, {len(self.plan.steps)} launches>"


def planned(fn, *args, **kwargs) -> PinnedPlan:
    """Plan ``fn(*args, **kwargs)`` without launching anything: array arguments fix the layout,
    other keyword arguments are options fixed in the plan.

    Notes
    -----
    CUDA graphs (``cupy.cuda.Stream.begin_capture``, ``torch.cuda.graph``): every entry point can be
    captured, through its plan or as a plain call, on these terms.

    - Run the call once on the capturing stream first (it makes the stream's words, the plan's
      workspace there, and loads the kernels); a first call inside a capture is a RuntimeError.
    - The graph reads and writes the arrays the captured call was given or returned (outputs,
      ``rng_state``): write new inputs into the same arrays, and keep the returned ones as long as the
      graph is replayed. Temporaries are kept by the plan (or the stream) for the graph.
    - Graphs captured on one stream share that stream's words and temporaries: run them one after
      the other; capture the graphs that are to run at the same time on different streams.
    - Dropout: each replay draws its (seed, offset) on the GPU from the generator's graph state
      (:meth:`cuflash.Generator.graph_safe`; made here for a forward with dropout), and the returned
      ``rng_state`` is a device array holding each replay's state, which
      :func:`cuflash.attention_backward` reads on the GPU.
    - A call that needs copies of its operands, ``check=True``, or ``return_dbias=True`` cannot be
      captured: RuntimeError, before any of its kernels is recorded (end the capture and drop its
      graph). Index arrays are checked on the GPU at every replay: a bad one makes the replay write
      nothing and is raised by the next call on the stream or by :func:`cuflash.check_errors`.
    """
    record = {}
    token = _planning.set(record)
    try:
        fn(*args, **kwargs)
    except PlanningDone as done:
        plan = done.plan
    else:
        raise ValueError(f"{getattr(fn, '__name__', fn)} launches nothing for these arguments (an empty "
                         "problem): there is nothing to plan")
    finally:
        _planning.reset(token)
    if record.get("key") is None:
        raise ValueError("this call cannot be planned: an operand is not a CuPy array or a torch tensor on "
                         "torch's current stream, needs a copy (a misaligned or non-contiguous last axis, a "
                         "head dim that is not a multiple of 8), or is an index array given on the host")
    options = {name: value for name, value in kwargs.items() if value is not None and not _is_array(value)}
    if plan.dropout is not None and plan.entry in ("attention", "attention_varlen"):
        # Its runs may be captured: their dropout then draws from the generator's graph state,
        # which a capture cannot make.
        (kwargs.get("generator") or _default_generator()).graph_safe()
    return PinnedPlan(fn, plan, record["key"], options)


def _is_array(x) -> bool:
    return hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__") or isinstance(x, (list, tuple)) \
        and any(hasattr(v, "__dlpack__") for v in x)


def device_id() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


def check_step(plan, fields: dict, device_id: int):
    """The index check that runs first in a plan: its fields (index-array pointers as
    ``("operand", i)``, sizes), its launch over ``batch`` CTAs, and the stream's words."""
    fields = dict(fields)
    slots = {"error": plan.index("error"), "scratch": plan.index("scratch"), "report": plan.index("report")}
    for name in ("cache_seqlens", "block_table", "cu_seqlens_q", "cu_seqlens_k"):
        value = fields.pop(name, None)
        if value is not None:
            slots[name] = value[1]
    plan.info.update(fields)
    template = _params.Template(_params.CHECK, fields, slots)
    kernel = _compile.get_kernel(_heuristics.check_indices_variant())
    func = _launch.prepare_kernel(kernel, 0, device_id)
    ctas = max(1, min(fields.get("batch", 1), _heuristics.CHECK_MAX_CTAS))
    return Step(func, (ctas, 1, 1), _heuristics.CHECK_THREADS, 0, (("struct", template),))


# ----------------------------------------------------------------------------- faults

_FAULTS = {
    1: "cache_seqlens[{i}] = {v} does not fit the cache: it must be in [0, {capacity} - {new}] ({capacity} keys "
       "per sequence, {new} appended)",
    2: "block_table[{b}, {p}] = {v} is not a page of the cache (0 .. {last_page}) and sequence {b} uses it",
    3: "cu_seqlens_q is not a valid offset array at position {i} (value {v}): it must start at 0, never "
       "decrease and end at most at the total number of rows",
    4: "cu_seqlens_k is not a valid offset array at position {i} (value {v}): it must start at 0, never "
       "decrease and end at most at the total number of rows",
    5: "max_seqlen_q is smaller than sequence {i}'s length: it must be at least the longest query sequence",
    6: "max_seqlen_k is smaller than sequence {i}'s length: it must be at least the longest key sequence",
}


def fault_message(code: int, index: int, value: int, plan) -> str:
    info = dict(plan.info) if plan is not None else {}
    max_pages = max(1, info.get("max_pages", 1))
    info["new"] = info.get("seqlen_new", "?")
    info.setdefault("capacity", "?")
    info.setdefault("new", "?")
    info["last_page"] = info.get("num_pages", 0) - 1
    text = _FAULTS.get(code, "index fault code {code} at {i} (value {v})")
    return text.format(i=index, v=value, b=index // max_pages, p=index % max_pages, code=code, **info)


def _raise_fault(state, slot):
    fault = state.take_fault(slot)
    if fault is not None:
        code, index, value, plan = fault
        entry = plan.entry if plan is not None else "an entry point"
        raise ValueError(f"{fault_message(code, index, value, plan)} (found on the GPU by a {entry} call on "
                         "this stream; that call wrote nothing)")


def check_errors() -> None:
    """Raise the index fault that an earlier call found on the GPU, if any (ValueError naming the
    argument). Waits first for the current device, and every device cuflash ran on, to finish."""
    import cupy

    states = _launch.all_stream_states()
    for device in sorted({cupy.cuda.runtime.getDevice()} | {state.device_id for state in states}):
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.deviceSynchronize()
    for state in states:
        for slot in _launch.REPORT_SLOTS.values():
            _raise_fault(state, slot)


# ----------------------------------------------------------------------------- the memo

def _torch_stream(device_index: int):
    """torch's current stream on the device (its handle), or None when torch is not imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch._C._cuda_getCurrentRawStream(device_index)
    except AttributeError:  # other torch builds
        return torch.cuda.current_stream(device_index).cuda_stream


_torch_types = set()   # the torch tensor classes seen (torch is never imported here)


def _is_torch_tensor(x) -> bool:
    t = type(x)
    if t in _torch_types:
        return True
    if t.__name__ in ("Tensor", "Parameter") and t.__module__ in ("torch", "torch.nn.parameter"):
        _torch_types.add(t)
        return True
    return False


def lookup(entry: str, operands, options):
    """The remembered plan of a call, the operands' pointers and where the call runs, or (None, key,
    where) when there is none.

    Returns
    -------
    (plan, ptrs, where) on a hit; (None, key, where) on a miss (``key`` is None when the call
    cannot be remembered: an operand of another kind, an unhashable option). ``where``: (device,
    stream) of the call, CuPy's current ones, for :meth:`Plan.run`; None when the operands did not
    allow a lookup (then ``key`` is None too).
    """
    cupy = _cp or _cupy()
    ndarray = cupy.ndarray
    descriptors, ptrs = [], []
    describe, point = descriptors.append, ptrs.append
    # CuPy's current device and stream are asked once the operands allow a lookup (a host array
    # must still get its TypeError on a machine without a GPU), and only once: Plan.run takes them.
    torch_device = None
    bits = 0   # the OR of the pointers: 16-byte alignment is checked operand by operand only if it has low bits
    for x in operands:
        if x is None:
            describe(None)
            point(0)
            continue
        kind = type(x)
        if kind is ndarray:
            memory = x.data
            # A C-contiguous array's strides follow from its shape, except along axes of length 1,
            # where no address depends on them: the flag stands for them (0.2 us a call per array).
            describe((x.shape, x._c_contiguous or x.strides, x.dtype, memory.device_id))
            ptr = memory.ptr
            point(ptr)
            bits |= ptr
        elif kind in _torch_types or _is_torch_tensor(x):
            device = x.get_device()   # -1 on the host
            if device != torch_device:
                if torch_device is not None or device < 0:
                    return None, None, None
                torch_device = device
            describe(("torch", x.shape, x.is_contiguous() or x.stride(), x.dtype, device))   # as CuPy's above
            ptr = x.data_ptr()
            point(ptr)
            bits |= ptr
        else:
            return None, None, None
    current_device = cupy.cuda.runtime.getDevice()
    stream = _launch.current_stream_ptr(current_device)
    if torch_device is not None and _torch_stream(torch_device) != stream:
        return None, None, None   # the full path's DLPack import orders torch's stream before CuPy's
    where = (current_device, stream)
    key = (entry, options, tuple(descriptors), current_device)
    pinned = _pinned.get()
    if pinned is not None:
        plan = pinned.plan
        if key != pinned.key:
            raise ValueError(f"the arguments do not match this plan's shapes, strides, dtypes, options or device "
                             f"(planned for {pinned.describe()})")
    else:
        try:
            plan = _memo.get(key)
        except TypeError:   # an unhashable option (e.g. a window given as a list): not remembered
            return None, None, where
        if plan is None:
            return None, key, where
    record = _planning.get()
    if record is not None:
        record["key"] = key
    if bits & 15:
        for i in plan.aligned:
            if ptrs[i] % 16:
                return None, None, where
    return plan, ptrs, where


def remember(key, plan) -> None:
    """Keep ``plan`` for repeats of the call ``key`` names (None: a call that must not be replayed,
    e.g. one whose operands were copied)."""
    record = _planning.get()
    if record is not None:
        record["key"] = key
    if key is None:
        return
    if len(_memo) >= _MEMO_ENTRIES:
        _memo.clear()
    _memo[key] = plan


def clear_memo() -> None:
    _memo.clear()


class Pointers(list):
    """Data pointers of a call's kernel-ready arrays, holding the arrays: copies made for the call
    (uploaded index arrays, padded operands) must outlive the launches that read them, or the pool
    could hand their memory to the call's own outputs."""

    def __init__(self, arrays):
        super().__init__(0 if x is None else x.data.ptr for x in arrays)
        self.keep = tuple(arrays)


def pointers(arrays) -> Pointers:
    return Pointers(arrays)


def temp_array(plan, temps, i):
    """Temporary ``i`` of a call as a CuPy array (from the workspace, or a view of the call's one
    allocation)."""
    import cupy

    if isinstance(temps, list):
        return temps[i]
    buffer = plan.temps[i]
    return cupy.ndarray(buffer.shape, dtype=buffer.dtype, memptr=temps + plan._temp_offsets[i])


def _pointer_of(x) -> int | None:
    import cupy

    if type(x) is cupy.ndarray:
        return x.data.ptr
    if _is_torch_tensor(x):
        return x.data_ptr()
    return None


def in_place(operands, kernel_operands) -> bool:
    """Whether the kernels use every operand in place (no copy was made): only then may a repeat
    call with new operands of the same layout replay the plan with their pointers."""
    for x, y in zip(operands, kernel_operands):
        if (x is None) != (y is None):
            return False
        if x is not None and _pointer_of(x) != y.data.ptr:
            return False
    return True


def nothing_to_plan() -> None:
    """Called by an entry point whose call launches nothing: under :func:`planned` that is an error."""
    if _planning.get() is not None:
        raise ValueError("an empty problem launches nothing: there is nothing to plan")
