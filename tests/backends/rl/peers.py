"""Trainer and receiver processes for the RL weight-update tests, driven over multiprocessing pipes.

Weights of version v are a pure function of (v, tensor name), so every process can regenerate what
any rank must hold at any version and check it byte for byte.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from backends.rl import TensorSpec, model_specs
from backends.sharding import shard_range
from tests.backends.models import LlamaConfig
from tests.backends.processes import CTX
from tests.tiny_llama import SMALL

# the suite's small Llama with two of its four layers (~4.5 MB in bf16): every kind of tensor, half
# the bytes to move per update
CONFIG = replace(LlamaConfig(**SMALL), num_hidden_layers=2)
SESSION = "test-rl"


def specs() -> tuple[TensorSpec, ...]:
    return model_specs(CONFIG.tensor_specs("bfloat16"))


def shard_bytes(spec: TensorSpec, version: int, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank` of `tp`'s shard of `spec` at `version`, as uint8 (random bytes; version 0 = zeros)."""
    elem = torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
    if version == 0:
        full = torch.zeros((*spec.shape, elem), dtype=torch.uint8)
    else:
        g = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()) * 1000 + version)
        full = torch.randint(0, 256, (*spec.shape, elem), generator=g, dtype=torch.uint8)
    if spec.split_dim is None or tp == 1:
        return full
    lo, hi = shard_range(spec.shape[spec.split_dim], tp, rank)
    return full.narrow(spec.split_dim, lo, hi - lo).contiguous()


def _engine() -> Any:  # noqa: ANN401
    from backends import TransferEngine

    # 8 s: a live peer on a loaded 2-core box is never mistaken for a dead one; a killed peer is
    # seen at once anyway (its connection resets).
    return TransferEngine("tcp", 1, timeout_s=8.0, host="127.0.0.1")


def trainer_main(conn: Connection, index: int, tp: int, rank: int) -> None:
    from backends.rl import RLTrainer, shard_layout
    from tests.backends.models import allocate

    eng = _engine()
    conn.send(eng.address)
    roster = conn.recv()
    sp = specs()
    trainer = RLTrainer(
        eng,
        session=SESSION,
        specs=sp,
        trainers=roster,
        index=index,
        buffers=allocate(shard_layout(sp, tp_size=tp, tp_rank=rank)),
        timeout_s=20.0,
    )
    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            break
        if cmd == "wait_receivers":
            trainer.wait_receivers(args[0], args[1])
            conn.send(True)
        elif cmd == "update":
            version, timeout = args
            for s in sp:
                trainer.tensors[s.name].view(torch.uint8).view(-1).copy_(
                    shard_bytes(s, version, tp, rank).view(-1)
                )
            res = trainer.update(version, timeout_s=timeout)
            conn.send(
                {
                    "applied": list(res.applied),
                    "dropped": sorted(res.dropped),
                    "failed": sorted(res.failed),
                    "trainer_version": trainer.version,
                    "receiver_versions": trainer.receiver_versions(),
                }
            )
    trainer.close()
    eng.close()
    _exit(conn)


class _Reader(threading.Thread):
    """Computes on snapshots without pause and checks each is one whole version."""

    def __init__(self, receiver: Any, tp: int, rank: int) -> None:  # noqa: ANN401
        super().__init__(daemon=True)
        self.receiver, self.tp, self.rank = receiver, tp, rank
        self.sp = specs()
        self.expected: dict[int, dict[str, torch.Tensor]] = {}
        self.reads = 0
        self.mixed = 0
        self.versions: set[int] = set()
        self.stop = False

    def expect(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self.expected:
            self.expected[version] = {s.name: shard_bytes(s, version, self.tp, self.rank) for s in self.sp}
        return self.expected[version]

    def run(self) -> None:
        while not self.stop:
            with self.receiver.acquire() as snap:
                want = self.expect(snap.version)
                ok = all(
                    torch.equal(snap.tensors[s.name].view(torch.uint8).view(-1), want[s.name].reshape(-1))
                    for s in self.sp
                )
            self.reads += 1
            self.versions.add(snap.version)
            self.mixed += not ok
            time.sleep(0.005)


def receiver_main(
    conn: Connection,
    index: int,
    tp: int,
    rank: int,
    roster: Sequence[Any],
    die_at: int | None,
    timeout: float,
) -> None:
    from backends.rl import RLReceiver

    def on_begin(version: int) -> None:
        if version == die_at:
            os.kill(os.getpid(), signal.SIGKILL)  # dies with the update's writes in flight

    eng = _engine()
    receiver = RLReceiver(
        eng,
        session=SESSION,
        specs=specs(),
        trainers=roster,
        index=index,
        tp_size=tp,
        tp_rank=rank,
        update_timeout_s=timeout,
        on_update_begin=on_begin,
    )
    reader = _Reader(receiver, tp, rank)
    reader.start()
    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            break
        if cmd == "wait_version":
            conn.send(receiver.wait_version(args[0], args[1]))
        elif cmd == "verify":
            with receiver.acquire() as snap:
                want = reader.expect(snap.version)
                bad = [
                    s.name
                    for s in reader.sp
                    if not torch.equal(
                        snap.tensors[s.name].view(torch.uint8).view(-1), want[s.name].reshape(-1)
                    )
                ]
            conn.send((snap.version, bad))
        elif cmd == "stats":
            conn.send(
                {
                    "reads": reader.reads,
                    "mixed": reader.mixed,
                    "versions": sorted(reader.versions),
                    "applied": receiver.applied,
                    "abandoned": receiver.abandoned,
                }
            )
    reader.stop = True
    reader.join(5)
    receiver.close()
    eng.close()
    _exit(conn)


def _exit(conn: Connection) -> None:
    """Leave without the interpreter's final collection (seconds with torch loaded on a busy box)."""
    conn.close()
    os._exit(0)


@dataclass
class Proc:
    proc: BaseProcess
    conn: Connection

    def call(self, *cmd: Any, timeout: float = 60.0) -> Any:  # noqa: ANN401
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"process did not answer {cmd[0]!r} within {timeout}s")
        return self.conn.recv()

    def ask_exit(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit",))

    def stop(self) -> None:
        self.ask_exit()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def start(target: Any, *args: Any) -> tuple[Proc, Connection]:  # noqa: ANN401
    ctx = CTX
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    return Proc(proc, parent), parent


def recv(conn: Connection, what: str, timeout: float = 90.0) -> Any:  # noqa: ANN401
    if not conn.poll(timeout):
        raise TimeoutError(f"{what} did not start within {timeout}s")
    return conn.recv()
