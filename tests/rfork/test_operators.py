"""What an operator of a fleet meets, with real processes: a planner, seed processes and `rfork load`
processes. A signal during a pull frees the seed's slot at once; a loader whose token cannot register
says so in one line; the planner URL comes from the environment; the loader says where it pulls from
and why, and both loader and seed export metrics; seeds and loaders of different rfork releases share
a fleet (a version string faked in the seed's process)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from bench.processes import load_args, seed_args
from planner.contract import PlannerClient
from tests.rfork.conftest import READER, identity_of, start_seed
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def _live_lease_of(planner: str, seed_id: str, timeout_s: float = 60.0) -> str:
    """The id of the first live pull from `seed_id` the planner shows."""
    with PlannerClient(planner, token=READER) as reader:
        live = wait_until(
            lambda: [e for e in reader.fleet().edges if e.live and e.seed_id == seed_id],
            timeout_s,
            f"a live pull from {seed_id}",
            every_s=0.05,
        )
    return live[0].assignment_id


def _metrics(port: int) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + ("{" if labels else " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_pull_frees_the_seeds_slot_at_once(signum, fleet, medium_ckpt, planner):
    """Kill a loader mid-pull: it reports `aborted`, exits 128 + signal with one line, and the next
    loader gets the seed's only slot at once (main: rc 1, no output, the slot held for the lease TTL)."""
    # one pull at a time, so the next loader needs the first one's slot
    ready = fleet.workdir / "seed1.ready.json"
    seed = fleet.spawn("seed1", seed_args(medium_ckpt, planner, ready, extra=["--max-concurrent-pulls", "1"]))
    (seed_id,) = fleet.wait_file(seed, ready, timeout_s=90)["instance_ids"]
    # Stop the seed before the loader starts: a pull over loopback ends in tens of milliseconds, so
    # stopping it once the lease shows would race the pull. The planner still lists the seed (its
    # heartbeat TTL is 30 s), so the loader takes the lease and then stalls on the stopped seed.
    os.kill(seed.proc.pid, signal.SIGSTOP)
    try:
        first = fleet.spawn(
            "loader1",
            load_args(
                fleet.workdir / "l1.json",
                planner_url=planner,
                checkpoint=medium_ckpt,
                extra=["--timeout", "60"],
            ),
        )
        assignment = _live_lease_of(planner, seed_id)
        time.sleep(0.5)
        t0 = time.monotonic()
        first.proc.send_signal(signum)
        status = fleet.wait_exit(first, timeout_s=30)
        stopped_in = time.monotonic() - t0
    finally:
        os.kill(seed.proc.pid, signal.SIGCONT)
    assert status == 128 + signum, first.tail()
    assert stopped_in < 15, stopped_in  # not the transfer timeout (60 s) nor the lease TTL
    tail = first.tail()
    errors = [ln for ln in tail.splitlines() if ln.startswith("rfork: error:")]
    name = signal.Signals(signum).name
    assert errors == [
        f"rfork: error: interrupted by {name}: the load stopped; no lease is held and nothing is served"
    ]
    assert "Traceback" not in tail
    with PlannerClient(planner, token=READER) as reader:
        (ended,) = [t for t in reader.transfers().items if t.id == assignment]
        assert (ended.outcome, ended.reason) == ("failure", "aborted")
        assert not [e for e in reader.fleet().edges if e.live]  # the slot is free now, not in 120 s
    second_json = fleet.workdir / "l2.json"
    t0 = time.monotonic()
    second = fleet.spawn("loader2", load_args(second_json, planner_url=planner, checkpoint=medium_ckpt))
    out = fleet.wait_file(second, second_json, timeout_s=90)
    assert out["source"] == "rfork-tcp", second.tail()
    assert out["verified"]
    assert "every seed busy" not in second.tail()
    assert time.monotonic() - t0 < 60


