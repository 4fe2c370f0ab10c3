"""A chunk whose run_chunk task failed every attempt is `failed`, its requests each with an error record; a batch
remembers when its stalled finalize was last sent again

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 16:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Postgres adds an enum value in place; it cannot remove one, hence the rebuild in downgrade.
    op.execute("ALTER TYPE chunk_status ADD VALUE IF NOT EXISTS 'failed'")
    op.add_column("batches", sa.Column("finalize_resent_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("batches", "finalize_resent_at")
    # The older schema's nearest state is `done` (requests counted, error records written), but a done chunk
    # should have an output object and a failed one has none: settle the jobs with failed chunks before this.
    op.execute("ALTER TYPE chunk_status RENAME TO chunk_status_with_failed")
    op.execute("CREATE TYPE chunk_status AS ENUM ('pending', 'done', 'skipped')")
    op.execute(
        "ALTER TABLE chunks ALTER COLUMN status TYPE chunk_status USING "
        "(CASE status::text WHEN 'failed' THEN 'done' ELSE status::text END)::chunk_status"
    )
    op.execute("DROP TYPE chunk_status_with_failed")
