"""Score and mask modifiers as models use them, forward + backward through autograd, against
FlashAttention-4, torch FlexAttention and SDPA with a dense mask (issue 52's table).

Problems (bf16, D 128, H 16):

- ``window+softcap``: B 2, S 8k, causal, a 1024-key sliding window and a tanh cap of 30
  (Gemma-2/3, gpt-oss, Mistral);
- ``document``: B 1, S 16k of documents 512..4096 tokens long, causal within each;
- ``prefix-lm``: B 2, S 8k, the first 2048 tokens see each other, the rest causally;
- ``relative-bias``: B 2, S 8k, causal, a learned bias per head and distance (1024 distances, the last
  one for every farther key), as T5 and ALiBi-like relative schemes add it;
- ``alibi``: B 2, S 8k, causal ALiBi with geometric slopes (BLOOM, MPT), written as FlexAttention's
  docs write it, ``score + slope[h] * (kv_idx - q_idx)``.

Contenders, each called as its users call it from torch tensors (``torch.autograd.grad`` of the
output with a fixed incoming gradient):

- ``cuflash``: the built-in options (``ct.attention(window=, softcap=)``; the document case as
  ``ct.attention_varlen`` over the packed documents; the relative bias as a ``bias`` of (1, H, S, S)
  made from the table, broadcast over the batch; prefix-LM has no built-in form);
- ``cuflash mod``: the same attention written as ``cuflash.ScoreMod`` / ``cuflash.MaskMod`` (the
  window, the softcap and ALiBi among them run as the built-in options: cuflash/modifiers/builtin.py);
- ``fa4``: ``flash_attn_func(causal=, window_size=, softcap=)`` / ``flash_attn_varlen_func`` (where
  carried, benchmarks/fa4_device.md);
- ``flex``: ``torch.compile(flex_attention)`` with a ``score_mod`` and a block mask from a
  ``mask_mod`` made once per problem (``create_block_mask``), as FlexAttention's docs write it;
- ``sdpa``: ``F.scaled_dot_product_attention`` with a dense ``attn_mask`` made once per problem, as a
  torch user without FlexAttention writes it: a boolean (S, S) mask of the keys each query may see, or
  for the biases a float (1, H, S, S) one holding the bias there and -inf elsewhere; torch picks the
  backend (cuDNN and flash take no such mask). No softcap in SDPA: no column for window+softcap.

Figure: TFLOP/s of visible work (4 B H D per visible (query, key) pair forward, 2.5 times that
backward, so 14 B H D per pair for the step), from CUDA events around each call, median of
``--repeats`` runs in settled random-order turns (``Timer.median_ms_each``); ``x fa4`` / ``x flex`` /
``x sdpa``: their time over cuflash's best (> 1: cuflash faster). ``maxdiff``: each contender's output against
the built-in cuflash call's.

Run on a GPU machine: ``PYTHONPATH=$PWD python benchmarks/bench_modifiers.py [--quick] [--md F]``.
"""

from __future__ import annotations

import argparse

import numpy as np

from _harness import (fa4_out, fmt, largest_difference, log, markdown_table, open_torch_peers, peer_arguments,
                      runnable, write_results)

HEADS, HEAD_DIM = 16, 128
WINDOW, CAP, PREFIX, DISTANCES = 1024, 30.0, 2048, 1024
COLUMNS = ["problem", "cuflash", "cuflash mod", "fa4", "flex", "sdpa", "x fa4", "x flex", "x sdpa", "maxdiff"]
PEERS = ("fa4", "flex", "sdpa")


def document_lengths(rng, total: int, lo: int = 512, hi: int = 4096) -> np.ndarray:
    """Document lengths in [lo, hi] that add up to ``total`` (the last one takes the rest)."""
    lengths, left = [], total
    while left > hi:
        n = int(rng.integers(lo, hi + 1))
        lengths.append(n)
        left -= n
    lengths.append(left)
    return np.asarray(lengths, dtype=np.int64)


