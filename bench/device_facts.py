"""Facts a device benchmark's JSON carries beside its figures (rfork bench kv/moe/rl --device)."""

from __future__ import annotations

import os
from typing import Any


def machine_facts(device: str | None) -> dict[str, Any]:
    """What a device figure needs beside it: GPU, torch, CUDA, libfabric, CPUs, load average."""
    import torch  # imported here: `rfork bench --help` imports every benchmark (start-up time)

    facts: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        # imported here: `rfork bench --help` imports every benchmark, which must stay light (start-up time)
        from backends.providers import _native

        facts["libfabric"] = "{}.{}".format(*_native.VERSION)
        facts["libfabric_library"] = _native.LIBRARY or "system"
    except (ImportError, AttributeError) as exc:
        facts["libfabric"] = f"unknown ({exc})"
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts["gpu"] = props.name
        facts["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        facts["processes_on_one_gpu"] = True
    return facts
