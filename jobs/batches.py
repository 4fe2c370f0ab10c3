"""Batches as a client sees them: create, read, list, cancel. The work itself is in `jobs.run`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import ColumnElement, Connection, Row, bindparam, exists, select, update
from sqlalchemy.orm import Session

from jobs.batch_limits import check_input_size
from jobs.openai_format.requests import ENDPOINTS
from jobs.errors import ServiceError
from jobs.files import get_file
from jobs.models import Batch, BatchStatus, Chunk, ChunkStatus, File, FilePurpose, plain_columns, utcnow
from jobs.pagination import Page, paginate

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
# Engine scheduling priority of a batch's requests: lower runs first (vLLM's convention); 0 is the default.
MIN_PRIORITY, MAX_PRIORITY = -100, 100
# OpenAI's metadata limits: a client that fits them there fits them here.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# A RAG preprocessing job (`jobs.rag.jobs`) is a batch row with this endpoint: /v1/batches neither lists nor shows it.
RAG_ENDPOINT = "/v1/rag/jobs"
MAX_INPUT_PREFIX_CHARS = 512  # leaves room for the inbox and S3 prefixes within S3's 1,024-byte keys


def create_batch(
    session: Session,
    project_id: str,
    *,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None,
    priority: int = 0,
    window_seconds: float | None = None,
    output_expires_after_seconds: int | None = None,
    max_input_bytes: int | None = None,
) -> Batch:
    """window_seconds: how long the batch may take before it expires (Settings.completion_window_seconds);
    None: the length completion_window names. output_expires_after_seconds: the output and error files' lifetime
    from their creation (OpenAI's `output_expires_after`); None: kept until deleted. max_input_bytes: the largest
    input file taken (`BatchLimits`, refused as OpenAI does); None: any."""
    check_batch_options(endpoint=endpoint, completion_window=completion_window, metadata=metadata)
    check_priority(priority)
    input_file = check_input_file(session, project_id, input_file_id)
    if max_input_bytes is not None:
        check_input_size(input_file.bytes, max_input_bytes)
    return add_batch(
        session,
        Batch(
            project_id=project_id,
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=completion_window,
            priority=priority,
            batch_metadata=metadata,
            output_expires_after_seconds=output_expires_after_seconds,
        ),
        window_seconds,
    )


def add_batch(session: Session, batch: Batch, window_seconds: float | None) -> Batch:
    """Add a checked batch (or RAG job) row as `validating`, its deadline set from its completion window."""
    batch.created_at = utcnow()
    window = COMPLETION_WINDOWS[batch.completion_window] if window_seconds is None else timedelta(seconds=window_seconds)
    batch.expires_at = batch.created_at + window
    batch.status = BatchStatus.validating
    session.add(batch)
    session.flush()
    return batch


def check_batch_options(*, endpoint: str, completion_window: str, metadata: dict[str, str] | None) -> None:
    """What a batch needs besides its input; schedules check their template with it before any batch exists."""
    if endpoint not in ENDPOINTS:
        raise ServiceError(
            "invalid_request", f"endpoint must be one of {list(ENDPOINTS)}, got {endpoint!r}", param="endpoint"
        )
    check_completion_window(completion_window)
    check_metadata(metadata)


def check_completion_window(completion_window: str) -> None:
    if completion_window not in COMPLETION_WINDOWS:
        raise ServiceError(
            "invalid_request",
            f"completion_window must be one of {list(COMPLETION_WINDOWS)}, got {completion_window!r}",
            param="completion_window",
        )


def check_priority(priority: int) -> None:
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ServiceError(
            "invalid_request",
            f"priority must be an integer from {MIN_PRIORITY} (most urgent) to {MAX_PRIORITY}, got {priority}",
            param="priority",
        )


def check_input_file(session: Session, project_id: str, input_file_id: str) -> File:
    input_file = get_file(session, project_id, input_file_id, lock="share")  # not deleted under the new batch
    if input_file.purpose != FilePurpose.batch:
        raise ServiceError(
            "invalid_request",
            f"file {input_file_id} has purpose {input_file.purpose.value!r}; a batch input needs purpose 'batch'",
            param="input_file_id",
        )
    return input_file


def check_one_input(input_file_id: str | None, input_prefix: str | None) -> None:
    """A schedule or RAG job reads one uploaded file or every object under a prefix of the project's inbox."""
    if (input_file_id is None) == (input_prefix is None):
        raise ServiceError(
            "invalid_request", "give exactly one of input_file_id and input_prefix", param="input_file_id"
        )
    if input_prefix is not None:
        check_input_prefix(input_prefix)


def check_input_prefix(prefix: str) -> None:
    """A prefix relative to the project's inbox. S3 keys have no `..`, but refusing such segments (and empty
    ones) keeps prefixes meaning what they look like."""
    segments = prefix.split("/")
    inner_segments, last_segment = segments[:-1], segments[-1]  # the last may be empty: "nightly/" is fine
    if not prefix:
        problem = "must not be empty"
    elif len(prefix) > MAX_INPUT_PREFIX_CHARS:
        problem = f"must be at most {MAX_INPUT_PREFIX_CHARS} characters"
    elif any(ord(char) < 32 or ord(char) == 127 for char in prefix):
        problem = "must not contain control characters"
    elif any(segment in ("", ".", "..") for segment in inner_segments) or last_segment in (".", ".."):
        problem = "must be relative to the project's inbox, with no empty, '.' or '..' segments"
    else:
        return
    raise ServiceError("invalid_request", f"input_prefix {problem}; got {prefix[:80]!r}", param="input_prefix")


def check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ServiceError("invalid_request", f"metadata holds at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise ServiceError(
                "invalid_request",
                f"metadata keys hold at most {MAX_METADATA_KEY_CHARS} characters and values "
                f"{MAX_METADATA_VALUE_CHARS}; {key[:80]!r} is too long",
                param="metadata",
            )


def _of_kind(rag_job: bool) -> ColumnElement[bool]:
    """Batches and RAG jobs share the table; each API sees only its own kind (a RAG job is no batch to /v1/batches)."""
    return Batch.endpoint == RAG_ENDPOINT if rag_job else Batch.endpoint != RAG_ENDPOINT


def _one_of_project(rag_job: bool) -> ColumnElement[bool]:
    """The batch (or RAG job) `:batch_id` of the project `:project_id`."""
    return (Batch.id == bindparam("batch_id")) & (Batch.project_id == bindparam("project_id")) & _of_kind(rag_job)


# What clients poll, built once: constructing the statement costs more than PostgreSQL takes to answer it.
_READ_ONE = {rag_job: select(*plain_columns(Batch)).where(_one_of_project(rag_job)) for rag_job in (False, True)}


def get_batch(reader: Session | Connection, project_id: str, batch_id: str, *, rag_job: bool = False) -> Row[Any]:
    """The batch as a Core row (`plain_columns`): read-only, the polling path."""
    row = reader.execute(_READ_ONE[rag_job], {"batch_id": batch_id, "project_id": project_id}).first()
    if row is None:
        raise _no_such_batch(batch_id, rag_job)
    return row


def _no_such_batch(batch_id: str, rag_job: bool) -> ServiceError:
    kind, param = ("RagJob", "job_id") if rag_job else ("Batch", "batch_id")
    return ServiceError("not_found", f"No such {kind} object: {batch_id}", param=param)


def list_batches(
    reader: Session | Connection,
    project_id: str,
    *,
    after: str | None,
    limit: int,
    rag_job: bool = False,
    status: BatchStatus | None = None,
) -> Page[Row[Any]]:
    """status: only the batches in that status (the console's filter); None: all."""
    filters = [_of_kind(rag_job)] + ([] if status is None else [Batch.status == status])
    return paginate(reader, Batch, project_id, after=after, limit=limit, filters=filters)


def request_cancel(session: Session, project_id: str, batch_id: str, *, rag_job: bool = False) -> tuple[Batch, bool]:
    """Move the batch to `cancelling`. Returns it and whether finalize must be enqueued now: true once its chunks
    exist, since finalize drops the queued ones at once and the running ones call it again when they stop.
    Cancelling again repeats that, so a client retrying a cancel whose enqueue failed gets it done."""
    batch = session.scalar(
        select(Batch).where(_one_of_project(rag_job)).with_for_update(),
        {"batch_id": batch_id, "project_id": project_id},
    )
    if batch is None:
        raise _no_such_batch(batch_id, rag_job)
    if batch.status not in (BatchStatus.validating, BatchStatus.in_progress, BatchStatus.cancelling):
        raise ServiceError(
            "conflict", f"Cannot cancel a batch with status {batch.status.value!r}", code="batch_not_cancellable"
        )
    if batch.status != BatchStatus.cancelling:
        batch.status = BatchStatus.cancelling
        batch.cancelling_at = utcnow()
        session.flush()
    # Before its chunks exist the validate task owns the batch and finishes the cancel itself.
    return batch, batch.in_progress_at is not None


def mark_validate_unsent(session: Session, batch_id: str) -> None:
    """Its validate task could not be queued: the recovery sweep (`jobs.recovery`) sends it once Redis is back."""
    session.execute(update(Batch).where(Batch.id == batch_id).values(validate_unsent=True))


def has_pending_chunks(session: Session, batch_id: str) -> bool:
    return bool(session.scalar(select(exists().where(Chunk.batch_id == batch_id, Chunk.status == ChunkStatus.pending))))
