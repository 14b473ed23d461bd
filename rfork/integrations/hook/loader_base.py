"""The template of rfork's `--load-format rfork` model loaders: what every framework hook does the same.

A framework's loader subclasses `RforkLoaderBase` and its framework's own `BaseModelLoader` (the class
the framework's loader registry takes), and keeps only the framework's calls: building the model, its
post-load steps, its default loader, its parallel layout and version. The template holds the rest:
settings, the source identity, pulling (checkpoint mode: the checkpoint's tensors; parameters mode:
one rank straight into the parameters), falling back to the framework's loader, and becoming a seed.

One hand-off, one registration: a pull keeps its engine and the registrations its reads landed
through (`LoadOptions.seed_later`), the outcome holds them (`LoadOutcome.pulled`), and the seed adopts
them once the framework's post-load steps ran. Where no seed adopts them (serving off or impossible,
a fallback, a draft model), `release()` closes them.

Imported by the vLLM plugin in every vLLM process: rfork's transport, planner and seed modules are
imported inside the methods that need them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from rfork.integrations.hook.outcome import LoadOutcome
from rfork.integrations.hook.settings import HookSettings

if TYPE_CHECKING:
    from rfork.compile_cache.shelf import CacheShelf
    from rfork.identity import SourceIdentity
    from rfork.seed.seed import Seed
    from rfork.weights.checkpoint import CheckpointInfo
    from rfork.weights.rank_weights import RankWeights

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """The framework's parallel layout in this process: sizes, and this worker's tp/pp ranks."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0


