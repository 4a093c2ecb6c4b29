"""cuflash.interop.jax on the GPU: forward and gradients inside jax.jit against the float64
reference, under grad, scan and checkpoint; varlen; decode with and without append (donation);
merge_states; dropout from JAX keys; the docs' example; a small training step against JAX's own
attention. Needs JAX with a CUDA device (skipped otherwise).

Accuracy. Outputs follow cuflash's rule (cuflash.testing.assert_attention_close: float16/bfloat16 at
most twice the error of a plain same-dtype attention, float32 within 1e-5 relative). Gradients
follow tests/gpu/test_backward.py's rule with a JAX yardstick: float16/bfloat16 ``max|g - ref| <=
2 * max|g_base - ref| + max|g_out - ref| + atol * M``, ``g_base`` the gradient of a plain attention
in the dtype differentiated by JAX, ``g_out`` the float64 gradient from the stored (rounded)
output, ``M`` the largest |reference gradient|; float32 within 1e-4 relative. Where a yardstick
would need dropout in JAX, the JAX path is compared bit for bit with the same call from CuPy
(deterministic backward), and with the reference at a relative tolerance.

Every output buffer is filled with NaN bytes before cuflash writes it (``_jax_buffers.POISON``), so
an element never written fails. Inputs are fresh normal data (cuflash.testing.random_qkv).
"""

import pathlib
import re

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.gpu._hardware import jax_on_gpu  # noqa: E402

jax = jax_on_gpu()

import jax.numpy as jnp  # noqa: E402

import cupy  # noqa: E402

import cuflash  # noqa: E402
import cuflash.interop.jax as cj  # noqa: E402
import cuflash.testing as tt  # noqa: E402
from cuflash import reference  # noqa: E402
from tests.gpu._jax_outputs import poisoned_outputs  # noqa: E402,F401

pytestmark = pytest.mark.gpu

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "jax.md"


def _qkv(shape, dtype, seed):
    return tuple(jnp.asarray(x) for x in tt.random_qkv(shape, dtype, seed))


def _host(x):
    return np.asarray(x)


def _rng_state(key):
    return tuple(int(w) for w in _host(cj.dropout_state(key)).view(np.uint64))


