"""Context parallelism benchmark: ring attention (cuflash.distributed) against one GPU's throughput.

Shapes: causal self-attention, bf16, D = 128, B = 1, ``--heads`` query heads and ``--kv-heads`` kv
heads (default 16 and 16), total sequence T in 32k .. 1M tokens (``--tokens``), for each world size
present among 2, 4, 8 GPUs (``--worlds``). Rank r holds T / world tokens in the zigzag layout.

Ring mode (default): one process per GPU, spawned from Python, joined by CuPy's NCCL
(``cupy.cuda.nccl``); every rank times ``cuflash.distributed.ring_attention`` (forward) and
``ring_attention`` + ``ring_attention_backward`` (forward+backward). A timed run is one call (two
for forward+backward) with CUDA events around each public call, host work included, after an NCCL
barrier; the median of ``--repeats`` runs on each rank, and of those the slowest rank's (the ring is
done when its last rank is). Beside it, in turns with the ring's runs (each repeat runs both, so
that the GPU's clock drift falls on both alike), every rank times one ``cuflash.attention_forward``
(and ``attention_backward``) over its own T / world tokens, causal: one GPU's time t1 at the per-rank
length (median over runs, then over ranks).

Fraction of ideal. Ideal is world x one GPU's throughput (FLOP/s) at the per-rank length: the ring
computes world^2 times the work of that single call (causal attention is quadratic), spread over
world GPUs, so its ideal time is world * t1, and

    tokens/s = T / t_ring,   ideal tokens/s = T / (world * t1),   fraction = world * t1 / t_ring.

``--comm torch``: the same, as torch users call it: torch tensors, ``cuflash.interop.torch.ring_attention``
and ``backward()`` (autograd) over a ``torch.distributed`` NCCL group; t1 from
``cuflash.interop.torch.attention``.

``--virtual``: one GPU runs ``ring_attention_virtual`` with ``world`` virtual ranks over T tokens
(the same driver, joined by device copies); its ideal is one single-GPU call over all T tokens (the
same work without a ring): fraction = t_single(T) / t_virtual. It measures what the decomposition
costs (smaller calls, merges, copies) apart from the network.

Output: progress lines, then a Markdown table on stdout; a CSV, the table and a plot (fraction of
ideal against T, one line per world and pass; needs matplotlib) under benchmarks/results/, named
``context_parallel[_virtual]_<gpu>.{csv,md,png}`` unless ``--csv``/``--md``/``--plot`` say otherwise.
A point that does not fit in memory is reported as ``-``.

Examples
--------
    python benchmarks/bench_context_parallel.py                     # every world size present
    python benchmarks/bench_context_parallel.py --worlds 2 --tokens 131072,262144
    python benchmarks/bench_context_parallel.py --virtual --worlds 2,4,8 --quick
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import statistics
import sys
import time

from _harness import log, markdown_table, write_results

FULL_TOKENS = (32768, 65536, 131072, 262144, 524288, 1048576)
QUICK_TOKENS = (32768, 131072)
HEAD_DIM = 128
PASSES = ("fwd", "fwd+bwd")
COLUMNS = ["mode", "world", "tokens", "per_rank", "pass", "ring_ms", "single_ms", "tokens/s", "ideal tokens/s",
           "fraction"]
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="cuflash ring attention (context parallelism) against one GPU.")
    p.add_argument("--virtual", action="store_true", help="one GPU, virtual ranks (ring_attention_virtual)")
    p.add_argument("--comm", choices=("cupy", "torch"), default="cupy",
                   help="ring mode's communicator and arrays: CuPy arrays over cupy.cuda.nccl (default), or torch "
                        "tensors through cuflash.interop.torch.ring_attention (autograd) over torch.distributed")
    p.add_argument("--worlds", default=None, help="comma-separated world sizes (default: those of 2, 4, 8 "
                                                  "that fit the GPUs present; --virtual: 2, 4, 8)")
    p.add_argument("--tokens", default=None, help=f"comma-separated total tokens T (default {FULL_TOKENS})")
    p.add_argument("--quick", action="store_true", help=f"tokens {QUICK_TOKENS}, 3 repeats")
    p.add_argument("--heads", type=int, default=16, help="query heads (default 16)")
    p.add_argument("--kv-heads", type=int, default=None, help="kv heads (default: --heads)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per point (median); default 5, 3 quick")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (default 1)")
    p.add_argument("--csv", default=None, help="CSV path (default under benchmarks/results/)")
    p.add_argument("--md", default=None, help="Markdown path (default under benchmarks/results/)")
    p.add_argument("--plot", default=None, help="PNG path (default under benchmarks/results/)")
    args = p.parse_args(argv)
    args.tokens = ([int(t) for t in args.tokens.split(",") if t.strip()] if args.tokens
                   else list(QUICK_TOKENS if args.quick else FULL_TOKENS))
    args.worlds = [int(w) for w in args.worlds.split(",") if w.strip()] if args.worlds else None
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.kv_heads = args.kv_heads or args.heads
    return args


# ----------------------------------------------------------------------------- timing

def timed_in_turns(fns, args, event, elapsed, before=None):
    """Median milliseconds of each of ``fns`` (name -> callable), timed in turns: every repeat runs
    each once, so that the GPU's clock drift over a run (it slows as it heats) falls on all alike.
    CUDA events (``event()``; ``elapsed(start, end)`` in ms) around each call on the current stream;
    ``before()`` (a barrier) ahead of every call, outside the events."""
    for _ in range(args.warmup):
        for fn in fns.values():
            if before:
                before()
            fn()
    times = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            if before:
                before()
            start, end = event(), event()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(elapsed(start, end))
    return {name: statistics.median(t) for name, t in times.items()}


def ring_and_single(ring_fwd, ring_both, single_fwd, single_both, args, event, elapsed, before=None):
    """({pass: ms} of the ring, {pass: ms} of the single call), each pass's two timed in turns."""
    fwd = timed_in_turns({"ring": ring_fwd, "single": single_fwd}, args, event, elapsed, before)
    both = timed_in_turns({"ring": ring_both, "single": single_both}, args, event, elapsed, before)
    return ({"fwd": fwd["ring"], "fwd+bwd": both["ring"]}, {"fwd": fwd["single"], "fwd+bwd": both["single"]})


