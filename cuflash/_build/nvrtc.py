"""Thin wrapper over libnvrtc: CUDA C++ source -> cubin, with no GPU needed.

CuPy's own compile path asks the driver for the device's architecture, so it fails on a
machine without a GPU. libnvrtc itself needs no driver: it compiles for any ``-arch`` and,
with ``--ptxas-options=-v``, reports registers, shared memory and spills in the program log.

The binding is ``cupy_backends.cuda.libs.nvrtc`` when CuPy is installed, else ctypes on the
libnvrtc shared library (pip ``nvidia-cuda-nvrtc``, or a CUDA toolkit). Both release the GIL
while compiling, so several programs can be compiled at once from threads. ``CUFLASH_NVRTC``, the
path of a libnvrtc shared library, chooses that one instead (through ctypes): NVRTC versions make
kernels of different speed from the same source (docs/decisions.md#compile-nvrtc-versions), and the
cubin cache is keyed by the version, so cubins precompiled under the library another machine uses are
found there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import re
import sys

from cuflash._build.cuda_status import driver_cuda_version, extra_for

__all__ = ["compile_to_cubin", "parse_ptxas_log", "version", "supported_archs", "library"]


class _CupyBackend:
    """libnvrtc through CuPy's Cython binding."""

    def __init__(self):
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()  # loads libnvrtc now, so a missing library means "try ctypes"
        self._nvrtc = nvrtc
        self.path = "libnvrtc loaded by CuPy"

    def version(self) -> tuple[int, int]:
        return tuple(self._nvrtc.getVersion())

    def supported_archs(self) -> tuple[int, ...]:
        query = getattr(self._nvrtc, "getSupportedArchs", None)  # not in every CuPy
        return tuple(int(a) for a in query()) if query else ()

    def compile(self, source: str, name: str, options: list[str]) -> tuple[bytes | None, str]:
        nvrtc = self._nvrtc
        prog = nvrtc.createProgram(source, name, [], [])
        try:
            try:
                nvrtc.compileProgram(prog, list(options))
            except nvrtc.NVRTCError as err:
                return None, f"{err}\n{nvrtc.getProgramLog(prog)}"
            # getCUBIN drops the final byte (it treats the image as a C string); put the NUL
            # back so the bytes equal what nvrtcGetCUBIN wrote and disassemblers accept them.
            return nvrtc.getCUBIN(prog) + b"\0", nvrtc.getProgramLog(prog)
        finally:
            nvrtc.destroyProgram(prog)


