"""Chunked prefill against the peers, per call as torch users call (issue 53's bar: 2048 new tokens onto a
16k paged prefix, page 16 and 64, D 128, GQA 32/8: >= 0.9x cuflash's contiguous forward on the same
work and >= 1.0x FlashAttention-4 with ``page_table``).

Problem: bf16, B sequences (``--batch``), each a prefix of ``--prefix`` keys already cached and a chunk of
``--new`` tokens whose keys are in the cache too (prefix caching: the chunk's keys were appended by the
previous step), causal bottom-right: new token i sees keys j <= prefix + i.

Contenders, from torch tensors, outputs allocated per call:

- ``cuflash``: ``cuflash.interop.torch.decode(q, k_cache, v_cache, cache_seqlens=, block_table=)``, the
  paged cache; planned on fwd_sm90 over the cache (cuflash/_prefill_plan.py);
- ``cuflash append``: the same call with the chunk's keys given as ``k_new``/``v_new`` and appended
  by the call (cache_seqlens = the prefix): the append's cost on top;
- ``cuflash kv in one``: the same call over K's and V's pages side by side in one (pages, 2, page, Hk, D)
  array (FlashInfer's layout): rows do not run on from page to page there, so a TMA copy takes one
  column block of a box instead of the whole box (kernels.fwd_sm90.kv_cache_mode);
- ``cuflash decode kernel``: the first call forced onto the decode kernel (where fewer new tokens
  run), and with ``--crossover`` ``cuflash fwd_sm90``: forced onto fwd_sm90 (below the threshold of
  ``kernels.fwd_sm90.kv_cache_pays`` the first call runs on the decode kernel; this measures where the
  two cross);
- ``cuflash contiguous``: ``ct.attention(q, k, v, causal=True)`` on a contiguous copy of the keys
  (B, prefix + new, 8, 128): the same work, the bar's reference;
- ``fa4`` / ``fa4 contiguous``: ``flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=, page_table=,
  causal=True)`` and ``flash_attn_func(q, k, v, causal=True)`` (where carried).

SDPA is left out: its ``is_causal`` aligns top-left, so a chunk after its prefix is not one of its
problems. Figure: TFLOP/s of visible work (4 D per visible (query, key) pair and head), CUDA events
around back-to-back calls, median of settled random-order turns; ``x`` columns: the other's time over
``cuflash``'s. ``maxdiff``: each output against cuflash's.

Run on a GPU machine: ``PYTHONPATH=$PWD python benchmarks/bench_chunked_prefill.py [--md F]``.
"""

from __future__ import annotations

import argparse

from _harness import (fa4_out, fmt, largest_difference, log, markdown_table, open_torch_peers, peer_arguments,
                      runnable, write_results)

HQ, HK, D = 32, 8, 128
COLUMNS = ["B", "prefix", "new", "page", "cuflash", "cuflash append", "cuflash kv in one", "cuflash decode kernel",
           "cuflash fwd_sm90",
           "cuflash contiguous", "fa4", "fa4 contiguous", "x contiguous", "x fa4", "x decode kernel", "maxdiff"]


