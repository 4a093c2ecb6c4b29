"""Rotary position embedding (``flash_attn.layers.rotary.apply_rotary_emb``) in plain torch.

Both conventions: GPT-NeoX ("half", ``interleaved=False``) rotates the pair (x[k], x[k + r/2]),
GPT-J (``interleaved=True``) the pair (x[2k], x[2k + 1]), each by the angle whose cos / sin are
row ``position`` of ``cos`` / ``sin``. Only the first ``rotary_dim = 2 * cos.shape[-1]`` features
rotate; the rest pass through. Computed in float32, returned in the input dtype.
"""

import torch

__all__ = ["apply_rotary_emb"]


def _positions(x, seqlen_offsets, cu_seqlens, max_seqlen):
    """Rotary position of every token of ``x``: (batch, seqlen) or (total,) int64."""
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        pos = torch.arange(seqlen, device=device).expand(batch, seqlen)
        if isinstance(seqlen_offsets, torch.Tensor):
            return pos + seqlen_offsets.to(device=device, dtype=torch.long).reshape(batch, 1)
        return pos + int(seqlen_offsets)
    total = x.shape[0]
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    token = torch.arange(total, device=device)
    seq = torch.searchsorted(cu, token, right=True) - 1     # sequence of each packed row
    pos = token - cu[seq]
    if isinstance(seqlen_offsets, torch.Tensor):
        return pos + seqlen_offsets.to(device=device, dtype=torch.long)[seq]
    return pos + int(seqlen_offsets)


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """Rotate the first ``rotary_dim`` features of ``x`` by position-dependent angles.

    Parameters
    ----------
    x : torch.Tensor (batch, seqlen, heads, head_dim), or (total, heads, head_dim) with ``cu_seqlens``
    cos, sin : torch.Tensor (seqlen_rotary, rotary_dim / 2)
        Row p holds the cos / sin of the angles of position p; rotary_dim <= head_dim.
    interleaved : bool
        True: GPT-J pairs (2k, 2k+1); False: GPT-NeoX pairs (k, k + rotary_dim/2).
    inplace : bool
        Write the result into ``x`` and return it.
    seqlen_offsets : int or int torch.Tensor (batch,)
        Position of each sequence's first token (e.g. the KV-cache length when decoding).
    cu_seqlens : int32 torch.Tensor (batch + 1,), optional
        Packed (varlen) ``x``: sequence b is rows cu_seqlens[b] .. cu_seqlens[b+1] - 1.
    max_seqlen : int, optional
        Accepted for API compatibility; not needed here.

    Returns
    -------
    torch.Tensor, the shape and dtype of ``x``
    """
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be <= head_dim ({x.shape[-1]})")
    if sin.shape != cos.shape:
        raise ValueError(f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    pos = _positions(x, seqlen_offsets, cu_seqlens, max_seqlen)
    if pos.numel() and int(pos.max()) >= cos.shape[0]:
        raise ValueError(f"positions reach {int(pos.max())} but cos/sin have only {cos.shape[0]} rows")
    c = cos.float()[pos].unsqueeze(-2)        # (..., 1, half): broadcast over heads
    s = sin.float()[pos].unsqueeze(-2)
    xr = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    o1 = x1 * c - x2 * s
    o2 = x1 * s + x2 * c
    rotated = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)
    rotated = rotated.to(x.dtype)
    if inplace:
        x[..., :rotary_dim] = rotated
        return x
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
