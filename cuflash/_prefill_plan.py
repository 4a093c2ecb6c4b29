"""Decode's many new tokens (chunked prefill) on the Hopper forward kernel.

The decode kernel packs 16 query rows a CTA and reads the keys they see, so a chunk of hundreds of new
tokens re-reads its prefix once per 16 rows. fwd_sm90 compiled with ``CUFLASH_KV_CACHE`` reads the
keys and values from the cache instead: 128 query rows a CTA, each sequence's length from
``cache_seqlens`` on the GPU, and the cache's rows by TMA (a contiguous cache, or pages of multiples of
8 rows in boxes that never cross a page, one copy a box when the rows run on from page to page) or
copied by the producer warpgroup (pages of other sizes:
:func:`cuflash.kernels.fwd_sm90.kv_cache_mode`). The new keys and values are written into the cache first by
``cuda_src/append_kv.cu``, so the forward attends exactly what the call stored.

:func:`runs_on_fwd_sm90` says which calls go this way (the rest stay on the decode kernel);
:func:`prefill_plan` builds their launches in the slots of a decode call's operands
(:mod:`cuflash.decode`). docs/decisions.md, "Chunked prefill on fwd_sm90", has the measurements.
"""

from __future__ import annotations

import contextvars
import math

import numpy as np

from . import _checks, kernels
from ._build.compile import device_arch, get_kernel
from ._runtime import faults as _faults, launch as _launch, plan as _plan, step as _step, tma as _tma
from ._runtime.params import APPEND, FWD, Template

#: The kernel families a decode call can run on (:func:`force_kernel`).
FAMILIES = ("decode", "fwd_sm90")
_forced_family = contextvars.ContextVar("cuflash_forced_decode_family", default=None)


def force_kernel(family: str):
    """Run every decode call (and ``attention_varlen`` over a cache) inside a ``with`` block on one
    kernel family: ``"decode"`` (cuda_src/decode.cu) or ``"fwd_sm90"`` (the Hopper forward over the
    cache, whatever the number of new tokens). A call fwd_sm90 cannot run raises ValueError naming why,
    never falls back. For tests and benchmarks."""
    return _launch.forcing(_forced_family, family, FAMILIES)


def forced() -> str | None:
    """The family :func:`force_kernel` forces (part of the plan memo's key), None: chosen per call."""
    return _forced_family.get()


def runs_on_fwd_sm90(*, seqlen_q, work_items, sms, **arguments) -> bool:
    """Whether a decode call runs on fwd_sm90 over its cache: forced, or enough new tokens
    (:func:`kernels.fwd_sm90.kv_cache_pays`: ``seqlen_q`` the longest sequence's, ``work_items`` fwd_sm90's
    128-row blocks x query heads x sequences, ``sms`` the GPU's); and nothing in :func:`obstacle`. A
    forced fwd_sm90 that cannot run the call is a ValueError."""
    family = _forced_family.get()
    if family == "decode":
        return False
    why = obstacle(**arguments)
    if family == "fwd_sm90":
        if why is not None:
            raise ValueError(f"the forced kernel family fwd_sm90 cannot run this decode call: {why}")
        return True
    return why is None and kernels.fwd_sm90.kv_cache_pays(seqlen_q, work_items, sms)


