"""A value head dim of its own (issue 53 item 2) without a GPU: the checks, the variants and their
keys, the pairs bwd_sm90 refuses, and the float64 reference (the kernels: tests/gpu/test_head_dim_v.py;
their compilation: tests/cpu/test_compile.py's sweep, cuflash.kernels.catalogue.value_head_dim_variants)."""

import numpy as np
import pytest

from cuflash import _checks, reference
from cuflash.kernels import backward as kbackward, catalogue, forward as kforward
from cuflash.kernels import bwd_sm80, bwd_sm90, bwd_simt, fwd_sm80, fwd_sm90, fwd_simt
from cuflash.kernels.common import round_up

PAIRS = ((192, 128), (128, 64), (64, 128))


def test_check_head_dim_takes_a_value_head_dim_of_its_own():
    _checks.check_head_dim(192, 192, 128, 256, own_value_dim=True)
    with pytest.raises(ValueError, match=r"value head dim .*\(192, 300\)"):
        _checks.check_head_dim(192, 192, 300, 256, own_value_dim=True)
    with pytest.raises(ValueError, match="k must have the head dim of q"):
        _checks.check_head_dim(192, 128, 128, 256, own_value_dim=True)
    # every caller that does not ask keeps its check
    with pytest.raises(ValueError, match="v must have the head dim of q"):
        _checks.check_head_dim(192, 192, 128, 256)


def test_decode_operands_take_a_value_head_dim_of_their_own_but_fp8():
    q = np.zeros((1, 1, 4, 192), np.float16)
    k, v = np.zeros((1, 8, 2, 192), np.float16), np.zeros((1, 8, 2, 128), np.float16)
    assert _checks.check_decode_operands(q, k, v, False, 256) == "float16"
    with pytest.raises(ValueError, match="but for its head dim"):
        _checks.check_decode_operands(q, k, np.zeros((1, 9, 2, 128), np.float16), False, 256)
    k8, v8 = np.zeros(k.shape, np.uint8), np.zeros(v.shape, np.uint8)
    with pytest.raises(ValueError, match=r"fp8 cache .*\(D_qk, D_v\) = \(192, 128\)"):
        _checks.check_decode_operands(q, k8, v8, False, 256, kv_dtype="float8_e4m3fn")


@pytest.mark.parametrize("d, dv", PAIRS)
def test_variant_keys_hold_the_value_head_dim(d, dv):
    for mods, dropout in ((False, False), (True, True)):
        plan = kforward.forward_plan("fwd_sm80", "bfloat16", d, score_mods=mods, dropout=dropout, head_dim_v=dv)
        defines = dict(plan.variant.defines)
        assert (defines["CUFLASH_HEAD_DIM"], defines["CUFLASH_HEAD_DIM_V"]) == (d, dv)
        assert plan.value_head_dim == dv and plan.head_dim == d
        same = kforward.forward_plan("fwd_sm80", "bfloat16", d, score_mods=mods, dropout=dropout)
        assert "CUFLASH_HEAD_DIM_V" not in dict(same.variant.defines) and same.variant != plan.variant
        # equal head dims keep the variants (and keys) they had
        assert kforward.forward_plan("fwd_sm80", "bfloat16", d, score_mods=mods, dropout=dropout,
                                     head_dim_v=d).variant == same.variant
        for dq_pass in (False, True):
            bplan = kbackward.backward_plan("bwd_sm80", "bfloat16", d, dq_pass=dq_pass, score_mods=mods,
                                            dropout=dropout, head_dim_v=dv)
            assert dict(bplan.variant.defines)["CUFLASH_HEAD_DIM_V"] == dv


def test_shared_memory_counts_v_at_its_head_dim():
    tiles = fwd_sm80.SM80_TILES[192]
    assert fwd_sm80.sm80_smem_bytes(tiles, 192, 128) == ((128 + 2 * 32) * 192 + 2 * 32 * 128) * 2
    assert fwd_sm80.sm80_smem_bytes(tiles, 192) == fwd_sm80.sm80_smem_bytes(tiles, 192, 192)
    t = fwd_simt.SIMT_TILES[192]
    assert fwd_simt.simt_smem_bytes(t, 192, 128) == (64 * 192 + 32 * (192 + 128) + 64 * 32) * 4
    bt = bwd_sm80.BWD_SM80_DKDV_TILES[192]
    assert (bwd_sm80.bwd_sm80_smem_bytes(bt, 192, False, 128)
            == 2 * (bt.block_r * 320 + 2 * bt.block_c * 320 + bt.block_r * bt.block_c) + 16 * bt.block_c)
    st = bwd_simt._bwd_simt_tiles(192)
    assert bwd_simt.bwd_simt_smem_bytes(st, 192, True, 192) == bwd_simt.bwd_simt_smem_bytes(st, 192, True)


