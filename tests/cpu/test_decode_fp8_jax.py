"""fp8 (e4m3) KV caches in cuflash.interop.jax.decode, traced without a GPU: jnp.float8_e4m3fn caches
(kv_dtype implied) and uint8 ones with kv_dtype said go to the callback as they are, aliased into the
returned caches (no bitcast, no copy in the compiled program); scales given as numbers are static (no
operand), as JAX arrays they are operands; the trace-time errors name kv_dtype, k_scale, v_scale,
k_cache; a float8 buffer's address is read from its DLPack tensor (checked on CPU buffers, whose
``__cuda_array_interface__`` does not exist; XLA's has no typestr for float8 either).
Skipped where JAX or CuPy is missing. The GPU counterpart: tests/gpu/test_decode_fp8_jax.py."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("cupy")

import jax.numpy as jnp  # noqa: E402

import cuflash.interop.jax as cj  # noqa: E402
from tests.cpu._jax_trace import callbacks  # noqa: E402
from cuflash.interop import _jax_buffers  # noqa: E402

S = jax.ShapeDtypeStruct
BF16, F16, F32, E4M3, U8 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.uint8
FP8 = "float8_e4m3fn"
B, HQ, HK, D = 2, 8, 2, 128
Q, NEW, LENS = S((B, 1, HQ, D), BF16), S((B, 1, HK, D), BF16), S((B,), jnp.int32)
CACHE, PAGES, TABLE = S((B, 300, HK, D), E4M3), S((40, 16, HK, D), E4M3), S((B, 20), jnp.int32)


def _step(**kw):
    return jax.jit(lambda q, kc, vc, lens, kn, vn, *scales: cj.decode(
        q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, **kw, **dict(zip(("k_scale", "v_scale"), scales))),
        donate_argnums=(1, 2))


@pytest.mark.parametrize("cache", [CACHE, S(CACHE.shape, U8)], ids=["float8_e4m3fn", "uint8"])
def test_append_returns_the_caches_in_their_dtype(cache):
    kw = {} if cache.dtype == E4M3 else {"kv_dtype": FP8}
    out, lse, kc, vc = jax.eval_shape(
        lambda q, kc, vc, l, kn, vn: cj.decode(q, kc, vc, cache_seqlens=l, k_new=kn, v_new=vn, return_lse=True,
                                               k_scale=0.5, v_scale=0.25, **kw), Q, cache, cache, LENS, NEW, NEW)
    assert (out.shape, out.dtype) == (Q.shape, Q.dtype) and (lse.shape, lse.dtype) == ((B, HQ, 1), F32)
    assert [(c.shape, c.dtype) for c in (kc, vc)] == [(cache.shape, cache.dtype)] * 2
    # The caches are operands 1 and 2, aliased into results 2 and 3 (after out and lse): in place when donated.
    jaxpr = jax.make_jaxpr(_step(return_lse=True, **kw))(Q, cache, cache, LENS, NEW, NEW, 0.5, 0.25).jaxpr
    [call] = callbacks(jaxpr)
    assert dict(call.params["input_output_aliases"]) == {1: 2, 2: 3}
    assert [v.aval.dtype for v in call.invars[1:3]] == [cache.dtype] * 2


def test_paged_fp8_shapes_and_explicit_kv_dtype():
    out = jax.eval_shape(lambda q, kc, vc, l, t: cj.decode(q, kc, vc, cache_seqlens=l, block_table=t, kv_dtype=FP8,
                                                           k_scale=1.0, v_scale=jnp.ones(HK, F32)),
                         Q, PAGES, PAGES, LENS, TABLE)
    assert (out.shape, out.dtype) == (Q.shape, BF16)


def test_scales_static_as_numbers_operands_as_arrays():
    def operands(k_scale, v_scale):
        f = lambda q, kc, vc, l: cj.decode(q, kc, vc, cache_seqlens=l, k_scale=k_scale, v_scale=v_scale)  # noqa: E731
        [call] = callbacks(jax.make_jaxpr(f)(Q, CACHE, CACHE, LENS).jaxpr)
        return call, [(tuple(v.aval.shape), v.aval.dtype) for v in call.invars[4:]]

    a, none = operands(0.5, np.float32(0.25))        # numbers (and NumPy scalars): static, no operand
    assert none == []
    b, _ = operands(0.5, np.array([0.125], np.float32))   # a one-element NumPy array is a number too
    assert a.params["callback"] is not b.params["callback"]   # another value, another callback
    _, both = operands(jnp.float32(0.5), jnp.ones(HK, F32))
    assert both == [((), F32), ((HK,), F32)]
    _, one = operands(jnp.ones((1,), F32), 0.5)
    assert one == [((1,), F32)]
    _, host = operands(np.full(HK, 0.5), 0.5)       # a NumPy array of Hk scales: a constant operand
    assert host == [((HK,), F32)]


def test_scale_arrays_may_be_traced():
    f = jax.jit(lambda q, kc, vc, l, ks, vs: cj.decode(q, kc, vc, cache_seqlens=l, k_scale=ks, v_scale=vs))
    out = jax.eval_shape(f, Q, CACHE, CACHE, LENS, S((HK,), F32), S((), F32))
    assert out.shape == Q.shape


def test_compiled_append_keeps_the_donated_caches():
    # No bitcast and no copy of the caches around the callback: the kernels append into the caller's bytes.
    text = _step().lower(Q, CACHE, CACHE, LENS, NEW, NEW, 0.5, 0.25).compile().as_text()
    assert "copy(" not in text and "bitcast-convert" not in text, text
    assert "input_output_alias={ {1}: (1, {}, may-alias), {2}: (2, {}, may-alias) }" in text


def test_command_buffers_only_for_whole_16_byte_rows(monkeypatch):
    monkeypatch.setattr(cj, "COMMAND_BUFFERS", True)

    def flag(d, dtype):
        q, cache = S((1, 1, 2, d), BF16), S((1, 64, 2, d), dtype)
        kw = dict(k_scale=1.0, v_scale=1.0) if dtype == E4M3 else {}
        [call] = callbacks(jax.make_jaxpr(lambda q, c, l: cj.decode(q, c, c, cache_seqlens=l, **kw))(
            q, cache, S((1,), jnp.int32)).jaxpr)
        return call.params["command_buffer_compatible"]

    assert flag(128, E4M3) and flag(72, BF16)
    assert not flag(72, E4M3)   # an fp8 row of 72 bytes is copied (padded), which a capture refuses


def test_views_read_float8_buffers_as_bytes():
    views = _jax_buffers.Views((((4, 16), E4M3), ((4,), F32)))
    assert [dtype for _, dtype in views._layouts] == [np.dtype(np.uint8), np.dtype(np.float32)]

    seen = {}

    def callback(ctx, out, x):
        seen["address"], seen["numpy"] = _jax_buffers.byte_address(x), np.asarray(x).__array_interface__["data"][0]
        np.asarray(out)[...] = np.asarray(x).view(np.uint8)

    # On the host's buffers (np.asarray reads them) also where JAX's default device is a GPU.
    cpu = jax.devices("cpu")[0]
    x = jax.device_put((jnp.arange(64, dtype=F32).reshape(4, 16) / 7).astype(E4M3), cpu)
    from jax.experimental.buffer_callback import buffer_callback

    with jax.default_device(cpu):
        y = jax.jit(buffer_callback(callback, S((4, 16), U8)))(x)
    assert seen["address"] == seen["numpy"] != 0
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x).view(np.uint8))


K8 = S((1, 24, 2, 64), E4M3)
Q16, N16 = S((1, 1, 4, 64), F16), S((1, 1, 2, 64), F16)
L1 = jnp.zeros(1, jnp.int32)
SCALES = dict(k_scale=1.0, v_scale=1.0)
ERRORS = [
    (lambda q, k: cj.decode(q, jnp.zeros(k.shape, U8), jnp.zeros(k.shape, U8),
                            cache_seqlens=L1, **SCALES), TypeError, "k_cache is uint8: an fp8 cache of e4m3 bytes "
                                                                    "needs kv_dtype"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=L1, kv_dtype="float8_e5m2", **SCALES), ValueError,
     "kv_dtype must be None or one of"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=L1, kv_dtype=8, **SCALES), TypeError,
     "kv_dtype must be None or a str"),
    (lambda q, k: cj.decode(q, jnp.zeros(k.shape, jnp.float8_e5m2), jnp.zeros(k.shape, jnp.float8_e5m2),
                            cache_seqlens=L1, **SCALES), TypeError, "k_cache is float8_e5m2: an fp8 cache is "
                                                                    "float8_e4m3fn"),
    (lambda q, k: cj.decode(q, k, jnp.zeros(k.shape, F16), cache_seqlens=L1, **SCALES), TypeError,
     r"v_cache must have the dtype of k_cache \(float8_e4m3fn\)"),
    (lambda q, k: cj.decode(q, jnp.zeros(k.shape, F16), jnp.zeros(k.shape, F16), cache_seqlens=L1, kv_dtype=FP8,
                            **SCALES), TypeError, "k_cache must be float8_e4m3fn"),
    (lambda q, k: cj.decode(q.astype(F32), k, k, cache_seqlens=L1, **SCALES), TypeError, "q is float32"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=L1, v_scale=1.0), ValueError, "k_scale is required"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=L1, k_scale=1.0), ValueError, "v_scale is required"),
    (lambda q, k: cj.decode(q, jnp.zeros(k.shape, F16), jnp.zeros(k.shape, F16), cache_seqlens=L1, k_scale=1.0),
     ValueError, "k_scale / v_scale are the scales of an fp8 cache"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=L1, k_scale=1.0, v_scale=jnp.ones(3, F32)), ValueError,
     r"v_scale must be a scalar or have shape \(1,\) or \(2,\)"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=L1, k_scale=jnp.ones((1, 2), F32), v_scale=1.0), ValueError,
     "k_scale must be a scalar or have shape"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=L1, k_scale=jnp.ones(2, F16), v_scale=1.0), TypeError,
     "k_scale must be float32"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=L1, k_scale=0.0, v_scale=1.0), ValueError,
     "k_scale must be a finite float32 scale > 0"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=L1, k_scale=1.0, v_scale=float("inf")), ValueError,
     "v_scale must be a finite float32 scale > 0"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=L1, k_scale=True, v_scale=1.0), TypeError,
     "k_scale must be a float or a JAX float32 array, got bool"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=L1, k_scale=[1.0], v_scale=1.0), TypeError,
     "k_scale must be a float or a JAX float32 array, got list"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=L1, k_new=jnp.zeros((1, 1, 2, 64), E4M3),
                            v_new=jnp.zeros((1, 1, 2, 64), E4M3), **SCALES), TypeError,
     "k_new must have the dtype of q"),
    (lambda q, k: cj.decode(jnp.zeros((1, 1, 4, 72), F16), jnp.zeros((1, 24, 2, 72), E4M3),
                            jnp.zeros((1, 24, 2, 72), E4M3), cache_seqlens=L1, k_new=jnp.zeros((1, 1, 2, 72), F16),
                            v_new=jnp.zeros((1, 1, 2, 72), F16), **SCALES), ValueError,
     r"head dim \(72\) to be a multiple of 16"),
    (lambda q, k: cj.decode(jnp.zeros((1, 1, 4, 36), F16), jnp.zeros((1, 24, 2, 36), F16),
                            jnp.zeros((1, 24, 2, 36), F16), cache_seqlens=L1, k_new=jnp.zeros((1, 1, 2, 36), F16),
                            v_new=jnp.zeros((1, 1, 2, 36), F16)), ValueError,
     r"head dim \(36\) to be a multiple of 8"),
]


@pytest.mark.parametrize("call, error, message", ERRORS, ids=[m for _, _, m in ERRORS])
def test_trace_time_errors_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        jax.eval_shape(call, Q16, K8)
