"""accusations: a checksum report holds a seed out until an independent verification; why a seed is
quarantined (corroborated reports or a failed health probe)

Revision ID: 0006
Revises: 0004 (re-chained after 0005 when the lanes merge)
Create Date: 2026-11-28 06:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    with op.batch_alter_table("instances") as batch:
        batch.add_column(sa.Column("accused_since", sa.Float(), nullable=True))
        batch.add_column(sa.Column("quarantine_cause", sa.String(length=32), nullable=True))
    op.create_index("ix_instances_identity_accused", "instances", ["identity_key", "accused_since"])
    op.create_index("ix_instances_accused", "instances", ["accused_since"])


def downgrade() -> None:
    op.drop_index("ix_instances_accused", table_name="instances")
    op.drop_index("ix_instances_identity_accused", table_name="instances")
    with op.batch_alter_table("instances") as batch:
        batch.drop_column("quarantine_cause")
        batch.drop_column("accused_since")