def visible_pairs(problem: str, seqlen: int, lengths=None) -> int:
    """Visible (query, key) pairs of one sequence of the problem."""
    i = np.arange(seqlen, dtype=np.int64)
    if problem == "window+softcap":
        return int(np.minimum(i + 1, WINDOW + 1).sum())
    if problem == "document":
        return int(sum(n * (n + 1) // 2 for n in lengths))
    if problem == "prefix-lm":
        return int(np.where(i < PREFIX, PREFIX, i + 1).sum())
    if problem in ("relative-bias", "alibi"):
        return int((i + 1).sum())
    raise ValueError(problem)


def may_attend(problem: str, qi, ki, doc=None):
    """Whether query qi may see key ki in the problem (NumPy or torch index arrays, broadcast): the
    dense mask the ``sdpa`` contender passes, whose count is ``visible_pairs``."""
    if problem == "window+softcap":
        return (qi >= ki) & (qi - ki <= WINDOW)
    if problem == "document":
        return (qi >= ki) & (doc[qi] == doc[ki])
    if problem == "prefix-lm":
        return (ki < PREFIX) | (ki <= qi)
    if problem in ("relative-bias", "alibi"):
        return qi >= ki
    raise ValueError(problem)


def step_tflops(pairs: int, batch: int, ms: float) -> float:
    """TFLOP/s of a forward + backward step over ``pairs`` visible pairs per sequence."""
    return 14 * batch * HEADS * HEAD_DIM * pairs / (ms * 1e-3) / 1e12


def problems(quick: bool, only: str | None = None):
    grid = [("window+softcap", 2, 8192), ("document", 1, 16384), ("prefix-lm", 2, 8192), ("relative-bias", 2, 8192),
            ("alibi", 2, 8192)]
    if only:
        return [row for row in grid if row[0] in only.split(",")]
    return grid[:1] if quick else grid


def contenders(gpu, ct, cuflash, fa4, flex, problem, batch, seqlen, rng):
    """({name: fn(i) -> the step's gradients}, {name: fn() -> output}) of one problem."""
    torch = gpu.torch
    mk = lambda: torch.randn(batch, seqlen, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,  # noqa: E731
                             requires_grad=True)
    q, k, v = mk(), mk(), mk()
    dout = torch.randn_like(q)
    calls = {}
    cap = cuflash.ScoreMod("c * tanh(score / c)", grad="1.0 - tanh(score / c) * tanh(score / c)", c=CAP)
    if problem == "window+softcap":
        calls["cuflash"] = lambda: ct.attention(q, k, v, causal=True, window=(WINDOW, 0), softcap=CAP)
        near = cuflash.MaskMod("q_idx - kv_idx <= w", w=WINDOW)
        calls["cuflash mod"] = lambda: ct.attention(q, k, v, causal=True, score_mod=cap, mask_mod=near)
        if fa4 is not None:
            calls["fa4"] = lambda: fa4_out(fa4.flash_attn_func(q, k, v, causal=True, window_size=(WINDOW, 0),
                                                               softcap=CAP))
        flex_score = lambda score, b, h, qi, ki: CAP * torch.tanh(score / CAP)  # noqa: E731
        flex_mask = lambda b, h, qi, ki: may_attend(problem, qi, ki)             # noqa: E731
        pairs = visible_pairs(problem, seqlen)
    elif problem == "document":
        lengths = document_lengths(rng, seqlen)
        doc = torch.from_numpy(np.repeat(np.arange(lengths.size), lengths).astype(np.int32)).cuda()
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)).cuda()
        longest = int(lengths.max())
        packed = lambda x: x.view(batch * seqlen, HEADS, HEAD_DIM)  # noqa: E731
        calls["cuflash"] = lambda: ct.attention_varlen(packed(q), packed(k), packed(v), cu, cu, max_seqlen_q=longest,
                                                       max_seqlen_k=longest, causal=True).view(q.shape)
        same = cuflash.MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc)
        calls["cuflash mod"] = lambda: ct.attention(q, k, v, causal=True, mask_mod=same)
        if fa4 is not None:
            calls["fa4"] = lambda: fa4_out(fa4.flash_attn_varlen_func(
                packed(q), packed(k), packed(v), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                max_seqlen_k=longest, causal=True)).view(q.shape)
        flex_score = None
        flex_mask = lambda b, h, qi, ki: may_attend(problem, qi, ki, doc)  # noqa: E731
        pairs = visible_pairs(problem, seqlen, lengths)
    elif problem == "relative-bias":
        table = torch.randn(HEADS, DISTANCES, device="cuda", dtype=torch.float32)
        i = torch.arange(seqlen, device="cuda")
        distance = (i[:, None] - i[None, :]).clamp(0, DISTANCES - 1)
        bias = table[:, distance].to(torch.bfloat16)[None]   # (1, H, S, S): the built-in call's operand
        del distance
        calls["cuflash"] = lambda: ct.attention(q, k, v, causal=True, bias=bias)
        relative = cuflash.ScoreMod("score + table[h * n + min(q_idx - kv_idx, n - 1)]", table=table.view(-1),
                                    n=DISTANCES)
        calls["cuflash mod"] = lambda: ct.attention(q, k, v, causal=True, score_mod=relative)
        flex_score = lambda score, b, h, qi, ki: score + table[h, (qi - ki).clamp(0, DISTANCES - 1)]  # noqa: E731
        flex_mask = lambda b, h, qi, ki: may_attend(problem, qi, ki)  # noqa: E731
        pairs = visible_pairs(problem, seqlen)
    elif problem == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / HEADS) for h in range(HEADS)], device="cuda")
        calls["cuflash"] = lambda: ct.attention(q, k, v, causal=True, alibi_slopes=slopes)
        alibi = cuflash.ScoreMod("score + slope[h] * (kv_idx - q_idx)", slope=slopes)
        calls["cuflash mod"] = lambda: ct.attention(q, k, v, causal=True, score_mod=alibi)
        flex_score = lambda score, b, h, qi, ki: score + slopes[h] * (ki - qi)  # noqa: E731
        flex_mask = lambda b, h, qi, ki: may_attend(problem, qi, ki)  # noqa: E731
        pairs = visible_pairs(problem, seqlen)
    else:
        prefix = cuflash.MaskMod("kv_idx < p || kv_idx <= q_idx", p=PREFIX)
        calls["cuflash mod"] = lambda: ct.attention(q, k, v, mask_mod=prefix)
        flex_score = None
        flex_mask = lambda b, h, qi, ki: may_attend(problem, qi, ki)  # noqa: E731
        pairs = visible_pairs(problem, seqlen)
    bhsd = lambda x: x.transpose(1, 2)  # noqa: E731 - SDPA and FlexAttention take (B, H, S, D)
    if problem != "window+softcap":   # SDPA has no softcap
        i = torch.arange(seqlen, device="cuda")
        allowed = may_attend(problem, i[:, None], i[None, :], doc if problem == "document" else None)
        if problem == "relative-bias":
            sdpa_mask = bias.masked_fill(~allowed, float("-inf"))
        elif problem == "alibi":
            sdpa_mask = (slopes[:, None, None] * (i[None, :] - i[:, None])[None]).to(torch.bfloat16)[None]
            sdpa_mask = sdpa_mask.masked_fill(~allowed, float("-inf"))
        else:
            sdpa_mask = allowed
        del allowed
        calls["sdpa"] = lambda: gpu.F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v),
                                                                   attn_mask=sdpa_mask).transpose(1, 2)
    if flex is not None:
        block_mask = flex.create_block_mask(flex_mask, B=None, H=None, Q_LEN=seqlen, KV_LEN=seqlen)
        calls["flex"] = lambda: flex.compiled(bhsd(q), bhsd(k), bhsd(v), score_mod=flex_score,
                                              block_mask=block_mask).transpose(1, 2)

    def step(fn):
        return lambda i: torch.autograd.grad(fn(), (q, k, v), dout)

    return {name: step(fn) for name, fn in calls.items()}, calls, pairs


