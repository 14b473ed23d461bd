"""Fetch a compile cache before the engine compiles: ask the planner, download, verify, install.

The story: the planner names READY seeds that serve the key (nearest first) with a compile-cache
token each; the first seed whose archive downloads within the size cap, matches its digest and was
packed under the same key is installed (rfork.compile_cache.archive.unpack). Nothing here raises for
a peer's or the network's failure: the outcome says why nothing was installed and the engine simply
compiles, as it would without rfork.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from planner.contract import CompileCacheSource, PlannerClient, PlannerError
from rfork.compile_cache.archive import CompileCacheError, Limits, unpack

log = logging.getLogger(__name__)

DIGEST_HEADER = "x-rfork-archive-digest"


@dataclass(kw_only=True)
class FetchOutcome:
    """What a fetch did: installed from `source` (files new to the local cache), or why not."""

    installed: bool
    source: str | None = None  # the seed's instance id
    files: int = 0
    archive_bytes: int = 0
    seconds: float = 0.0
    reason: str | None = None


def fetch_compile_cache(
    *,
    planner_url: str,
    token: str | None,
    key: str,
    dest: Path,
    labels: Mapping[str, str] | None = None,
    limits: Limits = Limits(),
    timeout_s: float = 30.0,
) -> FetchOutcome:
    """Install the compile cache `key` into `dest` from the first seed that serves a valid archive."""
    t0 = time.perf_counter()
    try:
        with PlannerClient(planner_url, token=token, timeout_s=timeout_s) as client:
            found = client.compile_cache_sources(key, labels=labels)
    except PlannerError as exc:
        return _nothing(t0, f"planner: {exc}")
    if found is None:
        return _nothing(t0, f"no READY seed serves compile cache {key[:12]}")
    reasons = []
    for source in found.sources:
        try:
            data, digest = _download(source, key, limits=limits, timeout_s=timeout_s)
            files = unpack(data, dest, key=key, digest=digest, limits=limits)
        except (CompileCacheError, httpx.HTTPError, OSError, ValueError) as exc:  # a peer's failure
            log.info("compile cache %s from %s refused: %s", key[:12], source.instance_id, exc)
            reasons.append(f"{source.instance_id}: {exc}")
            continue
        out = FetchOutcome(
            installed=True,
            source=source.instance_id,
            files=files,
            archive_bytes=len(data),
            seconds=time.perf_counter() - t0,
        )
        log.info(
            "compile cache %s: %d bytes from %s verified, %d new file(s) in %s in %.3f s",
            key[:12], out.archive_bytes, out.source, files, dest, out.seconds,
        )
        return out
    return _nothing(t0, "; ".join(reasons))


def _download(source: CompileCacheSource, key: str, *, limits: Limits, timeout_s: float) -> tuple[bytes, str]:
    """The archive and the digest its seed announced; CompileCacheError for a refusal or an oversize."""
    url = f"{source.control_url.rstrip('/')}/v1/compile-caches/{key}"
    headers = {"Authorization": f"Bearer {source.control_token}"}
    with httpx.stream("GET", url, headers=headers, timeout=timeout_s) as resp:
        if resp.status_code != 200:
            resp.read()
            raise CompileCacheError(f"GET {url}: {resp.status_code} {resp.text[:300]}")
        digest = resp.headers.get(DIGEST_HEADER)
        if not digest:
            raise CompileCacheError(f"GET {url}: no {DIGEST_HEADER} header")
        declared = int(resp.headers.get("content-length") or 0)
        if declared > limits.max_archive_bytes:
            raise CompileCacheError(f"GET {url}: archive of {declared} bytes over the limit")
        parts, size = [], 0
        for chunk in resp.iter_bytes():
            size += len(chunk)
            if size > limits.max_archive_bytes:
                raise CompileCacheError(f"GET {url}: archive over {limits.max_archive_bytes} bytes")
            parts.append(chunk)
    return b"".join(parts), digest


def _nothing(t0: float, reason: str) -> FetchOutcome:
    log.debug("compile cache not installed: %s", reason)
    return FetchOutcome(installed=False, seconds=time.perf_counter() - t0, reason=reason)
