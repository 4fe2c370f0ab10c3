"""Recurring batches and RAG jobs: a cron expression in a time zone, and a template fired at each time it names.

A template with endpoint `/v1/rag/jobs` makes a RAG job (with the schedule's `rag_options`) as `POST /v1/rag/jobs`
would, an inbox prefix listed at each fire; any other endpoint makes a batch.

Cron times are wall-clock times in the schedule's zone: "0 2 * * *" in Europe/Paris fires at 02:00 Paris time in
winter and in summer. On the spring-forward day a time the clock skips (02:30) fires when the clock jumps (03:30,
as cron does); on the fall-back day a repeated time fires once, at its first occurrence.

Firing (`fire_due_schedules`, run by beat's sweep) is exactly once per fire time, whatever the number of beats or
sweeps running at once: the sweep locks the schedule's row (`FOR UPDATE SKIP LOCKED`, so a second sweep skips it
instead of waiting), and inserts the `schedule_fires` row whose primary key (schedule, fire time) refuses a second
fire of the same time; the batch (or RAG job), that row and the advanced `next_fire_at` commit together.

Catch-up policy: a schedule found late (beat was down, or the worker busy) fires once, stamped with the time that
was due, and `next_fire_at` moves to the first cron time after now: a beat down for a day fires a daily schedule
once and an hourly one once, not 24 times. A fire that cannot make its batch or job (the input file was deleted,
the inbox prefix is empty) records the error on its `schedule_fires` row and the schedule still advances; a failure
of the services themselves (S3 or the database down) leaves the schedule due, and the next sweep tries again.

Inputs come from one file, or from every object under a prefix of the project's inbox (`inbox/<project id>/` in
the bucket, under the configured S3 prefix): at each fire they are concatenated in key order into a new input
file. The prefix is always relative to the caller's own inbox, so no schedule can read another project's objects.
"""

from __future__ import annotations

import functools
import logging
import zoneinfo
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from croniter import CroniterError, croniter
from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from jobs.batches import (
    RAG_ENDPOINT,
    check_batch_options,
    check_input_file,
    check_one_input,
    check_priority,
    create_batch,
)
from jobs.db import SessionFactory
from jobs.errors import ServiceError
from jobs.files import record_file
from jobs.models import Batch, File, FilePurpose, Schedule, ScheduleFire, utcnow
from jobs.object_keys import NEWLINE_KEY, file_key, inbox_key
from jobs.pagination import MAX_PAGE_SIZE, Page, paginate
from jobs.pipeline import derived_file_id
from jobs.rag.jobs import RagJobSpec, add_rag_job, check_rag_job, prepare_rag_job
from jobs.rag.processing import RagOptions
from jobs.settings import S3Settings
from jobs.storage import ObjectNotFound, ObjectStore
from jobs.webhooks import get_endpoint

log = logging.getLogger(__name__)

CRON_FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")
MAX_CRON_CHARS = 128  # the column's width
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


# ---------------------------------------------------------------------------------------------------------
# time


def normalized_cron(expression: str) -> str:
    """The expression with single spaces; raises a client error unless it is five valid cron fields."""
    fields = expression.split()
    if len(fields) != len(CRON_FIELDS) or len(expression) > MAX_CRON_CHARS:
        raise ServiceError(
            "invalid_request",
            f"cron must be five fields ({' '.join(CRON_FIELDS)}), e.g. '0 2 * * *'; "
            f"got {expression[:MAX_CRON_CHARS]!r}",
            param="cron",
        )
    normalized = " ".join(fields)
    try:
        croniter(normalized)
    except CroniterError as invalid:
        message = f"invalid cron expression {normalized!r}: {invalid}"
        raise ServiceError("invalid_request", message, param="cron") from None
    return normalized


@functools.cache
def _time_zone_names() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones())


def check_time_zone(name: str) -> None:
    if name not in _time_zone_names():
        raise ServiceError(
            "invalid_request",
            f"timezone must be an IANA time zone name such as 'UTC' or 'Europe/Paris', got {name[:80]!r}",
            param="timezone",
        )


