"""Helpers of the accusation tests: a planner with every role, a seed in its own process, loaders."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from planner.contract import PlannerClient
from planner.server import PlannerServer
from tests.planner.conftest import identity, ranks
from tests.waiting import wait_until as shared_wait_until

ROOT = Path(__file__).resolve().parents[2]
TOKENS: dict[str, Any] = {
    "admin_token": "adm",
    "anchor_token": "anc",  # the seed: register + anchor
    "register_token": "lr",
    "load_token": "lr",  # a loader's token: load + register, so its instance tokens may lease
    "reader_token": "read",
}


@contextlib.contextmanager
def planner(url: str, **settings: Any) -> Iterator[PlannerServer]:
    """A secured planner server (its reaper idle; the prober runs)."""
    with PlannerServer(db_url=url, port=0, reaper_interval_s=3600, **TOKENS, **settings) as srv:
        yield srv


@contextlib.contextmanager
def seed_process(planner_url: str, **env: str) -> Iterator[str]:
    """tests.planner.seed_process in its own process; yields its instance id once READY."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.planner.seed_process"],
        cwd=ROOT,
        env={**os.environ, "PLANNER_URL": planner_url, "SEED_TOKEN": "anc", **env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:1] == ["READY"], f"seed process did not start: {line}"
        yield line[1]
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def instance_loader(srv: PlannerServer) -> tuple[PlannerClient, str]:
    """A loader that registered first: its instance token identifies it (requester_id = its id)."""
    client = PlannerClient(srv.url, token="lr")
    reg = client.register_instance(identity=identity(), ranks=ranks(0))
    client.use_token(reg.token)
    return client, reg.id


def admin(srv: PlannerServer) -> PlannerClient:
    return PlannerClient(srv.url, token="adm")


def metrics_text(srv: PlannerServer) -> str:
    got = httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer adm"}, timeout=10)
    got.raise_for_status()
    return got.text


def fleet_json(srv: PlannerServer) -> dict[str, Any]:
    got = httpx.get(f"{srv.url}/v1/fleet", headers={"Authorization": "Bearer read"}, timeout=10)
    got.raise_for_status()
    return dict(got.json())


def wait_until(what: Callable[[], bool], timeout_s: float = 20.0, why: str = "") -> None:
    """Poll `what` until true (a bound for a shared 2-core box, not a timing assertion)."""
    shared_wait_until(what, timeout_s, why or "a condition", every_s=0.1)
