"""PyTorch over cuflash: one set of functions that works eagerly, under ``torch.compile`` and in CUDA graphs.

:func:`attention`, :func:`attention_varlen`, :func:`decode` and :func:`merge_states` take and
return torch tensors, with the semantics of :func:`cuflash.attention` and friends (BSHD layouts;
torch's BHSD tensors can be passed as ``x.transpose(1, 2)`` views). Each call takes one of two
routes, chosen per call:

- **Eager** (also inside ``torch.cuda.graph``, ``torch.utils.checkpoint`` and
  ``torch.autograd.grad``): a ``torch.autograd.Function`` that allocates its outputs with torch and
  has cuflash write them in place, on torch's current stream, with torch's caching allocator for
  whatever else cuflash allocates (:mod:`cuflash.interop._torch_stream`): the least host work per
  call, and memory that a captured graph keeps. Dropout under capture draws a fresh mask at every
  replay (:meth:`cuflash.Generator.graph_safe`).
- **While ``torch.compile`` traces** (``torch.compiler.is_compiling()``): the registered custom ops
  (``torch.ops.cuflash.*``, :mod:`cuflash.interop._torch_ops`), which Dynamo and AOTAutograd trace
  without a graph break (``fullgraph=True``, ``mode="reduce-overhead"``, ``torch.export``).

The ops stay public as ``cuflash.interop.torch.ops`` for those who want the op itself. Both routes
save q, k, v, out, lse and the dropout state for the backward, never the probabilities. Importing
this module imports torch and registers the ops.

Example
-------
>>> import torch, cuflash.interop.torch as ct
>>> q, k, v = (torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
...            for _ in range(3))
>>> out = ct.attention(q, k, v, causal=True)          # (2, 1024, 8, 64), layout (B, S, H, D)
>>> out.float().square().mean().backward()            # q.grad, k.grad, v.grad
>>> block = torch.compile(lambda q, k, v: ct.attention(q, k, v, causal=True), fullgraph=True)

Tensor options (``alibi_slopes``, ``mask``, ``bias``, ``block_mask``, ``cu_seqlens_*``,
``cache_seqlens``, ``block_table``, ``sinks``) are torch tensors; ``bias`` and ``sinks`` (attention sinks,
float32 (Hq,)) get a gradient when they require one.
``score_mod=`` / ``mask_mod=`` (:class:`cuflash.ScoreMod`, :class:`cuflash.MaskMod`, their arrays torch
tensors) work eagerly, in CUDA graphs and under ``torch.compile`` (the op carries each modifier as a
string and its arrays as tensors; make the modifiers outside the compiled function).
"""

from __future__ import annotations

import torch

from .._checks import check_flag as _check_flag
from ..attention import _forward as _cf_forward, attention_varlen as _cf_attention_varlen
from ..backward import _backward as _cf_backward, attention_varlen_backward as _cf_attention_varlen_backward
from ..decode import _decode as _cf_decode_body, decode as _cf_decode
from ..merge import merge_states as _cf_merge_states
from ..random import Generator, default_generator
from . import _torch_ops as ops
from ._torch_autograd import direct_apply as _direct_apply
from ._torch_ops import _dense_like
from ._torch_ring import ring_attention   # context parallelism (cuflash.distributed) as autograd
from ._torch_stream import as_torch as _as_torch, replay as _replay, torch_call as _torch_call

__all__ = ["attention", "attention_varlen", "decode", "merge_states", "ops", "ring_attention"]

_compiling = torch.compiler.is_compiling   # Dynamo folds it to True while tracing
_bump_versions = torch.autograd.graph.increment_version


def _new_out(q, v):
    """attention's output: q's shape with v's head dim (a value head dim of its own, issue 53)."""
    return _dense_like(q) if v.shape[-1] == q.shape[-1] else q.new_empty(ops._out_shape(q, v))


