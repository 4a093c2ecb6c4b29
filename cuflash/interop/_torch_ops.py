"""cuflash as ``torch.library`` custom ops: traceable by ``torch.compile``, capturable by ``torch.cuda.graph``.

Imported by :mod:`cuflash.interop.torch`, which exposes this module as ``cuflash.interop.torch.ops``.
Importing it registers, in the namespace ``cuflash`` (``torch.ops.cuflash.<name>``):

    attention_forward(q, k, v, alibi_slopes=None, mask=None, bias=None, block_mask=None, rng_state=None,
                      causal=False, scale=None, window_left=-1, window_right=-1, softcap=0.0, block_q=128,
                      block_k=128, dropout_p=0.0, deterministic=False, sinks=None, score_mod=None,
                      mask_mod=None, mod_arrays=None) -> (out, lse, rng_state)
    attention_backward(dout, q, k, v, out, lse, rng_state, alibi_slopes=None, mask=None, bias=None,
                       block_mask=None, <the options>, deterministic=False, return_dbias=False, sinks=None,
                       return_dsinks=False, <the modifiers>) -> (dq, dk, dv, dbias, dsinks)
    attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None, rng_state=None,
                             max_seqlen_q=None, max_seqlen_k=None, causal=False, scale=None,
                             window_left=-1, window_right=-1, softcap=0.0, dropout_p=0.0,
                             deterministic=False, sinks=None, <the modifiers>) -> (out, lse, rng_state)
    attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state,
                              alibi_slopes=None, max_seqlen_q=None, ..., deterministic=False, sinks=None,
                              return_dsinks=False, <the modifiers>) -> (dq, dk, dv, dsinks)
    decode(q, k_cache!, v_cache!, cache_seqlens=None, block_table=None, k_new=None, v_new=None, mask=None,
           alibi_slopes=None, num_splits=0, causal=True, scale=None, window_left=-1, window_right=-1,
           softcap=0.0, sinks=None, k_scale=None, v_scale=None, <the modifiers>, v_head_dim=None) -> (out, lse)
    decode_out(q, k_cache!, v_cache!, out!, <the same>) -> lse
    merge_states(outs, lses) -> (out, lse)

(``!``: mutated in place.) Every op has a fake (meta) implementation, so ``torch.compile``,
``torch.export`` and ``FakeTensorMode`` trace them without a GPU; the two forwards are
differentiable (an autograd kernel at the Autograd key: the backward op computes dq, dk, dv and,
when ``bias`` requires a gradient, dbias, when ``sinks`` requires one, dsinks). ``sinks`` (attention
sinks, float32 (Hq,)) come last in each schema, so calls written before them keep their meaning; a
backward that is not asked for dbias / dsinks returns an empty float32 tensor in their place. The ops are defined with ``torch.library.Library``
rather than ``torch.library.custom_op`` (:mod:`cuflash.interop._torch_library` says why). The functions of this module are the user-facing wrappers
(``window=(left, right)``, ``block_size=(bq, bk)``, a ``generator``, a list of partial states...).
Called eagerly on plain CUDA tensors, :func:`attention`, :func:`attention_varlen` and :func:`decode`
(without ``rng_state`` or ``return_lse`` for the first two) take :mod:`cuflash.interop.torch`'s eager
route: the same kernels and results without the op. Otherwise, called eagerly on plain tensors, a
wrapper runs what the dispatcher would run (the Autograd kernel, version bumps, the kernel) without
the dispatcher's Python hops (:meth:`cuflash.interop._torch_library._Op.__call__`); while
``torch.compile`` traces, under a dispatch mode or a functorch transform, and whenever
``torch.ops.cuflash.*`` is called itself, the dispatcher runs them.

Score and mask modifiers (:class:`cuflash.ScoreMod`, :class:`cuflash.MaskMod`) cross the schemas as
``<the modifiers>`` = ``score_mod: str?, mask_mod: str?, mod_arrays: Tensor[]?``: each modifier's
spec (:mod:`cuflash.modifiers.spec`, a string ``torch.compile`` keeps as a constant) and their array
arguments (graph inputs), the ScoreMod's first, each in slot order; the ops rebuild the modifiers
around the arrays they receive. The functions of this module take the objects (``score_mod=`` /
``mask_mod=``) and write those arguments; gradients flow to q, k, v (and sinks), not to the arrays.
While ``torch.compile`` traces, a MaskMod derives no block mask (its graph's inputs may be refilled
at the same address, e.g. by ``mode="reduce-overhead"``, which a cached block mask would not see).

Semantics are cuflash's (:func:`cuflash.attention_forward`, :func:`cuflash.decode`, ...): layouts
(B, S, H, D), bottom-right causal, lse float32 (B, Hq, Sq) (varlen: (Hq, total_q)) and treated as a
constant by autograd (its gradient is not propagated). Outputs are allocated by torch, C-contiguous
(``out`` has the shape and dtype of ``q``, whatever ``q``'s strides), and every allocation cuflash
makes during a call comes from torch's caching allocator (:mod:`cuflash.interop._torch_stream`).

Dropout and its random state
----------------------------
The forwards take ``rng_state`` (optional int64 tensor (2,) = [seed, offset], the bits of cuflash's
uint64 pair) and return the state they used. Without one, the op draws a fresh state from
cuflash's default generator (:func:`cuflash.manual_seed`) *when it runs*, so a compiled graph draws
a new mask at every call, like eager mode, and the backward regenerates that mask from the saved
state. The returned state is a CPU tensor when ``dropout_p > 0`` (the backward reads it on the host,
without a synchronisation) and an empty tensor on the inputs' device otherwise (so that graphs
without dropout stay on the GPU, e.g. for ``torch.compile(mode="reduce-overhead")``). The state is drawn on the
host, so a forward with dropout does not belong in a CUDA graph (a replay cannot draw a new one):
capture the ops without dropout. AOTAutograd's common-subexpression pass
exempts only aten's random ops, so two calls with identical inputs and dropout in one compiled graph
may be merged into one: pass distinct ``rng_state`` tensors if that matters.
"""

import numbers
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from .. import _checks
from ..attention import attention_forward as _cf_attention_forward, attention_varlen as _cf_attention_varlen
from ..backward import attention_backward as _cf_attention_backward
from ..backward import attention_varlen_backward as _cf_attention_varlen_backward
from ..decode import decode as _cf_decode
from ..merge import merge_states as _cf_merge_states
from ..random import Generator, as_rng_state, default_generator
from ._torch_autograd import direct_apply
from ._torch_library import RANDOM as _RANDOM, backward_op as _backward_op, compiling as _compiling
from ._torch_library import direct as _direct, op as _op, records_grad as _records_grad
from ._torch_stream import as_torch, torch_call

__all__ = ["attention", "attention_forward", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "decode", "merge_states"]

# ----------------------------------------------------------------------------- the kernels behind the ops

def _plain(x):
    """The tensor without autograd's requires_grad (cuflash imports tensors it has not planned for
    through DLPack, which refuses those); None passes."""
    return x.detach() if x is not None and x.requires_grad else x


def _generator(state):
    """A private generator whose next draw is exactly ``state`` (None without dropout)."""
    if state is None:
        return None
    generator = Generator(0)
    generator.set_state(state)
    return generator


