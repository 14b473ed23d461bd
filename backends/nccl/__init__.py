"""The two-sided fallback on torch.distributed: stream a rank's tensors from a seed to a loader.

gloo on CPU tensors, NCCL on CUDA tensors, one code path (`stream`); used when a seed and a loader
share no one-sided provider.
"""

from backends.nccl.stream import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_MAX_IN_FLIGHT,
    Bucket,
    BucketCallback,
    BucketItem,
    NcclPeerError,
    NcclPlanMismatchError,
    NcclSetupError,
    NcclTimeoutError,
    NcclTransferError,
    Rendezvous,
    backend_for,
    connect_rendezvous,
    local_address_towards,
    plan_buckets,
    plan_digest,
    recv_tensors,
    send_tensors,
    tensor_nbytes,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MAX_IN_FLIGHT",
    "Bucket",
    "BucketCallback",
    "BucketItem",
    "NcclPeerError",
    "NcclPlanMismatchError",
    "NcclSetupError",
    "NcclTimeoutError",
    "NcclTransferError",
    "Rendezvous",
    "backend_for",
    "connect_rendezvous",
    "local_address_towards",
    "plan_buckets",
    "plan_digest",
    "recv_tensors",
    "send_tensors",
    "tensor_nbytes",
]
