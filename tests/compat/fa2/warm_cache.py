"""Compile, ahead of the FA2 suite, every cuflash kernel variant that suite can reach.

FlashAttention-2's tests sweep head dims 32..256, fp16/bf16, and every combination of ALiBi,
softcap, dropout and deterministic backward; each combination is a separate cuflash kernel
variant, compiled by NVRTC on first use (a featured fwd_sm90 variant takes ~40 s of one CPU core).
Compiling them one by one inside the tests would spend the whole time budget on NVRTC, so the
runner fills a cache directory first, in parallel, and points ``CUFLASH_CACHE_DIR`` at it.

NVRTC needs no GPU, so the cache can also be built on a CPU machine and carried along
(``python tests/compat/fa2/warm_cache.py --arch sm_90a --cache-dir .devrun/cuflash-cache``).
Cubins are keyed by a hash of ``cuda_src/``: after a kernel change the old ones simply miss.

This lists variants through ``cuflash.kernels`` (private: the plan functions the dispatcher
itself calls). If those change shape, the warm-up lists fewer variants and the tests compile the
rest on first use: slower, never wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

#: Head dims of FA2's test_flash_attn.py (d parameters), rounded up to cuflash's multiple of 8.
FA2_HEAD_DIMS = (16, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
FA2_DTYPES = ("float16", "bfloat16")


def fa2_variants(dtypes=FA2_DTYPES, head_dims=FA2_HEAD_DIMS):
    """The kernel variants FA2's suite can reach on an sm_90a GPU (and the sm80 fallbacks).

    Forward fwd_sm90 and fwd_sm80, backward bwd_sm80 (both passes), each with and without score
    modifiers and dropout in all four combinations; decode (contiguous, paged, plain, modified),
    merges, the backward pre/post kernels and the index check.
    """
    from cuflash import kernels

    pads = sorted({-(-d // 8) * 8 for d in head_dims})
    out = []
    for dtype in dtypes:
        out += [kernels.bwd_common.bwd_preprocess_variant(dtype), kernels.bwd_common.bwd_convert_variant(dtype)]
        for d in pads:
            for mods in (False, True):
                for dropout in (False, True):
                    for family in ("fwd_sm90", "fwd_sm80"):
                        out.append(kernels.forward.forward_plan(family, dtype, d, score_mods=mods, dropout=dropout).variant)
                    for dq_pass in (False, True):
                        out.append(kernels.backward.backward_plan("bwd_sm80", dtype, d, dq_pass=dq_pass, score_mods=mods,
                                                   dropout=dropout).variant)
    out += kernels.decode.decode_precompile_variants(dtypes, pads)
    out.append(kernels.check_indices.check_indices_variant())
    return sorted(dict.fromkeys(out), key=_expected_cost, reverse=True)


def _expected_cost(variant):
    """Rough NVRTC time rank, so the thread pool starts the longest compiles first (a fwd_sm90
    variant with score modifiers takes 40-60 s of one core; most others 1-5 s)."""
    defines = dict(variant.defines)
    featured = defines.get("CUFLASH_SCORE_MODS", 0) or defines.get("CUFLASH_DROPOUT", 0)
    if variant.family == "fwd_sm90":
        return 3 if defines.get("CUFLASH_SCORE_MODS", 0) else 1
    return 2 if featured and variant.family in ("bwd_sm80", "decode") else 0


def warm(cache_dir, arch=None, threads=None, dtypes=FA2_DTYPES, head_dims=FA2_HEAD_DIMS, log=sys.stderr):
    """Compile the variants of :func:`fa2_variants` missing from ``cache_dir``.

    Returns (number of variants, number compiled now, seconds). Never raises for a variant that
    fails to compile (the test that needs it will fail and say why); prints one line per outcome.
    """
    import cuflash

    t0 = time.perf_counter()
    try:
        variants = fa2_variants(dtypes, head_dims)
    except Exception as err:   # private heuristics changed: let the tests compile on first use
        print(f"warm-up: could not list variants ({type(err).__name__}: {err}); compiling on first use",
              file=log)
        return 0, 0, 0.0
    os.makedirs(cache_dir, exist_ok=True)
    try:
        results = cuflash.precompile(variants=variants, arch=arch, threads=threads, cache_dir=cache_dir)
        compiled = len(results)
    except RuntimeError as err:
        print(f"warm-up: {err}", file=log)
        compiled = -1
    seconds = time.perf_counter() - t0
    print(f"warm-up: {len(variants)} variants for {arch or 'this GPU'} in {cache_dir}: "
          f"{'some failed' if compiled < 0 else f'{compiled} compiled now'}, {seconds:.0f} s", file=log)
    return len(variants), compiled, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=".devrun/cuflash-cache")
    parser.add_argument("--arch", default=None, help="e.g. sm_90a (default: this GPU's)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--list", action="store_true", help="only list the variants")
    args = parser.parse_args(argv)
    if args.list:
        for v in fa2_variants():
            print(v.family, v.label())
        return 0
    warm(args.cache_dir, args.arch, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
