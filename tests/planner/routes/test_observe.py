"""Operations endpoints: /healthz (the process is up), /readyz (the database answers), /metrics."""

from __future__ import annotations

import httpx

from planner import PlannerServer
from planner.db import Database


def test_health_readiness_and_metrics(planner_url):
    with PlannerServer(db_url=planner_url, port=0, admin_token="adm", reaper_interval_s=3600) as srv:
        assert httpx.get(srv.url + "/healthz").json() == {"status": "ok"}  # no token needed
        ready = httpx.get(srv.url + "/readyz")
        assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
        metrics = httpx.get(srv.url + "/metrics")
        assert metrics.headers["content-type"].startswith("text/plain")
        assert 'rfork_planner_instances{status="READY"} 0.0' in metrics.text
        assert srv.app is not None
        planner = srv.app.state.planner
        working = planner.db
        planner.db = Database("postgresql+psycopg://nobody@127.0.0.1:1/none", pool_size=1)  # refuses
        try:
            down = httpx.get(srv.url + "/readyz")
        finally:
            planner.db.close()
            planner.db = working
        assert down.status_code == 503
        assert down.json() == {"status": "unavailable", "detail": "database: OperationalError"}
        assert httpx.get(srv.url + "/healthz").status_code == 200  # up, though not ready
