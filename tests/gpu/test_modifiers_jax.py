"""User modifiers (cuflash.ScoreMod, cuflash.MaskMod) through cuflash.interop.jax on the GPU, their array
arguments JAX arrays passed into ``jax.jit`` as arguments (traced) or closed over (constants).

- float32, against the float64 reference (cuflash.reference) evaluating the same expressions on NumPy
  copies of the arrays: docs/design.md §5's rule (relative error 1e-5 forward, 1e-4 gradients):
  ``jax.jit(jax.value_and_grad(...))`` of cj.attention (relative-position bias table, document mask,
  a capped ScoreMod with its grad, beside the built-in causal mask), cj.attention_varlen forward and
  gradients, cj.decode forward (contiguous with an append, paged; positions absolute in each sequence).
- bfloat16 (the tensor-core families), against cuflash's own call from CuPy on the same data with the
  same modifiers on CuPy arrays: bit for bit, forward and deterministic backward; again with
  ``COMMAND_BUFFERS`` on and fresh data at each call.
- The modifier's arrays get zero gradients.

Every output buffer is filled with NaN bytes before cuflash writes it (``_jax_buffers.POISON``); the data
is fresh random at every run. The trace-time behaviour is tested without a GPU in
tests/cpu/test_modifiers_jax.py.

Run: ``python -m pytest -q tests/gpu/test_modifiers_jax.py`` (skipped without JAX on a GPU).
"""

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.gpu._hardware import jax_on_gpu  # noqa: E402

jax = jax_on_gpu()

import jax.numpy as jnp  # noqa: E402

import cupy  # noqa: E402

import cuflash  # noqa: E402
import cuflash.interop.jax as cj  # noqa: E402
from cuflash import reference  # noqa: E402
from tests.gpu._jax_outputs import poisoned_outputs  # noqa: E402,F401

pytestmark = pytest.mark.gpu

RELATIVE = "score + table[h * n + q_idx - kv_idx + n - 1]"
DOCUMENT = "doc[b * n + q_idx] == doc[b * n + kv_idx]"
CAP = ("c * tanh(score / c)", "1.0 - tanh(score / c) * tanh(score / c)")


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _documents(rng, batch, n):
    """Per (sequence, position) document ids: a few documents of random lengths in each sequence."""
    ids = np.zeros((batch, n), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, n), size=3, replace=False))
        ids[b] = np.searchsorted(cuts, np.arange(n), side="right")
    return ids.reshape(-1)


def _mods(table, doc, n, c):
    """A relative-position bias under a cap (one ScoreMod with its grad), a document mask (a MaskMod)."""
    score_mod = cuflash.ScoreMod(f"c * tanh(({RELATIVE}) / c)",
                                 grad=f"1.0 - tanh(({RELATIVE}) / c) * tanh(({RELATIVE}) / c)", table=table, n=n, c=c)
    return score_mod, cuflash.MaskMod(DOCUMENT, doc=doc, n=n)


def test_attention_forward_and_gradients_against_the_reference():
    rng = np.random.default_rng()
    B, N, Hq, Hk, D = 2, 113, 4, 2, 64
    q, k, v, dout = (rng.standard_normal(s).astype(np.float32)
                     for s in ((B, N, Hq, D), (B, N, Hk, D), (B, N, Hk, D), (B, N, Hq, D)))
    table = rng.standard_normal(Hq * N + N).astype(np.float32)
    doc = _documents(rng, B, N)

    def loss(q, k, v, table, doc):
        score_mod, mask_mod = _mods(table, doc, N, 8.0)
        out = cj.attention(q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod)
        return jnp.sum(out * dout), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, out), grads = step(*(jnp.asarray(x) for x in (q, k, v, table, doc)))
    score_mod, mask_mod = _mods(table, doc, N, 8.0)
    ref_out, _ = reference.attention_forward(q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod)
    ref = reference.attention_backward(dout, q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod)
    assert _rel(out, ref_out) <= 1e-5
    for got, want, name in zip(grads[:3], ref, ("dq", "dk", "dv")):
        assert _rel(got, want) <= 1e-4, name
    assert not np.asarray(grads[3]).any()   # no gradient for a modifier's arrays: zeros

    # Fresh data through the same compiled step: the new arrays' values are read, not the first call's.
    table2, doc2 = rng.standard_normal(table.shape).astype(np.float32), _documents(rng, B, N)
    (_, out), _ = step(*(jnp.asarray(x) for x in (q, k, v, table2, doc2)))
    score_mod, mask_mod = _mods(table2, doc2, N, 8.0)
    ref_out, _ = reference.attention_forward(q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod)
    assert _rel(out, ref_out) <= 1e-5


def test_a_closed_over_modifier_and_a_scalar_change():
    """A modifier made outside the jitted function around a concrete JAX array (a constant of the program),
    and a new scalar value (a new trace, the same kernel)."""
    rng = np.random.default_rng()
    B, N, H, D = 1, 77, 2, 32
    q, k, v = (rng.standard_normal((B, N, H, D)).astype(np.float32) for _ in range(3))
    table = rng.standard_normal(H * N + N).astype(np.float32)
    for c in (5.0, 20.0):
        score_mod = cuflash.ScoreMod(f"c * tanh(({RELATIVE}) / c)", table=jnp.asarray(table), n=N, c=c)
        window = cuflash.MaskMod("kv_idx <= q_idx && q_idx - kv_idx <= w", w=16)
        out = jax.jit(lambda q, k, v: cj.attention(q, k, v, score_mod=score_mod, mask_mod=window))(q, k, v)
        ref, _ = reference.attention_forward(q, k, v, mask_mod=window, score_mod=cuflash.ScoreMod(
            f"c * tanh(({RELATIVE}) / c)", table=table, n=N, c=c))
        assert _rel(out, ref) <= 1e-5, c


