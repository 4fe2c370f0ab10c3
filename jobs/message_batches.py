"""Anthropic's Message Batches: a second face of the batch store (one lifecycle, two object shapes).

A Message Batch is a batch row with endpoint `/v1/messages` and an id starting `msgbatch_`. Its requests arrive
inline (`{"custom_id", "params"}`); creation writes them as an ordinary batch input file of `/v1/messages` lines,
so validate, the chunks, the ledger, expiry, cancel, webhooks and tenancy are the OpenAI batches' own, and the
engine answers each line through the Anthropic format (`jobs.formats.anthropic_messages`). What differs is how the
batch is shown (`processing_status`, `request_counts`) and its results: one line per request, read from the output
and error files once the batch has ended: `succeeded` with the message, `errored` with Anthropic's error shape,
`expired` for a request its batch's expiry left unrun, and `canceled` for one a cancel left unrun.

Anthropic's limits hold, each a setting: at most 100,000 requests and 256 MB of them in one batch, refused at
creation; a custom_id is 1 to 64 letters, digits, `_` or `-`, unique in its batch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import ColumnElement, Connection, Row, select
from sqlalchemy.orm import Session

from jobs.batch_limits import MessageBatchLimits
from jobs.batches import add_batch, request_cancel
from jobs.errors import ServiceError
from jobs.files import record_file
from jobs.formats.anthropic_messages import MESSAGES
from jobs.models import Batch, BatchStatus, File, FilePurpose, new_id, plain_columns
from jobs.object_keys import file_key
from jobs.pagination import Page, paginate
from jobs.storage import ObjectNotFound, ObjectStore

CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
ID_PREFIX = "msgbatch_"
COMPLETION_WINDOW = "24h"  # Anthropic's batches end within 24 hours, as OpenAI's window says
ENDED = (BatchStatus.completed, BatchStatus.failed, BatchStatus.cancelled, BatchStatus.expired)
ProcessingStatus = Literal["in_progress", "canceling", "ended"]
# An error record's code as Anthropic's error type: the request's fault unless the service failed it
ERROR_TYPES = {
    "model_not_found": "not_found_error",
    "request_too_large": "request_too_large",
    "generation_failed": "api_error",
    "generation_aborted": "api_error",
    "chunk_failed": "api_error",
}


@dataclass(frozen=True)
class RequestCounts:
    processing: int
    succeeded: int
    errored: int
    canceled: int
    expired: int


def create_message_batch(
    session: Session,
    store: ObjectStore,
    project_id: str,
    requests: Sequence[dict[str, Any]],
    limits: MessageBatchLimits,
    window_seconds: float | None,
) -> Batch:
    """The batch, `in_progress` to its client (validating to the pipeline, which the caller starts): its requests
    are written as the input file's `/v1/messages` lines first (a crash after leaves an orphan object, no row)."""
    if not requests:
        raise ServiceError("invalid_request", "requests: at least one request is required", param="requests")
    if len(requests) > limits.max_requests:
        raise ServiceError(
            "invalid_request",
            f"requests: a Message Batch holds at most {limits.max_requests} requests, got {len(requests)}",
            param="requests",
        )
    lines = _input_lines(requests)
    size = sum(len(line) for line in lines)
    if size > limits.max_bytes:
        raise ServiceError(
            "too_large", f"the batch's requests take {size} bytes, over the limit of {limits.max_bytes}", param="requests"
        )
    batch_id = new_id(ID_PREFIX)
    file_id = new_id("file-")
    key = file_key(project_id, file_id)
    store.put_bytes(key, b"".join(lines))
    record_file(
        session,
        file_id=file_id,
        project_id=project_id,
        filename=f"{batch_id}_requests.jsonl",
        purpose=FilePurpose.batch,
        size=size,
        object_key=key,
    )
    batch = Batch(
        id=batch_id,
        project_id=project_id,
        input_file_id=file_id,
        endpoint=MESSAGES,
        completion_window=COMPLETION_WINDOW,
        total_requests=len(requests),  # validate counts them again, to the same number
    )
    return add_batch(session, batch, window_seconds)