def next_fire_time(cron: str, time_zone: str, after: datetime) -> datetime:
    """The first time strictly after `after` (aware) that `cron` names on the wall clock of `time_zone`, in UTC."""
    zone = zoneinfo.ZoneInfo(time_zone)
    # croniter walks naive wall-clock times; zoneinfo then places each on the time line (fold=0: the first of a
    # repeated time, and for a skipped one the offset before the jump, which lands just after it).
    wall_clock = croniter(cron, after.astimezone(zone).replace(tzinfo=None))
    while True:
        try:
            candidate = wall_clock.get_next(datetime).replace(tzinfo=zone).astimezone(timezone.utc)
        except CroniterError:
            raise ServiceError("invalid_request", f"cron {cron!r} never fires", param="cron") from None
        # During a repeated hour, wall-clock times of its first pass already lie behind `after`.
        if candidate > after:
            return candidate


# ---------------------------------------------------------------------------------------------------------
# the API's operations


def create_schedule(
    session: Session, project_id: str, spec: ScheduleSpec, *, embedding_model: str, now: datetime | None = None
) -> Schedule:
    """embedding_model: the service's (Settings.embedding_model), the only one a RAG template may name."""
    cron = normalized_cron(spec.cron)
    check_time_zone(spec.timezone)
    now = now or utcnow()
    schedule = Schedule(
        project_id=project_id,
        cron=cron,
        timezone=spec.timezone,
        endpoint=spec.endpoint,
        completion_window=spec.completion_window,
        input_file_id=spec.input_file_id,
        input_prefix=spec.input_prefix,
        batch_metadata=spec.metadata,
        priority=spec.priority,
        webhook_endpoint_id=spec.webhook_endpoint_id,
        rag_options=spec.rag_options,
        paused=False,
        next_fire_at=next_fire_time(cron, spec.timezone, now),
        created_at=now,
    )
    if schedule.endpoint == RAG_ENDPOINT:
        # Stored with every default filled in, as a RAG job shows them: each fire runs the same settings.
        schedule.rag_options = _check_rag_template(schedule, embedding_model).to_json()
    else:
        _check_batch_template(schedule)
    if schedule.input_file_id is not None:
        check_input_file(session, project_id, schedule.input_file_id)
    if schedule.webhook_endpoint_id is not None:
        _check_webhook_endpoint(session, project_id, schedule.webhook_endpoint_id)
    session.add(schedule)
    session.flush()
    return schedule


def _check_batch_template(schedule: Schedule) -> None:
    check_batch_options(
        endpoint=schedule.endpoint, completion_window=schedule.completion_window, metadata=schedule.batch_metadata
    )
    check_priority(schedule.priority)
    check_one_input(schedule.input_file_id, schedule.input_prefix)
    if schedule.rag_options is not None:
        raise ServiceError(
            "invalid_request", f"rag_options needs endpoint {RAG_ENDPOINT!r}, got {schedule.endpoint!r}",
            param="rag_options",
        )


def _check_rag_template(schedule: Schedule, embedding_model: str) -> RagOptions:
    """POST /v1/rag/jobs's checks of all but the input file (create_schedule checks that for any template)."""
    try:
        return check_rag_job(_rag_job_spec(schedule), embedding_model)
    except ServiceError as invalid:
        if invalid.param is None or not invalid.param.startswith("options"):
            raise
        # A RAG job's `options` are the schedule's `rag_options`: the client must find the field it sent.
        raise ServiceError(invalid.kind, invalid.message, param=f"rag_{invalid.param}") from None


def _rag_job_spec(schedule: Schedule) -> RagJobSpec:
    """The RAG job a schedule's template describes, as POST /v1/rag/jobs would read it from a request."""
    return RagJobSpec(
        input_file_id=schedule.input_file_id,
        input_prefix=schedule.input_prefix,
        options=schedule.rag_options or {},
        metadata=schedule.batch_metadata,
        completion_window=schedule.completion_window,
        priority=schedule.priority,
    )


def inbox_uri(s3: S3Settings, project_id: str, input_prefix: str) -> str:
    """Where the project's tools put the objects a prefix schedule reads."""
    return f"s3://{s3.bucket}/{s3.prefix}{inbox_key(project_id, input_prefix)}"


