"""JAX over cuflash: exact FlashAttention inside ``jax.jit``, with no build step.

Each function here is a JAX function (``jax.jit``, ``jax.grad``, ``jax.lax.scan``, ``jax.checkpoint``
trace it) whose kernels are cuflash's, launched from a ``jax.experimental.buffer_callback``: XLA
hands the callback its CUDA stream and the device buffers of the operands and results, and cuflash
runs on that stream, reading and writing those buffers in place (:mod:`._jax_stream`,
:mod:`._jax_buffers`). No copy, no host synchronisation, and nothing to compile ahead of time:
cuflash's kernels are compiled with NVRTC at their first use, as from CuPy.

- :func:`attention`: :func:`cuflash.attention` with its options, differentiable
  (``jax.custom_vjp``: the backward is :func:`cuflash.attention_backward`; residuals q, k, v, out,
  lse and the dropout words, never the probabilities; gradients for q, k, v, ``bias`` and ``sinks``).
- :func:`attention_varlen`: packed sequences of different lengths, differentiable.
- :func:`decode`: new tokens against a (paged) KV cache, appending into it; the new caches alias
  the given ones, so a donated cache is updated in place.
- :func:`merge_states`: combine partial results over disjoint keys.
- :func:`dropout_state`: the (seed, offset) that a dropout key gives, for the float64 reference.

User modifiers (``score_mod=`` a :class:`cuflash.ScoreMod`, ``mask_mod=`` a :class:`cuflash.MaskMod`) are
taken by :func:`attention`, :func:`attention_varlen` and :func:`decode` with JAX arrays as their array
arguments: split when traced into their static part (expression, grad, scalars) and their arrays, which
become operands of the callback, around whose buffers the modifiers are rebuilt (:mod:`._jax_modifiers`).

Shapes, dtypes and options are checked when the function is traced (``jax.eval_shape`` raises the
same TypeError/ValueError, naming the argument); the options are static (Python values). Layouts are
cuflash's: (B, S, H, D), lse (B, H, S).

Memory. cuflash's temporaries (split-KV partials, backward accumulators, the dbias buffer) come from
CuPy's memory pool, beside XLA's: give CuPy room (``XLA_PYTHON_CLIENT_MEM_FRACTION``, by default XLA
takes 75% of the GPU at its first use).

Command buffers. XLA may record custom calls into CUDA graphs ("command buffers") and replay them
with no Python callback. :data:`COMMAND_BUFFERS` (default True) chooses whether cuflash's callbacks
let it (read when a function is traced); see docs/jax.md.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.experimental.buffer_callback import buffer_callback

from .. import _checks
from ..attention import _forward_with_rng_words, _varlen_with_rng_words
from ..backward import attention_backward, attention_varlen_backward
from ..decode import decode as _decode, varlen_over_cache as _decode_varlen_over_cache
from ..merge import merge_states as _merge_states
from . import _jax_buffers, _jax_vmap
from ._jax_buffers import Views, poison
from ._jax_checks import (check_array, check_attention, check_decode, check_dropout_rng, check_kv_format,
                          check_kv_scales, check_merge, check_varlen, check_varlen_over_cache)
from ._jax_modifiers import check_differentiable
from ._jax_modifiers import split as split_modifiers
from ._jax_rng import state_words
from ._jax_stream import on_xla_stream

__all__ = ["COMMAND_BUFFERS", "attention", "attention_varlen", "decode", "dropout_state", "merge_states"]

#: Whether XLA may record cuflash's calls into its CUDA graphs (``command_buffer_compatible``); read
#: when a function is traced. Each recorded call has state of its own (cuflash._runtime.capture.call_state),
#: so XLA may run two of them at once; docs/jax.md says what it was measured to change.
COMMAND_BUFFERS = True

_SCORE_ARRAYS = ("alibi_slopes", "mask", "bias", "block_mask", "sinks")
_RNG_LAYOUT = ((2,), np.uint64)   # the four uint32 words of _jax_rng, read as cuflash's (seed, offset)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _layout(x) -> tuple:
    return tuple(x.shape), np.dtype(x.dtype)


def _ptr(buffer) -> int:
    return buffer.__cuda_array_interface__["data"][0]


def dropout_state(key):
    """The dropout state, ``(seed, offset)``, that cuflash draws its mask from for a JAX key.

    :func:`attention` and :func:`attention_varlen` with ``dropout_p > 0`` and ``dropout_rng=key``
    drop score element (b, h, i, j) as :func:`cuflash.attention` does with ``rng_state = (seed,
    offset)`` (Philox4x32-10, :mod:`cuflash.random`): the float64 reference
    (:func:`cuflash.reference.attention_forward`) reproduces a call from this state.

    Parameters
    ----------
    key : JAX PRNG key
        ``jax.random.key(seed)`` (or a raw uint32 (2,) key), the ``dropout_rng`` of the call.

    Returns
    -------
    jax.Array, uint32 (4,)
        ``[seed_lo, seed_hi, offset, 0]``: the uint64 pair (seed, offset) as little-endian words
        (JAX has no uint64 without ``jax_enable_x64``); ``np.asarray(words).view(np.uint64)`` is
        cuflash's ``rng_state``.

    Examples
    --------
    >>> import jax, numpy as np
    >>> import cuflash.interop.jax as cj
    >>> words = cj.dropout_state(jax.random.key(0))
    >>> seed, offset = np.asarray(words).view(np.uint64)
    """
    check_dropout_rng(key, 1.0)
    return state_words(key)


# ----------------------------------------------------------------------------- attention


class _AttentionSpec(NamedTuple):
    """What a traced attention call fixes: layouts, options, the score arrays given (by name)."""

    q: tuple
    k: tuple
    dtype: np.dtype
    causal: bool
    scale: object
    window: object
    softcap: float
    block_size: tuple
    dropout_p: float
    deterministic: bool
    arrays: tuple        # names of the score arrays given, in _SCORE_ARRAYS order
    array_layouts: tuple
    command_buffers: bool
    mods: object = None  # _jax_modifiers.Modifiers: score_mod / mask_mod, their arrays operands after the above
    v: tuple = None      # v's shape when its head dim is its own (None: k's)

    def options(self) -> dict:
        return dict(causal=self.causal, scale=self.scale, window=self.window, softcap=self.softcap,
                    block_size=self.block_size, dropout_p=self.dropout_p)

    def v_shape(self) -> tuple:
        return self.v or self.k

    def out_shape(self) -> tuple:
        """out's (and dout's) shape: q's with v's head dim."""
        return (*self.q[:-1], self.v_shape()[-1])

    def mod_layouts(self) -> tuple:
        return self.mods.layouts if self.mods is not None else ()


def _command_buffers(head_dim: int, chunk: int = 8) -> bool:
    # A head dim that is not a multiple of 8 (16 for an fp8 cache: its rows' 16-byte chunks) costs
    # cuflash padded copies, which a capture refuses.
    return bool(COMMAND_BUFFERS) and head_dim % chunk == 0


def _own_v(k, v):
    """v's shape for a spec when its head dim is its own (issue 53), else None (the spec, and so its
    cached callbacks, stay those of a call without one)."""
    return tuple(v.shape) if v.shape[-1] != k.shape[-1] else None


@functools.lru_cache(maxsize=256)
def _forward_call(spec: _AttentionSpec):
    """The buffer_callback of the forward: (q, k, v, *score arrays, *modifier arrays, [words]) -> (out, lse)."""
    b, sq, hq, _ = spec.q
    dtype, dropout, mods = spec.dtype, spec.dropout_p > 0, spec.mods
    n_arrays = len(spec.arrays)
    n_in = 3 + n_arrays + len(spec.mod_layouts())
    inputs = Views(((spec.q, dtype), (spec.k, dtype), (spec.v_shape(), dtype), *spec.array_layouts,
                    *spec.mod_layouts()))
    outputs = Views(((spec.out_shape(), dtype), ((b, hq, sq), np.float32)))
    options, names = spec.options(), spec.arrays

    def callback(ctx, results, *args):
        with on_xla_stream(ctx, args[0]) as where:
            q, k, v, *arrays = inputs(args[:n_in], where.device)
            out, lse = outputs(results, where.device)
            if _jax_buffers.POISON:
                poison((out, lse))
            score_mod, mask_mod = mods.rebuild(arrays[n_arrays:]) if mods is not None else (None, None)
            _forward_with_rng_words(q, k, v, _ptr(args[n_in]) if dropout else None, out=out, lse=lse,
                                    score_mod=score_mod, mask_mod=mask_mod, **options,
                                    **dict(zip(names, arrays)))

    call = buffer_callback(callback, (_sds(spec.out_shape(), dtype), _sds((b, hq, sq), np.float32)),
                           command_buffer_compatible=spec.command_buffers)
    return _jax_vmap.batchable(call, functools.partial(_forward_fold, spec))


def _attention_fold(spec: _AttentionSpec, n: int, batched, args, lead: int):
    """(the spec of the folded call, its arguments) under ``jax.vmap``, or None where the call does not
    fold (:mod:`._jax_vmap`). ``lead``: the arguments that start with the batch axis (q, k, v in the
    forward; dout, q, k, v, out, lse in the backward), the score arrays after them."""
    if spec.dropout_p or spec.mods is not None:
        return None
    arrays, arrays_mapped = args[lead:], batched[lead:]
    if "sinks" in spec.arrays and arrays_mapped[spec.arrays.index("sinks")]:
        return None
    b = spec.q[0]
    folded = [_jax_vmap.fold_batch(x, mapped, n) for x, mapped in zip(args[:lead], batched[:lead])]
    for name, x, mapped in zip(spec.arrays, arrays, arrays_mapped):
        folded.append(x if name == "sinks" else
                      _jax_vmap.fold_broadcast(x, mapped, n, b, 2 if name == "alibi_slopes" else 4))
    spec = spec._replace(q=(n * b, *spec.q[1:]), k=(n * b, *spec.k[1:]),
                         v=None if spec.v is None else (n * b, *spec.v[1:]),
                         array_layouts=tuple(_layout(x) for x in folded[lead:]))
    return spec, folded


def _forward_fold(spec, n, batched, args):
    folded = _attention_fold(spec, n, batched, args, 3)
    if folded is None:
        return None
    return tuple(_jax_vmap.unfold(x, n) for x in _forward_call(folded[0])(*folded[1]))


def _backward_fold(spec, with_dlse, n, batched, args):
    arrays_end = len(args) - with_dlse   # dlse, (B, Hq, Sq), last
    folded = _attention_fold(spec, n, batched[:arrays_end], args[:arrays_end], 6)
    if folded is None:
        return None
    dlse = (_jax_vmap.fold_batch(args[-1], batched[-1], n),) if with_dlse else ()
    results = _backward_call(folded[0], False, False, with_dlse)(*folded[1], *dlse)
    return tuple(_jax_vmap.unfold(x, n) for x in results)


@functools.lru_cache(maxsize=256)
def _backward_call(spec: _AttentionSpec, want_dbias: bool, want_dsinks: bool = False, with_dlse: bool = False):
    """The buffer_callback of the backward: (dout, q, k, v, out, lse, *score arrays, *modifier arrays,
    [words], [dlse]) -> (dq, dk, dv[, dbias][, dsinks]); ``with_dlse``: the loss reads lse, whose
    cotangent (B, Hq, Sq) comes last."""
    b, sq, hq, _ = spec.q
    dtype, dropout, mods = spec.dtype, spec.dropout_p > 0, spec.mods
    n_arrays = len(spec.arrays)
    o = spec.out_shape()
    inputs = Views(((o, dtype), (spec.q, dtype), (spec.k, dtype), (spec.v_shape(), dtype), (o, dtype),
                    ((b, hq, sq), np.float32), *spec.array_layouts, *spec.mod_layouts(),
                    *((_RNG_LAYOUT,) if dropout else ()), *((((b, hq, sq), np.float32),) if with_dlse else ())))
    bias_layout = spec.array_layouts[spec.arrays.index("bias")] if want_dbias else None
    result_layouts = ((spec.q, dtype), (spec.k, dtype), (spec.v_shape(), dtype),
                      *((bias_layout,) if want_dbias else ()),
                      *((((hq,), np.float32),) if want_dsinks else ()))
    outputs = Views(result_layouts)
    options, names = spec.options(), spec.arrays
    # dbias sums dS over the axes bias was broadcast along, and dsinks comes from per-CTA partial sums,
    # both in CuPy's pool: not capturable.
    command_buffers = spec.command_buffers and not want_dbias and not want_dsinks

    def callback(ctx, results, *args):
        with on_xla_stream(ctx, args[0]) as where:
            dout, q, k, v, out, lse, *arrays = inputs(args, where.device)
            dlse = arrays.pop() if with_dlse else None
            rng_state = arrays.pop() if dropout else None
            grads = outputs(results, where.device)
            if _jax_buffers.POISON:
                poison(grads)
            score_mod, mask_mod = mods.rebuild(arrays[n_arrays:]) if mods is not None else (None, None)
            found = attention_backward(dout, q, k, v, out, lse, rng_state=rng_state, deterministic=spec.deterministic,
                                       return_dbias=want_dbias, return_dsinks=want_dsinks, dq=grads[0], dk=grads[1],
                                       dv=grads[2], score_mod=score_mod, mask_mod=mask_mod, dlse=dlse, **options,
                                       **dict(zip(names, arrays[:n_arrays])))
            if want_dbias:
                _copy_bits(grads[3], found[3])
            if want_dsinks:   # last of both
                _copy_bits(grads[-1], found[-1])

    call = buffer_callback(callback, tuple(_sds(*layout) for layout in result_layouts),
                           command_buffer_compatible=command_buffers)
    # dbias and dsinks sum over axes that a folded call would share between instances.
    return _jax_vmap.batchable(call, None if want_dbias or want_dsinks else
                               functools.partial(_backward_fold, spec, with_dlse))


def _copy_bits(target, source) -> None:
    """``target[...] = source`` of one dtype, as unsigned integers (a plain copy for bfloat16 too)."""
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[target.itemsize]
    target.view(uint)[...] = source.view(uint)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec, q, k, v, arrays, mod_arrays, words):
    return tuple(_forward_call(spec)(q, k, v, *arrays, *mod_arrays, *words))


def _attention_fwd(spec, q, k, v, arrays, mod_arrays, words):
    # symbolic_zeros: every leaf comes as CustomVJPPrimal (value, perturbed); only a perturbed bias
    # needs dbias, whose float32 (B, Hq, Sq, Sk) buffer the backward then makes, and only perturbed
    # sinks need dsinks (the backward asks return_dsinks).
    want_dbias = "bias" in spec.arrays and arrays[spec.arrays.index("bias")].perturbed
    want_dsinks = "sinks" in spec.arrays and arrays[spec.arrays.index("sinks")].perturbed
    if want_dbias and spec.mods is not None and spec.mods.score_mod is not None and spec.softcap:
        raise ValueError("the gradient of cuflash.interop.jax.attention with respect to bias is not computed beside "
                         "both a score_mod and a softcap (cuflash.attention_backward refuses return_dbias with them): "
                         "put the cap inside the score_mod, or pass jax.lax.stop_gradient(bias)")
    # Differentiated with respect to nothing that has a gradient (a modifier's arrays alone): no backward.
    backward = q.perturbed or k.perturbed or v.perturbed or want_dbias or want_dsinks
    if backward:
        check_differentiable(spec.mods, "attention")
    q, k, v = q.value, k.value, v.value
    arrays = tuple(x.value for x in arrays)
    mod_arrays = tuple(x.value for x in mod_arrays)
    words = tuple(x.value for x in words)
    out, lse = _forward_call(spec)(q, k, v, *arrays, *mod_arrays, *words)
    # The two flags travel as pytree structure (an empty tuple or a tuple holding one), not as data.
    wanted = (((),) if want_dbias else (), ((),) if want_dsinks else (), ((),) if backward else ())
    return (out, lse), (q, k, v, arrays, mod_arrays, words, out, lse, wanted)


def _attention_bwd(spec, residuals, cotangents):
    q, k, v, arrays, mod_arrays, words, out, lse, wanted = residuals
    want_dbias, want_dsinks, backward = bool(wanted[0]), bool(wanted[1]), bool(wanted[2])
    dout, dlse = cotangents   # dlse: a symbolic zero unless the loss reads the returned lse
    none = tuple(None for _ in arrays)
    # No gradient for a modifier's arrays: their cotangents are symbolic zeros (docs/jax.md).
    no_mod_grads = tuple(None for _ in mod_arrays)
    with_dlse = not isinstance(dlse, SymbolicZero)
    if (isinstance(dout, SymbolicZero) and not with_dlse) or not backward:
        return None, None, None, none, no_mod_grads, tuple(None for _ in words)
    dout = jnp.zeros(out.shape, spec.dtype) if isinstance(dout, SymbolicZero) else dout.astype(spec.dtype)
    words_u64 = words   # the same four words; the backward's callback views them as uint64 (2,)
    grads = _backward_call(spec, want_dbias, want_dsinks, with_dlse)(
        dout, q, k, v, out, lse, *arrays, *mod_arrays, *words_u64, *((dlse.astype(jnp.float32),) if with_dlse else ()))
    extra = {"bias": grads[3] if want_dbias else None, "sinks": grads[-1] if want_dsinks else None}
    array_grads = tuple(extra.get(name) for name in spec.arrays)
    return grads[0], grads[1], grads[2], array_grads, no_mod_grads, tuple(None for _ in words)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None, mask=None,
              bias=None, block_mask=None, block_size=(128, 128), dropout_p=0.0, dropout_rng=None,
              deterministic=False, return_lse=False, score_mod=None, mask_mod=None, sinks=None):
    """Exact attention of JAX arrays on cuflash's kernels, differentiable, inside ``jax.jit``.

    :func:`cuflash.attention` as a JAX function: the same options and layout, run on XLA's stream
    in XLA's buffers. ``jax.grad`` runs :func:`cuflash.attention_backward` (FlashAttention's
    backward: the probabilities are recomputed from the saved lse).

    Parameters
    ----------
    q : jax.Array (B, Sq, Hq, D)
        float16, bfloat16 or float32, on a CUDA device.
    k : jax.Array (B, Sk, Hk, D), the dtype of q
        ``Hq % Hk == 0``: query head h reads kv head ``h // (Hq // Hk)`` (GQA; Hk = 1 is MQA).
    v : jax.Array (B, Sk, Hk, D_v), the dtype of q
        D and D_v from 1 to 256 (multiples of 8 run without padded copies); D_v may differ from D
        (DeepSeek's (192, 128)): out then has D_v columns.
    causal : bool, default False
        Bottom-right aligned: query i sees key j iff ``j <= i + Sk - Sq``.
    scale : float, optional
        Multiplies ``q . k``; default ``1 / sqrt(D)``.
    window : (int, int), optional
        Sliding window ``(left, right)``, inclusive, -1 unbounded, as in :func:`cuflash.attention`.
    softcap : float, default 0.0
        If > 0, ``s = softcap * tanh(s / softcap)``.
    alibi_slopes : jax.Array float32 (Hq,) or (B, Hq), optional
        ALiBi slopes (no gradient).
    mask : jax.Array bool broadcastable to (B, Hq, Sq, Sk), optional
        True = may attend; broadcast by zero strides, never materialised.
    bias : jax.Array broadcastable to (B, Hq, Sq, Sk), optional
        float32, float16 or bfloat16, added to the scores. Differentiable: when it is differentiated
        the backward also returns dL/dbias (summed over its broadcast axes), at the cost of a float32
        (B, Hq, Sq, Sk) buffer in that backward.
    block_mask : jax.Array bool broadcastable to (B, Hq, ceil(Sq / bq), ceil(Sk / bk)), optional
        Block-sparse attention over blocks of ``block_size``.
    block_size : (int, int), default (128, 128)
        ``(bq, bk)`` of ``block_mask``.
    dropout_p : float, default 0.0
        Inverted dropout on the probabilities, in [0, 1).
    dropout_rng : JAX PRNG key, optional
        Required when ``dropout_p > 0``: the mask is drawn from ``dropout_state(dropout_rng)`` inside
        the traced program (a new key, a new mask; the same key, the same mask, in the forward and in
        its backward, also under ``jax.checkpoint``).
    deterministic : bool, default False
        Bitwise reproducible gradients (see :func:`cuflash.attention_backward`).
    return_lse : bool, default False
        Also return the log-sum-exp of every row. Differentiable: a loss that reads it (partial
        results combined with :func:`merge_states`, a penalty on large lse) gets its gradient
        through q, k (and bias, sinks), :func:`cuflash.attention_backward`'s ``dlse``.
    score_mod : cuflash.ScoreMod, optional
        A user-written score modifier, applied as in :func:`cuflash.attention`. Its array arguments
        are JAX arrays (traced values too; NumPy arrays become constants), operands of the call; its
        expression and scalars are static (a new scalar value traces again, as any option). Under
        ``jax.grad`` a ScoreMod whose derivative is not 1 needs its ``grad`` (a ValueError naming
        score_mod when the gradient is traced), and no gradient flows to its arrays (zeros).
    mask_mod : cuflash.MaskMod, optional
        A user-written mask (True = may attend), ANDed with the other masks; its arguments as
        ``score_mod``'s.
    sinks : jax.Array float32 (Hq,), optional
        Attention sinks (gpt-oss), as in :func:`cuflash.attention`: each row's softmax denominator
        gains ``exp(sinks[h])``, with no value; lse includes it. Differentiable: when it is
        differentiated the backward also returns dL/dsinks (``return_dsinks``).

    Returns
    -------
    out : jax.Array (B, Sq, Hq, D_v), the dtype of q
    lse : jax.Array float32 (B, Hq, Sq)
        Only with ``return_lse``; ``-inf`` (``sinks[h]`` with sinks) for a row that sees no key.

    Raises
    ------
    TypeError
        When traced: a non-array argument, a dtype out of contract (q's, mixed dtypes, a mask that is
        not bool, ...), an option of the wrong type, a ``dropout_rng`` that is not a key; a
        ``score_mod``/``mask_mod`` that is not a ScoreMod/MaskMod, an array argument of theirs that
        is not a JAX array or of a dtype their expression refuses (named).
    ValueError
        When traced: shapes, heads or head dims that do not match, options out of range, an array
        option that does not broadcast, ``dropout_p > 0`` without ``dropout_rng``, more than 8 array
        or scalar modifier arguments. When the gradient is traced: a ``score_mod`` without the
        ``grad`` it needs, a differentiated ``bias`` beside a ``score_mod``.

    See Also
    --------
    cuflash.attention : the same on CuPy arrays.
    attention_varlen : packed sequences.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import cuflash.interop.jax as cj
    >>> kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    >>> q = jax.random.normal(kq, (2, 1024, 8, 64), jnp.bfloat16)
    >>> k = jax.random.normal(kk, (2, 1024, 2, 64), jnp.bfloat16)     # GQA: 8 query heads, 2 kv heads
    >>> v = jax.random.normal(kv, (2, 1024, 2, 64), jnp.bfloat16)
    >>> loss = lambda q, k, v: jnp.mean(jnp.square(cj.attention(q, k, v, causal=True).astype(jnp.float32)))
    >>> dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    """
    q, k, v = check_array(q, "q"), check_array(k, "k"), check_array(v, "v")
    given = {name: check_array(x, name) for name, x in zip(_SCORE_ARRAYS, (alibi_slopes, mask, bias, block_mask,
                                                                           sinks)) if x is not None}
    scale, window, softcap, dropout_p, block_size, deterministic = check_attention(
        q, k, v, causal=causal, scale=scale, window=window, softcap=softcap, block_size=block_size,
        dropout_p=dropout_p, deterministic=deterministic, **{n: given.get(n) for n in _SCORE_ARRAYS})
    check_dropout_rng(dropout_rng, dropout_p)
    return_lse = _checks.check_flag(return_lse, "return_lse")
    mods, mod_arrays = split_modifiers(score_mod, mask_mod)
    spec = _AttentionSpec(tuple(q.shape), tuple(k.shape), np.dtype(q.dtype), bool(causal), scale, window, softcap,
                          block_size, dropout_p, deterministic, tuple(given), tuple(_layout(x) for x in given.values()),
                          _command_buffers(q.shape[-1]) and _command_buffers(v.shape[-1]), mods, _own_v(k, v))
    words = (state_words(dropout_rng),) if dropout_p else ()
    out, lse = _attention(spec, q, k, v, tuple(given.values()), mod_arrays, words)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- varlen


class _VarlenSpec(NamedTuple):
    q: tuple
    k: tuple
    dtype: np.dtype
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    scale: object
    window: object
    softcap: float
    dropout_p: float
    deterministic: bool
    alibi: object        # the layout of alibi_slopes, or None
    command_buffers: bool
    sinks: bool = False  # sinks (float32 (Hq,)) given: an operand after alibi_slopes
    mods: object = None  # _jax_modifiers.Modifiers: score_mod / mask_mod, their arrays operands after sinks
    v: tuple = None      # v's shape when its head dim is its own (None: k's)

    def options(self) -> dict:
        return dict(max_seqlen_q=self.max_seqlen_q, max_seqlen_k=self.max_seqlen_k, causal=self.causal,
                    scale=self.scale, window=self.window, softcap=self.softcap, dropout_p=self.dropout_p)

    v_shape, out_shape = _AttentionSpec.v_shape, _AttentionSpec.out_shape


def _varlen_inputs(spec: _VarlenSpec) -> tuple:
    cu = ((spec.batch + 1,), np.int32)
    return (cu, cu, *((spec.alibi,) if spec.alibi is not None else ()),
            *((((spec.q[1],), np.float32),) if spec.sinks else ()), *(spec.mods.layouts if spec.mods else ()))


def _varlen_arrays(spec: _VarlenSpec, rest) -> dict:
    """alibi_slopes, sinks, score_mod and mask_mod of a varlen callback from its operands after the offsets."""
    alibi = spec.alibi is not None
    n = alibi + spec.sinks
    score_mod, mask_mod = spec.mods.rebuild(rest[n:n + len(spec.mods.layouts)]) if spec.mods else (None, None)
    return dict(alibi_slopes=rest[0] if alibi else None, sinks=rest[alibi] if spec.sinks else None,
                score_mod=score_mod, mask_mod=mask_mod)


@functools.lru_cache(maxsize=256)
def _varlen_forward_call(spec: _VarlenSpec):
    """(q, k, v, cu_q, cu_k, [alibi], [sinks], *modifier arrays, [words]) -> (out, lse (Hq, total_q))."""
    total_q, hq, _ = spec.q
    dtype, dropout, alibi = spec.dtype, spec.dropout_p > 0, spec.alibi is not None
    n_in = 5 + alibi + spec.sinks + (len(spec.mods.layouts) if spec.mods else 0)
    inputs = Views(((spec.q, dtype), (spec.k, dtype), (spec.v_shape(), dtype), *_varlen_inputs(spec)))
    outputs = Views(((spec.out_shape(), dtype), ((hq, total_q), np.float32)))
    options = spec.options()

    def callback(ctx, results, *args):
        with on_xla_stream(ctx, args[0]) as where:
            q, k, v, cu_q, cu_k, *rest = inputs(args[:n_in], where.device)
            out, lse = outputs(results, where.device)
            if _jax_buffers.POISON:
                poison((out, lse))
            # check=False: a bad offset is found on the GPU, makes the call write nothing, and is
            # raised by the next varlen call on this stream (cuflash.check_errors() asks at once).
            _varlen_with_rng_words(q, k, v, cu_q, cu_k, _ptr(args[n_in]) if dropout else None, out=out, lse=lse,
                                   check=False, **_varlen_arrays(spec, rest), **options)

    return _jax_vmap.batchable(buffer_callback(callback, (_sds(spec.out_shape(), dtype),
                                                          _sds((hq, total_q), np.float32)),
                                               command_buffer_compatible=spec.command_buffers))


@functools.lru_cache(maxsize=256)
def _varlen_backward_call(spec: _VarlenSpec, with_dlse: bool = False):
    """(dout, q, k, v, out, lse, cu_q, cu_k, [alibi], [sinks], *modifier arrays, [words], [dlse]) -> (dq, dk,
    dv[, dsinks]); ``with_dlse``: the loss reads lse, whose cotangent (Hq, total_q) comes last.

    With sinks the backward always returns dsinks (the varlen vjp does not see which inputs are
    differentiated): one more small launch."""
    total_q, hq, _ = spec.q
    dtype, dropout = spec.dtype, spec.dropout_p > 0
    o = spec.out_shape()
    inputs = Views(((o, dtype), (spec.q, dtype), (spec.k, dtype), (spec.v_shape(), dtype), (o, dtype),
                    ((hq, total_q), np.float32), *_varlen_inputs(spec), *((_RNG_LAYOUT,) if dropout else ()),
                    *((((hq, total_q), np.float32),) if with_dlse else ())))
    result_layouts = ((spec.q, dtype), (spec.k, dtype), (spec.v_shape(), dtype),
                      *((((hq,), np.float32),) if spec.sinks else ()))
    outputs = Views(result_layouts)
    options = spec.options()
    command_buffers = spec.command_buffers and not spec.sinks   # dsinks' partial sums: CuPy's pool

    def callback(ctx, results, *args):
        with on_xla_stream(ctx, args[0]) as where:
            dout, q, k, v, out, lse, cu_q, cu_k, *rest = inputs(args, where.device)
            dlse = rest.pop() if with_dlse else None
            grads = outputs(results, where.device)
            if _jax_buffers.POISON:
                poison(grads)
            found = attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                              rng_state=rest[-1] if dropout else None, return_dsinks=spec.sinks,
                                              deterministic=spec.deterministic, dq=grads[0], dk=grads[1], dv=grads[2],
                                              check=False, dlse=dlse, **_varlen_arrays(spec, rest), **options)
            if spec.sinks:
                _copy_bits(grads[3], found[3])

    return _jax_vmap.batchable(buffer_callback(callback, tuple(_sds(*layout) for layout in result_layouts),
                                               command_buffer_compatible=command_buffers))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_varlen(spec, q, k, v, cu_q, cu_k, arrays):
    return tuple(_varlen_forward_call(spec)(q, k, v, cu_q, cu_k, *arrays))


def _varlen_fwd(spec, q, k, v, cu_q, cu_k, arrays):
    # symbolic_zeros: every leaf comes as CustomVJPPrimal (value, perturbed), and an output the loss does
    # not read (lse, mostly) has a symbolic zero cotangent.
    check_differentiable(spec.mods, "attention_varlen")
    q, k, v, cu_q, cu_k = (x.value for x in (q, k, v, cu_q, cu_k))
    arrays = tuple(x.value for x in arrays)
    out, lse = _varlen_forward_call(spec)(q, k, v, cu_q, cu_k, *arrays)
    return (out, lse), (q, k, v, cu_q, cu_k, arrays, out, lse)


def _varlen_bwd(spec, residuals, cotangents):
    q, k, v, cu_q, cu_k, arrays, out, lse = residuals
    dout, dlse = cotangents
    with_dlse = not isinstance(dlse, SymbolicZero)
    if isinstance(dout, SymbolicZero) and not with_dlse:
        return None, None, None, None, None, tuple(None for _ in arrays)
    dout = jnp.zeros(out.shape, spec.dtype) if isinstance(dout, SymbolicZero) else dout.astype(spec.dtype)
    grads = _varlen_backward_call(spec, with_dlse)(dout, q, k, v, out, lse, cu_q, cu_k, *arrays,
                                                   *((dlse.astype(jnp.float32),) if with_dlse else ()))
    # arrays: [alibi], [sinks], *modifier arrays, [words]; only sinks get a gradient (a modifier's
    # arrays none: zeros, docs/jax.md)
    array_grads = [None] * len(arrays)
    if spec.sinks:
        array_grads[int(spec.alibi is not None)] = grads[3]
    return grads[0], grads[1], grads[2], None, None, tuple(array_grads)


_attention_varlen.defvjp(_varlen_fwd, _varlen_bwd, symbolic_zeros=True)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k=None, causal=False,
                     scale=None, window=None, softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_rng=None,
                     deterministic=False, return_lse=False, score_mod=None, mask_mod=None, sinks=None,
                     cache_seqlens=None, block_table=None):
    """Attention over sequences of different lengths packed without padding, differentiable.

    :func:`cuflash.attention_varlen` as a JAX function; ``jax.grad`` runs
    :func:`cuflash.attention_varlen_backward`. Sequence b holds rows ``cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1] - 1`` of q and ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1`` of k and v.

    Parameters
    ----------
    q : jax.Array (total_q, Hq, D)
        float16, bfloat16 or float32.
    k : jax.Array (total_k, Hk, D), the dtype of q
    v : jax.Array (total_k, Hk, D_v), the dtype of q (D_v as in :func:`attention`)
    cu_seqlens_q : jax.Array int32 (B + 1,)
        Offsets of the query sequences (0 first, never decreasing, at most total_q); traced values,
        checked on the GPU: a call with bad offsets writes nothing (its results are undefined) and
        the fault is raised by the next varlen call (or ``cuflash.check_errors()``).
    cu_seqlens_k : jax.Array int32 (B + 1,)
        Offsets of the key sequences, likewise.
    max_seqlen_q : int
        A bound of the longest query sequence (static: it sizes the grid; checked on the GPU).
    max_seqlen_k : int
        A bound of the longest key sequence.
    causal, scale, window, softcap, alibi_slopes, dropout_p, dropout_rng, deterministic, sinks
        As in :func:`attention` (per sequence, bottom-right aligned; alibi_slopes (Hq,) or (B, Hq);
        sinks float32 (Hq,), differentiable: with sinks the backward always computes dsinks).
    return_lse : bool, default False
        Also return the lse, float32 (Hq, total_q); differentiable, as in :func:`attention`.
    score_mod, mask_mod : cuflash.ScoreMod, cuflash.MaskMod, optional
        As in :func:`attention`; ``b`` is the sequence's index and ``q_idx``, ``kv_idx`` positions within
        the sequence.
    cache_seqlens, block_table : jax.Array int32 (B,) and (B, max_pages), optional
        Chunked prefill, as in :func:`cuflash.attention_varlen`: ``k`` and ``v`` are KV caches
        (contiguous (B, L, Hk, D), or paged (num_pages, page_size, Hk, D) with ``block_table``) that
        already hold each sequence's new tokens, ``cu_seqlens_k`` and ``max_seqlen_k`` are None; sequence
        b's queries see its ``cache_seqlens[b]`` keys bottom-right aligned, as in :func:`decode`. Not
        differentiable (a ValueError when differentiated), no dropout.

    Returns
    -------
    out : jax.Array (total_q, Hq, D_v), the dtype of q
        Rows past the last offset are not written (undefined).
    lse : jax.Array float32 (Hq, total_q)
        Only with ``return_lse``.

    Raises
    ------
    TypeError
        When traced: as :func:`attention`; offsets that are not int32; ``max_seqlen_*`` not an int.
    ValueError
        When traced: as :func:`attention`; offsets not 1-d or of different lengths, a negative
        ``max_seqlen_*``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import cuflash.interop.jax as cj
    >>> cu = jnp.array([0, 100, 137, 649], jnp.int32)             # three sequences, 649 rows
    >>> q = k = v = jax.random.normal(jax.random.key(1), (649, 8, 64), jnp.float16)
    >>> out = jax.jit(lambda q, k, v, cu: cj.attention_varlen(q, k, v, cu, cu, max_seqlen_q=512,
    ...                                                       max_seqlen_k=512, causal=True))(q, k, v, cu)
    """
    if cache_seqlens is not None or block_table is not None:
        return _varlen_over_cache(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                  window, softcap, alibi_slopes, dropout_p, return_lse, score_mod, mask_mod, sinks,
                                  cache_seqlens, block_table)
    q, k, v = check_array(q, "q"), check_array(k, "k"), check_array(v, "v")
    cu_q, cu_k = check_array(cu_seqlens_q, "cu_seqlens_q"), check_array(cu_seqlens_k, "cu_seqlens_k")
    alibi = check_array(alibi_slopes, "alibi_slopes") if alibi_slopes is not None else None
    sinks = check_array(sinks, "sinks") if sinks is not None else None
    if max_seqlen_q is None or max_seqlen_k is None:
        raise TypeError("max_seqlen_q and max_seqlen_k must be ints (static bounds of the sequence lengths)")
    max_q, max_k, scale, window, softcap, dropout_p, deterministic = check_varlen(
        q, k, v, cu_q, cu_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, scale=scale,
        window=window, softcap=softcap, alibi_slopes=alibi, dropout_p=dropout_p, deterministic=deterministic,
        sinks=sinks)
    check_dropout_rng(dropout_rng, dropout_p)
    return_lse = _checks.check_flag(return_lse, "return_lse")
    mods, mod_arrays = split_modifiers(score_mod, mask_mod)
    spec = _VarlenSpec(tuple(q.shape), tuple(k.shape), np.dtype(q.dtype), cu_q.shape[0] - 1, max_q, max_k,
                       bool(causal), scale, window, softcap, dropout_p, deterministic,
                       _layout(alibi) if alibi is not None else None,
                       _command_buffers(q.shape[-1]) and _command_buffers(v.shape[-1]), sinks is not None, mods,
                       _own_v(k, v))
    arrays = ((alibi,) if alibi is not None else ()) + ((sinks,) if sinks is not None else ()) + mod_arrays + \
        ((state_words(dropout_rng),) if dropout_p else ())
    out, lse = _attention_varlen(spec, q, k, v, cu_q, cu_k, arrays)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- chunked prefill

_CACHE_ARRAYS = ("block_table", "alibi_slopes", "sinks")
_NO_CACHE_GRAD = ("cuflash.interop.jax.attention_varlen over a KV cache (cache_seqlens / block_table: chunked "
                  "prefill) is not differentiable: apply jax.lax.stop_gradient to its inputs")


@functools.lru_cache(maxsize=256)
def _varlen_cache_call(q_layout, cache_layout, cu_layout, seqlens_layout, names, layouts, max_seqlen_q, causal, window,
                       softcap, scale, command_buffers, mods=None, v_layout=None):
    """(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, *arrays, *modifier arrays) -> (out, lse (Hq, total_q)),
    ``arrays`` cuflash's keyword arguments ``names`` (of _CACHE_ARRAYS); ``v_layout``: v_cache's layout
    when its head dim is its own (out then has its columns)."""
    (total_q, hq, _), dtype = q_layout
    n_arrays = len(names)
    v_layout = v_layout or cache_layout
    inputs = Views((q_layout, cache_layout, v_layout, cu_layout, seqlens_layout, *layouts,
                    *(mods.layouts if mods else ())))
    result_layouts = (((total_q, hq, v_layout[0][-1]), dtype), ((hq, total_q), np.float32))
    outputs = Views(result_layouts)
    options = dict(max_seqlen_q=max_seqlen_q, causal=causal, window=window, softcap=softcap, scale=scale)

    def callback(ctx, results, *args):
        with on_xla_stream(ctx, args[0]) as where:
            q, k_cache, v_cache, cu_q, lens, *arrays = inputs(args, where.device)
            out, lse = outputs(results, where.device)
            if _jax_buffers.POISON:
                poison((out, lse))
            score_mod, mask_mod = mods.rebuild(arrays[n_arrays:]) if mods is not None else (None, None)
            # check=False: bad offsets or lengths are found on the GPU, as in attention_varlen.
            _decode_varlen_over_cache(q, k_cache, v_cache, cu_q, cache_seqlens=lens, out=out, lse=lse,
                                      return_lse=True, check=False, score_mod=score_mod, mask_mod=mask_mod,
                                      **options, **dict(zip(names, arrays[:n_arrays])))

    return _jax_vmap.batchable(buffer_callback(callback, tuple(_sds(*layout) for layout in result_layouts),
                                               command_buffer_compatible=command_buffers))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _refusing_grad(call, *operands):
    return tuple(call(*operands))


def _refusing_grad_fwd(call, *operands):
    raise ValueError(_NO_CACHE_GRAD)


def _refusing_grad_bwd(call, residuals, cotangents):   # pragma: no cover - the forward refuses first
    raise ValueError(_NO_CACHE_GRAD)


_refusing_grad.defvjp(_refusing_grad_fwd, _refusing_grad_bwd)


def _varlen_over_cache(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                       window, softcap, alibi_slopes, dropout_p, return_lse, score_mod, mask_mod, sinks,
                       cache_seqlens, block_table):
    """:func:`attention_varlen` with ``cache_seqlens`` / ``block_table`` (chunked prefill): the trace-time
    checks (:func:`check_varlen_over_cache`), then one buffer_callback."""
    q, k_cache, v_cache = check_array(q, "q"), check_array(k_cache, "k"), check_array(v_cache, "v")
    cu_q = check_array(cu_seqlens_q, "cu_seqlens_q")
    lens = check_array(cache_seqlens, "cache_seqlens") if cache_seqlens is not None else None
    given = {name: check_array(x, name) for name, x in zip(_CACHE_ARRAYS, (block_table, alibi_slopes, sinks))
             if x is not None}
    max_seqlen_q, causal, window, softcap, scale = check_varlen_over_cache(
        q, k_cache, v_cache, cu_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        cache_seqlens=lens, causal=causal, scale=scale, window=window, softcap=softcap, dropout_p=dropout_p,
        **{n: given.get(n) for n in _CACHE_ARRAYS})
    return_lse = _checks.check_flag(return_lse, "return_lse")
    mods, mod_arrays = split_modifiers(score_mod, mask_mod)
    call = _varlen_cache_call(_layout(q), _layout(k_cache), _layout(cu_q), _layout(lens), tuple(given),
                              tuple(_layout(x) for x in given.values()), int(max_seqlen_q), causal, window, softcap,
                              scale, _command_buffers(q.shape[-1]), mods,
                              None if v_cache.shape[-1] == k_cache.shape[-1] else _layout(v_cache))
    out, lse = _refusing_grad(call, q, k_cache, v_cache, cu_q, lens, *given.values(), *mod_arrays)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- decode and merge

_DECODE_ARRAYS = ("block_table", "k_new", "v_new", "mask", "alibi_slopes", "sinks")


@functools.lru_cache(maxsize=256)
def _decode_call(q_layout, cache_layout, seqlens_layout, names, layouts, num_splits, causal, window, softcap, scale,
                 return_lse, command_buffers, mods=None, kv_dtype=None, scale_values=(None, None), v_head_dim=None,
                 v_layout=None):
    """(q, k_cache, v_cache, cache_seqlens, *arrays, *modifier arrays) -> (out, [lse], [k_cache, v_cache]).

    ``arrays`` are cuflash.decode's keyword arguments ``names`` (fp8 scales given as arrays among them).
    fp8 caches (float8_e4m3fn buffers, or uint8) are viewed as their bytes (``Views``); ``kv_dtype`` and
    the scales given as numbers (``scale_values``, None for an array) are fixed here. MLA (``v_head_dim``):
    one latent cache, (q, k_cache, cache_seqlens, ...) -> (out with v_head_dim columns, [lse], [k_cache]).
    ``v_layout``: v_cache's layout when its head dim is its own (out then has its columns)."""
    (b, sq, hq, _), dtype = q_layout
    mla = v_head_dim is not None
    caches = 1 if mla else 2
    append = "k_new" in names
    n_arrays = len(names)
    cache_layouts = (cache_layout,) if mla else (cache_layout, v_layout or cache_layout)
    inputs = Views((q_layout, *cache_layouts, seqlens_layout, *layouts, *(mods.layouts if mods else ())))
    lse_layout = ((b, hq, sq), np.float32)
    out_layout = ((b, sq, hq, v_head_dim), dtype) if mla else ((b, sq, hq, cache_layouts[1][0][-1]), dtype)
    result_layouts = (out_layout, *((lse_layout,) if return_lse else ()), *(cache_layouts if append else ()))
    outputs = Views(result_layouts)
    options = dict(num_splits=num_splits, causal=causal, window=window, softcap=softcap, scale=scale,
                   return_lse=return_lse)
    if mla:
        options["v_head_dim"] = v_head_dim
    if kv_dtype is not None:
        options["kv_dtype"] = kv_dtype
        options.update({name: value for name, value in zip(("k_scale", "v_scale"), scale_values) if value is not None})
    n_new = 1 + return_lse   # outputs before the caches

    def callback(ctx, results, *args):
        with on_xla_stream(ctx, args[0]) as where:
            viewed = inputs(args, where.device)
            q, *caches_in, lens = viewed[:2 + caches]
            arrays = viewed[2 + caches:]
            found = outputs(results, where.device)
            if append:   # the new caches alias the given ones: the kernels append into them in place
                caches_in = found[n_new:]
            k_cache, v_cache = caches_in if not mla else (caches_in[0], None)
            if _jax_buffers.POISON:
                poison(found[:n_new])
            score_mod, mask_mod = mods.rebuild(arrays[n_arrays:]) if mods is not None else (None, None)
            made = _decode(q, k_cache, v_cache, cache_seqlens=lens, out=found[0], check=False, score_mod=score_mod,
                           mask_mod=mask_mod, **options, **dict(zip(names, arrays[:n_arrays])))
            if return_lse:
                found[1][...] = made[1]

    aliases = ({1: n_new} if mla else {1: n_new, 2: n_new + 1}) if append else None
    call = buffer_callback(callback, tuple(_sds(*layout) for layout in result_layouts),
                           input_output_aliases=aliases, command_buffer_compatible=command_buffers)
    key = (q_layout, cache_layout, seqlens_layout, names, layouts, num_splits, causal, window, softcap, scale,
           return_lse, command_buffers, mods, kv_dtype, scale_values, v_head_dim, v_layout)
    return _jax_vmap.batchable(call, functools.partial(_decode_fold, key))