def _naive(q, k, v, *, causal=False, scale=None, bias=None):
    """A plain attention in the inputs' dtype (the products rounded to it, the softmax in float32),
    differentiated by JAX: the yardstick of the gradient rule."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        seen = jnp.arange(sk)[None, :] <= jnp.arange(sq)[:, None] + sk - sq
        s = jnp.where(seen, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _assert_grad_close(got, ref, base, ref_out, dtype, name, largest):
    got, ref = _host(got).astype(np.float64), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    assert np.isfinite(got).all(), f"{name}: {int((~np.isfinite(got)).sum())} elements not finite"
    err = np.abs(got - ref).max()
    if dtype == "float32":
        rel = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300)
        assert rel <= 1e-4, f"{name}: relative error {rel:.2e} > 1e-4"
        return
    base_err = np.abs(_host(base).astype(np.float64) - ref).max()
    out_err = np.abs(np.asarray(ref_out) - ref).max()
    allowed = 2 * base_err + out_err + tt.DEFAULT_ATOL[dtype] * largest
    assert err <= allowed, (f"{name} ({dtype}): max error {err:.3e} > 2 * {base_err:.3e} + {out_err:.3e} + slack "
                            f"= {allowed:.3e}")


FORWARD_CASES = [
    ("bfloat16", dict(B=2, Sq=193, Sk=193, Hq=8, Hk=2, D=64), dict(causal=True)),
    ("float16", dict(B=1, Sq=100, Sk=260, Hq=4, Hk=4, D=128), dict(window=(64, 16), softcap=20.0)),
    ("float32", dict(B=2, Sq=70, Sk=90, Hq=4, Hk=1, D=36), dict(scale=0.3)),   # D % 8: padded copies
]


@pytest.mark.parametrize("dtype, shape, options", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_forward_under_jit_matches_the_reference(dtype, shape, options):
    q, k, v = _qkv(shape, dtype, seed=11)
    out, lse = jax.jit(lambda q, k, v: cj.attention(q, k, v, return_lse=True, **options))(q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == jnp.float32
    hq, kh, vh = _host(q), _host(k), _host(v)
    ref_out, ref_lse = reference.attention_forward(hq, kh, vh, **options)
    base = tt.baseline_attention(hq, kh, vh, **options)
    tt.assert_attention_close(_host(out), ref_out, base)
    tt.assert_attention_close(_host(lse), ref_lse, dtype="float32", name="lse", atol=1e-5)


GRAD_CASES = [
    ("bfloat16", dict(B=2, Sq=193, Sk=193, Hq=8, Hk=2, D=64), True),
    ("float32", dict(B=1, Sq=64, Sk=80, Hq=4, Hk=2, D=64), False),
]


@pytest.mark.parametrize("dtype, shape, causal", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_gradients_under_jit_grad_match_the_reference(dtype, shape, causal):
    q, k, v = _qkv(shape, dtype, seed=12)
    dout = _qkv(dict(shape, Sk=shape["Sq"], Hk=shape["Hq"]), dtype, seed=13)[0]

    def vjp(fn):
        out, pullback = jax.vjp(fn, q, k, v)
        return out, pullback(dout)

    out, grads = jax.jit(lambda: vjp(lambda q, k, v: cj.attention(q, k, v, causal=causal)))()
    _, base = jax.jit(lambda: vjp(lambda q, k, v: _naive(q, k, v, causal=causal)))()
    args = [_host(x) for x in (dout, q, k, v)]
    ref = reference.attention_backward(*args, causal=causal)
    ref_out = reference.attention_backward(*args, causal=causal, out=_host(out))
    largest = max(np.abs(r).max() for r in ref)
    for name, g, r, b, ro in zip(("dq", "dk", "dv"), grads, ref, base, ref_out):
        assert g.dtype == q.dtype
        _assert_grad_close(g, r, b, ro, dtype, name, largest)


def test_bias_gradient_with_mask_and_alibi():
    shape = dict(B=2, Sq=64, Sk=80, Hq=4, Hk=2, D=64)
    q, k, v = _qkv(shape, "float32", seed=14)
    rng = np.random.default_rng(15)
    bias = jnp.asarray(rng.standard_normal((1, 4, 64, 80)).astype(np.float32))
    keep = np.ones((2, 1, 1, 80), dtype=bool)
    keep[1, ..., 70:] = False
    alibi = jnp.asarray(rng.uniform(0.01, 0.1, 4).astype(np.float32))
    options = dict(mask=jnp.asarray(keep), alibi_slopes=alibi, scale=0.2)
    dout = jnp.asarray(rng.standard_normal((2, 64, 4, 64)).astype(np.float32))

    def loss(q, k, v, bias):
        return jnp.sum(cj.attention(q, k, v, bias=bias, **options) * dout)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    ref = reference.attention_backward(*(_host(x) for x in (dout, q, k, v)), bias=_host(bias), return_dbias=True,
                                       mask=keep, alibi_slopes=_host(alibi), scale=0.2)
    largest = max(np.abs(r).max() for r in ref[:3])
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref):
        _assert_grad_close(g, r, None, None, "float32", name, largest)
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype


def test_jax_path_is_the_cupy_path_bit_for_bit():
    """Same kernels, same buffers' contents: the JAX path adds nothing to the arithmetic."""
    shape = dict(B=2, Sq=130, Sk=200, Hq=8, Hk=4, D=64)
    q, k, v = _qkv(shape, "bfloat16", seed=16)
    dout = _qkv(dict(shape, Sk=130, Hk=8), "bfloat16", seed=17)[0]
    options = dict(causal=True, softcap=15.0)

    def run(q, k, v, dout):
        out, pullback = jax.vjp(lambda q, k, v: cj.attention(q, k, v, deterministic=True, **options), q, k, v)
        return out, pullback(dout)

    out, grads = jax.jit(run)(q, k, v, dout)
    cq, ck, cv, cd = (cupy.asarray(_host(x)) for x in (q, k, v, dout))
    c_out, c_lse, _ = cuflash.attention_forward(cq, ck, cv, **options)
    c_grads = cuflash.attention_backward(cd, cq, ck, cv, c_out, c_lse, deterministic=True, **options)
    np.testing.assert_array_equal(_host(out).view(np.uint16), c_out.get().view(np.uint16))
    for g, c in zip(grads, c_grads):
        np.testing.assert_array_equal(_host(g).view(np.uint16), c.get().view(np.uint16))


