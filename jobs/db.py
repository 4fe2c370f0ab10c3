"""Database engine, sessions and migrations."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine
from sqlalchemy.orm import Session, sessionmaker

import migrations

SessionFactory = sessionmaker[Session]


def make_engine(database_url: str, pool_size: int = 10, pre_ping: bool = True) -> Engine:
    """pre_ping: test each pooled connection before use (one round trip), so a process that outlives a
    Postgres restart gets a fresh connection instead of an error. Without it, the first use of a dead
    connection fails and the whole pool is replaced."""
    return create_engine(database_url, pool_size=pool_size, max_overflow=2 * pool_size, pool_pre_ping=pre_ping)


def autocommit(engine: Engine) -> Engine:
    """The engine (same pool) with every statement committing on its own, so a read costs one round trip, not
    BEGIN, SELECT and ROLLBACK; for work whose statements need no common snapshot or locks."""
    return engine.execution_options(isolation_level="AUTOCOMMIT")


def make_session_factory(engine: Engine, read_only: bool = False) -> SessionFactory:
    """read_only: sessions over `autocommit(engine)`."""
    bind = autocommit(engine) if read_only else engine
    # expire_on_commit=False: rows read in a transaction stay readable after it, e.g. to build a response.
    return sessionmaker(bind, expire_on_commit=False)


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)
