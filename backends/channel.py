"""Channels: how paths (KV, RL, MoE, ...) share one engine without seeing each other's traffic.

`engine.channel(name, imms=n)` opens a channel: messages sent on it reach only the channel of the
same name on the peer engine, and its `n` immediate values are allocated by this engine, disjoint
from every other open channel's. A peer learns a channel's range from a message or a set-up blob
(`ImmRange.to_json`) and writes `ImmRange.value(i)` to signal index i; the owner waits with
`channel.expect(i, count)`. The engine's ImmCounter counts every immediate from the moment the
engine opens, so an expect never races the writes it waits for.

Every two-sided message is one frame sealed under a session with the peer engine
(backends.peer_auth): `Message.sender` is the engine address the session handshake proved, never
what a frame body claims. Forged, replayed, foreign or malformed frames are dropped and counted by
reason (`engine.frames_dropped`), never raised on the progress thread. Frames for a channel with no
callback yet are kept (at most EARLY_LIMIT of them, EARLY_PER_SENDER from one sender) and
delivered, in order, by `on_message`. A channel opened with a set-up `key` (a secret its members
got out of band, at least 16 bytes) accepts only frames tagged with that key, and a keyless
channel only untagged ones: this also holds against a peer that can read the fabric.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from backends.errors import ChannelError
from backends.imm import ImmCounter
from backends.peer_auth import DROP_REASONS as SESSION_DROPS
from backends.peer_auth import Opened, PeerSessions, channel_tag

log = logging.getLogger(__name__)

EARLY_LIMIT = 256  # frames kept for channels that have no callback yet
EARLY_PER_SENDER = 64  # of which one sender may hold at most this many
DROP_REASONS = (*SESSION_DROPS, "overflow", "closed")
IMM_FIRST = 1 << 24  # channel ranges come from [IMM_FIRST, 2**32); smaller values are left to raw write_imm
_IMM_END = 1 << 32


@dataclass(frozen=True, slots=True)
class Message:
    """One received frame: the channel and kind it was sent with, the sender's proven address, its data."""

    channel: str
    kind: str
    sender: bytes
    data: bytes

    def fields(self) -> dict[str, Any]:
        """The data as a JSON object (what `Channel.send_json` sent); ValueError when it is not one."""
        try:
            doc = json.loads(self.data) if self.data else {}
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(f"{self.kind} message on channel {self.channel!r} is not JSON ({exc})") from exc
        if not isinstance(doc, dict):
            raise ValueError(f"{self.kind} message on channel {self.channel!r} is not a JSON object")  # noqa: TRY004
        return doc


@dataclass(frozen=True, slots=True)
class ImmRange:
    """`count` immediate values from `base`: one channel's, as its owner advertises them to peers."""

    base: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 0 or not 0 <= self.base <= self.base + self.count <= _IMM_END:
            raise ValueError(f"immediate range [{self.base}, +{self.count}) is not inside 32 bits")

    def value(self, index: int) -> int:
        """The immediate for `index`; ValueError when the range has no such index."""
        if not 0 <= index < self.count:
            raise ValueError(f"immediate index {index} is outside the range's {self.count} values")
        return self.base + index

    def to_json(self) -> list[int]:
        """[base, count], for a message or a set-up blob."""
        return [self.base, self.count]

    @classmethod
    def from_json(cls, doc: Any) -> ImmRange:
        """Inverse of to_json, for what a peer sent; ValueError on anything else."""
        if (
            not isinstance(doc, list)
            or len(doc) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in doc)
        ):
            raise ValueError(f"an immediate range is [base, count], not {str(doc)[:40]!r}")
        return cls(doc[0], doc[1])


class Transport(Protocol):
    """What a channel needs of its engine (TransferEngine is one)."""

    @property
    def address(self) -> bytes: ...

    @property
    def imm(self) -> ImmCounter: ...

    @property
    def timeout_s(self) -> float: ...

    def expect(self, imm: int, count: int = 1) -> Future[None]: ...

    def send(self, peer_address: bytes, frame: bytes) -> Future[None]: ...


