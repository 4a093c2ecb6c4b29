"""The Python cost of repeat calls of each entry point, on a machine without a GPU.

The host bars of issue 15 are set in microseconds, of which the driver's launch takes 4-6 on the
device's hosts (docs/decisions.md#host-python-per-call); the rest is Python in ``_memo.lookup``,
``Plan.run`` and the entry points, which this script times with the CUDA runtime and driver stubbed
out: CuPy arrays over made-up device addresses (CuPy builds them without a device), device 0 an
sm_90a with 132 SMs, the null stream, a stand-in stream state, tensor maps of zeros and launches
(kernels and graphs) that do nothing. The first call of each case plans it for real (the planners
run; only kernels, maps and launches are stand-ins), so the repeat calls replay real plans. Their
allocations come from a stand-in allocator (a bump pointer, cheaper than CuPy's pool).

So a change to the call path can be weighed here before a GPU run; absolute figures are this CPU's
(attention / backward / decode / paged / merge_states: 8.5 / 13.4 / 9.0 / 9.5 / 5.4 us before the
trims of docs/decisions.md#host-plan-memo and #host-temporaries, 6.2 / 10.2 / 6.6 / 6.9 / 4.8 after)::

    python benchmarks/experiments/host_path_cpu.py [--only merge,decode,...]
"""
import argparse
import contextlib
import ctypes
import sys
import time
import types
from pathlib import Path

import cupy
import numpy as np
from cupy.cuda import memory

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cuflash  # noqa: E402
from cuflash._build import compile as _compile  # noqa: E402
from cuflash._runtime import graph as _graph, launch as _launch, memo as _memo, tma as _tma  # noqa: E402

# The modules (cuflash's names attention, decode, ... are the functions).
attention_module, backward_module, decode_module, merge_module = (
    sys.modules[f"cuflash.{name}"] for name in ("attention", "backward", "decode", "merge"))

CALLS, ROUNDS = 5000, 7
BASE = 0x7F0000000000
_SPAN = 1 << 30


class _FakeKernel:
    max_dynamic_shared_size_bytes = 0
    preferred_shared_memory_carveout = 0
    kernel = types.SimpleNamespace(ptr=0x1234)


class _FakeGraph:
    def __init__(self, steps, argvs):
        pass

    def launch(self, stream):
        pass