def test_dropout_follows_the_key():
    shape = dict(B=1, Sq=70, Sk=90, Hq=4, Hk=2, D=64)
    q, k, v = _qkv(shape, "bfloat16", seed=18)
    dout = _qkv(dict(shape, Sk=70, Hk=4), "bfloat16", seed=19)[0]
    options = dict(causal=True, dropout_p=0.3)

    @jax.jit
    def run(q, k, v, dout, key):
        out, pullback = jax.vjp(lambda q, k, v: cj.attention(q, k, v, dropout_rng=key, deterministic=True,
                                                             **options), q, k, v)
        return out, pullback(dout)

    key, other = jax.random.split(jax.random.key(20))
    out, grads = run(q, k, v, dout, key)
    again, _ = run(q, k, v, dout, key)
    changed, _ = run(q, k, v, dout, other)
    np.testing.assert_array_equal(_host(out).view(np.uint16), _host(again).view(np.uint16))
    differ = np.mean(_host(out) != _host(changed))
    assert differ > 0.3, f"another key changed only {differ:.1%} of the outputs"

    rng_state = _rng_state(key)
    hq, kh, vh, hd = (_host(x) for x in (q, k, v, dout))
    ref_out, _ = reference.attention_forward(hq, kh, vh, rng_state=rng_state, **options)
    base = tt.baseline_attention(hq, kh, vh, rng_state=rng_state, **options)
    tt.assert_attention_close(_host(out), ref_out, base)
    # The gradients: bit for bit the CuPy path's with the same (seed, offset), and near the reference.
    cq, ck, cv, cd = (cupy.asarray(x) for x in (hq, kh, vh, hd))
    c_out, c_lse, _ = cuflash.attention_forward(cq, ck, cv, generator=_generator(rng_state), **options)
    c_grads = cuflash.attention_backward(cd, cq, ck, cv, c_out, c_lse, rng_state=np.array(rng_state, np.uint64),
                                         deterministic=True, **options)
    ref = reference.attention_backward(hd, hq, kh, vh, rng_state=rng_state, **options)
    for name, g, c, r in zip(("dq", "dk", "dv"), grads, c_grads, ref):
        np.testing.assert_array_equal(_host(g).view(np.uint16), c.get().view(np.uint16))
        rel = np.linalg.norm(_host(g).astype(np.float64) - r) / np.linalg.norm(r)
        assert rel < 2e-2, f"{name}: relative error {rel:.2e} against the reference"


def _generator(rng_state):
    generator = cuflash.Generator(0)
    generator.set_state(np.array(rng_state, dtype=np.uint64))
    return generator


def test_scan_and_checkpoint_give_the_unrolled_gradients():
    q = _qkv(dict(B=2, Sq=96, Sk=96, Hq=4, Hk=4, D=64), "bfloat16", seed=21)[0]
    keys = jax.random.split(jax.random.key(22), 4)

    def layer(x, key):
        y = cj.attention(x, x, x, causal=True, dropout_p=0.1, dropout_rng=key, deterministic=True)
        return (x + 0.5 * y).astype(x.dtype), None

    def scanned(x, keys):
        return jax.lax.scan(jax.checkpoint(layer), x, keys)[0].astype(jnp.float32).sum()

    def unrolled(x, keys):
        for i in range(keys.shape[0]):
            x, _ = layer(x, keys[i])
        return x.astype(jnp.float32).sum()

    got = jax.jit(jax.grad(scanned))(q, keys)
    want = jax.jit(jax.grad(unrolled))(q, keys)
    assert np.isfinite(_host(got).astype(np.float32)).all()
    np.testing.assert_allclose(_host(got).astype(np.float32), _host(want).astype(np.float32), rtol=2e-2, atol=2e-2)
    assert np.abs(_host(got).astype(np.float32)).max() > 0


