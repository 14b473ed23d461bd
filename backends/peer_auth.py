"""Peer sessions: every channel frame is sealed, so a receiver knows which engine sent it.

A fabric endpoint does not tell a receiver who sent a message, and a frame's body says whatever
its author likes. So an engine proves ownership of its address with a return-routability
handshake before it sends anything on a channel:

    initiator A -> B   hello   A's address, a fresh random nonce_a
    responder B -> A   accept  B's address, nonce_a, nonce_b = HMAC(B's secret, A | B | nonce_a)

B sends nonce_b only to the address A claimed, and keeps no state for it (a hello flood costs B
nothing but the answers). Both derive the session key from nonce_b, nonce_a and both addresses;
every frame after that is

    b"RFCS" | version u8 | flags u8 | len(sender) u16 | len(name) u8 | len(kind) u8 | 0 u16
    | nonce_a 16 | seq u64 | sender | name | kind | data | tag 16

with tag = HMAC-SHA256(key, everything before it)[:16] and flags bit 0 set when the sender is the
session's initiator. A frame is accepted only if its tag verifies under the session named by
(sender, nonce_a); then `sender` is proven: only its owner received nonce_b. Sequence numbers
rise per session and direction, and a sliding window of REPLAY_WINDOW numbers drops replays
(fabrics may reorder, so no strict order is required). Everything else is dropped and counted by
reason: malformed, forged (tag does not verify), replayed, foreign (a session or answer this
engine does not know).

A channel opened with a set-up key (a secret its members got out of band, e.g. from the planner)
sets flags bit 1 and puts HMAC-SHA256(channel key, header .. data)[:16] between data and tag; the
receiving channel checks it (`channel_tag`), so only holders of the key speak on that channel.

Threat model: an off-path peer that can reach this engine's endpoints but not read traffic
between two other engines. A peer that can read the fabric learns nonce_b from the accept;
against it, a channel needs a set-up key (it still learns what is sent: nothing is encrypted), or
an isolated fabric.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from backends.descriptor import EngineAddress
from backends.errors import TransferError, TransferTimeout
from backends.progress import MAX_MESSAGE

log = logging.getLogger(__name__)

_HELLO = b"RFHI"
_ACCEPT = b"RFHA"
_SEALED = b"RFCS"
_VERSION = 1
_HANDSHAKE_HEAD = struct.Struct("<4sBxH")  # magic, version, len(address)
# magic, version, flags, len(sender), len(name), len(kind), nonce_a, seq
_SEALED_HEAD = struct.Struct("<4sBBHBBxx16sQ")
_FROM_INITIATOR = 1
_CHANNEL_KEYED = 2
NONCE_BYTES = 16
TAG_BYTES = 16
REPLAY_WINDOW = 1024  # sequence numbers behind the highest seen that may still arrive (reordering)
MAX_SESSIONS = 4096  # proven sessions kept; the least recently used goes first
MAX_QUEUED = 1024  # frames one peer's handshake may hold back
DROP_REASONS = ("malformed", "forged", "replayed", "foreign")


class Sender(Protocol):
    """What sessions need of an engine."""

    @property
    def address(self) -> bytes: ...

    @property
    def timeout_s(self) -> float: ...

    def send(self, peer_address: bytes, frame: bytes) -> Future[None]: ...


@dataclass(frozen=True, slots=True)
class Opened:
    """A frame that verified: the channel and kind it was sent on, its proven sender, its data."""

    name: str
    kind: str
    sender: bytes
    data: bytes
    signed: bytes = b""  # header .. data: what a channel tag covers
    channel_tag: bytes | None = None


@dataclass
class _Session:
    peer: bytes
    nonce_a: bytes
    key: bytes
    initiator: bool  # this engine started it
    next_seq: int = 1
    top: int = 0  # highest sequence number received
    seen: int = 0  # bit i: top - i was received


@dataclass
class _Handshake:
    nonce_a: bytes
    queued: list[tuple[str, str, bytes, bytes | None, Future[None]]] = field(default_factory=list)
    timer: threading.Timer | None = None


def _lp(b: bytes) -> bytes:
    return struct.pack("<H", len(b)) + b


def session_key(nonce_b: bytes, nonce_a: bytes, initiator: bytes, responder: bytes) -> bytes:
    """The key both ends derive once the handshake is done."""
    info = b"rfork-session-1" + nonce_a + _lp(initiator) + _lp(responder)
    return hmac.new(nonce_b, info, hashlib.sha256).digest()


def channel_tag(channel_key: bytes, signed: bytes) -> bytes:
    """The tag a channel's set-up key puts on a frame (over its header .. data)."""
    return hmac.new(channel_key, b"rfork-channel-1" + signed, hashlib.sha256).digest()[:TAG_BYTES]


