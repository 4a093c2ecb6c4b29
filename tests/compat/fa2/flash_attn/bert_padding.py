"""Packing padded batches into varlen form and back (``flash_attn.bert_padding``'s two helpers).

Plain differentiable torch indexing: gathering rows for :func:`unpad_input`, scattering them into
zeros for :func:`pad_input`.
"""

import torch
import torch.nn.functional as F

__all__ = ["pad_input", "unpad_input"]


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Keep the rows of a padded batch that the mask marks.

    Parameters
    ----------
    hidden_states : torch.Tensor (batch, seqlen, ...)
    attention_mask : bool or int torch.Tensor (batch, seqlen)
        True / 1 for the tokens in use.
    unused_mask : bool or int torch.Tensor (batch, seqlen), optional
        Tokens that are kept in the packed rows but do not count as used (FA2's "seqused").

    Returns
    -------
    hidden_states : torch.Tensor (total, ...)
        The kept rows, batch-major, in sequence order.
    indices : int64 torch.Tensor (total,)
        Their positions in the flattened (batch * seqlen) axis.
    cu_seqlens : int32 torch.Tensor (batch + 1,)
        Offsets of each sequence in the packed rows.
    max_seqlen : int
        The longest sequence (kept rows).
    seqused : int32 torch.Tensor (batch,)
        Tokens per sequence counted by ``attention_mask`` alone.
    """
    kept = attention_mask.bool() if unused_mask is None else (attention_mask.bool() | unused_mask.bool())
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return rows[indices], indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states, indices, batch, seqlen):
    """Scatter packed rows back into a zero-padded (batch, seqlen, ...) tensor.

    Parameters
    ----------
    hidden_states : torch.Tensor (total, ...)
    indices : int64 torch.Tensor (total,)
        Positions in the flattened (batch * seqlen) axis, as returned by :func:`unpad_input`.
    batch, seqlen : int

    Returns
    -------
    torch.Tensor (batch, seqlen, ...)
        Differentiable with respect to ``hidden_states``.
    """
    rest = hidden_states.shape[1:]
    zeros = hidden_states.new_zeros((batch * seqlen, *rest))
    return zeros.index_put((indices,), hidden_states).reshape(batch, seqlen, *rest)
