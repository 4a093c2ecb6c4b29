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

Figures: median GPU time of ``cupyx.profiler.benchmark`` (forward, and forward + backward where the
entry point has one) and TFLOP/s of the visible work (4 H D per visible pair forward, 14 for the step).
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

    def forward(**options):
        return lambda: cuflash.attention_forward(q, k, v, causal=True, **options)

    def step(**options):
        def call():
            out, lse, _ = cuflash.attention_forward(q, k, v, causal=True, **options)
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, **options)
        return call

    packed = [x.reshape(S, H, D) for x in (q, k, v)]
    longest = int(lengths.max())
    rows = {
        "causal": (forward(), step()),
        "varlen": (lambda: cuflash.attention_varlen(*packed, cu, cu, max_seqlen_q=longest, max_seqlen_k=longest,
                                                    causal=True), None),
        "maskmod sparse": (forward(mask_mod=sparse), step(mask_mod=sparse)),
        "maskmod dense": (forward(mask_mod=dense), None),
        "block_mask 128": (forward(block_mask=blocks), step(block_mask=blocks)),
        "maskmod+block_mask": (forward(mask_mod=dense, block_mask=blocks), step(mask_mod=dense, block_mask=blocks)),
    }
    pairs = int(sum(n * (n + 1) // 2 for n in lengths))
    print(f"| call | forward us | TFLOP/s | forward + backward us | TFLOP/s |  (documents {lengths.tolist()})")
    print("|---|---|---|---|---|")
    for name, (fwd, both) in rows.items():
        t_fwd = gpu_us(fwd)
        t_both = gpu_us(both) if both is not None else float("nan")
        print(f"| {name} | {t_fwd:.1f} | {4 * H * D * pairs / t_fwd / 1e6:.0f} | {t_both:.1f} | "
              f"{14 * H * D * pairs / t_both / 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
