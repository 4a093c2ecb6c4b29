"""cuflash.interop.jax when traced, without a GPU: result shapes under jax.eval_shape (also through
grad, scan and checkpoint), the trace-time errors (each naming its argument), what the traced
program holds (dbias only for a differentiated bias, the command-buffer option), and the dropout
words a key gives. Skipped where JAX (or CuPy, which the module imports) is missing, as in CI."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("cupy")

import jax.numpy as jnp  # noqa: E402

import cuflash.interop.jax as cj  # noqa: E402
from tests.cpu._jax_trace import callbacks  # noqa: E402

S = jax.ShapeDtypeStruct
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
def test_attention_shapes(dtype):
    q, k = S((2, 100, 8, 64), dtype), S((2, 130, 2, 64), dtype)
    out = jax.eval_shape(lambda q, k, v: cj.attention(q, k, v, causal=True), q, k, k)
    assert (out.shape, out.dtype) == (q.shape, q.dtype)
    out, lse = jax.eval_shape(lambda q, k, v: cj.attention(q, k, v, return_lse=True), q, k, k)
    assert (lse.shape, lse.dtype) == ((2, 8, 100), F32)


def test_a_value_head_dim_of_its_own():
    """v with its own head dim (issue 53): out and dout take it, dv v's shape; dense and varlen, and the
    callbacks of a square call stay those of before (the spec's v is None)."""
    q, k, v = S((2, 100, 8, 192), BF16), S((2, 130, 2, 192), BF16), S((2, 130, 2, 128), BF16)
    out, lse = jax.eval_shape(lambda q, k, v: cj.attention(q, k, v, causal=True, return_lse=True), q, k, v)
    assert out.shape == (2, 100, 8, 128) and lse.shape == (2, 8, 100)
    loss = lambda q, k, v: cj.attention(q, k, v, causal=True).astype(F32).sum()   # noqa: E731
    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    qv, kv, vv, cu = S((300, 8, 64), F16), S((400, 4, 64), F16), S((400, 4, 128), F16), S((4,), jnp.int32)
    fn = lambda q, k, v, c: cj.attention_varlen(q, k, v, c, c, max_seqlen_q=200, max_seqlen_k=300)  # noqa: E731
    assert jax.eval_shape(fn, qv, kv, vv, cu).shape == (300, 8, 128)
    grads = jax.eval_shape(jax.grad(lambda *a: fn(*a).astype(F32).sum(), argnums=(0, 1, 2)), qv, kv, vv, cu)
    assert [g.shape for g in grads] == [qv.shape, kv.shape, vv.shape]


@pytest.mark.parametrize("paged", [False, True])
def test_chunked_prefill_over_a_cache(paged):
    """attention_varlen with cache_seqlens / block_table: out (total_q, Hq, D) and lse (Hq, total_q) when
    traced; refused when differentiated, with cu_seqlens_k or dropout, or with offsets that do not match
    the batch of cache_seqlens (each naming the argument)."""
    q, cu, lens = S((70, 8, 64), BF16), S((4,), jnp.int32), S((3,), jnp.int32)
    cache = S((24, 16, 2, 64), BF16) if paged else S((3, 128, 2, 64), BF16)
    table = S((3, 8), jnp.int32) if paged else None

    def chunked(q, kc, vc, cu, lens, **extra):
        return cj.attention_varlen(q, kc, vc, cu, None, max_seqlen_q=40, causal=True, cache_seqlens=lens,
                                   block_table=None if table is None else jnp.zeros((3, 8), jnp.int32), **extra)

    out, lse = jax.eval_shape(lambda *a: chunked(*a, return_lse=True), q, cache, cache, cu, lens)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((70, 8, 64), BF16, (8, 70), F32)
    with pytest.raises(ValueError, match="not differentiable"):
        jax.eval_shape(jax.grad(lambda q, *a: chunked(q, *a).astype(F32).sum()), q, cache, cache, cu, lens)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        jax.eval_shape(lambda q, kc, vc, cu, lens: cj.attention_varlen(q, kc, vc, cu, cu, max_seqlen_q=40,
                                                                       cache_seqlens=lens), q, cache, cache, cu, lens)
    with pytest.raises(ValueError, match="dropout_p"):
        jax.eval_shape(lambda *a: chunked(*a, dropout_p=0.1), q, cache, cache, cu, lens)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        jax.eval_shape(chunked, q, cache, cache, S((5,), jnp.int32), lens)


def test_gradient_shapes_through_scan_and_checkpoint():
    x = S((2, 64, 4, 32), BF16)
    keys = S((3,), jax.random.key(0).dtype)

    def layer(x, key):
        return x + cj.attention(x, x, x, causal=True, dropout_p=0.1, dropout_rng=key), None

    def loss(x, keys):
        return jax.lax.scan(jax.checkpoint(layer), x, keys)[0].astype(F32).sum()

    grad = jax.eval_shape(jax.grad(loss), x, keys)
    assert (grad.shape, grad.dtype) == (x.shape, x.dtype)


def test_dbias_only_when_the_bias_is_differentiated():
    q, k, bias = S((1, 64, 4, 64), F16), S((1, 80, 4, 64), F16), S((1, 4, 64, 80), F32)

    def loss(q, k, v, bias):
        return cj.attention(q, k, v, bias=bias).astype(F32).sum()

    def backward_outputs(argnums):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=argnums))(q, k, k, bias).jaxpr
        backward = [e for e in callbacks(jaxpr) if len(e.outvars) >= 3]
        assert len(backward) == 1
        return [v.aval.shape for v in backward[0].outvars]

    assert backward_outputs((0, 1, 2)) == [q.shape, k.shape, k.shape]
    assert backward_outputs((0, 3)) == [q.shape, k.shape, k.shape, bias.shape]
    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 3)), q, k, k, bias)
    assert grads[1].shape == bias.shape and grads[1].dtype == bias.dtype


