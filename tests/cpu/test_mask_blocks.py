"""Block sparsity derived from a MaskMod (cuflash/_mask_blocks.py, cuda_src/mask_blocks.cu), on the CPU:
which variables an expression reads (the mask's batch and head axes), the cache key, ``sparse=``, and
the NVRTC compile of the block-mask kernel for sm_80 and sm_90a with no spills (also in the
catalogue's CI sweep). The kernel against NumPy: tests/gpu/test_mask_blocks.py."""

import collections

import numpy as np
import pytest

import cuflash
from cuflash import _mask_blocks
from cuflash.kernels import catalogue
from cuflash.kernels.mask_blocks import DERIVED_BLOCK_SIZE, mask_blocks_variant
from cuflash.modifiers import MaskMod, kernel_source
from cuflash.modifiers.parse import parse, variables


@pytest.mark.parametrize("expr, reads", [
    ("kv_idx <= q_idx", {"q_idx", "kv_idx"}),
    ("doc[b * S + q_idx] == doc[b * S + kv_idx]", {"b", "q_idx", "kv_idx"}),
    ("where(h < 2, kv_idx < p, true_ > 0)", {"h", "kv_idx"}),
    ("-score + 1.0", {"score"}),
    ("floor_div(q_idx, 4) == floor_div(kv_idx, 4) || !(p > 3)", {"q_idx", "kv_idx"}),
    ("p > 1", set()),
])
def test_variables_read(expr, reads):
    assert variables(parse(expr)) == reads


def test_mask_shape_follows_what_is_read():
    doc = np.zeros(8, np.int32)
    assert _mask_blocks.mask_shape(MaskMod("kv_idx <= q_idx"), 3, 5, 130, 64, (64, 64)) == (1, 1, 3, 1)
    assert _mask_blocks.mask_shape(MaskMod("doc[b * 4 + q_idx] == doc[kv_idx]", doc=doc), 3, 5, 1, 1, (64, 32)) \
        == (3, 1, 1, 1)
    assert _mask_blocks.mask_shape(MaskMod("h * 2 <= kv_idx"), 3, 5, 200, 65, (128, 64)) == (1, 5, 2, 2)
    assert MaskMod("h + b > kv_idx").reads == frozenset({"h", "b", "kv_idx"})


def test_sparse_option():
    assert MaskMod("kv_idx <= q_idx").derives_blocks
    assert MaskMod("kv_idx <= q_idx").sparse
    off = MaskMod("kv_idx <= q_idx", sparse=False)
    assert not off.derives_blocks and "sparse=False" in repr(off)
    with pytest.raises(TypeError, match="sparse"):
        MaskMod("kv_idx <= q_idx", sparse=1)
    # Views of another framework's buffers (with_arrays) derive nothing; with_args owns its arrays again.
    mod = MaskMod("doc[q_idx] == doc[kv_idx]", doc=np.zeros(4, np.int32))
    view = mod.with_arrays({"doc": np.ones(4, np.int32)})
    assert not view.derives_blocks
    assert view.with_args(doc=np.ones(4, np.int32)).derives_blocks
    # With no array, with_arrays changes nothing that could go stale.
    assert MaskMod("kv_idx <= q_idx + p", p=3).with_arrays({}).derives_blocks
    assert cuflash.clear_mask_cache is _mask_blocks.clear_mask_cache


def test_cache_key(monkeypatch):
    """The key holds the modifier's key and scalar values, each array's (address, shape, strides, dtype),
    the mask's batch/head axes (only where read), Sq, Sk, block size and device."""
    monkeypatch.setattr(_mask_blocks, "_describe", lambda x, name: (id(x), x.shape, x.strides, x.dtype.str))
    doc, other = np.zeros(16, np.int32), np.zeros(16, np.int32)
    mod = MaskMod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx + p", doc=doc, p=2)
    key = _mask_blocks.cache_key(mod, 2, 4, 100, 90, (64, 64), 0)
    assert key == _mask_blocks.cache_key(MaskMod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx + p", doc=doc, p=2),
                                         2, 4, 100, 90, (64, 64), 0)
    assert key == _mask_blocks.cache_key(mod, 3, 8, 100, 90, (64, 64), 0)   # reads neither b nor h
    different = [
        _mask_blocks.cache_key(mod.with_args(p=3), 2, 4, 100, 90, (64, 64), 0),           # scalar value
        _mask_blocks.cache_key(mod.with_args(doc=other), 2, 4, 100, 90, (64, 64), 0),     # another array
        _mask_blocks.cache_key(mod.with_args(doc=doc.astype(np.int64)), 2, 4, 100, 90, (64, 64), 0),
        _mask_blocks.cache_key(mod.with_args(doc=doc[:8]), 2, 4, 100, 90, (64, 64), 0),   # shape
        _mask_blocks.cache_key(mod, 2, 4, 101, 90, (64, 64), 0),
        _mask_blocks.cache_key(mod, 2, 4, 100, 91, (64, 64), 0),
        _mask_blocks.cache_key(mod, 2, 4, 100, 90, (128, 64), 0),
        _mask_blocks.cache_key(mod, 2, 4, 100, 90, (64, 64), 1),
        _mask_blocks.cache_key(MaskMod("doc[q_idx] == doc[kv_idx] && kv_idx < q_idx + p", doc=doc, p=2),
                               2, 4, 100, 90, (64, 64), 0),
    ]
    assert len({key, *different}) == len(different) + 1
    per_head = MaskMod("h <= kv_idx")
    assert _mask_blocks.cache_key(per_head, 2, 4, 10, 10, (64, 64), 0) != \
        _mask_blocks.cache_key(per_head, 2, 8, 10, 10, (64, 64), 0)
    assert _mask_blocks.cache_key(per_head, 2, 4, 10, 10, (64, 64), 0) == \
        _mask_blocks.cache_key(per_head, 5, 4, 10, 10, (64, 64), 0)