def _check_webhook_endpoint(session: Session, project_id: str, endpoint_id: str) -> None:
    try:
        get_endpoint(session, project_id, endpoint_id)
    except ServiceError as missing:  # named as the schedule's field, for the client
        raise ServiceError(missing.kind, missing.message, param="webhook_endpoint_id") from None


def get_schedule(session: Session, project_id: str, schedule_id: str, *, for_update: bool = False) -> Schedule:
    query = select(Schedule).where(Schedule.id == schedule_id, Schedule.project_id == project_id)
    schedule = session.scalar(query.with_for_update() if for_update else query)
    if schedule is None:
        raise ServiceError("not_found", f"No such Schedule object: {schedule_id}", param="schedule_id")
    return schedule


def list_schedules(session: Session, project_id: str, *, after: str | None, limit: int) -> Page[Schedule]:
    return paginate(session, Schedule, project_id, after=after, limit=limit)


def set_paused(
    session: Session, project_id: str, schedule_id: str, paused: bool, *, now: datetime | None = None
) -> Schedule:
    """Pause or resume. Resuming starts from now: the times missed while paused do not fire."""
    schedule = get_schedule(session, project_id, schedule_id, for_update=True)
    if schedule.paused and not paused:
        schedule.next_fire_at = next_fire_time(schedule.cron, schedule.timezone, now or utcnow())
    schedule.paused = paused
    session.flush()
    return schedule


def delete_schedule(session: Session, project_id: str, schedule_id: str) -> None:
    """The schedule and its fire records go; the batches it created stay."""
    session.delete(get_schedule(session, project_id, schedule_id))
    session.flush()


def run_id(fire_time: datetime) -> str:
    return f"{RUN_ID_PREFIX}{int(fire_time.timestamp())}"


def list_runs(
    session: Session, project_id: str, schedule_id: str, *, after: str | None, limit: int
) -> Page[ScheduleFire]:
    """The schedule's fires, newest first; `after` is the id of the last run of the previous page."""
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ServiceError("invalid_request", f"limit must be between 1 and {MAX_PAGE_SIZE}", param="limit")
    get_schedule(session, project_id, schedule_id)
    query = select(ScheduleFire).where(ScheduleFire.schedule_id == schedule_id)
    if after is not None:
        query = query.where(ScheduleFire.fire_time < _fire_time_of_run(after))
    rows = list(session.scalars(query.order_by(ScheduleFire.fire_time.desc()).limit(limit + 1)))
    return Page(rows=rows[:limit], has_more=len(rows) > limit)


def _fire_time_of_run(run: str) -> datetime:
    seconds = run.removeprefix(RUN_ID_PREFIX)
    if not run.startswith(RUN_ID_PREFIX) or not seconds.isdigit():
        raise ServiceError("invalid_request", f"no such run to page after: {run!r}", param="after")
    return datetime.fromtimestamp(int(seconds), timezone.utc)


# ---------------------------------------------------------------------------------------------------------
# firing


def fire_due_schedules(
    sessions: SessionFactory,
    store: ObjectStore,
    enqueue_validate: Callable[[str], None],
    *,
    embedding_model: str,
    window_seconds: float | None = None,
    now: datetime | None = None,
) -> list[Fire]:
    """Fire every unpaused schedule due at `now`, each in its own transaction; return what this call fired.
    embedding_model: the service's (Settings.embedding_model), which RAG templates are checked against again.
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
            fire = _fire(sessions, store, schedule_id, now, embedding_model, window_seconds)
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
                    created = _create_rag_job(session, store, schedule, embedding_model, window_seconds)
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
    session: Session, store: ObjectStore, schedule: Schedule, embedding_model: str, window_seconds: float | None
) -> Batch:
    """The RAG job POST /v1/rag/jobs would create from the template, checked again: the service's embedding model
    may have changed since the schedule was created."""
    spec = _rag_job_spec(schedule)
    prepared = prepare_rag_job(store, store.settings, schedule.project_id, spec, embedding_model)
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