def check_window(top: int, seen: int, seq: int) -> tuple[int, int] | None:
    """The new (top, seen) after receiving seq, or None when seq is a replay or too old."""
    if seq > top:
        shift = seq - top
        return seq, ((seen << shift) | 1) & ((1 << REPLAY_WINDOW) - 1)
    back = top - seq
    if back >= REPLAY_WINDOW or seen >> back & 1:
        return None
    return top, seen | 1 << back


class PeerSessions:
    """One engine's sessions with its peers: seals what it sends, opens what it receives.

    Thread-safety: any thread may send; progress threads receive. Handshakes that get no answer
    within the engine's timeout_s fail the frames they held back with TransferTimeout.
    """

    def __init__(self, engine: Sender, count: Callable[[str], None]) -> None:
        self._engine = engine
        self._count = count
        self._secret = os.urandom(32)
        self._lock = threading.Lock()
        self._sessions: OrderedDict[tuple[bytes, bytes], _Session] = OrderedDict()
        self._current: dict[bytes, tuple[bytes, bytes]] = {}  # peer -> the session to send on
        self._handshakes: dict[bytes, _Handshake] = {}

    # ----- sending ------------------------------------------------------------------------------
    def send(
        self, peer: bytes, name: str, kind: str, data: bytes, channel_key: bytes | None = None
    ) -> Future[None]:
        """Seal and send one frame (with a channel tag under channel_key, if given); the first frame
        to a peer waits for the handshake."""
        n, k = name.encode(), kind.encode()
        if not 0 < len(n) < 256 or not 0 < len(k) < 256:
            raise ValueError(f"channel {name!r}: name and kind must be 1..255 bytes")
        size = _SEALED_HEAD.size + len(self._engine.address) + len(n) + len(k) + len(data) + TAG_BYTES
        size += TAG_BYTES if channel_key is not None else 0
        if size > MAX_MESSAGE:
            raise ValueError(
                f"channel {name!r}: {kind} message is {size} bytes, over the {MAX_MESSAGE}-byte limit"
            )
        hello: bytes | None = None
        hs: _Handshake | None = None
        with self._lock:
            session = self._session_for(peer)
            if session is None:
                hs = self._handshakes.get(peer)
                if hs is None:
                    hs = self._handshakes[peer] = _Handshake(os.urandom(NONCE_BYTES))
                    hello = _handshake(_HELLO, self._engine.address, hs.nonce_a)
                if len(hs.queued) >= MAX_QUEUED:
                    raise TransferError(
                        f"send to {_label(peer)}: {MAX_QUEUED} frames already wait for its handshake"
                    )
                fut: Future[None] = Future()
                fut.set_running_or_notify_cancel()
                hs.queued.append((name, kind, data, channel_key, fut))
            else:
                frame = self._seal(session, n, k, data, channel_key)
        if session is not None:
            return self._engine.send(peer, frame)
        if hello is not None and hs is not None:
            self._start(peer, hs, hello)
        return fut

    def _session_for(self, peer: bytes) -> _Session | None:
        key = self._current.get(peer)
        return None if key is None else self._sessions.get(key)

    def _seal(
        self, session: _Session, name: bytes, kind: bytes, data: bytes, channel_key: bytes | None
    ) -> bytes:
        """Under the lock (the sequence number)."""
        seq = session.next_seq
        session.next_seq += 1
        me = self._engine.address
        flags = (_FROM_INITIATOR if session.initiator else 0) | (_CHANNEL_KEYED if channel_key else 0)
        head = _SEALED_HEAD.pack(
            _SEALED, _VERSION, flags, len(me), len(name), len(kind), session.nonce_a, seq
        )
        body = b"".join((head, me, name, kind, data))
        if channel_key is not None:
            body += channel_tag(channel_key, body)
        return body + hmac.new(session.key, body, hashlib.sha256).digest()[:TAG_BYTES]

    def _start(self, peer: bytes, hs: _Handshake, hello: bytes) -> None:
        """Send a hello and arm its deadline."""
        nonce_a = hs.nonce_a
        timer = hs.timer = threading.Timer(self._engine.timeout_s, self._give_up, (peer, nonce_a, None))
        timer.daemon = True
        timer.start()
        try:
            sent = self._engine.send(peer, hello)
        except (TransferError, ValueError) as exc:
            timer.cancel()
            self._give_up(peer, nonce_a, exc)
            return
        def hello_sent(f: Future[None]) -> None:
            if f.exception() is not None:
                self._give_up(peer, nonce_a, f.exception())

        sent.add_done_callback(hello_sent)

    def _give_up(self, peer: bytes, nonce_a: bytes, exc: BaseException | None) -> None:
        with self._lock:
            hs = self._handshakes.get(peer)
            if hs is None or hs.nonce_a != nonce_a:
                return  # answered (or a newer handshake)
            del self._handshakes[peer]
        err: BaseException = (
            TransferTimeout(f"peer {_label(peer)} did not answer the session handshake within "
                            f"{self._engine.timeout_s:g}s")
            if exc is None else exc
        )
        for *_, fut in hs.queued:  # (name, kind, data, channel key, future)
            if not fut.done():
                fut.set_exception(err)

    # ----- receiving ----------------------------------------------------------------------------
    def receive(self, frame: bytes) -> Opened | None:
        """The verified frame, or None (a handshake, or dropped and counted). Never raises."""
        magic = frame[:4]
        if magic == _SEALED:
            return self._open(frame)
        if magic == _HELLO:
            self._answer(frame)
        elif magic == _ACCEPT:
            self._accepted(frame)
        else:
            self._count("malformed")
        return None

    def _answer(self, frame: bytes) -> None:
        parsed = _parse_handshake(frame, NONCE_BYTES)
        if parsed is None:
            self._count("malformed")
            return
        peer, (nonce_a,) = parsed
        accept = _handshake(_ACCEPT, self._engine.address, nonce_a, self._cookie(peer, nonce_a))
        def accept_sent(f: Future[None]) -> None:
            if f.exception() is not None:
                log.debug("accept to %s failed: %s", _label(peer), f.exception())

        try:
            self._engine.send(peer, accept).add_done_callback(accept_sent)
        except (TransferError, ValueError) as exc:
            log.debug("could not answer a hello from %s: %s", _label(peer), exc)

    def _accepted(self, frame: bytes) -> None:
        parsed = _parse_handshake(frame, 2 * NONCE_BYTES)
        if parsed is None:
            self._count("malformed")
            return
        peer, (nonce_a, nonce_b) = parsed
        out: list[tuple[bytes, Future[None]]] = []
        with self._lock:
            hs = self._handshakes.get(peer)
            if hs is None or not hmac.compare_digest(hs.nonce_a, nonce_a):
                self._count("foreign")
                return
            del self._handshakes[peer]
            if hs.timer is not None:
                hs.timer.cancel()
            key = session_key(nonce_b, nonce_a, self._engine.address, peer)
            session = _Session(peer, nonce_a, key, True)
            self._keep(session)
            for name, kind, data, channel_key, fut in hs.queued:
                out.append((self._seal(session, name.encode(), kind.encode(), data, channel_key), fut))
        for sealed, fut in out:
            try:
                self._engine.send(peer, sealed).add_done_callback(functools.partial(_chain, target=fut))
            except (TransferError, ValueError) as exc:
                fut.set_exception(exc)

    def _open(self, frame: bytes) -> Opened | None:
        if len(frame) < _SEALED_HEAD.size + TAG_BYTES:
            self._count("malformed")
            return None
        _, version, flags, slen, nlen, klen, nonce_a, seq = _SEALED_HEAD.unpack_from(frame)
        pos = _SEALED_HEAD.size
        end = pos + slen + nlen + klen
        tags = TAG_BYTES * (2 if flags & _CHANNEL_KEYED else 1)
        if version != _VERSION or not (slen and nlen and klen) or end > len(frame) - tags:
            self._count("malformed")
            return None
        sender = bytes(frame[pos : pos + slen])
        try:
            EngineAddress.from_bytes(sender)
            name = frame[pos + slen : pos + slen + nlen].decode()
            kind = frame[pos + slen + nlen : end].decode()
        except (TransferError, UnicodeDecodeError):
            self._count("malformed")
            return None
        body, tag = frame[: len(frame) - TAG_BYTES], frame[len(frame) - TAG_BYTES :]
        with self._lock:
            known = self._sessions.get((sender, nonce_a))
        if known is None and not flags & _FROM_INITIATOR:
            self._count("foreign")  # an answer on a session this engine never started (or forgot)
            return None
        # The tag is checked outside the lock: progress threads of several domains open in parallel.
        if known is not None:
            key = known.key
        else:
            key = session_key(self._cookie(sender, nonce_a), nonce_a, sender, self._engine.address)
        if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest()[:TAG_BYTES], tag):
            self._count("forged")
            return None
        with self._lock:
            session = self._sessions.get((sender, nonce_a))
            if session is None:
                if known is not None:
                    self._count("foreign")  # evicted meanwhile
                    return None
                session = _Session(sender, nonce_a, key, False)
                self._keep(session)
            elif session.initiator == bool(flags & _FROM_INITIATOR):
                self._count("forged")  # our own frame reflected back
                return None
            window = check_window(session.top, session.seen, seq)
            if window is None:
                self._count("replayed")
                return None
            session.top, session.seen = window
            self._sessions.move_to_end((sender, nonce_a))
        signed = bytes(frame[: len(frame) - tags])
        ctag = bytes(frame[len(frame) - tags : len(frame) - TAG_BYTES]) if flags & _CHANNEL_KEYED else None
        return Opened(name, kind, sender, signed[end:], signed, ctag)

    def _keep(self, session: _Session) -> None:
        """Under the lock: add a proven session, the peer's current one; the table stays bounded."""
        key = (session.peer, session.nonce_a)
        self._sessions[key] = session
        self._current[session.peer] = key
        while len(self._sessions) > MAX_SESSIONS:
            (peer, nonce), _ = self._sessions.popitem(last=False)
            if self._current.get(peer) == (peer, nonce):
                del self._current[peer]

    def _cookie(self, initiator: bytes, nonce_a: bytes) -> bytes:
        """nonce_b: recomputed, never stored, so a hello flood leaves no state here."""
        msg = b"rfork-cookie-1" + _lp(initiator) + _lp(self._engine.address) + nonce_a
        return hmac.new(self._secret, msg, hashlib.sha256).digest()[:NONCE_BYTES]

    def sessions(self) -> int:
        """Proven sessions held now."""
        with self._lock:
            return len(self._sessions)


