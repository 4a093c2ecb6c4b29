"""A value head dim of its own against the peers, per call as torch users call (issue 53's bar:
(D_qk, D_v) = (192, 128) forward and forward+backward at 8k >= 1.0x FlashAttention-4 and cuDNN).

Problems: bf16, B 2, S 8k (``--seqlen``), H 16, causal and full, at the pairs (192, 128) (DeepSeek's
prefill and training), (128, 64) and (64, 128); q and k of D_qk columns, v (and out) of D_v.

Contenders, each called as its users call it from torch tensors (outputs allocated per call; the
backward as ``torch.autograd.grad`` of the output with a fixed incoming gradient):

- ``cuflash``: ``cuflash.interop.torch.attention(q, k, v, causal=)``;
- ``fa4``: ``flash_attn_func(q, k, v, causal=)`` (where carried, benchmarks/fa4_device.md);
- ``cudnn`` / ``flash``: ``F.scaled_dot_product_attention`` on BHSD views under ``sdpa_kernel``.

A contender that refuses a problem (SDPA's flash backend takes one head dim) is left out with a line
saying why. Figure: TFLOP/s of visible work (forward 2 (D_qk + D_v) per visible (query, key) pair,
backward 2 (3 D_qk + 2 D_v)), from CUDA events around back-to-back calls, median of ``--repeats``
settled random-order turns (``Timer.median_ms_each``); ``x fa4`` / ``x cudnn``: their time over
cuflash's (> 1: cuflash faster). ``maxdiff``: each contender's output against cuflash's.

Run on a GPU machine: ``PYTHONPATH=$PWD python benchmarks/bench_value_head_dim.py [--quick] [--md F]``.
"""

from __future__ import annotations

import argparse
import warnings

from _harness import (fa4_out, fmt, largest_difference, log, markdown_table, open_torch_peers, peer_arguments,
                      runnable, write_results)

BATCH, HEADS, SEQLEN = 2, 16, 8192
PAIRS = ((192, 128), (128, 64), (64, 128))
COLUMNS = ["D_qk", "D_v", "mask", "pass", "cuflash", "fa4", "cudnn", "flash", "x fa4", "x cudnn", "maxdiff"]


def visible_pairs(seqlen: int, causal: bool) -> int:
    return seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen


def flops(d_qk: int, d_v: int, pairs: int, backward: bool) -> float:
    """FLOPs of one sequence and head: the forward's two products, and the backward's five."""
    return 2 * pairs * (d_qk + d_v) + (2 * pairs * (3 * d_qk + 2 * d_v) if backward else 0)


def contenders(gpu, ct, fa4, d_qk, d_v, causal, backward, seqlen):
    """({name: fn(i)}, {name: fn() -> output}) of one problem."""
    torch, F = gpu.torch, gpu.F

    def mk(d):
        return torch.randn(BATCH, seqlen, HEADS, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward)

    q, k, v = mk(d_qk), mk(d_qk), mk(d_v)
    dout = torch.randn(BATCH, seqlen, HEADS, d_v, device="cuda", dtype=torch.bfloat16)
    bhsd = lambda x: x.transpose(1, 2)  # noqa: E731
    calls = {"cuflash": lambda: ct.attention(q, k, v, causal=causal)}
    if fa4 is not None:
        calls["fa4"] = lambda: fa4_out(fa4.flash_attn_func(q, k, v, causal=causal))
    for name, backend in (("cudnn", gpu.SDPBackend.CUDNN_ATTENTION), ("flash", gpu.SDPBackend.FLASH_ATTENTION)):
        def sdpa(backend=backend):
            with gpu.sdpa_kernel(backend):
                return F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=causal).transpose(1, 2)
        calls[name] = sdpa

    def step(fn):
        if backward:
            return lambda i: torch.autograd.grad(fn(), (q, k, v), dout)
        return lambda i: fn()

    return {name: step(fn) for name, fn in calls.items()}, calls


def main(argv=None):
    p = peer_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--quick", action="store_true", help="(192, 128) only")
    p.add_argument("--pairs", help="comma-separated D_qk x D_v pairs, e.g. 128x64 (default: all three)")
    p.add_argument("--seqlen", type=int, default=SEQLEN)
    args = p.parse_args(argv)
    import cupy

    opened = open_torch_peers(cupy, args)
    if opened is None:
        return
    gpu, ct, fa4, timer = opened
    # SDPA explains every backend it did not pick, once per call; the left-out line says it once
    warnings.filterwarnings("ignore", message=".*(kernel not used|runtime disabled|requires q,k,v).*")
    rows = []
    with gpu.stream:
        pairs = PAIRS[:1] if args.quick else PAIRS
        if args.pairs:
            pairs = [tuple(int(x) for x in pair.split("x")) for pair in args.pairs.split(",")]
        for d_qk, d_v in pairs:
            for causal in (True, False):
                for backward in (False, True):
                    steps, forwards = contenders(gpu, ct, fa4, d_qk, d_v, causal, backward, args.seqlen)
                    usable = runnable(steps, f"({d_qk}, {d_v})")
                    ms = timer.median_ms_each(usable)
                    work = BATCH * HEADS * flops(d_qk, d_v, visible_pairs(args.seqlen, causal), backward)
                    row = {"D_qk": d_qk, "D_v": d_v, "mask": "causal" if causal else "full",
                           "pass": "fwd+bwd" if backward else "fwd"}
                    row.update({name: work / (t * 1e-3) / 1e12 for name, t in ms.items()})
                    for peer in ("fa4", "cudnn"):
                        if peer in row and "cuflash" in row:
                            row[f"x {peer}"] = row["cuflash"] / row[peer]
                    row["maxdiff"] = largest_difference(forwards, usable)
                    rows.append(row)
                    log(", ".join(f"{k} {fmt(v, 2)}" for k, v in row.items()))
                    del steps, forwards, usable
                    gpu.torch.cuda.empty_cache()
                    cupy.get_default_memory_pool().free_all_blocks()
    header = (f"**{gpu.device_name}** ({gpu.versions}{', ' + fa4.label if fa4 else ''}); per call from torch "
              f"tensors, bf16, B {BATCH}, S {args.seqlen}, H {HEADS}; TFLOP/s of visible work")
    formats = {"x fa4": lambda x: f"{x:.2f}", "x cudnn": lambda x: f"{x:.2f}", "maxdiff": lambda x: f"{x:.1e}"}
    table = markdown_table(rows, header, COLUMNS, formats=formats)
    write_results(rows, table, COLUMNS, csv_path=args.csv, md_path=args.md)
    print(table)


if __name__ == "__main__":
    main()