def cupy_events(cupy):
    return cupy.cuda.Event, cupy.cuda.get_elapsed_time


def make_inputs(cupy, seqlen, heads, kv_heads):
    """q, dout (1, S, Hq, D) and k, v (1, S, Hk, D), bf16, standard normal."""
    import ml_dtypes

    def normal(h):
        return cupy.random.standard_normal((1, seqlen, h, HEAD_DIM), dtype=cupy.float32).astype(ml_dtypes.bfloat16)

    return normal(heads), normal(kv_heads), normal(kv_heads), normal(heads)


def bytes_needed(seqlen, heads, kv_heads, world):
    """A generous bound of one rank's memory for forward+backward at ``seqlen`` tokens: bf16 q, dout,
    out, dq, the forward's ``world`` parts, k, v, their two spare buffers, dk, dv and the calls' dk,
    dv; float32 dq (the sum and the kernel's accumulator), the dK/dV sums (two sets); and 1 GiB of
    slack."""
    row_q, row_kv = seqlen * heads * HEAD_DIM, seqlen * kv_heads * HEAD_DIM
    return int(2 * ((4 + world) * row_q + 10 * row_kv) + 4 * (2 * row_q + 4 * row_kv)) + (1 << 30)


def single_calls(cuflash, q, k, v, dout):
    """One GPU's forward and forward+backward over all of q's tokens (causal), as callables."""
    def fwd():
        return cuflash.attention_forward(q, k, v, causal=True)

    def both():
        out, lse, _ = fwd()
        cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)

    return fwd, both


# ----------------------------------------------------------------------------- ring mode: one process per GPU

def rank_main(rank, world, unique_id, args, results):
    """One rank: for each T, its ring times and its single-GPU time t1 (ms), put on ``results``."""
    import cupy
    from cupy.cuda import nccl

    import cuflash
    from cuflash import distributed as cd

    cupy.cuda.Device(rank).use()
    comm = nccl.NcclCommunicator(world, unique_id, rank)
    flag = cupy.zeros(1, cupy.float32)

    def barrier():
        comm.allReduce(flag.data.ptr, flag.data.ptr, 1, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       cupy.cuda.get_current_stream().ptr)
        cupy.cuda.get_current_stream().synchronize()

    def agree(ok):   # every rank runs a point, or none does (a lone rank would wait for ever)
        flag.fill(0.0 if ok else 1.0)
        barrier()
        return float(flag.get()[0]) == 0.0

    for tokens in args.tokens:
        seqlen = tokens // world
        free = cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()
        if not agree(tokens % (2 * world) == 0 and free >= bytes_needed(seqlen, args.heads, args.kv_heads, world)):
            results.put((rank, tokens, None))
            continue
        try:
            q, k, v, dout = make_inputs(cupy, seqlen, args.heads, args.kv_heads)

            def forward():
                return cd.ring_attention(q, k, v, group=comm, causal=True)

            def both():
                out, lse = forward()
                cd.ring_attention_backward(dout, q, k, v, out, lse, group=comm, causal=True)

            times = ring_and_single(forward, both, *single_calls(cuflash, q, k, v, dout), args, *cupy_events(cupy),
                                    barrier)
            results.put((rank, tokens, times))
        finally:
            q = k = v = dout = None
            cupy.get_default_memory_pool().free_all_blocks()


