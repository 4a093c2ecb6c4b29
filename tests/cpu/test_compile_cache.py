"""The on-disk cubin cache under faults (CPU only: runs in CI).

What must hold: a cubin is reused only by the same NVRTC with the same options; a damaged cubin
(empty, cut short, overwritten) never reaches the driver and is built again; cache files are
readable by whom the umask lets read them; an unwritable user cache falls back on one private
temporary directory that later processes find again. A real, small kernel (merge) is compiled;
the GPU is stood in for (:func:`fake_gpu`), so nothing here needs one.
"""

import json
import os
import stat
import sys
import tempfile
import types
from pathlib import Path

import pytest

from cuflash._build import cache as _cache, compile as _compile, nvrtc as _nvrtc
from cuflash.kernels.merge import merge_plan

MERGE = merge_plan("float32", "float32").variant  # the quickest real variant to compile (~0.1 s)
ARCH = "sm_80"
posix_only = pytest.mark.skipif(not hasattr(os, "getuid"), reason="uids and modes are POSIX")


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Private user cache, no $CUFLASH_CACHE_DIR, a private temp dir: the real ones stay untouched."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("CUFLASH_CACHE_DIR", raising=False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path


class FakeDriverError(Exception):
    def __init__(self, status):
        super().__init__(f"CUDA driver error {status}")
        self.status = status


@pytest.fixture
def fake_gpu(monkeypatch):
    """No GPU here: stand in for the device query and cupy.RawModule, and count compilations.

    ``gpu.loaded`` lists the paths loaded, ``gpu.compiled`` the variants compiled (build()'s
    too: clear it after setting up); a status put in ``gpu.fail`` makes the next load raise
    that driver error.
    """
    gpu = types.SimpleNamespace(loaded=[], compiled=[], fail=[])

    class FakeModule:
        def __init__(self, path):
            if gpu.fail:
                raise FakeDriverError(gpu.fail.pop(0))
            with open(path, "rb") as f:  # what the driver would read: it must be a whole cubin
                assert f.read(4) == b"\x7fELF"
            gpu.loaded.append(path)

        def get_function(self, name):
            return ("kernel", name)

    driver = types.SimpleNamespace(CUDADriverError=FakeDriverError)
    cupy = types.SimpleNamespace(RawModule=FakeModule, cuda=types.SimpleNamespace(driver=driver))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(_compile, "device_arch", lambda device=None: ARCH)
    monkeypatch.setattr(_compile, "current_device", lambda: 0)
    monkeypatch.setattr(_compile, "_kernels", {})
    real = _compile.compile_cubin

    def compile_cubin(variant, arch, *args, **kwargs):
        gpu.compiled.append(variant)
        return real(variant, arch, *args, **kwargs)

    monkeypatch.setattr(_compile, "compile_cubin", compile_cubin)
    return gpu


def new_process(monkeypatch):
    """What a new process starts with: no kernel loaded yet."""
    monkeypatch.setattr(_compile, "_kernels", {})


def user_path():
    return _compile.cache_path(_cache.user_cache_dir(), MERGE, ARCH)


# ----------------------------------------------------------------------------- the key

def test_key_follows_the_nvrtc_version_and_the_options(caches, monkeypatch):
    path = user_path()
    _compile.build([(MERGE, ARCH)])
    assert _compile.find_cubin(MERGE, ARCH) == path
    # Another libnvrtc (the cuda12 extra instead of cuda13): another name, nothing found.
    with monkeypatch.context() as m:
        m.setattr(_compile, "_nvrtc_version", lambda: (12, 9))
        assert user_path() != path and user_path().parent == path.parent
        assert _compile.find_cubin(MERGE, ARCH) is None
        assert _compile.cached_result(_cache.user_cache_dir(), MERGE, ARCH) is None
    assert user_path() == path
    # Another option: another name.
    real = _compile.nvrtc_options
    monkeypatch.setattr(_compile, "nvrtc_options", lambda *a, **k: real(*a, **k) + ["-lineinfo"])
    assert user_path() != path
    assert _compile.find_cubin(MERGE, ARCH) is None


