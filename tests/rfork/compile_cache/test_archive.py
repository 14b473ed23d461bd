"""Packing and unpacking compile caches: a round trip, and every kind of unsafe peer archive refused."""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rfork.compile_cache.archive import (
    META_NAME,
    ArchiveRefused,
    CacheKeyMismatch,
    CompileCacheError,
    Limits,
    archive_digest,
    pack,
    unpack,
)

KEY = "k" * 64


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _cache(root: Path) -> Path:
    (root / "abc123" / "rank_0_0" / "backbone").mkdir(parents=True)
    (root / "abc123" / "rank_0_0" / "backbone" / "computation_graph.py").write_text("def f(): pass\n")
    so = root / "abc123" / "rank_0_0" / "inductor_cache" / "xy" / "kernel.so"
    so.parent.mkdir(parents=True)
    so.write_bytes(os.urandom(3000))
    so.chmod(0o4755)  # setuid must not survive
    return root


def _tar(members: list[tuple[tarfile.TarInfo, bytes]], *, key: str | None = KEY) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if key is not None:
            meta = f'{{"key": "{key}"}}'.encode()
            info = tarfile.TarInfo(META_NAME)
            info.size = len(meta)
            tar.addfile(info, io.BytesIO(meta))
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"x", link: str = "") -> tuple[
    tarfile.TarInfo, bytes
]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.linkname = link
    return info, data


def test_round_trip_installs_the_same_files_with_safe_modes(tmp_path: Path) -> None:
    src = _cache(tmp_path / "src")
    packed = pack(src, key=KEY)
    assert packed.files == 2
    assert packed.digest == archive_digest(packed.data)
    dest = tmp_path / "dest"
    assert unpack(packed.data, dest, key=KEY, digest=packed.digest) == 2
    assert _tree(dest) == _tree(src)
    so = dest / "abc123" / "rank_0_0" / "inductor_cache" / "xy" / "kernel.so"
    assert so.stat().st_mode & 0o7777 == 0o755
    assert int(so.stat().st_mtime) == int((src / so.relative_to(dest)).stat().st_mtime)
    assert not any(p.name.startswith(".dest.rfork-") for p in tmp_path.iterdir())  # staging removed


def test_files_the_local_cache_holds_are_kept(tmp_path: Path) -> None:
    packed = pack(_cache(tmp_path / "src"), key=KEY)
    dest = tmp_path / "dest"
    mine = dest / "abc123" / "rank_0_0" / "backbone" / "computation_graph.py"
    mine.parent.mkdir(parents=True)
    mine.write_text("local\n")
    assert unpack(packed.data, dest, key=KEY, digest=packed.digest) == 1
    assert mine.read_text() == "local\n"


def test_pack_skips_links_and_enforces_limits(tmp_path: Path) -> None:
    src = _cache(tmp_path / "src")
    (src / "outside").symlink_to("/etc/passwd")
    assert "outside" not in _tree_of_archive(pack(src, key=KEY).data)
    with pytest.raises(CompileCacheError, match="limits"):
        pack(src, key=KEY, limits=Limits(max_unpacked_bytes=100))
    with pytest.raises(CompileCacheError, match="not a directory"):
        pack(tmp_path / "missing", key=KEY)


