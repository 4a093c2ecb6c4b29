"""cuflash.interop.jax with user modifiers, traced without a GPU: score_mod= / mask_mod= whose arrays are
JAX arrays (traced or not) become operands of the callbacks, forward and backward, for attention,
attention_varlen and decode; a modifier's static part (expression, grad, scalars) keys the callbacks; the
gradient has no cotangent for the modifier's arrays (zeros); the trace-time errors name the argument (a
ScoreMod without the grad its backward needs, when the gradient is traced; an array that is not a JAX
array; too many arguments; a float scalar outside float32). The callbacks' rebuilding of the modifiers
around buffer views is checked with stand-in views. Skipped where JAX or CuPy is missing."""

import functools
import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("cupy")

import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.interop.jax as cj  # noqa: E402
from tests.cpu._jax_trace import callbacks  # noqa: E402
from cuflash.interop import _jax_modifiers  # noqa: E402

S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32
RELATIVE = "score + table[q_idx - kv_idx + off]"
DOCUMENT = "doc[b * n + q_idx] == doc[b * n + kv_idx]"
CAP = ("c * tanh(score / c)", "1.0 - tanh(score / c) * tanh(score / c)")


def _operand_shapes(eqn):
    return [tuple(v.aval.shape) for v in eqn.invars]


def _mods(table, doc, n):
    return (cuflash.ScoreMod(RELATIVE, table=table, off=n - 1),
            cuflash.MaskMod(DOCUMENT + " && kv_idx <= q_idx + w", doc=doc, n=n, w=2))


def test_attention_takes_traced_modifier_arrays_as_operands():
    B, N, H, D = 2, 48, 4, 64
    q = S((B, N, H, D), BF16)
    table, doc = S((2 * N - 1,), F32), S((B * N,), jnp.int32)

    def fn(q, k, v, table, doc):
        score_mod, mask_mod = _mods(table, doc, N)
        return cj.attention(q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod)

    out = jax.eval_shape(jax.jit(fn), q, q, q, table, doc)
    assert (out.shape, out.dtype) == (q.shape, q.dtype)
    forward = callbacks(jax.make_jaxpr(fn)(q, q, q, table, doc).jaxpr)
    assert len(forward) == 1 and _operand_shapes(forward[0]) == [q.shape] * 3 + [table.shape, doc.shape]

    def loss(q, k, v, table, doc):
        return fn(q, k, v, table, doc).astype(F32).sum()

    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2, 3)), q, q, q, table, doc)
    assert [(g.shape, g.dtype) for g in grads] == [(q.shape, BF16)] * 3 + [(table.shape, F32)]
    backward = [e for e in callbacks(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q, table, doc).jaxpr)
                if len(e.outvars) == 3]
    assert len(backward) == 1
    assert _operand_shapes(backward[0])[6:] == [table.shape, doc.shape]   # after dout, q, k, v, out, lse


def test_modifier_arrays_get_no_gradient():
    q = jnp.zeros((1, 8, 2, 64), BF16)
    table = jnp.ones(15, F32)

    def loss(table):
        return cj.attention(q, q, q, score_mod=cuflash.ScoreMod(RELATIVE, table=table, off=7)).astype(F32).sum()

    # The cotangent is a symbolic zero: the gradient traces to zeros without a backward for the table.
    jaxpr = jax.make_jaxpr(jax.grad(loss))(table).jaxpr
    assert all(len(e.outvars) != 3 for e in callbacks(jaxpr))   # no backward call at all
    assert jax.eval_shape(jax.grad(loss), table).shape == table.shape