# Arrays of decode read per head: mapped, they cannot join one folded call.
_PER_HEAD_DECODE_ARRAYS = frozenset({"alibi_slopes", "sinks", "k_scale", "v_scale"})


def _decode_fold(key, n, batched, args):
    """The results of one folded decode under ``jax.vmap``, or None where the call does not fold
    (:mod:`._jax_vmap`): q, the lengths and the new rows join the batch; a contiguous cache joins it
    when every instance has its own, a paged one joins its pages when mapped or appended to (each
    instance's table then offset to its pages)."""
    names, mods, v_head_dim, v_layout = key[3], key[12], key[15], key[16]
    if mods is not None or "mask" in names:
        return None
    caches = 1 if v_head_dim is not None else 2
    cache_args, caches_mapped = list(args[1:1 + caches]), batched[1:1 + caches]
    arrays, arrays_mapped = list(args[2 + caches:]), batched[2 + caches:]
    if any(mapped for name, mapped in zip(names, arrays_mapped) if name in _PER_HEAD_DECODE_ARRAYS):
        return None
    if "block_table" in names:
        i = names.index("block_table")
        table = _jax_vmap.leading(arrays[i], arrays_mapped[i], n)
        if any(caches_mapped) or "k_new" in names:
            pages = key[1][0][0]
            cache_args = [_jax_vmap.fold_batch(c, mapped, n) for c, mapped in zip(cache_args, caches_mapped)]
            table = table + (jnp.arange(n, dtype=table.dtype) * pages)[:, None, None]
        arrays[i] = _jax_vmap.fold(table)
    elif all(caches_mapped):
        cache_args = [_jax_vmap.fold(c) for c in cache_args]
    else:
        return None   # a contiguous cache shared by the instances: one call each, not n copies of it
    for i, (name, mapped) in enumerate(zip(names, arrays_mapped)):
        if name in ("k_new", "v_new"):
            arrays[i] = _jax_vmap.fold_batch(arrays[i], mapped, n)
    q = _jax_vmap.fold_batch(args[0], batched[0], n)
    lens = _jax_vmap.fold_batch(args[1 + caches], batched[1 + caches], n)
    folded_key = (_layout(q), _layout(cache_args[0]), _layout(lens), names, tuple(_layout(x) for x in arrays),
                  *key[5:16], None if v_layout is None else _layout(cache_args[1]))
    results = _decode_call(*folded_key)(q, *cache_args, lens, *arrays)
    return tuple(_jax_vmap.unfold(x, n) for x in results)


