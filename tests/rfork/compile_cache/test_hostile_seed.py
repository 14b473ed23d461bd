"""A seed registered with a register token plants an archive in a loader's compile cache: it never lands.

A real planner process (`rfork planner serve`, auth on); the hostile seed is a raw socket server in this
process, registered with the register token, answering whatever the test says (a planted archive with
its own digest header, arbitrary bytes and headers, a byte at a time); the loader is
rfork.compile_cache.fetch as the vLLM hook calls it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import migrate
from planner.contract import Conflict, PlannerClient, control_token
from planner.contract.wire import identity_key as wire_identity_key
from rfork.compile_cache.archive import Limits, PackedCache, pack
from rfork.compile_cache.fetch import FetchOutcome, fetch_compile_cache
from rfork.compile_cache.key import CompileCacheKey
from tests.planner.conftest import identity, manifest, ranks
from tests.planner.test_concurrency import free_port
from tests.waiting import wait_until

ADMIN, REGISTER, ANCHOR, LOAD = "hs-admin", "hs-register", "hs-anchor", "hs-load"
IDENT = identity()
NEAR = "loader-node"  # the loader's node: the hostile seed claims it, to be tried first

Respond = Callable[[socket.socket], None]


@dataclass
class RawSeed:
    """Test double for a seed's control endpoint: a socket server that answers with `respond`."""

    respond: Respond
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0

    def __post_init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(30)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            self.requests.append(head)
            self.respond(conn)

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def answer(status: int, headers: dict[str, str], body: bytes) -> Respond:
    def respond(conn: socket.socket) -> None:
        lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in headers.items()]
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)

    return respond


def archive_answer(packed: PackedCache) -> Respond:
    """What a seed sends: the tar, with the digest it claims in its own header."""
    return answer(
        200,
        {"Content-Length": str(len(packed.data)), "X-Rfork-Archive-Digest": packed.digest},
        packed.data,
    )


def drip(prefix: bytes, *, every_s: float = 0.2, total_s: float = 30.0) -> Respond:
    """Send `prefix`, then one byte every `every_s` for up to `total_s`: each read is quick, the whole
    request never ends."""

    def respond(conn: socket.socket) -> None:
        conn.sendall(prefix)
        end = time.monotonic() + total_s
        while time.monotonic() < end:
            conn.sendall(b"x")
            time.sleep(every_s)

    return respond


def cache_dir(root: Path, source: str) -> Path:
    """A compile-cache entry with one generated module (what inductor writes and vLLM imports)."""
    graph = root / "rank_0_0" / "backbone" / "computation_graph.py"
    graph.parent.mkdir(parents=True)
    graph.write_text(source)
    old = time.time() - 60
    os.utime(graph, (old, old))
    return root


