"""A seed serves its compile cache on its control endpoint; a new instance fetches it through the planner.

Real planner (auth on), real seed (tcp engine, control endpoint), real HTTP; only the compile-cache
directory is hand-written instead of an engine's.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import httpx
import pytest
import torch

from planner.contract import NotFound, PlannerClient
from rfork import SourceIdentity
from rfork.compile_cache.archive import PackedCache, pack
from rfork.compile_cache.fetch import FetchOutcome, fetch_compile_cache
from rfork.compile_cache.key import CompileCacheKey
from rfork.compile_cache.shelf import CacheShelf
from rfork.identity import fingerprint
from rfork.seed.seed import Seed
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import ADMIN, LOAD, REGISTER
from tests.waiting import wait_until

TENSORS = {"w": torch.arange(64, dtype=torch.float32)}
IDENT = SourceIdentity(
    model="compile-cache-test",
    revision="r1",
    dtype="float32",
    fingerprint=fingerprint((n, str(t.dtype), t.shape) for n, t in TENSORS.items()),
)
CACHE = CompileCacheKey(
    identity_key=IDENT.key(), rank=0, engine="vllm", engine_version="0.32.0", torch_version="2.13.0+cpu",
    settings_digest="5" * 64, processor="x86_64:0123456789abcdef",
)
OTHER_CACHE = dataclasses.replace(CACHE, rank=1)
KEY, OTHER = CACHE.digest(), OTHER_CACHE.digest()


def _compiled(root: Path, *, age_s: float = 60.0) -> Path:
    graph = root / "torch_compile_cache" / "0123456789" / "rank_0_0" / "backbone" / "computation_graph.py"
    graph.parent.mkdir(parents=True)
    graph.write_text("def forward(x): return x\n")
    so = root / "torch_compile_cache" / "torch_aot_compile" / "ab" / "inductor_cache" / "k.so"
    so.parent.mkdir(parents=True)
    so.write_bytes(os.urandom(5000))
    old = time.time() - age_s
    for p in (graph, so):
        os.utime(p, (old, old))
    return root / "torch_compile_cache"


def _seed(planner: str, shelf: CacheShelf) -> Seed:
    weights = RankWeights.from_tensors(rank=0, tensors=TENSORS)
    return Seed(
        weights=[weights], identity=IDENT, planner_url=planner, providers=["tcp"], token=REGISTER,
        compile_caches=shelf,
    )


def _wait_anchored(planner: str, key: str = KEY) -> None:
    """Until the seed's heartbeat has anchored `key` (it packs the settled cache and publishes the digest)."""
    client = PlannerClient(planner, token=LOAD)

    def anchored() -> bool:
        try:
            return client.compile_cache_sources(key, identity_key=IDENT.key()) is not None
        except NotFound:
            return False

    wait_until(anchored, 30, f"compile cache {key[:12]} anchored", every_s=0.2)


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_new_instance_fetches_verifies_and_installs_the_seeds_cache(planner: str, tmp_path: Path) -> None:
    src = _compiled(tmp_path / "seed")
    with _seed(planner, CacheShelf({CACHE: src})) as seed:
        (iid,) = seed.instance_ids
        assert PlannerClient(planner, token=LOAD).get_instance(iid).compile_cache_keys == [KEY]
        _wait_anchored(planner)  # an anchor-role seed: the first authority for its own compile
        dest = tmp_path / "new" / "torch_compile_cache"
        out = fetch_compile_cache(planner_url=planner, token=LOAD, key=CACHE, dest=dest)
        assert out.installed, out.reason
        assert (out.source, out.files) == (iid, 2)
        assert _files(dest) == _files(src)
        # another key: no seed serves it, nothing installed
        other = fetch_compile_cache(planner_url=planner, token=LOAD, key=OTHER_CACHE, dest=tmp_path / "o")
        assert not other.installed
        assert "no anchored archive digest" in (other.reason or "")
        assert not (tmp_path / "o").exists()