def decode(q, k_cache, v_cache, *, cache_seqlens, block_table=None, k_new=None, v_new=None, num_splits=0,
           causal=True, window=None, softcap=0.0, alibi_slopes=None, scale=None, mask=None, return_lse=False,
           score_mod=None, mask_mod=None, sinks=None, kv_dtype=None, k_scale=None, v_scale=None, v_head_dim=None):
    """A few new query tokens against a KV cache (contiguous or paged), appending their keys first.

    :func:`cuflash.decode` as a JAX function (no gradient). With ``k_new``/``v_new`` the call
    returns the caches with the new rows written at positions ``cache_seqlens[b] ..``: they alias
    ``k_cache``/``v_cache`` (``input_output_aliases``), so when the caller donates them
    (``jax.jit(..., donate_argnums=...)``) the kernels append in place and nothing is copied;
    without donation XLA first copies each cache into the result.

    Parameters
    ----------
    q : jax.Array (B, Sq, Hq, D)
        float16, bfloat16 or float32 (float16 or bfloat16 with an fp8 cache).
    k_cache : jax.Array, the dtype of q, or float8_e4m3fn
        (B, S_cache, Hk, D), or paged (num_pages, page_size, Hk, D) with ``block_table``.
        ``jnp.float8_e4m3fn`` caches (or uint8 ones holding e4m3 bytes, with ``kv_dtype``) are fp8
        caches: see ``kv_dtype``.
    v_cache : jax.Array, the shape and dtype of k_cache, or None (MLA, see ``v_head_dim``)
    cache_seqlens : jax.Array int32 (B,)
        Keys each sequence holds before the append; checked on the GPU (a bad value makes the call
        write nothing and is raised by the next decode call or ``cuflash.check_errors()``).
    block_table : jax.Array int32 (B, max_pages), optional
        Pages of each sequence (paged cache).
    k_new : jax.Array (B, S_new, Hk, D), optional
    v_new : jax.Array (B, S_new, Hk, D), optional
        Appended before attending (given together).
    num_splits : int, default 0
        Split-KV partitions (0: cuflash's heuristic).
    causal : bool, default True
        Bottom-right aligned among the new tokens.
    window, softcap, alibi_slopes, scale, mask
        As in :func:`cuflash.decode`.
    return_lse : bool, default False
        Also return the lse, float32 (B, Hq, Sq).
    score_mod, mask_mod : cuflash.ScoreMod, cuflash.MaskMod, optional
        As in :func:`attention` (arrays as JAX arrays, scalars static); positions are absolute in each
        sequence, as in :func:`cuflash.decode`: new token i has ``q_idx = i + T_b - Sq``.
    sinks : jax.Array float32 (Hq,), optional
        Attention sinks, as in :func:`cuflash.decode` (an empty sequence's rows: out 0, lse =
        ``sinks[h]``).
    kv_dtype : {None, "float8_e4m3fn"}, optional
        As in :func:`cuflash.decode`: the caches hold e4m3 values standing for ``value * k_scale`` /
        ``value * v_scale``. Implied by ``jnp.float8_e4m3fn`` caches (which cuflash reads as their
        bytes); say it for uint8 caches of e4m3 bytes. ``k_new``/``v_new`` (q's dtype) are quantised
        into the caches as :func:`cuflash.decode` does (``e4m3(x / scale)``, nearest even, saturated at
        +-448, NaN kept) and the returned caches have the dtype given. Appending needs D a multiple of 16.
    k_scale, v_scale : float or jax.Array float32, optional
        The fp8 caches' scales (required with an fp8 cache, refused without): a number (static: a
        float32 value fixed when the function is traced, like ``scale``) or a float32 array of shape
        (), (1,) (per tensor) or (Hk,) (one per kv head), an operand read at each call (traced values
        that change from call to call go this way).

    v_head_dim : int, optional
        MLA: with ``v_cache=None``, the values are the first ``v_head_dim`` columns of ``k_cache``'s
        576-column latent rows, ``k_new`` the appended latent rows (no ``v_new``), and ``out`` has
        ``v_head_dim`` columns, as in :func:`cuflash.decode`; the call returns the one cache.

    Returns
    -------
    out : jax.Array (B, Sq, Hq, D) (D = ``v_head_dim`` for MLA)
    lse : jax.Array float32 (B, Hq, Sq)
        Only with ``return_lse``.
    k_cache, v_cache : jax.Array
        Only with ``k_new``/``v_new``: the caches after the append (their dtype as given); MLA: k_cache
        alone.

    Raises
    ------
    TypeError
        When traced: a non-array argument, dtypes out of contract (index arrays not int32, float8
        caches other than float8_e4m3fn, uint8 caches without ``kv_dtype``, float32 q or scales that
        are not float32 with an fp8 cache, ...), an option of the wrong type.
    ValueError
        When traced: shapes that do not match (scales of another shape than (), (1,) or (Hk,)),
        options out of range (an unknown ``kv_dtype``, a scale that is not finite and > 0), missing
        scales (or scales without an fp8 cache), ``k_new`` without ``v_new``, appends longer than the
        cache or into a cache whose rows are not whole 16-byte chunks (D a multiple of 8, 16 for fp8).

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import cuflash.interop.jax as cj
    >>> f16 = lambda i, *shape: jax.random.normal(jax.random.key(i), shape, jnp.float16)
    >>> k_cache, v_cache = f16(0, 2, 1024, 8, 128), f16(1, 2, 1024, 8, 128)
    >>> lens = jnp.array([1000, 20], jnp.int32)
    >>> step = jax.jit(lambda q, kc, vc, kn, vn, lens: cj.decode(q, kc, vc, cache_seqlens=lens, k_new=kn,
    ...                                                          v_new=vn), donate_argnums=(1, 2))
    >>> out, k_cache, v_cache = step(f16(2, 2, 1, 32, 128), k_cache, v_cache, f16(3, 2, 1, 8, 128),
    ...                              f16(4, 2, 1, 8, 128), lens)
    """
    q = check_array(q, "q")
    mla = v_cache is None   # MLA: one latent cache, the values its first v_head_dim columns
    _checks.check_mla_arguments(mla, v_head_dim, v_new, kv_dtype)
    k_cache = check_array(k_cache, "k_cache")
    v_cache = None if mla else check_array(v_cache, "v_cache")
    lens = check_array(cache_seqlens, "cache_seqlens")
    given = {name: check_array(x, name) for name, x in zip(_DECODE_ARRAYS, (block_table, k_new, v_new, mask,
                                                                            alibi_slopes, sinks)) if x is not None}
    # fp8 caches: float8_e4m3fn arrays go to the callback as they are (aliased in place), and become
    # uint8 views of their bytes there (_jax_buffers.Views); cuflash's checks read them as such.
    kv_dtype, as_bytes = check_kv_format(k_cache, k_cache if mla else v_cache, kv_dtype)
    k_checked, v_checked = ((_sds(x.shape, np.uint8) if x is not None else None for x in (k_cache, v_cache))
                            if as_bytes else (k_cache, v_cache))
    num_splits, causal, window, softcap, scale = check_decode(
        q, k_checked, v_checked, cache_seqlens=lens, num_splits=num_splits, causal=causal, window=window,
        softcap=softcap, scale=scale, kv_dtype=kv_dtype, v_head_dim=v_head_dim,
        **{n: given.get(n) for n in _DECODE_ARRAYS})
    scale_values, scale_arrays = check_kv_scales(kv_dtype, k_scale, v_scale, k_cache.shape[2])
    given.update(scale_arrays)
    return_lse = _checks.check_flag(return_lse, "return_lse")
    mods, mod_arrays = split_modifiers(score_mod, mask_mod)
    call = _decode_call(_layout(q), _layout(k_cache), _layout(lens), tuple(given),
                        tuple(_layout(x) for x in given.values()), num_splits, causal, window, softcap, scale,
                        return_lse, _command_buffers(q.shape[-1], 16 if kv_dtype is not None else 8), mods,
                        kv_dtype, scale_values, None if v_head_dim is None else int(v_head_dim),
                        None if mla or v_cache.shape[-1] == k_cache.shape[-1] else _layout(v_cache))
    results = call(q, k_cache, *(() if mla else (v_cache,)), lens, *given.values(), *mod_arrays)
    return results[0] if len(results) == 1 else tuple(results)