class _CudaKernels:
    """cuflash's kernels on torch's current stream, with torch's memory: each method writes the
    torch tensors it is given (``out``, ``lse``, ``dq``...) and returns what cuflash allocated."""

    @staticmethod
    def attention_forward(q, k, v, out, lse, rng_state, options):
        with torch_call(q.device):
            _cf_attention_forward(_plain(q), _plain(k), _plain(v), out=out, lse=lse, generator=_generator(rng_state),
                                  **options)

    @staticmethod
    def attention_backward(dout, q, k, v, out, lse, dq, dk, dv, rng_state, options, return_dbias, return_dsinks):
        """Writes dq, dk, dv; returns (dbias or None, dsinks or None)."""
        with torch_call(q.device):
            grads = list(_cf_attention_backward(_plain(dout), _plain(q), _plain(k), _plain(v), _plain(out), lse,
                                                rng_state=rng_state, dq=dq, dk=dk, dv=dv, return_dbias=return_dbias,
                                                return_dsinks=return_dsinks, **options)[3:])
            dbias = as_torch(grads.pop(0)) if return_dbias else None
            return dbias, (as_torch(grads.pop(0)) if return_dsinks else None)

    @staticmethod
    def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, out, rng_state, options):
        with torch_call(q.device):
            _, lse = _cf_attention_varlen(_plain(q), _plain(k), _plain(v), cu_seqlens_q, cu_seqlens_k, out=out,
                                          generator=_generator(rng_state), return_lse=True, **options)
            return as_torch(lse)

    @staticmethod
    def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, rng_state,
                                  options, return_dsinks):
        """Writes dq, dk, dv; returns dsinks or None."""
        with torch_call(q.device):
            grads = _cf_attention_varlen_backward(_plain(dout), _plain(q), _plain(k), _plain(v), _plain(out), lse,
                                                  cu_seqlens_q, cu_seqlens_k, rng_state=rng_state, dq=dq, dk=dk,
                                                  dv=dv, return_dsinks=return_dsinks, **options)
            return as_torch(grads[3]) if return_dsinks else None

    @staticmethod
    def decode(q, k_cache, v_cache, out, lse, options):
        k_cache, v_cache, cache_options = decode_cache_arguments(k_cache, v_cache, options["k_scale"],
                                                                 options["v_scale"])
        with torch_call(q.device):
            _cf_decode(_plain(q), k_cache, v_cache, out=out, lse=lse, **dict(options, **cache_options))

    @staticmethod
    def merge_states(outs, lses, out, lse):
        with torch_call(outs.device):
            _cf_merge_states(_plain(outs), _plain(lses), out=out, lse=lse)


# The kernels per device type. Only CUDA runs cuflash; the tests put a float64 host reference under
# "cpu" to check the torch.library plumbing (schemas, fakes, autograd, torch.compile) without a GPU.
_KERNELS = {"cuda": _CudaKernels}


def _kernels_for(x: Tensor):
    kernels = _KERNELS.get(x.device.type)
    if kernels is None:
        raise ValueError(f"cuflash's ops need CUDA tensors, got one on {x.device}")
    return kernels


# ----------------------------------------------------------------------------- shared pieces

def _check_rank(x: Tensor, rank: int, name: str, layout: str) -> None:
    if x.dim() != rank:
        raise ValueError(f"{name} must be {rank}-d {layout}, got shape {tuple(x.shape)}")


def _empty(shape, dtype, device) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _dense_like(x) -> Tensor:
    """An uninitialised C-contiguous tensor of x's shape, dtype and device. ``torch.empty_like`` with
    the format given reads no shape from Python: 3.4 us a call on an H200's host against 5.6 for
    ``x.new_empty(x.shape)`` and 7.9 for ``torch.empty(shape, dtype=, device=)``; an autograd step
    allocates five."""
    return _empty_like(x, memory_format=_contiguous)


_empty_like, _contiguous = torch.empty_like, torch.contiguous_format


def _window(window_left: int, window_right: int):
    return None if (window_left, window_right) == (-1, -1) else (window_left, window_right)


def _state_of(rng_state: Tensor):
    """(seed, offset) of an rng_state tensor: int64 (the bits of cuflash's uint64 pair) or uint64, (2,)."""
    if not isinstance(rng_state, Tensor):
        raise TypeError(f"rng_state must be a torch.Tensor, got {type(rng_state).__name__}")
    if rng_state.dtype not in (torch.int64, torch.uint64) or tuple(rng_state.shape) != (2,):
        raise ValueError(f"rng_state must be an int64 tensor of shape (2,) = [seed, offset], got "
                         f"{rng_state.dtype} {tuple(rng_state.shape)}")
    values = rng_state.detach().cpu().numpy()   # a copy from the GPU synchronises: keep it on the CPU
    return as_rng_state(values.view(np.uint64))


def _draw(dropout_p: float, rng_state: Optional[Tensor]):
    """The (seed, offset) of a forward call: the given one, or the default generator's next; None
    without dropout. Checks dropout_p first, so a bad call draws nothing."""
    if _checks.check_dropout(dropout_p) == 0.0:
        return None
    if rng_state is not None:
        return _state_of(rng_state)
    seed, offset = default_generator().next_state()
    return int(seed), int(offset)


def _state_tensor(state, device) -> Tensor:
    """The returned rng_state: [seed, offset] as int64 bits on the CPU; without dropout an empty
    tensor on ``device`` (no kernel to fill it, and nothing on the CPU in a graph without dropout)."""
    if state is None:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.from_numpy(np.array(state, dtype=np.uint64).view(np.int64))


def _fake_state(dropout_p: float, device) -> Tensor:
    return torch.empty(2 if dropout_p > 0 else 0, dtype=torch.int64, device="cpu" if dropout_p > 0 else device)


def _backward_state(dropout_p: float, rng_state: Optional[Tensor]):
    if dropout_p == 0.0:
        return None
    if rng_state is None:
        raise ValueError("dropout_p > 0 needs the forward's rng_state")
    return _state_of(rng_state)


_BSHD = "(batch, seqlen, heads, head_dim)"
_THD = "(total, heads, head_dim)"


# ----------------------------------------------------------------------------- attention

def _out_shape(q, v) -> tuple:
    """The attention output's shape: q's, with v's head dim (a value head dim of its own, issue 53).
    A v of another rank keeps q's, for cuflash's checks to name it."""
    return (*q.shape[:-1], v.shape[-1]) if v.dim() == q.dim() else tuple(q.shape)


def _run_attention_forward(q, k, v, alibi_slopes, mask, bias, block_mask, rng_state, causal, scale, window_left,
                           window_right, softcap, block_q, block_k, dropout_p, deterministic, sinks=None, mods=None):
    """The body of ``cuflash::attention_forward``; ``mods``: {"score_mod": ..., "mask_mod": ...} rebuilt
    from the op's modifier arguments (:func:`_rebuilt`)."""
    kernels = _kernels_for(q)
    _check_rank(q, 4, "q", _BSHD)
    b, sq, hq, _ = q.shape
    state = _draw(dropout_p, rng_state)
    out = _empty(_out_shape(q, v), q.dtype, q.device)
    lse = _empty((b, hq, sq), torch.float32, q.device)
    options = dict(alibi_slopes=_plain(alibi_slopes), mask=mask, bias=_plain(bias), block_mask=block_mask,
                   causal=causal, scale=scale, window=_window(window_left, window_right), softcap=softcap,
                   block_size=(block_q, block_k), dropout_p=dropout_p, sinks=_plain(sinks))
    if mods:
        options.update(mods)
    kernels.attention_forward(q, k, v, out, lse, state, options)
    return out, lse, _state_tensor(state, q.device)


@_op("attention_forward", tags=_RANDOM)
def _attention_forward_op(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor] = None,
                          mask: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                          block_mask: Optional[Tensor] = None, rng_state: Optional[Tensor] = None,
                          causal: bool = False, scale: Optional[float] = None, window_left: int = -1,
                          window_right: int = -1, softcap: float = 0.0, block_q: int = 128, block_k: int = 128,
                          dropout_p: float = 0.0, deterministic: bool = False, sinks: Optional[Tensor] = None,
                          score_mod: Optional[str] = None, mask_mod: Optional[str] = None,
                          mod_arrays: Optional[list[Tensor]] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _run_attention_forward(q, k, v, alibi_slopes, mask, bias, block_mask, rng_state, causal, scale,
                                  window_left, window_right, softcap, block_q, block_k, dropout_p, deterministic,
                                  sinks, _rebuilt(score_mod, mask_mod, mod_arrays))


