"""Forward attention on the GPU against the float64 reference, kernel family by kernel family.

Every test forces one kernel family (``with cuflash.force_kernel(...)``): ``fwd_sm90`` (on an
sm_90 GPU) and ``fwd_sm80`` for float16/bfloat16, ``fwd_simt`` for float32, so that a heuristic
change cannot silently stop testing a family. Calls fwd_sm90 cannot run (strides TMA cannot describe; it says so with a
ValueError) are rejected/skipped for that family only. Outputs are compared with :mod:`cuflash.reference` (float64, NumPy) under the
accuracy rule of :func:`cuflash.testing.assert_attention_close`: for 16-bit dtypes at most twice
the error of a plain same-dtype attention (:func:`cuflash.testing.baseline_attention`), for
float32 a relative error of 1e-5. ``lse`` is float32 whatever the inputs, so it is held to the
float32 rule. Every call writes into ``out=``/``lse=`` buffers poisoned with NaN, so an element
the kernel forgets to write fails the comparison.

Cost: the float64 reference runs on the host (and Philox for dropout in NumPy), so problems are
kept small (``max_scores`` bounds B * Hq * Sq * Sk) and each hypothesis test caps its number of
examples below the "gpu" profile's; the whole file should take about a minute on an H100 once
the kernels are compiled. The tests reach every compiled variant (dtype x head-dim bucket x
score-mods x dropout): ``bash benchmarks/gpu_check.sh`` compiles them all in parallel first, or
``bash benchmarks/gpu_check.sh --precompile-only DIR`` does it without a GPU for
``CUFLASH_CACHE_DIR=DIR``.
"""

import math
import zlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupy

import cuflash
import cuflash.testing as tt
from cuflash import reference
from tests.gpu._hardware import gpu_available as _gpu_available  # noqa: E402


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU found by CuPy")]

# (family, dtype) pairs: every family forced explicitly with the dtypes it serves.
KERNELS = [
    pytest.param("fwd_sm90", "float16", id="sm90-fp16"),
    pytest.param("fwd_sm90", "bfloat16", id="sm90-bf16"),
    pytest.param("fwd_sm80", "float16", id="sm80-fp16"),
    pytest.param("fwd_sm80", "bfloat16", id="sm80-bf16"),
    pytest.param("fwd_simt", "float32", id="simt-fp32"),
]

# Head dims: the specialisations, odd multiples of 8 (72, 80), and 36 / 250 which are not
# multiples of 8 (the padded path).
HEAD_DIMS = st.sampled_from([8, 32, 36, 64, 72, 80, 96, 128, 160, 192, 250, 256])
OPTION_HEAD_DIMS = st.sampled_from([32, 64, 80, 128])

NAN = float("nan")


