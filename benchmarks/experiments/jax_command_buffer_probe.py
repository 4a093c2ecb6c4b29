"""Whether XLA replays a jitted cuflash decode from a command buffer, and where its host time goes.

Counts the Python callbacks over 210 calls and times the callback's body and cuflash's call inside
it, for a lone jitted decode and for a decode step with two projections around it, against the same
decode from CuPy (B 8, L 8k, GQA 32/8, D 128, bf16). Run on a GPU machine, once per setting:

    PYTHONPATH=$PWD python benchmarks/experiments/jax_command_buffer_probe.py on|off
    XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 PYTHONPATH=$PWD python ... on
"""
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cupy  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import cuflash  # noqa: E402
import cuflash.interop.jax as cj  # noqa: E402

stamps = {"callback": [], "core": [], "count": 0}
orig_bc = cj.buffer_callback
def timed_cb(cb):
    def wrapped(ctx, results, *args):
        stamps["count"] += 1
        t = time.perf_counter(); cb(ctx, results, *args); stamps["callback"].append(time.perf_counter() - t)
    return wrapped
cj.buffer_callback = lambda cb, *a, **k: orig_bc(timed_cb(cb), *a, **k)
for name in ("_decode", "_forward_with_rng_words"):
    f = getattr(cj, name)
    def core(*a, _f=f, **k):
        t = time.perf_counter(); r = _f(*a, **k); stamps["core"].append(time.perf_counter() - t); return r
    setattr(cj, name, core)

mode = sys.argv[1]
cj.COMMAND_BUFFERS = mode != "off"
keys = jax.random.split(jax.random.key(0), 4)
b, length, hq, hk, d = 8, 8192, 32, 8, 128
qd = jax.random.normal(keys[0], (b, 1, hq, d), jnp.bfloat16)
kc, vc = (jax.random.normal(key, (b, length, hk, d), jnp.bfloat16) for key in keys[1:3])
lens = jnp.full((b,), length - 16, jnp.int32)
plain = jax.jit(lambda q, kc, vc, lens: cj.decode(q, kc, vc, cache_seqlens=lens))
def step(q, kc, vc, lens, w):   # a decode step's neighbours: projections around the attention
    q = (q.reshape(b, hq * d) @ w).reshape(b, 1, hq, d)
    o = cj.decode(q, kc, vc, cache_seqlens=lens)
    return jnp.tanh(o.reshape(b, hq * d) @ w) * 2
stepj = jax.jit(step)
w = jax.random.normal(keys[3], (hq * d, hq * d), jnp.bfloat16) * 0.01
cq, ckc, cvc, clens = (cupy.asarray(np.asarray(x)) for x in (qd, kc, vc, lens))
cases = {"plain": lambda: plain(qd, kc, vc, lens), "step": lambda: stepj(qd, kc, vc, lens, w),
         "cupy": lambda: cuflash.decode(cq, ckc, cvc, cache_seqlens=clens)}
for name, fn in cases.items():
    for _ in range(3): jax.block_until_ready(fn())
    cupy.cuda.Device().synchronize()
    stamps.update(callback=[], core=[], count=0)
    res = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(30): r = fn()
        t1 = time.perf_counter(); jax.block_until_ready(r); cupy.cuda.Device().synchronize(); t2 = time.perf_counter()
        res.append(((t1 - t0) / 30e-6, (t2 - t0) / 30e-6))
    cb = statistics.median(stamps["callback"]) * 1e6 if stamps["callback"] else 0
    core = statistics.median(stamps["core"]) * 1e6 if stamps["core"] else 0
    print(f"probe {mode:4s} {os.environ.get('XLA_FLAGS', ''):40s} {name:6s} enqueue {statistics.median(x[0] for x in res):6.1f} "
          f"total {statistics.median(x[1] for x in res):6.1f} us/call; callbacks {stamps['count']} / 210 calls, "
          f"callback body {cb:5.1f} us, core {core:5.1f} us")
