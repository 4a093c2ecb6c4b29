"""The on-disk cubin cache: where cubins live, how they are written and how they are read back.

An entry is ``DIR/<arch>/<family>-<key hash>-<source hash>.cubin`` with its report beside it
(``.ptxas``, JSON: the cubin's length and sha256, and whatever the compiler adds: the ptxas log,
the compile time). The key hash is the caller's (:func:`cuflash._build.compile.cache_path` hashes the
NVRTC version and the options), so this module knows nothing of variants or of NVRTC.

Both files are written atomically, the report first, so that a reader (another process too)
never sees a partial file and never a cubin without the report that vouches for it. A cubin that
does not match its report (empty, cut short, overwritten) is never handed out: it is deleted, so
that it gets built again, except in ``$CUFLASH_CACHE_DIR``, which is read only by contract.

Where to look, in order: ``$CUFLASH_CACHE_DIR`` (e.g. filled ahead of time by ``python -m cuflash
precompile --cache-dir``), the user cache (``$XDG_CACHE_HOME/cuflash`` or ``~/.cache/cuflash``),
then ``<temp dir>/cuflash-<uid>``, where a process whose user cache is not writable stores its
cubins for this user's later processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["user_cache_dir", "cache_dirs", "temp_cache_dir", "entry_path", "find", "read",
           "store", "discard", "report_path"]


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/cuflash``, else ``~/.cache/cuflash``: where compiled cubins go."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cuflash"


def cache_dirs() -> list[Path]:
    """Where :func:`find` looks first, in order: $CUFLASH_CACHE_DIR (if set), the user cache.
    The temporary cache comes after them, when there is one (:func:`temp_cache_dir`)."""
    env = os.environ.get("CUFLASH_CACHE_DIR")
    return ([Path(env)] if env else []) + [user_cache_dir()]


def temp_cache_dir(create: bool = False) -> Path | None:
    """``<temp dir>/cuflash-<uid>``: where cubins go when the user cache is not writable, found
    again by this user's later processes. None when it does not exist (``create`` makes it,
    0700) or cannot be trusted: a symlink, another user's, or writable by others (anyone may
    create that name in /tmp first)."""
    uid = os.getuid() if hasattr(os, "getuid") else None  # Windows: the temp dir is per user
    path = Path(tempfile.gettempdir()) / (f"cuflash-{uid}" if uid is not None else "cuflash")
    if create:
        try:
            path.mkdir(mode=0o700, exist_ok=True)
        except OSError:  # something else holds the name: rejected below
            pass
    try:
        st = path.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    if uid is not None and (st.st_uid != uid or st.st_mode & 0o022):
        return None
    return path


def entry_path(cache_dir, arch: str, family: str, key, src_hash: str) -> Path:
    """``cache_dir/<arch>/<family>-<key hash>-<src_hash>.cubin``; ``key`` is anything JSON
    can write (what must match for a cubin to be reused), hashed to 16 hex digits."""
    key_hash = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    return Path(cache_dir) / arch / f"{family}-{key_hash}-{src_hash}.cubin"


def report_path(cubin_path) -> Path:
    """The report that vouches for the cubin at ``cubin_path``."""
    return Path(cubin_path).with_suffix(".ptxas")


def find(name) -> Path | None:
    """The first good cubin called ``name`` (a path relative to a cache directory) in
    :func:`cache_dirs`, then in the temporary cache; None if there is none. A damaged one met on
    the way is discarded (see :func:`discard`)."""
    for directory in (*cache_dirs(), temp_cache_dir()):
        if directory is None:
            continue
        path = directory / name
        if read(path) is not None:
            return path
        if path.exists():
            discard(path)
    return None


def read(path) -> tuple[bytes, dict] | None:
    """The cubin at ``path`` and its report, or None when either is missing or the cubin is not
    the ELF image of the length and sha256 its report gives (empty, cut short, overwritten):
    the driver must never see such a file."""
    path = Path(path)
    try:
        report = json.loads(report_path(path).read_text())
        cubin = path.read_bytes()
    except (OSError, ValueError):
        return None
    if (not isinstance(report, dict) or not cubin.startswith(b"\x7fELF")
            or report.get("cubin") != _fingerprint(cubin)):
        return None
    return cubin, report


def store(path, cubin: bytes, report: dict) -> Path:
    """Write ``cubin`` to ``path`` and ``report`` (plus the cubin's length and sha256) beside
    it, both atomically: readers never see a partial file, and concurrent writers of the same
    entry both succeed."""
    path = Path(path)
    # Report first: a cubin is never there without the report that vouches for it.
    _atomic_write(report_path(path), json.dumps({**report, "cubin": _fingerprint(cubin)}).encode())
    return _atomic_write(path, cubin)


def discard(path) -> None:
    """Delete a damaged cubin and its report, where the cache is ours to change."""
    path = Path(path)
    env = os.environ.get("CUFLASH_CACHE_DIR")
    if env and path.is_relative_to(env):
        return
    for stale in (path, report_path(path)):
        try:
            stale.unlink(missing_ok=True)
        except OSError:  # a read-only user cache: the file is skipped all the same
            pass


def _fingerprint(cubin: bytes) -> dict:
    return {"bytes": len(cubin), "sha256": hashlib.sha256(cubin).hexdigest()}


def _atomic_write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Created 0644 less the umask, as any file; not through mkstemp, whose 0600 would keep the
    # other users of a shared --cache-dir out.
    tmp = path.with_name(f"{path.name}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
