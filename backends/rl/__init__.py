"""RL weight updates: trainer ranks write new weights into running inference ranks (one-sided).

A path of the transport library beside KV and MoE: it reshards between trainer and inference TP
layouts by `backends.sharding` and places shards in regions by `backends.layout`, and speaks to
the transport only through `backends.TransferEngine`. See docs/rl.md.
"""

from backends.rl.receiver import RLReceiver, Snapshot
from backends.rl.schedule import RankShard, ReceiverSchedule, Run, build_receiver_schedule
from backends.rl.spec import RLError, TensorSpec, TrainerRank, model_specs, shard_layout, specs_digest
from backends.rl.trainer import RLTrainer, UpdateResult

__all__ = [
    "RLError",
    "RLReceiver",
    "RLTrainer",
    "RankShard",
    "ReceiverSchedule",
    "Run",
    "Snapshot",
    "TensorSpec",
    "TrainerRank",
    "UpdateResult",
    "build_receiver_schedule",
    "model_specs",
    "shard_layout",
    "specs_digest",
]
