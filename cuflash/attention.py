"""Forward attention: the public entry points (check -> plan -> run); the plan of a call is
:mod:`cuflash._forward_plan`'s."""

from __future__ import annotations

import numpy as np

from . import _checks
from ._runtime import capture as _capture, launch as _launch, memo as _memo
from ._forward_plan import _family_for, _forced_family, forward_plan
from ._mask_blocks import bits_alone, call_block_mask
from ._scores import SCORE_OPERANDS, modifier_parts, score_operands, user_operands
from .modifiers.builtin import axis_len, bshd_facts, lowered, states_builtin
from .decode import varlen_over_cache as _varlen_over_cache   # attention_varlen over a KV cache

FAMILIES = ("fwd_sm90", "fwd_sm80", "fwd_simt")


def force_kernel(family: str):
    """Run every forward call inside a ``with`` block on one kernel family (tests and benchmarks).

    Parameters
    ----------
    family : {"fwd_sm90", "fwd_sm80", "fwd_simt"}
        fwd_sm90 (wgmma + TMA, sm_90 GPUs) and fwd_sm80 (mma.sync, sm_80 and newer) run
        float16/bfloat16, fwd_simt float32. A family that cannot run a call (its dtype, or for
        fwd_sm90 strides that TMA cannot describe) raises ValueError at that call, never falls back.

    Returns
    -------
    context manager
        Sets the family for the calls made inside the block (in this thread or task: a context
        variable) and restores the previous choice when it ends.

    Raises
    ------
    ValueError
        If ``family`` is not one of the three names (when the block is entered).

    Examples
    --------
    >>> import cupy as cp
    >>> import cuflash
    >>> q = k = v = cp.random.standard_normal((1, 256, 4, 64), dtype=cp.float32).astype(cp.float16)
    >>> with cuflash.force_kernel("fwd_sm80"):
    ...     out = cuflash.attention(q, k, v)
    """
    return _launch.forcing(_forced_family, family, FAMILIES)