@functools.lru_cache(maxsize=256)
def _merge_call(outs_layout, lses_layout, command_buffers):
    """(outs (n, B, S, H, D), lses (n, B, H, S)) -> (out, lse)."""
    (_, b, s, h, d), dtype = outs_layout
    inputs = Views((outs_layout, lses_layout))
    result_layouts = (((b, s, h, d), dtype), ((b, h, s), np.float32))
    outputs = Views(result_layouts)

    def callback(ctx, results, outs, lses):
        with on_xla_stream(ctx, outs) as where:
            outs, lses = inputs((outs, lses), where.device)
            out, lse = outputs(results, where.device)
            if _jax_buffers.POISON:
                poison((out, lse))
            _merge_states(outs, lses, out=out, lse=lse)

    call = buffer_callback(callback, tuple(_sds(*layout) for layout in result_layouts),
                           command_buffer_compatible=command_buffers)
    return _jax_vmap.batchable(call, functools.partial(_merge_fold, command_buffers))


def _merge_fold(command_buffers, n, batched, args):
    """One merge under ``jax.vmap``: the mapped axis joins B, behind the parts' axis."""
    outs, lses = (jnp.moveaxis(_jax_vmap.leading(x, mapped, n), 0, 1) for x, mapped in zip(args, batched))
    outs, lses = (x.reshape(x.shape[0], n * x.shape[2], *x.shape[3:]) for x in (outs, lses))
    out, lse = _merge_call(_layout(outs), _layout(lses), command_buffers)(outs, lses)
    return _jax_vmap.unfold(out, n), _jax_vmap.unfold(lse, n)