def _needs_grad(q, k, v, bias, sinks=None) -> bool:
    """Whether autograd must record the call (grad mode on and an input that requires grad)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (bias is not None and bias.requires_grad)
                                        or (sinks is not None and sinks.requires_grad))


def _check_cuda(*tensors):
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")


def _forward_into(q, k, v, out, lse, bias, sinks, options, generator, lse_output, rng_output):
    """cuflash's attention forward of ``options`` (see :func:`attention`) into out (and lse) on torch's
    stream: (out, lse, rng_state) as :func:`cuflash.attention_forward` returns them. A call without
    modifiers that repeats a remembered plan takes :func:`~._torch_stream.replay`, the rest
    :class:`~._torch_stream.torch_call`."""
    causal, scale, window, softcap, block_size, dropout_p, alibi_slopes, mask, block_mask, score_mod, mask_mod = options
    operands = (q, k, v, out, lse, alibi_slopes, mask, bias, block_mask, sinks)
    if score_mod is None and mask_mod is None:
        made = _replay(_cf_forward, operands, causal, scale, window, softcap, block_size, dropout_p, generator,
                       lse_output, rng_output, (0, 0), None, (None, None), True)
        if made is not None:
            return made
    with _torch_call(q.device):
        return _cf_forward(operands, causal, scale, window, softcap, block_size, dropout_p, generator, lse_output,
                           rng_output, (0, 0), None, (score_mod, mask_mod))


def _backward_into(dout, q, k, v, out, lse, bias, sinks, options, rng_state, deterministic, return_dbias,
                   return_dsinks, dq, dk, dv, dlse):
    """cuflash's attention backward of ``options`` into dq, dk, dv on torch's stream, as
    :func:`cuflash.attention_backward` returns it (the same two routes as :func:`_forward_into`)."""
    causal, scale, window, softcap, block_size, dropout_p, alibi_slopes, mask, block_mask, score_mod, mask_mod = options
    args = (dout, q, k, v, out, lse, rng_state, causal, scale, window, softcap, alibi_slopes, mask, bias, block_mask,
            block_size, dropout_p, score_mod, mask_mod, sinks, deterministic, return_dbias, return_dsinks, dq, dk,
            dv, dlse)
    if score_mod is None and mask_mod is None:
        grads = _replay(_cf_backward, *args, True)
        if grads is not None:
            return grads
    with _torch_call(q.device):
        return _cf_backward(*args)


class _Attention(torch.autograd.Function):
    """out (and lse) = attention(q, k, v, bias, sinks) with ``options`` as :func:`attention` lays them out;
    gradients for q, k, v, bias and sinks, through out and, with ``return_lse``, lse."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, options, generator, deterministic, return_lse=False):
        # torch allocates the outputs and cuflash writes them: no DLPack exchange per call, and
        # memory that a torch.cuda.graph capture keeps in its pool.
        out = _new_out(q, v)
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32) if q.dim() == 4 else None
        rng_state = _forward_into(q, k, v, out, lse, bias, sinks, options, generator, True, True)[2]
        ctx.save_for_backward(q, k, v, out, lse, bias, sinks)
        ctx.rng_state, ctx.options, ctx.deterministic = rng_state, options, deterministic
        if not return_lse:
            return out
        ctx.set_materialize_grads(False)   # lse's gradient None when the loss does not read it: no dlse
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse=None):
        q, k, v, out, lse, bias, sinks = ctx.saved_tensors
        if dout is None:   # the loss reads lse alone
            dout = torch.zeros_like(out)
        want_dbias = bias is not None and ctx.needs_input_grad[3]
        want_dsinks = sinks is not None and ctx.needs_input_grad[4]
        dq, dk, dv = _dense_like(q), _dense_like(k), _dense_like(v)
        grads = _backward_into(dout, q, k, v, out, lse, bias, sinks, ctx.options, ctx.rng_state, ctx.deterministic,
                               want_dbias, want_dsinks, dq, dk, dv, dlse)
        if not (want_dbias or want_dsinks):
            return dq, dk, dv, None, None, None, None, None, None
        extra = list(grads[3:])
        dbias = _as_torch(extra.pop(0)) if want_dbias else None
        dsinks = _as_torch(extra.pop(0)) if want_dsinks else None
        return dq, dk, dv, dbias, dsinks, None, None, None, None


