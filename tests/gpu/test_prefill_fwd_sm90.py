"""Decode's many new tokens on fwd_sm90 over the cache (cuflash/_prefill_plan.py, CUFLASH_KV_CACHE),
against cuflash.reference.decode (float64).

Each case is forced onto fwd_sm90 (``_prefill_plan.force_kernel``), whatever its number of new tokens,
and built by tests/gpu/test_decode.py's ``build_case``: slots past the sequences and pages no
sequence owns hold NaN, block_table entries past a sequence's last page are -1, outputs are
NaN-poisoned ``out=`` buffers, and after the call the whole cache must be the old one with the new
rows written at ``cache_seqlens``, bit for bit. Contiguous caches and pages of multiples of 8 rows go by
TMA (16, 48, 64: several boxes a tile, 48 in boxes of gcd(48, 128) = 16 rows; 128, 256: one), pages of
1 and 3 rows are copied row by row by the producer warpgroup. Paged caches come in both layouts: pages
of their own array, whose rows run on from page to page (one copy a box, "row_groups"), and K's and
V's pages side by side in one (pages, 2, page_size, H, D) array (a copy a box and column block, "tma").

Run: ``python -m pytest -q tests/gpu/test_prefill_fwd_sm90.py`` (skipped without an sm_90 GPU).
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cupy

import cuflash
import cuflash.testing as tt
from cuflash import _prefill_plan, reference
from cuflash._build.compile import device_arch
from cuflash._runtime import memo
from tests.gpu._hardware import gpu_available
from tests.gpu.test_decode import NAN, _capped, build_case, run_case
from tests.gpu.test_sinks_decode import run as run_with_sinks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available() or device_arch() != "sm_90a", reason="needs an sm_90 GPU")]

PAGE_SIZES = [None, 1, 3, 16, 48, 64, 128, 256]


@st.composite
def prefill_problems(draw):
    page_size = draw(st.sampled_from(PAGE_SIZES))
    edge = page_size or 128
    length = st.one_of(st.sampled_from([0, 1, edge - 1, edge, edge + 1, 127, 128, 129]), st.integers(0, 700))
    B = draw(st.integers(1, 3))
    hk = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 4]))
    opts = {}
    if not draw(st.booleans()):
        opts["causal"] = False
    if draw(st.integers(0, 3)) == 0:
        opts["window"] = (draw(st.sampled_from([-1, 0, 37, 200])), draw(st.sampled_from([-1, 0, 5])))
    modifier = draw(st.sampled_from([None, None, "softcap", "alibi"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if modifier == "softcap":
        opts["softcap"] = draw(st.sampled_from([5.0, 30.0]))
    elif modifier == "alibi":
        opts["alibi_slopes"] = rng.uniform(0.0, 0.3, draw(st.sampled_from([(hk * group,), (B, hk * group)]))
                                           ).astype(np.float32)
    if draw(st.integers(0, 3)) == 0:
        opts["sinks"] = rng.uniform(-2.0, 2.0, hk * group).astype(np.float32)
    return dict(dtype=draw(st.sampled_from(["float16", "bfloat16"])), B=B, Hq=hk * group, Hk=hk,
                D=draw(st.sampled_from([64, 128, 128, 256, 72])), Sq=draw(st.sampled_from([1, 17, 128, 129, 300])),
                lens=[draw(length) for _ in range(B)], page_size=page_size, append=draw(st.booleans()),
                options=opts, host_indices=draw(st.booleans()), kv_together=draw(st.booleans()),
                seed=draw(st.integers(0, 2**32 - 1)))


def kv_together(case):
    """The case's paged caches as the two halves of one (pages, 2, page_size, H, D) CuPy array (the
    layout of FlashInfer's and some vLLM backends' caches): each page's K rows are followed by its V rows."""
    kv = cupy.asarray(np.stack([case["k_cache"], case["v_cache"]], axis=1))
    return kv[:, 0], kv[:, 1]


