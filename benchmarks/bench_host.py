"""Host time per call of cuflash's front ends beside their peers, every contender called as its users
call it (issue 54, item 4).

**What is called.** Each *call* is one job done several ways; each way is a *contender*:

==========================  ============================================================  ==========================
call                        cuflash front ends                                            peers
==========================  ============================================================  ==========================
forward                     ``cuflash.attention`` on CuPy arrays (and, a labelled extra,  SDPA cuDNN, SDPA flash, FA4
                            the same with ``out=``), ``ct.attention``,
                            ``ct.ops.attention`` (torch in and out, no grad)
forward+backward            ``out = ct.attention(q, k, v, causal=True)`` then             the same, through autograd
                            ``torch.autograd.grad(out, (q, k, v), g)``; the same through
                            ``ct.ops.attention``
varlen forward              ``ct.attention_varlen`` (torch tensors, cu_seqlens on the     SDPA on the padded batch
                            GPU)                                                          (equal lengths: the same
                                                                                          work), FA4 varlen
decode                      ``cuflash.decode`` on CuPy arrays, ``ct.ops.decode``,         SDPA (q length 1,
                            ``ct.decode`` when it exists                                  ``enable_gqa``), FA4
jax forward /               ``cuflash.interop.jax.attention`` inside ``jax.jit``          ``jax.nn.dot_product_
jax forward+backward        (``jax.grad`` of a sum), when it imports                      attention(cudnn)``
==========================  ============================================================  ==========================

(``ct`` is ``cuflash.interop.torch``.) Nobody gets ``out=`` unless the contender's name says so:
allocating the output is part of a call as users make it. SDPA users hold BSHD projections and call
SDPA on ``x.transpose(1, 2)`` views, so the transposes in and out are part of SDPA's call; the backend
is chosen once around a burst (``sdpa_kernel``), as a model chooses it. JAX's layout BTNH is cuflash's.
Every contender of a call gets the same inputs, and before timing its outputs (gradients for a
backward) are compared with the call's cuDNN contender (``check``).

**Host time per call.** Problems small enough that the GPU never limits (forward B 1, S 128, H 8,
D 64, bf16, causal; varlen 4 x 32 tokens; decode B 1, L 256, GQA 32/8, D 128). A burst is N
back-to-back calls (``--calls``, 30) on an idle device after one untimed call; the wall clock runs
from the first call until one synchronisation after the last (``jax.block_until_ready`` for JAX,
whose dispatch is asynchronous), divided by N: a call whose GPU work outlasts its submission cannot
look cheap. One round times every contender of every call once, in a new random order (the host's
speed drifts over seconds, and in a fixed cycle a contender's place in it shows); the figure is the
median of ``--runs`` rounds (41). All in one process, one loop. The first call, ``launch floor``,
says how fast this host is: an empty kernel through ``cuLaunchKernel`` and a ``torch.add``.

**Kernel time** (a separate table, labelled so, never in place of the per-call figure): CUDA events
around a burst queued behind a spin kernel (``torch.cuda._sleep``) that outlasts its submission,
so the GPU runs the calls back to back; for contenders on torch's stream (not JAX's).

**Bars** (the ratio column is cuflash's host time / SDPA cuDNN's for the same call; JAX rows: /
JAX cuDNN's, no bar): ``ct.attention`` forward, the forward+backward step, ``ct.attention_varlen``
and ``ct.decode`` <= 1.0; ``ct.ops.*`` <= 1.25; the CuPy-array calls <= 0.6.

Output: progress lines, the kernel table, then the short host table last. ``--json PATH`` saves
every sample; ``--out DIR`` writes DIR/bench_host.md and DIR/bench_host.csv.

Examples
--------
    python3 benchmarks/bench_host.py --quick
    python3 benchmarks/bench_host.py --json benchmarks/results/host_h200.json --out benchmarks/results/host_h200
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional

from _harness import fmt, log, markdown_table, missing, open_gpu, turn_orders

# ----------------------------------------------------------------------------- what is measured

# The problems: small, so that the GPU never limits (the host submits a call in more time than the
# GPU takes to run it).
FWD = SimpleNamespace(B=1, S=128, H=8, D=64, causal=True)
VARLEN = SimpleNamespace(n=4, length=32, H=8, D=64, causal=True)
DECODE = SimpleNamespace(B=1, L=256, Hq=32, Hk=8, D=128)

PEERS = ("SDPA cuDNN", "SDPA flash", "FA4", "jax cuDNN")
FLOOR = "launch floor"

# call -> (what it computes, the peer its ratio and bar are taken against)
CALLS = {
    FLOOR: ("empty kernel through cuLaunchKernel (CuPy) / torch.add of 16 floats", None),
    "forward": (f"B{FWD.B} S{FWD.S} H{FWD.H} D{FWD.D} bf16 causal", "SDPA cuDNN"),
    "forward+backward": (f"B{FWD.B} S{FWD.S} H{FWD.H} D{FWD.D} bf16 causal, autograd", "SDPA cuDNN"),
    "varlen forward": (f"{VARLEN.n} x {VARLEN.length} tokens H{VARLEN.H} D{VARLEN.D} bf16 causal", "SDPA cuDNN"),
    "decode": (f"B{DECODE.B} L{DECODE.L} Hq{DECODE.Hq} Hk{DECODE.Hk} D{DECODE.D} bf16, q length 1", "SDPA cuDNN"),
    "jax forward": (f"B{FWD.B} S{FWD.S} H{FWD.H} D{FWD.D} bf16 causal, in jax.jit", "jax cuDNN"),
    "jax forward+backward": (f"B{FWD.B} S{FWD.S} H{FWD.H} D{FWD.D} bf16 causal, jax.grad in jax.jit",
                             "jax cuDNN"),
}

# (call, cuflash front end) -> the most it may take, as a multiple of the reference peer's host time.
BARS = {
    ("forward", "cuflash.attention (CuPy)"): 0.6,
    ("forward", "ct.attention"): 1.0,
    ("forward", "ct.ops.attention"): 1.25,
    ("forward+backward", "ct.attention"): 1.0,
    ("forward+backward", "ct.ops.attention"): 1.25,
    ("varlen forward", "ct.attention_varlen"): 1.0,
    ("decode", "cuflash.decode (CuPy)"): 0.6,
    ("decode", "ct.decode"): 1.0,
    ("decode", "ct.ops.decode"): 1.25,
}


@dataclass
class Contender:
    """One way of making a call, set up once (inputs, views, jitted functions) before any timing."""

    fn: Callable[[], Any]                       # one call, exactly as its users write it
    context: Callable[[], Any] = contextlib.nullcontext   # entered around a burst, never per call
    sync: Optional[Callable[[Any], None]] = None  # waits for a call's work (default: the device)
    events: bool = True                         # on torch's current stream: CUDA events can time it
    fallback: Optional[Callable[[], Any]] = None  # what a user does when fn is refused
    fallback_note: str = ""                     # says so in the table when the fallback runs
    outputs: Callable[[Any], list] = field(default=lambda r: list(r) if isinstance(r, (tuple, list)) else [r])
    note: str = ""


# ----------------------------------------------------------------------------- inputs, one set per call

def _randn(env, shape):
    cp = env.cp
    return cp.random.standard_normal(shape, dtype=cp.float32).astype(env.bf16)


def _torch(env, x, grad=False):
    """A torch view of a CuPy array (same memory, so every contender reads the same inputs)."""
    t = env.torch.from_dlpack(x)
    return t.requires_grad_() if grad else t


def _sdpa_in(x):
    return x.transpose(1, 2)   # BSHD -> BHSD, as SDPA users do it: a view


def forward_inputs(env):
    x = SimpleNamespace(q=_randn(env, (FWD.B, FWD.S, FWD.H, FWD.D)))
    x.k, x.v = _randn(env, (FWD.B, FWD.S, FWD.H, FWD.D)), _randn(env, (FWD.B, FWD.S, FWD.H, FWD.D))
    x.out = env.cp.empty_like(x.q)   # the labelled out= extra only
    if env.torch is not None:
        x.qt, x.kt, x.vt = (_torch(env, a) for a in (x.q, x.k, x.v))
        # Leaves of their own for the backward (views of the same memory), and the incoming gradient.
        x.qg, x.kg, x.vg = (_torch(env, a, grad=True) for a in (x.q, x.k, x.v))
        x.g = _torch(env, _randn(env, (FWD.B, FWD.S, FWD.H, FWD.D)))
    return x


def varlen_inputs(env):
    total = VARLEN.n * VARLEN.length
    x = SimpleNamespace(total=total)
    x.q, x.k, x.v = (_randn(env, (total, VARLEN.H, VARLEN.D)) for _ in range(3))
    x.cu = env.cp.arange(0, total + 1, VARLEN.length, dtype=env.cp.int32)   # on the GPU, as users hold it
    if env.torch is not None:
        x.qt, x.kt, x.vt, x.cut = (_torch(env, a) for a in (x.q, x.k, x.v, x.cu))
    return x


def decode_inputs(env):
    x = SimpleNamespace(q=_randn(env, (DECODE.B, 1, DECODE.Hq, DECODE.D)))
    x.k, x.v = (_randn(env, (DECODE.B, DECODE.L, DECODE.Hk, DECODE.D)) for _ in range(2))
    x.lens = env.cp.full(DECODE.B, DECODE.L, dtype=env.cp.int32)   # on the GPU, as a serving loop holds it
    if env.torch is not None:
        x.qt, x.kt, x.vt, x.lens_t = (_torch(env, a) for a in (x.q, x.k, x.v, x.lens))
    return x


def jax_inputs(env):
    if env.jax is None:
        return None
    jax, jnp = env.jax, env.jnp
    keys = jax.random.split(jax.random.key(0), 3)
    shape = (FWD.B, FWD.S, FWD.H, FWD.D)   # BTNH
    return SimpleNamespace(q=jax.random.normal(keys[0], shape, dtype=jnp.bfloat16),
                           k=jax.random.normal(keys[1], shape, dtype=jnp.bfloat16),
                           v=jax.random.normal(keys[2], shape, dtype=jnp.bfloat16))


def floor_inputs(env):
    return SimpleNamespace()


INPUTS = {FLOOR: floor_inputs, "forward": forward_inputs, "forward+backward": forward_inputs,
          "varlen forward": varlen_inputs, "decode": decode_inputs, "jax forward": jax_inputs,
          "jax forward+backward": jax_inputs}


# ----------------------------------------------------------------------------- the contenders
# Each maker returns a Contender, or None where this machine lacks it (no torch, no FA4, ...).

def _sdpa(backend_name):
    """The SDPA contender maker of one backend for every call (torch rows only)."""

    def make(env, call, x):
        if env.torch is None:
            return None
        F = env.F
        backend = getattr(env.SDPBackend, backend_name)

        def context():
            return env.sdpa_kernel(backend)

        if call == "forward":
            return Contender(lambda: F.scaled_dot_product_attention(
                _sdpa_in(x.qt), _sdpa_in(x.kt), _sdpa_in(x.vt), is_causal=FWD.causal).transpose(1, 2), context)
        if call == "forward+backward":
            def step():
                out = F.scaled_dot_product_attention(_sdpa_in(x.qg), _sdpa_in(x.kg), _sdpa_in(x.vg),
                                                     is_causal=FWD.causal).transpose(1, 2)
                return env.torch.autograd.grad(out, (x.qg, x.kg, x.vg), x.g)
            return Contender(step, context)
        if call == "varlen forward":
            # SDPA has no packed form; with equal lengths the padded batch is the same work (a view).
            shape = (VARLEN.n, VARLEN.length, VARLEN.H, VARLEN.D)
            return Contender(lambda: F.scaled_dot_product_attention(
                _sdpa_in(x.qt.view(shape)), _sdpa_in(x.kt.view(shape)), _sdpa_in(x.vt.view(shape)),
                is_causal=VARLEN.causal).transpose(1, 2).reshape(x.total, VARLEN.H, VARLEN.D), context)
        if call == "decode":
            group = DECODE.Hq // DECODE.Hk

            def expanded():   # a backend without GQA: users expand the cache at every call
                return F.scaled_dot_product_attention(
                    _sdpa_in(x.qt), _sdpa_in(x.kt).repeat_interleave(group, dim=1),
                    _sdpa_in(x.vt).repeat_interleave(group, dim=1), is_causal=False).transpose(1, 2)
            return Contender(lambda: F.scaled_dot_product_attention(
                _sdpa_in(x.qt), _sdpa_in(x.kt), _sdpa_in(x.vt), is_causal=False, enable_gqa=True).transpose(1, 2),
                context, fallback=expanded, fallback_note="backend refused enable_gqa: K/V expanded in every call")
        return None

    return make


def _fa4_first(r):
    return [r[0]] if isinstance(r, tuple) else [r]   # FA4 returns (out, lse)


def fa4(env, call, x):
    if env.fa4 is None or env.torch is None:
        return None
    f = env.fa4
    if call == "forward":
        return Contender(lambda: f.flash_attn_func(x.qt, x.kt, x.vt, causal=FWD.causal), outputs=_fa4_first)
    if call == "forward+backward":
        def step():
            out = f.flash_attn_func(x.qg, x.kg, x.vg, causal=FWD.causal)[0]
            return env.torch.autograd.grad(out, (x.qg, x.kg, x.vg), x.g)
        return Contender(step)
    if call == "varlen forward":
        return Contender(lambda: f.flash_attn_varlen_func(x.qt, x.kt, x.vt, x.cut, x.cut, max_seqlen_q=VARLEN.length,
                                                          max_seqlen_k=VARLEN.length, causal=VARLEN.causal),
                         outputs=_fa4_first)
    if call == "decode":
        return Contender(lambda: f.flash_attn_func(x.qt, x.kt, x.vt, causal=False), outputs=_fa4_first)
    return None


def cupy_attention(env, call, x):
    return Contender(lambda: env.cuflash.attention(x.q, x.k, x.v, causal=FWD.causal))


def cupy_attention_out(env, call, x):
    return Contender(lambda: env.cuflash.attention(x.q, x.k, x.v, causal=FWD.causal, out=x.out),
                     note="a buffer kept across calls")


def ct_attention(env, call, x):
    if env.ct is None:
        return None
    ct = env.ct
    if call == "forward":
        return Contender(lambda: ct.attention(x.qt, x.kt, x.vt, causal=FWD.causal))

    def step():
        out = ct.attention(x.qg, x.kg, x.vg, causal=FWD.causal)
        return env.torch.autograd.grad(out, (x.qg, x.kg, x.vg), x.g)
    return Contender(step)


def ct_ops_attention(env, call, x):
    if env.ct is None:
        return None
    ops = env.ct.ops
    if call == "forward":
        return Contender(lambda: ops.attention(x.qt, x.kt, x.vt, causal=FWD.causal))

    def step():
        out = ops.attention(x.qg, x.kg, x.vg, causal=FWD.causal)
        return env.torch.autograd.grad(out, (x.qg, x.kg, x.vg), x.g)
    return Contender(step)


def ct_attention_varlen(env, call, x):
    if env.ct is None:
        return None
    return Contender(lambda: env.ct.attention_varlen(x.qt, x.kt, x.vt, x.cut, x.cut, max_seqlen_q=VARLEN.length,
                                                     max_seqlen_k=VARLEN.length, causal=VARLEN.causal))


def cupy_decode(env, call, x):
    return Contender(lambda: env.cuflash.decode(x.q, x.k, x.v, cache_seqlens=x.lens))


def ct_decode(env, call, x):
    # cuflash.interop.torch.decode is being added: its row appears once it exists.
    decode = getattr(env.ct, "decode", None) if env.ct is not None else None
    if decode is None:
        return None
    return Contender(lambda: decode(x.qt, x.kt, x.vt, cache_seqlens=x.lens_t))


def ct_ops_decode(env, call, x):
    if env.ct is None:
        return None
    return Contender(lambda: env.ct.ops.decode(x.qt, x.kt, x.vt, cache_seqlens=x.lens_t))


def _jax_contender(env, call, x, attend):
    """``attend(q, k, v)`` inside ``jax.jit``; for the backward, ``jax.grad`` of the sum of its output."""
    jax, jnp = env.jax, env.jnp
    if call == "jax forward":
        jitted = jax.jit(attend)
    else:
        jitted = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
    return Contender(lambda: jitted(x.q, x.k, x.v), sync=jax.block_until_ready, events=False)


def jax_cuflash(env, call, x):
    if env.jax is None or env.cj is None:
        return None
    return _jax_contender(env, call, x, lambda q, k, v: env.cj.attention(q, k, v, causal=FWD.causal))


def jax_cudnn(env, call, x):
    if env.jax is None:
        return None
    return _jax_contender(env, call, x, lambda q, k, v: env.jax.nn.dot_product_attention(
        q, k, v, is_causal=FWD.causal, implementation="cudnn"))


def floor_kernel(env, call, x):
    cp = env.cp
    kernel = cp.RawKernel('extern "C" __global__ void empty() {}', "empty")
    kernel((1,), (32,), ())   # loads it on this device
    launch, func, stream = cp.cuda.driver.launchKernel, kernel.kernel.ptr, cp.cuda.get_current_stream().ptr
    return Contender(lambda: launch(func, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0))


def floor_torch(env, call, x):
    if env.torch is None:
        return None
    a, c = env.torch.ones(16, device="cuda"), env.torch.empty(16, device="cuda")
    return Contender(lambda: env.torch.add(a, a, out=c))


SDPA_CUDNN, SDPA_FLASH = _sdpa("CUDNN_ATTENTION"), _sdpa("FLASH_ATTENTION")
TORCH_PEERS = (("SDPA cuDNN", SDPA_CUDNN), ("SDPA flash", SDPA_FLASH), ("FA4", fa4))

# call -> [(contender, maker)]: cuflash's front ends first (one table row each), then the peers.
REGISTRY = {
    FLOOR: [("empty kernel (CuPy)", floor_kernel), ("torch.add", floor_torch)],
    "forward": [("cuflash.attention (CuPy)", cupy_attention), ("cuflash.attention (CuPy, out=)", cupy_attention_out),
                ("ct.attention", ct_attention), ("ct.ops.attention", ct_ops_attention), *TORCH_PEERS],
    "forward+backward": [("ct.attention", ct_attention), ("ct.ops.attention", ct_ops_attention), *TORCH_PEERS],
    "varlen forward": [("ct.attention_varlen", ct_attention_varlen), *TORCH_PEERS],
    "decode": [("cuflash.decode (CuPy)", cupy_decode), ("ct.decode", ct_decode), ("ct.ops.decode", ct_ops_decode),
               *TORCH_PEERS],
    "jax forward": [("cuflash.interop.jax", jax_cuflash), ("jax cuDNN", jax_cudnn)],
    "jax forward+backward": [("cuflash.interop.jax", jax_cuflash), ("jax cuDNN", jax_cudnn)],
}


def is_cuflash(call, contender):
    return call != FLOOR and contender not in PEERS


def make_registry(env, calls):
    """{(call, contender): Contender} for ``calls``, each call's inputs made once and shared by its
    contenders; contenders this machine lacks are left out (with a line saying so)."""
    registry = {}
    for call in calls:
        x = INPUTS[call](env)
        for name, make in REGISTRY[call]:
            try:
                c = make(env, call, x)
            except Exception as e:  # noqa: BLE001 - a contender that cannot be set up is left out
                log(f"  {call} / {name}: not set up: {type(e).__name__}: {_first_line(e)}")
                continue
            if c is None:
                log(f"  {call} / {name}: not available here")
            else:
                registry[(call, name)] = c
    return registry


# ----------------------------------------------------------------------------- timing

def _first_line(exc) -> str:
    return (str(exc).splitlines() or [""])[0][:160]


def burst_us(c, calls, clock=time.perf_counter):
    """Host microseconds per call: one untimed call on an idle device (the host's caches warm again
    after the wait), then the clock around ``calls`` back-to-back calls and one wait for their work."""
    with c.context():
        c.sync(c.fn())
        t0 = clock()
        for _ in range(calls):
            r = c.fn()
        c.sync(r)
        t1 = clock()
    return (t1 - t0) / calls * 1e6


def host_samples(registry, rounds, calls, clock=time.perf_counter):
    """{key: [us per call, one per round]}: each round times every contender once, in a new random
    order (the same sequence of orders in every run of the script)."""
    samples = {key: [] for key in registry}
    for order in turn_orders(list(registry), rounds):
        for key in order:
            samples[key].append(burst_us(registry[key], calls, clock))
    return samples


def medians(samples):
    return {key: statistics.median(v) for key, v in samples.items() if v}


def kernel_us(env, c, host_us, calls, rounds):
    """GPU microseconds per call: events around ``calls`` calls queued behind a spin kernel lasting
    twice their submission, so that the GPU runs them back to back; median of ``rounds``. None where
    events cannot see the work (JAX's stream) or torch has no spin kernel."""
    torch = env.torch
    if not c.events or torch is None or not hasattr(torch.cuda, "_sleep") or missing(host_us):
        return None
    try:
        clock_khz = env.cp.cuda.Device().attributes["ClockRate"]
    except Exception:  # noqa: BLE001 - an attribute this CUDA no longer reports: assume 2 GHz
        clock_khz = 2_000_000
    cycles = int(2 * host_us * calls * clock_khz / 1000) + 100_000
    times = []
    with c.context():
        for _ in range(rounds):
            env.device_sync()
            torch.cuda._sleep(cycles)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                c.fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / calls * 1e3)
    return statistics.median(times)


