"""The bwd_sm90 backward (forced) on small problems with tails, for compute-sanitizer on an sm_90 GPU:
  compute-sanitizer --tool memcheck python benchmarks/sanitize_backward.py
  compute-sanitizer --tool racecheck python benchmarks/sanitize_backward.py
bf16 and fp16, D 64, 128 and 256, GQA 4/2, Sq != Sk (77 / 200: partial tiles on both sides), causal and not,
Sq = Sk = 300 causal (whole tiles below the diagonal: dS unguarded tile by tile), D = 128's 80-row tiles
(non-causal, forced at every length), varlen (attention_varlen_backward), deterministic on and off. Each call's
gradients must be finite; the largest difference from bwd_sm80 on the same inputs is printed (relative to
max|g|), not judged (--no-compare: no bwd_sm80 calls, half the time under the sanitizer). Exit status 1 on a
failure.
Inputs (out, lse) come from cuflash's forward, without modifiers or dropout (what every bwd_sm90 build runs)."""
import sys
import cupy as cp, ml_dtypes, numpy as np, cuflash
from cuflash import backward as bw
DTYPES = {"bf16": cp.dtype(ml_dtypes.bfloat16), "fp16": cp.dtype(np.float16)}
Hq, Hk = 4, 2
COMPARE = "--no-compare" not in sys.argv[1:]
WIDE_MIN_ROWS = bw.kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS
def rnd(dt, *s): return cp.random.standard_normal(s, dtype=cp.float32).astype(dt)
def grads(family, fn, *args, **kw):
    with bw.force_kernel(family):
        return [g.astype(cp.float32) for g in fn(*args, **kw)]
def run(fn, *args, **kw):
    got = grads("bwd_sm90", fn, *args, **kw)
    return got, grads("bwd_sm80", fn, *args, **kw) if COMPARE else None
def report(label, got, other):
    finite = all(bool(cp.isfinite(g).all()) for g in got)
    note = ""
    if other is not None:
        rel = max(float(cp.abs(a - b).max()) / max(float(cp.abs(b).max()), 1e-30) for a, b in zip(got, other))
        note = f" (max|g - bwd_sm80| / max|g| = {rel:.1e})"
    print(f"{label}: {'ok' if finite else 'NOT FINITE'}{note}", flush=True)
    return finite
n_ok = n = 0
cp.random.seed(0)
for name, dt in DTYPES.items():
    for D in (64, 128, 256):
        for Sq, Sk, causal, wide in ((77, 200, True, False), (200, 77, False, False), (300, 300, True, False),
                                     (200, 77, False, True)):
            if wide and D != 128:
                continue
            # 80 query rows per step at every length (bwd_sm90 takes them from BWD_SM90_WIDE_MIN_ROWS rows)
            bw.kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS = 0 if wide else WIDE_MIN_ROWS
            cuflash._runtime.memo.clear_memo()
            q, k, v = rnd(dt, 2, Sq, Hq, D), rnd(dt, 2, Sk, Hk, D), rnd(dt, 2, Sk, Hk, D)
            dout = rnd(dt, 2, Sq, Hq, D)
            out, lse, _ = cuflash.attention_forward(q, k, v, causal=causal)
            for det in (False, True):
                args, kw = (dout, q, k, v, out, lse), dict(causal=causal, deterministic=det)
                got, other = run(cuflash.attention_backward, *args, **kw)
                n += 1
                n_ok += report(f"bwd_sm90 {name} D{D} B2 Sq{Sq} Sk{Sk} H{Hq}/{Hk} causal={causal} det={det}"
                               + (" (80-row tiles)" if wide else ""),
                               got, other)
        bw.kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS = WIDE_MIN_ROWS
        cuflash._runtime.memo.clear_memo()
        # varlen: sequences (77 queries, 200 keys), (200, 77), (1, 5)
        cu_q, cu_k = cp.array([0, 77, 277, 278], cp.int32), cp.array([0, 200, 277, 282], cp.int32)
        q, k, v = rnd(dt, 278, Hq, D), rnd(dt, 282, Hk, D), rnd(dt, 282, Hk, D)
        dout = rnd(dt, 278, Hq, D)
        causal = D == 64   # one varlen mode per head dim, both over the two dtypes
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=200, max_seqlen_k=200, causal=causal,
                                            return_lse=True)
        for det in (False, True):
            args = (dout, q, k, v, out, lse, cu_q, cu_k)
            kw = dict(max_seqlen_q=200, max_seqlen_k=200, causal=causal, deterministic=det, check=True)
            got, other = run(cuflash.attention_varlen_backward, *args, **kw)
            n += 1
            n_ok += report(f"bwd_sm90 {name} D{D} varlen (77,200),(200,77),(1,5) H{Hq}/{Hk} causal={causal} det={det}",
                           got, other)
cp.cuda.Device().synchronize()
print(f"{n_ok} calls ok" if n_ok == n else f"{n_ok} of {n} calls ok")
raise SystemExit(0 if n_ok == n else 1)
