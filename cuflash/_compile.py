"""Build, cache and load cuflash's kernels: the one place where CUDA modules are made.

A kernel *variant* is a family (``cuda_src/<family>.cu``, entry point ``cuflash_<family>``)
plus the ``-D`` defines that fix its compile-time configuration. Every variant is compiled by
libnvrtc (:mod:`cuflash._nvrtc`) to a cubin for one exact architecture; this works without a
GPU, so CI and ``python -m cuflash precompile`` build the same binaries a GPU would load.

Cubins are cached on disk as ``DIR/<arch>/<family>-<options hash>-<source hash>.cubin``, each
with its report beside it (``.ptxas``: registers, spills, compile time, and the cubin's length and
sha256). The options hash covers the NVRTC version and every option (the defines among them), the
source hash every file in ``cuda_src/``: another libnvrtc (the ``cuda12`` and ``cuda13`` extras),
another option or an edited header never reuses a stale binary. A cubin that does not match its
report (empty, cut short, overwritten) is never loaded: it is deleted and built again.
:func:`get_kernel` looks in ``$CUFLASH_CACHE_DIR`` (read only, e.g. filled ahead of time by
``python -m cuflash precompile --cache-dir``), then in the user cache (``$XDG_CACHE_HOME/cuflash``
or ``~/.cache/cuflash``), and compiles into the user cache on a miss; when that is not writable,
into ``<temp dir>/cuflash-<uid>``, which this user's later processes find again.

:func:`cuda_status` is the one place that tells "no GPU here" from "a CUDA setup that is broken"
(the command line, the test suite and :func:`device_arch` all ask it).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from cuflash import _nvrtc
from cuflash._variant import Variant

__all__ = ["CUDA_SRC", "Variant", "CompileResult", "source_hash", "nvrtc_options",
           "compile_cubin", "cache_path", "user_cache_dir", "cache_dirs", "find_cubin",
           "store_cubin", "cached_result", "get_kernel", "compile_many", "build", "precompile",
           "device_arch", "arch_for", "parse_archs", "default_threads", "CudaStatus",
           "cuda_status", "current_device"]


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
    return ["-std=c++17", f"-arch={arch}", f"-I{src_dir}", f"-DCUFLASH_SRC_HASH=0x{src_hash}",
            "--ptxas-options=-v", *(f"-D{k}={v}" for k, v in variant.defines)]


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
    cubin, log = _nvrtc.compile_to_cubin(source.read_text(), source.name,
                                         nvrtc_options(variant, arch, src_hash, src_dir))
    return _result(variant, arch, cubin, log, time.perf_counter() - start)


@functools.lru_cache(maxsize=None)  # the libnvrtc in use is chosen once per process
def _nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc.version())


def cache_path(cache_dir, variant: Variant, arch: str, src_hash: str | None = None) -> Path:
    """``cache_dir/<arch>/<family>-<options hash>-<source hash>.cubin``.

    The options hash covers the NVRTC version and the options (defines and arch included), so
    that another libnvrtc or another option never reuses a binary.
    """
    key = json.dumps([_nvrtc_version(), _portable(variant, arch)])
    options_hash = hashlib.sha256(key.encode()).hexdigest()[:16]
    src_hash = src_hash or source_hash()
    return Path(cache_dir) / arch / f"{variant.family}-{options_hash}-{src_hash}.cubin"


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/cuflash``, else ``~/.cache/cuflash``: where compiled cubins go."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cuflash"


def cache_dirs() -> list[Path]:
    """Where :func:`find_cubin` looks, in order: $CUFLASH_CACHE_DIR (if set), the user cache
    (then the temporary cache, if there is one: see :func:`get_kernel`)."""
    env = os.environ.get("CUFLASH_CACHE_DIR")
    return ([Path(env)] if env else []) + [user_cache_dir()]


def _temp_cache_dir(create: bool = False) -> Path | None:
    """``<temp dir>/cuflash-<uid>``: where :func:`get_kernel` stores cubins when the user cache
    is not writable, found again by this user's later processes. None when it does not exist
    (``create`` makes it, 0700) or cannot be trusted: a symlink, another user's, or writable by
    others (anyone may create that name in /tmp first)."""
    uid = os.getuid() if hasattr(os, "getuid") else None  # Windows: the temp dir is per user
    path = Path(tempfile.gettempdir()) / (f"cuflash-{uid}" if uid is not None else "cuflash")
    if create:
        try:
            path.mkdir(mode=0o700, exist_ok=True)
        except OSError:  # something else holds the name: rejected below
            pass
    try:
        st = path.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    if uid is not None and (st.st_uid != uid or st.st_mode & 0o022):
        return None
    return path


def find_cubin(variant: Variant, arch: str, src_hash: str | None = None) -> Path | None:
    """The cached cubin for ``variant`` on ``arch`` built from the current sources, or None.

    Looks in :func:`cache_dirs`, then in the temporary cache. A cubin that does not match its
    report (see :func:`cached_result`) is never returned: it is deleted, so that it gets built
    again, except in $CUFLASH_CACHE_DIR (read only by contract), where it is only skipped.
    """
    name = cache_path("", variant, arch, src_hash or source_hash())
    for directory in (*cache_dirs(), _temp_cache_dir()):
        if directory is None:
            continue
        path = directory / name
        if _read_cache(path) is not None:
            return path
        if path.exists():
            _discard(path)
    return None


def _discard(path: Path) -> None:
    """Delete a damaged cubin and its report, where the cache is ours to change."""
    env = os.environ.get("CUFLASH_CACHE_DIR")
    if env and path.is_relative_to(env):
        return
    for stale in (path, _report_path(path)):
        try:
            stale.unlink(missing_ok=True)
        except OSError:  # a read-only user cache: the file is skipped all the same
            pass


def _atomic_write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Created 0644 less the umask, as any file; not through mkstemp, whose 0600 would keep the
    # other users of a shared --cache-dir out.
    tmp = path.with_name(f"{path.name}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _fingerprint(cubin: bytes) -> dict:
    return {"bytes": len(cubin), "sha256": hashlib.sha256(cubin).hexdigest()}


def store_cubin(path: Path, cubin: bytes, result: CompileResult | None = None) -> Path:
    """Write ``cubin`` to ``path`` atomically, with its report beside it (its length and sha256;
    with ``result``, also the ptxas log read back by :func:`cached_result`): readers (other
    processes too) never see a partial file, and concurrent writers of the same variant simply
    both succeed."""
    path = Path(path)
    report = {"nvrtc": list(_nvrtc_version()), "cubin": _fingerprint(cubin)}
    if result is not None:
        report.update(options=_portable(result.variant, result.arch), log=result.log,
                      seconds=round(result.seconds, 3))
    # Report first: a cubin is never there without the report that vouches for it.
    _atomic_write(_report_path(path), json.dumps(report).encode())
    return _atomic_write(path, cubin)


def _report_path(cubin_path: Path) -> Path:
    return Path(cubin_path).with_suffix(".ptxas")


def _portable(variant: Variant, arch: str) -> list[str]:
    # The options minus the include path (it differs between a checkout and a wheel) and the
    # source hash (already in the file name).
    return [o for o in nvrtc_options(variant, arch, "0") if not o.startswith("-I")]


def _read_cache(path: Path) -> tuple[bytes, dict] | None:
    """The cubin at ``path`` and its report, or None when either is missing or the cubin is not
    the ELF image of the length and sha256 its report gives (empty, cut short, overwritten):
    the driver must never see such a file."""
    try:
        report = json.loads(_report_path(path).read_text())
        cubin = path.read_bytes()
    except (OSError, ValueError):
        return None
    if (not isinstance(report, dict) or not cubin.startswith(b"\x7fELF")
            or report.get("cubin") != _fingerprint(cubin)):
        return None
    return cubin, report


def cached_result(cache_dir, variant: Variant, arch: str, src_hash: str | None = None) -> CompileResult | None:
    """The cached cubin of ``variant`` with its ptxas report, as a CompileResult
    (``cached=True``); None when either is missing or the cubin does not match its report
    (then the variant should be compiled again). Another NVRTC version or other options look
    under another name (see :func:`cache_path`)."""
    found = _read_cache(cache_path(cache_dir, variant, arch, src_hash))
    if found is None:
        return None
    cubin, report = found
    return _result(variant, arch, cubin, report.get("log", ""), report.get("seconds", 0.0), True)


# ----------------------------------------------------------------------------- CUDA status

@dataclasses.dataclass(frozen=True)
class CudaStatus:
    """What CUDA looks like from this process.

    ``state`` is ``"ok"`` (a usable GPU), ``"no-gpu"`` (no driver or no device: nothing is
    wrong), ``"no-cupy"`` (CuPy is not installed) or ``"broken"`` (a driver and CuPy are there
    but do not work together). ``reason`` is the underlying error in one line; ``fix`` what to
    do about it in one line ("" when there is nothing to fix).
    """

    state: str
    reason: str = ""
    fix: str = ""
    devices: int = 0
    driver_cuda: tuple[int, int] | None = None   # the CUDA version the driver supports
    runtime_cuda: tuple[int, int] | None = None  # the CUDA runtime CuPy was built for

    def message(self) -> str:
        """One or two lines: what is wrong and how to fix it."""
        head = {"ok": "CUDA works", "no-gpu": "no CUDA GPU found",
                "no-cupy": "CuPy is not installed", "broken": "CUDA is not usable"}[self.state]
        return (f"cuflash: {head}" + (f": {self.reason}" if self.reason else "")
                + (f"\nfix: {self.fix}" if self.fix else ""))


def _version_pair(v: int) -> tuple[int, int]:
    return v // 1000, (v % 1000) // 10  # 12080 -> (12, 8)


def _driver_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the installed driver supports, from libcuda itself (no CuPy, no device
    needed); None when there is no libcuda, i.e. no NVIDIA driver."""
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value > 0:
            return _version_pair(version.value)
    return None


