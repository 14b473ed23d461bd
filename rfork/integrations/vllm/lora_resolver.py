"""vLLM's LoRA resolver for rfork: an unknown adapter name is pulled from a peer that holds it.

vLLM (with `--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) asks its registered resolvers for
an adapter the moment a request names one it has not loaded. This one asks the planner for a seed of
the adapter (`rfork.weights.adapters.adapter_identity`: the adapter's name and the base model's), pulls
and verifies it, writes it as a PEFT directory for vLLM to load, and serves it to other servers from
then on. With no seed it reads `$RFORK_LORA_DIR/<name>` (the storage fallback) and serves that.
Settings come from the environment, as the load format's do (`rfork.integrations.hook.settings`):
RFORK_PLANNER_URL, RFORK_PROVIDERS, the tokens, RFORK_MODEL_NAME (the base's name, default vLLM's
model path); RFORK_LORA_DIR; RFORK_LORA_CACHE (where pulled adapters are written; default a private
directory in /dev/shm).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry

from planner.contract import SourceIdentity
from rfork.integrations.hook.settings import HookSettings
from rfork.weights.adapters import AdapterError, adapter_identity, check_adapter_name

if TYPE_CHECKING:
    from rfork.pull.result import LoadResult
    from rfork.seed.seed import Seed


log = logging.getLogger(__name__)

RESOLVER_NAME = "rfork"
LORA_DIR_ENV = "RFORK_LORA_DIR"
LORA_CACHE_ENV = "RFORK_LORA_CACHE"


class RforkLoraResolver(LoRAResolver):
    """Resolves adapters from peers (then storage) and serves each one it resolved. Thread-safe."""

    def __init__(self, settings: HookSettings, storage: Path | None, cache: Path | None) -> None:
        self.settings = settings
        self.storage = storage
        self._cache = cache
        self._lock = threading.Lock()
        # adapter identity -> (its directory, what serves it)
        self._held: dict[SourceIdentity, tuple[Path, Seed | LoadResult | None]] = {}
        atexit.register(self.close)
        threading.Thread(target=_warm, args=(settings,), name="rfork-lora-warm", daemon=True).start()

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """vLLM's hook: the adapter's directory (pulled or from storage), or None if nobody has it."""
        path = await asyncio.to_thread(self.fetch, base_model_name, lora_name)
        if path is None:
            return None
        return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=str(path))  # vLLM sets the id

    def fetch(self, base_model_name: str, lora_name: str) -> Path | None:
        """The adapter's directory: from a peer, else from storage; None (logged) if neither has it."""
        try:
            check_adapter_name(lora_name)
        except AdapterError as exc:
            log.warning("LoRA adapter not resolved: %s", exc)
            return None
        identity = adapter_identity(base=self.settings.model or base_model_name, name=lora_name)
        with self._lock:
            held = self._held.get(identity)
        if held is not None:
            return held[0]
        try:
            found = self._from_peer(identity, lora_name) or self._from_storage(identity, lora_name)
        except Exception as exc:  # noqa: BLE001 - a request naming an adapter gets vLLM's 404, never a 500
            log.warning("LoRA adapter %s not resolved: %s", lora_name, exc)
            log.debug("resolving a LoRA adapter failed", exc_info=True)
            return None
        if found is None:
            log.info("LoRA adapter %s: no seed and not in %s", lora_name, self.storage or "storage (unset)")
            return None
        with self._lock:
            self._held[identity] = found
        return found[0]

    def _from_peer(self, identity: SourceIdentity, name: str) -> tuple[Path, LoadResult] | None:
        if not self.settings.planner_url:
            return None
        # imported here: only a server that pulls an adapter needs the transport (start-up time)
        from rfork.errors import SeedRequired
        from rfork.loader import Loader
        from rfork.pull.options import BusyWait, LoadOptions
        from rfork.weights.adapters import write_adapter

        options = LoadOptions(
            providers=self.settings.providers,
            transfer_timeout_s=self.settings.transfer_timeout_s,
            require_seed=True,  # the storage fallback is ours (RFORK_LORA_DIR), not a checkpoint
            require_crypto_digest=self.settings.require_crypto_digest,
            become_seed=False,  # after vLLM has the adapter: publishing is not on the request's clock
            seed_later=True,
            # a request is waiting: storage soon rather than a long wait for a busy seed or the planner
            busy_wait=BusyWait(max_wait_s=5.0, planner_outage_s=2.0),
        )
        loader = Loader(
            identity=identity,
            planner_url=self.settings.planner_url,
            token=self.settings.token,
            register_token=self.settings.seed_token,
            options=options,
        )
        try:
            result = loader.load()
        except SeedRequired as exc:
            log.info("LoRA adapter %s: %s", name, exc)
            return None
        try:
            directory = self._cache_dir() / f"{name}-{identity.fingerprint[:16]}"
            path = write_adapter(result.state_dict(0), directory)
        except BaseException:
            result.close()
            raise
        log.info(
            "LoRA adapter %s: %d bytes from a peer in %.3f s, verified", name, result.bytes, result.seconds
        )
        threading.Thread(
            target=self._serve, args=(name, result), name="rfork-lora-seed", daemon=True
        ).start()
        return path, result

    def _serve(self, name: str, result: LoadResult) -> None:
        """Serve a pulled adapter (its pull's engine and registrations), once vLLM was handed it."""
        assert self.settings.planner_url is not None
        # imported here: only a server that serves an adapter needs the seed (start-up time)
        from rfork.seed.seed import Seed

        try:
            seed = Seed.adopt(
                result,
                planner_url=self.settings.planner_url,
                token=self.settings.seed_token,
                retry_publish=True,  # a planner outage must not stop it serving later
            )
        except Exception:  # noqa: BLE001 - the adapter is loaded: serving it is a bonus
            log.warning("LoRA adapter %s: loaded, but could not serve it to others", name, exc_info=True)
            return
        log.info("LoRA adapter %s: serving it as seed %s", name, ",".join(seed.instance_ids))

    def _from_storage(self, identity: SourceIdentity, name: str) -> tuple[Path, Seed | None] | None:
        if self.storage is None or not (self.storage / name).is_dir():
            return None
        # imported here: only a server that serves an adapter needs the seed (start-up time)
        from rfork.seed.seed import Seed
        from rfork.weights.adapters import read_adapter
        from rfork.weights.rank_weights import RankWeights

        directory = self.storage / name
        weights = RankWeights.from_state_dict(read_adapter(directory))
        if not self.settings.planner_url:
            return directory, None  # nothing to publish through
        seed = Seed(
            weights=[weights],
            identity=identity,
            planner_url=self.settings.planner_url,
            token=self.settings.seed_token,
            providers=self.settings.providers,
            retry_publish=True,  # a planner outage must not keep the adapter from vLLM
        )
        seed.start()
        log.info(
            "LoRA adapter %s: read from %s; serving it as seed %s",
            name,
            directory,
            ",".join(seed.instance_ids),
        )
        return directory, seed

    def _cache_dir(self) -> Path:
        with self._lock:
            if self._cache is None:
                root = "/dev/shm" if os.path.isdir("/dev/shm") else None
                self._cache = Path(tempfile.mkdtemp(prefix="rfork-lora-", dir=root))
            return self._cache

    def close(self) -> None:
        """Stop serving every adapter (drain each seed)."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for _, server in held:
            if server is not None:
                try:
                    server.close()
                except Exception:  # noqa: BLE001 - at exit: drain the others regardless
                    log.warning("closing a LoRA adapter's seed failed", exc_info=True)


def _warm(settings: HookSettings) -> None:
    """Load the transport and initialise the provider now, off the first adapter's clock."""
    # imported here, on a helper thread: vLLM's start-up does not wait for the native library
    from rfork.pull.one_sided import warm_transport

    warm_transport(settings.providers)


def register_lora_resolver() -> None:
    """Register the resolver with vLLM when rfork has somewhere to look (a planner or RFORK_LORA_DIR);
    idempotent. vLLM asks resolvers only with VLLM_ALLOW_RUNTIME_LORA_UPDATING on."""
    if RESOLVER_NAME in LoRAResolverRegistry.get_supported_resolvers():
        return
    settings = HookSettings.resolve(None)
    storage = os.environ.get(LORA_DIR_ENV)
    if not settings.planner_url and not storage:
        return
    cache = os.environ.get(LORA_CACHE_ENV)
    LoRAResolverRegistry.register_resolver(
        RESOLVER_NAME,
        RforkLoraResolver(settings, Path(storage) if storage else None, Path(cache) if cache else None),
    )
