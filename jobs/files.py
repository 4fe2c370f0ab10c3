"""Files: uploaded batch inputs and the output and error files batches produce. Bytes live in S3."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import ColumnElement, Connection, Row, exists, or_, select
from sqlalchemy.orm import Session

from jobs.db import SessionFactory
from jobs.errors import ServiceError
from jobs.models import TERMINAL_BATCH_STATUSES, Batch, File, FilePurpose, utcnow
from jobs.pagination import Order, Page, paginate
from jobs.storage import ObjectStore

log = logging.getLogger(__name__)

# Only batch inputs are uploaded: OpenAI's other purposes (fine-tune, assistants, vision, user_data, evals) name
# features this service does not have, so they are refused rather than stored for nothing.
UPLOADABLE_PURPOSES = (FilePurpose.batch,)
UPLOAD_FIELDS = ("purpose", "expires_after[anchor]", "expires_after[seconds]")  # the form's text fields
# OpenAI's bounds on `expires_after.seconds` (files and batch outputs): one hour to 30 days.
MIN_EXPIRY_SECONDS, MAX_EXPIRY_SECONDS = 3600, 30 * 24 * 3600
EXPIRED_FILES_PER_SWEEP = 500  # rows one sweep deletes; the next sweep (seconds later) takes the rest


def expiry_seconds(anchor: object, seconds: object, param: str) -> int:
    """OpenAI's `expires_after` ({"anchor": "created_at", "seconds": N}), checked: N seconds after creation."""
    if anchor != "created_at":
        raise ServiceError("invalid_request", f"{param}.anchor must be 'created_at', got {anchor!r}", param=param)
    try:
        value = int(seconds)  # type: ignore[call-overload]  # a form field arrives as text
    except (TypeError, ValueError):
        raise ServiceError("invalid_request", f"{param}.seconds must be an integer, got {seconds!r}", param=param) from None
    if not MIN_EXPIRY_SECONDS <= value <= MAX_EXPIRY_SECONDS:
        raise ServiceError(
            "invalid_request",
            f"{param}.seconds must be between {MIN_EXPIRY_SECONDS} and {MAX_EXPIRY_SECONDS}, got {value}",
            param=param,
        )
    return value


def upload_expiry(fields: Mapping[str, str], created_at: datetime) -> datetime | None:
    """When an upload expires, from its `expires_after[...]` form fields; None: never."""
    if "expires_after[anchor]" not in fields and "expires_after[seconds]" not in fields:
        return None
    seconds = expiry_seconds(fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]"), "expires_after")
    return created_at + timedelta(seconds=seconds)


def _reading() -> ColumnElement[bool]:
    """Batches that may still read their input file: those not ended."""
    return Batch.status.not_in(TERMINAL_BATCH_STATUSES)


def _live() -> ColumnElement[bool]:
    """Files not expired: an expired file is gone for every reader, before the sweep deletes its bytes."""
    return or_(File.expires_at.is_(None), File.expires_at > utcnow())


def parse_upload_purpose(purpose: str | None) -> FilePurpose:
    allowed = [p.value for p in UPLOADABLE_PURPOSES]
    if purpose not in allowed:
        raise ServiceError("invalid_request", f"purpose must be one of {allowed}, got {purpose!r}", param="purpose")
    return FilePurpose(purpose)


def derived_file_id(job_id: str, role: str) -> str:
    """The id of a file a job makes (its output, errors, manifest, a prefix's listing): the same on every attempt,
    so a retried finalize or fire cannot add a twin."""
    return "file-" + hashlib.sha256(f"{job_id}/{role}".encode()).hexdigest()[:24]


def record_file(
    session: Session,
    *,
    file_id: str,
    project_id: str,
    filename: str,
    purpose: FilePurpose,
    size: int,
    object_key: str,
    created_at: datetime | None = None,
    expires_at: datetime | None = None,
) -> File:
    row = File(
        id=file_id,
        project_id=project_id,
        filename=filename,
        purpose=purpose,
        bytes=size,
        object_key=object_key,
        created_at=created_at or utcnow(),
        expires_at=expires_at,
    )
    session.add(row)
    session.flush()
    return row


def get_file(session: Session, project_id: str, file_id: str, *, lock: Literal["share", "update"] | None = None) -> File:
    """The project's live file; `lock` holds its row until the transaction ends (a batch made from it takes a share
    lock, a delete an exclusive one, so neither misses the other)."""
    query = select(File).where(File.id == file_id, File.project_id == project_id, _live())
    if lock is not None:
        query = query.with_for_update(read=lock == "share")
    row = session.scalar(query)
    if row is None:
        raise ServiceError("not_found", f"No such File object: {file_id}", param="file_id")
    return row


def list_files(
    reader: Session | Connection, project_id: str, *, after: str | None, limit: int, order: Order, purpose: str | None
) -> Page[Row[Any]]:
    filters = [_live()]
    if purpose is not None:
        if purpose not in FilePurpose.__members__:
            raise ServiceError("invalid_request", f"unknown purpose {purpose!r}", param="purpose")
        filters.append(File.purpose == FilePurpose(purpose))
    return paginate(reader, File, project_id, after=after, limit=limit, order=order, filters=filters)


def delete_file(session: Session, store: ObjectStore, project_id: str, file_id: str) -> None:
    """Delete the file's row, then its bytes; refused (409 `file_in_use`) while a batch that reads it has not ended:
    its chunks read their lines from the file while they run."""
    row = get_file(session, project_id, file_id, lock="update")
    reader = session.execute(
        select(Batch.id, Batch.status).where(Batch.input_file_id == file_id, _reading()).limit(1)
    ).first()
    if reader is not None:
        raise ServiceError(
            "conflict",
            f"file {file_id} is the input of batch {reader.id}, which is {reader.status.value}: a running batch reads "
            "its input until it ends; delete the file once the batch has ended, or cancel the batch first",
            param="file_id",
            code="file_in_use",
        )
    session.delete(row)
    # The row goes first: a crash between the two leaves an orphaned object, never a row without bytes.
    session.commit()
    store.delete(row.object_key)


def delete_expired_files(sessions: SessionFactory, store: ObjectStore) -> int:
    """Beat's sweep: expired files' rows, then their objects (a crash between leaves an orphan object, never a row
    without bytes). Returns how many were deleted."""
    with sessions.begin() as session:
        expired = session.scalars(
            select(File)
            # The input of a batch still running is kept until the batch ends (it is gone for readers already).
            .where(File.expires_at <= utcnow(), ~exists().where(Batch.input_file_id == File.id, _reading()))
            .limit(EXPIRED_FILES_PER_SWEEP)
            .with_for_update(skip_locked=True)
        ).all()
        keys = [row.object_key for row in expired]
        for row in expired:
            session.delete(row)
    for key in keys:
        store.delete(key)
    if keys:
        log.info("deleted %d expired files", len(keys))
    return len(keys)
