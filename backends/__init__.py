"""Transport library: one-sided RDMA-style transfers over libfabric, and a NCCL/gloo fallback."""
