"""Host time per call of every cuflash entry point, and end-to-end time per call, beside torch SDPA.

Everything runs in one process on one stream (torch's current stream, which is also CuPy's), the
peers measured in the same run. Three parts:

1. **Host microseconds per repeat call** (``host``) of ``attention``, ``attention_backward``,
   ``attention_varlen``, ``decode`` (contiguous and paged, page 16) and ``merge_states``, called
   with CuPy arrays, with torch tensors, and through a ``cuflash.plan`` (CuPy arrays), beside
   torch SDPA's FLASH_ATTENTION and CUDNN_ATTENTION backends on the same memory (BHSD views).
   Method: warm-up calls, then per loop: synchronise the device, two untimed calls, then
   ``time.perf_counter()`` around the host submission of N = 30 back-to-back calls, divided by N;
   the device is synchronised after the clock stops (outside the timed region). Median of
   ``--runs`` loops, in each of which every row's front ends and peers (the launch floor's too)
   take turns (each loop starting one later): the host's speed drifts over seconds, and timed in
   one loop all rows sample the same drift. N
   is small so that the launch queue cannot fill where the GPU takes longer per call than the
   host (a full queue blocks submission; loops of 200 backward calls measured the GPU's pace, the
   host time equal to the event time per call). The ``gpu us`` column is the GPU's own time per
   cuflash (CuPy) call: the N calls are queued behind a spin kernel (``torch.cuda._sleep``) that
   outlasts their submission, so CUDA events time them back to back with no host gaps (events
   around the host loop itself measure the host's pace wherever the host is slower, which session
   22 misread as GPU-bound). A row whose GPU time exceeds its host time is marked ``gpu-bound``.
   How each is called, as a user would: cuflash writes into ``out=`` / ``dq=, dk=, dv=`` /
   ``out=, lse=`` (merge_states) buffers (torch tensors in the torch column, returned as those very
   tensors); index arrays (``cache_seqlens``, ``block_table``, ``cu_seqlens``) live on the GPU;
   torch's backend is chosen once around the loop (``sdpa_kernel``), as a model selects it;
   torch's backward is
   ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` on an SDPA output; varlen's peer
   is ``torch.nn.attention.varlen.varlen_attn`` (flash) when this torch has it; decode's peers run
   SDPA with ``enable_gqa=True`` on the contiguous cache (``*``: the backend refused GQA, so K/V are
   expanded with ``repeat_interleave`` inside every call, as a user would have to); merge_states
   has no torch peer.
   Bars (issue 15): attention <= 15 us (CuPy) / 25 us (torch); attention_backward <= 25 us;
   decode contiguous and paged <= 20 us (CuPy) / 30 us (torch); merge_states <= 10 us; and never
   more than cuDNN's host time for the same call. The first row, ``launch floor``, is what any
   caller pays on this host: an empty kernel through cuLaunchKernel (CuPy's binding, as cuflash
   launches), and ``torch.add`` of two small tensors; the host's speed moves between machines
   and over a run, and this row measures it beside the others.
2. **End-to-end decode** (``decode``) at (B, L) = (8, 8k), (1, 128k), (32, 4k), (1, 32k), bf16,
   GQA 32/8, D = 128, one new token (Sq = 1, the cache full: ``cache_seqlens`` = L on the GPU),
   contiguous and paged (page 16, pages in random order): cuflash from torch tensors and from
   CuPy arrays against SDPA flash (and cuDNN where it runs) on the contiguous cache.
3. **End-to-end forward** (``forward``): bf16, D = 128 (``--head-dims 64,128,256``: the forward
   grid), heads x D = 2048, B * S = 16k tokens, S = 1k, 4k, 8k, 16k (``--quick``: 1k, 8k;
   ``--seqlens``), causal and not; cuflash from torch tensors (and CuPy arrays) against
   SDPA cuDNN and flash; three input sets in rotation so that L2 cannot hold them.

End-to-end time: CUDA events around N back-to-back calls (host work included, so a host-bound call
shows), N sized to about ``--target-ms``, contenders timed in turns (each repeat runs every
contender once, in a new random order, each timed run after an untimed one of the same
contender), median of ``--repeats``. Ratios ``vs flash`` / ``vs cudnn`` are peer time / cuflash
time (> 1: cuflash is faster). Bars: decode >= 1.0x flash contiguous, >= 0.9x paged; forward >= 0.95x cuDNN at every
shape, >= 1.0x at D = 128 8k.

Before timing, every cuflash call is checked once against the peer's output (or a float32 CuPy
computation when there is no peer): ``maxdiff`` is the largest |difference| over the call's
outputs, and ``check`` fails when it exceeds 4 bf16 ulps of the outputs' scale (gradients: 2**-5
of their largest value). Kernels are compiled first, in parallel, by planning each distinct call
(``cuflash.plan`` compiles without launching); ``python -m cuflash precompile`` beforehand helps.

Output: progress lines, the three tables, and a short table of the bars last; ``--out DIR`` also
writes ``DIR/bench_host.md`` and ``DIR/bench_host.csv``.

Examples
--------
    python benchmarks/bench_host.py --quick
    python benchmarks/bench_host.py --out results/host_h100
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from _harness import N_INPUT_SETS, fmt, log, markdown_table, missing, open_gpu, turn_orders

DECODE_SHAPES = ((8, 8192), (1, 131072), (32, 4096), (1, 32768))
HEADS_Q, HEADS_K, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
FORWARD_SEQLENS = (1024, 4096, 8192, 16384)
FORWARD_SEQLENS_QUICK = (1024, 8192)
FORWARD_TOKENS, FORWARD_HIDDEN = 16384, 2048   # heads = hidden / head dim, as bench_forward.py

# Host bars (us): (entry, frontend) -> bar. The issue's "decode (contiguous and paged) <= 20 us /
# 30 us" is read like attention's "15 us with CuPy arrays / 25 us with torch tensors".
HOST_BARS = {
    ("attention", "cupy"): 15, ("attention", "torch"): 25,
    ("attention_backward", "cupy"): 25, ("attention_backward", "torch"): 25,
    ("decode contiguous", "cupy"): 20, ("decode contiguous", "torch"): 30,
    ("decode paged16", "cupy"): 20, ("decode paged16", "torch"): 30,
    ("merge_states", "cupy"): 10, ("merge_states", "torch"): 10,
}
DECODE_BARS = {"contiguous": 1.0, "paged16": 0.9}
FORWARD_BAR, FORWARD_BAR_8K = 0.95, 1.0

HOST_COLUMNS = ["entry", "problem", "cupy us", "torch us", "plan us", "flash us", "cudnn us", "gpu us", "maxdiff",
                "check", "bar"]
DECODE_COLUMNS = ["layout", "B", "L", "torch us", "cupy us", "flash us", "cudnn us", "torch GB/s", "vs flash",
                  "vs cudnn", "maxdiff", "check", "bar"]
FORWARD_COLUMNS = ["D", "causal", "B", "S", "torch TFLOP/s", "cupy TFLOP/s", "cudnn TFLOP/s", "flash TFLOP/s", "vs cudnn",
                   "vs flash", "maxdiff", "check", "bar"]
SUMMARY_COLUMNS = ["bar", "value", "target", "result"]

CELLS = {"maxdiff": lambda v: f"{v:.1e}", "vs flash": lambda v: f"{v:.2f}", "vs cudnn": lambda v: f"{v:.2f}"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="cuflash host time per call and end-to-end time, beside torch SDPA.")
    p.add_argument("--quick", action="store_true", help="forward at 1k and 8k only, fewer repeats (~3 min on an H100)")
    p.add_argument("--out", default=None, help="directory for bench_host.md and bench_host.csv")
    p.add_argument("--parts", default="host,decode,forward", help="comma-separated subset of host, decode, forward")
    p.add_argument("--calls", type=int, default=30, help="back-to-back calls per host-time loop (default 30)")
    p.add_argument("--runs", type=int, default=None,
                   help="host-time loops (every host row in each), median; GPU-time runs per row (default 101, 41 quick)")
    p.add_argument("--repeats", type=int, default=None, help="end-to-end timed runs per point (default 7, 3 quick)")
    p.add_argument("--target-ms", type=float, default=None, help="length of one end-to-end run (default 40, 20 quick)")
    p.add_argument("--head-dims", default="128", help="forward part: head dims (default 128; the forward grid: "
                                                      "64,128,256)")
    p.add_argument("--seqlens", default=None, help="forward part: sequence lengths (default 1k,4k,8k,16k; quick 1k,8k)")
    p.add_argument("--no-torch", action="store_true", help="do not use torch even if importable")
    p.add_argument("--plot", default=None, metavar="CSV",
                   help="no GPU run: draw DIR/bench_host.png (--out DIR, default the CSV's folder) from a "
                        "bench_host.csv (needs matplotlib)")
    args = p.parse_args(argv)
    args.parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    unknown = args.parts - {"host", "decode", "forward"}
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}")
    args.runs = args.runs or (41 if args.quick else 101)
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.target_ms = args.target_ms or (20.0 if args.quick else 40.0)
    if args.seqlens:
        args.seqlens = tuple(int(x) for x in args.seqlens.split(","))
    else:
        args.seqlens = FORWARD_SEQLENS_QUICK if args.quick else FORWARD_SEQLENS
    args.head_dims = tuple(int(x) for x in args.head_dims.split(","))
    return args


# ----------------------------------------------------------------------------- timing

def host_us_each(env, contenders):
    """{name: host us per call} for ``{name: (fn, ctx or None)}``: medians over ``env.args.runs``
    loops of ``env.args.calls`` back-to-back calls, each loop starting on an idle device after two
    untimed calls (the host's caches warm again after the wait). The contenders take turns, each
    run starting one later: host times drift along a sequence too (the same merge_states call
    measured 9.1 us first and 14.1 us third in a fixed order). (The GPU's own time per call is
    :func:`gpu_us_per_call`'s: events around this loop would time the host's pace where it is the
    slower.)"""
    calls = env.args.calls
    device = env.cp.cuda.Device()
    host = {name: [] for name in contenders}
    names = list(contenders)
    for name, (fn, ctx) in contenders.items():
        with ctx() if ctx is not None else contextlib.nullcontext():
            for _ in range(5):
                fn()
    for r in range(env.args.runs):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, ctx = contenders[name]
            with ctx() if ctx is not None else contextlib.nullcontext():
                device.synchronize()
                fn()
                fn()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                t1 = time.perf_counter()
                device.synchronize()
            host[name].append((t1 - t0) / calls * 1e6)
    return {name: statistics.median(host[name]) for name in names}


def gpu_us_per_call(env, fn, host_us):
    """CUDA-event time per call of ``env.args.calls`` back-to-back calls of ``fn`` queued behind a
    spin kernel that lasts twice their measured submission time (``host_us`` per call), so that
    the GPU runs them without waiting for the host; median of ``env.args.runs``. None without
    torch (whose ``torch.cuda._sleep`` is the spin kernel)."""
    torch = env.torch
    if torch is None or not hasattr(torch.cuda, "_sleep"):
        return None
    cp, calls = env.cp, env.args.calls
    clock_khz = cp.cuda.Device().attributes["ClockRate"]
    cycles = int(2 * host_us * calls * clock_khz / 1000) + 100_000
    times = []
    for _ in range(env.args.runs):
        cp.cuda.Device().synchronize()
        torch.cuda._sleep(cycles)
        begin, end = cp.cuda.Event(), cp.cuda.Event()
        begin.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(begin, end) / calls * 1e3)
    return statistics.median(times)


def e2e_ms_each(env, contenders):
    """{name: ms per call} for ``{name: (fn(i), ctx or None)}``: CUDA events around N back-to-back
    calls (``fn(i)`` gets the input-set index), N sized to about ``--target-ms``; timed in turns,
    median of ``--repeats``. A contender's context (torch's backend choice) wraps its whole run."""
    cp = env.cp

    def run(fn, n, start):
        begin, end = cp.cuda.Event(), cp.cuda.Event()
        begin.record()
        for i in range(n):
            fn((start + i) % N_INPUT_SETS)
        end.record()
        end.synchronize()
        return cp.cuda.get_elapsed_time(begin, end) / n

    counts = {}
    for name, (fn, ctx) in contenders.items():
        with ctx() if ctx is not None else contextlib.nullcontext():
            for i in range(3):
                fn(i % N_INPUT_SETS)
            cp.cuda.Device().synchronize()
            single = run(fn, 1, 0)
        counts[name] = int(min(1000, max(N_INPUT_SETS, math.ceil(env.args.target_ms / max(single, 1e-3)))))
    times = {name: [] for name in contenders}
    for r, order in enumerate(turn_orders(list(contenders), env.args.repeats)):
        # Each repeat in a new order, and each timed run after an untimed one of the same contender:
        # at the power limit a run's clock depends on what ran just before it
        # (_harness.Timer.median_ms_each).
        for name in order:
            fn, ctx = contenders[name]
            with ctx() if ctx is not None else contextlib.nullcontext():
                run(fn, counts[name], r)
                times[name].append(run(fn, counts[name], r))
    return {name: statistics.median(t) for name, t in times.items()}


# ----------------------------------------------------------------------------- references and checks

def naive_attention(cp, q, k, v, causal=False):
    """float32 attention of (B, Sq, Hq, D) over (B, Sk, Hk, D), GQA; bottom-right causal."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    qf = q.astype(cp.float32).reshape(b, sq, hk, g, d)
    kf, vf = k.astype(cp.float32), v.astype(cp.float32)
    s = cp.einsum("bihgd,bjhd->bhgij", qf, kf) / math.sqrt(d)
    if causal:
        i = cp.arange(sq)[:, None]
        j = cp.arange(sk)[None, :]
        s = cp.where(j <= i + sk - sq, s, -cp.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = cp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return cp.einsum("bhgij,bjhd->bihgd", p, vf).reshape(b, sq, hq, d)


def naive_decode(cp, q, k, v):
    """float32 attention of q (B, 1, Hq, D) over a contiguous cache, one sequence at a time."""
    return cp.concatenate([naive_attention(cp, q[i:i + 1], k[i:i + 1], v[i:i + 1]) for i in range(q.shape[0])])


def naive_backward(cp, dout, q, k, v):
    """float32 gradients of non-causal attention with Hq == Hk, (B, S, H, D) arrays."""
    f = cp.float32
    qf, kf, vf, dof = (x.astype(f).transpose(0, 2, 1, 3) for x in (q, k, v, dout))
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = cp.matmul(qf, kf.transpose(0, 1, 3, 2)) * scale
    s -= s.max(axis=-1, keepdims=True)
    p = cp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    o = cp.matmul(p, vf)
    dv = cp.matmul(p.transpose(0, 1, 3, 2), dof)
    dp = cp.matmul(dof, vf.transpose(0, 1, 3, 2))
    ds = p * (dp - (dof * o).sum(axis=-1, keepdims=True))
    dq = cp.matmul(ds, kf) * scale
    dk = cp.matmul(ds.transpose(0, 1, 3, 2), qf) * scale
    return [x.transpose(0, 2, 1, 3) for x in (dq, dk, dv)]


def naive_merge(cp, outs, lses):
    """float32 merge of outs (n, B, S, H, D) with lses (n, B, H, S): (out, lse)."""
    lse_t = lses.transpose(0, 1, 3, 2)                       # (n, B, S, H)
    m = lse_t.max(axis=0)
    w = cp.exp(lse_t - m)
    total = w.sum(axis=0)
    out = (w[..., None] * outs.astype(cp.float32)).sum(axis=0) / total[..., None]
    return out, (m + cp.log(total)).transpose(0, 2, 1)


def max_diff(cp, got, want):
    """(max |got - want|, max |want|) over pairs of arrays (CuPy views; compared in float32)."""
    diff = scale = 0.0
    for g, w in zip(got, want):
        g32, w32 = g.astype(cp.float32), w.astype(cp.float32)
        diff = max(diff, float(cp.abs(g32 - w32).max()))
        scale = max(scale, float(cp.abs(w32).max()))
    return diff, scale


def tolerance(kind, scale):
    """4 bf16 ulps of the outputs' scale; gradients (longer sums, other orders): 2**-5 of theirs."""
    if kind == "grad":
        return 2.0**-5 * scale + 1e-3
    return 4 * 2.0**-8 * max(1.0, scale)


def first_line(exc) -> str:
    return (str(exc).splitlines() or [""])[0][:120]


def as_cupy(env, x):
    if isinstance(x, (list, tuple)):
        return [as_cupy(env, y) for y in x]
    return x if isinstance(x, env.cp.ndarray) else env.cp.from_dlpack(x)


def sdpa_call(env, q, k, v, *, causal=False, gqa=False):
    """SDPA on BHSD tensors, and whether K/V had to be expanded (the backend refused GQA)."""
    F = env.F
    if not gqa:
        return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), False
    group = q.shape[1] // k.shape[1]

    def with_gqa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    def expanded():   # what a user has to do when the backend takes no GQA: expand at every call
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1),
                                              v.repeat_interleave(group, dim=1), is_causal=causal)

    return with_gqa, expanded


