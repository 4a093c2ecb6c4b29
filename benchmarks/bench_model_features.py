"""What the model-family features cost, as users call them (issue 53's speed bars).

Three tables, each a ratio within one run, contenders in random-order turns (``Timer.median_ms_each``),
events around back-to-back public calls on CuPy arrays (host included, outputs allocated per call):

- **fp8 caches in decode**: ``cuflash.decode`` on an e4m3 cache (uint8 bytes, ``kv_dtype=
  "float8_e4m3fn"``, per-kv-head scales on the GPU) against the same call on the bf16 cache, GQA 32/8,
  D 128, one new token, at the decode grid's (B, L) in a contiguous and a paged (page 16) cache.
  ``fp8 x`` = bf16 time / fp8 time; bar >= 1.7 (the fp8 cache holds half the bytes).
- **sinks**: ``attention_forward`` + ``attention_backward`` (bf16, D 128, causal, B x S = 16k tokens,
  H 16) and ``decode`` ((8, 8k), GQA 32/8) with ``sinks=`` (float32 (Hq,)) against without.
  ``cost`` = time with sinks / time without - 1; bar <= 3%.
- **a value head dim of its own**: ``attention_forward`` + ``attention_backward`` at (D_qk, D_v) =
  (192, 128), (128, 64), (64, 128) against the same call with v of head dim D_qk (the square problem
  the kernels are tuned for), bf16, causal, 16k tokens, H 16. TFLOP/s count the visible work,
  4 * S_visible * (D_qk + D_v) per head for the forward and 2.5x that for the backward;
  ``pair / square`` = TFLOP/s of the pair over those of the square call (issue 53 asks for full
  speed on sm_90a: no fixed number; until the Hopper kernels take the pairs they run on fwd_sm80).
- **decode with a value head dim of its own**: ``cuflash.decode`` on a v_cache of head dim D_v beside a
  k_cache of D_qk, at the same pairs, against the square call (v_cache of D_qk), GQA 32/8, one new
  token, (B, L) = (8, 8k) and (1, 32k), contiguous and paged (page 16). GB/s count the K and V bytes
  the sequences hold (B * L * Hk * (D_qk + D_v) * 2); ``pair / square`` = the pair's GB/s over the
  square call's (decode is bound by those bytes: full speed is ~1).
- **MLA decode**: ``cuflash.decode(q, latent, None, v_head_dim=512)`` on a 576-column latent cache
  (bf16, one kv head, 16 or 128 query heads, one new token, pages of 64), GB/s of the latent bytes the
  sequences hold (B * L * 576 * 2) per call. No bar in the issue beyond "at full speed"; FlashMLA and
  FlashInfer, the peers, are not on the GPU machine.

Every timed call's output is also compared with a float32 CuPy computation of the same attention
(``maxdiff``), a guard against a fast but wrong kernel.

Examples
--------
    python benchmarks/bench_model_features.py
    python benchmarks/bench_model_features.py --only fp8 --repeats 11 --md features.md
"""

from __future__ import annotations

import argparse
import math
import sys

from _harness import Timer, fmt, log, markdown_table, open_gpu, write_results

DECODE_SHAPES = ((1, 32768), (8, 8192), (32, 4096), (1, 131072))
HEADS_Q, HEADS_K, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
TRAIN_TOKENS, TRAIN_HEADS, TRAIN_SEQLEN = 16384, 16, 4096
VALUE_PAIRS = ((192, 128), (128, 64), (64, 128))
PARTS = ("fp8", "sinks", "dv", "dvdecode", "mla")
DV_DECODE_SHAPES = ((8, 8192), (1, 32768))
MLA_SHAPES = ((1, 32768, 16), (32, 4096, 16), (64, 4096, 16), (32, 4096, 128), (64, 4096, 128), (128, 1024, 128))   # (B, L, Hq); issue 53 bars at B 64, 4k
FP8_BAR, SINKS_BAR = 1.7, 0.03

