"""NVRTC compilation, ptxas reports and the cubin cache (CPU only: runs in CI).

The sweep compiles every kernel family for sm_80 and sm_90a (see ``_sweep_jobs``), one test per
(family, arch) requiring a ptxas report, zero spills and no serialised wgmma; ``pytest -s``
prints registers, static+dynamic shared memory and compile time per variant. The other tests
use tiny kernels written into a temporary ``cuda_src`` so they do not depend on the real kernels.
"""

import os
import sys
import time
import types
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest

from cuflash._build import arch as _arch, cache as _cache, compile as _compile, cuda_status as _cuda_status, nvrtc as _nvrtc
from cuflash._build.variant import Variant

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
#
# The sweep: cuflash.kernels.catalogue.ci_variants() (every family for sm_80 and sm_90a, forward at
# every default head dim, the rest at D=128), or with CUFLASH_COMPILE_ALL=1 every variant
# precompile_variants() lists for both archs (about twice as many). Compiled once per session in
# a thread pool sized to the CPUs, with a progress line every ~10% of it. Results are kept with
# their ptxas reports in <user cache>/tests (the last few source versions only), so a rerun on
# unchanged sources (same NVRTC, same options) compiles nothing. CUFLASH_TEST_RECOMPILE=1
# compiles everything again.

_ON_GPU_MACHINE = _cuda_status.cuda_status().state == "ok"


def _sweep_jobs():
    from cuflash.kernels.catalogue import ci_variants
    from cuflash.kernels.catalogue import precompile_variants

    jobs = list(ci_variants())
    if os.environ.get("CUFLASH_COMPILE_ALL") == "1":
        jobs += [(v, a) for a in ARCHS for v in precompile_variants(arch=a)]
    # Longest first, so that the pool's threads finish together: fwd_sm90 (wgmma, warp
    # specialised) takes 1-25 s a variant on a 2-core machine, every other family 0.1-3 s.
    return sorted(dict.fromkeys(jobs), key=lambda job: job[0].family != "fwd_sm90")


def _prune(cache, keep=4):
    """Keep the cubins of the ``keep`` most recently written source versions (about 15-25 MB
    each): every edit of cuda_src/ makes a new version."""
    versions = defaultdict(list)
    for path in cache.glob("*/*"):
        if path.suffix in (".cubin", ".ptxas"):
            versions[path.stem.rsplit("-", 1)[-1]].append(path)

    def newest(paths):
        try:
            return max(p.stat().st_mtime for p in paths)
        except OSError:  # pruned meanwhile by another run
            return 0.0

    for version in sorted(versions, key=lambda v: newest(versions[v]), reverse=True)[keep:]:
        for path in versions[version]:
            path.unlink(missing_ok=True)


