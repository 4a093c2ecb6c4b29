"""All argument validation, done before any launch: the one module that checks operands.

Every error is a TypeError (type or dtype) or ValueError (shape or value) that names the argument,
says what was expected and what came. Nothing here writes to a user's buffer.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from ._build.cuda_status import import_cupy
from .features import DTYPE_CODES
from .kernels.common import MAX_HEAD_DIM
from .kernels.decode import DECODE_KV_DTYPES

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None

SUPPORTED_DTYPES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32"}
if BFLOAT16 is not None:
    SUPPORTED_DTYPES[BFLOAT16] = "bfloat16"
#: The dtypes a bias may have, by their code in the one numbering (features.DTYPE_CODES).
BIAS_DTYPE_CODES = {dtype: DTYPE_CODES[name] for dtype, name in SUPPORTED_DTYPES.items()}

# What the params structs and the kernels can hold: sizes, positions and window sizes are int32,
# scale and softcap float32, and sequences and query heads are CUDA grid axes y and z.
INT32_MAX = 2**31 - 1
GRID_YZ_MAX = 65535
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)   # the smallest normal float32


def dtype_name(dtype) -> str:
    return SUPPORTED_DTYPES[np.dtype(dtype)]


def _cupy():
    return import_cupy()   # a missing CuPy says which extra to install


def require_gpu() -> None:
    """RuntimeError when CuPy sees no CUDA device."""
    try:
        count = _cupy().cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDA driver missing or too old
        raise RuntimeError(f"cuflash needs a CUDA GPU, and none is usable here ({exc})") from None
    if count == 0:
        raise RuntimeError("cuflash needs a CUDA GPU, and none was found")


def as_cuda_array(x, name: str):
    """A CuPy view of a CuPy array or any CUDA array that speaks DLPack (zero copy).

    cupy.from_dlpack passes CuPy's current stream to ``__dlpack__``, so the producer orders its
    pending work before ours. An array on another GPU than the current device is a ValueError
    (:func:`check_device`), raised before it is imported.
    """
    cupy = _cupy()
    if isinstance(x, cupy.ndarray):
        check_device(x.data.device_id, name)
        return x
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a CUDA array; it is a NumPy (host) array: move it to the GPU with "
                        f"cupy.asarray({name})")
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type = x.__dlpack_device__()[0]
        if int(device_type) not in (2, 13):  # kDLCUDA, kDLCUDAManaged
            where = "host (CPU) memory" if int(device_type) in (1, 3) else f"DLPack device type {int(device_type)}"
            raise TypeError(f"{name} must be a CUDA array; it lives in {where}: move it to the GPU first")
        require_gpu()
        if int(device_type) == 2:   # managed memory (13) is usable from every device
            check_device(int(x.__dlpack_device__()[1]), name)
        if getattr(x, "requires_grad", False):
            x = x.detach()   # torch exports no tensor that requires grad; cuflash only reads its data
        return cupy.from_dlpack(x)
    raise TypeError(f"{name} must be a CUDA array (CuPy or anything with __dlpack__), got {type(x).__name__}")


def current_device() -> int:
    """The id of CuPy's current CUDA device: where the kernels run, on its current stream."""
    return _cupy().cuda.runtime.getDevice()


def check_device(device_id: int, name: str) -> None:
    """ValueError when an operand lives on another GPU than the current device (the kernels run on the
    current device; one on another GPU would read or write memory it cannot address). Checked on the
    full path of every entry point, for every operand, before any launch; the plans remembered for
    repeat calls are keyed by each operand's device and the current device (_memo.lookup), so a
    repeat call with an operand elsewhere is checked again."""
    current = current_device()
    if device_id != current:
        raise ValueError(f"{name} is on CUDA device {device_id}, but the current device is {current}: every array "
                         f"must be on the device the kernels run on; call inside `with cupy.cuda.Device({device_id}):` "
                         f"with all arrays there, or move {name} to device {current}")


