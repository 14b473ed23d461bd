"""planner.queries.RawStatement: the driver's execution of a compiled hot statement gives the rows that
SQLAlchemy's execution of the same statement gives (list parameters included, empty ones too)."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from planner import RankManifest, RegistrationRequest
from tests.planner.conftest import identity, manifest

_SETTINGS = settings(max_examples=25, deadline=None)


def _seeds(svc, n: int) -> list[str]:
    now = time.time()
    out = []
    for i in range(n):
        rank0 = {"rank": 0, "provider": "tcp", "address": f"YWRk{i}A==", "backends": ["tcp", "nccl"]}
        body = RegistrationRequest.model_validate(
            {"identity": identity(), "ranks": [rank0], "labels": {"node": f"n{i}"}}
        )
        seed = svc.register(body, now).id
        svc.put_manifest(seed, 0, RankManifest.model_validate(manifest(0)).model_dump_json(), now)
        svc.set_status(seed, "READY", now)
        out.append(seed)
    return out


def _same(svc, raw, params) -> None:
    with svc.db.write_core() as s:
        got = [tuple(r) for r in raw.rows(s, params)]
        want = [tuple(r) for r in s.execute(raw.stmt, params)]
        s.rollback()
    assert sorted(got) == sorted(want)


def test_raw_rows_match_sqlalchemy(svc):
    known = _seeds(svc, 4)
    key = svc.get(known[0]).identity_key
    sql = svc._sql

    @_SETTINGS
    @given(pick=st.lists(st.sampled_from([*known, "0" * 32, "x'; --"]), max_size=6))
    def check(pick: list[str]) -> None:
        now = time.time()
        base = {"b_key": key, "b_rank": 0, "b_oldest_beat": now - 60, "b_now": now, "b_limit": 3}
        near = {**base, "b_node": "n1", "b_rack": "", "b_zone": "z"}
        _same(svc, sql.candidates, base)
        _same(svc, sql.candidates_excluding, {**base, "b_excluded": pick})
        _same(svc, sql.ranked, near)
        _same(svc, sql.ranked_excluding, {**near, "b_excluded": pick})
        _same(svc, sql.lock_chosen, {**base, "b_ids": pick})
        _same(svc, sql.live_starts, base)
        _same(svc, sql.chosen_details, {"b_ids": pick, "b_rank": 0})
        _same(svc, sql.live_leases, {"b_ids": pick, "b_rank": 0, "b_now": now})
        _same(svc, sql.heartbeats, {"b_ids": pick, "b_now": now})

    check()


def test_sqlite_ranks_from_the_identity_index(svc):
    """The candidates of an identity are read through its index, not every READY instance's (SQLite
    without statistics chose ix_instances_status_updated: 10,000 rows per assignment at 10,000)."""
    if not svc.db.sqlite:
        return
    sql = svc._sql
    for raw in (sql.candidates, sql.candidates_excluding, sql.ranked, sql.ranked_excluding):
        params = {**raw.defaults, "b_key": "k", "b_rank": 0, "b_oldest_beat": 0.0, "b_now": 0.0, "b_limit": 3}
        params.update({"b_node": "n", "b_rack": "r", "b_zone": "z"})
        params.update(dict.fromkeys(raw.lists, "[]"))
        with svc.db.write_core() as s:
            plan = s.connection.dbapi_connection.execute("EXPLAIN QUERY PLAN " + raw.sql, params).fetchall()
        instances = [row[-1] for row in plan if " instances " in f"{row[-1]} "]
        assert instances, plan
        # through an index that leads with identity_key (the plain one, or (identity_key, accused_since))
        leading = ("ix_instances_identity_key", "ix_instances_identity_accused")
        assert all(any(ix in x for ix in leading) for x in instances), plan
