"""Forward attention benchmark: cuflash against its peers, side by side in one run.

Shapes follow the FlashAttention papers: a fixed budget of ``--tokens`` tokens
(batch * seqlen = 16384) and a fixed hidden size ``--hidden`` (heads * head_dim =
2048), so ``batch = tokens // seqlen`` and ``heads = hidden // head_dim``, with
``Sq = Sk``. Every implementation runs on the same data, on the same CUDA stream
(torch's current stream when torch is importable), timed with CUDA events.

Columns (TFLOP/s, FLOPs = 4 * B * H * Sq * Sk * D, half of that when causal):

- ``cuflash``: ``cuflash.attention`` with the kernel chosen by its heuristics (``fwd_sm90`` on
  H100/H200); ``sm80``: the portable ``fwd_sm80`` kernel forced on the same inputs;
- ``flash`` / ``cudnn`` / ``efficient``: ``torch.nn.functional.scaled_dot_product_attention``
  restricted to the FLASH_ATTENTION / CUDNN_ATTENTION / EFFICIENT_ATTENTION backend
  (``torch.nn.attention.sdpa_kernel``), given BHSD views (transposes) of the very same memory;
- ``fa4``: FlashAttention-4 (``flash_attn.cute.flash_attn_func(q, k, v, causal=...)``) on
  (B, S, H, D) torch views of the same memory, as its users call it: no ``out=``, its output
  allocated in the call. Left out, with one line saying so, where ``flash_attn.cute`` does not
  import (benchmarks/fa4_device.md says how to install it on the GPU machine) or with ``--no-fa4``;
- ``naive``: what a CuPy user writes today, matmul / softmax / matmul in float32
  (only up to ``--naive-max-seqlen`` to bound its O(S^2) memory);
- ratios ``cuflash/flash``, ``cuflash/cudnn`` and ``cuflash/fa4`` (speed over speed, > 1 is
  faster than the peer), and cuflash's fraction of the measured bf16 GEMM rate (torch.matmul of
  8192^3; CuPy fp16 when torch is absent).

Timing: warm-up calls (which also compile), then ``--repeats`` timed runs of N calls
each (N sized so a run takes about ``--target-ms``), rotating over 3 input sets so
that L2 cache (50 MiB on an H100) cannot hold the inputs between calls; the median
run is reported. The contenders of a shape, FA4 among them, take turns (one run each, repeated,
in a new random order each time), so that drift in clocks and power falls on all of them alike.
``maxdiff`` is max|cuflash - flash| (or the next SDPA backend that ran, else FA4, else naive) on
the first input set, a guard against a fast but wrong kernel.

Output: progress lines, then a Markdown table on stdout (last), a CSV (``--csv``),
the table alone (``--md``) and a plot (``--png``, when matplotlib is importable).

Examples
--------
    python benchmarks/bench_forward.py --quick
    python benchmarks/bench_forward.py --dtypes bf16,fp16 --head-dims 64,128,256 --csv out.csv
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from _harness import (N_INPUT_SETS, Timer, copy_bandwidth, fa4_out, gemm_rate, log, markdown_table, open_fa4,
                      open_gpu, write_results)

DTYPE_NAMES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
FULL_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (2048, 8192)

COLUMNS = [
    "dtype", "head_dim", "causal", "batch", "heads", "seqlen",
    "cuflash", "sm80", "flash", "cudnn", "efficient", "fa4", "naive",
    "cuflash/flash", "cuflash/cudnn", "cuflash/fa4", "cuflash/gemm", "maxdiff",
]
IMPLS = ("cuflash", "sm80", "flash", "cudnn", "efficient", "fa4", "naive")   # the TFLOP/s columns


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="cuflash forward benchmark against torch SDPA (flash, cuDNN), FlashAttention-4 and naive CuPy.",
    )
    p.add_argument("--quick", action="store_true",
                   help=f"fewer shapes: seqlens {QUICK_SEQLENS}, fewer repeats")
    p.add_argument("--dtypes", default="bf16",
                   help="comma-separated list from bf16, fp16 (default: bf16)")
    p.add_argument("--head-dims", default="64,128",
                   help="comma-separated head dims, e.g. 64,128,256 (default: 64,128)")
    p.add_argument("--seqlens", default=None,
                   help=f"comma-separated Sq = Sk values (default {FULL_SEQLENS})")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                   help="causal, non-causal or both (default: both)")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen (default: 16384)")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head_dim (default: 2048)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per point (median); default 7, 3 with --quick")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before timing (default: 2)")
    p.add_argument("--target-ms", type=float, default=30.0, help="approximate duration of one timed run in ms (default: 30)")
    p.add_argument("--naive-max-seqlen", type=int, default=8192,
                   help="largest seqlen for the naive float32 CuPy baseline (default: 8192)")
    p.add_argument("--no-torch", action="store_true", help="do not use torch even if importable")
    p.add_argument("--no-fa4", action="store_true", help="do not time FlashAttention-4 even if importable")
    p.add_argument("--no-naive", action="store_true", help="skip the naive CuPy baseline")
    p.add_argument("--csv", default=None, help="write the results as CSV to this path")
    p.add_argument("--md", default=None, help="write the Markdown table to this path")
    p.add_argument("--png", default=None, help="write a plot to this path (needs matplotlib)")
    args = p.parse_args(argv)
    try:
        args.dtypes = [DTYPE_NAMES[d.strip()] for d in args.dtypes.split(",") if d.strip()]
    except KeyError as e:
        p.error(f"--dtypes: unknown dtype {e.args[0]!r} (expected bf16 or fp16)")
    args.head_dims = [int(d) for d in args.head_dims.split(",") if d.strip()]
    if args.seqlens is not None:
        args.seqlens = [int(s) for s in args.seqlens.split(",") if s.strip()]
    else:
        args.seqlens = list(QUICK_SEQLENS if args.quick else FULL_SEQLENS)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 7
    args.causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    return args


def attention_flops(batch, heads, sq, sk, head_dim, causal):
    """FLOPs of one forward: two GEMMs of 2*Sq*Sk*D each per head; causal does half."""
    flops = 4.0 * batch * heads * sq * sk * head_dim
    return flops / 2 if causal else flops


def naive_attention(cupy, q, k, v, causal):
    """What a CuPy user writes: float32 matmul, softmax, matmul on (B, H, S, D) views."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    qt = q.astype(cupy.float32).transpose(0, 2, 1, 3)
    kt = k.astype(cupy.float32).transpose(0, 2, 3, 1)
    vt = v.astype(cupy.float32).transpose(0, 2, 1, 3)
    s = cupy.matmul(qt, kt)
    s *= scale
    if causal:
        sq, sk = s.shape[-2:]
        # Bottom-right aligned like cuflash; Sq == Sk here, so also torch's top-left.
        s += cupy.triu(cupy.full((sq, sk), -cupy.inf, dtype=cupy.float32), k=sk - sq + 1)
    s -= s.max(axis=-1, keepdims=True)
    cupy.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    o = cupy.matmul(s, vt)
    return o.transpose(0, 2, 1, 3).astype(q.dtype)


