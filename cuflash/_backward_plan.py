"""The plan of one backward call (attention_backward, attention_varlen_backward): the kernel family
of its dK/dV pass, and its launch sequence (preprocess, the passes, the conversions; see
:mod:`cuflash.backward`), whose tiles and defines come from :mod:`cuflash.kernels`."""

from __future__ import annotations

import contextvars
import math

import numpy as np

from . import _checks, _scores, kernels
from ._runtime import faults as _faults, launch as _launch, plan as _plan, step as _step, tma as _tma
from ._build.compile import device_arch, get_kernel
from ._runtime.params import BWD, CONVERT, Template
from ._runtime.work_order import WorkOrder
from .random import dropout_threshold

#: The family :func:`cuflash.backward.force_kernel` forces, None: chosen per call.
_forced_family = contextvars.ContextVar("cuflash_forced_backward_family", default=None)


def _family_for(dtype_name: str) -> str | None:
    """The forced family after checking it can run this dtype (None: choose per call)."""
    family = _forced_family.get()
    if family in ("bwd_sm80", "bwd_sm90") and dtype_name == "float32":
        raise ValueError(f"the forced kernel family {family} runs float16/bfloat16, not float32")
    if family == "bwd_simt" and dtype_name != "float32":
        raise ValueError(f"the forced kernel family bwd_simt runs float32, not {dtype_name}")
    return family


def _sm90_obstacle(d_pad: int, score_mods, dropout: bool, layouts, dv_pad: int | None = None) -> str | None:
    """Why bwd_sm90 cannot run this call, or None: it needs an sm_90 GPU, a head dim and options it
    compiles (kernels.bwd_sm90.bwd_sm90_obstacle), and q, k, v, dout that TMA can read (16-byte aligned
    bases, positive strides that are multiples of 16 bytes), and fewer than BWD_SM90_MAX_HEADS query heads."""
    obstacle = kernels.bwd_sm90.bwd_sm90_obstacle(d_pad, score_mods, dropout, dv_pad)
    if obstacle is not None and dv_pad not in (None, d_pad):
        return obstacle
    if device_arch() != "sm_90a":
        return "bwd_sm90 needs an sm_90 GPU (H100/H200)"
    if obstacle is not None:
        return obstacle
    if not all(_tma.tma_compatible(layouts[name]) for name in ("q", "k", "v", "dout")):
        return "the strides of q, k, v or dout are negative or not multiples of 16 bytes"
    if layouts["q"].shape[-2] >= kernels.bwd_sm90.BWD_SM90_MAX_HEADS:
        return f"bwd_sm90 runs fewer than {kernels.bwd_sm90.BWD_SM90_MAX_HEADS} query heads"
    return None


def _choose_family(dtype_name: str, forced: str | None, d_pad: int, score_mods, dropout: bool, layouts,
                   dv_pad: int | None = None) -> str:
    """The forced family, or the default for the dtype: bwd_sm90 on sm_90 where it can run the call
    (a value head dim of its own, ``dv_pad``, in the pairs it compiles), bwd_sm80 otherwise (bwd_simt
    for float32)."""
    if forced is not None and forced != "bwd_sm90":
        return forced
    if dtype_name == "float32":
        return "bwd_simt"
    obstacle = _sm90_obstacle(d_pad, score_mods, dropout, layouts, dv_pad)
    if forced == "bwd_sm90" and obstacle is not None:
        raise ValueError(f"the forced kernel family bwd_sm90 cannot run this call: {obstacle}")
    return "bwd_sm90" if obstacle is None else "bwd_sm80"


_num_sms = _launch.sm_count  # a module name, so tests can pretend to other SM counts
_max_smem = _launch.max_smem_per_block




def _rows(x, varlen: bool) -> dict:
    """(batch, row, head) element strides of a (B, S, H, D) array, or (0, row, head) of (T, H, D)."""
    strides = _checks.element_strides(x)
    if varlen:
        return dict(batch=0, row=strides[0], head=strides[1])
    return dict(batch=strides[0], row=strides[1], head=strides[2])


