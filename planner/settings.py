"""Planner settings: one pydantic-settings class, read from RFORK_* environment variables.

The database URL and every token or secret may instead come from a file that `RFORK_<FIELD>_FILE`
names (a mounted Kubernetes or Docker secret): e.g. RFORK_ADMIN_TOKEN_FILE=/run/secrets/admin.
"""

from __future__ import annotations

import hashlib
import os
from typing import Annotated, Any

from pydantic import AfterValidator, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from planner.contract.networks import parse_networks
from planner.secret_files import warn_if_world_readable
from planner.selection import policy_name

DEFAULT_DB_URL = "sqlite:///rfork-planner.db"
DEFAULT_PORT = 8470  # `rfork planner serve`; README, deploy/ and the docs use it
# fields that RFORK_<FIELD>_FILE may give instead (the URL carries the database password)
SECRET_FIELDS = (
    "db_url",
    "admin_token",
    "instance_token",
    "register_token",
    "load_token",
    "reader_token",
    "anchor_token",
    "control_secret",
)


class SettingsError(RuntimeError):
    """A setting cannot be read (a secret file); the message is one line naming the variable."""


def _networks(text: str) -> str:
    """A CIDR list the planner can parse (ValueError naming the bad entry)."""
    parse_networks(text)
    return text


