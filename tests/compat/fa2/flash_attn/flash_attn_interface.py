"""``flash_attn.flash_attn_interface`` (FA2 2.x signatures) mapped onto cuflash.

How each FA2 argument maps (cuflash's semantics are the same unless said otherwise):

- layouts: FA2's (batch, seqlen, heads, head_dim) is cuflash's; packed ``qkv`` (.., 3, H, D) and
  ``kv`` (.., 2, Hk, D) are unbound into strided views (cuflash takes any strides with a
  contiguous last axis), so gradients flow back into the packed tensor through autograd.
- ``causal``: bottom-right aligned in both. ``window_size=(left, right)``: the same inclusive
  window around the same diagonal, -1 unbounded; entries may be 0-d tensors (FA2's tests pass
  ``torch.randint`` results). ``softcap``, ``alibi_slopes`` ((H,) or (B, H) float32, minus
  ``slope * |i + Sk - Sq - j|``), ``softmax_scale`` (default ``head_dim ** -0.5``),
  ``deterministic``: passed through.
- autograd: :mod:`cuflash.interop.torch` (``attention``, ``attention_varlen``).
- ``dropout_p``: cuflash's dropout, seeded from torch's CUDA generator like FA2 (its seed, and
  its philox offset, advanced by each call), so ``torch.manual_seed`` makes calls repeatable.
- ``return_attn_probs``: ``(out, lse, S_dmask)``. cuflash's torch adapter returns only ``out``,
  so ``lse`` comes from a second, grad-free call of :func:`cuflash.attention_forward` /
  :func:`cuflash.attention_varlen` with the same inputs, options and dropout state. ``S_dmask``
  is written in FA2's encoding from cuflash's lse and keep mask (see :mod:`._probs`) when
  ``dropout_p > 0``; without dropout it is an empty tensor (FA2 returns none either).
- ``flash_attn_varlen_func(block_table=...)`` (paged KV): :func:`cuflash.decode` over the paged
  cache, queries left-padded per sequence so each one ends at its sequence's bottom-right corner
  (forward only; FA2 has no paged backward either).
- ``flash_attn_with_kvcache``: :func:`cuflash.decode`. Rotary embeddings are applied in torch to q
  and the new k before the call (cuflash has no rotary); ``cache_leftpad`` becomes a decode
  ``mask`` hiding each sequence's first ``leftpad`` keys (positions, causal and ALiBi distances are
  unchanged by it, as in FA2); ``cache_batch_idx`` gathers the cache rows and writes the appended
  ones back.

Raises :class:`NotSupported` where no faithful mapping exists.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from . import _probs

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

USE_TRITON_ROCM = False   # newer FA2 test files import it


class NotSupported(NotImplementedError):
    """An FA2 feature the shim cannot map onto cuflash (reported apart from failures)."""

    def __init__(self, what: str):
        super().__init__(f"cuflash FA2 shim: not supported: {what}")


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """Key-block width of the shim's ``S_dmask`` encoding (what FA2's tests decode it with).

    FA2 returns its kernel's tile width here; the shim's encoding is written with one fixed
    width, so this returns it whatever the arguments.
    """
    assert head_dim <= 256
    return _probs.block_size_n()


# ----------------------------------------------------------------------------- helpers

def _cuflash():
    import cuflash

    return cuflash


def _ct():
    import cuflash.interop.torch as ct

    return ct


@contextlib.contextmanager
def _torch_stream(device):
    """CuPy's current device and stream become torch's (for the calls made outside the adapter)."""
    import cupy

    from cuflash.interop._cupy_stream import cupy_stream

    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index), cupy_stream(torch.cuda.current_stream(index).cuda_stream):
        yield


def _window(window_size, causal):
    """cuflash's ``window`` (None when unbounded) and the (left, right) the S encoding uses."""
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1, got {(left, right)}")
    folded = (left, 0) if causal else (left, right)     # causal is the window's right edge at 0
    return (None if (left, right) == (-1, -1) else (left, right)), folded


def _scale(softmax_scale, head_dim):
    return float(softmax_scale) if softmax_scale is not None else head_dim ** -0.5


def _check_softcap(softcap):
    softcap = float(softcap)
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    return softcap


