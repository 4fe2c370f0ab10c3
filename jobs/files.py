"""Files: uploaded batch inputs and the output and error files batches produce. Bytes live in S3."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from jobs.errors import ServiceError
from jobs.models import File, FilePurpose
from jobs.pagination import Order, Page, paginate
from jobs.storage import ObjectStore

UPLOADABLE_PURPOSES = (FilePurpose.batch,)


def parse_upload_purpose(purpose: str | None) -> FilePurpose:
    allowed = [p.value for p in UPLOADABLE_PURPOSES]
    if purpose not in allowed:
        raise ServiceError("invalid_request", f"purpose must be one of {allowed}, got {purpose!r}", param="purpose")
    return FilePurpose(purpose)


def record_file(
    session: Session, *, file_id: str, project_id: str, filename: str, purpose: FilePurpose, size: int, object_key: str
) -> File:
    row = File(id=file_id, project_id=project_id, filename=filename, purpose=purpose, bytes=size, object_key=object_key)
    session.add(row)
    session.flush()
    return row


def get_file(session: Session, project_id: str, file_id: str) -> File:
    row = session.scalar(select(File).where(File.id == file_id, File.project_id == project_id))
    if row is None:
        raise ServiceError("not_found", f"No such File object: {file_id}", param="file_id")
    return row


def list_files(
    session: Session, project_id: str, *, after: str | None, limit: int, order: Order, purpose: str | None
) -> Page[File]:
    filters = []
    if purpose is not None:
        if purpose not in FilePurpose.__members__:
            raise ServiceError("invalid_request", f"unknown purpose {purpose!r}", param="purpose")
        filters.append(File.purpose == FilePurpose(purpose))
    return paginate(session, File, project_id, after=after, limit=limit, order=order, filters=filters)


def delete_file(session: Session, store: ObjectStore, project_id: str, file_id: str) -> None:
    row = get_file(session, project_id, file_id)
    session.delete(row)
    # The row goes first: a crash between the two leaves an orphaned object, never a row without bytes.
    session.commit()
    store.delete(row.object_key)
