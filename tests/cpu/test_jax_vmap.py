"""jax.vmap over cuflash.interop.jax without a GPU: which mapped calls fold into one call over the
folded batch and which run one call per instance (the traced program's callbacks and their shapes),
under vmap, grad of vmap, vmap of grad, nested vmap, scan and checkpoint; the folding helpers on
concrete arrays; decode's folded block tables (each instance offset to its own pages) through a
stand-in kernel. Skipped where JAX (or CuPy, which the module imports) is missing, as in CI."""

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("cupy")

import jax.numpy as jnp  # noqa: E402

import cuflash  # noqa: E402
import cuflash.interop.jax as cj  # noqa: E402
from cuflash.interop import _jax_vmap  # noqa: E402
from tests.cpu._jax_trace import callbacks, equations  # noqa: E402

S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
N, B = 3, 2


def _batches(fn, *args):
    """The batch (first axis) of each callback's first operand in the traced program of ``fn``."""
    return [eqn.invars[0].aval.shape[0] for eqn in callbacks(jax.make_jaxpr(fn)(*args).jaxpr)]


def _qkv(mapped_kv=True):
    n = (N,) if mapped_kv else ()
    return S((N, B, 100, 8, 64), BF16), S((*n, B, 130, 2, 64), BF16), S((*n, B, 130, 2, 64), BF16)


def _attention(q, k, v, **options):
    return cj.attention(q, k, v, causal=True, **options)


def _loss(q, k, v):
    return jnp.sum(_attention(q, k, v).astype(F32))


def test_attention_folds_forward_and_gradients():
    q, k, v = _qkv()
    out = jax.eval_shape(jax.vmap(_attention), q, k, v)
    assert out.shape == q.shape
    assert _batches(jax.vmap(_attention), q, k, v) == [N * B]
    grads = jax.eval_shape(jax.vmap(jax.grad(_loss, argnums=(0, 1, 2))), q, k, v)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert _batches(jax.vmap(jax.grad(_loss, argnums=(0, 1, 2))), q, k, v) == [N * B, N * B]
    of_map = jax.grad(lambda q, k, v: jnp.sum(jax.vmap(_loss)(q, k, v)), argnums=(0, 1, 2))
    assert _batches(of_map, q, k, v) == [N * B, N * B]


def test_shared_keys_fold_and_get_summed_gradients():
    q, k, v = _qkv(mapped_kv=False)
    mapped = jax.vmap(_loss, in_axes=(0, None, None))
    grads = jax.eval_shape(jax.grad(lambda *a: jnp.sum(mapped(*a)), argnums=(0, 1, 2)), q, k, v)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert _batches(mapped, q, k, v) == [N * B]


def test_nested_maps_fold_into_one_batch():
    q = S((4, N, B, 64, 4, 64), BF16)
    assert _batches(jax.vmap(jax.vmap(lambda q: cj.attention(q, q, q))), q) == [4 * N * B]


@pytest.mark.parametrize("name, shape, rank", [("bias", (N, 100, 130), 4), ("mask", (N, 1, 1, 130), 4),
                                               ("alibi_slopes", (N, 8), 2)])
def test_mapped_score_arrays_fold_with_the_batch(name, shape, rank):
    q, k, v = _qkv()
    dtype = jnp.bool_ if name == "mask" else F32
    fn = jax.vmap(lambda q, k, v, x: _attention(q, k, v, **{name: x}))
    assert _batches(fn, q, k, v, S(shape, dtype)) == [N * B]


@pytest.mark.parametrize("case", ["dropout", "mapped sinks", "score_mod", "bias gradient"])
def test_calls_that_do_not_fold_run_once_per_instance(case):
    q, k, v = _qkv()
    if case == "dropout":
        fn = jax.vmap(lambda q, k, v: _attention(q, k, v, dropout_p=0.1, dropout_rng=jax.random.key(0)))
        assert _batches(fn, q, k, v) == [B]
        assert equations(jax.make_jaxpr(fn)(q, k, v).jaxpr, "scan"), "one call in a jax.lax.map loop"
    elif case == "mapped sinks":
        fn = jax.vmap(lambda q, k, v, s: _attention(q, k, v, sinks=s))
        assert _batches(fn, q, k, v, S((N, 8), F32)) == [B]
    elif case == "score_mod":
        mod = cuflash.ScoreMod("score * 0.5", grad="0.5")
        assert _batches(jax.vmap(lambda q, k, v: _attention(q, k, v, score_mod=mod)), q, k, v) == [B]
    else:   # dbias sums over axes that a folded call would share between instances
        def loss(q, k, v, bias):
            return jnp.sum(_attention(q, k, v, bias=bias).astype(F32))
        fn = jax.vmap(jax.grad(loss, argnums=(0, 3)), in_axes=(0, 0, 0, None))
        assert _batches(fn, q, k, v, S((100, 130), F32)) == [N * B, B]   # the forward folds


def test_varlen_runs_once_per_instance():
    q, cu = S((N, 300, 8, 64), BF16), S((N, 4), I32)
    fn = jax.vmap(lambda q, k, v, c: cj.attention_varlen(q, k, v, c, c, max_seqlen_q=200, max_seqlen_k=200))
    assert jax.eval_shape(fn, q, q, q, cu).shape == q.shape
    assert [e.invars[0].aval.shape for e in callbacks(jax.make_jaxpr(fn)(q, q, q, cu).jaxpr)] == [(300, 8, 64)]