def _dropout_generator(device):
    """A cuflash Generator holding the state of this call, drawn from torch's CUDA generator.

    Like FA2: the seed is torch's CUDA seed and the offset its philox offset, which the call
    advances, so ``torch.manual_seed(s)`` before a call reproduces its dropout.
    """
    cuflash = _cuflash()
    index = device.index if device.index is not None else torch.cuda.current_device()
    gen = torch.cuda.default_generators[index]
    seed = int(gen.initial_seed()) % 2**64
    try:
        offset = int(gen.get_offset())
        gen.set_offset(offset + 4)           # torch's philox offsets move in steps of 4
    except (AttributeError, RuntimeError):   # a torch without get_offset: draw one instead
        offset = int(torch.randint(0, 2**62, (1,), device=device, generator=gen).item())
    g = cuflash.Generator(seed)
    g.set_state([seed, offset])
    return g


def _same_state(generator):
    """A copy of ``generator`` at its current state (for the second, lse-only call)."""
    if generator is None:
        return None
    g = _cuflash().Generator(0)
    g.set_state(generator.get_state())
    return g


def _round128(n):
    return -(-int(n) // 128) * 128


class _LastProbs:
    """The S_dmask of the last dense call, returned again for a call on the very same tensors.

    FA2's race-condition test repeats one call 250 times (same q, k, v objects, same seed) and
    discards S_dmask; rebuilding it each time would cost seconds per case. A hit needs the same
    tensor objects (weak references, so a new tensor at a recycled address never matches), the
    same version counters (no in-place change since), the same dropout state and options.
    """

    def __init__(self):
        self.key, self.refs, self.value = None, (), None

    def get(self, tensors, key):
        if (self.key == key and len(self.refs) == len(tensors)
                and all(ref() is t for ref, t in zip(self.refs, tensors))):
            return self.value
        return None

    def put(self, tensors, key, value):
        self.key, self.refs, self.value = key, tuple(weakref.ref(t) for t in tensors), value


_last_probs = _LastProbs()


# ----------------------------------------------------------------------------- dense

def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_attn_probs):
    ct = _ct()
    window, folded = _window(window_size, causal)
    options = dict(causal=bool(causal), scale=_scale(softmax_scale, q.shape[-1]), window=window,
                   softcap=_check_softcap(softcap), alibi_slopes=alibi_slopes, dropout_p=float(dropout_p))
    generator = _dropout_generator(q.device) if dropout_p > 0 else None
    lse_generator = _same_state(generator) if return_attn_probs else None
    out = ct.attention(q, k, v, generator=generator, deterministic=bool(deterministic), **options)
    if not return_attn_probs:
        return out
    cuflash = _cuflash()
    with torch.no_grad(), _torch_stream(q.device):
        _, lse_cp, rng_state = cuflash.attention_forward(q.detach(), k.detach(), v.detach(), generator=lse_generator,
                                                         **options)
        lse = torch.from_dlpack(lse_cp)
    if dropout_p <= 0:
        return out, lse, torch.empty(0, device=q.device, dtype=q.dtype)
    seed, offset = (int(x) for x in rng_state)
    operands = (q, k, v) if alibi_slopes is None else (q, k, v, alibi_slopes)
    key = (tuple((t._version, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in operands), seed, offset,
           float(dropout_p), options["scale"], options["softcap"], folded)
    s_dmask = _last_probs.get(operands, key)
    if s_dmask is not None:
        return out, lse, s_dmask
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    s_dmask = torch.zeros(batch, heads, _round128(seqlen_q), _round128(seqlen_k), device=q.device, dtype=q.dtype)
    threshold = cuflash.random.dropout_threshold(float(dropout_p))
    # Whole batches at a time (FA2's race-condition test asks for this 250 times at batch 60),
    # in chunks of about 2**26 scores to bound the temporaries.
    step = max(1, 2**26 // max(1, heads * seqlen_q * seqlen_k))
    with torch.no_grad():
        for b0 in range(0, batch, step):
            b1 = min(batch, b0 + step)
            slopes = alibi_slopes
            if alibi_slopes is not None and alibi_slopes.dim() == 2:
                slopes = alibi_slopes[b0:b1]
            s = _probs.scores(q[b0:b1], k[b0:b1], scale=options["scale"], softcap=options["softcap"],
                              alibi_slopes=slopes, window=folded)
            keep = _probs.keep_mask(seed, offset, threshold, range(b0, b1), heads, seqlen_q, seqlen_k, q.device)
            s_dmask[b0:b1, :, :seqlen_q, :seqlen_k] = _probs.encode(s, lse[b0:b1], keep).to(q.dtype)
    _last_probs.put(operands, key, s_dmask)
    return out, lse, s_dmask


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (B, Sq, H, D), k/v (B, Sk, Hk, D) -> out (B, Sq, H, D) [, lse (B, H, Sq), S_dmask]."""
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (B, Sq, H, D), kv (B, Sk, 2, Hk, D)."""
    k, v = kv.unbind(dim=2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """qkv (B, S, 3, H, D)."""
    q, k, v = qkv.unbind(dim=2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                      return_attn_probs)


# ----------------------------------------------------------------------------- varlen

def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table=None):
    window, folded = _window(window_size, causal)
    options = dict(causal=bool(causal), scale=_scale(softmax_scale, q.shape[-1]), window=window,
                   softcap=_check_softcap(softcap), alibi_slopes=alibi_slopes, dropout_p=float(dropout_p))
    if block_table is not None:
        return _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, options,
                             return_attn_probs)
    ct = _ct()
    generator = _dropout_generator(q.device) if dropout_p > 0 else None
    lse_generator = _same_state(generator) if return_attn_probs else None
    max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
    out = ct.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                              generator=generator, deterministic=bool(deterministic), **options)
    if not return_attn_probs:
        return out
    cuflash = _cuflash()
    state = None if lse_generator is None else lse_generator.get_state()
    with torch.no_grad(), _torch_stream(q.device):
        _, lse_cp = cuflash.attention_varlen(q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q=max_q, max_seqlen_k=max_k, generator=lse_generator,
                                             return_lse=True, **options)
        lse = torch.from_dlpack(lse_cp)                     # (H, total_q)
    if dropout_p <= 0:
        return out, lse, torch.empty(0, device=q.device, dtype=q.dtype)
    heads = q.shape[1]
    batch = cu_seqlens_q.numel() - 1
    s_dmask = torch.zeros(batch, heads, _round128(max_q), _round128(max_k), device=q.device, dtype=q.dtype)
    seed, offset = (int(x) for x in state)
    threshold = cuflash.random.dropout_threshold(float(dropout_p))
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    with torch.no_grad():
        for b in range(batch):
            sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            slopes = None if alibi_slopes is None else (alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes)
            s = _probs.scores(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], scale=options["scale"],
                              softcap=options["softcap"], alibi_slopes=slopes, window=folded)
            keep = _probs.keep_mask(seed, offset, threshold, b, heads, sq, sk, q.device)
            s_dmask[b, :, :sq, :sk] = _probs.encode(s[0], lse[:, cq[b]:cq[b + 1]], keep[0]).to(q.dtype)
    return out, lse, s_dmask