class Shaped:
    """The layout of a C-contiguous array a plan will allocate (shape, strides, dtype), for the
    layout fields of the params before the array exists."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        strides, step = [], self.itemsize
        for n in reversed(self.shape):
            strides.append(step)
            step *= max(n, 1)
        self.strides = tuple(reversed(strides))
        self.nbytes = self.itemsize * math.prod(self.shape)
        self.ndim = len(self.shape)


_CHECK_DEFAULT = os.environ.get("CUFLASH_CHECK", "").strip() not in ("", "0")


def check_flag(value, name: str = "check") -> bool:
    """A bool argument; for ``check`` (the entry points with index arrays) None = ``$CUFLASH_CHECK``."""
    if value is True or value is False:   # the usual case, first: it runs at every call
        return value
    if value is None and name == "check":
        return _CHECK_DEFAULT
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_qkv(q, k, v, rank: int, layout: str):
    """q, k, v as CuPy arrays of one float dtype, rank and consistent heads/head dims; and the dtype name."""
    q = as_cuda_array(q, "q")
    k = as_cuda_array(k, "k")
    v = as_cuda_array(v, "v")
    name = check_float_dtype(q, "q")
    check_same_dtype(q, "q", k, "k")
    check_same_dtype(q, "q", v, "v")
    for x, xname in ((q, "q"), (k, "k"), (v, "v")):
        check_rank(x, rank, xname, layout)
    check_heads(q.shape[-2], k.shape[-2], v.shape[-2])
    check_head_dim(q.shape[-1], k.shape[-1], v.shape[-1], MAX_HEAD_DIM, own_value_dim=True)
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"v must have the batch and length of k {tuple(k.shape[:-2])}, got {tuple(v.shape[:-2])}")
    return q, k, v, name


def kernel_ready(x, head_dim_padded: int):
    """x itself when its rows are 16-byte aligned with the last axis contiguous, else an aligned,
    zero-padded copy (documented: non-contiguous last axes and odd head dims cost a copy)."""
    cupy = _cupy()

    d = x.shape[-1]
    strides = element_strides(x)
    aligned = (
        d == head_dim_padded
        and strides[-1] == 1
        and all(s % 8 == 0 for s in strides[:-1])
        and x.data.ptr % 16 == 0
    )
    if aligned:
        return x
    padded = cupy.zeros(x.shape[:-1] + (head_dim_padded,), dtype=x.dtype)
    padded[..., :d] = x
    return padded


def check_float_dtype(x, name: str) -> str:
    if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    return SUPPORTED_DTYPES[np.dtype(x.dtype)]


def check_same_dtype(ref, ref_name: str, x, name: str) -> None:
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {x.dtype}")


def check_rank(x, rank: int, name: str, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must be {rank}-d {layout}, got shape {tuple(x.shape)}")


def check_heads(hq: int, hk: int, v_heads: int) -> None:
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"the heads of q ({hq}) must be a multiple of the heads of k ({hk}) (GQA/MQA)")
    if v_heads != hk:
        raise ValueError(f"v must have the heads of k ({hk}), got {v_heads}")


def check_head_dim(d: int, d_k: int, d_v: int, max_head_dim: int, *, own_value_dim: bool = False) -> None:
    """q's and k's head dim ``d`` in [1, max_head_dim]; v's ``d_v`` the same, or with ``own_value_dim``
    (attention, its backward and varlen: docs/design.md §2b) any in [1, max_head_dim] too."""
    if d_k != d:
        raise ValueError(f"k must have the head dim of q ({d}), got {d_k}")
    if d_v != d and not own_value_dim:
        raise ValueError(f"v must have the head dim of q ({d}); a different value head dim is not supported, got {d_v}")
    if not 1 <= d <= max_head_dim:
        raise ValueError(f"the head dim (last axis of q) must be in [1, {max_head_dim}], got {d}")
    if not 1 <= d_v <= max_head_dim:
        raise ValueError(f"the value head dim (last axis of v) must be in [1, {max_head_dim}], got {d_v} "
                         f"(the pair (D_qk, D_v) = ({d}, {d_v}))")


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    scale = float(scale)
    # float32 in the kernels, and scale * log2(e) too: neither may round to 0 or overflow there.
    limit = FLOAT32_MAX / math.log2(math.e)
    if not FLOAT32_TINY <= scale <= limit:
        raise ValueError(f"scale must be > 0, in [{FLOAT32_TINY:.4g}, {limit:.4g}] (float32 in the kernels), got "
                         f"{scale}")
    return scale


def check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    softcap = float(softcap)
    # float32 in the kernels: a softcap that rounds to 0 there would silently turn the cap off.
    if not (softcap == 0 or FLOAT32_TINY <= softcap <= FLOAT32_MAX):
        raise ValueError(f"softcap must be 0 (off) or in [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] (float32 in the "
                         f"kernels), got {softcap}")
    return softcap


def check_window(window, causal, seqlens=None) -> tuple[int, int]:
    """(left, right) with causal folded in as right = 0; -1 means unbounded.

    ``seqlens`` = (seqlen_q, seqlen_k), bounds of the call's query and key lengths: a side wider
    than that is cut to it, which is the same attention (query i sees keys i + seqlen_k - seqlen_q -
    left .. i + seqlen_k - seqlen_q + right, so left >= seqlen_k - 1 and right >= seqlen_q - 1
    bound nothing). The kernels add window sizes to positions in int32, where a size near 2**31
    would overflow: cut so, ``i + seqlen_k - seqlen_q + left + 1`` stays below ``2 * seqlen_k``.
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window is None:
        left, right = -1, -1
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"window must be a pair (left, right), got {window!r}")
        for value in window:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"window must hold ints, got {window!r}")
        left, right = int(window[0]), int(window[1])
        if left < -1 or right < -1:
            raise ValueError(f"window values must be >= -1 (-1 = unbounded), got {window!r}")
        if left > INT32_MAX or right > INT32_MAX:
            raise ValueError(f"window values must be at most {INT32_MAX} (int32 in the kernels; -1 = unbounded), "
                             f"got {window!r}")
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if seqlens is not None:
        left, right = min(left, max(seqlens[1] - 1, 0)), min(right, max(seqlens[0] - 1, 0))   # -1 stays -1
    return left, right