def _check_sinks_shape(sinks, heads_q) -> None:
    """The fakes' check of ``sinks``: a tensor of shape (Hq,) (its dtype, float32, is cuflash's check)."""
    if sinks is not None and tuple(sinks.shape) != (heads_q,):
        raise ValueError(f"sinks must have shape ({heads_q},) (one per query head), got {tuple(sinks.shape)}")


@_attention_forward_op.register_fake
def _(q, k, v, alibi_slopes=None, mask=None, bias=None, block_mask=None, rng_state=None, causal=False, scale=None,
      window_left=-1, window_right=-1, softcap=0.0, block_q=128, block_k=128, dropout_p=0.0, deterministic=False,
      sinks=None, score_mod=None, mask_mod=None, mod_arrays=None):
    _check_rank(q, 4, "q", _BSHD)
    b, sq, hq, _ = q.shape
    _check_sinks_shape(sinks, hq)
    out = q.new_empty(_out_shape(q, v))
    return out, q.new_empty((b, hq, sq), dtype=torch.float32), _fake_state(dropout_p, q.device)


def _run_attention_backward(dout, q, k, v, out, lse, rng_state, alibi_slopes, mask, bias, block_mask, causal, scale,
                            window_left, window_right, softcap, block_q, block_k, dropout_p, deterministic,
                            return_dbias, sinks=None, return_dsinks=False, mods=None, dlse=None):
    """The body of ``cuflash::attention_backward`` (``mods`` as in :func:`_run_attention_forward`; ``dlse``:
    the gradient of a loss that reads lse, :func:`cuflash.attention_backward`'s)."""
    kernels = _kernels_for(q)
    state = _backward_state(dropout_p, rng_state)
    dq = _dense_like(q)
    dk = _dense_like(k)
    dv = _dense_like(v)
    options = dict(alibi_slopes=_plain(alibi_slopes), mask=mask, bias=_plain(bias), block_mask=block_mask,
                   causal=causal, scale=scale, window=_window(window_left, window_right), softcap=softcap,
                   block_size=(block_q, block_k), dropout_p=dropout_p, deterministic=deterministic,
                   sinks=_plain(sinks))
    if mods:
        options.update(mods)
    if dlse is not None:
        options["dlse"] = dlse
    _checks.check_return_dsinks(return_dsinks, sinks)
    dbias, dsinks = kernels.attention_backward(dout, q, k, v, out, lse, dq, dk, dv, state, options, return_dbias,
                                               return_dsinks)
    if dbias is None:
        dbias = _empty((0,), torch.float32, q.device)
    if dsinks is None:
        dsinks = _empty((0,), torch.float32, q.device)
    return dq, dk, dv, dbias, dsinks


@_op("attention_backward")
def _attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           rng_state: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
                           mask: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                           block_mask: Optional[Tensor] = None, causal: bool = False, scale: Optional[float] = None,
                           window_left: int = -1, window_right: int = -1, softcap: float = 0.0, block_q: int = 128,
                           block_k: int = 128, dropout_p: float = 0.0, deterministic: bool = False,
                           return_dbias: bool = False, sinks: Optional[Tensor] = None,
                           return_dsinks: bool = False, score_mod: Optional[str] = None,
                           mask_mod: Optional[str] = None, mod_arrays: Optional[list[Tensor]] = None,
                           dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _run_attention_backward(dout, q, k, v, out, lse, rng_state, alibi_slopes, mask, bias, block_mask, causal,
                                   scale, window_left, window_right, softcap, block_q, block_k, dropout_p,
                                   deterministic, return_dbias, sinks, return_dsinks,
                                   _rebuilt(score_mod, mask_mod, mod_arrays), dlse)


@_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, rng_state=None, alibi_slopes=None, mask=None, bias=None, block_mask=None,
      causal=False, scale=None, window_left=-1, window_right=-1, softcap=0.0, block_q=128, block_k=128,
      dropout_p=0.0, deterministic=False, return_dbias=False, sinks=None, return_dsinks=False, score_mod=None,
      mask_mod=None, mod_arrays=None, dlse=None):
    if return_dbias and bias is None:
        raise ValueError("return_dbias=True needs a bias")
    _checks.check_return_dsinks(return_dsinks, sinks)
    _check_sinks_shape(sinks, q.shape[2])
    dbias = bias.new_empty(bias.shape) if return_dbias else q.new_empty((0,), dtype=torch.float32)
    dsinks = sinks.new_empty(sinks.shape) if return_dsinks else q.new_empty((0,), dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape), dbias, dsinks


