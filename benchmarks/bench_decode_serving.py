"""Decode as serving engines run it: every contender captured once in a CUDA graph and replayed.

A serving loop (vLLM, SGLang, TensorRT-LLM) captures its decode step in a CUDA graph per batch size
and replays it for every new token, so the host never shows; what counts is the GPU time of the
replay. This script does the same for each contender, from torch tensors (issue 51, item 3):

- batches of uniform lengths, (B, L) in (1, 32k), (8, 8k), (32, 4k), (1, 128k), and ragged ones,
  lengths drawn per sequence: 64 in 512..4k, 128 in 256..2k, 256 in 128..1k (1..256 sequences);
- caches contiguous (B, L_max, Hk, D) and paged, pages of 16 and 64 in random order;
- D 64, 128, 256, GQA 32/8 (Hq / Hk), bf16, one new token per sequence; ``cache_seqlens`` and
  ``block_table`` stay on the GPU (the split count is chosen without reading them).

Contenders, each ``torch.cuda.graph``-captured after a warm-up and replayed:

- ``cuflash``: ``ct.decode(q, k_cache, v_cache, cache_seqlens=, block_table=, out=)``, split count
  by cuflash's heuristic (``splits`` column); with ``--sweep`` also every fixed split count of
  ``SWEEP`` (``best`` column: the fastest and its count), which shows what the heuristic leaves;
- ``cudnn`` / ``flash``: torch SDPA on the contiguous cache (BHSD views, ``enable_gqa=True``), only
  where every sequence has the same length (SDPA has no per-sequence lengths);
- ``fa4``: FlashAttention-4 as its users call it: ``flash_attn_varlen_func(q, k, v, seqused_k=,
  page_table=)`` on a paged cache, ``flash_attn_func`` on a contiguous uniform one,
  ``flash_attn_varlen_func(q, k, v, seqused_k=)`` on a contiguous ragged one (where FA4 refuses a
  call, the cell says so). FA4 4.0.0b36 has no split-KV on sm90 (benchmarks/bench_decode.py).

Figures: GPU us per replay (CUDA events around back-to-back replays, median of ``--repeats`` runs,
contenders in settled random-order turns, ``Timer.median_ms_each``), GB/s of the K+V bytes the
sequences hold (what a decode must read), its fraction of the measured copy bandwidth, and
``x cudnn`` / ``x fa4`` = their time over cuflash's (> 1: cuflash faster). ``maxdiff``: cuflash's
output against FA4's or SDPA's where one ran.

Run on a GPU machine: ``PYTHONPATH=$PWD python benchmarks/bench_decode_serving.py [--quick]
[--sweep] [--md F] [--csv F]``; FA4 columns need it carried (benchmarks/fa4_device.md).
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from _harness import Timer, copy_bandwidth, fa4_out, fmt, log, markdown_table, open_fa4, open_gpu, write_results

HEADS_Q, HEADS_K = 32, 8
HEAD_DIMS = (64, 128, 256)
UNIFORM = ((1, 32768), (8, 8192), (32, 4096), (1, 131072))
RAGGED = ((64, 512, 4096), (128, 256, 2048), (256, 128, 1024))
LAYOUTS = ("contiguous", 16, 64)   # page sizes after the contiguous cache
SWEEP = (1, 2, 4, 8, 16, 32, 64)

COLUMNS = ["D", "cache", "batch", "KV MB", "splits", "cuflash us", "GB/s", "%copy", "best", "cudnn us", "flash us",
           "fa4 us", "x cudnn", "x fa4", "maxdiff"]


def batches(quick: bool = False):
    """(name, B, lo, hi) of the batches: lengths drawn uniformly in [lo, hi] per sequence (lo == hi:
    uniform)."""
    uniform = [(f"({b}, {length // 1024}k)", b, length, length) for b, length in UNIFORM]
    ragged = [(f"({b}, ragged {lo}..{hi})", b, lo, hi) for b, lo, hi in RAGGED]
    return (uniform[1:2] + ragged[:1]) if quick else uniform + ragged


def draw_lengths(rng, batch: int, lo: int, hi: int) -> np.ndarray:
    """int32 (B,) lengths in [lo, hi] (all ``lo`` when lo == hi)."""
    if lo == hi:
        return np.full(batch, lo, dtype=np.int32)
    return rng.integers(lo, hi + 1, size=batch).astype(np.int32)


def page_table(rng, lengths: np.ndarray, page_size: int):
    """(table (B, max_pages) int32, num_pages): each sequence's pages at random places in one pool;
    entries past a sequence's last page are -1 (never read)."""
    pages = -(-lengths.astype(np.int64) // page_size)
    max_pages = int(pages.max(initial=0))
    num_pages = int(pages.sum())
    order = rng.permutation(num_pages).astype(np.int32)
    table = np.full((lengths.size, max(max_pages, 1)), -1, dtype=np.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used:used + n]
        used += int(n)
    return table, num_pages


def kv_bytes(lengths: np.ndarray, heads_k: int, head_dim: int, itemsize: int = 2) -> int:
    """K and V bytes the sequences hold: what one decode step must read."""
    return 2 * int(lengths.astype(np.int64).sum()) * heads_k * head_dim * itemsize


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="D 128, two batches, fewer repeats")
    p.add_argument("--sweep", action="store_true", help=f"also every fixed split count of {SWEEP}")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--target-ms", type=float, default=20.0)
    p.add_argument("--no-fa4", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--md")
    p.add_argument("--csv")
    return p.parse_args(argv)


def captured(torch, fn):
    """``fn`` warmed up on a side stream, captured in a CUDA graph; returns a replay of no
    arguments and the graph's output (the tensors ``fn`` returned during capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return (lambda i: graph.replay()), out


def row_problem(torch, rng, d, layout, batch, lo, hi):
    """Torch tensors of one row: q, the cache in ``layout``, lengths, table (None when contiguous),
    the contiguous cache too (SDPA reads it when lengths are uniform)."""
    lengths = draw_lengths(rng, batch, lo, hi)
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(batch, 1, HEADS_Q, d, device=dev, dtype=bf16)
    capacity = int(lengths.max())
    k = torch.randn(batch, capacity, HEADS_K, d, device=dev, dtype=bf16)
    v = torch.randn(batch, capacity, HEADS_K, d, device=dev, dtype=bf16)
    lens = torch.from_numpy(lengths).to(dev)
    if layout == "contiguous":
        return dict(q=q, kc=k, vc=v, lens=lens, table=None, k=k, v=v, lengths=lengths)
    table, num_pages = page_table(rng, lengths, layout)
    kc = torch.empty(num_pages, layout, HEADS_K, d, device=dev, dtype=bf16)
    vc = torch.empty_like(kc)
    for b, n in enumerate(lengths):   # copy each sequence's keys into its pages
        pages = -(-int(n) // layout)
        rows = torch.from_numpy(table[b, :pages].astype(np.int64)).to(dev)
        padded = pages * layout
        src_k = torch.zeros(padded, HEADS_K, d, device=dev, dtype=bf16)
        src_v = torch.zeros_like(src_k)
        src_k[:n], src_v[:n] = k[b, :n], v[b, :n]
        kc[rows] = src_k.view(pages, layout, HEADS_K, d)
        vc[rows] = src_v.view(pages, layout, HEADS_K, d)
    return dict(q=q, kc=kc, vc=vc, lens=lens, table=torch.from_numpy(table).to(dev), k=k, v=v, lengths=lengths)


def contenders(gpu, ct, fa4, p, sweep):
    """{name: (fn of no arguments returning the output)} of one row."""
    torch = gpu.torch
    out = torch.empty_like(p["q"])
    calls = {"cuflash": lambda: ct.decode(p["q"], p["kc"], p["vc"], cache_seqlens=p["lens"],
                                          block_table=p["table"], out=out)}
    if sweep:
        for n in SWEEP:
            own = torch.empty_like(p["q"])
            calls[f"splits={n}"] = (lambda n=n, own=own: ct.decode(
                p["q"], p["kc"], p["vc"], cache_seqlens=p["lens"], block_table=p["table"], num_splits=n, out=own))
    uniform = bool((p["lengths"] == p["lengths"][0]).all())
    if uniform and p["table"] is None:
        tq, tk, tv = (x.transpose(1, 2) for x in (p["q"], p["k"], p["v"]))
        for name, backend in (("cudnn", gpu.SDPBackend.CUDNN_ATTENTION), ("flash", gpu.SDPBackend.FLASH_ATTENTION)):
            def sdpa(backend=backend):
                with gpu.sdpa_kernel(backend):
                    return gpu.F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True).transpose(1, 2)
            calls[name] = sdpa
    if fa4 is not None:
        if p["table"] is not None:
            calls["fa4"] = lambda: fa4_out(fa4.flash_attn_varlen_func(p["q"], p["kc"], p["vc"], seqused_k=p["lens"],
                                                                      page_table=p["table"]))
        elif uniform:
            calls["fa4"] = lambda: fa4_out(fa4.flash_attn_func(p["q"], p["kc"], p["vc"]))
        else:
            calls["fa4"] = lambda: fa4_out(fa4.flash_attn_varlen_func(p["q"], p["kc"], p["vc"], seqused_k=p["lens"]))
    return calls


def chosen_splits(cuflash, p):
    """The split count cuflash's heuristic picks for the row's call (its plan; nothing launched)."""
    try:
        planned = cuflash.plan(cuflash.decode, p["q"], p["kc"], p["vc"], cache_seqlens=p["lens"],
                               block_table=p["table"])
    except Exception as e:   # reported in the table as a missing cell
        log(f"plan failed: {type(e).__name__}: {e}")
        return None
    return planned.plan.info["num_splits"]


def bench_row(gpu, ct, fa4, timer, p, sweep):
    """{contender: ms per replay}, outputs, and the contenders that could not be captured."""
    replays, outputs, refused = {}, {}, {}
    for name, fn in contenders(gpu, ct, fa4, p, sweep).items():
        try:
            replays[name], outputs[name] = captured(gpu.torch, fn)
        except Exception as e:   # a peer that refuses the call or the capture: reported, left out
            refused[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return timer.median_ms_each(replays), outputs, refused


def main(argv=None):
    args = parse_args(argv)
    import cupy

    gpu = open_gpu(cupy, use_torch=True)
    if gpu is None or gpu.torch is None:
        log("needs a GPU and torch")
        return
    import cuflash
    import cuflash.interop.torch as ct

    fa4 = open_fa4(gpu.torch, wanted=not args.no_fa4)
    rng = np.random.default_rng(args.seed)
    repeats = 3 if args.quick else args.repeats
    timer = Timer(cupy, repeats, warmup=2, target_ms=args.target_ms)
    rows = []
    with gpu.stream:
        copy_gbs = copy_bandwidth(cupy, timer)
        for d in ((128,) if args.quick else HEAD_DIMS):
            for layout in LAYOUTS:
                for name, batch, lo, hi in batches(args.quick):
                    p = row_problem(gpu.torch, rng, d, layout, batch, lo, hi)
                    where = f"D{d} {layout} {name}"
                    ms, outputs, refused = bench_row(gpu, ct, fa4, timer, p, args.sweep)
                    for who, why in refused.items():
                        log(f"{where}: {who} left out ({why})")
                    mb = kv_bytes(p["lengths"], HEADS_K, d)
                    gbs = (lambda t: mb / (t * 1e-3) / 1e9) if mb else (lambda t: math.nan)
                    row = {"D": d, "cache": layout if layout == "contiguous" else f"paged {layout}", "batch": name,
                           "KV MB": mb / 2**20}
                    ours = ms.get("cuflash")
                    if ours:
                        row.update({"cuflash us": ours * 1e3, "GB/s": gbs(ours), "%copy": gbs(ours) / copy_gbs})
                        row["splits"] = chosen_splits(cuflash, p)
                    swept = {n: ms[f"splits={n}"] for n in SWEEP if f"splits={n}" in ms}
                    if swept:
                        n_best = min(swept, key=swept.get)
                        row["best"] = f"{swept[n_best] * 1e3:.1f} (s={n_best})"
                    for peer in ("cudnn", "flash", "fa4"):
                        if peer in ms:
                            row[f"{peer} us"] = ms[peer] * 1e3
                            if ours and peer in ("cudnn", "fa4"):
                                row[f"x {peer}"] = ms[peer] / ours
                    peer_out = next((outputs[n] for n in ("fa4", "cudnn", "flash") if n in outputs), None)
                    if peer_out is not None and "cuflash" in outputs:
                        row["maxdiff"] = float((outputs["cuflash"].float() - peer_out.float()).abs().max())
                    rows.append(row)
                    log(f"{where}: " + ", ".join(f"{k} {fmt(v)}" for k, v in row.items() if k not in ("D", "cache",
                                                                                                   "batch")))
    header = (f"**{gpu.device_name}** ({gpu.versions}); decode replayed from CUDA graphs, GQA {HEADS_Q}/{HEADS_K}, "
              f"bf16, one new token; copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    table = markdown_table(rows, header, COLUMNS, formats={"%copy": lambda x: f"{x:.0%}", "KV MB": lambda x: f"{x:.0f}",
                                                           "x cudnn": lambda x: f"{x:.2f}", "x fa4": lambda x: f"{x:.2f}",
                                                           "maxdiff": lambda x: f"{x:.1e}"})
    write_results(rows, table, COLUMNS, csv_path=args.csv, md_path=args.md)
    print(table)


if __name__ == "__main__":
    main()
