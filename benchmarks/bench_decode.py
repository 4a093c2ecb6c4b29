"""Decode benchmark: cuflash.decode's achieved memory bandwidth against the device's copy bandwidth.

Decode (one new token per sequence against a long KV cache) reads every cached K/V byte once and
does little arithmetic per byte: its ceiling is memory bandwidth. Shapes (issue #4): bf16,
Hq = 32, Hk = 8 (GQA 4), D = 128, Sq = 1, (B, L) in (1, 32k), (8, 8k), (32, 4k), (1, 128k), with a
contiguous cache (B, L, Hk, D) and a paged one (page 16, pages in random order).

Columns:

- ``cuflash us`` / ``GB/s`` / ``%copy``: the decode kernels alone (index check, split-KV partial
  kernel, merge): a ``cuflash.plan`` of the call captured once in a CUDA graph and replayed, so the
  GPU time is measured, not Python's; GB/s = K+V bytes read (2 * B * L * Hk * D * 2) / time, and
  %copy its fraction of the measured device-to-device copy bandwidth (``cupy.copyto`` of 1 GiB,
  counting read + write bytes);
- ``call us`` / ``call GB/s``: the whole ``cuflash.decode`` call as users make it (memo lookup,
  allocation, launches), back to back, events around each call, with ``cache_seqlens`` /
  ``block_table`` on the GPU (never read back); GB/s counts the same K+V bytes;
- ``flash`` / ``cudnn``: torch SDPA with the FLASH_ATTENTION / CUDNN_ATTENTION backend on the
  contiguous cache (zero-copy BHSD views of the same memory, ``enable_gqa=True``; if the backend
  refuses GQA, K/V are expanded to Hq heads beforehand and the column is marked ``*``), same q.
  They read the full cache; their GB/s counts the same K+V bytes;
- ``fa4``: FlashAttention-4 per call on this row's cache, as its users call it, on (B, S, H, D)
  torch views of the same memory, no ``out=``: ``flash_attn_func(q, k, v)`` on the contiguous
  cache, ``flash_attn_varlen_func(q, k_pages, v_pages, seqused_k=lengths, page_table=table)`` on
  the paged one (its paged-KV entry; the table and lengths stay on the GPU). FA4 4.0.0b36 has no
  split-KV on sm90 (its interface asserts "SplitKV not supported on SM 9.0"), so on H100/H200 it
  runs with its default one split, one CTA per (sequence, KV head): few CTAs at small B. Left out,
  with one line saying so, where ``flash_attn.cute`` does not import (benchmarks/fa4_device.md) or
  with ``--no-fa4``; ``call/fa4``: cuflash's ``call GB/s`` over FA4's (> 1 is faster than FA4);
- ``splits``: the split count the heuristic chose; ``maxdiff``: max |cuflash - float32 CuPy
  attention| on the same inputs, a guard against a fast but wrong kernel;
- ``bar``: the issue's targets, >= 80% of copy bandwidth at (8, 8k) and (1, 128k) contiguous,
  >= 70% paged (page 16).

Timing: CUDA events around N back-to-back calls (N sized so that a run takes about
``--target-ms``), after warm-up (which also compiles), median of ``--repeats`` runs. Per row, the
graph replay, the cuflash call and the peers take settled turns in a new random order each repeat
(``Timer.median_ms_each``), after one call each (a contender that cannot run is reported and left
out). The caches (128-512 MiB) are larger than L2, so no input rotation is needed.

Output: progress lines, then the Markdown table on stdout (last); ``--csv`` and ``--md`` write
files, ``--png`` a plot (when matplotlib is importable): one panel per cache layout, per (B, L) the
GB/s per call (``call GB/s``) of cuflash beside SDPA flash and cuDNN (theirs on the contiguous
cache in both panels) and FA4 (on the panel's cache), with the measured copy bandwidth as a dashed
line.

Examples
--------
    python benchmarks/bench_decode.py
    python benchmarks/bench_decode.py --repeats 11 --md decode.md --csv decode.csv --png decode.png
"""

from __future__ import annotations

import argparse
import math
import sys

from _harness import (Timer, copy_bandwidth, fa4_out, fmt, log, markdown_table, missing, open_fa4, open_gpu,
                      write_results)

