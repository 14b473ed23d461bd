"""Planner settings: one pydantic-settings class, read from RFORK_* environment variables.

Each secret also reads from a file: `RFORK_<NAME>_FILE` names it (RFORK_ADMIN_TOKEN_FILE,
RFORK_CONTROL_SECRET_FILE, ...), as Kubernetes and systemd mount secrets; the variable itself wins.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from planner.selection import policy_name

DEFAULT_DB_URL = "sqlite:///rfork-planner.db"
DEFAULT_PORT = 8470  # `rfork planner serve`; README, deploy/ and the docs use it
# the settings that are secrets: each may come from a file (RFORK_<NAME>_FILE)
SECRET_FIELDS = (
    "admin_token",
    "instance_token",
    "register_token",
    "load_token",
    "reader_token",
    "anchor_token",
    "control_secret",
)


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

    @model_validator(mode="after")
    def _secrets_from_files(self) -> PlannerSettings:
        """Fill each unset secret from the file its RFORK_<NAME>_FILE variable names."""
        for name in SECRET_FIELDS:
            path = os.environ.get(f"RFORK_{name.upper()}_FILE")
            if getattr(self, name) is None and path:
                try:
                    value = Path(path).read_text(encoding="utf-8").strip()
                except OSError as exc:
                    raise ValueError(f"RFORK_{name.upper()}_FILE {path}: {exc.strerror or exc}") from exc
                if not value:
                    raise ValueError(f"RFORK_{name.upper()}_FILE {path} is empty")
                setattr(self, name, value)
        return self

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
