"""Alembic's entry point: runs migrations online against the URL `jobs.db.alembic_config` set."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from jobs.models import Base

target_metadata = Base.metadata


def run_migrations_online() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    assert url is not None, "jobs.db.alembic_config sets sqlalchemy.url"
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata, compare_type=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; run `conveyor db upgrade`")
run_migrations_online()
