"""Decode attention: a few new query tokens against a KV cache (contiguous or paged), split-KV.

:func:`decode` checks its operands on the host (index arrays on the GPU are checked on the GPU), then
runs ``cuda_src/decode.cu``, which also appends ``k_new`` / ``v_new`` into the cache and, when the keys
were split, combines the splits' partial states in the last split to finish.
The float64 twin is :func:`cuflash.reference.decode`.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import _checks, _mla_plan, _prefill_plan, kernels
from ._scores import modifier_parts, user_operands
from .modifiers.builtin import axis_len, lowered, states_builtin
from ._runtime import capture as _capture, faults as _faults, launch as _launch, memo as _memo, plan as _plan, step as _step
from ._build.compile import device_arch, get_kernel
from ._runtime.params import DECODE, Template

__all__ = ["decode", "varlen_over_cache"]


@functools.lru_cache(maxsize=None)
def _device_limits(device_id: int) -> tuple[int, int, int, float]:
    """(SM count, opt-in shared memory per block, shared memory per SM, peak memory rate in bytes/s,
    0.0 where the runtime does not report it) of a device."""
    import cupy

    rt = cupy.cuda.runtime
    try:   # memory clock (kHz) x bus width (bits), double data rate
        rate = 2e3 * (rt.deviceGetAttribute(rt.cudaDevAttrMemoryClockRate, device_id) *
                      rt.deviceGetAttribute(rt.cudaDevAttrGlobalMemoryBusWidth, device_id)) / 8
    except rt.CUDARuntimeError:   # a runtime that no longer reports them
        rate = 0.0
    return (rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, device_id),
            rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id),
            rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerMultiprocessor, device_id), rate)


def _aligned(x, d_pad: int, chunk: int) -> bool:
    """Whether the kernel can copy x's rows in 16-byte chunks: last axis contiguous with d_pad
    elements, every other stride (of an axis longer than 1) a multiple of the chunk, base aligned."""
    strides = _checks.element_strides(x)
    return (x.shape[-1] == d_pad and (strides[-1] == 1 or x.shape[-1] <= 1)
            and all(s % chunk == 0 for s, n in zip(strides[:-1], x.shape[:-1]) if n > 1)
            and x.data.ptr % 16 == 0)


def _bits(x):
    """x viewed as unsigned integers of its item size: copies and scatters then move bits, whatever
    CuPy's support for the float type (ml_dtypes' bfloat16) is."""
    import cupy

    return x.view({1: cupy.uint8, 2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[x.itemsize])


def _padded_copy(x, d_pad: int):
    import cupy

    padded = cupy.zeros(x.shape[:-1] + (d_pad,), dtype=x.dtype)
    _bits(padded)[..., :x.shape[-1]] = _bits(x)
    return padded


def _row_strides(x) -> tuple[int, int, int]:
    """(batch or page, row, head) element strides of a (B, S, H, D) array (0 for axes of length 1)."""
    return tuple(0 if n == 1 else s for s, n in zip(_checks.element_strides(x)[:3], x.shape[:3]))


def _check_pages(table, lens, seqlen_new: int, page_size: int, num_pages: int) -> None:
    """Every page a sequence uses (keys before and after the append) is a page of the cache; the
    appended rows land in distinct slots that no sequence reads (the kernel reads and appends at
    once, so an overlap would be a race)."""
    batch, max_pages = table.shape
    needed = -(-(lens + seqlen_new) // page_size)
    used = np.arange(max_pages)[None, :] < needed[:, None]
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        b, k = (int(v[0]) for v in np.nonzero(bad))
        raise ValueError(f"block_table[{b}, {k}] = {int(table[b, k])} is not a page of the cache (0 .. "
                         f"{num_pages - 1}), and sequence {b} uses it (cache_seqlens + appended tokens = "
                         f"{int(lens[b]) + seqlen_new} keys, page_size {page_size})")
    if seqlen_new == 0:
        return
    pos = lens[:, None] + np.arange(seqlen_new)[None, :]                        # (B, S_new) positions
    pages = table[np.arange(batch)[:, None], pos // page_size]
    slots = pos % page_size
    flat = pages * page_size + slots
    if np.unique(flat).size != flat.size:
        raise ValueError("block_table sends two appended tokens to the same cache slot (sequences share a "
                         "page at the positions being appended)")
    # Slots read as keys (positions < cache_seqlens) of pages that receive appended rows.
    target_pages = np.unique(pages)
    read_entries = np.arange(max_pages)[None, :] < (-(-lens // page_size))[:, None]
    hit = read_entries & np.isin(table, target_pages)
    if hit.any():
        rows, cols = np.nonzero(hit)
        reach = np.minimum(page_size, lens[rows] - cols * page_size)         # slots 0 .. reach-1 are read
        where = np.searchsorted(target_pages, table[rows, cols])
        max_reach = np.zeros(target_pages.size, dtype=np.int64)
        np.maximum.at(max_reach, where, reach)
        clash = slots < max_reach[np.searchsorted(target_pages, pages)]
        if clash.any():
            b, t = (int(v[0]) for v in np.nonzero(clash))
            raise ValueError(f"appended token {t} of sequence {b} would overwrite page {int(pages[b, t])} slot "
                             f"{int(slots[b, t])}, which a sequence reads as a cached key")


# Operand positions of a decode call (lse: the caller's buffer, or None: the plan allocates it when returned;
# sinks: float32 (Hq,) or None; k_scale / v_scale: an fp8 cache's scales on the GPU, or None when given as
# numbers on the host, which are then options);
# cu_seqlens_q: ragged new tokens (attention_varlen over a cache, :func:`varlen_over_cache`), None for
# decode; the array arguments of a ScoreMod / MaskMod follow, from _USER on.
(_Q, _K_CACHE, _V_CACHE, _LENS, _TABLE, _K_NEW, _V_NEW, _MASK, _ALIBI, _OUT, _LSE, _SINKS, _K_SCALE, _V_SCALE,
 _CU_Q, _USER) = range(16)


def _with_modifiers(operands, score_mod, mask_mod):
    """A call's operands with its modifiers' arrays after them (from _USER on), and the modifiers' part of
    the plan memo's key (None without modifiers)."""
    if score_mod is None and mask_mod is None:
        return operands, None
    mod_key, user_arrays = modifier_parts(score_mod, mask_mod)
    return operands + user_arrays, mod_key


