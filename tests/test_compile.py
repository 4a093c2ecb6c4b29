"""NVRTC compilation, ptxas reports and the cubin cache (CPU only: runs in CI).

The main test compiles every kernel variant the dispatcher can pick
(``cuflash._heuristics.precompile_variants()``) for sm_80 and sm_90a and requires zero
spills; ``pytest -s`` prints registers and shared memory per variant. The other tests use tiny
kernels written into a temporary ``cuda_src`` so they do not depend on the real kernels.
"""

import sys
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from cuflash import _compile, _nvrtc
from cuflash._compile import Variant

ARCHS = ("sm_80", "sm_90a")

TINY_KERNEL = r"""
#include "tiny.cuh"
extern "C" __global__ void cuflash_tiny(float* out) {
    __shared__ float buf[TINY_N];
    buf[threadIdx.x % TINY_N] = scale(threadIdx.x);
    __syncthreads();
    out[threadIdx.x] = buf[(threadIdx.x + 1) % TINY_N];
}
"""
TINY_HEADER = "__device__ __forceinline__ float scale(unsigned i) { return 2.0f * i; }\n"
BROKEN_KERNEL = 'extern "C" __global__ void cuflash_broken() { undefined_thing(); }\n'


@pytest.fixture
def tiny_src(tmp_path, monkeypatch):
    """A private cuda_src with a "tiny" and a "broken" family, and private cache dirs."""
    src = tmp_path / "cuda_src"
    src.mkdir()
    (src / "tiny.cu").write_text(TINY_KERNEL)
    (src / "tiny.cuh").write_text(TINY_HEADER)
    (src / "broken.cu").write_text(BROKEN_KERNEL)
    monkeypatch.setattr(_compile, "CUDA_SRC", src)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("CUFLASH_CACHE_DIR", raising=False)
    return src


TINY = Variant("tiny", {"TINY_N": 64})


# ----------------------------------------------------------------------------- real kernels

def _real_variants():
    try:
        from cuflash._heuristics import precompile_variants
    except ModuleNotFoundError as err:
        if err.name != "cuflash._heuristics":
            raise
        pytest.skip("cuflash._heuristics is not written yet")
    return list(dict.fromkeys(precompile_variants()))


def _missing_families(variants):
    return sorted({v.family for v in variants
                   if not (_compile.CUDA_SRC / f"{v.family}.cu").is_file()})


@pytest.fixture(scope="module")
def compiled():
    """Every (variant, arch) compiled once, in parallel threads (NVRTC releases the GIL)."""
    variants = _real_variants()
    missing = _missing_families(variants)
    present = [v for v in variants if v.family not in missing]
    if not present:
        pytest.skip(f"no kernel sources yet (missing: {', '.join(missing) or 'all'})")
    from cuflash._heuristics import ci_variants

    return _compile.compile_many([(v, a) for v, a in ci_variants() if v.family not in missing])


def test_variant_sources_exist():
    variants = _real_variants()
    assert variants, "precompile_variants() returned no variants"
    missing = _missing_families(variants)
    if missing:
        pytest.skip(f"kernel sources not written yet: {', '.join(f + '.cu' for f in missing)}")


def test_every_variant_compiles_without_spills(compiled):
    print(f"\n{'family':10} {'arch':7} {'regs':>4} {'smem':>6} {'stack':>5} "
          f"{'spill st/ld':>11} {'sec':>5}  defines")
    problems = []
    for variant, arch, result in compiled:
        name = f"{variant.family} [{variant.label()}] {arch}"
        if isinstance(result, Exception):
            print(f"{variant.family:10} {arch:7} ERROR  {variant.label()}")
            problems.append(f"{name}: {result}")
            continue
        print(f"{variant.family:10} {arch:7} {result.registers:4d} {result.smem_static:6d} "
              f"{result.stack_frame:5d} {result.spill_stores:5d}/{result.spill_loads:<5d} "
              f"{result.seconds:5.1f}  {variant.label()}")
        if not result.cubin.startswith(b"\x7fELF"):
            problems.append(f"{name}: cubin is not an ELF image ({len(result.cubin)} bytes)")
        if result.spills:
            problems.append(f"{name}: spills {result.spill_stores} B stored, "
                            f"{result.spill_loads} B loaded")
        # ptxas falls back to waiting after every wgmma when it cannot prove the pipeline safe (a
        # branch it thinks divergent, accumulators touched in flight): correct, and much slower.
        serialised = [ln for ln in result.log.splitlines() if "instructions are serialized" in ln]
        if serialised:
            problems.append(f"{name}: {serialised[0].strip()}")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- NVRTC wrapper

PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'other' for 'sm_80'
ptxas info    : Function properties for other
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 360 bytes cmem[0]
ptxas info    : Compiling entry function 'cuflash_fwd' for 'sm_80'
ptxas info    : Function properties for cuflash_fwd
ptxas         .     1808 bytes stack frame, 2440 bytes spill stores, 2820 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 1808 bytes cumulative stack size, 4000 bytes smem, 360 bytes cmem[0]
ptxas info    : Compile time = 253.953 ms
ptxas info    : Function properties for _Z6helperPfi
ptxas         .     16 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads
"""


def test_parse_ptxas_log():
    assert _nvrtc.parse_ptxas_log(PTXAS_LOG, "cuflash_fwd") == {
        # the non-inlined helper's spills count against the entry that calls it
        "registers": 32, "spill_stores": 2444, "spill_loads": 2828, "stack_frame": 1824,
        "smem_static": 4000}
    first = _nvrtc.parse_ptxas_log(PTXAS_LOG)
    assert (first["registers"], first["smem_static"], first["spill_stores"]) == (8, 0, 4)
    with pytest.raises(ValueError, match="no ptxas report"):
        _nvrtc.parse_ptxas_log("ptxas info    : 0 bytes gmem\n")


def test_compile_reports_resources(tiny_src):
    for arch in ARCHS:
        result = _compile.compile_cubin(TINY, arch)
        assert result.cubin.startswith(b"\x7fELF")
        assert result.registers > 0 and result.spills == 0
        assert result.smem_static == 64 * 4  # float buf[TINY_N]
        assert (result.variant, result.arch) == (TINY, arch)


def test_ctypes_backend_gives_the_same_cubin(tiny_src):
    path = _nvrtc._find_libnvrtc()
    if path is None:
        pytest.skip("libnvrtc not found for the ctypes backend")
    options = _compile.nvrtc_options(TINY, "sm_80")
    source = (tiny_src / "tiny.cu").read_text()
    cubin, log = _nvrtc._CtypesBackend(path).compile(source, "tiny.cu", options)
    assert "cuflash_tiny" in log
    assert cubin == _nvrtc.compile_to_cubin(source, "tiny.cu", options)[0]


def test_nvrtc_error_is_a_runtime_error_with_the_log(tiny_src):
    with pytest.raises(RuntimeError, match=r'(?s)broken\.cu.*"undefined_thing" is undefined'):
        _compile.compile_cubin(Variant("broken"), "sm_80")
    with pytest.raises(ValueError, match="unknown kernel family 'nope'"):
        _compile.compile_cubin(Variant("nope"), "sm_80")


# ----------------------------------------------------------------------------- hashing, cache

def test_source_hash_follows_the_sources(tiny_src):
    h0 = _compile.source_hash()
    assert len(h0) == 16 and int(h0, 16) >= 0
    assert f"-DCUFLASH_SRC_HASH=0x{h0}" in _compile.nvrtc_options(TINY, "sm_80")
    header = tiny_src / "tiny.cuh"
    header.write_text(TINY_HEADER + "// edited\n")
    h1 = _compile.source_hash()
    assert h1 != h0
    (tiny_src / "NOTES.txt").write_text("not a source")  # not shipped, so not hashed
    assert _compile.source_hash() == h1
    (tiny_src / "extra.cuh").write_text("")
    assert _compile.source_hash() != h1
    (tiny_src / "extra.cuh").unlink()
    header.write_text(TINY_HEADER)
    assert _compile.source_hash() == h0


def test_real_sources_are_found():
    assert _compile.CUDA_SRC.is_dir(), _compile.CUDA_SRC
    assert len(_compile.source_hash()) == 16


def test_variant_is_normalised():
    a = Variant("fwd_sm80", {"CUFLASH_HEAD_DIM": 128, "CUFLASH_DTYPE": 1})
    b = Variant("fwd_sm80", (("CUFLASH_DTYPE", True), ("CUFLASH_HEAD_DIM", 128)))
    assert a == b and hash(a) == hash(b)
    assert a.defines == (("CUFLASH_DTYPE", 1), ("CUFLASH_HEAD_DIM", 128))
    assert a.label() == "DTYPE=1,HEAD_DIM=128" and a.entry == "cuflash_fwd_sm80"


def test_cache_path_layout(tmp_path):
    a = Variant("fwd_sm80", {"CUFLASH_HEAD_DIM": 128, "CUFLASH_DTYPE": 1})
    path = _compile.cache_path(tmp_path, a, "sm_90a", "0123456789abcdef")
    assert path.parent == tmp_path / "sm_90a"
    family, defines_hash, src_hash = path.stem.split("-")
    assert (family, src_hash, path.suffix) == ("fwd_sm80", "0123456789abcdef", ".cubin")
    assert len(defines_hash) == 16
    other = Variant("fwd_sm80", {"CUFLASH_HEAD_DIM": 64, "CUFLASH_DTYPE": 1})
    assert _compile.cache_path(tmp_path, other, "sm_90a", "0123456789abcdef") != path
    assert _compile.cache_path(tmp_path, a, "sm_80", "0123456789abcdef").parent.name == "sm_80"


def test_cache_dirs_order(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("CUFLASH_CACHE_DIR", raising=False)
    assert _compile.cache_dirs() == [tmp_path / "xdg" / "cuflash"]
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "aot"))
    assert _compile.cache_dirs() == [tmp_path / "aot", tmp_path / "xdg" / "cuflash"]


def test_precompiled_cubin_is_found(tiny_src, tmp_path, monkeypatch):
    aot = tmp_path / "aot"
    assert _compile.find_cubin(TINY, "sm_80") is None
    (result,) = _compile.precompile([TINY], arch="sm_80", cache_dir=aot)
    path = _compile.cache_path(aot, TINY, "sm_80")
    assert path.read_bytes() == result.cubin
    assert not list(aot.rglob("*.tmp"))  # the atomic write left no temporary file
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(aot))
    assert _compile.find_cubin(TINY, "sm_80") == path
    assert _compile.find_cubin(TINY, "sm_90a") is None  # SASS is per architecture
    # Cached variants are skipped unless forced.
    assert _compile.precompile([TINY], arch="sm_80", cache_dir=aot) == []
    assert len(_compile.precompile([TINY], arch="sm_80", cache_dir=aot, force=True)) == 1
    # The user cache is the fallback lookup.
    monkeypatch.delenv("CUFLASH_CACHE_DIR")
    assert _compile.find_cubin(TINY, "sm_80") is None
    _compile.precompile([TINY], arch="sm_80,sm_90a")
    assert _compile.find_cubin(TINY, "sm_90a").is_relative_to(tmp_path / "xdg" / "cuflash")
    # Editing a source makes every cached cubin stale.
    (tiny_src / "tiny.cuh").write_text(TINY_HEADER + "// edited\n")
    assert _compile.find_cubin(TINY, "sm_80") is None


def test_get_kernel_compiles_once_and_caches(tiny_src, tmp_path, monkeypatch):
    # No GPU here: stand in for the device query and for cupy.RawModule.
    loaded = []

    class FakeModule:
        def __init__(self, path):
            loaded.append(path)

        def get_function(self, name):
            return ("kernel", name)

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=FakeModule))
    monkeypatch.setattr(_compile, "device_arch", lambda device=None: "sm_80")
    monkeypatch.setattr(_compile, "_kernels", {})
    with ThreadPoolExecutor(8) as pool:
        kernels = list(pool.map(lambda _: _compile.get_kernel(TINY), range(8)))
    assert kernels == [("kernel", "cuflash_tiny")] * 8
    user_copy = _compile.cache_path(tmp_path / "xdg" / "cuflash", TINY, "sm_80")
    assert loaded == [str(user_copy)] and user_copy.is_file()
    # A read-only cache from $CUFLASH_CACHE_DIR wins over the user cache.
    aot = tmp_path / "aot"
    _compile.precompile([TINY], arch="sm_80", cache_dir=aot)
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(aot))
    monkeypatch.setattr(_compile, "_kernels", {})
    _compile.get_kernel(TINY)
    assert loaded[-1] == str(_compile.cache_path(aot, TINY, "sm_80"))


def test_precompile_reports_failures_after_writing_the_rest(tiny_src, tmp_path):
    with pytest.raises(RuntimeError, match=r"1 of 2 variants failed:\nbroken"):
        _compile.precompile([TINY, Variant("broken")], arch="sm_80", cache_dir=tmp_path / "c")
    assert _compile.cache_path(tmp_path / "c", TINY, "sm_80").is_file()


# ----------------------------------------------------------------------------- command line

@pytest.fixture
def fake_heuristics(monkeypatch):
    """Stand-in for cuflash._heuristics so the CLI can be tested on the tiny kernels."""
    module = types.ModuleType("cuflash._heuristics")
    module.variants = [TINY]
    module.precompile_variants = lambda dtypes=None, head_dims=None, **kw: module.variants
    monkeypatch.setitem(sys.modules, "cuflash._heuristics", module)
    return module


def test_cli_precompile(tiny_src, tmp_path, fake_heuristics, capsys):
    from cuflash.__main__ import main

    out_dir = tmp_path / "aot"
    assert main(["precompile", "--arch", "sm_90a,sm_80", "--cache-dir", str(out_dir)]) == 0
    table = capsys.readouterr().out
    assert "tiny" in table and "TINY_N=64" in table and "2/2 variants OK" in table
    assert _compile.cache_path(out_dir, TINY, "sm_90a").is_file()
    fake_heuristics.variants = [TINY, Variant("broken")]
    assert main(["precompile", "--arch", "sm_80", "--cache-dir", str(out_dir)]) == 1
    captured = capsys.readouterr()
    assert "ERROR" in captured.out and "undefined_thing" in captured.err


def test_cli_without_gpu_exits_zero(capsys):
    from cuflash.__main__ import _gpu_count, main

    if _gpu_count():
        pytest.skip("a GPU is present: the main job runs the GPU self-check instead")
    assert main([]) == 0
    assert "no CUDA GPU found" in capsys.readouterr().out


def test_device_arch_without_gpu():
    from cuflash.__main__ import _gpu_count

    if _gpu_count():
        assert _compile.device_arch().startswith("sm_")
    else:
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            _compile.device_arch()

