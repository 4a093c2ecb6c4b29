"""MLA decode on Hopper's wgmma kernel (cuda_src/mla_sm90.cu).

The decode kernel runs MLA (one latent kv head of 576 columns, the values its first 512) with 16
packed query rows a CTA on mma.sync. mla_sm90 takes 64 packed rows a CTA on wgmma, or 16 with the keys
as wgmma's M for calls of at most 16 rows (:func:`kernels.mla_sm90.mla_sm90_rows`), the latent tiles by
TMA, split-KV with the last split combining. New latent rows are written into the cache first by
``cuda_src/append_kv.cu``, so the kernel attends exactly what the call stored.

:func:`runs_on_mla_sm90` says which calls go this way (the rest stay on the decode kernel);
:func:`mla_plan` builds their launches in the slots of a decode call's operands (:mod:`cuflash.decode`).
docs/decisions.md, "MLA decode on wgmma", has the measurements.
"""

from __future__ import annotations

import contextvars
import math

import numpy as np

from . import _checks, kernels
from ._build.compile import device_arch, get_kernel
from ._prefill_plan import _strides
from ._runtime import faults as _faults, launch as _launch, plan as _plan, step as _step, tma as _tma
from ._runtime.params import APPEND, DECODE, Template

#: The kernel families an MLA decode call can run on (:func:`force_kernel`).
FAMILIES = ("decode", "mla_sm90")
_forced_family = contextvars.ContextVar("cuflash_forced_mla_family", default=None)


def force_kernel(family: str):
    """Run every MLA decode call inside a ``with`` block on one kernel family: ``"decode"``
    (cuda_src/decode.cu) or ``"mla_sm90"``. A call mla_sm90 cannot run raises ValueError naming why,
    never falls back. For tests and benchmarks."""
    return _launch.forcing(_forced_family, family, FAMILIES)


def forced() -> str | None:
    """The family :func:`force_kernel` forces (part of the plan memo's key), None: chosen per call."""
    return _forced_family.get()


def runs_on_mla_sm90(**arguments) -> bool:
    """Whether an MLA decode call runs on mla_sm90: unless forced onto the decode kernel, whenever
    nothing in :func:`obstacle` stands in the way. A forced mla_sm90 that cannot run the call is a
    ValueError."""
    family = _forced_family.get()
    if family == "decode":
        return False
    why = obstacle(**arguments)
    if family == "mla_sm90" and why is not None:
        raise ValueError(f"the forced kernel family mla_sm90 cannot run this decode call: {why}")
    return why is None


def obstacle(*, dtype_name, score_mods, sinks, window, seqlen_q, varlen, num_splits, paged, page_size, head_dim,
             out_dim, cache_in_place, arrays) -> str | None:
    """Why an MLA decode call (its checked arguments) cannot run on mla_sm90, or None. ``arrays``:
    q, the latent cache, k_new and out (kernel-ready; None where absent or allocated by the plan)."""
    if device_arch() != "sm_90a":
        return "not a Hopper GPU (sm_90a)"
    if dtype_name not in kernels.mla_sm90.MLA_SM90_DTYPES:
        return f"{dtype_name} data (mla_sm90 runs float16/bfloat16)"
    if head_dim != kernels.decode.DECODE_MLA_HEAD_DIM or out_dim != 512:
        return f"v_head_dim = {out_dim} (mla_sm90 computes all 512 value columns)"
    if score_mods or sinks is not None:
        return "score modifiers or sinks (mla_sm90 has none)"
    if window[0] >= 0 or not (window[1] == 0 or (window[1] < 0 and seqlen_q == 1)):
        return f"window = {window} (mla_sm90 runs causal calls, or any call of one new token)"
    if varlen:
        return "ragged new tokens (cu_seqlens_q)"
    if num_splits > kernels.mla_sm90.MLA_SM90_MAX_SPLITS:
        return f"num_splits = {num_splits} (mla_sm90 combines at most {kernels.mla_sm90.MLA_SM90_MAX_SPLITS})"
    if paged and page_size % kernels.mla_sm90.MLA_SM90_KEYS:
        return f"pages of {page_size} rows (mla_sm90's tiles of {kernels.mla_sm90.MLA_SM90_KEYS} keys need whole ones)"
    if not cache_in_place:
        return "the cache's rows are not 16-byte aligned (the call copies it)"
    if not all(x is None or _tma.tma_compatible(x) for x in arrays):
        return "q, the cache, k_new or out have strides a tensor map cannot describe"
    return None


#: Splits at most, and tiles of 64 keys a split at least: the last split of a (sequence, row block) adds
#: every split's float32 partial alone (at (1, 32k) with 128 heads, 64 splits of 8 tiles took 154 us,
#: its combine reading 8 MiB; one split 1018 us).
MLA_MAX_SPLITS, MLA_MIN_SPLIT_TILES = 32, 8


