"""cuflash.interop.jax and user modifiers, when traced without a GPU: score_mod= / mask_mod= are not
taken yet (docs/decisions.md, "jax: no modifiers yet"), and each function says so at trace time with a
NotImplementedError naming the argument, never dropping it. Skipped where JAX or CuPy is missing."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("cupy")

import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.interop.jax as cj  # noqa: E402

S = jax.ShapeDtypeStruct


def _call(fn, **mods):
    q = S((1, 8, 2, 64), jnp.bfloat16)
    if fn == "attention":
        return jax.eval_shape(lambda q: cj.attention(q, q, q, **mods), q)
    if fn == "attention_varlen":
        t = S((8, 2, 64), jnp.bfloat16)
        cu = S((2,), jnp.int32)
        return jax.eval_shape(lambda t, cu: cj.attention_varlen(t, t, t, cu, cu, max_seqlen_q=8, max_seqlen_k=8,
                                                                **mods), t, cu)
    lens = S((1,), jnp.int32)
    return jax.eval_shape(lambda q, lens: cj.decode(q, q, q, cache_seqlens=lens, **mods), q, lens)


@pytest.mark.parametrize("fn", ["attention", "attention_varlen", "decode"])
@pytest.mark.parametrize("name, mod", [("score_mod", cuflash.ScoreMod("score + 1.0")),
                                       ("mask_mod", cuflash.MaskMod("kv_idx <= q_idx"))])
def test_modifiers_are_refused_by_name_at_trace_time(fn, name, mod):
    with pytest.raises(NotImplementedError, match=rf"cuflash.interop.jax.{fn} does not take {name}"):
        _call(fn, **{name: mod})
    _call(fn)   # the same call without it traces


def test_an_array_argument_as_a_jax_array_is_refused_too():
    table = jnp.zeros(16, jnp.float32)
    with pytest.raises(NotImplementedError, match="score_mod"):
        _call("attention", score_mod=cuflash.ScoreMod("score + t[kv_idx]", t=table))
    assert np.asarray(table).shape == (16,)
