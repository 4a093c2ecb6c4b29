"""ScoreMod.with_arrays / MaskMod.with_arrays (for adapters that hand cuflash other objects for the same
arrays, as cuflash.interop.jax does with XLA's buffers): the expression, grad, scalars and key are kept,
the arrays swapped in slot order, and the float64 reference evaluates the new arrays; every array must be
named and keep its dtype."""

import numpy as np
import pytest

from cuflash.modifiers import MaskMod, ScoreMod


def test_with_arrays_keeps_the_static_part_and_swaps_the_arrays():
    table, other = np.zeros(7, np.float32), np.arange(7, dtype=np.float32)
    mod = ScoreMod("c * tanh(score / c) + table[kv_idx]", grad="1.0 - tanh(score / c) * tanh(score / c)",
                   table=table, c=5.0)
    new = mod.with_arrays({"table": other})
    assert new.key == mod.key and new.text == mod.text and new.grad is mod.grad
    assert new.call_parts() == (mod.call_parts()[0], (other,))
    assert new.args.values["c"] == 5.0 and mod.args.values["table"] is table   # the original is unchanged
    score = np.zeros((1, 1, 2, 7))
    np.testing.assert_array_equal(new.reference(score)[0, 0, 0], other)
    np.testing.assert_array_equal(mod.reference(score)[0, 0, 0], table)

    ids, doc = np.zeros(4, np.int32), np.ones(4, np.int32)
    mask = MaskMod("x[q_idx] == y[kv_idx] && kv_idx <= q_idx + w", x=ids, y=ids, w=1)
    swapped = mask.with_arrays({"y": doc, "x": ids})
    assert swapped.call_parts()[1] == (ids, doc)   # slot order, not the dict's
    assert not swapped.reference((1, 1, 4, 4)).any()
    scalars_only = ScoreMod("score * c", c=2.0)
    assert scalars_only.with_arrays({}).call_parts() == scalars_only.call_parts()


def test_with_arrays_needs_every_array_with_its_dtype():
    mod = ScoreMod("score + table[kv_idx]", table=np.zeros(7, np.float32))
    with pytest.raises(ValueError, match=r"exactly the array arguments \['table'\]"):
        mod.with_arrays({})
    with pytest.raises(ValueError, match="exactly the array arguments"):
        mod.with_arrays({"table": np.zeros(7, np.float32), "c": np.zeros(1, np.float32)})
    with pytest.raises(TypeError, match="score_mod argument table must stay float32 in with_arrays, got float64"):
        mod.with_arrays({"table": np.zeros(7)})
    with pytest.raises(TypeError, match="got no array"):
        mod.with_arrays({"table": [0.0] * 7})
