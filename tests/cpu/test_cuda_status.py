"""cuflash._build.cuda_status without CuPy: the first call of a machine with no CuPy says which extra
to install instead of Python's bare "No module named 'cupy'".

CuPy's absence is simulated (``sys.modules["cupy"] = None``), in this process for
:func:`import_cupy` and in a fresh one for a first call, where nothing is imported yet.
(The states of :func:`cuda_status` under CUDA failures are in tests/cpu/test_cli.py.)
"""

import builtins
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cuflash._build import cuda_status as _cuda_status

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ModuleNotFoundError


@pytest.mark.parametrize("driver, extra", [(None, "cuda13"), ((13, 0), "cuda13"), ((12, 8), "cuda12")])
def test_import_cupy_names_the_extra_for_the_driver(no_cupy, monkeypatch, driver, extra):
    monkeypatch.setattr(_cuda_status, "driver_cuda_version", lambda: driver)
    with pytest.raises(ModuleNotFoundError) as info:
        _cuda_status.import_cupy()
    assert info.value.name == "cupy"  # still what `except ImportError` and err.name checks expect
    assert str(info.value) == f"cuflash: CuPy is not installed\nfix: pip install 'cuflash[{extra}]'"


def test_import_cupy_that_fails_to_load(monkeypatch):
    real_import = builtins.__import__

    def importer(name, *args, **kwargs):
        if name == "cupy":
            raise ImportError("libcudart.so.13: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(_cuda_status, "driver_cuda_version", lambda: (13, 0))
    monkeypatch.setattr(builtins, "__import__", importer)
    with pytest.raises(ImportError, match=r"(?s)CUDA is not usable: import cupy: .*libcudart\.so\.13"
                                          r".*fix: reinstall: pip install 'cuflash\[cuda13\]'"):
        _cuda_status.import_cupy()


def _first_call_without_cupy(call: str) -> str:
    """stderr of a fresh process in which CuPy is missing and ``call`` is cuflash's first call."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules["cupy"] = None
        import numpy as np
        import cuflash
        q = np.zeros((1, 8, 2, 64), np.float16)
        {call}
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    return proc.stderr


def test_precompile_without_cupy_says_what_to_install():
    err = _first_call_without_cupy("cuflash.precompile()")
    assert "CuPy is not installed" in err and "pip install 'cuflash[cuda1" in err, err


@pytest.mark.parametrize("call", ["cuflash.attention(q, q, q)", "cuflash.check_errors()"])
def test_a_first_call_without_cupy_says_what_to_install(call):
    err = _first_call_without_cupy(call)
    assert "CuPy is not installed" in err and "pip install 'cuflash[cuda1" in err, err
    assert "No module named 'cupy'" not in err