FP8_COLUMNS = ["layout", "B", "L", "bf16 us", "fp8 us", "fp8 x", "maxdiff", "bar"]
SINKS_COLUMNS = ["call", "shape", "plain us", "sinks us", "cost", "maxdiff", "bar"]
DV_COLUMNS = ["D_qk", "D_v", "square us", "pair us", "square TFLOP/s", "pair TFLOP/s", "pair / square", "maxdiff"]
MLA_COLUMNS = ["B", "L", "Hq", "us", "GB/s", "maxdiff"]
DV_DECODE_COLUMNS = ["layout", "B", "L", "D_qk", "D_v", "square GB/s", "pair GB/s", "pair / square", "maxdiff"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="The cost of fp8 caches, sinks and a value head dim of its own, "
                                            "per call as users call.")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts among {', '.join(PARTS)}")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per point, median reported (default 7)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--target-ms", type=float, default=40.0, help="approximate length of one timed run (default 40)")
    p.add_argument("--quick", action="store_true", help="the first decode shape and value pair only, 4k tokens")
    p.add_argument("--md", default=None, help="also write the Markdown tables to this file")
    args = p.parse_args(argv)
    args.only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = set(args.only) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose among {', '.join(PARTS)}")
    return args


# ----------------------------------------------------------------------------- the cells

def fp8_cells(bf16_ms, fp8_ms):
    speedup = bf16_ms / fp8_ms
    return {"bf16 us": 1e3 * bf16_ms, "fp8 us": 1e3 * fp8_ms, "fp8 x": speedup,
            "bar": f">= {FP8_BAR}x {'pass' if speedup >= FP8_BAR else 'FAIL'}"}


def sinks_cells(plain_ms, sinks_ms):
    cost = sinks_ms / plain_ms - 1.0
    return {"plain us": 1e3 * plain_ms, "sinks us": 1e3 * sinks_ms, "cost": cost,
            "bar": f"<= {100 * SINKS_BAR:.0f}% {'pass' if cost <= SINKS_BAR else 'FAIL'}"}


def visible_pairs(seqlen, causal=True):
    """(query, key) pairs a causal (or full) Sq = Sk = seqlen problem computes."""
    return seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen


def train_flops(batch, heads, seqlen, d_qk, d_v):
    """Forward + backward FLOPs of the visible work: forward 2 * pairs * (D_qk + D_v) per head, the
    backward 2.5x the forward (five GEMMs of the forward's two, each the size of one)."""
    forward = 2.0 * batch * heads * visible_pairs(seqlen) * (d_qk + d_v)
    return 3.5 * forward


def dv_cells(d_qk, d_v, square_ms, pair_ms, batch, heads, seqlen):
    square = train_flops(batch, heads, seqlen, d_qk, d_qk) / (square_ms * 1e-3) / 1e12
    pair = train_flops(batch, heads, seqlen, d_qk, d_v) / (pair_ms * 1e-3) / 1e12
    return {"D_qk": d_qk, "D_v": d_v, "square us": 1e3 * square_ms, "pair us": 1e3 * pair_ms,
            "square TFLOP/s": square, "pair TFLOP/s": pair, "pair / square": pair / square}


CELL_FORMATS = {"maxdiff": lambda v: f"{v:.1e}", "cost": lambda v: f"{100 * v:+.1f}%",
                "fp8 x": lambda v: f"{v:.2f}", "pair / square": lambda v: f"{v:.2f}"}


# ----------------------------------------------------------------------------- the GPU side

def quantise_e4m3(cupy, ml_dtypes, x, scale):
    """x / scale as e4m3 bytes (uint8), per kv head (axis 2): what an fp8 cache holds."""
    q = cupy.clip(x.astype(cupy.float32) / scale.reshape(1, 1, -1, 1), -448, 448)
    return cupy.asarray(cupy.asnumpy(q).astype(ml_dtypes.float8_e4m3fn).view("uint8"))


