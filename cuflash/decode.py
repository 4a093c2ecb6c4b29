"""Decode attention: a few new query tokens against a KV cache (contiguous or paged), split-KV.

:func:`decode` validates everything on the host, then runs ``cuda_src/decode.cu`` (which also
appends ``k_new`` / ``v_new`` into the cache) and, when the keys were split, ``cuda_src/merge.cu``.
The float64 twin is :func:`cuflash.reference.decode`.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import _checks, _heuristics
from ._compile import get_kernel
from ._launch import PARAMS_DTYPE, launch, pack_params

__all__ = ["decode"]

# Mirrors ``DecodeParams`` in cuda_src/decode_params.cuh (align=True pads like C): the forward's
# FwdParams first (score-pipeline fields only), then decode's own. Its size is compiled in as
# CUFLASH_DECODE_PARAMS_SIZE and static_asserted there.
_POINTERS = ("q", "k_cache", "v_cache", "k_new", "v_new", "o", "lse", "o_part", "lse_part", "cache_seqlens",
             "block_table", "mask")
_STRIDES = (
    "q_batch_stride", "q_row_stride", "q_head_stride",
    "k_batch_stride", "k_row_stride", "k_head_stride",
    "v_batch_stride", "v_row_stride", "v_head_stride",
    "k_new_batch_stride", "k_new_row_stride", "k_new_head_stride",
    "v_new_batch_stride", "v_new_row_stride", "v_new_head_stride",
    "o_batch_stride", "o_row_stride", "o_head_stride",
    "lse_batch_stride", "lse_head_stride",
    "block_table_batch_stride",
    "mask_batch_stride", "mask_head_stride", "mask_row_stride", "mask_col_stride",
)
_INTS = ("batch", "seqlen_q", "heads_q", "heads_k", "group", "head_dim", "out_dim", "seqlen_cache", "seqlen_new",
         "page_size", "num_splits", "row_blocks", "mask_keys", "pad_")
DECODE_PARAMS_DTYPE = np.dtype(
    [("score", PARAMS_DTYPE)]
    + [(name, np.uint64) for name in _POINTERS]
    + [(name, np.int64) for name in _STRIDES]
    + [(name, np.int32) for name in _INTS],
    align=True,
)

_GRID_YZ_MAX = 65535


@functools.lru_cache(maxsize=None)
def _device_limits(device_id: int) -> tuple[int, int, int]:
    """(SM count, opt-in shared memory per block, shared memory per SM) of a device."""
    import cupy

    rt = cupy.cuda.runtime
    return (rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, device_id),
            rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id),
            rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerMultiprocessor, device_id))


def _int32_operand(x, name: str, ndim: int):
    """An int32 index array given on the GPU or as a NumPy array: (device array, host copy).

    A GPU array is read back once to be checked (a synchronisation, the price of checking); a NumPy
    array (or a list) is checked as is and copied to the GPU (no synchronisation).
    """
    import cupy

    if isinstance(x, (list, tuple)):
        x = np.asarray(x, dtype=np.int32)
    if isinstance(x, np.ndarray):
        host = x
        if host.dtype != np.int32:
            raise TypeError(f"{name} must be int32, got {host.dtype}")
        device = None
    else:
        device = _checks.as_cuda_array(x, name)
        if device.dtype != np.int32:
            raise TypeError(f"{name} must be int32, got {device.dtype}")
        host = None
    shape = tuple((host if host is not None else device).shape)
    if len(shape) != ndim:
        raise ValueError(f"{name} must be {ndim}-d, got shape {shape}")
    if device is None:
        device = cupy.asarray(np.ascontiguousarray(host))
    else:
        host = device.get()
        device = cupy.ascontiguousarray(device)   # the kernel indexes rows of it densely
    return device, host.astype(np.int64)


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

    return x.view({2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[x.itemsize])


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


_configured = {}


def _decode_kernel(variant):
    """The decode kernel, asking once for the largest shared-memory carveout: the K/V stream lives
    in shared memory (cp.async.cg skips L1), and two or three CTAs per SM need ~200 KiB of it."""
    kernel = get_kernel(variant)
    if id(kernel) not in _configured:
        try:
            kernel.preferred_shared_memory_carveout = 100
        except Exception:  # a hint only; the launch works without it
            pass
        _configured[id(kernel)] = kernel
    return kernel


class _DecodeCall:
    """A validated decode call: everything checked and allocated, ready to launch (no host sync).

    ``launch()`` runs the kernels on CuPy's current stream; it may be called again (benchmarks),
    re-appending the same rows. It keeps every temporary it points to alive.
    """

    def __init__(self, out, lse):
        self.out, self.lse = out, lse
        self.num_splits = 1     # key ranges per (sequence, kv head, row block); > 1 adds the merge
        self._steps = []
        self._keep = []

    def launch(self):
        for step in self._steps:
            step()
        return self.out, self.lse


def _prepare(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, k_new=None, v_new=None, num_splits=0,
             causal=True, window=None, softcap=0.0, alibi_slopes=None, scale=None, mask=None, out=None):
    """Validate a decode call and plan its launches (see :func:`decode`); raises before any launch."""
    import cupy

    layout = "(batch, seqlen, heads, head_dim)"
    q = _checks.as_cuda_array(q, "q")
    k_cache = _checks.as_cuda_array(k_cache, "k_cache")
    v_cache = _checks.as_cuda_array(v_cache, "v_cache")
    dtype_name = _checks.check_float_dtype(q, "q")
    _checks.check_same_dtype(q, "q", k_cache, "k_cache")
    _checks.check_same_dtype(q, "q", v_cache, "v_cache")
    _checks.check_rank(q, 4, "q", layout)
    paged = block_table is not None
    cache_layout = "(num_pages, page_size, heads, head_dim)" if paged else layout
    _checks.check_rank(k_cache, 4, "k_cache", cache_layout)
    _checks.check_rank(v_cache, 4, "v_cache", cache_layout)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache must have the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    batch, seqlen_q, heads_q, d = q.shape
    heads_k = k_cache.shape[2]
    _checks.check_heads(heads_q, heads_k, v_cache.shape[2])
    _checks.check_head_dim(d, k_cache.shape[3], v_cache.shape[3], _heuristics.MAX_HEAD_DIM)

    # The cache, its capacity per sequence, and the lengths it holds.
    if paged:
        table_dev, table = _int32_operand(block_table, "block_table", 2)
        if table.shape[0] != batch:
            raise ValueError(f"block_table must have one row per sequence ({batch}), got shape {table.shape}")
        num_pages, page_size = k_cache.shape[:2]
        if page_size == 0:
            raise ValueError("the paged cache must have page_size (k_cache.shape[1]) >= 1, got 0")
        capacity = table.shape[1] * page_size
    else:
        table_dev = table = None
        num_pages = page_size = 0
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache must have the batch size of q ({batch}), got {k_cache.shape[0]}; a paged "
                             "cache needs block_table")
        capacity = k_cache.shape[1]
    if cache_seqlens is None:
        seqlens_dev, lens = None, np.full(batch, capacity, dtype=np.int64)
    else:
        seqlens_dev, lens = _int32_operand(cache_seqlens, "cache_seqlens", 1)
        if lens.shape != (batch,):
            raise ValueError(f"cache_seqlens must have shape ({batch},), got {lens.shape}")
        if batch and (lens.min() < 0 or lens.max() > capacity):
            b = int(np.argmax((lens < 0) | (lens > capacity)))
            raise ValueError(f"cache_seqlens[{b}] = {int(lens[b])} is not in [0, {capacity}] (the cache holds "
                             f"{capacity} keys per sequence)")

    # Tokens to append.
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together")
    seqlen_new = 0
    if k_new is not None:
        k_new = _checks.as_cuda_array(k_new, "k_new")
        v_new = _checks.as_cuda_array(v_new, "v_new")
        _checks.check_same_dtype(q, "q", k_new, "k_new")
        _checks.check_same_dtype(q, "q", v_new, "v_new")
        _checks.check_rank(k_new, 4, "k_new", layout)
        _checks.check_rank(v_new, 4, "v_new", layout)
        seqlen_new = k_new.shape[1]
        want = (batch, seqlen_new, heads_k, d)
        for x, name in ((k_new, "k_new"), (v_new, "v_new")):
            if tuple(x.shape) != want:
                raise ValueError(f"{name} must have shape (batch, new tokens, kv heads, head_dim) = {want}, got "
                                 f"{tuple(x.shape)}")
        if batch and lens.max() + seqlen_new > capacity:
            b = int(np.argmax(lens + seqlen_new > capacity))
            raise ValueError(f"the {seqlen_new} appended tokens do not fit: sequence {b} holds {int(lens[b])} of "
                             f"{capacity} keys" + (" (cache_seqlens=None means full)" if cache_seqlens is None
                                                   else ""))
    if paged and batch:
        _check_pages(table, lens, seqlen_new, page_size, num_pages)

    # Options.
    opts = _checks.check_options(head_dim=d, causal=causal, scale=scale, window=window, softcap=softcap,
                                 dropout_p=0.0, generator=None)
    score_fields = {}
    if alibi_slopes is not None:
        slopes = _checks.check_alibi(alibi_slopes, batch, heads_q)
        score_fields.update(alibi_slopes=slopes.data.ptr, alibi_batch_stride=heads_q if slopes.ndim == 2 else 0)
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
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits must be an int (0 = heuristic), got {type(num_splits).__name__}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 = heuristic), got {num_splits}")
    if out is not None:
        _checks.check_out(out, "out", (batch, seqlen_q, heads_q, d), q.dtype)
    if batch > _GRID_YZ_MAX or heads_k > _GRID_YZ_MAX:
        raise ValueError(f"decode handles at most {_GRID_YZ_MAX} sequences and kv heads, got {batch} and {heads_k}")

    # Kernel-ready operands: 16-byte rows. q and k_new are small, so misaligned ones are copied; a
    # misaligned cache is copied too (slow, documented) and the appended rows written back after.
    out = cupy.empty((batch, seqlen_q, heads_q, d), dtype=q.dtype) if out is None else out
    lse = cupy.empty((batch, heads_q, seqlen_q), dtype=np.float32)
    call = _DecodeCall(out, lse)
    if batch == 0:
        return call
    chunk = 16 // q.itemsize
    d_pad = -(-d // chunk) * chunk
    q_k = q if _aligned(q, d_pad, chunk) else _padded_copy(q, d_pad)
    cache_in_place = _aligned(k_cache, d_pad, chunk) and _aligned(v_cache, d_pad, chunk)
    kc, vc = (k_cache, v_cache) if cache_in_place else (_padded_copy(k_cache, d_pad), _padded_copy(v_cache, d_pad))
    if seqlen_new:
        kn = k_new if _aligned(k_new, d_pad, chunk) else _padded_copy(k_new, d_pad)
        vn = v_new if _aligned(v_new, d_pad, chunk) else _padded_copy(v_new, d_pad)

    sms, smem_block, smem_sm = _device_limits(cupy.cuda.Device().id)
    score_mods = opts.softcap > 0 or alibi_slopes is not None or mask is not None
    plan = _heuristics.decode_plan(dtype_name, d_pad, paged=paged, score_mods=score_mods,
                                   smem_per_block=smem_block, smem_per_sm=smem_sm)
    group = heads_q // heads_k if heads_k else 0
    rows = seqlen_q * group
    row_blocks = max(1, -(-rows // plan.block_m))
    if num_splits == 0:
        left, right = opts.window
        keys = int(lens.max()) + seqlen_new
        if left >= 0 and right >= 0:
            keys = min(keys, left + right + seqlen_q)
        num_splits = _heuristics.decode_num_splits(batch, heads_k, keys, sms, row_blocks=row_blocks,
                                                   block_n=plan.block_n, ctas_per_sm=plan.ctas_per_sm)
    num_splits = int(num_splits) if rows else 1
    if row_blocks * num_splits >= 2**31:
        raise ValueError(f"num_splits = {num_splits} is too large for this problem")

    o_part = lse_part = None
    if num_splits > 1:
        o_part = cupy.empty((num_splits, batch, seqlen_q, heads_q, d), dtype=np.float32)
        lse_part = cupy.empty((num_splits, batch, heads_q, seqlen_q), dtype=np.float32)

    left, right = opts.window
    score = pack_params(heads_q=heads_q, heads_k=heads_k, head_dim=d_pad, batch=batch, seqlen_q=seqlen_q,
                        window_left=left, window_right=right, scale=opts.scale,
                        scale_log2=opts.scale * math.log2(math.e), softcap=opts.softcap, **score_fields)
    params = np.zeros((), dtype=DECODE_PARAMS_DTYPE)
    params["score"] = score
    fields = dict(
        q=q_k.data.ptr, k_cache=kc.data.ptr, v_cache=vc.data.ptr, o=out.data.ptr, lse=lse.data.ptr,
        batch=batch, seqlen_q=seqlen_q, heads_q=heads_q, heads_k=heads_k, group=group, head_dim=d_pad, out_dim=d,
        seqlen_cache=capacity, seqlen_new=seqlen_new, page_size=page_size, num_splits=num_splits,
        row_blocks=row_blocks, mask_keys=mask_keys,
    )
    for name, x in (("q", q_k), ("k", kc), ("v", vc), ("o", out)):
        fields.update(zip((f"{name}_batch_stride", f"{name}_row_stride", f"{name}_head_stride"), _row_strides(x)))
    lse_strides = _checks.element_strides(lse)
    fields.update(lse_batch_stride=lse_strides[0], lse_head_stride=lse_strides[1])
    if seqlen_new:
        fields.update(k_new=kn.data.ptr, v_new=vn.data.ptr)
        for name, x in (("k_new", kn), ("v_new", vn)):
            fields.update(zip((f"{name}_batch_stride", f"{name}_row_stride", f"{name}_head_stride"),
                              _row_strides(x)))
    if seqlens_dev is not None:
        fields["cache_seqlens"] = seqlens_dev.data.ptr
    if paged:
        fields.update(block_table=table_dev.data.ptr, block_table_batch_stride=_checks.element_strides(table_dev)[0])
    if mask_view is not None:
        mb, mh, mr, mc = _checks.element_strides(mask_view)
        fields.update(mask=mask_view.data.ptr, mask_batch_stride=mb, mask_head_stride=mh, mask_row_stride=mr,
                      mask_col_stride=mc)
    if o_part is not None:
        fields.update(o_part=o_part.data.ptr, lse_part=lse_part.data.ptr)
    for name, value in fields.items():
        params[name] = value
    params = params[()]

    kernel = _decode_kernel(plan.variant)
    call.num_splits = num_splits
    grid = (row_blocks * num_splits, heads_k, batch)
    call._steps.append(lambda: launch(kernel, grid, plan.threads, plan.smem_bytes, params))
    if o_part is not None:
        from .merge import _launch_merge

        call._steps.append(lambda: _launch_merge(o_part, lse_part, out, lse))
    if seqlen_new and not cache_in_place:
        call._steps.append(functools.partial(_write_back, k_cache, v_cache, k_new, v_new, lens, table, page_size))
    call._keep += [q_k, kc, vc, seqlens_dev, table_dev, mask_view, o_part, lse_part, params]
    if seqlen_new:
        call._keep += [kn, vn]
    return call


def _write_back(k_cache, v_cache, k_new, v_new, lens, table, page_size):
    """The slow path's append: k_new / v_new rows into a cache the kernel could not address in place."""
    import cupy

    batch, seqlen_new = k_new.shape[:2]
    b = np.repeat(np.arange(batch), seqlen_new)
    t = np.tile(np.arange(seqlen_new), batch)
    pos = lens[b] + t
    rows = (b, pos) if table is None else (table[b, pos // page_size], pos % page_size)
    rows = tuple(cupy.asarray(x) for x in rows)
    src = (cupy.asarray(b), cupy.asarray(t))
    _bits(k_cache)[rows] = _bits(k_new)[src]
    _bits(v_cache)[rows] = _bits(v_new)[src]


def decode(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, k_new=None, v_new=None, num_splits=0,
           causal=True, window=None, softcap=0.0, alibi_slopes=None, scale=None, mask=None, return_lse=False,
           out=None):
    """Attention of a few new query tokens over a KV cache, appending their keys and values first.

    Sequence ``b`` has ``T_b = cache_seqlens[b] + S_new`` keys: its cached keys, then the ``S_new``
    appended ones. Queries are aligned to the end of the keys (bottom-right), so with ``causal``
    query ``i`` of ``Sq`` sees keys ``j <= i + T_b - Sq``: the new tokens attend to the whole cache
    and causally among themselves (speculative decoding).

    Parameters
    ----------
    q : array (B, Sq, Hq, D), float16, bfloat16 or float32 (CuPy or any CUDA DLPack array)
        Sq (new tokens) from 1 up to a few dozen. Query heads that share a kv head
        (h // (Hq // Hk), GQA/MQA) are computed together, so the cache is read once per kv head.
    k_cache, v_cache : arrays, the dtype of q
        Contiguous (B, S_cache, Hk, D), or paged (num_pages, page_size, Hk, D) with ``block_table``
        (any page size). Written in place when ``k_new`` is given. Rows should be 16-byte aligned
        (last axis contiguous, D a multiple of 8 for 16-bit / 4 for float32 data, strides multiples
        of 16 bytes); otherwise the cache is copied on every call (slow) and the new rows written back.
    cache_seqlens : int32 array (B,), optional
        Keys each sequence holds before the append (0 allowed). On the GPU it is read back once to be
        checked (a synchronisation); a NumPy array avoids that. Default: the full capacity
        (S_cache, or max_pages * page_size).
    block_table : int32 array (B, max_pages), optional
        ``block_table[b, p]`` is the cache page holding keys ``p * page_size ..`` of sequence b.
        Read back to the host to be checked (or given as NumPy). Pages past a sequence's end are
        never read (they may hold anything, e.g. -1).
    k_new, v_new : arrays (B, S_new, Hk, D), optional
        Appended at positions ``cache_seqlens[b] ..`` before attending; the cache must have room
        (checked, like every argument, before anything is written). Usually S_new = Sq.
    num_splits : int
        Key ranges per (sequence, kv head) computed in parallel and merged (split-KV); 0 picks it
        from the shapes and the SM count (:func:`cuflash._heuristics.decode_num_splits`), 1 is the
        unsplit path that writes the output directly.
    causal : bool
        Default True (bottom-right, see above).
    window, softcap, alibi_slopes, scale
        As in :func:`cuflash.attention`, with query i at key position ``i + T_b - Sq``.
    mask : bool array, optional
        True = may attend; shape broadcastable to (B, Hq, Sq, M). Its M columns line up with the
        LAST M keys of every sequence, so a tree mask over the new tokens is (Sq, Sq) (or (B, 1, Sq,
        Sq), ...) whatever the cache lengths; keys before those are not masked. When every sequence
        has T keys, M = T is the usual (B, Hq, Sq, T) mask. M = 1 broadcasts over all keys.
    return_lse : bool
        Also return lse.
    out : CuPy array (B, Sq, Hq, D), optional
        C-contiguous, the dtype of q.

    Returns
    -------
    out : CuPy array (B, Sq, Hq, D), the dtype of q
    lse : CuPy float32 array (B, Hq, Sq), only when ``return_lse``
        ``-inf`` (and out = 0) for a row that sees no key, e.g. an empty sequence.

    Raises
    ------
    TypeError, ValueError
        For any bad argument, before any launch: the cache is never half-written. This includes
        appended tokens that do not fit, block_table entries that are not pages, and appended
        rows that would land in a slot another (or the same) sequence reads.
    RuntimeError
        When no CUDA GPU is usable.
    """
    call = _prepare(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k_new=k_new,
                    v_new=v_new, num_splits=num_splits, causal=causal, window=window, softcap=softcap,
                    alibi_slopes=alibi_slopes, scale=scale, mask=mask, out=out)
    out, lse = call.launch()
    return (out, lse) if return_lse else out