def test_key_ignores_where_the_headers_are(caches, monkeypatch):
    # A checkout and an installed wheel of the same sources share their cubins: the include
    # path is no part of the key (the headers' contents are, through the source hash).
    path = user_path()
    moved = caches / "elsewhere"
    moved.mkdir()
    for source in _compile.CUDA_SRC.iterdir():
        if source.is_file():
            (moved / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(_compile, "CUDA_SRC", moved)
    assert user_path() == path


def test_nvrtc_version_is_asked_once(monkeypatch):
    calls = []

    def version():
        calls.append(1)
        return (13, 0)

    _compile._nvrtc_version.cache_clear()
    try:
        monkeypatch.setattr(_nvrtc, "version", version)
        for out_dtype in ("float16", "bfloat16", "float32"):
            _compile.cache_path("c", merge_plan("float32", out_dtype).variant, ARCH, "0")
        assert len(calls) == 1
    finally:
        _compile._nvrtc_version.cache_clear()  # forget the stand-in's answer


# ----------------------------------------------------------------------------- damaged cubins

def _damage(path, how):
    cubin = path.read_bytes()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "cut short":
        path.write_bytes(cubin[:len(cubin) // 2])
    elif how == "garbage":
        path.write_bytes(os.urandom(len(cubin)))
    elif how == "one byte changed":  # still an ELF image of the right length
        path.write_bytes(cubin[:-1] + bytes([cubin[-1] ^ 1]))
    elif how == "no report":
        _cache.report_path(path).unlink()
    elif how == "garbled report":
        _cache.report_path(path).write_text("{not json")
    else:
        raise AssertionError(how)


DAMAGES = ["empty", "cut short", "garbage", "one byte changed", "no report", "garbled report"]


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_cubin_is_deleted_and_rebuilt(caches, fake_gpu, monkeypatch, how):
    ((_, _, first),) = _compile.build([(MERGE, ARCH)])
    path = user_path()
    _damage(path, how)
    fake_gpu.compiled.clear()
    assert _compile.cached_result(_cache.user_cache_dir(), MERGE, ARCH) is None
    assert _compile.find_cubin(MERGE, ARCH) is None
    assert not path.exists() and not _cache.report_path(path).exists()  # deleted
    assert _compile.get_kernel(MERGE) == ("kernel", MERGE.entry)
    assert fake_gpu.compiled == [MERGE] and fake_gpu.loaded == [str(path)]
    again = _compile.cached_result(_cache.user_cache_dir(), MERGE, ARCH)
    assert again is not None and again.cubin == first.cubin


def test_a_file_that_is_not_a_cubin_is_never_found(caches):
    # Its report vouches for it (length and hash match), yet it is no ELF image.
    path = _compile.store_cubin(user_path(), b"PTX text, not a cubin")
    assert _compile.find_cubin(MERGE, ARCH) is None and not path.exists()


@pytest.mark.parametrize("how", ["cut short", "no report"])
def test_build_rebuilds_a_damaged_cubin(caches, how):
    ((_, _, first),) = _compile.build([(MERGE, ARCH)])
    _damage(user_path(), how)
    ((_, _, rebuilt),) = _compile.build([(MERGE, ARCH)])
    assert not rebuilt.cached and rebuilt.cubin == first.cubin
    assert _compile.cached_result(_cache.user_cache_dir(), MERGE, ARCH).cubin == first.cubin


@pytest.mark.parametrize("how", ["cut short", "garbage"])
def test_damaged_cubin_in_the_read_only_cache_is_skipped(caches, fake_gpu, monkeypatch, how):
    aot = caches / "aot"
    _compile.precompile([MERGE], arch=ARCH, cache_dir=aot)
    shared = _compile.cache_path(aot, MERGE, ARCH)
    _damage(shared, how)
    damaged = shared.read_bytes()
    fake_gpu.compiled.clear()
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(aot))
    assert _compile.find_cubin(MERGE, ARCH) is None
    assert _compile.get_kernel(MERGE) == ("kernel", MERGE.entry)
    # Compiled into the user cache; $CUFLASH_CACHE_DIR left as it was (read only by contract).
    assert fake_gpu.compiled == [MERGE] and fake_gpu.loaded == [str(user_path())]
    assert shared.read_bytes() == damaged and _cache.report_path(shared).exists()


def test_a_cubin_the_driver_refuses_is_rebuilt_once(caches, fake_gpu, monkeypatch):
    _compile.build([(MERGE, ARCH)])
    path = user_path()
    fake_gpu.compiled.clear()
    fake_gpu.fail = [200]  # CUDA_ERROR_INVALID_IMAGE, though it matches its report
    assert _compile.get_kernel(MERGE) == ("kernel", MERGE.entry)
    assert fake_gpu.compiled == [MERGE] and fake_gpu.loaded == [str(path)]
    # Refused again after the rebuild: the error is the caller's, no third try.
    new_process(monkeypatch)
    fake_gpu.fail = [200, 200]
    with pytest.raises(FakeDriverError):
        _compile.get_kernel(MERGE)
    assert fake_gpu.compiled == [MERGE, MERGE]
    # An error a rebuild cannot mend (here CUDA_ERROR_ILLEGAL_ADDRESS, a dead context) is
    # raised at once: no compilation, the cached cubin kept.
    new_process(monkeypatch)
    fake_gpu.fail = [700]
    with pytest.raises(FakeDriverError):
        _compile.get_kernel(MERGE)
    assert fake_gpu.compiled == [MERGE, MERGE] and path.is_file()


# ----------------------------------------------------------------------------- file modes

@posix_only
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o644)],
                         ids=["umask 022", "umask 077", "umask 002"])
