"""Variants of ``cuflash.interop.torch.attention``'s autograd Function, timed per autograd step beside
SDPA cuDNN and flash as ``bench_host.py`` times them (bursts of 30 steps of
``torch.autograd.grad(out, (q, k, v), g)``, every contender once a round in random order, medians).

Contenders besides ``ct.attention`` and the SDPA backends:

- ``floor: no-op``: a Function that allocates out alone and hands dout back as all three gradients;
- ``floor: allocations``: a Function that allocates out and lse, saves five tensors and allocates
  dq, dk and dv, with no kernel: what a Python autograd node costs by itself;
- ``cuflash calls, no autograd``: the same allocations and cuflash's forward and backward calls
  on the main thread, without autograd: what cuflash itself costs;
- ``plain Function``: the Function with q, k, v as its only inputs, five saved tensors and
  ``causal=True`` as the only keyword; ``plain, ct's keywords`` passes cuflash every keyword that
  ct's Function passes; ``ct's inputs, plain calls`` has ct's eight inputs, seven saved tensors and
  ctx attributes; ``ct's Function, no wrapper`` is ct's Function applied without ``ct.attention``;
- ``lean Function``: plain, with the three gradients views of one allocation;
- ``no stream context in backward``: plain without ``torch_call`` in the backward (a diagnostic,
  not a valid route: cuflash's allocations would then not come from torch under a capture).

Each Function's body is written out in full, as the real one's is: a shared helper would add a call
to what is timed. Problem: bench_host.py's (B1 S128 H8 D64 bf16 causal). Run on a GPU machine:
``PYTHONPATH=$PWD python benchmarks/experiments/torch_step_variants.py [--single-threaded] [--gc-off]``.
What it showed is in docs/decisions.md#torch-the-autograd-steps-host-time.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import bench_host as bh  # noqa: E402
import cuflash  # noqa: E402
from _harness import open_gpu  # noqa: E402


def make_functions(torch):
    from cuflash.attention import attention_forward
    from cuflash.backward import attention_backward
    from cuflash.interop._torch_autograd import direct_apply
    from cuflash.interop._torch_stream import torch_call

    empty_like, contiguous = torch.empty_like, torch.contiguous_format

    class AllocationsOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out = empty_like(q, memory_format=contiguous)
            lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            return (empty_like(q, memory_format=contiguous), empty_like(k, memory_format=contiguous),
                    empty_like(v, memory_format=contiguous))

    class NoOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            return empty_like(q, memory_format=contiguous)

        @staticmethod
        def backward(ctx, dout):
            return dout, dout, dout

    templates = {}

    def grads_like(q, k, v):
        """dq, dk, dv as views of one allocation when q, k and v share shape and dtype."""
        if q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype:
            key = (q.shape, q.dtype, q.device)
            t = templates.get(key)
            if t is None:   # no storage of its own: a stride-0 view of one element
                t = templates[key] = q.new_empty(1).expand(3, *q.shape)
            return empty_like(t, memory_format=contiguous).unbind(0)
        return (empty_like(q, memory_format=contiguous), empty_like(k, memory_format=contiguous),
                empty_like(v, memory_format=contiguous))

    class Plain(torch.autograd.Function):
        """The real Function without bias, sinks or dropout: three allocations in the backward."""

        @staticmethod
        def forward(ctx, q, k, v):
            out = empty_like(q, memory_format=contiguous)
            lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
            with torch_call(q.device):
                attention_forward(q, k, v, causal=True, out=out, lse=lse)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = (empty_like(x, memory_format=contiguous) for x in (q, k, v))
            with torch_call(q.device):
                attention_backward(dout, q, k, v, out, lse, causal=True, dq=dq, dk=dk, dv=dv)
            return dq, dk, dv

    class Lean(Plain):
        """Plain with one allocation for the three gradients."""

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = grads_like(q, k, v)
            with torch_call(q.device):
                attention_backward(dout, q, k, v, out, lse, causal=True, dq=dq, dk=dk, dv=dv)
            return dq, dk, dv

    class NoStreamContext(Plain):
        """Plain without torch_call in the backward (CuPy's stream and allocator as they are)."""

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = (empty_like(x, memory_format=contiguous) for x in (q, k, v))
            attention_backward(dout, q, k, v, out, lse, causal=True, dq=dq, dk=dk, dv=dv)
            return dq, dk, dv

    options = dict(causal=True, scale=None, window=None, softcap=0.0, block_size=(128, 128), dropout_p=0.0,
                   alibi_slopes=None, mask=None, block_mask=None)

    class PlainAllKeywords(Plain):
        """Plain, calling cuflash with every keyword ct's Function passes."""

        @staticmethod
        def forward(ctx, q, k, v):
            out = empty_like(q, memory_format=contiguous)
            lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
            with torch_call(q.device):
                attention_forward(q, k, v, bias=None, sinks=None, out=out, lse=lse, generator=None, **options)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = (empty_like(x, memory_format=contiguous) for x in (q, k, v))
            with torch_call(q.device):
                list(attention_backward(dout, q, k, v, out, lse, bias=None, sinks=None, rng_state=None,
                                        return_dbias=False, return_dsinks=False, dq=dq, dk=dk, dv=dv,
                                        deterministic=False, **options)[3:])
            return dq, dk, dv

    class EightInputs(torch.autograd.Function):
        """ct's Function's inputs, saved tensors, ctx attributes and gradients, Plain's cuflash calls."""

        @staticmethod
        def forward(ctx, q, k, v, bias, sinks, options, generator, deterministic):
            out = empty_like(q, memory_format=contiguous)
            lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
            with torch_call(q.device):
                attention_forward(q, k, v, causal=True, out=out, lse=lse)
            ctx.save_for_backward(q, k, v, out, lse, bias, sinks)
            ctx.rng_state, ctx.options, ctx.deterministic = None, options, deterministic
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse, bias, sinks = ctx.saved_tensors
            dq, dk, dv = (empty_like(x, memory_format=contiguous) for x in (q, k, v))
            with torch_call(q.device):
                attention_backward(dout, q, k, v, out, lse, causal=True, dq=dq, dk=dk, dv=dv)
            return dq, dk, dv, None, None, None, None, None

    from cuflash.interop.torch import _attention_apply
    eight = direct_apply(EightInputs)
    return {"floor: allocations": direct_apply(AllocationsOnly), "floor: no-op": direct_apply(NoOp),
            "plain Function": direct_apply(Plain), "lean Function": direct_apply(Lean),
            "no stream context in backward": direct_apply(NoStreamContext),
            "plain, ct's keywords": direct_apply(PlainAllKeywords),
            "ct's inputs, plain calls": lambda q, k, v: eight(q, k, v, None, None, options, None, False),
            "ct's Function, no wrapper": lambda q, k, v: _attention_apply(q, k, v, None, None, options, None, False)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--single-threaded", action="store_true",
                        help="torch.autograd.set_multithreading_enabled(False) around every step")
    parser.add_argument("--gc-off", action="store_true", help="Python's garbage collector off while timing")
    args = parser.parse_args()
    gpu = open_gpu(cupy, True)
    torch = gpu.torch
    env = SimpleNamespace(cp=cupy, np=np, cuflash=cuflash, bf16=cupy.dtype(ml_dtypes.bfloat16), torch=torch,
                          F=gpu.F, sdpa_kernel=gpu.sdpa_kernel, SDPBackend=gpu.SDPBackend,
                          device_sync=cupy.cuda.Device().synchronize)
    import cuflash.interop.torch as ct
    env.ct, env.fa4 = ct, None
    functions = make_functions(torch)
    with gpu.stream:
        x = bh.forward_inputs(env)
        call = "forward+backward"
        registry = {"SDPA cuDNN": bh.SDPA_CUDNN(env, call, x), "SDPA flash": bh.SDPA_FLASH(env, call, x),
                    "ct.attention": bh.ct_attention(env, call, x)}
        for name, apply in functions.items():
            def step(apply=apply):
                out = apply(x.qg, x.kg, x.vg)
                return torch.autograd.grad(out, (x.qg, x.kg, x.vg), x.g)
            registry[name] = bh.Contender(step)
        from cuflash.attention import attention_forward
        from cuflash.backward import attention_backward
        from cuflash.interop._torch_stream import torch_call
        empty_like, contiguous = torch.empty_like, torch.contiguous_format

        def no_autograd():
            q, k, v = x.qt, x.kt, x.vt
            out = empty_like(q, memory_format=contiguous)
            lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
            with torch_call(q.device):
                attention_forward(q, k, v, causal=True, out=out, lse=lse)
            dq, dk, dv = (empty_like(t, memory_format=contiguous) for t in (q, k, v))
            with torch_call(q.device):
                attention_backward(x.g, q, k, v, out, lse, causal=True, dq=dq, dk=dk, dv=dv)
            return dq, dk, dv
        registry["cuflash calls, no autograd"] = bh.Contender(no_autograd)
        for c in registry.values():
            c.sync = lambda r: env.device_sync()
            if args.single_threaded:
                outer = c.context

                def context(outer=outer):
                    import contextlib
                    stack = contextlib.ExitStack()
                    stack.enter_context(outer())
                    stack.enter_context(torch.autograd.set_multithreading_enabled(False))
                    return stack
                c.context = context
        reference = [g.float() for g in registry["SDPA cuDNN"].fn()]
        for name in [n for n in registry if not n.startswith(("SDPA", "floor"))]:
            got = registry[name].fn()
            worst = max(float((a.float() - b).abs().max()) for a, b in zip(got, reference))
            print(f"check {name}: max |grad - cuDNN's| {worst:.2e}", flush=True)
        for c in registry.values():
            for _ in range(3):
                c.sync(c.fn())
        t0 = time.perf_counter()
        if args.gc_off:
            import gc
            gc.disable()
        samples = bh.host_samples(registry, args.rounds, args.calls)
        print(f"timed in {time.perf_counter() - t0:.0f} s", flush=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    cudnn = med["SDPA cuDNN"]
    mode = "single-threaded autograd" if args.single_threaded else "torch's default autograd threads"
    mode += ", garbage collector off" if args.gc_off else ""
    print(f"\nforward+backward step, host us per step ({mode}; median of {args.rounds} bursts of {args.calls})\n")
    print("| contender | us | x SDPA cuDNN |\n|---|---|---|")
    for name, us in med.items():
        print(f"| {name} | {us:.1f} | {us / cudnn:.2f} |")


if __name__ == "__main__":
    main()
