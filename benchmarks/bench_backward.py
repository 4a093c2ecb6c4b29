"""Backward attention benchmark: cuflash against torch SDPA (flash, cuDNN), side by side in one run.

Shapes as in bench_forward.py: a budget of ``--tokens`` tokens (batch * seqlen = 16384) and a
hidden size ``--hidden`` (heads * head_dim = 2048), Sq = Sk, bf16, causal and not.

Only the backward is timed. cuflash: ``attention_forward`` once per input set, then
``attention_backward(dout, q, k, v, out, lse)`` (atomic dQ, and ``deterministic=True`` in its own
column). torch: ``scaled_dot_product_attention`` under ``sdpa_kernel(FLASH_ATTENTION)`` /
``sdpa_kernel(CUDNN_ATTENTION)`` once per input set (BHSD views of the same memory, with
requires_grad), then ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)``.

TFLOP/s = 2.5 * forward FLOPs / time, forward FLOPs = 4 * B * H * Sq * Sk * D (half when causal).
Timing: CUDA events around N calls after warm-up, median of ``--repeats`` runs, rotating over 3
input sets so that L2 cannot hold them; everything on torch's current stream. ``maxdiff`` is
max|dq_cuflash - dq_flash| (cuDNN's when flash is unavailable) on the first input set: a guard
against a fast but wrong kernel.

Output: progress lines, then a Markdown table on stdout (last); ``--csv`` and ``--md`` write files.

Examples
--------
    python benchmarks/bench_backward.py --quick
    python benchmarks/bench_backward.py --head-dims 128 --seqlens 8192 --causal no
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from _harness import N_INPUT_SETS, Timer, log, markdown_table, open_gpu, write_results

FULL_SEQLENS = (1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (2048, 8192)
COLUMNS = ["dtype", "head_dim", "causal", "batch", "heads", "seqlen", "cuflash", "cuflash_det", "flash", "cudnn",
           "cuflash/flash", "cuflash/cudnn", "maxdiff"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="cuflash backward benchmark against torch SDPA (flash, cuDNN).")
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
    p.add_argument("--no-deterministic", action="store_true", help="skip the deterministic=True column")
    p.add_argument("--csv", default=None, help="write the results as CSV to this path")
    p.add_argument("--md", default=None, help="write the Markdown table to this path")
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
CELL_FORMATS = {**{c: lambda v: f"{v:.2f}" for c in ("cuflash/flash", "cuflash/cudnn")}, "maxdiff": lambda v: f"{v:.2e}"}


def bench_point(args, cupy, cuflash, torch, F, sdpa_kernel, SDPBackend, timer, inputs, dtype_name, batch, s,
                heads, d, causal):
    flops = backward_flops(batch, heads, s, s, d, causal)
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    row = dict(dtype=dtype_name, head_dim=d, causal=causal, batch=batch, heads=heads, seqlen=s,
               cuflash=float("nan"), cuflash_det=float("nan"), flash=float("nan"), cudnn=float("nan"),
               maxdiff=float("nan"))

    # cuflash: one forward per input set, then backward only.
    saved = []
    for q, k, v, _ in inputs:
        out, lse, _ = cuflash.attention_forward(q, k, v, causal=causal)
        saved.append((out, lse))
    grads = tuple(cupy.empty_like(x) for x in inputs[0][:3])

    def run_cuflash(i, deterministic=False):
        q, k, v, dout = inputs[i]
        out, lse = saved[i]
        return cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic,
                                          dq=grads[0], dk=grads[1], dv=grads[2])

    try:
        row["cuflash"] = tflops(timer.median_ms(run_cuflash))
        if not args.no_deterministic:
            row["cuflash_det"] = tflops(timer.median_ms(lambda i: run_cuflash(i, True)))
    except Exception as e:  # report and go on: one broken shape should not hide the others
        log(f"cuflash failed at D={d} S={s} causal={causal}: {type(e).__name__}: {e}")

    reference_dq = None
    if torch is not None:
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                graphs = []
                for q, k, v, dout in inputs:
                    # BHSD views of the same memory, as leaves that require grad.
                    leaves = [torch.from_dlpack(x).transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v)]
                    with sdpa_kernel(backend):
                        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                    graphs.append((out, leaves, torch.from_dlpack(dout).transpose(1, 2)))

                def run_torch(i):
                    out, leaves, dout = graphs[i]
                    return torch.autograd.grad(out, leaves, dout, retain_graph=True)

                row[name] = tflops(timer.median_ms(run_torch))
                if reference_dq is None:
                    reference_dq = cupy.from_dlpack(run_torch(0)[0].transpose(1, 2).contiguous())
                del graphs
            except Exception as e:
                log(f"torch {name} failed at D={d} S={s} causal={causal}: {type(e).__name__}: {e}")
            torch.cuda.empty_cache()

    if reference_dq is not None and not math.isnan(row["cuflash"]):
        dq = run_cuflash(0)[0]
        row["maxdiff"] = float(cupy.abs(dq.astype(cupy.float32) - reference_dq.astype(cupy.float32)).max())
    row["cuflash/flash"] = row["cuflash"] / row["flash"]
    row["cuflash/cudnn"] = row["cuflash"] / row["cudnn"]
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
    gpu = open_gpu(cupy, not args.no_torch)
    if gpu is None:
        return 1
    torch, F, sdpa_kernel, SDPBackend = gpu.torch, gpu.F, gpu.sdpa_kernel, gpu.SDPBackend
    dtypes = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    header = (f"**{gpu.device_name}** ({gpu.versions}). Backward TFLOP/s (2.5x forward FLOPs), tokens = {args.tokens}, "
              f"hidden = {args.hidden}, median of {args.repeats} runs; cuflash_det = deterministic=True.")
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
                                          dtype_name, batch, s, heads, d, causal)
                        rows.append(row)
                        log(" ".join(f"{c}={row[c]:.3g}" if isinstance(row[c], float) else f"{c}={row[c]}"
                                     for c in COLUMNS))
                    del inputs
                    cupy.get_default_memory_pool().free_all_blocks()
    table = markdown_table(rows, header, COLUMNS, CELL_FORMATS)
    write_results(rows, table, COLUMNS, args.csv, args.md)
    print()
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"\n(bench_backward took {time.time() - t0:.0f} s)", file=sys.stderr)
    sys.exit(rc)