def test_tiles_are_those_of_the_larger_head_dim():
    plan = fwd_sm80.plan("float16", 64, score_mods=False, dropout=False, head_dim_v=128)
    defines = dict(plan.variant.defines)
    tiles = fwd_sm80.SM80_TILES[128]
    assert (defines["CUFLASH_BLOCK_N"], defines["CUFLASH_WARPS"]) == (tiles.block_n, tiles.warps)


def test_simt_runs_any_pair():
    for d, dv in ((8, 256), (256, 8), (40, 200), (96, 64)):
        plan = fwd_simt.plan("float32", d, score_mods=False, dropout=False, head_dim_v=dv)
        defines = dict(plan.variant.defines)
        assert defines["CUFLASH_HEAD_DIM"] >= d and defines.get("CUFLASH_HEAD_DIM_V", defines["CUFLASH_HEAD_DIM"]) >= dv
        bwd_simt.plan("float32", d, dq_pass=False, score_mods=False, dropout=False, head_dim_v=dv)


@pytest.mark.parametrize("d, dv", PAIRS + ((256, 64), (64, 256)))
def test_fwd_sm90_compiles_v_at_its_own_head_dim(d, dv):
    """fwd_sm90 takes every pair up to 256: Q/K and V/O at their own compiled head dims (the define only
    where they differ), the key tile of the wider one and as many stages as fit."""
    assert fwd_sm90.value_head_dim_obstacle(d, dv) is None
    for mods, dropout in ((False, False), (True, True)):
        plan = kforward.forward_plan("fwd_sm90", "bfloat16", d, score_mods=mods, dropout=dropout, head_dim_v=dv)
        defines = dict(plan.variant.defines)
        kdim, kdim_v = fwd_sm90.pair_head_dims(d, dv)
        assert (defines["CUFLASH_HEAD_DIM"], defines["CUFLASH_HEAD_DIM_V"]) == (kdim, kdim_v)
        assert defines["CUFLASH_BLOCK_N"] <= min(fwd_sm90._tiles_of(kdim)[0], fwd_sm90.SM90_BLOCK_N[kdim_v])
        smem = fwd_sm90.sm90_smem_bytes(kdim, 2, defines["CUFLASH_BLOCK_N"], kdim_v, defines["CUFLASH_STAGES"])
        assert plan.smem_bytes == defines["CUFLASH_SMEM_BYTES"] == smem <= fwd_sm90.DEFAULT_SMEM_PER_BLOCK
        # (192, 128) with modifiers or dropout keeps 64-key tiles and their three stages.
        top = fwd_sm90.SM90_TILES_192_64[1] if kdim == 192 and (mods or dropout) else fwd_sm90._tiles_of(kdim)[2]
        assert 2 <= defines["CUFLASH_STAGES"] <= top
    same = kforward.forward_plan("fwd_sm90", "bfloat16", d, score_mods=False, dropout=False, head_dim_v=d)
    assert "CUFLASH_HEAD_DIM_V" not in dict(same.variant.defines)
    with pytest.raises(ValueError, match="3 at head dims"):
        fwd_sm90.plan("bfloat16", d, score_mods=False, dropout=False, consumers=3, head_dim_v=dv)


@pytest.mark.parametrize("options, tiles", [(dict(score_mods=(), dropout=False), (96, 2)),
                                            (dict(score_mods=("softcap",), dropout=False), (96, 2)),
                                            (dict(score_mods=(), dropout=True), (64, 3)),
                                            (dict(score_mods=("alibi",), dropout=False), (64, 3)),
                                            (dict(score_mods=("block_mask",), dropout=False), (64, 3)),
                                            (dict(score_mods=(), dropout=False, kv_cache="row_groups"), (64, 3))])
