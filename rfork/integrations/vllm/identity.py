"""Source identities for vLLM instances, one per loader mode (docs/vllm.md, "Identity rules").

checkpoint mode pulls checkpoint-named, unsharded tensors and lets vLLM's own `load_weights` shard and
post-process them, so its identity is the checkpoint's own (framework "rfork", tp=pp=1, cpu): the
identity of `rfork seed --checkpoint DIR` and of a checkpoint-mode SGLang server of the same files.

parameters mode pulls one rank's post-processed `named_parameters()` straight into the new instance's
parameters, so everything that shapes those bytes is in the identity: framework "vllm" and its version,
tp/pp/ep/dp, dtype, quantization, device kind and a fingerprint of the parameters. A vLLM instance and
an SGLang one never share such an identity (the framework differs), so neither pulls from the other.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from backends.layout import dtype_name
from rfork.identity import SourceIdentity
from rfork.integrations.sglang.identity import device_kind, parameters_fingerprint


def parameters_identity(
    *,
    model: str,
    revision: str,
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype | str,
    quantization: str | None,
    tp: int,
    pp: int,
    ep: int,
    dp: int,
    framework_version: str,
    device: torch.device | str,
) -> SourceIdentity:
    """Identity of a vLLM instance in parameters mode (see the module docstring)."""
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
        framework="vllm",
        framework_version=framework_version,
        device_kind=device_kind(device),
    )