def test_a_concrete_jax_array_closed_over_and_numpy_arrays_work():
    q = S((1, 32, 2, 64), BF16)
    table = jnp.arange(63, dtype=F32)
    from_numpy = cuflash.ScoreMod(RELATIVE, table=np.arange(63, dtype=np.float64), off=31)
    for score_mod in (cuflash.ScoreMod(RELATIVE, table=table, off=31), from_numpy):
        jaxpr = jax.make_jaxpr(lambda q: cj.attention(q, q, q, score_mod=score_mod))(q).jaxpr
        forward = callbacks(jaxpr)
        assert _operand_shapes(forward[0]) == [q.shape] * 3 + [(63,)]
        assert forward[0].invars[3].aval.dtype == F32   # NumPy float64 taken as JAX takes it (float32 by default)


def test_varlen_and_decode_take_modifiers():
    cu, t = S((4,), jnp.int32), S((300, 4, 64), BF16)
    table = S((511,), F32)
    cap = cuflash.ScoreMod(*CAP, c=20.0)

    def varlen(q, k, v, cu, table):
        return cj.attention_varlen(q, k, v, cu, cu, max_seqlen_q=256, max_seqlen_k=256, causal=True,
                                   score_mod=cuflash.ScoreMod(RELATIVE, table=table, off=255),
                                   mask_mod=cuflash.MaskMod("kv_idx + w >= q_idx", w=64))

    assert jax.eval_shape(varlen, t, t, t, cu, table).shape == t.shape
    forward = callbacks(jax.make_jaxpr(varlen)(t, t, t, cu, table).jaxpr)
    assert _operand_shapes(forward[0])[5:] == [table.shape]
    grads = jax.eval_shape(jax.grad(lambda *a: varlen(*a).astype(F32).sum(), argnums=(0, 1, 2)), t, t, t, cu, table)
    assert [g.shape for g in grads] == [t.shape] * 3
    grads = jax.eval_shape(jax.grad(lambda q: cj.attention_varlen(q, q, q, jnp.array([0, 300], jnp.int32),
                                                                  jnp.array([0, 300], jnp.int32), max_seqlen_q=300,
                                                                  max_seqlen_k=300, score_mod=cap).astype(F32).sum()),
                           t)
    assert grads.shape == t.shape

    qd, cache, lens, new = S((2, 1, 4, 128), BF16), S((2, 512, 2, 128), BF16), S((2,), jnp.int32), S((2, 1, 2, 128),
                                                                                                       BF16)
    doc = S((2 * 512,), jnp.int32)

    def decode(q, kc, vc, lens, kn, vn, table, doc):
        return cj.decode(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, return_lse=True,
                         score_mod=cuflash.ScoreMod(RELATIVE, table=table, off=511),
                         mask_mod=cuflash.MaskMod("doc[b * n + q_idx] == doc[b * n + kv_idx]", doc=doc, n=512))

    results = jax.eval_shape(decode, qd, cache, cache, lens, new, new, table, doc)
    assert [r.shape for r in results] == [qd.shape, (2, 4, 1), cache.shape, cache.shape]
    call = callbacks(jax.make_jaxpr(decode)(qd, cache, cache, lens, new, new, table, doc).jaxpr)[0]
    assert _operand_shapes(call)[-2:] == [table.shape, doc.shape]
    assert dict(call.params["input_output_aliases"]) == {1: 2, 2: 3}   # the caches, still in place


