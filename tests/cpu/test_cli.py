"""The command line (``python -m cuflash``, ``doctor``, ``precompile``) and the GPU-test gate of
conftest.py, on the CPU: CUDA failures are simulated with a stand-in ``cupy`` module whose
``getDeviceCount`` raises what CuPy raises, and a stand-in for the driver's CUDA version.
"""

import io
import sys
import types

import pytest

from cuflash._build import arch as _arch, cache as _cache, compile as _compile, cuda_status as _cuda_status
from cuflash.__main__ import main
from cuflash._build.variant import Variant

from tests.cpu.test_compile import TINY, tiny_src  # noqa: F401  (a fixture)

INSUFFICIENT_DRIVER = 35, "cudaErrorInsufficientDriver", \
    "CUDA driver version is insufficient for CUDA runtime version"
NO_DEVICE = 100, "cudaErrorNoDevice", "no CUDA-capable device is detected"
UNKNOWN = 999, "cudaErrorUnknown", "unknown error"


class FakeCUDARuntimeError(RuntimeError):
    """What cupy_backends.cuda.api.runtime.CUDARuntimeError looks like: a status and a text."""

    def __init__(self, status, name, text):
        super().__init__(f"{name}: {text}")
        self.status = status


def fake_cupy(monkeypatch, count=1, error=None, runtime=13020):
    """Install a stand-in ``cupy`` whose device count is ``count`` or which raises ``error``."""
    def get_device_count():
        if error is not None:
            raise FakeCUDARuntimeError(*error)
        return count

    module = types.ModuleType("cupy")
    module.__version__ = "14.2.0"
    module.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(
        getDeviceCount=get_device_count, runtimeGetVersion=lambda: runtime))
    monkeypatch.setitem(sys.modules, "cupy", module)


@pytest.fixture
def driver(monkeypatch):
    """Set the CUDA version the (simulated) driver supports; None: no driver installed."""
    def set_version(version):
        monkeypatch.setattr(_cuda_status, "driver_cuda_version", lambda: version)
    return set_version


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------- status

def test_status_insufficient_driver_names_the_cuda12_extra(monkeypatch, driver):
    driver((12, 8))
    fake_cupy(monkeypatch, error=INSUFFICIENT_DRIVER)
    status = _cuda_status.cuda_status()
    assert status.state == "broken"
    assert status.reason == ("cudaErrorInsufficientDriver: the driver supports CUDA 12.8, "
                             "CuPy was built for CUDA 13.2")
    assert status.fix.endswith("pip install 'cuflash[cuda12]'")
    assert "pip uninstall -y cupy" in status.fix


def test_status_driver_older_than_cuda12(monkeypatch, driver):
    driver((11, 4))
    fake_cupy(monkeypatch, error=INSUFFICIENT_DRIVER)
    status = _cuda_status.cuda_status()
    assert status.state == "broken" and "update the NVIDIA driver" in status.fix


@pytest.mark.parametrize("version, error, count, reason", [
    (None, INSUFFICIENT_DRIVER, None, "no NVIDIA driver"),  # what the runtime says without libcuda
    ((13, 0), NO_DEVICE, None, "no CUDA device"),
    ((13, 0), None, 0, "0 CUDA devices"),
])
def test_status_no_gpu_is_not_an_error(monkeypatch, driver, version, error, count, reason):
    driver(version)
    fake_cupy(monkeypatch, count=count, error=error)
    status = _cuda_status.cuda_status()
    assert status.state == "no-gpu" and reason in status.reason and status.fix == ""


def test_status_without_cupy(monkeypatch, driver):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ModuleNotFoundError
    driver(None)
    assert _cuda_status.cuda_status() == _cuda_status.CudaStatus(
        "no-cupy", fix="pip install 'cuflash[cuda13]'")
    driver((12, 4))
    assert _cuda_status.cuda_status().fix == "pip install 'cuflash[cuda12]'"


