"""Providers under the engine: each opens *domains* (an endpoint, its queues and registrations).

`domain.Domain` is the interface the engine speaks to; `registry` names the providers and how each
opens its domains; `libfabric` implements them for tcp, shm, efa and verbs, over the cffi binding
(`_native` loads it; its C sources are in `native/`). Nothing here imports the engine: GPU memory
paths that build on it live in backends.gpu.
"""