def test_a_score_mod_without_its_grad_fails_when_the_gradient_is_traced():
    q = S((1, 16, 2, 64), BF16)
    t, cu = S((16, 2, 64), BF16), S((2,), jnp.int32)
    cap = cuflash.ScoreMod(CAP[0], c=20.0)
    attention = lambda q: cj.attention(q, q, q, score_mod=cap)  # noqa: E731
    varlen = lambda q, cu: cj.attention_varlen(q, q, q, cu, cu, max_seqlen_q=16, max_seqlen_k=16,  # noqa: E731
                                               score_mod=cap)
    assert jax.eval_shape(attention, q).shape == q.shape   # the forward alone needs no grad
    assert jax.eval_shape(varlen, t, cu).shape == t.shape
    with pytest.raises(ValueError, match=r"cuflash.interop.jax.attention: score_mod .* pass grad="):
        jax.eval_shape(jax.grad(lambda q: attention(q).astype(F32).sum()), q)
    with pytest.raises(ValueError, match=r"cuflash.interop.jax.attention_varlen: score_mod .* pass grad="):
        jax.eval_shape(jax.grad(lambda q, cu: varlen(q, cu).astype(F32).sum()), t, cu)
    qz = jnp.zeros((1, 16, 2, 64), BF16)
    table_only = lambda t: cj.attention(qz, qz, qz, score_mod=cuflash.ScoreMod(  # noqa: E731
        CAP[0] + " + t[0]", c=20.0, t=t)).astype(F32).sum()
    assert jax.eval_shape(jax.grad(table_only), S((1,), F32)).shape == (1,)   # no backward runs: zeros, no error
    with_grad = cuflash.ScoreMod(*CAP, c=20.0)
    grad = jax.eval_shape(jax.grad(lambda q: cj.attention(q, q, q, score_mod=with_grad).astype(F32).sum()), q)
    assert grad.shape == q.shape


def test_bias_gradient_beside_a_score_mod_and_a_softcap_is_refused_when_traced():
    q, bias = S((1, 16, 2, 64), BF16), S((1, 2, 16, 16), F32)
    shift = cuflash.ScoreMod("score + 1.0")

    def loss(q, bias, softcap=0.0):
        return cj.attention(q, q, q, bias=bias, score_mod=shift, softcap=softcap).astype(F32).sum()

    assert jax.eval_shape(jax.grad(loss, argnums=1), q, bias).shape == bias.shape   # beside a ScoreMod alone
    capped = functools.partial(loss, softcap=30.0)
    assert jax.eval_shape(jax.grad(capped), q, bias).shape == q.shape   # bias not differentiated: fine
    with pytest.raises(ValueError, match="bias .* score_mod and a softcap"):
        jax.eval_shape(jax.grad(capped, argnums=1), q, bias)


class _NotAJaxArray:
    dtype, shape = np.dtype(np.float32), (8,)


Q = S((1, 16, 2, 64), BF16)
TRACED = S((8,), F32)
ERRORS = [
    (lambda q, t: cj.attention(q, q, q, score_mod=cuflash.ScoreMod("score + x[0]", x=_NotAJaxArray())), TypeError,
     r"score_mod argument x must be a JAX array .* got .*_NotAJaxArray"),
    (lambda q, t: cj.attention(q, q, q, mask_mod=cuflash.MaskMod("x[kv_idx] > 0.0", x=_NotAJaxArray())), TypeError,
     "mask_mod argument x must be a JAX array"),
    (lambda q, t: cj.decode(q, q, q, cache_seqlens=jnp.zeros(1, jnp.int32),
                            score_mod=cuflash.ScoreMod("score + x[0]", x=_NotAJaxArray())), TypeError,
     "score_mod argument x must be a JAX array"),
    (lambda q, t: cj.attention(q, q, q, score_mod=cuflash.MaskMod("kv_idx <= q_idx")), TypeError,
     "score_mod must be a cuflash.ScoreMod"),
    (lambda q, t: cj.attention(q, q, q, mask_mod="kv_idx <= q_idx"), TypeError, "mask_mod must be a cuflash.MaskMod"),
    (lambda q, t: cj.attention(q, q, q, score_mod=cuflash.ScoreMod("score + t[0]", t=t.astype(jnp.uint32))),
     TypeError, "argument array t has dtype uint32"),
    (lambda q, t: cj.attention(q, q, q, mask_mod=cuflash.MaskMod("t[kv_idx]", t=t)), ValueError,
     "mask_mod must give a bool"),
    (lambda q, t: cj.attention(q, q, q, score_mod=cuflash.ScoreMod("score * c", c=1e39)), ValueError,
     "score_mod argument c=1e.39 is outside float32's range"),
    (lambda q, t: cj.attention(q, q, q, score_mod=cuflash.ScoreMod(" + ".join(["score"] + [f"a{i}[0]"
                                                                                          for i in range(5)]),
                                                                   **{f"a{i}": t for i in range(5)}),
                               mask_mod=cuflash.MaskMod(" && ".join(f"b{i}[0] > 0.0" for i in range(4)),
                                                        **{f"b{i}": t for i in range(4)})),
     ValueError, "together take at most 8 array"),
]


