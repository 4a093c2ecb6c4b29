"""Where a sliding window and a softcap cost time, forward and forward + backward, against
FlashAttention-4 with the same options (issue 52's first bar).

B 2, S 8k, H 16, D 128, bf16, causal; each of: no option, ``window=(1024, 0)``, ``softcap=30``, both;
and, without FA4 (it has none of them), ALiBi slopes, an additive (S, S) bf16 bias and a bool (S, S)
mask (95% True), each alone (issue 52's bar: each >= 0.9x of the call without options), a (B, 1, 1, S)
key padding mask (95% True) and a (B, 1, 1, S) bf16 key bias.
Contenders called as their users call them from torch tensors: ``ct.attention`` (under
``torch.no_grad`` for the forward row), FA4's ``flash_attn_func``, and for the bias and the mask
SDPA's cuDNN and efficient backends, whose ``attn_mask`` then carries the causal mask too (SDPA takes
``is_causal`` or ``attn_mask``, not both: the (S, S) bias with -inf above the diagonal, the mask ANDed
with the lower triangle, made once); the step is
``torch.autograd.grad`` of the output with a fixed incoming gradient. All rows of one pass are timed
in turns in one ``Timer.median_ms_each`` (random order per repeat). Figure: TFLOP/s of visible work
(4 B H D per visible pair forward, 14 B H D for the step).

    PYTHONPATH=$PWD python benchmarks/experiments/window_softcap_breakdown.py [--repeats 5] [--only alibi,softcap]

``--ncu fwd|bwd`` instead makes one softcapped window call between profilerStart/Stop, for
``ncu --profile-from-start off`` (the pipes' utilisation: whether the special-function unit bounds it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import fa4_out, fmt, log, open_torch_peers, peer_arguments  # noqa: E402

B, S, H, D = 2, 8192, 16, 128
WINDOW, CAP = 1024, 30.0
OPTIONS = {"plain": {}, "window": dict(window=WINDOW), "softcap": dict(softcap=CAP),
           "window+softcap": dict(window=WINDOW, softcap=CAP), "alibi": dict(alibi=True), "bias": dict(bias=True),
           "mask": dict(mask=True), "key mask": dict(key_mask=True), "key bias": dict(key_bias=True)}


def visible_pairs(window, mask=None):
    if mask is not None:   # causal and the mask: (S, S), or a (B, 1, 1, S) key mask (a sequence's, on average)
        if mask.dim() == 4:
            rows = mask.new_ones(S).cumsum(0).flip(0)   # key j is seen by the S - j queries from j on
            return int((mask[:, 0, 0, :].long() * rows).sum()) // mask.shape[0]
        return int(mask.tril().sum())
    i = np.arange(S, dtype=np.int64)
    return int((np.minimum(i + 1, window + 1) if window else i + 1).sum())


def calls(gpu, ct, fa4, q, k, v, options, arrays):
    """{contender: fn() -> out} for one option set (``arrays``: the slopes, bias and mask, and SDPA's
    causal forms of the last two)."""
    window = options.get("window")
    softcap = options.get("softcap", 0.0)
    extra = {name: arrays[name] for name in ("alibi_slopes", "bias", "mask") if options.get(name.split("_")[0])}
    if options.get("key_mask"):
        extra["mask"] = arrays["key_mask"]
    if options.get("key_bias"):
        extra["bias"] = arrays["key_bias"]
    out = {"cuflash": lambda: ct.attention(q, k, v, causal=True, window=(window, 0) if window else None,
                                           softcap=softcap, **extra)}
    sdpa_mask = next((arrays["sdpa_" + name] for name in ("bias", "mask", "key_mask", "key_bias") if options.get(name)),
                     None)
    if sdpa_mask is not None:
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))   # SDPA's (B, H, S, D) views of (B, S, H, D)
        for who, backend in (("sdpa cudnn", gpu.SDPBackend.CUDNN_ATTENTION),
                             ("sdpa efficient", gpu.SDPBackend.EFFICIENT_ATTENTION)):
            def sdpa(backend=backend):
                with gpu.sdpa_kernel(backend):
                    return gpu.F.scaled_dot_product_attention(qt, kt, vt, attn_mask=sdpa_mask).transpose(1, 2)
            try:   # a backend without masks (or without their backward) is left out
                gpu.torch.autograd.grad(sdpa(), (q, k, v), gpu.torch.ones_like(q))
            except RuntimeError as error:
                log(f"{who} left out: {str(error).splitlines()[0][:120]}")
                continue
            out[who] = sdpa
    if extra:
        return out
    if fa4 is not None:
        out["fa4"] = lambda: fa4_out(fa4.flash_attn_func(q, k, v, causal=True,
                                                         window_size=(window, 0) if window else (None, None),
                                                         softcap=softcap))
    return out


def main(argv=None):
    p = peer_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]), repeats=5)
    p.add_argument("--ncu", choices=["fwd", "bwd"])
    p.add_argument("--only", default=",".join(OPTIONS), help="comma-separated option sets (plain is always timed)")
    args = p.parse_args(argv)
    chosen = {"plain", *args.only.split(",")}
    import cupy

    opened = open_torch_peers(cupy, args, max_calls=30)
    if opened is None:
        return
    gpu, ct, fa4, timer = opened
    torch = gpu.torch
    mk = lambda: torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = mk(), mk(), mk()
    dout = torch.randn_like(q)
    arrays = dict(alibi_slopes=torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)], device="cuda"),
                  bias=torch.randn(S, S, device="cuda", dtype=torch.bfloat16),
                  mask=torch.rand(S, S, device="cuda") < 0.95)
    causal = torch.ones(S, S, device="cuda", dtype=torch.bool).tril()
    arrays["key_mask"] = torch.rand(B, 1, 1, S, device="cuda") < 0.95
    arrays["key_bias"] = torch.randn(B, 1, 1, S, device="cuda", dtype=torch.bfloat16)
    arrays.update(sdpa_bias=arrays["bias"].masked_fill(~causal, float("-inf")), sdpa_mask=arrays["mask"] & causal,
                  sdpa_key_mask=arrays["key_mask"] & causal,
                  sdpa_key_bias=arrays["key_bias"].expand(B, 1, S, S).masked_fill(~causal, float("-inf")))
    if args.ncu:
        fn = calls(gpu, ct, None, q, k, v, OPTIONS["window+softcap"], arrays)["cuflash"]
        for _ in range(3):
            torch.autograd.grad(fn(), (q, k, v), dout)
        torch.cuda.synchronize()
        out = fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        if args.ncu == "fwd":
            fn()
        else:
            torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    rows = {}
    for pass_name in ("fwd", "fwd+bwd"):
        fns = {}
        for opt_name, options in OPTIONS.items():
            if opt_name not in chosen:
                continue
            for who, fn in calls(gpu, ct, fa4, q, k, v, options, arrays).items():
                if pass_name == "fwd":
                    def timed(i, fn=fn):
                        with torch.no_grad():
                            return fn()
                else:
                    def timed(i, fn=fn):
                        return torch.autograd.grad(fn(), (q, k, v), dout)
                timed(0)
                fns[(opt_name, who)] = timed
        with gpu.stream:
            ms = timer.median_ms_each(fns)
        for (opt_name, who), t in ms.items():
            mask = {"mask": arrays["mask"], "key mask": arrays["key_mask"]}.get(opt_name)
            pairs = visible_pairs(OPTIONS[opt_name].get("window"), mask)
            flop = (4 if pass_name == "fwd" else 14) * B * H * D * pairs
            rows.setdefault((pass_name, opt_name), {})[who] = flop / (t * 1e-3) / 1e12
    print(f"\n**{gpu.device_name}** ({gpu.versions}{', ' + fa4.label if fa4 else ''}); B {B} S {S} H {H} D {D} bf16 "
          f"causal, TFLOP/s of visible work, median of {args.repeats} in turns\n")
    peers = ("fa4", "sdpa cudnn", "sdpa efficient")
    print("| pass | options | cuflash | " + " | ".join(peers) + " | x best peer | cuflash x its plain |")
    print("|---" * (len(peers) + 5) + "|")
    for (pass_name, opt_name), r in rows.items():
        plain = rows[(pass_name, "plain")]["cuflash"]
        best = max((r[who] for who in peers if who in r), default=None)
        ratio = "-" if best is None else f"{r['cuflash'] / best:.2f}"
        print(f"| {pass_name} | {opt_name} | {fmt(r['cuflash'])} | " + " | ".join(fmt(r.get(who)) for who in peers) +
              f" | {ratio} | {r['cuflash'] / plain:.2f} |")
    log("done")


if __name__ == "__main__":
    main()