@jax.custom_vjp
def _merge(outs, lses):
    return tuple(_merge_call(_layout(outs), _layout(lses), _command_buffers(outs.shape[-1]))(outs, lses))


def _merge_fwd(outs, lses):
    out, lse = _merge(outs, lses)
    return (out, lse), (outs, lses, lse)


def _merge_bwd(residuals, cotangents):
    """With w_i = exp(lse_i - lse): d out / d out_i = w_i, d out / d lse_i = w_i (out_i - out) and
    d lse / d lse_i = w_i; in float32, out recomputed from the parts (not the rounded result)."""
    outs, lses, lse = residuals
    dout, dlse = (x.astype(jnp.float32) for x in cotangents)
    seen = jnp.isfinite(lse)   # a row no part saw (lse -inf) has no weight anywhere
    w = jnp.where(seen[None], jnp.exp(lses - jnp.where(seen, lse, 0.0)[None]), 0.0)   # (n, B, H, S)
    w_rows = jnp.swapaxes(w, -1, -2)[..., None]                                       # (n, B, S, H, 1)
    parts = outs.astype(jnp.float32)
    out = jnp.sum(w_rows * parts, axis=0)
    douts = (w_rows * dout[None]).astype(outs.dtype)
    toward = jnp.swapaxes(jnp.sum(dout[None] * (parts - out[None]), axis=-1), -1, -2)  # (n, B, H, S)
    return douts, w * (toward + dlse[None])


