"""Decode's two tiles for calls of a few packed rows: the keys as the mma's M (the default) against 16
packed rows as its M (``DECODE_KEYS_AS_M_BY_DEFAULT = False``), on bf16 and fp8 caches, contiguous and
paged 16 (the table of docs/decisions.md#decode-keys-as-the-mmas-m).

GQA 32/8, D 128, bf16 q, one new token (4 packed rows), at (batch, cache length) (8, 8k), (1, 128k),
(32, 4k), (1, 32k). Figures: kernel GPU time per call (events over 50 calls with ``out=`` given, best
of 3), each cell's ratio to the bf16 cache's 16-row time, and the largest difference between the two
tiles' outputs. Run on a GPU machine:
``PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/experiments/decode_keys_as_m_probe.py``.
"""

import ml_dtypes
import numpy as np

import cupy

import cuflash
from bench_model_features import paged_pages, quantise_e4m3
from cuflash._runtime import memo
from cuflash.kernels import decode as kdecode

BF16 = cupy.dtype(ml_dtypes.bfloat16)
HQ, HK, D = 32, 8, 128
SHAPES = [(8, 8192), (1, 131072), (32, 4096), (1, 32768)]


def gpu_us(fn, calls=50) -> float:
    fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) * 1e3 / calls)
    return best


def normal(shape):
    return cupy.random.standard_normal(shape, dtype=cupy.float32)


def main():
    saved = kdecode.DECODE_KEYS_AS_M_BY_DEFAULT
    for batch, length in SHAPES:
        q = normal((batch, 1, HQ, D)).astype(BF16)
        scale = cupy.full(HK, 0.02, cupy.float32)
        shape = (batch, length, HK, D)
        k8, v8 = (quantise_e4m3(cupy, ml_dtypes, normal(shape), scale) for _ in range(2))
        k16, v16 = (normal(shape).astype(BF16) for _ in range(2))
        lens = cupy.full((batch,), length, dtype=cupy.int32)
        out = cupy.empty_like(q)
        rng = np.random.default_rng(1)
        (kp16, table), (vp16, _), (kp8, _), (vp8, _) = (paged_pages(cupy, rng, x, 16) for x in (k16, v16, k8, v8))
        fp8 = dict(kv_dtype="float8_e4m3fn", k_scale=scale, v_scale=scale)
        for layout, pages in (("contiguous", None), ("paged 16", table)):
            cells = {}
            for cache, caches, extra in (("bf16", (k16, v16) if pages is None else (kp16, vp16), {}),
                                         ("fp8", (k8, v8) if pages is None else (kp8, vp8), fp8)):
                for keys_as_m in (False, True):
                    kdecode.DECODE_KEYS_AS_M_BY_DEFAULT = keys_as_m
                    memo.clear_memo()
                    got = cuflash.decode(q, *caches, cache_seqlens=lens, block_table=pages, **extra)
                    us = gpu_us(lambda: cuflash.decode(q, *caches, cache_seqlens=lens, block_table=pages,
                                                       out=out, **extra))
                    cells[cache, keys_as_m] = us, got.astype(cupy.float32)
            base = cells["bf16", False][0]
            diff = {c: float(cupy.abs(cells[c, True][1] - cells[c, False][1]).max()) for c in ("bf16", "fp8")}
            print(f"{layout:10s} B{batch} L{length}: "
                  + " | ".join(f"{c} {'keys-as-M' if m else '16-row'} {us:.1f} us ({base / us:.2f}x)"
                               for (c, m), (us, _) in cells.items())
                  + f" | tiles differ by {diff['bf16']:.1e} (bf16), {diff['fp8']:.1e} (fp8)", flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    kdecode.DECODE_KEYS_AS_M_BY_DEFAULT = saved


if __name__ == "__main__":
    main()
