"""The plan of a call: every kernel it launches with their arguments laid out once, independent of
the data pointers, and :meth:`Plan.run`, which writes a call's pointers and launches.

An entry point names its array operands (inputs, optional outputs, index arrays) and its options.
The first call with a given layout checks everything (:mod:`cuflash._checks`), plans the kernels
(:mod:`cuflash.kernels`) and packs their parameters (:mod:`cuflash._runtime.params`) into a :class:`Plan`,
which it then runs and remembers (:mod:`cuflash._runtime.memo`). A repeat call does only what depends on
the pointers: their 16-byte alignment, the outputs' allocation, writing the new pointers (into the
packed structs and the tensor maps, each step's argument block kept per thread at a fixed address,
:class:`cuflash._runtime.step.Step`), the launches (a plan of GRAPH_MIN_STEPS kernels or more: one launch of
a CUDA graph of them, :mod:`cuflash._runtime.graph`).
"""

from __future__ import annotations

import contextvars
import operator
import threading

import numpy as np

from cuflash._runtime import graph as _graph, launch as _launch, recycled as _recycled
from cuflash._build.cuda_status import import_cupy
from cuflash._runtime.capture import _graph_draw, call_state as _call_state
from cuflash._runtime.faults import _raise_fault

#: Plans kept by the memo, and tails kept by a stream (each keeps its plan alive).
_MEMO_ENTRIES = 512
# Plans of at least this many kernels launch them as one CUDA graph (cuflash/_runtime/graph.py); 0: never.
GRAPH_MIN_STEPS = 2
_cp = None   # the cupy module, bound at the first call (cuflash imports no CUDA library at import)
_random = None   # cuflash.random, bound at the first call that draws dropout


def _cupy():
    global _cp
    if _cp is None:
        _cp = import_cupy()   # a missing CuPy says which extra to install
    return _cp


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
    call and may not be read on the host: the call gets words, split counters and temporaries of its
    own, kept as long as its graph (:func:`cuflash._runtime.capture.call_state`), so that graphs, and
    calls inside one graph, may run at once; and a call that draws dropout takes its (seed, offset)
    on the GPU, from its generator's graph state, by a launch of ``cuda_src/rng_state.cu`` ahead of
    its steps; its kernels read them through DROPOUT_STATE.

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
        # Plan.run 2.2 -> 1.8 us on a CPU without a GPU (docs/decisions.md#host-python-per-call).
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
            Under capture: ``check=True`` (it waits for the GPU).
        """
        if _planning.get() is not None:
            raise PlanningDone(self)
        cupy = _cp or _cupy()

        if where is None:
            device_id = cupy.cuda.runtime.getDevice()
            stream = _launch.current_stream_ptr(device_id)
        else:
            device_id, stream = where
        # Asked at every call (~0.2 us): a captured call's state is its own (capture.call_state).
        capturing = cupy.cuda.runtime.streamIsCapturing(stream)
        state = _call_state(device_id, stream) if capturing else _launch.stream_state(device_id, stream)
        if self.slot is not None:
            _raise_fault(state, self.slot)
        if check and self.checked and capturing:
            raise RuntimeError(f"{self.entry}(check=True) waits for the GPU's check of the index arrays, which a "
                               "stream capture cannot do: capture it with check=False (a bad index then makes "
                               "the replay write nothing and is raised by the next call on the stream or by "
                               "cuflash.check_errors())")
        if workspace is None and self.temps and not capturing:
            pinned = _pinned.get()
            if pinned is not None and pinned.plan is self:
                workspace = pinned.workspace(device_id, stream)
        # What follows the operands' pointers in the values: the temporaries' pointers and the
        # stream's words, made once per stream for the plans whose temporaries fit the arena.
        if workspace is None and self._temp_bytes <= _launch.ARENA_BYTES:
            temps, tail = state.tails.get(self) or self._arena_tail(state)
        else:
            if workspace is None and (capturing or stream == _launch.PER_THREAD_STREAM):
                # Captured: the graph uses them at every replay, so the call's state keeps them.
                # The per-thread stream: CuPy's pool files freed blocks under the stream's handle,
                # which every thread's per-thread stream shares, so a block freed here could go to
                # another thread while this thread's kernels still use it; each thread keeps its own.
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
            if capturing:   # drawn on the GPU at each replay, from the generator's graph state
                draw = _graph_draw(cupy, source, device_id, state, rng_output)
            else:
                rng_state = source.next_state()
        values = ptrs + tail
        made = None
        if self._output_indices and not all(self._output_ptrs(values)):
            missing = tuple([index for index in self._output_indices if not values[index]])
            layout = self._output_layouts.get(missing)
            if layout is None:
                layout = self._output_layouts[missing] = self._output_layout(missing)
            if len(missing) == 1 and 0 < layout[1] <= _recycled.MAX_BYTES and not capturing:
                # One small output: handed out again once the caller dropped it (recycled.py).
                index, shape, dtype, _ = layout[0][0]
                key = (self, index)
                spare = state.spares.get(key)
                if spare is None:
                    if len(state.spares) >= _MEMO_ENTRIES:   # bounded like the memo
                        state.spares.clear()
                    spare = state.spares[key] = _recycled.spares()
                x = _recycled.output(spare, cupy, shape, dtype, layout[1])
                made = {index: x}
                values[index] = x.data.ptr
            elif layout[1]:
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
        if len(steps) >= GRAPH_MIN_STEPS > 0 and draw is None and not capturing:
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
        from cuflash import random

        _random = random
    return _random.default_generator()


class PlanningDone(Exception):
    """Raised by :meth:`Plan.run` under :func:`planned` instead of launching: carries the plan."""

    def __init__(self, plan):
        super().__init__("planned")
        self.plan = plan


_planning = contextvars.ContextVar("cuflash_planning", default=None)   # a dict while planning
_pinned = contextvars.ContextVar("cuflash_pinned_plan", default=None)
