"""Planner load: 1,000 heartbeating instances while N clients request assignments and report transfers."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: --db, --clients, --instances, --seconds, --json."""
    parser.add_argument(
        "--db",
        default=None,
        help="SQLAlchemy URL; PostgreSQL gets a fresh database on that "
        "server (default: a temporary SQLite file)",
    )
    parser.add_argument("--clients", type=int, default=32, help="concurrent assignment clients (default 32)")
    parser.add_argument(
        "--heartbeaters", type=int, default=16, help="concurrent heartbeat senders (default 16)"
    )
    parser.add_argument("--instances", type=int, default=1000, help="registered instances (default 1000)")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured duration (default 15)")
    parser.add_argument("--json", default=None, help="write the results to this file")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fresh_db(url: str | None) -> tuple[str, Any]:
    """A fresh database URL and a cleanup function."""
    if url is None or url.startswith("sqlite"):
        tmp = tempfile.mkdtemp(prefix="rfork-bench-")
        return f"sqlite:///{tmp}/planner.db", lambda: None
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    base = make_url(url)
    name = f"rfork_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return base.set(database=name).render_as_string(hide_password=False), drop


def _identity(i: int) -> dict[str, Any]:
    return {
        "model": f"bench-{i}",
        "revision": "main",
        "fingerprint": f"fp{i}",
        "dtype": "bfloat16",
        "quantization": "none",
        "tp": 1,
        "pp": 1,
        "ep": 1,
        "dp": 1,
        "framework": "rfork",
        "framework_version": "0.1",
        "device_kind": "cpu",
    }


MANIFEST = {
    "rank": 0,
    "checksum_algorithm": "xxh64",
    "regions": [{"index": 0, "nbytes": 4096, "descriptor": "ZGVzYw=="}],
    "tensors": [
        {
            "name": f"layer.{i}.w",
            "dtype": "bfloat16",
            "shape": [32],
            "nbytes": 64,
            "region": 0,
            "offset": 64 * i,
            "checksum": "0" * 16,
        }
        for i in range(64)
    ],
}


async def _load(base: str, args: argparse.Namespace) -> dict[str, list[float]]:
    import httpx

    models = max(1, args.instances // 10)
    lat: dict[str, list[float]] = {
        "register": [],
        "assignment": [],
        "report": [],
        "heartbeat": [],
        "busy": [],
    }
    limits = httpx.Limits(max_connections=args.clients + args.heartbeaters + 8)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
        ids: list[str] = []

        async def register(i: int) -> None:
            body = {
                "identity": _identity(i % models),
                "labels": {"node": f"n{i % 50}", "rack": f"r{i % 10}", "zone": f"z{i % 2}"},
                "ranks": [{"rank": 0, "provider": "tcp", "address": "YWRkcg==", "backends": ["tcp", "nccl"]}],
                "max_concurrent_pulls": 4,
            }
            r = await http.post("/v1/instances", json=body)
            r.raise_for_status()
            iid = r.json()["id"]
            (await http.put(f"/v1/instances/{iid}/manifests/0", json=MANIFEST)).raise_for_status()
            (await http.post(f"/v1/instances/{iid}/status", json={"status": "READY"})).raise_for_status()
            ids.append(iid)

        sem = asyncio.Semaphore(16)

        async def reg_bounded(i: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                await register(i)
                lat["register"].append(time.perf_counter() - t0)

        await asyncio.gather(*(reg_bounded(i) for i in range(args.instances)))
        stop = time.perf_counter() + args.seconds
        rng = random.Random(0)

        async def assigner(k: int) -> None:
            while time.perf_counter() < stop:
                m = rng.randrange(models)
                body = {
                    "identity": _identity(m),
                    "rank": 0,
                    "labels": {"node": f"n{k}", "rack": f"r{k % 10}"},
                    "providers": ["tcp"],
                    "backends": ["nccl"],
                    "requester_id": None,
                }
                t0 = time.perf_counter()
                r = await http.post("/v1/assignments", json=body)
                dt = time.perf_counter() - t0
                if r.status_code == 429:
                    lat["busy"].append(dt)
                    continue
                if r.status_code != 201:
                    raise RuntimeError(f"assignment: {r.status_code} {r.text[:200]}")
                lat["assignment"].append(dt)
                t0 = time.perf_counter()
                rr = await http.post(
                    f"/v1/assignments/{r.json()['id']}/report",
                    json={"outcome": "success", "bytes": 1 << 30, "seconds": 0.5, "backend": "tcp"},
                )
                rr.raise_for_status()
                lat["report"].append(time.perf_counter() - t0)

        async def heartbeater(k: int) -> None:
            i = k
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                r = await http.post(f"/v1/instances/{ids[i % len(ids)]}/heartbeat")
                r.raise_for_status()
                lat["heartbeat"].append(time.perf_counter() - t0)
                i += args.heartbeaters

        await asyncio.gather(
            *(assigner(k) for k in range(args.clients)), *(heartbeater(k) for k in range(args.heartbeaters))
        )
    return lat


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))] * 1000


def run(args: argparse.Namespace) -> int:
    """Start a planner process, load it, print and optionally save the table."""
    import httpx
    from rich.console import Console
    from rich.table import Table

    url, cleanup = _fresh_db(args.db)
    port = _free_port()
    env = {**os.environ, "RFORK_DB_POOL_SIZE": str(max(8, args.clients // 2))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rfork", "planner", "serve", "--db", url, "--port", str(port), "--insecure"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"planner exited: {proc.stderr.read().decode()[-500:] if proc.stderr else ''}"
                )
            try:
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("planner did not start")
            time.sleep(0.1)
        lat = asyncio.run(_load(base, args))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        cleanup()
    db_kind = "sqlite" if url.startswith("sqlite") else url.split("+")[0].split(":")[0]
    rows: list[dict[str, Any]] = []
    for name in ("assignment", "report", "heartbeat", "busy", "register"):
        xs = lat[name]
        secs = args.seconds if name != "register" else None
        rows.append(
            {
                "endpoint": name,
                "count": len(xs),
                "req_per_s": (len(xs) / secs) if secs else None,
                "p50_ms": _pct(xs, 50),
                "p99_ms": _pct(xs, 99),
            }
        )
    table = Table(
        title=f"rfork bench planner — {db_kind}, {args.instances} instances, {args.clients} clients, "
        f"{args.heartbeaters} heartbeaters, {args.seconds:.0f} s, {os.cpu_count()} cores"
    )
    for col in ("endpoint", "requests", "req/s", "p50 ms", "p99 ms"):
        table.add_column(col, justify="right" if col != "endpoint" else "left")
    for r in rows:
        table.add_row(
            r["endpoint"] if r["endpoint"] != "busy" else "assignment (429 busy)",
            str(r["count"]),
            f"{r['req_per_s']:.0f}" if r["req_per_s"] is not None else "-",
            f"{r['p50_ms']:.1f}",
            f"{r['p99_ms']:.1f}",
        )
    Console().print(table)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "db": db_kind,
                    "instances": args.instances,
                    "clients": args.clients,
                    "heartbeaters": args.heartbeaters,
                    "seconds": args.seconds,
                    "cpus": os.cpu_count(),
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0