def test_cache_files_are_as_readable_as_the_umask_allows(caches, umask, mode):
    old = os.umask(umask)
    try:
        _compile.build([(MERGE, ARCH)], caches / "shared")
    finally:
        os.umask(old)
    path = _compile.cache_path(caches / "shared", MERGE, ARCH)
    for written in (path, _cache.report_path(path)):
        assert stat.S_IMODE(written.stat().st_mode) == mode, written
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(
        [path.name, _cache.report_path(path).name])  # no temporary file left


# ----------------------------------------------------------------------------- no writable cache

def _unwritable_user_cache(caches, monkeypatch):
    # Under a regular file: unwritable even for root (for whom a chmod'ed directory is not).
    (caches / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(caches / "a-file" / "xdg"))


@posix_only
def test_unwritable_user_cache_falls_back_on_one_temp_dir(caches, fake_gpu, monkeypatch):
    _unwritable_user_cache(caches, monkeypatch)
    temp = caches / "tmp" / f"cuflash-{os.getuid()}"
    _compile.get_kernel(MERGE)
    new_process(monkeypatch)
    _compile.get_kernel(MERGE)
    # Compiled once; both "processes" loaded the same file, in this user's private temp dir.
    expected = str(_compile.cache_path(temp, MERGE, ARCH))
    assert fake_gpu.compiled == [MERGE] and fake_gpu.loaded == [expected, expected]
    assert stat.S_IMODE(temp.stat().st_mode) == 0o700
    assert _compile.find_cubin(MERGE, ARCH) == _compile.cache_path(temp, MERGE, ARCH)


@posix_only
@pytest.mark.parametrize("trap", ["symlink", "writable by others", "a file", "another user's"])
def test_an_untrusted_temp_dir_is_not_used(caches, fake_gpu, monkeypatch, trap):
    # Anyone can create /tmp/cuflash-<uid> before us: never read from it nor write into it.
    _unwritable_user_cache(caches, monkeypatch)
    temp = caches / "tmp" / f"cuflash-{os.getuid()}"
    planted = caches / "planted"
    if trap == "symlink":
        _compile.build([(MERGE, ARCH)], planted)  # a valid cubin, not ours to trust
        temp.symlink_to(planted)
    elif trap == "writable by others":
        _compile.build([(MERGE, ARCH)], temp)
        temp.chmod(0o777)
    elif trap == "another user's":  # as seen by a stand-in uid: ours is not theirs
        uid = os.getuid() + 1
        monkeypatch.setattr(os, "getuid", lambda: uid)
        temp = caches / "tmp" / f"cuflash-{uid}"
        _compile.build([(MERGE, ARCH)], temp)
        temp.chmod(0o700)
    else:
        temp.write_text("")
    fake_gpu.compiled.clear()
    assert _compile.find_cubin(MERGE, ARCH) is None
    _compile.get_kernel(MERGE)
    assert fake_gpu.compiled == [MERGE]
    (loaded,) = map(Path, fake_gpu.loaded)
    # A private directory of its own instead, as before there was a shared one.
    private = loaded.parent.parent
    assert private not in (temp, planted) and planted not in loaded.parents
    assert private.parent == caches / "tmp" and stat.S_IMODE(private.stat().st_mode) == 0o700


def test_report_records_what_the_cubin_was(caches):
    ((_, _, result),) = _compile.build([(MERGE, ARCH)])
    report = json.loads(_cache.report_path(user_path()).read_text())
    assert report["cubin"]["bytes"] == len(result.cubin)
    assert len(report["cubin"]["sha256"]) == 64
    assert tuple(report["nvrtc"]) == _nvrtc.version()