def test_status_cupy_that_fails_to_load(monkeypatch, driver):
    import builtins

    real_import = builtins.__import__

    def importer(name, *args, **kwargs):
        if name == "cupy":
            raise ImportError("libcudart.so.13: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    driver((13, 0))
    monkeypatch.setattr(builtins, "__import__", importer)
    status = _cuda_status.cuda_status()
    assert status.state == "broken" and "libcudart.so.13" in status.reason
    assert status.fix == "reinstall: pip install 'cuflash[cuda13]'"


def test_status_other_cuda_errors_are_broken(monkeypatch, driver):
    driver((13, 0))
    fake_cupy(monkeypatch, error=UNKNOWN)
    status = _cuda_status.cuda_status()
    assert status.state == "broken" and status.reason.startswith("cudaErrorUnknown")
    assert "nvidia-smi" in status.fix


def test_device_arch_error_says_why(monkeypatch, driver):
    driver((12, 8))
    fake_cupy(monkeypatch, error=INSUFFICIENT_DRIVER)
    sys.modules["cupy"].cuda.Device = lambda device=None: (_ for _ in ()).throw(
        FakeCUDARuntimeError(*INSUFFICIENT_DRIVER))
    with pytest.raises(RuntimeError, match=r"(?s)CUDA is not usable.*fix: .*cuda12"):
        _arch.device_arch()


# ----------------------------------------------------------------------------- main job, doctor

def test_main_with_a_broken_setup_exits_1_in_at_most_5_lines(monkeypatch, driver, capsys):
    driver((12, 8))
    fake_cupy(monkeypatch, error=INSUFFICIENT_DRIVER)
    code, out, err = run(capsys)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) <= 5, err
    assert "cudaErrorInsufficientDriver" in lines[0] and "CUDA 12.8" in lines[0]
    assert lines[1].startswith("fix: ") and "cuflash[cuda12]" in lines[1]