# Cells: ratios to two decimals, maxdiff in scientific notation, other floats to one decimal.
CELL_FORMATS = {**{c: lambda v: f"{v:.2f}" for c in ("cuflash/flash", "cuflash/cudnn", "cuflash/fa4", "cuflash/gemm")},
                "maxdiff": lambda v: f"{v:.2e}"}


def write_png(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not importable: no plot written")
        return
    groups = sorted({(r["dtype"], r["head_dim"], r["causal"]) for r in rows})
    ncols = min(4, len(groups))
    nrows = -(-len(groups) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 4 * nrows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, (dt, d, c) in zip(axes.flat, groups):
        sel = [r for r in rows if (r["dtype"], r["head_dim"], r["causal"]) == (dt, d, c)]
        xs = [r["seqlen"] for r in sel]
        for impl in IMPLS:
            ys = [r.get(impl) for r in sel]
            if all(y is None or math.isnan(y) for y in ys):
                continue
            ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seqlen (Sq = Sk)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{dt} D={d} {'causal' if c else 'non-causal'}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot written to {path}")


def main(argv=None):
    args = parse_args(argv)

    import cupy
    import ml_dtypes
    import numpy as np

    try:
        import cuflash
    except ImportError:  # run from a checkout without `pip install -e .`
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import cuflash

    # CuPy has no bfloat16 of its own: ml_dtypes' is the one it understands (docs/design.md §7).
    DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

    gpu = open_gpu(cupy, not args.no_torch)
    if gpu is None:
        return 1
    torch, F, sdpa_kernel, SDPBackend = gpu.torch, gpu.F, gpu.sdpa_kernel, gpu.SDPBackend
    fa4 = open_fa4(torch, not args.no_fa4)
    versions = gpu.versions + (f", {fa4.label}" if fa4 is not None else "")
    rows = []
    with gpu.stream:
        timer = Timer(cupy, args.repeats, args.warmup, args.target_ms)
        gemm, gemm_label = gemm_rate(cupy, torch, timer)
        bandwidth = copy_bandwidth(cupy, timer)
        cupy.get_default_memory_pool().free_all_blocks()
        header = (f"**{gpu.device_name}** ({versions}); ceilings: {gemm_label} 8192^3 = {gemm:.0f} TFLOP/s, "
                  f"device copy = {bandwidth:.0f} GB/s. Forward TFLOP/s, tokens = {args.tokens}, "
                  f"hidden = {args.hidden}, median of {args.repeats} runs.")
        log(header)

        for dtype_name in args.dtypes:
            cp_dtype = cupy.dtype(DTYPES[dtype_name])
            for d in args.head_dims:
                heads = args.hidden // d
                for s in args.seqlens:
                    batch = max(1, args.tokens // s)
                    inputs = make_inputs(cupy, cp_dtype, batch, s, heads, d)
                    fa4_inputs, torch_inputs = torch_views(torch, inputs)
                    for causal in args.causals:
                        row = bench_point(args, cupy, cuflash, torch, F, sdpa_kernel, SDPBackend,
                                          timer, inputs, torch_inputs, dtype_name, batch,
                                          s, heads, d, causal, gemm, fa4=fa4, fa4_inputs=fa4_inputs)
                        rows.append(row)
                        log(" ".join(f"{c}={row[c]}" if not isinstance(row[c], float)
                                     else f"{c}={row[c]:.3g}" for c in COLUMNS))
                    del inputs, torch_inputs, fa4_inputs
                    cupy.get_default_memory_pool().free_all_blocks()
                    if torch is not None:
                        torch.cuda.empty_cache()

    table = markdown_table(rows, header, COLUMNS, CELL_FORMATS)
    write_results(rows, table, COLUMNS, args.csv, args.md)
    if args.png:
        write_png(rows, args.png)
    print()
    print(table, flush=True)
    return 0


def torch_views(torch, inputs):
    """(FA4's inputs, SDPA's inputs) for CuPy's sets: zero-copy torch views of the same memory,
    (B, S, H, D) as FA4 takes them and BHSD views of those as SDPA wants them; (None, None) without
    torch."""
    if torch is None:
        return None, None
    bshd = [tuple(torch.from_dlpack(x) for x in qkv) for qkv in inputs]
    return bshd, [tuple(x.transpose(1, 2) for x in qkv) for qkv in bshd]


def make_inputs(cupy, dtype, batch, s, heads, d):
    """``N_INPUT_SETS`` independent (q, k, v) sets of shape (B, S, H, D), N(0, 1) values."""
    sets = []
    for _ in range(N_INPUT_SETS):
        sets.append(tuple(cupy.random.standard_normal((batch, s, heads, d), dtype=cupy.float32)
                          .astype(dtype) for _ in range(3)))
    return sets


def bench_point(args, cupy, cuflash, torch, F, sdpa_kernel, SDPBackend, timer, inputs,
                torch_inputs, dtype_name, batch, s, heads, d, causal, gemm, fa4=None, fa4_inputs=None):
    flops = attention_flops(batch, heads, s, s, d, causal)

    def tflops(ms):
        return flops / (ms * 1e-3) / 1e12

    row = dict(dtype=dtype_name, head_dim=d, causal=causal, batch=batch, heads=heads, seqlen=s,
               cuflash=float("nan"), sm80=float("nan"), flash=float("nan"), cudnn=float("nan"),
               efficient=float("nan"), fa4=float("nan"), naive=float("nan"),
               maxdiff=float("nan"))

    # Every contender allocates its output, as its users call it (no out= for one side only).
    def run_cuflash(i):
        q, k, v = inputs[i]
        return cuflash.attention(q, k, v, causal=causal)

    # The portable tensor-core kernel, forced, beside whatever the heuristics chose.
    def run_sm80(i):
        q, k, v = inputs[i]
        with cuflash.force_kernel("fwd_sm80"):
            return cuflash.attention(q, k, v, causal=causal)

    def sdpa(backend):
        def run(i):
            q, k, v = torch_inputs[i]
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    # FA4 as its users call it: (B, S, H, D) torch tensors, its output allocated in the call.
    def run_fa4(i):
        q, k, v = fa4_inputs[i]
        return fa4_out(fa4.flash_attn_func(q, k, v, causal=causal))

    contenders = {"cuflash": run_cuflash}
    if dtype_name in ("float16", "bfloat16"):
        contenders["sm80"] = run_sm80
    if torch is not None:
        contenders.update(flash=sdpa(SDPBackend.FLASH_ATTENTION), cudnn=sdpa(SDPBackend.CUDNN_ATTENTION),
                          efficient=sdpa(SDPBackend.EFFICIENT_ATTENTION))
    if fa4 is not None and fa4_inputs is not None:
        contenders["fa4"] = run_fa4
    # One call each first: a contender that cannot run this shape is reported and left out (one
    # broken shape should not hide the others); the rest are timed in turns.
    reference_out = None
    for name, fn in list(contenders.items()):
        try:
            result = fn(0)
            if name in ("flash", "cudnn", "efficient") and reference_out is None:
                # (B, H, S, D) -> (B, S, H, D), back in CuPy without a copy.
                reference_out = cupy.from_dlpack(result.transpose(1, 2))
            if name == "fa4" and reference_out is None:   # already (B, S, H, D); SDPA's comes first
                reference_out = cupy.from_dlpack(result)
        except Exception as e:
            log(f"{name} failed at D={d} S={s} causal={causal}: {type(e).__name__}: {e}")
            del contenders[name]
    for name, ms in timer.median_ms_each(contenders).items():
        row[name] = tflops(ms)

    if not args.no_naive and s <= args.naive_max_seqlen:
        try:
            # The naive version is slow; few runs of one call each bound its time.
            naive_timer = Timer(cupy, max(1, min(3, args.repeats)), 1, 0.0)
            row["naive"] = tflops(naive_timer.median_ms(
                lambda i: naive_attention(cupy, *inputs[i], causal)))
            if reference_out is None:
                reference_out = naive_attention(cupy, *inputs[0], causal)
        except cupy.cuda.memory.OutOfMemoryError:
            log(f"naive ran out of memory at D={d} S={s}")
        cupy.get_default_memory_pool().free_all_blocks()

    if reference_out is not None and not math.isnan(row["cuflash"]):
        out = run_cuflash(0)
        diff = cupy.abs(out.astype(cupy.float32) - reference_out.astype(cupy.float32)).max()
        row["maxdiff"] = float(diff)

    row["cuflash/flash"] = row["cuflash"] / row["flash"]
    row["cuflash/cudnn"] = row["cuflash"] / row["cudnn"]
    row["cuflash/fa4"] = row["cuflash"] / row["fa4"]
    row["cuflash/gemm"] = row["cuflash"] / gemm
    return row


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"\n(bench_forward took {time.time() - t0:.0f} s)", file=sys.stderr)
    sys.exit(rc)
