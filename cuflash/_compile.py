"""Build, cache and load cuflash's kernels: the one place where CUDA modules are made.

A kernel *variant* is a family (``cuda_src/<family>.cu``, entry point ``cuflash_<family>``)
plus the ``-D`` defines that fix its compile-time configuration. Every variant is compiled by
libnvrtc (:mod:`cuflash._nvrtc`) to a cubin for one exact architecture; this works without a
GPU, so CI and ``python -m cuflash precompile`` build the same binaries a GPU would load.

Cubins are cached on disk as ``DIR/<arch>/<family>-<defines hash>-<source hash>.cubin``; the
source hash covers every file in ``cuda_src/``, so editing a header never reuses a stale
binary. :func:`get_kernel` looks in ``$CUFLASH_CACHE_DIR`` (read only, e.g. filled ahead of
time by ``python -m cuflash precompile --cache-dir``), then in the user cache
(``$XDG_CACHE_HOME/cuflash`` or ``~/.cache/cuflash``), and compiles into the user cache on a miss.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cuflash import _nvrtc

__all__ = ["CUDA_SRC", "Variant", "CompileResult", "source_hash", "nvrtc_options",
           "compile_cubin", "cache_path", "user_cache_dir", "cache_dirs", "find_cubin",
           "store_cubin", "get_kernel", "compile_many", "precompile", "device_arch"]


def _find_cuda_src() -> Path:
    # Installed wheel: cuflash/cuda_src (package data). Source tree or editable install:
    # <repo>/cuda_src next to the package.
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if candidate.is_dir():
            return candidate
    return here / "cuda_src"


CUDA_SRC: Path = _find_cuda_src()
_SOURCE_SUFFIXES = (".cu", ".cuh", ".h")  # what the wheel ships, so hashes agree everywhere


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled configuration of a kernel family.

    Parameters
    ----------
    family : str
        ``"fwd_sm80"``, ``"fwd_simt"``, ...; the source is ``cuda_src/<family>.cu`` and the
        entry point ``cuflash_<family>``.
    defines : tuple of (str, int) pairs, or a dict
        Compile-time constants (``-DNAME=value``); stored sorted so that equal configurations
        are equal (and hash equal) however they were written.
    """

    family: str
    defines: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        defines = tuple(sorted((str(k), int(v)) for k, v in dict(self.defines).items()))
        object.__setattr__(self, "defines", defines)

    @property
    def entry(self) -> str:
        return "cuflash_" + self.family

    def label(self) -> str:
        """Short text for tables: ``HEAD_DIM=128,DTYPE=1`` (``CUFLASH_`` prefix dropped)."""
        return ",".join(f"{k.removeprefix('CUFLASH_')}={v}" for k, v in self.defines)


@dataclasses.dataclass(frozen=True)
class CompileResult:
    """A cubin and what ptxas said about it (sizes in bytes)."""

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

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

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
    return ["-std=c++17", f"-arch={arch}", f"-I{src_dir}", f"-DCUFLASH_SRC_HASH=0x{src_hash}",
            "--ptxas-options=-v", *(f"-D{k}={v}" for k, v in variant.defines)]


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
    cubin, log = _nvrtc.compile_to_cubin(source.read_text(), source.name,
                                         nvrtc_options(variant, arch, src_hash, src_dir))
    try:
        usage = _nvrtc.parse_ptxas_log(log, variant.entry)
    except ValueError:
        # Seen with the NVRTC of a GPU machine: a good cubin and an empty log. The cubin is what
        # the launch path needs; registers = -1 says "no report" (the CI test requires one).
        usage = dict(registers=-1, spill_stores=0, spill_loads=0, smem_static=0, stack_frame=0)
    return CompileResult(cubin=cubin, log=log, registers=usage["registers"],
                         spill_stores=usage["spill_stores"], spill_loads=usage["spill_loads"],
                         smem_static=usage["smem_static"], stack_frame=usage["stack_frame"],
                         variant=variant, arch=arch, seconds=time.perf_counter() - start)


def cache_path(cache_dir, variant: Variant, arch: str, src_hash: str | None = None) -> Path:
    """``cache_dir/<arch>/<family>-<defines hash>-<source hash>.cubin``."""
    defines = ",".join(f"{k}={v}" for k, v in variant.defines)
    defines_hash = hashlib.sha256(defines.encode()).hexdigest()[:16]
    src_hash = src_hash or source_hash()
    return Path(cache_dir) / arch / f"{variant.family}-{defines_hash}-{src_hash}.cubin"


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/cuflash``, else ``~/.cache/cuflash``: where compiled cubins go."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cuflash"


def cache_dirs() -> list[Path]:
    """Where :func:`find_cubin` looks, in order: $CUFLASH_CACHE_DIR (if set), the user cache."""
    env = os.environ.get("CUFLASH_CACHE_DIR")
    return ([Path(env)] if env else []) + [user_cache_dir()]


def find_cubin(variant: Variant, arch: str, src_hash: str | None = None) -> Path | None:
    """The cached cubin for ``variant`` on ``arch`` built from the current sources, or None."""
    src_hash = src_hash or source_hash()
    for directory in cache_dirs():
        path = cache_path(directory, variant, arch, src_hash)
        if path.is_file():
            return path
    return None


