"""A modifier's spec (cuflash.modifiers.spec): written when it is made, rebuilt around other arrays.

The spec is how a ScoreMod/MaskMod crosses torch's op schemas (tests/gpu/test_modifiers_adapters.py
runs that path); here, without torch or a GPU: the rebuilt modifier compiles to the same code (key,
memo key, CUDA source) and gives the same reference values with the new arrays; with_args writes a
new spec; a malformed spec, too few arrays, or an array of another dtype is refused.
"""

import json

import ml_dtypes
import numpy as np
import pytest

from cuflash.modifiers import MaskMod, ScoreMod, kernel_source
from cuflash.modifiers.spec import rebuild


def _scores(rng, shape=(2, 3, 5, 7)):
    return rng.standard_normal(shape)


def test_a_rebuilt_score_mod_is_the_same_code_around_new_arrays():
    rng = np.random.default_rng()
    table = rng.standard_normal(40).astype(ml_dtypes.bfloat16)
    mod = ScoreMod("c * tanh(score / c) + where(flag, table[q_idx - kv_idx + off], 0.0)",
                   grad="1.0 - tanh(score / c) * tanh(score / c)", c=float(rng.uniform(1, 5)), table=table, off=20, flag=True)
    other = rng.standard_normal(40).astype(ml_dtypes.bfloat16)
    rebuilt, used = rebuild(mod.spec, [other, "left over for the next modifier"])
    assert used == 1 and rebuilt.array_names == ("table",)
    assert rebuilt.key == mod.key and rebuilt.call_parts()[0] == mod.call_parts()[0]
    assert rebuilt.call_parts()[1][0] is other
    assert kernel_source(rebuilt, None, backward=True) == kernel_source(mod, None, backward=True)
    s = _scores(rng)
    want = ScoreMod("c * tanh(score / c) + where(flag, table[q_idx - kv_idx + off], 0.0)",
                    grad="1.0 - tanh(score / c) * tanh(score / c)", c=mod.args.values["c"], table=other, off=20,
                    flag=True)
    np.testing.assert_array_equal(rebuilt.reference(s), want.reference(s))
    np.testing.assert_array_equal(rebuilt.reference_gradient(s), want.reference_gradient(s))


def test_a_rebuilt_mask_mod_keeps_its_slots_and_sparse():
    rng = np.random.default_rng()
    doc = np.sort(rng.integers(0, 3, 9)).astype(np.int32)
    mod = MaskMod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx + w", doc=doc, w=int(rng.integers(0, 4)),
                  sparse=False)
    assert json.loads(mod.spec)["sparse"] is False and json.loads(mod.spec_without_blocks)["sparse"] is False
    dense = MaskMod("kv_idx <= q_idx")
    assert json.loads(dense.spec)["sparse"] is True and json.loads(dense.spec_without_blocks)["sparse"] is False
    new_doc = rng.permutation(doc)
    rebuilt, used = rebuild(mod.spec, (new_doc,))
    assert used == 1 and not rebuilt.sparse and rebuilt.args.slots == mod.args.slots
    want = MaskMod("doc[q_idx] == doc[kv_idx] && kv_idx <= q_idx + w", doc=new_doc, w=mod.args.values["w"])
    np.testing.assert_array_equal(rebuilt.reference((1, 2, 9, 9)), want.reference((1, 2, 9, 9)))
    # The caller's own arrays: a rebuilt MaskMod derives blocks when its spec says sparse.
    assert rebuild(dense.spec, ())[0].derives_blocks
    assert not rebuild(dense.spec_without_blocks, ())[0].derives_blocks


def test_with_args_writes_a_new_spec():
    mod = ScoreMod("score * s + bias[h]", s=2.0, bias=np.zeros(4, np.float32))
    changed = mod.with_args(s=3.0, bias=np.zeros(4, np.float16))
    assert json.loads(changed.spec)["args"] == [["s", "float", 3.0], ["bias", "array", "float16"]]
    assert json.loads(mod.spec)["args"] == [["s", "float", 2.0], ["bias", "array", "float32"]]
    assert changed.array_names == ("bias",)


def test_a_missing_grad_is_written_when_the_modifier_is_made():
    assert ScoreMod("score + 1.0").missing_grad is None
    assert ScoreMod("score * 2.0", grad="2.0").missing_grad is None
    message = ScoreMod("score * score").missing_grad
    assert "grad=" in message and "score * score" in message


@pytest.mark.parametrize("spec, error, match", [
    ("not json", ValueError, "not a modifier spec"),
    ('{"kind": "other", "expr": "1", "args": []}', ValueError, "kind 'other'"),
    ('{"expr": "score", "args": []}', ValueError, "not a modifier spec"),
    ('{"kind": "score_mod", "expr": "score +", "args": []}', ValueError, "score_mod"),
])
def test_a_malformed_spec_is_refused(spec, error, match):
    with pytest.raises(error, match=match):
        rebuild(spec, ())


def test_too_few_arrays_or_another_dtype_is_refused():
    mod = ScoreMod("score + t[kv_idx]", t=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="names 1 arrays"):
        rebuild(mod.spec, ())
    with pytest.raises(TypeError, match="must stay float32"):
        rebuild(mod.spec, (np.zeros(3, np.float64),))