class _AttentionVarlen(torch.autograd.Function):
    """out = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks=sinks, ...); gradients for q, k, v
    and sinks."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options):
        options = dict(options)
        deterministic = options.pop("deterministic", False)
        generator = options.pop("generator", None) or default_generator()
        rng_state = None
        if options.get("dropout_p", 0.0) > 0:
            # attention_varlen does not return its rng_state: draw the call's state here and hand
            # the forward a private generator that holds exactly that state.
            rng_state = generator.next_state()
            generator = Generator(0)
            generator.set_state(rng_state)
        out = _new_out(q, v)
        with _torch_call(q.device):
            _, lse = _cf_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                          max_seqlen_k=max_seqlen_k, generator=generator, return_lse=True,
                                          out=out, sinks=sinks, **options)
            lse = _as_torch(lse)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks)
        ctx.rng_state = rng_state
        ctx.options = dict(options, deterministic=deterministic, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
        want_dsinks = sinks is not None and ctx.needs_input_grad[3]
        dq, dk, dv = _dense_like(q), _dense_like(k), _dense_like(v)
        with _torch_call(q.device):
            grads = _cf_attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, rng_state=ctx.rng_state, dq=dq,
                                                  dk=dk, dv=dv, sinks=sinks, return_dsinks=want_dsinks, **ctx.options)
            dsinks = _as_torch(grads[3]) if want_dsinks else None
        return dq, dk, dv, dsinks, None, None, None, None, None


_attention_apply = _direct_apply(_Attention)
_attention_varlen_apply = _direct_apply(_AttentionVarlen)


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None, mask=None,
              bias=None, block_mask=None, block_size=(128, 128), dropout_p=0.0, generator=None,
              deterministic=False, score_mod=None, mask_mod=None, sinks=None, return_lse=False):
    """Differentiable :func:`cuflash.attention` for torch tensors: eager, compiled or captured.

    Runs cuflash's forward on torch's current stream of the inputs' device and saves q, k, v, out,
    lse and the dropout state for the backward (:func:`cuflash.attention_backward`), never the
    probabilities. While ``torch.compile`` traces it, it becomes the custom op
    ``torch.ops.cuflash.attention_forward`` (no graph break).

    Parameters
    ----------
    q : torch.Tensor (B, Sq, Hq, D)
        float16, bfloat16 or float32, on a CUDA device; BHSD tensors as ``x.transpose(1, 2)`` views.
    k : torch.Tensor (B, Sk, Hk, D)
    v : torch.Tensor (B, Sk, Hk, D_v)
        The dtype and device of q; ``Hq % Hk == 0`` (GQA/MQA). D_v may differ from D (DeepSeek's
        (192, 128)): out and its gradient then have D_v columns.
    causal, scale, window, softcap, alibi_slopes, mask, bias, block_mask, block_size, dropout_p
        As in :func:`cuflash.attention`; array options are torch tensors. ``bias`` receives a
        gradient when it requires one (dL/dbias summed over the axes it was broadcast along; this
        materialises a float32 (B, Hq, Sq, Sk) buffer in the backward).
    generator : cuflash.Generator, optional
        Source of the dropout random numbers (default: cuflash's default generator); the state of
        this call is saved for the backward, which regenerates the same mask. Eager mode only:
        under ``torch.compile`` seed the default generator (:func:`cuflash.manual_seed`).
    deterministic : bool, default False
        Bitwise reproducible gradients (see :func:`cuflash.attention_backward`).
    score_mod, mask_mod : cuflash.ScoreMod, cuflash.MaskMod, optional
        As in :func:`cuflash.attention`, in eager mode (and CUDA graphs); their array arguments may be
        torch tensors, read at each call. Gradients flow to q, k, v (and to ``bias`` beside a MaskMod
        alone), not to the modifiers' arrays: one that requires a gradient is refused while autograd
        records. A ScoreMod whose derivative is not 1 needs its ``grad`` when the call is
        differentiated. Under ``torch.compile`` too (made outside the compiled function; a MaskMod then
        derives no block mask: the graph's inputs may be refilled at the same address).
    sinks : float32 torch.Tensor (Hq,), optional
        Attention sinks (gpt-oss), as in :func:`cuflash.attention`: each row's softmax denominator
        gains ``exp(sinks[h])``, with no value. Receives a gradient when it requires one (the backward
        asks :func:`cuflash.attention_backward` for ``return_dsinks``); eager, compiled and captured.
    return_lse : bool, default False
        Also return the log-sum-exp of every row, float32 (B, Hq, Sq). Differentiable: a loss that
        reads it (merged partial results, :func:`merge_states`; a penalty on large lse) reaches q, k
        (and bias, sinks) through :func:`cuflash.attention_backward`'s ``dlse``.

    Returns
    -------
    out : torch.Tensor (B, Sq, Hq, D_v)
        C-contiguous, on the inputs' device, in their dtype; its backward gives dq, dk, dv (and dbias,
        dsinks).
    lse : float32 torch.Tensor (B, Hq, Sq)
        Only with ``return_lse``.

    Raises
    ------
    TypeError
        q, k or v not a ``torch.Tensor``, or any error of :func:`cuflash.attention`.
    ValueError
        q, k or v not on a CUDA device, a modifier's tensor that requires a gradient, or any error of
        :func:`cuflash.attention`.

    Notes
    -----
    CUDA graphs: a call inside ``torch.cuda.graph`` needs no warm-up on the capture stream (one
    anywhere moves compiling and planning out of the capture); the outputs come from the graph's
    memory pool, and dropout draws a fresh mask at every replay.

    Examples
    --------
    >>> import torch
    >>> import cuflash.interop.torch as ct
    >>> q, k, v = (torch.randn(2, 1024, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ...            for _ in range(3))
    >>> out = ct.attention(q, k, v, causal=True)
    >>> out.float().square().mean().backward()           # fills q.grad, k.grad, v.grad
    """
    if _compiling():
        return ops.attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                             alibi_slopes=alibi_slopes, mask=mask, bias=bias, block_mask=block_mask,
                             block_size=block_size, dropout_p=dropout_p, generator=generator,
                             deterministic=deterministic, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks,
                             return_lse=return_lse)
    _check_cuda(("q", q), ("k", k), ("v", v))
    if sinks is not None:
        _check_cuda(("sinks", sinks))
    return_lse = _check_flag(return_lse, "return_lse")
    if score_mod is not None or mask_mod is not None:
        mods = ops._modifiers(score_mod, mask_mod, backward=_needs_grad(q, k, v, bias, sinks))
        ops._check_dbias_beside(score_mod, bias, softcap)
        score_mod, mask_mod = mods.get("score_mod"), mods.get("mask_mod")
    # The options as cuflash's call bodies take them, in the order _forward_into unpacks.
    options = (causal, scale, window, softcap, block_size, dropout_p, alibi_slopes, mask, block_mask, score_mod,
               mask_mod)
    if _needs_grad(q, k, v, bias, sinks):
        return _attention_apply(q, k, v, bias, sinks, options, generator, deterministic, return_lse)
    # Nothing to differentiate (inference, torch.no_grad): no autograd node, no lse kept.
    out = _new_out(q, v)
    if return_lse:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        _forward_into(q, k, v, out, lse, bias, sinks, options, generator, True, True)
        return out, lse
    _forward_into(q, k, v, out, None, bias, sinks, options, generator, False, False)
    return out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                     scale=None, window=None, softcap=0.0, alibi_slopes=None, dropout_p=0.0, generator=None,
                     deterministic=False, score_mod=None, mask_mod=None, sinks=None, cache_seqlens=None,
                     block_table=None):
    """Differentiable :func:`cuflash.attention_varlen` for torch tensors: eager, compiled or captured.

    Parameters
    ----------
    q : torch.Tensor (total_q, Hq, D)
        float16, bfloat16 or float32, on a CUDA device.
    k : torch.Tensor (total_k, Hk, D)
    v : torch.Tensor (total_k, Hk, D_v)
        The dtype and device of q (D_v as in :func:`attention`).
    cu_seqlens_q, cu_seqlens_k : int32 torch.Tensor (B + 1,) on the same device
        Offsets of the packed sequences (see :func:`cuflash.attention_varlen`); never read on the host.
    max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes, dropout_p, generator,
    deterministic, score_mod, mask_mod, sinks
        As in :func:`cuflash.attention_varlen` and :func:`attention` (the modifiers' positions within
        each sequence, eager mode only; ``sinks`` gets a gradient when it requires one).
    cache_seqlens, block_table : int32 torch.Tensor (B,) and (B, max_pages), optional
        Chunked prefill, as in :func:`cuflash.attention_varlen`: ``k`` and ``v`` are the KV caches
        (contiguous (B, L, Hk, D) or paged) that already hold each sequence's new tokens, and
        ``cu_seqlens_k`` is None. Inference only (no backward: a call that needs a gradient is a
        ValueError); eager, compiled and captured.

    Returns
    -------
    torch.Tensor (total_q, Hq, D_v)
        Its backward gives dq, dk, dv (and dsinks).

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
    if _compiling():
        return ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                    max_seqlen_k=max_seqlen_k, causal=causal, scale=scale, window=window,
                                    softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                    generator=generator, deterministic=deterministic, score_mod=score_mod,
                                    mask_mod=mask_mod, sinks=sinks, cache_seqlens=cache_seqlens,
                                    block_table=block_table)
    cache = cache_seqlens is not None or block_table is not None
    _check_cuda(("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                *((("cu_seqlens_k", cu_seqlens_k),) if not cache or cu_seqlens_k is not None else ()),
                *((name, x) for name, x in (("cache_seqlens", cache_seqlens), ("block_table", block_table))
                  if x is not None))
    if sinks is not None:
        _check_cuda(("sinks", sinks))
    grad = _needs_grad(q, k, v, None, sinks)
    if cache and grad:
        raise ValueError(ops._NO_CACHE_GRAD)
    mods = ops._modifiers(score_mod, mask_mod, backward=grad) or {}
    if cache:
        mods = dict(mods, cache_seqlens=cache_seqlens, block_table=block_table)
    if grad:
        options = dict(causal=causal, scale=scale, window=window, softcap=softcap, dropout_p=dropout_p,
                       generator=generator, deterministic=deterministic, alibi_slopes=alibi_slopes, **mods)
        return _attention_varlen_apply(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       options)
    out = _new_out(q, v)
    with _torch_call(q.device):
        _cf_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                             causal=causal, scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                             dropout_p=dropout_p, generator=generator, out=out, sinks=sinks, **mods)
    return out


def decode(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, k_new=None, v_new=None, num_splits=0,
           causal=True, window=None, softcap=0.0, alibi_slopes=None, scale=None, mask=None, return_lse=False,
           out=None, score_mod=None, mask_mod=None, sinks=None, k_scale=None, v_scale=None, v_head_dim=None):
    """:func:`cuflash.decode` for torch tensors: eager, compiled or captured (a serving loop's graph).

    Parameters
    ----------
    q : torch.Tensor (B, Sq_new, Hq, D)
        float16, bfloat16 or float32, on a CUDA device.
    k_cache, v_cache : torch.Tensor
        (B, L, Hk, D), or paged (num_pages, page_size, Hk, D) with ``block_table``; ``k_new`` /
        ``v_new`` are appended into them in place (their version counters move, as for torch's
        in-place ops). q's dtype, or ``torch.float8_e4m3fn`` (an fp8
        cache, :func:`cuflash.decode`'s ``kv_dtype="float8_e4m3fn"`` on its bytes; q float16 or
        bfloat16, ``k_new`` / ``v_new`` in q's dtype, quantised as they are appended).
    cache_seqlens, block_table, k_new, v_new, num_splits, causal, window, softcap, alibi_slopes, scale, mask
        As in :func:`cuflash.decode`, as torch tensors (``cache_seqlens`` and ``block_table`` int32
        on the GPU, never read on the host).
    return_lse : bool, default False
        Also return the float32 (B, Hq, Sq_new) log-sum-exp (to merge with other partial states).
    out : torch.Tensor (B, Sq_new, Hq, D), optional
        C-contiguous, q's dtype: written in place (its version counter moves); otherwise allocated by
        torch.
    score_mod, mask_mod : cuflash.ScoreMod, cuflash.MaskMod, optional
        As in :func:`cuflash.decode` (absolute positions in each sequence), in eager mode and CUDA
        graphs and under ``torch.compile``; their array arguments may be torch tensors.
    sinks : float32 torch.Tensor (Hq,), optional
        Attention sinks, as in :func:`cuflash.decode` (an empty sequence's rows: out 0, lse = sinks[h]);
        eager, compiled and captured (read at each call or replay). Decode has no backward.
    k_scale, v_scale : float or float32 torch.Tensor (one element, or (Hk,) one per kv head), optional
        The fp8 caches' scales (required with them): a float or a host tensor of one element is a
        number fixed at the call (or at capture); a CUDA tensor is read at each call or replay.
    v_head_dim : int, optional
        MLA: with ``v_cache=None``, the values are the first ``v_head_dim`` columns of ``k_cache``'s
        576-column latent rows (``k_new`` the appended latent rows), and out has ``v_head_dim``
        columns, as in :func:`cuflash.decode`.

    Returns
    -------
    torch.Tensor (B, Sq_new, Hq, D) (D = ``v_head_dim`` for MLA), or (out, lse) when ``return_lse``.

    Raises
    ------
    TypeError, ValueError
        An array argument that is not a CUDA ``torch.Tensor``, or any error of :func:`cuflash.decode`.

    Examples
    --------
    >>> import torch
    >>> import cuflash.interop.torch as ct
    >>> k_cache, v_cache = (torch.randn(4, 4096, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    >>> lens = torch.full((4,), 1000, device="cuda", dtype=torch.int32)
    >>> q, k_new, v_new = (torch.randn(4, 1, n, 128, device="cuda", dtype=torch.bfloat16) for n in (32, 8, 8))
    >>> out = ct.decode(q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new, v_new=v_new)   # (4, 1, 32, 128)
    """
    if _compiling():
        return ops.decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k_new=k_new,
                          v_new=v_new, num_splits=num_splits, causal=causal, window=window, softcap=softcap,
                          alibi_slopes=alibi_slopes, scale=scale, mask=mask, return_lse=return_lse, out=out,
                          score_mod=score_mod, mask_mod=mask_mod, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                          v_head_dim=v_head_dim)
    _check_cuda(("q", q), ("k_cache", k_cache), *((("v_cache", v_cache),) if v_cache is not None else ()))
    if sinks is not None:
        _check_cuda(("sinks", sinks))
    caches = k_cache, v_cache
    if (k_scale is None and v_scale is None and k_cache.dtype == q.dtype
            and (v_cache is None or v_cache.dtype == q.dtype)):
        cache_options = {}   # caches in q's dtype: nothing to view or convert
    else:
        k_cache, v_cache, cache_options = ops.decode_cache_arguments(k_cache, v_cache, k_scale, v_scale)
    mods = ops._modifiers(score_mod, mask_mod) or {}
    given = out
    if out is None:
        own_dim = v_head_dim is not None or (v_cache is not None and v_cache.shape[-1] != q.shape[-1])
        out = q.new_empty(ops._decode_out_shape(q, v_cache, v_head_dim)) if own_dim and q.dim() == 4 \
            else _dense_like(q)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32) if return_lse and q.dim() == 4 \
        else None
    # Caches in q's dtype and no modifiers (most calls): a repeat call replays its plan with no torch_call
    # (_torch_stream.replay; the same route as attention's).
    replayed = not (mods or cache_options) and _replay(
        _cf_decode_body, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, num_splits, causal, window,
        softcap, alibi_slopes, scale, mask, None, None, sinks, None, None, None, v_head_dim, False, out, lse, None,
        True) is not None
    if not replayed:
        if v_head_dim is not None:
            cache_options["v_head_dim"] = v_head_dim
        with _torch_call(q.device):
            _cf_decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k_new=k_new,
                       v_new=v_new, num_splits=num_splits, causal=causal, window=window, softcap=softcap,
                       alibi_slopes=alibi_slopes, scale=scale, mask=mask, out=out, lse=lse, sinks=sinks, **mods,
                       **cache_options)
    # Tensors written in place get their version counters moved, as torch's in-place ops do (autograd
    # then refuses a saved tensor that was written since): the caches when rows were appended, out.
    if k_new is not None:
        _bump_versions(tuple(x for x in caches if x is not None))
    if given is not None:
        _bump_versions(given)
    return (out, lse) if return_lse else out


