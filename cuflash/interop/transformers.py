"""Hugging Face transformers over cuflash: ``register()``, then ``attn_implementation="cufa"``.

transformers picks a model's attention through two registries, both keyed by the name in
``config._attn_implementation``: ``AttentionInterface`` (the function each attention layer calls)
and ``AttentionMaskInterface`` (the function that builds the mask once per forward). :func:`register`
puts cuflash in both; registering only the attention function would leave transformers building no
mask at all for the name, and a padded batch would attend to its padding.

- :func:`attention_forward`: the layers' attention. q, k, v arrive as (B, H, S, D); cuflash reads
  them as (B, S, H, D) ``transpose(1, 2)`` views (no copy), with GQA done natively (no repeated
  kv heads), through :func:`cuflash.interop.torch.attention` or ``attention_varlen`` (autograd).
- :func:`attention_mask`: a padding mask becomes the real tokens packed for ``attention_varlen``
  (prefill, training) or a broadcast key mask (decode steps); no padding and causal: no mask at all
  (:mod:`cuflash.interop._transformers_masks`).

``sliding_window`` (transformers: a query sees itself and ``sliding_window - 1`` keys before it)
is cuflash's ``window=(sliding_window - 1, 0)``; ``softcap``, ``scaling`` and ``dropout`` map to
cuflash's options of those names. Importing this module imports torch and transformers.

The name is "cufa", not "cuflash": transformers 5 takes every implementation name that contains
"flash" for a flash-attention build (``utils.generic.is_flash_attention_requested``) and
``set_attn_implementation`` then tries to import one by that name and fails; :func:`register`
refuses such names.

Example
-------
>>> import cuflash.interop.transformers as cft
>>> cft.register()
>>> model.set_attn_implementation("cufa")             # or from_pretrained(..., attn_implementation="cufa")
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from . import torch as _cuflash_torch
from ._transformers_masks import CuflashMask, attention_mask

__all__ = ["register", "attention_forward", "attention_mask", "CuflashMask", "NAME"]

NAME = "cufa"   # no "flash" in it: see the module docstring


def register(name=NAME):
    """Register cuflash with transformers under ``name`` (the attention and the mask function).

    Parameters
    ----------
    name : str, default "cufa"
        The ``attn_implementation`` to use: ``model.set_attn_implementation(name)`` or
        ``from_pretrained(..., attn_implementation=name)``. It may not contain "flash" (any case).

    Returns
    -------
    str
        ``name``.

    Raises
    ------
    ValueError
        A name containing "flash": transformers would treat it as a flash-attention build.

    Examples
    --------
    >>> import transformers
    >>> import cuflash.interop.transformers as cft
    >>> cft.register()
    'cufa'
    >>> config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
    ...                                   intermediate_size=1024, num_hidden_layers=2, vocab_size=1000)
    >>> model = transformers.LlamaForCausalLM(config).cuda().bfloat16()
    >>> model.set_attn_implementation("cufa")
    """
    if "flash" in name.lower():
        raise ValueError(f"cuflash: {name!r} contains 'flash', and transformers takes any such attn_implementation "
                         "for a flash-attention build it then tries to import; choose another name (default 'cufa')")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


def _window(sliding_window, causal):
    if sliding_window is None:
        return None
    # Causal: itself and sliding_window - 1 keys before. Non-causal: transformers' flash attention
    # path's symmetric (w - 1, w - 1), the only non-causal window a model reaches with mask None.
    return (sliding_window - 1, 0) if causal else (sliding_window - 1, sliding_window - 1)


def _check_mask_registered(module):
    """Refuse a None mask under a name whose mask function transformers does not know: there it
    builds no mask at all, and a padded batch would silently attend to its padding."""
    config = getattr(module, "config", None)
    name = getattr(config, "_attn_implementation", None)
    if name is not None and name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        raise RuntimeError(f"cuflash: attn_implementation {name!r} has an attention function but no mask function, "
                           "so padding masks are dropped; register both with cuflash.interop.transformers."
                           f"register({name!r})")


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      softcap=None, is_causal=None, **kwargs):
    """The attention function registered for cuflash in transformers' ``AttentionInterface``.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention layer (its ``is_causal`` and ``config`` are read).
    query : torch.Tensor (B, Hq, Sq, D)
    key : torch.Tensor (B, Hk, Sk, D)
    value : torch.Tensor (B, Hk, Sk, D)
        CUDA, float16, bfloat16 or float32, any strides; ``Hq % Hk == 0``.
    attention_mask : None, CuflashMask or torch.Tensor
        What :func:`attention_mask` built: None (causal per ``is_causal``, bottom-right aligned), a
        :class:`CuflashMask`, or a 4-d tensor broadcastable to (B, Hq, Sq, Sk): bool (True = may
        attend) as cuflash's ``mask``, floating as an additive ``bias``. Anything else raises.
    scaling : float, optional
        Multiplies ``q . k`` (default ``1 / sqrt(D)``).
    dropout : float, default 0.0
        Dropout on the probabilities (cuflash's generator, not torch's).
    sliding_window : int, optional
        A query sees itself and the ``sliding_window - 1`` keys before it.
    softcap : float, optional
        ``s = softcap * tanh(s / softcap)`` (Gemma 2); None or 0 is off.
    is_causal : bool, optional
        With a None mask: causal or not (default: ``module.is_causal``, else True).
    **kwargs
        Other arguments of the model's forward (``position_ids``, ...), not used.

    Returns
    -------
    attn_output : torch.Tensor (B, Sq, Hq, D)
        Rows of padding tokens are 0 (they see no key under varlen).
    attn_weights : None
        cuflash never forms the probabilities.

    Raises
    ------
    TypeError
        An ``attention_mask`` of a form this function does not know (a 2-d padding mask, a flex
        ``BlockMask``, ...).
    ValueError
        A :class:`CuflashMask` built for other shapes, or a ``sliding_window`` that disagrees with it.
    RuntimeError
        A None mask under an implementation name with no registered mask function.

    Examples
    --------
    >>> import torch
    >>> from cuflash.interop.transformers import attention_forward
    >>> q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16)   # (B, H, S, D)
    >>> k = v = torch.randn(2, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    >>> out, _ = attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True)
    >>> out.shape                                                              # (B, S, H, D)
    torch.Size([2, 128, 8, 64])
    """
    options = dict(scale=scaling, softcap=float(softcap or 0.0), dropout_p=float(dropout or 0.0))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)   # BSHD views

    if attention_mask is None:
        _check_mask_registered(module)
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        return _cuflash_torch.attention(q, k, v, causal=causal, window=_window(sliding_window, causal),
                                        **options), None

    if isinstance(attention_mask, CuflashMask):
        return _run_cuflash_mask(attention_mask, q, k, v, sliding_window, options), None

    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 4:
        # A complete mask (transformers' dense fallback, or one the caller built): no causal flag.
        form = "mask" if attention_mask.dtype == torch.bool else "bias"
        return _cuflash_torch.attention(q, k, v, window=_window(sliding_window, False),
                                        **{form: attention_mask}, **options), None

    shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else None
    raise TypeError(f"cuflash: attention_mask of type {type(attention_mask).__name__}"
                    f"{f' and shape {shape}' if shape else ''} is not a form cuflash runs (None, CuflashMask, or a "
                    "4-d bool/float tensor); was the mask built by another attn_implementation's mask function? "
                    "Call cuflash.interop.transformers.register() to register both functions")


def _run_cuflash_mask(m: CuflashMask, q, k, v, sliding_window, options):
    """q (B, Sq, Hq, D), k and v (B, Sk, Hk, D) views under one forward's CuflashMask."""
    if (q.shape[0], q.shape[1], k.shape[1]) != (m.batch_size, m.q_length, m.kv_length):
        raise ValueError(f"cuflash: the mask was built for batch {m.batch_size}, {m.q_length} queries and "
                         f"{m.kv_length} keys; this layer has batch {q.shape[0]}, {q.shape[1]} queries and "
                         f"{k.shape[1]} keys")
    if sliding_window is not None and sliding_window != m.window:
        raise ValueError(f"cuflash: the layer's sliding_window={sliding_window} differs from the mask's window "
                         f"{m.window}")
    window = _window(m.window, m.causal)
    k, v = k[:, :m.kv_used], v[:, :m.kv_used]
    if m.varlen is None:
        return _cuflash_torch.attention(q, k, v, causal=m.causal, window=window, mask=m.key_mask, **options)
    p = m.varlen
    # One gather each straight from the strided (B, S, H, D) views into (total, H, D).
    out = _cuflash_torch.attention_varlen(q[p.batch_q, p.seq_q], k[p.batch_k, p.seq_k], v[p.batch_k, p.seq_k],
                                          p.cu_seqlens_q, p.cu_seqlens_k, max_seqlen_q=p.max_seqlen_q,
                                          max_seqlen_k=p.max_seqlen_k, causal=m.causal, window=window, **options)
    return torch.index_put(out.new_zeros(q.shape), (p.batch_q, p.seq_q), out)
