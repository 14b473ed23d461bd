"""What the prefill server hands the decode server through vLLM's `kv_transfer_params` (via the proxy).

The prefill server returns `RemotePrefill.to_params()` in its response; the proxy passes it unchanged
to the decode server's request. The address is the prefill worker's transfer-engine address: the
decode worker joins it on the engine channel "kv", whose frames are sealed under a session that
proves the peer's address (backends.peer_auth), and, with a set-up key, tagged with it. These fields
come from a client, so they are checked here, once, before the worker sees them.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

MAX_BLOCKS = 1 << 20  # block ids one request may name (a bound on what a client can make us hold)
MAX_ADDRESS = 4096  # bytes of an engine address
MAX_RID = 256  # characters of a request id (backends.kv's bound)


class KvParamsError(ValueError):
    """kv_transfer_params that the rfork connector cannot use; the message names the field."""


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a request's prefilled KV lives: the prefill engine, its request id there, its blocks."""

    address: bytes  # the prefill worker's transfer-engine address
    request_id: str  # the request id on the prefill server (backends.kv pairs on it)
    block_ids: tuple[int, ...]  # the prefill server's blocks holding the prompt's KV, in order
    block_size: int  # tokens per block on the prefill server

    def to_params(self) -> dict[str, Any]:
        """The kv_transfer_params the prefill server returns (JSON)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "rfork_address": base64.b64encode(self.address).decode(),
            "remote_request_id": self.request_id,
            "remote_block_ids": list(self.block_ids),
            "remote_block_size": self.block_size,
        }

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RemotePrefill:
        """Checked inverse of to_params; KvParamsError naming the bad field."""
        if "rfork_address" not in params:
            raise KvParamsError(
                "kv_transfer_params has no rfork_address: it did not come from an rfork prefill server"
            )
        encoded = params["rfork_address"]
        if not isinstance(encoded, str) or len(encoded) > 2 * MAX_ADDRESS:
            raise KvParamsError("kv_transfer_params.rfork_address must be a base64 string")
        try:
            address = base64.b64decode(encoded.encode(), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise KvParamsError(f"kv_transfer_params.rfork_address is not base64 ({exc})") from exc
        if not 0 < len(address) <= MAX_ADDRESS:
            raise KvParamsError(f"kv_transfer_params.rfork_address must be 1..{MAX_ADDRESS} bytes")
        rid = params.get("remote_request_id")
        if not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID:
            raise KvParamsError(
                f"kv_transfer_params.remote_request_id must be a string of 1..{MAX_RID} characters"
            )
        blocks = params.get("remote_block_ids")
        if (
            not isinstance(blocks, list)
            or len(blocks) > MAX_BLOCKS
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks)
        ):
            raise KvParamsError(
                f"kv_transfer_params.remote_block_ids must be a list of at most {MAX_BLOCKS} block ids >= 0"
            )
        size = params.get("remote_block_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise KvParamsError("kv_transfer_params.remote_block_size must be a positive integer")
        return cls(address, rid, tuple(blocks), size)
