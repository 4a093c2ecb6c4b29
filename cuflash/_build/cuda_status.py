"""What CUDA looks like from this process: the one place that tells "no GPU here" from "a CUDA
setup that is broken", and says what to do about it.

:func:`cuda_status` answers for the command line (``python -m cuflash``, ``doctor``), the test
suite's GPU gate and :func:`cuflash._build.arch.device_arch`; :func:`import_cupy` is how the library
imports CuPy on the path of a first call, so that a missing CuPy says which extra to install.
Nothing here needs a GPU, a driver or CuPy to answer.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys

__all__ = ["CudaStatus", "cuda_status", "import_cupy", "driver_cuda_version", "extra_for",
           "cupy_distribution"]


def import_cupy():
    """The ``cupy`` module.

    Raises
    ------
    ModuleNotFoundError
        When CuPy is not installed (``name == "cupy"``), with the install command that matches
        the driver (``pip install 'cuflash[cuda13]'`` or ``'cuflash[cuda12]'``) instead of
        Python's bare "No module named 'cupy'".
    ImportError
        When CuPy is there but fails to load (its CUDA libraries missing): the cause and the fix.
    """
    try:
        import cupy
    except ModuleNotFoundError as err:
        if err.name != "cupy":  # one of CuPy's own imports: not a missing CuPy
            raise _broken_import(err) from err
        status = CudaStatus("no-cupy", fix=extra_for(driver_cuda_version()))
        raise ModuleNotFoundError(status.message(), name="cupy") from None
    except ImportError as err:
        raise _broken_import(err) from err
    return cupy


def _broken_import(err: ImportError) -> ImportError:
    status = CudaStatus("broken", f"import cupy: {_first_line(err)}",
                        "reinstall: " + extra_for(driver_cuda_version()))
    return ImportError(status.message(), name="cupy")


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


def driver_cuda_version() -> tuple[int, int] | None:
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


def extra_for(driver: tuple[int, int] | None) -> str:
    """The install command that matches the driver (CUDA 13 when it is not known)."""
    if driver is not None and driver[0] == 12:
        return "pip install 'cuflash[cuda12]'"
    return "pip install 'cuflash[cuda13]'"


def cupy_distribution(runtime: tuple[int, int] | None) -> str:
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
    driver = driver_cuda_version()
    try:
        import cupy
    except Exception as err:  # not installed, or there but unable to load its CUDA libraries
        if isinstance(err, ModuleNotFoundError) and err.name == "cupy":
            return CudaStatus("no-cupy", fix=extra_for(driver), driver_cuda=driver)
        return CudaStatus("broken", f"import cupy: {_first_line(err)}",
                          "reinstall: " + extra_for(driver), driver_cuda=driver)
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
                fix = (f"pip uninstall -y {cupy_distribution(runtime)} && "
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
