"""Firing due schedules: beat's sweep, exactly once per schedule and fire time.

The sweep lists the due, unpaused schedules, then fires each in its own transaction: it locks the schedule's row
(`FOR UPDATE SKIP LOCKED`, so a second sweep skips it instead of waiting), inserts the `schedule_fires` row whose
primary key (schedule, fire time) refuses a second fire of the same time, creates the batch (or RAG job) in a
savepoint and moves `next_fire_at` to the first cron time after now (a late schedule fires once, not once per
missed time); validate is enqueued after the commit. A fire that cannot make its batch records the error on its
`schedule_fires` row and the schedule still advances; a failure of S3 or the database leaves it due.
"""

from __future__ import annotations


import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from jobs.batches import (
    RAG_ENDPOINT,
    create_batch,
)
from jobs.db import SessionFactory
from jobs.errors import ServiceError
from jobs.files import derived_file_id, record_file
from jobs.models import Batch, File, FilePurpose, Schedule, ScheduleFire, utcnow
from jobs.object_keys import NEWLINE_KEY, file_key, inbox_key
from jobs.rag.jobs import add_rag_job, prepare_rag_job
from jobs.served_models import ServedModel
from jobs.storage import ObjectNotFound, ObjectStore
from jobs.schedules.cron import next_fire_time
from jobs.schedules.definitions import rag_job_spec

log = logging.getLogger(__name__)

RUN_ID_PREFIX = "run_"


@dataclass(frozen=True)
class ScheduleSpec:
    """What a client asks for: when, and the batch (or RAG job) to create each time."""

    cron: str
    timezone: str
    endpoint: str
    completion_window: str
    input_file_id: str | None
    input_prefix: str | None
    metadata: dict[str, str] | None
    priority: int
    webhook_endpoint_id: str | None
    rag_options: dict[str, Any] | None = None  # the RagOptions fields the client set; only for RAG_ENDPOINT


@dataclass(frozen=True)
class Fire:
    """One fire time of one schedule, as a sweep handled it."""

    schedule_id: str
    fire_time: datetime
    batch_id: str | None  # or the RAG job's id
    error: str | None


def fire_due_schedules(
    sessions: SessionFactory,
    store: ObjectStore,
    enqueue_validate: Callable[[str], None],
    *,
    embedding_model: str,
    served_models: Callable[[], list[ServedModel]],
    window_seconds: float | None = None,
    now: datetime | None = None,
) -> list[Fire]:
    """Fire every unpaused schedule due at `now`, each in its own transaction; return what this call fired.
    embedding_model: the service's (Settings.embedding_model), which RAG templates are checked against again.
    served_models: the deployment's models now (`ModelRegistry.served`), read when a RAG job reading pages is made:
    it is bound to a model that reads images, as POST /v1/rag/jobs binds it, or its fire records why none can.
    window_seconds: the batches' deadline, as `create_batch` takes it (Settings.completion_window_seconds)."""
    now = now or utcnow()
    with sessions() as session:
        due = session.scalars(
            select(Schedule.id)
            .where(Schedule.paused.is_(False), Schedule.next_fire_at <= now)
            .order_by(Schedule.next_fire_at)
        ).all()
    fires: list[Fire] = []
    for schedule_id in due:
        try:
            fire = _fire(sessions, store, schedule_id, now, embedding_model, served_models, window_seconds)
        except Exception:  # one schedule's trouble (S3 down, say) must not hold back the others
            log.exception("schedule %s: firing failed; it stays due and the next sweep tries again", schedule_id)
            continue
        if fire is None:
            continue
        fires.append(fire)
        if fire.batch_id is not None:
            enqueue_validate(fire.batch_id)
    return fires


