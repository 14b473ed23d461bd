"""A rank's weights: RankWeights, their regions in memory, digests, host memory, checkpoints on disk."""
