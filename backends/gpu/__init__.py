"""GPU memory over the transport, above the engine: `staging` moves CUDA tensors through registered
host bounce slots of a `TransferEngine` (for providers that cannot register device memory), and
`cuda_ipc` copies between GPUs of one host through CUDA IPC handles, with the engine's shape and its
op checks. Both import the engine; nothing below the engine imports them. The KV, RL and MoE paths'
device variants (backends/kv/device.py, rl/device.py, moe/device.py) build on `staging` and `host_copy`.
"""