# ----------------------------------------------------------------------------- setup and checks

def _as_numpy(env, x):
    np = env.np
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    if hasattr(x, "get"):
        return x.get().astype(np.float32)
    return np.asarray(x).astype(np.float32)


def tolerance(call, scale):
    """4 bf16 ulps of the outputs' scale; gradients (longer sums, other orders): 2**-5 of theirs."""
    if call.endswith("backward"):
        return 2.0**-5 * scale + 1e-3
    return 4 * 2.0**-8 * max(1.0, scale)


def prepare(env, registry, warmup=3):
    """Runs every contender ``warmup`` times (kernels compile, allocators warm), switching to its
    fallback where it is refused and dropping it where both fail; then checks each call's contenders
    against the call's reference peer (or its first contender). Returns {key: (maxdiff, ok)}."""
    results = {}
    for key in list(registry):
        c = registry[key]
        for fn, mark in ((c.fn, ""), (c.fallback, "*")):
            if fn is None:
                continue
            try:
                with c.context():
                    for _ in range(warmup):
                        r = fn()
                    c.sync(r)
            except Exception as e:  # noqa: BLE001 - a contender refused here is reported, not timed
                log(f"  {key[0]} / {key[1]}{mark}: {type(e).__name__}: {_first_line(e)}")
                continue
            if mark:
                c.fn = fn
                c.note = "; ".join(filter(None, [c.note, c.fallback_note]))
            results[key] = r
            break
        else:
            del registry[key]
    checks = {}
    for call in dict.fromkeys(k[0] for k in results):
        if call == FLOOR:
            continue
        keys = [k for k in results if k[0] == call]
        ref_key = next((k for k in keys if k[1] == CALLS[call][1]), keys[0])
        want = [_as_numpy(env, a) for a in registry[ref_key].outputs(results[ref_key])]
        scale = max(float(abs(w).max()) for w in want)
        for key in keys:
            try:
                got = [_as_numpy(env, a) for a in registry[key].outputs(results[key])]
                diff = max(float(abs(g.reshape(w.shape) - w).max()) for g, w in zip(got, want, strict=True))
            except Exception as e:  # noqa: BLE001 - shapes that do not line up fail the check
                log(f"  {call} / {key[1]}: check failed: {type(e).__name__}: {_first_line(e)}")
                diff = math.inf
            checks[key] = (diff, diff <= tolerance(call, scale))
            if not checks[key][1]:
                log(f"  CHECK FAILED {call} / {key[1]}: maxdiff {diff:.3e} against {ref_key[1]} (scale {scale:.2e})")
    return checks


