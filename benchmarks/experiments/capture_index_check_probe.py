"""Direct and graph-captured MLA decode calls over several shapes, both kernel families forced, for
compute-sanitizer: each call's output from a replay against the direct call's, and the lengths array
checked after each.

Run bare, under ``compute-sanitizer --tool memcheck`` and under ``--tool racecheck``:

    PYTHONPATH=$PWD python benchmarks/experiments/capture_index_check_probe.py [decode] [mla_sm90]

On an H200 (2026-11-30) the bare run and memcheck (0 errors) passed. Under racecheck (0 hazards) a
new shape's first call stopped with the index check's fault "cache_seqlens[0] = ... does not fit the
cache", the value a float of earlier data or 0x01010101, whichever family was forced: the check read
the lengths array before it held the lengths. A probe of graph-captured decode calls once stopped the
same way without a sanitizer (0x3A800000). Not explained yet: it points at the ordering of the host
path around captures, not at a kernel.
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


def main():
    families = sys.argv[1:] or ["decode", "mla_sm90"]
    kept = []   # every graph and its outputs, alive to the end
    for batch, length, heads, page, new in SHAPES:
        latent = cupy.random.standard_normal((batch, length, 1, 576), dtype=cupy.float32).astype(BF16)
        q = cupy.random.standard_normal((batch, new, heads, 576), dtype=cupy.float32).astype(BF16)
        pool, table = paged_pages(cupy, np.random.default_rng(0), latent, page) if page else (latent, None)
        lens = cupy.asarray(np.random.default_rng(1).integers(1, length + 1, batch).astype(np.int32))
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