def test_scan_and_checkpoint_around_a_map():
    xs = S((5, N, B, 64, 4, 64), BF16)

    def body(carry, x):
        return carry, jax.vmap(lambda q: cj.attention(q, q, q))(x)

    assert jax.eval_shape(lambda xs: jax.lax.scan(body, 0, xs)[1], xs).shape == xs.shape
    q = S((N, B, 64, 4, 64), BF16)
    loss = lambda q: jnp.sum(jax.checkpoint(jax.vmap(lambda q: cj.attention(q, q, q)))(q).astype(F32))  # noqa: E731
    assert jax.eval_shape(jax.grad(loss), q).shape == q.shape


def test_decode_and_merge_fold():
    q, lens = S((N, B, 1, 8, 64), BF16), S((N, B), I32)
    cache, new = S((N, B, 256, 2, 64), BF16), S((N, B, 1, 2, 64), BF16)
    fn = jax.vmap(lambda q, kc, vc, l, kn, vn: cj.decode(q, kc, vc, cache_seqlens=l, k_new=kn, v_new=vn))
    out, kc, vc = jax.eval_shape(fn, q, cache, cache, lens, new, new)
    assert (out.shape, kc.shape, vc.shape) == (q.shape, cache.shape, cache.shape)
    assert _batches(fn, q, cache, cache, lens, new, new) == [N * B]
    # A contiguous cache that every instance shares: one call each rather than N copies of it.
    shared = jax.vmap(lambda q, kc, vc, l: cj.decode(q, kc, vc, cache_seqlens=l), in_axes=(0, None, None, 0))
    assert _batches(shared, q, S((B, 256, 2, 64), BF16), S((B, 256, 2, 64), BF16), lens) == [B]
    outs, lses = S((N, 2, B, 64, 4, 64), BF16), S((N, 2, B, 4, 64), F32)
    out, lse = jax.eval_shape(jax.vmap(cj.merge_states), outs, lses)
    assert (out.shape, lse.shape) == ((N, B, 64, 4, 64), (N, B, 4, 64))
    assert [e.invars[0].aval.shape for e in callbacks(jax.make_jaxpr(jax.vmap(cj.merge_states))(outs, lses).jaxpr)] \
        == [(2, N * B, 64, 4, 64)]


def test_folding_helpers_on_concrete_arrays():
    x = jnp.arange(N * B * 5, dtype=F32).reshape(N, B, 5)
    assert np.array_equal(_jax_vmap.unfold(_jax_vmap.fold(x), N), x)
    assert np.array_equal(_jax_vmap.fold(x)[B + 1], x[1, 1])   # instance-major
    one = jnp.arange(B * 5, dtype=F32).reshape(B, 5)
    assert np.array_equal(_jax_vmap.fold_batch(one, False, N), jnp.tile(one, (N, 1)))
    # A (Sq, Sk) bias mapped over N: each folded sequence gets its instance's bias.
    bias = jnp.arange(N * 3 * 4, dtype=F32).reshape(N, 3, 4)
    folded = _jax_vmap.fold_broadcast(bias, True, N, B, 4)
    assert folded.shape == (N * B, 1, 3, 4)
    for i in range(N):
        for b in range(B):
            assert np.array_equal(folded[i * B + b, 0], bias[i])
    # Not mapped and without a batch axis: left as it is; with one: repeated for every instance.
    shared = bias[0]
    assert _jax_vmap.fold_broadcast(shared, False, N, B, 4) is shared
    per_sequence = jnp.arange(B * 4, dtype=F32).reshape(B, 1, 1, 4)
    assert np.array_equal(_jax_vmap.fold_broadcast(per_sequence, False, N, B, 4), jnp.tile(per_sequence, (N, 1, 1, 1)))


def _stand_in_decode_call(*key):
    """A decode "kernel" that writes each sequence's block table into out[b, 0, 0, :pages] and its
    length into out[b, 0, 1, 0], with cuflash's own fold rule."""
    def call(q, k_cache, v_cache, lens, table):
        out = jnp.zeros(q.shape, F32)
        out = out.at[:, 0, 0, :table.shape[1]].set(table.astype(F32)).at[:, 0, 1, 0].set(lens.astype(F32))
        return (out.astype(q.dtype),)
    return _jax_vmap.batchable(call, functools.partial(cj._decode_fold, key))


@pytest.mark.parametrize("mapped_cache", [True, False], ids=["own-pages", "shared-pages"])
def test_folded_block_tables_point_at_each_instances_pages(monkeypatch, mapped_cache):
    monkeypatch.setattr(cj, "_decode_call", _stand_in_decode_call)
    pages, per_sequence = 10, 4
    rng = np.random.default_rng(0)
    table = np.stack([rng.permutation(pages)[:B * per_sequence].reshape(B, per_sequence) for _ in range(N)])
    lens = rng.integers(1, per_sequence * 16, (N, B)).astype(np.int32)
    q = jnp.zeros((N, B, 1, 8, 64), BF16)
    cache = jnp.zeros(((N,) if mapped_cache else ()) + (pages, 16, 2, 64), BF16)
    axes = (0, 0 if mapped_cache else None, 0 if mapped_cache else None, 0, 0)
    out = jax.vmap(lambda q, kc, vc, l, t: cj.decode(q, kc, vc, cache_seqlens=l, block_table=t), in_axes=axes)(
        q, cache, cache, jnp.asarray(lens), jnp.asarray(table.astype(np.int32)))
    out = np.asarray(out.astype(F32))
    offsets = (np.arange(N) * pages)[:, None, None] if mapped_cache else 0
    np.testing.assert_array_equal(out[:, :, 0, 0, :per_sequence], table + offsets)
    np.testing.assert_array_equal(out[:, :, 0, 1, 0], lens)
