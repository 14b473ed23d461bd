"""Planner load: 1,000 heartbeating instances while N clients request assignments and report transfers."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.processes import free_port


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: --db, --clients, --instances, --seconds, --json."""
    parser.add_argument(
        "--db",
        default=None,
        help="SQLAlchemy URL; PostgreSQL gets a fresh database on that "
        "server (default: a temporary SQLite file)",
    )
    parser.add_argument(
        "--clients",
        type=int,
        default=32,
        help="concurrent assignment clients (default 32; 0: heartbeats only)",
    )
    parser.add_argument(
        "--heartbeaters",
        type=int,
        default=64,
        help="concurrent heartbeat senders (default 64; 0: assignments only)",
    )
    parser.add_argument("--instances", type=int, default=1000, help="registered instances (default 1000)")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured duration (default 15)")
    parser.add_argument("--workers", type=int, default=1, help="planner server processes (default 1)")
    parser.add_argument("--json", default=None, help="write the results to this file")


def _fresh_db(url: str | None) -> tuple[str, Any]:
    """A fresh database URL and a cleanup function."""
    if url is None or url.startswith("sqlite"):
        import shutil

        tmp = tempfile.mkdtemp(prefix="rfork-bench-")
        return f"sqlite:///{tmp}/planner.db", lambda: shutil.rmtree(tmp, ignore_errors=True)
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
    "origin": "disk",  # the same digests everywhere: the first anchors the identity, the rest match
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