# ----------------------------------------------------------------------------- the tables

def bar_verdict(ratio, limit):
    """'<= 0.60x pass' / '<= 1.00x FAIL'; None without a bar, 'no cuDNN' without the ratio."""
    if limit is None:
        return None
    if missing(ratio):
        return f"<= {limit:.2f}x: no cuDNN"
    return f"<= {limit:.2f}x {'pass' if ratio <= limit else 'FAIL'}"


HOST_COLUMNS = ["call", "front end", "cuflash us", "SDPA cuDNN", "SDPA flash", "FA4", "jax cuDNN", "x cuDNN", "bar"]
KERNEL_COLUMNS = ["call", "contender", "host us", "kernel us", "maxdiff", "check", "note"]


def host_rows(host, calls):
    """One row per (call, cuflash front end) of ``calls``, in REGISTRY's order, run or not: cuflash's
    host us per call, the call's peers', the ratio to the call's reference peer (SDPA cuDNN; JAX
    cuDNN for JAX calls) and the bar."""
    rows = []
    for call in calls:
        for contender, _ in REGISTRY[call]:
            if not is_cuflash(call, contender):
                continue
            us = host.get((call, contender))
            row = {"call": call, "front end": contender, "cuflash us": us}
            for peer in PEERS:
                row[peer] = host.get((call, peer))
            reference = host.get((call, CALLS[call][1]))
            row["x cuDNN"] = us / reference if not missing(us) and not missing(reference) else None
            limit = BARS.get((call, contender))
            row["bar"] = bar_verdict(row["x cuDNN"], limit) if not missing(us) or limit is None else "not run"
            rows.append(row)
    return rows


