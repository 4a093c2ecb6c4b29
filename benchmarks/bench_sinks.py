"""Attention sinks per call as torch users call (issue 53's bars): what ``sinks=`` costs cuflash, and
a gpt-oss layer against FlashAttention-4.

Problems (bf16, B 1, S 8k (``--seqlen``), forward + backward through autograd unless said, the sinks
a float32 (Hq,) tensor that requires a gradient):

- ``cost D``: causal, H 16, D 64 and 128, forward alone (inference: no tensor requires a gradient) and
  forward + backward: ``ct.attention(..., sinks=)`` against the same call without sinks; ``cost`` =
  time with / time without - 1 (bar <= 3%);
- ``gpt-oss``: GQA 64/8, D 64, a 128-key sliding window (``window=(128, 0)``, causal) with sinks:
  cuflash against ``flash_attn_func(causal=True, window_size=(128, 0), learnable_sink=)`` (where
  carried, benchmarks/fa4_device.md); ``x fa4`` = FA4's time / cuflash's (bar >= 1.0).

Times from CUDA events around back-to-back calls (``torch.autograd.grad`` of the output with a
fixed incoming gradient), median of ``--repeats`` settled random-order turns (``Timer.median_ms_each``).
``maxdiff``: FA4's output against cuflash's.

Run on a GPU machine: ``PYTHONPATH=$PWD python benchmarks/bench_sinks.py [--md F]``.
"""

from __future__ import annotations

import argparse

from _harness import fa4_out, fmt, log, markdown_table, open_torch_peers, peer_arguments, runnable, write_results

SEQLEN, WINDOW = 8192, 128
COLUMNS = ["problem", "plain ms", "sinks ms", "cost", "fa4 ms", "x fa4", "maxdiff", "bar"]


def cost_problem(gpu, ct, d, seqlen, backward):
    """({plain, sinks}: call) at causal H 16, head dim d: forward + backward, or the forward alone."""
    torch = gpu.torch
    q, k, v = (torch.randn(1, seqlen, 16, d, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
               for _ in range(3))
    sinks = torch.randn(16, device="cuda", dtype=torch.float32, requires_grad=backward)
    if not backward:
        return {"plain": lambda i: ct.attention(q, k, v, causal=True),
                "sinks": lambda i: ct.attention(q, k, v, causal=True, sinks=sinks)}
    dout = torch.randn_like(q)
    return {"plain": lambda i: torch.autograd.grad(ct.attention(q, k, v, causal=True), (q, k, v), dout),
            "sinks": lambda i: torch.autograd.grad(ct.attention(q, k, v, causal=True, sinks=sinks), (q, k, v, sinks),
                                                   dout)}


def gpt_oss_problem(gpu, ct, fa4, seqlen):
    """({sinks, fa4}: step, {sinks, fa4}: forward) of a gpt-oss sliding-window layer."""
    torch = gpu.torch
    mk = lambda h: torch.randn(1, seqlen, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = mk(64), mk(8), mk(8)
    sinks = torch.randn(64, device="cuda", dtype=torch.float32, requires_grad=True)
    dout = torch.randn_like(q)
    forwards = {"sinks": lambda: ct.attention(q, k, v, causal=True, window=(WINDOW, 0), sinks=sinks)}
    if fa4 is not None:
        forwards["fa4"] = lambda: fa4_out(fa4.flash_attn_func(q, k, v, causal=True, window_size=(WINDOW, 0),
                                                              learnable_sink=sinks))
    steps = {name: (lambda fn: lambda i: torch.autograd.grad(fn(), (q, k, v, sinks), dout))(fn)
             for name, fn in forwards.items()}
    return steps, forwards


def main(argv=None):
    p = peer_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--seqlen", type=int, default=SEQLEN)
    args = p.parse_args(argv)
    import cupy

    opened = open_torch_peers(cupy, args)
    if opened is None:
        return
    gpu, ct, fa4, timer = opened
    rows = []
    with gpu.stream:
        for d in (64, 128):
            for backward in (False, True):
                ms = timer.median_ms_each(cost_problem(gpu, ct, d, args.seqlen, backward))
                rows.append({"problem": f"cost D {d}, causal, H 16, {'fwd+bwd' if backward else 'fwd'}",
                             "plain ms": ms["plain"], "sinks ms": ms["sinks"], "cost": ms["sinks"] / ms["plain"] - 1,
                             "bar": "<= 3%"})
            log(", ".join(f"{k} {fmt(v, 3)}" for k, v in rows[-1].items()))
        steps, forwards = gpt_oss_problem(gpu, ct, fa4, args.seqlen)
        ms = timer.median_ms_each(runnable(steps, "gpt-oss"))
        row = {"problem": f"gpt-oss: GQA 64/8, D 64, window {WINDOW}, sinks", "sinks ms": ms["sinks"], "bar": ">= 1.0x fa4"}
        if "fa4" in ms:
            want = forwards["sinks"]().detach().float()
            row.update({"fa4 ms": ms["fa4"], "x fa4": ms["fa4"] / ms["sinks"],
                        "maxdiff": float((forwards["fa4"]().detach().float() - want).abs().max())})
        rows.append(row)
        log(", ".join(f"{k} {fmt(v, 3)}" for k, v in row.items()))
    header = (f"**{gpu.device_name}** ({gpu.versions}{', ' + fa4.label if fa4 else ''}); forward + backward through "
              f"autograd, bf16, B 1, S {args.seqlen}")
    formats = {"cost": lambda x: f"{100 * x:+.1f}%", "x fa4": lambda x: f"{x:.2f}", "maxdiff": lambda x: f"{x:.1e}",
               "plain ms": lambda x: f"{x:.3f}", "sinks ms": lambda x: f"{x:.3f}", "fa4 ms": lambda x: f"{x:.3f}"}
    table = markdown_table(rows, header, COLUMNS, formats=formats)
    write_results(rows, table, COLUMNS, csv_path=args.csv, md_path=args.md)
    print(table)


if __name__ == "__main__":
    main()