@pytest.fixture(scope="module")
def planner_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`rfork planner serve` in its own process, auth on."""
    url = f"sqlite:///{tmp_path_factory.mktemp('hostile') / 'planner.db'}"
    migrate(url)
    port = free_port()
    env = {
        **os.environ,
        "RFORK_ADMIN_TOKEN": ADMIN,
        "RFORK_REGISTER_TOKEN": REGISTER,
        "RFORK_ANCHOR_TOKEN": ANCHOR,
        "RFORK_LOAD_TOKEN": LOAD,
        "RFORK_REAPER_INTERVAL_S": "3600",
    }
    log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "rfork", "planner", "serve", "--db", url, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=log,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, "planner exited"
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(base + "/healthz", timeout=1).status_code == 200
        return False

    try:
        wait_until(healthy, 60, "the planner answers /healthz", every_s=0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def register_seed(planner: str, token: str, url: str, key: str, *, node: str, manifests: bool = True) -> str:
    """A READY instance of IDENT serving compile cache `key` at `url` (its rank-0 manifest from disk)."""
    c = PlannerClient(planner, token=token)
    reg = c.register_instance(
        identity=IDENT, labels={"node": node}, ranks=ranks(0), control_url=url,
        control_key=control_token.new_control_key(), compile_cache_keys=[key],
    )
    own = c.with_token(reg.token)
    if manifests:
        own.put_manifest(reg.id, 0, manifest(0))  # a register token may copy the anchored manifest
    own.set_status(reg.id, "READY")
    return str(reg.id)


@dataclass
class Fleet:
    """An honest seed far away and a hostile one on the loader's node, both serving `key`."""

    planner: str
    cache: CompileCacheKey
    honest: PackedCache
    planted: PackedCache
    honest_seed: RawSeed
    hostile: RawSeed
    honest_id: str = ""
    hostile_id: str = ""

    @property
    def key(self) -> str:
        return self.cache.digest()

    def anchor(self) -> None:
        """The honest seed (anchor role) anchors the weights; an admin anchors the honest archive."""
        self.honest_id = register_seed(self.planner, ANCHOR, self.honest_seed.url, self.key, node="far")
        self.hostile_id = register_seed(self.planner, REGISTER, self.hostile.url, self.key, node=NEAR)
        admin = PlannerClient(self.planner, token=ADMIN)
        admin.anchor_compile_cache(
            self.key, self.honest.digest,
            key_variant=self.cache.variant(), identity_key=self.cache.identity_key,
        )

    def fetch(self, dest: Path, timeout_s: float = 10.0, limits: Limits = Limits()) -> FetchOutcome:
        return fetch_compile_cache(
            planner_url=self.planner, token=LOAD, key=self.cache, dest=dest, labels={"node": NEAR},
            timeout_s=timeout_s, limits=limits,
        )


@pytest.fixture
def fleet(planner_proc: str, tmp_path: Path) -> Iterator[Fleet]:
    cache = CompileCacheKey(  # one key per test: the planner process is shared
        identity_key=wire_identity_key(IDENT), rank=0, engine="vllm", engine_version="0.32.0",
        torch_version="2.13.0+cpu", settings_digest=os.urandom(32).hex(), processor="x86_64:0",
    )
    key = cache.digest()
    honest = pack(cache_dir(tmp_path / "honest", HONEST_SOURCE), key=key)
    planted = pack(cache_dir(tmp_path / "planted", "import os; os.system('touch /tmp/x')\n"), key=key)
    honest_seed, hostile = RawSeed(archive_answer(honest)), RawSeed(archive_answer(planted))
    f = Fleet(planner_proc, cache, honest, planted, honest_seed, hostile)
    yield f
    f.honest_seed.close()
    f.hostile.close()


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


HONEST_SOURCE = "def forward(x): return x\n"
HONEST_FILES = {"rank_0_0/backbone/computation_graph.py": HONEST_SOURCE.encode()}