def torch_rank_main(rank, world, store, args, results):
    """One rank as torch users call: torch tensors, ``cuflash.interop.torch.ring_attention`` and
    ``backward()`` over a torch.distributed NCCL group; t1 from ``cuflash.interop.torch.attention``."""
    import torch
    import torch.distributed as dist

    import cuflash.interop.torch as ct

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store, world), rank=rank, world_size=world)
    flag = torch.zeros(1, device="cuda")

    def barrier():
        dist.all_reduce(flag)
        torch.cuda.synchronize()

    def agree(ok):
        flag.fill_(0.0 if ok else 1.0)
        barrier()
        return float(flag.item()) == 0.0

    def event():
        return torch.cuda.Event(enable_timing=True)

    def elapsed(start, end):
        return start.elapsed_time(end)

    try:
        for tokens in args.tokens:
            seqlen = tokens // world
            free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
            if not agree(tokens % (2 * world) == 0 and free >= bytes_needed(seqlen, args.heads, args.kv_heads, world)):
                results.put((rank, tokens, None))
                continue

            def normal(h):
                return torch.randn(1, seqlen, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

            q, k, v = (normal(h).requires_grad_(True) for h in (args.heads, args.kv_heads, args.kv_heads))
            dout = normal(args.heads)

            def forward(attend):
                def run():
                    with torch.no_grad():
                        return attend(q, k, v, causal=True)
                return run

            def both(attend):
                def run():
                    attend(q, k, v, causal=True).backward(dout)
                return run

            times = ring_and_single(forward(ct.ring_attention), both(ct.ring_attention), forward(ct.attention),
                                    both(ct.attention), args, event, elapsed, barrier)
            results.put((rank, tokens, times))
            q = k = v = dout = None
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


def run_ring(args, world):
    import multiprocessing
    import tempfile

    from cupy.cuda import nccl

    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    if args.comm == "torch":
        store = tempfile.mktemp(prefix="cuflash-cp-store-")   # a FileStore's file, made by the ranks
        target, shared = torch_rank_main, store
    else:
        target, shared = rank_main, nccl.get_unique_id()   # drawn here, handed to every rank
    ranks = [spawn.Process(target=target, args=(r, world, shared, args, results)) for r in range(world)]
    for p in ranks:
        p.start()
    got, pending = {}, world * len(args.tokens)
    try:
        while pending:
            try:
                rank, tokens, times = results.get(timeout=10)
            except queue.Empty:   # a rank that died leaves the others waiting in NCCL for ever
                dead = [r for r, p in enumerate(ranks) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"world {world}: rank(s) {dead} failed (see their output above)") from None
                continue
            pending -= 1
            got.setdefault(tokens, {})[rank] = times
            if len(got[tokens]) == world:
                log(f"world {world}, T = {tokens}: done")
    finally:
        for p in ranks:
            p.join(60)
            if p.is_alive():
                p.kill()
    rows = []
    for tokens in args.tokens:
        per_rank = got.get(tokens, {})
        for name in PASSES:
            times = list(per_rank.values())
            ok = len(times) == world and all(t is not None for t in times)
            ring = max(t[0][name] for t in times) if ok else None
            single = statistics.median(t[1][name] for t in times) if ok else None
            rows.append(row(f"nccl ({args.comm})", world, tokens, tokens // world, name, ring, single, world * single if ok else None))
    return rows


def row(mode, world, tokens, per_rank, name, ring_ms, single_ms, ideal_ms):
    r = {"mode": mode, "world": world, "tokens": tokens, "per_rank": per_rank, "pass": name, "ring_ms": ring_ms,
         "single_ms": single_ms}
    if ring_ms and ideal_ms:
        r.update({"tokens/s": tokens / (ring_ms * 1e-3), "ideal tokens/s": tokens / (ideal_ms * 1e-3),
                  "fraction": ideal_ms / ring_ms})
    return r


# ----------------------------------------------------------------------------- virtual mode: one GPU

def run_virtual(args, worlds):
    import cupy

    import cuflash
    from cuflash import distributed as cd

    rows = []
    for tokens in args.tokens:
        try:
            q, k, v, dout = make_inputs(cupy, tokens, args.heads, args.kv_heads)
            single = single_calls(cuflash, q, k, v, dout)
        except cupy.cuda.memory.OutOfMemoryError:
            log(f"T = {tokens}: out of memory on one GPU")
            single = None
        for world in worlds:
            times = None
            if single is not None and tokens % (2 * world) == 0:
                try:
                    def forward(world=world):
                        return cd.ring_attention_virtual(q, k, v, world=world, causal=True)

                    def both(world=world):
                        out, lse = forward()
                        cd.ring_attention_backward_virtual(dout, q, k, v, out, lse, world=world, causal=True)

                    times = ring_and_single(forward, both, *single, args, *cupy_events(cupy))
                except cupy.cuda.memory.OutOfMemoryError:
                    log(f"T = {tokens}, world {world}: out of memory")
                cupy.get_default_memory_pool().free_all_blocks()
            for name in PASSES:
                ring, base = (times[0][name], times[1][name]) if times else (None, None)
                rows.append(row("virtual", world, tokens, tokens // world, name, ring, base, base))
            log(f"virtual world {world}, T = {tokens}: done")
        q = k = v = dout = None
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


# ----------------------------------------------------------------------------- output

def write_plot(rows, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not importable: no plot written")
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for world in sorted({r["world"] for r in rows}):
        for name, style in zip(PASSES, ("--", "-")):
            sel = [r for r in rows if r["world"] == world and r["pass"] == name and r.get("fraction")]
            if sel:
                ax.plot([r["tokens"] for r in sel], [r["fraction"] for r in sel], style, marker="o",
                        label=f"{world} {'virtual ranks' if sel[0]['mode'] == 'virtual' else 'GPUs'}, {name}")
    for bar in (0.85, 0.9):
        ax.axhline(bar, color="gray", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("total tokens T")
    ax.set_ylabel("fraction of ideal")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"plot written to {path}")


def gpu_tag(name):
    match = re.search(r"[A-Z]\d{2,3}", name)
    return match.group(0).lower() if match else "gpu"


CELLS = {"ring_ms": lambda v: f"{v:.2f}", "single_ms": lambda v: f"{v:.2f}", "tokens/s": lambda v: f"{v:,.0f}",
         "ideal tokens/s": lambda v: f"{v:,.0f}", "fraction": lambda v: f"{v:.3f}"}


def main(argv=None):
    args = parse_args(argv)
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        count = 0
    if count == 0:
        print("no CUDA GPU found: nothing to benchmark", file=sys.stderr)
        return 1
    props = cupy.cuda.runtime.getDeviceProperties(0)
    device_name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    if args.virtual:
        worlds = args.worlds or [2, 4, 8]
        rows = run_virtual(args, worlds)
        what = "one GPU, virtual ranks; ideal = one call over all T tokens"
    else:
        from cupy.cuda import nccl
        if args.comm == "cupy" and not nccl.available:
            print("cupy.cuda.nccl is not available (no NCCL library): use --comm torch, or --virtual on one GPU",
                  file=sys.stderr)
            return 1
        worlds = args.worlds or [w for w in (2, 4, 8) if w <= count]
        if not worlds or max(worlds) > count:
            print(f"{count} GPU(s) present: the ring needs 2 or more (or --virtual)", file=sys.stderr)
            return 1
        rows = []
        for world in worlds:
            try:
                rows += run_ring(args, world)
            except RuntimeError as error:   # one broken world size should not hide the others
                log(str(error))
        what = ("NCCL ring, one process per GPU, " + ("CuPy arrays over cupy.cuda.nccl" if args.comm == "cupy" else
                "torch tensors through cuflash.interop.torch (autograd) over torch.distributed") +
                "; ideal = world x one GPU at T / world tokens")
    header = (f"**{device_name}** x {count} (cupy {cupy.__version__}). Causal ring attention, bf16, D = {HEAD_DIM}, "
              f"B = 1, Hq = {args.heads}, Hk = {args.kv_heads}; {what}; median of {args.repeats} runs, the slowest "
              f"rank's; ms per call (fwd+bwd: both calls).")
    table = markdown_table(rows, header, COLUMNS, CELLS)
    mode = "_virtual" if args.virtual else "_torch" if args.comm == "torch" else ""
    stem = os.path.join(RESULTS, f"context_parallel{mode}_{gpu_tag(device_name)}")
    os.makedirs(RESULTS, exist_ok=True)
    write_results(rows, table, COLUMNS, args.csv or stem + ".csv", args.md or stem + ".md")
    write_plot(rows, args.plot or stem + ".png", header.replace("**", "")[:120])
    print()
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"\n(bench_context_parallel took {time.time() - t0:.0f} s)", file=sys.stderr)
    sys.exit(rc)

