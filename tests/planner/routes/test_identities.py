"""GET /v1/identities/{key}/shared: identities whose anchors share tensors with another's (a rollout's
other sources), only where someone serves them, most shared first."""

from __future__ import annotations

import copy

import httpx
import pytest

from planner.contract import PlannerClient
from planner.contract.wire import identity_key
from tests.planner.conftest import identity, manifest, ranks


def _publish(c: PlannerClient, fingerprint: str, digests: list[str]) -> tuple[str, str]:
    """A READY instance of identity `fingerprint`; its rank-0 tensors w0.. have `digests` (anchored)."""
    ident = identity(fingerprint=fingerprint, tp=1)
    iid = c.register_instance(identity=ident, ranks=ranks(0)).id
    m = manifest(0)
    template = m["tensors"][0]
    m["regions"][0]["nbytes"] = 64 * len(digests)
    m["tensors"] = [
        copy.deepcopy(template) | {"name": f"w{i}", "offset": 64 * i, "checksum": d}
        for i, d in enumerate(digests)
    ]
    c.put_manifest(iid, 0, m)
    c.set_status(iid, "READY")
    return iid, identity_key(ident)


def test_identities_sharing_anchored_tensors_are_listed_most_shared_first(server):
    c = PlannerClient(server.url)
    _, v2 = _publish(c, "v2", ["a", "b", "c", "d"])
    v1_id, v1 = _publish(c, "v1", ["a", "b", "c", "x"])  # three tensors unchanged
    _publish(c, "v1b", ["a", "y", "z", "x"])  # one
    _publish(c, "other", ["p", "q", "r", "s"])  # none
    _publish(c, "renamed", ["b", "a", "c", "d"])  # equal digests under other names are not the same tensor

    def shared(key: str, **params) -> list[tuple[str, int, int]]:
        page = c.shared_identities(key, rank=0, checksum_algorithm="xxh64", **params)
        return [(i.identity.fingerprint, i.shared_tensors, i.ready) for i in page.items]

    assert shared(v2) == [("v1", 3, 1), ("renamed", 2, 1), ("v1b", 1, 1)]
    assert shared(v2, limit=1) == [("v1", 3, 1)]
    assert shared(v1)[0] == ("v2", 3, 1)
    c.set_status(v1_id, "DRAINING")  # nobody serves v1 any more
    assert [f for f, _, _ in shared(v2)] == ["renamed", "v1b"]
    assert shared(v2.replace(v2[0], "0" if v2[0] != "0" else "1")) == []  # no anchor: nothing shared
    assert c.shared_identities(v2, rank=0, checksum_algorithm="blake3").items == []  # another algorithm


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/identities/xyz/shared", "identity_key"),
        ("/v1/identities/" + "a" * 64 + "/shared?rank=-1", "rank"),
    ],
)
def test_bad_keys_and_ranks_are_a_422_naming_them(server, path, field):
    r = httpx.get(server.url + path, timeout=10)
    assert r.status_code == 422
    assert field in r.text
