"""The mask side of the transformers integration: a model's padding mask as cuflash's cheap forms.

transformers builds one mask per forward (``masking_utils.create_causal_mask`` and friends) through
the function registered under the model's attention implementation in ``AttentionMaskInterface``,
and hands the result to every layer's attention function. :func:`attention_mask` is that function
for cuflash. It runs once per forward, so the work it does (finding the real tokens, one host
synchronisation for the longest sequence) is shared by all the layers, and it returns one of:

- ``None``: causal attention over keys that end where the queries end, no padding (the training
  case without padding, and a decode step of an unpadded batch): ``causal=True`` in cuflash, whose
  bottom-right alignment is the KV cache's.
- :class:`CuflashMask` with ``varlen``: a padded batch of several queries per sequence (prefill,
  training): the real tokens packed by :func:`cuflash.interop.torch.attention_varlen`, padding
  neither computed nor read.
- :class:`CuflashMask` with ``key_mask``: a (B, 1, 1, Sk) bool key mask that cuflash broadcasts and
  never materialises: decode steps of a padded batch (packing a KV cache would copy it every
  step), bidirectional attention, a sliding window over padding with holes in it.
- A dense (B, 1, Sq, Sk) bool tensor, built by transformers' own ``sdpa_mask``: only for mask
  patterns this module does not know (packed sequences found from ``position_ids``, a model's own
  ``or_mask_function`` / ``and_mask_function``, chunked attention): correct, not cheap.

Why varlen for prefill and a key mask for decode: docs/decisions.md#transformers-padding-masks.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import masking_utils


@dataclasses.dataclass(frozen=True, eq=False)
class Varlen:
    """Where the real tokens of a padded batch are, for ``attention_varlen``.

    ``q[batch_q, :, seq_q]`` of a (B, H, Sq, D) query gives the packed (total_q, H, D) queries in
    sequence order, likewise keys; ``cu_seqlens_*`` are the packed sequences' offsets.
    """

    batch_q: torch.Tensor       # int64 (total_q,)
    seq_q: torch.Tensor         # int64 (total_q,)
    batch_k: torch.Tensor       # int64 (total_k,)
    seq_k: torch.Tensor         # int64 (total_k,)
    cu_seqlens_q: torch.Tensor  # int32 (B + 1,)
    cu_seqlens_k: torch.Tensor  # int32 (B + 1,)
    max_seqlen_q: int
    max_seqlen_k: int


@dataclasses.dataclass(frozen=True, eq=False)
class CuflashMask:
    """One forward's attention pattern, as the cuflash attention function runs it.

    Attributes
    ----------
    batch_size, q_length, kv_length : int
        The shapes the layers' q (B, H, q_length, D) and k (B, Hk, kv_length, D) must have.
    causal : bool
        Query i sees keys up to its own position (bottom-right aligned over the first ``kv_used``
        keys).
    window : int or None
        transformers' ``sliding_window``: a query sees itself and the ``window - 1`` keys before it
        (cuflash's ``window=(window - 1, 0)``); None: no window.
    kv_used : int
        Only keys ``[0, kv_used)`` take part: with a static cache the slots after the last query are
        empty, and a causal query never sees them.
    key_mask : torch.Tensor or None
        (B, 1, 1, kv_used) bool, True where the key is a real token.
    varlen : Varlen or None
        The packed form (then ``key_mask`` is None).
    """

    batch_size: int
    q_length: int
    kv_length: int
    causal: bool
    window: int | None
    kv_used: int
    key_mask: torch.Tensor | None = None
    varlen: Varlen | None = None


def _closure(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in fn.__closure__ or ())))


def _sliding_window_of(mask_function) -> int | None:
    """w if ``mask_function`` is ``sliding_window_causal_mask_function(w)``, else None.

    That function is ``and_masks(sliding_window_overlay(w), causal_mask_function)``; its parts are
    read from the closures, then the overlay's rule is checked on two points, so that a transformers
    whose window rule moved (inclusive/exclusive) is refused rather than run off by one.
    """
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = _closure(mask_function).get("mask_functions")
    if not (isinstance(parts, tuple) and len(parts) == 2 and parts[1] is masking_utils.causal_mask_function):
        return None
    overlay = parts[0]
    if getattr(overlay, "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask":
        return None
    w = _closure(overlay).get("sliding_window")
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        return None
    # kv_idx > q_idx - w: query w - 1 sees key 0, query w does not (w keys, itself included).
    if not (overlay(0, 0, w - 1, 0) and not overlay(0, 0, w, 0)):
        return None
    return w


def _pattern(mask_function):
    """("causal" | "bidirectional", window) for the patterns cuflash runs natively, else None."""
    if mask_function is masking_utils.causal_mask_function:
        return "causal", None
    if mask_function is masking_utils.bidirectional_mask_function:
        return "bidirectional", None
    w = _sliding_window_of(mask_function)
    if w is not None:
        return "causal", w
    return None


def _padded_to(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """The 2D mask with False appended up to ``length`` columns (a static cache's empty slots)."""
    if attention_mask.shape[-1] >= length:
        return attention_mask
    return torch.nn.functional.pad(attention_mask, (0, length - attention_mask.shape[-1]), value=False)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                   mask_function=masking_utils.causal_mask_function, attention_mask=None, **kwargs):
    """The mask function registered for cuflash in transformers' ``AttentionMaskInterface``.

    Parameters
    ----------
    batch_size, q_length, kv_length : int
        The layers' batch, query length and key length.
    q_offset, kv_offset : int or torch.Tensor
        Positions of the first query and the first key (a static cache gives a 0-d tensor).
    mask_function : callable
        transformers' pattern (``causal_mask_function``, a sliding window of it,
        ``bidirectional_mask_function``, or a combination this module does not know).
    attention_mask : torch.Tensor (B, positions) or None
        The 2D padding mask, True (or 1) for real tokens, one column per position from 0.
    **kwargs
        transformers' other arguments (``device``, ``use_vmap``, ``local_size``, ...).

    Returns
    -------
    None, CuflashMask or torch.Tensor
        See the module's docstring.

    Examples
    --------
    >>> import torch
    >>> from cuflash.interop._transformers_masks import attention_mask
    >>> pad = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)   # left padding
    >>> m = attention_mask(2, 4, 4, attention_mask=pad)
    >>> m.varlen.cu_seqlens_q.tolist(), m.varlen.max_seqlen_q
    ([0, 2, 6], 4)
    """
    pattern = _pattern(mask_function)
    if pattern is None:
        # A pattern cuflash has no cheap form for: transformers' dense boolean mask, which the
        # attention function passes as cuflash's `mask` (exact, (B, 1, Sq, Sk) in memory).
        return masking_utils.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                       q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                                       attention_mask=attention_mask, allow_is_causal_skip=False,
                                       allow_is_bidirectional_skip=False, use_vmap=kwargs.get("use_vmap", False),
                                       device=kwargs.get("device", "cpu"))
    kind, window = pattern
    causal = kind == "causal"
    q_offset, kv_offset = int(q_offset), int(kv_offset)   # a static cache's 0-d tensor: one sync
    if causal:
        # Keys after the last query are never seen (a static cache's empty slots): cut them, and
        # cuflash's bottom-right diagonal falls on the queries' own positions.
        kv_used = q_offset + q_length - kv_offset
        if not q_length <= kv_used <= kv_length:
            raise ValueError(f"cuflash: queries at positions [{q_offset}, {q_offset + q_length}) are not the last "
                             f"of keys [{kv_offset}, {kv_offset + kv_length}); this cache layout is not supported")
    else:
        kv_used = kv_length
    plain = CuflashMask(batch_size, q_length, kv_length, causal, window, kv_used)
    if attention_mask is None:
        return None if causal and window is None and kv_used == kv_length else plain

    padding = _padded_to(attention_mask.to(torch.bool), kv_offset + kv_length)
    keys = padding[:, kv_offset:kv_offset + kv_used]
    lengths_k = keys.sum(1, dtype=torch.int32)
    if causal:
        queries = padding[:, q_offset:q_offset + q_length]
        lengths_q = queries.sum(1, dtype=torch.int32)
    else:
        queries, lengths_q = None, torch.full_like(lengths_k, q_length)   # cross attention: no query padding
    facts = [lengths_k.min(), lengths_q.max(), lengths_k.max()]
    if window is not None:
        # The window counts positions; packed indices count real tokens. They agree only where each
        # row's real keys are one run (left or right padding).
        first = keys.to(torch.int8).argmax(1)
        last = kv_used - 1 - keys.flip(1).to(torch.int8).argmax(1)
        facts.append(((last - first + 1 == lengths_k) | (lengths_k == 0)).all())
    facts = torch.stack([f.to(torch.int64) for f in facts]).tolist()   # the forward's one sync
    if facts[0] == kv_used:
        return None if causal and window is None and kv_used == kv_length else plain
    if not causal or q_length == 1 or (window is not None and not facts[3]):
        return dataclasses.replace(plain, key_mask=keys.contiguous()[:, None, None, :])
    batch_q, seq_q = queries.nonzero(as_tuple=True)
    batch_k, seq_k = keys.nonzero(as_tuple=True)
    varlen = Varlen(batch_q, seq_q, batch_k, seq_k, _offsets(lengths_q), _offsets(lengths_k),
                    facts[1], facts[2])
    return dataclasses.replace(plain, varlen=varlen)
