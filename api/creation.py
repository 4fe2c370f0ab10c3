"""What the create routes share: the `Idempotency-Key` header (`jobs.idempotency`) and the start of a new batch's
work, which survives Redis being down.

A batch is committed first and its validate task queued after. When Redis is unreachable the batch stays
recorded, marked for the recovery sweep (which queues its validate once Redis is back), and the client gets a
503 that says so; its retry with the same Idempotency-Key answers that batch instead of creating another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import Header
from kombu.exceptions import OperationalError as QueueUnreachable
from pydantic import BaseModel
from redis.exceptions import RedisError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from jobs import batches, enqueue, idempotency
from jobs.db import SessionFactory
from jobs.errors import ServiceError

AnswerT = TypeVar("AnswerT", bound=BaseModel)

IdempotencyKeyHeader = Annotated[
    str | None,
    Header(
        alias=idempotency.HEADER,
        max_length=idempotency.MAX_KEY_CHARS,
        pattern=idempotency.KEY_PATTERN,
        description="A retry with the same key (within 24 hours) returns the first answer instead of creating again.",
    ),
]


def create_once(
    sessions: SessionFactory,
    project_id: str,
    key: str | None,
    route: str,
    parameters: dict[str, Any],
    answer_type: type[AnswerT],
    create: Callable[[Session], AnswerT],
) -> tuple[AnswerT, bool]:
    """Run `create` in a transaction and return its answer and True; with a key already used for this request,
    return the first answer and False instead (409 if the key was used for a different request)."""
    if key is None:
        with sessions.begin() as session:
            return create(session), True
    fingerprint = idempotency.fingerprint(route, parameters)
    try:
        with sessions.begin() as session:
            stored = idempotency.replay(session, project_id, key, fingerprint)
            if stored is not None:
                return answer_type.model_validate(stored), False
            answer = create(session)
            idempotency.remember(session, project_id, key, fingerprint, answer.model_dump(mode="json"))
            return answer, True
    except IntegrityError:  # a concurrent request with this key committed first; ours was rolled back
        with sessions() as session:
            stored = idempotency.replay(session, project_id, key, fingerprint)
        if stored is None:
            raise
        return answer_type.model_validate(stored), False


def start_validation(sessions: SessionFactory, batch_id: str) -> None:
    """Queue the new batch's validate task; when Redis is unreachable, leave it to the recovery sweep and answer 503."""
    try:
        enqueue.validate(batch_id)
    except (QueueUnreachable, RedisError) as unreachable:
        with sessions.begin() as session:
            batches.mark_validate_unsent(session, batch_id)
        raise ServiceError(
            "unavailable",
            f"{batch_id} was created, but the task queue (Redis) is unreachable ({unreachable}); it starts once the "
            f"queue is back. A retry with the same {idempotency.HEADER} returns it.",
            code="queue_unavailable",
        ) from None