def _layout_fields(prefix: str, x, varlen: bool) -> dict:
    r = _rows(x, varlen)
    return {f"{prefix}_batch_stride": r["batch"], f"{prefix}_row_stride": r["row"], f"{prefix}_head_stride": r["head"]}


# ----------------------------------------------------------------------------- launch sequence

def _convert_launch(plan, dtype_name, device_id, grid, fields, slots, smem=0, dependent=False):
    """A bwd_convert step: its ConvertParams ``fields`` and operand ``slots`` (value indices), and
    the call's index-check verdict when the plan has one."""
    if plan.checked:
        slots = {**slots, "error": plan.index("error")}
    params = Template(CONVERT, fields, slots)
    func = _launch.prepare_kernel(get_kernel(kernels.bwd_common.bwd_convert_variant(dtype_name)), smem, device_id)
    return _step.Step(func, grid, 256, smem, (("struct", params),), dependent=dependent)


def _convert_tiles_step(plan, dtype_name, device_id, *, src, dst, tiles, tile_rows, dq, varlen, rows, batch, heads,
                        head_dim, cu_seqlens, scale, done=None, done_expected=0, heads_per_slot=1):
    """bwd_convert of bwd_sm90's tiled dq_accum ``src`` (value index; ``tiles`` its shape) into dQ
    ``dst``: a CTA per tile of each sequence (``rows``: the longest), heads and sequences in y, z; the
    tile passes through shared memory in row-major order (columns padded by 8 elements).

    ``done`` (value index of bwd_sm90's dq_done): launched as bwd_sm90's programmatic dependent, each
    CTA waits until its (sequence, slot of ``heads_per_slot`` heads) has counted ``done_expected``
    landed consumers (cuda_src/bwd_convert.cu)."""
    strides = _checks.element_strides(tiles)
    d = _rows(dq, varlen)
    slots = {"src": src, "dst": dst}
    if cu_seqlens is not None:
        slots["cu_seqlens"] = cu_seqlens[1]
    if done is not None:
        slots["done"] = done
    fields = dict(src_row_stride=strides[-2], src_head_stride=strides[-3], src_batch_stride=0 if varlen else strides[0],
                  dst_row_stride=d["row"], dst_head_stride=d["head"], dst_batch_stride=d["batch"], rows=rows,
                  heads=heads, head_dim=head_dim, scale=scale, tile_rows=tile_rows, done_expected=done_expected,
                  heads_per_slot=heads_per_slot)
    smem = tile_rows * (strides[-2] + 8) * 2
    return _convert_launch(plan, dtype_name, device_id, (math.ceil(rows / tile_rows), heads, batch), fields, slots,
                           smem, dependent=done is not None)


def _convert_step(plan, dtype_name, device_id, *, src, dst, rows, heads, head_dim, src_row_stride,
                  src_head_stride, dst_row_stride, dst_head_stride, scale=1.0, num_partials=1, partial_stride=0):
    """bwd_convert: float32 ``src`` (value index) times ``scale``, summed over ``num_partials``, into
    ``dst`` (value index) in the output dtype."""
    fields = dict(partial_stride=partial_stride, src_row_stride=src_row_stride, src_head_stride=src_head_stride,
                  dst_row_stride=dst_row_stride, dst_head_stride=dst_head_stride, rows=rows, heads=heads,
                  head_dim=head_dim, num_partials=num_partials, scale=scale)
    return _convert_launch(plan, dtype_name, device_id, (math.ceil(rows * heads / 8), 1, 1), fields,
                           {"src": src, "dst": dst})