def contenders(gpu, ct, fa4, batch, prefix, new, page, crossover=False):
    """({name: fn(i)}, {name: fn() -> output}) of one problem."""
    import cuflash._prefill_plan as prefill

    torch = gpu.torch
    total = prefix + new
    pages_per_seq = -(-total // page)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, total, HK, D, **bf16)
    v = torch.randn(batch, total, HK, D, **bf16)
    q = torch.randn(batch, new, HQ, D, **bf16)
    # Pages in a random order, as an engine's allocator leaves them.
    table = torch.randperm(batch * pages_per_seq, device="cuda", dtype=torch.int32).reshape(batch, pages_per_seq)
    k_cache = torch.zeros(batch * pages_per_seq, page, HK, D, **bf16)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.arange(total, device="cuda")
    for b in range(batch):
        k_cache[table[b, pos // page].long(), pos % page] = k[b]
        v_cache[table[b, pos // page].long(), pos % page] = v[b]
    lens = torch.full((batch,), total, device="cuda", dtype=torch.int32)
    prefix_lens = torch.full((batch,), prefix, device="cuda", dtype=torch.int32)
    k_new, v_new = k[:, prefix:].contiguous(), v[:, prefix:].contiguous()
    kv_one = torch.stack([k_cache, v_cache], dim=1)

    def forced(family):
        def call():
            with prefill.force_kernel(family):
                return ct.decode(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)
        return call

    calls = {
        "cuflash": lambda: ct.decode(q, k_cache, v_cache, cache_seqlens=lens, block_table=table),
        "cuflash append": lambda: ct.decode(q, k_cache, v_cache, cache_seqlens=prefix_lens, block_table=table,
                                            k_new=k_new, v_new=v_new),
        "cuflash kv in one": lambda: ct.decode(q, kv_one[:, 0], kv_one[:, 1], cache_seqlens=lens, block_table=table),
        "cuflash decode kernel": forced("decode"),
        "cuflash contiguous": lambda: ct.attention(q, k, v, causal=True),
    }
    if crossover:
        calls["cuflash fwd_sm90"] = forced("fwd_sm90")
    if fa4 is not None:
        calls["fa4"] = lambda: fa4_out(fa4.flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=lens,
                                                                   page_table=table, causal=True))
        calls["fa4 contiguous"] = lambda: fa4_out(fa4.flash_attn_func(q, k, v, causal=True))
    return {name: (lambda i, fn=fn: fn()) for name, fn in calls.items()}, calls


def main(argv=None):
    p = peer_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--batch", default="1,4", help="comma-separated batch sizes")
    p.add_argument("--prefix", type=int, default=16384)
    p.add_argument("--new", default="2048", help="comma-separated chunk lengths")
    p.add_argument("--pages", default="16,64")
    p.add_argument("--crossover", action="store_true", help="also time the calls forced onto fwd_sm90")
    args = p.parse_args(argv)
    import cupy

    opened = open_torch_peers(cupy, args)
    if opened is None:
        return
    gpu, ct, fa4, timer = opened
    rows = []
    with gpu.stream:
        for batch in (int(x) for x in args.batch.split(",")):
            for new in (int(x) for x in args.new.split(",")):
                for page in (int(x) for x in args.pages.split(",")):
                    steps, outputs = contenders(gpu, ct, fa4, batch, args.prefix, new, page, args.crossover)
                    usable = runnable(steps, f"(B {batch}, new {new}, page {page})")
                    ms = timer.median_ms_each(usable)
                    pairs = new * args.prefix + new * (new + 1) // 2
                    work = batch * HQ * 4 * D * pairs
                    row = {"B": batch, "prefix": args.prefix, "new": new, "page": page}
                    row.update({name: work / (t * 1e-3) / 1e12 for name, t in ms.items()})
                    for column, other in (("x contiguous", "cuflash contiguous"), ("x fa4", "fa4"),
                                          ("x decode kernel", "cuflash decode kernel")):
                        if other in row and "cuflash" in row:
                            row[column] = row["cuflash"] / row[other]
                    row["maxdiff"] = largest_difference(outputs, usable)
                    rows.append(row)
                    log(", ".join(f"{k} {fmt(v, 2)}" for k, v in row.items()))
                    del steps, outputs, usable
                    gpu.torch.cuda.empty_cache()
                    cupy.get_default_memory_pool().free_all_blocks()
    header = (f"**{gpu.device_name}** ({gpu.versions}{', ' + fa4.label if fa4 else ''}); per call from torch "
              f"tensors, bf16, Hq {HQ}, Hk {HK}, D {D}, causal; TFLOP/s of visible work")
    formats = {c: (lambda x: f"{x:.2f}") for c in ("x contiguous", "x fa4", "x decode kernel")}
    formats["maxdiff"] = lambda x: f"{x:.1e}"
    table = markdown_table(rows, header, COLUMNS, formats=formats)
    write_results(rows, table, COLUMNS, csv_path=args.csv, md_path=args.md)
    print(table)


if __name__ == "__main__":
    main()
