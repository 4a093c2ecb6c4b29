"""Block sparsity derived from a MaskMod: which tiles its expression hides entirely, so that the
attention kernels never load them (issue 52 item 4), and fwd_sm90 evaluates the MaskMod only on
tiles where a block is partly visible.

A call with a ``mask_mod`` whose :attr:`~cuflash.MaskMod.derives_blocks` holds (``sparse=True``, the
default) gets a bool block mask of shape (B|1, Hq|1, ceil(Sq / bq), ceil(Sk / bk)) computed on the GPU
by ``cuda_src/mask_blocks.cu``: a block is True where any of its elements may attend, evaluated
element by element with the very function the kernels compile, so passing it as ``block_mask`` changes
no score (a False block's elements are all hidden by the MaskMod already); it only lets every kernel
family skip the tiles whose blocks are all False through the existing ``block_mask`` path. A block
whose elements all attend holds the byte 3 rather than 1 (still True to every reader of a bool mask):
on a tile of such blocks fwd_sm90 runs no per-element mask at all (cuda_src/mask.cuh,
``block_mask_tile_state``), so a document mask pays for its expression only on the tiles that cross a
document's edge. The batch and head axes are 1 unless the expression reads ``b`` / ``h``
(:attr:`~cuflash.MaskMod.reads`): a document mask over 32k tokens is 512 x 512 bytes at 64 x 64 blocks.

**Bits.** With the block mask comes every element's answer, one bit each (bit j % 32 of the 32-bit
word (b, h, i, j // 32)), in the same allocation after the block bytes, where the bits take at most
:data:`BITS_MAX_BYTES` (S^2 / 8 bytes for one (b, h): 32 MiB at 16k tokens). A call whose only
modifier is the MaskMod then runs the block mask variant of each kernel family, which masks a tile's
partly visible blocks from the bits (``FwdParams::mask_bits_offset``) instead of compiling the
expression in: fwd_sm90 keeps its 128-key tiles and bwd_sm90 its plain ones, where the expression's
registers sent them to 64-key and featured tiles. Beside other modifiers the kernels evaluate the
expression as before.

**Cache.** The mask is computed once per (the MaskMod's key and scalar values, its arrays' addresses,
shapes, strides and dtypes, B|1, Hq|1, Sq, Sk, block size, device) and kept in a process-wide cache
(:data:`MAX_ENTRIES` entries and :data:`MAX_BYTES` bytes, least recently used first out). The
contract: **an array argument's contents are assumed unchanged while its address is**. The cache
holds a reference to the arrays a mask was derived from, so no other array can be given the same
address while the entry lives: a new array always means a new mask. Writing into an argument in place is the one case it cannot see: call
:func:`clear_mask_cache` afterwards (or pass a new array, or ``MaskMod(..., sparse=False)``).

**Streams and CUDA graphs.** Outside a capture the mask is computed on the call's stream (ordered after
the work that wrote the arguments, before the call's kernels); an event marks it, and a later call on
another stream waits for that event once on the host. Inside a capture (CuPy's current stream
capturing), a missing mask is computed with :func:`cuflash._runtime.now.done_now` (on a private
stream, finished before the call goes on), from the arguments' contents at capture time, and the entry
is pinned: never evicted, because the graph keeps reading its memory at every replay (only
:func:`clear_mask_cache` drops it; do not call it while such a graph is still replayed). A warm-up call
before the capture computes it ahead, as for every other set-up of a call.

**Not here.** attention_varlen (the mask would follow the packed layout) and decode (positions shift
with the cache lengths) load every tile; a MaskMod rebuilt by :meth:`~cuflash.MaskMod.with_arrays`
around another framework's buffers (JAX inside ``jax.jit``, which reuses a buffer's address for new
data) derives nothing.
"""

from __future__ import annotations

import collections
import math
import threading

import numpy as np

from . import _checks
from ._runtime import capture as _capture, launch as _launch
from ._runtime.now import done_now, relaxed_capture_mode
from ._runtime.params import USER_ARGS
from .interop._torch_tensors import is_torch_tensor

__all__ = ["clear_mask_cache", "derived_block_mask", "call_block_mask", "bits_layout", "MAX_ENTRIES", "MAX_BYTES",
           "BITS_MAX_BYTES"]

