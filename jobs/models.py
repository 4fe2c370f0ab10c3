"""The service's records in PostgreSQL (SQLAlchemy 2.0). Payloads live in S3; these rows point at them.

Every object a client can see belongs to one project (tenant); queries always filter by it, so another
project's ids simply do not exist for a caller.
"""

from __future__ import annotations

import enum
import functools
import secrets
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import BigInteger, Boolean, DateTime, Enum, Float, ForeignKey, Index, Integer, Label, String, Text, UniqueConstraint, func
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class Base(DeclarativeBase):
    pass


@functools.cache
def plain_columns(model: type[Base]) -> tuple[Label[Any], ...]:
    """Every column of `model`, labelled with its attribute's name: a Core row selected with these reads like the
    ORM object (`row.batch_metadata`, `row.status` as the enum) without the ORM building, identifying and tracking
    one, which costs more than the query itself on the API's hot read path (`GET /v1/batches/{id}`, listings)."""
    return tuple(getattr(model, attribute.key).label(attribute.key) for attribute in model.__mapper__.column_attrs)


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("proj_"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("key_"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(
        String(64), unique=True
    )  # sha256 hex of the secret; the secret itself is never stored
    key_hint: Mapped[str] = mapped_column(String(32))  # the first characters, to tell keys apart in listings
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class FilePurpose(str, enum.Enum):
    batch = "batch"  # a client's batch input
    batch_output = "batch_output"  # a batch's output or error file, written by finalize


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_project_created", "project_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("file-"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(1024))
    purpose: Mapped[FilePurpose] = mapped_column(Enum(FilePurpose, name="file_purpose"))
    bytes: Mapped[int] = mapped_column(BigInteger)
    object_key: Mapped[str] = mapped_column(String(1024))  # relative to the configured S3 prefix
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # None: kept until deleted


class BatchStatus(str, enum.Enum):
    validating = "validating"
    failed = "failed"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    expired = "expired"
    cancelling = "cancelling"
    cancelled = "cancelled"


TERMINAL_BATCH_STATUSES = frozenset(
    {BatchStatus.failed, BatchStatus.completed, BatchStatus.expired, BatchStatus.cancelled}
)


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_project_created", "project_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("batch_"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    # A plain id, not a foreign key: deleting the input file later must not erase the batch's history.
    input_file_id: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    # The engine's scheduling priority for every request of the batch: lower runs first (vLLM's convention).
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Set for batches a schedule created with a webhook: their events go to that endpoint only.
    webhook_endpoint_id: Mapped[str | None] = mapped_column(String(64))
    # A RAG preprocessing job is a batch with endpoint "/v1/rag/jobs": these are its options (RagOptions.to_json()).
    rag_options: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    # The inbox prefix a RAG job's documents were listed from (its input file is that listing); None otherwise.
    input_prefix: Mapped[str | None] = mapped_column(String(1024))
    status: Mapped[BatchStatus] = mapped_column(Enum(BatchStatus, name="batch_status"), default=BatchStatus.validating)
    # The served model's id its lines resolve to (`jobs.served_models`), set by validate from the first line; the name
    # as written when nobody serves it. A RAG job reading pages gets the model that reads them at creation
    # (`jobs.rag.jobs.job_model`). None for jobs bound to no model (other RAG jobs) and before validate.
    model: Mapped[str | None] = mapped_column(String(256))
    # Token usage of the lines answered so far, moved with the counts (`jobs.run.ledger.finish_chunk`).
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")  # of input, prefix cache hits
    output_expires_after_seconds: Mapped[int | None] = mapped_column(Integer)  # output/error files' lifetime
    batch_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", JSONB)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONB)  # batch-level errors (OpenAI's errors.data)
    total_requests: Mapped[int] = mapped_column(Integer, default=0)
    completed_requests: Mapped[int] = mapped_column(Integer, default=0)
    failed_requests: Mapped[int] = mapped_column(Integer, default=0)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Its validate task could not be queued (Redis down when it was created): the recovery sweep sends it.
    validate_unsent: Mapped[bool] = mapped_column(Boolean, default=False, server_default="false")
    # When the recovery sweep last sent a stalled batch's finalize again (`jobs.recovery`), which paces the re-sends.
    finalize_resent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ChunkStatus(str, enum.Enum):
    pending = "pending"
    done = "done"  # its output objects exist and its counts are in the batch's
    skipped = "skipped"  # never ran: the batch was cancelled first
    failed = "failed"  # its task failed every attempt: each of its requests has an error record, none an answer


class Chunk(Base):
    """A byte range of a batch's input file: the unit of work one `run_chunk` task does."""

    __tablename__ = "chunks"

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    byte_start: Mapped[int] = mapped_column(BigInteger)
    byte_end: Mapped[int] = mapped_column(BigInteger)  # exclusive
    first_line: Mapped[int] = mapped_column(Integer)  # 1-based line number of the range's first line
    num_requests: Mapped[int] = mapped_column(Integer)  # valid requests in the range
    # Line numbers in the range that validation already rejected (their error records are written): skipped here.
    rejected_lines: Mapped[list[int]] = mapped_column(JSONB, default=list)
    # The accepted lines' ids (custom_id, document id), in order: their error records when the chunk cannot run
    # need nothing else. None for chunks recorded before migration 0007, whose ids are read from the input.
    request_ids: Mapped[list[str] | None] = mapped_column(JSONB)
    status: Mapped[ChunkStatus] = mapped_column(Enum(ChunkStatus, name="chunk_status"), default=ChunkStatus.pending)
    completed_requests: Mapped[int] = mapped_column(Integer, default=0)
    failed_requests: Mapped[int] = mapped_column(Integer, default=0)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class WebhookEndpoint(Base):
    """Where a project wants batch events POSTed, and the secret that signs them (Standard Webhooks)."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("wh_"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    name: Mapped[str] = mapped_column(String(256))  # OpenAI's endpoints have one; ours default to host and path
    events: Mapped[list[str]] = mapped_column(JSONB)  # event types, e.g. ["batch.completed", "batch.failed"]
    secret: Mapped[str] = mapped_column(String(128))  # "whsec_" + base64; needed in clear to sign
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Last change of url, name, events or secret (OpenAI's updated_at); an update that changes nothing keeps it.
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WebhookEvent(Base):
    """One event about one batch (`batch.completed`, ...): created once, delivered to each subscribed endpoint."""

    __tablename__ = "webhook_events"
    __table_args__ = (UniqueConstraint("batch_id", "type", name="uq_webhook_events_batch_type"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("evt_"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    type: Mapped[str] = mapped_column(String(64))
    batch_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class DeliveryStatus(str, enum.Enum):
    pending = "pending"  # attempts remain
    succeeded = "succeeded"  # an attempt got a 2xx
    failed = "failed"  # every attempt failed


class WebhookDelivery(Base):
    """An event on its way to one endpoint."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("event_id", "endpoint_id", name="uq_webhook_deliveries_event_endpoint"),
        Index("ix_webhook_deliveries_next_attempt_at", "next_attempt_at"),  # the sweep's "what is due"
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("whd_"))
    event_id: Mapped[str] = mapped_column(ForeignKey("webhook_events.id", ondelete="CASCADE"))
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), index=True)
    status: Mapped[DeliveryStatus] = mapped_column(
        Enum(DeliveryStatus, name="delivery_status"), default=DeliveryStatus.pending
    )
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # None once finished
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class WebhookAttempt(Base):
    """One HTTP POST of a delivery: what happened and how long it took."""

    __tablename__ = "webhook_attempts"
    __table_args__ = (UniqueConstraint("delivery_id", "number", name="uq_webhook_attempts_delivery_number"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(ForeignKey("webhook_deliveries.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)  # 1-based
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    latency_ms: Mapped[float] = mapped_column(Float)
    status_code: Mapped[int | None] = mapped_column(Integer)  # None: no HTTP answer (refused, timeout, ...)
    error: Mapped[str | None] = mapped_column(Text)
    succeeded: Mapped[bool] = mapped_column(Boolean)


class Schedule(Base):
    """A recurring batch: at each time the cron expression names (in its time zone), a batch from the template
    (a RAG job when the endpoint is "/v1/rag/jobs")."""

    __tablename__ = "schedules"
    __table_args__ = (
        Index("ix_schedules_project_created", "project_id", "created_at", "id"),
        Index("ix_schedules_next_fire_at", "next_fire_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("sched_"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    cron: Mapped[str] = mapped_column(String(128))  # five fields, e.g. "0 2 * * *"
    timezone: Mapped[str] = mapped_column(String(64))  # IANA name, e.g. "Europe/Paris"
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    # Exactly one of the two: one input file, or every object under an S3 prefix (concatenated) at fire time.
    input_file_id: Mapped[str | None] = mapped_column(String(64))
    input_prefix: Mapped[str | None] = mapped_column(String(1024))
    batch_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", JSONB)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    webhook_endpoint_id: Mapped[str | None] = mapped_column(String(64))
    # A RAG template's options (RagOptions.to_json(), defaults filled in); None for a batch template.
    rag_options: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    paused: Mapped[bool] = mapped_column(Boolean, default=False)
    next_fire_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))  # UTC
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ScheduleFire(Base):
    """The guard that makes each fire time of a schedule create one batch (or RAG job), whatever beats run."""

    __tablename__ = "schedule_fires"

    schedule_id: Mapped[str] = mapped_column(ForeignKey("schedules.id", ondelete="CASCADE"), primary_key=True)
    fire_time: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    batch_id: Mapped[str | None] = mapped_column(String(64))  # or the RAG job's id; None: the fire failed (see error)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class IdempotentRequest(Base):
    """A create request made with an `Idempotency-Key`, and the answer it got: a retry with the same key replays it.

    Kept in PostgreSQL, in the transaction that creates the object, so the object and its key commit together or
    not at all, whatever happens to Redis (down being exactly when clients retry)."""

    __tablename__ = "idempotent_requests"
    __table_args__ = (Index("ix_idempotent_requests_created", "created_at"),)

    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))  # sha256 of the route and the request's parameters
    response: Mapped[dict[str, Any]] = mapped_column(JSONB)  # the body answered the first time (status 200)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