def mla_num_splits(batch: int, row_blocks: int, keys: int, sms: int) -> int:
    """Splits of each (sequence, row block)'s keys: as many as one wave of CTAs (one an SM) holds, so that
    no split waits for a second wave (B 64, 4k, 128 heads: one split 148 us, two 226), within
    MLA_MAX_SPLITS and MLA_MIN_SPLIT_TILES."""
    tiles = -(-keys // kernels.mla_sm90.MLA_SM90_KEYS)
    wave = sms // max(1, batch * row_blocks)
    return max(1, min(wave, tiles // MLA_MIN_SPLIT_TILES, MLA_MAX_SPLITS))


def mla_plan(slots, *, n_operands, dtype_name, q, cache, k_new, out, out_shape, lse_shape, batch, seqlen_q, heads_q,
             paged, page_size, table_stride, capacity, keys, seqlen_new, lens_given, scale, num_splits, return_lse,
             lse_output, check):
    """The plan of an MLA decode call on mla_sm90: [the index check,] [the append,] the kernel.

    ``slots``: the decode call's operand indices by name (q, k_cache, cache_seqlens, block_table, k_new,
    out, lse). ``q``, ``cache``, ``k_new`` and ``out`` (an array or :class:`_checks.Shaped`) are
    kernel-ready (16-byte rows, strides a tensor map takes). ``keys``: the most keys a sequence may
    hold after the call (for the split count; the lengths themselves stay on the GPU). ``check``: the
    index check's fields, or None.
    """
    device_id = _launch.device_id()
    rows = seqlen_q * heads_q
    cta_rows = kernels.mla_sm90.mla_sm90_rows(rows)
    row_blocks = -(-rows // cta_rows)
    if num_splits == 0:
        num_splits = mla_num_splits(batch, row_blocks, keys, _launch.sm_count(device_id))
    lse_buffer = _step.Buffer(lse_shape, np.float32)
    temps = [] if lse_output else [lse_buffer]
    if num_splits > 1:
        temps += [_step.Buffer((num_splits, batch, seqlen_q, heads_q, 512), np.float32),
                  _step.Buffer((num_splits, batch, heads_q, seqlen_q), np.float32)]
    outputs = {slots["out"]: _step.Buffer(out_shape, out.dtype)}
    if lse_output:
        outputs[slots["lse"]] = lse_buffer
    plan = _plan.Plan("decode", n_operands, outputs=outputs, temps=temps,
                      aligned=tuple(slots[name] for name in ("q", "k_cache", "k_new", "out")),
                      checked=check is not None,
                      results=(slots["out"], slots["lse"]) if return_lse else (slots["out"],),
                      split_counters=batch * row_blocks if num_splits > 1 else 0)
    error = {}
    if check is not None:
        plan.steps.append(_faults.check_step(plan, check, device_id))
        error = {"error": plan.index("error")}

    if seqlen_new:   # the new latent rows into the cache (append_kv.cu: K and V are the same rows here)
        chunks = cache.shape[-1] * cache.itemsize // 16
        fields = dict(**_strides(k_new, "k_new", "bytes"), **_strides(k_new, "v_new", "bytes"),
                      **_strides(cache, "k", "bytes"), **_strides(cache, "v", "bytes"),
                      block_table_batch_stride=table_stride, seqlen_new=seqlen_new, heads_k=1,
                      k_chunks=chunks, v_chunks=0, page_size=page_size)
        append_slots = dict(k_new=slots["k_new"], v_new=slots["k_new"], k_cache=slots["k_cache"],
                            v_cache=slots["k_cache"], cache_seqlens=slots["cache_seqlens"], **error)
        if paged:
            append_slots["block_table"] = slots["block_table"]
        threads = kernels.append_kv.APPEND_THREADS
        func = _launch.prepare_kernel(get_kernel(kernels.append_kv.append_kv_variant()), 0, device_id)
        plan.steps.append(_step.Step(func, (-(-seqlen_new * chunks // threads), batch, 1), threads, 0,
                                     (("struct", Template(APPEND, fields, append_slots)),)))

    lse_strides = _checks.element_strides(_checks.Shaped(lse_shape, np.float32))
    fields = {"score.scale": scale, "score.scale_log2": scale * math.log2(math.e)}   # all the kernel reads of score
    fields.update(batch=batch, seqlen_q=seqlen_q, heads_q=heads_q, heads_k=1, group=heads_q, head_dim=cache.shape[-1],
                  out_dim=512, seqlen_cache=capacity, seqlen_new=seqlen_new if lens_given else 0,
                  page_size=page_size, num_splits=num_splits, row_blocks=row_blocks,
                  lse_batch_stride=lse_strides[0], lse_head_stride=lse_strides[1],
                  **_strides(q, "q"), **_strides(out, "o"))
    if paged:
        fields["block_table_batch_stride"] = table_stride
    kernel_slots = dict(q=slots["q"], k_cache=slots["k_cache"], v_cache=slots["k_cache"], o=slots["out"],
                        lse=slots["lse"] if lse_output else plan.temp_index(0), **error)
    if lens_given:
        kernel_slots["cache_seqlens"] = slots["cache_seqlens"]
    if paged:
        kernel_slots["block_table"] = slots["block_table"]
    if num_splits > 1:
        part = len(temps) - 2
        kernel_slots.update(o_part=plan.temp_index(part), lse_part=plan.temp_index(part + 1),
                            split_counters=plan.index("split_counters"))
    variant = kernels.mla_sm90.mla_sm90_variant(dtype_name, cta_rows)
    smem = kernels.mla_sm90.mla_sm90_smem_bytes(cta_rows)
    func = _launch.prepare_kernel(get_kernel(variant), smem, device_id)
    kv_map = ("map", slots["k_cache"], _tma.TensorMapSpec(cache, kernels.mla_sm90.MLA_SM90_KEYS, dtype_name))
    # Right behind the index check (no append between), the kernel starts before the check ends and
    # waits for its verdict only before it writes (cuda_src/fault.cuh).
    plan.steps.append(_step.Step(func, (row_blocks * num_splits, 1, batch), kernels.mla_sm90.MLA_SM90_THREADS,
                                 smem, (kv_map, ("struct", Template(DECODE, fields, kernel_slots))),
                                 dependent=check is not None and not seqlen_new))
    plan.info.update(family="mla_sm90", num_splits=num_splits, cta_rows=cta_rows)
    return plan
