"""rfork's vLLM KV connector: prefill/decode disaggregation over backends.kv (docs/kv.md).

Load it with
    --kv-transfer-config '{"kv_connector": "RforkKvConnector",
                           "kv_connector_module_path": "rfork.integrations.vllm.kv_connector",
                           "kv_role": "kv_producer"}'          # "kv_consumer" on the decode server
(the rfork vLLM plugin also registers the name, so `kv_connector_module_path` may be left out).

The flow, as with vLLM's NixlConnector: a proxy sends a request to the prefill server with
`max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true}`; the prefill server keeps the
request's blocks and answers with kv_transfer_params naming its transfer engine, request id and
blocks (kv_params.RemotePrefill); the proxy sends the request, with those params, to the decode
server, which allocates blocks, asks the prefill worker for the KV (one-sided writes straight into its
cache, over the sealed channel "kv") and decodes. The prefill server frees the blocks once delivered.

Scheduler side: runs in vLLM's engine-core process and only keeps ids. Worker side: kv_worker.KvWorker.
Supported: TP 1 and PP 1 on both servers, the same model, dtype and block size on both (checked at
the first join), prefix-cache hits on either server, chunked prefill on the prefill server. Refused
with an error: TP or PP > 1, kv_both, hybrid (non-uniform) KV caches, a block size that differs
from the prefill server's.
"""

from __future__ import annotations

import ipaddress
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from rfork.env_secrets import env_secret
from rfork.integrations.vllm.kv_params import KvParamsError, RemotePrefill
from rfork.integrations.vllm.kv_worker import KvConnectorError, KvWorker
from rfork.seed_networks import Network

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

CHANNEL_KEY_ENV = "RFORK_KV_CHANNEL_KEY"  # or RFORK_KV_CHANNEL_KEY_FILE: a secret both servers share


@dataclass
class RforkKvMetadata(KVConnectorMetadata):
    """Scheduler -> worker, each step: requests to offer (prefill) and to fetch (decode)."""

    to_send: dict[str, list[int]] = field(default_factory=dict)
    to_recv: dict[str, tuple[list[int], RemotePrefill]] = field(default_factory=dict)


@dataclass
class RforkKvHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: the worker's transfer-engine address (for kv_transfer_params)."""

    address: bytes


