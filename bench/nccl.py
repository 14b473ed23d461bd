"""NCCL/gloo fallback benchmark: a 1 GiB pull between two processes on loopback against a raw socket.

The seed side (a spawned process) streams with `backends.nccl.send_tensors`, this process receives
with `recv_tensors`; the stream phase (header to completion ack) and the group set-up are timed
separately, medians over the repeats. The baseline, in the same run: one TCP socket moving the same
bytes between two processes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MiB = 1 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    """Options: size, repeats, JSON output."""
    parser.add_argument("--size-mib", type=int, default=1024, help="bytes per pull, MiB (default 1024)")
    parser.add_argument(
        "--repeat",
        "--repeats",
        dest="repeats",
        type=int,
        default=3,
        help="pulls per figure; the median is shown",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")


def run(args: argparse.Namespace) -> int:
    """Measure and print one table row per transport."""
    res = bench_loopback(args.size_mib << 20, repeats=args.repeats)
    print(f"{'transport':<12} {'seconds':>8} {'GB/s':>7}")
    print(f"{'gloo':<12} {res.gloo_seconds:8.3f} {res.gloo_gbps:7.2f}   (set-up {res.setup_seconds:.3f} s)")
    print(f"{'tcp socket':<12} {res.nbytes / res.socket_gbps / 1e9:8.3f} {res.socket_gbps:7.2f}")
    print(f"gloo / socket: {res.gloo_gbps / res.socket_gbps:.2f}")
    if args.json:
        args.json.write_text(json.dumps(asdict(res), allow_nan=False, indent=1))
    return 0


@dataclass(frozen=True)
class LoopbackBench:
    """Median figures of moving ``nbytes`` between two processes on 127.0.0.1 (GB/s = 1e9 B/s)."""

    nbytes: int
    repeats: int
    gloo_seconds: float
    gloo_gbps: float
    setup_seconds: float
    socket_gbps: float


def _bench_sender(port: int, nbytes: int, bucket_bytes: int, max_in_flight: int, repeats: int) -> None:
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    import torch

    from backends.nccl import connect_rendezvous, send_tensors

    payload = [torch.ones(nbytes, dtype=torch.uint8)]
    for r in range(repeats):
        store = connect_rendezvous("127.0.0.1", port, timeout_s=30.0)
        send_tensors(
            store,
            payload,
            session_id=f"bench{r}",
            local_host="127.0.0.1",
            timeout_s=30.0,
            peer="bench receiver",
            bucket_bytes=bucket_bytes,
            max_in_flight=max_in_flight,
        )


def _socket_sender(port: int, nbytes: int, chunk: int) -> None:
    data = memoryview(bytearray(chunk))
    with socket.create_connection(("127.0.0.1", port), timeout=30.0) as conn:
        left = nbytes
        while left:
            n = min(chunk, left)
            conn.sendall(data[:n])
            left -= n


def _socket_seconds(nbytes: int, chunk: int = 1 << 20) -> float:
    ctx = multiprocessing.get_context("spawn")
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        proc = ctx.Process(target=_socket_sender, args=(srv.getsockname()[1], nbytes, chunk), daemon=True)
        proc.start()
        try:
            srv.settimeout(60.0)
            conn, _ = srv.accept()
            with conn:
                buf = memoryview(bytearray(chunk))
                left = nbytes
                t0 = time.perf_counter()
                while left:
                    got = conn.recv_into(buf, min(chunk, left))
                    if not got:
                        raise ConnectionError("bench socket sender closed early")
                    left -= got
                return time.perf_counter() - t0
        finally:
            proc.join(30.0)
            if proc.is_alive():
                proc.kill()


def bench_loopback(
    nbytes: int = 1 << 30, *, repeats: int = 3, bucket_bytes: int = 64 * MiB, max_in_flight: int = 3
) -> LoopbackBench:
    """Measure a gloo pull of ``nbytes`` from a spawned sender process, and a raw socket of the same size.

    ``gloo_seconds`` is the stream phase (header to completion ack); ``setup_seconds`` the group setup,
    both medians over ``repeats``. The raw-socket figure is the baseline measured in the same run.
    """
    # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
    import torch

    from backends.nccl import Rendezvous, recv_tensors

    ctx = multiprocessing.get_context("spawn")
    rdv = Rendezvous(host="127.0.0.1", timeout_s=60.0)
    dest = [torch.empty(nbytes, dtype=torch.uint8)]
    proc = ctx.Process(
        target=_bench_sender, args=(rdv.port, nbytes, bucket_bytes, max_in_flight, repeats), daemon=True
    )
    proc.start()
    stream: list[float] = []
    setup: list[float] = []
    try:
        assert rdv.store is not None
        for r in range(repeats):
            timings: dict[str, float] = {}
            recv_tensors(
                rdv.store,
                dest,
                session_id=f"bench{r}",
                local_host="127.0.0.1",
                timeout_s=60.0,
                peer="bench sender",
                max_in_flight=max_in_flight,
                timings=timings,
            )
            stream.append(timings["stream_s"])
            setup.append(timings["setup_s"])
    finally:
        proc.join(60.0)
        if proc.is_alive():
            proc.kill()
        rdv.close()
    sock = sorted(_socket_seconds(nbytes) for _ in range(repeats))[repeats // 2]
    med = sorted(stream)[repeats // 2]
    return LoopbackBench(
        nbytes=nbytes,
        repeats=repeats,
        gloo_seconds=med,
        gloo_gbps=nbytes / med / 1e9,
        setup_seconds=sorted(setup)[repeats // 2],
        socket_gbps=nbytes / sock / 1e9,
    )