def test_no_derivation_without_a_gpu_array():
    """Host arrays and shapes the checks refuse pass through unchanged (the checks report them)."""
    mod = MaskMod("kv_idx <= q_idx")
    q = np.zeros((1, 4, 1, 8), np.float16)
    assert _mask_blocks.call_block_mask("attention", mod, q, q, None, (128, 128), True) == (None, (128, 128), None)
    assert _mask_blocks.call_block_mask("attention", MaskMod("kv_idx <= q_idx", sparse=False), q, q, None,
                                        (128, 128), True) == (None, (128, 128), None)
    assert _mask_blocks.call_block_mask("attention", None, q, q, None, (128, 128), True) == (None, (128, 128), None)


def test_bits_layout_pads_the_rows_for_the_kernels_tiles():
    """Rows up to the next multiple of 128 and one more (a 128-row tile and a 128-key tile past the ends
    read inside the bits), whole words per block column, and no bits past the budget or for blocks
    whose width is no multiple of 32."""
    rows, words = _mask_blocks.bits_layout((1, 1, 3, 5), 130, (64, 64))
    assert (rows, words) == (257, 10)
    assert _mask_blocks.bits_layout((1, 1, 2, 4), 128, (64, 64)) == (129, 8)
    assert _mask_blocks.bits_layout((1, 1, 3, 5), 130, (64, 48)) is None
    side = 1 << 15   # (32k)^2 bits of one (b, h): 128 MiB, within the budget; 4 heads of it are not
    assert _mask_blocks.bits_layout((1, 1, side // 64, side // 64), side, (64, 64)) is not None
    assert _mask_blocks.bits_layout((1, 4, side // 64, side // 64), side, (64, 64)) is None


def test_derived_block_size_divides_the_sm90_tiles():
    from cuflash.kernels import bwd_sm90, fwd_sm90

    bq, bk = DERIVED_BLOCK_SIZE
    for d in (64, 128, 256):
        assert fwd_sm90.SM90_BLOCK_N_USER[d] % bk == 0
        assert bwd_sm90.BWD_SM90_FEATURED_BLOCK_M[d] % bq == 0 and bwd_sm90.BWD_SM90_FEATURED_BLOCK_N[d] % bk == 0


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_mask_blocks_compiles_without_spills(arch):
    from cuflash._build.compile import compile_cubin

    variants = catalogue.ci_mask_blocks_variants()
    assert {(v, arch) for v in variants} <= set(catalogue.ci_variants())
    table = np.zeros(8, np.float32)
    # One with float arithmetic and a ScoreMod-free source (a MaskMod's own slots).
    variants.append(mask_blocks_variant(kernel_source(None, MaskMod("table[h] * 2.0 < 1.5 || kv_idx == q_idx",
                                                                    table=table))))
    for variant in variants:
        result = compile_cubin(variant, arch)
        assert result.spills == 0, result.log
    with pytest.raises(ValueError):
        mask_blocks_variant("")


def test_sparse_variants_in_the_sweep():
    pairs = set(catalogue.ci_variants())
    for arch in ("sm_80", "sm_90a"):
        sparse = catalogue.user_variants(arch, sparse=True)
        assert sparse and {(v, arch) for v in sparse} <= pairs


def test_cache_keeps_its_masks_within_entries_and_bytes(monkeypatch):
    """Least recently used out, by count and by bytes; the newest stays whatever its size."""
    from types import SimpleNamespace

    sizes = {1: 40, 2: 40, 3: 40, 4: 500}

    def compute(cupy, mask_mod, shape, seqlen_q, seqlen_k, block_size):
        return f"mask {seqlen_q}", None, (), sizes[seqlen_q]

    class Event:
        def __init__(self, **kwargs):
            pass

        def record(self):
            pass

    monkeypatch.setattr(_mask_blocks._checks, "_cupy", lambda: SimpleNamespace(cuda=SimpleNamespace(Event=Event)))
    monkeypatch.setattr(_mask_blocks._launch, "device_id", lambda: 0)
    monkeypatch.setattr(_mask_blocks._launch, "current_stream_ptr", lambda device: 0)
    monkeypatch.setattr(_mask_blocks._capture, "is_capturing", lambda: False)
    monkeypatch.setattr(_mask_blocks, "_compute", compute)
    monkeypatch.setattr(_mask_blocks, "MAX_BYTES", 100)
    monkeypatch.setattr(_mask_blocks, "_cache", collections.OrderedDict())
    mod = MaskMod("kv_idx <= q_idx")
    kept = lambda: sorted(entry.mask for entry in _mask_blocks._cache.values())  # noqa: E731
    for seqlen_q in (1, 2, 3):
        assert _mask_blocks._derived(mod, 1, 1, seqlen_q, 8, (64, 64)) == (f"mask {seqlen_q}", None)
    assert kept() == ["mask 2", "mask 3"]   # 120 bytes > 100: the oldest out
    monkeypatch.setattr(_mask_blocks, "MAX_ENTRIES", 1)
    _mask_blocks._derived(mod, 1, 1, 2, 8, (64, 64))   # a hit: now the most recent, nothing computed
    assert kept() == ["mask 2", "mask 3"]
    _mask_blocks._derived(mod, 1, 1, 4, 8, (64, 64))
    assert kept() == ["mask 4"]   # over both limits alone: kept
