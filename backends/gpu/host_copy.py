"""Copies between a device tensor and its registered host staging memory, complete when they return.

The KV, MoE and RL device paths keep their wire buffers in host memory registered with the engine
(the libfabric builds rfork carries cannot register GPU memory) and copy device <-> host around each
transfer. These helpers make each copy *finished* on return: a device-to-host copy must be in host
memory before the network reads it, and a host-to-device copy must be done before the host memory
is handed back to peers. They run on the caller's current CUDA stream, so work the caller queued on
the device tensor comes first. With a CPU "device" (the tests, the CPU rehearsal) they are plain
copies through the same code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["copy_now", "device_of", "page_runs", "pinned_empty", "synchronize"]


def pinned_empty(nbytes: int) -> torch.Tensor:
    """Uninitialised host bytes, page-locked when CUDA exists (so device copies are async DMA)."""
    return torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def device_of(device: torch.device | str | None) -> torch.device:
    """The device as a torch.device; None means cuda:<current> where CUDA exists, else cpu."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    return torch.device(device)


def synchronize(*tensors: torch.Tensor) -> None:
    """Wait for the current stream of every CUDA device among tensors (no-op for CPU tensors)."""
    seen: set[torch.device] = set()
    for t in tensors:
        if t.device.type == "cuda" and t.device not in seen:
            seen.add(t.device)
            torch.cuda.current_stream(t.device).synchronize()


def copy_now(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), finished on return (async DMA between pinned host and device, then one sync)."""
    dst.copy_(src, non_blocking=True)
    synchronize(dst, src)


def page_runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """(first page, count) of each run of consecutive page ids, in the given order."""
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs
