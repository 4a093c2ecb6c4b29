"""Kernel GPU time of a document mask written five ways, beside plain causal attention (the table of
docs/decisions.md#modifiers-masks-element-by-element-only-on-partly-visible-tiles).

One sequence of 16k tokens cut into documents of 512..4096 (a fixed seed), H 16, D 128, bf16, causal:
- ``causal``: no mask (the reference point: all the causal work);
- ``varlen``: ``attention_varlen`` over the documents (the work a document mask should cost);
- ``maskmod sparse``: ``MaskMod("doc[q_idx] == doc[kv_idx]")`` with its derived block mask;
- ``maskmod dense``: the same with ``sparse=False`` (every tile evaluates the expression);
- ``block_mask 128``: a bool block mask of the documents at 128 x 128 (not the same attention: its
  blocks on a document's edge let the neighbour in; it shows what the block path alone costs);
- ``maskmod+block_mask``: the dense MaskMod beside that block mask.

Figures: median GPU time of ``cupyx.profiler.benchmark`` of the forward and of the backward alone (on one
forward's out and lse), and TFLOP/s of the visible work (4 H D per visible pair forward, 10 backward);
each call's plans (kernel family, tiles, grid) print first.
Run on a GPU machine: ``PYTHONPATH=$PWD python benchmarks/experiments/document_mask_probe.py``.
"""

import numpy as np

import cupy
from cupyx.profiler import benchmark

import cuflash
from cuflash._checks import BFLOAT16

S, H, D, REPEATS = 16384, 16, 128, 10


def gpu_us(fn) -> float:
    return 1e6 * float(np.median(benchmark(fn, n_repeat=REPEATS, n_warmup=3).gpu_times[0]))


def document_lengths(rng) -> np.ndarray:
    lengths, left = [], S
    while left > 4096:
        n = int(rng.integers(512, 4097))
        lengths.append(n)
        left -= n
    return np.array(lengths + [left])


def main() -> None:
    rng = np.random.default_rng(0)
    lengths = document_lengths(rng)
    q, k, v, dout = (cupy.random.standard_normal((1, S, H, D), dtype=cupy.float32).astype(BFLOAT16)
                     for _ in range(4))
    doc_of = np.repeat(np.arange(len(lengths)), lengths)
    doc = cupy.asarray(doc_of.astype(np.int32))
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    sparse = cuflash.MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc)
    dense = cuflash.MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc, sparse=False)
    starts = np.arange(0, S, 128)
    first, last = doc_of[starts], doc_of[np.minimum(starts + 127, S - 1)]
    blocks = cupy.asarray((first[:, None] <= last[None, :]) & (last[:, None] >= first[None, :]))

    packed = [x.reshape(S, H, D) for x in (q, k, v, dout)]
    longest = int(lengths.max())
    varlen_options = dict(max_seqlen_q=longest, max_seqlen_k=longest, causal=True)

    def calls(**options):
        """(forward, backward) of one call; the backward reuses one forward's out and lse."""
        out, lse, _ = cuflash.attention_forward(q, k, v, causal=True, **options)
        return ((lambda: cuflash.attention_forward(q, k, v, causal=True, **options)),
                (lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **options)),
                (cuflash.plan(cuflash.attention_forward, q, k, v, causal=True, **options),
                 cuflash.plan(cuflash.attention_backward, dout, q, k, v, out, lse, causal=True, **options)))

    def varlen_calls():
        out, lse = cuflash.attention_varlen(*packed[:3], cu, cu, return_lse=True, **varlen_options)
        args = (packed[3], *packed[:3], out, lse, cu, cu)
        return ((lambda: cuflash.attention_varlen(*packed[:3], cu, cu, **varlen_options)),
                (lambda: cuflash.attention_varlen_backward(*args, **varlen_options)),
                (cuflash.plan(cuflash.attention_varlen, *packed[:3], cu, cu, **varlen_options),
                 cuflash.plan(cuflash.attention_varlen_backward, *args, **varlen_options)))

    rows = {
        "causal": calls(),
        "varlen": varlen_calls(),
        "maskmod sparse": calls(mask_mod=sparse),
        "maskmod dense": calls(mask_mod=dense),
        "block_mask 128": calls(block_mask=blocks),
        "maskmod+block_mask": calls(mask_mod=dense, block_mask=blocks),
    }
    pairs = int(sum(n * (n + 1) // 2 for n in lengths))
    print(f"documents {lengths.tolist()}")
    for name, (_, _, plans) in rows.items():
        for pass_name, planned in zip(("fwd", "bwd"), plans):
            steps = "; ".join(f"grid {step.grid} smem {step.smem}" for step in planned.plan.steps)
            print(f"{name} {pass_name}: {planned.plan.info} [{steps}]")
    print("| call | forward us | TFLOP/s | backward us | TFLOP/s | forward + backward TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for name, (fwd, bwd, _) in rows.items():
        t_fwd, t_bwd = gpu_us(fwd), gpu_us(bwd)
        print(f"| {name} | {t_fwd:.1f} | {4 * H * D * pairs / t_fwd / 1e6:.0f} | {t_bwd:.1f} | "
              f"{10 * H * D * pairs / t_bwd / 1e6:.0f} | {14 * H * D * pairs / (t_fwd + t_bwd) / 1e6:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
