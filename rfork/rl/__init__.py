"""RL weight updates: trainer ranks write new weights into running inference ranks (one-sided).

Lives in rfork/ rather than backends/ because it needs rfork's tensor-parallel sharding rule
(`rfork.checkpoint`) and region layout (`rfork.layout`); it speaks to the transport only through
`backends.TransferEngine`. See docs/rl.md.
"""

from rfork.rl.receiver import RLReceiver, Snapshot
from rfork.rl.schedule import RankShard, ReceiverSchedule, Run, build_receiver_schedule
from rfork.rl.spec import RLError, TensorSpec, TrainerRank, model_specs, shard_layout, specs_digest
from rfork.rl.trainer import RLTrainer, UpdateResult

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