def _varlen_data(dtype, seed):
    lens_q, lens_k = [37, 100, 1], [50, 80, 20]
    cu_q, cu_k = np.cumsum([0] + lens_q).astype(np.int32), np.cumsum([0] + lens_k).astype(np.int32)
    shape = dict(B=1, Sq=int(cu_q[-1]), Sk=int(cu_k[-1]), Hq=4, Hk=2, D=64)
    q, k, v = (x[0] for x in tt.random_qkv(shape, dtype, seed))
    dout = tt.random_qkv(dict(shape, Sk=shape["Sq"], Hk=4), dtype, seed + 1)[0][0]
    return q, k, v, dout, cu_q, cu_k, dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_varlen_forward_and_gradients(dropout_p):
    q, k, v, dout, cu_q, cu_k, bounds = _varlen_data("float16", seed=23)
    key = jax.random.key(24)
    options = dict(causal=True, dropout_p=dropout_p, **bounds)

    @jax.jit
    def run(q, k, v, dout, cu_q, cu_k):
        fn = lambda q, k, v: cj.attention_varlen(q, k, v, cu_q, cu_k, dropout_rng=key,   # noqa: E731
                                                 deterministic=True, return_lse=True, **options)
        (out, lse), pullback = jax.vjp(fn, q, k, v)
        return out, lse, pullback((dout, jnp.zeros_like(lse)))

    out, lse, grads = run(*(jnp.asarray(x) for x in (q, k, v, dout, cu_q, cu_k)))
    rng_state = _rng_state(key) if dropout_p else None
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, rng_state=rng_state, **options)
    base = tt.baseline_attention_varlen(q, k, v, cu_q, cu_k, rng_state=rng_state, **options)
    tt.assert_attention_close(_host(out), ref_out, base)
    tt.assert_attention_close(_host(lse), ref_lse, dtype="float32", name="lse", atol=1e-5)
    cq, ck, cv, cd, ccq, cck = (cupy.asarray(x) for x in (q, k, v, dout, cu_q, cu_k))
    generator = _generator(rng_state) if dropout_p else None
    c_out, c_lse = cuflash.attention_varlen(cq, ck, cv, ccq, cck, generator=generator, return_lse=True, **options)
    c_grads = cuflash.attention_varlen_backward(
        cd, cq, ck, cv, c_out, c_lse, ccq, cck, deterministic=True, **options,
        rng_state=None if rng_state is None else np.array(rng_state, np.uint64))
    ref = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, rng_state=rng_state, **options)
    for name, g, c, r in zip(("dq", "dk", "dv"), grads, c_grads, ref):
        np.testing.assert_array_equal(_host(g).view(np.uint16), c.get().view(np.uint16))
        rel = np.linalg.norm(_host(g).astype(np.float64) - r) / np.linalg.norm(r)
        assert rel < 5e-3, f"{name}: relative error {rel:.2e} against the reference"


