"""MLA decode (issue 53): the decode kernel against mla_sm90, each call captured in a CUDA graph of 10
and replayed in random-order turns (CuPy), with a device-to-device copy's rate and a bf16 GEMM's
(8192^3, cuBLAS) measured in the same run; bf16, one new token, a latent cache of 576 columns (values:
its first 512), pages of 64 in random order or contiguous.

    PYTHONPATH=$PWD python benchmarks/experiments/mla_decode_probe.py [SPLITS ...]

SPLITS: mla_sm90's split counts to time (0, the default: its rule); SHAPES=abc... picks shapes of
``ALL``. Prints us per call, GB/s of the latent rows and their share of the copy's rate, TFLOP/s of
Q K^T and P V and their share of the GEMM's, and the largest difference from the decode kernel's out.
After every call and capture the lengths array is checked unchanged.
"""
import os
import statistics
import sys
from pathlib import Path

import cupy
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import cuflash  # noqa: E402
from cuflash import _mla_plan  # noqa: E402
from ab_decode import replay_times  # noqa: E402
from bench_model_features import paged_pages  # noqa: E402

BF16 = cupy.dtype(ml_dtypes.bfloat16)
CALLS = 10
# (batch, keys, query heads, page size or None)
ALL = {"a": (64, 4096, 16, 64), "b": (64, 4096, 16, None), "c": (64, 4096, 128, 64), "d": (64, 4096, 128, None),
       "e": (4, 32768, 16, 64), "f": (1, 32768, 16, 64), "g": (8, 8192, 128, 64), "h": (1, 32768, 128, 64)}


def graph_of(fn):
    """(graph of CALLS calls of fn captured on a stream of their own, that stream, their outputs)."""
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        fn()
        s.synchronize()
        s.begin_capture()
        outs = [fn() for _ in range(CALLS)]
        g = s.end_capture()
    return g, s, outs


def replay(graphs, rounds=7):
    """Median us per call of each graph (ab_decode's turns)."""
    return replay_times(cupy, graphs, CALLS, rounds)


def copy_rate() -> float:
    src = cupy.empty(256 << 20, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    us = replay({"copy": graph_of(lambda: dst.data.copy_from_device_async(src.data, src.nbytes))})["copy"]
    return 2 * src.nbytes / (us * 1e-6) / 1e9   # GB/s, read + write


def gemm_rate() -> float:
    x = cupy.random.standard_normal((8192, 8192), dtype=cupy.float32).astype(BF16)
    y = x @ x
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(5):
        e0.record()
        for _ in range(10):
            cupy.matmul(x, x, out=y)
        e1.record()
        e1.synchronize()
        times.append(cupy.cuda.get_elapsed_time(e0, e1) * 1e3 / 10)
    return 2 * 8192**3 / (statistics.median(times) * 1e-6) / 1e12


def main():
    splits_asked = [int(x) for x in sys.argv[1:]] or [0]
    copy, gemm = copy_rate(), gemm_rate()
    print(f"copy {copy:.0f} GB/s, bf16 GEMM 8192^3 {gemm:.0f} TFLOP/s", flush=True)
    cupy.get_default_memory_pool().free_all_blocks()
    for batch, length, heads, page in (ALL[k] for k in os.environ.get("SHAPES", "abcdefgh")):
        latent = cupy.random.standard_normal((batch, length, 1, 576), dtype=cupy.float32).astype(BF16)
        q = cupy.random.standard_normal((batch, 1, heads, 576), dtype=cupy.float32).astype(BF16)
        pool, table = paged_pages(cupy, np.random.default_rng(0), latent, page) if page else (latent, None)
        lens = cupy.full((batch,), length, dtype=cupy.int32)

        def lens_ok(where):
            cupy.cuda.Device().synchronize()
            if int((lens != length).sum()):
                raise SystemExit(f"cache_seqlens changed after {where}: {lens[:4]}")

        graphs, outs = {}, {}
        for family in ("decode", "mla_sm90"):
            for splits in [0] if family == "decode" else splits_asked:
                with _mla_plan.force_kernel(family):
                    def fn(splits=splits):
                        return cuflash.decode(q, pool, None, v_head_dim=512, cache_seqlens=lens, block_table=table,
                                              num_splits=splits)
                    outs[(family, splits)] = fn().astype(cupy.float32)
                    lens_ok(f"{family} {splits} call")
                    info = cuflash.plan(cuflash.decode, q, pool, None, v_head_dim=512, cache_seqlens=lens,
                                        block_table=table, num_splits=splits).plan.info
                    graphs[(family, splits)] = graph_of(fn) + (info["num_splits"],)
                    lens_ok(f"{family} {splits} capture")
        times = replay(graphs)
        lens_ok("the replays")
        print(f"== B{batch} L{length} Hq{heads} page {page}", flush=True)
        for key, us in sorted(times.items(), key=lambda kv: kv[1]):
            gbs = latent.nbytes / (us * 1e-6) / 1e9
            tflops = 2 * batch * heads * length * (576 + 512) / (us * 1e-6) / 1e12
            diff = float(cupy.abs(outs[key] - outs[("decode", 0)]).max())
            print(f"  {key[0]:8s} splits {graphs[key][3]:2d}: {us:8.1f} us {gbs:6.0f} GB/s {gbs / copy:.2f} copy "
                  f"{tflops:6.1f} TFLOP/s {tflops / gemm:.2f} gemm  diff {diff:.1e}", flush=True)
        del graphs, outs
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
