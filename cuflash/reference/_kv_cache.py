"""KV caches in their serving formats, for the decode reference: fp8 (e4m3) bytes with scales, and
the MLA latent cache whose first ``v_head_dim`` columns are the values.

fp8: a cache holds ``float8_e4m3fn`` values as bytes (``uint8``; CuPy has no float8 dtype) and
stands for ``value * scale``, the scale a float32 scalar or one per kv head. Appended rows are
quantised as ``e4m3(clip(x / scale, -448, 448))``: rounded to nearest even by ml_dtypes, and
saturated at e4m3's largest finite value (448) as serving engines store them, rather than turned
into NaN (e4m3fn has no infinity). MLA: one latent cache of width D_qk (576 = 512 + 64 rope); the
keys are whole rows, the values their first ``v_head_dim`` columns, and an append writes one row
(``k_new``) that serves both.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["E4M3_MAX", "KV_DTYPES", "prepare", "quantize"]

KV_DTYPES = ("float8_e4m3fn",)
E4M3_MAX = 448.0


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _scale(scale, heads_k: int, name: str) -> np.ndarray:
    """A scale as float64 broadcastable to (B, S, Hk, D)."""
    if scale is None:
        raise ValueError(f"{name} is required with an fp8 cache (a float32 scalar or one per kv head)")
    s = _host(scale).astype(np.float64)
    if s.ndim == 0 or s.shape == (1,):
        return s.reshape(1, 1, 1, 1)
    if s.shape != (heads_k,):
        raise ValueError(f"{name} must be a scalar or have shape ({heads_k},) (one per kv head), got {s.shape}")
    return s.reshape(1, 1, heads_k, 1)


def quantize(x, scale) -> np.ndarray:
    """The e4m3 bytes (uint8) that stand for ``x`` under ``scale`` (broadcastable to x)."""
    scaled = np.clip(_host(x).astype(np.float64) / scale, -E4M3_MAX, E4M3_MAX)
    return scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def dequantize(raw, scale) -> np.ndarray:
    """float64 values of e4m3 bytes under ``scale``."""
    return np.asarray(raw).view(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale


def prepare(k_cache, v_cache, k_new, v_new, *, v_head_dim=None, kv_dtype=None, k_scale=None, v_scale=None):
    """The caches and new rows as the decode reference stores them, and how to read stored keys
    and values: ``(k_cache, v_cache, k_new, v_new, k_values, v_values)``, where ``k_values(x)``
    turns stored keys of shape (..., Hk, D) into float64 values (identity-like for float caches)."""
    k_cache = _host(k_cache)
    if v_cache is None:   # MLA: the values are the first v_head_dim columns of the latent cache
        if v_head_dim is None:
            raise ValueError("v_cache=None needs v_head_dim (the values are the first v_head_dim columns of k_cache)")
        if not 0 < int(v_head_dim) <= k_cache.shape[-1]:
            raise ValueError(f"v_head_dim must lie in [1, {k_cache.shape[-1]}] (k_cache's width), got {v_head_dim}")
        if v_new is not None:
            raise ValueError("with v_cache=None the appended latent rows are k_new alone; v_new must be None")
        v_cache = k_cache[..., :int(v_head_dim)]
        v_new = None if k_new is None else _host(k_new)[..., :int(v_head_dim)]
    elif v_head_dim is not None:
        raise ValueError("v_head_dim is for v_cache=None (an MLA latent cache); v_cache's last axis is its head dim")
    v_cache = _host(v_cache)
    if kv_dtype is None:
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale / v_scale need kv_dtype='float8_e4m3fn'")
        same = lambda x: x   # noqa: E731
        return k_cache, v_cache, k_new, v_new, same, same
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if cache.dtype != np.uint8:
            raise TypeError(f"{name} must hold the e4m3 bytes as uint8 with kv_dtype={kv_dtype!r}, got {cache.dtype}")
    heads_k = k_cache.shape[2]
    ks = _scale(k_scale, heads_k, "k_scale")
    vs = ks if v_scale is None and v_head_dim is not None else _scale(v_scale, heads_k, "v_scale")
    kn = None if k_new is None else quantize(k_new, ks)
    vn = None if v_new is None else quantize(v_new, vs)
    return k_cache, v_cache, kn, vn, (lambda x: dequantize(x, ks)), (lambda x: dequantize(x, vs))
