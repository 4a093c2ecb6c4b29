"""Decode captured in a CUDA graph of n calls on a fresh stream, after an eager call of the same
shape: the time per call of the second of two replays and the largest difference of the graph's
outputs from the eager call's.

On an H200 (2026-11-30, this script's logic): (1, 128k) and (1, 32k) were right for every n; at
(8, 8k) the first graph, of 5 calls, ran 4.4 us a call with outputs 8.4e-2 off (no work done), the
graphs captured after it (20, 5, 1, 2, 3 calls) were right. In an A/B of captured decode calls
(`benchmarks/ab_decode.py run --calls 5`) the graphs of (1, 128k) contiguous went wrong the same way.
Not yet explained. Run: ``PYTHONPATH=$PWD python benchmarks/experiments/decode_capture_probe.py``.
"""

import cupy
import ml_dtypes

import cuflash

bf16 = cupy.dtype(ml_dtypes.bfloat16)
for batch, length in ((1, 131072), (1, 32768), (8, 8192)):
    q = cupy.random.standard_normal((batch, 1, 32, 128), dtype=cupy.float32).astype(bf16)
    k = cupy.random.standard_normal((batch, length, 8, 128), dtype=cupy.float32).astype(bf16)
    v = cupy.random.standard_normal((batch, length, 8, 128), dtype=cupy.float32).astype(bf16)
    lens = cupy.full((batch,), length, dtype=cupy.int32)
    want = cuflash.decode(q, k, v, cache_seqlens=lens).astype(cupy.float32)
    for calls in (5, 20, 5, 1, 2, 3):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            outs = [cuflash.decode(q, k, v, cache_seqlens=lens) for _ in range(calls)]
            graph = stream.end_capture()
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        graph.launch(stream)
        begin.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        us = cupy.cuda.get_elapsed_time(begin, end) * 1e3 / calls
        diff = max(float(cupy.abs(o.astype(cupy.float32) - want).max()) for o in outs)
        print(f"B{batch} L{length} graph of {calls}: {us:.1f} us a call, maxdiff {diff:.1e}", flush=True)