def _decode_inputs(seed, paged=False):
    rng = np.random.default_rng(seed)
    bf16 = tt._dtype("bfloat16")
    normal = lambda *s: tt.normal_data(rng, s, bf16)  # noqa: E731
    q = normal(2, 1, 8, 128)
    lens = np.array([100, 257], dtype=np.int32)
    if paged:
        k_cache, v_cache = normal(48, 16, 2, 128), normal(48, 16, 2, 128)
        table = rng.permutation(48).astype(np.int32).reshape(2, 24)
        return q, k_cache, v_cache, lens, table
    return q, normal(2, 300, 2, 128), normal(2, 300, 2, 128), lens, None


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_matches_the_reference(paged):
    q, k_cache, v_cache, lens, table = _decode_inputs(25, paged)
    extra = dict(block_table=jnp.asarray(table)) if paged else {}
    out, lse = jax.jit(lambda q, kc, vc, lens, **kw: cj.decode(q, kc, vc, cache_seqlens=lens, return_lse=True, **kw))(
        *(jnp.asarray(x) for x in (q, k_cache, v_cache, lens)), **extra)
    ref_out, ref_lse = reference.decode(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)
    base = tt.baseline_attention(q[:1], _first_sequence(k_cache, lens, table), _first_sequence(v_cache, lens, table),
                                 causal=True)
    tt.assert_attention_close(_host(out)[:1], ref_out[:1], base)
    tt.assert_attention_close(_host(lse), ref_lse, dtype="float32", name="lse", atol=1e-5)
    tt.assert_attention_close(_host(out).astype(np.float32), ref_out.astype(np.float32), dtype="float32",
                              rtol=1e-2, name="out (all sequences)")


def _first_sequence(cache, lens, table):
    """Sequence 0's cached rows as a (1, lens[0], Hk, D) array (the baseline's keys or values)."""
    if table is None:
        return cache[:1, :lens[0]]
    return np.concatenate([cache[page] for page in table[0]])[None, :lens[0]]


def test_decode_appends_into_a_donated_cache_in_place():
    q, k_cache, v_cache, lens, _ = _decode_inputs(26)
    rng = np.random.default_rng(27)
    bf16 = tt._dtype("bfloat16")
    k_new, v_new = tt.normal_data(rng, (2, 1, 2, 128), bf16), tt.normal_data(rng, (2, 1, 2, 128), bf16)
    step = jax.jit(lambda q, kc, vc, kn, vn, lens: cj.decode(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn),
                   donate_argnums=(1, 2))
    kc, vc = jnp.asarray(k_cache), jnp.asarray(v_cache)
    k_ptr, v_ptr = kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer()
    out, kc2, vc2 = step(*(jnp.asarray(x) for x in (q,)), kc, vc, jnp.asarray(k_new), jnp.asarray(v_new),
                         jnp.asarray(lens))
    assert kc.is_deleted() and vc.is_deleted(), "the donated caches were not consumed"
    assert (kc2.unsafe_buffer_pointer(), vc2.unsafe_buffer_pointer()) == (k_ptr, v_ptr), "the append was not in place"
    ref_out, _, k_after, v_after = reference.decode(q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new, v_new=v_new,
                                                    return_cache=True)
    np.testing.assert_array_equal(_host(kc2).view(np.uint16), k_after.view(np.uint16))
    np.testing.assert_array_equal(_host(vc2).view(np.uint16), v_after.view(np.uint16))
    tt.assert_attention_close(_host(out).astype(np.float32), ref_out.astype(np.float32), dtype="float32", rtol=1e-2)

    # Without donation the inputs stay as they were and the results are new arrays.
    kc, vc = jnp.asarray(k_cache), jnp.asarray(v_cache)
    keep = jax.jit(lambda q, kc, vc, kn, vn, lens: cj.decode(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn))
    _, kc3, _ = keep(jnp.asarray(q), kc, vc, jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(lens))
    np.testing.assert_array_equal(_host(kc).view(np.uint16), k_cache.view(np.uint16))
    np.testing.assert_array_equal(_host(kc3).view(np.uint16), k_after.view(np.uint16))


