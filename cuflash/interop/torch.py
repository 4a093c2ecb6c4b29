"""PyTorch over cuflash: a direct autograd path, and ``torch.library`` custom ops (``ops``).

Two ways to call cuflash from torch, with the same semantics (those of :func:`cuflash.attention`;
BSHD layouts, torch's BHSD tensors can be passed as ``x.transpose(1, 2)`` views):

- **The direct path**, :func:`attention` and :func:`attention_varlen` here: ``torch.autograd.Function`` s
  that call cuflash with the least host work per call. Use it in eager mode (training or
  inference) when host time matters. ``torch.compile`` cannot trace it (a graph break around each
  call), and the memory cuflash allocates comes from CuPy's pool (returned to it when torch frees
  the tensors), so it does not belong in a ``torch.cuda.graph`` capture.
- **The custom ops**, ``cuflash.interop.torch.ops`` (:mod:`cuflash.interop._torch_ops`):
  ``ops.attention``, ``ops.attention_forward`` / ``ops.attention_backward``, ``ops.attention_varlen``,
  ``ops.decode``, ``ops.merge_states``, over ``torch.ops.cuflash.*`` registered with
  ``torch.library.custom_op`` (fake implementations and autograd formulas included). Use them under
  ``torch.compile`` (``fullgraph=True`` works: no graph break), ``torch.export``, and in
  ``torch.cuda.graph`` captures (decode in a serving loop): every allocation comes from torch's
  caching allocator. A call takes more host time than the direct path (torch's dispatcher and
  custom-op layer, the output allocations; not measured here).

Both run cuflash's kernels on torch's current stream of the inputs' device
(``cupy.cuda.Stream.from_external``), so they order with the surrounding torch work exactly as a
torch operator would, and both save q, k, v, out, lse and the dropout ``rng_state`` (two integers)
for the backward, never the probabilities. Importing this module imports torch and registers the ops.

Example
-------
>>> import torch, cuflash.interop.torch as ct
>>> q, k, v = (torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
...            for _ in range(3))
>>> out = ct.attention(q, k, v, causal=True)          # (2, 1024, 8, 64), layout (B, S, H, D)
>>> out.float().square().mean().backward()            # q.grad, k.grad, v.grad
>>> block = torch.compile(lambda q, k, v: ct.ops.attention(q, k, v, causal=True), fullgraph=True)

Tensor options of the direct path (``alibi_slopes``, ``mask``, ``bias``, ``block_mask``,
``cu_seqlens_*``) may be torch tensors; ``bias`` gets a gradient when it requires one.
"""

from __future__ import annotations

import torch

from ..attention import attention_forward, attention_varlen as _attention_varlen
from ..backward import attention_backward, attention_varlen_backward
from ..random import Generator, default_generator
from . import _torch_ops as ops
from ._torch_ring import ring_attention   # context parallelism (cuflash.distributed) as autograd
from ._torch_stream import on_torch_stream as _on_torch_stream

__all__ = ["attention", "attention_varlen", "ops", "ring_attention"]

_TENSOR_OPTIONS = ("alibi_slopes", "mask", "block_mask")


