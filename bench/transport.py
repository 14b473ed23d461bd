"""Transport benchmark: GB/s of the TransferEngine by op and size against a same-run baseline.

Baselines, both with the engine's op size and working set: for tcp, Python socket sendall ->
recv_into over loopback, the receiver walking a pre-faulted 64 MiB buffer op by op as the reads do;
for shm, one memcpy per op from shared memory into a distinct buffer across the same 64 MiB. A second
table reads into *fresh* (never touched) memory, as a new instance's first pull does, against a
socket recv_into (tcp) or a memcpy (shm) into fresh memory. A peer engine runs in a spawned process;
numbers are GB/s (10^9 bytes per second).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import socket
import statistics
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

from bench import small_ops

log = logging.getLogger(__name__)

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
PAGE_SIZES = [4 * KiB, 64 * KiB, 1 * MiB]
REGION = 64 * MiB


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: provider, sizes, domains, JSON output."""
    parser.add_argument("--provider", choices=["tcp", "shm"], default="tcp")
    parser.add_argument(
        "--sizes",
        type=_size_list,
        default=DEFAULT_SIZES,
        help="comma-separated op sizes, e.g. 4K,64K,1M,64M (default 4K..64M)",
    )
    parser.add_argument("--domains", type=int, default=1, help="domains (parallel endpoints) per engine")
    parser.add_argument("--seconds", type=float, default=0.3, help="rough time per measurement")
    parser.add_argument("--json", dest="json_file", default=None, help="write the rows to this JSON file")


def _size_list(text: str) -> list[int]:
    units = {"K": KiB, "M": MiB, "G": 1 << 30}
    out = []
    for part in text.split(","):
        part = part.strip().upper().removesuffix("B").removesuffix("I")
        mult = units.get(part[-1:], 1)
        value = int(part[:-1] if part[-1:] in units else part) * mult
        if not 0 < value <= REGION:
            raise argparse.ArgumentTypeError(f"size {part} must be between 1 byte and 64 MiB")
        out.append(value)
    return out


def _peer_main(conn: Connection, provider: str, domains: int, region: int = REGION) -> None:
    """Passive peer: a readable and a writable region of `region` bytes; serves until told to exit."""
    import numpy as np

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends import TransferEngine

    os.environ.setdefault("FI_TCP_IFACE", "lo")
    kw: dict[str, Any] = {"host": "127.0.0.1"} if provider == "tcp" else {}
    with TransferEngine(provider, domains, **kw) as eng:
        src = np.ones(region, dtype=np.uint8)
        dst = np.zeros(region, dtype=np.uint8)
        dst.fill(0)  # fault the pages in now: the first timed writes should not pay for that
        rs, rd = eng.register(src, "read"), eng.register(dst, "write")
        conn.send((rs.descriptor.to_bytes(), rd.descriptor.to_bytes()))
        conn.recv()