def test_main_without_cupy_gives_the_install_command(monkeypatch, driver, capsys):
    driver(None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    code, out, err = run(capsys)
    assert code == 1 and len(err.strip().splitlines()) <= 5
    assert "CuPy is not installed" in err and "pip install 'cuflash[cuda13]'" in err


@pytest.mark.parametrize("version, error, count", [(None, INSUFFICIENT_DRIVER, None),
                                                    ((13, 0), NO_DEVICE, None), ((13, 0), None, 0)])
def test_main_without_gpu_exits_0(monkeypatch, driver, capsys, version, error, count):
    driver(version)
    fake_cupy(monkeypatch, count=count, error=error)
    code, out, err = run(capsys)
    assert code == 0 and out.startswith("cuflash: no CUDA GPU found") and err == ""


def test_main_on_this_machine(capsys):
    if _cuda_status.cuda_status().state == "ok":
        pytest.skip("a GPU is present: the main job runs the GPU self-check (GPU suite)")
    code, out, err = run(capsys)
    assert (code, out.startswith("cuflash: no CUDA GPU found")) == (0, True) or code == 1


def test_doctor_report_without_gpu(monkeypatch, driver, capsys):
    driver(None)
    fake_cupy(monkeypatch, error=INSUFFICIENT_DRIVER)
    code, out, err = run(capsys, "doctor")
    assert code == 0, out + err
    for key in ("cuflash", "GPU", "driver", "CUDA", "CuPy", "cache", "kernel"):
        assert f"  {key} " in out
    assert "runtime 13.2" in out and "NVRTC" in out and "14.2.0" in out
    assert "compiles for sm_80" in out and "not run (no GPU)" in out
    assert "no CUDA GPU here" in out


def test_doctor_with_a_broken_setup_exits_1(monkeypatch, driver, capsys):
    driver((12, 8))
    fake_cupy(monkeypatch, error=INSUFFICIENT_DRIVER)
    code, out, err = run(capsys, "doctor")
    assert code == 1
    assert "supports CUDA 12.8" in out and "fix: pip uninstall -y" in out


def test_doctor_reports_a_kernel_that_does_not_compile(monkeypatch, driver, capsys):
    from cuflash._build import nvrtc as _nvrtc

    driver(None)
    fake_cupy(monkeypatch, error=INSUFFICIENT_DRIVER)

    def fail(*args, **kwargs):
        raise RuntimeError("cuflash: libnvrtc not found; install the CUDA extra, e.g. "
                           "`pip install 'cuflash[cuda13]'`")

    monkeypatch.setattr(_nvrtc, "compile_to_cubin", fail)
    code, out, err = run(capsys, "doctor")
    assert code == 1 and "does not compile for sm_80" in out and "fix: libnvrtc not found" in out


# ----------------------------------------------------------------------------- precompile

@pytest.fixture
def fake_heuristics(monkeypatch):
    """Stand-in for cuflash.kernels.catalogue so the CLI can be tested on the tiny kernels."""
    module = types.ModuleType("cuflash.kernels.catalogue")
    module.variants = [TINY]
    module.calls = []

    def precompile_variants(dtypes=None, head_dims=None, arch=None, **kw):
        module.calls.append((dtypes, head_dims, arch))
        return module.variants

    module.precompile_variants = precompile_variants
    monkeypatch.setitem(sys.modules, "cuflash.kernels.catalogue", module)
    return module


def test_precompile_prints_one_summary_line_and_caches(tiny_src, tmp_path, fake_heuristics, capsys):  # noqa: F811
    out_dir = tmp_path / "aot"
    code, out, err = run(capsys, "precompile", "--arch", "sm_90a,sm_80", "--cache-dir", str(out_dir))
    assert code == 0, err
    assert out.splitlines() == [out.strip()]  # the summary, nothing else
    assert out.startswith("precompile: 2 variants for sm_90a,sm_80: 2 built, 0 found in cache; ")
    assert f"-> {out_dir} (use it: CUFLASH_CACHE_DIR={out_dir})" in out
    # stderr is not a terminal here: a start line and at most one line per quarter.
    assert err.splitlines()[0] == "precompile: building 2 variants for sm_90a,sm_80 (0 found in cache)"
    assert len(err.splitlines()) <= 4 and "\r" not in err
    assert _compile.cache_path(out_dir, TINY, "sm_90a").is_file()
    # Second run: nothing compiled, no progress at all.
    code, out, err = run(capsys, "precompile", "--arch", "sm_90a,sm_80", "--cache-dir", str(out_dir))
    assert code == 0 and ": 0 built, 2 found in cache; " in out and err == ""
    code, out, err = run(capsys, "precompile", "--arch", "sm_80", "--cache-dir", str(out_dir),
                         "--force")
    assert code == 0 and ": 1 built, 0 found in cache; " in out


def test_precompile_in_the_user_cache_says_where(tiny_src, fake_heuristics, capsys):  # noqa: F811
    code, out, _ = run(capsys, "precompile", "--arch", "sm_80")
    assert code == 0 and out.rstrip().endswith(f"-> {_cache.user_cache_dir()}")


def test_precompile_verbose_table_and_warnings(tiny_src, tmp_path, fake_heuristics, capsys,  # noqa: F811
                                               monkeypatch):
    # Every compiled variant's warnings show with -v only, cached ones' too (from the report).
    from cuflash._build import nvrtc as _nvrtc

    real = _nvrtc.compile_to_cubin
    monkeypatch.setattr(_nvrtc, "compile_to_cubin", lambda *a: (
        lambda cubin, log: (cubin, 'tiny.cu(3): warning #177-D: variable "x" was declared but never '
                                   "referenced\n" + log))(*real(*a)))
    args = ("precompile", "--arch", "sm_90a,sm_80", "--cache-dir", str(tmp_path))
    code, out, err = run(capsys, *args)
    assert code == 0 and "warning" not in out + err
    code, out, err = run(capsys, *args, "-v")
    assert code == 0
    header, *rows = [ln for ln in out.splitlines() if ln.strip()][:5]
    assert header.split() == ["family", "arch", "config", "regs", "smem", "KiB", "spills", "sec"]
    assert rows[0].split()[:2] == ["tiny", "sm_90a"] and rows[2].split()[:2] == ["tiny", "sm_80"]
    assert " 0.2+0 " in rows[0] + " "  # 256 B static, no dynamic shared memory
    assert rows[1].strip() == "TINY_N=64" and "cached" in rows[0]
    assert max(len(ln) for ln in [header, *rows]) < 100
    assert out.splitlines()[-1].startswith("precompile: 2 variants")
    assert err.count("warning #177-D") == 2 and err.startswith("note: tiny sm_90a")


def test_precompile_failure_and_spills_exit_1(tiny_src, tmp_path, fake_heuristics, capsys,  # noqa: F811
                                              monkeypatch):
    fake_heuristics.variants = [TINY, Variant("broken")]
    code, out, err = run(capsys, "precompile", "--arch", "sm_80", "--cache-dir", str(tmp_path))
    assert code == 1 and ": 1 built, 0 found in cache, 1 failed; " in out
    failure = [ln for ln in err.splitlines() if ln.startswith("FAILED")]
    assert len(failure) == 1 and "undefined_thing" in failure[0]
    assert len(err.splitlines()) < 10  # not the whole NVRTC log (that is -v)

    from cuflash._build import nvrtc as _nvrtc

    real = _nvrtc.parse_ptxas_log
    monkeypatch.setattr(_nvrtc, "parse_ptxas_log",
                        lambda log, entry=None: {**real(log, entry), "spill_stores": 8})
    fake_heuristics.variants = [TINY]
    code, out, err = run(capsys, "precompile", "--arch", "sm_90a", "--cache-dir", str(tmp_path))
    assert code == 1 and "SPILLS tiny sm_90a" in err and ", 1 spilling; " in out


def test_precompile_accepts_dtype_aliases(tiny_src, tmp_path, fake_heuristics, capsys):  # noqa: F811
    code, _, _ = run(capsys, "precompile", "--arch", "sm_80", "--cache-dir", str(tmp_path),
                     "--dtypes", "bf16,FP16,float32,fp32", "--head-dims", "64,128,32")
    assert code == 0
    assert fake_heuristics.calls == [(["bfloat16", "float16", "float32"], [64, 128, 32], "sm_80")]


SUPPORTED_HEAD_DIMS = "expected some of 32,64,96,128,160,192,224,256"


@pytest.mark.parametrize("args, message", [
    (["--dtypes", "fp8"], "--dtypes 'fp8': expected float16 (fp16), bfloat16 (bf16) or float32"),
    (["--arch", "sm90"], "--arch sm90: use sm_90a (what a GPU of compute capability 9.0 loads"),
    (["--arch", "sm_90"], "use sm_90a"),
    (["--arch", "sm_70"], "need sm_80 or newer"),
    (["--head-dims", "100"], f"--head-dims '100': {SUPPORTED_HEAD_DIMS}"),
    (["--head-dims", "0"], f"--head-dims '0': {SUPPORTED_HEAD_DIMS}"),
    (["--head-dims", "64,512"], f"--head-dims '512': {SUPPORTED_HEAD_DIMS}"),
    (["--head-dims", "abc"], "--head-dims 'abc'"),
    (["--families", "fwd_sm99"], "--families 'fwd_sm99': expected some of"),
    (["--threads", "0"], "--threads 0: expected 1 or more"),
])
def test_precompile_rejects_bad_arguments_in_one_line(tiny_src, tmp_path, fake_heuristics,  # noqa: F811
                                                      capsys, args, message):
    code, out, err = run(capsys, "precompile", "--cache-dir", str(tmp_path), *args)
    assert code == 2 and out == "" and fake_heuristics.calls == []
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_precompile_head_dims_are_the_compiled_ones():
    # The list in the message is every family's compiled head dims, read from cuflash.kernels.
    from cuflash.__main__ import _compiled_head_dims
    from cuflash.kernels import fwd_simt, fwd_sm80, fwd_sm90

    dims = _compiled_head_dims()
    assert ",".join(map(str, dims)) in SUPPORTED_HEAD_DIMS
    assert {*fwd_sm80.SM80_HEAD_DIMS, *fwd_sm90.SM90_HEAD_DIMS, *fwd_simt.SIMT_HEAD_DIMS} <= set(dims)


def test_precompile_rejects_a_cache_dir_it_cannot_write(tmp_path, fake_heuristics, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, out, err = run(capsys, "precompile", "--arch", "sm_80", "--cache-dir", str(blocker / "x"))
    assert code == 2 and "--cache-dir" in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- conftest's gate

GPU_TESTS = """
import pytest

@pytest.mark.gpu
def test_marked():
    pass

pytestmark_free = 1

@pytest.mark.skipif(True, reason="module's own no-GPU check")
@pytest.mark.gpu
def test_own_skipif():
    pass

def test_fixture(xp_gpu):
    pass

def test_cpu():
    pass
"""


@pytest.fixture
def gate(pytester):
    """Run GPU_TESTS under this conftest with a given cuda_status; returns the result."""
    from pathlib import Path

    conftest = (Path(__file__).parents[1] / "conftest.py").read_text()

    def run_with(state, reason="", fix=""):
        pytester.makeconftest(conftest + f"""
from cuflash._build.cuda_status import CudaStatus
cuda_status = lambda: CudaStatus({state!r}, {reason!r}, {fix!r})
""")
        pytester.makepyfile(test_gpu=GPU_TESTS)
        return pytester.runpytest_inprocess("-rsE", "-p", "no:cacheprovider")

    return run_with


def test_gate_skips_without_gpu_and_says_why_once(gate):
    result = gate("no-gpu", "no NVIDIA driver (libcuda not found)")
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines(["cuflash GPU tests: skipped (no CUDA GPU: no NVIDIA driver*"])


def test_gate_skips_without_cupy(gate):
    result = gate("no-cupy", fix="pip install 'cuflash[cuda13]'")
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines(["*CuPy is not installed*"])


def test_gate_fails_gpu_tests_of_a_broken_setup(gate):
    result = gate("broken", "cudaErrorInsufficientDriver: the driver supports CUDA 12.8",
                  "pip install 'cuflash[cuda12]'")
    result.assert_outcomes(passed=1, errors=3)  # the module's own skipif does not hide it
    result.stdout.fnmatch_lines(["cuflash GPU tests: FAIL, broken CUDA setup: *",
                                 "*broken CUDA setup: cudaErrorInsufficientDriver*cuda12*"])