def test_a_planted_archive_never_lands(
    fleet: Fleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a register token alone: declares the key and its own control_url, READY, on the loader's node
    lone = register_seed(fleet.planner, REGISTER, fleet.hostile.url, fleet.key, node=NEAR, manifests=False)
    with caplog.at_level(logging.INFO, logger="rfork.compile_cache.fetch"):
        out = fleet.fetch(tmp_path / "a")
    assert not out.installed  # no authority anchored the key: nothing fetched, and the log says why
    assert "no anchored archive digest" in (out.reason or "")
    assert any("no anchored archive digest" in r.getMessage() for r in caplog.records)
    assert fleet.hostile.connections == 0
    assert not (tmp_path / "a").exists()
    fleet.anchor()
    found = PlannerClient(fleet.planner, token=LOAD).compile_cache_sources(
        fleet.key, identity_key=fleet.cache.identity_key, labels={"node": NEAR}
    )
    assert found is not None
    assert found.archive_digest == fleet.honest.digest
    assert lone not in [s.instance_id for s in found.sources]  # no anchored manifest: never offered
    assert [s.instance_id for s in found.sources] == [fleet.hostile_id, fleet.honest_id]  # nearest first
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rfork.compile_cache.fetch"):
        out = fleet.fetch(tmp_path / "b")
    assert (out.installed, out.source) == (True, fleet.honest_id), out.reason
    assert files(tmp_path / "b") == HONEST_FILES  # the planted archive was downloaded and refused
    assert len(fleet.hostile.requests) == 1
    assert any(
        fleet.hostile_id in r.getMessage() and "does not match" in r.getMessage() for r in caplog.records
    )


def test_an_anchor_seed_of_a_made_up_identity_cannot_anchor_the_victims_key(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A seed with the anchor role registers under a made-up identity, lists the victim identity's key
    (computed ahead of time) and anchors it with its planted archive; the victim's loader would install
    it. The key is bound to its identity: the anchor is refused and nothing is fetched."""
    c = PlannerClient(fleet.planner, token=ANCHOR)
    reg = c.register_instance(
        identity=identity(fingerprint="made-up"), labels={"node": NEAR}, ranks=ranks(0),
        control_url=fleet.hostile.url, control_key=control_token.new_control_key(),
        compile_cache_keys=[fleet.key],
    )
    own = c.with_token(reg.token)
    own.put_manifest(reg.id, 0, manifest(0))  # anchors the made-up identity's weights
    own.set_status(reg.id, "READY")
    with pytest.raises(Conflict, match="not a key of identity"):
        own.anchor_compile_cache(fleet.key, fleet.planted.digest, key_variant=fleet.cache.variant())
    out = fleet.fetch(tmp_path / "a")
    assert not out.installed
    assert "no anchored archive digest" in (out.reason or "")
    assert fleet.hostile.connections == 0
    assert not (tmp_path / "a").exists()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    status=st.sampled_from([200, 200, 200, 206, 302, 404, 500]),
    headers=st.dictionaries(
        st.sampled_from(["X-Rfork-Archive-Digest", "Content-Length", "Transfer-Encoding", "X-A"]),
        st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=80),
        max_size=4,
    ),
    body=st.one_of(st.binary(max_size=4096), st.sampled_from([b"", b"\x1f\x8b", b"ustar" * 200])),
    planted=st.sampled_from(["no", "with its own digest header", "under any headers"]),
)
def test_whatever_a_hostile_seed_answers_only_the_anchored_archive_lands(
    fleet: Fleet, status: int, headers: dict[str, str], body: bytes, planted: str
) -> None:
    if not fleet.hostile_id:
        fleet.anchor()
    if planted != "no":
        body = fleet.planted.data
    if planted == "with its own digest header":
        headers = {**headers, "X-Rfork-Archive-Digest": fleet.planted.digest}
    fleet.hostile.respond = answer(status, {**headers, "Connection": "close"}, body)
    with tempfile.TemporaryDirectory() as tmp:
        out = fleet.fetch(Path(tmp) / "dest", timeout_s=3.0)
        assert out.installed, out.reason  # from the honest seed, after the hostile one
        assert files(Path(tmp) / "dest") == HONEST_FILES


@pytest.mark.parametrize(
    "prefix",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n",  # the body, a byte at a time
        b"HTTP/1.1 200 OK\r\n",  # the headers, a byte at a time
    ],
    ids=["body", "headers"],
)
def test_a_dripping_seed_fails_within_the_deadline(fleet: Fleet, tmp_path: Path, prefix: bytes) -> None:
    fleet.anchor()
    fleet.hostile.respond = drip(prefix)
    fleet.honest_seed.respond = answer(404, {"Content-Length": "2"}, b"{}")  # only the dripping one is left
    t0 = time.monotonic()
    out = fleet.fetch(tmp_path / "d", timeout_s=2.0)
    elapsed = time.monotonic() - t0
    assert not out.installed
    assert "deadline" in (out.reason or "")
    # each read comes quickly; the whole never ends (main held the loader for as long as the seed dripped)
    assert elapsed < 6.0, f"held {elapsed:.1f} s at timeout_s=2"


@pytest.mark.parametrize(
    "head",
    [b"HTTP/1.1 200 OK\r\nContent-Length: 2000000\r\n\r\n", b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"],
    ids=["declared", "undeclared"],
)
def test_an_oversized_answer_is_cut_at_the_cap(fleet: Fleet, tmp_path: Path, head: bytes) -> None:
    fleet.anchor()
    fleet.hostile.respond = lambda conn: conn.sendall(head + b"x" * 2_000_000)
    fleet.honest_seed.respond = answer(404, {"Content-Length": "2"}, b"{}")
    out = fleet.fetch(tmp_path / "o", limits=Limits(max_archive_bytes=1 << 20))
    assert not out.installed
    assert "exceeds the cap of 1048576" in (out.reason or "")


def test_seed_endpoints_outside_rfork_seed_networks_are_never_connected(
    fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet.anchor()
    monkeypatch.setenv("RFORK_SEED_NETWORKS", "10.0.0.0/8, fd00::/8")
    out = fleet.fetch(tmp_path / "n")
    assert not out.installed
    assert "outside RFORK_SEED_NETWORKS" in (out.reason or "")
    assert (fleet.hostile.connections, fleet.honest_seed.connections) == (0, 0)
    monkeypatch.setenv("RFORK_SEED_NETWORKS", "127.0.0.0/8")
    assert fleet.fetch(tmp_path / "m").installed


def _decoys(fleet: Fleet, n: int) -> list[str]:
    """`n` instances registered with the register token that copy the anchored manifest, list the key and
    sit on the loader's node (each sorts before the honest seed by label), all answered by `fleet.hostile`."""
    return [register_seed(fleet.planner, REGISTER, fleet.hostile.url, fleet.key, node=NEAR) for _ in range(n)]


def test_decoys_are_reported_and_replaced_and_the_seed_that_served_comes_first(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Eight decoys (and the hostile seed) on the loader's node, the honest seed far away. On main the
    loader was offered the eight nearest, all decoys, and never reached the honest archive. Now failed
    sources are reported and replaced, and a source that served the key verified before comes first."""
    fleet.anchor()
    decoys = {fleet.hostile_id, *_decoys(fleet, 8)}
    out = fleet.fetch(tmp_path / "a", timeout_s=10.0)
    assert (out.installed, out.source) == (True, fleet.honest_id), out.reason
    tried = fleet.hostile.connections
    assert tried == len(decoys)  # each decoy once: reported, then replaced by the planner
    found = PlannerClient(fleet.planner, token=LOAD).compile_cache_sources(
        fleet.key, identity_key=fleet.cache.identity_key, labels={"node": NEAR}
    )
    assert found is not None
    assert found.sources[0].instance_id == fleet.honest_id  # served and verified before: first
    out = fleet.fetch(tmp_path / "b", timeout_s=10.0)
    assert (out.installed, out.source) == (True, fleet.honest_id), out.reason
    assert fleet.hostile.connections == tried  # no decoy tried again
    assert files(tmp_path / "b") == HONEST_FILES


@pytest.mark.slow  # waits out the 2 s deadline
def test_stalling_decoys_cost_a_loader_one_timeout_in_all(fleet: Fleet, tmp_path: Path) -> None:
    """Decoys that accept the fetch and never answer: on main each cost the loader its whole timeout
    (8 x timeout_s before a vLLM worker compiled). Now `timeout_s` bounds the whole fetch."""
    fleet.anchor()
    fleet.hostile.respond = drip(b"HTTP/1.1 200 OK\r\n", total_s=30.0)
    _decoys(fleet, 8)
    t0 = time.monotonic()
    out = fleet.fetch(tmp_path / "s", timeout_s=2.0)
    elapsed = time.monotonic() - t0
    assert not out.installed  # the deadline came first: vLLM compiles
    assert "deadline" in (out.reason or "")
    assert elapsed < 5.0, f"held {elapsed:.1f} s at timeout_s=2"
