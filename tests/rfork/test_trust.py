"""Trust and outages end to end, with auth on: a corrupted READY seed is never accepted and is
quarantined; seeds re-assert READY after STALE and register again after a 404; a planner outage
during a load keeps the verified weights and publishes in the background; the seed's control
endpoint (NCCL fallback) needs the lease's token and works across two addresses."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch
from sqlalchemy import create_engine, text

from planner.client import Conflict, PlannerClient
from planner.server import PlannerServer
from rfork import LoadOptions, load
from rfork.errors import LoadFailed
from rfork.pull.nccl import pull_over_nccl
from rfork.seed.seed import Seed
from rfork.weights.checkpoint import load_rank_from_disk, load_state_dict, read_checkpoint_info
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import ADMIN, AUTH, LOAD, READER, REGISTER
from tests.rfork.test_end_to_end import assert_same

pytestmark = pytest.mark.slow
TOKENS: dict[str, Any] = {
    "admin_token": ADMIN, "register_token": REGISTER, "load_token": LOAD, "reader_token": READER
}


def opts(**kw) -> LoadOptions:
    return LoadOptions(providers=["tcp"], transfer_timeout_s=3.0, rank_deadline_s=60.0, **kw)


def _weights(ckpt) -> RankWeights:
    layout, buffers, tensors = load_rank_from_disk(read_checkpoint_info(ckpt))
    return RankWeights(rank=0, layout=layout, buffers=buffers, tensors=tensors)


def _until(pred, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def test_flipped_byte_in_a_ready_seed_is_never_accepted_and_quarantines_it(small_ckpt, planner):
    info = read_checkpoint_info(small_ckpt)
    weights = _weights(small_ckpt)
    admin = PlannerClient(planner, token=ADMIN)
    with Seed(
        weights=[weights], identity=info.identity(), planner_url=planner, control=False, token=REGISTER
    ) as seed:
        victim = weights.layout.placements[7]
        weights.buffers[victim.region][victim.offset + 11] ^= 0x01  # one bit, while READY
        first = load(identity=info.identity(), planner_url=planner, checkpoint=small_ckpt, **AUTH,
                     options=opts(become_seed=False))
        assert first.source == "disk"  # the corrupt seed was refused, the disk copy verified
        assert first.attempts[0].instance_id == seed.instance_ids[0]
        assert "checksum" in (first.attempts[0].error or "")
        assert_same(first.state_dict(), load_state_dict(small_ckpt))
        assert admin.get_instance(seed.instance_ids[0])["quarantined_until"] > time.time()
        with pytest.raises(LoadFailed):  # no loader is ever handed that seed again
            load(identity=info.identity(), planner_url=planner, **AUTH, options=opts(become_seed=False))
        # republishing from the corrupted memory is refused against the anchor
        pub = seed.publications[0]
        weights.checksums.clear()
        fresh = weights.manifest(seed.servers[0].ranks[0].descriptors()).to_dict()
        with pytest.raises(Conflict) as err:
            pub.client.put_manifest(seed.instance_ids[0], 0, {**fresh, "origin": "disk"})
        assert err.value.reason == "digest_mismatch"
        metrics = urllib.request.urlopen(planner + "/metrics", timeout=10).read().decode()
        assert "rfork_planner_integrity_refusals_total 1.0" in metrics


def test_seed_reasserts_ready_after_stale_and_registers_again_after_404(small_ckpt, sqlite_url):
    info = read_checkpoint_info(small_ckpt)
    with PlannerServer(db_url=sqlite_url, heartbeat_ttl_s=1.5, reaper_interval_s=3600, **TOKENS) as srv:
        admin = PlannerClient(srv.url, token=ADMIN)
        with Seed(weights=[_weights(small_ckpt)], identity=info.identity(), planner_url=srv.url,
                  control=False, token=REGISTER) as seed:
            first = seed.instance_ids[0]
            eng = create_engine(sqlite_url)
            with eng.begin() as conn:  # what the reaper does when heartbeats stopped for a while
                conn.execute(text("UPDATE instances SET status='STALE' WHERE id=:i"), {"i": first})
            eng.dispose()
            _until(lambda: admin.get_instance(first)["status"] == "READY", 10, "READY again after STALE")
            admin.delete_instance(first)  # the planner forgets it (e.g. a fresh database)
            again = _until(lambda: [i for i in seed.instance_ids if i != first], 15, "registered again")[0]
            assert admin.get_instance(again)["status"] == "READY"
            result = load(
                identity=info.identity(), planner_url=srv.url, **AUTH, options=opts(become_seed=False)
            )
            assert result.attempts[0].instance_id == again
            assert result.source == "rfork-tcp"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_planner_down_during_load_keeps_weights_and_publishes_in_background(small_ckpt, sqlite_url):
    info = read_checkpoint_info(small_ckpt)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    result = load(identity=info.identity(), planner_url=url, checkpoint=small_ckpt, **AUTH, options=opts())
    try:
        assert time.monotonic() - t0 < 60
        assert result.source == "disk"
        assert_same(result.state_dict(), load_state_dict(small_ckpt))
        assert result.seed is not None
        assert result.seed.instance_ids == []  # not published yet: the planner is down
        with PlannerServer(db_url=sqlite_url, port=port, **TOKENS) as srv:
            reader = PlannerClient(srv.url, token=READER)
            _until(lambda: reader.list_instances(status="READY")["total"] == 1, 20, "published after outage")
            b = load(identity=info.identity(), planner_url=srv.url, **AUTH, options=opts(become_seed=False))
            assert b.source == "rfork-tcp"  # anchored by the disk-loaded instance, served from it
            assert b.attempts[0].instance_id == result.seed.instance_ids[0]
            assert_same(b.state_dict(), load_state_dict(small_ckpt))
    finally:
        result.close()


def _post_session(url: str, rank: int, token: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + "/v1/nccl/sessions", data=json.dumps({"rank": rank}).encode(),
                                 headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_control_endpoint_needs_the_lease_token_and_works_across_two_addresses(small_ckpt, planner):
    info = read_checkpoint_info(small_ckpt)
    with Seed(weights=[_weights(small_ckpt)], identity=info.identity(), planner_url=planner,
              control_host="127.0.0.2", token=REGISTER) as seed:
        assert seed.control_server is not None
        control_url = seed.control_server.url
        assert control_url.startswith("http://127.0.0.2:")  # bound to its routable address, published
        published = PlannerClient(planner, token=READER).get_instance(seed.instance_ids[0])
        assert published["control_url"] == control_url
        # the loader (on 127.0.0.1) pulls over the NCCL/gloo fallback with the lease's token
        result = load(identity=info.identity(), planner_url=planner, **AUTH,
                      options=LoadOptions(providers=["nccl"], rank_deadline_s=60.0, become_seed=False))
        assert result.source == "nccl"
        assert_same(result.state_dict(), load_state_dict(small_ckpt))

        status, body = _post_session(control_url, 0, None)
        assert status == 401
        loader = PlannerClient(planner, token=LOAD)
        lease = loader.request_assignment(identity=info.identity().to_dict(), rank=0, providers=[],
                                          backends=["nccl"])
        assert lease is not None
        token = lease.candidates[0].control_token
        assert token
        assert _post_session(control_url, 1, token)[0] == 403  # another rank
        forged = token[:-4] + ("0000" if not token.endswith("0000") else "1111")
        assert _post_session(control_url, 0, forged)[0] == 403
        dest = [torch.empty_like(t) for t in result.state_dict().values() if t.numel()]
        assert pull_over_nccl(control_url, 0, dest, timeout_s=60.0, control_token=token) > 0
        status, body = _post_session(control_url, 0, token)  # one session per lease
        assert status == 403
        assert "already used" in body["error"]
        loader.report_transfer(lease.id, outcome="failure", reason="test")


def test_control_endpoint_bounds_slow_clients_and_bodies():
    import torch

    from planner.control_token import new_control_key
    from rfork.seed.control import ControlServer

    with ControlServer(
        host="127.0.0.1",
        tensors_for_rank=lambda r: [torch.zeros(4)],
        control_key=new_control_key(),
        instance_ids=lambda: ["0" * 32],
        request_timeout_s=1.0,
    ) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/nccl/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            t0 = time.monotonic()
            data = sock.recv(1000)  # the seed gives up on the silent client
            assert time.monotonic() - t0 < 8
        assert b" 408 " in data
        assert _post_session(server.url, 0, "x" * 10)[0] == 403
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # refused by its length
            sock.sendall(b"POST /v1/nccl/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 1048576\r\n\r\n")
            assert b" 413 " in sock.recv(1000)
