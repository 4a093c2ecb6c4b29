"""Command line: ``python -m cuflash`` (check and demo), ``doctor`` and ``precompile``.

``python -m cuflash``
    With a GPU: checks :func:`cuflash.attention` against the float64 reference on small random
    problems (fp16/bf16/fp32, causal, GQA, dropout), then times a large bf16 problem.
    Exit status 1 if a check fails. With no GPU at all (no driver, no device) it says so and
    exits 0; with a broken setup (CuPy missing, a driver too old for CuPy's CUDA, ...) it prints
    the error and the fix and exits 1.
``python -m cuflash doctor``
    Reports the GPU, the driver, the CUDA runtime and NVRTC versions, CuPy, the kernel cache,
    and whether a small kernel compiles and runs. Exit status as above.
``python -m cuflash precompile --arch sm_90a,sm_80 --cache-dir DIR``
    Compiles every kernel variant the dispatcher can pick (no GPU needed) that is not cached
    yet and writes the cubins to DIR (point ``CUFLASH_CACHE_DIR`` at it), with one progress line
    and one summary line; ``-v`` adds a table of registers, shared memory, spills and compile
    time per variant, and the compiler's warnings. Exit status 1 if a variant fails to compile or
    spills, 2 for a bad argument.

The command line is a client of the library: nothing in cuflash imports this module.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

NO_GPU_MESSAGE = """\
cuflash: no CUDA GPU found: {reason}; nothing to run here.
Without a GPU you can still
  run the tests (GPU tests skip):  pip install -e ".[test,cuda13]" && python -m pytest -q tests
  build the kernels ahead of time: python -m cuflash precompile --arch sm_90a,sm_80 --cache-dir DIR"""


def _say(text: str = "", file=None) -> None:
    print(text, file=file or sys.stdout, flush=True)


# ----------------------------------------------------------------------------- doctor

# A kernel that includes one of cuflash's headers, so that a pass means NVRTC found the sources.
PROBE_SOURCE = r"""
#include "common.cuh"
extern "C" __global__ void cuflash_probe(float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = float(cuflash::ceil_div(3 * i, 2));
}
"""


def _probe_kernel(arch: str, run: bool) -> tuple[str, str]:
    """Compile the probe kernel for ``arch`` and, if ``run``, launch it on the current device.

    Returns ``(summary, fix)``; ``fix`` is "" when all went well, else the problem and the fix.
    """
    from cuflash._build import compile as _compile, nvrtc as _nvrtc

    start = time.perf_counter()
    try:
        cubin, _ = _nvrtc.compile_to_cubin(PROBE_SOURCE, "probe.cu",
                                           ["-std=c++17", f"-arch={arch}", f"-I{_compile.CUDA_SRC}"])
    except Exception as err:  # libnvrtc missing, headers missing, ...
        lines = [ln for ln in str(err).splitlines() if "error" in ln.lower()] or str(err).splitlines()
        return f"does not compile for {arch}: {lines[0].strip()}", _nvrtc_fix(err)
    summary = f"compiles for {arch} in {time.perf_counter() - start:.2f} s"
    if not run:
        return summary + "; not run (no GPU)", ""
    try:
        import cupy

        with tempfile.TemporaryDirectory(prefix="cuflash-probe-") as tmp:
            path = Path(tmp) / "probe.cubin"
            path.write_bytes(cubin)
            kernel = cupy.RawModule(path=str(path)).get_function("cuflash_probe")
            out = cupy.full(64, -1.0, dtype=cupy.float32)
            kernel((1,), (64,), (out, np.int32(64)))
            got = out.get()
        want = np.array([(3 * i + 1) // 2 for i in range(64)], dtype=np.float32)
        if not np.array_equal(got, want):
            return summary + "; runs but computes wrong values", "report this: python -m cuflash doctor"
    except Exception as err:  # the driver refused the cubin or the launch
        return summary + f"; does not run: {str(err).splitlines()[0]}", _load_fix()
    return summary + "; runs: ok", ""


def _nvrtc_fix(err: Exception) -> str:
    from cuflash._build.cuda_status import driver_cuda_version, extra_for

    if "libnvrtc not found" in str(err):
        return f"{err}".replace("cuflash: ", "")
    return f"reinstall the NVRTC package: {extra_for(driver_cuda_version())}"


def _load_fix() -> str:
    from cuflash._build import nvrtc as _nvrtc
    from cuflash._build.cuda_status import driver_cuda_version, extra_for

    driver = driver_cuda_version()
    try:
        nvrtc = _nvrtc.version()
    except Exception:  # already reported by the compile step
        nvrtc = None
    if driver and nvrtc and nvrtc[0] > driver[0]:
        return (f"NVRTC {nvrtc[0]}.{nvrtc[1]} makes cubins the driver (CUDA {driver[0]}.{driver[1]}) "
                f"cannot load: {extra_for(driver)}")
    return "check `nvidia-smi`; if it works, report this error"


def _driver_version() -> str | None:
    """The NVIDIA driver's own version (e.g. ``580.65.06``): /proc on Linux, else NVML."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", text)
        if m:
            return m.group(1)
    except OSError:
        pass
    import ctypes

    try:
        nvml = ctypes.CDLL("nvml.dll" if platform.system() == "Windows" else "libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        buf = ctypes.create_string_buffer(96)
        ok = nvml.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(96)) == 0
        nvml.nvmlShutdown()
        return buf.value.decode() if ok else None
    except (OSError, AttributeError):
        return None