def check_dropout(dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float, np.floating, np.integer)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p


def check_dropout_origin(origin, seqlens) -> dict:
    """The FwdParams fields of a call's dropout origin ``(row0, col0)``: the call draws the dropout mask
    of rows ``row0 ..`` and columns ``col0 ..`` of a larger call (ring attention's chunk pairs).
    ``col0`` must be a multiple of 4: the kernels draw a call's keys in Philox blocks of 4 from its
    first column (cuda_src/philox.cuh)."""
    try:
        row0, col0 = origin
    except (TypeError, ValueError):
        raise TypeError(f"dropout_origin must be a (row0, col0) pair of ints, got {origin!r}") from None
    for name, x, n in (("row0", row0, seqlens[0]), ("col0", col0, seqlens[1])):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"dropout_origin's {name} must be an int, got {type(x).__name__}")
        if not 0 <= int(x) <= INT32_MAX - n:
            raise ValueError(f"dropout_origin's {name} = {int(x)} must be in [0, 2**31 - 1 - {n}]")
    if col0 % 4:
        raise ValueError(f"dropout_origin's col0 = {int(col0)} must be a multiple of 4 (the kernels draw "
                         f"dropout in Philox blocks of 4 keys aligned to the call's first key)")
    return {"dropout_row0": int(row0), "dropout_col0": int(col0)}


def check_generator(generator):
    from .random import Generator, default_generator

    if generator is None:
        return default_generator()
    if not isinstance(generator, Generator):
        raise TypeError(f"generator must be a cuflash.Generator, got {type(generator).__name__}")
    return generator


