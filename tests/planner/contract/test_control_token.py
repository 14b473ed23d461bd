"""Control tokens: issued with a lease for the leased seed, signed with its control_key, checked offline
by the seed (planner.contract.control_token)."""

from __future__ import annotations

import time

import pytest

from planner.contract import ControlTokenError, PlannerClient, new_control_key, verify_control_token
from tests.planner.conftest import identity, manifest, ranks


def test_control_token_issued_with_the_lease_and_checked_offline(server):
    c = PlannerClient(server.url)
    key = new_control_key()
    reg = c.register_instance(
        identity=identity(), ranks=ranks(0), control_url="http://127.0.0.2:9000", control_key=key
    )
    c.put_manifest(reg.id, 0, manifest(0))
    c.set_status(reg.id, "READY")
    assert "control_key" not in c.get_instance(reg.id).model_dump()
    lease = c.request_assignment(identity=identity(), rank=0)
    assert lease is not None
    token = lease.candidates[0].control_token
    assert token is not None
    grant = verify_control_token(token, key, instance_ids=[reg.id], rank=0, now=time.time())
    assert grant.lease_id == lease.id
    with pytest.raises(ControlTokenError, match="rank"):
        verify_control_token(token, key, instance_ids=[reg.id], rank=1, now=time.time())
    with pytest.raises(ControlTokenError, match="signature"):
        verify_control_token(token, new_control_key(), instance_ids=[reg.id], rank=0, now=0)
    with pytest.raises(ControlTokenError, match="expired"):
        verify_control_token(token, key, instance_ids=[reg.id], rank=0, now=time.time() + 10**6)
    with pytest.raises(ControlTokenError, match="instance"):
        verify_control_token(token, key, instance_ids=["0" * 32], rank=0, now=time.time())
    forged = token.rsplit(".", 2)[0] + f".{int(time.time()) + 10**6}." + token.rsplit(".", 1)[1]
    with pytest.raises(ControlTokenError, match="signature"):
        verify_control_token(forged, key, instance_ids=[reg.id], rank=0, now=time.time())
