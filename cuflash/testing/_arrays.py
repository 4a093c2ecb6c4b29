"""Arrays of any module (NumPy, CuPy, anything with ``__array__``) and dtypes by name."""

from __future__ import annotations

import numpy as np


def _dtype(dtype):
    """NumPy dtype for a name or dtype ("bfloat16" resolves through ml_dtypes)."""
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    if isinstance(dtype, str) and dtype in ("fp16", "half"):
        return np.dtype(np.float16)
    return np.dtype(dtype)


def _is_cupy(x):
    return type(x).__module__.split(".")[0] == "cupy"


def _xp_of(x):
    if _is_cupy(x):
        import cupy
        return cupy
    return np


def _host(x):
    """Any array (NumPy, CuPy, ``__array__``) as NumPy."""
    return x.get() if _is_cupy(x) else np.asarray(x)


def _host64(x):
    return _host(x).astype(np.float64)

