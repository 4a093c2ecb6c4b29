"""Block sparsity derived from a MaskMod (cuflash/_mask_blocks.py, cuda_src/mask_blocks.cu) on the GPU.

(a) the derived block mask equals the one NumPy computes from the reference's dense mask
    (MaskMod.reference) for random shapes and document / sliding-window / prefix-LM masks;
(b) outputs and gradients with derived sparsity, the kernels evaluating the expression, equal the same
    call with ``sparse=False`` bit for bit (the backward with ``deterministic=True``) and match the
    float64 reference;
(b') the bits beside the block mask equal the reference's dense mask, and the kernels reading them
    (the block mask variants, no expression compiled in) meet the accuracy rule;
(c) a repeat call with a new array (new address) derives a new mask;
(d) a call captured in a CUDA graph after a warm-up replays correctly.
Fresh data each example, outputs poisoned with NaN.

Run: ``python -m pytest -q tests/gpu/test_mask_blocks.py`` (skipped without a GPU).
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupy

import cuflash
from cuflash import _mask_blocks, reference
from cuflash.kernels.mask_blocks import DERIVED_BLOCK_SIZE
from tests.gpu._hardware import gpu_available

# These tests are of the block masks derived from the expressions as written: nothing moves into a built-in option.
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU found by CuPy"),
              pytest.mark.usefixtures("modifiers_as_written")]



SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def _document_ids(rng, batch, seqlen):
    ids = np.zeros((batch, seqlen), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seqlen), size=min(3, seqlen - 1), replace=False)) if seqlen > 1 else []
        ids[b] = np.searchsorted(cuts, np.arange(seqlen), side="right")
    return ids


def _mask_mod(case, rng, batch, seqlen_q, seqlen_k, sparse=True):
    if case == "document":
        ids = _document_ids(rng, batch, max(seqlen_q, seqlen_k))
        return cuflash.MaskMod("doc[b * S + q_idx] == doc[b * S + kv_idx] && kv_idx <= q_idx + shift",
                               doc=cupy.asarray(ids.reshape(-1)), S=ids.shape[1], shift=max(seqlen_k - seqlen_q, 0),
                               sparse=sparse)
    if case == "sliding":
        return cuflash.MaskMod("kv_idx <= q_idx + d && q_idx + d - kv_idx < w", d=seqlen_k - seqlen_q,
                               w=int(rng.integers(1, 200)), sparse=sparse)
    if case == "prefix":
        return cuflash.MaskMod("kv_idx < prefix || kv_idx <= q_idx", prefix=int(rng.integers(0, seqlen_k + 1)),
                               sparse=sparse)
    # per head: reads h, so the mask gets a head axis
    return cuflash.MaskMod("abs(q_idx - kv_idx) < (h + 1) * 37", sparse=sparse)


def _numpy_blocks(mask_mod, shape, block_size):
    """The block mask's bytes from the reference's dense mask: 3 where every element of a block (inside
    the sequences) is visible, 1 where some is, 0 where none is."""
    dense = mask_mod.reference(shape)
    b, h, sq, sk = shape
    bq, bk = block_size
    nq, nk = -(-sq // bq), -(-sk // bk)
    some, every = np.zeros((b, h, nq * bq, nk * bk), bool), np.ones((b, h, nq * bq, nk * bk), bool)
    some[:, :, :sq, :sk] = every[:, :, :sq, :sk] = dense
    blocks = (b, h, nq, bq, nk, bk)
    return np.where(every.reshape(blocks).all(axis=(3, 5)), 3, some.reshape(blocks).any(axis=(3, 5)).astype(np.uint8))


CASES = ("document", "sliding", "prefix", "per_head")


@SETTINGS
@given(case=st.sampled_from(CASES), batch=st.integers(1, 3), heads=st.integers(1, 4),
       seqlen_q=st.sampled_from([1, 17, 64, 113, 300]), seqlen_k=st.sampled_from([1, 17, 64, 113, 300]),
       block=st.sampled_from([DERIVED_BLOCK_SIZE, (16, 32), (128, 128), (1, 7)]), seed=st.integers(0, 2**31))
def test_derived_mask_equals_numpy(case, batch, heads, seqlen_q, seqlen_k, block, seed):
    rng = np.random.default_rng(seed)
    mod = _mask_mod(case, rng, batch, seqlen_q, seqlen_k)
    got = _mask_blocks.derived_block_mask(mod, batch, heads, seqlen_q, seqlen_k, block).get()
    expected_shape = _mask_blocks.mask_shape(mod, batch, heads, seqlen_q, seqlen_k, block)
    assert got.shape == expected_shape
    assert got.dtype == np.bool_   # bytes 0, 1 and 3: every bool reader takes both nonzero ones as True
    want = _numpy_blocks(mod, (batch, heads, seqlen_q, seqlen_k), block)
    np.testing.assert_array_equal(np.broadcast_to(got.view(np.uint8), want.shape), want)


def _data(rng, shape, dtype):
    x = rng.standard_normal(shape, dtype=np.float32)
    return cupy.asarray(x).astype(dtype)


@SETTINGS
@given(case=st.sampled_from(CASES), batch=st.integers(1, 3), heads=st.integers(1, 4),
       seqlen_q=st.sampled_from([1, 17, 64, 113, 300]), seqlen_k=st.sampled_from([1, 17, 64, 113, 300]),
       seed=st.integers(0, 2**31))
def test_derived_bits_equal_numpy(case, batch, heads, seqlen_q, seqlen_k, seed):
    rng = np.random.default_rng(seed)
    mod = _mask_mod(case, rng, batch, seqlen_q, seqlen_k)
    mask, bits = _mask_blocks._derived(mod, batch, heads, seqlen_q, seqlen_k, DERIVED_BLOCK_SIZE)
    bits = dict(bits)
    shape = _mask_blocks.mask_shape(mod, batch, heads, seqlen_q, seqlen_k, DERIVED_BLOCK_SIZE)
    rows, row_words = _mask_blocks.bits_layout(shape, seqlen_q, DERIVED_BLOCK_SIZE)
    assert bits["mask_bits_row_stride"] == row_words
    words = cupy.ndarray((shape[0], shape[1], rows, row_words), cupy.uint32,
                         cupy.cuda.MemoryPointer(mask.data.mem, mask.data.ptr - mask.data.mem.ptr + bits["mask_bits_offset"]))
    got = words.get()[:, :, :seqlen_q].view(np.uint8)   # little-endian words: byte w holds keys 8w .. 8w + 7
    got = np.unpackbits(got, axis=3, bitorder="little").astype(bool)
    want = np.zeros(got.shape[:2] + (seqlen_q, got.shape[3]), bool)
    want[..., :seqlen_k] = np.broadcast_to(mod.reference((batch, heads, seqlen_q, seqlen_k)),
                                           (batch, heads, seqlen_q, seqlen_k))[:shape[0], :shape[1]]
    np.testing.assert_array_equal(got, want)   # zeros past the keys' end too


def _grad_error(got, ref):
    return np.abs(got - ref).max(initial=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("case", CASES)
def test_bits_against_the_reference_and_the_expression(dtype, case, monkeypatch):
    """The MaskMod read from bits (block mask variants) and evaluated (a variant per expression), each
    forced, as the plans say: out and lse meet the accuracy rule against the float64 reference, and the
    gradients from the bits lie as close to it as the expression's (within 2x and a small slack)."""
    import ml_dtypes
    from cuflash.testing import assert_attention_close, baseline_attention

    cdtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng()
    b, sq, sk, hq, hk, d = 2, 300, 413, 4, 2, 64
    q, k, v = _data(rng, (b, sq, hq, d), cdtype), _data(rng, (b, sk, hk, d), cdtype), _data(rng, (b, sk, hk, d), cdtype)
    dout = _data(rng, (b, sq, hq, d), cdtype)
    mod = _mask_mod(case, rng, b, sq, sk)
    host = [x.get().astype(np.float64) for x in (q, k, v, dout)]
    ref_out, ref_lse = reference.attention_forward(*host[:3], mask_mod=mod)[:2]
    ref_grads = reference.attention_backward(host[3], *host[:3], mask_mod=mod)[:3]
    base_out, base_lse = baseline_attention(q, k, v, mask_mod=mod, return_lse=True)
    errors = {}
    for bits in (True, False):
        if not bits:
            monkeypatch.setattr(_mask_blocks, "BITS_MAX_BYTES", 0)
        cuflash.clear_mask_cache()
        assert cuflash.plan(cuflash.attention_forward, q, k, v, mask_mod=mod).plan.info["mask_bits"] is bits
        out = cupy.full((b, sq, hq, d), np.nan, dtype=cdtype)
        lse = cupy.full((b, hq, sq), np.nan, dtype=np.float32)
        out, lse, _ = cuflash.attention_forward(q, k, v, mask_mod=mod, out=out, lse=lse)
        assert cuflash.plan(cuflash.attention_backward, dout, q, k, v, out, lse,
                            mask_mod=mod).plan.info["mask_bits"] is bits
        assert_attention_close(out, ref_out, base_out, name=f"out (bits {bits})")
        assert_attention_close(lse, ref_lse, base_lse, dtype=dtype, name=f"lse (bits {bits})")
        dq, dk, dv = (cupy.full(x.shape, np.nan, dtype=cdtype) for x in (q, k, v))
        dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, mask_mod=mod, dq=dq, dk=dk, dv=dv)
        errors[bits] = [_grad_error(x.get().astype(np.float64), r) for x, r in zip((dq, dk, dv), ref_grads)]
    for name, with_bits, evaluated in zip(("dq", "dk", "dv"), errors[True], errors[False]):
        assert np.isfinite(with_bits) and with_bits <= 2 * evaluated + 1e-3, (name, with_bits, evaluated)
    cuflash.clear_mask_cache()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("case", CASES)