class _AttentionForward(torch.autograd.Function):
    """The autograd of ``cuflash::attention_forward``: ``cuflash::attention_backward`` gives dq, dk,
    dv and, when ``bias`` / ``sinks`` require them, dbias / dsinks, through out and lse (lse's gradient
    is the backward's ``dlse``; None, not a tensor of zeros, when the loss does not read lse: the
    gradients are not materialised); rng_state is a constant.
    ``mods``: the op's modifier arguments (score_mod, mask_mod, mod_arrays), handed to the backward op."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, constants, options, mods):
        alibi_slopes, mask, block_mask, rng_state = constants
        out, lse, state = _attention_forward_op.below_autograd(q, k, v, alibi_slopes, mask, bias, block_mask,
                                                               rng_state, *options, sinks, *mods)
        ctx.mark_non_differentiable(state)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, state, alibi_slopes, mask, bias, block_mask, sinks, *(mods[2] or ()))
        ctx.options, ctx.specs = options, mods[:2]
        return out, lse, state

    @staticmethod
    def backward(ctx, dout, dlse, _dstate):
        q, k, v, out, lse, state, alibi_slopes, mask, bias, block_mask, sinks, *arrays = ctx.saved_tensors
        if dout is None:   # the loss reads lse alone
            dout = torch.zeros_like(out)
        want_dbias = bias is not None and ctx.needs_input_grad[3]
        want_dsinks = sinks is not None and ctx.needs_input_grad[4]
        dq, dk, dv, dbias, dsinks = _backward_op(
            _attention_backward_op, dout, q, k, v, out, lse, state, alibi_slopes, mask, bias, block_mask, *ctx.options,
            want_dbias, sinks, want_dsinks, *ctx.specs, arrays or None, dlse)
        return dq, dk, dv, (dbias if want_dbias else None), (dsinks if want_dsinks else None), None, None, None


_attention_forward_apply = direct_apply(_AttentionForward)


@_attention_forward_op.register_autograd
def _(q, k, v, alibi_slopes=None, mask=None, bias=None, block_mask=None, rng_state=None, causal=False, scale=None,
      window_left=-1, window_right=-1, softcap=0.0, block_q=128, block_k=128, dropout_p=0.0, deterministic=False,
      sinks=None, score_mod=None, mask_mod=None, mod_arrays=None):
    options = (causal, scale, window_left, window_right, softcap, block_q, block_k, dropout_p, deterministic)
    if _records_grad(q, k, v, bias, sinks):
        return _attention_forward_apply(q, k, v, bias, sinks, (alibi_slopes, mask, block_mask, rng_state), options,
                                        (score_mod, mask_mod, mod_arrays))
    return _attention_forward_op.below_autograd(q, k, v, alibi_slopes, mask, bias, block_mask, rng_state, *options,
                                                sinks, score_mod, mask_mod, mod_arrays)


# ----------------------------------------------------------------------------- varlen

_NO_CACHE_GRAD = ("attention_varlen over a KV cache (cache_seqlens / block_table: chunked prefill) has no backward: "
                  "call it under torch.no_grad() or with tensors that do not require a gradient")


@_op("attention_varlen_forward", tags=_RANDOM)
def _attention_varlen_forward_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                                 cu_seqlens_k: Optional[Tensor], alibi_slopes: Optional[Tensor] = None,
                                 rng_state: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                                 max_seqlen_k: Optional[int] = None, causal: bool = False,
                                 scale: Optional[float] = None, window_left: int = -1, window_right: int = -1,
                                 softcap: float = 0.0, dropout_p: float = 0.0, deterministic: bool = False,
                                 sinks: Optional[Tensor] = None, score_mod: Optional[str] = None,
                                 mask_mod: Optional[str] = None, mod_arrays: Optional[list[Tensor]] = None,
                                 cache_seqlens: Optional[Tensor] = None,
                                 block_table: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _run_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, max_seqlen_q,
                               max_seqlen_k, causal, scale, window_left, window_right, softcap, dropout_p, deterministic,
                               sinks, _rebuilt(score_mod, mask_mod, mod_arrays), (cache_seqlens, block_table))


def _run_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state, max_seqlen_q, max_seqlen_k,
                        causal, scale, window_left, window_right, softcap, dropout_p, deterministic, sinks=None,
                        mods=None, cache=(None, None)):
    """The body of ``cuflash::attention_varlen_forward`` (``mods`` as in :func:`_run_attention_forward`;
    ``cache``: (cache_seqlens, block_table) of chunked prefill, k and v then the caches)."""
    kernels = _kernels_for(q)
    _check_rank(q, 3, "q", _THD)
    state = _draw(dropout_p, rng_state)
    out = _empty(_out_shape(q, v), q.dtype, q.device)
    options = dict(alibi_slopes=_plain(alibi_slopes), max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   causal=causal, scale=scale, window=_window(window_left, window_right), softcap=softcap,
                   dropout_p=dropout_p, sinks=_plain(sinks))
    if cache[0] is not None or cache[1] is not None:
        options.update(cache_seqlens=cache[0], block_table=cache[1])
    if mods:
        options.update(mods)
    lse = kernels.attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, out, state, options)
    return out, lse, _state_tensor(state, q.device)


@_attention_varlen_forward_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None, rng_state=None, max_seqlen_q=None, max_seqlen_k=None,
      causal=False, scale=None, window_left=-1, window_right=-1, softcap=0.0, dropout_p=0.0, deterministic=False,
      sinks=None, score_mod=None, mask_mod=None, mod_arrays=None, cache_seqlens=None, block_table=None):
    _check_rank(q, 3, "q", _THD)
    total_q, hq, _ = q.shape
    _check_sinks_shape(sinks, hq)
    out = q.new_empty(_out_shape(q, v))
    return out, q.new_empty((hq, total_q), dtype=torch.float32), _fake_state(dropout_p, q.device)


@_op("attention_varlen_backward")
def _attention_varlen_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                  cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, rng_state: Optional[Tensor] = None,
                                  alibi_slopes: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                                  max_seqlen_k: Optional[int] = None, causal: bool = False,
                                  scale: Optional[float] = None, window_left: int = -1, window_right: int = -1,
                                  softcap: float = 0.0, dropout_p: float = 0.0, deterministic: bool = False,
                                  sinks: Optional[Tensor] = None, return_dsinks: bool = False,
                                  score_mod: Optional[str] = None, mask_mod: Optional[str] = None,
                                  mod_arrays: Optional[list[Tensor]] = None,
                                  dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _run_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state, alibi_slopes,
                                max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right, softcap,
                                dropout_p, deterministic, sinks, return_dsinks,
                                _rebuilt(score_mod, mask_mod, mod_arrays), dlse)


def _run_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state, alibi_slopes, max_seqlen_q,
                         max_seqlen_k, causal, scale, window_left, window_right, softcap, dropout_p,
                         deterministic, sinks=None, return_dsinks=False, mods=None, dlse=None):
    """The body of ``cuflash::attention_varlen_backward`` (``mods`` as in :func:`_run_attention_forward`,
    ``dlse`` as in :func:`_run_attention_backward`)."""
    kernels = _kernels_for(q)
    state = _backward_state(dropout_p, rng_state)
    dq = _dense_like(q)
    dk = _dense_like(k)
    dv = _dense_like(v)
    options = dict(alibi_slopes=_plain(alibi_slopes), max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   causal=causal, scale=scale, window=_window(window_left, window_right), softcap=softcap,
                   dropout_p=dropout_p, deterministic=deterministic, sinks=_plain(sinks))
    if mods:
        options.update(mods)
    if dlse is not None:
        options["dlse"] = dlse
    _checks.check_return_dsinks(return_dsinks, sinks)
    dsinks = kernels.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, state,
                                               options, return_dsinks)
    if dsinks is None:
        dsinks = _empty((0,), torch.float32, q.device)
    return dq, dk, dv, dsinks


@_attention_varlen_backward_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state=None, alibi_slopes=None, max_seqlen_q=None,
      max_seqlen_k=None, causal=False, scale=None, window_left=-1, window_right=-1, softcap=0.0, dropout_p=0.0,
      deterministic=False, sinks=None, return_dsinks=False, score_mod=None, mask_mod=None, mod_arrays=None,
      dlse=None):
    _checks.check_return_dsinks(return_dsinks, sinks)
    _check_sinks_shape(sinks, q.shape[1])
    dsinks = sinks.new_empty(sinks.shape) if return_dsinks else q.new_empty((0,), dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty(k.shape), q.new_empty(v.shape), dsinks


class _AttentionVarlenForward(torch.autograd.Function):
    """The autograd of ``cuflash::attention_varlen_forward`` (``cuflash::attention_varlen_backward``):
    dq, dk, dv and, when ``sinks`` requires it, dsinks, through out and lse; ``mods`` as for
    :class:`_AttentionForward`."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, constants, options, mods):
        cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state = constants
        out, lse, state = _attention_varlen_forward_op.below_autograd(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                                      alibi_slopes, rng_state, *options, sinks, *mods)
        ctx.mark_non_differentiable(state)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, state, alibi_slopes, sinks,
                              *(mods[2] or ()))
        ctx.options, ctx.specs = options, mods[:2]
        return out, lse, state

    @staticmethod
    def backward(ctx, dout, dlse, _dstate):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, state, alibi_slopes, sinks, *arrays = ctx.saved_tensors
        if dout is None:   # the loss reads lse alone
            dout = torch.zeros_like(out)
        want_dsinks = sinks is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dsinks = _backward_op(
            _attention_varlen_backward_op, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, state, alibi_slopes,
            *ctx.options, sinks, want_dsinks, *ctx.specs, arrays or None, dlse)
        return dq, dk, dv, (dsinks if want_dsinks else None), None, None, None


_attention_varlen_forward_apply = direct_apply(_AttentionVarlenForward)


@_attention_varlen_forward_op.register_autograd
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None, rng_state=None, max_seqlen_q=None, max_seqlen_k=None,
      causal=False, scale=None, window_left=-1, window_right=-1, softcap=0.0, dropout_p=0.0, deterministic=False,
      sinks=None, score_mod=None, mask_mod=None, mod_arrays=None, cache_seqlens=None, block_table=None):
    options = (max_seqlen_q, max_seqlen_k, causal, scale, window_left, window_right, softcap, dropout_p,
               deterministic)
    if cache_seqlens is not None or block_table is not None:   # chunked prefill: inference only
        if _records_grad(q, k, v, sinks):
            raise ValueError(_NO_CACHE_GRAD)
        return _attention_varlen_forward_op.below_autograd(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                                           rng_state, *options, sinks, score_mod, mask_mod, mod_arrays,
                                                           cache_seqlens, block_table)
    if _records_grad(q, k, v, sinks):
        return _attention_varlen_forward_apply(q, k, v, sinks, (cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state),
                                               options, (score_mod, mask_mod, mod_arrays))
    return _attention_varlen_forward_op.below_autograd(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, rng_state,
                                                       *options, sinks, score_mod, mask_mod, mod_arrays)