SHAPES = ((1, 32768), (8, 8192), (32, 4096), (1, 131072))
HEADS_Q, HEADS_K, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
BARS = {("contiguous", 8, 8192): 0.80, ("contiguous", 1, 131072): 0.80,
        **{("paged16", b, s): 0.70 for b, s in SHAPES}}

PEERS = ("flash", "cudnn", "fa4")
COLUMNS = ["layout", "B", "L", "splits", "cuflash us", "GB/s", "%copy", "call us", "call GB/s", "flash us",
           "flash GB/s", "cudnn us", "cudnn GB/s", "fa4 us", "fa4 GB/s", "call/fa4", "maxdiff", "bar"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="cuflash decode bandwidth against copy bandwidth, torch SDPA and "
                                            "FlashAttention-4.")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per point, median reported (default 7)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--target-ms", type=float, default=50.0, help="approximate length of one timed run (default 50)")
    p.add_argument("--shapes", default=None, help="B:L pairs, e.g. 1:32768,8:8192 (default: the issue's four)")
    p.add_argument("--layouts", default="contiguous,paged16", help="contiguous and/or paged16")
    p.add_argument("--no-torch", action="store_true", help="skip torch SDPA (and FA4, which needs torch) even if "
                                                           "importable")
    p.add_argument("--no-fa4", action="store_true", help="do not time FlashAttention-4 even if importable")
    p.add_argument("--csv", default=None, help="also write the rows as CSV")
    p.add_argument("--md", default=None, help="also write the Markdown table to this file")
    p.add_argument("--png", default=None, help="also write a plot of GB/s per call to this path (needs matplotlib)")
    args = p.parse_args(argv)
    if args.shapes:
        args.shapes = [tuple(int(x) for x in pair.split(":")) for pair in args.shapes.split(",") if pair]
    else:
        args.shapes = list(SHAPES)
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    return args


