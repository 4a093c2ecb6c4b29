"""Command line: ``python -m cuflash`` (self-check and demo) and ``python -m cuflash precompile``.

``python -m cuflash``
    With a GPU: checks :func:`cuflash.attention` against the float64 reference on small random
    problems (fp16/bf16/fp32, causal, GQA, dropout), then times a large bf16 problem.
    Exit status 1 if a check fails. Without a GPU: says so and exits 0.
``python -m cuflash precompile --arch sm_90a,sm_80 --cache-dir DIR``
    Compiles every kernel variant the dispatcher can pick (no GPU needed), prints registers,
    shared memory and spills, and writes the cubins to DIR (point ``CUFLASH_CACHE_DIR`` at it).
    Exit status 1 if a variant fails to compile or spills registers.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

NO_GPU_MESSAGE = """\
cuflash: no CUDA GPU found; nothing to run here.
On a machine with an NVIDIA GPU, `python -m cuflash` checks cuflash.attention against the
float64 reference and times it. Without one you can still
  run the tests (GPU tests skip):  pip install -e ".[test,cuda13]" && python -m pytest -q tests
  build the kernels ahead of time: python -m cuflash precompile --arch sm_90a,sm_80 --cache-dir DIR"""


def _csv(text, kind=str):
    return None if text is None else [kind(x) for x in text.split(",") if x.strip()]


# ----------------------------------------------------------------------------- precompile

def _precompile(args) -> int:
    from cuflash import _compile
    from cuflash._heuristics import precompile_variants

    archs = _csv(args.arch)
    if not archs:
        try:
            archs = [_compile.device_arch()]
        except RuntimeError:
            archs = ["sm_80", "sm_90a"]  # no GPU: the two targets cuflash tunes for
    cache_dir = args.cache_dir or _compile.user_cache_dir()
    pairs = [(v, a) for a in archs
             for v in dict.fromkeys(precompile_variants(dtypes=_csv(args.dtypes),
                                                        head_dims=_csv(args.head_dims, int), arch=a))]
    src_hash = _compile.source_hash()
    start = time.perf_counter()
    results = _compile.compile_many(pairs, args.threads)

    header = ("family", "arch", "regs", "smem", "stack", "spill st/ld", "sec", "defines")
    rows, failed, notes = [], [], []
    for variant, arch, result in results:
        name = f"{variant.family} [{variant.label()}] {arch}"
        if isinstance(result, Exception):
            failed.append(f"{name}:\n{result}")
            rows.append((variant.family, arch, "-", "-", "-", "ERROR", "-", variant.label()))
            continue
        _compile.store_cubin(_compile.cache_path(cache_dir, variant, arch, src_hash), result.cubin)
        if result.spills:
            failed.append(f"{name}: spills {result.spill_stores} B stored, "
                          f"{result.spill_loads} B loaded")
        notes += [f"{name}: {line}" for line in result.warnings]
        rows.append((variant.family, arch, result.registers, result.smem_static,
                     result.stack_frame, f"{result.spill_stores}/{result.spill_loads}",
                     f"{result.seconds:.1f}", variant.label()))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
    print(f"\n{len(results) - len(failed)}/{len(results)} variants OK for {','.join(archs)} "
          f"in {time.perf_counter() - start:.1f} s -> {cache_dir}")
    sys.stdout.flush()
    for note in dict.fromkeys(notes):
        print(f"note: {note}", file=sys.stderr)
    for failure in failed:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failed else 0


# ----------------------------------------------------------------------------- main job

def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU" here
        return 0


def _random(rng, shape, dtype):
    # Drawn on the host: no CuPy kernel (and so no CUDA headers) is needed for the inputs.
    import cupy

    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))


def _host64(x):
    return np.asarray(x.get() if hasattr(x, "get") else x, dtype=np.float64)


CASES = [
    # name, dtype, (B, Sq, Sk, Hq, Hk, D), options
    ("bf16", "bfloat16", (2, 128, 128, 4, 4, 64), {}),
    ("fp16 causal Sq<Sk", "float16", (1, 100, 257, 4, 4, 128), {"causal": True}),
    ("bf16 GQA 8:2 causal", "bfloat16", (2, 200, 200, 8, 2, 128), {"causal": True}),
    ("fp16 dropout 0.1", "float16", (1, 256, 256, 4, 4, 64), {"dropout_p": 0.1}),
    ("bf16 window softcap", "bfloat16", (1, 300, 300, 2, 1, 64),
     {"window": (64, 16), "softcap": 30.0}),
    ("fp32", "float32", (1, 77, 130, 2, 2, 64), {}),
    ("fp32 causal GQA", "float32", (2, 130, 77, 4, 2, 128), {"causal": True}),
]


def _check_case(name, dtype_name, shape, options, rng) -> bool:
    import cuflash
    import ml_dtypes
    from cuflash import reference

    dtype = ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
    B, Sq, Sk, Hq, Hk, D = shape
    q = _random(rng, (B, Sq, Hq, D), dtype)
    k = _random(rng, (B, Sk, Hk, D), dtype)
    v = _random(rng, (B, Sk, Hk, D), dtype)
    out, lse, rng_state = cuflash.attention_forward(q, k, v, generator=cuflash.Generator(7),
                                                    **options)
    ref_out, ref_lse = reference.attention_forward(q, k, v, rng_state=rng_state, **options)
    out = _host64(out)
    err = float(np.max(np.abs(out - ref_out)))
    seen = np.isfinite(ref_lse)
    lse_err = float(np.max(np.abs(_host64(lse)[seen] - ref_lse[seen]), initial=0.0))
    if dtype_name == "float32":
        rel = float(np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out))
        ok, detail = rel <= 1e-5, f"rel err {rel:.2e} (limit 1e-5)"
    else:
        # The project's rule: at most 2x the error of a plain same-dtype attention, + slack.
        from cuflash.testing import baseline_attention

        base = _host64(baseline_attention(q, k, v, rng_state=rng_state, **options))
        base_err = float(np.max(np.abs(base - ref_out)))
        limit = 2 * base_err + 1e-3
        ok, detail = err <= limit, f"baseline {base_err:.2e}, limit {limit:.2e}"
    ok = ok and lse_err <= 1e-3
    print(f"  {'PASS' if ok else 'FAIL'}  {name:22s} max|out-ref| {err:.2e}  ({detail})  "
          f"max|lse-ref| {lse_err:.1e}")
    return ok


def _demo(rng) -> None:
    import cupy
    import cuflash
    import ml_dtypes

    B, S, H, D = 4, 4096, 16, 128
    q, k, v = (_random(rng, (B, S, H, D), ml_dtypes.bfloat16) for _ in range(3))
    out = cupy.empty_like(q)
    print(f"\ndemo: B={B}, S={S}, H={H}, D={D}, bfloat16 on {_device_name()}")
    for causal in (False, True):
        for _ in range(3):  # warm-up (the first call also loads or compiles the kernel)
            cuflash.attention(q, k, v, causal=causal, out=out)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        reps = 10
        start.record()
        for _ in range(reps):
            cuflash.attention(q, k, v, causal=causal, out=out)
        stop.record()
        stop.synchronize()
        ms = cupy.cuda.get_elapsed_time(start, stop) / reps
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        print(f"  causal={causal!s:5}  {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s")


def _device_name() -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else name


def _main_job() -> int:
    if _gpu_count() == 0:
        print(NO_GPU_MESSAGE)
        return 0
    rng = np.random.default_rng(0)
    print(f"cuflash self-check against the float64 reference on {_device_name()}")
    ok = True
    for case in CASES:
        try:
            ok &= _check_case(*case, rng)
        except Exception as err:  # report every case, then fail
            print(f"  FAIL  {case[0]:22s} {type(err).__name__}: {err}")
            ok = False
    _demo(rng)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cuflash", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command")
    pre = commands.add_parser("precompile", help="compile kernels ahead of time (no GPU needed)")
    pre.add_argument("--arch", help="comma-separated targets, e.g. sm_90a,sm_80 "
                     "(default: this GPU's; without a GPU sm_80,sm_90a)")
    pre.add_argument("--cache-dir", help="where to write the cubins (default: the user cache, "
                     "~/.cache/cuflash); use it later with CUFLASH_CACHE_DIR=DIR")
    pre.add_argument("--dtypes", help="comma-separated subset of float16,bfloat16,float32")
    pre.add_argument("--head-dims", help="comma-separated head dims, e.g. 64,128")
    pre.add_argument("--threads", type=int, help="parallel compilations (default: CPU count)")
    args = parser.parse_args(argv)
    if args.command == "precompile":
        return _precompile(args)
    return _main_job()


if __name__ == "__main__":
    sys.exit(main())
