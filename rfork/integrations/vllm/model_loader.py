"""`--load-format rfork`: vLLM's model loader that pulls weights from a seed, else loads as vLLM would.

Imported by the plugin in every vLLM process (the class must subclass vLLM's `BaseModelLoader` to
register); rfork's transport, planner and seed modules are imported only when a model loads.

vLLM's `BaseModelLoader.load_model` builds the model, calls `load_weights`, then runs the post-load
steps (online quantization, `process_weights_after_loading`). This loader keeps that order and only
decides where `load_weights` gets its bytes:

checkpoint mode (any model): pull the checkpoint-named tensors (the identity of `rfork seed`) and
feed them to `model.load_weights()`, so vLLM shards, fuses and post-processes them as it does disk
tensors. No seed: rfork reads the same safetensors files (so the instance can serve them afterwards).

parameters mode: pull one rank's *loaded* parameters (vLLM's own names, fused and sharded, before the
post-load steps) straight into the model's parameters, then let vLLM post-process them. Not after
the post-load steps as in the SGLang hook: on CPU those steps pack every linear weight into a oneDNN
or sgl-kernel handle and replace the parameter with an empty one, so post-processed parameters do
not hold the weights (docs/vllm.md, "Modes"). No seed: vLLM's own disk loader fills the parameters.

Anything else going wrong: vLLM's DefaultModelLoader loads the whole model again. After a load the
instance becomes a seed of what it loaded and drains when the process exits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from rfork.integrations.hook.outcome import LoadOutcome
from rfork.integrations.hook.settings import HookSettings, default_loader_config

if TYPE_CHECKING:
    from rfork.compile_cache.shelf import CacheShelf
    from rfork.identity import SourceIdentity
    from rfork.pull.result import LoadResult
    from rfork.seed.seed import Seed
    from rfork.weights.rank_weights import RankWeights

log = logging.getLogger(__name__)


class RforkModelLoader(BaseModelLoader):
    """vLLM `BaseModelLoader` for `--load-format rfork` (see the module docstring)."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.settings = HookSettings.resolve(load_config.model_loader_extra_config)
        self.outcome: LoadOutcome | None = None
        self.seed: Seed | None = None
        self.compile_caches: CacheShelf | None = None  # what this worker compiles, served as a seed
        self._pulled: LoadResult | None = None  # checkpoint mode: what load_weights feeds the model
        self._vllm_config: Any = None
        self._built = False  # vLLM registers layer names when a model is built: never build twice

    # --- vLLM's loader interface

    def download_model(self, model_config: Any) -> None:
        self._default_loader().download_model(model_config)

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> torch.nn.Module:
        t0 = time.perf_counter()
        self._vllm_config = vllm_config
        try:
            if self.settings.mode == "checkpoint":
                reason = self._pull_checkpoint(model_config)
                if reason is not None:
                    return self._fallback(vllm_config, model_config, prefix, t0, reason)
            model = super().load_model(vllm_config, model_config, prefix)
        except Exception as exc:  # noqa: BLE001 - every failure ends in vLLM's own loader
            if self._built:  # a second model would clash with the first's layer names: vLLM's error
                raise
            return self._fallback(vllm_config, model_config, prefix, t0, f"rfork load failed: {exc}")
        finally:
            self._pulled = None
            self._vllm_config = None  # a later load_weights (vLLM reloading weights) reads the disk
        assert self.outcome is not None
        self.outcome.seconds = time.perf_counter() - t0
        log.info(
            "rfork: %s mode: rank %d, %d bytes from %s, model loaded in %.3f s",
            self.settings.mode,
            self.outcome.rank,
            self.outcome.bytes,
            self.outcome.source,
            self.outcome.seconds,
        )
        identity = self.outcome.identity
        if identity is not None:  # before vLLM compiles (its profiling run, after this)
            # imported here: vLLM imports the plugin in each of its processes (start-up time)
            from rfork.integrations.vllm.compile_cache import prepare

            self.compile_caches = prepare(vllm_config, identity, self.outcome.rank, self.settings)
        self.become_seed()
        return model

    def create_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> torch.nn.Module:
        self._built = True
        return super().create_model(vllm_config, model_config, prefix)

    def load_weights(self, model: Any, model_config: Any) -> None:
        """Fill the freshly built model (called by `BaseModelLoader.load_model`, post-processing after).

        `model` is a vLLM model: a torch module with vLLM's `load_weights(iterable of (name, tensor))`.
        """
        if self._pulled is not None:
            try:
                loaded = model.load_weights(iter(self._pulled.state_dict(0).items()))
                if model_config.quantization is None and loaded is not None:
                    self._default_loader().track_weights_loading(model, loaded)  # every parameter set
            except Exception as exc:  # noqa: BLE001 - tensors vLLM cannot digest: its own disk loader
                reason = f"vLLM's load_weights failed on the pulled tensors: {exc!r}"
                log.info("rfork: loading with vLLM's default loader: %s", reason)
                self._default_loader().load_weights(model, model_config)  # rewrites every parameter
                self.outcome = LoadOutcome(source="vllm-default", reason=reason)  # nothing to serve
            return
        if self.settings.mode == "parameters" and self._vllm_config is not None:
            self._load_parameters(model, model_config)
            return
        # vLLM calling load_weights on its own (a weight reload): from disk, as vLLM would. A seed
        # serving these parameters in place then serves new bytes under old digests: its readers'
        # digest checks fail and they fail over, so nobody loads them.
        self._default_loader().load_weights(model, model_config)

    # --- modes

    def _pull_checkpoint(self, model_config: Any) -> str | None:
        """Pull (or read) the checkpoint tensors for load_weights; the fallback reason, else None."""
        # imported here: vLLM imports the plugin in each of its processes (start-up time)
        from rfork.integrations.hook.local_model import local_checkpoint
        from rfork.integrations.hook.pulling import pull_checkpoint

        info = local_checkpoint(model_config.model)
        if info is None:
            return "no local safetensors checkpoint"
        identity, result = pull_checkpoint(info, self.settings)
        self._pulled = result
        self.outcome = LoadOutcome(
            source=result.source, bytes=result.bytes, identity=identity, served=result.weights[0]
        )
        return None

    def _load_parameters(self, model: torch.nn.Module, model_config: Any) -> None:
        """Pull this rank's loaded parameters in place; no source or a failed pull: vLLM's disk loader."""
        # imported here: vLLM imports the plugin in each of its processes (start-up time)
        from rfork.integrations.hook.pulling import pull_parameters
        from rfork.weights.rank_weights import RankWeights

        params = dict(model.named_parameters())
        rank = _global_rank(self._vllm_config)
        identity = self._parameters_identity(model_config, params)
        source, nbytes, reason = "disk", 0, None
        served: RankWeights | None = None
        if self.settings.planner_url is None:
            reason = "no planner URL"
        else:
            try:
                result = pull_parameters(params, identity=identity, rank=rank, settings=self.settings)
                source, nbytes = result.source, result.bytes
                served = result.weights.get(rank)  # these parameters, digests verified by the pull
                result.close()
            except Exception as exc:  # noqa: BLE001 - the parameters are undefined now: disk rewrites all
                reason = str(exc) or type(exc).__name__
        if reason is not None:
            log.info("rfork: parameters mode: vLLM's disk loader fills the parameters: %s", reason)
            self._default_loader().load_weights(model, model_config)
        if served is None:
            served = RankWeights.from_tensors(rank=rank, tensors=params)
            served.origin = "disk"
        served.compute_checksums()  # before the post-load steps (a pull's verified digests are kept)
        self.outcome = LoadOutcome(
            source=source, bytes=nbytes, identity=identity, rank=rank, served=served, reason=reason
        )

    # --- seeding

    def become_seed(self) -> Seed | None:
        """Serve what this rank loaded, read-only, publish it, drain at exit (no-op when disabled)."""
        s, out = self.settings, self.outcome
        if not s.serve or s.planner_url is None or out is None or out.served is None or out.identity is None:
            return None
        if self.seed is not None:
            return self.seed
        # imported here: vLLM imports the plugin in each of its processes (start-up time)
        from rfork.errors import ChecksumMismatch
        from rfork.integrations.hook.serving import start_seed
        from rfork.integrations.vllm.lifecycle import drain_at_exit

        try:
            if s.mode == "parameters":
                # the post-load steps must have left the loaded parameters as they were: recheck
                out.served.verify(dict(out.served.checksums))
            seed = start_seed(
                weights=[out.served], identity=out.identity, settings=s, compile_caches=self.compile_caches
            )
        except ChecksumMismatch as exc:
            log.warning(
                "rfork: vLLM's post-load steps changed the loaded parameters in place (%s); "
                "parameters mode cannot serve this model, use checkpoint mode",
                exc,
            )
            return None
        except Exception as exc:  # noqa: BLE001 - the server runs fine without being a seed
            log.warning("rfork: could not become a seed: %s", exc, exc_info=True)
            return None
        self.seed = seed
        drain_at_exit(seed, planner_url=s.planner_url)
        return seed

    # --- helpers

    def _default_loader(self) -> DefaultModelLoader:
        return DefaultModelLoader(default_loader_config(self.load_config, "auto"))

    def _fallback(
        self, vllm_config: Any, model_config: Any, prefix: str, t0: float, reason: str
    ) -> torch.nn.Module:
        log.info("rfork: loading with vLLM's default loader: %s", reason)
        self._vllm_config = None  # load_weights must not take the parameters path again
        model = self._default_loader().load_model(vllm_config, model_config, prefix)
        self.outcome = LoadOutcome(
            source="vllm-default",
            seconds=time.perf_counter() - t0,
            rank=_global_rank(vllm_config),
            reason=reason,
        )
        return model  # nothing to serve: post-processed weights are not a pullable layout

    def _parameters_identity(self, model_config: Any, params: Mapping[str, torch.Tensor]) -> SourceIdentity:
        import vllm

        # imported here: vLLM imports the plugin in each of its processes (start-up time)
        from rfork.integrations.hook.identity import parameters_identity
        from rfork.integrations.hook.local_model import identity_model_and_revision

        par = self._vllm_config.parallel_config
        tp, pp, dp = par.tensor_parallel_size, par.pipeline_parallel_size, par.data_parallel_size
        device = next(iter(params.values())).device if params else torch.device("cpu")
        model, revision = identity_model_and_revision(self.settings, model_config, model_config.model)
        return parameters_identity(
            framework="vllm",
            framework_version=str(vllm.__version__),
            model=model,
            revision=revision,
            tensors=params,
            dtype=model_config.dtype,
            quantization=model_config.quantization,
            tp=tp,
            pp=pp,
            ep=tp * dp if getattr(par, "enable_expert_parallel", False) else 1,
            dp=dp,
            device=device,
        )


def _global_rank(vllm_config: Any) -> int:
    """pp_rank * tp_size + tp_rank of this worker (0 before vLLM's groups exist)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    tp = vllm_config.parallel_config.tensor_parallel_size
    return int(parallel_state.get_pp_group().rank_in_group) * tp + int(
        parallel_state.get_tensor_model_parallel_rank()
    )
