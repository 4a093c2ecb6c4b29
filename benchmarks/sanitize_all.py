"""Every public entry point under compute-sanitizer, each kernel family forced, at small shapes.

    python benchmarks/sanitize_all.py --tool memcheck          # or racecheck, synccheck, initcheck
    python benchmarks/sanitize_all.py --tool racecheck --only decode --only merge
    python benchmarks/sanitize_all.py --list                   # the cases; no GPU needed
    python benchmarks/sanitize_all.py --tool none              # the cases without a sanitizer

What runs: the forward (fwd_sm90, fwd_sm80, fwd_simt; fp16/bf16/fp32; causal, window, softcap, ALiBi,
mask, bias, block_mask, dropout, GQA, D 64 and 128, Sq != Sk with partial tiles on both sides), varlen
forward and backward, the backward (bwd_sm90, bwd_sm80, bwd_simt; deterministic, dbias), decode
(contiguous and paged, odd page sizes, with and without an append, 1 / several / heuristic splits, index
checks in the kernel and by a check_indices launch), merge_states, and the bad index values of
benchmarks/sanitize_bad_indices.py (each call must be refused, touching no memory out of bounds).
Sequences are 64-200 long, batch 1-2: racecheck, the slowest tool, should take a few minutes on an H100.

How: the script re-executes itself, first without the sanitizer (the warm pass: it compiles, in
parallel threads, exactly the kernel variants the cases need, since NVRTC under the sanitizer is slow,
warms CuPy's kernel cache, and runs every case once), then under
``compute-sanitizer --tool X --error-exitcode 1`` with CuPy's memory pool off (each array its own
cudaMalloc, so memcheck sees accesses past an array's end; a call's temporaries in one allocation of
their size, not in the stream's arena). Each case runs between two markers and
synchronises at its end; a sanitizer report is put on the case whose markers surround it (rerun a case
alone with ``--only`` to be sure). A case that leaves the CUDA context unusable (a kernel killed by
memcheck) ends that process; the run goes on in a new one from the next case. At the end: one table
(entry, family, options, result, seconds) and the exit status: 0 when every case ran and the sanitizer
reported nothing, 1 otherwise, 2 when compute-sanitizer is not found (PATH, $CUDA_HOME/bin,
/usr/local/cuda*/bin, the nvidia-cuda-sanitizer-api wheel).

Options: ``--only SUBSTRING`` (repeatable; matches "entry family options"), ``--no-warm`` (skip the warm
pass when the kernels are cached already), ``--pool`` (keep CuPy's memory pool under the sanitizer),
``--sanitizer-args "..."`` (more compute-sanitizer options, e.g. "--racecheck-report all").
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck", "none")


@dataclasses.dataclass
class Case:
    entry: str       # the public function called (the bad-index cases call several: the first is named)
    family: str      # the kernel family forced (or the one the call reaches: decode, merge, check_indices)
    options: str     # what the call does, in words
    run: object      # () -> str (a note for the table); raises on a wrong result
    needs: str = ""  # an architecture the case needs ("sm_90a"), else ""

    @property
    def label(self) -> str:
        return f"{self.entry} {self.family} {self.options}"


# ----------------------------------------------------------------------------- helpers (GPU side)

def _cp():
    import cupy

    return cupy


def _dtype(name):
    import ml_dtypes
    import numpy as np

    return {"fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16), "fp32": np.dtype(np.float32)}[name]


def _rnd(dt, *shape):
    cp = _cp()
    return cp.random.standard_normal(shape, dtype=cp.float32).astype(_dtype(dt) if isinstance(dt, str) else dt)


def _finite(*arrays, what="output"):
    cp = _cp()
    for i, x in enumerate(arrays):
        if not bool(cp.isfinite(x.astype(cp.float32)).all()):
            raise AssertionError(f"{what} {i} has NaN/Inf")


def _score_options(opts, B, Sq, Sk, Hq):
    """Keyword arguments for the score modifiers named in ``opts`` (arrays made here)."""
    cp = _cp()
    kw = {k: opts[k] for k in ("causal", "window", "softcap", "dropout_p") if k in opts}
    if opts.get("alibi"):
        kw["alibi_slopes"] = cp.random.uniform(0.01, 0.5, (B, Hq) if opts["alibi"] == "batch" else (Hq,)).astype(
            cp.float32)
    if opts.get("mask"):
        kw["mask"] = cp.random.random((1, 1, Sq, Sk)) < 0.8
    if opts.get("bias"):
        kw["bias"] = _rnd("fp32", 1, Hq, Sq, Sk)
    if opts.get("block_mask"):
        # "small": blocks of 3 x 5, dozens in a tile (bwd_sm90's producer walks them by lanes).
        bq, bk = (3, 5) if opts["block_mask"] == "small" else (64, 64)
        kw["block_size"] = (bq, bk)
        kw["block_mask"] = cp.random.random((B, 1, math.ceil(Sq / bq), math.ceil(Sk / bk))) < 0.7
    return kw


def _flag_words(opts) -> list[str]:
    shown = []
    for key, value in opts.items():
        if value is True:
            shown.append(key)
        elif key == "dropout_p":
            shown.append(f"dropout {value}")
        elif key == "alibi":
            shown.append(f"alibi ({value})")
        else:
            shown.append(f"{key} {value}")
    return shown


def _words(dt, D, B, Sq, Sk, Hq, Hk, opts):
    gqa = f" GQA {Hq}/{Hk}" if Hq != Hk else f" H{Hq}"
    return f"{dt} D{D} B{B} Sq{Sq} Sk{Sk}{gqa}" + "".join(f", {w}" for w in _flag_words(opts))


# ----------------------------------------------------------------------------- the cases

def forward_case(family, dt, D, B, Sq, Sk, Hq, Hk, entry="attention_forward", wide=False, **opts):
    """wide: fwd_sm90's three consumer warpgroups (192-row items) at any length (D = 64, ``attention``)."""
    def run():
        import cuflash
        from cuflash import kernels
        from cuflash._runtime import memo as _memo

        q, k, v = _rnd(dt, B, Sq, Hq, D), _rnd(dt, B, Sk, Hk, D), _rnd(dt, B, Sk, Hk, D)
        kw = _score_options(opts, B, Sq, Sk, Hq)
        fwd = kernels.fwd_sm90
        saved = fwd.SM90_WIDE_MIN_ROWS, fwd.SM90_WIDE_MIN_ROWS_CAUSAL
        if wide:
            fwd.SM90_WIDE_MIN_ROWS = fwd.SM90_WIDE_MIN_ROWS_CAUSAL = 1
            _memo.clear_memo()
        try:
            with cuflash.force_kernel(family):
                if entry == "attention":
                    out = cuflash.attention(q, k, v, **kw)
                else:
                    out, lse, _ = cuflash.attention_forward(q, k, v, **kw)
        finally:
            fwd.SM90_WIDE_MIN_ROWS, fwd.SM90_WIDE_MIN_ROWS_CAUSAL = saved
            if wide:
                _memo.clear_memo()
        _finite(out)
        return ""

    words = _words(dt, D, B, Sq, Sk, Hq, Hk, dict(opts, **({"wide": True} if wide else {})))
    return Case(entry, family, words, run, "sm_90a" if family.endswith("sm90") else "")


