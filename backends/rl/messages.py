"""Control messages of a weight-update session (small JSON over the engine's send/on_message).

receiver -> trainers  HELLO  join: TP position, layout parameters, model digest, the descriptors of
                             both parameter slots, its immediate tag, version and free slot
receiver -> trainers  READY  "I serve `version`; slot `slot` is free to write" (after a flip or an
                             abandoned update, once no reader uses that slot); slot null: "I serve
                             `version`, but a reader still holds the other slot" (a confirmation)
trainer -> receiver   BEGIN  "version `version` is being written into the free slot"
trainer -> receiver   REJECT the HELLO disagrees with the trainer (model, layout, contributors)
Completion is not a message: each contributing trainer sends one immediate `imm_for(tag, version)`
after its writes to that receiver have completed.
"""

from __future__ import annotations

import json
from typing import Any

from backends import MAX_MESSAGE
from backends.rl.spec import RLError

HELLO, READY, BEGIN, REJECT = "hello", "ready", "begin", "reject"
_KINDS = (HELLO, READY, BEGIN, REJECT)
VERSION_BITS = 24  # the low bits of an immediate carry the version; the high 8 bits the receiver's tag
VERSION_MASK = (1 << VERSION_BITS) - 1


def imm_for(tag: int, version: int) -> int:
    """The 32-bit immediate that completes `version` at the receiver with immediate tag `tag`."""
    if not 0 <= tag < 256:
        raise RLError(f"immediate tag {tag} is not 8 bits")
    return (tag << VERSION_BITS) | (version & VERSION_MASK)


def encode(session: str, kind: str, **fields: Any) -> bytes:
    """One message; RLError when it would not fit the engine's message limit."""
    data = json.dumps({"session": session, "kind": kind, **fields}, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise RLError(
            f"{kind} message is {len(data)} bytes, over the {MAX_MESSAGE}-byte limit "
            "(raise max_region_bytes to need fewer regions)"
        )
    return data


def decode(data: bytes, session: str) -> dict[str, Any] | None:
    """The message as a dict, or None when it is for another session; RLError when malformed."""
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RLError(f"malformed session message ({exc})") from exc
    if not isinstance(msg, dict) or msg.get("kind") not in _KINDS:
        raise RLError(f"malformed session message: {str(msg)[:80]!r}")
    if msg.get("session") != session:
        return None
    return msg


def field(msg: dict[str, Any], name: str, kind: type) -> Any:  # noqa: ANN401 - typed by `kind`
    """msg[name], checked to be of `kind`; RLError naming the message and field otherwise."""
    value = msg.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RLError(f"{msg.get('kind')} message: field {name!r} is missing or not {kind.__name__}")
    return value