class Channel:
    """A named message stream plus a private immediate range on one engine; see the module docstring.

    Thread-safety: any thread may send, expect or close; callbacks run on the progress thread, one
    message at a time, and must be short. Close it when the path is done (the name and the range are
    then free again; later frames for it are dropped).
    """

    def __init__(self, hub: ChannelHub, name: str, imms: ImmRange, key: bytes | None = None) -> None:
        self.name = name
        self.imms = imms
        self.key = key
        self._hub = hub
        self.closed = False

    @property
    def address(self) -> bytes:
        """This engine's address: what peers send to."""
        return self._hub.transport.address

    def on_message(self, callback: Callable[[Message], None]) -> None:
        """Set the callback; frames that came before it are delivered now, in order."""
        self._hub.attach(self.name, callback)

    def send(self, peer_address: bytes, kind: str, data: bytes = b"") -> Future[None]:
        """Send one message to the channel of this name on the peer engine."""
        if self.closed:
            raise ChannelError(f"channel {self.name!r} is closed")
        return self._hub.sessions.send(peer_address, self.name, kind, data, self.key)

    def send_json(self, peer_address: bytes, kind: str, **fields: Any) -> Future[None]:
        """send() with a JSON object of fields as the data (Message.fields() on the other side)."""
        return self.send(peer_address, kind, json.dumps(fields, separators=(",", ":")).encode())

    def imm(self, index: int) -> int:
        """The immediate value that signals `index` of this channel (for this engine's own regions)."""
        return self.imms.value(index)

    def expect(self, index: int, count: int = 1) -> Future[None]:
        """Future resolved once `count` immediates for `index` arrived (since engine open); consumes them."""
        if self.closed:
            raise ChannelError(f"channel {self.name!r} is closed")
        return self._hub.transport.expect(self.imms.value(index), count)

    def discard(self, index: int, future: Future[None]) -> bool:
        """Withdraw an expect no longer wanted; True if it was still waiting."""
        return self._hub.transport.imm.discard(self.imms.value(index), future)

    def forget(self, first: int, count: int) -> None:
        """Drop what arrived for indices [first, first + count) and not yet consumed (a slot reused)."""
        if count:
            self.imms.value(first)
            self.imms.value(first + count - 1)
            self._hub.transport.imm.forget(
                self.imms.base + first, count, ChannelError(f"channel {self.name!r}: indices forgotten")
            )

    def close(self) -> None:
        """Stop receiving; outstanding expects fail; the name and the range may be reused."""
        if not self.closed:
            self.closed = True
            self._hub.close(self)

    def __repr__(self) -> str:
        return f"Channel({self.name!r}, imms=[{self.imms.base:#x}, +{self.imms.count}))"