_merge.defvjp(_merge_fwd, _merge_bwd)


def merge_states(outs, lses):
    """Combine attention results over disjoint key sets into the result over their union.

    :func:`cuflash.merge_states` as a JAX function, differentiable with respect to ``outs`` and ``lses``
    (with :func:`attention`'s differentiable lse, a merge of partial results trains as one call):
    ``lse = log(sum_i exp(lse_i))``, ``out = sum_i exp(lse_i - lse) * out_i``.

    Parameters
    ----------
    outs : jax.Array (n, B, S, H, D), or a sequence of n arrays (B, S, H, D)
        Partial outputs (float16, bfloat16, float32; a sequence of mixed dtypes is merged in float32
        and the result cast to the dtype of ``outs[0]``).
    lses : jax.Array float32 (n, B, H, S), or a sequence of n arrays (B, H, S)
        Their log-sum-exps (as :func:`attention` returns them with ``return_lse=True``).

    Returns
    -------
    out : jax.Array (B, S, H, D), the dtype of ``outs[0]``
    lse : jax.Array float32 (B, H, S)

    Raises
    ------
    TypeError
        When traced: dtypes out of contract, a non-array argument.
    ValueError
        When traced: shapes that do not match, no part.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import cuflash.interop.jax as cj
    >>> q, k, v = (jax.random.normal(jax.random.key(i), (1, 64, 4, 64), jnp.float16) for i in range(3))
    >>> o1, l1 = cj.attention(q, k[:, :40], v[:, :40], return_lse=True)
    >>> o2, l2 = cj.attention(q, k[:, 40:], v[:, 40:], return_lse=True)
    >>> out, lse = jax.jit(cj.merge_states)([o1, o2], [l1, l2])      # = attention over all 64 keys
    """
    result_dtype = None
    if isinstance(outs, (list, tuple)):
        if len(outs) == 0:
            raise ValueError("outs must hold at least one partial result, got an empty sequence")
        parts = [check_array(x, f"outs[{i}]") for i, x in enumerate(outs)]
        for i, x in enumerate(parts):
            if x.ndim != 4 or x.shape != parts[0].shape:
                raise ValueError(f"outs[{i}] must be 4-d (batch, seqlen, heads, head_dim) like outs[0] "
                                 f"{tuple(parts[0].shape)}, got shape {tuple(x.shape)}")
        if len({x.dtype for x in parts}) > 1:   # merged in float32, never rounded down
            result_dtype = parts[0].dtype
            parts = [x.astype(jnp.float32) for x in parts]
        outs = jnp.stack(parts)
    else:
        outs = check_array(outs, "outs")
    if isinstance(lses, (list, tuple)):
        lses = jnp.stack([check_array(x, f"lses[{i}]") for i, x in enumerate(lses)])
    else:
        lses = check_array(lses, "lses")
    check_merge(outs, lses)
    out, lse = _merge(outs, lses)
    return (out if result_dtype is None else out.astype(result_dtype)), lse
