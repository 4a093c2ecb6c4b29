"""A benchmark script as a module for its tests: the scripts run as programs (``python
benchmarks/bench_*.py``), so a test module names its script (``SCRIPT = "bench_modifiers"``) and
takes the ``bench`` fixture."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench(request):
    """benchmarks/<SCRIPT>.py loaded as a module: its folder on sys.path (it imports _harness from beside
    it) and the module registered under its name (dataclasses look it up there), both undone after."""
    name = request.module.SCRIPT
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop(name, None)
