"""Attention sinks on the kernels' side, without a GPU (issue 53 item 1): the checks of ``sinks=`` and
``return_dsinks=`` before any launch, the kernel parameters that carry them (a run-time pointer in
FwdParams; dsinks' partial sums and result in BwdParams), and the dsinks kernel in the compile lists.

The numbers are checked on a GPU in tests/gpu/test_sinks.py; NVRTC compiles every family (whose
forward epilogue and bwd_preprocess now read the sinks) and bwd_dsinks for sm_80 and sm_90a with zero
spills in tests/cpu/test_compile.py.
"""

import pathlib
import re

import numpy as np
import pytest

import cuflash
from cuflash import _checks
from cuflash._runtime.params import BWD, BWD_PARAMS, FWD, FWD_PARAMS
from cuflash.kernels.bwd_common import BWD_DSINKS_THREADS, bwd_dsinks_variant
from cuflash.kernels.catalogue import ci_variants, precompile_variants, reachable_variants

CUDA_SRC = pathlib.Path(cuflash.__file__).resolve().parent.parent / "cuda_src"


def _host(shape, dtype=np.float16):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def test_sinks_must_be_a_cuda_array():
    assert _checks.check_sinks(None, 4) is None
    with pytest.raises(TypeError, match=r"sinks must be a CUDA array"):
        _checks.check_sinks(np.zeros(4, np.float32), 4)
    with pytest.raises(TypeError, match=r"sinks"):
        _checks.check_sinks([0.0] * 4, 4)


def test_return_dsinks_needs_sinks_and_a_bool():
    assert _checks.check_return_dsinks(False, None) is False
    assert _checks.check_return_dsinks(True, object()) is True
    with pytest.raises(ValueError, match="return_dsinks=True needs sinks"):
        _checks.check_return_dsinks(True, None)
    with pytest.raises(TypeError, match="return_dsinks must be a bool"):
        _checks.check_return_dsinks(1, object())


@pytest.mark.parametrize("fn", ["attention_backward", "attention_varlen_backward"])
def test_the_backward_refuses_return_dsinks_without_sinks_first(fn):
    # Before any array is looked at (these are host arrays, which would be a TypeError next).
    q = _host((2, 8, 2, 64))
    lse = np.zeros((2, 2, 8), np.float32)
    if fn == "attention_varlen_backward":
        q = q.reshape(16, 2, 64)
        cu = np.array([0, 8, 16], dtype=np.int32)
        args = (q, q, q, q, q, np.zeros((2, 16), np.float32), cu, cu)
    else:
        args = (q, q, q, q, q, lse)
    with pytest.raises(ValueError, match="return_dsinks=True needs sinks"):
        getattr(cuflash, fn)(*args, return_dsinks=True)


@pytest.mark.parametrize("fn", ["attention", "attention_forward"])
def test_host_sinks_are_refused(fn):
    # q first: a host q is named before the sinks (both are TypeErrors before any launch).
    q = _host((1, 8, 2, 64))
    with pytest.raises(TypeError, match=r"\bq\b"):
        getattr(cuflash, fn)(q, q, q, sinks=np.zeros(2, np.float32))


def _struct_fields(header: str, struct: str) -> list[str]:
    """Member names of ``struct`` in a header, in declaration order (comments dropped)."""
    text = (CUDA_SRC / header).read_text()
    body = text[text.index(f"struct {struct} {{") + len(struct) + 9:]
    body = body[:body.index("\n};")]
    body = re.sub(r"//[^\n]*", "", body)
    names = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl:
            continue
        for part in decl.split(","):   # "long long a, b, c": the last word of each part
            names.append(re.findall(r"\w+", part)[-1])
    return names


def test_the_params_structs_carry_sinks_in_the_c_order():
    fwd = _struct_fields("params.cuh", "FwdParams")
    assert fwd == list(FWD_PARAMS.names)
    assert fwd.index("sinks") == fwd.index("block_mask") + 1   # a pointer among the pointers
    bwd = _struct_fields("bwd_params.cuh", "BwdParams")
    assert bwd == list(BWD_PARAMS.names)
    assert {"dsink_part", "dsinks"} <= set(bwd)
    # Absent by default: a plan without sinks passes null pointers (no sink, no dsinks).
    assert FWD.unpack(FWD.pack({}))["sinks"] == 0
    values = BWD.unpack(BWD.pack({}))
    assert values["fwd.sinks"] == values["dsink_part"] == values["dsinks"] == 0


def test_the_dsinks_kernel_is_compiled_and_reachable():
    variant = bwd_dsinks_variant()
    assert variant.family == "bwd_dsinks" and variant.entry == "cuflash_bwd_dsinks"
    for arch in ("sm_80", "sm_90a"):
        assert (variant, arch) in ci_variants()
        assert variant in precompile_variants(arch=arch)
        assert variant in reachable_variants(arch)
    source = (CUDA_SRC / "bwd_dsinks.cu").read_text()
    assert f"kDsinkThreads = {BWD_DSINKS_THREADS};" in source