# ----------------------------------------------------------------------------- decode

def decode_cache_arguments(k_cache, v_cache, k_scale, v_scale):
    """torch's fp8 caches as cuflash reads them: ``torch.float8_e4m3fn`` caches viewed as their uint8
    bytes (the same memory: appends land in the caller's tensors) with ``kv_dtype`` implied, and the
    scales: a float, or a tensor of one element on the host, as a number (no copy to the GPU);
    a CUDA tensor as it is (read at each call or graph replay). Returns (k_cache, v_cache, options)."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    options = {}
    caches = []
    for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if isinstance(cache, Tensor) and cache.dtype == torch.uint8:
            raise TypeError(f"{name} is a uint8 tensor: pass an fp8 cache as torch.float8_e4m3fn "
                            f"({name}.view(torch.float8_e4m3fn)); kv_dtype follows from it")
        if isinstance(cache, Tensor) and fp8 is not None and cache.dtype == fp8:
            options["kv_dtype"] = "float8_e4m3fn"
            cache = cache.view(torch.uint8)
        caches.append(cache)
    for scale, name in ((k_scale, "k_scale"), (v_scale, "v_scale")):
        if isinstance(scale, Tensor):
            scale = _plain(scale)
            if scale.device.type == "cpu" and scale.numel() == 1:
                scale = float(scale.reshape(()).to(torch.float32))
        options[name] = scale
    return caches[0], caches[1], options


def _scale_tensor(x):
    """A scale for the ops' schema (Optional[Tensor]): a Python number becomes a float32 host scalar."""
    if x is None or isinstance(x, Tensor):
        return x
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"a scale must be a float or a torch.Tensor, got {type(x).__name__}")
    return torch.tensor(float(x), dtype=torch.float32)


def _check_scale_shape(scale, name: str, k_cache) -> None:
    """The fakes' check of an fp8 cache's scale: one element, or one per kv head (k_cache axis 2)."""
    if scale is None:
        return
    heads_k = k_cache.shape[2] if k_cache.dim() == 4 else None
    if scale.numel() != 1 and tuple(scale.shape) != (heads_k,):
        raise ValueError(f"{name} must be a scalar or have shape ({heads_k},) (one per kv head), got "
                         f"{tuple(scale.shape)}")


def _decode_options(cache_seqlens, block_table, k_new, v_new, mask, alibi_slopes, num_splits, causal, scale,
                    window_left, window_right, softcap, sinks=None, k_scale=None, v_scale=None, mods=None,
                    v_head_dim=None):
    options = dict(cache_seqlens=cache_seqlens, block_table=block_table, k_new=_plain(k_new), v_new=_plain(v_new),
                   mask=mask, alibi_slopes=_plain(alibi_slopes), num_splits=num_splits, causal=causal, scale=scale,
                   window=_window(window_left, window_right), softcap=softcap, sinks=_plain(sinks),
                   k_scale=k_scale, v_scale=v_scale)
    if v_head_dim is not None:   # MLA: v_cache is None, the values k_cache's first v_head_dim columns
        options["v_head_dim"] = v_head_dim
    if mods:
        options.update(mods)
    return options


@_op("decode", mutates_args=("k_cache", "v_cache"))
def _decode_op(q: Tensor, k_cache: Tensor, v_cache: Optional[Tensor], cache_seqlens: Optional[Tensor] = None,
               block_table: Optional[Tensor] = None, k_new: Optional[Tensor] = None, v_new: Optional[Tensor] = None,
               mask: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None, num_splits: int = 0,
               causal: bool = True, scale: Optional[float] = None, window_left: int = -1, window_right: int = -1,
               softcap: float = 0.0, sinks: Optional[Tensor] = None, k_scale: Optional[Tensor] = None,
               v_scale: Optional[Tensor] = None, score_mod: Optional[str] = None, mask_mod: Optional[str] = None,
               mod_arrays: Optional[list[Tensor]] = None, v_head_dim: Optional[int] = None) -> tuple[Tensor, Tensor]:
    kernels = _kernels_for(q)
    _check_rank(q, 4, "q", _BSHD)
    b, sq, hq, _ = q.shape
    out = _empty(_decode_out_shape(q, v_cache, v_head_dim), q.dtype, q.device)
    lse = _empty((b, hq, sq), torch.float32, q.device)
    kernels.decode(q, k_cache, v_cache, out, lse, _decode_options(
        cache_seqlens, block_table, k_new, v_new, mask, alibi_slopes, num_splits, causal, scale, window_left,
        window_right, softcap, sinks, k_scale, v_scale, _rebuilt(score_mod, mask_mod, mod_arrays), v_head_dim))
    return out, lse


def _decode_out_shape(q, v_cache, v_head_dim):
    """out's shape: q's with the value head dim: v_cache's (its own may differ from q's), or v_head_dim
    for MLA decode (v_cache None)."""
    if v_head_dim is not None:
        return (*q.shape[:3], v_head_dim)
    if v_cache is not None and v_cache.dim() == 4 and v_cache.shape[-1] != q.shape[-1]:
        return (*q.shape[:3], v_cache.shape[-1])
    return tuple(q.shape)


@_decode_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens=None, block_table=None, k_new=None, v_new=None, mask=None,
      alibi_slopes=None, num_splits=0, causal=True, scale=None, window_left=-1, window_right=-1, softcap=0.0,
      sinks=None, k_scale=None, v_scale=None, score_mod=None, mask_mod=None, mod_arrays=None, v_head_dim=None):
    _check_rank(q, 4, "q", _BSHD)
    b, sq, hq, _ = q.shape
    _check_sinks_shape(sinks, hq)
    _check_scale_shape(k_scale, "k_scale", k_cache)
    _check_scale_shape(v_scale, "v_scale", k_cache)
    return q.new_empty(_decode_out_shape(q, v_cache, v_head_dim)), q.new_empty((b, hq, sq), dtype=torch.float32)


@_op("decode_out", mutates_args=("k_cache", "v_cache", "out"))
def _decode_out_op(q: Tensor, k_cache: Tensor, v_cache: Optional[Tensor], out: Tensor,
                   cache_seqlens: Optional[Tensor] = None,
                   block_table: Optional[Tensor] = None, k_new: Optional[Tensor] = None,
                   v_new: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                   alibi_slopes: Optional[Tensor] = None, num_splits: int = 0, causal: bool = True,
                   scale: Optional[float] = None, window_left: int = -1, window_right: int = -1,
                   softcap: float = 0.0, sinks: Optional[Tensor] = None, k_scale: Optional[Tensor] = None,
                   v_scale: Optional[Tensor] = None, score_mod: Optional[str] = None, mask_mod: Optional[str] = None,
                   mod_arrays: Optional[list[Tensor]] = None, v_head_dim: Optional[int] = None) -> Tensor:
    kernels = _kernels_for(q)
    _check_rank(q, 4, "q", _BSHD)
    b, sq, hq, _ = q.shape
    lse = _empty((b, hq, sq), torch.float32, q.device)
    kernels.decode(q, k_cache, v_cache, out, lse, _decode_options(
        cache_seqlens, block_table, k_new, v_new, mask, alibi_slopes, num_splits, causal, scale, window_left,
        window_right, softcap, sinks, k_scale, v_scale, _rebuilt(score_mod, mask_mod, mod_arrays), v_head_dim))
    return lse


