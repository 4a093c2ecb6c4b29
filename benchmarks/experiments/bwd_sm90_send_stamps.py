"""Where a consumer's time goes in its dQ share's way out and its dS^T stores (NOTES, session 33):
thread 0's clock64 in bwd_sm90 at D = 128 with 64-row steps, fp16. Columns in cycles, medians over
the first 264 CTAs and steps 4..: the share's stores issued (stamps 0->1), the proxy fence (1->2),
the wait for the previous reduction's read (2->3, thread 0), the warpgroup's barrier (3->4), the
dS^T stores with their fence (5->6), and the step. ``bwd_sm90_send_stamps.patch`` applies to
bwd_sm90.cu as of commit 80527fd (the consumers' own reductions; CUFLASH_BWD_DQ_ASYNC=0 today runs
that way out, but the patch's context is the older file)::

    git show 80527fd:cuda_src/bwd_sm90.cu > cuda_src/bwd_sm90.cu
    patch -p1 < benchmarks/experiments/bwd_sm90_send_stamps.patch
    python benchmarks/experiments/bwd_sm90_send_stamps.py "st;CUFLASH_BWD_STAMPS=1"
"""
import sys
sys.path.insert(0, "benchmarks")
import numpy as np, cupy, cuflash
from cuflash import _compile, _memo
from ab_backward import Installed, parse_contender
arch, device = _compile.device_arch(), _compile.current_device()
c = parse_contender(sys.argv[1])
for batch, seqlen, causal in [(4, 4096, False), (2, 8192, True)]:
    _memo._memo = type(_memo._memo)()
    seen = []
    q, k, v, do = (cupy.random.standard_normal((batch, seqlen, 16, 128), dtype=cupy.float32).astype(cupy.float16) for _ in range(4))
    out, lse = cuflash.attention_forward(q, k, v, causal=causal)[:2]
    with Installed(c, on_variant=seen.append):
        cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
        module = _compile._kernels[(seen[-1], arch, device)][0]
        st = cupy.ndarray((264, 2, 128, 3), dtype=cupy.int64, memptr=module.get_global("bwd_stamps"))
        ss = cupy.ndarray((264, 2, 128, 7), dtype=cupy.int64, memptr=module.get_global("bwd_stamps_send"))
        cupy.cuda.Device().synchronize(); st[...] = 0; ss[...] = 0
        cuflash.attention_backward(do, q, k, v, out, lse, causal=causal)
        cupy.cuda.Device().synchronize()
    a, b = st.get(), ss.get()
    print(f"B{batch} S{seqlen} {'causal' if causal else 'full'}")
    for cons in (0, 1):
        rows = []
        for cta in range(264):
            for j in range(4, 127):
                x, p0, p1 = b[cta, cons, j], a[cta, cons, j, 1], a[cta, cons, j + 1, 1]
                if (x[[0, 1, 2, 3, 4]] == 0).any() or p0 == 0 or p1 == 0 or x[5] == 0 or x[6] == 0:
                    continue
                rows.append((x[1] - x[0], x[2] - x[1], x[3] - x[2], x[4] - x[3], x[6] - x[5], p1 - p0))
        r = np.array(rows)
        print(f"  consumer {cons}: n {len(r)}  stores {np.median(r[:,0]):.0f}  fence {np.median(r[:,1]):.0f}  "
              f"wait_read {np.median(r[:,2]):.0f}  barrier {np.median(r[:,3]):.0f}  dS^T stores {np.median(r[:,4]):.0f}  "
              f"period {np.median(r[:,5]):.0f}   (means: {', '.join(f'{m:.0f}' for m in r.mean(0))})")
