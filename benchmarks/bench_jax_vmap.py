"""jax.vmap over cuflash.interop.jax: time per call of a mapped call against the same work as one
batched call, and against JAX's cuDNN attention mapped the same way, on one GPU.

Contenders, each jitted once, called ``calls`` times back to back and waited for (the median of
``rounds`` rounds, every contender once a round in a new random order):

- ``vmap cuflash``: ``jax.jit(jax.vmap(f))`` over (N, B, ...) (the mapped axis folds into B);
- ``batched cuflash``: ``jax.jit(f)`` over (N B, ...), the call folding makes;
- ``vmap cuflash, one call per instance``: the same mapped call with sinks of -30 mapped too (one per
  instance and head: a change of the denominator below float32's resolution), which cuflash runs
  once per instance in a ``jax.lax.map`` loop: what a map that does not fold costs;
- ``vmap cudnn``: ``jax.jit(jax.vmap(jax.nn.dot_product_attention(..., implementation="cudnn")))``.

The table gives ``x batched`` (the batched call's time over the mapped one's: 1.0 when folding
costs nothing) and ``x cuDNN`` (cuDNN's mapped time over cuflash's).

Run on a GPU machine: ``PYTHONPATH=$PWD:$PWD/benchmarks python benchmarks/bench_jax_vmap.py [--rounds R]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from bench_jax_grid import _time  # noqa: E402

# (name, kind, N, (B, S, H, D)) for attention, (name, kind, N, (B, L, Hq, Hk, D)) for decode
PROBLEMS = (
    ("fwd D128 S4k causal, N 4 x B 1", "fwd", 4, (1, 4096, 16, 128)),
    ("fwd+bwd D128 S4k causal, N 4 x B 1", "fwd+bwd", 4, (1, 4096, 16, 128)),
    ("fwd D64 S1k causal, N 8 x B 2", "fwd", 8, (2, 1024, 32, 64)),
    ("fwd+bwd D64 S1k causal, N 8 x B 2", "fwd+bwd", 8, (2, 1024, 32, 64)),
    ("decode L8k GQA 32/8 D128, N 4 x B 2", "decode", 4, (2, 8192, 32, 8, 128)),
)


def _contenders(kind, n, shape):
    import jax
    import jax.numpy as jnp

    import cuflash.interop.jax as cj

    keys = jax.random.split(jax.random.key(0), 3)
    if kind == "decode":
        b, length, hq, hk, d = shape
        q = jax.random.normal(keys[0], (n, b, 1, hq, d), jnp.bfloat16)
        kc, vc = (jax.random.normal(key, (n, b, length, hk, d), jnp.bfloat16) for key in keys[1:3])
        lens = jnp.full((n, b), length - 16, jnp.int32)

        def step(q, kc, vc, lens):
            return cj.decode(q, kc, vc, cache_seqlens=lens)

        mapped, batched = jax.jit(jax.vmap(step)), jax.jit(step)
        fold = [x.reshape(n * b, *x.shape[2:]) for x in (q, kc, vc, lens)]
        return {"vmap cuflash": lambda: mapped(q, kc, vc, lens), "batched cuflash": lambda: batched(*fold)}

    q, k, v = (jax.random.normal(key, (n, *shape), jnp.bfloat16) for key in keys[:3])
    fold = [x.reshape(-1, *shape[1:]) for x in (q, k, v)]

    def ours(q, k, v):
        return cj.attention(q, k, v, causal=True)

    sinks = jnp.full((n, shape[2]), -30.0, jnp.float32)

    def ours_per_instance(q, k, v, sinks):
        return cj.attention(q, k, v, causal=True, sinks=sinks)

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    if kind == "fwd+bwd":
        def trained(attend):
            def loss(q, k, v, *rest):
                return attend(q, k, v, *rest).astype(jnp.float32).sum()
            return jax.grad(loss, argnums=(0, 1, 2))
        ours, ours_per_instance, cudnn = (trained(f) for f in (ours, ours_per_instance, cudnn))
    mapped = {name: jax.jit(jax.vmap(f)) for name, f in (("vmap cuflash", ours), ("vmap cudnn", cudnn))}
    batched, per_instance = jax.jit(ours), jax.jit(jax.vmap(ours_per_instance))
    contenders = {name: (lambda f=f: f(q, k, v)) for name, f in mapped.items()}
    contenders["vmap cuflash, one call per instance"] = lambda: per_instance(q, k, v, sinks)
    contenders["batched cuflash"] = lambda: batched(*fold)
    return contenders


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    rows = []
    for name, kind, n, shape in PROBLEMS:
        contenders, failed = {}, {}
        for contender, fn in _contenders(kind, n, shape).items():
            try:
                _time(fn, 2)   # compile, plan, warm up
                contenders[contender] = fn
            except Exception as exc:  # a route this machine cannot run: say why, time the others
                failed[contender] = f"{type(exc).__name__}: {str(exc)[:160]}"
        samples = {c: [] for c in contenders}
        for _ in range(args.rounds):
            order = list(contenders)
            random.shuffle(order)
            for c in order:
                samples[c].append(_time(contenders[c], args.calls))
        times = {c: statistics.median(s) for c, s in samples.items()}
        rows.append((name, times))
        print(f"{name:40} " + "  ".join(f"{c} {1e6 * t:9.1f} us" for c, t in times.items()), flush=True)
        for c, why in failed.items():
            print(f"{name:40} {c} failed: {why}", flush=True)
    columns = ("vmap cuflash", "batched cuflash", "vmap cuflash, one call per instance", "vmap cudnn")
    print("\n| problem | " + " | ".join(f"{c} us" for c in columns) + " | x batched | x cuDNN |")
    print("|---" * (len(columns) + 3) + "|")
    for name, times in rows:
        ours = times.get("vmap cuflash")
        cells = [f"{1e6 * times[c]:.1f}" if c in times else "-" for c in columns]
        ratio = [f"{times[c] / ours:.3f}" if ours and c in times else "-" for c in ("batched cuflash", "vmap cudnn")]
        print(f"| {name} | {' | '.join(cells)} | {' | '.join(ratio)} |")


if __name__ == "__main__":
    main()