def _say(config, line):
    """A line on the terminal now, through pytest's capture (visible with pytest -q)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(line, file=sys.__stderr__, flush=True)
        return
    with capture.global_and_fixture_disabled():
        if getattr(getattr(reporter, "_tw", None), "width_of_current_line", 0):
            reporter.write("\n")  # after the progress dots of pytest -q
        reporter.write_line(line)


@pytest.fixture(scope="session")
def sweep(request):
    """{(family, arch): [(variant, arch, CompileResult or Exception), ...]} for the sweep."""
    config = request.config
    jobs = _sweep_jobs()
    force = os.environ.get("CUFLASH_TEST_RECOMPILE") == "1"
    src_hash = _compile.source_hash()
    cache = _cache.user_cache_dir() / "tests"
    todo = len(jobs) if force else sum(
        _compile.cached_result(cache, v, a, src_hash) is None for v, a in jobs)
    threads = _compile.default_threads()
    _say(config, f"compile sweep: {len(jobs)} variants for {','.join(ARCHS)}, {todo} to compile "
                 f"on {threads} threads ({len(jobs) - todo} cached in {cache})")
    start = last = time.perf_counter()
    every = max(1, todo // 10)

    def progress(done, total, variant, arch, result):
        nonlocal last
        now = time.perf_counter()
        if done % every == 0 or done == total or now - last > 15:  # ~10 lines, more if slow
            last = now
            _say(config, f"compile sweep: {done}/{total} compiled in {now - start:.0f} s")

    results = _compile.build(jobs, cache, force, threads, progress)
    _prune(cache)
    by_group = {}
    for variant, arch, result in results:
        by_group.setdefault((variant.family, arch), []).append((variant, arch, result))
    return by_group


def test_sweep_covers_every_family_and_arch():
    from cuflash.kernels.catalogue import precompile_variants

    covered = {(v.family, a) for v, a in _sweep_jobs()}
    families = {p.stem for p in _compile.CUDA_SRC.glob("*.cu")}
    wanted = {(v.family, a) for a in ARCHS for v in precompile_variants(arch=a)}
    assert wanted <= covered, f"not in the sweep: {sorted(wanted - covered)}"
    # Families compiled per user expression (cuda_src/mask_blocks.cu: a MaskMod's block mask) cannot be
    # precompiled; the sweep compiles them for the catalogue's sample expressions.
    per_expression = {"mask_blocks"}
    assert {(f, a) for f in per_expression for a in ARCHS} <= covered
    never = families - {f for f, _ in wanted} - per_expression
    assert not never, f"kernel sources no variant compiles: {sorted(never)}"
    missing = {v.family for v, _ in _sweep_jobs()} - families
    assert not missing, f"variants of families without a source: {sorted(missing)}"


@pytest.mark.parametrize("family, arch", sorted(dict.fromkeys((v.family, a) for v, a in _sweep_jobs())))
def test_compiles_without_spills(sweep, family, arch):
    problems = []
    print(f"\n{'family':14} {'arch':7} {'regs':>4} {'smem':>6}+{'dyn':<6} {'stack':>5} "
          f"{'spill st/ld':>11} {'sec':>6}  defines")
    for variant, arch, result in sweep[(family, arch)]:
        name = f"{variant.family} [{variant.label()}] {arch}"
        if isinstance(result, Exception):
            print(f"{variant.family:14} {arch:7} ERROR  {variant.label()}")
            problems.append(f"{name}: {result}")
            continue
        sec = "cached" if result.cached else f"{result.seconds:.1f}"
        print(f"{variant.family:14} {arch:7} {result.registers:4d} {result.smem_static:6d}+"
              f"{result.smem_dynamic:<6d} {result.stack_frame:5d} "
              f"{result.spill_stores:5d}/{result.spill_loads:<5d} {sec:>6}  {variant.label()}")
        if not result.cubin.startswith(b"\x7fELF"):
            problems.append(f"{name}: cubin is not an ELF image ({len(result.cubin)} bytes)")
        if result.registers < 0 and not _ON_GPU_MACHINE:
            # The NVRTC that CuPy loads on the H100/H200 machines (13.0) returns good cubins with
            # an empty log for some variants (bwd_* for sm_90a); CI's pip NVRTC always reports.
            problems.append(f"{name}: no ptxas report in the NVRTC log")
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


@pytest.fixture
def chosen_nvrtc(monkeypatch):
    """Sets CUFLASH_NVRTC for one test: the libnvrtc in use is chosen once per process, so the choice is
    forgotten before and after."""
    def choose(path):
        monkeypatch.setenv("CUFLASH_NVRTC", str(path))
        _nvrtc._backend.cache_clear()
        _compile._nvrtc_version.cache_clear()
    yield choose
    monkeypatch.delenv("CUFLASH_NVRTC", raising=False)
    _nvrtc._backend.cache_clear()
    _compile._nvrtc_version.cache_clear()


def test_cuflash_nvrtc_chooses_the_library(tiny_src, chosen_nvrtc):
    path = _nvrtc._find_libnvrtc()
    if path is None:
        pytest.skip("no libnvrtc file to name")
    options = _compile.nvrtc_options(TINY, "sm_80")
    source = (tiny_src / "tiny.cu").read_text()
    want = _nvrtc.compile_to_cubin(source, "tiny.cu", options)[0]
    chosen_nvrtc(path)
    assert _nvrtc.library() == path
    assert _nvrtc.compile_to_cubin(source, "tiny.cu", options)[0] == want


def test_cuflash_nvrtc_that_is_no_library_is_named(tmp_path, chosen_nvrtc):
    chosen_nvrtc(tmp_path / "missing.so")
    with pytest.raises(RuntimeError, match=r"CUFLASH_NVRTC names .*missing\.so.*not a file"):
        _nvrtc.version()
    not_a_library = tmp_path / "libnvrtc.so.13"
    not_a_library.write_text("not an ELF file")
    chosen_nvrtc(not_a_library)
    with pytest.raises(RuntimeError, match=r"CUFLASH_NVRTC=.*is not a loadable libnvrtc"):
        _nvrtc.version()


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
    assert a.describe() == "bf16 D128"


@pytest.mark.parametrize("defines, words", [
    ({"CUFLASH_DTYPE": 0, "CUFLASH_HEAD_DIM": 64, "CUFLASH_SCORE_MODS": 31, "CUFLASH_DROPOUT": 1},
     "fp16 D64 mods dropout"),
    ({"CUFLASH_DTYPE": 1, "CUFLASH_HEAD_DIM": 128, "CUFLASH_SCORE_MODS": 4}, "bf16 D128 bias"),
    ({"CUFLASH_DTYPE": 2, "CUFLASH_HEAD_DIM": 128, "CUFLASH_BWD_PASS": 1}, "fp32 D128 dq"),
    ({"CUFLASH_DTYPE": 1, "CUFLASH_HEAD_DIM": 256, "CUFLASH_PAGED": 1}, "bf16 D256 paged"),
    ({"CUFLASH_IN_DTYPE": 3, "CUFLASH_OUT_DTYPE": 3}, "fp64->fp64"),
    ({"CUFLASH_CHECK_PARAMS_SIZE": 64}, ""),
])
def test_variant_describes_itself_in_words(defines, words):
    assert Variant("x", defines).describe() == words


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
    assert _cache.cache_dirs() == [tmp_path / "xdg" / "cuflash"]
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "aot"))
    assert _cache.cache_dirs() == [tmp_path / "aot", tmp_path / "xdg" / "cuflash"]


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
    monkeypatch.setattr(_compile, "current_device", lambda: 0)
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


def test_precompile_shows_progress_and_one_summary_line(tiny_src, tmp_path, capsys):
    # No compiler warnings, one line per quarter at most in a log (stderr is not a terminal here).
    aot = tmp_path / "aot"
    _compile.precompile([TINY], arch="sm_80,sm_90a", cache_dir=aot)
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) <= 5 and "warning" not in err
    assert err.splitlines()[-1].startswith(
        "cuflash.precompile: 2 variants for sm_80,sm_90a: 2 built, 0 found in cache; ")
    assert _compile.precompile([TINY], arch="sm_80", cache_dir=aot) == []
    assert capsys.readouterr().err.startswith("cuflash.precompile: 1 variant for sm_80: 0 built, 1 found")
    _compile.precompile([TINY], arch="sm_80", cache_dir=aot, force=True, quiet=True)
    assert capsys.readouterr() == ("", "")


def test_precompile_reports_failures_after_writing_the_rest(tiny_src, tmp_path):
    with pytest.raises(RuntimeError, match=r"1 of 2 variants failed:\nbroken"):
        _compile.precompile([TINY, Variant("broken")], arch="sm_80", cache_dir=tmp_path / "c")
    assert _compile.cache_path(tmp_path / "c", TINY, "sm_80").is_file()


# ----------------------------------------------------------------------------- architectures

def test_arch_for_compute_capability():
    assert _arch.arch_for("90") == "sm_90a" and _arch.arch_for(80) == "sm_80"
    assert _arch.arch_for("120") == "sm_120"


@pytest.mark.parametrize("spec, message", [
    ("sm90", "use sm_90a"), ("sm_90", "use sm_90a"), ("compute_90", "use sm_90a"),
    ("sm_80a", "use sm_80"), ("sm_75", "need sm_80 or newer"), ("h100", "such as sm_80"),
    ("sm_99", "cannot compile for it"), ("", "no architecture"),
])
def test_parse_archs_rejects_with_one_line(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        _arch.parse_archs(spec)
    assert "\n" not in str(info.value) and len(str(info.value)) < 140


def test_parse_archs_accepts_lists_and_drops_repeats():
    assert _arch.parse_archs(" sm_90a,sm_80 ,sm_90a") == ["sm_90a", "sm_80"]
    assert _arch.parse_archs(["sm_80", "sm_90a"]) == ["sm_80", "sm_90a"]
    assert set(_nvrtc.supported_archs()) >= {80, 90}


def test_device_arch_says_why_there_is_no_gpu():
    status = _cuda_status.cuda_status()
    if status.state == "ok":
        assert _arch.device_arch().startswith("sm_")
    else:
        with pytest.raises(RuntimeError, match="no CUDA GPU" if status.state == "no-gpu"
                           else "CuPy is not installed|CUDA is not usable"):
            _arch.device_arch()


def test_cached_result_needs_the_same_nvrtc_and_options(tiny_src, tmp_path, monkeypatch):
    cache = tmp_path / "c"
    assert _compile.cached_result(cache, TINY, "sm_80") is None
    (compiled,) = _compile.build([(TINY, "sm_80")], cache)[:1]
    assert not compiled[2].cached
    again = _compile.cached_result(cache, TINY, "sm_80")
    assert again.cached and again.cubin == compiled[2].cubin
    assert (again.registers, again.smem_static) == (compiled[2].registers, 64 * 4)
    # build() reuses it; force recompiles
    assert _compile.build([(TINY, "sm_80")], cache)[0][2].cached
    assert not _compile.build([(TINY, "sm_80")], cache, force=True)[0][2].cached
    # another NVRTC version, or other options, make it stale
    monkeypatch.setattr(_compile, "_nvrtc_version", lambda: (99, 0))
    assert _compile.cached_result(cache, TINY, "sm_80") is None
    monkeypatch.undo()
    monkeypatch.setattr(_compile, "CUDA_SRC", tiny_src)
    real = _compile.nvrtc_options
    monkeypatch.setattr(_compile, "nvrtc_options", lambda *a, **k: real(*a, **k) + ["-lineinfo"])
    assert _compile.cached_result(cache, TINY, "sm_80") is None


def test_compile_many_reports_progress_in_order(tiny_src):
    seen = []
    jobs = [(TINY, "sm_80"), (Variant("broken"), "sm_80"), (TINY, "sm_90a")]
    results = _compile.compile_many(jobs, 2, lambda *args: seen.append(args))
    assert [(v, a) for v, a, _ in results] == jobs
    assert isinstance(results[1][2], RuntimeError)
    assert sorted(done for done, *_ in seen) == [1, 2, 3] and {t for _, t, *_ in seen} == {3}


def test_prune_keeps_the_newest_source_versions(tmp_path):
    for age, version in enumerate("abcdef"):
        for name in (f"fwd-1-{version}.cubin", f"fwd-1-{version}.ptxas", f"fwd-2-{version}.cubin"):
            path = tmp_path / "sm_80" / name
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(b"")
            os.utime(path, (1000 - age, 1000 - age))  # "a" is the newest
    (tmp_path / "sm_80" / "notes.txt").write_text("")
    _prune(tmp_path, keep=2)
    left = sorted(p.name for p in (tmp_path / "sm_80").iterdir())
    assert left == ["fwd-1-a.cubin", "fwd-1-a.ptxas", "fwd-1-b.cubin", "fwd-1-b.ptxas",
                    "fwd-2-a.cubin", "fwd-2-b.cubin", "notes.txt"]


def test_smem_dynamic_is_the_define():
    result = _compile.CompileResult(b"", "", 1, 0, 0, 1024,
                                    variant=Variant("x", {"CUFLASH_SMEM_BYTES": 230400}))
    assert (result.smem_static, result.smem_dynamic) == (1024, 230400)
    assert _compile.CompileResult(b"", "", 1, 0, 0, 0, variant=Variant("x")).smem_dynamic == 0


def test_a_slow_compile_says_so_once(capsys):
    # A call that waits more than a second for NVRTC gets one line on stderr; a quick one none.
    variant = Variant("fwd_sm90", {"CUFLASH_DTYPE": 1, "CUFLASH_HEAD_DIM": 128, "CUFLASH_SCORE_MODS": 1})
    _compile.compile_notice(variant, "sm_90a", 0.4, "/cache/sm_90a/x.cubin")
    assert capsys.readouterr().err == ""
    _compile.compile_notice(variant, "sm_90a", 37.2, "/cache/sm_90a/x.cubin")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fwd_sm90" in err and "37.2 s" in err and "D128" in err
    assert "/cache/sm_90a" in err
