"""Backward attention benchmark: cuflash against torch SDPA (flash, cuDNN) and FlashAttention-4, side by side
in one run.

Shapes as in bench_forward.py: a budget of ``--tokens`` tokens (batch * seqlen = 16384) and a
hidden size ``--hidden`` (heads * head_dim = 2048), Sq = Sk, bf16, causal and not.

Only the backward is timed. cuflash: ``attention_forward`` once per input set, then
``attention_backward(dout, q, k, v, out, lse)`` (atomic dQ, and ``deterministic=True`` in its own
column ``cuflash_det``) on CuPy arrays; ``cuflash_torch`` is the same call given torch tensors
(``torch.from_dlpack`` views of the same memory, gradient buffers included), as a torch user calls
it. ``--family`` forces one backward kernel family on every cuflash call
(``cuflash.backward.force_kernel``); by default cuflash chooses, and ``family`` says what it chose.
torch: ``scaled_dot_product_attention`` under ``sdpa_kernel(FLASH_ATTENTION)`` /
``sdpa_kernel(CUDNN_ATTENTION)`` once per input set (BHSD views of the same memory, with
requires_grad), then ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``.
FA4 (column ``fa4``): the same, as its users call it: ``out = flash_attn_func(q, k, v, causal=...)[0]``
once per input set on (B, S, H, D) leaves (``torch.from_dlpack`` views of the same memory, no
transposes), then ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``, which runs FA4's
own backward. Left out, with one line saying so, where ``flash_attn.cute`` does not import
(benchmarks/fa4_device.md says how to install it on the GPU machine) or with ``--no-fa4``.

TFLOP/s = 2.5 * forward FLOPs / time, forward FLOPs = 4 * B * H * Sq * Sk * D (half when causal).
Timing: CUDA events around N calls after warm-up, median of ``--repeats`` runs, rotating over 3
input sets so that L2 cannot hold them; the contenders take turns (each repeat times each of them
once, in a new random order each time, each timed run after an untimed run of the same contender, so
that every contender is timed at its own pace at the power limit); everything on torch's current
stream. ``maxdiff`` is
max|dq_cuflash - dq_flash| (cuDNN's when flash is unavailable, FA4's when neither is) on the first
input set: a guard against a fast but wrong kernel.

Ratios (speed over speed, > 1 is faster than the peer): ``cuflash/flash``, ``cuflash/cudnn``,
``cuflash/fa4``, ``det/cudnn`` (cuflash_det / cudnn), ``torch-path/cudnn`` (cuflash_torch / cudnn).

Output: progress lines, then a Markdown table on stdout (last); ``--csv`` and ``--md`` write files,
``--plot`` a PNG (one panel per dtype and head dim: cuflash/cudnn against seqlen, causal and not,
det/cudnn dashed, cuflash/fa4 dotted; needs matplotlib).

Examples
--------
    python benchmarks/bench_backward.py --quick
    python benchmarks/bench_backward.py --head-dims 128 --seqlens 8192 --causal no
    python benchmarks/bench_backward.py --dtypes bf16,fp16 --head-dims 64,128,256 --family bwd_sm90 --plot bwd.png
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time

from _harness import N_INPUT_SETS, Timer, fa4_out, log, markdown_table, missing, open_fa4, open_gpu, write_results

FULL_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)   # as bench_forward.py
QUICK_SEQLENS = (2048, 8192)
COLUMNS = ["dtype", "head_dim", "causal", "batch", "heads", "seqlen", "family", "cuflash", "cuflash_det",
           "cuflash_torch", "flash", "cudnn", "fa4", "cuflash/flash", "cuflash/cudnn", "cuflash/fa4", "det/cudnn",
           "torch-path/cudnn", "maxdiff"]
RATIOS = {"cuflash/flash": ("cuflash", "flash"), "cuflash/cudnn": ("cuflash", "cudnn"),
          "cuflash/fa4": ("cuflash", "fa4"),
          "det/cudnn": ("cuflash_det", "cudnn"), "torch-path/cudnn": ("cuflash_torch", "cudnn")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="cuflash backward benchmark against torch SDPA (flash, cuDNN) and "
                                            "FlashAttention-4.")
    p.add_argument("--quick", action="store_true", help=f"seqlens {QUICK_SEQLENS}, fewer repeats")
    p.add_argument("--dtypes", default="bf16", help="comma-separated list from bf16, fp16 (default: bf16)")
    p.add_argument("--head-dims", default="64,128", help="comma-separated head dims (default: 64,128)")
    p.add_argument("--seqlens", default=None, help=f"comma-separated Sq = Sk values (default {FULL_SEQLENS})")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen (default: 16384)")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head_dim (default: 2048)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per point (median); default 7, 3 quick")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before timing (default: 2)")
    p.add_argument("--target-ms", type=float, default=40.0, help="approximate duration of one timed run (ms)")
    p.add_argument("--no-torch", action="store_true", help="do not use torch even if importable")
    p.add_argument("--no-fa4", action="store_true", help="do not time FlashAttention-4 even if importable")
    p.add_argument("--no-deterministic", action="store_true", help="skip the deterministic=True column")
    p.add_argument("--family", default=None,
                   help="force this backward kernel family (e.g. bwd_sm90, bwd_sm80) on every cuflash call "
                        "(default: none, cuflash chooses)")
    p.add_argument("--csv", default=None, help="write the results as CSV to this path")
    p.add_argument("--md", default=None, help="write the Markdown table to this path")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write a PNG of the cuDNN ratios to this path (needs matplotlib)")
    args = p.parse_args(argv)
    names = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}
    try:
        args.dtypes = [names[d.strip()] for d in args.dtypes.split(",") if d.strip()]
    except KeyError as e:
        p.error(f"--dtypes: unknown dtype {e.args[0]!r} (expected bf16 or fp16)")
    args.head_dims = [int(d) for d in args.head_dims.split(",") if d.strip()]
    args.seqlens = ([int(s) for s in args.seqlens.split(",") if s.strip()] if args.seqlens
                    else list(QUICK_SEQLENS if args.quick else FULL_SEQLENS))
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    return args


def backward_flops(batch, heads, sq, sk, head_dim, causal):
    """2.5x the forward's 4 * B * H * Sq * Sk * D (half of it when causal)."""
    forward = 4.0 * batch * heads * sq * sk * head_dim
    return 2.5 * (forward / 2 if causal else forward)