@_capped(40)
@given(problem=prefill_problems())
def test_fwd_sm90_over_the_cache_matches_the_reference(xp_gpu, problem):
    """Shapes, page sizes, lengths (0, tile and page edges), appends, GQA, causal or not, windows,
    softcap, ALiBi, sinks; index arrays on the GPU or the host; paged K and V apart or together."""
    p = problem
    case = build_case(dtype=p["dtype"], B=p["B"], Hq=p["Hq"], Hk=p["Hk"], D=p["D"], Sq=p["Sq"], lens=p["lens"],
                      page_size=p["page_size"], append=p["append"], seed=p["seed"])
    options = dict(p["options"])
    sinks = options.pop("sinks", None)
    together = p["kv_together"] and p["page_size"] is not None and sinks is None
    with _prefill_plan.force_kernel("fwd_sm90"):
        if sinks is None:
            run_case(case, dtype=p["dtype"], options=options, host_indices=p["host_indices"],
                     device_cache=kv_together(case) if together else None)
        else:
            run_with_sinks(case, cupy.asarray(sinks), p["dtype"], 0, p["seed"], options)


@pytest.mark.parametrize("page_size", [None, 16, 64])
def test_a_long_chunk_runs_on_fwd_sm90_by_default(xp_gpu, monkeypatch, page_size):
    """Without forcing, a chunk of KV_CACHE_MIN_QUERIES new tokens or more is planned on fwd_sm90 and
    matches the reference; the decode kernel, forced on the same case, agrees with it."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    sq = cuflash.kernels.fwd_sm90.KV_CACHE_MIN_QUERIES + int(np.random.default_rng(seed).integers(0, 200))
    case = build_case(dtype="bfloat16", B=2, Hq=8, Hk=2, D=128, Sq=sq, lens=[900, 130], page_size=page_size,
                      append=True, seed=seed)
    planned = []
    real = _prefill_plan.prefill_plan
    monkeypatch.setattr(_prefill_plan, "prefill_plan", lambda *a, **k: planned.append(1) or real(*a, **k))
    memo.clear_memo()
    (out, lse), expected = run_case(case, dtype="bfloat16")
    assert planned, f"{sq} new tokens did not run on fwd_sm90"
    with _prefill_plan.force_kernel("decode"):
        (_, lse_decode), _ = run_case(case, dtype="bfloat16", expected=expected)
    assert len(planned) == 1
    assert float(cupy.abs(lse - lse_decode).max()) < 1e-3, f"seed {seed}"


@pytest.mark.parametrize("page_size, together, D, mode", [
    (None, False, 128, "tma"), (16, False, 128, "row_groups"), (16, True, 128, "tma"), (48, False, 64, "row_groups"),
    (64, False, 256, "row_groups"), (16, False, 72, "tma"), (3, False, 128, "gather")])
def test_how_the_cache_is_read(xp_gpu, page_size, together, D, mode):
    """The mode a layout is planned in (pages whose rows run on, head dims of whole 64-column blocks: one
    copy a box), and its result against the reference."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    case = build_case(dtype="bfloat16", B=2, Hq=4, Hk=2, D=D, Sq=150, lens=[333, 40], page_size=page_size,
                      append=True, seed=seed)
    kc, vc = kv_together(case) if together else (cupy.asarray(case["k_cache"]), cupy.asarray(case["v_cache"]))
    table = None if case["table"] is None else cupy.asarray(case["table"])
    args = (cupy.asarray(case["q"]), kc, vc)
    options = dict(cache_seqlens=cupy.asarray(case["lens"]), block_table=table, k_new=cupy.asarray(case["k_new"]),
                   v_new=cupy.asarray(case["v_new"]))
    with _prefill_plan.force_kernel("fwd_sm90"):
        info = cuflash.plan(cuflash.decode, *args, **options).plan.info
        assert (info["family"], info["kv_cache"]) == ("fwd_sm90", mode)
        run_case(case, dtype="bfloat16", device_cache=(kc, vc))


