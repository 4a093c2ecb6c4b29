"""jax.vmap over cuflash.interop.jax on the GPU: each instance of a mapped call is the call on that
instance (JAX's contract for vmap), whether the mapped axis folds into the kernels' batch (attention,
its gradients, decode, merge_states) or runs one call per instance in a jax.lax.map loop (dropout,
mapped sinks, varlen).

Folded calls run the same kernels over a larger batch, so they are compared with the instances' own
calls within two units of the output dtype's rounding (an instance mixed up with another is off by
the data's size) and each with the float64 reference; calls made one per instance are the instances'
own calls, compared bit for bit. Outputs are poisoned with NaN before cuflash writes them; inputs
are fresh normal data.
"""

import numpy as np
import pytest

from tests.gpu._hardware import jax_on_gpu

jax = jax_on_gpu()

import jax.numpy as jnp  # noqa: E402

import cuflash.interop.jax as cj  # noqa: E402
import cuflash.testing as tt  # noqa: E402
from cuflash import reference  # noqa: E402
from tests.gpu._jax_outputs import poisoned_outputs  # noqa: E402,F401

pytestmark = pytest.mark.gpu

N = 3   # instances of the mapped axis


def _host(x):
    return np.asarray(x)


def _normal(rng, shape, dtype="bfloat16"):
    return tt.normal_data(rng, shape, tt._dtype(dtype))