def test_dsinks_only_when_the_sinks_are_differentiated():
    q, k, sinks = S((1, 64, 4, 64), BF16), S((1, 80, 2, 64), BF16), S((4,), F32)

    def loss(q, k, v, sinks):
        return cj.attention(q, k, v, sinks=sinks, causal=True).astype(F32).sum()

    def backward_outputs(argnums):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=argnums))(q, k, k, sinks).jaxpr
        backward = [e for e in callbacks(jaxpr) if len(e.outvars) >= 3]
        assert len(backward) == 1
        return [v.aval.shape for v in backward[0].outvars]

    assert backward_outputs((0, 1, 2)) == [q.shape, k.shape, k.shape]
    assert backward_outputs((0, 3)) == [q.shape, k.shape, k.shape, sinks.shape]
    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 3)), q, k, k, sinks)
    assert (grads[1].shape, grads[1].dtype) == (sinks.shape, F32)
    # The sinks go into the forward's callback as an operand (a buffer, read at each call).
    forward = [e for e in callbacks(jax.make_jaxpr(loss)(q, k, k, sinks).jaxpr)]
    assert len(forward) == 1 and any(v.aval.shape == (4,) for v in forward[0].invars)

    # varlen: dsinks beside dq, dk, dv; decode: an operand, shapes unchanged.
    qv, kv, cu = S((300, 4, 64), F16), S((400, 2, 64), F16), S((4,), jnp.int32)
    fv = lambda q, k, v, cq, ck, s: cj.attention_varlen(q, k, v, cq, ck, max_seqlen_q=200,  # noqa: E731
                                                         max_seqlen_k=300, sinks=s, alibi_slopes=jnp.ones(4, F32))
    grads = jax.eval_shape(jax.grad(lambda *a: fv(*a).astype(F32).sum(), argnums=(0, 5)), qv, kv, kv, cu, cu, sinks)
    assert grads[0].shape == qv.shape and (grads[1].shape, grads[1].dtype) == ((4,), F32)
    qd, cache, lens = S((2, 1, 4, 128), BF16), S((2, 512, 2, 128), BF16), S((2,), jnp.int32)
    out, lse = jax.eval_shape(lambda q, kc, vc, l, s: cj.decode(q, kc, vc, cache_seqlens=l, sinks=s, return_lse=True),
                              qd, cache, cache, lens, sinks)
    assert out.shape == qd.shape and lse.shape == (2, 4, 1)


