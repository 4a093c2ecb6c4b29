"""Where a bwd_sm90 CTA's time goes outside its walk (docs/decisions.md#bwd-sm90-a-ctas-fixed-cost).

With ``bwd_sm90_cta_timeline.patch`` applied to the tree the kernels load from, every CTA of its own
(not persistent) stamps clock64 at fixed points of its life, and %globaltimer and its SM at its start
and end (CUFLASH_BWD_CTA_STAMPS=1, added here to bwd_sm90's variants). Per shape, medians over the
call's CTAs, in cycles: entry to consumer 0's wait for K and V, that wait, the first query tile, a
step of the walk, the walk's end to dK/dV's store, the store's parts; and the gap in ns between one
CTA's end and the next one's start on the same SM::

    patch -p1 < benchmarks/experiments/bwd_sm90_cta_timeline.patch
    python benchmarks/experiments/bwd_sm90_cta_timeline.py
"""
import dataclasses

import numpy as np

import cupy
import cuflash
from cuflash import kernels
from cuflash._build import compile as _compile
from cuflash._build.variant import Variant

SHAPES = [(2, 8192, 16, 128, (1024, 0)), (2, 8192, 16, 128, (-1, 0)), (16, 1024, 16, 128, (-1, 0)),
          (16, 1024, 32, 64, (-1, 0))]   # batch, tokens, heads, head dim, window (causal: (-1, 0))

_plan = kernels.bwd_sm90.plan


def _stamping_plan(*args, **kwargs):
    launch = _plan(*args, **kwargs)
    defines = dict(launch.variant.defines, CUFLASH_BWD_CTA_STAMPS=1)
    return dataclasses.replace(launch, variant=Variant("bwd_sm90", tuple(sorted(defines.items()))))


kernels.bwd_sm90.plan = _stamping_plan
kernels.bwd_sm90.BWD_SM90_PERSISTENT_MAX_STEPS = -1   # CTAs of their own


def stamps(head_dim):
    for (variant, _, _), (module, _) in _compile._kernels.items():
        if variant.family == "bwd_sm90" and dict(variant.defines)["CUFLASH_HEAD_DIM"] == head_dim:
            return cupy.ndarray((1 << 16, 16), dtype=cupy.uint64, memptr=module.get_global("bwd_cta_stamps"))
    raise RuntimeError("no bwd_sm90 module was loaded")


def run(b, s, h, d, window):
    rng = np.random.default_rng(0)
    q, k, v, do = (cupy.asarray(rng.standard_normal((b, s, h, d)), dtype=cupy.float16) for _ in range(4))
    out, lse = cuflash.attention_forward(q, k, v, window=window)
    cuflash.attention_backward(do, q, k, v, out, lse, window=window)
    cupy.cuda.Device().synchronize()
    table = stamps(d)
    table.fill(0)
    cuflash.attention_backward(do, q, k, v, out, lse, window=window)
    cupy.cuda.Device().synchronize()
    a = table.get().astype(np.int64)
    a = a[a[:, 8] > 0]

    def med(i, j):
        return float(np.median(a[:, j] - a[:, i]))

    steps = a[:, 9]
    per_step = (a[:, 4] - a[:, 3]) / np.maximum(steps - 1, 1)
    gaps = []
    for sm in np.unique(a[:, 10]):
        rows = a[a[:, 10] == sm]
        order = np.argsort(rows[:, 8])
        gaps += list(rows[order, 8][1:] - rows[order, 7][:-1])
    print(f"B {b} S {s} H {h} D {d} window {window}: {len(a)} CTAs, {np.median(steps):.0f} steps (median)")
    print(f"  cycles: entry to the wait for K, V {med(0, 1):.0f} (past __syncthreads {med(0, 15):.0f}) | "
          f"K, V {med(1, 2):.0f} | first tile {med(2, 3):.0f} | step {np.median(per_step):.0f} | "
          f"walk's end to the store {med(4, 5):.0f} | store: pack {med(5, 11):.0f}, barrier {med(11, 12):.0f}, "
          f"dK {med(12, 13):.0f}, dV {med(13, 14):.0f}, the rest {med(14, 6):.0f}")
    print(f"  ns between CTAs on an SM: median {np.median(gaps):.0f}, p90 {np.percentile(gaps, 90):.0f}")


if __name__ == "__main__":
    for shape in SHAPES:
        run(*shape)