def _instances(fn, args, in_axes):
    """``fn`` called on each instance of the mapped arguments (one jitted call each), stacked."""
    call = jax.jit(fn)
    outs = [call(*(x if axis is None else x[i] for x, axis in zip(args, in_axes))) for i in range(N)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def _assert_close_to_instances(mapped, own, name):
    """Within two units of bfloat16's rounding at the largest magnitude (another instance's data
    would be off by the data's size)."""
    mapped, own = _host(mapped).astype(np.float64), _host(own).astype(np.float64)
    assert mapped.shape == own.shape, f"{name}: shape {mapped.shape} != {own.shape}"
    assert np.isfinite(mapped).all(), f"{name}: not finite"
    err, allowed = np.abs(mapped - own).max(), 2 * 2.0 ** -8 * np.abs(own).max()
    assert err <= allowed, f"{name}: max difference {err:.3e} from the instances' own calls > {allowed:.3e}"


def _map_against_instances(fn, args, axes):
    """(out, lse) of ``jax.vmap(fn)`` under jit, checked against the instances' own calls: out within
    two units of rounding, lse within float32's."""
    out, lse = jax.jit(jax.vmap(fn, in_axes=axes))(*args)
    own_out, own_lse = _instances(fn, args, axes)
    _assert_close_to_instances(out, own_out, "out")
    np.testing.assert_allclose(_host(lse), _host(own_lse), rtol=1e-5, atol=1e-5)
    return out, lse


def _assert_same_bits(mapped, own, name):
    mapped, own = _host(mapped), _host(own)
    assert mapped.shape == own.shape, f"{name}: shape {mapped.shape} != {own.shape}"
    np.testing.assert_array_equal(mapped.view(np.uint8), own.view(np.uint8), err_msg=name)


def _qkv(rng, b=2, sq=100, sk=130, hq=8, hk=2, d=64, mapped_kv=True):
    n = (N,) if mapped_kv else ()
    return (_normal(rng, (N, b, sq, hq, d)), _normal(rng, (*n, b, sk, hk, d)), _normal(rng, (*n, b, sk, hk, d)))


@pytest.mark.parametrize("mapped_kv", [True, False], ids=["all-mapped", "kv-shared"])
def test_forward_folds_and_each_instance_is_its_own_call(mapped_kv):
    rng = np.random.default_rng(40)
    q, k, v = _qkv(rng, mapped_kv=mapped_kv)
    bias = _normal(rng, (N, 100, 130), "float32")                         # mapped, broadcast over B and heads
    keep = np.ones((2, 1, 1, 130), dtype=bool)
    keep[1, ..., 120:] = False                                            # not mapped, one per sequence
    options = dict(causal=True, mask=jnp.asarray(keep))

    def fn(q, k, v, bias):
        return cj.attention(q, k, v, bias=bias, return_lse=True, **options)

    axes = (0, 0, 0, 0) if mapped_kv else (0, None, None, 0)
    out, _ = _map_against_instances(fn, tuple(jnp.asarray(x) for x in (q, k, v, bias)), axes)
    for i in range(N):
        ki, vi = (k[i], v[i]) if mapped_kv else (k, v)
        ref_out, _ = reference.attention_forward(q[i], ki, vi, bias=bias[i], causal=True, mask=keep)
        base = tt.baseline_attention(q[i], ki, vi, bias=bias[i], causal=True, mask=keep)
        tt.assert_attention_close(_host(out[i]), ref_out, base)


def test_gradients_of_the_map_and_the_map_of_gradients():
    rng = np.random.default_rng(41)
    q, k, v = (jnp.asarray(x) for x in _qkv(rng))
    dout = jnp.asarray(_normal(rng, q.shape))

    def loss(q, k, v, dout):
        return jnp.sum(cj.attention(q, k, v, causal=True).astype(jnp.float32) * dout.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    per_map = jax.jit(jax.vmap(grad))(q, k, v, dout)
    of_map = jax.jit(jax.grad(lambda q, k, v, d: jnp.sum(jax.vmap(loss)(q, k, v, d)), argnums=(0, 1, 2)))(q, k, v, dout)
    own = _instances(grad, (q, k, v, dout), (0, 0, 0, 0))
    for name, a, b, c in zip(("dq", "dk", "dv"), per_map, of_map, own):
        _assert_close_to_instances(a, c, f"vmap(grad) {name}")
        _assert_close_to_instances(b, c, f"grad(vmap) {name}")
    ref = reference.attention_backward(*(_host(x[0]) for x in (dout, q, k, v)), causal=True)
    for name, g, r in zip(("dq", "dk", "dv"), per_map, ref):
        rel = np.linalg.norm(_host(g[0]).astype(np.float64) - r) / np.linalg.norm(r)
        assert rel < 5e-3, f"{name}: relative error {rel:.2e} against the reference"


def test_shared_keys_get_the_sum_of_the_instances_gradients():
    """k and v not mapped: grad of the mapped loss sums each instance's dk and dv."""
    rng = np.random.default_rng(42)
    q, k, v = (jnp.asarray(x) for x in _qkv(rng, mapped_kv=False))
    dout = jnp.asarray(_normal(rng, q.shape))

    def loss(q, k, v, dout):
        return jnp.sum(cj.attention(q, k, v, causal=True).astype(jnp.float32) * dout.astype(jnp.float32))

    mapped = jax.vmap(loss, in_axes=(0, None, None, 0))
    dk, dv = jax.jit(jax.grad(lambda *a: jnp.sum(mapped(*a)), argnums=(1, 2)))(q, k, v, dout)
    own = _instances(jax.grad(loss, argnums=(1, 2)), (q, k, v, dout), (0, None, None, 0))
    for name, g, parts in zip(("dk", "dv"), (dk, dv), own):
        total = _host(parts).astype(np.float64).sum(axis=0)
        got = _host(g).astype(np.float64)
        assert np.abs(got - total).max() <= 4 * 2.0 ** -8 * np.abs(total).max(), name


@pytest.mark.parametrize("mapped_key", [True, False], ids=["keys-mapped", "one-key"])
def test_dropout_runs_one_call_per_instance(mapped_key):
    """Dropout's mask is a function of the batch index: a mapped call is each instance's own call,
    forward and backward, bit for bit (deterministic backward)."""
    rng = np.random.default_rng(43)
    q, k, v = (jnp.asarray(x) for x in _qkv(rng, b=1, sq=70, sk=90, hq=4, hk=2))
    dout = jnp.asarray(_normal(rng, q.shape))
    keys = jax.random.split(jax.random.key(44), N) if mapped_key else jax.random.key(44)

    def run(q, k, v, dout, key):
        out, pullback = jax.vjp(lambda q, k, v: cj.attention(q, k, v, causal=True, dropout_p=0.3, dropout_rng=key,
                                                             deterministic=True), q, k, v)
        return out, pullback(dout)

    axes = (0, 0, 0, 0, 0 if mapped_key else None)
    mapped = jax.jit(jax.vmap(run, in_axes=axes))(q, k, v, dout, keys)
    own = _instances(run, (q, k, v, dout, keys), axes)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (mapped[0], *mapped[1]), (own[0], *own[1])):
        _assert_same_bits(a, b, name)


def test_mapped_sinks_run_one_call_per_instance():
    rng = np.random.default_rng(45)
    q, k, v = (jnp.asarray(x) for x in _qkv(rng))
    sinks = jnp.asarray(rng.uniform(-1, 2, (N, 8)).astype(np.float32))
    fn = lambda q, k, v, s: cj.attention(q, k, v, causal=True, sinks=s, return_lse=True)  # noqa: E731
    out, lse = jax.jit(jax.vmap(fn))(q, k, v, sinks)
    own_out, own_lse = _instances(fn, (q, k, v, sinks), (0, 0, 0, 0))
    _assert_same_bits(out, own_out, "out")
    _assert_same_bits(lse, own_lse, "lse")


def test_varlen_runs_one_call_per_instance():
    rng = np.random.default_rng(46)
    cu = np.array([[0, 50, 120, 200], [0, 10, 150, 200], [0, 100, 101, 200]], dtype=np.int32)
    q = jnp.asarray(_normal(rng, (N, 200, 4, 64)))
    k, v = (jnp.asarray(_normal(rng, (N, 200, 2, 64))) for _ in range(2))

    def fn(q, k, v, cu):
        return cj.attention_varlen(q, k, v, cu, cu, max_seqlen_q=140, max_seqlen_k=140, causal=True)

    args = (q, k, v, jnp.asarray(cu))
    _assert_same_bits(jax.jit(jax.vmap(fn))(*args), _instances(fn, args, (0, 0, 0, 0)), "out")
    grad = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=(0, 1, 2))
    for name, a, b in zip(("dq", "dk", "dv"), jax.jit(jax.vmap(grad))(*args), _instances(grad, args, (0, 0, 0, 0))):
        _assert_close_to_instances(a, b, name)


