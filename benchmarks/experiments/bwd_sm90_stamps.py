"""Where the two consumers' lag goes along a walk (bwd_sm90 D = 128, 64-row steps; NOTES, session 32).

With ``bwd_sm90_stamps.patch`` applied, each consumer's thread 0 stamps clock64 per step
(CUFLASH_BWD_STAMPS=1): before its stage wait, after it, and after its dQ share has gone out, for the
first 264 CTAs. Per bucket of steps: the leader's period (cycles), consumer 1's lag behind consumer 0
and each consumer's wait, as fractions of the period. Contenders as in ``ab_backward.py``; by default
the deferred dQ with the staggered start (on) and lockstep (off)::

    patch -p1 < benchmarks/experiments/bwd_sm90_stamps.patch
    python benchmarks/experiments/bwd_sm90_stamps.py "on;CUFLASH_BWD_STAMPS=1"
"""
import sys
sys.path.insert(0, "benchmarks")
import numpy as np
import cupy
import cuflash
from cuflash import _compile, _pipeline
from ab_backward import Installed, parse_contender

arch, device = _compile.device_arch(), _compile.current_device()
SHAPES = [(4, 4096, False), (8, 2048, False), (2, 8192, True)]
BUCKETS = [(0, 1), (1, 4), (4, 16), (16, 32), (32, 64), (64, 128)]
for spec in sys.argv[1:] or ("on;CUFLASH_BWD_STAMPS=1", "off;CUFLASH_BWD_STAMPS=1;CUFLASH_BWD_DEFER_DQ=0"):
    c = parse_contender(spec)
    _pipeline._memo = type(_pipeline._memo)()   # plans made afresh under this contender
    for batch, seqlen, causal in SHAPES:
        seen = []
        q, k, v, do = (cupy.random.standard_normal((batch, seqlen, 16, 128), dtype=cupy.float32).astype(cupy.float16)
                       for _ in range(4))
        out, lse = cuflash.attention_forward(q, k, v, causal=causal)[:2]
        with Installed(c, on_variant=seen.append):
            cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
            cupy.cuda.Device().synchronize()
            module = _compile._kernels[(seen[-1], arch, device)][0]
            ptr = module.get_global("bwd_stamps")
            st = cupy.ndarray((264, 2, 128, 3), dtype=cupy.int64, memptr=ptr)
            st[...] = 0
            cupy.cuda.Device().synchronize()
            cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
            cupy.cuda.Device().synchronize()
        a = st.get()
        print(f"{c.name} B{batch} S{seqlen} {'causal' if causal else 'full'}: variant {dict(seen[-1].defines).get('CUFLASH_BLOCK_M')} rows")
        print("  steps     n   period(cyc)  lag/period  |lag|/period  wait0/period  wait1/period  out0/period")
        for lo, hi in BUCKETS:
            rows = []
            for cta in range(264):
                for j in range(lo, min(hi, 127)):
                    p0, p1, n0 = a[cta, 0, j, 1], a[cta, 1, j, 1], a[cta, 0, j + 1, 1]
                    if p0 == 0 or p1 == 0 or n0 == 0:
                        continue
                    period = n0 - p0
                    lag = p1 - p0
                    w0 = a[cta, 0, j, 1] - a[cta, 0, j, 0]
                    w1 = a[cta, 1, j, 1] - a[cta, 1, j, 0]
                    out0 = a[cta, 0, j, 2] - a[cta, 0, j, 1]
                    rows.append((period, lag / period, abs(lag) / period, w0 / period, w1 / period, out0 / period))
            if rows:
                r = np.array(rows)
                print(f"  {lo:3d}-{hi - 1:<3d} {len(r):5d} {np.median(r[:, 0]):10.0f}   " +
                      "  ".join(f"{np.mean(r[:, i]):10.3f}" for i in range(1, 6)))
