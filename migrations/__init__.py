"""Alembic migrations of the service's PostgreSQL schema (`conveyor db upgrade`)."""
