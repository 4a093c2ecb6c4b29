"""``ct.attention``'s autograd step with and without the replay route, beside SDPA cuDNN, in one process.

The replay route (``cuflash.interop._torch_stream.replay``) lets a repeat call run its remembered plan
with only torch's allocator swapped in; the other contender is the same tree with the route refused
(``cuflash.interop.torch._replay`` patched to answer None), so every call goes through ``torch_call``.
B1 S128 H8 D64 bf16 causal (bench_host.py's problem), bursts of 30 steps of ``torch.autograd.grad``
and one synchronisation, every contender once a round in random order, medians; x SDPA cuDNN.
What it showed is in docs/decisions.md#torch-the-autograd-steps-host-time. Run on a GPU machine:
``PYTHONPATH=$PWD python benchmarks/experiments/torch_replay_ab.py [ROUNDS]``.
"""
import contextlib
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuflash.interop.torch as ct

STEPS = 30


@contextlib.contextmanager
def refused():
    replay = ct._replay
    ct._replay = lambda *args: None
    try:
        yield
    finally:
        ct._replay = replay


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 61
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    g = torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16)

    def ours():
        return torch.autograd.grad(ct.attention(q, k, v, causal=True), (q, k, v), g)

    def cudnn():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return torch.autograd.grad(out.transpose(1, 2), (q, k, v), g)

    contenders = {"ct.attention (replay)": (ours, contextlib.nullcontext),
                  "ct.attention, torch_call route": (ours, refused),
                  "SDPA cuDNN": (cudnn, lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION))}
    for fn, context in contenders.values():
        with context():
            for _ in range(20):
                fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in contenders}
    for _ in range(rounds):
        order = list(contenders)
        random.shuffle(order)
        for name in order:
            fn, context = contenders[name]
            with context():
                start = time.perf_counter()
                for _ in range(STEPS):
                    fn()
                torch.cuda.synchronize()
                samples[name].append((time.perf_counter() - start) / STEPS * 1e6)
    reference = statistics.median(samples["SDPA cuDNN"])
    for name, times in samples.items():
        median = statistics.median(times)
        print(f"{name:32s} {median:7.1f} us  x cuDNN {median / reference:.3f}")


if __name__ == "__main__":
    main()
