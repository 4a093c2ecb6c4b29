"""Decode's tile shapes against each other, graph-replayed, on uniform and ragged batches.

For one head dim, each tile shape (warps, keys a warp takes a stage, stages) is made the planner's only
choice in turn, the call ``ct.decode(q, k_cache, v_cache, cache_seqlens=, block_table=, out=)`` is
captured in a CUDA graph of 20 calls per shape, and the graphs replay in random-order turns (median of
9). bf16, GQA 32/8, one new token, contiguous caches and pages of 16; the batches and lengths of
``bench_decode_serving.py``. The split count is the planner's for that tile. The comparisons of
docs/decisions.md#decode-tiles (short sequences)::

    PYTHONPATH=$PWD python benchmarks/experiments/decode_tiles_probe.py --head-dim 128 --tiles 8,16,3 4,16,2
    PYTHONPATH=$PWD python benchmarks/experiments/decode_tiles_probe.py --head-dim 256 --tiles 4,16,3 2,16,2
"""
import argparse
import random
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_decode_serving import captured, kv_bytes, row_problem  # noqa: E402

import cuflash  # noqa: E402
import cuflash.interop.torch as ct  # noqa: E402
from cuflash._runtime import memo  # noqa: E402
from cuflash.kernels import decode as kdecode  # noqa: E402

CALLS, ROUNDS, HEADS_K = 20, 9, 8
BATCHES = ((1, 32768, 32768), (8, 8192, 8192), (64, 512, 4096), (128, 256, 2048), (256, 128, 1024))


def us_per_call(replay):
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    replay(0)
    replay(1)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / (2 * CALLS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tiles", nargs="+", default=["8,16,3", "4,16,2"], metavar="WARPS,KEYS,STAGES")
    args = parser.parse_args()
    tiles = {t: kdecode.DecodeTiles(*map(int, t.split(","))) for t in args.tiles}
    key = ("mma", args.head_dim)
    usual, short_keys = kdecode._DECODE_TILE_CHOICES[key], kdecode.DECODE_SHORT_KEYS
    rng = np.random.default_rng(0)
    for layout in ("contiguous", 16):
        for batch, lo, hi in BATCHES:
            p = row_problem(torch, rng, args.head_dim, layout, batch, lo, hi)
            graphs, splits, outs = {}, {}, {}
            kdecode.DECODE_SHORT_KEYS = 0   # every batch on the tile under test
            try:
                for name, shape in tiles.items():
                    kdecode._DECODE_TILE_CHOICES[key] = (shape,)
                    memo.clear_memo()
                    out = torch.empty_like(p["q"])

                    def calls(out=out):   # CALLS calls in one graph: the kernels back to back
                        for _ in range(CALLS):
                            ct.decode(p["q"], p["kc"], p["vc"], cache_seqlens=p["lens"], block_table=p["table"],
                                      out=out)
                        return out

                    # The graph writes `out` at every replay: it lives as long as the graph (each
                    # torch.cuda.graph capture empties torch's cache, unmapping freed blocks).
                    graphs[name], outs[name] = captured(torch, calls)
                    splits[name] = cuflash.plan(cuflash.decode, p["q"], p["kc"], p["vc"], cache_seqlens=p["lens"],
                                                block_table=p["table"]).plan.info["num_splits"]
            finally:
                kdecode._DECODE_TILE_CHOICES[key], kdecode.DECODE_SHORT_KEYS = usual, short_keys
                memo.clear_memo()
            times = {name: [] for name in graphs}
            for _ in range(ROUNDS):
                order = list(graphs)
                random.shuffle(order)
                for name in order:
                    us_per_call(graphs[name])   # settle
                    times[name].append(us_per_call(graphs[name]))
            nbytes = kv_bytes(p["lengths"], HEADS_K, args.head_dim)
            cells = []
            for name, t in times.items():
                us = statistics.median(t)
                cells.append(f"{name}: {splits[name]} splits {us:.1f} us {nbytes / us / 1e3:.0f} GB/s")
            print(f"{layout} ({batch}, {lo}..{hi})  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