def _capped(n):
    """Settings with at most ``n`` examples (fewer if the loaded profile asks for fewer): the
    float64 reference, not the GPU, is what each example costs."""
    base = settings.default
    return settings(max_examples=max(1, min(base.max_examples, n)), deadline=None,
                    suppress_health_check=list(base.suppress_health_check)
                    + [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


# ----------------------------------------------------------------------------- helpers

def _family_source_exists(family):
    here = Path(cuflash.__file__).resolve().parent
    return any((d / f"{family}.cu").exists()
               for d in (here / "cuda_src", here.parent / "cuda_src"))


@contextmanager
def forced(family):
    """Force ``family`` for the calls inside; skip if its source is not in this checkout."""
    if family is None:
        yield
        return
    if not _family_source_exists(family):
        pytest.skip(f"cuda_src/{family}.cu is not in this checkout")
    force = getattr(cuflash, "force_kernel", None)
    if force is None:
        import importlib
        force = importlib.import_module("cuflash.attention").force_kernel
    if family == "fwd_sm90" and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("fwd_sm90 needs an sm_90 GPU (H100/H200)")
    with force(family):
        try:
            yield
        except ValueError as exc:
            # What fwd_sm90 cannot run (strides that TMA cannot describe) is a ValueError naming
            # the obstacle, never a fallback: such examples are left to the other families
            # (rejected inside hypothesis, skipped elsewhere).
            if family != "fwd_sm90" or "cannot run this call" not in str(exc):
                raise
            import hypothesis
            if "varlen" not in str(exc) and hypothesis.currently_in_test_context():
                hypothesis.reject()
            pytest.skip(str(exc))


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes  # CuPy has no bfloat16 of its own (docs/design.md §7)
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _shape(B, Sq, Sk, Hq, Hk, D):
    return dict(B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hk=Hk, D=D)


def _qkv(shape, dtype, seed):
    return tt.random_qkv(shape, dtype, seed, xp=cupy)


def _device_options(options, dtype, *, bias_same_dtype=False):
    """Options with arrays on the GPU; optionally the bias in the input dtype."""
    opts = tt.as_device_options(options, cupy)
    if bias_same_dtype and "bias" in opts:
        opts["bias"] = opts["bias"].astype(_dtype(dtype))
    return opts


def _broadcast(opts, shape):
    """Mask and bias as zero-stride views of (B, Hq, Sq, Sk), as ``cupy.broadcast_to`` gives."""
    out = dict(opts)
    full = (shape["B"], shape["Hq"], shape["Sq"], shape["Sk"])
    for name in ("mask", "bias"):
        if name in out:
            out[name] = cupy.broadcast_to(out[name], full)
    return out


def run_forward(family, q, k, v, options, *, generator=None):
    """``attention_forward`` into NaN-poisoned ``out``/``lse`` buffers.

    Returns
    -------
    out : cupy.ndarray, shape (B, Sq, Hq, D)
    lse : cupy.ndarray of float32, shape (B, Hq, Sq)
    rng_state : numpy.ndarray of uint64, shape (2,), or None
    """
    B, Sq, Hq, D = q.shape
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    lse = cupy.full((B, Hq, Sq), NAN, dtype=cupy.float32)
    with forced(family):
        res = cuflash.attention_forward(q, k, v, out=out, lse=lse, generator=generator, **options)
    got_out, got_lse, rng_state = res
    assert got_out.shape == q.shape and got_out.dtype == q.dtype
    assert got_lse.shape == (B, Hq, Sq) and got_lse.dtype == cupy.float32
    if out.size:
        assert got_out.data.ptr == out.data.ptr, "out= buffer was not used"
    if lse.size:
        assert got_lse.data.ptr == lse.data.ptr, "lse= buffer was not used"
    return got_out, got_lse, rng_state


def _reference_options(options, rng_state):
    ref = {n: v for n, v in options.items() if n != "generator"}
    if ref.get("dropout_p", 0.0) > 0:
        ref["rng_state"] = rng_state
    return ref


def check_close(q, k, v, options, out, lse, rng_state, *, dtype):
    """``out`` and ``lse`` against the float64 reference under the accuracy rule."""
    ref_opts = _reference_options(options, rng_state)
    ref_out, ref_lse = reference.attention_forward(q, k, v, **ref_opts)
    base = tt.baseline_attention(q, k, v, **ref_opts) if dtype != "float32" else None
    tt.assert_attention_close(out, ref_out, base, dtype=dtype, name="out")
    tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")
    return ref_out, ref_lse


def _check_dropout_state(options, rng_state, generator, state_before):
    if options.get("dropout_p", 0.0) > 0:
        assert rng_state is not None
        np.testing.assert_array_equal(np.asarray(rng_state, dtype=np.uint64), state_before)
        assert generator.offset == int(state_before[1]) + 1
    else:
        assert rng_state is None
        assert generator.offset == int(state_before[1])


def _solve(family, dtype, shape, options, seed, *, bias_same_dtype=False, broadcast=False):
    """One whole check: fresh data, forced kernel, poisoned buffers, reference comparison."""
    q, k, v = _qkv(shape, dtype, seed)
    opts = _device_options(options, dtype, bias_same_dtype=bias_same_dtype)
    if broadcast:
        opts = _broadcast(opts, shape)
    generator = cuflash.Generator(seed % 2**64)
    state_before = generator.get_state()
    out, lse, rng_state = run_forward(family, q, k, v, opts, generator=generator)
    _check_dropout_state(opts, rng_state, generator, state_before)
    return check_close(q, k, v, opts, out, lse, rng_state, dtype=dtype), (q, k, v, out, lse)


# ----------------------------------------------------------------------------- properties

@st.composite
def shape_problems(draw):
    """Shapes straddling tile edges, all head dims, GQA/MQA, causal or not."""
    shape = draw(tt.attention_shapes(max_batch=2, head_dims=HEAD_DIMS, max_scores=2**19))
    options = {"causal": True} if draw(st.booleans()) else {}
    return dict(shape=shape, options=options, seed=draw(st.integers(0, 2**63 - 1)))


@pytest.mark.parametrize("family, dtype", KERNELS)
@_capped(50)
@given(problem=shape_problems())
def test_shapes_and_head_dims(family, dtype, problem):
    _solve(family, dtype, problem["shape"], problem["options"], problem["seed"])


@st.composite
def option_problems(draw):
    """Every option, drawn independently, so that random combinations are tried."""
    shape = draw(tt.attention_shapes(max_batch=2, head_dims=OPTION_HEAD_DIMS, max_scores=2**17))
    options = draw(tt.attention_options(shape))
    return dict(shape=shape, options=options, seed=draw(st.integers(0, 2**63 - 1)),
                bias_same_dtype=draw(st.booleans()), broadcast=draw(st.booleans()))


@pytest.mark.parametrize("family, dtype", KERNELS)
@_capped(50)
@given(problem=option_problems())
def test_option_combinations(family, dtype, problem):
    _solve(family, dtype, problem["shape"], problem["options"], problem["seed"],
           bias_same_dtype=problem["bias_same_dtype"], broadcast=problem["broadcast"])


# ----------------------------------------------------------------------------- each option

def _geometric_slopes(h):
    return (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)


def _mask(shape, density, seed):
    return np.random.default_rng(seed).random(shape) < density


def _bias(shape, seed, amplitude=2.0):
    return (amplitude * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


# (name, shape, options): each option alone at least once, plus broadcast shapes and combos.
B_, SQ_, SK_, HQ_, HK_, D_ = 2, 113, 129, 4, 2, 64
EACH_OPTION = [
    ("plain", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {}),
    ("square_1025", _shape(1, 1025, 1025, 1, 1, 64), {"causal": True}),
    ("causal_sq_lt_sk", _shape(B_, 17, 129, HQ_, HK_, D_), {"causal": True}),
    ("causal_sq_gt_sk", _shape(B_, 129, 17, HQ_, HK_, D_), {"causal": True}),
    ("causal_sq_1", _shape(B_, 1, 1025, HQ_, 1, D_), {"causal": True}),
    ("scale", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"scale": 0.3}),
    ("window_left", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"window": (16, -1)}),
    ("window_right", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"window": (-1, 5)}),
    ("window_both", _shape(B_, 200, 150, HQ_, HK_, D_), {"window": (7, 3)}),
    ("window_zero", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"window": (0, 0)}),
    ("window_causal", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"window": (20, 8), "causal": True}),
    ("softcap", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"softcap": 5.0, "scale": 1.0}),
    ("alibi_h", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"alibi_slopes": _geometric_slopes(HQ_)}),
    ("alibi_bh", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"alibi_slopes": np.random.default_rng(1).uniform(0, 1, (B_, HQ_)).astype(np.float32)}),
    ("alibi_causal", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"alibi_slopes": _geometric_slopes(HQ_), "causal": True}),
    ("mask_full", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"mask": _mask((B_, HQ_, SQ_, SK_), 0.5, 2)}),
    ("mask_2d", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"mask": _mask((SQ_, SK_), 0.3, 3)}),
    ("mask_keys_1d", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"mask": _mask((SK_,), 0.7, 4)}),
    ("mask_per_batch_key", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"mask": _mask((B_, 1, 1, SK_), 0.6, 5)}),
    ("mask_per_head_row", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"mask": _mask((1, HQ_, SQ_, 1), 0.8, 6)}),
    ("bias_full", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"bias": _bias((B_, HQ_, SQ_, SK_), 7)}),
    ("bias_2d", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"bias": _bias((SQ_, SK_), 8)}),
    ("bias_per_head", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"bias": _bias((1, HQ_, 1, 1), 9)}),
    ("bias_per_batch_key", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"bias": _bias((B_, 1, 1, SK_), 10)}),
    ("block_mask_default", _shape(1, 300, 400, 2, 1, D_),
     {"block_mask": _mask((1, 2, 3, 4), 0.5, 11)}),
    ("block_mask_64x32", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"block_mask": _mask((B_, 1, 2, 5), 0.5, 12), "block_size": (64, 32)}),
    ("block_mask_odd_blocks", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"block_mask": _mask((1, HQ_, 7, 3), 0.6, 13), "block_size": (17, 45)}),
    # Blocks smaller than a tile's share of the vote (a tile meets up to 43 x 27 of them).
    ("block_mask_small_blocks", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"block_mask": _mask((1, HQ_, 38, 26), 0.05, 21), "block_size": (3, 5)}),
    ("dropout_01", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"dropout_p": 0.1}),
    ("dropout_05_causal", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"dropout_p": 0.5, "causal": True}),
    ("everything", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"causal": True, "window": (50, -1), "softcap": 20.0, "alibi_slopes": _geometric_slopes(HQ_),
      "mask": _mask((1, 1, SQ_, SK_), 0.9, 14), "bias": _bias((B_, 1, SQ_, SK_), 15, 0.5),
      "block_mask": _mask((1, HQ_, 4, 3), 0.8, 16), "block_size": (32, 64), "dropout_p": 0.2}),
]


# A bias is tried as float32 and in the input dtype.
EACH_OPTION_CASES = [pytest.param(name, shape, options, False, id=name)
                     for name, shape, options in EACH_OPTION]