def test_sparse_equals_dense_and_reference(dtype, case, monkeypatch):
    import ml_dtypes

    monkeypatch.setattr(_mask_blocks, "BITS_MAX_BYTES", 0)   # the expression in both calls (bits: above)
    cuflash.clear_mask_cache()

    cdtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(hash((dtype, case)) % 2**32)
    b, sq, sk, hq, hk, d = 2, 300, 413, 4, 2, 64
    q, k, v = _data(rng, (b, sq, hq, d), cdtype), _data(rng, (b, sk, hk, d), cdtype), _data(rng, (b, sk, hk, d), cdtype)
    dout = _data(rng, (b, sq, hq, d), cdtype)
    sparse = _mask_mod(case, rng, b, sq, sk)
    dense = cuflash.MaskMod(sparse.text, sparse=False, **sparse.args.values)
    results = []
    for mod in (sparse, dense):
        out = cupy.full((b, sq, hq, d), np.nan, dtype=cdtype)
        lse = cupy.full((b, hq, sq), np.nan, dtype=np.float32)
        out, lse, _ = cuflash.attention_forward(q, k, v, mask_mod=mod, out=out, lse=lse)
        dq, dk, dv = (cupy.full(x.shape, np.nan, dtype=cdtype) for x in (q, k, v))
        dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, mask_mod=mod, deterministic=True,
                                                dq=dq, dk=dk, dv=dv)
        results.append([x.get().astype(np.float64) for x in (out, lse, dq, dk, dv)])
    for got, want, name in zip(results[0], results[1], ("out", "lse", "dq", "dk", "dv")):
        np.testing.assert_array_equal(got, want, err_msg=f"{name}: sparse != sparse=False")
    if dtype == "float32":
        host = [x.get().astype(np.float64) for x in (q, k, v, dout)]
        ref_out, ref_lse = reference.attention_forward(*host[:3], mask_mod=dense)[:2]
        ref_grads = reference.attention_backward(host[3], *host[:3], mask_mod=dense)[:3]
        for got, want, tol in zip(results[0], (ref_out, ref_lse, *ref_grads), (1e-5, 1e-5, 1e-4, 1e-4, 1e-4)):
            finite = np.isfinite(want)
            assert np.array_equal(np.isfinite(got), finite)
            assert np.abs(got[finite] - want[finite]).max(initial=0) <= tol * (1 + np.abs(want[finite]).max(initial=0))


