"""Providers behind the engine: each opens *domains* (an endpoint, its queues and registrations).

`domain.Domain` is the interface the engine speaks to; `libfabric` implements it for tcp, shm, efa
and verbs. `cuda_ipc` (same-host GPU memory) and `staging` (GPU memory through registered host
bounce slots) move device memory for providers that cannot register it.
"""