def test_merge_states_equals_one_call_over_all_keys():
    q, k, v = _qkv(dict(B=1, Sq=64, Sk=100, Hq=4, Hk=4, D=64), "float16", seed=28)

    @jax.jit
    def split_and_merge(q, k, v):
        o1, l1 = cj.attention(q, k[:, :40], v[:, :40], return_lse=True)
        o2, l2 = cj.attention(q, k[:, 40:], v[:, 40:], return_lse=True)
        return (o1, o2, l1, l2), cj.merge_states([o1, o2], [l1, l2])

    (o1, o2, l1, l2), (out, lse) = split_and_merge(q, k, v)
    c_out, c_lse = cuflash.merge_states([cupy.asarray(_host(x)) for x in (o1, o2)],
                                        [cupy.asarray(_host(x)) for x in (l1, l2)])
    np.testing.assert_array_equal(_host(out).view(np.uint16), c_out.get().view(np.uint16))
    np.testing.assert_array_equal(_host(lse), c_lse.get())
    ref_out, ref_lse = reference.attention_forward(*(_host(x) for x in (q, k, v)))
    tt.assert_attention_close(_host(lse), ref_lse, dtype="float32", name="lse", atol=1e-5)
    assert np.abs(_host(out).astype(np.float64) - ref_out).max() < 4e-3


def test_a_loss_that_reads_lse_gets_its_gradient():
    """out and lse both read by the loss: dq, dk, dv against the reference's with dlse (dense and varlen)."""
    shape = dict(B=2, Sq=90, Sk=70, Hq=4, Hk=2, D=64)    # causal, Sq > Sk: 20 rows see no key
    q, k, v = _qkv(shape, "float32", seed=30)
    rng = np.random.default_rng(31)
    dout = jnp.asarray(rng.standard_normal(q.shape).astype(np.float32))
    dlse = jnp.asarray(rng.standard_normal((2, 4, 90)).astype(np.float32))

    def loss(q, k, v):
        out, lse = cj.attention(q, k, v, causal=True, return_lse=True)
        return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    ref = reference.attention_backward(*(_host(x) for x in (dout, q, k, v)), causal=True, dlse=_host(dlse))
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        _assert_grad_close(g, r, None, None, "float32", name, max(np.abs(x).max() for x in ref))

    cu = jnp.asarray(np.array([0, 37, 120, 200], np.int32))
    qv, kv, vv = (x[0] for x in _qkv(dict(B=1, Sq=200, Sk=200, Hq=4, Hk=2, D=64), "float32", seed=32))
    dout_v = jnp.asarray(rng.standard_normal(qv.shape).astype(np.float32))
    dlse_v = jnp.asarray(rng.standard_normal((4, 200)).astype(np.float32))

    def varlen_loss(q, k, v):
        out, lse = cj.attention_varlen(q, k, v, cu, cu, max_seqlen_q=83, max_seqlen_k=83, causal=True,
                                       return_lse=True)
        return jnp.sum(out * dout_v) + jnp.sum(lse * dlse_v)

    grads = jax.jit(jax.grad(varlen_loss, argnums=(0, 1, 2)))(qv, kv, vv)
    ref = reference.attention_varlen_backward(*(_host(x) for x in (dout_v, qv, kv, vv)), _host(cu), _host(cu),
                                              causal=True, dlse=_host(dlse_v))
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        _assert_grad_close(g, r, None, None, "float32", name, max(np.abs(x).max() for x in ref))