@pytest.mark.parametrize("call, error, message", ERRORS, ids=[m for _, _, m in ERRORS])
def test_trace_time_errors_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        jax.eval_shape(call, Q, TRACED)


def test_the_static_part_is_the_key_the_scalars_and_the_layouts():
    table = jnp.zeros(31, F32)

    def static(off, table=table, grad=None):
        args = (RELATIVE,) if grad is None else (RELATIVE, grad)
        return _jax_modifiers.split(cuflash.ScoreMod(*args, table=table, off=off), None)[0]

    assert static(15) == static(15) and hash(static(15)) == hash(static(15))
    assert static(15) == static(15, table=jnp.ones(31, F32))            # other data, same layout
    assert static(15) != static(16)                                      # a new scalar: a new trace
    assert static(15) != static(15, table=jnp.zeros(32, F32))            # another shape
    assert static(15) != static(15, table=jnp.zeros(31, BF16))           # another dtype
    assert static(15) != static(15, grad="1.0")                          # another grad
    nan = [_jax_modifiers.split(cuflash.ScoreMod("score * c", c=float("nan")), None)[0] for _ in range(2)]
    assert nan[0] == nan[1]

    def callback_of(off):
        jaxpr = jax.make_jaxpr(lambda q: cj.attention(q, q, q, score_mod=cuflash.ScoreMod(RELATIVE, table=table,
                                                                                         off=off)))(Q).jaxpr
        return callbacks(jaxpr)[0].params["callback"]

    assert callback_of(15) is callback_of(15) and callback_of(15) is not callback_of(16)
    # The template holds no traced value (a cache may keep it).
    kept = static(15)
    assert isinstance(kept.score_mod.args.values["table"], jax.ShapeDtypeStruct)


class _View:
    """A stand-in for a CuPy view of an XLA buffer: a dtype, a shape and an address."""

    class _Data:
        def __init__(self, ptr):
            self.ptr = ptr

    def __init__(self, ptr, shape, dtype):
        self.data, self.shape, self.dtype = self._Data(ptr), shape, np.dtype(dtype)


def test_rebuild_puts_the_views_in_the_slots_and_remembers_them():
    table, doc = jnp.zeros(63, F32), jnp.zeros(64, jnp.int32)
    score_mod, mask_mod = _mods(table, doc, 32)
    mods, arrays = _jax_modifiers.split(score_mod, mask_mod)
    assert [a.shape for a in arrays] == [(63,), (64,)]
    assert mods.layouts == (((63,), np.dtype(np.float32)), ((64,), np.dtype(np.int32)))
    views = (_View(4096, (63,), np.float32), _View(8192, (64,), np.int32))
    rebuilt = mods.rebuild(views)
    assert rebuilt[0].args.values["table"] is views[0] and rebuilt[1].args.values["doc"] is views[1]
    assert rebuilt[0].call_parts() == (score_mod.call_parts()[0], (views[0],))
    assert rebuilt[1].call_parts() == (mask_mod.call_parts()[0], (views[1],))
    assert rebuilt[1].args.values["w"] == 2 and rebuilt[0].text == RELATIVE
    assert mods.rebuild((_View(4096, (63,), np.float32), _View(8192, (64,), np.int32))) is rebuilt   # by address
    moved = mods.rebuild((_View(4096, (63,), np.float32), _View(12288, (64,), np.int32)))
    assert moved is not rebuilt and moved[1].args.values["doc"].data.ptr == 12288
    scalars_only, none = _jax_modifiers.split(cuflash.ScoreMod("score * c", c=2.0), None)
    assert none == () and scalars_only.rebuild(()) == (scalars_only.score_mod, None)
