"""Expert-parallel dispatch/combine with tokens and expert outputs in GPU memory, staged through pinned host.

`DeviceExpertParallel` is an `ExpertParallel` whose four registered wire buffers are pinned host
memory; the round's protocol (records, headers, immediates counted by the ImmCounter, the connect
handshake) is the host one, unchanged. Around it:

    dispatch_send(x, ids)   x (device) -> pinned staging rows, then the host dispatch_send
    dispatch_recv()         host dispatch_recv, then each source's used records -> a device copy of
                            the receive buffer; the Dispatched it returns holds device views
    combine_send(d)         d.out (device) -> the registered host out rows, then the host combine_send
    combine_recv(w)         wait as the host does, copy the rows of this rank's pairs (its own block and
                            the received block, two contiguous copies) to the device and reduce there

Every copy is finished before the host buffer it reads or writes is handed to peers again, so the
host round's buffer-reuse argument holds unchanged. A CPU `device` runs the same code (the tests).
"""

from __future__ import annotations

from typing import Any

import torch

from backends.engine import TransferEngine
from backends.gpu.host_copy import copy_now, device_of, synchronize
from backends.moe.expert_parallel import Dispatched, ExpertParallel, MoEError
from backends.moe.routing import combine_reduce

__all__ = ["DeviceExpertParallel"]


class DeviceExpertParallel(ExpertParallel):
    """One rank of an expert-parallel group whose activations live on `device` (see the module doc).

    Takes ExpertParallel's keyword arguments; `device` defaults to the current CUDA device. Not
    thread-safe, like ExpertParallel.
    """

    def __init__(self, engine: TransferEngine, *, device: torch.device | str | None = None,
                 **kwargs: Any) -> None:  # noqa: ANN401 - ExpertParallel's keyword arguments
        kwargs.setdefault("pin_memory", torch.cuda.is_available())
        super().__init__(engine, **kwargs)
        self.device = device_of(device)
        dev = self.device
        self._x_stage = torch.empty(self.max_tokens, self.hidden, dtype=torch.bfloat16,
                                    pin_memory=bool(kwargs["pin_memory"]))
        self._dev_recv = torch.zeros(self._recv_buf.numel(), dtype=torch.uint8, device=dev)
        self._dev_views = self._record_views(self._dev_recv)
        self._dev_out = torch.empty(self._out_buf.shape, dtype=torch.bfloat16, device=dev)
        self._dev_rows = torch.empty(2 * self.max_tokens * self.topk, self.hidden, dtype=torch.bfloat16,
                                     device=dev)
        self._host_dispatched: Dispatched | None = None

    def dispatch_send(self, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Send device tokens x [T, hidden] (bf16); topk_ids [T, k] on any device (see ExpertParallel)."""
        if x.dim() != 2 or x.shape[1] != self.hidden or x.dtype != torch.bfloat16:
            raise ValueError(f"x must be bf16 [T, {self.hidden}], not {x.dtype} {list(x.shape)}")
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens exceed max_tokens={self.max_tokens}")
        staged = self._x_stage[: x.shape[0]]
        copy_now(staged, x)
        super().dispatch_send(staged, topk_ids.to("cpu"))

    def dispatch_recv(self) -> Dispatched:
        """Wait for every peer's tokens; the returned Dispatched's x, scales, pair_row, pair_expert and
        out are on the device (out: write each pair's expert output there before combine_send)."""
        host = super().dispatch_recv()
        self._host_dispatched = host
        for s, n in enumerate(host.source_tokens):
            lo = s * self._slot_bytes
            hi = lo + (1 + n) * self.record_bytes
            self._dev_recv[lo:hi].copy_(self._recv_buf[lo:hi], non_blocking=True)
        pair_row = host.pair_row.to(self.device, non_blocking=True)
        pair_expert = host.pair_expert.to(self.device, non_blocking=True)
        synchronize(self._dev_recv)  # peers may rewrite the host buffer once we combine_send
        return Dispatched(
            x=self._dev_views.rows,
            scales=self._dev_views.scales,
            pair_row=pair_row,
            pair_expert=pair_expert,
            out=self._dev_out[: host.plan.total_pairs],
            source_tokens=host.source_tokens,
            num_local_experts=host.num_local_experts,
            plan=host.plan,
            round=host.round,
        )

    def combine_send(self, dispatched: Dispatched, out: torch.Tensor | None = None) -> None:
        """Send each pair's expert output (dispatched.out, or `out`, on the device) back to its source."""
        host = self._host_dispatched
        if host is None or dispatched.plan is not host.plan:
            raise MoEError(f"rank {self.rank}: combine_send got a Dispatched from round {dispatched.round}")
        src = dispatched.out if out is None else out
        if tuple(src.shape) != tuple(host.out.shape):
            raise ValueError(f"out must be {list(host.out.shape)}, not {list(src.shape)}")
        copy_now(host.out, src)
        super().combine_send(host)

    def combine_recv(self, topk_weights: torch.Tensor) -> torch.Tensor:
        """Wait for every expert output of this rank's tokens, then reduce on the device: [T, hidden] bf16."""
        plan = self._combine_plan(topk_weights)
        with self._step("combine_recv", "idle"):
            self._combine_collect()
            # Our pairs served by ourselves (out rows [start, start + n)), then every peer's (back rows
            # [0, total)), as one device block; pair_slot re-based onto it.
            offset, start, n = self._self_block
            total = plan.total_pairs
            rows = self._dev_rows[: n + total]
            rows[:n].copy_(self._out_buf[start:start + n], non_blocking=True)
            rows[n:].copy_(self._back_buf[:total], non_blocking=True)
            slot = plan.pair_slot
            mine = (slot >= offset) & (slot < offset + n)
            index = torch.where(mine, slot - offset, slot + n)
            index = torch.where(slot >= 0, index, -1)
            y = combine_reduce(rows, index, topk_weights, torch.bfloat16)
            synchronize(rows)  # the host rows are rewritten by the next round once we return
            return y
