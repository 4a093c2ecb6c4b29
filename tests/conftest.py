"""Shared pytest configuration: hypothesis profiles and GPU detection.

- ``HYPOTHESIS_PROFILE=ci`` (default): few examples, for CPU CI and quick runs.
  ``HYPOTHESIS_PROFILE=gpu``: more examples, for a run on an H100/H200.
- Tests marked ``@pytest.mark.gpu`` (alias ``requires_gpu``) and tests using the ``xp_gpu``
  fixture (which returns the ``cupy`` module) need a GPU. They skip only when there is truly
  none (no NVIDIA driver, no device visible) or CuPy is not installed; with a broken CUDA setup
  (a driver too old for CuPy's CUDA, CuPy failing to load, ...) each of them fails with the
  cause and the fix. The pytest header says which, once.
"""

import functools
import os
import re

import pytest
from hypothesis import HealthCheck, settings

# A JAX process takes 75% of the GPU's memory at its first array unless told otherwise: with the suite
# spread over pytest-xdist workers, the second such worker (a CPU test that traces through JAX on a GPU
# machine) failed at collection with RESOURCE_EXHAUSTED. Set before any test module imports JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

pytest_plugins = ["pytester"]  # tests/cpu/test_cli.py runs this file's GPU gate in a small session

_SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=25, deadline=None,
                          suppress_health_check=_SUPPRESSED, print_blob=True)
settings.register_profile("gpu", max_examples=200, deadline=None,
                          suppress_health_check=_SUPPRESSED, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@functools.lru_cache(maxsize=None)
def cuda_status():
    """:func:`cuflash._build.cuda_status.cuda_status`, asked once per session."""
    from cuflash._build.cuda_status import cuda_status

    return cuda_status()


def gpu_available():
    """True if CuPy imports and sees at least one working CUDA device."""
    return cuda_status().state == "ok"


def _skip_reason():
    status = cuda_status()
    if status.state == "no-cupy":
        return "CuPy is not installed"
    return f"no CUDA GPU: {status.reason}"


def _needs_gpu(item):
    return (item.get_closest_marker("gpu") is not None
            or item.get_closest_marker("requires_gpu") is not None
            or "xp_gpu" in getattr(item, "fixturenames", ()))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped when there is none)")
    config.addinivalue_line("markers", "requires_gpu: alias of the gpu marker")


def pytest_report_header(config):
    status = cuda_status()
    if status.state == "ok":
        return f"cuflash GPU tests: run on {status.devices} CUDA device(s)"
    if status.state == "broken":
        return f"cuflash GPU tests: FAIL, broken CUDA setup: {status.reason} (fix: {status.fix})"
    return f"cuflash GPU tests: skipped ({_skip_reason()})"


def pytest_collection_modifyitems(config, items):
    if cuda_status().state not in ("no-gpu", "no-cupy"):
        return  # a GPU, or a broken setup: the GPU tests run (and fail, see below)
    skip = pytest.mark.skip(reason=_skip_reason())
    for item in items:
        if _needs_gpu(item):
            item.add_marker(skip)


_NO_CUPY = re.compile(r"No module named '(cupy|cupyx|cupy_backends)[.']")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    # A test module that imports CuPy at its top cannot be collected without it: report the
    # module as skipped for that reason, as pytest.importorskip would, not as an error.
    report = yield
    if (report.failed and isinstance(collector, pytest.Module)
            and cuda_status().state == "no-cupy" and _NO_CUPY.search(str(report.longrepr))):
        report.outcome = "skipped"
        report.longrepr = (str(collector.path), 0, "Skipped: CuPy is not installed")
    return report


@pytest.hookimpl(tryfirst=True)  # before the skipif markers of the GPU test modules are evaluated
def pytest_runtest_setup(item):
    status = cuda_status()
    if status.state == "broken" and _needs_gpu(item):
        pytest.fail(f"broken CUDA setup: {status.reason}; fix: {status.fix}", pytrace=False)


@pytest.fixture
def xp_gpu():
    """The ``cupy`` module, or skip the test when there is no GPU."""
    if not gpu_available():
        pytest.skip(_skip_reason())
    import cupy
    return cupy


@pytest.fixture(scope="module")
def modifiers_as_written():
    """A module's calls run their ScoreMods and MaskMods as written: nothing moves into a built-in option
    (cuflash/modifiers/builtin.py). For the tests of an expression's own path through the kernels; the
    moves have tests/gpu/test_modifiers_builtin.py. A module takes it as
    ``pytest.mark.usefixtures("modifiers_as_written")``."""
    from cuflash.modifiers import as_written

    with as_written():
        yield
