"""Training attention per call as torch users call it: forward and forward + backward of cuflash, SDPA
cuDNN, SDPA flash and FlashAttention-4 in one run (issue 51's grid and its bars).

Problems: bf16, ``--tokens`` tokens (B x S = 16384) and ``--hidden`` (Hq x D = 2048), Sq = Sk = S, at
D in ``--head-dims`` (64, 128, 256), S in ``--seqlens`` (1k, 4k, 16k), causal and not. Contenders, each
on (B, S, H, D) torch tensors that require a gradient:

- ``cuflash``: ``cuflash.interop.torch.attention(q, k, v, causal=...)``;
- ``cudnn`` / ``flash``: ``scaled_dot_product_attention`` under ``sdpa_kernel(CUDNN_ATTENTION)`` /
  ``sdpa_kernel(FLASH_ATTENTION)`` on BHSD views of the same tensors;
- ``fa4``: ``flash_attn.cute.flash_attn_func(q, k, v, causal=...)`` where it imports
  (benchmarks/fa4_device.md says how to carry it to the GPU machine).

``fwd``: the forward under ``torch.no_grad`` (inference); ``fwd+bwd``: ``torch.autograd.grad`` of the
forward's output with a fixed incoming gradient, so autograd runs each contender's own backward. Times
from CUDA events around back-to-back calls, host included (outputs allocated per call, as users call),
median of ``--repeats`` settled random-order turns (``Timer.median_ms_each``). Ratios are speed (time of
the peer / time of cuflash: > 1 = cuflash faster). ``maxdiff``: the largest forward output difference
of a peer from cuflash's.

Bars (issue 51): cuflash >= 1.0x FA4 and >= 1.0x cuDNN in every cell, >= 1.05x FA4 in the geometric
mean of the grid; the geometric-mean rows follow the grid. Then, with ``--extras`` (the default), the
issue's two other training problems at D = 128, causal, against >= 1.0x FA4: packed documents
(lengths drawn in 512..4096 adding up to 32k tokens, H 16; ``ct.attention_varlen`` against FA4's
``flash_attn_varlen_func``, SDPA has no varlen entry) and one sequence of 256k tokens (H 8).

Run on a GPU machine: ``PYTHONPATH=$PWD python benchmarks/bench_training.py [--md F] [--csv F]``.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from _harness import fa4_out, fmt, log, markdown_table, open_torch_peers, peer_arguments, runnable, write_results
from bench_modifiers import document_lengths

PASSES = ("fwd", "fwd+bwd")
PEERS = ("cudnn", "flash", "fa4")
COLUMNS = (["D", "mask", "S", "B x H"]
           + [f"{p} x {peer}" for p in PASSES for peer in PEERS]
           + ["cuflash fwd+bwd TFLOP/s", "cudnn fwd+bwd TFLOP/s", "maxdiff"])


def grid(head_dims, seqlens, tokens, hidden):
    """The problems: (D, causal, S, B, H) for every head dim, length and mask, B x S = tokens, H x D = hidden."""
    return [(d, causal, s, tokens // s, hidden // d) for d in head_dims for s in seqlens for causal in (False, True)
            if tokens % s == 0 and hidden % d == 0]


def flops(d, causal, s, b, h, backward):
    """FLOPs of the visible work: 4 B H S^2 D (half under a causal mask), the backward 2.5x the forward."""
    forward = 4 * b * h * s * s * d / (2 if causal else 1)
    return forward * (3.5 if backward else 1.0)


def problem(gpu, ct, fa4, d, causal, s, b, h):
    """({pass: {contender: fn(i)}}, {contender: forward() -> out}) for one problem."""
    torch, F = gpu.torch, gpu.F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)

    def sdpa(backend):
        def forward():
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=causal)
            return o.transpose(1, 2)
        return forward

    forwards = {"cuflash": lambda: ct.attention(q, k, v, causal=causal),
                "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    if fa4 is not None:
        forwards["fa4"] = lambda: fa4_out(fa4.flash_attn_func(q, k, v, causal=causal))
    return passes(torch, forwards, (q, k, v), dout), forwards


EXTRA_HEAD_DIM = 128
PACKED_TOKENS, PACKED_HEADS = 32768, 16
LONG_TOKENS, LONG_HEADS = 262144, 8


def packed_problem(gpu, ct, fa4, lengths):
    """Causal attention over documents of ``lengths`` packed in one (total, H, D) batch, as
    :func:`problem` returns it, and the visible (query, key) pairs a head."""
    torch = gpu.torch
    total, d = int(lengths.sum()), EXTRA_HEAD_DIM
    q, k, v = (torch.randn(total, PACKED_HEADS, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(total, PACKED_HEADS, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)).cuda()
    longest = int(lengths.max())
    forwards = {"cuflash": lambda: ct.attention_varlen(q, k, v, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest,
                                                       causal=True)}
    if fa4 is not None:
        forwards["fa4"] = lambda: fa4_out(fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                                     max_seqlen_q=longest, max_seqlen_k=longest,
                                                                     causal=True))
    return passes(torch, forwards, (q, k, v), dout), forwards, int(sum(n * (n + 1) // 2 for n in lengths))


def passes(torch, forwards, leaves, dout):
    """{pass: {contender: fn(i)}}: each forward under no_grad, and through autograd to ``leaves``."""
    def inference(fn):
        def call(i):
            with torch.no_grad():
                return fn()
        return call

    def step(fn):
        return lambda i: torch.autograd.grad(fn(), leaves, dout)

    return {"fwd": {name: inference(fn) for name, fn in forwards.items()},
            "fwd+bwd": {name: step(fn) for name, fn in forwards.items()}}


def geometric_mean(values):
    values = [x for x in values if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in values) / len(values)) if values else None


def summary_rows(rows):
    """The geometric mean of each ratio column over the grid, and the count of cells under 1.0."""
    ratio_columns = [f"{p} x {peer}" for p in PASSES for peer in PEERS]
    mean = {"D": "geometric mean"}
    under = {"D": "cells < 1.0"}
    for column in ratio_columns:
        values = [r[column] for r in rows if r.get(column) is not None]
        mean[column] = geometric_mean(values)
        under[column] = str(sum(x < 1.0 for x in values)) if values else None
    return [mean, under]


def main(argv=None):
    p = peer_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), repeats=5)
    p.add_argument("--head-dims", default="64,128,256")
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--no-extras", dest="extras", action="store_false",
                   help="leave out the packed documents and the 256k sequence")
    args = p.parse_args(argv)
    import cupy

    opened = open_torch_peers(cupy, args)
    if opened is None:
        return
    gpu, ct, fa4, timer = opened
    problems = grid([int(x) for x in args.head_dims.split(",")], [int(x) for x in args.seqlens.split(",")],
                    args.tokens, args.hidden)
    rows, extras = [], []

    def measure(row, name, calls, forwards, fwd_bwd_flops):
        for pass_name in PASSES:
            ms = timer.median_ms_each(runnable(calls[pass_name], f"{name} {pass_name}"))
            for peer in PEERS:
                if peer in ms and "cuflash" in ms:
                    row[f"{pass_name} x {peer}"] = ms[peer] / ms["cuflash"]
            if pass_name == "fwd+bwd":
                for name in ("cuflash", "cudnn"):
                    if name in ms:
                        row[f"{name} fwd+bwd TFLOP/s"] = fwd_bwd_flops / ms[name] / 1e9
        want = forwards["cuflash"]().detach().float()
        row["maxdiff"] = max((float((fn().detach().float() - want).abs().max())
                              for peer, fn in forwards.items() if peer != "cuflash"), default=None)
        log(", ".join(f"{k} {fmt(v, 3)}" for k, v in row.items()))
        return row

    with gpu.stream:
        for d, causal, s, b, h in problems:
            calls, forwards = problem(gpu, ct, fa4, d, causal, s, b, h)
            row = {"D": d, "mask": "causal" if causal else "-", "S": s, "B x H": f"{b} x {h}"}
            rows.append(measure(row, f"D {d} {'causal' if causal else 'full'} S {s}", calls, forwards,
                                flops(d, causal, s, b, h, True)))
        if args.extras:
            lengths = document_lengths(np.random.default_rng(0), PACKED_TOKENS)
            calls, forwards, pairs = packed_problem(gpu, ct, fa4, lengths)
            row = {"D": EXTRA_HEAD_DIM, "mask": "causal", "S": f"packed {PACKED_TOKENS} ({lengths.size} documents)",
                   "B x H": f"1 x {PACKED_HEADS}"}
            extras.append(measure(row, "packed documents", calls, forwards,
                                  3.5 * 4 * PACKED_HEADS * pairs * EXTRA_HEAD_DIM))
            calls, forwards = problem(gpu, ct, fa4, EXTRA_HEAD_DIM, True, LONG_TOKENS, 1, LONG_HEADS)
            row = {"D": EXTRA_HEAD_DIM, "mask": "causal", "S": LONG_TOKENS, "B x H": f"1 x {LONG_HEADS}"}
            extras.append(measure(row, f"S {LONG_TOKENS}", calls, forwards,
                                  flops(EXTRA_HEAD_DIM, True, LONG_TOKENS, 1, LONG_HEADS, True)))
    rows += summary_rows(rows) + extras
    header = (f"**{gpu.device_name}** ({gpu.versions}{', ' + fa4.label if fa4 else ''}); bf16, {args.tokens} tokens, "
              f"hidden {args.hidden}, per call from torch tensors (forward under no_grad; forward + backward "
              f"through autograd), median of {args.repeats} turns; ratio = peer's time / cuflash's "
              "(> 1: cuflash faster)")
    ratio = lambda x: x if isinstance(x, str) else f"{x:.2f}"   # noqa: E731
    formats = {c: ratio for c in COLUMNS if " x " in c and c != "B x H"}
    formats.update({"maxdiff": lambda x: f"{x:.1e}", "cudnn fwd+bwd TFLOP/s": lambda x: f"{x:.0f}",
                    "cuflash fwd+bwd TFLOP/s": lambda x: f"{x:.0f}"})
    table = markdown_table(rows, header, COLUMNS, formats=formats)
    write_results(rows, table, COLUMNS, csv_path=args.csv, md_path=args.md)
    print(table)


if __name__ == "__main__":
    main()
