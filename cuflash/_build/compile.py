"""Build and load cuflash's kernels: the one place where CUDA modules are made.

A kernel *variant* (:class:`cuflash._build.variant.Variant`) is a family (``cuda_src/<family>.cu``,
entry point ``cuflash_<family>``) plus the ``-D`` defines that fix its compile-time configuration.
Every variant is compiled by libnvrtc (:mod:`cuflash._build.nvrtc`) to a cubin for one exact
architecture (:mod:`cuflash._build.arch`); this works without a GPU, so CI and ``python -m cuflash
precompile`` build the same binaries a GPU would load.

Cubins are kept in the on-disk cache (:mod:`cuflash._build.cache`) under a name that covers the NVRTC
version and every option (the defines among them) and a hash of every file in ``cuda_src/``:
another libnvrtc (the ``cuda12`` and ``cuda13`` extras), another option or an edited header never
reuses a stale binary. :func:`get_kernel` loads a variant on the current device, from the cache
or compiled on a miss, once per process; :func:`build` and :func:`precompile` compile many at
once, ahead of time.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from cuflash._build import cache as _cache, nvrtc as _nvrtc
from cuflash._build.arch import device_arch, parse_archs
from cuflash._build.progress import Progress, summary
from cuflash._build.variant import Variant


__all__ = ["CUDA_SRC", "CompileResult", "source_hash", "nvrtc_options", "compile_cubin",
           "variant_source", "cache_path", "find_cubin", "store_cubin", "cached_result", "get_kernel",
           "current_device", "compile_notice", "default_threads", "compile_many", "build",
           "precompile"]


def _find_cuda_src() -> Path:
    # Installed wheel: cuflash/cuda_src (package data). Source tree or editable install:
    # <repo>/cuda_src next to the package.
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "cuda_src", package.parent / "cuda_src"):
        if candidate.is_dir():
            return candidate
    return package / "cuda_src"


CUDA_SRC: Path = _find_cuda_src()
_SOURCE_SUFFIXES = (".cu", ".cuh", ".h")  # what the wheel ships, so hashes agree everywhere


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """A cubin and what ptxas said about it (sizes in bytes).

    ``cached`` is True for a result read back from the cache (``seconds`` is then the time the
    original compilation took).
    """

    cubin: bytes
    log: str
    registers: int
    spill_stores: int
    spill_loads: int
    smem_static: int
    stack_frame: int = 0
    variant: Variant | None = None
    arch: str = ""
    seconds: float = 0.0
    cached: bool = False

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def smem_dynamic(self) -> int:
        """Bytes of dynamic shared memory the launch asks for: the ``CUFLASH_SMEM_BYTES`` define
        (each kernel ``static_assert``s it against its own layout), 0 without one."""
        return dict(self.variant.defines).get("CUFLASH_SMEM_BYTES", 0) if self.variant else 0

    @property
    def warnings(self) -> list[str]:
        """Log lines worth a human's eye (compiler warnings, ptxas performance notes such as
        serialised wgmma)."""
        return [ln for ln in self.log.splitlines()
                if ("warning" in ln.lower() and not ln.startswith("Remark"))
                or "Performance Loss" in ln]


def source_hash(src_dir=None) -> str:
    """sha256 (first 16 hex digits) over the names and bytes of the sources in ``src_dir``
    (default CUDA_SRC)."""
    digest = hashlib.sha256()
    for path in sorted(Path(src_dir or CUDA_SRC).iterdir()):
        if path.is_file() and path.suffix in _SOURCE_SUFFIXES:
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def nvrtc_options(variant: Variant, arch: str, src_hash: str | None = None, src_dir=None) -> list[str]:
    """NVRTC options for ``variant`` on ``arch`` (e.g. ``"sm_90a"``, ``"sm_80"``), with headers
    from ``src_dir`` (default CUDA_SRC; another tree is for benchmarks/ab_forward.py).

    The source hash is passed as ``-DCUFLASH_SRC_HASH`` so that the options, and anything
    keyed on them, change whenever a source does.
    """
    src_dir = src_dir or CUDA_SRC
    src_hash = src_hash or source_hash(src_dir)
    # A variant with generated source (a user modifier) names its hash, so that every key made of the
    # options (the cache path, the cached report) tells two expressions apart.
    user = [f"-DCUFLASH_USER_SOURCE=0x{variant.source_key}"] if variant.source else []
    return ["-std=c++17", f"-arch={arch}", f"-I{src_dir}", f"-DCUFLASH_SRC_HASH=0x{src_hash}",
            "--ptxas-options=-v", *(f"-D{k}={v}" for k, v in variant.defines), *user]


def variant_source(variant: Variant, source_text: str, name: str) -> str:
    """The text NVRTC compiles for ``variant``: the family's source ``source_text`` (file ``name``),
    after the variant's generated functions when it has them (a ``#line`` keeps the file's own line
    numbers in NVRTC's messages)."""
    if not variant.source:
        return source_text
    return f'{variant.source}\n#line 1 "{name}"\n{source_text}'



