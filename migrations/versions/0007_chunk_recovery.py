"""A chunk keeps the ids of its accepted lines (`custom_id`, a document's id): its requests' error records, when
it cannot run or expires unrun, are written from them without reading the input again

Revision ID: 0007_chunk_recovery
Revises: 0006
Create Date: 2026-11-26 18:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007_chunk_recovery"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Null for the chunks recorded before: their ids are read from the input, as they always were.
    op.add_column("chunks", sa.Column("request_ids", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column("chunks", "request_ids")