def kernel_rows(host, kernel, checks, registry):
    rows = []
    for key, c in registry.items():
        diff, ok = checks.get(key, (None, None))
        rows.append({"call": key[0], "contender": key[1], "host us": host.get(key), "kernel us": kernel.get(key),
                     "maxdiff": diff, "check": None if ok is None else ("ok" if ok else "FAILED"), "note": c.note})
    return rows


CELLS = {"x cuDNN": lambda v: f"{v:.2f}", "maxdiff": lambda v: f"{v:.1e}"}


def bar_summary(rows):
    verdicts = [r["bar"] for r in rows if r.get("bar")]
    failed = [f"{r['call']} / {r['front end']}" for r in rows if r.get("bar") and "pass" not in r["bar"]]
    return f"bars: {len(verdicts) - len(failed)}/{len(verdicts)} pass" + (f"; not passed: {', '.join(failed)}"
                                                                          if failed else "")


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Host time per call of cuflash's front ends beside SDPA, FA4 and JAX, "
                                            "every contender called as its users call it.")
    p.add_argument("--quick", action="store_true", help="a smoke run: 5 rounds, 2 kernel rounds")
    p.add_argument("--calls", type=int, default=30, help="back-to-back calls per burst (default 30)")
    p.add_argument("--runs", type=int, default=None, help="rounds, each timing every contender once; the figure is "
                                                          "their median (default 41, 5 with --quick)")
    p.add_argument("--kernel-runs", type=int, default=None, help="rounds of the kernel-time table (default 5, 2 quick)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of the calls: {', '.join(CALLS)} "
                                                f"(the launch floor always runs)")
    p.add_argument("--no-torch", action="store_true", help="do not use torch even if importable")
    p.add_argument("--no-jax", action="store_true", help="do not use JAX even if importable")
    p.add_argument("--json", default=None, metavar="PATH", help="save every sample and the tables as JSON")
    p.add_argument("--out", default=None, metavar="DIR", help="write DIR/bench_host.md and DIR/bench_host.csv")
    p.add_argument("--parts", default="host", help=argparse.SUPPRESS)   # the old spelling of a host-only run
    args = p.parse_args(argv)
    if set(args.parts.replace(" ", "").split(",")) - {"host", ""}:
        p.error("--parts: only host time is measured here now; end-to-end decode is bench_decode.py's, and the "
                "end-to-end forward from torch tensors was bench_host.py --parts forward before issue 54 item 4")
    args.runs = args.runs or (5 if args.quick else 41)
    args.kernel_runs = args.kernel_runs or (2 if args.quick else 5)
    if args.calls < 1 or args.runs < 1:
        p.error("--calls and --runs must be at least 1")
    if args.only:
        args.only = [c.strip() for c in args.only.split(",") if c.strip()]
        unknown = sorted(set(args.only) - set(CALLS))
        if unknown:
            p.error(f"--only: unknown calls {unknown}; known: {list(CALLS)}")
    args.selected = [FLOOR] + [c for c in CALLS if c != FLOOR and (not args.only or c in args.only)
                               and not (args.no_jax and c.startswith("jax"))]
    return args