def _backward_plan(entry, n_operands, *, family, dtype_name, varlen, batch, max_q, max_k, heads_q, heads_k, d,
                   d_pad, dv=None, dv_pad=None, layouts, lse_head_stride, fwd_fields, score_fields, dropout_p, deterministic, dbias_shape,
                   check=None, user_mods=(), user_source="", dsinks=None, score_arrays=None, dlse_at=None):
    """The plan of one backward call: [index check], preprocess, dK/dV pass (+ atomic dQ), then the
    dQ conversion or the dQ pass, and the sums of dK/dV partials. ``layouts`` maps q, k, v, out, dout,
    dq, dk, dv to arrays (or :class:`_checks.Shaped`) whose strides the kernels use; operands are
    0 dout, 1 q, 2 k, 3 v, 4 out, 5 lse, 6 dq, 7 dk, 8 dv, then the score and index arrays and the
    ScoreMod/MaskMod arrays. ``user_mods``, ``user_source``: the call's ScoreMod/MaskMod
    (:func:`cuflash._scores.user_operands` with ``backward=True``; their fields are in ``score_fields``).
    ``dsinks``: (operand index of sinks, operand index of dsinks) when the call returns dL/dsinks
    (bwd_preprocess sums each CTA's rows, bwd_dsinks each head's CTAs: cuda_src/bwd_dsinks.cu), else None;
    dsinks is then an output of the plan, its fourth result. ``dv``, ``dv_pad``: v's head dim (out, dout
    and dv have it) and its padding to 8; None: ``d``'s. ``score_arrays``: the kernel-ready bias and mask
    by name (:func:`cuflash._scores.score_operands`), whose layouts decide whether bwd_sm90 reads them as
    tiles (not with dbias: its stores run on the featured tiles). ``dlse_at``: the operand index of dL/dlse
    (in lse's layout) when the loss reads lse, which bwd_preprocess takes out of D; else None."""
    dv, dv_pad = (d, d_pad) if dv is None else (dv, dv_pad)
    own_v = dv_pad if dv_pad != d_pad else None   # v's compiled head dim, where it differs
    score_mods = tuple(key for key in ("alibi_slopes", "mask", "bias", "block_mask") if key in score_fields) + (
        ("softcap",) if fwd_fields.get("softcap", 0.0) > 0 else ()) + tuple(user_mods)
    dropout = dropout_p > 0
    family = _choose_family(dtype_name, family, d_pad, score_mods, dropout, layouts, dv_pad)
    device_id = _launch.device_id()
    # Deterministic bwd_sm90 adds dQ in a fixed order (cuda_src/dq_order.cuh) where it can; else, and
    # on the other families, a dQ pass computes dQ after the dK/dV pass (bwd_sm90 has none: bwd_sm80's).
    sm90_mode = (kernels.bwd_sm90.bwd_sm90_dq_mode(d_pad, bool(score_mods or dropout), bool(deterministic))
                 if family == "bwd_sm90" else None)
    ordered = sm90_mode is True
    dq_pass = bool(deterministic) and not ordered
    windowed = (fwd_fields["window_left"], fwd_fields["window_right"]) != (-1, -1)
    all_seen = kernels.bwd_sm90.bwd_all_keys_seen(windowed=windowed, varlen=varlen, featured=bool(score_mods or dropout))
    tile_name = score_mods[0] if len(score_mods) == 1 and score_mods[0] in ("bias", "mask") else None
    tile_array = (score_arrays or {}).get(tile_name)
    score_tile = (family == "bwd_sm90" and dbias_shape is None
                  and kernels.bwd_sm90.takes_score_tiles(d_pad, score_mods, dropout, sm90_mode, own_v)
                  and kernels.fwd_sm90.score_tile_layout(score_mods, tile_array, dtype_name))
    group = heads_q // heads_k
    persistent = False
    if family == "bwd_sm90" and not score_tile:
        blocks = math.ceil(max_k / kernels.bwd_sm90.bwd_sm90_tiles(kernels.bwd_sm90.compiled_head_dims(d_pad)[0])[0])
        persistent = kernels.bwd_sm90.bwd_sm90_persistent(
            d_pad, score_mods=score_mods, dropout=dropout, deterministic=sm90_mode, varlen=varlen, head_dim_v=own_v,
            seqlen_q=max_q, seqlen_k=max_k, window=(fwd_fields["window_left"], fwd_fields["window_right"]),
            heads_per_cta=kernels.bwd_common.backward_heads_per_cta(batch, heads_k, group, blocks,
                                                                    _num_sms(device_id)))
    allows_first_stores = family == "bwd_sm90" and kernels.bwd_sm90.bwd_sm90_first_stores_dq(
        score_mods=score_mods, dropout=dropout, deterministic=sm90_mode, varlen=varlen, seqlen_q=max_q,
        seqlen_k=max_k, window=(fwd_fields["window_left"], fwd_fields["window_right"]))
    plan0 = kernels.backward.backward_plan(family, dtype_name, d_pad, dq_pass=False, score_mods=score_mods,
                                      dropout=dropout, deterministic=sm90_mode, windowed=windowed, seqlen_q=max_q,
                                      all_keys_seen=all_seen, user_source=user_source, head_dim_v=own_v,
                                      score_tile=score_tile,
                                      tile_one_row=score_tile and kernels.fwd_sm90.tile_one_row(tile_array),
                                      persistent=persistent, dq_first_stores=allows_first_stores)
    dq_family = "bwd_sm80" if family == "bwd_sm90" else family
    plan1 = (kernels.backward.backward_plan(dq_family, dtype_name, d_pad, dq_pass=True, score_mods=score_mods,
                                       dropout=dropout, user_source=user_source, head_dim_v=own_v) if dq_pass else None)
    for p in (plan0, plan1):
        if p is not None and p.smem_bytes > _max_smem(device_id):
            raise ValueError(f"the backward for head_dim {d} needs {p.smem_bytes // 1024} KiB of shared memory "
                             f"per block; this GPU offers {_max_smem(device_id) // 1024} KiB")

    key_blocks = math.ceil(max_k / plan0.block_m)
    heads_per_cta = kernels.bwd_common.backward_heads_per_cta(batch, heads_k, group, key_blocks, _num_sms(device_id))
    splits = group // heads_per_cta
    defines0 = dict(plan0.variant.defines)
    dq_tile = defines0["CUFLASH_BLOCK_M"] if family == "bwd_sm90" and not dq_pass else 0
    # Each dQ tile's first writer stores it where the call allows and the variant has writers: then
    # dq_accum is not zeroed.
    dq_first_stores = defines0.get("CUFLASH_BWD_DQ_FIRST_STORES", 0) == 1
    # Causal (the window bounded on the right only): each pass's later blocks walk less.
    shrinking = fwd_fields["window_right"] >= 0 and fwd_fields["window_left"] < 0
    # lse2 and D rows per head: whole tiles of every block size that reads them (bwd_sm90's 80-row
    # query tiles too).
    row_pad = math.lcm(kernels.bwd_common.BWD_ROW_PAD, dq_tile or 1)
    rows_pad = row_pad * max(1, math.ceil(max_q / row_pad))
    dq_t, dk_t, dv_t = layouts["dq"], layouts["dk"], layouts["dv"]
    temps = [_step.Buffer((batch, heads_q, rows_pad), np.float32),     # lse2
             _step.Buffer((batch, heads_q, rows_pad), np.float32)]     # dsum
    names = ["lse2", "dsum"]
    # bwd_sm90 adds dQ into whole tiles (cuda_src/bwd_common.cuh, dq_tile_offset): per head a row
    # space of tiles of the compiled head dim; under varlen each sequence's tiles start a tile apart.
    if dq_tile:
        total_q = dq_t.shape[0]
        shape = ((heads_q, -(-(total_q + batch * dq_tile) // dq_tile) * dq_tile, plan0.head_dim) if varlen
                 else (batch, heads_q, rows_pad, plan0.head_dim))
        # Zeroed by the preprocess kernel, every tile of every sequence (or stored by its first writer).
        temps.append(_step.Buffer(shape, np.float32))
        names.append("dq_accum")
        if ordered or dq_first_stores:
            # Two counters per tile of kBlockM rows (cuda_src/dq_order.cuh: one per consumer's share; the
            # first store's: writers, and first stores landed), zeroed by the preprocess.
            tiles = math.prod(shape) // (dq_tile * plan0.head_dim)
            temps.append(_step.Buffer((tiles * 2,), np.int32))
            names.append("dq_semaphore")
        elif kernels.bwd_sm90.bwd_convert_behind(shrinking=shrinking) and not persistent:
            # Landed consumers per (sequence, slot), zeroed by the preprocess: the conversion runs
            # behind bwd_sm90 as its programmatic dependent. (Not behind persistent CTAs, which would
            # wait for their counts between key blocks.)
            temps.append(_step.Buffer((batch * heads_k * splits,), np.int32))
            names.append("dq_done")
    elif not deterministic:
        # Zeroed by the preprocess kernel row by row; varlen rows outside every sequence need a memset.
        temps.append(_step.Buffer(dq_t.shape[:-1] + (d_pad,), np.float32, zero=varlen))
        names.append("dq_accum")
    if persistent:
        # The persistent CTAs' counter of key blocks taken, zeroed by the preprocess.
        temps.append(_step.Buffer((1,), np.int32))
        names.append("work_counter")
    if splits > 1:
        # float32 partial sums per head chunk: (rows, Hk * splits, d_pad); bwd_convert adds them.
        rows_k = dk_t.shape[:-2]
        for name, pad in (("dk_part", d_pad), ("dv_part", dv_pad)):
            temps.append(_step.Buffer(rows_k + (heads_k * splits, pad), np.float32))
            names.append(name)
    order = None
    if (family == "bwd_sm90" and not persistent and not ordered and "block_mask" in score_fields
            and kernels.work_order.takes_work_order(key_blocks, heads_k * splits * batch, _num_sms(device_id))):
        # The key blocks' order, from the block mask, ahead of the kernel (its CTAs start in grid order).
        order = WorkOrder(score_fields, batch=batch, heads=heads_q, tiles=key_blocks, by_keys=True,
                          tile=plan0.block_m, step=defines0["CUFLASH_BLOCK_M"], seqlen_q=max_q, seqlen_k=max_k,
                          window=(fwd_fields["window_left"], fwd_fields["window_right"]))
        temps += order.buffers()
        names += ["work_order", "work_walks", "work_bounds"]
    if dsinks is not None:
        # Per (sequence, query head, 16-row CTA of bwd_preprocess): that CTA's terms of dL/dsinks. Every
        # entry is written (no zeroing); before dbias, which _finisher takes as the last temporary.
        temps.append(_step.Buffer((batch, heads_q, rows_pad // 16), np.float32))
        names.append("dsink_part")
    if dbias_shape is not None:
        temps.append(_step.Buffer(dbias_shape, np.float32, zero=True))
        names.append("dbias")
    shaped = {name: _checks.Shaped(b.shape, b.dtype) for name, b in zip(names, temps)}
    outputs = {i: _step.Buffer(layouts[name].shape, layouts[name].dtype)
               for i, name in ((6, "dq"), (7, "dk"), (8, "dv"))}
    if dsinks is not None:
        outputs[dsinks[1]] = _step.Buffer((heads_q,), np.float32)
    aligned = tuple(range(9)) + ((score_fields[tile_name][1],) if score_tile else ())   # TMA reads these
    plan = _plan.Plan(entry, n_operands, outputs=outputs, temps=temps, aligned=aligned,
                          dropout=(dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p)) if dropout else None,
                          checked=check is not None,
                          results=(6, 7, 8) if dsinks is None else (6, 7, 8, dsinks[1]))
    temp = {name: plan.temp_index(i) for i, name in enumerate(names)}
    if check is not None:
        plan.steps.append(_faults.check_step(plan, check, device_id))

    fwd = dict(**fwd_fields, heads_q=heads_q, heads_k=heads_k, head_dim=d_pad, head_dim_v=dv_pad, batch=batch,
               lse_batch_stride=0 if varlen else heads_q * max_q, lse_head_stride=lse_head_stride)
    slots = {"fwd.q": 1, "fwd.k": 2, "fwd.v": 3, "fwd.o": 4, "fwd.lse": 5, "dout": 0, "dq": 6,
             "lse2": temp["lse2"], "dsum": temp["dsum"]}
    if dlse_at is not None:
        slots["dlse"] = dlse_at
    for name, value in score_fields.items():
        if isinstance(value, tuple):
            slots["fwd." + name] = value[1]
        else:
            fwd[name] = value
    if dropout:
        fwd.update(dropout_threshold=dropout_threshold(dropout_p), dropout_rescale=1.0 / (1.0 - dropout_p))
        slots.update({"fwd.dropout_state": plan.index("dropout_state"), "fwd.dropout_seed": plan.index("seed"),
                      "fwd.dropout_offset": plan.index("offset")})
    if check is not None:
        slots["fwd.error"] = plan.index("error")
    for name in ("q", "k", "v"):
        fwd.update(_layout_fields(name, layouts[name], varlen))
    fwd.update(_layout_fields("o", layouts["out"], varlen))
    dk_target = shaped["dk_part"] if splits > 1 else dk_t
    dv_target = shaped["dv_part"] if splits > 1 else dv_t
    slots["dk"] = temp["dk_part"] if splits > 1 else 7
    slots["dv"] = temp["dv_part"] if splits > 1 else 8

    def tail_pairs_of(launch_plan, blocks, pairs, ordered_dq=False):
        func = _launch.prepare_kernel(get_kernel(launch_plan.variant), launch_plan.smem_bytes, device_id)
        wave = _num_sms(device_id) * _launch.ctas_per_sm(func, launch_plan.threads, launch_plan.smem_bytes)
        return kernels.bwd_common.bwd_tail_pairs(blocks, pairs, wave, shrinking=shrinking, ordered=ordered_dq)

    # (bwd_sm80's and bwd_simt's dK/dV pass keep head by head: cuda_src/bwd_sm80.cu says why.)
    tail_pairs = tail_pairs_of(plan0, key_blocks, heads_k * splits * batch, ordered) if family == "bwd_sm90" else 0
    dq_tail_pairs = tail_pairs_of(plan1, math.ceil(max_q / plan1.block_m), heads_q * batch) if dq_pass else 0
    bwd = dict(seqlen_q_pad=rows_pad, heads_per_cta=heads_per_cta, dkv_partial=int(splits > 1), tail_pairs=tail_pairs,
               dq_tail_pairs=dq_tail_pairs,
               **_layout_fields("do", layouts["dout"], varlen), **_layout_fields("dk", dk_target, varlen),
               **_layout_fields("dv", dv_target, varlen), **_layout_fields("dq", dq_t, varlen))
    if dq_tile:
        slots["dq_accum"] = temp["dq_accum"]
        strides = _checks.element_strides(shaped["dq_accum"])
        bwd.update(dqa_batch_stride=0 if varlen else strides[0], dqa_head_stride=strides[-3],
                   dqa_row_stride=strides[-2], dqa_tile_rows=dq_tile)
        if ordered or dq_first_stores:
            slots["dq_semaphore"] = temp["dq_semaphore"]
        if "dq_done" in temp:
            slots["dq_done"] = temp["dq_done"]
    elif not deterministic:
        slots["dq_accum"] = temp["dq_accum"]
        bwd.update(_layout_fields("dqa", shaped["dq_accum"], varlen))
    if persistent:
        slots["work_counter"] = temp["work_counter"]
    if dsinks is not None:
        slots.update({"fwd.sinks": dsinks[0], "dsinks": dsinks[1], "dsink_part": temp["dsink_part"]})
    if dbias_shape is not None:
        sb, sh, sr, _ = _checks.element_strides(shaped["dbias"])
        slots["dbias"] = temp["dbias"]
        bwd.update(dbias_batch_stride=sb, dbias_head_stride=sh, dbias_row_stride=sr)
    if order is not None:
        slots["fwd.work_order"], slots["fwd.work_bounds"] = temp["work_order"], temp["work_bounds"]
        fwd.update(order.kernel_fields())
    params = Template(BWD, {**{"fwd." + k: val for k, val in fwd.items()}, **bwd}, slots)

    def step(variant, grid, threads, smem):
        func = _launch.prepare_kernel(get_kernel(variant), smem, device_id)
        return _step.Step(func, grid, threads, smem, (("struct", params),))

    plan.steps.append(step(kernels.bwd_common.bwd_preprocess_variant(dtype_name, dq_first_stores),
                           (rows_pad // 16, heads_q, batch), 128, 0))
    if dsinks is not None:   # (here, not at the end: bwd_sm90's dQ conversion may run as its dependent)
        plan.steps.append(step(kernels.bwd_common.bwd_dsinks_variant(), (heads_q, 1, 1),
                               kernels.bwd_common.BWD_DSINKS_THREADS, 0))
    if order is not None:
        plan.steps += order.steps(slots["fwd.block_mask"], temp["work_order"], temp["work_walks"], temp["work_bounds"],
                                  device_id)
    grid0 = (key_blocks, heads_k * splits, batch)
    if persistent:   # one CTA an SM (the kernel's launch bounds), key blocks in grid0's order from the counter
        grid0 = (min(math.prod(grid0), _num_sms(device_id)), 1, 1)
    if family == "bwd_sm90":
        # Q and dO arrive in boxes of a step's query rows, K and V in boxes of the CTA's keys.
        block_m = defines0["CUFLASH_BLOCK_M"]
        maps = [("map", index, _tma.TensorMapSpec(layouts[name], rows, dtype_name))
                for index, name, rows in ((1, "q", block_m), (2, "k", plan0.block_m), (3, "v", plan0.block_m),
                                          (0, "dout", block_m))]
        if score_tile:   # the kernel takes the bias's or mask's map after dO's
            maps.append(("map", score_fields[tile_name][1], _scores.score_tile_spec(tile_array, block_m)))
        func = _launch.prepare_kernel(get_kernel(plan0.variant), plan0.smem_bytes, device_id)
        plan.steps.append(_step.Step(func, grid0, plan0.threads, plan0.smem_bytes, (*maps, ("struct", params))))
    else:
        plan.steps.append(step(plan0.variant, grid0, plan0.threads, plan0.smem_bytes))
    if dq_pass:
        plan.steps.append(step(plan1.variant, (math.ceil(max_q / plan1.block_m), heads_q, batch), plan1.threads,
                               plan1.smem_bytes))
    elif dq_tile:
        plan.steps.append(_convert_tiles_step(plan, dtype_name, device_id, src=temp["dq_accum"], dst=6,
                                              tiles=shaped["dq_accum"], tile_rows=dq_tile, dq=dq_t, varlen=varlen,
                                              rows=max_q, batch=batch, heads=heads_q, head_dim=d,
                                              cu_seqlens=score_fields.get("cu_seqlens_q"), scale=fwd_fields["scale"],
                                              done=temp.get("dq_done"), done_expected=2 * key_blocks,
                                              heads_per_slot=heads_per_cta))
    else:
        rows_q = dq_t.shape[0] if varlen else dq_t.shape[0] * dq_t.shape[1]
        qa, qt = _rows(shaped["dq_accum"], varlen), _rows(dq_t, varlen)
        plan.steps.append(_convert_step(plan, dtype_name, device_id, src=temp["dq_accum"], dst=6, rows=rows_q,
                                        heads=heads_q, head_dim=d, src_row_stride=qa["row"],
                                        src_head_stride=qa["head"], dst_row_stride=qt["row"],
                                        dst_head_stride=qt["head"], scale=fwd_fields["scale"]))
    if splits > 1:
        rows_k = dk_t.shape[0] if varlen else dk_t.shape[0] * dk_t.shape[1]
        for part, target, index, width in (("dk_part", dk_t, 7, d), ("dv_part", dv_t, 8, dv)):
            pr, tr = _rows(shaped[part], varlen), _rows(target, varlen)
            plan.steps.append(_convert_step(plan, dtype_name, device_id, src=temp[part], dst=index, rows=rows_k,
                                            heads=heads_k, head_dim=width, src_row_stride=pr["row"],
                                            src_head_stride=splits * pr["head"], dst_row_stride=tr["row"],
                                            dst_head_stride=tr["head"], num_partials=splits,
                                            partial_stride=pr["head"]))
    plan.info.update(family=family, splits=splits, dsinks=dsinks is not None, dq="ordered" if ordered else "pass" if dq_pass else "atomic",
                     query_tile=dq_tile or None, tail_pairs=tail_pairs, dq_tail_pairs=dq_tail_pairs,
                     convert_behind="dq_done" in temp, dq_first_stores=dq_first_stores, persistent=persistent,
                     all_keys_seen=defines0.get("CUFLASH_ALL_KEYS_SEEN", 0) == 1,
                     tile_guard=defines0.get("CUFLASH_TILE_GUARD", 0) == 1, score_tile=score_tile,
                     mask_bits="mask_bits_offset" in score_fields, work_order=order is not None)
    return plan
