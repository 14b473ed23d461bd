"""vLLM's torch.compile cache by R-Fork: the key, the directory, and the fetch before vLLM compiles.

vLLM compiles after the model is loaded (its profiling run), under
`VLLM_CACHE_ROOT/torch_compile_cache/` (`<10 hex>/rank_<r>_<dp>/` for the backend's graphs and
inductor code, `torch_aot_compile/<hash>/` for the AOT artifact and its inductor cache). The loader
calls `prepare` at the end of `load_model`: it computes the rfork key, gives this worker a cache root
of that key alone (`cache_entry`), installs a seed's archive for that key into it (existing files are
kept; an archive cannot reach the shared root, hence no other configuration's entries), and returns
the shelf this instance serves once it has compiled. vLLM then finds (or not) its own cache files;
the log says which (compile_log). Any failure is logged and vLLM compiles as usual.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rfork.compile_cache.key import CompileCacheKey, processor_tag, settings_digest

if TYPE_CHECKING:
    from rfork.compile_cache.shelf import CacheShelf
    from rfork.identity import SourceIdentity
    from rfork.integrations.hook.settings import HookSettings

log = logging.getLogger(__name__)


def cache_entry(key_digest: str) -> Path | None:
    """This worker's own cache root for `key_digest`, made vLLM's: `<VLLM_CACHE_ROOT>/rfork/<key>`.

    vLLM names its entries by hashes it computes while tracing (`torch_compile_cache/<10 hex>/`,
    `torch_aot_compile/<sha256>/` with its inductor cache), under VLLM_CACHE_ROOT, after the load. So
    the worker points VLLM_CACHE_ROOT at a root of this key alone, read by no other configuration,
    and an archive is installed into its `torch_compile_cache` only: never the shared root, where an
    archive could write the entry of any configuration. None (no cache) when vLLM no longer reads
    the variable (its environment cache is on).
    """
    from vllm import envs

    global _BASE_ROOT
    if _BASE_ROOT is None:
        _BASE_ROOT = Path(envs.VLLM_CACHE_ROOT)
    root = _BASE_ROOT / "rfork" / key_digest[:24]
    before = os.environ.get("VLLM_CACHE_ROOT")
    os.environ["VLLM_CACHE_ROOT"] = str(root)
    if Path(envs.VLLM_CACHE_ROOT) != root:
        if before is None:
            os.environ.pop("VLLM_CACHE_ROOT")
        else:
            os.environ["VLLM_CACHE_ROOT"] = before
        log.warning("rfork: vLLM caches VLLM_CACHE_ROOT already; no compile cache for %s", key_digest[:12])
        return None
    return root / "torch_compile_cache"


_BASE_ROOT: Path | None = None  # VLLM_CACHE_ROOT as this process found it (cache_entry)


def compile_cache_key(vllm_config: Any, identity: SourceIdentity, rank: int) -> CompileCacheKey | None:
    """The key of this worker's compiled graphs; None when vLLM will not compile or cache them."""
    import vllm
    from vllm import envs
    from vllm.config import CompilationMode

    if vllm_config.compilation_config.mode == CompilationMode.NONE or envs.VLLM_DISABLE_COMPILE_CACHE:
        return None
    gpu = None  # the worker's GPU, whatever the identity's device kind (checkpoint mode says "cpu")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        gpu = f"cuda:sm{major}{minor}"
    return CompileCacheKey(
        identity_key=identity.key(),
        rank=rank,
        engine="vllm",
        engine_version=str(vllm.__version__),
        torch_version=str(torch.__version__),
        # vLLM's own config hash and compile-relevant environment: its cache directory depends on both
        settings_digest=settings_digest(
            {"config": vllm_config.compute_hash(), "env": envs.compile_factors()}
        ),
        processor=processor_tag(gpu=gpu),
    )


def prepare(
    vllm_config: Any, identity: SourceIdentity, rank: int, settings: HookSettings
) -> CacheShelf | None:
    """Fetch and install this worker's compile cache from a seed; the shelf to serve it, or None."""
    # imported here: vLLM imports the plugin in each of its processes (start-up time)
    from rfork.compile_cache.fetch import fetch_compile_cache
    from rfork.compile_cache.shelf import CacheShelf
    from rfork.identity import default_labels

    if not settings.compile_cache or settings.planner_url is None:
        return None
    try:
        key = compile_cache_key(vllm_config, identity, rank)
    except Exception as exc:  # noqa: BLE001 - no key, no cache: vLLM compiles as usual
        log.warning("rfork: no compile-cache key (%s); vLLM compiles as usual", exc)
        return None
    if key is None:
        log.info("rfork: vLLM will not compile (eager or cache disabled): no compile cache")
        return None
    digest = key.digest()
    root = cache_entry(digest)
    if root is None:
        return None
    out = fetch_compile_cache(
        planner_url=settings.planner_url,
        token=settings.token,
        key=key,
        dest=root,
        labels=default_labels(),
        timeout_s=max(settings.transfer_timeout_s, 30.0),
    )
    if out.installed:
        log.info(
            "rfork: compile cache %s installed from %s: %d new file(s), %d bytes, %.3f s",
            digest[:12], out.source, out.files, out.archive_bytes, out.seconds,
        )
    else:
        log.info("rfork: compile cache %s not installed (vLLM compiles): %s", digest[:12], out.reason)
    return CacheShelf({key: root})
