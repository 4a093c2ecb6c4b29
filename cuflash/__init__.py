"""cuflash: exact FlashAttention for CuPy.

CUDA kernels in ``cuda_src/`` compiled at run time through NVRTC, a NumPy-style functional API,
and a float64 reference (:mod:`cuflash.reference`) that every kernel is tested against.
"""

from .attention import attention, attention_forward, attention_varlen, force_kernel
from .random import Generator, default_generator, manual_seed
from ._compile import precompile

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_forward",
    "attention_varlen",
    "force_kernel",
    "Generator",
    "default_generator",
    "manual_seed",
    "precompile",
]
