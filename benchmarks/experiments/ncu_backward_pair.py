"""One backward call of cuflash, torch SDPA's cuDNN backend or FlashAttention-4 between
profilerStart/Stop, for Nsight Compute (``--profile-from-start off``): bf16, 16384 tokens, hidden 2048,
Sq = Sk.

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        --csv python benchmarks/experiments/ncu_backward_pair.py cuflash 128 16384 causal

Arguments: ``cuflash``, ``cudnn`` or ``fa4`` (``flash_attn.cute``), the head dim, the sequence length,
and ``causal`` or ``full``.
Each is called three times first (compiles, plans, cuDNN's autotuning), then once profiled.
"""
import sys

import cupy
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, ".")
import cuflash  # noqa: E402


def main(which: str, head_dim: int, seqlen: int, causal: bool) -> None:
    batch, heads = 16384 // seqlen, 2048 // head_dim
    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    if which == "cuflash":
        qc, kc, vc, dc = (cupy.from_dlpack(x) for x in (q, k, v, dout))
        out, lse = cuflash.attention_forward(qc, kc, vc, causal=causal)[:2]

        def call():
            return cuflash.attention_backward(dc, qc, kc, vc, out, lse, causal=causal)
    elif which == "fa4":
        from flash_attn.cute import flash_attn_func

        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        out = flash_attn_func(*leaves, causal=causal)
        out = out[0] if isinstance(out, (tuple, list)) else out

        def call():
            return torch.autograd.grad(out, leaves, dout, retain_graph=True)
    else:
        leaves = [x.transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v)]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        grad = dout.transpose(1, 2)

        def call():
            return torch.autograd.grad(out, leaves, grad, retain_graph=True)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStart()
    call()
    torch.cuda.synchronize()
    cupy.cuda.Device().synchronize()
    cupy.cuda.runtime.profilerStop()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "causal")
