"""OpenAI compatibility: a batch's model, token usage and output expiry; a file's expiry

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24 07:40:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('batches', sa.Column('model', sa.String(length=256), nullable=True))
    op.add_column('batches', sa.Column('input_tokens', sa.BigInteger(), server_default='0', nullable=False))
    op.add_column('batches', sa.Column('output_tokens', sa.BigInteger(), server_default='0', nullable=False))
    op.add_column('batches', sa.Column('cached_tokens', sa.BigInteger(), server_default='0', nullable=False))
    op.add_column('batches', sa.Column('output_expires_after_seconds', sa.Integer(), nullable=True))
    op.add_column('files', sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column('files', 'expires_at')
    op.drop_column('batches', 'output_expires_after_seconds')
    op.drop_column('batches', 'cached_tokens')
    op.drop_column('batches', 'output_tokens')
    op.drop_column('batches', 'input_tokens')
    op.drop_column('batches', 'model')
