"""vLLM's torch.compile cache by R-Fork: the key, the directory, and the fetch before vLLM compiles.

vLLM compiles after the model is loaded (its profiling run), into one cache entry: the config's
`compilation_config.cache_dir`, or else `VLLM_CACHE_ROOT/torch_compile_cache/<10 hex>/` (graphs and
inductor code under `rank_<r>_<dp>/`). The loader calls `prepare` at the end of `load_model`: it
computes the rfork key, selects the entry (`cache_entry`: the config's own cache_dir, else one named
by the key, which it sets in the config so vLLM compiles there), installs a seed's archive for that key
into that entry only (existing files are kept; an archive cannot reach another entry or the root), and
returns the shelf this instance serves once it has compiled. vLLM then finds (or not) its own cache
files; the log says which (compile_log). Any failure is logged and vLLM compiles as usual.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rfork.compile_cache.key import CompileCacheKey, processor_tag, settings_digest

if TYPE_CHECKING:
    from rfork.compile_cache.shelf import CacheShelf
    from rfork.identity import SourceIdentity
    from rfork.integrations.hook.settings import HookSettings

log = logging.getLogger(__name__)


def cache_entry(vllm_config: Any, key_digest: str) -> Path:
    """The one cache entry this worker compiles into, set in its config: the config's cache_dir when the
    user gave one, else `VLLM_CACHE_ROOT/torch_compile_cache/rfork-<key>` (never the root: an archive
    unpacked there could write any entry, i.e. code another configuration imports)."""
    from vllm import envs

    compilation = vllm_config.compilation_config
    if not compilation.cache_dir:
        entry = Path(envs.VLLM_CACHE_ROOT) / "torch_compile_cache" / f"rfork-{key_digest[:20]}"
        compilation.cache_dir = str(entry)
    return Path(compilation.cache_dir)


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
    root = cache_entry(vllm_config, digest)
    out = fetch_compile_cache(
        planner_url=settings.planner_url,
        token=settings.token,
        key=digest,
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
    return CacheShelf({digest: root})
