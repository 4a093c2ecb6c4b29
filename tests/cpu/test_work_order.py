"""The work order's planning (cuflash/kernels/work_order.py, cuflash/_runtime/work_order.py), without a GPU."""

import pytest

from cuflash.kernels import work_order
from cuflash._runtime.work_order import WorkOrder


@pytest.mark.parametrize("tiles, pairs, wave, expected", [
    (32, 32, 132, True),                     # 1024 tiles: nearly 8 waves
    (32, 8, 132, False),                     # 256: under two waves
    (1, 10**6, 132, False),                  # one tile a pair: nothing to order
    (work_order.WORK_ORDER_MAX_TILES, 1, 132, True),
    (work_order.WORK_ORDER_MAX_TILES + 1, 1, 132, False),   # past the kernel's shared memory
])
def test_takes_work_order(tiles, pairs, wave, expected):
    assert work_order.takes_work_order(tiles, pairs, wave) is expected


def _mask_fields(batch_stride, head_stride):
    return dict(block_mask_batch_stride=batch_stride, block_mask_head_stride=head_stride, block_mask_row_stride=64,
                block_mask_col_stride=1, block_q=64, block_k=64)


@pytest.mark.parametrize("strides, slices, kernel_strides", [
    ((0, 0), (1, 1), (0, 0)),                # a document mask of one sequence, every head
    ((64 * 64, 0), (3, 1), (32, 0)),         # a mask per sequence
    ((0, 64 * 64), (1, 5), (0, 32)),         # a mask per head
    ((5 * 64 * 64, 64 * 64), (3, 5), (5 * 32, 32)),
])
def test_slices_follow_the_masks_broadcast(strides, slices, kernel_strides):
    order = WorkOrder(_mask_fields(*strides), batch=3, heads=5, tiles=32, by_keys=False, tile=128, step=128,
                      seqlen_q=4096, seqlen_k=4096, window=(-1, 0))
    assert (order.batch_m, order.heads_m) == slices
    n = slices[0] * slices[1]
    assert [b.shape for b in order.buffers()] == [(n, 32), (n, 32), (n, 32, 2)]
    assert (order.kernel_fields()["work_order_batch_stride"], order.kernel_fields()["work_order_head_stride"]) \
        == kernel_strides
    assert order.fields["heads_m"] == slices[1] and order.fields["by_keys"] == 0
    assert (order.fields["window_left"], order.fields["window_right"]) == (-1, 0)
