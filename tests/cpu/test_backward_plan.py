"""The backward's host side without a GPU: launch plans, parameter packing, GQA split heuristic,
and NVRTC compilation of the kernels that carry the performance bar (zero spills).

Every backward variant is compiled for sm_80 and sm_90a by tests/cpu/test_compile.py once
cuflash.kernels.catalogue.precompile_variants() includes precompile_backward_variants().
"""

import types

import numpy as np
import pytest

from cuflash import kernels
from cuflash._build import compile as _compile
from cuflash._runtime import launch as _launch, params as _params
from cuflash.kernels.bwd_common import BWD_ROW_PAD
from cuflash.kernels.bwd_common import backward_heads_per_cta
from cuflash.kernels.backward import backward_plan
from cuflash.kernels.backward import precompile_backward_variants


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [8, 64, 72, 128, 136, 192, 256])
@pytest.mark.parametrize("dq_pass", [False, True])
@pytest.mark.parametrize("featured", [False, True])
def test_sm80_plans(dtype, head_dim, dq_pass, featured):
    plan = backward_plan("bwd_sm80", dtype, head_dim, dq_pass=dq_pass, score_mods=featured, dropout=featured)
    defines = dict(plan.variant.defines)
    assert plan.variant.family == "bwd_sm80"
    assert plan.head_dim >= head_dim and plan.head_dim % 64 == 0
    assert defines["CUFLASH_BWD_PASS"] == int(dq_pass)
    assert defines["CUFLASH_SMEM_BYTES"] == plan.smem_bytes <= 227 * 1024
    assert plan.threads == 32 * defines["CUFLASH_WARPS"]
    # Each warp row owns 16 kept rows; the padded lse2/D rows cover whole tiles of both passes.
    assert plan.block_m == 16 * defines["CUFLASH_WARPS"] // defines["CUFLASH_DSPLIT"]
    assert BWD_ROW_PAD % plan.block_m == 0 and BWD_ROW_PAD % defines["CUFLASH_BLOCK_C"] == 0
    if not dq_pass:
        assert defines["CUFLASH_BLOCK_C"] in (64, 128)   # the dS^T swizzle


@pytest.mark.parametrize("head_dim", [8, 32, 40, 128, 160, 192, 256])
def test_simt_plans(head_dim):
    for dq_pass in (False, True):
        plan = backward_plan("bwd_simt", "float32", head_dim, dq_pass=dq_pass, score_mods=True, dropout=False)
        assert plan.head_dim % 32 == 0 and plan.head_dim >= head_dim
        assert plan.threads == 128 and BWD_ROW_PAD % plan.block_m == 0
        assert dict(plan.variant.defines)["CUFLASH_SMEM_BYTES"] == plan.smem_bytes


def test_bwd_sm90_takes_fewer_than_its_head_limit(monkeypatch):
    """bwd_sm90's tile word holds the query head in 14 bits: from BWD_SM90_MAX_HEADS query heads the
    backward runs on bwd_sm80, and forcing bwd_sm90 names the limit."""
    from cuflash import _backward_plan

    monkeypatch.setattr(_backward_plan, "device_arch", lambda: "sm_90a")
    limit = kernels.bwd_sm90.BWD_SM90_MAX_HEADS

    def layouts(heads):   # a layout TMA can read: contiguous, a 16-byte aligned base
        shape = (1, 64, heads, 64)
        strides = tuple(int(2 * np.prod(shape[i + 1:])) for i in range(4))
        x = types.SimpleNamespace(shape=shape, strides=strides, itemsize=2, data=types.SimpleNamespace(ptr=256))
        return {name: x for name in ("q", "k", "v", "dout")}

    assert _backward_plan._choose_family("float16", None, 64, (), False, layouts(limit - 1)) == "bwd_sm90"
    assert _backward_plan._choose_family("float16", None, 64, (), False, layouts(limit)) == "bwd_sm80"
    with pytest.raises(ValueError, match=f"fewer than {limit} query heads"):
        _backward_plan._choose_family("float16", "bwd_sm90", 64, (), False, layouts(limit))


def test_wrong_family_for_dtype():
    with pytest.raises(ValueError):
        backward_plan("bwd_sm80", "float32", 64, dq_pass=False, score_mods=False, dropout=False)
    with pytest.raises(ValueError):
        backward_plan("bwd_simt", "bfloat16", 64, dq_pass=False, score_mods=False, dropout=False)
    with pytest.raises(ValueError):
        backward_plan("bwd_nope", "bfloat16", 64, dq_pass=False, score_mods=False, dropout=False)


@pytest.mark.parametrize("batch, heads_k, group, key_blocks, sms", [
    (2, 16, 1, 64, 132), (1, 1, 8, 1, 132), (2, 2, 4, 8, 132), (4, 8, 4, 64, 132), (1, 2, 6, 3, 132),
    (1, 1, 32, 2, 132), (3, 1, 1, 1, 132)])
