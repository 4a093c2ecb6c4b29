"""Where the two consumers' lag goes along a walk (bwd_sm90 D = 128, 64-row steps; docs/decisions.md#bwd-sm90-relag).

With ``bwd_sm90_stamps.patch`` applied, each consumer's thread 0 stamps clock64 per step
(CUFLASH_BWD_STAMPS=1): before its stage wait, after it, and after its dQ share has gone out, and
the producer before and after its wait for a free stage, for the first 264 CTAs. Per bucket of
steps, as fractions of the step (consumer 0's period): consumer 1's lag behind consumer 0, each
consumer's wait for its stage, consumer 0's step from its stage to its dQ share out, the producer's
wait for a free stage, how far ahead of the first consumer's start the tile was issued; and (in
cycles) the copy's latency where that consumer waited for it. Contenders as in ``ab_backward.py``;
by default the deferred dQ with the staggered start (on) and lockstep (off)::

    patch -p1 < benchmarks/experiments/bwd_sm90_stamps.patch
    python benchmarks/experiments/bwd_sm90_stamps.py ["on;CUFLASH_BWD_STAMPS=1" ...]

The patch goes into the installed tree (the kernels are loaded from it, not from a contender's
source directory). Walks longer than the patch's 128 steps: raise its kStampSteps and set
STAMP_STEPS to the same; other shapes: STAMP_SHAPES, e.g. ``2/8192c,1/16384c`` (batch/seqlen, c:
causal).
"""
import os
import sys

import numpy as np

CTAS, STEPS = 264, int(os.environ.get("STAMP_STEPS", 128))   # the patch's kStampCtas, kStampSteps
SHAPES = [(4, 4096, False), (8, 2048, False), (2, 8192, True)]   # (batch, seqlen, causal), 16 heads of 128
if os.environ.get("STAMP_SHAPES"):
    SHAPES = [(int(b), int(s.rstrip("c")), s.endswith("c"))
              for b, s in (x.split("/") for x in os.environ["STAMP_SHAPES"].split(","))]
BUCKETS = [(0, 1), (1, 4), (4, 16), (16, 32), (32, 64), (64, 128), (128, 192), (192, 256)]
COLUMNS = ("lag", "|lag|", "wait0", "wait1", "out0", "prodwait", "ahead")


def report(a, pr):
    """The table of one call's stamps: consumers ``a`` [cta, consumer, step, 3], producer ``pr``
    [cta, tile, 2] (clock64; 0 where nothing was stamped)."""
    lines = ["  steps      n  period  " + "  ".join(f"{c:>8}" for c in COLUMNS) + "  latency"]
    for lo, hi in BUCKETS:
        rows = []
        for cta in range(a.shape[0]):
            for j in range(lo, min(hi, a.shape[2] - 1)):
                p0, p1, n0 = a[cta, 0, j, 1], a[cta, 1, j, 1], a[cta, 0, j + 1, 1]
                if p0 == 0 or p1 == 0 or n0 == 0 or pr[cta, j, 1] == 0:
                    continue
                period = n0 - p0
                w0, w1 = p0 - a[cta, 0, j, 0], p1 - a[cta, 1, j, 0]
                issue, first = pr[cta, j, 1], min(p0, p1)
                waited = (w0 if p0 <= p1 else w1) > 200
                rows.append(((p1 - p0) / period, abs(p1 - p0) / period, w0 / period, w1 / period,
                             (a[cta, 0, j, 2] - p0) / period, (pr[cta, j, 1] - pr[cta, j, 0]) / period,
                             (first - issue) / period, period, first - issue if waited else np.nan))
        if rows:
            r = np.array(rows, dtype=float)
            latency = np.nanmedian(r[:, 8]) if np.isfinite(r[:, 8]).any() else float("nan")
            lines.append(f"  {lo:3d}-{hi - 1:<3d} {len(r):5d} {np.median(r[:, 7]):7.0f}  " +
                         "  ".join(f"{np.mean(r[:, i]):8.3f}" for i in range(7)) + f"  {latency:7.0f}")
    return "\n".join(lines)


def main(specs):
    sys.path.insert(0, "benchmarks")
    import cupy

    import cuflash
    from ab_backward import Installed, parse_contender
    from cuflash._build import compile as _compile
    from cuflash._runtime import memo as _memo

    arch, device = _compile.device_arch(), _compile.current_device()
    for spec in specs:
        c = parse_contender(spec)
        _memo._memo = type(_memo._memo)()   # plans made afresh under this contender
        for batch, seqlen, causal in SHAPES:
            seen = []
            q, k, v, do = (cupy.random.standard_normal((batch, seqlen, 16, 128), dtype=cupy.float32)
                           .astype(cupy.float16) for _ in range(4))
            out, lse = cuflash.attention_forward(q, k, v, causal=causal)[:2]
            with Installed(c, on_variant=seen.append):
                cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)   # compiles, loads
                module = _compile._kernels[(seen[-1], arch, device)][0]
                st = cupy.ndarray((CTAS, 2, STEPS, 3), dtype=cupy.int64, memptr=module.get_global("bwd_stamps"))
                sp = cupy.ndarray((CTAS, STEPS, 2), dtype=cupy.int64,
                                  memptr=module.get_global("bwd_stamps_producer"))
                cupy.cuda.Device().synchronize()
                st[...] = 0
                sp[...] = 0
                cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
                cupy.cuda.Device().synchronize()
            rows = dict(seen[-1].defines).get("CUFLASH_BLOCK_M")
            print(f"{c.name} B{batch} S{seqlen} {'causal' if causal else 'full'}, {rows}-row steps")
            print(report(st.get(), sp.get()))


if __name__ == "__main__":
    main(sys.argv[1:] or ("on;CUFLASH_BWD_STAMPS=1", "off;CUFLASH_BWD_STAMPS=1;CUFLASH_BWD_DEFER_DQ=0"))