def obstacle(*, dtype_name, score_mods, kv_dtype, mla, num_splits, paged, page_size, num_pages, head_dim,
             head_dim_v, cache_in_place, arrays) -> str | None:
    """Why a decode call (its checked arguments) cannot run on fwd_sm90 over its cache, or None.
    ``arrays``: q, k_cache, v_cache, out (kernel-ready; out None when the plan allocates it)."""
    if device_arch() != "sm_90a":
        return "not a Hopper GPU (sm_90a)"
    if not cache_in_place:
        return "the cache's rows are not 16-byte aligned (the call copies it)"
    if dtype_name not in ("float16", "bfloat16") or kv_dtype is not None or mla:
        return "float32 data, fp8 caches and MLA run on the decode kernel only"
    if num_splits:
        return f"num_splits = {num_splits} (split-KV is the decode kernel's)"
    if tuple(score_mods) not in kernels.fwd_sm90.KV_CACHE_SCORE_MODS:
        return (f"the score modifiers {score_mods} (fwd_sm90 over a cache takes one of "
                f"{kernels.fwd_sm90.KV_CACHE_SCORE_MODS[1:]})")
    if paged and num_pages * page_size >= 2**31:
        return f"a paged cache of {num_pages} x {page_size} rows (its rows are counted in int32)"
    why = kernels.fwd_sm90.value_head_dim_obstacle(head_dim, head_dim_v)
    if why is not None:
        return why
    if not all(x is None or _tma.tma_compatible(x) for x in arrays):
        return "q, the caches or out have strides a tensor map cannot describe"
    return None


def _strides(x, name, unit=None):
    """{name_batch_stride, _row_stride, _head_stride} of a (B, S, H, D) array (a paged cache's batch is its
    page), in elements, or in bytes with ``unit="bytes"`` (cuda_src/append_kv.cu)."""
    strides = x.strides[:3] if unit == "bytes" else _checks.element_strides(x)[:3]
    return dict(zip((f"{name}_batch_stride", f"{name}_row_stride", f"{name}_head_stride"), strides))