def backward_case(family, dt, D, B, Sq, Sk, Hq, Hk, deterministic=False, return_dbias=False, wide=False, **opts):
    """wide: bwd_sm90's 80-row query tiles at any length (BWD_SM90_WIDE_MIN_ROWS lowered to 1)."""
    def run():
        import cuflash
        from cuflash import kernels
        from cuflash._runtime import memo as _memo
        from cuflash import backward as bw

        q, k, v = _rnd(dt, B, Sq, Hq, D), _rnd(dt, B, Sk, Hk, D), _rnd(dt, B, Sk, Hk, D)
        dout = _rnd(dt, B, Sq, Hq, D)
        kw = _score_options(opts, B, Sq, Sk, Hq)
        out, lse, rng_state = cuflash.attention_forward(q, k, v, **kw)   # the default family
        min_rows = kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS
        kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS = 1 if wide else min_rows
        _memo.clear_memo()
        try:
            with bw.force_kernel(family):
                grads = cuflash.attention_backward(dout, q, k, v, out, lse, rng_state=rng_state,
                                                   deterministic=deterministic, return_dbias=return_dbias, **kw)
        finally:
            kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS = min_rows
            _memo.clear_memo()
        _finite(*grads, what="gradient")
        return ""

    flags = dict(opts)
    if wide:
        flags["wide"] = True
    if deterministic:
        flags["deterministic"] = True
    if return_dbias:
        flags["dbias"] = True
    return Case("attention_backward", family, _words(dt, D, B, Sq, Sk, Hq, Hk, flags), run,
                "sm_90a" if family.endswith("sm90") else "")


# Three sequences: (77 queries, 200 keys), (200, 77), (1, 5): partial tiles, Sq < Sk and Sq > Sk.
VARLEN_Q, VARLEN_K = [0, 77, 277, 278], [0, 200, 277, 282]


def varlen_case(family, dt, D, Hq, Hk, backward=False, deterministic=False, **opts):
    def run():
        import cuflash
        from cuflash import backward as bw

        cp = _cp()
        cu_q, cu_k = cp.array(VARLEN_Q, cp.int32), cp.array(VARLEN_K, cp.int32)
        q, k, v = _rnd(dt, VARLEN_Q[-1], Hq, D), _rnd(dt, VARLEN_K[-1], Hk, D), _rnd(dt, VARLEN_K[-1], Hk, D)
        kw = _score_options(opts, 3, 1, 1, Hq)
        lengths = dict(max_seqlen_q=200, max_seqlen_k=200)
        if not backward:
            with cuflash.force_kernel(family):
                out = cuflash.attention_varlen(q, k, v, cu_q, cu_k, **lengths, check=True, **kw)
            _finite(out)
            return ""
        out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, **lengths, return_lse=True, **kw)
        dout = _rnd(dt, VARLEN_Q[-1], Hq, D)
        with bw.force_kernel(family):
            grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **lengths,
                                                      deterministic=deterministic, check=True, **kw)
        _finite(*grads, what="gradient")
        return ""

    flags = dict(opts, **({"deterministic": True} if deterministic else {}))
    words = f"{dt} D{D} seqs (77,200),(200,77),(1,5) GQA {Hq}/{Hk}" + "".join(f", {w}" for w in _flag_words(flags))
    entry = "attention_varlen_backward" if backward else "attention_varlen"
    return Case(entry, family, words, run, "sm_90a" if family.endswith("sm90") else "")


