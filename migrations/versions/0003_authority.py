"""authority: who may anchor or lease, re-verification after a checksum report, who set an anchor

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 21:45:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    # instances registered before this revision keep nothing they were not granted: they anchor nothing
    # and lease nothing with their own token (their static tokens still do what their roles allow)
    with op.batch_alter_table("instances") as batch:
        batch.add_column(sa.Column("may_anchor", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("may_lease", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("reverify_since", sa.Float(), nullable=True))
        batch.add_column(
            sa.Column("integrity_failed", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.create_index("ix_instances_status_updated", ["status", "updated_at"])
    with op.batch_alter_table("anchors") as batch:
        batch.add_column(sa.Column("set_by", sa.String(length=80), nullable=False, server_default=""))
    with op.batch_alter_table("anchors") as batch:  # rows before this revision: set by "" (unknown)
        batch.alter_column("set_by", server_default=None)
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("disproved", sa.Boolean(), nullable=True))
        batch.create_index("ix_leases_holder_disproved", ["holder", "disproved"])
    # control keys are derived from the planner's secret from now on: stored ones could forge tokens
    op.execute(sa.text("UPDATE instances SET control_key = NULL"))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_index("ix_leases_holder_disproved")
        batch.drop_column("disproved")
    with op.batch_alter_table("anchors") as batch:
        batch.drop_column("set_by")
    with op.batch_alter_table("instances") as batch:
        batch.drop_index("ix_instances_status_updated")
        batch.drop_column("integrity_failed")
        batch.drop_column("reverify_since")
        batch.drop_column("may_lease")
        batch.drop_column("may_anchor")
