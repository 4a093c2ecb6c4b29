"""A/B of decode source trees: the decode kernel built from several copies of ``cuda_src/``, each
tree's calls captured in CUDA graphs and replayed in random-order turns in one process.

This is how the decode entries of ``docs/decisions.md`` are measured. Copy ``cuda_src/`` to a
scratch folder, change the copy (or the checkout, keeping the old one), then::

    python benchmarks/ab_decode.py build old=/tmp/old/cuda_src                 # no GPU needed
    python benchmarks/ab_decode.py run old                                     # on an H100/H200

``build`` compiles, from each tree, the decode variants the problems run (bf16 queries, GQA 32/8,
D = 128, one new token: 16-bit and fp8 caches, contiguous and in pages of 16) into
``--out/NAME.pkl`` (build on the GPU machine: the installed tree is compiled there, and its NVRTC differs
from the CPU machine's; ``run`` says so). ``run`` times the installed tree (``installed``) against each built one: every
contender (tree, cache dtype, layout) is captured once in a graph of ``--calls`` calls through
``cuflash.decode`` with that tree's kernel in place, the graphs are replayed in a new random order
each round, and the median per call is printed beside the ratio to the installed tree, the bytes
read per second and their ratio to a device-to-device copy of the fp8 cache's bytes (read + write)
timed the same way, and the largest difference of any graph's outputs from the float32 result
(``WRONG`` past ``TOLERANCE``). Kernels the trees share give ratios of 1 within ~2%: the run's own
control.

A tree must keep the installed host side's interface (parameters, shared memory, tiles).
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _harness import log, note_other_compiler, nvrtc_label
from bench_model_features import HEAD_DIM, fp8_decode_problem, maxdiff, paged

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the checkout's cuflash, installed or not

from cuflash._build import compile as _compile  # noqa: E402
from cuflash.kernels import decode as _decode_kernels  # noqa: E402

SHAPES = ((1, 32768), (8, 8192), (32, 4096), (1, 131072))
KV_DTYPES = {"bf16": None, "fp8": "float8_e4m3fn"}
LAYOUTS = ("contiguous", "paged16")
# Largest difference from the float32 result that a bf16 output may show (the runs: at most 7.5e-4).
TOLERANCE = 1e-2


def variants():
    """The decode variants the problems run: one new token of a GQA group of 4 takes the keys as M, and
    (32, 4k)'s one wave of CTAs the short-sequence tiles (decode_takes_short_tiles)."""
    found = [_decode_kernels.decode_plan("bfloat16", HEAD_DIM, paged=layout != "contiguous", score_mods=(),
                                         kv_dtype=kv_dtype, keys_as_m=True, short=short).variant
             for kv_dtype in KV_DTYPES.values() for layout in LAYOUTS for short in (False, True)]
    return list(dict.fromkeys(found))


def build(args):
    jobs = [(spec.split("=", 1), v) for spec in args.trees for v in variants()]

    def compile_one(job):
        (name, src), variant = job
        result = _compile.compile_cubin(variant, "sm_90a", src_dir=src)
        print(f"{name} {variant.describe()}: {result.registers} registers, spills "
              f"{result.spill_stores}/{result.spill_loads} B", flush=True)
        return name, variant, result.cubin

    with ThreadPoolExecutor() as pool:
        results = list(pool.map(compile_one, jobs))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for name in {name for name, _, _ in results}:
        cubins = {variant: cubin for n, variant, cubin in results if n == name}
        (Path(args.out) / f"{name}.pkl").write_bytes(pickle.dumps(cubins))
        (Path(args.out) / f"{name}.nvrtc").write_text(nvrtc_label())
    return 0


class Trees:
    """Which tree's kernel ``cuflash.decode`` gets, and each tree's own memo of launches (a repeat call
    replays the launch remembered for its shapes, whichever kernel that was)."""

    def __init__(self, cupy, names, out):
        from cuflash._runtime import memo

        self.cupy, self.memo, self.current = cupy, memo, "installed"
        self.cubins = {name: pickle.loads((Path(out) / f"{name}.pkl").read_bytes()) for name in names}
        recorded = {name: Path(out) / f"{name}.nvrtc" for name in names}
        note_other_compiler({name: path.read_text() if path.exists() else None for name, path in recorded.items()})
        self.memos = {name: {} for name in ["installed", *names]}
        self.loaded, self.tmp = {}, Path(tempfile.mkdtemp())
        self.module = sys.modules["cuflash.decode"]
        self.installed_get = self.module.get_kernel
        self.module.get_kernel = self.get_kernel

    def get_kernel(self, variant):
        if self.current == "installed":
            return self.installed_get(variant)
        key = (self.current, variant)
        if key not in self.loaded:
            if variant not in self.cubins[self.current]:
                raise KeyError(f"tree {self.current} has no cubin for decode {variant.describe()}: build it")
            path = self.tmp / f"{len(self.loaded)}.cubin"
            path.write_bytes(self.cubins[self.current][variant])
            module = self.cupy.RawModule(path=str(path))
            self.loaded[key] = (module, module.get_function(variant.entry))
        return self.loaded[key][1]

    def graph(self, name, call, calls):
        """``calls`` calls of ``call`` under tree ``name``, captured on a stream of their own: (graph,
        stream, outputs)."""
        cupy = self.cupy
        installed_memo = self.memo._memo
        self.current, self.memo._memo = name, self.memos[name]
        try:
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                stream.begin_capture()
                outputs = [call() for _ in range(calls)]
                graph = stream.end_capture()
        finally:
            self.current, self.memo._memo = "installed", installed_memo
        return graph, stream, outputs


