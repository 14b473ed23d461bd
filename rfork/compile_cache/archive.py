"""Pack a compile-cache directory into a digested tar; unpack a peer's archive, refusing anything unsafe.

The archive is plain tar: first a member `.rfork-compile-cache.json` naming the key it was packed
under, then the directory's regular files (relative paths, permission bits masked to 0o755, mtimes kept). Its
name on the wire is `sha256:<hex>` of the whole archive.

The archive comes from a peer and holds code the engine will load, so `unpack` trusts nothing in it:
the digest must match before tar is parsed; the key member must come first and name the expected key;
members may only be regular files and directories with relative, normalised paths (no absolute path,
no `..`, no links, no devices or fifos); member count, archive size and unpacked size are capped. It
extracts into a fresh staging directory beside the destination and only then moves files in, never
replacing a file the local cache already holds; a refusal leaves the destination as it was. The
digest proves the bytes are the ones the seed packed, not that the seed is honest: trust in the
artifacts is trust in the seeds the planner registered.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import stat
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from rfork.errors import RforkError

log = logging.getLogger(__name__)

META_NAME = ".rfork-compile-cache.json"
_META_MAX = 4096
_DIGEST_PREFIX = "sha256:"


class CompileCacheError(RforkError):
    """A compile cache could not be packed, fetched or installed (the engine then compiles as usual)."""


class ArchiveRefused(CompileCacheError, ValueError):
    """A peer's archive is unsafe, oversized, malformed or does not match its digest; nothing installed."""


class CacheKeyMismatch(ArchiveRefused):
    """The archive was packed under another compile-cache key: its artifacts are not valid here."""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Caps on one archive (bytes on the wire, bytes unpacked, members)."""

    max_archive_bytes: int = 1 << 30
    max_unpacked_bytes: int = 1 << 30
    max_members: int = 100_000

    def __post_init__(self) -> None:
        if min(self.max_archive_bytes, self.max_unpacked_bytes, self.max_members) < 1:
            raise ValueError("compile cache limits must be >= 1")


@dataclass(frozen=True, kw_only=True)
class PackedCache:
    """An archive as packed: its bytes, their digest, and how many files and file bytes it holds."""

    data: bytes
    digest: str
    files: int
    file_bytes: int


def archive_digest(data: bytes) -> str:
    """`sha256:<hex>` of an archive's bytes."""
    return _DIGEST_PREFIX + hashlib.sha256(data).hexdigest()


def pack(root: Path, *, key: str, limits: Limits = Limits()) -> PackedCache:
    """Archive the regular files under `root` (symlinks and special files are skipped, with a log line).

    Raises CompileCacheError when `root` is not a directory or the archive would exceed the limits.
    """
    if not root.is_dir():
        raise CompileCacheError(f"compile cache {root}: not a directory")
    buf = io.BytesIO()
    files = total = 0
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _add_bytes(tar, META_NAME, json.dumps({"key": key}).encode(), mode=0o644)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath, name)
                st = path.lstat()
                if not stat.S_ISREG(st.st_mode):
                    log.info("compile cache: skipping %s (not a regular file)", path)
                    continue
                files += 1
                total += st.st_size
                if files > limits.max_members or total > limits.max_unpacked_bytes:
                    raise CompileCacheError(f"compile cache {root}: over the limits {limits}")
                info = tarfile.TarInfo(path.relative_to(root).as_posix())
                info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), st.st_mode & 0o755
                with path.open("rb") as f:
                    tar.addfile(info, f)
    data = buf.getvalue()
    if len(data) > limits.max_archive_bytes:
        raise CompileCacheError(f"compile cache {root}: archive of {len(data)} bytes over the limit")
    return PackedCache(data=data, digest=archive_digest(data), files=files, file_bytes=total)


