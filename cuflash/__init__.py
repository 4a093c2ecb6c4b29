"""cuflash: exact FlashAttention for CuPy.

CUDA kernels in ``cuda_src/`` compiled at run time through NVRTC, a NumPy-style functional API,
and a float64 reference (:mod:`cuflash.reference`) that every kernel is tested against.
"""

from .attention import attention, attention_forward, attention_varlen, force_kernel
from .backward import attention_backward, attention_varlen_backward
from .decode import decode
from .merge import merge_states
from .modifiers import MaskMod, ScoreMod
from ._mask_blocks import clear_mask_cache
from .random import Generator, default_generator, manual_seed
from ._build.compile import precompile
from ._runtime.faults import check_errors
from ._runtime.pinned import PinnedPlan as Plan, planned as plan

from ._version import __version__

__all__ = [
    "attention",
    "attention_forward",
    "attention_varlen",
    "attention_backward",
    "attention_varlen_backward",
    "decode",
    "merge_states",
    "ScoreMod",
    "MaskMod",
    "clear_mask_cache",
    "force_kernel",
    "Generator",
    "default_generator",
    "manual_seed",
    "precompile",
    "plan",
    "Plan",
    "check_errors",
]

# Submodules reachable as attributes without importing them (or torch, hypothesis) up front.
_LAZY = ("reference", "testing", "interop")


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
