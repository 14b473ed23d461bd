"""`--load-format rfork`: SGLang's model loader that pulls weights from a seed, else loads as SGLang would.

Imported only inside SGLang's scheduler processes, when the load format is rfork (it needs sglang).

checkpoint mode (any model): pull the checkpoint-named tensors (the identity of `rfork seed`), then
feed them to `model.load_weights()` and the quantization post-processing exactly as SGLang's
DefaultModelLoader does. No seed: rfork reads the same safetensors files (so the instance can serve
them afterwards). Anything else going wrong: SGLang's own DefaultModelLoader.

parameters mode (the fast path): build the model, run the post-load steps on the still-empty model,
then pull one rank's post-processed `named_parameters()` from an identical SGLang seed straight into
that storage. No seed, or a failed pull: SGLang's DefaultModelLoader.

Either way `ModelRunner.load_model` is followed by `become_seed` (the plugin's AFTER hook).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
from sglang.srt.configs.load_config import LoadFormat
from sglang.srt.model_loader.loader import (
    BaseModelLoader,
    DefaultModelLoader,
    _get_quantization_config,
    _initialize_model,
)
from sglang.srt.model_loader.utils import set_default_torch_dtype

from rfork.identity import SourceIdentity
from rfork.integrations.hook import drain
from rfork.integrations.hook.identity import parameters_identity
from rfork.integrations.hook.local_model import identity_model_and_revision, local_checkpoint
from rfork.integrations.hook.outcome import LoadOutcome
from rfork.integrations.hook.pulling import pull_checkpoint, pull_parameters
from rfork.integrations.hook.serving import start_seed
from rfork.integrations.hook.settings import HookSettings, default_loader_config
from rfork.seed.seed import Seed
from rfork.weights.rank_weights import RankWeights

log = logging.getLogger(__name__)


class RforkModelLoader(BaseModelLoader):
    """SGLang `BaseModelLoader` for `--load-format rfork` (see the module docstring)."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.settings = HookSettings.resolve(load_config.model_loader_extra_config)
        self.outcome: LoadOutcome | None = None
        self.seed: Seed | None = None

    # --- SGLang's loader interface

    def download_model(self, model_config: Any) -> None:
        self._default_loader().download_model(model_config)

    def load_model(self, *, model_config: Any, device_config: Any) -> torch.nn.Module:
        if self.settings.mode == "parameters":
            return self._load_parameters(model_config, device_config)
        return self._load_checkpoint(model_config, device_config)

    # --- modes

    def _load_checkpoint(self, model_config: Any, device_config: Any) -> torch.nn.Module:
        t0 = time.perf_counter()
        target = torch.device(device_config.device)
        info = local_checkpoint(model_config.model_path)
        if info is None:
            return self._fallback(model_config, device_config, t0, "no local safetensors checkpoint")
        try:
            identity, result = pull_checkpoint(info, self.settings)
        except Exception as exc:  # noqa: BLE001 - every failure ends in SGLang's own loader
            return self._fallback(model_config, device_config, t0, f"rfork load failed: {exc}")
        pulled = time.perf_counter()
        try:
            model = self._build(model_config, target)
            DefaultModelLoader.load_weights_and_postprocess(
                model, iter(result.state_dict(0).items()), target
            )
        except Exception as exc:  # noqa: BLE001 - a checkpoint SGLang cannot digest this way: default
            result.close()
            return self._fallback(model_config, device_config, t0, f"load_weights failed: {exc}")
        self.outcome = LoadOutcome(
            source=result.source,
            seconds=time.perf_counter() - t0,
            bytes=result.bytes,
            identity=identity,
            served=result.weights[0],
        )
        log.info(
            "rfork: checkpoint mode: %d bytes from %s in %.3f s (pull %.3f s, load_weights %.3f s)",
            result.bytes,
            result.source,
            self.outcome.seconds,
            pulled - t0,
            time.perf_counter() - pulled,
        )
        return model.eval()

    def _load_parameters(self, model_config: Any, device_config: Any) -> torch.nn.Module:
        t0 = time.perf_counter()
        target = torch.device(device_config.device)
        model = self._build(model_config, target)
        DefaultModelLoader.postprocess_weights(model, target)  # the post-load steps, on the empty model
        params = dict(model.named_parameters())
        rank = _global_rank()
        identity = self._parameters_identity(model_config, params, target)
        if self.settings.planner_url is None:
            return self._fallback(model_config, device_config, t0, "no planner URL")
        try:
            result = pull_parameters(params, identity=identity, rank=rank, settings=self.settings)
            nbytes, source = result.bytes, result.source
            result.close()
        except Exception as exc:  # noqa: BLE001 - no source or a failed pull: SGLang's own loader
            return self._fallback(model_config, device_config, t0, f"{exc}")
        self.outcome = LoadOutcome(
            source=source, seconds=time.perf_counter() - t0, bytes=nbytes, identity=identity, rank=rank
        )
        log.info(
            "rfork: parameters mode: rank %d, %d bytes from %s into the model's parameters in %.3f s",
            rank,
            nbytes,
            source,
            self.outcome.seconds,
        )
        return model.eval()

    # --- seeding (called after ModelRunner.load_model)

    def become_seed(self, model: torch.nn.Module) -> Seed | None:
        """Serve this rank's weights read-only and publish them (no-op when disabled or impossible)."""
        s = self.settings
        if not s.serve or s.planner_url is None or self.outcome is None or self.seed is not None:
            return None
        try:
            if s.mode == "parameters":
                # CUDA parameters: the seed serves them through host mirrors when the provider cannot
                # register device memory (rfork.seed.seed; not run here, no GPU)
                params = dict(model.named_parameters())
                identity = self.outcome.identity  # of the final, post-processed parameters
                if identity is None:
                    return None
                weights = RankWeights.from_tensors(rank=self.outcome.rank, tensors=params)
                # only a disk load may anchor the identity's digests at the planner (#12)
                weights.origin = "disk" if self.outcome.source in ("disk", "sglang-default") else "peer"
            else:
                if self.outcome.served is None or self.outcome.identity is None:
                    return None
                identity, weights = self.outcome.identity, self.outcome.served
            self.seed = start_seed(weights=[weights], identity=identity, settings=s)
            # SGLang SIGKILLs its schedulers: its main process drains what they published
            drain.record_publications(self.seed, planner_url=s.planner_url)
        except Exception as exc:  # noqa: BLE001 - the server runs fine without being a seed
            log.warning("rfork: could not become a seed: %s", exc, exc_info=True)
            return None
        return self.seed

    # --- helpers

    def _build(self, model_config: Any, target: torch.device) -> torch.nn.Module:
        quant_config = _get_quantization_config(model_config, self.load_config)
        with set_default_torch_dtype(model_config.dtype), target:
            return _initialize_model(model_config, self.load_config, quant_config)

    def _default_loader(self) -> DefaultModelLoader:
        return DefaultModelLoader(default_loader_config(self.load_config, LoadFormat.AUTO))

    def _fallback(self, model_config: Any, device_config: Any, t0: float, reason: str) -> torch.nn.Module:
        log.info("rfork: loading with SGLang's default loader: %s", reason)
        model = self._default_loader().load_model(model_config=model_config, device_config=device_config)
        identity = None
        if self.settings.mode == "parameters":
            identity = self._parameters_identity(
                model_config, dict(model.named_parameters()), torch.device(device_config.device)
            )
        self.outcome = LoadOutcome(
            source="sglang-default",
            seconds=time.perf_counter() - t0,
            identity=identity,
            rank=_global_rank(),
            reason=reason,
        )
        return model

    def _parameters_identity(
        self, model_config: Any, params: Mapping[str, torch.Tensor], device: torch.device
    ) -> SourceIdentity:
        import sglang

        par = _parallel()
        model, revision = identity_model_and_revision(self.settings, model_config, model_config.model_path)
        return parameters_identity(
            framework="sglang",
            framework_version=str(sglang.__version__),
            model=model,
            revision=revision,
            tensors=params,
            dtype=model_config.dtype,
            quantization=model_config.quantization,
            tp=par["tp"],
            pp=par["pp"],
            ep=par["ep"],
            dp=par["dp"],
            device=device,
        )


def _parallel() -> dict[str, int]:
    """tp/pp/ep/dp sizes (and ranks) from SGLang's runtime context; 1 / 0 where it has none."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()

    def read(name: str, default: int) -> int:
        try:
            value = getattr(par, name)
        except Exception:  # noqa: BLE001 - a field SGLang has not published in this process
            return default
        return int(value) if isinstance(value, int) and value is not None else default

    return {
        "tp": read("tp_size", 1),
        "pp": read("pp_size", 1),
        "ep": read("moe_ep_size", 1),
        "dp": read("dp_size", 1),
        "tp_rank": read("tp_rank", 0),
        "pp_rank": read("pp_rank", 0),
    }


def _global_rank() -> int:
    par = _parallel()
    return par["pp_rank"] * par["tp"] + par["tp_rank"]
