"""The fault matrix (docs/reliability.md): each fault is injected in the middle of a pull, with auth on.

For every row the loader ends with verified weights from another source or from disk, or with a clear
error, within a bounded time; nothing half-written is marked READY; and the planner stays consistent:
no live lease is left behind and the instance counts are right.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.processes import free_port, load_args
from planner import PlannerServer
from planner.contract import Conflict, PlannerClient
from rfork import Loader, LoadOptions, LoadResult
from rfork.seed.seed import Seed
from rfork.weights.checkpoint import load_rank_from_disk, load_state_dict, read_checkpoint_info
from rfork.weights.rank_weights import RankWeights
from rfork.weights.synthetic import write_synthetic_checkpoint
from tests.rfork.conftest import ADMIN, LOAD, READER, REGISTER, assert_same, start_seed
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
TOKENS: dict[str, Any] = {
    "admin_token": ADMIN,
    "register_token": REGISTER,
    "anchor_token": REGISTER,  # the tests' seeds load from disk on a trusted host: they anchor
    "load_token": LOAD,
    "reader_token": READER,
}
BOUND_S = 90.0  # every row must end within this (generous: a shared 2-core box)


def opts(**kw) -> LoadOptions:
    base = {
        "providers": ["tcp"],
        "transfer_timeout_s": 2.0,
        "rank_deadline_s": 60.0,
        "chunk_bytes": 1 << 20,
        "max_inflight": 2,
    }
    return LoadOptions(**{**base, **kw})


class FaultOnProgress(Loader):
    """A loader that calls `fault(instance_id)` once, when the first bytes of a pull have arrived."""

    def __init__(self, fault: Callable[[str], None], **kw) -> None:
        super().__init__(progress=self._on_progress, token=LOAD, register_token=REGISTER, **kw)
        self.fault = fault
        self.fired: str | None = None
        self.current: str | None = None

    def _pull(self, source: Any, *args: Any, **kwargs: Any) -> Any:
        self.current = source.instance_id
        return super()._pull(source, *args, **kwargs)

    def _on_progress(self, done: int, total: int) -> None:
        if self.fired is None and 0 < done < total and self.current is not None:
            self.fired = self.current
            self.fault(self.current)


def timed_load(loader: Loader) -> LoadResult:
    t0 = time.monotonic()
    result = loader.load()
    elapsed = time.monotonic() - t0
    assert elapsed < BOUND_S, f"the load took {elapsed:.1f} s"
    return result


def live_leases(url: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("rfork_planner_live_leases "):
            return float(line.split()[1])
    raise AssertionError("no live-lease gauge")


def assert_consistent(url: str, *, ready: int, timeout_s: float = 30.0) -> None:
    """No live lease, every transfer ended with an outcome, `ready` READY instances (eventually)."""
    admin = PlannerClient(url, token=ADMIN)
    seen = ""

    def settled() -> bool:
        nonlocal seen
        leases = live_leases(url)
        n_ready = admin.list_instances(status="READY").total
        outcomes = [t.outcome for t in admin.transfers(limit=1000).items]
        seen = f"planner state: {leases} live leases, {n_ready} READY (want {ready}), outcomes {outcomes}"
        return leases == 0 and n_ready == ready and all(outcomes)

    wait_until(settled, timeout_s, lambda: seen, every_s=0.25)


def _disk_weights(ckpt: Path) -> RankWeights:
    layout, buffers, tensors = load_rank_from_disk(read_checkpoint_info(ckpt))
    return RankWeights(rank=0, layout=layout, buffers=buffers, tensors=tensors)


# ---- 1, 2: the seed dies or stalls mid-pull -------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["seed-SIGKILL", "seed-SIGSTOP"])
def test_seed_killed_or_stalled_mid_pull(fleet, medium_ckpt, planner, sig):
    ids1, s1 = start_seed(fleet, medium_ckpt, planner, name="seed1")
    ids2, s2 = start_seed(fleet, medium_ckpt, planner, name="seed2")
    pids = {ids1[0]: s1.proc.pid, ids2[0]: s2.proc.pid}
    info = read_checkpoint_info(medium_ckpt)
    loader = FaultOnProgress(
        lambda iid: os.kill(pids[iid], sig),
        identity=info.identity(),
        planner_url=planner,
        options=opts(become_seed=False),
    )
    try:
        result = timed_load(loader)
        assert loader.fired is not None
        assert [a.ok for a in result.attempts] == [False, True]
        assert result.attempts[1].instance_id != loader.fired
        assert result.source == "rfork-tcp"
        assert_same(result.state_dict(), load_state_dict(medium_ckpt))
        result.close()
        victim = s1 if loader.fired == ids1[0] else s2
        if sig == signal.SIGSTOP:
            os.kill(victim.proc.pid, signal.SIGCONT)
            victim.proc.kill()
        victim.proc.wait(10)
        admin = PlannerClient(planner, token=ADMIN)
        admin.delete_instance(loader.fired)  # what the reaper's STALE + an operator would do
        assert_consistent(planner, ready=1)
        assert sorted(str(t.outcome) for t in admin.transfers().items) == ["failure", "success"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            for pid in pids.values():
                os.kill(pid, signal.SIGCONT)


# ---- 3: the planner is killed mid-pull and restarted on the same database ---------------------------


def _planner_process(db: str, port: int, workdir: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "RFORK_ADMIN_TOKEN": ADMIN,
        "RFORK_REGISTER_TOKEN": REGISTER,
        "RFORK_ANCHOR_TOKEN": REGISTER,  # the tests' disk seeds anchor their identity
        "RFORK_LOAD_TOKEN": LOAD,
        "RFORK_READER_TOKEN": READER,
        "RFORK_LEASE_TTL_S": "4",
        "RFORK_REAPER_INTERVAL_S": "0.5",
        "RFORK_DB_URL": db,
    }
    log = (workdir / f"planner-{time.monotonic_ns()}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rfork", "planner", "serve", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    def listening() -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
        return False

    try:
        wait_until(listening, 60, "the planner listens")
    except AssertionError:
        proc.kill()
        raise
    return proc


def test_planner_killed_mid_pull_and_restarted_on_the_same_db(medium_ckpt, tmp_path, sqlite_url):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    planner = _planner_process(sqlite_url, port, tmp_path)
    info = read_checkpoint_info(medium_ckpt)
    result = None
    try:
        with Seed(
            weights=[_disk_weights(medium_ckpt)],
            identity=info.identity(),
            planner_url=url,
            control=False,
            token=REGISTER,
        ):
            loader = FaultOnProgress(
                lambda _iid: planner.kill(), identity=info.identity(), planner_url=url, options=opts()
            )
            result = timed_load(loader)  # the data plane does not need the planner
            assert result.source == "rfork-tcp"
            assert result.attempts[0].ok
            assert_same(result.state_dict(), load_state_dict(medium_ckpt))
            assert result.seed is not None
            assert result.seed.instance_ids == []  # could not publish: retrying in the background
            planner.wait(10)
            planner = _planner_process(sqlite_url, port, tmp_path)
            # the loader's seed publishes, the lease the report could not end expires: consistent again
            assert_consistent(url, ready=2, timeout_s=45)
            assert result.seed.instance_ids
    finally:
        if result is not None:
            result.close()
        planner.kill()
        planner.wait(10)


# ---- 4: PostgreSQL restarted mid-pull (a private server: the shared one is never touched) -----------


def _pg_bin(name: str) -> str | None:
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / name).exists():
            return str(d / name)
    return shutil.which(name)


@pytest.fixture
def private_postgres() -> Iterator[tuple[str, Callable[[], None]]]:
    """A throwaway PostgreSQL on its own port: (SQLAlchemy URL, restart())."""
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    root = Path(tempfile.mkdtemp(prefix="rfork-pg-"))
    data, port = root / "data", free_port()
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses to run as root
        import pwd

        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]

    def run(*cmd: str) -> None:
        subprocess.run([*as_user, *cmd], check=True, capture_output=True, timeout=120)

    run(initdb, "-D", str(data), "-A", "trust", "-U", "postgres")
    opts_ = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    run(pg_ctl, "-D", str(data), "-o", opts_, "-l", str(root / "log"), "-w", "start")

    def restart() -> None:
        run(pg_ctl, "-D", str(data), "-o", opts_, "-l", str(root / "log"), "-m", "fast", "-w", "restart")

    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", restart
    finally:
        with contextlib.suppress(Exception):
            run(pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


def test_postgresql_restarted_mid_pull(medium_ckpt, private_postgres):
    pg_url, restart = private_postgres
    info = read_checkpoint_info(medium_ckpt)
    with (
        PlannerServer(db_url=pg_url, reaper_interval_s=0.5, lease_ttl_s=4, **TOKENS) as srv,
        Seed(
            weights=[_disk_weights(medium_ckpt)],
            identity=info.identity(),
            planner_url=srv.url,
            control=False,
            token=REGISTER,
        ),
    ):
        loader = FaultOnProgress(
            lambda _iid: restart(),
            identity=info.identity(),
            planner_url=srv.url,
            options=opts(become_seed=False),
        )
        result = timed_load(loader)
        assert loader.fired is not None
        assert result.source == "rfork-tcp"
        assert_same(result.state_dict(), load_state_dict(medium_ckpt))
        result.close()
        assert_consistent(srv.url, ready=1)
        # and the planner serves normally on the restarted database
        again = Loader(
            identity=info.identity(), planner_url=srv.url, token=LOAD, options=opts(become_seed=False)
        ).load()
        assert again.source == "rfork-tcp"
        again.close()
        assert_consistent(srv.url, ready=1)


# ---- 5: a byte of the seed's memory is corrupted mid-pull -------------------------------------------


def test_corrupted_byte_mid_pull(medium_ckpt, planner):
    info = read_checkpoint_info(medium_ckpt)
    weights = _disk_weights(medium_ckpt)
    last = weights.layout.placements[-1]

    def corrupt(_iid: str) -> None:  # in a region the loader has not read yet
        weights.buffers[last.region][last.offset + last.nbytes - 1] ^= 0x80

    with Seed(
        weights=[weights], identity=info.identity(), planner_url=planner, control=False, token=REGISTER
    ) as seed:
        loader = FaultOnProgress(
            corrupt,
            identity=info.identity(),
            planner_url=planner,
            checkpoint=medium_ckpt,
            options=opts(become_seed=False),
        )
        result = timed_load(loader)
        assert [a.source for a in result.attempts] == ["rfork-tcp", "disk"]
        assert "checksum" in (result.attempts[0].error or "")
        assert_same(result.state_dict(), load_state_dict(medium_ckpt))
        admin = PlannerClient(planner, token=ADMIN)
        view = admin.get_instance(seed.instance_ids[0])
        # out of service until it re-verifies (and its re-hash of the corrupted memory will fail)
        assert view.reverifying or view.integrity_failed
        assert [t.reason for t in admin.transfers().items] == ["checksum_mismatch"]
        assert_consistent(planner, ready=1)  # READY but quarantined: never offered (checked below)
        assert admin.request_assignment(identity=info.identity(), rank=0) is None


# ---- 6: an instance with the same identity but other weights publishes mid-pull ---------------------


def test_wrong_identity_publication_mid_pull_is_refused(medium_ckpt, planner, tmp_path):
    info = read_checkpoint_info(medium_ckpt)
    impostor_dir = write_synthetic_checkpoint(tmp_path / "impostor", config=_config_of(medium_ckpt), seed=7)
    impostor_info = read_checkpoint_info(impostor_dir)
    assert impostor_info.identity(model=info.identity().model) == info.identity()  # same shapes and names
    refused: list[Conflict] = []

    def impostor_publishes(_iid: str) -> None:
        try:
            Seed(
                weights=[_disk_weights(impostor_dir)],
                identity=info.identity(),
                planner_url=planner,
                control=False,
                token=REGISTER,
            ).start()
        except Conflict as exc:
            refused.append(exc)

    with Seed(
        weights=[_disk_weights(medium_ckpt)],
        identity=info.identity(),
        planner_url=planner,
        control=False,
        token=REGISTER,
    ):
        loader = FaultOnProgress(
            impostor_publishes, identity=info.identity(), planner_url=planner, options=opts(become_seed=False)
        )
        result = timed_load(loader)
        assert result.source == "rfork-tcp"
        assert_same(result.state_dict(), load_state_dict(medium_ckpt))
        assert len(refused) == 1
        assert refused[0].reason == "digest_mismatch"
        result.close()
        assert_consistent(planner, ready=1)  # the impostor was deleted again, never READY


def _config_of(ckpt: Path):
    import json

    from rfork.weights.synthetic import LlamaConfig

    return LlamaConfig.from_dict(json.loads((ckpt / "config.json").read_text()))


# ---- 7: the loader's disk is full ---------------------------------------------------------------


@contextlib.contextmanager
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a full filesystem: a 64 KiB tmpfs, filled (needs the right to mount: root)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.decode().strip()}")
    try:
        with contextlib.suppress(OSError), (mnt / "filler").open("wb") as f:
            f.write(b"\0" * (1 << 20))
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_full_disk_at_the_loader(fleet, small_ckpt, planner, tmp_path):
    ids, _seed = start_seed(fleet, small_ckpt, planner)
    with full_disk(tmp_path) as mnt:
        out = mnt / "result.json"
        args = load_args(out, planner_url=planner, checkpoint=small_ckpt, then="serve")
        child = fleet.spawn("loader", args)
        t0 = time.monotonic()
        rc = child.proc.wait(BOUND_S)
        assert time.monotonic() - t0 < BOUND_S
        assert rc != 0
        tail = child.tail()
        assert "rfork: error:" in tail
        assert "No space left on device" in tail
        assert not out.exists()
    # the loaded instance served for a moment, then drained on the error: only the seed is left
    assert_consistent(planner, ready=1)
    assert PlannerClient(planner, token=ADMIN).list_instances().total == 1
    assert ids