def decode_case(dt, D, Hq, Hk, *, Sq=1, paged=False, page_size=16, append=0, splits=1, host_lens=False,
                check_kernel=False, dv=None, mla=False, **opts):
    """B = 2 sequences holding 77 and 150 keys of a capacity of 200 (paged: pages shuffled). ``dv``: v's
    head dim when it differs; ``mla``: one latent cache of D columns whose first 512 are the values."""
    B, capacity, lens = 2, 200, [77, 150]

    def run():
        import numpy as np

        import cuflash
        from cuflash import kernels
        from cuflash._runtime import memo as _memo

        cp = _cp()
        kw = dict(num_splits=splits)
        v_dim = dv or D
        if paged:
            max_pages = -(-capacity // page_size)
            num_pages = B * max_pages + 3
            kc, vc = _rnd(dt, num_pages, page_size, Hk, D), _rnd(dt, num_pages, page_size, Hk, v_dim)
            table = np.random.default_rng(0).permutation(num_pages)[:B * max_pages].reshape(B, max_pages)
            kw["block_table"] = cp.asarray(table.astype(np.int32))
        else:
            kc, vc = _rnd(dt, B, capacity, Hk, D), _rnd(dt, B, capacity, Hk, v_dim)
        kw["cache_seqlens"] = np.array(lens, np.int32) if host_lens else cp.array(lens, cp.int32)
        if append:
            kw.update(k_new=_rnd(dt, B, append, Hk, D), v_new=None if mla else _rnd(dt, B, append, Hk, v_dim))
        if mla:
            vc, kw["v_head_dim"] = None, 512
        kw.update(_score_options({k: v for k, v in opts.items() if k != "mask"}, B, Sq, capacity, Hq))
        if opts.get("mask"):   # a tree mask over the new tokens: its columns are the last Sq keys
            kw["mask"] = cp.tril(cp.ones((Sq, Sq), dtype=bool))
        if opts.get("return_lse"):
            kw["return_lse"] = True
        q = _rnd(dt, B, Sq, Hq, D)
        saved = kernels.decode.DECODE_SELF_CHECK_PER_THREAD
        if check_kernel:   # every paged table checked by a check_indices launch ahead of decode
            kernels.decode.DECODE_SELF_CHECK_PER_THREAD = 0
            _memo.clear_memo()
        try:
            result = cuflash.decode(q, kc, vc, check=True, **kw)
        finally:
            kernels.decode.DECODE_SELF_CHECK_PER_THREAD = saved
            if check_kernel:
                _memo.clear_memo()
        _finite(result[0] if isinstance(result, tuple) else result)
        return ""

    words = [f"{dt} D{D}" + (f"/{dv}" if dv else "") + (" MLA" if mla else "") + f" B{B} Sq{Sq} GQA {Hq}/{Hk}",
             f"paged page {page_size}" if paged else "contiguous",
             f"append {append}" if append else "no append",
             "splits heuristic" if splits == 0 else f"splits {splits}"]
    words += ["lens on host"] if host_lens else []
    words += ["check_indices launch"] if check_kernel else []
    words += _flag_words(opts)
    return Case("decode", "decode", ", ".join(words), run)


def merge_case(dt, n, *, stacked=False, mixed=False, given_out=False):
    B, S, H, D = 2, 70, 4, 64

    def run():
        import numpy as np

        import cuflash

        cp = _cp()
        dts = [dt] * n if not mixed else ["fp16", "fp32"] + [dt] * (n - 2)
        outs = [_rnd(d, B, S, H, D) for d in dts]
        lses = [_rnd("fp32", B, H, S) for _ in range(n)]
        lses[0][:, :, :5] = -np.inf   # rows some parts did not see, and rows no part saw
        lses[1][:, :, :3] = -np.inf
        if n > 2:
            lses[2][:, :, :3] = -np.inf
        kw = {}
        if given_out:
            kw = dict(out=cp.empty((B, S, H, D), dtype=outs[0].dtype), lse=cp.empty((B, H, S), cp.float32))
        if stacked:
            out, lse = cuflash.merge_states(cp.stack(outs), cp.stack(lses), **kw)
        else:
            out, lse = cuflash.merge_states(outs, lses, **kw)
        _finite(out)
        return ""

    words = f"{dt if not mixed else 'fp16+fp32'} n{n} B{B} S{S} H{H} D{D}, -inf rows" + (
        ", stacked" if stacked else ", list") + (", out/lse given" if given_out else "")
    return Case("merge_states", "merge", words, run)


def bad_decode_case(splits, check_kernel):
    """sanitize_bad_indices.py's five bad decode calls (lengths past the cache, negative, no room for the
    append, a page past the cache, a negative page): each must be refused (check=True)."""
    def run():
        import cuflash
        from cuflash import kernels
        from cuflash._runtime import memo as _memo

        cp = _cp()
        B, Hq, Hk, D, P = 4, 8, 2, 64, 16
        q = _rnd("bf16", B, 1, Hq, D)
        kn, vn = _rnd("bf16", B, 1, Hk, D), _rnd("bf16", B, 1, Hk, D)
        kc, vc = _rnd("bf16", B, 256, Hk, D), _rnd("bf16", B, 256, Hk, D)
        kp, vp = _rnd("bf16", 64, P, Hk, D), _rnd("bf16", 64, P, Hk, D)
        table = cp.arange(64, dtype=cp.int32).reshape(B, 16)
        bad_page, negative_page = table.copy(), table.copy()
        bad_page[1, 1] = 1 << 20
        negative_page[0, 2] = -5
        calls = [dict(k_cache=kc, v_cache=vc, cache_seqlens=cp.array([10, 300, 5, 7], cp.int32)),
                 dict(k_cache=kc, v_cache=vc, cache_seqlens=cp.array([10, -4, 5, 7], cp.int32), k_new=kn, v_new=vn),
                 dict(k_cache=kc, v_cache=vc, cache_seqlens=cp.array([10, 256, 5, 7], cp.int32), k_new=kn, v_new=vn),
                 dict(k_cache=kp, v_cache=vp, cache_seqlens=cp.array([40, 30, 5, 7], cp.int32), block_table=bad_page),
                 dict(k_cache=kp, v_cache=vp, cache_seqlens=cp.array([40, 30, 5, 7], cp.int32),
                      block_table=negative_page, k_new=kn, v_new=vn)]
        saved = kernels.decode.DECODE_SELF_CHECK_PER_THREAD
        if check_kernel:
            kernels.decode.DECODE_SELF_CHECK_PER_THREAD = 0
        _memo.clear_memo()
        refused = 0
        try:
            for kw in calls:
                kw = dict(kw)
                try:
                    cuflash.decode(q, kw.pop("k_cache"), kw.pop("v_cache"), num_splits=splits, check=True, **kw)
                except ValueError:
                    refused += 1
        finally:
            kernels.decode.DECODE_SELF_CHECK_PER_THREAD = saved
            _memo.clear_memo()
        if refused != len(calls):
            raise AssertionError(f"only {refused} of {len(calls)} bad calls refused")
        return f"{refused}/{len(calls)} refused"

    how = "check_indices launch" if check_kernel else "in-kernel check"
    return Case("decode", "check_indices" if check_kernel else "decode",
                f"bad indices (5 calls: lengths, append room, pages), {how}, splits {splits}", run)


def bad_varlen_case(backward):
    def run():
        import cuflash

        cp = _cp()
        T, H, D = 100, 4, 64
        q, k = _rnd("bf16", T, H, D), _rnd("bf16", T, H, D)
        refused = 0
        offsets = ([0, 60, 30, 100], [0, 50, 100, 1 << 28], [5, 10, 20, 100])
        for cu in offsets:
            cu = cp.array(cu, cp.int32)
            try:
                if backward:
                    o, lse = _rnd("bf16", T, H, D), cp.zeros((H, T), cp.float32)
                    cuflash.attention_varlen_backward(o, q, k, k, o, lse, cu, cu, max_seqlen_q=100, max_seqlen_k=100,
                                                      check=True)
                else:
                    cuflash.attention_varlen(q, k, k, cu, cu, max_seqlen_q=100, max_seqlen_k=100, check=True)
            except ValueError:
                refused += 1
        if refused != len(offsets):
            raise AssertionError(f"only {refused} of {len(offsets)} bad calls refused")
        return f"{refused}/{len(offsets)} refused"

    entry = "attention_varlen_backward" if backward else "attention_varlen"
    return Case(entry, "check_indices", "bad indices (3 cu_seqlens: decreasing, past the rows, not from 0)", run)


def build_cases() -> list[Case]:
    cases = []
    # Forward: each family, its dtypes, every option alone, all together, GQA, both head dims, partial tiles.
    for family, dts in (("fwd_sm90", ("bf16", "fp16")), ("fwd_sm80", ("fp16", "bf16")), ("fwd_simt", ("fp32", "fp32"))):
        a, b = dts
        cases += [
            forward_case(family, a, 64, 2, 77, 200, 4, 2),
            forward_case(family, b, 128, 1, 200, 77, 4, 4, causal=True),
            forward_case(family, a, 64, 1, 150, 150, 4, 1, entry="attention", causal=True),
            forward_case(family, b, 64, 1, 77, 200, 4, 2, window=(32, 16), softcap=30.0),
            forward_case(family, a, 128, 2, 64, 129, 4, 2, alibi="batch"),
            forward_case(family, b, 64, 1, 100, 140, 4, 2, mask=True),
            forward_case(family, a, 64, 1, 140, 100, 4, 2, bias=True),
            forward_case(family, b, 64, 1, 150, 200, 4, 2, block_mask=True),
            forward_case(family, a, 64, 1, 77, 200, 4, 2, dropout_p=0.1),
            forward_case(family, b, 128, 1, 77, 200, 4, 2, causal=True, window=(64, 0), softcap=20.0, alibi="heads",
                         mask=True, bias=True, block_mask=True, dropout_p=0.2),
        ]
    # fwd_sm90 with three consumer warpgroups (full attention at D = 64 over >= 2048 query rows), a
    # last m-block of 28 rows; causal (from SM90_WIDE_MIN_ROWS_CAUSAL rows, lowered here), Sq != Sk.
    cases += [forward_case("fwd_sm90", "bf16", 64, 1, 2140, 300, 2, 1),
              forward_case("fwd_sm90", "fp16", 64, 1, 300, 420, 2, 1, causal=True, wide=True)]
    cases += [varlen_case("fwd_sm90", "bf16", 64, 4, 2, causal=True),
              varlen_case("fwd_sm90", "fp16", 128, 4, 4, dropout_p=0.1, alibi="batch"),
              varlen_case("fwd_sm80", "fp16", 64, 4, 2, window=(32, 8), softcap=30.0),
              varlen_case("fwd_sm80", "bf16", 128, 4, 1, causal=True, dropout_p=0.1),
              varlen_case("fwd_simt", "fp32", 64, 4, 2, causal=True, alibi="heads")]
    # Backward: bwd_sm90 plain (ordered dQ at D = 128; at D = 64 and 256 deterministic dQ is bwd_sm80's
    # pass) and featured (score modifiers, dropout: the smaller tiles of BwdSm90Config::kFeatured).
    cases += [backward_case("bwd_sm90", "fp16", 64, 2, 77, 200, 4, 2, causal=True),
              backward_case("bwd_sm90", "bf16", 128, 2, 200, 77, 4, 2, deterministic=True),
              backward_case("bwd_sm90", "bf16", 64, 1, 150, 150, 4, 4, causal=True, deterministic=True),
              backward_case("bwd_sm90", "fp16", 128, 1, 77, 200, 4, 1),
              backward_case("bwd_sm90", "bf16", 128, 2, 200, 77, 4, 2, wide=True),
              backward_case("bwd_sm90", "bf16", 256, 2, 77, 200, 4, 2, causal=True),
              backward_case("bwd_sm90", "fp16", 256, 1, 200, 77, 4, 1, deterministic=True),
              backward_case("bwd_sm90", "fp16", 64, 1, 77, 200, 4, 2, window=(32, 16), softcap=30.0, dropout_p=0.1),
              backward_case("bwd_sm90", "bf16", 128, 1, 100, 140, 4, 2, alibi="batch", mask=True, block_mask=True),
              backward_case("bwd_sm90", "fp16", 128, 1, 140, 100, 4, 2, bias=True, return_dbias=True, dropout_p=0.1,
                            deterministic=True),
              backward_case("bwd_sm90", "bf16", 256, 1, 77, 200, 4, 2, causal=True, softcap=30.0, dropout_p=0.1),
              backward_case("bwd_sm90", "fp16", 256, 1, 140, 100, 4, 2, softcap=30.0, alibi="heads", mask=True,
                            bias=True, block_mask="small", dropout_p=0.1)]
    for family, a, b in (("bwd_sm80", "fp16", "bf16"), ("bwd_simt", "fp32", "fp32")):
        cases += [backward_case(family, a, 64, 2, 77, 200, 4, 2, causal=True),
                  backward_case(family, b, 128, 1, 200, 77, 4, 2, deterministic=True),
                  backward_case(family, a, 64, 1, 77, 200, 4, 2, window=(32, 16), softcap=30.0, dropout_p=0.1),
                  backward_case(family, b, 64, 1, 100, 140, 4, 2, alibi="batch", mask=True, block_mask=True),
                  backward_case(family, a, 64, 1, 140, 100, 4, 2, bias=True, return_dbias=True, deterministic=True)]
    cases += [varlen_case("bwd_sm90", "bf16", 64, 4, 2, backward=True, causal=True),
              varlen_case("bwd_sm90", "bf16", 128, 4, 2, backward=True, causal=True),
              varlen_case("bwd_sm90", "fp16", 128, 4, 2, backward=True, deterministic=True),
              varlen_case("bwd_sm90", "bf16", 256, 4, 2, backward=True, causal=True),
              varlen_case("bwd_sm90", "fp16", 128, 4, 2, backward=True, causal=True, alibi="heads", softcap=30.0),
              varlen_case("bwd_sm80", "fp16", 64, 4, 2, backward=True, causal=True, alibi="heads"),
              varlen_case("bwd_sm80", "bf16", 128, 4, 1, backward=True, deterministic=True, window=(32, 8)),
              varlen_case("bwd_simt", "fp32", 64, 4, 2, backward=True, causal=True, softcap=30.0)]
    # Decode: contiguous and paged, appends, splits, dtypes, options, both ways of checking indices.
    cases += [decode_case("bf16", 128, 8, 2),
              decode_case("fp16", 64, 8, 2, append=2, Sq=2, splits=3),
              decode_case("fp32", 64, 4, 2, append=1, splits=0),
              decode_case("bf16", 64, 8, 1, Sq=4, append=4, splits=2, mask=True, return_lse=True),
              decode_case("fp16", 128, 8, 2, host_lens=True, splits=0, softcap=30.0, alibi="batch"),
              decode_case("bf16", 128, 8, 2, paged=True, splits=3),
              decode_case("fp16", 64, 8, 2, paged=True, page_size=7, append=2, Sq=2, splits=1),
              decode_case("fp32", 128, 4, 2, paged=True, page_size=16, append=1, splits=2, window=(64, 0),
                          softcap=20.0, alibi="heads"),
              decode_case("bf16", 64, 8, 2, paged=True, page_size=32, append=1, splits=0, check_kernel=True),
              decode_case("fp16", 64, 8, 2, paged=True, page_size=16, host_lens=True, splits=4, return_lse=True),
              # rows of 72 and 24 chunks (copy_rows_by_eights): MLA's latent rows, D = 192 beside a V of 128
              decode_case("bf16", 576, 16, 1, mla=True, append=1, splits=3),
              decode_case("fp16", 576, 16, 1, mla=True, paged=True, page_size=64, splits=0),
              decode_case("bf16", 576, 16, 1, mla=True, paged=True, page_size=3, append=1, splits=2),
              decode_case("bf16", 192, 8, 2, dv=128, paged=True, page_size=16, append=1, splits=2),
              decode_case("fp16", 192, 8, 2, splits=3)]
    cases += [merge_case("fp32", 3), merge_case("bf16", 2, stacked=True), merge_case("fp16", 3, given_out=True),
              merge_case("bf16", 3, mixed=True)]
    cases += [bad_decode_case(splits, check_kernel) for check_kernel in (False, True) for splits in (1, 3)]
    cases += [bad_varlen_case(False), bad_varlen_case(True)]
    return cases


CASES = build_cases()


# ----------------------------------------------------------------------------- inside (the cases run here)

MARK = "@@sanitize_all"


class _Deferred(Exception):
    """A kernel that is not compiled yet: noted, the case abandoned, the kernel built in parallel later."""


def _compile_needed(indices, arch):
    """Run the cases with compilation deferred, collect the variants they miss, build those in parallel
    threads; repeat until none is missing (a case meets its kernels one at a time)."""
    from cuflash._build import compile as _compile

    total = 0
    for _ in range(10):
        missing = set()
        real = _compile.compile_cubin

        def defer(variant, arch_, *args, **kwargs):
            missing.add((variant, arch_))
            raise _Deferred()

        _compile.compile_cubin = defer
        try:
            for i in indices:
                if CASES[i].needs and CASES[i].needs != arch:
                    continue
                try:
                    CASES[i].run()
                except Exception:   # _Deferred, or a failure the run below reports
                    pass
        finally:
            _compile.compile_cubin = real
        if not missing:
            break
        start = time.perf_counter()
        results = _compile.build(sorted(missing, key=lambda job: (job[0].family, job[0].label())))
        failed = [f"{v.family} [{v.label()}]: {r}" for v, _, r in results if isinstance(r, Exception)]
        total += len(missing)
        print(f"warm: compiled {len(missing)} kernel variants in {time.perf_counter() - start:.1f} s", flush=True)
        if failed:
            print("warm: compile failures:\n" + "\n".join(failed), flush=True)
            break
    _cp().cuda.Device().synchronize()
    return total


def _context_usable() -> bool:
    cp = _cp()
    try:
        cp.cuda.runtime.deviceSynchronize()
        return float(cp.ones(4, cp.float32).sum()) == 4.0
    except Exception:   # a sticky CUDA error: the context is gone
        return False


def inner(args) -> int:
    cp = _cp()
    from cuflash._build.compile import device_arch

    arch = device_arch()
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    print(f"device: {name.decode() if isinstance(name, bytes) else name} ({arch}), CuPy {cp.__version__}", flush=True)
    indices = [int(i) for i in args.cases.split(",") if i != ""]
    if args.warm:
        _compile_needed(indices, arch)
    if args.sanitized and not args.pool:
        cp.cuda.set_allocator(None)   # each array its own cudaMalloc: memcheck sees past its end
        # Temporaries too, allocated per call rather than in the stream's arena (cuflash/_runtime/launch.py).
        from cuflash._runtime import launch as _launch

        _launch.ARENA_BYTES = 0
    failed = 0
    for i in indices:
        case = CASES[i]
        print(f"{MARK} begin {i}", flush=True)
        start = time.perf_counter()
        sticky = False
        if case.needs and case.needs != arch:
            status, note = "skip", f"needs {case.needs} (this GPU: {arch})"
        else:
            try:
                cp.random.seed(1000 + i)
                note = case.run() or ""
                cp.cuda.Device().synchronize()
                status = "ok"
            except Exception as err:
                traceback.print_exc(file=sys.stdout)
                status, note = "fail", f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
                failed += 1
                sticky = not _context_usable()
        if args.sanitized:
            sys.stdout.flush()
            time.sleep(0.05)   # let the sanitizer's reports of this case reach the pipe before the end marker
        print(f"{MARK} end {i} {status} {time.perf_counter() - start:.2f} {note}".rstrip(), flush=True)
        if sticky:
            print(f"{MARK} sticky", flush=True)
            return 3
    return 1 if failed else 0


# ----------------------------------------------------------------------------- outside (drives the runs)

def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT")]
    roots += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True), "/opt/cuda"]
    for root in filter(None, roots):
        for path in (os.path.join(root, "bin", "compute-sanitizer"),
                     os.path.join(root, "compute-sanitizer", "compute-sanitizer")):
            if os.access(path, os.X_OK):
                return path
    for base in sys.path:   # the nvidia-cuda-sanitizer-api wheel
        for path in (*glob.glob(os.path.join(base, "nvidia", "*", "compute-sanitizer", "compute-sanitizer")),
                     *glob.glob(os.path.join(base, "nvidia", "*", "bin", "compute-sanitizer"))):
            if os.access(path, os.X_OK):
                return path
    return None