def test_varlen_forward_and_gradients_against_the_reference():
    rng = np.random.default_rng()
    lengths = [33, 1, 120, 64]
    cu = np.cumsum([0] + lengths).astype(np.int32)
    total, n = int(cu[-1]), max(lengths)
    q, k, v = (rng.standard_normal((total, h, 64)).astype(np.float32) for h in (4, 2, 2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    table = rng.standard_normal(4 * n + n).astype(np.float32)
    doc = _documents(rng, len(lengths), n)

    def loss(q, k, v, table, doc):
        score_mod, mask_mod = _mods(table, doc, n, 6.0)
        out = cj.attention_varlen(q, k, v, jnp.asarray(cu), jnp.asarray(cu), max_seqlen_q=n, max_seqlen_k=n,
                                  causal=True, score_mod=score_mod, mask_mod=mask_mod)
        return jnp.sum(out * dout), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        *(jnp.asarray(x) for x in (q, k, v, table, doc)))
    score_mod, mask_mod = _mods(table, doc, n, 6.0)
    ref_out, _ = reference.attention_varlen(q, k, v, cu, cu, causal=True, score_mod=score_mod, mask_mod=mask_mod)
    ref = reference.attention_varlen_backward(dout, q, k, v, cu, cu, causal=True, score_mod=score_mod,
                                              mask_mod=mask_mod)
    assert _rel(out, ref_out) <= 1e-5
    for got, want, name in zip(grads, ref, ("dq", "dk", "dv")):
        assert _rel(got, want) <= 1e-4, name


@pytest.mark.parametrize("paged", [False, True])
def test_decode_forward_against_the_reference(paged):
    rng = np.random.default_rng()
    B, Hq, Hk, D, cap, new = 3, 8, 2, 128, 512, 2
    lens = np.array([0, 300, 77], np.int32)
    q = rng.standard_normal((B, new, Hq, D)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((B, new, Hk, D)).astype(np.float32) for _ in range(2))
    k_cache, v_cache = (rng.standard_normal((B, cap, Hk, D)).astype(np.float32) for _ in range(2))
    table = rng.standard_normal(Hq * cap + cap).astype(np.float32)
    doc = _documents(rng, B, cap)
    extra = {}
    if paged:   # pages of 64, shuffled
        page = 64
        order = rng.permutation(B * cap // page).astype(np.int32)
        extra["block_table"] = order.reshape(B, cap // page)
        k_cache, v_cache = (np.ascontiguousarray(x.reshape(B * cap // page, page, Hk, D)[np.argsort(order)])
                            for x in (k_cache, v_cache))

    def step(q, kc, vc, lens, kn, vn, table, doc, *table_pages):
        score_mod, mask_mod = _mods(table, doc, cap, 10.0)
        return cj.decode(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, return_lse=True, score_mod=score_mod,
                         mask_mod=mask_mod, block_table=table_pages[0] if table_pages else None)

    args = (q, k_cache, v_cache, lens, k_new, v_new, table, doc, *extra.values())
    out, lse, k_after, v_after = jax.jit(step)(*(jnp.asarray(x) for x in args))
    score_mod, mask_mod = _mods(table, doc, cap, 10.0)
    ref_out, ref_lse, k_ref, v_ref = reference.decode(q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new,
                                                      v_new=v_new, return_cache=True, score_mod=score_mod,
                                                      mask_mod=mask_mod, **extra)
    assert _rel(out, ref_out) <= 1e-5 and _rel(lse, ref_lse) <= 1e-5
    np.testing.assert_array_equal(np.asarray(k_after), k_ref)
    np.testing.assert_array_equal(np.asarray(v_after), v_ref)


def _bf16_case(rng, B=2, N=300, Hq=8, Hk=2, D=128):
    q, k, v, dout = (jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(jnp.bfloat16)
                     for s in ((B, N, Hq, D), (B, N, Hk, D), (B, N, Hk, D), (B, N, Hq, D)))
    return (q, k, v, dout, jnp.asarray(rng.standard_normal(Hq * N + N).astype(np.float32)),
            jnp.asarray(_documents(rng, B, N)))


def _cupy(x):
    return cupy.from_dlpack(x)


@pytest.mark.parametrize("command_buffers", [False, True])
def test_bfloat16_equals_cuflash_from_cupy(monkeypatch, command_buffers):
    """The tensor-core families: the JAX call gives cuflash's own CuPy call's bits (deterministic
    backward), with command buffers off and on (then with fresh data at each call of one program)."""
    monkeypatch.setattr(cj, "COMMAND_BUFFERS", command_buffers)
    rng = np.random.default_rng()
    N = 300

    def run(q, k, v, dout, table, doc):
        score_mod, mask_mod = _mods(table, doc, N, 8.0)
        out, pullback = jax.vjp(lambda q, k, v: cj.attention(q, k, v, causal=True, deterministic=True,
                                                              score_mod=score_mod, mask_mod=mask_mod), q, k, v)
        return (out, *pullback(dout))

    program = jax.jit(run)
    for _ in range(2 if command_buffers else 1):
        case = _bf16_case(rng, N=N)
        got = program(*case)
        q, k, v, dout, table, doc = (_cupy(x) for x in case)
        score_mod, mask_mod = _mods(table, doc, N, 8.0)
        out, lse, _ = cuflash.attention_forward(q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod)
        want = (out, *cuflash.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True,
                                                 score_mod=score_mod, mask_mod=mask_mod))
        for g, w, name in zip(got, want, ("out", "dq", "dk", "dv")):
            np.testing.assert_array_equal(np.asarray(g).view(np.uint16), w.get().view(np.uint16), err_msg=name)
