"""Shared pytest configuration: hypothesis profiles and GPU detection.

- ``HYPOTHESIS_PROFILE=ci`` (default): few examples, for CPU CI and quick runs.
  ``HYPOTHESIS_PROFILE=gpu``: more examples, for a run on an H100/H200.
- Tests marked ``@pytest.mark.gpu`` (alias ``requires_gpu``) are skipped when CuPy finds no
  CUDA device; the ``xp_gpu`` fixture returns the ``cupy`` module or skips.
"""

import functools
import os

import pytest
from hypothesis import HealthCheck, settings

_SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=25, deadline=None,
                          suppress_health_check=_SUPPRESSED, print_blob=True)
settings.register_profile("gpu", max_examples=200, deadline=None,
                          suppress_health_check=_SUPPRESSED, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@functools.lru_cache(maxsize=None)
def gpu_available():
    """True if CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no library, no device: all mean "no GPU"
        return False


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped when CuPy finds none)")
    config.addinivalue_line("markers", "requires_gpu: alias of the gpu marker")


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU found by CuPy")
    for item in items:
        if item.get_closest_marker("gpu") or item.get_closest_marker("requires_gpu"):
            item.add_marker(skip)


@pytest.fixture
def xp_gpu():
    """The ``cupy`` module, or skip the test when there is no GPU."""
    if not gpu_available():
        pytest.skip("no CUDA GPU found by CuPy")
    import cupy
    return cupy