def _varlen_queries(cu_seqlens_q, max_seqlen_q, cache_seqlens, total_q, k_new, mask):
    """The checks of ragged new tokens (:func:`varlen_over_cache`): int32 offsets (B + 1,), an int
    ``max_seqlen_q``, the cache's lengths (required: their count is B); no append and no decode mask.
    Offsets given on the host are checked here, on the GPU by the index check. Returns (offsets on the
    GPU, offsets on the host or None, B, max_seqlen_q)."""
    if cache_seqlens is None:
        raise ValueError("attention_varlen over a cache needs cache_seqlens (the keys each sequence's cache holds)")
    if k_new is not None or mask is not None:
        raise ValueError("attention_varlen over a cache takes no k_new/v_new or mask (append the chunk's keys first)")
    cu_dev, cu_host = _checks.int32_operand(cu_seqlens_q, "cu_seqlens_q", 1)
    batch = cu_dev.shape[0] - 1
    if batch < 0:
        raise ValueError("cu_seqlens_q must hold B + 1 offsets, got an empty array")
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, (int, np.integer)):
        raise TypeError(f"max_seqlen_q must be an int (the longest sequence of new tokens), got "
                        f"{type(max_seqlen_q).__name__}")
    if max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q must be >= 0, got {max_seqlen_q}")
    if cu_host is not None and batch:
        steps = np.diff(cu_host.astype(np.int64))
        if cu_host[0] != 0 or (steps < 0).any() or cu_host[-1] > total_q:
            raise ValueError(f"cu_seqlens_q must start at 0, never decrease and end at most at q's {total_q} rows, "
                             f"got {cu_host.tolist()[:8]}...")
        if steps.max() > max_seqlen_q:
            raise ValueError(f"max_seqlen_q = {max_seqlen_q} is smaller than sequence {int(np.argmax(steps))}'s "
                             f"{int(steps.max())} new tokens")
    return cu_dev, cu_host, batch, int(max_seqlen_q)


def varlen_over_cache(q, k_cache, v_cache, cu_seqlens_q, *, max_seqlen_q, cache_seqlens, block_table=None,
                      causal=True, window=None, softcap=0.0, alibi_slopes=None, scale=None, score_mod=None,
                      mask_mod=None, sinks=None, num_splits=0, return_lse=False, out=None, lse=None, check=None):
    """:func:`cuflash.attention_varlen` with ``block_table`` / ``cache_seqlens``: a ragged batch of new
    tokens (chunked prefill) against their sequences' caches, which already hold them.

    Sequence b's queries are rows ``cu_seqlens_q[b] ..`` of ``q`` (n_b of them) and its keys the
    ``cache_seqlens[b]`` of its cache (contiguous or paged), aligned bottom-right as in
    :func:`decode`: query i sees keys ``j <= i + cache_seqlens[b] - n_b`` with ``causal``. Runs on
    the decode kernel (rows packed per kv head, split-KV). Returns (out (total_q, Hq, D), lse (Hq,
    total_q) or None)."""
    if states_builtin(score_mod, mask_mod):   # what they state runs built in (positions as decode's)
        score_mod, mask_mod, window, softcap, alibi_slopes = lowered(score_mod, mask_mod, causal, window, softcap,
                                                                     alibi_slopes, None, axis_len(q, 1), True)
    operands, mod_key = _with_modifiers((q, k_cache, v_cache, cache_seqlens, block_table, None, None, None,
                                         alibi_slopes, out, lse, sinks, None, None, cu_seqlens_q), score_mod, mask_mod)
    options = (num_splits, causal, window, softcap, scale, return_lse, mod_key, None, None, None, None,
               ("varlen", max_seqlen_q), _prefill_plan.forced())
    plan, ptrs, where = _memo.lookup("decode", operands, options)
    if plan is None:
        plan, ptrs, finish = _plan_decode(operands, ptrs, num_splits=num_splits, causal=causal, window=window,
                                          softcap=softcap, scale=scale, return_lse=return_lse,
                                          modifiers=(score_mod, mask_mod), max_seqlen_q=max_seqlen_q)
        if plan is None:
            out, lse = finish
            return out, (lse if return_lse else None)
    results, _, _ = plan.run(operands, ptrs, where, check=_checks.check_flag(check))
    return results[0], (results[1] if return_lse else None)


def _scale_parts(k_scale, v_scale):
    """(k_scale operand, v_scale operand, k_scale value, v_scale value): a scale given on the host as
    one number is a float32 value (an option of the plan) and no operand; an array is an operand."""
    k_value, v_value = _checks.host_scale(k_scale, "k_scale"), _checks.host_scale(v_scale, "v_scale")
    return (None if k_value is not None else k_scale, None if v_value is not None else v_scale, k_value, v_value)


