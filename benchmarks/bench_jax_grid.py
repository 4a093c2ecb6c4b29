"""cuflash inside jax.jit against JAX's cuDNN attention and against the same cuflash call from CuPy,
over issue 54's grid: forward and forward + backward, D 64 / 128 / 256, 4k and 16k tokens per
sequence (16k tokens in all, Hq x D = 2048), causal and not, bf16; and jitted decode at
(B 8, L 8k), GQA 32/8, D 128, alone and four calls chained in one jitted function, beside JAX's
dispatch floor (a jitted ``q * 2`` over the same operands).

Each contender is timed as its users run it: JAX functions jitted once, then called ``calls``
times back to back and waited for with ``block_until_ready``; CuPy calls in a Python loop, then one
synchronisation. The figure is the time per call, the median of ``rounds`` rounds, every contender
timed once a round in a new random order. The last table gives, per problem, cuflash-in-jit /
cuDNN (higher is better: cuDNN's time over ours) and cuflash-in-jit / CuPy (ours from CuPy over
ours in jit), with the bars: >= 1.0x cuDNN, >= 0.95x CuPy.

Run on a GPU machine: ``PYTHONPATH=$PWD python benchmarks/bench_jax_grid.py [--quick] [--only fwd,decode]
[--calls N] [--no-command-buffers]``. 30 calls a round by default: a round's first call waits for
the host before the GPU starts (JAX's dispatch and the callback, ~80 us on an H200's host against
~20 for a CuPy call), which 10 calls a round left at 4-6 us a call; the steady-state figure is
what a training or serving loop sees. ``--no-command-buffers`` traces cuflash's calls with
``COMMAND_BUFFERS = False`` (XLA then runs the Python callback at every call).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

TOKENS = 16384
WIDTH = 2048            # Hq x D
HEAD_DIMS = (64, 128, 256)
SEQLENS = (4096, 16384)
BARS = {"cudnn": 1.0, "cupy": 0.95}


def problems(quick: bool = False):
    """(name, kind, shape, causal) of the grid; shape (B, S, H, D) for attention, (B, L, Hq, Hk, D)
    for decode."""
    grid = []
    for d in HEAD_DIMS[1:2] if quick else HEAD_DIMS:
        for s in SEQLENS[:1] if quick else SEQLENS:
            for causal in (False, True):
                for kind in ("fwd", "fwd+bwd"):
                    grid.append((f"{kind} D{d} S{s // 1024}k {'causal' if causal else 'full'}", kind,
                                 (TOKENS // s, s, WIDTH // d, d), causal))
    grid.append(("decode B8 L8k GQA 32/8 D128", "decode", (8, 8192, 32, 8, 128), True))
    # Four decode calls chained in one jitted function (each output the next q), as a model's layers
    # run in one jitted step: JAX's dispatch is paid once for four calls. Times are per four calls.
    grid.append(("decode x4 a jit B8 L8k GQA 32/8 D128", "decode4", (8, 8192, 32, 8, 128), True))
    return grid


def ratios(times: dict) -> dict:
    """{"cudnn": cuDNN's time / ours in jit, "cupy": ours from CuPy / ours in jit} where present."""
    ours = times.get("jax cuflash")
    out = {}
    if ours:
        if times.get("jax cudnn"):
            out["cudnn"] = times["jax cudnn"] / ours
        if times.get("cupy cuflash"):
            out["cupy"] = times["cupy cuflash"] / ours
    return out


def bar_text(name: str, value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f} {'pass' if value >= BARS[name] else 'FAIL'}"


def _contenders(kind, shape, causal):
    """{contender: (setup-free callable running ``calls`` calls and waiting, calls)}."""
    import cupy
    import jax
    import jax.numpy as jnp
    import numpy as np

    import cuflash
    import cuflash.interop.jax as cj

    keys = jax.random.split(jax.random.key(0), 4)
    if kind in ("decode", "decode4"):
        b, length, hq, hk, d = shape
        q = jax.random.normal(keys[0], (b, 1, hq, d), jnp.bfloat16)
        kc, vc = (jax.random.normal(key, (b, length, hk, d), jnp.bfloat16) for key in keys[1:3])
        lens = jnp.full((b,), length - 16, jnp.int32)
        cq, ckc, cvc = (cupy.asarray(np.asarray(x)) for x in (q, kc, vc))
        clens = cupy.asarray(np.asarray(lens))
        steps = 4 if kind == "decode4" else 1

        def chained(attend, q):
            for _ in range(steps):
                q = attend(q)
            return q

        jitted = jax.jit(lambda q, kc, vc, lens: chained(lambda x: cj.decode(x, kc, vc, cache_seqlens=lens), q))
        # What JAX's dispatch of a jitted call with these operands costs: one tiny fused kernel (the
        # unused operands kept, as jit would otherwise drop them from the call).
        floor = jax.jit(lambda q, kc, vc, lens: q * 2, keep_unused=True)
        return {"jax cuflash": lambda: jitted(q, kc, vc, lens),
                "jax dispatch floor": lambda: floor(q, kc, vc, lens),
                "cupy cuflash": lambda: chained(lambda x: cuflash.decode(x, ckc, cvc, cache_seqlens=clens), cq)}
    q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys[:3])
    cq, ck, cv = (cupy.asarray(np.asarray(x)) for x in (q, k, v))
    if kind == "fwd":
        ours = jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=causal))
        theirs = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                       implementation="cudnn"))
        return {"jax cuflash": lambda: ours(q, k, v), "jax cudnn": lambda: theirs(q, k, v),
                "cupy cuflash": lambda: cuflash.attention(cq, ck, cv, causal=causal)}

    def loss(attend):
        return jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))

    ours = loss(lambda q, k, v: cj.attention(q, k, v, causal=causal))
    theirs = loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"))
    dout = cupy.ones_like(cq)

    def cupy_step():
        out, lse, _ = cuflash.attention_forward(cq, ck, cv, causal=causal)
        return cuflash.attention_backward(dout, cq, ck, cv, out, lse, causal=causal)

    return {"jax cuflash": lambda: ours(q, k, v), "jax cudnn": lambda: theirs(q, k, v), "cupy cuflash": cupy_step}


