"""Alembic migrations against a real, empty PostgreSQL database: up, down, and up again."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from jobs import db
from jobs.models import Base

TABLES = {
    "projects", "api_keys", "files", "batches", "chunks",
    "webhook_endpoints", "webhook_events", "webhook_deliveries", "webhook_attempts", "schedules", "schedule_fires",
    "idempotent_requests",
}


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _enum_types(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return set(connection.scalars(text("select typname from pg_type where typtype = 'e'")))
    finally:
        engine.dispose()


def test_upgrade_creates_the_schema_the_models_describe(empty_database_url: str) -> None:
    db.upgrade(empty_database_url)
    assert _tables(empty_database_url) == TABLES
    engine = create_engine(empty_database_url)
    try:
        with engine.connect() as connection:
            differences = compare_metadata(
                MigrationContext.configure(connection, opts={"compare_type": True}), Base.metadata
            )
    finally:
        engine.dispose()
    assert differences == [], "models and migrations disagree; write a migration"


def test_downgrade_removes_everything_and_upgrade_works_again(empty_database_url: str) -> None:
    db.upgrade(empty_database_url)
    db.downgrade(empty_database_url, "base")
    assert _tables(empty_database_url) == set()
    assert _enum_types(empty_database_url) == set()
    db.upgrade(empty_database_url)
    assert _tables(empty_database_url) == TABLES
