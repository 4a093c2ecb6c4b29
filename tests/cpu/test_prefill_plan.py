"""Which decode calls run on fwd_sm90 over their cache (cuflash/_prefill_plan.py) and how it reads the
cache (cuflash.kernels.fwd_sm90.kv_cache_mode), on the CPU: the GPU's arch is pretended."""

import pytest

from cuflash import _prefill_plan
from cuflash.kernels import fwd_sm90


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(_prefill_plan, "device_arch", lambda: "sm_90a")


def _call(**changes):
    """The arguments of runs_on_fwd_sm90 for a chunk of 512 bf16 tokens over a paged cache of 16-row pages."""
    args = dict(dtype_name="bfloat16", seqlen_q=512, work_items=512, sms=132, score_mods=(), kv_dtype=None, mla=False,
                num_splits=0, paged=True,
                page_size=16, num_pages=4096, head_dim=128, head_dim_v=128, cache_in_place=True, arrays=())
    args.update(changes)
    return args


@pytest.mark.parametrize("page_size, mode", [(None, "tma"), (8, "tma"), (16, "tma"), (48, "tma"), (256, "tma"),
                                             (1, "gather"), (3, "gather"), (12, "gather")])
def test_kv_cache_mode(page_size, mode):
    assert fwd_sm90.kv_cache_mode(page_size) == mode
    # Pages whose rows run on from one to the next take a box's column blocks in one copy.
    assert fwd_sm90.kv_cache_mode(page_size, True) == ("row_groups" if mode == "tma" and page_size else mode)


@pytest.mark.parametrize("page_size, block_n, rows", [(None, 128, 128), (16, 128, 16), (48, 128, 16), (256, 128, 128),
                                                      (64, 64, 64), (8, 64, 8)])
def test_kv_box_rows_never_cross_a_page(page_size, block_n, rows):
    assert fwd_sm90.kv_box_rows(page_size, block_n) == rows
    assert block_n % rows == 0 and (page_size is None or page_size % rows == 0)


def test_many_new_tokens_run_on_fwd_sm90(hopper):
    assert _prefill_plan.runs_on_fwd_sm90(**_call())
    few = fwd_sm90.KV_CACHE_MIN_QUERIES_FULL
    assert _prefill_plan.runs_on_fwd_sm90(**_call(seqlen_q=fwd_sm90.KV_CACHE_MIN_QUERIES, work_items=1))
    assert not _prefill_plan.runs_on_fwd_sm90(**_call(seqlen_q=fwd_sm90.KV_CACHE_MIN_QUERIES - 1, work_items=131))
    assert _prefill_plan.runs_on_fwd_sm90(**_call(seqlen_q=few, work_items=132))   # the SMs filled
    assert not _prefill_plan.runs_on_fwd_sm90(**_call(seqlen_q=few - 1, work_items=10_000))


@pytest.mark.parametrize("changes, why", [
    (dict(dtype_name="float32"), "float32"),
    (dict(kv_dtype="float8_e4m3fn"), "fp8"),
    (dict(mla=True), "MLA"),
    (dict(num_splits=4), "num_splits = 4"),
    (dict(score_mods=("mask",)), "score modifiers"),
    (dict(score_mods=("softcap", "alibi")), "score modifiers"),
    (dict(cache_in_place=False), "16-byte aligned"),
    (dict(head_dim=512, head_dim_v=128), "head dims up to 256"),
    (dict(num_pages=2**27), "counted in int32"),
])
def test_what_stays_on_the_decode_kernel(hopper, changes, why):
    """Each obstacle keeps a long chunk on the decode kernel, and a forced fwd_sm90 names it."""
    assert not _prefill_plan.runs_on_fwd_sm90(**_call(**changes))
    with _prefill_plan.force_kernel("fwd_sm90"), pytest.raises(ValueError, match=why):
        _prefill_plan.runs_on_fwd_sm90(**_call(**changes))


def test_forcing(hopper):
    with _prefill_plan.force_kernel("decode"):
        assert not _prefill_plan.runs_on_fwd_sm90(**_call())
        assert _prefill_plan.forced() == "decode"
    with _prefill_plan.force_kernel("fwd_sm90"):
        assert _prefill_plan.runs_on_fwd_sm90(**_call(seqlen_q=1))
    assert _prefill_plan.forced() is None
    with pytest.raises(ValueError, match="family must be one of"):
        with _prefill_plan.force_kernel("fwd_sm80"):
            pass


def test_not_on_other_gpus(monkeypatch):
    monkeypatch.setattr(_prefill_plan, "device_arch", lambda: "sm_80")
    assert not _prefill_plan.runs_on_fwd_sm90(**_call())
    with _prefill_plan.force_kernel("fwd_sm90"), pytest.raises(ValueError, match="sm_90a"):
        _prefill_plan.runs_on_fwd_sm90(**_call())


def test_kv_cache_variants_cover_every_mode_and_the_pair():
    variants = fwd_sm90.kv_cache_variants(("bfloat16",))
    modes = {dict(v.defines)["CUFLASH_KV_CACHE"] for v in variants}
    assert modes == set(fwd_sm90.KV_CACHE_MODES.values())
    assert any(dict(v.defines).get("CUFLASH_HEAD_DIM_V") == 128 and dict(v.defines)["CUFLASH_HEAD_DIM"] == 192
               for v in variants)
    modes = len(fwd_sm90.KV_CACHE_MODES)
    assert len(variants) == len(set(variants)) == 3 * len(fwd_sm90.KV_CACHE_SCORE_MODS) * modes + modes


def test_strides_of_a_paged_cache_in_elements_and_bytes():
    import numpy as np

    cache = np.zeros((5, 16, 2, 64), np.float16)   # (pages, page_size, kv heads, head dim)
    assert _prefill_plan._strides(cache, "k") == dict(k_batch_stride=16 * 2 * 64, k_row_stride=2 * 64,
                                                      k_head_stride=64)
    assert _prefill_plan._strides(cache, "v", "bytes") == dict(v_batch_stride=16 * 2 * 64 * 2, v_row_stride=2 * 64 * 2,
                                                               v_head_stride=64 * 2)
