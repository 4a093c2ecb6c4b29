"""NVRTC targets: the one a CUDA device loads, and checking the ones a user names.

A cubin holds SASS for one exact architecture, so every build names its target: ``sm_80`` for
compute capability 8.0, ``sm_90a`` for 9.0 (wgmma needs the arch-specific target), and so on.
"""

from __future__ import annotations

import functools
import re

from cuflash._build import nvrtc as _nvrtc
from cuflash._build.cuda_status import cuda_status

__all__ = ["arch_for", "parse_archs", "device_arch"]


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
