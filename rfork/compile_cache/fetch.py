"""Fetch a compile cache before the engine compiles: ask the planner, download, verify, install.

The story: the planner answers the key's anchored archive digest (set by an authority, never by the
seed that serves it) and the READY seeds of the key's identity that serve it, those with evidence
(anchored it, served it verified before) first, then nearest, with a one-fetch token each; the first
seed whose archive downloads within the deadline and size cap, has the anchored digest and was packed
under the same key is installed (rfork.compile_cache.archive.unpack). Every outcome is reported, and
failed seeds are replaced, within one deadline for the whole fetch.
A key no authority anchored is not fetched at all. Nothing here raises for a peer's or the network's
failure: the outcome says why nothing was installed (logged) and the engine simply compiles, as it
would without rfork.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from planner.contract import CompileCacheSource, PlannerClient, PlannerError, seed_http
from rfork.compile_cache.archive import CompileCacheError, Limits, unpack
from rfork.compile_cache.key import CompileCacheKey
from rfork.seed_networks import allowed_networks, resolve_seed_host

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class FetchOutcome:
    """What a fetch did: installed from `source` (files new to the local cache), or why not."""

    installed: bool
    source: str | None = None  # the seed's instance id
    files: int = 0
    archive_bytes: int = 0
    seconds: float = 0.0
    reason: str | None = None


MAX_SOURCES = 32  # sources one fetch tries at most, over all of the planner's answers


def fetch_compile_cache(
    *,
    planner_url: str,
    token: str | None,
    key: CompileCacheKey,
    dest: Path,
    labels: Mapping[str, str] | None = None,
    limits: Limits = Limits(),
    timeout_s: float = 30.0,
) -> FetchOutcome:
    """Install the compile cache `key` into `dest` from the first seed that serves a valid archive, all
    within `timeout_s`; the planner is asked for the sources of `key`'s identity only.

    Each source's outcome is reported to the planner (it ranks sources by that evidence), and sources
    that failed are replaced by asking again without them, until one verifies, the planner has no
    other, MAX_SOURCES were tried or the deadline passed: decoys cost a loader at most `timeout_s`.

    ValueError for a malformed RFORK_SEED_NETWORKS (a setting, not a peer's failure)."""
    allowed_networks()
    t0 = time.perf_counter()
    end = time.monotonic() + timeout_s
    name = key.digest()
    tried: list[str] = []
    reasons: list[str] = []
    try:
        with PlannerClient(planner_url, token=token, timeout_s=timeout_s) as client:
            while len(tried) < MAX_SOURCES and time.monotonic() < end:
                found = client.compile_cache_sources(
                    name, identity_key=key.identity_key, labels=labels, exclude=tried
                )
                if found is None or not found.sources:
                    if not tried:
                        return _nothing(t0, f"no READY seed serves compile cache {name[:12]}")
                    break
                for source in found.sources[: MAX_SOURCES - len(tried)]:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    tried.append(source.instance_id)
                    try:
                        data = _download(source, name, limits=limits, timeout_s=left)
                        files = unpack(data, dest, key=name, digest=found.archive_digest, limits=limits)
                    except (CompileCacheError, seed_http.SeedHttpError, OSError, ValueError) as exc:
                        log.info("compile cache %s from %s refused: %s", name[:12], source.instance_id, exc)
                        reasons.append(f"{source.instance_id}: {exc}")
                        _report(client, name, source.instance_id, "failed", str(exc))
                        continue
                    _report(client, name, source.instance_id, "verified", None)
                    out = FetchOutcome(
                        installed=True,
                        source=source.instance_id,
                        files=files,
                        archive_bytes=len(data),
                        seconds=time.perf_counter() - t0,
                    )
                    log.info(
                        "compile cache %s: %d bytes from %s verified, %d new file(s) in %s in %.3f s",
                        name[:12], out.archive_bytes, out.source, files, dest, out.seconds,
                    )
                    return out
    except PlannerError as exc:
        reasons.append(f"planner: {exc}")
    if time.monotonic() >= end:
        reasons.append(f"the {timeout_s:g} s deadline passed")
    return _nothing(t0, "; ".join(reasons))


def _report(client: PlannerClient, key: str, instance_id: str, outcome: str, error: str | None) -> None:
    """Tell the planner how the fetch from `instance_id` went; its failure only costs the evidence."""
    try:
        client.report_compile_cache(key, instance_id, outcome, error=None if error is None else error[:1024])
    except PlannerError as exc:
        log.info("compile cache %s: report on %s not sent: %s", key[:12], instance_id, exc)


def _download(source: CompileCacheSource, key: str, *, limits: Limits, timeout_s: float) -> bytes:
    """The archive, within `timeout_s` in all and `limits.max_archive_bytes`; CompileCacheError for a
    refusal, SeedHttpError for a deadline or an oversize, SeedNetworkRefused for a network outside
    RFORK_SEED_NETWORKS."""
    url = f"{source.control_url.rstrip('/')}/v1/compile-caches/{key}"
    resp = seed_http.exchange(
        url,
        headers={"Authorization": f"Bearer {source.control_token}"},
        deadline_s=timeout_s,
        max_body_bytes=limits.max_archive_bytes,
        resolve=resolve_seed_host,
    )
    if resp.status != 200:
        raise CompileCacheError(f"GET {url}: {resp.status} {resp.body[:300].decode('utf-8', 'replace')}")
    return resp.body


def _nothing(t0: float, reason: str) -> FetchOutcome:
    log.info("compile cache not installed: %s", reason)
    return FetchOutcome(installed=False, seconds=time.perf_counter() - t0, reason=reason)