def element_strides(x) -> tuple[int, ...]:
    return tuple(s // x.itemsize for s in x.strides)


#: Cache formats decode reads as bytes (docs/design.md §2b), held in uint8 arrays.
KV_DTYPES = DECODE_KV_DTYPES


def check_kv_dtype(q, k_cache, v_cache, kv_dtype) -> None:
    """``kv_dtype`` against the caches' and q's dtypes: None for caches of q's dtype (uint8 caches
    need it), ``"float8_e4m3fn"`` for e4m3 bytes in uint8 caches with float16/bfloat16 queries."""
    if kv_dtype is None:
        for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            if np.dtype(x.dtype) == np.uint8:
                raise TypeError(f"{name} is uint8: an fp8 cache of e4m3 bytes needs kv_dtype='float8_e4m3fn' (and "
                                "k_scale, v_scale); other caches have the dtype of q")
        return
    if not isinstance(kv_dtype, str):
        raise TypeError(f"kv_dtype must be None or a str {KV_DTYPES}, got {type(kv_dtype).__name__}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be None or one of {KV_DTYPES}, got {kv_dtype!r}")
    for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if np.dtype(x.dtype) != np.uint8:
            raise TypeError(f"{name} must hold the e4m3 bytes as uint8 with kv_dtype={kv_dtype!r} (CuPy has no "
                            f"float8 dtype), got {x.dtype}")
    if check_float_dtype(q, "q") == "float32":
        raise TypeError(f"q is float32, but an fp8 cache (kv_dtype={kv_dtype!r}) is read by the float16/bfloat16 "
                        "tensor-core path (the e4m3 values are converted to q's 16-bit type exactly); pass q "
                        "(and k_new, v_new) as float16 or bfloat16")


def host_scale(x, name: str):
    """An fp8 cache's scale given on the host as one number (a Python or NumPy number, a NumPy array
    of one element): its float32 value, checked finite and positive; None for anything else (an
    array on the GPU, checked by :func:`check_kv_scale`)."""
    if x is None or isinstance(x, (bool, np.bool_)):
        return None
    if isinstance(x, (int, float, np.integer, np.floating)) or (isinstance(x, np.ndarray) and x.size == 1
                                                                  and x.ndim <= 1):
        value = np.float32(np.asarray(x).reshape(()))
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite float32 scale > 0, got {float(value)!r}")
        return float(value)
    return None


def check_kv_scale_layout(x, name: str, heads_k: int) -> None:
    """An fp8 cache's scale as an array, by dtype and shape only (also a traced JAX array): float32 of
    shape (), (1,) (per tensor) or (Hk,) (per kv head)."""
    if np.dtype(x.dtype) != np.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if tuple(x.shape) not in ((), (1,), (heads_k,)):
        raise ValueError(f"{name} must be a scalar or have shape (1,) or ({heads_k},) (one per kv head), got shape "
                         f"{tuple(x.shape)}")


def check_kv_scale(x, name: str, heads_k: int):
    """An fp8 cache's scale on the GPU (:func:`check_kv_scale_layout`), as (contiguous CuPy array,
    element stride between kv heads: 0 or 1)."""
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a float32 scale (a number, or a CUDA float32 array), got a bool")
    x = as_cuda_array(x, name)
    check_kv_scale_layout(x, name, heads_k)
    return _cupy().ascontiguousarray(x), (1 if x.ndim == 1 and x.shape[0] > 1 else 0)


def check_decode_operands(q, k_cache, v_cache, paged: bool, max_head_dim: int, kv_dtype=None) -> str:
    """The checks of a decode call's q and caches that read only dtypes and shapes (shared by
    :func:`cuflash.decode` and the JAX adapter's trace-time checks); returns q's dtype name.
    ``kv_dtype``: the caches' format when it is not q's dtype (:func:`check_kv_dtype`)."""
    layout = "(batch, seqlen, heads, head_dim)"
    check_kv_dtype(q, k_cache, v_cache, kv_dtype)
    dtype_name = check_float_dtype(q, "q")
    if kv_dtype is None:
        check_same_dtype(q, "q", k_cache, "k_cache")
        check_same_dtype(q, "q", v_cache, "v_cache")
    check_rank(q, 4, "q", layout)
    cache_layout = "(num_pages, page_size, heads, head_dim)" if paged else layout
    check_rank(k_cache, 4, "k_cache", cache_layout)
    check_rank(v_cache, 4, "v_cache", cache_layout)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)} but for its head dim (last "
                         f"axis), got {tuple(v_cache.shape)}")
    if kv_dtype is not None and v_cache.shape[3] != k_cache.shape[3]:
        raise ValueError(f"an fp8 cache needs v_cache's head dim to be k_cache's: the pair (D_qk, D_v) = "
                         f"({k_cache.shape[3]}, {v_cache.shape[3]}) is supported with 16-bit and float32 caches only")
    check_heads(q.shape[2], k_cache.shape[2], v_cache.shape[2])
    # A value head dim of its own (DeepSeek's (192, 128)): out has v_cache's head dim.
    check_head_dim(q.shape[3], k_cache.shape[3], v_cache.shape[3], max_head_dim, own_value_dim=kv_dtype is None)
    return dtype_name