def _extra_for(driver: tuple[int, int] | None) -> str:
    """The install command that matches the driver (CUDA 13 when it is not known)."""
    if driver is not None and driver[0] == 12:
        return "pip install 'cuflash[cuda12]'"
    return "pip install 'cuflash[cuda13]'"


def _cupy_distribution(runtime: tuple[int, int] | None) -> str:
    try:
        from importlib.metadata import packages_distributions

        names = packages_distributions().get("cupy", [])
        if names:
            return names[0]
    except Exception:  # metadata is a nicety here; fall back on the wheel's usual name
        pass
    return f"cupy-cuda{runtime[0]}x" if runtime else "cupy"


_CUDA_ERROR_FIXES = {
    803: "the driver's kernel module and libcuda differ (updated without a reboot?): reboot",
    804: "a CUDA forward-compatibility libcuda is on the library path for a GPU that does not "
         "support it: remove it from LD_LIBRARY_PATH",
}
_NO_DEVICE, _INSUFFICIENT_DRIVER = 100, 35  # cudaErrorNoDevice, cudaErrorInsufficientDriver


def cuda_status() -> CudaStatus:
    """Tell "no GPU here" (no NVIDIA driver, or no device visible) from a broken setup (CuPy
    missing or failing to load, a driver too old for CuPy's CUDA runtime, ...).

    Never raises; the answer carries the underlying error and the fix.
    """
    driver = _driver_cuda_version()
    try:
        import cupy
    except Exception as err:  # not installed, or there but unable to load its CUDA libraries
        if isinstance(err, ModuleNotFoundError) and err.name == "cupy":
            return CudaStatus("no-cupy", fix=_extra_for(driver), driver_cuda=driver)
        return CudaStatus("broken", f"import cupy: {_first_line(err)}",
                          "reinstall: " + _extra_for(driver), driver_cuda=driver)
    runtime = None
    try:
        runtime = _version_pair(cupy.cuda.runtime.runtimeGetVersion())
    except Exception:  # reported through getDeviceCount below, if it matters
        pass
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:
        code = getattr(err, "status", None)
        if code == _NO_DEVICE:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = "no CUDA device" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
            return CudaStatus("no-gpu", why, driver_cuda=driver, runtime_cuda=runtime)
        if code == _INSUFFICIENT_DRIVER and driver is None:
            # The runtime says this when there is no driver at all: a machine without a GPU.
            return CudaStatus("no-gpu", "no NVIDIA driver (libcuda not found)", runtime_cuda=runtime)
        reason = _first_line(err)
        if code == _INSUFFICIENT_DRIVER:
            have = f"{driver[0]}.{driver[1]}"
            need = f"{runtime[0]}.{runtime[1]}" if runtime else "a newer one"
            reason = (f"{reason.split(':')[0]}: the driver supports CUDA {have}, "
                      f"CuPy was built for CUDA {need}")
            if driver[0] < 12:
                fix = "update the NVIDIA driver: cuflash needs one for CUDA 12 or newer"
            elif runtime and driver[0] < runtime[0]:
                fix = (f"pip uninstall -y {_cupy_distribution(runtime)} && "
                       f"pip install 'cuflash[cuda{driver[0]}]'")
            else:
                fix = f"update the NVIDIA driver to one for CUDA {need}"
        else:
            fix = _CUDA_ERROR_FIXES.get(code, "check `nvidia-smi`; if it fails too, reinstall "
                                              "the NVIDIA driver")
        return CudaStatus("broken", reason, fix, driver_cuda=driver, runtime_cuda=runtime)
    if count == 0:
        return CudaStatus("no-gpu", "CuPy sees 0 CUDA devices", driver_cuda=driver,
                          runtime_cuda=runtime)
    return CudaStatus("ok", devices=count, driver_cuda=driver, runtime_cuda=runtime)


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    line = lines[0] if lines else ""
    # CuPy's CUDA errors already start with their name ("cudaErrorNoDevice: ...").
    return line if line.startswith("cuda") else f"{type(err).__name__}: {line}".rstrip(": ")