def _input_lines(requests: Sequence[dict[str, Any]]) -> list[bytes]:
    seen: set[str] = set()
    lines = []
    for index, request in enumerate(requests):
        if not isinstance(request, dict) or set(request) != {"custom_id", "params"}:
            raise ServiceError(
                "invalid_request", f"requests.{index}: a request is exactly {{custom_id, params}}", param="requests"
            )
        custom_id, params = request["custom_id"], request["params"]
        if not isinstance(custom_id, str) or CUSTOM_ID.fullmatch(custom_id) is None:
            raise ServiceError(
                "invalid_request",
                f"requests.{index}.custom_id: 1 to 64 letters, digits, '_' or '-', got {custom_id!r}",
                param="requests",
            )
        if custom_id in seen:
            raise ServiceError(
                "invalid_request", f"requests.{index}.custom_id: {custom_id!r} is used by an earlier request", param="requests"
            )
        seen.add(custom_id)
        if not isinstance(params, dict):
            raise ServiceError("invalid_request", f"requests.{index}.params: must be an object", param="requests")
        line = {"custom_id": custom_id, "method": "POST", "url": MESSAGES, "body": params}
        lines.append(json.dumps(line, ensure_ascii=False).encode() + b"\n")
    return lines


def _message_batches_of(project_id: str) -> ColumnElement[bool]:
    return (Batch.project_id == project_id) & (Batch.endpoint == MESSAGES)


def get_message_batch(reader: Session | Connection, project_id: str, batch_id: str) -> Row[Any]:
    row = reader.execute(select(*plain_columns(Batch)).where(_message_batches_of(project_id), Batch.id == batch_id)).first()
    if row is None:
        raise _not_found(batch_id)
    return row


def _not_found(batch_id: str) -> ServiceError:
    return ServiceError("not_found", f"No Message Batch {batch_id!r} in this workspace", param="message_batch_id")


def list_message_batches(
    reader: Session | Connection, project_id: str, *, before_id: str | None, after_id: str | None, limit: int
) -> Page[Row[Any]]:
    """Newest first, as Anthropic lists them; `after_id` pages to older batches, `before_id` to newer ones."""
    if before_id is not None and after_id is not None:
        raise ServiceError("invalid_request", "give at most one of before_id and after_id", param="before_id")
    mine = [Batch.endpoint == MESSAGES]
    if before_id is None:
        return paginate(reader, Batch, project_id, after=after_id, limit=limit, filters=mine)
    newer = paginate(reader, Batch, project_id, after=before_id, limit=limit, order="asc", filters=mine)
    return Page(rows=newer.rows[::-1], has_more=newer.has_more)


def cancel_message_batch(session: Session, project_id: str, batch_id: str) -> tuple[Batch, bool]:
    """As `jobs.batches.request_cancel`; an ended batch is shown as it is (Anthropic's cancel is idempotent)."""
    get_message_batch(session, project_id, batch_id)
    batch = session.get(Batch, batch_id)
    assert batch is not None
    if batch.status in ENDED:
        return batch, False
    return request_cancel(session, project_id, batch_id)


def delete_message_batch(session: Session, store: ObjectStore, project_id: str, batch_id: str) -> None:
    """An ended batch and its files (requests, results); one still processing must be canceled first."""
    get_message_batch(session, project_id, batch_id)
    batch = session.get(Batch, batch_id, with_for_update=True)
    assert batch is not None
    if batch.status not in ENDED:
        raise ServiceError(
            "invalid_request",
            f"Message Batch {batch_id} is still processing; cancel it, and delete it once it has ended",
            param="message_batch_id",
        )
    file_ids = [file_id for file_id in (batch.input_file_id, batch.output_file_id, batch.error_file_id) if file_id]
    owned = list(session.scalars(select(File).where(File.project_id == project_id, File.id.in_(file_ids))))
    for row in owned:
        session.delete(row)
    session.delete(batch)  # its chunks go with it
    # The rows go first: a crash between leaves orphaned objects, never a row without bytes.
    session.commit()
    for row in owned:
        store.delete(row.object_key)


