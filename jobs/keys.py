"""API keys: `sk-conveyor-…` secrets, stored only as their SHA-256, each belonging to one project.

A revoked key is refused at once by every API process: the revocation's transaction sends a PostgreSQL
notification (`REVOKED_CHANNEL`, payload the key's hash) that the processes' key caches listen to (`api.auth`)."""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg import sql

from sqlalchemy import func, make_url, select, update
from sqlalchemy.orm import Session

from jobs import db
from jobs.models import ApiKey, Project, utcnow

KEY_PREFIX = "sk-conveyor-"
REVOKED_CHANNEL = "conveyor_api_key_revoked"
LISTEN_RETRY_SECONDS = 5.0  # after the listening connection is lost (PostgreSQL restarting)
LISTEN_POLL_SECONDS = 0.25  # how often the listening thread looks whether it should stop

log = logging.getLogger(__name__)


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


def revoke_key(session: Session, key_id: str) -> bool:
    """Revoke the key (the id `create_key` printed); False if no such key is live. The notification goes out when
    the transaction commits, and only if it does."""
    key_hash = session.scalar(
        update(ApiKey)
        .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=utcnow())
        .returning(ApiKey.key_hash)
    )
    if key_hash is None:
        return False
    session.execute(select(func.pg_notify(REVOKED_CHANNEL, key_hash)))
    return True


def project_for_key_hash(session: Session, key_hash: str) -> str | None:
    """The project id of the key with this hash; None for an unknown or revoked key."""
    return session.scalar(
        select(ApiKey.project_id).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
    )


class RevocationListener:
    """A thread on a PostgreSQL connection of its own that LISTENs on `REVOKED_CHANNEL`: `revoked(key_hash)` for
    each key revoked anywhere, `listening(True)` once it listens, `listening(False)` when the connection is lost
    (notifications sent meanwhile are missed, so a cache must then stop trusting itself); it reconnects every
    `LISTEN_RETRY_SECONDS`."""

    def __init__(
        self, database_url: str, revoked: Callable[[str], None], listening: Callable[[bool], None]
    ) -> None:
        self._conninfo = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
        self._revoked = revoked
        self._listening = listening
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="key-revocations", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True, connect_timeout=5) as connection:
                    connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(REVOKED_CHANNEL)))
                    self._listening(True)
                    try:
                        while not self._stopping.is_set():
                            for notification in connection.notifies(timeout=LISTEN_POLL_SECONDS):
                                self._revoked(notification.payload)
                    finally:
                        self._listening(False)
            except psycopg.Error as error:
                log.warning("not listening for revoked API keys (%s); retrying in %g s", error, LISTEN_RETRY_SECONDS)
            self._stopping.wait(LISTEN_RETRY_SECONDS)
