"""Direct and graph-captured MLA decode calls over several shapes, both kernel families forced, for
compute-sanitizer: each call's output from a replay against the direct call's, and the lengths array
checked after each.

Run bare, under ``compute-sanitizer --tool memcheck`` and under ``--tool racecheck``:

    PYTHONPATH=$PWD python benchmarks/experiments/capture_index_check_probe.py [decode] [mla_sm90]
    PYTHONPATH=$PWD python benchmarks/experiments/capture_index_check_probe.py race

``race`` makes the mistake described below on purpose and says whether the index check caught it.

On an H200 (2026-11-30) the bare run and memcheck (0 errors) passed. Under racecheck (0 hazards) a
new shape's first calls stopped with the index check's fault "cache_seqlens[0] = ... does not fit the
cache", the value a float of earlier data or 0x01010101, whichever family was forced. The likely
cause is the probe's own: the inputs were made on the legacy default stream, behind kernels that
racecheck slows down, and the calls on the new non-blocking stream (which does not wait for the
legacy one) could read the lengths' block of CuPy's pool before the upload landed. ``race`` makes that
mistake on purpose: the index check reports it as the same fault (2147483647 there) on a stream
that had made a call before; as that stream's first call (which makes its state) it was not caught,
and the probe's streams were new, so the cause is likely, not proven. With the device synchronised
after the inputs are made, racecheck ran all 24 cases (replays equal to direct calls) with 0
hazards and no fault (one run, same day).
"""
import sys
from pathlib import Path

import cupy
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cuflash  # noqa: E402
from cuflash import _mla_plan  # noqa: E402
from bench_model_features import paged_pages  # noqa: E402

BF16 = cupy.dtype(ml_dtypes.bfloat16)
# (batch, keys, query heads, page size or None, new tokens)
SHAPES = [(4, 704, 16, 64, 1), (4, 700, 128, None, 1), (3, 384, 40, 128, 3)]


def race():
    """Lengths uploaded on the legacy stream behind a 0.1 s kernel into a pool block that held
    0x7FFFFFFF, then a call on a non-blocking stream with no wait: the index check should see the
    stale block and report it at a later call on that stream."""
    batch, length, heads = 4, 704, 16
    latent = cupy.random.standard_normal((batch, length, 1, 576), dtype=cupy.float32).astype(BF16)
    q = cupy.random.standard_normal((batch, 1, heads, 576), dtype=cupy.float32).astype(BF16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:   # the stream's state made (its first call may wait for the device) and the call planned
        cuflash.decode(q, latent, None, v_head_dim=512, cache_seqlens=cupy.full(batch, length, cupy.int32))
    cupy.cuda.Device().synchronize()
    junk = cupy.full(batch, 0x7FFFFFFF, dtype=cupy.int32)
    stale = junk.data.ptr
    cupy.cuda.Device().synchronize()
    del junk
    spin = cupy.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
        long long start = clock64(); while (clock64() - start < cycles) {} }""", "spin")
    spin((1,), (1,), (np.int64(200_000_000),))
    lens = cupy.asarray(np.full(batch, length, np.int32))
    print("lengths in the stale block:", lens.data.ptr == stale, flush=True)
    with stream:
        try:
            for _ in range(3):
                cuflash.decode(q, latent, None, v_head_dim=512, cache_seqlens=lens)
                stream.synchronize()
        except Exception as e:  # noqa: BLE001 - the fault is what this looks for
            print("race caught by the index check:", type(e).__name__, str(e).splitlines()[0], flush=True)
            return
    print("race not caught", flush=True)


def main():
    if sys.argv[1:] == ["race"]:
        return race()
    families = sys.argv[1:] or ["decode", "mla_sm90"]
    kept = []   # every graph and its outputs, alive to the end
    for batch, length, heads, page, new in SHAPES:
        latent = cupy.random.standard_normal((batch, length, 1, 576), dtype=cupy.float32).astype(BF16)
        q = cupy.random.standard_normal((batch, new, heads, 576), dtype=cupy.float32).astype(BF16)
        pool, table = paged_pages(cupy, np.random.default_rng(0), latent, page) if page else (latent, None)
        lens = cupy.asarray(np.random.default_rng(1).integers(1, length + 1, batch).astype(np.int32))
        cupy.cuda.Device().synchronize()   # a non-blocking stream does not wait for the inputs' stream
        for family in families:
            for splits in (0, 1, 2, 5):
                print("start", batch, length, heads, page, new, family, splits, flush=True)
                with _mla_plan.force_kernel(family):
                    def call(splits=splits):
                        return cuflash.decode(q, pool, None, v_head_dim=512, cache_seqlens=lens, block_table=table,
                                              num_splits=splits)
                    direct = call()
                    stream = cupy.cuda.Stream(non_blocking=True)
                    with stream:
                        call()
                        stream.synchronize()
                        stream.begin_capture()
                        outs = [call() for _ in range(3)]
                        graph = stream.end_capture()
                        for _ in range(3):
                            graph.launch(stream)
                        stream.synchronize()
                    kept.append((graph, stream, outs))
                diff = float(cupy.abs(outs[-1].astype(cupy.float32) - direct.astype(cupy.float32)).max())
                print(batch, length, heads, page, new, family, splits,
                      "replay == direct" if diff == 0 else f"replay differs by {diff}",
                      "lengths kept" if bool((lens > 0).all()) else "LENGTHS CHANGED", flush=True)


if __name__ == "__main__":
    main()
