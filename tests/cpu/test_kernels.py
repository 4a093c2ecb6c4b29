"""Decode heuristics on the CPU: tile plans fit the device, the split count behaves.

``decode_num_splits`` must stay in bounds, leave each split enough keys, never split when the
batch already fills the GPU, and move monotonically with the shapes (more keys never fewer splits,
more CTAs never more splits). ``decode_plan`` must fit every budget a supported GPU offers and
agree with what ``decode_precompile_variants`` compiles.
"""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cuflash import _scores, features, kernels

DTYPES = ("float16", "bfloat16", "float32")
# Opt-in shared memory per block: H100/H200, A100, and consumer Ampere/Ada (RTX 30x0/40x0).
SMEM_BUDGETS = (227 * 1024, 163 * 1024, 99 * 1024)

batches = st.integers(1, 256)
heads = st.sampled_from([1, 2, 4, 8, 16, 32])
seqlens = st.one_of(st.integers(0, 300), st.integers(0, 1 << 20), st.sampled_from([1, 4096, 8192, 32768, 131072]))
sm_counts = st.sampled_from([1, 8, 46, 84, 108, 114, 132, 144])
ctas_per_sm = st.integers(1, 4)
row_blocks = st.integers(1, 16)
block_ns = st.sampled_from([16, 32, 64, 128])