def _result(variant, arch, cubin, log, seconds, cached=False) -> CompileResult:
    try:
        usage = _nvrtc.parse_ptxas_log(log, variant.entry)
    except ValueError:
        # Seen with the NVRTC of a GPU machine: a good cubin and an empty log. The cubin is what
        # the launch path needs; registers = -1 says "no report" (the CI test requires one).
        usage = dict(registers=-1, spill_stores=0, spill_loads=0, smem_static=0, stack_frame=0)
    return CompileResult(cubin=cubin, log=log, variant=variant, arch=arch, seconds=seconds,
                         cached=cached, **usage)


def compile_cubin(variant: Variant, arch: str, src_hash: str | None = None, src_dir=None) -> CompileResult:
    """Compile one variant for one architecture with libnvrtc (no GPU needed), from the sources
    in ``src_dir`` (default CUDA_SRC).

    Raises
    ------
    ValueError
        If the family has no source file.
    RuntimeError
        If NVRTC fails; the message holds its log.
    """
    source = Path(src_dir or CUDA_SRC) / f"{variant.family}.cu"
    if not source.is_file():
        raise ValueError(f"unknown kernel family {variant.family!r}: {source} does not exist")
    start = time.perf_counter()
    cubin, log = _nvrtc.compile_to_cubin(variant_source(variant, source.read_text(), source.name), source.name,
                                         nvrtc_options(variant, arch, src_hash, src_dir))
    return _result(variant, arch, cubin, log, time.perf_counter() - start)


@functools.lru_cache(maxsize=None)  # the libnvrtc in use is chosen once per process
def _nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc.version())


# ----------------------------------------------------------------------------- the cache, by variant

def cache_path(cache_dir, variant: Variant, arch: str, src_hash: str | None = None) -> Path:
    """``cache_dir/<arch>/<family>-<options hash>-<source hash>.cubin``.

    The options hash covers the NVRTC version and the options (defines and arch included), so
    that another libnvrtc or another option never reuses a binary.
    """
    return _cache.entry_path(cache_dir, arch, variant.family,
                             [_nvrtc_version(), _portable(variant, arch)], src_hash or source_hash())


def _portable(variant: Variant, arch: str) -> list[str]:
    # The options minus the include path (it differs between a checkout and a wheel) and the
    # source hash (already in the file name).
    return [o for o in nvrtc_options(variant, arch, "0") if not o.startswith("-I")]


def find_cubin(variant: Variant, arch: str, src_hash: str | None = None) -> Path | None:
    """The cached cubin for ``variant`` on ``arch`` built from the current sources, or None.

    Looks in ``$CUFLASH_CACHE_DIR``, the user cache, then the temporary cache
    (:func:`cuflash._build.cache.find`); a cubin that does not match its report is never returned.
    """
    return _cache.find(cache_path("", variant, arch, src_hash or source_hash()))