_SUMMARY_ERRORS = re.compile(r"(?:ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: .*\((\d+) error)")
_NOT_A_REPORT = re.compile(r"(ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|COMPUTE-SANITIZER|Target application|"
                           r"No kernels were profiled|This tool|Saved host backtrace)")


@dataclasses.dataclass
class Outcome:
    status: str = "not run"   # ok / fail / skip / crashed / not run
    seconds: float = 0.0
    note: str = ""
    errors: int = 0
    warnings: int = 0
    first_report: str = ""


def run_inner(cmd, env, indices, outcomes, quiet_prefix="") -> tuple[int, list[int], list[str]]:
    """Run one inner process over ``indices``; fill ``outcomes``. Returns (exit status, the indices not
    reached, the sanitizer's summary lines)."""
    proc = subprocess.Popen(cmd + ["--cases", ",".join(map(str, indices))], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    current, done, summaries = None, set(), []
    n = len(CASES)
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.startswith(MARK):
            words = line.split(" ", 5)
            if words[1] == "begin":
                current = int(words[2])
            elif words[1] == "end":
                i, status, seconds = int(words[2]), words[3], float(words[4])
                o = outcomes[i]
                o.status, o.seconds, o.note = status, seconds, words[5] if len(words) > 5 else ""
                done.add(i)
                reports = f", {o.errors} sanitizer errors" if o.errors else ""
                reports += f", {o.warnings} warnings" if o.warnings else ""
                print(f"{quiet_prefix}[{i + 1}/{n}] {CASES[i].label}: {status} {seconds:.1f} s{reports}"
                      + (f" ({o.note})" if o.note and status != "ok" else ""), flush=True)
                current = None
            continue
        print(line, flush=True)
        if line.startswith("========= "):
            body = line[len("========= "):]
            if "SUMMARY" in body:
                summaries.append(line)
            if not body or body[0].isspace() or _NOT_A_REPORT.search(body):
                continue
            target = outcomes[current] if current is not None else None
            if target is None:
                summaries.append(f"(outside any case) {line}")
                continue
            if body.startswith("Warning"):
                target.warnings += 1
            else:
                target.errors += 1
            target.first_report = target.first_report or body.strip()
    rc = proc.wait()
    if current is not None and current not in done:
        outcomes[current].status = "crashed"
        outcomes[current].note = f"the process ended in this case (exit {rc})"
        done.add(current)
    return rc, [i for i in indices if i not in done], summaries


def run_all(base_cmd, env, indices, label) -> tuple[dict, list[str], list[int]]:
    """Run the cases, starting a new process after one that ended early (a sticky CUDA error)."""
    outcomes = {i: Outcome() for i in indices}
    summaries, codes, todo = [], [], list(indices)
    while todo:
        rc, rest, lines = run_inner(base_cmd, env, todo, outcomes)
        summaries += lines
        codes.append(rc)
        if rest and rest == todo:   # nothing ran: do not loop
            for i in rest:
                outcomes[i].status, outcomes[i].note = "not run", f"{label} process exited {rc} before it"
            break
        if rest:
            print(f"{label}: the process ended early (exit {rc}); going on from case {rest[0] + 1} in a new one",
                  flush=True)
        todo = rest
    return outcomes, summaries, codes


def result_text(o: Outcome, tool: str) -> str:
    if o.status == "skip":
        return f"skipped: {o.note}"
    parts = []
    if o.errors:
        parts.append(f"{o.errors} {tool} error{'s' if o.errors > 1 else ''} ({o.first_report[:60]})")
    if o.warnings:
        parts.append(f"{o.warnings} warning{'s' if o.warnings > 1 else ''}")
    if o.status in ("fail", "crashed", "not run"):
        parts.append(f"{o.status.upper()}: {o.note}"[:100])
    if not parts:
        parts.append("clean" if tool != "none" else "ok")
        if o.note:
            parts.append(o.note)
    return "; ".join(parts)


def print_table(rows, header=("entry", "family", "options", "result", "s"), cut=110) -> None:
    """Columns padded, the last one right-aligned; options longer than ``cut`` shortened (None: never)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    widths[2] = min(widths[2], cut or widths[2])
    for row in [header, ["-" * w for w in widths], *rows]:
        cells = [str(x) if i != 2 or len(str(x)) <= widths[2] else str(x)[:widths[2] - 3] + "..."
                 for i, x in enumerate(row)]
        print("  ".join(c.ljust(w) if i < len(row) - 1 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(cells, widths))).rstrip(), flush=True)


def select(only) -> list[int]:
    if not only:
        return list(range(len(CASES)))
    return [i for i, c in enumerate(CASES) if any(s.lower() in c.label.lower() for s in only)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool", choices=TOOLS, default="memcheck",
                        help="compute-sanitizer tool, or none (run the cases plainly)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    parser.add_argument("--only", action="append", default=[], metavar="SUBSTRING",
                        help="run the cases whose 'entry family options' contain it (repeatable)")
    parser.add_argument("--no-warm", action="store_true", help="skip the warm pass (kernels already cached)")
    parser.add_argument("--pool", action="store_true", help="keep CuPy's memory pool under the sanitizer")
    parser.add_argument("--sanitizer-args", default="", help="more compute-sanitizer options, one string")
    # Inside: what the script runs in its child processes.
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cases", default="", help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sanitized", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.inner:
        return inner(args)
    indices = select(args.only)
    if args.list:
        print_table([(c.entry, c.family, c.options, c.needs) for c in (CASES[i] for i in indices)],
                    header=("entry", "family", "options", "needs"), cut=None)
        print(f"{len(indices)} cases" + (f" of {len(CASES)}" if len(indices) != len(CASES) else ""))
        return 0
    if not indices:
        print(f"no case matches {args.only}", file=sys.stderr)
        return 2
    sanitizer = None
    if args.tool != "none":
        sanitizer = find_sanitizer()
        if sanitizer is None:
            print("compute-sanitizer not found: not on PATH, nor in $CUDA_HOME/bin, /usr/local/cuda*/bin or the "
                  "nvidia-cuda-sanitizer-api wheel. Install the CUDA toolkit (or pip install "
                  "nvidia-cuda-sanitizer-api) and put compute-sanitizer on PATH.", file=sys.stderr)
            return 2
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    me = [sys.executable, os.path.abspath(__file__), "--inner"]
    start = time.perf_counter()
    warm = None
    if not args.no_warm or args.tool == "none":
        print(f"== warm pass (no sanitizer): compile what {len(indices)} cases need, run each once", flush=True)
        warm, _, _ = run_all(me + (["--warm"] if not args.no_warm else []), env, indices, "warm pass")
    outcomes, summaries, codes = warm, [], [0]
    if sanitizer is not None:
        tool_cmd = [sanitizer, "--tool", args.tool, "--error-exitcode", "1", *shlex.split(args.sanitizer_args)]
        version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True).stdout.strip()
        print(f"== {args.tool}: {' '.join(tool_cmd)} python {os.path.basename(__file__)} ...\n"
              f"   {version.splitlines()[-1] if version else ''}", flush=True)
        outcomes, summaries, codes = run_all(tool_cmd + me + ["--sanitized"] + (["--pool"] if args.pool else []),
                                             env, indices, args.tool)
    tool = args.tool
    rows = [(CASES[i].entry, CASES[i].family, CASES[i].options, result_text(outcomes[i], tool),
             f"{outcomes[i].seconds:.1f}") for i in indices]
    print()
    print_table(rows)
    ran = [o for o in outcomes.values() if o.status != "skip"]
    errors = sum(o.errors for o in ran)
    warnings = sum(o.warnings for o in ran)
    bad = [o for o in ran if o.status != "ok"]
    clean = [o for o in ran if o.status == "ok" and not o.errors]
    stray = [s for s in summaries if s.startswith("(outside")]
    # What the sanitizer itself counted (each process prints its summary), whatever was attributed.
    counted = sum(int(m.group(1) or m.group(2)) for s in summaries for m in [_SUMMARY_ERRORS.search(s)] if m)
    print(f"\n{tool}: {len(indices)} cases, {len(ran)} run, {len(indices) - len(ran)} skipped; {len(clean)} clean, "
          f"{len([o for o in ran if o.errors])} with sanitizer errors ({errors} errors, {warnings} warnings), "
          f"{len(bad)} failed or not run; {time.perf_counter() - start:.0f} s")
    for line in [*dict.fromkeys(s for s in summaries if not s.startswith("(outside")), *stray]:
        print(line)
    if warm is not None and sanitizer is not None:
        warm_bad = [i for i in indices if warm[i].status not in ("ok", "skip")]
        if warm_bad:
            print(f"without the sanitizer, {len(warm_bad)} cases failed: " + ", ".join(str(i + 1) for i in warm_bad))
    odd_exit = [code for code in codes if code not in (0, 1, 3)]   # e.g. killed by a signal
    if odd_exit:
        print(f"a process exited with {odd_exit}")
    return 1 if errors or counted or bad or stray or odd_exit else 0


if __name__ == "__main__":
    sys.exit(main())