def _tree_of_archive(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return tar.getnames()


def test_a_tampered_archive_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    packed = pack(_cache(tmp_path / "src"), key=KEY)
    data = bytearray(packed.data)
    data[len(data) // 2] ^= 1
    dest = tmp_path / "dest"
    with pytest.raises(ArchiveRefused, match="digest"):
        unpack(bytes(data), dest, key=KEY, digest=packed.digest)
    assert _tree(dest) == {} if dest.exists() else True


def test_another_key_is_not_installed(tmp_path: Path) -> None:
    packed = pack(_cache(tmp_path / "src"), key="other")
    dest = tmp_path / "dest"
    with pytest.raises(CacheKeyMismatch, match="other"):
        unpack(packed.data, dest, key=KEY, digest=packed.digest)
    assert _tree(dest) == {}


def test_oversized_archives_are_refused(tmp_path: Path) -> None:
    packed = pack(_cache(tmp_path / "src"), key=KEY)
    dest = tmp_path / "dest"
    with pytest.raises(ArchiveRefused, match="limit"):
        unpack(packed.data, dest, key=KEY, digest=packed.digest, limits=Limits(max_archive_bytes=1000))
    with pytest.raises(ArchiveRefused, match="unpacks to more"):
        unpack(packed.data, dest, key=KEY, digest=packed.digest, limits=Limits(max_unpacked_bytes=2000))
    with pytest.raises(ArchiveRefused, match="members"):
        unpack(packed.data, dest, key=KEY, digest=packed.digest, limits=Limits(max_members=2))
    assert _tree(dest) == {}


UNSAFE = [
    _member("/etc/evil"),
    _member("../evil"),
    _member("a/../../evil"),
    _member("a/./b"),
    _member("a//b"),
    _member("a\\..\\evil"),
    _member("link", tarfile.SYMTYPE, link="/etc/passwd"),
    _member("link", tarfile.SYMTYPE, link="inside"),
    _member("hard", tarfile.LNKTYPE, link="a"),
    _member("dev", tarfile.CHRTYPE),
    _member("fifo", tarfile.FIFOTYPE),
    _member(META_NAME),
]


@pytest.mark.parametrize("bad", UNSAFE, ids=lambda m: f"{m[0].name}:{m[0].type!r}")
def test_unsafe_members_refuse_the_whole_archive(tmp_path: Path, bad: tuple[tarfile.TarInfo, bytes]) -> None:
    data = _tar([_member("fine/first.py"), bad, _member("fine/last.py")])
    dest = tmp_path / "root" / "dest"
    with pytest.raises(ArchiveRefused):
        unpack(data, dest, key=KEY, digest=archive_digest(data))
    assert _tree(tmp_path) == {}  # nothing written, inside dest or beside it


def test_the_key_member_must_come_first(tmp_path: Path) -> None:
    data = _tar([_member("a.py")], key=None)
    with pytest.raises(ArchiveRefused, match="key member"):
        unpack(data, tmp_path / "d", key=KEY, digest=archive_digest(data))


NAMES = st.text(alphabet=st.sampled_from(list("ab./\\\0")), min_size=0, max_size=12)
KINDS = st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(members=st.lists(st.tuples(NAMES, KINDS, st.binary(max_size=64)), max_size=6))
def test_any_archive_installs_only_regular_files_inside_dest(
    tmp_path_factory: pytest.TempPathFactory, members: list[tuple[str, bytes, bytes]]
) -> None:
    base = tmp_path_factory.mktemp("prop")
    dest = base / "root" / "dest"
    try:
        data = _tar([_member(n, k, d, link="a") for n, k, d in members])
    except (ValueError, tarfile.TarError):
        return  # tarfile itself cannot write such a member
    try:
        unpack(data, dest, key=KEY, digest=archive_digest(data))
    except ArchiveRefused:
        assert _tree(base) == {}
        return
    for p in base.rglob("*"):
        assert p == dest.parent or p.resolve().is_relative_to(dest.resolve())
        assert p.is_dir() or (p.is_file() and not p.is_symlink())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=4096), cut=st.integers(min_value=0, max_value=4096))
def test_arbitrary_or_truncated_bytes_are_refused_cleanly(
    tmp_path_factory: pytest.TempPathFactory, data: bytes, cut: int
) -> None:
    base = tmp_path_factory.mktemp("bytes")
    good = _tar([_member("a/b.py", data=data[:100])])
    for blob in (data, good[:cut], good[:512] + data):
        with contextlib.suppress(ArchiveRefused):
            unpack(blob, base / "dest", key=KEY, digest=archive_digest(blob))
    for p in base.rglob("*"):
        assert p.resolve().is_relative_to((base / "dest").resolve())