def dequantise(cupy, ml_dtypes, x8, scale):
    f = cupy.asarray(cupy.asnumpy(x8).view(ml_dtypes.float8_e4m3fn).astype("float32"))
    return f * scale.reshape(1, 1, -1, 1)


def naive_attention(cupy, q, k, v, *, causal, sinks=None):
    """float32 attention of q (B, Sq, Hq, Dqk) over k (B, Sk, Hk, Dqk), v (B, Sk, Hk, Dv), bottom-right
    causal, one sequence at a time (bounds the float32 copies): the guard of every table."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = cupy.empty((b, sq, hq, v.shape[-1]), dtype=cupy.float32)
    for i in range(b):
        qf = q[i].astype(cupy.float32).reshape(sq, hk, hq // hk, d)
        s = cupy.einsum("qhgd,khd->hgqk", qf, k[i].astype(cupy.float32)) / math.sqrt(d)
        if causal:
            hidden = cupy.arange(sk)[None, :] > cupy.arange(sq)[:, None] + (sk - sq)
            s = cupy.where(hidden, -cupy.inf, s)
        m = s.max(axis=-1, keepdims=True)
        if sinks is not None:
            m = cupy.maximum(m, sinks.reshape(hk, hq // hk, 1, 1))
        p = cupy.exp(s - m)
        denom = p.sum(axis=-1, keepdims=True)
        if sinks is not None:
            denom += cupy.exp(sinks.reshape(hk, hq // hk, 1, 1) - m)
        o = cupy.einsum("hgqk,khd->qhgd", p / denom, v[i].astype(cupy.float32))
        out[i] = o.reshape(sq, hq, v.shape[-1])
    return out


def maxdiff(cupy, got, want):
    return float(cupy.abs(got.astype(cupy.float32) - want).max())


def paged_pages(cupy, rng, x, page_size):
    """x (B, L, Hk, D) as a pool of pages (in random order) and its (B, L / page_size) table."""
    b, length = x.shape[:2]
    per = length // page_size
    order = rng.permutation(b * per).astype("int32")
    pool = cupy.empty((b * per, page_size) + x.shape[2:], dtype=x.dtype)
    pool[cupy.asarray(order)] = x.reshape((b * per, page_size) + x.shape[2:])
    return pool, cupy.asarray(order.reshape(b, per))


def paged(cupy, rng, x):
    return paged_pages(cupy, rng, x, PAGE_SIZE)


def fp8_decode_problem(cupy, ml_dtypes, rng, batch, length):
    """One new bf16 token against an fp8 cache of ``length`` keys per sequence (GQA 32/8, D 128): q,
    the scales per kv head, the caches as e4m3 bytes and as the same values in bf16, and the float32
    result."""
    bf16 = cupy.dtype(ml_dtypes.bfloat16)
    q = cupy.random.standard_normal((batch, 1, HEADS_Q, HEAD_DIM), dtype=cupy.float32).astype(bf16)
    k_scale = cupy.asarray(rng.uniform(0.01, 0.03, HEADS_K), dtype=cupy.float32)
    v_scale = cupy.asarray(rng.uniform(0.01, 0.03, HEADS_K), dtype=cupy.float32)
    shape = (batch, length, HEADS_K, HEAD_DIM)
    k8 = quantise_e4m3(cupy, ml_dtypes, cupy.random.standard_normal(shape, dtype=cupy.float32), k_scale)
    v8 = quantise_e4m3(cupy, ml_dtypes, cupy.random.standard_normal(shape, dtype=cupy.float32), v_scale)
    k16 = dequantise(cupy, ml_dtypes, k8, k_scale).astype(bf16)
    v16 = dequantise(cupy, ml_dtypes, v8, v_scale).astype(bf16)
    want = naive_attention(cupy, q, k16, v16, causal=True)
    return q, (k_scale, v_scale), (k8, v8), (k16, v16), want


def bench_fp8(cupy, ml_dtypes, np, cuflash, timer, shapes):
    rng = np.random.default_rng(0)
    rows = []
    for batch, length in shapes:
        q, (k_scale, v_scale), (k8, v8), (k16, v16), want = fp8_decode_problem(cupy, ml_dtypes, rng, batch, length)
        for layout in ("contiguous", "paged16"):
            if layout == "contiguous":
                caches16, caches8, table = (k16, v16), (k8, v8), None
            else:
                # One page order for all four pools (the same seed), so one table serves them.
                (kp16, t), (vp16, _), (kp8, _), (vp8, _) = (paged(cupy, np.random.default_rng(1), x)
                                                            for x in (k16, v16, k8, v8))
                caches16, caches8, table = (kp16, vp16), (kp8, vp8), t
            lens = cupy.full((batch,), length, dtype=cupy.int32)
            calls = {
                "bf16": lambda i: cuflash.decode(q, *caches16, cache_seqlens=lens, block_table=table),
                "fp8": lambda i: cuflash.decode(q, *caches8, cache_seqlens=lens, block_table=table,
                                                kv_dtype="float8_e4m3fn", k_scale=k_scale, v_scale=v_scale),
            }
            diff = max(maxdiff(cupy, calls[name](0), want) for name in calls)
            ms = timer.median_ms_each(calls)
            row = dict(layout=layout, B=batch, L=length, maxdiff=diff, **fp8_cells(ms["bf16"], ms["fp8"]))
            rows.append(row)
            log(" ".join(f"{c}={fmt(row.get(c), 3)}" for c in FP8_COLUMNS))
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def bench_sinks(cupy, ml_dtypes, cuflash, timer, seqlen):
    bf16 = cupy.dtype(ml_dtypes.bfloat16)
    rows = []
    batch = max(1, TRAIN_TOKENS // seqlen)
    q, k, v, dout = (cupy.random.standard_normal((batch, seqlen, TRAIN_HEADS, HEAD_DIM), dtype=cupy.float32)
                     .astype(bf16) for _ in range(4))
    sinks = cupy.random.standard_normal(TRAIN_HEADS, dtype=cupy.float32)

    def train(with_sinks):
        extra = dict(sinks=sinks) if with_sinks else {}

        def call(i):
            out, lse, _ = cuflash.attention_forward(q, k, v, causal=True, **extra)
            cuflash.attention_backward(dout, q, k, v, out, lse, causal=True,
                                       **(dict(extra, return_dsinks=True) if with_sinks else {}))
            return out
        return call

    calls = {"plain": train(False), "sinks": train(True)}
    diff = maxdiff(cupy, calls["sinks"](0)[:1], naive_attention(cupy, q[:1], k[:1], v[:1], causal=True, sinks=sinks))
    ms = timer.median_ms_each(calls)
    rows.append(dict(call="forward + backward", shape=f"B{batch} S{seqlen} H{TRAIN_HEADS} D{HEAD_DIM} causal",
                     maxdiff=diff, **sinks_cells(ms["plain"], ms["sinks"])))
    q = k = v = dout = None

    batch, length = 8, 8192
    qd = cupy.random.standard_normal((batch, 1, HEADS_Q, HEAD_DIM), dtype=cupy.float32).astype(bf16)
    kc, vc = (cupy.random.standard_normal((batch, length, HEADS_K, HEAD_DIM), dtype=cupy.float32).astype(bf16)
              for _ in range(2))
    lens = cupy.full((batch,), length, dtype=cupy.int32)
    dsinks = cupy.random.standard_normal(HEADS_Q, dtype=cupy.float32)
    calls = {"plain": lambda i: cuflash.decode(qd, kc, vc, cache_seqlens=lens),
             "sinks": lambda i: cuflash.decode(qd, kc, vc, cache_seqlens=lens, sinks=dsinks)}
    diff = maxdiff(cupy, calls["sinks"](0), naive_attention(cupy, qd, kc, vc, causal=True, sinks=dsinks))
    ms = timer.median_ms_each(calls)
    rows.append(dict(call="decode", shape=f"B{batch} L{length} Hq{HEADS_Q} Hk{HEADS_K} D{HEAD_DIM}", maxdiff=diff,
                     **sinks_cells(ms["plain"], ms["sinks"])))
    for row in rows:
        log(" ".join(f"{c}={fmt(row.get(c), 3)}" for c in SINKS_COLUMNS))
    cupy.get_default_memory_pool().free_all_blocks()
    return rows


def bench_mla(cupy, ml_dtypes, np, cuflash, timer, shapes):
    bf16 = cupy.dtype(ml_dtypes.bfloat16)
    rows = []
    for batch, length, heads_q in shapes:
        latent = cupy.random.standard_normal((batch, length, 1, 576), dtype=cupy.float32).astype(bf16)
        q = cupy.random.standard_normal((batch, 1, heads_q, 576), dtype=cupy.float32).astype(bf16)
        pool, table = paged_pages(cupy, np.random.default_rng(0), latent, 64)
        lens = cupy.full((batch,), length, dtype=cupy.int32)
        call = {"mla": lambda i: cuflash.decode(q, pool, None, v_head_dim=512, cache_seqlens=lens, block_table=table)}
        want = naive_attention(cupy, q, latent, latent[..., :512], causal=True)
        diff = maxdiff(cupy, call["mla"](0), want)
        ms = timer.median_ms_each(call)["mla"]
        row = dict(B=batch, L=length, Hq=heads_q, us=1e3 * ms, maxdiff=diff,
                   **{"GB/s": batch * length * 576 * 2 / (ms * 1e-3) / 1e9})
        rows.append(row)
        log(" ".join(f"{c}={fmt(row.get(c), 3)}" for c in MLA_COLUMNS))
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def bench_value_dims(cupy, ml_dtypes, cuflash, timer, pairs, seqlen):
    bf16 = cupy.dtype(ml_dtypes.bfloat16)
    rows = []
    batch = max(1, TRAIN_TOKENS // seqlen)
    for d_qk, d_v in pairs:
        def rand(d):
            return cupy.random.standard_normal((batch, seqlen, TRAIN_HEADS, d), dtype=cupy.float32).astype(bf16)
        q, k, v_square, v_pair = rand(d_qk), rand(d_qk), rand(d_qk), rand(d_v)

        def train(v):
            dout = rand(v.shape[-1])

            def call(i):
                out, lse, _ = cuflash.attention_forward(q, k, v, causal=True)
                cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
                return out
            return call

        calls = {"square": train(v_square), "pair": train(v_pair)}
        diff = maxdiff(cupy, calls["pair"](0)[:1], naive_attention(cupy, q[:1], k[:1], v_pair[:1], causal=True))
        ms = timer.median_ms_each(calls)
        row = dict(maxdiff=diff, **dv_cells(d_qk, d_v, ms["square"], ms["pair"], batch, TRAIN_HEADS, seqlen))
        rows.append(row)
        log(" ".join(f"{c}={fmt(row.get(c), 3)}" for c in DV_COLUMNS))
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def bench_value_dims_decode(cupy, ml_dtypes, np, cuflash, timer, pairs, shapes):
    bf16 = cupy.dtype(ml_dtypes.bfloat16)
    rows = []
    for batch, length in shapes:
        for d_qk, d_v in pairs:
            def rand(*shape):
                return cupy.random.standard_normal(shape, dtype=cupy.float32).astype(bf16)
            q, k = rand(batch, 1, HEADS_Q, d_qk), rand(batch, length, HEADS_K, d_qk)
            v_square, v_pair = rand(batch, length, HEADS_K, d_qk), rand(batch, length, HEADS_K, d_v)
            want = naive_attention(cupy, q, k, v_pair, causal=True)
            lens = cupy.full((batch,), length, dtype=cupy.int32)
            for layout in ("contiguous", "paged16"):
                if layout == "contiguous":
                    caches, table = (k, v_square, v_pair), None
                else:   # one page order for the three pools (the same seed), so one table serves them
                    (kp, table), (vsp, _), (vpp, _) = (paged(cupy, np.random.default_rng(1), x)
                                                       for x in (k, v_square, v_pair))
                    caches = (kp, vsp, vpp)
                calls = {"square": lambda i: cuflash.decode(q, caches[0], caches[1], cache_seqlens=lens,
                                                             block_table=table),
                         "pair": lambda i: cuflash.decode(q, caches[0], caches[2], cache_seqlens=lens,
                                                           block_table=table)}
                diff = maxdiff(cupy, calls["pair"](0), want)
                ms = timer.median_ms_each(calls)
                rate = {name: batch * length * HEADS_K * (d_qk + (d_qk if name == "square" else d_v)) * 2
                        / (ms[name] * 1e-3) / 1e9 for name in ms}
                row = {"layout": layout, "B": batch, "L": length, "D_qk": d_qk, "D_v": d_v, "maxdiff": diff,
                       "square GB/s": rate["square"], "pair GB/s": rate["pair"],
                       "pair / square": rate["pair"] / rate["square"]}
                rows.append(row)
                log(" ".join(f"{c}={fmt(row.get(c), 3)}" for c in DV_DECODE_COLUMNS))
            cupy.get_default_memory_pool().free_all_blocks()
    return rows


def main(argv=None):
    args = parse_args(argv)

    import cupy
    import ml_dtypes
    import numpy as np

    import cuflash

    gpu = open_gpu(cupy, use_torch=False)
    if gpu is None:
        return 1
    timer = Timer(cupy, args.repeats, args.warmup, args.target_ms, max_calls=1000)
    shapes = DECODE_SHAPES[:1] if args.quick else DECODE_SHAPES
    seqlen = 4096 if not args.quick else 1024
    header = (f"**{gpu.device_name}** ({gpu.versions}); per call as users call (CuPy arrays, outputs allocated per "
              f"call), median of {args.repeats} runs, contenders in random-order turns.")
    log(header)
    tables = []
    with gpu.stream:
        if "fp8" in args.only:
            rows = bench_fp8(cupy, ml_dtypes, np, cuflash, timer, shapes)
            tables.append(("fp8 caches in decode (bf16 q, GQA 32/8, D 128, one new token)", rows, FP8_COLUMNS))
        if "sinks" in args.only:
            rows = bench_sinks(cupy, ml_dtypes, cuflash, timer, seqlen)
            tables.append(("attention sinks", rows, SINKS_COLUMNS))
        if "dv" in args.only:
            rows = bench_value_dims(cupy, ml_dtypes, cuflash, timer, VALUE_PAIRS[:1] if args.quick else VALUE_PAIRS,
                                    seqlen)
            tables.append((f"a value head dim of its own (bf16, causal, {TRAIN_TOKENS} tokens, H {TRAIN_HEADS}, "
                           "forward + backward)", rows, DV_COLUMNS))
        if "dvdecode" in args.only:
            rows = bench_value_dims_decode(cupy, ml_dtypes, np, cuflash, timer,
                                           VALUE_PAIRS[:1] if args.quick else VALUE_PAIRS,
                                           DV_DECODE_SHAPES[:1] if args.quick else DV_DECODE_SHAPES)
            tables.append(("decode with a value head dim of its own (bf16 q, GQA 32/8, one new token)", rows,
                           DV_DECODE_COLUMNS))
        if "mla" in args.only:
            rows = bench_mla(cupy, ml_dtypes, np, cuflash, timer, MLA_SHAPES[:1] if args.quick else MLA_SHAPES)
            tables.append(("MLA decode (bf16 latent rows of 576, v_head_dim 512, one new token, pages of 64)", rows,
                           MLA_COLUMNS))
    text = "\n\n".join(markdown_table(rows, f"{header}\n\n{title}", columns, CELL_FORMATS)
                       for title, rows, columns in tables)
    if args.md:
        write_results([], text, [], None, args.md)
    print()
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