def test_merged_partial_results_train_as_one_call():
    """Attention over two halves of the keys merged with merge_states (ring attention's step): its
    gradients are those of one call over all the keys (through the lse's gradient and merge's)."""
    q, k, v = _qkv(dict(B=2, Sq=64, Sk=100, Hq=4, Hk=2, D=64), "float32", seed=33)
    dout = jnp.asarray(np.random.default_rng(34).standard_normal(q.shape).astype(np.float32))

    def merged(q, k, v):
        o1, l1 = cj.attention(q, k[:, :40], v[:, :40], return_lse=True)
        o2, l2 = cj.attention(q, k[:, 40:], v[:, 40:], return_lse=True)
        out, _ = cj.merge_states([o1, o2], [l1, l2])
        return jnp.sum(out * dout)

    def whole(q, k, v):
        return jnp.sum(cj.attention(q, k, v) * dout)

    got = jax.jit(jax.grad(merged, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(whole, argnums=(0, 1, 2)))(q, k, v)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        g, w = _host(g).astype(np.float64), _host(w).astype(np.float64)
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel < 1e-4, f"{name}: relative difference {rel:.2e} from the single call"


def test_trace_time_errors_launch_nothing():
    q = jnp.zeros((1, 8, 4, 64), jnp.float16)
    with pytest.raises(ValueError, match="heads of q"):
        jax.jit(lambda q: cj.attention(q, q[:, :, :3], q[:, :, :3]))(q)
    with pytest.raises(TypeError, match="dropout_rng"):
        jax.jit(lambda q: cj.attention(q, q, q, dropout_p=0.1, dropout_rng=q))(q)


def test_command_buffers_give_the_same_results(monkeypatch):
    """With COMMAND_BUFFERS on, XLA may record the callbacks into CUDA graphs and replay them: fresh
    inputs at each call must still give the results of the plain route."""
    shape = dict(B=2, Sq=128, Sk=128, Hq=4, Hk=4, D=64)

    def run(q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: cj.attention(q, k, v, causal=True, deterministic=True), q, k, v)
        return out, pullback(jnp.ones_like(out))

    monkeypatch.setattr(cj, "COMMAND_BUFFERS", False)
    plain = jax.jit(run)
    monkeypatch.setattr(cj, "COMMAND_BUFFERS", True)
    graphed = jax.jit(lambda q, k, v: run(q, k, v))   # traced anew, with the option on
    for seed in (29, 30, 31):
        args = _qkv(shape, "bfloat16", seed)
        want, got = jax.tree.leaves(plain(*args)), jax.tree.leaves(graphed(*args))
        for w, g in zip(want, got):
            np.testing.assert_array_equal(_host(g).view(np.uint16), _host(w).view(np.uint16))


def test_command_buffers_with_independent_calls(monkeypatch):
    """Calls that do not depend on each other, recorded into one CUDA graph, which XLA may schedule
    side by side: each must still give the plain route's result (each recorded call has its own
    words and temporaries)."""
    args = _qkv(dict(B=4, Sq=512, Sk=512, Hq=8, Hk=8, D=64), "bfloat16", 32)

    def run(q, k, v):
        return [cj.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], causal=bool(i % 2)) for i in range(4)]

    monkeypatch.setattr(cj, "COMMAND_BUFFERS", False)
    want = jax.jit(run)(*args)
    monkeypatch.setattr(cj, "COMMAND_BUFFERS", True)
    graphed = jax.jit(lambda q, k, v: run(q, k, v))
    for _ in range(3):
        for w, g in zip(want, graphed(*args)):
            np.testing.assert_array_equal(_host(g).view(np.uint16), _host(w).view(np.uint16))


def test_docs_example_runs():
    text = DOCS.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/jax.md has no python block"
    namespace = {}
    for block in blocks:
        exec(compile(block, str(DOCS), "exec"), namespace)   # noqa: S102 - our own documentation