@_decode_out_op.register_fake
def _(q, k_cache, v_cache, out, cache_seqlens=None, block_table=None, k_new=None, v_new=None, mask=None,
      alibi_slopes=None, num_splits=0, causal=True, scale=None, window_left=-1, window_right=-1, softcap=0.0,
      sinks=None, k_scale=None, v_scale=None, score_mod=None, mask_mod=None, mod_arrays=None, v_head_dim=None):
    _check_rank(q, 4, "q", _BSHD)
    b, sq, hq, _ = q.shape
    _check_sinks_shape(sinks, hq)
    _check_scale_shape(k_scale, "k_scale", k_cache)
    _check_scale_shape(v_scale, "v_scale", k_cache)
    return q.new_empty((b, hq, sq), dtype=torch.float32)


# ----------------------------------------------------------------------------- merge

@_op("merge_states")
def _merge_states_op(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    kernels = _kernels_for(outs)
    _check_rank(outs, 5, "outs", "(parts, batch, seqlen, heads, head_dim)")
    _, b, s, h, _ = outs.shape
    out = _empty(outs.shape[1:], outs.dtype, outs.device)
    lse = _empty((b, h, s), torch.float32, outs.device)
    kernels.merge_states(outs, lses, out, lse)
    return out, lse


@_merge_states_op.register_fake
def _(outs, lses):
    _check_rank(outs, 5, "outs", "(parts, batch, seqlen, heads, head_dim)")
    _, b, s, h, _ = outs.shape
    return outs.new_empty(outs.shape[1:]), outs.new_empty((b, h, s), dtype=torch.float32)


def _merge_states_grads(outs, lses, lse, dout, dlse):
    """d outs and d lses of merge_states, in float32 with out recomputed from the parts: with
    w_i = exp(lse_i - lse), d out / d out_i = w_i, d out / d lse_i = w_i (out_i - out), d lse / d lse_i = w_i."""
    seen = torch.isfinite(lse)   # a row no part saw (lse -inf) has no weight anywhere
    w = torch.where(seen, torch.exp(lses - torch.where(seen, lse, torch.zeros_like(lse))), torch.zeros_like(lses))
    w_rows = w.transpose(-1, -2).unsqueeze(-1)                          # (n, B, S, H, 1)
    parts, dout = outs.float(), dout.float()
    out = (w_rows * parts).sum(0)
    toward = (dout * (parts - out)).sum(-1).transpose(-1, -2)           # (n, B, H, S)
    return (w_rows * dout).to(outs.dtype), w * (toward + dlse.float())


class _MergeStates(torch.autograd.Function):
    """The autograd of ``cuflash::merge_states``: gradients for outs and lses (torch operations)."""

    @staticmethod
    def forward(ctx, outs, lses):
        out, lse = _merge_states_op.below_autograd(outs, lses)
        ctx.save_for_backward(outs, lses, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _merge_states_grads(*ctx.saved_tensors, dout, dlse)


_merge_states_apply = direct_apply(_MergeStates)


@_merge_states_op.register_autograd
def _(outs, lses):
    if _records_grad(outs, lses):
        return _merge_states_apply(outs, lses)
    return _merge_states_op.below_autograd(outs, lses)


# ----------------------------------------------------------------------------- score_mod / mask_mod
#
# A ScoreMod/MaskMod crosses an op's schema as its spec (a string) and its arrays (a Tensor[]), see the
# module docstring; the functions of this module write those arguments (_mod_operands) and the ops'
# kernels rebuild the modifiers (_rebuilt). cuflash.interop.torch's eager route hands cuflash the
# objects themselves (_modifiers).

def _rebuilt(score_spec, mask_spec, arrays):
    """{"score_mod": ..., "mask_mod": ...} for cuflash from an op's modifier arguments, or None without."""
    if score_spec is None and mask_spec is None:
        return None
    from ..modifiers.spec import rebuild

    arrays, mods = tuple(arrays or ()), {}
    if score_spec is not None:
        mods["score_mod"], used = rebuild(score_spec, arrays)
        arrays = arrays[used:]
    if mask_spec is not None:
        mods["mask_mod"], used = rebuild(mask_spec, arrays)
        arrays = arrays[used:]
    if arrays:
        raise ValueError(f"mod_arrays has {len(arrays)} more tensors than the modifiers' specs name")
    return mods


def _checked_modifiers(score_mod, mask_mod, backward: bool):
    """The call's (name, modifier) pairs, checked: types (TypeError naming the argument); no array
    that requires a gradient while autograd records (ValueError: cuflash computes gradients for q, k,
    v, not for a modifier's arrays, so it would be silently missing); with ``backward`` (the call will
    be differentiated), a ScoreMod whose derivative is not 1 must have its ``grad`` (ValueError now,
    not in the backward). Only attribute reads: Dynamo traces it without a graph break."""
    from ..modifiers import MaskMod, ScoreMod

    pairs = []
    for name, mod, kind in (("score_mod", score_mod, ScoreMod), ("mask_mod", mask_mod, MaskMod)):
        if mod is None:
            continue
        if not isinstance(mod, kind):
            raise TypeError(f"{name} must be a cuflash.{kind.__name__} or None, got {type(mod).__name__}")
        if torch.is_grad_enabled():
            for arg, value in mod.args.values.items():
                if isinstance(value, Tensor) and value.requires_grad:
                    raise ValueError(f"{name} argument {arg} requires a gradient, which cuflash does not compute "
                                     f"for a modifier's arrays (only q, k, v get gradients): pass {arg}.detach()")
        if backward and name == "score_mod" and mod.missing_grad is not None:
            raise ValueError(mod.missing_grad)
        pairs.append((name, mod))
    return pairs


def _modifiers(score_mod, mask_mod, *, backward: bool = False):
    """{"score_mod": ..., "mask_mod": ...} for cuflash from a call's modifiers (checked as in
    :func:`_checked_modifiers`, tensors that require a gradient detached), or None without."""
    if score_mod is None and mask_mod is None:
        return None
    mods = {}
    for name, mod in _checked_modifiers(score_mod, mask_mod, backward):
        detached = {arg: value.detach() for arg, value in mod.args.values.items()
                    if isinstance(value, Tensor) and value.requires_grad}
        mods[name] = mod.with_args(**detached) if detached else mod
    return mods


def _mod_operands(score_mod, mask_mod, *, backward: bool = False):
    """The ops' modifier arguments (score_mod spec, mask_mod spec, mod_arrays) of a call's modifiers,
    checked as in :func:`_checked_modifiers`; (None, None, None) without. While torch.compile traces, a
    MaskMod's spec is the one that derives no block mask (see the module docstring)."""
    if score_mod is None and mask_mod is None:
        return None, None, None
    specs, arrays = {"score_mod": None, "mask_mod": None}, []
    for name, mod in _checked_modifiers(score_mod, mask_mod, backward):
        specs[name] = mod.spec_without_blocks if name == "mask_mod" and _compiling() else mod.spec
        values = mod.args.values
        arrays.extend(values[arg] for arg in mod.array_names)
    return specs["score_mod"], specs["mask_mod"], arrays or None


def _check_dbias_beside(score_mod, bias, softcap) -> None:
    """dbias beside a ScoreMod needs no softcap (cuflash.attention_backward says why)."""
    if (score_mod is not None and softcap and bias is not None and bias.requires_grad
            and torch.is_grad_enabled()):
        raise ValueError("bias requires a gradient, and dbias is not computed beside both a score_mod and a softcap: "
                         "put the cap inside the score_mod, or detach bias")


# ----------------------------------------------------------------------------- the eager route
#
# Called eagerly on plain CUDA tensors, attention, attention_varlen and decode below run
# cuflash.interop.torch's eager route instead of the op: the same kernels with the same arguments
# (outputs and gradients equal bit for bit, dropout drawn from the same generator), with an autograd
# Function of one output and no op layer between (docs/decisions.md#torch-ops-eager-route).

_eager = None   # cuflash.interop.torch, bound at the first eager call (that module imports this one)


def _eager_module():
    global _eager
    if _eager is None:
        from . import torch as eager
        _eager = eager
    return _eager


def _runs_eagerly(q, tensors) -> bool:
    """Whether a call may take the eager route: q a CUDA tensor, every tensor plain, and nothing that
    must see the op (torch.compile, a dispatch mode, a functorch transform, a jit trace: :func:`direct`)."""
    return type(q) is Tensor and q.is_cuda and not _compiling() and _direct(tensors)


# ----------------------------------------------------------------------------- the functions users call

def _pair(value, name: str, unbounded):
    """(a, b) of a window or block_size argument (``unbounded`` for None)."""
    if value is None:
        return unbounded
    if type(value) is tuple and len(value) == 2 and type(value[0]) is int and type(value[1]) is int:
        return value   # the common case, checked in one line
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name} must be a pair of ints, got {value!r}")
    for x in value:
        if isinstance(x, bool) or not isinstance(x, (numbers.Integral, torch.SymInt)):
            raise TypeError(f"{name} must hold ints, got {value!r}")
    return value[0], value[1]


def _call_state(dropout_p, rng_state, generator):
    """The rng_state tensor a forward gets: the caller's, or drawn from ``generator`` (eager mode:
    under torch.compile the generator's Python lock breaks the graph; use cuflash.manual_seed)."""
    if generator is None or not dropout_p:
        return rng_state
    if rng_state is not None:
        raise ValueError("pass either generator or rng_state, not both")
    return _state_tensor(generator.next_state(), None)


def attention_forward(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None, mask=None,
                      bias=None, block_mask=None, block_size=(128, 128), dropout_p=0.0, rng_state=None,
                      generator=None, deterministic=False, score_mod=None, mask_mod=None, sinks=None):
    """``torch.ops.cuflash.attention_forward``: differentiable exact attention with its lse and rng_state.

    Parameters
    ----------
    q : torch.Tensor (B, Sq, Hq, D), float16, bfloat16 or float32, on a CUDA device
    k, v : torch.Tensor (B, Sk, Hk, D)
    causal, scale, window, softcap, alibi_slopes, mask, bias, block_mask, block_size, dropout_p
        As in :func:`cuflash.attention_forward`; tensors are torch tensors. ``bias`` receives a
        gradient when it requires one.
    rng_state : int64 torch.Tensor (2,), optional
        The dropout state [seed, offset] to use (see the module docstring); default: drawn from
        cuflash's default generator when the op runs.
    generator : cuflash.Generator, optional
        Draw the state from this generator instead (eager mode only).
    deterministic : bool
        Bitwise reproducible gradients (see :func:`cuflash.attention_backward`).
    score_mod, mask_mod : cuflash.ScoreMod, cuflash.MaskMod, optional
        As in :func:`cuflash.attention_forward`; their array arguments may be torch tensors (used as
        constants: a tensor that requires a gradient is refused while autograd records). Eager, under
        ``torch.compile`` (made outside the compiled function; a MaskMod then derives no block mask)
        and in CUDA graphs.
    sinks : float32 torch.Tensor (Hq,), optional
        Attention sinks, as in :func:`cuflash.attention_forward` (each row's denominator gains
        ``exp(sinks[h])``; lse includes it). Receives a gradient when it requires one.

    Returns
    -------
    out : torch.Tensor (B, Sq, Hq, D), C-contiguous, the dtype of q (differentiable)
    lse : float32 torch.Tensor (B, Hq, Sq) (a constant for autograd)
    rng_state : int64 torch.Tensor: the state used, (2,) on the CPU, with dropout; empty on q's device without
    """
    left, right = _pair(window, "window", (-1, -1))
    block_q, block_k = _pair(block_size, "block_size", (128, 128))
    if score_mod is None and mask_mod is None:
        return _attention_forward_op(q, k, v, alibi_slopes, mask, bias, block_mask,
                                     _call_state(dropout_p, rng_state, generator), causal, scale, left, right, softcap,
                                     block_q, block_k, dropout_p, deterministic, sinks)
    mods = _mod_operands(score_mod, mask_mod, backward=_records_grad(q, k, v, bias, sinks))
    _check_dbias_beside(score_mod, bias, softcap)
    return _attention_forward_op(q, k, v, alibi_slopes, mask, bias, block_mask,
                                 _call_state(dropout_p, rng_state, generator), causal, scale, left, right, softcap,
                                 block_q, block_k, dropout_p, deterministic, sinks, *mods)


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None, mask=None,
              bias=None, block_mask=None, block_size=(128, 128), dropout_p=0.0, rng_state=None, generator=None,
              deterministic=False, return_lse=False, score_mod=None, mask_mod=None, sinks=None):
    """Differentiable exact attention through the custom op (see :func:`attention_forward`); eagerly on
    plain CUDA tensors (no ``rng_state``, no ``return_lse``), :func:`cuflash.interop.torch.attention`.

    Returns
    -------
    torch.Tensor (B, Sq, Hq, D), or (out, lse) when ``return_lse``.
    """
    return_lse = _checks.check_flag(return_lse, "return_lse")
    if rng_state is None and not return_lse and _runs_eagerly(q, (q, k, v, alibi_slopes, mask, bias, block_mask,
                                                                   sinks)):
        return _eager_module().attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                                         alibi_slopes=alibi_slopes, mask=mask, bias=bias, block_mask=block_mask,
                                         block_size=block_size, dropout_p=dropout_p, generator=generator,
                                         deterministic=deterministic, score_mod=score_mod, mask_mod=mask_mod,
                                         sinks=sinks)
    out, lse, _ = attention_forward(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                                    alibi_slopes=alibi_slopes, mask=mask, bias=bias, block_mask=block_mask,
                                    block_size=block_size, dropout_p=dropout_p, rng_state=rng_state,
                                    generator=generator, deterministic=deterministic, score_mod=score_mod,
                                    mask_mod=mask_mod, sinks=sinks)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, rng_state=None, causal=False, scale=None, window=None, softcap=0.0,
                       alibi_slopes=None, mask=None, bias=None, block_mask=None, block_size=(128, 128), dropout_p=0.0,
                       deterministic=False, return_dbias=False, score_mod=None, mask_mod=None, sinks=None,
                       return_dsinks=False, dlse=None):
    """``torch.ops.cuflash.attention_backward``: dq, dk, dv (and dbias, dsinks) from the forward's out, lse,
    rng_state (and ``dlse``, the gradient of a loss that reads lse, as in :func:`cuflash.attention_backward`).

    Takes the forward's options (see :func:`cuflash.attention_backward`), ``score_mod``/``mask_mod``
    included (as in :func:`attention_forward`). Returns (dq, dk, dv), then
    dbias with ``return_dbias`` (in the shape and dtype of ``bias``), then dsinks (float32 (Hq,)) with
    ``return_dsinks`` (which needs ``sinks``).
    """
    left, right = _pair(window, "window", (-1, -1))
    block_q, block_k = _pair(block_size, "block_size", (128, 128))
    args = (dout, q, k, v, out, lse, rng_state, alibi_slopes, mask, bias, block_mask, causal, scale, left, right,
            softcap, block_q, block_k, dropout_p, deterministic, return_dbias, sinks, return_dsinks)
    mods = _mod_operands(score_mod, mask_mod, backward=True) if score_mod is not None or mask_mod is not None else ()
    if dlse is None:
        dq, dk, dv, dbias, dsinks = _attention_backward_op(*args, *mods)
    else:
        dq, dk, dv, dbias, dsinks = _attention_backward_op(*args, *(mods or (None, None, None)), dlse)
    return (dq, dk, dv) + ((dbias,) if return_dbias else ()) + ((dsinks,) if return_dsinks else ())


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                     scale=None, window=None, softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None,
                     generator=None, deterministic=False, return_lse=False, score_mod=None, mask_mod=None, sinks=None,
                     cache_seqlens=None, block_table=None):
    """``torch.ops.cuflash.attention_varlen_forward``: differentiable packed-sequence attention (eagerly
    on plain CUDA tensors, no ``rng_state`` or ``return_lse``: :func:`cuflash.interop.torch.attention_varlen`).

    Parameters
    ----------
    q : torch.Tensor (total_q, Hq, D); k, v : torch.Tensor (total_k, Hk, D)
    cu_seqlens_q, cu_seqlens_k : int32 torch.Tensor (B + 1,) on q's device (never read back)
    max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes, dropout_p
        As in :func:`cuflash.attention_varlen`.
    rng_state, generator, deterministic, score_mod, mask_mod, sinks
        As in :func:`attention_forward` (the modifiers' positions within each sequence; ``sinks`` gets a
        gradient when it requires one).
    cache_seqlens, block_table : int32 torch.Tensor (B,) and (B, max_pages), optional
        Chunked prefill, as in :func:`cuflash.attention_varlen`: k and v are the KV caches (contiguous
        (B, L, Hk, D) or paged) that already hold each sequence's new tokens, ``cu_seqlens_k`` is None.
        Inference only: a call that records a gradient is refused (ValueError).

    Returns
    -------
    out : torch.Tensor (total_q, Hq, D), or (out, lse) with lse float32 (Hq, total_q) when ``return_lse``.
    """
    return_lse = _checks.check_flag(return_lse, "return_lse")
    if rng_state is None and not return_lse and _runs_eagerly(q, (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                                                   sinks, cache_seqlens, block_table)):
        return _eager_module().attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
            scale=scale, window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
            generator=generator, deterministic=deterministic, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks,
            cache_seqlens=cache_seqlens, block_table=block_table)
    left, right = _pair(window, "window", (-1, -1))
    options = (max_seqlen_q, max_seqlen_k, causal, scale, left, right, softcap, dropout_p, deterministic)
    cache = (cache_seqlens, block_table) if cache_seqlens is not None or block_table is not None else ()
    if score_mod is None and mask_mod is None and not cache:
        out, lse, _ = _attention_varlen_forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                                   _call_state(dropout_p, rng_state, generator), *options, sinks)
    else:
        mods = _mod_operands(score_mod, mask_mod, backward=_records_grad(q, k, v, sinks))
        out, lse, _ = _attention_varlen_forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                                   _call_state(dropout_p, rng_state, generator), *options, sinks,
                                                   *mods, *cache)
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, rng_state=None,
                              max_seqlen_q=None, max_seqlen_k=None, causal=False, scale=None, window=None,
                              softcap=0.0, alibi_slopes=None, dropout_p=0.0, deterministic=False, score_mod=None,
                              mask_mod=None, sinks=None, return_dsinks=False, dlse=None):
    """``torch.ops.cuflash.attention_varlen_backward``: (dq, dk, dv) of :func:`attention_varlen`, and
    dsinks (float32 (Hq,)) last with ``return_dsinks``; ``dlse`` as in :func:`attention_backward`."""
    left, right = _pair(window, "window", (-1, -1))
    args = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rng_state, alibi_slopes, max_seqlen_q, max_seqlen_k,
            causal, scale, left, right, softcap, dropout_p, deterministic, sinks, return_dsinks)
    mods = _mod_operands(score_mod, mask_mod, backward=True) if score_mod is not None or mask_mod is not None else ()
    if dlse is None:
        grads = tuple(_attention_varlen_backward_op(*args, *mods))
    else:
        grads = tuple(_attention_varlen_backward_op(*args, *(mods or (None, None, None)), dlse))
    return grads if return_dsinks else grads[:3]