# Cells: ratios to two decimals, maxdiff in scientific notation, other floats to one decimal.
CELL_FORMATS = {**{c: lambda v: f"{v:.2f}" for c in RATIOS}, "maxdiff": lambda v: f"{v:.2e}"}


def forcing(cuflash, family):
    """The context every cuflash backward call runs in: the forced family, or nothing."""
    return cuflash.backward.force_kernel(family) if family else contextlib.nullcontext()


def write_plot(rows, path):
    """One panel per (dtype, head_dim): cuflash/cudnn against seqlen, causal and non-causal lines
    (det/cudnn dashed, cuflash/fa4 dotted, in the same colour), and the parity line at 1."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not importable: no plot written")
        return
    groups = sorted({(r["dtype"], r["head_dim"]) for r in rows})
    if not groups:
        log("no rows: no plot written")
        return
    ncols = min(3, len(groups))
    nrows = -(-len(groups) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.8 * ncols, 4 * nrows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    nan = float("nan")
    for ax, (dt, d) in zip(axes.flat, groups):
        for causal, color in ((False, "tab:blue"), (True, "tab:orange")):
            sel = sorted((r for r in rows if (r["dtype"], r["head_dim"], r["causal"]) == (dt, d, causal)),
                         key=lambda r: r["seqlen"])
            if not sel:
                continue
            xs = [r["seqlen"] for r in sel]
            label = "causal" if causal else "non-causal"
            for column, style, suffix in (("cuflash/cudnn", "-", ""), ("det/cudnn", "--", " deterministic"),
                                          ("cuflash/fa4", ":", " vs FA4")):
                ys = [nan if missing(r.get(column)) else r[column] for r in sel]
                if all(math.isnan(y) for y in ys):
                    continue
                ax.plot(xs, ys, style, color=color, marker="o", label=label + suffix)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("seqlen (Sq = Sk)")
        ax.set_ylabel("cuflash / cuDNN, dotted: / FA4 (speed)")
        ax.set_title(f"backward {dt} D={d}")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        else:   # cuDNN or cuflash could not run these shapes: say so rather than leave a bare panel
            ax.text(0.5, 0.5, "no ratio measured", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"plot written to {path}")


def bench_point(args, cupy, cuflash, torch, F, sdpa_kernel, SDPBackend, timer, inputs, dtype_name, batch, s,
                heads, d, causal, fa4=None):
    flops = backward_flops(batch, heads, s, s, d, causal)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    nan = float("nan")
    row = dict(dtype=dtype_name, head_dim=d, causal=causal, batch=batch, heads=heads, seqlen=s, family="-",
               cuflash=nan, cuflash_det=nan, cuflash_torch=nan, flash=nan, cudnn=nan, fa4=nan, maxdiff=nan)
    where = f"D={d} S={s} causal={causal}"

    # cuflash: one forward per input set, then backward only.
    saved = []
    for q, k, v, _ in inputs:
        out, lse, _ = cuflash.attention_forward(q, k, v, causal=causal)
        saved.append((out, lse))

    # Every cuflash call below runs inside forcing(...) (the forced family, or nothing), entered
    # around the timing rather than in each call, so that it adds no host time to the figures.
    def run_cuflash(i, deterministic=False):
        q, k, v, dout = inputs[i]
        out, lse = saved[i]
        # dq, dk, dv allocated by the call, as its users call it (the peers allocate theirs).
        return cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)

    try:   # which family runs (planned, nothing launched)
        q, k, v, dout = inputs[0]
        with forcing(cuflash, args.family):
            planned = cuflash.plan(cuflash.attention_backward, dout, q, k, v, *saved[0], causal=causal)
        row["family"] = planned.plan.info.get("family", "?")
    except Exception as e:
        log(f"cuflash planning failed at {where}: {type(e).__name__}: {e}")

    contenders = {"cuflash": run_cuflash}
    if not args.no_deterministic:
        contenders["cuflash_det"] = lambda i: run_cuflash(i, True)
    if torch is not None:
        # The same call from torch: views of the same memory.
        views = [tuple(torch.from_dlpack(x) for x in (dout, q, k, v, out, lse))
                 for (q, k, v, dout), (out, lse) in zip(inputs, saved)]

        def run_cuflash_torch(i):
            return cuflash.attention_backward(*views[i], causal=causal)

        contenders["cuflash_torch"] = run_cuflash_torch
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                graphs = []
                for q, k, v, dout in inputs:
                    # BHSD views of the same memory, as leaves that require grad.
                    leaves = [torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v)]
                    with sdpa_kernel(backend):
                        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                    graphs.append((out, leaves, torch.from_dlpack(dout).transpose(1, 2)))
            except Exception as e:
                log(f"torch {name} failed at {where}: {type(e).__name__}: {e}")
                continue

            def run_torch(i, graphs=graphs):
                out, leaves, dout = graphs[i]
                return torch.autograd.grad(out, leaves, dout, retain_graph=True)

            contenders[name] = run_torch

        if fa4 is not None:
            try:
                graphs = []
                for q, k, v, dout in inputs:
                    # (B, S, H, D) leaves of the same memory, as FA4's users hold them: no transposes.
                    leaves = [torch.from_dlpack(x).detach().requires_grad_(True) for x in (q, k, v)]
                    out = fa4_out(fa4.flash_attn_func(*leaves, causal=causal))
                    graphs.append((out, leaves, torch.from_dlpack(dout)))
            except Exception as e:
                log(f"FA4 failed at {where}: {type(e).__name__}: {e}")
            else:
                def run_fa4(i, graphs=graphs):
                    out, leaves, dout = graphs[i]
                    return torch.autograd.grad(out, leaves, dout, retain_graph=True)

                contenders["fa4"] = run_fa4

    # One call each first: a contender that cannot run this shape is reported and left out (one
    # broken shape should not hide the others); the rest are timed in turns (Timer.median_ms_each),
    # so that the GPU's clocks, which fall as it warms, weigh on all of them alike.
    reference_dq = None
    with forcing(cuflash, args.family):
        for name, fn in list(contenders.items()):
            try:
                result = fn(0)
                if name in ("flash", "cudnn") and reference_dq is None:
                    reference_dq = cupy.from_dlpack(result[0].transpose(1, 2).contiguous())
                if name == "fa4" and reference_dq is None:   # already (B, S, H, D); SDPA's come first
                    reference_dq = cupy.from_dlpack(result[0].contiguous())
            except Exception as e:
                log(f"{name} failed at {where}: {type(e).__name__}: {e}")
                del contenders[name]
        for name, ms in timer.median_ms_each(contenders).items():
            row[name] = tflops(ms)
    del contenders
    if torch is not None:
        torch.cuda.empty_cache()

    if reference_dq is not None and not math.isnan(row["cuflash"]):
        with forcing(cuflash, args.family):
            dq = run_cuflash(0)[0]
        row["maxdiff"] = float(cupy.abs(dq.astype(cupy.float32) - reference_dq.astype(cupy.float32)).max())
    for ratio, (num, den) in RATIOS.items():
        row[ratio] = row[num] / row[den]
    return row


def main(argv=None):
    args = parse_args(argv)
    import cupy
    import ml_dtypes
    import numpy as np

    import cuflash
    from cuflash.backward import attention_backward

    if not hasattr(cuflash, "attention_backward"):  # until the package exports it
        cuflash.attention_backward = attention_backward
    import cuflash.backward

    if args.family is not None and args.family not in cuflash.backward.FAMILIES:
        print(f"--family: {args.family!r} is not a backward kernel family; expected one of "
              f"{', '.join(cuflash.backward.FAMILIES)}", file=sys.stderr)
        return 2
    gpu = open_gpu(cupy, not args.no_torch)
    if gpu is None:
        return 1
    torch, F, sdpa_kernel, SDPBackend = gpu.torch, gpu.F, gpu.sdpa_kernel, gpu.SDPBackend
    fa4 = open_fa4(torch, not args.no_fa4)
    versions = gpu.versions + (f", {fa4.label}" if fa4 is not None else "")
    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    chosen = f"forced {args.family}" if args.family else "cuflash's choice"
    header = (f"**{gpu.device_name}** ({versions}). Backward TFLOP/s (2.5x forward FLOPs), tokens = {args.tokens}, "
              f"hidden = {args.hidden}, median of {args.repeats} runs; cuflash family: {chosen}; "
              f"cuflash_det = deterministic=True; cuflash_torch = the same call on torch tensors; "
              f"fa4 = FlashAttention-4's backward through torch.autograd.grad.")
    log(header)
    rows = []
    with gpu.stream:
        timer = Timer(cupy, args.repeats, args.warmup, args.target_ms, max_calls=100)
        for dtype_name in args.dtypes:
            for d in args.head_dims:
                heads = args.hidden // d
                for s in args.seqlens:
                    batch = max(1, args.tokens // s)
                    inputs = [tuple(cupy.random.standard_normal((batch, s, heads, d), dtype=cupy.float32)
                                    .astype(dtypes[dtype_name]) for _ in range(4)) for _ in range(N_INPUT_SETS)]
                    for causal in args.causals:
                        row = bench_point(args, cupy, cuflash, torch, F, sdpa_kernel, SDPBackend, timer, inputs,
                                          dtype_name, batch, s, heads, d, causal, fa4=fa4)
                        rows.append(row)
                        log(" ".join(f"{c}={row[c]:.3g}" if isinstance(row[c], float) else f"{c}={row[c]}"
                                     for c in COLUMNS))
                    del inputs
                    cupy.get_default_memory_pool().free_all_blocks()
    table = markdown_table(rows, header, COLUMNS, CELL_FORMATS)
    write_results(rows, table, COLUMNS, args.csv, args.md)
    if args.plot:
        write_plot(rows, args.plot)
    print()
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"\n(bench_backward took {time.time() - t0:.0f} s)", file=sys.stderr)
    sys.exit(rc)