class _Conn:
    """A minimal HTTP/1.1 keep-alive client over asyncio streams: the load generator shares the two
    cores with the server, and httpx costs several times more CPU per request than this."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(
            f"{method} {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding":
                raise RuntimeError("chunked responses are not expected from the planner")
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _check(what: str, status: int, body: bytes, *ok: int) -> None:
    if status not in ok:
        raise RuntimeError(f"{what}: HTTP {status} {body[:200]!r}")


async def _load(
    host: str, port: int, args: argparse.Namespace, server_cpu: Any
) -> tuple[dict[str, list[float]], float, float, float]:
    """Register, then run the closed loops; latencies per endpoint and the client's CPU seconds."""
    models = max(1, args.instances // 10)
    lat: dict[str, list[float]] = {
        "register": [],
        "assignment": [],
        "report": [],
        "heartbeat": [],
        "busy": [],
    }
    ids: list[str] = []
    manifest = json.dumps(MANIFEST).encode()
    ready = json.dumps({"status": "READY"}).encode()

    async def register(conn: _Conn, i: int) -> None:
        body = {
            "identity": _identity(i % models),
            "labels": {"node": f"n{i % 50}", "rack": f"r{i % 10}", "zone": f"z{i % 2}"},
            "ranks": [{"rank": 0, "provider": "tcp", "address": "YWRkcg==", "backends": ["tcp", "nccl"]}],
            "max_concurrent_pulls": 4,
        }
        st, out = await conn.request("POST", "/v1/instances", json.dumps(body).encode())
        _check("register", st, out, 201)
        iid = json.loads(out)["id"]
        st, out = await conn.request("PUT", f"/v1/instances/{iid}/manifests/0", manifest)
        _check("manifest", st, out, 204)
        st, out = await conn.request("POST", f"/v1/instances/{iid}/status", ready)
        _check("status", st, out, 200)
        ids.append(iid)

    todo = iter(range(args.instances))

    async def registrar() -> None:
        conn = _Conn(host, port)
        for i in todo:
            t0 = time.perf_counter()
            await register(conn, i)
            lat["register"].append(time.perf_counter() - t0)
        await conn.close()

    await asyncio.gather(*(registrar() for _ in range(16)))
    rng = random.Random(0)
    bodies = [
        [
            json.dumps(
                {
                    "identity": _identity(m),
                    "rank": 0,
                    "labels": {"node": f"n{k}", "rack": f"r{k % 10}"},
                    "providers": ["tcp"],
                    "backends": ["nccl"],
                    "requester_id": None,
                }
            ).encode()
            for m in range(models)
        ]
        for k in range(args.clients)
    ]
    report = json.dumps({"outcome": "success", "bytes": 1 << 30, "seconds": 0.5, "backend": "tcp"}).encode()
    cpu0, scpu0, start = time.process_time(), server_cpu(), time.perf_counter()
    stop = start + args.seconds

    async def assigner(k: int) -> None:
        conn = _Conn(host, port)
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            st, out = await conn.request("POST", "/v1/assignments", bodies[k][rng.randrange(models)])
            t1 = time.perf_counter()
            if st == 429:
                lat["busy"].append(t1 - t0)
                continue
            _check("assignment", st, out, 201)
            lat["assignment"].append(t1 - t0)
            lease = out[8:40].decode()  # '{"id": "<32 hex>", ...' (asserted below)
            if out[:8] != b'{"id": "':
                lease = json.loads(out)["id"]
            t0 = time.perf_counter()
            st, out = await conn.request("POST", f"/v1/assignments/{lease}/report", report)
            _check("report", st, out, 200)
            lat["report"].append(time.perf_counter() - t0)
        await conn.close()

    async def heartbeater(k: int) -> None:
        conn = _Conn(host, port)
        i = k
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            st, out = await conn.request("POST", f"/v1/instances/{ids[i % len(ids)]}/heartbeat")
            _check("heartbeat", st, out, 200)
            lat["heartbeat"].append(time.perf_counter() - t0)
            i += args.heartbeaters
        await conn.close()

    await asyncio.gather(
        *(assigner(k) for k in range(args.clients)), *(heartbeater(k) for k in range(args.heartbeaters))
    )
    elapsed = time.perf_counter() - start
    return lat, time.process_time() - cpu0, server_cpu() - scpu0, elapsed


def _cpu_s(pid: int) -> float:
    """User+system CPU seconds of a process and its children that exited (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and its live children (uvicorn workers)."""
    total = _cpu_s(pid)
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    return total + sum(_cpu_s(int(k)) for k in kids)


def _pct(xs: list[float], p: float) -> float | None:
    """The p-th percentile in ms; None (JSON null, "-" in the table) when nothing was measured."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))] * 1000


def run(args: argparse.Namespace) -> int:
    """Start a planner process, load it, print and optionally save the table."""
    import httpx
    from rich.console import Console
    from rich.table import Table

    url, cleanup = _fresh_db(args.db)
    port = free_port()
    # an --insecure server of its own: tokens in the caller's environment would turn auth on for the
    # server while the load generator sends none (every request a 401)
    env = {k: v for k, v in os.environ.items() if not (k.startswith("RFORK_") and k.endswith("_TOKEN"))}
    env["RFORK_DB_POOL_SIZE"] = str(max(8, args.clients // 2))
    # Registering 10,000 instances takes minutes, longer than the heartbeat TTL: with the default TTL
    # (and --heartbeaters 0) the reaper would mark all but the last registered STALE and assignments
    # would rank one or two live seeds per identity, or none (404). Every instance stays live instead;
    # a heartbeat costs the same whatever the TTL.
    env["RFORK_HEARTBEAT_TTL_S"] = "3600"
    # The server's log goes to a file: a pipe nobody reads fills up (64 KiB, ~600 "registered" lines)
    # and then every thread blocks in logging's handler lock -- the registration stall seen before.
    log_file = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    cmd = [sys.executable, "-m", "rfork", "planner", "serve", "--db", url, "--port", str(port), "--insecure"]
    proc = subprocess.Popen(
        [*cmd, "--workers", str(args.workers)], stdout=subprocess.DEVNULL, stderr=log_file, env=env
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                log_file.seek(0)
                raise RuntimeError(f"planner exited: {log_file.read().decode()[-500:]}")
            try:
                if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("planner did not start")
            time.sleep(0.1)
        lat, client_cpu, server_cpu, elapsed = asyncio.run(
            _load("127.0.0.1", port, args, lambda: _tree_cpu_s(proc.pid))
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_file.close()
        cleanup()
    db_kind = "sqlite" if url.startswith("sqlite") else url.split("+")[0].split(":")[0]
    rows: list[dict[str, Any]] = []
    for name in ("assignment", "report", "heartbeat", "busy", "register"):
        xs = lat[name]
        secs = elapsed if name != "register" else None
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
            f"{r['p50_ms']:.1f}" if r["p50_ms"] is not None else "-",
            f"{r['p99_ms']:.1f}" if r["p99_ms"] is not None else "-",
        )
    Console().print(table)
    served = sum(r["count"] for r in rows if r["endpoint"] != "register")
    per_request_ms = server_cpu / served * 1000 if served else None
    print(
        f"CPU over the {elapsed:.1f} s window: server {server_cpu:.1f} s"
        f" ({server_cpu / elapsed:.0%} of one core"
        + (f", {per_request_ms:.3f} ms per request" if per_request_ms is not None else "")
        + f"), load generator {client_cpu:.1f} s ({client_cpu / elapsed:.0%}); {os.cpu_count()} cores in all"
    )
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
                    "workers": args.workers,
                    "elapsed_s": elapsed,
                    "server_cpu_s": server_cpu,
                    # server CPU over the window / requests answered in it (--clients 0 or --heartbeaters 0
                    # give one endpoint's cost)
                    "server_cpu_ms_per_request": per_request_ms,
                    "client_cpu_s": client_cpu,
                    "rows": rows,
                },
                indent=2,
                allow_nan=False,  # a NaN is not JSON; missing figures are null
            )
        )
    return 0
