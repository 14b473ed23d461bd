"""compile-cache anchors: the archive digest an authority set for each compile-cache key

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28 06:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "compile_cache_anchors",
        sa.Column("cache_key", sa.String(length=64), nullable=False),
        sa.Column("identity_key", sa.String(length=64), nullable=False),
        sa.Column("archive_digest", sa.String(length=80), nullable=False),
        sa.Column("instance_id", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("set_by", sa.String(length=80), nullable=False),
        sa.PrimaryKeyConstraint("cache_key"),
    )


def downgrade() -> None:
    op.drop_table("compile_cache_anchors")