def test_fwd_sm90_tiles_at_192_128(options, tiles):
    """(192, 128) takes 96-key tiles and two stages without modifiers or with the softcap alone; with
    the others, dropout or a KV cache (whose boxes go out one a lane: 36 at 96 keys), 64 and three."""
    plan = fwd_sm90.plan("bfloat16", 192, head_dim_v=128, **options)
    defines = dict(plan.variant.defines)
    assert (defines["CUFLASH_BLOCK_N"], defines["CUFLASH_STAGES"]) == tiles
    assert defines["CUFLASH_SMEM_BYTES"] <= fwd_sm90.DEFAULT_SMEM_PER_BLOCK


@pytest.mark.parametrize("d, dv, compiled", [(192, 128, (192, 128)), (136, 128, (192, 128)), (192, 64, (256, 64)),
                                             (192, 192, (256, 256)), (192, 256, (256, 256)), (200, 128, (256, 128)),
                                             (64, 128, (64, 128))])
def test_fwd_sm90_compiles_q_and_k_at_192_beside_a_v_of_128(d, dv, compiled):
    """DeepSeek's (192, 128) runs S = Q K^T over 192 columns, not 256; a square 192, or one beside another
    V, still rounds up to 256 (the square output's staging takes 128 columns a pass)."""
    assert fwd_sm90.pair_head_dims(d, dv) == compiled
    plan = fwd_sm90.plan("bfloat16", d, score_mods=False, dropout=False, head_dim_v=dv)
    defines = dict(plan.variant.defines)
    assert (defines["CUFLASH_HEAD_DIM"], defines.get("CUFLASH_HEAD_DIM_V", defines["CUFLASH_HEAD_DIM"])) == compiled


def test_a_hopper_routes_pairs_to_fwd_sm90(monkeypatch):
    """Unforced forwards of a pair run on fwd_sm90 on a Hopper, as square calls do; forcing fwd_sm80
    keeps them there."""
    import types

    from cuflash import _forward_plan

    monkeypatch.setattr(_forward_plan, "device_arch", lambda: "sm_90a")

    def layout(d):   # what TMA can read: contiguous, a 16-byte aligned base
        shape = (1, 64, 2, d)
        strides = tuple(int(2 * np.prod(shape[i + 1:])) for i in range(4))
        return types.SimpleNamespace(shape=shape, strides=strides, itemsize=2, data=types.SimpleNamespace(ptr=256))

    q, k, v = layout(192), layout(192), layout(128)
    assert _forward_plan._choose_family("bfloat16", q, k, layout(192)) == "fwd_sm90"
    assert _forward_plan._choose_family("bfloat16", q, k, v) == "fwd_sm90"
    token = _forward_plan._forced_family.set("fwd_sm80")
    try:
        assert _forward_plan._choose_family("bfloat16", q, k, v) == "fwd_sm80"
    finally:
        _forward_plan._forced_family.reset(token)


def test_fwd_sm90_refuses_head_dims_past_256():
    assert "(64, 512)" in fwd_sm90.value_head_dim_obstacle(64, 512)
    with pytest.raises(ValueError, match=r"\(64, 512\)"):
        fwd_sm90.plan("bfloat16", 64, score_mods=False, dropout=False, head_dim_v=512)


@pytest.mark.parametrize("d, dv", PAIRS + ((96, 64), (40, 128)))
def test_bwd_sm90_runs_the_pairs_plain(d, dv):
    """Each pair (and any that rounds up to one) compiles with V's own head dim and tiles that fit."""
    assert bwd_sm90.bwd_sm90_obstacle(d, (), False, dv) is None
    for det in (False, "pass"):
        plan = kbackward.backward_plan("bwd_sm90", "bfloat16", d, dq_pass=False, score_mods=False, dropout=False,
                                       deterministic=det, windowed=False, seqlen_q=16384, all_keys_seen=True,
                                       head_dim_v=dv)
        defines = dict(plan.variant.defines)
        kdim, kdim_v = bwd_sm90.compiled_head_dims(d, dv)
        assert (defines["CUFLASH_HEAD_DIM"], defines["CUFLASH_HEAD_DIM_V"]) == (kdim, kdim_v)
        assert defines["CUFLASH_BLOCK_M"] == 64   # no pair takes 80-row steps
        assert plan.smem_bytes == defines["CUFLASH_SMEM_BYTES"] <= 227 * 1024


