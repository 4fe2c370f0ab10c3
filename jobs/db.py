"""Database engine, sessions and migrations."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker

import migrations

SessionFactory = sessionmaker[Session]


def make_engine(database_url: str, pool_size: int = 10) -> Engine:
    # pre_ping: a worker outlives Postgres restarts; a dead pooled connection is replaced, not raised.
    return create_engine(database_url, pool_size=pool_size, max_overflow=2 * pool_size, pool_pre_ping=True)


def make_session_factory(engine: Engine) -> SessionFactory:
    # expire_on_commit=False: rows read in a transaction stay readable after it, e.g. to build a response.
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)