# ----------------------------------------------------------------------------- architectures

def arch_for(compute_capability: int | str) -> str:
    """The NVRTC target cuflash builds for a compute capability: ``"sm_90a"`` for 9.0 (wgmma
    needs the arch-specific target), else ``"sm_<major><minor>"`` (``86`` -> ``"sm_86"``)."""
    cc = int(compute_capability)
    return "sm_90a" if cc == 90 else f"sm_{cc}"


_ARCH = re.compile(r"(?:sm_?|compute_?)?(\d{2,3})[af]?", re.IGNORECASE)
_MIN_CC = 80  # cp.async and mma.sync m16n8k16: the sm_80 families are the portable ones


def parse_archs(spec, what: str = "arch") -> list[str]:
    """Check and split ``"sm_80,sm_90a"`` (or a sequence of such strings) into NVRTC targets.

    ``what`` names the argument in messages (``"--arch"`` for the command line).

    Raises
    ------
    ValueError
        One line naming the bad entry and what to write instead: not an ``sm_NN`` target,
        older than sm_80, not supported by the libnvrtc in use, or not the target a GPU of that
        compute capability loads (``sm_90`` -> ``sm_90a``).
    """
    items = [spec] if isinstance(spec, str) else list(spec)
    archs = [a.strip() for item in items for a in str(item).split(",") if a.strip()]
    if not archs:
        raise ValueError(f"{what}: no architecture given (e.g. sm_80,sm_90a)")
    out = []
    for arch in archs:
        m = _ARCH.fullmatch(arch)
        if m is None:
            raise ValueError(f"{what} {arch}: expected a target such as sm_80 or sm_90a")
        cc = int(m.group(1))
        wanted = arch_for(cc)
        if arch != wanted:
            why = "; wgmma needs it" if cc == 90 else ""
            raise ValueError(f"{what} {arch}: use {wanted} (what a GPU of compute capability "
                             f"{cc // 10}.{cc % 10} loads{why})")
        if cc < _MIN_CC:
            raise ValueError(f"{what} {arch}: cuflash's kernels need sm_80 or newer")
        supported = _nvrtc.supported_archs()
        if supported and cc not in supported:  # () when this NVRTC cannot tell
            major, minor = _nvrtc.version()
            raise ValueError(f"{what} {arch}: NVRTC {major}.{minor} cannot compile for it "
                             f"(it supports sm_{min(supported)} to sm_{max(supported)})")
        if arch not in out:
            out.append(arch)
    return out