EACH_OPTION_CASES += [pytest.param(name, shape, options, True, id=name + "-bias_in_dtype")
                      for name, shape, options in EACH_OPTION if "bias" in options]


def _seed_of(name):
    return zlib.crc32(name.encode())  # stable across processes, unlike hash()


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("name, shape, options, bias_same_dtype", EACH_OPTION_CASES)
def test_each_option(family, dtype, name, shape, options, bias_same_dtype):
    _solve(family, dtype, shape, options, seed=_seed_of(name), bias_same_dtype=bias_same_dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape, options", [
    pytest.param(_shape(1, 1500, 1500, 4, 2, 128), {"causal": True}, id="1500-keys-back"),
    pytest.param(_shape(2, 300, 1400, 4, 4, 64), {"causal": True, "window": (700, 0)}, id="diag-1100-window"),
    pytest.param(_shape(2, 257, 257, 2, 1, 256), {"causal": True, "dropout_p": 0.2}, id="dropout"),
    pytest.param(_shape(1, 700, 600, 4, 2, 128), {"causal": True}, id="rows-without-keys"),
    pytest.param(_shape(2, 200, 200, 4, 2, 64), {"window": (-1, 0)}, id="window-right-0"),
])
def test_causal_alibi_as_column_biases(dtype, shape, options):
    """Where no visible key lies right of its query's diagonal, fwd_sm90 runs ALiBi as a bias of each
    key column and takes the rows' own terms back before the lse; slopes up to 1 per (sequence, head)
    put the far keys' biases near -1500. Without a right edge of 0 it keeps the per-element form."""
    seed = _seed_of("alibi_columns" + repr(shape) + repr(options) + dtype)
    slopes = np.random.default_rng(seed).uniform(0.0, 1.0, (shape["B"], shape["Hq"])).astype(np.float32)
    opts = dict(options, alibi_slopes=slopes)
    q, k, v = _qkv(shape, dtype, seed)
    for causal_opts, columns in ((opts, True), ({"alibi_slopes": slopes}, False)):
        info = cuflash.plan(cuflash.attention_forward, q, k, v, **_device_options(causal_opts, dtype)).plan.info
        assert (info["family"], info["on_plain_loop"]) == ("fwd_sm90", columns), causal_opts
    _solve("fwd_sm90", dtype, shape, opts, seed=seed)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape, options", [
    pytest.param(_shape(1, 1500, 1500, 4, 2, 128), {"causal": True, "softcap": 30.0}, id="causal-30"),
    pytest.param(_shape(2, 300, 700, 4, 4, 64), {"window": (200, 30), "softcap": 50.0, "scale": 1.0},
                 id="window-50-scale-1"),
    pytest.param(_shape(2, 257, 257, 2, 1, 256), {"softcap": 5.0, "dropout_p": 0.2}, id="dropout"),
    pytest.param(_shape(1, 700, 600, 4, 2, 128), {"causal": True, "softcap": 8.0}, id="rows-without-keys"),
])
def test_softcap_on_the_plain_loop(dtype, shape, options):
    """The softcap alone runs on fwd_sm90's loop without modifiers (raw scores capped, then the edge
    tiles' masks); scores up to the cap with scale 1."""
    seed = _seed_of("softcap_plain" + repr(shape) + repr(options) + dtype)
    q, k, v = _qkv(shape, dtype, seed)
    info = cuflash.plan(cuflash.attention_forward, q, k, v, **_device_options(options, dtype)).plan.info
    assert (info["family"], info["on_plain_loop"]) == ("fwd_sm90", True)
    _solve("fwd_sm90", dtype, shape, options, seed=seed)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind, shape, options, operand, tiled", [
    pytest.param("bias", _shape(2, 300, 456, 4, 2, 128), {"causal": True}, dict(shape=(300, 456)), True,
                 id="bias-causal-tails"),
    pytest.param("bias", _shape(1, 700, 600, 4, 2, 64), {"causal": True}, dict(shape=(4, 700, 600)), True,
                 id="bias-heads-rows-without-keys"),
    pytest.param("bias", _shape(2, 257, 384, 2, 1, 128), {"window": (100, 20), "scale": 0.3},
                 dict(shape=(2, 1, 257, 384)), True, id="bias-batches-window"),
    pytest.param("bias", _shape(2, 200, 328, 4, 4, 128), {}, dict(shape=(200, 328), rows_stride=512), True,
                 id="bias-rows-of-a-wider-array"),
    pytest.param("bias", _shape(1, 300, 456, 2, 2, 128), {"causal": True}, dict(shape=(300, 456), dtype="float32"),
                 False, id="bias-float32-by-element"),
    pytest.param("mask", _shape(2, 300, 464, 4, 2, 128), {"causal": True}, dict(shape=(300, 464)), True,
                 id="mask-causal-tails"),
    pytest.param("mask", _shape(2, 257, 512, 4, 2, 64), {"dropout_p": 0.2}, dict(shape=(2, 4, 257, 512), empty_rows=9),
                 True, id="mask-rows-all-hidden-dropout"),
    pytest.param("mask", _shape(1, 300, 456, 2, 2, 128), {}, dict(shape=(300, 456)), False,
                 id="mask-rows-apart-by-456-bytes"),
    pytest.param("mask", _shape(2, 300, 464, 4, 2, 128), {"causal": True}, dict(shape=(2, 1, 1, 464)), True,
                 id="key-mask-one-row"),
    pytest.param("bias", _shape(2, 257, 456, 4, 2, 64), {"window": (100, 20)}, dict(shape=(456,)), True,
                 id="key-bias-one-row"),
])
def test_bias_and_mask_as_tiles(dtype, kind, shape, options, operand, tiled):
    """A bias of q's dtype or a mask alone, rows apart by a multiple of 16 bytes, runs on fwd_sm90's loop
    without modifiers, read as tiles by TMA (broadcast heads and batches at coordinate 0, rows and keys
    past the ends zero-filled; broadcast rows, a key mask or bias, as tiles of one row); a float32 bias,
    or mask rows 456 bytes apart, element by element."""
    seed = _seed_of("score_tile" + kind + repr(shape) + repr(options) + dtype)
    operand = dict(operand)
    x = tt.score_tile_operand(kind, operand.pop("shape"), operand.pop("dtype", dtype), seed, cupy, **operand)
    opts = dict(_device_options(options, dtype), **{kind: x})
    q, k, v = _qkv(shape, dtype, seed)
    info = cuflash.plan(cuflash.attention_forward, q, k, v, **opts).plan.info
    assert (info["family"], info["score_tile"], info["on_plain_loop"]) == ("fwd_sm90", tiled, tiled)
    generator = cuflash.Generator(seed)
    out, lse, rng_state = run_forward("fwd_sm90", q, k, v, opts, generator=generator)
    check_close(q, k, v, opts, out, lse, rng_state, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bias_tile_infinities_where_hidden(dtype, head_dim):
    """The bias tile is S's starting accumulator, so its values meet qk before the edge tiles' causal
    masks: NaN and +inf where a key is hidden must not reach its row, -inf where it is seen hides it."""
    shape = _shape(2, 300, 456, 4, 2, head_dim)
    seed = _seed_of("bias_tile_hidden_infinities" + dtype + str(head_dim))
    opts = dict(_device_options({"causal": True}, dtype), bias=tt.bias_with_hidden_infinities(300, 456, dtype, seed, cupy))
    q, k, v = _qkv(shape, dtype, seed)
    assert cuflash.plan(cuflash.attention_forward, q, k, v, **opts).plan.info["score_tile"]
    out, lse, rng_state = run_forward("fwd_sm90", q, k, v, opts)
    assert not bool(cupy.isnan(out.astype(cupy.float32)).any())
    check_close(q, k, v, opts, out, lse, rng_state, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_causal_alibi_columns_with_sinks_and_varlen(dtype):
    """ALiBi as column biases beside sinks (the sink joins each row's true denominator) and under
    varlen, where each sequence has its own diagonal."""
    seed = _seed_of("alibi_columns_varlen" + dtype)
    rng = np.random.default_rng(seed)
    Hq, Hk, D = 4, 2, 128
    lens_q, lens_k = np.array([1, 300, 129, 64]), np.array([700, 300, 513, 64])
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    dt = tt._dtype(dtype)
    q = cupy.asarray(rng.standard_normal((int(cu_q[-1]), Hq, D)).astype(np.float32).astype(dt))
    k = cupy.asarray(rng.standard_normal((int(cu_k[-1]), Hk, D)).astype(np.float32).astype(dt))
    v = cupy.asarray(rng.standard_normal((int(cu_k[-1]), Hk, D)).astype(np.float32).astype(dt))
    slopes = cupy.asarray(rng.uniform(0.0, 1.0, (len(lens_q), Hq)).astype(np.float32))
    sinks = cupy.asarray(rng.uniform(-2.0, 4.0, Hq).astype(np.float32))
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    with cuflash.force_kernel("fwd_sm90"):
        _, lse = cuflash.attention_varlen(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k),
                                          max_seqlen_q=int(lens_q.max()), max_seqlen_k=int(lens_k.max()),
                                          causal=True, alibi_slopes=slopes, sinks=sinks, return_lse=True, out=out)
    for b in range(len(lens_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        args = [x[None] for x in (q[rows], k[keys], v[keys])]
        kw = dict(causal=True, alibi_slopes=slopes[b], sinks=sinks)
        ref_out, ref_lse = reference.attention_forward(*args, **kw)
        base = tt.baseline_attention(*args, **kw)
        tt.assert_attention_close(out[rows][None], ref_out, base, dtype=dtype, name=f"out[{b}] (seed {seed})")
        tt.assert_attention_close(lse[:, rows][None], ref_lse, dtype="float32", name=f"lse[{b}]")


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_mask_and_bias_as_broadcast_views(family, dtype):
    shape = _shape(B_, SQ_, SK_, HQ_, HK_, D_)
    options = {"mask": _mask((1, HQ_, 1, SK_), 0.5, 20), "bias": _bias((B_, 1, SQ_, 1), 21)}
    _solve(family, dtype, shape, options, seed=22, broadcast=True)


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_lse_is_taken_before_dropout(family, dtype):
    shape = _shape(B_, SQ_, SK_, HQ_, HK_, D_)
    q, k, v = _qkv(shape, dtype, 30)
    _, lse_plain, _ = run_forward(family, q, k, v, {"causal": True})
    out_drop, lse_drop, state = run_forward(family, q, k, v, {"causal": True, "dropout_p": 0.5},
                                            generator=cuflash.Generator(31))
    cupy.testing.assert_allclose(lse_drop, lse_plain, rtol=1e-5, atol=1e-5)
    check_close(q, k, v, {"causal": True, "dropout_p": 0.5}, out_drop, lse_drop, state,
                dtype=dtype)


# ----------------------------------------------------------------------------- masked rows

FULLY_MASKED = [
    # (name, shape, options): some or all rows see no key.
    ("causal_sq_gt_sk", _shape(B_, 150, 40, HQ_, HK_, D_), {"causal": True}),
    ("window_left_of_keys", _shape(B_, 130, 20, HQ_, HK_, D_), {"window": (5, 0)}),
    ("mask_rows", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"mask": np.broadcast_to(np.arange(SQ_)[:, None] % 3 != 0, (SQ_, SK_)).copy()}),
    ("mask_all_false", _shape(B_, SQ_, SK_, HQ_, HK_, D_), {"mask": np.zeros((1, 1), bool)}),
    ("block_mask_rows", _shape(B_, 200, SK_, HQ_, HK_, D_),
     {"block_mask": np.array([[True, False], [False, False]]).reshape(1, 1, 2, 2),
      "block_size": (128, 128)}),
    ("block_mask_all_false", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"block_mask": np.zeros((1, 1, 1, 1), bool)}),
    ("bias_minus_inf_rows", _shape(B_, SQ_, SK_, HQ_, HK_, D_),
     {"bias": np.where(np.arange(SQ_)[:, None] < 10, -np.inf, 0.0).astype(np.float32)
      * np.ones((1, SK_), np.float32)}),
    ("dropout_causal_sq_gt_sk", _shape(B_, 150, 40, HQ_, HK_, D_),
     {"causal": True, "dropout_p": 0.3}),
]


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("name, shape, options", FULLY_MASKED, ids=[c[0] for c in FULLY_MASKED])
def test_fully_masked_rows(family, dtype, name, shape, options):
    (ref_out, ref_lse), (_, _, _, out, lse) = _solve(family, dtype, shape, options,
                                                     seed=_seed_of(name))
    out_h = cupy.asnumpy(out).astype(np.float64)
    lse_h = cupy.asnumpy(lse)
    empty = np.isneginf(ref_lse)                                   # (B, Hq, Sq)
    assert empty.any(), "the case should have rows that see no key"
    assert not np.isnan(out_h).any() and not np.isnan(lse_h).any()
    assert np.isneginf(lse_h[empty]).all()
    rows = np.moveaxis(empty, 1, 2)                                # (B, Sq, Hq)
    assert (out_h[rows] == 0).all(), "rows that see no key must be exactly 0"


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_no_keys_at_all(family, dtype):
    # Sk = 0: every row sees nothing -> out 0, lse -inf, and every buffer element written.
    shape = _shape(2, 33, 0, 4, 2, 64)
    q, k, v = _qkv(shape, dtype, 41)
    out, lse, _ = run_forward(family, q, k, v, {})
    assert bool((out.astype(cupy.float32) == 0).all())
    assert bool(cupy.isneginf(lse).all())


# ----------------------------------------------------------------------------- NaN

NAN_CASES = ["q_row", "k_row", "k_element", "v_element", "bias_element"]


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("where", NAN_CASES)
def test_nan_propagates_to_exactly_the_rows_that_see_it(family, dtype, where):
    # Causal with Sq = Sk and a NaN key at j0: rows i >= j0 of the heads that use that kv head
    # must become NaN, every other row must stay finite (masked NaN must not leak through
    # 0 * NaN or -inf + NaN). For v only the column of the NaN goes bad, and only when every
    # row of the tile sees the key (the P @ V product of a masked key is 0 * NaN on tensor
    # cores), so the v case is non-causal.
    shape = _shape(2, 150, 150, 4, 2, 64)
    q, k, v = _qkv(shape, dtype, 50)
    b0, j0, g0, i0 = 1, 70, 1, 100
    options = {"causal": where != "v_element"}
    if where == "q_row":
        q[b0, i0, 2] = NAN
    elif where == "k_row":
        k[b0, j0, g0] = NAN
    elif where == "k_element":
        k[b0, j0, g0, 5] = NAN
    elif where == "v_element":
        v[b0, j0, g0, 5] = NAN
    else:
        bias = cupy.zeros((2, 4, 150, 150), dtype=cupy.float32)
        bias[b0, 3, i0, j0] = NAN      # seen (j0 <= i0)
        bias[b0, 3, 10, j0] = NAN      # not seen (j0 > 10): must not leak
        options["bias"] = bias
    out, lse, state = run_forward(family, q, k, v, options)
    # The reference defines exactly which elements are NaN; the rule checks NaN positions.
    ref_out, ref_lse = check_close(q, k, v, options, out, lse, state, dtype=dtype)
    assert np.isnan(ref_out).any() and not np.isnan(ref_out).all()


# ----------------------------------------------------------------------------- layouts

LAYOUTS = ["bhsd_transposed", "strided_heads", "batch_slice", "nan_padded_rows",
           "nan_padded_head_dim", "reversed_keys", "last_axis_strided"]


def _layout(x, layout):
    """A view of ``x`` (B, S, H, D) with the same values and the given memory layout."""
    B, S, H, D = x.shape
    if layout == "bhsd_transposed":
        return cupy.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if layout == "strided_heads":
        buf = cupy.full((B, S, 2 * H, D), NAN, dtype=x.dtype)
        buf[:, :, 1::2] = x
        return buf[:, :, 1::2]
    if layout == "batch_slice":
        buf = cupy.full((B + 2, S, H, D), NAN, dtype=x.dtype)
        buf[1:-1] = x
        return buf[1:-1]
    if layout == "nan_padded_rows":
        # Rows past the sequence end hold NaN: tails must never be read into a result.
        buf = cupy.full((B, S + 67, H, D), NAN, dtype=x.dtype)
        buf[:, :S] = x
        return buf[:, :S]
    if layout == "nan_padded_head_dim":
        buf = cupy.full((B, S, H, D + 40), NAN, dtype=x.dtype)
        buf[..., :D] = x
        return buf[..., :D]
    if layout == "reversed_keys":
        return x[:, ::-1].copy()[:, ::-1]  # negative sequence stride, same values
    if layout == "last_axis_strided":
        buf = cupy.full((B, S, H, 2 * D), NAN, dtype=x.dtype)
        buf[..., ::2] = x
        return buf[..., ::2]  # not contiguous in D: copied by cuflash, not an error
    raise AssertionError(layout)


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim", [36, 64, 128])
def test_non_contiguous_inputs(family, dtype, layout, head_dim):
    shape = _shape(2, 77, 143, 4, 2, head_dim)
    q, k, v = _qkv(shape, dtype, 60)
    qv, kv, vv = (_layout(x, layout) for x in (q, k, v))
    for a, b in ((qv, q), (kv, k), (vv, v)):
        assert a.shape == b.shape and bool((a == b).all())
    options = {"causal": True}
    out, lse, state = run_forward(family, qv, kv, vv, options)
    check_close(q, k, v, options, out, lse, state, dtype=dtype)


# ----------------------------------------------------------------------------- API surface

@pytest.mark.parametrize("family, dtype", KERNELS)
def test_attention_matches_attention_forward(family, dtype):
    shape = _shape(B_, SQ_, SK_, HQ_, HK_, D_)
    q, k, v = _qkv(shape, dtype, 70)
    out_f, lse_f, _ = run_forward(family, q, k, v, {"causal": True})
    poisoned = cupy.full(q.shape, NAN, dtype=q.dtype)
    with forced(family):
        out_a = cuflash.attention(q, k, v, causal=True)
        out_b, lse_b = cuflash.attention(q, k, v, causal=True, return_lse=True, out=poisoned)
    assert out_b.data.ptr == poisoned.data.ptr
    assert lse_b.shape == (B_, HQ_, SQ_) and lse_b.dtype == cupy.float32
    cupy.testing.assert_array_equal(out_a, out_f)
    cupy.testing.assert_array_equal(out_b, out_f)
    cupy.testing.assert_array_equal(lse_b, lse_f)


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_default_scale_is_inverse_sqrt_head_dim(family, dtype):
    shape = _shape(1, 65, 65, 2, 2, 80)
    q, k, v = _qkv(shape, dtype, 71)
    with forced(family):
        a = cuflash.attention(q, k, v)
        b = cuflash.attention(q, k, v, scale=1.0 / math.sqrt(80))
    cupy.testing.assert_allclose(a.astype(cupy.float32), b.astype(cupy.float32),
                                 rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_large_magnitude_inputs(family, dtype):
    # Scores of a few hundred: the online softmax must subtract the running max before exp.
    shape = _shape(2, 129, 257, 4, 1, 128)
    q, k, v = _qkv(shape, dtype, 80)
    q = (q.astype(cupy.float32) * 30).astype(q.dtype)
    for options in ({}, {"causal": True}, {"softcap": 50.0}):
        out, lse, state = run_forward(family, q, k, v, options)
        assert bool(cupy.isfinite(out.astype(cupy.float32)).all())
        assert bool(cupy.isfinite(lse).all())
        check_close(q, k, v, options, out, lse, state, dtype=dtype)


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("growth", [3.0, 12.0])
@pytest.mark.parametrize("rising_towards", ["first_key", "last_key"])
def test_row_maximum_grows_at_every_key_tile(family, dtype, growth, rising_towards):
    # Key tiles run from the last to the first (fwd_sm80, fwd_simt) or from the first to the last
    # (fwd_sm90), so scores that rise towards the first keys, or towards the last, raise every
    # row's maximum at every tile, by `growth` log2 units per 64 keys: by a little (less than 8
    # per tile of 64 or 128 keys), the online softmax keeps its old reference point and its p
    # exceed 1 (lazy rescaling); by a lot, it moves the reference and rescales O at each tile.
    # (Scores stay below ~60: beyond that float32's own rounding of s exceeds its 1e-5 rule.)
    B, Sq, Sk, D = 1, 70, 450, 64
    q, k, v = _qkv(_shape(B, Sq, Sk, 2, 1, D), dtype, 90 + int(growth))
    steps = Sk - np.arange(Sk) if rising_towards == "first_key" else 1 + np.arange(Sk)
    score = growth / math.log2(math.e) * steps / 64   # natural units, key j
    q = q.astype(cupy.float32)
    k = k.astype(cupy.float32)
    q[..., 0] = 1.0
    k[0, :, 0, 0] = cupy.asarray(score * math.sqrt(D))   # times q[..., 0] = 1 and the scale 1/sqrt(D)
    q, k = q.astype(v.dtype), k.astype(v.dtype)
    for options in ({}, {"causal": True}):
        out, lse, state = run_forward(family, q, k, v, options)
        check_close(q, k, v, options, out, lse, state, dtype=dtype)


@pytest.mark.parametrize("family, dtype", [k for k in KERNELS if k.values[1] != "float32"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", ["jump_at_key_0", "step_at_key_0", "jump_at_a_late_key", "step_at_a_late_key",
                                  "all_scores_large"])
def test_score_far_above_the_rows_maximum(family, dtype, head_dim, case):
    # A key met after a row's first tile carries a score far above the row's running maximum:
    # key 0 when tiles run from the last to the first (fwd_sm80), key Sk - Sq (the last key that
    # every row sees under the causal mask, past the first tile) when they run from the first to
    # the last (fwd_sm90). A score of 100 there (natural units, 144 in log2) makes fwd_sm90's
    # speculative softmax, which takes a tile's exponentials against the old maximum, overflow,
    # and it must redo the tile exactly. A score of 10 (14 in log2) moves the maximum past the
    # slack without overflowing: the redo must still win over the speculative values. With every
    # score near 100 and a causal or windowed mask, rows whose first tiles were fully masked meet
    # their first keys with no maximum yet. (float32 is left out: scores of 100 carry more
    # rounding than its 1e-5 rule; see the test above.)
    B, Sq, Sk = 1, 70, 450
    q, k, v = _qkv(_shape(B, Sq, Sk, 2, 1, head_dim), dtype, 96 + head_dim)
    q = q.astype(cupy.float32)
    k = k.astype(cupy.float32)
    q[..., 0] = 1.0
    if case != "all_scores_large":
        jump = 100.0 if case.startswith("jump") else 10.0
        key = 0 if case.endswith("key_0") else Sk - Sq
        k[:, key, :, 0] = jump * math.sqrt(head_dim)   # times q[..., 0] = 1 and the scale 1/sqrt(D)
    else:
        k[..., 0] = 100.0 * math.sqrt(head_dim)
    q, k = q.astype(v.dtype), k.astype(v.dtype)
    for options in ({}, {"causal": True}, {"window": (20, 0)}):
        out, lse, state = run_forward(family, q, k, v, options)
        check_close(q, k, v, options, out, lse, state, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_automatic_kernel_choice(dtype, head_dim):
    # No forcing: whatever the heuristics pick (fwd_sm90 on Hopper, later) obeys the same rule.
    shape = _shape(2, 257, 300, 4, 2, head_dim)
    for options in ({}, {"causal": True}):
        _solve(None, dtype, shape, options, seed=90 + head_dim)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_sm90_three_consumer_warpgroups(dtype, head_dim):
    # Full attention at D = 64 over >= 2048 query rows runs fwd_sm90 with three consumer warpgroups
    # (192 rows a CTA; kernels.fwd_sm90.sm90_consumers): chosen for this shape (a last m-block of 180
    # rows, Sq != Sk, GQA) and right, out and lse; the causal call of the same shape keeps two, and
    # takes three too where its rows reach SM90_WIDE_MIN_ROWS_CAUSAL (lowered here to this shape's,
    # so that the float64 reference stays small).
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("fwd_sm90 needs an sm_90 GPU (H100/H200)")
    from cuflash import kernels
    from cuflash._runtime import memo as _memo
    shape = _shape(2, 2100, 2222, 4, 2, head_dim)
    assert shape["Sq"] % 192 and kernels.fwd_sm90.SM90_WIDE_MIN_ROWS <= shape["Sq"]
    assert shape["Sq"] < kernels.fwd_sm90.SM90_WIDE_MIN_ROWS_CAUSAL
    q, k, v = _qkv(shape, dtype, 96 + head_dim)
    for causal, consumers, causal_min_rows in ((False, 3, None), (True, 2, None), (True, 3, shape["Sq"])):
        with pytest.MonkeyPatch.context() as mp:
            if causal_min_rows is not None:
                mp.setattr(kernels.fwd_sm90, "SM90_WIDE_MIN_ROWS_CAUSAL", causal_min_rows)
                _memo.clear_memo()   # the remembered plans chose with the threshold in force
            with forced("fwd_sm90"):
                planned = cuflash.plan(cuflash.attention, q, k, v, causal=causal)
            assert planned.plan.info["consumers"] == consumers
            out, lse, state = run_forward(None, q, k, v, {"causal": causal})
            check_close(q, k, v, {"causal": causal}, out, lse, state, dtype=dtype)
        _memo.clear_memo()


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_runs_on_the_current_stream(family, dtype):
    shape = _shape(2, 129, 129, 4, 4, 64)
    q, k, v = _qkv(shape, dtype, 95)
    expected, _, _ = run_forward(family, q, k, v, {})
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        # Inputs made on this stream; the kernel must be ordered after them on it.
        q2, k2, v2 = (x.copy() for x in (q, k, v))
        with forced(family):
            out = cuflash.attention(q2, k2, v2)
    stream.synchronize()
    cupy.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sm90_work_counter_per_stream(dtype):
    # fwd_sm90's CTAs take (m-block, head, batch) items from a counter that each launch leaves at
    # 0; more items than SMs, calls alternating between two streams, and every result must be
    # bitwise the same as a lone call on the default stream (the item order changes nothing).
    from cuflash._runtime import launch as _launch
    shape = _shape(3, 1000, 1100, 8, 2, 128)   # 8 m-blocks x 8 heads x 3 = 192 items
    q, k, v = _qkv(shape, dtype, 97)
    expected, lse, state = run_forward("fwd_sm90", q, k, v, {"causal": True})
    check_close(q, k, v, {"causal": True}, expected, lse, state, dtype=dtype)
    cupy.cuda.Device().synchronize()   # the streams below do not wait for the default stream
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    outs = []
    with forced("fwd_sm90"):
        for i in range(6):
            with streams[i % 2]:
                outs.append(cuflash.attention(q, k, v, causal=True))
    device = cupy.cuda.Device().id
    for stream in streams:
        stream.synchronize()
        assert int(_launch.stream_state(device, stream.ptr)._words[0]) == 0
    null = cupy.cuda.get_current_stream().ptr
    assert int(_launch.stream_state(device, null)._words[0]) == 0
    for out in outs:
        cupy.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("family, dtype", KERNELS)
@pytest.mark.parametrize("empty", ["batch", "queries", "batch_and_queries"])
def test_zero_size_inputs(family, dtype, empty):
    B, Sq, Sk, Hq, Hk, D = 2, 33, 40, 4, 2, 64
    if empty == "batch":
        B = 0
    elif empty == "queries":
        Sq = 0
    else:
        B, Sq = 0, 0
    q = cupy.empty((B, Sq, Hq, D), dtype=_dtype(dtype))
    k = cupy.empty((B, Sk, Hk, D), dtype=_dtype(dtype))
    v = cupy.empty((B, Sk, Hk, D), dtype=_dtype(dtype))
    with forced(family):
        out, lse, state = cuflash.attention_forward(q, k, v, causal=True)
        out2 = cuflash.attention(q, k, v)
    assert out.shape == (B, Sq, Hq, D) and out.dtype == q.dtype and out2.shape == out.shape
    assert lse.shape == (B, Hq, Sq) and lse.dtype == cupy.float32
    assert state is None


# ----------------------------------------------------------------------------- generator

def _dropout_call(family, q, k, v, generator, p=0.5):
    with forced(family):
        return cuflash.attention_forward(q, k, v, dropout_p=p, generator=generator)


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_same_seed_and_offset_give_identical_output(family, dtype):
    q, k, v = _qkv(_shape(2, 65, 130, 4, 2, 64), dtype, 100)
    a_out, a_lse, a_state = _dropout_call(family, q, k, v, cuflash.Generator(1234))
    b_out, b_lse, b_state = _dropout_call(family, q, k, v, cuflash.Generator(1234))
    np.testing.assert_array_equal(a_state, [1234, 0])
    np.testing.assert_array_equal(a_state, b_state)
    cupy.testing.assert_array_equal(a_out, b_out)
    cupy.testing.assert_array_equal(a_lse, b_lse)
    # set_state replays any (seed, offset), and the reference agrees with it.
    g = cuflash.Generator(1)
    g.set_state(np.array([2**40 + 7, 5], dtype=np.uint64))
    c_out, c_lse, c_state = _dropout_call(family, q, k, v, g)
    np.testing.assert_array_equal(c_state, [2**40 + 7, 5])
    assert g.offset == 6
    check_close(q, k, v, {"dropout_p": 0.5}, c_out, c_lse, c_state, dtype=dtype)


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_consecutive_calls_draw_fresh_dropout_masks(family, dtype):
    q, k, v = _qkv(_shape(2, 65, 130, 4, 2, 64), dtype, 101)
    g = cuflash.Generator(99)
    first, _, s1 = _dropout_call(family, q, k, v, g)
    second, _, s2 = _dropout_call(family, q, k, v, g)
    assert int(s1[1]) == 0 and int(s2[1]) == 1 and int(s1[0]) == int(s2[0]) == 99
    assert not bool((first == second).all())
    # p = 0 neither uses nor advances the generator.
    with forced(family):
        _, _, s3 = cuflash.attention_forward(q, k, v, dropout_p=0.0, generator=g)
    assert s3 is None and g.offset == 2


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_manual_seed_makes_default_generator_reproducible(family, dtype):
    q, k, v = _qkv(_shape(1, 40, 70, 2, 1, 64), dtype, 102)
    cuflash.manual_seed(2024)
    a1, _, sa1 = _dropout_call(family, q, k, v, None)
    a2, _, sa2 = _dropout_call(family, q, k, v, None)
    cuflash.manual_seed(2024)
    b1, _, sb1 = _dropout_call(family, q, k, v, None)
    b2, _, sb2 = _dropout_call(family, q, k, v, None)
    np.testing.assert_array_equal(sa1, [2024, 0])
    np.testing.assert_array_equal(sa2, [2024, 1])
    np.testing.assert_array_equal(sa1, sb1)
    np.testing.assert_array_equal(sa2, sb2)
    cupy.testing.assert_array_equal(a1, b1)
    cupy.testing.assert_array_equal(a2, b2)
    assert cuflash.default_generator().offset == 2


# ----------------------------------------------------------------------------- varlen

def _varlen_inputs(cu_q, cu_k, Hq, Hk, D, dtype, seed):
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q, k, v = _qkv(_shape(1, total_q, total_k, Hq, Hk, D), dtype, seed)
    return q[0], k[0], v[0]


def _run_varlen(family, q, k, v, cu_q, cu_k, options, generator=None):
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    with forced(family):
        got, lse = cuflash.attention_varlen(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k),
                                            max_seqlen_q=int(np.diff(cu_q).max()),
                                            max_seqlen_k=int(np.diff(cu_k).max()),
                                            return_lse=True, out=out, generator=generator,
                                            **options)
    assert got.data.ptr == out.data.ptr or out.size == 0
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == cupy.float32
    return got, lse


@st.composite
def varlen_problems(draw, allow=tt.VARLEN_OPTIONS):
    cu_q, cu_k = draw(tt.varlen_seqlens(max_batch=4, max_seqlen=300))
    heads = draw(tt.gqa_heads(max_heads=4))
    D = draw(OPTION_HEAD_DIMS)
    nseq = len(cu_q) - 1
    # Shape seen by the option strategy: B sequences, windows sized by the longest ones.
    shape = _shape(nseq, max(1, int(np.diff(cu_q).max())), max(1, int(np.diff(cu_k).max())),
                   heads[0], heads[1], D)
    options = draw(tt.attention_options(shape, allow=allow))
    return dict(cu_q=cu_q, cu_k=cu_k, shape=shape, options=options,
                seed=draw(st.integers(0, 2**63 - 1)))


@pytest.mark.parametrize("family, dtype", KERNELS)
@_capped(30)
@given(problem=varlen_problems())
def test_varlen_against_reference(family, dtype, problem):
    shape, cu_q, cu_k = problem["shape"], problem["cu_q"], problem["cu_k"]
    q, k, v = _varlen_inputs(cu_q, cu_k, shape["Hq"], shape["Hk"], shape["D"], dtype,
                             problem["seed"])
    opts = tt.as_device_options(problem["options"], cupy)
    generator = cuflash.Generator(problem["seed"] % 2**64)
    rng_state = generator.get_state()
    out, lse = _run_varlen(family, q, k, v, cu_q, cu_k, opts, generator)
    ref_opts = _reference_options(opts, rng_state)
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, **ref_opts)
    base = (tt.baseline_attention_varlen(q, k, v, cu_q, cu_k, **ref_opts)
            if dtype != "float32" else None)
    tt.assert_attention_close(out, ref_out, base, dtype=dtype, name="out")
    tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")


@pytest.mark.parametrize("family, dtype", KERNELS)
@_capped(20)
@given(problem=varlen_problems(allow=tt.VARLEN_OPTIONS - {"dropout_p"}))
def test_varlen_matches_per_sequence_calls(family, dtype, problem):
    # Dropout is left out: its random numbers depend on the batch index, which differs.
    shape, cu_q, cu_k = problem["shape"], problem["cu_q"], problem["cu_k"]
    q, k, v = _varlen_inputs(cu_q, cu_k, shape["Hq"], shape["Hk"], shape["D"], dtype,
                             problem["seed"])
    opts = tt.as_device_options(problem["options"], cupy)
    out, lse = _run_varlen(family, q, k, v, cu_q, cu_k, opts)
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, **opts)
    slopes = opts.pop("alibi_slopes", None)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        seq_opts = dict(opts)
        if slopes is not None:
            seq_opts["alibi_slopes"] = slopes[b] if slopes.ndim == 2 else slopes
        one_out, one_lse, _ = run_forward(family, q[None, rows], k[None, keys], v[None, keys],
                                          seq_opts)
        # The packed call may be at most twice as far from the truth as the separate call.
        tt.assert_attention_close(out[rows], ref_out[rows], one_out[0], dtype=dtype,
                                  name=f"out[seq {b}]")
        cupy.testing.assert_allclose(lse[:, rows], one_lse[0], rtol=1e-5, atol=1e-5)
        assert np.array_equal(np.isneginf(cupy.asnumpy(lse[:, rows])),
                              np.isneginf(ref_lse[:, rows]))


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_varlen_neighbours_do_not_leak(family, dtype):
    # Sequence 1 is all NaN (and sequence 2 has no keys): 0 and 3 must be finite and correct.
    cu_q = np.array([0, 70, 150, 190, 320], dtype=np.int32)
    cu_k = np.array([0, 129, 200, 200, 263], dtype=np.int32)
    q, k, v = _varlen_inputs(cu_q, cu_k, 4, 2, 64, dtype, 110)
    for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k)):
        x[int(cu[1]):int(cu[2])] = NAN
    out, lse = _run_varlen(family, q, k, v, cu_q, cu_k, {"causal": True})
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    base = (tt.baseline_attention_varlen(q, k, v, cu_q, cu_k, causal=True)
            if dtype != "float32" else None)
    tt.assert_attention_close(out, ref_out, base, dtype=dtype, name="out")
    tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")
    out_h = cupy.asnumpy(out).astype(np.float32)
    assert np.isfinite(out_h[:70]).all() and np.isfinite(out_h[190:]).all()
    assert (out_h[150:190] == 0).all()


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_varlen_empty_total(family, dtype):
    q = cupy.empty((0, 4, 64), dtype=_dtype(dtype))
    k = cupy.empty((0, 2, 64), dtype=_dtype(dtype))
    cu = cupy.zeros(3, dtype=cupy.int32)
    with forced(family):
        out, lse = cuflash.attention_varlen(q, k, k, cu, cu, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)


