"""RFORK_PROBE_NETWORKS: the planner's health probe connects only inside the listed networks, so a
register token cannot aim it at any host:port and read the answer's fate off the seed's quarantine
(a port scan by proxy). Real planner server, the seed in its own process, a real listener."""

from __future__ import annotations

import logging
import socket

import pytest

from planner.contract import PlannerClient
from planner.settings import PlannerSettings
from tests.planner.conftest import identity
from tests.planner.trust_fleet import admin, planner, seed_process, wait_until


def test_a_malformed_list_stops_the_planner() -> None:
    with pytest.raises(ValueError, match="10.0.0.300/8"):
        PlannerSettings(probe_networks="10.0.0.0/8, 10.0.0.300/8")


ALLOW_10 = "10.0.0.0/8"


@pytest.mark.slow
def test_the_probe_never_connects_outside_the_networks(
    planner_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """main: the probe connected to the listener (any host:port a control URL named) and, as nothing
    answered, quarantined the seed: whether the port was open showed in its state."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        target = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with (
            caplog.at_level(logging.WARNING, logger="planner.service.probes"),
            planner(planner_url, probe_interval_s=0.5, probe_timeout_s=1.0, probe_networks=ALLOW_10) as srv,
            seed_process(srv.url, SEED_CONTROL_URL=target) as seed_id,
        ):
            loader = PlannerClient(srv.url, token="lr")
            for _ in range(3):  # one token's transport failures: the planner asks its probe
                lease = loader.request_assignment(identity=identity(), rank=0)
                assert lease is not None
                loader.report_transfer(lease.id, outcome="failure", reason="transport", error="claimed")
            wait_until(lambda: "outside RFORK_PROBE_NETWORKS" in caplog.text, why="the probe is refused")
            with pytest.raises(BlockingIOError):  # nothing connected to the listener
                listener.accept()
            assert admin(srv).get_instance(seed_id).quarantined_until is None
