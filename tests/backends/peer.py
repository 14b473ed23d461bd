"""A peer engine in its own (spawned) process, driven over a multiprocessing pipe by the tests."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import xxhash


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic random bytes both sides can regenerate; a shorter one is a prefix of a longer one."""
    words = np.random.default_rng(seed).integers(0, 2**64, -(-nbytes // 8), dtype=np.uint64, endpoint=False)
    return words.view(np.uint8)[:nbytes]


def digest(a: np.ndarray) -> str:
    """XXH3-128 of a contiguous array's bytes, hashed in place (copying 1 GiB costs seconds here)."""
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(a).data)


def engine_kwargs(provider: str) -> dict[str, Any]:
    return {"host": "127.0.0.1"} if provider == "tcp" else {}


def serve(
    conn: Connection, provider: str, domains: int, regions: list[tuple[str, int, str]], reorder: bool
) -> None:
    """Open an engine, register `regions` (name, nbytes, access; "src" ones hold pattern(1)), then obey.

    Channels open on first use by name; what each receives is kept for the "inbox" command.
    """
    os.environ.setdefault("FI_TCP_IFACE", "lo")
    from backends import Channel, MemoryRegionDescriptor, Message, TransferEngine, TransferError

    eng = TransferEngine(
        provider, domains, timeout_s=8.0, reorder_for_test=reorder, **engine_kwargs(provider)
    )
    bufs: dict[str, np.ndarray] = {}
    regs = {}
    for name, nbytes, access in regions:
        bufs[name] = pattern(1, nbytes) if name.startswith("src") else np.zeros(nbytes, dtype=np.uint8)
        regs[name] = eng.register(bufs[name], access)
    conn.send((eng.address, {n: r.descriptor.to_bytes() for n, r in regs.items()}))
    pending_expects = {}
    channels: dict[str, Channel] = {}
    inbox: dict[str, list[tuple[str, bytes, bytes]]] = {}

    def channel(name: str, imms: int = 0) -> Channel:
        if name not in channels:
            inbox[name] = []
            channels[name] = eng.channel(name, imms=imms)

            def keep(m: Message, box: list[tuple[str, bytes, bytes]] = inbox[name]) -> None:
                box.append((m.kind, m.data, m.sender))

            channels[name].on_message(keep)
        return channels[name]

    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "exit":
                break
            try:
                if cmd == "digest":
                    name, off, n = args
                    conn.send(digest(bufs[name][off : off + n]))
                elif cmd == "fill":
                    name, seed = args
                    bufs[name][:] = pattern(seed, len(bufs[name]))
                    conn.send(True)
                elif cmd == "write":  # (name, off, n, desc, roff, imm)
                    name, off, n, desc, roff, imm = args
                    eng.write(
                        regs[name], off, n, MemoryRegionDescriptor.from_bytes(desc), roff, imm=imm
                    ).result(30)
                    conn.send(True)
                elif cmd == "write_imms":  # list of imm values, each as its own write_imm
                    (imms, desc) = args
                    d = MemoryRegionDescriptor.from_bytes(desc)
                    for f in [eng.write_imm(i, d) for i in imms]:
                        f.result(30)
                    conn.send(True)
                elif cmd == "expect":
                    key, imm, count = args
                    pending_expects[key] = eng.expect(imm, count)
                    conn.send(True)
                elif cmd == "wait_expect":
                    key, timeout = args
                    try:
                        pending_expects.pop(key).result(timeout)
                        conn.send(True)
                    except TimeoutError:
                        conn.send(False)
                elif cmd == "channel":  # (name, imms) -> its immediate range [base, count]
                    name, imms = args
                    conn.send(channel(name, imms).imms.to_json())
                elif cmd == "send":  # (address, channel name, kind, data)
                    addr, name, kind, data = args
                    channel(name).send(addr, kind, data).result(10)
                    conn.send(True)
                elif cmd == "send_raw":  # (address, frame): anything, framed or not
                    addr, data = args
                    eng.send(addr, data).result(10)
                    conn.send(True)
                elif cmd == "inbox":  # (channel name, count, timeout) -> what it received, once count arrived
                    name, count, timeout = args
                    channel(name)
                    deadline = time.monotonic() + timeout
                    while len(inbox[name]) < count and time.monotonic() < deadline:
                        time.sleep(0.01)
                    conn.send(list(inbox[name]))
                else:
                    conn.send(f"unknown command {cmd}")
            except TransferError as exc:
                conn.send(f"error: {exc}")
    finally:
        eng.close()