def test_new_array_derives_a_new_mask():
    rng = np.random.default_rng(7)
    b, s, h, d = 1, 256, 2, 64
    q, k, v = (_data(rng, (b, s, h, d), np.float16) for _ in range(3))
    first = cupy.asarray(np.repeat(np.arange(4), s // 4).astype(np.int32))
    second = cupy.asarray(np.zeros(s, np.int32))   # one document: every block visible
    mod = cuflash.MaskMod("doc[q_idx] == doc[kv_idx]", doc=first)
    out1 = cuflash.attention(q, k, v, mask_mod=mod)
    mask1 = _mask_blocks.derived_block_mask(mod, b, h, s, s, DERIVED_BLOCK_SIZE).get()
    assert not mask1.all()
    mod2 = mod.with_args(doc=second)
    out2 = cuflash.attention(q, k, v, mask_mod=mod2)
    mask2 = _mask_blocks.derived_block_mask(mod2, b, h, s, s, DERIVED_BLOCK_SIZE).get()
    assert mask2.all()
    # The same derivation from a new array of the same documents (bit for bit: the same kernels), and
    # close to the expression evaluated by the kernels (other tiles: the bits run the block mask variants).
    want = cuflash.attention(q, k, v, mask_mod=cuflash.MaskMod("doc[q_idx] == doc[kv_idx]", doc=second.copy()))
    np.testing.assert_array_equal(out2.get(), want.get())
    dense = cuflash.attention(q, k, v, mask_mod=cuflash.MaskMod("doc[q_idx] == doc[kv_idx]", doc=second, sparse=False))
    np.testing.assert_allclose(out2.get().astype(np.float32), dense.get().astype(np.float32), atol=2e-3, rtol=1e-2)
    assert not np.array_equal(out1.get(), out2.get())
    # Written in place: clear_mask_cache makes the next call derive again.
    first[:] = 0
    cuflash.clear_mask_cache()
    out3 = cuflash.attention(q, k, v, mask_mod=mod)
    np.testing.assert_array_equal(out3.get(), want.get())


def test_explicit_block_mask_is_anded():
    rng = np.random.default_rng(3)
    b, s, h, d = 1, 256, 2, 64
    q, k, v = (_data(rng, (b, s, h, d), np.float16) for _ in range(3))
    mod = cuflash.MaskMod("kv_idx <= q_idx")
    block_mask = cupy.asarray(rng.random((1, 1, 4, 4)) < 0.6)
    got = cuflash.attention(q, k, v, mask_mod=mod, block_mask=block_mask, block_size=(64, 64))
    want = cuflash.attention(q, k, v, mask_mod=cuflash.MaskMod("kv_idx <= q_idx", sparse=False),
                             block_mask=block_mask, block_size=(64, 64))
    np.testing.assert_array_equal(got.get(), want.get())


def test_captured_in_a_graph():
    rng = np.random.default_rng(11)
    b, s, h, d = 2, 384, 4, 64
    q, k, v = (_data(rng, (b, s, h, d), np.float16) for _ in range(3))
    ids = cupy.asarray(_document_ids(rng, b, s).reshape(-1))
    mod = cuflash.MaskMod("doc[b * S + q_idx] == doc[b * S + kv_idx] && kv_idx <= q_idx", doc=ids, S=s)
    out = cupy.full((b, s, h, d), np.nan, dtype=np.float16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuflash.attention(q, k, v, mask_mod=mod, out=out)   # warm-up: plan, kernels and the mask
        stream.synchronize()
        out.fill(np.nan)
        stream.begin_capture()
        cuflash.attention(q, k, v, mask_mod=mod, out=out)
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
    # The eager call (bit for bit), from a new MaskMod over a copy of the documents (its own mask).
    want = cuflash.attention(q, k, v, mask_mod=cuflash.MaskMod(mod.text, doc=ids.copy(), S=s))
    np.testing.assert_array_equal(out.get(), want.get())
    dense = cuflash.attention(q, k, v, mask_mod=cuflash.MaskMod(mod.text, sparse=False, doc=ids, S=s))
    np.testing.assert_allclose(want.get().astype(np.float32), dense.get().astype(np.float32), atol=2e-3, rtol=1e-2)
    # Captured without a warm-up of the mask: derived at capture time (done_now), pinned in the cache.
    cuflash.clear_mask_cache()
    out.fill(np.nan)
    with stream:
        stream.begin_capture()
        cuflash.attention(q, k, v, mask_mod=mod, out=out)
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
    np.testing.assert_array_equal(out.get(), want.get())
