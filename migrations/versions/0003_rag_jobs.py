"""RAG preprocessing jobs: a batch's RAG options and input prefix, a schedule's RAG options

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 03:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('batches', sa.Column('rag_options', postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.add_column('batches', sa.Column('input_prefix', sa.String(length=1024), nullable=True))
    op.add_column('schedules', sa.Column('rag_options', postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column('schedules', 'rag_options')
    op.drop_column('batches', 'input_prefix')
    op.drop_column('batches', 'rag_options')
