"""Modifiers that state a built-in option (cuflash/modifiers/builtin.py): which forms are read as the
softcap, ALiBi or a window, which calls may take them, and that a moved call is the same attention
as the call written, by the float64 reference (forward and backward): hypothesis draws the forms,
the rest of the expression and the call's own options (causal, window, softcap, ALiBi, bias, square
or not)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cuflash import reference
from cuflash.modifiers import MaskMod, ScoreMod, as_written
from cuflash.modifiers.builtin import lowered


def _call(score_mod=None, mask_mod=None, causal=False, window=None, softcap=0.0, alibi=None, bias=None, heads=4,
          aligned=True, backward=False):
    return lowered(score_mod, mask_mod, causal, window, softcap, alibi, bias, heads, aligned, backward)


# ----------------------------------------------------------------------------- the forms read

@pytest.mark.parametrize("text, args, cap", [
    ("c * tanh(score / c)", dict(c=30.0), 30.0),
    ("30.0 * tanh(score / 30.0)", {}, 30.0),
    ("tanh(score / 7) * 7", {}, 7.0),
    ("-5.0 * tanh(score / -5.0)", {}, 5.0),
    ("c * tanh(score / 4.0)", dict(c=4.0), 4.0),
])
def test_softcap_forms_move_into_the_softcap(text, args, cap):
    assert _call(ScoreMod(text, **args)) == (None, None, None, cap, None)


@pytest.mark.parametrize("text, args", [
    ("c * tanh(score / d)", dict(c=3.0, d=4.0)),        # two values
    ("c * tanh(score * r)", dict(c=3.0, r=1 / 3.0)),    # not a quotient
    ("2.0 * score", {}),
    ("score + score * 0.0", {}),                        # score in two terms
    ("-score", {}),
    ("0.0 * tanh(score / 0.0)", {}),                    # no softcap of 0
    ("score + t[q_idx]", dict(t=np.zeros(3, np.float32))),   # nothing built in
])
def test_other_score_mods_stay(text, args):
    mod = ScoreMod(text, **args)
    assert mod._builtin is None
    assert _call(mod)[0] is mod


@pytest.mark.parametrize("text", ["score - s[h] * abs(q_idx - kv_idx)", "score - abs(kv_idx - q_idx) * s[h]",
                                  "score + s[h] * (kv_idx - q_idx)", "score - s[h] * (q_idx - kv_idx)"])
def test_alibi_forms_move_into_alibi(text):
    slopes = np.linspace(0.1, 1.0, 4, dtype=np.float32)
    mod = ScoreMod(text, s=slopes)
    score_mod, mask_mod, window, softcap, alibi = _call(mod, causal=True)
    assert score_mod is None and softcap == 0.0 and alibi is slopes
    signed = "abs" not in text
    # Keys right of the diagonal: only |d| is ALiBi there.
    assert (_call(mod, causal=False)[4] is None) == signed
    # Other positions than the built-in's, another dtype or length, the call's own slopes: no move.
    assert _call(mod, causal=True, aligned=False)[0] is mod
    assert _call(mod, causal=True, heads=8)[0] is mod
    assert _call(mod, causal=True, alibi=slopes)[0] is mod
    assert ScoreMod(text, s=slopes.astype(np.float64))._builtin is None


@pytest.mark.parametrize("text, args, window", [
    ("kv_idx <= q_idx", {}, (-1, 0)),
    ("q_idx >= kv_idx", {}, (-1, 0)),
    ("q_idx - kv_idx <= w", dict(w=1024), (1024, -1)),
    ("q_idx - kv_idx < 128", {}, (127, -1)),
    ("kv_idx > q_idx - 128 && kv_idx <= q_idx", {}, (127, 0)),
    ("kv_idx - q_idx <= 3 && q_idx - kv_idx <= 5", {}, (5, 3)),
    ("q_idx + 5 >= kv_idx + 2 && kv_idx * 1 - q_idx >= -100", {}, (100, 3)),
    ("q_idx == kv_idx", {}, (0, 0)),
    ("kv_idx <= q_idx + n", dict(n=2), (-1, 2)),
])
def test_window_forms_move_into_the_window(text, args, window):
    assert _call(mask_mod=MaskMod(text, **args)) == (None, None, window, 0.0, None)


@pytest.mark.parametrize("text, args", [
    ("kv_idx < q_idx", {}),                      # right of nothing: no window=(left, right) holds it
    ("q_idx - kv_idx >= 4", {}),
    ("kv_idx < p || kv_idx <= q_idx", dict(p=3)),
    ("2 * q_idx >= kv_idx", {}),
    ("abs(q_idx - kv_idx) < 4", {}),
    ("q_idx - kv_idx <= 2.5", {}),
    ("h <= kv_idx", {}),
])
def test_other_mask_mods_stay(text, args):
    mod = MaskMod(text, **args)
    assert mod._builtin is None
    assert _call(mask_mod=mod)[1] is mod


def test_what_is_left_stays_a_modifier_of_the_same_arguments():
    table, doc = np.arange(6, dtype=np.float32), np.arange(6, dtype=np.int32)
    slopes = np.ones(4, np.float32)
    mod = ScoreMod("c * tanh(score / c) - s[h] * abs(q_idx - kv_idx) + t[q_idx]", c=2.0, s=slopes, t=table)
    score_mod, _, _, softcap, alibi = _call(mod, causal=True)
    assert softcap == 2.0 and alibi is slopes and score_mod.text == "(score + t[q_idx])"
    assert score_mod.args.values["t"] is table
    # Where the call cannot take ALiBi, the softcap moves and ALiBi's term stays.
    score_mod, _, _, softcap, alibi = _call(mod, causal=True, aligned=False)
    assert softcap == 2.0 and alibi is None and "s[h]" in score_mod.text
    mask = MaskMod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx", doc=doc, sparse=False)
    _, mask_mod, window, _, _ = _call(mask_mod=mask, window=(8, -1))
    assert window == (8, 0) and mask_mod.text == "(doc[q_idx] == doc[kv_idx])" and not mask_mod.sparse
    assert mask_mod.args.values["doc"] is doc


def test_calls_that_cannot_take_the_softcap_keep_the_score_mod():
    mod = ScoreMod("c * tanh(score / c)", grad="1.0 - tanh(score / c) * tanh(score / c)", c=3.0)
    bias = np.zeros((1, 1, 2, 2))
    assert _call(mod, bias=bias)[0] is mod                       # the bias comes before the ScoreMod
    assert _call(mod, softcap=5.0)[0] is mod
    assert _call(mod, alibi=np.ones(4, np.float32))[0] is mod
    assert _call(mod, softcap="5")[0] is mod                      # the call's check names it
    assert _call(mod, backward=True)[3] == 3.0
    gradless = ScoreMod("c * tanh(score / c)", c=3.0)
    assert _call(gradless)[3] == 3.0                              # a forward needs no grad
    assert _call(gradless, backward=True)[0] is gradless          # the backward's error stays
    # A grad that is not the softcap's derivative is the user's gradient: nothing moves.
    assert ScoreMod("c * tanh(score / c)", grad="1.0", c=3.0)._builtin is None
    assert ScoreMod("score - s[h] * abs(q_idx - kv_idx)", grad="2.0", s=np.ones(4, np.float32))._builtin is None


def test_windows_that_are_not_pairs_move_nothing():
    mod = MaskMod("kv_idx <= q_idx")
    for window in ((1, 2, 3), (1.0, 0), "(1, 0)", (-3, 0)):
        assert _call(mask_mod=mod, window=window) == (None, mod, window, 0.0, None)


def test_as_written_moves_nothing():
    cap, near = ScoreMod("c * tanh(score / c)", c=3.0), MaskMod("kv_idx <= q_idx")
    with as_written():
        assert _call(cap, near) == (cap, near, None, 0.0, None)
    assert _call(cap, near) == (None, None, (-1, 0), 3.0, None)


def test_rests_follow_the_arrays_of_with_arrays_and_with_args():
    doc, other = np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32)
    mod = MaskMod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx", doc=doc)
    views = mod.with_arrays({"doc": other})
    rest = _call(mask_mod=views)[1]
    assert rest.args.values["doc"] is other and not rest.derives_blocks    # a view: no derived sparsity
    assert _call(mask_mod=views)[1] is rest                                 # made once a modifier
    assert _call(mask_mod=mod)[1].args.values["doc"] is doc
    assert _call(mask_mod=mod.with_args(doc=other))[1].args.values["doc"] is other
    cap = ScoreMod("c * tanh(score / c)", c=3.0)
    assert _call(cap.with_args(c=7.0))[3] == 7.0


# ----------------------------------------------------------------------------- the same attention

SOFTCAPS = ("", "c * tanh(score / c)", "tanh(score / 2.5) * 2.5")
ALIBIS = ("", " - s[h] * abs(q_idx - kv_idx)", " + s[h] * (kv_idx - q_idx)", " - abs(kv_idx - q_idx) * s[h]")
RESTS = ("", " + t[q_idx]", " - 0.5 * t[kv_idx + h]")
BOUNDS = ("kv_idx <= q_idx", "q_idx - kv_idx <= w", "kv_idx - q_idx < 3", "q_idx - kv_idx >= -2", "kv_idx < q_idx",
          "doc[q_idx] == doc[kv_idx]", "kv_idx < 2 || kv_idx <= q_idx")


@st.composite
def calls(draw):
    score_text = draw(st.sampled_from(SOFTCAPS))
    alibi, rest = draw(st.sampled_from(ALIBIS)), draw(st.sampled_from(RESTS))
    if score_text or alibi or rest:
        score_text = ("score" if not score_text else score_text) + alibi + rest
    conjuncts = draw(st.lists(st.sampled_from(BOUNDS), max_size=3, unique=True))
    sq = draw(st.integers(1, 9))
    square = draw(st.booleans())
    return dict(score_text=score_text, mask_text=" && ".join(f"({c})" for c in conjuncts), sq=sq,
                sk=sq if square else draw(st.integers(1, 9)), causal=draw(st.booleans()),
                window=draw(st.sampled_from([None, (2, 1), (4, -1), (-1, 0), (0, 3)])),
                softcap=draw(st.sampled_from([0.0, 1.5])), alibi=draw(st.booleans()), bias=draw(st.booleans()),
                grad=draw(st.sampled_from(["right", "none", "wrong"])), seed=draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_moved_calls_are_the_same_attention_by_the_reference(case):
    rng = np.random.default_rng(case["seed"])
    B, Hq, Hk, D, sq, sk = 2, 4, 2, 8, case["sq"], case["sk"]
    q, k, v = (rng.standard_normal((B, s, h, D)) for s, h in ((sq, Hq), (sk, Hk), (sk, Hk)))
    dout = rng.standard_normal(q.shape)
    slopes = rng.uniform(0.05, 0.5, Hq).astype(np.float32)
    args = dict(c=2.0, s=slopes, t=rng.standard_normal(16).astype(np.float32))
    score_mod = mask_mod = None
    if case["score_text"]:
        cap = 2.0 if "score / c" in case["score_text"] else 2.5
        grad = {"right": f"1.0 - tanh(score / {cap}) * tanh(score / {cap})" if "tanh" in case["score_text"] else "1.0",
                "none": None, "wrong": "0.5"}[case["grad"]]
        score_mod = ScoreMod(case["score_text"], grad=grad, **args)
    if case["mask_text"]:
        mask_mod = MaskMod(case["mask_text"], w=3, doc=rng.integers(0, 2, 12).astype(np.int32))
    options = dict(causal=case["causal"], window=case["window"], softcap=case["softcap"],
                   alibi_slopes=rng.uniform(0.05, 0.5, Hq) if case["alibi"] else None,
                   bias=rng.standard_normal((1, Hq, sq, sk)) if case["bias"] else None)

    def moved(backward):
        s, m, window, softcap, alibi = lowered(score_mod, mask_mod, options["causal"], options["window"],
                                               options["softcap"], options["alibi_slopes"], options["bias"], Hq,
                                               sq == sk, backward)
        return dict(options, score_mod=s, mask_mod=m, window=window, softcap=softcap, alibi_slopes=alibi)

    written = dict(options, score_mod=score_mod, mask_mod=mask_mod)
    for got, want in zip(reference.attention_forward(q, k, v, **moved(False)),
                         reference.attention_forward(q, k, v, **written)):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)
    if score_mod is not None and score_mod.needs_grad:
        return   # the backward refuses it, moved or not (test_calls_that_cannot_take_the_softcap_keep_the_score_mod)
    for got, want in zip(reference.attention_backward(dout, q, k, v, **moved(True)),
                         reference.attention_backward(dout, q, k, v, **written)):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


def test_decode_positions_are_the_built_ins():
    """In decode q_idx is absolute in the sequence, so ALiBi and the window move with any lengths."""
    rng = np.random.default_rng()
    B, Sq, Hq, Hk, D, L = 2, 3, 4, 2, 8, 12
    q = rng.standard_normal((B, Sq, Hq, D))
    k_cache, v_cache = rng.standard_normal((B, L, Hk, D)), rng.standard_normal((B, L, Hk, D))
    seqlens = np.asarray([7, 12], np.int32)
    slopes = rng.uniform(0.1, 0.5, Hq).astype(np.float32)
    score_mod = ScoreMod("c * tanh(score / c) + s[h] * (kv_idx - q_idx)", c=3.0, s=slopes)
    mask_mod = MaskMod("q_idx - kv_idx < 4")
    s, m, window, softcap, alibi = lowered(score_mod, mask_mod, True, None, 0.0, None, None, Hq, True)
    assert (s, m, window, softcap, alibi is slopes) == (None, None, (3, -1), 3.0, True)
    got = reference.decode(q, k_cache, v_cache, cache_seqlens=seqlens, window=window, softcap=softcap,
                           alibi_slopes=alibi)
    want = reference.decode(q, k_cache, v_cache, cache_seqlens=seqlens, score_mod=score_mod, mask_mod=mask_mod)
    for got_part, want_part in zip(got, want):   # out, lse
        np.testing.assert_allclose(got_part, want_part, rtol=1e-9, atol=1e-11)


def test_the_entry_points_facts():
    """What the entry points ask before and for lowered: whether a modifier states anything, and a
    (B, S, H, D) call's heads and whether its queries and keys have as many rows."""
    from cuflash.modifiers.builtin import bshd_facts, states_builtin

    table = np.zeros(3, np.float32)
    assert states_builtin(ScoreMod("c * tanh(score / c)", c=3.0), None)
    assert states_builtin(None, MaskMod("kv_idx <= q_idx"))
    assert not states_builtin(ScoreMod("score + t[q_idx]", t=table), MaskMod("kv_idx < 2 || kv_idx <= q_idx"))
    assert not states_builtin(None, None) and not states_builtin("not a modifier", 3)
    q, k = np.zeros((2, 5, 4, 8)), np.zeros((2, 5, 2, 8))
    assert bshd_facts(q, k) == (4, True)
    assert bshd_facts(q, np.zeros((2, 7, 2, 8))) == (4, False)
    assert bshd_facts(q[0], k) == (None, False) and bshd_facts("q", k) == (None, False)