def stub_the_gpu() -> None:
    runtime = cupy.cuda.runtime
    runtime.getDevice = lambda: 0
    runtime.streamIsCapturing = lambda stream: False
    runtime.memsetAsync = lambda *args: None
    attributes = {runtime.cudaDevAttrMultiProcessorCount: 132,
                  runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin: 227 * 1024}
    runtime.deviceGetAttribute = lambda attribute, device: attributes.get(attribute, 0)
    cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor = lambda *args: 1
    _launch._current_stream = lambda device_id=-1: types.SimpleNamespace(ptr=0)
    _launch._driver_launch = lambda *args: None
    _launch._launch_kernel_ex = lambda: (lambda *args: 0)
    _launch.prepare_kernel = lambda kernel, smem, device_id, carveout=None: 0x1234
    cupy.cuda.Device = lambda device_id=0: contextlib.nullcontext()
    # The null stream's state, its device words and fault reports at made-up addresses.
    state = _launch.StreamState.__new__(_launch.StreamState)
    state.device_id = 0
    state.counter, state.error, state.scratch, state._host = BASE - 64, BASE - 60, BASE - 56, BASE - 48
    state.reports = (ctypes.c_int32 * (4 * len(_launch.REPORT_SLOTS)))()
    state.plans = [None] * len(_launch.REPORT_SLOTS)
    state._workspaces, state.tails, state.spares = {}, {}, {}
    state._arena, state._arena_bytes, state._old_arenas = None, 0, []
    state._counters, state._old_counters = types.SimpleNamespace(size=1 << 20, data=types.SimpleNamespace(
        ptr=BASE - 4096)), []
    _launch._states[(0, 0, None)] = state
    for module in (_compile, attention_module, backward_module, decode_module, merge_module,
                   sys.modules["cuflash._forward_plan"], sys.modules["cuflash._backward_plan"],
                   sys.modules["cuflash._prefill_plan"]):
        if hasattr(module, "get_kernel"):
            module.get_kernel = lambda variant: _FakeKernel()
        if hasattr(module, "device_arch"):
            module.device_arch = lambda: "sm_90a"
    # Set-up work runs on a private stream with the capture mode relaxed (libcuda): nothing to relax here.
    _launch.done_now = _launch.relaxed_capture_mode = lambda *args: contextlib.nullcontext()
    _tma.address_patchable = lambda spec=None: True
    _tma.template = lambda spec: bytes(128)
    _graph.KernelGraph = _FakeGraph
    top = [BASE + 8 * _SPAN]

    def alloc(nbytes):   # a bump pointer over made-up addresses
        address = top[0]
        top[0] += -(-max(nbytes, 1) // 256) * 256
        return memory.MemoryPointer(memory.UnownedMemory(address, nbytes, None, device_id=0), 0)

    cupy.cuda.alloc = alloc


def device_array(shape, dtype, slot: int):
    mem = memory.UnownedMemory(BASE + slot * _SPAN, _SPAN, None, device_id=0)
    return cupy.ndarray(shape, dtype=dtype, memptr=memory.MemoryPointer(mem, 0))


def us_per_call(fn) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        best = min(best, (time.perf_counter() - start) / CALLS * 1e6)
    return best


def cases():
    """(name, call) of bench_host.py's problems, with out= buffers kept across calls as it does."""
    bf16 = cuflash._checks.BFLOAT16
    slots = iter(range(8 * 64))

    def array(shape, dtype=bf16):
        return device_array(shape, dtype, next(slots))

    q, k, v, out = (array((1, 256, 8, 128)) for _ in range(4))
    yield "attention B1 S256 H8 D128", lambda: cuflash.attention(q, k, v, out=out)
    # A user modifier's warm call against the built-in option it replaces (issue 52's host bar).
    yield "attention softcap=30", lambda: cuflash.attention(q, k, v, softcap=30.0, out=out)
    capped = cuflash.ScoreMod("30.0 * tanh(score / 30.0)", grad="1.0 - tanh(score / 30.0) * tanh(score / 30.0)")
    yield "attention ScoreMod(cap)", lambda: cuflash.attention(q, k, v, score_mod=capped, out=out)
    table, doc = array((8 * 511,), np.float32), array((256,), np.int32)
    relative = cuflash.ScoreMod("score + table[h * 511 + q_idx - kv_idx + 255]", table=table)
    document = cuflash.MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc, sparse=False)
    yield "attention ScoreMod(table)+MaskMod(doc)", \
        lambda: cuflash.attention(q, k, v, score_mod=relative, mask_mod=document, out=out)
    dout, lse = array((1, 256, 8, 128)), array((1, 8, 256), np.float32)
    dq, dk, dv = (array((1, 256, 8, 128)) for _ in range(3))
    yield "attention_backward B1 S256 H8 D128", \
        lambda: cuflash.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv)
    # The calls ct.attention's autograd Function makes (cuflash/interop/torch.py), every keyword spelled.
    yield "autograd's attention_forward causal", \
        lambda: cuflash.attention_forward(q, k, v, bias=None, sinks=None, out=out, lse=lse, generator=None,
                                          causal=True)
    yield "autograd's attention_backward causal", \
        lambda: cuflash.attention_backward(dout, q, k, v, out, lse, bias=None, sinks=None, rng_state=None,
                                           return_dbias=False, return_dsinks=False, dq=dq, dk=dk, dv=dv,
                                           deterministic=False, causal=True)
    b, length, hq, hk, d = 8, 1024, 32, 8, 128
    qd, outd = array((b, 1, hq, d)), array((b, 1, hq, d))
    kc, vc = array((b, length, hk, d)), array((b, length, hk, d))
    seqlens = array((b,), np.int32)
    yield "decode contiguous B8 L1024 Hq32 Hk8", lambda: cuflash.decode(qd, kc, vc, cache_seqlens=seqlens, out=outd)
    pages = b * length // 16
    kp, vp = array((pages, 16, hk, d)), array((pages, 16, hk, d))
    table = array((b, length // 16), np.int32)
    yield "decode paged16 B8 L1024 Hq32 Hk8", \
        lambda: cuflash.decode(qd, kp, vp, cache_seqlens=seqlens, block_table=table, out=outd)
    # Chunked prefill: ragged chunks of new tokens against their paged caches (attention_varlen over a cache).
    total, chunk = 8 * 64, 64
    qv, outv = array((total, hq, d)), array((total, hq, d))
    cu = array((b + 1,), np.int32)
    yield "varlen over paged16 B8 64 new each", \
        lambda: cuflash.attention_varlen(qv, kp, vp, cu, None, max_seqlen_q=chunk, cache_seqlens=seqlens,
                                         block_table=table, causal=True, out=outv)
    outs, lses = array((2, 8, 1, 32, 128)), array((2, 8, 32, 1), np.float32)
    outm, lsem = array((8, 1, 32, 128)), array((8, 32, 1), np.float32)
    yield "merge_states 2 parts B8 S1 H32 D128", lambda: cuflash.merge_states(outs, lses, out=outm, lse=lsem)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated name prefixes (default: every case)")
    args = parser.parse_args(argv)
    stub_the_gpu()
    only = [name for name in args.only.split(",") if name]
    print(f"us per repeat call, CuPy arrays, out= buffers given; best of {ROUNDS} x {CALLS} calls")
    for name, call in cases():
        if only and not any(name.startswith(prefix) for prefix in only):
            continue
        call()   # plans
        print(f"  {name:40s} {us_per_call(call):6.2f}")


if __name__ == "__main__":
    main()