def test_varlen_decode_and_merge_shapes():
    q, k, cu = S((300, 8, 64), F16), S((400, 4, 64), F16), S((4,), jnp.int32)
    fn = lambda q, k, v, cq, ck: cj.attention_varlen(q, k, v, cq, ck, max_seqlen_q=200, max_seqlen_k=300,  # noqa: E731
                                                      return_lse=True)
    out, lse = jax.eval_shape(fn, q, k, k, cu, cu)
    assert out.shape == q.shape and lse.shape == (8, 300)
    grads = jax.eval_shape(jax.grad(lambda *a: fn(*a)[0].astype(F32).sum(), argnums=(0, 1, 2)), q, k, k, cu, cu)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]

    qd, cache, lens, new = S((2, 1, 8, 128), BF16), S((2, 512, 2, 128), BF16), S((2,), jnp.int32), S((2, 1, 2, 128),
                                                                                                       BF16)
    results = jax.eval_shape(lambda q, kc, vc, l, kn, vn: cj.decode(q, kc, vc, cache_seqlens=l, k_new=kn, v_new=vn,
                                                                    return_lse=True), qd, cache, cache, lens, new, new)
    assert [r.shape for r in results] == [qd.shape, (2, 8, 1), cache.shape, cache.shape]
    jaxpr = jax.make_jaxpr(lambda q, kc, vc, l, kn, vn: cj.decode(q, kc, vc, cache_seqlens=l, k_new=kn, v_new=vn))(
        qd, cache, cache, lens, new, new).jaxpr
    assert dict(callbacks(jaxpr)[0].params["input_output_aliases"]) == {1: 1, 2: 2}   # the caches, in place
    pages, table = S((64, 16, 2, 128), BF16), S((2, 32), jnp.int32)
    out = jax.eval_shape(lambda q, kc, vc, l, t: cj.decode(q, kc, vc, cache_seqlens=l, block_table=t), qd, pages,
                         pages, lens, table)
    assert out.shape == qd.shape

    o, lse = S((1, 64, 4, 64), F16), S((1, 4, 64), F32)
    out, merged = jax.eval_shape(lambda a, b, c, d: cj.merge_states([a, b], [c, d]), o, o, lse, lse)
    assert (out.shape, out.dtype, merged.shape) == (o.shape, F16, lse.shape)
    out, _ = jax.eval_shape(lambda a, b, c, d: cj.merge_states([a, b.astype(F32)], [c, d]), o, o, lse, lse)
    assert out.dtype == F16   # mixed parts merge in float32, the result in the dtype of outs[0]


Q, K = S((1, 16, 4, 64), F16), S((1, 24, 2, 64), F16)
ERRORS = [
    (lambda q, k: cj.attention(q, k[..., :32], k), ValueError, "k must have the head dim of q"),
    (lambda q, k: cj.attention(q, k, jnp.zeros((1, 24, 2, 300), F16)), ValueError, r"value head dim .*\(64, 300\)"),
    (lambda q, k: cj.attention(q, k[:, :, :1].repeat(3, 2), k[:, :, :1].repeat(3, 2)), ValueError, "heads of q"),
    (lambda q, k: cj.attention(q.astype(jnp.int32), k, k), TypeError, "q must be float16"),
    (lambda q, k: cj.attention(q, k.astype(BF16), k), TypeError, "k must have the dtype of q"),
    (lambda q, k: cj.attention(q[0], k[0], k[0]), ValueError, "q must be 4-d"),
    (lambda q, k: cj.attention(q, k, k, dropout_p=0.1), ValueError, "dropout_rng"),
    (lambda q, k: cj.attention(q, k, k, dropout_p=0.1, dropout_rng=q), TypeError, "dropout_rng"),
    (lambda q, k: cj.attention(q, k, k, dropout_p=1.0, dropout_rng=jax.random.key(0)), ValueError, "dropout_p"),
    (lambda q, k: cj.attention(q, k, k, mask=jnp.ones((3, 24), bool)), ValueError, "mask of shape"),
    (lambda q, k: cj.attention(q, k, k, mask=jnp.ones((16, 24))), TypeError, "mask must be a bool"),
    (lambda q, k: cj.attention(q, k, k, bias=jnp.ones((16, 24), jnp.int32)), TypeError, "bias must be float32"),
    (lambda q, k: cj.attention(q, k, k, alibi_slopes=jnp.ones(3)), ValueError, "alibi_slopes must have shape"),
    (lambda q, k: cj.attention(q, k, k, block_mask=jnp.ones((1, 4, 3, 3), bool), block_size=(8, 8)), ValueError,
     "block_mask of shape"),
    (lambda q, k: cj.attention(q, k, k, scale=-1.0), ValueError, "scale must be > 0"),
    (lambda q, k: cj.attention(q, k, k, scale=q[0, 0, 0, 0]), TypeError, "scale must be a float"),
    (lambda q, k: cj.attention(q, k, k, window=(1,)), ValueError, "window must be a pair"),
    (lambda q, k: cj.attention(q, k, k, softcap="2"), TypeError, "softcap must be a float"),
    (lambda q, k: cj.attention(q, k, k, block_size=(0, 8)), ValueError, "block_size"),
    (lambda q, k: cj.attention(q, k, k, causal=1), TypeError, "causal must be a bool"),
    (lambda q, k: cj.attention(q, k, k, return_lse="yes"), TypeError, "return_lse must be a bool"),
    (lambda q, k: cj.attention(q, [0.0], k), TypeError, "k must be a JAX array"),
    (lambda q, k: cj.attention_varlen(q[0], k[0], k[0], jnp.zeros(3, jnp.int16), jnp.zeros(3, jnp.int32),
                                      max_seqlen_q=8, max_seqlen_k=8), TypeError, "cu_seqlens_q must be int32"),
    (lambda q, k: cj.attention_varlen(q[0], k[0], k[0], jnp.zeros(3, jnp.int32), jnp.zeros(4, jnp.int32),
                                      max_seqlen_q=8, max_seqlen_k=8), ValueError, "cu_seqlens_k must have length"),
    (lambda q, k: cj.attention_varlen(q[0], k[0], k[0], jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32),
                                      max_seqlen_q=-1, max_seqlen_k=8), ValueError, "max_seqlen_q"),
    (lambda q, k: cj.attention_varlen(q[0], k[0], k[0], jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32),
                                      max_seqlen_q=None, max_seqlen_k=8), TypeError, "max_seqlen_q"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=jnp.zeros(1, jnp.uint32)), TypeError, "cache_seqlens must be int32"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=jnp.zeros(2, jnp.int32)), ValueError, "cache_seqlens must have"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=jnp.zeros(1, jnp.int32), k_new=k), ValueError,
     "k_new and v_new"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=jnp.zeros(1, jnp.int32), k_new=k[:, :2], v_new=k[:, :2, :1]),
     ValueError, "v_new must have shape"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=jnp.zeros(1, jnp.int32), num_splits=1000), ValueError,
     "num_splits"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=jnp.zeros(1, jnp.int32), block_table=jnp.zeros((2, 3), jnp.int32)),
     ValueError, "block_table must have one row"),
    (lambda q, k: cj.attention(q, k, k, sinks=jnp.zeros(4, F16)), TypeError, "sinks must be float32"),
    (lambda q, k: cj.attention(q, k, k, sinks=jnp.zeros(2, F32)), ValueError, r"sinks must have shape \(4,\)"),
    (lambda q, k: cj.attention(q, k, k, sinks=[0.0] * 4), TypeError, "sinks must be a JAX array"),
    (lambda q, k: cj.attention_varlen(q[0], k[0], k[0], jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32),
                                      max_seqlen_q=8, max_seqlen_k=8, sinks=jnp.zeros((1, 4), F32)), ValueError,
     "sinks must have shape"),
    (lambda q, k: cj.attention_varlen(q[0], k[0], k[0], jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.int32),
                                      max_seqlen_q=8, max_seqlen_k=8, sinks=jnp.zeros(4, jnp.int32)), TypeError,
     "sinks must be float32"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=jnp.zeros(1, jnp.int32), sinks=jnp.zeros(3, F32)), ValueError,
     "sinks must have shape"),
    (lambda q, k: cj.decode(q, k, k, cache_seqlens=jnp.zeros(1, jnp.int32), sinks=jnp.zeros(4, BF16)), TypeError,
     "sinks must be float32"),
    (lambda q, k: cj.merge_states(q[None], jnp.zeros((1, 1, 4, 15), F32)), ValueError, "lses must have shape"),
    (lambda q, k: cj.merge_states(q[None], jnp.zeros((1, 1, 4, 16), F16)), TypeError, "lses must be float32"),
    (lambda q, k: cj.merge_states([], []), ValueError, "at least one"),
]


