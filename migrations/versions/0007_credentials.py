"""credentials: which credential registered an instance, and which one stands behind a lease's reports

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


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("credential")
    op.drop_index("ix_instances_registered_by", table_name="instances")
    with op.batch_alter_table("instances") as batch:
        batch.drop_column("registered_by")