def _fire(
    sessions: SessionFactory,
    store: ObjectStore,
    schedule_id: str,
    now: datetime,
    embedding_model: str,
    served_models: Callable[[], list[ServedModel]],
    window_seconds: float | None,
) -> Fire | None:
    """Fire one schedule if it is still due and no other sweep holds or has fired it; None otherwise."""
    with sessions.begin() as session:
        schedule = session.scalar(
            select(Schedule)
            .where(Schedule.id == schedule_id, Schedule.paused.is_(False), Schedule.next_fire_at <= now)
            .with_for_update(skip_locked=True)
        )
        if schedule is None:
            return None
        fire_time = schedule.next_fire_at.astimezone(timezone.utc)
        schedule.next_fire_at = next_fire_time(schedule.cron, schedule.timezone, now)
        claimed = session.scalar(
            insert(ScheduleFire)
            .values(schedule_id=schedule_id, fire_time=fire_time, created_at=now)
            .on_conflict_do_nothing(index_elements=[ScheduleFire.schedule_id, ScheduleFire.fire_time])
            .returning(ScheduleFire.schedule_id)
        )
        if claimed is None:  # this time fired already (a sweep before a restore of next_fire_at): only advance
            return None
        batch_id: str | None = None
        error: str | None = None
        try:
            with session.begin_nested():
                if schedule.endpoint == RAG_ENDPOINT:
                    created = _create_rag_job(session, store, schedule, embedding_model, served_models, window_seconds)
                else:
                    created = _create_batch(session, store, schedule, fire_time, window_seconds)
                created.webhook_endpoint_id = schedule.webhook_endpoint_id
                session.flush()
                batch_id = created.id
        except ServiceError as failure:
            error = failure.message
        except ObjectNotFound as gone:
            error = f"an input object disappeared while it was read: {gone.key}"
        session.execute(
            update(ScheduleFire)
            .where(ScheduleFire.schedule_id == schedule_id, ScheduleFire.fire_time == fire_time)
            .values(batch_id=batch_id, error=error)
        )
    log.info("schedule %s fired for %s: %s", schedule_id, fire_time.isoformat(), batch_id or error)
    return Fire(schedule_id=schedule_id, fire_time=fire_time, batch_id=batch_id, error=error)


def _create_batch(
    session: Session, store: ObjectStore, schedule: Schedule, fire_time: datetime, window_seconds: float | None
) -> Batch:
    input_file_id = schedule.input_file_id
    if input_file_id is None:
        assert schedule.input_prefix is not None  # a schedule has one of the two
        input_file_id = _compose_inbox_input(session, store, schedule, fire_time).id
    return create_batch(
        session,
        schedule.project_id,
        input_file_id=input_file_id,
        endpoint=schedule.endpoint,
        completion_window=schedule.completion_window,
        metadata=schedule.batch_metadata,
        priority=schedule.priority,
        window_seconds=window_seconds,
    )


def _create_rag_job(
    session: Session,
    store: ObjectStore,
    schedule: Schedule,
    embedding_model: str,
    served_models: Callable[[], list[ServedModel]],
    window_seconds: float | None,
) -> Batch:
    """The RAG job POST /v1/rag/jobs would create from the template, checked again: the service's embedding model
    and the models served may have changed since the schedule was created."""
    spec = rag_job_spec(schedule)
    prepared = prepare_rag_job(store, store.settings, schedule.project_id, spec, embedding_model, served_models)
    return add_rag_job(session, schedule.project_id, spec, prepared, window_seconds)


def _compose_inbox_input(session: Session, store: ObjectStore, schedule: Schedule, fire_time: datetime) -> File:
    """Every non-empty object under the schedule's inbox prefix, in key order, as one new input file."""
    assert schedule.input_prefix is not None
    listed = store.list_objects(inbox_key(schedule.project_id, schedule.input_prefix))
    objects = [found for found in listed if found.size > 0]
    if not objects:
        raise ServiceError("invalid_request", f"no objects under the inbox prefix {schedule.input_prefix!r}")
    sources: list[str] = []
    for found in objects:
        sources.append(found.key)
        if store.read_range(found.key, found.size - 1, found.size) != b"\n":
            sources.append(NEWLINE_KEY)
    if NEWLINE_KEY in sources:
        store.put_bytes(NEWLINE_KEY, b"\n")
    # Derived from the fire: a fire retried after a rollback rewrites the same object instead of leaving a twin.
    file_id = derived_file_id(schedule.id, f"fire/{fire_time.isoformat()}")
    object_key = file_key(schedule.project_id, file_id)
    size = store.compose(object_key, sources)
    return record_file(
        session,
        file_id=file_id,
        project_id=schedule.project_id,
        filename=f"{schedule.id}-{fire_time.strftime('%Y%m%dT%H%M%SZ')}.jsonl",
        purpose=FilePurpose.batch,
        size=size,
        object_key=object_key,
    )