def _socket_sink(port_conn: Connection, chunk: int, fresh: bool) -> None:
    """Receiver for the socket baseline: recv_into until the sender closes, op by op across a 64 MiB
    pre-faulted working set as the engine's reads land (fresh: one never-touched buffer, in order)."""
    import numpy as np

    srv = socket.create_server(("127.0.0.1", 0))
    port_conn.send(srv.getsockname()[1])
    total_wanted = port_conn.recv()
    if fresh:
        buf = np.empty(total_wanted, dtype=np.uint8)  # untouched: every page faults inside recv_into
        slots = 1
    else:
        buf = np.ones(REGION, dtype=np.uint8)  # touched: no page faults inside the timing
        slots = max(1, REGION // chunk)
    view = memoryview(buf.data).cast("B")
    cli, _ = srv.accept()
    total = 0
    op = 0
    while True:
        base = total if fresh else (op % slots) * chunk
        got = 0
        while got < chunk:
            n = cli.recv_into(view[base + got : base + chunk])
            if n == 0:
                break
            got += n
        total += got
        op += 1
        if got < chunk:
            break
    port_conn.send(total)
    cli.close()
    srv.close()


def _socket_baseline(size: int, total: int, *, fresh: bool = False) -> float:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    reps = max(1, total // size)
    proc = ctx.Process(target=_socket_sink, args=(b, size, fresh), daemon=True)
    proc.start()
    port = a.recv()
    a.send(reps * size)
    data = memoryview(bytearray(size))
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    for _ in range(reps):
        s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    a.recv()
    dt = time.perf_counter() - t0
    s.close()
    proc.join(10)
    return reps * size / dt / 1e9


def _memcpy_baseline(size: int, total: int) -> float:
    """One memcpy per op from shared memory into a distinct buffer, across a 64 MiB working set.

    The ops copy `size` bytes at offset (i % slots) * size of a 64 MiB region, so the baseline does
    the same: copying one small buffer over and over would measure the CPU cache, not memory.
    """
    from multiprocessing import shared_memory

    import numpy as np

    shm = shared_memory.SharedMemory(create=True, size=REGION)
    try:
        src = np.ndarray((REGION,), dtype=np.uint8, buffer=shm.buf)
        src[:] = 1
        dst = np.zeros(REGION, dtype=np.uint8)  # touched: no page faults inside the timing
        slots = REGION // size
        reps = max(slots, total // size)
        t0 = time.perf_counter()
        for i in range(reps):
            o = (i % slots) * size
            np.copyto(dst[o : o + size], src[o : o + size])
        dt = time.perf_counter() - t0
        del src
        return reps * size / dt / 1e9
    finally:
        shm.close()
        shm.unlink()


def _memcpy_fresh(size: int, total: int) -> float:
    """memcpy of `total` bytes, op by op, from shared memory into a fresh (never touched) buffer."""
    from multiprocessing import shared_memory

    import numpy as np

    shm = shared_memory.SharedMemory(create=True, size=REGION)
    try:
        src = np.ndarray((REGION,), dtype=np.uint8, buffer=shm.buf)
        src[:] = 1
        dst = np.empty(total, dtype=np.uint8)
        slots = REGION // size
        t0 = time.perf_counter()
        for i in range(total // size):
            o = (i % slots) * size
            np.copyto(dst[i * size : (i + 1) * size], src[o : o + size])
        dt = time.perf_counter() - t0
        del src
        return total / dt / 1e9
    finally:
        shm.close()
        shm.unlink()


def _engine_fresh(eng: Any, src: Any, size: int, total: int) -> float:
    """Engine reads of `size` into a fresh (never touched) buffer, registration included."""
    import numpy as np

    dst = np.empty(total, dtype=np.uint8)
    slots = REGION // size
    t0 = time.perf_counter()
    reg = eng.register(dst, "rw")
    futs = [eng.read(reg, i * size, size, src, (i % slots) * size) for i in range(total // size)]
    for f in futs:
        f.result(120)
    dt = time.perf_counter() - t0
    eng.deregister(reg)
    return total / dt / 1e9


def start_peer(provider: str, domains: int = 1, region: int = REGION) -> tuple[Any, Connection, bytes, bytes]:
    """A passive peer engine in a spawned process: (process, pipe, readable desc, writable desc)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=_peer_main, args=(child, provider, domains, region), daemon=True)
    peer.start()
    if not parent.poll(60 + region / 1e8):  # the peer touches its regions first
        peer.kill()
        raise RuntimeError("benchmark peer did not start")
    src_b, dst_b = parent.recv()
    return peer, parent, src_b, dst_b


def stop_peer(peer: Any, conn: Connection) -> None:
    if peer.is_alive():
        with contextlib.suppress(OSError):
            conn.send("exit")
        peer.join(10)
    if peer.is_alive():
        peer.kill()


def large_read_gbps(
    provider: str,
    *,
    op_bytes: int = 8 * MiB,
    total: int = 1 << 30,
    inflight: int = 8,
    domains: int = 1,
    working_set: int = REGION,
    local_huge_pages: bool = True,
    passes: int = 1,
) -> float:
    """The transport's own large-read GB/s: `op_bytes` reads, `inflight` at a time (the loader's
    defaults), `total` bytes from a peer process's `working_set`-byte region into a pre-faulted local
    region of the same size (the reads cycle through it when `total` is larger).

    Both regions are numpy arrays, which get transparent huge pages, as rfork's own buffers do
    (`rfork.weights.memory`); local_huge_pages=False reads into a torch tensor instead (4 KiB pages, as a
    framework's own parameters). With passes > 1, the median pass."""
    import numpy as np

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends import MemoryRegionDescriptor, TransferEngine

    if working_set < op_bytes or working_set % op_bytes:
        raise ValueError(f"working_set {working_set} must be a multiple of op_bytes {op_bytes}")
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    peer, conn, src_b, _ = start_peer(provider, domains, working_set)
    try:
        src = MemoryRegionDescriptor.from_bytes(src_b)
        kw: dict[str, Any] = {"host": "127.0.0.1"} if provider == "tcp" else {}
        with TransferEngine(provider, domains, **kw) as eng:
            if local_huge_pages:
                buf: Any = np.ones(working_set, dtype=np.uint8)  # touched: no faults inside the timing
            else:
                import torch

                buf = torch.ones(working_set, dtype=torch.uint8)
            reg = eng.register(buf, "rw")
            slots = working_set // op_bytes
            pending: deque[Any] = deque()

            def pass_of(count: int) -> float:
                t0 = time.perf_counter()
                for i in range(count):
                    if len(pending) >= inflight:
                        pending.popleft().result(120)
                    o = (i % slots) * op_bytes
                    pending.append(eng.read(reg, o, op_bytes, src, o))
                while pending:
                    pending.popleft().result(120)
                return time.perf_counter() - t0

            pass_of(min(slots, 2 * inflight))  # connect and warm up
            count = max(1, total // op_bytes)
            return statistics.median(count * op_bytes / pass_of(count) / 1e9 for _ in range(passes))
    finally:
        stop_peer(peer, conn)


def _timed(fn: Any, count: int) -> float:
    t0 = time.perf_counter()
    futs = [fn(i) for i in range(count)]
    for f in futs:
        f.result(120)
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    """Run every op at every size, print a table, optionally write JSON."""
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    from backends import MemoryRegionDescriptor, TransferEngine

    os.environ.setdefault("FI_TCP_IFACE", "lo")
    provider: str = args.provider
    peer, parent, src_b, dst_b = start_peer(provider, args.domains)
    rows: list[dict[str, Any]] = []
    fresh_rows: list[dict[str, Any]] = []
    lat: list[float] = []
    small: dict[str, Any] = {}
    try:
        src, dst = MemoryRegionDescriptor.from_bytes(src_b), MemoryRegionDescriptor.from_bytes(dst_b)
        kw: dict[str, Any] = {"host": "127.0.0.1"} if provider == "tcp" else {}
        with TransferEngine(provider, args.domains, **kw) as eng:
            buf = np.ones(REGION, dtype=np.uint8)
            reg = eng.register(buf, "rw")
            budget = 2 * 10**9 * args.seconds  # bytes per measurement at ~2 GB/s
            baselines: dict[int, float] = {}
            for size in sorted(set(args.sizes) | set(PAGE_SIZES)):
                total = int(max(size, min(budget, 256 * MiB)))
                baselines[size] = (
                    _socket_baseline(size, total) if provider == "tcp" else _memcpy_baseline(size, total)
                )
            eng.read(reg, 0, 4096, src, 0).result(30)  # connect
            for size in args.sizes:
                count = int(max(4, min(budget // size, 4096)))
                slots = REGION // size

                def op_read(i: int, size: int = size, slots: int = slots) -> Any:
                    o = (i % slots) * size
                    return eng.read(reg, o, size, src, o)

                def op_write(i: int, size: int = size, slots: int = slots) -> Any:
                    o = (i % slots) * size
                    return eng.write(reg, o, size, dst, o)

                def op_write_imm(i: int, size: int = size, slots: int = slots) -> Any:
                    o = (i % slots) * size
                    return eng.write(reg, o, size, dst, o, imm=1)

                for name, fn in (("write", op_write), ("write_imm", op_write_imm), ("read", op_read)):
                    _timed(fn, min(count, 8))  # warm-up
                    dt = _timed(fn, count)
                    rows.append(_row(name, size, count * size / dt / 1e9, baselines[size]))
            rng = np.random.default_rng(0)
            for page in PAGE_SIZES:
                npages = REGION // (2 * page)
                sp = rng.permutation(npages).tolist()
                dp = rng.permutation(npages).tolist()
                reps = int(max(1, budget // (npages * page)))

                def op_paged(_i: int, page: int = page, sp: list[int] = sp, dp: list[int] = dp) -> Any:
                    return eng.write_paged(reg, sp, 2 * page, dst, dp, 2 * page, page)

                _timed(op_paged, 1)
                dt = _timed(op_paged, reps)
                rows.append(_row("paged_write", page, reps * npages * page / dt / 1e9, baselines[page]))
            for _ in range(1000):
                t0 = time.perf_counter()
                eng.read(reg, 0, 64, src, 0).result(10)
                lat.append(time.perf_counter() - t0)
            fresh_total = 256 * MiB  # 256 reads of 1 MiB into memory nobody touched yet
            base = (
                _socket_baseline(MiB, fresh_total, fresh=True)
                if provider == "tcp"
                else _memcpy_fresh(MiB, fresh_total)
            )
            fresh_rows.append(
                _row("read (fresh memory)", MiB, _engine_fresh(eng, src, MiB, fresh_total), base)
            )
            small = small_ops.measure(eng, reg, src, dst, provider, seconds=args.seconds)
    finally:
        stop_peer(peer, parent)
    lat.sort()
    p50, p99 = statistics.median(lat) * 1e6, lat[int(len(lat) * 0.99) - 1] * 1e6
    base_name = "socket sendall->recv_into" if provider == "tcp" else "shared-memory memcpy"
    table = Table(
        title=f"rfork transport, provider={provider}, domains={args.domains} (GB/s; baseline: {base_name})"
    )
    for col in ("op", "size", "GB/s", "baseline GB/s", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["op"],
            _fmt_size(r["size_bytes"]),
            f"{r['gb_per_s']:.2f}",
            f"{r['baseline_gb_per_s']:.2f}",
            f"{r['ratio']:.2f}",
        )
    console = Console()
    console.print(table)
    fresh_base = "socket recv_into" if provider == "tcp" else "memcpy"
    for r in fresh_rows:
        console.print(
            f"into fresh memory, 256 reads of 1 MiB (registration included): {r['gb_per_s']:.2f} GB/s "
            f"against {fresh_base} into fresh memory {r['baseline_gb_per_s']:.2f} GB/s: "
            f"ratio {r['ratio']:.2f}"
        )
    console.print(f"small-op (64 B read) latency: p50 {p50:.0f} us, p99 {p99:.0f} us")
    for line in small_ops.report_lines(small):
        console.print(line)
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(
                {
                    "provider": provider,
                    "domains": args.domains,
                    "rows": rows,
                    "fresh_memory": fresh_rows,
                    "latency_us": {"p50": p50, "p99": p99},
                    "small_ops": small,
                },
                f,
                indent=1,
                allow_nan=False,
            )
    return 0


def _row(op: str, size: int, gbps: float, base: float) -> dict[str, Any]:
    return {
        "op": op,
        "size_bytes": size,
        "gb_per_s": round(gbps, 3),
        "baseline_gb_per_s": round(base, 3),
        "ratio": round(gbps / base, 3) if base else 0.0,
    }


def _fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"