def _plan_decode(operands, key, *, num_splits, causal, window, softcap, scale, return_lse, modifiers=(None, None),
                 kv_dtype=None, scale_values=(None, None), v_head_dim=None, max_seqlen_q=None):
    """Check a decode call and plan its launches (see :func:`decode`); raises before any launch.

    Returns (plan, pointers, finish), or (None, None, result) for a call that launches nothing.
    """
    import cupy

    (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, mask, alibi_slopes, out, lse_user, sinks,
     k_scale, v_scale, cu_seqlens_q) = operands[:_USER]
    layout = "(batch, seqlen, heads, head_dim)"
    q = _checks.as_cuda_array(q, "q")
    # Ragged new tokens (varlen_over_cache): q (total_q, Hq, D) is read as one (1, total_q, Hq, D) batch
    # for the shape checks; the sequences are cu_seqlens_q's, their count cache_seqlens'.
    varlen = cu_seqlens_q is not None
    if varlen:
        _checks.check_rank(q, 3, "q", "(total_q, heads, head_dim)")
        q = q[None]
    k_cache = _checks.as_cuda_array(k_cache, "k_cache")
    # MLA: one latent cache, the values its first v_head_dim columns; v_cache / v_new stand for
    # k_cache / k_new from here on (the kernel reads the values from the key tiles).
    mla = v_cache is None
    _checks.check_mla_arguments(mla, v_head_dim, v_new, kv_dtype)
    v_cache = k_cache if mla else _checks.as_cuda_array(v_cache, "v_cache")
    paged = block_table is not None
    max_head_dim = _checks.MLA_HEAD_DIM if mla else kernels.common.MAX_HEAD_DIM
    dtype_name = _checks.check_decode_operands(q, k_cache, v_cache, paged, max_head_dim, kv_dtype=kv_dtype)
    batch, seqlen_q, heads_q, d = q.shape
    d_out = int(v_head_dim) if mla else v_cache.shape[3]   # columns of out: v's head dim
    cu_dev = cu_host = None
    total_q = seqlen_q
    if varlen:
        cu_dev, cu_host, batch, seqlen_q = _varlen_queries(cu_seqlens_q, max_seqlen_q, cache_seqlens, total_q, k_new,
                                                            mask)
    if mla:
        _checks.check_mla_shape(dtype_name, d, d_out)
    heads_k = k_cache.shape[2]
    # fp8 caches: their scales, given as numbers (scale_values) or as float32 arrays on the GPU.
    k_scale_dev = v_scale_dev = None
    scale_strides = (0, 0)
    if kv_dtype is None:
        if k_scale is not None or v_scale is not None or scale_values != (None, None):
            raise ValueError("k_scale / v_scale are the scales of an fp8 cache: they need kv_dtype='float8_e4m3fn'")
    else:
        for given, value, name in ((k_scale, scale_values[0], "k_scale"), (v_scale, scale_values[1], "v_scale")):
            if given is None and value is None:
                raise ValueError(f"{name} is required with kv_dtype={kv_dtype!r} (a float32 scale per tensor, or a "
                                 f"CUDA float32 array of shape ({heads_k},), one per kv head)")
        k_scale_dev, k_stride = (None, 0) if k_scale is None else _checks.check_kv_scale(k_scale, "k_scale",
                                                                                          heads_k)
        v_scale_dev, v_stride = (None, 0) if v_scale is None else _checks.check_kv_scale(v_scale, "v_scale",
                                                                                          heads_k)
        scale_strides = (k_stride, v_stride)

    # The cache, its capacity per sequence, and the lengths it holds (values checked on the host when
    # given there, else by the index check on the GPU).
    if paged:
        table_dev, table = _checks.int32_operand(block_table, "block_table", 2)
        if table_dev.shape[0] != batch:
            raise ValueError(f"block_table must have one row per sequence ({batch}), got shape "
                             f"{tuple(table_dev.shape)}")
        num_pages, page_size = k_cache.shape[:2]
        if page_size == 0:
            raise ValueError("the paged cache must have page_size (k_cache.shape[1]) >= 1, got 0")
        max_pages = table_dev.shape[1]
        capacity = max_pages * page_size
    else:
        table_dev = table = None
        num_pages = page_size = max_pages = 0
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache must have the batch size of q ({batch}), got {k_cache.shape[0]}; a paged "
                             "cache needs block_table")
        capacity = k_cache.shape[1]
    if cache_seqlens is None:
        seqlens_dev, lens = None, np.full(batch, capacity, dtype=np.int64)
    else:
        seqlens_dev, lens = _checks.int32_operand(cache_seqlens, "cache_seqlens", 1)
        if tuple(seqlens_dev.shape) != (batch,):
            raise ValueError(f"cache_seqlens must have shape ({batch},), got {tuple(seqlens_dev.shape)}")

    # Tokens to append.
    if not mla and (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    seqlen_new = 0
    if k_new is not None:
        k_new = _checks.as_cuda_array(k_new, "k_new")
        v_new = k_new if mla else _checks.as_cuda_array(v_new, "v_new")
        _checks.check_same_dtype(q, "q", k_new, "k_new")
        _checks.check_same_dtype(q, "q", v_new, "v_new")
        _checks.check_rank(k_new, 4, "k_new", layout)
        _checks.check_rank(v_new, 4, "v_new", layout)
        seqlen_new = k_new.shape[1]
        for x, name, dim in ((k_new, "k_new", d), (v_new, "v_new", d if mla else d_out)):
            want = (batch, seqlen_new, heads_k, dim)
            if tuple(x.shape) != want:
                raise ValueError(f"{name} must have shape (batch, new tokens, kv heads, head_dim) = {want}, got "
                                 f"{tuple(x.shape)}")
        if seqlen_new > capacity:
            raise ValueError(f"the {seqlen_new} tokens of k_new/v_new do not fit a cache of {capacity} keys per "
                             "sequence")
    if lens is not None and batch:   # values given on the host: checked here, no kernel needed
        if lens.min() < 0 or lens.max() + seqlen_new > capacity:
            b = int(np.argmax((lens < 0) | (lens + seqlen_new > capacity)))
            if lens[b] < 0 or lens[b] > capacity:
                raise ValueError(f"cache_seqlens[{b}] = {int(lens[b])} is not in [0, {capacity}] (the cache holds "
                                 f"{capacity} keys per sequence)")
            raise ValueError(f"the {seqlen_new} tokens of k_new/v_new do not fit: sequence {b} holds "
                             f"{int(lens[b])} of {capacity} keys" + (" (cache_seqlens=None means full)"
                                                                      if cache_seqlens is None else
                                                                      f" (cache_seqlens[{b}])"))
        if paged and table is not None:
            _check_pages(table, lens, seqlen_new, page_size, num_pages)
    check_on_gpu = batch > 0 and ((cache_seqlens is not None and lens is None) or (paged and table is None)
                                  or (varlen and cu_host is None))

    # Options (a sequence holds at most ``capacity`` keys: the bound of the window).
    opts = _checks.check_options(head_dim=d, causal=causal, scale=scale, window=window, softcap=softcap,
                                 dropout_p=0.0, generator=None, seqlens=(seqlen_q, capacity))
    score_fields, alibi_dev = {}, None
    if alibi_slopes is not None:
        alibi_dev = _checks.check_alibi(alibi_slopes, batch, heads_q)
        score_fields.update({"score.alibi_slopes": None, "score.alibi_batch_stride": heads_q if alibi_dev.ndim == 2 else 0})
    mask_view, mask_keys = None, 0
    if mask is not None:
        m = _checks.as_cuda_array(mask, "mask")
        if m.dtype != np.bool_:
            raise TypeError(f"mask must be a bool array (True = may attend), got {m.dtype}")
        if not 1 <= m.ndim <= 4 or m.shape[-1] == 0:
            raise ValueError(f"mask must have 1 to 4 axes and at least one key column, got shape {tuple(m.shape)}")
        cols = m.shape[-1]
        mask_view = _checks.broadcast_operand(m, "mask", (batch, heads_q, seqlen_q, cols), "bool")
        mask_keys = 0 if cols == 1 else cols
    sinks_dev = _checks.check_sinks(sinks, heads_q)
    user_fields, user_arrays, user_mods, user_source = user_operands(*modifiers, first=_USER)
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be an int (0 = heuristic), got {type(num_splits).__name__}")
    if not 0 <= num_splits <= kernels.decode.DECODE_MAX_SPLITS:
        raise ValueError(f"num_splits must be in [0, {kernels.decode.DECODE_MAX_SPLITS}] (0 = heuristic), got "
                         f"{num_splits}")
    out_user = out
    # Shapes of out and lse: (B, Sq, Hq, D) and (B, Hq, Sq); ragged: (total_q, Hq, D) and (Hq, total_q).
    out_shape = (total_q, heads_q, d_out) if varlen else (batch, seqlen_q, heads_q, d_out)
    lse_shape = (heads_q, total_q) if varlen else (batch, heads_q, seqlen_q)
    if out is not None:
        out = _checks.check_out(out, "out", out_shape, q.dtype)
    lse_given = None if lse_user is None else _checks.check_out(lse_user, "lse", lse_shape, np.float32)

    # Memory the call writes must not be memory it reads: out always, the caches when it appends.
    reads = (("q", q), ("k_new", k_new), ("v_new", v_new), ("mask", mask_view), ("alibi_slopes", alibi_dev),
             ("cache_seqlens", seqlens_dev), ("block_table", table_dev), ("sinks", sinks_dev), ("cu_seqlens_q", cu_dev),
             ("k_scale", k_scale_dev), ("v_scale", v_scale_dev),
             *(("score_mod/mask_mod argument", x) for x in user_arrays))
    _checks.check_disjoint((("out", out), ("lse", lse_given)), (*reads, ("k_cache", k_cache), ("v_cache", v_cache)))
    if seqlen_new:
        # Without an append the caches are only read: a broadcast cache, or k_cache is v_cache, is fine.
        _checks.check_cache_rows(k_cache, None if mla else v_cache)
        for name, cache in (("k_cache", k_cache),) if mla else (("k_cache", k_cache), ("v_cache", v_cache)):
            _checks.check_disjoint(((name, cache),), reads,
                                   why="the call appends k_new/v_new into the caches, so nothing it reads may "
                                       "share their memory")

    # Sizes: grid axes y and z are kv heads and sequences; the kernel's positions, pages and rows are int32.
    grid = "one CUDA grid row (axis y or z) per sequence and per kv head"
    _checks.check_size(batch, _checks.GRID_YZ_MAX, "the batch of q (axis 0)", grid)
    _checks.check_size(heads_k, _checks.GRID_YZ_MAX, "the heads of k_cache (axis 2)", grid)
    int32 = "int32 in the decode kernel"
    _checks.check_size(seqlen_q * max(heads_q, 1), _checks.INT32_MAX, "the rows of q (seqlen x heads)", int32)
    _checks.check_size(capacity, _checks.INT32_MAX, "the keys a sequence can hold (block_table's columns x "
                       "page_size)" if paged else "the length of k_cache (axis 1)", int32)
    _checks.check_size(num_pages, _checks.INT32_MAX, "the pages of k_cache (axis 0)", int32)
    _checks.check_size(batch * max_pages, _checks.INT32_MAX, "the entries of block_table", int32)
    _checks.check_size(mask_keys, _checks.INT32_MAX, "the key columns of mask (last axis)", int32)
    if batch == 0:
        _memo.nothing_to_plan()
        out = cupy.empty(out_shape, dtype=q.dtype) if out is None else out
        lse = cupy.empty(lse_shape, dtype=np.float32) if lse_user is None else lse_user
        return None, None, (out_user if out_user is not None else out, lse)

    # Kernel-ready operands: 16-byte rows. q and k_new are small, so misaligned ones are copied; a
    # misaligned cache is copied too (slow, documented) and the appended rows written back after. An fp8
    # cache moves 16 values per 16-byte copy, so its rows (and q's, padded alike) come in 16 columns.
    chunk = 16 // q.itemsize
    cache_chunk = 16 // k_cache.itemsize
    d_pad = -(-d // cache_chunk) * cache_chunk
    # v's rows: their own head dim (MLA: the key rows themselves).
    dv_pad = d_pad if mla else -(-d_out // cache_chunk) * cache_chunk
    q_k = q if _aligned(q, d_pad, chunk) else _padded_copy(q, d_pad)
    cache_in_place = _aligned(k_cache, d_pad, cache_chunk) and _aligned(v_cache, dv_pad, cache_chunk)
    kc, vc = (k_cache, v_cache) if cache_in_place else (_padded_copy(k_cache, d_pad), _padded_copy(v_cache, dv_pad))
    kn = vn = None
    if seqlen_new:
        kn = k_new if _aligned(k_new, d_pad, chunk) else _padded_copy(k_new, d_pad)
        vn = v_new if _aligned(v_new, dv_pad, chunk) else _padded_copy(v_new, dv_pad)
    if not cache_in_place and seqlen_new and lens is None:
        raise ValueError("a cache whose rows are not 16-byte aligned is copied, and appending to it needs "
                         "cache_seqlens (and block_table) on the host: pass NumPy arrays, or align the cache")

    device_id = _launch.device_id()
    sms, smem_block, smem_sm, memory_rate = _device_limits(device_id)
    score_mods = tuple(name for name, used in (("softcap", opts.softcap > 0), ("alibi", alibi_slopes is not None),
                                                ("mask", mask is not None)) if used) + user_mods
    group = heads_q // heads_k if heads_k else 0
    rows = seqlen_q * group
    check_fields = dict(
        cache_seqlens=("operand", _LENS) if cache_seqlens is not None else None,
        block_table=("operand", _TABLE) if paged else None,
        block_table_batch_stride=_checks.element_strides(table_dev)[0] if paged else 0,
        batch=batch, capacity=capacity, seqlen_new=seqlen_new, page_size=page_size, num_pages=num_pages,
        max_pages=max_pages, **(dict(cu_seqlens_q=("operand", _CU_Q), total_q=total_q, max_seqlen_q=seqlen_q)
                                if varlen else {}))
    out_layout = out if out is not None else _checks.Shaped(out_shape, q.dtype)
    if varlen:   # one batch of rows, as q: the sequences start at cu_seqlens_q
        out_layout = _checks.Shaped((1, *out_shape), q.dtype) if out is None else out[None]
    # Many new tokens: the Hopper forward kernel over the cache (cuflash/_prefill_plan.py).
    if _prefill_plan.runs_on_fwd_sm90(
            work_items=-(-seqlen_q // 128) * heads_q * batch, sms=_launch.sm_count(_launch.device_id()),
            dtype_name=dtype_name, seqlen_q=seqlen_q, score_mods=score_mods, kv_dtype=kv_dtype, mla=mla,
            num_splits=num_splits, paged=paged, page_size=page_size, num_pages=num_pages, head_dim=d_pad,
            head_dim_v=dv_pad, cache_in_place=cache_in_place, arrays=(q_k, kc, vc, out)):
        lse_output = return_lse or lse_given is not None
        plan = _prefill_plan.prefill_plan(
            dict(q=_Q, k_cache=_K_CACHE, v_cache=_V_CACHE, cache_seqlens=_LENS, block_table=_TABLE, k_new=_K_NEW,
                 v_new=_V_NEW, alibi_slopes=_ALIBI, sinks=_SINKS, out=_OUT, lse=_LSE, cu_seqlens_q=_CU_Q),
            n_operands=len(operands), dtype_name=dtype_name, q=q_k, k_cache=kc, v_cache=vc, k_new=kn, v_new=vn,
            out=out_layout, out_shape=out_shape, lse_shape=lse_shape, varlen=varlen, batch=batch, seqlen_q=seqlen_q,
            heads_q=heads_q, head_dim=d_pad, head_dim_v=dv_pad, paged=paged, page_size=page_size,
            table_stride=check_fields["block_table_batch_stride"], capacity=capacity, seqlen_new=seqlen_new,
            lens_given=cache_seqlens is not None, opts=opts,
            alibi_batch_stride=None if alibi_dev is None else score_fields["score.alibi_batch_stride"],
            sinks=sinks_dev, return_lse=return_lse, lse_output=lse_output,
            check=check_fields if check_on_gpu else None)
        ptrs = _remember(plan, operands, key, [q_k, kc, vc, seqlens_dev, table_dev, kn, vn, mask_view, alibi_dev,
                                               out, lse_given, sinks_dev, None, None, cu_dev, *user_arrays])
        return plan, ptrs, None
    # Keys a CTA's rows may see: the longest sequence when the lengths are known here, else the
    # capacity (never read back), within a window.
    keys = min(int(lens.max() if lens is not None else capacity) + seqlen_new, capacity)
    if opts.window[0] >= 0 and opts.window[1] >= 0:
        keys = min(keys, opts.window[0] + opts.window[1] + seqlen_q)
    # MLA on Hopper: the wgmma kernel (cuflash/_mla_plan.py).
    if mla and _mla_plan.runs_on_mla_sm90(
            dtype_name=dtype_name, score_mods=score_mods, sinks=sinks_dev, window=opts.window, seqlen_q=seqlen_q,
            varlen=varlen, num_splits=num_splits, paged=paged, page_size=page_size, head_dim=d_pad, out_dim=d_out,
            cache_in_place=cache_in_place, arrays=(q_k, kc, kn, out)):
        lse_output = return_lse or lse_given is not None
        plan = _mla_plan.mla_plan(
            dict(q=_Q, k_cache=_K_CACHE, cache_seqlens=_LENS, block_table=_TABLE, k_new=_K_NEW, out=_OUT, lse=_LSE),
            n_operands=len(operands), dtype_name=dtype_name, q=q_k, cache=kc, k_new=kn, out=out_layout,
            out_shape=out_shape, lse_shape=lse_shape, batch=batch, seqlen_q=seqlen_q, heads_q=heads_q, paged=paged,
            page_size=page_size, table_stride=check_fields["block_table_batch_stride"], capacity=capacity, keys=keys,
            seqlen_new=seqlen_new, lens_given=cache_seqlens is not None, scale=opts.scale, num_splits=num_splits,
            return_lse=return_lse, lse_output=lse_output, check=check_fields if check_on_gpu else None)
        ptrs = _remember(plan, operands, key, [q_k, kc, None, seqlens_dev, table_dev, kn, None, mask_view, alibi_dev,
                                               out, lse_given, sinks_dev, None, None, cu_dev, *user_arrays])
        return plan, ptrs, None
    # A few packed rows (one new token, a GQA group of up to 8) fit the keys-as-M tile, where the
    # 16-row one would compute half or more on padding; ragged new tokens keep the 16-row one.
    keys_as_m = (kernels.decode.DECODE_KEYS_AS_M_BY_DEFAULT and dtype_name != "float32" and not mla and not varlen
                 and rows <= kernels.decode.DECODE_KEYS_AS_M_ROWS)
    block_m = kernels.decode.decode_block_m(dtype_name, keys_as_m)
    short = kernels.decode.decode_takes_short_tiles(keys, batch * heads_k * max(1, -(-rows // block_m)), sms,
                                                      max(d_pad, dv_pad))
    # The kernel's columns: q.k's and v's, the larger (the other's loads zero-fill past their own).
    plan_k = kernels.decode.decode_plan(dtype_name, max(d_pad, dv_pad), paged=paged, score_mods=score_mods,
                                        smem_per_block=smem_block, smem_per_sm=smem_sm, user_source=user_source,
                                        kv_dtype=kv_dtype, mla=mla, keys_as_m=keys_as_m, short=short)
    row_blocks = max(1, -(-rows // plan_k.block_m))
    # MLA: the CTAs of a (row block, split) come in value halves (DECODE_MLA_VALUE_COLUMNS columns each).
    halves = -(-d_out // kernels.decode.DECODE_MLA_VALUE_COLUMNS) if mla else 1
    if num_splits == 0:
        # Contiguous caches: at most two CTAs an SM of 16- or 32-bit caches, one of fp8 caches
        # (kernels.decode.DECODE_CONTIGUOUS_CTAS_PER_SM), and no more splits than it takes to keep
        # the memory busy (DecodePlan.saturating_ctas: on an H100 64 CTAs of eight warps at D = 128,
        # on an H200 all 132), since each split adds a partial to write and merge. Paged caches wait
        # on page lookups and need every resident CTA ((8, 8k) page 16, eight warps: 2 splits 1.14x
        # flash, 1 split 1.03x), but not at the price of splits under 2048 keys (MLA's 910 hold the
        # same bytes), whose page-table start-up no longer hides.
        contiguous_per_sm = 1 if kv_dtype is not None else kernels.decode.DECODE_CONTIGUOUS_CTAS_PER_SM
        num_splits = kernels.decode.decode_num_splits(
            batch, heads_k, keys, sms, row_blocks=row_blocks * halves, block_n=plan_k.block_n,
            ctas_per_sm=plan_k.ctas_per_sm if paged else min(plan_k.ctas_per_sm, contiguous_per_sm),
            saturating_ctas=None if paged else plan_k.saturating_ctas(memory_rate),
            min_tiles_per_split=max(4, (kernels.decode.DECODE_MLA_PAGED_MIN_SPLIT_KEYS if mla else
                                        kernels.decode.DECODE_PAGED_MIN_SPLIT_KEYS) // plan_k.block_n) if paged else 4,
            max_splits=kernels.decode.DECODE_MLA_MAX_SPLITS if mla else kernels.decode.DECODE_MAX_SPLITS)
    num_splits = int(num_splits) if rows else 1
    if row_blocks * num_splits * halves >= 2**31:
        raise ValueError(f"num_splits = {num_splits} is too large for this problem")

    lse_buffer = _step.Buffer(lse_shape, np.float32)
    lse_output = return_lse or lse_given is not None   # else a temporary
    temps = [] if lse_output else [lse_buffer]
    if num_splits > 1:
        temps += [_step.Buffer((num_splits, batch, seqlen_q, heads_q, d_out), np.float32),
                  _step.Buffer((num_splits, batch, heads_q, seqlen_q), np.float32)]
    outputs = {_OUT: _step.Buffer(out_shape, q.dtype)}
    if lse_output:
        outputs[_LSE] = lse_buffer
    plan = _plan.Plan("decode", len(operands), outputs=outputs, temps=temps,
                          aligned=(_Q, _K_CACHE, _V_CACHE, _K_NEW, _V_NEW), checked=check_on_gpu,
                          results=(_OUT, _LSE) if return_lse else (_OUT,),
                          split_counters=batch * heads_k * row_blocks * halves if num_splits > 1 else 0)
    lse_slot = _LSE if lse_output else plan.temp_index(0)
    part = len(temps) - 2   # o_part, lse_part: the last two temporaries
    # Small index arrays (every contiguous cache's lengths, small page tables) are checked by the
    # decode kernel itself before it writes (cuda_src/decode.cu, indices_faulted): one launch fewer.
    # (Not for ragged new tokens: a CTA with no rows of its sequence would return before publishing.)
    check_in_kernel = (check_on_gpu and not varlen
                       and kernels.decode.decode_self_check(paged, batch, max_pages, plan_k.threads))
    if check_in_kernel:
        plan.info.update(batch=batch, capacity=capacity, seqlen_new=seqlen_new, num_pages=num_pages,
                         max_pages=max_pages)
    elif check_on_gpu:
        plan.steps.append(_faults.check_step(plan, check_fields, device_id))

    left, right = opts.window
    fields = {"score.heads_q": heads_q, "score.heads_k": heads_k, "score.head_dim": d_pad, "score.batch": batch,
              "score.seqlen_q": seqlen_q, "score.window_left": left, "score.window_right": right,
              "score.scale": opts.scale, "score.scale_log2": opts.scale * math.log2(math.e),
              "score.softcap": opts.softcap}
    fields.update({k: v for k, v in score_fields.items() if v is not None})
    fields.update(batch=batch, seqlen_q=seqlen_q, heads_q=heads_q, heads_k=heads_k, group=group, head_dim=d_pad,
                  out_dim=d_out, seqlen_cache=capacity, seqlen_new=seqlen_new, page_size=page_size,
                  num_splits=num_splits, row_blocks=row_blocks, mask_keys=mask_keys, num_pages=num_pages,
                  max_pages=max_pages)
    for name, x in (("q", q_k), ("k", kc), ("v", vc), ("o", out_layout)):
        fields.update(zip((f"{name}_batch_stride", f"{name}_row_stride", f"{name}_head_stride"), _row_strides(x)))
    lse_strides = _checks.element_strides(_checks.Shaped(lse_buffer.shape, np.float32))
    if varlen:   # (Hq, total_q): the sequences' rows start at cu_seqlens_q in every head's row
        fields.update(lse_batch_stride=0, lse_head_stride=lse_strides[0])
    else:
        fields.update(lse_batch_stride=lse_strides[0], lse_head_stride=lse_strides[1])
    # MLA: the values are the key rows' first columns (the kernel reads them from the key tiles), so
    # v_cache / v_new take k_cache's / k_new's pointers, from their operands (a repeat call's too).
    slots = {"q": _Q, "k_cache": _K_CACHE, "v_cache": _K_CACHE if mla else _V_CACHE, "o": _OUT, "lse": lse_slot}
    if seqlen_new:
        slots.update(k_new=_K_NEW, v_new=_K_NEW if mla else _V_NEW)
        for name, x in (("k_new", kn), ("v_new", vn)):
            fields.update(zip((f"{name}_batch_stride", f"{name}_row_stride", f"{name}_head_stride"),
                              _row_strides(x)))
    if cache_seqlens is not None:
        slots["cache_seqlens"] = _LENS
    if varlen:
        slots["cu_seqlens_q"] = _CU_Q
    if paged:
        slots["block_table"] = _TABLE
        fields["block_table_batch_stride"] = _checks.element_strides(table_dev)[0]
    if alibi_dev is not None:
        slots["score.alibi_slopes"] = _ALIBI
    if sinks_dev is not None:   # read per call: a new pointer or new values need no new plan
        slots["score.sinks"] = _SINKS
    if kv_dtype is not None:   # the scales: arrays read per call (like sinks), or values of this plan
        for name, dev, slot, stride, value in (("k_scale", k_scale_dev, _K_SCALE, scale_strides[0], scale_values[0]),
                                               ("v_scale", v_scale_dev, _V_SCALE, scale_strides[1], scale_values[1])):
            if dev is not None:
                slots[name] = slot
                fields[f"{name}_stride"] = stride
            else:
                fields[f"{name}_value"] = value
    if mask_view is not None:
        mb, mh, mr, mc = _checks.element_strides(mask_view)
        slots["mask"] = _MASK
        fields.update(mask_batch_stride=mb, mask_head_stride=mh, mask_row_stride=mr, mask_col_stride=mc)
    for name, value in user_fields.items():   # the ScoreMod / MaskMod arguments: p.score.user
        if isinstance(value, tuple):
            slots[f"score.{name}"] = value[1]
        else:
            fields[f"score.{name}"] = value
    if num_splits > 1:
        # The last split of each (sequence, kv head, row block) combines the partials (decode.cu).
        slots.update(o_part=plan.temp_index(part), lse_part=plan.temp_index(part + 1),
                     split_counters=plan.index("split_counters"))
    if check_on_gpu and not check_in_kernel:
        slots["error"] = plan.index("error")
    if check_in_kernel:
        slots["report"] = plan.index("report")
        fields["self_check"] = 1
    kernel = get_kernel(plan_k.variant)
    # The K/V stream lives in shared memory (cp.async.cg skips L1), and two or three CTAs per SM
    # need ~200 KiB of it: ask for the largest carveout.
    func = _launch.prepare_kernel(kernel, plan_k.smem_bytes, device_id, carveout=100)
    # On sm_90 the kernels behind the index check start before it ends and wait for its verdict
    # only before they write (cuda_src/fault.cuh): the check then costs the stream no time.
    dependent = device_arch() == "sm_90a"
    plan.steps.append(_step.Step(func, (row_blocks * num_splits * halves, heads_k, batch), plan_k.threads,
                                     plan_k.smem_bytes, (("struct", Template(DECODE, fields, slots)),),
                                     dependent=dependent and check_on_gpu and not check_in_kernel))
    plan.info.update(num_splits=num_splits)

    kernel_operands = [q_k, kc, None if mla else vc, seqlens_dev, table_dev, kn, None if mla else vn, mask_view,
                       alibi_dev, out, lse_given, sinks_dev, k_scale_dev, v_scale_dev, cu_dev, *user_arrays]
    ptrs = _remember(plan, operands, key, kernel_operands)
    finish = None
    if seqlen_new and not cache_in_place:
        finish = functools.partial(_write_back, k_cache, v_cache, k_new, v_new, lens, table, page_size,
                                   (kc, vc) if kv_dtype is not None else None)
    return plan, ptrs, finish


def _remember(plan, operands, key, kernel_operands):
    """The call's pointers (of its kernel-ready operands); the plan is remembered for calls of this
    layout unless an operand had to be copied (such a call cannot be captured either)."""
    ptrs = _memo.pointers(kernel_operands)
    in_place = _memo.in_place(operands, kernel_operands)
    if not in_place:
        _capture.refuse_capture("decode", _capture.COPIES_NOT_CAPTURED)
    _memo.remember(key if in_place else None, plan)
    return ptrs


def _write_back(k_cache, v_cache, k_new, v_new, lens, table, page_size, copies=None):
    """The slow path's append: k_new / v_new rows into a cache the kernel could not address in place;
    for an fp8 cache, the rows the kernel quantised into its copies (``copies``: (kc, vc))."""
    import cupy

    batch, seqlen_new = k_new.shape[:2]
    b = np.repeat(np.arange(batch), seqlen_new)
    t = np.tile(np.arange(seqlen_new), batch)
    pos = lens[b] + t
    rows = (b, pos) if table is None else (table[b, pos // page_size], pos % page_size)
    rows = tuple(cupy.asarray(x) for x in rows)
    if copies is not None:
        d = k_cache.shape[-1]
        _bits(k_cache)[rows] = _bits(copies[0])[rows][..., :d]
        _bits(v_cache)[rows] = _bits(copies[1])[rows][..., :d]
        return
    src = (cupy.asarray(b), cupy.asarray(t))
    _bits(k_cache)[rows] = _bits(k_new)[src]
    _bits(v_cache)[rows] = _bits(v_new)[src]


def decode(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, k_new=None, v_new=None, num_splits=0,
           causal=True, window=None, softcap=0.0, alibi_slopes=None, scale=None, mask=None, score_mod=None,
           mask_mod=None, sinks=None, kv_dtype=None, k_scale=None, v_scale=None, v_head_dim=None, return_lse=False,
           out=None, lse=None, check=None):
    """Attention of a few new query tokens over a KV cache, appending their keys and values first.

    Sequence ``b`` has ``T_b = cache_seqlens[b] + S_new`` keys: its cached keys, then the ``S_new``
    appended ones. Queries are aligned to the end of the keys (bottom-right), so with ``causal``
    query ``i`` of ``Sq`` sees keys ``j <= i + T_b - Sq``: the new tokens attend to the whole cache
    and causally among themselves (speculative decoding).

    Parameters
    ----------
    q : array (B, Sq, Hq, D), float16, bfloat16 or float32 (CuPy or any CUDA DLPack array)
        Sq (new tokens): any number. A few run on the decode kernel; a chunk (chunked prefill: from 128
        new tokens, or from 32 when the batch and heads fill the GPU) runs on the Hopper forward kernel
        reading the cache (sm_90, 16-bit caches, no ``mask`` or user modifiers, not softcap and ALiBi
        together: docs/decisions.md#chunked-prefill-on-fwd_sm90), after the append. Query heads that share a kv head
        (h // (Hq // Hk), GQA/MQA) are computed together, so the cache is read once per kv head.
    k_cache, v_cache : arrays, the dtype of q
        Contiguous (B, S_cache, Hk, D), or paged (num_pages, page_size, Hk, D) with ``block_table``
        (any page size); ``v_cache`` (and ``v_new``) may have a head dim D_v of its own (16-bit and float32
        caches, not fp8: DeepSeek's (192, 128)), and ``out`` then has D_v columns. Written in place when
        ``k_new`` is given. Rows should be 16-byte aligned
        (last axis contiguous, D a multiple of 8 for 16-bit / 4 for float32 data, strides multiples
        of 16 bytes); otherwise the cache is copied on every call (slow) and the new rows written back.
        With ``k_new`` their rows must not share memory (no zero or overlapping batch/page stride, and
        ``k_cache`` and ``v_cache`` distinct, though they may interleave in one allocation); without
        it they are only read, so a broadcast cache or ``v_cache is k_cache`` is accepted. ``v_cache``
        None: MLA's one latent cache (see ``v_head_dim``).
    cache_seqlens : int32 array (B,), optional
        Keys each sequence holds before the append (0 allowed). On the GPU it is never read back: the
        index check kernel validates it before anything is written (see ``check``). Given as NumPy,
        it is checked on the host before any launch. Default: the full capacity (S_cache, or
        max_pages * page_size).
    block_table : int32 array (B, max_pages), optional
        ``block_table[b, p]`` is the cache page holding keys ``p * page_size ..`` of sequence b.
        Checked like ``cache_seqlens``. Pages past a sequence's end are never read (they may hold
        anything, e.g. -1). Appended rows must land in slots that no sequence reads as cached keys:
        checked when the table is given on the host, the caller's contract when it is on the GPU.
    k_new, v_new : arrays (B, S_new, Hk, D), optional
        Appended at positions ``cache_seqlens[b] ..`` before attending; the cache must have room
        (a call whose appends do not fit writes nothing). Usually S_new = Sq.
    num_splits : int, default 0
        Key ranges per (sequence, kv head) computed in parallel and merged (split-KV); 0 picks it
        from the shapes and the SM count (:func:`cuflash.kernels.decode.decode_num_splits`), 1 is the
        unsplit path that writes the output directly; at most 128.
    causal : bool, default True
        Bottom-right, see above.
    window, softcap, alibi_slopes, scale
        As in :func:`cuflash.attention`, with query i at key position ``i + T_b - Sq``.
    mask : bool array, optional
        True = may attend; shape broadcastable to (B, Hq, Sq, M). Its M columns line up with the
        LAST M keys of every sequence, so a tree mask over the new tokens is (Sq, Sq) (or (B, 1, Sq,
        Sq), ...) whatever the cache lengths; keys before those are not masked. When every sequence
        has T keys, M = T is the usual (B, Hq, Sq, T) mask. M = 1 broadcasts over all keys.
    score_mod : cuflash.ScoreMod, optional
        A score modifier (one expression over ``score``, after softcap and ALiBi, ``b``, ``h``
        (query head), ``q_idx``, ``kv_idx`` and its named arguments), compiled into the decode kernel
        once per expression. Positions are absolute in the sequence: query ``i`` is ``q_idx = i + T_b
        - Sq`` (the new tokens' own positions), key ``j`` is ``kv_idx = j`` (cached keys first, then
        the appended ones). Applied before the masks.
    mask_mod : cuflash.MaskMod, optional
        A bool expression over the same positions: False hides the key (ANDed with ``causal``,
        ``window`` and ``mask``). Its arrays' addresses and scalars' values are read at each call.
    sinks : CUDA float32 array (Hq,), optional
        Attention sinks (gpt-oss), as in :func:`cuflash.attention`: every row's softmax denominator
        gains ``exp(sinks[h])`` (h the query head), with no value; ``lse`` includes it, and a row that
        sees no key (an empty sequence) gets ``out = 0`` and ``lse = sinks[h]``; ``-inf`` is no sink
        for that head. Split-KV adds it once, where the splits are combined. Read at each call (new
        values or a new array of the same layout need no new plan).
    kv_dtype : {None, "float8_e4m3fn"}, optional
        None: the caches have the dtype of q. ``"float8_e4m3fn"``: fp8 caches, whose uint8 elements
        are e4m3 bytes (CuPy has no float8 dtype) standing for ``value * k_scale`` / ``value *
        v_scale``; q (and out, k_new, v_new) float16 or bfloat16. The kernel converts the bytes to q's
        16-bit type exactly and applies the scales in float32 (k_scale to the scores, v_scale to the
        output rows). ``k_new`` / ``v_new`` (q's dtype) are quantised as they are appended, as
        :func:`cuflash.reference.decode` does: ``e4m3(x / scale)`` rounded to nearest even, saturated
        at +-448, NaN kept NaN; the new tokens attend to their quantised values. D a multiple of 16
        for in-place caches (others are copied, as above).
    k_scale, v_scale : float or CUDA float32 array, optional
        The fp8 caches' scales (required with ``kv_dtype``, refused without): a number (or a NumPy
        array of one element; a float32 value fixed in the call's plan), or a CUDA float32 array of
        shape (), (1,) (per tensor) or (Hk,) (one per kv head), read at each call.
    v_head_dim : int, optional
        MLA (DeepSeek's latent cache): with ``v_cache=None``, the values are the first ``v_head_dim``
        columns of ``k_cache``'s rows (one cache, the keys its whole rows), and ``out`` has
        ``v_head_dim`` columns. ``k_new`` alone is appended (the new latent rows; ``v_new`` must be
        None). float16/bfloat16, head dim 576 (512 values and 64 rope columns) and ``v_head_dim`` a
        multiple of 8 up to 512; contiguous or paged, split-KV, modifiers and sinks as otherwise; not
        with ``kv_dtype``.
    return_lse : bool, default False
        Also return lse.
    out : array (B, Sq, Hq, D_v) (v_cache's head dim; ``v_head_dim`` for MLA), optional
        C-contiguous, the dtype of q (CuPy or a CUDA DLPack tensor; returned as given), sharing no
        memory with the other arguments.
    lse : float32 array (B, Hq, Sq), optional
        C-contiguous buffer for the log-sum-exp, like ``out`` (returned as given with ``return_lse``).
    check : bool, optional
        True: wait for the index check and raise a bad ``cache_seqlens`` / ``block_table`` value now.
        False: a bad value makes the call write nothing and is raised (ValueError naming the
        argument) by the next decode call on this stream or by :func:`cuflash.check_errors`.
        Default: the environment variable ``CUFLASH_CHECK`` (``1`` = True), else False.

    Returns
    -------
    out : CuPy array (B, Sq, Hq, D), the dtype of q
    lse : CuPy float32 array (B, Hq, Sq), only when ``return_lse``
        ``-inf`` (``sinks[h]`` with sinks; and out = 0) for a row that sees no key, e.g. an empty
        sequence.

    Raises
    ------
    TypeError
        An array that is not a CUDA array (index arrays may be NumPy), a dtype other than
        float16/bfloat16/float32 or one that differs from q's, index arrays that are not int32, a
        mask that is not bool, ``sinks`` that are not float32, uint8 caches without ``kv_dtype``
        (or ``kv_dtype`` with other caches, or with float32 q), scales that are not float32, ``num_splits``,
        ``score_mod``/``mask_mod`` (or an array argument of theirs) or an option of the wrong type;
        the message names the argument.
    ValueError
        For any other bad argument (shapes, ``sinks`` not of shape (Hq,), an unknown ``kv_dtype``,
        missing scales or scales of another shape than (), (1,) or (Hk,), heads, head dims, values
        out of range, appends that do not fit, overlapping memory), before any launch: the cache is
        never half-written. Index values on the GPU are checked by a kernel (see ``check``); given on the host, before any
        launch, including appended rows that would land in a slot another (or the same) sequence
        reads.
    RuntimeError
        When CuPy or a usable CUDA GPU is missing, or a call that needs copies (a misaligned cache,
        index arrays on the host) is being captured in a CUDA graph.

    See Also
    --------
    cuflash.reference.decode : the float64 host reference.
    merge_states : how the split-KV partial results are combined.

    Examples
    --------
    A paged cache of 16-token pages, two sequences holding 1000 and 20 tokens, one new token each:

    >>> import cupy as cp
    >>> import cuflash
    >>> f16 = lambda *shape: cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    >>> k_cache, v_cache = f16(256, 16, 8, 128), f16(256, 16, 8, 128)   # (num_pages, page_size, Hk, D)
    >>> block_table = cp.arange(2 * 64, dtype=cp.int32).reshape(2, 64)    # pages of each sequence
    >>> lens = cp.asarray([1000, 20], dtype=cp.int32)
    >>> q, k_new, v_new = f16(2, 1, 32, 128), f16(2, 1, 8, 128), f16(2, 1, 8, 128)
    >>> out = cuflash.decode(q, k_cache, v_cache, cache_seqlens=lens, block_table=block_table,
    ...                      k_new=k_new, v_new=v_new)     # appends at positions 1000 and 20
    >>> out.shape
    (2, 1, 32, 128)
    >>> lens += 1                                             # the caller keeps the lengths
    """
    return _decode(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, num_splits, causal, window, softcap,
                   alibi_slopes, scale, mask, score_mod, mask_mod, sinks, kv_dtype, k_scale, v_scale, v_head_dim,
                   return_lse, out, lse, check)


def _decode(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, num_splits, causal, window, softcap,
            alibi_slopes, scale, mask, score_mod, mask_mod, sinks, kv_dtype, k_scale, v_scale, v_head_dim, return_lse,
            out, lse, check, replay_only=False):
    """The body of :func:`decode`, its arguments positional. ``replay_only``: return None, having done
    nothing, unless the call replays a remembered plan (:func:`cuflash.interop._torch_stream.replay`;
    calls without scales or modifiers only, whose conversions come before the lookup)."""
    # Without scales or modifiers (most calls) their helpers are not called (0.6 us a call on a CPU).
    k_scale_op = v_scale_op = k_value = v_value = mod_key = None
    if k_scale is not None or v_scale is not None:
        k_scale_op, v_scale_op, k_value, v_value = _scale_parts(k_scale, v_scale)
    if states_builtin(score_mod, mask_mod):   # what they state runs built in (q_idx absolute, as ALiBi's)
        score_mod, mask_mod, window, softcap, alibi_slopes = lowered(score_mod, mask_mod, causal, window, softcap,
                                                                     alibi_slopes, None, axis_len(q, 2), True)
    operands = (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, mask, alibi_slopes, out, lse, sinks,
                k_scale_op, v_scale_op, None)
    if score_mod is not None or mask_mod is not None:
        operands, mod_key = _with_modifiers(operands, score_mod, mask_mod)
    options = (num_splits, causal, window, softcap, scale, return_lse, mod_key, kv_dtype, k_value, v_value, v_head_dim,
               _prefill_plan.forced(), _mla_plan.forced())
    plan, ptrs, where = _memo.lookup("decode", operands, options)
    finish = None
    if plan is None:
        if replay_only:
            return None
        plan, ptrs, finish = _plan_decode(operands, ptrs, num_splits=num_splits, causal=causal, window=window,
                                          softcap=softcap, scale=scale, return_lse=return_lse,
                                          modifiers=(score_mod, mask_mod), kv_dtype=kv_dtype,
                                          scale_values=(k_value, v_value), v_head_dim=v_head_dim)
        if plan is None:
            out, lse = finish
            return (out, lse) if return_lse else out
    results, _, _ = plan.run(operands, ptrs, where, check=_checks.check_flag(check))
    if finish is not None:
        finish()
    return tuple(results) if return_lse else results[0]