def _gpu_lines(count: int) -> list[str]:
    import cupy

    from cuflash._build.arch import arch_for

    lines = []
    for i in range(count):
        props = cupy.cuda.runtime.getDeviceProperties(i)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        cc = props["major"] * 10 + props["minor"]
        lines.append(f"{i}: {name}, compute {props['major']}.{props['minor']} ({arch_for(cc)}), "
                     f"{props['totalGlobalMem'] / 2**30:.0f} GiB")
    return lines


def _cache_line() -> str:
    from cuflash._build import cache as _cache, compile as _compile

    src_hash = _compile.source_hash()
    parts = []
    for directory in _cache.cache_dirs():
        cubins = len(list(directory.glob(f"*/*-{src_hash}.cubin"))) if directory.is_dir() else 0
        probe = directory
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        writable = "writable" if os.access(probe, os.W_OK) else "read only"
        parts.append(f"{directory} ({writable}, {cubins} cubins for these sources)")
    return "; ".join(parts)


def _versions(v) -> str:
    return f"{v[0]}.{v[1]}" if v else "unknown"


def _doctor(verbose: bool = True) -> tuple[int, str]:
    """Print the report (``verbose``) or only what is wrong; return the exit status and the
    state of CUDA (see :class:`cuflash._build.cuda_status.CudaStatus`)."""
    import cuflash
    from cuflash._build import arch as _arch, nvrtc as _nvrtc
    from cuflash._build.cuda_status import cuda_status, cupy_distribution
    from cuflash._version import __version__

    status = cuda_status()
    rows = [("cuflash", f"{__version__} ({Path(cuflash.__file__).parent}), "
                        f"Python {platform.python_version()}")]
    if status.state == "ok":
        for k, line in enumerate(_gpu_lines(status.devices)):
            rows.append(("GPU" if k == 0 else "", line))
    else:
        rows.append(("GPU", {"no-gpu": f"none: {status.reason}", "no-cupy": "unknown (no CuPy)",
                             "broken": "not usable (see below)"}[status.state]))
    driver = _driver_version()
    rows.append(("driver", (f"{driver or 'installed'}, supports CUDA {_versions(status.driver_cuda)}"
                            if status.driver_cuda else "none (libcuda not found)")))
    try:
        nvrtc = f"NVRTC {_versions(_nvrtc.version())} ({_nvrtc.library()})"
    except Exception as err:  # reported by the probe below as well
        nvrtc = f"NVRTC not found: {str(err).splitlines()[0]}"
    rows.append(("CUDA", f"runtime {_versions(status.runtime_cuda)} (CuPy's), {nvrtc}"
                 if status.runtime_cuda else nvrtc))
    if status.state == "no-cupy":
        rows.append(("CuPy", "not installed"))
    else:
        try:
            import cupy

            rows.append(("CuPy", f"{cupy.__version__} ({cupy_distribution(status.runtime_cuda)})"))
        except Exception as err:  # a CuPy that fails to import: cuda_status has the error
            rows.append(("CuPy", f"fails to import: {str(err).splitlines()[0]}"))
    rows.append(("cache", _cache_line()))
    arch = _arch.device_arch() if status.state == "ok" else "sm_80"
    summary, fix = _probe_kernel(arch, run=status.state == "ok")
    rows.append(("kernel", summary))

    if verbose:
        for key, value in rows:
            _say(f"  {key:8} {value}")
    # The first cause only: a kernel that does not run usually follows from a broken setup.
    problem = (status.message() if status.state in ("no-cupy", "broken")
               else f"cuflash: a test kernel {summary}\nfix: {fix}" if fix else "")
    if problem:  # the doctor's report is one text on stdout; the main job's error goes to stderr
        _say(problem if verbose else f"{problem}\ndetails: python -m cuflash doctor",
             None if verbose else sys.stderr)
        return 1, status.state
    if status.state == "no-gpu":
        _say("no CUDA GPU here, nothing broken: kernels still compile (python -m cuflash "
             "precompile) and the CPU tests run" if verbose
             else NO_GPU_MESSAGE.format(reason=status.reason))
        return 0, status.state
    if verbose:
        _say("ok: cuflash compiles and runs its kernels here")
    return 0, status.state