def _time(fn, calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls and one wait for the device."""
    import cupy
    import jax

    start = time.perf_counter()
    for _ in range(calls):
        result = fn()
    jax.block_until_ready(result)
    cupy.cuda.get_current_stream().synchronize()
    return (time.perf_counter() - start) / calls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one head dim, one length, 3 rounds")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--only", default="", help="comma-separated name prefixes of the problems to run")
    parser.add_argument("--no-command-buffers", action="store_true",
                        help="cuflash.interop.jax.COMMAND_BUFFERS = False (a Python callback at every call, "
                             "never recorded in XLA's CUDA graphs)")
    args = parser.parse_args(argv)
    if args.no_command_buffers:
        import cuflash.interop.jax as cj

        cj.COMMAND_BUFFERS = False
    only = [x for x in args.only.split(",") if x]
    rounds = 3 if args.quick else args.rounds
    rows = []
    for name, kind, shape, causal in problems(args.quick):
        if only and not any(name.startswith(prefix) for prefix in only):
            continue
        contenders = _contenders(kind, shape, causal)
        for fn in contenders.values():   # compile, plan, warm up
            _time(fn, 2)
        samples = {c: [] for c in contenders}
        for _ in range(rounds):
            order = list(contenders)
            random.shuffle(order)
            for c in order:
                samples[c].append(_time(contenders[c], args.calls))
        times = {c: statistics.median(s) for c, s in samples.items()}
        rows.append((name, times, ratios(times)))
        print(f"{name:34} " + "  ".join(f"{c} {1e6 * t:9.1f} us" for c, t in times.items()), flush=True)
    print("\n| problem | jax cuflash us | jax cuDNN us | cupy cuflash us | jax dispatch floor us | x cuDNN (>= 1.0) "
          "| x CuPy (>= 0.95) |")
    print("|---|---|---|---|---|---|---|")
    for name, times, r in rows:
        cells = [f"{1e6 * times[c]:.1f}" if c in times else "-"
                 for c in ("jax cuflash", "jax cudnn", "cupy cuflash", "jax dispatch floor")]
        print(f"| {name} | {' | '.join(cells)} | {bar_text('cudnn', r.get('cudnn'))} | {bar_text('cupy', r.get('cupy'))} |")


if __name__ == "__main__":
    main()