def _to_cupy(x):
    """The tensor without its autograd history (cuflash reads torch tensors directly on torch's
    current stream, and imports them through DLPack otherwise); other values pass through."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    return x


def _to_torch(x):
    return torch.from_dlpack(x)


def _check_cuda(*tensors):
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")


class _Attention(torch.autograd.Function):
    """out = attention(q, k, v, bias, **options); gradients for q, k, v and bias."""

    @staticmethod
    def forward(ctx, q, k, v, bias, options):
        forward_options = {n: val for n, val in options.items() if n != "deterministic"}
        with _on_torch_stream(q.device):
            tensor_options = {n: _to_cupy(forward_options.pop(n)) for n in _TENSOR_OPTIONS if n in forward_options}
            out, lse, rng_state = attention_forward(_to_cupy(q), _to_cupy(k), _to_cupy(v), bias=_to_cupy(bias),
                                                    **tensor_options, **forward_options)
            out_t, lse_t = _to_torch(out), _to_torch(lse)
        ctx.save_for_backward(q, k, v, out_t, lse_t, bias)
        ctx.rng_state = rng_state
        backward_options = {n: val for n, val in forward_options.items() if n != "generator"}
        ctx.options = dict(backward_options, deterministic=options.get("deterministic", False), **tensor_options)
        return out_t

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, bias = ctx.saved_tensors
        want_dbias = bias is not None and ctx.needs_input_grad[3]
        with _on_torch_stream(q.device):
            grads = attention_backward(_to_cupy(dout), _to_cupy(q), _to_cupy(k), _to_cupy(v), _to_cupy(out),
                                       _to_cupy(lse), bias=_to_cupy(bias), rng_state=ctx.rng_state,
                                       return_dbias=want_dbias, **ctx.options)
            grads = tuple(_to_torch(g) for g in grads)
        dbias = grads[3] if want_dbias else None
        return grads[0], grads[1], grads[2], dbias, None


class _AttentionVarlen(torch.autograd.Function):
    """out = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, ...); gradients for q, k, v."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options):
        options = dict(options)
        deterministic = options.pop("deterministic", False)
        generator = options.pop("generator", None) or default_generator()
        rng_state = None
        with _on_torch_stream(q.device):
            if options.get("dropout_p", 0.0) > 0:
                # attention_varlen does not return its rng_state: draw the call's state here and
                # hand the forward a private generator that holds exactly that state.
                rng_state = generator.next_state()
                call_generator = Generator(0)
                call_generator.set_state(rng_state)
            else:
                call_generator = None
            if "alibi_slopes" in options:
                options["alibi_slopes"] = _to_cupy(options["alibi_slopes"])
            cu_q, cu_k = _to_cupy(cu_seqlens_q), _to_cupy(cu_seqlens_k)
            out, lse = _attention_varlen(_to_cupy(q), _to_cupy(k), _to_cupy(v), cu_q, cu_k, max_seqlen_q=max_seqlen_q,
                                         max_seqlen_k=max_seqlen_k, generator=call_generator, return_lse=True,
                                         **options)
            out_t, lse_t = _to_torch(out), _to_torch(lse)
        ctx.save_for_backward(q, k, v, out_t, lse_t, cu_seqlens_q, cu_seqlens_k)
        ctx.rng_state = rng_state
        ctx.options = dict(options, deterministic=deterministic, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        return out_t

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        with _on_torch_stream(q.device):
            grads = attention_varlen_backward(_to_cupy(dout), _to_cupy(q), _to_cupy(k), _to_cupy(v), _to_cupy(out),
                                              _to_cupy(lse), _to_cupy(cu_q), _to_cupy(cu_k), rng_state=ctx.rng_state,
                                              **ctx.options)
            grads = tuple(_to_torch(g) for g in grads)
        return grads[0], grads[1], grads[2], None, None, None, None, None


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None, mask=None,
              bias=None, block_mask=None, block_size=(128, 128), dropout_p=0.0, generator=None,
              deterministic=False):
    """Differentiable :func:`cuflash.attention` for torch tensors (the direct autograd path).

    Runs cuflash's forward on torch's current stream of the inputs' device and saves q, k, v, out,
    lse and the dropout state for the backward (:func:`cuflash.attention_backward`), never the
    probabilities.

    Parameters
    ----------
    q : torch.Tensor (B, Sq, Hq, D)
        float16, bfloat16 or float32, on a CUDA device; BHSD tensors as ``x.transpose(1, 2)`` views.
    k : torch.Tensor (B, Sk, Hk, D)
    v : torch.Tensor (B, Sk, Hk, D)
        The dtype and device of q; ``Hq % Hk == 0`` (GQA/MQA).
    causal, scale, window, softcap, alibi_slopes, mask, bias, block_mask, block_size, dropout_p
        As in :func:`cuflash.attention`; array options may be torch tensors or CuPy arrays. ``bias``
        receives a gradient when it is a torch tensor that requires one (dL/dbias summed over the
        axes it was broadcast along; this materialises a float32 (B, Hq, Sq, Sk) buffer in the
        backward).
    generator : cuflash.Generator, optional
        Source of the dropout random numbers (default: cuflash's default generator); the state of
        this call is saved for the backward, which regenerates the same mask.
    deterministic : bool, default False
        Bitwise reproducible gradients (see :func:`cuflash.attention_backward`).

    Returns
    -------
    torch.Tensor (B, Sq, Hq, D)
        On the inputs' device, in their dtype; its backward gives dq, dk, dv (and dbias).

    Raises
    ------
    TypeError
        q, k or v not a ``torch.Tensor``, or any error of :func:`cuflash.attention`.
    ValueError
        q, k or v not on a CUDA device, or any error of :func:`cuflash.attention`.

    Notes
    -----
    ``torch.compile`` cannot trace this path (a graph break around each call), and its memory comes
    from CuPy's pool; under ``torch.compile``, ``torch.export`` or CUDA graphs use the custom ops
    ``cuflash.interop.torch.ops.attention``.

    Examples
    --------
    >>> import torch
    >>> import cuflash.interop.torch as ct
    >>> q, k, v = (torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ...            for _ in range(3))
    >>> out = ct.attention(q, k, v, causal=True)
    >>> out.float().square().mean().backward()           # fills q.grad, k.grad, v.grad
    """
    _check_cuda(("q", q), ("k", k), ("v", v))
    options = dict(causal=causal, scale=scale, window=window, softcap=softcap, block_size=block_size,
                   dropout_p=dropout_p, generator=generator, deterministic=deterministic)
    for name, value in (("alibi_slopes", alibi_slopes), ("mask", mask), ("block_mask", block_mask)):
        if value is not None:
            options[name] = value
    return _Attention.apply(q, k, v, bias, options)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                     scale=None, window=None, softcap=0.0, alibi_slopes=None, dropout_p=0.0, generator=None,
                     deterministic=False):
    """Differentiable :func:`cuflash.attention_varlen` for torch tensors (the direct autograd path).

    Parameters
    ----------
    q : torch.Tensor (total_q, Hq, D)
        float16, bfloat16 or float32, on a CUDA device.
    k : torch.Tensor (total_k, Hk, D)
    v : torch.Tensor (total_k, Hk, D)
        The dtype and device of q.
    cu_seqlens_q, cu_seqlens_k : int32 torch.Tensor (B + 1,) on the same device
        Offsets of the packed sequences (see :func:`cuflash.attention_varlen`).
    max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes, dropout_p, generator,
    deterministic
        As in :func:`cuflash.attention_varlen` and :func:`attention`.

    Returns
    -------
    torch.Tensor (total_q, Hq, D)
        Its backward gives dq, dk, dv.

    Raises
    ------
    TypeError
        An array argument that is not a ``torch.Tensor``, or any error of
        :func:`cuflash.attention_varlen`.
    ValueError
        An array argument not on a CUDA device, or any error of :func:`cuflash.attention_varlen`.

    Examples
    --------
    >>> import torch
    >>> import cuflash.interop.torch as ct
    >>> cu = torch.tensor([0, 100, 137, 649], device="cuda", dtype=torch.int32)
    >>> q, k, v = (torch.randn(649, 8, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    ...            for _ in range(3))
    >>> out = ct.attention_varlen(q, k, v, cu, cu, max_seqlen_q=512, max_seqlen_k=512, causal=True)
    >>> out.sum().backward()
    """
    _check_cuda(("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    options = dict(causal=causal, scale=scale, window=window, softcap=softcap, dropout_p=dropout_p,
                   generator=generator, deterministic=deterministic)
    if alibi_slopes is not None:
        options["alibi_slopes"] = alibi_slopes
    return _AttentionVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options)
