"""The plan of one forward call (attention, attention_varlen): the kernel family that runs it, its
parameters and its launches (cuda_src/fwd_sm90.cu, fwd_sm80.cu, fwd_simt.cu; their tiles and defines
come from :mod:`cuflash.kernels`)."""

from __future__ import annotations

import contextvars
import math

import numpy as np

from . import _checks, _scores, kernels
from ._runtime import faults as _faults, launch as _launch, plan as _plan, step as _step, tma as _tma
from ._build.compile import device_arch, get_kernel
from ._runtime.params import FWD, Template
from ._runtime.work_order import WorkOrder
from .random import dropout_threshold

#: The family :func:`cuflash.force_kernel` forces, None: chosen per call.
_forced_family = contextvars.ContextVar("cuflash_forced_family", default=None)
_num_sms = _launch.sm_count  # a module name, so tests can pretend to other SM counts


def _family_for(dtype_name: str) -> str | None:
    """The forced family after checking it can run this dtype (None: choose per call)."""
    family = _forced_family.get()
    if family in ("fwd_sm80", "fwd_sm90") and dtype_name == "float32":
        raise ValueError(f"the forced kernel family {family} runs float16/bfloat16, not float32")
    if family == "fwd_simt" and dtype_name != "float32":
        raise ValueError(f"the forced kernel family fwd_simt runs float32, not {dtype_name}")
    return family


def _sm90_obstacle(q, k, v) -> str | None:
    """Why fwd_sm90 cannot run this call, or None: its TMA loads need a 16-byte aligned base and
    positive strides that are multiples of 16 bytes. (Every option, varlen, head dims up to 256 and any
    pair of them for q/k and v run there.)"""
    obstacle = kernels.fwd_sm90.value_head_dim_obstacle(q.shape[-1], v.shape[-1])
    if obstacle is not None:
        return obstacle
    if not all(_tma.tma_compatible(x) for x in (q, k, v)):
        return "the strides of q, k or v are negative or not multiples of 16 bytes"
    return None


def _choose_family(dtype_name: str, q, k, v) -> str:
    forced = _family_for(dtype_name)
    if dtype_name == "float32":
        return "fwd_simt"
    obstacle = _sm90_obstacle(q, k, v)
    if forced == "fwd_sm90":
        if obstacle is not None:
            raise ValueError(f"the forced kernel family fwd_sm90 cannot run this call: {obstacle}")
        return forced
    if forced == "fwd_sm80":
        return forced
    return "fwd_sm90" if obstacle is None and _is_hopper() else "fwd_sm80"


def _is_hopper() -> bool:
    return device_arch() == "sm_90a"