def _decode_case(rng, paged, mapped_cache):
    b, hk, d = 2, 2, 128
    q = _normal(rng, (N, b, 1, 8, d))
    lens = rng.integers(50, 250, (N, b)).astype(np.int32)
    n = (N,) if mapped_cache else ()
    if not paged:
        return q, _normal(rng, (*n, b, 300, hk, d)), _normal(rng, (*n, b, 300, hk, d)), lens, None
    pages = 40
    table = np.stack([rng.permutation(pages)[:2 * 16].reshape(b, 16) for _ in range(N)]).astype(np.int32)
    return q, _normal(rng, (*n, pages, 16, hk, d)), _normal(rng, (*n, pages, 16, hk, d)), lens, table


@pytest.mark.parametrize("paged, mapped_cache", [(False, True), (True, True), (True, False)],
                         ids=["contiguous", "paged", "paged-shared-pages"])
def test_decode_folds_and_each_instance_is_its_own_call(paged, mapped_cache):
    rng = np.random.default_rng(47)
    q, k_cache, v_cache, lens, table = _decode_case(rng, paged, mapped_cache)
    extra = (jnp.asarray(table),) if paged else ()

    def fn(q, kc, vc, lens, *table):
        return cj.decode(q, kc, vc, cache_seqlens=lens, block_table=table[0] if table else None, return_lse=True)

    axes = (0, 0 if mapped_cache else None, 0 if mapped_cache else None, 0, *((0,) if paged else ()))
    args = (jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(lens), *extra)
    out, _ = _map_against_instances(fn, args, axes)
    for i in range(N):
        kc, vc = (k_cache[i], v_cache[i]) if mapped_cache else (k_cache, v_cache)
        ref_out, _ = reference.decode(q[i], kc, vc, cache_seqlens=lens[i],
                                      block_table=None if table is None else table[i])
        tt.assert_attention_close(_host(out[i]).astype(np.float32), ref_out.astype(np.float32), dtype="float32",
                                  rtol=1e-2, name=f"instance {i}")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_appends_into_each_instances_cache(paged):
    """Mapped appends write each instance's new rows into its own cache (its own pages), in place
    when the caches are donated."""
    rng = np.random.default_rng(48)
    q, k_cache, v_cache, lens, table = _decode_case(rng, paged, mapped_cache=True)
    k_new, v_new = _normal(rng, (N, 2, 1, 2, 128)), _normal(rng, (N, 2, 1, 2, 128))
    extra = (jnp.asarray(table),) if paged else ()

    def fn(q, kc, vc, lens, kn, vn, *table):
        return cj.decode(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, block_table=table[0] if table else None)

    step = jax.jit(jax.vmap(fn), donate_argnums=(1, 2))
    kc, vc = jnp.asarray(k_cache), jnp.asarray(v_cache)
    k_ptr = kc.unsafe_buffer_pointer()
    out, kc2, vc2 = step(jnp.asarray(q), kc, vc, jnp.asarray(lens), jnp.asarray(k_new), jnp.asarray(v_new), *extra)
    assert kc2.unsafe_buffer_pointer() == k_ptr, "the mapped append was not in place"
    for i in range(N):
        ref_out, _, k_after, v_after = reference.decode(q[i], k_cache[i], v_cache[i], cache_seqlens=lens[i],
                                                        k_new=k_new[i], v_new=v_new[i], return_cache=True,
                                                        block_table=None if table is None else table[i])
        np.testing.assert_array_equal(_host(kc2[i]).view(np.uint16), k_after.view(np.uint16))
        np.testing.assert_array_equal(_host(vc2[i]).view(np.uint16), v_after.view(np.uint16))
        tt.assert_attention_close(_host(out[i]).astype(np.float32), ref_out.astype(np.float32), dtype="float32",
                                  rtol=1e-2, name=f"instance {i}")


def test_merge_states_folds():
    rng = np.random.default_rng(49)
    outs = jnp.asarray(_normal(rng, (N, 2, 2, 64, 4, 64)))
    lses = jnp.asarray(rng.standard_normal((N, 2, 2, 4, 64)).astype(np.float32))
    out, lse = jax.jit(jax.vmap(cj.merge_states))(outs, lses)
    own_out, own_lse = _instances(cj.merge_states, (outs, lses), (0, 0))
    _assert_same_bits(out, own_out, "out")
    _assert_same_bits(lse, own_lse, "lse")
