"""cuflash/interop/_cupy_stream.py: a CuPy stream over a foreign stream's handle, through the CUDA
stream protocol, without CuPy 14's deprecated ExternalStream (no GPU needed)."""

import random
import warnings

import pytest

cupy = pytest.importorskip("cupy")

from cuflash.interop._cupy_stream import cupy_stream  # noqa: E402


def test_stream_over_a_handle_without_deprecation():
    handle = random.randrange(1 << 20, 1 << 47) * 16   # an address-like value, fresh each run
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a DeprecationWarning (ExternalStream) fails the test
        stream = cupy_stream(handle)
    assert isinstance(stream, cupy.cuda.Stream)
    assert stream.ptr == handle


def test_importing_it_imports_no_framework():
    import subprocess
    import sys

    code = ("import sys, cuflash.interop._cupy_stream; "
            "print(sorted(m for m in ('torch', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