def _merge_needs_grad(outs, lses) -> bool:
    parts = (list(outs) if isinstance(outs, (list, tuple)) else [outs]) + (
        list(lses) if isinstance(lses, (list, tuple)) else [lses])
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in parts)


def merge_states(outs, lses):
    """:func:`cuflash.merge_states` for torch tensors: eager, compiled or captured.

    Differentiable with respect to ``outs`` and ``lses``: with the differentiable lse of
    ``attention(..., return_lse=True)``, merged partial results train as one call.

    Parameters
    ----------
    outs : torch.Tensor (n, B, S, H, D), or a sequence of n tensors (B, S, H, D)
        Attention results over disjoint key sets.
    lses : float32 torch.Tensor (n, B, H, S), or a sequence of n tensors (B, H, S)
        Their log-sum-exps.

    Returns
    -------
    out : torch.Tensor (B, S, H, D), the dtype of ``outs[0]``
    lse : float32 torch.Tensor (B, H, S)

    Raises
    ------
    TypeError, ValueError
        Any error of :func:`cuflash.merge_states`.

    Examples
    --------
    >>> import torch
    >>> import cuflash.interop.torch as ct
    >>> o1, lse1 = ct.ops.attention(q, k1, v1, return_lse=True)
    >>> o2, lse2 = ct.ops.attention(q, k2, v2, return_lse=True)
    >>> out, lse = ct.merge_states([o1, o2], [lse1, lse2])      # attention over k1 and k2
    """
    if _compiling() or _merge_needs_grad(outs, lses):   # the op's autograd gives d outs and d lses
        return ops.merge_states(outs, lses)
    first = outs[0]
    _check_cuda(("outs", first))
    shape = first.shape
    out = _dense_like(first)
    lse = first.new_empty((shape[0], shape[2], shape[1]), dtype=torch.float32) if len(shape) == 4 else None
    with _torch_call(first.device):
        _cf_merge_states(outs, lses, out=out, lse=lse)
    return out, lse
