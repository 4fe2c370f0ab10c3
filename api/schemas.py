"""Request and response bodies, shaped like OpenAI's Files and Batches objects."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from jobs.models import Batch, File

ItemT = TypeVar("ItemT")


def _unix(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None

    @classmethod
    def of(cls, row: File) -> "FileObject":
        return cls(
            id=row.id,
            bytes=row.bytes,
            created_at=int(row.created_at.timestamp()),
            filename=row.filename,
            purpose=row.purpose.value,
        )


class DeletedFile(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class ListPage(BaseModel, Generic[ItemT]):
    object: Literal["list"] = "list"
    data: list[ItemT]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, data: list[ItemT], has_more: bool) -> "ListPage[ItemT]":
        ids = [getattr(item, "id") for item in data]
        return cls(data=data, first_id=ids[0] if ids else None, last_id=ids[-1] if ids else None, has_more=has_more)


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchErrorEntry(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorEntry]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = Field(default=None)

    @classmethod
    def of(cls, row: Batch) -> "BatchObject":
        errors: list[dict[str, Any]] | None = row.errors
        return cls(
            id=row.id,
            endpoint=row.endpoint,
            errors=BatchErrors(data=[BatchErrorEntry(**entry) for entry in errors]) if errors else None,
            input_file_id=row.input_file_id,
            completion_window=row.completion_window,
            status=row.status.value,
            output_file_id=row.output_file_id,
            error_file_id=row.error_file_id,
            created_at=int(row.created_at.timestamp()),
            in_progress_at=_unix(row.in_progress_at),
            expires_at=_unix(row.expires_at),
            finalizing_at=_unix(row.finalizing_at),
            completed_at=_unix(row.completed_at),
            failed_at=_unix(row.failed_at),
            expired_at=_unix(row.expired_at),
            cancelling_at=_unix(row.cancelling_at),
            cancelled_at=_unix(row.cancelled_at),
            request_counts=RequestCounts(
                total=row.total_requests, completed=row.completed_requests, failed=row.failed_requests
            ),
            metadata=row.batch_metadata,
        )
