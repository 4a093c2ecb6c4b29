"""Time per call of cuflash inside jax.jit (cuflash.interop.jax) against the same call from CuPy and
JAX's cuDNN attention, on one GPU.

Each row times ``n`` calls chained inside one jitted function (each call's output is the next
call's q, so none can be skipped or overlapped), run ``reps`` times after a warm-up, and reports
microseconds per call. A small problem shows the host cost of a call (the GPU work is a few
microseconds), a large one the GPU time. Rows:

- ``jax empty callback``: a buffer_callback that launches nothing: what JAX and XLA cost per call;
- ``jax wrapper, no launch``: that, with the adapter's own work (XLA's stream made CuPy's, the
  buffers' CuPy views) and no cuflash call;
- ``jax cuflash``: cuflash.interop.jax.attention (buffer_callback, with ``COMMAND_BUFFERS = False``);
- ``jax cuflash, command buffers``: the same with ``COMMAND_BUFFERS = True`` (the default);
- ``cupy cuflash``: cuflash.attention called from Python in a loop on CuPy arrays;
- ``cupy cuflash, out= lse=``: the call the adapter makes (the forward with given out and lse);
- ``jax cudnn``: jax.nn.dot_product_attention(implementation="cudnn").

Run: ``PYTHONPATH=$PWD python benchmarks/bench_jax.py`` (prints a table).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.buffer_callback import buffer_callback  # noqa: E402

import cupy  # noqa: E402

import cuflash  # noqa: E402
import cuflash.interop.jax as cj  # noqa: E402
from cuflash.attention import _forward_with_rng_words  # noqa: E402
from cuflash.interop._jax_buffers import Views  # noqa: E402
from cuflash.interop._jax_stream import on_xla_stream  # noqa: E402


def _chained(attend, n):
    def run(q, k, v):
        for _ in range(n):
            q = attend(q, k, v)
        return q
    return jax.jit(run)


def _time_jax(fn, args, reps):
    fn(*args).block_until_ready()
    fn(*args).block_until_ready()
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    out.block_until_ready()
    return time.perf_counter() - start


def _time_cupy(q, k, v, n, reps, causal):
    stream = cupy.cuda.get_current_stream()
    for _ in range(2):
        x = q
        for _ in range(n):
            x = cuflash.attention(x, k, v, causal=causal)
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        x = q
        for _ in range(n):
            x = cuflash.attention(x, k, v, causal=causal)
    stream.synchronize()
    return time.perf_counter() - start


def _empty(q, k, v):
    def nothing(ctx, out, q, k, v):
        pass
    return buffer_callback(nothing, jax.ShapeDtypeStruct(q.shape, q.dtype))(q, k, v)


def _wrapper_only(q, k, v):
    views = Views([(q.shape, q.dtype)] * 3)
    outs = Views([(q.shape, q.dtype), ((q.shape[0], q.shape[2], q.shape[1]), np.float32)])

    def wrap(ctx, results, *args):
        with on_xla_stream(ctx, args[0]) as where:
            views(args, where.device)
            outs(results, where.device)

    return buffer_callback(wrap, (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                  jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)))(q, k, v)[0]


def _time_cupy_given(q, k, v, n, reps):
    """The adapter's cuflash call, from CuPy: into given out and lse (two of each, alternating)."""
    outs = [cupy.empty_like(q) for _ in range(2)]
    lses = [cupy.empty((q.shape[0], q.shape[2], q.shape[1]), np.float32) for _ in range(2)]

    def burst():
        x = q
        for i in range(n):
            x, _ = _forward_with_rng_words(x, k, v, None, causal=True, out=outs[i % 2], lse=lses[i % 2])

    burst()
    cupy.cuda.get_current_stream().synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        burst()
    cupy.cuda.get_current_stream().synchronize()
    return time.perf_counter() - start


def _with_command_buffers(on: bool, calls: int, args, reps: int) -> float:
    """The chained cuflash calls traced with ``COMMAND_BUFFERS = on``."""
    default = cj.COMMAND_BUFFERS
    cj.COMMAND_BUFFERS = on
    try:
        return _time_jax(_chained(lambda q, k, v: cj.attention(q, k, v, causal=True), calls), args, reps)
    finally:
        cj.COMMAND_BUFFERS = default


def main(shapes=((1, 128, 8, 64), (4, 4096, 16, 128)), n=50, reps=10):
    print(f"{'shape (B, S, H, D) bf16 causal':34} {'route':32} {'us per call':>12}")
    for shape in shapes:
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
        calls = n if shape[1] <= 1024 else 10
        rows = [("jax empty callback", lambda: _time_jax(_chained(_empty, calls), (q, k, v), reps)),
                ("jax wrapper, no launch", lambda: _time_jax(_chained(_wrapper_only, calls), (q, k, v), reps)),
                ("jax cuflash", lambda: _with_command_buffers(False, calls, (q, k, v), reps)),
                ("jax cuflash, command buffers", lambda: _with_command_buffers(True, calls, (q, k, v), reps))]
        cq, ck, cv = (cupy.asarray(np.asarray(x)) for x in (q, k, v))
        rows.append(("cupy cuflash", lambda: _time_cupy(cq, ck, cv, calls, reps, True)))
        rows.append(("cupy cuflash, out= lse=", lambda: _time_cupy_given(cq, ck, cv, calls, reps)))
        rows.append(("jax cudnn", lambda: _time_jax(_chained(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"), calls),
            (q, k, v), reps)))
        for name, timed in rows:
            try:
                seconds = timed()
                print(f"{str(shape):34} {name:32} {1e6 * seconds / (reps * calls):12.1f}")
            except Exception as exc:  # a route this machine cannot run: say why, time the others
                print(f"{str(shape):34} {name:32} {'failed':>12}  {type(exc).__name__}: {str(exc)[:200]}")


if __name__ == "__main__":
    main()