class _CtypesBackend:
    """libnvrtc through ctypes (ctypes drops the GIL around foreign calls)."""

    def __init__(self, path: str):
        self._lib = lib = ctypes.CDLL(path)
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.path = path

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            msg = self._lib.nvrtcGetErrorString(status).decode()
            raise RuntimeError(f"{what} failed: {msg} ({status})")

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        status = self._lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self._check(status, "nvrtcVersion")
        return major.value, minor.value

    def supported_archs(self) -> tuple[int, ...]:
        count = ctypes.c_int()
        self._check(self._lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)),
                    "nvrtcGetNumSupportedArchs")
        archs = (ctypes.c_int * count.value)()
        self._check(self._lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
        return tuple(archs)

    def _read(self, prog, size_fn, read_fn) -> bytes:
        size = ctypes.c_size_t()
        self._check(size_fn(prog, ctypes.byref(size)), size_fn.__name__)
        buf = ctypes.create_string_buffer(size.value)
        self._check(read_fn(prog, buf), read_fn.__name__)
        return buf.raw

    def compile(self, source: str, name: str, options: list[str]) -> tuple[bytes | None, str]:
        lib = self._lib
        prog = ctypes.c_void_p()
        status = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                        0, None, None)
        self._check(status, "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = lib.nvrtcCompileProgram(prog, len(options), opts)
            log = self._read(prog, lib.nvrtcGetProgramLogSize, lib.nvrtcGetProgramLog)
            log = log.rstrip(b"\0").decode(errors="replace")
            if status != 0:
                return None, f"{lib.nvrtcGetErrorString(status).decode()} ({status})\n{log}"
            return self._read(prog, lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN), log
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _find_libnvrtc() -> str | None:
    """Path of libnvrtc: CUDA's pathfinder, then pip's nvidia wheels, then the system."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        return load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception:  # not installed, or found nothing: search by hand below
        pass
    for site in sys.path:
        # CUDA 13 wheels: nvidia/cu13/lib; CUDA 12 wheels: nvidia/cuda_nvrtc/lib
        hits = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so.*")))
        hits = [h for h in hits if "builtins" not in h and "alt" not in os.path.basename(h)]
        if hits:
            return hits[-1]
    return ctypes.util.find_library("nvrtc")


def _chosen_backend(path: str) -> _CtypesBackend:
    """The libnvrtc that CUFLASH_NVRTC names. Its builtins library (libnvrtc-builtins.so.*, which
    libnvrtc opens by name at its first compile) is loaded first from the same folder, so that a
    library outside the loader's search path works."""
    if not os.path.isfile(path):
        raise RuntimeError(f"cuflash: CUFLASH_NVRTC names {path!r}, which is not a file; give the path of a "
                           "libnvrtc shared library (e.g. .../nvidia/cu13/lib/libnvrtc.so.13)")
    try:
        for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*"))):
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        return _CtypesBackend(path)
    except (OSError, AttributeError) as err:
        raise RuntimeError(f"cuflash: CUFLASH_NVRTC={path!r} is not a loadable libnvrtc: {err}") from None


@functools.lru_cache(maxsize=None)
def _backend():
    chosen = os.environ.get("CUFLASH_NVRTC")
    if chosen:
        return _chosen_backend(chosen)
    try:
        return _CupyBackend()
    except Exception:  # CuPy missing, or its libnvrtc failed to load: try ctypes
        pass
    path = _find_libnvrtc()
    if path is None:
        # The extra that matches the driver: a libnvrtc newer than the driver makes cubins it
        # cannot load.
        raise RuntimeError(
            f"cuflash: libnvrtc not found; install the CUDA extra, `{extra_for(driver_cuda_version())}` "
            "(it brings nvidia-cuda-nvrtc), or a CUDA toolkit"
        )
    return _CtypesBackend(path)


def version() -> tuple[int, int]:
    """(major, minor) version of the libnvrtc in use."""
    return _backend().version()


def library() -> str:
    """Where the libnvrtc in use comes from (a path, or "libnvrtc loaded by CuPy")."""
    return _backend().path


def supported_archs() -> tuple[int, ...]:
    """Compute capabilities the libnvrtc in use can compile for, e.g. ``(75, 80, ..., 90, 100)``
    (arch-specific targets such as ``sm_90a`` are not listed separately); ``()`` when the
    binding cannot ask."""
    return _backend().supported_archs()


def compile_to_cubin(source: str, name: str, options: list[str]) -> tuple[bytes, str]:
    """Compile one CUDA C++ translation unit to a cubin.

    Parameters
    ----------
    source : str
        The .cu text; its ``#include "..."`` headers are found through ``-I`` options.
    name : str
        File name shown in diagnostics (e.g. ``"fwd_sm80.cu"``).
    options : list of str
        NVRTC options; must contain a real architecture (``-arch=sm_80``, not ``compute_80``).

    Returns
    -------
    cubin : bytes
        The ELF image, loadable with ``cuModuleLoadData`` or ``cupy.RawModule(path=...)``.
    log : str
        NVRTC's program log (warnings; with ``--ptxas-options=-v`` also ptxas's report).

    Raises
    ------
    RuntimeError
        If compilation fails; the message holds the options and the full log.
    """
    cubin, log = _backend().compile(source, name, list(options))
    if cubin is None:
        raise RuntimeError(
            f"NVRTC failed to compile {name}\noptions: {' '.join(options)}\n{log}"
        )
    return cubin, log


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)\s*\n[^\n]*?(\d+) bytes stack frame, "
                    r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str, entry: str | None = None) -> dict[str, int]:
    """Resource usage of one entry function from a ``--ptxas-options=-v`` log.

    Parameters
    ----------
    log : str
        The program log returned by :func:`compile_to_cubin`.
    entry : str, optional
        Entry function name; by default the first one compiled (cuflash's .cu files each
        have one ``extern "C" __global__`` entry point).

    Returns
    -------
    dict
        ``registers``, ``spill_stores``, ``spill_loads``, ``stack_frame`` (bytes) and
        ``smem_static`` (bytes of static shared memory). Spills and stack frames of non-inlined
        device functions (listed by ptxas outside any entry) are added in: they are part of
        what the entry point runs.

    Raises
    ------
    ValueError
        If the log has no ptxas report for the entry (``--ptxas-options=-v`` missing).
    """
    # ptxas writes one section per entry: "Compiling entry function 'name'" ... up to the next.
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(log)]
    names = [n for _, n in starts]
    if not starts or (entry is not None and entry not in names):
        raise ValueError(f"no ptxas report for entry {entry or '(any)'} in log:\n{log}")
    k = 0 if entry is None else names.index(entry)
    end = starts[k + 1][0] if k + 1 < len(starts) else len(log)
    section = log[starts[k][0]:end]
    used = _USED.search(section)
    smem = _SMEM.search(section[used.start():]) if used else None
    out = {"registers": int(used.group(1)) if used else 0, "spill_stores": 0, "spill_loads": 0,
           "stack_frame": 0, "smem_static": int(smem.group(1)) if smem else 0}
    for m in _PROPS.finditer(log):
        if m.group(1) == names[k] or m.group(1) not in names:
            out["stack_frame"] += int(m.group(2))
            out["spill_stores"] += int(m.group(3))
            out["spill_loads"] += int(m.group(4))
    return out