@given(batches, heads, seqlens, sm_counts, row_blocks, block_ns, ctas_per_sm)
def test_num_splits_bounds(batch, heads_k, seqlen, sms, rb, block_n, per_sm):
    s = kernels.decode.decode_num_splits(batch, heads_k, seqlen, sms, row_blocks=rb, block_n=block_n, ctas_per_sm=per_sm)
    assert isinstance(s, int) and 1 <= s <= kernels.decode.DECODE_MAX_SPLITS
    tiles = -(-seqlen // block_n)
    if s > 1:
        assert tiles // s >= 4, "every split keeps at least 4 tiles of keys"
    if batch * heads_k * rb >= 4 * per_sm * sms:
        assert s == 1, "four waves of CTAs need no splitting"


@given(batches, heads, seqlens, sm_counts, row_blocks, ctas_per_sm)
def test_num_splits_wave_efficiency(batch, heads_k, seqlen, sms, rb, per_sm):
    """The choice is within 95% of the best wave efficiency any allowed split count reaches, and no
    smaller count is."""
    s = kernels.decode.decode_num_splits(batch, heads_k, seqlen, sms, row_blocks=rb, ctas_per_sm=per_sm)
    ctas, slots = batch * heads_k * rb, per_sm * sms
    if s == 1 and (ctas >= 4 * slots or seqlen < 8 * 64):
        return
    limit = max(1, min(-(-seqlen // 64) // 4, kernels.decode.DECODE_MAX_SPLITS))
    effs = {n: kernels.decode.decode_bandwidth_efficiency(ctas * n, slots, slots) for n in range(1, limit + 1)}
    best = max(effs.values())
    assert effs[s] >= 0.95 * best
    assert all(effs[n] < 0.95 * best for n in range(1, s))


@given(batches, heads, seqlens, seqlens, sm_counts, row_blocks)
def test_num_splits_monotone_in_keys(batch, heads_k, a, b, sms, rb):
    short, long_ = sorted((a, b))
    assert (kernels.decode.decode_num_splits(batch, heads_k, short, sms, row_blocks=rb)
            <= kernels.decode.decode_num_splits(batch, heads_k, long_, sms, row_blocks=rb))


@given(heads, seqlens, sm_counts)
def test_num_splits_fills_the_gpu_for_one_sequence(heads_k, seqlen, sms):
    """A single sequence gets about one wave of CTAs, or as many as its keys allow."""
    s = kernels.decode.decode_num_splits(1, heads_k, seqlen, sms, ctas_per_sm=2)
    tiles = -(-seqlen // 64)
    slots = 2 * sms
    reachable = min(tiles // 4, kernels.decode.DECODE_MAX_SPLITS) * heads_k
    assert heads_k * s >= 0.9 * min(slots - heads_k + 1, reachable) or heads_k >= slots


def test_wave_efficiency():
    """Saturating only with a whole wave: the fraction of CTA slots busy over the waves."""
    assert kernels.decode.decode_bandwidth_efficiency(264, 264, 264) == 1.0
    assert kernels.decode.decode_bandwidth_efficiency(265, 264, 264) == pytest.approx(265 / 528)
    assert kernels.decode.decode_bandwidth_efficiency(132, 264, 264) == 0.5
    assert kernels.decode.decode_bandwidth_efficiency(0, 264, 264) == 0.0


def test_bandwidth_efficiency():
    # A wave of at least the saturating count streams at the full rate; fewer, in proportion.
    assert kernels.decode.decode_bandwidth_efficiency(64, 132, 64) == 1.0
    assert kernels.decode.decode_bandwidth_efficiency(32, 132, 64) == 0.5
    assert kernels.decode.decode_bandwidth_efficiency(132 + 64, 132, 64) == 1.0
    assert kernels.decode.decode_bandwidth_efficiency(132 + 8, 132, 64) == pytest.approx(140 / (132 + 64))
    assert kernels.decode.decode_bandwidth_efficiency(0, 132, 64) == 0.0


@given(batches, heads, seqlens, sm_counts, row_blocks, st.integers(1, 300))
# (found by hypothesis: 3 splits make 36 CTAs of 46 slots; 4, 48 CTAs, would take a second wave)
@example(batch=1, heads_k=2, seqlen=961, sms=46, rb=6, saturating=38)
def test_num_splits_saturating(batch, heads_k, seqlen, sms, rb, saturating):
    """With CTAs that saturate the memory sooner, the choice is never more splits; and it reaches
    the saturating count (or the most CTAs the keys allow in one wave: a second, nearly empty wave
    streams slower) unless it already streams at 95%."""
    full = kernels.decode.decode_num_splits(batch, heads_k, seqlen, sms, row_blocks=rb, ctas_per_sm=1)
    s = kernels.decode.decode_num_splits(batch, heads_k, seqlen, sms, row_blocks=rb, ctas_per_sm=1, saturating_ctas=saturating)
    assert 1 <= s <= full
    ctas, limit = batch * heads_k * rb, max(1, min(-(-seqlen // 64) // 4, kernels.decode.DECODE_MAX_SPLITS))
    sat = min(saturating, sms)
    one_wave = ctas * max(1, min(limit, sms // ctas))
    if seqlen > 0 and ctas < 4 * sms:
        assert ctas * s >= 0.95 * min(sat, one_wave) or ctas * s >= sms * 0.95


def test_saturating_bytes_follow_memory_rate():
    """The H100's 8 MiB up to its rate (and when the rate is unknown), then more than in proportion:
    the rates the runtime reports for an H100 SXM (3.352 TB/s) and an H200 (4.814 TB/s)."""
    plan = kernels.decode.decode_plan("bfloat16", 128, paged=False, score_mods=False)
    assert kernels.decode.decode_saturating_bytes(0.0) == kernels.decode.DECODE_SATURATING_BYTES
    assert kernels.decode.decode_saturating_bytes(3.352e12) == kernels.decode.DECODE_SATURATING_BYTES
    h200 = kernels.decode.decode_saturating_bytes(4.814e12)
    assert h200 > kernels.decode.DECODE_SATURATING_BYTES * 4.814 / 3.352
    rates = [2e12, 3.352e12, 4e12, 4.814e12, 8e12]
    sizes = [kernels.decode.decode_saturating_bytes(r) for r in rates]
    assert sizes == sorted(sizes)
    # On an H200 every SM streams: the split counts its sweep found best (docs/decisions.md#decode-split-count).
    saturating = plan.saturating_ctas(4.814e12)
    assert saturating == -(-h200 // plan.in_flight_bytes)
    expect = {(8, 8192): 2, (1, 32768): 16, (1, 131072): 16, (4, 16384): 4, (2, 65536): 8}
    for (batch, seqlen), want in expect.items():
        got = kernels.decode.decode_num_splits(batch, 8, seqlen, 132, block_n=plan.block_n, ctas_per_sm=1,
                                  saturating_ctas=saturating)
        assert got == want, (batch, seqlen, got)


def test_device_memory_rate(monkeypatch):
    """decode reads the memory rate from the clock (kHz, double data rate) and the bus width (bits),
    and takes 0 (the H100's bytes in flight) where the runtime does not report them."""
    import importlib

    import cupy

    decode_module = importlib.import_module("cuflash.decode")
    rt = cupy.cuda.runtime
    reported = {rt.cudaDevAttrMultiProcessorCount: 132, rt.cudaDevAttrMaxSharedMemoryPerBlockOptin: 232448,
                rt.cudaDevAttrMaxSharedMemoryPerMultiprocessor: 233472,
                rt.cudaDevAttrMemoryClockRate: 2619000, rt.cudaDevAttrGlobalMemoryBusWidth: 5120}

    def attribute(attr, device_id):
        if attr not in reported:
            raise rt.CUDARuntimeError(1)
        return reported[attr]

    monkeypatch.setattr(rt, "deviceGetAttribute", attribute)
    limits = decode_module._device_limits.__wrapped__(0)
    assert limits[:3] == (132, 232448, 233472)
    assert limits[3] == pytest.approx(3.352e12, rel=1e-3)   # an H100 SXM
    del reported[rt.cudaDevAttrMemoryClockRate]
    assert decode_module._device_limits.__wrapped__(0)[3] == 0.0


def test_num_splits_benchmark_shapes():
    """The issue's benchmark shapes on an H100/H200 (132 SMs) with the D = 128 plan: one 200 KiB CTA
    of eight warps per SM, 128 KiB of K/V in flight each."""
    plan = kernels.decode.decode_plan("bfloat16", 128, paged=False, score_mods=False)
    assert plan.ctas_per_sm == 1 and plan.block_n == 128 and plan.block_m == 16 and plan.threads == 256
    assert plan.in_flight_bytes == 2 * 2 * 128 * 128 * 2
    saturating = plan.saturating_ctas(0.0)
    assert saturating == 64
    # Contiguous: 64 CTAs keep the memory busy, so (8, 8k) needs no split and one sequence 8 of them.
    expect = {(1, 32768): 8, (8, 8192): 1, (32, 4096): 1, (1, 131072): 8, (4, 16384): 2}
    for (batch, seqlen), want in expect.items():
        got = kernels.decode.decode_num_splits(batch, 8, seqlen, 132, block_n=plan.block_n, ctas_per_sm=1,
                                  saturating_ctas=saturating)
        assert got == want, (batch, seqlen, got)
    # Paged: every SM, splits of at least 2048 keys.
    expect = {(1, 32768): 16, (8, 8192): 2, (32, 4096): 1, (1, 131072): 16}
    for (batch, seqlen), want in expect.items():
        got = kernels.decode.decode_num_splits(batch, 8, seqlen, 132, block_n=plan.block_n, ctas_per_sm=1,
                                  min_tiles_per_split=2048 // plan.block_n)
        assert got == want, (batch, seqlen, got)
    assert kernels.decode.decode_num_splits(512, 8, 4096, 132) == 1          # the batch alone fills the GPU
    assert kernels.decode.decode_num_splits(1, 8, 100, 132) == 1             # too few keys to split
    assert kernels.decode.decode_num_splits(0, 8, 4096, 132) == 1
    assert kernels.decode.decode_num_splits(1, 8, 0, 132) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smem", SMEM_BUDGETS)
@pytest.mark.parametrize("head_dim", [8, 64, 72, 128, 160, 192, 256])
def test_decode_plan_fits(dtype, smem, head_dim):
    if dtype == "float32" and head_dim % 4:
        pytest.skip("float32 rows are 4-element chunks")
    for paged in (False, True):
        for mods in (False, True):
            plan = kernels.decode.decode_plan(dtype, head_dim, paged=paged, score_mods=mods, smem_per_block=smem)
            defines = dict(plan.variant.defines)
            assert plan.variant.family == "decode"
            assert plan.head_dim >= head_dim and defines["CUFLASH_HEAD_DIM"] == plan.head_dim
            assert plan.smem_bytes + 1024 <= smem and defines["CUFLASH_SMEM_BYTES"] == plan.smem_bytes
            assert plan.threads == 32 * defines["CUFLASH_WARPS"]
            assert plan.block_n == defines["CUFLASH_WARPS"] * defines["CUFLASH_KEYS_PER_WARP"]
            assert defines["CUFLASH_STAGES"] >= 2
            assert defines["CUFLASH_PAGED"] == int(paged) and defines["CUFLASH_SCORE_MODS"] == (11 if mods else 0)
            assert 1 <= plan.ctas_per_sm <= 4 and defines["CUFLASH_MIN_BLOCKS"] == plan.ctas_per_sm
            if dtype == "float32":
                assert plan.block_m == 8 and plan.head_dim % 128 == 0
            else:
                assert plan.block_m == 16 and plan.head_dim % 64 == 0 and defines["CUFLASH_KEYS_PER_WARP"] == 16
            tiles = kernels.decode.DecodeTiles(defines["CUFLASH_WARPS"], defines["CUFLASH_KEYS_PER_WARP"],
                                  defines["CUFLASH_STAGES"])
            assert kernels.decode.decode_smem_bytes(dtype, plan.head_dim, tiles) == plan.smem_bytes


def test_decode_plan_prefers_deeper_pipelines_when_memory_allows():
    big = kernels.decode.decode_plan("bfloat16", 128, paged=False, score_mods=False, smem_per_block=227 * 1024)
    small = kernels.decode.decode_plan("bfloat16", 128, paged=False, score_mods=False, smem_per_block=99 * 1024)
    assert dict(big.variant.defines)["CUFLASH_STAGES"] > dict(small.variant.defines)["CUFLASH_STAGES"]


def test_decode_plan_rejects():
    with pytest.raises(ValueError, match="decode runs"):
        kernels.decode.decode_plan("float64", 128, paged=False, score_mods=False)
    with pytest.raises(ValueError, match="exceeds"):
        kernels.decode.decode_plan("float16", 264, paged=False, score_mods=False)
    with pytest.raises(ValueError, match="no decode tile shape"):
        kernels.decode.decode_plan("float16", 256, paged=False, score_mods=False, smem_per_block=32 * 1024)


def test_keys_as_m_decode_plan():
    """Keys as the mma's M: 8 packed rows per CTA, a define of their own (the other variants keep their
    compile keys), the shared memory of 8 Q rows; float16/bfloat16 q, 16-bit or fp8 caches, not MLA."""
    for dtype in ("float16", "bfloat16"):
        for kv_dtype in (None, "float8_e4m3fn"):
            for paged in (False, True):
                plan = kernels.decode.decode_plan(dtype, 128, paged=paged, score_mods=True, kv_dtype=kv_dtype,
                                                  keys_as_m=True)
                defines = dict(plan.variant.defines)
                assert defines["CUFLASH_KEYS_AS_M"] == 1
                assert plan.block_m == kernels.decode.DECODE_KEYS_AS_M_ROWS == 8
                tiles = kernels.decode.DecodeTiles(defines["CUFLASH_WARPS"], defines["CUFLASH_KEYS_PER_WARP"],
                                                   defines["CUFLASH_STAGES"])
                assert kernels.decode.decode_smem_bytes(dtype, 128, tiles, kv_dtype, keys_as_m=True) == plan.smem_bytes
                rows16 = kernels.decode.decode_plan(dtype, 128, paged=paged, score_mods=True, kv_dtype=kv_dtype)
                assert "CUFLASH_KEYS_AS_M" not in dict(rows16.variant.defines) and rows16.block_m == 16
                if kv_dtype and paged:   # fp8 paged: two CTAs an SM of three stages (user modifiers: one)
                    assert (tiles, plan.ctas_per_sm) == (kernels.decode.DecodeTiles(8, 16, 3), 2)
                    user = kernels.decode.decode_plan(dtype, 128, paged=True, score_mods=("score_mod",),
                                                      user_source="/* user */", kv_dtype=kv_dtype, keys_as_m=True)
                    assert user.ctas_per_sm == 1
                else:
                    assert rows16.smem_bytes - plan.smem_bytes == 8 * 128 * 2   # 8 Q rows fewer
    for dtype, extra in (("float32", {}), ("bfloat16", {"mla": True})):
        with pytest.raises(ValueError, match="keys as the mma's M"):
            kernels.decode.decode_plan(dtype, 576 if extra else 128, paged=False, score_mods=False, keys_as_m=True,
                                       **extra)


def test_mla_sm90_rows_splits_and_variants():
    """mla_sm90: 16 rows a CTA (the keys as M) for calls of at most 16 packed rows, 64 beyond; splits
    fill one wave of CTAs (one an SM), at least MLA_MIN_SPLIT_TILES tiles each and at most
    MLA_MAX_SPLITS; both row counts fit the H100/H200's 227 KiB with the kernel's static memory."""
    from cuflash import _mla_plan
    rows = kernels.mla_sm90.mla_sm90_rows
    assert rows(16) == rows(1) == 16 and rows(17) == rows(128) == 64
    splits = _mla_plan.mla_num_splits
    assert splits(64, 1, 4096, 132) == 2 and splits(64, 2, 4096, 132) == 1    # one wave, not two
    assert splits(8, 2, 8192, 132) == 8 and splits(1, 1, 32768, 132) == _mla_plan.MLA_MAX_SPLITS
    assert splits(1, 1, 64 * (_mla_plan.MLA_MIN_SPLIT_TILES * 3 + 1), 132) == 3
    assert splits(1, 1, 64, 132) == splits(200, 2, 1 << 20, 132) == 1
    for r in kernels.mla_sm90.MLA_SM90_ROWS:
        assert kernels.mla_sm90.mla_sm90_smem_bytes(r) + 2048 <= 227 * 1024
        defines = dict(kernels.mla_sm90.mla_sm90_variant("bfloat16", r).defines)
        assert defines["CUFLASH_MLA_ROWS"] == r and defines["CUFLASH_SMEM_BYTES"] == kernels.mla_sm90.mla_sm90_smem_bytes(r)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        kernels.mla_sm90.mla_sm90_variant("float32")
    with pytest.raises(ValueError, match="64 or 16 rows"):
        kernels.mla_sm90.mla_sm90_variant("bfloat16", 32)


def test_mla_decode_plan():
    """MLA's variants: one K tile per stage (the values are its first columns), head dim 576, float16 or
    bfloat16 caches of q's dtype only, a define of their own; they fit the H100/H200 budget."""
    for dtype in ("float16", "bfloat16"):
        for paged in (False, True):
            plan = kernels.decode.decode_plan(dtype, 576, paged=paged, score_mods=True, mla=True)
            defines = dict(plan.variant.defines)
            assert defines["CUFLASH_MLA"] == 1 and defines["CUFLASH_HEAD_DIM"] == 576 and plan.block_m == 16
            tiles = kernels.decode.DecodeTiles(defines["CUFLASH_WARPS"], defines["CUFLASH_KEYS_PER_WARP"],
                                               defines["CUFLASH_STAGES"])
            assert kernels.decode.decode_smem_bytes(dtype, 576, tiles, mla=True) == plan.smem_bytes
            # K alone: half the stage bytes of a K and V pipeline of the same shape
            assert (kernels.decode.decode_smem_bytes(dtype, 576, tiles) - plan.smem_bytes ==
                    tiles.stages * plan.block_n * 576 * 2)
            assert plan.in_flight_bytes == (tiles.stages - 1) * plan.block_n * 576 * 2
    plain = kernels.decode.decode_plan("bfloat16", 256, paged=False, score_mods=False)
    assert "CUFLASH_MLA" not in dict(plain.variant.defines)   # the other variants keep their compile keys
    for dtype, dim, extra in (("float32", 576, {}), ("bfloat16", 512, {}),
                              ("bfloat16", 576, {"kv_dtype": "float8_e4m3fn"})):
        with pytest.raises(ValueError, match="MLA decode runs"):
            kernels.decode.decode_plan(dtype, dim, paged=False, score_mods=False, mla=True, **extra)


def test_merge_plan():
    plan = kernels.merge.merge_plan("float32", "bfloat16")
    assert plan.variant.family == "merge" and plan.threads == 32 * plan.rows_per_block
    assert dict(plan.variant.defines)["CUFLASH_IN_DTYPE"] == 2
    assert dict(plan.variant.defines)["CUFLASH_OUT_DTYPE"] == 1
    # a warp a row: every row is covered once, the last block partly
    assert [plan.grid(rows) * plan.rows_per_block - rows for rows in (1, 8, 9, 1 << 20)] == [7, 0, 7, 0]
    assert plan.rows_per_block == kernels.merge.MERGE_ROWS_PER_BLOCK
    with pytest.raises(ValueError):
        kernels.merge.merge_plan("int32", "float32")


def test_decode_precompile_variants_cover_the_dispatcher():
    variants = kernels.decode.decode_precompile_variants()
    assert len(variants) == len(set(variants))
    assert {v.family for v in variants} == {"decode", "merge"}
    for dtype in DTYPES:
        for d in (64, 128, 256):
            for paged in (False, True):
                for mods in (False, True):
                    assert kernels.decode.decode_plan(dtype, d, paged=paged, score_mods=mods).variant in variants
                    if dtype != "float32":
                        for short in (False, True):
                            assert kernels.decode.decode_plan(dtype, d, paged=paged, score_mods=mods, keys_as_m=True,
                                                              short=short).variant in variants
        assert kernels.merge.merge_plan("float32", dtype).variant in variants
        assert kernels.merge.merge_plan(dtype, dtype).variant in variants
    only = kernels.decode.decode_precompile_variants(dtypes=["bfloat16"], head_dims=[128])
    # (contiguous, paged) x (plain, mods) x 2 tiles, and the keys-as-M ones again with the short-sequence tiles
    assert len([v for v in only if v.family == "decode"]) == 12


def test_short_tiles_rule():
    """The short-sequence tiles: at most DECODE_SHORT_KEYS keys and a wave of three CTAs an SM; a
    tile of their own at D = 128 in 16 bits (three CTAs an SM), the usual ones elsewhere."""
    def takes(keys, ctas, sms, head_dim=128):
        return kernels.decode.decode_takes_short_tiles(keys, ctas, sms, head_dim)
    limit, per_sm = kernels.decode.DECODE_SHORT_KEYS, kernels.decode.DECODE_SHORT_MIN_CTAS_PER_SM
    assert takes(limit, per_sm * 132, 132) and takes(1, per_sm * 132, 132) and takes(limit, per_sm * 132, 132, 256)
    assert not takes(limit, per_sm * 132 - 1, 132)
    # longer sequences: only CTAs of two or three waves of the usual tiles, one wave of the short ones,
    # at D = 64 and 128
    assert takes(limit + 1, 133, 132) and takes(limit + 1, per_sm * 132, 132) and takes(limit + 1, 133, 132, 64)
    assert not takes(limit + 1, 132, 132) and not takes(limit + 1, per_sm * 132 + 1, 132)
    assert not takes(limit + 1, 133, 132, 256)
    assert not takes(0, per_sm * 132, 132)
    short = kernels.decode.decode_plan("bfloat16", 128, paged=True, score_mods=False, keys_as_m=True, short=True)
    usual = kernels.decode.decode_plan("bfloat16", 128, paged=True, score_mods=False, keys_as_m=True)
    assert short.ctas_per_sm == 3 and usual.ctas_per_sm == 1 and short.variant != usual.variant
    assert (kernels.decode.decode_plan("bfloat16", 128, paged=True, score_mods=False, short=True).variant
            == kernels.decode.decode_plan("bfloat16", 128, paged=True, score_mods=False).variant)   # 16 rows
    for args in (("bfloat16", 64), ("float32", 128)):
        assert (kernels.decode.decode_plan(*args, paged=False, score_mods=False, short=True).variant
                == kernels.decode.decode_plan(*args, paged=False, score_mods=False).variant)
    fp8 = dict(paged=False, score_mods=False, kv_dtype="float8_e4m3fn")
    assert (kernels.decode.decode_plan("bfloat16", 128, short=True, **fp8).variant
            == kernels.decode.decode_plan("bfloat16", 128, **fp8).variant)


def test_paged_head_dim_64_tiles():
    """16-bit pages at D = 64 with the keys as M: eight warps of three stages, and for many short
    sequences four warps of two stages; the contiguous cache keeps four warps (short or not)."""
    def tiles(paged, short):
        d = dict(kernels.decode.decode_plan("bfloat16", 64, paged=paged, score_mods=False, keys_as_m=True,
                                            short=short).variant.defines)
        return kernels.decode.DecodeTiles(d["CUFLASH_WARPS"], d["CUFLASH_KEYS_PER_WARP"], d["CUFLASH_STAGES"])
    assert tiles(True, False) == kernels.decode.DecodeTiles(8, 16, 3)
    assert tiles(True, True) == kernels.decode.DecodeTiles(4, 16, 2)
    assert tiles(False, False) == tiles(False, True) == kernels.decode.DecodeTiles(4, 16, 4)
    rows16 = dict(kernels.decode.decode_plan("bfloat16", 64, paged=True, score_mods=False).variant.defines)
    assert rows16["CUFLASH_WARPS"] == 4   # 16 packed rows: the usual tiles


# ----------------------------------------------------------------------------- score modifiers

def test_score_mod_bits():
    assert features.SCORE_MODS == ("softcap", "alibi", "bias", "mask", "block_mask")
    assert [features.score_mod_bits((name,)) for name in features.SCORE_MODS] == [1, 2, 4, 8, 16]
    assert features.score_mod_bits(("alibi_slopes",)) == 2   # the keyword's name
    assert features.score_mod_bits(True) == 31 and features.score_mod_bits(False) == features.score_mod_bits(()) == 0
    assert features.score_mod_bits(None) == 0 and features.score_mod_bits(8) == 8
    # Two or more share the variant with every modifier (precompiled), so at most 7 per configuration.
    assert features.score_mod_bits(("softcap", "mask")) == features.score_mod_bits(frozenset({"bias", "block_mask"})) == 31
    assert features.score_mod_bits(True, features.DECODE_SCORE_MODS) == 1 | 2 | 8
    assert features.score_mod_bits(("alibi", "mask"), features.DECODE_SCORE_MODS) == 11
    assert features.score_mod_sets() == [0, 1, 2, 4, 8, 16, 31]
    assert features.score_mod_sets(features.DECODE_SCORE_MODS) == [0, 1, 2, 8, 11]
    with pytest.raises(ValueError, match="unknown score modifier 'tanh'"):
        features.score_mod_bits(("tanh",))
    with pytest.raises(ValueError, match="unknown score modifier 'bias'"):
        features.score_mod_bits(("bias",), features.DECODE_SCORE_MODS)
    with pytest.raises(ValueError, match="bit mask 128"):
        features.score_mod_bits(128)
    # The user modifiers' bits (32, 64) come on top of the built-in ones, never merged with them,
    # and not in decode.
    assert features.score_mod_bits(("score_mod",)) == 32 and features.score_mod_bits(("mask_mod", "bias")) == 64 | 4
    assert features.score_mod_bits(("softcap", "mask", "score_mod", "mask_mod")) == 31 | 32 | 64
    with pytest.raises(ValueError, match="bit mask 32"):
        features.score_mod_bits(32, features.DECODE_SCORE_MODS)


def test_score_mod_bits_match_mask_cuh():
    # The planner's bit order is the kernels' (cuda_src/mask.cuh): one source of truth each side.
    from cuflash._build import compile as _compile

    text = (_compile.CUDA_SRC / "mask.cuh").read_text()
    for k, name in enumerate(features.SCORE_MODS):
        camel = "".join(part.title() for part in name.split("_"))
        assert f"kMod{camel} = {1 << k}" in text, name


@pytest.mark.parametrize("family, dtype", [("fwd_sm90", "bfloat16"), ("fwd_sm80", "float16"),
                                           ("fwd_simt", "float32")])
def test_softcap_only_plan_compiles_only_the_softcap(family, dtype):
    # A softcap-only call gets a variant of its own (CUFLASH_SCORE_MODS=1), not the one with every
    # modifier (31, what True and any two modifiers give), and the flag reaches NVRTC's defines.
    from cuflash._build import compile as _compile

    softcap = kernels.forward.forward_plan(family, dtype, 128, score_mods=("softcap",), dropout=False).variant
    every = kernels.forward.forward_plan(family, dtype, 128, score_mods=True, dropout=False).variant
    plain = kernels.forward.forward_plan(family, dtype, 128, score_mods=(), dropout=False).variant
    assert len({softcap, every, plain}) == 3
    assert dict(softcap.defines)["CUFLASH_SCORE_MODS"] == 1
    assert dict(every.defines)["CUFLASH_SCORE_MODS"] == 31
    assert dict(plain.defines)["CUFLASH_SCORE_MODS"] == 0
    assert kernels.forward.forward_plan(family, dtype, 128, score_mods=("softcap", "bias"), dropout=False).variant == every
    assert kernels.forward.forward_plan(family, dtype, 128, score_mods=False, dropout=False).variant == plain
    # Only the modifier bits differ (tiles, shared memory: the same as with every modifier).
    assert {k: v for k, v in softcap.defines if k != "CUFLASH_SCORE_MODS"} == \
        {k: v for k, v in every.defines if k != "CUFLASH_SCORE_MODS"}
    assert "-DCUFLASH_SCORE_MODS=1" in _compile.nvrtc_options(softcap, "sm_90a")
    assert "-DCUFLASH_SCORE_MODS=31" in _compile.nvrtc_options(every, "sm_90a")


def test_each_modifier_alone_has_its_own_variant():
    for plan in (lambda m: kernels.forward.forward_plan("fwd_sm90", "bfloat16", 64, score_mods=m, dropout=True),
                 lambda m: kernels.backward.backward_plan("bwd_sm80", "bfloat16", 64, dq_pass=False, score_mods=m, dropout=False)):
        variants = [plan((name,)).variant for name in features.SCORE_MODS]
        assert len(set(variants)) == 5
        assert [dict(v.defines)["CUFLASH_SCORE_MODS"] for v in variants] == [1, 2, 4, 8, 16]
    decode = [kernels.decode.decode_plan("bfloat16", 128, paged=True, score_mods=(name,)).variant for name in features.DECODE_SCORE_MODS]
    assert [dict(v.defines)["CUFLASH_SCORE_MODS"] for v in decode] == [1, 2, 8]


def test_reachable_variants():
    sm90 = kernels.catalogue.reachable_variants("sm_90a")
    assert len(sm90) == len(set(sm90))
    assert set(kernels.catalogue.precompile_variants(arch="sm_90a")) <= set(sm90)
    assert {v.family for v in sm90} >= {"fwd_sm90", "fwd_sm80", "fwd_simt", "bwd_sm80", "bwd_simt", "decode",
                                        "merge", "bwd_preprocess", "bwd_convert", "check_indices"}
    assert "fwd_sm90" not in {v.family for v in kernels.catalogue.reachable_variants("sm_80")}
    # fwd_sm90: 2 dtypes x 3 head dims x (7 modifier sets, ALiBi and the softcap on the plain loop) x
    # dropout on/off, a bias or a mask as tiles at 2 head dims x dropout on/off x (tiles of the CTA's rows,
    # of one row), the three-warpgroup
    # plain variant at D = 64 for each dtype, and per dtype the value head dim pairs, plain and with
    # every modifier and dropout; and over a KV cache (kv_cache_variants).
    pairs = len(kernels.catalogue.VALUE_HEAD_DIM_PAIRS)
    kv = len(kernels.fwd_sm90.kv_cache_variants())
    tiles = 2 * len(kernels.fwd_sm90.SCORE_TILE_HEAD_DIMS) * 2 * 2 * 2
    assert len([v for v in sm90 if v.family == "fwd_sm90"]) == 2 * 3 * 9 * 2 + tiles + 2 + 2 * pairs * 2 + kv
    plain_loop = [v for v in sm90 if dict(v.defines).get("CUFLASH_MOD_ON_PLAIN_LOOP")]
    assert len(plain_loop) == 2 * 3 * 2 * 2 + tiles
    assert {dict(v.defines)["CUFLASH_SCORE_MODS"] for v in plain_loop} == {
        features.score_mod_bits((name,)) for name in ("alibi", "softcap", "bias", "mask")}
    assert set(kernels.fwd_sm90.kv_cache_variants()) <= set(sm90) and kernels.append_kv.append_kv_variant() in sm90
    small = kernels.catalogue.reachable_variants("sm_90a", ("bfloat16",), (100,))
    assert {dict(v.defines).get("CUFLASH_HEAD_DIM") for v in small} == {None, 128}


def test_forward_plan_cache_tells_true_from_one():
    # forward_plan is memoised; True (every modifier) and 1 (the softcap bit) are equal as dict keys.
    assert dict(kernels.forward.forward_plan("fwd_sm80", "bfloat16", 64, score_mods=1, dropout=False).variant.defines)[
        "CUFLASH_SCORE_MODS"] == 1
    assert dict(kernels.forward.forward_plan("fwd_sm80", "bfloat16", 64, score_mods=True, dropout=False).variant.defines)[
        "CUFLASH_SCORE_MODS"] == 31


# ----------------------------------------------------------------------------- bwd_sm90

def _bwd_sm90_obstacle():
    return kernels.bwd_sm90.bwd_sm90_obstacle


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bwd_sm90_runs_plain_head_dims(head_dim):
    assert _bwd_sm90_obstacle()(head_dim, (), False) is None


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("mods, dropout", [(("softcap",), False), (("bias",), True), ((), True),
                                           (("alibi", "mask"), False), (("softcap", "block_mask"), True)])
def test_bwd_sm90_runs_modifiers_and_dropout(head_dim, mods, dropout):
    # Every combination of modifiers and dropout compiles for bwd_sm90 (featured tiles), several
    # modifiers with dropout at D = 256 included.
    assert _bwd_sm90_obstacle()(head_dim, mods, dropout) is None


def test_bwd_sm90_names_what_it_cannot_run():
    reason = _bwd_sm90_obstacle()(264, (), False)
    assert isinstance(reason, str) and "264" in reason and "\n" not in reason


@pytest.mark.parametrize("head_dim, keys, rows", [(64, 128, 64), (128, 64, 64), (256, 64, 64)])
def test_bwd_sm90_featured_tiles(head_dim, keys, rows):
    # With score modifiers or dropout the consumers take smaller accumulators: D = 128 splits the
    # columns (64 keys per CTA), D = 64 takes 64 query rows per step; no fixed dQ order for them.
    for mods, dropout in ((("bias",), False), ((), True), (("softcap",), True)):
        plan = kernels.backward.backward_plan("bwd_sm90", "bfloat16", head_dim, dq_pass=False, score_mods=mods, dropout=dropout,
                               deterministic=False)
        defines = dict(plan.variant.defines)
        assert (plan.block_m, defines["CUFLASH_BLOCK_M"]) == (keys, rows)
        assert plan.smem_bytes == defines["CUFLASH_SMEM_BYTES"] <= 227 * 1024
        assert not kernels.bwd_sm90.bwd_sm90_orders_dq(head_dim, featured=True)
        with pytest.raises(ValueError, match="fixed order"):
            kernels.backward.backward_plan("bwd_sm90", "bfloat16", head_dim, dq_pass=False, score_mods=mods, dropout=dropout,
                            deterministic=True)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("windowed", [True, False])
@pytest.mark.parametrize("mod", ["softcap", "alibi", "block_mask", "bias", "mask"])
def test_bwd_sm90_one_modifier_in_place_keeps_the_plain_tiles_from_head_dim_128(head_dim, windowed, mod):
    # The softcap, ALiBi or the block mask alone modify the scores in place (the softcap's derivative
    # recovered from P), so from D = 128 they take the tiles of a call without modifiers; at D = 64
    # those spilled with the softcap, at D = 128 with the bias's or the mask's loads: featured tiles.
    def plan(mods):
        return kernels.backward.backward_plan("bwd_sm90", "bfloat16", head_dim, dq_pass=False, score_mods=mods,
                                              dropout=False, deterministic=False, windowed=windowed, seqlen_q=16384)
    one, plain, featured = plan((mod,)), plan(()), plan(("alibi", "softcap"))
    tiles = lambda x: (x.block_m, dict(x.variant.defines)["CUFLASH_BLOCK_M"], x.smem_bytes)  # noqa: E731
    bit = dict(one.variant.defines)["CUFLASH_SCORE_MODS"]
    in_place = head_dim >= 128 and mod in ("softcap", "alibi", "block_mask")
    assert kernels.bwd_sm90.bwd_sm90_featured(head_dim, bit, False) is not in_place
    if in_place:   # no 80-row steps with a modifier (those of a call without one, windowed=False)
        assert tiles(one) == tiles(plan(())) or dict(plain.variant.defines)["CUFLASH_BLOCK_M"] == 80
        assert dict(one.variant.defines)["CUFLASH_BLOCK_M"] == 64 and one.block_m == plain.block_m
    else:
        assert tiles(one) == tiles(featured)
    assert kernels.bwd_sm90.bwd_sm90_featured(head_dim, bit, True) is True   # dropout: featured


def test_bwd_sm90_plans_head_dim_256_by_columns():
    # D = 256: 64 keys per CTA (the consumers split dK/dV's columns), 64 query rows per step, and
    # shared memory within the 227 KiB an H100 block may use.
    plan = kernels.backward.backward_plan("bwd_sm90", "bfloat16", 256, dq_pass=False, score_mods=(), dropout=False,
                           deterministic=False)
    defines = dict(plan.variant.defines)
    assert (plan.block_m, defines["CUFLASH_BLOCK_M"], plan.head_dim) == (64, 64, 256)
    assert plan.smem_bytes == defines["CUFLASH_SMEM_BYTES"] <= 227 * 1024
    for d in (136, 192, 200):   # padded to the compiled head dim 256
        assert kernels.backward.backward_plan("bwd_sm90", "float16", d, dq_pass=False, score_mods=(), dropout=False,
                               deterministic="pass").head_dim == 256


def test_bwd_sm90_wide_query_tiles():
    # 80 query rows per step (dQ computed transposed) only at D = 128 without a window, score
    # modifier, dropout or fixed dQ order, from BWD_SM90_WIDE_MIN_ROWS query rows when every row sees
    # every key of its tiles and from BWD_SM90_WIDE_MIN_ROWS_GUARDED otherwise; every other plan keeps
    # its rows. Shared memory stays within the 227 KiB an H100 block may use, and both variants are
    # precompiled.
    def rows(d, windowed=False, det=False, mods=(), dropout=False, seqlen_q=kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS,
             all_keys_seen=True):
        plan = kernels.backward.backward_plan("bwd_sm90", "bfloat16", d, dq_pass=False, score_mods=mods, dropout=dropout,
                               deterministic=det, windowed=windowed, seqlen_q=seqlen_q, all_keys_seen=all_keys_seen)
        defines = dict(plan.variant.defines)
        assert plan.smem_bytes == defines["CUFLASH_SMEM_BYTES"] <= 227 * 1024
        return defines["CUFLASH_BLOCK_M"]

    assert kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS < kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS_GUARDED
    assert [rows(d) for d in (64, 72, 128, 256)] == [128, 80, 80, 64]
    assert rows(128, windowed=True) == rows(128, det=True) == rows(128, det="pass") == 64
    assert rows(128, mods=("softcap",)) == rows(128, dropout=True) == 64
    assert rows(128, seqlen_q=kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS - 1) == 64 and rows(128, seqlen_q=10 ** 6) == 80
    guarded = kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS_GUARDED
    assert rows(128, all_keys_seen=False, seqlen_q=guarded - 1) == 64
    assert rows(128, all_keys_seen=False, seqlen_q=guarded) == 80
    for all_keys_seen, seqlen_q in ((True, kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS), (False, guarded)):
        wide = kernels.backward.backward_plan("bwd_sm90", "bfloat16", 128, dq_pass=False, score_mods=(), dropout=False,
                               deterministic=False, windowed=False, seqlen_q=seqlen_q, all_keys_seen=all_keys_seen)
        assert wide.block_m == 128 and wide.smem_bytes > 220 * 1024   # 128 keys; single-buffered dQ staging
        assert wide.variant in kernels.backward.precompile_backward_variants(dtypes=("bfloat16",), head_dims=(128,), arch="sm_90a")
        assert wide.variant in kernels.catalogue.reachable_variants("sm_90a", ("bfloat16",), (128,))


def test_bwd_sm90_third_stage_option(monkeypatch):
    # BWD_SM90_DEFER_STAGES = 3 gives the D = 128 64-row plans that add dQ in any order a third Q/dO
    # stage in the room of their second dQ share buffer (same shared memory); deterministic, wide,
    # featured and other head dims keep BWD_SM90_STAGES. The CPU compile sweep builds those variants.
    def plan(d=128, det=False, windowed=True, mods=(), seqlen_q=1024):
        p = kernels.backward.backward_plan("bwd_sm90", "bfloat16", d, dq_pass=False, score_mods=mods, dropout=False,
                            deterministic=det, windowed=windowed, seqlen_q=seqlen_q)
        defines = dict(p.variant.defines)
        assert p.smem_bytes == defines["CUFLASH_SMEM_BYTES"] <= 227 * 1024
        return p, defines["CUFLASH_STAGES"]

    default, two = plan()
    assert two == kernels.bwd_sm90.BWD_SM90_DEFER_STAGES == 2
    ci = kernels.catalogue.ci_variants()   # with the default
    monkeypatch.setattr(kernels.bwd_sm90, "BWD_SM90_DEFER_STAGES", 3)
    third, three = plan()
    assert three == 3 and third.smem_bytes == default.smem_bytes
    assert plan(windowed=False)[1] == 3
    assert plan(det=True)[1] == plan(windowed=False, seqlen_q=10 ** 6)[1] == plan(mods=("bias",))[1] == 2
    assert plan(mods=("softcap",))[1] == plan(mods=("alibi",))[1] == 3   # one modifier in place: the plain tiles
    assert plan(d=64)[1] == plan(d=256)[1] == 2
    assert (third.variant, "sm_90a") in ci


def test_bwd_sm90_ordered_dq_async_option_in_the_sweep():
    # CUFLASH_BWD_ORDERED_DQ_ASYNC = 0 (ordered dQ handed over by the consumers' thread 0, kept for
    # A/Bs): the CPU compile sweep builds it beside every ordered bwd_sm90 variant it builds, so
    # that it stays compilable and free of spills.
    ci = [v for v, arch in kernels.catalogue.ci_variants() if arch == "sm_90a" and v.family == "bwd_sm90"]
    ordered = [v for v in ci if dict(v.defines)["CUFLASH_BWD_DQ"] == 2
               and "CUFLASH_BWD_ORDERED_DQ_ASYNC" not in dict(v.defines)]
    assert ordered
    for v in ordered:
        assert kernels.catalogue._with_define(v, "CUFLASH_BWD_ORDERED_DQ_ASYNC", 0) in ci


def test_bwd_sm90_first_step_lag_option_in_the_sweep():
    # CUFLASH_BWD_RELAG = 0 (the consumers' lag made at the first step only, kept for A/Bs): the CPU
    # compile sweep builds it beside every two-stage bwd_sm90 variant that defers dQ.
    ci = [v for v, arch in kernels.catalogue.ci_variants() if arch == "sm_90a" and v.family == "bwd_sm90"]
    deferring = [v for v in ci if kernels.catalogue._defers_dq(v) and dict(v.defines)["CUFLASH_STAGES"] == 2
                 and "CUFLASH_BWD_RELAG" not in dict(v.defines)]
    assert deferring
    for v in deferring:
        assert kernels.catalogue._with_define(v, "CUFLASH_BWD_RELAG", 0) in ci


def test_bwd_tail_pairs_only_for_shrinking_walks():
    # The last BWD_TAIL_WAVES waves' worth of (slot, sequence) pairs of a causal grid go block by
    # block (a wave: 132 CTAs here); none without a causal mask or with ordered dQ, never more than
    # the grid has.
    assert kernels.bwd_common.bwd_tail_pairs(8, 256, 132, shrinking=True, ordered=False) == -(-kernels.bwd_common.BWD_TAIL_WAVES * 132 // 8)
    assert kernels.bwd_common.bwd_tail_pairs(64, 32, 132, shrinking=True, ordered=False) == -(-kernels.bwd_common.BWD_TAIL_WAVES * 132 // 64)
    assert kernels.bwd_common.bwd_tail_pairs(8, 10, 132, shrinking=True, ordered=False) == 10
    assert kernels.bwd_common.bwd_tail_pairs(8, 256, 132, shrinking=False, ordered=False) == 0
    assert kernels.bwd_common.bwd_tail_pairs(8, 256, 132, shrinking=True, ordered=True) == 0


def test_fwd_tail_heads_only_for_causal_calls():
    # The last FWD_TAIL_WAVES waves' worth of (head, sequence) pairs of a causal forward number
    # their m-blocks m-block-major (a wave: 132 persistent CTAs here); enough pairs that their
    # items fill those waves, never more than the call has, none without a causal mask or with a
    # single m-block per head (nothing to reorder).
    for m_blocks, pairs in ((8, 512), (64, 32), (128, 16), (8, 10)):
        tail = kernels.fwd_sm90.fwd_tail_heads(m_blocks, pairs, 132, shrinking=True)
        assert tail == min(pairs, -(-kernels.fwd_sm90.FWD_TAIL_WAVES * 132 // m_blocks))
        assert tail == pairs or tail * m_blocks >= kernels.fwd_sm90.FWD_TAIL_WAVES * 132 > (tail - 1) * m_blocks
    assert kernels.fwd_sm90.fwd_tail_heads(8, 512, 132, shrinking=False) == 0
    assert kernels.fwd_sm90.fwd_tail_heads(1, 512, 132, shrinking=True) == 0


def test_bwd_convert_behind_only_without_a_causal_mask(monkeypatch):
    # bwd_sm90's dQ conversion runs as its programmatic dependent where the grid's last wave leaves
    # SMs idle (no causal mask); never when switched off.
    assert kernels.bwd_sm90.bwd_convert_behind(shrinking=False) and not kernels.bwd_sm90.bwd_convert_behind(shrinking=True)
    monkeypatch.setattr(kernels.bwd_sm90, "BWD_CONVERT_BEHIND", False)
    assert not kernels.bwd_sm90.bwd_convert_behind(shrinking=False)


def test_bwd_all_keys_seen_only_without_unseen_keys(monkeypatch):
    # dS's guard for P = 0 is left out only where every key of a row's tiles is one it sees, and
    # only at the head dims listed; the define is the only difference between the two variants.
    assert kernels.bwd_sm90.bwd_all_keys_seen(windowed=False, varlen=False, featured=False)
    for unseen in ({"windowed": True}, {"varlen": True}, {"featured": True}):
        assert not kernels.bwd_sm90.bwd_all_keys_seen(**{"windowed": False, "varlen": False, "featured": False, **unseen})

    def defines(d, seqlen_q=kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS, deterministic=False, **kw):
        plan = kernels.backward.backward_plan("bwd_sm90", "bfloat16", d, dq_pass=False, score_mods=kw.pop("mods", ()),
                               dropout=False, deterministic=deterministic, seqlen_q=seqlen_q, **kw)
        return dict(plan.variant.defines)

    for d in (64, 128, 256):
        # (at rows where both take 80-row steps at D = 128: test_bwd_sm90_wide_query_tiles)
        long = kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS_GUARDED
        guarded = defines(d, windowed=False, seqlen_q=long)
        unguarded = defines(d, windowed=False, all_keys_seen=True, seqlen_q=long)
        if d in kernels.bwd_sm90.BWD_SM90_UNGUARDED_HEAD_DIMS:
            assert unguarded.pop("CUFLASH_ALL_KEYS_SEEN") == 1
        assert unguarded == guarded
        # a window or a score modifier keeps the guard whatever the caller says
        assert "CUFLASH_ALL_KEYS_SEEN" not in defines(d, windowed=True, all_keys_seen=True)
        assert "CUFLASH_ALL_KEYS_SEEN" not in defines(d, windowed=False, all_keys_seen=True, mods=("softcap",))
    # D = 128 with 64 query rows (shorter sequences, and the ordered dQ at every length) too
    narrow = kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS - 1
    for seqlen_q, deterministic in ((narrow, False), (1024, True), (kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS, True)):
        rows64 = defines(128, seqlen_q=seqlen_q, windowed=False, all_keys_seen=True, deterministic=deterministic)
        assert rows64["CUFLASH_BLOCK_M"] == 64 and rows64["CUFLASH_ALL_KEYS_SEEN"] == 1
    for seqlen_q in (1024, kernels.bwd_sm90.BWD_SM90_WIDE_MIN_ROWS):
        assert "CUFLASH_ALL_KEYS_SEEN" not in defines(128, seqlen_q=seqlen_q, windowed=True, all_keys_seen=True,
                                                      deterministic=True)
    reachable = [v for v in kernels.catalogue.reachable_variants("sm_90a", ("bfloat16",), (64,)) if v.family == "bwd_sm90"]
    assert any(dict(v.defines).get("CUFLASH_ALL_KEYS_SEEN") == 1 for v in reachable)
    monkeypatch.setattr(kernels.bwd_sm90, "BWD_ALL_KEYS_SEEN", False)
    assert not kernels.bwd_sm90.bwd_all_keys_seen(windowed=False, varlen=False, featured=False)


def test_bwd_tile_guard_only_where_measured(monkeypatch):
    # Windowed calls without score modifiers or dropout decide dS's guard tile by tile at D = 64 and
    # D = 128, not at D = 256; the define is the only difference, and never beside
    # CUFLASH_ALL_KEYS_SEEN.
    def defines(d, deterministic=False, **kw):
        plan = kernels.backward.backward_plan("bwd_sm90", "bfloat16", d, dq_pass=False, score_mods=kw.pop("mods", ()),
                               dropout=kw.pop("dropout", False), deterministic=deterministic, seqlen_q=8192, **kw)
        return dict(plan.variant.defines)

    takes = [(64, False), (64, "pass"), (128, False), (128, True)]
    for d, deterministic in takes + [(256, False), (256, "pass")]:
        with_it = defines(d, deterministic, windowed=True)
        assert with_it.pop("CUFLASH_TILE_GUARD", 0) == ((d, deterministic) in takes)
        monkeypatch.setattr(kernels.bwd_sm90, "BWD_SM90_TILE_GUARD", False)
        assert defines(d, deterministic, windowed=True) == with_it
        monkeypatch.setattr(kernels.bwd_sm90, "BWD_SM90_TILE_GUARD", True)
        assert "CUFLASH_TILE_GUARD" not in defines(d, deterministic, windowed=False)
        assert "CUFLASH_TILE_GUARD" not in defines(d, deterministic, windowed=False, all_keys_seen=True)
        if deterministic is not True:   # (the ordered dQ runs without modifiers and dropout)
            # the softcap alone keeps the plain tiles from D = 128 (kSoftcapAlone), and their guard
            capped = defines(d, deterministic, windowed=True, mods=("softcap",))
            assert ("CUFLASH_TILE_GUARD" in capped) == (d == 128)
            for mods in (("alibi",), ("bias",)):   # P^T from modified scores: the guard everywhere
                assert "CUFLASH_TILE_GUARD" not in defines(d, deterministic, windowed=True, mods=mods)
            assert "CUFLASH_TILE_GUARD" not in defines(d, deterministic, windowed=True, dropout=True)
    reachable = [v for v in kernels.catalogue.reachable_variants("sm_90a", ("bfloat16",), (64,)) if v.family == "bwd_sm90"]
    assert any(dict(v.defines).get("CUFLASH_TILE_GUARD") == 1 for v in reachable)


def test_bwd_sm90_orders_dq_at_d128_only():
    # deterministic=True on bwd_sm90 adds dQ in a fixed order at D = 128 (padded head dims 72..128);
    # at D = 64 bwd_sm80's dQ pass computes dQ.
    assert [kernels.bwd_sm90.bwd_sm90_orders_dq(d) for d in (40, 64, 72, 128, 136, 256)] == [False, False, True, True, False, False]
    # the call's mode: any order without deterministic=True, else the fixed order or bwd_sm80's pass
    assert [kernels.bwd_sm90.bwd_sm90_dq_mode(d, False, True) for d in (64, 128, 256)] == ["pass", True, "pass"]
    assert kernels.bwd_sm90.bwd_sm90_dq_mode(128, True, True) == "pass" and kernels.bwd_sm90.bwd_sm90_dq_mode(128, False, False) is False


def test_bwd_sm90_deterministic_variants():
    def dq_mode(d, det):
        plan = kernels.backward.backward_plan("bwd_sm90", "bfloat16", d, dq_pass=False, score_mods=(), dropout=False,
                               deterministic=det)
        return dict(plan.variant.defines)["CUFLASH_BWD_DQ"]

    assert [dq_mode(128, det) for det in (False, True, "pass")] == [1, 2, 0]
    assert dq_mode(64, "pass") == 0
    with pytest.raises(ValueError, match="fixed order"):
        dq_mode(64, True)
    with pytest.raises(ValueError, match="deterministic"):
        dq_mode(128, None)
    # Every variant the planner can choose is precompiled (and so compiled by the CPU tests).
    variants = set(kernels.backward.precompile_backward_variants(dtypes=("bfloat16",), head_dims=(64, 128), arch="sm_90a"))
    for d, det in ((128, False), (128, True), (128, "pass"), (64, False), (64, "pass")):
        assert kernels.backward.backward_plan("bwd_sm90", "bfloat16", d, dq_pass=False, score_mods=(), dropout=False,
                               deterministic=det).variant in variants


def test_sm90_consumers():
    """Three consumer warpgroups only at D = 64 (any head dim that compiles to it), plain, full
    attention over at least SM90_WIDE_MIN_ROWS query rows or causal over SM90_WIDE_MIN_ROWS_CAUSAL;
    their variant exists only there."""
    fwd = kernels.fwd_sm90
    wide = dict(featured=False, window=(-1, -1), seqlen_q=fwd.SM90_WIDE_MIN_ROWS)
    assert fwd.sm90_consumers(64, **wide) == 3 and fwd.sm90_consumers(40, **wide) == 3
    assert fwd.sm90_consumers(128, **wide) == 2 and fwd.sm90_consumers(256, **wide) == 2
    assert fwd.sm90_consumers(64, **{**wide, "featured": True}) == 2
    assert fwd.sm90_consumers(64, **{**wide, "seqlen_q": fwd.SM90_WIDE_MIN_ROWS - 1}) == 2
    assert fwd.SM90_WIDE_MIN_ROWS < fwd.SM90_WIDE_MIN_ROWS_CAUSAL
    causal = {**wide, "window": (-1, 0), "seqlen_q": fwd.SM90_WIDE_MIN_ROWS_CAUSAL}
    assert fwd.sm90_consumers(64, **causal) == 3 and fwd.sm90_consumers(128, **causal) == 2
    assert fwd.sm90_consumers(64, **{**causal, "seqlen_q": fwd.SM90_WIDE_MIN_ROWS_CAUSAL - 1}) == 2
    assert fwd.sm90_consumers(64, **{**causal, "featured": True}) == 2
    for window in ((1024, 0), (-1, 3), (5, 5)):   # sliding windows keep two
        assert fwd.sm90_consumers(64, **{**causal, "window": window, "seqlen_q": 10 ** 6}) == 2
    plan = kernels.forward.forward_plan("fwd_sm90", "bfloat16", 64, score_mods=False, dropout=False, consumers=3)
    assert (plan.block_m, plan.threads) == (192, 512)
    assert dict(plan.variant.defines)["CUFLASH_CONSUMERS"] == 3
    assert plan.smem_bytes == dict(plan.variant.defines)["CUFLASH_SMEM_BYTES"] <= 227 * 1024
    for kwargs in (dict(head_dim=128, score_mods=False, dropout=False), dict(head_dim=64, score_mods=True, dropout=False),
                   dict(head_dim=64, score_mods=False, dropout=True)):
        with pytest.raises(ValueError, match="consumer warpgroups"):
            kernels.forward.forward_plan("fwd_sm90", "bfloat16", kwargs.pop("head_dim"), consumers=3, **kwargs)


@pytest.mark.parametrize("score_mods, window, plain", [
    (("alibi_slopes",), (-1, 0), True), (("alibi",), (100, 0), True), (("alibi_slopes",), (-1, -1), False),
    (("alibi_slopes",), (-1, 3), False), (("alibi_slopes", "softcap"), (-1, 0), False), ((), (-1, 0), False),
    (("softcap",), (-1, -1), True), (("softcap",), (1024, 0), True), (("softcap", "bias"), (-1, 0), False)])
def test_one_modifier_on_the_plain_loop(score_mods, window, plain):
    """fwd_sm90 runs ALiBi on its plain loop only where no visible key is right of its query's diagonal,
    the softcap under any window, and neither beside another modifier."""
    assert kernels.fwd_sm90.on_plain_loop(score_mods, window) is plain
    if plain:
        variant = kernels.forward.forward_plan("fwd_sm90", "bfloat16", 128, score_mods=score_mods, dropout=False,
                                               on_plain_loop=True).variant
        assert dict(variant.defines)["CUFLASH_MOD_ON_PLAIN_LOOP"] == 1


class _Operand:
    """What fwd_sm90.score_tile reads of a bias or mask view: dtype, itemsize, byte strides, address."""

    def __init__(self, dtype, shape, strides, ptr=0x7F00_0000_0000):
        self.dtype, self.itemsize = np.dtype(dtype), np.dtype(dtype).itemsize
        self.shape, self.strides = shape, strides
        self.data = type("Memory", (), {"ptr": ptr})()


@pytest.mark.parametrize("mods, operand, dtype_name, head_dim, tiled", [
    (("bias",), _Operand(np.float16, (2, 4, 300, 456), (0, 0, 912, 2)), "float16", 128, True),
    (("bias",), _Operand(np.float16, (2, 4, 300, 456), (0, 912 * 300, 912, 2)), "float16", 64, True),
    (("bias",), _Operand(np.float16, (2, 4, 300, 456), (0, 0, 912, 2)), "float16", 256, False),   # no room
    (("bias",), _Operand(np.float16, (2, 4, 300, 456), (0, 0, 912, 2)), "bfloat16", 128, False),  # q's dtype only
    (("bias",), _Operand(np.float32, (2, 4, 300, 456), (0, 0, 1824, 4)), "float16", 128, False),
    (("bias",), _Operand(np.float16, (2, 4, 300, 456), (0, 0, 0, 2)), "float16", 128, True),      # rows broadcast
    (("mask",), _Operand(np.bool_, (2, 4, 300, 456), (464, 0, 0, 1)), "float16", 128, True),      # a key mask
    (("bias",), _Operand(np.float16, (2, 4, 300, 456), (0, 0, 912, 0)), "float16", 128, False),   # keys broadcast
    (("bias",), _Operand(np.float16, (2, 4, 300, 452), (0, 0, 904, 2)), "float16", 128, False),   # 904 % 16
    (("bias",), _Operand(np.float16, (2, 4, 300, 456), (0, 0, 912, 2), ptr=0x1008), "float16", 128, False),
    (("mask",), _Operand(np.bool_, (2, 4, 300, 464), (0, 0, 464, 1)), "bfloat16", 128, True),
    (("mask",), _Operand(np.bool_, (2, 4, 300, 456), (0, 0, 456, 1)), "bfloat16", 128, False),
    (("mask", "bias"), _Operand(np.bool_, (2, 4, 300, 464), (0, 0, 464, 1)), "bfloat16", 128, False),
])
def test_bias_or_mask_read_as_tiles(mods, operand, dtype_name, head_dim, tiled):
    """fwd_sm90 reads a bias of q's dtype or a mask alone as TMA tiles where its layout allows (keys
    contiguous, rows 16-byte multiples apart, not broadcast over rows, aligned) at D = 64 and 128; its
    plan makes room for the tile with one Q slot at D = 128 (a tile of rows), and fits the shared memory
    beside the static. Rows broadcast (a key mask or bias) are read as tiles of one row."""
    assert kernels.fwd_sm90.score_tile(mods, operand, dtype_name, head_dim) is tiled
    if tiled:
        one_row = kernels.fwd_sm90.tile_one_row(operand)
        plan = kernels.fwd_sm90.plan(dtype_name, head_dim, score_mods=mods, dropout=False, on_plain_loop=True,
                                     tile_one_row=one_row)
        defines = dict(plan.variant.defines)
        assert defines.get("CUFLASH_TILE_ONE_ROW", 0) == int(one_row)
        if not one_row:
            assert defines["CUFLASH_Q_SLOTS"] == (1 if head_dim == 128 else 2)
        room = kernels.common.DEFAULT_SMEM_PER_BLOCK - kernels.fwd_sm90.STATIC_SMEM_ROOM
        assert plan.smem_bytes == defines["CUFLASH_SMEM_BYTES"] <= room
        assert plan.smem_bytes == kernels.fwd_sm90.sm90_smem_bytes(
            head_dim, q_slots=defines["CUFLASH_Q_SLOTS"], tile_elem_bytes=kernels.common.SCORE_TILE_BYTES[mods[0]],
            tile_one_row=one_row)
        spec = _scores.score_tile_spec(operand, 128)
        b, h, sq, sk = operand.shape
        rows = 1 if one_row else sq
        assert spec[0] == (b if operand.strides[0] else 1, rows, h if operand.strides[1] else 1, sk)
        assert spec[3:5] == (1 if one_row else 128, str(operand.dtype))


@pytest.mark.parametrize("mods, head_dim, dropout, deterministic, tiled", [
    (("bias",), 128, False, False, True), (("mask",), 128, False, False, True), (("bias",), 64, False, False, False),
    (("bias",), 256, False, False, False), (("mask",), 128, True, False, False), (("bias",), 128, False, "pass", False),
    (("bias", "mask"), 128, False, False, False), (("alibi",), 128, False, False, False)])
def test_bwd_sm90_score_tiles(mods, head_dim, dropout, deterministic, tiled):
    """bwd_sm90 reads a bias or mask alone as tiles at D = 128 without dropout, dQ in any order: the plain
    64-row tiles (not the featured ones), one dQ share buffer beside a score tile per stage, within
    the shared memory; anything else is refused by the plan."""
    assert kernels.bwd_sm90.takes_score_tiles(head_dim, mods, dropout, deterministic) is tiled
    kwargs = dict(score_mods=mods, dropout=dropout, deterministic=deterministic, score_tile=True)
    if not tiled:
        with pytest.raises(ValueError, match="as tiles"):
            kernels.bwd_sm90.plan("bfloat16", head_dim, **kwargs)
        return
    plan = kernels.bwd_sm90.plan("bfloat16", head_dim, **kwargs)
    defines = dict(plan.variant.defines)
    assert (defines["CUFLASH_SCORE_TILE"], defines["CUFLASH_BLOCK_M"], plan.block_m) == (1, 64, 128)
    elem = kernels.common.SCORE_TILE_BYTES[mods[0]]
    plain = kernels.bwd_sm90.bwd_sm90_smem_bytes(128, stages=defines["CUFLASH_STAGES"])
    # one of dQ's two 2 x 16 KiB share buffers gives way to a (64 rows x 128 keys) tile per stage
    assert plan.smem_bytes == plain - 2 * 64 * 64 * 4 + defines["CUFLASH_STAGES"] * 64 * 128 * elem
    assert plan.smem_bytes == defines["CUFLASH_SMEM_BYTES"] <= kernels.common.DEFAULT_SMEM_PER_BLOCK
    one_row = kernels.bwd_sm90.plan("bfloat16", head_dim, tile_one_row=True, **kwargs)   # a key mask or bias
    assert dict(one_row.variant.defines)["CUFLASH_TILE_ONE_ROW"] == 1
    assert one_row.smem_bytes == plain - 2 * 64 * 64 * 4 + defines["CUFLASH_STAGES"] * 8 * 128 * elem
    with pytest.raises(ValueError, match="score tiles"):
        kernels.backward.backward_plan("bwd_sm80", "bfloat16", head_dim, dq_pass=False, score_mods=mods,
                                       dropout=dropout, score_tile=True)


def test_plain_loop_refused_beside_other_modifiers_and_off_sm90():
    with pytest.raises(ValueError, match="ALiBi, the softcap, a bias or a mask alone"):
        kernels.fwd_sm90.plan("bfloat16", 128, score_mods=("alibi", "softcap"), dropout=False, on_plain_loop=True)
    with pytest.raises(ValueError, match="bias or mask as tiles at head dims"):
        kernels.fwd_sm90.plan("bfloat16", 256, score_mods=("bias",), dropout=False, on_plain_loop=True)
    with pytest.raises(ValueError, match="fwd_sm90's"):
        kernels.forward.forward_plan("fwd_sm80", "bfloat16", 128, score_mods=("alibi",), dropout=False,
                                     on_plain_loop=True)
