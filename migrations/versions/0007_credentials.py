"""credentials and evidence: which credential registered an instance, which one stands behind a lease's
reports, and loaders' reports of compile-cache fetches per source

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07 05:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.add_column(sa.Column("registered_by", sa.String(length=80), nullable=True))
    op.create_index("ix_instances_registered_by", "instances", ["registered_by"])
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("credential", sa.String(length=80), nullable=True))
    with op.batch_alter_table("compile_caches") as batch:
        batch.add_column(sa.Column("served", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(sa.Column("failed", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("compile_caches") as batch:
        batch.drop_column("failed")
        batch.drop_column("served")
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("credential")
    op.drop_index("ix_instances_registered_by", table_name="instances")
    with op.batch_alter_table("instances") as batch:
        batch.drop_column("registered_by")