@pytest.mark.parametrize("d, dv, mods", [(128, 64, ("bias",)), (128, 64, ("softcap", "alibi")), (64, 128, ("softcap",)),
                                         (64, 256, ()), (256, 64, ()), (128, 256, ())])
def test_bwd_sm90_refuses_other_pairs_by_name(d, dv, mods):
    assert f"({d}, {dv})" in bwd_sm90.bwd_sm90_obstacle(d, mods, False, dv)
    assert bwd_sm90.bwd_sm90_obstacle(d, mods, False, d) is None
    with pytest.raises(ValueError, match=rf"\({d}, {dv}\).*bwd_sm80"):
        kbackward.backward_plan("bwd_sm90", "bfloat16", d, dq_pass=False, score_mods=mods, dropout=False,
                                deterministic=False, head_dim_v=dv)


def test_bwd_sm90_shared_memory_of_the_pairs():
    """(256, 128): K 64 x 256, V 64 x 128, two stages of Q (64 x 256) and dO (64 x 128), P^T and dS^T,
    and consumer 1's dQ share (64 x 128 float32) in a buffer of its own (dO's is too small). (192, 128):
    consumer 0's two shares (64 x 128 float32) do not fit Q's 64 x 192 and take the buffer instead, and
    the ring has three stages."""
    assert bwd_sm90.bwd_sm90_smem_bytes(256, head_dim_v=128) == 1024 + 2 * (
        64 * 384 + 2 * 64 * 384 + 2 * 64 * 64) + 4 * 64 * 128
    assert bwd_sm90.bwd_sm90_smem_bytes(192, head_dim_v=128) == 1024 + 2 * (
        64 * 320 + 3 * 64 * 320 + 2 * 64 * 64) + 4 * 64 * 128   # three stages: consume_dim_pipelined
    assert bwd_sm90.bwd_sm90_smem_bytes(256, head_dim_v=256) == bwd_sm90.bwd_sm90_smem_bytes(256)


@pytest.mark.parametrize("d, dv, compiled", [(192, 128, (192, 128)), (136, 128, (192, 128)), (200, 128, (256, 128)),
                                             (192, 64, (256, 64)), (192, 192, (256, 256))])
def test_bwd_sm90_compiles_q_and_k_at_192_beside_a_v_of_128(d, dv, compiled):
    """DeepSeek's (192, 128) is compiled as it is (the consumers split dK's and dQ's three column blocks
    two and one, dV's to the second: split_dk_cols); elsewhere 192 rounds up to 256."""
    assert bwd_sm90.compiled_head_dims(d, dv) == compiled
    assert [bwd_sm90.split_dk_cols(192, c) for c in (0, 1)] == [128, 64]
    assert [bwd_sm90.split_dk_cols(256, c) for c in (0, 1)] == [128, 128]


def test_backward_routes_the_pairs(monkeypatch):
    from cuflash import _backward_plan

    monkeypatch.setattr(_backward_plan, "device_arch", lambda: "sm_90a")
    monkeypatch.setattr(_backward_plan._tma, "tma_compatible", lambda x: True)
    layouts = {name: _checks.Shaped((1, 128, 2, 64), np.float16) for name in ("q", "k", "v", "dout")}
    assert _backward_plan._choose_family("float16", None, 192, (), False, layouts, 128) == "bwd_sm90"
    assert _backward_plan._choose_family("float16", None, 192, ("softcap",), True, layouts, 128) == "bwd_sm90"
    assert _backward_plan._choose_family("float16", None, 128, ("softcap",), False, layouts, 64) == "bwd_sm90"
    assert _backward_plan._choose_family("float16", None, 128, ("bias",), False, layouts, 64) == "bwd_sm80"
    with pytest.raises(ValueError, match=r"bwd_sm90 cannot run this call: .*\(128, 64\)"):
        _backward_plan._choose_family("float16", "bwd_sm90", 128, ("softcap",), True, layouts, 64)