def test_training_step_tracks_jax_attention():
    """A transformer block scanned over 4 layers, trained 50 steps with Adam to continue sequences
    that step by 1, 2 or 3 (the step is read from the context): the losses with cuflash's attention
    stay within 1% of those with jax.nn.dot_product_attention.

    In float32 with full-precision matmuls: two bfloat16 attentions that each pass the accuracy rule
    still drift apart over 50 steps (3.6% at a loss of 0.2 was seen on an H200 with bfloat16 q, k, v),
    which would say nothing about cuflash."""
    optax = pytest.importorskip("optax")
    vocab, width, heads, seq, batch, layers = 64, 128, 4, 64, 8, 4
    rng = np.random.default_rng(32)

    def init(key):
        keys = jax.random.split(key, 6)
        dense = lambda k, *s: jax.random.normal(k, s, jnp.float32) * s[-2] ** -0.5  # noqa: E731
        return dict(embed=jax.random.normal(keys[0], (vocab, width)) * 0.02,
                    qkv=dense(keys[1], layers, width, 3 * width), proj=dense(keys[2], layers, width, width),
                    up=dense(keys[3], layers, width, 4 * width), down=dense(keys[4], layers, 4 * width, width),
                    head=dense(keys[5], width, vocab))

    def loss_fn(params, tokens, attend):
        def layer(x, p):
            h = x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
            q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
            q, k, v = (t.reshape(batch, seq, heads, width // heads) for t in (q, k, v))
            x = x + attend(q, k, v).reshape(batch, seq, width) @ p["proj"]
            h = x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
            return x + jax.nn.gelu(h @ p["up"]) @ p["down"], None

        stacked = {n: params[n] for n in ("qkv", "proj", "up", "down")}
        x, _ = jax.lax.scan(layer, params["embed"][tokens[:, :-1]], stacked)
        logits = x @ params["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def train(attend):
        params = init(jax.random.key(33))
        opt = optax.adam(3e-3)
        state = opt.init(params)

        @jax.jit
        def step(params, state, tokens):
            loss, grads = jax.value_and_grad(lambda p: loss_fn(p, tokens, attend))(params)
            updates, state = opt.update(grads, state)
            return optax.apply_updates(params, updates), state, loss

        losses = []
        for tokens in batches:
            params, state, loss = step(params, state, tokens)
            losses.append(float(loss))
        return np.array(losses)

    starts, strides = rng.integers(0, vocab, (50, batch, 1)), rng.integers(1, 4, (50, batch, 1))
    batches = [jnp.asarray((s + d * np.arange(seq + 1)) % vocab, jnp.int32) for s, d in zip(starts, strides)]
    with jax.default_matmul_precision("highest"):   # no TF32 in JAX's attention or the model
        ours = train(lambda q, k, v: cj.attention(q, k, v, causal=True))
        theirs = train(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    assert ours[-1] < 0.75 * ours[0], f"the loss did not fall: {ours[0]:.3f} -> {ours[-1]:.3f}"
    worst = np.max(np.abs(ours - theirs) / theirs)
    assert worst <= 0.01, f"losses differ by up to {worst:.2%} (ours {ours[-5:]}, jax's {theirs[-5:]})"


@pytest.mark.parametrize("paged", [False, True])
def test_chunked_prefill_over_a_cache_equals_cupy(paged):
    """cj.attention_varlen over a KV cache inside jax.jit (cache_seqlens, block_table): out and lse are
    cuflash.attention_varlen's bits from CuPy (the same kernel)."""
    rng = np.random.default_rng()
    B, Hq, Hk, D, L, page = 3, 8, 2, 128, 512, 64
    n = np.array([37, 0, 150])
    lens = (n + np.array([100, 5, 300])).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    bf16 = cuflash._checks.BFLOAT16
    q = rng.standard_normal((int(n.sum()), Hq, D), dtype=np.float32).astype(bf16)
    cache_shape = (B * L // page, page, Hk, D) if paged else (B, L, Hk, D)
    k_cache, v_cache = (rng.standard_normal(cache_shape, dtype=np.float32).astype(bf16) for _ in range(2))
    table = rng.permutation(B * L // page).astype(np.int32).reshape(B, L // page) if paged else None
    want, want_lse = cuflash.attention_varlen(
        cupy.asarray(q), cupy.asarray(k_cache), cupy.asarray(v_cache), cupy.asarray(cu), None,
        max_seqlen_q=int(n.max()), causal=True, cache_seqlens=cupy.asarray(lens),
        block_table=None if table is None else cupy.asarray(table), return_lse=True)
    step = jax.jit(lambda q, kc, vc, cu, lens, t: cj.attention_varlen(
        q, kc, vc, cu, None, max_seqlen_q=int(n.max()), causal=True, cache_seqlens=lens, block_table=t,
        return_lse=True))
    out, lse = step(*(None if x is None else jnp.asarray(x) for x in (q, k_cache, v_cache, cu, lens, table)))
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), want.view(cupy.uint16).get())
    np.testing.assert_array_equal(np.asarray(lse), want_lse.get())