@dataclass(frozen=True)
class ConnectorSettings:
    """From kv_transfer_config (kv_connector_extra_config): provider, timeouts, the channel key."""

    producer: bool
    provider: str
    timeout_s: float
    abort_timeout_s: float
    channel_key: bytes | None
    prefill_networks: tuple[Network, ...] | None = None  # decode: where prefill engines may be

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> ConnectorSettings:
        kv = vllm_config.kv_transfer_config
        assert kv is not None
        role = kv.kv_role
        if role not in ("kv_producer", "kv_consumer"):
            raise KvConnectorError(
                f"kv_role {role!r}: the rfork connector runs as kv_producer (prefill) or kv_consumer (decode)"
            )
        par = vllm_config.parallel_config
        if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
            raise KvConnectorError(
                f"tensor_parallel_size {par.tensor_parallel_size}, pipeline_parallel_size "
                f"{par.pipeline_parallel_size}: the rfork connector supports 1 and 1 on both servers"
            )
        extra = dict(kv.kv_connector_extra_config or {})
        known = {"provider", "timeout_s", "abort_timeout_s", "prefill_networks", "allow_keyless"}
        unknown = set(extra) - known
        if unknown:
            raise KvConnectorError(
                f"kv_connector_extra_config: unknown setting(s) {sorted(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        key = env_secret(CHANNEL_KEY_ENV)
        if key is not None and len(key.encode()) < 16:
            raise KvConnectorError(f"${CHANNEL_KEY_ENV} must be at least 16 bytes")
        keyless = extra.get("allow_keyless", False)
        if not isinstance(keyless, bool):
            raise KvConnectorError("kv_connector_extra_config.allow_keyless must be true or false")
        if key is None and not keyless:
            raise KvConnectorError(
                f"${CHANNEL_KEY_ENV} (or ${CHANNEL_KEY_ENV}_FILE) is not set: without it any engine that "
                "reaches this one's fabric address can take part in KV transfers (a prefill server hands a "
                "request's KV to whoever asks for its id). Set the same secret on both servers, or set "
                "allow_keyless: true in kv_connector_extra_config to run without it on a fabric you trust"
            )
        if key is None:
            log.warning(
                "rfork KV: running WITHOUT $%s (allow_keyless): any engine that can reach this server's "
                "fabric address and knows a request id can collect that request's KV from a prefill server, "
                "and the KV frames can be read by anyone who can read the fabric", CHANNEL_KEY_ENV,
            )
        return cls(
            producer=role == "kv_producer",
            provider=str(extra.get("provider", "tcp")),
            timeout_s=float(extra.get("timeout_s", 10.0)),
            abort_timeout_s=float(extra.get("abort_timeout_s", 120.0)),
            channel_key=key.encode() if key is not None else None,
            prefill_networks=_prefill_networks(role, extra.get("prefill_networks")),
        )


def _prefill_networks(role: str, value: object) -> tuple[Network, ...] | None:
    """The decode server's allow-list of prefill engines (CIDR networks); required for kv_consumer."""
    if role == "kv_producer":
        if value is not None:
            raise KvConnectorError("kv_connector_extra_config.prefill_networks is a kv_consumer setting")
        return None
    if value is None:
        raise KvConnectorError(
            "kv_connector_extra_config.prefill_networks is not set: a decode server joins the prefill engine "
            "that a request's kv_transfer_params name and grants it write access to KV blocks, so list the "
            'networks your prefill servers are in (e.g. ["10.1.0.0/16"]; ["0.0.0.0/0"] allows any engine)'
        )
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise KvConnectorError(
            "kv_connector_extra_config.prefill_networks must be a non-empty list of CIDR strings"
        )
    try:
        return tuple(ipaddress.ip_network(v, strict=False) for v in value)
    except ValueError as exc:
        raise KvConnectorError(f"kv_connector_extra_config.prefill_networks: {exc}") from exc


class RforkKvConnector(KVConnectorBase_V1):
    """vLLM KV connector (v1) moving prefilled KV with backends.kv one-sided writes."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = ConnectorSettings.from_vllm(vllm_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._worker: KvWorker | None = None
        # scheduler side
        self._address: bytes | None = None
        self._to_send: dict[str, list[int]] = {}
        self._to_recv: dict[str, tuple[list[int], RemotePrefill]] = {}
        self._offered: set[str] = set()  # prefill: requests whose blocks wait for their decode server
        self._fetching: set[str] = set()  # decode: requests whose KV the worker is fetching

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Decode: every prompt token not cached here comes from the prefill server, asynchronously."""
        params = request.kv_transfer_params
        if self.settings.producer or not params or not params.get("do_remote_prefill"):
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Decode: remember the blocks vLLM allocated for the remote tokens, to fetch next step."""
        params = request.kv_transfer_params
        if self.settings.producer or not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # once per request
        if num_external_tokens <= 0:
            return
        try:
            remote = RemotePrefill.from_params(params)
            if remote.block_size != self.block_size:
                raise KvParamsError(  # noqa: TRY301 - reported below like any bad params
                    f"the prefill server's block size is {remote.block_size}, this server's "
                    f"{self.block_size}: the rfork connector needs the same --block-size on both"
                )
        except KvParamsError as exc:
            # the worker reports these blocks as failed: vLLM's kv_load_failure_policy decides
            log.warning("rfork KV: request %s: %s", request.request_id, exc)
            remote = RemotePrefill(b"", request.request_id, (), self.block_size)
        local = list(blocks.get_unhashed_block_ids())
        self._to_recv[request.request_id] = (local, remote)
        self._fetching.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RforkKvMetadata(self._to_send, self._to_recv)
        self._to_send, self._to_recv = {}, {}
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: a request the decode server finishes keeps its blocks until they were collected."""
        params = request.kv_transfer_params
        if not self.settings.producer or not params or not params.get("do_remote_decode"):
            return False, None
        from vllm.v1.request import RequestStatus

        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # aborted or stopped: nothing for a decode server
        if self._address is None:
            log.warning("rfork KV: request %s finished before the worker's address was known",
                        request.request_id)
            return False, None
        prompt_blocks = math.ceil(len(request.prompt_token_ids or ()) / self.block_size)
        blocks = list(block_ids[:prompt_blocks])
        if not blocks:
            return False, None
        self._to_send[request.request_id] = blocks
        self._offered.add(request.request_id)
        remote = RemotePrefill(self._address, request.request_id, tuple(blocks), self.block_size)
        return True, remote.to_params()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Transfers the worker finished (delivered, failed or expired) no longer keep vLLM busy."""
        self._offered.difference_update(connector_output.finished_sending or ())
        self._fetching.difference_update(connector_output.finished_recving or ())

    def has_pending_push_work(self) -> bool:
        """Keep vLLM's engine loop stepping while transfers are open: an idle engine would never ask
        the worker again, so neither an offer's blocks nor an aborted fetch's would be freed."""
        return bool(self._offered or self._fetching)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """The workers' handshake metadata (rank 0's engine address: TP is 1)."""
        first = metadata.get(0)
        if isinstance(first, RforkKvHandshake):
            self._address = first.address
            log.info("rfork KV: worker engine %s", first.address[-8:].hex())

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        s = self.settings
        self._worker = KvWorker(
            producer=s.producer, kv_caches=kv_caches, provider=s.provider, timeout_s=s.timeout_s,
            abort_timeout_s=s.abort_timeout_s, channel_key=s.channel_key, prefill_networks=s.prefill_networks,
            name=f"vllm-decode-{self._vllm_config.instance_id}" if not s.producer else "",
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return RforkKvHandshake(self._worker.address) if self._worker is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start what this step's metadata asks: offers (prefill) or fetches (decode); never blocks."""
        worker, meta = self._worker, self._connector_metadata
        if worker is None or not isinstance(meta, RforkKvMetadata):
            return
        for rid, blocks in meta.to_send.items():
            worker.send(rid, blocks)
        for rid, (local, remote) in meta.to_recv.items():
            worker.receive(rid, local, remote)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a fetched request runs only after all its KV landed (async load)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing to save per layer: prefill offers a request's blocks once it finished."""

    def wait_for_save(self) -> None:
        """Nothing pending: offers are asynchronous and hold their blocks until delivered."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        worker = self._worker
        if worker is None:
            return None, None
        if worker.producer:
            return worker.finished_sending() or None, None
        worker.cancel(finished_req_ids)  # finished while still fetching: aborted
        return None, worker.finished_receiving() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