def prefill_plan(slots, *, n_operands, dtype_name, q, k_cache, v_cache, k_new, v_new, out, out_shape, lse_shape,
                 varlen, batch, seqlen_q, heads_q, head_dim, head_dim_v, paged, page_size, table_stride, capacity,
                 seqlen_new, lens_given, opts, alibi_batch_stride, sinks, return_lse, lse_output, check):
    """The plan of a decode call on fwd_sm90 over its cache: [the index check,] [the append,] the forward.

    ``slots``: the decode call's operand indices by name (q, k_cache, v_cache, cache_seqlens, block_table,
    k_new, v_new, alibi_slopes, sinks, out, lse, cu_seqlens_q). ``q`` (a batch of rows when ``varlen``),
    the caches, ``k_new``/``v_new`` and ``out`` (an array or :class:`_checks.Shaped`; ragged: one batch of
    rows, as q) are kernel-ready (16-byte rows, strides a tensor map takes); ``out_shape`` the output the
    call returns. ``check``: the index check's fields, or None.
    """
    heads_k = k_cache.shape[2]
    score_mods = (("softcap",) if opts.softcap > 0 else ()) + (("alibi_slopes",) if alibi_batch_stride is not None
                                                                else ())
    rows_run_on = paged and head_dim % 64 == 0 and head_dim_v % 64 == 0 and all(
        x.strides[0] == page_size * x.strides[1] for x in (k_cache, v_cache))
    mode = kernels.fwd_sm90.kv_cache_mode(page_size if paged else None, rows_run_on)
    plan_k = kernels.fwd_sm90.plan(dtype_name, head_dim, score_mods=score_mods, dropout=False,
                                   head_dim_v=head_dim_v if head_dim_v != head_dim else None, kv_cache=mode)
    block_n = dict(plan_k.variant.defines)["CUFLASH_BLOCK_N"]
    box_rows = kernels.fwd_sm90.kv_box_rows(page_size if paged else None, block_n)
    lse_buffer = _step.Buffer(lse_shape, np.float32)
    outputs = {slots["out"]: _step.Buffer(out_shape, out.dtype)}
    if lse_output:
        outputs[slots["lse"]] = lse_buffer
    plan = _plan.Plan("decode", n_operands, outputs=outputs, temps=() if lse_output else (lse_buffer,),
                      aligned=tuple(slots[name] for name in ("q", "k_cache", "v_cache", "k_new", "v_new", "out")),
                      checked=check is not None,
                      results=(slots["out"], slots["lse"]) if return_lse else (slots["out"],))
    device_id = _launch.device_id()
    error = {}
    if check is not None:
        plan.steps.append(_faults.check_step(plan, check, device_id))
        error = {"error": plan.index("error")}

    if seqlen_new:
        fields = dict(**_strides(k_new, "k_new", "bytes"), **_strides(v_new, "v_new", "bytes"),
                      **_strides(k_cache, "k", "bytes"), **_strides(v_cache, "v", "bytes"),
                      block_table_batch_stride=table_stride, seqlen_new=seqlen_new, heads_k=heads_k,
                      k_chunks=head_dim * k_cache.itemsize // 16, v_chunks=head_dim_v * v_cache.itemsize // 16,
                      page_size=page_size)
        append_slots = dict(k_new=slots["k_new"], v_new=slots["v_new"], k_cache=slots["k_cache"],
                            v_cache=slots["v_cache"], cache_seqlens=slots["cache_seqlens"], **error)
        if paged:
            append_slots["block_table"] = slots["block_table"]
        work = seqlen_new * heads_k * max(fields["k_chunks"], fields["v_chunks"])
        threads = kernels.append_kv.APPEND_THREADS
        func = _launch.prepare_kernel(get_kernel(kernels.append_kv.append_kv_variant()), 0, device_id)
        plan.steps.append(_step.Step(func, (-(-work // threads), batch, 1), threads, 0,
                                     (("struct", Template(APPEND, fields, append_slots)),)))

    left, right = opts.window
    lse_strides = _checks.element_strides(_checks.Shaped(lse_shape, np.float32))
    out_strides = _checks.element_strides(out)
    fields = dict(batch=batch, seqlen_q=seqlen_q, seqlen_k=capacity, heads_q=heads_q, heads_k=heads_k,
                  head_dim=head_dim, head_dim_v=head_dim_v, window_left=left, window_right=right, scale=opts.scale,
                  scale_log2=opts.scale * math.log2(math.e), softcap=opts.softcap,
                  seqlen_k_new=seqlen_new if lens_given else 0, page_size=page_size, kv_box_rows=box_rows,
                  block_table_batch_stride=table_stride,
                  **_strides(k_cache, "k"), **_strides(v_cache, "v"),
                  lse_batch_stride=0 if varlen else lse_strides[0], lse_head_stride=lse_strides[-2],
                  o_row_stride=out_strides[-3], o_head_stride=out_strides[-2])
    fwd_slots = dict(q=slots["q"], k=slots["k_cache"], v=slots["v_cache"], o=slots["out"],
                     lse=slots["lse"] if lse_output else plan.temp_index(0), **error)
    if lens_given:
        fwd_slots["seqused_k"] = slots["cache_seqlens"]
    if paged:
        fwd_slots["block_table"] = slots["block_table"]
    if varlen:
        fwd_slots["cu_seqlens_q"] = slots["cu_seqlens_q"]
    if alibi_batch_stride is not None:
        fwd_slots["alibi_slopes"] = slots["alibi_slopes"]
        fields["alibi_batch_stride"] = alibi_batch_stride
    if sinks is not None:
        fwd_slots["sinks"] = slots["sinks"]
    m_blocks = math.ceil(seqlen_q / plan_k.block_m)
    func = _launch.prepare_kernel(get_kernel(plan_k.variant), plan_k.smem_bytes, device_id)
    # (A gather reads the caches through their pointers and strides; its K/V maps go unused.)
    row_groups = mode == "row_groups"
    maps = [("map", slots[name], _tma.TensorMapSpec(x, rows, dtype_name, groups))
            for name, x, rows, groups in (("q", q, plan_k.block_m, False), ("k_cache", k_cache, box_rows, row_groups),
                                          ("v_cache", v_cache, box_rows, row_groups), ("out", out, 64, False))]
    grid = (min(m_blocks * heads_q * batch, _launch.sm_count(device_id)), 1, 1)
    plan.steps.append(_step.Step(func, grid, plan_k.threads, plan_k.smem_bytes,
                                 (*maps, ("struct", Template(FWD, fields, fwd_slots)),
                                  ("pointer", plan.index("counter")))))
    plan.info.update(family="fwd_sm90", kv_cache=mode, num_splits=1)
    return plan
