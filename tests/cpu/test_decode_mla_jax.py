"""MLA decode in cuflash.interop.jax, traced without a GPU: ``cj.decode(q, latent, None, v_head_dim=512,
k_new=...)`` calls one callback with the one latent cache (no v_cache operand), returns out with
v_head_dim columns and, with k_new, the cache aliased from its operand (in place when donated); the
arguments that do not fit MLA are refused at trace time, naming them. Skipped where JAX or CuPy is
missing; tests/gpu/test_decode_mla.py::test_jax_mla_decode_equals_cupy runs it on a GPU."""

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("cupy")

import jax.numpy as jnp  # noqa: E402

import cuflash.interop.jax as cj  # noqa: E402
from tests.cpu._jax_trace import callbacks  # noqa: E402

S = jax.ShapeDtypeStruct
B, HQ, D, DV = 2, 16, 576, 512
Q, LATENT, NEW, LENS = (S((B, 1, HQ, D), jnp.bfloat16), S((B, 256, 1, D), jnp.bfloat16),
                        S((B, 1, 1, D), jnp.bfloat16), S((B,), jnp.int32))


def test_one_cache_in_and_out():
    out, lse, cache = jax.eval_shape(
        lambda q, c, l, kn: cj.decode(q, c, None, cache_seqlens=l, k_new=kn, v_head_dim=DV, return_lse=True),
        Q, LATENT, LENS, NEW)
    assert out.shape == (B, 1, HQ, DV) and out.dtype == Q.dtype and lse.shape == (B, HQ, 1)
    assert (cache.shape, cache.dtype) == (LATENT.shape, LATENT.dtype)
    step = jax.jit(lambda q, c, l, kn: cj.decode(q, c, None, cache_seqlens=l, k_new=kn, v_head_dim=DV),
                   donate_argnums=(1,))
    [call] = callbacks(jax.make_jaxpr(step)(Q, LATENT, LENS, NEW).jaxpr)
    # operands q, the cache, the lengths, k_new; the cache aliased into result 1 (after out)
    assert [tuple(v.aval.shape) for v in call.invars] == [Q.shape, LATENT.shape, LENS.shape, NEW.shape]
    assert dict(call.params["input_output_aliases"]) == {1: 1}
    # without an append: out alone, nothing aliased
    out = jax.eval_shape(lambda q, c, l: cj.decode(q, c, None, cache_seqlens=l, v_head_dim=256), Q, LATENT, LENS)
    assert out.shape == (B, 1, HQ, 256)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(), ValueError, "needs v_head_dim"),
    (dict(v_head_dim=DV, v_new=jnp.zeros(NEW.shape, NEW.dtype)), ValueError, "v_new must be None"),
    (dict(v_head_dim=520), ValueError, "v_head_dim a multiple of 8 up to 512"),
    (dict(v_head_dim=DV, kv_dtype="float8_e4m3fn"), ValueError, "kv_dtype"),
])
def test_mla_arguments_are_checked_at_trace_time(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        jax.eval_shape(lambda q, c, l, kn, **kw: cj.decode(q, c, None, cache_seqlens=l, k_new=kn, **kwargs),
                       Q, LATENT, LENS, NEW)


def test_rows_other_than_576_are_refused():
    q, cache = S((B, 1, HQ, 512), jnp.bfloat16), S((B, 256, 1, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="576"):
        jax.eval_shape(lambda q, c, l: cj.decode(q, c, None, cache_seqlens=l, v_head_dim=256), q, cache, LENS)
    with pytest.raises(ValueError, match="v_head_dim is for MLA"):
        jax.eval_shape(lambda q, c, l: cj.decode(q, c, c, cache_seqlens=l, v_head_dim=256), q, cache, LENS)
