"""Batches as a client sees them: create, read, list, cancel. The work itself is in `jobs.pipeline`."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from jobs.batch_format import ENDPOINTS
from jobs.errors import ServiceError
from jobs.files import get_file
from jobs.models import Batch, BatchStatus, Chunk, ChunkStatus, FilePurpose, utcnow
from jobs.pagination import Page, paginate

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
# OpenAI's metadata limits: a client that fits them there fits them here.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def create_batch(
    session: Session,
    project_id: str,
    *,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None,
) -> Batch:
    if endpoint not in ENDPOINTS:
        raise ServiceError(
            "invalid_request", f"endpoint must be one of {list(ENDPOINTS)}, got {endpoint!r}", param="endpoint"
        )
    if completion_window not in COMPLETION_WINDOWS:
        raise ServiceError(
            "invalid_request",
            f"completion_window must be one of {list(COMPLETION_WINDOWS)}, got {completion_window!r}",
            param="completion_window",
        )
    _check_metadata(metadata)
    input_file = get_file(session, project_id, input_file_id)
    if input_file.purpose != FilePurpose.batch:
        raise ServiceError(
            "invalid_request",
            f"file {input_file_id} has purpose {input_file.purpose.value!r}; a batch input needs purpose 'batch'",
            param="input_file_id",
        )
    now = utcnow()
    batch = Batch(
        project_id=project_id,
        input_file_id=input_file_id,
        endpoint=endpoint,
        completion_window=completion_window,
        status=BatchStatus.validating,
        batch_metadata=metadata,
        created_at=now,
        expires_at=now + COMPLETION_WINDOWS[completion_window],
    )
    session.add(batch)
    session.flush()
    return batch


def _check_metadata(metadata: dict[str, str] | None) -> None:
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


def get_batch(session: Session, project_id: str, batch_id: str, *, for_update: bool = False) -> Batch:
    query = select(Batch).where(Batch.id == batch_id, Batch.project_id == project_id)
    batch = session.scalar(query.with_for_update() if for_update else query)
    if batch is None:
        raise ServiceError("not_found", f"No such Batch object: {batch_id}", param="batch_id")
    return batch


def list_batches(session: Session, project_id: str, *, after: str | None, limit: int) -> Page[Batch]:
    return paginate(session, Batch, project_id, after=after, limit=limit)


def request_cancel(session: Session, project_id: str, batch_id: str) -> tuple[Batch, bool]:
    """Move the batch to `cancelling`. Returns it and whether finalize must be enqueued now: true when no chunk
    is left to notice the cancel (otherwise the last chunk task to finish or skip enqueues it)."""
    batch = get_batch(session, project_id, batch_id, for_update=True)
    if batch.status == BatchStatus.cancelling:
        return batch, False
    if batch.status not in (BatchStatus.validating, BatchStatus.in_progress):
        raise ServiceError(
            "conflict", f"Cannot cancel a batch with status {batch.status.value!r}", code="batch_not_cancellable"
        )
    was_validating = batch.status == BatchStatus.validating
    batch.status = BatchStatus.cancelling
    batch.cancelling_at = utcnow()
    session.flush()
    # While validating, the validate task owns the batch and finishes the cancel itself.
    return batch, not was_validating and not has_pending_chunks(session, batch_id)


def has_pending_chunks(session: Session, batch_id: str) -> bool:
    return bool(session.scalar(select(exists().where(Chunk.batch_id == batch_id, Chunk.status == ChunkStatus.pending))))