# ----------------------------------------------------------------------------- precompile

DTYPE_ALIASES = {"float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
                 "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32"}


class UsageError(ValueError):
    """A bad command-line argument: reported in one line, exit status 2."""


def _csv(text) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def _parse_dtypes(text):
    if text is None:
        return None
    out = []
    for name in _csv(text) or [""]:
        if name.lower() not in DTYPE_ALIASES:
            raise UsageError(f"--dtypes {name!r}: expected float16 (fp16), bfloat16 (bf16) "
                             "or float32 (fp32)")
        out.append(DTYPE_ALIASES[name.lower()])
    return list(dict.fromkeys(out))


def _compiled_head_dims() -> list[int]:
    """Every head dim some kernel family is compiled for; a call's head dim runs the next one up
    of its family, so only these name a kernel to precompile."""
    from cuflash.kernels import bwd_sm90, decode, fwd_simt, fwd_sm80, fwd_sm90

    return sorted({*fwd_sm80.SM80_HEAD_DIMS, *fwd_sm90.SM90_HEAD_DIMS, *fwd_simt.SIMT_HEAD_DIMS,
                   *bwd_sm90.BWD_SM90_HEAD_DIMS, *decode.DECODE_MMA_HEAD_DIMS,
                   *decode.DECODE_SIMT_HEAD_DIMS})


def _parse_head_dims(text):
    if text is None:
        return None
    supported = _compiled_head_dims()
    out = []
    for item in _csv(text) or [""]:
        if not item.isdigit() or int(item) not in supported:
            # Not silently the next one up: the user would believe D = 100 has a kernel of its own.
            raise UsageError(f"--head-dims {item!r}: expected some of {','.join(map(str, supported))} "
                             "(the head dims kernels are compiled for; a call with another head dim "
                             "runs the next one up)")
        out.append(int(item))
    return list(dict.fromkeys(out))


def _parse_families(text, known):
    if text is None:
        return None
    names = _csv(text)
    unknown = [n for n in names if n not in known] or ([""] if not names else [])
    if unknown:
        raise UsageError(f"--families {unknown[0]!r}: expected some of {', '.join(sorted(known))}")
    return names


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.1f}".removesuffix(".0")


def _default_archs() -> tuple[list[str], str]:
    """This GPU's target, or without a usable GPU the two targets cuflash tunes for; and a note
    for the summary saying why, when it is the latter."""
    from cuflash._build import arch as _arch
    from cuflash._build.cuda_status import cuda_status

    if cuda_status().state == "ok":
        return [_arch.device_arch()], ""
    return ["sm_80", "sm_90a"], " (no usable GPU here; --arch picks the targets)"


def _precompile_jobs(args):
    """Validate the arguments (UsageError) and list the (variant, arch) jobs."""
    from cuflash._build import arch as _arch, cache as _cache, compile as _compile

    dtypes = _parse_dtypes(args.dtypes)
    head_dims = _parse_head_dims(args.head_dims)
    families = _parse_families(args.families, {p.stem for p in _compile.CUDA_SRC.glob("*.cu")})
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads {args.threads}: expected 1 or more")
    try:
        archs = _arch.parse_archs(args.arch, "--arch") if args.arch is not None else None
    except ValueError as err:
        raise UsageError(str(err)) from None
    cache_dir = Path(args.cache_dir) if args.cache_dir else _cache.user_cache_dir()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--cache-dir {cache_dir}: {err.strerror}") from None
    if not os.access(cache_dir, os.W_OK):
        raise UsageError(f"--cache-dir {cache_dir}: not writable")

    from cuflash.kernels.catalogue import precompile_variants

    note = ""
    if archs is None:
        archs, note = _default_archs()
    jobs = []
    for arch in archs:
        for variant in precompile_variants(dtypes=dtypes, head_dims=head_dims, arch=arch):
            if families is None or variant.family in families:
                jobs.append((variant, arch))
    return archs, note, cache_dir, list(dict.fromkeys(jobs))


def _table(results, archs) -> list[str]:
    """``-v``: one row per variant (registers, shared memory static+dynamic, spills, seconds)
    and its full defines under it."""
    header = ("family", "arch", "config", "regs", "smem KiB", "spills", "sec")
    order = {a: i for i, a in enumerate(archs)}
    rows = []
    for variant, arch, result in sorted(results, key=lambda r: (order[r[1]], r[0].family)):
        if isinstance(result, Exception):
            rows.append((variant.family, arch, variant.describe(), "-", "-", "FAILED", "-"))
        else:
            smem = f"{_kib(result.smem_static)}+{_kib(result.smem_dynamic)}"
            spills = f"{result.spill_stores}/{result.spill_loads}" if result.spills else "0"
            sec = "cached" if result.cached else f"{result.seconds:.1f}"
            regs = result.registers if result.registers >= 0 else "?"
            rows.append((variant.family, arch, variant.describe(), regs, smem, spills, sec))
        rows.append(("", "", variant.label(), "", "", "", ""))
    right = {3, 4, 5, 6}
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(x).rjust(w) if i in right else str(x).ljust(w)
                      for i, (x, w) in enumerate(zip(row, widths))).rstrip()
            for row in [header, *rows]]