def store_cubin(path, cubin: bytes, result: CompileResult | None = None) -> Path:
    """Write ``cubin`` to ``path`` atomically, with its report beside it (the NVRTC version, the
    cubin's length and sha256; with ``result``, also the options and the ptxas log read back by
    :func:`cached_result`)."""
    report = {"nvrtc": list(_nvrtc_version())}
    if result is not None:
        report.update(options=_portable(result.variant, result.arch), log=result.log,
                      seconds=round(result.seconds, 3))
    return _cache.store(path, cubin, report)


def cached_result(cache_dir, variant: Variant, arch: str, src_hash: str | None = None) -> CompileResult | None:
    """The cached cubin of ``variant`` with its ptxas report, as a CompileResult
    (``cached=True``); None when either is missing or the cubin does not match its report
    (then the variant should be compiled again). Another NVRTC version or other options look
    under another name (see :func:`cache_path`)."""
    found = _cache.read(cache_path(cache_dir, variant, arch, src_hash))
    if found is None:
        return None
    cubin, report = found
    return _result(variant, arch, cubin, report.get("log", ""), report.get("seconds", 0.0), True)


# ----------------------------------------------------------------------------- loading

_kernels: dict = {}
_key_locks: defaultdict = defaultdict(threading.Lock)
_key_locks_guard = threading.Lock()


def current_device() -> int:
    """The id of CuPy's current CUDA device."""
    import cupy

    return cupy.cuda.runtime.getDevice()


def get_kernel(variant: Variant):
    """The ``cupy.RawKernel`` for ``variant`` on the current device, memoised per
    (variant, arch, device); thread-safe, and each variant is built at most once per process.

    Looks for a cached cubin (see :func:`find_cubin`); if none, compiles it and stores it in
    the user cache, or when that is not writable in ``<temp dir>/cuflash-<uid>`` (a private
    directory of this user's, reused by their later processes).

    Per device, because a module is loaded into one device's context: a RawKernel would load
    itself on another device lazily from its cubin's path, at its first use there, past the
    checks and the rebuild of :func:`_load` (a cubin deleted or cut short since would fail there).
    Here each device's first call finds (or rebuilds) the cubin and loads it. Function handles
    and attributes (the shared-memory limit) are per device as well: see
    :func:`cuflash._runtime.launch.prepare_kernel`.
    """
    arch = device_arch()
    key = (variant, arch, current_device())
    if key in _kernels:
        return _kernels[key][1]
    with _key_locks_guard:
        lock = _key_locks[key]
    with lock:
        if key not in _kernels:
            _kernels[key] = _load(variant, arch)
    return _kernels[key][1]


NOTICE_SECONDS = 1.0


def compile_notice(variant: Variant, arch: str, seconds: float, path, file=None) -> None:
    """One line on stderr when a call waited more than a second for a compile: what, how long, and
    that it is paid once (``python -m cuflash precompile`` pays it ahead of time)."""
    if seconds < NOTICE_SECONDS:
        return
    print(f"cuflash: compiled {variant.family} ({variant.describe()}, {arch}) in {seconds:.1f} s, once; "
          f"cached in {Path(path).parent}", file=file or sys.stderr)


# Driver errors that a rebuild mends: CUDA_ERROR_INVALID_IMAGE (a cubin bad from the start,
# which its report vouches for all the same), CUDA_ERROR_FILE_NOT_FOUND (deleted by another
# process since the lookup). Others (a dead context, a driver too old) would only fail again.
_REBUILD_ON = (200, 301)


