"""Idempotent creation, Stripe's `Idempotency-Key` convention, for POST /v1/batches and POST /v1/files.

A client that sends a key with a create request and retries it (a timeout, a 503, a dropped connection) gets the
answer of the first request that succeeded with that key, never a second object. Keys belong to a project: two
projects never see each other's. A key reused with different parameters (another route, another body, another
file) answers 409 `idempotency_key_reused`, as Stripe does ("the request conflicts with another request, perhaps
due to using the same idempotent key"). A first request that failed (an invalid body, a 503) stored nothing, so its retry runs
afresh. Keys are kept for `KEY_LIFETIME` (Stripe's 24 hours); past it a key is new again.

The key and the answer are written in the transaction that creates the object: both commit or neither does. Two
concurrent requests with one key both run, and the second's commit fails on the key's primary key; it then
answers the first's result (`replay_after_conflict`) and what it created is rolled back with it.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, select
from sqlalchemy.orm import Session

from jobs.errors import ServiceError
from jobs.models import IdempotentRequest, utcnow

HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255  # Stripe's limit
KEY_PATTERN = r"^[!-~]([ -~]*[!-~])?$"  # printable ASCII; HTTP strips a header value's outer spaces
KEY_LIFETIME = timedelta(hours=24)


def fingerprint(route: str, parameters: dict[str, Any]) -> str:
    """What makes two requests the same request: the route and its parameters, canonically serialised."""
    canonical = json.dumps({"route": route, "parameters": parameters}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _live(project_id: str, key: str) -> ColumnElement[bool]:
    return and_(
        IdempotentRequest.project_id == project_id,
        IdempotentRequest.key == key,
        IdempotentRequest.created_at > utcnow() - KEY_LIFETIME,
    )


def key_exists(session: Session, project_id: str, key: str) -> bool:
    return session.scalar(select(IdempotentRequest.key).where(_live(project_id, key))) is not None


def replay(session: Session, project_id: str, key: str, request_fingerprint: str) -> dict[str, Any] | None:
    """The first answer given to this key, or None if the key is new (or expired)."""
    row = session.scalar(select(IdempotentRequest).where(_live(project_id, key)))
    if row is None:
        return None
    if row.fingerprint != request_fingerprint:
        raise ServiceError(
            "conflict",
            f"{HEADER} {key!r} was used with different parameters; a retry must repeat the first request exactly, "
            "and a new request needs a new key",
            param=HEADER,
            code="idempotency_key_reused",
        )
    return row.response


def remember(session: Session, project_id: str, key: str, request_fingerprint: str, response: dict[str, Any]) -> None:
    """Record the answer in the caller's transaction; its commit fails (IntegrityError) if a concurrent request with
    the same key committed first. An expired row for the key is replaced."""
    session.execute(
        delete(IdempotentRequest).where(
            IdempotentRequest.project_id == project_id,
            IdempotentRequest.key == key,
            IdempotentRequest.created_at <= utcnow() - KEY_LIFETIME,
        )
    )
    session.add(IdempotentRequest(project_id=project_id, key=key, fingerprint=request_fingerprint, response=response))
    session.flush()


def forget_expired(session: Session, now: datetime | None = None) -> int:
    """Delete keys past their lifetime (the recovery sweep calls it); returns how many."""
    cutoff = (now or utcnow()) - KEY_LIFETIME
    return session.execute(delete(IdempotentRequest).where(IdempotentRequest.created_at <= cutoff)).rowcount