def _optional(env, args):
    """The optional parties: cuflash's torch and JAX adapters, FlashAttention-4, JAX itself."""
    env.ct = env.fa4 = env.jax = env.jnp = env.cj = None
    versions = []
    if env.torch is not None:
        try:
            env.ct = importlib.import_module("cuflash.interop.torch")
        except Exception as e:  # noqa: BLE001 - the CuPy and JAX rows still run
            log(f"cuflash.interop.torch not importable ({type(e).__name__}: {_first_line(e)}): no ct rows")
        try:
            from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
        except Exception:  # noqa: BLE001 - FA4 is optional: its columns stay empty
            pass
        else:
            env.fa4 = SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func)
            versions.append("flash_attn.cute")
    if not args.no_jax:
        # JAX takes 75% of the GPU's memory at its first use unless told otherwise; torch and CuPy
        # share this process.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        try:
            import jax
            import jax.numpy as jnp
            if not any(d.platform == "gpu" for d in jax.devices()):
                raise RuntimeError("no GPU device")
        except Exception as e:  # noqa: BLE001 - no JAX rows
            log(f"JAX not usable ({type(e).__name__}: {_first_line(e)}): no JAX rows")
        else:
            env.jax, env.jnp = jax, jnp
            versions.append(f"jax {jax.__version__}")
            try:
                env.cj = importlib.import_module("cuflash.interop.jax")
            except Exception as e:  # noqa: BLE001 - being written: its rows appear once it imports
                log(f"cuflash.interop.jax not importable ({type(e).__name__}: {_first_line(e)}): no cuflash JAX rows")
    return versions


