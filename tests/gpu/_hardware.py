"""Which GPU the tests run on: whether CuPy sees one, and whether it is an sm_90 (the wgmma
families). Shared by the GPU test files, which skip their GPU cases and their sm90 cases by them."""

import os

import cupy
import pytest


def gpu_available() -> bool:
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver / no device
        return False


def is_sm90() -> bool:
    if not gpu_available():
        return False
    try:
        return cupy.cuda.Device().compute_capability == "90"
    except Exception:
        return False


SM90 = pytest.mark.skipif(not is_sm90(), reason="the sm90 families need an sm_90 GPU")


def jax_on_gpu():
    """jax, for a test module that runs it on a GPU: the module is skipped without JAX or without a
    JAX GPU device. XLA is told not to preallocate, leaving memory to CuPy's pool."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    try:
        jax.devices("gpu")
    except RuntimeError:  # pragma: no cover - depends on the machine
        pytest.skip("JAX has no GPU device", allow_module_level=True)
    return jax
