"""trust: integrity anchors, manifest digest sets, lease holders, control keys

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 11:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "anchors",
        sa.Column("identity_key", sa.String(length=64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("checksum_algorithm", sa.String(length=128), nullable=False),
        sa.Column("digest_set", sa.String(length=64), nullable=False),
        sa.Column("digests", sa.JSON(), nullable=False),
        sa.Column("instance_id", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("identity_key", "rank", "checksum_algorithm"),
    )
    with op.batch_alter_table("instances") as batch:
        batch.add_column(sa.Column("control_key", sa.String(length=128), nullable=True))
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("holder", sa.String(length=80), nullable=True))
    # manifests stored before this revision have no digest set: they are not served until republished
    with op.batch_alter_table("manifests") as batch:
        batch.add_column(
            sa.Column("checksum_algorithm", sa.String(length=128), nullable=False, server_default="")
        )
        batch.add_column(sa.Column("digest_set", sa.String(length=64), nullable=False, server_default=""))
    with op.batch_alter_table("manifests") as batch:
        batch.alter_column("checksum_algorithm", server_default=None)
        batch.alter_column("digest_set", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("manifests") as batch:
        batch.drop_column("digest_set")
        batch.drop_column("checksum_algorithm")
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("holder")
    with op.batch_alter_table("instances") as batch:
        batch.drop_column("control_key")
    op.drop_table("anchors")
