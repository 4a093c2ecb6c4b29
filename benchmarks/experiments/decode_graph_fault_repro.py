"""An open fault: a captured decode graph that faults at replay after other graphs came and went.

Found with ``decode_tiles_probe.py --head-dim 64 --tiles 4,16,4 8,16,3 8,16,2 4,16,6 4,16,2`` on an
H200 (2026-11-30): its replay of the paged (pages of 16) batch of 128 sequences of 256..2048 keys
raised ``cudaErrorIllegalAddress``. This script keeps what the fault needs, as far as it was narrowed
down (H200, CuPy 14.2, torch 2.11, NVRTC 13.0):

- the batches and lengths of the probe, drawn in its order from one generator (seed 0);
- for every batch, one graph of 20 ``ct.decode`` calls per tile shape (``captured`` of
  ``bench_decode_serving.py``: a warm-up on a side stream, then ``torch.cuda.graph``), each graph
  replayed once; the contiguous batches' graphs first (``--paged-only`` leaves them out);
- D 64, GQA 32/8, bf16, one new token, ``cache_seqlens`` and ``block_table`` on the GPU.

What was seen: the graph of tile (8, 16, 3) faults at its first replay on the batch of 128 sequences,
after the graph of tile (4, 16, 4) on the same batch replayed fine. It does not fault without the
contiguous batches' graphs before it, nor with tile (8, 16, 3)'s graph alone on each batch, nor as
plain calls without graphs, nor under compute-sanitizer's memcheck (0 errors) or racecheck (0
hazards). It still faults with the index check inside the decode kernel (no check kernel in the
graph), without the programmatic dependent launch, and without cuflash's own graphs of multi-kernel
plans (``GRAPH_MIN_STEPS = 0``). Not known yet: which access faults.

    PYTHONPATH=$PWD python benchmarks/experiments/decode_graph_fault_repro.py
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_decode_serving import captured, row_problem  # noqa: E402

import cuflash.interop.torch as ct  # noqa: E402
from cuflash._runtime import memo  # noqa: E402
from cuflash.kernels import decode as kdecode  # noqa: E402

BATCHES = ((1, 32768, 32768), (8, 8192, 8192), (64, 512, 4096), (128, 256, 2048), (256, 128, 1024))
CALLS, HEAD_DIM = 20, 64


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", nargs="+", default=["4,16,4", "8,16,3", "8,16,2", "4,16,6", "4,16,2"],
                        metavar="WARPS,KEYS,STAGES")
    parser.add_argument("--paged-only", action="store_true", help="no graphs of the contiguous batches")
    args = parser.parse_args()
    key = ("mma", HEAD_DIM)
    usual, short_keys = kdecode._DECODE_TILE_CHOICES[key], kdecode.DECODE_SHORT_KEYS
    kdecode.DECODE_SHORT_KEYS = 0   # every batch on the tile under test, as in decode_tiles_probe.py
    rng = np.random.default_rng(0)
    try:
        for layout in ("contiguous", 16):
            for batch, lo, hi in BATCHES:
                p = row_problem(torch, rng, HEAD_DIM, layout, batch, lo, hi)   # drawn in the probe's order
                if layout == "contiguous" and args.paged_only:
                    continue
                graphs = {}
                for tile in args.tiles:
                    kdecode._DECODE_TILE_CHOICES[key] = (kdecode.DecodeTiles(*map(int, tile.split(","))),)
                    memo.clear_memo()
                    out = torch.empty_like(p["q"])

                    def calls(out=out, p=p):
                        for _ in range(CALLS):
                            ct.decode(p["q"], p["kc"], p["vc"], cache_seqlens=p["lens"], block_table=p["table"],
                                      out=out)

                    graphs[tile] = captured(torch, calls)[0]
                for tile, replay in graphs.items():
                    print(f"{layout} ({batch}, {lo}..{hi}) tile {tile}: replaying", flush=True)
                    replay(0)
                    torch.cuda.synchronize()
    finally:
        kdecode._DECODE_TILE_CHOICES[key], kdecode.DECODE_SHORT_KEYS = usual, short_keys
        memo.clear_memo()
    print("no fault")


if __name__ == "__main__":
    main()
