"""User modifiers in decode, without a GPU: the float64 reference's positions (the new tokens at the
end of each sequence), decode's checks of score_mod= / mask_mod=, the variant and kernel arguments a
call's modifiers become.

NVRTC compiles decode variants with a ScoreMod and a MaskMod for sm_80 and sm_90a in
tests/cpu/test_compile.py (cuflash.kernels.catalogue.user_decode_variants). The kernels against this
reference: tests/gpu/test_modifiers_decode.py.
"""

import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash._runtime.params import DECODE, Template
from cuflash.kernels.catalogue import user_decode_variants
from cuflash.kernels.decode import decode_mod_bits, decode_plan
from cuflash.modifiers import MaskMod, ScoreMod, kernel_source

RELATIVE = "score + table[q_idx - kv_idx + 64]"


def _gathered(k_cache, v_cache, lens, table, k_new, v_new, b):
    """Sequence b's keys and values: its cached rows (through the page table), then the new ones."""
    n = int(lens[b])
    if table is None:
        k, v = k_cache[b, :n], v_cache[b, :n]
    else:
        page_size = k_cache.shape[1]
        pos = np.arange(n)
        k = k_cache[table[b, pos // page_size], pos % page_size]
        v = v_cache[table[b, pos // page_size], pos % page_size]
    return np.concatenate([k, k_new[b]]), np.concatenate([v, v_new[b]])


@pytest.mark.parametrize("paged", [False, True])
def test_reference_decode_gives_modifiers_absolute_positions(paged):
    # Each sequence against attention over its gathered keys with the same modifier written as a
    # dense bias and mask over absolute positions: q_idx = i + T_b - Sq, kv_idx = j, b the sequence.
    rng = np.random.default_rng()
    B, Sq, Hq, Hk, D, cap = 3, 3, 4, 2, 16, 48
    lens = np.array([0, 17, 40])
    q = rng.standard_normal((B, Sq, Hq, D))
    k_new, v_new = rng.standard_normal((B, Sq, Hk, D)), rng.standard_normal((B, Sq, Hk, D))
    if paged:
        page_size = 5
        table = rng.permutation(B * 10)[:B * 10].reshape(B, 10)
        k_cache, v_cache = rng.standard_normal((B * 10, page_size, Hk, D)), rng.standard_normal((B * 10, page_size, Hk, D))
    else:
        table = None
        k_cache, v_cache = rng.standard_normal((B, cap, Hk, D)), rng.standard_normal((B, cap, Hk, D))
    table_bias = rng.standard_normal(129)
    per_b = np.array([0.5, -1.0, 2.0])
    score_mod = ScoreMod(RELATIVE + " + w[b] * 1.0 + 0.01 * h", table=table_bias, w=per_b)
    mask_mod = MaskMod("q_idx - kv_idx <= window || kv_idx == 0", window=9)
    out, lse = reference.decode(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, k_new=k_new,
                                v_new=v_new, score_mod=score_mod, mask_mod=mask_mod, softcap=5.0)
    for b in range(B):
        k, v = _gathered(k_cache, v_cache, lens, table, k_new, v_new, b)
        T = k.shape[0]
        qi = np.arange(Sq)[:, None] + T - Sq
        kj = np.arange(T)[None, :]
        h = np.arange(Hq)[:, None, None]
        bias = table_bias[qi - kj + 64][None] + per_b[b] + 0.01 * h
        visible = (qi - kj <= 9) | (kj == 0)
        o, l = reference.attention_forward(q[b:b + 1], k[None], v[None], causal=True, softcap=5.0,
                                           bias=bias[None], mask=np.broadcast_to(visible, (1, Hq, Sq, T)))
        np.testing.assert_allclose(out[b], o[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[b], l[0], rtol=1e-12, atol=1e-12)


def test_decode_names_a_modifier_of_the_wrong_type():
    q = np.zeros((1, 1, 2, 64), np.float16)
    with pytest.raises(TypeError, match="score_mod"):
        cuflash.decode(q, q, q, score_mod=MaskMod("kv_idx <= q_idx"))
    with pytest.raises(TypeError, match="mask_mod"):
        cuflash.decode(q, q, q, mask_mod=ScoreMod("score"))
    with pytest.raises(TypeError, match="score_mod"):
        cuflash.decode(q, q, q, score_mod="score * 2.0")


def test_decode_variants_carry_the_user_bits_and_source():
    score_mod = ScoreMod(RELATIVE, table=np.zeros(129, np.float32))
    mask_mod = MaskMod("kv_idx <= q_idx")
    source = kernel_source(score_mod, mask_mod)
    assert decode_mod_bits(("score_mod",)) == 32 and decode_mod_bits(("mask_mod", "softcap")) == 64 | 1
    # Two or more built-ins take decode's every-modifier bits (softcap, alibi, mask), the user bits beside.
    assert decode_mod_bits(("softcap", "alibi", "score_mod", "mask_mod")) == 1 | 2 | 8 | 32 | 64
    assert decode_mod_bits(True) == 1 | 2 | 8 and decode_mod_bits(32 | 1) == 33
    with pytest.raises(ValueError):
        decode_mod_bits(("bias",))
    plan = decode_plan("bfloat16", 128, paged=True, score_mods=("score_mod", "mask_mod"), user_source=source)
    assert dict(plan.variant.defines)["CUFLASH_SCORE_MODS"] == 96 and plan.variant.source == source
    other = decode_plan("bfloat16", 128, paged=True, score_mods=("score_mod", "mask_mod"),
                        user_source=kernel_source(score_mod, MaskMod("kv_idx < q_idx")))
    assert other.variant != plan.variant
    # A variant without the source of its user bits, or with a source and no bits, is refused.
    with pytest.raises(ValueError, match="generated source"):
        decode_plan("bfloat16", 128, paged=False, score_mods=("score_mod",))
    with pytest.raises(ValueError, match="generated source"):
        decode_plan("bfloat16", 128, paged=False, score_mods=("softcap",), user_source=source)


def test_the_modifiers_arguments_fill_the_decode_params_user_block():
    # decode.py writes the user::Args fields under "score." (FwdParams is DecodeParams' first member).
    template = Template(DECODE, {"score.user.size0": 129, "score.user.i0": 7, "score.user.f1": 0.5},
                        {"score.user.ptr0": 0})
    values = DECODE.unpack(template.fill([0x4000]))
    assert (values["score.user.ptr0"], values["score.user.size0"], values["score.user.i0"],
            values["score.user.f1"]) == (0x4000, 129, 7, 0.5)


def test_the_compile_sweep_has_decode_user_variants():
    variants = user_decode_variants()
    assert {dict(v.defines)["CUFLASH_PAGED"] for v in variants} == {0, 1}
    assert {dict(v.defines)["CUFLASH_DTYPE"] for v in variants} >= {1, 2}
    assert all(v.family == "decode" and v.source and dict(v.defines)["CUFLASH_SCORE_MODS"] & 96 == 96
               for v in variants)
    from cuflash.kernels.catalogue import ci_variants
    swept = {v for v, _ in ci_variants()}
    assert set(variants) <= swept