def naive_decode(cupy, q, k, v):
    """float32 attention of q (B, 1, Hq, D) over a contiguous cache (B, L, Hk, D): the correctness guard."""
    b, _, hq, d = q.shape
    hk = k.shape[2]
    qf = q.astype(cupy.float32).reshape(b, hk, hq // hk, d)
    out = cupy.empty((b, hk, hq // hk, d), dtype=cupy.float32)
    for i in range(b):   # one sequence at a time bounds the float32 copies
        kf, vf = k[i].astype(cupy.float32), v[i].astype(cupy.float32)          # (L, Hk, D)
        s = cupy.einsum("hgd,lhd->hgl", qf[i], kf) / math.sqrt(d)
        s -= s.max(axis=-1, keepdims=True)
        p = cupy.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        out[i] = cupy.einsum("hgl,lhd->hgd", p, vf)
    return out.reshape(b, 1, hq, d)


# Cells: maxdiff in scientific notation, %copy as a percentage, other floats to one decimal.
CELL_FORMATS = {"maxdiff": lambda v: f"{v:.1e}", "%copy": lambda v: f"{100 * v:.0f}%", "call/fa4": lambda v: f"{v:.2f}"}


def main(argv=None):
    args = parse_args(argv)

    import cupy
    import ml_dtypes
    import numpy as np

    import cuflash

    gpu = open_gpu(cupy, not args.no_torch)
    if gpu is None:
        return 1
    torch, F, sdpa_kernel, SDPBackend = gpu.torch, gpu.F, gpu.sdpa_kernel, gpu.SDPBackend
    fa4 = open_fa4(torch, not args.no_fa4)
    versions = gpu.versions + (f", {fa4.label}" if fa4 is not None else "")
    bf16 = cupy.dtype(ml_dtypes.bfloat16)
    rows = []
    with gpu.stream:
        # Calls take the input-set index; decode's calls reuse one set (its cache is the input).
        timer = Timer(cupy, args.repeats, args.warmup, args.target_ms, max_calls=1000)
        copy_gbs = copy_bandwidth(cupy, timer)
        cupy.get_default_memory_pool().free_all_blocks()
        header = (f"**{gpu.device_name}** ({versions}); device copy bandwidth = {copy_gbs:.0f} GB/s (read + write). "
                  f"Decode bf16, Sq = 1, Hq = {HEADS_Q}, Hk = {HEADS_K}, D = {HEAD_DIM}; median of {args.repeats} "
                  f"runs, contenders in random-order turns.")
        log(header)
        rng = np.random.default_rng(0)
        for batch, seqlen in args.shapes:
            kv_bytes = kv_bytes_of(batch, seqlen)
            q = cupy.random.standard_normal((batch, 1, HEADS_Q, HEAD_DIM), dtype=cupy.float32).astype(bf16)
            k = cupy.random.standard_normal((batch, seqlen, HEADS_K, HEAD_DIM), dtype=cupy.float32).astype(bf16)
            v = cupy.random.standard_normal((batch, seqlen, HEADS_K, HEAD_DIM), dtype=cupy.float32).astype(bf16)
            reference = naive_decode(cupy, q, k, v)
            out = cupy.empty_like(q)
            for layout in args.layouts:
                if layout == "contiguous":
                    kc, vc, table, lens = k, v, None, None
                elif layout == "paged16":
                    kc, vc, table, lens = paged_cache(cupy, rng, k, v, bf16)
                else:
                    raise SystemExit(f"unknown layout {layout!r}")
                where = f"{layout} B={batch} L={seqlen}"
                peers = peer_contenders(torch, F, sdpa_kernel, SDPBackend, fa4, q, k, v, layout, kc, vc, table, lens)
                ms, marks, measured = bench_layout(cupy, cuflash, timer, peers, q, kc, vc, table, lens, out,
                                                   reference, where)
                row = dict(layout=layout, B=batch, L=seqlen, **measured,
                           **decode_cells(ms, marks, kv_bytes, copy_gbs, BARS.get((layout, batch, seqlen))))
                rows.append(row)
                log(" ".join(f"{c}={fmt(row.get(c), 3)}" for c in COLUMNS if c in row))
                peers = kc = vc = None   # drop the paged copies (and any expanded K/V) before the next layout
            q = k = v = out = reference = None
            cupy.get_default_memory_pool().free_all_blocks()
            if torch is not None:
                torch.cuda.empty_cache()

    table_md = markdown_table(rows, header, COLUMNS, CELL_FORMATS)
    write_results(rows, table_md, COLUMNS, args.csv, args.md)
    if args.png:
        write_png(rows, args.png, gpu.device_name, copy_gbs)
    print()
    print(table_md, flush=True)
    return 0


def kv_bytes_of(batch, seqlen):
    """K+V bytes a decode step reads: 2 * B * L * Hk * D * 2 (bf16)."""
    return 2 * batch * seqlen * HEADS_K * HEAD_DIM * 2


def write_png(rows, path, device_name, copy_gbs):
    """One panel per cache layout: per (B, L), GB/s per call (K+V bytes over ``call us``) of cuflash
    beside SDPA flash and cuDNN (theirs on the contiguous cache in every panel) and FA4 (on the
    panel's cache), higher is better; the dashed line is the measured device copy bandwidth."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not importable: no plot written")
        return
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    if not layouts:
        log("no rows: no plot written")
        return
    nan = float("nan")

    def gbs(row, column):   # GB/s from a time column, NaN where that contender did not run
        us = row.get(column)
        return nan if missing(us) else kv_bytes_of(row["B"], row["L"]) / (us * 1e-6) / 1e9

    bars = [("cuflash.decode", "call us", "tab:blue"), ("SDPA flash", "flash us", "tab:green"),
            ("SDPA cuDNN", "cudnn us", "tab:red"), ("FA4", "fa4 us", "tab:purple")]
    width = 0.8 / len(bars)
    measured = [gbs(r, column) for r in rows for _, column, _ in bars]
    top = max([copy_gbs] + [y for y in measured if not math.isnan(y)])
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4.2), squeeze=False, sharey=True)
    for ax, layout in zip(axes.flat, layouts):
        sel = [r for r in rows if r["layout"] == layout]
        xs = range(len(sel))
        for j, (label, column, color) in enumerate(bars):
            # "*": that backend refused GQA, so K/V were expanded to Hq heads before timing
            expanded = any(str(r.get(column.replace(" us", " GB/s"), "")).endswith("*") for r in sel)
            ys = [gbs(r, column) for r in sel]
            if all(math.isnan(y) for y in ys):   # not run (no torch, or the backend refused every shape)
                continue
            ax.bar([x + (j - (len(bars) - 1) / 2) * width for x in xs], ys, width, color=color,
                   label=label + (" *K/V expanded" if expanded else ""))
        ax.axhline(copy_gbs, color="gray", linestyle="--", linewidth=1,
                   label=f"device copy {copy_gbs:.0f} GB/s (read + write)")
        ax.set_xticks(list(xs), [f"B{r['B']} L{r['L'] // 1024}k" if r["L"] % 1024 == 0 else f"B{r['B']} L{r['L']}"
                                 for r in sel])
        ax.set_ylabel("K+V GB/s per call (higher is better)")
        ax.set_title("decode, contiguous cache" if layout == "contiguous" else
                     f"decode, paged cache (page {PAGE_SIZE}); SDPA on the contiguous one")
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_ylim(0, 1.3 * top)   # room above the bars for the legend (shared by the panels)
        ax.legend(fontsize="small", loc="upper left", ncol=2)
    fig.suptitle(f"{device_name}: bf16, Sq 1, Hq {HEADS_Q}, Hk {HEADS_K}, D {HEAD_DIM}; per call, host included")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"plot written to {path}")


def paged_cache(cupy, rng, k, v, bf16):
    """(k pages, v pages, block table, lengths) of the contiguous cache (B, L, Hk, D) in pages of 16:
    page p of sequence b holds its keys p*16 .. p*16+15, at a random place in the pool."""
    batch, seqlen = k.shape[:2]
    pages = batch * seqlen // PAGE_SIZE
    order = rng.permutation(pages).astype("int32")
    table = cupy.asarray(order.reshape(batch, seqlen // PAGE_SIZE))
    kc = cupy.empty((pages, PAGE_SIZE, HEADS_K, HEAD_DIM), dtype=bf16)
    vc = cupy.empty_like(kc)
    # (scattered as uint16 bits: CuPy's bfloat16 is ml_dtypes', best kept to plain copies)
    kc.view(cupy.uint16)[table] = k.view(cupy.uint16).reshape(batch, -1, PAGE_SIZE, HEADS_K, HEAD_DIM)
    vc.view(cupy.uint16)[table] = v.view(cupy.uint16).reshape(batch, -1, PAGE_SIZE, HEADS_K, HEAD_DIM)
    return kc, vc, table, cupy.full(batch, seqlen, dtype=cupy.int32)


def peer_contenders(torch, F, sdpa_kernel, SDPBackend, fa4, q, k, v, layout, kc, vc, table, lens):
    """{name: (call, mark)} of one row's peers, each a call of no arguments as its users make it:
    SDPA flash and cuDNN on the contiguous cache ``k``/``v`` whatever the layout (BHSD views,
    ``enable_gqa=True``; where a backend refuses GQA, K/V expanded to Hq heads beforehand and the
    mark ``*``), and FA4 on this layout's cache (``kc``/``vc``, with ``table`` and ``lens`` when
    paged). Nothing without torch."""
    peers = {}
    if torch is None:
        return peers
    tq = torch.from_dlpack(q).transpose(1, 2)            # (B, Hq, 1, D)
    tk = torch.from_dlpack(k).transpose(1, 2)            # (B, Hk, L, D), a view of the cache
    tv = torch.from_dlpack(v).transpose(1, 2)
    for impl, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run_gqa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

        try:
            run_gqa()
            peers[impl] = (run_gqa, "")
            continue
        except Exception:
            pass
        group = tq.shape[1] // tk.shape[1]
        try:
            ek, ev = tk.repeat_interleave(group, dim=1), tv.repeat_interleave(group, dim=1)
        except Exception as e:
            log(f"torch {impl}: cannot expand K/V ({type(e).__name__}: {e})")
            continue

        def run_expanded(backend=backend, ek=ek, ev=ev):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(tq, ek, ev)

        peers[impl] = (run_expanded, "*")
    if fa4 is not None:
        # (B, S, H, D) views of the same memory, as FA4 takes them; its own default num_splits (the
        # module docstring says why).
        fq = torch.from_dlpack(q)                        # (B, 1, Hq, D)
        if layout == "contiguous":
            fk, fv = torch.from_dlpack(kc), torch.from_dlpack(vc)        # (B, L, Hk, D)

            def run_fa4():
                return fa4_out(fa4.flash_attn_func(fq, fk, fv))
        else:
            # FA4's paged KV: pages (num_pages, page_size, Hk, D), page_table (B, pages per sequence)
            # int32, seqused_k (B,) int32; only flash_attn_varlen_func takes them.
            fk, fv, ft, fl = (torch.from_dlpack(x) for x in (kc, vc, table, lens))

            def run_fa4():
                return fa4_out(fa4.flash_attn_varlen_func(fq, fk, fv, seqused_k=fl, page_table=ft))
        peers["fa4"] = (run_fa4, "")
    return peers


def bench_layout(cupy, cuflash, timer, peers, q, kc, vc, table, lens, out, reference, where):
    """Times one row: cuflash's kernels alone (a ``cuflash.plan`` of the call captured in a CUDA graph
    and replayed, ``graph``), the whole ``cuflash.decode`` call (``call``) and the peers, in settled
    random-order turns, after one call each (one that cannot run is reported and left out).

    Returns ({contender: ms per call}, {peer: mark}, {"splits", "maxdiff"} where known); the output
    checked against ``reference`` is the graph's (the call's without a graph)."""
    contenders, measured, graph = {}, {}, None
    stream = cupy.cuda.get_current_stream()
    try:
        planned = cuflash.plan(cuflash.decode, q, kc, vc, cache_seqlens=lens, block_table=table, out=out)
        measured["splits"] = planned.plan.info["num_splits"]
        cupy.cuda.Device().synchronize()
        capture = cupy.cuda.Stream(non_blocking=True)   # the default stream cannot capture
        with capture:
            planned(q, kc, vc, cache_seqlens=lens, block_table=table, out=out)   # makes its workspace
            capture.begin_capture()
            planned(q, kc, vc, cache_seqlens=lens, block_table=table, out=out)
            graph = capture.end_capture()
        capture.synchronize()
        contenders["graph"] = lambda i: graph.launch(stream)
    except Exception as e:  # report and go on: the call and the peers are still timed
        log(f"cuflash plan / graph failed at {where}: {type(e).__name__}: {e}")
    # The plain call allocates its output, as its users call it; the graph's output is the buffer it
    # was captured with, as a serving loop's graph keeps one.
    contenders["call"] = lambda i: cuflash.decode(q, kc, vc, cache_seqlens=lens, block_table=table)
    for name, (fn, _) in peers.items():
        contenders[name] = lambda i, fn=fn: fn()
    for name, fn in list(contenders.items()):
        try:
            fn(0)
        except Exception as e:  # one broken contender should not hide the others
            log(f"{name} failed at {where}: {type(e).__name__}: {e}")
            del contenders[name]
    ms = timer.median_ms_each(contenders) if contenders else {}
    checked = next((name for name in ("graph", "call") if name in ms), None)
    if checked is not None:
        got = contenders[checked](0)
        got = out if checked == "graph" else got
        measured["maxdiff"] = float(cupy.abs(got.astype(cupy.float32) - reference).max())
    return ms, {name: mark for name, (_, mark) in peers.items() if name in ms}, measured


def decode_cells(ms, marks, kv_bytes, copy_gbs, bar=None):
    """A row's time and bandwidth cells from {contender: ms per call}: ``graph`` -> cuflash us / GB/s /
    %copy, ``call`` -> call us / call GB/s, each peer -> "<peer> us" / "<peer> GB/s" (with its mark),
    ``call/fa4`` (speed over speed) and the bar where the row has one."""
    def gbs(t):
        return kv_bytes / (t * 1e-3) / 1e9

    cells = {}
    if "graph" in ms:
        cells.update({"cuflash us": ms["graph"] * 1e3, "GB/s": gbs(ms["graph"]), "%copy": gbs(ms["graph"]) / copy_gbs})
    if "call" in ms:
        cells.update({"call us": ms["call"] * 1e3, "call GB/s": gbs(ms["call"])})
    for impl in PEERS:
        if impl in ms:
            cells[f"{impl} us"] = ms[impl] * 1e3
            cells[f"{impl} GB/s"] = f"{gbs(ms[impl]):.0f}" + marks.get(impl, "")
    if "call" in ms and "fa4" in ms:
        cells["call/fa4"] = ms["fa4"] / ms["call"]
    if bar is not None and "%copy" in cells:
        cells["bar"] = f">={100 * bar:.0f}% " + ("PASS" if cells["%copy"] >= bar else "FAIL")
    return cells


if __name__ == "__main__":
    sys.exit(main())