def _load(variant: Variant, arch: str):
    import cupy

    src_hash = source_hash()
    path = find_cubin(variant, arch, src_hash)
    if path is not None:
        try:
            return _module(path, variant)
        except cupy.cuda.driver.CUDADriverError as err:
            if err.status not in _REBUILD_ON:
                raise
            _cache.discard(path)  # and build it again, once
    result = compile_cubin(variant, arch, src_hash)
    path = _store_compiled(result, src_hash)
    compile_notice(variant, arch, result.seconds, path)
    return _module(path, variant)


def _module(path: Path, variant: Variant):
    import cupy

    module = cupy.RawModule(path=str(path))
    # Keep the module with its kernel: the kernel's function handle lives in the module.
    return module, module.get_function(variant.entry)


def _store_compiled(result: CompileResult, src_hash: str) -> Path:
    """Store a cubin that :func:`get_kernel` compiled: in the user cache, else in the temporary
    cache, else (someone else holds its name) in a new private directory: RawModule loads from
    a path."""
    variant, arch = result.variant, result.arch
    try:
        return store_cubin(cache_path(_cache.user_cache_dir(), variant, arch, src_hash), result.cubin,
                           result)
    except OSError:  # a read-only home, a full disk
        pass
    directory = _cache.temp_cache_dir(create=True) or tempfile.mkdtemp(prefix="cuflash-")
    return store_cubin(cache_path(directory, variant, arch, src_hash), result.cubin, result)


# ----------------------------------------------------------------------------- building many

def default_threads() -> int:
    """Parallel compilations by default: the CPUs this process may run on. NVRTC releases the
    GIL, so threads compile in parallel (measured on 2 cores: the 94 variants of the CPU test
    in 97 s of wall time for 195 s of CPU time)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def compile_many(jobs, threads: int | None = None, progress=None):
    """Compile ``(variant, arch)`` jobs in parallel threads (NVRTC releases the GIL).

    Parameters
    ----------
    jobs : iterable of (Variant, str)
    threads : int, optional
        Default: :func:`default_threads`.
    progress : callable, optional
        Called in the calling thread as each job finishes, with
        ``(done, total, variant, arch, result_or_exception)``.

    Returns
    -------
    list of (Variant, str, CompileResult or Exception)
        In the order of ``jobs``; a failed job carries its exception instead of a result.
    """
    jobs = list(jobs)
    if not jobs:
        return []
    results = [None] * len(jobs)
    with ThreadPoolExecutor(max_workers=min(len(jobs), threads or default_threads())) as pool:
        futures = {pool.submit(compile_cubin, *job): i for i, job in enumerate(jobs)}
        for done, future in enumerate(as_completed(futures), 1):
            i = futures[future]
            try:
                outcome = future.result()
            except Exception as err:  # reported per job; the caller decides what fails
                outcome = err
            results[i] = (*jobs[i], outcome)
            if progress is not None:
                progress(done, len(jobs), *results[i])
    return results


def build(jobs, cache_dir=None, force=False, threads=None, progress=None, started=None):
    """Compile what is not cached yet and store it: the cache-aware :func:`compile_many`.

    Parameters
    ----------
    jobs : iterable of (Variant, str)
    cache_dir : path, optional
        Default: the user cache.
    force : bool
        Compile even what is cached.
    threads, progress
        As for :func:`compile_many` (``progress`` is called for compiled jobs only).
    started : callable, optional
        Called once the cache has been looked at, before the first compilation, with
        ``(to compile, found in cache)`` (:class:`cuflash._build.progress.Progress` draws its
        line then).

    Returns
    -------
    list of (Variant, str, CompileResult or Exception)
        In the order of ``jobs`` (duplicates dropped); results read from the cache have
        ``cached=True``. Compiled cubins are written to ``cache_dir`` with their reports.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else _cache.user_cache_dir()
    src_hash = source_hash()
    jobs = list(dict.fromkeys(jobs))
    found = {} if force else {job: cached_result(cache_dir, *job, src_hash) for job in jobs}
    todo = [job for job in jobs if found.get(job) is None]
    if started is not None:
        started(len(todo), len(jobs) - len(todo))

    def store(done, total, variant, arch, result):
        if not isinstance(result, Exception):
            store_cubin(cache_path(cache_dir, variant, arch, src_hash), result.cubin, result)
        if progress is not None:
            progress(done, total, variant, arch, result)

    compiled = {(v, a): r for v, a, r in compile_many(todo, threads, store)}
    return [(v, a, found.get((v, a)) or compiled[(v, a)]) for v, a in jobs]


