"""SQLAlchemy 2 models: the planner's schema (Alembic's env.py reads `Base.metadata`)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


class Base(DeclarativeBase):
    """Declarative base; its metadata is the schema the migrations must produce."""


class Instance(Base):
    """A registered inference instance (seed or loader). Times are UNIX seconds (float)."""

    __tablename__ = "instances"
    __table_args__ = (
        Index("ix_instances_status_updated", "status", "updated_at"),
        Index("ix_instances_identity_accused", "identity_key", "accused_since"),
        Index("ix_instances_accused", "accused_since"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    identity_key: Mapped[str] = mapped_column(String(64), index=True)
    identity: Mapped[dict[str, Any]] = mapped_column(JSON)
    model: Mapped[str] = mapped_column(String(512), index=True)
    fingerprint: Mapped[str] = mapped_column(String(256), index=True)
    node: Mapped[str] = mapped_column(String(256), index=True)
    rack: Mapped[str] = mapped_column(String(256))
    zone: Mapped[str] = mapped_column(String(256))
    control_url: Mapped[str | None] = mapped_column(String(2048), nullable=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    max_concurrent_pulls: Mapped[int] = mapped_column(Integer)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    last_heartbeat: Mapped[float] = mapped_column(Float)
    consecutive_failures: Mapped[int] = mapped_column(Integer, default=0)
    quarantined_until: Mapped[float | None] = mapped_column(Float, nullable=True)
    # no longer written: control keys are derived from the planner's secret (planner.contract.control_token)
    control_key: Mapped[str | None] = mapped_column(String(128), nullable=True)
    # granted by the registering token's roles (planner.auth): set the identity's anchor from a disk
    # publication; lease (this identity only) with the instance's own token
    may_anchor: Mapped[bool] = mapped_column(Boolean, server_default=false(), default=False)
    may_lease: Mapped[bool] = mapped_column(Boolean, server_default=false(), default=False)
    # a loader reported a checksum mismatch: not offered until it re-hashed its memory and republished
    reverify_since: Mapped[float | None] = mapped_column(Float, nullable=True)
    # its republication differed from the anchor: never offered until it republishes clean
    integrity_failed: Mapped[bool] = mapped_column(Boolean, server_default=false(), default=False)
    # a checksum report stands against it: offered only for a probation pull (one at a time, to a loader
    # that did not accuse it) until such a pull verifies; its own republication never clears it
    accused_since: Mapped[float | None] = mapped_column(Float, nullable=True)
    # why quarantined_until was set: "reports" (transport failures from distinct reporters) or "probe"
    quarantine_cause: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # Principal.holder of the credential that registered it: its reports count as that credential's (one
    # witness however many instances it registers), and registrations per credential are bounded
    registered_by: Mapped[str | None] = mapped_column(String(80), nullable=True, index=True)

    ranks: Mapped[list[InstanceRank]] = relationship(
        back_populates="instance",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="InstanceRank.rank",
        lazy="selectin",
    )
    compile_caches: Mapped[list[CompileCache]] = relationship(
        back_populates="instance",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="CompileCache.cache_key",
        lazy="selectin",
    )


class InstanceRank(Base):
    """One global rank of an instance: the transport it serves and its engine address."""

    __tablename__ = "instance_ranks"

    instance_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("instances.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    provider: Mapped[str] = mapped_column(String(32))
    address: Mapped[bytes] = mapped_column(LargeBinary)
    backends: Mapped[list[str]] = mapped_column(JSON)

    instance: Mapped[Instance] = relationship(back_populates="ranks")


class CompileCache(Base):
    """A compile-cache key an instance serves (rfork.compile_cache): what the engine compiled for it.

    Registered with the instance and deleted with it; the key is a sha256 of everything a compiled
    artifact depends on, so equal keys are interchangeable caches.
    """

    __tablename__ = "compile_caches"

    instance_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("instances.id", ondelete="CASCADE"), primary_key=True
    )
    cache_key: Mapped[str] = mapped_column(String(64), primary_key=True, index=True)
    # loaders' reports of fetches from it (POST /v1/compile-caches/{key}/reports): sources are ranked by
    # this evidence, a source that served the anchored archive before first, one that failed last
    served: Mapped[int] = mapped_column(Integer, server_default="0", default=0)
    failed: Mapped[int] = mapped_column(Integer, server_default="0", default=0)

    instance: Mapped[Instance] = relationship(back_populates="compile_caches")


class CompileCacheAnchor(Base):
    """The archive digest a compile-cache key must have, set by an authority: an admin upload, or the
    first publication of an instance registered with the `anchor` role that serves the key. Loaders
    install only an archive with this digest (rfork.compile_cache.fetch); kept when instances go."""

    __tablename__ = "compile_cache_anchors"

    cache_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    identity_key: Mapped[str] = mapped_column(String(64))  # the identity whose instances may serve it
    archive_digest: Mapped[str] = mapped_column(String(80))  # rfork.compile_cache.archive.archive_digest
    instance_id: Mapped[str] = mapped_column(String(32))  # the anchoring instance, or "" for an upload
    created_at: Mapped[float] = mapped_column(Float)
    set_by: Mapped[str] = mapped_column(String(80))  # Principal.holder of the authority


class Manifest(Base):
    """A rank manifest, stored verbatim as the JSON text the seed sent."""

    __tablename__ = "manifests"

    instance_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("instances.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    body: Mapped[str] = mapped_column(Text)
    nbytes: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[float] = mapped_column(Float)
    checksum_algorithm: Mapped[str] = mapped_column(String(128), default="")
    digest_set: Mapped[str] = mapped_column(String(64), default="")  # planner.contract.integrity.digest_set


class Anchor(Base):
    """The digests an identity's rank must have, set by an authority: uploaded by an admin, or recorded
    from the first disk publication of an instance registered with the `anchor` role; later manifests
    must match (one row per checksum algorithm, so a device-side digest is anchored separately)."""

    __tablename__ = "anchors"

    identity_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    checksum_algorithm: Mapped[str] = mapped_column(String(128), primary_key=True)
    digest_set: Mapped[str] = mapped_column(String(64))
    digests: Mapped[dict[str, str]] = mapped_column(JSON)  # tensor name -> checksum
    instance_id: Mapped[str] = mapped_column(String(32))  # the disk-loaded instance that anchored it, or ""
    created_at: Mapped[float] = mapped_column(Float)
    set_by: Mapped[str] = mapped_column(String(80), default="")  # Principal.holder of the authority


class Lease(Base):
    """An assignment: a loader pulls one rank from a seed until it reports or the lease expires.

    Live while `ended_at` is NULL and `expires_at` is in the future. Kept after it ends as the
    transfer history (no foreign key, so deleting the seed keeps the figures).
    """

    __tablename__ = "leases"
    __table_args__ = (
        Index("ix_leases_seed_live", "instance_id", "rank", "ended_at"),
        Index("ix_leases_holder_disproved", "holder", "disproved"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    instance_id: Mapped[str] = mapped_column(String(32))
    rank: Mapped[int] = mapped_column(Integer)
    identity_key: Mapped[str] = mapped_column(String(64), index=True)
    requester_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    holder: Mapped[str | None] = mapped_column(String(80), nullable=True)  # planner.auth.Principal.holder
    provider: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[float] = mapped_column(Float, index=True)
    expires_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    outcome: Mapped[str | None] = mapped_column(String(16), nullable=True)
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    seconds: Mapped[float | None] = mapped_column(Float, nullable=True)
    backend: Mapped[str | None] = mapped_column(String(32), nullable=True)
    reason: Mapped[str | None] = mapped_column(String(1024), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # a checksum_mismatch claim the seed's re-verification disproved (counts against the reporter)
    disproved: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    # the witness behind the holder (Principal.witness): a static token, or the credential that registered
    # the holding instance; distinct reporters are counted by it (planner.service.reports)
    credential: Mapped[str | None] = mapped_column(String(80), nullable=True)
