"""rfork.seed.control: the control endpoint wants the lease's token, bounds slow clients, answers bad
input with 4xx."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch

from planner.contract import PlannerClient
from rfork import LoadOptions, load
from rfork.pull.nccl import pull_over_nccl
from rfork.seed.control import ControlServer
from rfork.seed.seed import Seed
from rfork.weights.checkpoint import load_rank_from_disk, load_state_dict, read_checkpoint_info
from rfork.weights.rank_weights import RankWeights
from tests.rfork.conftest import AUTH, LOAD, READER, REGISTER, assert_same
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def _weights(ckpt) -> RankWeights:
    layout, buffers, tensors = load_rank_from_disk(read_checkpoint_info(ckpt))
    return RankWeights(rank=0, layout=layout, buffers=buffers, tensors=tensors)


def _post_session(url: str, rank: int, token: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(
        url + "/v1/nccl/sessions", data=json.dumps({"rank": rank}).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _post(url: str, body: bytes, method: str = "POST") -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_control_endpoint_needs_the_lease_token_and_works_across_two_addresses(small_ckpt, planner):
    info = read_checkpoint_info(small_ckpt)
    with Seed(
        weights=[_weights(small_ckpt)],
        identity=info.identity(),
        planner_url=planner,
        control_host="127.0.0.2",
        token=REGISTER,
    ) as seed:
        assert seed.control_server is not None
        control_url = seed.control_server.url
        assert control_url.startswith("http://127.0.0.2:")  # bound to its routable address, published
        published = PlannerClient(planner, token=READER).get_instance(seed.instance_ids[0])
        assert published.control_url == control_url
        # the loader (on 127.0.0.1) pulls over the NCCL/gloo fallback with the lease's token
        result = load(
            identity=info.identity(),
            planner_url=planner,
            **AUTH,
            options=LoadOptions(providers=["nccl"], rank_deadline_s=60.0, become_seed=False),
        )
        assert result.source == "nccl"
        assert_same(result.state_dict(), load_state_dict(small_ckpt))

        status, body = _post_session(control_url, 0, None)
        assert status == 401
        loader = PlannerClient(planner, token=LOAD)
        lease = loader.request_assignment(identity=info.identity(), rank=0, providers=[], backends=["nccl"])
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

    from planner.contract import issue_control_token, new_control_key
    from rfork.seed.control import ControlServer

    key = new_control_key()

    def auth(lease: str) -> bytes:
        token = issue_control_token(
            key, lease_id=lease, instance_id="0" * 32, rank=0, expires_at=time.time() + 60
        )
        return b"Authorization: Bearer " + token.encode() + b"\r\n"

    with ControlServer(
        host="127.0.0.1",
        tensors_for_rank=lambda r: [torch.zeros(4)],
        control_key=key,
        instance_ids=lambda: ["0" * 32],
        request_timeout_s=1.0,
    ) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/nccl/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                + auth("a")
                + b"\r\n{"
            )
            t0 = time.monotonic()
            data = sock.recv(1000)  # the seed gives up on the silent client
            assert time.monotonic() - t0 < 8
        assert b" 408 " in data
        assert _post_session(server.url, 0, "x" * 10)[0] == 403
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # refused by its length
            sock.sendall(
                b"POST /v1/nccl/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 1048576\r\n"
                + auth("b")
                + b"\r\n"
            )
            assert b" 413 " in sock.recv(1000)


def test_control_endpoint_rejects_bad_input_with_4xx() -> None:
    tensors = [torch.ones(4)]
    with ControlServer(tensors_for_rank=lambda r: [tensors][r], max_concurrent=1, timeout_s=1.0) as srv:
        url = srv.url + "/v1/nccl/sessions"
        cases = [
            (b"not json", 400),
            (b"[1]", 400),
            (b'{"rank": -1}', 422),
            (b'{"rank": "0"}', 422),
            (b'{"rank": true}', 422),
            (b"{}", 422),
            (b'{"rank": 7}', 404),
        ]
        for body, want in cases:
            status, answer = _post(url, body)
            assert status == want, (body, answer)
            assert answer["error"]
        assert _post(srv.url + "/v1/nope", b"{}")[0] == 404
        assert _post(url, b"{}", method="PUT")[0] == 405
        status, answer = _post(url, b'{"rank": 0}')
        assert status == 201
        assert set(answer) == {"session_id", "host", "port", "backend"}
        assert answer["backend"] == "gloo"
        status, busy = _post(url, b'{"rank": 0}')
        assert status == 429
        assert busy["retry_after_s"] > 0
        with urllib.request.urlopen(f"{srv.url}/v1/nccl/sessions/{answer['session_id']}", timeout=5) as resp:
            assert json.loads(resp.read())["rank"] == 0
        # nobody joins: the session fails after timeout_s and frees the slot
        wait_until(lambda: not srv.health()["active_sessions"], 5.0, "the slot freed")
        assert srv.session(answer["session_id"]).state == "failed"  # type: ignore[union-attr]
