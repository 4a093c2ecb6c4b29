"""Per call, forward + backward from CuPy: a document mask written as a MaskMod, with the work order
(docs/decisions.md#modifiers-work-order-from-the-block-mask) and without it, beside attention_varlen on
the same documents (the documents, shape and seed of ``document_mask_probe.py``), in random-order turns.
``--mask ones``: an all-True block mask instead, whose order is the causal one: what the order costs.

Without: ``cuflash.kernels.work_order.WORK_ORDER_MIN_WAVES`` raised past any grid, plans made again.
Figure: the median over the turns of CUDA events around ten calls, host included; ``varlen / this``.
Run on a GPU machine: ``PYTHONPATH=$PWD python benchmarks/experiments/work_order_probe.py [--turns N]
[--mask documents|ones]``.
"""

import argparse
import random

import numpy as np

import cupy

import cuflash
from cuflash import kernels
from cuflash._checks import BFLOAT16
from cuflash._runtime import memo
from document_mask_probe import D, H, S, document_lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--mask", choices=("documents", "ones"), default="documents")
    args = parser.parse_args()
    lengths = document_lengths(np.random.default_rng(0))
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v, dout = (cupy.random.standard_normal((1, S, H, D), dtype=cupy.float32).astype(BFLOAT16)
                     for _ in range(4))
    document = cuflash.MaskMod("doc[q_idx] == doc[kv_idx]",
                               doc=cupy.asarray(np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)))
    cu = cupy.asarray(starts)
    packed = [x.reshape(S, H, D) for x in (q, k, v, dout)]
    longest = int(lengths.max())
    varlen_options = dict(max_seqlen_q=longest, max_seqlen_k=longest, causal=True)
    min_waves = kernels.work_order.WORK_ORDER_MIN_WAVES
    ordered = {"on": True}

    def order(on):
        if ordered["on"] != on:
            ordered["on"] = on
            kernels.work_order.WORK_ORDER_MIN_WAVES = min_waves if on else 10**9
            memo.clear_memo()

    def varlen_step():
        out, lse = cuflash.attention_varlen(*packed[:3], cu, cu, return_lse=True, **varlen_options)
        return cuflash.attention_varlen_backward(packed[3], *packed[:3], out, lse, cu, cu, **varlen_options)

    masked = dict(mask_mod=document) if args.mask == "documents" else dict(
        block_mask=cupy.ones((1, 1, S // 128, S // 128), dtype=cupy.bool_))

    def mask_step(on):
        def step():
            order(on)
            out, lse, _ = cuflash.attention_forward(q, k, v, causal=True, **masked)
            return cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **masked)
        return step

    name = "MaskMod" if args.mask == "documents" else "all-True block mask"
    rows = {"varlen": varlen_step, f"{name}, work order": mask_step(True), f"{name}, causal order": mask_step(False)}
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def per_call_us(step, calls=10):
        step()
        start.record()
        for _ in range(calls):
            step()
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) * 1e3 / calls

    for step in rows.values():
        step()
    times = {name: [] for name in rows}
    for _ in range(args.turns):
        names = list(rows)
        random.shuffle(names)
        for name in names:
            times[name].append(per_call_us(rows[name]))
    median = {name: float(np.median(t)) for name, t in times.items()}
    print("| call | us per forward + backward | varlen / this |")
    print("|---|---|---|")
    for name, t in median.items():
        print(f"| {name} | {t:.1f} | {median['varlen'] / t:.3f} |")


if __name__ == "__main__":
    main()
