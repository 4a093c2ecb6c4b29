"""Bad index values on the GPU through every entry point that takes them: each call must be refused (check=True)
and, run under `compute-sanitizer --tool memcheck python benchmarks/sanitize_bad_indices.py`, touch no memory out of bounds.
Decode runs twice: checked by the decode kernel itself (small tables) and by a check_indices launch ahead of it."""
import cupy as cp, ml_dtypes, cuflash
from cuflash import kernels
from cuflash._runtime import memo as _memo
bf = cp.dtype(ml_dtypes.bfloat16)
def rnd(*s): return cp.random.standard_normal(s, dtype=cp.float32).astype(bf)
B, Hq, Hk, D, P = 4, 8, 2, 64, 16
q = rnd(B, 1, Hq, D); kn, vn = rnd(B, 1, Hk, D), rnd(B, 1, Hk, D)
kc, vc = rnd(B, 256, Hk, D), rnd(B, 256, Hk, D)
kp, vp = rnd(64, P, Hk, D), rnd(64, P, Hk, D)
table = cp.arange(64, dtype=cp.int32).reshape(B, 16)
cases = [dict(k_cache=kc, v_cache=vc, cache_seqlens=cp.array([10, 300, 5, 7], cp.int32)),
         dict(k_cache=kc, v_cache=vc, cache_seqlens=cp.array([10, -4, 5, 7], cp.int32), k_new=kn, v_new=vn),
         dict(k_cache=kc, v_cache=vc, cache_seqlens=cp.array([10, 256, 5, 7], cp.int32), k_new=kn, v_new=vn),
         dict(k_cache=kp, v_cache=vp, cache_seqlens=cp.array([40, 30, 5, 7], cp.int32), block_table=table.copy()),
         dict(k_cache=kp, v_cache=vp, cache_seqlens=cp.array([40, 30, 5, 7], cp.int32), k_new=kn, v_new=vn)]
cases[3]["block_table"][1, 1] = 1 << 20
cases[4]["block_table"] = table.copy(); cases[4]["block_table"][0, 2] = -5
n = 0
self_check = kernels.decode.DECODE_SELF_CHECK_PER_THREAD
for per_thread in (self_check, 0):   # 0: every paged table is checked by a check_indices launch
    kernels.decode.DECODE_SELF_CHECK_PER_THREAD = per_thread
    _memo.clear_memo()
    for splits in (1, 3):
        for c in cases:
            c = dict(c); kcache, vcache = c.pop("k_cache"), c.pop("v_cache")
            try:
                cuflash.decode(q, kcache, vcache, num_splits=splits, check=True, **c)
            except ValueError as e:
                n += 1
T, H = 100, 4
qv, kv = rnd(T, H, D), rnd(T, H, D)
for cu in ([0, 60, 30, 100], [0, 50, 100, 1 << 28], [5, 10, 20, 100]):
    for fn in ("fwd", "bwd"):
        cuv = cp.array(cu, cp.int32)
        try:
            if fn == "fwd":
                cuflash.attention_varlen(qv, kv, kv, cuv, cuv, max_seqlen_q=100, max_seqlen_k=100, check=True)
            else:
                o = rnd(T, H, D); lse = cp.zeros((H, T), cp.float32)
                cuflash.attention_varlen_backward(o, qv, kv, kv, o, lse, cuv, cuv, max_seqlen_q=100, max_seqlen_k=100, check=True)
        except ValueError:
            n += 1
cp.cuda.Device().synchronize()
print(f"bad-index calls refused: {n} of {4 * len(cases) + 6}")
raise SystemExit(0 if n == 4 * len(cases) + 6 else 1)
