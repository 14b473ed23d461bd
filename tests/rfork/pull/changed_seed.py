"""A seed process whose memory changes after it published its digests (test program).

    python -m tests.rfork.pull.changed_seed CHECKPOINT PLANNER_URL READY_FILE PROVIDER

Serves rank 0 of CHECKPOINT, publishes it (digests of the real bytes, so its manifest matches the
anchor), then overwrites every byte it serves with 0x5A: what an in-place update or a memory fault
looks like from the outside. Any byte a loader reads from it afterwards is wrong. Runs until killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import torch

from rfork.seed.seed import Seed
from rfork.weights.checkpoint import load_rank_from_disk, read_checkpoint_info
from rfork.weights.rank_weights import RankWeights


def main(ckpt: str, planner_url: str, ready_file: str, provider: str) -> None:
    info = read_checkpoint_info(Path(ckpt))
    layout, buffers, tensors = load_rank_from_disk(info)
    weights = RankWeights(rank=0, layout=layout, buffers=buffers, tensors=tensors)
    seed = Seed(
        weights=[weights],
        identity=info.identity(),
        planner_url=planner_url,
        providers=[provider],
        control=False,
        timeout_s=2.0,
        token=os.environ.get("RFORK_REGISTER_TOKEN"),
    )
    seed.start()
    for buf in buffers:
        buf.view(torch.uint8).fill_(0x5A)
    Path(ready_file).write_text(json.dumps({"instance_ids": seed.instance_ids}))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    seed.close()


if __name__ == "__main__":
    main(*sys.argv[1:5])