def test_a_load_token_that_cannot_register_says_so_in_one_line(fleet, small_ckpt, planner):
    """`RFORK_TOKEN=<load token> rfork load` (serving by default) without a register token: status 2 and
    one line naming the register token (main: an AuthError traceback, "loaded", status 0)."""
    start_seed(fleet, small_ckpt, planner)
    env = {**os.environ, "RFORK_REGISTER_TOKEN": "", "PYTHONUNBUFFERED": "1"}
    del env["RFORK_REGISTER_TOKEN"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rfork",
            "load",
            "--checkpoint",
            str(small_ckpt),
            "--planner",
            planner,
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("rfork: error:")]
    assert len(errors) == 1, out.stderr
    assert "refused to register" in errors[0]
    assert "RFORK_REGISTER_TOKEN" in errors[0]
    assert "--no-serve" in errors[0]
    with PlannerClient(planner, token=READER) as reader:
        assert [i.status.value for i in reader.fleet().instances] == ["READY"]  # the seed alone: no stray


def test_the_planner_url_comes_from_the_environment_and_the_loader_says_why(
    fleet, small_ckpt, planner, tmp_path
):
    """`rfork seed` and `rfork load` read RFORK_PLANNER_URL (main: load went to disk without a word, seed
    refused to start); the loader logs its source and the planner's reason at the default level; both
    export Prometheus metrics."""
    env = {"RFORK_PLANNER_URL": planner}
    ready = fleet.workdir / "seed.ready.json"
    args = seed_args(small_ckpt, planner, ready)
    at = args.index("--planner")
    seed = fleet.spawn("seed", [*args[:at], *args[at + 2 :], "--metrics-port", "0"], env=env)
    (seed_id,) = fleet.wait_file(seed, ready, timeout_s=90)["instance_ids"]
    out_json = tmp_path / "load.json"
    loader = fleet.spawn(
        "loader",
        [*load_args(out_json, planner_url=None, checkpoint=small_ckpt, then="serve"), "--metrics-port", "0"],
        env=env,
    )
    out = fleet.wait_file(loader, out_json, timeout_s=90)
    assert out["source"] == "rfork-tcp", loader.tail()
    log = loader.tail(20_000)
    (why,) = [ln for ln in log.splitlines() if "pulling from seed" in ln]
    assert " INFO " in why
    assert seed_id in why
    assert "same node" in why
    assert "load_aware" in why
    ports = {}
    for child in (seed, loader):
        found = re.search(r"metrics on http://[^:]+:(\d+)/metrics", child.tail(20_000))
        assert found is not None, child.tail()
        ports[child.name] = int(found.group(1))
    seeding = _metrics(ports["seed"])
    size = float(json.loads(ready.read_text())["bytes"])
    assert _sample(seeding, "rfork_seed_bytes") == size
    loading = _metrics(ports["loader"])  # it serves now, so it is still there to be scraped
    assert _sample(loading, "rfork_pulls_total", source="rfork-tcp", outcome="success") == 1.0
    assert _sample(loading, "rfork_pull_bytes_total", source="rfork-tcp") == size
    assert (_sample(loading, "rfork_verify_seconds_count") or 0.0) >= 1.0
    assert _sample(loading, "rfork_seed_bytes") == size
    assert "rfork_fallbacks_total{" not in loading  # none happened


def test_seeds_and_loaders_of_different_releases_share_a_fleet(fleet, small_ckpt, planner, tmp_path):
    """The identity is the bytes and their layout: a seed of another rfork release (its version string
    faked) serves a loader of this one (main: framework_version carried the release, so disk)."""
    ready = fleet.workdir / "old-seed.ready.json"
    (tmp_path / "old_rfork.py").write_text(
        "import sys, rfork\n"
        "rfork.__version__ = '0.0.1-old'  # before anything reads it\n"
        "from rfork.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    seed = fleet.spawn(
        "old-seed",
        seed_args(small_ckpt, planner, ready),
        module="old_rfork",
        env={"PYTHONPATH": str(tmp_path)},
    )
    (seed_id,) = fleet.wait_file(seed, ready, timeout_s=90)["instance_ids"]
    with PlannerClient(planner, token=READER) as reader:
        registered = reader.get_instance(seed_id).identity
    assert registered == identity_of(small_ckpt).model_dump()
    out_json = tmp_path / "load.json"
    loader = fleet.spawn("loader", load_args(out_json, planner_url=planner, checkpoint=small_ckpt))
    out = fleet.wait_file(loader, out_json, timeout_s=90)
    assert out["source"] == "rfork-tcp", loader.tail()
    assert out["attempts"][-1]["instance_id"] == seed_id
