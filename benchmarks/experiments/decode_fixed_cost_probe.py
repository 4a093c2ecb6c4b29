"""Decode's GPU time per replay against its kernels' own time, cuflash beside SDPA cuDNN.

Each contender is captured in a CUDA graph of one call (``captured`` of ``bench_decode_serving.py``),
replayed in random-order turns (median of 9 rounds of 30 replays), then profiled: torch's profiler
gives each replay's kernels, their time and their launch shapes (grid, block, shared memory,
registers). bf16, GQA 32/8, one new token, contiguous caches, the bar's four (B, L). A kernel that
only spins for ~30 us, replayed the same way, gives the replay's own cost. (This script gathers the
measurements of that entry, which were taken piecewise; it has not run as a whole yet.) The figures of
docs/decisions.md#decode-the-fixed-cost-beside-cudnn::

    PYTHONPATH=$PWD python benchmarks/experiments/decode_fixed_cost_probe.py [--head-dim 128]
"""
import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_decode_serving import captured  # noqa: E402

import cuflash.interop.torch as ct  # noqa: E402

HEADS_Q, HEADS_K, ROUNDS, REPLAYS = 32, 8, 9, 30
SHAPES = ((1, 32768), (8, 8192), (32, 4096), (1, 131072))


def us_per_replay(replay):
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(REPLAYS):
        replay(0)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / REPLAYS


def kernels_of(replay):
    """{kernel name: (launches a replay, median us, launch shape)} over 20 replays."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            replay(0)
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    found = {}
    for event in json.load(open(path))["traceEvents"]:
        if event.get("cat") != "kernel":
            continue
        args = event.get("args", {})
        shape = tuple(args.get(k) for k in ("grid", "block", "shared memory", "registers per thread"))
        found.setdefault(event["name"][:48], ([], shape))[0].append(event["dur"])
    return {name: (len(durs) / 20, statistics.median(durs), shape) for name, (durs, shape) in found.items()}


def spin(cycles):
    """A kernel of one thread that spins for ``cycles`` SM cycles (~30 us at an H200's 1.98 GHz)."""
    return lambda: torch.cuda._sleep(cycles)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    d = args.head_dim
    for batch, length in SHAPES:
        q = torch.randn(batch, 1, HEADS_Q, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, length, HEADS_K, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch, length, HEADS_K, d, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        tq, tk, tv = (x.transpose(1, 2) for x in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

        calls = {"cuflash": lambda: ct.decode(q, k, v, cache_seqlens=lens, out=out), "cudnn": cudnn,
                 "spin": spin(60000)}
        graphs = {name: captured(torch, fn) for name, fn in calls.items()}   # (replay, output): both kept
        times = {name: [] for name in graphs}
        for _ in range(ROUNDS):
            order = list(graphs)
            random.shuffle(order)
            for name in order:
                us_per_replay(graphs[name][0])   # settle
                times[name].append(us_per_replay(graphs[name][0]))
        print(f"== ({batch}, {length}) D {d}", flush=True)
        for name, (replay, _) in graphs.items():
            found = kernels_of(replay)
            kernel_us = sum(count * us for count, us, _ in found.values())
            print(f"  {name:10s} replay {statistics.median(times[name]):7.1f} us, kernels {kernel_us:7.1f} us")
            for kernel, (count, us, shape) in found.items():
                print(f"      {kernel:48s} x{count:.0f} {us:7.1f} us  grid/block/smem/regs {shape}")


if __name__ == "__main__":
    main()