def test_heads_per_cta(batch, heads_k, group, key_blocks, sms):
    hpc = backward_heads_per_cta(batch, heads_k, group, key_blocks, sms)
    assert 1 <= hpc <= group and group % hpc == 0
    ctas, splits = batch * heads_k * key_blocks, group // hpc
    if hpc == group:   # the whole group in one CTA unless that leaves SMs idle
        assert ctas >= sms or group == 1
    else:              # the fewest splits that fill the GPU (or one head per CTA)
        assert ctas < sms and (ctas * splits >= sms or hpc == 1)
        assert all(ctas * d < sms for d in range(1, splits) if group % d == 0)


def test_param_structs_pack():
    assert _params.BWD_PARAMS.itemsize == _params.FWD_PARAMS.itemsize + 14 * 8 + 18 * 8 + 6 * 4
    raw = _params.BWD.pack({"fwd.q": 1, "fwd.scale": 0.5, "fwd.heads_q": 8, "dout": 2, "seqlen_q_pad": 256,
                            "heads_per_cta": 4, "tail_pairs": 5, "dq_tail_pairs": 6})
    p = np.frombuffer(raw, dtype=_params.BWD_PARAMS)[0]
    assert p["fwd"]["q"] == 1 and p["fwd"]["scale"] == np.float32(0.5) and p["fwd"]["heads_q"] == 8
    assert p["fwd"]["dropout_rescale"] == 1.0 and p["dout"] == 2 and p["heads_per_cta"] == 4
    assert p["tail_pairs"] == 5 and p["dq_tail_pairs"] == 6 and p["dqa_tile_rows"] == 0
    c = np.frombuffer(_params.CONVERT.pack({"rows": 3, "scale": 2.0}), dtype=_params.CONVERT_PARAMS)[0]
    assert c["rows"] == 3 and c["num_partials"] == 1 and c["scale"] == 2.0


def test_dropout_origin_fields():
    # replace FwdParams' old pad_: 8-byte fields, then 4-byte ones (tail_heads ends it at an 8-byte size)
    offsets = _params.FWD.offsets
    assert offsets["dropout_row0"] == offsets["dropout_rescale"] + 4
    assert offsets["dropout_col0"] == offsets["dropout_row0"] + 4
    assert offsets["tail_heads"] == offsets["dropout_col0"] + 4
    # then fwd_sm90's KV-cache fields, then the work order's strides, the last
    assert (offsets["kv_box_rows"] == offsets["page_size"] + 4 == offsets["seqlen_k_new"] + 8
            == offsets["tail_heads"] + 12)
    assert offsets["work_order_head_stride"] == offsets["work_order_batch_stride"] + 4 == offsets["kv_box_rows"] + 8
    assert _params.FWD.size == -(-(offsets["work_order_head_stride"] + 4) // 8) * 8   # padded to its 8-byte alignment
    assert _params.FWD.size % 8 == 0
    p = _params.FWD.unpack(_params.FWD.pack({"dropout_row0": 12, "dropout_col0": 8}))
    assert (p["dropout_row0"], p["dropout_col0"]) == (12, 8)
    assert _params.FWD.unpack(_params.FWD.pack({}))["dropout_col0"] == 0
    from cuflash import _checks
    assert _checks.check_dropout_origin((5, 8), (10, 10)) == {"dropout_row0": 5, "dropout_col0": 8}
    with pytest.raises(ValueError, match="col0 = 6 must be a multiple of 4"):
        _checks.check_dropout_origin((0, 6), (10, 10))
    with pytest.raises(ValueError, match="row0 = -1"):
        _checks.check_dropout_origin((-1, 0), (10, 10))
    with pytest.raises(TypeError, match="pair"):
        _checks.check_dropout_origin(3, (10, 10))
    with pytest.raises(TypeError, match="col0 must be an int"):
        _checks.check_dropout_origin((0, 4.0), (10, 10))


def test_precompile_list():
    variants = precompile_backward_variants()
    families = {v.family for v in variants}
    assert families == {"bwd_preprocess", "bwd_convert", "bwd_dsinks", "bwd_sm80", "bwd_sm90", "bwd_simt"}
    assert "bwd_sm90" not in {v.family for v in precompile_backward_variants(arch="sm_80")}
    assert len(variants) == len(set(variants))
    for v in variants:
        defines = dict(v.defines)
        assert defines["CUFLASH_BWD_PARAMS_SIZE"] == _params.BWD_PARAMS.itemsize


def _nvrtc_available():
    try:
        from cuflash._build import nvrtc as _nvrtc
        _nvrtc.version()
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _nvrtc_available(), reason="libnvrtc not found")
@pytest.mark.parametrize("family, dtype, head_dim", [("bwd_sm80", "bfloat16", 128), ("bwd_simt", "float32", 64)])
def test_bar_kernels_compile_without_spills(family, dtype, head_dim):
    jobs = [(backward_plan(family, dtype, head_dim, dq_pass=dq, score_mods=False, dropout=False).variant, "sm_90a")
            for dq in (False, True)]
    jobs += [(kernels.bwd_common.bwd_preprocess_variant(dtype), "sm_90a"), (kernels.bwd_common.bwd_convert_variant(dtype), "sm_90a")]
    for variant, arch, result in _compile.compile_many(jobs):
        assert not isinstance(result, Exception), result
        assert result.spills == 0, f"{variant.label()}: {result.spill_stores}/{result.spill_loads} bytes spilled"
        print(f"{variant.family} {arch} regs={result.registers} {variant.label()}")