# MLA decode (one latent cache, the values its first v_head_dim columns): DeepSeek's latent row of 512
# value and 64 rope columns, as the decode kernel's MLA variants take it (cuflash/kernels/decode.py).
MLA_HEAD_DIM, MLA_MAX_VALUE_DIM = 576, 512


def check_mla_arguments(mla: bool, v_head_dim, v_new, kv_dtype) -> None:
    """The arguments that say whether a decode call is MLA (``v_cache=None``) agree with it."""
    if not mla:
        if v_head_dim is not None:
            raise ValueError("v_head_dim is for MLA decode (v_cache=None: the values are the first v_head_dim columns "
                             "of k_cache); with a v_cache, its last axis is the value head dim")
        return
    if v_head_dim is None:
        raise ValueError("v_cache=None (MLA decode) needs v_head_dim: the values are the first v_head_dim columns "
                         "of k_cache")
    if isinstance(v_head_dim, bool) or not isinstance(v_head_dim, (int, np.integer)):
        raise TypeError(f"v_head_dim must be an int, got {type(v_head_dim).__name__}")
    if v_new is not None:
        raise ValueError("v_new must be None with v_cache=None (MLA decode): k_new holds the new latent rows, "
                         "whose first v_head_dim columns are their values")
    if kv_dtype is not None:
        raise ValueError(f"MLA decode (v_cache=None) does not take kv_dtype={kv_dtype!r} yet")


def check_mla_shape(dtype_name: str, head_dim: int, v_head_dim: int) -> None:
    """MLA decode runs float16/bfloat16 latent rows of MLA_HEAD_DIM columns, v_head_dim a multiple of 8
    up to MLA_MAX_VALUE_DIM."""
    if (dtype_name not in ("float16", "bfloat16") or head_dim != MLA_HEAD_DIM or v_head_dim % 8
            or not 0 < v_head_dim <= MLA_MAX_VALUE_DIM):
        raise ValueError(f"MLA decode (v_cache=None) runs float16/bfloat16 latent rows of {MLA_HEAD_DIM} columns "
                         f"with v_head_dim a multiple of 8 up to {MLA_MAX_VALUE_DIM}, got {dtype_name} rows of "
                         f"{head_dim} with v_head_dim={v_head_dim}")


def check_broadcast(x, name: str, target: tuple[int, ...], kind: str) -> tuple[int, ...]:
    """The 4-d shape of a mask/bias/block_mask (``kind`` "bool" or "float") that broadcasts to
    ``target``, or an error naming it. Reads only ``dtype`` and ``shape``: an abstract array passes
    (the JAX adapter checks at trace time)."""
    if kind == "bool" and x.dtype != np.bool_:
        raise TypeError(f"{name} must be a bool array (True = may attend), got {x.dtype}")
    if kind == "float" and np.dtype(x.dtype) not in BIAS_DTYPE_CODES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if len(x.shape) > 4:
        raise ValueError(f"{name} must have at most 4 axes, got shape {tuple(x.shape)}")
    shape = (1,) * (4 - len(x.shape)) + tuple(x.shape)
    for have, want in zip(shape, target):
        if have not in (1, want):
            raise ValueError(f"{name} of shape {tuple(x.shape)} does not broadcast to {target}")
    return shape