def open_flex(torch):
    """FlexAttention compiled once, or None where it does not import."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as e:  # noqa: BLE001 - optional contender
        log(f"FlexAttention not importable ({type(e).__name__}): no flex column")
        return None

    class Flex:
        compiled = staticmethod(torch.compile(flex_attention))

    Flex.create_block_mask = staticmethod(create_block_mask)
    return Flex


def main(argv=None):
    p = peer_arguments(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", help="problems to run, comma-separated (window+softcap, document, prefix-lm, "
                                  "relative-bias, alibi)")
    args = p.parse_args(argv)
    import cupy

    opened = open_torch_peers(cupy, args, repeats=3 if args.quick else None, max_calls=20)
    if opened is None:
        return
    gpu, ct, fa4, timer = opened
    import cuflash

    flex = open_flex(gpu.torch)
    rng = np.random.default_rng(0)
    rows = []
    with gpu.stream:
        for problem, batch, seqlen in problems(args.quick, args.only):
            steps, forwards, pairs = contenders(gpu, ct, cuflash, fa4, flex, problem, batch, seqlen, rng)
            usable = runnable(steps, problem)
            ms = timer.median_ms_each(usable)
            row = {"problem": f"{problem} B{batch} S{seqlen // 1024}k"}
            for name, t in ms.items():
                row[name] = step_tflops(pairs, batch, t)
            ours = max((row[n] for n in ("cuflash", "cuflash mod") if n in row), default=None)
            for peer in PEERS:
                if ours and peer in row:
                    row[f"x {peer}"] = ours / row[peer]
            base = "cuflash" if "cuflash" in usable else "cuflash mod"
            if base in usable:
                row["maxdiff"] = largest_difference(forwards, usable, base)
            rows.append(row)
            log(", ".join(f"{k} {fmt(v)}" for k, v in row.items()))
    header = (f"**{gpu.device_name}** ({gpu.versions}); forward + backward through autograd, bf16, H {HEADS}, "
              f"D {HEAD_DIM}; TFLOP/s of visible work")
    formats = {f"x {peer}": (lambda x: f"{x:.2f}") for peer in PEERS}
    table = markdown_table(rows, header, COLUMNS, formats={**formats, "maxdiff": lambda x: f"{x:.1e}"})
    write_results(rows, table, COLUMNS, csv_path=args.csv, md_path=args.md)
    print(table)


if __name__ == "__main__":
    main()
