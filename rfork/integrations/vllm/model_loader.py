"""`--load-format rfork`: vLLM's model loader that pulls weights from a seed, else loads as vLLM would.

Imported by the plugin in every vLLM process (the class must subclass vLLM's `BaseModelLoader` to
register); rfork's transport, planner and seed modules are imported only when a model loads.

vLLM's `BaseModelLoader.load_model` builds the model, calls `load_weights`, then runs the post-load
steps (online quantization, `process_weights_after_loading`). This loader keeps that order and only
decides where `load_weights` gets its bytes:

checkpoint mode (any model): pull the checkpoint-named tensors (the identity of `rfork seed`) and
feed them to `model.load_weights()`, so vLLM shards, fuses and post-processes them as it does disk
tensors. No seed: rfork reads the same safetensors files (so the instance can serve them afterwards).
At TP>1, for a model vLLM shards as backends.sharding does (`slices_like_backends`), each rank pulls
only its slice (the TP=tp checkpoint identity: from its seeds, else a TP=1 seed's verified stripes,
else the files) and serves it; `load_weights` gets each split tensor at full shape, the slice in place.

parameters mode: pull one rank's *loaded* parameters (vLLM's own names, fused and sharded, before the
post-load steps) straight into the model's parameters, then let vLLM post-process them. Not after
the post-load steps as in the SGLang hook: on CPU those steps pack every linear weight into a oneDNN
or sgl-kernel handle and replace the parameter with an empty one, so post-processed parameters do
not hold the weights (docs/vllm.md, "Modes"). No seed: vLLM's own disk loader fills the parameters.

Anything else going wrong: vLLM's DefaultModelLoader loads the whole model again. After a load the
instance becomes a seed of what it loaded on a helper thread (beside vLLM's start, off `load_model`'s
clock), adopting the pull's engine and registrations, and drains when the process exits. Pulling,
identities, fallback bookkeeping and seeding are the template's (rfork.integrations.hook.loader_base);
this module keeps vLLM's calls.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from rfork.errors import ConfigurationError, SeedRequired
from rfork.integrations.hook.loader_base import Parallel, RforkLoaderBase
from rfork.integrations.hook.outcome import LoadOutcome
from rfork.integrations.hook.settings import default_loader_config

if TYPE_CHECKING:
    from rfork.pull.result import LoadResult
    from rfork.seed.seed import Seed

log = logging.getLogger(__name__)


class RforkModelLoader(RforkLoaderBase, BaseModelLoader):
    """vLLM `BaseModelLoader` for `--load-format rfork` (see the module docstring)."""

    framework = "vllm"
    framework_name = "vLLM"
    pulls_after_post_load = False

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self._vllm_config: Any = None
        self._loading = False  # inside load_model: load_weights pulls (parameters mode)
        self._pulled: LoadResult | None = None  # checkpoint mode: what load_weights feeds the model
        self._built = False  # vLLM registers layer names when a model is built: never build twice

    # --- vLLM's loader interface

    def download_model(self, model_config: Any) -> None:
        self._default_loader().download_model(model_config)

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> torch.nn.Module:
        t0 = time.perf_counter()
        self._vllm_config = vllm_config
        self._loading = True
        try:
            if self.settings.mode == "checkpoint":
                reason = self.pull_checkpoint(model_config)
                if reason is not None:
                    return self._fallback(vllm_config, model_config, prefix, t0, reason)
                assert self.outcome is not None
                self._pulled = self.outcome.pulled
            model = super().load_model(vllm_config, model_config, prefix)
        except (ConfigurationError, SeedRequired):
            self.release()
            raise  # a wrong setting, or no fallback wanted: the server must not start quietly from disk
        except Exception as exc:  # noqa: BLE001 - every other failure ends in vLLM's own loader
            if self._built:  # a second model would clash with the first's layer names: vLLM's error
                self.release()
                raise
            return self._fallback(vllm_config, model_config, prefix, t0, f"rfork load failed: {exc}")
        finally:
            self._pulled = None
            self._loading = False  # a later load_weights (vLLM reloading weights) reads the disk
        assert self.outcome is not None
        self.outcome.seconds = time.perf_counter() - t0
        log.info(
            "rfork: %s mode: %s, model loaded in %.3f s",
            self.settings.mode,
            self.outcome.moved(self.global_rank()),
            self.outcome.seconds,
        )
        identity = self.outcome.identity
        if identity is not None:  # before vLLM compiles (its profiling run, after this)
            # imported here: vLLM imports the plugin in each of its processes (start-up time)
            from rfork.integrations.vllm.compile_cache import prepare

            self.compile_caches = prepare(vllm_config, identity, self.outcome.rank, self.settings)
        self.become_seed_soon()
        return model

    def create_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> torch.nn.Module:
        self._built = True
        return super().create_model(vllm_config, model_config, prefix)

    def load_weights(self, model: Any, model_config: Any) -> None:
        """Fill the freshly built model (called by `BaseModelLoader.load_model`, post-processing after).

        `model` is a vLLM model: a torch module with vLLM's `load_weights(iterable of (name, tensor))`.
        """
        if self._pulled is not None:
            # imported here: vLLM imports the plugin in each of its processes (start-up time)
            from rfork.integrations.hook.pulling import checkpoint_tensors

            self.note_shard(dict(model.named_parameters()))
            assert self.outcome is not None
            assert self.checkpoint is not None
            info, part = self.checkpoint
            try:
                tensors = self._pulled.state_dict(self.outcome.rank)
                loaded = model.load_weights(checkpoint_tensors(tensors, info, part))
                if model_config.quantization is None and loaded is not None:
                    self._default_loader().track_weights_loading(model, loaded)  # every parameter set
            except Exception as exc:  # noqa: BLE001 - tensors vLLM cannot digest: its own disk loader
                reason = f"vLLM's load_weights failed on the pulled tensors: {exc!r}"
                log.info("rfork: loading with vLLM's default loader: %s", reason)
                self._default_loader().load_weights(model, model_config)  # rewrites every parameter
                self.record(LoadOutcome(source="vllm-default", reason=reason))  # nothing to serve
            return
        if self._loading and self.settings.mode == "parameters":
            self._load_parameters(model, model_config)
            return
        # vLLM calling load_weights on its own (a weight reload): from disk, as vLLM would. A seed
        # serving these parameters in place then serves new bytes under old digests: its readers'
        # digest checks fail and they fail over, so nobody loads them.
        self._default_loader().load_weights(model, model_config)

    # --- modes

    def _load_parameters(self, model: torch.nn.Module, model_config: Any) -> None:
        """Pull this rank's loaded parameters in place; no source or a failed pull: vLLM's disk loader."""
        # imported here: vLLM imports the plugin in each of its processes (start-up time)
        from rfork.weights.rank_weights import RankWeights

        params = dict(model.named_parameters())
        rank = self.global_rank()
        device = next(iter(params.values())).device if params else torch.device("cpu")
        identity = self.parameters_identity(model_config, params, device)
        reason = self.pull_parameters(params, identity=identity, rank=rank)
        if reason is not None:
            log.info("rfork: parameters mode: vLLM's disk loader fills the parameters: %s", reason)
            self._default_loader().load_weights(model, model_config)
            served = RankWeights.from_tensors(rank=rank, tensors=params)
            served.origin = "disk"
            self.record(
                LoadOutcome(source="disk", identity=identity, rank=rank, served=served, reason=reason)
            )
        assert self.outcome is not None
        assert self.outcome.served is not None
        self.note_shard(params)
        self.outcome.served.compute_checksums()  # before the post-load steps (a pull's are kept)

    # --- the template's framework calls

    def checkpoint_slice(self, model_config: Any) -> tuple[int, int] | None:
        """This TP rank's slice where vLLM shards the model's checkpoint as backends.sharding does
        (`slices_like_backends`), else None (the whole checkpoint)."""
        par = self.parallel()
        if par.tp == 1 or par.pp != 1:
            return None
        why_not = slices_like_backends(model_config, par.tp)
        if why_not is not None:
            log.info("rfork: checkpoint mode pulls the whole checkpoint on all %d ranks: %s", par.tp, why_not)
            return None
        return par.tp, par.tp_rank

    def parallel(self) -> Parallel:
        """Sizes from vLLM's parallel config; this worker's ranks (0 before vLLM's groups exist)."""
        from vllm.distributed import parallel_state

        par = self._vllm_config.parallel_config
        tp, pp, dp = par.tensor_parallel_size, par.pipeline_parallel_size, par.data_parallel_size
        ep = tp * dp if getattr(par, "enable_expert_parallel", False) else 1
        if not parallel_state.model_parallel_is_initialized():
            return Parallel(tp=tp, pp=pp, ep=ep, dp=dp)
        return Parallel(
            tp=tp,
            pp=pp,
            ep=ep,
            dp=dp,
            tp_rank=int(parallel_state.get_tensor_model_parallel_rank()),
            pp_rank=int(parallel_state.get_pp_group().rank_in_group),
        )

    def framework_version(self) -> str:
        import vllm

        return str(vllm.__version__)

    def model_path(self, model_config: Any) -> str:
        return str(model_config.model)

    def arrange_drain(self, seed: Seed) -> None:
        # imported here: vLLM imports the plugin in each of its processes (start-up time)
        from rfork.integrations.vllm.lifecycle import drain_at_exit

        assert self.settings.planner_url is not None
        drain_at_exit(seed, planner_url=self.settings.planner_url)

    # --- helpers

    def _default_loader(self) -> DefaultModelLoader:
        return DefaultModelLoader(default_loader_config(self.load_config, "auto"))

    def _fallback(
        self, vllm_config: Any, model_config: Any, prefix: str, t0: float, reason: str
    ) -> torch.nn.Module:
        log.info("rfork: loading with vLLM's default loader: %s", reason)
        self._pulled = None
        self._loading = False  # load_weights must not take the parameters path again
        model = self._default_loader().load_model(vllm_config, model_config, prefix)
        # nothing to serve: post-processed weights are not a pullable layout (`pulls_after_post_load`)
        return self.fell_back(model, model_config, reason=reason, seconds=time.perf_counter() - t0)


# Models whose vLLM layers shard a checkpoint tensor by tensor exactly as backends.sharding does, given
# `slices_like_backends`' conditions: q/k/v (QKVParallelLinear), gate/up (MergedColumnParallelLinear)
# and each expert's w1/w3 along dim 0, o/down and w2 (RowParallelLinear, FusedMoE) along dim 1, the
# vocabulary (VocabParallelEmbedding, ParallelLMHead) in equal parts, norms and routers whole.
SLICED_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM"}
)


def slices_like_backends(model_config: Any, tp: int) -> str | None:
    """Why this model's TP ranks must not read only their slices (vLLM would shard some tensor another
    way than backends.sharding, and read bytes no one verified), or None where they may."""
    hf = model_config.hf_config
    arch = next(iter(getattr(hf, "architectures", None) or []), None)
    if arch not in SLICED_ARCHITECTURES:
        return f"architecture {arch} is not one whose sharding rfork follows"
    if model_config.quantization is not None:
        return f"quantized ({model_config.quantization}): its scales shard their own way"
    heads, kv = hf.num_attention_heads, getattr(hf, "num_key_value_heads", hf.num_attention_heads)
    if heads % tp or kv % tp:
        return f"{heads} attention and {kv} key/value heads do not split {tp} ways (vLLM replicates them)"
    if hf.vocab_size % 64 or hf.vocab_size % tp:  # vLLM pads the vocabulary to a multiple of 64, then splits
        return f"a vocabulary of {hf.vocab_size} is not a multiple of 64 that splits {tp} ways"
    return None
