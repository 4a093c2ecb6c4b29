"""Where an autograd step through ``cuflash.interop.torch.attention`` spends its host time: the same
autograd Function with ``time.perf_counter`` stamps around each part of its forward and backward
(the table of docs/decisions.md#torch-the-autograd-steps-host-time).

B1 S128 H8 D64 bf16 causal (bench_host.py's problem, small enough that the GPU never limits), 400
steps of ``torch.autograd.grad``, medians of the last 350; once with torch's default (the backward
on autograd's device thread) and once single-threaded (``set_multithreading_enabled(False)``).
Run on a GPU machine: ``PYTHONPATH=$PWD python benchmarks/experiments/torch_step_stamps.py``.
"""

import statistics
import time

import torch

from cuflash.attention import attention_forward
from cuflash.backward import attention_backward
from cuflash.interop._torch_autograd import direct_apply
from cuflash.interop._torch_stream import torch_call

STEPS, SKIP = 400, 50
PARTS = ["call -> forward", "forward: allocations", "forward: torch_call in", "forward: core",
         "forward: torch_call out", "forward: saving", "forward -> backward", "backward: saved tensors",
         "backward: allocations", "backward: torch_call in", "backward: core", "backward: torch_call out",
         "backward -> grad returned"]
clock = time.perf_counter
stamps = []


class Stamped(torch.autograd.Function):
    """cuflash.interop.torch's _Attention (no bias, sinks or dropout), stamped."""

    @staticmethod
    def forward(ctx, q, k, v):
        s = stamps[-1]
        s.append(clock())
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        s.append(clock())
        with torch_call(q.device):
            s.append(clock())
            attention_forward(q, k, v, causal=True, out=out, lse=lse)
            s.append(clock())
        s.append(clock())
        ctx.save_for_backward(q, k, v, out, lse)
        s.append(clock())
        return out

    @staticmethod
    def backward(ctx, dout):
        s = stamps[-1]
        s.append(clock())
        q, k, v, out, lse = ctx.saved_tensors
        s.append(clock())
        dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
        s.append(clock())
        with torch_call(q.device):
            s.append(clock())
            attention_backward(dout, q, k, v, out, lse, causal=True, dq=dq, dk=dk, dv=dv)
            s.append(clock())
        s.append(clock())
        return dq, dk, dv


def main():
    device = torch.device("cuda", 0)
    q, k, v = (torch.randn(1, 128, 8, 64, device=device, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    g = torch.randn(1, 128, 8, 64, device=device, dtype=torch.bfloat16)
    apply = direct_apply(Stamped)
    for threaded in (True, False):
        stamps.clear()
        with torch.autograd.set_multithreading_enabled(threaded):
            for step in range(STEPS):
                stamps.append([clock()])
                torch.autograd.grad(apply(q, k, v), (q, k, v), g)
                stamps[-1].append(clock())
                if step % 40 == 39:
                    torch.cuda.synchronize()
        rows = stamps[SKIP:]
        total = statistics.median(r[-1] - r[0] for r in rows) * 1e6
        print(f"{'autograd device thread' if threaded else 'single-threaded'}: {total:.1f} us a step")
        for j, name in enumerate(PARTS):
            print(f"  {name:28s} {statistics.median(r[j + 1] - r[j] for r in rows) * 1e6:6.1f}")


if __name__ == "__main__":
    main()