def processing_status(status: BatchStatus) -> ProcessingStatus:
    if status in ENDED:
        return "ended"
    return "canceling" if status == BatchStatus.cancelling else "in_progress"


def ended_at(row: Row[Any] | Batch) -> datetime | None:
    return row.completed_at or row.failed_at or row.cancelled_at or row.expired_at


def request_counts(row: Row[Any] | Batch) -> RequestCounts:
    """Anthropic's tallies: all `processing` until the batch ends. A failed batch's requests all errored; the requests
    a cancel (or the expiry) left unrun are `canceled` (`expired`). Requests that expiry stopped midway have an error
    record, and are counted among `errored` here (their result line says `expired`)."""
    total = row.total_requests
    if row.status not in ENDED:
        return RequestCounts(processing=total, succeeded=0, errored=0, canceled=0, expired=0)
    if row.status == BatchStatus.failed:
        succeeded = row.completed_requests
        return RequestCounts(processing=0, succeeded=succeeded, errored=total - succeeded, canceled=0, expired=0)
    unrun = total - row.completed_requests - row.failed_requests
    return RequestCounts(
        processing=0,
        succeeded=row.completed_requests,
        errored=row.failed_requests,
        canceled=unrun if row.status == BatchStatus.cancelled else 0,
        expired=unrun if row.status == BatchStatus.expired else 0,
    )


def result_lines(store: ObjectStore, row: Row[Any]) -> Iterator[bytes]:
    """The ended batch's results, one JSON line per request: its answers, its errors, then the requests that never
    ran (`canceled` or `expired`, or, in a batch that failed as a whole, `errored` with the batch's error). Refused
    here, before any line is read, while the batch has not ended."""
    if row.status not in ENDED:
        raise ServiceError(
            "invalid_request", f"Message Batch {row.id} has not ended yet: its results are not ready", param="message_batch_id"
        )
    return _results(store, row)


def _results(store: ObjectStore, row: Row[Any]) -> Iterator[bytes]:
    answered: set[str] = set()
    for file_id in (row.output_file_id, row.error_file_id):
        for record in _records(store, row.project_id, file_id):
            answered.add(record["custom_id"])
            yield _line(record["custom_id"], _result(record))
    if row.status == BatchStatus.failed:
        errors = row.errors or [{"message": "the batch failed"}]
        unrun: dict[str, Any] = _errored("api_error", errors[0]["message"])
    else:
        unrun = {"type": "canceled" if row.status == BatchStatus.cancelled else "expired"}
    for record in _records(store, row.project_id, row.input_file_id):
        if record["custom_id"] not in answered:
            yield _line(record["custom_id"], unrun)


def _records(store: ObjectStore, project_id: str, file_id: str | None) -> Iterator[dict[str, Any]]:
    if file_id is None:
        return
    pending = b""
    try:
        for block in store.open_stream(file_key(project_id, file_id)):
            pending += block
            *complete, pending = pending.split(b"\n")
            yield from (json.loads(line) for line in complete if line.strip())
    except ObjectNotFound:
        return
    if pending.strip():
        yield json.loads(pending)


def _result(record: dict[str, Any]) -> dict[str, Any]:
    """An output or error record (OpenAI's Batch output line) as Anthropic's result."""
    if record.get("response") is not None:
        return {"type": "succeeded", "message": record["response"]["body"]}
    error = record["error"]
    if error["code"] == "batch_expired":
        return {"type": "expired"}
    return _errored(ERROR_TYPES.get(error["code"], "invalid_request_error"), error["message"])


def _errored(error_type: str, message: str) -> dict[str, Any]:
    return {"type": "errored", "error": {"type": "error", "error": {"type": error_type, "message": message}}}


def _line(custom_id: str, result: dict[str, Any]) -> bytes:
    return json.dumps({"custom_id": custom_id, "result": result}, ensure_ascii=False).encode() + b"\n"