def test_catalogue_compiles_the_pairs():
    variants = catalogue.value_head_dim_variants()
    pairs = {(v.family, dict(v.defines)["CUFLASH_HEAD_DIM"], dict(v.defines)["CUFLASH_HEAD_DIM_V"]) for v in variants}
    for d, dv in PAIRS:
        assert {("fwd_sm80", d, dv), ("bwd_sm80", d, dv)} <= pairs
        assert ("fwd_sm90", *fwd_sm90.pair_head_dims(d, dv)) in pairs
        assert ("bwd_sm90", *bwd_sm90.compiled_head_dims(d, dv)) in pairs
    assert ("fwd_simt", 192, 128) in pairs and ("bwd_simt", 192, 128) in pairs
    ci = {v for v, arch in catalogue.ci_variants()}
    assert set(variants) <= ci
    assert set(variants) <= set(catalogue.reachable_variants("sm_90a"))


@pytest.mark.parametrize("d, dv", PAIRS + ((40, 24),))
def test_reference_takes_a_value_head_dim_of_its_own(d, dv):
    rng = np.random.default_rng(d * 1000 + dv)
    B, Sq, Sk, Hq, Hk = 2, 5, 7, 4, 2
    q = rng.standard_normal((B, Sq, Hq, d))
    k = rng.standard_normal((B, Sk, Hk, d))
    v = rng.standard_normal((B, Sk, Hk, dv))
    out, lse = reference.attention_forward(q, k, v, causal=True)
    assert out.shape == (B, Sq, Hq, dv) and lse.shape == (B, Hq, Sq)
    # the textbook formula, default scale 1/sqrt(D_qk)
    kk, vv = np.repeat(k, Hq // Hk, axis=2), np.repeat(v, Hq // Hk, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, kk) / np.sqrt(d)
    s = np.where(np.arange(Sk)[None, :] <= np.arange(Sq)[:, None] + Sk - Sq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, np.einsum("bhij,bjhd->bihd", p, vv), rtol=1e-12, atol=1e-12)
    # gradients against central differences of sum(out * dout)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv_ = reference.attention_backward(dout, q, k, v, causal=True)
    assert (dq.shape, dk.shape, dv_.shape) == (q.shape, k.shape, v.shape)
    eps = 1e-6
    for x, g in ((q, dq), (k, dk), (v, dv_)):
        idx = tuple(rng.integers(0, n) for n in x.shape)
        old = x[idx]
        x[idx] = old + eps
        up = np.sum(reference.attention_forward(q, k, v, causal=True)[0] * dout)
        x[idx] = old - eps
        down = np.sum(reference.attention_forward(q, k, v, causal=True)[0] * dout)
        x[idx] = old
        assert abs((up - down) / (2 * eps) - g[idx]) < 1e-6


def test_reference_varlen_takes_a_value_head_dim_of_its_own():
    rng = np.random.default_rng(7)
    cu_q, cu_k = np.array([0, 3, 8]), np.array([0, 4, 6])
    q, k, v = rng.standard_normal((8, 2, 64)), rng.standard_normal((6, 1, 64)), rng.standard_normal((6, 1, 128))
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert out.shape == (8, 2, 128)
    dq, dk, dv = reference.attention_varlen_backward(rng.standard_normal(out.shape), q, k, v, cu_q, cu_k, causal=True)
    assert dv.shape == v.shape and dk.shape == k.shape


@pytest.mark.parametrize("mods", [("softcap",), ("alibi",), ("block_mask",)])
def test_bwd_sm90_runs_128_64_with_one_in_place_modifier(mods):
    """(128, 64) beside the softcap, ALiBi or the block mask alone: bwd_sm90's plain tiles, as the square
    D = 128 takes them (bwd_sm90_featured)."""
    assert bwd_sm90.bwd_sm90_obstacle(128, mods, False, 64) is None
    assert "(128, 64)" in bwd_sm90.bwd_sm90_obstacle(128, mods, True, 64)   # dropout: featured tiles
    plan = kbackward.backward_plan("bwd_sm90", "bfloat16", 128, dq_pass=False, score_mods=mods, dropout=False,
                                   deterministic=False, head_dim_v=64)
    defines = dict(plan.variant.defines)
    assert (defines["CUFLASH_HEAD_DIM"], defines["CUFLASH_HEAD_DIM_V"]) == (128, 64)
    assert plan.block_m == bwd_sm90.BWD_SM90_BLOCK_N[128]   # (its block_m: the plain tiles' keys per CTA)
