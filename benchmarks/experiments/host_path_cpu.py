"""The Python cost of a repeat ``merge_states`` call, on a machine without a GPU.

The host bars of issue 15 are set in microseconds, of which the driver's launch takes 4-6 on the
device's hosts (benchmarks/NOTES.md, session 35); the rest is Python in ``_pipeline.lookup`` and
``Plan.run``, which this script times with the CUDA runtime and driver stubbed out: CuPy arrays
over made-up device addresses (CuPy builds them without a device), the current device 0, the
null stream, a stand-in stream state and a launch that does nothing. So a change to the call path
can be weighed here before a lease; absolute figures are this CPU's (session 36, this machine:
lookup 2.8 us, Plan.run 2.3 us, the whole call 5.5 us)::

    python benchmarks/experiments/host_path_cpu.py
"""
import sys
import time
import types
from pathlib import Path

import cupy
import numpy as np
from cupy.cuda import memory

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cuflash  # noqa: E402
from cuflash import _launch, _pipeline  # noqa: E402
from cuflash import merge as merge_module  # noqa: E402

CALLS, ROUNDS = 20000, 7


def stub_the_gpu() -> None:
    cupy.cuda.runtime.getDevice = lambda: 0
    _launch._current_stream = lambda device_id=-1: types.SimpleNamespace(ptr=0)
    _launch._driver_launch = lambda *args: None
    _launch.prepare_kernel = lambda kernel, smem, device_id, carveout=None: 0x1234
    merge_module.get_kernel = lambda variant: None
    _launch._states[(0, 0, None)] = types.SimpleNamespace(counter=0x100, error=0x104, scratch=0x108)


def device_array(shape, dtype, address: int):
    mem = memory.UnownedMemory(address, 1 << 24, None, device_id=0)
    return cupy.ndarray(shape, dtype=dtype, memptr=memory.MemoryPointer(mem, 0))


def us_per_call(fn) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        best = min(best, (time.perf_counter() - start) / CALLS * 1e6)
    return best


def main() -> None:
    stub_the_gpu()
    base = 0x7F0000000000
    outs = device_array((2, 8, 1, 32, 128), np.float16, base)
    lses = device_array((2, 8, 32, 1), np.float32, base + (1 << 24))
    out = device_array((8, 1, 32, 128), np.float16, base + (2 << 24))
    lse = device_array((8, 32, 1), np.float32, base + (3 << 24))
    operands = (outs, lses, out, lse)
    cuflash.merge_states(outs, lses, out=out, lse=lse)   # plans once
    plan, ptrs = _pipeline.lookup("merge_states", operands, ())
    print(f"merge_states, 2 parts B8 S1 H32 D128, out= and lse= given; best of {ROUNDS} x {CALLS} calls")
    print(f"  lookup       {us_per_call(lambda: _pipeline.lookup('merge_states', operands, ())):.2f} us")
    print(f"  Plan.run     {us_per_call(lambda: plan.run(operands, ptrs)):.2f} us")
    print(f"  the call     {us_per_call(lambda: cuflash.merge_states(outs, lses, out=out, lse=lse)):.2f} us")


if __name__ == "__main__":
    main()