@pytest.mark.parametrize("batch", [40, 128, 129, 300])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_varlen_skewed_batches(batch, causal):
    # fwd_sm90 numbers a varlen batch's work items as for a padded batch of the longest sequence, so
    # most items of a skewed batch hold no rows: up to 300 sequences, one long among short ones, and
    # empty ones, every row checked (docs/decisions.md#fwd-sm90-persistent-work-items).
    rng = np.random.default_rng(batch * 2 + causal)
    lengths_q = rng.integers(0, 40, batch)
    lengths_q[rng.integers(batch)] = 700
    lengths_q[rng.choice(batch, 3, replace=False)] = 0
    lengths_k = lengths_q + rng.integers(0, 20, batch) * (not causal)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lengths_q, lengths_k))
    q, k, v = _varlen_inputs(cu_q, cu_k, 2, 1, 64, "bfloat16", batch)
    out, lse = _run_varlen("fwd_sm90", q, k, v, cu_q, cu_k, {"causal": causal})
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
    base = tt.baseline_attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
    tt.assert_attention_close(out, ref_out, base, dtype="bfloat16", name="out")
    tt.assert_attention_close(lse, ref_lse, dtype="float32", name="lse")


@pytest.mark.parametrize("family, dtype", KERNELS)
def test_repeated_plain_call_replays_its_launch(family, dtype, monkeypatch):
    # A call remembers its plan by the operands' layouts and the options; a repeat on new arrays of
    # the same layout replays it with their pointers, without the argument checks and the kernel
    # choice. An input whose base is not 16-byte aligned (which the kernel choice reads) must go
    # the whole way again.
    import sys

    from cuflash._runtime import memo as _memo

    module = sys.modules["cuflash.attention"]
    shape = _shape(2, 130, 257, 4, 2, 64)
    _memo.clear_memo()

    def first_call_only(*args, **kwargs):
        raise AssertionError("a repeated call went through the whole launch path")

    for seed in (301, 302):
        q, k, v = _qkv(shape, dtype, seed)
        out = cupy.full(q.shape, NAN, dtype=q.dtype)
        with forced(family):
            got, lse = cuflash.attention(q, k, v, causal=True, out=out, return_lse=True)
        assert got is out and len(_memo._memo) == 1
        check_close(q, k, v, {"causal": True}, got, lse, None, dtype=dtype)
        monkeypatch.setattr(module, "_plan_attention", first_call_only)
    monkeypatch.undo()

    q, k, v = _qkv(shape, dtype, 303)
    buf = cupy.empty(q.size + 1, dtype=q.dtype)
    q_off = buf[1:].reshape(q.shape)   # the same strides, the base one element off
    q_off[...] = q
    assert q_off.data.ptr % 16 != 0 and q_off.strides == q.strides
    out = cupy.full(q.shape, NAN, dtype=q.dtype)
    with forced(family):
        got, lse = cuflash.attention(q_off, k, v, causal=True, out=out, return_lse=True)
    check_close(q, k, v, {"causal": True}, got, lse, None, dtype=dtype)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_causal_tail_heads_m_block_major(head_dim, monkeypatch):
    # fwd_sm90's causal work items with the last (head, sequence) pairs numbered m-block-major
    # (WorkItem::of): with 4 persistent CTAs and 3 m-blocks per head, 3 of the 24 pairs
    # (tail_heads); then none, then all of them. Each item must still be taken exactly once:
    # against the reference, and out/lse bitwise the same in every order (an item is one CTA's
    # work wherever it falls).
    import sys

    from cuflash import kernels
    from cuflash._runtime import memo as _memo

    monkeypatch.setattr(sys.modules["cuflash._forward_plan"], "_num_sms", lambda device_id: 4)
    _memo.clear_memo()
    shape = _shape(3, 3 * 128 - 20, 3 * 128 - 20, 8, 4, head_dim)
    _, (q, k, v, out, lse) = _solve("fwd_sm90", "bfloat16", shape, {"causal": True}, 311)
    with forced("fwd_sm90"):
        info = cuflash.plan(cuflash.attention_forward, q, k, v, causal=True).plan.info
    assert info["family"] == "fwd_sm90" and info["tail_heads"] == 3
    for waves in (0, 100):
        monkeypatch.setattr(kernels.fwd_sm90, "FWD_TAIL_WAVES", waves)
        _memo.clear_memo()
        again_out, again_lse, _ = run_forward("fwd_sm90", q, k, v, {"causal": True})
        assert bool((again_out.view(cupy.uint8) == out.view(cupy.uint8)).all()), f"out changed with {waves} waves"
        assert bool((again_lse.view(cupy.uint8) == lse.view(cupy.uint8)).all()), f"lse changed with {waves} waves"
    _memo.clear_memo()