def attention_forward(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None,
                      mask=None, bias=None, block_mask=None, block_size=(128, 128), dropout_p=0.0,
                      generator=None, score_mod=None, mask_mod=None, sinks=None, out=None, lse=None):
    """Exact attention forward that also returns what the backward pass needs.

    :func:`attention` with the log-sum-exp and the dropout state always returned: pass them, with
    the same inputs and options, to :func:`attention_backward`. Runs on CuPy's current stream of the
    current device, with no host synchronisation.

    Parameters
    ----------
    q : CUDA array (B, Sq, Hq, D)
        float16, bfloat16 (``ml_dtypes.bfloat16``) or float32; a CuPy array or any CUDA array with
        ``__dlpack__`` (PyTorch, JAX, ...), imported without a copy. float16/bfloat16 run on tensor
        cores, float32 on a full-precision path.
    k : CUDA array (B, Sk, Hk, D), the dtype of q
        ``Hq % Hk == 0``: query head h reads kv head ``h // (Hq // Hk)`` (GQA; Hk = 1 is MQA).
    v : CUDA array (B, Sk, Hk, D_v), the dtype of q
        D_v, v's head dim, may differ from D (design.md §2b); out (and dout, dv) have it.
        Any strides for q, k and v (BHSD data as ``x.transpose(0, 2, 1, 3)`` views); a last axis that
        is not contiguous, rows that are not 16-byte aligned, or a head dim D that is not a multiple
        of 8 cost a padded copy. D from 1 to 256; Sq and Sk may differ.
    causal : bool, default False
        Causal mask aligned to the bottom-right corner: query i sees key j iff ``j <= i + Sk - Sq``
        (the last query sees every key; with Sq > Sk the first Sq - Sk rows see none).
    scale : float, optional
        Multiplies ``q . k``; default ``1 / sqrt(D)``. Positive and representable in float32.
    window : (int, int), optional
        Sliding window ``(left, right)``, inclusive, ``-1`` = unbounded, around the same bottom-right
        diagonal: query i sees keys ``i + Sk - Sq - left`` to ``i + Sk - Sq + right``. ``causal=True``
        sets ``right = 0``. Default None: no window.
    softcap : float, default 0.0
        If > 0, caps the scaled scores: ``s = softcap * tanh(s / softcap)`` (Gemma 2, Grok); 0 is off.
    alibi_slopes : CUDA float32 array (Hq,) or (B, Hq), optional
        ALiBi: subtracts ``slope[b, h] * |i + Sk - Sq - j|`` from the scores.
    mask : CUDA bool array broadcastable to (B, Hq, Sq, Sk), optional
        True = may attend. At most 4 axes, broadcast with zero strides, never materialised: (Sq, Sk)
        for one mask shared by all, (B, 1, 1, Sk) for key padding. Tree masks of speculative
        decoding are this.
    bias : CUDA array broadcastable to (B, Hq, Sq, Sk), optional
        float32, float16 or bfloat16, added to the scores after softcap and ALiBi (relative position
        biases); broadcast like ``mask``.
    block_mask : CUDA bool array broadcastable to (B, Hq, ceil(Sq / bq), ceil(Sk / bk)), optional
        Block-sparse attention over blocks of ``block_size = (bq, bk)``: key j is hidden from query i
        where ``block_mask[b, h, i // bq, j // bk]`` is False. Key tiles whose blocks are all False
        are neither loaded nor computed.
    block_size : (int, int), default (128, 128)
        ``(bq, bk)``, the query and key lengths of a block of ``block_mask`` (any positive sizes,
        independent of the kernels' tiles).
    dropout_p : float, default 0.0
        In [0, 1): inverted dropout on the normalised probabilities (each dropped with probability
        ``dropout_p``, the kept ones scaled by ``1 / (1 - dropout_p)``). The decision for element
        (b, h, i, j) is a pure function of the generator's (seed, offset) and (b, h, i, j)
        (Philox4x32-10, :mod:`cuflash.random`): the same on every GPU and kernel, so that
        :func:`attention_backward` regenerates the mask from the returned ``rng_state``.
    generator : cuflash.Generator, optional
        Source of the dropout random numbers; each call with dropout takes its next (seed, offset).
        Default: :func:`cuflash.default_generator` (seeded by :func:`cuflash.manual_seed`).
    score_mod : cuflash.ScoreMod, optional
        A score modifier written as one expression over ``score`` (after softcap, ALiBi and bias),
        ``b``, ``h`` (query head), ``q_idx``, ``kv_idx`` (positions in the sequence) and its named
        arguments; applied before the masks. Compiled into the kernel once per expression (its
        arrays' addresses and scalars' values are read at each call: new values need no new kernel).
    mask_mod : cuflash.MaskMod, optional
        A mask written as one bool expression: key ``kv_idx`` is hidden from query ``q_idx`` where it
        gives False (ANDed with the other masks).
        Unless ``MaskMod(..., sparse=False)``, the tiles it hides entirely are skipped, never
        loaded: a block mask derived from it on the GPU once per shapes and arguments, and cached
        (an argument array written in place needs :func:`cuflash.clear_mask_cache`).
    sinks : CUDA float32 array (Hq,), optional
        Attention sinks (gpt-oss): a logit per query head that joins every row's softmax denominator,
        ``exp(sinks[h])`` beside the keys' ``exp(s)``, with no value (the row's probabilities then sum
        to less than 1). It is compared with the final scores (after scale, softcap, ALiBi, bias and
        ``score_mod``). ``lse`` includes it; a row that sees no key gets ``out = 0`` and
        ``lse = sinks[h]``; ``-inf`` is no sink for that head. Read at each call (new values need no
        new kernel); its gradient comes from :func:`attention_backward` (``return_dsinks``).
    out : CUDA array (B, Sq, Hq, D_v), the dtype of q, optional
    lse : CUDA float32 array (B, Hq, Sq), optional
        C-contiguous buffers to write the results into (returned as given); they may not overlap
        each other or any input.

    Returns
    -------
    out : CuPy array (B, Sq, Hq, D), the dtype of q
        ``out`` itself when it is given. Rows that see no key are 0.
    lse : CuPy float32 array (B, Hq, Sq)
        ``lse`` itself when it is given: the natural log of each row's sum of ``exp(s)`` over its
        final scores (scaled, capped, biased, masked; before dropout), plus ``exp(sinks[h])``; ``-inf``
        (``sinks[h]``) for a row that sees no key.
    rng_state : numpy uint64 array (2,) = (seed, offset), or None without dropout
        The generator state this call drew its dropout mask from. Captured in a CUDA graph: a CuPy
        uint64 array (2,) that each replay fills with its own (seed, offset), drawn on the GPU from
        the generator's graph state (:meth:`cuflash.Generator.graph_safe`); pass it to
        :func:`attention_backward` as it is (the kernels read it on the GPU), and keep it, like
        ``out`` and ``lse``, while the graph is replayed.

    Raises
    ------
    TypeError
        An array that is not a CUDA array (a NumPy array too), a dtype other than float16, bfloat16
        or float32, mixed dtypes, a ``mask``/``block_mask`` that is not bool, a ``bias``,
        ``alibi_slopes`` or ``sinks`` of another dtype, an ``out``/``lse`` of the wrong dtype, an option
        of the wrong type (``causal``, ``scale``, ``window``, ``softcap``, ``dropout_p``, ``generator``).
    ValueError
        A shape or value out of contract: ranks, batch or heads that do not match (GQA), head dims,
        an array on another GPU than the current one, a ``window`` or ``block_size`` entry, ``scale``,
        ``softcap`` or ``dropout_p`` out of range, an operand that does not broadcast, ``sinks`` not of
        shape (Hq,), an ``out``/``lse`` of the wrong shape, not C-contiguous or overlapping an input.
        Every message names the argument; nothing is launched and ``out``/``lse`` are left untouched.
    RuntimeError
        CuPy or a usable CUDA GPU is missing; or the call needs copies of its operands (see ``k``,
        ``v``) while CuPy's current stream is capturing a CUDA graph.

    See Also
    --------
    attention : the same without the lse and dropout state (unless asked).
    attention_backward : the gradients, from this call's results.
    cuflash.reference.attention_forward : the float64 host reference.

    Notes
    -----
    The scores are built in this order: ``s = scale * q . k``; softcap; minus ALiBi; plus bias; then
    causal, window, ``mask``, ``block_mask`` and the sequence ends set ``s = -inf``. A row whose
    scores are all ``-inf`` gets ``out = 0`` and ``lse = -inf`` (``sinks[h]`` with sinks), never NaN.
    ``lse`` lets partial results over disjoint keys be combined exactly (:func:`merge_states`).

    Examples
    --------
    >>> import cupy as cp
    >>> import cuflash
    >>> q, k, v = (cp.random.standard_normal((2, 512, 8, 64), dtype=cp.float32).astype(cp.float16)
    ...            for _ in range(3))
    >>> out, lse, rng_state = cuflash.attention_forward(q, k, v, causal=True, dropout_p=0.1)
    >>> lse.shape, lse.dtype, rng_state.dtype
    ((2, 8, 512), dtype('float32'), dtype('uint64'))
    >>> dout = cp.ones_like(out)
    >>> dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, rng_state=rng_state,
    ...                                         causal=True, dropout_p=0.1)
    """
    return _forward((q, k, v, out, lse, alibi_slopes, mask, bias, block_mask, sinks), causal, scale, window, softcap,
                    block_size, dropout_p, generator, True, True, modifiers=(score_mod, mask_mod))


