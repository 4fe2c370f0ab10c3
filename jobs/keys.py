"""API keys: `sk-conveyor-…` secrets, stored only as their SHA-256, each belonging to one project."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs import db
from jobs.models import ApiKey, Project

KEY_PREFIX = "sk-conveyor-"


def hash_key(secret: str) -> str:
    # A plain hash suffices (no salt or slow KDF): the secret is 256 random bits, not a guessable password.
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class CreatedKey:
    project_id: str
    project_name: str
    key_id: str
    secret: str  # shown once; only its hash is kept


def create_key(session: Session, project_name: str) -> CreatedKey:
    """A new key for the named project, creating the project on first use."""
    project = session.scalar(select(Project).where(Project.name == project_name))
    if project is None:
        project = Project(name=project_name)
        session.add(project)
        session.flush()
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(project_id=project.id, key_hash=hash_key(secret), key_hint=secret[: len(KEY_PREFIX) + 4])
    session.add(key)
    session.flush()
    return CreatedKey(project_id=project.id, project_name=project.name, key_id=key.id, secret=secret)


def create_key_in_database(database_url: str, project_name: str) -> CreatedKey:
    """`create_key` in its own short-lived connection: for the CLI, tests and benchmarks."""
    engine = db.make_engine(database_url, pool_size=1)
    try:
        with db.make_session_factory(engine).begin() as session:
            return create_key(session, project_name)
    finally:
        engine.dispose()


def project_for_key_hash(session: Session, key_hash: str) -> str | None:
    """The project id of the key with this hash; None for an unknown or revoked key."""
    return session.scalar(
        select(ApiKey.project_id).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
    )