@pytest.mark.parametrize("page_size", [None, 16, 48])
def test_ragged_chunks_through_attention_varlen_on_fwd_sm90(xp_gpu, page_size):
    """attention_varlen over a cache (cu_seqlens_q, cache_seqlens, block_table) on fwd_sm90: each
    sequence's chunk (0 to ~300 rows, already in its cache) as the reference's decode of it alone."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    n = rng.integers(0, 300, 3)
    n[rng.integers(3)] = 0
    lens = n + rng.integers(0, 400, 3)
    case = build_case(dtype="float16", B=3, Hq=8, Hk=2, D=128, Sq=1, lens=lens.tolist(), page_size=page_size,
                      append=False, seed=seed)
    cu = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]), 8, 128), dtype=np.float32).astype(np.float16)
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    table = None if case["table"] is None else case["table"]
    with _prefill_plan.force_kernel("fwd_sm90"):
        got, lse = cuflash.attention_varlen(cupy.asarray(q), cupy.asarray(case["k_cache"]),
                                            cupy.asarray(case["v_cache"]), cupy.asarray(cu), None,
                                            max_seqlen_q=int(n.max()), cache_seqlens=cupy.asarray(case["lens"]),
                                            block_table=None if table is None else cupy.asarray(table),
                                            causal=True, return_lse=True, out=out)
    assert got.data.ptr == out.data.ptr
    with _prefill_plan.force_kernel("fwd_sm90"):   # out allocated by the call: the same packed layout
        again = cuflash.attention_varlen(cupy.asarray(q), cupy.asarray(case["k_cache"]), cupy.asarray(case["v_cache"]),
                                         cupy.asarray(cu), None, max_seqlen_q=int(n.max()),
                                         cache_seqlens=cupy.asarray(case["lens"]),
                                         block_table=None if table is None else cupy.asarray(table), causal=True)
    assert again.shape == q.shape
    assert bool((again.view(cupy.uint16) == got.view(cupy.uint16)).all())
    for b in range(3):
        if n[b] == 0:
            continue
        cache = {k: (case[k] if table is not None else case[k][b:b + 1]) for k in ("k_cache", "v_cache")}
        args = dict(cache_seqlens=case["lens"][b:b + 1], block_table=None if table is None else table[b:b + 1])
        want, want_lse = reference.decode(q[cu[b]:cu[b + 1]][None], cache["k_cache"], cache["v_cache"], **args)
        problems, _, _ = reference._decode._decode_sequences(q[cu[b]:cu[b + 1]][None], cache["k_cache"],
                                                             cache["v_cache"], **args)
        base = tt.baseline_attention(problems[0]["q"], problems[0]["k"], problems[0]["v"], **problems[0]["options"])
        tt.assert_attention_close(got[cu[b]:cu[b + 1]][None], want, base, dtype="float16",
                                  name=f"out[{b}] (seed {seed})")
        tt.assert_attention_close(lse[:, cu[b]:cu[b + 1]][None], want_lse, dtype="float32", name=f"lse[{b}]")


def test_value_head_dim_of_its_own(xp_gpu):
    """DeepSeek's (192, 128) over a paged cache with an append: out has v's 128 columns."""
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    B, Sq, Hq, Hk, page, lens = 2, 150, 4, 2, 64, np.array([300, 5], np.int32)
    f16 = lambda *s: rng.standard_normal(s, dtype=np.float32).astype(np.float16)  # noqa: E731
    pages = -(-(lens + Sq) // page)
    table = np.full((B, int(pages.max()) + 1), -1, np.int32)
    table[0, :pages[0]] = np.arange(pages[0])
    table[1, :pages[1]] = pages[0] + np.arange(pages[1])
    kc, vc = f16(int(pages.sum()), page, Hk, 192), f16(int(pages.sum()), page, Hk, 128)
    q, kn, vn = f16(B, Sq, Hq, 192), f16(B, Sq, Hk, 192), f16(B, Sq, Hk, 128)
    args = dict(cache_seqlens=lens, block_table=table, k_new=kn, v_new=vn)
    want, want_lse = reference.decode(q, kc, vc, **args)
    problems, _, _ = reference._decode._decode_sequences(q, kc, vc, **args)
    base = np.concatenate([tt.baseline_attention(p["q"], p["k"], p["v"], **p["options"]) for p in problems])
    out = cupy.full((B, Sq, Hq, 128), NAN, np.float16)
    with _prefill_plan.force_kernel("fwd_sm90"):
        got, lse = cuflash.decode(cupy.asarray(q), cupy.asarray(kc), cupy.asarray(vc), cache_seqlens=cupy.asarray(lens),
                                  block_table=cupy.asarray(table), k_new=cupy.asarray(kn), v_new=cupy.asarray(vn),
                                  out=out, return_lse=True)
    tt.assert_attention_close(got, want, base, dtype="float16", name="out")
    tt.assert_attention_close(lse, want_lse, dtype="float32", name="lse")


@pytest.mark.parametrize("bad, pattern", [
    (dict(dtype="float32"), "float32"),
    (dict(D=36), "16-byte aligned"),
    (dict(options={"mask": np.ones((1, 1, 1, 1), bool)}), "score modifiers"),
    (dict(num_splits=2), "num_splits"),
])
def test_forced_fwd_sm90_refuses_what_it_cannot_run(xp_gpu, bad, pattern):
    """A call fwd_sm90 cannot run, forced onto it, is a ValueError naming why, before any launch (a
    misaligned cache without an append: the decode kernel would run it on a copy)."""
    append = "D" not in bad
    case = build_case(dtype=bad.get("dtype", "float16"), B=1, Hq=4, Hk=2, D=bad.get("D", 64), Sq=3, lens=[40],
                      page_size=16, append=append, seed=1)
    kc, vc = cupy.asarray(case["k_cache"]), cupy.asarray(case["v_cache"])
    before = kc.get()
    new = dict(k_new=cupy.asarray(case["k_new"]), v_new=cupy.asarray(case["v_new"])) if append else {}
    with _prefill_plan.force_kernel("fwd_sm90"), pytest.raises(ValueError, match=pattern):
        cuflash.decode(cupy.asarray(case["q"]), kc, vc, cache_seqlens=cupy.asarray(case["lens"]),
                       block_table=cupy.asarray(case["table"]), num_splits=bad.get("num_splits", 0), **new,
                       **tt.as_device_options(bad.get("options", {}), cupy))
    assert np.array_equal(kc.get().view(np.uint16), before.view(np.uint16))


def test_bad_lengths_on_the_gpu_write_nothing(xp_gpu):
    """cache_seqlens on the GPU that do not fit the appends: the index check stops the append and the
    forward (the cache and out untouched) and the call raises with check=True."""
    case = build_case(dtype="bfloat16", B=2, Hq=4, Hk=2, D=128, Sq=130, lens=[10, 20], page_size=16, append=True,
                      seed=2)
    kc, vc = cupy.asarray(case["k_cache"]), cupy.asarray(case["v_cache"])
    before = kc.get()
    lens = cupy.asarray(np.array([10, 10_000], np.int32))
    out = cupy.full(case["q"].shape, NAN, dtype=case["q"].dtype)
    with _prefill_plan.force_kernel("fwd_sm90"), pytest.raises(ValueError, match="cache_seqlens"):
        cuflash.decode(cupy.asarray(case["q"]), kc, vc, cache_seqlens=lens, block_table=cupy.asarray(case["table"]),
                       k_new=cupy.asarray(case["k_new"]), v_new=cupy.asarray(case["v_new"]), out=out, check=True)
    assert np.array_equal(kc.get().view(np.uint16), before.view(np.uint16))
    assert bool(cupy.isnan(out).all())
