"""A 429 answered again from memory (Planner._still_busy): while no write of this process changed rows
and the clock moved less than `busy_cache_s`; never a lease, and never past a change."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from planner import AllBusy, NoSource, TransferReport, migrate
from tests.planner.conftest import make_planner
from tests.planner.test_burst import _ask, _seed

DONE = TransferReport(outcome="success", bytes=64, seconds=0.5)


@pytest.fixture
def sqlite_svc(sqlite_url: str) -> Iterator[Any]:
    """A planner on a migrated SQLite file (the remembered 429 applies on SQLite only)."""
    migrate(sqlite_url)
    svc = make_planner(sqlite_url, busy_cache_s=0.05)
    yield svc
    svc.close()


def _now(answer: Any) -> Any:
    """A batch step's continuation for an answer already made."""
    return lambda: answer


def _counting(svc: Any) -> list[int]:
    """Count the decisions that read the seeds."""
    calls = [0]
    real = svc._free_seeds

    def counted(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        return real(*a, **kw)

    svc._free_seeds = counted
    return calls


def test_a_repeated_429_reads_nothing_until_a_write_frees_a_slot(planner_url):
    svc = make_planner(planner_url)
    try:
        now = 1000.0
        _seed(svc, now, limit=1)
        lease = svc.assign(_ask(), now).id
        calls = _counting(svc)
        for dt in (0.0, 0.01, 0.02):
            with pytest.raises(AllBusy):
                svc.assign(_ask(), now + dt)
        # SQLite: one read, then from memory; PostgreSQL counts every write transaction as a change
        assert calls[0] == (1 if svc.db.sqlite else 3)
        svc.report(lease, DONE, now + 0.03)  # frees the slot: the next ask reads again and gets it
        assert svc.assign(_ask(), now + 0.03).candidates
        assert calls[0] == (2 if svc.db.sqlite else 4)
    finally:
        svc.close()


def test_the_remembered_429_lasts_busy_cache_s_of_the_clock(sqlite_svc):
    svc = sqlite_svc
    now = 1000.0
    _seed(svc, now, limit=1)
    svc.assign(_ask(), now)
    calls = _counting(svc)
    for dt in (0.0, 0.04, 0.1, 0.12, 0.05):  # 0.1 is past 0.04 + 0.05; 0.05 lies before 0.1
        with pytest.raises(AllBusy):
            svc.assign(_ask(), now + dt)
    assert calls[0] == 3  # at 0.0, 0.1 and (the clock went back) 0.05


def test_another_shape_of_request_is_not_answered_from_memory(sqlite_svc):
    svc = sqlite_svc
    now = 1000.0
    seed = _seed(svc, now, limit=1)
    svc.assign(_ask(), now)
    calls = _counting(svc)
    with pytest.raises(AllBusy):
        svc.assign(_ask(), now)
    with pytest.raises(AllBusy):
        svc.assign(_ask(exclude=["someone"]), now)
    assert calls[0] == 2
    with pytest.raises(NoSource):  # excluding the only seed: 404, not the remembered 429
        svc.assign(_ask(exclude=[seed]), now)


def test_in_a_batch_a_report_before_an_ask_frees_the_slot_for_it(sqlite_svc):
    svc = sqlite_svc
    now = 1000.0
    _seed(svc, now, limit=1)
    lease = svc.assign(_ask(), now).id
    with pytest.raises(AllBusy):
        svc.assign(_ask(), now)  # remembered
    got = svc.write_batch(
        [
            lambda s: _now(svc.report_in(s, lease, DONE, now, None)),
            lambda s: svc.assign_in(s, _ask(), now, None),
        ]
    )
    assert not isinstance(got[1], Exception), got


def test_another_process_write_is_seen_after_busy_cache_s(sqlite_url):
    migrate(sqlite_url)
    # two planners on one database: the first remembers its 429; the second ends the lease
    a = make_planner(sqlite_url, busy_cache_s=0.05)
    b = make_planner(sqlite_url)
    try:
        now = 1000.0
        _seed(a, now, limit=1)
        lease = a.assign(_ask(), now).id
        with pytest.raises(AllBusy):
            a.assign(_ask(), now)
        b.report(lease, DONE, now)
        with pytest.raises(AllBusy):  # within busy_cache_s: the remembered answer, one extra ask
            a.assign(_ask(), now + 0.01)
        assert a.assign(_ask(), now + 0.07).candidates
    finally:
        a.close()
        b.close()