@pytest.mark.parametrize("call, error, message", ERRORS, ids=[m for _, _, m in ERRORS])
def test_trace_time_errors_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        jax.eval_shape(call, Q, K)


def test_dropout_state_is_the_keys_bits_as_a_uint64_pair():
    words = np.asarray(cj.dropout_state(jax.random.key(7)))
    again = np.asarray(cj.dropout_state(jax.random.key(7)))
    other = np.asarray(cj.dropout_state(jax.random.key(8)))
    bits = np.asarray(jax.random.bits(jax.random.key(7), (3,), jnp.uint32))
    assert words.dtype == np.uint32 and words.shape == (4,)
    np.testing.assert_array_equal(words, again)
    assert (words != other).any()
    seed, offset = words.view(np.uint64)
    assert int(seed) == int(bits[0]) | int(bits[1]) << 32 and int(offset) == int(bits[2])
    raw = np.asarray(cj.dropout_state(jax.random.PRNGKey(7)))   # a raw uint32 (2,) key
    assert raw.shape == (4,) and raw[3] == 0


def test_command_buffer_option_is_read_when_traced(monkeypatch):
    def flags(d):
        q = S((1, 16, 2, d), F16)
        jaxpr = jax.make_jaxpr(lambda q: cj.attention(q, q, q))(q).jaxpr
        return [e.params["command_buffer_compatible"] for e in callbacks(jaxpr)]

    assert flags(64) == [True]   # on by default
    monkeypatch.setattr(cj, "COMMAND_BUFFERS", False)
    assert flags(64) == [False]
    monkeypatch.setattr(cj, "COMMAND_BUFFERS", True)
    assert flags(36) == [False]   # a head dim that costs padded copies is never recorded