def store_cubin(path: Path, cubin: bytes) -> Path:
    """Write ``cubin`` to ``path`` atomically: readers (other processes too) never see a
    partial file, and concurrent writers of the same variant simply both succeed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def device_arch(device=None) -> str:
    """The NVRTC architecture of a CUDA device: ``"sm_90a"`` for compute capability 9.0
    (wgmma needs the arch-specific target), else ``"sm_<major><minor>"``.

    Raises
    ------
    RuntimeError
        If there is no usable CUDA GPU.
    """
    import cupy

    try:
        device_id = cupy.cuda.Device(device).id
        return _arch_of(device_id)
    except Exception as err:  # CUDARuntimeError: no driver, no device
        raise RuntimeError(f"cuflash: no CUDA GPU found ({err})") from err


@functools.lru_cache(maxsize=None)  # asked at every launch; a device's capability never changes
def _arch_of(device_id: int) -> str:
    import cupy

    cc = cupy.cuda.Device(device_id).compute_capability  # e.g. "90", "120"
    return "sm_90a" if cc == "90" else f"sm_{cc}"


_kernels: dict = {}
_key_locks: defaultdict = defaultdict(threading.Lock)
_key_locks_guard = threading.Lock()


def get_kernel(variant: Variant):
    """The ``cupy.RawKernel`` for ``variant`` on the current device, memoised per
    (variant, arch); thread-safe, and each variant is built at most once per process.

    Looks for a cached cubin (see :func:`cache_dirs`); if none, compiles it and stores it in
    the user cache (or a temporary directory if that is not writable).
    """
    arch = device_arch()
    key = (variant, arch)
    if key in _kernels:
        return _kernels[key][1]
    with _key_locks_guard:
        lock = _key_locks[key]
    with lock:
        if key not in _kernels:
            _kernels[key] = _load(variant, arch)
    return _kernels[key][1]


def _load(variant: Variant, arch: str):
    import cupy

    src_hash = source_hash()
    path = find_cubin(variant, arch, src_hash)
    if path is None:
        cubin = compile_cubin(variant, arch, src_hash).cubin
        try:
            path = store_cubin(cache_path(user_cache_dir(), variant, arch, src_hash), cubin)
        except OSError:  # read-only home: RawModule loads from a path, so use a private temp dir
            path = store_cubin(cache_path(tempfile.mkdtemp(prefix="cuflash-"), variant, arch,
                                          src_hash), cubin)
    module = cupy.RawModule(path=str(path))
    # Keep the module with its kernel: the kernel's function handle lives in the module.
    return module, module.get_function(variant.entry)


def compile_many(jobs, threads: int | None = None):
    """Compile ``(variant, arch)`` jobs in parallel threads (NVRTC releases the GIL).

    Returns
    -------
    list of (Variant, str, CompileResult or Exception)
        In the order of ``jobs``; a failed job carries its exception instead of a result.
    """
    jobs = list(jobs)

    def one(job):
        try:
            return (*job, compile_cubin(*job))
        except Exception as err:  # reported per job; the caller decides what fails
            return (*job, err)

    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=threads or min(len(jobs), os.cpu_count() or 1)) as pool:
        return list(pool.map(one, jobs))


def precompile(variants=None, arch=None, threads=None, cache_dir=None, force=False):
    """Compile kernel variants ahead of time into a cache directory.

    Parameters
    ----------
    variants : iterable of Variant, optional
        Default: ``cuflash._heuristics.precompile_variants()`` (what the dispatcher can pick).
    arch : str or sequence of str, optional
        ``"sm_90a"``, ``"sm_80,sm_90a"``, ``["sm_80", "sm_90a"]``; default: the current device's.
    threads : int, optional
        Parallel compilations; default: the number of CPUs.
    cache_dir : path, optional
        Default: the user cache (what :func:`get_kernel` fills). For a shared read-only cache,
        compile into a directory and point ``CUFLASH_CACHE_DIR`` at it.
    force : bool
        Recompile variants whose cubin is already there.

    Returns
    -------
    list of CompileResult
        The variants compiled by this call (cached ones are skipped unless ``force``).

    Raises
    ------
    RuntimeError
        If any variant failed to compile (the others are still written), listing the failures.
    """
    if variants is None:
        from cuflash._heuristics import precompile_variants

        variants = precompile_variants()
    archs = [arch] if isinstance(arch, str) or arch is None else list(arch)
    archs = [a.strip() for spec in archs for a in (spec or device_arch()).split(",") if a.strip()]
    cache_dir = Path(cache_dir) if cache_dir is not None else user_cache_dir()
    src_hash = source_hash()
    jobs = [(v, a) for a in archs for v in dict.fromkeys(variants)
            if force or not cache_path(cache_dir, v, a, src_hash).is_file()]
    results, failures = [], []
    for variant, a, result in compile_many(jobs, threads):
        if isinstance(result, Exception):
            failures.append(f"{variant.family} [{variant.label()}] {a}: {result}")
        else:
            store_cubin(cache_path(cache_dir, variant, a, src_hash), result.cubin)
            results.append(result)
    if failures:
        raise RuntimeError(f"cuflash.precompile: {len(failures)} of {len(jobs)} variants "
                           "failed:\n" + "\n".join(failures))
    return results