def _precompile(args) -> int:
    from cuflash._build import compile as _compile, nvrtc as _nvrtc
    from cuflash._build.progress import Progress, summary

    try:
        _nvrtc.version()
    except RuntimeError as err:  # libnvrtc missing: nothing can be compiled
        _say(f"python -m cuflash precompile: {str(err).removeprefix('cuflash: ')}", sys.stderr)
        return 1
    try:
        archs, note, cache_dir, jobs = _precompile_jobs(args)
    except UsageError as err:
        _say(f"python -m cuflash precompile: error: {err}", sys.stderr)
        return 2
    start = time.perf_counter()
    progress = Progress(archs, "precompile")
    try:
        results = _compile.build(jobs, cache_dir, args.force, args.threads, progress, progress.start)
    finally:
        progress.close()

    failed, spilled, notes = [], [], []
    for variant, arch, result in results:
        name = f"{variant.family} {arch} {variant.describe()}"
        if isinstance(result, Exception):
            lines = [ln.strip() for ln in str(result).splitlines()]
            errors = [ln for ln in lines if "error" in ln.lower()] or lines
            failed.append(f"FAILED {name}: " + ("\n".join(lines) if args.verbose
                                                else "; ".join(errors[:2])))
            continue
        if result.spills:
            spilled.append(f"SPILLS {name}: {result.spill_stores} B stored, "
                           f"{result.spill_loads} B loaded")
        notes += [f"note: {name}: {line.strip()}" for line in result.warnings]
    fresh = [(v, a, r) for v, a, r in results if isinstance(r, _compile.CompileResult) and not r.cached]
    if args.verbose:
        for line in _table(results, archs):
            _say(line)
        if fresh:  # what a first call waits for at most
            v, a, r = max(fresh, key=lambda job: job[2].seconds)
            _say(f"slowest compile: {r.seconds:.1f} s ({v.family} {a} {v.describe()})")
        # The compiler's warnings (an unused constant, a serialised wgmma), cached variants' too.
        for line in dict.fromkeys(notes):
            _say(line, sys.stderr)
    _say(summary(results, archs, cache_dir, time.perf_counter() - start, "precompile", note))
    for line in [*spilled, *failed]:
        _say(line, sys.stderr)
    return 1 if failed or spilled else 0


# ----------------------------------------------------------------------------- main job

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
    code, state = _doctor(verbose=False)  # silent when all is well
    if code or state != "ok":
        return code
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
    parser = argparse.ArgumentParser(
        prog="python -m cuflash",
        description="Without a command: check the setup, then check cuflash.attention against the "
                    "float64 reference and time it on the GPU.")
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("doctor", help="report GPU, driver, CUDA, NVRTC, CuPy and the cache; "
                        "compile and run a small kernel")
    pre = commands.add_parser("precompile", help="compile kernels ahead of time (no GPU needed)")
    pre.add_argument("--arch", help="comma-separated targets, e.g. sm_90a,sm_80 "
                     "(default: this GPU's; without a GPU sm_80,sm_90a)")
    pre.add_argument("--cache-dir", help="where to write the cubins (default: the user cache, "
                     "~/.cache/cuflash); use it later with CUFLASH_CACHE_DIR=DIR")
    pre.add_argument("--dtypes", help="comma-separated: fp16,bf16,fp32 (or float16,bfloat16,float32)")
    pre.add_argument("--head-dims", help="comma-separated, among the head dims kernels are compiled "
                     f"for: {','.join(map(str, _compiled_head_dims()))} (default: 64,128,256)")
    pre.add_argument("--families", help="comma-separated kernel families, e.g. fwd_sm90,decode")
    pre.add_argument("--threads", type=int, help="parallel compilations (default: CPU count)")
    pre.add_argument("--force", action="store_true", help="recompile variants already cached")
    pre.add_argument("-v", "--verbose", action="store_true",
                     help="a table of registers, shared memory, spills and compile time per "
                          "variant; the compiler's warnings; full NVRTC logs of failures")
    args = parser.parse_args(argv)
    if args.command == "precompile":
        return _precompile(args)
    if args.command == "doctor":
        return _doctor(verbose=True)[0]
    return _main_job()


if __name__ == "__main__":
    sys.exit(main())
