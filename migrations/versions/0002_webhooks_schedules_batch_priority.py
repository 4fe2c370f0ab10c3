"""webhooks, schedules, batch priority

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 01:42:50.195225
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('schedules',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('cron', sa.String(length=128), nullable=False),
    sa.Column('timezone', sa.String(length=64), nullable=False),
    sa.Column('endpoint', sa.String(length=64), nullable=False),
    sa.Column('completion_window', sa.String(length=16), nullable=False),
    sa.Column('input_file_id', sa.String(length=64), nullable=True),
    sa.Column('input_prefix', sa.String(length=1024), nullable=True),
    sa.Column('metadata', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('webhook_endpoint_id', sa.String(length=64), nullable=True),
    sa.Column('paused', sa.Boolean(), nullable=False),
    sa.Column('next_fire_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_schedules_project_created', 'schedules', ['project_id', 'created_at', 'id'], unique=False)
    op.create_index('ix_schedules_next_fire_at', 'schedules', ['next_fire_at'], unique=False)
    op.create_table('webhook_endpoints',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('url', sa.String(length=2048), nullable=False),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('events', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('secret', sa.String(length=128), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index(op.f('ix_webhook_endpoints_project_id'), 'webhook_endpoints', ['project_id'], unique=False)
    op.create_table('webhook_events',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('type', sa.String(length=64), nullable=False),
    sa.Column('batch_id', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('batch_id', 'type', name='uq_webhook_events_batch_type')
    )
    op.create_index(op.f('ix_webhook_events_project_id'), 'webhook_events', ['project_id'], unique=False)
    op.create_table('schedule_fires',
    sa.Column('schedule_id', sa.String(length=64), nullable=False),
    sa.Column('fire_time', sa.DateTime(timezone=True), nullable=False),
    sa.Column('batch_id', sa.String(length=64), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['schedule_id'], ['schedules.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('schedule_id', 'fire_time')
    )
    op.create_table('webhook_deliveries',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('event_id', sa.String(length=64), nullable=False),
    sa.Column('endpoint_id', sa.String(length=64), nullable=False),
    sa.Column('status', sa.Enum('pending', 'succeeded', 'failed', name='delivery_status'), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['endpoint_id'], ['webhook_endpoints.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['event_id'], ['webhook_events.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('event_id', 'endpoint_id', name='uq_webhook_deliveries_event_endpoint')
    )
    op.create_index(op.f('ix_webhook_deliveries_endpoint_id'), 'webhook_deliveries', ['endpoint_id'], unique=False)
    op.create_index('ix_webhook_deliveries_next_attempt_at', 'webhook_deliveries', ['next_attempt_at'], unique=False)
    op.create_table('webhook_attempts',
    sa.Column('id', sa.BigInteger(), autoincrement=True, nullable=False),
    sa.Column('delivery_id', sa.String(length=64), nullable=False),
    sa.Column('number', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('latency_ms', sa.Float(), nullable=False),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('succeeded', sa.Boolean(), nullable=False),
    sa.ForeignKeyConstraint(['delivery_id'], ['webhook_deliveries.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('delivery_id', 'number', name='uq_webhook_attempts_delivery_number')
    )
    op.add_column('batches', sa.Column('priority', sa.Integer(), server_default='0', nullable=False))
    op.add_column('batches', sa.Column('webhook_endpoint_id', sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column('batches', 'webhook_endpoint_id')
    op.drop_column('batches', 'priority')
    op.drop_table('webhook_attempts')
    op.drop_index('ix_webhook_deliveries_next_attempt_at', table_name='webhook_deliveries')
    op.drop_index(op.f('ix_webhook_deliveries_endpoint_id'), table_name='webhook_deliveries')
    op.drop_table('webhook_deliveries')
    op.drop_table('schedule_fires')
    op.drop_index(op.f('ix_webhook_events_project_id'), table_name='webhook_events')
    op.drop_table('webhook_events')
    op.drop_index(op.f('ix_webhook_endpoints_project_id'), table_name='webhook_endpoints')
    op.drop_table('webhook_endpoints')
    op.drop_index('ix_schedules_next_fire_at', table_name='schedules')
    op.drop_index('ix_schedules_project_created', table_name='schedules')
    op.drop_table('schedules')
    sa.Enum(name="delivery_status").drop(op.get_bind(), checkfirst=True)
