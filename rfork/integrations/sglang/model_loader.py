"""`--load-format rfork`: SGLang's model loader that pulls weights from a seed, else loads as SGLang would.

Imported only inside SGLang's scheduler processes, when the load format is rfork (it needs sglang).

checkpoint mode (any model): pull the checkpoint-named tensors (the identity of `rfork seed`), then
feed them to `model.load_weights()` and the quantization post-processing exactly as SGLang's
DefaultModelLoader does. No seed: rfork reads the same safetensors files (so the instance can serve
them afterwards). Anything else going wrong: SGLang's own DefaultModelLoader.

parameters mode (the fast path): build the model, run the post-load steps on the still-empty model,
then pull one rank's post-processed `named_parameters()` from an identical SGLang seed straight into
that storage. No seed, or a failed pull: SGLang's DefaultModelLoader.

Either way `ModelRunner.load_model` is followed by `become_seed_soon` (the plugin's AFTER hook; on a
helper thread), which adopts the pull's engine and registrations. Pulling, identities, fallback
bookkeeping and seeding are the template's (rfork.integrations.hook.loader_base); this module keeps
SGLang's calls.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.configs.load_config import LoadFormat
from sglang.srt.model_loader.loader import (
    BaseModelLoader,
    DefaultModelLoader,
    _get_quantization_config,
    _initialize_model,
)
from sglang.srt.model_loader.utils import set_default_torch_dtype

from rfork.integrations.hook import drain
from rfork.integrations.hook.loader_base import Parallel, RforkLoaderBase
from rfork.integrations.hook.settings import default_loader_config

if TYPE_CHECKING:
    from rfork.seed.seed import Seed

log = logging.getLogger(__name__)


class RforkModelLoader(RforkLoaderBase, BaseModelLoader):
    """SGLang `BaseModelLoader` for `--load-format rfork` (see the module docstring)."""

    framework = "sglang"
    framework_name = "SGLang"
    pulls_after_post_load = True

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
        reason = self.pull_checkpoint(model_config)
        if reason is not None:
            return self._fallback(model_config, device_config, t0, reason)
        assert self.outcome is not None
        assert self.outcome.pulled is not None
        pulled = time.perf_counter()
        try:
            model = self._build(model_config, target)
            self.note_shard(dict(model.named_parameters()))
            DefaultModelLoader.load_weights_and_postprocess(
                model, iter(self.outcome.pulled.state_dict(0).items()), target
            )
        except Exception as exc:  # noqa: BLE001 - a checkpoint SGLang cannot digest this way: default
            return self._fallback(model_config, device_config, t0, f"load_weights failed: {exc}")
        self.outcome.seconds = time.perf_counter() - t0
        log.info(
            "rfork: checkpoint mode: %s in %.3f s (pull %.3f s, load_weights %.3f s)",
            self.outcome.moved(self.global_rank()),
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
        rank = self.global_rank()
        identity = self.parameters_identity(model_config, params, target)
        reason = self.pull_parameters(params, identity=identity, rank=rank)
        if reason is not None:
            return self._fallback(model_config, device_config, t0, reason)
        assert self.outcome is not None
        self.note_shard(params)
        self.outcome.seconds = time.perf_counter() - t0
        log.info(
            "rfork: parameters mode: %s into the model's parameters in %.3f s",
            self.outcome.moved(rank),
            self.outcome.seconds,
        )
        return model.eval()

    # --- the template's framework calls

    def parallel(self) -> Parallel:
        """tp/pp/ep/dp sizes and ranks from SGLang's runtime context; 1 / 0 where it has none."""
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()

        def read(name: str, default: int) -> int:
            try:
                value = getattr(par, name)
            except Exception:  # noqa: BLE001 - a field SGLang has not published in this process
                return default
            return int(value) if isinstance(value, int) and value is not None else default

        return Parallel(
            tp=read("tp_size", 1),
            pp=read("pp_size", 1),
            ep=read("moe_ep_size", 1),
            dp=read("dp_size", 1),
            tp_rank=read("tp_rank", 0),
            pp_rank=read("pp_rank", 0),
        )

    def framework_version(self) -> str:
        import sglang

        return str(sglang.__version__)

    def model_path(self, model_config: Any) -> str:
        return str(model_config.model_path)

    def arrange_drain(self, seed: Seed) -> None:
        # SGLang SIGKILLs its schedulers: its main process drains what they published
        assert self.settings.planner_url is not None
        drain.record_publications(seed, planner_url=self.settings.planner_url)

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
        return self.fell_back(model, model_config, reason=reason, seconds=time.perf_counter() - t0)
