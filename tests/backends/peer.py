"""A peer engine in its own process, driven over a multiprocessing pipe by the tests; and the helpers
both sides use for test data (patterns, digests, buffers)."""

from __future__ import annotations

import contextlib
import mmap
import os
from array import array
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import xxhash

from tests.waiting import wait_until


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """Deterministic random bytes both sides can regenerate; a shorter one is a prefix of a longer one."""
    words = np.random.default_rng(seed).integers(0, 2**64, -(-nbytes // 8), dtype=np.uint64, endpoint=False)
    return words.view(np.uint8)[:nbytes]


def host_buffer(nbytes: int, seed: int | None = None) -> np.ndarray:
    """nbytes of zeros (or of pattern(seed)) in memory advised to use huge pages.

    The first touch of memory dominates tests that move GiBs on this VM; huge pages make it cheaper.
    A pattern is drawn in slices straight into the buffer: the same bytes as pattern(seed, nbytes).
    """
    area = mmap.mmap(-1, max(nbytes, 1))
    area.madvise(mmap.MADV_HUGEPAGE)
    buf = np.frombuffer(area, dtype=np.uint8)[:nbytes]
    if seed is not None:
        rng, step = np.random.default_rng(seed), 16 << 20  # 64-bit draws continue across slices
        for off in range(0, nbytes, step):
            n = min(step, nbytes - off)
            words = rng.integers(0, 2**64, -(-n // 8), dtype=np.uint64, endpoint=False)
            buf[off : off + n] = words.view(np.uint8)[:n]
    return buf


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
        bufs[name] = host_buffer(nbytes, 1 if name.startswith("src") else None)
        regs[name] = eng.register(bufs[name], access)
    conn.send((eng.address, {n: r.descriptor.to_bytes() for n, r in regs.items()}))
    pending_expects = {}
    channels: dict[str, Channel] = {}
    inbox: dict[str, list[tuple[str, bytes, bytes]]] = {}
    keys: dict[str, bytes] = {}
    opened: list[tuple[str, str, bytes]] = []  # every frame the sessions opened, admitted or not

    def channel(name: str, imms: int = 0) -> Channel:
        if name not in channels:
            inbox[name] = []
            channels[name] = eng.channel(name, imms=imms, key=keys.get(name))

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
                elif cmd == "read":  # (name, off, n, desc, roff) -> the bytes read
                    name, off, n, desc, roff = args
                    eng.read(regs[name], off, n, MemoryRegionDescriptor.from_bytes(desc), roff).result(30)
                    conn.send(bufs[name][off : off + n].tobytes())
                elif cmd == "key":  # (channel name, set-up key): that channel opens with the key
                    name, key = args
                    keys[name] = key
                    conn.send(True)
                elif cmd == "watch":  # keep every frame opened from now on: what this peer can read
                    sessions = eng._hub().sessions
                    real_receive = sessions.receive

                    def watch(frame: bytes, receive: Any = real_receive) -> Any:
                        got = receive(frame)
                        if got is not None:
                            opened.append((got.name, got.kind, got.data))
                        return got

                    sessions.receive = watch  # type: ignore[method-assign]
                    conn.send(True)
                elif cmd == "opened":  # -> the frames kept since "watch"
                    conn.send(list(opened))
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
                elif cmd == "send_captured":  # like send, and returns the sealed frame as it went out
                    addr, name, kind, data = args
                    captured: list[bytes] = []
                    real_send = eng.send

                    def capture(
                        a: bytes, f: bytes, keep: list[bytes] = captured, send: Any = real_send
                    ) -> Any:
                        keep.append(f)
                        return send(a, f)

                    eng.send = capture  # type: ignore[method-assign, assignment]
                    try:
                        channel(name).send(addr, kind, data).result(10)
                    finally:
                        del eng.send
                    conn.send(captured[-1])
                elif cmd == "send_raw":  # (address, frame): anything, framed or not
                    addr, data = args
                    eng.send(addr, data).result(10)
                    conn.send(True)
                elif cmd == "inbox":  # (channel name, count, timeout) -> what it received, once count arrived
                    name, count, timeout = args
                    channel(name)
                    # fewer than count by the timeout is an answer too: the caller asserts on what came
                    box: list[tuple[str, bytes, bytes]] = inbox[name]
                    with contextlib.suppress(AssertionError):
                        wait_until(lambda: len(box) >= count, timeout, "messages", every_s=0.01)  # noqa: B023
                    conn.send(list(inbox[name]))
                else:
                    conn.send(f"unknown command {cmd}")
            except TransferError as exc:
                conn.send(f"error: {exc}")
    finally:
        eng.close()


def group_pieces(
    pieces: list[tuple[int, int, int]], max_bytes: int, max_segs: int, *, scatters: bool, upto: int = 0
) -> list[list[tuple[int, int, int]]]:
    """The native core's grouping of write pieces into gathered writes (rf_group_pieces), as lists."""
    from backends.providers._native import ffi, lib

    flat = array("Q", [x for piece in pieces for x in piece])
    sizes = ffi.new("uint32_t[]", max(1, len(pieces)))
    ptr = ffi.cast("uint64_t *", ffi.from_buffer(flat))
    count = lib.rf_group_pieces(ptr, len(pieces), max_segs, int(scatters), max_bytes, upto, sizes)
    out, i = [], 0
    for g in ffi.unpack(sizes, count):
        out.append(pieces[i : i + g])
        i += g
    return out