def broadcast_operand(x, name: str, target: tuple[int, ...], kind: str):
    """A zero-copy broadcast view of a mask/bias/block_mask to ``target`` (4-d), or an error."""
    x = as_cuda_array(x, name)
    shape = check_broadcast(x, name, target, kind)
    return _cupy().broadcast_to(x.reshape(shape), target)


def check_alibi(alibi_slopes, batch: int, heads_q: int):
    x = as_cuda_array(alibi_slopes, "alibi_slopes")
    if x.dtype != np.float32:
        raise TypeError(f"alibi_slopes must be float32, got {x.dtype}")
    if tuple(x.shape) not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes must have shape ({heads_q},) or ({batch}, {heads_q}), got {tuple(x.shape)}")
    return _cupy().ascontiguousarray(x)


def check_sinks(sinks, heads_q: int):
    """Attention sinks (docs/design.md §2b): a CUDA float32 array of shape (Hq,), one logit per query
    head, as a contiguous CuPy array (None passes)."""
    if sinks is None:
        return None
    x = as_cuda_array(sinks, "sinks")
    if x.dtype != np.float32:
        raise TypeError(f"sinks must be float32, got {x.dtype}")
    if tuple(x.shape) != (heads_q,):
        raise ValueError(f"sinks must have shape ({heads_q},) (one per query head), got {tuple(x.shape)}")
    return _cupy().ascontiguousarray(x)


def check_return_dsinks(return_dsinks, sinks) -> bool:
    """``return_dsinks``: a bool, True only with ``sinks``."""
    if not isinstance(return_dsinks, (bool, np.bool_)):
        raise TypeError(f"return_dsinks must be a bool, got {type(return_dsinks).__name__}")
    if return_dsinks and sinks is None:
        raise ValueError("return_dsinks=True needs sinks (the forward's sinks=)")
    return bool(return_dsinks)


def check_block_size(block_size) -> tuple[int, int]:
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
        raise ValueError(f"block_size must be a pair (bq, bk), got {block_size!r}")
    for value in block_size:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= INT32_MAX:
            raise ValueError(f"block_size must hold two ints in [1, {INT32_MAX}] (int32 in the kernels), got "
                             f"{block_size!r}")
    return int(block_size[0]), int(block_size[1])


