"""Expert-parallel MoE dispatch and combine among P ranks over the TransferEngine.

Each rank registers four buffers once, at set-up, and exchanges descriptors (`setup_blob` /
`connect`). A round is four split calls, so expert compute (or anything else) can run between
sending and receiving:

    ep.dispatch_send(x, topk_ids)      # pack, then one one-sided write (+imm) per peer; returns at once
    d = ep.dispatch_recv()             # wait for every peer's write; d.x, d.pair_row, d.pair_expert
    for e, pairs in enumerate(d.expert_pairs()):
        d.out[pairs] = experts[e](d.gather(pairs))
    ep.combine_send(d)                 # one write (+imm) per source, straight from d.out
    y = ep.combine_recv(topk_weights)  # wait, then reduce in fp32 with the routing weights

Wire layout: a *record* is one token row (bf16, or fp8 plus an fp32 scale) followed by its k
expert ids (int32, -1 where the expert lives elsewhere). Each source owns a slot of
max_tokens + 1 records in every receiver's dispatch buffer; record 0 is a header (round, token
count, where the outputs go back, pair count), so the token count travels in the same write as the
tokens, and every source writes every peer each round (a header alone when it has no tokens for
it). Combine writes each source's pairs as one contiguous block of bf16 rows at the offset the
source put in its header.

Completion: writes carry 32-bit immediates from the receiver's channel range ("moe/<group>", 3P
values advertised in its set-up blob: index source rank for dispatch, P + rank for combine, 2P +
rank for the connect handshake), counted by the engine's ImmCounter, so a receiver waits for
exactly P-1 arrivals per phase and never for a barrier. Buffer reuse is safe without one: a rank
starts round N+1 only after its combine_recv of round N, which needs every peer's combine_send of
round N, which each peer calls only once it no longer needs round N's dispatch buffer. Writes of a
round complete before its receive call returns.

Engines: give the engine a chunk_bytes at least as large as the largest write
(`ExpertParallel.largest_write`), so each write is one message that carries its imm itself; a
multi-chunk write with an imm needs delivery-complete on every chunk, which costs ~2 ms per op on
shm (docs/transport.md).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from backends.channel import ImmRange
from backends.descriptor import MemoryRegionDescriptor
from backends.engine import TransferEngine
from backends.errors import TransferError
from backends.moe.routing import (
    WIRE_DTYPES,
    RecvPlan,
    SendPlan,
    check_topk_ids,
    combine_reduce,
    dequantize_fp8,
    expert_placement,
    group_by_expert,
    plan_dispatch,
    plan_receive,
    quantize_fp8,
)

log = logging.getLogger(__name__)

_HEADER_FIELDS = 4  # round, tokens, combine offset (rows), pairs
_BLOB_VERSION = 2  # 2: each rank's immediate range instead of a shared imm_base


class MoEError(TransferError):
    """A dispatch/combine round failed: a peer is missing or misbehaved, or calls came out of order."""


class MoETimeout(MoEError):
    """Peers did not deliver their part of a round within timeout_s."""


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass
class _RecordViews:
    """Typed views over a buffer of records (see the module docstring for the layout)."""

    rows: torch.Tensor  # [P * slots, hidden] in the wire dtype (strided)
    rows_u8: torch.Tensor  # the same bytes as uint8
    scales: torch.Tensor | None  # [P * slots] float32 (strided), fp8 only
    ids: torch.Tensor  # [P * slots, k] int32 (strided)
    headers: torch.Tensor  # [P, header fields] int64 (strided), record 0 of each slot


@dataclass(frozen=True)
class _Peer:
    """What a rank tells the others at set-up: where to write its tokens and outputs, how to signal it."""

    dispatch: MemoryRegionDescriptor  # its dispatch receive buffer
    combine: MemoryRegionDescriptor  # its combine receive buffer
    imms: ImmRange  # its channel's immediates


@dataclass
class Dispatched:
    """What dispatch_recv hands the expert compute; views into registered buffers, valid for one round.

    x: every receive row in the wire dtype (bf16 or float8_e4m3fn), header and unused rows included;
    index it with pair_row. scales: per-row fp32 scales for fp8, else None.
    pair_row / pair_expert: [M] int64, the receive row and local expert of each pair, in (source,
    token, slot) order. out: [M, hidden] bf16 registered memory; write each pair's expert output to
    out[m] before combine_send. source_tokens[s]: tokens received from rank s.
    """

    x: torch.Tensor
    scales: torch.Tensor | None
    pair_row: torch.Tensor
    pair_expert: torch.Tensor
    out: torch.Tensor
    source_tokens: list[int]
    num_local_experts: int
    plan: RecvPlan = field(repr=False)
    round: int = 0

    def expert_pairs(self) -> list[torch.Tensor]:
        """Pair indices per local expert, ascending (tokens in (source, token) order)."""
        return group_by_expert(self.pair_expert, self.num_local_experts)

    def gather(self, pairs: torch.Tensor) -> torch.Tensor:
        """The bf16 input rows of these pairs (dequantised when the wire is fp8); a copy."""
        rows = self.pair_row.index_select(0, pairs)
        picked = self.x.index_select(0, rows)
        if self.scales is None:
            return picked
        return dequantize_fp8(picked, self.scales.index_select(0, rows))

    def expert_counts(self) -> list[int]:
        """Pairs per local expert (0 for an expert no token chose)."""
        return [int(c) for c in torch.bincount(self.pair_expert, minlength=self.num_local_experts).tolist()]


class ExpertParallel:
    """One rank of an expert-parallel group: registered buffers plus the four split round calls.

    Not thread-safe: one thread drives the rounds. Calls must come in the order dispatch_send,
    dispatch_recv, combine_send, combine_recv (MoEError otherwise). After a failure the group is
    broken: every later call raises, because peers may have half a round in flight. `group` names the
    group (every rank gives the same; groups sharing an engine need different names).
    """

    def __init__(
        self,
        engine: TransferEngine,
        *,
        rank: int,
        world_size: int,
        num_experts: int,
        hidden: int,
        topk: int,
        max_tokens: int,
        expert_to_rank: Sequence[int] | torch.Tensor | None = None,
        wire: str = "bf16",
        group: str = "moe",
        timeout_s: float = 30.0,
        pin_memory: bool = False,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if hidden < 1 or topk < 1 or max_tokens < 1:
            raise ValueError(f"hidden ({hidden}), topk ({topk}) and max_tokens ({max_tokens}) must be >= 1")
        if wire not in WIRE_DTYPES:
            raise ValueError(f"wire must be one of {WIRE_DTYPES}, not {wire!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        self.engine = engine
        self.rank = rank
        self.world_size = world_size
        self.num_experts = num_experts
        self.hidden = hidden
        self.topk = topk
        self.max_tokens = max_tokens
        self.wire = wire
        self.group = group
        self.timeout_s = float(timeout_s)
        self.expert_to_rank, self.expert_to_local = expert_placement(num_experts, world_size, expert_to_rank)
        self.num_local_experts = int((self.expert_to_rank == rank).sum())

        # Record: token row, [fp8 scale], k expert ids; 64-byte aligned so rows stay aligned.
        self._row_bytes = hidden * (1 if wire == "fp8" else 2)
        self._scale_off = _align(self._row_bytes, 4)
        self._ids_off = self._scale_off + (4 if wire == "fp8" else 0)
        self.record_bytes = _align(max(self._ids_off + 4 * topk, 8 * _HEADER_FIELDS), 64)
        self._slot_records = max_tokens + 1
        self._slot_bytes = self._slot_records * self.record_bytes
        self._out_row_bytes = hidden * 2
        max_pairs_in = world_size * max_tokens * min(topk, max(self.num_local_experts, 1))

        p = world_size
        # pin_memory: page-locked buffers, for a caller that copies them to and from a GPU
        self._send_buf = torch.zeros(p * self._slot_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._recv_buf = torch.zeros(p * self._slot_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        # Expert outputs we send (out) and those we get back (back) share one tensor, registered as
        # two regions, so the reduction reads our own experts' outputs in place instead of copying them.
        self._pair_rows = torch.zeros(
            max_pairs_in + max_tokens * topk, hidden, dtype=torch.bfloat16, pin_memory=pin_memory
        )
        self._out_buf = self._pair_rows[:max_pairs_in]
        self._back_buf = self._pair_rows[max_pairs_in:]
        self._self_block = (0, 0, 0)  # (offset in back, start in out, rows) of our pairs for ourselves
        self.channel = engine.channel(f"moe/{group}", imms=3 * world_size)
        self._send_reg = engine.register(self._send_buf, "read")
        self._recv_reg = engine.register(self._recv_buf, "write")
        self._out_reg = engine.register((self._out_buf.data_ptr(), self._out_buf.nbytes), "read")
        self._back_reg = engine.register((self._back_buf.data_ptr(), self._back_buf.nbytes), "write")

        self._send = self._record_views(self._send_buf)
        self._recv = self._record_views(self._recv_buf)
        if engine.chunk_bytes < self.largest_write:
            log.warning(
                "moe rank %d: engine chunk_bytes=%d splits writes of up to %d bytes into chunks "
                "(correct, but slower: each chunk then needs delivery-complete)",
                rank,
                engine.chunk_bytes,
                self.largest_write,
            )
        self._peers: list[_Peer] = []  # per rank, filled by connect
        self._round = 0
        self._state = "idle"
        self._broken: str | None = None
        self._send_plan: SendPlan | None = None
        self._recv_plan: RecvPlan | None = None
        self._inflight: list[tuple[int, Future[None]]] = []
        self._arrivals: list[tuple[int, Future[None]]] = []

    # ----- set-up -------------------------------------------------------------------------------
    @property
    def largest_write(self) -> int:
        """Bytes of the largest single write this group issues (size the engine's chunk_bytes to it)."""
        combine = self.max_tokens * min(self.topk, self.num_experts) * self._out_row_bytes
        return max(self._slot_bytes, combine)

    def setup_blob(self) -> bytes:
        """This rank's settings and buffer descriptors; give every rank's blob, in rank order, to connect."""
        doc = {
            "v": _BLOB_VERSION,
            "rank": self.rank,
            "settings": self._settings(),
            "dispatch": base64.b64encode(self._recv_reg.descriptor.to_bytes()).decode(),
            "combine": base64.b64encode(self._back_reg.descriptor.to_bytes()).decode(),
            "imms": self.channel.imms.to_json(),
        }
        return json.dumps(doc, sort_keys=True).encode()

    def _settings(self) -> dict[str, object]:
        return {
            "world_size": self.world_size,
            "num_experts": self.num_experts,
            "hidden": self.hidden,
            "topk": self.topk,
            "max_tokens": self.max_tokens,
            "wire": self.wire,
            "group": self.group,
            "expert_to_rank": self.expert_to_rank.tolist(),
            "provider": self.engine.provider,
        }

    def connect(self, blobs: Sequence[bytes]) -> None:
        """Check every rank's blob against our settings, then handshake with each peer (bounded by timeout_s).

        The handshake (one immediate each way) makes the first round pay no connection set-up and
        proves every peer can write to us. MoEError names the rank and field that disagree.
        """
        if self._peers:
            raise MoEError(f"rank {self.rank}: connect called twice")
        if len(blobs) != self.world_size:
            raise MoEError(
                f"rank {self.rank}: connect got {len(blobs)} blobs for a world of {self.world_size}"
            )
        mine = self._settings()
        peers = [self._peer_from_blob(r, blob, mine) for r, blob in enumerate(blobs)]
        self._peers = peers
        hello = 2 * self.world_size
        others = [r for r in range(self.world_size) if r != self.rank]
        with self._step("connect", "idle"):
            sent = [(r, self.engine.write_imm(peers[r].imms.value(hello + self.rank), peers[r].dispatch))
                    for r in others]
            arrived = self._expect_from_peers(hello)
            self._wait(sent, "connect", "handshake write to")
            self._wait(arrived, "connect", "handshake from")
        log.info("moe rank %d/%d connected (%s)", self.rank, self.world_size, self.engine.provider)

    def _peer_from_blob(self, r: int, blob: bytes, mine: dict[str, object]) -> _Peer:
        """Rank r's buffers and immediates, once its blob is well formed and agrees with ours."""
        try:
            doc = json.loads(blob)
            version, rank, settings = doc.get("v"), doc["rank"], dict(doc["settings"])
            dispatch = MemoryRegionDescriptor.from_bytes(base64.b64decode(doc["dispatch"]))
            combine = MemoryRegionDescriptor.from_bytes(base64.b64decode(doc["combine"]))
            imms = ImmRange.from_json(doc["imms"])
        except (ValueError, KeyError, TypeError, AttributeError, TransferError) as exc:
            raise MoEError(f"rank {self.rank}: rank {r}'s set-up blob is malformed: {exc}") from exc
        if version != _BLOB_VERSION:
            raise MoEError(f"rank {r}'s set-up blob has version {version!r}, not {_BLOB_VERSION}")
        if rank != r:
            raise MoEError(f"blob {r} belongs to rank {rank}")
        for name, value in mine.items():
            if settings.get(name) != value:
                raise MoEError(f"rank {r} has {name}={settings.get(name)!r}, rank {self.rank} has {value!r}")
        if dispatch.length != self._recv_buf.numel() or combine.length != self._back_buf.numel() * 2:
            raise MoEError(f"rank {r}'s buffers have sizes this rank's settings do not produce")
        if imms.count != 3 * self.world_size:
            need = 3 * self.world_size
            raise MoEError(f"rank {r} has {imms.count} immediates, a group of {self.world_size} needs {need}")
        return _Peer(dispatch, combine, imms)

    # ----- the round ----------------------------------------------------------------------------
    def dispatch_send(self, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Send tokens x [T, hidden] (bf16) to the ranks owning their experts topk_ids [T, k] (-1 = none).

        Packs every destination's records, then posts one write per peer and returns; our own
        tokens are packed straight into our receive buffer. T may differ between ranks and rounds
        (0 <= T <= max_tokens). Bad input raises ValueError and leaves the group usable.
        """
        self._enter("dispatch_send", "idle")
        if x.dim() != 2 or x.shape[1] != self.hidden or x.dtype != torch.bfloat16:
            raise ValueError(f"x must be bf16 [T, {self.hidden}], not {x.dtype} {list(x.shape)}")
        if tuple(topk_ids.shape) != (x.shape[0], self.topk):
            raise ValueError(f"topk_ids must be [{x.shape[0]}, {self.topk}], not {list(topk_ids.shape)}")
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens exceed max_tokens={self.max_tokens}")
        check_topk_ids(topk_ids, self.num_experts)
        with self._step("dispatch_send", "dispatched"):
            self._round += 1
            plan = plan_dispatch(topk_ids, self.expert_to_rank, self.world_size)
            self._send_plan = plan
            scales = None
            if self.wire == "fp8":
                q, scales = quantize_fp8(x)
                rows = self._as_row_bytes(q)
            else:
                rows = self._as_row_bytes(x)
            for dest in self._peer_order():
                # Our own tokens go straight into our receive buffer; the others into send slot `dest`.
                self._pack(self._recv if dest == self.rank else self._send, rows, scales, plan, dest)
                if dest == self.rank:
                    continue
                nbytes = (1 + int(plan.dest_tokens[dest].numel())) * self.record_bytes
                peer = self._peers[dest]
                fut = self.engine.write(
                    self._send_reg,
                    dest * self._slot_bytes,
                    nbytes,
                    peer.dispatch,
                    self.rank * self._slot_bytes,
                    imm=peer.imms.value(self.rank),
                )
                self._inflight.append((dest, fut))
            self._arrivals = self._expect_from_peers(0)

    def dispatch_recv(self) -> Dispatched:
        """Wait for every peer's tokens of this round (bounded by timeout_s) and plan the expert work."""
        self._enter("dispatch_recv", "dispatched")
        with self._step("dispatch_recv", "received"):
            self._wait(self._arrivals, "dispatch_recv", "tokens from")
            self._wait(self._inflight, "dispatch_recv", "write of tokens to")
            self._arrivals, self._inflight = [], []
            ids_by_source, row_base, counts = [], [], []
            for s in range(self.world_size):
                rnd, n, _, _ = self._header(self._recv, s)
                if rnd != self._round or not 0 <= n <= self.max_tokens:
                    raise MoEError(
                        f"rank {self.rank} round {self._round}: header from rank {s} says round {rnd}, "
                        f"{n} tokens (peers out of step, or a mismatched group)"
                    )
                first = s * self._slot_records + 1
                ids_by_source.append(self._recv.ids[first : first + n])
                row_base.append(first)
                counts.append(n)
            try:
                plan = plan_receive(
                    ids_by_source, row_base, self.expert_to_rank, self.expert_to_local, self.rank
                )
            except ValueError as exc:
                raise MoEError(f"round {self._round}: {exc}") from exc
            self._recv_plan = plan
        return Dispatched(
            x=self._recv.rows,
            scales=self._recv.scales,
            pair_row=plan.pair_row,
            pair_expert=plan.pair_expert,
            out=self._out_buf[: plan.total_pairs],
            source_tokens=counts,
            num_local_experts=self.num_local_experts,
            plan=plan,
            round=self._round,
        )

    def combine_send(self, dispatched: Dispatched, out: torch.Tensor | None = None) -> None:
        """Send each pair's expert output back to its source: one write per peer, from dispatched.out.

        Pass `out` ([M, hidden]) only if the outputs are not already in dispatched.out (it is copied).
        """
        self._enter("combine_send", "received")
        plan = self._recv_plan
        assert plan is not None
        if dispatched.plan is not plan:
            raise MoEError(f"rank {self.rank}: combine_send got a Dispatched from round {dispatched.round}")
        if out is not None and tuple(out.shape) != (plan.total_pairs, self.hidden):
            raise ValueError(f"out must be [{plan.total_pairs}, {self.hidden}], not {list(out.shape)}")
        with self._step("combine_send", "combined"):
            if out is not None:
                dispatched.out.copy_(out)
            row = self._out_row_bytes
            start = [0] * self.world_size
            for s in range(1, self.world_size):
                start[s] = start[s - 1] + plan.source_pairs[s - 1]
            for src in self._peer_order():
                n = plan.source_pairs[src]
                _, _, offset, pairs = self._header(self._recv, src)
                if pairs != n:
                    raise MoEError(f"rank {src}'s header promised {pairs} pairs, its ids hold {n}")
                if not 0 <= offset <= self._back_buf.shape[0] - n:
                    raise MoEError(
                        f"rank {src}'s header puts {n} outputs at row {offset}, outside its "
                        f"{self._back_buf.shape[0]}-row combine buffer"
                    )
                if src == self.rank:
                    self._self_block = (offset, start[src], n)
                    continue
                peer = self._peers[src]
                imm = peer.imms.value(self.world_size + self.rank)
                if n:
                    fut = self.engine.write(
                        self._out_reg, start[src] * row, n * row, peer.combine, offset * row, imm=imm
                    )
                else:
                    fut = self.engine.write_imm(imm, peer.combine)
                self._inflight.append((src, fut))
            self._arrivals = self._expect_from_peers(self.world_size)

    def _combine_plan(self, topk_weights: torch.Tensor) -> SendPlan:
        """combine_recv's entry: the state check and this round's send plan, `topk_weights` checked
        against it."""
        self._enter("combine_recv", "combined")
        plan = self._send_plan
        assert plan is not None
        if tuple(topk_weights.shape) != tuple(plan.pair_slot.shape):
            raise ValueError(
                f"topk_weights must be {list(plan.pair_slot.shape)}, not {list(topk_weights.shape)}"
            )
        return plan

    def _combine_collect(self) -> None:
        """Every expert output for this rank's tokens has arrived, and our own writes of them landed."""
        self._wait(self._arrivals, "combine_recv", "expert outputs from")
        self._wait(self._inflight, "combine_recv", "write of expert outputs to")
        self._arrivals, self._inflight = [], []

    def combine_recv(self, topk_weights: torch.Tensor) -> torch.Tensor:
        """Wait for every expert output of this rank's tokens, then reduce: [T, hidden] bf16.

        y[t] = sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), in fp32, j in order.
        """
        plan = self._combine_plan(topk_weights)
        with self._step("combine_recv", "idle"):
            self._combine_collect()
            # Pairs we served ourselves are read from out; the rest from back, behind it.
            slot = plan.pair_slot
            offset, start, n = self._self_block
            mine = (slot >= offset) & (slot < offset + n)
            rows = torch.where(mine, slot - offset + start, slot + self._out_buf.shape[0])
            rows = torch.where(slot >= 0, rows, -1)
            return combine_reduce(self._pair_rows, rows, topk_weights, torch.bfloat16)

    def close(self) -> None:
        """Deregister the buffers (the engine stays open: it belongs to the caller)."""
        for reg in (self._send_reg, self._recv_reg, self._out_reg, self._back_reg):
            self.engine.deregister(reg)
        self.channel.close()
        self._state = "closed"

    def __enter__(self) -> ExpertParallel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- internals ----------------------------------------------------------------------------
    def _record_views(self, buf: torch.Tensor) -> _RecordViews:
        rec = buf.view(self.world_size * self._slot_records, self.record_bytes)
        rows_u8 = rec[:, : self._row_bytes]
        rows = rows_u8.view(torch.float8_e4m3fn if self.wire == "fp8" else torch.bfloat16)
        scales = (
            rec[:, self._scale_off : self._scale_off + 4].view(torch.float32).squeeze(1)
            if self.wire == "fp8"
            else None
        )
        ids = rec[:, self._ids_off : self._ids_off + 4 * self.topk].view(torch.int32)
        headers = rec[:: self._slot_records, : 8 * _HEADER_FIELDS].view(torch.int64)
        return _RecordViews(rows, rows_u8, scales, ids, headers)

    def _peer_order(self) -> list[int]:
        """Peers starting after this rank (spreads the load: not everyone writes rank 0 first), self last."""
        p = self.world_size
        return [(self.rank + i) % p for i in range(1, p)] + [self.rank]

    def _pack(
        self,
        views: _RecordViews,
        rows: torch.Tensor,
        scales: torch.Tensor | None,
        plan: SendPlan,
        dest: int,
    ) -> None:
        """Write the header and dest's records into slot `dest` of views (our send or receive buffer)."""
        tokens = plan.dest_tokens[dest]
        n = int(tokens.numel())
        first = dest * self._slot_records + 1
        if n:
            torch.index_select(rows, 0, tokens, out=views.rows_u8[first : first + n])
            views.ids[first : first + n] = plan.dest_ids[dest]
            if scales is not None and views.scales is not None:
                torch.index_select(scales, 0, tokens, out=views.scales[first : first + n])
        header = torch.tensor(
            [self._round, n, plan.combine_offsets[dest], plan.pair_counts[dest]], dtype=torch.int64
        )
        views.headers[dest] = header

    def _as_row_bytes(self, t: torch.Tensor) -> torch.Tensor:
        """[T, row_bytes] uint8 view of token rows (flattened first: a size-1 dim may carry any stride)."""
        return t.contiguous().reshape(-1).view(torch.uint8).view(t.shape[0], self._row_bytes)

    def _header(self, views: _RecordViews, slot: int) -> tuple[int, int, int, int]:
        rnd, n, offset, pairs = views.headers[slot].tolist()
        return int(rnd), int(n), int(offset), int(pairs)

    def _enter(self, call: str, state: str) -> None:
        if self._broken is not None:
            raise MoEError(f"rank {self.rank}: {call} on a broken group ({self._broken})")
        if not self._peers:
            raise MoEError(f"rank {self.rank}: {call} before connect")
        if self._state != state:
            raise MoEError(f"rank {self.rank}: {call} called in state {self._state!r}, needs {state!r}")

    @contextlib.contextmanager
    def _step(self, call: str, next_state: str) -> Iterator[None]:
        """Run one step of a round: on success move to next_state, on any failure break the group."""
        try:
            yield
        except BaseException as exc:
            self._broken = f"{call} failed: {exc}"
            raise
        self._state = next_state

    def _expect_from_peers(self, first: int) -> list[tuple[int, Future[None]]]:
        """An expect per peer for index first + its rank (per-peer values: a timeout names who is missing)."""
        return [(r, self.channel.expect(first + r)) for r in range(self.world_size) if r != self.rank]

    def _wait(self, futures: list[tuple[int, Future[None]]], call: str, what: str) -> None:
        """Wait for every (rank, future) within timeout_s overall; MoEError naming the ranks that failed."""
        deadline = time.monotonic() + self.timeout_s
        missing: list[int] = []
        for r, fut in futures:
            try:
                fut.result(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                missing.append(r)
            except TransferError as exc:
                raise MoEError(
                    f"rank {self.rank} round {self._round} {call}: {what} rank {r} failed: {exc}"
                ) from exc
        if missing:
            raise MoETimeout(
                f"rank {self.rank} round {self._round} {call}: {what} rank(s) {missing} "
                f"not complete within {self.timeout_s:g}s"
            )