def _forward_at(q, k, v, *, dropout_origin=(0, 0), causal=False, scale=None, window=None, softcap=0.0,
                alibi_slopes=None, mask=None, bias=None, block_mask=None, block_size=(128, 128), dropout_p=0.0,
                generator=None, out=None, lse=None):
    """:func:`attention_forward` of a call that is one block of a larger call (ring attention's chunk
    pairs, :mod:`cuflash.distributed._comm`): ``dropout_origin = (row0, col0)`` is the position of this
    call's element (0, 0) in the larger call, whose dropout mask it draws
    (:func:`cuflash._checks.check_dropout_origin`: col0 a multiple of 4). Private, so that the public
    signature holds only what users pass; the public function calls :func:`_forward` directly (no
    extra frame on its repeat path)."""
    if isinstance(dropout_origin, list):
        dropout_origin = tuple(dropout_origin)   # a key of the plan memo: hashable
    return _forward((q, k, v, out, lse, alibi_slopes, mask, bias, block_mask, None), causal, scale, window, softcap,
                    block_size, dropout_p, generator, True, True, dropout_origin)


def _forward_with_rng_words(q, k, v, rng_words, *, causal=False, scale=None, window=None, softcap=0.0,
                            alibi_slopes=None, mask=None, bias=None, block_mask=None, block_size=(128, 128),
                            dropout_p=0.0, sinks=None, out=None, lse=None, score_mod=None, mask_mod=None):
    """:func:`attention_forward` whose dropout (seed, offset) the kernels read from the GPU: ``rng_words``
    is the address of a uint64 (2,) array ``[seed, offset]`` on the call's device (as
    ``attention_backward(rng_state=<device array>)`` reads it). For callers whose state is device data
    that the host must not read (a JAX PRNG key inside ``jax.jit``: :mod:`cuflash.interop.jax`).
    Returns (out, lse); nothing is drawn from a generator. Private: the public signatures hold only
    what users pass."""
    out, lse, _ = _forward((q, k, v, out, lse, alibi_slopes, mask, bias, block_mask, sinks), causal, scale, window,
                           softcap, block_size, dropout_p, None, True, False, (0, 0), rng_words,
                           (score_mod, mask_mod))
    return out, lse


def _forward(operands, causal, scale, window, softcap, block_size, dropout_p, generator, lse_output,
             rng_output=False, dropout_origin=(0, 0), rng_words=None, modifiers=(None, None), replay_only=False):
    """attention_forward, and attention (whose lse, unless returned, is a temporary of the call, and
    whose dropout state is not returned). Positional: keywords cost a repeat call ~0.2 us.
    ``rng_words``: see :func:`_forward_with_rng_words` (None: drawn from the generator).
    ``operands``: q, k, v, out, lse, alibi_slopes, mask, bias, block_mask, sinks.
    ``modifiers``: (score_mod, mask_mod); their arrays follow the operands.
    ``replay_only``: return None, having done nothing, unless the call replays a remembered plan
    (:func:`cuflash.interop._torch_stream.replay`)."""
    mod_key = mask_bits = None
    if states_builtin(*modifiers):   # what they state of a built-in option runs built in
        score_mod, mask_mod, window, softcap, alibi = lowered(*modifiers, causal, window, softcap, operands[5],
                                                              operands[7], *bshd_facts(operands[0], operands[1]))
        modifiers = (score_mod, mask_mod)
        if alibi is not operands[5]:
            operands = operands[:5] + (alibi,) + operands[6:]
    if modifiers[0] is not None or modifiers[1] is not None:
        mod_key, user_arrays = modifier_parts(*modifiers)
        if modifiers[1] is not None and modifiers[1].derives_blocks:   # the tiles it hides are skipped
            block_mask, block_size, mask_bits = call_block_mask(
                "attention", modifiers[1], operands[0], operands[1], operands[8], block_size,
                bits_alone(modifiers[0], softcap, *operands[5:8]))
            operands = operands[:8] + (block_mask,) + operands[9:]
            if mask_bits is not None:   # the kernels read the MaskMod's bits, not its expression
                modifiers, user_arrays, mod_key = (None, None), (), ("mask bits", mask_bits)
        operands = operands + user_arrays
    options = (causal, scale, window, softcap, block_size, dropout_p, type(generator), _forced_family.get(),
               lse_output, dropout_origin, mod_key)
    plan, ptrs, where = _memo.lookup("attention", operands, options)
    finish = None
    if plan is None:
        if replay_only:
            return None
        plan, ptrs, finish = _plan_attention(operands, ptrs, causal=causal, scale=scale, window=window,
                                             softcap=softcap, block_size=block_size, dropout_p=dropout_p,
                                             generator=generator, lse_output=lse_output,
                                             dropout_origin=dropout_origin, modifiers=modifiers, mask_bits=mask_bits)
        if plan is None:
            return finish
    results, _, rng_state = plan.run(operands, ptrs, where, generator=generator, rng_state=rng_words,
                                     rng_output=rng_output)
    out = finish(results[0]) if finish is not None else results[0]
    return out, (results[1] if lse_output else None), rng_state


