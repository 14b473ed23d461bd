"""The pull: a rank's weights from a seed (one-sided reads), else NCCL, else disk; verified."""