def _handshake(magic: bytes, address: bytes, *nonces: bytes) -> bytes:
    return b"".join((_HANDSHAKE_HEAD.pack(magic, _VERSION, len(address)), address, *nonces))


def _parse_handshake(frame: bytes, nonce_bytes: int) -> tuple[bytes, tuple[bytes, ...]] | None:
    """(address, nonces) of a hello or accept, or None when it is malformed."""
    if len(frame) < _HANDSHAKE_HEAD.size:
        return None
    _, version, alen = _HANDSHAKE_HEAD.unpack_from(frame)
    pos = _HANDSHAKE_HEAD.size
    if version != _VERSION or not alen or len(frame) != pos + alen + nonce_bytes:
        return None
    address = bytes(frame[pos : pos + alen])
    try:
        EngineAddress.from_bytes(address)
    except TransferError:
        return None
    rest = frame[pos + alen :]
    return address, tuple(bytes(rest[i : i + NONCE_BYTES]) for i in range(0, nonce_bytes, NONCE_BYTES))


def _chain(source: Future[None], *, target: Future[None]) -> None:
    exc = source.exception()
    if target.done():
        return
    if exc is None:
        target.set_result(None)
    else:
        target.set_exception(exc)


def _label(address: bytes) -> str:
    return address[-8:].hex()
