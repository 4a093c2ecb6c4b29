"""The work order of block-masked calls (cuda_src/work_order.cu, cuflash/_runtime/work_order.py) on the GPU.

(a) the order and bounds the kernels write equal NumPy's (walks counted from the block mask inside the
    window, longest first, ties in the kernels' own order; each tile's first and last step a True block
    touches) for random masks, shapes, blocks, tiles and windows;
(b) fwd_sm90 and bwd_sm90 taking their tiles in that order give the bits of the same calls in the causal
    order (out, lse, dK, dV; dQ, added in any order by atomics, to rounding), for a document MaskMod
    and an explicit block mask, and the plans say which order they took;
(c) such calls captured in a CUDA graph replay on new data as they run uncaptured.
Fresh data each example, outputs poisoned with NaN.

Run: ``python -m pytest -q tests/gpu/test_work_order.py`` (skipped without a GPU).
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupy

import cuflash
from cuflash import kernels
from cuflash._build.compile import device_arch, get_kernel
from cuflash._runtime import memo
from cuflash._runtime.params import WORK_ORDER, WORK_ORDER_PARAMS
from cuflash._runtime.work_order import WorkOrder
from tests.gpu._hardware import gpu_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU found by CuPy")]


def _numpy_order(mask, *, by_keys, tile, step, block, seqlen_q, seqlen_k, window):
    """(order, bounds) from a (Bm, Hm, rows, cols) bool mask, as cuda_src/work_order.cu defines them: per
    slice, the tiles by walk (the steps inside the window that a True block touches), longest first, ties in
    the kernels' own order; per tile, (first, end) of the steps a True block touches, the window aside."""
    bq, bk = block
    left, right = window
    diag = seqlen_k - seqlen_q
    length, other = (seqlen_k, seqlen_q) if by_keys else (seqlen_q, seqlen_k)
    tiles, steps = -(-length // tile), -(-other // step)
    slices = mask.reshape(-1, *mask.shape[2:])
    order = np.empty((len(slices), tiles), np.int32)
    bounds = np.empty((len(slices), tiles, 2), np.int32)
    for s, m in enumerate(slices):
        walks = []
        for t in range(tiles):
            lo, hi = t * tile, min(t * tile + tile, length)
            if not by_keys:
                first = 0 if left < 0 else max(0, lo + diag - left)
                last = seqlen_k if right < 0 else min(seqlen_k, hi + diag + right)
            else:
                first = 0 if right < 0 else max(0, lo - diag - right)
                last = seqlen_q if left < 0 else min(seqlen_q, hi - diag + left)
            touched = []
            walk = 0
            for o in range(steps):
                o0, o1 = o * step, min(o * step + step, other)
                (i0, i1), (j0, j1) = ((o0, o1), (lo, hi)) if by_keys else ((lo, hi), (o0, o1))
                if m[i0 // bq:(i1 - 1) // bq + 1, j0 // bk:(j1 - 1) // bk + 1].any():
                    touched.append(o)
                    walk += max(o0, first) < min(o1, last)
            walks.append(walk)
            bounds[s, t] = (touched[0], touched[-1] + 1) if touched else (0, 0)
        # Longest first; ties in the kernels' own order: fwd the higher m-block first, bwd the lower key block.
        order[s] = sorted(range(tiles), key=lambda t: (-walks[t], t if by_keys else -t))
    return order, bounds


def _gpu_order(mask, **kw):
    fields = {"block_mask_batch_stride": mask.strides[0], "block_mask_head_stride": mask.strides[1],
              "block_mask_row_stride": mask.strides[2], "block_mask_col_stride": mask.strides[3],
              "block_q": kw["block"][0], "block_k": kw["block"][1]}
    length = kw["seqlen_k"] if kw["by_keys"] else kw["seqlen_q"]
    order = WorkOrder(fields, batch=mask.shape[0], heads=mask.shape[1], tiles=-(-length // kw["tile"]),
                      by_keys=kw["by_keys"], tile=kw["tile"], step=kw["step"], seqlen_q=kw["seqlen_q"],
                      seqlen_k=kw["seqlen_k"], window=kw["window"])
    slices = order.batch_m * order.heads_m
    out, walks = (cupy.full((slices, order.tiles), -1, np.int32) for _ in range(2))
    bounds = cupy.full((slices, order.tiles, 2), -1, np.int32)
    data = WORK_ORDER.pack(dict(order.fields, block_mask=mask.data.ptr, order=out.data.ptr, walks=walks.data.ptr,
                                bounds=bounds.data.ptr))
    params = np.frombuffer(bytes(data), WORK_ORDER_PARAMS)[0]
    for phase, grid in ((0, (order.tiles, slices)), (1, (slices,))):
        get_kernel(kernels.work_order.work_order_variant(phase))(grid, (kernels.work_order.WORK_ORDER_THREADS[phase],),
                                                                 (params,))
    return out.get(), bounds.get()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31), by_keys=st.booleans(), batch_m=st.integers(1, 3), heads_m=st.integers(1, 3),
       seqlen_q=st.integers(1, 1500), seqlen_k=st.integers(1, 1500),
       block=st.sampled_from([(64, 64), (128, 128), (32, 64), (64, 16)]),
       tiles=st.sampled_from([(128, 128), (128, 64), (128, 80), (192, 128), (64, 64)]),
       window=st.sampled_from([(-1, -1), (-1, 0), (100, 0), (300, 50), (-1, 200)]), density=st.floats(0.05, 0.95))
def test_order_equals_numpy(seed, by_keys, batch_m, heads_m, seqlen_q, seqlen_k, block, tiles, window, density):
    rng = np.random.default_rng(seed)
    rows, cols = -(-seqlen_q // block[0]), -(-seqlen_k // block[1])
    mask = rng.random((batch_m, heads_m, rows, cols)) < density
    tile, step = tiles if not by_keys else tiles[::-1]
    kw = dict(by_keys=by_keys, tile=tile, step=step, block=block, seqlen_q=seqlen_q, seqlen_k=seqlen_k, window=window)
    want_order, want_bounds = _numpy_order(mask, **kw)
    got_order, got_bounds = _gpu_order(cupy.asarray(mask), **kw)
    np.testing.assert_array_equal(got_order, want_order)
    np.testing.assert_array_equal(got_bounds, want_bounds)


def _document_mask_mod(rng, seqlen):
    cuts = np.sort(rng.choice(np.arange(256, seqlen - 256), size=6, replace=False))
    doc = np.searchsorted(cuts, np.arange(seqlen), side="right").astype(np.int32)
    return cuflash.MaskMod("doc[q_idx] == doc[kv_idx]", doc=cupy.asarray(doc)), doc


@pytest.mark.skipif(gpu_available() and device_arch() != "sm_90a", reason="fwd_sm90 and bwd_sm90: Hopper")
@pytest.mark.parametrize("how", ["mask_mod", "block_mask"])
def test_ordered_calls_equal_the_causal_order(how, monkeypatch):
    import ml_dtypes

    rng = np.random.default_rng()
    b, s, h, d = 2, 4096, 16, 128
    q, k, v, dout = (cupy.asarray(rng.standard_normal((b, s, h, d), np.float32)).astype(ml_dtypes.bfloat16)
                     for _ in range(4))
    mod, doc = _document_mask_mod(rng, s)
    if how == "mask_mod":
        options = dict(causal=True, mask_mod=mod)
    else:   # 128 x 128 blocks of the documents, a different mask per sequence
        starts = doc[::128]
        blocks = np.stack([(starts[:, None] == starts[None, :]) | (rng.random((s // 128, s // 128)) < 0.1)
                           for _ in range(b)])[:, None]
        options = dict(causal=True, block_mask=cupy.asarray(blocks))
    results = {}
    for ordered in (True, False):
        if not ordered:
            monkeypatch.setattr(kernels.work_order, "WORK_ORDER_MIN_WAVES", 10**9)
            memo.clear_memo()
        fwd_plan = cuflash.plan(cuflash.attention_forward, q, k, v, **options).plan
        assert fwd_plan.info["family"] == "fwd_sm90" and fwd_plan.info["work_order"] is ordered
        out = cupy.full((b, s, h, d), np.nan, dtype=q.dtype)
        lse = cupy.full((b, h, s), np.nan, dtype=np.float32)
        out, lse, _ = cuflash.attention_forward(q, k, v, out=out, lse=lse, **options)
        bwd_plan = cuflash.plan(cuflash.attention_backward, dout, q, k, v, out, lse, **options).plan
        assert bwd_plan.info["family"] == "bwd_sm90" and bwd_plan.info["work_order"] is ordered
        dq, dk, dv = (cupy.full(x.shape, np.nan, dtype=x.dtype) for x in (q, k, v))
        dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **options)
        results[ordered] = [x.get().astype(np.float32) for x in (out, lse, dq, dk, dv)]
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), results[True], results[False]):
        assert np.isfinite(got).all(), name
        if name == "dq":   # tiles of dQ added by atomics in any order: to rounding
            np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)
    memo.clear_memo()


@pytest.mark.skipif(gpu_available() and device_arch() != "sm_90a", reason="fwd_sm90 and bwd_sm90: Hopper")
def test_ordered_calls_replay_from_a_graph():
    """A document-masked forward and backward (the work order's launches among their steps) captured on a
    fresh stream after a warm-up on another, replayed on new data: the bits of the uncaptured calls (dQ,
    added by atomics in any order, to rounding)."""
    import ml_dtypes

    from tests.gpu.test_capture import _capture, _replay

    rng = np.random.default_rng()
    b, s, h, d = 2, 4096, 16, 128
    q, k, v, dout = (cupy.empty((b, s, h, d), ml_dtypes.bfloat16) for _ in range(4))
    mod, _ = _document_mask_mod(rng, s)
    options = dict(causal=True, mask_mod=mod)

    def fill():
        for x in (q, k, v, dout):
            x[...] = cupy.asarray(rng.standard_normal(x.shape, np.float32)).astype(x.dtype)

    def step():
        out, lse, _ = cuflash.attention_forward(q, k, v, causal=True, mask_mod=mod)
        return (out, lse, *cuflash.attention_backward(dout, q, k, v, out, lse, **options))

    fill()
    assert cuflash.plan(cuflash.attention_forward, q, k, v, causal=True, mask_mod=mod).plan.info["work_order"]
    out, lse, _ = cuflash.attention_forward(q, k, v, causal=True, mask_mod=mod)
    assert cuflash.plan(cuflash.attention_backward, dout, q, k, v, out, lse, **options).plan.info["work_order"]
    stream = cupy.cuda.Stream(non_blocking=True)
    graph, captured = _capture(stream, step)
    for _ in range(2):
        fill()
        for x in captured:
            x[...] = np.nan
        _replay(graph, stream)
        direct = step()
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), captured, direct):
            if name == "dq":   # tiles of dQ added by atomics in any order: to rounding
                np.testing.assert_allclose(got.get().astype(np.float32), want.get().astype(np.float32), atol=2e-2,
                                           rtol=2e-2, err_msg=name)
            else:
                np.testing.assert_array_equal(got.get(), want.get(), err_msg=name)
