"""What a call captured in a CUDA graph needs: state of its own, dropout's (seed, offset) drawn on
the GPU at each replay (cuda_src/rng_state.cu), and the calls that cannot be captured."""

from __future__ import annotations

import numpy as np

from cuflash import kernels
from cuflash._build import compile as _compile
from cuflash._runtime import launch as _launch
from cuflash._runtime.graph_lifetime import keep_with_capture
from cuflash._runtime.now import done_now, relaxed_capture_mode
from cuflash._runtime.step import Buffer, Step


class _RngScratch:
    """The stream's two words holding the state that a captured call drew but does not return
    (``attention``, ``attention_varlen``), kept by the stream's workspaces under this key."""

    temps = (Buffer((2,), np.uint64),)


_RNG_SCRATCH = _RngScratch()
_rng_steps: dict = {}   # device id -> the Step of cuda_src/rng_state.cu


def rng_step(device_id: int) -> Step:
    """The launch of ``cuda_src/rng_state.cu`` on a device (values: the generator's graph state, the
    call's words); its kernel is loaded at the first call (by :meth:`cuflash.Generator.graph_safe`)."""
    step = _rng_steps.get(device_id)
    if step is None:
        func = _launch.prepare_kernel(_compile.get_kernel(kernels.rng_state.rng_state_variant()), 0, device_id)
        step = _rng_steps[device_id] = Step(func, (1, 1, 1), 1, 0, (("pointer", 0), ("pointer", 1)))
    return step


def call_state(device_id: int, stream: int) -> _launch.StreamState:
    """The words, split counters and temporaries of one call that ``stream`` is capturing, its own.

    Calls on a stream run one after the other, so uncaptured calls share their stream's state. Graphs
    do not: XLA records the calls of a program into one graph, where two calls that share no buffer
    may run at once, and graphs captured on one stream may be replayed on several. Two calls at once
    on the same persistent kernels' counter, or the same split partials, would corrupt each other.
    So a captured call gets state of its own, kept exactly as long as the graph
    (:mod:`cuflash._runtime.graph_lifetime`); its faults go to the reports of ``stream``'s state.
    Made once per captured call, never on a replay."""
    shared = _launch.stream_state(device_id, stream)
    with done_now(device_id):
        state = _launch.StreamState(device_id, reports_of=shared)
    keep_with_capture(stream, state)
    return state


def _graph_draw(cupy, generator, device_id: int, state, rng_output: bool):
    """Dropout's state for a captured call: the launch that draws it on the GPU at each replay
    (step, values), and the call's words it fills (a new array when the caller returns it, else the
    stream's scratch words), as (step, values, words)."""
    words = generator._graph_state(device_id)
    if words is None:   # the first capture with this generator on this GPU
        words = generator.graph_safe(device_id)
    if rng_output:
        with relaxed_capture_mode():   # the pool may need a cudaMalloc, which a global-mode capture forbids
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
    cupy = _launch._cupy()
    return bool(cupy.cuda.runtime.streamIsCapturing(_launch.current_stream_ptr()))


def refuse_capture(entry: str, why: str) -> None:
    """Raise RuntimeError when CuPy's current stream is capturing: ``entry``'s call cannot be
    captured safely, for the reason ``why``. Called on the full path only (a call that can never be
    replayed from a plan)."""
    if is_capturing():
        raise RuntimeError(f"this {entry} call cannot be captured in a CUDA graph: {why}")

