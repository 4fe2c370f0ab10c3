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

import logging
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Row, select
from sqlalchemy.orm import Session

from jobs.batches import (
    RAG_ENDPOINT,
    check_batch_options,
    check_input_file,
    check_one_input,
    check_priority,
)
from jobs.errors import ServiceError
from jobs.models import Schedule, ScheduleFire, utcnow
from jobs.object_keys import inbox_key
from jobs.pagination import MAX_PAGE_SIZE, Page, paginate
from jobs.schedules.cron import check_time_zone, next_fire_time, normalized_cron
from jobs.rag.jobs import RagJobSpec, check_rag_job
from jobs.rag.processing import RagOptions
from jobs.settings import S3Settings
from jobs.webhooks.endpoints import get_endpoint

log = logging.getLogger(__name__)

RUN_ID_PREFIX = "run_"


class ScheduleTemplate(BaseModel):
    """A schedule as a client writes it: when, and the batch (or RAG job) to create each time. One list of fields:
    the API's request body and response object (`api.schemas.CreateSchedule`, `ScheduleObject`) derive from it, and
    so does the spec a schedule is created from."""

    cron: str = Field(description="five cron fields (minute hour day-of-month month day-of-week), e.g. '0 2 * * *'")
    timezone: str = Field(default="UTC", description="IANA time zone the cron fields are read in")
    endpoint: str = Field(description="a batch endpoint, or '/v1/rag/jobs' for a RAG job with rag_options")
    completion_window: str
    input_file_id: str | None = Field(default=None, description="an uploaded file; or give input_prefix")
    input_prefix: str | None = Field(
        default=None, description="every object under this prefix of the project's inbox, concatenated at each fire"
    )
    metadata: dict[str, str] | None = None
    priority: int = Field(default=0, description="the batches' engine priority: lower runs first")
    webhook_endpoint_id: str | None = None


class ScheduleSpec(ScheduleTemplate):
    """What a schedule is created from."""

    model_config = ConfigDict(frozen=True)

    rag_options: dict[str, Any] | None = None  # the RagOptions fields the client set; only for RAG_ENDPOINT


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
        return check_rag_job(rag_job_spec(schedule), embedding_model)
    except ServiceError as invalid:
        if invalid.param is None or not invalid.param.startswith("options"):
            raise
        # A RAG job's `options` are the schedule's `rag_options`: the client must find the field it sent.
        raise ServiceError(invalid.kind, invalid.message, param=f"rag_{invalid.param}") from None


def rag_job_spec(schedule: Schedule) -> RagJobSpec:
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


def list_schedules(session: Session, project_id: str, *, after: str | None, limit: int) -> Page[Row[Any]]:
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