#: Masks kept (pinned ones, used by a captured graph, are not counted out).
MAX_ENTRIES = 32
#: Bytes the kept masks may take together (the newest is kept whatever its size).
MAX_BYTES = 1 << 30
#: The most bytes a mask's bits may take; beyond, the mask comes without them.
BITS_MAX_BYTES = 256 << 20
#: Query rows of the bits are padded to a multiple of this and one more row, so that the kernels' tiles
#: (at most 128 rows, 128 keys) read them without bounds past the sequences' ends.
BITS_ROW_PAD = 128

_cache: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


class _Entry:
    __slots__ = ("mask", "bits", "keep", "event", "stream", "pinned", "nbytes")

    def __init__(self, mask, bits, keep, event, stream, pinned, nbytes):
        self.mask, self.bits, self.keep, self.event, self.stream = mask, bits, keep, event, stream
        self.pinned, self.nbytes = pinned, nbytes


def clear_mask_cache() -> None:
    """Forget every block mask derived from a MaskMod (:class:`cuflash.MaskMod`, ``sparse=True``).

    The cache assumes that a MaskMod's array arguments keep their contents while they keep their
    addresses; call this after writing into one in place, so that the next call derives its block
    mask again. Do not call it while a CUDA graph captured with a derived mask is still replayed (the
    graph reads the mask's memory, which this releases).

    Examples
    --------
    >>> doc = cupy.asarray(doc_ids, dtype=cupy.int32)
    >>> document = cuflash.MaskMod("doc[q_idx] == doc[kv_idx]", doc=doc)
    >>> out = cuflash.attention(q, k, v, mask_mod=document)
    >>> doc[:] = new_doc_ids            # written in place: same address, new contents
    >>> cuflash.clear_mask_cache()
    >>> out = cuflash.attention(q, k, v, mask_mod=document)
    """
    with _lock:
        _cache.clear()


def _describe(x, name: str):
    """(address, shape, strides, dtype) of an array argument (torch tensors read without DLPack)."""
    cupy = _checks._cupy()
    if type(x) is cupy.ndarray:
        return x.data.ptr, x.shape, x.strides, x.dtype.str
    if is_torch_tensor(x):
        return x.data_ptr(), tuple(x.shape), tuple(x.stride()), str(x.dtype)
    y = _checks.as_cuda_array(x, f"mask_mod argument {name}")
    return y.data.ptr, y.shape, y.strides, y.dtype.str


def _on_gpu(x) -> bool:
    """Whether ``x`` is a CUDA array (else the call's checks report it; nothing is derived)."""
    cupy = _checks._cupy()
    if type(x) is cupy.ndarray:
        return True
    if is_torch_tensor(x):
        return bool(x.is_cuda)
    device = getattr(x, "__dlpack_device__", None)
    try:
        return device is not None and device()[0] in (2, 3, 13)   # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
    except Exception:   # noqa: BLE001 - any failure here is the checks' to report
        return False


def _reads(mask_mod) -> frozenset:
    reads = mask_mod.__dict__.get("_reads")
    if reads is None:
        reads = mask_mod._reads = mask_mod.reads
    return reads


