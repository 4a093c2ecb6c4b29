"""User modifiers on the kernels' side, without a GPU: the entry points' checks of score_mod= and
mask_mod=, the kernel arguments a call's modifiers become, the variants they compile (keyed by the
expression), and the varlen reference that the GPU tests compare against.

NVRTC compiles each family's variant with a ScoreMod and a MaskMod for sm_80 and sm_90a in
tests/cpu/test_compile.py (cuflash.kernels.catalogue.user_variants).
"""

import numpy as np
import pytest

import cuflash
from cuflash import _scores, reference
from cuflash._build.compile import cache_path, nvrtc_options
from cuflash._runtime.params import FWD, Template
from cuflash.kernels.backward import backward_plan
from cuflash.kernels.catalogue import user_variants
from cuflash.kernels.forward import forward_plan
from cuflash.modifiers import MaskMod, ScoreMod, kernel_source

RELATIVE = "score + table[h * n + abs(q_idx - kv_idx)]"
DOCUMENT = "doc[b * S + q_idx] == doc[b * S + kv_idx]"


def _host(shape, dtype=np.float16, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("fn", ["attention", "attention_forward", "attention_varlen", "attention_backward",
                                "attention_varlen_backward"])
@pytest.mark.parametrize("keyword, value", [("score_mod", "score * 2.0"), ("mask_mod", ScoreMod("score")),
                                            ("score_mod", MaskMod("kv_idx <= q_idx"))])
def test_entry_points_name_a_modifier_of_the_wrong_type(fn, keyword, value):
    q = k = v = _host((2, 8, 2, 64))
    args = (q, k, v)
    if fn.startswith("attention_varlen"):
        q = k = v = q.reshape(16, 2, 64)
        cu = np.array([0, 8, 16], dtype=np.int32)
        args = (q, q, k, v, q, np.zeros((2, 16), np.float32), cu, cu) if fn.endswith("backward") else (q, k, v, cu, cu)
    elif fn == "attention_backward":
        args = (q, q, k, v, q, np.zeros((2, 2, 8), np.float32))
    with pytest.raises(TypeError, match=keyword):
        getattr(cuflash, fn)(*args, **{keyword: value})


def test_an_array_argument_must_be_a_cuda_array():
    mod = ScoreMod(RELATIVE, table=np.zeros(8, np.float32), n=2)
    with pytest.raises(TypeError, match=r"score_mod argument table.*CUDA"):
        _scores.user_operands(mod, None, first=9)
    with pytest.raises(TypeError, match=r"mask_mod argument doc.*CUDA"):
        _scores.user_operands(None, MaskMod(DOCUMENT, doc=np.zeros(4, np.int32), S=2), first=9)


def test_the_backward_needs_the_grad_of_a_score_mod_that_is_not_additive():
    capped = ScoreMod("c * tanh(score / c)", c=30.0)
    assert kernel_source(capped, None)   # the forward needs no grad
    with pytest.raises(ValueError, match="grad="):
        _scores.user_operands(capped, None, first=13, backward=True)
    source = kernel_source(ScoreMod("score + 1.0"), None, backward=True)
    assert "user_score_mod_grad" in source   # derivative 1: no grad needed, 1 is written


def test_scalar_arguments_are_kernel_fields_and_must_fit_float32():
    fields, arrays, names, source = _scores.user_operands(
        ScoreMod("score * g + where(flag, 1.0, 0.0) * floor_div(i, 2)", g=0.5, i=3, flag=True), None, first=9)
    assert arrays == () and names == ("score_mod",)
    # One slot number per scalar, in the order given: g is f[0], i is i[1], flag i[2] (bools are ints).
    assert fields == {"user.f0": 0.5, "user.i1": 3, "user.i2": 1}
    assert "args.f[0]" in source
    with pytest.raises(ValueError, match="float32"):
        _scores.user_operands(ScoreMod("score * g", g=1e300), None, first=9)
    # Both modifiers share 8 array and 8 scalar slots.
    nine = {f"s{k}": k for k in range(5)}
    with pytest.raises(ValueError, match="at most 8"):
        _scores.user_operands(ScoreMod("score", **nine), MaskMod("b >= 0", **{f"m{k}": k for k in range(4)}), first=9)


def test_the_mask_arguments_follow_the_score_arguments_in_one_block():
    score_mod = ScoreMod(RELATIVE, table=np.zeros(8, np.float32), n=2)
    mask_mod = MaskMod(DOCUMENT, doc=np.zeros(8, np.int32), S=4)
    source = kernel_source(score_mod, mask_mod)
    assert "read_f32(args, 0," in source and "args.i[0]" in source   # the ScoreMod's table and n
    assert "read_int<int>(args, 1," in source and "args.i[1]" in source   # the MaskMod's doc and S
    # Pointer slots: array k is operand first + k, written per call like every operand's pointer.
    template = Template(FWD, {"user.size0": 8, "user.size1": 8, "user.i0": 2, "user.i1": 4},
                        {"user.ptr0": 0, "user.ptr1": 1})
    values = FWD.unpack(template.fill([0x1000, 0x2000]))
    assert (values["user.ptr0"], values["user.ptr1"], values["user.size1"], values["user.i1"]) == (0x1000, 0x2000, 8, 4)


def test_each_expression_compiles_its_own_variant_and_equal_ones_share_it():
    def variant(mod, family="fwd_sm80", backward=False):
        names = ("score_mod",) if isinstance(mod, ScoreMod) else ("mask_mod",)
        pair = (mod, None) if isinstance(mod, ScoreMod) else (None, mod)
        source = kernel_source(*pair, backward=backward)
        if backward:
            return backward_plan(family, "bfloat16", 64, dq_pass=False, score_mods=names, dropout=False,
                                 user_source=source).variant
        return forward_plan(family, "bfloat16", 64, score_mods=names, dropout=False, user_source=source).variant

    table = np.zeros(8, np.float32)
    a, b = variant(ScoreMod(RELATIVE, table=table, n=2)), variant(ScoreMod(RELATIVE, table=table, n=5))
    assert a == b and hash(a) == hash(b)   # scalars are read at run time
    c = variant(ScoreMod("score - table[h * n + abs(q_idx - kv_idx)]", table=table, n=2))
    d = variant(ScoreMod(RELATIVE, table=table.astype(np.float16), n=2))   # another dtype reads otherwise
    assert len({a, c, d}) == 3
    paths = {cache_path("/c", v, "sm_80", "0" * 16) for v in (a, c, d)}
    assert len(paths) == 3
    assert any(o.startswith("-DCUFLASH_USER_SOURCE=0x") for o in nvrtc_options(a, "sm_80", "0" * 16))
    assert variant(MaskMod("kv_idx <= q_idx")) != variant(MaskMod("kv_idx < q_idx"))
    assert variant(MaskMod("kv_idx <= q_idx"), "bwd_sm80", True) == variant(MaskMod("kv_idx <= q_idx"), "bwd_sm80", True)
    # A variant without the source of its user bits, or with a source and no bits, is refused.
    with pytest.raises(ValueError, match="generated source"):
        forward_plan("fwd_simt", "float32", 64, score_mods=("score_mod",), dropout=False)
    with pytest.raises(ValueError, match="generated source"):
        forward_plan("fwd_simt", "float32", 64, score_mods=(), dropout=False, user_source="x")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_compile_sweep_has_a_user_variant_of_every_family(arch):
    families = {v.family for v in user_variants(arch)}
    expected = {"fwd_sm80", "fwd_simt", "bwd_sm80", "bwd_simt"} | ({"fwd_sm90", "bwd_sm90"} if arch == "sm_90a" else set())
    assert families == expected
    assert all(v.source and dict(v.defines)["CUFLASH_SCORE_MODS"] & 96 for v in user_variants(arch))


def test_varlen_reference_evaluates_modifiers_per_sequence():
    # Sequence b alone, as a batch of one, with b written as b0 + b: the varlen reference must agree.
    rng = np.random.default_rng(1)
    lengths_q, lengths_k = [5, 9], [7, 4]
    cu_q, cu_k = np.cumsum([0] + lengths_q), np.cumsum([0] + lengths_k)
    q = rng.standard_normal((cu_q[-1], 2, 16))
    k = rng.standard_normal((cu_k[-1], 1, 16))
    v = rng.standard_normal((cu_k[-1], 1, 16))
    dout = rng.standard_normal(q.shape)
    bonus = np.array([0.5, -1.5])
    per_b = ScoreMod("score + bonus[b] * 1.0 + 0.1 * abs(q_idx - kv_idx)", bonus=bonus)
    mask = MaskMod("kv_idx <= q_idx + b")
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, score_mod=per_b, mask_mod=mask)
    grads = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, score_mod=per_b, mask_mod=mask)
    for b in range(2):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        alone_score = ScoreMod("score + bonus[b + b0] * 1.0 + 0.1 * abs(q_idx - kv_idx)", bonus=bonus, b0=b)
        alone_mask = MaskMod("kv_idx <= q_idx + b + b0", b0=b)
        o, l = reference.attention_forward(q[None, rows], k[None, keys], v[None, keys], score_mod=alone_score,
                                           mask_mod=alone_mask)
        np.testing.assert_allclose(out[rows], o[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[:, rows], l[0], rtol=1e-12, atol=1e-12)
        g = reference.attention_backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys],
                                         score_mod=alone_score, mask_mod=alone_mask)
        np.testing.assert_allclose(grads[0][rows], g[0][0], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(grads[1][keys], g[1][0], rtol=1e-10, atol=1e-12)