def precompile(variants=None, arch=None, threads=None, cache_dir=None, force=False, *, quiet=False):
    """Compile kernel variants ahead of time into a cache directory (no GPU needed with ``arch``).

    A first call of an entry point compiles the kernels it needs (NVRTC, seconds each) and caches
    the cubins on disk; this builds them beforehand, e.g. in a container image or on a CI machine
    without a GPU. Shows one progress line on stderr while it compiles (redrawn in place on a
    terminal) and ends with one summary line there (variants built and found in cache, time,
    directory); compiler warnings stay in the results (``CompileResult.warnings``). The command
    line does the same: ``python -m cuflash precompile --arch sm_80,sm_90a``.

    Parameters
    ----------
    variants : iterable of Variant, optional
        Default: ``cuflash.kernels.catalogue.precompile_variants()`` (what the dispatcher can pick).
    arch : str or sequence of str, optional
        ``"sm_90a"``, ``"sm_80,sm_90a"``, ``["sm_80", "sm_90a"]``; default: the current device's.
    threads : int, optional
        Parallel compilations; default: the number of CPUs.
    cache_dir : path, optional
        Default: the user cache (what :func:`get_kernel` fills). For a shared read-only cache,
        compile into a directory and point ``CUFLASH_CACHE_DIR`` at it.
    force : bool
        Recompile variants whose cubin is already there.
    quiet : bool
        Print nothing.

    Returns
    -------
    list of CompileResult
        The variants compiled by this call (cached ones are skipped unless ``force``).

    Raises
    ------
    ValueError
        If an architecture is not one NVRTC and cuflash can build for (see
        :func:`cuflash._build.arch.parse_archs`).
    RuntimeError
        If any variant failed to compile (the others are still written), listing the failures;
        without ``arch``, if there is no usable GPU (the message says why and what to install).

    Examples
    --------
    >>> import cuflash
    >>> results = cuflash.precompile(arch="sm_90a", cache_dir="/opt/cuflash-cache", quiet=True)
    >>> # later, on the GPU machines: CUFLASH_CACHE_DIR=/opt/cuflash-cache python train.py
    """
    if variants is None:
        from cuflash.kernels.catalogue import precompile_variants

        variants = precompile_variants()
    archs = [arch] if isinstance(arch, str) or arch is None else list(arch)
    archs = parse_archs([a or device_arch() for a in archs])
    jobs = [(v, a) for a in archs for v in dict.fromkeys(variants)]
    cache_dir = Path(cache_dir) if cache_dir is not None else _cache.user_cache_dir()
    start = time.perf_counter()
    progress = None if quiet else Progress(archs, "cuflash.precompile")
    try:
        outcomes = build(jobs, cache_dir, force, threads, progress, progress and progress.start)
    finally:
        if progress is not None:
            progress.close()
    if not quiet:
        print(summary(outcomes, archs, cache_dir, time.perf_counter() - start, "cuflash.precompile"),
              file=sys.stderr, flush=True)
    results = [r for _, _, r in outcomes if isinstance(r, CompileResult) and not r.cached]
    failures = [f"{v.family} [{v.label()}] {a}: {r}" for v, a, r in outcomes
                if isinstance(r, Exception)]
    if failures:
        raise RuntimeError(f"cuflash.precompile: {len(failures)} of {len(results) + len(failures)} "
                           "variants failed:\n" + "\n".join(failures))
    return results