def unpack(data: bytes, dest: Path, *, key: str, digest: str, limits: Limits = Limits()) -> int:
    """Verify `data` and install its files under `dest`; returns how many files were new there.

    Raises ArchiveRefused (CacheKeyMismatch for another key) with `dest` untouched.
    """
    if len(data) > limits.max_archive_bytes:
        raise ArchiveRefused(f"archive of {len(data)} bytes; limit {limits.max_archive_bytes}")
    if archive_digest(data) != digest:
        raise ArchiveRefused(f"archive digest {archive_digest(data)} does not match {digest!r}")
    dest.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.rfork-", dir=dest.parent))
    try:
        names = _extract(data, staging, key=key, limits=limits)
        return _merge(staging, dest, names)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _extract(data: bytes, staging: Path, *, key: str, limits: Limits) -> list[str]:
    """Write every file of the archive under `staging` (fresh and private); the relative file names."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            return _extract_members(tar, staging, key=key, limits=limits)
    except ArchiveRefused:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError, UnicodeError) as exc:  # malformed peer data
        raise ArchiveRefused(f"archive is not a readable tar: {exc}") from exc


def _extract_members(tar: tarfile.TarFile, staging: Path, *, key: str, limits: Limits) -> list[str]:
    first = tar.next()
    if first is None or first.name != META_NAME or not first.isreg() or first.size > _META_MAX:
        raise ArchiveRefused(f"archive does not start with its key member {META_NAME}")
    _check_key(_read(tar, first), key)
    names: list[str] = []
    count, total = 1, 0
    while (member := tar.next()) is not None:
        count += 1
        if count > limits.max_members:
            raise ArchiveRefused(f"archive has more than {limits.max_members} members")
        rel = _safe_name(member.name)
        if member.isdir():
            (staging / rel).mkdir(parents=True, exist_ok=True)
            continue
        if not member.isreg():
            raise ArchiveRefused(f"archive member {member.name!r}: not a regular file or directory")
        total += member.size
        if total > limits.max_unpacked_bytes:
            raise ArchiveRefused(f"archive unpacks to more than {limits.max_unpacked_bytes} bytes")
        if rel in names:
            raise ArchiveRefused(f"archive member {member.name!r} appears twice")
        _write_new(staging / rel, _read(tar, member), member.mode & 0o755, member.mtime)
        names.append(rel)
    return names


def _check_key(raw: bytes, key: str) -> None:
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeError) as exc:
        raise ArchiveRefused(f"archive key member is not JSON: {exc}") from exc
    got = meta.get("key") if isinstance(meta, dict) else None
    if got != key:
        raise CacheKeyMismatch(f"archive was packed for compile cache key {got!r}, not {key!r}")


def _safe_name(name: str) -> str:
    """The member's path if it is relative and normalised ("a/b"), else ArchiveRefused."""
    path = PurePosixPath(name)
    bad = (
        not name
        or "\0" in name
        or "\\" in name
        or path.is_absolute()
        or any(part in ("..", ".", "") for part in name.rstrip("/").split("/"))
        or path.as_posix() == META_NAME
    )
    if bad:
        raise ArchiveRefused(f"archive member {name!r}: unsafe path")
    return path.as_posix()


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    f = tar.extractfile(member)
    if f is None:
        raise ArchiveRefused(f"archive member {member.name!r} has no data")
    data = f.read()
    if len(data) != member.size:
        raise ArchiveRefused(f"archive member {member.name!r} is truncated")
    return data


def _write_new(path: Path, data: bytes, mode: int, mtime: float) -> None:
    """Create `path` (it must not exist; no link is followed) and its parents, inside the staging tree,
    with the packed mtime (a kernel newer than the start of the engine was built by it, not installed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode | 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.utime(path, (mtime, mtime))


def _merge(staging: Path, dest: Path, names: list[str]) -> int:
    """Move the staged files into `dest`, keeping any file the local cache already has."""
    added = 0
    for rel in names:
        target = dest / rel
        if os.path.lexists(target):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / rel, target)
        added += 1
    return added


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, *, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))