class RforkLoaderBase:
    """Template of a framework's `--load-format rfork` loader (see the module docstring).

    A subclass sets `framework` and `framework_name`, says where its pull lands
    (`pulls_after_post_load`), and implements `parallel`, `framework_version`, `model_path`
    and `arrange_drain`.
    """

    framework: ClassVar[str]  # the identity's framework in parameters mode ("sglang", "vllm")
    framework_name: ClassVar[str]  # in log lines ("SGLang", "vLLM")
    # Parameters mode: True where the pull lands after the framework's post-load steps (SGLang), so the
    # seed serves the model's parameters as they are when it becomes one, also after a fallback; False
    # where it lands before them (vLLM): the seed serves the loaded tensors, re-verified first, and
    # nothing after a fallback (post-processed weights are not a layout a peer can pull).
    pulls_after_post_load: ClassVar[bool]

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)  # type: ignore[call-arg]  # the framework's BaseModelLoader
        self.settings = HookSettings.resolve(load_config.model_loader_extra_config)
        self.outcome: LoadOutcome | None = None
        self.seed: Seed | None = None
        self.compile_caches: CacheShelf | None = None  # what this worker compiles, served as a seed
        self.seeding: threading.Thread | None = None  # become_seed_soon's helper thread
        # checkpoint mode: the checkpoint pulled, and the (tp, tp_rank) slice of it (None: all of it)
        self.checkpoint: tuple[CheckpointInfo, tuple[int, int] | None] | None = None
        if self.settings.planner_url is not None:  # a pull or a seed will need the transport
            # imported here: the plugin is imported in every framework process (start-up time)
            from backends import load_binding_soon

            load_binding_soon()  # beside the model's build, not inside the first pull

    # --- the framework's calls (per subclass)

    def parallel(self) -> Parallel:
        """This process's parallel layout, as the framework knows it."""
        raise NotImplementedError

    def framework_version(self) -> str:
        """The framework's version (in the parameters identity)."""
        raise NotImplementedError

    def model_path(self, model_config: Any) -> str:
        """Where the framework's model config says the checkpoint is."""
        raise NotImplementedError

    def arrange_drain(self, seed: Seed) -> None:
        """Make sure `seed` drains when the framework shuts this worker down (it may SIGKILL it)."""
        raise NotImplementedError

    # --- identity

    def global_rank(self) -> int:
        """pp_rank * tp_size + tp_rank of this worker."""
        # imported here: the plugin is imported in every framework process (start-up time)
        from rfork.identity import global_rank

        par = self.parallel()
        return global_rank(tp_rank=par.tp_rank, pp_rank=par.pp_rank, tp_size=par.tp)

    def parameters_identity(
        self, model_config: Any, params: Mapping[str, torch.Tensor], device: torch.device
    ) -> SourceIdentity:
        """The identity of this rank's parameters (rfork.integrations.hook.identity)."""
        # imported here: the plugin is imported in every framework process (start-up time)
        from rfork.integrations.hook.identity import parameters_identity
        from rfork.integrations.hook.local_model import identity_model_and_revision

        par = self.parallel()
        path = self.model_path(model_config)
        model, revision = identity_model_and_revision(self.settings, model_config, path)
        return parameters_identity(
            framework=self.framework,
            framework_version=self.framework_version(),
            model=model,
            revision=revision,
            tensors=params,
            dtype=model_config.dtype,
            quantization=model_config.quantization,
            tp=par.tp,
            pp=par.pp,
            ep=par.ep,
            dp=par.dp,
            device=device,
        )

    # --- pulling

    def serve_metrics(self) -> None:
        """Serve rfork's metrics (pulls, fallbacks, what this worker seeds) on metrics_port + this
        worker's global rank, once per process; a port that is taken is a warning, not a failed load."""
        port = self.settings.metrics_port
        if port is None:
            return
        # imported here: the plugin is imported in every framework process (start-up time)
        from rfork import metrics

        try:
            metrics.serve_metrics(port + self.global_rank() if port else 0, self.settings.metrics_host)
        except OSError as exc:
            log.warning("rfork: no metrics from this worker: port %d: %s", port + self.global_rank(), exc)

    def pull_checkpoint(self, model_config: Any) -> str | None:
        """checkpoint mode: pull the checkpoint's tensors from a seed (else rfork reads its files) into
        `self.outcome` (`served`: what load_weights is fed; `pulled`: the hand-off); the reason to fall
        back to the framework's loader, or None."""
        # imported here: the plugin is imported in every framework process (start-up time)
        from rfork.errors import ConfigurationError, SeedRequired
        from rfork.integrations.hook.local_model import local_checkpoint
        from rfork.integrations.hook.pulling import pull_checkpoint

        self.serve_metrics()

        info = local_checkpoint(self.model_path(model_config))
        if info is None:
            if self.settings.require_seed:
                raise SeedRequired("no local safetensors checkpoint to take the identity from (require_seed)")
            return "no local safetensors checkpoint"
        part = self.checkpoint_slice(model_config)
        try:
            identity, result = pull_checkpoint(info, self.settings, part)
        except (ConfigurationError, SeedRequired):
            raise  # a wrong setting, or no fallback wanted: the server must not start quietly from disk
        except Exception as exc:  # noqa: BLE001 - every other failure ends in the framework's own loader
            return f"rfork load failed: {exc}"
        rank = 0 if part is None else part[1]
        self.checkpoint = (info, part)
        self.record(
            LoadOutcome(
                source=result.source,
                bytes=result.bytes,
                identity=identity,
                rank=rank,
                served=result.weights[rank],
                pulled=result,
            )
        )
        return None

    def checkpoint_slice(self, model_config: Any) -> tuple[int, int] | None:
        """(tp, tp_rank) where checkpoint mode reads only this rank's slice of each tensor: the framework
        shards this model's checkpoint exactly as backends.sharding does; None: the whole checkpoint
        (the template's answer; a framework that knows its sharding overrides it)."""
        return None

    def pull_parameters(
        self, params: Mapping[str, torch.Tensor], *, identity: SourceIdentity, rank: int
    ) -> str | None:
        """parameters mode: pull one rank straight into `params` (checked against the seed's manifest
        first, verified) into `self.outcome`; the reason it did not (no planner, no seed, a failure:
        the parameters are undefined then), or None."""
        # imported here: the plugin is imported in every framework process (start-up time)
        from rfork.errors import ConfigurationError, SeedRequired
        from rfork.integrations.hook.pulling import pull_parameters

        self.serve_metrics()
        if self.settings.planner_url is None:
            return "no planner URL"
        try:
            result = pull_parameters(params, identity=identity, rank=rank, settings=self.settings)
        except (ConfigurationError, SeedRequired):
            raise  # a wrong setting, or no fallback wanted: the server must not start quietly from disk
        except Exception as exc:  # noqa: BLE001 - no source or a failed pull: the framework's loader
            return str(exc) or type(exc).__name__
        self.record(
            LoadOutcome(
                source=result.source,
                bytes=result.bytes,
                identity=identity,
                rank=rank,
                served=result.weights[rank],  # these parameters, digests verified by the pull
                pulled=result,
            )
        )
        return None

    def fell_back(
        self, model: torch.nn.Module, model_config: Any, *, reason: str, seconds: float
    ) -> torch.nn.Module:
        """Record that the framework's own loader loaded `model` (why: `reason`)."""
        identity = None
        if self.settings.mode == "parameters" and self.pulls_after_post_load:
            params = dict(model.named_parameters())
            device = next(iter(params.values())).device if params else torch.device("cpu")
            identity = self.parameters_identity(model_config, params, device)
        self.record(
            LoadOutcome(
                source=f"{self.framework}-default",
                seconds=seconds,
                identity=identity,
                rank=self.global_rank(),
                reason=reason,
            )
        )
        return model

    def note_shard(self, params: Mapping[str, torch.Tensor]) -> None:
        """Record this rank's share of the model (`params`: its parameters as the framework sharded
        them) beside what its load moved, for the per-rank log line."""
        if self.outcome is not None:
            self.outcome.shard_bytes = sum(t.numel() * t.element_size() for t in params.values())

    def record(self, outcome: LoadOutcome) -> None:
        """`outcome` is how this rank got its weights now; what an earlier one held for a seed is closed."""
        if self.outcome is not None and self.outcome.pulled is not outcome.pulled:
            self.outcome.release()
        self.outcome = outcome

    # --- seeding (after the framework's post-load steps)

    def become_seed_soon(self, model: torch.nn.Module | None = None) -> None:
        """`become_seed` on a helper thread, once: the post-load digest re-check, the registrations and
        the publication leave the framework's load clock. The framework goes on starting (its profiling
        run, KV cache, API server) meanwhile; the planner lists this seed once it is verified and
        published, so no peer is sent to it before. `seeding` is the thread (join it to wait)."""
        if self.seeding is not None:
            return
        t0 = time.perf_counter()

        def seed() -> None:
            served = self.become_seed(model)
            log.info(
                "rfork: rank %d: %s in %.3f s, beside %s's start",
                self.global_rank(),
                "serving as a seed" if served is not None else "not serving",
                time.perf_counter() - t0,
                self.framework_name,
            )

        self.seeding = threading.Thread(target=seed, name="rfork-become-seed", daemon=True)
        self.seeding.start()

    def become_seed(self, model: torch.nn.Module | None = None) -> Seed | None:
        """Serve what this rank loaded, read-only, adopting the pull's registrations, and publish it;
        the drain is arranged. None (and what the pull held is closed) when serving is off or
        impossible; a failure is logged, never raised: the server runs fine without being a seed."""
        if self.seed is not None:
            return self.seed
        s, out = self.settings, self.outcome
        if not s.serve or s.planner_url is None or out is None or out.identity is None:
            self.release()
            return None
        # imported here: the plugin is imported in every framework process (start-up time)
        from planner.contract import AuthError
        from rfork.errors import ChecksumMismatch
        from rfork.integrations.hook.serving import start_seed

        try:
            weights = self._to_serve(model)
            if weights is None:
                self.release()
                return None
            seed = start_seed(
                weights=[weights],
                identity=out.identity,
                settings=s,
                compile_caches=self.compile_caches,
                pulled=out.pulled,
            )
        except ChecksumMismatch as exc:
            log.warning(
                "rfork: %s's post-load steps changed the loaded parameters in place (%s); "
                "parameters mode cannot serve this model, use checkpoint mode",
                self.framework_name,
                exc,
            )
            self.release()
            return None
        except AuthError as exc:
            which = "$RFORK_REGISTER_TOKEN" if s.register_token else "$RFORK_TOKEN (no $RFORK_REGISTER_TOKEN)"
            log.warning(
                "rfork: not serving as a seed: the planner refused to register it with %s (%s); a seed "
                "needs the register role: set $RFORK_REGISTER_TOKEN(_FILE) to a token with it, or give "
                "one token with load and register, or serve=false",
                which,
                exc,
            )
            self.release()
            return None
        except Exception as exc:  # noqa: BLE001 - the server runs fine without being a seed
            log.warning("rfork: could not become a seed: %s", exc, exc_info=True)
            self.release()
            return None
        self.seed = seed
        self.arrange_drain(seed)
        # imported here: the plugin is imported in every framework process (start-up time)
        from rfork import metrics

        metrics.SEED_BYTES.set(weights.layout.total_bytes)
        metrics.SEED_INSTANCES.set(len(seed.instance_ids))
        return seed

    def release(self) -> None:
        """Close the engine and registrations a pull holds for a seed, when none will adopt them."""
        if self.outcome is not None:
            self.outcome.release()

    def _to_serve(self, model: torch.nn.Module | None) -> RankWeights | None:
        """The weights the seed serves (see `pulls_after_post_load`); ChecksumMismatch when the loaded
        parameters changed since they were verified."""
        out = self.outcome
        assert out is not None
        if self.settings.mode != "parameters":
            return out.served  # the pulled (or read) checkpoint tensors
        if not self.pulls_after_post_load:
            if out.served is not None:
                out.served.verify(dict(out.served.checksums))  # the post-load steps must not change them
            return out.served
        # imported here: the plugin is imported in every framework process (start-up time)
        from rfork.weights.rank_weights import RankWeights

        assert model is not None
        params = dict(model.named_parameters())
        if out.served is not None and out.served.holds(params):
            return out.served  # the pulled parameters, still the model's: their registrations are reused
        weights = RankWeights.from_tensors(rank=out.rank, tensors=params)
        # only a disk load may anchor the identity's digests at the planner
        weights.origin = "disk" if out.source in ("disk", f"{self.framework}-default") else "peer"
        return weights
