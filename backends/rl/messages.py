"""Control messages of a weight-update session, on the engine channel "rl/<session>" (JSON fields).

receiver -> trainers  HELLO  join: TP position, layout parameters, model digest, the descriptors of
                             both parameter slots, its immediate range (its channel's), version and
                             free slot
receiver -> trainers  READY  "I serve `version`; slot `slot` is free to write" (after a flip or an
                             abandoned update, once no reader uses that slot); slot null: "I serve
                             `version`, but a reader still holds the other slot" (a confirmation).
                             After an abandoned update the free slot is re-registered (re-keyed) and
                             READY carries its new descriptors in `descs`: writes a slow trainer
                             still has in flight for the abandoned version fail at the old keys.
trainer -> receiver   BEGIN  "version `version` is being written into the free slot"; at most
                             MAX_VERSION_JUMP above what the receiver serves or abandoned
trainer -> receiver   REJECT the HELLO disagrees with the trainer (model, layout, contributors)
trainer -> receiver   DROPPED the trainer dropped this receiver from the session {reason}
Only roster trainers' messages count at a receiver, and a receiver's READY only from the address
that joined under its index (Message.sender is proven by the channel's session).
Completion is not a message: each contributing trainer sends one immediate, index
`imm_index(version)` of the receiver's range, after its writes to that receiver have completed.
Messages of other sessions travel on other channels: a session never sees them.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from backends.channel import Channel, Message
from backends.rl.spec import RLError

HELLO, READY, BEGIN, REJECT, DROPPED = "hello", "ready", "begin", "reject", "dropped"
_KINDS = (HELLO, READY, BEGIN, REJECT, DROPPED)
VERSION_BITS = 24  # a receiver's range holds one immediate per version modulo 2**24
VERSION_MASK = (1 << VERSION_BITS) - 1
IMMS = 1 << VERSION_BITS
MAX_VERSION_JUMP = 1 << 20  # well inside the 24-bit immediate, so no two live versions alias
MAX_INBOX = 1024  # control messages queued for a session's control thread; beyond, dropped and counted


def channel_name(session: str) -> str:
    """The channel a session's members talk on (both sides open the same name)."""
    return f"rl/{session}"


def imm_index(version: int) -> int:
    """The index, in the receiver's immediate range, of the immediate that completes `version`."""
    return version & VERSION_MASK


def send(channel: Channel, address: bytes, kind: str, **fields: Any) -> Future[None]:
    """Send one message; RLError when it would not fit the engine's message limit."""
    try:
        return channel.send_json(address, kind, **fields)
    except ValueError as exc:
        raise RLError(f"{exc} (raise max_region_bytes to need fewer regions)") from exc


def decode(message: Message) -> dict[str, Any]:
    """The message's fields plus its "kind"; RLError when it is malformed or of an unknown kind."""
    if message.kind not in _KINDS:
        raise RLError(f"malformed session message: unknown kind {message.kind[:40]!r}")
    try:
        return {**message.fields(), "kind": message.kind}
    except ValueError as exc:
        raise RLError(f"malformed session message ({exc})") from exc


def field(msg: dict[str, Any], name: str, kind: type) -> Any:  # noqa: ANN401 - typed by `kind`
    """msg[name], checked to be of `kind`; RLError naming the field otherwise."""
    value = msg.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RLError(f"{msg.get('kind')} message: field {name!r} is missing or not {kind.__name__}")
    return value