@pytest.mark.parametrize("seqlen, window, steps", [
    (1024, (-1, 0), 4.5), (4096, (-1, 0), 16.5), (1024, (-1, -1), 8.0), (8192, (1024, 0), 8.4375), (0, (-1, 0), 0.0)])
def test_mean_walk_steps(seqlen, window, steps):
    assert kernels.bwd_sm90.mean_walk_steps(seqlen, seqlen, window, 128, 128) == pytest.approx(steps)


def test_dq_first_stores_rule():
    rule = kernels.bwd_sm90.bwd_sm90_first_stores_dq
    plain = dict(score_mods=(), dropout=False, deterministic=False, varlen=False)
    assert rule(**plain, seqlen_q=1024, seqlen_k=1024, window=(-1, 0))
    assert rule(**plain, seqlen_q=777, seqlen_k=777, window=(300, 0))
    assert not rule(**plain, seqlen_q=777, seqlen_k=777, window=(-1, -1))   # blocks reach each tile together
    assert rule(**{**plain, "score_mods": ("softcap",)}, seqlen_q=2048, seqlen_k=2048, window=(1024, 0))
    assert not rule(**plain, seqlen_q=4096, seqlen_k=4096, window=(-1, 0))   # long walks: zeroed
    assert not rule(**plain, seqlen_q=512, seqlen_k=1024, window=(-1, 0))   # rows that see no key
    for other in (dict(score_mods=("block_mask",)), dict(dropout=True), dict(deterministic=True),
                  dict(deterministic="pass"), dict(varlen=True)):
        assert not rule(**{**plain, **other}, seqlen_q=1024, seqlen_k=1024, window=(-1, 0)), other
    # The variant stores first only where its dQ goes through writers: D = 128 on the plain 64-row tiles.
    def defines(head_dim, **kw):
        launch = kernels.bwd_sm90.plan("bfloat16", head_dim, score_mods=kw.pop("score_mods", ()), dropout=False,
                                       deterministic=False, dq_first_stores=True, **kw)
        return dict(launch.variant.defines)
    assert defines(128)["CUFLASH_BWD_DQ_FIRST_STORES"] == 1
    assert defines(128, score_mods=("softcap",))["CUFLASH_BWD_DQ_FIRST_STORES"] == 1
    assert "CUFLASH_BWD_DQ_FIRST_STORES" not in defines(64)
    assert "CUFLASH_BWD_DQ_FIRST_STORES" not in defines(256)
    assert "CUFLASH_BWD_DQ_FIRST_STORES" not in defines(128, windowed=False, seqlen_q=1 << 14)   # 80-row steps
    assert "CUFLASH_BWD_DQ_FIRST_STORES" not in defines(128, score_mods=("softcap", "alibi"))   # featured
    preprocess = dict(kernels.bwd_common.bwd_preprocess_variant("bfloat16", dq_first_stores=True).defines)
    assert preprocess["CUFLASH_DQ_FIRST_STORES"] == 1


def test_persistent_ctas_rule():
    rule = kernels.bwd_sm90.bwd_sm90_persistent
    plain = dict(score_mods=(), dropout=False, deterministic=False, varlen=False)
    assert rule(64, **plain)                                                  # the variant exists
    assert rule(64, **plain, seqlen_q=1024, seqlen_k=1024, window=(-1, 0))    # short causal walks
    assert rule(64, **plain, seqlen_q=8192, seqlen_k=8192, window=(1024, 0))
    assert not rule(64, **plain, seqlen_q=8192, seqlen_k=8192, window=(-1, 0))   # long ones
    assert not rule(64, **plain, seqlen_q=1024, seqlen_k=1024, window=(-1, 0), heads_per_cta=4)
    assert not rule(64, **plain, seqlen_q=1024, seqlen_k=1024, window=(-1, -1))  # no mask: the unguarded tiles
    for other in (dict(score_mods=("softcap",)), dict(dropout=True), dict(deterministic=True), dict(varlen=True)):
        assert not rule(64, **{**plain, **other}, seqlen_q=1024, seqlen_k=1024, window=(-1, 0)), other
    assert not rule(128, **plain, seqlen_q=1024, seqlen_k=1024, window=(-1, 0))
    variant = kernels.bwd_sm90.plan("bfloat16", 64, score_mods=(), dropout=False, deterministic=False, persistent=True)
    defines = dict(variant.variant.defines)
    assert defines["CUFLASH_BWD_PERSISTENT"] == 1 and "CUFLASH_TILE_GUARD" not in defines
    with pytest.raises(ValueError, match="persistent"):
        kernels.bwd_sm90.plan("bfloat16", 128, score_mods=(), dropout=False, deterministic=False, persistent=True)
