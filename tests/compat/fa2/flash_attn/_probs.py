"""The ``S_dmask`` that FA2's ``return_attn_probs=True`` returns, rebuilt from cuflash's pieces.

FA2's kernels can write the attention probabilities of a call, unnormalised per key block, with
the sign bit marking the elements that dropout removed. FA2's tests decode that tensor
(``convert_flash_attn_S_to_softmax`` and ``normalize_flash_attn_S``): the dropout mask is
``S >= 0``, and the probabilities are ``|S|`` times ``exp(m - lse)`` where ``m`` is, for key block
``j`` of width :func:`block_size_n`, the running row maximum over blocks ``j, j + 1, ...`` (FA2
walks the key blocks from the last to the first) and ``lse`` the test's own log-sum-exp.

cuflash never materialises probabilities, so this module writes a tensor with that encoding from:

- the scores ``s``, recomputed here in float32 torch from q and k with cuflash's score pipeline
  (scale, softcap, minus ALiBi, causal/window masks, all aligned bottom-right);
- cuflash's own ``lse`` of the call, so the decoded probabilities are ``exp(s - lse_cuflash)``:
  the test's comparison with its reference therefore checks cuflash's lse;
- cuflash's dropout keep mask for the call's ``rng_state``, regenerated on the GPU by
  :func:`keep_mask` from the documented formula (Philox4x32-10 over ``(seed, offset, b, h, i,
  j)``, see :mod:`cuflash.random`). The test's reference applies that mask to compute its
  expected output, so any difference between the mask the kernel applied and the documented one
  fails the output check.

The value written for element (i, j) of key block J is
``exp(s_ij - m_iJ) * exp(L_i - lse_i)`` with ``L_i`` this module's float32 log-sum-exp of the
row, which the test's ``exp(m_iJ - lse_test_i)`` turns back into ``exp(s_ij - lse_i)``.
"""

from __future__ import annotations

import torch

#: Width of the key blocks of the encoding (any value works as long as the encoder and the
#: decoder agree; the decoder asks :func:`flash_attn.flash_attn_interface._get_block_size_n`).
BLOCK_N = 128

# Random123's Philox4x32 round multipliers and key increments (as in cuflash.random).
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def block_size_n() -> int:
    return BLOCK_N


def _mul_hi_lo(a, m: int):
    """(hi, lo) 32-bit halves of the 64-bit product ``a * m``, exact in int64 arithmetic.

    ``a`` is an int64 tensor of values in [0, 2**32); ``m`` a 32-bit constant. The product may not
    fit a signed 64-bit integer, so ``m`` is split in 16-bit halves: every partial product stays
    below 2**49.
    """
    t_lo = a * (m & 0xFFFF)                 # < 2**48
    t_hi = a * (m >> 16)                    # < 2**48; the product is t_hi * 2**16 + t_lo
    r = (t_hi & 0xFFFF) * 65536 + t_lo      # < 2**49
    return (t_hi >> 16) + (r >> 32), r & _MASK32


def philox4x32_10(c0, c1, c2, c3, seed: int):
    """Philox4x32-10 of the counters (int64 tensors holding 32-bit words) under key ``seed``."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for rnd in range(10):
        if rnd:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mul_hi_lo(c0, _M0)
        hi1, lo1 = _mul_hi_lo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def keep_mask(seed: int, offset: int, threshold: int, batch_index, num_heads: int, seqlen_q: int, seqlen_k: int,
              device) -> torch.Tensor:
    """cuflash's dropout keep mask: bool (len(batch_index), num_heads, seqlen_q, seqlen_k).

    Element (b, h, i, j) is kept iff word ``j % 4`` of Philox4x32-10 with key ``(seed lo32, seed
    hi32)`` and counter ``(j // 4, i, batch_index[b] * num_heads + h, offset lo32)`` is
    ``>= threshold`` (:func:`cuflash.random.dropout_threshold` of the dropout probability).
    ``batch_index`` is an int or a sequence of ints (the batch / varlen sequence indices).
    """
    batch = torch.as_tensor(batch_index, dtype=torch.int64, device=device).reshape(-1)
    groups = -(-seqlen_k // 4)
    shape = (batch.numel(), num_heads, seqlen_q, groups)
    c0 = torch.arange(groups, device=device, dtype=torch.int64).view(1, 1, 1, groups).expand(shape)
    c1 = torch.arange(seqlen_q, device=device, dtype=torch.int64).view(1, 1, seqlen_q, 1).expand(shape)
    c2 = (batch.view(-1, 1) * num_heads + torch.arange(num_heads, device=device, dtype=torch.int64)) & _MASK32
    c2 = c2.view(batch.numel(), num_heads, 1, 1).expand(shape)
    c3 = torch.full(shape, offset & _MASK32, device=device, dtype=torch.int64)
    words = torch.stack(philox4x32_10(c0, c1, c2, c3, seed), dim=-1)      # (B, H, Sq, groups, 4)
    return words.reshape(*shape[:3], groups * 4)[..., :seqlen_k] >= threshold


def scores(q, k, *, scale, softcap, alibi_slopes, window):
    """float32 scores (B, H, Sq, Sk) with cuflash's pipeline; hidden keys are -inf.

    q (B, Sq, Hq, D), k (B, Sk, Hk, D); ``alibi_slopes`` (B, Hq) or (Hq,) float32, or None;
    ``window`` (left, right) after causal was folded in (-1 = unbounded), around the bottom-right
    diagonal.
    """
    sq, hq = q.shape[1:3]
    sk, hk = k.shape[1:3]
    k = k.repeat_interleave(hq // hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.float(), k.float()) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    dist = (torch.arange(sq, device=q.device).view(sq, 1) + (sk - sq)
            - torch.arange(sk, device=q.device).view(1, sk))               # i + Sk - Sq - j
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().reshape(-1, hq, 1, 1)
        s = s - slopes * dist.abs()
    left, right = window
    hidden = torch.zeros_like(dist, dtype=torch.bool)
    if left >= 0:
        hidden |= dist > left
    if right >= 0:
        hidden |= dist < -right
    return s.masked_fill(hidden, float("-inf"))


def encode(s, lse, keep, block_n: int = BLOCK_N):
    """FA2's S_dmask values: float32 (..., Sq, Sk), see the module docstring.

    ``s`` float32 (..., Sq, Sk) scores, ``lse`` float32 (..., Sq) cuflash's, ``keep`` bool like
    ``s`` or None (no dropout: every element positive).
    """
    *lead, sq, sk = s.shape
    blocks = -(-sk // block_n)
    padded = torch.nn.functional.pad(s, (0, blocks * block_n - sk), value=float("-inf"))
    block_max = padded.view(*lead, sq, blocks, block_n).amax(dim=-1)
    running = torch.cummax(block_max.flip(-1), dim=-1).values.flip(-1)   # max over blocks >= J
    m = running.repeat_interleave(block_n, dim=-1)[..., :sk]
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.logsumexp(s, dim=-1)
    factor = torch.exp(total - lse)
    factor = torch.where(torch.isfinite(lse) & torch.isfinite(total), factor, torch.zeros_like(factor))
    values = torch.exp(s - m) * factor.unsqueeze(-1)
    return values if keep is None else torch.where(keep, values, -values)
