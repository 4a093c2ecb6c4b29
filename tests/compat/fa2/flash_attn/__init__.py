"""FlashAttention-2's Python API (``flash_attn`` 2.x) implemented on cuflash — a test shim.

This package exists so that FlashAttention-2's own test file (``tests/test_flash_attn.py`` of
Dao-AILab/flash-attention) can run unchanged against cuflash: it provides the names that file
imports and maps each call onto cuflash's public API with torch tensors (DLPack). It is not an
installable ``flash_attn`` replacement and shares no code with FlashAttention; see
``tests/compat/fa2/README.md`` and ``tests/compat/fa2/run_fa2_suite.py``.

Where FA2 has a feature cuflash cannot express, the shim raises :class:`NotSupported` (a
``NotImplementedError``), which the runner reports as "not supported", never as a pass.
"""

from .flash_attn_interface import (
    NotSupported,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__version__ = "2.8.3+cuflash.shim"

__all__ = [
    "NotSupported",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
