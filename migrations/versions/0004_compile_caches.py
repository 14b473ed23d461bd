"""compile caches: which instances serve compiled artifacts for which key

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24 01:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "compile_caches",
        sa.Column("instance_id", sa.String(length=32), nullable=False),
        sa.Column("cache_key", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["instance_id"], ["instances.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("instance_id", "cache_key"),
    )
    op.create_index("ix_compile_caches_cache_key", "compile_caches", ["cache_key"])


def downgrade() -> None:
    op.drop_index("ix_compile_caches_cache_key", table_name="compile_caches")
    op.drop_table("compile_caches")