def check_out(out, name: str, shape: tuple[int, ...], dtype, *, contiguous_last: bool = True):
    """A caller's output buffer (a CuPy array or a CUDA DLPack tensor) of exactly this shape and
    dtype, as a CuPy view."""
    out = as_cuda_array(out, name)
    if out.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {out.dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if contiguous_last and not out.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return out


def memory_span(x) -> tuple[int, int]:
    """[first, last) byte addresses an array's elements can occupy (empty arrays: an empty span)."""
    if x.size == 0:
        return 0, 0
    low = high = x.data.ptr
    for n, stride in zip(x.shape, x.strides):
        if stride > 0:
            high += (n - 1) * stride
        else:
            low += (n - 1) * stride
    return low, high + x.itemsize


def check_disjoint(outputs, inputs, why: str = "pass an output buffer of its own") -> None:
    """Raise ValueError when an output's memory overlaps an input's or another output's: the kernels
    read their inputs while writing, so an overlap would be a race. ``outputs`` and ``inputs`` are
    (name, array or None) pairs; spans are compared, so two interleaved views count as overlapping.
    ``why`` ends the message."""
    spans = [(name, memory_span(x)) for name, x in outputs if x is not None]
    for i, (name, (low, high)) in enumerate(spans):
        others = spans[i + 1:] + [(n, memory_span(x)) for n, x in inputs if x is not None]
        for other, (lo, hi) in others:
            if low < hi and lo < high:
                raise ValueError(f"{name} overlaps {other} in memory: {why}")


def distinct_elements(shape, strides, itemsize: int) -> bool:
    """Whether no two elements of a layout (shape, byte strides) can share a byte, by a sufficient
    test: taken by increasing stride, each axis longer than 1 steps past every byte that the faster
    axes reach. Every view sliced or transposed out of a C- or F-ordered array passes; zero
    (broadcast) strides and axes that step into each other fail."""
    if 0 in tuple(shape):
        return True
    reach = itemsize
    for stride, n in sorted((abs(s), n) for n, s in zip(shape, strides) if n > 1):
        if stride < reach:
            return False
        reach += (n - 1) * stride
    return True


def check_cache_rows(k_cache, v_cache) -> None:
    """Before an append into the caches (same shape; ``v_cache`` None for MLA's one latent cache):
    ValueError when two rows of a cache can share memory (a zero or overlapping batch or page
    stride), or a row of k_cache one of v_cache (``k_cache is v_cache``, overlapping views): an
    appended row would overwrite another's. Caches interleaved in one allocation (k and v as views of
    a (..., 2, ...) array) are distinct."""
    for x, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if x is None:   # one cache (MLA decode)
            continue
        if not distinct_elements(x.shape, x.strides, x.itemsize):
            raise ValueError(f"{name} has rows that share memory (shape {tuple(x.shape)}, byte strides "
                             f"{tuple(x.strides)}: a zero or overlapping batch/page stride), and the call appends "
                             "k_new/v_new into it, which would overwrite another row: pass a cache whose rows are "
                             "distinct (without k_new/v_new it is only read, and that is allowed)")
    if v_cache is None:
        return
    if k_cache.strides == v_cache.strides:
        # v_cache is k_cache moved by delta bytes: the two are distinct iff the layout with a leading
        # axis of length 2 and stride delta is.
        delta = v_cache.data.ptr - k_cache.data.ptr
        apart = distinct_elements((2, *k_cache.shape), (delta, *k_cache.strides), k_cache.itemsize)
    else:
        (k_lo, k_hi), (v_lo, v_hi) = memory_span(k_cache), memory_span(v_cache)
        apart = k_hi <= v_lo or v_hi <= k_lo
    if not apart:
        raise ValueError("k_cache and v_cache share memory (k_cache is v_cache, or views whose rows overlap), and "
                         "the call appends k_new/v_new into both, so appended keys would overwrite values: pass "
                         "separate caches (without k_new/v_new they are only read, and sharing is allowed)")


def check_size(value: int, limit: int, what: str, why: str) -> None:
    """ValueError when a size exceeds what the kernels can index; ``what`` names the argument (and
    its axes), ``why`` says what sets the limit."""
    if value > limit:
        raise ValueError(f"{what} must be at most {limit} ({why}), got {value}")


def check_problem_size(q, k, *, batch: int, seqlen_q: int, seqlen_k: int, varlen: bool) -> None:
    """The sizes of a forward or backward call that the attention kernels can index: a CUDA grid row
    per sequence and per query head (grid axes y and z), q's and k's rows x heads in int32, and query
    and key positions (compared after adding the window) in int32. ``seqlen_q``/``seqlen_k``: the
    lengths, or under varlen their bounds max_seqlen_q/k."""
    grid = "one CUDA grid row (axis y or z) per sequence and per query head"
    if varlen:
        check_size(batch, GRID_YZ_MAX, "the sequences of cu_seqlens_q (its length - 1)", grid)
    else:
        check_size(batch, GRID_YZ_MAX, "the batch of q (axis 0)", grid)
    check_size(q.shape[-2], GRID_YZ_MAX, "the heads of q (axis -2)", grid)
    axes = "total x heads" if varlen else "batch x seqlen x heads"
    for x, name in ((q, "q"), (k, "k")):
        check_size(math.prod(x.shape[:-1]), INT32_MAX, f"the rows of {name} ({axes})", "int32 in the kernels")
    lengths = "max_seqlen_q + max_seqlen_k" if varlen else "the sequence lengths of q and k (axis 1) added"
    check_size(seqlen_q + seqlen_k, INT32_MAX, lengths, "positions are int32 in the kernels")


@dataclass
class Options:
    """Validated, kernel-ready options shared by the forward entry points."""

    scale: float
    window: tuple[int, int]
    softcap: float
    dropout_p: float
    generator: object


def check_options(*, head_dim, causal, scale, window, softcap, dropout_p, generator, seqlens=None) -> Options:
    """The forward options; ``seqlens`` as in :func:`check_window`."""
    return Options(
        scale=check_scale(scale, head_dim),
        window=check_window(window, causal, seqlens),
        softcap=check_softcap(softcap),
        dropout_p=check_dropout(dropout_p),
        generator=check_generator(generator) if dropout_p else None,
    )


def check_cu_seqlens(cu, name: str, batch: int | None):
    """cu_seqlens: an int32 (B+1,) array on the GPU. Its values are never read here (that would
    synchronise): the check_indices kernel validates them before the attention kernels run."""
    cu = as_cuda_array(cu, name)
    if cu.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-d of length batch + 1 >= 1, got shape {tuple(cu.shape)}")
    if batch is not None and cu.shape[0] != batch + 1:
        raise ValueError(f"{name} must have length {batch + 1} like cu_seqlens_q, got {cu.shape[0]}")
    if cu.strides[0] != 4:
        cu = _cupy().ascontiguousarray(cu)
    return cu


def check_max_seqlen(value, name: str, total: int) -> int:
    """max_seqlen_q/k: an int in [0, total], or None for the total (which bounds every sequence)."""
    if value is None:
        return total
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return min(int(value), total)


def check_varlen(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q, max_seqlen_k):
    """The packed-sequence arguments of the varlen entry points: both cu_seqlens
    (:func:`check_cu_seqlens`, same batch) and the max_seqlen bounds.

    Returns
    -------
    cu_q, cu_k : the cu_seqlens on the GPU (contiguous)
    batch : int
    max_q, max_k : int, bounds of the longest query and key sequences
    """
    cu_q = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", None)
    batch = cu_q.shape[0] - 1
    cu_k = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", batch)
    return (cu_q, cu_k, batch, check_max_seqlen(max_seqlen_q, "max_seqlen_q", total_q),
            check_max_seqlen(max_seqlen_k, "max_seqlen_k", total_k))


def int32_operand(x, name: str, ndim: int):
    """An int32 index array: on the GPU (used as it is; its values are checked by a kernel, never
    read back here), or given on the host (NumPy array or list: checked here by the caller, then
    copied to the GPU, no synchronisation).

    Returns
    -------
    (device array (C-contiguous), host array or None)
    """
    cupy = _cupy()
    if isinstance(x, (list, tuple)):
        x = _int32_values(x, name)
    if isinstance(x, np.ndarray):
        if x.dtype != np.int32:
            raise TypeError(f"{name} must be int32, got {x.dtype}")
        if x.ndim != ndim:
            raise ValueError(f"{name} must be {ndim}-d, got shape {tuple(x.shape)}")
        return cupy.asarray(np.ascontiguousarray(x)), x.astype(np.int64)
    device = as_cuda_array(x, name)
    if device.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {device.dtype}")
    if device.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-d, got shape {tuple(device.shape)}")
    # The kernels index rows of it densely (a strided row axis is fine for block_table).
    if device.strides[-1] != 4 or any(s < 0 for s in device.strides):
        device = cupy.ascontiguousarray(device)
    return device, None


def _int32_values(values, name: str) -> np.ndarray:
    """A list or tuple of ints as an int32 array; np.asarray(values, dtype=np.int32) would truncate
    floats and raise OverflowError for values past int32, neither naming the argument."""
    try:
        x = np.asarray(values)
    except ValueError:   # ragged
        raise ValueError(f"{name} must be a rectangular array of int32 values, got a ragged sequence") from None
    if x.size == 0:
        return x.astype(np.int32)
    if x.dtype.kind == "O" and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in x.flat):
        raise ValueError(f"{name} holds values past int32: {min(x.flat)} .. {max(x.flat)}")
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold int32 values, got {x.dtype} values")
    if x.min() < -INT32_MAX - 1 or x.max() > INT32_MAX:
        raise ValueError(f"{name} holds values past int32: {x.min()} .. {x.max()}")
    return x.astype(np.int32)