def device_arch(device=None) -> str:
    """The NVRTC architecture of a CUDA device: ``"sm_90a"`` for compute capability 9.0
    (wgmma needs the arch-specific target), else ``"sm_<major><minor>"``.

    Raises
    ------
    RuntimeError
        If there is no usable CUDA GPU; the message says why (no GPU, CuPy missing, a driver
        too old for CuPy, ...) and what to do.
    """
    try:
        import cupy

        device_id = cupy.cuda.Device(device).id
        return _arch_of(device_id)
    except Exception as err:  # CUDARuntimeError: no driver, no device; ImportError: no CuPy
        status = cuda_status()
        if status.state == "ok":  # the setup works: the problem is this device (e.g. its id)
            raise RuntimeError(f"cuflash: CUDA device {device}: {err}") from err
        raise RuntimeError(status.message()) from err


@functools.lru_cache(maxsize=None)  # asked at every launch; a device's capability never changes
def _arch_of(device_id: int) -> str:
    import cupy

    return arch_for(cupy.cuda.Device(device_id).compute_capability)  # e.g. "90", "120"


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
    :func:`cuflash._launch.prepare_kernel`.
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
    from cuflash.__main__ import _config

    print(f"cuflash: compiled {variant.family} ({_config(variant)}, {arch}) in {seconds:.1f} s, once; "
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
            _discard(path)  # and build it again, once
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
        return store_cubin(cache_path(user_cache_dir(), variant, arch, src_hash), result.cubin,
                           result)
    except OSError:  # a read-only home, a full disk
        pass
    directory = _temp_cache_dir(create=True) or tempfile.mkdtemp(prefix="cuflash-")
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


def build(jobs, cache_dir=None, force=False, threads=None, progress=None):
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

    Returns
    -------
    list of (Variant, str, CompileResult or Exception)
        In the order of ``jobs`` (duplicates dropped); results read from the cache have
        ``cached=True``. Compiled cubins are written to ``cache_dir`` with their reports.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else user_cache_dir()
    src_hash = source_hash()
    jobs = list(dict.fromkeys(jobs))
    found = {} if force else {job: cached_result(cache_dir, *job, src_hash) for job in jobs}
    todo = [job for job in jobs if found.get(job) is None]

    def store(done, total, variant, arch, result):
        if not isinstance(result, Exception):
            store_cubin(cache_path(cache_dir, variant, arch, src_hash), result.cubin, result)
        if progress is not None:
            progress(done, total, variant, arch, result)

    compiled = {(v, a): r for v, a, r in compile_many(todo, threads, store)}
    return [(v, a, found.get((v, a)) or compiled[(v, a)]) for v, a in jobs]


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
    ValueError
        If an architecture is not one NVRTC and cuflash can build for (see :func:`parse_archs`).
    RuntimeError
        If any variant failed to compile (the others are still written), listing the failures.
    """
    if variants is None:
        from cuflash._heuristics import precompile_variants

        variants = precompile_variants()
    archs = [arch] if isinstance(arch, str) or arch is None else list(arch)
    archs = parse_archs([a or device_arch() for a in archs])
    jobs = [(v, a) for a in archs for v in dict.fromkeys(variants)]
    outcomes = build(jobs, cache_dir, force, threads)
    results = [r for _, _, r in outcomes if isinstance(r, CompileResult) and not r.cached]
    failures = [f"{v.family} [{v.label()}] {a}: {r}" for v, a, r in outcomes
                if isinstance(r, Exception)]
    if failures:
        raise RuntimeError(f"cuflash.precompile: {len(failures)} of {len(results) + len(failures)} "
                           "variants failed:\n" + "\n".join(failures))
    return results