def decode(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, k_new=None, v_new=None, num_splits=0,
           causal=True, window=None, softcap=0.0, alibi_slopes=None, scale=None, mask=None, return_lse=False,
           out=None, score_mod=None, mask_mod=None, sinks=None, k_scale=None, v_scale=None, v_head_dim=None):
    """``torch.ops.cuflash.decode`` (``decode_out`` with ``out``): attention of a few new tokens over a KV cache;
    eagerly on plain CUDA tensors, :func:`cuflash.interop.torch.decode` (which moves the caches' version
    counters only when rows are appended, and ``out``'s when given).

    Arguments as in :func:`cuflash.decode`, as torch tensors (``cache_seqlens`` and ``block_table``
    int32 on the GPU). ``k_new`` / ``v_new`` are appended into ``k_cache`` / ``v_cache`` in place
    (the ops declare the caches mutated). ``out`` (C-contiguous, q's shape and dtype) is written in
    place; otherwise the op allocates it. Capturable in ``torch.cuda.graph`` (an eager call of the
    same shapes anywhere first moves compiling and planning out of the capture). ``score_mod`` /
    ``mask_mod`` as in :func:`attention_forward`. ``sinks`` (float32 (Hq,)):
    attention sinks as in :func:`cuflash.decode` (decode has no backward). fp8 caches:
    ``torch.float8_e4m3fn`` ``k_cache`` / ``v_cache`` (``kv_dtype`` implied; ``q``, ``k_new``, ``v_new``
    float16 or bfloat16) with ``k_scale`` / ``v_scale``: floats (carried by the ops as float32 host
    scalars) or float32 tensors of one element or (Hk,), on the GPU (read at each call or replay). MLA:
    ``v_cache=None`` with ``v_head_dim`` (the values are ``k_cache``'s first ``v_head_dim`` columns,
    ``k_new`` the appended latent rows; out has ``v_head_dim`` columns), as in :func:`cuflash.decode`.

    Returns
    -------
    out : torch.Tensor (B, Sq, Hq, D), or (out, lse) with lse float32 (B, Hq, Sq) when ``return_lse``.
    """
    if _runs_eagerly(q, (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, mask, alibi_slopes, sinks,
                         k_scale, v_scale, out)):
        return _eager_module().decode(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, k_new=k_new, v_new=v_new,
            num_splits=num_splits, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
            scale=scale, mask=mask, return_lse=return_lse, out=out, score_mod=score_mod, mask_mod=mask_mod,
            sinks=sinks, k_scale=k_scale, v_scale=v_scale, v_head_dim=v_head_dim)
    left, right = _pair(window, "window", (-1, -1))
    args = (cache_seqlens, block_table, k_new, v_new, mask, alibi_slopes, num_splits, causal, scale, left, right,
            softcap, sinks, _scale_tensor(k_scale), _scale_tensor(v_scale))
    if score_mod is not None or mask_mod is not None or v_head_dim is not None:
        args += _mod_operands(score_mod, mask_mod)
    if v_head_dim is not None:
        args += (v_head_dim,)
    if out is None:
        out, lse = _decode_op(q, k_cache, v_cache, *args)
    else:
        lse = _decode_out_op(q, k_cache, v_cache, out, *args)
    return (out, lse) if return_lse else out


def merge_states(outs, lses):
    """``torch.ops.cuflash.merge_states``: attention over the union of disjoint key sets.

    Parameters
    ----------
    outs : torch.Tensor (n, B, S, H, D), or a sequence of n tensors (B, S, H, D)
        A sequence of mixed dtypes is merged in float32 (float64 if one is) and returned in the dtype
        of ``outs[0]``.
    lses : float32 torch.Tensor (n, B, H, S), or a sequence of n tensors (B, H, S)

    Returns
    -------
    out : torch.Tensor (B, S, H, D), lse : float32 torch.Tensor (B, H, S)
    """
    dtype = None
    if isinstance(outs, (list, tuple)):
        dtype = outs[0].dtype
        work = dtype
        if any(x.dtype != dtype for x in outs):
            work = torch.float64 if any(x.dtype == torch.float64 for x in outs) else torch.float32
        outs = torch.stack([x.to(work) for x in outs])
    if isinstance(lses, (list, tuple)):
        lses = torch.stack(list(lses))
    out, lse = _merge_states_op(outs, lses)
    return (out if dtype is None or out.dtype == dtype else out.to(dtype)), lse
