"""The work-order steps of a block-masked fwd_sm90 or bwd_sm90 plan (cuda_src/work_order.cu): the buffers
of the order and of the tiles' bounds, the two launches that write them ahead of the attention kernel,
and the FwdParams fields that point the kernel at them."""

from __future__ import annotations

import numpy as np

from cuflash import kernels
from cuflash._build import compile as _compile
from cuflash._runtime import launch as _launch, params as _params
from cuflash._runtime.step import Buffer, Step


class WorkOrder:
    """One call's work order: ``tiles`` blocks per slice of the block mask (``batch_m`` x ``heads_m``
    slices: 1 where the mask broadcasts), each of ``tile`` query rows walking key tiles of ``step``
    keys (``by_keys`` False: fwd_sm90's m-blocks), or of ``tile`` keys walking query steps of ``step``
    rows (True: bwd_sm90's key blocks)."""

    __slots__ = ("fields", "batch_m", "heads_m", "tiles")

    def __init__(self, mask_fields: dict, *, batch: int, heads: int, tiles: int, by_keys: bool, tile: int,
                 step: int, seqlen_q: int, seqlen_k: int, window: tuple[int, int]):
        self.batch_m = batch if mask_fields["block_mask_batch_stride"] else 1
        self.heads_m = heads if mask_fields["block_mask_head_stride"] else 1
        self.tiles = tiles
        names = ("block_mask_batch_stride", "block_mask_head_stride", "block_mask_row_stride",
                 "block_mask_col_stride", "block_q", "block_k")
        self.fields = dict({name: mask_fields[name] for name in names}, heads_m=self.heads_m, tiles=tiles,
                           by_keys=int(by_keys), tile=tile, step=step, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                           window_left=window[0], window_right=window[1])

    def buffers(self) -> tuple[Buffer, Buffer, Buffer]:
        """The plan's temporaries: the order, the walks it comes from (int32, slices x tiles each) and the
        tiles' bounds (int32 pairs, slices x tiles x 2)."""
        shape = (self.batch_m * self.heads_m, self.tiles)
        return Buffer(shape, np.int32), Buffer(shape, np.int32), Buffer(shape + (2,), np.int32)

    def steps(self, mask_slot: int, order_slot: int, walks_slot: int, bounds_slot: int, device_id: int) -> list[Step]:
        """The two launches that write, from the block mask in value ``mask_slot``, the order into
        ``order_slot`` and the tiles' bounds into ``bounds_slot`` (the walks into ``walks_slot``)."""
        template = _params.Template(_params.WORK_ORDER, self.fields, {"block_mask": mask_slot, "order": order_slot,
                                                                      "walks": walks_slot, "bounds": bounds_slot})
        slices = self.batch_m * self.heads_m
        steps = []
        for phase, grid in ((0, (self.tiles, slices, 1)), (1, (slices, 1, 1))):
            func = _launch.prepare_kernel(_compile.get_kernel(kernels.work_order.work_order_variant(phase)), 0,
                                          device_id)
            steps.append(Step(func, grid, kernels.work_order.WORK_ORDER_THREADS[phase], 0, (("struct", template),)))
        return steps

    def kernel_fields(self) -> dict:
        """FwdParams' strides of the order and the bounds (their pointers are slots)."""
        return {"work_order_batch_stride": self.heads_m * self.tiles if self.batch_m > 1 else 0,
                "work_order_head_stride": self.tiles if self.heads_m > 1 else 0}