def replay_times(cupy, graphs, calls, rounds):
    """Median us per call of each graph: each round replays every graph in a new random order, once
    to settle and once timed."""
    times = {key: [] for key in graphs}
    begin, end = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(rounds):
        order = list(graphs)
        random.shuffle(order)
        for key in order:
            graph, stream = graphs[key][:2]
            graph.launch(stream)
            begin.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times[key].append(cupy.cuda.get_elapsed_time(begin, end) * 1e3 / calls)
    return {key: statistics.median(v) for key, v in times.items()}


def run(args):
    import cupy
    import ml_dtypes
    import numpy as np

    import cuflash

    trees = Trees(cupy, args.trees, args.out)
    names = ["installed", *args.trees]
    rng = np.random.default_rng(0)
    log(f"{'layout':>10} {'B':>3} {'L':>7} {'cache':>5} " + " ".join(f"{n + ' us':>14} {'x':>6}" for n in names)
        + f" {'GB/s':>6} {'x copy':>6} {'maxdiff':>8}")
    for batch, length in SHAPES:
        q, (k_scale, v_scale), (k8, v8), (k16, v16), want = fp8_decode_problem(cupy, ml_dtypes, rng, batch, length)
        lens = cupy.full((batch,), length, dtype=cupy.int32)
        source = cupy.empty(k8.nbytes + v8.nbytes, dtype=cupy.uint8)
        target = cupy.empty_like(source)
        copy_stream = cupy.cuda.Stream(non_blocking=True)
        with copy_stream:
            copy_stream.begin_capture()
            for _ in range(args.calls):
                target[...] = source
            copy_graph = copy_stream.end_capture()
        copy_us = replay_times(cupy, {"copy": (copy_graph, copy_stream)}, args.calls, args.rounds)["copy"]
        copy_rate = 2 * source.nbytes / copy_us / 1e3   # GB/s, read + write
        for layout in LAYOUTS:
            if layout == "contiguous":
                caches = {"bf16": (k16, v16), "fp8": (k8, v8)}
                table = None
            else:   # one page order for all four pools (the same seed), so one table serves them
                (kp16, table), (vp16, _), (kp8, _), (vp8, _) = (paged(cupy, np.random.default_rng(1), x)
                                                                for x in (k16, v16, k8, v8))
                caches = {"bf16": (kp16, vp16), "fp8": (kp8, vp8)}
            calls = {
                "bf16": lambda: cuflash.decode(q, *caches["bf16"], cache_seqlens=lens, block_table=table),
                "fp8": lambda: cuflash.decode(q, *caches["fp8"], cache_seqlens=lens, block_table=table,
                                              kv_dtype="float8_e4m3fn", k_scale=k_scale, v_scale=v_scale),
            }
            # The inputs were made on the legacy default stream, which the graphs' non-blocking streams
            # do not wait for: without this, the first replays can read lens before it is written.
            cupy.cuda.Device().synchronize()
            graphs = {(dt, name): trees.graph(name, call, args.calls) for dt, call in calls.items() for name in names}
            us = replay_times(cupy, graphs, args.calls, args.rounds)
            for dt in calls:
                # Every output of every graph: a replay that did no work leaves its outputs unwritten.
                diff = max(maxdiff(cupy, out, want) for name in names for out in graphs[(dt, name)][2])
                nbytes = (k8.nbytes + v8.nbytes) * (2 if dt == "bf16" else 1)
                rate = nbytes / us[(dt, "installed")] / 1e3
                log(f"{layout:>10} {batch:>3} {length:>7} {dt:>5} "
                    + " ".join(f"{us[(dt, n)]:14.1f} {us[(dt, n)] / us[(dt, 'installed')]:6.3f}" for n in names)
                    + f" {rate:6.0f} {rate / copy_rate:6.2f} {diff:8.1e}" + ("" if diff < TOLERANCE else "  WRONG"))
            del graphs
        log(f"  copy of {source.nbytes / 2**20:.0f} MiB: {copy_rate:.0f} GB/s (read + write)")
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/cuflash_ab_decode", help="where build puts the cubins")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile each tree's decode variants (no GPU needed)")
    b.add_argument("trees", nargs="+", metavar="NAME=SRC_DIR")
    r = sub.add_parser("run", help="time the built trees beside the installed one (GPU)")
    r.add_argument("trees", nargs="+", metavar="NAME")
    r.add_argument("--calls", type=int, default=20, help="calls per graph (default 20)")
    r.add_argument("--rounds", type=int, default=15, help="timed replays per contender, median (default 15)")
    args = parser.parse_args(argv)
    return build(args) if args.command == "build" else run(args)


if __name__ == "__main__":
    sys.exit(main())
