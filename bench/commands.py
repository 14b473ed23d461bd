"""The commands `rfork` runs from this checkout: `rfork demo`, `rfork bench ...`, `rfork simulate ...`.

rfork/cli/checkout_commands.py imports this module by name only when one of them runs (the wheel does not ship
bench/). Each module has `configure(parser)` and `run(args) -> int`, like rfork/cli's command modules,
and keeps its top-level imports light: `rfork bench --help` imports every one of them.
"""

from __future__ import annotations

from types import ModuleType

from bench import (
    api_ready,
    cold_start,
    demo,
    digest,
    gpu,
    kv,
    lora,
    moe,
    nccl,
    pd,
    planner,
    rl,
    rl_delta,
    rollout,
    scale_out,
    shards,
    transport,
)
from bench.fleet import command as fleet
from bench.simulate import scale_out as simulate_scale_out

# (command path, implementing module). Groups ("bench", "simulate") are created on the way.
COMMANDS: tuple[tuple[tuple[str, ...], ModuleType], ...] = (
    (("demo",), demo),
    (("bench", "transport"), transport),
    (("bench", "cold-start"), cold_start),
    (("bench", "planner"), planner),
    (("bench", "gpu"), gpu),
    (("bench", "rl"), rl),
    (("bench", "rl-delta"), rl_delta),
    (("bench", "rollout"), rollout),
    (("bench", "moe"), moe),
    (("bench", "kv"), kv),
    (("bench", "lora"), lora),
    (("bench", "pd"), pd),
    (("bench", "nccl"), nccl),
    (("bench", "scale-out"), scale_out),
    (("bench", "digest"), digest),
    (("bench", "shards"), shards),
    (("bench", "api-ready"), api_ready),
    (("bench", "fleet"), fleet),
    (("simulate", "scale-out"), simulate_scale_out),
)