def forward_plan(entry, operands, q, k, v, o, *, dtype_name, head_dim, head_dim_v=None, seq_fields, row_layout, opts,
                 score_fields, grid_rows, batch, heads_q, check=None, lse_output=True, dropout_origin=None,
                 user_mods=(), user_source="", score_arrays=None):
    """Choose the kernel and build the plan of one forward call.

    ``operands`` are the entry point's (q, k, v, out, lse, then the score and index arrays); ``q``,
    ``k``, ``v``, ``o`` the kernel-ready arrays whose layouts the plan encodes. ``score_fields``
    maps FwdParams fields to values, or, for pointers, to ``("operand", index)``. ``check`` is the
    index-check step's fields (varlen on the GPU), or None. ``dropout_origin``: the FwdParams fields
    of :func:`_checks.check_dropout_origin`, or None (origin (0, 0)). ``user_mods``, ``user_source``:
    the call's ScoreMod/MaskMod (:func:`cuflash._scores.user_operands`; their fields are in
    ``score_fields``). ``head_dim_v``: v's and out's head dim (padded to 8), None: ``head_dim``.
    ``score_arrays``: the kernel-ready bias and mask by name (:func:`cuflash._scores.score_operands`),
    whose layouts decide whether fwd_sm90 reads them as tiles.
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    family = _choose_family(dtype_name, q, k, v)
    dropout = opts.dropout_p > 0
    score_mods = (tuple(key for key in ("alibi_slopes", "mask", "bias", "block_mask") if key in score_fields)
                  + (("softcap",) if opts.softcap > 0 else ()) + tuple(user_mods))
    consumers = 2
    if family == "fwd_sm90" and entry == "attention" and head_dim_v == head_dim:
        consumers = kernels.fwd_sm90.sm90_consumers(head_dim, featured=bool(score_mods) or dropout,
                                               window=opts.window, seqlen_q=q.shape[1])
    tile_name = score_mods[0] if len(score_mods) == 1 and score_mods[0] in ("bias", "mask") else None
    tile_array = (score_arrays or {}).get(tile_name)
    score_tile = family == "fwd_sm90" and kernels.fwd_sm90.score_tile(score_mods, tile_array, dtype_name, head_dim,
                                                                      head_dim_v)
    plain_loop = family == "fwd_sm90" and (kernels.fwd_sm90.on_plain_loop(score_mods, opts.window) or score_tile)
    plan_k = kernels.forward.forward_plan(family, dtype_name, head_dim, score_mods=score_mods, dropout=dropout,
                                      consumers=consumers, user_source=user_source,
                                      head_dim_v=head_dim_v if head_dim_v != head_dim else None,
                                      on_plain_loop=plain_loop,
                                      tile_one_row=score_tile and kernels.fwd_sm90.tile_one_row(tile_array))
    b, hq = batch, heads_q
    if family == "fwd_sm90" and entry == "attention_varlen":
        # Its CTAs count work items (m-block, head, sequence) in int32, and under varlen the m-blocks
        # cover max_seqlen_q rows of every sequence (check_problem_size bounds the dense ones).
        _checks.check_size(math.ceil(grid_rows / plan_k.block_m) * hq * b, _checks.INT32_MAX,
                           "the query blocks of max_seqlen_q rows x heads x sequences",
                           "int32 in fwd_sm90: pass max_seqlen_q, the longest query sequence")
    device_id = _launch.device_id()
    order = None
    if family == "fwd_sm90" and "block_mask" in score_fields and seq_fields:
        tiles = math.ceil(grid_rows / plan_k.block_m)
        if kernels.work_order.takes_work_order(tiles, hq * b, _num_sms(device_id)):
            order = WorkOrder(score_fields, batch=b, heads=hq, tiles=tiles, by_keys=False, tile=plan_k.block_m,
                              step=dict(plan_k.variant.defines)["CUFLASH_BLOCK_N"], window=opts.window,
                              seqlen_q=seq_fields["seqlen_q"], seqlen_k=seq_fields["seqlen_k"])
    lse_shape = (hq, q.shape[0]) if entry == "attention_varlen" else (b, hq, q.shape[1])
    lse_buffer = _step.Buffer(lse_shape, np.float32)
    outputs = {3: _step.Buffer(o.shape, o.dtype)}
    temps = ()
    if lse_output:
        outputs[4] = lse_buffer
    else:
        temps = (lse_buffer,)
    if order is not None:
        temps += order.buffers()
    aligned = (0, 1, 2, 3) + ((score_fields[tile_name][1],) if score_tile else ())   # TMA reads these
    plan = _plan.Plan(entry, len(operands), outputs=outputs, temps=temps, aligned=aligned,
                          dropout=(dropout_threshold(opts.dropout_p), 1.0 / (1.0 - opts.dropout_p)) if dropout else None,
                          checked=check is not None, results=(3, 4) if lse_output else (3,))
    lse_slot = 4 if lse_output else plan.temp_index(0)
    left, right = opts.window
    fields = dict(**row_layout, **seq_fields, heads_q=hq, heads_k=k.shape[-2], head_dim=head_dim,
                  head_dim_v=head_dim_v, batch=b,
                  window_left=left, window_right=right, scale=opts.scale, scale_log2=opts.scale * math.log2(math.e),
                  softcap=opts.softcap)
    slots = {"q": 0, "k": 1, "v": 2, "o": 3, "lse": lse_slot}
    for name, value in score_fields.items():
        if isinstance(value, tuple):
            slots[name] = value[1]
        else:
            fields[name] = value
    if dropout:
        fields.update(dropout_threshold=dropout_threshold(opts.dropout_p), dropout_rescale=1.0 / (1.0 - opts.dropout_p),
                      **(dropout_origin or {}))
        slots.update(dropout_state=plan.index("dropout_state"), dropout_seed=plan.index("seed"),
                     dropout_offset=plan.index("offset"))
    if check is not None:
        plan.steps.append(_faults.check_step(plan, check, device_id))
        slots["error"] = plan.index("error")
    if order is not None:   # the tiles' order, from the block mask, ahead of the kernel that takes them
        slots["work_order"], walks, slots["work_bounds"] = (plan.temp_index(len(temps) - i) for i in (3, 2, 1))
        fields.update(order.kernel_fields())
        plan.steps += order.steps(slots["block_mask"], slots["work_order"], walks, slots["work_bounds"], device_id)
    if family == "fwd_sm90":
        fields["tail_heads"] = kernels.fwd_sm90.fwd_tail_heads(math.ceil(grid_rows / plan_k.block_m), hq * b,
                                                          _num_sms(device_id), shrinking=right >= 0 and left < 0)
    params = Template(FWD, fields, slots)
    kernel = get_kernel(plan_k.variant)
    func = _launch.prepare_kernel(kernel, plan_k.smem_bytes, device_id)
    grid = (math.ceil(grid_rows / plan_k.block_m), hq, b)
    if family == "fwd_sm90":
        # Persistent: at most one CTA per SM, each taking (m-block, head, batch) items from the
        # stream's counter, which the kernel leaves at 0 when it ends.
        grid = (min(grid[0] * hq * b, _num_sms(device_id)), 1, 1)
        block_n = dict(plan_k.variant.defines)["CUFLASH_BLOCK_N"]
        # O is written by TMA in boxes of one consumer warpgroup's 64 rows.
        boxes = (plan_k.block_m, block_n, block_n, 64)
        maps = [("map", i, _tma.TensorMapSpec(x, rows, dtype_name)) for i, (x, rows) in enumerate(zip((q, k, v, o), boxes))]
        if score_tile:   # the kernel takes the bias's or mask's map after O's
            maps.append(("map", slots[tile_name], _scores.score_tile_spec(tile_array, plan_k.block_m)))
        args = (*maps, ("struct", params), ("pointer", plan.index("counter")))
    else:
        args = (("struct", params),)
    plan.steps.append(_step.Step(func, grid, plan_k.threads, plan_k.smem_bytes, args))
    plan.info.update(family=family, mask_bits="mask_bits_offset" in score_fields)
    if family == "fwd_sm90":
        plan.info.update(consumers=consumers, tail_heads=fields["tail_heads"], on_plain_loop=plain_loop,
                         score_tile=score_tile, work_order=order is not None)
    return plan