def _plan_attention(operands, key, *, causal, scale, window, softcap, block_size, dropout_p, generator,
                    lse_output=True, dropout_origin=(0, 0), modifiers=(None, None), mask_bits=None):
    """The full path of :func:`attention_forward`: check, plan (remembered under ``key`` when the
    operands are used in place). Returns (plan, pointers, finish): ``finish`` copies the kernel's
    output into the caller's when a private one was needed; (None, None, result) for a call that
    launches nothing. ``mask_bits``: the fields of the MaskMod's bits beside a derived ``block_mask``
    (cuflash/_mask_blocks.py), or None."""
    import cupy

    q, k, v, out, lse, alibi_slopes, mask, bias, block_mask, sinks = operands[:10]
    q, k, v, dtype_name = _checks.check_qkv(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
    b, sq, hq, d = q.shape
    dv = v.shape[-1]   # out has v's head dim (design.md §2b)
    if k.shape[0] != b:
        raise ValueError(f"k must have the batch size of q ({b}), got {k.shape[0]}")
    sk = k.shape[1]
    _checks.check_problem_size(q, k, batch=b, seqlen_q=sq, seqlen_k=sk, varlen=False)
    opts = _checks.check_options(head_dim=d, causal=causal, scale=scale, window=window, softcap=softcap,
                                 dropout_p=dropout_p, generator=generator, seqlens=(sq, sk))
    origin_fields = _checks.check_dropout_origin(dropout_origin, (sq, sk))
    score_fields, score_arrays = score_operands(b, hq, sq, sk, alibi_slopes=alibi_slopes, mask=mask, bias=bias,
                                                block_mask=block_mask, block_size=block_size, first=5,
                                                mask_bits=mask_bits)
    sinks = _checks.check_sinks(sinks, hq)
    if sinks is not None:
        score_fields["sinks"] = ("operand", 9)
    user_fields, user_arrays, user_mods, user_source = user_operands(*modifiers, first=10)
    out_user = out
    if out is not None:
        out = _checks.check_out(out, "out", (b, sq, hq, dv), q.dtype)
    if lse is not None:
        lse = _checks.check_out(lse, "lse", (b, hq, sq), np.float32)
    _checks.check_disjoint((("out", out), ("lse", lse)),
                           (("q", q), ("k", k), ("v", v), *zip(SCORE_OPERANDS, score_arrays), ("sinks", sinks),
                            *((("score_mod/mask_mod argument", x) for x in user_arrays))))
    _family_for(dtype_name)  # an impossible forced family is an argument error too

    if b * sq * hq * d == 0 or sk == 0:
        _memo.nothing_to_plan()
        out = cupy.empty((b, sq, hq, dv), dtype=q.dtype) if out is None else out
        lse = cupy.empty((b, hq, sq), dtype=np.float32) if lse is None else lse
        rng_state = opts.generator.next_state() if opts.dropout_p else None
        if sk == 0:   # no key: out 0, lse the sink (-inf without)
            out.fill(0)
            if sinks is None:
                lse.fill(-np.inf)
            else:
                lse[...] = sinks[None, :, None]
        return None, None, (out_user if out_user is not None else out, lse, rng_state)

    d_pad, dv_pad = -(-d // 8) * 8, -(-dv // 8) * 8
    qk, kk, vk = _checks.kernel_ready(q, d_pad), _checks.kernel_ready(k, d_pad), _checks.kernel_ready(v, dv_pad)
    o_kernel = out
    if dv_pad != dv or (out is not None and out.data.ptr % 16):   # the kernels write whole 16-byte rows
        o_kernel = cupy.empty((b, sq, hq, dv_pad), dtype=q.dtype)
    o_layout = o_kernel if o_kernel is not None else _checks.Shaped((b, sq, hq, dv_pad), q.dtype)
    row_layout = {}
    for name, x in (("q", qk), ("k", kk), ("v", vk), ("o", o_layout)):
        sb, sr, sh, _ = _checks.element_strides(x)
        row_layout.update({f"{name}_batch_stride": sb, f"{name}_row_stride": sr, f"{name}_head_stride": sh})
    row_layout.update(lse_batch_stride=hq * sq, lse_head_stride=sq)
    kernel_operands = (qk, kk, vk, o_kernel, lse, *score_arrays, sinks, *user_arrays)
    plan = forward_plan("attention", operands, qk, kk, vk, o_layout, dtype_name=dtype_name, head_dim=d_pad,
                        head_dim_v=dv_pad, seq_fields=dict(seqlen_q=sq, seqlen_k=sk), row_layout=row_layout, opts=opts,
                        score_fields={**score_fields, **user_fields}, grid_rows=sq, batch=b, heads_q=hq,
                        lse_output=lse_output, dropout_origin=origin_fields, user_mods=user_mods,
                        user_source=user_source, score_arrays=dict(zip(SCORE_OPERANDS, score_arrays)))
    ptrs = _memo.pointers(kernel_operands)
    in_place = _memo.in_place(operands, kernel_operands)
    if not in_place:
        _capture.refuse_capture("attention", _capture.COPIES_NOT_CAPTURED)
    _memo.remember(key if in_place else None, plan)
    return plan, ptrs, _copy_out(out, out_user, o_kernel, dv)


def _copy_out(out, out_user, o_kernel, d):
    """None when the kernel writes the caller's ``out`` (or the plan's) in place; else the step
    after the launches: the kernel's private output, cut to ``d`` columns, into ``out``."""
    if o_kernel is out:
        return None

    def finish(_):
        import cupy

        target = out if out is not None else cupy.empty(o_kernel.shape[:-1] + (d,), dtype=o_kernel.dtype)
        target[...] = o_kernel[..., :d]
        return out_user if out_user is not None else target

    return finish


def attention(q, k, v, *, causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None, mask=None,
              bias=None, block_mask=None, block_size=(128, 128), dropout_p=0.0, generator=None,
              score_mod=None, mask_mod=None, sinks=None, return_lse=False, out=None):
    """Exact scaled-dot-product attention, ``softmax(scale * q k^T + modifiers) v``, in one fused pass.

    For every batch b, query head h and query row i, attends ``q[b, i, h]`` over the keys and values
    of kv head ``h // (Hq // Hk)`` without materialising the (Sq, Sk) scores. Runs on CuPy's current
    stream of the current device, with no host synchronisation.

    Parameters
    ----------
    q : CUDA array (B, Sq, Hq, D)
        float16, bfloat16 (``ml_dtypes.bfloat16``) or float32; a CuPy array or any CUDA array with
        ``__dlpack__`` (PyTorch, JAX, ...), imported without a copy. float16/bfloat16 run on tensor
        cores, float32 on a full-precision path.
    k : CUDA array (B, Sk, Hk, D), the dtype of q
        ``Hq % Hk == 0``: query head h reads kv head ``h // (Hq // Hk)`` (GQA; Hk = 1 is MQA).
    v : CUDA array (B, Sk, Hk, D_v), the dtype of q
        D_v, v's head dim, may differ from D (design.md §2b); out (and dout, dv) have it.
        Any strides for q, k and v (BHSD data as ``x.transpose(0, 2, 1, 3)`` views); a last axis that
        is not contiguous, rows that are not 16-byte aligned, or a head dim D that is not a multiple
        of 8 cost a padded copy. D from 1 to 256; Sq and Sk may differ.
    causal : bool, default False
        Causal mask aligned to the bottom-right corner: query i sees key j iff ``j <= i + Sk - Sq``
        (the last query sees every key; with Sq > Sk the first Sq - Sk rows see none).
    scale : float, optional
        Multiplies ``q . k``; default ``1 / sqrt(D)``. Positive and representable in float32.
    window : (int, int), optional
        Sliding window ``(left, right)``, inclusive, ``-1`` = unbounded, around the same bottom-right
        diagonal: query i sees keys ``i + Sk - Sq - left`` to ``i + Sk - Sq + right``. ``causal=True``
        sets ``right = 0``. Default None: no window.
    softcap : float, default 0.0
        If > 0, caps the scaled scores: ``s = softcap * tanh(s / softcap)`` (Gemma 2, Grok); 0 is off.
    alibi_slopes : CUDA float32 array (Hq,) or (B, Hq), optional
        ALiBi: subtracts ``slope[b, h] * |i + Sk - Sq - j|`` from the scores.
    mask : CUDA bool array broadcastable to (B, Hq, Sq, Sk), optional
        True = may attend. At most 4 axes, broadcast with zero strides, never materialised: (Sq, Sk)
        for one mask shared by all, (B, 1, 1, Sk) for key padding. Tree masks of speculative
        decoding are this.
    bias : CUDA array broadcastable to (B, Hq, Sq, Sk), optional
        float32, float16 or bfloat16, added to the scores after softcap and ALiBi (relative position
        biases); broadcast like ``mask``.
    block_mask : CUDA bool array broadcastable to (B, Hq, ceil(Sq / bq), ceil(Sk / bk)), optional
        Block-sparse attention over blocks of ``block_size = (bq, bk)``: key j is hidden from query i
        where ``block_mask[b, h, i // bq, j // bk]`` is False. Key tiles whose blocks are all False
        are neither loaded nor computed.
    block_size : (int, int), default (128, 128)
        ``(bq, bk)``, the query and key lengths of a block of ``block_mask`` (any positive sizes,
        independent of the kernels' tiles).
    dropout_p : float, default 0.0
        In [0, 1): inverted dropout on the normalised probabilities (each dropped with probability
        ``dropout_p``, the kept ones scaled by ``1 / (1 - dropout_p)``). The decision for element
        (b, h, i, j) is a pure function of the generator's (seed, offset) and (b, h, i, j)
        (Philox4x32-10, :mod:`cuflash.random`): the same on every GPU and kernel. For training use
        :func:`attention_forward`, which returns the ``rng_state`` the backward needs.
    generator : cuflash.Generator, optional
        Source of the dropout random numbers; each call with dropout takes its next (seed, offset).
        Default: :func:`cuflash.default_generator` (seeded by :func:`cuflash.manual_seed`).
    score_mod : cuflash.ScoreMod, optional
        A score modifier written as one expression over ``score`` (after softcap, ALiBi and bias),
        ``b``, ``h`` (query head), ``q_idx``, ``kv_idx`` (positions in the sequence) and its named
        arguments; applied before the masks. Compiled into the kernel once per expression (its
        arrays' addresses and scalars' values are read at each call: new values need no new kernel).
    mask_mod : cuflash.MaskMod, optional
        A mask written as one bool expression: key ``kv_idx`` is hidden from query ``q_idx`` where it
        gives False (ANDed with the other masks).
        Unless ``MaskMod(..., sparse=False)``, the tiles it hides entirely are skipped, never
        loaded: a block mask derived from it on the GPU once per shapes and arguments, and cached
        (an argument array written in place needs :func:`cuflash.clear_mask_cache`).
    sinks : CUDA float32 array (Hq,), optional
        Attention sinks (gpt-oss): a logit per query head that joins every row's softmax denominator,
        ``exp(sinks[h])`` beside the keys' ``exp(s)``, with no value (the row's probabilities then sum
        to less than 1). It is compared with the final scores (after scale, softcap, ALiBi, bias and
        ``score_mod``). ``lse`` includes it; a row that sees no key gets ``out = 0`` and
        ``lse = sinks[h]``; ``-inf`` is no sink for that head. Read at each call (new values need no
        new kernel); its gradient comes from :func:`attention_backward` (``return_dsinks``).
    return_lse : bool, default False
        Also return the log-sum-exp of every row.
    out : CUDA array (B, Sq, Hq, D_v), the dtype of q, optional
        C-contiguous buffer to write the result into (returned as given); it may not overlap any
        input.

    Returns
    -------
    out : CuPy array (B, Sq, Hq, D), the dtype of q
        ``out`` itself when it is given. Rows that see no key are 0.
    lse : CuPy float32 array (B, Hq, Sq)
        Only with ``return_lse``: the natural log of each row's sum of ``exp(s)`` over its final
        scores (scaled, capped, biased, masked; before dropout), plus ``exp(sinks[h])``; ``-inf``
        (``sinks[h]``) for a row that sees no key.

    Raises
    ------
    TypeError
        An array that is not a CUDA array (a NumPy array too), a dtype other than float16, bfloat16
        or float32, mixed dtypes, a ``mask``/``block_mask`` that is not bool, a ``bias``,
        ``alibi_slopes`` or ``sinks`` of another dtype, an option of the wrong type (``causal``,
        ``scale``, ``window``, ``softcap``, ``dropout_p``, ``generator``, ``return_lse``), a ``score_mod``/
        ``mask_mod`` that is not a :class:`cuflash.ScoreMod`/:class:`cuflash.MaskMod`, or whose array
        argument is not a CUDA array.
    ValueError
        A shape or value out of contract: ranks, batch or heads that do not match (GQA), head dims,
        an array on another GPU than the current one, a ``window`` or ``block_size`` entry, ``scale``,
        ``softcap`` or ``dropout_p`` out of range, an operand that does not broadcast, ``sinks`` not of
        shape (Hq,), an ``out`` of the wrong shape, not C-contiguous or overlapping an input. Every
        message names the argument; nothing is launched and ``out`` is left untouched.
    RuntimeError
        CuPy or a usable CUDA GPU is missing; or the call needs copies of its operands (see ``k``,
        ``v``) while CuPy's current stream is capturing a CUDA graph.

    See Also
    --------
    attention_forward : the same, returning what :func:`attention_backward` needs.
    attention_varlen : sequences of different lengths packed without padding.
    decode : a few new tokens against a (paged) KV cache.
    cuflash.reference.attention_forward : the float64 host reference.
    cuflash.interop.torch.attention : differentiable, for torch tensors.

    Notes
    -----
    The scores are built in this order: ``s = scale * q . k``; softcap; minus ALiBi; plus bias; then
    causal, window, ``mask``, ``block_mask`` and the sequence ends set ``s = -inf``. A row whose
    scores are all ``-inf`` gets ``out = 0`` and ``lse = -inf`` (``sinks[h]`` with sinks), never NaN;
    a NaN or Inf in a position a row sees propagates to that row. With ``sinks``, each row's
    denominator also holds ``exp(sinks[h])``: ``out_i = sum_j exp(s_ij) v_j / (exp(sinks[h]) +
    sum_j exp(s_ij))``.

    A repeat call with the same shapes, strides, dtypes and options reuses its plan (a few
    microseconds of host time); :func:`cuflash.plan` fixes a call's plan for a CUDA graph.

    Examples
    --------
    >>> import cupy as cp
    >>> import cuflash
    >>> q = cp.random.standard_normal((2, 1024, 16, 128), dtype=cp.float32).astype(cp.float16)
    >>> k = cp.random.standard_normal((2, 1024, 4, 128), dtype=cp.float32).astype(cp.float16)
    >>> v = cp.random.standard_normal((2, 1024, 4, 128), dtype=cp.float32).astype(cp.float16)
    >>> out = cuflash.attention(q, k, v, causal=True)       # GQA: 16 query heads over 4 kv heads
    >>> out.shape, out.dtype
    ((2, 1024, 16, 128), dtype('float16'))
    >>> out, lse = cuflash.attention(q, k, v, window=(255, 0), return_lse=True)  # 256-key window
    >>> lse.shape
    (2, 16, 1024)
    >>> keep = cp.ones((2, 1, 1, 1024), dtype=bool)           # key padding, broadcast
    >>> keep[1, ..., 900:] = False
    >>> out = cuflash.attention(q, k, v, mask=keep, softcap=30.0)
    """
    return_lse = _checks.check_flag(return_lse, "return_lse")
    out, lse, _ = _forward((q, k, v, out, None, alibi_slopes, mask, bias, block_mask, sinks), causal, scale, window,
                           softcap, block_size, dropout_p, generator, return_lse, modifiers=(score_mod, mask_mod))
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                     causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                     generator=None, score_mod=None, mask_mod=None, sinks=None, return_lse=False, out=None, mask=None,
                     bias=None, block_mask=None, check=None, cache_seqlens=None, block_table=None):
    """Attention over a batch of sequences of different lengths, packed without padding.

    Sequence b holds query rows ``cu_seqlens_q[b]`` to ``cu_seqlens_q[b + 1] - 1`` of q and key rows
    ``cu_seqlens_k[b]`` to ``cu_seqlens_k[b + 1] - 1`` of k and v; each is an independent
    (Sq_b, Sk_b) problem, with the semantics of :func:`attention` (causal and window aligned to its
    own bottom-right corner). Runs on CuPy's current stream; the offsets are never read back.

    Parameters
    ----------
    q : CUDA array (total_q, Hq, D)
        float16, bfloat16 or float32 (CuPy or any CUDA DLPack array), as in :func:`attention`.
    k : CUDA array (total_k, Hk, D), the dtype of q
        ``Hq % Hk == 0`` (GQA/MQA as in :func:`attention`).
    v : CUDA array (total_k, Hk, D_v), the dtype of q
        D_v, v's head dim, may differ from D; out has it.
    cu_seqlens_q : CUDA int32 array (B + 1,)
        Offsets of the query sequences: 0 first, never decreasing, at most total_q. They stay on the
        GPU: a kernel checks them before the attention runs, and a call with bad offsets writes
        nothing and reports a ValueError (see ``check``). Rows past the last offset are padding: not
        written.
    cu_seqlens_k : CUDA int32 array (B + 1,)
        Offsets of the key sequences, likewise (at most total_k).
    max_seqlen_q : int, optional
        The longest query sequence (checked on the GPU as well). It sizes the grid; default: total_q
        (correct, but the grid is then larger than needed).
    max_seqlen_k : int, optional
        The longest key sequence; default: total_k.
    causal : bool, default False
        Per sequence, bottom-right aligned: row i of sequence b sees key j iff ``j <= i + Sk_b - Sq_b``.
    scale : float, optional
        Default ``1 / sqrt(D)``.
    window : (int, int), optional
        ``(left, right)`` around each sequence's bottom-right diagonal, as in :func:`attention`.
    softcap : float, default 0.0
        As in :func:`attention`.
    alibi_slopes : CUDA float32 array (Hq,) or (B, Hq), optional
        As in :func:`attention`; a (B, Hq) array has a row per sequence.
    dropout_p : float, default 0.0
        As in :func:`attention`, with the sequence index b as the batch index of the random numbers.
    generator : cuflash.Generator, optional
        As in :func:`attention`.
    score_mod : cuflash.ScoreMod, optional
        A score modifier written as one expression over ``score`` (after softcap, ALiBi and bias),
        ``b`` (the sequence's index), ``h`` (query head), ``q_idx``, ``kv_idx`` (positions within each
        sequence) and its named arguments; applied before the masks. Compiled into the kernel once
        per expression (its arrays' addresses and scalars' values are read at each call).
    mask_mod : cuflash.MaskMod, optional
        A mask written as one bool expression: key ``kv_idx`` is hidden from query ``q_idx`` where it
        gives False (ANDed with the other masks). Tiles are loaded and computed all
        the same (no block mask is derived in varlen).
    sinks : CUDA float32 array (Hq,), optional
        Attention sinks (gpt-oss): a logit per query head that joins every row's softmax denominator,
        ``exp(sinks[h])`` beside the keys' ``exp(s)``, with no value (the row's probabilities then sum
        to less than 1). It is compared with the final scores (after scale, softcap, ALiBi, bias and
        ``score_mod``). ``lse`` includes it; a row that sees no key gets ``out = 0`` and
        ``lse = sinks[h]``; ``-inf`` is no sink for that head. Read at each call (new values need no
        new kernel); its gradient comes from :func:`attention_backward` (``return_dsinks``).
    return_lse : bool, default False
        Also return the log-sum-exp of every row.
    out : CUDA array (total_q, Hq, D_v), the dtype of q, optional
        C-contiguous buffer to write the result into (returned as given), sharing no memory with the
        inputs.
    mask, bias, block_mask : None
        Not supported in varlen (a ValueError): pad the batch and call :func:`attention` instead.
    check : bool, optional
        True: wait for the check of the offsets and raise a bad one now. False: a bad offset is
        raised at the next varlen call on this stream or by :func:`cuflash.check_errors`. Default:
        the environment variable ``CUFLASH_CHECK`` (``1`` = True), else False.
    cache_seqlens, block_table : int32 arrays (B,) and (B, max_pages), optional
        Chunked prefill over a KV cache: with ``cache_seqlens``, ``k`` and ``v`` are the caches
        (contiguous (B, S_cache, Hk, D), or paged (num_pages, page_size, Hk, D) with ``block_table``),
        which already hold each sequence's new keys, ``cu_seqlens_k`` must be None, and sequence b's
        n_b queries attend to its ``cache_seqlens[b]`` keys aligned bottom-right as in
        :func:`decode` (query i sees keys ``j <= i + cache_seqlens[b] - n_b`` with ``causal``).
        Runs on the Hopper forward kernel reading the cache where :func:`cuflash.decode` would, else on
        the decode kernel; no dropout. Index arrays are checked
        as in :func:`decode`.

    Returns
    -------
    out : CuPy array (total_q, Hq, D), the dtype of q
        Rows that see no key are 0.
    lse : CuPy float32 array (Hq, total_q)
        Only with ``return_lse``; with ``sinks``, ``exp(sinks[h])`` is in its sum; ``-inf``
        (``sinks[h]``) for a row that sees no key.

    Raises
    ------
    TypeError
        As :func:`attention`, and ``cu_seqlens_q``/``cu_seqlens_k`` that are not int32 CUDA arrays,
        ``max_seqlen_q``/``max_seqlen_k`` or ``check`` of the wrong type.
    ValueError
        As :func:`attention`; ``cu_seqlens_q``/``cu_seqlens_k`` that are not 1-d or differ in length,
        a negative ``max_seqlen_*``, ``mask``/``bias``/``block_mask`` given; and offsets or
        ``max_seqlen_*`` that the GPU check finds wrong (at once with ``check=True``).
    RuntimeError
        CuPy or a usable CUDA GPU is missing, or a call that needs copies is being captured.

    See Also
    --------
    attention_varlen_backward : the gradients.
    cuflash.reference.attention_varlen : the float64 host reference.

    Examples
    --------
    >>> import cupy as cp
    >>> import cuflash
    >>> lengths = [100, 37, 512]                          # three sequences, 649 rows in all
    >>> cu = cp.asarray([0, 100, 137, 649], dtype=cp.int32)
    >>> q, k, v = (cp.random.standard_normal((649, 8, 64), dtype=cp.float32).astype(cp.float16)
    ...            for _ in range(3))
    >>> out = cuflash.attention_varlen(q, k, v, cu, cu, max_seqlen_q=512, max_seqlen_k=512, causal=True)
    >>> out.shape
    (649, 8, 64)
    """
    for value, name in ((mask, "mask"), (bias, "bias"), (block_mask, "block_mask")):
        if value is not None:
            raise ValueError(f"{name} is not supported by attention_varlen; pad and call attention instead")
    if cache_seqlens is not None or block_table is not None:   # chunked prefill over a cache
        if cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_k must be None with cache_seqlens/block_table: the caches hold the keys")
        if dropout_p:
            raise ValueError("dropout_p must be 0 with cache_seqlens/block_table (attention over a KV cache)")
        out, lse = _varlen_over_cache(q, k, v, cu_seqlens_q, max_seqlen_q=max_seqlen_q, cache_seqlens=cache_seqlens,
                                      block_table=block_table, causal=causal, window=window, softcap=softcap,
                                      alibi_slopes=alibi_slopes, scale=scale, score_mod=score_mod, mask_mod=mask_mod,
                                      sinks=sinks, return_lse=return_lse, out=out, check=check)
        return (out, lse) if return_lse else out
    out, lse = _varlen((q, k, v, out, None, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks), max_seqlen_q, max_seqlen_k,
                       causal, scale, window, softcap, dropout_p, generator, return_lse, check,
                       modifiers=(score_mod, mask_mod))
    return (out, lse) if return_lse else out


def _varlen_with_rng_words(q, k, v, cu_seqlens_q, cu_seqlens_k, rng_words, *, max_seqlen_q=None, max_seqlen_k=None,
                           causal=False, scale=None, window=None, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                           sinks=None, out=None, lse=None, check=None, score_mod=None, mask_mod=None):
    """:func:`attention_varlen` with ``return_lse=True``, writing ``lse`` (float32 (Hq, total_q),
    C-contiguous) when given, and reading its dropout (seed, offset) from the device words at address
    ``rng_words`` (see :func:`_forward_with_rng_words`). Returns (out, lse)."""
    return _varlen((q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks), max_seqlen_q, max_seqlen_k,
                   causal, scale, window, softcap, dropout_p, None, True, check, rng_words, (score_mod, mask_mod))


def _varlen(operands, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, dropout_p, generator, return_lse,
            check, rng_words=None, modifiers=(None, None)):
    """attention_varlen's check, plan and run (positional, as :func:`_forward`); returns (out, lse or None)."""
    mod_key = None
    if states_builtin(*modifiers):   # one cu_seqlens for both: each sequence square
        score_mod, mask_mod, window, softcap, alibi = lowered(*modifiers, causal, window, softcap, operands[7], None,
                                                              axis_len(operands[0], 1), operands[5] is operands[6])
        modifiers = (score_mod, mask_mod)
        if alibi is not operands[7]:
            operands = operands[:7] + (alibi,) + operands[8:]
    if modifiers[0] is not None or modifiers[1] is not None:
        mod_key, user_arrays = modifier_parts(*modifiers)
        operands = operands + user_arrays
    options = (max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, dropout_p, type(generator), return_lse,
               _forced_family.get(), mod_key)
    plan, ptrs, where = _memo.lookup("attention_varlen", operands, options)
    finish = None
    if plan is None:
        plan, ptrs, finish = _plan_varlen(operands, ptrs, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                          causal=causal, scale=scale, window=window, softcap=softcap,
                                          alibi_slopes=operands[7], dropout_p=dropout_p, generator=generator,
                                          return_lse=return_lse, modifiers=modifiers)
        if plan is None:
            out, lse = finish
            return out, (lse if return_lse else None)
    results, temps, _ = plan.run(operands, ptrs, where, generator=generator, rng_state=rng_words,
                                 check=_checks.check_flag(check))
    out = finish(results[0]) if finish is not None else results[0]
    return out, (results[1] if return_lse else None)


def _plan_varlen(operands, key, *, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap, alibi_slopes,
                 dropout_p, generator, return_lse, modifiers=(None, None)):
    """The full path of :func:`attention_varlen` (see :func:`_plan_attention`)."""
    import cupy

    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks = operands[:9]
    q, k, v, dtype_name = _checks.check_qkv(q, k, v, 3, "(total, heads, head_dim)")
    total_q, hq, d = q.shape
    dv = v.shape[-1]
    total_k = k.shape[0]
    cu_q, cu_k, batch, max_q, max_k = _checks.check_varlen(cu_seqlens_q, cu_seqlens_k, total_q, total_k,
                                                           max_seqlen_q, max_seqlen_k)
    _checks.check_problem_size(q, k, batch=batch, seqlen_q=max_q, seqlen_k=max_k, varlen=True)
    opts = _checks.check_options(head_dim=d, causal=causal, scale=scale, window=window, softcap=softcap,
                                 dropout_p=dropout_p, generator=generator, seqlens=(max_q, max_k))
    score_fields, score_arrays = score_operands(batch, hq, 1, 1, alibi_slopes=alibi_slopes, mask=None, bias=None,
                                                block_mask=None, block_size=(128, 128), first=7)
    sinks = _checks.check_sinks(sinks, hq)
    if sinks is not None:
        score_fields["sinks"] = ("operand", 8)
    user_fields, user_arrays, user_mods, user_source = user_operands(*modifiers, first=9)
    out_user = out
    if out is not None:
        out = _checks.check_out(out, "out", (total_q, hq, dv), q.dtype)
    if lse is not None:   # only given by _varlen_with_rng_words
        lse = _checks.check_out(lse, "lse", (hq, total_q), np.float32)
    _checks.check_disjoint((("out", out), ("lse", lse)),
                           (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k),
                            ("alibi_slopes", score_arrays[0]), ("sinks", sinks),
                            *((("score_mod/mask_mod argument", x) for x in user_arrays))))
    _family_for(dtype_name)

    if total_q * hq * d == 0 or batch == 0 or max_q == 0:
        _memo.nothing_to_plan()
        out = cupy.empty((total_q, hq, dv), dtype=q.dtype) if out is None else out
        if lse is None:
            lse = cupy.empty((hq, total_q), dtype=np.float32)
        lse.fill(-np.inf)
        if opts.dropout_p:
            opts.generator.next_state()
        return None, None, (out_user if out_user is not None else out, lse)

    d_pad, dv_pad = -(-d // 8) * 8, -(-dv // 8) * 8
    qk, kk, vk = _checks.kernel_ready(q, d_pad), _checks.kernel_ready(k, d_pad), _checks.kernel_ready(v, dv_pad)
    o_kernel = out
    if dv_pad != dv or (out is not None and out.data.ptr % 16):
        o_kernel = cupy.empty((total_q, hq, dv_pad), dtype=q.dtype)
    o_layout = o_kernel if o_kernel is not None else _checks.Shaped((total_q, hq, dv_pad), q.dtype)
    row_layout = {}
    for name, x in (("q", qk), ("k", kk), ("v", vk), ("o", o_layout)):
        sr, sh, _ = _checks.element_strides(x)
        row_layout.update({f"{name}_batch_stride": 0, f"{name}_row_stride": sr, f"{name}_head_stride": sh})
    row_layout.update(lse_batch_stride=0, lse_head_stride=total_q)
    seq_fields = dict(seqlen_q=max_q, seqlen_k=max_k, cu_seqlens_q=("operand", 5), cu_seqlens_k=("operand", 6))
    check = dict(cu_seqlens_q=("operand", 5), cu_seqlens_k=("operand", 6), batch=batch, total_q=total_q,
                 total_k=total_k, max_seqlen_q=max_q if max_seqlen_q is not None else 0,
                 max_seqlen_k=max_k if max_seqlen_k is not None else 0)
    plan = forward_plan("attention_varlen", operands, qk, kk, vk, o_layout, dtype_name=dtype_name, head_dim=d_pad,
                        head_dim_v=dv_pad, seq_fields={}, row_layout=row_layout, opts=opts,
                        score_fields={**score_fields, **seq_fields, **user_fields}, grid_rows=max_q, batch=batch,
                        heads_q=hq, check=check, lse_output=return_lse, user_mods=user_mods, user_source=user_source)
    kernel_operands = (qk, kk, vk, o_kernel, lse, cu_q, cu_k, score_arrays[0], sinks, *user_arrays)
    ptrs = _memo.pointers(kernel_operands)
    in_place = _memo.in_place(operands, kernel_operands)
    if not in_place:
        _capture.refuse_capture("attention_varlen", _capture.COPIES_NOT_CAPTURED)
    _memo.remember(key if in_place else None, plan)
    return plan, ptrs, _copy_out(out, out_user, o_kernel, dv)
