"""Idempotent create requests (Idempotency-Key) and batches whose validate could not be queued

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24 06:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "idempotent_requests",
        sa.Column("project_id", sa.String(length=64), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("response", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("project_id", "key"),
    )
    op.create_index("ix_idempotent_requests_created", "idempotent_requests", ["created_at"])
    op.add_column("batches", sa.Column("validate_unsent", sa.Boolean(), server_default="false", nullable=False))


def downgrade() -> None:
    op.drop_column("batches", "validate_unsent")
    op.drop_index("ix_idempotent_requests_created", table_name="idempotent_requests")
    op.drop_table("idempotent_requests")