class ChannelHub:
    """An engine's channels: open names and their callbacks, early frames, immediate ranges."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._lock = threading.Lock()
        self._open: dict[str, Channel] = {}
        self._callbacks: dict[str, Callable[[Message], None]] = {}
        self._early: deque[Opened] = deque()
        self._early_from: Counter[bytes] = Counter()
        self._closed_names: set[str] = set()
        self._next_imm = IMM_FIRST
        self._free: list[ImmRange] = []  # ranges of closed channels, sorted by base, adjacent ones merged
        self._count_lock = threading.Lock()
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.sessions = PeerSessions(transport, self._count)

    def _count(self, reason: str) -> None:
        with self._count_lock:
            self.dropped[reason] += 1
        log.debug("dropped a frame: %s", reason)

    def open(self, name: str, imms: int, key: bytes | None = None) -> Channel:
        if not 0 < len(name.encode()) < 256:
            raise ValueError(f"channel name {name!r} must be 1..255 bytes")
        if key is not None and len(key) < 16:
            raise ValueError(f"channel {name!r}: a set-up key must have at least 16 bytes, not {len(key)}")
        if imms < 0:
            raise ValueError(f"channel {name!r}: imms must be >= 0, not {imms}")
        with self._lock:
            if name in self._open:
                raise ChannelError(f"channel {name!r} is already open on this engine")
            channel = Channel(self, name, self._allocate(name, imms), key)
            self._open[name] = channel
            self._closed_names.discard(name)
        return channel

    def _allocate(self, name: str, count: int) -> ImmRange:
        if count == 0:
            return ImmRange(0, 0)
        if self._next_imm + count <= _IMM_END:  # fresh values first: a closed channel's late ones fade
            self._next_imm += count
            return ImmRange(self._next_imm - count, count)
        for i, free in enumerate(self._free):
            if free.count >= count:
                rest = ImmRange(free.base + count, free.count - count)
                self._free[i : i + 1] = [rest] if rest.count else []
                return ImmRange(free.base, count)
        largest = max((f.count for f in self._free), default=0)
        raise ChannelError(
            f"channel {name!r}: no room for {count} immediates; the engine's range [{IMM_FIRST:#x}, 2**32) "
            f"is exhausted (largest free block {largest})"
        )

    def close(self, channel: Channel) -> None:
        with self._lock:
            if self._open.get(channel.name) is not channel:
                return
            del self._open[channel.name]
            self._callbacks.pop(channel.name, None)
            self._closed_names.add(channel.name)
            self._take_early(channel.name)
            if channel.imms.count:
                self._free.append(channel.imms)
                self._free.sort(key=lambda r: r.base)
                merged: list[ImmRange] = []
                for r in self._free:
                    if merged and merged[-1].base + merged[-1].count == r.base:
                        merged[-1] = ImmRange(merged[-1].base, merged[-1].count + r.count)
                    else:
                        merged.append(r)
                self._free = merged
        if channel.imms.count:
            self.transport.imm.forget(
                channel.imms.base, channel.imms.count, ChannelError(f"channel {channel.name!r} closed")
            )

    def attach(self, name: str, callback: Callable[[Message], None]) -> None:
        while True:
            with self._lock:
                channel = self._open.get(name)
                if channel is None:
                    raise ChannelError(f"channel {name!r} is not open")
                early = self._take_early(name)
                if not early:
                    self._callbacks[name] = callback
                    return
            for opened in early:
                message = self._admitted(channel, opened)
                if message is not None:
                    _call(callback, message)

    def _take_early(self, name: str) -> list[Opened]:
        """Under the lock: remove and return the early frames of one channel."""
        taken = [m for m in self._early if m.name == name]
        if taken:
            self._early = deque(m for m in self._early if m.name != name)
            for m in taken:
                self._early_from[m.sender] -= 1
                if self._early_from[m.sender] <= 0:
                    del self._early_from[m.sender]
        return taken

    def _admitted(self, channel: Channel, opened: Opened) -> Message | None:
        """The message, if the frame carries the channel's set-up key tag exactly when the channel has a
        key; otherwise counted as forged."""
        if channel.key is None:
            ok = opened.channel_tag is None
        else:
            ok = opened.channel_tag is not None and hmac.compare_digest(
                channel_tag(channel.key, opened.signed), opened.channel_tag
            )
        if not ok:
            self._count("forged")
            return None
        return Message(opened.name, opened.kind, opened.sender, opened.data)

    def deliver(self, frame: bytes) -> None:
        """Route one received frame (progress thread): to its callback, the early queue, or the drop count."""
        opened = self.sessions.receive(frame)
        if opened is None:
            return  # a handshake, or dropped and counted by the sessions
        reason = None
        with self._lock:
            callback = self._callbacks.get(opened.name)
            channel = self._open.get(opened.name)
            if callback is None:
                if opened.name in self._closed_names:
                    reason = "closed"
                elif len(self._early) >= EARLY_LIMIT or self._early_from[opened.sender] >= EARLY_PER_SENDER:
                    reason = "overflow"
                else:
                    self._early.append(opened)
                    self._early_from[opened.sender] += 1
        if reason == "overflow":
            log.warning("dropped a %s frame for channel %r: early frames are capped (%d, %d per sender)",
                        opened.kind, opened.name, EARLY_LIMIT, EARLY_PER_SENDER)
        if reason is not None:
            self._count(reason)
        if callback is not None and channel is not None:
            message = self._admitted(channel, opened)
            if message is not None:
                _call(callback, message)

    def early(self) -> int:
        """Frames held for channels with no callback yet."""
        with self._lock:
            return len(self._early)


def _call(callback: Callable[[Message], None], message: Message) -> None:
    try:
        callback(message)
    except Exception:
        log.exception("channel %r: the %s callback raised", message.channel, message.kind)