class PlannerSettings(BaseSettings):
    """Everything the planner service can be told; env names are RFORK_<FIELD> (e.g. RFORK_ADMIN_TOKEN)."""

    model_config = SettingsConfigDict(env_prefix="RFORK_", extra="ignore")

    db_url: str = DEFAULT_DB_URL
    admin_token: str | None = None
    instance_token: str | None = None  # legacy: register + load in one token
    register_token: str | None = None
    load_token: str | None = None
    reader_token: str | None = None
    # register + set an identity's anchor from a disk publication: give it to trusted disk seeds only
    anchor_token: str | None = None
    insecure: bool = False
    # `serve`: do not migrate at start, only check the schema is current (a Job or an init container
    # migrates: `rfork planner migrate`)
    no_migrate: bool = False
    # seals the seeds' control keys in the database (planner.contract.control_token.seal); every planner
    # process of one database needs the same. Unset: derived from the configured tokens and the database URL
    control_secret: str | None = Field(default=None, repr=False)
    heartbeat_ttl_s: float = Field(default=30.0, gt=0)
    lease_ttl_s: float = Field(default=120.0, gt=0)
    reaper_interval_s: float = Field(default=5.0, gt=0)
    # a name in planner.selection.POLICIES
    selection_policy: Annotated[str, AfterValidator(policy_name)] = "load_aware"
    # load_aware: a requester whose rack already holds a seed of the identity waits (429) for one of
    # those instead of pulling across racks, so the spine carries only each rack's first copies
    rack_hold: bool = False
    # rack_hold, a rack with no seed yet: this many pulls into it at once by loaders that will serve
    # there (its first copies, across the spine); its other loaders wait for them. On the emulated fleet
    # (uplink = one host NIC) every loader of such a rack pulled across at once and the shared uplink
    # took 2x the ideal rack-aware tree (docs/scale-out.md)
    rack_first_copies: int = Field(default=1, ge=1)
    # a requester that will serve once loaded (serves_after > 0) is leased only a seed with no live pull:
    # when a seed's NIC is the bottleneck two pulls halve each other's rate, and the doubling tree wants
    # each pull at full rate so that new seeds appear after one transfer, not two (measured on the
    # emulated fleet, docs/scale-out.md). Requesters that will not serve still fill every seed's
    # max_concurrent_pulls. Turn off where one pull cannot fill a seed's NIC.
    solo_pulls_for_seeds: bool = True
    max_candidates: int = Field(default=3, ge=1, le=64)
    failure_threshold: int = Field(default=3, ge=1)
    quarantine_s: float = Field(default=300.0, ge=0)
    max_manifest_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)  # every other route
    retry_after_s: float = Field(default=1.0, gt=0)  # unused since planner.burst computes Retry-After
    db_pool_size: int = Field(default=16, ge=1)
    threadpool_size: int | None = Field(default=None, ge=1, le=1024)  # None: 4 on SQLite, else 8
    heartbeat_batch_s: float = Field(default=0.01, ge=0, le=1)
    # 429 all_busy (planner.burst): Retry-After from the live leases and recorded pull rates
    retry_after_min_s: float = Field(default=0.05, gt=0)
    retry_after_max_s: float = Field(default=60.0, gt=0)
    # a 429 is answered again from memory while no write of this process changed rows and the clock
    # moved less than this (planner.service: the herd of a fleet started at once; SQLite only)
    busy_cache_s: float = Field(default=0.05, ge=0, le=5)
    assumed_pull_gbps: float = Field(default=1.0, gt=0)  # until a pull of the identity is recorded
    rate_window: int = Field(default=16, ge=1, le=1024)  # recent successful pulls that give the rate
    rate_history_s: float = Field(default=86_400.0, gt=0)  # ... ended at most this long ago
    stale_retention_s: float = Field(default=3600.0, ge=0)  # STALE this long: deleted with its manifests
    false_report_threshold: int = Field(default=3, ge=1)  # disproved checksum claims that flag a reporter
    # transport failures quarantine a seed only when this many distinct witnesses (credentials: a static
    # token, or the one that registered the reporting instance) stand behind the failure_threshold in a
    # row, or the planner's probe of it fails
    transport_witnesses: int = Field(default=2, ge=1)
    # checksum reports from this many distinct witnesses (credentials) end a seed's probation pulls
    checksum_witnesses: int = Field(default=2, ge=1)
    # an accusation lapses this long after it was made (the reaper): the seed is offered again, and the
    # loaders verify every byte as always
    accusation_s: float = Field(default=900.0, gt=0)
    # instances one credential (register, anchor, load+register token) may have registered; past it a
    # registration is refused (409). An admin's are not counted.
    max_instances_per_credential: int = Field(default=4096, ge=1)
    probe_timeout_s: float = Field(default=2.0, gt=0, le=60)  # GET {control_url}/v1/health, whole answer
    probe_interval_s: float = Field(default=10.0, gt=0)  # quarantined seeds are probed again this often
    # CIDR list (comma or space separated) the health probe may connect to; empty: every address. A
    # control URL is a register token's word: without a list the probe's outcome tells it whether any
    # host:port the planner reaches answers
    probe_networks: Annotated[str, AfterValidator(_networks)] = ""

    @model_validator(mode="before")
    @classmethod
    def _secrets_from_files(cls, data: Any) -> Any:
        """RFORK_<FIELD>_FILE: the field from that file (whitespace stripped), unless given in code."""
        if not isinstance(data, dict):
            return data
        for field in SECRET_FIELDS:
            var = f"RFORK_{field.upper()}"
            path = os.environ.get(f"{var}_FILE")
            if not path:
                continue
            if os.environ.get(var):
                raise SettingsError(f"both ${var} and ${var}_FILE are set; keep one")
            if data.get(field) is not None:
                continue  # given in code or on the command line (`--db`): that wins
            try:
                with open(path, encoding="utf-8") as f:
                    value = f.read().strip()
            except OSError as exc:
                raise SettingsError(f"${var}_FILE={path}: {exc.strerror or exc}") from None
            warn_if_world_readable(path, f"${var}_FILE")
            if not value:
                raise SettingsError(f"${var}_FILE={path} is empty")
            data[field] = value
        return data

    def control_secret_bytes(self) -> bytes:
        """The secret that seals control keys (see control_secret)."""
        if self.control_secret:
            return self.control_secret.encode()
        parts = (
            self.admin_token,
            self.instance_token,
            self.register_token,
            self.anchor_token,
            self.load_token,
            self.reader_token,
            self.db_url,
        )
        return hashlib.sha256("\0".join(p or "" for p in parts).encode()).digest()

    def has_tokens(self) -> bool:
        """True when at least one bearer token is configured."""
        return any(
            (
                self.admin_token,
                self.instance_token,
                self.register_token,
                self.anchor_token,
                self.load_token,
                self.reader_token,
            )
        )