def test_the_endpoint_wants_a_compile_cache_token_and_a_settled_cache(planner: str, tmp_path: Path) -> None:
    src = _compiled(tmp_path / "seed")
    shelf = CacheShelf({CACHE: src}, settle_s=3600.0)  # everything counts as "still being written"
    with _seed(planner, shelf) as seed:
        assert seed.control_server is not None
        url = f"{seed.control_server.url}/v1/compile-caches/{KEY}"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer v1.x.y.0.1.z"}).status_code == 403
        # never settled, so the seed anchors nothing: an admin uploads the digest
        identity_key = PlannerClient(planner, token=LOAD).get_instance(seed.instance_ids[0]).identity_key
        digest = pack(src, key=KEY).digest
        PlannerClient(planner, token=ADMIN).anchor_compile_cache(
            KEY, digest, key_variant=CACHE.variant(), identity_key=identity_key
        )

        def grant() -> dict[str, str]:
            found = PlannerClient(planner, token=LOAD).compile_cache_sources(KEY, identity_key=IDENT.key())
            assert found is not None
            assert found.archive_digest == digest
            return {"Authorization": f"Bearer {found.sources[0].control_token}"}

        auth = grant()
        busy = httpx.get(url, headers=auth)
        assert (busy.status_code, busy.json()["reason"]) == (409, "not_ready")
        again = httpx.get(url, headers=auth)  # not spent by a fetch that got nothing (main: 403 here)
        assert (again.status_code, again.json()["reason"]) == (409, "not_ready")
        other = httpx.get(url.replace(KEY, OTHER), headers=grant())  # a grant names its key
        assert (other.status_code, "not a grant for" in other.json()["error"]) == (403, True)
        assert httpx.get(url[:-1] + "/", headers=grant()).status_code == 404  # not 64 hex
        # a compile-cache grant opens no weight session
        auth = grant()
        session = httpx.post(f"{seed.control_server.url}/v1/nccl/sessions", json={"rank": 0}, headers=auth)
        assert session.status_code == 403
        assert "compile-cache grant" in session.json()["error"]
        shelf.settle_s = 0.0
        ok = httpx.get(url, headers=auth)
        assert ok.status_code == 200
        assert ok.headers["x-rfork-archive-digest"] == digest
        assert ok.headers["content-type"] == "application/x-tar"
        spent = httpx.get(url, headers=auth)  # one archive per grant
        assert (spent.status_code, "already used" in spent.json()["error"]) == (403, True)


class TamperingShelf(CacheShelf):
    """Test double for a seed whose archive is changed on the way (one byte flipped, digest kept)."""

    def archive(self, key: str) -> PackedCache:
        good = super().archive(key)
        data = bytearray(good.data)
        data[-2048] ^= 0xFF
        return PackedCache(data=bytes(data), digest=good.digest, files=good.files, file_bytes=good.file_bytes)


class ForeignKeyShelf(CacheShelf):
    """Test double for a seed that serves, under the asked key, an archive packed for another key."""

    def archive(self, key: str) -> PackedCache:
        return pack(self.dirs[key], key=OTHER)


@pytest.mark.parametrize(("shelf_type", "why"), [(TamperingShelf, "digest"), (ForeignKeyShelf, "packed for")])
def test_tampered_or_foreign_archives_are_not_installed(
    planner: str, tmp_path: Path, shelf_type: type[CacheShelf], why: str
) -> None:
    with _seed(planner, shelf_type({CACHE: _compiled(tmp_path / "seed")})):
        _wait_anchored(planner)  # the seed anchors what it packs; it serves other bytes
        dest = tmp_path / "new" / "torch_compile_cache"
        out = fetch_compile_cache(planner_url=planner, token=LOAD, key=CACHE, dest=dest)
        assert not out.installed
        assert why in (out.reason or "")
        assert _files(tmp_path / "new") == {}


@pytest.mark.slow  # waits out the seed's next anchoring round (about 12 s): the fast suite has 6 minutes
def test_a_cache_that_grows_after_it_was_anchored_is_anchored_again(planner: str, tmp_path: Path) -> None:
    # CI's vLLM run: the cache settled mid-compile, was anchored, then grew; the seed kept serving the
    # grown archive under the old anchor, which every loader refused
    src = _compiled(tmp_path / "seed")
    with _seed(planner, CacheShelf({CACHE: src})):
        _wait_anchored(planner)
        extra = src / "torch_aot_compile" / "cd" / "inductor_cache" / "k2.so"
        extra.parent.mkdir(parents=True)
        extra.write_bytes(os.urandom(3000))
        old = time.time() - 60
        os.utime(extra, (old, old))  # written long enough ago: settled
        dest = tmp_path / "new" / "torch_compile_cache"
        outcomes: list[FetchOutcome] = []

        def installed() -> bool:
            outcomes.append(fetch_compile_cache(planner_url=planner, token=LOAD, key=CACHE, dest=dest))
            return outcomes[-1].installed

        wait_until(installed, 30, lambda: f"the grown cache installed ({outcomes[-1].reason})", every_s=0.3)
        assert _files(dest) == _files(src)