def _paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table, options,
                  return_attn_probs):
    """Varlen queries over a paged KV cache through cuflash.decode (forward only).

    decode aligns the Sq rows of its q block to the end of each sequence's keys, so each
    sequence's queries are placed at the end of a (B, max_seqlen_q) block (left padding): its last
    query then sits at its own bottom-right corner, as varlen requires.
    """
    if options["dropout_p"] > 0:
        raise NotSupported("dropout with a paged KV cache (cuflash.decode has no dropout)")
    if return_attn_probs:
        raise NotSupported("return_attn_probs with a paged KV cache")
    cuflash = _cuflash()
    batch = cu_seqlens_q.numel() - 1
    rows = int(max_seqlen_q)
    lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    slot = torch.arange(rows, device=q.device).view(1, rows)
    start = (rows - lens_q).view(batch, 1)
    valid = slot >= start                                            # (B, rows), batch-major
    source = (cu_seqlens_q[:-1].long().view(batch, 1) + slot - start)[valid]
    q_block = q.new_zeros((batch, rows, *q.shape[1:]))
    q_block[valid] = q.detach()[source]      # (DLPack exports no tensor that requires grad)
    decode_options = {n: options[n] for n in ("causal", "scale", "window", "softcap", "alibi_slopes")}
    with torch.no_grad(), _torch_stream(q.device):
        out_block = torch.from_dlpack(cuflash.decode(q_block, k_cache, v_cache, cache_seqlens=lens_k,
                                                     block_table=block_table, **decode_options))
    return out_block[valid]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q (total_q, H, D), k/v (total_k, Hk, D) [or paged (pages, page_size, Hk, D) with block_table]."""
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                             return_attn_probs, block_table)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q (total_q, H, D), kv (total_k, 2, Hk, D)."""
    k, v = kv.unbind(dim=1)
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                             return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, H, D)."""
    q, k, v = qkv.unbind(dim=1)
    return _attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                             causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


# ----------------------------------------------------------------------------- KV cache

def _rows_aligned(x):
    """Whether cuflash.decode can use ``x`` in place (16-byte rows and strides)."""
    size = x.element_size()
    return (x.stride(-1) == 1 and (x.shape[-1] * size) % 16 == 0 and x.data_ptr() % 16 == 0
            and all((s * size) % 16 == 0 for s in x.stride()[:-1]))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Attention of q (B, Sq, H, D) over a KV cache after appending k/v (B, S_new, Hk, D) in place.

    k_cache/v_cache: (B_cache, S_cache, Hk, D), or paged (pages, page_size, Hk, D) with
    block_table (B, max_pages) int32. Returns out (B, Sq, H, D) [, lse (B, H, Sq)].
    """
    from .layers.rotary import apply_rotary_emb

    cuflash = _cuflash()
    batch, seqlen_q = q.shape[:2]
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if cache_batch_idx is not None and block_table is not None:
        raise ValueError("cache_batch_idx cannot be used with a paged KV cache (block_table)")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    elif cache_seqlens is not None:
        cache_seqlens = cache_seqlens.to(torch.int32)
    window, _ = _window(window_size, causal)

    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin need the new k and v to append (as in FA2)")
        if cache_seqlens is None:
            raise NotSupported("rotary embeddings without cache_seqlens")
        # FA2: with causal or a local window each query sits at its own position cache_seqlens + i;
        # otherwise all queries sit at position cache_seqlens.
        if causal or window is not None:
            q = apply_rotary_emb(q, rotary_cos, rotary_sin, seqlen_offsets=cache_seqlens,
                                 interleaved=rotary_interleaved)
        else:
            flat = q.reshape(batch, 1, seqlen_q * q.shape[2], q.shape[3])
            q = apply_rotary_emb(flat, rotary_cos, rotary_sin, seqlen_offsets=cache_seqlens,
                                 interleaved=rotary_interleaved).reshape(q.shape)
        k = apply_rotary_emb(k, rotary_cos, rotary_sin, seqlen_offsets=cache_seqlens, interleaved=rotary_interleaved)

    k_sel, v_sel = k_cache, v_cache
    if cache_batch_idx is not None:
        rows = cache_batch_idx.long()
        k_sel, v_sel = k_cache[rows], v_cache[rows]

    mask = None
    if cache_leftpad is not None:
        if cache_seqlens is None:
            raise NotSupported("cache_leftpad without cache_seqlens")
        # decode's mask columns line up with the LAST M keys of each sequence (T_b keys in all).
        capacity = block_table.shape[1] * k_cache.shape[1] if block_table is not None else k_sel.shape[1]
        total = cache_seqlens.long() + (0 if k is None else k.shape[1])
        key = total.view(batch, 1) - capacity + torch.arange(capacity, device=q.device).view(1, capacity)
        mask = (key >= cache_leftpad.long().view(batch, 1)).view(batch, 1, 1, capacity)

    lens, table = cache_seqlens, block_table
    if k is not None and lens is not None and not (_rows_aligned(k_sel) and _rows_aligned(v_sel)):
        # cuflash copies a cache whose rows are not 16-byte aligned (e.g. D = 59) and then needs the
        # lengths (and pages) on the host to write the appended rows back.
        lens = lens.cpu().numpy()
        table = None if table is None else table.cpu().numpy()

    with torch.no_grad(), _torch_stream(q.device):
        q, k, v = (None if x is None else x.detach() for x in (q, k, v))
        result = cuflash.decode(q, k_sel, v_sel, cache_seqlens=lens, block_table=table, k_new=k, v_new=v,
                                num_splits=int(num_splits), causal=bool(causal), window=window,
                                softcap=_check_softcap(softcap), alibi_slopes=alibi_slopes,
                                scale=_scale(softmax_scale, q.shape[-1]), mask=mask,
                                return_lse=bool(return_softmax_lse))
    if cache_batch_idx is not None and k is not None:
        k_cache[rows], v_cache[rows] = k_sel, v_sel
    if return_softmax_lse:
        out, lse = result
        return torch.from_dlpack(out), torch.from_dlpack(lse)
    return torch.from_dlpack(result)