def mask_shape(mask_mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int, block_size) -> tuple:
    """(B|1, Hq|1, ceil(Sq / bq), ceil(Sk / bk)) of the mask derived from ``mask_mod``: a batch axis only
    if its expression reads ``b``, a head axis only if it reads ``h``."""
    reads = _reads(mask_mod)
    bq, bk = block_size
    return (batch if "b" in reads else 1, heads if "h" in reads else 1, -(-seqlen_q // bq), -(-seqlen_k // bk))


def bits_layout(shape, seqlen_q: int, block_size) -> tuple[int, int] | None:
    """(rows, row_words) of the bits beside a derived mask of ``shape`` (B|1, Hq|1, ceil(Sq / bq),
    ceil(Sk / bk)): rows = Sq padded to a multiple of :data:`BITS_ROW_PAD` plus one, row_words = the
    mask's columns x bk / 32. None where bk is no multiple of 32, a (b, h) slice reaches 2^31 words
    (the kernels index it in 32 bits) or the bits would take more than :data:`BITS_MAX_BYTES`."""
    bk = block_size[1]
    if bk % 32:
        return None
    rows = -(-seqlen_q // BITS_ROW_PAD) * BITS_ROW_PAD + 1
    row_words = shape[3] * bk // 32
    if rows * row_words >= 2 ** 31 or 4 * shape[0] * shape[1] * rows * row_words > BITS_MAX_BYTES:
        return None
    return rows, row_words


def cache_key(mask_mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int, block_size, device: int) -> tuple:
    """What a derived mask depends on: the MaskMod's :attr:`key` and scalar values, each array
    argument's (address, shape, strides, dtype) (the contents are assumed unchanged while the address
    is), the mask's shape (B and Hq only where the expression reads them), Sq, Sk, the block size and
    the device."""
    memo_key, arrays = mask_mod.call_parts()
    shape = mask_shape(mask_mod, batch, heads, seqlen_q, seqlen_k, block_size)
    described = tuple(_describe(x, name) for x, name in zip(arrays, mask_mod.args.array_names()))
    return (memo_key[0], memo_key[1], described, shape[:2], seqlen_q, seqlen_k,
            tuple(block_size), device)


def derived_block_mask(mask_mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int, block_size):
    """The block mask ``mask_mod`` implies for a call, from the cache or computed now (see the module's
    notes): a C-contiguous CuPy bool array (B|1, Hq|1, ceil(Sq / bq), ceil(Sk / bk)) whose bytes are 3
    where every element of the block may attend, 1 where some may, 0 where none may (both nonzero
    bytes read as True). Sq, Sk, B and Hq must be positive."""
    return _derived(mask_mod, batch, heads, seqlen_q, seqlen_k, block_size)[0]


def _derived(mask_mod, batch, heads, seqlen_q, seqlen_k, block_size):
    """(mask, bits): :func:`derived_block_mask`'s mask and the FwdParams fields of the bits beside it
    (``mask_bits_offset`` and the strides, as (name, value) pairs: a call's memo key takes them as they
    are), or None without bits."""
    cupy = _checks._cupy()
    device = _launch.device_id()
    key = cache_key(mask_mod, batch, heads, seqlen_q, seqlen_k, block_size, device)
    stream = _launch.current_stream_ptr(device)
    with _lock:
        entry = _cache.get(key)
        if entry is not None:
            _cache.move_to_end(key)
    if entry is not None:
        if entry.event is not None and entry.stream != stream:
            with relaxed_capture_mode():   # a host wait, once: allowed beside a capture in relaxed mode
                entry.event.synchronize()
            entry.event = None
        if not entry.pinned and _capture.is_capturing():
            entry.pinned = True
        return entry.mask, entry.bits
    shape = mask_shape(mask_mod, batch, heads, seqlen_q, seqlen_k, block_size)
    if _capture.is_capturing():
        with done_now(device):
            mask, bits, keep, nbytes = _compute(cupy, mask_mod, shape, seqlen_q, seqlen_k, block_size)
        entry = _Entry(mask, bits, keep, None, stream, True, nbytes)
    else:
        mask, bits, keep, nbytes = _compute(cupy, mask_mod, shape, seqlen_q, seqlen_k, block_size)
        event = cupy.cuda.Event(disable_timing=True)
        event.record()
        entry = _Entry(mask, bits, keep, event, stream, False, nbytes)
    with _lock:
        _cache[key] = entry
        unpinned = [k for k, e in _cache.items() if not e.pinned]
        total = sum(_cache[k].nbytes for k in unpinned)
        for old in unpinned[:-1]:   # oldest first; the newest stays
            if len(unpinned) <= MAX_ENTRIES and total <= MAX_BYTES:
                break
            total -= _cache.pop(old).nbytes
            unpinned.remove(old)
    return mask, bits


def _compute(cupy, mask_mod, shape, seqlen_q, seqlen_k, block_size):
    """Launch cuda_src/mask_blocks.cu for ``mask_mod`` on CuPy's current stream; returns the mask, its
    bits' fields (or None), what must live as long as the entry (the user's arrays, whose addresses key
    it, and the copies and arguments the launch reads) and the bytes allocated."""
    from ._build.compile import get_kernel
    from ._scores import user_operands
    from .kernels.mask_blocks import MASK_BLOCKS_MAX_CTAS, MASK_BLOCKS_THREADS, mask_blocks_variant

    fields, arrays, _, source = user_operands(None, mask_mod, first=0)
    args = np.zeros((), USER_ARGS)
    for name, value in fields.items():
        field = name.removeprefix("user.")
        args[field] = arrays[value[1]].data.ptr if isinstance(value, tuple) else value
    args_gmem = cupy.asarray(np.frombuffer(args.tobytes(), np.uint8))
    blocks = math.prod(shape)
    layout = bits_layout(shape, seqlen_q, block_size)
    if layout is None:
        mask, bits, bits_fields, rows = cupy.empty(shape, dtype=cupy.bool_), np.uint64(0), None, 0
        buffer = mask
    else:   # one allocation: the block bytes, then the bits at a 256-byte boundary
        rows, row_words = layout
        offset = -(-blocks // 256) * 256
        slice_words = rows * row_words
        buffer = cupy.empty(offset + 4 * shape[0] * shape[1] * slice_words, dtype=cupy.uint8)
        mask = buffer[:blocks].view(cupy.bool_).reshape(shape)
        bits = buffer[offset:].view(cupy.uint32)
        bits_fields = (("mask_bits_offset", offset),
                       ("mask_bits_batch_stride", shape[1] * slice_words if shape[0] > 1 else 0),
                       ("mask_bits_head_stride", slice_words if shape[1] > 1 else 0),
                       ("mask_bits_row_stride", row_words))
    kernel = get_kernel(mask_blocks_variant(source))
    bq, bk = block_size
    kernel((min(blocks, MASK_BLOCKS_MAX_CTAS),), (MASK_BLOCKS_THREADS,),
           (args_gmem, mask, bits, np.int64(blocks), np.int32(shape[1]), np.int32(shape[2]), np.int32(shape[3]),
            np.int32(bq), np.int32(bk), np.int32(seqlen_q), np.int32(seqlen_k), np.int32(rows)))
    return mask, bits_fields, (mask_mod.call_parts()[1], arrays, args_gmem, buffer), buffer.nbytes


def call_block_mask(entry: str, mask_mod, q, k, block_mask, block_size, alone: bool):
    """(block_mask, block_size, bits) that a dense call (``attention``, ``attention_forward``,
    ``attention_backward``) passes its kernels: unchanged (bits None) without a ``mask_mod`` that derives
    blocks; else the derived mask at :data:`~cuflash.kernels.mask_blocks.DERIVED_BLOCK_SIZE` and, where
    the MaskMod is the call's only modifier (``alone``: :func:`bits_alone`) and the mask has them (see
    :func:`bits_layout`), its bits' FwdParams fields, for the kernels to read instead of the expression;
    or, beside an explicit ``block_mask``, at its ``block_size`` and ANDed with it (a new array each call,
    without bits: such a call cannot be captured in a CUDA graph). Shapes that the checks will refuse,
    and empty problems, are passed through unchanged for the checks to report."""
    from .modifiers import MaskMod
    from .kernels.mask_blocks import DERIVED_BLOCK_SIZE

    if not isinstance(mask_mod, MaskMod) or not mask_mod.derives_blocks:
        return block_mask, block_size, None
    q_shape, k_shape = getattr(q, "shape", None), getattr(k, "shape", None)
    if q_shape is None or k_shape is None or len(q_shape) != 4 or len(k_shape) != 4 or not _on_gpu(q):
        return block_mask, block_size, None
    batch, seqlen_q, heads = int(q_shape[0]), int(q_shape[1]), int(q_shape[2])
    seqlen_k = int(k_shape[1])
    if min(batch, seqlen_q, heads, seqlen_k) <= 0 or max(seqlen_q, seqlen_k) > _checks.INT32_MAX:
        return block_mask, block_size, None
    if block_mask is None:
        mask, bits = _derived(mask_mod, batch, heads, seqlen_q, seqlen_k, DERIVED_BLOCK_SIZE)
        return mask, DERIVED_BLOCK_SIZE, bits if alone else None
    bq, bk = _checks.check_block_size(block_size)
    target = (batch, heads, -(-seqlen_q // bq), -(-seqlen_k // bk))
    given = _checks.broadcast_operand(block_mask, "block_mask", target, "bool")
    _capture.refuse_capture(entry, "a mask_mod beside an explicit block_mask ANDs the two into a new array at each "
                            "call, which lives only during the call; pass MaskMod(..., sparse=False) or no block_mask")
    derived = derived_block_mask(mask_mod, batch, heads, seqlen_q, seqlen_k, (bq, bk))
    return _checks._cupy().logical_and(given, derived), (bq, bk), None


def bits_alone(score_mod, softcap, alibi_slopes, mask, bias) -> bool:
    """Whether a call's MaskMod may be read as bits (the block mask variants, without the expression):
    no other score modifier, whose variants have no room for the bits' reads."""
    return score_mod is None and not softcap and alibi_slopes is None and mask is None and bias is None
