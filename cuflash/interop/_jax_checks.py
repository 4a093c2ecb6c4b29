"""Trace-time checks of :mod:`cuflash.interop.jax`: the arguments' shapes, dtypes and options, read
from JAX's abstract values (``jax.eval_shape`` raises the same errors, and no GPU is needed).

The messages are :mod:`cuflash._checks`' (its shape and option checks are reused as they are); what
that module reads from a CuPy array (a pointer, strides) does not exist at trace time, so the array
options (ALiBi slopes, mask, bias, block mask, index arrays) are checked here by shape and dtype
alone. The pointers' checks (alignment, overlap) need none: XLA's buffers are dense, aligned and
distinct. Every function returns what the callback needs as hashable, static values.

fp8 KV caches. ``jnp.float8_e4m3fn`` caches imply ``kv_dtype="float8_e4m3fn"`` (:func:`check_kv_format`);
the adapter hands cuflash their bytes (uint8), which is what :mod:`cuflash._checks` then checks.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .. import _checks
from ..kernels import decode as _decode_kernels
from ..kernels.common import MAX_HEAD_DIM

__all__ = ["check_array", "check_attention", "check_decode", "check_dropout_rng", "check_kv_format", "check_kv_scales",
           "check_merge", "check_varlen", "check_varlen_over_cache"]

#: The fp8 cache format that float8_e4m3fn caches imply (cuflash.decode's kv_dtype), and its dtype.
FP8 = "float8_e4m3fn"
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)


def check_array(x, name: str):
    """``x`` as a JAX array (NumPy arrays are taken as constants); TypeError naming ``name`` otherwise."""
    import jax
    import jax.numpy as jnp

    if isinstance(x, jax.Array):
        return x
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    raise TypeError(f"{name} must be a JAX array, got {type(x).__name__}")


def _check_qkv(q, k, v, rank: int, layout: str) -> str:
    name = _checks.check_float_dtype(q, "q")
    _checks.check_same_dtype(q, "q", k, "k")
    _checks.check_same_dtype(q, "q", v, "v")
    for x, xname in ((q, "q"), (k, "k"), (v, "v")):
        _checks.check_rank(x, rank, xname, layout)
    _checks.check_heads(q.shape[-2], k.shape[-2], v.shape[-2])
    _checks.check_head_dim(q.shape[-1], k.shape[-1], v.shape[-1], MAX_HEAD_DIM, own_value_dim=True)
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"v must have the batch and length of k {tuple(k.shape[:-2])}, got {tuple(v.shape[:-2])}")
    return name


def _check_alibi(x, batch: int, heads_q: int) -> None:
    if x.dtype != np.float32:
        raise TypeError(f"alibi_slopes must be float32, got {x.dtype}")
    if tuple(x.shape) not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes must have shape ({heads_q},) or ({batch}, {heads_q}), got {tuple(x.shape)}")


def _check_sinks(x, heads_q: int) -> None:
    """Attention sinks: float32 (Hq,), one logit per query head (as :func:`cuflash._checks.check_sinks`)."""
    if x.dtype != np.float32:
        raise TypeError(f"sinks must be float32, got {x.dtype}")
    if tuple(x.shape) != (heads_q,):
        raise ValueError(f"sinks must have shape ({heads_q},) (one per query head), got {tuple(x.shape)}")


def _check_int32(x, name: str, shape: tuple) -> None:
    if x.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")


def _check_options(head_dim: int, causal, scale, window, softcap, dropout_p, seqlens) -> tuple:
    """(scale, window, softcap, dropout_p) as given, once checked; the window as a tuple (hashable)."""
    _checks.check_scale(scale, head_dim)
    _checks.check_window(window, causal, seqlens)
    _checks.check_softcap(softcap)
    _checks.check_dropout(dropout_p)
    return scale, (None if window is None else tuple(window)), softcap, dropout_p


def check_dropout_rng(dropout_rng, dropout_p: float) -> None:
    """A JAX PRNG key (typed, shape (), or a raw uint32 (2,) key) when ``dropout_p > 0``."""
    if not dropout_p:
        return
    if dropout_rng is None:
        raise ValueError("dropout_p > 0 needs dropout_rng, a JAX PRNG key (jax.random.key(seed)), to draw its mask")
    import jax

    typed = isinstance(dropout_rng, jax.Array) and jax.dtypes.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key)
    raw = isinstance(dropout_rng, jax.Array) and dropout_rng.dtype == np.uint32 and dropout_rng.shape == (2,)
    if not (typed and dropout_rng.shape == ()) and not raw:
        dtype, shape = getattr(dropout_rng, "dtype", None), getattr(dropout_rng, "shape", None)
        raise TypeError(f"dropout_rng must be one JAX PRNG key (jax.random.key(seed), or a raw uint32 (2,) key), got "
                        f"{type(dropout_rng).__name__} of dtype {dtype} and shape {shape}")


def check_attention(q, k, v, *, causal, scale, window, softcap, alibi_slopes, mask, bias, block_mask, block_size,
                    dropout_p, deterministic, sinks=None) -> tuple:
    """The checks of :func:`cuflash.attention_forward` and :func:`cuflash.attention_backward` that
    need no data. Returns the static options (scale, window, softcap, dropout_p, block_size,
    deterministic)."""
    _check_qkv(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
    b, sq, hq, d = q.shape
    if k.shape[0] != b:
        raise ValueError(f"k must have the batch size of q ({b}), got {k.shape[0]}")
    sk = k.shape[1]
    _checks.check_problem_size(q, k, batch=b, seqlen_q=sq, seqlen_k=sk, varlen=False)
    options = _check_options(d, causal, scale, window, softcap, dropout_p, (sq, sk))
    bq, bk = _checks.check_block_size(block_size)
    if alibi_slopes is not None:
        _check_alibi(alibi_slopes, b, hq)
    if mask is not None:
        _checks.check_broadcast(mask, "mask", (b, hq, sq, sk), "bool")
    if bias is not None:
        _checks.check_broadcast(bias, "bias", (b, hq, sq, sk), "float")
    if block_mask is not None:
        _checks.check_broadcast(block_mask, "block_mask", (b, hq, math.ceil(sq / bq), math.ceil(sk / bk)), "bool")
    if sinks is not None:
        _check_sinks(sinks, hq)
    return (*options, (bq, bk), _checks.check_flag(deterministic, "deterministic"))


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap,
                 alibi_slopes, dropout_p, deterministic, sinks=None) -> tuple:
    """The checks of :func:`cuflash.attention_varlen` that need no data (the offsets' values are
    checked by a kernel). Returns (max_seqlen_q, max_seqlen_k, scale, window, softcap, dropout_p,
    deterministic)."""
    _check_qkv(q, k, v, 3, "(total, heads, head_dim)")
    total_q, hq, d = q.shape
    total_k = k.shape[0]
    for cu, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        if cu.dtype != np.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.ndim != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-d of length batch + 1 >= 1, got shape {tuple(cu.shape)}")
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_k must have length {batch + 1} like cu_seqlens_q, got {cu_seqlens_k.shape[0]}")
    # JAX needs them static (they size the grid), so unlike cuflash's they have no default.
    max_q = _checks.check_max_seqlen(max_seqlen_q, "max_seqlen_q", total_q)
    max_k = _checks.check_max_seqlen(max_seqlen_k, "max_seqlen_k", total_k)
    _checks.check_problem_size(q, k, batch=batch, seqlen_q=max_q, seqlen_k=max_k, varlen=True)
    options = _check_options(d, causal, scale, window, softcap, dropout_p, (max_q, max_k))
    if alibi_slopes is not None:
        _check_alibi(alibi_slopes, batch, hq)
    if sinks is not None:
        _check_sinks(sinks, hq)
    return (int(max_seqlen_q), int(max_seqlen_k), *options, _checks.check_flag(deterministic, "deterministic"))


def check_varlen_over_cache(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k,
                            cache_seqlens, block_table, causal, scale, window, softcap, alibi_slopes, dropout_p,
                            sinks) -> tuple:
    """The checks of :func:`cuflash.attention_varlen` over a KV cache (chunked prefill) that need no data:
    q (total_q, Hq, D), ``cu_seqlens_q`` one longer than ``cache_seqlens``, no ``cu_seqlens_k`` nor dropout,
    then :func:`check_decode`'s on a (B, max_seqlen_q, Hq, D) stand-in of q. Returns (max_seqlen_q,
    causal, window, softcap, scale)."""
    if cu_seqlens_k is not None or max_seqlen_k is not None:
        raise ValueError("cu_seqlens_k and max_seqlen_k must be None with cache_seqlens/block_table: the caches "
                         "hold the keys")
    if dropout_p:
        raise ValueError("dropout_p must be 0 with cache_seqlens/block_table (attention over a KV cache)")
    if cache_seqlens is None:
        raise ValueError("block_table needs cache_seqlens (each sequence's keys in its cache)")
    _checks.check_rank(q, 3, "q", "(total_q, heads, head_dim)")
    if cache_seqlens.ndim != 1:
        raise ValueError(f"cache_seqlens must have shape (B,), got {tuple(cache_seqlens.shape)}")
    batch = cache_seqlens.shape[0]
    _check_int32(cu_seqlens_q, "cu_seqlens_q", (batch + 1,))
    max_q = _checks.check_max_seqlen(max_seqlen_q, "max_seqlen_q", q.shape[0])
    import jax

    stand_in = jax.ShapeDtypeStruct((batch, max_q, *q.shape[1:]), q.dtype)
    _, causal, window, softcap, scale = check_decode(
        stand_in, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k_new=None, v_new=None,
        num_splits=0, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes, scale=scale,
        mask=None, sinks=sinks)
    return max_q, causal, window, softcap, scale


def check_kv_format(k_cache, v_cache, kv_dtype) -> tuple:
    """The caches' format, from their dtypes: ``jnp.float8_e4m3fn`` caches imply
    ``kv_dtype="float8_e4m3fn"`` (given or not); uint8 caches are e4m3 bytes only with that
    ``kv_dtype`` said (checked by :func:`cuflash._checks.check_kv_dtype`, as are unknown names).
    Returns (kv_dtype, whether the caches are float8 arrays that the adapter views as their bytes)."""
    e4m3, uint8 = np.dtype(FP8_DTYPE), np.dtype(np.uint8)
    dtypes = (np.dtype(k_cache.dtype), np.dtype(v_cache.dtype))
    for dtype, name in zip(dtypes, ("k_cache", "v_cache")):
        if dtype.itemsize == 1 and dtype not in (uint8, e4m3):
            raise TypeError(f"{name} is {dtype}: an fp8 cache is float8_e4m3fn (kv_dtype={FP8!r}), or its bytes as "
                            f"uint8 with kv_dtype={FP8!r}")
    if e4m3 not in dtypes:
        if isinstance(kv_dtype, str) and kv_dtype in _checks.KV_DTYPES:
            for dtype, name in zip(dtypes, ("k_cache", "v_cache")):
                if dtype != uint8:
                    raise TypeError(f"{name} must be float8_e4m3fn (or its bytes as uint8) with kv_dtype="
                                    f"{kv_dtype!r}, got {dtype}")
        return kv_dtype, False
    if dtypes[0] != dtypes[1]:
        raise TypeError(f"v_cache must have the dtype of k_cache ({dtypes[0]}), got {dtypes[1]}")
    return (FP8 if kv_dtype is None else kv_dtype), True


def check_kv_scales(kv_dtype, k_scale, v_scale, heads_k: int) -> tuple:
    """An fp8 cache's scales: required with ``kv_dtype``, refused without. A number (or a NumPy array of
    one element) is static, a float32 value (:func:`cuflash._checks.host_scale`: finite, > 0); a JAX
    array (NumPy arrays of more elements are taken as constants) is float32 of shape (), (1,) or (Hk,),
    an operand read at each call. Returns ((k value, v value), {name: array}) (None for an array)."""
    import jax

    if kv_dtype is None:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale are the scales of an fp8 cache: they need float8_e4m3fn caches (or "
                             f"uint8 ones with kv_dtype={FP8!r})")
        return (None, None), {}
    values, arrays = [], {}
    for x, name in ((k_scale, "k_scale"), (v_scale, "v_scale")):
        if x is None:
            raise ValueError(f"{name} is required with kv_dtype={kv_dtype!r} (a float32 scale per tensor: a float, or "
                             f"a JAX float32 array of shape () or (1,); or one per kv head, of shape ({heads_k},))")
        value = _checks.host_scale(x, name)
        if value is None:
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, (jax.Array, np.ndarray)):
                raise TypeError(f"{name} must be a float or a JAX float32 array, got {type(x).__name__}")
            x = check_array(x, name)
            _checks.check_kv_scale_layout(x, name, heads_k)
            arrays[name] = x
        values.append(value)
    return tuple(values), arrays


def check_decode(q, k_cache, v_cache, *, cache_seqlens, block_table, k_new, v_new, num_splits, causal, window,
                 softcap, alibi_slopes, scale, mask, sinks=None, kv_dtype=None, v_head_dim=None) -> tuple:
    """The checks of :func:`cuflash.decode` that need no data (the lengths' and the page table's
    values are checked by the decode kernels). ``kv_dtype``: fp8 caches, given here as their uint8
    bytes (:func:`check_kv_format`). MLA: ``v_cache`` None with ``v_head_dim`` (the values are
    k_cache's first columns; k_new alone). Returns (num_splits, causal, window, softcap, scale)."""
    paged = block_table is not None
    mla = v_cache is None
    _checks.check_mla_arguments(mla, v_head_dim, v_new, kv_dtype)
    if mla:   # one latent cache: it stands for v_cache, and k_new for v_new, in the checks below
        v_cache, v_new = k_cache, k_new
    max_head_dim = _checks.MLA_HEAD_DIM if mla else MAX_HEAD_DIM
    dtype_name = _checks.check_decode_operands(q, k_cache, v_cache, paged, max_head_dim, kv_dtype=kv_dtype)
    batch, seqlen_q, heads_q, d = q.shape
    if mla:
        _checks.check_mla_shape(dtype_name, d, int(v_head_dim))
    heads_k = k_cache.shape[2]
    if paged:
        if block_table.dtype != np.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.ndim != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have one row per sequence ({batch}, max_pages), got shape "
                             f"{tuple(block_table.shape)}")
        if k_cache.shape[1] == 0:
            raise ValueError("the paged cache must have page_size (k_cache.shape[1]) >= 1, got 0")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache must have the batch size of q ({batch}), got {k_cache.shape[0]}; a paged "
                             "cache needs block_table")
        capacity = k_cache.shape[1]
    _check_int32(cache_seqlens, "cache_seqlens", (batch,))
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    if k_new is not None:
        for x, name in ((k_new, "k_new"), (v_new, "v_new")):
            _checks.check_same_dtype(q, "q", x, name)
            _checks.check_rank(x, 4, name, "(batch, seqlen, heads, head_dim)")
        for x, name, dim in ((k_new, "k_new", d), (v_new, "v_new", v_cache.shape[3])):
            want = (batch, k_new.shape[1], heads_k, dim)
            if tuple(x.shape) != want:
                raise ValueError(f"{name} must have shape (batch, new tokens, kv heads, head_dim) = {want}, got "
                                 f"{tuple(x.shape)}")
        if k_new.shape[1] > capacity:
            raise ValueError(f"the {k_new.shape[1]} tokens of k_new/v_new do not fit a cache of {capacity} keys per "
                             "sequence")
        # cuflash copies a cache whose rows are not whole 16-byte chunks, and appending to a copy needs
        # the lengths on the host; here they are on the GPU, so the call could only fail when it runs.
        chunk = 16 // np.dtype(k_cache.dtype).itemsize
        for dim in {d, v_cache.shape[3]}:
            if dim % chunk:
                raise ValueError(f"appending into a cache needs its head dim ({dim}) to be a multiple of {chunk} "
                                 f"({np.dtype(k_cache.dtype)} rows of whole 16-byte chunks, updated in place)")
    scale, window, softcap, _ = _check_options(d, causal, scale, window, softcap, 0.0, (seqlen_q, capacity))
    if alibi_slopes is not None:
        _check_alibi(alibi_slopes, batch, heads_q)
    if sinks is not None:
        _check_sinks(sinks, heads_q)
    if mask is not None:
        if mask.dtype != np.bool_:
            raise TypeError(f"mask must be a bool array (True = may attend), got {mask.dtype}")
        if not 1 <= mask.ndim <= 4 or mask.shape[-1] == 0:
            raise ValueError(f"mask must have 1 to 4 axes and at least one key column, got shape {tuple(mask.shape)}")
        _checks.check_broadcast(mask, "mask", (batch, heads_q, seqlen_q, mask.shape[-1]), "bool")
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be an int (0 = heuristic), got {type(num_splits).__name__}")
    if not 0 <= num_splits <= _decode_kernels.DECODE_MAX_SPLITS:
        raise ValueError(f"num_splits must be in [0, {_decode_kernels.DECODE_MAX_SPLITS}] (0 = heuristic), got "
                         f"{num_splits}")
    return int(num_splits), bool(causal), window, softcap, scale


def check_merge(outs, lses) -> None:
    """Stacked partial results: ``outs`` (n, B, S, H, D) float16/bfloat16/float32/float64, ``lses``
    (n, B, H, S) float32."""
    if np.dtype(outs.dtype) not in (*_checks.SUPPORTED_DTYPES, np.dtype(np.float64)):
        raise TypeError(f"outs must be float16, bfloat16, float32 or float64, got {outs.dtype}")
    if outs.ndim != 5:
        raise ValueError(f"outs must be 5-d (parts, batch, seqlen, heads, head_dim) or a sequence of 4-d arrays, got "
                         f"shape {tuple(outs.shape)}")
    if outs.shape[0] == 0:
        raise ValueError("outs must hold at least one partial result, got 0")
    if lses.dtype != np.float32:
        raise TypeError(f"lses must be float32, got {lses.dtype}")
    n, b, s, h, _ = outs.shape
    if tuple(lses.shape) != (n, b, h, s):
        raise ValueError(f"lses must have shape (parts, batch, heads, seqlen) = {(n, b, h, s)}, got "
                         f"{tuple(lses.shape)}")
