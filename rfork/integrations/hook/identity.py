"""Source identities of a framework instance, one per loader mode (docs/sglang.md and docs/vllm.md,
"Identity rules").

checkpoint mode pulls checkpoint-named, unsharded tensors, whatever the framework does with them after,
so its identity is the checkpoint's own (framework "rfork", tp=pp=1, cpu): the same identity as
`rfork seed --checkpoint DIR`, and any SGLang or vLLM version, parallel layout or device can use it.
A TP rank of a framework that shards the checkpoint as backends.sharding does pulls its slice instead:
the same identity with tp = the framework's TP, this rank's (`rfork seed --checkpoint DIR --tp N`'s).

parameters mode pulls one rank's `named_parameters()` straight into the new instance's parameters,
so everything that shapes those bytes is in the identity: the framework ("sglang", "vllm") and its
version, tp/pp/ep/dp, quantization, dtype, device kind and a fingerprint of the parameters. An SGLang
instance and a vLLM one never share such an identity (the framework differs), so neither pulls from
the other.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from backends import dtype_name
from rfork.identity import SourceIdentity, fingerprint
from rfork.weights.checkpoint import CheckpointInfo


def device_kind(device: torch.device | str) -> str:
    """"cpu", or "cuda:smXY" for the current CUDA device (parameters differ in layout across archs)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type
    major, minor = torch.cuda.get_device_capability(dev)
    return f"cuda:sm{major}{minor}"


def parameters_fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """The identity fingerprint of one rank's parameters: names, dtypes and (sharded) shapes."""
    return fingerprint((name, dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items())


def parameters_identity(
    *,
    framework: str,
    framework_version: str,
    model: str,
    revision: str,
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype | str,
    quantization: str | None,
    tp: int,
    pp: int,
    ep: int,
    dp: int,
    device: torch.device | str,
) -> SourceIdentity:
    """Identity of a framework instance in parameters mode (see the module docstring)."""
    return SourceIdentity(
        model=model,
        revision=revision,
        fingerprint=parameters_fingerprint(tensors),
        dtype=dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype),
        quantization=quantization or "none",
        tp=tp,
        pp=pp,
        ep=ep,
        dp=dp,
        framework=framework,
        framework_version=framework_version,
        device_kind=device_kind(device),
    )


def checkpoint_identity(info: CheckpointInfo, *, model: str | None, revision: str) -> SourceIdentity:
    """Identity in checkpoint mode: the checkpoint's, exactly as `rfork seed` publishes it."""
    return info.identity(tp=1, pp=1, model=model, revision=revision, device_kind="cpu")