def main(argv=None):
    args = parse_args(argv)

    import cupy
    import ml_dtypes
    import numpy as np

    try:
        import cuflash
    except ImportError:  # run from a checkout without `pip install -e .`
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import cuflash

    gpu = open_gpu(cupy, not args.no_torch)
    if gpu is None:
        return 1
    device = cupy.cuda.Device()
    env = SimpleNamespace(cp=cupy, np=np, cuflash=cuflash, bf16=cupy.dtype(ml_dtypes.bfloat16), torch=gpu.torch,
                          F=gpu.F, sdpa_kernel=gpu.sdpa_kernel, SDPBackend=gpu.SDPBackend,
                          device_sync=device.synchronize)
    versions = ", ".join([gpu.versions] + _optional(env, args))
    header = (f"**{gpu.device_name}** ({versions}); host us per call = wall time of {args.calls} back-to-back calls "
              f"and one synchronisation / {args.calls}, median of {args.runs} rounds, every contender once a round "
              f"in random order")
    log(header)

    with gpu.stream:   # torch's current stream, also CuPy's: every torch-side contender on one stream
        log("setting up (first calls compile)")
        registry = make_registry(env, args.selected)
        for c in registry.values():
            c.sync = c.sync or (lambda r: env.device_sync())
        checks = prepare(env, registry)
        log(f"timing {len(registry)} contenders, {args.runs} rounds of {args.calls}-call bursts")
        t0 = time.perf_counter()
        samples = host_samples(registry, args.runs, args.calls)
        log(f"  took {time.perf_counter() - t0:.0f} s")
        host = medians(samples)
        log("kernel time (events behind a spin kernel)")
        kernel = {}
        for key, c in registry.items():
            try:
                kernel[key] = kernel_us(env, c, host.get(key), args.calls, args.kernel_runs)
            except Exception as e:  # noqa: BLE001 - the host figures stand without it
                log(f"  {key[0]} / {key[1]}: no kernel time: {type(e).__name__}: {_first_line(e)}")

    floor = " / ".join(f"{name} {fmt(host.get((FLOOR, name)))} us" for name, _ in REGISTRY[FLOOR]
                       if (FLOOR, name) in host)
    rows = host_rows(host, args.selected)
    details = kernel_rows(host, kernel, checks, registry)
    problems = "; ".join(f"{call}: {CALLS[call][0]}" for call in args.selected if call != FLOOR)
    tables = [
        header,
        markdown_table(details, "Every contender: host us per call (the figure), kernel us per call (GPU time alone, "
                                "events behind a spin kernel: not a per-call figure) and the output check against "
                                "the call's cuDNN contender", KERNEL_COLUMNS, CELLS),
        markdown_table(rows, f"Host us per call, as users call (launch floor this run: {floor}). Problems: {problems}. "
                             f"x cuDNN = cuflash / SDPA cuDNN's host time for the same call (JAX rows: / JAX "
                             f"cuDNN's); CuPy-array rows against SDPA cuDNN from torch tensors. "
                             + bar_summary(rows), HOST_COLUMNS, CELLS),
    ]
    if any(c.get("check") == "FAILED" for c in details):
        tables.insert(-1, "**CHECK FAILED**: a contender's outputs differ from its call's reference (above)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "header": header, "calls_per_burst": args.calls, "rounds": args.runs,
            "problems": {call: CALLS[call][0] for call in args.selected},
            "host_us_samples": {f"{k[0]} | {k[1]}": v for k, v in samples.items()},
            "host_us": {f"{k[0]} | {k[1]}": v for k, v in host.items()},
            "kernel_us": {f"{k[0]} | {k[1]}": v for k, v in kernel.items() if v is not None},
            "details": details, "rows": rows}, indent=1, default=str) + "\n")
        log(f"written: {args.json}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_host.md").write_text("\n\n".join(tables) + "\n")
        with open(out / "bench_host.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=HOST_COLUMNS)
            w.writeheader()
            for r in rows:
                w.writerow({c: "" if missing(r.get(c)) else r[c] for c in HOST_COLUMNS})
        log(f"written: {out / 'bench_host.md'}, {out / 'bench_host.csv'}")
    print()
    print("\n\n".join(tables), flush=True)
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"\n(bench_host took {time.time() - t0:.0f} s)", file=sys.stderr)
    sys.exit(rc)
