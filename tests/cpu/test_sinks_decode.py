"""Attention sinks in cuflash.decode without a GPU (issue 53 item 1): the argument in decode's
signature and checks, the kernel parameter that carries it (DecodeParams.score.sinks, a run-time
pointer: no decode variant more), and the float64 reference's split-KV identity the kernel's combine
relies on (the partials without the sink, merged, then the sink added once).

The kernels against the reference: tests/gpu/test_sinks_decode.py. NVRTC compiles every decode
variant (whose finalisation and split combine now read the sinks) for sm_80 and sm_90a with zero
spills in tests/cpu/test_compile.py.
"""

import inspect

import numpy as np
import pytest

import cuflash
from cuflash import reference
from cuflash._runtime.params import DECODE
from cuflash.kernels.decode import decode_precompile_variants


def test_decode_takes_sinks():
    params = inspect.signature(cuflash.decode).parameters
    assert params["sinks"].default is None and params["sinks"].kind is inspect.Parameter.KEYWORD_ONLY


def test_host_arrays_are_refused_before_anything_else():
    q = np.zeros((1, 1, 2, 64), np.float16)
    with pytest.raises(TypeError, match=r"\bq\b"):
        cuflash.decode(q, q, q, sinks=np.zeros(2, np.float32))


def test_the_sinks_pointer_is_a_field_of_decode_params():
    # DecodeParams embeds FwdParams as ``score``: its sinks pointer, null by default (no sink).
    assert "score.sinks" in DECODE.offsets
    assert DECODE.unpack(DECODE.pack({}))["score.sinks"] == 0
    assert DECODE.unpack(DECODE.pack({"score.sinks": 0x7f0012345600}))["score.sinks"] == 0x7f0012345600


def test_sinks_add_no_decode_variant():
    variants = decode_precompile_variants()
    assert not any("SINK" in name for v in variants for name, _ in v.defines)


def _merge_with_sink(outs, lses, sink):
    """What decode.cu's combine does for one row: the splits' partial (o, lse), then exp(sink) as one
    more term of the denominator with no value."""
    top = max(np.max(lses), sink)
    weights = np.exp(lses - top)
    total = weights.sum() + np.exp(sink - top)
    return (weights[:, None] * outs).sum(axis=0) / total, top + np.log(total)


@pytest.mark.parametrize("sink", [-1.5, 0.3, 14.0])
def test_split_partials_merged_then_the_sink_equal_the_reference(sink):
    # One sequence of 37 keys in three key ranges: attention over each range without a sink, merged
    # with the sink added once, is the reference's decode with the sink.
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 1, 1, 16))
    k, v = rng.standard_normal((1, 37, 1, 16)), rng.standard_normal((1, 37, 1, 16))
    outs, lses = [], []
    for lo, hi in ((0, 10), (10, 30), (30, 37)):
        o, lse = reference.attention_forward(q, k[:, lo:hi], v[:, lo:hi])
        outs.append(o[0, 0, 0])
        lses.append(lse[0, 0, 0])
    out, lse = _merge_with_sink(np.array(outs), np.array(lses), sink)
    ref_out, ref_lse = reference.decode(q, k, v, sinks=np.array([sink]))
    np.testing.assert_allclose(out, ref_out[0, 0, 0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, ref_lse[0, 0, 0], rtol=1e-12)


def test_an_empty_sequence_gets_zero_and_the_sink_in_the_reference():
    q = np.ones((2, 1, 2, 8))
    cache = np.ones((2, 4, 1, 8))
    out, lse = reference.decode(q, cache, cache, cache_seqlens=np.array([0, 3]), sinks=np.array([0.5, -np.inf]))
    assert (out[0] == 0).all()
    np.testing.assert_array_equal(lse[0, :, 0], [0.5, -np.inf])