def peer_fns(env, make):
    """{backend name: (fn, ctx, mark)} of the SDPA backends that run ``make()``'s call; ``make``
    returns fn or (fn, fallback fn)."""
    if env.torch is None:
        return {}
    found = {}
    for name, backend in (("flash", env.SDPBackend.FLASH_ATTENTION), ("cudnn", env.SDPBackend.CUDNN_ATTENTION)):
        def ctx(backend=backend):
            return env.sdpa_kernel(backend)
        made = make()
        options = [(made[0], "")] + ([(made[1], "*")] if made[1] else [])
        for fn, mark in options:
            try:
                with ctx():
                    fn()
                env.torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a backend that cannot run this call is left out
                log(f"  torch {name}{mark}: {type(e).__name__}: {first_line(e)}")
                continue
            found[name] = (fn, ctx, mark)
            break
    return found


# ----------------------------------------------------------------------------- inputs

def randn(env, shape):
    cp = env.cp
    return cp.random.standard_normal(shape, dtype=cp.float32).astype(env.bf16)


def paged_copy(env, k, v, seed=0):
    """(k_pages, v_pages, block_table) holding a contiguous (B, L, Hk, D) cache in pages of
    PAGE_SIZE, the pages of all sequences in random order; block_table (B, L / PAGE_SIZE) on the GPU."""
    cp, np = env.cp, env.np
    b, length, hk, d = k.shape
    pages = b * length // PAGE_SIZE
    table = np.random.default_rng(seed).permutation(pages).astype(np.int32).reshape(b, length // PAGE_SIZE)
    table_dev = cp.asarray(table)
    kp = cp.empty((pages, PAGE_SIZE, hk, d), dtype=k.dtype)
    vp = cp.empty_like(kp)
    # Scattered as uint16 bits (CuPy's bfloat16 is ml_dtypes'; plain copies are the safe operations).
    kp.view(cp.uint16)[table_dev] = k.view(cp.uint16).reshape(b, -1, PAGE_SIZE, hk, d)
    vp.view(cp.uint16)[table_dev] = v.view(cp.uint16).reshape(b, -1, PAGE_SIZE, hk, d)
    return kp, vp, table_dev


def torch_views(env, *arrays):
    return tuple(env.torch.from_dlpack(x) for x in arrays)


# ----------------------------------------------------------------------------- compiling first

def warm_compile(env):
    """Plan (compile, no launch) a small call of every kernel the benchmark uses, in parallel."""
    cp, cuflash = env.cp, env.cuflash
    e = lambda *shape: cp.empty(shape, dtype=env.bf16)  # noqa: E731 - contents never read
    q = e(1, 128, 8, HEAD_DIM)
    cu = cp.asarray([0, 128], dtype=cp.int32)
    lens = cp.full(1, 64, dtype=cp.int32)
    table = cp.arange(4, dtype=cp.int32).reshape(1, 4)
    qd, kd, kp = e(1, 1, HEADS_Q, HEAD_DIM), e(1, 64, HEADS_K, HEAD_DIM), e(4, PAGE_SIZE, HEADS_K, HEAD_DIM)
    jobs = [
        (cuflash.attention, (q, q, q), dict(causal=False)),
        (cuflash.attention, (q, q, q), dict(causal=True)),
        (cuflash.attention_backward, (q, q, q, q, q, cp.empty((1, 8, 128), cp.float32)), {}),
        (cuflash.attention_varlen, (q[0], q[0], q[0], cu, cu), dict(max_seqlen_q=128, max_seqlen_k=128)),
        (cuflash.decode, (qd, kd, kd), dict(cache_seqlens=lens, num_splits=2)),
        (cuflash.decode, (qd, kp, kp), dict(cache_seqlens=lens, block_table=table, num_splits=2)),
        (cuflash.merge_states, (e(2, 1, 1, HEADS_Q, HEAD_DIM), cp.empty((2, 1, HEADS_Q, 1), cp.float32)), {}),
    ]

    def plan(job):
        fn, a, kw = job
        try:
            cuflash.plan(fn, *a, **kw)
        except Exception as exc:  # noqa: BLE001 - the timed call reports it
            log(f"  planning {fn.__name__} failed: {type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        list(pool.map(plan, jobs))
    log(f"kernels ready in {time.perf_counter() - t0:.1f} s")


# ----------------------------------------------------------------------------- part 1: host time

def host_cases(env):
    """The calls of part 1: SimpleNamespace(name, problem, cupy, torch, plan, peers, outputs,
    peer_outputs, naive, kind) with fns of no argument."""
    cp, cuflash, torch = env.cp, env.cuflash, env.torch
    cases = []
    b, s, h, d = 1, 256, 8, HEAD_DIM

    def _case_1(cases):   # its own scope: the lambdas below bind this block's arrays
        # attention
        b, s, h, d = 1, 256, 8, HEAD_DIM
        q, k, v = (randn(env, (b, s, h, d)) for _ in range(3))
        out = cp.empty_like(q)
        c = SimpleNamespace(name="attention", problem=f"B{b} S{s} H{h} D{d}", kind="out",
                            cupy=lambda: cuflash.attention(q, k, v, out=out),
                            plan=lambda: cuflash.plan(cuflash.attention, q, k, v, out=out),
                            plan_args=((q, k, v), dict(out=out)),
                            outputs=lambda r: [as_cupy(env, r)], naive=lambda: [naive_attention(cp, q, k, v)],
                            torch=None, peers={}, peer_outputs=None)
        if torch is not None:
            qt, kt, vt = torch_views(env, q, k, v)
            out_t = torch.empty_like(qt)
            c.torch = lambda: cuflash.attention(qt, kt, vt, out=out_t)
            qs, ks, vs = (x.transpose(1, 2) for x in (qt, kt, vt))
            c.peers = peer_fns(env, lambda: sdpa_call(env, qs, ks, vs))
            c.peer_outputs = lambda r: [cp.from_dlpack(r.transpose(1, 2))]
        cases.append(c)
    _case_1(cases)

    def _case_2(cases):   # its own scope: the lambdas below bind this block's arrays
        # attention_backward
        q, k, v, dout = (randn(env, (b, s, h, d)) for _ in range(4))
        o, lse, _ = cuflash.attention_forward(q, k, v)
        dq, dk, dv = (cp.empty_like(x) for x in (q, k, v))
        c = SimpleNamespace(name="attention_backward", problem=f"B{b} S{s} H{h} D{d}", kind="grad",
                            cupy=lambda: cuflash.attention_backward(dout, q, k, v, o, lse, dq=dq, dk=dk, dv=dv),
                            plan=lambda: cuflash.plan(cuflash.attention_backward, dout, q, k, v, o, lse, dq=dq, dk=dk,
                                                      dv=dv),
                            plan_args=((dout, q, k, v, o, lse), dict(dq=dq, dk=dk, dv=dv)),
                            outputs=lambda r: as_cupy(env, list(r)), naive=lambda: naive_backward(cp, dout, q, k, v),
                            torch=None, peers={}, peer_outputs=None)
        if torch is not None:
            qt, kt, vt, dot, ot, lset = torch_views(env, q, k, v, dout, o, lse)
            dqt, dkt, dvt = (torch.empty_like(x) for x in (qt, kt, vt))
            c.torch = lambda: cuflash.attention_backward(dot, qt, kt, vt, ot, lset, dq=dqt, dk=dkt, dv=dvt)

            def make_backward():
                leaves = [x.transpose(1, 2).detach().requires_grad_() for x in (qt, kt, vt)]
                grad_out = dot.transpose(1, 2)
                holder = {}

                def grads():   # the forward once (under the backend), then the backward at every call
                    if "out" not in holder:
                        holder["out"] = env.F.scaled_dot_product_attention(*leaves)
                    return torch.autograd.grad(holder["out"], leaves, grad_out, retain_graph=True)
                return grads, None

            c.peers = peer_fns(env, make_backward)
            c.peer_outputs = lambda r: [cp.from_dlpack(g.transpose(1, 2)) for g in r]
        cases.append(c)
    _case_2(cases)

    def _case_3(cases):   # its own scope: the lambdas below bind this block's arrays
        # attention_varlen: 4 sequences of 64 tokens
        n, length = 4, 64
        total = n * length
        q, k, v = (randn(env, (total, h, d)) for _ in range(3))
        cu = cp.arange(0, total + 1, length, dtype=cp.int32)
        out = cp.empty_like(q)
        kw = dict(max_seqlen_q=length, max_seqlen_k=length)
        c = SimpleNamespace(name="attention_varlen", problem=f"{n} x {length} tokens, H{h} D{d}", kind="out",
                            cupy=lambda: cuflash.attention_varlen(q, k, v, cu, cu, out=out, **kw),
                            plan=lambda: cuflash.plan(cuflash.attention_varlen, q, k, v, cu, cu, out=out, **kw),
                            plan_args=((q, k, v, cu, cu), dict(out=out)),
                            outputs=lambda r: [as_cupy(env, r)],
                            naive=lambda: [cp.concatenate([naive_attention(cp, *(x[None, i * length:(i + 1) * length]
                                                                                 for x in (q, k, v)))[0]
                                                           for i in range(n)])],
                            torch=None, peers={}, peer_outputs=None)
        if torch is not None:
            qt, kt, vt, cut = torch_views(env, q, k, v, cu)
            out_t = torch.empty_like(qt)
            c.torch = lambda: cuflash.attention_varlen(qt, kt, vt, cut, cut, out=out_t, **kw)
            try:
                from torch.nn.attention.varlen import varlen_attn

                def flash_varlen():
                    return varlen_attn(qt, kt, vt, cut, cut, length, length)
                flash_varlen()
                torch.cuda.synchronize()
                c.peers = {"flash": (flash_varlen, None, "")}
                c.peer_outputs = lambda r: [as_cupy(env, r[0] if isinstance(r, tuple) else r)]
            except Exception as e:  # noqa: BLE001 - older torch: no varlen peer
                log(f"  torch varlen_attn: {type(e).__name__}: {first_line(e)}")
        cases.append(c)
    _case_3(cases)

    def _case_4(cases):   # its own scope: the lambdas below bind this block's arrays
        # decode, contiguous and paged
        b, length = 8, 1024
        q = randn(env, (b, 1, HEADS_Q, HEAD_DIM))
        k, v = (randn(env, (b, length, HEADS_K, HEAD_DIM)) for _ in range(2))
        lens = cp.full(b, length, dtype=cp.int32)
        kp, vp, table = paged_copy(env, k, v)
        problem = f"B{b} L{length} Hq{HEADS_Q} Hk{HEADS_K} D{HEAD_DIM}"
        for layout, kc, vc, tb in (("contiguous", k, v, None), ("paged16", kp, vp, table)):
            out = cp.empty_like(q)
            idx = dict(cache_seqlens=lens) if tb is None else dict(cache_seqlens=lens, block_table=tb)
            c = SimpleNamespace(name=f"decode {layout}", problem=problem, kind="out",
                                cupy=lambda kc=kc, vc=vc, idx=idx, out=out: cuflash.decode(q, kc, vc, out=out, **idx),
                                plan=lambda kc=kc, vc=vc, idx=idx, out=out: cuflash.plan(cuflash.decode, q, kc, vc,
                                                                                        out=out, **idx),
                                plan_args=((q, kc, vc), dict(out=out, **idx)),
                                outputs=lambda r: [as_cupy(env, r)], naive=lambda: [naive_decode(cp, q, k, v)],
                                torch=None, peers={}, peer_outputs=None)
            if torch is not None:
                qt, kct, vct, lenst = torch_views(env, q, kc, vc, lens)
                idx_t = dict(cache_seqlens=lenst) if tb is None else dict(cache_seqlens=lenst,
                                                                          block_table=env.torch.from_dlpack(tb))
                out_t = torch.empty_like(qt)
                c.torch = lambda qt=qt, kct=kct, vct=vct, idx_t=idx_t, out_t=out_t: cuflash.decode(qt, kct, vct, out=out_t,
                                                                                                 **idx_t)
                qs = env.torch.from_dlpack(q).transpose(1, 2)
                ks, vs = (env.torch.from_dlpack(x).transpose(1, 2) for x in (k, v))
                c.peers = peer_fns(env, lambda qs=qs, ks=ks, vs=vs: sdpa_call(env, qs, ks, vs, gqa=True))
                c.peer_outputs = lambda r: [cp.from_dlpack(r.transpose(1, 2))]
            cases.append(c)
    _case_4(cases)

    def _case_5(cases):   # its own scope: the lambdas below bind this block's arrays
        # merge_states: two partial results of a decode step (bf16 outs, float32 lses)
        b = 8
        outs = randn(env, (2, b, 1, HEADS_Q, HEAD_DIM))
        lses = cp.random.standard_normal((2, b, HEADS_Q, 1), dtype=cp.float32)
        # Into buffers kept across calls, as a serving loop does (like out= of the other entries).
        out, lse = cp.empty(outs.shape[1:], dtype=outs.dtype), cp.empty(lses.shape[1:], dtype=cp.float32)
        c = SimpleNamespace(name="merge_states", problem=f"2 parts, B{b} S1 H{HEADS_Q} D{HEAD_DIM}", kind="out",
                            cupy=lambda: cuflash.merge_states(outs, lses, out=out, lse=lse),
                            plan=lambda: cuflash.plan(cuflash.merge_states, outs, lses, out=out, lse=lse),
                            plan_args=((outs, lses), dict(out=out, lse=lse)),
                            outputs=lambda r: as_cupy(env, list(r)), naive=lambda: list(naive_merge(cp, outs, lses)),
                            torch=None, peers={}, peer_outputs=None)
        if torch is not None:
            outs_t, lses_t, out_t, lse_t = torch_views(env, outs, lses, out, lse)
            c.torch = lambda: cuflash.merge_states(outs_t, lses_t, out=out_t, lse=lse_t)
        cases.append(c)
    _case_5(cases)
    return cases


def launch_floor(env):
    """The contenders of the host row of what any caller pays on this host: an empty kernel
    launched through the driver's cuLaunchKernel (CuPy's binding, as cuflash launches; cupy column)
    and ``torch.add`` on two small tensors (one kernel behind torch's dispatcher; torch column).
    Host speed moves between machines and over a run (docs/decisions.md#measuring-host-time): this row says how fast
    the host is while the rows below it are measured."""
    cp, torch = env.cp, env.torch
    kernel = cp.RawKernel('extern "C" __global__ void empty() {}', "empty")
    kernel((1,), (32,), ())   # loads it on this device
    launch, func, stream = cp.cuda.driver.launchKernel, kernel.kernel.ptr, cp.cuda.get_current_stream().ptr
    contenders = {"cupy": (lambda: launch(func, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0), None)}
    if torch is not None:
        a, c = torch.ones(16, device="cuda"), torch.empty(16, device="cuda")
        contenders["torch"] = (lambda: torch.add(a, a, out=c), None)
    return dict(entry="launch floor", problem="empty kernel (cuLaunchKernel) / torch.add"), contenders


def checked_case(env, case):
    """``case``'s row with every cuflash call checked once against the reference (the first peer
    that runs, else float32 CuPy), and its contenders: cuflash's front ends that ran, then the peers."""
    cp = env.cp
    row = dict(entry=case.name, problem=case.problem)
    reference = None
    for name in ("flash", "cudnn"):
        if name in case.peers:
            fn, ctx, _ = case.peers[name]
            with ctx() if ctx is not None else contextlib.nullcontext():
                reference = case.peer_outputs(fn())
            break
    if reference is None:
        reference = case.naive()
    plan = None
    try:
        p = case.plan()
        a, kw = case.plan_args

        def plan(p=p, a=a, kw=kw):
            return p(*a, **kw)
    except Exception as e:  # noqa: BLE001
        log(f"  cuflash.plan: {type(e).__name__}: {e}")
    calls = {"cupy": case.cupy, "torch": case.torch, "plan": plan}
    worst, scale = 0.0, 0.0
    for frontend, fn in calls.items():
        if fn is None:
            continue
        try:
            got = case.outputs(fn())
            cp.cuda.Device().synchronize()
            diff, s = max_diff(cp, got, reference)
            worst, scale = max(worst, diff), max(scale, s)
        except Exception as e:  # noqa: BLE001 - report and go on
            log(f"  cuflash ({frontend}) failed: {type(e).__name__}: {e}")
            calls[frontend] = None
    row["maxdiff"] = worst
    row["check"] = "ok" if worst <= tolerance(case.kind, scale) else "FAILED"
    if row["check"] != "ok":
        log(f"  CHECK FAILED: maxdiff {worst:.3e} at output scale {scale:.3e}")
    contenders = {frontend: (fn, None) for frontend, fn in calls.items() if fn is not None}
    contenders.update({name: (fn, ctx) for name, (fn, ctx, _) in case.peers.items()})
    return row, contenders


def bench_host(env):
    """The host table. Every row's contenders (the launch floor's too) are timed in one loop, in
    turns: the host's speed drifts over seconds (the same merge_states call measured 8.3 and 12.2
    us in two runs a minute apart while `attention` held at 10), and timed row after row a slow
    spell lands on whichever rows it overlaps. In one loop every row samples the same spells, so
    the rows compare with each other and with the floor."""
    log("host: launch floor")
    floor_row, floor = launch_floor(env)
    rows, contenders, cases = [floor_row], {(0, name): c for name, c in floor.items()}, []
    for case in host_cases(env):
        log(f"host: {case.name} ({case.problem})")
        row, mine = checked_case(env, case)
        contenders.update({(len(rows), name): c for name, c in mine.items()})
        rows.append(row)
        cases.append(case)
    log(f"host: timing {len(contenders)} contenders in turns, {env.args.runs} loops")
    for (index, name), host in host_us_each(env, contenders).items():
        rows[index][f"{name} us"] = host
    for row, case in zip(rows[1:], cases):
        for name, (_, _, mark) in case.peers.items():
            if mark and not missing(row.get(f"{name} us")):
                row[f"{name} us"] = f"{row[f'{name} us']:.1f}{mark}"
        gpu = gpu_us_per_call(env, case.cupy, row["cupy us"]) if not missing(row.get("cupy us")) else None
        row["gpu us"] = gpu
        if gpu is not None and gpu > row["cupy us"]:
            row["gpu us"] = f"{gpu:.1f} gpu-bound"
        row["bar"] = host_bar(row, case.name)
    for row in rows:
        log("  " + " ".join(f"{col}={fmt(row.get(col), 2)}" for col in HOST_COLUMNS))
    return rows


def _number(x):
    if isinstance(x, str):
        try:
            return float(x.split()[0].rstrip("*"))
        except (ValueError, IndexError):   # IndexError: an empty cell
            return None
    return x


def host_bar(row, name):
    verdicts = []
    cudnn = _number(row.get("cudnn us"))
    for frontend in ("cupy", "torch"):
        value = row.get(f"{frontend} us")
        if missing(value):
            continue
        bar = HOST_BARS.get((name, frontend))
        if bar is not None:
            verdicts.append(f"{frontend}<={bar} {'PASS' if value <= bar else 'FAIL'}")
        if cudnn is not None:
            verdicts.append(f"{frontend}<=cudnn {'PASS' if value <= cudnn else 'FAIL'}")
    return "; ".join(verdicts) or None


# ----------------------------------------------------------------------------- part 2: decode end to end

def bench_decode(env):
    cp, cuflash, torch = env.cp, env.cuflash, env.torch
    rows = []
    for b, length in DECODE_SHAPES:
        log(f"decode: B={b} L={length}")
        kv_bytes = 2 * b * length * HEADS_K * HEAD_DIM * env.bf16.itemsize
        q = randn(env, (b, 1, HEADS_Q, HEAD_DIM))
        k, v = (randn(env, (b, length, HEADS_K, HEAD_DIM)) for _ in range(2))
        lens = cp.full(b, length, dtype=cp.int32)
        peers, reference = {}, None
        if torch is not None:
            qs, ks, vs = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
            peers = peer_fns(env, lambda: sdpa_call(env, qs, ks, vs, gqa=True))
            for name in ("flash", "cudnn"):
                if name in peers:
                    fn, ctx, _ = peers[name]
                    with ctx():
                        reference = [cp.from_dlpack(fn().transpose(1, 2))]
                    break
        if reference is None:
            reference = [naive_decode(cp, q, k, v)]
        peer_times = {}
        for layout in ("contiguous", "paged16"):
            if layout == "contiguous":
                kc, vc, idx = k, v, dict(cache_seqlens=lens)
            else:
                kc, vc, table = paged_copy(env, k, v, seed=b)
                idx = dict(cache_seqlens=lens, block_table=table)
            out = cp.empty_like(q)
            contenders = {"cupy": (lambda i, kc=kc, vc=vc, idx=idx, out=out: cuflash.decode(q, kc, vc, out=out, **idx),
                                   None)}
            checks = {"cupy": lambda: contenders["cupy"][0](0)}
            if torch is not None:
                qt, kct, vct = torch_views(env, q, kc, vc)
                idx_t = {n: torch.from_dlpack(x) for n, x in idx.items()}
                out_t = torch.empty_like(qt)
                contenders["torch"] = (lambda i, qt=qt, kct=kct, vct=vct, idx_t=idx_t, out_t=out_t:
                                       cuflash.decode(qt, kct, vct, out=out_t, **idx_t), None)
                checks["torch"] = lambda: contenders["torch"][0](0)
            row = dict(layout=layout, B=b, L=length)
            worst, scale = 0.0, 0.0
            for frontend, fn in list(checks.items()):
                try:
                    diff, s = max_diff(cp, [as_cupy(env, fn())], reference)
                    worst, scale = max(worst, diff), max(scale, s)
                except Exception as e:  # noqa: BLE001
                    log(f"  cuflash ({frontend}) failed: {type(e).__name__}: {e}")
                    del contenders[frontend]
            row["maxdiff"] = worst
            row["check"] = "ok" if worst <= tolerance("out", scale) else "FAILED"
            if layout == "contiguous":   # the peers read the contiguous cache: timed once per shape
                contenders.update({name: ((lambda i, fn=fn: fn()), ctx) for name, (fn, ctx, _) in peers.items()})
            times = e2e_ms_each(env, contenders)
            for name in ("flash", "cudnn"):
                if name in times:
                    peer_times[name] = times.pop(name)
            for name, ms in times.items():
                row[f"{name} us"] = ms * 1e3
            for name, ms in peer_times.items():
                row[f"{name} us"] = f"{ms * 1e3:.1f}{peers[name][2]}"
            base = row.get("torch us", row.get("cupy us"))
            if not missing(base):
                row["torch GB/s"] = kv_bytes / (base * 1e-6) / 1e9
                for name, ms in peer_times.items():
                    row[f"vs {name}"] = ms * 1e3 / base
            bar = DECODE_BARS[layout]
            if "vs flash" in row:
                row["bar"] = f">={bar:.1f}x flash {'PASS' if row['vs flash'] >= bar else 'FAIL'}"
            log("  " + " ".join(f"{col}={fmt(row.get(col), 2)}" for col in DECODE_COLUMNS))
            rows.append(row)
            kc = vc = None
        q = k = v = reference = None
        cp.get_default_memory_pool().free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- part 3: forward end to end

def bench_forward(env):
    cp, cuflash, torch = env.cp, env.cuflash, env.torch
    rows = []
    for d, s in ((d, s) for d in env.args.head_dims for s in env.args.seqlens):
        b, heads = max(1, FORWARD_TOKENS // s), FORWARD_HIDDEN // d
        sets = [tuple(randn(env, (b, s, heads, d)) for _ in range(3)) for _ in range(N_INPUT_SETS)]
        out = cp.empty_like(sets[0][0])
        tsets = [torch_views(env, *x) for x in sets] if torch is not None else None
        out_t = torch.empty_like(tsets[0][0]) if torch is not None else None
        for causal in (False, True):
            log(f"forward: D={d} B={b} S={s} causal={causal}")
            flops = 4.0 * b * heads * s * s * d / (2 if causal else 1)
            contenders = {"cupy": (lambda i, c=causal: cuflash.attention(*sets[i], causal=c, out=out), None)}
            peers = {}
            if torch is not None:
                contenders["torch"] = (lambda i, c=causal: cuflash.attention(*tsets[i], causal=c, out=out_t), None)
                views = [tuple(x.transpose(1, 2) for x in t) for t in tsets]
                peers = peer_fns(env, lambda c=causal: sdpa_call(env, *views[0], causal=c))
                for name, (_, ctx, _) in peers.items():
                    contenders[name] = ((lambda i, c=causal: env.F.scaled_dot_product_attention(*views[i],
                                                                                               is_causal=c)), ctx)
            # Checked once: each cuflash call against the first peer (else float32 CuPy).
            if "cudnn" in peers or "flash" in peers:
                fn, ctx, _ = peers["cudnn"] if "cudnn" in peers else peers["flash"]
                with ctx():
                    reference = [cp.from_dlpack(fn().transpose(1, 2))]
            else:
                reference = [naive_attention(cp, *sets[0], causal=causal)] if s <= 4096 else None
            row = dict(D=d, causal=causal, B=b, S=s)
            if reference is not None:
                worst, scale = 0.0, 0.0
                for frontend in ("cupy", "torch"):
                    if frontend in contenders:
                        diff, sc = max_diff(cp, [as_cupy(env, contenders[frontend][0](0))], reference)
                        worst, scale = max(worst, diff), max(scale, sc)
                row["maxdiff"] = worst
                row["check"] = "ok" if worst <= tolerance("out", scale) else "FAILED"
                reference = None
            times = e2e_ms_each(env, contenders)
            for name, ms in times.items():
                row[f"{name} TFLOP/s"] = flops / (ms * 1e-3) / 1e12
            base = times.get("torch", times.get("cupy"))
            for name in ("cudnn", "flash"):
                if name in times:
                    row[f"vs {name}"] = times[name] / base
            if "vs cudnn" in row:
                bar = FORWARD_BAR_8K if (s, d) == (8192, 128) else FORWARD_BAR
                row["bar"] = f">={bar:.2f}x cudnn {'PASS' if row['vs cudnn'] >= bar else 'FAIL'}"
            log("  " + " ".join(f"{col}={fmt(row.get(col), 2)}" for col in FORWARD_COLUMNS))
            rows.append(row)
        sets = tsets = out = out_t = None
        cp.get_default_memory_pool().free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- output

def summary_rows(host, decode, forward):
    rows = []
    for r in host:
        for frontend in ("cupy", "torch"):
            bar = HOST_BARS.get((r["entry"], frontend))
            value = r.get(f"{frontend} us")
            if bar is not None and not missing(value):
                rows.append({"bar": f"host {r['entry']} ({frontend})", "value": f"{value:.1f} us",
                             "target": f"<= {bar} us", "result": "PASS" if value <= bar else "FAIL"})
            cudnn = _number(r.get("cudnn us"))
            if cudnn is not None and not missing(value):
                rows.append({"bar": f"host {r['entry']} ({frontend}) vs cuDNN", "value": f"{value:.1f} us",
                             "target": f"<= {cudnn:.1f} us", "result": "PASS" if value <= cudnn else "FAIL"})
    for r in decode:
        if "vs flash" in r:
            bar = DECODE_BARS[r["layout"]]
            rows.append({"bar": f"decode {r['layout']} B{r['B']} L{r['L']} vs flash", "value": f"{r['vs flash']:.2f}x",
                         "target": f">= {bar:.1f}x", "result": "PASS" if r["vs flash"] >= bar else "FAIL"})
    for r in forward:
        if "vs cudnn" in r:
            bar = FORWARD_BAR_8K if (r["S"], r["D"]) == (8192, 128) else FORWARD_BAR
            rows.append({"bar": f"forward D{r['D']} {'causal' if r['causal'] else 'full'} S{r['S']} vs cuDNN",
                         "value": f"{r['vs cudnn']:.2f}x", "target": f">= {bar:.2f}x",
                         "result": "PASS" if r["vs cudnn"] >= bar else "FAIL"})
    for part, rs in (("host", host), ("decode", decode), ("forward", forward)):
        failed = [r for r in rs if r.get("check") == "FAILED"]
        if rs:
            rows.append({"bar": f"{part}: outputs checked against the peer",
                         "value": f"{len(rs) - len(failed)}/{len(rs)}", "target": "all",
                         "result": "PASS" if not failed else "FAIL"})
    return rows


def write_outputs(directory, tables, parts):
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "bench_host.md").write_text("\n\n".join(tables) + "\n")
    columns = ["part"]
    for _, _, cols in parts:
        columns += [c for c in cols if c not in columns]
    with open(path / "bench_host.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for part, rows, _ in parts:
            for r in rows:
                w.writerow({"part": part, **{c: "" if missing(r.get(c)) else r[c] for c in columns if c != "part"}})
    log(f"written: {path / 'bench_host.md'}, {path / 'bench_host.csv'}")


def write_png(csv_path, png_path):
    """Two panels from a bench_host.csv: decode end to end (us per call, cuflash from torch beside
    SDPA flash and cuDNN, contiguous and paged caches) and host us per repeat call per entry point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    decode = [r for r in rows if r["part"] == "decode"]
    host = [r for r in rows if r["part"] == "host"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    shapes = [(r["B"], r["L"]) for r in decode if r["layout"] == "contiguous"]
    x = range(len(shapes))
    series = [("cuflash, contiguous", [float(r["torch us"]) for r in decode if r["layout"] == "contiguous"]),
              ("cuflash, paged 16", [float(r["torch us"]) for r in decode if r["layout"] == "paged16"]),
              ("SDPA flash", [float(r["flash us"]) for r in decode if r["layout"] == "contiguous"]),
              ("SDPA cuDNN", [float(r["cudnn us"]) for r in decode if r["layout"] == "contiguous"])]
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series):
        left.bar([j + i * width for j in x], values, width, label=name)
    left.set_xticks([j + 0.4 - width / 2 for j in x], [f"B{b} L{int(l) // 1024}k" for b, l in shapes])
    left.set_ylabel("us per call, host included (lower is better)")
    left.set_title("decode from torch tensors, bf16 Hq32 Hk8 D128")
    left.legend(fontsize=8)
    entries = [r["entry"] for r in host]
    for i, (column, name) in enumerate((("cupy us", "cuflash, CuPy arrays"), ("torch us", "cuflash, torch tensors"),
                                       ("cudnn us", "SDPA cuDNN"))):
        values = [float(_number(r.get(column)) or 0.0) for r in host]
        right.barh([j + i * 0.27 for j in range(len(entries))], values, 0.27, label=name)
    right.set_yticks([j + 0.27 for j in range(len(entries))], entries)
    right.invert_yaxis()
    right.set_xlabel("host us per repeat call (lower is better)")
    right.set_title("host time per call, small problems")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    log(f"written: {png_path}")


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        out = Path(args.out) if args.out else Path(args.plot).parent
        write_png(args.plot, out / "bench_host.png")
        return 0

    import cupy
    import ml_dtypes
    import numpy as np

    try:
        import cuflash
    except ImportError:  # run from a checkout without `pip install -e .`
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import cuflash

    gpu = open_gpu(cupy, not args.no_torch)
    if gpu is None:
        return 1
    env = SimpleNamespace(cp=cupy, np=np, cuflash=cuflash, args=args, bf16=cupy.dtype(ml_dtypes.bfloat16),
                          torch=gpu.torch, F=gpu.F, sdpa_kernel=gpu.sdpa_kernel, SDPBackend=gpu.SDPBackend)
    check_env = os.environ.get("CUFLASH_CHECK", "")
    header = (f"**{gpu.device_name}** ({gpu.versions}); host time = wall time of {args.calls} back-to-back "
              f"calls / {args.calls} (median of {args.runs}); end to end = CUDA events around back-to-back calls, "
              f"host included (median of {args.repeats})" + (f"; CUFLASH_CHECK={check_env}" if check_env else ""))
    log(header)
    host = decode = forward = []
    with gpu.stream:
        warm_compile(env)
        if "host" in args.parts:
            host = bench_host(env)
        if "decode" in args.parts:
            decode = bench_decode(env)
        if "forward" in args.parts:
            forward = bench_forward(env)

    tables = [header]
    if host:
        tables.append(markdown_table(host, "Host microseconds per repeat call (cuflash with CuPy arrays, torch "
                                           "tensors, a cuflash.plan; torch SDPA backends)", HOST_COLUMNS, CELLS))
    if decode:
        tables.append(markdown_table(decode, f"End-to-end decode, us per call (bf16, Sq 1, Hq {HEADS_Q}, Hk {HEADS_K}, "
                                             f"D {HEAD_DIM}; peers on the contiguous cache)", DECODE_COLUMNS, CELLS))
    if forward:
        tables.append(markdown_table(forward, f"End-to-end forward (bf16, heads x D = {FORWARD_HIDDEN}, "
                                              f"{FORWARD_TOKENS} tokens)", FORWARD_COLUMNS, CELLS))
    summary = summary_rows(host, decode, forward)
    tables.append(markdown_table(summary, "Bars (issue 15)", SUMMARY_COLUMNS))
    if args.out:
        write_outputs(args.out, tables, [("host", host, HOST_COLUMNS), ("decode", decode, DECODE_COLUMNS),
                                         ("forward", forward, FORWARD_COLUMNS), ("bars", summary, SUMMARY_COLUMNS)])
        try:
            if host and decode:
                write_png(Path(args.out) / "bench_host.csv", Path(args.out) / "bench_host.png")
        except Exception as e:  # noqa: BLE001 - the tables matter more than the picture
            log(f"no plot: {type(e).__name__}: {e}")
    print()
    print("\n\n".join(tables), flush=True)
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"\n(bench_host took {time.time() - t0:.0f} s)", file=sys.stderr)
    sys.exit(rc)
