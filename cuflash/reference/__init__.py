"""Float64 host reference for attention, written from the definitions (no tiling).

This module is what every kernel is compared with. It computes, for each batch ``b``, query
head ``h`` and row ``i``:

1. the scores ``s[b, h, i, :]`` (:func:`attention_scores`): ``scale * q.k``; softcap
   ``c * tanh(s / c)``; minus ALiBi ``slope * |i + Sk - Sq - j|``; plus ``bias``; then every mask
   (causal, window, ``mask``, ``block_mask``) sets ``s = -inf``;
2. ``lse = log(sum_j exp(s_ij))`` and ``p = exp(s - lse)`` over the keys the row sees
   (``s_ij != -inf``); a row that sees no key gets ``out = 0`` and ``lse = -inf``;
3. dropout (``keep`` from :func:`cuflash.random.dropout_keep`) and ``out = sum_j keep_ij *
   p_ij / (1 - dropout_p) * v_j`` over the keys the row sees.

A key the row does not see contributes nothing, even if its ``k``/``v``/``bias`` hold NaN or
Inf; a NaN in anything the row sees makes the row NaN (IEEE arithmetic, nothing is dropped).

Inputs may be NumPy arrays of any float dtype (``ml_dtypes.bfloat16`` included), CuPy arrays
(copied to the host) or anything with ``__array__``; everything is computed in float64.
"""

from ._backward import attention_backward, attention_varlen_backward
from ._decode import decode
from ._forward import attention_forward, attention_scores, attention_varlen, merge_states

__all__ = ["attention_forward", "attention_scores", "attention_varlen", "decode", "merge_states",
           "attention_backward", "attention_varlen_backward"]
